//! Server side of a connection: read requests (bodies in full, capped),
//! write responses with a length, or stream them chunked without copying
//! the data. Works over any monoio stream (TCP or TLS).
//!
//! ```text
//! loop:  read_request ──► Some(req) ──► write_response
//!                     │             └─► start_chunked ─► write_chunk* ─► finish
//!                     ├─► None (clean EOF between requests): done
//!                     └─► Err(e): write_error(&e) if e.is_answerable(), close
//!        continue while keep_alive()
//! ```

use std::fmt;

use bytes::{Bytes, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent, CancelableAsyncReadRent, Canceller};

use super::body::{BodyDecoder, BodyEvent};
use super::head::worth_parsing;
use super::io::{fill, write_parts, IoParts, READ_CHUNK_BYTES};
use super::write::{
    encode_chunk_header, write_response_head, CHUNKED_END, CHUNK_DATA_END, CONTINUE_100,
};
use super::{parse_request_head, BodyFraming, HttpError, Limits, RequestHead, Version};

/// Most spare capacity reserved per read of a `Content-Length` body.
const BODY_READ_CHUNK_BYTES: usize = 64 * 1024;

/// A request with its whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The parsed head.
    pub head: RequestHead,
    /// The de-chunked body (empty when there is none). A `Content-Length`
    /// body is one slice of the read buffer (no copy).
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

