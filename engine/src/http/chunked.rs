//! Incremental `Transfer-Encoding: chunked` decoder (RFC 9112 §7.1).
//!
//! ```text
//! SizeDigits ─hex─► SizeDigits ─SP/HTAB─► SizeWhitespace ─;─► SizeExtension
//!      │ ;                        │ CR                        │ CR
//!      └──────────────CR──────────┴──────────► SizeLf ◄───────┘
//! SizeLf ─LF, size>0─► Data ─► DataCr ─CR─► DataLf ─LF─► SizeDigits
//! SizeLf ─LF, size=0─► Trailer ⇄ TrailerLf ─LF on empty line─► Done
//! ```
//!
//! Strict where leniency smuggles: every line ends in CRLF (a bare LF is an
//! error), the size is hex that fits `u64`, the size line (extensions
//! included) is capped, the trailer section is capped. Extensions and
//! trailer fields are consumed and dropped.

use std::ops::{Deref, Range};

use bytes::{Buf, Bytes, BytesMut};

use super::HttpError;

/// Decoder state; see the module diagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading the hex chunk size.
    SizeDigits {
        size_bytes: u64,
        digits: usize,
        line_bytes: usize,
    },
    /// Whitespace after the size, before `;` or CR.
    SizeWhitespace { size_bytes: u64, line_bytes: usize },
    /// Inside chunk extensions, until CR.
    SizeExtension { size_bytes: u64, line_bytes: usize },
    /// Saw the size line's CR; LF must follow.
    SizeLf { size_bytes: u64 },
    /// Chunk data with this many bytes still to come.
    Data { remaining_bytes: u64 },
    /// After chunk data; CR must follow.
    DataCr,
    /// After chunk data's CR; LF must follow.
    DataLf,
    /// Inside the trailer section.
    Trailer {
        line_bytes: usize,
        section_bytes: usize,
    },
    /// Saw a trailer line's CR; LF must follow.
    TrailerLf {
        line_bytes: usize,
        section_bytes: usize,
    },
    /// The last chunk and the trailer section are consumed.
    Done,
}

/// What one [`ChunkedDecoder::step`] did with its input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkedStep {
    /// Bytes of the input consumed (framing and data).
    pub consumed_bytes: usize,
    /// Range of the input that is body data, if this step reached some
    /// (never empty; ends at `consumed_bytes`).
    pub data: Option<Range<usize>>,
    /// The body ended (last chunk and trailers consumed).
    pub done: bool,
}

/// One result of [`ChunkedDecoder::decode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkedItem {
    /// Body data: a slice of the input buffer (no copy).
    Data(Bytes),
    /// The body ended; bytes after it stay in the buffer.
    End,
}

/// Incremental chunked-body decoder. Feed it any split of the input.
#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: State,
    max_line_bytes: usize,
    max_trailer_bytes: usize,
}

const START: State = State::SizeDigits {
    size_bytes: 0,
    digits: 0,
    line_bytes: 0,
};

impl ChunkedDecoder {
    /// A decoder that caps each chunk-size line at `max_line_bytes` (CRLF
    /// excluded) and the trailer section at `max_trailer_bytes`.
    pub fn new(max_line_bytes: usize, max_trailer_bytes: usize) -> Self {
        ChunkedDecoder {
            state: START,
            max_line_bytes,
            max_trailer_bytes,
        }
    }

    /// Whether the whole body has been consumed.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consumes framing bytes from `input` up to and including at most one
    /// run of data. Call again with the unconsumed rest; when a step
    /// returns neither data nor `done`, it consumed all of `input` and
    /// needs more bytes. After `done`, steps consume nothing.
    pub fn step(&mut self, input: &[u8]) -> Result<ChunkedStep, HttpError> {
        let mut pos = 0usize;
        loop {
            match self.state {
                State::Done => {
                    return Ok(ChunkedStep {
                        consumed_bytes: pos,
                        data: None,
                        done: true,
                    })
                }
                State::Data { remaining_bytes } if pos < input.len() => {
                    let available = input.len() - pos;
                    let take =
                        usize::try_from(remaining_bytes).map_or(available, |r| r.min(available));
                    let left = remaining_bytes - take as u64;
                    self.state = if left == 0 {
                        State::DataCr
                    } else {
                        State::Data {
                            remaining_bytes: left,
                        }
                    };
                    return Ok(ChunkedStep {
                        consumed_bytes: pos + take,
                        data: Some(pos..pos + take),
                        done: false,
                    });
                }
                _ if pos < input.len() => {
                    self.state = self.next_state(input[pos])?;
                    pos += 1;
                }
                _ => {
                    return Ok(ChunkedStep {
                        consumed_bytes: pos,
                        data: None,
                        done: false,
                    })
                }
            }
        }
    }

