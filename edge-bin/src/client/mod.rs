//! The client HTTP shell: the request loop and routes ([`router`]), one
//! inference request from body to relay (`pipeline`), the relays (`relay`),
//! the connection and its early answers (`conn`), the inference endpoints
//! (`endpoints`: each one's path, operation and error shape), operator
//! commands ([`admin`]), `/status` ([`status`]), `/metrics`
//! ([`metrics`]) and the `/ui` status page ([`ui`]).

pub mod admin;
mod conn;
mod endpoints;
mod forward;
pub mod metrics;
mod pipeline;
mod relay;
pub mod router;
pub mod status;
pub mod ui;
