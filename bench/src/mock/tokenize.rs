//! The mock's vLLM tokenizer routes: `POST /tokenize` and
//! `POST /detokenize`.
//!
//! # The deterministic vocabulary
//!
//! A prompt's tokens are its whitespace-separated words; the id of a word
//! is the FNV-1a hash of its UTF-8 bytes modulo [`VOCAB_SIZE`]
//! ([`token_id`]). The process remembers the first word it saw for each id
//! (up to [`MAX_REMEMBERED`] ids), so `/detokenize` maps ids back to words
//! joined by one space; an id it never saw renders as `<unk:ID>`.
//!
//! ```text
//! POST /tokenize   {"model":M,"prompt":"a b"} → {"count":2,"max_model_len":32768,"tokens":[…]}
//! POST /detokenize {"model":M,"tokens":[…]}   → {"prompt":"a b"}
//! ```

use std::collections::HashMap;

use serde_json::{json, Value};

use super::digest::fnv1a;
use super::openai::error_body;

/// Ids are below this.
pub const VOCAB_SIZE: u64 = 50_000;

/// The `max_model_len` `/tokenize` reports.
pub const MAX_MODEL_LEN: u64 = 32_768;

/// Ids whose words the process remembers at most (bounds its memory).
pub const MAX_REMEMBERED: usize = 100_000;

/// The id of `word`.
pub fn token_id(word: &str) -> u64 {
    fnv1a(word.as_bytes()) % VOCAB_SIZE
}

/// The words seen by `/tokenize`, by id.
#[derive(Debug, Clone, Default)]
pub struct Vocabulary {
    words: HashMap<u64, String>,
}

impl Vocabulary {
    /// `POST /tokenize`: `(status, body)`; remembers the words.
    pub fn tokenize(&mut self, body: &[u8]) -> (u16, String) {
        let prompt = match parse(body, "prompt", |v| v.as_str().map(str::to_string)) {
            Ok(prompt) => prompt,
            Err(message) => return (400, error_body(&message)),
        };
        let tokens: Vec<u64> = prompt
            .split_whitespace()
            .map(|word| {
                let id = token_id(word);
                if self.words.len() < MAX_REMEMBERED || self.words.contains_key(&id) {
                    self.words.entry(id).or_insert_with(|| word.to_string());
                }
                id
            })
            .collect();
        let body = json!({"count": tokens.len(), "max_model_len": MAX_MODEL_LEN, "tokens": tokens});
        (200, body.to_string())
    }

    /// `POST /detokenize`: `(status, body)`.
    pub fn detokenize(&self, body: &[u8]) -> (u16, String) {
        let ids = match parse(body, "tokens", |v| {
            v.as_array()?
                .iter()
                .map(Value::as_u64)
                .collect::<Option<Vec<u64>>>()
        }) {
            Ok(ids) => ids,
            Err(message) => return (400, error_body(&message)),
        };
        let words: Vec<String> = ids
            .iter()
            .map(|id| {
                self.words
                    .get(id)
                    .cloned()
                    .unwrap_or_else(|| format!("<unk:{id}>"))
            })
            .collect();
        (200, json!({"prompt": words.join(" ")}).to_string())
    }
}

fn parse<T>(body: &[u8], field: &str, get: impl Fn(&Value) -> Option<T>) -> Result<T, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    if !value.get("model").is_none_or(Value::is_string) {
        return Err("model must be a string".into());
    }
    value.get(field).and_then(get).ok_or(match field {
        "prompt" => "prompt is required (a string)".to_string(),
        _ => "tokens is required (an array of non-negative integers)".to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_then_detokenize_round_trips_seen_words() {
        let mut vocab = Vocabulary::default();
        let (status, body) = vocab.tokenize(br#"{"model":"m","prompt":"hello  big world"}"#);
        assert_eq!(status, 200);
        let ids = [token_id("hello"), token_id("big"), token_id("world")];
        assert_eq!(
            body,
            format!(
                r#"{{"count":3,"max_model_len":32768,"tokens":[{},{},{}]}}"#,
                ids[0], ids[1], ids[2]
            )
        );
        assert!(ids.iter().all(|&id| id < VOCAB_SIZE));
        let (status, body) = vocab.detokenize(
            format!(r#"{{"model":"m","tokens":[{},{},50000]}}"#, ids[2], ids[0]).as_bytes(),
        );
        assert_eq!(status, 200);
        // 50000 is outside the vocabulary: never seen.
        assert_eq!(body, r#"{"prompt":"world hello <unk:50000>"}"#);
    }

    #[test]
    fn bad_bodies_are_400() {
        let mut vocab = Vocabulary::default();
        assert_eq!(vocab.tokenize(br#"{"model":"m"}"#).0, 400);
        assert_eq!(vocab.tokenize(b"[").0, 400);
        assert_eq!(vocab.detokenize(br#"{"model":"m","tokens":[-1]}"#).0, 400);
        assert_eq!(vocab.detokenize(br#"{"model":"m","tokens":"a"}"#).0, 400);
    }
}
