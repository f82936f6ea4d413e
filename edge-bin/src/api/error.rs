//! The gateway's errors, and how a client is told of them: one
//! [`GatewayError`] for every refusal and failure the Edge answers, and the
//! one place its OpenAI and Anthropic shapes are rendered — as a response
//! body, or as the SSE event that ends a stream already started.
//!
//! Like pingora's error, a [`GatewayError`] says where it came from
//! ([`Origin`]) and whether the request may be tried again elsewhere
//! ([`GatewayError::retryable`]: another provider, before anything reached
//! the client). A node's words that name a provider's address are kept for
//! the Edge's log ([`GatewayError::detail`]), never shown to the client
//! ([`client_message`]).

use bytes::Bytes;
use serde_json::{json, Value};

use crate::api::body_json::BodyError;

/// The error code of a body refused at the JSON limits.
const JSON_TOO_COMPLEX: &str = "json_too_complex";

/// Which client API a route speaks; decides the error shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// OpenAI: `{"error":{"message","type","param","code"}}`.
    OpenAi,
    /// Anthropic Messages: `{"type":"error","error":{"type","message"}}`.
    Anthropic,
}

/// Where a [`GatewayError`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The client: its request, its key or limits, or how it reads.
    Client,
    /// The provider or the node serving it: a failure, a stall, a lost
    /// connection, no provider ready.
    Upstream,
    /// The Edge itself: a full queue, a credential it cannot issue, a
    /// shutdown.
    Internal,
}

/// An error the Edge answers a client with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    /// Where it came from.
    pub origin: Origin,
    /// HTTP status.
    pub status: u16,
    /// Human-readable message (what the client is shown).
    pub message: String,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// The offending request parameter, if any.
    pub param: Option<&'static str>,
    /// Machine-readable `code`, if any.
    pub code: Option<String>,
    /// Seconds for a `retry-after` header, if any.
    pub retry_after_sec: Option<u32>,
    /// Another provider may still take the request: an upstream failure
    /// of an attempt that had not committed, of a kind Control fails over
    /// (`AttemptEnd::is_retryable`). Control decides whether it does; the
    /// client is answered only when it does not.
    pub retryable: bool,
    /// What the client is not shown of it (a node's words that name the
    /// provider's address): for the Edge's log.
    pub detail: Option<String>,
}

