//! The frame size cap is enforced before any allocation (T1), measured with a
//! counting global allocator. One test function only: the allocator counts
//! the whole process, so nothing may run beside it in this binary.

use std::alloc::System;

use cap::Cap;
use iop_wire::codec::{DecodeError, FrameDecoder};
use iop_wire::limits::DEFAULT_MAX_FRAME_BYTES;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// Far below every announced length used here.
const SMALL_ALLOCATION_BYTES: usize = 64 * 1024;

/// Bytes allocated (in total, not net) while `decoder.decode()` runs.
fn decode_counting(decoder: &mut FrameDecoder) -> (Result<bool, DecodeError>, usize) {
    let before = ALLOCATOR.total_allocated();
    let result = decoder.decode().map(|frame| frame.is_some());
    (result, ALLOCATOR.total_allocated() - before)
}

#[test]
fn oversized_prefix_allocates_nothing_for_the_announced_length() {
    // CONTRACT: T1 — a length above the cap is refused before allocating.
    let cases = [
        (DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_FRAME_BYTES + 1),
        (DEFAULT_MAX_FRAME_BYTES, u32::MAX as usize),
        (1024, 1 << 24),
        (0, 1),
    ];
    for (max_frame_bytes, len) in cases {
        let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
        decoder.feed(&(len as u32).to_be_bytes());
        let (result, allocated) = decode_counting(&mut decoder);
        assert_eq!(
            result,
            Err(DecodeError::FrameTooLarge {
                len,
                max: max_frame_bytes
            })
        );
        assert!(
            allocated < SMALL_ALLOCATION_BYTES,
            "decode allocated {allocated} bytes for a refused {len}-byte frame"
        );
    }

    // Contrast (shows the measurement can fail): a length at the cap is
    // valid, and the decoder reserves room for it.
    let len = 1 << 24;
    let mut decoder = FrameDecoder::with_max_frame_bytes(len);
    decoder.feed(&(len as u32).to_be_bytes());
    let (result, allocated) = decode_counting(&mut decoder);
    assert_eq!(result, Ok(false));
    assert!(allocated >= len, "reserved only {allocated} bytes");
}
