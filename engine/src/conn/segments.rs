//! Write batches: many small frames coalesced into one buffer, large tunnel
//! bodies kept as their own segments (no copy), all written with one
//! vectored write.

use bytes::{Buf, Bytes, BytesMut};
use monoio::buf::IoVecBuf;
use monoio::io::AsyncWriteRent;

use super::core::OutFrame;

/// Segments one vectored write carries at most (well under `IOV_MAX`).
pub(crate) const SEGMENTS_MAX: usize = 64;

/// Frames whose head is at most this long are copied into the coalescing
/// buffer; longer encoded frames are written as their own segment.
const HEAD_COPY_MAX_BYTES: usize = 4 * 1024;

/// Gathers frames into the segments of one write.
#[derive(Debug)]
pub(crate) struct BatchBuilder {
    coalesce: BytesMut,
    segments: Vec<Bytes>,
    len_bytes: usize,
    body_copy_max_bytes: usize,
}

impl BatchBuilder {
    /// An empty batch; tunnel bodies up to `body_copy_max_bytes` are copied
    /// next to their head, larger ones travel as they are.
    pub(crate) fn new(body_copy_max_bytes: usize) -> Self {
        Self {
            coalesce: BytesMut::new(),
            segments: Vec::with_capacity(SEGMENTS_MAX),
            len_bytes: 0,
            body_copy_max_bytes,
        }
    }

    /// True when another frame (its head and up to three body pieces, each
    /// a segment, plus the coalescing buffer) still fits under the segment
    /// limit and `max_bytes`.
    pub(crate) fn has_room(&self, max_bytes: usize) -> bool {
        self.segments.len() + 5 <= SEGMENTS_MAX && self.len_bytes < max_bytes
    }

    /// Bytes gathered so far.
    #[cfg(test)]
    pub(crate) fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Adds one frame.
    pub(crate) fn push(&mut self, frame: OutFrame) {
        self.len_bytes += frame.len_bytes();
        let (head, body) = (frame.head(), frame.body());
        if head.len() <= HEAD_COPY_MAX_BYTES {
            self.coalesce.extend_from_slice(head);
        } else {
            self.cut_coalesced();
            self.segments.push(head.clone());
        }
        for piece in body.parts() {
            if piece.is_empty() {
                continue;
            }
            if piece.len() <= self.body_copy_max_bytes {
                self.coalesce.extend_from_slice(piece);
            } else {
                self.cut_coalesced();
                self.segments.push(piece.clone());
            }
        }
    }

    /// The gathered segments, in order; the builder is empty afterwards.
    pub(crate) fn take(&mut self) -> Vec<Bytes> {
        self.cut_coalesced();
        self.len_bytes = 0;
        std::mem::replace(&mut self.segments, Vec::with_capacity(SEGMENTS_MAX))
    }

    /// Hands back a segment vector after its write, to reuse its allocation.
    pub(crate) fn recycle(&mut self, mut segments: Vec<Bytes>) {
        segments.clear();
        if self.segments.is_empty() && segments.capacity() >= SEGMENTS_MAX {
            self.segments = segments;
        }
    }

    fn cut_coalesced(&mut self) {
        if !self.coalesce.is_empty() {
            self.segments.push(self.coalesce.split().freeze());
        }
    }
}

/// Owned segments with their `iovec`s, for one vectored write, advanced
/// past what each (possibly partial) write took.
///
/// monoio 0.2.4's `write_vectored_all` cannot be used: after a partial write
/// its `IoVecMeta::consume` shortens an iovec without moving its base (the
/// start is written twice) and keeps reporting consumed iovecs. Over TLS,
/// where rustls takes at most its buffer limit per write, every large body
/// is a partial write.
pub(crate) struct IoSegments {
    segments: Vec<Bytes>,
    /// `iovecs[i]` describes exactly `segments[i]` as it is now.
    iovecs: Vec<libc::iovec>,
    /// Segments before this index are fully written.
    first: usize,
}

impl std::fmt::Debug for IoSegments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoSegments")
            .field("segments", &self.segments.len())
            .field("first", &self.first)
            .finish()
    }
}

fn iovec_of(segment: &Bytes) -> libc::iovec {
    libc::iovec {
        iov_base: segment.as_ptr() as *mut libc::c_void,
        iov_len: segment.len(),
    }
}

