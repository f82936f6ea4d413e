//! The mock provider's pure core: routing, request parsing and every byte of
//! the OpenAI-compatible responses. No IO and no clock: the shell passes in
//! the send time (`sent_ns`, from `iop_engine::clock::monotonic_raw_ns`) and
//! acts on the returned [`Reply`] / [`StreamStep`]s.
//!
//! # The deterministic content rule
//!
//! A completion of `n` tokens consists of the tokens `0..n`; token `i` is the
//! text `tok{i} ` (the letters `tok`, the decimal index, one space), and the
//! message content is their concatenation: `"tok0 tok1 tok2 "` for `n = 3`.
//! `n` is the server's `--tokens`, capped by the request's `max_tokens` /
//! `max_completion_tokens`; when the cap is below `--tokens` the finish reason
//! is `"length"`, otherwise `"stop"`.
//!
//! With `--token-bytes N` ([`MockProvider::with_token_bytes`]) every chat
//! completion token is padded to exactly `N` bytes for body-heavy streams:
//! `tok{i}`, then `.` up to `N - 1` bytes, then the space
//! ([`padded_token_text`]); still one word per token.
//!
//! `prompt_tokens` is the total number of whitespace-separated words in the
//! text of all request messages (a string `content`, or the `text` of each
//! content part of an array `content`; other contents count 0).
//! `completion_tokens` is `n`; `total_tokens` is their sum.
//!
//! # Stream shape
//!
//! ```text
//! data: {chunk: delta {"role":"assistant","content":""}}     (at once)
//!                                                            (sleep --ttft-ms)
//! data: {chunk: delta {"content":"tok0 "}}
//!                                                            (sleep --inter-token-ms)
//! data: {chunk: delta {"content":"tok1 "}}   ... one per token
//! data: {chunk: delta {}, finish_reason "stop" | "length"}
//! data: {chunk: "choices":[], usage}         (only with stream_options.include_usage)
//! data: [DONE]
//! ```
//!
//! Every chunk object has `id`, `object: "chat.completion.chunk"`, `created`,
//! `model`, `choices`, (with `include_usage`, `usage`: `null` except on the
//! usage chunk, as the real API does) and a last, non-OpenAI field
//! `iop_mock_sent_ns`: the monotonic time the chunk was rendered for sending,
//! so a load harness on the same machine can measure delivery latency. SDKs
//! ignore unknown fields.
//!
//! # Fault injection and admin routes
//!
//! [`MockFaults`] (all off by default) makes chat completions misbehave, for
//! the Node's watchdog tests:
//!
//! - `stall_after_tokens: N` with `stall_ms: D`: after the N-th content token
//!   the stream pauses D ms (0 = forever) before going on; a non-streaming
//!   reply with more than N tokens waits D ms more (0 = never answers).
//! - `drop_after_tokens: N`: after the N-th content token the connection is
//!   closed mid-stream (no finish chunk, no terminating chunk); a
//!   non-streaming reply with more than N tokens closes without a response.
//! - `fail_status: CODE`: every chat completion is answered `CODE` with an
//!   OpenAI error body.
//!
//! `GET /health` answers by the runtime [`HealthState`]: `healthy` → 200
//! `{"status":"ok"}`, `unhealthy` → 503, `hanging` → never answers,
//! `missing` → 404 like a server without a health route (llama-cpp-python's).
//! `POST /admin/health {"state":"healthy"|"unhealthy"|"hanging"|"missing"}`
//! flips it.
//! `GET /admin/stats` returns the counters in [`MockStats`] as JSON, then
//! `last_audio`: the model, file name, size and hash of the last audio
//! upload (or `null`), then `last_model`: the `model` member of the last
//! JSON request to `/v1/completions`, `/v1/embeddings`, `/v1/rerank`,
//! `/v2/rerank`, `/v1/score`, `/tokenize` or `/detokenize` (or `null`: none
//! yet, or it had no string `model`), so a test through a gateway sees the
//! name the provider was asked for; then `last_traceparent`: the
//! `traceparent` header of the last request that carried one (or `null`),
//! so a tracing test sees the span id the provider was given.
//!
//! # Prefix cache
//!
//! With [`MockProvider::with_prefix_cache`] (`--prefix-cache-tokens N`,
//! `--prefill-us-per-token U`) every generation request first goes through
//! a [`PrefixCache`](super::prefix_cache::PrefixCache) of `N` tokens: its
//! first token waits `ttft_ms` + `U` µs per prompt token not covered by the
//! cached prefix (a non-streaming reply waits as much longer), and
//! `prompt_tokens_seen` / `cached_tokens_hit` in [`MockStats`] count the
//! prompt tokens and their cached part. See [`super::prefix_cache`].

use serde::{Deserialize, Serialize};

use super::prefix_cache::PromptShape;

/// The `created` timestamp (Unix seconds) of every object the mock returns,
/// fixed so outputs are reproducible.
pub const CREATED_UNIX_S: u64 = 1_700_000_000;

/// The `owned_by` of every listed model.
pub const OWNED_BY: &str = "mock";

/// The prefix of completion ids; the full id is `chatcmpl-mock-<seq>`.
pub const COMPLETION_ID_PREFIX: &str = "chatcmpl-mock-";

/// The last event of every stream.
pub const DONE_EVENT: &str = "data: [DONE]\n\n";

/// The text of token `index`: `tok{index} `.
pub fn token_text(index: u32) -> String {
    format!("tok{index} ")
}

/// The full message content of a completion of `tokens` tokens.
pub fn completion_text(tokens: u32) -> String {
    (0..tokens).map(token_text).collect()
}

/// The filler byte of a padded token (plain ASCII: JSON needs no escape).
pub const TOKEN_PAD_BYTE: u8 = b'.';

/// The text of token `index` padded to `token_bytes` bytes
/// (`--token-bytes`): `tok{index}`, then [`TOKEN_PAD_BYTE`]s, then one
/// space, so a padded token is still one word. A `token_bytes` shorter
/// than [`token_text`] leaves the token as it is (0 = no padding).
pub fn padded_token_text(index: u32, token_bytes: u32) -> String {
    let mut text = token_text(index);
    let target = usize::try_from(token_bytes).unwrap_or(usize::MAX);
    if target > text.len() {
        text.pop();
        let pad = target - text.len() - 1;
        text.extend(std::iter::repeat_n(char::from(TOKEN_PAD_BYTE), pad));
        text.push(' ');
    }
    text
}

/// The number of whitespace-separated words in `text`.
pub fn word_count(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// What the mock serves; fixed for the life of the process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MockConfig {
    /// Delay between the role chunk and the first content token.
    pub ttft_ms: u64,
    /// Delay between consecutive content tokens.
    pub inter_token_ms: u64,
    /// Tokens per completion before any `max_tokens` cap.
    pub tokens: u32,
    /// Model ids listed by `GET /v1/models`.
    pub models: Vec<String>,
}

/// Injected faults (see the module docs); `Default` is no fault.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MockFaults {
    /// Stall after this many content tokens.
    pub stall_after_tokens: Option<u32>,
    /// Length of that stall in milliseconds; 0 = forever.
    pub stall_ms: u64,
    /// Close the connection after this many content tokens.
    pub drop_after_tokens: Option<u32>,
    /// Answer every chat completion with this status.
    pub fail_status: Option<u16>,
}

/// What `GET /health` answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthState {
    /// 200 `{"status":"ok"}`.
    #[default]
    Healthy,
    /// 503.
    Unhealthy,
    /// No answer at all.
    Hanging,
    /// 404: no health route (llama-cpp-python's server).
    Missing,
}

/// Counters served by `GET /admin/stats`. The shell reports connection and
/// stream lifetimes; the core counts requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MockStats {
    /// TCP connections accepted so far.
    pub connections_accepted: u64,
    /// TCP connections open now.
    pub connections_open: u64,
    /// Chat completion requests received so far.
    pub chat_requests: u64,
    /// Streamed replies being written now.
    pub active_streams: u64,
    /// Streamed replies whose writing failed because the client went away
    /// (an aborted request, as a cancelled relay looks from here).
    pub streams_aborted: u64,
    /// Requests answered 400 by the `reject_tools` mode.
    pub tools_rejected: u64,
    /// Ollama `POST /api/chat` requests received so far.
    pub ollama_chat_requests: u64,
    /// Anthropic `POST /v1/messages` requests received so far.
    pub messages_requests: u64,
    /// `POST /v1/responses` requests received so far.
    pub responses_requests: u64,
    /// Event bytes of streamed replies written to sockets so far (chunk
    /// framing not counted). With a client that stops reading, this stops
    /// growing once the connection's buffers are full: back-pressure.
    pub stream_bytes_written: u64,
    /// TLS handshakes that failed (an HTTPS mock whose certificate a client
    /// refused).
    pub tls_handshake_failures: u64,
    /// Prompt tokens of the generation requests that went through the prefix
    /// cache model (0 while it is off).
    pub prompt_tokens_seen: u64,
    /// Of those, the tokens covered by a cached prefix: the hit rate is
    /// `cached_tokens_hit / prompt_tokens_seen`.
    pub cached_tokens_hit: u64,
    /// `POST /v1/completions` requests received so far.
    pub completions_requests: u64,
    /// `POST /v1/embeddings` requests received so far.
    pub embeddings_requests: u64,
    /// Ollama `POST /api/embed` requests received so far.
    pub ollama_embed_requests: u64,
    /// `POST /v1/rerank` and `/v2/rerank` requests received so far.
    pub rerank_requests: u64,
    /// `POST /v1/score` requests received so far.
    pub score_requests: u64,
    /// `POST /tokenize` requests received so far.
    pub tokenize_requests: u64,
    /// `POST /detokenize` requests received so far.
    pub detokenize_requests: u64,
    /// `GET /v1/models/{id}` requests received so far.
    pub model_requests: u64,
    /// `POST /v1/audio/transcriptions` requests received so far.
    pub transcription_requests: u64,
    /// `POST /v1/audio/translations` requests received so far.
    pub translation_requests: u64,
    /// `POST /v1/audio/speech` requests received so far.
    pub speech_requests: u64,
    /// Bytes of the `file` parts of the audio uploads parsed so far.
    pub audio_file_bytes: u64,
}

