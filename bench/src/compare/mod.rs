//! `bench compare`: relay-vs-direct latency, concurrency and cost, measured
//! side by side on one machine.
//!
//! ```text
//!                 ┌──────────────── A: direct ────────────────┐
//! bench (load) ───┤                                           ├──► bench mock-provider
//!                 └─► edge-bin ══mTLS══► node-bin ── B ───────┘
//!                 └─► --peer URL (e.g. nginx) ────── C ───────┘
//! ```
//!
//! The harness starts the mock provider (this very binary), mints
//! certificates with `edge-bin certs`, writes the Edge and Node
//! configuration into a temporary directory, starts `edge-bin` and
//! `node-bin`, waits until `/status` shows the provider connected, and then,
//! at each concurrency level (`--concurrency`, default 1 and 200 streams),
//! runs rounds of windows — A, B (and C) at the same offered load, the
//! order alternating between rounds so drift does not favour one arm. It
//! reports per level the medians over rounds of the per-round differences
//! (B − A, C − A) and ratios (B / A), the Edge + Node CPU time per relayed
//! token (`/proc/<pid>/stat`), their memory per active stream (`VmRSS`),
//! the same two figures for the peer's processes (`--peer-pid`), and the
//! goals: IOP ÷ peer against the relay's targets
//! ([`report::check_goals`]); then a concurrency ladder for both paths.
//! docs/bench-compare.md describes the table and the JSON.
//!
//! Every child is stopped by PID when the harness ends, also on error or
//! panic ([`procs::ChildProc`] guards), and on SIGINT/SIGTERM (the harness
//! stops at the next check and unwinds through the guards).

pub mod cli;
pub mod config;
pub mod ladder;
pub mod procs;
pub mod report;
pub(crate) mod run;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use serde::Serialize;

pub use run::run;

