//! The front door: the accept loops of both listeners and the limits that
//! keep hostile or clumsy peers from holding the Edge's sockets and memory.
//!
//! ```text
//! client listener ─ Gate(max_client_connections / cores) ─► accept ─► PeerLimit ─► surface::serve
//!                    at the cap: close the longest-idle keep-alive        │ over: 429
//!                    connection for a new one, else stop accepting (the   │ too_many_connections
//!                    kernel backlog holds new connections until one closes);
//!                    every read has a deadline, a body a minimum rate
//! node listener   ─ Gate(max_node_handshakes / cores) ─► accept ─► PeerLimit ─► first byte ─► nodes::serve
//!                    the permit is held for the TLS handshake only,   │ over: close   (node_first_byte_timeout_ms)
//!                    which has its own deadline; a reconnect burst
//!                    waits in the backlog
//! ```
//!
//! One peer address (IPv6: its `/64`) holds at most
//! `edge.max_client_connections_per_peer` client connections and
//! `edge.max_node_handshakes_per_peer` node handshakes, counted for the
//! whole process ([`crate::plane::limits::PeerLimits`]): a few sockets from one host can fill
//! neither listener. A node connection must send its first byte (the TLS
//! ClientHello) within `edge.node_first_byte_timeout_ms`, far sooner than
//! the handshake deadline, so silent sockets give their handshake places
//! back quickly.
//!
//! At `max_client_connections` a kept-alive connection waiting for its
//! next request is worth less than a new client: when a new connection
//! arrives, the core's longest-idle connection ([`IdleConnections`]) is
//! closed to admit it, as nginx does when it runs out of connections. Only
//! connections waiting for a next request are taken, never one with a
//! request in flight or whose next request has begun to arrive.
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
//!
//! The peer listener of a cluster member (`[cluster] peer_listen`) takes
//! other Edges' forwarded requests, one connection per request in flight:
//! it shares the client connection cap's size (its own gate) but has no
//! per-peer cap (a handful of Edge addresses carry every forwarded
//! request), and every connection must complete an mTLS handshake as an
//! Edge of the trust domain within `edge.client_head_timeout_ms`.

use std::cell::RefCell;
use std::net::IpAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Duration;

use iop_engine::clock;
use iop_engine::metrics::{self as engine_metrics, Count};
use iop_engine::net::{DeadlineRef, Gate, LogThrottle, PeerPermit, Permit, Wait};
use iop_engine::tls::EdgeTlsAcceptor;
use monoio::net::{TcpListener, TcpStream};
use slab::Slab;

use crate::link::edge::Edge;
use crate::link::handshake::{HandshakeSlot, HANDSHAKE_LOG_INTERVAL, HANDSHAKE_LOG_MAX_PEERS};
use crate::{client::router, link::nodes};

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

/// The client connections of one core, for reclaiming the longest-idle
/// one at the connection cap. Each entry is a weak handle on a
/// connection's deadline, which says whether it waits for a next request
/// and since when (its keep-alive deadline: the earliest is the longest
/// idle, all having the same timeout).
#[derive(Debug, Default)]
pub struct IdleConnections {
    conns: RefCell<Slab<DeadlineRef>>,
}

impl IdleConnections {
    /// Registers a connection; the key removes it.
    fn add(&self, deadline: DeadlineRef) -> usize {
        self.conns.borrow_mut().insert(deadline)
    }

    fn remove(&self, key: usize) {
        self.conns.borrow_mut().try_remove(key);
    }

    /// Closes the longest-idle connection that waits for its next request
    /// with no byte of it arrived; true when one was closed. One pass over
    /// the core's connections (at most its share of the cap), only when
    /// the cap is reached and a new connection is there.
    pub fn reclaim_longest_idle(&self) -> bool {
        let mut idle: Vec<(std::time::Instant, DeadlineRef)> = self
            .conns
            .borrow()
            .iter()
            .filter_map(|(_, d)| match d.armed() {
                Some((Wait::Idle, at)) => Some((at, d.clone())),
                _ => None,
            })
            .collect();
        idle.sort_by_key(|(at, _)| *at);
        let now = clock::now();
        idle.into_iter()
            .any(|(_, d)| d.cut_off_if_waiting(Wait::Idle, now))
    }
}

