//! The Ollama adapter: a normalized run as `POST /api/chat` with
//! `"stream": true`, its NDJSON answer parsed into [`RunOutput`]s.
//!
//! ```text
//! RunInput ──chat_body──► {"model","messages","stream":true,"tools"?,"options"?}
//! 200 ─► start
//! {"message":{"content":"Hel"},"done":false}            ─► delta "Hel"
//! {"message":{"tool_calls":[{"function":{…}}]}, …}       ─► (kept for complete; progress)
//! {"done":true,"done_reason":"stop","prompt_eval_count":P,"eval_count":N}
//!                                                       ─► complete {usage P/N, finish_reason,
//!                                                            metadata: done_reason, openai_tool_calls}
//! {"error":"…"} (any time)                              ─► error (provider_error, no ExecutionFailure, W6)
//! ```
//!
//! Request mapping: messages keep role and content; an assistant's OpenAI
//! `tool_calls` become Ollama tool calls whose `arguments` is a JSON object;
//! a `tool` message gets `tool_name` from the call it answers. Tools pass
//! as they are (Ollama takes the OpenAI function shape) unless
//! `tool_choice` is `"none"`. `max_tokens` → `options.num_predict`,
//! `temperature`, `top_p`, `stop`, `seed` → `options`.
//!
//! Answer mapping: Ollama tool calls (arguments a JSON object) become
//! `metadata["openai_tool_calls"]`, an array of OpenAI tool calls with
//! `arguments` as a JSON string and ids `call_<n>` unless Ollama gave one
//! (E4). `finish_reason` is `tool_calls` when there are calls, `length`
//! for `done_reason` `length`, else `stop`; the raw `done_reason` is kept in
//! `metadata["done_reason"]`.
//!
//! An embeddings run (`RunRequest.operation = "embeddings"`) is one
//! `POST /api/embed`, answered as one JSON document:
//!
//! ```text
//! RunInput ──embed_body──► {"model","input":[…],"dimensions"?}
//! 200 {"embeddings":[[…],…],"prompt_eval_count":P}
//!        ─► start, complete {embeddings packed f32 LE, dimensions, usage P/0/P}
//! non-2xx, malformed, ragged, or not one vector per input ─► error (provider_error)
//! ```

use std::collections::HashMap;
use std::rc::Rc;

use bytes::Bytes;
use iop_engine::http::NdjsonSplitter;
use iop_wire::pb;
use serde_json::{json, Map, Value};

use super::channel::OutputTx;
use super::normalize::{
    self, CallFailure, Framing, InputError, ItemParser, MAX_ERROR_BODY_BYTES, MAX_EVENT_BYTES,
    MAX_JSON_BODY_BYTES, META_DONE_REASON,
};
use super::output::RunOutput;
use super::pool::ProviderPool;
use crate::adapters::Endpoint;
use crate::codes;

/// The chat path under the adapter's base URL.
pub const CHAT_PATH: &str = "/api/chat";

