//! Server side of a connection: read requests (bodies in full, capped),
//! write responses with a length, or stream them chunked without copying
//! the data. Works over any monoio stream (TCP or TLS).
//!
//! ```text
//! loop:  read_request ──► Some(req) ──► write_response
//!                     │             └─► start_chunked ─► write_chunk* ─► finish
//!                     ├─► None (clean EOF between requests): done
//!                     └─► Err(e): write_error(&e) if e.is_answerable(),
//!                                 then linger_close (request bytes may be unread)
//!        continue while keep_alive()
//! ```
//!
//! With a [`Deadline`] ([`ServerConn::with_deadline`]) every read has one:
//! the first request's head must arrive within [`ServerTimeouts::head`] of
//! the accept, a later one's first byte within
//! [`ServerTimeouts::keep_alive_idle`] of the previous response and its head
//! within `head` of that byte, and a body may pause at most
//! [`ServerTimeouts::body_idle`] between reads. A passed deadline shuts the
//! socket's read side down from outside (reads are never cancelled) and the
//! read fails with [`HttpError::TimedOut`]. With
//! [`ServerTimeouts::write_stall`] every write has one too, pushed on by
//! each partial write: a peer that takes no byte for that long is reset and
//! the write fails with [`HttpError::TimedOut`]`(`[`Wait::Write`]`)`.
//!
//! Memory: a connection holds a read buffer only while it reads. A read
//! with nothing buffered first waits for the socket to be readable
//! ([`ReadReadiness`]; a plain TCP stream waits without a buffer, a TLS one
//! with its buffer as before), and once a request is read an empty read
//! buffer is given back, so neither a streaming response nor an idle
//! kept-alive connection keeps one. A request's head, and a body of at
//! most [`READ_CHUNK_BYTES`], are copies of their bytes, never slices of
//! the read buffer that would keep all of it for the life of the request.
//! A larger `Content-Length` body grows its buffer toward the declared
//! length, never past it, and is split off (not copied), leaving the
//! connection's read buffer behind.

use std::fmt;
use std::future::{ready, Future};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent, CancelableAsyncReadRent, Canceller};

use super::body::{BodyDecoder, BodyEvent};
use super::head::worth_parsing;
use super::io::{fill, fill_toward, write_parts_back, IoParts, ReadReadiness, READ_CHUNK_BYTES};
use super::write::{
    chunk_size_line, encode_chunk_header, write_response_head, CHUNKED_END, CHUNK_DATA_END,
    CONTINUE_100,
};
use super::{parse_request_head, BodyFraming, HttpError, Limits, RequestHead, Version};
use crate::clock;
use crate::net::{Deadline, Wait};
use crate::sync::Either;

/// Most spare capacity reserved per read of a `Content-Length` body.
const BODY_READ_CHUNK_BYTES: usize = 64 * 1024;

/// A read buffer grown past this is replaced by a fresh one between
/// requests (and detached from a body split off it).
const KEPT_READ_BUFFER_BYTES: usize = 4 * READ_CHUNK_BYTES;

/// Room a response head is written into at first: a relayed provider's
/// head with the exchange headers fits, so it is one allocation, not one
/// per doubling from empty (five per streamed response before).
const RESPONSE_HEAD_ROOM_BYTES: usize = 512;

/// What the response of the current exchange (the request last read, or
/// the answer to a request that failed to read) did so far: for access logs
/// and time-to-first-byte metrics. Reset when the next request is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExchangeStats {
    /// Status of the response head written (`None`: no head yet).
    pub status: Option<u16>,
    /// Response bytes the socket took (head, body, chunk framing).
    pub bytes_out: u64,
    /// When the first body byte was handed to the socket.
    pub first_body_byte_at: Option<Instant>,
}

/// The read deadlines of a server connection ([`ServerConn::with_deadline`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerTimeouts {
    /// How long a kept-alive connection may wait for the first byte of its
    /// next request.
    pub keep_alive_idle: Duration,
    /// How long a whole request head may take: from the accept for the
    /// first request, from its first byte for later ones.
    pub head: Duration,
    /// Longest pause between two reads of a request body.
    pub body_idle: Duration,
    /// The slowest average a request body may arrive at once its grace
    /// has passed (`None`: only [`ServerTimeouts::body_idle`] bounds it).
    pub body_min_rate: Option<BodyRate>,
    /// Longest time a response write may go without the peer accepting a
    /// byte; the connection is then cut off (reset) and the write fails
    /// with [`HttpError::TimedOut`]`(`[`Wait::Write`]`)`. `None`: writes
    /// wait for as long as the peer takes.
    pub write_stall: Option<Duration>,
}

/// A minimum average rate for request bodies, after Apache's
/// `mod_reqtimeout` (`body=grace,MinRate=rate`): a body must be complete
/// `grace` after its first read began, plus one second for each
/// `bytes_per_sec` bytes that arrived. A client that trickles a byte now
/// and then (which the idle bound alone never cuts off) loses the
/// connection at the grace; one that sends at least the rate is never cut
/// off by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyRate {
    /// Time a body gets before the rate counts.
    pub grace: Duration,
    /// Bytes per second that extend the deadline (at least 1).
    pub bytes_per_sec: u64,
}

