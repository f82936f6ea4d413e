//! HTTP/1.1 for the Edge's client surface, the Node's provider calls and
//! the bench.
//!
//! A sans-IO core of pure, incremental, capped parsers (each returns
//! `Ok(None)` when it needs more bytes, never panics on input, and fails
//! with a typed [`HttpError`] that maps to a status code), and thin monoio
//! shells over any `AsyncReadRent + AsyncWriteRent` stream (TCP or TLS).
//!
//! ```text
//!             pure core                               shells (monoio)
//! bytes ─► parse_request_head / parse_response_head   ServerConn: read_request,
//!       ─► BodyDecoder (length | chunked | close)        write_response, start_chunked,
//!             └─ ChunkedDecoder                          write_chunk, finish, write_error
//!       ─► SseSplitter (raw blocks | parsed events)   ClientConn: send_request,
//!       ─► NdjsonSplitter                                read_response_head,
//! heads ◄─ write_request_head / write_response_head      read_body_chunk, read_raw
//! chunk ◄─ encode_chunk_header                        connect, accept, set_nodelay, Url
//! ```
//!
//! A response body comes out as `Bytes` slices of pooled read buffers (no
//! copy); a request body over 16 KiB is one slice of the buffer it was read
//! into, while heads and smaller request bodies are copies, so a few bytes
//! never keep a whole read buffer alive. Bodies go out with gathered writes
//! that share the caller's `Bytes` (no copy).
//! Every socket these helpers create or accept has `TCP_NODELAY`.

mod body;
mod chunked;
mod client;
mod error;
mod head;
mod io;
mod ndjson;
#[cfg(test)]
mod prop_tests;
mod server;
mod sse;
mod url;
mod write;

pub use body::{BodyDecoder, BodyEvent};
pub use chunked::{ChunkedDecoder, ChunkedItem, ChunkedStep};
pub use client::{provider_read_pool_stats, ClientConn};
pub use error::HttpError;
pub use head::{
    parse_request_head, parse_response_head, BodyFraming, Header, RequestHead, ResponseHead,
    Version,
};
pub use io::{
    accept, connect, connect_addrs, connect_host, connect_url, set_nodelay, ReadReadiness,
};
pub use ndjson::NdjsonSplitter;
pub use server::{
    BodyPieces, BodyRate, ExchangeStats, Linger, LingerEnd, Request, ServerConn, ServerTimeouts,
    Watched,
};
pub use sse::{parse_event, SseEvent, SseSplitter};
pub use url::{Scheme, Url, UrlError};
pub use write::{
    canonical_reason, encode_chunk_header, is_framing, is_hop_by_hop, write_request_head,
    write_response_head, ChunkHeader, HeadLen, HeadSink, CHUNKED_END, CHUNK_DATA_END, CONTINUE_100,
};

/// Caps every parser honours. One value per connection; the defaults suit
/// request parsing on the Edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest head (start line and header fields, final blank line
    /// included) and longest chunked trailer section. Default 16 KiB.
    pub max_head_bytes: usize,
    /// Most header fields in one head. Default 64.
    pub max_headers: usize,
    /// Longest request body a server reads. Default 8 MiB. Streamed
    /// response bodies are not capped by the client shell.
    pub max_body_bytes: usize,
    /// Longest chunk-size line (extensions included, CRLF excluded).
    /// Default 1 KiB.
    pub max_chunk_line_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_head_bytes: 16 * 1024,
            max_headers: 64,
            max_body_bytes: 8 * 1024 * 1024,
            max_chunk_line_bytes: 1024,
        }
    }
}
