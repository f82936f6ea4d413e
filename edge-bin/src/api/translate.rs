//! Normalized runs → the OpenAI chat completions surface (E1, E4, E5, U7).
//!
//! A pure translator: `RunEvent`s in, SSE bytes (streaming) or one
//! `chat.completion` object (non-streaming) out, exactly as the official SDKs
//! expect:
//!
//! ```text
//! start              → chunk {delta:{role:"assistant",content:""}}
//! delta "Hel"        → chunk {delta:{content:"Hel"}}
//! complete           → chunk {delta:{tool_calls:[{index,id,type,function}]}} per call (E4)
//!                      chunk {delta:{}, finish_reason}
//!                      chunk {choices:[], usage}        (only with include_usage)
//!                      data: [DONE]
//! error              → data: {"error":{...}}  then  data: [DONE]
//! ```
//!
//! Every chunk carries the same `id` and `created`. Assistant text is parsed
//! into tool calls only when the run says the adapter used the text tool-call
//! fallback (`metadata["openai_text_tool_fallback"] = "true"`, E5); then the
//! text is held back until the run completes, so no tool-call markup leaks
//! into the stream.

use bytes::Bytes;
use iop_wire::pb;
use serde_json::{json, Map, Value};

use crate::api::error;

/// Metadata key of native tool calls on `complete` (E4): a JSON array of
/// OpenAI tool calls with `arguments` as JSON strings.
pub const META_TOOL_CALLS: &str = "openai_tool_calls";
/// Metadata key set to `"true"` when the adapter fell back to text tool
/// calls (E5).
pub const META_TEXT_TOOL_FALLBACK: &str = "openai_text_tool_fallback";

/// Opening and closing tags of one text tool call in the fallback format
/// (E5): `<tool_call>{"name": "...", "arguments": {...}}</tool_call>`.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// See [`TOOL_CALL_OPEN`].
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// Identity shared by every chunk of one response.
#[derive(Debug, Clone)]
pub struct ResponseId {
    /// `chatcmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: i64,
    /// The model name reported to the client.
    pub model: String,
}

fn usage_json(u: &pb::Usage) -> Value {
    let total = if u.total_tokens == 0 {
        u.prompt_tokens.saturating_add(u.completion_tokens)
    } else {
        u.total_tokens
    };
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": total,
    })
}

fn is_fallback(ev: &pb::RunEvent) -> bool {
    ev.metadata
        .get(META_TEXT_TOOL_FALLBACK)
        .is_some_and(|v| v == "true")
}

/// Native tool calls of a `complete` event (E4), normalized to the OpenAI
/// shape. Malformed metadata yields none.
pub fn native_tool_calls(ev: &pb::RunEvent) -> Vec<Value> {
    let Some(raw) = ev.metadata.get(META_TOOL_CALLS) else {
        return Vec::new();
    };
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Array(calls)) => calls
            .into_iter()
            .enumerate()
            .filter_map(|(i, c)| normalize_tool_call(c, i))
            .collect(),
        _ => Vec::new(),
    }
}

fn normalize_tool_call(call: Value, index: usize) -> Option<Value> {
    let function = call.get("function")?;
    let name = function.get("name")?.as_str()?.to_string();
    let arguments = match function.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => "{}".to_string(),
    };
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| format!("call_{index}"));
    Some(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

/// Splits assistant text in the fallback format into the text outside the
/// tags and the tool calls inside them (E5). Text that does not parse as a
/// tool call stays text.
pub fn parse_text_tool_calls(text: &str, run_id: &str) -> (String, Vec<Value>) {
    let mut rest = text;
    let mut outside = String::new();
    let mut calls = Vec::new();
    while let Some(start) = rest.find(TOOL_CALL_OPEN) {
        let after = &rest[start + TOOL_CALL_OPEN.len()..];
        let Some(end) = after.find(TOOL_CALL_CLOSE) else {
            break;
        };
        let inner = after[..end].trim();
        let parsed = serde_json::from_str::<Value>(inner).ok().and_then(|v| {
            let name = v.get("name")?.as_str()?.to_string();
            let arguments = match v.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => "{}".to_string(),
            };
            Some((name, arguments))
        });
        match parsed {
            Some((name, arguments)) => {
                outside.push_str(&rest[..start]);
                calls.push(json!({
                    "id": format!("call_{}_{}", run_id, calls.len()),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }));
            }
            None => outside
                .push_str(&rest[..start + TOOL_CALL_OPEN.len() + end + TOOL_CALL_CLOSE.len()]),
        }
        rest = &after[end + TOOL_CALL_CLOSE.len()..];
    }
    outside.push_str(rest);
    (outside.trim().to_string(), calls)
}

