//! The orchestration of `bench compare`: start the children, warm up,
//! run the rounds of windows, climb the ladder, assemble the report.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use iop_engine::clock::monotonic_raw_ns;

use super::config::{
    certs_args, edge_toml, node_toml, status_has_connected_provider, ClusterNames,
};
use super::ladder::{climb, LevelRun, Limits};
use super::procs::{ChildProc, TempDir};
use super::report::{
    check_goals, streams_text, Arm, ArmInfo, CompareReport, CompareSummary, CpuReport, CpuWindow,
    GoalInputs, LadderReport, LevelOutcome, LevelReport, PeerCost, PeerProcess, PeerRssSample,
    RoundRecord, RssReport, RssSample, WindowRecord, SCHEMA,
};
use super::{CompareError, CompareOptions};
use crate::load::{self, format_us, Live, LoadSpec, LoadSummary, Mode, Target};
use crate::procstat::{self, CpuTicks};

/// How long the harness waits for the Node to show up connected.
const CONNECT_TIMEOUT_MS: u64 = 20_000;
/// `/status` poll period while waiting.
const STATUS_POLL_MS: u64 = 50;
/// Pause between runs so closed connections are torn down on every side
/// before the next run starts.
const SETTLE_MS: u64 = 200;
/// Time after the end of a window that requests still running get.
const WINDOW_DRAIN_MS: u64 = 10_000;
/// Characters of a peer process's command line the report keeps.
const PEER_COMMAND_CHARS: usize = 48;

/// The children and their working directory. Fields drop in order: the
/// Node first, then the Edge, the mock, and last the directory.
struct Cluster {
    node: Option<ChildProc>,
    edge: Option<ChildProc>,
    mock: Option<ChildProc>,
    tmp: TempDir,
}

/// CPU counters of the children (and, in peer windows, of the peer's
/// processes together, or why they could not be read) at one moment.
#[derive(Debug, Clone, Default)]
struct CpuSnapshot {
    edge: Option<CpuTicks>,
    node: Option<CpuTicks>,
    mock: Option<CpuTicks>,
    peer: Option<Result<u64, String>>,
}

impl Cluster {
    fn check_running(&mut self) -> Result<(), CompareError> {
        for child in [&mut self.node, &mut self.edge, &mut self.mock]
            .into_iter()
            .flatten()
        {
            child.check_running()?;
        }
        Ok(())
    }

    fn cpu(&self) -> CpuSnapshot {
        let read =
            |c: &Option<ChildProc>| c.as_ref().and_then(|c| procstat::read_cpu(c.pid()).ok());
        CpuSnapshot {
            edge: read(&self.edge),
            node: read(&self.node),
            mock: read(&self.mock),
            peer: None,
        }
    }

    fn relay_pids(&self) -> Option<(u32, u32)> {
        Some((self.edge.as_ref()?.pid(), self.node.as_ref()?.pid()))
    }
}

/// The CPU used between two snapshots, and why the peer's could not be
/// had (when it was to be sampled and a read failed).
fn cpu_window(
    before: &CpuSnapshot,
    after: &CpuSnapshot,
    ticks_per_s: u64,
) -> (CpuWindow, Option<String>) {
    let used = |b: Option<CpuTicks>, a: Option<CpuTicks>| {
        Some(procstat::ticks_to_us(a?.since(b?), ticks_per_s))
    };
    let (peer_us, peer_error) = match (&before.peer, &after.peer) {
        (Some(Ok(b)), Some(Ok(a))) => (
            Some(procstat::ticks_to_us(a.saturating_sub(*b), ticks_per_s)),
            None,
        ),
        (Some(Err(e)), _) => (None, Some(format!("CPU before the window: {e}"))),
        (_, Some(Err(e))) => (None, Some(format!("CPU after the window: {e}"))),
        _ => (None, None),
    };
    let window = CpuWindow {
        edge_us: used(before.edge, after.edge),
        node_us: used(before.node, after.node),
        mock_us: used(before.mock, after.mock),
        peer_us,
    };
    (window, peer_error)
}

/// The peer's processes' CPU ticks together; the error names the PID.
fn read_peer_cpu(pids: &[u32]) -> Result<u64, String> {
    pids.iter().try_fold(0u64, |total, &pid| {
        procstat::read_cpu(pid)
            .map(|t| total.saturating_add(t.total_ticks()))
            .map_err(|e| format!("PID {pid}: {e}"))
    })
}

