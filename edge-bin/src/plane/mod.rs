//! Per-request policy and records, shared by every shard: who a caller is
//! and what it may do ([`client_keys`]), the credential leases it takes
//! ([`credentials`], C1–C5), how much it may use ([`limits`]), what was done (the access log,
//! [`access`]; the usage file, [`usage`]; the request series of `/metrics`,
//! [`request_metrics`]), and this Edge's place in a cluster ([`cluster`]).

pub mod access;
pub mod client_keys;
pub mod cluster;
pub mod credentials;
pub mod limits;
pub mod request_metrics;
pub mod usage;
