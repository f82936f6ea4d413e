//! Keep-alive pool of provider HTTP connections, one per core that owns
//! provider sockets (the [`NodeCore`](crate::session::NodeCore)'s on a
//! single core; each worker core's own with `--cores` of two or more,
//! [`crate::calls::workers`]), so tunnels and normalized runs stop paying a TCP
//! handshake per request and the provider an accept.
//!
//! ```text
//! ProviderPool::send(target, request, secret)
//!   ├─ checkout: idle LIFO of target's authority ──hit──► reused ClientConn
//!   │                 └─ miss ──► connect (TCP_NODELAY; TLS handshake for
//!   │                             https) ──► fresh ClientConn
//!   ├─ request head + body ─► response head ──► ProviderResponse { conn, head }
//!   └─ reused, and nothing of the response arrived (ClosedBeforeResponse,
//!      or the write failed)? ─► once more on a fresh connection
//!
//! body read to its end ─► PooledConn::release ─► is_reusable? ─► idle LIFO
//! anything else (abort, cancel, stall, error, early return) ─► the
//!   PooledConn drops ─► socket closed, never reused
//! ```
//!
//! # Policy ([`IdlePool`], pure: `now` is passed in)
//!
//! - Idle connections are kept per provider authority (scheme,
//!   `host:port` and, for `https`, the adapter's TLS client) in a LIFO: the most recently returned one is reused first (warm, least
//!   likely closed by the server), the oldest ones age out.
//! - At most [`PoolConfig::max_idle_per_authority`] idle connections per
//!   authority; returning one more closes the oldest.
//! - A connection idle for [`PoolConfig::idle_timeout`] or longer is closed
//!   instead of reused; this is checked on every checkout and check-in of
//!   its authority and by a sweep on the core's timer wheel every
//!   [`SWEEP_INTERVAL`] ([`spawn_sweeper`]).
//! - The pool bounds only *idle* connections: a checkout never waits, so a
//!   burst never starves (it connects).
//!
//! # Check-in only after a clean end (U6, W4, W10)
//!
//! A connection goes back only through [`PooledConn::release`] (or
//! [`PooledConn::finish`]), and only when [`ClientConn::is_reusable`] says
//! the response was read to its end on a keep-alive connection. There is no
//! check-in on drop: a provider call that is aborted (cancel K1/U6, stall
//! W4, session end F5), returns early, or fails simply drops its
//! connection, which closes the socket. A cancelled or stalled call's
//! connection is therefore never reused.
//!
//! # Stale connections: one retry
//!
//! A server may close an idle keep-alive connection at any time. When a
//! request on a *reused* connection fails before any byte of the response
//! arrived — [`HttpError::ClosedBeforeResponse`], or the request could not
//! be written ([`retry_on_fresh`]) — it is sent once more on a fresh
//! connection. Never after any response byte, never on a fresh connection,
//! never twice.
//!
//! # Credentials (C2, C5)
//!
//! The lease-injected header travels as a [`SecretHeader`] owned by
//! [`ProviderPool::send`]: it is zeroized as soon as no retry can need it —
//! right after the request is written on a fresh connection, or once the
//! response head (or a non-retryable failure) came back on a reused one.
//! A retry reuses that same header value: the lease is opened once per
//! call (its replay cache entry is never hit twice). Pooled connections
//! keep no request bytes, so no plaintext outlives its request.
//!
//! # Probes do not use the pool
//!
//! Health probes ([`crate::adapters::probe`]) open their own short connection with
//! `connection: close`: their answer is evidence about the provider
//! *now* (a stale pooled socket would turn into a spurious failure or an
//! extra round trip), they are rare (stalls, CAPABILITIES), and they can
//! never be starved by the pool or take an idle slot from the hot path.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::ops::{Deref, DerefMut};
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{ClientConn, HttpError, Limits, ReadReadiness, ResponseHead, Scheme};
use iop_engine::tls::{UpstreamStream, UpstreamTls};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use zeroize::Zeroizing;

use crate::adapters::dial::{self, SendError, Target};
use crate::timers::Timers;

/// Default [`PoolConfig::max_idle_per_authority`].
pub const MAX_IDLE_PER_AUTHORITY: usize = 64;
/// Default [`PoolConfig::idle_timeout`].
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often [`spawn_sweeper`] closes connections past their idle timeout.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(10);
/// Longest wait in [`PooledConn::finish`] for the rest of a body whose
/// content already ended (the chunked terminator after `[DONE]`).
pub const DRAIN_TIMEOUT: Duration = Duration::from_millis(200);
/// Most body bytes [`PooledConn::finish`] reads and discards.
pub const MAX_DRAIN_BYTES: usize = 64 * 1024;