/// The peer's processes' `VmRSS` together, KiB; the error names the PID.
fn read_peer_rss(pids: &[u32]) -> Result<u64, String> {
    pids.iter().try_fold(0u64, |total, &pid| {
        procstat::read_rss_kib(pid)
            .map(|kib| total.saturating_add(kib))
            .map_err(|e| format!("PID {pid}: {e}"))
    })
}

fn read_rss(pids: (u32, u32), active_streams: u64) -> Option<RssSample> {
    Some(RssSample {
        active_streams,
        edge_kib: procstat::read_rss_kib(pids.0).ok()?,
        node_kib: procstat::read_rss_kib(pids.1).ok()?,
    })
}

/// Calls `sample` with the number of streams then in flight `delay_ms`
/// into a run; `None` if the run ended first.
fn spawn_sampler<T: Send + 'static>(
    live: Arc<Live>,
    delay_ms: u64,
    sample: impl FnOnce(u64) -> Option<T> + Send + 'static,
) -> JoinHandle<Option<T>> {
    std::thread::spawn(move || {
        let due_ns = monotonic_raw_ns() + delay_ms * 1_000_000;
        while monotonic_raw_ns() < due_ns {
            if live.finished.load(Ordering::Relaxed) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        sample(live.in_flight.load(Ordering::Relaxed))
    })
}

/// Samples Edge and Node memory `delay_ms` into a run, with the number of
/// streams then in flight; `None` if the run ended first.
fn spawn_rss_sampler(
    live: Arc<Live>,
    pids: (u32, u32),
    delay_ms: u64,
) -> JoinHandle<Option<RssSample>> {
    spawn_sampler(live, delay_ms, move |streams| read_rss(pids, streams))
}

pub(crate) fn check_binary(path: &Path) -> Result<(), CompareError> {
    if path.is_file() {
        Ok(())
    } else {
        Err(CompareError::MissingBinary {
            path: path.display().to_string(),
            hint: "build the binaries first (`cargo build --workspace --bins`, or `--release`) \
                   or point --bin-dir at them"
                .into(),
        })
    }
}

pub(crate) fn write_file(path: &Path, text: &str) -> Result<(), CompareError> {
    std::fs::write(path, text).map_err(|source| CompareError::Io {
        what: format!("write {}", path.display()),
        source,
    })
}

pub(crate) fn interrupted(stop: &AtomicBool) -> Result<(), CompareError> {
    if stop.load(Ordering::Relaxed) {
        Err(CompareError::Interrupted)
    } else {
        Ok(())
    }
}

/// Starts the mock (unless attached); returns its base URL.
fn start_mock(
    opts: &CompareOptions,
    cluster: &mut Cluster,
    stop: &AtomicBool,
) -> Result<String, CompareError> {
    if let Some(url) = &opts.attach_mock {
        return Ok(url.clone());
    }
    check_binary(&opts.bench_exe)?;
    let args: Vec<String> = [
        "mock-provider".to_string(),
        "--port".into(),
        opts.mock_port.to_string(),
        "--tokens".into(),
        opts.tokens.max(opts.ladder_tokens).to_string(),
        "--inter-token-ms".into(),
        opts.inter_token_ms.to_string(),
        "--ttft-ms".into(),
        opts.ttft_ms.to_string(),
        "--model-list".into(),
        opts.mock_model.clone(),
    ]
    .into();
    let mock = ChildProc::spawn(
        "mock",
        &opts.bench_exe,
        &args,
        cluster.tmp.path(),
        true,
        stop,
    )?;
    let url = format!("http://{}", mock.ready_value("addr")?);
    cluster.mock = Some(mock);
    Ok(url)
}

fn start_relay(
    opts: &CompareOptions,
    cluster: &mut Cluster,
    mock_url: &str,
    stop: &AtomicBool,
) -> Result<String, CompareError> {
    if let Some(url) = &opts.attach_edge {
        return Ok(url.clone());
    }
    let dir = cluster.tmp.path().to_path_buf();
    let names = ClusterNames::bench(&opts.edge_model, &opts.mock_model);
    let mut mock = cluster.mock.take();
    let edge_config = edge_toml(&names, mock_url);
    let spec = RelaySpec {
        names: &names,
        edge_config: &edge_config,
        cores: (&opts.edge_cores, &opts.node_cores),
        status_key: None,
    };
    let pair = spawn_relay(&opts.bin_dir, &dir, &spec, stop, &mut || {
        mock.as_mut().map_or(Ok(()), ChildProc::check_running)
    });
    cluster.mock = mock;
    let pair = pair?;
    cluster.edge = Some(pair.edge);
    cluster.node = Some(pair.node);
    Ok(pair.url)
}

/// An Edge and a Node started by [`spawn_relay`].
pub(crate) struct RelayPair {
    /// The Edge process.
    pub(crate) edge: ChildProc,
    /// The Node process, connected to it.
    pub(crate) node: ChildProc,
    /// The Edge's client base URL.
    pub(crate) url: String,
}

/// What [`spawn_relay`] starts: the names, the Edge's config and the
/// `--cores` of the Edge and the Node.
pub(crate) struct RelaySpec<'a> {
    /// The names of the Edge, the Node and the model.
    pub(crate) names: &'a ClusterNames,
    /// The Edge's `edge.toml` (its node must be `names.node_id`), e.g.
    /// [`edge_toml`] against one mock.
    pub(crate) edge_config: &'a str,
    /// The `--cores` of edge-bin and node-bin.
    pub(crate) cores: (&'a str, &'a str),
    /// The key `/status` is read with (an Edge with `[[client_keys]]`).
    pub(crate) status_key: Option<&'a load::ApiKey>,
}

