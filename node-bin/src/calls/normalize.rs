//! What the normalized-run adapters share: mapping the normalized input
//! (E3) into provider JSON, reading provider errors and usage, and relaying
//! a streamed body through a framing (NDJSON lines or SSE events) and an
//! adapter's [`ItemParser`] into [`RunOutput`]s.

use std::collections::HashMap;
use std::rc::Rc;

use bytes::Bytes;
use iop_engine::http::{HttpError, NdjsonSplitter, ResponseHead, SseSplitter};
use iop_wire::pb;
use serde_json::Value;

use super::channel::OutputTx;
use super::output::RunOutput;
use super::pool::{PooledConn, ProviderPool, ProviderRequest};
use crate::adapters::Endpoint;
use crate::codes;

/// Metadata key of native tool calls on `complete` (E4): a JSON array of
/// OpenAI tool calls, `arguments` as JSON strings.
pub const META_TOOL_CALLS: &str = "openai_tool_calls";
/// Metadata key set to `"true"` on `start` and `complete` when the adapter
/// fell back to text tool calls (E5).
pub const META_TEXT_TOOL_FALLBACK: &str = "openai_text_tool_fallback";
/// Metadata key of Ollama's raw `done_reason` on `complete`.
pub const META_DONE_REASON: &str = "done_reason";

/// Largest provider error body read (the rest is not needed for a message).
pub const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;
/// Largest non-streamed provider answer read.
pub const MAX_JSON_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Longest NDJSON line or SSE event accepted from a provider.
pub const MAX_EVENT_BYTES: usize = 1024 * 1024;

/// Why a normalized input cannot become a provider request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// A JSON field of the input (`tools_json`, `tool_choice_json`,
    /// `tool_calls_json`) is not valid JSON.
    #[error("`{field}` is not valid JSON: {reason}")]
    BadJson {
        /// The input field.
        field: &'static str,
        /// Parser message.
        reason: String,
    },
    /// `tools_json` is not a JSON array.
    #[error("`tools_json` must be a JSON array")]
    ToolsNotArray,
    /// An embeddings run with no text to embed.
    #[error("an embeddings run needs at least one input")]
    NoEmbedInput,
    /// An assistant `tool_calls_json` entry is not an OpenAI tool call.
    #[error("message {index}: tool call {call} has no function name")]
    BadToolCall {
        /// Message index.
        index: usize,
        /// Call index within the message.
        call: usize,
    },
    /// A tool call's `arguments` is not a JSON object (Ollama needs one).
    #[error("message {index}: tool call {call}: arguments must be a JSON object")]
    ToolArguments {
        /// Message index.
        index: usize,
        /// Call index within the message.
        call: usize,
    },
}

/// Parses an optional JSON input field (empty bytes: absent).
pub fn json_field(field: &'static str, bytes: &Bytes) -> Result<Option<Value>, InputError> {
    if bytes.is_empty() {
        return Ok(None);
    }
    serde_json::from_slice(bytes)
        .map(Some)
        .map_err(|e| InputError::BadJson {
            field,
            reason: e.to_string(),
        })
}

/// The input's tools (a non-empty JSON array), if any.
pub fn tools(input: &pb::RunInput) -> Result<Option<Vec<Value>>, InputError> {
    match json_field("tools_json", &input.tools_json)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(tools)) if tools.is_empty() => Ok(None),
        Some(Value::Array(tools)) => Ok(Some(tools)),
        Some(_) => Err(InputError::ToolsNotArray),
    }
}

/// A tool call normalized to the OpenAI shape of `openai_tool_calls` (E4):
/// `{"id","type":"function","function":{"name","arguments":"<JSON string>"}}`.
pub fn openai_tool_call(id: &str, name: &str, arguments: &str) -> Value {
    serde_json::json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// `complete` metadata carrying `calls` as `openai_tool_calls` (E4); no key
/// when there are none.
pub fn tool_calls_metadata(calls: Vec<Value>, metadata: &mut HashMap<String, String>) {
    if !calls.is_empty() {
        metadata.insert(META_TOOL_CALLS.to_string(), Value::Array(calls).to_string());
    }
}

/// Maps a provider `Usage`-like triple; `total` 0 means "not reported".
pub fn usage(prompt_tokens: u64, completion_tokens: u64, total_tokens: u64) -> pb::Usage {
    pb::Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: if total_tokens == 0 {
            prompt_tokens.saturating_add(completion_tokens)
        } else {
            total_tokens
        },
    }
}

