//! More than one Edge (see `docs/multi-edge.md`): the pieces that let
//! Edges share a fleet through etcd.
//!
//! - [`member`]: the cluster shell on the control shard — this Edge's
//!   lease, Control's ownership claims and releases carried to etcd, and
//!   the watch of the cluster's keys fed back to Control.
//! - [`etcd`]: a small etcd v3 client over the JSON gateway on monoio, and
//!   its sans-IO codec ([`etcd::codec`]).
//! - [`route`]: where a request for a model is served — here, or
//!   forwarded to the Edge that owns its nodes (sans-IO).
//! - [`session`]: the Edge's one etcd lease as a sans-IO state machine —
//!   when to keep it alive, and the fence deadline after which the Edge
//!   must stop acting as the owner of anything attached to it.

pub mod etcd;
pub mod member;
pub mod route;
pub mod session;
