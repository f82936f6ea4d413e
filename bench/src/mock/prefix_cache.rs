//! The mock's prefix cache (`--prefix-cache-tokens N`,
//! `--prefill-us-per-token U`): a model of the KV cache an inference server
//! keeps of recent prompts, so that routing a conversation back to the
//! provider that already saw its prefix is measurably faster.
//!
//! # Tokens
//!
//! A *token* is a whitespace-separated word of the prompt text, the unit the
//! mock already reports as `prompt_tokens` ([`super::openai::word_count`]).
//! A request's token sequence is the words of its prompt text in order
//! ([`prompt_sequence`]):
//!
//! - chat completions and Ollama `/api/chat`: each message's `content` (a
//!   string, or the `text` of each content part) in message order;
//! - Anthropic `/v1/messages`: `system`, then the messages likewise;
//! - Responses `/v1/responses`: `instructions`, then `input` (a string, or
//!   each item's `content`).
//!
//! # The cache
//!
//! [`PrefixCache`] holds token sequences in least-recently-used order, at
//! most `N` tokens in total. A request's *cached prefix* is the longest
//! prefix of its sequence that is also a prefix of one cached sequence
//! ([`PrefixCache::lookup`]). Then the request's sequence (its first `N`
//! tokens when longer) becomes the most recently used entry
//! ([`PrefixCache::insert`]): cached sequences that are a prefix of it are
//! dropped (it covers them); if it is itself a prefix of a cached sequence,
//! that sequence is refreshed instead; least recently used sequences are
//! evicted until the total fits `N`.
//!
//! The first token then waits `ttft_ms` + `U` µs per uncached prompt token
//! ([`first_token_delay_ms`], rounded up to whole milliseconds, the
//! granularity of the mock's timers). Pure: no IO, no clock.

use serde_json::Value;