/// Mints development certificates into `dir`, writes `edge.toml` and
/// `node.toml` for `spec`, starts edge-bin and node-bin from `bin_dir` with
/// their `--cores` and waits for the Node to connect. `others` checks the
/// children already running, so a dead mock ends the wait with its log.
pub(crate) fn spawn_relay(
    bin_dir: &Path,
    dir: &Path,
    spec: &RelaySpec<'_>,
    stop: &AtomicBool,
    others: &mut dyn FnMut() -> Result<(), CompareError>,
) -> Result<RelayPair, CompareError> {
    let RelaySpec {
        names,
        edge_config,
        cores,
        status_key,
    } = *spec;
    let edge_bin = bin_dir.join("edge-bin");
    let node_bin = bin_dir.join("node-bin");
    check_binary(&edge_bin)?;
    check_binary(&node_bin)?;
    std::fs::create_dir_all(dir).map_err(|source| CompareError::Io {
        what: format!("create {}", dir.display()),
        source,
    })?;
    let certs_dir = dir.join("certs");
    let minted = Command::new(&edge_bin)
        .args(certs_args(names, &certs_dir.display().to_string()))
        .env("RUST_LOG", "warn")
        .output()
        .map_err(|source| CompareError::Spawn {
            name: "edge-bin certs".into(),
            program: edge_bin.display().to_string(),
            source,
        })?;
    if !minted.status.success() {
        return Err(CompareError::Exited {
            name: "edge-bin certs".into(),
            status: minted.status.to_string(),
            log_tail: String::from_utf8_lossy(&minted.stderr).into_owned(),
        });
    }
    let args = |config: &Path, cores: &str| -> Vec<String> {
        vec![
            "--config".into(),
            config.display().to_string(),
            "--cores".into(),
            cores.to_string(),
        ]
    };
    let edge_config_path = dir.join("edge.toml");
    write_file(&edge_config_path, edge_config)?;
    let mut edge = ChildProc::spawn(
        "edge",
        &edge_bin,
        &args(&edge_config_path, cores.0),
        dir,
        true,
        stop,
    )?;
    let client = edge.ready_value("client")?.to_string();
    let nodes = edge.ready_value("nodes")?.to_string();
    let node_config = dir.join("node.toml");
    write_file(&node_config, &node_toml(names, &nodes))?;
    let mut node = ChildProc::spawn(
        "node",
        &node_bin,
        &args(&node_config, cores.1),
        dir,
        false,
        stop,
    )?;
    let url = format!("http://{client}");
    wait_for_status_as(
        &Target::parse(&url)?,
        status_key,
        stop,
        &mut || {
            others()?;
            edge.check_running()?;
            node.check_running()
        },
        &status_has_connected_provider,
    )?;
    Ok(RelayPair { edge, node, url })
}

