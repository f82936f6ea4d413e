//! The mock's embeddings: OpenAI `POST /v1/embeddings` and Ollama
//! `POST /api/embed`, with the same vectors.
//!
//! # The deterministic vector rule
//!
//! An input is a text, or a list of token ids. Its seed is the text's
//! UTF-8 bytes, or for ids the text `ids:` followed by the ids in decimal
//! joined by `,` (`ids:1,2,3`). Component `i` of its vector is the `i`-th
//! value of [`super::digest::Stream::of`] the seed, through
//! [`Stream::next_unit`](super::digest::Stream::next_unit): a number in
//! `[-1, 1)`, exact in `f32`. `dimensions` (default [`DEFAULT_DIMENSIONS`],
//! at most [`MAX_DIMENSIONS`]) is the vector length. A text counts its
//! words as tokens, an id list its ids.
//!
//! OpenAI: `input` is a string, an array of strings, an array of token ids
//! or an array of such arrays; `encoding_format` `"float"` (the default)
//! gives the numbers, `"base64"` the little-endian `f32` bytes in standard
//! base64.
//!
//! ```text
//! {"object":"list","data":[{"object":"embedding","index":0,"embedding":[…]}],
//!  "model":M,"usage":{"prompt_tokens":P,"total_tokens":P}}
//! ```
//!
//! Ollama: `{"model","input"}` (a string or array of strings) →
//! `{"model":M,"embeddings":[[…]],"prompt_eval_count":P}`.

use serde::Serialize;
use serde_json::Value;

use super::digest::{self, Stream};
use super::openai::{error_body, word_count};

/// Vector length when the request names none.
pub const DEFAULT_DIMENSIONS: usize = 8;

/// The longest vector the mock makes (bounds the work a request causes).
pub const MAX_DIMENSIONS: usize = 4096;

/// One input to embed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmbedInput {
    /// A text.
    Text(String),
    /// Token ids.
    Ids(Vec<u64>),
}

impl EmbedInput {
    /// The bytes seeding its vector (see the module docs).
    pub fn seed(&self) -> Vec<u8> {
        match self {
            EmbedInput::Text(text) => text.as_bytes().to_vec(),
            EmbedInput::Ids(ids) => {
                let list: Vec<String> = ids.iter().map(u64::to_string).collect();
                format!("ids:{}", list.join(",")).into_bytes()
            }
        }
    }

    /// Tokens it counts for: words of a text, or ids.
    pub fn tokens(&self) -> u64 {
        match self {
            EmbedInput::Text(text) => word_count(text),
            EmbedInput::Ids(ids) => ids.len() as u64,
        }
    }

    /// Its vector of `dimensions` components.
    pub fn vector(&self, dimensions: usize) -> Vec<f32> {
        let mut stream = Stream::of(&self.seed());
        (0..dimensions).map(|_| stream.next_unit()).collect()
    }
}

fn ids_of(items: &[Value]) -> Option<Vec<u64>> {
    items.iter().map(Value::as_u64).collect()
}

/// The inputs of an OpenAI `input` value; `Err` is the 400 message.
pub fn parse_inputs(input: Option<&Value>, allow_ids: bool) -> Result<Vec<EmbedInput>, String> {
    const SHAPE: &str = "input must be a string, an array of strings, or token ids";
    match input {
        Some(Value::String(text)) => Ok(vec![EmbedInput::Text(text.clone())]),
        Some(Value::Array(items)) if items.is_empty() => Err("input must not be empty".into()),
        Some(Value::Array(items)) => {
            if items.iter().all(Value::is_string) {
                return Ok(items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(|t| EmbedInput::Text(t.to_string()))
                    .collect());
            }
            if !allow_ids {
                return Err("input must be a string or an array of strings".into());
            }
            if let Some(ids) = ids_of(items) {
                return Ok(vec![EmbedInput::Ids(ids)]);
            }
            items
                .iter()
                .map(|item| match item {
                    Value::Array(ids) => ids_of(ids).map(EmbedInput::Ids).ok_or(SHAPE.to_string()),
                    _ => Err(SHAPE.to_string()),
                })
                .collect()
        }
        _ => Err(if allow_ids {
            SHAPE.into()
        } else {
            "input must be a string or an array of strings".into()
        }),
    }
}

fn dimensions_of(value: &Value) -> Result<usize, String> {
    match value.get("dimensions") {
        None | Some(Value::Null) => Ok(DEFAULT_DIMENSIONS),
        Some(v) => v
            .as_u64()
            .and_then(|d| usize::try_from(d).ok())
            .filter(|d| (1..=MAX_DIMENSIONS).contains(d))
            .ok_or(format!(
                "dimensions must be an integer from 1 to {MAX_DIMENSIONS}"
            )),
    }
}

fn model_of(value: &Value) -> Result<String, String> {
    value
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or("model is required (a string)".into())
}

/// The `f32`s as little-endian bytes in standard base64.
pub fn base64_vector(vector: &[f32]) -> String {
    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
    digest::base64(&bytes)
}

/// `POST /v1/embeddings`: `(status, body)`.
pub fn openai(body: &[u8]) -> (u16, String) {
    match openai_inner(body) {
        Ok(body) => (200, body),
        Err(message) => (400, error_body(&message)),
    }
}