impl BodyRate {
    /// When a body whose reading began at `started` and of which
    /// `received_bytes` arrived must be complete.
    pub fn deadline(&self, started: Instant, received_bytes: u64) -> Instant {
        let rate = self.bytes_per_sec.max(1);
        let earned = Duration::from_secs(received_bytes / rate)
            + Duration::from_nanos((received_bytes % rate).saturating_mul(1_000_000_000) / rate);
        started + self.grace + earned
    }
}

/// The bounds of a lingering close ([`ServerConn::linger_close`]), after
/// nginx's `lingering_time` / `lingering_timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linger {
    /// Longest time spent reading and discarding in all.
    pub time: Duration,
    /// Longest pause between two reads.
    pub idle: Duration,
    /// Most bytes read and discarded.
    pub max_bytes: u64,
}

/// How a lingering close ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LingerEnd {
    /// The client closed its side (it read the answer): the clean end.
    PeerClosed {
        /// Bytes discarded (those already buffered included).
        discarded_bytes: u64,
    },
    /// The time or idle bound passed first.
    TimedOut {
        /// Bytes discarded (those already buffered included).
        discarded_bytes: u64,
    },
    /// The byte bound was reached first.
    ByteCapReached,
    /// The socket failed (reset) or the connection has no deadline to bound
    /// the reads (it was only shut down for writing).
    Skipped,
}

/// A request with its whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The parsed head.
    pub head: RequestHead,
    /// The de-chunked body (empty when there is none): its own copy when
    /// it is at most [`READ_CHUNK_BYTES`], else one slice of the buffer it
    /// was read into (a `Content-Length` body is not copied).
    pub body: Bytes,
}

/// What [`ServerConn::watch_peer`] saw first.
#[derive(Debug)]
pub enum Watched<T> {
    /// The work finished; its output.
    Done(T),
    /// The client closed (or reset) its side first.
    PeerClosed,
}

/// Where the response to the current request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResponseState {
    /// No response in progress.
    Idle,
    /// A chunked body is being streamed.
    Chunked,
    /// An HTTP/1.0 client: the body runs until the connection closes.
    CloseDelimited,
    /// The head went out; the body is not sent (HEAD request, 204, 304).
    HeadOnly,
}

/// A request body being read in pieces ([`ServerConn::body_pieces`]).
#[derive(Debug, Clone)]
pub struct BodyPieces {
    left: u64,
    started: Instant,
    received: usize,
    continued: bool,
}

impl BodyPieces {
    /// Bytes of the body not read yet.
    pub fn left(&self) -> u64 {
        self.left
    }
}

/// HTTP/1.1 server connection over stream `S`.
///
/// Reads are never cancelled here; do not wrap these futures in a timeout
/// or `select!` (a TLS stream panics on the next read after a cancelled
/// one). Enforce deadlines by shutting the socket from outside.
pub struct ServerConn<S> {
    /// Declared before `stream`: dropped first, so the watchdog never
    /// shuts down a descriptor number the stream already gave back.
    deadline: Option<(Deadline, ServerTimeouts)>,
    stream: S,
    read_buf: BytesMut,
    /// The vectors of the last gathered write, kept for the next one
    /// (`None` while a write owns them).
    spare_parts: Option<IoParts>,
    limits: Limits,
    /// The last request allows another one and nothing failed.
    keep_alive: bool,
    /// The last request was HEAD.
    head_request: bool,
    /// The last request was HTTP/1.0 (no chunked responses).
    http10: bool,
    response: ResponseState,
    /// Requests read so far (the first one's head deadline counts from the
    /// accept).
    requests_read: u64,
    /// The head of a request whose body failed to read (boxed: rare, and
    /// inline it would take room in every connection).
    unfinished_head: Option<Box<RequestHead>>,
    /// Headers added to every response head of the current exchange.
    exchange_headers: Vec<(&'static str, Bytes)>,
    exchange: ExchangeStats,
}

impl<S> fmt::Debug for ServerConn<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConn")
            .field("buffered_bytes", &self.read_buf.len())
            .field("keep_alive", &self.keep_alive)
            .field("response", &self.response)
            .finish_non_exhaustive()
    }
}

impl<S> ServerConn<S> {
    /// What the current exchange's response did so far.
    pub fn exchange(&self) -> ExchangeStats {
        self.exchange
    }

    /// Bytes of read buffer the connection holds (its capacity): 0 while
    /// a response is written after a request with nothing pipelined
    /// behind it, and while the connection waits for its next request.
    pub fn read_buffer_bytes(&self) -> usize {
        self.read_buf.capacity()
    }
}

impl<S: AsyncReadRent + AsyncWriteRent + ReadReadiness> ServerConn<S> {
    /// Wraps an accepted stream (set `TCP_NODELAY` first:
    /// [`super::accept`] does).
    pub fn new(stream: S, limits: Limits) -> Self {
        ServerConn {
            stream,
            // Allocated by the first read, once the socket is readable.
            read_buf: BytesMut::new(),
            spare_parts: None,
            limits,
            keep_alive: true,
            head_request: false,
            http10: false,
            response: ResponseState::Idle,
            requests_read: 0,
            unfinished_head: None,
            exchange_headers: Vec::new(),
            exchange: ExchangeStats::default(),
            deadline: None,
        }
    }