fn finish_reason(ev: &pb::RunEvent, has_tool_calls: bool) -> &'static str {
    if has_tool_calls {
        return "tool_calls";
    }
    match ev.finish_reason.as_str() {
        "length" => "length",
        "tool_calls" => "tool_calls",
        _ => match ev.metadata.get("done_reason").map(String::as_str) {
            Some("length") => "length",
            _ => "stop",
        },
    }
}

/// Streaming translation of one run into `chat.completion.chunk` SSE events.
#[derive(Debug)]
pub struct ChunkStream {
    id: ResponseId,
    include_usage: bool,
    role_sent: bool,
    /// Text held back because the run uses the text tool-call fallback.
    held: Option<String>,
    finished: bool,
}

impl ChunkStream {
    /// A translator for one response.
    pub fn new(id: ResponseId, include_usage: bool) -> Self {
        Self {
            id,
            include_usage,
            role_sent: false,
            held: None,
            finished: false,
        }
    }

    /// Whether the terminal was translated.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> Bytes {
        let mut obj = Map::new();
        obj.insert("id".into(), json!(self.id.id));
        obj.insert("object".into(), json!("chat.completion.chunk"));
        obj.insert("created".into(), json!(self.id.created));
        obj.insert("model".into(), json!(self.id.model));
        obj.insert("choices".into(), choices);
        if let Some(u) = usage {
            obj.insert("usage".into(), u);
        } else if self.include_usage {
            obj.insert("usage".into(), Value::Null);
        }
        Bytes::from(format!("data: {}\n\n", Value::Object(obj)))
    }

    fn delta(&self, delta: Value, finish: Option<&str>) -> Bytes {
        self.chunk(
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]),
            None,
        )
    }

    fn role(&mut self, out: &mut Vec<Bytes>) {
        if !self.role_sent {
            self.role_sent = true;
            out.push(self.delta(json!({"role": "assistant", "content": ""}), None));
        }
    }

    /// Translates one event; returns the SSE bytes to write (possibly none).
    /// Nothing is produced after the terminal (E1).
    pub fn on_event(&mut self, ev: &pb::RunEvent) -> Vec<Bytes> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        if is_fallback(ev) && self.held.is_none() {
            self.held = Some(String::new());
        }
        match ev.r#type() {
            pb::RunEventType::Start => self.role(&mut out),
            pb::RunEventType::Delta => {
                self.role(&mut out);
                if ev.delta.is_empty() {
                    return out;
                }
                match &mut self.held {
                    Some(buf) => buf.push_str(&ev.delta),
                    None => out.push(self.delta(json!({"content": ev.delta}), None)),
                }
            }
            pb::RunEventType::Complete => {
                self.role(&mut out);
                let mut calls = native_tool_calls(ev);
                if let Some(text) = self.held.take() {
                    let (text, text_calls) = parse_text_tool_calls(&text, &ev.run_id);
                    if !text.is_empty() {
                        out.push(self.delta(json!({"content": text}), None));
                    }
                    calls.extend(text_calls);
                }
                for (index, call) in calls.iter().enumerate() {
                    let mut c = call.clone();
                    if let Value::Object(o) = &mut c {
                        o.insert("index".into(), json!(index));
                    }
                    out.push(self.delta(json!({"tool_calls": [c]}), None));
                }
                let reason = finish_reason(ev, !calls.is_empty());
                out.push(self.delta(json!({}), Some(reason)));
                if self.include_usage {
                    let usage = ev.usage.as_deref().copied().unwrap_or_default();
                    out.push(self.chunk(json!([]), Some(usage_json(&usage))));
                }
                out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                self.finished = true;
            }
            pb::RunEventType::Error | pb::RunEventType::Cancelled => {
                let code = if ev.failure_code.is_empty() {
                    "provider_error"
                } else {
                    ev.failure_code.as_str()
                };
                let message = if ev.error.is_empty() {
                    "the provider run failed"
                } else {
                    error::client_message(code, &ev.error)
                };
                out.push(error::sse_error_event(
                    message,
                    "upstream_error",
                    Some(code),
                ));
                self.finished = true;
            }
            pb::RunEventType::Unspecified => {}
        }
        out
    }
}