/// A provider connection as the Node's adapters use it: plain TCP for
/// `http://` providers, TLS for `https://` ones.
pub type ProviderConn = ClientConn<UpstreamStream>;

/// The pool's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Most idle connections kept per provider authority; 0 disables
    /// pooling (every connection is closed after its request).
    pub max_idle_per_authority: usize,
    /// A connection idle this long or longer is closed, not reused.
    pub idle_timeout: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_idle_per_authority: MAX_IDLE_PER_AUTHORITY,
            idle_timeout: IDLE_TIMEOUT,
        }
    }
}

/// Counters of one pool (also logged at debug on stale retries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Checkouts served by an idle connection.
    pub hits: u64,
    /// Checkouts that had to connect (no usable idle connection).
    pub misses: u64,
    /// Requests sent again on a fresh connection because the reused one
    /// had been closed by the provider ([`retry_on_fresh`]).
    pub stale_retries: u64,
    /// Connections returned to the idle LIFO.
    pub checkins: u64,
}

/// A provider authority: what idle connections are kept under — scheme,
/// `host:port` and the TLS client (a connection verified against one
/// adapter's CA never serves another adapter's requests). The host is
/// shared, so handing it to every checkout costs no allocation.
#[derive(Debug, Clone, PartialEq)]
pub struct Authority {
    scheme: Scheme,
    host: Rc<str>,
    port: u16,
    tls: Option<UpstreamTls>,
}

impl Authority {
    /// The authority of `target` (its scheme, host, port and TLS client;
    /// the path prefix does not matter for a connection).
    pub fn of<'a>(target: impl Into<Target<'a>>) -> Self {
        let target = target.into();
        Self {
            scheme: target.url.scheme(),
            host: Rc::from(target.url.host()),
            port: target.url.port(),
            tls: target.tls.cloned(),
        }
    }

    /// The host (IPv6 without brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    fn is(&self, target: Target<'_>) -> bool {
        self.port == target.url.port()
            && self.scheme == target.url.scheme()
            && *self.host == *target.url.host()
            && self.tls.as_ref() == target.tls
    }
}

impl fmt::Display for Authority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// One idle connection and when it became idle.
struct Idle<C> {
    conn: C,
    idle_since: Instant,
}

/// The idle connections of one authority: oldest at the front, most
/// recently returned at the back (checkouts pop the back: LIFO).
struct Stack<C> {
    authority: Authority,
    idle: VecDeque<Idle<C>>,
}

impl<C> Stack<C> {
    /// Closes the connections idle for `timeout` or longer at `now`
    /// (they are all at the front). Returns how many.
    fn expire(&mut self, now: Instant, timeout: Duration) -> usize {
        let mut closed = 0;
        while self
            .idle
            .front()
            .is_some_and(|i| now.saturating_duration_since(i.idle_since) >= timeout)
        {
            self.idle.pop_front();
            closed += 1;
        }
        closed
    }
}

/// The pool's policy: idle connections per authority, LIFO, bounded,
/// aged out after the idle timeout. Pure: no IO, no clock (`now` is an
/// argument), `C` is any connection value. Dropping a `C` closes it.
pub struct IdlePool<C> {
    config: PoolConfig,
    /// One entry per authority ever used (few: one per provider address).
    stacks: Vec<Stack<C>>,
}

impl<C> fmt::Debug for IdlePool<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdlePool")
            .field("config", &self.config)
            .field("idle_total", &self.idle_total())
            .finish()
    }
}

impl<C> IdlePool<C> {
    /// An empty pool with `config`.
    pub fn new(config: PoolConfig) -> Self {
        Self {
            config,
            stacks: Vec::new(),
        }
    }

