//! etcd's v3 API over its JSON gateway (`/v3/...`), for the Edge.
//!
//! The sans-IO half is [`codec`].

pub mod codec;

pub use codec::{
    CodecError, EventKind, Kv, LeaseGrant, LeaseId, RangeAnswer, WatchEvent, WatchMessage,
};
