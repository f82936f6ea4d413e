//! What a request offers the Edge's routing policies
//! ([`crate::control::routing`]), read from the client's bytes without
//! building a JSON tree.
//!
//! - **Prompt** (`prefix`): the raw JSON text of the members that make the
//!   prompt, in this order: `system` (Anthropic), `instructions`
//!   (Responses), then `messages` (chat, Anthropic), `input` (Responses) or
//!   `prompt` (completions). A conversation's next turn repeats the
//!   previous turn's messages and appends, so its text shares the previous
//!   one's as a prefix; a shared system prompt is a shared prefix too. Only
//!   the first `prefix_bytes_max` bytes are copied (bounded work and
//!   memory per request).
//! - **Session** (`session`): the `prompt_cache_key` member (the OpenAI
//!   field), else an `x-session-id` header, else the `user` member; a JSON
//!   string's text, hashed.
//!
//! Only the operations that generate from a prompt offer it
//! ([`reads_prompt`]): chat completions, Responses, Messages (and its token
//! count, which counts the same prompt) and text completions. Embeddings,
//! rerank, score, tokenize and detokenize offer none — their `input`,
//! `query`, `documents` or `prompt` is text to embed, score or split, not a
//! prefix a server's KV cache reuses, and filing it would only crowd the
//! model's tree out of the prompts that are. A `prefix` model routes them by
//! load; a `session` model still keeps a session's requests together.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};

use crate::api::body_json::Members;
use crate::control::routing::session_hash;
use crate::control::{Operation, RouteHint, RoutingPolicy};

/// Whether requests of `operation` offer their prompt to the `prefix`
/// policy (see the module docs).
pub fn reads_prompt(operation: Operation) -> bool {
    match operation {
        Operation::ChatCompletions
        | Operation::Responses
        | Operation::Messages
        | Operation::CountTokens
        | Operation::Completions => true,
        Operation::Embeddings
        | Operation::Rerank
        | Operation::Score
        | Operation::Tokenize
        | Operation::Detokenize
        | Operation::Transcriptions
        | Operation::Translations
        | Operation::Speech => false,
    }
}

/// The members whose text makes a prompt, in prompt order.
pub const PROMPT_MEMBERS: [&str; 5] = ["system", "instructions", "messages", "input", "prompt"];

/// The header naming a session when the body has no `prompt_cache_key`.
pub const SESSION_HEADER: &str = "x-session-id";

/// The hint for a request of a model routed by `policy`: nothing for
/// `least_loaded`, the session key for `session`, the prompt for `prefix`.
/// `session_header`: the value of [`SESSION_HEADER`], if sent.
pub fn route_hint(
    body: &Members,
    session_header: Option<&[u8]>,
    policy: RoutingPolicy,
    prefix_bytes_max: usize,
) -> RouteHint {
    match policy {
        RoutingPolicy::LeastLoaded => RouteHint::default(),
        RoutingPolicy::Session => RouteHint {
            session: session_key(body, session_header).map(|key| session_hash(&key)),
            prompt: None,
        },
        RoutingPolicy::Prefix => RouteHint {
            session: None,
            prompt: prompt_text(body, prefix_bytes_max),
        },
    }
}

/// The first `max` bytes of the prompt members' raw text, concatenated;
/// `None` when the body has none of them or `max` is 0.
pub fn prompt_text(body: &Members, max: usize) -> Option<Bytes> {
    let bytes = body.bytes();
    let mut spans = PROMPT_MEMBERS.iter().filter_map(|name| body.span(name));
    let first = spans.next()?;
    let mut out = BytesMut::with_capacity(max.min(bytes.len()));
    for span in std::iter::once(first).chain(spans) {
        let room = max - out.len();
        if room == 0 {
            break;
        }
        let text = &bytes[span];
        out.extend_from_slice(&text[..text.len().min(room)]);
    }
    (!out.is_empty()).then(|| out.freeze())
}

