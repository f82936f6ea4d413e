//! More than one Edge (see `docs/multi-edge.md`): the pieces that let
//! Edges share a fleet through etcd.
//!
//! - [`member`]: the cluster shell on the control shard — this Edge's
//!   lease, Control's ownership claims and releases carried to etcd, and
//!   the watch of the cluster's keys fed back to Control.
//! - [`fleet`]: the cluster's fleet in etcd (sans-IO) — which fleet an
//!   Edge runs, when it publishes its file's, and whether a published one
//!   fits its own file.
//! - [`etcd`]: a small etcd v3 client over the JSON gateway on monoio, and
//!   its sans-IO codec ([`etcd::codec`]).
//! - [`route`]: where a request for a model is served — here, or
//!   forwarded to a peer with a free slot, or to the Edge that owns its
//!   nodes (sans-IO).
//! - [`summaries`]: what each Edge has free per model — this Edge's own
//!   summary from Control, its peers' polled over the peer listener.
//! - [`session`]: the Edge's one etcd lease as a sans-IO state machine —
//!   when to keep it alive, and the fence deadline after which the Edge
//!   must stop acting as the owner of anything attached to it.

pub mod etcd;
pub mod fleet;
pub mod member;
pub mod route;
pub mod session;
pub mod summaries;
