//! The swarm report: per fleet size, the figures of each phase; Control's
//! decision costs; the tables printed on stdout. Pure: numbers in, text
//! out.

use std::fmt::Write as _;

use serde::Serialize;

use super::client::ProbeOutcome;
use super::selection::SelectionFigures;
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
    /// Control's decision costs per fleet size.
    pub selection: Vec<SelectionFigures>,
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

fn ns(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} ms", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} µs", v / 1e3)
    } else {
        format!("{v:.0} ns")
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
                nodes: 10,
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
