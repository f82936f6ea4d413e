//! Token usage observed in a tunnel's raw body (U1: observation only; the
//! bytes are relayed untouched whatever this finds).
//!
//! ```text
//! body piece ─► memmem `"usage"` (SIMD scan, no copy; a key split between
//!               pieces is caught by the few bytes carried over)
//!           ─► the object after `"usage":` collected to its closing brace
//!               (bounded) ─► prompt/completion counts, the last seen winning
//! end       ─► one Usage observation before END
//! ```
//!
//! It reads every usage shape an OpenAI-compatible server streams or
//! answers: chat completions (`prompt_tokens`, `completion_tokens`,
//! `total_tokens`, the last chunk with `stream_options.include_usage`),
//! Responses (`input_tokens`, `output_tokens` in `response.completed`) and
//! Anthropic Messages (`input_tokens` in `message_start`, the final
//! `output_tokens` in `message_delta`), embeddings and score
//! (`prompt_tokens`, `total_tokens`) and rerank (`total_tokens` alone,
//! counted as prompt tokens). A `"usage"` inside a string value
//! has its quotes escaped, so it never matches `"usage"` followed by `:`.
//!
//! # The usage chunk the client did not ask for
//!
//! When the Edge asked the provider for usage on a client's behalf
//! (`ProviderTunnelRequest.strip_usage_chunk`), [`UsageChunkStrip`] leaves
//! the usage-only event out of the relayed stream — after the watcher saw
//! it — and nothing else:
//!
//! ```text
//! piece ─► memchr2 CR/LF: event ends (blank line), bytes in between skipped
//!       ─► an event within the piece where the watcher found no usage object:
//!            relayed, not looked at (one scan of each token's bytes)
//!       ─► each other event: does it start `data:` with `"choices":[]`?
//!            no  ─► relayed (slices of the piece, no copy, no wait)
//!            yes ─► complete: parsed; `choices` empty and `usage` an
//!                   object ─► dropped, else relayed
//!                   unfinished at the piece's end: held (≤ HOLD_MAX_BYTES)
//!                   until it ends or shows `"choices":[{`
//! ```
//!
//! Only the tail of a piece that may be the usage event waits for the next
//! read; every other event, complete or split, goes on at once.

use std::sync::LazyLock;

use bytes::Bytes;
use iop_wire::pb;
use memchr::memmem;

const KEY: &[u8] = b"\"usage\"";
const CHOICES: &[u8] = b"\"choices\"";

// The searchers are built once: `memmem::find` builds one on every call,
// which cost more than scanning a token's chunk (some 800 instructions per
// relayed token in callgrind).
static KEY_FINDER: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(KEY));
static CHOICES_FINDER: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(CHOICES));
/// Longest usage object collected (real ones are well under 1 KiB).
const MAX_OBJECT_BYTES: usize = 4096;

/// Watches one tunnel body for usage objects.
#[derive(Debug, Default)]
pub struct UsageWatcher {
    /// The last bytes of the previous piece (a key may straddle pieces).
    carry: Vec<u8>,
    /// A usage value being collected: bytes from its first `{`.
    object: Option<Vec<u8>>,
    /// Where the scan of that object stands.
    scan: ObjectScan,
    /// Just after a key: waiting for `:` and the value's first byte.
    after_key: bool,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    total_tokens: Option<u64>,
}

impl UsageWatcher {
    /// A watcher for a body of `content_type`: JSON and event streams carry
    /// usage; anything else is not watched (`None`).
    pub fn for_content_type(content_type: &[u8]) -> Option<Self> {
        let watched = [
            &b"text/event-stream"[..],
            b"application/json",
            b"application/x-ndjson",
        ]
        .iter()
        .any(|kind| {
            content_type
                .get(..kind.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(kind))
        });
        watched.then(Self::default)
    }