fn openai_inner(body: &[u8]) -> Result<String, String> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| format!("invalid embeddings request body: {e}"))?;
    let model = model_of(&value)?;
    let inputs = parse_inputs(value.get("input"), true)?;
    let dimensions = dimensions_of(&value)?;
    let base64 = match value.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(_) => return Err("encoding_format must be \"float\" or \"base64\"".into()),
    };
    let tokens: u64 = inputs.iter().map(EmbedInput::tokens).sum();
    let data = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            let vector = input.vector(dimensions);
            EmbeddingWire {
                object: "embedding",
                index,
                embedding: if base64 {
                    Embedding::Base64(base64_vector(&vector))
                } else {
                    Embedding::Float(vector)
                },
            }
        })
        .collect();
    Ok(to_json(&ListWire {
        object: "list",
        data,
        model,
        usage: UsageWire {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    }))
}

// Serialized through these types (not `serde_json::Value`) so an `f32`
// keeps its shortest form: `-0.9406856`, not its widened `f64` digits.
#[derive(Serialize)]
struct ListWire {
    object: &'static str,
    data: Vec<EmbeddingWire>,
    model: String,
    usage: UsageWire,
}

#[derive(Serialize)]
struct EmbeddingWire {
    object: &'static str,
    index: usize,
    embedding: Embedding,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Embedding {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct UsageWire {
    prompt_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
struct OllamaWire {
    model: String,
    embeddings: Vec<Vec<f32>>,
    prompt_eval_count: u64,
}

/// Serializes strings, numbers and finite floats, which cannot fail; an
/// impossible failure renders as `null`.
fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "null".to_string())
}

/// Ollama `POST /api/embed`: `(status, body)`; errors are `{"error": …}`.
pub fn ollama(body: &[u8]) -> (u16, String) {
    let result = (|| -> Result<String, String> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
        let model = model_of(&value)?;
        let inputs = parse_inputs(value.get("input"), false)?;
        let dimensions = dimensions_of(&value)?;
        let tokens: u64 = inputs.iter().map(EmbedInput::tokens).sum();
        let embeddings: Vec<Vec<f32>> = inputs.iter().map(|i| i.vector(dimensions)).collect();
        Ok(to_json(&OllamaWire {
            model,
            embeddings,
            prompt_eval_count: tokens,
        }))
    })();
    match result {
        Ok(body) => (200, body),
        Err(message) => (400, super::ollama::error_body(&message)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn vectors_are_deterministic_and_input_dependent() {
        let a = EmbedInput::Text("hello world".into());
        assert_eq!(a.vector(8), a.vector(8));
        assert_eq!(a.vector(3)[..], a.vector(8)[..3]);
        assert_ne!(
            a.vector(8),
            EmbedInput::Text("hello worle".into()).vector(8)
        );
        assert_eq!(EmbedInput::Ids(vec![1, 22]).seed(), b"ids:1,22");
        assert_eq!(a.tokens(), 2);
    }

    #[test]
    fn floats_keep_their_shortest_f32_form() {
        let (_, body) = openai(br#"{"model":"e","input":"q","dimensions":2}"#);
        let vector = EmbedInput::Text("q".into()).vector(2);
        let expected = format!(
            r#"{{"object":"list","data":[{{"object":"embedding","index":0,"embedding":[{},{}]}}],"model":"e","usage":{{"prompt_tokens":1,"total_tokens":1}}}}"#,
            vector[0], vector[1]
        );
        assert_eq!(body, expected);
    }

    #[test]
    fn base64_is_little_endian_f32() {
        assert_eq!(base64_vector(&[1.0, -0.5]), "AACAPwAAAL8=");
    }

    #[test]
    fn openai_and_ollama_agree_and_count_tokens() {
        let (status, body) = openai(br#"{"model":"e","input":["a b","c"],"dimensions":2}"#);
        assert_eq!(status, 200);
        let value: Value = serde_json::from_str(&body).expect("json");
        let (status, obody) = ollama(br#"{"model":"e","input":["a b","c"],"dimensions":2}"#);
        assert_eq!(status, 200);
        let ovalue: Value = serde_json::from_str(&obody).expect("json");
        assert_eq!(value["data"][1]["embedding"], ovalue["embeddings"][1]);
        assert_eq!(
            value["usage"],
            json!({"prompt_tokens": 3, "total_tokens": 3})
        );
        assert_eq!(ovalue["prompt_eval_count"], 3);
        let expected: Vec<f32> = EmbedInput::Text("c".into()).vector(2);
        let served: Vec<f32> = value["data"][1]["embedding"]
            .as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect();
        assert_eq!(served, expected);
    }

    #[test]
    fn token_id_inputs_are_counted() {
        let (status, body) = openai(br#"{"model":"e","input":[[1,2,3],[4]]}"#);
        assert_eq!(status, 200);
        let value: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(value["usage"]["prompt_tokens"], 4);
        assert_eq!(
            value["data"][0]["embedding"].as_array().map(Vec::len),
            Some(8)
        );
        let (status, body) = openai(br#"{"model":"e","input":[5,6]}"#);
        assert_eq!(status, 200);
        let value: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(value["usage"]["prompt_tokens"], 2);
    }

    #[test]
    fn bad_requests_are_400() {
        for body in [
            &br#"{"model":"e"}"#[..],
            br#"{"model":"e","input":[]}"#,
            br#"{"model":"e","input":[1,"a"]}"#,
            br#"{"model":"e","input":"x","dimensions":0}"#,
            br#"{"model":"e","input":"x","dimensions":4097}"#,
            br#"{"model":"e","input":"x","encoding_format":"hex"}"#,
            br#"{"input":"x"}"#,
        ] {
            assert_eq!(openai(body).0, 400, "{}", String::from_utf8_lossy(body));
        }
        assert_eq!(ollama(br#"{"model":"e","input":[[1]]}"#).0, 400);
    }
}
