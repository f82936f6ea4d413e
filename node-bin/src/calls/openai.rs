//! The OpenAI-compatible adapter's normalized path: a `RunRequest` aimed at
//! an `openai_compat` instance (a direct, non-pool call; the Edge tunnels
//! pool traffic to these providers, U7) becomes `POST` to the profile's
//! `chat_completions` path with `"stream": true`, its SSE answer parsed
//! into [`RunOutput`]s.
//!
//! ```text
//! RunInput ──chat_body(Native)──► POST chat_completions (tools, tool_choice)
//!   400/422 (or an error naming tools) while tools were sent?
//!     └─ once: chat_body(TextFallback) — no tools/tool_choice, the text
//!        tool-call instruction merged into the leading system message  (E5)
//! 200 ─► start {openai_text_tool_fallback?}
//! data: {delta.content}          ─► delta
//! data: {delta.tool_calls[i]}    ─► accumulated by index (progress)      (E4)
//! data: {choices: [], usage}     ─► kept for complete (progress)
//! data: [DONE] / end of body     ─► complete {finish_reason, usage,
//!                                     metadata: openai_tool_calls?, openai_text_tool_fallback?}
//! data: {"error": …}             ─► error (provider_error, W6)
//! ```
//!
//! # The text tool-call fallback (E5)
//!
//! When the backend rejects the native tool API, the run is retried once
//! without `tools`/`tool_choice`; the instruction below (the Hermes/Qwen
//! tool-prompt convention) lists the tools, one JSON object per line between
//! `<tools>` and `</tools>`, and asks for calls as
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`. It is merged into
//! the leading system message (appended after a blank line, or a system
//! message is created first) so backends that only accept a system message
//! in first position keep working. Earlier assistant tool calls are
//! rewritten into that text form and tool results into `user` messages
//! wrapped in `<tool_response>`, since the backend speaks no tool API. Both
//! `start` and `complete` carry `openai_text_tool_fallback = "true"`; only
//! then does the Edge parse the text into tool calls. A `tool_choice` of
//! `"none"` is retried without tools and without the instruction (no
//! fallback flag: the text is never parsed).

use std::collections::HashMap;
use std::rc::Rc;

use bytes::Bytes;
use iop_engine::http::SseSplitter;
use iop_wire::pb;
use serde_json::{json, Map, Value};

use super::channel::OutputTx;
use super::normalize::{
    self, CallFailure, Framing, InputError, ItemParser, MAX_ERROR_BODY_BYTES, MAX_EVENT_BYTES,
    MAX_JSON_BODY_BYTES, META_TEXT_TOOL_FALLBACK,
};
use super::output::RunOutput;
use super::pool::ProviderPool;
use crate::adapters::Endpoint;
use crate::codes;

/// How a request treats tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolMode {
    /// Native `tools`/`tool_choice` (E4).
    Native,
    /// No tools; the text tool-call instruction in the system message (E5).
    TextFallback,
    /// No tools and no instruction (`tool_choice: "none"` after a
    /// rejection).
    Without,
}

/// The instruction's heading line.
pub const INSTRUCTION_HEADING: &str = "# Tools";

/// The text tool-call instruction for `tools` (see the module docs).
pub fn fallback_instruction(tools: &[Value], tool_choice: Option<&Value>) -> String {
    let mut text = String::from(INSTRUCTION_HEADING);
    text.push_str(
        "\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
    );
    for tool in tools {
        text.push_str(&tool.to_string());
        text.push('\n');
    }
    text.push_str(
        "</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    match tool_choice {
        Some(Value::String(s)) if s == "required" => {
            text.push_str("\n\nYou must call at least one function.");
        }
        Some(choice) => {
            if let Some(name) = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
            {
                text.push_str(&format!("\n\nYou must call the function `{name}`."));
            }
        }
        None => {}
    }
    text
}

/// Whether a non-2xx answer to a request that carried tools means the
/// backend rejects the tool API: 400 or 422, or any error whose body
/// mentions tools (llama.cpp without `--jinja` answers 500 "tools param
/// requires --jinja flag").
pub fn is_tool_rejection(status: u16, body: &[u8], tools_sent: bool) -> bool {
    if !tools_sent || status < 400 {
        return false;
    }
    if status == 400 || status == 422 {
        return true;
    }
    String::from_utf8_lossy(body)
        .to_ascii_lowercase()
        .contains("tool")
}

fn text_tool_call(c: &Value) -> Option<String> {
    let function = c.get("function")?;
    let name = function.get("name")?.as_str()?;
    let arguments = match function.get("arguments") {
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::String(s.clone()))
        }
        Some(v) => v.clone(),
        None => Value::Object(Map::new()),
    };
    Some(format!(
        "<tool_call>\n{}\n</tool_call>",
        json!({"name": name, "arguments": arguments})
    ))
}

/// The chat completions body for `target` in `mode` (see the module docs).
pub fn chat_body(target: &str, input: &pb::RunInput, mode: ToolMode) -> Result<Bytes, InputError> {
    let tools = normalize::tools(input)?;
    let choice = normalize::json_field("tool_choice_json", &input.tool_choice_json)?;
    let mut messages = Vec::with_capacity(input.messages.len() + 1);
    for m in &input.messages {
        let calls = normalize::json_field("tool_calls_json", &m.tool_calls_json)?
            .and_then(|c| c.as_array().cloned())
            .filter(|c| !c.is_empty());
        let mut msg = Map::new();
        if mode == ToolMode::Native {
            msg.insert("role".into(), json!(m.role));
            msg.insert(
                "content".into(),
                if m.content.is_empty() && calls.is_some() {
                    Value::Null
                } else {
                    json!(m.content)
                },
            );
            if !m.name.is_empty() {
                msg.insert("name".into(), json!(m.name));
            }
            if !m.tool_call_id.is_empty() {
                msg.insert("tool_call_id".into(), json!(m.tool_call_id));
            }
            if let Some(calls) = calls {
                msg.insert("tool_calls".into(), Value::Array(calls));
            }
        } else if m.role == "tool" {
            msg.insert("role".into(), json!("user"));
            msg.insert(
                "content".into(),
                json!(format!("<tool_response>\n{}\n</tool_response>", m.content)),
            );
        } else {
            let mut content = m.content.clone();
            for text in calls.iter().flatten().filter_map(text_tool_call) {
                if !content.is_empty() {
                    content.push('\n');
                }
                content.push_str(&text);
            }
            msg.insert("role".into(), json!(m.role));
            msg.insert("content".into(), json!(content));
            if !m.name.is_empty() {
                msg.insert("name".into(), json!(m.name));
            }
        }
        messages.push(Value::Object(msg));
    }
    if let (ToolMode::TextFallback, Some(tools)) = (mode, tools.as_ref()) {
        let instruction = fallback_instruction(tools, choice.as_ref());
        let leading_system = messages
            .first_mut()
            .filter(|m| m.get("role").and_then(Value::as_str) == Some("system"));
        match leading_system {
            Some(Value::Object(system)) => {
                let original = system
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                let merged = if original.is_empty() {
                    instruction
                } else {
                    format!("{original}\n\n{instruction}")
                };
                system.insert("content".into(), json!(merged));
            }
            _ => messages.insert(0, json!({"role": "system", "content": instruction})),
        }
    }
    let mut body = Map::new();
    body.insert("model".into(), json!(target));
    body.insert("messages".into(), Value::Array(messages));
    body.insert("stream".into(), json!(true));
    body.insert("stream_options".into(), json!({"include_usage": true}));
    if mode == ToolMode::Native {
        if let Some(tools) = tools {
            body.insert("tools".into(), Value::Array(tools));
            if let Some(choice) = choice {
                body.insert("tool_choice".into(), choice);
            }
        }
    }
    if let Some(n) = input.max_tokens {
        body.insert("max_tokens".into(), json!(n));
    }
    if let Some(t) = input.temperature {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(p) = input.top_p {
        body.insert("top_p".into(), json!(p));
    }
    if !input.stop.is_empty() {
        body.insert("stop".into(), json!(input.stop));
    }
    if let Some(s) = input.seed {
        body.insert("seed".into(), json!(s));
    }
    Ok(Bytes::from(Value::Object(body).to_string()))
}

/// The mode of the one retry after a tool rejection.
pub fn retry_mode(input: &pb::RunInput) -> ToolMode {
    let none = normalize::json_field("tool_choice_json", &input.tool_choice_json)
        .ok()
        .flatten()
        .is_some_and(|c| c.as_str() == Some("none"));
    if none {
        ToolMode::Without
    } else {
        ToolMode::TextFallback
    }
}

/// The auth header a credential lease injects (C2): the profile's header
/// name with `{secret}` in its format replaced; `None` when the profile
/// declares no auth header. The secret only ever comes from an opened lease.
pub fn auth_header(profile: &pb::ProtocolProfile, secret: &str) -> Option<(String, String)> {
    if profile.auth_header_name.is_empty() {
        return None;
    }
    let format = if profile.auth_header_format.is_empty() {
        "{secret}"
    } else {
        profile.auth_header_format.as_str()
    };
    Some((
        profile.auth_header_name.clone(),
        format.replace("{secret}", secret),
    ))
}

/// One tool call being assembled from stream deltas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ToolCallParts {
    index: u64,
    id: String,
    name: String,
    arguments: String,
}

/// The SSE answer's parser: one event's data in, the outputs it means out.
/// Nothing is produced after a terminal.
#[derive(Debug)]
pub struct ChatStream {
    fallback: bool,
    calls: Vec<ToolCallParts>,
    finish_reason: Option<String>,
    usage: Option<pb::Usage>,
    ended: bool,
}

impl ChatStream {
    /// A parser; `fallback` marks a text tool-call fallback run (E5).
    pub fn new(fallback: bool) -> Self {
        Self {
            fallback,
            calls: Vec::new(),
            finish_reason: None,
            usage: None,
            ended: false,
        }
    }

    /// The `start` output.
    pub fn start(&self) -> RunOutput {
        let mut metadata = HashMap::new();
        if self.fallback {
            metadata.insert(META_TEXT_TOOL_FALLBACK.to_string(), "true".to_string());
        }
        RunOutput::Start { metadata }
    }

    fn fail(&mut self, message: String) -> Vec<RunOutput> {
        self.ended = true;
        vec![RunOutput::Failed {
            code: codes::PROVIDER_ERROR,
            message,
        }]
    }

    fn complete(&mut self) -> RunOutput {
        self.ended = true;
        let calls: Vec<Value> = std::mem::take(&mut self.calls)
            .into_iter()
            .map(|c| {
                let id = if c.id.is_empty() {
                    format!("call_{}", c.index)
                } else {
                    c.id
                };
                normalize::openai_tool_call(&id, &c.name, &c.arguments)
            })
            .collect();
        let finish_reason = match self.finish_reason.as_deref() {
            _ if !calls.is_empty() => "tool_calls",
            Some("length") => "length",
            Some("tool_calls" | "function_call") => "tool_calls",
            _ => "stop",
        };
        let mut metadata = HashMap::new();
        normalize::tool_calls_metadata(calls, &mut metadata);
        if self.fallback {
            metadata.insert(META_TEXT_TOOL_FALLBACK.to_string(), "true".to_string());
        }
        RunOutput::Complete {
            finish_reason: finish_reason.to_string(),
            usage: self.usage,
            metadata,
        }
    }

    fn absorb_tool_call(&mut self, position: usize, delta: &Value) {
        let index = delta
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(position as u64);
        let at = match self.calls.iter().position(|c| c.index == index) {
            Some(at) => at,
            None => {
                self.calls.push(ToolCallParts {
                    index,
                    ..ToolCallParts::default()
                });
                self.calls.len() - 1
            }
        };
        let call = &mut self.calls[at];
        if let Some(id) = delta.get("id").and_then(Value::as_str) {
            if call.id.is_empty() {
                call.id = id.to_string();
            }
        }
        let function = delta.get("function");
        if let Some(name) = function.and_then(|f| f.get("name")).and_then(Value::as_str) {
            if call.name.is_empty() {
                call.name = name.to_string();
            }
        }
        match function.and_then(|f| f.get("arguments")) {
            Some(Value::String(piece)) => call.arguments.push_str(piece),
            Some(Value::Null) | None => {}
            Some(other) => call.arguments.push_str(&other.to_string()),
        }
    }

    fn absorb_usage(&mut self, u: &Value) {
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        self.usage = Some(normalize::usage(
            n("prompt_tokens"),
            n("completion_tokens"),
            n("total_tokens"),
        ));
    }

    /// The outputs of one SSE event's `data`.
    pub fn on_data(&mut self, data: &str) -> Vec<RunOutput> {
        if self.ended {
            return Vec::new();
        }
        if data.trim() == "[DONE]" {
            return vec![self.complete()];
        }
        let value: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => return self.fail(format!("provider: malformed stream event: {e}")),
        };
        if let Some(error) = value.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| error.to_string());
            return self.fail(format!("provider: {message}"));
        }
        let mut out = Vec::new();
        let mut progressed = false;
        if let Some(u) = value.get("usage").filter(|u| u.is_object()) {
            self.absorb_usage(u);
            progressed = true;
        }
        let choice = value
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first());
        if let Some(choice) = choice {
            let delta = choice.get("delta");
            if let Some(calls) = delta
                .and_then(|d| d.get("tool_calls"))
                .and_then(Value::as_array)
            {
                for (position, c) in calls.iter().enumerate() {
                    self.absorb_tool_call(position, c);
                    progressed = true;
                }
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_string());
            }
            let text = delta
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !text.is_empty() {
                out.push(RunOutput::Delta {
                    text: text.to_string(),
                    usage: None,
                });
                progressed = false;
            }
        }
        if progressed {
            out.push(RunOutput::Progress);
        }
        out
    }

    /// The outputs of a non-streamed `chat.completion` body (a backend that
    /// ignored `"stream": true`): the content as one delta, then complete.
    pub fn on_json_body(&mut self, body: &[u8]) -> Vec<RunOutput> {
        if self.ended {
            return Vec::new();
        }
        let value: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return self.fail(format!("provider: malformed completion: {e}")),
        };
        if let Some(u) = value.get("usage").filter(|u| u.is_object()) {
            self.absorb_usage(u);
        }
        let mut out = Vec::new();
        if let Some(choice) = value
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        {
            let message = choice.get("message");
            if let Some(calls) = message
                .and_then(|m| m.get("tool_calls"))
                .and_then(Value::as_array)
            {
                for (position, c) in calls.iter().enumerate() {
                    self.absorb_tool_call(position, c);
                }
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_string());
            }
            if let Some(text) = message
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
            {
                out.push(RunOutput::Delta {
                    text: text.to_string(),
                    usage: None,
                });
            }
        }
        out.push(self.complete());
        out
    }
}

/// Runs one chat against the adapter's OpenAI-compatible server on a
/// connection of `pool`, with the E5 retry, sending outputs as they are
/// parsed. `auth` is the header a credential lease provides (C2; `None`
/// without the credential plane). `Err` is the failure terminal. The
/// connection goes back to the pool only after a clean end of a body (the
/// E5 retry reuses the rejected request's connection).
pub async fn call(
    pool: &Rc<ProviderPool>,
    adapter: &Endpoint,
    target: &str,
    input: &pb::RunInput,
    auth: Option<(String, String)>,
    out: &OutputTx<RunOutput>,
) -> Result<(), CallFailure> {
    let invalid = |e: InputError| (codes::INVALID_INPUT, format!("chat request: {e}"));
    let path = adapter
        .tunnel_path("chat_completions", "/v1/chat/completions")
        .map_err(|e| (codes::BAD_OPERATION, e.to_string()))?;
    let provider = adapter
        .profile
        .as_ref()
        .map(|p| p.name.as_str())
        .filter(|n| !n.is_empty())
        .unwrap_or("openai_compat")
        .to_string();
    let extra: Vec<(String, String)> = auth.into_iter().collect();
    let tools_sent = normalize::tools(input).map_err(invalid)?.is_some();
    let body = chat_body(target, input, ToolMode::Native).map_err(invalid)?;
    let mut exchange =
        normalize::post_json(pool, adapter, &path, "text/event-stream", &extra, body).await?;
    let mut mode = ToolMode::Native;
    let mut status = exchange.head.status;
    if !(200..300).contains(&status) {
        let error = exchange
            .body(MAX_ERROR_BODY_BYTES)
            .await
            .unwrap_or_default();
        // provider pool: the error body was read to its end.
        exchange.client.release();
        if !is_tool_rejection(status, &error, tools_sent) {
            return Err((
                codes::PROVIDER_ERROR,
                normalize::status_message(&provider, status, &error),
            ));
        }
        // E5: once, without the tool API.
        mode = retry_mode(input);
        tracing::info!(
            adapter = %adapter.name,
            status,
            ?mode,
            "backend rejected the tool API; retrying with text tool calls"
        );
        let body = chat_body(target, input, mode).map_err(invalid)?;
        exchange =
            normalize::post_json(pool, adapter, &path, "text/event-stream", &extra, body).await?;
        status = exchange.head.status;
        if !(200..300).contains(&status) {
            let error = exchange
                .body(MAX_ERROR_BODY_BYTES)
                .await
                .unwrap_or_default();
            exchange.client.release();
            return Err((
                codes::PROVIDER_ERROR,
                normalize::status_message(&provider, status, &error),
            ));
        }
    }
    let mut stream = ChatStream::new(mode == ToolMode::TextFallback);
    if !out.send(stream.start()).await {
        return Ok(());
    }
    if !exchange.content_type_is(b"text/event-stream") {
        let body = exchange.body(MAX_JSON_BODY_BYTES).await?;
        exchange.client.release();
        for output in stream.on_json_body(&body) {
            out.send(output).await;
        }
        return Ok(());
    }
    exchange
        .relay_items(
            Framing::Sse(SseSplitter::new(MAX_EVENT_BYTES)),
            &mut stream,
            out,
        )
        .await
}

impl ItemParser for ChatStream {
    fn on_item(&mut self, item: &[u8]) -> Vec<RunOutput> {
        match std::str::from_utf8(item) {
            Ok(data) => self.on_data(data),
            // Not UTF-8: let the parser report it as a malformed event.
            Err(_) => self.on_data(&String::from_utf8_lossy(item)),
        }
    }

    /// Whether a terminal was produced.
    fn is_ended(&self) -> bool {
        self.ended
    }

    /// The output at the end of the body: the terminal if the stream
    /// ended without one.
    fn on_end(&mut self) -> Vec<RunOutput> {
        if self.ended {
            return Vec::new();
        }
        if self.finish_reason.is_some() {
            return vec![self.complete()];
        }
        self.fail("provider: the stream ended before it finished".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> pb::ChatMessage {
        pb::ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    const TOOLS: &[u8] = br#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;

    fn tool_input() -> pb::RunInput {
        pb::RunInput {
            messages: vec![
                msg("system", "Be brief."),
                msg("user", "weather in Seoul?"),
                pb::ChatMessage {
                    tool_calls_json: Bytes::from_static(
                        br#"[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\"}"}}]"#,
                    ),
                    ..msg("assistant", "")
                },
                pb::ChatMessage {
                    tool_call_id: "call_1".into(),
                    ..msg("tool", "sunny")
                },
            ],
            tools_json: Bytes::from_static(TOOLS),
            tool_choice_json: Bytes::from_static(br#""auto""#),
            max_tokens: Some(9),
            ..Default::default()
        }
    }

    // CONTRACT: E3, E4 — the native request carries messages (tool calls,
    // tool results), tools and tool_choice, and asks for a stream with usage.
    #[test]
    fn native_request_is_exact() {
        let body = chat_body("qwen", &tool_input(), ToolMode::Native).unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            concat!(
                r#"{"model":"qwen","messages":["#,
                r#"{"role":"system","content":"Be brief."},"#,
                r#"{"role":"user","content":"weather in Seoul?"},"#,
                r#"{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\"}"}}]},"#,
                r#"{"role":"tool","content":"sunny","tool_call_id":"call_1"}],"#,
                r#""stream":true,"stream_options":{"include_usage":true},"#,
                r#""tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"#,
                r#""tool_choice":"auto","max_tokens":9}"#
            )
        );
    }

    // CONTRACT: E5 — the retry drops tools/tool_choice and merges the text
    // tool-call instruction into the leading system message; the history's
    // tool calls and results are rewritten as text.
    #[test]
    fn fallback_request_merges_the_instruction_into_the_system_message() {
        let body = chat_body("qwen", &tool_input(), ToolMode::TextFallback).unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert!(v.get("tools").is_none());
        assert!(v.get("tool_choice").is_none());
        let messages = v["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 4, "no extra system message");
        let instruction = fallback_instruction(
            &serde_json::from_slice::<Vec<Value>>(TOOLS).unwrap(),
            Some(&json!("auto")),
        );
        assert_eq!(
            messages[0],
            json!({"role": "system", "content": format!("Be brief.\n\n{instruction}")})
        );
        assert_eq!(
            messages[2],
            json!({"role": "assistant", "content": "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Seoul\"}}\n</tool_call>"})
        );
        assert_eq!(
            messages[3],
            json!({"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"})
        );
        assert_eq!(
            instruction,
            concat!(
                "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
                r#"{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}"#,
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n",
                r#"{"name": <function-name>, "arguments": <args-json-object>}"#,
                "\n</tool_call>"
            )
        );
        // Without a leading system message one is created.
        let mut input = tool_input();
        input.messages.remove(0);
        let v: Value =
            serde_json::from_slice(&chat_body("qwen", &input, ToolMode::TextFallback).unwrap())
                .unwrap();
        assert_eq!(v["messages"][0]["role"], "system");
        assert_eq!(v["messages"][0]["content"], json!(instruction));
        assert_eq!(v["messages"][1]["role"], "user");
    }

    #[test]
    fn instruction_follows_tool_choice() {
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        assert!(fallback_instruction(&tools, Some(&json!("required")))
            .ends_with("\n\nYou must call at least one function."));
        assert!(fallback_instruction(
            &tools,
            Some(&json!({"type": "function", "function": {"name": "f"}}))
        )
        .ends_with("\n\nYou must call the function `f`."));
        let mut input = tool_input();
        assert_eq!(retry_mode(&input), ToolMode::TextFallback);
        input.tool_choice_json = Bytes::from_static(br#""none""#);
        assert_eq!(retry_mode(&input), ToolMode::Without);
        let v: Value =
            serde_json::from_slice(&chat_body("q", &input, ToolMode::Without).unwrap()).unwrap();
        assert_eq!(
            v["messages"][0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert!(v.get("tools").is_none());
    }

    // CONTRACT: E5 — only a rejection of a request that carried tools
    // triggers the fallback.
    #[test]
    fn tool_rejection_detection() {
        assert!(is_tool_rejection(400, b"anything", true));
        assert!(is_tool_rejection(422, b"", true));
        assert!(is_tool_rejection(
            500,
            br#"{"error":{"message":"tools param requires --jinja flag"}}"#,
            true
        ));
        assert!(!is_tool_rejection(500, b"out of memory", true));
        assert!(!is_tool_rejection(400, b"tools", false));
        assert!(!is_tool_rejection(200, b"", true));
    }

    #[test]
    fn auth_header_follows_the_profile() {
        let mut p = pb::ProtocolProfile {
            auth_header_name: "Authorization".into(),
            auth_header_format: "Bearer {secret}".into(),
            ..Default::default()
        };
        assert_eq!(
            auth_header(&p, "s3"),
            Some(("Authorization".to_string(), "Bearer s3".to_string()))
        );
        p.auth_header_name = "x-api-key".into();
        p.auth_header_format = String::new();
        assert_eq!(
            auth_header(&p, "s3"),
            Some(("x-api-key".to_string(), "s3".to_string()))
        );
        p.auth_header_name = String::new();
        assert_eq!(auth_header(&p, "s3"), None);
    }

    fn feed(s: &mut ChatStream, events: &[&str]) -> Vec<RunOutput> {
        events.iter().flat_map(|e| s.on_data(e)).collect()
    }

    // CONTRACT: E1 — content deltas, then one complete with the finish
    // reason and the usage chunk's figures; nothing after it.
    #[test]
    fn text_stream_maps_to_deltas_and_complete() {
        let mut s = ChatStream::new(false);
        assert_eq!(
            s.start(),
            RunOutput::Start {
                metadata: HashMap::new()
            }
        );
        let out = feed(
            &mut s,
            &[
                r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#,
                r#"{"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}"#,
                r#"{"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}"#,
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#,
                r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}"#,
                "[DONE]",
                r#"{"choices":[{"index":0,"delta":{"content":"late"}}]}"#,
            ],
        );
        assert_eq!(
            out,
            vec![
                RunOutput::Delta {
                    text: "Hel".into(),
                    usage: None
                },
                RunOutput::Delta {
                    text: "lo".into(),
                    usage: None
                },
                RunOutput::Progress,
                RunOutput::Complete {
                    finish_reason: "length".into(),
                    usage: Some(pb::Usage {
                        prompt_tokens: 4,
                        completion_tokens: 2,
                        total_tokens: 6
                    }),
                    metadata: HashMap::new(),
                },
            ]
        );
    }

    // CONTRACT: E4 — native tool-call deltas (index on every delta, id and
    // name only in the first) are assembled into openai_tool_calls on
    // complete.
    #[test]
    fn tool_call_deltas_are_assembled() {
        let mut s = ChatStream::new(false);
        let out = feed(
            &mut s,
            &[
                r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"get_weather","arguments":""}}]}}]}"#,
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}}]}"#,
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"lookup","arguments":"{}"}}]}}]}"#,
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Seoul\"}"}}]}}]}"#,
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
                "[DONE]",
            ],
        );
        assert_eq!(out.len(), 5);
        assert!(
            out[..4].iter().all(|o| *o == RunOutput::Progress),
            "{out:?}"
        );
        let Some(RunOutput::Complete {
            finish_reason,
            metadata,
            ..
        }) = out.last()
        else {
            panic!("expected complete, got {out:?}");
        };
        assert_eq!(finish_reason, "tool_calls");
        assert_eq!(
            metadata["openai_tool_calls"],
            r#"[{"id":"call_a","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\"}"}},{"id":"call_b","type":"function","function":{"name":"lookup","arguments":"{}"}}]"#
        );
        assert!(!metadata.contains_key("openai_text_tool_fallback"));
    }

    // CONTRACT: E5 — a fallback run says so on start and on complete, and
    // its text is passed through unparsed (the Edge parses it).
    #[test]
    fn fallback_runs_are_flagged_on_start_and_complete() {
        let mut s = ChatStream::new(true);
        let flag = HashMap::from([("openai_text_tool_fallback".to_string(), "true".to_string())]);
        assert_eq!(
            s.start(),
            RunOutput::Start {
                metadata: flag.clone()
            }
        );
        let out = feed(
            &mut s,
            &[
                r#"{"choices":[{"index":0,"delta":{"content":"<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>"}}]}"#,
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
                "[DONE]",
            ],
        );
        assert_eq!(
            out,
            vec![
                RunOutput::Delta {
                    text: r#"<tool_call>{"name":"f","arguments":{}}</tool_call>"#.into(),
                    usage: None
                },
                RunOutput::Complete {
                    finish_reason: "stop".into(),
                    usage: None,
                    metadata: flag,
                },
            ]
        );
    }

    // CONTRACT: W6 — an error event, a malformed event or a stream that
    // breaks off before finishing is an error terminal.
    #[test]
    fn errors_end_the_run() {
        let mut s = ChatStream::new(false);
        assert_eq!(
            s.on_data(r#"{"error":{"message":"overloaded","type":"server_error"}}"#),
            vec![RunOutput::Failed {
                code: codes::PROVIDER_ERROR,
                message: "provider: overloaded".into()
            }]
        );
        assert!(s.on_data("[DONE]").is_empty());
        let mut s = ChatStream::new(false);
        assert!(matches!(
            &s.on_data("{oops")[..],
            [RunOutput::Failed { .. }]
        ));
        let mut s = ChatStream::new(false);
        s.on_data(r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#);
        assert_eq!(
            s.on_end(),
            vec![RunOutput::Failed {
                code: codes::PROVIDER_ERROR,
                message: "provider: the stream ended before it finished".into()
            }]
        );
        let mut s = ChatStream::new(false);
        s.on_data(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#);
        assert!(matches!(&s.on_end()[..], [RunOutput::Complete { .. }]));
    }

    #[test]
    fn a_non_streamed_completion_is_delta_and_complete() {
        let mut s = ChatStream::new(false);
        let out = s.on_json_body(
            br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#,
        );
        assert_eq!(
            out[0],
            RunOutput::Delta {
                text: "hi".into(),
                usage: None
            }
        );
        let RunOutput::Complete {
            finish_reason,
            usage,
            metadata,
        } = &out[1]
        else {
            panic!("{out:?}")
        };
        assert_eq!(finish_reason, "tool_calls");
        assert_eq!(usage.map(|u| u.total_tokens), Some(3));
        assert_eq!(
            metadata["openai_tool_calls"],
            r#"[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]"#
        );
    }
}
