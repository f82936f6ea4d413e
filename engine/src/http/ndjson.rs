//! Newline-delimited JSON splitter (Ollama's streaming format): feed body
//! bytes, take complete lines. Lines end in LF (a CR before it is
//! dropped); blank lines are skipped; each line is capped.

use bytes::{Bytes, BytesMut};

use super::HttpError;

/// Incremental, capped NDJSON line splitter.
#[derive(Debug)]
pub struct NdjsonSplitter {
    buf: BytesMut,
    /// Bytes of `buf` already searched for LF.
    scanned_bytes: usize,
    max_line_bytes: usize,
    eof: bool,
}

impl NdjsonSplitter {
    /// A splitter that refuses lines longer than `max_line_bytes`
    /// (terminator excluded).
    pub fn new(max_line_bytes: usize) -> Self {
        NdjsonSplitter {
            buf: BytesMut::new(),
            scanned_bytes: 0,
            max_line_bytes,
            eof: false,
        }
    }

    /// Appends body bytes; drain with [`NdjsonSplitter::next_line`] after
    /// each feed.
    pub fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Marks the end of the stream: a last line without LF becomes
    /// available.
    pub fn finish(&mut self) {
        self.eof = true;
    }

    /// Bytes buffered but not yet returned.
    pub fn pending_bytes(&self) -> usize {
        self.buf.len()
    }

    /// The next non-blank line without its terminator. `Ok(None)`: feed
    /// more (or, after [`NdjsonSplitter::finish`], the stream is drained).
    pub fn next_line(&mut self) -> Result<Option<Bytes>, HttpError> {
        loop {
            let line = match self.buf[self.scanned_bytes..]
                .iter()
                .position(|&b| b == b'\n')
            {
                Some(offset) => {
                    let at = self.scanned_bytes + offset;
                    let mut line = self.buf.split_to(at + 1);
                    line.truncate(at);
                    if line.last() == Some(&b'\r') {
                        line.truncate(at - 1);
                    }
                    self.scanned_bytes = 0;
                    line
                }
                None if self.eof && !self.buf.is_empty() => {
                    self.scanned_bytes = 0;
                    let mut line = self.buf.split();
                    if line.last() == Some(&b'\r') {
                        line.truncate(line.len() - 1);
                    }
                    line
                }
                None => {
                    self.scanned_bytes = self.buf.len();
                    // A full-length line may still be waiting for its CRLF.
                    let waiting_for_lf = self.buf.len() == self.max_line_bytes + 1
                        && self.buf.last() == Some(&b'\r');
                    if self.buf.len() > self.max_line_bytes && !waiting_for_lf {
                        return Err(HttpError::LineTooLong {
                            max_bytes: self.max_line_bytes,
                        });
                    }
                    return Ok(None);
                }
            };
            if line.len() > self.max_line_bytes {
                return Err(HttpError::LineTooLong {
                    max_bytes: self.max_line_bytes,
                });
            }
            let line = line.freeze();
            let leading = line.iter().take_while(|b| b.is_ascii_whitespace()).count();
            if leading == line.len() {
                continue;
            }
            return Ok(Some(line));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &[u8] = b"{\"response\":\"a\"}\n\n{\"response\":\"b\"}\r\n  \n{\"done\":true}\n";

    fn drain(split: &mut NdjsonSplitter) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(line) = split.next_line().unwrap() {
            out.push(line.to_vec());
        }
        out
    }

    fn expected() -> Vec<Vec<u8>> {
        vec![
            b"{\"response\":\"a\"}".to_vec(),
            b"{\"response\":\"b\"}".to_vec(),
            b"{\"done\":true}".to_vec(),
        ]
    }

    #[test]
    fn lines_at_every_split() {
        for cut in 0..=STREAM.len() {
            let mut split = NdjsonSplitter::new(64);
            split.feed(&STREAM[..cut]);
            let mut out = drain(&mut split);
            split.feed(&STREAM[cut..]);
            out.extend(drain(&mut split));
            assert_eq!(out, expected(), "cut {cut}");
            assert_eq!(split.pending_bytes(), 0);
        }
    }

    #[test]
    fn byte_by_byte() {
        let mut split = NdjsonSplitter::new(64);
        let mut out = Vec::new();
        for &b in STREAM {
            split.feed(&[b]);
            out.extend(drain(&mut split));
        }
        assert_eq!(out, expected());
    }

    #[test]
    fn last_line_without_newline_needs_finish() {
        let mut split = NdjsonSplitter::new(64);
        split.feed(b"{\"a\":1}\n{\"b\":2}");
        assert_eq!(drain(&mut split), vec![b"{\"a\":1}".to_vec()]);
        split.finish();
        assert_eq!(drain(&mut split), vec![b"{\"b\":2}".to_vec()]);
        assert_eq!(split.next_line().unwrap(), None);
    }

    #[test]
    fn line_cap() {
        let mut split = NdjsonSplitter::new(4);
        split.feed(b"1234\r\n");
        assert_eq!(drain(&mut split), vec![b"1234".to_vec()]);
        split.feed(b"1234\r");
        assert_eq!(split.next_line().unwrap(), None);
        split.feed(b"\n");
        assert_eq!(drain(&mut split), vec![b"1234".to_vec()]);
        split.feed(b"1234");
        assert_eq!(split.next_line().unwrap(), None);
        split.feed(b"5");
        assert!(matches!(
            split.next_line(),
            Err(HttpError::LineTooLong { max_bytes: 4 })
        ));
        let mut split = NdjsonSplitter::new(4);
        split.feed(b"12345\n");
        assert!(matches!(
            split.next_line(),
            Err(HttpError::LineTooLong { max_bytes: 4 })
        ));
    }
}
