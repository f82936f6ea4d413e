//! `bench instructions`: user-space instructions per relayed token, counted
//! by callgrind, which noise does not move.
//!
//! The Edge and the Node run under `valgrind --tool=callgrind` (through
//! two small wrapper scripts given to [`spawn_relay`] as the binary
//! directory). One round of `streams` concurrent streams warms them up;
//! their counters are then zeroed (`callgrind_control --zero`), `rounds`
//! rounds of `streams` one-shot streams of `tokens` tokens run, and the
//! counters are dumped (`callgrind_control --dump`). Instructions ÷ tokens
//! the client received is the figure. Then the counters are zeroed again
//! and one round of `streams` one-token requests runs: instructions ÷
//! requests is what a request costs once (its head and body, admission,
//! the dispatch, the provider's response head, the access line), which
//! the per-token figure spreads over `tokens`. A peer proxy already running
//! under callgrind (`scripts/bench.sh` starts nginx so) is counted the same
//! way over the same load, against the same mock.
//!
//! Callgrind slows a process some fifty times, so the default pacing (a
//! token every 100 ms per stream) keeps the Edge and the Node below
//! saturation: a saturated process batches more per wake-up and would look
//! cheaper than it is. The report keeps each arm's per-chunk p99 so a
//! reader can see the pacing held.

pub mod cli;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use serde::Serialize;

use crate::compare::config::{edge_toml, ClusterNames};
use crate::compare::procs::{ChildProc, TempDir};
use crate::compare::run::{check_binary, commit, spawn_relay, write_file, RelaySpec};
use crate::load::{self, format_us, Live, LoadSpec, Mode, Target};

/// The issue's goal: user-space instructions per relayed token, Edge and
/// Node together.
pub const GOAL_RELAY_PER_TOKEN: u64 = 6_000;

/// What one run measures.
#[derive(Debug, Clone)]
pub struct InstructionsOptions {
    /// Concurrent streams of a round.
    pub streams: u64,
    /// Tokens per stream.
    pub tokens: u32,
    /// The mock's delay between tokens.
    pub inter_token_ms: u64,
    /// Measured rounds.
    pub rounds: u32,
    /// `--cores` of edge-bin and node-bin.
    pub edge_cores: String,
    pub node_cores: String,
    /// Where edge-bin and node-bin are.
    pub bin_dir: PathBuf,
    /// This executable (it serves the mock).
    pub bench_exe: PathBuf,
    /// The mock's port (0: any); a peer proxy points at it.
    pub mock_port: u16,
    /// A peer proxy in front of the mock, with its processes (each under
    /// callgrind) and its name.
    pub peer: Option<String>,
    pub peer_pids: Vec<u32>,
    pub peer_name: String,
    /// `valgrind` and `callgrind_control`.
    pub valgrind: PathBuf,
    pub callgrind_control: PathBuf,
    /// Where the JSON report goes.
    pub json: Option<PathBuf>,
    /// Keep the temporary directory.
    pub keep_temp: bool,
}

/// One process's count over the measured rounds.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessCount {
    pub name: String,
    pub pid: u32,
    pub instructions: u64,
    pub per_token: f64,
    /// Over the round of one-token requests, per request.
    pub per_request: f64,
}

