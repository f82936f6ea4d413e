//! The client HTTP shell: the request loop and routes ([`surface`]),
//! operator commands ([`admin`]), `/status` ([`status`]), `/metrics`
//! ([`metrics`]) and the `/ui` status page ([`ui`]).

pub mod admin;
pub mod metrics;
pub mod status;
pub mod surface;
pub mod ui;
