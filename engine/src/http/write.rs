//! Head writers and the chunked encoder: serialize into a `BytesMut`,
//! refusing names and values that would change the message's meaning on the
//! wire (CR/LF injection).

use bytes::{Bytes, BytesMut};

use super::{BodyFraming, HttpError};

/// The end of a chunked body: the zero-size last chunk and an empty trailer
/// section.
pub const CHUNKED_END: &[u8] = b"0\r\n\r\n";

/// The CRLF that follows each chunk's data.
pub const CHUNK_DATA_END: &[u8] = b"\r\n";

/// The interim response a server sends to `Expect: 100-continue`.
pub const CONTINUE_100: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// A chunk-size line (`<hex>\r\n`) built on the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    bytes: [u8; 18],
    len_bytes: u8,
}

impl ChunkHeader {
    /// The line's bytes, e.g. `b"1a\r\n"`.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len_bytes)]
    }
}

/// The chunk-size line for a chunk of `data_len` bytes. The wire form of a
/// chunk is this line, the data, then [`CHUNK_DATA_END`]; a body ends with
/// [`CHUNKED_END`]. Never encode a zero-length data chunk: `0\r\n` ends the
/// body.
pub fn encode_chunk_header(data_len: usize) -> ChunkHeader {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut n = data_len as u64;
    let mut count = 0usize;
    loop {
        digits[15 - count] = HEX[(n & 0xf) as usize];
        count += 1;
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    let mut bytes = [0u8; 18];
    bytes[..count].copy_from_slice(&digits[16 - count..]);
    bytes[count] = b'\r';
    bytes[count + 1] = b'\n';
    ChunkHeader {
        bytes,
        // At most 16 hex digits plus CRLF: fits in u8.
        len_bytes: (count + 2) as u8,
    }
}

/// Chunks shorter than this take their size line from [`SIZE_LINES`].
const SIZE_LINES_BELOW: usize = 0x1000;

/// The size lines of every chunk length below [`SIZE_LINES_BELOW`], back
/// to back: `0\r\n1\r\n…f\r\n10\r\n…fff\r\n`.
static SIZE_LINES: [u8; size_line_offset(SIZE_LINES_BELOW)] = size_lines();

/// Where the size line of a chunk of `data_len` bytes starts in
/// [`SIZE_LINES`]: one hex digit below 0x10, two below 0x100, three
/// below 0x1000, each line followed by CRLF.
const fn size_line_offset(data_len: usize) -> usize {
    if data_len < 0x10 {
        data_len * 3
    } else if data_len < 0x100 {
        0x10 * 3 + (data_len - 0x10) * 4
    } else {
        0x10 * 3 + 0xf0 * 4 + (data_len - 0x100) * 5
    }
}

const fn size_lines() -> [u8; size_line_offset(SIZE_LINES_BELOW)] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut lines = [0u8; size_line_offset(SIZE_LINES_BELOW)];
    let mut data_len = 0;
    while data_len < SIZE_LINES_BELOW {
        let digits = if data_len < 0x10 {
            1
        } else if data_len < 0x100 {
            2
        } else {
            3
        };
        let at = size_line_offset(data_len);
        let mut digit = 0;
        while digit < digits {
            let shift = 4 * (digits - 1 - digit);
            lines[at + digit] = HEX[(data_len >> shift) & 0xf];
            digit += 1;
        }
        lines[at + digits] = b'\r';
        lines[at + digits + 1] = b'\n';
        data_len += 1;
    }
    lines
}

/// The chunk-size line for a chunk of `data_len` bytes as `Bytes` of its
/// own: for chunks under 4 KiB (every streamed token) a slice of a static
/// table, so sending a chunk allocates nothing and a connection keeps no
/// buffer for its size lines.
pub fn chunk_size_line(data_len: usize) -> Bytes {
    if data_len < SIZE_LINES_BELOW {
        let start = size_line_offset(data_len);
        let end = size_line_offset(data_len + 1);
        Bytes::from_static(&SIZE_LINES[start..end])
    } else {
        Bytes::copy_from_slice(encode_chunk_header(data_len).as_bytes())
    }
}

/// Where a head is written: a buffer, or [`HeadLen`], which only counts so
/// a head can be sized before it is written (a request head that may carry
/// a credential is written once into wiping memory of its exact size).
pub trait HeadSink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);
    /// Bytes written so far.
    fn written(&self) -> usize;
    /// Drops everything after the first `len` bytes.
    fn truncate_to(&mut self, len: usize);
}

/// [`HeadSink`] for the growable byte buffers (same method names on each).
macro_rules! buffer_head_sink {
    ($($buffer:ty),*) => {$(
        impl HeadSink for $buffer {
            fn put(&mut self, bytes: &[u8]) {
                self.extend_from_slice(bytes);
            }

            fn written(&self) -> usize {
                self.len()
            }

            fn truncate_to(&mut self, len: usize) {
                self.truncate(len);
            }
        }
    )*};
}

buffer_head_sink!(BytesMut, Vec<u8>);

/// A [`HeadSink`] that only counts the bytes a head takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeadLen(pub usize);