impl IoSegments {
    /// Takes ownership of `segments` and points one `iovec` at each.
    pub(crate) fn new(segments: Vec<Bytes>) -> Self {
        let iovecs = segments.iter().map(iovec_of).collect();
        Self {
            segments,
            iovecs,
            first: 0,
        }
    }

    /// Bytes not yet written.
    pub(crate) fn remaining_bytes(&self) -> usize {
        self.segments[self.first..].iter().map(Bytes::len).sum()
    }

    /// Marks `written_bytes` more bytes as written.
    pub(crate) fn advance(&mut self, mut written_bytes: usize) {
        while written_bytes > 0 && self.first < self.segments.len() {
            let segment = &mut self.segments[self.first];
            if written_bytes >= segment.len() {
                written_bytes -= segment.len();
                self.first += 1;
            } else {
                segment.advance(written_bytes);
                self.iovecs[self.first] = iovec_of(segment);
                written_bytes = 0;
            }
        }
    }

    /// The segments back, once the write is done.
    pub(crate) fn into_segments(self) -> Vec<Bytes> {
        self.segments
    }
}

// SAFETY: the iovecs handed out (`iovecs[first..]`) each describe exactly the
// current view of a `Bytes` in `segments[first..]`, which `IoSegments` owns.
// Nothing changes `segments` or `iovecs` while the runtime holds the value
// (`advance` needs it back), so the returned pointer and the memory it
// describes stay valid and unmoved until the write completes: moving a
// `Bytes` handle or a `Vec` never moves their heap data. The kernel only
// reads through these pointers.
unsafe impl IoVecBuf for IoSegments {
    fn read_iovec_ptr(&self) -> *const libc::iovec {
        self.iovecs[self.first..].as_ptr()
    }

    fn read_iovec_len(&self) -> usize {
        self.iovecs.len() - self.first
    }
}

/// Writes every byte of `segments` with vectored writes, resuming after
/// partial writes.
pub(crate) async fn write_all_segments<W: AsyncWriteRent>(
    writer: &mut W,
    mut segments: IoSegments,
) -> (std::io::Result<()>, IoSegments) {
    while segments.remaining_bytes() > 0 {
        let (result, back) = writer.writev(segments).await;
        segments = back;
        match result {
            Ok(0) => return (Err(std::io::ErrorKind::WriteZero.into()), segments),
            Ok(written_bytes) => segments.advance(written_bytes),
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return (Err(err), segments),
        }
    }
    (Ok(()), segments)
}

#[cfg(test)]
mod tests {
    use iop_wire::codec::BodyParts;
    use iop_wire::pb;

    use super::*;
    use crate::conn::{ConnConfig, ConnCore};

    fn core() -> ConnCore {
        ConnCore::new(ConnConfig::default(), crate::clock::now())
    }

    fn event(core: &mut ConnCore, seq: u64) -> OutFrame {
        let frame = iop_wire::codec::frame(pb::frame::Body::RunEvent(Box::new(pb::RunEvent {
            seq,
            ..Default::default()
        })));
        core.encode_frame(&frame).unwrap()
    }

    #[test]
    fn small_frames_coalesce_into_one_segment() {
        let mut core = core();
        let mut batch = BatchBuilder::new(512);
        let frames: Vec<OutFrame> = (1..=10).map(|seq| event(&mut core, seq)).collect();
        let mut expected = Vec::new();
        for frame in frames {
            expected.extend_from_slice(frame.head());
            batch.push(frame);
        }
        assert_eq!(batch.len_bytes(), expected.len());
        let segments = batch.take();
        assert_eq!(segments, vec![Bytes::from(expected)]);
        assert_eq!(batch.len_bytes(), 0);
    }

