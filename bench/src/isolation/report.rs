//! The `bench isolation` report: per round, the four windows' figures and
//! what the never-readers cost; over rounds, medians against the goals.

use serde::Serialize;

use super::IsolationOptions;
use crate::load::LoadSummary;
use crate::procstat::MachineInfo;
use crate::stats::median;

/// Version of the JSON layout.
pub const SCHEMA: u32 = 1;
/// Goal: added per-chunk p99 with never-readers ÷ without.
pub const GOAL_P99_RATIO: f64 = 1.2;

/// One window's figures (per-chunk latency in µs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowFigures {
    /// Streams that completed.
    pub requests_ok: u64,
    /// Streams that failed or were truncated.
    pub requests_failed: u64,
    /// Per-chunk latency p50 (mock send → client receive).
    pub chunk_p50_us: f64,
    /// Per-chunk latency p99.
    pub chunk_p99_us: f64,
}

impl WindowFigures {
    fn of(summary: &LoadSummary) -> Self {
        Self {
            requests_ok: summary.requests_ok,
            requests_failed: summary.errors_total + summary.truncated,
            chunk_p50_us: summary.chunk_latency.p50_us,
            chunk_p99_us: summary.chunk_latency.p99_us,
        }
    }
}

/// Edge and Node resident memory at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Rss {
    /// The Edge's, KiB.
    pub edge_kib: u64,
    /// The Node's, KiB.
    pub node_kib: u64,
}

impl Rss {
    fn total(self) -> u64 {
        self.edge_kib + self.node_kib
    }
}

/// One round.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundResult {
    /// Its index.
    pub round: u32,
    /// Window A, direct to the normal mock.
    pub a_direct: WindowFigures,
    /// Window A, relayed, no never-readers.
    pub a_relay: WindowFigures,
    /// Window B, relayed, the never-readers stuck.
    pub b_relay: WindowFigures,
    /// Window B, direct, the never-readers stuck.
    pub b_direct: WindowFigures,
    /// Added per-chunk p99 without never-readers (A relayed − A direct).
    pub added_p99_without_us: f64,
    /// Added per-chunk p99 with them (B relayed − B direct).
    pub added_p99_with_us: f64,
    /// `added_p99_with_us ÷ added_p99_without_us`.
    pub added_p99_ratio: f64,
    /// RSS before the never-readers, with them stuck, after they were cut
    /// off.
    pub rss: (Rss, Rss, Rss),
    /// Edge + Node `(stuck − before) ÷ K`: RSS per stuck run (KiB).
    pub rss_per_stuck_kib: f64,
    /// The Edge's share of it.
    pub edge_rss_per_stuck_kib: f64,
    /// The Node's share of it.
    pub node_rss_per_stuck_kib: f64,
    /// Edge + Node RSS after the cut-offs minus before (KiB): what was not
    /// given back.
    pub rss_kept_kib: i64,
    /// The Edge's share of it.
    pub edge_rss_kept_kib: i64,
    /// The Node's share of it.
    pub node_rss_kept_kib: i64,
    /// Bulk bytes the mock wrote for the stuck runs, per run.
    pub bulk_written_per_stuck_bytes: f64,
    /// Never-readers still connected after window B (cut off later).
    pub stuck_after_b: usize,
    /// Seconds after it connected that each never-reader was cut off
    /// (`None`: never, within the wait).
    pub cut_off_s: Vec<Option<f64>>,
    /// Bulk leases still held once the cut-offs were over (0 expected).
    pub leases_left: u64,
}

