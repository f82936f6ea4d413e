//! The mock's Ollama native API: `POST /api/chat` (NDJSON stream, or one
//! JSON object with `"stream": false`), `GET /api/tags`, `GET /api/version`.
//!
//! Content follows the same deterministic rule as the OpenAI mode
//! (`tok0 tok1 …`, `--tokens` capped by `options.num_predict`, finish
//! `length` when capped); `prompt_eval_count` is the word count of the
//! message texts and `eval_count` the number of tokens. In the `tool_calls`
//! mode a request with `tools` is answered with one tool call whose
//! `arguments` is a JSON object (see [`super::tools`]). The stall/drop
//! faults apply to the token lines; `--fail-status` answers
//! `{"error": "..."}` with that status.
//!
//! ```text
//! {"model":"m","created_at":"2023-11-14T22:13:20Z","message":{"role":"assistant","content":"tok0 "},"done":false}
//! …
//! {"model":"m","created_at":"…","message":{"role":"assistant","content":""},"done_reason":"stop","done":true,
//!  "total_duration":0,"load_duration":0,"prompt_eval_count":P,"prompt_eval_duration":0,"eval_count":N,"eval_duration":0}
//! ```

use serde_json::{json, Value};

use super::openai::{completion_text, token_text, MockConfig, MockFaults};
use super::script::{self, Script};
use super::tools::{self, MockModes, MockToolCall};

/// `created_at` / `modified_at` of every object: [`super::openai::CREATED_UNIX_S`]
/// as RFC 3339.
pub const CREATED_AT: &str = "2023-11-14T22:13:20Z";

/// The version `GET /api/version` reports.
pub const VERSION: &str = "0.0.0-iop-mock";

/// `{"error": message}`, Ollama's error body.
pub fn error_body(message: &str) -> String {
    json!({ "error": message }).to_string()
}

/// `GET /api/version`.
pub fn version_body() -> String {
    json!({ "version": VERSION }).to_string()
}

/// `GET /api/tags`: every configured model, as `name` and `model`.
pub fn tags_body(models: &[String]) -> String {
    let models: Vec<Value> = models
        .iter()
        .map(|m| {
            json!({
                "name": m,
                "model": m,
                "modified_at": CREATED_AT,
                "size": 0,
                "digest": "0000000000000000000000000000000000000000000000000000000000000000",
                "details": {
                    "format": "gguf",
                    "family": "mock",
                    "parameter_size": "0B",
                    "quantization_level": "none",
                },
            })
        })
        .collect();
    json!({ "models": models }).to_string()
}

/// A parsed `/api/chat` request.
#[derive(Debug, Clone, PartialEq)]
pub struct OllamaChat {
    /// Model, echoed.
    pub model: String,
    /// `stream` (Ollama's default is `true`).
    pub stream: bool,
    /// Words in the message texts.
    pub prompt_tokens: u64,
    /// `options.num_predict` when not negative.
    pub num_predict: Option<u64>,
    /// The request body, for the tool modes.
    pub body: Value,
}

impl OllamaChat {
    /// Parses a body; `Err` is the 400 message.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
        let model = value
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .ok_or("model is required")?
            .to_string();
        if !value.get("messages").is_some_and(Value::is_array) {
            return Err("messages must be an array".into());
        }
        let stream = value.get("stream").and_then(Value::as_bool).unwrap_or(true);
        let num_predict = value
            .get("options")
            .and_then(|o| o.get("num_predict"))
            .and_then(Value::as_i64)
            .and_then(|n| u64::try_from(n).ok());
        Ok(Self {
            model,
            stream,
            prompt_tokens: tools::prompt_words(&value),
            num_predict,
            body: value,
        })
    }

    fn line(&self, message: Value, done: bool) -> Value {
        json!({
            "model": self.model,
            "created_at": CREATED_AT,
            "message": message,
            "done": done,
        })
    }

    fn done_line(&self, message: Value, done_reason: &str, eval_count: u64) -> String {
        let mut line = self.line(message, true);
        if let Value::Object(o) = &mut line {
            o.insert("done_reason".into(), json!(done_reason));
            o.insert("total_duration".into(), json!(0));
            o.insert("load_duration".into(), json!(0));
            o.insert("prompt_eval_count".into(), json!(self.prompt_tokens));
            o.insert("prompt_eval_duration".into(), json!(0));
            o.insert("eval_count".into(), json!(eval_count));
            o.insert("eval_duration".into(), json!(0));
        }
        line.to_string()
    }
}

fn text_message(content: &str) -> Value {
    json!({"role": "assistant", "content": content})
}

fn tool_message(call: &MockToolCall) -> Value {
    json!({
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {
            "name": call.name,
            "arguments": Value::Object(call.arguments.clone()),
        }}],
    })
}