impl GatewayError {
    fn new(origin: Origin, status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            origin,
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_sec: None,
            retryable: false,
            detail: None,
        }
    }

    /// 400: the request is not valid (malformed JSON, missing fields).
    pub fn invalid_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            param,
            ..Self::new(Origin::Client, 400, "invalid_request_error", message)
        }
    }

    /// 401: no API key, or one that is not a client key (`code`:
    /// `invalid_api_key`).
    pub fn unauthenticated(message: impl Into<String>, code: Option<&str>) -> Self {
        Self {
            code: code.map(str::to_owned),
            ..Self::new(Origin::Client, 401, "invalid_request_error", message)
        }
    }

    /// 404: the requested model is not served here (E2).
    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model"),
            code: Some("model_not_found".into()),
            ..Self::new(
                Origin::Client,
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
                Origin::Upstream,
                503,
                "service_unavailable_error",
                format!("No provider for model `{model}` is available right now; retry shortly."),
            )
        }
    }

    /// 503: the model's nodes are owned by other Edges of the cluster and
    /// none of them could be reached to forward the request to.
    pub fn peer_unavailable(model: &str) -> Self {
        Self {
            code: Some("peer_unavailable".into()),
            retry_after_sec: Some(1),
            ..Self::new(
                Origin::Upstream,
                503,
                "service_unavailable_error",
                format!(
                    "The providers of model `{model}` are served by another gateway of this \
                     cluster, which cannot be reached right now; retry shortly."
                ),
            )
        }
    }

    /// 429: the model's queue is full.
    pub fn queue_full(model: &str) -> Self {
        Self {
            code: Some("queue_full".into()),
            retry_after_sec: Some(1),
            ..Self::new(
                Origin::Internal,
                429,
                "rate_limit_error",
                format!("Too many requests are waiting for model `{model}`; retry shortly."),
            )
        }
    }

    /// 503: a configuration reload removed `model` (or its last provider
    /// serving the request's operation) while the request waited for a
    /// provider.
    pub fn model_removed(model: &str) -> Self {
        Self {
            code: Some("model_removed".into()),
            param: Some("model"),
            ..Self::new(
                Origin::Internal,
                503,
                "service_unavailable_error",
                format!(
                    "A configuration reload removed the model `{model}`, or every provider \
                     of it serving this request, while the request waited."
                ),
            )
        }
    }

    /// 403: the client key may not use `model` (`[[client_keys]] models`).
    pub fn model_not_allowed(model: &str) -> Self {
        Self {
            code: Some("model_not_allowed".into()),
            param: Some("model"),
            ..Self::new(
                Origin::Client,
                403,
                "permission_error",
                format!("This API key may not use model `{model}`."),
            )
        }
    }

    /// 429: the key's principal is over one of its limits; `limit` names
    /// it (`concurrency`, `requests`, `tokens`).
    pub fn rate_limited(limit: &str, message: String, retry_after_sec: u64) -> Self {
        Self {
            code: Some(format!("rate_limit_{limit}")),
            retry_after_sec: Some(u32::try_from(retry_after_sec).unwrap_or(u32::MAX)),
            ..Self::new(Origin::Client, 429, "rate_limit_error", message)
        }
    }

    /// 429: a token budget of the key's principal (`tokens_per_day`,
    /// `tokens_per_month`) is spent until its period ends; the message
    /// names the budget, its size and when it resets.
    pub fn budget_exhausted(message: String, retry_after_sec: u64) -> Self {
        Self {
            code: Some("budget_exhausted".into()),
            retry_after_sec: Some(u32::try_from(retry_after_sec).unwrap_or(u32::MAX)),
            ..Self::new(Origin::Client, 429, "rate_limit_error", message)
        }
    }

    /// 503: the status page's event stream already has `limit` viewers on
    /// this core.
    pub fn too_many_viewers(limit: usize) -> Self {
        Self {
            code: Some("too_many_viewers".into()),
            ..Self::new(
                Origin::Internal,
                503,
                "ui_error",
                format!("at most {limit} status page viewers at once on this core"),
            )
        }
    }

    /// 413: the request body exceeds the configured limit.
    pub fn body_too_large(limit_bytes: usize) -> Self {
        Self {
            code: Some("request_too_large".into()),
            ..Self::new(
                Origin::Client,
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
            ..Self::new(Origin::Client, 408, "invalid_request_error", message)
        }
    }

    /// 404: unknown route.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        Self {
            code: Some("unknown_url".into()),
            ..Self::new(
                Origin::Client,
                404,
                "invalid_request_error",
                format!("Unknown request URL: {method} {path}."),
            )
        }
    }

    /// 403: a client key without the `metrics` (or `admin`) scope asked
    /// for `/metrics` under `edge.metrics_access = "key"`.
    pub fn metrics_scope_required() -> Self {
        Self {
            code: Some("metrics_scope_required".into()),
            ..Self::new(
                Origin::Client,
                403,
                "permission_error",
                "This API key may not read /metrics: give it scopes = [\"metrics\"] in [[client_keys]].",
            )
        }
    }

    /// 429: the peer address holds `edge.max_client_connections_per_peer`
    /// connections already.
    pub fn too_many_connections() -> Self {
        Self {
            code: Some("too_many_connections".into()),
            retry_after_sec: Some(1),
            ..Self::new(
                Origin::Client,
                429,
                "rate_limit_error",
                "Too many open connections from your address.",
            )
        }
    }

    /// 405: known route, wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            Origin::Client,
            405,
            "invalid_request_error",
            format!("Method {method} is not allowed for {path}."),
        )
    }

    /// 503: the Edge is draining for shutdown and takes no new request.
    pub fn shutting_down() -> Self {
        Self {
            code: Some("shutting_down".into()),
            retry_after_sec: Some(1),
            ..Self::new(
                Origin::Internal,
                503,
                "service_unavailable_error",
                "The gateway is shutting down; retry shortly.",
            )
        }
    }

    /// 503: no credential lease could be issued for the provider (C3, C5);
    /// the request was not sent. `code` is the credential plane's.
    pub fn credential_unavailable(message: impl Into<String>, code: &str) -> Self {
        Self {
            code: Some(code.to_owned()),
            ..Self::new(Origin::Internal, 503, "server_error", message)
        }
    }

    /// An attempt failed with the node's failure `code` and `detail` (its
    /// `ERROR` message): 504 when the provider stalled or never started a
    /// response, else 502. The client is shown [`client_message`]; a
    /// detail it is not shown is kept in [`GatewayError::detail`].
    /// `retryable`: another provider may take the request (see the field).
    pub fn provider_failure(code: &str, detail: &str, retryable: bool) -> Self {
        let status = match code {
            "response_stalled" | "response_wait_timeout" => 504,
            _ => 502,
        };
        let message = client_message(code, detail);
        Self {
            code: Some(code.to_owned()),
            retryable,
            detail: (message != detail).then(|| detail.to_owned()),
            ..Self::new(Origin::Upstream, status, "upstream_error", message)
        }
    }

    /// 504: no response started within `edge.response_wait_timeout_ms`;
    /// Control cancelled the run (U6).
    pub fn response_wait_timeout() -> Self {
        Self::provider_failure(
            "response_wait_timeout",
            "The provider did not start a response within edge.response_wait_timeout_ms.",
            false,
        )
    }

    /// 502: the node serving the request disconnected (its connection was
    /// fenced or superseded) before the response ended.
    pub fn node_lost() -> Self {
        Self::provider_failure(
            "node_disconnected",
            "the node serving this request disconnected",
            false,
        )
    }

    /// 502: the node the request was dispatched to disconnected before it
    /// could be sent.
    pub fn node_unavailable() -> Self {
        Self::provider_failure("node_unavailable", "the selected node disconnected", false)
    }

    /// 502: the tunnel ended without a response head.
    pub fn no_response() -> Self {
        Self::new(
            Origin::Upstream,
            502,
            "upstream_error",
            "the provider sent no response",
        )
    }

    /// The run was cut off: its client drained slower than its node sent
    /// (a node without flow control). Answered as an upstream error (502
    /// `upstream_error`, code `client_too_slow`), which is what the client
    /// sees of it.
    pub fn client_too_slow() -> Self {
        Self {
            origin: Origin::Client,
            ..Self::provider_failure(
                "client_too_slow",
                "The response outgrew what this client was reading.",
                false,
            )
        }
    }

    /// 400: a request body the Edge cannot read ([`BodyError`]); JSON-limit
    /// refusals carry code `json_too_complex`.
    pub fn from_body(e: BodyError) -> Self {
        let code = e.is_limit().then(|| JSON_TOO_COMPLEX.to_string());
        Self {
            code,
            ..Self::invalid_request(e.to_string(), None)
        }
    }

    /// Whether this refuses a body at `edge.max_json_depth` /
    /// `edge.max_json_elements` / `edge.max_json_members`.
    pub fn is_json_limit(&self) -> bool {
        self.code.as_deref() == Some(JSON_TOO_COMPLEX)
    }

    /// An error from a malformed HTTP request, mapped from its status.
    pub fn from_http_status(status: u16, message: impl Into<String>) -> Self {
        Self::new(Origin::Client, status, "invalid_request_error", message)
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

    /// [`GatewayError::body_for`] of the request `request_id`: the
    /// Anthropic shape carries it as `request_id`, as Anthropic's API does
    /// (the OpenAI shape has no such field; both get the `x-request-id`
    /// header).
    pub fn body_for_request(&self, surface: Surface, request_id: &str) -> Bytes {
        match surface {
            Surface::OpenAi => self.body_bytes(),
            Surface::Anthropic => Bytes::from(
                json!({
                    "type": "error",
                    "error": {"type": self.anthropic_type(), "message": self.message},
                    "request_id": request_id,
                })
                .to_string(),
            ),
        }
    }

    /// The SSE event that ends an already-started stream of `surface` with
    /// this error: OpenAI `data: {"error":{...}}` then `data: [DONE]`;
    /// Anthropic `event: error` with `{"type":"error","error":{...}}`, the
    /// code in the message.
    pub fn sse_event(&self, surface: Surface) -> Bytes {
        match surface {
            Surface::OpenAi => sse_error_event(&self.message, self.kind, self.code.as_deref()),
            Surface::Anthropic => {
                let message = match &self.code {
                    Some(code) => format!("{} ({code})", self.message),
                    None => self.message.clone(),
                };
                let event = json!({
                    "type": "error",
                    "error": {"type": self.anthropic_type(), "message": message},
                });
                Bytes::from(format!("event: error\ndata: {event}\n\n"))
            }
        }
    }

    /// What the access log says of a request answered with this error: its
    /// `code`, else its `type`.
    pub fn outcome(&self) -> &str {
        self.code.as_deref().unwrap_or(self.kind)
    }
}

