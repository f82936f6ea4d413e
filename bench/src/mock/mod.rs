//! `bench mock-provider`: a mock inference server with deterministic
//! content, speaking every protocol IOP relays.
//!
//! [`openai`] is the pure core (routing, request parsing, every response
//! byte of the OpenAI chat completions mode, the stream plan); [`server`] is
//! the monoio shell that accepts connections, reads requests with
//! `iop_engine::http` and writes what the core decides, pacing streamed
//! tokens with timers. The other protocols are pure modules the router
//! calls, each answering with a [`script::Script`]:
//!
//! | route | module |
//! |---|---|
//! | `POST /v1/chat/completions`, `GET /v1/models` | [`openai`] (+ [`tools`] modes) |
//! | `POST /api/chat`, `GET /api/tags`, `GET /api/version` | [`ollama`] |
//! | `POST /v1/messages`, `POST /v1/messages/count_tokens` | [`anthropic`] |
//! | `POST /v1/responses` | [`responses`] |
//! | `POST /v1/completions` | [`completions`] |
//! | `POST /v1/embeddings`, `POST /api/embed` | [`embeddings`] |
//! | `POST /v1/rerank`, `POST /v2/rerank`, `POST /v1/score` | [`rerank`] |
//! | `POST /tokenize`, `POST /detokenize` | [`tokenize`] |
//! | `GET /v1/models/{id}` | [`openai`] |
//! | `POST /v1/audio/transcriptions`, `/translations`, `/speech` | [`audio`] (+ [`multipart`]) |
//! | `GET /health`, `POST /admin/health`, `GET /admin/stats` | [`openai`] |
//!
//! [`auth`] (`--require-api-key`) refuses provider requests without the
//! configured key before any route runs. [`prefix_cache`]
//! (`--prefix-cache-tokens`, `--prefill-us-per-token`) models an inference
//! server's KV cache of recent prompts: the first token waits for the
//! prefill of the uncached part of the prompt.
//!
//! Every generation route produces the same text for the same token count
//! (`tok0 tok1 …`), so a relayed answer can be compared byte for byte with
//! what the mock sent, whatever protocol carried it.

pub mod anthropic;
pub mod audio;
pub mod auth;
pub mod completions;
pub mod digest;
pub mod embeddings;
pub mod multipart;
pub mod ollama;
pub mod openai;
pub mod prefix_cache;
pub mod rerank;
pub mod responses;
pub mod script;
pub mod server;
pub mod tokenize;
pub mod tools;

pub use openai::{HealthState, MockConfig, MockFaults, MockProvider, MockStats};
pub use server::{
    ready_line, run, run_provider, run_with, serve, serve_provider, serve_shared, serve_with,
    ServeError,
};
pub use tools::MockModes;
