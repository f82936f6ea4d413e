//! The comparison's report: the JSON document (every figure, per window
//! too) and the human table. Pure: built from measured values, no IO.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::load::{format_us, LoadSummary};
use crate::procstat::{MachineInfo, NofileLimit};
use crate::stats::{median, Headline, HeadlineRatio};

use super::CompareOptions;

/// Version tag of the JSON document.
pub const SCHEMA: &str = "iop-bench-compare/2";

/// One side of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Arm {
    /// A: client → mock provider directly.
    A,
    /// B: client → Edge → Node → mock provider.
    B,
    /// C: client → peer proxy (`--peer`) → mock provider.
    C,
}

impl Arm {
    /// `direct`, `relayed` or `peer`.
    pub fn label(self) -> &'static str {
        match self {
            Arm::A => "direct",
            Arm::B => "relayed",
            Arm::C => "peer",
        }
    }
}

/// Where an arm sends its requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmInfo {
    /// Which arm.
    pub arm: Arm,
    /// `direct`, `relayed`, `peer`.
    pub label: String,
    /// Base URL.
    pub url: String,
    /// The `model` of its requests.
    pub model: String,
}

/// CPU time children used during one window, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuWindow {
    /// The Edge (`None` when not started by the harness).
    pub edge_us: Option<u64>,
    /// The Node.
    pub node_us: Option<u64>,
    /// The mock provider.
    pub mock_us: Option<u64>,
    /// The peer's processes together (`--peer-pid`, peer windows only;
    /// `None` when one of them could not be read).
    pub peer_us: Option<u64>,
}

/// Resident memory of Edge and Node at one moment, with the number of
/// streams the load generator had in flight then.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RssSample {
    /// Streams in flight when sampled.
    pub active_streams: u64,
    /// Edge `VmRSS`, KiB.
    pub edge_kib: u64,
    /// Node `VmRSS`, KiB.
    pub node_kib: u64,
}

impl RssSample {
    /// Edge + Node bytes per active stream above `idle`; `None` with no
    /// active stream.
    pub fn bytes_per_stream_over(&self, idle: &RssSample) -> Option<f64> {
        if self.active_streams == 0 {
            return None;
        }
        let now = (self.edge_kib + self.node_kib) as f64;
        let base = (idle.edge_kib + idle.node_kib) as f64;
        Some((now - base) * 1024.0 / self.active_streams as f64)
    }
}

/// Resident memory of the peer's processes together at one moment, with
/// the streams in flight then.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRssSample {
    /// Streams in flight when sampled.
    pub active_streams: u64,
    /// Sum of the peer processes' `VmRSS`, KiB.
    pub kib: u64,
}

impl PeerRssSample {
    /// Bytes per active stream above `idle_kib`; `None` with no active
    /// stream.
    pub fn bytes_per_stream_over(&self, idle_kib: u64) -> Option<f64> {
        (self.active_streams > 0)
            .then(|| (self.kib as f64 - idle_kib as f64) * 1024.0 / self.active_streams as f64)
    }
}

/// One process of the peer, as given by `--peer-pid`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerProcess {
    /// Its process id.
    pub pid: u32,
    /// Its command line when the run started (nginx's names the master
    /// and the workers), shortened; `None` if it was not running.
    pub command: Option<String>,
}

/// One measured window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowRecord {
    /// Round number, from 0.
    pub round: u32,
    /// Which arm ran.
    pub arm: Arm,
    /// Its place in the round (rounds alternate the order).
    pub position: u32,
    /// The five headline figures (copied from `summary`).
    pub headline: Headline,
    /// Everything measured.
    pub summary: LoadSummary,
    /// Children's CPU time during the window.
    pub cpu: CpuWindow,
    /// Edge + Node memory mid-window (relayed windows).
    pub rss: Option<RssSample>,
    /// The peer's memory mid-window (peer windows with `--peer-pid`).
    pub peer_rss: Option<PeerRssSample>,
    /// Why the peer's processes could not be sampled in this window.
    pub peer_not_sampled: Option<String>,
}

/// The per-round comparison of the arms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// Round number.
    pub round: u32,
    /// The order the arms ran in.
    pub order: Vec<Arm>,
    /// B − A, figure by figure, µs.
    pub relayed_minus_direct: Headline,
    /// B / A.
    pub relayed_over_direct: HeadlineRatio,
    /// C − A, when a peer ran.
    pub peer_minus_direct: Option<Headline>,
    /// C / A.
    pub peer_over_direct: Option<HeadlineRatio>,
}

impl RoundRecord {
    /// Compares the windows of one round.
    pub fn of(
        round: u32,
        order: Vec<Arm>,
        a: &Headline,
        b: &Headline,
        c: Option<&Headline>,
    ) -> Self {
        RoundRecord {
            round,
            order,
            relayed_minus_direct: b.minus(*a),
            relayed_over_direct: b.over(*a),
            peer_minus_direct: c.map(|c| c.minus(*a)),
            peer_over_direct: c.map(|c| c.over(*a)),
        }
    }
}

/// Totals of one arm over its windows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ArmTotals {
    /// Windows run.
    pub windows: u32,
    /// Requests completed cleanly.
    pub requests_ok: u64,
    /// Errors (see `LoadSummary::errors`).
    pub errors: u64,
    /// Streams without `[DONE]`.
    pub truncated: u64,
    /// Content chunks received.
    pub content_chunks: u64,
    /// Median of the windows' requests per second.
    pub requests_per_s: f64,
    /// Median of the windows' tokens per second.
    pub tokens_per_s: f64,
    /// Non-200 responses by status code, over the windows.
    pub http_status_codes: BTreeMap<u16, u64>,
}

impl ArmTotals {
    /// Sums and medians over `windows`.
    pub fn of<'a>(windows: impl Iterator<Item = &'a WindowRecord>) -> Self {
        let mut t = ArmTotals::default();
        let (mut rps, mut tps) = (Vec::new(), Vec::new());
        for w in windows {
            t.windows += 1;
            t.requests_ok += w.summary.requests_ok;
            t.errors += w.summary.errors_total;
            t.truncated += w.summary.truncated;
            t.content_chunks += w.summary.content_chunks;
            for (code, n) in &w.summary.http_status_codes {
                *t.http_status_codes.entry(*code).or_default() += n;
            }
            rps.push(w.summary.requests_per_s);
            tps.push(w.summary.tokens_per_s);
        }
        t.requests_per_s = median(&rps).unwrap_or(0.0);
        t.tokens_per_s = median(&tps).unwrap_or(0.0);
        t
    }
}

/// The headline result: medians over rounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareSummary {
    /// Median absolute figures of the direct windows.
    pub direct: Headline,
    /// Median absolute figures of the relayed windows.
    pub relayed: Headline,
    /// Median absolute figures of the peer windows.
    pub peer: Option<Headline>,
    /// Median over rounds of B − A (the latency the relay adds).
    pub relayed_added: Headline,
    /// Median over rounds of B / A.
    pub relayed_ratio: HeadlineRatio,
    /// Median over rounds of C − A.
    pub peer_added: Option<Headline>,
    /// Median over rounds of C / A.
    pub peer_ratio: Option<HeadlineRatio>,
    /// Direct totals.
    pub direct_totals: ArmTotals,
    /// Relayed totals.
    pub relayed_totals: ArmTotals,
    /// Peer totals.
    pub peer_totals: Option<ArmTotals>,
}