/// The legacy error string of a provider's non-2xx answer: the status and
/// the message of an OpenAI (`{"error":{"message"}}`), Ollama
/// (`{"error":"..."}`) or plain-text body, bounded.
pub fn status_message(provider: &str, status: u16, body: &[u8]) -> String {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let message = parsed.as_ref().and_then(|v| match v.get("error") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(e) => e.get("message").and_then(Value::as_str).map(str::to_string),
        None => v.get("message").and_then(Value::as_str).map(str::to_string),
    });
    let message = message.unwrap_or_else(|| {
        let text = String::from_utf8_lossy(body);
        text.chars().take(512).collect::<String>()
    });
    if message.is_empty() {
        format!("{provider}: HTTP {status}")
    } else {
        format!("{provider}: HTTP {status}: {message}")
    }
}

/// A failed provider exchange: the terminal's failure code and message (W6).
pub type CallFailure = (&'static str, String);

/// An open provider exchange: the connection with its response head read.
pub struct Exchange {
    /// The connection, positioned at the response body; back to the pool
    /// with `release` (body read to its end) or `finish` (content ended,
    /// rest of the body drained), closed when dropped.
    pub client: PooledConn,
    /// The response head.
    pub head: ResponseHead,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange")
            .field("status", &self.head.status)
            .finish_non_exhaustive()
    }
}

impl Exchange {
    /// Whether the response's `content-type` starts with `prefix`.
    pub fn content_type_is(&self, prefix: &[u8]) -> bool {
        self.head.header("content-type").is_some_and(|v| {
            v.len() >= prefix.len() && v[..prefix.len()].eq_ignore_ascii_case(prefix)
        })
    }

    /// Reads the rest of the body, at most `max_bytes`.
    pub async fn body(&mut self, max_bytes: usize) -> Result<Bytes, CallFailure> {
        self.client
            .read_body_to_end(max_bytes)
            .await
            .map_err(provider_failure)
    }
}

/// How a streamed provider body is split into items: NDJSON lines (Ollama)
/// or the `data:` of SSE events (OpenAI-compatible servers).
#[derive(Debug)]
pub enum Framing {
    /// One JSON document per line.
    Ndjson(NdjsonSplitter),
    /// Server-sent events; events without `data` are skipped.
    Sse(SseSplitter),
}

impl Framing {
    fn feed(&mut self, bytes: &[u8]) {
        match self {
            Framing::Ndjson(s) => s.feed(bytes),
            Framing::Sse(s) => s.feed(bytes),
        }
    }

    fn finish(&mut self) {
        match self {
            Framing::Ndjson(s) => s.finish(),
            Framing::Sse(s) => s.finish(),
        }
    }

    fn next_item(&mut self) -> Result<Option<Bytes>, HttpError> {
        match self {
            Framing::Ndjson(s) => s.next_line(),
            Framing::Sse(s) => loop {
                match s.next_event()? {
                    None => return Ok(None),
                    Some(event) => match event.data {
                        Some(data) => return Ok(Some(Bytes::from(data))),
                        None => continue,
                    },
                }
            },
        }
    }
}

/// A provider stream parser fed one framed item at a time.
pub trait ItemParser {
    /// Outputs for one item (a line or an event's data).
    fn on_item(&mut self, item: &[u8]) -> Vec<RunOutput>;
    /// Whether the provider's stream reached its own end marker.
    fn is_ended(&self) -> bool;
    /// Outputs when the body ended without the end marker.
    fn on_end(&mut self) -> Vec<RunOutput>;
}

