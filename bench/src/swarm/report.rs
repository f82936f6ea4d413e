//! The swarm report: per fleet size, the figures of each phase; Control's
//! decision costs; the tables printed on stdout. Pure: numbers in, text
//! out.

use std::fmt::Write as _;

use serde::Serialize;

use super::client::ProbeOutcome;
use super::node::ReadyTimes;
use super::selection::SelectionFigures;
use super::topology::ClusterTable;
use super::SwarmOptions;
use crate::procstat::{MachineInfo, NofileLimit};
use crate::stats::{LatencyHistogram, LatencySummary};

/// Version of the JSON layout.
pub const SCHEMA: &str = "iop-bench-swarm/1";

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct SwarmReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// When the run ended.
    pub created_unix_ms: i64,
    /// `git rev-parse --short HEAD`, when available.
    pub commit: Option<String>,
    /// The machine.
    pub machine: MachineInfo,
    /// The options, defaults resolved.
    pub options: SwarmOptions,
    /// The open-file limit after raising it (children inherit it).
    pub nofile: Option<NofileLimit>,
    /// The machine's load averages (1/5/15 min) when the run started and
    /// when it ended: the figures of a loaded machine are slower and
    /// noisier, the tails most.
    pub load_average: [Option<[f64; 3]>; 2],
    /// One entry per fleet size (empty with `--selection-only`).
    pub steps: Vec<StepReport>,
    /// Control's decision costs per fleet size (none in a cluster run).
    pub selection: Vec<SelectionFigures>,
    /// The `--cluster` run: the fleet over N Edges, one killed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterReport>,
}

/// Spread of instants relative to a phase's origin, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Spread {
    /// Earliest.
    pub min_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// Latest.
    pub max_ms: f64,
}

impl Spread {
    /// The spread of `offsets_ns` (empty: all zero).
    pub fn of(offsets_ns: &[u64]) -> Self {
        let mut hist = LatencyHistogram::new();
        for &ns in offsets_ns {
            hist.record_ns(ns);
        }
        let s = hist.summary();
        Spread {
            min_ms: s.min_us / 1e3,
            p50_ms: s.p50_us / 1e3,
            max_ms: s.max_us / 1e3,
        }
    }
}

/// Getting every node ready: from a cold Edge start, or after the Edge was
/// killed (SIGKILL) and restarted. For the cold start the origin is the
/// Edge's spawn and the nodes count as dialling the moment it listens
/// (`ready_dials` are then from that moment); for a restart the origin is
/// the SIGKILL.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PhaseFigures {
    /// Origin (Edge spawned, or Edge killed) → the last node ready.
    pub all_ready_ms: f64,
    /// Origin → the Edge printed its `IOP_READY` line (listening).
    pub edge_listening_ms: f64,
    /// When the attempts that got each node ready dialled, from the origin.
    pub ready_dials: Spread,
    /// Dial → ready of each node's successful attempt (TCP connect, TLS
    /// handshake, register, ready): queueing at the Edge shows here.
    pub connect_to_ready: LatencySummary,
    /// Edge CPU from the dials (cold) or the restarted Edge listening
    /// (restart) to the last node ready: handshakes, registrations,
    /// readiness.
    pub edge_cpu_ms: f64,
    /// `edge_cpu_ms` per node.
    pub edge_cpu_per_node_us: f64,
    /// CPU of the harness (the simulated nodes' side of every handshake,
    /// the orchestrator) over the same span: when it nears the span's
    /// length, the harness, not the Edge, set the pace.
    pub harness_cpu_ms: f64,
    /// Attempts started in the phase.
    pub attempts: u64,
    /// Attempts that ended before ready (the Edge not listening yet, a
    /// handshake cut short).
    pub failed_attempts: u64,
}

/// The Edge's CPU with N idle nodes heartbeating.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct HeartbeatFigures {
    /// Length of the measured window.
    pub window_ms: u64,
    /// Heartbeat interval on both sides during it (test-only override).
    pub interval_ms: u64,
    /// Edge CPU in the window.
    pub edge_cpu_us: f64,
    /// Edge CPU of the same window length with no node connected.
    pub idle_cpu_us: f64,
    /// (edge − idle) per node per heartbeat interval: one heartbeat sent,
    /// one answered, two acks handled, the timers.
    pub per_node_interval_us: f64,
    /// That cost at the transport's 30 s interval for N nodes, in percent
    /// of one core.
    pub core_percent_at_30s: f64,
}

impl HeartbeatFigures {
    /// The figures of a window of `window_ms` at `interval_ms` with
    /// `nodes` nodes, from the Edge CPU in it and in an idle window of the
    /// same length.
    pub fn of(
        nodes: usize,
        window_ms: u64,
        interval_ms: u64,
        edge_cpu_us: f64,
        idle_cpu_us: f64,
    ) -> Self {
        let intervals = window_ms as f64 / interval_ms.max(1) as f64;
        let per_node_interval_us =
            ((edge_cpu_us - idle_cpu_us).max(0.0)) / (nodes.max(1) as f64 * intervals);
        HeartbeatFigures {
            window_ms,
            interval_ms,
            edge_cpu_us,
            idle_cpu_us,
            per_node_interval_us,
            core_percent_at_30s: nodes as f64 * per_node_interval_us / 30e6 * 100.0,
        }
    }
}

