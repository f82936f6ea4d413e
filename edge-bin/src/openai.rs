//! The OpenAI-compatible client surface, pure parts: error shapes, request
//! preparation (external `model` → provider target, E2/U5), the models list,
//! and the SSE error event that ends a failed stream.
//!
//! Surface translation lives here, never in transport handlers (X4).

use bytes::Bytes;
use iop_wire::pb;
use serde_json::{json, Map, Value};

/// Which client API a route speaks; decides the error shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// OpenAI: `{"error":{"message","type","param","code"}}`.
    OpenAi,
    /// Anthropic Messages: `{"type":"error","error":{"type","message"}}`.
    Anthropic,
}

/// An error in the OpenAI error shape
/// `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// The offending request parameter, if any.
    pub param: Option<&'static str>,
    /// Machine-readable `code`, if any.
    pub code: Option<String>,
    /// Seconds for a `retry-after` header, if any.
    pub retry_after_sec: Option<u32>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_sec: None,
        }
    }

    /// 400: the request is not valid (malformed JSON, missing fields).
    pub fn invalid_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            param,
            ..Self::new(400, "invalid_request_error", message)
        }
    }

    /// 404: the requested model is not served here (E2).
    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model"),
            code: Some("model_not_found".into()),
            ..Self::new(
                404,
                "invalid_request_error",
                format!("The model `{model}` does not exist or you do not have access to it."),
            )
        }
    }

    /// 503: no provider of the model is ready.
    pub fn no_provider(model: &str) -> Self {
        Self {
            code: Some("no_provider_available".into()),
            retry_after_sec: Some(1),
            ..Self::new(
                503,
                "service_unavailable_error",
                format!("No provider for model `{model}` is available right now; retry shortly."),
            )
        }
    }

    /// 429: the model's queue is full.
    pub fn queue_full(model: &str) -> Self {
        Self {
            code: Some("queue_full".into()),
            retry_after_sec: Some(1),
            ..Self::new(
                429,
                "rate_limit_error",
                format!("Too many requests are waiting for model `{model}`; retry shortly."),
            )
        }
    }

    /// 413: the request body exceeds the configured limit.
    pub fn body_too_large(limit_bytes: usize) -> Self {
        Self {
            code: Some("request_too_large".into()),
            ..Self::new(
                413,
                "invalid_request_error",
                format!("Request body exceeds the limit of {limit_bytes} bytes."),
            )
        }
    }

    /// 408: the request head or body stalled past its deadline.
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self {
            code: Some("request_timeout".into()),
            ..Self::new(408, "invalid_request_error", message)
        }
    }

    /// 404: unknown route.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        Self {
            code: Some("unknown_url".into()),
            ..Self::new(
                404,
                "invalid_request_error",
                format!("Unknown request URL: {method} {path}."),
            )
        }
    }

    /// 405: known route, wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            405,
            "invalid_request_error",
            format!("Method {method} is not allowed for {path}."),
        )
    }

    /// 502: the provider or the node failed before a response started.
    pub fn upstream(message: impl Into<String>, code: Option<String>) -> Self {
        Self {
            code,
            ..Self::new(502, "upstream_error", message)
        }
    }

    /// 504: the provider stalled or timed out before a response started.
    pub fn upstream_timeout(message: impl Into<String>, code: Option<String>) -> Self {
        Self {
            code,
            ..Self::new(504, "upstream_error", message)
        }
    }

    /// An error from a malformed HTTP request, mapped from its status.
    pub fn from_http_status(status: u16, message: impl Into<String>) -> Self {
        match status {
            413 => Self::new(413, "invalid_request_error", message),
            _ => Self::new(status, "invalid_request_error", message),
        }
    }

    /// The JSON body `{"error":{...}}`.
    pub fn body_json(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// The JSON body as bytes.
    pub fn body_bytes(&self) -> Bytes {
        Bytes::from(self.body_json().to_string())
    }

    /// The Anthropic error `type` for this error's status.
    pub fn anthropic_type(&self) -> &'static str {
        match self.status {
            400 | 405 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            408 => "timeout_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// The JSON body in the shape of `surface`.
    pub fn body_for(&self, surface: Surface) -> Bytes {
        match surface {
            Surface::OpenAi => self.body_bytes(),
            Surface::Anthropic => Bytes::from(
                json!({
                    "type": "error",
                    "error": {"type": self.anthropic_type(), "message": self.message},
                })
                .to_string(),
            ),
        }
    }

    /// The SSE event that reports this error inside an already-started
    /// stream, followed by `data: [DONE]`.
    pub fn sse_event(&self) -> Bytes {
        sse_error_event(&self.message, self.kind, self.code.as_deref())
    }
}

/// The SSE event that ends a started stream with an error, in the shape of
/// `surface`: OpenAI `data: {"error":{...}}` then `data: [DONE]`; Anthropic
/// `event: error` with `{"type":"error","error":{...}}`.
pub fn sse_error_event_for(surface: Surface, message: &str, code: &str) -> Bytes {
    match surface {
        Surface::OpenAi => sse_error_event(message, "upstream_error", Some(code)),
        Surface::Anthropic => {
            let event = json!({
                "type": "error",
                "error": {"type": "api_error", "message": format!("{message} ({code})")},
            });
            Bytes::from(format!("event: error\ndata: {event}\n\n"))
        }
    }
}

/// `data: {"error":{...}}\n\ndata: [DONE]\n\n` — how an OpenAI stream reports
/// a failure after the response started.
pub fn sse_error_event(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    let event = json!({
        "error": {
            "message": message,
            "type": kind,
            "param": Value::Null,
            "code": code,
        }
    });
    Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n"))
}

/// A parsed chat completion request, ready to be rebuilt for a provider.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// The external model the client asked for (E2).
    pub model: String,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The whole request object, field order preserved.
    body: Map<String, Value>,
}

