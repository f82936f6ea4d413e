//! # bench — IOP's load harness and mock providers
//!
//! The `bench` binary's subcommands live here as library modules so tests
//! (and other crates' tests) can use them in-process:
//!
//! - [`mock`]: `bench mock-provider`, an OpenAI-compatible mock inference
//!   server with deterministic content and configurable pacing, used by the
//!   demo, the end-to-end tests and the load harness.
//!
//! ```text
//! client ──HTTP/1.1──► mock::server (monoio shell, iop_engine::http)
//!                         │ method, path, body
//!                         ▼
//!                      mock::openai::MockProvider (pure: Reply / StreamPlan)
//! ```

#![forbid(unsafe_code)]

pub mod mock;
