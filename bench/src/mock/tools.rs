//! Tool-calling modes of the mock (off by default, [`MockModes`]):
//!
//! - `tool_calls`: a chat completion (and an Ollama `/api/chat`) that
//!   carries a non-empty `tools` array is answered with one native tool
//!   call instead of text.
//! - `reject_tools`: a chat completion that carries a non-empty `tools`
//!   array is answered `400` (param `tools`), as servers without tool
//!   support do; a retry without `tools` whose leading system message lists
//!   the tools between `<tools>` and `</tools>` (one JSON tool per line, the
//!   Hermes/Qwen convention the Node's text tool-call instruction uses) is
//!   answered with text holding one
//!   `<tool_call>{"name":..,"arguments":{..}}</tool_call>` block.
//!
//! # The deterministic tool call
//!
//! The mock calls the tool that `tool_choice` names
//! (`{"type":"function","function":{"name":..}}`), else the first tool. Its
//! arguments have one entry per property of the tool's
//! `parameters.properties`, in schema order; the value of the property at
//! position `i` is `"tok<i>"` for type `string`, `i` for `integer` and
//! `number`, `true` for `boolean` and `null` otherwise. A tool call counts
//! as one completion token.
//!
//! # OpenAI tool-call stream
//!
//! ```text
//! data: {delta: {role, content:null, tool_calls:[{index:0, id, type, function:{name, arguments:""}}]}}
//! data: {delta: {tool_calls:[{index:0, function:{arguments:"<8 chars>"}}]}}   per piece
//! data: {delta: {}, finish_reason: "tool_calls"}
//! data: {choices: [], usage}                                                (include_usage only)
//! data: [DONE]
//! ```
//!
//! `index` is on every tool-call delta; `id`, `type` and `function.name` only
//! on the first, as the OpenAI API sends them.

use serde_json::{json, Map, Value};

use super::openai::{word_count, MockConfig, Usage, CREATED_UNIX_S, DONE_EVENT};
use super::script::{self, Script};

/// Characters of tool-call arguments (or fallback text) per streamed piece.
pub const PIECE_CHARS: usize = 8;

/// The text that opens a text tool call (E5 fallback format).
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// The text that closes a text tool call.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// Tool-calling modes; `Default` is both off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MockModes {
    /// Answer requests with `tools` with a native tool call.
    pub tool_calls: bool,
    /// Reject `tools` with 400 and answer the text-instruction retry with a
    /// `<tool_call>` block.
    pub reject_tools: bool,
}

/// The tool call the mock makes.
#[derive(Debug, Clone, PartialEq)]
pub struct MockToolCall {
    /// Function name.
    pub name: String,
    /// Arguments object (see the module docs).
    pub arguments: Map<String, Value>,
}

impl MockToolCall {
    /// The arguments as the JSON string OpenAI sends.
    pub fn arguments_json(&self) -> String {
        Value::Object(self.arguments.clone()).to_string()
    }

    /// The text tool call: `<tool_call>{"name":..,"arguments":{..}}</tool_call>`.
    pub fn text(&self) -> String {
        let inner = json!({"name": self.name, "arguments": Value::Object(self.arguments.clone())});
        format!("{TOOL_CALL_OPEN}{inner}{TOOL_CALL_CLOSE}")
    }
}

/// The non-empty `tools` array of a request body, if any.
pub fn request_tools(body: &Value) -> Option<&Vec<Value>> {
    body.get("tools")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
}

/// The call the mock makes for `tools` (see the module docs); `None` when
/// no tool has a function name.
pub fn choose_tool(tools: &[Value], tool_choice: Option<&Value>) -> Option<MockToolCall> {
    let function = |t: &Value| t.get("function").cloned().unwrap_or_else(|| t.clone());
    let named = tool_choice
        .and_then(|c| c.get("function"))
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str);
    let chosen = tools
        .iter()
        .map(function)
        .filter(|f| f.get("name").and_then(Value::as_str).is_some())
        .find(|f| named.is_none() || f.get("name").and_then(Value::as_str) == named)?;
    let name = chosen.get("name")?.as_str()?.to_string();
    let mut arguments = Map::new();
    let properties = chosen
        .get("parameters")
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object);
    for (i, (key, schema)) in properties.into_iter().flatten().enumerate() {
        let value = match schema.get("type").and_then(Value::as_str) {
            Some("string") => json!(format!("tok{i}")),
            Some("integer") | Some("number") => json!(i),
            Some("boolean") => json!(true),
            _ => Value::Null,
        };
        arguments.insert(key.clone(), value);
    }
    Some(MockToolCall { name, arguments })
}

