//! The frame connection both Edge and Node run over their one TLS connection
//! (T1, T4).
//!
//! ```text
//!                 ┌──────────────────── ConnCore (sans-IO, `now` passed in) ───────────────────┐
//!  send_control ─►│ control lane (bounded; overflow closes) ──┐                                │
//!  send_bulk   ──►│ bulk lane (bounded; full = backpressure) ─┴► poll_transmit: control first  │─► writer task
//!  send_body_frame│                                              (heartbeat acks never wait    │   coalesces small frames,
//!                 │ heartbeats: send every interval, answer at    behind tunnel bodies, T4)    │   bodies as-is (writev)
//!                 │ once, close on `heartbeat_timeout`                                         │
//!  ConnEvents ◄───│ handle_frame: heartbeats/acks/Close consumed, the rest delivered           │◄─ reader task
//!   Frame | Chunk │ (`ConnConfig::chunks`: plain BODY frames as `TunnelChunk`s, no message)    │
//!                 └────────────────────────────────────────────────────────────────────────────┘   (one, never cancelled)
//! ```
//!
//! - [`ConnCore`] holds every decision: the two lanes, heartbeat bookkeeping,
//!   the close state machine. It reads no clock and does no IO, so its tests
//!   drive it with a manual clock.
//! - [`spawn_conn`] is the shell: exactly one reader task (never cancelled:
//!   a cancelled io_uring read can lose bytes), one writer task and one
//!   timer task on the current monoio runtime. Closing unblocks the reader by
//!   shutting the socket down from outside ([`SocketShutdown`]). Over TLS the
//!   halves are [`crate::tls::TlsStream::into_split`]'s, whose reader never
//!   writes (monoio-rustls' split panics when a peer's alert arrives during
//!   a write).
//! - [`spawn_conn_handled`] is the same shell with the reader handing each
//!   frame to the application's handler as it decodes it, instead of
//!   queueing it for [`ConnEvents`]; [`ConnClosed`] brings the close. No
//!   queue and no second task per frame. The Edge's node links use it; the
//!   handler gets a [`ConnRef`], which can close the connection and does
//!   not keep it open.
//!
//! ## Close state machine
//!
//! ```text
//!   Open ──close(reason) / protocol error / heartbeat_timeout──► Closing ──Close frame written
//!    │      (a `Close{reason}` frame is queued last)              │        or linger elapsed──► Closed
//!    └──peer EOF / peer Close / io error────────────────────────────────────────────────────► Closed
//! ```
//!
//! Sends fail with [`SendError::Closed`] from `Closing` on. On `Closed` the
//! shell shuts the socket down; the application then receives exactly one
//! [`ConnEvent::Closed`], after every frame received before the close. The
//! reason is an [`iop_wire::CloseReason`]; an io error's reason names a TLS
//! failure ([`io_error_reason`]): a peer's fatal alert is `tls_alert:<alert>`.
//!
//! ## Heartbeat rule (T4)
//!
//! Each side sends `Heartbeat{seq}` every interval (30 s) whatever else flows,
//! and answers a peer heartbeat at once with `HeartbeatAck{seq}` on the control
//! lane. Only a `HeartbeatAck` answers a heartbeat: other frames from the peer
//! do not count, because an ack is the one proof that the peer both reads our
//! frames and can still get a control frame past its own bulk backlog. When
//! the oldest unanswered heartbeat is 45 s old the connection closes with
//! reason `heartbeat_timeout`. An ack for `seq` answers every heartbeat up to
//! `seq`.

mod core;
mod segments;
mod shell;

use std::time::Duration;

use iop_wire::limits::{DEFAULT_MAX_FRAME_BYTES, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT};
use iop_wire::CloseReason;

pub use self::core::{ConnCore, ConnStats, OutFrame, TrySendError};
pub use self::shell::{
    spawn_conn, spawn_conn_handled, ConnClosed, ConnEvent, ConnEvents, ConnHandle, ConnRef,
    PushBulk, SocketShutdown,
};