    /// Decodes from the front of `buf`, removing what it consumes.
    /// `Ok(None)`: everything buffered was framing, read more.
    ///
    /// Framing is consumed byte by byte into the decoder's state, so after
    /// `Ok(None)` the buffer is empty: a chunk-size line or trailer split
    /// across reads never has to stay buffered.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<ChunkedItem>, HttpError> {
        self.decode_front(buf)
    }

    /// Like [`ChunkedDecoder::decode`], from a frozen read (for example a
    /// pooled buffer): data comes out as slices of `buf`'s memory, and
    /// `buf` lets go of that memory once it is fully consumed.
    pub fn decode_bytes(&mut self, buf: &mut Bytes) -> Result<Option<ChunkedItem>, HttpError> {
        self.decode_front(buf)
    }

    pub(crate) fn decode_front<B: ReadFront>(
        &mut self,
        buf: &mut B,
    ) -> Result<Option<ChunkedItem>, HttpError> {
        let step = self.step(buf)?;
        if let Some(data) = step.data {
            buf.skip_front(data.start);
            return Ok(Some(ChunkedItem::Data(buf.take_front(data.len()))));
        }
        buf.skip_front(step.consumed_bytes);
        Ok(step.done.then_some(ChunkedItem::End))
    }

    fn next_state(&self, b: u8) -> Result<State, HttpError> {
        let bad = |reason| Err(HttpError::BadChunk { reason });
        let line = |line_bytes: usize| {
            let line_bytes = line_bytes + 1;
            if line_bytes > self.max_line_bytes {
                Err(HttpError::ChunkLineTooLong {
                    max_bytes: self.max_line_bytes,
                })
            } else {
                Ok(line_bytes)
            }
        };
        match self.state {
            State::SizeDigits {
                size_bytes,
                digits,
                line_bytes,
            } => {
                if let Some(d) = hex_value(b) {
                    let Some(size_bytes) =
                        size_bytes.checked_mul(16).and_then(|s| s.checked_add(d))
                    else {
                        return bad("chunk size overflows u64");
                    };
                    return Ok(State::SizeDigits {
                        size_bytes,
                        digits: digits + 1,
                        line_bytes: line(line_bytes)?,
                    });
                }
                if digits == 0 {
                    return bad("chunk size is not hex");
                }
                match b {
                    b' ' | b'\t' => Ok(State::SizeWhitespace {
                        size_bytes,
                        line_bytes: line(line_bytes)?,
                    }),
                    b';' => Ok(State::SizeExtension {
                        size_bytes,
                        line_bytes: line(line_bytes)?,
                    }),
                    b'\r' => Ok(State::SizeLf { size_bytes }),
                    b'\n' => bad("bare LF after chunk size"),
                    _ => bad("chunk size is not hex"),
                }
            }
            State::SizeWhitespace {
                size_bytes,
                line_bytes,
            } => match b {
                b' ' | b'\t' => Ok(State::SizeWhitespace {
                    size_bytes,
                    line_bytes: line(line_bytes)?,
                }),
                b';' => Ok(State::SizeExtension {
                    size_bytes,
                    line_bytes: line(line_bytes)?,
                }),
                b'\r' => Ok(State::SizeLf { size_bytes }),
                _ => bad("unexpected byte after chunk size"),
            },
            State::SizeExtension {
                size_bytes,
                line_bytes,
            } => match b {
                b'\r' => Ok(State::SizeLf { size_bytes }),
                b'\n' => bad("bare LF in chunk extension"),
                b'\t' => Ok(State::SizeExtension {
                    size_bytes,
                    line_bytes: line(line_bytes)?,
                }),
                0..=0x1f | 0x7f => bad("control byte in chunk extension"),
                _ => Ok(State::SizeExtension {
                    size_bytes,
                    line_bytes: line(line_bytes)?,
                }),
            },
            State::SizeLf { size_bytes } => match (b, size_bytes) {
                (b'\n', 0) => Ok(State::Trailer {
                    line_bytes: 0,
                    section_bytes: 0,
                }),
                (b'\n', remaining_bytes) => Ok(State::Data { remaining_bytes }),
                _ => bad("CR without LF in chunk-size line"),
            },
            State::DataCr => match b {
                b'\r' => Ok(State::DataLf),
                _ => bad("chunk data longer than its size"),
            },
            State::DataLf => match b {
                b'\n' => Ok(START),
                _ => bad("CR without LF after chunk data"),
            },
            State::Trailer {
                line_bytes,
                section_bytes,
            } => {
                let section_bytes = section_bytes + 1;
                if section_bytes > self.max_trailer_bytes {
                    return Err(HttpError::HeadTooLarge {
                        max_bytes: self.max_trailer_bytes,
                    });
                }
                match b {
                    b'\r' => Ok(State::TrailerLf {
                        line_bytes,
                        section_bytes,
                    }),
                    b'\n' => bad("bare LF in trailer section"),
                    0 => bad("NUL in trailer section"),
                    _ => Ok(State::Trailer {
                        line_bytes: line_bytes + 1,
                        section_bytes,
                    }),
                }
            }
            State::TrailerLf {
                line_bytes,
                section_bytes,
            } => {
                let section_bytes = section_bytes + 1;
                if section_bytes > self.max_trailer_bytes {
                    return Err(HttpError::HeadTooLarge {
                        max_bytes: self.max_trailer_bytes,
                    });
                }
                match (b, line_bytes) {
                    (b'\n', 0) => Ok(State::Done),
                    (b'\n', _) => Ok(State::Trailer {
                        line_bytes: 0,
                        section_bytes,
                    }),
                    _ => bad("CR without LF in trailer section"),
                }
            }
            // `step` handles these without calling here.
            State::Data { .. } | State::Done => bad("internal: no byte expected"),
        }
    }
}