/// HTTP/1.1 server connection over stream `S`.
///
/// Reads are never cancelled here; do not wrap these futures in a timeout
/// or `select!` (a TLS stream panics on the next read after a cancelled
/// one). Enforce deadlines by shutting the socket from outside.
pub struct ServerConn<S> {
    stream: S,
    read_buf: BytesMut,
    /// Scratch for heads and chunk-size lines.
    write_buf: BytesMut,
    limits: Limits,
    /// The last request allows another one and nothing failed.
    keep_alive: bool,
    /// The last request was HEAD.
    head_request: bool,
    /// The last request was HTTP/1.0 (no chunked responses).
    http10: bool,
    response: ResponseState,
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

impl<S: AsyncReadRent + AsyncWriteRent> ServerConn<S> {
    /// Wraps an accepted stream (set `TCP_NODELAY` first:
    /// [`super::accept`] does).
    pub fn new(stream: S, limits: Limits) -> Self {
        ServerConn {
            stream,
            read_buf: BytesMut::with_capacity(READ_CHUNK_BYTES),
            write_buf: BytesMut::new(),
            limits,
            keep_alive: true,
            head_request: false,
            http10: false,
            response: ResponseState::Idle,
        }
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
    /// The watch is a cancelable read: when `work` finishes first the read
    /// is cancelled and awaited, and any bytes it had already received (a
    /// pipelined next request) are kept for [`ServerConn::read_request`], so
    /// nothing is lost. After the client sent such bytes the watch stops
    /// (their arrival says nothing about a close) and only `work` is awaited.
    pub async fn watch_peer<F: std::future::Future>(&mut self, work: F) -> Watched<F::Output>
    where
        S: CancelableAsyncReadRent,
    {
        let mut work = std::pin::pin!(work);
        let canceller = Canceller::new();
        let probe = vec![0u8; 4096];
        let read = self.stream.cancelable_read(probe, canceller.handle());
        let mut read = std::pin::pin!(read);
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

    /// Reads the next request and its whole body.
    ///
    /// `Ok(None)`: the client closed cleanly between requests. Sends
    /// `100 Continue` when the client asked for it and the body is not
    /// already here (after the `Content-Length` cap check, so an oversized
    /// body gets its 413 without being sent). Errors leave
    /// [`ServerConn::keep_alive`] false; answer them with
    /// [`ServerConn::write_error`] when [`HttpError::is_answerable`].
    pub async fn read_request(&mut self) -> Result<Option<Request>, HttpError> {
        if self.response != ResponseState::Idle {
            return Err(HttpError::NotReady {
                reason: "the previous response is not finished",
            });
        }
        let result = self.read_request_inner().await;
        if result.is_err() {
            self.keep_alive = false;
        }
        result
    }

    async fn read_request_inner(&mut self) -> Result<Option<Request>, HttpError> {
        // Until a head is parsed, answers (errors) go out as for a GET/1.1.
        self.head_request = false;
        self.http10 = false;
        let mut scanned_bytes = 0;
        let head = loop {
            if worth_parsing(&self.read_buf, scanned_bytes, &self.limits) {
                if let Some(head) = parse_request_head(&mut self.read_buf, &self.limits)? {
                    break head;
                }
            }
            scanned_bytes = self.read_buf.len();
            if fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await? == 0 {
                self.keep_alive = false;
                // Stray CRLFs after the last request are not a request.
                return if self.read_buf.iter().all(|&b| b == b'\r' || b == b'\n') {
                    Ok(None)
                } else {
                    Err(HttpError::UnexpectedEof)
                };
            }
        };
        self.keep_alive = head.keep_alive;
        self.head_request = head.is_head();
        self.http10 = head.version == Version::Http10;
        let body = self.read_body(&head).await?;
        Ok(Some(Request { head, body }))
    }

    async fn read_body(&mut self, head: &RequestHead) -> Result<Bytes, HttpError> {
        let mut decoder =
            BodyDecoder::new(head.framing, &self.limits, Some(self.limits.max_body_bytes))?;
        if decoder.is_done() {
            return Ok(Bytes::new());
        }
        if head.expect_continue && self.read_buf.is_empty() {
            write_parts(
                &mut self.stream,
                IoParts::new([Bytes::from_static(CONTINUE_100)]),
            )
            .await?;
        }
        if let BodyFraming::ContentLength { len_bytes } = head.framing {
            // Bounded by max_body_bytes in BodyDecoder::new. Read the body
            // contiguously and split it off once: no copy.
            let len = usize::try_from(len_bytes).map_err(|_| HttpError::BodyTooLarge {
                max_bytes: self.limits.max_body_bytes,
            })?;
            while self.read_buf.len() < len {
                // Grow with the data, not with the declared length: a
                // client that announces 8 MiB and sends nothing costs
                // nothing. BytesMut doubles, so regrowth copies are O(len).
                let spare_bytes = (len - self.read_buf.len()).min(BODY_READ_CHUNK_BYTES);
                if fill(&mut self.stream, &mut self.read_buf, spare_bytes).await? == 0 {
                    return Err(HttpError::UnexpectedEof);
                }
            }
            return Ok(self.read_buf.split_to(len).freeze());
        }
        let mut first: Option<Bytes> = None;
        let mut joined = BytesMut::new();
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
                    if fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await? == 0 {
                        decoder.on_eof()?;
                    }
                }
            }
        }
        Ok(match first {
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
        write_response_head(
            &mut self.write_buf,
            status,
            headers,
            framing,
            !self.keep_alive,
        )?;
        let head = self.write_buf.split().freeze();
        let body = if self.head_request || bodiless_status {
            Bytes::new()
        } else {
            body
        };
        self.write(IoParts::new([head, body])).await
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
        write_response_head(
            &mut self.write_buf,
            status,
            headers,
            framing,
            !self.keep_alive,
        )?;
        let head = self.write_buf.split().freeze();
        self.write(IoParts::new([head])).await?;
        self.response = state;
        Ok(())
    }

    /// Sends `data` as one chunk: the chunk-size line, then `data` itself
    /// (shared, not copied), then CRLF, in one gathered write. Empty data
    /// sends nothing (a zero-size chunk would end the body).
    pub async fn write_chunk(&mut self, data: Bytes) -> Result<(), HttpError> {
        match self.response {
            ResponseState::Idle => Err(HttpError::NotReady {
                reason: "write_chunk before start_chunked",
            }),
            ResponseState::HeadOnly => Ok(()),
            _ if data.is_empty() => Ok(()),
            ResponseState::CloseDelimited => self.write(IoParts::new([data])).await,
            ResponseState::Chunked => {
                self.write_buf
                    .extend_from_slice(encode_chunk_header(data.len()).as_bytes());
                let size_line = self.write_buf.split().freeze();
                self.write(IoParts::new([
                    size_line,
                    data,
                    Bytes::from_static(CHUNK_DATA_END),
                ]))
                .await
            }
        }
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
            ResponseState::Chunked => {
                self.write(IoParts::new([Bytes::from_static(CHUNKED_END)]))
                    .await
            }
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

    fn expect_idle(&self) -> Result<(), HttpError> {
        if self.response == ResponseState::Idle {
            Ok(())
        } else {
            Err(HttpError::NotReady {
                reason: "a streamed response is in progress",
            })
        }
    }

    async fn write(&mut self, parts: IoParts) -> Result<(), HttpError> {
        let result = write_parts(&mut self.stream, parts).await;
        if result.is_err() {
            self.keep_alive = false;
        }
        result.map_err(HttpError::from)
    }
}
