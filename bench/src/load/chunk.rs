//! The pure part of reading one streamed completion: classify each SSE
//! `data:` payload and turn arrivals into latencies.
//!
//! Every chunk the mock provider streams carries `"iop_mock_sent_ns"`, the
//! `CLOCK_MONOTONIC` time it was rendered for sending. The load generator
//! runs on the same machine and reads the same clock when the bytes arrive
//! (`iop_engine::clock::monotonic_raw_ns`), so `arrival - sent` is the
//! one-way delivery latency of that chunk through whatever sits between
//! (nothing, the Edge and Node, or a peer proxy).
//!
//! ```text
//! request start ─────────── TTFT ──────────►│
//!                         first content chunk ├─ gap ─┤ next chunk … [DONE]
//! request start ─────────────────── end to end ───────────────────────►│
//! ```

use serde::Deserialize;

/// What one SSE `data:` payload of a chat-completions stream is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkKind {
    /// A chunk whose first choice's `delta.content` is a non-empty string.
    Content,
    /// A chunk with no content text (the role chunk, the finish chunk,
    /// the usage chunk).
    NoContent,
    /// `[DONE]`, the end-of-stream marker.
    Done,
    /// An OpenAI-style error object (`{"error": {"message": ...}}`).
    Error {
        /// `error.message`, or the whole payload when it has none.
        message: String,
    },
    /// Not JSON of the chunk shape.
    Unparsable,
}

/// One classified payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// What it is.
    pub kind: ChunkKind,
    /// Its `iop_mock_sent_ns` stamp, if it carries one.
    pub sent_ns: Option<u64>,
}

#[derive(Deserialize)]
struct ChunkWire<'a> {
    #[serde(default, borrow)]
    choices: Option<Vec<ChoiceWire<'a>>>,
    #[serde(default)]
    iop_mock_sent_ns: Option<u64>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct ChoiceWire<'a> {
    #[serde(default, borrow)]
    delta: Option<DeltaWire<'a>>,
}

#[derive(Deserialize)]
struct DeltaWire<'a> {
    #[serde(default, borrow)]
    content: Option<std::borrow::Cow<'a, str>>,
}

/// Classifies one SSE `data:` payload.
pub fn classify(data: &str) -> Chunk {
    let trimmed = data.trim();
    if trimmed == "[DONE]" {
        return Chunk {
            kind: ChunkKind::Done,
            sent_ns: None,
        };
    }
    let Ok(wire) = serde_json::from_str::<ChunkWire<'_>>(trimmed) else {
        return Chunk {
            kind: ChunkKind::Unparsable,
            sent_ns: None,
        };
    };
    let kind = if let Some(error) = wire.error.filter(|e| !e.is_null()) {
        let message = error
            .get("message")
            .and_then(serde_json::Value::as_str)
            .map_or_else(|| error.to_string(), str::to_string);
        ChunkKind::Error { message }
    } else {
        let has_content = wire
            .choices
            .as_ref()
            .and_then(|c| c.first())
            .and_then(|c| c.delta.as_ref())
            .and_then(|d| d.content.as_ref())
            .is_some_and(|text| !text.is_empty());
        if has_content {
            ChunkKind::Content
        } else {
            ChunkKind::NoContent
        }
    };
    Chunk {
        kind,
        sent_ns: wire.iop_mock_sent_ns,
    }
}

/// The one-way latency of a chunk stamped `sent_ns` that arrived at
/// `arrival_ns` (same clock); 0 if the stamp is later than the arrival.
pub fn chunk_latency_ns(sent_ns: u64, arrival_ns: u64) -> u64 {
    arrival_ns.saturating_sub(sent_ns)
}

/// What one payload added to a stream's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// A content chunk.
    Content {
        /// Request start → this chunk, for the first content chunk only.
        ttft_ns: Option<u64>,
        /// Its one-way latency, when stamped.
        latency_ns: Option<u64>,
        /// Time since the previous content chunk, from the second one on.
        gap_ns: Option<u64>,
    },
    /// `[DONE]`.
    Done,
    /// An error event.
    Error,
    /// Nothing to record (no-content chunks, anything after `[DONE]`,
    /// unparsable payloads).
    Nothing,
}

