//! The mock's OpenAI Responses API: `POST /v1/responses` (SSE with
//! `"stream": true`, one `response` object otherwise).
//!
//! Content follows the deterministic rule of the OpenAI chat mode
//! (`tok0 tok1 …`, `--tokens` capped by `max_output_tokens`; a capped
//! response is `incomplete` with reason `max_output_tokens`).
//! `input_tokens` is the word count of `instructions` and `input` (a string,
//! or the text of every input item's content). Stall/drop faults apply to
//! the text deltas; `--fail-status` answers with that status.
//!
//! The stream is the event sequence the official API sends, each event
//! `event: <type>` + `data: {…,"sequence_number":k}` with `k` counting from 0:
//!
//! ```text
//! response.created → response.in_progress → response.output_item.added →
//! response.content_part.added → response.output_text.delta × N →
//! response.output_text.done → response.content_part.done →
//! response.output_item.done → response.completed | response.incomplete
//! ```

use serde_json::{json, Value};

use super::openai::{completion_text, error_body, token_text, word_count, MockConfig, MockFaults};
use super::script::{self, Script};
use super::tools;

/// Prefix of response ids (`resp_mock_<seq>`).
pub const RESPONSE_ID_PREFIX: &str = "resp_mock_";
/// Prefix of output message ids (`msg_mock_<seq>`).
pub const ITEM_ID_PREFIX: &str = "msg_mock_";

/// A parsed Responses request.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    /// Model, echoed.
    pub model: String,
    /// `stream: true`.
    pub stream: bool,
    /// `max_output_tokens`.
    pub max_output_tokens: Option<u64>,
    /// Words of `instructions` and `input`.
    pub input_tokens: u64,
    /// `instructions`, echoed.
    pub instructions: Value,
}

impl ResponsesRequest {
    /// Parses a `/v1/responses` body; `Err` is the 400 message.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
        let model = value
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .ok_or("Missing required parameter: 'model'.")?
            .to_string();
        let input_words = match value.get("input") {
            Some(Value::String(s)) => word_count(s),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| tools::content_words(item.get("content")))
                .sum(),
            None => 0,
            Some(_) => return Err("Invalid type for 'input'.".into()),
        };
        let instructions = value.get("instructions").cloned().unwrap_or(Value::Null);
        let instruction_words = instructions.as_str().map(word_count).unwrap_or(0);
        Ok(Self {
            model,
            stream: value
                .get("stream")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_output_tokens: value.get("max_output_tokens").and_then(Value::as_u64),
            input_tokens: input_words.saturating_add(instruction_words),
            instructions,
        })
    }
}

/// Builds the objects of one response.
struct Builder<'a> {
    request: &'a ResponsesRequest,
    id: String,
    item_id: String,
    tokens: u32,
    incomplete: bool,
}

impl Builder<'_> {
    fn text_part(text: &str) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    }

    fn item(&self, status: &str, content: Value) -> Value {
        json!({
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        })
    }

    fn final_status(&self) -> &'static str {
        if self.incomplete {
            "incomplete"
        } else {
            "completed"
        }
    }

    /// The response object in `status` with `output`.
    fn response(&self, status: &str, output: Value, done: bool) -> Value {
        let input = self.request.input_tokens;
        let output_tokens = u64::from(self.tokens);
        let usage = if done {
            json!({
                "input_tokens": input,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input.saturating_add(output_tokens),
            })
        } else {
            Value::Null
        };
        let incomplete_details = if done && self.incomplete {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": super::openai::CREATED_UNIX_S,
            "status": status,
            "completed_at": if done && !self.incomplete { json!(super::openai::CREATED_UNIX_S) } else { Value::Null },
            "error": null,
            "incomplete_details": incomplete_details,
            "instructions": self.request.instructions,
            "max_output_tokens": self.request.max_output_tokens,
            "model": self.request.model,
            "output": output,
            "parallel_tool_calls": true,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
        })
    }

    fn done_output(&self) -> Value {
        let text = completion_text(self.tokens);
        json!([self.item(self.final_status(), json!([Self::text_part(&text)]))])
    }
}

/// Numbers events as they are laid out.
struct Events {
    next_seq: u64,
}

impl Events {
    fn event(&mut self, kind: &str, mut data: Value) -> String {
        if let Value::Object(o) = &mut data {
            o.insert("type".into(), json!(kind));
            o.insert("sequence_number".into(), json!(self.next_seq));
        }
        self.next_seq += 1;
        format!("event: {kind}\ndata: {data}\n\n")
    }
}