/// The close reason for a failed socket read or write: a TLS failure is
/// named ([`CloseReason::TlsAlert`], [`CloseReason::TlsError`]), anything
/// else is [`CloseReason::IoError`] with the error's kind.
pub fn io_error_reason(err: &std::io::Error) -> CloseReason {
    match crate::tls::rustls_cause(err) {
        Some(rustls::Error::AlertReceived(alert)) => {
            CloseReason::TlsAlert(crate::tls::alert_name(*alert))
        }
        Some(_) => CloseReason::TlsError,
        None => CloseReason::IoError(err.kind()),
    }
}

/// Environment variable of the test-only heartbeat override:
/// `IOP_TEST_HEARTBEAT_MS=<interval_ms>:<timeout_ms>`.
pub const HEARTBEAT_OVERRIDE_ENV: &str = "IOP_TEST_HEARTBEAT_MS";

/// Shortest heartbeat interval or timeout accepted (values below are raised).
const HEARTBEAT_MIN: Duration = Duration::from_millis(1);
/// Longest heartbeat interval or timeout accepted (values above are lowered),
/// so deadline arithmetic can never overflow.
const HEARTBEAT_MAX: Duration = Duration::from_secs(24 * 60 * 60);

/// A frame could not be queued for sending.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The connection is closing or closed; nothing more is sent.
    #[error("connection closed")]
    Closed,
    /// The encoded frame exceeds the maximum frame size (T1).
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Encoded frame length in bytes (without the length prefix).
        len: usize,
        /// Configured maximum in bytes.
        max: usize,
    },
}

impl From<iop_wire::EncodeError> for SendError {
    fn from(err: iop_wire::EncodeError) -> Self {
        match err {
            iop_wire::EncodeError::FrameTooLarge { len, max } => {
                SendError::FrameTooLarge { len, max }
            }
        }
    }
}

/// The test-only heartbeat override value could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeartbeatOverrideError {
    /// The value is not `<interval_ms>:<timeout_ms>`.
    #[error("expected <interval_ms>:<timeout_ms>, got {0:?}")]
    Format(String),
    /// A number is not a positive integer of milliseconds.
    #[error("{0:?} is not a positive number of milliseconds")]
    Millis(String),
}

/// Connection settings. The heartbeat timers are transport constants (T4);
/// only tests change them, through [`ConnConfig::with_heartbeat_timers`] or
/// [`ConnConfig::from_env_override`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnConfig {
    heartbeat_interval: Duration,
    heartbeat_timeout: Duration,
    /// Largest frame accepted from the peer and sent to it, in bytes,
    /// excluding the 4-byte length prefix (T1).
    pub max_frame_bytes: usize,
    /// Frames the control lane holds before the connection closes with
    /// [`CloseReason::ControlLaneOverflow`].
    pub control_lane_max_frames: usize,
    /// Frames the bulk lane holds before senders wait.
    pub bulk_lane_max_frames: usize,
    /// Encoded bytes the bulk lane holds before senders wait (one frame is
    /// always admitted into an empty lane, whatever its size).
    pub bulk_lane_max_bytes: usize,
    /// Received frames buffered for the application before the reader stops
    /// reading (backpressure to the peer through TCP). Unused when a handler
    /// takes the frames ([`spawn_conn_handled`]).
    pub event_queue_max_frames: usize,
    /// How long a closing connection may take to write its queued frames and
    /// its `Close` frame before the socket is shut down regardless.
    pub close_linger: Duration,
    /// Bytes one write gathers at most (many small frames become one write).
    pub write_batch_max_bytes: usize,
    /// Tunnel bodies up to this size are copied next to their head in the
    /// coalescing buffer; larger bodies are written as they are, without a
    /// copy. Copying a few hundred bytes costs less than the extra TLS record
    /// and write a separate segment costs.
    pub body_copy_max_bytes: usize,
    /// Hand relayed chunks' frames (tunnel `BODY` frames with nothing but
    /// a body) to the application as [`ConnEvent::Chunk`], slices of the
    /// read buffer with no frame built (the Edge's node links, where every
    /// token is one); off, they come as the [`ConnEvent::Frame`]s they are.
    pub chunks: bool,
}

impl Default for ConnConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval: HEARTBEAT_INTERVAL,
            heartbeat_timeout: HEARTBEAT_TIMEOUT,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            control_lane_max_frames: 256,
            bulk_lane_max_frames: 1024,
            bulk_lane_max_bytes: 8 * 1024 * 1024,
            event_queue_max_frames: 256,
            close_linger: Duration::from_secs(1),
            write_batch_max_bytes: 64 * 1024,
            body_copy_max_bytes: 512,
            chunks: false,
        }
    }
}

