//! `bench cores`: bulk relay throughput per core layout, measured side by
//! side with a direct baseline.
//!
//! ```text
//!                 ┌──────────────────── direct ─────────────────────┐
//! bench (load) ───┤                                                 ├──► bench mock-provider
//!                 ├─► edge-bin --cores 0   ══► node-bin --cores 0   ┤    --token-bytes B
//!                 └─► edge-bin --cores 0-1 ══► node-bin --cores 0-1 ┘    --inter-token-ms 0
//! ```
//!
//! One mock provider streams body-heavy completions (each content token
//! padded to `--token-bytes`, no pacing) and is shared by every arm. For
//! each layout in `--layout` (default `0` and `0-1`) the harness starts an
//! Edge and a Node, both with that `--cores`, all before the first window.
//! Then it runs rounds: in each, one closed-loop window per arm (the direct
//! baseline and every layout), the order reversed every other round so
//! drift does not favour an arm. Per window it counts the body bytes the
//! client actually received and the streams that completed (status 200,
//! ended with `[DONE]`, no error event), and the CPU time of each child.
//!
//! The report ([`report::CoresReport`]) gives, per arm, the median over
//! rounds of body bytes/s and requests/s, each layout's ratio to the first
//! layout and to direct (medians of the per-round ratios, so a slow round
//! moves both sides), and every error. A run with any incomplete stream
//! still prints and writes its report, then exits 1.

pub mod cli;
pub mod report;
mod run;

use std::path::PathBuf;

use serde::Serialize;

pub use run::run;

/// Every option of a throughput run, defaults resolved (recorded in the
/// JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CoresOptions {
    /// Quick mode (shorter windows, fewer rounds).
    pub quick: bool,
    /// The `--cores` values; edge-bin and node-bin of a layout get the same.
    pub layouts: Vec<String>,
    /// Rounds; each runs one window per arm.
    pub rounds: u32,
    /// Length of each window.
    pub window_ms: u64,
    /// Unmeasured warm-up per arm before the first round.
    pub warmup_ms: u64,
    /// Concurrent closed-loop streams in every window.
    pub concurrency: u64,
    /// Content tokens per stream.
    pub tokens: u32,
    /// Bytes of each content token (the mock's `--token-bytes`).
    pub token_bytes: u32,
    /// Load threads' cores (`None`: one unpinned thread).
    pub load_cores: Option<String>,
    /// Where edge-bin and node-bin are.
    pub bin_dir: PathBuf,
    /// This binary (started as the mock provider).
    pub bench_exe: PathBuf,
    /// Where the JSON report goes.
    pub out_dir: PathBuf,
    /// The model the mock serves (direct requests name it).
    pub mock_model: String,
    /// The model relayed requests name.
    pub edge_model: String,
    /// Keep the temporary directory (configs, certificates, logs).
    pub keep_temp: bool,
}