/// Polls the Edge's `/status` until `ready` says so (a provider connected,
/// every provider…), calling `check_running` between polls.
pub(crate) fn wait_for_status(
    edge: &Target,
    stop: &AtomicBool,
    check_running: &mut dyn FnMut() -> Result<(), CompareError>,
    ready: &dyn Fn(&serde_json::Value) -> bool,
) -> Result<(), CompareError> {
    wait_for_status_as(edge, None, stop, check_running, ready)
}

/// [`wait_for_status`], reading `/status` with `key` when one is given.
pub(crate) fn wait_for_status_as(
    edge: &Target,
    key: Option<&load::ApiKey>,
    stop: &AtomicBool,
    check_running: &mut dyn FnMut() -> Result<(), CompareError>,
    ready: &dyn Fn(&serde_json::Value) -> bool,
) -> Result<(), CompareError> {
    let mut waited_ms = 0;
    let mut last_status = String::from("none yet");
    while waited_ms < CONNECT_TIMEOUT_MS {
        interrupted(stop)?;
        check_running()?;
        match load::get_blocking_as(edge, "/status", key) {
            Ok((200, body)) => match serde_json::from_slice::<serde_json::Value>(&body) {
                Ok(status) if ready(&status) => return Ok(()),
                Ok(status) => last_status = status.to_string(),
                Err(e) => last_status = format!("not JSON: {e}"),
            },
            Ok((code, _)) => last_status = format!("HTTP {code}"),
            Err(e) => last_status = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(STATUS_POLL_MS));
        waited_ms += STATUS_POLL_MS;
    }
    Err(CompareError::NodeNotConnected {
        waited_ms,
        last_status,
    })
}

/// The offered load of every window at `streams` concurrent streams.
fn window_spec(
    opts: &CompareOptions,
    target: &Target,
    model: &str,
    streams: u64,
    duration_ms: u64,
    stop: &Arc<AtomicBool>,
) -> Result<LoadSpec, CompareError> {
    let stream_ms = u64::from(opts.tokens) * opts.inter_token_ms + opts.ttft_ms;
    Ok(LoadSpec {
        target: target.clone(),
        model: model.to_string(),
        mode: Mode::Concurrency { streams },
        duration_ms,
        tokens: opts.tokens,
        stream: true,
        ramp_ms: (duration_ms / 4).min(stream_ms),
        drain_ms: WINDOW_DRAIN_MS + 2 * stream_ms,
        gap_limit_ns: Some(2 * opts.inter_token_ms * 1_000_000),
        cores: crate::load::cli::load_cores(opts.load_cores.as_deref())
            .map_err(CompareError::Options)?,
        max_in_flight: streams,
        api_key: None,
        request_id_prefix: None,
        progress: false,
        stop: Arc::clone(stop),
    })
}

fn describe(summary: &LoadSummary) -> String {
    format!(
        "{} ok, {} errors, {} truncated; TTFT p50 {} p99 {}; chunk p50 {} p99 {}; gap p99 {}",
        summary.requests_ok,
        summary.errors_total,
        summary.truncated,
        format_us(summary.ttft.p50_us),
        format_us(summary.ttft.p99_us),
        format_us(summary.chunk_latency.p50_us),
        format_us(summary.chunk_latency.p99_us),
        format_us(summary.inter_chunk_gap.p99_us),
    )
}

pub(crate) fn commit() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

/// One level's windows and rounds as measured, before the ladder (whose
/// memory sample joins the highest level's figures).
struct LevelRaw {
    streams: u64,
    windows: Vec<WindowRecord>,
    rounds: Vec<RoundRecord>,
    idle: Option<RssSample>,
    peer_idle: Option<Result<u64, String>>,
}

