//! `bench fairness`: how the Edge shares one saturated model between two
//! keys, with the queue discipline off (FIFO), by weighted fair queueing,
//! and by priority class, side by side in one run.
//!
//! ```text
//!   key A (flood, open loop) ─┐                       ┌─ provider fifo     (capacity C) ─┐
//!   key B (low rate)         ─┴─► edge-bin ══ node-bin ┼─ provider wfq      (capacity C) ─┼─► bench mock-provider
//!                                 │ access log (JSON)  └─ provider priority (capacity C) ─┘
//!                                 ▼
//!                 who was admitted when, and how long B waited
//! ```
//!
//! One mock, one Node, one Edge serving three models (`fifo`, `wfq`,
//! `priority`), each over a provider of its own with capacity C (4), so
//! each model has a queue of its own. Six client keys, two per model
//! (an *arm*):
//!
//! - **fifo**: A's and B's keys name the same principal. One principal's
//!   requests run in arrival order, so this arm is the FIFO baseline (the
//!   queue as it was before fair queueing).
//! - **wfq**: two principals, weight 1 each, the same class (`standard`).
//! - **priority**: A's key `priority = "batch"`, B's `"interactive"`.
//!
//! Each arm runs two phases, one after the other:
//!
//! - **latency**: A floods open loop at F × the model's capacity (10×),
//!   B sends at a low rate (0.1× capacity). Reported: B's queue wait
//!   p50/p99.
//! - **share**: A floods as before, B sends at 1.5× capacity, so both
//!   keys stay backlogged (neither is served as fast as it sends, under
//!   any arm: B interactive gets 9 admissions in 10). Reported: each key's share of the admissions per time window,
//!   over the windows during which both were backlogged.
//!
//! The capacity in requests/s is C ÷ the mock's service time (its TTFT
//! plus `(tokens − 1) × inter-token`). At a phase's end requests still queued
//! are cut off by the client (A's flood is never meant to drain).
//!
//! Every measure comes from the Edge's own access log (JSON lines, in a
//! file): each request carries `x-request-id: fair-<arm>-<phase>-<key>-<n>`,
//! and its line gives the time it was read (`ts` − `duration_ms`), the
//! time its first body byte left (+ `ttft_ms`) and its outcome. A
//! request's queue wait is the Edge's TTFT minus the mock's fixed TTFT
//! (so it holds the relay's hops too, well under a millisecond on
//! loopback); its admission is its first byte minus the mock's TTFT. A
//! request cut off while queued waited at least until the cut-off: that
//! bound enters B's percentiles and marks them `≥` when it may move them
//! ([`report`]). The client's own TTFT of B is reported beside, as a cross-check.
//!
//! docs/bench-fairness.md describes the method and a table from a run.

pub mod cli;
pub mod report;
mod run;

use std::path::PathBuf;

use serde::Serialize;

pub use run::run;

/// Every option of a run, defaults resolved (recorded in the JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FairnessOptions {
    /// Quick mode (shorter phases).
    pub quick: bool,
    /// Capacity (concurrent requests) of each arm's provider.
    pub capacity: u32,
    /// The mock's time to first token, ms.
    pub ttft_ms: u64,
    /// The mock's reply length in tokens.
    pub tokens: u32,
    /// The mock's delay between tokens, ms.
    pub inter_token_ms: u64,
    /// A's rate as a multiple of the capacity in requests/s.
    pub flood_factor: f64,
    /// B's rate in the latency phase, as a multiple of the capacity.
    pub latency_b_factor: f64,
    /// B's rate in the share phase, as a multiple of the capacity.
    pub share_b_factor: f64,
    /// Length of the latency phase (sending), ms.
    pub latency_ms: u64,
    /// Length of the share phase (sending), ms.
    pub share_ms: u64,
    /// Length of a share window, ms.
    pub window_ms: u64,
    /// `--cores` of edge-bin.
    pub edge_cores: String,
    /// `--cores` of node-bin.
    pub node_cores: String,
    /// Where edge-bin and node-bin are.
    pub bin_dir: PathBuf,
    /// This binary (started as the mock provider).
    pub bench_exe: PathBuf,
    /// Where the JSON report goes, if anywhere.
    pub json: Option<PathBuf>,
    /// Keep the temporary directory (configs, certificates, logs).
    pub keep_temp: bool,
}

impl FairnessOptions {
    /// The mock's time to serve one request, ms: its TTFT, then a gap
    /// before each further token.
    pub fn service_ms(&self) -> u64 {
        self.ttft_ms + u64::from(self.tokens.saturating_sub(1)) * self.inter_token_ms
    }

    /// What one arm's provider serves per second at full capacity.
    pub fn capacity_per_s(&self) -> f64 {
        f64::from(self.capacity) * 1000.0 / self.service_ms().max(1) as f64
    }
}
