//! Client side of a connection (Node → provider, bench → Edge): send a
//! request, read the response head, then stream the body piece by piece as
//! it arrives. Tracks whether the connection can carry another request.
//!
//! ```text
//! Idle ─send_request─► AwaitingHead ─read_response_head─► Body ─(end)─► Idle
//!                                                            └─(close-delimited,
//!                                                               not keep-alive,
//!                                                               error)──► Closed
//! ```
//!
//! # Read path: pooled buffers, body pieces without a copy
//!
//! ```text
//! socket ─read─► PooledBuf (this thread's provider read pool, 16 KiB)
//!                   │ freeze
//!                   ▼
//!               pending: Bytes ─┬─ head phase: copied into a small heap
//!                               │  buffer and parsed there (header values
//!                               │  never pin pooled memory); the bytes after
//!                               │  the head stay a slice of the pooled read
//!                               └─ body phase: BodyDecoder hands out pieces
//!                                  as slices of the pooled read (no copy)
//! ```
//!
//! A read on a plain TCP stream first waits for the socket to be readable
//! ([`super::ReadReadiness`]) and only then takes buffer room, so a
//! connection waiting between two tokens holds none; it then reads what is
//! there into the tail of the buffer this core's reads share
//! ([`BufferPool::read_packed`]), so the pieces of many streams in flight
//! hold one buffer between them. A read over TLS, or one that must follow
//! unconsumed bytes, goes into a fresh buffer of its own.
//! Buffers come from a [`BufferPool`]: by default the
//! current thread's pool ([`provider_read_pool_stats`] reports its
//! counters), or one given with [`ClientConn::with_read_pool`]. A buffer
//! returns to its pool when the last body piece cut from it is dropped, on
//! whatever thread that happens; when the pool is exhausted a read gets an
//! unpooled overflow buffer instead of waiting. Bytes not yet consumed when
//! the next read starts are copied to the front of the new buffer; the body
//! decoders consume chunk framing byte by byte, so this carry is empty on
//! the body path (see [`super::io`]'s `read_pooled`).

use std::fmt;

