//! The OpenAI-compatible client surface, pure parts: request preparation
//! (external `model` → provider target, E2/U5), the models list, and which
//! provider headers are not relayed. Errors and their shapes are
//! [`crate::api::error`]'s.
//!
//! Surface translation lives here, never in transport handlers (X4).

use std::borrow::Cow;

use bytes::Bytes;
use iop_wire::codec::BodyParts;
use iop_wire::pb;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::api::body_json::{self, JsonLimits, Members};
use crate::api::error::GatewayError;
use crate::api::multipart::FormRequest;

/// A parsed chat completion request, ready to be rebuilt for a provider.
///
/// Holds the client's bytes ([`Members`]: validated, bounded, no JSON
/// tree); the members the Edge needs are read from them on demand, and the
/// provider's body is the client's with only `model` spliced (U5).
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// The external model the client asked for (E2).
    pub model: String,
    /// Whether the client asked for a stream.
    pub stream: bool,
    body: Members,
}

impl ChatRequest {
    /// What the routing policy of its model reads of it
    /// ([`crate::api::route_hint`]).
    pub fn route_hint(
        &self,
        session_header: Option<&[u8]>,
        policy: crate::control::RoutingPolicy,
        prefix_bytes_max: usize,
    ) -> crate::control::RouteHint {
        crate::api::route_hint::route_hint(&self.body, session_header, policy, prefix_bytes_max)
    }

