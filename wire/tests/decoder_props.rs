//! Properties of the incremental frame decoder (T1): any split of a valid
//! stream yields exactly its frames in order; oversized, truncated, empty and
//! garbage input give the documented outcome, never a panic.

use bytes::{Bytes, BytesMut};
use iop_wire::codec::{self, encode_with_max, DecodeError, EncodeError, FrameDecoder, Inbound};
use iop_wire::limits::{DEFAULT_MAX_FRAME_BYTES, LENGTH_PREFIX_BYTES};
use iop_wire::pb::{self, frame::Body};
use proptest::prelude::*;
use prost::Message;

/// An upper bound for the decoder's buffer capacity when it must not have
/// allocated for an announced frame: far below any announced size we test.
const SMALL_CAPACITY_BYTES: usize = 4096;

// ---------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------

fn header() -> impl Strategy<Value = pb::Header> {
    ("[A-Za-z-]{1,12}", prop::collection::vec(any::<u8>(), 0..16)).prop_map(|(name, value)| {
        pb::Header {
            name,
            value: Bytes::from(value),
        }
    })
}

fn frame() -> impl Strategy<Value = pb::Frame> {
    let body = prop_oneof![
        any::<u64>().prop_map(|seq| Body::Heartbeat(pb::Heartbeat { seq })),
        any::<u64>().prop_map(|seq| Body::HeartbeatAck(pb::HeartbeatAck { seq })),
        (".{0,20}", ".{0,40}")
            .prop_map(|(reason, detail)| Body::Close(pb::Close { reason, detail })),
        (
            "[a-z0-9-]{0,12}",
            any::<u64>(),
            0i32..6,
            prop::collection::vec(header(), 0..4),
            prop::collection::vec(any::<u8>(), 0..600),
        )
            .prop_map(|(run_id, seq, kind, headers, body)| {
                Body::ProviderTunnelFrame(Box::new(pb::ProviderTunnelFrame {
                    run_id,
                    seq,
                    kind,
                    headers,
                    body: Bytes::from(body),
                    ..Default::default()
                }))
            }),
        (
            "[a-z0-9-]{0,12}",
            any::<u64>(),
            ".{0,64}",
            any::<Option<u64>>()
        )
            .prop_map(|(run_id, seq, delta, observation)| {
                Body::RunEvent(Box::new(pb::RunEvent {
                    run_id,
                    seq,
                    r#type: pb::RunEventType::Delta as i32,
                    delta,
                    failure: observation.map(|seq| {
                        Box::new(pb::ExecutionFailure {
                            failure_code: "response_stalled".into(),
                            health_observation_seq: Some(seq),
                            ..Default::default()
                        })
                    }),
                    ..Default::default()
                }))
            }),
        (
            "[a-z0-9-]{0,12}",
            any::<i64>(),
            prop::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(run_id, response_stall_timeout_ms, body)| {
                Body::ProviderTunnelRequest(Box::new(pb::ProviderTunnelRequest {
                    run_id,
                    response_stall_timeout_ms,
                    operation: "chat_completions".into(),
                    body: Bytes::from(body),
                    ..Default::default()
                }))
            }),
    ];
    body.prop_map(codec::frame)
}

fn encode_all(frames: &[pb::Frame]) -> Vec<u8> {
    let mut wire = BytesMut::new();
    for frame in frames {
        assert_eq!(codec::encode(frame, &mut wire), Ok(()));
    }
    wire.to_vec()
}

/// Feeds `wire` in chunks of the given sizes (cycled; each at least 1),
/// alternating `feed` and direct writes into `buffer_mut`, draining frames
/// after every chunk.
fn decode_in_chunks(
    decoder: &mut FrameDecoder,
    wire: &[u8],
    chunk_sizes: &[usize],
) -> Result<Vec<pb::Frame>, DecodeError> {
    let mut frames = Vec::new();
    let mut pos = 0;
    let mut step = 0;
    while pos < wire.len() {
        let size = chunk_sizes[step % chunk_sizes.len()].max(1);
        let end = (pos + size).min(wire.len());
        if step % 2 == 0 {
            decoder.feed(&wire[pos..end]);
        } else {
            decoder.buffer_mut().extend_from_slice(&wire[pos..end]);
        }
        pos = end;
        step += 1;
        while let Some(frame) = decoder.decode()? {
            frames.push(frame);
        }
    }
    Ok(frames)
}