/// The tools listed in the leading system message between `<tools>` and
/// `</tools>`, one JSON object per non-blank line; `None` without such a
/// block or when a line is not JSON.
pub fn instructed_tools(body: &Value) -> Option<Vec<Value>> {
    let first = body.get("messages")?.as_array()?.first()?;
    if first.get("role").and_then(Value::as_str) != Some("system") {
        return None;
    }
    let content = first.get("content")?.as_str()?;
    // The first non-empty block: prose may mention `<tools></tools>` first.
    let block = content.match_indices("<tools>").find_map(|(at, open)| {
        let start = at + open.len();
        let end = start + content[start..].find("</tools>")?;
        let inner = content[start..end].trim();
        (!inner.is_empty()).then_some(inner)
    })?;
    block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// What the tool modes make of a chat request.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolDecision {
    /// `reject_tools` and the request has tools: answer 400.
    Reject,
    /// `tool_calls` and the request has tools: answer with this native call.
    Call(MockToolCall),
    /// `reject_tools`, no tools, and the system message lists them: answer
    /// with this text (one `<tool_call>` block).
    Text(String),
}

/// The tool modes' decision for a chat request `body`; `None` means answer
/// as usual.
pub fn decide(modes: MockModes, body: &Value) -> Option<ToolDecision> {
    let choice = body.get("tool_choice");
    match request_tools(body) {
        Some(_) if modes.reject_tools => Some(ToolDecision::Reject),
        Some(tools) if modes.tool_calls => choose_tool(tools, choice).map(ToolDecision::Call),
        Some(_) => None,
        None if modes.reject_tools => {
            let tools = instructed_tools(body)?;
            choose_tool(&tools, None).map(|call| ToolDecision::Text(call.text()))
        }
        None => None,
    }
}

/// The 400 a server without tool support answers.
pub fn rejection_body() -> String {
    json!({"error": {
        "message": "tools are not supported by this server (start it with tool calling enabled)",
        "type": "invalid_request_error",
        "param": "tools",
        "code": null,
    }})
    .to_string()
}

/// Identity and options of one OpenAI chat reply the tool modes build.
#[derive(Debug, Clone)]
pub struct ChatReplyCtx<'a> {
    /// `chatcmpl-mock-<seq>`.
    pub id: String,
    /// `call_mock_<seq>`.
    pub call_id: String,
    /// The request's model, echoed.
    pub model: &'a str,
    /// Words in the request messages.
    pub prompt_tokens: u64,
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

