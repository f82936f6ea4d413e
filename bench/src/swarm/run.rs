//! The orchestration of `bench swarm`: mint the fleet's certificates, and
//! for each fleet size start an Edge, bring the swarm up, measure, kill
//! and restart the Edge twice, and assemble the report.
//!
//! ```text
//! per fleet size N:
//!   edge-bin (cold) ─ RSS, idle CPU ─ swarm dials (all N at once) ─ all ready ─ /status
//!     ─ RSS ─ probes (dispatch latency, pinned nodes)
//!   SIGKILL ─ edge-bin again (same ports) ─ all ready (jitter on)
//!   SIGKILL ─ edge-bin again ─ all ready (jitter off: one burst)
//!   SIGKILL ─ edge-bin again, 1 s heartbeats on both sides ─ heartbeat CPU window
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use iop_engine::clock::{monotonic_raw_ns, unix_ms};
use iop_engine::rng::SplitMix64;
use node_bin::supervisor::Jitter;

use super::client::Probe;
use super::fleet::{mint_fleet, ms_between, parse_addr, phase_figures, Command, Cpu, SwarmThread};
use super::node::{DialPolicy, NodeIdentity, SwarmState};
use super::report::{HeartbeatFigures, PhaseFigures, StepReport, SwarmReport, SCHEMA};
use super::selection::{self, SelectionSpec};
use super::topology::{Topology, EDGE_NAME};
use super::SwarmOptions;
use crate::compare::procs::{ChildProc, TempDir};
use crate::compare::run::{check_binary, commit, interrupted, write_file};
use crate::compare::CompareError;
use crate::load::{self, Target};
use crate::procstat;
use crate::stats::LatencyHistogram;

/// Poll period while waiting for the swarm.
const POLL_MS: u64 = 10;
/// Pause after every node is ready before idle figures are read, so the
/// last registrations' work is done.
const SETTLE_MS: u64 = 1_000;
/// Idle window before the swarm dials (the Edge's CPU with no node).
const IDLE_WINDOW_MS: u64 = 1_000;
/// The heartbeat timeout while heartbeats are shortened: long enough that
/// a busy restart never trips it.
const HEARTBEAT_TIMEOUT_MS: u64 = 30_000;
/// File descriptors kept free beyond one per node, in this process and in
/// the Edge (listeners, logs, the probe connection, the runtime).
const FD_MARGIN: u64 = 256;
/// The nodes' reconnect wait before the heartbeat window (at most): that
/// restart is not measured, so it need not take long.
const HEARTBEAT_PHASE_RECONNECT: Duration = Duration::from_secs(1);

/// A running Edge and where it listens.
struct Edge {
    proc: ChildProc,
    client: SocketAddr,
    nodes: SocketAddr,
}

/// Everything one fleet size needs.
struct Step<'a> {
    opts: &'a SwarmOptions,
    topology: Topology,
    dir: &'a Path,
    edge_bin: PathBuf,
    stop: &'a AtomicBool,
}

