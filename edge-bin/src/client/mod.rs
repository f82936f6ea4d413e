//! The client HTTP shell: the request loop and routes ([`router`]), one
//! inference request from body to relay (`pipeline`), the relays (`relay`),
//! the connection and its early answers (`conn`), the inference routes
//! (`routes`),
//! operator commands ([`admin`]), `/status` ([`status`]), `/metrics`
//! ([`metrics`]) and the `/ui` status page ([`ui`]).

pub mod admin;
mod conn;
pub mod metrics;
mod pipeline;
mod relay;
pub mod router;
mod routes;
pub mod status;
pub mod ui;
