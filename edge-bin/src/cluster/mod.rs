//! More than one Edge (see `docs/multi-edge.md`): the pieces that let
//! Edges share a fleet through etcd.
//!
//! - [`etcd`]: a small etcd v3 client over the JSON gateway on monoio, and
//!   its sans-IO codec ([`etcd::codec`]).
//! - [`route`]: where a request for a model is served — here, or
//!   forwarded to the Edge that owns its nodes (sans-IO).
//! - [`session`]: the Edge's one etcd lease as a sans-IO state machine —
//!   when to keep it alive, and the fence deadline after which the Edge
//!   must stop acting as the owner of anything attached to it.
//!
//! Nothing here is wired into the Edge yet.

pub mod etcd;
pub mod member;
pub mod route;
pub mod session;
