//! `bench swarm --cluster N`: N Edges of one cluster over a real etcd,
//! the whole fleet spread over them, then one Edge killed.
//!
//! ```text
//! etcd (one member, loopback) ◄── leases, owner keys, watch ──┐
//!                                                              │
//! edge-a  edge-b  edge-c   (same fleet, own name + cert, [cluster] ttl 4 s / keep-alive 1 s)
//!    ▲       ▲       ▲
//!    └───────┴───────┴── every node: a fresh shuffle of the three node addresses per attempt
//!
//! all Edges hold their lease ─ every node dials at once ─ all ready ─ /status of each
//!   agrees with the swarm on who owns which node
//! pairs of requests to a random node's pinned model: to the Edge owning it, then to
//!   another Edge, which forwards it over its peer listener (dispatch latency of both)
//! SIGKILL edge-a ─ its nodes redial (interval ± jitter), the dead address refuses,
//!   the next one takes them ─ all ready again on edge-b / edge-c
//!   meanwhile: etcd drops edge-a's edge key when its lease expires (polled)
//! /status of each survivor: every node owned by a live Edge, the one it is on
//! one request to the pinned model of re-homed nodes, through their new Edge
//! ```

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use edge_bin::cluster::etcd::{EtcdClient, EtcdConfig};
use iop_engine::clock::monotonic_raw_ns;
use iop_engine::rng::SplitMix64;
use node_bin::supervisor::Jitter;

use super::client::Probe;
use super::fleet::{mint_fleet, parse_addr, phase_figures, Command, Cpu, SwarmThread};
use super::node::{DialPolicy, SwarmState};
use super::report::{
    ClusterReport, EdgeFigures, ForwardedFigures, NodeAcrossKill, OwnershipCheck, RehomeFigures,
};
use super::topology::{ClusterTable, EdgeRole, Topology, CLUSTER_NAME};
use super::SwarmOptions;
use crate::compare::procs::ChildProc;
use crate::compare::run::{check_binary, interrupted, write_file};
use crate::compare::CompareError;
use crate::load::{self, Target};
use crate::procstat;

/// The Edges' etcd lease: short, so the killed Edge's lease expires
/// within seconds of the kill.
pub const LEASE_TTL_SEC: u64 = 4;
/// Their keep-alive period.
pub const KEEPALIVE_INTERVAL_SEC: u64 = 1;
/// How long etcd may take to answer `/health` healthy.
const ETCD_START_MS: u64 = 60_000;
/// How long an Edge may take to hold its lease and see every other Edge.
const EDGES_UP_MS: u64 = 60_000;
/// How long the Edges' `/status` may take to agree with the swarm on who
/// owns which node (their watches trail the claims).
const OWNERSHIP_SETTLE_MS: u64 = 30_000;
/// The Edge killed: the first (`edge-a`); the nodes' shuffles make it no
/// different from the others.
const KILLED: usize = 0;
/// Poll period of the swarm's state.
const POLL_MS: u64 = 10;
/// Poll period of etcd for the killed Edge's key.
const LEASE_POLL_MS: u64 = 50;
/// Poll period of `/status` while waiting for it to settle.
const STATUS_POLL_MS: u64 = 250;

/// The etcd binary: `/usr/bin/etcd`, else `etcd` on `PATH`.
fn etcd_binary() -> Result<PathBuf, CompareError> {
    let system = PathBuf::from("/usr/bin/etcd");
    if system.is_file() {
        return Ok(system);
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("etcd"))
                .find(|candidate| candidate.is_file())
        })
        .ok_or_else(|| {
            CompareError::Swarm(
                "--cluster needs etcd, and it is not installed (no /usr/bin/etcd, no etcd on \
                 PATH): run `apt-get install etcd-server`"
                    .into(),
            )
        })
}

/// A free loopback port (bound, then released; another process may take
/// it before etcd binds it, and then etcd fails to start, saying so).
fn free_port() -> Result<u16, CompareError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| CompareError::Io {
            what: "find a free port".into(),
            source,
        })
}

/// One etcd member on loopback, its data under the run's directory.
struct Etcd {
    proc: ChildProc,
    endpoint: String,
}