    /// The bounds.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    fn stack_index(&self, target: Target<'_>) -> Option<usize> {
        self.stacks.iter().position(|s| s.authority.is(target))
    }

    /// The [`Authority`] of `target`, sharing the pool's copy of the host
    /// when the authority is known.
    pub fn authority<'a>(&mut self, target: impl Into<Target<'a>>) -> Authority {
        let target = target.into();
        match self.stack_index(target) {
            Some(i) => self.stacks[i].authority.clone(),
            None => {
                let authority = Authority::of(target);
                self.stacks.push(Stack {
                    authority: authority.clone(),
                    idle: VecDeque::new(),
                });
                authority
            }
        }
    }

    /// The most recently returned connection of `target`'s authority that
    /// has not reached its idle timeout at `now`; older, timed-out ones are
    /// closed on the way. `None`: connect.
    pub fn checkout<'a>(&mut self, target: impl Into<Target<'a>>, now: Instant) -> Option<C> {
        let timeout = self.config.idle_timeout;
        let index = self.stack_index(target.into())?;
        let stack = &mut self.stacks[index];
        stack.expire(now, timeout);
        stack.idle.pop_back().map(|i| i.conn)
    }

    /// Keeps `conn` as the most recent idle connection of `authority`,
    /// idle since `now`, closing timed-out ones and, at the bound, the
    /// oldest. False when pooling is disabled (`conn` is closed).
    pub fn checkin(&mut self, authority: &Authority, conn: C, now: Instant) -> bool {
        let max_idle = self.config.max_idle_per_authority;
        if max_idle == 0 {
            return false;
        }
        let timeout = self.config.idle_timeout;
        let index = match self.stacks.iter().position(|s| s.authority == *authority) {
            Some(i) => i,
            None => {
                self.stacks.push(Stack {
                    authority: authority.clone(),
                    idle: VecDeque::new(),
                });
                self.stacks.len() - 1
            }
        };
        let stack = &mut self.stacks[index];
        stack.expire(now, timeout);
        while stack.idle.len() >= max_idle {
            stack.idle.pop_front();
        }
        stack.idle.push_back(Idle {
            conn,
            idle_since: now,
        });
        true
    }

    /// Closes every connection past its idle timeout at `now` and forgets
    /// authorities left without idle connections (so the list stays as
    /// short as the set of providers in use, across config refreshes).
    /// Returns how many connections were closed.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let timeout = self.config.idle_timeout;
        let closed = self.stacks.iter_mut().map(|s| s.expire(now, timeout)).sum();
        self.stacks.retain(|s| !s.idle.is_empty());
        closed
    }

    /// Authorities the pool tracks (each with idle connections, or used
    /// since the last sweep).
    pub fn authorities(&self) -> usize {
        self.stacks.len()
    }

    /// Idle connections kept for `target`'s authority.
    pub fn idle<'a>(&self, target: impl Into<Target<'a>>) -> usize {
        self.stack_index(target.into())
            .map_or(0, |i| self.stacks[i].idle.len())
    }

    /// Idle connections kept in all.
    pub fn idle_total(&self) -> usize {
        self.stacks.iter().map(|s| s.idle.len()).sum()
    }
}

/// A connection that knows whether it can carry another request.
pub trait Reusable {
    /// Whether the last response ended cleanly on a keep-alive connection.
    fn is_reusable(&self) -> bool;
}

impl<S: AsyncReadRent + AsyncWriteRent + ReadReadiness> Reusable for ClientConn<S> {
    fn is_reusable(&self) -> bool {
        ClientConn::is_reusable(self)
    }
}

/// Where an attempt on a connection failed.
#[derive(Debug, Clone, Copy)]
pub enum AttemptFailure<'e> {
    /// Writing the request failed.
    Writing(&'e HttpError),
    /// Reading the response head failed.
    ReadingHead(&'e HttpError),
}

/// Whether a request that failed on a connection may be sent once more on
/// a fresh one (pure): only on a *reused* connection, and only when nothing
/// of the response can have arrived — the server closed before any byte
/// (`ClosedBeforeResponse`), or the socket refused the request because the
/// server had already closed it (reset, broken pipe). A fresh connection's
/// failure, any failure after a response byte, and local errors are final.
pub fn retry_on_fresh(reused: bool, failure: AttemptFailure<'_>) -> bool {
    if !reused {
        return false;
    }
    match failure {
        AttemptFailure::ReadingHead(e) => matches!(e, HttpError::ClosedBeforeResponse),
        AttemptFailure::Writing(HttpError::Io(e)) => matches!(
            e.kind(),
            io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::NotConnected
        ),
        AttemptFailure::Writing(_) => false,
    }
}

/// The per-core pool: the [`IdlePool`] policy over real connections, its
/// counters, and the send path with the stale retry.
pub struct ProviderPool<C = ProviderConn> {
    idle: RefCell<IdlePool<C>>,
    stats: Cell<PoolStats>,
}

impl<C> fmt::Debug for ProviderPool<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderPool")
            .field("idle", &self.idle.borrow())
            .field("stats", &self.stats.get())
            .finish()
    }
}

