//! `POST /v1/embeddings` for an Ollama provider: the client's OpenAI
//! request read into a normalized embeddings run ([`EmbeddingsRun`]), and
//! the run's `complete` turned into the answer OpenAI gives
//! ([`EmbeddingsAnswer`]). Pure: no sockets, no state.
//!
//! ```text
//! {"model":M,"input":"a"|["a","b"],"encoding_format"?,"dimensions"?}
//!    ──EmbeddingsRun::parse──► RunInput{embed_input, dimensions}
//! complete{embeddings (packed f32 LE), embedding_dimensions, usage P}
//!    ──EmbeddingsAnswer::on_event──►
//! {"object":"list","data":[{"object":"embedding","index":i,"embedding":[…]|"<base64>"}],
//!  "model":M,"usage":{"prompt_tokens":P,"total_tokens":P}}
//! ```
//!
//! `M` in the answer is the client's model name. Token-id inputs (an array
//! of integers, or of arrays of them) have no Ollama form: a 400 naming
//! `input`. `base64` is the standard base64 of each vector's
//! little-endian `f32` bytes, as OpenAI sends it.

use bytes::Bytes;
use iop_wire::pb;
use serde::Serialize;
use serde_json::Value;

use super::error::GatewayError;

/// Most texts one request may embed (OpenAI's own limit).
pub const MAX_EMBED_INPUTS: usize = 2048;

/// An embeddings request as a normalized run takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingsRun {
    /// The texts, in order.
    pub inputs: Vec<String>,
    /// The vector length asked for.
    pub dimensions: Option<u32>,
    /// `encoding_format: "base64"`.
    pub base64: bool,
}

impl EmbeddingsRun {
    /// Reads the request's members (`member(name)`: its raw JSON text, if
    /// present); `Err` is the 400 the client gets.
    pub fn parse<'a>(member: impl Fn(&str) -> Option<&'a str>) -> Result<Self, GatewayError> {
        let value = |name: &'static str| -> Result<Value, GatewayError> {
            match member(name) {
                None => Ok(Value::Null),
                Some(raw) => serde_json::from_str(raw).map_err(|_| {
                    GatewayError::invalid_request(
                        format!("`{name}` is not valid JSON."),
                        Some(name),
                    )
                }),
            }
        };
        let inputs = inputs(value("input")?)?;
        let base64 = match value("encoding_format")? {
            Value::Null => false,
            Value::String(f) if f == "float" => false,
            Value::String(f) if f == "base64" => true,
            _ => {
                return Err(GatewayError::invalid_request(
                    "`encoding_format` must be \"float\" or \"base64\".",
                    Some("encoding_format"),
                ))
            }
        };
        let dimensions = match value("dimensions")? {
            Value::Null => None,
            v => Some(
                v.as_u64()
                    .and_then(|d| u32::try_from(d).ok())
                    .filter(|&d| d > 0)
                    .ok_or_else(|| {
                        GatewayError::invalid_request(
                            "`dimensions` must be a positive integer.",
                            Some("dimensions"),
                        )
                    })?,
            ),
        };
        Ok(Self {
            inputs,
            dimensions,
            base64,
        })
    }

    /// The run's input.
    pub fn run_input(&self) -> pb::RunInput {
        pb::RunInput {
            embed_input: self.inputs.clone(),
            dimensions: self.dimensions,
            ..Default::default()
        }
    }
}

/// The texts of `input`: a string, or a non-empty array of strings.
fn inputs(input: Value) -> Result<Vec<String>, GatewayError> {
    let shape = || {
        GatewayError::invalid_request(
            "`input` must be a string or an array of strings.",
            Some("input"),
        )
    };
    let texts = match input {
        Value::String(text) => vec![text],
        Value::Array(items) if items.is_empty() => {
            return Err(GatewayError::invalid_request(
                "`input` must not be empty.",
                Some("input"),
            ))
        }
        Value::Array(items) => {
            let token_ids = items.iter().all(|item| match item {
                Value::Number(n) => n.is_u64(),
                Value::Array(ids) => ids.iter().all(Value::is_u64),
                _ => false,
            });
            if token_ids {
                return Err(GatewayError::invalid_request(
                    "Token-id `input` cannot be embedded by an Ollama provider; send text.",
                    Some("input"),
                ));
            }
            items
                .into_iter()
                .map(|item| match item {
                    Value::String(text) => Ok(text),
                    _ => Err(shape()),
                })
                .collect::<Result<_, _>>()?
        }
        _ => return Err(shape()),
    };
    if texts.len() > MAX_EMBED_INPUTS {
        return Err(GatewayError::invalid_request(
            format!("`input` may hold at most {MAX_EMBED_INPUTS} texts."),
            Some("input"),
        ));
    }
    Ok(texts)
}