impl CompareSummary {
    /// Medians over `windows` and `rounds`; `None` without a direct and a
    /// relayed window.
    pub fn of(windows: &[WindowRecord], rounds: &[RoundRecord]) -> Option<Self> {
        let headlines = |arm: Arm| -> Vec<Headline> {
            windows
                .iter()
                .filter(|w| w.arm == arm)
                .map(|w| w.headline)
                .collect()
        };
        let has_peer = windows.iter().any(|w| w.arm == Arm::C);
        let b_minus: Vec<Headline> = rounds.iter().map(|r| r.relayed_minus_direct).collect();
        let b_over: Vec<HeadlineRatio> = rounds.iter().map(|r| r.relayed_over_direct).collect();
        let c_minus: Vec<Headline> = rounds.iter().filter_map(|r| r.peer_minus_direct).collect();
        let c_over: Vec<HeadlineRatio> = rounds.iter().filter_map(|r| r.peer_over_direct).collect();
        let totals = |arm: Arm| ArmTotals::of(windows.iter().filter(move |w| w.arm == arm));
        Some(CompareSummary {
            direct: Headline::median_of(&headlines(Arm::A))?,
            relayed: Headline::median_of(&headlines(Arm::B))?,
            peer: Headline::median_of(&headlines(Arm::C)),
            relayed_added: Headline::median_of(&b_minus)?,
            relayed_ratio: HeadlineRatio::median_of(&b_over),
            peer_added: Headline::median_of(&c_minus),
            peer_ratio: has_peer.then(|| HeadlineRatio::median_of(&c_over)),
            direct_totals: totals(Arm::A),
            relayed_totals: totals(Arm::B),
            peer_totals: has_peer.then(|| totals(Arm::C)),
        })
    }
}

/// CPU cost of relaying, from the relayed windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuReport {
    /// `sysconf(_SC_CLK_TCK)`: the resolution of the figures below.
    pub clock_ticks_per_s: u64,
    /// Content chunks (tokens) received in the relayed windows.
    pub tokens_relayed: u64,
    /// Edge CPU time over the relayed windows, µs.
    pub edge_cpu_us: u64,
    /// Node CPU time over the relayed windows, µs.
    pub node_cpu_us: u64,
    /// `edge_cpu_us / tokens_relayed`.
    pub edge_us_per_token: Option<f64>,
    /// `node_cpu_us / tokens_relayed`.
    pub node_us_per_token: Option<f64>,
    /// Edge + Node per relayed token.
    pub relay_us_per_token: Option<f64>,
    /// The mock's CPU per token in the direct windows (context: the cost
    /// of producing a token at all).
    pub mock_us_per_token_direct: Option<f64>,
}

impl CpuReport {
    /// Totals over the windows (Edge/Node from the relayed ones, the mock
    /// from the direct ones).
    pub fn of(windows: &[WindowRecord], clock_ticks_per_s: u64) -> Self {
        let per = |us: u64, tokens: u64| (tokens > 0).then(|| us as f64 / tokens as f64);
        let relayed = windows.iter().filter(|w| w.arm == Arm::B);
        let (mut tokens, mut edge, mut node) = (0, 0, 0);
        for w in relayed {
            tokens += w.summary.content_chunks;
            edge += w.cpu.edge_us.unwrap_or(0);
            node += w.cpu.node_us.unwrap_or(0);
        }
        let (mut direct_tokens, mut mock) = (0, 0);
        for w in windows.iter().filter(|w| w.arm == Arm::A) {
            direct_tokens += w.summary.content_chunks;
            mock += w.cpu.mock_us.unwrap_or(0);
        }
        CpuReport {
            clock_ticks_per_s,
            tokens_relayed: tokens,
            edge_cpu_us: edge,
            node_cpu_us: node,
            edge_us_per_token: per(edge, tokens),
            node_us_per_token: per(node, tokens),
            relay_us_per_token: per(edge + node, tokens),
            mock_us_per_token_direct: per(mock, direct_tokens),
        }
    }
}

/// Memory per active stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RssReport {
    /// Edge and Node before any request (connected, nothing served yet).
    pub idle: RssSample,
    /// Samples taken mid-way through each relayed window.
    pub window_samples: Vec<RssSample>,
    /// Median over `window_samples` of (Edge + Node − idle) / streams, bytes.
    pub bytes_per_stream: Option<f64>,
    /// The same at the largest passing relayed ladder level, if sampled.
    pub ladder_sample: Option<RssSample>,
    /// (Edge + Node − idle) / streams for `ladder_sample`, bytes.
    pub ladder_bytes_per_stream: Option<f64>,
}

impl RssReport {
    /// Builds the report from the idle sample and the samples taken.
    pub fn of(idle: RssSample, window_samples: Vec<RssSample>, ladder: Option<RssSample>) -> Self {
        let per: Vec<f64> = window_samples
            .iter()
            .filter_map(|s| s.bytes_per_stream_over(&idle))
            .collect();
        RssReport {
            idle,
            bytes_per_stream: median(&per),
            ladder_bytes_per_stream: ladder.and_then(|s| s.bytes_per_stream_over(&idle)),
            window_samples,
            ladder_sample: ladder,
        }
    }
}

/// What the peer's processes (`--peer-pid`) cost in the peer windows of
/// one level, by the relay's definitions: CPU time used during the windows
/// ÷ tokens received through the peer, and (sum of `VmRSS` mid-window −
/// idle) ÷ streams in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerCost {
    /// Content chunks (tokens) received in the peer windows.
    pub tokens: u64,
    /// CPU time of the peer's processes over those windows, µs; `None`
    /// when a window could not be sampled.
    pub cpu_us: Option<u64>,
    /// `cpu_us / tokens`.
    pub us_per_token: Option<f64>,
    /// The peer's processes before any request of the run, KiB.
    pub idle_kib: Option<u64>,
    /// Samples taken mid-way through each peer window.
    pub window_samples: Vec<PeerRssSample>,
    /// Median over `window_samples` of (peer − idle) / streams, bytes.
    pub bytes_per_stream: Option<f64>,
    /// Why a figure is missing (a process gone, a file unreadable).
    pub not_sampled: Vec<String>,
}

impl PeerCost {
    /// Sums over the peer windows of `windows`; `idle` is the idle sample
    /// or why it could not be taken.
    pub fn of(windows: &[WindowRecord], idle: Result<u64, String>) -> Self {
        let mut not_sampled = Vec::new();
        let (mut tokens, mut cpu) = (0, Some(0u64));
        let mut samples = Vec::new();
        for w in windows.iter().filter(|w| w.arm == Arm::C) {
            tokens += w.summary.content_chunks;
            cpu = match (cpu, w.cpu.peer_us) {
                (Some(total), Some(us)) => Some(total + us),
                _ => None,
            };
            if let Some(reason) = &w.peer_not_sampled {
                not_sampled.push(format!("round {}: {reason}", w.round + 1));
            }
            samples.extend(w.peer_rss);
        }
        let idle_kib = match idle {
            Ok(kib) => Some(kib),
            Err(reason) => {
                not_sampled.insert(0, format!("idle: {reason}"));
                None
            }
        };
        let per: Vec<f64> = match idle_kib {
            Some(idle) => samples
                .iter()
                .filter_map(|s| s.bytes_per_stream_over(idle))
                .collect(),
            None => Vec::new(),
        };
        PeerCost {
            tokens,
            cpu_us: cpu,
            us_per_token: cpu.and_then(|us| (tokens > 0).then(|| us as f64 / tokens as f64)),
            idle_kib,
            window_samples: samples,
            bytes_per_stream: median(&per),
            not_sampled,
        }
    }
}

/// The largest RSS growth per active stream (Edge + Node) the relay's goal
/// allows, bytes.
pub const RSS_PER_STREAM_GOAL_BYTES: f64 = 12.0 * 1024.0;
/// The largest IOP ÷ peer ratio of added latency the goals allow.
pub const LATENCY_RATIO_GOAL: f64 = 1.5;
/// The largest IOP ÷ peer ratio of CPU per token the goal allows: within
/// a fifth of one nginx hop, for two hops with mutual TLS between them.
pub const CPU_RATIO_GOAL: f64 = 1.2;
/// A peer's added latency at or below this (µs) is too small to divide
/// by: the ratio is reported as n/a.
pub const MIN_PEER_ADDED_US: f64 = 10.0;
/// A peer CPU total below this many clock ticks is too coarse to divide
/// by: the ratio is reported as n/a.
pub const MIN_PEER_CPU_TICKS: u64 = 5;

