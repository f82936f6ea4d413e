//! Scripted replies: the whole reply of a request decided up front as a list
//! of [`StreamStep`]s, for the protocols whose bytes need no send-time stamp
//! (Ollama NDJSON, Anthropic Messages SSE, Responses SSE, OpenAI tool calls).
//!
//! [`paced`] lays out one token sequence the way the OpenAI chat stream
//! does: the head events at once, `--ttft-ms` before the first token,
//! `--inter-token-ms` between tokens, the tail events, and the injected
//! stall/drop fault after its token count.

use super::openai::{MockConfig, MockFaults, StreamFault, StreamStep};

/// `content-type` of an SSE reply.
pub const SSE: &str = "text/event-stream";
/// `content-type` of a JSON reply.
pub const JSON: &str = "application/json";
/// `content-type` of an Ollama NDJSON stream.
pub const NDJSON: &str = "application/x-ndjson";

/// A reply decided in full by the pure core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Script {
    /// HTTP status.
    pub status: u16,
    /// `content-type`.
    pub content_type: &'static str,
    /// `true`: chunked, every [`StreamStep::Event`] its own flushed chunk.
    /// `false`: the sleeps are waited out, then the events are sent as one
    /// body with `content-length` (a fault step still hangs or drops).
    pub chunked: bool,
    /// What to do, in order.
    pub steps: Vec<StreamStep>,
}

impl Script {
    /// A chunked stream of `steps`.
    pub fn stream(content_type: &'static str, steps: Vec<StreamStep>) -> Self {
        Self {
            status: 200,
            content_type,
            chunked: true,
            steps,
        }
    }

    /// One JSON body with `status`, sent after `delay_ms`.
    pub fn json(status: u16, delay_ms: u64, body: String) -> Self {
        let mut steps = Vec::with_capacity(2);
        if delay_ms > 0 {
            steps.push(StreamStep::Sleep {
                duration_ms: delay_ms,
            });
        }
        steps.push(StreamStep::Event(body));
        Self {
            status,
            content_type: JSON,
            chunked: false,
            steps,
        }
    }

