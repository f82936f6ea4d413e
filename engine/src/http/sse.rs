//! Server-sent events splitter (WHATWG HTML §9.2 "event stream").
//!
//! Feed body bytes as they arrive; take complete events out. An event is
//! a block of lines ended by a blank line; lines end in CRLF, LF or CR. Two
//! views of the same split:
//!
//! - [`SseSplitter::next_raw`]: the exact original bytes of each block,
//!   its terminating blank line included (lone blank lines come out as
//!   blocks of their own), so the concatenation of all raw blocks plus
//!   [`SseSplitter::take_remainder`] is the input, byte for byte. The Node
//!   relays these unchanged while sniffing them.
//! - [`SseSplitter::next_event`]: parsed fields, `data:` lines joined with
//!   `\n`; blocks with no field and no comment are skipped.
//!
//! A CR at the very end of the buffered input might be the first half of a
//! CRLF, so the splitter waits for the next byte (or [`SseSplitter::finish`])
//! before deciding. Pending bytes are capped.

use bytes::{Bytes, BytesMut};

use super::HttpError;

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A parsed server-sent event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The last `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` fields joined with `\n`; `None` when there was none.
    pub data: Option<String>,
    /// The last `id:` field without NUL, if any.
    pub id: Option<String>,
    /// The last all-digit `retry:` field.
    pub retry_ms: Option<u64>,
    /// Comment lines (`:` lines) without the colon and one leading space.
    pub comments: Vec<String>,
}

impl SseEvent {
    /// Whether the block carried no field and no comment.
    pub fn is_empty(&self) -> bool {
        self.event.is_none()
            && self.data.is_none()
            && self.id.is_none()
            && self.retry_ms.is_none()
            && self.comments.is_empty()
    }
}

/// Incremental, capped SSE block splitter; see the module docs.
#[derive(Debug)]
pub struct SseSplitter {
    buf: BytesMut,
    /// Next byte of `buf` to examine.
    scan_pos: usize,
    /// Start of the line being scanned.
    line_start: usize,
    max_event_bytes: usize,
    eof: bool,
    /// No event has been parsed yet (a leading BOM is dropped from it).
    at_stream_start: bool,
}

impl SseSplitter {
    /// A splitter that refuses events (and pending bytes) longer than
    /// `max_event_bytes`.
    pub fn new(max_event_bytes: usize) -> Self {
        SseSplitter {
            buf: BytesMut::new(),
            scan_pos: 0,
            line_start: 0,
            max_event_bytes,
            eof: false,
            at_stream_start: true,
        }
    }

    /// Appends body bytes. Drain with [`SseSplitter::next_raw`] or
    /// [`SseSplitter::next_event`] after each feed.
    pub fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Marks the end of the stream: a final CR counts as a line end.
    pub fn finish(&mut self) {
        self.eof = true;
    }