/// The session key: `prompt_cache_key`, else `session_header`, else
/// `user`; members count only as non-empty JSON strings.
pub fn session_key<'a>(
    body: &'a Members,
    session_header: Option<&'a [u8]>,
) -> Option<Cow<'a, [u8]>> {
    let member = |name: &str| {
        body.raw(name)
            .and_then(|raw| serde_json::from_str::<Cow<'_, str>>(raw).ok())
            .filter(|text| !text.is_empty())
            .map(|text| match text {
                Cow::Borrowed(s) => Cow::Borrowed(s.as_bytes()),
                Cow::Owned(s) => Cow::Owned(s.into_bytes()),
            })
    };
    member("prompt_cache_key")
        .or_else(|| session_header.filter(|h| !h.is_empty()).map(Cow::Borrowed))
        .or_else(|| member("user"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::body_json::JsonLimits;

    fn members(json: &str) -> Members {
        Members::parse(Bytes::from(json.to_owned()), &JsonLimits::default()).expect("a body")
    }

    #[test]
    fn the_prompt_is_the_raw_text_of_its_members_in_prompt_order() {
        let body = members(
            r#"{"messages":[{"role":"user","content":"hi"}],"model":"m","system":"be brief"}"#,
        );
        assert_eq!(
            prompt_text(&body, 1 << 20).as_deref(),
            Some(&br#""be brief"[{"role":"user","content":"hi"}]"#[..])
        );
        let responses = members(r#"{"model":"m","input":"question","instructions":"rules"}"#);
        assert_eq!(
            prompt_text(&responses, 1 << 20).as_deref(),
            Some(&br#""rules""question""#[..])
        );
        let completion = members(r#"{"model":"m","prompt":"def f(x):"}"#);
        assert_eq!(
            prompt_text(&completion, 1 << 20).as_deref(),
            Some(&br#""def f(x):""#[..])
        );
        assert_eq!(prompt_text(&members(r#"{"model":"m"}"#), 1 << 20), None);
    }

    #[test]
    fn only_the_first_bytes_are_copied() {
        let body = members(r#"{"system":"abcdef","messages":[1,2,3]}"#);
        assert_eq!(prompt_text(&body, 4).as_deref(), Some(&br#""abc"#[..]));
        assert_eq!(
            prompt_text(&body, 10).as_deref(),
            Some(&br#""abcdef"[1"#[..])
        );
        assert_eq!(prompt_text(&body, 0), None);
    }

    #[test]
    fn a_next_turn_extends_the_previous_prompt() {
        let turn1 = members(r#"{"model":"m","messages":[{"role":"user","content":"a"}]}"#);
        let turn2 = members(
            r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#,
        );
        let one = prompt_text(&turn1, 1 << 20).expect("a prompt");
        let two = prompt_text(&turn2, 1 << 20).expect("a prompt");
        // All of turn 1 but its closing bracket.
        assert!(two.starts_with(&one[..one.len() - 1]));
    }

    #[test]
    fn the_session_key_is_the_cache_key_then_the_header_then_the_user() {
        let both = members(r#"{"prompt_cache_key":"conv-1","user":"u-7"}"#);
        assert_eq!(
            session_key(&both, Some(b"hdr")).as_deref(),
            Some(&b"conv-1"[..])
        );
        let user = members(r#"{"user":"u-7"}"#);
        assert_eq!(
            session_key(&user, Some(b"hdr")).as_deref(),
            Some(&b"hdr"[..])
        );
        assert_eq!(session_key(&user, None).as_deref(), Some(&b"u-7"[..]));
        // Escapes are decoded; empty strings and other types do not count.
        let escaped = members(r#"{"prompt_cache_key":"a\u0062","user":""}"#);
        assert_eq!(session_key(&escaped, None).as_deref(), Some(&b"ab"[..]));
        let odd = members(r#"{"prompt_cache_key":7,"user":""}"#);
        assert_eq!(session_key(&odd, Some(b"")), None);
    }

    #[test]
    fn only_the_generating_operations_offer_a_prompt() {
        let reading: Vec<&str> = Operation::ALL
            .into_iter()
            .filter(|&op| reads_prompt(op))
            .map(Operation::name)
            .collect();
        assert_eq!(
            reading,
            [
                "chat_completions",
                "responses",
                "messages",
                "count_tokens",
                "completions"
            ]
        );
    }

    #[test]
    fn a_policy_reads_only_what_it_uses() {
        let body = members(r#"{"messages":[],"user":"u"}"#);
        assert_eq!(
            route_hint(&body, None, RoutingPolicy::LeastLoaded, 64),
            RouteHint::default()
        );
        assert_eq!(
            route_hint(&body, None, RoutingPolicy::Session, 64),
            RouteHint {
                session: Some(session_hash(b"u")),
                prompt: None
            }
        );
        assert_eq!(
            route_hint(&body, None, RoutingPolicy::Prefix, 64),
            RouteHint {
                session: None,
                prompt: Some(Bytes::from_static(b"[]"))
            }
        );
    }
}
