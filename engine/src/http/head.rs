//! Request and response heads: incremental, capped parsing on httparse and
//! the body framing each head implies (RFC 9112 §6).

use bytes::{Buf, Bytes, BytesMut};

use super::{HttpError, Limits};

/// Header slots kept on the stack; larger `max_headers` use the heap.
const STACK_HEADER_SLOTS: usize = 64;

/// HTTP/1.x minor version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// HTTP/1.0: close after each message unless `Connection: keep-alive`.
    Http10,
    /// HTTP/1.1: keep-alive unless `Connection: close`.
    Http11,
}

/// One header field as received: the name keeps its original case, the
/// value is a slice of the head's bytes (no copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Field name, case as received (compare with `eq_ignore_ascii_case`).
    pub name: String,
    /// Field value without surrounding whitespace.
    pub value: Bytes,
}

/// How a message body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body at all (requests without framing headers; 1xx/204/304
    /// responses; responses to HEAD).
    None,
    /// Exactly `len_bytes` bytes follow the head.
    ContentLength {
        /// The declared body length.
        len_bytes: u64,
    },
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// The body runs until the peer closes the connection (responses only).
    CloseDelimited,
}

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// Method token as received (`GET`, `POST`, …).
    pub method: String,
    /// Request target as received (`/v1/chat/completions?x=1`).
    pub target: String,
    /// Protocol version.
    pub version: Version,
    /// Header fields in wire order, duplicates kept.
    pub headers: Vec<Header>,
    /// Body framing derived from `Content-Length`/`Transfer-Encoding`.
    pub framing: BodyFraming,
    /// Whether the connection may carry another request after this one.
    pub keep_alive: bool,
    /// The client sent `Expect: 100-continue` (HTTP/1.1 only).
    pub expect_continue: bool,
}

/// A parsed response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// Protocol version.
    pub version: Version,
    /// Status code (`100..=999`).
    pub status: u16,
    /// Reason phrase as received (may be empty).
    pub reason: String,
    /// Header fields in wire order, duplicates kept.
    pub headers: Vec<Header>,
    /// Body framing derived from the status, the request method and the
    /// framing headers.
    pub framing: BodyFraming,
    /// Whether the server lets the connection carry another request after
    /// this response's body (false for close-delimited bodies).
    pub keep_alive: bool,
}

impl RequestHead {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&Bytes> {
        first_header(&self.headers, name)
    }

    /// Every value of header `name` (case-insensitive), in wire order.
    pub fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Bytes> + 'a {
        all_headers(&self.headers, name)
    }

    /// Whether this is a `HEAD` request (its response carries no body).
    pub fn is_head(&self) -> bool {
        self.method == "HEAD"
    }
}

impl ResponseHead {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&Bytes> {
        first_header(&self.headers, name)
    }

    /// Every value of header `name` (case-insensitive), in wire order.
    pub fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Bytes> + 'a {
        all_headers(&self.headers, name)
    }

    /// Whether this is an interim `1xx` response that precedes the final
    /// one (`101 Switching Protocols` is final).
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.status) && self.status != 101
    }
}

fn first_header<'a>(headers: &'a [Header], name: &str) -> Option<&'a Bytes> {
    headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case(name))
        .map(|h| &h.value)
}

fn all_headers<'a>(headers: &'a [Header], name: &'a str) -> impl Iterator<Item = &'a Bytes> + 'a {
    headers
        .iter()
        .filter(move |h| h.name.eq_ignore_ascii_case(name))
        .map(|h| &h.value)
}