impl Etcd {
    fn start(dir: &Path, stop: &AtomicBool) -> Result<Etcd, CompareError> {
        let binary = etcd_binary()?;
        let (client_port, peer_port) = (free_port()?, free_port()?);
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let args: Vec<String> = [
            "--name",
            "swarm",
            "--data-dir",
            &dir.join("etcd.data").display().to_string(),
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("swarm={peer_url}"),
            "--initial-cluster-state",
            "new",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let mut proc = ChildProc::spawn("etcd", &binary, &args, dir, false, stop)?;
        let target = Target::parse(&client_url)?;
        let started_ns = monotonic_raw_ns();
        loop {
            interrupted(stop)?;
            proc.check_running()?;
            if let Ok((200, body)) = load::get_blocking(&target, "/health") {
                let health = serde_json::from_slice::<serde_json::Value>(&body);
                if health.is_ok_and(|h| h["health"] == "true") {
                    break;
                }
            }
            if monotonic_raw_ns() - started_ns > ETCD_START_MS * 1_000_000 {
                return Err(CompareError::Swarm(format!(
                    "etcd not healthy within {} s\n--- etcd log (tail) ---\n{}",
                    ETCD_START_MS / 1_000,
                    proc.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Etcd {
            proc,
            endpoint: format!("127.0.0.1:{client_port}"),
        })
    }

    /// The names of the Edges holding their lease (the edge keys).
    fn live_edges(&self) -> Result<Vec<String>, CompareError> {
        let prefix = format!("/iop/{CLUSTER_NAME}/edges/");
        let endpoint = self.endpoint.clone();
        let answer = iop_engine::rt::block_on(async move {
            let client = EtcdClient::new(EtcdConfig::new(vec![endpoint]))?;
            client.range_prefix(prefix.as_bytes()).await
        })
        .map_err(|e| CompareError::Swarm(format!("the etcd runtime did not start: {e}")))?
        .map_err(|e| CompareError::Swarm(format!("etcd: reading the Edges: {e}")))?;
        let prefix = format!("/iop/{CLUSTER_NAME}/edges/");
        Ok(answer
            .kvs
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(&kv.key).ok()?;
                key.strip_prefix(&prefix).map(str::to_string)
            })
            .collect())
    }
}

/// One Edge of the cluster.
struct ClusterEdge {
    name: String,
    proc: ChildProc,
    client: SocketAddr,
    nodes: SocketAddr,
}

/// `/status` of the Edge at `client`, parsed.
fn status(client: SocketAddr) -> Result<serde_json::Value, CompareError> {
    let target = Target::parse(&format!("http://{client}"))?;
    let (code, body) = load::get_blocking(&target, "/status")?;
    if code != 200 {
        return Err(CompareError::Swarm(format!(
            "/status of {client} answered HTTP {code}"
        )));
    }
    serde_json::from_slice(&body)
        .map_err(|e| CompareError::Swarm(format!("/status of {client} is not JSON: {e}")))
}

fn elapsed_ms(since_ns: u64) -> u64 {
    monotonic_raw_ns().saturating_sub(since_ns) / 1_000_000
}

fn cpu_of(edges: &[&ClusterEdge]) -> Result<u64, CompareError> {
    let mut sum = 0;
    for e in edges {
        sum += procstat::read_cpu_ns(e.proc.pid())?;
    }
    Ok(sum)
}

/// Each fleet node's id and the name of the Edge its ready session is on.
fn where_nodes_are(state: &SwarmState, n: usize, names: &[String]) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let on = state
                .ready_times(i)
                .filter(|_| state.is_ready(i))
                .and_then(|t| names.get(t.edge).cloned())
                .unwrap_or_default();
            (Topology::node_id(i), on)
        })
        .collect()
}