impl<C: Reusable> ProviderPool<C> {
    /// An empty pool with `config`.
    pub fn new(config: PoolConfig) -> Rc<Self> {
        Rc::new(Self {
            idle: RefCell::new(IdlePool::new(config)),
            stats: Cell::new(PoolStats::default()),
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> PoolStats {
        self.stats.get()
    }

    fn count(&self, update: impl FnOnce(&mut PoolStats)) {
        let mut stats = self.stats.get();
        update(&mut stats);
        self.stats.set(stats);
    }

    /// Idle connections kept for `target`'s authority.
    pub fn idle_connections<'a>(&self, target: impl Into<Target<'a>>) -> usize {
        self.idle.borrow().idle(target)
    }

    /// Idle connections kept in all.
    pub fn idle_total(&self) -> usize {
        self.idle.borrow().idle_total()
    }

    /// Closes every idle connection past its timeout at `now`.
    pub fn sweep(&self, now: Instant) -> usize {
        self.idle.borrow_mut().sweep(now)
    }

    /// An idle connection of `target`'s authority at `now` (a hit), or
    /// `None`.
    pub fn take_idle<'a>(
        self: &Rc<Self>,
        target: impl Into<Target<'a>>,
        now: Instant,
    ) -> Option<PooledConn<C>> {
        let target = target.into();
        let (authority, conn) = {
            let mut idle = self.idle.borrow_mut();
            let conn = idle.checkout(target, now)?;
            (idle.authority(target), conn)
        };
        self.count(|s| s.hits += 1);
        Some(PooledConn {
            conn,
            pool: self.clone(),
            authority,
            reused: true,
        })
    }

    /// Wraps a freshly connected `conn` to `target`, so it can be returned
    /// after its request.
    pub fn adopt<'a>(self: &Rc<Self>, target: impl Into<Target<'a>>, conn: C) -> PooledConn<C> {
        PooledConn {
            conn,
            pool: self.clone(),
            authority: self.idle.borrow_mut().authority(target),
            reused: false,
        }
    }

    fn checkin(&self, authority: &Authority, conn: C, now: Instant) -> bool {
        let pooled = self.idle.borrow_mut().checkin(authority, conn, now);
        if pooled {
            self.count(|s| s.checkins += 1);
        }
        pooled
    }
}

impl ProviderPool<ProviderConn> {
    /// An idle connection to `target` (a hit), or a new one (a miss).
    pub async fn checkout(self: &Rc<Self>, target: Target<'_>) -> Result<PooledConn, SendError> {
        if let Some(conn) = self.take_idle(target, clock::now()) {
            return Ok(conn);
        }
        self.count(|s| s.misses += 1);
        self.connect(target).await
    }

    /// A new connection to `target` (`TCP_NODELAY`, TLS for `https`),
    /// `Host` set to its authority.
    async fn connect(self: &Rc<Self>, target: Target<'_>) -> Result<PooledConn, SendError> {
        let stream = dial::connect(target).await?;
        let client = ClientConn::new(stream, Limits::default()).with_host(target.url.authority());
        Ok(self.adopt(target, client))
    }