    /// Looks at the next body piece. Returns where, in it, the search for
    /// keys ran to its end and found none with an object value: no usage
    /// object starts at or after that offset (the piece's length when it
    /// ends inside a value). The usage-chunk filter takes it
    /// ([`UsageChunkStrip::feed`]), so that one scan of the bytes serves
    /// both.
    pub fn feed(&mut self, piece: &[u8]) -> usize {
        let mut at = 0;
        // Finish what the previous piece started.
        if self.object.is_some() || self.after_key {
            at = self.continue_value(piece, 0);
        } else if self.carry.contains(&b'"') {
            // A key split between the pieces: carry ++ head of this piece.
            // Only a carry with a quote can hold a key's start (the key
            // begins with one): most pieces end an event, `}` and a blank
            // line, and skip this search.
            // On the stack, no allocation per piece: `carry` keeps fewer
            // than `KEY.len()` bytes.
            let head = &piece[..piece.len().min(KEY.len())];
            let carry = &self.carry[self.carry.len().saturating_sub(KEY.len() - 1)..];
            let carried = carry.len();
            let mut buf = [0u8; 2 * KEY.len()];
            buf[..carried].copy_from_slice(carry);
            buf[carried..carried + head.len()].copy_from_slice(head);
            let joined = &buf[..carried + head.len()];
            if let Some(pos) = KEY_FINDER.find(joined) {
                let end = pos + KEY.len();
                if end > carried && !escaped(&joined[..pos]) {
                    self.after_key = true;
                    at = self.continue_value(piece, end - carried);
                }
            }
        }
        // Every key at or after this is found below.
        let mut key_free_from = at;
        while at < piece.len() && self.object.is_none() && !self.after_key {
            let Some(pos) = KEY_FINDER.find(&piece[at..]) else {
                break;
            };
            let key_at = at + pos;
            at = key_at + KEY.len();
            if escaped(&piece[..key_at]) {
                continue;
            }
            // A key whose value is not an object (`"usage":null` in every
            // chunk of a stream that asked for usage) makes no event the
            // usage chunk: the piece stays free past it.
            let object = piece[at..]
                .iter()
                .find(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n' | b':'))
                .is_none_or(|&b| b == b'{');
            self.after_key = true;
            at = self.continue_value(piece, at);
            if object {
                key_free_from = at;
            }
        }
        if self.object.is_some() || self.after_key {
            // Inside a value at the piece's end: nothing after it searched.
            key_free_from = piece.len();
        }
        if self.object.is_none() && !self.after_key {
            // The last bytes seen (of this piece and, when it is short, of
            // the ones before).
            let keep = KEY.len() - 1;
            if piece.len() >= keep {
                self.carry.clear();
                self.carry.extend_from_slice(&piece[piece.len() - keep..]);
            } else {
                self.carry.extend_from_slice(piece);
                let excess = self.carry.len().saturating_sub(keep);
                self.carry.drain(..excess);
            }
        } else {
            self.carry.clear();
        }
        key_free_from
    }

    /// What was observed, if anything. A usage object with a total alone
    /// (rerank's, as vLLM and the Jina/Cohere shape report it: the tokens
    /// of the query and documents read) counts the total as prompt tokens.
    pub fn finish(self) -> Option<pb::Usage> {
        if self.prompt_tokens.is_none() && self.completion_tokens.is_none() {
            return self.total_tokens.map(|total| pb::Usage {
                prompt_tokens: total,
                completion_tokens: 0,
                total_tokens: total,
            });
        }
        let prompt_tokens = self.prompt_tokens.unwrap_or(0);
        let completion_tokens = self.completion_tokens.unwrap_or(0);
        Some(pb::Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: self
                .total_tokens
                .unwrap_or(prompt_tokens.saturating_add(completion_tokens)),
        })
    }

    /// Continues a value at `piece[at..]`; returns where scanning resumes.
    fn continue_value(&mut self, piece: &[u8], mut at: usize) -> usize {
        if self.after_key {
            // Skip whitespace and the colon; the value must be an object.
            while at < piece.len() {
                match piece[at] {
                    b' ' | b'\t' | b'\r' | b'\n' | b':' => at += 1,
                    b'{' => {
                        self.after_key = false;
                        self.object = Some(Vec::new());
                        self.scan = ObjectScan::default();
                        break;
                    }
                    _ => {
                        // `null`, or not a key after all.
                        self.after_key = false;
                        return at;
                    }
                }
            }
            if self.after_key {
                return at;
            }
        }
        let Some(object) = self.object.as_mut() else {
            return at;
        };
        let start = at;
        let end = piece[start..]
            .iter()
            .position(|&b| self.scan.step(b))
            .map(|i| start + i + 1);
        let take_to = end.unwrap_or(piece.len());
        object.extend_from_slice(&piece[start..take_to]);
        if object.len() > MAX_OBJECT_BYTES {
            self.object = None;
            return take_to;
        }
        if end.is_some() {
            if let Some(object) = self.object.take() {
                self.absorb(&object);
            }
        }
        take_to
    }

    fn absorb(&mut self, object: &[u8]) {
        let Ok(serde_json::Value::Object(usage)) = serde_json::from_slice(object) else {
            return;
        };
        let count = |names: &[&str]| names.iter().find_map(|n| usage.get(*n)?.as_u64());
        if let Some(n) = count(&["prompt_tokens", "input_tokens"]) {
            self.prompt_tokens = Some(n);
        }
        if let Some(n) = count(&["completion_tokens", "output_tokens"]) {
            self.completion_tokens = Some(n);
        }
        if let Some(n) = count(&["total_tokens"]) {
            self.total_tokens = Some(n);
        }
    }
}