// ---------------------------------------------------------------------------
// Valid streams
// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_split_yields_exactly_the_frames_in_order(
        frames in prop::collection::vec(frame(), 0..12),
        chunk_sizes in prop::collection::vec(1usize..700, 1..20),
    ) {
        // CONTRACT: T1
        let wire = encode_all(&frames);
        let mut decoder = FrameDecoder::new();
        let decoded = decode_in_chunks(&mut decoder, &wire, &chunk_sizes);
        prop_assert_eq!(decoded, Ok(frames));
        prop_assert_eq!(decoder.buffered_bytes(), 0);
        prop_assert_eq!(decoder.decode(), Ok(None));
    }

    #[test]
    fn one_byte_feeds_yield_exactly_the_frames_in_order(
        frames in prop::collection::vec(frame(), 1..5),
    ) {
        // CONTRACT: T1
        let wire = encode_all(&frames);
        let mut decoder = FrameDecoder::new();
        let decoded = decode_in_chunks(&mut decoder, &wire, &[1]);
        prop_assert_eq!(decoded, Ok(frames));
        prop_assert_eq!(decoder.buffered_bytes(), 0);
    }

    #[test]
    fn truncated_input_waits_forever_without_error(
        frames in prop::collection::vec(frame(), 1..4),
        cut_permille in 0usize..1000,
    ) {
        // CONTRACT: T1 — a frame cut short is "need more bytes", not an error.
        let wire = encode_all(&frames);
        let last_len = frames.last().map_or(0, |f| f.encoded_len()) + LENGTH_PREFIX_BYTES;
        let last_start = wire.len() - last_len;
        // Cut inside the last frame: all earlier frames come out, then nothing.
        let cut = last_start + cut_permille * last_len / 1000;
        prop_assert!(cut < wire.len());
        let mut decoder = FrameDecoder::new();
        let decoded = decode_in_chunks(&mut decoder, &wire[..cut], &[37]);
        prop_assert_eq!(decoded, Ok(frames[..frames.len() - 1].to_vec()));
        for _ in 0..3 {
            prop_assert_eq!(decoder.decode(), Ok(None));
            prop_assert!(decoder.bytes_wanted() > 0);
        }
    }

    #[test]
    fn garbage_never_panics(
        garbage in prop::collection::vec(any::<u8>(), 0..2048),
        chunk_sizes in prop::collection::vec(1usize..64, 1..8),
        max_frame_bytes in 0usize..4096,
    ) {
        // CONTRACT: T1 — garbage gives Ok(None) or a typed error, never a
        // panic; after an error the decoder stays failed.
        let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
        match decode_in_chunks(&mut decoder, &garbage, &chunk_sizes) {
            Ok(_) => {}
            Err(error) => {
                prop_assert_ne!(&error, &DecodeError::Failed);
                prop_assert_eq!(decoder.decode(), Err(DecodeError::Failed));
            }
        }
    }

    #[test]
    fn garbage_with_a_valid_prefix_is_a_frame_or_a_decode_error(
        payload in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        // CONTRACT: T1 — a correctly framed but arbitrary protobuf payload
        // reaches prost; the outcome is a frame with a body or
        // Malformed/Empty, never FrameTooLarge and never a panic.
        let mut wire = (payload.len() as u32).to_be_bytes().to_vec();
        wire.extend_from_slice(&payload);
        let mut decoder = FrameDecoder::new();
        decoder.feed(&wire);
        match decoder.decode() {
            Ok(Some(frame)) => prop_assert!(frame.body.is_some()),
            Ok(None) => return Err(TestCaseError::fail("a complete frame must not wait")),
            Err(DecodeError::Malformed(_)) | Err(DecodeError::Empty) => {
                prop_assert_eq!(decoder.decode(), Err(DecodeError::Failed));
            }
            Err(other) => return Err(TestCaseError::fail(format!("unexpected error {other:?}"))),
        }
    }

    #[test]
    fn oversized_prefix_fails_before_the_body_arrives(
        max_frame_bytes in 0usize..=DEFAULT_MAX_FRAME_BYTES,
        excess in 1u64..=u64::from(u32::MAX),
    ) {
        // CONTRACT: T1 — the cap is checked on the 4 prefix bytes alone; no
        // buffer is grown towards the announced length.
        let len = (max_frame_bytes as u64 + excess).min(u64::from(u32::MAX));
        prop_assume!(len > max_frame_bytes as u64);
        let prefix = (len as u32).to_be_bytes();
        let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
        for byte in &prefix[..3] {
            decoder.feed(std::slice::from_ref(byte));
            prop_assert_eq!(decoder.decode(), Ok(None));
        }
        decoder.feed(&prefix[3..]);
        prop_assert!(decoder.buffer_mut().capacity() < SMALL_CAPACITY_BYTES);
        prop_assert_eq!(
            decoder.decode(),
            Err(DecodeError::FrameTooLarge { len: len as usize, max: max_frame_bytes })
        );
        prop_assert!(decoder.buffer_mut().capacity() < SMALL_CAPACITY_BYTES);
        prop_assert_eq!(decoder.decode(), Err(DecodeError::Failed));
    }
}

