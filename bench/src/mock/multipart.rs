//! A bounded, streaming `multipart/form-data` parser (RFC 7578 / RFC 2046)
//! for the mock's audio uploads.
//!
//! [`Parser::feed`] takes the body in pieces of any size and hands each
//! part's head and data to a [`Sink`] as soon as they are known; it keeps
//! at most one delimiter's length of data, and at most [`MAX_HEAD_BYTES`]
//! of a part's header section, whatever the input. [`Parser::finish`]
//! checks the closing delimiter was seen. Every malformation is a
//! [`MultipartError`] naming what was wrong; nothing panics.
//!
//! Not supported (a mock needs none): nested `multipart/mixed`, header
//! folding, `Content-Transfer-Encoding`, RFC 2231 `filename*`.

/// The longest boundary RFC 2046 allows.
pub const MAX_BOUNDARY_BYTES: usize = 70;

/// The longest header section of one part (its final blank line included).
pub const MAX_HEAD_BYTES: usize = 8 * 1024;

/// The most parts one body may have.
pub const MAX_PARTS: usize = 64;

/// What is wrong with a multipart body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MultipartError {
    /// The `Content-Type` is not `multipart/form-data`.
    #[error("content-type must be multipart/form-data (got {0:?})")]
    NotMultipart(String),
    /// The `Content-Type` names no boundary.
    #[error("multipart content-type has no boundary parameter")]
    NoBoundary,
    /// The boundary is empty or longer than 70 bytes.
    #[error("multipart boundary must be 1 to 70 bytes (got {0})")]
    BadBoundary(usize),
    /// The body ended before its first delimiter.
    #[error("multipart body has no opening boundary delimiter")]
    NoOpeningDelimiter,
    /// A delimiter is followed by neither CRLF nor `--`.
    #[error("multipart boundary delimiter not followed by CRLF or \"--\"")]
    BadDelimiter,
    /// A part's header section exceeds [`MAX_HEAD_BYTES`].
    #[error("multipart part headers exceed {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    /// A header line has no colon, or is not UTF-8.
    #[error("malformed multipart part header line")]
    BadHeader,
    /// A part without `Content-Disposition: form-data; name="…"`.
    #[error("multipart part without content-disposition form-data name")]
    NoName,
    /// More than [`MAX_PARTS`] parts.
    #[error("multipart body has more than {MAX_PARTS} parts")]
    TooManyParts,
    /// The body ended inside a part (no closing delimiter).
    #[error("multipart body truncated: no closing boundary delimiter")]
    Truncated,
    /// The form's content is refused by the [`Sink`] (the message says why).
    #[error("{0}")]
    Form(String),
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Result<String, MultipartError> {
    let mut params = content_type.split(';');
    let essence = params.next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("multipart/form-data") {
        return Err(MultipartError::NotMultipart(essence.to_string()));
    }
    let value = params
        .filter_map(|p| p.split_once('='))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, value)| value.trim())
        .ok_or(MultipartError::NoBoundary)?;
    let value = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    if value.is_empty() || value.len() > MAX_BOUNDARY_BYTES {
        return Err(MultipartError::BadBoundary(value.len()));
    }
    Ok(value.to_string())
}

/// The head of one part.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartHead {
    /// `Content-Disposition` `name`.
    pub name: String,
    /// `Content-Disposition` `filename`, if any.
    pub filename: Option<String>,
    /// `Content-Type`, if any.
    pub content_type: Option<String>,
}

/// Receives what the parser finds, in order: for each part
/// `start`, `data` zero or more times, `end`.
pub trait Sink {
    /// A part begins.
    fn start(&mut self, head: &PartHead) -> Result<(), MultipartError>;
    /// The next bytes of the current part (never empty).
    fn data(&mut self, bytes: &[u8]) -> Result<(), MultipartError>;
    /// The current part ended.
    fn end(&mut self) -> Result<(), MultipartError>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first delimiter.
    Preamble,
    /// Just after a delimiter: CRLF (a part) or `--` (the end) is next.
    AfterDelimiter,
    /// In a part's header section.
    Head,
    /// In a part's data.
    Body,
    /// After the closing delimiter; the epilogue is ignored.
    Done,
}