    /// Bytes buffered but not yet returned.
    pub fn pending_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Takes the buffered bytes of an unfinished event (at the end of the
    /// stream such an event is dropped by SSE rules; relays forward it).
    pub fn take_remainder(&mut self) -> Bytes {
        self.scan_pos = 0;
        self.line_start = 0;
        self.buf.split().freeze()
    }

    /// The next complete block's exact bytes, terminating blank line
    /// included. `Ok(None)`: feed more.
    pub fn next_raw(&mut self) -> Result<Option<Bytes>, HttpError> {
        loop {
            let Some(offset) = self.buf[self.scan_pos..]
                .iter()
                .position(|&b| b == b'\n' || b == b'\r')
            else {
                self.scan_pos = self.buf.len();
                return self.pending_within_cap();
            };
            let at = self.scan_pos + offset;
            let terminator_bytes = if self.buf[at] == b'\n' {
                1
            } else if at + 1 < self.buf.len() {
                if self.buf[at + 1] == b'\n' {
                    2
                } else {
                    1
                }
            } else if self.eof {
                1
            } else {
                // A CR at the end may be half of a CRLF: wait.
                self.scan_pos = at;
                return self.pending_within_cap();
            };
            let next_line = at + terminator_bytes;
            if at == self.line_start {
                let raw = self.buf.split_to(next_line).freeze();
                self.scan_pos = 0;
                self.line_start = 0;
                if raw.len() > self.max_event_bytes {
                    return Err(HttpError::EventTooLarge {
                        max_bytes: self.max_event_bytes,
                    });
                }
                return Ok(Some(raw));
            }
            self.line_start = next_line;
            self.scan_pos = next_line;
        }
    }

    /// The next parsed event, skipping blocks without fields or comments.
    /// `Ok(None)`: feed more.
    pub fn next_event(&mut self) -> Result<Option<SseEvent>, HttpError> {
        while let Some(raw) = self.next_raw()? {
            let mut block = &raw[..];
            if self.at_stream_start {
                self.at_stream_start = false;
                block = block.strip_prefix(BOM).unwrap_or(block);
            }
            let event = parse_event(block);
            if !event.is_empty() {
                return Ok(Some(event));
            }
        }
        Ok(None)
    }

    fn pending_within_cap<T>(&self) -> Result<Option<T>, HttpError> {
        if self.buf.len() > self.max_event_bytes {
            Err(HttpError::EventTooLarge {
                max_bytes: self.max_event_bytes,
            })
        } else {
            Ok(None)
        }
    }
}

/// Parses one block (as returned by [`SseSplitter::next_raw`]) into its
/// fields. Invalid UTF-8 is replaced (U+FFFD).
pub fn parse_event(block: &[u8]) -> SseEvent {
    let mut event = SseEvent::default();
    let mut data: Option<Vec<u8>> = None;
    for line in lines(block) {
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix(b":") {
            event.comments.push(text(strip_one_space(comment)));
            continue;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => (&line[..colon], strip_one_space(&line[colon + 1..])),
            None => (line, &b""[..]),
        };
        match name {
            b"event" => event.event = Some(text(value)),
            b"data" => match &mut data {
                Some(joined) => {
                    joined.push(b'\n');
                    joined.extend_from_slice(value);
                }
                None => data = Some(value.to_vec()),
            },
            b"id" if !value.contains(&0) => event.id = Some(text(value)),
            b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                event.retry_ms = super::head::parse_decimal(value);
            }
            _ => {}
        }
    }
    event.data = data.map(|d| text(&d));
    event
}

/// The lines of `block` without their terminators (CRLF, LF or CR).
fn lines(block: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = block;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(at) => {
                let line = &rest[..at];
                let skip = if rest[at] == b'\r' && rest.get(at + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                };
                rest = &rest[at + skip..];
                Some(line)
            }
            None => {
                let line = rest;
                rest = &[];
                Some(line)
            }
        }
    })
}

fn strip_one_space(v: &[u8]) -> &[u8] {
    v.strip_prefix(b" ").unwrap_or(v)
}