impl ChatReplyCtx<'_> {
    fn usage(&self, completion_tokens: u64) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens.saturating_add(completion_tokens),
        }
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> String {
        let mut obj = Map::new();
        obj.insert("id".into(), json!(self.id));
        obj.insert("object".into(), json!("chat.completion.chunk"));
        obj.insert("created".into(), json!(CREATED_UNIX_S));
        obj.insert("model".into(), json!(self.model));
        obj.insert("choices".into(), choices);
        if self.include_usage {
            obj.insert("usage".into(), usage.unwrap_or(Value::Null));
        }
        format!("data: {}\n\n", Value::Object(obj))
    }

    fn delta(&self, delta: Value, finish_reason: Option<&str>) -> String {
        self.chunk(
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]),
            None,
        )
    }

    fn tail(&self, finish_reason: &str, completion_tokens: u64) -> Vec<String> {
        let mut tail = vec![self.delta(json!({}), Some(finish_reason))];
        if self.include_usage {
            let usage = serde_json::to_value(self.usage(completion_tokens)).unwrap_or(Value::Null);
            tail.push(self.chunk(json!([]), Some(usage)));
        }
        tail.push(DONE_EVENT.to_string());
        tail
    }

    fn completion(&self, message: Value, finish_reason: &str, completion_tokens: u64) -> String {
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": CREATED_UNIX_S,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": null,
                "finish_reason": finish_reason,
            }],
            "usage": self.usage(completion_tokens),
        })
        .to_string()
    }

    /// The native tool-call reply (see the module docs).
    pub fn tool_call_reply(&self, call: &MockToolCall, config: &MockConfig) -> Script {
        let arguments = call.arguments_json();
        if !self.stream {
            let message = json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{
                    "id": self.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }],
            });
            let delay_ms = config.ttft_ms;
            return Script::json(200, delay_ms, self.completion(message, "tool_calls", 1));
        }
        let head = vec![self.delta(
            json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{
                    "index": 0,
                    "id": self.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }],
            }),
            None,
        )];
        let pieces = script::pieces(&arguments, PIECE_CHARS)
            .into_iter()
            .map(|p| {
                self.delta(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}),
                    None,
                )
            })
            .collect();
        let steps = script::paced(
            head,
            pieces,
            self.tail("tool_calls", 1),
            config,
            &Default::default(),
        );
        Script::stream(script::SSE, steps)
    }

    /// A text reply of `text` (the fallback answer), streamed in pieces of
    /// [`PIECE_CHARS`], finish reason `stop`; one completion token per piece.
    pub fn text_reply(&self, text: &str, config: &MockConfig) -> Script {
        let pieces = script::pieces(text, PIECE_CHARS);
        let tokens = pieces.len() as u64;
        if !self.stream {
            let message = json!({"role": "assistant", "content": text});
            return Script::json(
                200,
                config.ttft_ms,
                self.completion(message, "stop", tokens),
            );
        }
        let head = vec![self.delta(json!({"role": "assistant", "content": ""}), None)];
        let events = pieces
            .into_iter()
            .map(|p| self.delta(json!({"content": p}), None))
            .collect();
        let steps = script::paced(
            head,
            events,
            self.tail("stop", tokens),
            config,
            &Default::default(),
        );
        Script::stream(script::SSE, steps)
    }
}

/// Words in the text of every message of an OpenAI/Ollama chat body (the
/// mock's prompt token count).
pub fn prompt_words(body: &Value) -> u64 {
    body.get("messages")
        .and_then(Value::as_array)
        .map(|msgs| msgs.iter().map(|m| content_words(m.get("content"))).sum())
        .unwrap_or(0)
}

