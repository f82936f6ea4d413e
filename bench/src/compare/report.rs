//! The comparison's report: the JSON document (every figure, per window
//! too) and the human table. Pure: built from measured values, no IO.

use serde::{Deserialize, Serialize};

use crate::load::{format_us, LoadSummary};
use crate::procstat::{MachineInfo, NofileLimit};
use crate::stats::{median, Headline, HeadlineRatio};

use super::CompareOptions;

/// Version tag of the JSON document.
pub const SCHEMA: &str = "iop-bench-compare/1";

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
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
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
    /// Edge and Node with no stream in flight (after warm-up, before the
    /// first window).
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
    let s = &report.summary;
    let mut out = String::new();
    let m = &report.machine;
    out.push_str(&format!(
        "IOP relay vs direct — {} rounds × {:.1} s per arm, {} streams, {} tokens at {} ms \
         (edge cores {}, node cores {})\n",
        o.windows,
        o.window_ms as f64 / 1000.0,
        o.concurrency,
        o.tokens,
        o.inter_token_ms,
        o.edge_cores,
        o.node_cores,
    ));
    out.push_str(&format!(
        "machine: {} CPUs, {}, kernel {}, {}; commit {}\n\n",
        m.nproc,
        m.cpu_model,
        m.kernel,
        m.driver,
        report.commit.as_deref().unwrap_or("unknown")
    ));
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
        format!(
            "{name:<8} {:>8} ok, {:>3} errors, {:>3} truncated; {:>8.1} req/s, {:>9.0} tokens/s (median window)\n",
            t.requests_ok, t.errors, t.truncated, t.requests_per_s, t.tokens_per_s
        )
    };
    out.push_str(&totals("direct", &s.direct_totals));
    out.push_str(&totals("relayed", &s.relayed_totals));
    if let Some(t) = &s.peer_totals {
        out.push_str(&totals("peer", t));
    }
    out.push('\n');
    match &report.cpu {
        Some(cpu) => {
            let us = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2} µs"));
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
    match &report.rss {
        Some(rss) => {
            let per =
                |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{:.1} KiB", v / 1024.0));
            out.push_str(&format!(
                "RSS per active stream (edge + node): {} at ~{} streams (idle edge {}, node {})",
                per(rss.bytes_per_stream),
                rss.window_samples.first().map_or(0, |s| s.active_streams),
                kib_text(rss.idle.edge_kib),
                kib_text(rss.idle.node_kib),
            ));
            if let Some(l) = &rss.ladder_sample {
                out.push_str(&format!(
                    "; {} at {} streams (edge {}, node {})",
                    per(rss.ladder_bytes_per_stream),
                    l.active_streams,
                    kib_text(l.edge_kib),
                    kib_text(l.node_kib)
                ));
            }
            out.push('\n');
        }
        None => out.push_str("RSS per active stream: not measured\n"),
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

    #[test]
    fn table_shows_absolute_figures_deltas_and_ratios() {
        let none = CpuWindow::default();
        let windows = vec![
            window(0, Arm::A, 100.0, 10, none),
            window(0, Arm::B, 150.0, 10, none),
        ];
        let rounds = vec![RoundRecord::of(
            0,
            vec![Arm::A, Arm::B],
            &windows[0].headline,
            &windows[1].headline,
            None,
        )];
        let summary = CompareSummary::of(&windows, &rounds).unwrap();
        let report = CompareReport {
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
            arms: Vec::new(),
            windows,
            rounds,
            summary,
            cpu: None,
            rss: None,
            ladder: None,
            notes: vec!["shared machine".into()],
        };
        let table = render_table(&report);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            "IOP relay vs direct — 6 rounds × 10.0 s per arm, 64 streams, 32 tokens at 20 ms \
             (edge cores 0, node cores 1)"
        );
        assert_eq!(
            lines[1],
            "machine: 2 CPUs, cpu, kernel 6.1, io_uring; commit abc1234"
        );
        assert_eq!(
            lines[3],
            "median of windows         direct A   relayed B       B − A    B / A"
        );
        assert_eq!(
            lines[4],
            "TTFT p50                  100.0 µs    150.0 µs    +50.0 µs    1.50x"
        );
        assert_eq!(
            lines[6],
            "chunk latency p50          10.0 µs     10.0 µs     +0.0 µs    1.00x"
        );
        assert!(table.contains("CPU per relayed token: not measured"));
        assert!(table.ends_with("note: shared machine\n"));
    }

    #[test]
    fn arms_have_labels() {
        assert_eq!(Arm::A.label(), "direct");
        assert_eq!(Arm::B.label(), "relayed");
        assert_eq!(Arm::C.label(), "peer");
        assert_eq!(serde_json::to_string(&Arm::B).unwrap(), "\"B\"");
    }
}