/// The reply to `POST /api/chat`.
pub fn chat(body: &[u8], config: &MockConfig, faults: &MockFaults, modes: MockModes) -> Script {
    if let Some(status) = faults.fail_status {
        return Script::json(
            status,
            0,
            error_body(&format!("injected failure (status {status})")),
        );
    }
    let chat = match OllamaChat::parse(body) {
        Ok(c) => c,
        Err(message) => return Script::json(400, 0, error_body(&message)),
    };
    let tool_call = if modes.tool_calls {
        tools::request_tools(&chat.body).and_then(|t| tools::choose_tool(t, None))
    } else {
        None
    };
    if let Some(call) = tool_call {
        let done = chat.done_line(text_message(""), "stop", 1);
        if !chat.stream {
            return Script::json(
                200,
                config.ttft_ms,
                chat.done_line(tool_message(&call), "stop", 1),
            );
        }
        let head = vec![format!("{}\n", chat.line(tool_message(&call), false))];
        return Script::stream(
            script::NDJSON,
            script::paced(head, vec![], vec![format!("{done}\n")], config, faults),
        );
    }
    let (tokens, done_reason) = match chat.num_predict {
        Some(cap) if cap < u64::from(config.tokens) => (u32::try_from(cap).unwrap_or(0), "length"),
        _ => (config.tokens, "stop"),
    };
    if !chat.stream {
        return match script::plain_delay(config, faults, tokens) {
            Ok(delay_ms) => Script::json(
                200,
                delay_ms,
                chat.done_line(
                    text_message(&completion_text(tokens)),
                    done_reason,
                    u64::from(tokens),
                ),
            ),
            Err(step) => Script {
                status: 200,
                content_type: script::JSON,
                chunked: false,
                steps: vec![step],
            },
        };
    }
    let lines = (0..tokens)
        .map(|i| format!("{}\n", chat.line(text_message(&token_text(i)), false)))
        .collect();
    let done = chat.done_line(text_message(""), done_reason, u64::from(tokens));
    Script::stream(
        script::NDJSON,
        script::paced(vec![], lines, vec![format!("{done}\n")], config, faults),
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
            models: vec!["mock-model".into()],
        }
    }

    fn events(script: &Script) -> Vec<String> {
        script
            .steps
            .iter()
            .map(|s| match s {
                StreamStep::Event(e) => e.clone(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    const DONE_TAIL: &str = r#""total_duration":0,"load_duration":0,"prompt_eval_count":2,"prompt_eval_duration":0,"eval_count":2,"eval_duration":0}"#;

    #[test]
    fn streamed_chat_is_exact_ndjson() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi there"}]}"#;
        let script = chat(
            body,
            &config(2),
            &MockFaults::default(),
            MockModes::default(),
        );
        assert_eq!(
            (script.status, script.content_type, script.chunked),
            (200, NDJSON_CT, true)
        );
        assert_eq!(
            events(&script),
            vec![
                "{\"model\":\"m\",\"created_at\":\"2023-11-14T22:13:20Z\",\"message\":{\"role\":\"assistant\",\"content\":\"tok0 \"},\"done\":false}\n".to_string(),
                "{\"model\":\"m\",\"created_at\":\"2023-11-14T22:13:20Z\",\"message\":{\"role\":\"assistant\",\"content\":\"tok1 \"},\"done\":false}\n".to_string(),
                format!("{{\"model\":\"m\",\"created_at\":\"2023-11-14T22:13:20Z\",\"message\":{{\"role\":\"assistant\",\"content\":\"\"}},\"done\":true,\"done_reason\":\"stop\",{DONE_TAIL}\n"),
            ]
        );
    }

    const NDJSON_CT: &str = script::NDJSON;

    #[test]
    fn plain_chat_and_num_predict() {
        let body = br#"{"model":"m","stream":false,"options":{"num_predict":1},"messages":[{"role":"user","content":"a b"}]}"#;
        let script = chat(
            body,
            &config(3),
            &MockFaults::default(),
            MockModes::default(),
        );
        assert!(!script.chunked);
        assert_eq!(
            script.body(),
            r#"{"model":"m","created_at":"2023-11-14T22:13:20Z","message":{"role":"assistant","content":"tok0 "},"done":true,"done_reason":"length","total_duration":0,"load_duration":0,"prompt_eval_count":2,"prompt_eval_duration":0,"eval_count":1,"eval_duration":0}"#
        );
    }

    #[test]
    fn tool_call_mode_answers_with_an_object_arguments_call() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"a b"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]}"#;
        let modes = MockModes {
            tool_calls: true,
            ..MockModes::default()
        };
        let script = chat(body, &config(3), &MockFaults::default(), modes);
        let ev = events(&script);
        assert_eq!(ev.len(), 2);
        assert_eq!(
            ev[0],
            "{\"model\":\"m\",\"created_at\":\"2023-11-14T22:13:20Z\",\"message\":{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"function\":{\"name\":\"get_weather\",\"arguments\":{\"city\":\"tok0\"}}}]},\"done\":false}\n"
        );
        assert!(ev[1].contains(r#""done":true,"done_reason":"stop""#));
    }

    #[test]
    fn faults_and_errors() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
        let drop = MockFaults {
            drop_after_tokens: Some(1),
            ..MockFaults::default()
        };
        let script = chat(body, &config(3), &drop, MockModes::default());
        assert_eq!(script.steps.len(), 2);
        assert_eq!(script.steps.last(), Some(&StreamStep::Drop));
        let fail = MockFaults {
            fail_status: Some(500),
            ..MockFaults::default()
        };
        let script = chat(body, &config(3), &fail, MockModes::default());
        assert_eq!(script.status, 500);
        assert_eq!(
            script.body(),
            r#"{"error":"injected failure (status 500)"}"#
        );
        let script = chat(
            b"{}",
            &config(3),
            &MockFaults::default(),
            MockModes::default(),
        );
        assert_eq!(
            (script.status, script.body()),
            (400, r#"{"error":"model is required"}"#.to_string())
        );
    }

    #[test]
    fn tags_and_version() {
        let tags: Value = serde_json::from_str(&tags_body(&["a".into(), "b:7b".into()])).unwrap();
        let names: Vec<&str> = tags["models"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["a", "b:7b"]);
        assert_eq!(version_body(), r#"{"version":"0.0.0-iop-mock"}"#);
    }
}