/// Parses a request head from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` holds only part of a head (read more and
/// call again with the longer buffer); on success the head's bytes are
/// removed from `buf` and the body (if any) starts at `buf[0]`. Header
/// values are slices of the removed bytes (no copy).
///
/// Errors: [`HttpError::HeadTooLarge`] once `max_head_bytes` are buffered
/// without a complete head, [`HttpError::TooManyHeaders`],
/// [`HttpError::Malformed`], and the framing errors of RFC 9112 §6.3
/// (conflicting `Content-Length`, `Content-Length` with
/// `Transfer-Encoding`, codings other than `chunked`).
pub fn parse_request_head(
    buf: &mut BytesMut,
    limits: &Limits,
) -> Result<Option<RequestHead>, HttpError> {
    let window = &buf[..buf.len().min(limits.max_head_bytes)];
    let mut stack_slots = [httparse::EMPTY_HEADER; STACK_HEADER_SLOTS];
    let mut heap_slots;
    let slots: &mut [httparse::Header<'_>] = if limits.max_headers <= STACK_HEADER_SLOTS {
        &mut stack_slots[..limits.max_headers]
    } else {
        heap_slots = vec![httparse::EMPTY_HEADER; limits.max_headers];
        &mut heap_slots
    };
    let mut req = httparse::Request::new(slots);
    let head_len = match req.parse(window) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return partial(buf.len(), limits),
        Err(e) => return Err(map_parse_error(e, limits)),
    };
    let method = req.method.unwrap_or_default().to_owned();
    let target = req.path.unwrap_or_default().to_owned();
    let version = version_of(req.version);
    let spans = header_spans(buf, req.headers);
    // A copy, not a slice of `buf`: the header values live as long as the
    // request, and a slice would keep the connection's whole read buffer
    // with them (a few hundred bytes pinning 16 KiB per streaming request).
    let head_bytes = Bytes::copy_from_slice(&buf[..head_len]);
    buf.advance(head_len);
    let headers = materialize(&head_bytes, spans);

    let framing_fields = FramingFields::scan(&headers)?;
    let framing = match (
        framing_fields.content_length,
        framing_fields.transfer_encoding,
    ) {
        (Some(_), Some(_)) => return Err(HttpError::ContentLengthWithTransferEncoding),
        (None, Some(_)) if version == Version::Http10 => {
            return Err(HttpError::TransferEncodingInHttp10)
        }
        (None, Some(coding)) => coding.into_framing()?,
        (Some(len_bytes), None) => BodyFraming::ContentLength { len_bytes },
        (None, None) => BodyFraming::None,
    };
    let keep_alive = keep_alive_of(version, &headers);
    let expect_continue = version == Version::Http11
        && first_header(&headers, "expect")
            .is_some_and(|v| trim_ows(v).eq_ignore_ascii_case(b"100-continue"));
    Ok(Some(RequestHead {
        method,
        target,
        version,
        headers,
        framing,
        keep_alive,
        expect_continue,
    }))
}

/// Parses a response head from the front of `buf` (client side).
///
/// `head_request` says whether the request was `HEAD` (its response has no
/// body whatever the headers say). Same buffer contract as
/// [`parse_request_head`]. Interim `1xx` heads are returned like any other;
/// the caller skips them ([`ResponseHead::is_interim`]).
///
/// Unlike requests, a response with both `Transfer-Encoding: chunked` and
/// `Content-Length` is accepted as chunked (RFC 9112 §6.3: the former
/// overrides) but marked not reusable.
pub fn parse_response_head(
    buf: &mut BytesMut,
    limits: &Limits,
    head_request: bool,
) -> Result<Option<ResponseHead>, HttpError> {
    let window = &buf[..buf.len().min(limits.max_head_bytes)];
    let mut stack_slots = [httparse::EMPTY_HEADER; STACK_HEADER_SLOTS];
    let mut heap_slots;
    let slots: &mut [httparse::Header<'_>] = if limits.max_headers <= STACK_HEADER_SLOTS {
        &mut stack_slots[..limits.max_headers]
    } else {
        heap_slots = vec![httparse::EMPTY_HEADER; limits.max_headers];
        &mut heap_slots
    };
    let mut resp = httparse::Response::new(slots);
    let head_len = match resp.parse(window) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return partial(buf.len(), limits),
        Err(e) => return Err(map_parse_error(e, limits)),
    };
    let status = resp.code.unwrap_or_default();
    let reason = resp.reason.unwrap_or_default().to_owned();
    let version = version_of(resp.version);
    let spans = header_spans(buf, resp.headers);
    let head_bytes = buf.split_to(head_len).freeze();
    let headers = materialize(&head_bytes, spans);

    let mut keep_alive = keep_alive_of(version, &headers);
    let bodiless = head_request || (100..200).contains(&status) || status == 204 || status == 304;
    let framing = if bodiless {
        BodyFraming::None
    } else {
        let framing_fields = FramingFields::scan(&headers)?;
        match (
            framing_fields.content_length,
            framing_fields.transfer_encoding,
        ) {
            (content_length, Some(coding)) => {
                if content_length.is_some() {
                    keep_alive = false;
                }
                coding.into_framing()?
            }
            (Some(len_bytes), None) => BodyFraming::ContentLength { len_bytes },
            (None, None) => BodyFraming::CloseDelimited,
        }
    };
    if framing == BodyFraming::CloseDelimited || status == 101 {
        keep_alive = false;
    }
    Ok(Some(ResponseHead {
        version,
        status,
        reason,
        headers,
        framing,
        keep_alive,
    }))
}