impl ChatRequest {
    /// Parses a `/v1/chat/completions` body. Only what the Edge needs is
    /// checked; every other field passes through unchanged.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let body = parse_json_object(body)?;
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            Some(_) => {
                return Err(ApiError::invalid_request(
                    "`model` must be a non-empty string.",
                    Some("model"),
                ))
            }
            None => {
                return Err(ApiError::invalid_request(
                    "You must provide a `model` parameter.",
                    Some("model"),
                ))
            }
        };
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::invalid_request(
                    "`stream` must be a boolean.",
                    Some("stream"),
                ))
            }
        };
        if !matches!(body.get("messages"), Some(Value::Array(_))) {
            return Err(ApiError::invalid_request(
                "`messages` must be an array.",
                Some("messages"),
            ));
        }
        Ok(Self {
            model,
            stream,
            body,
        })
    }

    /// Whether the client asked for a usage chunk (`stream_options.include_usage`).
    pub fn include_usage(&self) -> bool {
        self.body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    /// A cheap prompt size estimate (characters of message text / 4), for the
    /// long-context decision.
    pub fn estimated_prompt_tokens(&self) -> u64 {
        fn text_len(v: &Value) -> usize {
            match v {
                Value::String(s) => s.len(),
                Value::Array(parts) => parts.iter().map(text_len).sum(),
                Value::Object(o) => o.get("text").map(text_len).unwrap_or(0),
                _ => 0,
            }
        }
        let chars: usize = self
            .body
            .get("messages")
            .and_then(Value::as_array)
            .map(|msgs| {
                msgs.iter()
                    .map(|m| m.get("content").map(text_len).unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0);
        (chars / 4) as u64
    }

    /// The normalized provider input of a run (E3): messages, tools and
    /// sampling options; everything else in the request is not forwarded on
    /// the normalized path.
    pub fn run_input(&self) -> pb::RunInput {
        fn content_text(v: Option<&Value>) -> String {
            match v {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(""),
                _ => String::new(),
            }
        }
        let str_field = |m: &Value, k: &str| {
            m.get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let json_bytes = |v: Option<&Value>| match v {
            None | Some(Value::Null) => Bytes::new(),
            Some(v) => Bytes::from(v.to_string()),
        };
        let messages = self
            .body
            .get("messages")
            .and_then(Value::as_array)
            .map(|msgs| {
                msgs.iter()
                    .map(|m| pb::ChatMessage {
                        role: str_field(m, "role"),
                        content: content_text(m.get("content")),
                        name: str_field(m, "name"),
                        tool_call_id: str_field(m, "tool_call_id"),
                        tool_calls_json: json_bytes(m.get("tool_calls")),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let stop = match self.body.get("stop") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect(),
            _ => Vec::new(),
        };
        pb::RunInput {
            messages,
            tools_json: json_bytes(self.body.get("tools")),
            tool_choice_json: json_bytes(self.body.get("tool_choice")),
            max_tokens: self
                .body
                .get("max_completion_tokens")
                .or_else(|| self.body.get("max_tokens"))
                .and_then(Value::as_i64),
            temperature: self.body.get("temperature").and_then(Value::as_f64),
            top_p: self.body.get("top_p").and_then(Value::as_f64),
            stop,
            seed: self.body.get("seed").and_then(Value::as_i64),
        }
    }

    /// The body for the selected provider: identical to the client's except
    /// that `model` names the served target (U5).
    pub fn body_for_target(&self, target: &str) -> Bytes {
        with_model(&self.body, target)
    }
}

/// A request for a passthrough route (`/v1/responses`, `/v1/messages`,
/// `/v1/messages/count_tokens`): only `model` and `stream` are read; the body
/// is forwarded with `model` rewritten to the served target (U5).
#[derive(Debug, Clone)]
pub struct PassthroughRequest {
    /// The external model (E2).
    pub model: String,
    /// Whether the client asked for a stream.
    pub stream: bool,
    body: Map<String, Value>,
}

impl PassthroughRequest {
    /// Parses a JSON object with a string `model`.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let body = parse_json_object(body)?;
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            _ => {
                return Err(ApiError::invalid_request(
                    "`model` must be a non-empty string.",
                    Some("model"),
                ))
            }
        };
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        Ok(Self {
            model,
            stream,
            body,
        })
    }

    /// The body for the selected provider, `model` naming its target (U5).
    pub fn body_for_target(&self, target: &str) -> Bytes {
        with_model(&self.body, target)
    }
}

/// A request body that must be a JSON object.
fn parse_json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid_request(format!("The request body is not valid JSON: {e}"), None)
    })?;
    let Value::Object(body) = value else {
        return Err(ApiError::invalid_request(
            "The request body must be a JSON object.",
            None,
        ));
    };
    Ok(body)
}

/// `body` with `model` set to `target` (U5), serialized.
fn with_model(body: &Map<String, Value>, target: &str) -> Bytes {
    let mut body = body.clone();
    body.insert("model".into(), Value::String(target.to_string()));
    Bytes::from(Value::Object(body).to_string())
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelEntry {
    /// The external model name.
    pub id: String,
    /// `owned_by` shown to clients.
    pub owned_by: String,
}

/// `GET /v1/models` body, in config order.
pub fn models_list(models: &[ModelEntry], created_unix_sec: i64) -> Bytes {
    let data: Vec<Value> = models
        .iter()
        .map(|m| {
            json!({
                "id": m.id,
                "object": "model",
                "created": created_unix_sec,
                "owned_by": m.owned_by,
            })
        })
        .collect();
    Bytes::from(json!({"object": "list", "data": data}).to_string())
}

/// Response headers from a provider that must not be relayed as they are:
/// hop-by-hop headers and framing, which the Edge sets itself.
pub fn is_hop_by_hop(name: &str) -> bool {
    const HOP: [&str; 9] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "content-length",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
    ];
    HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_shape_is_openai() {
        let e = ApiError::model_not_found("gpt-x");
        assert_eq!(e.status, 404);
        assert_eq!(
            e.body_json(),
            json!({"error": {
                "message": "The model `gpt-x` does not exist or you do not have access to it.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found"
            }})
        );
        let e = ApiError::no_provider("m");
        assert_eq!((e.status, e.retry_after_sec), (503, Some(1)));
        assert_eq!(ApiError::body_too_large(10).status, 413);
    }

    #[test]
    fn malformed_json_is_a_400() {
        let e = ChatRequest::parse(b"{not json").unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.kind, "invalid_request_error");
        assert!(e.message.starts_with("The request body is not valid JSON"));
        assert_eq!(ChatRequest::parse(b"[1]").unwrap_err().status, 400);
        assert_eq!(
            ChatRequest::parse(br#"{"messages":[]}"#).unwrap_err().param,
            Some("model")
        );
        assert_eq!(
            ChatRequest::parse(br#"{"model":"m"}"#).unwrap_err().param,
            Some("messages")
        );
        assert_eq!(
            ChatRequest::parse(br#"{"model":"m","messages":[],"stream":"yes"}"#)
                .unwrap_err()
                .param,
            Some("stream")
        );
    }

    // CONTRACT: E2, U5 — the external model is replaced by the served target
    // in the body built after selection; every other field is kept in order.
    #[test]
    fn body_for_target_rewrites_only_the_model() {
        let req = ChatRequest::parse(
            br#"{"model":"public-name","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"temperature":0.5}"#,
        )
        .unwrap();
        assert_eq!(req.model, "public-name");
        assert!(req.stream);
        assert!(req.include_usage());
        assert_eq!(
            &req.body_for_target("meta-llama/Llama-3.1-8B")[..],
            br#"{"model":"meta-llama/Llama-3.1-8B","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"temperature":0.5}"#
        );
    }

    // CONTRACT: E3 — the normalized input carries messages, tools and
    // sampling options; the external model is not part of it (E2).
    #[test]
    fn run_input_is_normalized() {
        let req = ChatRequest::parse(
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"tool","tool_call_id":"c1","content":"42"}],"tools":[{"type":"function","function":{"name":"f"}}],"max_tokens":5,"temperature":0.5,"stop":"x","seed":3}"#,
        )
        .unwrap();
        let input = req.run_input();
        assert_eq!(input.messages.len(), 3);
        assert_eq!(input.messages[0].role, "system");
        assert_eq!(input.messages[1].content, "ab");
        assert_eq!(input.messages[2].tool_call_id, "c1");
        assert_eq!(
            &input.tools_json[..],
            br#"[{"type":"function","function":{"name":"f"}}]"#
        );
        assert_eq!(input.max_tokens, Some(5));
        assert_eq!(input.temperature, Some(0.5));
        assert_eq!(input.stop, vec!["x".to_string()]);
        assert_eq!(input.seed, Some(3));
        assert!(input.tool_choice_json.is_empty());
    }

    #[test]
    fn sse_error_event_ends_with_done() {
        assert_eq!(
            &sse_error_event("boom", "upstream_error", Some("response_stalled"))[..],
            b"data: {\"error\":{\"message\":\"boom\",\"type\":\"upstream_error\",\"param\":null,\"code\":\"response_stalled\"}}\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn models_list_shape() {
        let body = models_list(
            &[ModelEntry {
                id: "a".into(),
                owned_by: "iop".into(),
            }],
            7,
        );
        assert_eq!(
            &body[..],
            br#"{"object":"list","data":[{"id":"a","object":"model","created":7,"owned_by":"iop"}]}"#
        );
    }

    #[test]
    fn anthropic_error_shape() {
        let e = ApiError::model_not_found("claude-x");
        assert_eq!(
            serde_json::from_slice::<Value>(&e.body_for(Surface::Anthropic)).unwrap(),
            json!({"type": "error", "error": {"type": "not_found_error", "message": e.message}})
        );
        assert_eq!(
            ApiError::queue_full("m").anthropic_type(),
            "rate_limit_error"
        );
        assert_eq!(
            &sse_error_event_for(Surface::Anthropic, "stalled", "response_stalled")[..],
            b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"stalled (response_stalled)\"}}\n\n"
        );
    }

    // CONTRACT: U5 — passthrough bodies keep every field but `model`.
    #[test]
    fn passthrough_rewrites_model_only() {
        let r =
            PassthroughRequest::parse(br#"{"model":"pub","input":"hi","stream":true}"#).unwrap();
        assert!(r.stream);
        assert_eq!(
            &r.body_for_target("t")[..],
            br#"{"model":"t","input":"hi","stream":true}"#
        );
        assert_eq!(PassthroughRequest::parse(b"{}").unwrap_err().status, 400);
    }

    #[test]
    fn hop_by_hop_headers() {
        assert!(is_hop_by_hop("Transfer-Encoding"));
        assert!(is_hop_by_hop("content-length"));
        assert!(!is_hop_by_hop("content-type"));
        assert!(!is_hop_by_hop("x-request-id"));
    }
}