impl HeadSink for HeadLen {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }

    fn written(&self) -> usize {
        self.0
    }

    fn truncate_to(&mut self, len: usize) {
        self.0 = self.0.min(len);
    }
}

/// Writes `HTTP/1.1 <status> <reason>\r\n`, the caller's headers, the
/// framing header for `framing`, an optional `connection: close`, and the
/// blank line.
///
/// Caller headers named `content-length` or `transfer-encoding` are skipped:
/// framing belongs to `framing`. `connection: close` is added when
/// `connection_close` is set and the caller gave no `connection` header.
/// [`BodyFraming::None`] and [`BodyFraming::CloseDelimited`] write no
/// framing header. Statuses outside `200..=999` (and `101`) are refused.
pub fn write_response_head<I, K, V>(
    dst: &mut BytesMut,
    status: u16,
    headers: I,
    framing: BodyFraming,
    connection_close: bool,
) -> Result<(), HttpError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<[u8]>,
{
    if !(status == 101 || (200..=999).contains(&status)) {
        return Err(HttpError::InvalidStatus { status });
    }
    let start = dst.len();
    dst.put(b"HTTP/1.1 ");
    push_decimal(dst, u64::from(status));
    dst.put(b" ");
    dst.put(canonical_reason(status).as_bytes());
    dst.put(b"\r\n");
    write_fields(dst, start, headers, framing, connection_close)
}

/// Writes `<method> <target> HTTP/1.1\r\n`, the caller's headers, the
/// framing header for `framing` and the blank line. Same header rules as
/// [`write_response_head`]; `connection_close` adds `connection: close`.
pub fn write_request_head<D, I, K, V>(
    dst: &mut D,
    method: &str,
    target: &str,
    headers: I,
    framing: BodyFraming,
    connection_close: bool,
) -> Result<(), HttpError>
where
    D: HeadSink + ?Sized,
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<[u8]>,
{
    let target_ok = !target.is_empty() && target.bytes().all(|b| (0x21..=0x7e).contains(&b));
    if !is_token(method.as_bytes()) || !target_ok {
        return Err(HttpError::InvalidRequestLine);
    }
    let start = dst.written();
    dst.put(method.as_bytes());
    dst.put(b" ");
    dst.put(target.as_bytes());
    dst.put(b" HTTP/1.1\r\n");
    write_fields(dst, start, headers, framing, connection_close)
}

/// Writes the header fields and the blank line that follow a start line
/// written from offset `start` of `dst`. On a refused header, `dst` is
/// truncated back to `start`: nothing of the head stays written.
fn write_fields<D, I, K, V>(
    dst: &mut D,
    start: usize,
    headers: I,
    framing: BodyFraming,
    connection_close: bool,
) -> Result<(), HttpError>
where
    D: HeadSink + ?Sized,
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<[u8]>,
{
    let mut caller_connection = false;
    for (name, value) in headers {
        let name = name.as_ref();
        let value = value.as_ref();
        if !is_token(name.as_bytes()) || !is_field_value(value) {
            dst.truncate_to(start);
            return Err(HttpError::InvalidOutgoingHeader {
                name: name.to_owned(),
            });
        }
        if name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("transfer-encoding")
        {
            continue;
        }
        caller_connection |= name.eq_ignore_ascii_case("connection");
        dst.put(name.as_bytes());
        dst.put(b": ");
        dst.put(value);
        dst.put(b"\r\n");
    }
    match framing {
        BodyFraming::ContentLength { len_bytes } => {
            dst.put(b"content-length: ");
            push_decimal(dst, len_bytes);
            dst.put(b"\r\n");
        }
        BodyFraming::Chunked => dst.put(b"transfer-encoding: chunked\r\n"),
        BodyFraming::None | BodyFraming::CloseDelimited => {}
    }
    if connection_close && !caller_connection {
        dst.put(b"connection: close\r\n");
    }
    dst.put(b"\r\n");
    Ok(())
}

fn push_decimal<D: HeadSink + ?Sized>(dst: &mut D, n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        // n % 10 < 10: the cast is exact.
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    dst.put(&digits[at..]);
}

/// RFC 9110 `token` (method, header name).
fn is_token(s: &[u8]) -> bool {
    !s.is_empty()
        && s.iter().all(|&b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        })
}

