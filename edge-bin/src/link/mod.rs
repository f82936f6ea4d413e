//! The node side and the shards: node connections ([`nodes`]) and their
//! places among the handshakes in progress ([`handshake`]), the
//! per-shard shell state that carries out Control's actions ([`edge`]),
//! commands sent to nodes and waiting for their answer ([`commands`]), the
//! nodes' `/metrics` series ([`node_metrics`]), the shells' static settings
//! ([`settings`]), and
//! the mailboxes that carry requests, frames and lifecycle steps between
//! shards ([`shards`]).

pub mod commands;
pub mod edge;
pub mod handshake;
pub mod node_metrics;
pub mod nodes;
pub mod settings;
pub mod shards;