/// Why a comparison could not finish.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// The options are inconsistent.
    #[error("{0}")]
    Options(String),
    /// A binary the harness starts is not there.
    #[error("{path} not found: {hint}")]
    MissingBinary {
        /// Where it was looked for.
        path: String,
        /// What to do about it.
        hint: String,
    },
    /// A child could not be started.
    #[error("cannot start {name} ({program}): {source}")]
    Spawn {
        /// Which child.
        name: String,
        /// The program path.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A child did not announce readiness.
    #[error("{name} did not become ready: {reason}\n--- {name} log (tail) ---\n{log_tail}")]
    NotReady {
        /// Which child.
        name: String,
        /// What happened.
        reason: String,
        /// The end of its log.
        log_tail: String,
    },
    /// A child exited while it was needed.
    #[error("{name} exited ({status})\n--- {name} log (tail) ---\n{log_tail}")]
    Exited {
        /// Which child.
        name: String,
        /// Its exit status.
        status: String,
        /// The end of its log.
        log_tail: String,
    },
    /// A file or process operation failed.
    #[error("cannot {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A load run failed to run (not: a request failed).
    #[error(transparent)]
    Load(#[from] crate::load::LoadError),
    /// A `/proc` figure or system call failed.
    #[error(transparent)]
    Proc(#[from] crate::procstat::ProcError),
    /// The Node never showed up as connected in `/status`.
    #[error("the node did not connect within {waited_ms} ms (last /status: {last_status})")]
    NodeNotConnected {
        /// How long the harness waited.
        waited_ms: u64,
        /// The last `/status` answer or error.
        last_status: String,
    },
    /// An arm could not complete a single request in warm-up, so its
    /// figures would mean nothing.
    #[error("the {arm} path completed no request during warm-up: {first_error}")]
    ArmBroken {
        /// `direct`, `relayed` or `peer`.
        arm: String,
        /// The first failure seen.
        first_error: String,
    },
    /// A swarm phase did not complete (nodes not ready in time, the swarm
    /// thread gone, a measurement that could not be taken).
    #[error("{0}")]
    Swarm(String),
    /// SIGINT or SIGTERM arrived.
    #[error("interrupted")]
    Interrupted,
}

/// Every option of a comparison, defaults resolved (recorded in the JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareOptions {
    /// Quick mode (smaller defaults throughout).
    pub quick: bool,
    /// Rounds; each runs one window per arm.
    pub windows: u32,
    /// Length of each window.
    pub window_ms: u64,
    /// Unmeasured warm-up per arm before the first round.
    pub warmup_ms: u64,
    /// The concurrency levels: each runs its own rounds of windows at
    /// that many concurrent streams (increasing).
    pub concurrency: Vec<u64>,
    /// Tokens per request.
    pub tokens: u32,
    /// Mock inter-token delay.
    pub inter_token_ms: u64,
    /// Mock time to first token.
    pub ttft_ms: u64,
    /// `--cores` of edge-bin.
    pub edge_cores: String,
    /// `--cores` of node-bin.
    pub node_cores: String,
    /// Load threads' cores (`None`: one unpinned thread).
    pub load_cores: Option<String>,
    /// Third arm's base URL.
    pub peer: Option<String>,
    /// The peer's processes, sampled for CPU and memory in its windows.
    pub peer_pids: Vec<u32>,
    /// The peer's name in the table and the goals.
    pub peer_name: String,
    /// Where edge-bin and node-bin are.
    pub bin_dir: PathBuf,
    /// This binary (started as the mock provider).
    pub bench_exe: PathBuf,
    /// Where the JSON report goes.
    pub out_dir: PathBuf,
    /// Use this mock instead of starting one.
    pub attach_mock: Option<String>,
    /// Use this Edge instead of starting Edge and Node.
    pub attach_edge: Option<String>,
    /// Port of the mock the harness starts (0: any).
    pub mock_port: u16,
    /// The model the mock serves (direct and peer requests name it).
    pub mock_model: String,
    /// The model relayed requests name.
    pub edge_model: String,
    /// Ladder levels (empty: no ladder).
    pub ladder_levels: Vec<u64>,
    /// Tokens per ladder stream.
    pub ladder_tokens: u32,
    /// Ladder stream starts are spread over this long.
    pub ladder_ramp_ms: u64,
    /// Keep the temporary directory (configs, certificates, logs).
    pub keep_temp: bool,
}

/// Makes SIGINT and SIGTERM set `stop` (a second one terminates at once).
/// Installation failures are ignored: the defaults then still end the
/// process, only without the orderly child shutdown.
/// Writes `report` as pretty JSON to `<dir>/<kind>-<unix_sec>.json` (the
/// directory created if needed) and returns the path; the error names the
/// path.
pub fn write_json_report<T: Serialize>(
    dir: &Path,
    kind: &str,
    unix_sec: i64,
    report: &T,
) -> Result<PathBuf, String> {
    let path = dir.join(format!("{kind}-{unix_sec}.json"));
    std::fs::create_dir_all(dir)
        .and_then(|()| {
            let text = serde_json::to_string_pretty(report).map_err(std::io::Error::other)?;
            std::fs::write(&path, text + "\n")
        })
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// A report a `bench` command writes as JSON.
pub trait Report: Serialize {
    /// When the report was made (Unix ms): names its JSON file.
    fn created_unix_ms(&self) -> i64;
}

/// The shared shell of `bench compare`, `bench cores` and `bench
/// isolation`: finds this executable, resolves the options with it, runs
/// with SIGINT/SIGTERM stopping the run, prints the table and writes
/// `<out_dir>/<kind>-<unix s>.json`. Every failure is printed as
/// `bench <kind>: …`; `None` then (exit 1).
pub fn run_command<O, R, E: std::fmt::Display>(
    kind: &str,
    resolve: impl FnOnce(&Path) -> Result<O, String>,
    out_dir: impl Fn(&O) -> &Path,
    run: impl FnOnce(&O, &Arc<AtomicBool>) -> Result<R, E>,
    render: impl Fn(&R) -> String,
) -> Option<R>
where
    R: Report,
{
    let exe = std::env::current_exe()
        .map_err(|e| eprintln!("bench {kind}: cannot find this executable: {e}"))
        .ok()?;
    let options = resolve(&exe)
        .map_err(|e| eprintln!("bench {kind}: {e}"))
        .ok()?;
    let stop = Arc::new(AtomicBool::new(false));
    install_stop_handlers(&stop);
    let report = run(&options, &stop)
        .map_err(|e| eprintln!("bench {kind}: {e}"))
        .ok()?;
    print!("{}", render(&report));
    let unix_sec = report.created_unix_ms() / 1000;
    let path = write_json_report(out_dir(&options), kind, unix_sec, &report)
        .map_err(|e| eprintln!("bench {kind}: {e}"))
        .ok()?;
    println!("JSON report: {}", path.display());
    Some(report)
}

/// The shell of a measuring subcommand (`bench cache-routing`, `bench
/// fairness`): resolves its options against the CPUs this process may use
/// and its own executable, runs it with SIGINT/SIGTERM stopping it, prints
/// its table and writes its JSON report where `json` says. The report, or
/// the exit code of a run that could not complete (its reason printed).
pub fn run_subcommand<O, R: serde::Serialize>(
    name: &str,
    resolve: impl FnOnce(&std::collections::BTreeSet<usize>, &std::path::Path) -> Result<O, String>,
    run: impl FnOnce(&O, &Arc<AtomicBool>) -> Result<R, String>,
    render: impl FnOnce(&R) -> String,
    json: impl FnOnce(&O) -> Option<std::path::PathBuf>,
) -> Result<R, std::process::ExitCode> {
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("bench {name}: {e}");
        std::process::ExitCode::from(1)
    };
    let exe =
        std::env::current_exe().map_err(|e| fail(&format!("cannot find this executable: {e}")))?;
    let allowed =
        iop_engine::rt::allowed_cpus().unwrap_or_else(|_| std::collections::BTreeSet::from([0]));
    let options = resolve(&allowed, &exe).map_err(|e| fail(&e))?;
    let stop = Arc::new(AtomicBool::new(false));
    install_stop_handlers(&stop);
    let report = run(&options, &stop).map_err(|e| fail(&e))?;
    print!("{}", render(&report));
    if let Some(path) = json(&options) {
        let written = serde_json::to_string_pretty(&report)
            .map_err(std::io::Error::other)
            .and_then(|text| std::fs::write(&path, text + "\n"));
        if let Err(e) = written {
            return Err(fail(&format!("cannot write {}: {e}", path.display())));
        }
        println!("JSON report: {}", path.display());
    }
    Ok(report)
}

/// [`run_subcommand`] for a command whose complete run is a success
/// (`bench fairness`, `bench instructions`): exit 0 after it, 1 when it
/// could not run.
pub fn run_subcommand_exit<O, R: serde::Serialize>(
    name: &str,
    resolve: impl FnOnce(&std::collections::BTreeSet<usize>, &std::path::Path) -> Result<O, String>,
    run: impl FnOnce(&O, &Arc<AtomicBool>) -> Result<R, String>,
    render: impl FnOnce(&R) -> String,
    json: impl FnOnce(&O) -> Option<std::path::PathBuf>,
) -> std::process::ExitCode {
    run_subcommand(name, resolve, run, render, json)
        .map_or_else(|code| code, |_| std::process::ExitCode::SUCCESS)
}

pub fn install_stop_handlers(stop: &Arc<AtomicBool>) {
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(stop));
        let _ = signal_hook::flag::register(signal, Arc::clone(stop));
    }
}
