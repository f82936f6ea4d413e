//! `bench cache-routing`: the Edge's per-model routing policies measured
//! side by side on workloads whose speed depends on an engine's prefix (KV)
//! cache.
//!
//! ```text
//!                               ┌─ p0 ─► bench mock-provider --prefix-cache-tokens N
//! bench (client) ──► edge-bin ══╡   …     (TTFT = ttft + U µs per uncached prompt word)
//!   model = least_loaded        └─ pP-1 ► bench mock-provider …
//!         | session | prefix        (one node-bin, one adapter per mock,
//!         | pinned-i                 capacity 1 or 2 each)
//! ```
//!
//! For each pool size P (`--providers 2,4`) the harness starts P mock
//! providers, each modelling a prefix cache that holds only a few
//! conversations, one Node serving all of them as separate adapters and
//! one Edge with the models `least_loaded`, `session` and `prefix` over the
//! whole pool (`routing = "…"`) and `pinned-0..P-1` (one provider each:
//! affinity by hand, the yardstick). Then three workloads, each as rounds
//! in which every policy (an *arm*) runs one window, the order reversed
//! every other round so drift does not favour an arm:
//!
//! - **multi-turn**: C conversations at once, T turns each; a turn sends
//!   the whole history and appends the streamed reply. The session arm
//!   sends `prompt_cache_key` = the conversation's id; the pinned arm sends
//!   conversation i to `pinned-(i mod P)`.
//! - **shared system prompt**: independent requests at half the pool's
//!   capacity, each one of K long system prompts and a short unique
//!   question (session key: the system prompt's id; pinned: prompt k to
//!   `pinned-(k mod P)`).
//! - **no shared prefix**: unique prompts at a concurrency above the pool's
//!   capacity: what affinity costs when there is nothing to gain.
//!
//! Every text is unique per pool, workload, arm and round, so no window
//! finds the cache warmed by another. Per window the harness records each
//! request's TTFT (first content chunk), the wall time, and the change of
//! every mock's `prompt_tokens_seen` / `cached_tokens_hit`
//! (`GET /admin/stats`) and of the Edge's routing counters of the arm's
//! model(s) (`/status`: dispatches by load, by match, by session). The report ([`report::CacheRoutingReport`]) gives
//! per pool, workload and arm the TTFT p50/p99 (multi-turn: turns after the
//! first), the cache hit rate, requests/s, and the ratios the routing work
//! aims at: prefix and session multi-turn TTFT p50 ÷ pinned (goal ≤ 1.2),
//! no-shared-prefix throughput prefix ÷ least_loaded (goal ≥ 0.95).
//! docs/bench-cache-routing.md describes the method and the table.
//!
//! Children are stopped by PID when the harness ends, also on error, panic
//! or SIGINT/SIGTERM ([`crate::compare::procs::ChildProc`] guards).

pub mod cli;
mod client;
pub mod report;
mod run;
pub mod workload;

use std::path::PathBuf;

use serde::Serialize;

pub use run::run;

/// Every option of a run, defaults resolved (recorded in the JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheRoutingOptions {
    /// Quick mode (fewer rounds, turns and requests).
    pub quick: bool,
    /// The pool sizes: the whole measurement runs once per entry.
    pub providers: Vec<u32>,
    /// Capacity (concurrent requests) of every provider at the Edge.
    pub capacity: u32,
    /// Rounds per workload; each runs one window per arm (even, so every
    /// arm runs as often early as late in a round).
    pub rounds: u32,
    /// Conversations per provider: C = this × P.
    pub conversations_per_provider: u32,
    /// Turns per conversation.
    pub turns: u32,
    /// Words of a conversation's system prompt.
    pub system_words: u32,
    /// Words of each user message.
    pub user_words: u32,
    /// A conversation pauses 0 to this many ms (drawn per turn) before each
    /// turn after the first.
    pub think_ms_max: u64,
    /// Each mock's prefix cache holds this many conversations at their
    /// longest (in tokens: this × [`Self::conversation_tokens_max`]).
    pub cache_conversations: u32,
    /// The mock's reply length in tokens (words).
    pub reply_tokens: u32,
    /// The mock's time to first token before any prefill, ms.
    pub ttft_ms: u64,
    /// The mock's delay between reply tokens, ms.
    pub inter_token_ms: u64,
    /// The mock's prefill time per uncached prompt word, µs.
    pub prefill_us_per_token: u64,
    /// Shared-prompt workload: system prompts per provider (K = this × P).
    pub shared_prompts_per_provider: u32,
    /// Words of each shared system prompt.
    pub shared_prompt_words: u32,
    /// Words of each question after a shared system prompt.
    pub question_words: u32,
    /// Shared-prompt workload: requests per provider per window.
    pub shared_requests_per_provider: u32,
    /// No-shared-prefix workload: words of each unique prompt.
    pub unique_prompt_words: u32,
    /// No-shared-prefix workload: requests per provider per window.
    pub unique_requests_per_provider: u32,
    /// No-shared-prefix workload: concurrent requests per unit of pool
    /// capacity (above 1 keeps every provider busy).
    pub unique_concurrency_per_slot: u32,
    /// `--cores` of edge-bin.
    pub edge_cores: String,
    /// `--cores` of node-bin.
    pub node_cores: String,
    /// Where edge-bin and node-bin are.
    pub bin_dir: PathBuf,
    /// This binary (started as the mock providers).
    pub bench_exe: PathBuf,
    /// Where the JSON report goes, if anywhere.
    pub json: Option<PathBuf>,
    /// Keep the temporary directory (configs, certificates, logs).
    pub keep_temp: bool,
}

impl CacheRoutingOptions {
    /// Prompt words of a conversation's last turn: the system prompt, T
    /// user messages and T − 1 replies.
    pub fn conversation_tokens_max(&self) -> u64 {
        u64::from(self.system_words)
            + u64::from(self.turns) * u64::from(self.user_words)
            + u64::from(self.turns.saturating_sub(1)) * u64::from(self.reply_tokens)
    }

    /// Each mock's `--prefix-cache-tokens`.
    pub fn cache_tokens(&self) -> u64 {
        u64::from(self.cache_conversations) * self.conversation_tokens_max()
    }
}