/// A pause at a cap logs at most once per this interval (each pause is
/// counted).
pub const PAUSE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Accepts on `listener` forever, each connection holding a place of
/// `gate` (handed to `serve` with it): at the cap the loop stops accepting
/// until a place frees up, counting each pause in `paused` and logging it
/// at most once per [`PAUSE_LOG_INTERVAL`]. `what` names the cap in logs.
///
/// With `idle` (the client listener), a new connection waiting at the cap
/// makes room: the core's longest-idle keep-alive connection is closed
/// for it ([`wait_for_place`]).
async fn gated_accept_loop(
    listener: TcpListener,
    gate: Gate,
    paused: Count,
    what: &str,
    idle: Option<&IdleConnections>,
    mut serve: impl FnMut(TcpStream, Option<IpAddr>, Permit),
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
                wait_for_place(&gate, &listener, idle).await
            }
        };
        match iop_engine::http::accept(&listener).await {
            Ok((tcp, addr)) => serve(tcp, Some(addr.ip()), permit),
            Err(e) => {
                tracing::warn!(error = %e, "{what}: accept failed");
                drop(permit);
                monoio::time::sleep(ACCEPT_RETRY_DELAY).await;
            }
        }
    }
}

/// While a new connection waits at the cap and none of this core's
/// connections is idle, how often the accept loop looks again (a request
/// that ends leaves its connection idle).
const RECLAIM_RETRY: Duration = Duration::from_millis(50);

/// A place of the full `gate`: the next one that frees up, or, with
/// `idle`, one made for a connection waiting in the backlog by closing the
/// longest-idle keep-alive connection (counted). Without a waiting
/// connection nothing is closed: an idle connection is worth keeping until
/// someone needs its place.
async fn wait_for_place(
    gate: &Gate,
    listener: &TcpListener,
    idle: Option<&IdleConnections>,
) -> Permit {
    let Some(idle) = idle else {
        return gate.enter().await;
    };
    loop {
        // Dropping either wait loses nothing: a readiness poll takes no
        // connection, a gate wait no place.
        monoio::select! {
            permit = gate.enter() => return permit,
            ready = listener.readable(false) => {
                if ready.is_err() {
                    return gate.enter().await;
                }
            }
        }
        if idle.reclaim_longest_idle() {
            engine_metrics::add(Count::EdgeClientIdleReclaimed, 1);
            return gate.enter().await;
        }
        monoio::select! {
            permit = gate.enter() => return permit,
            _ = monoio::time::sleep(RECLAIM_RETRY) => {}
        }
    }
}