/// Words of a message `content`: a string, or the `text` of each part.
pub fn content_words(content: Option<&Value>) -> u64 {
    match content {
        Some(Value::String(text)) => word_count(text),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(word_count)
            .sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::openai::StreamStep;

    fn weather_tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "extra": {"type": "object"}
                }}
            }}),
            json!({"type": "function", "function": {"name": "lookup", "parameters": {
                "type": "object", "properties": {"q": {"type": "string"}}
            }}}),
        ]
    }

    #[test]
    fn the_tool_call_is_deterministic() {
        let call = choose_tool(&weather_tools(), None).unwrap();
        assert_eq!(call.name, "get_weather");
        assert_eq!(
            call.arguments_json(),
            r#"{"city":"tok0","days":1,"metric":true,"extra":null}"#
        );
        assert_eq!(
            call.text(),
            r#"<tool_call>{"name":"get_weather","arguments":{"city":"tok0","days":1,"metric":true,"extra":null}}</tool_call>"#
        );
        let named = json!({"type": "function", "function": {"name": "lookup"}});
        let call = choose_tool(&weather_tools(), Some(&named)).unwrap();
        assert_eq!(call.name, "lookup");
        assert_eq!(call.arguments_json(), r#"{"q":"tok0"}"#);
        assert!(choose_tool(&[json!({"type": "function"})], None).is_none());
    }

    #[test]
    fn decisions_follow_the_modes() {
        let with_tools = json!({"messages": [], "tools": weather_tools()});
        let both_off = MockModes::default();
        let calls = MockModes {
            tool_calls: true,
            ..MockModes::default()
        };
        let reject = MockModes {
            reject_tools: true,
            ..MockModes::default()
        };
        assert_eq!(decide(both_off, &with_tools), None);
        assert!(matches!(
            decide(calls, &with_tools),
            Some(ToolDecision::Call(c)) if c.name == "get_weather"
        ));
        assert_eq!(decide(reject, &with_tools), Some(ToolDecision::Reject));
        let retry = json!({"messages": [
            {"role": "system", "content": "<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"lookup\",\"parameters\":{\"properties\":{\"q\":{\"type\":\"string\"}}}}}\n</tools>"},
            {"role": "user", "content": "hi"}
        ]});
        assert_eq!(
            decide(reject, &retry),
            Some(ToolDecision::Text(
                r#"<tool_call>{"name":"lookup","arguments":{"q":"tok0"}}</tool_call>"#.into()
            ))
        );
        assert_eq!(decide(calls, &retry), None);
        let empty_tools = json!({"messages": [], "tools": []});
        assert_eq!(decide(reject, &empty_tools), None);
    }

    #[test]
    fn instructed_tools_are_read_from_the_system_message() {
        let body = json!({"messages": [
            {"role": "system", "content": "Be brief. Signatures are within <tools></tools> tags:\n<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"lookup\"}}\n</tools>\nmore"},
            {"role": "user", "content": "hi"}
        ]});
        let tools = instructed_tools(&body).unwrap();
        assert_eq!(
            tools,
            vec![json!({"type": "function", "function": {"name": "lookup"}})]
        );
        let no_block = json!({"messages": [{"role": "system", "content": "plain"}]});
        assert!(instructed_tools(&no_block).is_none());
        let not_first = json!({"messages": [{"role": "user", "content": "<tools>\n{}\n</tools>"}]});
        assert!(instructed_tools(&not_first).is_none());
    }

    fn ctx(stream: bool, include_usage: bool) -> ChatReplyCtx<'static> {
        ChatReplyCtx {
            id: "chatcmpl-mock-1".into(),
            call_id: "call_mock_1".into(),
            model: "m",
            prompt_tokens: 2,
            stream,
            include_usage,
        }
    }

    fn config() -> MockConfig {
        MockConfig {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens: 3,
            models: vec!["m".into()],
        }
    }

    #[test]
    fn streamed_tool_call_is_exact() {
        let call = MockToolCall {
            name: "f".into(),
            arguments: serde_json::from_str(r#"{"city":"tok0"}"#).unwrap(),
        };
        let script = ctx(true, true).tool_call_reply(&call, &config());
        assert!(script.chunked);
        let head = r#""id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m""#;
        let expected: Vec<StreamStep> = [
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":null,"tool_calls":[{{"index":0,"id":"call_mock_1","type":"function","function":{{"name":"f","arguments":""}}}}]}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"function":{{"arguments":"{{\"city\":"}}}}]}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"function":{{"arguments":"\"tok0\"}}"}}}}]}},"logprobs":null,"finish_reason":null}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"tool_calls"}}],"usage":null}}"#),
            format!(r#"data: {{{head},"choices":[],"usage":{{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}}}"#),
        ]
        .into_iter()
        .map(|e| StreamStep::Event(e + "\n\n"))
        .chain([StreamStep::Event(DONE_EVENT.into())])
        .collect();
        assert_eq!(script.steps, expected);
    }

    #[test]
    fn plain_tool_call_and_text_replies() {
        let call = MockToolCall {
            name: "f".into(),
            arguments: Map::new(),
        };
        let script = ctx(false, false).tool_call_reply(&call, &config());
        assert!(!script.chunked);
        assert_eq!(
            script.body(),
            r#"{"id":"chatcmpl-mock-1","object":"chat.completion","created":1700000000,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_mock_1","type":"function","function":{"name":"f","arguments":"{}"}}]},"logprobs":null,"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}"#
        );
        let text = ctx(true, false).text_reply("0123456789", &config());
        let body = text.body();
        assert!(body.contains(r#""delta":{"content":"01234567"}"#), "{body}");
        assert!(body.contains(r#""delta":{"content":"89"}"#), "{body}");
        assert!(body.ends_with(DONE_EVENT));
    }
}
