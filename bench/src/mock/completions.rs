//! The mock's legacy OpenAI text completions: `POST /v1/completions`.
//!
//! The text follows the chat rule (`tok0 tok1 …`, `--tokens` capped by
//! `max_tokens`, finish `length` when capped). With a `suffix` the text ends
//! with the marker `[suffix:<bytes>]` naming its length, so a test sees the
//! suffix was passed through. `prompt` is a string or an array of strings;
//! `prompt_tokens` is the word count of them all, `completion_tokens` the
//! token count.
//!
//! ```text
//! {"id":"cmpl-mock-<seq>","object":"text_completion","created":1700000000,"model":M,
//!  "choices":[{"index":0,"text":"tok0 tok1 ","finish_reason":"stop","logprobs":null}],
//!  "usage":{"prompt_tokens":P,"completion_tokens":N,"total_tokens":P+N}}
//! ```
//!
//! A stream (`"stream": true`) sends one `text_completion` chunk per token
//! (`--ttft-ms` before the first, `--inter-token-ms` between), then the
//! suffix marker chunk if any, then a chunk with empty text and the finish
//! reason, then (with `stream_options.include_usage`) a `"choices":[]` chunk
//! carrying `usage`, then `data: [DONE]`. Every chunk but the usage chunk
//! has `"usage":null` when `include_usage` is on, as chat chunks do.

use serde_json::{json, Value};

use super::openai::{
    error_body, token_text, word_count, MockConfig, MockFaults, StreamStep, CREATED_UNIX_S,
    DONE_EVENT,
};
use super::script::{self, Script};

/// The prefix of text completion ids; the full id is `cmpl-mock-<seq>`.
pub const ID_PREFIX: &str = "cmpl-mock-";

/// The marker ending the text of a completion with a `suffix` of `bytes`
/// bytes.
pub fn suffix_marker(bytes: usize) -> String {
    format!("[suffix:{bytes}]")
}

/// The parts of a `/v1/completions` request the mock acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletionsRequest {
    /// Model, echoed.
    pub model: String,
    /// Words in the prompt(s).
    pub prompt_tokens: u64,
    /// Byte length of `suffix`, when present.
    pub suffix_bytes: Option<usize>,
    /// `max_tokens`.
    pub max_tokens: Option<u64>,
    /// `"stream": true`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

impl CompletionsRequest {
    /// Parses a body; `Err` is the 400 message.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| format!("invalid completion request body: {e}"))?;
        let model = value
            .get("model")
            .and_then(Value::as_str)
            .ok_or("model is required (a string)")?
            .to_string();
        let prompt_tokens = match value.get("prompt") {
            Some(Value::String(text)) => word_count(text),
            Some(Value::Array(items)) => {
                let mut words = 0;
                for item in items {
                    let text = item
                        .as_str()
                        .ok_or("prompt must be a string or an array of strings")?;
                    words += word_count(text);
                }
                words
            }
            _ => return Err("prompt must be a string or an array of strings".into()),
        };
        let suffix_bytes = match value.get("suffix") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.len()),
            Some(_) => return Err("suffix must be a string".into()),
        };
        let max_tokens = match value.get("max_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .ok_or("max_tokens must be a non-negative integer")?,
            ),
        };
        Ok(Self {
            model,
            prompt_tokens,
            suffix_bytes,
            max_tokens,
            stream: value
                .get("stream")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            include_usage: value
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    }
}

