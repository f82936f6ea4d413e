//! The checks behind every fuzz target, one function per decoder. Each takes
//! the fuzzer's bytes, drives the decoder, and asserts the decoder's
//! contract (libFuzzer reports a panic or failed assertion as a crash):
//!
//! | target | decoder | beyond "never panics" |
//! |---|---|---|
//! | `frame_decoder` | `iop_wire::FrameDecoder` (T1) | sticky error; decoded frames re-encode to equal frames |
//! | `http_request_head` | `parse_request_head` | any split parses as the whole; a partial parse consumes nothing |
//! | `http_response_head` | `parse_response_head` | the same |
//! | `chunked_decoder` | `BodyDecoder` (chunked) | any split decodes as the whole; raw bytes re-decode to the data |
//! | `sse_splitter` | `SseSplitter` | raw blocks + remainder are the input; any split gives the same blocks |
//! | `ndjson_splitter` | `NdjsonSplitter` | any split gives the same lines; lines hold no LF |
//! | `lease_open` | `iop_wire::lease::open` (C2, C3) | only the issued secret ever opens; a lease opens once |
//! | `edge_request_json` | the Edge's request parse and `model` splice (U5) | the splice re-parses with only `model` changed |
//! | `edge_body_members` | the Edge's member reading: repeated names, the member cap, nested objects | the same answers as a naive reference |
//! | `ollama_stream` | the Node's Ollama NDJSON item parser | exactly one terminal, nothing after it |
//! | `openai_stream` | the Node's OpenAI SSE item parser | exactly one terminal, nothing after it |
//! | `edge_config` | `EdgeConfig::parse` | errors name the file |
//! | `node_config` | `NodeConfig::parse` | errors name the file |
//!
//! Many targets read a first control byte that sets how the rest is split
//! into reads, so libFuzzer mutates the split along with the bytes.

use std::sync::OnceLock;

use bytes::{Bytes, BytesMut};
use iop_engine::http::{
    parse_request_head, parse_response_head, BodyDecoder, BodyEvent, BodyFraming, HttpError,
    Limits, NdjsonSplitter, SseSplitter,
};
use iop_wire::codec::{self, DecodeError, FrameDecoder};
use iop_wire::limits::DEFAULT_MAX_FRAME_BYTES;
use iop_wire::pb::{self, frame::Body};

/// Splits `data` into a control byte and the rest; the control byte's low
/// four bits (plus one) are the read size of a split feed, zero meaning
/// "all at once".
fn control(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&c, rest)) => (c, rest),
        None => (0, data),
    }
}

/// `input` cut into reads of `size` bytes (`0`: one read).
fn pieces(input: &[u8], size: usize) -> impl Iterator<Item = &[u8]> {
    let size = if size == 0 { input.len().max(1) } else { size };
    input.chunks(size)
}

// ---------------------------------------------------------------------------
// Frames