/// How an embeddings run ends for the client.
#[derive(Debug, Clone, PartialEq)]
pub enum Embedded {
    /// 200 with this JSON body.
    Done(Bytes),
    /// The run failed: its failure code and message.
    Failed {
        /// `failure_code` (`provider_error` when none).
        code: String,
        /// The legacy error string.
        message: String,
    },
}

/// Builds the OpenAI answer of one embeddings run from its events.
#[derive(Debug, Clone)]
pub struct EmbeddingsAnswer {
    model: String,
    base64: bool,
    inputs: usize,
}

impl EmbeddingsAnswer {
    /// The answer to `run` for the client's `model`.
    pub fn new(model: &str, run: &EmbeddingsRun) -> Self {
        Self {
            model: model.to_string(),
            base64: run.base64,
            inputs: run.inputs.len(),
        }
    }

    /// Feeds one event; the answer at the terminal.
    pub fn on_event(&self, ev: &pb::RunEvent) -> Option<Embedded> {
        match ev.r#type() {
            pb::RunEventType::Complete => Some(self.complete(ev)),
            pb::RunEventType::Error | pb::RunEventType::Cancelled => Some(Embedded::Failed {
                code: if ev.failure_code.is_empty() {
                    "provider_error".into()
                } else {
                    ev.failure_code.clone()
                },
                message: ev.error.clone(),
            }),
            _ => None,
        }
    }

    fn complete(&self, ev: &pb::RunEvent) -> Embedded {
        let vectors = match iop_wire::embedding::unpack(&ev.embeddings, ev.embedding_dimensions) {
            Ok(v) if v.len() == self.inputs => v,
            Ok(v) => {
                return Embedded::Failed {
                    code: "provider_error".into(),
                    message: format!("{} embeddings for {} inputs", v.len(), self.inputs),
                }
            }
            Err(e) => {
                return Embedded::Failed {
                    code: "provider_error".into(),
                    message: e.to_string(),
                }
            }
        };
        let prompt_tokens = ev.usage.as_ref().map_or(0, |u| u.prompt_tokens);
        let data = vectors
            .into_iter()
            .enumerate()
            .map(|(index, vector)| Item {
                object: "embedding",
                index,
                embedding: if self.base64 {
                    Vector::Base64(base64_vector(&vector))
                } else {
                    Vector::Float(vector)
                },
            })
            .collect();
        let list = List {
            object: "list",
            data,
            model: &self.model,
            usage: UsageWire {
                prompt_tokens,
                total_tokens: prompt_tokens,
            },
        };
        // Strings, integers and finite `f32`s (from little-endian bytes a
        // NaN may come; serde_json writes it as `null`): cannot fail.
        Embedded::Done(Bytes::from(serde_json::to_vec(&list).unwrap_or_default()))
    }
}

// Serialized through these types, not `serde_json::Value`, so an `f32`
// keeps its shortest form (`-0.9406856`), as OpenAI writes it, not its
// widened `f64` digits.
#[derive(Serialize)]
struct List<'a> {
    object: &'static str,
    data: Vec<Item>,
    model: &'a str,
    usage: UsageWire,
}

