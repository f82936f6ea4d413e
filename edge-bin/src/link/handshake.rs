//! A node connection's place among the TLS handshakes in progress: its
//! permit under `edge.max_node_handshakes` (and its peer's under
//! `edge.max_node_handshakes_per_peer`), its deadlines, and the per-peer
//! throttle of handshake failure logs. The accept loop
//! ([`crate::server::front_door`]) makes one per connection; the node
//! connection shell ([`super::nodes`]) gives it back when the handshake
//! ends.

use std::cell::RefCell;
use std::net::IpAddr;
use std::rc::Rc;
use std::time::Duration;

use iop_engine::clock;
use iop_engine::metrics::{self as engine_metrics, Count};
use iop_engine::net::{Gate, LogThrottle, PeerPermit, Permit};

/// A peer address logs a failed or timed-out node handshake at most once
/// per this interval.
pub const HANDSHAKE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Peer addresses the handshake log throttle remembers per core.
pub const HANDSHAKE_LOG_MAX_PEERS: usize = 4096;

/// A node connection's place among the handshakes in progress, its
/// deadline, and the shared per-peer log throttle.
pub struct HandshakeSlot {
    permit: Permit,
    /// The place under the peer's handshake cap (`None`: no peer address).
    peer_place: Option<PeerPermit>,
    /// `edge.node_handshake_timeout_ms`.
    pub timeout: Duration,
    /// `edge.node_first_byte_timeout_ms` (at most `timeout`).
    pub first_byte_timeout: Duration,
    log: Rc<RefCell<LogThrottle<IpAddr>>>,
}

impl std::fmt::Debug for HandshakeSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeSlot")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// How a node's TLS handshake ended, when it did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// No byte arrived within the first-byte deadline.
    NoFirstByte,
    /// The deadline passed first.
    TimedOut,
    /// The peer failed it (bad certificate, wrong identity, not TLS, gone).
    Rejected,
}

impl HandshakeSlot {
    /// The slot of a connection accepted under `permit` (and `peer_place`
    /// of its peer), with its deadlines and the shard's log throttle.
    pub fn new(
        permit: Permit,
        peer_place: Option<PeerPermit>,
        timeout: Duration,
        first_byte_timeout: Duration,
        log: Rc<RefCell<LogThrottle<IpAddr>>>,
    ) -> Self {
        Self {
            permit,
            peer_place,
            timeout,
            first_byte_timeout,
            log,
        }
    }

    /// A slot outside any accept loop (tests, plain-TCP dev mode): its own
    /// one-place gate.
    pub fn standalone(timeout: Duration) -> Self {
        Self {
            permit: Gate::new(1).try_enter().expect("a fresh gate has room"),
            peer_place: None,
            timeout,
            first_byte_timeout: timeout,
            log: Rc::new(RefCell::new(LogThrottle::new(
                HANDSHAKE_LOG_INTERVAL,
                HANDSHAKE_LOG_MAX_PEERS,
            ))),
        }
    }

    /// Records the end of the handshake (counted; a failure logged at most
    /// once per peer address per [`HANDSHAKE_LOG_INTERVAL`]) and frees the
    /// place for the next handshake.
    pub fn finish(self, peer: Option<IpAddr>, failure: Option<(HandshakeFailure, String)>) {
        engine_metrics::add(Count::EdgeNodeHandshakesEnded, 1);
        let Some((failure, error)) = failure else {
            return;
        };
        engine_metrics::add(
            match failure {
                HandshakeFailure::NoFirstByte => Count::EdgeNodeFirstByteTimeouts,
                HandshakeFailure::TimedOut => Count::EdgeNodeHandshakeTimeouts,
                HandshakeFailure::Rejected => Count::EdgeNodeHandshakeFailures,
            },
            1,
        );
        let ip = peer.unwrap_or(IpAddr::from([0, 0, 0, 0]));
        let Some(suppressed) = self.log.borrow_mut().check(ip, clock::now()) else {
            return;
        };
        match failure {
            HandshakeFailure::NoFirstByte => tracing::warn!(
                peer = %ip,
                first_byte_timeout_ms =
                    u64::try_from(self.first_byte_timeout.as_millis()).unwrap_or(u64::MAX),
                suppressed,
                "node connection sent nothing (no TLS ClientHello) in time; closed"
            ),
            HandshakeFailure::TimedOut => tracing::warn!(
                peer = %ip,
                timeout_ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
                suppressed,
                "node TLS handshake timed out; connection closed"
            ),
            HandshakeFailure::Rejected => tracing::warn!(
                peer = %ip,
                %error,
                suppressed,
                "node connection rejected in the TLS handshake"
            ),
        }
    }

    /// Frees the place without counting a handshake (plain-TCP dev mode).
    pub fn release(self) {
        drop(self.permit);
        drop(self.peer_place);
    }
}