/// `frame_decoder`: arbitrary bytes, in arbitrary chunk splits, with the
/// default or a small frame cap.
///
/// ```text
/// byte 0        bits 0..=3: n, the number of chunk-size bytes that follow
///               bit 4: use a small cap (the next 2 bytes, big-endian u16)
/// n bytes       chunk sizes, each `byte + 1`, cycled
/// [2 bytes]     small cap, when bit 4 is set
/// rest          the byte stream fed to the decoder
/// ```
pub fn frame_decoder(data: &[u8]) {
    let (control, rest) = control(data);
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
    let mut decoder = FrameDecoder::with_max_frame_bytes(max_frame_bytes);
    let mut failed = false;
    let mut pos = 0;
    let mut step = 0;
    while pos < stream.len() {
        let size = chunk_sizes[step % chunk_sizes.len()];
        let end = stream.len().min(pos.saturating_add(size));
        if step % 2 == 0 {
            decoder.feed(&stream[pos..end]);
        } else {
            decoder.buffer_mut().extend_from_slice(&stream[pos..end]);
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

// ---------------------------------------------------------------------------
// HTTP heads

/// Small limits so the caps are reached too.
fn small_limits() -> Limits {
    Limits {
        max_head_bytes: 512,
        max_headers: 8,
        max_body_bytes: 4096,
        max_chunk_line_bytes: 32,
    }
}

/// Control byte bit 4: small limits.
fn limits_for(control: u8) -> Limits {
    if control & 0x10 != 0 {
        small_limits()
    } else {
        Limits::default()
    }
}

/// A head parser's outcome, comparable across splits.
#[derive(Debug, PartialEq, Eq)]
enum HeadOutcome<T> {
    Head { head: T, rest: Vec<u8> },
    Partial,
    Failed(String),
}

fn parse_split<T>(
    input: &[u8],
    size: usize,
    parse: impl Fn(&mut BytesMut) -> Result<Option<T>, HttpError>,
) -> HeadOutcome<T> {
    let mut buf = BytesMut::new();
    for piece in pieces(input, size) {
        buf.extend_from_slice(piece);
        let before = buf.len();
        match parse(&mut buf) {
            Ok(Some(head)) => {
                // The rest of the input stays after the head.
                let consumed = before - buf.len();
                let fed = buf.len();
                let mut rest = buf.to_vec();
                rest.extend_from_slice(&input[consumed + fed..]);
                return HeadOutcome::Head { head, rest };
            }
            Ok(None) => assert_eq!(buf.len(), before, "a partial parse consumed bytes"),
            Err(e) => return HeadOutcome::Failed(e.to_string()),
        }
    }
    HeadOutcome::Partial
}

/// `http_request_head`: byte 0 sets the split and the limits; the rest is
/// the input. Parsing it split must give what parsing it whole gives.
pub fn http_request_head(data: &[u8]) {
    let (control, input) = control(data);
    let limits = limits_for(control);
    let parse = |buf: &mut BytesMut| parse_request_head(buf, &limits);
    let whole = parse_split(input, 0, parse);
    let split = parse_split(input, usize::from(control & 0x0f) + 1, parse);
    assert_eq!(whole, split);
    if let HeadOutcome::Head { head, .. } = &whole {
        assert!(head.headers.len() <= limits.max_headers);
    }
}

/// `http_response_head`: as [`http_request_head`]; control bit 5 says the
/// request was HEAD.
pub fn http_response_head(data: &[u8]) {
    let (control, input) = control(data);
    let limits = limits_for(control);
    let head_request = control & 0x20 != 0;
    let parse = |buf: &mut BytesMut| parse_response_head(buf, &limits, head_request);
    let whole = parse_split(input, 0, parse);
    let split = parse_split(input, usize::from(control & 0x0f) + 1, parse);
    assert_eq!(whole, split);
    if let HeadOutcome::Head { head, .. } = &whole {
        if head_request {
            assert_eq!(head.framing, BodyFraming::None);
        }
    }
}

// ---------------------------------------------------------------------------
// Chunked bodies

/// A body decode's outcome: the data, then how it ended and what followed.
#[derive(Debug, PartialEq, Eq)]
struct BodyOutcome {
    data: Vec<u8>,
    end: Result<Option<Vec<u8>>, String>,
}

fn decode_chunked(input: &[u8], size: usize, raw: bool, limits: &Limits) -> BodyOutcome {
    let mut decoder = BodyDecoder::new(BodyFraming::Chunked, limits, Some(limits.max_body_bytes))
        .expect("chunked framing always has a decoder");
    let mut buf = BytesMut::new();
    let mut data = Vec::new();
    let mut fed = 0;
    for piece in pieces(input, size) {
        buf.extend_from_slice(piece);
        fed += piece.len();
        loop {
            let event = if raw {
                decoder.decode_raw(&mut buf)
            } else {
                decoder.decode(&mut buf)
            };
            match event {
                Ok(Some(BodyEvent::Data(d))) => {
                    assert!(!d.is_empty(), "empty data event");
                    data.extend_from_slice(&d);
                }
                Ok(Some(BodyEvent::End)) => {
                    let mut rest = buf.to_vec();
                    rest.extend_from_slice(&input[fed..]);
                    return BodyOutcome {
                        data,
                        end: Ok(Some(rest)),
                    };
                }
                Ok(None) => break,
                Err(e) => {
                    return BodyOutcome {
                        data,
                        end: Err(e.to_string()),
                    }
                }
            }
        }
    }
    BodyOutcome {
        data,
        end: Ok(None),
    }
}

/// `chunked_decoder`: byte 0 sets the split and the limits; the rest is a
/// chunked body (and whatever follows it).
pub fn chunked_decoder(data: &[u8]) {
    let (control, input) = control(data);
    let limits = limits_for(control);
    let size = usize::from(control & 0x0f) + 1;
    let whole = decode_chunked(input, 0, false, &limits);
    let split = decode_chunked(input, size, false, &limits);
    // Errors are found at the same byte whatever the split; data handed out
    // before an error may differ by what the last read held.
    assert_eq!(whole.end, split.end);
    if whole.end.is_ok() {
        assert_eq!(whole.data, split.data);
    }
    assert!(whole.data.len() <= limits.max_body_bytes || whole.end.is_err());
    // The raw (wire-exact) view ends at the same place, and its bytes are
    // a chunked body that decodes to the same data.
    let raw = decode_chunked(input, size, true, &limits);
    assert_eq!(raw.end.is_ok(), whole.end.is_ok());
    if let (Ok(Some(rest)), Ok(Some(raw_rest))) = (&whole.end, &raw.end) {
        assert_eq!(rest, raw_rest);
        let again = decode_chunked(&raw.data, 0, false, &limits);
        assert_eq!(again.data, whole.data);
        assert_eq!(again.end, Ok(Some(Vec::new())));
    }
}

// ---------------------------------------------------------------------------
// SSE and NDJSON

#[derive(Debug, PartialEq, Eq)]
struct Split {
    items: Vec<Bytes>,
    rest: Result<Bytes, String>,
}

fn sse_split(input: &[u8], size: usize, max_event_bytes: usize) -> Split {
    let mut splitter = SseSplitter::new(max_event_bytes);
    let mut items = Vec::new();
    let mut fed = 0;
    let total = input.len();
    for piece in pieces(input, size).chain(std::iter::once(&[][..])) {
        fed += piece.len();
        splitter.feed(piece);
        if fed == total && piece.is_empty() {
            splitter.finish();
        }
        loop {
            match splitter.next_raw() {
                Ok(Some(raw)) => items.push(raw),
                Ok(None) => break,
                Err(e) => {
                    return Split {
                        items,
                        rest: Err(e.to_string()),
                    }
                }
            }
        }
    }
    Split {
        items,
        rest: Ok(splitter.take_remainder()),
    }
}

/// `sse_splitter`: byte 0 sets the split and a small cap; the rest is an
/// event stream.
pub fn sse_splitter(data: &[u8]) {
    let (control, input) = control(data);
    let max = if control & 0x10 != 0 { 64 } else { 1 << 20 };
    let whole = sse_split(input, 0, max);
    let split = sse_split(input, usize::from(control & 0x0f) + 1, max);
    if let Ok(rest) = &whole.rest {
        assert_eq!(whole, split);
        // Raw blocks and the remainder are the input, byte for byte.
        let mut joined: Vec<u8> = whole.items.iter().flat_map(|b| b.to_vec()).collect();
        joined.extend_from_slice(rest);
        assert_eq!(joined, input);
        for block in &whole.items {
            assert!(block.len() <= max);
            // Parsing a block never panics; joined data lines are no longer
            // than the block (unless invalid UTF-8 became U+FFFD).
            let event = iop_engine::http::parse_event(block);
            if let (Some(data), Ok(_)) = (&event.data, std::str::from_utf8(block)) {
                assert!(data.len() <= block.len());
            }
        }
    }
    // The parsed view skips exactly the empty blocks.
    let mut events = SseSplitter::new(max);
    events.feed(input);
    events.finish();
    while let Ok(Some(event)) = events.next_event() {
        assert!(!event.is_empty());
    }
}

fn ndjson_split(input: &[u8], size: usize, max_line_bytes: usize) -> Split {
    let mut splitter = NdjsonSplitter::new(max_line_bytes);
    let mut items = Vec::new();
    let pieces: Vec<&[u8]> = pieces(input, size).collect();
    for (i, piece) in pieces.iter().enumerate() {
        splitter.feed(piece);
        if i + 1 == pieces.len() {
            splitter.finish();
        }
        loop {
            match splitter.next_line() {
                Ok(Some(line)) => items.push(line),
                Ok(None) => break,
                Err(e) => {
                    return Split {
                        items,
                        rest: Err(e.to_string()),
                    }
                }
            }
        }
    }
    Split {
        items,
        rest: Ok(Bytes::new()),
    }
}

/// `ndjson_splitter`: byte 0 sets the split and a small cap; the rest is a
/// newline-delimited stream.
pub fn ndjson_splitter(data: &[u8]) {
    let (control, input) = control(data);
    let max = if control & 0x10 != 0 { 32 } else { 1 << 20 };
    let whole = ndjson_split(input, 0, max);
    let split = ndjson_split(input, usize::from(control & 0x0f) + 1, max);
    if whole.rest.is_ok() {
        assert_eq!(whole, split);
    }
    for line in &whole.items {
        assert!(!line.is_empty(), "blank lines are skipped");
        assert!(!line.contains(&b'\n'));
        assert!(line.len() <= max);
    }
}

// ---------------------------------------------------------------------------
// Credential leases

const LEASE_SECRET: &[u8] = b"sk-fuzz-0123456789";
const NOT_BEFORE_MS: i64 = 1_000_000;
const EXPIRES_AT_MS: i64 = 1_060_000;

struct LeaseFixture {
    issuer: ed25519_dalek::SigningKey,
    recipient: iop_wire::lease::RecipientKey,
    binding: pb::CredentialLeaseBinding,
    lease: pb::CredentialLease,
}

/// The origin the fixture lease is bound to.
const LEASE_ORIGIN: &str = "http://10.0.0.5:8000";

fn lease_fixture() -> &'static LeaseFixture {
    static FIXTURE: OnceLock<LeaseFixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        use iop_wire::lease::{issue, upstream_target, IssueParams, LeaseEntropy, RecipientKey};
        let recipient = RecipientKey::from_secret(x25519_dalek::StaticSecret::from([9; 32]));
        let binding = pb::CredentialLeaseBinding {
            principal: "client-a".into(),
            slot: "slot-a".into(),
            route: "model-a".into(),
            profile: "openai".into(),
            upstream_target: upstream_target("openai", "gpt-4o"),
            selected_node: "node-a".into(),
            recipient: recipient.key_id().to_owned(),
            credential_revision: 3,
            route_revision: 5,
            projection_generation: 8,
            upstream_origin: LEASE_ORIGIN.into(),
            run_id: "run-1".into(),
            request_digest: Bytes::copy_from_slice(&LEASE_REQUEST_DIGEST),
            provider_trust: Bytes::copy_from_slice(&LEASE_PROVIDER_TRUST),
        };
        let issuer = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let lease = issue(
            &IssueParams {
                lease_id: "lease-1",
                sequence: 1,
                binding: &binding,
                secret: LEASE_SECRET,
                header_name: "Authorization",
                header_format: "Bearer {secret}",
                not_before_unix_ms: NOT_BEFORE_MS,
                expires_at_unix_ms: EXPIRES_AT_MS,
            },
            &issuer,
            &recipient.public_key(),
            LeaseEntropy::from_seed([3; 32]),
        )
        .expect("the fixture lease issues");
        LeaseFixture {
            issuer,
            recipient,
            binding,
            lease,
        }
    })
}