/// The `/api/chat` request body for `target` (see the module docs).
pub fn chat_body(target: &str, input: &pb::RunInput) -> Result<Bytes, InputError> {
    let mut messages = Vec::with_capacity(input.messages.len());
    // Tool call id → function name, to name the tool a result answers.
    let mut call_names: HashMap<String, String> = HashMap::new();
    for (index, m) in input.messages.iter().enumerate() {
        let mut msg = Map::new();
        msg.insert("role".into(), json!(m.role));
        msg.insert("content".into(), json!(m.content));
        if let Some(calls) = normalize::json_field("tool_calls_json", &m.tool_calls_json)? {
            let calls = calls.as_array().cloned().unwrap_or_default();
            let mut mapped = Vec::with_capacity(calls.len());
            for (call, c) in calls.iter().enumerate() {
                let function = c.get("function");
                let name = function
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or(InputError::BadToolCall { index, call })?;
                let arguments = match function.and_then(|f| f.get("arguments")) {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
                    Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => return Err(InputError::ToolArguments { index, call }),
                    },
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(_) => return Err(InputError::ToolArguments { index, call }),
                };
                if let Some(id) = c.get("id").and_then(Value::as_str) {
                    call_names.insert(id.to_string(), name.to_string());
                }
                mapped.push(json!({"function": {"name": name, "arguments": arguments}}));
            }
            if !mapped.is_empty() {
                msg.insert("tool_calls".into(), Value::Array(mapped));
            }
        }
        if m.role == "tool" {
            if let Some(name) = call_names.get(&m.tool_call_id) {
                msg.insert("tool_name".into(), json!(name));
            }
        }
        messages.push(Value::Object(msg));
    }
    let mut body = Map::new();
    body.insert("model".into(), json!(target));
    body.insert("messages".into(), Value::Array(messages));
    body.insert("stream".into(), json!(true));
    let choice = normalize::json_field("tool_choice_json", &input.tool_choice_json)?;
    if let Some(tools) = normalize::tools(input)? {
        if choice.as_ref().and_then(Value::as_str) != Some("none") {
            body.insert("tools".into(), Value::Array(tools));
        }
    }
    let mut options = Map::new();
    if let Some(t) = input.temperature {
        options.insert("temperature".into(), json!(t));
    }
    if let Some(p) = input.top_p {
        options.insert("top_p".into(), json!(p));
    }
    if let Some(n) = input.max_tokens {
        options.insert("num_predict".into(), json!(n));
    }
    if !input.stop.is_empty() {
        options.insert("stop".into(), json!(input.stop));
    }
    if let Some(s) = input.seed {
        options.insert("seed".into(), json!(s));
    }
    if !options.is_empty() {
        body.insert("options".into(), Value::Object(options));
    }
    Ok(Bytes::from(Value::Object(body).to_string()))
}

/// The embed path under the adapter's base URL.
pub const EMBED_PATH: &str = "/api/embed";

/// Most bytes of packed vectors one embeddings run may carry back (they
/// travel in one frame, below the frame cap).
pub const MAX_EMBEDDING_BYTES: usize = 8 * 1024 * 1024;

/// The `/api/embed` request body for `target`: the input texts, always as
/// an array, and `dimensions` when asked for.
pub fn embed_body(target: &str, input: &pb::RunInput) -> Result<Bytes, InputError> {
    if input.embed_input.is_empty() {
        return Err(InputError::NoEmbedInput);
    }
    let mut body = Map::new();
    body.insert("model".into(), json!(target));
    body.insert("input".into(), json!(input.embed_input));
    if let Some(d) = input.dimensions {
        body.insert("dimensions".into(), json!(d));
    }
    Ok(Bytes::from(Value::Object(body).to_string()))
}

/// The terminal of an `/api/embed` answer to `inputs` texts: the vectors
/// packed ([`iop_wire::embedding`]) with usage `prompt_eval_count`, or the
/// failure (the answer is no such document, its vectors differ in length,
/// or it has not one vector per input).
pub fn embed_answer(body: &[u8], inputs: usize) -> RunOutput {
    #[derive(serde::Deserialize)]
    struct Answer {
        embeddings: Vec<Vec<f32>>,
        #[serde(default)]
        prompt_eval_count: u64,
    }
    let failed = |message: String| RunOutput::Failed {
        code: codes::PROVIDER_ERROR,
        message,
    };
    let answer: Answer = match serde_json::from_slice(body) {
        Ok(a) => a,
        Err(e) => return failed(format!("ollama: malformed embed answer: {e}")),
    };
    if answer.embeddings.len() != inputs {
        return failed(format!(
            "ollama: {} embeddings for {inputs} inputs",
            answer.embeddings.len()
        ));
    }
    let width = answer.embeddings.first().map_or(0, Vec::len);
    if width == 0 || answer.embeddings.iter().any(|v| v.len() != width) {
        return failed("ollama: embeddings of unequal or zero length".into());
    }
    if inputs.saturating_mul(width).saturating_mul(4) > MAX_EMBEDDING_BYTES {
        return failed(format!(
            "ollama: {inputs} embeddings of {width} values exceed {MAX_EMBEDDING_BYTES} bytes"
        ));
    }
    let Ok(dimensions) = u32::try_from(width) else {
        return failed("ollama: embeddings too long".into());
    };
    RunOutput::Embedded {
        embeddings: iop_wire::embedding::pack(answer.embeddings.iter().map(Vec::as_slice)),
        dimensions,
        usage: normalize::usage(answer.prompt_eval_count, 0, 0),
    }
}