    /// Adds `name: value` to every response head of the current exchange
    /// (after the caller's headers), e.g. `x-request-id`; replaces an
    /// earlier value of `name`. Cleared when the next request is read.
    pub fn set_exchange_header(&mut self, name: &'static str, value: Bytes) {
        self.exchange_headers.retain(|(n, _)| *n != name);
        // Most connections set one (the request id): room for that one,
        // not the four a growing vector starts with.
        self.exchange_headers.reserve_exact(1);
        self.exchange_headers.push((name, value));
    }

    /// Puts every read under `deadline` (made for this connection's socket
    /// with [`Deadlines::watch`](crate::net::Deadlines::watch)) with `timeouts`; see the module docs. The
    /// first request's head deadline starts now.
    pub fn with_deadline(mut self, deadline: Deadline, timeouts: ServerTimeouts) -> Self {
        deadline.arm(Wait::Head, timeouts.head);
        self.deadline = Some((deadline, timeouts));
        self
    }

    /// The connection's deadline, for writers that bound their own waits
    /// (a write-stall cut-off arms [`Wait::Write`] on it).
    pub fn deadline(&self) -> Option<&Deadline> {
        self.deadline.as_ref().map(|(d, _)| d)
    }

    /// Whether the connection may carry another request: the last request
    /// allowed it, its response is complete, and no error happened.
    pub fn keep_alive(&self) -> bool {
        self.keep_alive && self.response == ResponseState::Idle
    }

    /// The stream, for socket options.
    pub fn stream(&self) -> &S {
        &self.stream
    }