/// One fleet size.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepReport {
    /// Nodes.
    pub nodes: usize,
    /// Providers in all.
    pub providers: usize,
    /// Edge RSS listening, before any node.
    pub edge_rss_idle_kib: u64,
    /// Edge RSS with every node ready and idle.
    pub edge_rss_ready_kib: u64,
    /// (ready − idle) / nodes.
    pub rss_per_node_bytes: f64,
    /// Cold start (origin: Edge spawned; every node dials at once).
    pub cold: PhaseFigures,
    /// Providers `/status` showed connected once every node was ready.
    pub status_connected_providers: usize,
    /// Providers `/status` listed.
    pub status_providers: usize,
    /// Dispatch latency of the probes to pooled models: request written →
    /// tunnel request read by the node.
    pub dispatch: LatencySummary,
    /// Their round trip: request written → answer read.
    pub round_trip: LatencySummary,
    /// Pooled probes answered by a node.
    pub probes_ok: u64,
    /// Pooled probes that failed.
    pub probes_failed: u64,
    /// Distinct nodes that served pooled probes.
    pub nodes_served: usize,
    /// Every probe to a pinned model (random nodes and `--pin-node`).
    pub pinned: Vec<ProbeOutcome>,
    /// Kill + restart with the jitter on.
    pub recovery_jitter: PhaseFigures,
    /// Kill + restart with no jitter (every node redials at once).
    pub recovery_no_jitter: PhaseFigures,
    /// Heartbeat CPU at N idle nodes.
    pub heartbeat: HeartbeatFigures,
    /// Problems the nodes noted (refusals, failed handshakes), first few.
    pub notes: Vec<String>,
    /// The first failed pooled probes.
    pub probe_errors: Vec<String>,
}

/// A `--cluster` run: N Edges of one cluster over one etcd, the whole
/// fleet spread over them, then one Edge killed with SIGKILL.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterReport {
    /// Nodes in the fleet (every Edge is configured with all of them).
    pub nodes: usize,
    /// The `[cluster]` table every Edge had.
    pub table: ClusterTable,
    /// Every Edge, in the order the nodes' lists name them.
    pub edges: Vec<EdgeFigures>,
    /// Every node dialling at once (a fresh shuffle of the Edges each)
    /// until all are ready; origin: the dials (every Edge held its etcd
    /// lease by then). CPU is that of all Edges together.
    pub cold: PhaseFigures,
    /// The Edge killed (the first).
    pub killed: String,
    /// Its nodes finding the other Edges.
    pub rehome: RehomeFigures,
    /// Kill → etcd no longer holding the killed Edge's edge key: its lease
    /// expired (polled every 50 ms); `None` if that was not seen.
    pub lease_expired_ms: Option<f64>,
    /// Of the killed Edge's nodes, those ready on a surviving Edge only
    /// after its lease expired (until then their owner keys still named
    /// the dead Edge; the expiry deleted them).
    pub rehomed_after_expiry: Option<usize>,
    /// With all Edges up: requests sent to the Edge owning their node
    /// against requests sent to another Edge, which forwards them.
    pub forwarded: ForwardedFigures,
    /// Each surviving Edge's `/status` after the re-homing and the lease
    /// expiry: who owns which node.
    pub ownership: Vec<OwnershipCheck>,
    /// Requests to the pinned models of re-homed nodes, each sent to the
    /// Edge the node is on now: each must be served by its node.
    pub served_after: Vec<ProbeOutcome>,
    /// Problems the nodes noted (refusals, failed handshakes), first few.
    pub notes: Vec<String>,
}

/// Latencies of one path, in microseconds (nearest rank).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest.
    pub max_us: f64,
}

impl Percentiles {
    /// The percentiles of `ns` (sorted here).
    pub fn of(mut ns: Vec<u64>) -> Self {
        ns.sort_unstable();
        let us = |v: u64| v as f64 / 1e3;
        Percentiles {
            count: ns.len(),
            p50_us: us(nearest_rank(&ns, 50.0)),
            p99_us: us(nearest_rank(&ns, 99.0)),
            max_us: us(ns.last().copied().unwrap_or(0)),
        }
    }
}

/// Requests for the pinned model of a random node, in pairs: one sent to
/// the Edge that owns the node (direct), then one to another Edge, which
/// forwards it over its peer link to the owner (forwarded). Each must be
/// answered by that node.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ForwardedFigures {
    /// Pairs sent (after one unmeasured warm-up request per pair of Edges,
    /// which opens the peer connections).
    pub pairs: usize,
    /// Pairs in which both requests were answered by their node (the
    /// figures below are theirs).
    pub pairs_ok: usize,
    /// Dispatch latency (client request written → tunnel request read by
    /// the node), direct.
    pub direct_dispatch: Percentiles,
    /// The same, forwarded.
    pub forwarded_dispatch: Percentiles,
    /// Round trip (request written → answer read), direct.
    pub direct_round_trip: Percentiles,
    /// The same, forwarded.
    pub forwarded_round_trip: Percentiles,
    /// What forwarding adds to the dispatch latency: forwarded − direct,
    /// at the median, µs.
    pub added_dispatch_p50_us: f64,
    /// At the 99th percentile.
    pub added_dispatch_p99_us: f64,
    /// What it adds to the round trip, at the median.
    pub added_round_trip_p50_us: f64,
    /// At the 99th percentile.
    pub added_round_trip_p99_us: f64,
    /// The first failed requests.
    pub errors: Vec<String>,
    /// Forwarded requests the owning Edges counted from their peers while
    /// the pairs ran (`iop_edge_cluster_peer_requests_total`, summed over
    /// the Edges): `pairs` when every forwarded request took the peer path.
    /// `None` when an Edge's `/metrics` did not show the counter (edge-bin
    /// cuts its exposition at 20,000 lines). A forwarded request answered
    /// by its node is proof enough on its own: the entry Edge has no
    /// session with that node.
    pub peer_requests: Option<u64>,
}

/// Failed requests kept in [`ForwardedFigures::errors`].
const MAX_FORWARD_ERRORS: usize = 5;

