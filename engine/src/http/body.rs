//! One body decoder for the three framings: `Content-Length`, chunked and
//! close-delimited. Yields data as slices of the read buffer and says when
//! the body ends; bytes after the body stay in the buffer (pipelining,
//! keep-alive).
//!
//! The read buffer is either a growable `BytesMut` (the server shell:
//! [`BodyDecoder::decode`]) or a frozen read such as a pooled buffer (the
//! client shell: [`BodyDecoder::decode_bytes`]). A call that returns
//! `Ok(None)` (need more bytes) has consumed everything it was given: data
//! is handed out as it arrives and framing goes into the decoder state, so
//! nothing is carried into the next read and a frozen read is released as
//! soon as the pieces cut from it are dropped.

use bytes::{Bytes, BytesMut};

use super::chunked::{ChunkedDecoder, ChunkedItem, ReadFront};
use super::{BodyFraming, HttpError, Limits};

/// One result of [`BodyDecoder::decode`] / [`BodyDecoder::decode_raw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyEvent {
    /// Body bytes (a slice of the read buffer, no copy). Never empty.
    Data(Bytes),
    /// The body is complete. Returned again on every later call.
    End,
}

#[derive(Debug, Clone)]
enum Kind {
    Length { remaining_bytes: u64 },
    Chunked(ChunkedDecoder),
    UntilClose,
    Done,
}

/// Incremental body decoder; see the module docs.
#[derive(Debug, Clone)]
pub struct BodyDecoder {
    kind: Kind,
    /// Decoded body bytes so far (chunk framing excluded).
    received_bytes: u64,
    max_body_bytes: Option<usize>,
}

impl BodyDecoder {
    /// A decoder for `framing`. `max_body_bytes` caps the decoded body
    /// (`None`: no cap, for streamed responses); a `Content-Length` above
    /// the cap fails here, before any body byte is read. Chunk-size lines
    /// are capped by `limits.max_chunk_line_bytes`, trailers by
    /// `limits.max_head_bytes`.
    pub fn new(
        framing: BodyFraming,
        limits: &Limits,
        max_body_bytes: Option<usize>,
    ) -> Result<Self, HttpError> {
        let kind = match framing {
            BodyFraming::None | BodyFraming::ContentLength { len_bytes: 0 } => Kind::Done,
            BodyFraming::ContentLength { len_bytes } => {
                if let Some(max_bytes) = max_body_bytes {
                    if len_bytes > max_bytes as u64 {
                        return Err(HttpError::BodyTooLarge { max_bytes });
                    }
                }
                Kind::Length {
                    remaining_bytes: len_bytes,
                }
            }
            BodyFraming::Chunked => Kind::Chunked(ChunkedDecoder::new(
                limits.max_chunk_line_bytes,
                limits.max_head_bytes,
            )),
            BodyFraming::CloseDelimited => Kind::UntilClose,
        };
        Ok(BodyDecoder {
            kind,
            received_bytes: 0,
            max_body_bytes,
        })
    }

    /// Whether the body has ended.
    pub fn is_done(&self) -> bool {
        matches!(self.kind, Kind::Done)
    }

    /// Decoded body bytes seen so far.
    pub fn received_bytes(&self) -> u64 {
        self.received_bytes
    }