/// A peer over its cap is logged at most once per this interval.
pub const PEER_CAP_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Accepts client connections forever, at most this core's share of
/// `edge.max_client_connections` open at once and
/// `edge.max_client_connections_per_peer` of one peer address.
pub async fn serve_clients(edge: Rc<Edge>, listener: TcpListener) {
    let limits = edge.settings.limits;
    let gate = Gate::new(per_core(limits.max_client_connections, edge.shard_count()));
    let idle = Rc::new(IdleConnections::default());
    let peers = edge.settings.peer_limits.clients.clone();
    let log = RefCell::new(LogThrottle::new(
        PEER_CAP_LOG_INTERVAL,
        HANDSHAKE_LOG_MAX_PEERS,
    ));
    let tls = edge.settings.client_tls.is_some();
    let serve = |tcp: TcpStream, peer: Option<IpAddr>, permit| {
        let peer_place = match peer.map(|ip| (ip, peers.try_enter(ip))) {
            Some((ip, None)) => {
                engine_metrics::add(Count::EdgeClientPeerCapRefusals, 1);
                if let Some(suppressed) = log.borrow_mut().check(ip, clock::now()) {
                    tracing::warn!(
                        peer = %ip,
                        limit = peers.limit(),
                        suppressed,
                        "client connection refused: its address holds edge.max_client_connections_per_peer"
                    );
                }
                router::refuse_over_peer_cap(&tcp, tls);
                return;
            }
            Some((_, Some(place))) => Some(place),
            None => None,
        };
        engine_metrics::add(Count::EdgeClientConnectionsAccepted, 1);
        let deadline = edge.deadlines.watch(&tcp);
        let open = OpenConnection {
            idle_key: idle.add(deadline.downgrade()),
            idle: idle.clone(),
            _peer: peer_place,
            _permit: permit,
        };
        // The connection's own future is the task (wrapped, it would hold
        // the socket a second time).
        monoio::spawn(router::serve(edge.clone(), tcp, deadline, open));
    };
    let paused = Count::EdgeClientAcceptPaused;
    gated_accept_loop(
        listener,
        gate,
        paused,
        "client connection",
        Some(&idle),
        serve,
    )
    .await;
}

/// A client connection's place under the cap, under its peer's cap and in
/// the core's idle registry; counts the close.
struct OpenConnection {
    idle_key: usize,
    idle: Rc<IdleConnections>,
    _peer: Option<PeerPermit>,
    _permit: Permit,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.idle.remove(self.idle_key);
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
/// `edge.max_node_handshakes` in their TLS handshake at once, and
/// `edge.max_node_handshakes_per_peer` of one peer address.
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
    let peers = edge.settings.peer_limits.node_handshakes.clone();
    let timeout = Duration::from_millis(limits.node_handshake_timeout_ms);
    let first_byte_timeout = Duration::from_millis(limits.node_first_byte_timeout_ms).min(timeout);
    let serve = |tcp: TcpStream, peer: Option<IpAddr>, permit| {
        let peer_place = match peer.map(|ip| (ip, peers.try_enter(ip))) {
            Some((ip, None)) => {
                engine_metrics::add(Count::EdgeNodePeerCapRefusals, 1);
                if let Some(suppressed) = log.borrow_mut().check(ip, clock::now()) {
                    tracing::warn!(
                        peer = %ip,
                        limit = peers.limit(),
                        suppressed,
                        "node connection closed: its address holds edge.max_node_handshakes_per_peer handshakes"
                    );
                }
                return;
            }
            Some((_, Some(place))) => Some(place),
            None => None,
        };
        let handshake =
            HandshakeSlot::new(permit, peer_place, timeout, first_byte_timeout, log.clone());
        monoio::spawn(nodes::serve(edge.clone(), tcp, acceptor.clone(), handshake));
    };
    let paused = Count::EdgeNodeAcceptPaused;
    gated_accept_loop(listener, gate, paused, "node handshake", None, serve).await;
}

/// Accepts other Edges' connections on the peer listener forever, at
/// most this core's share of `edge.max_client_connections` open at once
/// (see the module docs); each is served by
/// [`router::serve_peer`] after its mTLS handshake.
pub async fn serve_peers(edge: Rc<Edge>, listener: TcpListener, acceptor: Rc<EdgeTlsAcceptor>) {
    let limits = edge.settings.limits;
    let gate = Gate::new(per_core(limits.max_client_connections, edge.shard_count()));
    let serve = |tcp: TcpStream, _peer: Option<IpAddr>, permit: Permit| {
        let deadline = edge.deadlines.watch(&tcp);
        monoio::spawn(router::serve_peer(
            edge.clone(),
            tcp,
            deadline,
            acceptor.clone(),
            permit,
        ));
    };
    let paused = Count::EdgeClientAcceptPaused;
    gated_accept_loop(listener, gate, paused, "peer connection", None, serve).await;
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
}
