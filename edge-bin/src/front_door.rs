//! The front door: the accept loops of both listeners and the limits that
//! keep hostile or clumsy peers from holding the Edge's sockets and memory.
//!
//! ```text
//! client listener ─ Gate(max_client_connections / cores) ─► accept ─► surface::serve
//!                    at the cap: stop accepting (the kernel backlog holds new
//!                    connections until one closes); every read has a deadline
//! node listener   ─ Gate(max_node_handshakes / cores) ─► accept ─► nodes::serve
//!                    the permit is held for the TLS handshake only, which has
//!                    its own deadline; a reconnect burst waits in the backlog
//! ```
//!
//! Why stop accepting rather than accept and refuse, on both listeners: a
//! refused connection costs a descriptor, a task and (for TLS) most of a
//! handshake before it is turned away, exactly when the Edge is busiest,
//! and the refused peer retries at once. Connections left in the backlog
//! cost a few hundred bytes of kernel memory, are served in arrival order as
//! room frees up, and a fleet of nodes reconnecting together after an Edge
//! restart registers as fast as handshakes complete instead of failing and
//! backing off. Once the backlog itself is full the kernel drops new SYNs
//! and clients retransmit them: the standard, self-pacing overload signal.
//!
//! The caps are process-wide numbers split evenly over the cores (each
//! core's accept loop has its own gate: no cross-core traffic per accept).

use std::cell::RefCell;
use std::net::IpAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use iop_engine::clock;
use iop_engine::http::{Linger, ServerTimeouts};
use iop_engine::metrics::{self as engine_metrics, Count};
use iop_engine::net::{Gate, LogThrottle, Permit};
use iop_engine::tls::EdgeTlsAcceptor;
use monoio::net::{TcpListener, TcpStream};

use crate::config::ListenerLimits;
use crate::state::Edge;
use crate::{nodes, surface};

/// A peer address logs a failed or timed-out node handshake at most once
/// per this interval.
pub const HANDSHAKE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Peer addresses the handshake log throttle remembers per core.
const HANDSHAKE_LOG_MAX_PEERS: usize = 4096;

/// After a failed `accept()` (e.g. out of descriptors), wait this long
/// before the next.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);

/// How often the heap trimmer looks for closed connections.
pub const TRIM_INTERVAL: Duration = Duration::from_secs(5);

/// Client connections closed on any core since the heap trimmer last ran.
static CLOSED_SINCE_TRIM: AtomicU64 = AtomicU64::new(0);

/// One core's share of a process-wide cap (at least one).
pub fn per_core(limit: u64, cores: usize) -> usize {
    let cores = cores.max(1) as u64;
    usize::try_from(limit.div_ceil(cores).max(1)).unwrap_or(usize::MAX)
}

/// The deadlines of a client connection: its reads, and its response
/// writes (`write_stall`: `edge.client_write_stall_timeout_ms`).
pub fn client_timeouts(limits: &ListenerLimits, write_stall: Duration) -> ServerTimeouts {
    ServerTimeouts {
        keep_alive_idle: Duration::from_millis(limits.client_keep_alive_timeout_ms),
        head: Duration::from_millis(limits.client_head_timeout_ms),
        body_idle: Duration::from_millis(limits.client_body_idle_timeout_ms),
        write_stall: Some(write_stall),
    }
}

/// The lingering close after an early answer; `None` when disabled
/// (`client_linger_time_ms = 0`).
pub fn client_linger(limits: &ListenerLimits) -> Option<Linger> {
    (limits.client_linger_time_ms > 0).then(|| Linger {
        time: Duration::from_millis(limits.client_linger_time_ms),
        idle: Duration::from_millis(limits.client_linger_idle_timeout_ms),
        max_bytes: limits.client_linger_max_bytes,
    })
}

/// A pause at a cap logs at most once per this interval (each pause is
/// counted).
pub const PAUSE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Accepts on `listener` forever, each connection holding a place of
/// `gate` (handed to `serve` with it): at the cap the loop stops accepting
/// until a place frees up, counting each pause in `paused` and logging it
/// at most once per [`PAUSE_LOG_INTERVAL`]. `what` names the cap in logs.
async fn gated_accept_loop(
    listener: TcpListener,
    gate: Gate,
    paused: Count,
    what: &str,
    mut serve: impl FnMut(TcpStream, Permit),
) {
    let mut log = LogThrottle::new(PAUSE_LOG_INTERVAL, 1);
    loop {
        let permit = match gate.try_enter() {
            Some(permit) => permit,
            None => {
                engine_metrics::add(paused, 1);
                if let Some(suppressed) = log.check((), clock::now()) {
                    tracing::warn!(
                        limit = gate.limit(),
                        suppressed,
                        "{what} cap reached on this core; new connections wait in the accept backlog"
                    );
                }
                gate.enter().await
            }
        };
        match iop_engine::http::accept(&listener).await {
            Ok((tcp, _)) => serve(tcp, permit),
            Err(e) => {
                tracing::warn!(error = %e, "{what}: accept failed");
                drop(permit);
                monoio::time::sleep(ACCEPT_RETRY_DELAY).await;
            }
        }
    }
}