impl ConnConfig {
    /// **Test only.** Replaces the transport heartbeat timers (30 s / 45 s,
    /// T4). Values are clamped to 1 ms ..= 24 h.
    pub fn with_heartbeat_timers(mut self, interval: Duration, timeout: Duration) -> Self {
        self.heartbeat_interval = interval.clamp(HEARTBEAT_MIN, HEARTBEAT_MAX);
        self.heartbeat_timeout = timeout.clamp(HEARTBEAT_MIN, HEARTBEAT_MAX);
        self
    }

    /// The default configuration, with the heartbeat timers taken from the
    /// **test-only** environment variable [`HEARTBEAT_OVERRIDE_ENV`]
    /// (`IOP_TEST_HEARTBEAT_MS=<interval_ms>:<timeout_ms>`) when it is set.
    /// End-to-end tests use it to shorten T4's timers in real processes; a
    /// warning is logged whenever it takes effect, and an unparsable value is
    /// logged and ignored.
    pub fn from_env_override() -> Self {
        let config = Self::default();
        let Some(value) = std::env::var_os(HEARTBEAT_OVERRIDE_ENV) else {
            return config;
        };
        let value = value.to_string_lossy();
        match parse_heartbeat_override(&value) {
            Ok((interval, timeout)) => {
                tracing::warn!(
                    interval_ms = interval.as_millis() as u64,
                    timeout_ms = timeout.as_millis() as u64,
                    "{HEARTBEAT_OVERRIDE_ENV} is set: test-only heartbeat timers in effect"
                );
                config.with_heartbeat_timers(interval, timeout)
            }
            Err(err) => {
                tracing::warn!("ignoring {HEARTBEAT_OVERRIDE_ENV}: {err}");
                config
            }
        }
    }

    /// How often a heartbeat is sent.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
    }

    /// How long a heartbeat may stay unanswered before the connection closes.
    pub fn heartbeat_timeout(&self) -> Duration {
        self.heartbeat_timeout
    }
}

/// Parses the test-only override `<interval_ms>:<timeout_ms>` (both positive).
pub fn parse_heartbeat_override(
    value: &str,
) -> Result<(Duration, Duration), HeartbeatOverrideError> {
    let (interval, timeout) = value
        .trim()
        .split_once(':')
        .ok_or_else(|| HeartbeatOverrideError::Format(value.to_owned()))?;
    Ok((parse_positive_ms(interval)?, parse_positive_ms(timeout)?))
}

fn parse_positive_ms(text: &str) -> Result<Duration, HeartbeatOverrideError> {
    match text.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(HeartbeatOverrideError::Millis(text.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_timers_are_the_transport_constants() {
        // CONTRACT: T4
        let config = ConnConfig::default();
        assert_eq!(config.heartbeat_interval(), Duration::from_secs(30));
        assert_eq!(config.heartbeat_timeout(), Duration::from_secs(45));
    }

    #[test]
    fn heartbeat_override_parses_interval_and_timeout() {
        assert_eq!(
            parse_heartbeat_override("50:150"),
            Ok((Duration::from_millis(50), Duration::from_millis(150)))
        );
        assert_eq!(
            parse_heartbeat_override(" 20 : 2000 "),
            Ok((Duration::from_millis(20), Duration::from_millis(2000)))
        );
    }

    #[test]
    fn heartbeat_override_rejects_bad_values() {
        assert_eq!(
            parse_heartbeat_override("50"),
            Err(HeartbeatOverrideError::Format("50".to_owned()))
        );
        assert_eq!(
            parse_heartbeat_override("0:150"),
            Err(HeartbeatOverrideError::Millis("0".to_owned()))
        );
        assert_eq!(
            parse_heartbeat_override("50:abc"),
            Err(HeartbeatOverrideError::Millis("abc".to_owned()))
        );
    }

    #[test]
    fn heartbeat_timers_are_clamped() {
        let config = ConnConfig::default().with_heartbeat_timers(Duration::ZERO, Duration::MAX);
        assert_eq!(config.heartbeat_interval(), HEARTBEAT_MIN);
        assert_eq!(config.heartbeat_timeout(), HEARTBEAT_MAX);
    }
}