/// Runs the whole comparison. Progress goes to stderr; the caller prints
/// and writes the returned report.
pub fn run(opts: &CompareOptions, stop: &Arc<AtomicBool>) -> Result<CompareReport, CompareError> {
    if opts.concurrency.is_empty() {
        return Err(CompareError::Options(
            "--concurrency needs at least one level".into(),
        ));
    }
    let nofile = procstat::raise_nofile_limit()?;
    let machine = procstat::machine_info();
    let ticks_per_s = procstat::clock_ticks_per_s()?;
    let mut notes = Vec::new();
    let mut cluster = Cluster {
        node: None,
        edge: None,
        mock: None,
        tmp: TempDir::create(opts.keep_temp)?,
    };
    if opts.keep_temp {
        eprintln!(
            "bench compare: working directory {}",
            cluster.tmp.path().display()
        );
    }
    let peer_processes: Vec<PeerProcess> = opts
        .peer_pids
        .iter()
        .map(|&pid| PeerProcess {
            pid,
            command: procstat::read_cmdline(pid, PEER_COMMAND_CHARS),
        })
        .collect();
    let mock_url = start_mock(opts, &mut cluster, stop)?;
    let edge_url = start_relay(opts, &mut cluster, &mock_url, stop)?;
    if opts.attach_edge.is_some() {
        notes.push("Edge attached: Edge/Node CPU and memory were not measured".to_string());
    }
    eprintln!("bench compare: mock {mock_url}, edge {edge_url}");

    let mut arms = vec![
        ArmInfo {
            arm: Arm::A,
            label: Arm::A.label().into(),
            url: mock_url,
            model: opts.mock_model.clone(),
        },
        ArmInfo {
            arm: Arm::B,
            label: Arm::B.label().into(),
            url: edge_url,
            model: opts.edge_model.clone(),
        },
    ];
    if let Some(peer) = &opts.peer {
        arms.push(ArmInfo {
            arm: Arm::C,
            label: Arm::C.label().into(),
            url: peer.clone(),
            model: opts.mock_model.clone(),
        });
    }
    let targets = arms
        .iter()
        .map(|a| Target::parse(&a.url))
        .collect::<Result<Vec<_>, _>>()?;

    // The memory baseline: every process connected, none has served a
    // request yet. Growth per stream is measured from here at every level,
    // so what the first requests allocate and keep (pools, buffers, the
    // allocator's caches) counts against the streams, as it would for an
    // operator watching a fresh process take load.
    let fresh = Baseline {
        relay: cluster.relay_pids().and_then(|pids| read_rss(pids, 0)),
        peer: (!opts.peer_pids.is_empty() && arms.iter().any(|a| a.arm == Arm::C))
            .then(|| read_peer_rss(&opts.peer_pids)),
    };
    let mut raws = Vec::new();
    for &streams in &opts.concurrency {
        raws.push(run_level(
            opts,
            &mut cluster,
            &arms,
            &targets,
            streams,
            &fresh,
            ticks_per_s,
            stop,
        )?);
    }

    let ladder = if opts.ladder_levels.is_empty() {
        None
    } else {
        Some(run_ladder(
            opts,
            &mut cluster,
            &targets,
            &arms,
            nofile.soft,
            machine.local_ports,
            stop,
        )?)
    };

    let relay_measured = cluster.relay_pids().is_some();
    let ladder_sample = ladder.as_ref().and_then(|l| {
        l.relayed
            .levels
            .iter()
            .rev()
            .find(|level| level.outcome == LevelOutcome::Pass)
            .and_then(|level| level.rss)
    });
    let highest = raws.len() - 1;
    let mut levels = Vec::new();
    for (i, raw) in raws.into_iter().enumerate() {
        let summary = CompareSummary::of(&raw.windows, &raw.rounds).ok_or_else(|| {
            CompareError::Options(format!(
                "no complete round was measured at {} streams",
                raw.streams
            ))
        })?;
        let rss = match (raw.idle, relay_measured) {
            (Some(idle), true) => {
                let samples = raw.windows.iter().filter_map(|w| w.rss).collect();
                Some(RssReport::of(
                    idle,
                    samples,
                    ladder_sample.filter(|_| i == highest),
                ))
            }
            _ => None,
        };
        let cpu = relay_measured.then(|| CpuReport::of(&raw.windows, ticks_per_s));
        let peer = raw.peer_idle.map(|idle| PeerCost::of(&raw.windows, idle));
        let goals = check_goals(&GoalInputs {
            summary: &summary,
            cpu: cpu.as_ref(),
            rss: rss.as_ref(),
            peer: peer.as_ref(),
            peer_name: &opts.peer_name,
            highest: i == highest,
            clock_ticks_per_s: ticks_per_s,
        });
        levels.push(LevelReport {
            streams: raw.streams,
            windows: raw.windows,
            rounds: raw.rounds,
            summary,
            cpu,
            rss,
            peer,
            goals,
        });
    }

    if machine.nproc < 4 {
        notes.push(format!(
            "this machine has {} CPUs shared by the load generator, the mock, the Edge and the Node: \
             the figures include that contention for every arm",
            machine.nproc
        ));
    }
    if relay_measured {
        notes.push(format!(
            "CPU time is read from /proc/<pid>/stat in clock ticks of {} ms per process and window",
            1000 / ticks_per_s.max(1)
        ));
        notes.push(
            "idle memory is sampled once, after the processes connected and before any request; \
             the per-stream figure is (Edge + Node VmRSS mid-window − idle) ÷ streams in flight, \
             so what the first requests allocate and keep counts against the streams"
                .to_string(),
        );
    }
    if !peer_processes.is_empty() {
        notes.push(format!(
            "{}'s CPU and memory are those of the PIDs given with --peer-pid, summed, by the same \
             definitions as the relay's",
            opts.peer_name
        ));
    }
    Ok(CompareReport {
        schema: SCHEMA,
        created_unix_ms: iop_engine::clock::unix_ms(),
        machine,
        nofile,
        commit: commit(),
        options: opts.clone(),
        arms,
        peer_name: opts.peer_name.clone(),
        peer_processes,
        levels,
        ladder,
        notes,
    })
}

