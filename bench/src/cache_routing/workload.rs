//! The pure part of the cache-routing workloads: the arms (routing
//! policies), the texts (unique per pool, workload, arm and round), the
//! request bodies, and reading one SSE payload of a reply. No IO, no clock.
//!
//! # Texts
//!
//! A *word* is what the mock counts as a token (whitespace-separated). Every
//! text starts with a tag word naming where it belongs
//! (`[multi_turn.p2.prefix.r1.c3]`), so two texts share a prefix only when
//! the workload means them to (the turns of one conversation, the requests
//! of one shared system prompt); the other words are drawn from a seeded
//! generator ([`words`]), so a run is reproducible.

use bytes::Bytes;
use serde::Serialize;
use serde_json::{json, Value};

/// The model the mocks serve (every provider's target).
pub const MOCK_MODEL: &str = "mock-model";

/// A routing policy under test: one arm of every round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// The model `least_loaded` over the pool (today's behaviour).
    LeastLoaded,
    /// The model `session`: affinity by `prompt_cache_key`.
    Session,
    /// The model `prefix`: affinity by the prompt text's prefix.
    Prefix,
    /// The models `pinned-0..P-1`, one provider each: affinity by hand.
    Pinned,
}

impl Policy {
    /// Every arm, in the order of a forward round.
    pub const ALL: [Policy; 4] = [
        Policy::LeastLoaded,
        Policy::Session,
        Policy::Prefix,
        Policy::Pinned,
    ];

    /// The name in tables, tags and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Policy::LeastLoaded => "least_loaded",
            Policy::Session => "session",
            Policy::Prefix => "prefix",
            Policy::Pinned => "pinned",
        }
    }

    /// The `routing` value of its pooled model; `None` for the pinned
    /// models (one provider: nothing to choose).
    pub fn routing(self) -> Option<&'static str> {
        match self {
            Policy::Pinned => None,
            pooled => Some(pooled.name()),
        }
    }

    /// The model a request with affinity group `group` names (the pinned
    /// arm spreads the groups over its P models).
    pub fn model(self, group: u64, providers: u32) -> String {
        match self {
            Policy::Pinned => pinned_model(group % u64::from(providers.max(1))),
            pooled => pooled.name().to_string(),
        }
    }

    /// The `prompt_cache_key` a request of affinity group `key` sends: the
    /// session arm's only, so the other arms route on nothing but the text.
    pub fn cache_key(self, key: &str) -> Option<String> {
        (self == Policy::Session).then(|| key.to_string())
    }
}

/// The pinned model of provider `i`.
pub fn pinned_model(i: u64) -> String {
    format!("pinned-{i}")
}

/// A workload: what one window of an arm sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// Conversations of several turns, each turn the whole history.
    MultiTurn,
    /// Independent requests over a few long shared system prompts.
    SharedSystemPrompt,
    /// Independent requests with nothing in common.
    NoSharedPrefix,
}

impl Workload {
    /// Every workload, in the order they run.
    pub const ALL: [Workload; 3] = [
        Workload::MultiTurn,
        Workload::SharedSystemPrompt,
        Workload::NoSharedPrefix,
    ];

    /// The name in tags and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Workload::MultiTurn => "multi_turn",
            Workload::SharedSystemPrompt => "shared_system_prompt",
            Workload::NoSharedPrefix => "no_shared_prefix",
        }
    }

    /// The name in the table.
    pub fn label(self) -> &'static str {
        match self {
            Workload::MultiTurn => "multi-turn (turns > 1)",
            Workload::SharedSystemPrompt => "shared system prompt",
            Workload::NoSharedPrefix => "no shared prefix",
        }
    }
}

/// Where a window's texts belong: the prefix of every tag word in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowTag {
    /// `<workload>.p<P>.<policy>.r<round>`.
    pub text: String,
}

impl WindowTag {
    /// The tag of `policy`'s window in `round` of `workload` on a pool of
    /// `providers`.
    pub fn new(workload: Workload, providers: u32, policy: Policy, round: u32) -> Self {
        WindowTag {
            text: format!(
                "{}.p{providers}.{}.r{round}",
                workload.name(),
                policy.name()
            ),
        }
    }

    /// The id of part `part` of the window (`<tag>.<part>`), e.g. a
    /// conversation (`c3`) or a shared prompt (`s1`).
    pub fn id(&self, part: &str) -> String {
        format!("{}.{part}", self.text)
    }
}

