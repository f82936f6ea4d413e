//! `bench isolation`: what clients that never read cost everyone else on the
//! same node connection.
//!
//! ```text
//!                 ┌──────────── direct ────────────┐
//! bench (load) ───┤                                ├──► mock "normal" (paced tokens)
//!   N streams     └─► edge-bin ══ one node conn ══► node-bin ─┤
//! K never-readers ──► edge-bin ═══════════════════════════════┴──► mock "bulk" (16 MiB answers)
//!  (4 KiB receive buffer, never read)
//! ```
//!
//! One Edge and one Node serve two models from two mock providers through
//! the one node connection: `normal` (paced token streams, the clients
//! measured) and `bulk` (large unpaced answers, asked for by K clients that
//! never read: sockets with a 4 KiB receive buffer). In each round the
//! harness measures N normal closed-loop streams directly and through the
//! relay without never-readers (window A), then opens the K never-readers,
//! waits until their runs are stuck, and measures again (window B, relayed
//! and direct). Then it waits for the Edge to cut each never-reader off
//! (`client_write_stall_timeout_ms`).
//!
//! Reported ([`report::IsolationReport`]):
//!
//! - the normal clients' *added* per-chunk latency p99 (relayed minus
//!   direct, same window) with ÷ without never-readers, median over rounds
//!   (goal ≤ 1.2);
//! - Edge + Node RSS growth with the K stuck runs, against K × the window,
//!   and what of it was not given back [`RETURN_WAIT`] after the cut-offs;
//! - how long after it connected each never-reader was cut off;
//! - the bulk mock's bytes written per stuck run (back-pressure: about a
//!   window plus the sockets' buffers, not the whole answer).

pub mod cli;
pub mod report;
mod run;
mod stuck;

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

pub use run::run;

/// How long after the cut-offs the memory not given back is measured: past
/// the Edge's heap trim, which runs every 5 s once connections closed.
pub const RETURN_WAIT: Duration = Duration::from_secs(6);

/// Every option of an isolation run, defaults resolved (recorded in the
/// JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IsolationOptions {
    /// Quick mode (shorter windows, fewer rounds).
    pub quick: bool,
    /// Rounds; each runs windows A and B.
    pub rounds: u32,
    /// Length of each window.
    pub window_ms: u64,
    /// Normal closed-loop streams in every window.
    pub normal_streams: u64,
    /// Content tokens per normal stream.
    pub normal_tokens: u32,
    /// Milliseconds between the normal mock's tokens.
    pub inter_token_ms: u64,
    /// Clients that never read, per round.
    pub never_readers: u32,
    /// Bytes of a bulk answer (what a never-reader asks for).
    pub bulk_bytes: u64,
    /// The Edge's `flow_window_bytes`.
    pub flow_window_bytes: u64,
    /// The Edge's `client_write_stall_timeout_ms`.
    pub client_write_stall_timeout_ms: u64,
    /// The `--cores` of edge-bin and of node-bin.
    pub cores: (String, String),
    /// Where edge-bin and node-bin are.
    pub bin_dir: PathBuf,
    /// This binary (started as the mock providers).
    pub bench_exe: PathBuf,
    /// Where the JSON report goes.
    pub out_dir: PathBuf,
    /// Keep the temporary directory (configs, certificates, logs).
    pub keep_temp: bool,
}
