//! Typed HTTP errors and the status a server answers with for each.

use std::io;

use crate::net::Wait;

/// Everything that can go wrong while parsing, framing or moving HTTP/1.1
/// messages. Parsers return these for bad peer bytes; they never panic.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The head (start line and header fields) or a chunked trailer section
    /// is longer than the configured cap.
    #[error("message head is longer than {max_bytes} bytes")]
    HeadTooLarge {
        /// The cap that was exceeded (`Limits::max_head_bytes`).
        max_bytes: usize,
    },
    /// The head has more header fields than the configured cap.
    #[error("message head has more than {max_headers} header fields")]
    TooManyHeaders {
        /// The cap that was exceeded (`Limits::max_headers`).
        max_headers: usize,
    },
    /// The head is not HTTP/1.x syntax (httparse's reason).
    #[error("malformed message head: {0}")]
    Malformed(httparse::Error),
    /// The body is longer than the configured cap.
    #[error("message body is longer than {max_bytes} bytes")]
    BodyTooLarge {
        /// The cap that was exceeded (`Limits::max_body_bytes`).
        max_bytes: usize,
    },
    /// `Content-Length` is not a decimal number, or appears with differing
    /// values.
    #[error("invalid or conflicting Content-Length")]
    BadContentLength,
    /// A request carries both `Content-Length` and `Transfer-Encoding`
    /// (a request-smuggling shape, rejected).
    #[error("request has both Content-Length and Transfer-Encoding")]
    ContentLengthWithTransferEncoding,
    /// `Transfer-Encoding` is anything other than exactly `chunked`.
    #[error("unsupported Transfer-Encoding (only `chunked` is implemented)")]
    UnsupportedTransferEncoding,
    /// An HTTP/1.0 request carries `Transfer-Encoding`, which 1.0 does not
    /// define (RFC 9112 §6.1: the framing is faulty).
    #[error("Transfer-Encoding in an HTTP/1.0 request")]
    TransferEncodingInHttp10,
    /// The chunked framing is broken.
    #[error("bad chunked encoding: {reason}")]
    BadChunk {
        /// What was wrong, for logs.
        reason: &'static str,
    },
    /// A chunk-size line (with its extensions) is longer than the cap.
    #[error("chunk-size line is longer than {max_bytes} bytes")]
    ChunkLineTooLong {
        /// The cap that was exceeded (`Limits::max_chunk_line_bytes`).
        max_bytes: usize,
    },
    /// A server-sent event is longer than the splitter's cap.
    #[error("server-sent event is longer than {max_bytes} bytes")]
    EventTooLarge {
        /// The splitter's cap.
        max_bytes: usize,
    },
    /// An NDJSON line is longer than the splitter's cap.
    #[error("NDJSON line is longer than {max_bytes} bytes")]
    LineTooLong {
        /// The splitter's cap.
        max_bytes: usize,
    },
    /// The peer closed the connection in the middle of a message.
    #[error("connection closed in the middle of a message")]
    UnexpectedEof,
    /// The peer closed the connection before sending any byte of the
    /// response (a pooled connection the server had already closed; the
    /// request may be retried on a fresh connection if it is idempotent).
    #[error("connection closed before any byte of the response")]
    ClosedBeforeResponse,
    /// A response's status cannot answer the request: `101 Switching
    /// Protocols` (this client never asks for an upgrade), or a code
    /// outside `100..=599` (RFC 9110 §15). Interim `1xx` heads are skipped
    /// before this is checked.
    #[error("unexpected response status {status} (a request is answered with 200 to 599)")]
    UnexpectedStatus {
        /// The status received.
        status: u16,
    },
    /// A header name or value given to a head writer would not be valid on
    /// the wire (not a token, or contains CR, LF or NUL).
    #[error("invalid outgoing header field {name:?}")]
    InvalidOutgoingHeader {
        /// The offending name, lossily decoded.
        name: String,
    },
    /// A method or request target given to the request writer is not valid
    /// on the wire.
    #[error("invalid outgoing request line")]
    InvalidRequestLine,
    /// A status code given to the response writer is outside `200..=999`
    /// (informational responses are written by the shells themselves).
    #[error("invalid outgoing status code {status}")]
    InvalidStatus {
        /// The rejected code.
        status: u16,
    },
    /// A shell method was called in the wrong order (for example a new
    /// request before the previous response body was read to its end).
    #[error("connection is not ready for this call: {reason}")]
    NotReady {
        /// Which order was broken.
        reason: &'static str,
    },
    /// The connection's deadline passed while it waited for the peer (a
    /// request head or body that stalled, an idle keep-alive connection: the
    /// socket's read side was shut down; a response the peer stopped taking:
    /// the connection was reset) ([`crate::net::Deadline`]).
    #[error("timed out waiting for the {} (deadline passed)", .0.name())]
    TimedOut(Wait),
    /// The socket or TLS stream failed.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
}

