//! Fuzz target: arbitrary bytes, fed in arbitrary chunk splits, into
//! `FrameDecoder` (T1). Checks that
//!
//! - nothing panics (libFuzzer reports any panic as a crash);
//! - after the first error, every decode returns `DecodeError::Failed`;
//! - every decoded frame has a body, re-encodes, and the re-encoded bytes
//!   decode to an equal frame.
//!
//! Input layout (so libFuzzer can mutate the split as well as the bytes):
//!
//! ```text
//! byte 0        bits 0..=3: n, the number of chunk-size bytes that follow
//!               bit 4: use a small cap (the next 2 bytes, big-endian u16)
//! n bytes       chunk sizes, each `byte + 1`, cycled
//! [2 bytes]     small cap, when bit 4 is set
//! rest          the byte stream fed to the decoder
//! ```

#![no_main]

use bytes::BytesMut;
use iop_wire::codec::{self, DecodeError, FrameDecoder};
use iop_wire::limits::DEFAULT_MAX_FRAME_BYTES;
use iop_wire::pb::{self, frame::Body};
use libfuzzer_sys::fuzz_target;

/// The parsed fuzz input.
struct Input<'a> {
    chunk_sizes: Vec<usize>,
    max_frame_bytes: usize,
    stream: &'a [u8],
}

fn parse(data: &[u8]) -> Input<'_> {
    let Some((&control, rest)) = data.split_first() else {
        return Input {
            chunk_sizes: vec![1],
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            stream: data,
        };
    };
    let n = usize::from(control & 0x0f).min(rest.len());
    let (sizes, rest) = rest.split_at(n);
    let mut chunk_sizes: Vec<usize> = sizes.iter().map(|&b| usize::from(b) + 1).collect();
    if chunk_sizes.is_empty() {
        chunk_sizes.push(usize::MAX);
    }
    let (max_frame_bytes, stream) = match rest {
        [hi, lo, stream @ ..] if control & 0x10 != 0 => {
            (usize::from(u16::from_be_bytes([*hi, *lo])), stream)
        }
        _ => (DEFAULT_MAX_FRAME_BYTES, rest),
    };
    Input {
        chunk_sizes,
        max_frame_bytes,
        stream,
    }
}

/// `frame` with its floating-point fields replaced by their bit patterns, so
/// a NaN (which is not equal to itself) still compares by value.
fn comparable(frame: &pb::Frame) -> pb::Frame {
    let mut frame = frame.clone();
    if let Some(Body::RunRequest(request)) = &mut frame.body {
        if let Some(input) = &mut request.input {
            input.temperature = input.temperature.map(|t| t.to_bits() as f64);
            input.top_p = input.top_p.map(|p| p.to_bits() as f64);
        }
    }
    frame
}

fn check_reencodes(frame: &pb::Frame) {
    assert!(
        frame.body.is_some(),
        "decoder returned a frame without body"
    );
    let mut wire = BytesMut::new();
    // Not the default cap: re-encoding may grow a frame (a 5-byte varint
    // read as a negative int32/enum is written back sign-extended to 10).
    let max_frame_bytes = u32::MAX as usize;
    codec::encode_with_max(frame, &mut wire, max_frame_bytes).expect("a decoded frame re-encodes");
    let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
    decoder.feed(&wire);
    let again = decoder.decode().expect("a re-encoded frame decodes");
    let again = again.expect("a complete re-encoded frame is returned");
    assert_eq!(comparable(&again), comparable(frame));
    assert_eq!(decoder.decode(), Ok(None));
}

fuzz_target!(|data: &[u8]| {
    let input = parse(data);
    let mut decoder = FrameDecoder::with_max_frame_bytes(input.max_frame_bytes);
    let mut failed = false;
    let mut pos = 0;
    let mut step = 0;
    while pos < input.stream.len() {
        let size = input.chunk_sizes[step % input.chunk_sizes.len()];
        let end = input.stream.len().min(pos.saturating_add(size));
        if step % 2 == 0 {
            decoder.feed(&input.stream[pos..end]);
        } else {
            decoder
                .buffer_mut()
                .extend_from_slice(&input.stream[pos..end]);
        }
        pos = end;
        step += 1;
        loop {
            match decoder.decode() {
                Ok(Some(frame)) => {
                    assert!(!failed, "a frame after an error");
                    check_reencodes(&frame);
                }
                Ok(None) => {
                    assert!(!failed, "Ok(None) after an error");
                    break;
                }
                Err(DecodeError::Failed) => {
                    assert!(failed, "Failed without an earlier error");
                    break;
                }
                Err(_) => {
                    assert!(!failed, "a second distinct error");
                    failed = true;
                    assert_eq!(decoder.decode(), Err(DecodeError::Failed));
                    break;
                }
            }
        }
    }
});