/// The request digest the fixture lease is bound to (any 32 bytes: the
/// target checks the binding, not the digest's preimage).
const LEASE_REQUEST_DIGEST: [u8; 32] = [5; 32];
/// The provider trust digest the fixture lease is bound to (any 32 bytes,
/// likewise).
const LEASE_PROVIDER_TRUST: [u8; 32] = [6; 32];

/// `lease_open`: a valid lease and binding, patched by the input
/// (protobuf bytes merged into one of them), optionally re-signed so the
/// checks after the signature are reached too.
///
/// ```text
/// byte 0   bit 0: patch the binding (else the lease)
///          bit 1: recompute the binding digest into the lease
///          bit 2: re-sign the lease with the issuer key
///          bit 3: drop the lease; bit 4: drop the binding
/// byte 1-2 now, as an offset in seconds from not_before (big-endian i16)
/// rest     protobuf bytes merged into the patched message
/// ```
pub fn lease_open(data: &[u8]) {
    use iop_wire::lease::{
        binding_digest, open, sign, ExpectedScope, OpenContext, OriginPins, ReplayGuard,
    };
    use prost::Message;

    let f = lease_fixture();
    let (control, rest) = control(data);
    let (offset_sec, patch) = match rest {
        [hi, lo, patch @ ..] => (i64::from(i16::from_be_bytes([*hi, *lo])), patch),
        _ => (30, rest),
    };
    let mut lease = f.lease.clone();
    let mut binding = f.binding.clone();
    let merged = if control & 1 != 0 {
        binding.merge(patch)
    } else {
        lease.merge(patch)
    };
    if merged.is_err() {
        return;
    }
    if control & 2 != 0 {
        lease.binding_digest = Bytes::copy_from_slice(&binding_digest(&binding));
    }
    if control & 4 != 0 {
        sign(&mut lease, &f.issuer);
    }
    let scope = ExpectedScope {
        selected_node: &f.binding.selected_node,
        upstream_target: &f.binding.upstream_target,
        upstream_origin: LEASE_ORIGIN,
        provider_trust: &LEASE_PROVIDER_TRUST,
        run_id: &f.binding.run_id,
        request_digest: &LEASE_REQUEST_DIGEST,
        profile: Some(&f.binding.profile),
        principal: None,
        slot: None,
        route: None,
        credential_revision: Some(f.binding.credential_revision),
        route_revision: None,
        projection_generation: None,
    };
    let issuer = f.issuer.verifying_key();
    let pins = OriginPins::new();
    let ctx = OpenContext {
        recipient: &f.recipient,
        issuer: &issuer,
        scope,
        revoked: &[],
        origin_pins: &pins,
        now_unix_ms: NOT_BEFORE_MS + offset_sec * 1000,
        clock_skew_ms: 2_000,
    };
    let mut replay = ReplayGuard::new(NOT_BEFORE_MS - 10_000);
    let lease_arg = (control & 8 == 0).then_some(&lease);
    let binding_arg = (control & 16 == 0).then_some(&binding);
    if let Ok(opened) = open(lease_arg, binding_arg, &ctx, &mut replay) {
        // Authenticated encryption: only the secret that was sealed opens.
        assert_eq!(opened.secret_bytes(), LEASE_SECRET);
        // A lease opens once.
        assert!(open(lease_arg, binding_arg, &ctx, &mut replay).is_err());
    }
}