fn text(v: &[u8]) -> String {
    String::from_utf8_lossy(v).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_event(data: &str) -> SseEvent {
        SseEvent {
            data: Some(data.to_owned()),
            ..SseEvent::default()
        }
    }

    fn all_raw(split: &mut SseSplitter) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(raw) = split.next_raw().unwrap() {
            out.push(raw.to_vec());
        }
        out
    }

    const STREAM: &[u8] = b"data: {\"a\":1}\n\nevent: usage\r\ndata: line1\r\ndata: line2\r\nid: 7\r\n\r\n: keep-alive\r\rdata: x\n\ndata: [DONE]\n\n";

    fn expected_raw() -> Vec<Vec<u8>> {
        vec![
            b"data: {\"a\":1}\n\n".to_vec(),
            b"event: usage\r\ndata: line1\r\ndata: line2\r\nid: 7\r\n\r\n".to_vec(),
            b": keep-alive\r\r".to_vec(),
            b"data: x\n\n".to_vec(),
            b"data: [DONE]\n\n".to_vec(),
        ]
    }

    #[test]
    fn parsed_events_mixed_line_endings() {
        let mut split = SseSplitter::new(1024);
        split.feed(STREAM);
        let mut events = Vec::new();
        while let Some(e) = split.next_event().unwrap() {
            events.push(e);
        }
        assert_eq!(
            events,
            vec![
                data_event("{\"a\":1}"),
                SseEvent {
                    event: Some("usage".into()),
                    data: Some("line1\nline2".into()),
                    id: Some("7".into()),
                    ..SseEvent::default()
                },
                SseEvent {
                    comments: vec!["keep-alive".into()],
                    ..SseEvent::default()
                },
                data_event("x"),
                data_event("[DONE]"),
            ]
        );
        assert_eq!(split.pending_bytes(), 0);
    }

    #[test]
    fn raw_blocks_are_exact_at_every_split() {
        for cut in 0..=STREAM.len() {
            let mut split = SseSplitter::new(1024);
            split.feed(&STREAM[..cut]);
            let mut out = all_raw(&mut split);
            split.feed(&STREAM[cut..]);
            out.extend(all_raw(&mut split));
            assert_eq!(out, expected_raw(), "cut {cut}");
        }
    }

    #[test]
    fn raw_blocks_byte_by_byte() {
        let mut split = SseSplitter::new(1024);
        let mut out = Vec::new();
        for &b in STREAM {
            split.feed(&[b]);
            out.extend(all_raw(&mut split));
        }
        assert_eq!(out, expected_raw());
    }

    #[test]
    fn trailing_cr_waits_for_next_byte_or_finish() {
        let mut split = SseSplitter::new(1024);
        split.feed(b"data: a\r\r");
        // The second CR could be the start of a CRLF.
        assert_eq!(split.next_raw().unwrap(), None);
        split.feed(b"\n");
        assert_eq!(
            split.next_raw().unwrap().as_deref(),
            Some(&b"data: a\r\r\n"[..])
        );

        let mut split = SseSplitter::new(1024);
        split.feed(b"data: a\r\r");
        split.finish();
        assert_eq!(
            split.next_raw().unwrap().as_deref(),
            Some(&b"data: a\r\r"[..])
        );
    }

    #[test]
    fn lone_blank_lines_are_raw_blocks_but_not_events() {
        let mut split = SseSplitter::new(1024);
        split.feed(b"\n\r\ndata: a\n\n");
        assert_eq!(
            all_raw(&mut split),
            vec![b"\n".to_vec(), b"\r\n".to_vec(), b"data: a\n\n".to_vec()]
        );
        let mut split = SseSplitter::new(1024);
        split.feed(b"\n\r\ndata: a\n\n");
        assert_eq!(split.next_event().unwrap(), Some(data_event("a")));
        assert_eq!(split.next_event().unwrap(), None);
    }

    #[test]
    fn field_rules() {
        let e = parse_event(b"data\ndata:\ndata:  two spaces\nevent:e\nid: a\0b\nretry: 1500\nretry: x\nunknown: 1\n:c\n\n");
        assert_eq!(
            e,
            SseEvent {
                event: Some("e".into()),
                data: Some("\n\n two spaces".into()),
                id: None,
                retry_ms: Some(1500),
                comments: vec!["c".into()],
            }
        );
        assert_eq!(parse_event(b"data:\n\n").data.as_deref(), Some(""));
        assert_eq!(parse_event(b"event: x\n\n").data, None);
    }

    #[test]
    fn leading_bom_is_dropped_from_the_first_event_only() {
        let mut split = SseSplitter::new(1024);
        split.feed(b"\xEF\xBB\xBFdata: a\n\n\xEF\xBB\xBFdata: b\n\n");
        assert_eq!(split.next_event().unwrap(), Some(data_event("a")));
        // A BOM later is part of the field name, so the line is ignored.
        assert_eq!(split.next_event().unwrap(), None);
    }

    #[test]
    fn pending_event_cap() {
        let mut split = SseSplitter::new(8);
        split.feed(b"data: 12");
        assert_eq!(split.next_raw().unwrap(), None);
        split.feed(b"3");
        assert!(matches!(
            split.next_raw(),
            Err(HttpError::EventTooLarge { max_bytes: 8 })
        ));
        // A complete event over the cap is refused too.
        let mut split = SseSplitter::new(8);
        split.feed(b"data: 1\n\n");
        assert!(matches!(
            split.next_raw(),
            Err(HttpError::EventTooLarge { max_bytes: 8 })
        ));
        let mut split = SseSplitter::new(9);
        split.feed(b"data: 1\n\n");
        assert_eq!(
            split.next_raw().unwrap().as_deref(),
            Some(&b"data: 1\n\n"[..])
        );
    }

    #[test]
    fn remainder_is_the_unfinished_event() {
        let mut split = SseSplitter::new(1024);
        split.feed(b"data: a\n\ndata: partial");
        assert_eq!(
            split.next_raw().unwrap().as_deref(),
            Some(&b"data: a\n\n"[..])
        );
        assert_eq!(split.next_raw().unwrap(), None);
        split.finish();
        assert_eq!(split.next_raw().unwrap(), None);
        assert_eq!(&split.take_remainder()[..], b"data: partial");
        assert_eq!(split.pending_bytes(), 0);
    }
}
