//! The node side and the shards: node connections ([`nodes`]) and their
//! places among the handshakes in progress ([`handshake`]), the
//! per-shard shell state that carries out Control's actions ([`edge`]),
//! the per-request replies between node connections and clients
//! ([`replies`]), the observers of Control's events ([`observers`]), the
//! shutdown drain ([`drain`]), the ownership claims queued for etcd in a
//! cluster ([`ownership`]), commands sent to nodes and waiting for their
//! answer ([`commands`]), the nodes' `/metrics` series ([`node_metrics`],
//! cached per shard in [`node_metrics_cache`]), the shells' static settings
//! ([`settings`]), the mailboxes that carry requests, frames and lifecycle
//! steps between shards ([`shards`]) and what a shard does with them
//! ([`mesh`]).

pub mod commands;
pub mod drain;
pub mod edge;
pub mod handshake;
pub mod mesh;
pub mod node_metrics;
pub mod node_metrics_cache;
pub mod nodes;
pub mod observers;
pub mod ownership;
pub mod replies;
pub mod settings;
pub mod shards;