/// What a client is told of an attempt that failed with failure `code`,
/// given the Node's `detail` (its `ERROR` message). The codes of a provider
/// the node could not reach or agree TLS with get a fixed sentence: their
/// detail names the provider's address, host name and port (`connect
/// 10.0.0.5:8000: connection refused`, `TLS handshake with llm.internal
/// failed: …`), which are the operator's to see (the Edge logs them), not
/// the client's. Every other code's detail says nothing of where the
/// provider is (a broken exchange, the provider's own error answer, a
/// request the node refused, a lease failure, a stall) and is kept.
pub fn client_message<'a>(code: &str, detail: &'a str) -> &'a str {
    match code {
        "provider_unreachable" => "The provider could not be reached.",
        "provider_tls" => {
            "The TLS handshake with the provider failed (its certificate was refused or the \
             handshake broke off)."
        }
        _ => detail,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn text(bytes: Bytes) -> String {
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[test]
    fn error_shape_is_openai() {
        let e = GatewayError::model_not_found("gpt-x");
        assert_eq!(
            (e.status, e.origin, e.retryable),
            (404, Origin::Client, false)
        );
        assert_eq!(
            e.body_json(),
            json!({"error": {
                "message": "The model `gpt-x` does not exist or you do not have access to it.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found"
            }})
        );
        let e = GatewayError::no_provider("m");
        assert_eq!((e.status, e.retry_after_sec), (503, Some(1)));
        assert_eq!(GatewayError::body_too_large(10).status, 413);
    }

    #[test]
    fn anthropic_error_shape() {
        let e = GatewayError::model_not_found("claude-x");
        assert_eq!(
            serde_json::from_slice::<Value>(&e.body_for(Surface::Anthropic)).unwrap(),
            json!({"type": "error", "error": {"type": "not_found_error", "message": e.message}})
        );
        assert_eq!(
            GatewayError::queue_full("m").anthropic_type(),
            "rate_limit_error"
        );
        assert_eq!(
            text(GatewayError::provider_failure("response_stalled", "stalled", true).sse_event(Surface::Anthropic)),
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"stalled (response_stalled)\"}}\n\n"
        );
    }

    // The failures of an attempt, rendered in each shape exactly as a
    // client gets them: before a response started (the body) and after
    // (the stream's last event).
    #[test]
    fn attempt_failures_render_in_both_shapes() {
        let e = GatewayError::node_lost();
        assert_eq!(
            (e.status, e.origin, e.retryable),
            (502, Origin::Upstream, false)
        );
        assert_eq!(
            text(e.body_for_request(Surface::OpenAi, "req-1")),
            "{\"error\":{\"message\":\"the node serving this request disconnected\",\
             \"type\":\"upstream_error\",\"param\":null,\"code\":\"node_disconnected\"}}"
        );
        assert_eq!(
            text(e.body_for_request(Surface::Anthropic, "req-1")),
            "{\"type\":\"error\",\"error\":{\"type\":\"api_error\",\
             \"message\":\"the node serving this request disconnected\"},\"request_id\":\"req-1\"}"
        );
        assert_eq!(
            text(e.sse_event(Surface::OpenAi)),
            "data: {\"error\":{\"message\":\"the node serving this request disconnected\",\
             \"type\":\"upstream_error\",\"param\":null,\"code\":\"node_disconnected\"}}\n\n\
             data: [DONE]\n\n"
        );
        // Stalls and the response-wait timeout are 504s; the rest 502s.
        let e = GatewayError::response_wait_timeout();
        assert_eq!((e.status, e.outcome()), (504, "response_wait_timeout"));
        assert_eq!(
            e.message,
            "The provider did not start a response within edge.response_wait_timeout_ms."
        );
        assert_eq!(
            GatewayError::provider_failure("response_stalled", "x", true).status,
            504
        );
        assert_eq!(
            GatewayError::provider_failure("capacity_exhausted", "x", true).status,
            502
        );
        // A cut-off run is the client's doing, answered as the 502 it sees.
        let e = GatewayError::client_too_slow();
        assert_eq!(
            (e.status, e.origin, e.kind),
            (502, Origin::Client, "upstream_error")
        );
        assert_eq!(
            text(e.sse_event(Surface::Anthropic)),
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\
             \"message\":\"The response outgrew what this client was reading. (client_too_slow)\"}}\n\n"
        );
        // No head, no code: the outcome is the type.
        let e = GatewayError::no_response();
        assert_eq!(
            (e.status, e.code.as_deref(), e.outcome()),
            (502, None, "upstream_error")
        );
        assert_eq!(
            text(e.sse_event(Surface::Anthropic)),
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\
             \"message\":\"the provider sent no response\"}}\n\n"
        );
    }

    // A node's words naming the provider's address stay in the error's
    // detail, for the log; the client gets the fixed sentence.
    #[test]
    fn a_provider_failure_keeps_what_the_client_is_not_shown() {
        let detail = "connect 10.0.0.5:8000: Connection refused (os error 111)";
        let e = GatewayError::provider_failure("provider_unreachable", detail, true);
        assert_eq!(
            (e.message.as_str(), e.detail.as_deref(), e.retryable),
            ("The provider could not be reached.", Some(detail), true)
        );
        assert!(!text(e.body_bytes()).contains("10.0.0.5"));
        let e = GatewayError::provider_failure("response_stalled", "no progress for 500 ms", false);
        assert_eq!(
            (e.message.as_str(), e.detail),
            ("no progress for 500 ms", None)
        );
    }

    // A node's words about a provider it could not reach name its address;
    // the client gets a fixed sentence for those codes, the detail for the
    // others.
    #[test]
    fn client_messages_carry_no_provider_address() {
        assert_eq!(
            client_message(
                "provider_unreachable",
                "connect 10.0.0.5:8000: Connection refused (os error 111)"
            ),
            "The provider could not be reached."
        );
        assert_eq!(
            client_message(
                "provider_tls",
                "provider TLS: TLS handshake with llm.internal failed: invalid peer certificate"
            ),
            "The TLS handshake with the provider failed (its certificate was refused or the \
             handshake broke off)."
        );
        for (code, detail) in [
            (
                "provider_error",
                "provider: connection closed in the middle of a message",
            ),
            ("response_stalled", "no progress for 500 ms"),
            ("invalid_input", "chat request: `messages` is empty"),
            ("lease_expired", "credential lease expired"),
        ] {
            assert_eq!(client_message(code, detail), detail);
        }
    }

    #[test]
    fn sse_error_event_ends_with_done() {
        assert_eq!(
            &sse_error_event("boom", "upstream_error", Some("response_stalled"))[..],
            b"data: {\"error\":{\"message\":\"boom\",\"type\":\"upstream_error\",\"param\":null,\"code\":\"response_stalled\"}}\n\ndata: [DONE]\n\n"
        );
    }
}