impl ForwardedFigures {
    /// The figures of `pairs` (direct, forwarded), with `peer_requests`
    /// counted by the owning Edges meanwhile.
    pub fn of(pairs: &[(ProbeOutcome, ProbeOutcome)], peer_requests: Option<u64>) -> Self {
        let mut dispatch = (Vec::new(), Vec::new());
        let mut round_trip = (Vec::new(), Vec::new());
        let mut errors = Vec::new();
        for (direct, forwarded) in pairs {
            let bad: Vec<&ProbeOutcome> = [direct, forwarded]
                .into_iter()
                .filter(|p| !p.is_ok() || p.dispatch_ns.is_none())
                .collect();
            if !bad.is_empty() {
                for p in bad {
                    if errors.len() < MAX_FORWARD_ERRORS {
                        errors.push(format!(
                            "{} (for {}): served by {:?}, error {:?}",
                            p.model,
                            p.expect_node.as_deref().unwrap_or("?"),
                            p.served_by,
                            p.error
                        ));
                    }
                }
                continue;
            }
            dispatch.0.push(direct.dispatch_ns.unwrap_or(0));
            dispatch.1.push(forwarded.dispatch_ns.unwrap_or(0));
            round_trip.0.push(direct.round_trip_ns);
            round_trip.1.push(forwarded.round_trip_ns);
        }
        let pairs_ok = dispatch.0.len();
        let (direct_dispatch, forwarded_dispatch) =
            (Percentiles::of(dispatch.0), Percentiles::of(dispatch.1));
        let (direct_round_trip, forwarded_round_trip) =
            (Percentiles::of(round_trip.0), Percentiles::of(round_trip.1));
        ForwardedFigures {
            pairs: pairs.len(),
            pairs_ok,
            added_dispatch_p50_us: forwarded_dispatch.p50_us - direct_dispatch.p50_us,
            added_dispatch_p99_us: forwarded_dispatch.p99_us - direct_dispatch.p99_us,
            added_round_trip_p50_us: forwarded_round_trip.p50_us - direct_round_trip.p50_us,
            added_round_trip_p99_us: forwarded_round_trip.p99_us - direct_round_trip.p99_us,
            direct_dispatch,
            forwarded_dispatch,
            direct_round_trip,
            forwarded_round_trip,
            errors,
            peer_requests,
        }
    }
}

/// One Edge of a cluster run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EdgeFigures {
    /// Its name (and certificate).
    pub name: String,
    /// Nodes ready on it once the whole fleet was.
    pub nodes_before: usize,
    /// Nodes ready on it once the killed Edge's nodes were re-homed.
    pub nodes_after: usize,
    /// RSS with its share of the fleet ready.
    pub rss_ready_kib: u64,
    /// CPU from the kill to the last node re-homed (`None` for the
    /// killed one).
    pub rehome_cpu_ms: Option<f64>,
}

/// How the killed Edge's nodes came back, from the kill (SIGKILL).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RehomeFigures {
    /// Nodes that were on the killed Edge (they had to move).
    pub moved: usize,
    /// Of those, ready again on a surviving Edge.
    pub rehomed: usize,
    /// Kill → the last of them ready on a surviving Edge (0 if none had
    /// to move): every node of the fleet ready again.
    pub all_ready_ms: f64,
    /// Per re-homed node, kill → ready on a surviving Edge: the earliest,
    /// median (nearest rank), 99th percentile and latest.
    pub min_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Latest (= `all_ready_ms` once all re-homed).
    pub max_ms: f64,
    /// Per re-homed node, its successful dial → ready on the surviving
    /// Edge (TCP connect, TLS, register with its etcd claim, ready):
    /// median and 99th percentile (nearest rank). The rest of the re-home
    /// time is the reconnect wait and a refused dial to the dead Edge.
    pub dial_to_ready_p50_ms: f64,
    /// 99th percentile.
    pub dial_to_ready_p99_ms: f64,
    /// Nodes of the surviving Edges that had a new session after the kill
    /// (an Edge that dies should cost its own nodes only: 0).
    pub disturbed: usize,
    /// Dials in the re-homing (one per Edge address tried).
    pub dials: u64,
    /// Of those, dials that gave no ready session (the dead Edge's address
    /// refuses).
    pub failed_dials: u64,
}

/// One node around the kill: the Edge it was ready on before, and its
/// last ready session now (if it has one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeAcrossKill {
    /// Its Edge before the kill.
    pub edge_before: usize,
    /// Whether it has a ready session now.
    pub ready: bool,
    /// Its last ready session.
    pub last: Option<ReadyTimes>,
}