/// Why a chat request body was rejected.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON of the chat-completions request shape.
    #[error("invalid chat completion request body: {0}")]
    Json(#[from] serde_json::Error),
}

/// Why a generation finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// All configured tokens were produced.
    Stop,
    /// The request's `max_tokens` cut the completion short.
    Length,
}

/// Token counts of one completion, as the `usage` object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Words in the request messages (see the module docs).
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// `prompt_tokens + completion_tokens`.
    pub total_tokens: u64,
}

#[derive(Deserialize)]
struct ChatRequestWire {
    model: String,
    messages: Vec<MessageWire>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptionsWire>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct MessageWire {
    #[serde(default)]
    content: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct StreamOptionsWire {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The parts of a chat-completions request the mock acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatRequest {
    /// The requested model, echoed back.
    pub model: String,
    /// Words in the messages (see the module docs).
    pub prompt_tokens: u64,
    /// `"stream": true`.
    pub stream: bool,
    /// `"stream_options": {"include_usage": true}`.
    pub include_usage: bool,
    /// The smaller of `max_tokens` and `max_completion_tokens`, if any.
    pub max_tokens: Option<u64>,
}

impl ChatRequest {
    /// Parses a `POST /v1/chat/completions` body. Unknown fields are ignored;
    /// `model` (a string) and `messages` (an array of objects) are required.
    pub fn parse(body: &[u8]) -> Result<Self, RequestError> {
        let wire: ChatRequestWire = serde_json::from_slice(body)?;
        let prompt_tokens = wire
            .messages
            .iter()
            .map(|m| m.content.as_ref().map_or(0, content_words))
            .sum();
        let max_tokens = match (wire.max_tokens, wire.max_completion_tokens) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Ok(Self {
            model: wire.model,
            prompt_tokens,
            stream: wire.stream.unwrap_or(false),
            include_usage: wire
                .stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            max_tokens,
        })
    }
}

fn content_words(content: &serde_json::Value) -> u64 {
    match content {
        serde_json::Value::String(text) => word_count(text),
        serde_json::Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(serde_json::Value::as_str))
            .map(word_count)
            .sum(),
        _ => 0,
    }
}

/// One planned completion: everything needed to render its body or chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// `chatcmpl-mock-<seq>`.
    pub id: String,
    /// The request's model, echoed.
    pub model: String,
    /// Tokens to generate.
    pub tokens: u32,
    /// `stop`, or `length` when `max_tokens` capped the count.
    pub finish_reason: FinishReason,
    /// Words in the request messages.
    pub prompt_tokens: u64,
    /// Whether a streamed reply carries `usage` (null, then a usage chunk).
    pub include_usage: bool,
    /// Each content token padded to this many bytes (`--token-bytes`; 0:
    /// unpadded), see [`padded_token_text`].
    pub token_bytes: u32,
}

impl Completion {
    /// Plans the completion of `request` on a server configured for
    /// `configured_tokens`; `seq` makes the id.
    pub fn plan(request: &ChatRequest, configured_tokens: u32, seq: u64) -> Self {
        let (tokens, finish_reason) = match request.max_tokens {
            Some(cap) if cap < u64::from(configured_tokens) => {
                // cap < configured_tokens <= u32::MAX, so it fits.
                (u32::try_from(cap).unwrap_or(0), FinishReason::Length)
            }
            _ => (configured_tokens, FinishReason::Stop),
        };
        Self {
            id: format!("{COMPLETION_ID_PREFIX}{seq}"),
            model: request.model.clone(),
            tokens,
            finish_reason,
            prompt_tokens: request.prompt_tokens,
            include_usage: request.include_usage,
            token_bytes: 0,
        }
    }

    /// The same completion with every content token padded to
    /// `token_bytes` bytes (0: unpadded).
    pub fn with_token_bytes(mut self, token_bytes: u32) -> Self {
        self.token_bytes = token_bytes;
        self
    }

    /// The message content: the (padded) tokens concatenated.
    pub fn content(&self) -> String {
        (0..self.tokens)
            .map(|i| padded_token_text(i, self.token_bytes))
            .collect()
    }

    /// The `usage` object.
    pub fn usage(&self) -> Usage {
        let completion_tokens = u64::from(self.tokens);
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens.saturating_add(completion_tokens),
        }
    }

    /// The non-streaming `chat.completion` JSON body.
    pub fn json_body(&self, sent_ns: u64) -> String {
        let content = self.content();
        let body = CompletionWire {
            id: &self.id,
            object: "chat.completion",
            created: CREATED_UNIX_S,
            model: &self.model,
            choices: [CompletionChoiceWire {
                index: 0,
                message: MessageOutWire {
                    role: "assistant",
                    content: &content,
                },
                logprobs: None,
                finish_reason: self.finish_reason,
            }],
            usage: self.usage(),
            iop_mock_sent_ns: sent_ns,
        };
        to_json(&body)
    }

    /// The first stream event: delta `{"role":"assistant","content":""}`.
    pub fn role_event(&self, sent_ns: u64) -> String {
        self.choice_event(
            DeltaWire {
                role: Some("assistant"),
                content: Some(""),
            },
            None,
            sent_ns,
        )
    }

    /// The stream event carrying token `index`.
    pub fn token_event(&self, index: u32, sent_ns: u64) -> String {
        let text = padded_token_text(index, self.token_bytes);
        self.choice_event(
            DeltaWire {
                role: None,
                content: Some(&text),
            },
            None,
            sent_ns,
        )
    }

    /// The stream event with an empty delta and the finish reason.
    pub fn finish_event(&self, sent_ns: u64) -> String {
        self.choice_event(
            DeltaWire {
                role: None,
                content: None,
            },
            Some(self.finish_reason),
            sent_ns,
        )
    }

    /// The usage event (`"choices":[]`), sent only with `include_usage`.
    pub fn usage_event(&self, sent_ns: u64) -> String {
        self.event(&[], Some(Some(self.usage())), sent_ns)
    }

    fn choice_event(
        &self,
        delta: DeltaWire<'_>,
        finish_reason: Option<FinishReason>,
        sent_ns: u64,
    ) -> String {
        let choices = [ChunkChoiceWire {
            index: 0,
            delta,
            logprobs: None,
            finish_reason,
        }];
        let usage = if self.include_usage { Some(None) } else { None };
        self.event(&choices, usage, sent_ns)
    }

    fn event(
        &self,
        choices: &[ChunkChoiceWire<'_>],
        usage: Option<Option<Usage>>,
        sent_ns: u64,
    ) -> String {
        let chunk = ChunkWire {
            id: &self.id,
            object: "chat.completion.chunk",
            created: CREATED_UNIX_S,
            model: &self.model,
            choices,
            usage,
            iop_mock_sent_ns: sent_ns,
        };
        format!("data: {}\n\n", to_json(&chunk))
    }
}

/// Serializes a value made only of strings, numbers and options, which
/// cannot fail; an impossible failure renders as `null`.
fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "null".to_string())
}

#[derive(Serialize)]
struct CompletionWire<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [CompletionChoiceWire<'a>; 1],
    usage: Usage,
    iop_mock_sent_ns: u64,
}

#[derive(Serialize)]
struct CompletionChoiceWire<'a> {
    index: u32,
    message: MessageOutWire<'a>,
    logprobs: Option<()>,
    finish_reason: FinishReason,
}

#[derive(Serialize)]
struct MessageOutWire<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct ChunkWire<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [ChunkChoiceWire<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
    iop_mock_sent_ns: u64,
}

#[derive(Serialize)]
struct ChunkChoiceWire<'a> {
    index: u32,
    delta: DeltaWire<'a>,
    logprobs: Option<()>,
    finish_reason: Option<FinishReason>,
}

#[derive(Serialize)]
struct DeltaWire<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

