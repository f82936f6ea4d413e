//! Transport constants, in one place (T1, T4, W1).
//!
//! The heartbeat timers are transport constants, not user configuration (T4);
//! tests shorten them through the engine's test-only override, never here.

use std::time::Duration;

/// Each side sends a `Heartbeat` this often (T4).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(30);

/// A connection whose peer has not answered a heartbeat for this long is
/// closed with reason [`crate::CloseReason::HeartbeatTimeout`] (T4).
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(45);

/// Default maximum size of one encoded `Frame`, excluding the 4-byte length
/// prefix (T1).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 * 1024 * 1024;

/// Size of the big-endian `u32` length prefix in front of every frame.
pub const LENGTH_PREFIX_BYTES: usize = 4;

/// Node default for `response_stall_timeout_ms = 0` (W1).
pub const DEFAULT_RESPONSE_STALL_TIMEOUT_MS: i64 = 300_000;