// ---------------------------------------------------------------------------
// The Edge's request bodies

/// `edge_request_json`: the input is a request body. If the Edge accepts
/// it, the body it builds for a provider must parse again with `model`
/// naming the target and every other member unchanged.
pub fn edge_request_json(data: &[u8]) {
    use edge_bin::api::body_json::{JsonLimits, Members};
    use edge_bin::api::openai::{ChatRequest, PassthroughRequest};

    const TARGET: &str = "org/target \"7b\"\u{e9}";
    let body = Bytes::copy_from_slice(data);
    let limits = JsonLimits {
        max_depth: 16,
        max_elements: 4096,
        max_members: 64,
    };
    if let Ok(chat) = ChatRequest::parse(body.clone(), &limits) {
        let _ = chat.include_usage();
        let _ = chat.estimated_prompt_tokens();
        let input = chat.run_input();
        assert!(input.messages.len() <= limits.max_elements as usize);
        let pieces = chat.body_for_target(TARGET);
        // Before and after the value: the client's own bytes, in place.
        let [before, _, after] = pieces.parts() else {
            panic!("three pieces")
        };
        assert!(body.starts_with(before) && body.ends_with(after));
        let spliced = pieces.to_bytes();
        let again = ChatRequest::parse(spliced, &limits)
            .unwrap_or_else(|e| panic!("the spliced body does not parse: {e:?}"));
        assert_eq!(again.model, TARGET);
        assert_eq!(again.stream, chat.stream);
        assert_eq!(again.run_input(), input);
    }
    if let Ok(pass) = PassthroughRequest::parse(body.clone(), &limits) {
        let spliced = pass.body_for_target(TARGET).to_bytes();
        let again = PassthroughRequest::parse(spliced.clone(), &limits)
            .unwrap_or_else(|e| panic!("the spliced body does not parse: {e:?}"));
        assert_eq!(again.model, TARGET);
        let before = Members::parse(body, &limits).expect("parsed once");
        let after = Members::parse(spliced, &limits).expect("parsed again");
        for name in ["input", "messages", "stream", "tools", "max_tokens"] {
            assert_eq!(before.raw(name), after.raw(name), "member {name} changed");
        }
    }
}