impl RoundResult {
    /// Assembles a round from its four windows (A direct, A relayed, B
    /// relayed, B direct) and measurements.
    pub fn of(
        round: u32,
        windows: [&LoadSummary; 4],
        rss: (Rss, Rss, Rss),
        written_stuck: u64,
        stuck_after_b: usize,
        cut_off_s: Vec<Option<f64>>,
        leases_left: u64,
    ) -> Self {
        let [a_direct, a_relay, b_relay, b_direct] = windows.map(WindowFigures::of);
        let k = cut_off_s.len().max(1) as f64;
        let added_without = a_relay.chunk_p99_us - a_direct.chunk_p99_us;
        let added_with = b_relay.chunk_p99_us - b_direct.chunk_p99_us;
        Self {
            round,
            added_p99_without_us: added_without,
            added_p99_with_us: added_with,
            added_p99_ratio: if added_without > 0.0 {
                added_with / added_without
            } else {
                f64::NAN
            },
            a_direct,
            a_relay,
            b_relay,
            b_direct,
            rss,
            rss_per_stuck_kib: rss.1.total().saturating_sub(rss.0.total()) as f64 / k,
            edge_rss_per_stuck_kib: rss.1.edge_kib.saturating_sub(rss.0.edge_kib) as f64 / k,
            node_rss_per_stuck_kib: rss.1.node_kib.saturating_sub(rss.0.node_kib) as f64 / k,
            rss_kept_kib: rss.2.total() as i64 - rss.0.total() as i64,
            edge_rss_kept_kib: rss.2.edge_kib as i64 - rss.0.edge_kib as i64,
            node_rss_kept_kib: rss.2.node_kib as i64 - rss.0.node_kib as i64,
            bulk_written_per_stuck_bytes: written_stuck as f64 / k,
            stuck_after_b,
            cut_off_s,
            leases_left,
        }
    }

    /// One line for the progress log.
    pub fn describe(&self) -> String {
        format!(
            "added chunk p99 {:.0} µs without, {:.0} µs with never-readers ({:.2}×); \
             RSS +{:.0} KiB per stuck run (Edge {:.0}, Node {:.0}); {:.0} KiB written per stuck run",
            self.added_p99_without_us,
            self.added_p99_with_us,
            self.added_p99_ratio,
            self.rss_per_stuck_kib,
            self.edge_rss_per_stuck_kib,
            self.node_rss_per_stuck_kib,
            self.bulk_written_per_stuck_bytes / 1024.0,
        )
    }

