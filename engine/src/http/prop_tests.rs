//! Property tests: no parser panics on arbitrary bytes, and encoders and
//! decoders agree at any split of the input.

use bytes::BytesMut;
use proptest::prelude::*;

use super::*;

/// Feeds `input` cut at `cuts` (sorted, deduplicated, in range).
fn pieces<'a>(input: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut from = 0;
    for cut in cuts {
        out.push(&input[from..cut]);
        from = cut;
    }
    out.push(&input[from..]);
    out
}

proptest! {
    #[test]
    fn heads_never_panic(input in proptest::collection::vec(any::<u8>(), 0..512)) {
        let limits = Limits { max_head_bytes: 256, max_headers: 8, ..Limits::default() };
        let _ = parse_request_head(&mut BytesMut::from(&input[..]), &limits);
        let _ = parse_response_head(&mut BytesMut::from(&input[..]), &limits, false);
    }

    #[test]
    fn body_decoders_never_panic(input in proptest::collection::vec(any::<u8>(), 0..512)) {
        let limits = Limits { max_chunk_line_bytes: 16, max_head_bytes: 64, ..Limits::default() };
        for raw in [false, true] {
            let mut dec = BodyDecoder::new(BodyFraming::Chunked, &limits, Some(128)).unwrap();
            let mut buf = BytesMut::from(&input[..]);
            for _ in 0..input.len() + 2 {
                let step = if raw { dec.decode_raw(&mut buf) } else { dec.decode(&mut buf) };
                match step {
                    Ok(Some(BodyEvent::Data(_))) => {}
                    _ => break,
                }
            }
        }
    }

    #[test]
    fn splitters_never_panic(input in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut sse = SseSplitter::new(64);
        sse.feed(&input);
        sse.finish();
        while let Ok(Some(_)) = sse.next_event() {}
        let mut ndjson = NdjsonSplitter::new(64);
        ndjson.feed(&input);
        ndjson.finish();
        while let Ok(Some(_)) = ndjson.next_line() {}
    }

    #[test]
    fn chunked_encoding_round_trips_at_any_split(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 0..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let mut wire = Vec::new();
        for chunk in &chunks {
            wire.extend_from_slice(encode_chunk_header(chunk.len()).as_bytes());
            wire.extend_from_slice(chunk);
            wire.extend_from_slice(CHUNK_DATA_END);
        }
        wire.extend_from_slice(CHUNKED_END);
        let mut dec = ChunkedDecoder::new(32, 64);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut ended = false;
        for piece in pieces(&wire, &cuts) {
            buf.extend_from_slice(piece);
            while let Some(item) = dec.decode(&mut buf).unwrap() {
                match item {
                    ChunkedItem::Data(d) => out.extend_from_slice(&d),
                    ChunkedItem::End => { ended = true; break; }
                }
            }
        }
        prop_assert!(ended);
        prop_assert_eq!(out, chunks.concat());
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn sse_raw_blocks_reassemble_the_input_at_any_split(
        events in proptest::collection::vec(
            (proptest::collection::vec("[a-z :]{0,12}", 0..4), 0usize..3),
            0..6,
        ),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let endings = ["\n", "\r\n", "\r"];
        let mut stream = Vec::new();
        for (lines, ending) in &events {
            let ending = endings[*ending];
            for line in lines {
                // Lines are non-empty so they do not end the block early.
                stream.extend_from_slice(b"x");
                stream.extend_from_slice(line.as_bytes());
                stream.extend_from_slice(ending.as_bytes());
            }
            stream.extend_from_slice(ending.as_bytes());
        }
        let mut split = SseSplitter::new(4096);
        let mut out = Vec::new();
        for piece in pieces(&stream, &cuts) {
            split.feed(piece);
            while let Some(raw) = split.next_raw().unwrap() {
                out.extend_from_slice(&raw);
            }
        }
        split.finish();
        while let Some(raw) = split.next_raw().unwrap() {
            out.extend_from_slice(&raw);
        }
        out.extend_from_slice(&split.take_remainder());
        prop_assert_eq!(out, stream);
    }
}