/// The top-level member names of `text` in order, by a reference reading
/// written apart from the Edge's (`None` unless `text` is one JSON
/// object).
fn reference_member_names(text: &str) -> Option<Vec<String>> {
    struct Names;
    impl<'de> serde::de::Visitor<'de> for Names {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut names = Vec::new();
            while let Some((name, _)) = map.next_entry::<String, serde::de::IgnoredAny>()? {
                names.push(name);
            }
            Ok(names)
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let names = serde::Deserializer::deserialize_map(&mut de, Names).ok()?;
    de.end().ok()?;
    Some(names)
}

/// `edge_body_members`: the Edge's reading of a body's members against a
/// naive reference (a quadratic scan, fine on fuzzer-sized inputs).
///
/// ```text
/// byte 0   the top-level member cap: `byte % 32` (0 to 31)
/// rest     the request body
/// ```
///
/// Checked: a body accepted by `Members::parse` is one object with at most
/// the cap of members, all names distinct, in the reference's order; a
/// refusal for a repeated name names the first member whose name came
/// before; a refusal at the member cap means the reference counts more
/// members than the cap; a valid object within the cap, without repeats
/// and within the other bounds, is accepted. `object_members` (the lenient
/// reading of nested objects) gives each distinct name once, in order of
/// first appearance, with its last value.
pub fn edge_body_members(data: &[u8]) {
    use edge_bin::api::body_json::{object_members, BodyError, JsonLimits, Members};

    let (control, rest) = control(data);
    let limits = JsonLimits {
        max_depth: 16,
        max_elements: 4096,
        max_members: u64::from(control % 32),
    };
    let reference = std::str::from_utf8(rest)
        .ok()
        .and_then(reference_member_names);
    // The first member whose name appeared before it, naively.
    let first_repeat = reference.as_ref().and_then(|names| {
        (0..names.len())
            .find(|&i| names[..i].contains(&names[i]))
            .map(|i| names[i].clone())
    });
    match Members::parse(Bytes::copy_from_slice(rest), &limits) {
        Ok(members) => {
            let names: Vec<&str> = members.names().collect();
            let Some(reference) = &reference else {
                panic!("accepted a body the reference does not read as one object")
            };
            assert_eq!(names, *reference, "member names");
            assert!(names.len() as u64 <= limits.max_members, "over the cap");
            assert_eq!(first_repeat, None, "accepted a repeated name");
        }
        Err(BodyError::DuplicateMember(name)) => {
            assert_eq!(Some(name), first_repeat, "the repeated name reported");
        }
        Err(BodyError::TooManyMembers { max_members }) => {
            assert_eq!(max_members, limits.max_members);
            if let Some(reference) = &reference {
                assert!(
                    reference.len() as u64 > max_members,
                    "refused within the cap"
                );
            }
        }
        Err(BodyError::TooDeep { .. } | BodyError::TooManyElements { .. }) => {}
        Err(e @ (BodyError::Syntax(_) | BodyError::NotAnObject)) => {
            if let Some(reference) = &reference {
                // The reference reads objects beyond the depth bound, and
                // the Edge checks the bounds first: only a valid object
                // within every bound must be accepted.
                let within = reference.len() as u64 <= limits.max_members
                    && edge_bin::api::body_json::check_shape(rest, &limits).is_ok();
                assert!(!within, "a valid object refused: {e:?}");
            }
        }
    }
    // The lenient reading of a nested object.
    if let Some(text) = std::str::from_utf8(rest).ok() {
        if let (Some(members), Some(names)) = (object_members(text), reference_member_names(text)) {
            let mut distinct: Vec<&String> = Vec::new();
            for name in &names {
                if !distinct.contains(&name) {
                    distinct.push(name);
                }
            }
            let got: Vec<&str> = members.iter().map(|(n, _)| n.as_ref()).collect();
            assert_eq!(got, distinct, "lenient member names");
            // Each value is the last one given for its name.
            let values = reference_member_values(text);
            for (name, value) in &members {
                let last = values
                    .iter()
                    .rev()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.as_str());
                assert_eq!(Some(value.get()), last, "value of {name}");
            }
        }
    }
}