use bytes::{Bytes, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use zeroize::Zeroizing;

use super::body::{BodyDecoder, BodyEvent};
use super::head::worth_parsing;
use super::io::{read_pooled, write_parts, IoParts, ReadReadiness};
use super::write::{write_request_head, HeadLen, HeadSink};
use super::{parse_response_head, BodyFraming, HttpError, Limits, ResponseHead};
use crate::pool::{BufferPool, PoolStats};

thread_local! {
    /// This thread's pool for response reads: [`crate::pool::PoolConfig`]
    /// defaults (16 KiB buffers, at most 1024 pooled, allocated lazily,
    /// overflow allocation past that).
    static PROVIDER_READ_POOL: BufferPool = BufferPool::default();
}

/// The current thread's provider read pool (a cheap `Rc` handle); a fresh
/// pool if the thread-local is already torn down (thread exit).
fn provider_read_pool() -> BufferPool {
    PROVIDER_READ_POOL
        .try_with(BufferPool::clone)
        .unwrap_or_default()
}

/// Counters of the current thread's provider read pool: the pool every
/// [`ClientConn`] created on this thread reads responses into (unless it
/// was given another with [`ClientConn::with_read_pool`]). `in_use` counts
/// buffers held by a connection's pending bytes, by body pieces not yet
/// dropped (on any thread), or by a cancelled read not yet completed.
/// All zeros once the thread-local is torn down.
pub fn provider_read_pool_stats() -> PoolStats {
    PROVIDER_READ_POOL
        .try_with(BufferPool::stats)
        .unwrap_or_default()
}

/// Where the exchange on the connection stands.
#[derive(Debug)]
enum ClientState {
    /// Ready for a request.
    Idle,
    /// A request head went out with `left` bytes of its body still to
    /// come ([`ClientConn::send_body`]); then its response head is next.
    SendingBody {
        left: u64,
        head_request: bool,
        request_close: bool,
    },
    /// A request went out; its response head is next.
    AwaitingHead {
        head_request: bool,
        request_close: bool,
    },
    /// The head was read; the body is being read.
    Body {
        decoder: BodyDecoder,
        reusable_after: bool,
    },
    /// The connection cannot carry another request (closed by either
    /// side, not keep-alive, or an error).
    Closed,
}

impl ClientState {
    /// A request went out with `left` bytes of its body still to send.
    fn sent(left: u64, head_request: bool, request_close: bool) -> Self {
        if left == 0 {
            ClientState::AwaitingHead {
                head_request,
                request_close,
            }
        } else {
            ClientState::SendingBody {
                left,
                head_request,
                request_close,
            }
        }
    }
}

/// HTTP/1.1 client connection over stream `S`.
///
/// Reads are never cancelled here; do not wrap these futures in a timeout
/// or `select!` (TLS streams break after a cancelled read). Enforce
/// deadlines by shutting the socket from outside.
pub struct ClientConn<S> {
    stream: S,
    /// Where reads get their buffers.
    read_pool: BufferPool,
    /// Bytes read but not consumed yet: a slice of the last (pooled) read,
    /// or empty (then holding no buffer).
    pending: Bytes,
    limits: Limits,
    /// `Host` value added to requests that carry none.
    host: Option<String>,
    state: ClientState,
}

impl<S> fmt::Debug for ClientConn<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConn")
            .field("host", &self.host)
            .field("buffered_bytes", &self.pending.len())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<S: AsyncReadRent + AsyncWriteRent + ReadReadiness> ClientConn<S> {
    /// Wraps a connected stream (use [`super::connect`] for TCP with
    /// `TCP_NODELAY`). `limits` caps response heads and chunk lines;
    /// streamed bodies are not capped (see [`ClientConn::read_body_to_end`]).
    /// Responses are read into the current thread's provider read pool.
    pub fn new(stream: S, limits: Limits) -> Self {
        ClientConn {
            stream,
            read_pool: provider_read_pool(),
            pending: Bytes::new(),
            limits,
            host: None,
            state: ClientState::Idle,
        }
    }

    /// Reads responses into buffers from `pool` instead of the current
    /// thread's provider read pool (the pool must belong to this thread,
    /// like the connection).
    pub fn with_read_pool(mut self, pool: BufferPool) -> Self {
        self.read_pool = pool;
        self
    }

    /// Adds `host: <authority>` to every request that has no `Host` header
    /// (for example [`super::Url::authority`]).
    pub fn with_host(mut self, authority: impl Into<String>) -> Self {
        self.host = Some(authority.into());
        self
    }

    /// Whether the last response ended cleanly on a keep-alive connection,
    /// so another request may be sent (pool check-in).
    pub fn is_reusable(&self) -> bool {
        matches!(self.state, ClientState::Idle)
    }

    /// Gives the stream back.
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// Marks the connection unusable and lets go of unconsumed bytes (and
    /// so of the pooled buffer they live in).
    fn mark_closed(&mut self) {
        self.state = ClientState::Closed;
        self.pending = Bytes::new();
    }

    /// Sends a request with `body`. A non-empty body (or any POST, PUT or
    /// PATCH) gets `content-length`; the body is written after the head in
    /// one gathered write, shared, not copied. Caller headers named
    /// `content-length`/`transfer-encoding` are dropped. A caller
    /// `connection: close` makes the connection non-reusable.
    pub async fn send_request<I, K, V>(
        &mut self,
        method: &str,
        target: &str,
        headers: I,
        body: Bytes,
    ) -> Result<(), HttpError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let len_bytes = body.len() as u64;
        self.send_request_start(method, target, headers, len_bytes, body)
            .await
    }

    /// Sends a request head announcing a body of `len_bytes` and `first`,
    /// the body's first bytes; the rest follows through
    /// [`ClientConn::send_body`] (an upload streamed as it arrives). The
    /// response head can be read once all `len_bytes` went out. A body
    /// longer than announced is refused, never sent.
    pub async fn send_request_start<I, K, V>(
        &mut self,
        method: &str,
        target: &str,
        headers: I,
        len_bytes: u64,
        first: Bytes,
    ) -> Result<(), HttpError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        if first.len() as u64 > len_bytes {
            return Err(HttpError::NotReady {
                reason: "the body's first piece is longer than the body",
            });
        }
        if !matches!(self.state, ClientState::Idle) {
            return Err(HttpError::NotReady {
                reason:
                    "the previous response was not read to its end, or the connection is closed",
            });
        }
        let headers: Vec<(K, V)> = headers.into_iter().collect();
        let mut has_host = false;
        let mut request_close = false;
        for (name, value) in &headers {
            let name = name.as_ref();
            has_host |= name.eq_ignore_ascii_case("host");
            if name.eq_ignore_ascii_case("connection") {
                request_close |= value
                    .as_ref()
                    .split(|&b| b == b',')
                    .any(|t| super::head::trim_ows(t).eq_ignore_ascii_case(b"close"));
            }
        }
        let framing = if len_bytes == 0 && !matches!(method, "POST" | "PUT" | "PATCH") {
            BodyFraming::None
        } else {
            BodyFraming::ContentLength { len_bytes }
        };
        let host = self.host.as_deref().filter(|_| !has_host);
        let fields = || {
            host.map(|h| ("host", h.as_bytes()))
                .into_iter()
                .chain(headers.iter().map(|(k, v)| (k.as_ref(), v.as_ref())))
        };
        let head = zeroizing_head(|sink| {
            write_request_head(sink, method, target, fields(), framing, false)
        })?;
        let left = len_bytes - first.len() as u64;
        if let Err(e) = write_parts(&mut self.stream, IoParts::new([head, first]), || {}).await {
            self.mark_closed();
            return Err(e.into());
        }
        self.state = ClientState::sent(left, method == "HEAD", request_close);
        Ok(())
    }

    /// Sends the next `piece` of the body whose head
    /// [`ClientConn::send_request_start`] sent. More than the announced
    /// length is refused and nothing of it is sent.
    pub async fn send_body(&mut self, piece: Bytes) -> Result<(), HttpError> {
        let ClientState::SendingBody {
            left,
            head_request,
            request_close,
        } = self.state
        else {
            return Err(HttpError::NotReady {
                reason: "no request body is being sent",
            });
        };
        let Some(left) = left.checked_sub(piece.len() as u64) else {
            return Err(HttpError::NotReady {
                reason: "a body piece goes beyond the announced length",
            });
        };
        if let Err(e) =
            write_parts(&mut self.stream, IoParts::new([piece, Bytes::new()]), || {}).await
        {
            self.mark_closed();
            return Err(e.into());
        }
        self.state = ClientState::sent(left, head_request, request_close);
        Ok(())
    }

    /// Bytes of the request body still to send ([`ClientConn::send_body`]).
    pub fn body_left(&self) -> u64 {
        match self.state {
            ClientState::SendingBody { left, .. } => left,
            _ => 0,
        }
    }

    /// Reads the final response head (interim `1xx` heads are skipped).
    /// Then read the body with [`ClientConn::read_body_chunk`] (or
    /// [`ClientConn::read_raw`]) until `Ok(None)`, even when it is empty.
    ///
    /// [`HttpError::ClosedBeforeResponse`] when the server closed without
    /// sending a byte (a stale pooled connection);
    /// [`HttpError::UnexpectedStatus`] (and the connection closed) for a
    /// status that cannot answer a request: `101` (nothing here asks for
    /// an upgrade) or one outside `100..=599`, which a relay could not pass
    /// on as an answer either.
    pub async fn read_response_head(&mut self) -> Result<ResponseHead, HttpError> {
        let ClientState::AwaitingHead {
            head_request,
            request_close,
        } = self.state
        else {
            return Err(HttpError::NotReady {
                reason: "no request is waiting for its response",
            });
        };
        let result = self.read_head(head_request).await.and_then(|head| {
            if (200..=599).contains(&head.status) {
                Ok(head)
            } else {
                Err(HttpError::UnexpectedStatus {
                    status: head.status,
                })
            }
        });
        match result {
            Ok(head) => match BodyDecoder::new(head.framing, &self.limits, None) {
                Ok(decoder) => {
                    self.state = ClientState::Body {
                        decoder,
                        reusable_after: head.keep_alive && !request_close,
                    };
                    Ok(head)
                }
                Err(e) => {
                    self.mark_closed();
                    Err(e)
                }
            },
            Err(e) => {
                self.mark_closed();
                Err(e)
            }
        }
    }

    /// Reads pooled buffers until a final head parses. The head is parsed
    /// from a heap copy of what was read (small: at most `max_head_bytes`
    /// plus one read), so its header values do not pin a pooled buffer for
    /// the life of the response; the bytes after the head stay in `pending`
    /// as a slice of the last pooled read.
    async fn read_head(&mut self, head_request: bool) -> Result<ResponseHead, HttpError> {
        let mut head_buf = BytesMut::new();
        head_buf.extend_from_slice(&self.pending);
        let mut received_any = !head_buf.is_empty();
        let mut scanned_bytes = 0;
        loop {
            if worth_parsing(&head_buf, scanned_bytes, &self.limits) {
                if let Some(head) = parse_response_head(&mut head_buf, &self.limits, head_request)?
                {
                    if !head.is_interim() {
                        let last_read = std::mem::take(&mut self.pending);
                        self.pending = unparsed_tail(last_read, head_buf);
                        return Ok(head);
                    }
                    // An interim head was consumed; parse what follows it.
                    scanned_bytes = 0;
                    continue;
                }
            }
            scanned_bytes = head_buf.len();
            let (read, read_bytes) =
                read_pooled(&mut self.stream, &self.read_pool, Bytes::new()).await?;
            if read_bytes == 0 {
                return Err(if received_any {
                    HttpError::UnexpectedEof
                } else {
                    HttpError::ClosedBeforeResponse
                });
            }
            received_any = true;
            head_buf.extend_from_slice(&read);
            // `head_buf` now ends with exactly the bytes of `pending`.
            self.pending = read;
        }
    }

    /// The next piece of the de-chunked body, as soon as it arrives (one
    /// read's worth or one chunk's worth; a slice of a pooled read buffer,
    /// no copy: the buffer returns to its pool when the last piece cut from
    /// it is dropped, on any thread). `Ok(None)`: the body ended.
    pub async fn read_body_chunk(&mut self) -> Result<Option<Bytes>, HttpError> {
        self.read_body_piece(false).await
    }

    /// Like [`ClientConn::read_body_chunk`], but a chunked body comes back
    /// as its wire bytes (chunk-size lines, CRLFs and trailers included),
    /// for relaying the transfer framing unchanged; the end of the body is
    /// still found. For `Content-Length` and close-delimited bodies this is
    /// the same as `read_body_chunk`.
    pub async fn read_raw(&mut self) -> Result<Option<Bytes>, HttpError> {
        self.read_body_piece(true).await
    }

    /// Reads the rest of the body into one `Bytes` (copying only when it
    /// came in more than one piece), refusing more than `max_body_bytes`.
    /// A body that came in one piece is a slice of a pooled read buffer and
    /// keeps that buffer on loan while it lives; copy it before keeping it
    /// for long.
    pub async fn read_body_to_end(&mut self, max_body_bytes: usize) -> Result<Bytes, HttpError> {
        let mut first: Option<Bytes> = None;
        let mut joined = BytesMut::new();
        let mut total_bytes = 0usize;
        while let Some(piece) = self.read_body_chunk().await? {
            total_bytes = total_bytes.saturating_add(piece.len());
            if total_bytes > max_body_bytes {
                self.mark_closed();
                return Err(HttpError::BodyTooLarge {
                    max_bytes: max_body_bytes,
                });
            }
            match first.take() {
                None if joined.is_empty() => first = Some(piece),
                earlier => {
                    if let Some(earlier) = earlier {
                        joined.extend_from_slice(&earlier);
                    }
                    joined.extend_from_slice(&piece);
                }
            }
        }
        Ok(match first {
            Some(only) => only,
            None => joined.freeze(),
        })
    }

    async fn read_body_piece(&mut self, raw: bool) -> Result<Option<Bytes>, HttpError> {
        loop {
            let ClientState::Body {
                decoder,
                reusable_after,
            } = &mut self.state
            else {
                return match self.state {
                    ClientState::AwaitingHead { .. } => Err(HttpError::NotReady {
                        reason: "read the response head first",
                    }),
                    _ => Ok(None),
                };
            };
            let reusable_after = *reusable_after;
            let event = if raw {
                decoder.decode_raw_bytes(&mut self.pending)
            } else {
                decoder.decode_bytes(&mut self.pending)
            };
            match event {
                Ok(Some(BodyEvent::Data(data))) => return Ok(Some(data)),
                Ok(Some(BodyEvent::End)) => {
                    // Bytes after a complete response that nobody asked
                    // for mean the framing cannot be trusted: close.
                    if reusable_after && self.pending.is_empty() {
                        self.state = ClientState::Idle;
                        self.pending = Bytes::new();
                    } else {
                        self.mark_closed();
                    }
                    return Ok(None);
                }
                Ok(None) => {}
                Err(e) => {
                    self.mark_closed();
                    return Err(e);
                }
            }
            // Whatever the decoder left (nothing, in practice) is carried
            // into the next buffer.
            let carry = std::mem::take(&mut self.pending);
            match read_pooled(&mut self.stream, &self.read_pool, carry).await {
                Ok((_, 0)) => {
                    let ended = match &mut self.state {
                        ClientState::Body { decoder, .. } => decoder.on_eof(),
                        _ => Ok(BodyEvent::End),
                    };
                    self.mark_closed();
                    return ended.map(|_| None);
                }
                Ok((read, _)) => self.pending = read,
                Err(e) => {
                    self.mark_closed();
                    return Err(e.into());
                }
            }
        }
    }

    /// Shuts down the write side (the peer sees EOF); the connection is
    /// not reusable after this.
    pub async fn close(&mut self) -> Result<(), HttpError> {
        self.mark_closed();
        self.stream.shutdown().await.map_err(HttpError::from)
    }
}