impl Step<'_> {
    /// Writes the configuration for `client`/`nodes` (`127.0.0.1:0` picks)
    /// and starts edge-bin; `heartbeat_ms` shortens its heartbeat timers.
    fn start_edge(
        &self,
        name: &str,
        client: &str,
        nodes: &str,
        heartbeat_ms: Option<u64>,
    ) -> Result<Edge, CompareError> {
        let config = self.dir.join(format!("edge-{}.toml", self.topology.nodes));
        let max_queue = self.opts.selection_queued.max(256);
        write_file(&config, &self.topology.edge_toml(client, nodes, max_queue))?;
        let args = vec![
            "--config".to_string(),
            config.display().to_string(),
            "--cores".into(),
            self.opts.edge_cores.clone(),
        ];
        let heartbeat = heartbeat_ms.map(|ms| format!("{ms}:{HEARTBEAT_TIMEOUT_MS}"));
        let env: Vec<(&str, &str)> = heartbeat
            .as_deref()
            .map(|v| (iop_engine::conn::HEARTBEAT_OVERRIDE_ENV, v))
            .into_iter()
            .collect();
        let proc = ChildProc::spawn_with_env(
            name,
            &self.edge_bin,
            &args,
            &env,
            self.dir,
            true,
            self.stop,
        )?;
        let client = parse_addr(&proc, "client")?;
        let nodes = parse_addr(&proc, "nodes")?;
        Ok(Edge {
            proc,
            client,
            nodes,
        })
    }

    /// Waits until every node had a ready session that began after
    /// `since_ns` and all are ready now.
    fn wait_all_ready(
        &self,
        state: &SwarmState,
        since_ns: u64,
        edge: &mut Edge,
        what: &str,
    ) -> Result<(), CompareError> {
        let n = self.topology.nodes;
        let limit_ms = 120_000 + n as u64 * 50;
        let started_ns = monotonic_raw_ns();
        loop {
            interrupted(self.stop)?;
            edge.proc.check_running()?;
            let fresh = (0..n)
                .filter(|&i| state.ready_times(i).is_some_and(|t| t.ready_ns > since_ns))
                .count();
            if fresh == n && state.ready_count() == n {
                return Ok(());
            }
            if monotonic_raw_ns() - started_ns > limit_ms * 1_000_000 {
                return Err(CompareError::Swarm(format!(
                    "{what}: {fresh} of {n} nodes ready after {} s; notes: {:?}\n--- edge log (tail) ---\n{}",
                    limit_ms / 1_000,
                    state.notes(),
                    edge.proc.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(POLL_MS));
        }
    }

    fn phase(
        &self,
        state: &SwarmState,
        origin_ns: u64,
        listening_ns: u64,
        cpu: Cpu,
    ) -> PhaseFigures {
        phase_figures(self.topology.nodes, state, origin_ns, listening_ns, cpu)
    }

    /// SIGKILLs the Edge and starts it again on the same ports
    /// (`heartbeat_ms` shortens its heartbeats); returns the new Edge and
    /// the recovery figures.
    fn restart(
        &self,
        edge: Edge,
        state: &SwarmState,
        name: &str,
        heartbeat_ms: Option<u64>,
    ) -> Result<(Edge, PhaseFigures), CompareError> {
        let (client, nodes) = (edge.client.to_string(), edge.nodes.to_string());
        let mut old = edge;
        state.take_counters();
        let killed_ns = monotonic_raw_ns();
        old.proc.kill();
        let harness_before = procstat::read_cpu_ns(std::process::id())?;
        let mut edge = self.start_edge(name, &client, &nodes, heartbeat_ms)?;
        let listening_ns = monotonic_raw_ns();
        let cpu_before = procstat::read_cpu_ns(edge.proc.pid())?;
        self.wait_all_ready(state, killed_ns, &mut edge, name)?;
        let cpu = Cpu {
            edge_ns: procstat::read_cpu_ns(edge.proc.pid())?.saturating_sub(cpu_before),
            harness_ns: procstat::read_cpu_ns(std::process::id())?.saturating_sub(harness_before),
        };
        let figures = self.phase(state, killed_ns, listening_ns, cpu);
        Ok((edge, figures))
    }
}

/// `/status` of the Edge at `client`: (connected providers, providers).
fn status_providers(client: SocketAddr) -> Result<(usize, usize), CompareError> {
    let target = Target::parse(&format!("http://{client}"))?;
    let (code, body) = load::get_blocking(&target, "/status")?;
    if code != 200 {
        return Err(CompareError::Swarm(format!("/status answered HTTP {code}")));
    }
    let status: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| CompareError::Swarm(format!("/status is not JSON: {e}")))?;
    let providers = status["providers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let connected = providers
        .iter()
        .filter(|p| p["connected"] == serde_json::Value::Bool(true))
        .count();
    Ok((connected, providers.len()))
}

/// The probes of one fleet size: `probes` to pooled models (model chosen
/// at random), then `pinned_probes` to the pinned models of random nodes
/// and one to each `--pin-node` this fleet has.
fn plan_probes(opts: &SwarmOptions, topology: Topology, rng: &mut SplitMix64) -> Vec<Probe> {
    let mut probes = Vec::new();
    let mut seq = 0;
    let mut next = |model: String, expect_node: Option<String>| {
        seq += 1;
        Probe {
            seq,
            model,
            expect_node,
        }
    };
    for _ in 0..opts.probes {
        let j = rng.below(topology.providers_per_node as u64) as usize;
        probes.push(next(Topology::pooled_model(j), None));
    }
    let random = (0..opts.pinned_probes).map(|_| rng.below(topology.nodes as u64) as usize);
    let chosen: Vec<usize> = opts
        .pin_nodes
        .iter()
        .copied()
        .filter(|&i| i < topology.nodes)
        .collect();
    for i in random.chain(chosen) {
        probes.push(next(Topology::pinned_model(i), Some(Topology::node_id(i))));
    }
    probes
}

fn run_step(
    opts: &SwarmOptions,
    identities: &[NodeIdentity],
    n: usize,
    dir: &Path,
    stop: &AtomicBool,
) -> Result<StepReport, CompareError> {
    let topology = Topology {
        nodes: n,
        providers_per_node: opts.providers_per_node,
        capacity: opts.capacity,
    };
    let step = Step {
        opts,
        topology,
        dir,
        edge_bin: opts.bin_dir.join("edge-bin"),
        stop,
    };
    let mut rng = SplitMix64::new(opts.seed ^ n as u64);
    let jitter = Jitter::new(opts.jitter_percent).unwrap_or_default();
    let interval = Duration::from_millis(opts.reconnect_interval_ms);
    let state = Arc::new(SwarmState::new(
        n,
        DialPolicy {
            interval,
            jitter,
            heartbeat: None,
        },
    ));

    // Cold start: the Edge comes up, then every node dials at once.
    eprintln!("swarm {n}: cold start");
    let spawned_ns = monotonic_raw_ns();
    let mut edge = step.start_edge(
        &format!("edge-{n}-cold"),
        "127.0.0.1:0",
        "127.0.0.1:0",
        None,
    )?;
    let listening_ns = monotonic_raw_ns();
    let pid = edge.proc.pid();
    let edge_rss_idle_kib = procstat::read_rss_kib(pid)?;
    let idle_before = procstat::read_cpu_ns(pid)?;
    std::thread::sleep(Duration::from_millis(IDLE_WINDOW_MS));
    let idle_cpu_ns_per_ms =
        procstat::read_cpu_ns(pid)?.saturating_sub(idle_before) as f64 / IDLE_WINDOW_MS as f64;
    let swarm = SwarmThread::start(
        identities[..n].to_vec(),
        Arc::from([edge.nodes]),
        state.clone(),
        rng.next_u64(),
    )?;
    state.take_counters();
    let cpu_before = procstat::read_cpu_ns(pid)?;
    let harness_before = procstat::read_cpu_ns(std::process::id())?;
    let dial_ns = monotonic_raw_ns();
    swarm.send(Command::Dial)?;
    step.wait_all_ready(&state, dial_ns, &mut edge, "cold start")?;
    let cpu = Cpu {
        edge_ns: procstat::read_cpu_ns(pid)?.saturating_sub(cpu_before),
        harness_ns: procstat::read_cpu_ns(std::process::id())?.saturating_sub(harness_before),
    };
    // Counted as if the nodes had dialled the moment the Edge listened:
    // the idle window between is left out.
    let mut cold = step.phase(&state, dial_ns, dial_ns, cpu);
    cold.edge_listening_ms = ms_between(spawned_ns, listening_ns);
    cold.all_ready_ms += cold.edge_listening_ms;
    let (status_connected_providers, status_providers) = status_providers(edge.client)?;
    std::thread::sleep(Duration::from_millis(SETTLE_MS));
    let edge_rss_ready_kib = procstat::read_rss_kib(pid)?;

    eprintln!("swarm {n}: probes");
    let outcomes = swarm.probe(edge.client, plan_probes(opts, topology, &mut rng))?;
    let (pinned, pooled): (Vec<_>, Vec<_>) =
        outcomes.into_iter().partition(|p| p.expect_node.is_some());
    let mut dispatch = LatencyHistogram::new();
    let mut round_trip = LatencyHistogram::new();
    let mut served = std::collections::BTreeSet::new();
    let mut probe_errors = Vec::new();
    let mut probes_failed = 0;
    for p in &pooled {
        match (&p.error, p.dispatch_ns, &p.served_by) {
            (None, Some(ns), Some(node)) => {
                dispatch.record_ns(ns);
                round_trip.record_ns(p.round_trip_ns);
                served.insert(node.clone());
            }
            _ => {
                probes_failed += 1;
                if probe_errors.len() < 5 {
                    probe_errors.push(format!("{} {:?}", p.model, p.error));
                }
            }
        }
    }
    state.take_counters();

    // Restarts, the nodes redialling under the jittered policy, then
    // without jitter (every node at once).
    eprintln!("swarm {n}: restart (jitter {} %)", opts.jitter_percent);
    let (edge, recovery_jitter) = step.restart(edge, &state, &format!("edge-{n}-restart"), None)?;
    eprintln!("swarm {n}: restart (no jitter)");
    state.set_policy(DialPolicy {
        interval,
        jitter: Jitter::NONE,
        heartbeat: None,
    });
    let (edge, recovery_no_jitter) =
        step.restart(edge, &state, &format!("edge-{n}-stampede"), None)?;

    // Heartbeats shortened on both sides, on an Edge of their own (its
    // recovery is not measured: the nodes come back after at most one
    // short wait).
    eprintln!("swarm {n}: heartbeat window");
    let heartbeat = (
        Duration::from_millis(opts.heartbeat_interval_ms),
        Duration::from_millis(HEARTBEAT_TIMEOUT_MS),
    );
    state.set_policy(DialPolicy {
        interval: interval.min(HEARTBEAT_PHASE_RECONNECT),
        jitter,
        heartbeat: Some(heartbeat),
    });
    let (mut edge, _) = step.restart(
        edge,
        &state,
        &format!("edge-{n}-heartbeat"),
        Some(opts.heartbeat_interval_ms),
    )?;
    std::thread::sleep(Duration::from_millis(SETTLE_MS));
    let pid = edge.proc.pid();
    let before = procstat::read_cpu_ns(pid)?;
    std::thread::sleep(Duration::from_millis(opts.heartbeat_window_ms));
    let edge_cpu_ns = procstat::read_cpu_ns(pid)?.saturating_sub(before);
    edge.proc.check_running()?;
    if state.ready_count() != n {
        return Err(CompareError::Swarm(format!(
            "heartbeat window: {} of {n} nodes stayed ready",
            state.ready_count()
        )));
    }
    let heartbeat_figures = HeartbeatFigures::of(
        n,
        opts.heartbeat_window_ms,
        opts.heartbeat_interval_ms,
        edge_cpu_ns as f64 / 1e3,
        idle_cpu_ns_per_ms * opts.heartbeat_window_ms as f64 / 1e3,
    );
    drop(swarm);
    edge.proc.stop();
    Ok(StepReport {
        nodes: n,
        providers: topology.provider_count(),
        edge_rss_idle_kib,
        edge_rss_ready_kib,
        rss_per_node_bytes: edge_rss_ready_kib.saturating_sub(edge_rss_idle_kib) as f64 * 1024.0
            / n as f64,
        cold,
        status_connected_providers,
        status_providers,
        dispatch: dispatch.summary(),
        round_trip: round_trip.summary(),
        probes_ok: dispatch.count(),
        probes_failed,
        nodes_served: served.len(),
        pinned,
        recovery_jitter,
        recovery_no_jitter,
        heartbeat: heartbeat_figures,
        notes: state.notes(),
        probe_errors,
    })
}

/// Runs the whole swarm benchmark. Progress goes to stderr; the caller
/// prints the tables and writes the JSON.
pub fn run(opts: &SwarmOptions, stop: &Arc<AtomicBool>) -> Result<SwarmReport, CompareError> {
    let largest = opts.ladder.iter().copied().max().unwrap_or(0);
    let load_at_start = procstat::read_loadavg();
    let mut selection = Vec::with_capacity(opts.ladder.len());
    // A cluster run measures re-homing only; Control's costs are the
    // single-Edge run's.
    let measured = if opts.cluster_edges.is_some() {
        &[][..]
    } else {
        &opts.ladder[..]
    };
    for &n in measured {
        interrupted(stop)?;
        eprintln!("swarm {n}: Control decisions in process");
        let spec = SelectionSpec {
            topology: Topology {
                nodes: n,
                providers_per_node: opts.providers_per_node,
                capacity: opts.capacity,
            },
            iterations: opts.selection_iterations,
            queued: opts.selection_queued,
        };
        selection.push(selection::measure(spec).map_err(|e| CompareError::Swarm(e.to_string()))?);
    }
    let mut report = SwarmReport {
        schema: SCHEMA,
        created_unix_ms: 0,
        commit: commit(),
        machine: procstat::machine_info(),
        options: opts.clone(),
        nofile: None,
        load_average: [load_at_start, None],
        steps: Vec::new(),
        selection,
        cluster: None,
    };
    if !opts.selection_only {
        // One socket per node here and in the Edge (which inherits the
        // limit), plus a margin.
        let nofile = procstat::raise_nofile_limit()?;
        let needed = largest as u64 + FD_MARGIN;
        if nofile.soft < needed {
            return Err(CompareError::Swarm(format!(
                "the open-file limit is {} (hard {}); {largest} nodes need at least {needed}: \
                 raise it (`ulimit -n {needed}`) or run fewer --nodes",
                nofile.soft, nofile.hard
            )));
        }
        report.nofile = Some(nofile);
        let edge_bin = opts.bin_dir.join("edge-bin");
        check_binary(&edge_bin)?;
        let tmp = TempDir::create(opts.keep_temp)?;
        if opts.keep_temp {
            eprintln!("swarm: working directory {}", tmp.path().display());
        }
        if let Some(edges) = opts.cluster_edges {
            report.cluster = Some(super::cluster::run(opts, edges, tmp.path(), stop)?);
            report.load_average[1] = procstat::read_loadavg();
            report.created_unix_ms = unix_ms();
            return Ok(report);
        }
        eprintln!("swarm: minting {largest} node certificates");
        let single = [(EDGE_NAME.to_string(), "edge".to_string())];
        let identities = mint_fleet(tmp.path(), largest, &single)?;
        for &n in &opts.ladder {
            interrupted(stop)?;
            report
                .steps
                .push(run_step(opts, &identities, n, tmp.path(), stop)?);
        }
    }
    report.load_average[1] = procstat::read_loadavg();
    report.created_unix_ms = unix_ms();
    Ok(report)
}