/// Every top-level `(name, raw value)` of `text`, repeats included.
fn reference_member_values(text: &str) -> Vec<(String, String)> {
    let members: Vec<(String, Box<serde_json::value::RawValue>)> =
        serde_json::from_str::<RawMembers>(text)
            .map(|m| m.0)
            .unwrap_or_default();
    members
        .into_iter()
        .map(|(name, value)| (name, value.get().to_string()))
        .collect()
}

/// An object read as its members in order, repeats kept.
struct RawMembers(Vec<(String, Box<serde_json::value::RawValue>)>);

impl<'de> serde::Deserialize<'de> for RawMembers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawMembers;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawMembers, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    out.push(entry);
                }
                Ok(RawMembers(out))
            }
        }
        d.deserialize_map(V)
    }
}

// ---------------------------------------------------------------------------
// The Node's stream item parsers

fn is_terminal(output: &node_bin::calls::output::RunOutput) -> bool {
    matches!(
        output,
        node_bin::calls::output::RunOutput::Complete { .. }
            | node_bin::calls::output::RunOutput::Failed { .. }
    )
}

/// Feeds `items` then the end of the body to `parser`: exactly one terminal
/// comes out, and nothing after it.
fn check_items(parser: &mut impl node_bin::calls::normalize::ItemParser, items: &[&[u8]]) {
    let mut outputs = Vec::new();
    for item in items {
        outputs.extend(parser.on_item(item));
    }
    outputs.extend(parser.on_end());
    let terminals: Vec<usize> = outputs
        .iter()
        .enumerate()
        .filter(|(_, o)| is_terminal(o))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(terminals.len(), 1, "terminals: {outputs:?}");
    assert_eq!(terminals[0], outputs.len() - 1, "output after the terminal");
}