impl HttpError {
    /// The status a server answers with when this error came from reading a
    /// request (`400`, `413`, `431`, `501`, …). Errors that can only come
    /// from an upstream peer (SSE/NDJSON caps) map to `502`; local misuse and
    /// IO errors map to `500`.
    pub fn status_code(&self) -> u16 {
        match self {
            HttpError::HeadTooLarge { .. } | HttpError::TooManyHeaders { .. } => 431,
            HttpError::Malformed(_)
            | HttpError::BadContentLength
            | HttpError::ContentLengthWithTransferEncoding
            | HttpError::TransferEncodingInHttp10
            | HttpError::BadChunk { .. }
            | HttpError::ChunkLineTooLong { .. }
            | HttpError::UnexpectedEof
            | HttpError::ClosedBeforeResponse => 400,
            HttpError::BodyTooLarge { .. } => 413,
            HttpError::TimedOut(_) => 408,
            HttpError::UnsupportedTransferEncoding => 501,
            HttpError::EventTooLarge { .. }
            | HttpError::LineTooLong { .. }
            | HttpError::UnexpectedStatus { .. } => 502,
            HttpError::InvalidOutgoingHeader { .. }
            | HttpError::InvalidRequestLine
            | HttpError::InvalidStatus { .. }
            | HttpError::NotReady { .. }
            | HttpError::Io(_) => 500,
        }
    }

    /// Whether a server can still answer on the connection after this error
    /// (false for IO errors and peer closes: nobody is listening; false for
    /// an idle keep-alive connection that timed out: there is no request to
    /// answer; false for a write stall: the connection was reset).
    pub fn is_answerable(&self) -> bool {
        !matches!(
            self,
            HttpError::Io(_)
                | HttpError::UnexpectedEof
                | HttpError::ClosedBeforeResponse
                | HttpError::TimedOut(Wait::Idle | Wait::Linger | Wait::Write)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_match_rfc_meanings() {
        let cases: Vec<(HttpError, u16)> = vec![
            (HttpError::HeadTooLarge { max_bytes: 1 }, 431),
            (HttpError::TooManyHeaders { max_headers: 1 }, 431),
            (HttpError::Malformed(httparse::Error::Token), 400),
            (HttpError::BodyTooLarge { max_bytes: 1 }, 413),
            (HttpError::BadContentLength, 400),
            (HttpError::ContentLengthWithTransferEncoding, 400),
            (HttpError::UnsupportedTransferEncoding, 501),
            (HttpError::TransferEncodingInHttp10, 400),
            (HttpError::BadChunk { reason: "x" }, 400),
            (HttpError::ChunkLineTooLong { max_bytes: 1 }, 400),
            (HttpError::EventTooLarge { max_bytes: 1 }, 502),
            (HttpError::LineTooLong { max_bytes: 1 }, 502),
            (HttpError::UnexpectedStatus { status: 101 }, 502),
            (HttpError::UnexpectedEof, 400),
            (HttpError::TimedOut(Wait::Head), 408),
            (HttpError::TimedOut(Wait::Body), 408),
            (HttpError::InvalidStatus { status: 42 }, 500),
            (HttpError::Io(io::Error::other("x")), 500),
        ];
        for (err, status) in cases {
            assert_eq!(err.status_code(), status, "{err:?}");
        }
    }

    #[test]
    fn io_errors_are_not_answerable() {
        assert!(!HttpError::Io(io::Error::other("x")).is_answerable());
        assert!(!HttpError::UnexpectedEof.is_answerable());
        assert!(HttpError::BodyTooLarge { max_bytes: 1 }.is_answerable());
        // A stalled request gets its 408; an idle connection is just closed.
        assert!(HttpError::TimedOut(Wait::Head).is_answerable());
        assert!(HttpError::TimedOut(Wait::Body).is_answerable());
        assert!(!HttpError::TimedOut(Wait::Idle).is_answerable());
        // A client that stopped reading was reset: nothing more is written.
        assert!(!HttpError::TimedOut(Wait::Write).is_answerable());
    }
}