    /// Gives the stream back (buffered unread bytes are dropped).
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// Runs `work` (e.g. waiting for a queue admission or the first
    /// upstream byte) while watching the client: returns
    /// [`Watched::PeerClosed`] as soon as the client closes its side, or
    /// [`Watched::Done`] with `work`'s output.
    ///
    /// The watch first waits for the socket to be readable, which lends
    /// no buffer and takes no bytes ([`ReadReadiness`]), so a request
    /// waiting in the queue or for its first token costs no read memory.
    /// Then it is a cancelable read: when `work` finishes first the read
    /// is cancelled and awaited, and any bytes it had already received (a
    /// pipelined next request) are kept for [`ServerConn::read_request`], so
    /// nothing is lost. After the client sent such bytes the watch stops
    /// (their arrival says nothing about a close) and only `work` is awaited.
    pub async fn watch_peer<F: std::future::Future>(&mut self, work: F) -> Watched<F::Output>
    where
        S: CancelableAsyncReadRent,
    {
        // The watch's two waits are boxed: a read future of a stream that
        // may be TLS is large, and inline it would stay reserved in every
        // caller's future (a relay's, for the life of its stream) although
        // it is only used until the first byte goes out.
        let mut work = std::pin::pin!(work);
        if self.read_buf.is_empty() {
            // Dropping a readiness wait loses nothing: no bytes were taken.
            let ready = monoio::select! {
                out = &mut work => Some(out),
                _ = Box::pin(self.stream.read_ready()) => None,
            };
            if let Some(out) = ready {
                return Watched::Done(out);
            }
        }
        let canceller = Canceller::new();
        let probe = Vec::with_capacity(4096);
        let mut read = Box::pin(self.stream.cancelable_read(probe, canceller.handle()));
        let mut read_done = false;
        let mut extra = Vec::new();
        let output = monoio::select! {
            out = &mut work => Some(out),
            (res, buf) = &mut read => {
                read_done = true;
                match res {
                    Ok(0) | Err(_) => None,
                    Ok(n) => {
                        extra.extend_from_slice(&buf[..n]);
                        Some(work.await)
                    }
                }
            }
        };
        if !read_done {
            // Cancel and collect the read so its buffer (and any data the
            // kernel already put there) is not lost.
            let _ = canceller.cancel();
            let (res, buf) = read.await;
            match res {
                Ok(0) => {
                    // The client closed just as the work finished; the
                    // next read sees EOF again.
                }
                Ok(n) => extra.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        self.read_buf.extend_from_slice(&extra);
        match output {
            Some(out) => Watched::Done(out),
            None => {
                self.keep_alive = false;
                Watched::PeerClosed
            }
        }
    }

    /// Reads the next request and its whole body: [`ServerConn::read_head`]
    /// then [`ServerConn::read_body`].
    ///
    /// `Ok(None)`: the client closed cleanly between requests. Sends
    /// `100 Continue` when the client asked for it and the body is not
    /// already here (after the `Content-Length` cap check, so an oversized
    /// body gets its 413 without being sent). Errors leave
    /// [`ServerConn::keep_alive`] false; answer them with
    /// [`ServerConn::write_error`] when [`HttpError::is_answerable`].
    pub async fn read_request(&mut self) -> Result<Option<Request>, HttpError> {
        let Some(head) = self.read_head().await? else {
            return Ok(None);
        };
        let body = self.read_body(&head).await?;
        Ok(Some(Request { head, body }))
    }

    /// Reads the next request's head only, so the caller can decide on it
    /// (authenticate, route) before a byte of the body is read. Follow with
    /// [`ServerConn::read_body`], or with [`ServerConn::skip_body`] and an
    /// answer (the connection then closes after it).
    ///
    /// `Ok(None)`: the client closed cleanly between requests. Errors leave
    /// [`ServerConn::keep_alive`] false.
    pub async fn read_head(&mut self) -> Result<Option<RequestHead>, HttpError> {
        if self.response != ResponseState::Idle {
            return Err(HttpError::NotReady {
                reason: "the previous response is not finished",
            });
        }
        let result = self.read_head_inner().await;
        if result.is_err() {
            self.keep_alive = false;
        }
        self.disarm();
        result
    }

    /// Reads the whole body of the request whose head
    /// [`ServerConn::read_head`] just returned (empty when it has none).
    ///
    /// Sends `100 Continue` when the client asked for it and the body is
    /// not already here. Each read has the body deadlines
    /// ([`ServerTimeouts::body_idle`], [`ServerTimeouts::body_min_rate`]).
    /// On an error the head is kept for [`ServerConn::unfinished_head`] and
    /// the connection is not kept alive.
    pub async fn read_body(&mut self, head: &RequestHead) -> Result<Bytes, HttpError> {
        let body = self.read_body_inner(head).await;
        self.disarm();
        if self.read_buf.is_empty() {
            // Nothing pipelined: the buffer goes back now, not after the
            // response (which may stream for minutes).
            self.read_buf = BytesMut::new();
        }
        if body.is_err() {
            self.keep_alive = false;
            self.unfinished_head = Some(Box::new(head.clone()));
        }
        body
    }

    /// Starts reading `head`'s body in pieces ([`ServerConn::read_body_piece`]):
    /// a body with a `Content-Length` only (a chunked one is read whole,
    /// with [`ServerConn::read_body`]); `None` for any other.
    pub fn body_pieces(&self, head: &RequestHead) -> Option<BodyPieces> {
        match head.framing {
            BodyFraming::ContentLength { len_bytes } => Some(BodyPieces {
                left: len_bytes,
                started: clock::now(),
                received: 0,
                continued: false,
            }),
            _ => None,
        }
    }

    /// The next piece of the body [`ServerConn::body_pieces`] started, at
    /// most `max_bytes` (at least 1); `None` once it was read to its end.
    /// Each read has the body deadlines, as [`ServerConn::read_body`]'s;
    /// `100 Continue` goes out before the first read when the client asked
    /// for it. A body left unread ends the connection after its answer:
    /// call [`ServerConn::skip_body`]. On an error the head is kept for
    /// [`ServerConn::unfinished_head`] and the connection is not kept
    /// alive.
    pub async fn read_body_piece(
        &mut self,
        head: &RequestHead,
        pieces: &mut BodyPieces,
        max_bytes: usize,
    ) -> Result<Option<Bytes>, HttpError> {
        if pieces.left == 0 {
            return Ok(None);
        }
        let piece = self.read_body_piece_inner(head, pieces, max_bytes).await;
        self.disarm();
        if piece.is_err() {
            self.keep_alive = false;
            self.unfinished_head = Some(Box::new(head.clone()));
        }
        piece.map(Some)
    }

    async fn read_body_piece_inner(
        &mut self,
        head: &RequestHead,
        pieces: &mut BodyPieces,
        max_bytes: usize,
    ) -> Result<Bytes, HttpError> {
        if head.expect_continue && !pieces.continued && self.read_buf.is_empty() {
            // An interim response: not counted in the response's bytes.
            self.write_counting([Bytes::from_static(CONTINUE_100)], 0)
                .await?;
        }
        pieces.continued = true;
        while self.read_buf.is_empty() {
            self.arm_body(pieces.started, pieces.received);
            let read = fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await;
            if self.check_deadline(read)? == 0 {
                return Err(HttpError::UnexpectedEof);
            }
        }
        let left = usize::try_from(pieces.left).unwrap_or(usize::MAX);
        let len = self.read_buf.len().min(max_bytes.max(1)).min(left);
        // A copy: the read buffer is reused for the next piece, not pinned
        // by this one while it travels.
        let piece = Bytes::copy_from_slice(&self.read_buf[..len]);
        self.read_buf.advance(len);
        pieces.left -= len as u64;
        pieces.received += len;
        Ok(piece)
    }

    /// The body of the request last read will not be read: the answer to
    /// it says `connection: close` and the connection ends after it
    /// (follow the answer with [`ServerConn::linger_close`] when the client
    /// may still be sending). A request without a body keeps the
    /// connection.
    pub fn skip_body(&mut self, head: &RequestHead) {
        if head.framing != BodyFraming::None
            && head.framing != (BodyFraming::ContentLength { len_bytes: 0 })
        {
            self.keep_alive = false;
        }
    }

    async fn read_head_inner(&mut self) -> Result<Option<RequestHead>, HttpError> {
        self.exchange_headers.clear();
        self.exchange = ExchangeStats::default();
        // Until a head is parsed, answers (errors) go out as for a GET/1.1.
        self.head_request = false;
        self.http10 = false;
        self.unfinished_head = None;
        self.shrink_read_buffer();
        let first_request = self.requests_read == 0;
        self.requests_read += 1;
        if !first_request {
            // The first request's head deadline runs from the accept.
            if self.read_buf.is_empty() {
                self.arm(|t| (Wait::Idle, t.keep_alive_idle));
            } else {
                self.arm(|t| (Wait::Head, t.head));
            }
        }
        let mut scanned_bytes = 0;
        let head = loop {
            if worth_parsing(&self.read_buf, scanned_bytes, &self.limits) {
                if let Some(head) = parse_request_head(&mut self.read_buf, &self.limits)? {
                    break head;
                }
            }
            scanned_bytes = self.read_buf.len();
            let mut read = None;
            if self.read_buf.is_empty() {
                // Waiting for the (next) request costs no read buffer, and
                // what arrived is read into room of its own size (a plain
                // socket): a burst of new requests does not take a full
                // read chunk each.
                let ready = self.stream.read_ready().await;
                if matches!(&ready, Err(e) if e.kind() == std::io::ErrorKind::Interrupted) {
                    // A signal interrupted the wait: wait again.
                    continue;
                }
                self.check_deadline(ready.map(|()| 1))?;
                read = self.stream.read_now(&mut self.read_buf, READ_CHUNK_BYTES);
                if let Some(Err(e)) = &read {
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ) {
                        // A readiness the socket no longer has: wait again.
                        continue;
                    }
                }
            }
            let read = match read {
                Some(read) => read,
                None => fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await,
            };
            let read_bytes = self.check_deadline(read)?;
            if read_bytes == 0 {
                self.keep_alive = false;
                // Stray CRLFs after the last request are not a request.
                return if self.read_buf.iter().all(|&b| b == b'\r' || b == b'\n') {
                    self.read_buf = BytesMut::new();
                    Ok(None)
                } else {
                    Err(HttpError::UnexpectedEof)
                };
            }
            if scanned_bytes == 0 && !first_request {
                // The first byte of the next request: its head deadline.
                self.arm(|t| (Wait::Head, t.head));
            }
        };
        self.keep_alive = head.keep_alive;
        self.head_request = head.is_head();
        self.http10 = head.version == Version::Http10;
        Ok(Some(head))
    }

    /// After [`ServerConn::read_request`] failed reading a body: that
    /// request's head (to answer in its route's shape). `None` when the
    /// head itself failed, and once the next request is read.
    pub fn unfinished_head(&self) -> Option<&RequestHead> {
        self.unfinished_head.as_deref()
    }

    /// Arms the deadline (if any) with the wait and timeout `pick` chooses.
    fn arm(&self, pick: impl FnOnce(&ServerTimeouts) -> (Wait, Duration)) {
        if let Some((deadline, timeouts)) = &self.deadline {
            let (wait, timeout) = pick(timeouts);
            deadline.arm(wait, timeout);
        }
    }

    fn disarm(&self) {
        if let Some((deadline, _)) = &self.deadline {
            deadline.disarm();
        }
    }

    /// A read's result, or [`HttpError::TimedOut`] when the deadline shut the
    /// socket down under it (the read then ends with EOF or an error).
    fn check_deadline(&self, read: std::io::Result<usize>) -> Result<usize, HttpError> {
        let expired = self.deadline.as_ref().and_then(|(d, _)| d.expired());
        match (read, expired) {
            (Ok(0) | Err(_), Some(wait)) => Err(HttpError::TimedOut(wait)),
            (read, _) => Ok(read?),
        }
    }

    /// Replaces a read buffer that a large request grew with a fresh small
    /// one (keeping any pipelined bytes), so an idle connection holds no
    /// more than [`KEPT_READ_BUFFER_BYTES`].
    fn shrink_read_buffer(&mut self) {
        if self.read_buf.capacity() > KEPT_READ_BUFFER_BYTES {
            self.detach_read_buffer();
        }
    }

    /// Moves the unread bytes into a fresh buffer: the old allocation then
    /// belongs to whatever was split off it (a request body) alone, and is
    /// freed with it.
    fn detach_read_buffer(&mut self) {
        let mut fresh = BytesMut::with_capacity(READ_CHUNK_BYTES.max(self.read_buf.len()));
        fresh.extend_from_slice(&self.read_buf);
        self.read_buf = fresh;
    }

    /// Arms the body deadline before a read: the idle bound, or the
    /// minimum-rate deadline when that comes first.
    fn arm_body(&self, started: Instant, received_bytes: usize) {
        if let Some((deadline, timeouts)) = &self.deadline {
            let idle_end = clock::now() + timeouts.body_idle;
            let at = match timeouts.body_min_rate {
                Some(rate) => idle_end.min(rate.deadline(started, received_bytes as u64)),
                None => idle_end,
            };
            deadline.arm_at(Wait::Body, at);
        }
    }

    async fn read_body_inner(&mut self, head: &RequestHead) -> Result<Bytes, HttpError> {
        let mut decoder =
            BodyDecoder::new(head.framing, &self.limits, Some(self.limits.max_body_bytes))?;
        if decoder.is_done() {
            return Ok(Bytes::new());
        }
        if head.expect_continue && self.read_buf.is_empty() {
            // An interim response: not counted in the response's bytes.
            self.write_counting([Bytes::from_static(CONTINUE_100)], 0)
                .await?;
        }
        let started = clock::now();
        // Body bytes already buffered behind the head count as arrived.
        let buffered_at_start = self.read_buf.len();
        if let BodyFraming::ContentLength { len_bytes } = head.framing {
            // Bounded by max_body_bytes in BodyDecoder::new. Read the body
            // contiguously and split it off once: no copy.
            let len = usize::try_from(len_bytes).map_err(|_| HttpError::BodyTooLarge {
                max_bytes: self.limits.max_body_bytes,
            })?;
            while self.read_buf.len() < len {
                // Grow with the data, not with the declared length: a
                // client that announces 8 MiB and sends nothing costs
                // nothing. Growth doubles (regrowth copies are O(len)) but
                // stops at the declared length, so the body's buffer is at
                // most its length.
                self.arm_body(started, self.read_buf.len() - buffered_at_start);
                let spare_bytes = (len - self.read_buf.len()).min(BODY_READ_CHUNK_BYTES);
                let read =
                    fill_toward(&mut self.stream, &mut self.read_buf, spare_bytes, len).await;
                if self.check_deadline(read)? == 0 {
                    return Err(HttpError::UnexpectedEof);
                }
            }
            if len <= READ_CHUNK_BYTES {
                let body = Bytes::copy_from_slice(&self.read_buf[..len]);
                self.read_buf.advance(len);
                return Ok(body);
            }
            let body = self.read_buf.split_to(len).freeze();
            self.detach_read_buffer();
            return Ok(body);
        }
        let mut first: Option<Bytes> = None;
        let mut joined = BytesMut::new();
        // Wire bytes of a chunked body read so far (framing included).
        let mut received_bytes = 0usize;
        loop {
            match decoder.decode(&mut self.read_buf)? {
                Some(BodyEvent::Data(data)) => match first.take() {
                    None if joined.is_empty() => first = Some(data),
                    earlier => {
                        if let Some(earlier) = earlier {
                            joined.extend_from_slice(&earlier);
                        }
                        joined.extend_from_slice(&data);
                    }
                },
                Some(BodyEvent::End) => break,
                None => {
                    self.arm_body(started, received_bytes);
                    let read = fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await;
                    let read_bytes = self.check_deadline(read)?;
                    if read_bytes == 0 {
                        decoder.on_eof()?;
                    }
                    received_bytes = received_bytes.saturating_add(read_bytes);
                }
            }
        }
        Ok(match first {
            // One chunk: a slice of the read buffer, unless it is small.
            Some(only) if only.len() <= READ_CHUNK_BYTES => Bytes::copy_from_slice(&only),
            Some(only) => only,
            None => joined.freeze(),
        })
    }

    /// Writes a complete response with `Content-Length: body.len()`.
    ///
    /// The body is not sent for HEAD requests (the length still is), nor
    /// for 204/304 (no length either). Adds `connection: close` when the
    /// connection will not be kept. Caller headers named `content-length`
    /// or `transfer-encoding` are dropped.
    pub async fn write_response<I, K, V>(
        &mut self,
        status: u16,
        headers: I,
        body: Bytes,
    ) -> Result<(), HttpError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        self.expect_idle()?;
        let bodiless_status = status == 204 || status == 304;
        let framing = if bodiless_status {
            BodyFraming::None
        } else {
            BodyFraming::ContentLength {
                len_bytes: body.len() as u64,
            }
        };
        // The head's buffer is the head's alone, freed once it is written:
        // a connection keeps none between responses.
        let mut head = BytesMut::with_capacity(RESPONSE_HEAD_ROOM_BYTES);
        write_response_head(
            &mut head,
            status,
            with_exchange_headers(headers, &self.exchange_headers),
            framing,
            !self.keep_alive,
        )?;
        let head = head.freeze();
        let body = if self.head_request || bodiless_status {
            Bytes::new()
        } else {
            body
        };
        self.exchange.status = Some(status);
        if !body.is_empty() {
            self.exchange
                .first_body_byte_at
                .get_or_insert_with(clock::now);
        }
        self.write([head, body]).await
    }