/// Whether parsing `buf` again can give a new answer after the first
/// `scanned_bytes` were already parsed as partial: a head only completes
/// at a LF, and the size cap must still be checked. Shells call this before
/// re-parsing so a head trickling in byte by byte costs one parse per line,
/// not one per read.
pub(crate) fn worth_parsing(buf: &[u8], scanned_bytes: usize, limits: &Limits) -> bool {
    buf.len() >= limits.max_head_bytes
        || buf
            .get(scanned_bytes..)
            .is_some_and(|fresh| fresh.contains(&b'\n'))
}

fn partial<T>(buffered_bytes: usize, limits: &Limits) -> Result<Option<T>, HttpError> {
    if buffered_bytes >= limits.max_head_bytes {
        Err(HttpError::HeadTooLarge {
            max_bytes: limits.max_head_bytes,
        })
    } else {
        Ok(None)
    }
}

fn map_parse_error(e: httparse::Error, limits: &Limits) -> HttpError {
    match e {
        httparse::Error::TooManyHeaders => HttpError::TooManyHeaders {
            max_headers: limits.max_headers,
        },
        other => HttpError::Malformed(other),
    }
}

fn version_of(minor: Option<u8>) -> Version {
    match minor {
        Some(0) => Version::Http10,
        _ => Version::Http11,
    }
}

/// Header names and the byte ranges of their values inside `buf`.
fn header_spans(
    buf: &[u8],
    parsed: &[httparse::Header<'_>],
) -> Vec<(String, std::ops::Range<usize>)> {
    let base = buf.as_ptr() as usize;
    parsed
        .iter()
        .map(|h| {
            let range = if h.value.is_empty() {
                0..0
            } else {
                // httparse hands out subslices of `buf`; the offset is plain
                // address arithmetic (no pointer dereference).
                let start = (h.value.as_ptr() as usize).saturating_sub(base);
                start..start + h.value.len()
            };
            (h.name.to_owned(), range)
        })
        .collect()
}

fn materialize(head_bytes: &Bytes, spans: Vec<(String, std::ops::Range<usize>)>) -> Vec<Header> {
    spans
        .into_iter()
        .map(|(name, range)| {
            let value = if range.end <= head_bytes.len() && !range.is_empty() {
                head_bytes.slice(range)
            } else {
                Bytes::new()
            };
            Header { name, value }
        })
        .collect()
}

/// What `Transfer-Encoding` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coding {
    /// Exactly one coding, `chunked`.
    Chunked,
    /// Anything else (gzip, chunked twice, empty list, …).
    Unsupported,
}

impl Coding {
    fn into_framing(self) -> Result<BodyFraming, HttpError> {
        match self {
            Coding::Chunked => Ok(BodyFraming::Chunked),
            Coding::Unsupported => Err(HttpError::UnsupportedTransferEncoding),
        }
    }
}

/// The framing-relevant header fields of a head.
#[derive(Debug, Default)]
struct FramingFields {
    content_length: Option<u64>,
    transfer_encoding: Option<Coding>,
}

impl FramingFields {
    fn scan(headers: &[Header]) -> Result<Self, HttpError> {
        let mut fields = FramingFields::default();
        let mut codings = 0usize;
        let mut only_chunked = true;
        let mut saw_te = false;
        for h in headers {
            if h.name.eq_ignore_ascii_case("content-length") {
                for item in h.value.split(|&b| b == b',') {
                    let len = parse_decimal(trim_ows(item)).ok_or(HttpError::BadContentLength)?;
                    match fields.content_length {
                        Some(prev) if prev != len => return Err(HttpError::BadContentLength),
                        _ => fields.content_length = Some(len),
                    }
                }
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                saw_te = true;
                for item in h.value.split(|&b| b == b',') {
                    let coding = trim_ows(item);
                    if coding.is_empty() {
                        continue;
                    }
                    codings += 1;
                    only_chunked &= coding.eq_ignore_ascii_case(b"chunked");
                }
            }
        }
        if saw_te {
            fields.transfer_encoding = Some(if codings == 1 && only_chunked {
                Coding::Chunked
            } else {
                Coding::Unsupported
            });
        }
        Ok(fields)
    }
}

/// A non-empty run of ASCII digits that fits `u64`.
pub(crate) fn parse_decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |acc, &b| {
        if b.is_ascii_digit() {
            acc.checked_mul(10)?.checked_add(u64::from(b - b'0'))
        } else {
            None
        }
    })
}