    /// Parses a `/v1/chat/completions` body within `limits`. Only what the
    /// Edge needs is checked; every other member passes through unchanged.
    pub fn parse(body: Bytes, limits: &JsonLimits) -> Result<Self, GatewayError> {
        let body = Members::parse(body, limits).map_err(GatewayError::from_body)?;
        let model = match body.raw("model") {
            Some(raw) => model_name(raw)?,
            None => {
                return Err(GatewayError::invalid_request(
                    "You must provide a `model` parameter.",
                    Some("model"),
                ))
            }
        };
        let stream = match body.raw("stream") {
            None | Some("null") => false,
            Some("true") => true,
            Some("false") => false,
            Some(_) => {
                return Err(GatewayError::invalid_request(
                    "`stream` must be a boolean.",
                    Some("stream"),
                ))
            }
        };
        if !body.raw("messages").is_some_and(|m| m.starts_with('[')) {
            return Err(GatewayError::invalid_request(
                "`messages` must be an array.",
                Some("messages"),
            ));
        }
        // The Edge may rewrite `stream_options` of a stream (see
        // `body_asking_usage`); anything but an object (or null) is
        // refused as OpenAI refuses it.
        let options = body.raw("stream_options");
        if stream && options.is_some_and(|o| o != "null" && !o.starts_with('{')) {
            return Err(GatewayError::invalid_request(
                "`stream_options` must be an object.",
                Some("stream_options"),
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
        include_usage(&self.body)
    }

    /// The messages, each as its (leniently read) members; a message that
    /// is not an object has none.
    fn messages(&self) -> Vec<Vec<(Cow<'_, str>, &RawValue)>> {
        self.body
            .raw("messages")
            .and_then(body_json::array_elements)
            .unwrap_or_default()
            .into_iter()
            .map(|m| body_json::object_members(m.get()).unwrap_or_default())
            .collect()
    }

    /// A cheap prompt size estimate (characters of message text / 4), for the
    /// long-context decision.
    pub fn estimated_prompt_tokens(&self) -> u64 {
        let chars: usize = self
            .messages()
            .iter()
            .map(|m| member(m, "content").map_or(0, text_len))
            .sum();
        (chars / 4) as u64
    }

    /// The normalized provider input of a run (E3): messages, tools and
    /// sampling options; everything else in the request is not forwarded on
    /// the normalized path.
    pub fn run_input(&self) -> pb::RunInput {
        let str_member = |m: &[(Cow<'_, str>, &RawValue)], k: &str| {
            member(m, k)
                .and_then(body_json::as_string)
                .map(Cow::into_owned)
                .unwrap_or_default()
        };
        let messages = self
            .messages()
            .iter()
            .map(|m| pb::ChatMessage {
                role: str_member(m, "role"),
                content: content_text(member(m, "content")),
                name: str_member(m, "name"),
                tool_call_id: str_member(m, "tool_call_id"),
                tool_calls_json: raw_json(member(m, "tool_calls").map(RawValue::get)),
            })
            .collect();
        let stop = match self.body.raw("stop") {
            Some(raw) if raw.starts_with('"') => serde_json::from_str::<String>(raw)
                .map(|s| vec![s])
                .unwrap_or_default(),
            Some(raw) => body_json::array_elements(raw)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|v| body_json::as_string(v).map(Cow::into_owned))
                .collect(),
            None => Vec::new(),
        };
        let number = |name: &str| self.body.raw(name).and_then(|raw| raw.parse::<f64>().ok());
        let integer = |name: &str| self.body.raw(name).and_then(|raw| raw.parse::<i64>().ok());
        pb::RunInput {
            messages,
            tools_json: raw_json(self.body.raw("tools")),
            tool_choice_json: raw_json(self.body.raw("tool_choice")),
            max_tokens: if self.body.raw("max_completion_tokens").is_some() {
                integer("max_completion_tokens")
            } else {
                integer("max_tokens")
            },
            temperature: number("temperature"),
            top_p: number("top_p"),
            stop,
            seed: integer("seed"),
            ..Default::default()
        }
    }

    /// The body for the selected provider: the client's bytes with only
    /// `model`'s value replaced by the served target (U5), in pieces that
    /// share the client's memory (each attempt costs no copy of the body).
    pub fn body_for_target(&self, target: &str) -> BodyParts {
        with_model(&self.body, target)
    }

    /// For a stream whose client did not ask for usage: the body for
    /// `target` ([`ChatRequest::body_for_target`]) that also asks the
    /// provider for its usage chunk, `"stream_options":{"include_usage":true}`.
    /// The node observes that chunk and leaves it out of what the client
    /// gets (`ProviderTunnelRequest.strip_usage_chunk`). `None` when the
    /// request is not streamed or already asks for usage.
    ///
    /// Without `stream_options` the member is inserted right after
    /// `model`'s value (the spliced middle is the two values, no byte of
    /// the client's copied). With one, each `include_usage` member whose
    /// value is not `true` gets `true` (lenient servers read `0`, `"no"` or
    /// `null` as false), or `"include_usage":true` is inserted first in the
    /// object; `null` becomes `{"include_usage":true}`. Every other byte is
    /// the client's; the bytes between `model` and `stream_options` are
    /// copied once (a second edit, see [`Members::splice_spans`]).
    pub fn body_asking_usage(&self, target: &str) -> Option<BodyParts> {
        body_asking_usage(&self.body, self.stream, target)
    }
}

/// Whether `body` asks for a usage chunk (`stream_options.include_usage`).
fn include_usage(body: &Members) -> bool {
    body.raw("stream_options")
        .and_then(body_json::object_members)
        .and_then(|options| {
            options
                .into_iter()
                .find(|(name, _)| name == "include_usage")
                .map(|(_, v)| v.get() == "true")
        })
        .unwrap_or(false)
}

/// [`ChatRequest::body_asking_usage`] of `body`: `None` unless `stream`
/// and the body does not ask for usage already.
fn body_asking_usage(body: &Members, stream: bool, target: &str) -> Option<BodyParts> {
    if !stream || include_usage(body) {
        return None;
    }
    const ASK: &[u8] = br#"{"include_usage":true}"#;
    let model = body.span("model")?;
    let mut edits = vec![(model.clone(), Bytes::from(body_json::json_string(target)))];
    match (body.span("stream_options"), body.raw("stream_options")) {
        (Some(span), Some("null")) => edits.push((span, Bytes::from_static(ASK))),
        (Some(span), Some(raw)) => {
            let members = body_json::member_spans(raw)?;
            let named: Vec<_> = members
                .iter()
                .filter(|(name, _)| name == "include_usage")
                .collect();
            if named.is_empty() {
                let at = span.start + 1;
                let member: &'static [u8] = if members.is_empty() {
                    br#""include_usage":true"#
                } else {
                    br#""include_usage":true,"#
                };
                edits.push((at..at, Bytes::from_static(member)));
            }
            for (_, value) in named {
                if &raw[value.clone()] != "true" {
                    let value = span.start + value.start..span.start + value.end;
                    edits.push((value, Bytes::from_static(b"true")));
                }
            }
        }
        _ => {
            let mut member = br#","stream_options":"#.to_vec();
            member.extend_from_slice(ASK);
            edits.push((model.end..model.end, Bytes::from(member)));
        }
    }
    edits.sort_by_key(|(span, _)| (span.start, span.end));
    body.splice_spans(&edits)
}

/// The value of member `name` among `members`.
fn member<'m>(members: &[(Cow<'_, str>, &'m RawValue)], name: &str) -> Option<&'m RawValue> {
    members.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
}

/// Text length of a message `content`: a string, or the `text` of each
/// part of an array.
fn text_len(content: &RawValue) -> usize {
    match content.get().as_bytes().first() {
        // The raw length less the quotes: escapes make it a little longer,
        // which is fine for an estimate.
        Some(b'"') => content.get().len().saturating_sub(2),
        Some(b'[') => body_json::array_elements(content.get())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|part| {
                let part = body_json::object_members(part.get())?;
                Some(member(&part, "text").map_or(0, text_len))
            })
            .sum(),
        _ => 0,
    }
}

/// A message `content` as text: the string, or the `text` parts of an array
/// joined.
fn content_text(content: Option<&RawValue>) -> String {
    let Some(content) = content else {
        return String::new();
    };
    if let Some(text) = body_json::as_string(content) {
        return text.into_owned();
    }
    body_json::array_elements(content.get())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|part| {
            let part = body_json::object_members(part.get())?;
            member(&part, "text")
                .and_then(body_json::as_string)
                .map(Cow::into_owned)
        })
        .collect()
}

