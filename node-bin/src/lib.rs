//! # node-bin — the IOP Node daemon
//!
//! Runs on a GPU host, dials *out* to the Edge over one mutually-authenticated
//! TLS connection, registers, applies the config the Edge pushes, and serves
//! provider tunnels against local inference servers.
//!
//! ```text
//! supervisor (dial, redial: S1–S3)
//!   └─ session (register → apply config → ready: R2, R3; F5 on disconnect)
//!        └─ tunnel per request (W1 check, capacity gate P4, provider HTTP,
//!           ordered RESPONSE_START/BODY*/END|ERROR frames: U1, U2)
//! ```
//!
//! Exit codes: 0 after SIGTERM/SIGINT; 1 for bad configuration, unreadable
//! credentials, or exhausted reconnect attempts (S3).

pub mod adapters;
pub mod config;
pub mod emit;
pub mod session;
pub mod supervisor;
pub mod tunnel;