/// The value at nearest rank `percent` of sorted `values` (0 if empty).
pub fn nearest_rank(sorted: &[u64], percent: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (percent / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl RehomeFigures {
    /// The figures of the fleet `nodes` after Edge `killed` was killed at
    /// `killed_ns`: a node of the killed Edge counts as re-homed when it
    /// is ready on another Edge in a session that began after the kill.
    pub fn of(killed_ns: u64, killed: usize, nodes: &[NodeAcrossKill]) -> Self {
        let mut times: Vec<u64> = Vec::new();
        let mut dial_to_ready: Vec<u64> = Vec::new();
        let mut moved = 0;
        let mut disturbed = 0;
        for node in nodes {
            let after_kill = node
                .last
                .filter(|t| node.ready && t.ready_ns > killed_ns && t.edge != killed);
            if node.edge_before == killed {
                moved += 1;
                if let Some(t) = after_kill {
                    times.push(t.ready_ns - killed_ns);
                    dial_to_ready.push(t.ready_ns.saturating_sub(t.dialled_ns));
                }
            } else if node.last.is_some_and(|t| t.ready_ns > killed_ns) {
                disturbed += 1;
            }
        }
        times.sort_unstable();
        dial_to_ready.sort_unstable();
        let ms = |ns: u64| ns as f64 / 1e6;
        let max_ms = ms(times.last().copied().unwrap_or(0));
        RehomeFigures {
            moved,
            rehomed: times.len(),
            all_ready_ms: max_ms,
            min_ms: ms(times.first().copied().unwrap_or(0)),
            p50_ms: ms(nearest_rank(&times, 50.0)),
            p99_ms: ms(nearest_rank(&times, 99.0)),
            max_ms,
            dial_to_ready_p50_ms: ms(nearest_rank(&dial_to_ready, 50.0)),
            dial_to_ready_p99_ms: ms(nearest_rank(&dial_to_ready, 99.0)),
            disturbed,
            dials: 0,
            failed_dials: 0,
        }
    }
}

/// One surviving Edge's `/status` `cluster` object against the fleet.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OwnershipCheck {
    /// The Edge whose `/status` it is.
    pub edge: String,
    /// The cluster's Edges it lists (holding their etcd lease).
    pub live_edges: Vec<String>,
    /// Whether the killed Edge is among them.
    pub lists_killed: bool,
    /// Fleet nodes it shows an owner for.
    pub owned: usize,
    /// Of those, owned by the killed Edge.
    pub by_killed: usize,
    /// Owned by an Edge it does not list as live.
    pub by_unlisted: usize,
    /// Owned by another Edge than the one the node's ready session is on.
    pub mismatched: usize,
    /// Fleet nodes with no owner shown.
    pub unowned: usize,
}

impl OwnershipCheck {
    /// Reads the `cluster` object of `status` (a `/status` document of
    /// Edge `edge`) against `expected` (each fleet node's id and the name
    /// of the Edge its ready session is on), `killed` naming the dead Edge.
    pub fn of(
        edge: &str,
        status: &serde_json::Value,
        killed: &str,
        expected: &[(String, String)],
    ) -> Result<Self, String> {
        let cluster = status
            .get("cluster")
            .ok_or_else(|| format!("{edge}: /status has no cluster object"))?;
        let live_edges: Vec<String> = cluster["edges"]
            .as_array()
            .ok_or_else(|| format!("{edge}: /status cluster.edges is not a list"))?
            .iter()
            .filter_map(|e| e.as_str().map(str::to_string))
            .collect();
        let owners: std::collections::HashMap<&str, &str> = cluster["nodes"]
            .as_array()
            .ok_or_else(|| format!("{edge}: /status cluster.nodes is not a list"))?
            .iter()
            .filter_map(|n| Some((n["node_id"].as_str()?, n["edge"].as_str()?)))
            .collect();
        let mut check = OwnershipCheck {
            edge: edge.to_string(),
            lists_killed: live_edges.iter().any(|e| e == killed),
            ..Default::default()
        };
        for (node, on) in expected {
            let Some(&owner) = owners.get(node.as_str()) else {
                check.unowned += 1;
                continue;
            };
            check.owned += 1;
            if owner == killed {
                check.by_killed += 1;
            }
            if !live_edges.iter().any(|e| e == owner) {
                check.by_unlisted += 1;
            }
            if owner != on {
                check.mismatched += 1;
            }
        }
        check.live_edges = live_edges;
        Ok(check)
    }

    /// Whether every fleet node is owned by a live Edge, the one it is on,
    /// and the killed Edge is gone from the list.
    pub fn is_clean(&self) -> bool {
        !self.lists_killed
            && self.unowned == 0
            && self.by_killed == 0
            && self.by_unlisted == 0
            && self.mismatched == 0
    }
}

impl ClusterReport {
    /// What makes a cluster run a failure.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let f = &self.forwarded;
        if f.pairs_ok != f.pairs {
            problems.push(format!(
                "cluster: {} of {} direct/forwarded request pairs failed: {:?}",
                f.pairs - f.pairs_ok,
                f.pairs,
                f.errors
            ));
        }
        if let Some(counted) = f.peer_requests.filter(|&c| c != f.pairs as u64) {
            problems.push(format!(
                "cluster: {} requests were sent to an Edge not owning their node, and the owning \
                 Edges counted {counted} from their peers",
                f.pairs
            ));
        }
        let r = &self.rehome;
        if r.rehomed != r.moved {
            problems.push(format!(
                "cluster: {} of the {} nodes of {} re-homed",
                r.rehomed, r.moved, self.killed
            ));
        }
        if r.disturbed > 0 {
            problems.push(format!(
                "cluster: {} nodes of the surviving Edges lost their session when {} died",
                r.disturbed, self.killed
            ));
        }
        if self.lease_expired_ms.is_none() {
            problems.push(format!(
                "cluster: the etcd lease of {} was not seen to expire",
                self.killed
            ));
        }
        for c in self.ownership.iter().filter(|c| !c.is_clean()) {
            problems.push(format!(
                "cluster: /status of {} after the re-homing: {c:?}",
                c.edge
            ));
        }
        for p in self.served_after.iter().filter(|p| !p.is_ok()) {
            problems.push(format!(
                "cluster: the request to {} was not served by {}: served by {:?}, error {:?}",
                p.model,
                p.expect_node.as_deref().unwrap_or("?"),
                p.served_by,
                p.error
            ));
        }
        problems
    }
}

impl SwarmReport {
    /// What makes the run a failure: a probe not served (by the node it
    /// was meant for), or `/status` not showing every provider connected.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for step in &self.steps {
            let n = step.nodes;
            if step.status_connected_providers != step.providers
                || step.status_providers != step.providers
            {
                problems.push(format!(
                    "{n} nodes: /status showed {} of {} providers connected ({} listed)",
                    step.status_connected_providers, step.providers, step.status_providers
                ));
            }
            if step.probes_failed > 0 {
                problems.push(format!(
                    "{n} nodes: {} pooled probes failed: {:?}",
                    step.probes_failed, step.probe_errors
                ));
            }
            for p in step.pinned.iter().filter(|p| !p.is_ok()) {
                problems.push(format!(
                    "{n} nodes: the request to {} was not served by {}: served by {:?}, error {:?}",
                    p.model,
                    p.expect_node.as_deref().unwrap_or("?"),
                    p.served_by,
                    p.error
                ));
            }
        }
        if let Some(cluster) = &self.cluster {
            problems.extend(cluster.problems());
        }
        problems
    }
}

