//! # edge-bin — the IOP Edge gateway
//!
//! Faces clients with an OpenAI-compatible HTTP API and Nodes with one mTLS
//! frame connection each. The authoritative state (registry, generations,
//! leases) is the sans-IO [`control::Control`]; the shells around it only move
//! bytes.
//!
//! ```text
//!  clients ──HTTP──► client ──submit──► link ──input──► Control ◄── register/ready/close ── nodes
//!     ▲                │                 │ ◄──actions──┘                                   ▲
//!     └── chunks ◄── relay ◄── reply ◄── link (tunnel frames, H1: by connection) ───────────┘
//! ```
//!
//! The rooms, one way down (a room uses only the rooms below it):
//!
//! - [`server`]: wiring — binds the listeners of every shard, the accept
//!   loops and their caps ([`server::front_door`]), SIGHUP reloads.
//! - [`client`]: the client HTTP shell — the request loop, routes, the
//!   relays, `/admin`, `/status`, `/metrics`, the `/ui` page.
//! - [`cluster`]: this Edge as one of several sharing a fleet through etcd
//!   (`[cluster]`) — its lease and fence deadline, ownership claims and the
//!   watch ([`cluster::member`]), the etcd client ([`cluster::etcd`]).
//! - [`link`]: the node side and the shards — node connections, the
//!   per-shard [`link::edge::Edge`] that carries out Control's actions, the
//!   per-request replies, mailboxes between shards, pending node commands.
//! - [`plane`]: per-request policy and records — client keys and credential
//!   leases, per-key and per-address limits, the access log, the usage file,
//!   the request series of `/metrics`.
//! - [`control`]: the sans-IO state machine — registry, admission, leases,
//!   failover, passive health, views; the commit point of an attempt.
//! - [`api`]: the client-facing shapes — OpenAI/Anthropic errors and
//!   requests, request bodies as the client's bytes, run translation.
//! - [`config`]: `edge.toml`, parsed and validated.

#![forbid(unsafe_code)]

pub mod api;
pub mod client;
pub mod cluster;
pub mod config;
pub mod control;
pub mod link;
pub mod plane;
pub mod server;