    /// Answers a request error: the error's status
    /// ([`HttpError::status_code`]), a one-line text body, and
    /// `connection: close` (the connection is not kept after an error).
    pub async fn write_error(&mut self, error: &HttpError) -> Result<(), HttpError> {
        self.keep_alive = false;
        let body = Bytes::from(format!("{error}\n"));
        self.write_response(
            error.status_code(),
            [("content-type", "text/plain; charset=utf-8")],
            body,
        )
        .await
    }

    /// Starts a streamed response: writes the head with
    /// `transfer-encoding: chunked` (for an HTTP/1.0 client: no framing,
    /// the body ends when the connection closes). Follow with
    /// [`ServerConn::write_chunk`] and [`ServerConn::finish`].
    pub async fn start_chunked<I, K, V>(&mut self, status: u16, headers: I) -> Result<(), HttpError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        self.start_chunked_with(status, headers, Bytes::new()).await
    }

    /// [`ServerConn::start_chunked`] followed by
    /// [`ServerConn::write_chunk`]`(first)`, in one gathered write: a relay
    /// that holds the head until the first body byte sends both in one
    /// segment, so the client wakes once for them, not once per part.
    pub async fn start_chunked_with<I, K, V>(
        &mut self,
        status: u16,
        headers: I,
        first: Bytes,
    ) -> Result<(), HttpError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        self.expect_idle()?;
        let bodiless_status = status == 204 || status == 304;
        let (framing, state) = if bodiless_status {
            (BodyFraming::None, ResponseState::HeadOnly)
        } else if self.http10 {
            self.keep_alive = false;
            (BodyFraming::CloseDelimited, ResponseState::CloseDelimited)
        } else if self.head_request {
            (BodyFraming::Chunked, ResponseState::HeadOnly)
        } else {
            (BodyFraming::Chunked, ResponseState::Chunked)
        };
        let mut head = BytesMut::with_capacity(RESPONSE_HEAD_ROOM_BYTES);
        write_response_head(
            &mut head,
            status,
            with_exchange_headers(headers, &self.exchange_headers),
            framing,
            !self.keep_alive,
        )?;
        let first = match state {
            ResponseState::HeadOnly => Bytes::new(),
            _ => first,
        };
        let chunked = state == ResponseState::Chunked && !first.is_empty();
        if chunked {
            head.extend_from_slice(encode_chunk_header(first.len()).as_bytes());
        }
        let head = head.freeze();
        self.exchange.status = Some(status);
        if !first.is_empty() {
            self.exchange
                .first_body_byte_at
                .get_or_insert_with(clock::now);
        }
        let chunk_end = Bytes::from_static(if chunked { CHUNK_DATA_END } else { b"" });
        self.write([head, first, chunk_end]).await?;
        self.response = state;
        Ok(())
    }

    /// Sends `data` as one chunk: the chunk-size line, then `data` itself
    /// (shared, not copied), then CRLF, in one gathered write. Empty data
    /// sends nothing (a zero-size chunk would end the body).
    ///
    /// The parts are laid out at the call and the future is the write
    /// alone: this is inside every streamed response's task, for each
    /// chunk, and keeps no room for `data` or the size line.
    pub fn write_chunk(&mut self, data: Bytes) -> impl Future<Output = Result<(), HttpError>> + '_ {
        let parts = match self.response {
            ResponseState::Idle => {
                return Either::right(ready(Err(HttpError::NotReady {
                    reason: "write_chunk before start_chunked",
                })))
            }
            ResponseState::HeadOnly => return Either::right(ready(Ok(()))),
            _ if data.is_empty() => return Either::right(ready(Ok(()))),
            ResponseState::CloseDelimited => [data, Bytes::new(), Bytes::new()],
            ResponseState::Chunked => [
                chunk_size_line(data.len()),
                data,
                Bytes::from_static(CHUNK_DATA_END),
            ],
        };
        self.exchange
            .first_body_byte_at
            .get_or_insert_with(clock::now);
        Either::left(self.write(parts))
    }

    /// Ends a streamed response: the last chunk (`0\r\n\r\n`), or for an
    /// HTTP/1.0 client a shutdown of the write side.
    pub async fn finish(&mut self) -> Result<(), HttpError> {
        let state = self.response;
        self.response = ResponseState::Idle;
        match state {
            ResponseState::Idle => Err(HttpError::NotReady {
                reason: "finish before start_chunked",
            }),
            ResponseState::HeadOnly => Ok(()),
            ResponseState::Chunked => self.write([Bytes::from_static(CHUNKED_END)]).await,
            ResponseState::CloseDelimited => {
                self.keep_alive = false;
                self.stream.shutdown().await.map_err(HttpError::from)
            }
        }
    }

    /// Shuts down the write side (the peer sees EOF).
    pub async fn close(&mut self) -> Result<(), HttpError> {
        self.keep_alive = false;
        self.stream.shutdown().await.map_err(HttpError::from)
    }

    /// Closes after an answer the client may not have finished sending
    /// its request for (413, 431, a malformed head, a refusal while
    /// draining): shuts down the write side, then reads and discards what
    /// the client still sends, within `linger`'s bounds, so the close does
    /// not reset the connection before the client read the answer (a client
    /// that writes its whole body before reading would otherwise see
    /// `ECONNRESET` instead of the 413).
    ///
    /// Needs the connection's deadline to bound the reads; without one it
    /// only shuts down the write side. The connection is not kept alive.
    pub async fn linger_close(&mut self, linger: &Linger) -> LingerEnd {
        self.keep_alive = false;
        if self.stream.shutdown().await.is_err() {
            return LingerEnd::Skipped;
        }
        let Some((deadline, _)) = &self.deadline else {
            return LingerEnd::Skipped;
        };
        let end = clock::now() + linger.time;
        // Bytes already buffered (the start of a refused body) count too.
        let mut discarded_bytes = self.read_buf.len() as u64;
        let result = loop {
            let idle_end: Instant = clock::now() + linger.idle;
            deadline.arm_at(Wait::Linger, idle_end.min(end));
            self.read_buf.clear();
            match fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await {
                Ok(0) if deadline.expired() == Some(Wait::Linger) => {
                    break LingerEnd::TimedOut { discarded_bytes }
                }
                Ok(0) => break LingerEnd::PeerClosed { discarded_bytes },
                Ok(n) => {
                    discarded_bytes += n as u64;
                    if discarded_bytes >= linger.max_bytes {
                        break LingerEnd::ByteCapReached;
                    }
                    if clock::now() >= end {
                        // A peer that never pauses still stops at `time`.
                        break LingerEnd::TimedOut { discarded_bytes };
                    }
                }
                Err(_) if deadline.expired() == Some(Wait::Linger) => {
                    break LingerEnd::TimedOut { discarded_bytes }
                }
                Err(_) => break LingerEnd::Skipped,
            }
        };
        deadline.disarm();
        self.read_buf = BytesMut::new();
        result
    }

    fn expect_idle(&self) -> Result<(), HttpError> {
        if self.response == ResponseState::Idle {
            Ok(())
        } else {
            Err(HttpError::NotReady {
                reason: "a streamed response is in progress",
            })
        }
    }

    /// Writes `parts` (a response's bytes: counted in the exchange's
    /// `bytes_out` once written) under the write-stall deadline, if one is
    /// set: armed before the write, pushed on by every partial write (a
    /// slow reader that keeps taking bytes is not stalled), and put back to
    /// what was armed before (a read deadline) once the write is done.
    fn write<const N: usize>(
        &mut self,
        parts: [Bytes; N],
    ) -> impl Future<Output = Result<(), HttpError>> + '_ {
        let len = parts.iter().map(|p| p.len() as u64).sum();
        self.write_counting(parts, len)
    }

    /// [`ServerConn::write`], counting `counted` bytes once written. The
    /// parts move into the write's vectors at the call: the future holds
    /// those (reused from the last write), not the parts.
    fn write_counting<const N: usize>(
        &mut self,
        parts: [Bytes; N],
        counted: u64,
    ) -> impl Future<Output = Result<(), HttpError>> + '_ {
        let mut io = self.spare_parts.take().unwrap_or_default();
        io.refill(parts);
        async move {
            let stall = self
                .deadline
                .as_ref()
                .and_then(|(deadline, t)| t.write_stall.map(|stall| (deadline, stall)));
            let (result, io) = match stall {
                None => write_parts_back(&mut self.stream, io, || {}).await,
                Some((deadline, stall)) => {
                    let before = deadline.armed();
                    deadline.arm(Wait::Write, stall);
                    let (result, io) =
                        write_parts_back(&mut self.stream, io, || deadline.arm(Wait::Write, stall))
                            .await;
                    match before {
                        Some((wait, at)) if result.is_ok() => deadline.arm_at(wait, at),
                        _ => deadline.disarm(),
                    }
                    (result, io)
                }
            };
            self.spare_parts = Some(io);
            if result.is_err() {
                self.keep_alive = false;
            }
            match (result, self.deadline()) {
                (Ok(()), _) => {
                    self.exchange.bytes_out += counted;
                    Ok(())
                }
                (Err(_), Some(deadline)) if deadline.expired() == Some(Wait::Write) => {
                    Err(HttpError::TimedOut(Wait::Write))
                }
                (Err(e), _) => Err(HttpError::from(e)),
            }
        }
    }
}