/// Raw JSON as bytes for a `*_json` wire field; empty when absent or null.
fn raw_json(raw: Option<&str>) -> Bytes {
    match raw {
        None | Some("null") => Bytes::new(),
        Some(raw) => Bytes::copy_from_slice(raw.as_bytes()),
    }
}

/// A `model` member's value: a non-empty string.
fn model_name(raw: &str) -> Result<String, GatewayError> {
    match serde_json::from_str::<String>(raw) {
        Ok(m) if !m.is_empty() => Ok(m),
        _ => Err(GatewayError::invalid_request(
            "`model` must be a non-empty string.",
            Some("model"),
        )),
    }
}

/// A request for a passthrough route (`/v1/responses`, `/v1/messages`,
/// `/v1/messages/count_tokens`, `/v1/completions`, `/v1/embeddings`,
/// `/v1/rerank`, `/v2/rerank`, `/v1/score`, `/tokenize`, `/detokenize`): only
/// `model` and `stream` are read; the body is forwarded with `model`
/// rewritten to the served target (U5).
#[derive(Debug, Clone)]
pub struct PassthroughRequest {
    /// The external model (E2).
    pub model: String,
    /// Whether the client asked for a stream.
    pub stream: bool,
    body: PassthroughBody,
}

/// What a passthrough body is.
#[derive(Debug, Clone)]
enum PassthroughBody {
    /// A JSON object (every route but the audio uploads).
    Json(Members),
    /// A `multipart/form-data` form (`/v1/audio/transcriptions`,
    /// `/v1/audio/translations`).
    Form(FormRequest),
}

impl PassthroughRequest {
    /// What the routing policy of its model reads of it
    /// ([`crate::api::route_hint`]).
    pub fn route_hint(
        &self,
        session_header: Option<&[u8]>,
        policy: crate::control::RoutingPolicy,
        prefix_bytes_max: usize,
    ) -> crate::control::RouteHint {
        match &self.body {
            PassthroughBody::Json(body) => {
                crate::api::route_hint::route_hint(body, session_header, policy, prefix_bytes_max)
            }
            // An upload holds no prompt text; its model's least loaded
            // provider serves it.
            PassthroughBody::Form(_) => crate::control::RouteHint::default(),
        }
    }