/// Polls every Edge in `edges`' `/status` until each agrees with the
/// swarm on who owns which node (or the settle time is up); returns the
/// last checks.
fn settle_ownership(
    edges: &[&ClusterEdge],
    state: &SwarmState,
    n: usize,
    names: &[String],
    killed: &str,
    stop: &AtomicBool,
) -> Result<Vec<OwnershipCheck>, CompareError> {
    let started_ns = monotonic_raw_ns();
    loop {
        interrupted(stop)?;
        let expected = where_nodes_are(state, n, names);
        let mut checks = Vec::with_capacity(edges.len());
        for e in edges {
            checks.push(
                OwnershipCheck::of(&e.name, &status(e.client)?, killed, &expected)
                    .map_err(CompareError::Swarm)?,
            );
        }
        if checks.iter().all(OwnershipCheck::is_clean)
            || elapsed_ms(started_ns) > OWNERSHIP_SETTLE_MS
        {
            return Ok(checks);
        }
        std::thread::sleep(Duration::from_millis(STATUS_POLL_MS));
    }
}

/// The value of the unlabelled counter `name` in a `/metrics` text.
fn counter_value(metrics: &str, name: &str) -> Option<u64> {
    metrics.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

/// Forwarded requests the Edges took from their peers, summed; `None`
/// when an Edge's `/metrics` does not show the counter. (edge-bin caps
/// every exposition it merges at 20,000 lines, its own included: with a
/// thousand models that have request histograms, the cluster families at
/// the end are cut off.)
fn peer_requests(edges: &[ClusterEdge]) -> Result<Option<u64>, CompareError> {
    const NAME: &str = "iop_edge_cluster_peer_requests_total";
    let mut sum = 0;
    for e in edges {
        let target = Target::parse(&format!("http://{}", e.client))?;
        let (code, body) = load::get_blocking(&target, "/metrics")?;
        if code != 200 {
            return Err(CompareError::Swarm(format!(
                "{}: /metrics answered HTTP {code}",
                e.name
            )));
        }
        match std::str::from_utf8(&body)
            .ok()
            .and_then(|text| counter_value(text, NAME))
        {
            Some(value) => sum += value,
            None => return Ok(None),
        }
    }
    Ok(Some(sum))
}

/// Sends `pairs` pairs of requests for the pinned model of a random node:
/// to the Edge that owns it, then to a random other Edge (which forwards
/// it). One unmeasured request per (entry, owner) pair of Edges first, so
/// that the peer connections are open.
fn measure_forwarding(
    swarm: &SwarmThread,
    edges: &[ClusterEdge],
    state: &SwarmState,
    n: usize,
    pairs: usize,
    rng: &mut SplitMix64,
) -> Result<ForwardedFigures, CompareError> {
    let count = edges.len();
    let owner = |i: usize| state.ready_times(i).map(|t| t.edge);
    let mut seq = 2_000_000;
    let mut probe = |i: usize| {
        seq += 1;
        Probe {
            seq,
            model: Topology::pinned_model(i),
            expect_node: Some(Topology::node_id(i)),
        }
    };
    let mut warm_up = Vec::new();
    for o in 0..count {
        let Some(i) = (0..n).find(|&i| owner(i) == Some(o)) else {
            continue;
        };
        for e in (0..count).filter(|&e| e != o) {
            warm_up.push((edges[e].client, probe(i)));
        }
    }
    swarm.probe_each(warm_up)?;
    let before = peer_requests(edges)?;
    let mut list = Vec::with_capacity(2 * pairs);
    for _ in 0..pairs {
        let i = rng.below(n as u64) as usize;
        let o = owner(i).unwrap_or(0).min(count - 1);
        let k = rng.below(count as u64 - 1) as usize;
        let other = if k >= o { k + 1 } else { k };
        list.push((edges[o].client, probe(i)));
        list.push((edges[other].client, probe(i)));
    }
    let outcomes = swarm.probe_each(list)?;
    let after = peer_requests(edges)?;
    let pairs: Vec<_> = outcomes
        .chunks(2)
        .filter_map(|pair| match pair {
            [direct, forwarded] => Some((direct.clone(), forwarded.clone())),
            _ => None,
        })
        .collect();
    let counted = before
        .zip(after)
        .map(|(before, after)| after.saturating_sub(before));
    Ok(ForwardedFigures::of(&pairs, counted))
}

/// Runs the cluster measurement with `count` Edges in `dir`.
pub fn run(
    opts: &SwarmOptions,
    count: usize,
    dir: &Path,
    stop: &AtomicBool,
) -> Result<ClusterReport, CompareError> {
    let n = opts.ladder.last().copied().unwrap_or(0);
    let topology = Topology {
        nodes: n,
        providers_per_node: opts.providers_per_node,
        capacity: opts.capacity,
    };
    let names: Vec<String> = (0..count).filter_map(Topology::edge_name).collect();
    if names.len() != count {
        return Err(CompareError::Swarm(format!("no names for {count} Edges")));
    }
    let edge_bin = opts.bin_dir.join("edge-bin");
    check_binary(&edge_bin)?;

    eprintln!("swarm cluster: starting etcd");
    let mut etcd = Etcd::start(dir, stop)?;
    let table = ClusterTable {
        name: CLUSTER_NAME.into(),
        etcd_endpoints: vec![etcd.endpoint.clone()],
        lease_ttl_sec: LEASE_TTL_SEC,
        keepalive_interval_sec: KEEPALIVE_INTERVAL_SEC,
        peer_listen: Some("127.0.0.1:0".into()),
    };

    eprintln!("swarm cluster: minting {n} node certificates and {count} Edge certificates");
    let files: Vec<(String, String)> = names.iter().map(|e| (e.clone(), e.clone())).collect();
    let identities = mint_fleet(dir, n, &files)?;

    eprintln!(
        "swarm cluster: starting {count} Edges ({})",
        names.join(", ")
    );
    let max_queue = opts.selection_queued.max(256);
    let mut edges = Vec::with_capacity(count);
    for name in &names {
        let config = dir.join(format!("{name}.toml"));
        let role = EdgeRole::Member {
            name,
            cluster: &table,
        };
        write_file(
            &config,
            &topology.edge_toml_as(role, "127.0.0.1:0", "127.0.0.1:0", max_queue),
        )?;
        let args = vec![
            "--config".to_string(),
            config.display().to_string(),
            "--cores".into(),
            opts.edge_cores.clone(),
        ];
        let proc = ChildProc::spawn(name, &edge_bin, &args, dir, true, stop)?;
        let client = parse_addr(&proc, "client")?;
        let nodes = parse_addr(&proc, "nodes")?;
        edges.push(ClusterEdge {
            name: name.clone(),
            proc,
            client,
            nodes,
        });
    }
    // Every Edge holds its lease and sees the others before a node dials.
    let started_ns = monotonic_raw_ns();
    for e in &mut edges {
        loop {
            interrupted(stop)?;
            e.proc.check_running()?;
            let doc = status(e.client)?;
            let cluster = &doc["cluster"];
            let seen = cluster["edges"].as_array().map_or(0, Vec::len);
            if cluster["up"] == serde_json::Value::Bool(true) && seen == count {
                break;
            }
            if elapsed_ms(started_ns) > EDGES_UP_MS {
                return Err(CompareError::Swarm(format!(
                    "{}: not up in the cluster with {count} Edges within {} s: {cluster}\n\
                     --- edge log (tail) ---\n{}\n--- etcd log (tail) ---\n{}",
                    e.name,
                    EDGES_UP_MS / 1_000,
                    e.proc.log_tail(),
                    etcd.proc.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    let mut rng = SplitMix64::new(opts.seed ^ n as u64);
    let jitter = Jitter::new(opts.jitter_percent).unwrap_or_default();
    let state = Arc::new(SwarmState::new(
        n,
        DialPolicy {
            interval: Duration::from_millis(opts.reconnect_interval_ms),
            jitter,
            heartbeat: None,
        },
    ));
    let node_addrs: Arc<[SocketAddr]> = edges.iter().map(|e| e.nodes).collect();
    let swarm = SwarmThread::start(identities, node_addrs, state.clone(), rng.next_u64())?;

    // Cold: every node dials at once, each in its own order of the Edges.
    eprintln!("swarm cluster: {n} nodes dial");
    let all: Vec<&ClusterEdge> = edges.iter().collect();
    state.take_counters();
    let cpu_before = cpu_of(&all)?;
    let harness_before = procstat::read_cpu_ns(std::process::id())?;
    let dial_ns = monotonic_raw_ns();
    swarm.send(Command::Dial)?;
    let limit_ms = 120_000 + n as u64 * 50;
    while state.ready_count() < n {
        interrupted(stop)?;
        for e in &mut edges {
            e.proc.check_running()?;
        }
        if elapsed_ms(dial_ns) > limit_ms {
            return Err(CompareError::Swarm(format!(
                "cluster cold start: {} of {n} nodes ready after {} s; notes: {:?}",
                state.ready_count(),
                limit_ms / 1_000,
                state.notes()
            )));
        }
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
    let all: Vec<&ClusterEdge> = edges.iter().collect();
    let cpu = Cpu {
        edge_ns: cpu_of(&all)?.saturating_sub(cpu_before),
        harness_ns: procstat::read_cpu_ns(std::process::id())?.saturating_sub(harness_before),
    };
    let cold = phase_figures(n, &state, dial_ns, dial_ns, cpu);
    let per_edge = |state: &SwarmState| {
        let mut counts = vec![0; count];
        for i in (0..n).filter(|&i| state.is_ready(i)) {
            if let Some(t) = state.ready_times(i) {
                counts[t.edge.min(count - 1)] += 1;
            }
        }
        counts
    };
    let before = per_edge(&state);
    eprintln!("swarm cluster: all {n} ready, spread {before:?}; checking /status");
    let checks = settle_ownership(&all, &state, n, &names, "", stop)?;
    if let Some(bad) = checks.iter().find(|c| !c.is_clean()) {
        return Err(CompareError::Swarm(format!(
            "before the kill, /status of {} does not agree with the swarm: {bad:?}",
            bad.edge
        )));
    }
    let mut rss = Vec::with_capacity(count);
    for e in &edges {
        rss.push(procstat::read_rss_kib(e.proc.pid())?);
    }
    let pairs = (opts.probes / 2).max(1) as usize;
    eprintln!("swarm cluster: {pairs} direct/forwarded request pairs");
    let forwarded = measure_forwarding(&swarm, &edges, &state, n, pairs, &mut rng)?;

    // The kill.
    let killed = KILLED;
    let killed_name = names[killed].clone();
    let is_survivor = |i: usize| i != killed;
    let edge_before: Vec<usize> = (0..n)
        .map(|i| state.ready_times(i).map_or(usize::MAX, |t| t.edge))
        .collect();
    let moved = edge_before.iter().filter(|&&e| e == killed).count();
    eprintln!("swarm cluster: SIGKILL {killed_name} ({moved} nodes)");
    state.take_counters();
    let mut survivor_cpu_before = vec![0u64; count];
    for (i, e) in edges.iter().enumerate().filter(|(i, _)| is_survivor(*i)) {
        survivor_cpu_before[i] = procstat::read_cpu_ns(e.proc.pid())?;
    }
    let killed_ns = monotonic_raw_ns();
    edges[killed].proc.kill();

    let rehomed = |state: &SwarmState| {
        state.ready_count() == n
            && (0..n).filter(|&i| edge_before[i] == killed).all(|i| {
                state
                    .ready_times(i)
                    .is_some_and(|t| t.ready_ns > killed_ns && t.edge != killed)
            })
    };
    let mut rehomed_ns: Option<u64> = None;
    let mut survivor_cpu = vec![0u64; count];
    let mut lease_expired_ns: Option<u64> = None;
    let mut lease_polled_ns = 0;
    let limit_ms = 120_000 + n as u64 * 50 + opts.reconnect_interval_ms * 3;
    while rehomed_ns.is_none() || lease_expired_ns.is_none() {
        interrupted(stop)?;
        for (_, e) in edges
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| is_survivor(*i))
        {
            e.proc.check_running()?;
        }
        let now = monotonic_raw_ns();
        if rehomed_ns.is_none() && rehomed(&state) {
            rehomed_ns = Some(now);
            for (i, e) in edges.iter().enumerate().filter(|(i, _)| is_survivor(*i)) {
                survivor_cpu[i] =
                    procstat::read_cpu_ns(e.proc.pid())?.saturating_sub(survivor_cpu_before[i]);
            }
            eprintln!(
                "swarm cluster: {moved} nodes re-homed {} ms after the kill",
                (now - killed_ns) / 1_000_000
            );
        }
        if lease_expired_ns.is_none() && now - lease_polled_ns >= LEASE_POLL_MS * 1_000_000 {
            lease_polled_ns = now;
            if !etcd.live_edges()?.contains(&killed_name) {
                lease_expired_ns = Some(monotonic_raw_ns());
                eprintln!(
                    "swarm cluster: the lease of {killed_name} expired {} ms after the kill",
                    (monotonic_raw_ns() - killed_ns) / 1_000_000
                );
            }
        }
        if elapsed_ms(killed_ns) > limit_ms {
            return Err(CompareError::Swarm(format!(
                "after the kill: re-homed {}, lease expired {} after {} s; ready {} of {n}; notes: {:?}",
                rehomed_ns.is_some(),
                lease_expired_ns.is_some(),
                limit_ms / 1_000,
                state.ready_count(),
                state.notes()
            )));
        }
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
    let counters = state.take_counters();
    let across: Vec<NodeAcrossKill> = (0..n)
        .map(|i| NodeAcrossKill {
            edge_before: edge_before[i],
            ready: state.is_ready(i),
            last: state.ready_times(i),
        })
        .collect();
    let mut rehome = RehomeFigures::of(killed_ns, killed, &across);
    rehome.dials = counters.attempts;
    rehome.failed_dials = counters.failed;
    let rehomed_after_expiry = lease_expired_ns.map(|expired_ns| {
        across
            .iter()
            .filter(|a| a.edge_before == killed)
            .filter(|a| a.last.is_some_and(|t| t.ready_ns > expired_ns))
            .count()
    });

    eprintln!("swarm cluster: checking /status of the surviving Edges");
    let survivors: Vec<&ClusterEdge> = edges
        .iter()
        .enumerate()
        .filter(|(i, _)| is_survivor(*i))
        .map(|(_, e)| e)
        .collect();
    let ownership = settle_ownership(&survivors, &state, n, &names, &killed_name, stop)?;
    let after = per_edge(&state);

    // One request to the pinned model of re-homed nodes, each through
    // the Edge it is on now.
    let moved_nodes: Vec<usize> = (0..n).filter(|&i| edge_before[i] == killed).collect();
    let mut served_after = Vec::new();
    let mut seq = 1_000_000;
    for _ in 0..opts.pinned_probes.min(moved_nodes.len() as u32) {
        let i = moved_nodes[rng.below(moved_nodes.len() as u64) as usize];
        let Some(on) = state.ready_times(i).map(|t| t.edge) else {
            continue;
        };
        seq += 1;
        let probe = Probe {
            seq,
            model: Topology::pinned_model(i),
            expect_node: Some(Topology::node_id(i)),
        };
        served_after.extend(swarm.probe(edges[on].client, vec![probe])?);
    }

    drop(swarm);
    for (_, e) in edges
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| is_survivor(*i))
    {
        e.proc.stop();
    }
    etcd.proc.stop();
    let figures = edges
        .iter()
        .enumerate()
        .map(|(i, e)| EdgeFigures {
            name: e.name.clone(),
            nodes_before: before[i],
            nodes_after: after[i],
            rss_ready_kib: rss[i],
            rehome_cpu_ms: is_survivor(i).then(|| survivor_cpu[i] as f64 / 1e6),
        })
        .collect();
    let ms = |ns: u64| ns.saturating_sub(killed_ns) as f64 / 1e6;
    Ok(ClusterReport {
        nodes: n,
        table,
        edges: figures,
        cold,
        killed: killed_name,
        rehome,
        lease_expired_ms: lease_expired_ns.map(ms),
        rehomed_after_expiry,
        forwarded,
        ownership,
        served_after,
        notes: state.notes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unlabelled_counter_is_read_from_metrics_text() {
        let text = "# HELP iop_edge_cluster_peer_requests_total Inference requests.\n\
                    # TYPE iop_edge_cluster_peer_requests_total counter\n\
                    iop_edge_cluster_peer_requests_total_other 9\n\
                    iop_edge_cluster_forwarded_total{edge=\"edge-b\",outcome=\"ok\"} 4\n\
                    iop_edge_cluster_peer_requests_total 17\n";
        assert_eq!(
            counter_value(text, "iop_edge_cluster_peer_requests_total"),
            Some(17)
        );
        assert_eq!(
            counter_value(text, "iop_edge_cluster_forwarded_total"),
            None
        );
        assert_eq!(counter_value("", "x"), None);
    }
}