/// One thing the stream shell does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamStep {
    /// Sleep this long before asking for the next step.
    Sleep {
        /// How long.
        duration_ms: u64,
    },
    /// Write this SSE event as one HTTP chunk and flush it.
    Event(String),
    /// Injected stall forever: write nothing more, keep the connection open.
    Hang,
    /// Injected drop: close the connection now, mid-stream.
    Drop,
}

/// Where a [`StreamPlan`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamPhase {
    /// The role chunk is next.
    Role,
    /// The time-to-first-token pause is next.
    FirstTokenDelay,
    /// Token `next` is next (`next == tokens` means the finish chunk).
    Token {
        /// The index of the next token.
        next: u32,
    },
    /// The pause before token `next` is next.
    InterTokenDelay {
        /// The index of the token after the pause.
        next: u32,
    },
    /// The usage chunk is next (only with `include_usage`).
    Usage,
    /// `data: [DONE]` is next.
    Done,
    /// The injected fault is next; then token `next` (a finite stall).
    Fault {
        /// The index of the token after the fault.
        next: u32,
    },
    /// Nothing is left.
    Finished,
}

/// A fault a [`StreamPlan`] injects after a number of content tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFault {
    /// Pause this long (`None` = forever) after `after_tokens` tokens.
    Stall {
        /// Content tokens written first.
        after_tokens: u32,
        /// Pause length; `None` = forever.
        duration_ms: Option<u64>,
    },
    /// Close the connection after `after_tokens` tokens.
    Drop {
        /// Content tokens written first.
        after_tokens: u32,
    },
}

impl StreamFault {
    fn after_tokens(self) -> u32 {
        match self {
            StreamFault::Stall { after_tokens, .. } | StreamFault::Drop { after_tokens } => {
                after_tokens
            }
        }
    }
}

/// The sans-IO plan of one streamed completion: call
/// [`next_step`](Self::next_step) until it returns `None`, sleeping or
/// writing as each step says.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    completion: Completion,
    ttft_ms: u64,
    inter_token_ms: u64,
    phase: StreamPhase,
    fault: Option<StreamFault>,
}

impl StreamPlan {
    /// A plan for `completion` with the given pauses.
    pub fn new(completion: Completion, ttft_ms: u64, inter_token_ms: u64) -> Self {
        Self {
            completion,
            ttft_ms,
            inter_token_ms,
            phase: StreamPhase::Role,
            fault: None,
        }
    }

    /// The same plan with `fault` injected; a fault after as many tokens as
    /// the completion has (or more) never happens.
    pub fn with_fault(mut self, fault: Option<StreamFault>) -> Self {
        self.fault = fault.filter(|f| f.after_tokens() < self.completion.tokens);
        self
    }

    /// The completion being streamed.
    pub fn completion(&self) -> &Completion {
        &self.completion
    }

    /// The next step; an event is stamped with `sent_ns`. Pauses of zero are
    /// skipped. `None` once `data: [DONE]` has been handed out.
    pub fn next_step(&mut self, sent_ns: u64) -> Option<StreamStep> {
        loop {
            match self.phase {
                StreamPhase::Role => {
                    self.phase = StreamPhase::FirstTokenDelay;
                    return Some(StreamStep::Event(self.completion.role_event(sent_ns)));
                }
                StreamPhase::FirstTokenDelay => {
                    self.phase = StreamPhase::Token { next: 0 };
                    if self.ttft_ms > 0 {
                        return Some(StreamStep::Sleep {
                            duration_ms: self.ttft_ms,
                        });
                    }
                }
                StreamPhase::Token { next } if next >= self.completion.tokens => {
                    self.phase = if self.completion.include_usage {
                        StreamPhase::Usage
                    } else {
                        StreamPhase::Done
                    };
                    return Some(StreamStep::Event(self.completion.finish_event(sent_ns)));
                }
                StreamPhase::Token { next } => {
                    let after = next.saturating_add(1);
                    self.phase = if self.fault.is_some_and(|f| f.after_tokens() == after) {
                        StreamPhase::Fault { next: after }
                    } else if after < self.completion.tokens {
                        StreamPhase::InterTokenDelay { next: after }
                    } else {
                        StreamPhase::Token { next: after }
                    };
                    return Some(StreamStep::Event(
                        self.completion.token_event(next, sent_ns),
                    ));
                }
                StreamPhase::InterTokenDelay { next } => {
                    self.phase = StreamPhase::Token { next };
                    if self.inter_token_ms > 0 {
                        return Some(StreamStep::Sleep {
                            duration_ms: self.inter_token_ms,
                        });
                    }
                }
                StreamPhase::Usage => {
                    self.phase = StreamPhase::Done;
                    return Some(StreamStep::Event(self.completion.usage_event(sent_ns)));
                }
                StreamPhase::Done => {
                    self.phase = StreamPhase::Finished;
                    return Some(StreamStep::Event(DONE_EVENT.to_string()));
                }
                StreamPhase::Fault { next } => {
                    let fault = self.fault.take();
                    match fault {
                        Some(StreamFault::Stall {
                            duration_ms: Some(duration_ms),
                            ..
                        }) => {
                            self.phase = StreamPhase::InterTokenDelay { next };
                            if duration_ms > 0 {
                                return Some(StreamStep::Sleep { duration_ms });
                            }
                        }
                        Some(StreamFault::Stall {
                            duration_ms: None, ..
                        }) => {
                            self.phase = StreamPhase::Finished;
                            return Some(StreamStep::Hang);
                        }
                        Some(StreamFault::Drop { .. }) => {
                            self.phase = StreamPhase::Finished;
                            return Some(StreamStep::Drop);
                        }
                        None => self.phase = StreamPhase::InterTokenDelay { next },
                    }
                }
                StreamPhase::Finished => return None,
            }
        }
    }
}

/// What the shell sends for one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A complete JSON response.
    Json {
        /// HTTP status code.
        status: u16,
        /// The JSON body.
        body: String,
    },
    /// A non-streaming completion: wait `delay_ms` (the time the tokens would
    /// take), then send `200` with [`Completion::json_body`] stamped with the
    /// send time.
    Completion {
        /// Simulated generation time: `ttft_ms + (tokens - 1) * inter_token_ms`.
        delay_ms: u64,
        /// The completion to render.
        completion: Completion,
    },
    /// A `text/event-stream` response driven by the plan.
    Stream(StreamPlan),
    /// Never answer (a hanging health check or an injected stall forever);
    /// keep the connection until the client closes it.
    Hang,
    /// Close the connection without answering (injected drop).
    Drop,
    /// A complete response of any content type (plain text, audio bytes).
    Body {
        /// HTTP status code.
        status: u16,
        /// `content-type`.
        content_type: &'static str,
        /// The body.
        body: Vec<u8>,
    },
    /// A reply scripted in full (the other protocols and the tool modes).
    Scripted(super::script::Script),
}

/// The OpenAI error body:
/// `{"error":{"message":..,"type":"invalid_request_error","param":null,"code":null}}`.
pub fn error_body(message: &str) -> String {
    #[derive(Serialize)]
    struct ErrorWire<'a> {
        error: ErrorDetailWire<'a>,
    }
    #[derive(Serialize)]
    struct ErrorDetailWire<'a> {
        message: &'a str,
        #[serde(rename = "type")]
        kind: &'static str,
        param: Option<()>,
        code: Option<()>,
    }
    to_json(&ErrorWire {
        error: ErrorDetailWire {
            message,
            kind: "invalid_request_error",
            param: None,
            code: None,
        },
    })
}

/// The `GET /v1/models` body for `models`.
pub fn models_body(models: &[String]) -> String {
    #[derive(Serialize)]
    struct ListWire<'a> {
        object: &'static str,
        data: Vec<ModelWire<'a>>,
    }
    #[derive(Serialize)]
    struct ModelWire<'a> {
        id: &'a str,
        object: &'static str,
        created: u64,
        owned_by: &'static str,
    }
    to_json(&ListWire {
        object: "list",
        data: models
            .iter()
            .map(|id| ModelWire {
                id,
                object: "model",
                created: CREATED_UNIX_S,
                owned_by: OWNED_BY,
            })
            .collect(),
    })
}

/// `GET /v1/models/{id}`: `(200, the model object)` for a listed `id`,
/// `(404, an OpenAI error)` otherwise. `id` is matched as sent (no
/// percent-decoding).
pub fn model_body(models: &[String], id: &str) -> (u16, String) {
    if models.iter().any(|m| m == id) {
        let body = serde_json::json!({
            "id": id,
            "object": "model",
            "created": CREATED_UNIX_S,
            "owned_by": OWNED_BY,
        });
        return (200, body.to_string());
    }
    let body = serde_json::json!({"error": {
        "message": format!("The model '{id}' does not exist"),
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }});
    (404, body.to_string())
}

/// The `GET /admin/stats` body: the counters, then `last_audio` (what the
/// last parsed audio upload carried, or `null`), `last_model` and
/// `last_traceparent`.
#[derive(Serialize)]
struct StatsView<'a> {
    #[serde(flatten)]
    stats: &'a MockStats,
    last_audio: Option<&'a super::audio::AudioSeen>,
    last_model: Option<&'a str>,
    last_traceparent: Option<&'a str>,
}