    /// Sends `request` (plus `secret`, the credential header, C2) to
    /// `target` on a pooled or new connection and reads the response head;
    /// once more on a fresh connection when a reused one turns out stale
    /// ([`retry_on_fresh`]). `secret` is zeroized as soon as no retry can
    /// need it (see the module docs). The body is then read from
    /// [`ProviderResponse::conn`], which goes back to the pool only through
    /// [`PooledConn::release`] or [`PooledConn::finish`].
    pub async fn send<'a>(
        self: &Rc<Self>,
        target: impl Into<Target<'a>>,
        request: &ProviderRequest<'_>,
        secret: Option<SecretHeader>,
    ) -> Result<ProviderResponse, SendError> {
        let target = target.into();
        let mut secret = secret;
        let mut conn = self.checkout(target).await?;
        // At most two attempts: a retry always runs on a fresh connection,
        // and a fresh connection's failure is final.
        loop {
            let injected = secret
                .as_ref()
                .map(|s| (s.name.as_str(), s.value.as_bytes()));
            let sent = conn
                .send_request(
                    request.method,
                    request.target,
                    request.headers.iter().copied().chain(injected),
                    request.body.clone(),
                )
                .await;
            let reused = conn.is_reused();
            if !reused {
                // C2: nothing can retry a fresh connection's request, so
                // the plaintext goes as soon as the head is written.
                secret = None;
            }
            let error = match sent {
                Ok(()) => match conn.read_response_head().await {
                    Ok(head) => return Ok(ProviderResponse { conn, head }),
                    Err(e) => {
                        if !retry_on_fresh(reused, AttemptFailure::ReadingHead(&e)) {
                            return Err(SendError::Http(e));
                        }
                        e
                    }
                },
                Err(e) => {
                    if !retry_on_fresh(reused, AttemptFailure::Writing(&e)) {
                        return Err(SendError::Http(e));
                    }
                    e
                }
            };
            self.count(|s| s.stale_retries += 1);
            tracing::debug!(
                authority = %conn.authority(),
                error = %error,
                "provider pool: the reused connection was closed by the provider; retrying once on a fresh one"
            );
            drop(conn);
            conn = self.connect(target).await?;
        }
    }
}

impl ProviderPool {
    /// Starts `request` to `target` with a body of `len_bytes` of which
    /// `request.body` is the first piece, on a fresh connection (a streamed
    /// body cannot be sent again, so no reused connection is risked on it);
    /// `secret` (C2) is zeroized once the head is written. Send the rest
    /// with `send_body` on the connection, then read the response head.
    pub async fn send_upload<'a>(
        self: &Rc<Self>,
        target: impl Into<Target<'a>>,
        request: &ProviderRequest<'_>,
        len_bytes: u64,
        secret: Option<SecretHeader>,
    ) -> Result<PooledConn, SendError> {
        let mut conn = self.connect(target.into()).await?;
        let injected = secret
            .as_ref()
            .map(|s| (s.name.as_str(), s.value.as_bytes()));
        conn.send_request_start(
            request.method,
            request.target,
            request.headers.iter().copied().chain(injected),
            len_bytes,
            request.body.clone(),
        )
        .await
        .map_err(SendError::Http)?;
        drop(secret);
        Ok(conn)
    }
}

/// A request for [`ProviderPool::send`]: everything but the credential
/// header.
#[derive(Debug, Clone)]
pub struct ProviderRequest<'a> {
    /// Method.
    pub method: &'a str,
    /// Request target (path and query).
    pub target: &'a str,
    /// Header fields, in order (no `Host`: the connection adds it).
    pub headers: &'a [(&'a str, &'a [u8])],
    /// The body (shared, not copied, on a retry).
    pub body: Bytes,
}

/// The credential header a lease injects (C2): its plaintext value lives
/// in a zeroizing buffer. `Debug` shows the name only.
pub struct SecretHeader {
    name: String,
    value: Zeroizing<String>,
}

impl SecretHeader {
    /// A header `name: value`.
    pub fn new(name: impl Into<String>, value: Zeroizing<String>) -> Self {
        Self {
            name: name.into(),
            value,
        }
    }

    /// The header name (not secret).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Debug for SecretHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretHeader")
            .field("name", &self.name)
            .field("value", &"<redacted>")
            .finish()
    }
}

/// A provider response whose head was read.
#[derive(Debug)]
pub struct ProviderResponse {
    /// The connection, positioned at the response body.
    pub conn: PooledConn,
    /// The response head.
    pub head: ResponseHead,
}

/// A connection checked out of a [`ProviderPool`]. Use it through `Deref`;
/// give it back with [`PooledConn::release`] once its response was read
/// to the end. Dropping it closes it (never a check-in).
pub struct PooledConn<C = ProviderConn> {
    conn: C,
    pool: Rc<ProviderPool<C>>,
    authority: Authority,
    reused: bool,
}

impl<C> fmt::Debug for PooledConn<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledConn")
            .field("authority", &self.authority)
            .field("reused", &self.reused)
            .finish_non_exhaustive()
    }
}

impl<C> Deref for PooledConn<C> {
    type Target = C;

    fn deref(&self) -> &C {
        &self.conn
    }
}

impl<C> DerefMut for PooledConn<C> {
    fn deref_mut(&mut self) -> &mut C {
        &mut self.conn
    }
}