// ---------------------------------------------------------------------------
// Error cases, one by one
// ---------------------------------------------------------------------------

#[test]
fn prefix_above_default_cap_is_frame_too_large() {
    // CONTRACT: T1 — default cap 16 MiB: exactly 16 MiB waits for bytes,
    // one byte more is refused at once.
    let mut decoder = FrameDecoder::new();
    assert_eq!(decoder.max_frame_bytes(), 16 * 1024 * 1024);
    decoder.feed(&((DEFAULT_MAX_FRAME_BYTES + 1) as u32).to_be_bytes());
    decoder.feed(&[0x2a, 0x00, 0x01]); // some body bytes already arrived
    assert_eq!(
        decoder.decode(),
        Err(DecodeError::FrameTooLarge {
            len: DEFAULT_MAX_FRAME_BYTES + 1,
            max: DEFAULT_MAX_FRAME_BYTES
        })
    );
    assert!(decoder.buffer_mut().capacity() < SMALL_CAPACITY_BYTES);
}

#[test]
fn prefix_at_the_cap_is_accepted_and_only_then_reserved() {
    // CONTRACT: T1 — the contrast case of the capacity assertions above: a
    // length at the cap is valid, so the decoder reserves room for it. This
    // shows the capacity check can fail, i.e. it is not vacuous.
    let max_frame_bytes = 1 << 20;
    let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
    decoder.feed(&(max_frame_bytes as u32).to_be_bytes());
    assert!(decoder.buffer_mut().capacity() < SMALL_CAPACITY_BYTES);
    assert_eq!(decoder.decode(), Ok(None));
    assert!(decoder.buffer_mut().capacity() >= max_frame_bytes);
    assert_eq!(decoder.bytes_wanted(), max_frame_bytes);
}

/// A `Close` frame whose encoding is exactly `frame_len` bytes.
fn close_frame_of_len(frame_len: usize) -> pb::Frame {
    (0..frame_len)
        .map(|n| {
            codec::frame(Body::Close(pb::Close {
                reason: "x".repeat(n),
                detail: String::new(),
            }))
        })
        .find(|f| f.encoded_len() == frame_len)
        .unwrap_or_else(|| panic!("no Close frame of {frame_len} bytes"))
}

#[test]
fn custom_cap_accepts_the_limit_and_refuses_one_byte_more() {
    // CONTRACT: T1
    let max_frame_bytes = 100;
    let at_cap = close_frame_of_len(100);
    let over_cap = close_frame_of_len(101);

    let mut wire = BytesMut::new();
    assert_eq!(encode_with_max(&at_cap, &mut wire, max_frame_bytes), Ok(()));
    let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
    assert_eq!(decoder.max_frame_bytes(), 100);
    decoder.feed(&wire);
    assert_eq!(decoder.decode(), Ok(Some(at_cap)));

    // The default encoder lets 101 bytes through; the small decoder refuses.
    let mut wire = BytesMut::new();
    assert_eq!(codec::encode(&over_cap, &mut wire), Ok(()));
    decoder.feed(&wire[..LENGTH_PREFIX_BYTES]);
    assert_eq!(
        decoder.decode(),
        Err(DecodeError::FrameTooLarge { len: 101, max: 100 })
    );
}

#[test]
fn encode_with_max_refuses_an_oversized_frame() {
    // CONTRACT: T1 — the sender checks the same cap and writes nothing.
    let frame = close_frame_of_len(101);
    let mut wire = BytesMut::from(&b"keep"[..]);
    assert_eq!(
        encode_with_max(&frame, &mut wire, 100),
        Err(EncodeError::FrameTooLarge { len: 101, max: 100 })
    );
    assert_eq!(&wire[..], b"keep");
    assert_eq!(encode_with_max(&frame, &mut wire, 101), Ok(()));
    assert_eq!(wire.len(), 4 + LENGTH_PREFIX_BYTES + 101);
}