/// SplitMix64: the next state and its output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a of `text`: the seed of a text's words.
pub fn seed_of(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `count` words of 3 to 8 lowercase letters drawn from `seed`, one space
/// between them.
pub fn words(seed: u64, count: u32) -> String {
    let mut state = seed;
    let mut text = String::with_capacity(count as usize * 7);
    for i in 0..count {
        if i > 0 {
            text.push(' ');
        }
        let mut bits = splitmix64(&mut state);
        let len = 3 + (bits % 6) as usize;
        bits /= 6;
        for _ in 0..len {
            text.push(char::from(b'a' + (bits % 26) as u8));
            bits /= 26;
        }
    }
    text
}

/// A text of exactly `count` words (at least 1): the tag word `[id]`, then
/// `count − 1` words seeded by `id`.
pub fn tagged_text(id: &str, count: u32) -> String {
    let rest = count.saturating_sub(1);
    if rest == 0 {
        format!("[{id}]")
    } else {
        format!("[{id}] {}", words(seed_of(id), rest))
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// Its text.
    pub content: String,
}

/// A streamed chat-completions body: `messages`, `max_tokens`, and the
/// session key when there is one.
pub fn chat_body(
    model: &str,
    messages: &[Message],
    max_tokens: u32,
    prompt_cache_key: Option<&str>,
) -> Bytes {
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let mut body = json!({
        "model": model,
        "messages": messages,
        "stream": true,
        "max_tokens": max_tokens,
    });
    if let Some(key) = prompt_cache_key {
        body["prompt_cache_key"] = Value::String(key.to_string());
    }
    Bytes::from(body.to_string())
}

/// One conversation of the multi-turn workload: its route, its system
/// prompt and user messages, and the history so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    /// Its index in the window.
    pub index: u32,
    /// The model its requests name.
    pub model: String,
    /// The `prompt_cache_key` its requests send.
    pub cache_key: Option<String>,
    /// The history: the system prompt, then user and assistant messages.
    pub history: Vec<Message>,
    /// The user message of every turn, in order.
    pub user_messages: Vec<String>,
    /// Tokens the mock replies with (`max_tokens`).
    pub max_tokens: u32,
    /// The pause before each turn after the first (a user reading and
    /// typing), ms: `think_ms[t]` precedes turn `t + 1`.
    pub think_ms: Vec<u64>,
}

/// The sizes of a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConversationShape {
    /// Turns.
    pub turns: u32,
    /// Words of the system prompt.
    pub system_words: u32,
    /// Words of each user message.
    pub user_words: u32,
    /// Reply tokens (`max_tokens`).
    pub reply_tokens: u32,
    /// The pause before a later turn is drawn from `0..=think_ms_max`.
    pub think_ms_max: u64,
}

impl Conversation {
    /// Conversation `index` of the window `tag` of `policy` on `providers`
    /// providers.
    pub fn new(
        tag: &WindowTag,
        index: u32,
        policy: Policy,
        providers: u32,
        shape: ConversationShape,
    ) -> Self {
        let id = tag.id(&format!("c{index}"));
        let system = tagged_text(&id, shape.system_words);
        let user_messages = (0..shape.turns)
            .map(|turn| tagged_text(&format!("{id}.u{turn}"), shape.user_words))
            .collect();
        let mut state = seed_of(&format!("{id}.think"));
        let think_ms = (1..shape.turns)
            .map(|_| splitmix64(&mut state) % (shape.think_ms_max + 1))
            .collect();
        Conversation {
            index,
            model: policy.model(u64::from(index), providers),
            cache_key: policy.cache_key(&id),
            history: vec![Message {
                role: "system",
                content: system,
            }],
            user_messages,
            max_tokens: shape.reply_tokens,
            think_ms,
        }
    }

    /// The pause before the next turn, ms (0 before the first).
    pub fn think_before_next(&self) -> u64 {
        match self.turns_sent() {
            0 => 0,
            sent => self.think_ms.get(sent as usize - 1).copied().unwrap_or(0),
        }
    }

    /// Turns sent so far.
    pub fn turns_sent(&self) -> u32 {
        // The history holds the system prompt, then a user message per turn
        // sent and an assistant message per reply.
        self.history.iter().filter(|m| m.role == "user").count() as u32
    }