/// The reply to `POST /v1/responses`; `seq` makes the ids.
pub fn create(body: &[u8], config: &MockConfig, faults: &MockFaults, seq: u64) -> Script {
    if let Some(status) = faults.fail_status {
        return Script::json(
            status,
            0,
            error_body(&format!("injected failure (status {status})")),
        );
    }
    let request = match ResponsesRequest::parse(body) {
        Ok(r) => r,
        Err(message) => return Script::json(400, 0, error_body(&message)),
    };
    let (tokens, incomplete) = match request.max_output_tokens {
        Some(cap) if cap < u64::from(config.tokens) => (u32::try_from(cap).unwrap_or(0), true),
        _ => (config.tokens, false),
    };
    let b = Builder {
        request: &request,
        id: format!("{RESPONSE_ID_PREFIX}{seq}"),
        item_id: format!("{ITEM_ID_PREFIX}{seq}"),
        tokens,
        incomplete,
    };
    if !request.stream {
        let body = b
            .response(b.final_status(), b.done_output(), true)
            .to_string();
        return match script::plain_delay(config, faults, tokens) {
            Ok(delay_ms) => Script::json(200, delay_ms, body),
            Err(step) => Script {
                status: 200,
                content_type: script::JSON,
                chunked: false,
                steps: vec![step],
            },
        };
    }
    let mut ev = Events { next_seq: 0 };
    let head = vec![
        ev.event(
            "response.created",
            json!({"response": b.response("in_progress", json!([]), false)}),
        ),
        ev.event(
            "response.in_progress",
            json!({"response": b.response("in_progress", json!([]), false)}),
        ),
        ev.event(
            "response.output_item.added",
            json!({"output_index": 0, "item": b.item("in_progress", json!([]))}),
        ),
        ev.event(
            "response.content_part.added",
            json!({"item_id": b.item_id, "output_index": 0, "content_index": 0, "part": Builder::text_part("")}),
        ),
    ];
    let deltas = (0..tokens)
        .map(|i| {
            ev.event(
                "response.output_text.delta",
                json!({"item_id": b.item_id, "output_index": 0, "content_index": 0, "delta": token_text(i), "logprobs": []}),
            )
        })
        .collect();
    let text = completion_text(tokens);
    let done_item = b.item(b.final_status(), json!([Builder::text_part(&text)]));
    let last = if incomplete {
        "response.incomplete"
    } else {
        "response.completed"
    };
    let tail = vec![
        ev.event(
            "response.output_text.done",
            json!({"item_id": b.item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
        ),
        ev.event(
            "response.content_part.done",
            json!({"item_id": b.item_id, "output_index": 0, "content_index": 0, "part": Builder::text_part(&text)}),
        ),
        ev.event(
            "response.output_item.done",
            json!({"output_index": 0, "item": done_item}),
        ),
        ev.event(
            last,
            json!({"response": b.response(b.final_status(), b.done_output(), true)}),
        ),
    ];
    Script::stream(
        script::SSE,
        script::paced(head, deltas, tail, config, faults),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::openai::StreamStep;

    fn config(tokens: u32) -> MockConfig {
        MockConfig {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens,
            models: vec!["m".into()],
        }
    }

    fn data(script: &Script) -> Vec<Value> {
        script
            .steps
            .iter()
            .filter_map(|s| match s {
                StreamStep::Event(e) => {
                    let line = e.lines().find(|l| l.starts_with("data: "))?;
                    serde_json::from_str(&line["data: ".len()..]).ok()
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn stream_events_are_ordered_and_numbered() {
        let body = br#"{"model":"m","input":"say hi","stream":true}"#;
        let script = create(body, &config(2), &MockFaults::default(), 3);
        let events = data(&script);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let seqs: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, (0..10).collect::<Vec<u64>>());
        assert_eq!(events[4]["delta"], "tok0 ");
        assert_eq!(events[5]["delta"], "tok1 ");
        assert_eq!(events[0]["response"]["id"], "resp_mock_3");
        let done = &events[9]["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "tok0 tok1 ");
        assert_eq!(done["usage"]["input_tokens"], 2);
        assert_eq!(done["usage"]["output_tokens"], 2);
        // Every SSE block names its event like the data's type.
        for step in &script.steps {
            if let StreamStep::Event(e) = step {
                let name = e.lines().next().unwrap().trim_start_matches("event: ");
                assert!(e.contains(&format!("\"type\":\"{name}\"")), "{e}");
            }
        }
    }

    #[test]
    fn plain_response_and_cap() {
        let body = br#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a b c"}]}],"max_output_tokens":1}"#;
        let script = create(body, &config(3), &MockFaults::default(), 1);
        assert!(!script.chunked);
        let v: Value = serde_json::from_str(&script.body()).unwrap();
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(v["output"][0]["content"][0]["text"], "tok0 ");
        assert_eq!(v["usage"]["input_tokens"], 3);
        assert_eq!(
            create(b"{}", &config(1), &MockFaults::default(), 1).status,
            400
        );
    }
}
