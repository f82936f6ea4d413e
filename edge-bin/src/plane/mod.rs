//! Per-request policy and records, shared by every shard: who a caller is
//! and what it may do ([`client_keys`]), the credential leases it takes
//! ([`credentials`], C1–C5), how much it may use ([`limits`]; its token
//! budgets, [`budgets`], kept on disk by [`budget_file`]), what was done
//! (the access log, [`access`]; the usage file, [`usage`]; the request
//! series of `/metrics`, [`request_metrics`]), this Edge's place in a cluster ([`cluster`]), and
//! the running configuration the shards read per request ([`running`]),
//! and the trace of a request (`[tracing]`, [`tracing`]).

pub mod access;
pub mod budget_file;
pub mod budgets;
pub mod client_keys;
pub mod cluster;
pub mod credentials;
pub mod limits;
pub mod request_metrics;
pub mod running;
pub mod tracing;
pub mod usage;