/// One arm (the relay, or the peer).
#[derive(Debug, Clone, Serialize)]
pub struct ArmCount {
    pub arm: String,
    pub tokens: u64,
    pub processes: Vec<ProcessCount>,
    /// All its processes together, per token.
    pub per_token: f64,
    /// One-token requests of the request round.
    pub requests: u64,
    /// All its processes together, per one-token request.
    pub per_request: f64,
    /// Per-chunk latency p99 under callgrind (µs): shows the pacing held.
    pub chunk_p99_us: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct InstructionsReport {
    pub schema: &'static str,
    pub created_unix_ms: i64,
    pub commit: Option<String>,
    pub streams: u64,
    pub tokens: u32,
    pub inter_token_ms: u64,
    pub rounds: u32,
    pub arms: Vec<ArmCount>,
    pub goal_relay_per_token: u64,
    pub goal_met: bool,
}

pub const SCHEMA: &str = "iop-bench-instructions/2";

/// Why a run could not complete.
#[derive(Debug)]
pub struct InstructionsError(pub String);

impl std::fmt::Display for InstructionsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<std::io::Error> for InstructionsError {
    fn from(e: std::io::Error) -> Self {
        InstructionsError(e.to_string())
    }
}

impl From<crate::load::LoadError> for InstructionsError {
    fn from(e: crate::load::LoadError) -> Self {
        InstructionsError(e.to_string())
    }
}

/// `'text'` for a POSIX shell.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Writes `dir/<name>`, a script that runs `real` under callgrind (its
/// counts to `out_prefix.<pid>`), except for `certs`, which runs as is.
fn write_wrapper(
    dir: &Path,
    name: &str,
    real: &Path,
    valgrind: &Path,
    out_prefix: &Path,
) -> Result<(), InstructionsError> {
    use std::os::unix::fs::PermissionsExt;
    let real = shell_quote(&real.display().to_string());
    let script = format!(
        "#!/bin/sh\n\
         if [ \"$1\" = certs ]; then exec {real} \"$@\"; fi\n\
         exec {} --tool=callgrind --callgrind-out-file={}.%p --dump-instr=no \
         --compress-strings=no --compress-pos=no {real} \"$@\"\n",
        shell_quote(&valgrind.display().to_string()),
        shell_quote(&out_prefix.display().to_string()),
    );
    let path = dir.join(name);
    write_file(&path, &script).map_err(|e| InstructionsError(e.to_string()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| InstructionsError(format!("chmod {}: {e}", path.display())))
}

/// Runs `callgrind_control <flag> <pid>`.
fn control(opts: &InstructionsOptions, flag: &str, pid: u32) -> Result<(), InstructionsError> {
    let out = Command::new(&opts.callgrind_control)
        .args([flag, &pid.to_string()])
        .output()
        .map_err(|e| {
            InstructionsError(format!(
                "cannot run {}: {e}",
                opts.callgrind_control.display()
            ))
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && text.contains("OK") {
        Ok(())
    } else {
        Err(InstructionsError(format!(
            "callgrind_control {flag} {pid} failed (is PID {pid} running under callgrind?): {}{}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The `Ir` total of a callgrind dump (its `summary:` or `totals:` line).
pub fn parse_total(dump: &str) -> Option<u64> {
    dump.lines()
        .find_map(|line| {
            line.strip_prefix("summary:")
                .or_else(|| line.strip_prefix("totals:"))
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// The newest dump of `pid` (callgrind names them `<out file>.<n>`), where
/// the process's out file is the one its command line gave, found through
/// `/proc/<pid>/cmdline`.
fn newest_dump(pid: u32) -> Result<String, InstructionsError> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| InstructionsError(format!("PID {pid}: {e}")))?;
    let out_file = cmdline
        .split(|&b| b == 0)
        .find_map(|arg| arg.strip_prefix(b"--callgrind-out-file="))
        .map(|f| String::from_utf8_lossy(f).replace("%p", &pid.to_string()))
        .unwrap_or_else(|| format!("callgrind.out.{pid}"));
    let out_file = PathBuf::from(out_file);
    let dir = match out_file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from(format!("/proc/{pid}/cwd")),
    };
    let stem = format!(
        "{}.",
        out_file.file_name().unwrap_or_default().to_string_lossy()
    );
    let newest = std::fs::read_dir(&dir)
        .map_err(|e| InstructionsError(format!("{}: {e}", dir.display())))?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().to_string_lossy().into_owned();
            let n: u64 = name.strip_prefix(&stem)?.parse().ok()?;
            Some((n, dir.join(name)))
        })
        .max_by_key(|(n, _)| *n)
        .ok_or_else(|| {
            InstructionsError(format!("no callgrind dump {stem}<n> in {}", dir.display()))
        })?;
    std::fs::read_to_string(&newest.1)
        .map_err(|e| InstructionsError(format!("{}: {e}", newest.1.display())))
}

/// One arm: warm up, zero the counters, run the rounds, dump and read them.
fn count_arm(
    opts: &InstructionsOptions,
    arm: &str,
    target: &Target,
    model: &str,
    processes: &[(String, u32)],
    stop: &Arc<AtomicBool>,
) -> Result<ArmCount, InstructionsError> {
    let stream_ms = u64::from(opts.tokens) * opts.inter_token_ms;
    let spec = LoadSpec {
        target: target.clone(),
        model: model.to_string(),
        mode: Mode::OneShot {
            streams: opts.streams,
        },
        duration_ms: stream_ms,
        tokens: opts.tokens,
        stream: true,
        ramp_ms: stream_ms.min(2_000),
        drain_ms: 60_000 + 4 * stream_ms,
        gap_limit_ns: None,
        cores: Vec::new(),
        max_in_flight: opts.streams,
        progress: false,
        stop: Arc::clone(stop),
        api_key: None,
        request_id_prefix: None,
    };
    // The request round: the same streams, one token each.
    let one_token = LoadSpec {
        tokens: 1,
        duration_ms: opts.inter_token_ms,
        drain_ms: 60_000 + 4 * opts.inter_token_ms,
        ..spec.clone()
    };
    let run_round = |spec: &LoadSpec, what: &str| -> Result<load::LoadSummary, InstructionsError> {
        let summary = load::run(spec, &Live::new())?;
        let want = opts.streams * u64::from(spec.tokens);
        if summary.requests_ok != opts.streams || summary.content_chunks != want {
            return Err(InstructionsError(format!(
                "{arm} {what}: {} of {} streams ok, {} of {want} tokens ({} errors; first: {})",
                summary.requests_ok,
                opts.streams,
                summary.content_chunks,
                summary.errors_total,
                summary.first_error.as_deref().unwrap_or("none")
            )));
        }
        Ok(summary)
    };
    let round = |what: &str| run_round(&spec, what);
    eprintln!("bench instructions: {arm}: warm-up round");
    round("warm-up")?;
    for (_, pid) in processes {
        control(opts, "--zero", *pid)?;
    }
    let mut tokens = 0;
    let mut chunk_p99_us: f64 = 0.0;
    for r in 0..opts.rounds {
        let summary = round(&format!("round {}", r + 1))?;
        eprintln!(
            "bench instructions: {arm}: round {} of {}: chunk p99 {}",
            r + 1,
            opts.rounds,
            format_us(summary.chunk_latency.p99_us)
        );
        tokens += summary.content_chunks;
        chunk_p99_us = chunk_p99_us.max(summary.chunk_latency.p99_us);
    }
    let mut per_token = Vec::new();
    for (name, pid) in processes {
        per_token.push(dump_total(opts, name, *pid)?);
    }
    for (_, pid) in processes {
        control(opts, "--zero", *pid)?;
    }
    let requests = run_round(&one_token, "request round")?.requests_ok;
    eprintln!("bench instructions: {arm}: a round of {requests} one-token requests");
    let mut counts = Vec::new();
    for ((name, pid), instructions) in processes.iter().zip(per_token) {
        let in_requests = dump_total(opts, name, *pid)?;
        counts.push(ProcessCount {
            name: name.clone(),
            pid: *pid,
            instructions,
            per_token: instructions as f64 / tokens as f64,
            per_request: in_requests as f64 / requests as f64,
        });
    }
    Ok(arm_count(arm, tokens, requests, counts, chunk_p99_us))
}

/// Dumps `pid`'s counters and reads their total.
fn dump_total(opts: &InstructionsOptions, name: &str, pid: u32) -> Result<u64, InstructionsError> {
    control(opts, "--dump", pid)?;
    let dump = newest_dump(pid)?;
    parse_total(&dump).ok_or_else(|| {
        InstructionsError(format!(
            "{name} (PID {pid}): no total in its callgrind dump"
        ))
    })
}

/// An arm's figures from its processes' counts.
fn arm_count(
    arm: &str,
    tokens: u64,
    requests: u64,
    processes: Vec<ProcessCount>,
    chunk_p99_us: f64,
) -> ArmCount {
    let total: u64 = processes.iter().map(|c| c.instructions).sum();
    let per_request = processes.iter().map(|c| c.per_request).sum();
    ArmCount {
        arm: arm.to_string(),
        tokens,
        processes,
        per_token: total as f64 / tokens as f64,
        requests,
        per_request,
        chunk_p99_us,
    }
}

/// Runs the relay arm (and the peer's, when given) and assembles the report.
pub fn run(
    opts: &InstructionsOptions,
    stop: &Arc<AtomicBool>,
) -> Result<InstructionsReport, InstructionsError> {
    crate::procstat::raise_nofile_limit().map_err(|e| InstructionsError(e.to_string()))?;
    let tmp = TempDir::create(opts.keep_temp).map_err(|e| InstructionsError(e.to_string()))?;
    if opts.keep_temp {
        eprintln!(
            "bench instructions: working directory {}",
            tmp.path().display()
        );
    }
    let err = |e: crate::compare::CompareError| InstructionsError(e.to_string());
    check_binary(&opts.bench_exe).map_err(err)?;
    let mock_args: Vec<String> = vec![
        "mock-provider".into(),
        "--port".into(),
        opts.mock_port.to_string(),
        "--tokens".into(),
        opts.tokens.to_string(),
        "--inter-token-ms".into(),
        opts.inter_token_ms.to_string(),
        "--model-list".into(),
        MOCK_MODEL.into(),
    ];
    let mock = ChildProc::spawn("mock", &opts.bench_exe, &mock_args, tmp.path(), true, stop)
        .map_err(err)?;
    let mock_url = format!("http://{}", mock.ready_value("addr").map_err(err)?);

    let wrap = tmp.path().join("callgrind-bin");
    std::fs::create_dir_all(&wrap)?;
    for (name, prefix) in [
        ("edge-bin", "callgrind.edge"),
        ("node-bin", "callgrind.node"),
    ] {
        let real = opts.bin_dir.join(name);
        check_binary(&real).map_err(err)?;
        write_wrapper(&wrap, name, &real, &opts.valgrind, &tmp.path().join(prefix))?;
    }
    let names = ClusterNames::bench(EDGE_MODEL, MOCK_MODEL);
    let edge_config = edge_toml(&names, &mock_url);
    let spec = RelaySpec {
        names: &names,
        edge_config: &edge_config,
        cores: (&opts.edge_cores, &opts.node_cores),
        status_key: None,
    };
    eprintln!("bench instructions: starting edge-bin and node-bin under callgrind");
    let pair = spawn_relay(&wrap, tmp.path(), &spec, stop, &mut || Ok(())).map_err(err)?;
    let relay = [
        ("edge".to_string(), pair.edge.pid()),
        ("node".to_string(), pair.node.pid()),
    ];
    let mut arms = vec![count_arm(
        opts,
        "iop",
        &Target::parse(&pair.url)?,
        EDGE_MODEL,
        &relay,
        stop,
    )?];
    if let Some(peer) = &opts.peer {
        let processes: Vec<(String, u32)> = opts
            .peer_pids
            .iter()
            .map(|&pid| (format!("{} {pid}", opts.peer_name), pid))
            .collect();
        arms.push(count_arm(
            opts,
            &opts.peer_name,
            &Target::parse(peer)?,
            MOCK_MODEL,
            &processes,
            stop,
        )?);
    }
    drop(pair);
    drop(mock);
    let goal_met = arms[0].per_token <= GOAL_RELAY_PER_TOKEN as f64;
    Ok(InstructionsReport {
        schema: SCHEMA,
        created_unix_ms: iop_engine::clock::unix_ms(),
        commit: commit(),
        streams: opts.streams,
        tokens: opts.tokens,
        inter_token_ms: opts.inter_token_ms,
        rounds: opts.rounds,
        arms,
        goal_relay_per_token: GOAL_RELAY_PER_TOKEN,
        goal_met,
    })
}

/// The model the mock serves (and a peer's requests name).
pub const MOCK_MODEL: &str = "mock-model";
/// The model relayed requests name.
pub const EDGE_MODEL: &str = "bench-model";

/// The table printed on stdout.
pub fn render(report: &InstructionsReport) -> String {
    let mut out = format!(
        "\nUser-space instructions per token (callgrind), {} streams × {} tokens × {} rounds, \
         a token every {} ms; per request: a round of {} one-token requests:\n\n\
         | arm | process | instructions | per token | per request |\n|---|---|---|---|---|\n",
        report.streams, report.tokens, report.rounds, report.inter_token_ms, report.streams
    );
    for arm in &report.arms {
        for p in &arm.processes {
            out += &format!(
                "| {} | {} | {} | {:.0} | {:.0} |\n",
                arm.arm, p.name, p.instructions, p.per_token, p.per_request
            );
        }
        out += &format!(
            "| {} | **together** (chunk p99 {}) | {} | **{:.0}** | **{:.0}** |\n",
            arm.arm,
            format_us(arm.chunk_p99_us),
            arm.processes.iter().map(|p| p.instructions).sum::<u64>(),
            arm.per_token,
            arm.per_request
        );
    }
    let relay = &report.arms[0];
    out += &format!(
        "\ngoal: relay (Edge + Node) ≤ {} instructions per token: {:.0}, {}\n",
        report.goal_relay_per_token,
        relay.per_token,
        if report.goal_met { "met" } else { "NOT met" }
    );
    for peer in &report.arms[1..] {
        out += &format!(
            "relay ÷ {}: {:.2}× per token, {:.2}× per request\n",
            peer.arm,
            relay.per_token / peer.per_token,
            relay.per_request / peer.per_request
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_comes_from_the_summary_or_totals_line() {
        let dump = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\n\
                    fn=(1) main\n3 100\n\nsummary: 1234567\n\n\ntotals: 1234567\n";
        assert_eq!(parse_total(dump), Some(1_234_567));
        assert_eq!(parse_total("events: Ir\ntotals: 42\n"), Some(42));
        assert_eq!(parse_total("events: Ir\n"), None);
        assert_eq!(parse_total("summary: lots\n"), None);
    }

    #[test]
    fn the_table_gives_each_process_per_token_and_per_request() {
        let process = |name: &str, pid, instructions, per_request| ProcessCount {
            name: name.into(),
            pid,
            instructions,
            per_token: instructions as f64 / 1_000.0,
            per_request,
        };
        let iop = arm_count(
            "iop",
            1_000,
            10,
            vec![
                process("edge", 1, 9_000_000, 120_000.4),
                process("node", 2, 11_000_000, 100_000.0),
            ],
            2_500.0,
        );
        let nginx = arm_count(
            "nginx",
            1_000,
            10,
            vec![process("nginx 3", 3, 3_000_000, 30_000.0)],
            900.0,
        );
        assert_eq!((iop.per_token, iop.per_request), (20_000.0, 220_000.4));
        let report = InstructionsReport {
            schema: SCHEMA,
            created_unix_ms: 0,
            commit: None,
            streams: 10,
            tokens: 100,
            inter_token_ms: 100,
            rounds: 1,
            arms: vec![iop, nginx],
            goal_relay_per_token: GOAL_RELAY_PER_TOKEN,
            goal_met: false,
        };
        assert_eq!(
            render(&report),
            "\nUser-space instructions per token (callgrind), 10 streams × 100 tokens × 1 rounds, \
             a token every 100 ms; per request: a round of 10 one-token requests:\n\n\
             | arm | process | instructions | per token | per request |\n|---|---|---|---|---|\n\
             | iop | edge | 9000000 | 9000 | 120000 |\n\
             | iop | node | 11000000 | 11000 | 100000 |\n\
             | iop | **together** (chunk p99 2.50 ms) | 20000000 | **20000** | **220000** |\n\
             | nginx | nginx 3 | 3000000 | 3000 | 30000 |\n\
             | nginx | **together** (chunk p99 900.0 µs) | 3000000 | **3000** | **30000** |\n\
             \ngoal: relay (Edge + Node) ≤ 6000 instructions per token: 20000, NOT met\n\
             relay ÷ nginx: 6.67× per token, 7.33× per request\n"
        );
    }

    #[test]
    fn quoting_survives_quotes_and_spaces() {
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}