impl<C: Reusable> PooledConn<C> {
    /// Whether this connection carried an earlier request.
    pub fn is_reused(&self) -> bool {
        self.reused
    }

    /// The provider authority.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// Returns the connection to the pool if its response was read to the
    /// end on a keep-alive connection; otherwise closes it. True when it
    /// was pooled.
    pub fn release(self) -> bool {
        if !self.conn.is_reusable() {
            return false;
        }
        self.pool.checkin(&self.authority, self.conn, clock::now())
    }
}

impl<S: AsyncReadRent + AsyncWriteRent + ReadReadiness> PooledConn<ClientConn<S>> {
    /// [`release`](Self::release) after reading and discarding what is
    /// left of the body — at most [`MAX_DRAIN_BYTES`] within
    /// [`DRAIN_TIMEOUT`] — for a caller whose content already ended (an
    /// SSE `[DONE]`, an NDJSON `done` line) before the body did. A body
    /// that does not end in that bound closes the connection.
    pub async fn finish(mut self) -> bool {
        let drained = monoio::select! {
            biased;
            drained = drain(&mut self.conn, MAX_DRAIN_BYTES) => drained,
            _ = monoio::time::sleep(DRAIN_TIMEOUT) => false,
        };
        drained && self.release()
    }
}

/// Reads the rest of the body, at most `max_bytes`; true when it ended.
async fn drain<S: AsyncReadRent + AsyncWriteRent + ReadReadiness>(
    conn: &mut ClientConn<S>,
    max_bytes: usize,
) -> bool {
    let mut seen_bytes = 0usize;
    loop {
        match conn.read_body_chunk().await {
            Ok(None) => return true,
            Ok(Some(piece)) => {
                seen_bytes = seen_bytes.saturating_add(piece.len());
                if seen_bytes > max_bytes {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
}

/// Spawns the periodic sweep of `pool` on the core's timer wheel: every
/// [`SWEEP_INTERVAL`] it closes connections past their idle timeout, so an
/// authority nobody calls any more does not keep sockets open. Ends once
/// the pool is gone.
pub fn spawn_sweeper<C: Reusable + 'static>(pool: &Rc<ProviderPool<C>>, timers: &Rc<Timers>) {
    let pool: Weak<ProviderPool<C>> = Rc::downgrade(pool);
    let mut timer = timers.timer();
    monoio::spawn(async move {
        loop {
            timer.arm(clock::now().checked_add(SWEEP_INTERVAL));
            timer.fired().await;
            let Some(pool) = pool.upgrade() else { return };
            let closed = pool.sweep(clock::now());
            if closed > 0 {
                tracing::debug!(closed, "provider pool: idle connections timed out");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use iop_engine::http::Url;

    use super::*;

    fn url(s: &str) -> Url {
        Url::parse(s).unwrap()
    }

    fn pool(max_idle: usize) -> IdlePool<u32> {
        IdlePool::new(PoolConfig {
            max_idle_per_authority: max_idle,
            idle_timeout: Duration::from_secs(30),
        })
    }

    fn checkouts(pool: &mut IdlePool<u32>, base: &Url, now: Instant) -> Vec<u32> {
        std::iter::from_fn(|| pool.checkout(base, now)).collect()
    }

    #[test]
    fn idle_connections_are_reused_last_in_first_out() {
        let t0 = clock::now();
        let a = url("http://127.0.0.1:8000/v1");
        let mut p = pool(8);
        assert_eq!(p.checkout(&a, t0), None, "nothing idle yet");
        let authority = p.authority(&a);
        for id in [1, 2, 3] {
            assert!(p.checkin(&authority, id, t0));
        }
        assert_eq!(p.idle(&a), 3);
        assert_eq!(p.checkout(&a, t0), Some(3));
        assert!(p.checkin(&authority, 4, t0));
        assert_eq!(checkouts(&mut p, &a, t0), vec![4, 2, 1]);
        assert_eq!(p.idle_total(), 0);
    }

    #[test]
    fn authorities_are_host_and_port_only() {
        let t0 = clock::now();
        let mut p = pool(8);
        let a = url("http://127.0.0.1:8000/v1");
        let same = url("http://127.0.0.1:8000/api");
        let other_port = url("http://127.0.0.1:8001");
        let other_host = url("http://localhost:8000");
        let authority = p.authority(&a);
        assert_eq!(authority.to_string(), "127.0.0.1:8000");
        assert_eq!(
            Authority::of(&url("http://[::1]:80")).to_string(),
            "[::1]:80"
        );
        assert!(p.checkin(&authority, 1, t0));
        assert_eq!(p.checkout(&other_port, t0), None);
        assert_eq!(p.checkout(&other_host, t0), None);
        assert_eq!(p.checkout(&same, t0), Some(1));
    }

    #[test]
    fn authorities_tell_schemes_and_tls_clients_apart() {
        let t0 = clock::now();
        let mut p = pool(8);
        let plain = url("http://gw:8443");
        let https = url("https://gw:8443");
        let tls = |ca: Option<String>| {
            UpstreamTls::new(&iop_engine::tls::UpstreamTlsSettings {
                ca_pem: ca,
                insecure_skip_verify: false,
            })
            .unwrap()
        };
        let (client_a, client_b) = (tls(None), tls(None));
        let over_a = Target::new(&https, Some(&client_a));
        let authority = p.authority(over_a);
        assert_eq!(authority.to_string(), "gw:8443");
        assert!(p.checkin(&authority, 1, t0));
        // Same host and port: not over plain HTTP, not with another
        // adapter's TLS client (its own trust anchors).
        assert_eq!(p.checkout(&plain, t0), None);
        assert_eq!(p.checkout(Target::new(&https, Some(&client_b)), t0), None);
        assert_eq!(p.checkout(Target::new(&https, None), t0), None);
        assert_eq!(
            p.checkout(Target::new(&https, Some(&client_a.clone())), t0),
            Some(1)
        );
    }

    #[test]
    fn the_bound_closes_the_oldest_idle_connection() {
        let t0 = clock::now();
        let a = url("http://10.0.0.1:9000");
        let mut p = pool(2);
        let authority = p.authority(&a);
        for (id, at_s) in [(1, 0), (2, 1), (3, 2)] {
            assert!(p.checkin(&authority, id, t0 + Duration::from_secs(at_s)));
        }
        assert_eq!(p.idle(&a), 2);
        assert_eq!(
            checkouts(&mut p, &a, t0 + Duration::from_secs(3)),
            vec![3, 2]
        );
        // A bound of 0 disables pooling.
        let mut off = pool(0);
        let authority = off.authority(&a);
        assert!(!off.checkin(&authority, 1, t0));
        assert_eq!(off.idle_total(), 0);
    }

    #[test]
    fn connections_idle_past_the_timeout_are_closed_not_reused() {
        let t0 = clock::now();
        let s = Duration::from_secs;
        let a = url("http://127.0.0.1:8000");
        let mut p = pool(8);
        let authority = p.authority(&a);
        assert!(p.checkin(&authority, 1, t0));
        assert!(p.checkin(&authority, 2, t0 + s(20)));
        // At 29.999 s the first one is still good.
        assert_eq!(p.idle(&a), 2);
        assert_eq!(p.sweep(t0 + s(30) - Duration::from_millis(1)), 0);
        // At 30 s it has timed out: the checkout skips (closes) it.
        assert_eq!(p.checkout(&a, t0 + s(30)), Some(2));
        assert_eq!(p.idle(&a), 0);
        // Expiry is also applied on check-in and by the sweep.
        assert!(p.checkin(&authority, 3, t0 + s(31)));
        assert!(p.checkin(&authority, 4, t0 + s(40)));
        assert!(p.checkin(&authority, 5, t0 + s(61)));
        assert_eq!(p.idle(&a), 2, "3 timed out at the check-in of 5");
        assert_eq!(p.sweep(t0 + s(70)), 1);
        assert_eq!(checkouts(&mut p, &a, t0 + s(70)), vec![5]);
        assert!(p.checkin(&authority, 6, t0 + s(70)));
        assert_eq!(p.checkout(&a, t0 + s(100)), None, "every one timed out");
        // A sweep forgets authorities without idle connections; a later
        // check-in of a connection to one of them still works.
        let b = url("http://127.0.0.1:9000");
        let other = p.authority(&b);
        assert!(p.checkin(&other, 7, t0 + s(100)));
        assert_eq!(p.authorities(), 2);
        assert_eq!(p.sweep(t0 + s(101)), 0);
        assert_eq!(p.authorities(), 1);
        assert!(p.checkin(&authority, 8, t0 + s(102)));
        assert_eq!(p.checkout(&a, t0 + s(102)), Some(8));
        assert_eq!(p.sweep(t0 + s(200)), 1);
        assert_eq!(p.authorities(), 0);
    }

    #[test]
    fn only_a_failure_before_any_response_byte_on_a_reused_connection_is_retried() {
        let io = |kind| HttpError::Io(io::Error::from(kind));
        let closed = HttpError::ClosedBeforeResponse;
        assert!(retry_on_fresh(true, AttemptFailure::ReadingHead(&closed)));
        // Never on a fresh connection.
        assert!(!retry_on_fresh(false, AttemptFailure::ReadingHead(&closed)));
        assert!(!retry_on_fresh(
            false,
            AttemptFailure::Writing(&io(io::ErrorKind::BrokenPipe))
        ));
        // Never after a response byte, or on a read error that cannot tell.
        for e in [
            HttpError::UnexpectedEof,
            HttpError::BadContentLength,
            io(io::ErrorKind::ConnectionReset),
        ] {
            assert!(
                !retry_on_fresh(true, AttemptFailure::ReadingHead(&e)),
                "{e}"
            );
        }
        // The request could not be written to a socket the server closed.
        for kind in [
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::NotConnected,
        ] {
            assert!(retry_on_fresh(true, AttemptFailure::Writing(&io(kind))));
        }
        // Local errors are final.
        assert!(!retry_on_fresh(
            true,
            AttemptFailure::Writing(&io(io::ErrorKind::InvalidInput))
        ));
        assert!(!retry_on_fresh(
            true,
            AttemptFailure::Writing(&HttpError::InvalidRequestLine)
        ));
    }

    /// A connection whose reusability the test decides.
    #[derive(Debug)]
    struct FakeConn {
        id: u32,
        reusable: Rc<Cell<bool>>,
    }

    impl Reusable for FakeConn {
        fn is_reusable(&self) -> bool {
            self.reusable.get()
        }
    }

    fn fake(id: u32, reusable: bool) -> (FakeConn, Rc<Cell<bool>>) {
        let flag = Rc::new(Cell::new(reusable));
        (
            FakeConn {
                id,
                reusable: flag.clone(),
            },
            flag,
        )
    }

    // CONTRACT: U6, W4, W10 — a connection goes back to the pool only by
    // release after a clean end: dropping the holder (an aborted provider
    // task) closes it, and an unfinished body is never pooled.
    #[monoio::test(timer_enabled = true)]
    async fn only_a_released_reusable_connection_is_checked_in() {
        let base = url("http://127.0.0.1:8000");
        let pool = ProviderPool::<FakeConn>::new(PoolConfig::default());
        // Released after a clean end: pooled, then reused.
        let (conn, _) = fake(1, true);
        let held = pool.adopt(&base, conn);
        assert!(!held.is_reused());
        assert!(held.release());
        assert_eq!(pool.idle_connections(&base), 1);
        let again = pool.take_idle(&base, clock::now()).expect("a hit");
        assert!(again.is_reused());
        assert_eq!(again.id, 1);
        // A body that was not read to its end is closed on release.
        again.reusable.set(false);
        assert!(!again.release());
        assert_eq!(pool.idle_connections(&base), 0);
        // An aborted provider call drops its connection (as
        // an abort drops the call): no check-in,
        // even though the connection itself looks reusable.
        let (conn, _) = fake(2, true);
        let held = pool.adopt(&base, conn);
        let (abort, aborted) = iop_engine::sync::oneshot::channel::<()>();
        let task = monoio::spawn(async move {
            let call = async move {
                let _held = held;
                std::future::pending::<()>().await;
            };
            monoio::select! {
                biased;
                _ = aborted => {},
                _ = call => {},
            }
        });
        monoio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(abort.send(()), Ok(()));
        task.await;
        assert_eq!(pool.idle_connections(&base), 0);
        assert_eq!(
            pool.stats(),
            PoolStats {
                hits: 1,
                misses: 0,
                stale_retries: 0,
                checkins: 1,
            }
        );
    }

    #[test]
    fn secret_headers_are_redacted_in_debug() {
        let h = SecretHeader::new("authorization", Zeroizing::new("Bearer sk-1".into()));
        assert_eq!(h.name(), "authorization");
        let shown = format!("{h:?}");
        assert!(!shown.contains("sk-1"), "{shown}");
        assert_eq!(
            shown,
            r#"SecretHeader { name: "authorization", value: "<redacted>" }"#
        );
    }
}
