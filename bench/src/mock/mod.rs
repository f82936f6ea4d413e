//! `bench mock-provider`: an OpenAI-compatible mock inference server.
//!
//! [`openai`] is the pure core (routing, request parsing, every response
//! byte, the stream plan); [`server`] is the monoio shell that accepts
//! connections, reads requests with `iop_engine::http` and writes what the
//! core decides, pacing streamed tokens with timers.

pub mod openai;
pub mod server;

pub use openai::{HealthState, MockConfig, MockFaults, MockStats};
pub use server::{ready_line, run, run_with, serve, serve_with, ServeError};