/// Which goal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GoalId {
    /// Added TTFT p50 ≤ 1.5 × the peer's.
    AddedTtftP50,
    /// Added TTFT p99 ≤ 1.5 × the peer's.
    AddedTtftP99,
    /// Added per-chunk latency p99 ≤ 1.5 × the peer's.
    AddedChunkLatencyP99,
    /// Edge + Node CPU per relayed token ≤ 1.2 × the peer's per token.
    CpuPerToken,
    /// Edge + Node RSS growth per active stream ≤ 12 KiB.
    RssPerStream,
}

impl GoalId {
    /// The figure's name in the table.
    pub fn label(self) -> &'static str {
        match self {
            GoalId::AddedTtftP50 => "added TTFT p50",
            GoalId::AddedTtftP99 => "added TTFT p99",
            GoalId::AddedChunkLatencyP99 => "added chunk latency p99",
            GoalId::CpuPerToken => "CPU per token",
            GoalId::RssPerStream => "RSS per active stream",
        }
    }
}

/// One goal checked at one level: IOP's figure, the peer's, their ratio
/// and the verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoalCheck {
    /// Which goal.
    pub goal: GoalId,
    /// The unit of `iop` and `peer`: `us` (added latency, medians of
    /// per-round differences to direct), `us_per_token`, `bytes_per_stream`.
    pub unit: String,
    /// IOP's figure (Edge + Node).
    pub iop: Option<f64>,
    /// The peer's figure.
    pub peer: Option<f64>,
    /// `iop / peer` (ratio goals; `None`: n/a, see `why_not`).
    pub ratio: Option<f64>,
    /// The goal as a ratio to the peer (`None`: an absolute goal).
    pub max_ratio: Option<f64>,
    /// The goal as an absolute bound in `unit` (`None`: a ratio goal).
    pub max_value: Option<f64>,
    /// Met, not met, or `None` when it could not be judged.
    pub met: Option<bool>,
    /// Why it could not be judged.
    pub why_not: Option<String>,
}

/// What [`check_goals`] judges: one level's figures.
#[derive(Debug, Clone, Copy)]
pub struct GoalInputs<'a> {
    /// The level's summary (added latency of B and C).
    pub summary: &'a CompareSummary,
    /// Edge + Node CPU (`None`: not measured).
    pub cpu: Option<&'a CpuReport>,
    /// Edge + Node memory (`None`: not measured).
    pub rss: Option<&'a RssReport>,
    /// The peer's processes (`None`: no `--peer-pid`).
    pub peer: Option<&'a PeerCost>,
    /// The peer's name (`nginx`, `peer`).
    pub peer_name: &'a str,
    /// Whether this is the highest level (the CPU and memory goals apply
    /// there only).
    pub highest: bool,
    /// `sysconf(_SC_CLK_TCK)`.
    pub clock_ticks_per_s: u64,
}

/// A ratio goal: `iop / peer ≤ max_ratio`; n/a (`tiny` says why) when
/// the peer's figure is `floor` or less.
fn ratio_goal(
    goal: GoalId,
    unit: &str,
    iop: Option<f64>,
    peer: Result<Option<f64>, String>,
    floor: f64,
    tiny: String,
    max_ratio: f64,
) -> GoalCheck {
    let mut check = GoalCheck {
        goal,
        unit: unit.into(),
        iop,
        peer: None,
        ratio: None,
        max_ratio: Some(max_ratio),
        max_value: None,
        met: None,
        why_not: None,
    };
    match (iop, peer) {
        (_, Err(why)) => check.why_not = Some(why),
        (None, _) => check.why_not = Some("IOP not measured".into()),
        (Some(_), Ok(None)) => check.why_not = Some("peer not measured".into()),
        (Some(iop), Ok(Some(peer))) => {
            check.peer = Some(peer);
            if peer > floor {
                let ratio = iop / peer;
                check.ratio = Some(ratio);
                check.met = Some(ratio <= max_ratio);
            } else {
                check.why_not = Some(tiny);
            }
        }
    }
    check
}

/// One latency figure of a [`Headline`].
type Figure = fn(&Headline) -> f64;

/// The goals of one level: the latency ratios at every level, CPU per
/// token and RSS per stream at the highest.
pub fn check_goals(inputs: &GoalInputs<'_>) -> Vec<GoalCheck> {
    let s = inputs.summary;
    let no_peer = || Err::<Option<f64>, String>("no peer: ratios not computed".to_string());
    let peer_added = |f: Figure| match &s.peer_added {
        Some(h) => Ok(Some(f(h))),
        None => no_peer(),
    };
    let name = inputs.peer_name;
    let tiny_latency = || {
        format!(
            "n/a: {name}'s added figure is not above {}",
            format_us(MIN_PEER_ADDED_US)
        )
    };
    // The latency goals: IOP's added figure ÷ the peer's, at every level.
    let latency: [(GoalId, Figure); 3] = [
        (GoalId::AddedTtftP50, |h| h.ttft_p50_us),
        (GoalId::AddedTtftP99, |h| h.ttft_p99_us),
        (GoalId::AddedChunkLatencyP99, |h| h.chunk_latency_p99_us),
    ];
    let mut goals: Vec<GoalCheck> = latency
        .into_iter()
        .map(|(id, figure)| {
            ratio_goal(
                id,
                "us",
                Some(figure(&s.relayed_added)),
                peer_added(figure),
                MIN_PEER_ADDED_US,
                tiny_latency(),
                LATENCY_RATIO_GOAL,
            )
        })
        .collect();
    if !inputs.highest {
        return goals;
    }
    let peer_cpu = match (&s.peer_added, inputs.peer) {
        (None, _) => no_peer(),
        (Some(_), None) => Err(format!("{name}'s processes not sampled (no --peer-pid)")),
        (Some(_), Some(p)) => match (p.cpu_us, p.us_per_token) {
            (Some(_), Some(per)) => Ok(Some(per)),
            _ => Err(not_sampled_text(name, &p.not_sampled)),
        },
    };
    // The floor is what MIN_PEER_CPU_TICKS ticks come to per token.
    let cpu_floor = inputs.peer.map_or(0.0, |p| {
        let floor_us =
            crate::procstat::ticks_to_us(MIN_PEER_CPU_TICKS, inputs.clock_ticks_per_s) as f64;
        if p.tokens > 0 {
            floor_us / p.tokens as f64
        } else {
            0.0
        }
    });
    goals.push(ratio_goal(
        GoalId::CpuPerToken,
        "us_per_token",
        inputs.cpu.and_then(|c| c.relay_us_per_token),
        peer_cpu,
        cpu_floor,
        format!("n/a: {name}'s CPU over the windows is {MIN_PEER_CPU_TICKS} clock ticks or less"),
        CPU_RATIO_GOAL,
    ));
    let iop_rss = inputs.rss.and_then(|r| r.bytes_per_stream);
    let peer_rss = inputs.peer.and_then(|p| p.bytes_per_stream);
    goals.push(GoalCheck {
        goal: GoalId::RssPerStream,
        unit: "bytes_per_stream".into(),
        iop: iop_rss,
        peer: peer_rss,
        ratio: None,
        max_ratio: None,
        max_value: Some(RSS_PER_STREAM_GOAL_BYTES),
        met: iop_rss.map(|b| b <= RSS_PER_STREAM_GOAL_BYTES),
        why_not: iop_rss.is_none().then(|| "IOP not measured".to_string()),
    });
    goals
}

fn not_sampled_short(reasons: &[String]) -> String {
    match reasons.first() {
        Some(reason) => format!("not sampled ({reason})"),
        None => "not sampled".into(),
    }
}

fn not_sampled_text(peer_name: &str, reasons: &[String]) -> String {
    match reasons.first() {
        Some(reason) => format!("{peer_name} not sampled: {reason}"),
        None => format!("{peer_name} not sampled"),
    }
}

