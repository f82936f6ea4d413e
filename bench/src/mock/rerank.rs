//! The mock's relevance scoring: `POST /v1/rerank` and `POST /v2/rerank`
//! (the Jina / Cohere shape) and vLLM's `POST /v1/score`.
//!
//! # The deterministic score rule
//!
//! The score of a text pair is the Jaccard index of their sets of
//! whitespace-separated words (exact, case-sensitive): distinct words in
//! both divided by distinct words in either; 0 when both are empty.
//! Tokens counted in `usage` are the words of every text in the request.
//!
//! Rerank: `{"model","query","documents":[str | {"text"}…],"top_n"?,
//! "return_documents"?}` → results sorted by score descending (equal scores
//! by index), cut to `top_n`, each with `"document":{"text"}` when
//! `return_documents` is true:
//!
//! ```text
//! {"id":"rerank-mock-<seq>","model":M,"results":[{"index":1,"relevance_score":0.5},…],
//!  "usage":{"total_tokens":T}}
//! ```
//!
//! Score: `{"model","text_1","text_2"}`, each a string or an array of
//! strings; a single `text_1` (a string or a one-element array) is scored
//! against every `text_2`, otherwise the arrays pair up by position and
//! must be as long:
//!
//! ```text
//! {"id":"score-mock-<seq>","object":"list","created":1700000000,"model":M,
//!  "data":[{"index":0,"object":"score","score":S}],
//!  "usage":{"prompt_tokens":T,"total_tokens":T,"completion_tokens":0}}
//! ```

use std::collections::BTreeSet;

use serde_json::{json, Value};

use super::openai::{error_body, word_count, CREATED_UNIX_S};

/// The Jaccard index of the word sets of `a` and `b` (module docs).
pub fn score(a: &str, b: &str) -> f64 {
    let a: BTreeSet<&str> = a.split_whitespace().collect();
    let b: BTreeSet<&str> = b.split_whitespace().collect();
    let union = a.union(&b).count();
    if union == 0 {
        return 0.0;
    }
    a.intersection(&b).count() as f64 / union as f64
}

fn model_of(value: &Value) -> Result<String, String> {
    value
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or("model is required (a string)".into())
}

fn reply(result: Result<String, String>) -> (u16, String) {
    match result {
        Ok(body) => (200, body),
        Err(message) => (400, error_body(&message)),
    }
}

/// `POST /v1/rerank` or `/v2/rerank`: `(status, body)`.
pub fn rerank(body: &[u8], seq: u64) -> (u16, String) {
    reply(rerank_inner(body, seq))
}

fn rerank_inner(body: &[u8], seq: u64) -> Result<String, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid rerank request body: {e}"))?;
    let model = model_of(&value)?;
    let query = value
        .get("query")
        .and_then(Value::as_str)
        .ok_or("query is required (a string)")?;
    let documents: Vec<&str> = value
        .get("documents")
        .and_then(Value::as_array)
        .ok_or("documents must be an array")?
        .iter()
        .map(|d| match d {
            Value::String(text) => Some(text.as_str()),
            other => other.get("text").and_then(Value::as_str),
        })
        .collect::<Option<_>>()
        .ok_or("each document must be a string or an object with a string text")?;
    let top_n = match value.get("top_n") {
        None | Some(Value::Null) => documents.len(),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or("top_n must be a non-negative integer")?,
    };
    let return_documents = match value.get("return_documents") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or("return_documents must be a boolean")?,
    };
    let mut scored: Vec<(usize, f64)> = documents
        .iter()
        .enumerate()
        .map(|(i, d)| (i, score(query, d)))
        .collect();
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    scored.truncate(top_n);
    let results: Vec<Value> = scored
        .into_iter()
        .map(|(index, relevance_score)| {
            let mut result = json!({"index": index, "relevance_score": relevance_score});
            if return_documents {
                result["document"] = json!({"text": documents[index]});
            }
            result
        })
        .collect();
    let tokens = word_count(query) + documents.iter().map(|d| word_count(d)).sum::<u64>();
    Ok(json!({
        "id": format!("rerank-mock-{seq}"),
        "model": model,
        "results": results,
        "usage": {"total_tokens": tokens},
    })
    .to_string())
}

fn texts(value: &Value, name: &str) -> Result<Vec<String>, String> {
    match value.get(name) {
        Some(Value::String(text)) => Ok(vec![text.clone()]),
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|i| i.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or(format!("{name} must be a string or an array of strings")),
        _ => Err(format!(
            "{name} must be a string or a non-empty array of strings"
        )),
    }
}

/// vLLM `POST /v1/score`: `(status, body)`.
pub fn score_pairs(body: &[u8], seq: u64) -> (u16, String) {
    reply(score_inner(body, seq))
}

fn score_inner(body: &[u8], seq: u64) -> Result<String, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid score request body: {e}"))?;
    let model = model_of(&value)?;
    let first = texts(&value, "text_1")?;
    let second = texts(&value, "text_2")?;
    let pairs: Vec<(&str, &str)> = if first.len() == 1 {
        second
            .iter()
            .map(|b| (first[0].as_str(), b.as_str()))
            .collect()
    } else if first.len() == second.len() {
        first
            .iter()
            .zip(&second)
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect()
    } else {
        return Err(format!(
            "text_1 has {} texts and text_2 {}: they must be as many, or text_1 one",
            first.len(),
            second.len()
        ));
    };
    let tokens: u64 = pairs
        .iter()
        .map(|(a, b)| word_count(a) + word_count(b))
        .sum();
    let data: Vec<Value> = pairs
        .iter()
        .enumerate()
        .map(|(index, (a, b))| json!({"index": index, "object": "score", "score": score(a, b)}))
        .collect();
    Ok(json!({
        "id": format!("score-mock-{seq}"),
        "object": "list",
        "created": CREATED_UNIX_S,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    })
    .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_is_the_jaccard_index_of_word_sets() {
        assert_eq!(score("a b", "b c"), 1.0 / 3.0);
        assert_eq!(score("a a", "a"), 1.0);
        assert_eq!(score("", ""), 0.0);
        assert_eq!(score("x", "y"), 0.0);
    }

    #[test]
    fn rerank_sorts_cuts_and_returns_documents() {
        let (status, body) = rerank(
            br#"{"model":"r","query":"a b","documents":["c","a b",{"text":"b"}],"top_n":2,"return_documents":true}"#,
            4,
        );
        assert_eq!(status, 200);
        assert_eq!(
            body,
            concat!(
                r#"{"id":"rerank-mock-4","model":"r","results":["#,
                r#"{"index":1,"relevance_score":1.0,"document":{"text":"a b"}},"#,
                r#"{"index":2,"relevance_score":0.5,"document":{"text":"b"}}],"#,
                r#""usage":{"total_tokens":6}}"#
            )
        );
    }

    #[test]
    fn score_broadcasts_one_text_and_pairs_lists() {
        let (status, body) = score_pairs(br#"{"model":"s","text_1":"a","text_2":["a","a b"]}"#, 1);
        assert_eq!(status, 200);
        let value: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(value["data"][0]["score"], 1.0);
        assert_eq!(value["data"][1]["score"], 0.5);
        assert_eq!(value["usage"]["prompt_tokens"], 5);
        let (status, _) = score_pairs(br#"{"model":"s","text_1":["a","b"],"text_2":["a"]}"#, 1);
        assert_eq!(status, 400);
        let (status, _) = rerank(br#"{"model":"s","query":"a","documents":[1]}"#, 1);
        assert_eq!(status, 400);
    }
}