/// A buffer the body decoders take bytes from the front of: the growable
/// read buffer of the server shell (`BytesMut`) or a frozen read of the
/// client shell (`Bytes`, a slice of a pooled buffer).
pub(crate) trait ReadFront: Deref<Target = [u8]> {
    /// Removes and returns the first `len_bytes` bytes (`<= len()`),
    /// sharing the memory (no copy).
    fn take_front(&mut self, len_bytes: usize) -> Bytes;

    /// Drops the first `len_bytes` bytes (`<= len()`).
    fn skip_front(&mut self, len_bytes: usize);
}

impl ReadFront for BytesMut {
    fn take_front(&mut self, len_bytes: usize) -> Bytes {
        self.split_to(len_bytes).freeze()
    }

    fn skip_front(&mut self, len_bytes: usize) {
        // Keeps the capacity: the server shell reads into it again.
        self.advance(len_bytes);
    }
}

impl ReadFront for Bytes {
    fn take_front(&mut self, len_bytes: usize) -> Bytes {
        // Taking everything leaves a static empty `Bytes` behind, so the
        // memory is released when the taken part is.
        self.split_to(len_bytes)
    }

    fn skip_front(&mut self, len_bytes: usize) {
        if len_bytes >= self.len() {
            // `advance` would keep the (pooled) memory alive for an empty
            // view; let go of it instead.
            *self = Bytes::new();
        } else {
            self.advance(len_bytes);
        }
    }
}