/// The caller's `headers`, then the exchange's own.
fn with_exchange_headers<'a, I, K, V>(
    headers: I,
    exchange: &'a [(&'static str, Bytes)],
) -> impl Iterator<Item = (HeaderName<K>, HeaderValue<'a, V>)>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<[u8]>,
{
    headers
        .into_iter()
        .map(|(k, v)| (HeaderName::Caller(k), HeaderValue::Caller(v)))
        .chain(
            exchange
                .iter()
                .map(|(k, v)| (HeaderName::Exchange(k), HeaderValue::Exchange(&v[..]))),
        )
}

/// A header name from the caller or the exchange.
enum HeaderName<K> {
    Caller(K),
    Exchange(&'static str),
}

impl<K: AsRef<str>> AsRef<str> for HeaderName<K> {
    fn as_ref(&self) -> &str {
        match self {
            HeaderName::Caller(k) => k.as_ref(),
            HeaderName::Exchange(k) => k,
        }
    }
}

/// A header value from the caller or the exchange.
enum HeaderValue<'a, V> {
    Caller(V),
    Exchange(&'a [u8]),
}

impl<V: AsRef<[u8]>> AsRef<[u8]> for HeaderValue<'_, V> {
    fn as_ref(&self) -> &[u8] {
        match self {
            HeaderValue::Caller(v) => v.as_ref(),
            HeaderValue::Exchange(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_earns_one_second_past_its_grace_per_rate_bytes() {
        let rate = BodyRate {
            grace: Duration::from_secs(30),
            bytes_per_sec: 1024,
        };
        let start = clock::now();
        assert_eq!(rate.deadline(start, 0), start + Duration::from_secs(30));
        assert_eq!(rate.deadline(start, 1024), start + Duration::from_secs(31));
        assert_eq!(
            rate.deadline(start, 1536),
            start + Duration::from_millis(31_500)
        );
        // A huge count does not overflow the arithmetic.
        let far = rate.deadline(start, u64::MAX / 2);
        assert!(far > start + Duration::from_secs(1 << 40));
        // A zero rate is treated as one byte a second, not a division by zero.
        let zero = BodyRate {
            grace: Duration::ZERO,
            bytes_per_sec: 0,
        };
        assert_eq!(zero.deadline(start, 3), start + Duration::from_secs(3));
    }
}