/// Posts `body` to `path` of the adapter's Ollama server and sends `start`
/// at a 2xx head: the exchange, positioned at the answer's body; `None`
/// when the attempt is gone. A non-2xx answer is the failure terminal (its
/// body read, bounded, into the message).
async fn post(
    pool: &Rc<ProviderPool>,
    adapter: &Endpoint,
    path: &str,
    accept: &str,
    body: Bytes,
    out: &OutputTx<RunOutput>,
) -> Result<Option<normalize::Exchange>, CallFailure> {
    let mut exchange = normalize::post_json(pool, adapter, path, accept, &[], body).await?;
    let status = exchange.head.status;
    if !(200..300).contains(&status) {
        let body = exchange
            .body(MAX_ERROR_BODY_BYTES)
            .await
            .unwrap_or_default();
        // provider pool: the error body was read to its end.
        exchange.client.release();
        return Err((
            codes::PROVIDER_ERROR,
            normalize::status_message("ollama", status, &body),
        ));
    }
    if !out
        .send(RunOutput::Start {
            metadata: HashMap::new(),
        })
        .await
    {
        return Ok(None);
    }
    Ok(Some(exchange))
}

/// Runs one embeddings request against the adapter's Ollama server on a
/// connection of `pool`: `start` at its 2xx head, then the terminal of its
/// whole answer. `Err` is the failure terminal. The connection goes back to
/// the pool once the answer was read to its end.
pub async fn embed(
    pool: &Rc<ProviderPool>,
    adapter: &Endpoint,
    target: &str,
    input: &pb::RunInput,
    out: &OutputTx<RunOutput>,
) -> Result<(), CallFailure> {
    let body = embed_body(target, input)
        .map_err(|e| (codes::INVALID_INPUT, format!("ollama request: {e}")))?;
    let path = adapter.base_url.join(EMBED_PATH);
    let Some(mut exchange) = post(pool, adapter, &path, "application/json", body, out).await?
    else {
        return Ok(());
    };
    let answer = exchange.body(MAX_JSON_BODY_BYTES).await?;
    // provider pool: the answer was read to its end.
    exchange.client.release();
    out.send(embed_answer(&answer, input.embed_input.len()))
        .await;
    Ok(())
}

/// The NDJSON answer's parser: one line in, the outputs it means out.
/// Nothing is produced after a terminal.
#[derive(Debug, Default)]
pub struct ChatStream {
    calls: Vec<Value>,
    ended: bool,
}

impl ChatStream {
    /// A parser at the start of an answer.
    pub fn new() -> Self {
        Self::default()
    }

    fn fail(&mut self, message: String) -> Vec<RunOutput> {
        self.ended = true;
        vec![RunOutput::Failed {
            code: codes::PROVIDER_ERROR,
            message,
        }]
    }

    /// The outputs of one NDJSON line.
    pub fn on_line(&mut self, line: &[u8]) -> Vec<RunOutput> {
        if self.ended {
            return Vec::new();
        }
        let value: Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(e) => return self.fail(format!("ollama: malformed stream line: {e}")),
        };
        if let Some(error) = value.get("error") {
            let message = error
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| error.to_string());
            return self.fail(format!("ollama: {message}"));
        }
        let mut out = Vec::new();
        let message = value.get("message");
        let mut progressed = false;
        if let Some(calls) = message
            .and_then(|m| m.get("tool_calls"))
            .and_then(Value::as_array)
        {
            for c in calls {
                let function = c.get("function");
                let Some(name) = function.and_then(|f| f.get("name")).and_then(Value::as_str)
                else {
                    continue;
                };
                let arguments = match function.and_then(|f| f.get("arguments")) {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => v.to_string(),
                    None => "{}".to_string(),
                };
                let id = c
                    .get("id")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("call_{}", self.calls.len()));
                self.calls
                    .push(normalize::openai_tool_call(&id, name, &arguments));
                progressed = true;
            }
        }
        let content = message
            .and_then(|m| m.get("content"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !content.is_empty() {
            out.push(RunOutput::Delta {
                text: content.to_string(),
                usage: None,
            });
        } else if progressed {
            out.push(RunOutput::Progress);
        }
        if value.get("done").and_then(Value::as_bool) == Some(true) {
            self.ended = true;
            let done_reason = value.get("done_reason").and_then(Value::as_str);
            let count = |k: &str| value.get(k).and_then(Value::as_u64).unwrap_or(0);
            let finish_reason = if !self.calls.is_empty() {
                "tool_calls"
            } else if done_reason == Some("length") {
                "length"
            } else {
                "stop"
            };
            let mut metadata = HashMap::new();
            if let Some(r) = done_reason {
                metadata.insert(META_DONE_REASON.to_string(), r.to_string());
            }
            normalize::tool_calls_metadata(std::mem::take(&mut self.calls), &mut metadata);
            out.push(RunOutput::Complete {
                finish_reason: finish_reason.to_string(),
                usage: Some(normalize::usage(
                    count("prompt_eval_count"),
                    count("eval_count"),
                    0,
                )),
                metadata,
            });
        }
        out
    }
}