/// The string `model` member of a JSON request body, if any.
fn model_member(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Model {
        model: Option<String>,
    }
    serde_json::from_slice::<Model>(body).ok()?.model
}

fn json_reply((status, body): (u16, String)) -> Reply {
    Reply::Json { status, body }
}

/// The mock's request handler: configuration, the precomputed models body
/// and the completion counter. One per server thread.
#[derive(Debug)]
pub struct MockProvider {
    config: MockConfig,
    faults: MockFaults,
    health: HealthState,
    stats: MockStats,
    models_body: String,
    completions_started: u64,
    modes: super::tools::MockModes,
    required_api_key: Option<super::auth::ApiKey>,
    close_after_requests: Option<u32>,
    token_bytes: u32,
    tls: Option<iop_engine::tls::HttpsAcceptor>,
    prefix_cache: Option<PrefixModel>,
    vocabulary: super::tokenize::Vocabulary,
    last_audio: Option<super::audio::AudioSeen>,
    last_model: Option<String>,
    last_traceparent: Option<String>,
}

/// The prefix cache model of [`MockProvider::with_prefix_cache`].
#[derive(Debug, Clone)]
struct PrefixModel {
    cache: super::prefix_cache::PrefixCache,
    prefill_us_per_token: u64,
}

impl MockProvider {
    /// A handler serving `config`.
    pub fn new(config: MockConfig) -> Self {
        Self::with_faults(config, MockFaults::default())
    }

    /// A handler serving `config` with `faults` injected.
    pub fn with_faults(config: MockConfig, faults: MockFaults) -> Self {
        let models_body = models_body(&config.models);
        Self {
            config,
            faults,
            health: HealthState::Healthy,
            stats: MockStats::default(),
            models_body,
            completions_started: 0,
            modes: super::tools::MockModes::default(),
            required_api_key: None,
            close_after_requests: None,
            token_bytes: 0,
            tls: None,
            prefix_cache: None,
            vocabulary: super::tokenize::Vocabulary::default(),
            last_audio: None,
            last_model: None,
            last_traceparent: None,
        }
    }

    /// The same handler padding every OpenAI chat completion token to
    /// `token_bytes` bytes (`--token-bytes`, for body-heavy streams; 0:
    /// unpadded). The other protocols keep unpadded tokens.
    pub fn with_token_bytes(mut self, token_bytes: u32) -> Self {
        self.token_bytes = token_bytes;
        self
    }

    /// The same handler modelling an inference server's prefix cache of
    /// `capacity_tokens` tokens, with `prefill_us_per_token` µs of prefill
    /// per uncached prompt token before the first token (see the module
    /// docs). Both 0 is the default: no model, no delay, counters at 0.
    pub fn with_prefix_cache(mut self, capacity_tokens: usize, prefill_us_per_token: u64) -> Self {
        self.prefix_cache =
            (capacity_tokens > 0 || prefill_us_per_token > 0).then(|| PrefixModel {
                cache: super::prefix_cache::PrefixCache::new(capacity_tokens),
                prefill_us_per_token,
            });
        self
    }

    /// The prefix cache, when modelled.
    pub fn prefix_cache(&self) -> Option<&super::prefix_cache::PrefixCache> {
        self.prefix_cache.as_ref().map(|model| &model.cache)
    }

    /// The padding of chat completion tokens (0: none).
    pub fn token_bytes(&self) -> u32 {
        self.token_bytes
    }

    /// The same handler closing each connection, without notice, after it
    /// served `requests` requests (`--close-after-requests`): the reply
    /// still looks keep-alive, so a client pool keeps the connection and
    /// finds it closed on its next request — a server's idle-connection
    /// close as a test can trigger it.
    pub fn with_close_after_requests(mut self, requests: u32) -> Self {
        self.close_after_requests = Some(requests);
        self
    }

    /// Requests a connection serves before the shell closes it, if limited.
    pub fn close_after_requests(&self) -> Option<u32> {
        self.close_after_requests
    }

    /// The same handler served over HTTPS with `tls` (`--tls-cert`,
    /// `--tls-key`).
    pub fn with_tls(mut self, tls: iop_engine::tls::HttpsAcceptor) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The HTTPS acceptor, when the mock serves TLS.
    pub fn tls(&self) -> Option<&iop_engine::tls::HttpsAcceptor> {
        self.tls.as_ref()
    }

    /// Counts a TLS handshake that failed (the client refused the
    /// certificate, or gave up).
    pub fn tls_handshake_failed(&mut self) {
        self.stats.tls_handshake_failures += 1;
    }

    /// The same handler requiring `key` on provider routes
    /// (`--require-api-key`, see [`super::auth`]).
    pub fn with_required_api_key(mut self, key: super::auth::ApiKey) -> Self {
        self.required_api_key = Some(key);
        self
    }

    /// The API key provider routes require, if any.
    pub fn required_api_key(&self) -> Option<&super::auth::ApiKey> {
        self.required_api_key.as_ref()
    }

    /// The same handler with the tool-calling `modes` on.
    pub fn with_modes(mut self, modes: super::tools::MockModes) -> Self {
        self.modes = modes;
        self
    }

    /// The tool-calling modes.
    pub fn modes(&self) -> super::tools::MockModes {
        self.modes
    }

    /// The injected faults.
    pub fn faults(&self) -> &MockFaults {
        &self.faults
    }

    /// What `GET /health` answers now.
    pub fn health(&self) -> HealthState {
        self.health
    }

    /// The counters.
    pub fn stats(&self) -> MockStats {
        self.stats
    }

    /// The shell accepted a connection.
    pub fn connection_opened(&mut self) {
        self.stats.connections_accepted += 1;
        self.stats.connections_open += 1;
    }

    /// A connection closed.
    pub fn connection_closed(&mut self) {
        self.stats.connections_open = self.stats.connections_open.saturating_sub(1);
    }

    /// The shell started writing a stream.
    pub fn stream_started(&mut self) {
        self.stats.active_streams += 1;
    }

    /// A stream ended (finished, dropped, hung up on or failed).
    pub fn stream_ended(&mut self) {
        self.stats.active_streams = self.stats.active_streams.saturating_sub(1);
    }

    /// The shell wrote `len` event bytes of a streamed reply.
    pub fn stream_wrote(&mut self, len: usize) {
        self.stats.stream_bytes_written += len as u64;
    }

    /// Writing a stream failed: the client went away mid-reply.
    pub fn stream_aborted(&mut self) {
        self.stats.streams_aborted += 1;
    }

    /// The configuration served.
    pub fn config(&self) -> &MockConfig {
        &self.config
    }

    /// Notes the `traceparent` header of a request (served as
    /// `last_traceparent` by `GET /admin/stats`).
    pub fn saw_traceparent(&mut self, value: &[u8]) {
        self.last_traceparent = Some(String::from_utf8_lossy(value).into_owned());
    }

    /// Decides the reply to one request. `path` may carry a query string,
    /// which is ignored. Completion ids count up from `chatcmpl-mock-1`.
    pub fn handle(&mut self, method: &str, path: &str, body: &[u8]) -> Reply {
        self.handle_typed(method, path, None, body)
    }