/// The token sequences of recent prompts, LRU-bounded in total tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCache {
    capacity_tokens: usize,
    /// Least recently used first.
    entries: Vec<Vec<String>>,
    total_tokens: usize,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity_tokens` tokens (0: it never
    /// holds anything).
    pub fn new(capacity_tokens: usize) -> Self {
        Self {
            capacity_tokens,
            entries: Vec::new(),
            total_tokens: 0,
        }
    }

    /// The bound, in tokens.
    pub fn capacity_tokens(&self) -> usize {
        self.capacity_tokens
    }

    /// Tokens held now (the sum of the cached sequences' lengths).
    pub fn total_tokens(&self) -> usize {
        self.total_tokens
    }

    /// The cached sequences, least recently used first.
    pub fn sequences(&self) -> impl Iterator<Item = &[String]> {
        self.entries.iter().map(Vec::as_slice)
    }

    /// The length of the longest prefix of `tokens` that is a prefix of a
    /// cached sequence.
    pub fn lookup(&self, tokens: &[String]) -> usize {
        self.entries
            .iter()
            .map(|entry| common_prefix(entry, tokens))
            .max()
            .unwrap_or(0)
    }

    /// Makes `tokens` (its first `capacity_tokens` tokens) the most recently
    /// used sequence, evicting least recently used ones until the total fits.
    pub fn insert(&mut self, tokens: &[String]) {
        let tokens = &tokens[..tokens.len().min(self.capacity_tokens)];
        if tokens.is_empty() {
            return;
        }
        if let Some(at) = self
            .entries
            .iter()
            .position(|entry| entry.starts_with(tokens))
        {
            let entry = self.entries.remove(at);
            self.entries.push(entry);
            return;
        }
        let mut removed = 0;
        self.entries.retain(|entry| {
            let covered = tokens.starts_with(entry);
            if covered {
                removed += entry.len();
            }
            !covered
        });
        self.total_tokens -= removed;
        self.entries.push(tokens.to_vec());
        self.total_tokens += tokens.len();
        while self.total_tokens > self.capacity_tokens {
            let evicted = self.entries.remove(0);
            self.total_tokens -= evicted.len();
        }
    }

    /// One request: its cached prefix length ([`lookup`](Self::lookup)),
    /// then its sequence [inserted](Self::insert).
    pub fn serve(&mut self, tokens: &[String]) -> usize {
        let cached = self.lookup(tokens);
        self.insert(tokens);
        cached
    }
}

fn common_prefix(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The delay before the first token of a prompt of `prompt_tokens` tokens
/// of which `cached_tokens` were cached: `ttft_ms` + `prefill_us_per_token`
/// µs per uncached token, rounded up to whole milliseconds.
pub fn first_token_delay_ms(
    ttft_ms: u64,
    prefill_us_per_token: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
) -> u64 {
    let prefill_us =
        prefill_us_per_token.saturating_mul(prompt_tokens.saturating_sub(cached_tokens));
    ttft_ms.saturating_add(prefill_us.div_ceil(1000))
}

/// Which prompt shape a generation route carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptShape {
    /// `messages[].content` (chat completions, Ollama chat).
    Messages,
    /// `system`, then `messages[].content` (Anthropic Messages).
    SystemAndMessages,
    /// `instructions`, then `input` (Responses).
    InstructionsAndInput,
    /// `prompt`: a string or an array of strings (text completions).
    Prompt,
}

/// The token sequence of a request body of `shape` (see the module docs).
pub fn prompt_sequence(shape: PromptShape, body: &Value) -> Vec<String> {
    let mut tokens = Vec::new();
    match shape {
        PromptShape::Messages => messages_words(body, &mut tokens),
        PromptShape::SystemAndMessages => {
            content_words(body.get("system"), &mut tokens);
            messages_words(body, &mut tokens);
        }
        PromptShape::InstructionsAndInput => {
            content_words(body.get("instructions"), &mut tokens);
            match body.get("input") {
                Some(Value::Array(items)) => items
                    .iter()
                    .for_each(|item| content_words(item.get("content"), &mut tokens)),
                input => content_words(input, &mut tokens),
            }
        }
        PromptShape::Prompt => match body.get("prompt") {
            Some(Value::Array(items)) => items
                .iter()
                .for_each(|item| content_words(Some(item), &mut tokens)),
            prompt => content_words(prompt, &mut tokens),
        },
    }
    tokens
}

fn messages_words(body: &Value, tokens: &mut Vec<String>) {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for message in messages {
            content_words(message.get("content"), tokens);
        }
    }
}

/// Words of a string, or of the `text` of each part of an array.
fn content_words(content: Option<&Value>, tokens: &mut Vec<String>) {
    let mut push = |text: &str| tokens.extend(text.split_whitespace().map(str::to_string));
    match content {
        Some(Value::String(text)) => push(text),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .for_each(push),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn words(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    fn held(cache: &PrefixCache) -> Vec<String> {
        cache.sequences().map(|s| s.join(" ")).collect()
    }

    #[test]
    fn cached_prefix_is_the_longest_match_over_all_sequences() {
        let mut cache = PrefixCache::new(100);
        assert_eq!(cache.serve(&words("a b c d")), 0);
        assert_eq!(cache.serve(&words("x y")), 0);
        assert_eq!(cache.lookup(&words("a b c z")), 3);
        assert_eq!(cache.lookup(&words("a b c d e f")), 4);
        assert_eq!(cache.lookup(&words("x y")), 2);
        assert_eq!(cache.lookup(&words("x")), 1);
        assert_eq!(cache.lookup(&words("b c")), 0);
        assert_eq!(cache.lookup(&[]), 0);
        assert_eq!(cache.serve(&words("a b q")), 2);
        assert_eq!(held(&cache), ["a b c d", "x y", "a b q"]);
        assert_eq!(cache.total_tokens(), 9);
    }

    #[test]
    fn an_extension_replaces_its_prefix_and_a_prefix_refreshes_its_extension() {
        let mut cache = PrefixCache::new(100);
        cache.insert(&words("s1 s2 u1"));
        cache.insert(&words("other"));
        // The next turn of the conversation covers the previous one.
        assert_eq!(cache.serve(&words("s1 s2 u1 a1 u2")), 3);
        assert_eq!(held(&cache), ["other", "s1 s2 u1 a1 u2"]);
        assert_eq!(cache.total_tokens(), 6);
        // A prefix of a cached sequence only refreshes it.
        cache.insert(&words("other"));
        assert_eq!(cache.serve(&words("s1 s2")), 2);
        assert_eq!(held(&cache), ["other", "s1 s2 u1 a1 u2"]);
        assert_eq!(cache.total_tokens(), 6);
    }

    #[test]
    fn least_recently_used_sequences_are_evicted_first_within_the_bound() {
        let mut cache = PrefixCache::new(6);
        cache.insert(&words("a1 a2"));
        cache.insert(&words("b1 b2"));
        cache.insert(&words("c1 c2"));
        assert_eq!(cache.total_tokens(), 6);
        // Using `a` makes `b` the least recently used.
        assert_eq!(cache.serve(&words("a1 a2")), 2);
        assert_eq!(held(&cache), ["b1 b2", "c1 c2", "a1 a2"]);
        cache.insert(&words("d1 d2 d3"));
        assert_eq!(held(&cache), ["a1 a2", "d1 d2 d3"]);
        assert_eq!(cache.total_tokens(), 5);
        assert_eq!(cache.lookup(&words("b1 b2")), 0);
        assert_eq!(cache.lookup(&words("c1 c2")), 0);
        assert_eq!(cache.lookup(&words("a1 a2")), 2);
    }

    #[test]
    fn a_sequence_longer_than_the_bound_is_cached_truncated() {
        let mut cache = PrefixCache::new(3);
        cache.insert(&words("x"));
        assert_eq!(cache.serve(&words("t1 t2 t3 t4 t5")), 0);
        assert_eq!(held(&cache), ["t1 t2 t3"]);
        assert_eq!(cache.total_tokens(), 3);
        assert_eq!(cache.lookup(&words("t1 t2 t3 t4 t5")), 3);
    }

    #[test]
    fn a_zero_bound_caches_nothing() {
        let mut cache = PrefixCache::new(0);
        assert_eq!(cache.serve(&words("a b")), 0);
        assert_eq!(cache.serve(&words("a b")), 0);
        assert_eq!(cache.total_tokens(), 0);
        assert_eq!(cache.sequences().count(), 0);
    }

    #[test]
    fn first_token_delay_adds_the_uncached_prefill_rounded_up() {
        assert_eq!(first_token_delay_ms(5, 0, 100, 0), 5);
        assert_eq!(first_token_delay_ms(5, 100, 100, 0), 15);
        assert_eq!(first_token_delay_ms(5, 100, 100, 90), 6);
        assert_eq!(first_token_delay_ms(0, 100, 100, 99), 1);
        assert_eq!(first_token_delay_ms(0, 100, 100, 100), 0);
        assert_eq!(first_token_delay_ms(0, 1000, 3, 0), 3);
    }

    #[test]
    fn prompt_sequences_follow_each_protocol_in_order() {
        let chat = json!({"model": "m", "messages": [
            {"role": "system", "content": "be  brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi there"}, {"type": "image_url"}]},
            {"role": "assistant", "content": null},
            {"role": "user", "content": "again"}
        ]});
        assert_eq!(
            prompt_sequence(PromptShape::Messages, &chat),
            words("be brief hi there again")
        );
        let anthropic = json!({"model": "m", "system": [{"type": "text", "text": "sys one"}],
            "messages": [{"role": "user", "content": "q"}]});
        assert_eq!(
            prompt_sequence(PromptShape::SystemAndMessages, &anthropic),
            words("sys one q")
        );
        let responses = json!({"model": "m", "instructions": "ins", "input": [
            {"role": "user", "content": "a b"}, {"role": "user", "content": [{"type": "input_text", "text": "c"}]}
        ]});
        assert_eq!(
            prompt_sequence(PromptShape::InstructionsAndInput, &responses),
            words("ins a b c")
        );
        let completion = json!({"model": "m", "prompt": ["a  b", "c"]});
        assert_eq!(
            prompt_sequence(PromptShape::Prompt, &completion),
            words("a b c")
        );
        let plain = json!({"model": "m", "input": "just this"});
        assert_eq!(
            prompt_sequence(PromptShape::InstructionsAndInput, &plain),
            words("just this")
        );
    }
}