impl Exchange {
    /// Relays a streamed body through `framing` and `parser` to `out` until
    /// the parser's end marker (then the rest of the body is drained, bounded,
    /// and the connection returns to the pool) or the end of the body.
    pub async fn relay_items(
        mut self,
        mut framing: Framing,
        parser: &mut impl ItemParser,
        out: &OutputTx<RunOutput>,
    ) -> Result<(), CallFailure> {
        loop {
            let piece = self
                .client
                .read_body_chunk()
                .await
                .map_err(provider_failure)?;
            match &piece {
                Some(bytes) => framing.feed(bytes),
                None => framing.finish(),
            }
            while let Some(item) = framing.next_item().map_err(provider_failure)? {
                for output in parser.on_item(&item) {
                    if !out.send(output).await {
                        return Ok(());
                    }
                }
                if parser.is_ended() {
                    // provider pool: the terminal is out; drain what is left
                    // of the body (bounded) and return the connection.
                    self.client.finish().await;
                    return Ok(());
                }
            }
            if piece.is_none() {
                // provider pool: the body ended.
                self.client.release();
                for output in parser.on_end() {
                    out.send(output).await;
                }
                return Ok(());
            }
        }
    }
}

/// Opens `POST path` with a JSON `body` on a pooled (or new) connection to
/// the adapter's provider and reads the response head. `extra` headers are
/// added as given (the credential hook of C2 goes here).
pub async fn post_json(
    pool: &Rc<ProviderPool>,
    adapter: &Endpoint,
    path: &str,
    accept: &str,
    extra: &[(String, String)],
    body: Bytes,
) -> Result<Exchange, CallFailure> {
    let headers: Vec<(&str, &[u8])> = [
        ("content-type", &b"application/json"[..]),
        ("accept", accept.as_bytes()),
    ]
    .into_iter()
    .chain(extra.iter().map(|(k, v)| (k.as_str(), v.as_bytes())))
    .collect();
    let request = ProviderRequest {
        method: "POST",
        target: path,
        headers: &headers,
        body,
    };
    let response = pool
        .send(adapter.target(), &request, None)
        .await
        .map_err(|e| e.into_failure())?;
    Ok(Exchange {
        client: response.conn,
        head: response.head,
    })
}

/// A provider HTTP failure as a terminal code and message (W6).
pub fn provider_failure(e: HttpError) -> CallFailure {
    (codes::PROVIDER_ERROR, format!("provider: {e}"))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_and_json_fields() {
        let mut input = pb::RunInput::default();
        assert_eq!(tools(&input), Ok(None));
        input.tools_json = Bytes::from_static(b"[]");
        assert_eq!(tools(&input), Ok(None));
        input.tools_json = Bytes::from_static(br#"[{"type":"function"}]"#);
        assert_eq!(tools(&input).unwrap().unwrap().len(), 1);
        input.tools_json = Bytes::from_static(b"{}");
        assert_eq!(tools(&input), Err(InputError::ToolsNotArray));
        input.tools_json = Bytes::from_static(b"[");
        assert!(matches!(
            tools(&input),
            Err(InputError::BadJson {
                field: "tools_json",
                ..
            })
        ));
    }

    #[test]
    fn status_messages_read_every_error_shape() {
        assert_eq!(
            status_message(
                "vllm",
                400,
                br#"{"error":{"message":"bad tools","type":"invalid_request_error"}}"#
            ),
            "vllm: HTTP 400: bad tools"
        );
        assert_eq!(
            status_message("ollama", 404, br#"{"error":"model \"x\" not found"}"#),
            "ollama: HTTP 404: model \"x\" not found"
        );
        assert_eq!(
            status_message("p", 502, b"Bad Gateway"),
            "p: HTTP 502: Bad Gateway"
        );
        assert_eq!(status_message("p", 500, b""), "p: HTTP 500");
    }

    #[test]
    fn usage_fills_a_missing_total() {
        assert_eq!(usage(3, 4, 0).total_tokens, 7);
        assert_eq!(usage(3, 4, 9).total_tokens, 9);
    }
}