/// The bytes after a parsed head. `head_buf` (what is left of the parse
/// buffer) ends with the bytes of `last_read`, and the head was parsed as
/// soon as its last byte arrived, so the tail lies within `last_read`:
/// return it as a slice of that (pooled) read. The heap copy is only a
/// fallback should that ever not hold.
fn unparsed_tail(last_read: Bytes, mut head_buf: BytesMut) -> Bytes {
    if head_buf.is_empty() {
        return Bytes::new();
    }
    match last_read.len().checked_sub(head_buf.len()) {
        Some(start) => {
            debug_assert_eq!(&last_read[start..], &head_buf[..]);
            last_read.slice(start..)
        }
        None => head_buf.split().freeze(),
    }
}

/// Writes a request head straight into memory that is wiped when the write
/// is done: `write` runs once to measure the head ([`HeadLen`]) and once
/// into a zeroizing buffer allocated at exactly that size, so the buffer
/// never grows and no copy of the head (which can carry an injected
/// credential header, C2, C4) is left in freed memory.
fn zeroizing_head(
    write: impl Fn(&mut dyn HeadSink) -> Result<(), HttpError>,
) -> Result<Bytes, HttpError> {
    let mut len = HeadLen::default();
    write(&mut len)?;
    let mut head = Zeroizing::new(Vec::with_capacity(len.0));
    let capacity = head.capacity();
    write(&mut *head)?;
    debug_assert_eq!(
        head.len(),
        len.0,
        "the measured head and the written head differ"
    );
    debug_assert_eq!(head.capacity(), capacity, "the head buffer grew");
    Ok(Bytes::from_owner(head))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::net::SocketAddr;
    use std::time::Duration;

    use crate::sync::oneshot;
    use monoio::io::AsyncWriteRentExt;
    use monoio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::http::connect;
    use crate::pool::PoolConfig;

    /// Guard against a hang: a test that has not finished by then fails.
    const TEST_GUARD: Duration = Duration::from_secs(20);

    async fn guarded<F: std::future::Future<Output = ()>>(test: F) {
        if monoio::time::timeout(TEST_GUARD, test).await.is_err() {
            panic!("test did not finish within {TEST_GUARD:?}");
        }
    }

    fn pool(buffer_size_bytes: usize, buffer_count_max: usize) -> BufferPool {
        BufferPool::new(PoolConfig {
            buffer_size_bytes,
            buffer_count_max,
        })
        .unwrap()
    }

    fn pattern(len_bytes: usize) -> Vec<u8> {
        (0..len_bytes).map(|i| (i * 7 % 251) as u8).collect()
    }

    /// What the stand-in provider does after its scripted responses.
    enum After {
        /// Close the connection.
        Close,
        /// Keep the connection open, sending nothing, until released.
        Stall(oneshot::Receiver<()>),
    }

    /// Reads one request head (requests here have no body); false on EOF.
    async fn read_request_head(stream: &mut TcpStream) -> bool {
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let (res, buf) = stream.read(Vec::with_capacity(1024)).await;
            match res {
                Ok(0) | Err(_) => return false,
                Ok(_) => seen.extend_from_slice(&buf),
            }
        }
        true
    }

    /// A provider stand-in on 127.0.0.1 port 0 serving one connection: for
    /// each of `responses` it reads a request head, then writes the
    /// response in separate writes of `write_piece_bytes`.
    fn provider(
        responses: Vec<Vec<u8>>,
        write_piece_bytes: usize,
        after: After,
    ) -> (SocketAddr, monoio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let task = monoio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            for response in responses {
                if !read_request_head(&mut stream).await {
                    return;
                }
                for piece in response.chunks(write_piece_bytes) {
                    let (res, _) = stream.write_all(piece.to_vec()).await;
                    res.unwrap();
                }
            }
            match after {
                After::Close => drop(stream),
                After::Stall(release) => {
                    let _ = release.await;
                    drop(stream);
                }
            }
        });
        (addr, task)
    }

    async fn client(addr: SocketAddr) -> ClientConn<TcpStream> {
        ClientConn::new(connect(addr).await.unwrap(), Limits::default()).with_host("provider")
    }

    async fn get(conn: &mut ClientConn<TcpStream>) -> ResponseHead {
        conn.send_request("GET", "/v1/stream", [("accept", "*/*")], Bytes::new())
            .await
            .unwrap();
        conn.read_response_head().await.unwrap()
    }

    /// Every body piece until the end, held (not dropped).
    async fn pieces(conn: &mut ClientConn<TcpStream>, raw: bool) -> Vec<Bytes> {
        let mut out = Vec::new();
        loop {
            let piece = if raw {
                conn.read_raw().await
            } else {
                conn.read_body_chunk().await
            };
            match piece.unwrap() {
                Some(piece) => {
                    assert!(!piece.is_empty());
                    out.push(piece);
                }
                None => return out,
            }
        }
    }

    fn concat(pieces: &[Bytes]) -> Vec<u8> {
        pieces.iter().flat_map(|p| p.iter().copied()).collect()
    }

    /// Distinct pooled buffers the pieces are slices of; panics if a piece
    /// is not a slice of `pool`'s memory (a copy).
    fn pooled_buffers(pool: &BufferPool, pieces: &[Bytes]) -> BTreeSet<u32> {
        pieces
            .iter()
            .map(|p| match pool.locate(p.as_ptr()) {
                Some(at) => {
                    assert!(at.offset_bytes + p.len() <= pool.buffer_size_bytes());
                    at.index
                }
                None => panic!("piece of {} bytes is not in pooled memory", p.len()),
            })
            .collect()
    }

    fn content_length_response(body: &[u8]) -> Vec<u8> {
        let mut wire = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\nx-request-id: r-17\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        wire.extend_from_slice(body);
        wire
    }

    /// A chunked body with extensions and a trailer: (wire bytes, data).
    fn chunked_body() -> (Vec<u8>, Vec<u8>) {
        let mut wire = Vec::new();
        let mut data = Vec::new();
        for (i, size) in [1usize, 5, 16, 33, 64, 7, 100, 2].into_iter().enumerate() {
            let chunk = pattern(size + i);
            let ext = if i % 3 == 0 { ";step=\"x\"" } else { "" };
            wire.extend_from_slice(format!("{:X}{ext}\r\n", chunk.len()).as_bytes());
            wire.extend_from_slice(&chunk);
            wire.extend_from_slice(b"\r\n");
            data.extend_from_slice(&chunk);
        }
        wire.extend_from_slice(b"0\r\nx-usage: 12\r\n\r\n");
        (wire, data)
    }

    fn chunked_response(wire_body: &[u8]) -> Vec<u8> {
        let mut wire =
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                .to_vec();
        wire.extend_from_slice(wire_body);
        wire
    }

    /// Sleeps in 1 ms steps until `done` holds (at most 1000 steps; the
    /// caller asserts the outcome, so this is not a timed assertion).
    async fn settle(done: impl Fn() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            monoio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn content_length_pieces_are_exact_across_buffer_boundaries() {
        guarded(async {
            let body = pattern(1000);
            let responses = vec![
                content_length_response(&body),
                content_length_response(b"0123456789"),
            ];
            let (addr, provider) = provider(responses, 13, After::Close);
            let read_pool = pool(32, 4);
            let mut conn = client(addr).await.with_read_pool(read_pool.clone());

            let head = get(&mut conn).await;
            assert_eq!(head.framing, BodyFraming::ContentLength { len_bytes: 1000 });
            let mut received = Vec::new();
            let mut piece_count = 0usize;
            while let Some(piece) = conn.read_body_chunk().await.unwrap() {
                // One piece never spans two reads, so never two buffers.
                assert!(piece.len() <= 32, "piece of {} bytes", piece.len());
                received.extend_from_slice(&piece);
                piece_count += 1;
            }
            assert_eq!(received, body);
            assert!(piece_count >= 1000 / 32, "{piece_count} pieces");
            assert!(conn.is_reusable());

            // The same connection carries the next exchange.
            get(&mut conn).await;
            assert_eq!(
                conn.read_body_to_end(64).await.unwrap(),
                Bytes::from_static(b"0123456789")
            );
            assert!(conn.is_reusable());
            drop(conn);
            provider.await;

            // Pieces were dropped as read, so the pool never needed more
            // than the two buffers of a head spanning reads (the previous
            // read is still pending while the next one is in flight).
            assert_eq!(
                read_pool.stats(),
                PoolStats {
                    in_use: 0,
                    available: 2,
                    allocated: 2,
                    capacity_max: 4,
                    overflow_allocations: 0,
                    stale_returns: 0,
                }
            );
        })
        .await;
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn chunked_pieces_are_exact_decoded_and_raw_across_buffer_boundaries() {
        guarded(async {
            let (wire_body, data) = chunked_body();
            let response = chunked_response(&wire_body);
            let (addr, provider) = provider(vec![response.clone(), response], 5, After::Close);
            // 7-byte buffers: chunk-size lines, CRLFs and the trailer are
            // cut at every kind of place. Enough of them that the held
            // pieces never exhaust the pool.
            let read_pool = pool(7, 256);
            let mut conn = client(addr).await.with_read_pool(read_pool.clone());

            assert_eq!(get(&mut conn).await.framing, BodyFraming::Chunked);
            let decoded = pieces(&mut conn, false).await;
            assert_eq!(concat(&decoded), data);
            pooled_buffers(&read_pool, &decoded);
            assert!(conn.is_reusable());
            drop(decoded);

            assert_eq!(get(&mut conn).await.framing, BodyFraming::Chunked);
            let raw = pieces(&mut conn, true).await;
            assert_eq!(concat(&raw), wire_body);
            pooled_buffers(&read_pool, &raw);
            assert!(conn.is_reusable());
            drop(raw);
            drop(conn);
            provider.await;
            let stats = read_pool.stats();
            assert_eq!(stats.in_use, 0);
            assert_eq!(stats.overflow_allocations, 0);
            assert_eq!(stats.stale_returns, 0);
        })
        .await;
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn close_delimited_pieces_are_exact_across_buffer_boundaries() {
        guarded(async {
            let body = pattern(700);
            let mut response =
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n\r\n".to_vec();
            response.extend_from_slice(&body);
            let (addr, provider) = provider(vec![response], 50, After::Close);
            let read_pool = pool(16, 4);
            let mut conn = client(addr).await.with_read_pool(read_pool.clone());

            let head = get(&mut conn).await;
            assert_eq!(head.framing, BodyFraming::CloseDelimited);
            let got = pieces(&mut conn, false).await;
            assert_eq!(concat(&got), body);
            assert!(got.iter().all(|p| p.len() <= 16));
            assert!(!conn.is_reusable());
            provider.await;
            drop(got);
            drop(conn);
            assert_eq!(read_pool.stats().in_use, 0);
        })
        .await;
    }

    // A status that cannot answer a request is an error, not a head: 101
    // (no upgrade was asked for; an interim 1xx before it is still
    // skipped) and codes outside 100..=599. The connection is not reused.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_status_that_cannot_answer_a_request_is_an_error() {
        guarded(async {
            for (wire, status) in [
                (
                    &b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
                       HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n"[..],
                    101,
                ),
                (b"HTTP/1.1 600 Nope\r\ncontent-length: 0\r\n\r\n", 600),
                (b"HTTP/1.1 099 Low\r\ncontent-length: 0\r\n\r\n", 99),
            ] {
                let (addr, provider) = provider(vec![wire.to_vec()], 64, After::Close);
                let mut conn = client(addr).await;
                conn.send_request("GET", "/v1/stream", [("accept", "*/*")], Bytes::new())
                    .await
                    .unwrap();
                let err = conn.read_response_head().await.unwrap_err();
                assert!(
                    matches!(err, HttpError::UnexpectedStatus { status: s } if s == status),
                    "{err:?}"
                );
                assert_eq!(
                    err.to_string(),
                    format!("unexpected response status {status} (a request is answered with 200 to 599)")
                );
                assert!(!conn.is_reusable());
                provider.await;
            }
            // The edges of the range are answers.
            for status in [200, 599] {
                let wire = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n");
                let (addr, provider) = provider(vec![wire.into_bytes()], 64, After::Close);
                let mut conn = client(addr).await;
                assert_eq!(get(&mut conn).await.status, status);
                provider.await;
            }
        })
        .await;
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn body_pieces_are_slices_of_pooled_buffers_and_heads_are_not() {
        guarded(async {
            let baseline = provider_read_pool_stats();
            assert_eq!(baseline.in_use, 0);
            let body = pattern(3000);
            let (wire_body, data) = chunked_body();
            let responses = vec![
                content_length_response(&body),
                chunked_response(&wire_body),
                chunked_response(&wire_body),
            ];
            let (addr, provider) = provider(responses, 1000, After::Close);
            let read_pool = provider_read_pool();
            let mut conn = client(addr).await;

            let head = get(&mut conn).await;
            let length = pieces(&mut conn, false).await;
            assert_eq!(concat(&length), body);
            // Every piece is pooled memory (no copy); header values are a
            // heap copy of the head, so they pin no pooled buffer.
            let buffers = pooled_buffers(&read_pool, &length);
            let request_id = head.header("x-request-id").unwrap();
            assert_eq!(&request_id[..], b"r-17");
            assert_eq!(read_pool.locate(request_id.as_ptr()), None);
            // Only the held pieces keep buffers on loan: the connection
            // let go of its last read when the body ended.
            assert_eq!(provider_read_pool_stats().in_use, buffers.len());
            drop(length);
            assert_eq!(provider_read_pool_stats().in_use, 0);

            get(&mut conn).await;
            let decoded = pieces(&mut conn, false).await;
            assert_eq!(concat(&decoded), data);
            let buffers = pooled_buffers(&read_pool, &decoded);
            assert_eq!(provider_read_pool_stats().in_use, buffers.len());
            drop(decoded);

            get(&mut conn).await;
            let raw = pieces(&mut conn, true).await;
            assert_eq!(concat(&raw), wire_body);
            let buffers = pooled_buffers(&read_pool, &raw);
            assert_eq!(provider_read_pool_stats().in_use, buffers.len());
            drop(raw);
            drop(head);
            drop(conn);
            provider.await;
            let stats = provider_read_pool_stats();
            assert_eq!(stats.in_use, 0);
            assert_eq!(stats.overflow_allocations, 0);
            assert_eq!(stats.stale_returns, 0);
        })
        .await;
    }

    // A streamed body whose next piece has not arrived: the read waiting
    // for it holds no pooled buffer (a stream between two tokens costs no
    // read memory), and the piece that then arrives is still pooled.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_read_waiting_for_the_next_piece_holds_no_buffer() {
        guarded(async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let (next_tx, next_rx) = oneshot::channel::<()>();
            let provider = monoio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                let req = vec![0u8; 4096];
                let (res, _) = s.read(req).await;
                res.unwrap();
                let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n";
                let (res, _) = s.write_all(head.to_vec()).await;
                res.unwrap();
                let _ = next_rx.await;
                let (res, _) = s.write_all(b"6\r\nsecond\r\n0\r\n\r\n".to_vec()).await;
                res.unwrap();
            });
            let read_pool = provider_read_pool();
            let mut conn = client(addr).await;
            get(&mut conn).await;
            let first = conn.read_body_chunk().await.unwrap().unwrap();
            assert_eq!(&first[..], b"first");
            drop(first);
            {
                let read = conn.read_body_chunk();
                let mut read = std::pin::pin!(read);
                monoio::select! {
                    _ = &mut read => panic!("the second piece was not sent yet"),
                    _ = monoio::time::sleep(Duration::from_millis(50)) => {}
                }
                // The read is in flight, waiting, and lends nothing.
                assert_eq!(read_pool.stats().in_use, 0);
                next_tx.send(()).unwrap();
                let second = read.await.unwrap().unwrap();
                assert_eq!(&second[..], b"second");
                assert!(read_pool.locate(second.as_ptr()).is_some());
            }
            assert_eq!(conn.read_body_chunk().await.unwrap(), None);
            provider.await;
        })
        .await;
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn body_larger_than_the_pool_overflows_and_stays_exact() {
        guarded(async {
            let body = pattern(2000);
            let (addr, provider) =
                provider(vec![content_length_response(&body)], 100, After::Close);
            // 2 × 64 bytes of pooled memory for a 2000-byte body whose
            // pieces are all held: later reads get overflow buffers.
            let read_pool = pool(64, 2);
            let mut conn = client(addr).await.with_read_pool(read_pool.clone());
            get(&mut conn).await;
            let held = pieces(&mut conn, false).await;
            assert_eq!(concat(&held), body);

            let stats = read_pool.stats();
            assert_eq!(stats.allocated, 2);
            assert!(stats.overflow_allocations >= 1);
            // Each overflow read became exactly one piece outside the pool.
            let unpooled = held
                .iter()
                .filter(|p| read_pool.locate(p.as_ptr()).is_none())
                .count();
            assert_eq!(unpooled as u64, stats.overflow_allocations);

            drop(held);
            drop(conn);
            provider.await;
            let stats = read_pool.stats();
            assert_eq!(stats.in_use, 0);
            assert_eq!(stats.available, 2);
            assert_eq!(stats.stale_returns, 0);
        })
        .await;
    }

    /// How a stalled read is cancelled.
    enum Cancel {
        /// Drop the read future; the connection is dropped afterwards.
        ReadFuture,
        /// Drop a future that owns the connection: both go at once.
        ReadFutureOwningConn,
    }

    /// Reads part of a streamed body from a provider that then stalls,
    /// cancels the read in flight, drops every piece, and checks that the
    /// provider read pool gets every buffer back (under io_uring the
    /// cancelled read returns its buffer only when the kernel completes
    /// it, so this waits for that, bounded by iterations).
    async fn cancelled_stream_leaves_no_buffer_on_loan(cancel: Cancel) {
        let baseline = provider_read_pool_stats();
        assert_eq!(baseline.in_use, 0);
        let mut response = b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n".to_vec();
        response.extend_from_slice(&pattern(100));
        let (release, stalled) = oneshot::channel();
        let (addr, provider) = provider(vec![response], 30, After::Stall(stalled));
        let read_pool = provider_read_pool();
        let mut conn = client(addr).await;
        get(&mut conn).await;
        let mut held = Vec::new();
        while concat(&held).len() < 100 {
            held.push(conn.read_body_chunk().await.unwrap().unwrap());
        }
        assert_eq!(concat(&held), pattern(100));
        let held_buffers = pooled_buffers(&read_pool, &held).len();

        let mut read = match cancel {
            Cancel::ReadFuture => {
                let mut read = Box::pin(conn.read_body_chunk());
                let woke = monoio::select! {
                    _ = &mut read => true,
                    _ = monoio::time::sleep(Duration::from_millis(10)) => false,
                };
                assert!(!woke, "a read on a stalled provider completed");
                // The read in flight waits for the socket and lends nothing.
                assert_eq!(provider_read_pool_stats().in_use, held_buffers);
                drop(read);
                assert!(!conn.is_reusable());
                drop(conn);
                None
            }
            Cancel::ReadFutureOwningConn => {
                let mut read = Box::pin(async move {
                    let _ = conn.read_body_chunk().await;
                    conn
                });
                let woke = monoio::select! {
                    _ = &mut read => true,
                    _ = monoio::time::sleep(Duration::from_millis(10)) => false,
                };
                assert!(!woke, "a read on a stalled provider completed");
                assert_eq!(provider_read_pool_stats().in_use, held_buffers);
                Some(read)
            }
        };
        drop(read.take());
        // The cancelled wait held no buffer, so none stays with the kernel.
        assert_eq!(provider_read_pool_stats().in_use, held_buffers);
        drop(held);
        assert_eq!(provider_read_pool_stats().in_use, 0);

        settle(|| provider_read_pool_stats().in_use == baseline.in_use).await;
        let stats = provider_read_pool_stats();
        assert_eq!(stats.in_use, baseline.in_use);
        assert_eq!(stats.available, stats.allocated);
        assert_eq!(stats.stale_returns, 0);
        let _ = release.send(());
        provider.await;
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn cancelled_read_future_returns_every_buffer() {
        guarded(cancelled_stream_leaves_no_buffer_on_loan(
            Cancel::ReadFuture,
        ))
        .await;
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn dropped_conn_with_read_in_flight_returns_every_buffer() {
        guarded(cancelled_stream_leaves_no_buffer_on_loan(
            Cancel::ReadFutureOwningConn,
        ))
        .await;
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn pieces_dropped_on_another_thread_come_back() {
        guarded(async {
            assert_eq!(provider_read_pool_stats().in_use, 0);
            let body = pattern(40_000);
            let (addr, provider) =
                provider(vec![content_length_response(&body)], 4096, After::Close);
            let read_pool = provider_read_pool();
            let mut conn = client(addr).await;
            get(&mut conn).await;
            let held = pieces(&mut conn, false).await;
            assert_eq!(concat(&held), body);
            let held_buffers = pooled_buffers(&read_pool, &held).len();
            assert_eq!(provider_read_pool_stats().in_use, held_buffers);

            let dropped_bytes = std::thread::spawn(move || {
                let len_bytes: usize = held.iter().map(Bytes::len).sum();
                drop(held);
                len_bytes
            })
            .join()
            .unwrap();
            assert_eq!(dropped_bytes, 40_000);

            // The other thread queued the memory; reading the counters
            // brings it home.
            let stats = provider_read_pool_stats();
            assert_eq!(stats.in_use, 0);
            assert_eq!(stats.available, stats.allocated);
            assert_eq!(stats.stale_returns, 0);
            drop(conn);
            provider.await;
        })
        .await;
    }

    // CONTRACT: C4 — a request head (which may carry an injected credential
    // header) is written once, into wiping memory sized up front: also a
    // head far past the old 256-byte first buffer never grows (no copy of
    // it is left in freed memory), and the bytes on the wire are exactly
    // what the head writer produces.
    #[test]
    fn heads_are_written_once_into_wiping_memory_of_their_size() {
        let secret = format!("Bearer sk-{}", "x".repeat(4096));
        let headers = [
            ("host", b"provider:8000".as_slice()),
            ("authorization", secret.as_bytes()),
        ];
        let framing = BodyFraming::ContentLength { len_bytes: 123 };
        let write = |sink: &mut dyn HeadSink| {
            write_request_head(
                sink,
                "POST",
                "/v1/chat/completions",
                headers,
                framing,
                false,
            )
        };
        let mut expected = BytesMut::new();
        write(&mut expected).expect("valid head");
        assert!(expected.len() > 4096);
        let mut measured = HeadLen::default();
        write(&mut measured).expect("valid head");
        assert_eq!(measured.0, expected.len());
        // The debug assertions in `zeroizing_head` check that the buffer
        // neither grew nor differs from the measurement.
        let head = zeroizing_head(write).expect("valid head");
        assert_eq!(&head[..], &expected[..]);
        // Slices share the wiping owner; the memory is wiped when the last
        // one drops.
        let tail = head.slice(20..);
        drop(head);
        assert_eq!(&tail[..], &expected[20..]);
        // A refused header fails the head before anything is allocated.
        assert!(matches!(
            zeroizing_head(|sink| write_request_head(
                sink,
                "POST",
                "/",
                [("x-bad", b"a\r\nb".as_slice())],
                framing,
                false
            )),
            Err(HttpError::InvalidOutgoingHeader { .. })
        ));
    }
}