    /// The body of the next turn (the history plus the next user message,
    /// which joins the history), or `None` after the last turn.
    pub fn next_turn(&mut self) -> Option<Bytes> {
        let next = self.user_messages.get(self.turns_sent() as usize)?.clone();
        self.history.push(Message {
            role: "user",
            content: next,
        });
        Some(chat_body(
            &self.model,
            &self.history,
            self.max_tokens,
            self.cache_key.as_deref(),
        ))
    }

    /// Appends the reply to the last turn.
    pub fn add_reply(&mut self, reply: String) {
        self.history.push(Message {
            role: "assistant",
            content: reply,
        });
    }
}

/// One request of a workload of independent requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndependentRequest {
    /// The model it names.
    pub model: String,
    /// The body.
    pub body: Bytes,
}

/// The sizes of the shared-system-prompt workload's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedShape {
    /// Distinct system prompts (K).
    pub prompts: u32,
    /// Words of each system prompt.
    pub prompt_words: u32,
    /// Words of each question.
    pub question_words: u32,
    /// Requests.
    pub requests: u32,
    /// Reply tokens (`max_tokens`).
    pub reply_tokens: u32,
}

/// The system prompt request `j` of a shared-prompt window uses: drawn
/// from the window's seed, so every window has its own mix.
pub fn shared_prompt_of(tag: &WindowTag, j: u32, prompts: u32) -> u32 {
    let mut state = seed_of(&tag.text) ^ u64::from(j).wrapping_mul(0x2545_f491_4f6c_dd1d);
    (splitmix64(&mut state) % u64::from(prompts.max(1))) as u32
}

/// The requests of a shared-system-prompt window: request `j` is system
/// prompt [`shared_prompt_of`] and a unique question. The session arm's
/// key and the pinned arm's model follow the system prompt.
pub fn shared_prompt_requests(
    tag: &WindowTag,
    policy: Policy,
    providers: u32,
    shape: SharedShape,
) -> Vec<IndependentRequest> {
    let systems: Vec<String> = (0..shape.prompts)
        .map(|k| tagged_text(&tag.id(&format!("s{k}")), shape.prompt_words))
        .collect();
    (0..shape.requests)
        .map(|j| {
            let k = shared_prompt_of(tag, j, shape.prompts);
            let messages = [
                Message {
                    role: "system",
                    content: systems[k as usize].clone(),
                },
                Message {
                    role: "user",
                    content: tagged_text(&tag.id(&format!("q{j}")), shape.question_words),
                },
            ];
            let model = policy.model(u64::from(k), providers);
            let key = policy.cache_key(&tag.id(&format!("s{k}")));
            IndependentRequest {
                body: chat_body(&model, &messages, shape.reply_tokens, key.as_deref()),
                model,
            }
        })
        .collect()
}

/// The requests of a no-shared-prefix window: `requests` prompts of
/// `prompt_words` words, each unique from its first word. The session arm
/// sends each its own key; the pinned arm deals them round robin.
pub fn unique_prompt_requests(
    tag: &WindowTag,
    policy: Policy,
    providers: u32,
    requests: u32,
    prompt_words: u32,
    reply_tokens: u32,
) -> Vec<IndependentRequest> {
    (0..requests)
        .map(|j| {
            let id = tag.id(&format!("u{j}"));
            let messages = [Message {
                role: "user",
                content: tagged_text(&id, prompt_words),
            }];
            let model = policy.model(u64::from(j), providers);
            let key = policy.cache_key(&id);
            IndependentRequest {
                body: chat_body(&model, &messages, reply_tokens, key.as_deref()),
                model,
            }
        })
        .collect()
}

/// What one SSE `data:` payload of a chat-completions stream says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// Content text (non-empty `choices[0].delta.content`).
    Content(String),
    /// A chunk without content (the role chunk, the finish chunk).
    NoContent,
    /// `[DONE]`.
    Done,
    /// An error object: its message.
    Error(String),
    /// Not a chunk.
    Unparsable,
}