/// The streaming parser of one body.
#[derive(Debug)]
pub struct Parser {
    /// `CRLF--boundary`.
    delimiter: Vec<u8>,
    state: State,
    buf: Vec<u8>,
    /// In a part's data: bytes at the front of `buf` that are not data
    /// (the CRLF put back by `head`, so a delimiter right after the header
    /// section is found).
    skip: usize,
    parts: usize,
}

impl Parser {
    /// A parser of a body with `boundary` (see [`boundary`]).
    pub fn new(boundary: &str) -> Self {
        let mut delimiter = b"\r\n--".to_vec();
        delimiter.extend_from_slice(boundary.as_bytes());
        Self {
            delimiter,
            state: State::Preamble,
            // The opening delimiter may start the body without a CRLF:
            // behave as if one came first.
            buf: b"\r\n".to_vec(),
            skip: 0,
            parts: 0,
        }
    }

    /// Parses the next piece of the body.
    pub fn feed(&mut self, bytes: &[u8], sink: &mut impl Sink) -> Result<(), MultipartError> {
        if self.state == State::Done {
            return Ok(());
        }
        self.buf.extend_from_slice(bytes);
        loop {
            let progressed = match self.state {
                State::Preamble => self.preamble(),
                State::AfterDelimiter => self.after_delimiter()?,
                State::Head => self.head(sink)?,
                State::Body => self.body(sink)?,
                State::Done => {
                    self.buf.clear();
                    return Ok(());
                }
            };
            if !progressed {
                return Ok(());
            }
        }
    }

    /// Checks the body ended after its closing delimiter.
    pub fn finish(&self) -> Result<(), MultipartError> {
        match self.state {
            State::Done => Ok(()),
            State::Preamble => Err(MultipartError::NoOpeningDelimiter),
            _ => Err(MultipartError::Truncated),
        }
    }

    fn preamble(&mut self) -> bool {
        match find(&self.buf, &self.delimiter) {
            Some(at) => {
                self.buf.drain(..at + self.delimiter.len());
                self.state = State::AfterDelimiter;
                true
            }
            None => {
                // Keep only what may begin a delimiter.
                let keep = self.delimiter.len() - 1;
                let cut = self.buf.len().saturating_sub(keep);
                self.buf.drain(..cut);
                false
            }
        }
    }

    fn after_delimiter(&mut self) -> Result<bool, MultipartError> {
        if self.buf.len() < 2 {
            return Ok(false);
        }
        match &self.buf[..2] {
            b"--" => {
                self.state = State::Done;
                Ok(true)
            }
            b"\r\n" => {
                self.parts += 1;
                if self.parts > MAX_PARTS {
                    return Err(MultipartError::TooManyParts);
                }
                self.buf.drain(..2);
                self.state = State::Head;
                Ok(true)
            }
            _ => Err(MultipartError::BadDelimiter),
        }
    }

    fn head(&mut self, sink: &mut impl Sink) -> Result<bool, MultipartError> {
        // An empty header section is a lone CRLF.
        let end = if self.buf.starts_with(b"\r\n") {
            Some((0, 2))
        } else {
            find(&self.buf, b"\r\n\r\n").map(|at| (at, at + 4))
        };
        let Some((text_end, consumed)) = end else {
            if self.buf.len() >= MAX_HEAD_BYTES {
                return Err(MultipartError::HeadTooLarge);
            }
            return Ok(false);
        };
        if consumed > MAX_HEAD_BYTES {
            return Err(MultipartError::HeadTooLarge);
        }
        let head = parse_head(&self.buf[..text_end])?;
        self.buf.drain(..consumed);
        sink.start(&head)?;
        // The delimiter search of the body includes the CRLF before it;
        // an empty part is followed by the delimiter at once.
        self.buf.splice(0..0, b"\r\n".iter().copied());
        self.skip = 2;
        self.state = State::Body;
        Ok(true)
    }