/// Resident memory before any load: the relay's and the peer's.
struct Baseline {
    relay: Option<RssSample>,
    peer: Option<Result<u64, String>>,
}

/// One concurrency level: a warm-up of every arm at `streams`, then the
/// rounds of windows; memory growth is measured from `fresh`.
#[allow(clippy::too_many_arguments)]
fn run_level(
    opts: &CompareOptions,
    cluster: &mut Cluster,
    arms: &[ArmInfo],
    targets: &[Target],
    streams: u64,
    fresh: &Baseline,
    ticks_per_s: u64,
    stop: &Arc<AtomicBool>,
) -> Result<LevelRaw, CompareError> {
    let peer_pids: Arc<[u32]> = opts.peer_pids.clone().into();
    let sample_peer = !peer_pids.is_empty() && arms.iter().any(|a| a.arm == Arm::C);
    // Warm-up: every arm must complete requests, or its figures are void.
    for (info, target) in arms.iter().zip(targets) {
        interrupted(stop)?;
        let mut spec = window_spec(opts, target, &info.model, streams, opts.warmup_ms, stop)?;
        if opts.warmup_ms == 0 {
            spec.mode = Mode::OneShot { streams: 1 };
        }
        let summary = load::run(&spec, &Live::new())?;
        eprintln!(
            "{}: warm-up {:<8} {}",
            streams_text(streams),
            info.label,
            describe(&summary)
        );
        if summary.requests_ok == 0 {
            return Err(CompareError::ArmBroken {
                arm: info.label.clone(),
                first_error: summary.first_error.unwrap_or_else(|| "no response".into()),
            });
        }
    }
    std::thread::sleep(Duration::from_millis(SETTLE_MS));
    let idle = fresh.relay;
    let peer_idle = fresh.peer.clone().filter(|_| sample_peer);

    let mut windows: Vec<WindowRecord> = Vec::new();
    let mut rounds = Vec::new();
    for round in 0..opts.windows {
        let mut order: Vec<usize> = (0..arms.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for (position, &i) in order.iter().enumerate() {
            interrupted(stop)?;
            cluster.check_running()?;
            let (info, target) = (&arms[i], &targets[i]);
            let spec = window_spec(opts, target, &info.model, streams, opts.window_ms, stop)?;
            let live = Live::new();
            let mid_ms = opts.window_ms / 2;
            let sampler = match (info.arm, cluster.relay_pids()) {
                (Arm::B, Some(pids)) => Some(spawn_rss_sampler(Arc::clone(&live), pids, mid_ms)),
                _ => None,
            };
            let peer_window = info.arm == Arm::C && sample_peer;
            let peer_sampler = peer_window.then(|| {
                let pids = Arc::clone(&peer_pids);
                spawn_sampler(Arc::clone(&live), mid_ms, move |active_streams| {
                    Some(read_peer_rss(&pids).map(|kib| PeerRssSample {
                        active_streams,
                        kib,
                    }))
                })
            });
            let mut before = cluster.cpu();
            if peer_window {
                before.peer = Some(read_peer_cpu(&peer_pids));
            }
            let summary = load::run(&spec, &live)?;
            let mut after = cluster.cpu();
            if peer_window {
                after.peer = Some(read_peer_cpu(&peer_pids));
            }
            let rss = sampler.and_then(|h| h.join().ok().flatten());
            let (cpu, mut peer_not_sampled) = cpu_window(&before, &after, ticks_per_s);
            let peer_rss = match peer_sampler.map(|h| h.join().ok().flatten()) {
                Some(Some(Ok(sample))) => Some(sample),
                Some(Some(Err(e))) => {
                    peer_not_sampled.get_or_insert(format!("memory mid-window: {e}"));
                    None
                }
                Some(None) => {
                    peer_not_sampled
                        .get_or_insert("memory: the window ended before mid-window".into());
                    None
                }
                None => None,
            };
            eprintln!(
                "{}: round {}/{} {:<8} {}",
                streams_text(streams),
                round + 1,
                opts.windows,
                info.label,
                describe(&summary)
            );
            if let Some(why) = &peer_not_sampled {
                eprintln!(
                    "{}: {} not sampled: {why}",
                    streams_text(streams),
                    opts.peer_name
                );
            }
            windows.push(WindowRecord {
                round,
                arm: info.arm,
                position: position as u32,
                headline: summary.headline(),
                summary,
                cpu,
                rss,
                peer_rss,
                peer_not_sampled,
            });
        }
        let of = |arm: Arm| {
            windows
                .iter()
                .rev()
                .find(|w| w.round == round && w.arm == arm)
                .map(|w| w.headline)
        };
        if let (Some(a), Some(b)) = (of(Arm::A), of(Arm::B)) {
            let order = order.iter().map(|&i| arms[i].arm).collect();
            rounds.push(RoundRecord::of(round, order, &a, &b, of(Arm::C).as_ref()));
        }
        std::thread::sleep(Duration::from_millis(SETTLE_MS));
    }
    Ok(LevelRaw {
        streams,
        windows,
        rounds,
        idle,
        peer_idle,
    })
}

#[allow(clippy::too_many_arguments)]
fn run_ladder(
    opts: &CompareOptions,
    cluster: &mut Cluster,
    targets: &[Target],
    arms: &[ArmInfo],
    nofile: u64,
    local_ports: Option<u64>,
    stop: &Arc<AtomicBool>,
) -> Result<LadderReport, CompareError> {
    let limits = Limits {
        nofile,
        local_ports,
    };
    let stream_ms = u64::from(opts.ladder_tokens) * opts.inter_token_ms + opts.ttft_ms;
    let gap_limit_ms = 2 * opts.inter_token_ms;
    let cores =
        crate::load::cli::load_cores(opts.load_cores.as_deref()).map_err(CompareError::Options)?;
    let relay_pids = cluster.relay_pids();
    let mut climb_arm = |index: usize| {
        let (info, target) = (&arms[index], &targets[index]);
        climb(&opts.ladder_levels, &limits, |streams| {
            interrupted(stop)?;
            cluster.check_running()?;
            let spec = LoadSpec {
                target: target.clone(),
                model: info.model.clone(),
                mode: Mode::OneShot { streams },
                duration_ms: opts.ladder_ramp_ms,
                tokens: opts.ladder_tokens,
                stream: true,
                ramp_ms: opts.ladder_ramp_ms,
                drain_ms: WINDOW_DRAIN_MS + 3 * stream_ms,
                gap_limit_ns: Some(gap_limit_ms * 1_000_000),
                cores: cores.clone(),
                max_in_flight: streams,
                api_key: None,
                request_id_prefix: None,
                progress: false,
                stop: Arc::clone(stop),
            };
            let live = Live::new();
            let sampler = match (info.arm, relay_pids) {
                // At the end of the ramp every stream has started and
                // (a stream lasting at least the ramp) none has ended.
                (Arm::B, Some(pids)) => Some(spawn_rss_sampler(
                    Arc::clone(&live),
                    pids,
                    opts.ladder_ramp_ms + 10,
                )),
                _ => None,
            };
            let summary = load::run(&spec, &live)?;
            let rss = sampler.and_then(|h| h.join().ok().flatten());
            eprintln!(
                "ladder {:<8} {streams:>5} streams: {}",
                info.label,
                describe(&summary)
            );
            std::thread::sleep(Duration::from_millis(SETTLE_MS));
            Ok(LevelRun { summary, rss })
        })
    };
    let direct = climb_arm(0)?;
    let relayed = climb_arm(1)?;
    Ok(LadderReport {
        inter_token_ms: opts.inter_token_ms,
        tokens: opts.ladder_tokens,
        ramp_ms: opts.ladder_ramp_ms,
        gap_limit_ms,
        direct,
        relayed,
    })
}
