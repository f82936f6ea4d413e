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

use std::fmt;

use bytes::{Bytes, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use zeroize::{Zeroize, Zeroizing};

use super::body::{BodyDecoder, BodyEvent};
use super::head::worth_parsing;
use super::io::{fill, write_parts, IoParts, READ_CHUNK_BYTES};
use super::write::write_request_head;
use super::{parse_response_head, BodyFraming, HttpError, Limits, ResponseHead};

/// Where the exchange on the connection stands.
#[derive(Debug)]
enum ClientState {
    /// Ready for a request.
    Idle,
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

/// HTTP/1.1 client connection over stream `S`.
///
/// Reads are never cancelled here; do not wrap these futures in a timeout
/// or `select!` (TLS streams break after a cancelled read). Enforce
/// deadlines by shutting the socket from outside.
pub struct ClientConn<S> {
    stream: S,
    read_buf: BytesMut,
    limits: Limits,
    /// `Host` value added to requests that carry none.
    host: Option<String>,
    state: ClientState,
}

impl<S> fmt::Debug for ClientConn<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConn")
            .field("host", &self.host)
            .field("buffered_bytes", &self.read_buf.len())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<S: AsyncReadRent + AsyncWriteRent> ClientConn<S> {
    /// Wraps a connected stream (use [`super::connect`] for TCP with
    /// `TCP_NODELAY`). `limits` caps response heads and chunk lines;
    /// streamed bodies are not capped (see [`ClientConn::read_body_to_end`]).
    pub fn new(stream: S, limits: Limits) -> Self {
        ClientConn {
            stream,
            read_buf: BytesMut::with_capacity(READ_CHUNK_BYTES),
            limits,
            host: None,
            state: ClientState::Idle,
        }
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
        let framing = if body.is_empty() && !matches!(method, "POST" | "PUT" | "PATCH") {
            BodyFraming::None
        } else {
            BodyFraming::ContentLength {
                len_bytes: body.len() as u64,
            }
        };
        let host = self.host.as_deref().filter(|_| !has_host);
        let fields = host
            .map(|h| ("host", h.as_bytes()))
            .into_iter()
            .chain(headers.iter().map(|(k, v)| (k.as_ref(), v.as_ref())));
        let mut head = BytesMut::with_capacity(256);
        write_request_head(&mut head, method, target, fields, framing, false)?;
        let head = zeroizing_head(head);
        if let Err(e) = write_parts(&mut self.stream, IoParts::new([head, body])).await {
            self.state = ClientState::Closed;
            return Err(e.into());
        }
        self.state = ClientState::AwaitingHead {
            head_request: method == "HEAD",
            request_close,
        };
        Ok(())
    }

    /// Reads the final response head (interim `1xx` heads are skipped).
    /// Then read the body with [`ClientConn::read_body_chunk`] (or
    /// [`ClientConn::read_raw`]) until `Ok(None)`, even when it is empty.
    ///
    /// [`HttpError::ClosedBeforeResponse`] when the server closed without
    /// sending a byte (a stale pooled connection).
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
        let result = self.read_head(head_request).await;
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
                    self.state = ClientState::Closed;
                    Err(e)
                }
            },
            Err(e) => {
                self.state = ClientState::Closed;
                Err(e)
            }
        }
    }

    async fn read_head(&mut self, head_request: bool) -> Result<ResponseHead, HttpError> {
        let mut received_any = !self.read_buf.is_empty();
        let mut scanned_bytes = 0;
        loop {
            if worth_parsing(&self.read_buf, scanned_bytes, &self.limits) {
                if let Some(head) =
                    parse_response_head(&mut self.read_buf, &self.limits, head_request)?
                {
                    if !head.is_interim() {
                        return Ok(head);
                    }
                    // An interim head was consumed; parse what follows it.
                    scanned_bytes = 0;
                    continue;
                }
            }
            scanned_bytes = self.read_buf.len();
            if fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await? == 0 {
                return Err(if received_any {
                    HttpError::UnexpectedEof
                } else {
                    HttpError::ClosedBeforeResponse
                });
            }
            received_any = true;
        }
    }

    /// The next piece of the de-chunked body, as soon as it arrives (one
    /// read's worth or one chunk's worth; a slice of the read buffer, no
    /// copy). `Ok(None)`: the body ended.
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
    pub async fn read_body_to_end(&mut self, max_body_bytes: usize) -> Result<Bytes, HttpError> {
        let mut first: Option<Bytes> = None;
        let mut joined = BytesMut::new();
        let mut total_bytes = 0usize;
        while let Some(piece) = self.read_body_chunk().await? {
            total_bytes = total_bytes.saturating_add(piece.len());
            if total_bytes > max_body_bytes {
                self.state = ClientState::Closed;
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
                decoder.decode_raw(&mut self.read_buf)
            } else {
                decoder.decode(&mut self.read_buf)
            };
            match event {
                Ok(Some(BodyEvent::Data(data))) => return Ok(Some(data)),
                Ok(Some(BodyEvent::End)) => {
                    // Bytes after a complete response that nobody asked
                    // for mean the framing cannot be trusted: close.
                    self.state = if reusable_after && self.read_buf.is_empty() {
                        ClientState::Idle
                    } else {
                        ClientState::Closed
                    };
                    return Ok(None);
                }
                Ok(None) => {}
                Err(e) => {
                    self.state = ClientState::Closed;
                    return Err(e);
                }
            }
            match fill(&mut self.stream, &mut self.read_buf, READ_CHUNK_BYTES).await {
                Ok(0) => {
                    let ended = match &mut self.state {
                        ClientState::Body { decoder, .. } => decoder.on_eof(),
                        _ => Ok(BodyEvent::End),
                    };
                    self.state = ClientState::Closed;
                    return ended.map(|_| None);
                }
                Ok(_) => {}
                Err(e) => {
                    self.state = ClientState::Closed;
                    return Err(e.into());
                }
            }
        }
    }

    /// Shuts down the write side (the peer sees EOF); the connection is
    /// not reusable after this.
    pub async fn close(&mut self) -> Result<(), HttpError> {
        self.state = ClientState::Closed;
        self.stream.shutdown().await.map_err(HttpError::from)
    }
}

/// Moves a request head into memory that is wiped when the write is done.
/// Heads can carry an injected credential header (C2, C4); neither the
/// scratch buffer nor the written copy outlives the write with the secret
/// in it. The copy costs one small allocation per request.
fn zeroizing_head(mut scratch: BytesMut) -> Bytes {
    let owned = Zeroizing::new(scratch.to_vec());
    scratch[..].zeroize();
    Bytes::from_owner(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    // CONTRACT: C4 — a request head (which may carry an injected credential
    // header) is written from a copy held in wiping memory; the bytes on the
    // wire are unchanged.
    #[test]
    fn heads_are_written_from_wiping_memory() {
        let wire = b"POST /v1 HTTP/1.1\r\nauthorization: Bearer sk-x\r\n\r\n";
        let mut scratch = BytesMut::new();
        scratch.extend_from_slice(wire);
        let head = zeroizing_head(scratch);
        assert_eq!(&head[..], wire);
        // Slices share the wiping owner; the memory is wiped when the last
        // one drops.
        let tail = head.slice(20..);
        drop(head);
        assert_eq!(&tail[..], &wire[20..]);
    }
}
