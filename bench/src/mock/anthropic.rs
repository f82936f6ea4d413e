//! The mock's Anthropic Messages API: `POST /v1/messages` (SSE with
//! `"stream": true`, one `message` object otherwise) and
//! `POST /v1/messages/count_tokens`.
//!
//! Content follows the deterministic rule of the OpenAI mode (`tok0 tok1 …`,
//! `--tokens` capped by `max_tokens`, `stop_reason` `max_tokens` when
//! capped, else `end_turn`). `input_tokens` is the word count of `system`
//! (a string or text blocks) and of every message's text. Stall/drop faults
//! apply to the text deltas; `--fail-status` answers with that status and an
//! Anthropic error body.
//!
//! ```text
//! event: message_start        {"type":"message_start","message":{…,"content":[],"usage":{"input_tokens":P,"output_tokens":0}}}
//! event: content_block_start  {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}
//! event: ping                 {"type":"ping"}
//! event: content_block_delta  {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"tok0 "}}   × N
//! event: content_block_stop   {"type":"content_block_stop","index":0}
//! event: message_delta        {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":N}}
//! event: message_stop         {"type":"message_stop"}
//! ```

use serde_json::{json, Value};

use super::openai::{completion_text, token_text, word_count, MockConfig, MockFaults};
use super::script::{self, Script};
use super::tools;

/// The prefix of message ids; the full id is `msg_mock_<seq>`.
pub const MESSAGE_ID_PREFIX: &str = "msg_mock_";

/// Anthropic's error body `{"type":"error","error":{"type":..,"message":..}}`.
pub fn error_body(kind: &str, message: &str) -> String {
    json!({"type": "error", "error": {"type": kind, "message": message}}).to_string()
}

/// A parsed Messages request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagesRequest {
    /// Model, echoed.
    pub model: String,
    /// `stream: true`.
    pub stream: bool,
    /// `max_tokens`.
    pub max_tokens: Option<u64>,
    /// Words of `system` and the messages.
    pub input_tokens: u64,
}

impl MessagesRequest {
    /// Parses a `/v1/messages` or `/v1/messages/count_tokens` body; `Err`
    /// is the 400 message.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
        let model = value
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .ok_or("model: field required")?
            .to_string();
        if !value.get("messages").is_some_and(Value::is_array) {
            return Err("messages: field required".into());
        }
        let system = match value.get("system") {
            Some(Value::String(s)) => word_count(s),
            other => tools::content_words(other),
        };
        Ok(Self {
            model,
            stream: value
                .get("stream")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_tokens: value.get("max_tokens").and_then(Value::as_u64),
            input_tokens: system.saturating_add(tools::prompt_words(&value)),
        })
    }
}

fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn rejected(faults: &MockFaults, body: &[u8]) -> Result<MessagesRequest, Script> {
    if let Some(status) = faults.fail_status {
        return Err(Script::json(
            status,
            0,
            error_body("api_error", &format!("injected failure (status {status})")),
        ));
    }
    MessagesRequest::parse(body)
        .map_err(|message| Script::json(400, 0, error_body("invalid_request_error", &message)))
}

/// The reply to `POST /v1/messages`; `seq` makes the id.
pub fn messages(body: &[u8], config: &MockConfig, faults: &MockFaults, seq: u64) -> Script {
    let request = match rejected(faults, body) {
        Ok(r) => r,
        Err(script) => return script,
    };
    let (tokens, stop_reason) = match request.max_tokens {
        Some(cap) if cap < u64::from(config.tokens) => {
            (u32::try_from(cap).unwrap_or(0), "max_tokens")
        }
        _ => (config.tokens, "end_turn"),
    };
    let id = format!("{MESSAGE_ID_PREFIX}{seq}");
    let message = |content: Value, stop: Value, output_tokens: u64| {
        json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": null,
            "usage": {"input_tokens": request.input_tokens, "output_tokens": output_tokens},
        })
    };
    if !request.stream {
        let content = json!([{"type": "text", "text": completion_text(tokens)}]);
        let body = message(content, json!(stop_reason), u64::from(tokens)).to_string();
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
    let head = vec![
        event(
            "message_start",
            &json!({"type": "message_start", "message": message(json!([]), Value::Null, 0)}),
        ),
        event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", &json!({"type": "ping"})),
    ];
    let deltas = (0..tokens)
        .map(|i| {
            event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": token_text(i)}}),
            )
        })
        .collect();
    let tail = vec![
        event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        ),
        event(
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": tokens}}),
        ),
        event("message_stop", &json!({"type": "message_stop"})),
    ];
    Script::stream(
        script::SSE,
        script::paced(head, deltas, tail, config, faults),
    )
}

/// The reply to `POST /v1/messages/count_tokens`: `{"input_tokens":N}`.
pub fn count_tokens(body: &[u8], faults: &MockFaults) -> Script {
    match rejected(faults, body) {
        Ok(r) => Script::json(200, 0, json!({"input_tokens": r.input_tokens}).to_string()),
        Err(script) => script,
    }
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

    const BODY: &[u8] = br#"{"model":"claude-x","max_tokens":64,"system":"be brief","messages":[{"role":"user","content":"hi there"}],"stream":true}"#;

    #[test]
    fn streamed_message_is_exact() {
        let script = messages(BODY, &config(2), &MockFaults::default(), 7);
        assert_eq!((script.status, script.content_type), (200, script::SSE));
        let events: Vec<String> = script
            .steps
            .iter()
            .map(|s| match s {
                StreamStep::Event(e) => e.clone(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(
            events,
            [
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_mock_7\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-x\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":4,\"output_tokens\":0}}}\n\n",
                "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
                "event: ping\ndata: {\"type\":\"ping\"}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok0 \"}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok1 \"}}\n\n",
                "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":2}}\n\n",
                "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            ]
        );
    }

    #[test]
    fn plain_message_count_tokens_and_errors() {
        let plain = br#"{"model":"c","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"a b c"}]}]}"#;
        let script = messages(plain, &config(3), &MockFaults::default(), 1);
        assert!(!script.chunked);
        assert_eq!(
            script.body(),
            r#"{"id":"msg_mock_1","type":"message","role":"assistant","model":"c","content":[{"type":"text","text":"tok0 "}],"stop_reason":"max_tokens","stop_sequence":null,"usage":{"input_tokens":3,"output_tokens":1}}"#
        );
        let counted = count_tokens(BODY, &MockFaults::default());
        assert_eq!(
            (counted.status, counted.body()),
            (200, r#"{"input_tokens":4}"#.to_string())
        );
        let bad = count_tokens(b"{}", &MockFaults::default());
        assert_eq!(
            (bad.status, bad.body()),
            (
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"model: field required"}}"#
                    .to_string()
            )
        );
        let fail = MockFaults {
            fail_status: Some(529),
            ..MockFaults::default()
        };
        assert_eq!(messages(BODY, &config(2), &fail, 1).status, 529);
    }
}