/// How a non-streaming run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Completion {
    /// The `chat.completion` object.
    Done(Value),
    /// The run failed: failure code and message.
    Failed {
        /// Failure code (`response_stalled`, `provider_error`, …).
        code: String,
        /// Message.
        message: String,
    },
}

/// Non-streaming translation: accumulates a run into one `chat.completion`.
#[derive(Debug)]
pub struct CompletionBuilder {
    id: ResponseId,
    content: String,
    fallback: bool,
}

impl CompletionBuilder {
    /// A builder for one response.
    pub fn new(id: ResponseId) -> Self {
        Self {
            id,
            content: String::new(),
            fallback: false,
        }
    }

    /// Feeds one event; returns the result at the terminal.
    pub fn on_event(&mut self, ev: &pb::RunEvent) -> Option<Completion> {
        self.fallback |= is_fallback(ev);
        match ev.r#type() {
            pb::RunEventType::Delta => {
                self.content.push_str(&ev.delta);
                None
            }
            pb::RunEventType::Complete => {
                let mut calls = native_tool_calls(ev);
                let mut content = std::mem::take(&mut self.content);
                if self.fallback {
                    let (text, text_calls) = parse_text_tool_calls(&content, &ev.run_id);
                    content = text;
                    calls.extend(text_calls);
                }
                let reason = finish_reason(ev, !calls.is_empty());
                let mut message = Map::new();
                message.insert("role".into(), json!("assistant"));
                message.insert(
                    "content".into(),
                    if content.is_empty() && !calls.is_empty() {
                        Value::Null
                    } else {
                        json!(content)
                    },
                );
                if !calls.is_empty() {
                    message.insert("tool_calls".into(), Value::Array(calls));
                }
                let usage = ev.usage.as_deref().copied().unwrap_or_default();
                Some(Completion::Done(json!({
                    "id": self.id.id,
                    "object": "chat.completion",
                    "created": self.id.created,
                    "model": self.id.model,
                    "choices": [{
                        "index": 0,
                        "message": Value::Object(message),
                        "logprobs": null,
                        "finish_reason": reason,
                    }],
                    "usage": usage_json(&usage),
                })))
            }
            pb::RunEventType::Error | pb::RunEventType::Cancelled => Some(Completion::Failed {
                code: if ev.failure_code.is_empty() {
                    "provider_error".into()
                } else {
                    ev.failure_code.clone()
                },
                message: if ev.error.is_empty() {
                    "the provider run failed".into()
                } else {
                    ev.error.clone()
                },
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> ResponseId {
        ResponseId {
            id: "chatcmpl-run-1".into(),
            created: 7,
            model: "llama".into(),
        }
    }

    fn ev(t: pb::RunEventType) -> pb::RunEvent {
        pb::RunEvent {
            run_id: "run-1".into(),
            r#type: t as i32,
            ..Default::default()
        }
    }

    fn delta(text: &str) -> pb::RunEvent {
        pb::RunEvent {
            delta: text.into(),
            ..ev(pb::RunEventType::Delta)
        }
    }

    fn text(chunks: &[Bytes]) -> String {
        chunks
            .iter()
            .map(|b| std::str::from_utf8(b).unwrap())
            .collect()
    }

    // CONTRACT: E1 — start, deltas, one terminal; nothing after it.
    #[test]
    fn stream_is_exact() {
        let mut s = ChunkStream::new(id(), true);
        let mut out = s.on_event(&ev(pb::RunEventType::Start));
        out.extend(s.on_event(&delta("Hel")));
        out.extend(s.on_event(&delta("lo")));
        let mut done = ev(pb::RunEventType::Complete);
        done.usage = Some(Box::new(pb::Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            total_tokens: 0,
        }));
        out.extend(s.on_event(&done));
        assert!(s.on_event(&delta("late")).is_empty());
        let head =
            r#""id":"chatcmpl-run-1","object":"chat.completion.chunk","created":7,"model":"llama""#;
        let expected = [
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{"content":"Hel"}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{"content":"lo"}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"stop"}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}}}"#),
            "data: [DONE]".to_string(),
        ]
        .map(|e| e + "\n\n")
        .concat();
        assert_eq!(text(&out), expected);
    }

    // CONTRACT: E4 — native tool calls come back as delta.tool_calls with an
    // index on every delta and id/type/name in the first.
    #[test]
    fn native_tool_calls_stream_and_complete() {
        let mut done = ev(pb::RunEventType::Complete);
        done.metadata.insert(
            META_TOOL_CALLS.into(),
            r#"[{"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\"}"}}]"#.into(),
        );
        let mut s = ChunkStream::new(id(), false);
        let out = text(&s.on_event(&done));
        assert!(out.contains(r#""delta":{"tool_calls":[{"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\"}"},"index":0}]}"#), "{out}");
        assert!(out.contains(r#""finish_reason":"tool_calls""#));
        let mut b = CompletionBuilder::new(id());
        let Some(Completion::Done(v)) = b.on_event(&done) else {
            panic!("no completion")
        };
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(v["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }

    // CONTRACT: E4, E5 — assistant text is parsed into tool calls only when
    // the fallback flag is set.
    #[test]
    fn text_tool_calls_only_with_the_fallback_flag() {
        let text_call = r#"Sure. <tool_call>{"name":"lookup","arguments":{"q":"x"}}</tool_call>"#;
        let mut plain = CompletionBuilder::new(id());
        plain.on_event(&delta(text_call));
        let Some(Completion::Done(v)) = plain.on_event(&ev(pb::RunEventType::Complete)) else {
            panic!()
        };
        assert_eq!(v["choices"][0]["message"]["content"], text_call);
        assert!(v["choices"][0]["message"].get("tool_calls").is_none());

        let mut fb = CompletionBuilder::new(id());
        fb.on_event(&delta(text_call));
        let mut done = ev(pb::RunEventType::Complete);
        done.metadata
            .insert(META_TEXT_TOOL_FALLBACK.into(), "true".into());
        let Some(Completion::Done(v)) = fb.on_event(&done) else {
            panic!()
        };
        assert_eq!(v["choices"][0]["message"]["content"], "Sure.");
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"],
            json!({"name": "lookup", "arguments": "{\"q\":\"x\"}"})
        );

        // Streaming: flagged on start, the text is held back and parsed.
        let mut s = ChunkStream::new(id(), false);
        let mut start = ev(pb::RunEventType::Start);
        start
            .metadata
            .insert(META_TEXT_TOOL_FALLBACK.into(), "true".into());
        let mut out = s.on_event(&start);
        out.extend(s.on_event(&delta(text_call)));
        out.extend(s.on_event(&ev(pb::RunEventType::Complete)));
        let out = text(&out);
        assert!(!out.contains("<tool_call>"), "{out}");
        assert!(out.contains(r#""name":"lookup""#));
    }

    // CONTRACT: E5 — the events a Node sends for a text tool-call fallback
    // run (flag on start and complete, the <tool_call> block split across
    // deltas as a backend streams it) become one SDK tool call; no markup
    // reaches the client.
    #[test]
    fn fallback_run_split_across_deltas_becomes_a_tool_call() {
        let flagged = |t: pb::RunEventType| {
            let mut e = ev(t);
            e.metadata
                .insert(META_TEXT_TOOL_FALLBACK.into(), "true".into());
            e
        };
        let call_text =
            r#"<tool_call>{"name":"get_weather","arguments":{"city":"tok0","days":1}}</tool_call>"#;
        let pieces: Vec<String> = call_text
            .as_bytes()
            .chunks(8)
            .map(|c| String::from_utf8(c.to_vec()).unwrap())
            .collect();
        let mut s = ChunkStream::new(id(), false);
        let mut out = s.on_event(&flagged(pb::RunEventType::Start));
        for p in &pieces {
            out.extend(s.on_event(&delta(p)));
        }
        let mut done = flagged(pb::RunEventType::Complete);
        done.finish_reason = "stop".into();
        out.extend(s.on_event(&done));
        let out = text(&out);
        assert!(!out.contains("tool_call>"), "{out}");
        assert!(out.contains(r#""delta":{"tool_calls":[{"id":"call_run-1_0","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"tok0\",\"days\":1}"},"index":0}]}"#), "{out}");
        assert!(out.contains(r#""finish_reason":"tool_calls""#));
        assert!(!out.contains(r#""content":"<"#));
        let mut b = CompletionBuilder::new(id());
        b.on_event(&flagged(pb::RunEventType::Start));
        for p in &pieces {
            b.on_event(&delta(p));
        }
        let Some(Completion::Done(v)) = b.on_event(&done) else {
            panic!("no completion")
        };
        assert_eq!(v["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"],
            json!({"name": "get_weather", "arguments": "{\"city\":\"tok0\",\"days\":1}"})
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn error_ends_the_stream_with_an_error_event() {
        let mut s = ChunkStream::new(id(), false);
        s.on_event(&delta("x"));
        let mut err = ev(pb::RunEventType::Error);
        err.failure_code = "response_stalled".into();
        err.error = "stalled".into();
        let out = text(&s.on_event(&err));
        assert_eq!(
            out,
            "data: {\"error\":{\"message\":\"stalled\",\"type\":\"upstream_error\",\"param\":null,\"code\":\"response_stalled\"}}\n\ndata: [DONE]\n\n"
        );
        assert!(s.is_finished());
    }

    // A node's words that name the provider's address never reach the
    // client's stream (error::client_message).
    #[test]
    fn an_error_event_names_no_provider_address() {
        let mut s = ChunkStream::new(id(), false);
        s.on_event(&delta("x"));
        let mut err = ev(pb::RunEventType::Error);
        err.failure_code = "provider_unreachable".into();
        err.error = "connect 10.0.0.5:8000: Connection refused (os error 111)".into();
        assert_eq!(
            text(&s.on_event(&err)),
            "data: {\"error\":{\"message\":\"The provider could not be reached.\",\"type\":\"upstream_error\",\"param\":null,\"code\":\"provider_unreachable\"}}\n\ndata: [DONE]\n\n"
        );
    }

    // Usage from the wire near u64::MAX: the total saturates.
    #[test]
    fn a_usage_total_saturates() {
        let usage = |prompt_tokens, completion_tokens, total_tokens| pb::Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens,
        };
        assert_eq!(
            usage_json(&usage(u64::MAX, 2, 0)),
            json!({"prompt_tokens": u64::MAX, "completion_tokens": 2, "total_tokens": u64::MAX})
        );
        assert_eq!(usage_json(&usage(3, 4, 0))["total_tokens"], 7);
        assert_eq!(usage_json(&usage(3, 4, 9))["total_tokens"], 9);
    }

    #[test]
    fn unparseable_text_call_stays_text() {
        let (t, calls) = parse_text_tool_calls("a <tool_call>nope</tool_call> b", "r");
        assert_eq!(t, "a <tool_call>nope</tool_call> b");
        assert!(calls.is_empty());
    }
}