    /// Parses a JSON object with a string `model`, within `limits`.
    pub fn parse(body: Bytes, limits: &JsonLimits) -> Result<Self, GatewayError> {
        let body = Members::parse(body, limits).map_err(GatewayError::from_body)?;
        // Required on every route, `/tokenize` and `/detokenize` too (vLLM
        // defaults it; the Edge routes by it and picks no model itself).
        let model = match body.raw("model") {
            Some(raw) => model_name(raw)?,
            None => {
                return Err(GatewayError::invalid_request(
                    "You must provide a `model` parameter.",
                    Some("model"),
                ))
            }
        };
        let stream = body.raw("stream") == Some("true");
        Ok(Self {
            model,
            stream,
            body: PassthroughBody::Json(body),
        })
    }

    /// Parses a `multipart/form-data` body with a `model` field
    /// ([`FormRequest::parse`]); `content_type` is the request's header.
    pub fn parse_form(body: Bytes, content_type: &[u8]) -> Result<Self, GatewayError> {
        let form = FormRequest::parse(body, content_type)?;
        Ok(Self {
            model: form.model.clone(),
            stream: form.stream,
            body: PassthroughBody::Form(form),
        })
    }

    /// The raw JSON text of the body's member `name`, if present (a
    /// translated operation reads what it needs of the body this way).
    /// A form has no JSON members.
    pub fn member(&self, name: &str) -> Option<&str> {
        match &self.body {
            PassthroughBody::Json(body) => body.raw(name),
            PassthroughBody::Form(_) => None,
        }
    }

    /// The body for the selected provider, `model` naming its target (U5),
    /// in pieces that share the client's memory.
    pub fn body_for_target(&self, target: &str) -> BodyParts {
        match &self.body {
            PassthroughBody::Json(body) => with_model(body, target),
            PassthroughBody::Form(form) => form.body_for_target(target),
        }
    }

    /// A streamed text completion's body that also asks the provider for
    /// its usage chunk, as [`ChatRequest::body_asking_usage`] (the same
    /// `stream_options` member); `None` when not streamed or already asked.
    pub fn body_asking_usage(&self, target: &str) -> Option<BodyParts> {
        match &self.body {
            PassthroughBody::Json(body) => body_asking_usage(body, self.stream, target),
            PassthroughBody::Form(_) => None,
        }
    }
}