#[test]
fn encode_refuses_frames_over_the_default_cap() {
    // CONTRACT: T1
    let frame = codec::frame(Body::ProviderTunnelFrame(Box::new(
        pb::ProviderTunnelFrame {
            body: Bytes::from(vec![0u8; DEFAULT_MAX_FRAME_BYTES]),
            ..Default::default()
        },
    )));
    let len = frame.encoded_len();
    assert!(len > DEFAULT_MAX_FRAME_BYTES);
    let mut wire = BytesMut::new();
    assert_eq!(
        codec::encode(&frame, &mut wire),
        Err(EncodeError::FrameTooLarge {
            len,
            max: DEFAULT_MAX_FRAME_BYTES
        })
    );
    assert!(wire.is_empty());
}

#[test]
fn zero_length_frame_is_empty() {
    // CONTRACT: T1 — a frame with no body is a protocol error.
    let mut decoder = FrameDecoder::new();
    decoder.feed(&[0, 0, 0, 0]);
    assert_eq!(decoder.decode(), Err(DecodeError::Empty));
    assert_eq!(decoder.decode(), Err(DecodeError::Failed));
}

#[test]
fn frame_with_only_unknown_fields_is_empty() {
    // CONTRACT: T1 — field 99 (varint) is skipped; no body remains.
    let mut decoder = FrameDecoder::new();
    decoder.feed(&[0, 0, 0, 3, 0x98, 0x06, 0x01]);
    assert_eq!(decoder.decode(), Err(DecodeError::Empty));
}

#[test]
fn malformed_protobuf_is_malformed() {
    // CONTRACT: T1
    let cases: [&[u8]; 3] = [
        // Frame.register_request announces 5 bytes, none follow.
        &[0x0a, 0x05],
        // RegisterRequest.node_id holds invalid UTF-8.
        &[0x0a, 0x03, 0x0a, 0x01, 0xff],
        // Wire type 7 does not exist.
        &[0x0f],
    ];
    for payload in cases {
        let mut decoder = FrameDecoder::new();
        decoder.feed(&(payload.len() as u32).to_be_bytes());
        decoder.feed(payload);
        let result = decoder.decode();
        assert!(
            matches!(result, Err(DecodeError::Malformed(_))),
            "{payload:?} gave {result:?}"
        );
    }
}

#[test]
fn after_an_error_every_decode_fails() {
    // CONTRACT: T1 — the decoder stays failed even when valid frames follow,
    // and drops further input.
    let mut valid = BytesMut::new();
    let heartbeat = codec::frame(Body::Heartbeat(pb::Heartbeat { seq: 1 }));
    assert_eq!(codec::encode(&heartbeat, &mut valid), Ok(()));

    let mut decoder = FrameDecoder::new();
    decoder.feed(&[0, 0, 0, 0]);
    decoder.feed(&valid);
    assert_eq!(decoder.decode(), Err(DecodeError::Empty));
    assert_eq!(decoder.buffered_bytes(), 0);
    for _ in 0..3 {
        decoder.feed(&valid);
        assert_eq!(decoder.buffered_bytes(), 0);
        assert_eq!(decoder.decode(), Err(DecodeError::Failed));
    }
}

#[test]
fn close_reasons() {
    // CONTRACT: T1 — the connection closes with a machine-readable reason.
    let too_large = DecodeError::FrameTooLarge { len: 2, max: 1 };
    assert_eq!(too_large.close_reason().as_str(), "frame_too_large");
    assert_eq!(
        DecodeError::Malformed("x".into()).close_reason().as_str(),
        "decode_error"
    );
    assert_eq!(DecodeError::Empty.close_reason().as_str(), "decode_error");
    assert_eq!(DecodeError::Failed.close_reason().as_str(), "decode_error");
    assert_eq!(
        too_large.to_string(),
        "frame of 2 bytes exceeds the maximum of 1 bytes"
    );
}

#[test]
fn bytes_wanted_tracks_prefix_then_frame() {
    // CONTRACT: T1
    let frame = close_frame_of_len(50);
    let mut wire = BytesMut::new();
    assert_eq!(codec::encode(&frame, &mut wire), Ok(()));
    let mut decoder = FrameDecoder::new();
    assert_eq!(decoder.bytes_wanted(), 4);
    decoder.feed(&wire[..2]);
    assert_eq!(decoder.bytes_wanted(), 2);
    decoder.feed(&wire[2..10]);
    assert_eq!(decoder.decode(), Ok(None));
    assert_eq!(decoder.bytes_wanted(), 50 - 6);
    decoder.feed(&wire[10..]);
    assert_eq!(decoder.decode(), Ok(Some(frame)));
    assert_eq!(decoder.bytes_wanted(), 4);
}

// ---------------------------------------------------------------------------
// The chunk fast path agrees with prost
// ---------------------------------------------------------------------------