/// Runs one chat against the adapter's Ollama server on a connection of
/// `pool`, sending the outputs as they are parsed. `Err` is the failure
/// terminal. The connection goes back to the pool only after a clean end
/// of the body.
pub async fn call(
    pool: &Rc<ProviderPool>,
    adapter: &Endpoint,
    target: &str,
    input: &pb::RunInput,
    out: &OutputTx<RunOutput>,
) -> Result<(), CallFailure> {
    let body = chat_body(target, input)
        .map_err(|e| (codes::INVALID_INPUT, format!("ollama request: {e}")))?;
    let path = adapter.base_url.join(CHAT_PATH);
    let Some(exchange) = post(pool, adapter, &path, "application/x-ndjson", body, out).await?
    else {
        return Ok(());
    };
    let mut stream = ChatStream::new();
    exchange
        .relay_items(
            Framing::Ndjson(NdjsonSplitter::new(MAX_EVENT_BYTES)),
            &mut stream,
            out,
        )
        .await
}

impl ItemParser for ChatStream {
    fn on_item(&mut self, item: &[u8]) -> Vec<RunOutput> {
        self.on_line(item)
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
        self.fail("ollama: the stream ended before its done line".to_string())
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

    // CONTRACT: E3 — the normalized input becomes Ollama's request:
    // messages (tool calls with object arguments, tool results named),
    // tools, and options.
    #[test]
    fn request_mapping_is_exact() {
        let input = pb::RunInput {
            messages: vec![
                msg("system", "be brief"),
                msg("user", "weather?"),
                pb::ChatMessage {
                    tool_calls_json: Bytes::from_static(
                        br#"[{"id":"call_9","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\"}"}}]"#,
                    ),
                    ..msg("assistant", "")
                },
                pb::ChatMessage {
                    tool_call_id: "call_9".into(),
                    ..msg("tool", "sunny")
                },
            ],
            tools_json: Bytes::from_static(br#"[{"type":"function","function":{"name":"get_weather"}}]"#),
            max_tokens: Some(5),
            temperature: Some(0.5),
            top_p: Some(0.9),
            stop: vec!["END".into()],
            seed: Some(7),
            ..Default::default()
        };
        let body = chat_body("llama3:8b", &input).unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            concat!(
                r#"{"model":"llama3:8b","messages":["#,
                r#"{"role":"system","content":"be brief"},"#,
                r#"{"role":"user","content":"weather?"},"#,
                r#"{"role":"assistant","content":"","tool_calls":[{"function":{"name":"get_weather","arguments":{"city":"Seoul"}}}]},"#,
                r#"{"role":"tool","content":"sunny","tool_name":"get_weather"}],"#,
                r#""stream":true,"tools":[{"type":"function","function":{"name":"get_weather"}}],"#,
                r#""options":{"temperature":0.5,"top_p":0.9,"num_predict":5,"stop":["END"],"seed":7}}"#
            )
        );
        let plain = chat_body("m", &pb::RunInput::default()).unwrap();
        assert_eq!(&plain[..], br#"{"model":"m","messages":[],"stream":true}"#);
    }

    #[test]
    fn request_mapping_rejects_bad_tool_calls() {
        let bad_args = pb::RunInput {
            messages: vec![pb::ChatMessage {
                tool_calls_json: Bytes::from_static(
                    br#"[{"function":{"name":"f","arguments":"[1]"}}]"#,
                ),
                ..msg("assistant", "")
            }],
            ..Default::default()
        };
        assert_eq!(
            chat_body("m", &bad_args),
            Err(InputError::ToolArguments { index: 0, call: 0 })
        );
        let no_name = pb::RunInput {
            messages: vec![pb::ChatMessage {
                tool_calls_json: Bytes::from_static(br#"[{"function":{}}]"#),
                ..msg("assistant", "")
            }],
            ..Default::default()
        };
        assert_eq!(
            chat_body("m", &no_name),
            Err(InputError::BadToolCall { index: 0, call: 0 })
        );
        let none_choice = pb::RunInput {
            tools_json: Bytes::from_static(br#"[{"type":"function","function":{"name":"f"}}]"#),
            tool_choice_json: Bytes::from_static(br#""none""#),
            ..Default::default()
        };
        assert_eq!(
            &chat_body("m", &none_choice).unwrap()[..],
            br#"{"model":"m","messages":[],"stream":true}"#
        );
    }

    fn lines(stream: &mut ChatStream, input: &[&str]) -> Vec<RunOutput> {
        input
            .iter()
            .flat_map(|l| stream.on_line(l.as_bytes()))
            .collect()
    }

    // CONTRACT: E1 — content lines are deltas, the done line is the one
    // complete with usage and done_reason; nothing after it.
    #[test]
    fn text_stream_maps_to_deltas_and_complete() {
        let mut s = ChatStream::new();
        let out = lines(
            &mut s,
            &[
                r#"{"model":"m","message":{"role":"assistant","content":"Hel"},"done":false}"#,
                r#"{"model":"m","message":{"role":"assistant","content":""},"done":false}"#,
                r#"{"model":"m","message":{"role":"assistant","content":"lo"},"done":false}"#,
                r#"{"model":"m","message":{"role":"assistant","content":""},"done":true,"done_reason":"length","prompt_eval_count":26,"eval_count":2}"#,
                r#"{"model":"m","message":{"role":"assistant","content":"late"},"done":false}"#,
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
                RunOutput::Complete {
                    finish_reason: "length".into(),
                    usage: Some(pb::Usage {
                        prompt_tokens: 26,
                        completion_tokens: 2,
                        total_tokens: 28
                    }),
                    metadata: HashMap::from([("done_reason".to_string(), "length".to_string())]),
                },
            ]
        );
        assert!(s.on_end().is_empty());
    }

    // CONTRACT: E4 — Ollama tool calls (object arguments) become
    // openai_tool_calls with JSON-string arguments and call_<n> ids.
    #[test]
    fn tool_calls_become_openai_tool_calls() {
        let mut s = ChatStream::new();
        let out = lines(
            &mut s,
            &[
                r#"{"message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"get_weather","arguments":{"city":"Seoul","days":2}}}]},"done":false}"#,
                r#"{"message":{"role":"assistant","content":"","tool_calls":[{"id":"abc","function":{"name":"lookup","arguments":{}}}]},"done":false}"#,
                r#"{"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop","prompt_eval_count":3,"eval_count":1}"#,
            ],
        );
        assert_eq!(out[0], RunOutput::Progress);
        assert_eq!(out[1], RunOutput::Progress);
        let RunOutput::Complete {
            finish_reason,
            metadata,
            ..
        } = &out[2]
        else {
            panic!("expected complete, got {out:?}");
        };
        assert_eq!(finish_reason, "tool_calls");
        assert_eq!(
            metadata["openai_tool_calls"],
            r#"[{"id":"call_0","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Seoul\",\"days\":2}"}},{"id":"abc","type":"function","function":{"name":"lookup","arguments":"{}"}}]"#
        );
        assert_eq!(metadata["done_reason"], "stop");
    }

    // CONTRACT: W6 — a mid-stream error line, a malformed line or a body
    // that ends without done is an error terminal without ExecutionFailure
    // (RunOutput::Failed carries none).
    #[test]
    fn errors_end_the_run() {
        let mut s = ChatStream::new();
        let out = lines(
            &mut s,
            &[
                r#"{"message":{"role":"assistant","content":"a"},"done":false}"#,
                r#"{"error":"model runner crashed"}"#,
                r#"{"message":{"role":"assistant","content":"b"},"done":false}"#,
            ],
        );
        assert_eq!(
            out[1],
            RunOutput::Failed {
                code: codes::PROVIDER_ERROR,
                message: "ollama: model runner crashed".into()
            }
        );
        assert_eq!(out.len(), 2);
        let mut s = ChatStream::new();
        assert!(matches!(
            &s.on_line(b"{nope")[..],
            [RunOutput::Failed {
                code: codes::PROVIDER_ERROR,
                ..
            }]
        ));
        let mut s = ChatStream::new();
        assert!(
            s.on_line(br#"{"message":{"content":"x"},"done":false}"#)
                .len()
                == 1
        );
        assert_eq!(
            s.on_end(),
            vec![RunOutput::Failed {
                code: codes::PROVIDER_ERROR,
                message: "ollama: the stream ended before its done line".into()
            }]
        );
    }

    // The embeddings run's request: the texts always as an array, the
    // target as `model`, `dimensions` only when asked for.
    #[test]
    fn embed_request_mapping_is_exact() {
        let input = pb::RunInput {
            embed_input: vec!["one".into(), "two words".into()],
            dimensions: Some(3),
            ..Default::default()
        };
        assert_eq!(
            &embed_body("nomic-embed-text", &input).unwrap()[..],
            br#"{"model":"nomic-embed-text","input":["one","two words"],"dimensions":3}"#
        );
        let one = pb::RunInput {
            embed_input: vec!["x".into()],
            ..Default::default()
        };
        assert_eq!(
            &embed_body("m", &one).unwrap()[..],
            br#"{"model":"m","input":["x"]}"#
        );
        assert_eq!(
            embed_body("m", &pb::RunInput::default()),
            Err(InputError::NoEmbedInput)
        );
    }

    // The answer: the vectors packed as little-endian f32s, exactly the
    // values Ollama wrote, usage prompt_eval_count.
    #[test]
    fn embed_answer_packs_the_vectors() {
        let out = embed_answer(
            br#"{"model":"m","embeddings":[[1.0,-0.5],[0.25,-0.9406856]],"prompt_eval_count":5}"#,
            2,
        );
        let RunOutput::Embedded {
            embeddings,
            dimensions,
            usage,
        } = out
        else {
            panic!("expected embedded, got {out:?}");
        };
        assert_eq!(dimensions, 2);
        assert_eq!(
            iop_wire::embedding::unpack(&embeddings, 2),
            Ok(vec![vec![1.0, -0.5], vec![0.25, -0.9406856]])
        );
        assert_eq!(&embeddings[..8], &[0, 0, 0x80, 0x3f, 0, 0, 0, 0xbf]);
        assert_eq!(
            usage,
            pb::Usage {
                prompt_tokens: 5,
                completion_tokens: 0,
                total_tokens: 5
            }
        );
    }

    #[test]
    fn a_bad_embed_answer_is_a_provider_error() {
        let failed = |body: &[u8], inputs| match embed_answer(body, inputs) {
            RunOutput::Failed { code, message } => (code, message),
            other => panic!("expected failed, got {other:?}"),
        };
        assert_eq!(
            failed(br#"{"embeddings":[[1.0]]}"#, 2),
            (
                codes::PROVIDER_ERROR,
                "ollama: 1 embeddings for 2 inputs".into()
            )
        );
        assert_eq!(
            failed(br#"{"embeddings":[[1.0],[1.0,2.0]]}"#, 2).1,
            "ollama: embeddings of unequal or zero length"
        );
        assert_eq!(
            failed(br#"{"embeddings":[[]]}"#, 1).1,
            "ollama: embeddings of unequal or zero length"
        );
        assert!(failed(br#"{"error":"model not found"}"#, 1)
            .1
            .starts_with("ollama: malformed embed answer"));
    }

    #[test]
    fn a_single_non_streamed_object_is_delta_and_complete() {
        let mut s = ChatStream::new();
        let out = s.on_line(
            br#"{"message":{"role":"assistant","content":"all of it"},"done":true,"done_reason":"stop","prompt_eval_count":1,"eval_count":3}"#,
        );
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0],
            RunOutput::Delta {
                text: "all of it".into(),
                usage: None
            }
        );
        assert!(
            matches!(&out[1], RunOutput::Complete { finish_reason, .. } if finish_reason == "stop")
        );
    }
}