fn ms(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.1} s", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0} ms")
    } else {
        format!("{v:.1} ms")
    }
}

fn us(v: f64) -> String {
    if v >= 1_000.0 {
        format!("{:.2} ms", v / 1e3)
    } else {
        format!("{v:.0} µs")
    }
}

/// A difference in µs, with its sign (`+148 µs`, `−126 µs`).
fn signed_us(v: f64) -> String {
    let sign = if v < 0.0 { "−" } else { "+" };
    format!("{sign}{}", us(v.abs()))
}

fn ns(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} ms", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} µs", v / 1e3)
    } else {
        format!("{v:.0} ns")
    }
}

fn render_cluster(t: &mut String, c: &ClusterReport) {
    let _ = writeln!(
        t,
        "\ncluster \"{}\": {} Edges, {} nodes, etcd lease {} s (keep-alive {} s)",
        c.table.name,
        c.edges.len(),
        c.nodes,
        c.table.lease_ttl_sec,
        c.table.keepalive_interval_sec
    );
    let _ = writeln!(
        t,
        "{:>8}  {:>12}  {:>12}  {:>10}  {:>13}",
        "edge", "nodes before", "nodes after", "RSS", "re-home CPU"
    );
    for e in &c.edges {
        let _ = writeln!(
            t,
            "{:>8}  {:>12}  {:>12}  {:>10}  {:>13}",
            e.name,
            e.nodes_before,
            e.nodes_after,
            format!("{:.1} MiB", e.rss_ready_kib as f64 / 1024.0),
            e.rehome_cpu_ms.map_or("killed".to_string(), ms)
        );
    }
    let _ = writeln!(
        t,
        "cold: all {} ready {} after the dials (dial→ready p50 {}, p99 {})",
        c.nodes,
        ms(c.cold.all_ready_ms),
        us(c.cold.connect_to_ready.p50_us),
        us(c.cold.connect_to_ready.p99_us)
    );
    let f = &c.forwarded;
    let _ = writeln!(
        t,
        "forwarded: {} of {} pairs ok (owning Edges' peer-request count: {}); dispatch direct p50 {} \
         p99 {}, forwarded p50 {} p99 {}: {} at p50, {} at p99; round trip direct p50 {} p99 {}, \
         forwarded p50 {} p99 {}: {} at p50, {} at p99",
        f.pairs_ok,
        f.pairs,
        f.peer_requests
            .map_or("not in /metrics".to_string(), |n| n.to_string()),
        us(f.direct_dispatch.p50_us),
        us(f.direct_dispatch.p99_us),
        us(f.forwarded_dispatch.p50_us),
        us(f.forwarded_dispatch.p99_us),
        signed_us(f.added_dispatch_p50_us),
        signed_us(f.added_dispatch_p99_us),
        us(f.direct_round_trip.p50_us),
        us(f.direct_round_trip.p99_us),
        us(f.forwarded_round_trip.p50_us),
        us(f.forwarded_round_trip.p99_us),
        signed_us(f.added_round_trip_p50_us),
        signed_us(f.added_round_trip_p99_us),
    );
    let r = &c.rehome;
    let _ = writeln!(
        t,
        "{} killed: {} of its {} nodes re-homed; every node ready again {} after the kill; \
         per node p50 {}, p99 {}, max {} (first {}; dial→ready p50 {}, p99 {}); \
         {} nodes of other Edges disturbed; {} dials, {} failed",
        c.killed,
        r.rehomed,
        r.moved,
        ms(r.all_ready_ms),
        ms(r.p50_ms),
        ms(r.p99_ms),
        ms(r.max_ms),
        ms(r.min_ms),
        ms(r.dial_to_ready_p50_ms),
        ms(r.dial_to_ready_p99_ms),
        r.disturbed,
        r.dials,
        r.failed_dials
    );
    let _ = writeln!(
        t,
        "its etcd lease expired {} after the kill ({} of its nodes re-homed after that)",
        c.lease_expired_ms.map_or("(not seen)".to_string(), ms),
        c.rehomed_after_expiry
            .map_or("?".to_string(), |n| n.to_string())
    );
    for o in &c.ownership {
        let _ = writeln!(
            t,
            "/status of {}: Edges {:?}; {} nodes owned ({} by {}, {} by an unlisted Edge, {} not where \
             their session is, {} unowned)",
            o.edge, o.live_edges, o.owned, o.by_killed, c.killed, o.by_unlisted, o.mismatched, o.unowned
        );
    }
    let served = c.served_after.iter().filter(|p| p.is_ok()).count();
    let _ = writeln!(
        t,
        "{served} of {} requests to re-homed nodes served by their node through its new Edge",
        c.served_after.len()
    );
    for note in &c.notes {
        let _ = writeln!(t, "note: {note}");
    }
}