/// Everything measured at one concurrency level.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelReport {
    /// Concurrent streams in every window of this level.
    pub streams: u64,
    /// Every measured window in run order.
    pub windows: Vec<WindowRecord>,
    /// Per-round deltas and ratios.
    pub rounds: Vec<RoundRecord>,
    /// Medians over rounds.
    pub summary: CompareSummary,
    /// CPU per relayed token (when the harness started Edge and Node).
    pub cpu: Option<CpuReport>,
    /// Memory per active stream (likewise).
    pub rss: Option<RssReport>,
    /// The peer's CPU and memory (with `--peer-pid`).
    pub peer: Option<PeerCost>,
    /// The goals judged at this level.
    pub goals: Vec<GoalCheck>,
}

/// How a ladder level went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LevelOutcome {
    /// Every stream completed with no gap over the limit.
    Pass,
    /// Some stream failed, was truncated or stalled over the limit.
    Fail,
    /// Not attempted: this machine's limits cannot hold that many streams.
    Impossible,
    /// Not attempted: a lower level already failed.
    Skipped,
}

/// One rung of the ladder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LadderLevel {
    /// Concurrent streams.
    pub streams: u64,
    /// The verdict.
    pub outcome: LevelOutcome,
    /// Why it failed or was impossible.
    pub reasons: Vec<String>,
    /// What was measured (attempted levels only).
    pub summary: Option<LoadSummary>,
    /// Edge + Node memory with all streams started (relayed only).
    pub rss: Option<RssSample>,
}

/// One arm's climb.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LadderArm {
    /// The largest level that passed; `None` if none did.
    pub highest_passing: Option<u64>,
    /// Every level, attempted or not.
    pub levels: Vec<LadderLevel>,
}

/// The concurrency ladder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LadderReport {
    /// Mock inter-token delay.
    pub inter_token_ms: u64,
    /// Tokens per stream.
    pub tokens: u32,
    /// Stream starts are spread over this long.
    pub ramp_ms: u64,
    /// A gap above this fails the stream (2 × the inter-token delay).
    pub gap_limit_ms: u64,
    /// Client → mock.
    pub direct: LadderArm,
    /// Client → Edge → Node → mock.
    pub relayed: LadderArm,
}

/// The whole JSON document.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// When the run finished, Unix milliseconds.
    pub created_unix_ms: i64,
    /// The machine.
    pub machine: MachineInfo,
    /// The open-file limit the run had.
    pub nofile: NofileLimit,
    /// `git rev-parse --short HEAD`, when available.
    pub commit: Option<String>,
    /// The options, defaults resolved.
    pub options: CompareOptions,
    /// The arms.
    pub arms: Vec<ArmInfo>,
    /// The peer's name in the table (`--peer-name`).
    pub peer_name: String,
    /// The peer's processes sampled (`--peer-pid`).
    pub peer_processes: Vec<PeerProcess>,
    /// One entry per concurrency level, in increasing order.
    pub levels: Vec<LevelReport>,
    /// The concurrency ladder (unless disabled).
    pub ladder: Option<LadderReport>,
    /// Caveats worth reading next to the figures.
    pub notes: Vec<String>,
}

fn signed_us(us: f64) -> String {
    if us >= 0.0 {
        format!("+{}", format_us(us))
    } else {
        format_us(us)
    }
}

fn ratio_text(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |r| format!("{r:.2}x"))
}

fn kib_text(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// The human-readable report.
pub fn render_table(report: &CompareReport) -> String {
    let o = &report.options;
    let mut out = String::new();
    let m = &report.machine;
    let levels: Vec<String> = report
        .levels
        .iter()
        .map(|l| l.streams.to_string())
        .collect();
    out.push_str(&format!(
        "IOP relay vs direct — {} rounds × {:.1} s per arm at each level ({} streams), \
         {} tokens at {} ms (edge cores {}, node cores {})\n",
        o.windows,
        o.window_ms as f64 / 1000.0,
        levels.join(", "),
        o.tokens,
        o.inter_token_ms,
        o.edge_cores,
        o.node_cores,
    ));
    out.push_str(&format!(
        "machine: {} CPUs, {}, kernel {}, {}; commit {}\n",
        m.nproc,
        m.cpu_model,
        m.kernel,
        m.driver,
        report.commit.as_deref().unwrap_or("unknown")
    ));
    if let Some(peer) = report.arms.iter().find(|a| a.arm == Arm::C) {
        out.push_str(&format!("peer C: {} at {}", report.peer_name, peer.url));
        if report.peer_processes.is_empty() {
            out.push_str("; its processes are not sampled (no --peer-pid)\n");
        } else {
            let procs: Vec<String> = report
                .peer_processes
                .iter()
                .map(|p| match &p.command {
                    Some(command) => format!("{} ({command})", p.pid),
                    None => format!("{} (not running)", p.pid),
                })
                .collect();
            out.push_str(&format!(
                "; CPU and memory sampled from PIDs {}\n",
                procs.join(", ")
            ));
        }
    }
    for level in &report.levels {
        render_level(&mut out, report, level);
    }
    if let Some(ladder) = &report.ladder {
        out.push_str(&format!(
            "\nConcurrency ladder ({} tokens at {} ms, starts spread over {} ms; \
             pass = every stream completes, no gap over {} ms):\n",
            ladder.tokens, ladder.inter_token_ms, ladder.ramp_ms, ladder.gap_limit_ms
        ));
        out.push_str(&format!("{:>8}  {:<40}relayed\n", "streams", "direct"));
        for (d, r) in ladder.direct.levels.iter().zip(&ladder.relayed.levels) {
            out.push_str(&format!(
                "{:>8}  {:<40}{}\n",
                d.streams,
                level_text(d),
                level_text(r)
            ));
        }
        let highest = |a: &LadderArm| {
            a.highest_passing
                .map_or_else(|| "none".into(), |n| n.to_string())
        };
        out.push_str(&format!(
            "highest passing level: direct {}, relayed {}\n",
            highest(&ladder.direct),
            highest(&ladder.relayed)
        ));
        for (name, arm) in [("direct", &ladder.direct), ("relayed", &ladder.relayed)] {
            for level in &arm.levels {
                for reason in &level.reasons {
                    out.push_str(&format!("  {name} {}: {reason}\n", level.streams));
                }
            }
        }
    }
    for note in &report.notes {
        out.push_str(&format!("note: {note}\n"));
    }
    out
}

/// `1 stream`, `200 streams`.
pub(crate) fn streams_text(n: u64) -> String {
    if n == 1 {
        "1 stream".into()
    } else {
        format!("{n} streams")
    }
}

/// One level's section: the latency table, totals, costs and goals.
fn render_level(out: &mut String, report: &CompareReport, level: &LevelReport) {
    let s = &level.summary;
    out.push_str(&format!("\n== {} ==\n", streams_text(level.streams)));
    let peer = s.peer.is_some();
    out.push_str(&format!(
        "{:<22}{:>12}{:>12}{:>12}{:>9}",
        "median of windows", "direct A", "relayed B", "B − A", "B / A"
    ));
    if peer {
        out.push_str(&format!("{:>12}{:>12}{:>9}", "peer C", "C − A", "C / A"));
    }
    out.push('\n');
    let a = s.direct.to_array();
    let b = s.relayed.to_array();
    let added = s.relayed_added.to_array();
    let ratio = s.relayed_ratio.to_array();
    let c = s.peer.map(|p| p.to_array());
    let c_added = s.peer_added.map(|p| p.to_array());
    let c_ratio = s.peer_ratio.map(|p| p.to_array());
    for i in 0..Headline::LEN {
        out.push_str(&format!(
            "{:<22}{:>12}{:>12}{:>12}{:>9}",
            Headline::LABELS[i],
            format_us(a[i]),
            format_us(b[i]),
            signed_us(added[i]),
            ratio_text(ratio[i]),
        ));
        if peer {
            let cell = |v: Option<[f64; Headline::LEN]>, f: fn(f64) -> String| {
                v.map_or_else(|| "-".to_string(), |v| f(v[i]))
            };
            out.push_str(&format!(
                "{:>12}{:>12}{:>9}",
                cell(c, format_us),
                cell(c_added, signed_us),
                ratio_text(c_ratio.and_then(|r| r[i])),
            ));
        }
        out.push('\n');
    }
    out.push_str("(B − A and B / A are medians of per-round differences and ratios.)\n\n");
    let totals = |name: &str, t: &ArmTotals| {
        let mut line = format!(
            "{name:<8} {:>8} ok, {:>3} errors, {:>3} truncated; {:>8.1} req/s, {:>9.0} tokens/s (median window)",
            t.requests_ok, t.errors, t.truncated, t.requests_per_s, t.tokens_per_s
        );
        if !t.http_status_codes.is_empty() {
            let codes: Vec<String> = t
                .http_status_codes
                .iter()
                .map(|(code, n)| format!("{code} ×{n}"))
                .collect();
            line.push_str(&format!("; HTTP {}", codes.join(", ")));
        }
        line.push('\n');
        line
    };
    out.push_str(&totals("direct", &s.direct_totals));
    out.push_str(&totals("relayed", &s.relayed_totals));
    if let Some(t) = &s.peer_totals {
        out.push_str(&totals("peer", t));
    }
    out.push('\n');
    let us = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2} µs"));
    let per_kib =
        |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{:.1} KiB", v / 1024.0));
    match &level.cpu {
        Some(cpu) => {
            out.push_str(&format!(
                "CPU per relayed token: edge {} + node {} = {} ({} tokens; edge {:.3} s, node {:.3} s of CPU; \
                 clock tick {} ms); mock per token, direct: {}\n",
                us(cpu.edge_us_per_token),
                us(cpu.node_us_per_token),
                us(cpu.relay_us_per_token),
                cpu.tokens_relayed,
                cpu.edge_cpu_us as f64 / 1e6,
                cpu.node_cpu_us as f64 / 1e6,
                1000 / cpu.clock_ticks_per_s.max(1),
                us(cpu.mock_us_per_token_direct),
            ));
        }
        None => out.push_str(
            "CPU per relayed token: not measured (Edge/Node not started by the harness)\n",
        ),
    }
    let name = &report.peer_name;
    if let Some(p) = &level.peer {
        match p.cpu_us {
            Some(cpu_us) => out.push_str(&format!(
                "CPU per {name} token: {} ({} tokens; {:.3} s of CPU)\n",
                us(p.us_per_token),
                p.tokens,
                cpu_us as f64 / 1e6
            )),
            None => out.push_str(&format!(
                "CPU per {name} token: {}\n",
                not_sampled_short(&p.not_sampled)
            )),
        }
    }
    match &level.rss {
        Some(rss) => {
            out.push_str(&format!(
                "RSS per active stream (edge + node): {} at ~{} (idle edge {}, node {})",
                per_kib(rss.bytes_per_stream),
                streams_text(rss.window_samples.first().map_or(0, |s| s.active_streams)),
                kib_text(rss.idle.edge_kib),
                kib_text(rss.idle.node_kib),
            ));
            if let Some(l) = &rss.ladder_sample {
                out.push_str(&format!(
                    "; {} at {} streams (edge {}, node {})",
                    per_kib(rss.ladder_bytes_per_stream),
                    l.active_streams,
                    kib_text(l.edge_kib),
                    kib_text(l.node_kib)
                ));
            }
            out.push('\n');
        }
        None => out.push_str("RSS per active stream: not measured\n"),
    }
    if let Some(p) = &level.peer {
        match (p.idle_kib, p.bytes_per_stream) {
            (Some(idle), Some(bytes)) => out.push_str(&format!(
                "RSS per active stream ({name}): {} at ~{} (idle {})\n",
                per_kib(Some(bytes)),
                streams_text(p.window_samples.first().map_or(0, |s| s.active_streams)),
                kib_text(idle),
            )),
            _ => out.push_str(&format!(
                "RSS per active stream ({name}): {}\n",
                not_sampled_short(&p.not_sampled)
            )),
        }
    }
    render_goals(out, name, level);
}