/// A field value we are willing to send: HTAB, SP, visible ASCII and
/// obs-text; never CR, LF, NUL or other controls.
fn is_field_value(v: &[u8]) -> bool {
    v.iter().all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// Whether `name` is a message framing header (`content-length`,
/// `transfer-encoding`): a relay that frames the body itself (chunked
/// towards its client) drops the peer's.
pub fn is_framing(name: &str) -> bool {
    name.eq_ignore_ascii_case("content-length") || name.eq_ignore_ascii_case("transfer-encoding")
}

/// Whether `name` is a hop-by-hop header (RFC 9110 §7.6.1) that a relay must
/// not forward. The one list of them: every relay of both binaries uses it.
pub fn is_hop_by_hop(name: &str) -> bool {
    [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ]
    .iter()
    .any(|h| name.eq_ignore_ascii_case(h))
}

/// The standard reason phrase for `status` (empty for unknown codes).
pub fn canonical_reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        417 => "Expectation Failed",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_lines_match_the_encoder_for_every_length() {
        for data_len in (0..=SIZE_LINES_BELOW + 2).chain([65_535, 1 << 20, usize::MAX]) {
            assert_eq!(
                &chunk_size_line(data_len)[..],
                encode_chunk_header(data_len).as_bytes(),
                "{data_len}"
            );
        }
        assert_eq!(&chunk_size_line(0xfff)[..], b"fff\r\n");
        assert_eq!(&chunk_size_line(0x1000)[..], b"1000\r\n");
    }

    #[test]
    fn chunk_headers() {
        assert_eq!(encode_chunk_header(0).as_bytes(), b"0\r\n");
        assert_eq!(encode_chunk_header(1).as_bytes(), b"1\r\n");
        assert_eq!(encode_chunk_header(26).as_bytes(), b"1a\r\n");
        assert_eq!(encode_chunk_header(4096).as_bytes(), b"1000\r\n");
        assert_eq!(
            encode_chunk_header(usize::MAX).as_bytes(),
            b"ffffffffffffffff\r\n"
        );
    }

    #[test]
    fn response_head_with_length() {
        let mut dst = BytesMut::new();
        write_response_head(
            &mut dst,
            200,
            [
                ("content-type", "application/json"),
                ("x-a", "1"),
                ("X-A", "2"),
            ],
            BodyFraming::ContentLength { len_bytes: 12 },
            false,
        )
        .unwrap();
        assert_eq!(
            &dst[..],
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-a: 1\r\nX-A: 2\r\ncontent-length: 12\r\n\r\n"
        );
    }

    #[test]
    fn response_head_chunked_close_and_framing_headers_dropped() {
        let mut dst = BytesMut::new();
        write_response_head(
            &mut dst,
            599,
            [("Content-Length", "5"), ("Transfer-Encoding", "gzip")],
            BodyFraming::Chunked,
            true,
        )
        .unwrap();
        assert_eq!(
            &dst[..],
            b"HTTP/1.1 599 \r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
    }

    #[test]
    fn caller_connection_header_wins() {
        let mut dst = BytesMut::new();
        write_response_head(
            &mut dst,
            204,
            [("Connection", "close")],
            BodyFraming::None,
            true,
        )
        .unwrap();
        assert_eq!(
            &dst[..],
            b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn request_head() {
        let mut dst = BytesMut::new();
        write_request_head(
            &mut dst,
            "POST",
            "/v1/chat/completions",
            [("host", "127.0.0.1:8000")],
            BodyFraming::ContentLength { len_bytes: 2 },
            false,
        )
        .unwrap();
        assert_eq!(
            &dst[..],
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\ncontent-length: 2\r\n\r\n"
        );
    }

    #[test]
    fn injection_is_refused_and_nothing_is_written() {
        let mut dst = BytesMut::from(&b"keep"[..]);
        let err = write_response_head(
            &mut dst,
            200,
            [("x-ok", "1"), ("x-evil", "a\r\nset-cookie: b")],
            BodyFraming::None,
            false,
        )
        .unwrap_err();
        assert!(matches!(err, HttpError::InvalidOutgoingHeader { ref name } if name == "x-evil"));
        assert_eq!(&dst[..], b"keep");
        for (name, value) in [("bad name", "v"), ("", "v"), ("x", "a\nb"), ("x", "a\0b")] {
            let err = write_request_head(
                &mut dst,
                "GET",
                "/",
                [(name, value)],
                BodyFraming::None,
                false,
            )
            .unwrap_err();
            assert!(
                matches!(err, HttpError::InvalidOutgoingHeader { .. }),
                "{name:?}"
            );
        }
        for (method, target) in [
            ("GE T", "/"),
            ("GET", "/a b"),
            ("GET", ""),
            ("", "/"),
            ("GET", "/\r\n"),
        ] {
            let err = write_request_head(
                &mut dst,
                method,
                target,
                [("a", "b")],
                BodyFraming::None,
                false,
            )
            .unwrap_err();
            assert!(
                matches!(err, HttpError::InvalidRequestLine),
                "{method:?} {target:?}"
            );
        }
        assert_eq!(&dst[..], b"keep");
    }

    #[test]
    fn informational_statuses_are_refused() {
        let mut dst = BytesMut::new();
        for status in [0, 99, 100, 103, 199, 1000] {
            let err = write_response_head(&mut dst, status, [("a", "b")], BodyFraming::None, false)
                .unwrap_err();
            assert!(matches!(err, HttpError::InvalidStatus { status: s } if s == status));
        }
        assert!(dst.is_empty());
    }

    #[test]
    fn hop_by_hop_names() {
        assert!(is_hop_by_hop("Transfer-Encoding"));
        assert!(is_hop_by_hop("connection"));
        assert!(!is_hop_by_hop("content-type"));
        assert!(!is_hop_by_hop("content-length"));
        assert!(is_framing("Content-Length") && is_framing("transfer-encoding"));
        assert!(!is_framing("content-type"));
    }
}