    /// Takes the next decoded body bytes from the front of `buf`.
    /// `Ok(None)`: need more bytes (or, for a close-delimited body, the
    /// peer's close: then call [`BodyDecoder::on_eof`]).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<BodyEvent>, HttpError> {
        self.decode_front(buf)
    }

    /// Like [`BodyDecoder::decode`], from a frozen read (for example a
    /// pooled buffer): data comes out as slices of `buf`'s memory, and
    /// `buf` lets go of that memory once it is fully consumed. Only bytes
    /// after the end of the body can be left in `buf` after a call.
    pub fn decode_bytes(&mut self, buf: &mut Bytes) -> Result<Option<BodyEvent>, HttpError> {
        self.decode_front(buf)
    }

    /// Like [`BodyDecoder::decode_raw`], from a frozen read; see
    /// [`BodyDecoder::decode_bytes`].
    pub fn decode_raw_bytes(&mut self, buf: &mut Bytes) -> Result<Option<BodyEvent>, HttpError> {
        self.decode_raw_front(buf)
    }

    fn decode_front<B: ReadFront>(&mut self, buf: &mut B) -> Result<Option<BodyEvent>, HttpError> {
        match &mut self.kind {
            Kind::Done => Ok(Some(BodyEvent::End)),
            Kind::Length { .. } | Kind::UntilClose => self.decode_plain(buf),
            Kind::Chunked(dec) => match dec.decode_front(buf)? {
                Some(ChunkedItem::Data(data)) => {
                    self.count(data.len())?;
                    Ok(Some(BodyEvent::Data(data)))
                }
                Some(ChunkedItem::End) => {
                    self.kind = Kind::Done;
                    Ok(Some(BodyEvent::End))
                }
                None => Ok(None),
            },
        }
    }

    /// Like [`BodyDecoder::decode`], but a chunked body comes back as its
    /// wire bytes, chunk-size lines, extensions, CRLFs and trailers
    /// included (for a byte-exact relay); the decoder still tracks the
    /// framing so it knows where the body ends. Other framings come back as
    /// with `decode`.
    pub fn decode_raw(&mut self, buf: &mut BytesMut) -> Result<Option<BodyEvent>, HttpError> {
        self.decode_raw_front(buf)
    }

    fn decode_raw_front<B: ReadFront>(
        &mut self,
        buf: &mut B,
    ) -> Result<Option<BodyEvent>, HttpError> {
        let Kind::Chunked(dec) = &mut self.kind else {
            return self.decode_front(buf);
        };
        let mut consumed_bytes = 0usize;
        let mut data_bytes = 0usize;
        let mut done = false;
        while consumed_bytes < buf.len() {
            let step = dec.step(&buf[consumed_bytes..])?;
            consumed_bytes += step.consumed_bytes;
            data_bytes += step.data.map_or(0, |r| r.len());
            if step.done {
                done = true;
                break;
            }
            if step.consumed_bytes == 0 {
                break;
            }
        }
        if done {
            // Hand out the final framing bytes first; `End` comes next call.
            self.kind = Kind::Done;
        }
        self.count(data_bytes)?;
        if consumed_bytes == 0 {
            return Ok(done.then_some(BodyEvent::End));
        }
        Ok(Some(BodyEvent::Data(buf.take_front(consumed_bytes))))
    }

    /// The peer closed the connection: ends a close-delimited body, and is
    /// [`HttpError::UnexpectedEof`] for any other unfinished body.
    pub fn on_eof(&mut self) -> Result<BodyEvent, HttpError> {
        match self.kind {
            Kind::Done | Kind::UntilClose => {
                self.kind = Kind::Done;
                Ok(BodyEvent::End)
            }
            Kind::Length { .. } | Kind::Chunked(_) => Err(HttpError::UnexpectedEof),
        }
    }

    fn decode_plain<B: ReadFront>(&mut self, buf: &mut B) -> Result<Option<BodyEvent>, HttpError> {
        if buf.is_empty() {
            return Ok(None);
        }
        let take = match &mut self.kind {
            Kind::Length { remaining_bytes } => {
                let take =
                    usize::try_from(*remaining_bytes).map_or(buf.len(), |r| r.min(buf.len()));
                *remaining_bytes -= take as u64;
                if *remaining_bytes == 0 {
                    self.kind = Kind::Done;
                }
                take
            }
            _ => buf.len(),
        };
        self.count(take)?;
        let data = buf.take_front(take);
        Ok(Some(BodyEvent::Data(data)))
    }

    fn count(&mut self, bytes: usize) -> Result<(), HttpError> {
        self.received_bytes = self.received_bytes.saturating_add(bytes as u64);
        match self.max_body_bytes {
            Some(max_bytes) if self.received_bytes > max_bytes as u64 => {
                Err(HttpError::BodyTooLarge { max_bytes })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{BufferLocation, BufferPool, PoolConfig};

    fn drain(
        dec: &mut BodyDecoder,
        buf: &mut BytesMut,
        raw: bool,
    ) -> Result<(Vec<u8>, bool), HttpError> {
        let mut out = Vec::new();
        loop {
            let event = if raw {
                dec.decode_raw(buf)?
            } else {
                dec.decode(buf)?
            };
            match event {
                Some(BodyEvent::Data(d)) => {
                    assert!(!d.is_empty());
                    out.extend_from_slice(&d);
                }
                Some(BodyEvent::End) => return Ok((out, true)),
                None => return Ok((out, false)),
            }
        }
    }

    fn new(framing: BodyFraming, max: Option<usize>) -> BodyDecoder {
        BodyDecoder::new(framing, &Limits::default(), max).unwrap()
    }

    #[test]
    fn content_length_stops_at_the_length() {
        let mut dec = new(BodyFraming::ContentLength { len_bytes: 5 }, None);
        let mut buf = BytesMut::from(&b"hel"[..]);
        assert_eq!(
            drain(&mut dec, &mut buf, false).unwrap(),
            (b"hel".to_vec(), false)
        );
        buf.extend_from_slice(b"loGET /");
        assert_eq!(
            drain(&mut dec, &mut buf, false).unwrap(),
            (b"lo".to_vec(), true)
        );
        assert_eq!(&buf[..], b"GET /");
        assert!(dec.is_done());
        assert_eq!(dec.received_bytes(), 5);
    }

    #[test]
    fn content_length_split_at_every_byte() {
        let input = b"0123456789NEXT";
        for cut in 0..=input.len() {
            let mut dec = new(BodyFraming::ContentLength { len_bytes: 10 }, Some(10));
            let mut buf = BytesMut::from(&input[..cut]);
            let (mut out, mut done) = drain(&mut dec, &mut buf, false).unwrap();
            buf.extend_from_slice(&input[cut..]);
            if !done {
                let (more, d) = drain(&mut dec, &mut buf, false).unwrap();
                out.extend(more);
                done = d;
            }
            assert_eq!(out, b"0123456789", "cut {cut}");
            assert!(done);
            assert_eq!(&buf[..], b"NEXT");
        }
    }

    #[test]
    fn empty_framings_end_at_once() {
        for framing in [
            BodyFraming::None,
            BodyFraming::ContentLength { len_bytes: 0 },
        ] {
            let mut dec = new(framing, Some(0));
            let mut buf = BytesMut::from(&b"rest"[..]);
            assert_eq!(dec.decode(&mut buf).unwrap(), Some(BodyEvent::End));
            assert_eq!(&buf[..], b"rest");
        }
    }

    #[test]
    fn content_length_over_cap_fails_before_reading() {
        let err = BodyDecoder::new(
            BodyFraming::ContentLength { len_bytes: 11 },
            &Limits::default(),
            Some(10),
        )
        .unwrap_err();
        assert!(matches!(err, HttpError::BodyTooLarge { max_bytes: 10 }));
        assert_eq!(err.status_code(), 413);
    }

    #[test]
    fn chunked_body_cap_counts_data_only() {
        let input = b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n";
        let mut dec = new(BodyFraming::Chunked, Some(10));
        let mut buf = BytesMut::from(&input[..]);
        assert_eq!(
            drain(&mut dec, &mut buf, false).unwrap(),
            (b"helloworld".to_vec(), true)
        );
        let mut dec = new(BodyFraming::Chunked, Some(9));
        let mut buf = BytesMut::from(&input[..]);
        assert!(matches!(
            drain(&mut dec, &mut buf, false),
            Err(HttpError::BodyTooLarge { max_bytes: 9 })
        ));
        let mut dec = new(BodyFraming::Chunked, Some(9));
        let mut buf = BytesMut::from(&input[..]);
        assert!(matches!(
            drain(&mut dec, &mut buf, true),
            Err(HttpError::BodyTooLarge { max_bytes: 9 })
        ));
    }

    #[test]
    fn raw_chunked_returns_wire_bytes_and_finds_the_end() {
        let input = b"5;x=1\r\nhello\r\n0\r\nT: v\r\n\r\nNEXT";
        let body_len = input.len() - 4;
        for cut in 0..=input.len() {
            let mut dec = new(BodyFraming::Chunked, None);
            let mut buf = BytesMut::from(&input[..cut]);
            let (mut out, mut done) = drain(&mut dec, &mut buf, true).unwrap();
            buf.extend_from_slice(&input[cut..]);
            if !done {
                let (more, d) = drain(&mut dec, &mut buf, true).unwrap();
                out.extend(more);
                done = d;
            }
            assert_eq!(out, &input[..body_len], "cut {cut}");
            assert!(done, "cut {cut}");
            assert_eq!(&buf[..], b"NEXT", "cut {cut}");
            assert_eq!(dec.received_bytes(), 5);
        }
    }

    /// Decodes `input` delivered as two frozen reads cut at `cut`, the way
    /// the client shell does: whatever the decoder leaves of the first read
    /// is carried (copied) in front of the second. Returns the pieces, the
    /// bytes carried (if a second read was needed), and what follows the
    /// end of the body.
    fn decode_frozen_split(
        framing: BodyFraming,
        input: &[u8],
        cut: usize,
        raw: bool,
    ) -> (Vec<u8>, usize, Vec<u8>) {
        let mut dec = new(framing, None);
        let mut out = Vec::new();
        let mut buf = Bytes::copy_from_slice(&input[..cut]);
        let mut carried_bytes = 0;
        for second in [false, true] {
            if second {
                carried_bytes = buf.len();
                let mut next = buf.to_vec();
                next.extend_from_slice(&input[cut..]);
                buf = Bytes::from(next);
            }
            loop {
                let event = if raw {
                    dec.decode_raw_bytes(&mut buf).unwrap()
                } else {
                    dec.decode_bytes(&mut buf).unwrap()
                };
                match event {
                    Some(BodyEvent::Data(d)) => {
                        assert!(!d.is_empty());
                        out.extend_from_slice(&d);
                    }
                    Some(BodyEvent::End) => {
                        // What follows the body, fed or not yet fed.
                        let mut rest = buf.to_vec();
                        if !second {
                            rest.extend_from_slice(&input[cut..]);
                        }
                        return (out, carried_bytes, rest);
                    }
                    None => break,
                }
            }
        }
        panic!("body did not end");
    }

    #[test]
    fn frozen_reads_split_at_every_byte_decode_exactly_and_carry_nothing() {
        let chunked =
            b"5;x=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nT: v\r\n\r\nNEXT";
        let chunked_body_len = chunked.len() - 4;
        let length = b"0123456789NEXT";
        for cut in 0..=chunked.len() {
            let (data, carried, rest) =
                decode_frozen_split(BodyFraming::Chunked, chunked, cut, false);
            assert_eq!(data, b"helloabcdefghijklmnopqrstuvwxyz", "cut {cut}");
            assert_eq!(rest, b"NEXT", "cut {cut}");
            // Framing is consumed into the decoder state, never left over.
            assert_eq!(carried, 0, "cut {cut}");
            let (wire, carried, rest) =
                decode_frozen_split(BodyFraming::Chunked, chunked, cut, true);
            assert_eq!(wire, &chunked[..chunked_body_len], "cut {cut}");
            assert_eq!(rest, b"NEXT", "cut {cut}");
            assert_eq!(carried, 0, "cut {cut}");
        }
        for cut in 0..=length.len() {
            let framing = BodyFraming::ContentLength { len_bytes: 10 };
            let (data, carried, rest) = decode_frozen_split(framing, length, cut, false);
            assert_eq!(data, b"0123456789", "cut {cut}");
            assert_eq!(rest, b"NEXT", "cut {cut}");
            assert_eq!(carried, 0, "cut {cut}");
        }
    }

    #[test]
    fn frozen_read_is_released_when_consumed_and_kept_for_bytes_after_the_body() {
        let pool = BufferPool::new(PoolConfig {
            buffer_size_bytes: 32,
            buffer_count_max: 1,
        })
        .unwrap();
        let mut read = pool.acquire();
        read.extend_from_slice(b"hello");
        let mut buf = read.freeze();
        let mut dec = new(BodyFraming::ContentLength { len_bytes: 8 }, None);
        let Some(BodyEvent::Data(hello)) = dec.decode_bytes(&mut buf).unwrap() else {
            panic!("expected data");
        };
        assert_eq!(
            pool.locate(hello.as_ptr()),
            Some(BufferLocation {
                index: 0,
                offset_bytes: 0
            })
        );
        assert!(buf.is_empty());
        drop(hello);
        // Fully consumed: only the piece held the buffer.
        assert_eq!(pool.in_use(), 0);

        let mut read = pool.acquire();
        read.extend_from_slice(b"lo!NEXT");
        let mut buf = read.freeze();
        assert_eq!(
            dec.decode_bytes(&mut buf).unwrap(),
            Some(BodyEvent::Data(Bytes::from_static(b"lo!")))
        );
        assert_eq!(dec.decode_bytes(&mut buf).unwrap(), Some(BodyEvent::End));
        // Bytes after the body stay, in the pooled buffer.
        assert_eq!(&buf[..], b"NEXT");
        assert_eq!(pool.in_use(), 1);
        drop(buf);
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn close_delimited_ends_on_eof_only() {
        let mut dec = new(BodyFraming::CloseDelimited, None);
        let mut buf = BytesMut::from(&b"abc"[..]);
        assert_eq!(
            drain(&mut dec, &mut buf, false).unwrap(),
            (b"abc".to_vec(), false)
        );
        assert_eq!(dec.on_eof().unwrap(), BodyEvent::End);
        assert!(dec.is_done());
        assert_eq!(dec.decode(&mut buf).unwrap(), Some(BodyEvent::End));
    }

    #[test]
    fn eof_inside_framed_bodies_is_an_error() {
        for framing in [
            BodyFraming::ContentLength { len_bytes: 3 },
            BodyFraming::Chunked,
        ] {
            let mut dec = new(framing, None);
            assert!(matches!(dec.on_eof(), Err(HttpError::UnexpectedEof)));
        }
        let mut dec = new(BodyFraming::ContentLength { len_bytes: 0 }, None);
        assert_eq!(dec.on_eof().unwrap(), BodyEvent::End);
    }
}