/// One field of a tunnel frame as bytes: mostly the four a chunk has, some
/// repeated, of the wrong wire type, unknown, truncated or overlong.
fn tunnel_field() -> impl Strategy<Value = Vec<u8>> {
    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    let len_field = |field: u64, value: Vec<u8>| {
        let mut out = Vec::new();
        varint(field << 3 | 2, &mut out);
        varint(value.len() as u64, &mut out);
        out.extend(value);
        out
    };
    let varint_field = |field: u64, value: u64| {
        let mut out = Vec::new();
        varint(field << 3, &mut out);
        varint(value, &mut out);
        out
    };
    prop_oneof![
        4 => "[a-z0-9-]{0,12}".prop_map(move |id| len_field(1, id.into_bytes())),
        4 => any::<u64>().prop_map(move |v| varint_field(2, v)),
        4 => prop_oneof![Just(2u64), any::<u64>()].prop_map(move |v| varint_field(3, v)),
        4 => prop::collection::vec(any::<u8>(), 0..200).prop_map(move |b| len_field(6, b)),
        1 => prop::collection::vec(any::<u8>(), 1..4).prop_map(move |b| len_field(1, b)),
        1 => (1u64..20, any::<u64>()).prop_map(move |(f, v)| varint_field(f, v)),
        1 => (1u64..20, prop::collection::vec(any::<u8>(), 0..8))
            .prop_map(move |(f, b)| len_field(f, b)),
        1 => prop::collection::vec(any::<u8>(), 0..6),
        1 => Just(vec![0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02]),
    ]
}

proptest! {
    /// Whatever a frame holds, the decoder returns what prost decodes, or
    /// fails where prost fails: the hand-decoded chunk path changes cost,
    /// never the result.
    #[test]
    fn the_decoder_agrees_with_prost_on_tunnel_frames(
        fields in prop::collection::vec(tunnel_field(), 0..7),
        outer_field in prop_oneof![8 => Just(10u8), 1 => Just(8u8)],
        trailing in prop_oneof![8 => Just(Vec::new()), 1 => prop::collection::vec(any::<u8>(), 1..4)],
    ) {
        let inner: Vec<u8> = fields.concat();
        let mut message = vec![outer_field << 3 | 2];
        let mut len = inner.len();
        while len >= 0x80 {
            message.push((len as u8) | 0x80);
            len >>= 7;
        }
        message.push(len as u8);
        message.extend(&inner);
        message.extend(&trailing);
        let expected = pb::Frame::decode(&message[..]);
        let mut wire = (message.len() as u32).to_be_bytes().to_vec();
        wire.extend(&message);
        let mut decoder = FrameDecoder::new();
        decoder.feed(&wire);
        match (decoder.decode(), expected.clone()) {
            (Ok(Some(got)), Ok(want)) => prop_assert_eq!(got, want),
            (Err(DecodeError::Malformed(_)), Err(_)) => {}
            (Err(DecodeError::Empty), Ok(want)) => prop_assert!(want.body.is_none()),
            (got, want) => prop_assert!(false, "decoder {:?}, prost {:?}", got, want),
        }
        // Asked for chunks, the decoder hands over a chunk only where prost
        // decodes a `BODY` frame, and the chunk is that frame.
        let mut decoder = FrameDecoder::new();
        decoder.feed(&wire);
        match (decoder.decode_inbound(), expected) {
            (Ok(Some(Inbound::Chunk(chunk))), Ok(want)) => {
                let Some(Body::ProviderTunnelFrame(tf)) = &want.body else {
                    return Err(TestCaseError::fail(format!("a chunk where prost decodes {want:?}")));
                };
                prop_assert_eq!(tf.kind(), pb::TunnelFrameKind::Body);
                prop_assert_eq!(chunk.run_id(), tf.run_id.as_str());
                prop_assert_eq!(chunk.seq(), tf.seq);
                prop_assert_eq!(&chunk.body, &tf.body);
                prop_assert_eq!(Inbound::Chunk(chunk).into_frame(), want);
            }
            // A repeated field, say, falls back to prost: a frame, as prost
            // decodes it.
            (Ok(Some(Inbound::Frame(got))), Ok(want)) => prop_assert_eq!(got, want),
            (Err(DecodeError::Malformed(_)), Err(_)) => {}
            (Err(DecodeError::Empty), Ok(want)) => prop_assert!(want.body.is_none()),
            (got, want) => prop_assert!(false, "decoder {:?}, prost {:?}", got, want),
        }
    }
}
