//! More than one Edge (see `docs/multi-edge.md`): the pieces that let
//! Edges share a fleet through etcd.
//!
//! - [`etcd`]: the sans-IO codec of etcd's v3 JSON gateway
//!   ([`etcd::codec`]).
//! - [`session`]: the Edge's one etcd lease as a sans-IO state machine —
//!   when to keep it alive, and the fence deadline after which the Edge
//!   must stop acting as the owner of anything attached to it.
//!
//! Nothing here is wired into the Edge yet.

pub mod etcd;
pub mod session;