    #[test]
    fn large_bodies_are_written_without_a_copy() {
        let mut core = core();
        let mut batch = BatchBuilder::new(512);
        let body = Bytes::from(vec![0xAB; 4096]);
        let tunnel = pb::ProviderTunnelFrame {
            seq: 1,
            ..Default::default()
        };
        let first = event(&mut core, 1);
        let body_frame = core.encode_body_frame(&tunnel, body.clone()).unwrap();
        let last = event(&mut core, 2);
        let mut head_segment = first.head().to_vec();
        head_segment.extend_from_slice(body_frame.head());
        let last_head = last.head().clone();
        let total_bytes = first.len_bytes() + body_frame.len_bytes() + last.len_bytes();
        batch.push(first);
        batch.push(body_frame);
        batch.push(last);
        let segments = batch.take();
        assert_eq!(segments.len(), 3);
        assert_eq!(segments[0], Bytes::from(head_segment));
        // The body segment is the caller's memory, not a copy.
        assert_eq!(segments[1].as_ptr(), body.as_ptr());
        assert_eq!(segments[1].len(), 4096);
        assert_eq!(segments[2], last_head);
        assert_eq!(IoSegments::new(segments).remaining_bytes(), total_bytes);
    }

    #[test]
    fn small_bodies_are_copied_next_to_their_head() {
        let mut core = core();
        let mut batch = BatchBuilder::new(512);
        let body = Bytes::from_static(b"data: tok\n\n");
        let frame = core
            .encode_body_frame(&pb::ProviderTunnelFrame::default(), body.clone())
            .unwrap();
        let mut expected = frame.head().to_vec();
        expected.extend_from_slice(&body);
        batch.push(frame);
        assert_eq!(batch.take(), vec![Bytes::from(expected)]);
    }

    #[test]
    fn request_pieces_travel_as_they_are_small_ones_coalesced() {
        let mut batch = BatchBuilder::new(16);
        let mut core = core();
        let client = Bytes::from(vec![7u8; 4096]);
        let value = Bytes::from_static(b"\"target\"");
        let body = BodyParts::spliced(client.slice(..1000), value.clone(), client.slice(1010..));
        let frame = core
            .encode_request_frame(&pb::ProviderTunnelRequest::default(), body)
            .unwrap();
        let head = frame.head().clone();
        batch.push(frame);
        let segments = batch.take();
        // head | prefix (the client's memory) | value coalesced | suffix.
        assert_eq!(segments.len(), 4);
        assert_eq!(segments[0], head);
        assert_eq!(segments[1].as_ptr(), client.as_ptr());
        assert_eq!(segments[2], value);
        assert_eq!(segments[3].as_ptr(), client[1010..].as_ptr());
    }

    #[test]
    fn batch_room_respects_segment_and_byte_limits() {
        let mut batch = BatchBuilder::new(0);
        assert!(batch.has_room(100));
        let mut core = core();
        let body = Bytes::from(vec![1u8; 10]);
        for _ in 0..29 {
            let frame = core
                .encode_body_frame(&pb::ProviderTunnelFrame::default(), body.clone())
                .unwrap();
            batch.push(frame);
        }
        // 29 frames: 29 coalesced heads interleaved with 29 bodies; room
        // for one more frame of a head and three pieces.
        assert!(batch.has_room(usize::MAX));
        let frame = core
            .encode_body_frame(&pb::ProviderTunnelFrame::default(), body.clone())
            .unwrap();
        batch.push(frame);
        assert!(!batch.has_room(usize::MAX));
        assert!(!batch.has_room(10));
        assert_eq!(batch.take().len(), 60);
    }

    #[test]
    fn segments_advance_through_partial_writes() {
        let segments = vec![
            Bytes::from_static(b"abc"),
            Bytes::from_static(b"defgh"),
            Bytes::from_static(b"ij"),
        ];
        let mut io = IoSegments::new(segments);
        assert_eq!(io.remaining_bytes(), 10);
        assert_eq!(io.read_iovec_len(), 3);
        io.advance(4); // "abc" and "d"
        assert_eq!(io.remaining_bytes(), 6);
        assert_eq!(io.read_iovec_len(), 2);
        // SAFETY: the pointer and length come from `io`, alive and unchanged.
        let first = unsafe { *io.read_iovec_ptr() };
        // SAFETY: the iovec describes a live `Bytes` owned by `io`.
        let view =
            unsafe { std::slice::from_raw_parts(first.iov_base as *const u8, first.iov_len) };
        assert_eq!(view, b"efgh");
        io.advance(4);
        assert_eq!(io.read_iovec_len(), 1);
        io.advance(2);
        assert_eq!(io.remaining_bytes(), 0);
        assert_eq!(io.read_iovec_len(), 0);
    }
}