fn goal_value(unit: &str, v: Option<f64>) -> String {
    match (unit, v) {
        (_, None) => "-".into(),
        ("us", Some(v)) => signed_us(v),
        ("bytes_per_stream", Some(v)) => format!("{:.1} KiB", v / 1024.0),
        (_, Some(v)) => format!("{v:.2} µs"),
    }
}

/// The goals table of one level.
fn render_goals(out: &mut String, peer_name: &str, level: &LevelReport) {
    if level.goals.is_empty() {
        return;
    }
    let ratio_head = format!("IOP ÷ {peer_name}");
    // A long peer name (`vllm-router`, `nginx-chain`) widens its columns
    // rather than running into the next heading.
    let peer_width = 12.max(peer_name.chars().count() + 2);
    let ratio_width = 14.max(ratio_head.chars().count() + 2);
    out.push_str(&format!(
        "\n{:<26}{:>12}{:>peer_width$}{:>ratio_width$}{:>11}  met\n",
        format!("goals at {}", streams_text(level.streams)),
        "IOP",
        peer_name,
        ratio_head,
        "goal"
    ));
    let mut reasons = Vec::new();
    for g in &level.goals {
        let goal = match (g.max_ratio, g.max_value) {
            (Some(r), _) => format!("≤ {r:.2}x"),
            (None, Some(v)) => format!("≤ {:.0} KiB", v / 1024.0),
            (None, None) => "-".into(),
        };
        let ratio = match (g.ratio, g.max_ratio) {
            (Some(r), _) => format!("{r:.2}x"),
            (None, Some(_)) => "n/a".into(),
            (None, None) => "-".into(),
        };
        let met = match g.met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "n/a",
        };
        out.push_str(&format!(
            "{:<26}{:>12}{:>peer_width$}{:>ratio_width$}{:>11}  {met}\n",
            g.goal.label(),
            goal_value(&g.unit, g.iop),
            goal_value(&g.unit, g.peer),
            ratio,
            goal,
        ));
        if let Some(why) = &g.why_not {
            if !reasons.contains(why) {
                reasons.push(why.clone());
            }
        }
    }
    for why in reasons {
        out.push_str(&format!("  ({why})\n"));
    }
    out.push_str(
        "(IOP = Edge + Node; latency: added over direct, medians of per-round differences; \
         CPU per token and RSS per stream are judged at the highest level only)\n",
    );
}

fn level_text(level: &LadderLevel) -> String {
    match level.outcome {
        LevelOutcome::Pass => match &level.summary {
            Some(s) => format!("pass (max gap {})", format_us(s.max_gap_us)),
            None => "pass".into(),
        },
        LevelOutcome::Fail => match &level.summary {
            Some(s) if s.requests_ok < level.streams => {
                format!("FAIL ({}/{} completed)", s.requests_ok, level.streams)
            }
            Some(s) => format!(
                "FAIL ({} gaps over limit, max {})",
                s.streams_over_gap_limit,
                format_us(s.max_gap_us)
            ),
            None => "FAIL".into(),
        },
        LevelOutcome::Impossible => "impossible (limits)".into(),
        LevelOutcome::Skipped => "-".into(),
    }
}

