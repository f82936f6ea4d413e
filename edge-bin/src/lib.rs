//! # edge-bin — the IOP Edge gateway
//!
//! Faces clients with an OpenAI-compatible HTTP API and Nodes with one mTLS
//! frame connection each. The authoritative state (registry, generations,
//! leases) is the sans-IO [`control::Control`]; the shells around it only move
//! bytes.
//!
//! ```text
//!  clients ──HTTP──► surface ──select──► Control ◄──register/ready/close── nodes
//!     ▲                 │                   │ lease                       ▲
//!     └── chunks ◄── relay ◄── route ◄── tunnel frames (H1: by connection) ┘
//! ```
//!
//! Modules: [`config`] (edge.toml), [`control`] (the state machine),
//! [`openai`] (surface shapes), [`surface`] (client HTTP shell), [`nodes`]
//! (node connection shell), [`state`] (shell tables), [`status`] (`/status`),
//! [`metrics`] and [`request_metrics`] (`/metrics`),
//! [`server`] (wiring and listeners), [`shards`] (the Edge across cores:
//! Control on shard 0, mailboxes between shards), [`credentials`] (client
//! keys and credential leases, C1–C5), [`attempt`] (the commit point of an
//! attempt, shared by the node and client shells), [`outlier`] (passive
//! health of one provider) and [`ui`] (the `/ui` status page).

pub mod access;
pub mod admin;
pub mod attempt;
pub mod body_json;
pub mod config;
pub mod control;
pub mod credentials;
pub mod front_door;
pub mod limits;
pub mod metrics;
pub mod nodes;
pub mod openai;
pub mod outlier;
pub mod request_metrics;
pub mod server;
pub mod shards;
pub mod state;
pub mod status;
pub mod surface;
pub mod translate;
pub mod ui;
pub mod usage;