/// Accepts client connections forever, at most this core's share of
/// `edge.max_client_connections` open at once.
pub async fn serve_clients(edge: Rc<Edge>, listener: TcpListener) {
    let limits = edge.settings.limits;
    let gate = Gate::new(per_core(limits.max_client_connections, edge.shard_count()));
    let serve = |tcp, permit| {
        engine_metrics::add(Count::EdgeClientConnectionsAccepted, 1);
        // The connection's own future is the task (wrapped, it would hold
        // the socket a second time).
        monoio::spawn(surface::serve(
            edge.clone(),
            tcp,
            OpenConnection { _permit: permit },
        ));
    };
    let paused = Count::EdgeClientAcceptPaused;
    gated_accept_loop(listener, gate, paused, "client connection", serve).await;
}

/// A client connection's place under the cap; counts the close.
struct OpenConnection {
    _permit: Permit,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        engine_metrics::add(Count::EdgeClientConnectionsClosed, 1);
        CLOSED_SINCE_TRIM.fetch_add(1, Ordering::Relaxed);
    }
}

/// Returns the heap pages freed by closed client connections to the OS:
/// every [`TRIM_INTERVAL`], if any connection closed meanwhile, one
/// `malloc_trim` (for every core's arena; run it on one core). Their read
/// buffers are small allocations that fragment the heaps, which glibc does
/// not give back on its own (5,000 idle keep-alive connections left 60 MiB
/// behind after they closed; see `iop_engine::memory`).
pub async fn trim_heaps() -> ! {
    loop {
        monoio::time::sleep(TRIM_INTERVAL).await;
        if CLOSED_SINCE_TRIM.swap(0, Ordering::Relaxed) > 0 {
            iop_engine::memory::trim();
        }
    }
}

/// Accepts node connections forever, at most this core's share of
/// `edge.max_node_handshakes` in their TLS handshake at once.
pub async fn serve_nodes(
    edge: Rc<Edge>,
    listener: TcpListener,
    acceptor: Option<Rc<EdgeTlsAcceptor>>,
) {
    let limits = edge.settings.limits;
    let gate = Gate::new(per_core(limits.max_node_handshakes, edge.shard_count()));
    let log = Rc::new(RefCell::new(LogThrottle::new(
        HANDSHAKE_LOG_INTERVAL,
        HANDSHAKE_LOG_MAX_PEERS,
    )));
    let timeout = Duration::from_millis(limits.node_handshake_timeout_ms);
    let serve = |tcp, permit| {
        let handshake = HandshakeSlot {
            permit,
            timeout,
            log: log.clone(),
        };
        monoio::spawn(nodes::serve(edge.clone(), tcp, acceptor.clone(), handshake));
    };
    let paused = Count::EdgeNodeAcceptPaused;
    gated_accept_loop(listener, gate, paused, "node handshake", serve).await;
}

/// A node connection's place among the handshakes in progress, its
/// deadline, and the shared per-peer log throttle.
pub struct HandshakeSlot {
    permit: Permit,
    /// `edge.node_handshake_timeout_ms`.
    pub timeout: Duration,
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
    /// The deadline passed first.
    TimedOut,
    /// The peer failed it (bad certificate, wrong identity, not TLS, gone).
    Rejected,
}

impl HandshakeSlot {
    /// A slot outside any accept loop (tests, plain-TCP dev mode): its own
    /// one-place gate.
    pub fn standalone(timeout: Duration) -> Self {
        Self {
            permit: Gate::new(1).try_enter().expect("a fresh gate has room"),
            timeout,
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_split_evenly_over_cores_rounding_up() {
        assert_eq!(per_core(4096, 1), 4096);
        assert_eq!(per_core(4096, 3), 1366);
        assert_eq!(per_core(1, 4), 1);
        assert_eq!(per_core(10, 0), 10);
    }

    #[test]
    fn limits_map_to_connection_timeouts_and_linger() {
        let limits = ListenerLimits::default();
        assert_eq!(
            client_timeouts(&limits, Duration::from_secs(30)),
            ServerTimeouts {
                keep_alive_idle: Duration::from_secs(60),
                head: Duration::from_secs(10),
                body_idle: Duration::from_secs(30),
                write_stall: Some(Duration::from_secs(30)),
            }
        );
        assert_eq!(
            client_linger(&limits),
            Some(Linger {
                time: Duration::from_secs(30),
                idle: Duration::from_secs(5),
                max_bytes: 128 * 1024 * 1024,
            })
        );
        let off = ListenerLimits {
            client_linger_time_ms: 0,
            ..limits
        };
        assert_eq!(client_linger(&off), None);
    }
}