impl crate::compare::Report for CompareReport {
    fn created_unix_ms(&self) -> i64 {
        self.created_unix_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(round: u32, arm: Arm, ttft: f64, tokens: u64, cpu: CpuWindow) -> WindowRecord {
        let headline = Headline::from_array([ttft, ttft * 2.0, 10.0, 20.0, 30.0]);
        WindowRecord {
            round,
            arm,
            position: 0,
            headline,
            summary: LoadSummary {
                content_chunks: tokens,
                requests_ok: 10,
                requests_per_s: 5.0,
                tokens_per_s: tokens as f64,
                ..Default::default()
            },
            cpu,
            rss: None,
            peer_rss: None,
            peer_not_sampled: None,
        }
    }

    #[test]
    fn summary_takes_medians_of_round_deltas() {
        let none = CpuWindow::default();
        let windows = vec![
            window(0, Arm::A, 100.0, 1, none),
            window(0, Arm::B, 150.0, 1, none),
            window(1, Arm::A, 200.0, 1, none),
            window(1, Arm::B, 230.0, 1, none),
            window(2, Arm::A, 100.0, 1, none),
            window(2, Arm::B, 400.0, 1, none),
        ];
        let rounds: Vec<RoundRecord> = (0..3)
            .map(|r| {
                let a = windows[r * 2].headline;
                let b = windows[r * 2 + 1].headline;
                RoundRecord::of(r as u32, vec![Arm::A, Arm::B], &a, &b, None)
            })
            .collect();
        assert_eq!(rounds[0].relayed_minus_direct.ttft_p50_us, 50.0);
        assert_eq!(rounds[0].relayed_over_direct.ttft_p50, Some(1.5));
        let s = CompareSummary::of(&windows, &rounds).unwrap();
        // Deltas 50, 30, 300 → 50; ratios 1.5, 1.15, 4 → 1.5.
        assert_eq!(s.relayed_added.ttft_p50_us, 50.0);
        assert_eq!(s.relayed_ratio.ttft_p50, Some(1.5));
        assert_eq!(s.direct.ttft_p50_us, 100.0);
        assert_eq!(s.relayed.ttft_p50_us, 230.0);
        assert_eq!(s.relayed_added.chunk_latency_p50_us, 0.0);
        assert_eq!(s.relayed_ratio.chunk_latency_p50, Some(1.0));
        assert_eq!(s.peer, None);
        assert_eq!(s.peer_ratio, None);
        assert_eq!(s.direct_totals.windows, 3);
        assert_eq!(s.direct_totals.requests_ok, 30);
        assert!(CompareSummary::of(&windows[..1], &[]).is_none());
    }

    #[test]
    fn cpu_per_token_divides_relayed_cpu_by_relayed_tokens() {
        let b = |edge, node| CpuWindow {
            edge_us: Some(edge),
            node_us: Some(node),
            mock_us: Some(999),
            peer_us: None,
        };
        let windows = vec![
            window(
                0,
                Arm::A,
                1.0,
                100,
                CpuWindow {
                    mock_us: Some(500),
                    ..Default::default()
                },
            ),
            window(0, Arm::B, 1.0, 1000, b(20_000, 10_000)),
            window(1, Arm::B, 1.0, 1000, b(10_000, 0)),
        ];
        let cpu = CpuReport::of(&windows, 100);
        assert_eq!(cpu.tokens_relayed, 2000);
        assert_eq!(cpu.edge_cpu_us, 30_000);
        assert_eq!(cpu.node_cpu_us, 10_000);
        assert_eq!(cpu.edge_us_per_token, Some(15.0));
        assert_eq!(cpu.node_us_per_token, Some(5.0));
        assert_eq!(cpu.relay_us_per_token, Some(20.0));
        assert_eq!(cpu.mock_us_per_token_direct, Some(5.0));
        assert_eq!(CpuReport::of(&[], 100).relay_us_per_token, None);
    }

    #[test]
    fn rss_per_stream_is_growth_over_idle() {
        let idle = RssSample {
            active_streams: 0,
            edge_kib: 1000,
            node_kib: 500,
        };
        let at = |streams, edge, node| RssSample {
            active_streams: streams,
            edge_kib: edge,
            node_kib: node,
        };
        assert_eq!(at(64, 1064, 500).bytes_per_stream_over(&idle), Some(1024.0));
        assert_eq!(at(0, 2000, 500).bytes_per_stream_over(&idle), None);
        let report = RssReport::of(
            idle,
            vec![at(64, 1064, 500), at(64, 1000, 628), at(64, 1500, 500)],
            Some(at(1024, 2000, 1548)),
        );
        // 1024, 2048, 8000 → 2048.
        assert_eq!(report.bytes_per_stream, Some(2048.0));
        assert_eq!(report.ladder_bytes_per_stream, Some(2048.0));
    }

    fn level(streams: u64, outcome: LevelOutcome, ok: u64, over: u64) -> LadderLevel {
        LadderLevel {
            streams,
            outcome,
            reasons: Vec::new(),
            summary: Some(LoadSummary {
                requests_ok: ok,
                streams_over_gap_limit: over,
                max_gap_us: 45_000.0,
                ..Default::default()
            }),
            rss: None,
        }
    }

    #[test]
    fn ladder_levels_render_their_verdicts() {
        assert_eq!(
            level_text(&level(64, LevelOutcome::Pass, 64, 0)),
            "pass (max gap 45.00 ms)"
        );
        assert_eq!(
            level_text(&level(64, LevelOutcome::Fail, 60, 0)),
            "FAIL (60/64 completed)"
        );
        assert_eq!(
            level_text(&level(64, LevelOutcome::Fail, 64, 3)),
            "FAIL (3 gaps over limit, max 45.00 ms)"
        );
        let mut impossible = level(8192, LevelOutcome::Impossible, 0, 0);
        impossible.summary = None;
        assert_eq!(level_text(&impossible), "impossible (limits)");
        impossible.outcome = LevelOutcome::Skipped;
        assert_eq!(level_text(&impossible), "-");
    }

    fn win(round: u32, arm: Arm, figures: [f64; 5], tokens: u64, cpu: CpuWindow) -> WindowRecord {
        let mut w = window(round, arm, 0.0, tokens, cpu);
        w.headline = Headline::from_array(figures);
        w
    }

    fn test_report(levels: Vec<LevelReport>, peer: bool) -> CompareReport {
        let mut arms = vec![ArmInfo {
            arm: Arm::A,
            label: "direct".into(),
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
        }];
        if peer {
            arms.push(ArmInfo {
                arm: Arm::C,
                label: "peer".into(),
                url: "http://127.0.0.1:3".into(),
                model: "m".into(),
            });
        }
        CompareReport {
            schema: SCHEMA,
            created_unix_ms: 0,
            machine: MachineInfo {
                nproc: 2,
                kernel: "6.1".into(),
                cpu_model: "cpu".into(),
                driver: "io_uring".into(),
                local_ports: None,
            },
            nofile: NofileLimit {
                soft_before: 1024,
                soft: 4096,
                hard: 4096,
            },
            commit: Some("abc1234".into()),
            options: crate::compare::cli::CompareArgs {
                inter_token_ms: 20,
                ..Default::default()
            }
            .resolve(&[0, 1].into(), std::path::Path::new("/b/bench"))
            .unwrap(),
            arms,
            peer_name: if peer { "nginx" } else { "peer" }.into(),
            peer_processes: if peer {
                vec![
                    PeerProcess {
                        pid: 41,
                        command: Some("nginx: master process".into()),
                    },
                    PeerProcess {
                        pid: 42,
                        command: None,
                    },
                ]
            } else {
                Vec::new()
            },
            levels,
            ladder: None,
            notes: vec!["shared machine".into()],
        }
    }

    /// A level from one round of `a`, `b` (and `c`) with the given costs.
    fn level_of(
        streams: u64,
        figures: ([f64; 5], [f64; 5], Option<[f64; 5]>),
        costs: (Option<CpuReport>, Option<RssReport>),
        peer: Option<(CpuWindow, Option<PeerRssSample>, Result<u64, String>)>,
        peer_name: &str,
        highest: bool,
    ) -> LevelReport {
        let (a, b, c) = figures;
        let mut windows = vec![
            win(0, Arm::A, a, 10_000, CpuWindow::default()),
            win(0, Arm::B, b, 10_000, CpuWindow::default()),
        ];
        let mut peer_idle = None;
        if let Some(c) = c {
            let mut w = win(0, Arm::C, c, 10_000, CpuWindow::default());
            if let Some((cpu, rss, idle)) = peer {
                w.cpu = cpu;
                w.peer_rss = rss;
                if cpu.peer_us.is_none() {
                    w.peer_not_sampled = Some("CPU after the window: PID 42: gone".into());
                }
                peer_idle = Some(idle);
            }
            windows.push(w);
        }
        let rounds = vec![RoundRecord::of(
            0,
            vec![Arm::A, Arm::B],
            &windows[0].headline,
            &windows[1].headline,
            windows.get(2).map(|w| &w.headline),
        )];
        let summary = CompareSummary::of(&windows, &rounds).unwrap();
        let peer = peer_idle.map(|idle| PeerCost::of(&windows, idle));
        let (cpu, rss) = costs;
        let goals = check_goals(&GoalInputs {
            summary: &summary,
            cpu: cpu.as_ref(),
            rss: rss.as_ref(),
            peer: peer.as_ref(),
            peer_name,
            highest,
            clock_ticks_per_s: 100,
        });
        LevelReport {
            streams,
            windows,
            rounds,
            summary,
            cpu,
            rss,
            peer,
            goals,
        }
    }

    const A: [f64; 5] = [100.0, 200.0, 10.0, 20.0, 30.0];
    const B: [f64; 5] = [400.0, 900.0, 40.0, 120.0, 60.0];
    const C: [f64; 5] = [300.0, 500.0, 20.0, 60.0, 40.0];

    fn relay_costs() -> (Option<CpuReport>, Option<RssReport>) {
        let cpu = CpuReport {
            clock_ticks_per_s: 100,
            tokens_relayed: 10_000,
            edge_cpu_us: 300_000,
            node_cpu_us: 100_000,
            edge_us_per_token: Some(30.0),
            node_us_per_token: Some(10.0),
            relay_us_per_token: Some(40.0),
            mock_us_per_token_direct: Some(5.0),
        };
        let idle = RssSample {
            active_streams: 0,
            edge_kib: 1000,
            node_kib: 500,
        };
        let mid = RssSample {
            active_streams: 200,
            edge_kib: 2100,
            node_kib: 1000,
        };
        (Some(cpu), Some(RssReport::of(idle, vec![mid], None)))
    }

    fn peer_window(
        peer_us: Option<u64>,
    ) -> (CpuWindow, Option<PeerRssSample>, Result<u64, String>) {
        let cpu = CpuWindow {
            peer_us,
            ..Default::default()
        };
        let rss = PeerRssSample {
            active_streams: 200,
            kib: 4400,
        };
        (cpu, Some(rss), Ok(4000))
    }

    #[test]
    fn goals_divide_iop_by_the_peer_and_judge_each() {
        let level = level_of(
            200,
            (A, B, Some(C)),
            relay_costs(),
            Some(peer_window(Some(200_000))),
            "nginx",
            true,
        );
        let peer = level.peer.as_ref().unwrap();
        assert_eq!(peer.tokens, 10_000);
        assert_eq!(peer.cpu_us, Some(200_000));
        assert_eq!(peer.us_per_token, Some(20.0));
        assert_eq!(peer.idle_kib, Some(4000));
        // (4400 − 4000) KiB × 1024 ÷ 200 streams.
        assert_eq!(peer.bytes_per_stream, Some(2048.0));
        assert!(peer.not_sampled.is_empty());
        let g = &level.goals;
        let ids: Vec<GoalId> = g.iter().map(|g| g.goal).collect();
        assert_eq!(
            ids,
            [
                GoalId::AddedTtftP50,
                GoalId::AddedTtftP99,
                GoalId::AddedChunkLatencyP99,
                GoalId::CpuPerToken,
                GoalId::RssPerStream
            ]
        );
        // TTFT p50: IOP +300, nginx +200 → 1.5, at the limit: met.
        assert_eq!((g[0].iop, g[0].peer), (Some(300.0), Some(200.0)));
        assert_eq!((g[0].ratio, g[0].met), (Some(1.5), Some(true)));
        assert_eq!(g[0].max_ratio, Some(1.5));
        assert_eq!(g[0].unit, "us");
        // TTFT p99: +700 vs +300; chunk p99: +100 vs +40.
        assert_eq!((g[1].ratio, g[1].met), (Some(700.0 / 300.0), Some(false)));
        assert_eq!((g[2].ratio, g[2].met), (Some(2.5), Some(false)));
        // CPU: 40 µs vs 20 µs per token.
        assert_eq!((g[3].iop, g[3].peer), (Some(40.0), Some(20.0)));
        assert_eq!((g[3].ratio, g[3].met), (Some(2.0), Some(false)));
        assert_eq!(g[3].max_ratio, Some(1.2));
        // RSS: (3100 − 1500) KiB ÷ 200 = 8 KiB ≤ 12 KiB; nginx's shown.
        assert_eq!((g[4].iop, g[4].peer), (Some(8192.0), Some(2048.0)));
        assert_eq!((g[4].ratio, g[4].met), (None, Some(true)));
        assert_eq!(g[4].max_value, Some(12288.0));
        assert!(g.iter().all(|g| g.why_not.is_none()));
        let json = serde_json::to_value(&g[3]).unwrap();
        assert_eq!(json["goal"], "cpu_per_token");
        assert_eq!(json["unit"], "us_per_token");
    }

    #[test]
    fn lower_levels_judge_latency_only_and_tiny_peer_figures_are_not_divided() {
        // nginx adds 5 µs TTFT p50 (≤ 10 µs: n/a), nothing to chunk p99.
        let c = [105.0, 500.0, 10.0, 20.0, 30.0];
        let level = level_of(1, (A, B, Some(c)), (None, None), None, "nginx", false);
        let g = &level.goals;
        assert_eq!(g.len(), 3);
        assert_eq!((g[0].iop, g[0].peer), (Some(300.0), Some(5.0)));
        assert_eq!((g[0].ratio, g[0].met), (None, None));
        assert_eq!(
            g[0].why_not.as_deref(),
            Some("n/a: nginx's added figure is not above 10.0 µs")
        );
        assert_eq!((g[1].ratio, g[1].met), (Some(700.0 / 300.0), Some(false)));
        assert_eq!(g[2].peer, Some(0.0));
        assert_eq!(g[2].met, None);
        // A peer that adds less than nothing is not divided by either.
        let c = [90.0, 500.0, 10.0, 20.0, 30.0];
        let level = level_of(1, (A, B, Some(c)), (None, None), None, "nginx", false);
        assert_eq!(level.goals[0].peer, Some(-10.0));
        assert_eq!(level.goals[0].met, None);
    }

    #[test]
    fn goals_without_a_peer_or_its_samples_say_why() {
        let level = level_of(200, (A, B, None), relay_costs(), None, "peer", true);
        let g = &level.goals;
        for check in &g[..4] {
            assert_eq!(check.met, None, "{check:?}");
            assert_eq!(
                check.why_not.as_deref(),
                Some("no peer: ratios not computed")
            );
        }
        // The absolute part is still judged.
        assert_eq!((g[4].iop, g[4].met), (Some(8192.0), Some(true)));

        // A peer window whose CPU could not be read: not sampled, no crash.
        let level = level_of(
            200,
            (A, B, Some(C)),
            relay_costs(),
            Some(peer_window(None)),
            "nginx",
            true,
        );
        let peer = level.peer.as_ref().unwrap();
        assert_eq!(peer.cpu_us, None);
        assert_eq!(
            peer.not_sampled,
            ["round 1: CPU after the window: PID 42: gone"]
        );
        let cpu = &level.goals[3];
        assert_eq!((cpu.iop, cpu.peer, cpu.met), (Some(40.0), None, None));
        assert_eq!(
            cpu.why_not.as_deref(),
            Some("nginx not sampled: round 1: CPU after the window: PID 42: gone")
        );
        // Peer processes not given: the CPU goal says so.
        let level = level_of(200, (A, B, Some(C)), relay_costs(), None, "nginx", true);
        assert_eq!(
            level.goals[3].why_not.as_deref(),
            Some("nginx's processes not sampled (no --peer-pid)")
        );
        // CPU under five clock ticks in all the peer windows is too coarse.
        let level = level_of(
            200,
            (A, B, Some(C)),
            relay_costs(),
            Some(peer_window(Some(40_000))),
            "nginx",
            true,
        );
        assert_eq!(level.goals[3].peer, Some(4.0));
        assert_eq!(level.goals[3].met, None);
        assert_eq!(
            level.goals[3].why_not.as_deref(),
            Some("n/a: nginx's CPU over the windows is 5 clock ticks or less")
        );
        // An idle sample that failed: memory not sampled, CPU still is.
        let (cpu, rss, _) = peer_window(Some(200_000));
        let level = level_of(
            200,
            (A, B, Some(C)),
            relay_costs(),
            Some((cpu, rss, Err("PID 42: gone".into()))),
            "nginx",
            true,
        );
        let peer = level.peer.as_ref().unwrap();
        assert_eq!((peer.idle_kib, peer.bytes_per_stream), (None, None));
        assert_eq!(peer.not_sampled, ["idle: PID 42: gone"]);
        assert_eq!(level.goals[3].met, Some(false));
        assert_eq!(level.goals[4].peer, None);
    }

    #[test]
    fn table_shows_each_level_with_its_costs_and_goals() {
        let low = level_of(
            1,
            (A, B, Some(C)),
            relay_costs(),
            Some(peer_window(Some(200_000))),
            "nginx",
            false,
        );
        let high = level_of(
            200,
            (A, B, Some(C)),
            relay_costs(),
            Some(peer_window(None)),
            "nginx",
            true,
        );
        let table = render_table(&test_report(vec![low, high], true));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[..6],
            [
                "IOP relay vs direct — 6 rounds × 4.0 s per arm at each level (1, 200 streams), \
                 32 tokens at 20 ms (edge cores 0, node cores 1)",
                "machine: 2 CPUs, cpu, kernel 6.1, io_uring; commit abc1234",
                "peer C: nginx at http://127.0.0.1:3; CPU and memory sampled from PIDs \
                 41 (nginx: master process), 42 (not running)",
                "",
                "== 1 stream ==",
                "median of windows         direct A   relayed B       B − A    B / A      \
                 peer C       C − A    C / A",
            ]
        );
        assert_eq!(
            lines[6],
            "TTFT p50                  100.0 µs    400.0 µs   +300.0 µs    4.00x    \
             300.0 µs   +200.0 µs    3.00x"
        );
        assert_eq!(
            lines[18..29],
            [
                "CPU per nginx token: 20.00 µs (10000 tokens; 0.200 s of CPU)",
                "RSS per active stream (edge + node): 8.0 KiB at ~200 streams (idle edge 1.0 MiB, \
                 node 0.5 MiB)",
                "RSS per active stream (nginx): 2.0 KiB at ~200 streams (idle 3.9 MiB)",
                "",
                "goals at 1 stream                  IOP       nginx   IOP ÷ nginx       goal  met",
                "added TTFT p50               +300.0 µs   +200.0 µs         1.50x    ≤ 1.50x  yes",
                "added TTFT p99               +700.0 µs   +300.0 µs         2.33x    ≤ 1.50x  NO",
                "added chunk latency p99      +100.0 µs    +40.0 µs         2.50x    ≤ 1.50x  NO",
                "(IOP = Edge + Node; latency: added over direct, medians of per-round differences; \
                 CPU per token and RSS per stream are judged at the highest level only)",
                "",
                "== 200 streams ==",
            ]
        );
        let high_at = lines
            .iter()
            .position(|l| *l == "== 200 streams ==")
            .unwrap();
        assert_eq!(
            lines[high_at + 14..high_at + 17],
            [
                "CPU per nginx token: not sampled (round 1: CPU after the window: PID 42: gone)",
                "RSS per active stream (edge + node): 8.0 KiB at ~200 streams (idle edge 1.0 MiB, \
                 node 0.5 MiB)",
                "RSS per active stream (nginx): 2.0 KiB at ~200 streams (idle 3.9 MiB)",
            ]
        );
        assert_eq!(
            lines[high_at + 18..high_at + 26],
            [
                "goals at 200 streams               IOP       nginx   IOP ÷ nginx       goal  met",
                "added TTFT p50               +300.0 µs   +200.0 µs         1.50x    ≤ 1.50x  yes",
                "added TTFT p99               +700.0 µs   +300.0 µs         2.33x    ≤ 1.50x  NO",
                "added chunk latency p99      +100.0 µs    +40.0 µs         2.50x    ≤ 1.50x  NO",
                "CPU per token                 40.00 µs           -           n/a    ≤ 1.20x  n/a",
                "RSS per active stream          8.0 KiB     2.0 KiB             -   ≤ 12 KiB  yes",
                "  (nginx not sampled: round 1: CPU after the window: PID 42: gone)",
                "(IOP = Edge + Node; latency: added over direct, medians of per-round differences; \
                 CPU per token and RSS per stream are judged at the highest level only)",
            ]
        );
        assert!(
            table.ends_with("highest level only)\nnote: shared machine\n"),
            "{table}"
        );
    }