/// Whether a quote right after `before` is escaped (an odd run of
/// backslashes ends `before`).
fn escaped(before: &[u8]) -> bool {
    before.iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

/// Brace depth and string state while an object's bytes go by.
#[derive(Debug, Default, Clone, Copy)]
struct ObjectScan {
    depth: u32,
    in_string: bool,
    escape: bool,
}

impl ObjectScan {
    /// Takes the next byte; true when it closes the object.
    fn step(&mut self, b: u8) -> bool {
        if self.in_string {
            match (self.escape, b) {
                (true, _) => self.escape = false,
                (false, b'\\') => self.escape = true,
                (false, b'"') => self.in_string = false,
                _ => {}
            }
            return false;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' => self.depth += 1,
            b'}' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

/// Most bytes of one event held while it may still be the usage-only
/// chunk (real ones are a few hundred bytes). An event that is still
/// undecided past this is relayed as it is, unchecked (counted).
pub const HOLD_MAX_BYTES: usize = 8 * 1024;

/// Leaves the usage-only event (`data: {…,"choices":[],"usage":{…}}`) out
/// of a `text/event-stream` chat completion; every other byte goes on as
/// the provider sent it, in order. Events end at a blank line; lines end
/// at CRLF, LF or CR, in any cut of the stream into pieces.
#[derive(Debug)]
pub struct UsageChunkStrip {
    event: EventState,
    /// No byte of the current line yet: a line end now ends the event.
    line_empty: bool,
    /// The last byte was a CR (an LF next is the same line end).
    after_cr: bool,
    /// The bytes of an undecided event begun in an earlier piece.
    held: Vec<u8>,
    /// The event just dropped ended with a CR: the LF of its CRLF goes too.
    lf_of_dropped: bool,
    /// From here to the end of the piece being fed there is no usage
    /// object (what [`UsageWatcher::feed`] found).
    key_free_from: usize,
    counts: StripCounts,
}

/// What [`UsageChunkStrip`] did since it was last asked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StripCounts {
    /// Usage-only events left out.
    pub stripped: u64,
    /// Events relayed unchecked: undecided past [`HOLD_MAX_BYTES`].
    pub unchecked: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventState {
    /// Between two events: no byte of the next one yet.
    Between,
    /// The event may be the usage chunk: decided when it ends.
    Undecided,
    /// Not the usage chunk (or too long to tell): relayed as it comes.
    Passing,
}

/// What the start of an event says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// It is not a usage-only event.
    NotUsage,
    /// It may be one.
    Maybe,
}

impl Default for UsageChunkStrip {
    fn default() -> Self {
        Self::new()
    }
}

impl UsageChunkStrip {
    /// A filter at the start of a stream.
    pub fn new() -> Self {
        Self {
            event: EventState::Between,
            line_empty: true,
            after_cr: false,
            held: Vec::new(),
            lf_of_dropped: false,
            key_free_from: 0,
            counts: StripCounts::default(),
        }
    }

    /// Takes the next body piece; pushes what is relayed of it (and of
    /// what was held) to `out`, in order: slices of `piece`, or the held
    /// bytes once their event is decided. `key_free_from` is what
    /// [`UsageWatcher::feed`] returned for the piece (`piece.len()` when
    /// nothing is known): an event that begins and ends in the piece at or
    /// after it has no usage object, so it is relayed without a look at its
    /// `choices` (every token of a stream, in practice).
    pub fn feed(&mut self, piece: &Bytes, key_free_from: usize, out: &mut Vec<Bytes>) {
        if self.takes_whole(piece, key_free_from) {
            // Every event of it goes on: no line of it is looked at. It
            // ended at a blank line, so no CR is pending, as the scan
            // would leave it.
            self.after_cr = false;
            out.push(piece.clone());
            return;
        }
        self.key_free_from = key_free_from;
        let bytes = &piece[..];
        let mut pos = 0;
        // `piece[pass_from..]` is neither relayed nor dropped yet.
        let mut pass_from = 0;
        // Where the undecided event's bytes in this piece begin.
        let mut event_from = 0;
        while pos < bytes.len() {
            if self.event == EventState::Between {
                if self.after_cr && bytes[pos] == b'\n' {
                    // The LF of the CRLF that ended the last event.
                    self.after_cr = false;
                    if std::mem::take(&mut self.lf_of_dropped) {
                        relay(piece, pass_from, pos, out);
                        pass_from = pos + 1;
                    }
                    pos += 1;
                    continue;
                }
                self.lf_of_dropped = false;
                self.event = EventState::Undecided;
                event_from = pos;
            }
            let Some(found) = memchr::memchr2(b'\n', b'\r', &bytes[pos..]) else {
                // The rest of the piece is within one line.
                self.line_empty = false;
                self.after_cr = false;
                break;
            };
            if found > 0 {
                self.line_empty = false;
                self.after_cr = false;
            }
            let at = pos + found;
            pos = at + 1;
            if bytes[at] == b'\n' && self.after_cr {
                self.after_cr = false;
                continue;
            }
            self.after_cr = bytes[at] == b'\r';
            if !self.line_empty {
                self.line_empty = true;
                continue;
            }
            // A blank line: the event ends with it.
            if self.event == EventState::Undecided {
                self.end_event(piece, event_from, pos, &mut pass_from, out);
            }
            self.event = EventState::Between;
        }
        if self.event == EventState::Undecided {
            self.hold_or_pass(piece, event_from, &mut pass_from, out);
        }
        relay(piece, pass_from, bytes.len(), out);
    }

    /// Whether `piece` goes on whole, as every token of a stream does: it
    /// starts between events (nothing held, no dropped event's LF to take)
    /// and holds no usage object (`key_free_from` 0), so none of its events
    /// is the usage chunk; and it ends with a blank line (`\n\n` or
    /// `\r\n\r\n`), so it leaves the filter between events again, with no
    /// CR pending. Anything else is scanned line by line.
    fn takes_whole(&self, piece: &[u8], key_free_from: usize) -> bool {
        key_free_from == 0
            && self.event == EventState::Between
            && self.held.is_empty()
            && !self.lf_of_dropped
            && (piece.ends_with(b"\n\n") || piece.ends_with(b"\r\n\r\n"))
    }

    /// The bytes still held at the end of the body (an event it ended
    /// in), to relay as they are; or after a failure, before it.
    pub fn take_held(&mut self) -> Option<Bytes> {
        self.event = EventState::Passing;
        (!self.held.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.held)))
    }

    /// What was stripped and passed unchecked since the last call.
    pub fn take_counts(&mut self) -> StripCounts {
        std::mem::take(&mut self.counts)
    }

    /// The undecided event that began at `piece[event_from..]` (after the
    /// held bytes, if any) ended at `piece[..end]`.
    fn end_event(
        &mut self,
        piece: &Bytes,
        event_from: usize,
        end: usize,
        pass_from: &mut usize,
        out: &mut Vec<Bytes>,
    ) {
        let part = &piece[event_from..end];
        let drop = if self.held.is_empty() {
            // Begun in this piece; with no usage object in it, not the
            // usage chunk.
            event_from < self.key_free_from && self.judge(part, true)
        } else {
            // Begun in an earlier piece: nothing of this one went out yet.
            let took = self.extend_held(part);
            let drop = self.judge_held(took == part.len());
            if !drop {
                out.push(Bytes::from(std::mem::take(&mut self.held)));
                *pass_from = took;
            }
            drop
        };
        if drop {
            relay(piece, *pass_from, event_from, out);
            self.held.clear();
            *pass_from = end;
            self.counts.stripped += 1;
            self.lf_of_dropped = piece[end - 1] == b'\r';
        }
    }

    /// The piece ends inside an undecided event begun at
    /// `piece[event_from..]`: hold it while it may be the usage chunk.
    fn hold_or_pass(
        &mut self,
        piece: &Bytes,
        event_from: usize,
        pass_from: &mut usize,
        out: &mut Vec<Bytes>,
    ) {
        let part = &piece[event_from..];
        if self.held.is_empty() {
            match start_of(part) {
                Start::Maybe if part.len() <= HOLD_MAX_BYTES => {
                    relay(piece, *pass_from, event_from, out);
                    self.held.extend_from_slice(part);
                    *pass_from = piece.len();
                }
                start => {
                    if start == Start::Maybe {
                        self.counts.unchecked += 1;
                    }
                    self.event = EventState::Passing;
                }
            }
            return;
        }
        let took = self.extend_held(part);
        let start = start_of(&self.held);
        if start == Start::Maybe && took == part.len() {
            *pass_from = piece.len();
            return;
        }
        if start == Start::Maybe {
            self.counts.unchecked += 1;
        }
        self.event = EventState::Passing;
        out.push(Bytes::from(std::mem::take(&mut self.held)));
        *pass_from = took;
    }

    /// Appends what fits of `part` under [`HOLD_MAX_BYTES`]; how much.
    fn extend_held(&mut self, part: &[u8]) -> usize {
        let took = part
            .len()
            .min(HOLD_MAX_BYTES.saturating_sub(self.held.len()));
        self.held.extend_from_slice(&part[..took]);
        took
    }

    /// Whether the ended event in `held` is the usage chunk; `whole` says
    /// the held bytes are all of it (else it outgrew the hold).
    fn judge_held(&mut self, whole: bool) -> bool {
        let held = std::mem::take(&mut self.held);
        let drop = self.judge(&held, whole);
        self.held = held;
        drop
    }

    /// Whether `event` (all of it when `whole`) is the usage chunk.
    fn judge(&mut self, event: &[u8], whole: bool) -> bool {
        match start_of(event) {
            Start::NotUsage => false,
            Start::Maybe if !whole || event.len() > HOLD_MAX_BYTES => {
                self.counts.unchecked += 1;
                false
            }
            Start::Maybe => is_usage_only(event),
        }
    }
}

fn relay(piece: &Bytes, from: usize, to: usize, out: &mut Vec<Bytes>) {
    if to > from {
        out.push(piece.slice(from..to));
    }
}

/// What the first bytes of an event say: a usage-only event has only
/// `data:` lines and its top-level `choices` is `[]`. The first
/// `"choices"` key decides (a chat chunk has no other object before it);
/// a wrong guess only ever keeps an event, never drops one (the complete
/// event is parsed before it is dropped).
fn start_of(event: &[u8]) -> Start {
    const DATA: &[u8] = b"data:";
    let n = event.len().min(DATA.len());
    if event[..n] != DATA[..n] {
        return Start::NotUsage;
    }
    // The first byte at or after `i` that is not JSON whitespace.
    let next = |i: usize| {
        event
            .get(i..)
            .and_then(|rest| {
                rest.iter()
                    .position(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
            })
            .map(|skip| i + skip)
    };
    for at in CHOICES_FINDER.find_iter(event) {
        let Some(colon) = next(at + CHOICES.len()) else {
            return Start::Maybe;
        };
        if event[colon] != b':' {
            // A string value, not the key.
            continue;
        }
        let Some(open) = next(colon + 1) else {
            return Start::Maybe;
        };
        if event[open] != b'[' {
            return Start::NotUsage;
        }
        return match next(open + 1).map(|close| event[close]) {
            None | Some(b']') => Start::Maybe,
            Some(_) => Start::NotUsage,
        };
    }
    Start::Maybe
}

/// Whether a complete event (its blank line included) is a usage-only
/// chunk: every line a `data:` field, and the data a JSON object whose
/// `choices` is `[]` and whose `usage` is an object.
fn is_usage_only(event: &[u8]) -> bool {
    let mut data = Vec::with_capacity(event.len());
    for (i, line) in event
        .split(|&b| b == b'\n' || b == b'\r')
        .filter(|line| !line.is_empty())
        .enumerate()
    {
        let Some(value) = line.strip_prefix(b"data:") else {
            return false;
        };
        if i > 0 {
            data.push(b'\n');
        }
        data.extend_from_slice(value.strip_prefix(b" ").unwrap_or(value));
    }
    // Only the two members are looked at, borrowed: building the whole
    // chunk as a `Value` cost some 13,000 instructions per stream.
    #[derive(serde::Deserialize)]
    struct Members<'a> {
        #[serde(borrow)]
        choices: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow)]
        usage: Option<&'a serde_json::value::RawValue>,
    }
    // A struct also deserializes from an array: only an object qualifies.
    if data.trim_ascii_start().first() != Some(&b'{') {
        return false;
    }
    let Ok(Members {
        choices: Some(choices),
        usage: Some(usage),
    }) = serde_json::from_slice(&data)
    else {
        return false;
    };
    serde_json::from_str::<Vec<serde::de::IgnoredAny>>(choices.get()).is_ok_and(|c| c.is_empty())
        && usage.get().starts_with('{')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(prompt: u64, completion: u64, total: u64) -> Option<pb::Usage> {
        Some(pb::Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: total,
        })
    }

    /// `body` fed whole, and cut at every position: the same answer.
    fn observed(content_type: &str, body: &str) -> Option<pb::Usage> {
        let watcher = || UsageWatcher::for_content_type(content_type.as_bytes()).expect("watched");
        let whole = {
            let mut w = watcher();
            w.feed(body.as_bytes());
            w.finish()
        };
        for cut in 0..=body.len() {
            let mut w = watcher();
            w.feed(&body.as_bytes()[..cut]);
            w.feed(&body.as_bytes()[cut..]);
            assert_eq!(w.finish(), whole, "cut at {cut}");
        }
        // One byte at a time.
        let mut w = watcher();
        for b in body.as_bytes() {
            w.feed(std::slice::from_ref(b));
        }
        assert_eq!(w.finish(), whole, "byte by byte");
        whole
    }

    #[test]
    fn the_watcher_says_where_a_piece_holds_no_more_usage_keys() {
        const CONTENT: &str =
            "data: {\"choices\":[{\"delta\":{\"content\":\"say \\\"usage\\\"\"}}]}\n\n";
        const USAGE: &str =
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n";
        let mut w = UsageWatcher::default();
        // No key (the one in the content is escaped): all of it is free.
        assert_eq!(w.feed(CONTENT.as_bytes()), 0);
        // Nor is a key with a null value.
        let null = "data: {\"choices\":[{\"delta\":{}}],\"usage\" : null}\n\n";
        assert_eq!(w.feed(null.as_bytes()), 0);
        // A usage object: free after its closing brace.
        let piece = format!("{CONTENT}{USAGE}{CONTENT}");
        let object_end = CONTENT.len() + USAGE.rfind('}').unwrap();
        assert_eq!(w.feed(piece.as_bytes()), object_end);
        // A piece that ends inside the object: nothing of it is free; the
        // next is free after the object's end.
        let cut = CONTENT.len() + USAGE.find("prompt").unwrap();
        assert_eq!(w.feed(&piece.as_bytes()[..cut]), cut);
        assert_eq!(w.feed(&piece.as_bytes()[cut..]), object_end - cut);
        // A key split between pieces: the first holds no whole key (no
        // event that ends in it can hold one), the second is free after
        // the key's value.
        let cut = CONTENT.len() + USAGE.find("sage").unwrap();
        assert_eq!(w.feed(&piece.as_bytes()[..cut]), 0);
        assert_eq!(w.feed(&piece.as_bytes()[cut..]), object_end - cut);
        assert_eq!(w.finish(), usage(1, 2, 3));
    }

    #[test]
    fn a_streamed_chat_completion_reports_its_last_usage_chunk() {
        let body = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
                    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":5,\"total_tokens\":17}}\n\n\
                    data: [DONE]\n\n";
        assert_eq!(observed("text/event-stream", body), usage(12, 5, 17));
    }

    #[test]
    fn a_plain_json_completion_and_the_responses_shape() {
        let chat = r#"{"id":"x","choices":[{"message":{"content":"a \"usage\": {\"prompt_tokens\": 99}"}}],"usage": {"prompt_tokens":3,"completion_tokens":4,"total_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        assert_eq!(observed("application/json", chat), usage(3, 4, 7));
        let responses = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":8,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":2,\"total_tokens\":10}}}\n\n";
        assert_eq!(observed("text/event-stream", responses), usage(8, 2, 10));
    }

    #[test]
    fn embeddings_and_rerank_report_what_they_read() {
        let embeddings = r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}],"model":"m","usage":{"prompt_tokens":6,"total_tokens":6}}"#;
        assert_eq!(observed("application/json", embeddings), usage(6, 0, 6));
        let rerank = r#"{"id":"rerank-1","model":"m","results":[{"index":0,"relevance_score":0.5}],"usage":{"total_tokens":9}}"#;
        assert_eq!(observed("application/json", rerank), usage(9, 0, 9));
    }

    #[test]
    fn anthropic_messages_take_input_from_the_start_and_output_from_the_last_delta() {
        let body = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                    event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"usage\"}}\n\n\
                    event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n";
        assert_eq!(observed("text/event-stream", body), usage(25, 15, 40));
    }

    // Counts near u64::MAX from the wire: a total the provider left out
    // saturates instead of wrapping (or panicking in a debug build).
    #[test]
    fn a_missing_total_saturates() {
        let max = u64::MAX;
        let body = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{max},\"completion_tokens\":2}}}}\n\n"
        );
        assert_eq!(observed("text/event-stream", &body), usage(max, 2, max));
        let body = format!(
            "{{\"usage\":{{\"input_tokens\":{},\"output_tokens\":{max}}}}}",
            max - 1
        );
        assert_eq!(
            observed("application/json", &body),
            usage(max - 1, max, max)
        );
    }

    #[test]
    fn nothing_is_observed_without_a_usage_object() {
        assert_eq!(
            observed(
                "text/event-stream",
                "data: {\"usage\":null}\n\ndata: [DONE]\n\n"
            ),
            None
        );
        assert_eq!(observed("application/json", "{\"usage\":\"many\"}"), None);
        assert!(UsageWatcher::for_content_type(b"text/plain").is_none());
        // An object past the bound is given up, not grown.
        let huge = format!(
            "{{\"usage\":{{\"pad\":\"{}\"}}}}",
            "x".repeat(MAX_OBJECT_BYTES)
        );
        assert_eq!(observed("application/json", &huge), None);
    }
}