/// The reply to `POST /v1/completions` with `body`; `seq` makes the id.
pub fn create(body: &[u8], config: &MockConfig, faults: &MockFaults, seq: u64) -> Script {
    if let Some(status) = faults.fail_status {
        return Script::json(
            status,
            0,
            error_body(&format!("injected failure (status {status})")),
        );
    }
    let request = match CompletionsRequest::parse(body) {
        Ok(request) => request,
        Err(message) => return Script::json(400, 0, error_body(&message)),
    };
    let (tokens, finish_reason) = match request.max_tokens {
        Some(cap) if cap < u64::from(config.tokens) => (u32::try_from(cap).unwrap_or(0), "length"),
        _ => (config.tokens, "stop"),
    };
    let id = format!("{ID_PREFIX}{seq}");
    let completion_tokens = u64::from(tokens);
    let usage = json!({
        "prompt_tokens": request.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": request.prompt_tokens.saturating_add(completion_tokens),
    });
    let marker = request.suffix_bytes.map(suffix_marker);
    if !request.stream {
        let mut text: String = (0..tokens).map(token_text).collect();
        if let Some(marker) = &marker {
            text.push_str(marker);
        }
        let body = json!({
            "id": id,
            "object": "text_completion",
            "created": CREATED_UNIX_S,
            "model": request.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": null}],
            "usage": usage,
        })
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
    let chunk = |text: &str, finish: Value| {
        let mut value = json!({
            "id": id,
            "object": "text_completion",
            "created": CREATED_UNIX_S,
            "model": request.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}],
        });
        if request.include_usage {
            value["usage"] = Value::Null;
        }
        format!("data: {value}\n\n")
    };
    let events = (0..tokens)
        .map(|i| chunk(&token_text(i), Value::Null))
        .collect();
    let mut tail = Vec::with_capacity(4);
    if let Some(marker) = &marker {
        tail.push(chunk(marker, Value::Null));
    }
    tail.push(chunk("", json!(finish_reason)));
    if request.include_usage {
        let value = json!({
            "id": id,
            "object": "text_completion",
            "created": CREATED_UNIX_S,
            "model": request.model,
            "choices": [],
            "usage": usage,
        });
        tail.push(format!("data: {value}\n\n"));
    }
    tail.push(DONE_EVENT.to_string());
    let steps: Vec<StreamStep> = script::paced(vec![], events, tail, config, faults);
    Script::stream(script::SSE, steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tokens: u32) -> MockConfig {
        MockConfig {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens,
            models: vec!["m".into()],
        }
    }

    #[test]
    fn plain_completion_is_exact_and_marks_the_suffix() {
        let script = create(
            br#"{"model":"gpt-x","prompt":["a b","c"],"suffix":"xyz","max_tokens":2}"#,
            &config(3),
            &MockFaults::default(),
            7,
        );
        assert_eq!((script.status, script.chunked), (200, false));
        assert_eq!(
            script.body(),
            concat!(
                r#"{"id":"cmpl-mock-7","object":"text_completion","created":1700000000,"model":"gpt-x","#,
                r#""choices":[{"index":0,"text":"tok0 tok1 [suffix:3]","finish_reason":"length","logprobs":null}],"#,
                r#""usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#
            )
        );
    }

    #[test]
    fn bad_prompts_are_400_in_the_openai_shape() {
        for body in [
            &br#"{"model":"m"}"#[..],
            br#"{"model":"m","prompt":[1,2]}"#,
            br#"{"prompt":"x"}"#,
            br#"{"model":"m","prompt":"x","suffix":3}"#,
            b"not json",
        ] {
            let script = create(body, &config(1), &MockFaults::default(), 1);
            assert_eq!(script.status, 400, "{}", String::from_utf8_lossy(body));
            let value: Value = serde_json::from_str(&script.body()).expect("json");
            assert_eq!(value["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn stream_ends_with_finish_usage_and_done() {
        let script = create(
            br#"{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}"#,
            &config(1),
            &MockFaults::default(),
            2,
        );
        assert_eq!((script.status, script.chunked), (200, true));
        let head = r#"data: {"id":"cmpl-mock-2","object":"text_completion","created":1700000000,"model":"m","choices":"#;
        assert_eq!(
            script.steps,
            vec![
                StreamStep::Event(format!(
                    "{head}[{{\"index\":0,\"text\":\"tok0 \",\"finish_reason\":null,\"logprobs\":null}}],\"usage\":null}}\n\n"
                )),
                StreamStep::Event(format!(
                    "{head}[{{\"index\":0,\"text\":\"\",\"finish_reason\":\"stop\",\"logprobs\":null}}],\"usage\":null}}\n\n"
                )),
                StreamStep::Event(format!(
                    "{head}[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2}}}}\n\n"
                )),
                StreamStep::Event(DONE_EVENT.to_string()),
            ]
        );
    }
}
