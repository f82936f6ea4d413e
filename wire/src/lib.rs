//! # iop-wire — the Edge–Node wire layer
//!
//! Everything that crosses the one mutually-authenticated TLS connection between
//! an Edge and a Node, and nothing that does IO:
//!
//! ```text
//!  bytes from TLS ──► FrameDecoder::decode ──► pb::Frame (Bytes fields are slices
//!                     (length prefix, cap        of the read buffer, no copy)
//!                      checked before alloc)
//!  pb::Frame ──► codec::encode ──► caller's BytesMut ──► TLS
//!  tunnel body ──► codec::BodyFrameHead (prefix only) + the body Bytes as-is
//! ```
//!
//! - [`pb`]: prost types generated at build time from `proto/iop/runtime.proto`
//!   by the pure-Rust `protox` compiler (no system `protoc`; generated code is
//!   never checked in or edited, X3).
//! - [`codec`]: the length-delimited frame codec (T1).
//! - [`close`]: [`CloseReason`], why a frame connection closed — the one
//!   list of close reasons the transport, the Edge and the Node use.
//! - [`checks`]: pure value checks the contract fixes (W1 stall timeout, S2
//!   reconnect policy).
//! - [`lease`]: managed credential leases (C1–C5): canonical binding digest,
//!   sealing/signing at the Edge, verifying/opening at the Node, replay window;
//!   time and randomness are inputs.
//! - [`embedding`]: an embeddings run's vectors on `RunEvent.embeddings`
//!   (packed little-endian `f32`).
//! - [`flow`]: per-run flow control windows (charged bytes, absolute credit).
//! - [`limits`]: transport constants (T4 heartbeat timers, frame size cap).
//! - [`profile`]: protocol profile lookups both sides share (U3).
//!
//! Invariant: no function here panics on bytes from a peer; every decode error
//! is typed.

#![forbid(unsafe_code)]

pub mod checks;
pub mod close;
pub mod codec;
pub mod embedding;
pub mod flow;
pub mod lease;
pub mod limits;
pub mod profile;

/// Generated protobuf types of package `iop.runtime` (X3: never edited).
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/iop.runtime.rs"));
}

pub use close::CloseReason;
pub use codec::{encode, DecodeError, EncodeError, FrameDecoder, Inbound, TunnelChunk};