    /// The events of the script concatenated (the body a non-chunked script
    /// sends, or what a chunked one sends in total).
    pub fn body(&self) -> String {
        self.steps
            .iter()
            .filter_map(|s| match s {
                StreamStep::Event(e) => Some(e.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// The fault the mock injects into a token sequence of `tokens` tokens:
/// a drop wins over a stall; a fault after as many tokens as there are (or
/// more) never happens.
pub fn stream_fault(faults: &MockFaults, tokens: u32) -> Option<StreamFault> {
    let fault = match (faults.drop_after_tokens, faults.stall_after_tokens) {
        (Some(after_tokens), _) => StreamFault::Drop { after_tokens },
        (None, Some(after_tokens)) => StreamFault::Stall {
            after_tokens,
            duration_ms: (faults.stall_ms > 0).then_some(faults.stall_ms),
        },
        (None, None) => return None,
    };
    let after = match fault {
        StreamFault::Drop { after_tokens } | StreamFault::Stall { after_tokens, .. } => {
            after_tokens
        }
    };
    (after < tokens).then_some(fault)
}

/// Lays out `head`, then the `tokens` events paced by `config`, with the
/// fault of `faults` injected, then `tail`. After a hang or a drop nothing
/// more is scripted.
pub fn paced(
    head: Vec<String>,
    tokens: Vec<String>,
    tail: Vec<String>,
    config: &MockConfig,
    faults: &MockFaults,
) -> Vec<StreamStep> {
    let count = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    let fault = stream_fault(faults, count);
    let mut steps: Vec<StreamStep> = head.into_iter().map(StreamStep::Event).collect();
    let sleep = |steps: &mut Vec<StreamStep>, duration_ms: u64| {
        if duration_ms > 0 {
            steps.push(StreamStep::Sleep { duration_ms });
        }
    };
    for (i, token) in tokens.into_iter().enumerate() {
        sleep(
            &mut steps,
            if i == 0 {
                config.ttft_ms
            } else {
                config.inter_token_ms
            },
        );
        steps.push(StreamStep::Event(token));
        let written = u32::try_from(i + 1).unwrap_or(u32::MAX);
        match fault {
            Some(StreamFault::Drop { after_tokens }) if after_tokens == written => {
                steps.push(StreamStep::Drop);
                return steps;
            }
            Some(StreamFault::Stall {
                after_tokens,
                duration_ms,
            }) if after_tokens == written => match duration_ms {
                Some(ms) => sleep(&mut steps, ms),
                None => {
                    steps.push(StreamStep::Hang);
                    return steps;
                }
            },
            _ => {}
        }
    }
    steps.extend(tail.into_iter().map(StreamStep::Event));
    steps
}

/// How a non-streaming reply of `tokens` tokens misbehaves under `faults`:
/// `Err(step)` is the hang or drop to perform instead of answering;
/// `Ok(delay_ms)` is the time to wait before answering (the stream's
/// duration plus a finite stall).
pub fn plain_delay(
    config: &MockConfig,
    faults: &MockFaults,
    tokens: u32,
) -> Result<u64, StreamStep> {
    let gaps = u64::from(tokens.saturating_sub(1));
    let base_ms = if tokens == 0 {
        0
    } else {
        config
            .ttft_ms
            .saturating_add(gaps.saturating_mul(config.inter_token_ms))
    };
    match stream_fault(faults, tokens) {
        None => Ok(base_ms),
        Some(StreamFault::Drop { .. }) => Err(StreamStep::Drop),
        Some(StreamFault::Stall {
            duration_ms: None, ..
        }) => Err(StreamStep::Hang),
        Some(StreamFault::Stall {
            duration_ms: Some(ms),
            ..
        }) => Ok(base_ms.saturating_add(ms)),
    }
}

/// Splits `text` into pieces of at most `max_chars` characters (at least
/// one piece, possibly empty), on character boundaries.
pub fn pieces(text: &str, max_chars: usize) -> Vec<String> {
    let max_chars = max_chars.max(1);
    let chars: Vec<char> = text.chars().collect();
    if chars.is_empty() {
        return vec![String::new()];
    }
    chars
        .chunks(max_chars)
        .map(|c| c.iter().collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(ttft_ms: u64, inter_token_ms: u64) -> MockConfig {
        MockConfig {
            ttft_ms,
            inter_token_ms,
            tokens: 3,
            models: vec!["m".into()],
        }
    }

    fn ev(s: &str) -> StreamStep {
        StreamStep::Event(s.to_string())
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn paced_lays_out_head_tokens_and_tail() {
        let steps = paced(
            strings(&["h"]),
            strings(&["a", "b"]),
            strings(&["t1", "t2"]),
            &config(5, 7),
            &MockFaults::default(),
        );
        assert_eq!(
            steps,
            vec![
                ev("h"),
                StreamStep::Sleep { duration_ms: 5 },
                ev("a"),
                StreamStep::Sleep { duration_ms: 7 },
                ev("b"),
                ev("t1"),
                ev("t2"),
            ]
        );
    }

    #[test]
    fn paced_injects_faults() {
        let stall = MockFaults {
            stall_after_tokens: Some(1),
            ..MockFaults::default()
        };
        assert_eq!(
            paced(
                vec![],
                strings(&["a", "b"]),
                strings(&["t"]),
                &config(0, 0),
                &stall
            ),
            vec![ev("a"), StreamStep::Hang]
        );
        let finite = MockFaults {
            stall_after_tokens: Some(1),
            stall_ms: 9,
            ..MockFaults::default()
        };
        assert_eq!(
            paced(vec![], strings(&["a", "b"]), vec![], &config(0, 0), &finite),
            vec![ev("a"), StreamStep::Sleep { duration_ms: 9 }, ev("b")]
        );
        let drop = MockFaults {
            drop_after_tokens: Some(2),
            ..MockFaults::default()
        };
        assert_eq!(
            paced(
                vec![],
                strings(&["a", "b", "c"]),
                vec![],
                &config(0, 0),
                &drop
            ),
            vec![ev("a"), ev("b"), StreamStep::Drop]
        );
        // A fault after the last token never happens.
        assert_eq!(
            paced(vec![], strings(&["a"]), vec![], &config(0, 0), &drop),
            vec![ev("a")]
        );
    }

    #[test]
    fn plain_delay_follows_faults() {
        assert_eq!(
            plain_delay(&config(5, 7), &MockFaults::default(), 3),
            Ok(19)
        );
        assert_eq!(plain_delay(&config(5, 7), &MockFaults::default(), 0), Ok(0));
        let drop = MockFaults {
            drop_after_tokens: Some(1),
            ..MockFaults::default()
        };
        assert_eq!(plain_delay(&config(0, 0), &drop, 3), Err(StreamStep::Drop));
        let stall = MockFaults {
            stall_after_tokens: Some(1),
            stall_ms: 4,
            ..MockFaults::default()
        };
        assert_eq!(plain_delay(&config(0, 0), &stall, 3), Ok(4));
    }

    #[test]
    fn pieces_split_on_char_boundaries() {
        assert_eq!(pieces("abcdefg", 3), strings(&["abc", "def", "g"]));
        assert_eq!(pieces("", 3), strings(&[""]));
        assert_eq!(pieces("héllo", 2), strings(&["hé", "ll", "o"]));
    }
}