/// Strips optional whitespace (SP / HTAB) from both ends.
pub(crate) fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

fn keep_alive_of(version: Version, headers: &[Header]) -> bool {
    let mut close = false;
    let mut keep_alive = false;
    for value in all_headers(headers, "connection") {
        for token in value.split(|&b| b == b',') {
            let token = trim_ows(token);
            close |= token.eq_ignore_ascii_case(b"close");
            keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
        }
    }
    match version {
        Version::Http11 => !close,
        Version::Http10 => keep_alive && !close,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::default()
    }

    fn req(text: &str) -> Result<Option<RequestHead>, HttpError> {
        let mut buf = BytesMut::from(text.as_bytes());
        parse_request_head(&mut buf, &limits())
    }

    fn resp(text: &str, head_request: bool) -> Result<Option<ResponseHead>, HttpError> {
        let mut buf = BytesMut::from(text.as_bytes());
        parse_response_head(&mut buf, &limits(), head_request)
    }

    fn h(name: &str, value: &str) -> Header {
        Header {
            name: name.to_owned(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        }
    }

    #[test]
    fn request_head_fields_order_and_duplicates() {
        let mut buf = BytesMut::from(
            &b"POST /v1/chat?x=1 HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nx-a:  2 \r\nContent-Length: 3\r\n\r\nabcGET"[..],
        );
        let head = parse_request_head(&mut buf, &limits()).unwrap().unwrap();
        assert_eq!(head.method, "POST");
        assert_eq!(head.target, "/v1/chat?x=1");
        assert_eq!(head.version, Version::Http11);
        assert_eq!(
            head.headers,
            vec![
                h("Host", "a"),
                h("X-A", "1"),
                h("x-a", "2"),
                h("Content-Length", "3")
            ]
        );
        assert_eq!(head.framing, BodyFraming::ContentLength { len_bytes: 3 });
        assert!(head.keep_alive);
        assert!(!head.expect_continue);
        assert_eq!(head.header("x-A").map(|v| &v[..]), Some(&b"1"[..]));
        let all: Vec<&[u8]> = head.header_values("X-a").map(|v| &v[..]).collect();
        assert_eq!(all, vec![&b"1"[..], &b"2"[..]]);
        // The head is consumed; the body starts the buffer.
        assert_eq!(&buf[..], b"abcGET");
    }

    // A request's header values are a copy: they share no memory with the
    // read buffer (which would then live as long as the request), and the
    // bytes after the head stay there, exact.
    #[test]
    fn request_head_values_do_not_share_the_read_buffer() {
        let mut buf = BytesMut::with_capacity(16 * 1024);
        buf.extend_from_slice(b"POST /x HTTP/1.1\r\nhost: h\r\nx-a: value\r\n\r\nBODY");
        let start = buf.as_ptr() as usize;
        let end = start + buf.capacity();
        let head = parse_request_head(&mut buf, &limits()).unwrap().unwrap();
        let value = head.header("x-a").unwrap();
        assert_eq!(&value[..], b"value");
        let at = value.as_ptr() as usize;
        assert!(!(start..end).contains(&at), "a slice of the read buffer");
        assert_eq!(&buf[..], b"BODY");
    }

    #[test]
    fn request_head_split_at_every_byte() {
        let text = b"GET /a HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n";
        for cut in 0..text.len() {
            let mut buf = BytesMut::from(&text[..cut]);
            assert!(
                parse_request_head(&mut buf, &limits()).unwrap().is_none(),
                "cut {cut}"
            );
            assert_eq!(buf.len(), cut, "partial parse must not consume");
            buf.extend_from_slice(&text[cut..]);
            let head = parse_request_head(&mut buf, &limits()).unwrap().unwrap();
            assert_eq!(head.target, "/a");
            assert_eq!(head.headers, vec![h("Host", "x"), h("Accept", "*/*")]);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn keep_alive_rules() {
        let cases = [
            ("GET / HTTP/1.1\r\n\r\n", true),
            ("GET / HTTP/1.1\r\nConnection: close\r\n\r\n", false),
            (
                "GET / HTTP/1.1\r\nConnection: Upgrade, CLOSE\r\n\r\n",
                false,
            ),
            ("GET / HTTP/1.0\r\n\r\n", false),
            ("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", true),
            (
                "GET / HTTP/1.0\r\nConnection: Keep-Alive, close\r\n\r\n",
                false,
            ),
        ];
        for (text, keep_alive) in cases {
            assert_eq!(req(text).unwrap().unwrap().keep_alive, keep_alive, "{text}");
        }
    }

    #[test]
    fn request_framing_rules() {
        let ok = [
            ("GET / HTTP/1.1\r\n\r\n", BodyFraming::None),
            (
                "POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                BodyFraming::ContentLength { len_bytes: 0 },
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 7\r\ncontent-length: 7\r\n\r\n",
                BodyFraming::ContentLength { len_bytes: 7 },
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 7, 7\r\n\r\n",
                BodyFraming::ContentLength { len_bytes: 7 },
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n",
                BodyFraming::Chunked,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: , chunked\r\n\r\n",
                BodyFraming::Chunked,
            ),
        ];
        for (text, framing) in ok {
            assert_eq!(req(text).unwrap().unwrap().framing, framing, "{text}");
        }
    }

    #[test]
    fn request_framing_errors() {
        let bad_cl = [
            "POST / HTTP/1.1\r\nContent-Length: 7\r\nContent-Length: 8\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 7, 8\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length:\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        ];
        for text in bad_cl {
            assert!(
                matches!(req(text), Err(HttpError::BadContentLength)),
                "{text}"
            );
        }
        assert!(matches!(
            req("POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Err(HttpError::ContentLengthWithTransferEncoding)
        ));
        for te in [
            "gzip",
            "gzip, chunked",
            "chunked, chunked",
            "chunked, gzip",
            "",
        ] {
            let text = format!("POST / HTTP/1.1\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert!(
                matches!(req(&text), Err(HttpError::UnsupportedTransferEncoding)),
                "{te}"
            );
        }
        assert!(matches!(
            req("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Err(HttpError::TransferEncodingInHttp10)
        ));
    }

    #[test]
    fn expect_continue_only_on_http11() {
        assert!(
            req("POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 1\r\n\r\n")
                .unwrap()
                .unwrap()
                .expect_continue
        );
        assert!(
            !req("POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n")
                .unwrap()
                .unwrap()
                .expect_continue
        );
    }

    #[test]
    fn head_size_cap() {
        let limits = Limits {
            max_head_bytes: 32,
            ..Limits::default()
        };
        // Exactly at the cap is fine.
        let exact = b"GET / HTTP/1.1\r\nX-Pad: 12345\r\n\r\n";
        assert_eq!(exact.len(), 32);
        let mut buf = BytesMut::from(&exact[..]);
        assert!(parse_request_head(&mut buf, &limits).unwrap().is_some());
        // One byte over, complete or not, is rejected.
        let over = b"GET / HTTP/1.1\r\nX-Pad: 123456\r\n\r\n";
        let mut buf = BytesMut::from(&over[..]);
        assert!(matches!(
            parse_request_head(&mut buf, &limits),
            Err(HttpError::HeadTooLarge { max_bytes: 32 })
        ));
        let mut buf = BytesMut::from(&over[..31]);
        assert!(parse_request_head(&mut buf, &limits).unwrap().is_none());
    }

    #[test]
    fn header_count_cap() {
        let limits = Limits {
            max_headers: 2,
            ..Limits::default()
        };
        let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\n\r\n"[..]);
        assert_eq!(
            parse_request_head(&mut buf, &limits)
                .unwrap()
                .unwrap()
                .headers
                .len(),
            2
        );
        let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n"[..]);
        let err = parse_request_head(&mut buf, &limits).unwrap_err();
        assert!(matches!(err, HttpError::TooManyHeaders { max_headers: 2 }));
        assert_eq!(err.status_code(), 431);
        // Beyond the stack slots the heap is used.
        let limits = Limits {
            max_headers: 100,
            ..Limits::default()
        };
        let mut text = String::from("GET / HTTP/1.1\r\n");
        for i in 0..100 {
            text.push_str(&format!("H{i}: {i}\r\n"));
        }
        text.push_str("\r\n");
        let mut buf = BytesMut::from(text.as_bytes());
        let head = parse_request_head(&mut buf, &limits).unwrap().unwrap();
        assert_eq!(head.headers.len(), 100);
        assert_eq!(head.headers[99], h("H99", "99"));
    }

    #[test]
    fn malformed_heads() {
        for text in [
            "GET / HTTP/2.0\r\n\r\n",
            "G E T / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
            "GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",
            "\x00\x01\x02\r\n\r\n",
        ] {
            let err = req(text).unwrap_err();
            assert!(matches!(err, HttpError::Malformed(_)), "{text:?}: {err:?}");
            assert_eq!(err.status_code(), 400);
        }
    }

    #[test]
    fn response_head_framing() {
        let cases = [
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                false,
                BodyFraming::ContentLength { len_bytes: 5 },
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
                BodyFraming::Chunked,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\n\r\n",
                false,
                BodyFraming::CloseDelimited,
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n",
                false,
                BodyFraming::ContentLength { len_bytes: 1 },
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n",
                false,
                BodyFraming::ContentLength { len_bytes: 1 },
                true,
            ),
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
                false,
                BodyFraming::None,
                true,
            ),
            (
                "HTTP/1.1 304 Not Modified\r\n\r\n",
                false,
                BodyFraming::None,
                true,
            ),
            (
                "HTTP/1.1 100 Continue\r\n\r\n",
                false,
                BodyFraming::None,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                true,
                BodyFraming::None,
                true,
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", true, BodyFraming::None, true),
            (
                "HTTP/1.1 101 Switching Protocols\r\n\r\n",
                false,
                BodyFraming::None,
                false,
            ),
            // Transfer-Encoding overrides Content-Length; not reusable.
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
                false,
                BodyFraming::Chunked,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 5\r\n\r\n",
                false,
                BodyFraming::ContentLength { len_bytes: 5 },
                false,
            ),
        ];
        for (text, head_request, framing, keep_alive) in cases {
            let head = resp(text, head_request).unwrap().unwrap();
            assert_eq!(head.framing, framing, "{text}");
            assert_eq!(head.keep_alive, keep_alive, "{text}");
        }
    }

    #[test]
    fn response_head_fields() {
        let head = resp(
            "HTTP/1.1 404 Not Found\r\nA: 1\r\na: 2\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(head.status, 404);
        assert_eq!(head.reason, "Not Found");
        assert_eq!(head.version, Version::Http11);
        assert_eq!(
            head.headers,
            vec![h("A", "1"), h("a", "2"), h("Content-Length", "0")]
        );
        assert!(!head.is_interim());
        assert!(resp("HTTP/1.1 103 Early Hints\r\n\r\n", false)
            .unwrap()
            .unwrap()
            .is_interim());
        assert!(!resp("HTTP/1.1 101 Switching Protocols\r\n\r\n", false)
            .unwrap()
            .unwrap()
            .is_interim());
    }

    #[test]
    fn response_head_errors() {
        assert!(matches!(
            resp(
                "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                false
            ),
            Err(HttpError::BadContentLength)
        ));
        assert!(matches!(
            resp("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", false),
            Err(HttpError::UnsupportedTransferEncoding)
        ));
        assert!(matches!(
            resp("HTTP/1.1 abc OK\r\n\r\n", false),
            Err(HttpError::Malformed(_))
        ));
    }

    #[test]
    fn response_head_split_at_every_byte() {
        let text = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
        for cut in 0..text.len() {
            let mut buf = BytesMut::from(&text[..cut]);
            assert!(
                parse_response_head(&mut buf, &limits(), false)
                    .unwrap()
                    .is_none(),
                "cut {cut}"
            );
            buf.extend_from_slice(&text[cut..]);
            let head = parse_response_head(&mut buf, &limits(), false)
                .unwrap()
                .unwrap();
            assert_eq!(head.framing, BodyFraming::Chunked);
            assert_eq!(
                head.header("content-type").map(|v| &v[..]),
                Some(&b"text/event-stream"[..])
            );
        }
    }

    #[test]
    fn reparse_only_after_a_new_line_or_at_the_cap() {
        let limits = Limits {
            max_head_bytes: 16,
            ..Limits::default()
        };
        assert!(!worth_parsing(b"GET /", 0, &limits));
        assert!(worth_parsing(b"GET /\r\n", 0, &limits));
        assert!(!worth_parsing(b"GET /\r\nX", 7, &limits));
        assert!(worth_parsing(b"GET /\r\nX\n", 7, &limits));
        assert!(worth_parsing(b"GET /aaaaaaaaaaa", 16, &limits));
    }

    #[test]
    fn decimal_and_ows_helpers() {
        assert_eq!(parse_decimal(b"0"), Some(0));
        assert_eq!(parse_decimal(b"18446744073709551615"), None); // 20 digits
        assert_eq!(
            parse_decimal(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        assert_eq!(parse_decimal(b""), None);
        assert_eq!(parse_decimal(b"1 "), None);
        assert_eq!(trim_ows(b" \t a b\t "), b"a b");
        assert_eq!(trim_ows(b"   "), b"");
    }
}