/// Reads one SSE `data:` payload.
pub fn read_payload(data: &str) -> Payload {
    let data = data.trim();
    if data == "[DONE]" {
        return Payload::Done;
    }
    let Ok(value) = serde_json::from_str::<Value>(data) else {
        return Payload::Unparsable;
    };
    if let Some(error) = value.get("error").filter(|e| !e.is_null()) {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| error.to_string(), str::to_string);
        return Payload::Error(message);
    }
    match value
        .pointer("/choices/0/delta/content")
        .and_then(Value::as_str)
    {
        Some(text) if !text.is_empty() => Payload::Content(text.to_string()),
        _ if value.get("choices").is_some() => Payload::NoContent,
        _ => Payload::Unparsable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_json(body: &Bytes) -> Value {
        serde_json::from_slice(body).unwrap()
    }

    fn shape() -> ConversationShape {
        ConversationShape {
            turns: 3,
            system_words: 5,
            user_words: 2,
            reply_tokens: 4,
            think_ms_max: 50,
        }
    }

    #[test]
    fn words_are_seeded_and_counted() {
        let a = words(7, 50);
        assert_eq!(a.split_whitespace().count(), 50);
        assert_eq!(a, words(7, 50));
        assert_ne!(a, words(8, 50));
        assert!(a
            .split_whitespace()
            .all(|w| (3..=8).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase())));
        assert_eq!(words(7, 0), "");
        assert_eq!(tagged_text("x.y", 1), "[x.y]");
        let text = tagged_text("x.y", 4);
        assert!(text.starts_with("[x.y] "), "{text}");
        assert_eq!(text.split_whitespace().count(), 4);
    }

    #[test]
    fn arms_route_by_model_and_key() {
        assert_eq!(Policy::Pinned.model(5, 4), "pinned-1");
        assert_eq!(Policy::Pinned.model(3, 2), "pinned-1");
        assert_eq!(Policy::Prefix.model(5, 4), "prefix");
        assert_eq!(Policy::LeastLoaded.model(0, 2), "least_loaded");
        assert_eq!(Policy::Session.cache_key("k"), Some("k".to_string()));
        assert_eq!(Policy::Prefix.cache_key("k"), None);
        assert_eq!(Policy::Pinned.cache_key("k"), None);
        assert_eq!(Policy::Session.routing(), Some("session"));
        assert_eq!(Policy::Pinned.routing(), None);
        assert_eq!(
            WindowTag::new(Workload::MultiTurn, 2, Policy::Prefix, 1).id("c3"),
            "multi_turn.p2.prefix.r1.c3"
        );
    }

    #[test]
    fn a_conversation_resends_its_whole_history_each_turn() {
        let tag = WindowTag::new(Workload::MultiTurn, 2, Policy::Session, 0);
        let mut conv = Conversation::new(&tag, 3, Policy::Session, 2, shape());
        assert_eq!(conv.think_before_next(), 0);
        assert_eq!(conv.think_ms.len(), 2);
        assert!(
            conv.think_ms.iter().all(|&ms| ms <= 50),
            "{:?}",
            conv.think_ms
        );
        let first = body_json(&conv.next_turn().unwrap());
        assert_eq!(first["model"], "session");
        assert_eq!(first["prompt_cache_key"], "multi_turn.p2.session.r0.c3");
        assert_eq!(first["stream"], true);
        assert_eq!(first["max_tokens"], 4);
        let system = first["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(system.starts_with("[multi_turn.p2.session.r0.c3] "));
        assert_eq!(system.split_whitespace().count(), 5);
        assert_eq!(first["messages"].as_array().unwrap().len(), 2);
        conv.add_reply("tok0 tok1 ".into());
        assert_eq!(conv.think_before_next(), conv.think_ms[0]);
        let second = body_json(&conv.next_turn().unwrap());
        let roles: Vec<&str> = second["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        // The earlier turn's messages are resent unchanged: a prefix.
        assert_eq!(second["messages"][0], first["messages"][0]);
        assert_eq!(second["messages"][1], first["messages"][1]);
        assert_eq!(second["messages"][2]["content"], "tok0 tok1 ");
        assert_eq!(
            second["messages"][3]["content"],
            tagged_text("multi_turn.p2.session.r0.c3.u1", 2)
        );
        conv.add_reply("r".into());
        assert_eq!(conv.think_before_next(), conv.think_ms[1]);
        assert!(conv.next_turn().is_some());
        assert_eq!(conv.turns_sent(), 3);
        conv.add_reply("r".into());
        assert_eq!(conv.next_turn(), None);
        let pinned = Conversation::new(&tag, 3, Policy::Pinned, 2, shape());
        assert_eq!(
            (pinned.model.as_str(), pinned.cache_key),
            ("pinned-1", None)
        );
    }

    #[test]
    fn texts_differ_between_arms_and_rounds() {
        let a = WindowTag::new(Workload::MultiTurn, 2, Policy::Prefix, 0);
        let b = WindowTag::new(Workload::MultiTurn, 2, Policy::Prefix, 1);
        let c = WindowTag::new(Workload::MultiTurn, 2, Policy::Pinned, 0);
        let first_word = |tag: &WindowTag| {
            Conversation::new(tag, 0, Policy::Prefix, 2, shape()).history[0]
                .content
                .split_whitespace()
                .next()
                .unwrap()
                .to_string()
        };
        assert_ne!(first_word(&a), first_word(&b));
        assert_ne!(first_word(&a), first_word(&c));
    }

    #[test]
    fn shared_prompt_requests_share_exactly_their_system_prompt() {
        let tag = WindowTag::new(Workload::SharedSystemPrompt, 2, Policy::Pinned, 0);
        let shape = SharedShape {
            prompts: 4,
            prompt_words: 6,
            question_words: 3,
            requests: 40,
            reply_tokens: 2,
        };
        let requests = shared_prompt_requests(&tag, Policy::Pinned, 2, shape);
        assert_eq!(requests.len(), 40);
        let mut used = std::collections::BTreeSet::new();
        for (j, r) in requests.iter().enumerate() {
            let k = shared_prompt_of(&tag, j as u32, 4);
            used.insert(k);
            let body = body_json(&r.body);
            assert_eq!(body["model"], format!("pinned-{}", k % 2));
            assert_eq!(r.model, format!("pinned-{}", k % 2));
            assert_eq!(
                body["messages"][0]["content"],
                tagged_text(&format!("{}.s{k}", tag.text), 6)
            );
            assert_eq!(
                body["messages"][1]["content"],
                tagged_text(&format!("{}.q{j}", tag.text), 3)
            );
            assert!(body.get("prompt_cache_key").is_none());
        }
        assert_eq!(used.len(), 4, "40 draws use every one of 4 prompts");
        let session = shared_prompt_requests(&tag, Policy::Session, 2, shape);
        let k = shared_prompt_of(&tag, 0, 4);
        assert_eq!(
            body_json(&session[0].body)["prompt_cache_key"],
            format!("{}.s{k}", tag.text)
        );
    }

    #[test]
    fn unique_prompt_requests_share_nothing() {
        let tag = WindowTag::new(Workload::NoSharedPrefix, 4, Policy::Session, 1);
        let requests = unique_prompt_requests(&tag, Policy::Session, 4, 3, 5, 2);
        let firsts: Vec<String> = requests
            .iter()
            .map(|r| {
                let body = body_json(&r.body);
                assert_eq!(body["model"], "session");
                let text = body["messages"][0]["content"].as_str().unwrap().to_string();
                assert_eq!(text.split_whitespace().count(), 5);
                text.split_whitespace().next().unwrap().to_string()
            })
            .collect();
        assert_eq!(
            firsts,
            [
                "[no_shared_prefix.p4.session.r1.u0]",
                "[no_shared_prefix.p4.session.r1.u1]",
                "[no_shared_prefix.p4.session.r1.u2]"
            ]
        );
        let pinned = unique_prompt_requests(&tag, Policy::Pinned, 4, 5, 5, 2);
        let models: Vec<&str> = pinned.iter().map(|r| r.model.as_str()).collect();
        assert_eq!(
            models,
            ["pinned-0", "pinned-1", "pinned-2", "pinned-3", "pinned-0"]
        );
    }

    #[test]
    fn payloads_are_read() {
        assert_eq!(
            read_payload(r#"{"choices":[{"delta":{"content":"tok0 "}}]}"#),
            Payload::Content("tok0 ".into())
        );
        assert_eq!(
            read_payload(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#),
            Payload::NoContent
        );
        assert_eq!(read_payload(r#"{"choices":[]}"#), Payload::NoContent);
        assert_eq!(read_payload(" [DONE] "), Payload::Done);
        assert_eq!(
            read_payload(r#"{"error":{"message":"no provider"}}"#),
            Payload::Error("no provider".into())
        );
        assert_eq!(
            read_payload(r#"{"error":"x"}"#),
            Payload::Error("\"x\"".into())
        );
        assert_eq!(read_payload("nope"), Payload::Unparsable);
        assert_eq!(read_payload("{}"), Payload::Unparsable);
    }
}