/// How a stream ended, from the tracker's point of view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEnd {
    /// Request start → end of the response.
    pub end_to_end_ns: u64,
    /// Request start → first content chunk.
    pub ttft_ns: Option<u64>,
    /// Content chunks received.
    pub content_chunks: u64,
    /// Content chunks without an `iop_mock_sent_ns` stamp.
    pub unstamped_chunks: u64,
    /// The largest gap between consecutive content chunks.
    pub max_gap_ns: u64,
    /// Whether `[DONE]` arrived.
    pub done: bool,
    /// The first error event's message, if any.
    pub error: Option<String>,
    /// Payloads that were not JSON of the chunk shape.
    pub unparsable: u64,
}

/// Per-stream state: feed it each payload with its arrival time.
#[derive(Debug, Clone)]
pub struct StreamTracker {
    start_ns: u64,
    first_content_ns: Option<u64>,
    last_content_ns: Option<u64>,
    content_chunks: u64,
    unstamped_chunks: u64,
    max_gap_ns: u64,
    done: bool,
    error: Option<String>,
    unparsable: u64,
}

impl StreamTracker {
    /// A stream whose request started (or was scheduled to start) at
    /// `start_ns`.
    pub fn new(start_ns: u64) -> Self {
        StreamTracker {
            start_ns,
            first_content_ns: None,
            last_content_ns: None,
            content_chunks: 0,
            unstamped_chunks: 0,
            max_gap_ns: 0,
            done: false,
            error: None,
            unparsable: 0,
        }
    }

    /// Takes one `data:` payload that arrived at `arrival_ns`.
    pub fn on_data(&mut self, data: &str, arrival_ns: u64) -> Observation {
        if self.done {
            return Observation::Nothing;
        }
        let chunk = classify(data);
        match chunk.kind {
            ChunkKind::Done => {
                self.done = true;
                Observation::Done
            }
            ChunkKind::Error { message } => {
                self.error.get_or_insert(message);
                Observation::Error
            }
            ChunkKind::Unparsable => {
                self.unparsable += 1;
                Observation::Nothing
            }
            ChunkKind::NoContent => Observation::Nothing,
            ChunkKind::Content => {
                self.content_chunks += 1;
                let ttft_ns = match self.first_content_ns {
                    None => {
                        self.first_content_ns = Some(arrival_ns);
                        Some(arrival_ns.saturating_sub(self.start_ns))
                    }
                    Some(_) => None,
                };
                let gap_ns = self
                    .last_content_ns
                    .map(|last| arrival_ns.saturating_sub(last));
                if let Some(gap) = gap_ns {
                    self.max_gap_ns = self.max_gap_ns.max(gap);
                }
                self.last_content_ns = Some(arrival_ns);
                let latency_ns = chunk.sent_ns.map(|sent| chunk_latency_ns(sent, arrival_ns));
                if latency_ns.is_none() {
                    self.unstamped_chunks += 1;
                }
                Observation::Content {
                    ttft_ns,
                    latency_ns,
                    gap_ns,
                }
            }
        }
    }