    fn body(&mut self, sink: &mut impl Sink) -> Result<bool, MultipartError> {
        match find(&self.buf, &self.delimiter) {
            Some(at) => {
                if at > self.skip {
                    sink.data(&self.buf[self.skip..at])?;
                }
                sink.end()?;
                self.buf.drain(..at + self.delimiter.len());
                self.state = State::AfterDelimiter;
                Ok(true)
            }
            None => {
                let keep = self.delimiter.len() - 1;
                let cut = self.buf.len().saturating_sub(keep);
                if cut > self.skip {
                    sink.data(&self.buf[self.skip..cut])?;
                    self.buf.drain(..cut);
                    self.skip = 0;
                }
                Ok(false)
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn parse_head(text: &[u8]) -> Result<PartHead, MultipartError> {
    let text = std::str::from_utf8(text).map_err(|_| MultipartError::BadHeader)?;
    let mut head = PartHead::default();
    let mut named = false;
    for line in text.split("\r\n").filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').ok_or(MultipartError::BadHeader)?;
        let name = name.trim();
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-disposition") {
            let mut params = value.split(';');
            if !params
                .next()
                .is_some_and(|d| d.trim().eq_ignore_ascii_case("form-data"))
            {
                return Err(MultipartError::NoName);
            }
            for param in params {
                let Some((key, raw)) = param.split_once('=') else {
                    continue;
                };
                let raw = raw.trim();
                let value = raw
                    .strip_prefix('"')
                    .and_then(|v| v.strip_suffix('"'))
                    .unwrap_or(raw)
                    .to_string();
                match key.trim().to_ascii_lowercase().as_str() {
                    "name" => {
                        head.name = value;
                        named = true;
                    }
                    "filename" => head.filename = Some(value),
                    _ => {}
                }
            }
        } else if name.eq_ignore_ascii_case("content-type") {
            head.content_type = Some(value.to_string());
        }
    }
    if !named {
        return Err(MultipartError::NoName);
    }
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records every event as text.
    #[derive(Default)]
    struct Record(Vec<String>);

    impl Sink for Record {
        fn start(&mut self, head: &PartHead) -> Result<(), MultipartError> {
            self.0.push(format!(
                "start {} {:?} {:?}",
                head.name, head.filename, head.content_type
            ));
            Ok(())
        }
        fn data(&mut self, bytes: &[u8]) -> Result<(), MultipartError> {
            assert!(!bytes.is_empty());
            match self.0.last_mut() {
                Some(last) if last.starts_with("data ") => {
                    last.push_str(&String::from_utf8_lossy(bytes));
                }
                _ => self
                    .0
                    .push(format!("data {}", String::from_utf8_lossy(bytes))),
            }
            Ok(())
        }
        fn end(&mut self) -> Result<(), MultipartError> {
            self.0.push("end".into());
            Ok(())
        }
    }

    const BODY: &[u8] = b"preamble\r\n--XyZ\r\n\
Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
Content-Type: audio/wav\r\n\r\n\
RIFF\r\n--Xy\r\n-data ab--XyZ--\r\n\
--XyZ\r\ncontent-disposition: form-data; name=model\r\n\r\n\
whisper-1\r\n--XyZ\r\nContent-Disposition: form-data; name=\"empty\"\r\n\r\n\
\r\n--XyZ--\r\nepilogue";

    fn parse_in_pieces(body: &[u8], piece: usize) -> Result<Vec<String>, MultipartError> {
        let mut parser = Parser::new("XyZ");
        let mut record = Record::default();
        for chunk in body.chunks(piece) {
            parser.feed(chunk, &mut record)?;
        }
        parser.finish()?;
        Ok(record.0)
    }

    #[test]
    fn parts_are_the_same_whatever_the_piece_size() {
        let expected = vec![
            r#"start file Some("a.wav") Some("audio/wav")"#.to_string(),
            "data RIFF\r\n--Xy\r\n-data ab--XyZ--".into(),
            "start model None None".into(),
            "data whisper-1".into(),
            "end".into(),
            "start empty None None".into(),
            "end".into(),
        ];
        let mut with_first_end = expected.clone();
        with_first_end.insert(2, "end".into());
        for piece in 1..=BODY.len() {
            assert_eq!(
                parse_in_pieces(BODY, piece).expect("valid body"),
                with_first_end,
                "piece size {piece}"
            );
        }
    }

    #[test]
    fn a_body_starting_with_the_delimiter_has_no_preamble() {
        let body = b"--b\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n1\r\n--b--";
        let mut parser = Parser::new("b");
        let mut record = Record::default();
        parser.feed(body, &mut record).expect("valid");
        parser.finish().expect("complete");
        assert_eq!(record.0, ["start x None None", "data 1", "end"]);
    }

    #[test]
    fn boundary_comes_from_the_content_type() {
        assert_eq!(
            boundary("multipart/form-data; boundary=abc").as_deref(),
            Ok("abc")
        );
        assert_eq!(
            boundary("Multipart/Form-Data;charset=utf-8; BOUNDARY=\"a b\"").as_deref(),
            Ok("a b")
        );
        assert_eq!(
            boundary("multipart/form-data"),
            Err(MultipartError::NoBoundary)
        );
        assert_eq!(
            boundary("multipart/form-data; boundary="),
            Err(MultipartError::BadBoundary(0))
        );
        assert_eq!(
            boundary(&format!("multipart/form-data; boundary={}", "a".repeat(71))),
            Err(MultipartError::BadBoundary(71))
        );
        assert_eq!(
            boundary("application/json"),
            Err(MultipartError::NotMultipart("application/json".into()))
        );
    }

    #[test]
    fn hostile_bodies_fail_with_the_reason_and_never_panic() {
        let cases: [(&[u8], MultipartError); 6] = [
            (b"no delimiter at all", MultipartError::NoOpeningDelimiter),
            (b"", MultipartError::NoOpeningDelimiter),
            (
                b"--XyZ\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nabc",
                MultipartError::Truncated,
            ),
            (
                b"--XyZ\r\nContent-Disposition: form-data; name=\"f\"\r\n",
                MultipartError::Truncated,
            ),
            (b"--XyZxx", MultipartError::BadDelimiter),
            (b"--XyZ", MultipartError::Truncated),
        ];
        for (body, error) in cases {
            for piece in [1, 3, 1000] {
                let mut parser = Parser::new("XyZ");
                let mut record = Record::default();
                let result = body
                    .chunks(piece)
                    .try_for_each(|c| parser.feed(c, &mut record))
                    .and_then(|()| parser.finish());
                assert_eq!(
                    result,
                    Err(error.clone()),
                    "{:?}",
                    String::from_utf8_lossy(body)
                );
            }
        }
        let bad_heads: [(&[u8], MultipartError); 3] = [
            (
                b"--XyZ\r\nno colon here\r\n\r\nx\r\n--XyZ--",
                MultipartError::BadHeader,
            ),
            (
                b"--XyZ\r\nContent-Type: text/plain\r\n\r\nx\r\n--XyZ--",
                MultipartError::NoName,
            ),
            (
                b"--XyZ\r\nContent-Disposition: attachment; name=a\r\n\r\nx\r\n--XyZ--",
                MultipartError::NoName,
            ),
        ];
        for (body, error) in bad_heads {
            assert_eq!(parse_in_pieces(body, 5), Err(error));
        }
    }

    #[test]
    fn huge_heads_are_refused_with_bounded_memory() {
        let mut parser = Parser::new("XyZ");
        let mut record = Record::default();
        parser
            .feed(b"--XyZ\r\nX-Filler: ", &mut record)
            .expect("head begins");
        let filler = vec![b'a'; 1024];
        let mut result = Ok(());
        for _ in 0..64 {
            result = parser.feed(&filler, &mut record);
            assert!(parser.buf.len() <= MAX_HEAD_BYTES + filler.len());
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(MultipartError::HeadTooLarge));
    }

    #[test]
    fn long_preambles_and_bodies_keep_only_a_delimiter_of_data() {
        let mut parser = Parser::new("XyZ");
        let mut record = Record::default();
        for _ in 0..100 {
            parser.feed(&[b'p'; 1000], &mut record).expect("preamble");
            assert!(parser.buf.len() < 8);
        }
        parser
            .feed(
                b"\r\n--XyZ\r\nContent-Disposition: form-data; name=f\r\n\r\n",
                &mut record,
            )
            .expect("head");
        for _ in 0..100 {
            parser.feed(&[b'd'; 1000], &mut record).expect("data");
            assert!(parser.buf.len() < 10);
        }
        parser.feed(b"\r\n--XyZ--", &mut record).expect("end");
        parser.finish().expect("complete");
        assert_eq!(record.0.len(), 3);
        assert_eq!(record.0[1].len(), "data ".len() + 100_000);
    }

    #[test]
    fn too_many_parts_are_refused() {
        let mut body = Vec::new();
        for i in 0..=MAX_PARTS {
            body.extend_from_slice(
                format!("--XyZ\r\nContent-Disposition: form-data; name=p{i}\r\n\r\nv\r\n")
                    .as_bytes(),
            );
        }
        body.extend_from_slice(b"--XyZ--");
        assert_eq!(
            parse_in_pieces(&body, 4096),
            Err(MultipartError::TooManyParts)
        );
    }
}
