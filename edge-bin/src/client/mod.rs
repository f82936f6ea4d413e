//! The client HTTP shell: the request loop and routes ([`router`]), one
//! inference request from body to relay (`pipeline`), the relays (`relay`),
//! embeddings on an Ollama provider (`embeddings`),
//! the caller's key and limit checks (`caller`), forwarding to the Edge
//! that owns a model's nodes in a cluster (`forward`), the connection and
//! its early answers (`conn`), the inference endpoints
//! (`endpoints`: each one's path, operation and error shape), operator
//! commands ([`admin`]), `/status` ([`status`]), `/metrics`
//! ([`metrics`]) and the `/ui` status page ([`ui`]).

pub mod admin;
mod attempt;
mod caller;
mod conn;
mod embeddings;
mod endpoints;
mod forward;
pub mod metrics;
mod pipeline;
mod relay;
pub mod router;
pub mod status;
pub mod ui;
mod upload;