    /// The stream's figures once its response ended at `end_ns`.
    pub fn finish(self, end_ns: u64) -> StreamEnd {
        StreamEnd {
            end_to_end_ns: end_ns.saturating_sub(self.start_ns),
            ttft_ns: self
                .first_content_ns
                .map(|first| first.saturating_sub(self.start_ns)),
            content_chunks: self.content_chunks,
            unstamped_chunks: self.unstamped_chunks,
            max_gap_ns: self.max_gap_ns,
            done: self.done,
            error: self.error,
            unparsable: self.unparsable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token chunk exactly as `bench mock-provider` streams it.
    const MOCK_TOKEN: &str = r#"{"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"mock-model","choices":[{"index":0,"delta":{"content":"tok0 "},"logprobs":null,"finish_reason":null}],"iop_mock_sent_ns":1000000}"#;
    const MOCK_ROLE: &str = r#"{"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"mock-model","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"iop_mock_sent_ns":999000}"#;
    const MOCK_FINISH: &str = r#"{"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"mock-model","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"iop_mock_sent_ns":1300000}"#;

    #[test]
    fn sample_event_latency_is_arrival_minus_stamp() {
        let chunk = classify(MOCK_TOKEN);
        assert_eq!(
            chunk,
            Chunk {
                kind: ChunkKind::Content,
                sent_ns: Some(1_000_000)
            }
        );
        assert_eq!(chunk_latency_ns(1_000_000, 1_042_500), 42_500);
        assert_eq!(chunk_latency_ns(1_000_000, 999_999), 0);
    }

    #[test]
    fn classifies_every_payload_kind() {
        assert_eq!(classify(MOCK_ROLE).kind, ChunkKind::NoContent);
        assert_eq!(classify(MOCK_ROLE).sent_ns, Some(999_000));
        assert_eq!(classify(MOCK_FINISH).kind, ChunkKind::NoContent);
        assert_eq!(
            classify(r#"{"choices":[],"usage":{"prompt_tokens":1}}"#).kind,
            ChunkKind::NoContent
        );
        assert_eq!(classify(" [DONE] ").kind, ChunkKind::Done);
        assert_eq!(classify("{not json").kind, ChunkKind::Unparsable);
        assert_eq!(classify("[1,2]").kind, ChunkKind::Unparsable);
        assert_eq!(
            classify(r#"{"error":{"message":"node lost","type":"upstream_error","param":null,"code":"node_disconnected"}}"#).kind,
            ChunkKind::Error {
                message: "node lost".into()
            }
        );
        assert_eq!(
            classify(r#"{"error":"plain"}"#).kind,
            ChunkKind::Error {
                message: "\"plain\"".into()
            }
        );
        // Escaped content still counts as content; no stamp is fine.
        let escaped = classify(r#"{"choices":[{"delta":{"content":"\"q\"\n"}}]}"#);
        assert_eq!(
            escaped,
            Chunk {
                kind: ChunkKind::Content,
                sent_ns: None
            }
        );
    }

    #[test]
    fn tracker_measures_ttft_gaps_and_latency() {
        let mut t = StreamTracker::new(500_000);
        assert_eq!(t.on_data(MOCK_ROLE, 999_500), Observation::Nothing);
        assert_eq!(
            t.on_data(MOCK_TOKEN, 1_010_000),
            Observation::Content {
                ttft_ns: Some(510_000),
                latency_ns: Some(10_000),
                gap_ns: None
            }
        );
        let second = MOCK_TOKEN.replace("1000000", "1200000");
        assert_eq!(
            t.on_data(&second, 1_230_000),
            Observation::Content {
                ttft_ns: None,
                latency_ns: Some(30_000),
                gap_ns: Some(220_000)
            }
        );
        let unstamped = r#"{"choices":[{"delta":{"content":"x"}}]}"#;
        assert_eq!(
            t.on_data(unstamped, 1_250_000),
            Observation::Content {
                ttft_ns: None,
                latency_ns: None,
                gap_ns: Some(20_000)
            }
        );
        assert_eq!(t.on_data(MOCK_FINISH, 1_300_000), Observation::Nothing);
        assert_eq!(t.on_data("garbage", 1_300_000), Observation::Nothing);
        assert_eq!(t.on_data("[DONE]", 1_310_000), Observation::Done);
        // Nothing counts after [DONE].
        assert_eq!(t.on_data(MOCK_TOKEN, 1_400_000), Observation::Nothing);
        assert_eq!(
            t.finish(1_320_000),
            StreamEnd {
                end_to_end_ns: 820_000,
                ttft_ns: Some(510_000),
                content_chunks: 3,
                unstamped_chunks: 1,
                max_gap_ns: 220_000,
                done: true,
                error: None,
                unparsable: 1,
            }
        );
    }

    #[test]
    fn tracker_keeps_the_first_error_and_notices_truncation() {
        let mut t = StreamTracker::new(0);
        assert_eq!(
            t.on_data(r#"{"error":{"message":"first"}}"#, 10),
            Observation::Error
        );
        assert_eq!(
            t.on_data(r#"{"error":{"message":"second"}}"#, 20),
            Observation::Error
        );
        let end = t.finish(30);
        assert_eq!(end.error.as_deref(), Some("first"));
        assert!(!end.done);
        assert_eq!(end.ttft_ns, None);
        assert_eq!(end.content_chunks, 0);
        assert_eq!(end.end_to_end_ns, 30);
    }
}