/// The tables printed on stdout.
pub fn render(report: &SwarmReport) -> String {
    let o = &report.options;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "swarm: {} providers per node, capacity {}, edge --cores {}, reconnect {} ms ± {} %, seed {}",
        o.providers_per_node, o.capacity, o.edge_cores, o.reconnect_interval_ms, o.jitter_percent, o.seed
    );
    let load = |l: Option<[f64; 3]>| l.map_or("?".to_string(), |l| format!("{:.1}", l[0]));
    let _ = writeln!(
        t,
        "machine: {} CPUs, load average {} at the start, {} at the end",
        report.machine.nproc,
        load(report.load_average[0]),
        load(report.load_average[1])
    );
    if !report.steps.is_empty() {
        let _ = writeln!(
            t,
            "\n{:>6}  {:>10}  {:>11}  {:>13}  {:>13}  {:>15}  {:>15}  {:>13}",
            "nodes",
            "RSS/node",
            "cold ready",
            "recover ±jit",
            "recover 0 jit",
            "dispatch p50",
            "dispatch p99",
            "hb CPU @30s"
        );
        for s in &report.steps {
            let _ = writeln!(
                t,
                "{:>6}  {:>10}  {:>11}  {:>13}  {:>13}  {:>15}  {:>15}  {:>12.3}%",
                s.nodes,
                format!("{:.1} KiB", s.rss_per_node_bytes / 1024.0),
                ms(s.cold.all_ready_ms),
                ms(s.recovery_jitter.all_ready_ms),
                ms(s.recovery_no_jitter.all_ready_ms),
                us(s.dispatch.p50_us),
                us(s.dispatch.p99_us),
                s.heartbeat.core_percent_at_30s,
            );
        }
        let _ = writeln!(
            t,
            "\n{:>6}  {:>13}  {:>13}  {:>13}  {:>13}  {:>13}  {:>11}",
            "nodes", "dial→ready", "±jit", "0 jit", "redials ±jit", "CPU/register", "hb CPU/node"
        );
        let _ = writeln!(
            t,
            "{:>6}  {:>13}  {:>13}  {:>13}  {:>13}  {:>13}  {:>11}",
            "", "p99 cold", "p99", "p99", "after kill", "(cold)", "/interval"
        );
        for s in &report.steps {
            let _ = writeln!(
                t,
                "{:>6}  {:>13}  {:>13}  {:>13}  {:>13}  {:>13}  {:>11}",
                s.nodes,
                us(s.cold.connect_to_ready.p99_us),
                us(s.recovery_jitter.connect_to_ready.p99_us),
                us(s.recovery_no_jitter.connect_to_ready.p99_us),
                format!(
                    "{}–{}",
                    ms(s.recovery_jitter.ready_dials.min_ms),
                    ms(s.recovery_jitter.ready_dials.max_ms)
                ),
                us(s.cold.edge_cpu_per_node_us),
                us(s.heartbeat.per_node_interval_us),
            );
        }
        for s in &report.steps {
            let pinned_ok = s.pinned.iter().filter(|p| p.is_ok()).count();
            let _ = writeln!(
                t,
                "{} nodes: {} pooled probes ok ({} failed), served by {} distinct nodes; {} of {} pinned probes \
                 served by their node; /status {} of {} providers connected",
                s.nodes,
                s.probes_ok,
                s.probes_failed,
                s.nodes_served,
                pinned_ok,
                s.pinned.len(),
                s.status_connected_providers,
                s.providers
            );
        }
    }
    if let Some(c) = &report.cluster {
        render_cluster(&mut t, c);
    }
    if !report.selection.is_empty() {
        let _ = writeln!(
            t,
            "\nControl decisions (in process, one core):\n{:>6}  {:>9}  {:>14}  {:>10}  {:>12}  {:>12}  {:>10}  {:>10}",
            "nodes", "providers", "register+ready", "admit", "poll_timeout", "pump", "snapshot", "fence"
        );
        for f in &report.selection {
            let _ = writeln!(
                t,
                "{:>6}  {:>9}  {:>14}  {:>10}  {:>12}  {:>12}  {:>10}  {:>10}",
                f.nodes,
                f.providers,
                ns(f.register_ready_ns),
                ns(f.admit_ns),
                ns(f.poll_timeout_ns),
                ns(f.pump_ns),
                ns(f.snapshot_ns),
                ns(f.fence_ns),
            );
        }
        if let Some(f) = report.selection.first() {
            let _ = writeln!(
                t,
                "(admit: submit + terminal with every candidate idle; pump: terminal admitting the head of {} queued + the refilling submit)",
                f.queued
            );
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_cost_is_per_node_and_interval() {
        // 1,000 nodes, 5 s at 1 s: 5,000 node-intervals; 60 ms over idle.
        let h = HeartbeatFigures::of(1_000, 5_000, 1_000, 70_000.0, 10_000.0);
        assert_eq!(h.per_node_interval_us, 12.0);
        // 1,000 × 12 µs every 30 s = 0.04 % of a core.
        assert!((h.core_percent_at_30s - 0.04).abs() < 1e-12, "{h:?}");
        // Less than idle is noise, not a negative cost.
        assert_eq!(
            HeartbeatFigures::of(10, 1_000, 1_000, 5.0, 9.0).per_node_interval_us,
            0.0
        );
    }

    #[test]
    fn spreads_are_in_milliseconds() {
        let s = Spread::of(&[500_000_000, 1_000_000_000, 1_500_000_000]);
        assert!((s.min_ms - 500.0).abs() < 1.0, "{s:?}");
        assert!((s.p50_ms - 1_000.0).abs() < 1.0, "{s:?}");
        assert!((s.max_ms - 1_500.0).abs() < 2.0, "{s:?}");
        assert_eq!(Spread::of(&[]), Spread::default());
    }

    /// A session on `edge`, ready at `ready_ns`, its dial 5 ms before.
    fn on(edge: usize, ready_ns: u64) -> Option<ReadyTimes> {
        dialled(edge, ready_ns, 5_000_000)
    }

    fn dialled(edge: usize, ready_ns: u64, dial_to_ready_ns: u64) -> Option<ReadyTimes> {
        Some(ReadyTimes {
            dialled_ns: ready_ns - dial_to_ready_ns,
            ready_ns,
            edge,
        })
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(nearest_rank(&v, 50.0), 50);
        assert_eq!(nearest_rank(&v, 99.0), 99);
        assert_eq!(nearest_rank(&v, 100.0), 100);
        assert_eq!(nearest_rank(&v, 0.0), 1);
        assert_eq!(nearest_rank(&[7], 99.0), 7);
        assert_eq!(nearest_rank(&[1, 2, 3], 50.0), 2);
        assert_eq!(nearest_rank(&[], 50.0), 0);
    }

    #[test]
    fn rehoming_counts_the_killed_edges_nodes_from_the_kill() {
        const KILL: u64 = 1_000_000_000;
        let node = |edge_before, ready, last| NodeAcrossKill {
            edge_before,
            ready,
            last,
        };
        let nodes = [
            // On the killed Edge 0, back on 1 and 2 after 2, 4 and 6 s.
            node(0, true, dialled(1, KILL + 2_000_000_000, 30_000_000)),
            node(0, true, dialled(2, KILL + 6_000_000_000, 10_000_000)),
            node(0, true, dialled(2, KILL + 4_000_000_000, 20_000_000)),
            // Still shown on Edge 0 by a session from before the kill.
            node(0, true, on(0, KILL - 5)),
            // Ready on Edge 1 after the kill but down again: not re-homed.
            node(0, false, on(1, KILL + 1_000_000_000)),
            // Untouched nodes of the survivors.
            node(1, true, on(1, KILL - 10)),
            node(2, true, on(2, KILL - 20)),
            // A survivor's node that had to reconnect.
            node(2, true, on(2, KILL + 3_000_000_000)),
        ];
        let r = RehomeFigures::of(KILL, 0, &nodes);
        assert_eq!(
            r,
            RehomeFigures {
                moved: 5,
                rehomed: 3,
                all_ready_ms: 6_000.0,
                min_ms: 2_000.0,
                p50_ms: 4_000.0,
                p99_ms: 6_000.0,
                max_ms: 6_000.0,
                dial_to_ready_p50_ms: 20.0,
                dial_to_ready_p99_ms: 30.0,
                disturbed: 1,
                dials: 0,
                failed_dials: 0,
            }
        );
        assert_eq!(
            RehomeFigures::of(KILL, 0, &nodes[5..7]),
            RehomeFigures::default()
        );
    }

    #[test]
    fn forwarding_adds_the_difference_of_percentiles_of_matched_ok_pairs() {
        let probe =
            |node: &str, served: Option<&str>, dispatch_us: u64, round_trip_us: u64| ProbeOutcome {
                seq: 0,
                model: format!("swarm-{node}"),
                expect_node: Some(node.into()),
                served_by: served.map(str::to_string),
                dispatch_ns: Some(dispatch_us * 1_000),
                round_trip_ns: round_trip_us * 1_000,
                error: None,
            };
        let ok = |d: u64, f: u64| {
            (
                probe("n00001", Some("n00001"), d, 2 * d),
                probe("n00001", Some("n00001"), f, 3 * f),
            )
        };
        let mut pairs = vec![ok(100, 250), ok(300, 400), ok(200, 500)];
        // A forwarded request answered by another node: the pair is left
        // out of both sides.
        pairs.push((
            probe("n00002", Some("n00002"), 1, 1),
            probe("n00002", Some("n00009"), 9_999, 9_999),
        ));
        let f = ForwardedFigures::of(&pairs, Some(4));
        assert_eq!((f.pairs, f.pairs_ok, f.peer_requests), (4, 3, Some(4)));
        assert_eq!(
            f.direct_dispatch,
            Percentiles {
                count: 3,
                p50_us: 200.0,
                p99_us: 300.0,
                max_us: 300.0
            }
        );
        assert_eq!(
            (f.forwarded_dispatch.p50_us, f.forwarded_dispatch.p99_us),
            (400.0, 500.0)
        );
        assert_eq!(
            (f.added_dispatch_p50_us, f.added_dispatch_p99_us),
            (200.0, 200.0)
        );
        // Round trips: direct 200/400/600, forwarded 750/1200/1500.
        assert_eq!(
            (f.added_round_trip_p50_us, f.added_round_trip_p99_us),
            (800.0, 900.0)
        );
        assert_eq!(
            f.errors,
            ["swarm-n00002 (for n00002): served by Some(\"n00009\"), error None".to_string()]
        );
        assert_eq!(ForwardedFigures::of(&[], None), ForwardedFigures::default());
        assert_eq!(
            (signed_us(-126.4), signed_us(148.0)),
            ("−126 µs".to_string(), "+148 µs".to_string())
        );
    }

    fn cluster_status(edges: &[&str], owners: &[(&str, &str)]) -> serde_json::Value {
        serde_json::json!({
            "providers": [],
            "cluster": {
                "name": "swarm",
                "edge": "edge-b",
                "up": true,
                "edges": edges,
                "nodes": owners
                    .iter()
                    .map(|(n, e)| serde_json::json!({"node_id": n, "edge": e}))
                    .collect::<Vec<_>>(),
            }
        })
    }

    #[test]
    fn ownership_is_checked_against_the_live_edges_and_the_swarm() {
        let expected: Vec<(String, String)> = [
            ("n00000", "edge-b"),
            ("n00001", "edge-c"),
            ("n00002", "edge-b"),
            ("n00003", "edge-c"),
        ]
        .iter()
        .map(|(n, e)| (n.to_string(), e.to_string()))
        .collect();
        let clean = cluster_status(
            &["edge-b", "edge-c"],
            &[
                ("n00000", "edge-b"),
                ("n00001", "edge-c"),
                ("n00002", "edge-b"),
                ("n00003", "edge-c"),
                // Not a fleet node: not counted.
                ("x", "edge-a"),
            ],
        );
        let check = OwnershipCheck::of("edge-b", &clean, "edge-a", &expected).unwrap();
        assert_eq!(
            check,
            OwnershipCheck {
                edge: "edge-b".into(),
                live_edges: vec!["edge-b".into(), "edge-c".into()],
                lists_killed: false,
                owned: 4,
                by_killed: 0,
                by_unlisted: 0,
                mismatched: 0,
                unowned: 0,
            }
        );
        assert!(check.is_clean());

        // The killed Edge still listed and owning a node, another node
        // shown on the wrong Edge, one with no owner.
        let stale = cluster_status(
            &["edge-a", "edge-b", "edge-c"],
            &[
                ("n00000", "edge-a"),
                ("n00001", "edge-b"),
                ("n00002", "edge-b"),
            ],
        );
        let check = OwnershipCheck::of("edge-c", &stale, "edge-a", &expected).unwrap();
        assert_eq!(
            (
                check.lists_killed,
                check.owned,
                check.by_killed,
                check.by_unlisted,
                check.mismatched,
                check.unowned
            ),
            (true, 3, 1, 0, 2, 1)
        );
        assert!(!check.is_clean());
        // Owned by an Edge the list no longer has.
        let gone = cluster_status(&["edge-b", "edge-c"], &[("n00000", "edge-a")]);
        let check = OwnershipCheck::of("edge-b", &gone, "edge-a", &expected[..1]).unwrap();
        assert_eq!(
            (check.by_killed, check.by_unlisted, check.mismatched),
            (1, 1, 1)
        );
        // Before any kill (no killed name), a clean fleet is clean.
        let check = OwnershipCheck::of("edge-b", &clean, "", &expected).unwrap();
        assert!(check.is_clean(), "{check:?}");

        assert_eq!(
            OwnershipCheck::of(
                "edge-b",
                &serde_json::json!({"providers": []}),
                "edge-a",
                &expected
            ),
            Err("edge-b: /status has no cluster object".to_string())
        );
    }

    #[test]
    fn a_cluster_run_fails_on_unhomed_disturbed_or_misowned_nodes() {
        let mut report = ClusterReport {
            nodes: 3,
            table: ClusterTable {
                name: "swarm".into(),
                etcd_endpoints: vec!["127.0.0.1:2379".into()],
                lease_ttl_sec: 4,
                keepalive_interval_sec: 1,
                peer_listen: None,
            },
            edges: Vec::new(),
            cold: PhaseFigures::default(),
            killed: "edge-a".into(),
            rehome: RehomeFigures {
                moved: 2,
                rehomed: 2,
                ..Default::default()
            },
            lease_expired_ms: Some(3_500.0),
            rehomed_after_expiry: Some(0),
            forwarded: ForwardedFigures::default(),
            ownership: vec![OwnershipCheck {
                edge: "edge-b".into(),
                owned: 3,
                ..Default::default()
            }],
            served_after: Vec::new(),
            notes: Vec::new(),
        };
        assert_eq!(report.problems(), Vec::<String>::new());
        report.forwarded.pairs = 2;
        report.forwarded.pairs_ok = 2;
        report.forwarded.peer_requests = Some(1);
        assert_eq!(
            report.problems(),
            [
                "cluster: 2 requests were sent to an Edge not owning their node, and the owning \
              Edges counted 1 from their peers"
                    .to_string()
            ]
        );
        // Not readable: no problem of its own (the answers prove the path).
        report.forwarded.peer_requests = None;
        assert_eq!(report.problems(), Vec::<String>::new());
        report.forwarded.peer_requests = Some(2);
        report.rehome.rehomed = 1;
        report.rehome.disturbed = 4;
        report.lease_expired_ms = None;
        report.ownership[0].by_killed = 1;
        let problems = report.problems();
        assert_eq!(problems.len(), 4, "{problems:?}");
        assert_eq!(problems[0], "cluster: 1 of the 2 nodes of edge-a re-homed");
        assert_eq!(
            problems[1],
            "cluster: 4 nodes of the surviving Edges lost their session when edge-a died"
        );
        assert_eq!(
            problems[2],
            "cluster: the etcd lease of edge-a was not seen to expire"
        );
        assert!(problems[3].starts_with("cluster: /status of edge-b after the re-homing: "));
        let text = {
            let mut t = String::new();
            render_cluster(&mut t, &report);
            t
        };
        assert!(
            text.contains("edge-a killed: 1 of its 2 nodes re-homed"),
            "{text}"
        );
        assert!(text.contains("its etcd lease expired (not seen)"), "{text}");
    }

    #[test]
    fn problems_name_the_step_and_what_failed() {
        let pinned = |served: &str| ProbeOutcome {
            seq: 1,
            model: "swarm-n00004".into(),
            expect_node: Some("n00004".into()),
            served_by: Some(served.into()),
            dispatch_ns: Some(1),
            round_trip_ns: 1,
            error: None,
        };
        let step = StepReport {
            nodes: 10,
            providers: 40,
            status_connected_providers: 40,
            status_providers: 40,
            pinned: vec![pinned("n00004")],
            ..Default::default()
        };
        let mut report = SwarmReport {
            schema: SCHEMA,
            created_unix_ms: 0,
            commit: None,
            machine: crate::procstat::machine_info(),
            options: crate::swarm::cli::SwarmArgs {
                nodes: Some(10),
                providers_per_node: 4,
                capacity: 4,
                edge_cores: "0".into(),
                heartbeat_interval_ms: 1_000,
                ..Default::default()
            }
            .resolve(std::path::Path::new("bench"), 1)
            .unwrap(),
            nofile: None,
            load_average: [Some([1.0, 1.0, 1.0]), None],
            steps: vec![step.clone()],
            selection: Vec::new(),
            cluster: None,
        };
        assert!(report.problems().is_empty());
        report.steps[0].pinned.push(pinned("n00005"));
        report.steps[0].status_connected_providers = 39;
        assert_eq!(
            report.problems(),
            [
                "10 nodes: /status showed 39 of 40 providers connected (40 listed)".to_string(),
                "10 nodes: the request to swarm-n00004 was not served by n00004: served by \
                 Some(\"n00005\"), error None"
                    .to_string(),
            ]
        );
        let text = render(&report);
        assert!(
            text.contains("1 of 2 pinned probes served by their node"),
            "{text}"
        );
    }
}