/// The client's body with `model` set to `target` (U5): the old value's
/// bytes are replaced, nothing else changes. Parsing guarantees `model` is
/// present.
fn with_model(body: &Members, target: &str) -> BodyParts {
    body.splice("model", Bytes::from(body_json::json_string(target)))
        .unwrap_or_else(|| BodyParts::whole(body.bytes().clone()))
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelEntry {
    /// The external model name.
    pub id: String,
    /// `owned_by` shown to clients.
    pub owned_by: String,
}

/// One model object, as `GET /v1/models` lists it.
fn model_object(m: &ModelEntry, created_unix_sec: i64) -> Value {
    json!({
        "id": m.id,
        "object": "model",
        "created": created_unix_sec,
        "owned_by": m.owned_by,
    })
}

/// `GET /v1/models` body, in config order.
pub fn models_list(models: &[ModelEntry], created_unix_sec: i64) -> Bytes {
    let data: Vec<Value> = models
        .iter()
        .map(|m| model_object(m, created_unix_sec))
        .collect();
    Bytes::from(json!({"object": "list", "data": data}).to_string())
}

/// `GET /v1/models/{id}` body: the model object of `model`.
pub fn model_retrieved(model: &ModelEntry, created_unix_sec: i64) -> Bytes {
    Bytes::from(model_object(model, created_unix_sec).to_string())
}

/// Response headers from a provider that are not relayed as they are: the
/// hop-by-hop headers ([`iop_engine::http::is_hop_by_hop`], the one list)
/// and the framing, which the Edge sets itself
/// ([`iop_engine::http::is_framing`]).
pub fn is_not_relayed(name: &str) -> bool {
    iop_engine::http::is_hop_by_hop(name) || iop_engine::http::is_framing(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &'static [u8]) -> Result<ChatRequest, GatewayError> {
        ChatRequest::parse(Bytes::from_static(body), &JsonLimits::default())
    }

    fn passthrough(body: &'static [u8]) -> Result<PassthroughRequest, GatewayError> {
        PassthroughRequest::parse(Bytes::from_static(body), &JsonLimits::default())
    }

    #[test]
    fn malformed_json_is_a_400() {
        let e = chat(b"{not json").unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.kind, "invalid_request_error");
        assert!(e.message.starts_with("The request body is not valid JSON"));
        assert_eq!(chat(b"[1]").unwrap_err().status, 400);
        assert_eq!(
            chat(br#"{"messages":[]}"#).unwrap_err().param,
            Some("model")
        );
        assert_eq!(
            chat(br#"{"model":"m"}"#).unwrap_err().param,
            Some("messages")
        );
        assert_eq!(
            chat(br#"{"model":"m","messages":[],"stream":"yes"}"#)
                .unwrap_err()
                .param,
            Some("stream")
        );
    }

    // CONTRACT: E2, U5 — the external model is replaced by the served target
    // in the body built after selection; every other field is kept in order.
    #[test]
    fn body_for_target_rewrites_only_the_model() {
        let req = chat(br#"{"model":"public-name","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"temperature":0.5}"#)
        .unwrap();
        assert_eq!(req.model, "public-name");
        assert!(req.stream);
        assert!(req.include_usage());
        assert_eq!(
            &req.body_for_target("meta-llama/Llama-3.1-8B").to_bytes()[..],
            br#"{"model":"meta-llama/Llama-3.1-8B","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"temperature":0.5}"#
        );
    }

    /// The body a streamed `body` is sent with to target `t` when the Edge
    /// asks for usage; `None` when it asks nothing.
    fn asking(body: &'static [u8]) -> Option<String> {
        let req = chat(body).unwrap();
        let spliced = req.body_asking_usage("t")?.to_bytes();
        // Valid JSON that asks for usage, whichever duplicate a server reads.
        let v: Value = serde_json::from_slice(&spliced).expect("valid JSON");
        assert_eq!(v["stream_options"]["include_usage"], json!(true));
        assert_eq!(v["model"], json!("t"));
        Some(String::from_utf8(spliced.to_vec()).unwrap())
    }

    #[test]
    fn a_stream_that_did_not_ask_for_usage_asks_for_it_and_nothing_else_changes() {
        // No `stream_options`: inserted right after `model`, wherever it is.
        assert_eq!(
            asking(br#"{"model":"pub","messages":[],"stream":true}"#).unwrap(),
            r#"{"model":"t","stream_options":{"include_usage":true},"messages":[],"stream":true}"#
        );
        assert_eq!(
            asking(br#"{ "messages" : [], "stream":true , "model" : "pub" }"#).unwrap(),
            r#"{ "messages" : [], "stream":true , "model" : "t","stream_options":{"include_usage":true} }"#
        );
        // An object without `include_usage`: added first, the rest kept.
        assert_eq!(
            asking(br#"{"stream":true,"stream_options": {"continuous_usage_stats" : true},"model":"pub","messages":[]}"#).unwrap(),
            r#"{"stream":true,"stream_options": {"include_usage":true,"continuous_usage_stats" : true},"model":"t","messages":[]}"#
        );
        assert_eq!(
            asking(br#"{"model":"pub","messages":[],"stream":true,"stream_options":{ }}"#).unwrap(),
            r#"{"model":"t","messages":[],"stream":true,"stream_options":{"include_usage":true }}"#
        );
        // Any value but `true` (lenient servers read 0 or "no" as false),
        // every repeat of the member, and `null` options.
        assert_eq!(
            asking(br#"{"model":"pub","messages":[],"stream":true,"stream_options":{"include_usage": false, "x":1}}"#).unwrap(),
            r#"{"model":"t","messages":[],"stream":true,"stream_options":{"include_usage": true, "x":1}}"#
        );
        assert_eq!(
            asking(br#"{"model":"pub","messages":[],"stream":true,"stream_options":{"include_usage":"no","include_usage":0}}"#).unwrap(),
            r#"{"model":"t","messages":[],"stream":true,"stream_options":{"include_usage":true,"include_usage":true}}"#
        );
        assert_eq!(
            asking(br#"{"model":"pub","messages":[],"stream":true,"stream_options":{"include_usage":null}}"#).unwrap(),
            r#"{"model":"t","messages":[],"stream":true,"stream_options":{"include_usage":true}}"#
        );
        assert_eq!(
            asking(br#"{"stream_options":null,"model":"pub","messages":[],"stream":true}"#)
                .unwrap(),
            r#"{"stream_options":{"include_usage":true},"model":"t","messages":[],"stream":true}"#
        );
        // Nothing to ask: the client asked, or nothing streams.
        assert_eq!(
            asking(br#"{"model":"pub","messages":[],"stream":true,"stream_options":{"include_usage":true}}"#),
            None
        );
        assert_eq!(asking(br#"{"model":"pub","messages":[]}"#), None);
        assert_eq!(
            asking(br#"{"model":"pub","messages":[],"stream":false,"stream_options":"x"}"#),
            None
        );
        // A stream's options must be an object.
        let e = chat(br#"{"model":"pub","messages":[],"stream":true,"stream_options":[true]}"#)
            .unwrap_err();
        assert_eq!(
            (e.status, e.param, e.message.as_str()),
            (
                400,
                Some("stream_options"),
                "`stream_options` must be an object."
            )
        );
    }

    #[test]
    fn asking_for_usage_copies_no_client_byte_when_stream_options_is_absent() {
        let body = Bytes::from_static(br#"{"model":"pub","messages":[{"role":"user","content":"long prompt"}],"stream":true}"#);
        let req = ChatRequest::parse(body.clone(), &JsonLimits::default()).unwrap();
        let spliced = req.body_asking_usage("t").unwrap();
        let [before, middle, after] = spliced.parts() else {
            panic!("three pieces")
        };
        assert_eq!(before.as_ptr(), body.as_ptr());
        assert_eq!(
            &middle[..],
            br#""t","stream_options":{"include_usage":true}"#
        );
        assert_eq!(after.as_ptr(), body[14..].as_ptr());
    }

    // CONTRACT: E3 — the normalized input carries messages, tools and
    // sampling options; the external model is not part of it (E2).
    #[test]
    fn run_input_is_normalized() {
        let req = chat(br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"tool","tool_call_id":"c1","content":"42"}],"tools":[{"type":"function","function":{"name":"f"}}],"max_tokens":5,"temperature":0.5,"stop":"x","seed":3}"#)
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

    // CONTRACT: U5 — the provider body is the client's bytes with only the
    // `model` value replaced: whitespace, member order, number spelling and
    // escapes elsewhere are untouched; an escaped model name is decoded for
    // routing and the target is escaped where it needs to be.
    #[test]
    fn the_model_is_spliced_into_the_clients_bytes() {
        let body = b"{ \"messages\" : [ {\"role\":\"user\",\"content\":\"h\\u00e9 \\\"x\\\"\"} ],\n  \"model\":\"pub\\u002dname\", \"temperature\": 1.50e0 }";
        let req = chat(body).unwrap();
        assert_eq!(req.model, "pub-name");
        assert_eq!(
            std::str::from_utf8(&req.body_for_target("org/Model \"7B\"").to_bytes()).unwrap(),
            "{ \"messages\" : [ {\"role\":\"user\",\"content\":\"h\\u00e9 \\\"x\\\"\"} ],\n  \
             \"model\":\"org/Model \\\"7B\\\"\", \"temperature\": 1.50e0 }"
        );
        // Passthrough routes splice the same way.
        let req = passthrough(b"{\"input\": [1,2], \"model\" :\"m\",\"stream\":true}").unwrap();
        assert_eq!(
            &req.body_for_target("t").to_bytes()[..],
            b"{\"input\": [1,2], \"model\" :\"t\",\"stream\":true}"
        );
    }

    // A second `model` (or any repeated top-level member) is refused: the
    // Edge would route on one and the provider might read the other.
    #[test]
    fn repeated_top_level_members_are_refused() {
        let e = chat(br#"{"model":"cheap","messages":[],"model":"expensive"}"#).unwrap_err();
        assert_eq!(
            (e.status, e.message.as_str()),
            (
                400,
                "The request body has the member `model` more than once."
            )
        );
        assert!(passthrough(br#"{"model":"a","\u006dodel":"b"}"#).is_err());
    }

    // Nesting, value count and top-level members are bounded before
    // anything is parsed; the refusal is a 400 with code `json_too_complex`.
    #[test]
    fn json_limits_are_enforced() {
        let limits = JsonLimits {
            max_depth: 4,
            max_elements: 6,
            max_members: 3,
        };
        let parse = |b: &'static [u8]| ChatRequest::parse(Bytes::from_static(b), &limits);
        let ok = parse(br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#);
        assert!(ok.is_ok());
        let deep = parse(br#"{"model":"m","messages":[{"content":[{"text":"x"}]}]}"#).unwrap_err();
        assert_eq!(deep.status, 400);
        assert_eq!(deep.code.as_deref(), Some("json_too_complex"));
        assert!(deep.is_json_limit());
        assert_eq!(
            deep.message,
            "The request body nests arrays and objects deeper than 4 levels."
        );
        let wide = parse(br#"{"model":"m","messages":[1,2,3,4,5]}"#).unwrap_err();
        assert_eq!(
            (wide.message.as_str(), wide.is_json_limit()),
            ("The request body has more than 6 JSON values.", true)
        );
        let members = parse(br#"{"model":"m","messages":[],"a":1,"b":2}"#).unwrap_err();
        assert_eq!(
            (
                members.status,
                members.message.as_str(),
                members.code.as_deref()
            ),
            (
                400,
                "The request body has more than 3 top-level members.",
                Some("json_too_complex")
            )
        );
        assert!(!chat(b"{").unwrap_err().is_json_limit());
    }

    // Messages are read leniently for the normalized path, as before: a
    // member of the wrong type reads as empty rather than failing the run.
    #[test]
    fn run_input_reads_odd_messages_leniently() {
        let req = chat(
            br#"{"model":"m","messages":["not an object",{"role":7,"content":null,"name":"n","tool_calls":[{"id":"c"}]}],"stop":["a",1,"b"],"max_completion_tokens":null,"max_tokens":9}"#,
        )
        .unwrap();
        let input = req.run_input();
        assert_eq!(input.messages.len(), 2);
        assert_eq!(input.messages[0], pb::ChatMessage::default());
        assert_eq!(input.messages[1].role, "");
        assert_eq!(input.messages[1].name, "n");
        assert_eq!(&input.messages[1].tool_calls_json[..], br#"[{"id":"c"}]"#);
        assert_eq!(input.stop, vec!["a".to_string(), "b".to_string()]);
        // max_completion_tokens wins when present, even as null.
        assert_eq!(input.max_tokens, None);
        assert_eq!(req.estimated_prompt_tokens(), 0);
        let long = chat(
            br#"{"model":"m","messages":[{"content":"abcdefgh"},{"content":[{"text":"abcd"}]}]}"#,
        )
        .unwrap();
        assert_eq!(long.estimated_prompt_tokens(), 3);
        assert!(!long.include_usage());
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

    // CONTRACT: U5 — passthrough bodies keep every field but `model`.
    #[test]
    fn passthrough_rewrites_model_only() {
        let r = passthrough(br#"{"model":"pub","input":"hi","stream":true}"#).unwrap();
        assert!(r.stream);
        assert_eq!(
            &r.body_for_target("t").to_bytes()[..],
            br#"{"model":"t","input":"hi","stream":true}"#
        );
        assert_eq!(passthrough(b"{}").unwrap_err().status, 400);
    }

    #[test]
    fn hop_by_hop_headers() {
        assert!(is_not_relayed("Transfer-Encoding"));
        assert!(is_not_relayed("content-length"));
        assert!(is_not_relayed("Proxy-Authenticate"));
        assert!(!is_not_relayed("content-type"));
        assert!(!is_not_relayed("x-request-id"));
    }
}