    /// [`handle`](Self::handle) with the request's `content-type`, which
    /// the multipart routes (audio uploads) need.
    pub fn handle_typed(
        &mut self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Reply {
        let route = path.split_once('?').map_or(path, |(route, _query)| route);
        if method == "POST"
            && matches!(
                route,
                "/v1/completions"
                    | "/v1/embeddings"
                    | "/v1/rerank"
                    | "/v2/rerank"
                    | "/v1/score"
                    | "/tokenize"
                    | "/detokenize"
            )
        {
            self.last_model = model_member(body);
        }
        match (method, route) {
            ("GET", "/v1/models") => Reply::Json {
                status: 200,
                body: self.models_body.clone(),
            },
            ("POST", "/v1/chat/completions") => {
                let ttft_ms = self.prefill(PromptShape::Messages, body);
                self.chat(body, ttft_ms)
            }
            ("POST", "/api/chat") => {
                self.stats.ollama_chat_requests += 1;
                let ttft_ms = self.prefill(PromptShape::Messages, body);
                let config = self.config_with_ttft(ttft_ms);
                let script = super::ollama::chat(body, &config, &self.faults, self.modes);
                Reply::Scripted(script)
            }
            ("GET", "/api/tags") => Reply::Json {
                status: 200,
                body: super::ollama::tags_body(&self.config.models),
            },
            ("GET", "/api/version") => Reply::Json {
                status: 200,
                body: super::ollama::version_body(),
            },
            ("POST", "/v1/messages") => {
                self.stats.messages_requests += 1;
                let seq = self.next_seq();
                let ttft_ms = self.prefill(PromptShape::SystemAndMessages, body);
                Reply::Scripted(super::anthropic::messages(
                    body,
                    &self.config_with_ttft(ttft_ms),
                    &self.faults,
                    seq,
                ))
            }
            ("POST", "/v1/messages/count_tokens") => {
                Reply::Scripted(super::anthropic::count_tokens(body, &self.faults))
            }
            ("POST", "/v1/responses") => {
                self.stats.responses_requests += 1;
                let seq = self.next_seq();
                let ttft_ms = self.prefill(PromptShape::InstructionsAndInput, body);
                Reply::Scripted(super::responses::create(
                    body,
                    &self.config_with_ttft(ttft_ms),
                    &self.faults,
                    seq,
                ))
            }
            ("POST", "/v1/completions") => {
                self.stats.completions_requests += 1;
                let seq = self.next_seq();
                let ttft_ms = self.prefill(PromptShape::Prompt, body);
                Reply::Scripted(super::completions::create(
                    body,
                    &self.config_with_ttft(ttft_ms),
                    &self.faults,
                    seq,
                ))
            }
            ("POST", "/v1/embeddings") => {
                self.stats.embeddings_requests += 1;
                json_reply(super::embeddings::openai(body))
            }
            ("POST", "/api/embed") => {
                self.stats.ollama_embed_requests += 1;
                json_reply(super::embeddings::ollama(body))
            }
            ("POST", "/v1/rerank" | "/v2/rerank") => {
                self.stats.rerank_requests += 1;
                let seq = self.next_seq();
                json_reply(super::rerank::rerank(body, seq))
            }
            ("POST", "/v1/score") => {
                self.stats.score_requests += 1;
                let seq = self.next_seq();
                json_reply(super::rerank::score_pairs(body, seq))
            }
            ("POST", "/tokenize") => {
                self.stats.tokenize_requests += 1;
                json_reply(self.vocabulary.tokenize(body))
            }
            ("POST", "/detokenize") => {
                self.stats.detokenize_requests += 1;
                json_reply(self.vocabulary.detokenize(body))
            }
            ("POST", "/v1/audio/transcriptions") => {
                self.stats.transcription_requests += 1;
                self.audio_upload(super::audio::Task::Transcription, content_type, body)
            }
            ("POST", "/v1/audio/translations") => {
                self.stats.translation_requests += 1;
                self.audio_upload(super::audio::Task::Translation, content_type, body)
            }
            ("POST", "/v1/audio/speech") => {
                self.stats.speech_requests += 1;
                let reply = super::audio::speech(body);
                Reply::Body {
                    status: reply.status,
                    content_type: reply.content_type,
                    body: reply.body,
                }
            }
            ("GET", model) if model.starts_with("/v1/models/") => {
                self.stats.model_requests += 1;
                let id = &model["/v1/models/".len()..];
                json_reply(model_body(&self.config.models, id))
            }
            ("GET", "/health") => match self.health {
                HealthState::Healthy => Reply::Json {
                    status: 200,
                    body: r#"{"status":"ok"}"#.to_string(),
                },
                HealthState::Unhealthy => Reply::Json {
                    status: 503,
                    body: r#"{"status":"unhealthy"}"#.to_string(),
                },
                HealthState::Hanging => Reply::Hang,
                HealthState::Missing => Reply::Json {
                    status: 404,
                    body: r#"{"detail":"Not Found"}"#.to_string(),
                },
            },
            ("POST", "/admin/health") => self.set_health(body),
            ("GET", "/admin/stats") => Reply::Json {
                status: 200,
                body: to_json(&StatsView {
                    stats: &self.stats,
                    last_audio: self.last_audio.as_ref(),
                    last_model: self.last_model.as_deref(),
                    last_traceparent: self.last_traceparent.as_deref(),
                }),
            },
            _ => Reply::Json {
                status: 404,
                body: error_body(&format!("Invalid URL ({method} {route})")),
            },
        }
    }

    fn audio_upload(
        &mut self,
        task: super::audio::Task,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Reply {
        let (reply, seen) = super::audio::upload(task, content_type, body);
        if let Some(seen) = seen {
            self.stats.audio_file_bytes += seen.file_bytes;
            self.last_audio = Some(seen);
        }
        Reply::Body {
            status: reply.status,
            content_type: reply.content_type,
            body: reply.body,
        }
    }

    /// What the last audio upload carried (model, file size and hash).
    pub fn last_audio(&self) -> Option<&super::audio::AudioSeen> {
        self.last_audio.as_ref()
    }

    fn set_health(&mut self, body: &[u8]) -> Reply {
        #[derive(Deserialize)]
        struct SetHealthWire {
            state: HealthState,
        }
        match serde_json::from_slice::<SetHealthWire>(body) {
            Ok(wire) => {
                self.health = wire.state;
                Reply::Json {
                    status: 200,
                    body: format!(r#"{{"state":{}}}"#, to_json(&self.health)),
                }
            }
            Err(err) => Reply::Json {
                status: 400,
                body: error_body(&format!(
                    "expected {{\"state\":\"healthy\"|\"unhealthy\"|\"hanging\"|\"missing\"}}: {err}"
                )),
            },
        }
    }

    /// The delay before the first token of a generation request with
    /// `body`: `ttft_ms`, plus the prefill of its uncached prompt tokens when
    /// the prefix cache is modelled (which then counts and caches the
    /// prompt). A body that is not JSON, or a request answered by an
    /// injected failure status, is not prefilled.
    fn prefill(&mut self, shape: PromptShape, body: &[u8]) -> u64 {
        let ttft_ms = self.config.ttft_ms;
        let Some(model) = self.prefix_cache.as_mut() else {
            return ttft_ms;
        };
        if self.faults.fail_status.is_some() {
            return ttft_ms;
        }
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
            return ttft_ms;
        };
        let tokens = super::prefix_cache::prompt_sequence(shape, &value);
        let cached = model.cache.serve(&tokens) as u64;
        let prompt = tokens.len() as u64;
        self.stats.prompt_tokens_seen += prompt;
        self.stats.cached_tokens_hit += cached;
        super::prefix_cache::first_token_delay_ms(
            ttft_ms,
            model.prefill_us_per_token,
            prompt,
            cached,
        )
    }

    /// The configuration with the first token after `ttft_ms`.
    fn config_with_ttft(&self, ttft_ms: u64) -> std::borrow::Cow<'_, MockConfig> {
        if ttft_ms == self.config.ttft_ms {
            std::borrow::Cow::Borrowed(&self.config)
        } else {
            std::borrow::Cow::Owned(MockConfig {
                ttft_ms,
                ..self.config.clone()
            })
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.completions_started = self.completions_started.saturating_add(1);
        self.completions_started
    }

    /// The tool modes' reply to a chat request, if they take it.
    fn tool_reply(&mut self, request: &ChatRequest, body: &[u8], ttft_ms: u64) -> Option<Reply> {
        use super::tools::{self, ToolDecision};
        if self.modes == tools::MockModes::default() {
            return None;
        }
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        let decision = tools::decide(self.modes, &value)?;
        let seq = self.completions_started;
        let ctx = tools::ChatReplyCtx {
            id: format!("{COMPLETION_ID_PREFIX}{seq}"),
            call_id: format!("call_mock_{seq}"),
            model: &request.model,
            prompt_tokens: request.prompt_tokens,
            stream: request.stream,
            include_usage: request.include_usage,
        };
        Some(match decision {
            ToolDecision::Reject => {
                self.stats.tools_rejected += 1;
                Reply::Json {
                    status: 400,
                    body: tools::rejection_body(),
                }
            }
            ToolDecision::Call(call) => {
                Reply::Scripted(ctx.tool_call_reply(&call, &self.config_with_ttft(ttft_ms)))
            }
            ToolDecision::Text(text) => {
                Reply::Scripted(ctx.text_reply(&text, &self.config_with_ttft(ttft_ms)))
            }
        })
    }

    /// A chat completion whose first token comes after `ttft_ms`.
    fn chat(&mut self, body: &[u8], ttft_ms: u64) -> Reply {
        self.stats.chat_requests += 1;
        if let Some(status) = self.faults.fail_status {
            return Reply::Json {
                status,
                body: error_body(&format!("injected failure (status {status})")),
            };
        }
        let request = match ChatRequest::parse(body) {
            Ok(request) => request,
            Err(err) => {
                return Reply::Json {
                    status: 400,
                    body: error_body(&err.to_string()),
                }
            }
        };
        self.completions_started = self.completions_started.saturating_add(1);
        if let Some(reply) = self.tool_reply(&request, body, ttft_ms) {
            return reply;
        }
        let completion = Completion::plan(&request, self.config.tokens, self.completions_started)
            .with_token_bytes(self.token_bytes);
        let fault = match (
            self.faults.drop_after_tokens,
            self.faults.stall_after_tokens,
        ) {
            (Some(after_tokens), _) => Some(StreamFault::Drop { after_tokens }),
            (None, Some(after_tokens)) => Some(StreamFault::Stall {
                after_tokens,
                duration_ms: (self.faults.stall_ms > 0).then_some(self.faults.stall_ms),
            }),
            (None, None) => None,
        }
        .filter(|f| f.after_tokens() < completion.tokens);
        if request.stream {
            Reply::Stream(
                StreamPlan::new(completion, ttft_ms, self.config.inter_token_ms).with_fault(fault),
            )
        } else {
            let gaps = u64::from(completion.tokens.saturating_sub(1));
            let delay_ms = if completion.tokens == 0 {
                0
            } else {
                ttft_ms.saturating_add(gaps.saturating_mul(self.config.inter_token_ms))
            };
            match fault {
                Some(StreamFault::Drop { .. }) => Reply::Drop,
                Some(StreamFault::Stall {
                    duration_ms: None, ..
                }) => Reply::Hang,
                Some(StreamFault::Stall {
                    duration_ms: Some(stall_ms),
                    ..
                }) => Reply::Completion {
                    delay_ms: delay_ms.saturating_add(stall_ms),
                    completion,
                },
                None => Reply::Completion {
                    delay_ms,
                    completion,
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(tokens: u32) -> MockProvider {
        MockProvider::new(MockConfig {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens,
            models: vec!["mock-model".to_string()],
        })
    }

    fn stream_events(plan: &mut StreamPlan) -> Vec<StreamStep> {
        let mut steps = Vec::new();
        let mut sent_ns = 100;
        while let Some(step) = plan.next_step(sent_ns) {
            steps.push(step);
            sent_ns += 1;
        }
        steps
    }

    fn plan_of(reply: Reply) -> StreamPlan {
        match reply {
            Reply::Stream(plan) => plan,
            other => panic!("expected a stream, got {other:?}"),
        }
    }

    #[test]
    fn token_rule_is_tok_index_space() {
        assert_eq!(token_text(0), "tok0 ");
        assert_eq!(token_text(17), "tok17 ");
        assert_eq!(completion_text(3), "tok0 tok1 tok2 ");
        assert_eq!(completion_text(0), "");
    }

    #[test]
    fn padded_tokens_are_exactly_token_bytes_long() {
        assert_eq!(padded_token_text(3, 12), "tok3....... ");
        assert_eq!(padded_token_text(3, 12).len(), 12);
        assert_eq!(padded_token_text(17, 7), "tok17. ");
        // Shorter than the token, or 0: unpadded.
        assert_eq!(padded_token_text(17, 6), "tok17 ");
        assert_eq!(padded_token_text(17, 3), "tok17 ");
        assert_eq!(padded_token_text(0, 0), "tok0 ");
        assert_eq!(padded_token_text(255, 4096).len(), 4096);
        assert_eq!(word_count(&padded_token_text(255, 4096)), 1);
    }

    #[test]
    fn padded_stream_chunk_is_exact() {
        let mut p = provider(2).with_token_bytes(16);
        assert_eq!(p.token_bytes(), 16);
        let body = br#"{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        let mut plan = plan_of(p.handle("POST", "/v1/chat/completions", body));
        let steps = stream_events(&mut plan);
        assert_eq!(steps.len(), 5);
        assert_eq!(
            steps[2],
            StreamStep::Event(
                concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{"content":"tok1........... "},"logprobs":null,"finish_reason":null}],"#,
                    r#""iop_mock_sent_ns":102}"#,
                    "\n\n"
                )
                .to_string()
            )
        );
        assert_eq!(steps[4], StreamStep::Event(DONE_EVENT.to_string()));
        // A non-streamed reply carries the same padded content.
        let plain = br#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#;
        let Reply::Completion { completion, .. } = p.handle("POST", "/v1/chat/completions", plain)
        else {
            panic!("expected a completion");
        };
        assert_eq!(completion.content(), "tok0........... tok1........... ");
    }

    #[test]
    fn two_token_stream_without_usage_is_exact() {
        let mut p = provider(2);
        let body =
            br#"{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi there"}]}"#;
        let mut plan = plan_of(p.handle("POST", "/v1/chat/completions", body));
        let steps = stream_events(&mut plan);
        let ev = |s: &str| StreamStep::Event(s.to_string());
        assert_eq!(
            steps,
            vec![
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"#,
                    r#""iop_mock_sent_ns":100}"#,
                    "\n\n"
                )),
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{"content":"tok0 "},"logprobs":null,"finish_reason":null}],"#,
                    r#""iop_mock_sent_ns":101}"#,
                    "\n\n"
                )),
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{"content":"tok1 "},"logprobs":null,"finish_reason":null}],"#,
                    r#""iop_mock_sent_ns":102}"#,
                    "\n\n"
                )),
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"#,
                    r#""iop_mock_sent_ns":103}"#,
                    "\n\n"
                )),
                ev("data: [DONE]\n\n"),
            ]
        );
        assert_eq!(plan.next_step(0), None);
    }

    #[test]
    fn two_token_stream_with_usage_is_exact() {
        let mut p = provider(2);
        let body = br#"{"model":"m1","stream":true,"stream_options":{"include_usage":true},
            "messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi  there\nfriend"}]}"#;
        let mut plan = plan_of(p.handle("POST", "/v1/chat/completions", body));
        let steps = stream_events(&mut plan);
        let ev = |s: &str| StreamStep::Event(s.to_string());
        assert_eq!(
            steps,
            vec![
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"#,
                    r#""usage":null,"iop_mock_sent_ns":100}"#,
                    "\n\n"
                )),
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{"content":"tok0 "},"logprobs":null,"finish_reason":null}],"#,
                    r#""usage":null,"iop_mock_sent_ns":101}"#,
                    "\n\n"
                )),
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{"content":"tok1 "},"logprobs":null,"finish_reason":null}],"#,
                    r#""usage":null,"iop_mock_sent_ns":102}"#,
                    "\n\n"
                )),
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"#,
                    r#""usage":null,"iop_mock_sent_ns":103}"#,
                    "\n\n"
                )),
                ev(concat!(
                    r#"data: {"id":"chatcmpl-mock-1","object":"chat.completion.chunk","created":1700000000,"model":"m1","#,
                    r#""choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7},"#,
                    r#""iop_mock_sent_ns":104}"#,
                    "\n\n"
                )),
                ev("data: [DONE]\n\n"),
            ]
        );
    }

    #[test]
    fn stream_sleeps_ttft_before_first_token_and_between_tokens() {
        let request = ChatRequest {
            model: "m".into(),
            prompt_tokens: 0,
            stream: true,
            include_usage: false,
            max_tokens: None,
        };
        let mut plan = StreamPlan::new(Completion::plan(&request, 3, 1), 50, 7);
        let shape: Vec<String> = stream_events(&mut plan)
            .into_iter()
            .map(|step| match step {
                StreamStep::Sleep { duration_ms } => format!("sleep {duration_ms}"),
                StreamStep::Event(e) if e == DONE_EVENT => "done".to_string(),
                StreamStep::Event(e) if e.contains(r#""role":"assistant""#) => "role".into(),
                StreamStep::Event(e) if e.contains(r#""finish_reason":"stop""#) => "finish".into(),
                StreamStep::Event(e) => {
                    let start = e.find("tok").unwrap_or(0);
                    e[start..start + 4].to_string()
                }
                StreamStep::Hang | StreamStep::Drop => "fault".to_string(),
            })
            .collect();
        assert_eq!(
            shape,
            ["role", "sleep 50", "tok0", "sleep 7", "tok1", "sleep 7", "tok2", "finish", "done"]
        );
    }

    #[test]
    fn non_streaming_body_is_exact() {
        let mut p = provider(3);
        let body = br#"{"model":"gpt-x","messages":[{"role":"user","content":[{"type":"text","text":"one two"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null}]}"#;
        let reply = p.handle("POST", "/v1/chat/completions?api-version=1", body);
        let Reply::Completion {
            delay_ms,
            completion,
        } = reply
        else {
            panic!("expected a completion, got {reply:?}");
        };
        assert_eq!(delay_ms, 0);
        assert_eq!(
            completion.json_body(42),
            concat!(
                r#"{"id":"chatcmpl-mock-1","object":"chat.completion","created":1700000000,"model":"gpt-x","#,
                r#""choices":[{"index":0,"message":{"role":"assistant","content":"tok0 tok1 tok2 "},"logprobs":null,"finish_reason":"stop"}],"#,
                r#""usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5},"iop_mock_sent_ns":42}"#
            )
        );
    }

    #[test]
    fn non_streaming_delay_is_the_stream_duration() {
        let mut p = MockProvider::new(MockConfig {
            ttft_ms: 100,
            inter_token_ms: 10,
            tokens: 4,
            models: vec![],
        });
        let body = br#"{"model":"m","messages":[]}"#;
        match p.handle("POST", "/v1/chat/completions", body) {
            Reply::Completion { delay_ms, .. } => assert_eq!(delay_ms, 130),
            other => panic!("expected a completion, got {other:?}"),
        }
        let capped = br#"{"model":"m","messages":[],"max_tokens":0}"#;
        match p.handle("POST", "/v1/chat/completions", capped) {
            Reply::Completion { delay_ms, .. } => assert_eq!(delay_ms, 0),
            other => panic!("expected a completion, got {other:?}"),
        }
    }

    #[test]
    fn usage_counts_words_of_every_message() {
        let body = br#"{"model":"m","messages":[
            {"role":"system","content":"  a b\tc  "},
            {"role":"user","content":[{"type":"text","text":"d e"},{"type":"text","text":""}]},
            {"role":"tool","content":7},
            {"role":"assistant"}]}"#;
        let request = ChatRequest::parse(body).unwrap();
        assert_eq!(request.prompt_tokens, 5);
        let completion = Completion::plan(&request, 16, 9);
        assert_eq!(completion.id, "chatcmpl-mock-9");
        assert_eq!(
            completion.usage(),
            Usage {
                prompt_tokens: 5,
                completion_tokens: 16,
                total_tokens: 21
            }
        );
    }

    #[test]
    fn max_tokens_caps_and_finishes_with_length() {
        let mut p = provider(4);
        let body = br#"{"model":"m","messages":[],"max_tokens":2}"#;
        let Reply::Completion { completion, .. } = p.handle("POST", "/v1/chat/completions", body)
        else {
            panic!("expected a completion");
        };
        assert_eq!(completion.tokens, 2);
        assert_eq!(completion.finish_reason, FinishReason::Length);
        assert!(completion
            .json_body(0)
            .contains(r#""content":"tok0 tok1 "},"logprobs":null,"finish_reason":"length"}"#));

        // The smaller of max_tokens and max_completion_tokens wins.
        let both = br#"{"model":"m","messages":[],"max_tokens":3,"max_completion_tokens":1,"stream":true}"#;
        let plan = plan_of(p.handle("POST", "/v1/chat/completions", both));
        assert_eq!(plan.completion().tokens, 1);
        assert_eq!(plan.completion().id, "chatcmpl-mock-2");

        // A cap at or above --tokens changes nothing.
        let loose = br#"{"model":"m","messages":[],"max_tokens":4}"#;
        let Reply::Completion { completion, .. } = p.handle("POST", "/v1/chat/completions", loose)
        else {
            panic!("expected a completion");
        };
        assert_eq!(completion.tokens, 4);
        assert_eq!(completion.finish_reason, FinishReason::Stop);

        // A stream capped at zero: role, finish "length", done.
        let zero = br#"{"model":"m","messages":[],"max_tokens":0,"stream":true}"#;
        let mut plan = plan_of(p.handle("POST", "/v1/chat/completions", zero));
        let steps = stream_events(&mut plan);
        assert_eq!(steps.len(), 3);
        assert!(
            matches!(&steps[1], StreamStep::Event(e) if e.contains(r#""delta":{},"logprobs":null,"finish_reason":"length""#))
        );
    }

    #[test]
    fn models_list_is_exact() {
        let mut p = MockProvider::new(MockConfig {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens: 1,
            models: vec!["m1".into(), "m\"2".into()],
        });
        let Reply::Json { status, body } = p.handle("GET", "/v1/models", b"") else {
            panic!("expected json");
        };
        assert_eq!(status, 200);
        assert_eq!(
            body,
            concat!(
                r#"{"object":"list","data":["#,
                r#"{"id":"m1","object":"model","created":1700000000,"owned_by":"mock"},"#,
                r#"{"id":"m\"2","object":"model","created":1700000000,"owned_by":"mock"}]}"#
            )
        );
    }

    #[test]
    fn malformed_bodies_get_a_400_openai_error() {
        let mut p = provider(2);
        for body in [
            &b"{not json"[..],
            br#"{"messages":[]}"#,
            br#"{"model":"m"}"#,
            br#"{"model":"m","messages":[1]}"#,
            br#"{"model":"m","messages":[],"max_tokens":-1}"#,
            br#"{"model":"m","messages":[],"stream":"yes"}"#,
        ] {
            let Reply::Json { status, body } = p.handle("POST", "/v1/chat/completions", body)
            else {
                panic!("expected a json error");
            };
            assert_eq!(status, 400);
            let value: serde_json::Value = serde_json::from_str(&body).unwrap();
            let error = &value["error"];
            assert!(error["message"]
                .as_str()
                .unwrap()
                .starts_with("invalid chat completion request body: "));
            assert_eq!(error["type"], "invalid_request_error");
            assert_eq!(error["param"], serde_json::Value::Null);
            assert_eq!(error["code"], serde_json::Value::Null);
            assert_eq!(error.as_object().unwrap().len(), 4);
        }
        // Rejected requests do not consume completion ids.
        let ok = br#"{"model":"m","messages":[]}"#;
        let Reply::Completion { completion, .. } = p.handle("POST", "/v1/chat/completions", ok)
        else {
            panic!("expected a completion");
        };
        assert_eq!(completion.id, "chatcmpl-mock-1");
    }

    #[test]
    fn unknown_routes_get_a_404_openai_error() {
        let mut p = provider(2);
        let Reply::Json { status, body } = p.handle("GET", "/v1/chat/completions", b"") else {
            panic!("expected json");
        };
        assert_eq!(status, 404);
        assert_eq!(
            body,
            r#"{"error":{"message":"Invalid URL (GET /v1/chat/completions)","type":"invalid_request_error","param":null,"code":null}}"#
        );
        let Reply::Json { status, .. } = p.handle("POST", "/v2/nothing?x=1", b"{}") else {
            panic!("expected json");
        };
        assert_eq!(status, 404);
    }

    fn faulty(tokens: u32, faults: MockFaults) -> MockProvider {
        MockProvider::with_faults(
            MockConfig {
                ttft_ms: 0,
                inter_token_ms: 0,
                tokens,
                models: vec!["mock-model".to_string()],
            },
            faults,
        )
    }

    fn step_names(plan: &mut StreamPlan) -> Vec<String> {
        stream_events(plan)
            .into_iter()
            .map(|step| match step {
                StreamStep::Sleep { duration_ms } => format!("sleep {duration_ms}"),
                StreamStep::Hang => "hang".into(),
                StreamStep::Drop => "drop".into(),
                StreamStep::Event(e) if e == DONE_EVENT => "done".into(),
                StreamStep::Event(e) if e.contains(r#""role":"assistant""#) => "role".into(),
                StreamStep::Event(e) if e.contains(r#""finish_reason":"stop""#) => "finish".into(),
                StreamStep::Event(e) => {
                    let at = e.find("tok").unwrap_or(0);
                    e[at..].split(' ').next().unwrap_or("").to_string()
                }
            })
            .collect()
    }

    const STREAM: &[u8] =
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    const PLAIN: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

    #[test]
    fn stall_forever_after_n_tokens() {
        let faults = MockFaults {
            stall_after_tokens: Some(2),
            ..MockFaults::default()
        };
        let mut p = faulty(4, faults);
        let mut plan = plan_of(p.handle("POST", "/v1/chat/completions", STREAM));
        assert_eq!(step_names(&mut plan), ["role", "tok0", "tok1", "hang"]);
        assert!(matches!(
            p.handle("POST", "/v1/chat/completions", PLAIN),
            Reply::Hang
        ));
    }

    #[test]
    fn finite_stall_then_the_rest() {
        let faults = MockFaults {
            stall_after_tokens: Some(1),
            stall_ms: 250,
            ..MockFaults::default()
        };
        let mut p = faulty(3, faults);
        let mut plan = plan_of(p.handle("POST", "/v1/chat/completions", STREAM));
        assert_eq!(
            step_names(&mut plan),
            [
                "role",
                "tok0",
                "sleep 250",
                "tok1",
                "tok2",
                "finish",
                "done"
            ]
        );
        match p.handle("POST", "/v1/chat/completions", PLAIN) {
            Reply::Completion { delay_ms, .. } => assert_eq!(delay_ms, 250),
            other => panic!("expected a completion, got {other:?}"),
        }
        // A stall after as many tokens as the completion has never happens.
        let mut short = faulty(1, faults);
        let mut plan = plan_of(short.handle("POST", "/v1/chat/completions", STREAM));
        assert_eq!(step_names(&mut plan), ["role", "tok0", "finish", "done"]);
    }

    #[test]
    fn drop_after_n_tokens() {
        let faults = MockFaults {
            drop_after_tokens: Some(3),
            ..MockFaults::default()
        };
        let mut p = faulty(5, faults);
        let mut plan = plan_of(p.handle("POST", "/v1/chat/completions", STREAM));
        assert_eq!(
            step_names(&mut plan),
            ["role", "tok0", "tok1", "tok2", "drop"]
        );
        assert!(matches!(
            p.handle("POST", "/v1/chat/completions", PLAIN),
            Reply::Drop
        ));
    }

    #[test]
    fn fail_status_answers_every_chat() {
        let faults = MockFaults {
            fail_status: Some(503),
            ..MockFaults::default()
        };
        let mut p = faulty(5, faults);
        let Reply::Json { status, body } = p.handle("POST", "/v1/chat/completions", STREAM) else {
            panic!("expected JSON");
        };
        assert_eq!(status, 503);
        assert_eq!(
            body,
            r#"{"error":{"message":"injected failure (status 503)","type":"invalid_request_error","param":null,"code":null}}"#
        );
        assert_eq!(p.stats().chat_requests, 1);
    }

    #[test]
    fn health_flips_at_runtime() {
        let mut p = provider(1);
        let json = |r: Reply| match r {
            Reply::Json { status, body } => (status, body),
            other => panic!("expected JSON, got {other:?}"),
        };
        assert_eq!(
            json(p.handle("GET", "/health", b"")),
            (200, r#"{"status":"ok"}"#.to_string())
        );
        assert_eq!(
            json(p.handle("POST", "/admin/health", br#"{"state":"unhealthy"}"#)),
            (200, r#"{"state":"unhealthy"}"#.to_string())
        );
        assert_eq!(
            json(p.handle("GET", "/health", b"")),
            (503, r#"{"status":"unhealthy"}"#.to_string())
        );
        json(p.handle("POST", "/admin/health", br#"{"state":"hanging"}"#));
        assert!(matches!(p.handle("GET", "/health", b""), Reply::Hang));
        assert_eq!(p.health(), HealthState::Hanging);
        json(p.handle("POST", "/admin/health", br#"{"state":"missing"}"#));
        assert_eq!(
            json(p.handle("GET", "/health", b"")),
            (404, r#"{"detail":"Not Found"}"#.to_string())
        );
        json(p.handle("POST", "/admin/health", br#"{"state":"hanging"}"#));
        let (status, _) = json(p.handle("POST", "/admin/health", br#"{"state":"sick"}"#));
        assert_eq!(status, 400);
        assert_eq!(p.health(), HealthState::Hanging);
    }

    #[test]
    fn stats_count_connections_streams_and_chats() {
        let mut p = provider(1);
        p.connection_opened();
        p.connection_opened();
        p.connection_closed();
        p.stream_started();
        p.stream_wrote(10);
        p.stream_wrote(5);
        p.handle("POST", "/v1/chat/completions", PLAIN);
        let Reply::Json { status, body } = p.handle("GET", "/admin/stats", b"") else {
            panic!("expected JSON");
        };
        assert_eq!(status, 200);
        assert_eq!(
            body,
            concat!(
                r#"{"connections_accepted":2,"connections_open":1,"chat_requests":1,"active_streams":1,"streams_aborted":0,"tools_rejected":0,"ollama_chat_requests":0,"messages_requests":0,"responses_requests":0,"stream_bytes_written":15,"tls_handshake_failures":0,"prompt_tokens_seen":0,"cached_tokens_hit":0,"#,
                r#""completions_requests":0,"embeddings_requests":0,"ollama_embed_requests":0,"rerank_requests":0,"#,
                r#""score_requests":0,"tokenize_requests":0,"detokenize_requests":0,"model_requests":0,"#,
                r#""transcription_requests":0,"translation_requests":0,"speech_requests":0,"audio_file_bytes":0,"#,
                r#""last_audio":null,"last_model":null,"last_traceparent":null}"#
            )
        );
        // The last traceparent seen is served as it came.
        p.saw_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let Reply::Json { body, .. } = p.handle("GET", "/admin/stats", b"") else {
            panic!("expected JSON");
        };
        assert!(
            body.ends_with(
                r#""last_traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#
            ),
            "{body}"
        );
        p.stream_ended();
        assert_eq!(p.stats().active_streams, 0);
    }

    #[test]
    fn stats_name_the_model_of_the_last_surface_request() {
        let mut p = provider(1);
        let last_model = |p: &mut MockProvider| {
            let Reply::Json { body, .. } = p.handle("GET", "/admin/stats", b"") else {
                panic!("expected JSON");
            };
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["last_model"].clone()
        };
        assert_eq!(last_model(&mut p), serde_json::Value::Null);
        p.handle(
            "POST",
            "/tokenize",
            br#"{"model":"target-a","prompt":"x y"}"#,
        );
        assert_eq!(last_model(&mut p), "target-a");
        p.handle(
            "POST",
            "/v2/rerank",
            br#"{"model":"target-b","query":"q","documents":["d"]}"#,
        );
        assert_eq!(last_model(&mut p), "target-b");
        // Chat is not one of these routes; a body without a model clears it.
        p.handle("POST", "/v1/chat/completions", PLAIN);
        assert_eq!(last_model(&mut p), "target-b");
        p.handle("POST", "/detokenize", br#"{"tokens":[1]}"#);
        assert_eq!(last_model(&mut p), serde_json::Value::Null);
    }

    fn chat_body(stream: bool, system: &str, user: &str) -> Vec<u8> {
        serde_json::json!({"model": "m", "stream": stream, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user}
        ]})
        .to_string()
        .into_bytes()
    }

    fn first_sleep(reply: Reply) -> Option<u64> {
        let mut plan = plan_of(reply);
        stream_events(&mut plan)
            .into_iter()
            .find_map(|step| match step {
                StreamStep::Sleep { duration_ms } => Some(duration_ms),
                _ => None,
            })
    }

    #[test]
    fn prefix_cache_delays_the_first_token_by_the_uncached_prefill() {
        let system = "w ".repeat(100);
        let mut p = MockProvider::new(MockConfig {
            ttft_ms: 7,
            inter_token_ms: 0,
            tokens: 2,
            models: vec!["m".into()],
        })
        .with_prefix_cache(1000, 250);
        // 102 uncached words × 250 µs = 25.5 ms, rounded up.
        let cold = p.handle(
            "POST",
            "/v1/chat/completions",
            &chat_body(true, &system, "a b"),
        );
        assert_eq!(first_sleep(cold), Some(7 + 26));
        // 100 system words + "a" are cached; "c d e" are not: 750 µs.
        let warm = p.handle(
            "POST",
            "/v1/chat/completions",
            &chat_body(true, &system, "a c d e"),
        );
        assert_eq!(first_sleep(warm), Some(7 + 1));
        // A non-streaming reply of the same prompt: all cached, so ttft and
        // one inter-token gap of 0.
        let Reply::Completion { delay_ms, .. } = p.handle(
            "POST",
            "/v1/chat/completions",
            &chat_body(false, &system, "a c d e"),
        ) else {
            panic!("expected a completion");
        };
        assert_eq!(delay_ms, 7);
        let stats = p.stats();
        assert_eq!(stats.prompt_tokens_seen, 102 + 104 + 104);
        assert_eq!(stats.cached_tokens_hit, 101 + 104);
        let cache = p.prefix_cache().expect("modelled");
        assert_eq!(cache.total_tokens(), 102 + 104);
    }

    #[test]
    fn prefix_cache_covers_the_other_protocols_and_skips_injected_failures() {
        let config = MockConfig {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens: 1,
            models: vec!["m".into()],
        };
        let mut p = MockProvider::new(config.clone()).with_prefix_cache(1000, 1000);
        p.handle(
            "POST",
            "/v1/chat/completions",
            &chat_body(true, "s1 s2 s3", "u1"),
        );
        let anthropic =
            br#"{"model":"m","system":"s1 s2 s3","messages":[{"role":"user","content":"u1 u2"}]}"#;
        p.handle("POST", "/v1/messages", anthropic);
        let responses = br#"{"model":"m","instructions":"s1 s2","input":"x"}"#;
        p.handle("POST", "/v1/responses", responses);
        let ollama = br#"{"model":"m","messages":[{"role":"user","content":"s1 s2 s3 u1 u2 u3"}]}"#;
        p.handle("POST", "/api/chat", ollama);
        let stats = p.stats();
        assert_eq!(stats.prompt_tokens_seen, 4 + 5 + 3 + 6);
        assert_eq!(stats.cached_tokens_hit, 4 + 2 + 5);

        let mut failing = MockProvider::with_faults(
            config,
            MockFaults {
                fail_status: Some(500),
                ..MockFaults::default()
            },
        )
        .with_prefix_cache(1000, 1000);
        failing.handle("POST", "/v1/chat/completions", &chat_body(true, "s1", "u1"));
        failing.handle("POST", "/v1/chat/completions", b"not json");
        assert_eq!(failing.stats().prompt_tokens_seen, 0);
        assert_eq!(failing.prefix_cache().map(|c| c.total_tokens()), Some(0));
    }

    #[test]
    fn without_a_prefix_cache_nothing_is_counted_or_delayed() {
        let mut p = MockProvider::new(MockConfig {
            ttft_ms: 3,
            inter_token_ms: 0,
            tokens: 1,
            models: vec!["m".into()],
        })
        .with_prefix_cache(0, 0);
        let system = "w ".repeat(50);
        for _ in 0..2 {
            let reply = p.handle(
                "POST",
                "/v1/chat/completions",
                &chat_body(true, &system, "a"),
            );
            assert_eq!(first_sleep(reply), Some(3));
        }
        assert!(p.prefix_cache().is_none());
        assert_eq!(p.stats().prompt_tokens_seen, 0);
        assert_eq!(p.stats().cached_tokens_hit, 0);
    }
}