    fn failed(&self) -> u64 {
        [&self.a_direct, &self.a_relay, &self.b_relay, &self.b_direct]
            .iter()
            .map(|w| w.requests_failed)
            .sum()
    }
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IsolationReport {
    /// JSON layout version.
    pub schema: u32,
    /// When it was made.
    pub created_unix_ms: i64,
    /// Where it ran.
    pub machine: MachineInfo,
    /// The commit measured, if known.
    pub commit: Option<String>,
    /// Every option.
    pub options: IsolationOptions,
    /// Every round.
    pub rounds: Vec<RoundResult>,
    /// Median over rounds of `added_p99_ratio`.
    pub added_p99_ratio: f64,
    /// Whether it meets [`GOAL_P99_RATIO`].
    pub ratio_goal_met: bool,
    /// Median Edge + Node RSS per stuck run (KiB).
    pub rss_per_stuck_kib: f64,
    /// Median Edge RSS per stuck run (KiB).
    pub edge_rss_per_stuck_kib: f64,
    /// Median Node RSS per stuck run (KiB).
    pub node_rss_per_stuck_kib: f64,
    /// Median RSS not given back after the cut-offs (KiB).
    pub rss_kept_kib: f64,
    /// Median Edge RSS not given back (KiB).
    pub edge_rss_kept_kib: f64,
    /// Median Node RSS not given back (KiB).
    pub node_rss_kept_kib: f64,
    /// The window, KiB.
    pub window_kib: f64,
    /// Median bulk bytes written per stuck run.
    pub bulk_written_per_stuck_bytes: f64,
    /// Every cut-off time, seconds, sorted.
    pub cut_off_s: Vec<f64>,
    /// Never-readers never cut off.
    pub never_cut_off: usize,
    /// Normal streams that failed, over every window.
    pub normal_failures: u64,
    /// Leases not released after the cut-offs, over every round.
    pub leases_left: u64,
}

impl IsolationReport {
    /// The report of `rounds`.
    pub fn new(
        schema: u32,
        machine: MachineInfo,
        commit: Option<String>,
        options: IsolationOptions,
        rounds: Vec<RoundResult>,
    ) -> Self {
        let med = |f: fn(&RoundResult) -> f64| {
            median(&rounds.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
        };
        let added_p99_ratio = med(|r| r.added_p99_ratio);
        let mut cut_off_s: Vec<f64> = rounds
            .iter()
            .flat_map(|r| r.cut_off_s.iter().flatten().copied())
            .collect();
        cut_off_s.sort_by(f64::total_cmp);
        Self {
            schema,
            created_unix_ms: iop_engine::clock::unix_ms(),
            machine,
            commit,
            window_kib: options.flow_window_bytes as f64 / 1024.0,
            options,
            added_p99_ratio,
            ratio_goal_met: added_p99_ratio <= GOAL_P99_RATIO,
            rss_per_stuck_kib: med(|r| r.rss_per_stuck_kib),
            edge_rss_per_stuck_kib: med(|r| r.edge_rss_per_stuck_kib),
            node_rss_per_stuck_kib: med(|r| r.node_rss_per_stuck_kib),
            rss_kept_kib: med(|r| r.rss_kept_kib as f64),
            edge_rss_kept_kib: med(|r| r.edge_rss_kept_kib as f64),
            node_rss_kept_kib: med(|r| r.node_rss_kept_kib as f64),
            bulk_written_per_stuck_bytes: med(|r| r.bulk_written_per_stuck_bytes),
            never_cut_off: rounds
                .iter()
                .map(|r| r.cut_off_s.iter().filter(|c| c.is_none()).count())
                .sum(),
            cut_off_s,
            normal_failures: rounds.iter().map(RoundResult::failed).sum(),
            leases_left: rounds.iter().map(|r| r.leases_left).sum(),
            rounds,
        }
    }

    /// Whether anything went wrong that makes the figures void (normal
    /// streams failed, never-readers never cut off, leases not returned).
    pub fn incomplete(&self) -> bool {
        self.normal_failures > 0 || self.never_cut_off > 0 || self.leases_left > 0
    }
}

/// The table printed on stdout.
pub fn render_table(report: &IsolationReport) -> String {
    let o = &report.options;
    let mut out = String::new();
    out.push_str(&format!(
        "bench isolation: {} normal streams, {} never-readers, window {} KiB, stall cut-off {} ms, {} rounds\n",
        o.normal_streams, o.never_readers, report.window_kib, o.client_write_stall_timeout_ms, o.rounds
    ));
    out.push_str(
        "round  added p99 without  added p99 with  ratio  RSS/stuck KiB  written/stuck KiB\n",
    );
    for r in &report.rounds {
        out.push_str(&format!(
            "{:>5}  {:>14.0} µs  {:>11.0} µs  {:>5.2}  {:>13.0}  {:>17.0}\n",
            r.round + 1,
            r.added_p99_without_us,
            r.added_p99_with_us,
            r.added_p99_ratio,
            r.rss_per_stuck_kib,
            r.bulk_written_per_stuck_bytes / 1024.0
        ));
    }
    let goal = if report.ratio_goal_met {
        "met"
    } else {
        "NOT met"
    };
    out.push_str(&format!(
        "added per-chunk p99 with ÷ without never-readers: {:.2} (goal ≤ {GOAL_P99_RATIO}: {goal})\n",
        report.added_p99_ratio
    ));
    out.push_str(&format!(
        "Edge + Node RSS per stuck run: {:.0} KiB (Edge {:.0}, Node {:.0}; window {:.0} KiB); \
         {:.0} KiB not given back {} s after the cut-offs (Edge {:.0}, Node {:.0})\n",
        report.rss_per_stuck_kib,
        report.edge_rss_per_stuck_kib,
        report.node_rss_per_stuck_kib,
        report.window_kib,
        report.rss_kept_kib,
        super::RETURN_WAIT.as_secs(),
        report.edge_rss_kept_kib,
        report.node_rss_kept_kib
    ));
    out.push_str(&format!(
        "bulk bytes the mock wrote per stuck run: {:.0} KiB of a {} KiB answer\n",
        report.bulk_written_per_stuck_bytes / 1024.0,
        o.bulk_bytes / 1024
    ));
    match (report.cut_off_s.first(), report.cut_off_s.last()) {
        (Some(first), Some(last)) => out.push_str(&format!(
            "never-readers cut off {:.1}–{:.1} s after they connected (timeout {} ms); {} never\n",
            first, last, o.client_write_stall_timeout_ms, report.never_cut_off
        )),
        _ => out.push_str(&format!(
            "no never-reader was cut off ({} never)\n",
            report.never_cut_off
        )),
    }
    if report.incomplete() {
        out.push_str(&format!(
            "INCOMPLETE: {} normal streams failed, {} never-readers not cut off, {} leases left\n",
            report.normal_failures, report.never_cut_off, report.leases_left
        ));
    }
    out
}