/// `ollama_stream`: the input's lines are Ollama NDJSON items.
pub fn ollama_stream(data: &[u8]) {
    // As the NDJSON splitter hands them out: blank lines are skipped.
    let items: Vec<&[u8]> = data
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    check_items(&mut node_bin::calls::ollama::ChatStream::new(), &items);
}

/// `openai_stream`: byte 0 bit 0 marks a text tool-call fallback run; the
/// rest's blank-line-separated blocks are OpenAI SSE `data` items. Bit 1
/// parses the rest as one non-streamed JSON body instead.
pub fn openai_stream(data: &[u8]) {
    let (control, rest) = control(data);
    let mut parser = node_bin::calls::openai::ChatStream::new(control & 1 != 0);
    if control & 2 != 0 {
        let outputs = parser.on_json_body(rest);
        assert!(outputs.iter().filter(|o| is_terminal(o)).count() <= 1);
        return;
    }
    let mut items = Vec::new();
    let mut start = 0;
    for i in 0..rest.len() {
        if rest[i..].starts_with(b"\n\n") && i >= start {
            items.push(&rest[start..i]);
            start = i + 2;
        }
    }
    items.push(&rest[start.min(rest.len())..]);
    check_items(&mut parser, &items);
}

// ---------------------------------------------------------------------------
// Configuration files

/// `edge_config`: the input as edge.toml text.
pub fn edge_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = edge_bin::config::EdgeConfig::parse(text, "conf/edge.toml") {
        assert!(e.to_string().starts_with("conf/edge.toml: "), "{e}");
    }
}

/// `node_config`: the input as node.toml text.
pub fn node_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = node_bin::config::NodeConfig::parse(text, "conf/node.toml") {
        assert!(e.to_string().starts_with("conf/node.toml: "), "{e}");
    }
}