#[derive(Serialize)]
struct Item {
    object: &'static str,
    index: usize,
    embedding: Vector,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct UsageWire {
    prompt_tokens: u64,
    total_tokens: u64,
}

/// Standard base64 (RFC 4648, padded) of `vector`'s little-endian `f32`
/// bytes.
pub fn base64_vector(vector: &[f32]) -> String {
    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
    iop_engine::base64::encode(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<EmbeddingsRun, GatewayError> {
        let value: serde_json::Map<String, Value> =
            serde_json::from_str(body).unwrap_or_else(|e| panic!("test body {body}: {e}"));
        let raw: Vec<(String, String)> =
            value.into_iter().map(|(k, v)| (k, v.to_string())).collect();
        EmbeddingsRun::parse(|name| raw.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()))
    }

    fn refused(body: &str) -> (String, Option<&'static str>) {
        let e = parse(body).expect_err("refused");
        assert_eq!(e.status, 400);
        (e.message.clone(), e.param)
    }

    #[test]
    fn text_inputs_become_the_run_input() {
        let run = parse(r#"{"model":"m","input":"one text"}"#).unwrap();
        assert_eq!(
            run,
            EmbeddingsRun {
                inputs: vec!["one text".into()],
                dimensions: None,
                base64: false
            }
        );
        let run =
            parse(r#"{"model":"m","input":["a","b c"],"encoding_format":"base64","dimensions":3}"#)
                .unwrap();
        assert_eq!(
            run.run_input(),
            pb::RunInput {
                embed_input: vec!["a".into(), "b c".into()],
                dimensions: Some(3),
                ..Default::default()
            }
        );
        assert!(run.base64);
        assert!(
            !parse(r#"{"input":"x","encoding_format":"float"}"#)
                .unwrap()
                .base64
        );
    }

    #[test]
    fn token_ids_and_bad_members_are_a_400_naming_the_member() {
        let ids = "Token-id `input` cannot be embedded by an Ollama provider; send text.";
        assert_eq!(refused(r#"{"input":[1,2,3]}"#), (ids.into(), Some("input")));
        assert_eq!(
            refused(r#"{"input":[[1,2],[3]]}"#),
            (ids.into(), Some("input"))
        );
        let shape = "`input` must be a string or an array of strings.";
        assert_eq!(
            refused(r#"{"input":["a",1]}"#),
            (shape.into(), Some("input"))
        );
        assert_eq!(refused(r#"{"model":"m"}"#), (shape.into(), Some("input")));
        assert_eq!(
            refused(r#"{"input":[]}"#),
            ("`input` must not be empty.".into(), Some("input"))
        );
        assert_eq!(
            refused(r#"{"input":"a","encoding_format":"hex"}"#).1,
            Some("encoding_format")
        );
        assert_eq!(
            refused(r#"{"input":"a","dimensions":0}"#).1,
            Some("dimensions")
        );
        assert_eq!(
            refused(r#"{"input":"a","dimensions":-4}"#).1,
            Some("dimensions")
        );
    }

    fn complete(vectors: &[&[f32]], prompt_tokens: u64) -> pb::RunEvent {
        pb::RunEvent {
            run_id: "r".into(),
            r#type: pb::RunEventType::Complete as i32,
            embeddings: iop_wire::embedding::pack(vectors.iter().copied()),
            embedding_dimensions: vectors.first().map_or(0, |v| v.len() as u32),
            usage: Some(Box::new(pb::Usage {
                prompt_tokens,
                completion_tokens: 0,
                total_tokens: prompt_tokens,
            })),
            ..Default::default()
        }
    }

    fn run(inputs: usize, base64: bool) -> EmbeddingsRun {
        EmbeddingsRun {
            inputs: vec![String::new(); inputs],
            dimensions: None,
            base64,
        }
    }

    // The float answer, byte for byte as OpenAI writes it: member order,
    // the client's model, each f32 in its shortest form.
    #[test]
    fn a_complete_is_the_openai_list() {
        let answer = EmbeddingsAnswer::new("public-name", &run(2, false));
        let ev = complete(&[&[-0.9406856, 0.5], &[1.0, -2.5e-8]], 3);
        assert_eq!(
            answer.on_event(&ev),
            Some(Embedded::Done(Bytes::from_static(
                br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[-0.9406856,0.5]},{"object":"embedding","index":1,"embedding":[1.0,-2.5e-8]}],"model":"public-name","usage":{"prompt_tokens":3,"total_tokens":3}}"#
            )))
        );
        let start = pb::RunEvent {
            r#type: pb::RunEventType::Start as i32,
            ..Default::default()
        };
        assert_eq!(answer.on_event(&start), None);
    }

    // base64: the standard base64 of the little-endian f32 bytes.
    #[test]
    fn base64_is_of_the_little_endian_f32_bytes() {
        // 1.0 = 00 00 80 3f, -0.5 = 00 00 00 bf.
        assert_eq!(base64_vector(&[1.0, -0.5]), "AACAPwAAAL8=");
        assert_eq!(base64_vector(&[1.0]), "AACAPw==");
        assert_eq!(base64_vector(&[]), "");
        let answer = EmbeddingsAnswer::new("m", &run(1, true));
        assert_eq!(
            answer.on_event(&complete(&[&[1.0, -0.5]], 1)),
            Some(Embedded::Done(Bytes::from_static(
                br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":"AACAPwAAAL8="}],"model":"m","usage":{"prompt_tokens":1,"total_tokens":1}}"#
            )))
        );
    }

    #[test]
    fn a_wrong_count_or_an_error_is_a_failure() {
        let answer = EmbeddingsAnswer::new("m", &run(2, false));
        assert_eq!(
            answer.on_event(&complete(&[&[1.0]], 1)),
            Some(Embedded::Failed {
                code: "provider_error".into(),
                message: "1 embeddings for 2 inputs".into()
            })
        );
        let mut ragged = complete(&[&[1.0, 2.0], &[3.0, 4.0]], 1);
        ragged.embedding_dimensions = 3;
        assert!(matches!(
            answer.on_event(&ragged),
            Some(Embedded::Failed { code, .. }) if code == "provider_error"
        ));
        let error = pb::RunEvent {
            r#type: pb::RunEventType::Error as i32,
            failure_code: "response_stalled".into(),
            error: "stalled".into(),
            ..Default::default()
        };
        assert_eq!(
            answer.on_event(&error),
            Some(Embedded::Failed {
                code: "response_stalled".into(),
                message: "stalled".into()
            })
        );
    }
}