    #[test]
    fn table_without_a_peer_prints_the_absolute_goals() {
        let level = level_of(200, (A, B, None), relay_costs(), None, "peer", true);
        let table = render_table(&test_report(vec![level], false));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[..5],
            [
                "IOP relay vs direct — 6 rounds × 4.0 s per arm at each level (200 streams), \
                 32 tokens at 20 ms (edge cores 0, node cores 1)",
                "machine: 2 CPUs, cpu, kernel 6.1, io_uring; commit abc1234",
                "",
                "== 200 streams ==",
                "median of windows         direct A   relayed B       B − A    B / A",
            ]
        );
        assert_eq!(
            lines[6],
            "TTFT p99                  200.0 µs    900.0 µs   +700.0 µs    4.50x"
        );
        assert_eq!(
            lines[8],
            "chunk latency p99          20.0 µs    120.0 µs   +100.0 µs    6.00x"
        );
        assert_eq!(
            lines[12],
            "direct         10 ok,   0 errors,   0 truncated;      5.0 req/s,     \
             10000 tokens/s (median window)"
        );
        assert!(
            !table.contains("nginx") && !table.contains("peer C"),
            "{table}"
        );
        assert_eq!(
            lines[18..26],
            [
                "goals at 200 streams               IOP        peer    IOP ÷ peer       goal  met",
                "added TTFT p50               +300.0 µs           -           n/a    ≤ 1.50x  n/a",
                "added TTFT p99               +700.0 µs           -           n/a    ≤ 1.50x  n/a",
                "added chunk latency p99      +100.0 µs           -           n/a    ≤ 1.50x  n/a",
                "CPU per token                 40.00 µs           -           n/a    ≤ 1.20x  n/a",
                "RSS per active stream          8.0 KiB           -             -   ≤ 12 KiB  yes",
                "  (no peer: ratios not computed)",
                "(IOP = Edge + Node; latency: added over direct, medians of per-round differences; \
                 CPU per token and RSS per stream are judged at the highest level only)",
            ]
        );
    }

    #[test]
    fn a_long_peer_name_widens_its_columns() {
        let low = level_of(
            1,
            (A, B, Some(C)),
            relay_costs(),
            Some(peer_window(Some(200_000))),
            "vllm-router",
            false,
        );
        let mut out = String::new();
        render_goals(&mut out, "vllm-router", &low);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[1..3],
            [
                "goals at 1 stream                  IOP  vllm-router  IOP ÷ vllm-router       goal  met",
                "added TTFT p50               +300.0 µs    +200.0 µs              1.50x    ≤ 1.50x  yes",
            ]
        );
    }

    #[test]
    fn arms_have_labels() {
        assert_eq!(Arm::A.label(), "direct");
        assert_eq!(Arm::B.label(), "relayed");
        assert_eq!(Arm::C.label(), "peer");
        assert_eq!(serde_json::to_string(&Arm::B).unwrap(), "\"B\"");
    }
}