fn hex_value(b: u8) -> Option<u64> {
    match b {
        b'0'..=b'9' => Some(u64::from(b - b'0')),
        b'a'..=b'f' => Some(u64::from(b - b'a' + 10)),
        b'A'..=b'F' => Some(u64::from(b - b'A' + 10)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{BufferLocation, BufferPool, PoolConfig};

    fn decoder() -> ChunkedDecoder {
        ChunkedDecoder::new(64, 256)
    }

    /// Feeds `input` in pieces of the given sizes (the last piece gets the
    /// rest); returns the concatenated data, whether the body ended, and
    /// what stayed in the buffer.
    fn decode_in_pieces(
        dec: &mut ChunkedDecoder,
        input: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, bool, Vec<u8>), HttpError> {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0usize;
        let mut pieces: Vec<&[u8]> = Vec::new();
        for &cut in cuts {
            pieces.push(&input[fed..cut]);
            fed = cut;
        }
        pieces.push(&input[fed..]);
        for (i, piece) in pieces.iter().enumerate() {
            buf.extend_from_slice(piece);
            while let Some(item) = dec.decode(&mut buf)? {
                match item {
                    ChunkedItem::Data(d) => {
                        assert!(!d.is_empty());
                        out.extend_from_slice(&d);
                    }
                    ChunkedItem::End => {
                        // What follows the body, fed or not yet fed.
                        let mut rest = buf.to_vec();
                        rest.extend(pieces[i + 1..].concat());
                        return Ok((out, true, rest));
                    }
                }
            }
        }
        Ok((out, false, buf.to_vec()))
    }

    const BODY: &[u8] =
        b"5\r\nhello\r\n1A;name=\"v\" ; x\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: t\r\n\r\nNEXT";

    #[test]
    fn whole_body_with_extensions_and_trailers() {
        let (data, done, rest) = decode_in_pieces(&mut decoder(), BODY, &[]).unwrap();
        assert_eq!(data, b"helloabcdefghijklmnopqrstuvwxyz");
        assert!(done);
        assert_eq!(rest, b"NEXT");
    }

    #[test]
    fn split_at_every_byte() {
        for cut in 0..=BODY.len() {
            let (data, done, rest) = decode_in_pieces(&mut decoder(), BODY, &[cut]).unwrap();
            assert_eq!(data, b"helloabcdefghijklmnopqrstuvwxyz", "cut {cut}");
            assert!(done, "cut {cut}");
            assert_eq!(rest, b"NEXT", "cut {cut}");
        }
    }

    #[test]
    fn one_byte_at_a_time() {
        let cuts: Vec<usize> = (1..BODY.len()).collect();
        let (data, done, rest) = decode_in_pieces(&mut decoder(), BODY, &cuts).unwrap();
        assert_eq!(data, b"helloabcdefghijklmnopqrstuvwxyz");
        assert!(done);
        assert_eq!(rest, b"NEXT");
    }

    #[test]
    fn data_is_a_slice_of_the_input_buffer() {
        let mut buf = BytesMut::from(&b"3\r\nabc\r\n0\r\n\r\n"[..]);
        let base = buf.as_ptr() as usize;
        let mut dec = decoder();
        let Some(ChunkedItem::Data(d)) = dec.decode(&mut buf).unwrap() else {
            panic!("expected data");
        };
        assert_eq!(&d[..], b"abc");
        assert_eq!(d.as_ptr() as usize, base + 3, "no copy");
        assert_eq!(dec.decode(&mut buf).unwrap(), Some(ChunkedItem::End));
        assert!(dec.is_done());
        assert_eq!(dec.decode(&mut buf).unwrap(), Some(ChunkedItem::End));
    }

    #[test]
    fn frozen_input_yields_slices_and_lets_go_once_consumed() {
        let pool = BufferPool::new(PoolConfig {
            buffer_size_bytes: 64,
            buffer_count_max: 1,
        })
        .unwrap();
        let mut read = pool.acquire();
        read.extend_from_slice(b"3\r\nabc\r\n4\r\nde");
        let mut buf = read.freeze();
        let mut dec = decoder();
        let Some(ChunkedItem::Data(abc)) = dec.decode_bytes(&mut buf).unwrap() else {
            panic!("expected data");
        };
        assert_eq!(&abc[..], b"abc");
        assert_eq!(
            pool.locate(abc.as_ptr()),
            Some(BufferLocation {
                index: 0,
                offset_bytes: 3
            })
        );
        let Some(ChunkedItem::Data(de)) = dec.decode_bytes(&mut buf).unwrap() else {
            panic!("expected data");
        };
        assert_eq!(&de[..], b"de");
        assert_eq!(pool.locate(de.as_ptr()).map(|at| at.offset_bytes), Some(11));
        // Everything consumed: `buf` no longer holds the pooled buffer, only
        // the pieces do.
        assert_eq!(dec.decode_bytes(&mut buf).unwrap(), None);
        assert!(buf.is_empty());
        drop((abc, de));
        assert_eq!(pool.in_use(), 0);

        // Framing alone (the rest of a chunk, a partial size line) is
        // consumed too, releasing its buffer.
        let mut read = pool.acquire();
        read.extend_from_slice(b"fg\r\n1");
        let mut buf = read.freeze();
        assert_eq!(
            dec.decode_bytes(&mut buf).unwrap(),
            Some(ChunkedItem::Data(Bytes::from_static(b"fg")))
        );
        assert_eq!(dec.decode_bytes(&mut buf).unwrap(), None);
        assert!(buf.is_empty());
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn partial_data_is_yielded_as_it_arrives() {
        let mut dec = decoder();
        let mut buf = BytesMut::from(&b"a\r\n0123"[..]);
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(ChunkedItem::Data(Bytes::from_static(b"0123")))
        );
        assert_eq!(dec.decode(&mut buf).unwrap(), None);
        buf.extend_from_slice(b"456789\r\n");
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(ChunkedItem::Data(Bytes::from_static(b"456789")))
        );
        assert_eq!(dec.decode(&mut buf).unwrap(), None);
        assert!(buf.is_empty());
    }

    #[test]
    fn step_reports_ranges() {
        let mut dec = decoder();
        let input = b"2\r\nab\r\n0\r\n\r\n";
        let s = dec.step(input).unwrap();
        assert_eq!(
            s,
            ChunkedStep {
                consumed_bytes: 5,
                data: Some(3..5),
                done: false
            }
        );
        let s = dec.step(&input[5..]).unwrap();
        assert_eq!(
            s,
            ChunkedStep {
                consumed_bytes: 7,
                data: None,
                done: true
            }
        );
    }

    #[test]
    fn uppercase_hex_leading_zeros_and_whitespace() {
        let input = b"000A \t;ext\r\n0123456789\r\n00\r\n\r\n";
        let (data, done, _) = decode_in_pieces(&mut decoder(), input, &[]).unwrap();
        assert_eq!(data, b"0123456789");
        assert!(done);
    }

    #[test]
    fn malformed_inputs_are_bad_chunks() {
        let cases: &[&[u8]] = &[
            b"x\r\n",
            b"\r\n",
            b";ext\r\n",
            b"5\nhello\r\n",
            b"5\rhello\r\n",
            b"5\r\nhelloX\r\n",
            b"5\r\nhello\rX",
            b"5 x\r\n",
            b"5;a\nb\r\n",
            b"5;a\x01\r\n",
            b"0\r\nX: y\n\r\n",
            b"0\r\nX: y\rZ",
            b"0\r\n\rZ",
            b"10000000000000000\r\n",
        ];
        for input in cases {
            let err = decode_in_pieces(&mut decoder(), input, &[]).unwrap_err();
            assert!(
                matches!(err, HttpError::BadChunk { .. }),
                "{:?}: {err:?}",
                String::from_utf8_lossy(input)
            );
            assert_eq!(err.status_code(), 400);
        }
    }

    #[test]
    fn max_u64_size_is_accepted() {
        let mut dec = decoder();
        let mut buf = BytesMut::from(&b"ffffffffffffffff\r\nab"[..]);
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(ChunkedItem::Data(Bytes::from_static(b"ab")))
        );
    }

    #[test]
    fn size_line_cap() {
        let mut dec = ChunkedDecoder::new(8, 256);
        let mut buf = BytesMut::from(&b"5;abcdef\r\nhello\r\n"[..]);
        assert!(matches!(
            dec.decode(&mut buf).unwrap(),
            Some(ChunkedItem::Data(_))
        ));
        let mut dec = ChunkedDecoder::new(8, 256);
        let mut buf = BytesMut::from(&b"5;abcdefg\r\n"[..]);
        assert!(matches!(
            dec.decode(&mut buf),
            Err(HttpError::ChunkLineTooLong { max_bytes: 8 })
        ));
        // Leading zeros count too, so a line of zeros cannot run forever.
        let mut dec = ChunkedDecoder::new(8, 256);
        let mut buf = BytesMut::from(&b"000000000"[..]);
        assert!(matches!(
            dec.decode(&mut buf),
            Err(HttpError::ChunkLineTooLong { max_bytes: 8 })
        ));
    }

    #[test]
    fn trailer_section_cap() {
        let mut dec = ChunkedDecoder::new(64, 8);
        let mut buf = BytesMut::from(&b"0\r\nA: 1\r\n\r\n"[..]);
        assert_eq!(dec.decode(&mut buf).unwrap(), Some(ChunkedItem::End));
        let mut dec = ChunkedDecoder::new(64, 8);
        let mut buf = BytesMut::from(&b"0\r\nA: 12\r\n\r\n"[..]);
        assert!(matches!(
            dec.decode(&mut buf),
            Err(HttpError::HeadTooLarge { max_bytes: 8 })
        ));
    }
}
