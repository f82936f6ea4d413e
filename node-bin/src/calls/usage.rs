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
//! `output_tokens` in `message_delta`). A `"usage"` inside a string value
//! has its quotes escaped, so it never matches `"usage"` followed by `:`.

use iop_wire::pb;
use memchr::memmem;

const KEY: &[u8] = b"\"usage\"";
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

    /// Looks at the next body piece.
    pub fn feed(&mut self, piece: &[u8]) {
        let mut at = 0;
        // Finish what the previous piece started.
        if self.object.is_some() || self.after_key {
            at = self.continue_value(piece, 0);
        } else if !self.carry.is_empty() {
            // A key split between the pieces: carry ++ head of this piece.
            // On the stack, no allocation per piece: `carry` keeps fewer
            // than `KEY.len()` bytes.
            let head = &piece[..piece.len().min(KEY.len())];
            let carry = &self.carry[self.carry.len().saturating_sub(KEY.len() - 1)..];
            let carried = carry.len();
            let mut buf = [0u8; 2 * KEY.len()];
            buf[..carried].copy_from_slice(carry);
            buf[carried..carried + head.len()].copy_from_slice(head);
            let joined = &buf[..carried + head.len()];
            if let Some(pos) = memmem::find(joined, KEY) {
                let end = pos + KEY.len();
                if end > carried && !escaped(&joined[..pos]) {
                    self.after_key = true;
                    at = self.continue_value(piece, end - carried);
                }
            }
        }
        while at < piece.len() && self.object.is_none() && !self.after_key {
            let Some(pos) = memmem::find(&piece[at..], KEY) else {
                break;
            };
            let key_at = at + pos;
            at = key_at + KEY.len();
            if escaped(&piece[..key_at]) {
                continue;
            }
            self.after_key = true;
            at = self.continue_value(piece, at);
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
    }

    /// What was observed, if anything.
    pub fn finish(self) -> Option<pb::Usage> {
        if self.prompt_tokens.is_none() && self.completion_tokens.is_none() {
            return None;
        }
        let prompt_tokens = self.prompt_tokens.unwrap_or(0);
        let completion_tokens = self.completion_tokens.unwrap_or(0);
        Some(pb::Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: self
                .total_tokens
                .unwrap_or(prompt_tokens + completion_tokens),
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
    fn anthropic_messages_take_input_from_the_start_and_output_from_the_last_delta() {
        let body = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
                    event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"usage\"}}\n\n\
                    event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n";
        assert_eq!(observed("text/event-stream", body), usage(25, 15, 40));
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