#[cfg(test)]
mod strip_tests {
    use super::*;

    /// A chat completion stream as vLLM and OpenAI send it with
    /// `include_usage`: `"usage":null` on every chunk, then the usage-only
    /// chunk, then `[DONE]`.
    const CONTENT: &str = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n\
        data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi \\\"there\\\"\"}}],\"usage\":null}\n\n\
        : keep-alive comment\n\n\
        data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n";
    const USAGE: &str = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15,\"prompt_tokens_details\":null}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn stream() -> String {
        format!("{CONTENT}{USAGE}{DONE}")
    }

    fn crlf(text: &str) -> String {
        text.replace('\n', "\r\n")
    }

    /// Feeds `pieces` in order; what was relayed after each, and the
    /// counts. Run twice, with what a watcher found of each piece and with
    /// nothing known: the same bytes go out, and the same counts.
    fn run(pieces: &[&[u8]]) -> (Vec<Vec<u8>>, StripCounts) {
        let with_watcher = run_strip(pieces, true);
        let alone = run_strip(pieces, false);
        assert_eq!(with_watcher, alone, "the watcher's hint changed the result");
        with_watcher
    }

    fn run_strip(pieces: &[&[u8]], watched: bool) -> (Vec<Vec<u8>>, StripCounts) {
        let mut watcher = UsageWatcher::default();
        let mut strip = UsageChunkStrip::new();
        let mut after_each = Vec::new();
        let mut out = Vec::new();
        let mut counts = StripCounts::default();
        for piece in pieces {
            let key_free_from = if watched {
                watcher.feed(piece)
            } else {
                piece.len()
            };
            strip.feed(&Bytes::copy_from_slice(piece), key_free_from, &mut out);
            assert!(strip.held.len() <= HOLD_MAX_BYTES, "held past the cap");
            let relayed: Vec<u8> = out.drain(..).flat_map(|b| b.to_vec()).collect();
            after_each.push(relayed);
            let c = strip.take_counts();
            counts.stripped += c.stripped;
            counts.unchecked += c.unchecked;
        }
        if let Some(held) = strip.take_held() {
            after_each.push(held.to_vec());
        }
        (after_each, counts)
    }

    fn joined(after_each: &[Vec<u8>]) -> Vec<u8> {
        after_each.concat()
    }

    /// Where the last event that ends at or before `cut` ends.
    fn complete_before(text: &str, cut: usize, blank: &str) -> usize {
        text[..cut].rfind(blank).map_or(0, |at| at + blank.len())
    }

    #[test]
    fn every_cut_of_a_stream_relays_all_but_the_usage_event_and_delays_no_complete_event() {
        for (text, usage, blank) in [
            (stream(), USAGE.to_string(), "\n\n"),
            (crlf(&stream()), crlf(USAGE), "\r\n\r\n"),
        ] {
            let expected = text.replace(&usage, "");
            let usage_at = text.find(&usage).unwrap();
            let whole = run(&[text.as_bytes()]);
            assert_eq!(joined(&whole.0), expected.as_bytes());
            assert_eq!(
                whole.1,
                StripCounts {
                    stripped: 1,
                    unchecked: 0
                }
            );
            for cut in 0..=text.len() {
                let (first, rest) = text.as_bytes().split_at(cut);
                let (after, counts) = run(&[first, rest]);
                assert_eq!(joined(&after), expected.as_bytes(), "cut at {cut}");
                assert_eq!(
                    counts,
                    StripCounts {
                        stripped: 1,
                        unchecked: 0
                    },
                    "cut at {cut}"
                );
                // Every event complete in the first read went out with it.
                let done = complete_before(&text, cut, blank);
                let min = if done > usage_at {
                    done - usage.len()
                } else {
                    done
                };
                assert!(
                    after[0].len() >= min && expected.as_bytes().starts_with(&after[0]),
                    "cut at {cut}: {} bytes relayed, {min} complete",
                    after[0].len()
                );
                // Outside the usage event, a split event is not held once
                // its non-empty `choices` shows.
                if cut < usage_at {
                    let event_start = complete_before(&text, cut, blank);
                    let event = &text[event_start..cut];
                    if event.contains("\"choices\":[{") || event.starts_with(':') {
                        assert_eq!(after[0].len(), cut, "cut at {cut}");
                    }
                }
            }
            // One byte at a time.
            let bytes: Vec<&[u8]> = text.as_bytes().chunks(1).collect();
            let (after, counts) = run(&bytes);
            assert_eq!(joined(&after), expected.as_bytes());
            assert_eq!(counts.stripped, 1);
        }
    }

    #[test]
    fn a_usage_event_split_across_three_reads_is_held_then_dropped() {
        let text = stream();
        let usage_at = text.find(USAGE).unwrap();
        // Read 1 ends before its `choices`, read 2 inside its usage object,
        // read 3 carries its end and `[DONE]`.
        let cut1 = usage_at + USAGE.find("\"model\"").unwrap();
        let cut2 = usage_at + USAGE.find("\"completion_tokens\"").unwrap();
        let b = text.as_bytes();
        let (after, counts) = run(&[&b[..cut1], &b[cut1..cut2], &b[cut2..]]);
        assert_eq!(after.len(), 3, "nothing held at the end");
        assert_eq!(after[0], CONTENT.as_bytes());
        assert_eq!(after[1], b"");
        assert_eq!(after[2], DONE.as_bytes());
        assert_eq!(
            counts,
            StripCounts {
                stripped: 1,
                unchecked: 0
            }
        );
    }

    #[test]
    fn a_stripped_event_ending_in_cr_takes_the_lf_of_the_next_read() {
        let text = crlf(&stream());
        let usage = crlf(USAGE);
        let end = text.find(&usage).unwrap() + usage.len();
        // The read ends between the CR and LF of the usage event's blank line.
        let b = text.as_bytes();
        let (after, _) = run(&[&b[..end - 1], &b[end - 1..]]);
        assert_eq!(joined(&after), text.replace(&usage, "").as_bytes());
        assert_eq!(after[1], crlf(DONE).as_bytes());
        // Bare CR line ends too.
        let cr = stream().replace('\n', "\r");
        let (after, counts) = run(&[cr.as_bytes()]);
        assert_eq!(
            joined(&after),
            cr.replace(&USAGE.replace('\n', "\r"), "").as_bytes()
        );
        assert_eq!(counts.stripped, 1);
    }

    #[test]
    fn only_a_data_event_with_empty_choices_and_a_usage_object_is_dropped() {
        let kept = [
            // Azure's prompt-filter chunk: empty choices, no usage.
            "data: {\"choices\":[],\"prompt_filter_results\":[]}\n\n",
            // Empty choices, usage null.
            "data: {\"choices\":[],\"usage\":null}\n\n",
            // Usage on a chunk with a choice.
            "data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"prompt_tokens\":1}}\n\n",
            // Another field line in the event.
            "event: usage\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n",
            // Not JSON.
            "data: {\"choices\":[],\"usage\":{\n\n",
            "data: [DONE]\n\n",
        ];
        for event in kept {
            let (after, counts) = run(&[event.as_bytes()]);
            assert_eq!(joined(&after), event.as_bytes(), "{event:?}");
            assert_eq!(counts, StripCounts::default(), "{event:?}");
        }
        // Whitespace around the key and a second data line are still JSON.
        let spaced = "data: { \"choices\" : [ ] ,\ndata: \"usage\": {\"prompt_tokens\": 1} }\n\n";
        let (after, counts) = run(&[spaced.as_bytes()]);
        assert_eq!(joined(&after), b"");
        assert_eq!(counts.stripped, 1);
    }

    #[test]
    fn an_event_the_body_ends_in_is_relayed_as_it_is() {
        let unfinished = &USAGE[..USAGE.len() - 2];
        let text = format!("{CONTENT}{unfinished}");
        let (after, counts) = run(&[text.as_bytes()]);
        assert_eq!(
            after,
            vec![CONTENT.as_bytes().to_vec(), unfinished.as_bytes().to_vec()]
        );
        assert_eq!(counts, StripCounts::default());
    }

    /// One event of a generated stream, and whether it is a usage event.
    fn event(kind: u8, text: &str, line_end: &str) -> (String, bool) {
        let text = serde_json::to_string(text).unwrap();
        let (body, usage) = match kind % 6 {
            0 => (format!("data: {{\"id\":{text},\"choices\":[],\"usage\":{{\"prompt_tokens\":1}}}}"), true),
            1 => (format!("data: {{\"choices\":[],\"note\":{text}}}"), false),
            2 => (format!(": {}", text.replace(['\r', '\n'], " ")), false),
            3 => ("data: [DONE]".to_string(), false),
            4 => (format!("event: x\ndata: {{\"choices\":[],\"usage\":{{}},\"t\":{text}}}"), false),
            _ => (format!("data: {{\"model\":{text},\"choices\":[{{\"delta\":{{\"content\":{text}}}}}],\"usage\":null}}"), false),
        };
        let body = body.replace('\n', line_end);
        (format!("{body}{line_end}{line_end}"), usage)
    }

    proptest::proptest! {
        #[test]
        fn any_stream_cut_anywhere_loses_exactly_its_usage_events(
            events in proptest::collection::vec(
                (0u8..6, "[a-z \"\\\\{}\\[\\]:,]{0,40}", 0usize..3),
                0..12,
            ),
            cuts in proptest::collection::vec(0usize..4000, 0..8),
        ) {
            let mut text = String::new();
            let mut expected = String::new();
            let mut usage_events = 0;
            for (kind, body, end) in &events {
                let (event, usage) = event(*kind, body, ["\n", "\r\n", "\r"][*end]);
                text.push_str(&event);
                if usage {
                    usage_events += 1;
                } else {
                    expected.push_str(&event);
                }
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut at = 0;
            for cut in cuts.into_iter().chain([text.len()]) {
                pieces.push(&text.as_bytes()[at..cut]);
                at = cut;
            }
            let (after, counts) = run(&pieces);
            proptest::prop_assert_eq!(joined(&after), expected.as_bytes());
            proptest::prop_assert_eq!(counts, StripCounts { stripped: usage_events, unchecked: 0 });
        }
    }

    #[test]
    fn a_tokens_piece_goes_on_whole_and_the_usage_event_after_it_is_still_dropped() {
        let token = Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\r\n\r\n",
        );
        let usage = Bytes::from_static(USAGE.as_bytes());
        let mut watcher = UsageWatcher::default();
        let mut strip = UsageChunkStrip::new();
        let mut out = Vec::new();
        for _ in 0..2 {
            strip.feed(&token, watcher.feed(&token), &mut out);
            assert_eq!(out.len(), 1);
            assert_eq!(out[0], token);
            assert_eq!(
                out[0].as_ptr(),
                token.as_ptr(),
                "the piece itself, not a copy"
            );
            out.clear();
        }
        strip.feed(&usage, watcher.feed(&usage), &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(strip.take_counts().stripped, 1);
        assert_eq!(watcher.finish().map(|u| u.total_tokens), Some(15));
    }

    #[test]
    fn an_undecided_event_past_the_cap_is_relayed_unchecked_and_stripping_goes_on() {
        // `choices` comes only after a long field: undecided until then.
        let long = format!(
            "data: {{\"pad\":\"{}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":1}}}}\n\n",
            "x".repeat(HOLD_MAX_BYTES)
        );
        let text = format!("{long}{USAGE}{DONE}");
        let expected = format!("{long}{DONE}");
        for size in [1, 100, 4096, text.len()] {
            let pieces: Vec<&[u8]> = text.as_bytes().chunks(size).collect();
            let (after, counts) = run(&pieces);
            assert_eq!(joined(&after), expected.as_bytes(), "pieces of {size}");
            assert_eq!(
                counts,
                StripCounts {
                    stripped: 1,
                    unchecked: 1
                },
                "pieces of {size}"
            );
        }
        // A long content event is decided by its `choices`, not counted.
        let content = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
            "y".repeat(3 * HOLD_MAX_BYTES)
        );
        let pieces: Vec<&[u8]> = content.as_bytes().chunks(1000).collect();
        let (after, counts) = run(&pieces);
        assert_eq!(joined(&after), content.as_bytes());
        assert_eq!(counts, StripCounts::default());
        // Each piece went out as it came.
        assert!(after.iter().zip(&pieces).all(|(a, p)| a.as_slice() == *p));
    }
}
