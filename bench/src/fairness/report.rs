//! The pure part of `bench fairness`: the request ids that tag each arm,
//! phase and key; the access-log lines read back; B's queue waits and
//! their percentiles; the admissions per window and each key's share; the
//! goal; the markdown table.

use serde::Serialize;

use super::FairnessOptions;
use crate::load::{format_us, LoadSummary};
use crate::procstat::MachineInfo;

/// Schema of the JSON report.
pub const SCHEMA: &str = "iop-bench-fairness/1";

/// The issue's goal: with weights 1:1, each key's share of the admissions
/// in a window while both are backlogged is within this fraction of half.
pub const GOAL_TOLERANCE: f64 = 0.10;

/// How the two keys are configured: see the module docs of
/// [`super`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arm {
    /// Both keys one principal: arrival order.
    Fifo,
    /// Two principals, weights 1:1, one class.
    Wfq,
    /// A batch, B interactive.
    Priority,
}

impl Arm {
    /// Every arm, in the order they run and print.
    pub const ALL: [Arm; 3] = [Arm::Fifo, Arm::Wfq, Arm::Priority];

    /// The arm's name: its model's, and in its request ids.
    pub fn name(self) -> &'static str {
        match self {
            Arm::Fifo => "fifo",
            Arm::Wfq => "wfq",
            Arm::Priority => "priority",
        }
    }

    fn from_name(name: &str) -> Option<Arm> {
        Arm::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The principal of `key`'s client key in this arm.
    pub fn principal(self, key: Key) -> String {
        match self {
            Arm::Fifo => "fifo".into(),
            _ => format!("{}-{}", self.name(), key.name()),
        }
    }

    /// The `priority` of `key`'s client key in this arm.
    pub fn priority(self, key: Key) -> &'static str {
        match (self, key) {
            (Arm::Priority, Key::A) => "batch",
            (Arm::Priority, Key::B) => "interactive",
            _ => "standard",
        }
    }
}

/// The two phases of an arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// A floods, B at a low rate: B's queue wait.
    Latency,
    /// A floods, B above capacity: the shares while both are backlogged.
    Share,
}

impl Phase {
    /// Both phases, in the order they run.
    pub const ALL: [Phase; 2] = [Phase::Latency, Phase::Share];

    /// The phase's name in request ids.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Latency => "latency",
            Phase::Share => "share",
        }
    }

    fn from_name(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// The flooding key and the other one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Key {
    /// Floods.
    A,
    /// Sends at a low rate (latency) or above capacity (share).
    B,
}

impl Key {
    /// Both keys.
    pub const ALL: [Key; 2] = [Key::A, Key::B];

    /// `a` or `b`.
    pub fn name(self) -> &'static str {
        match self {
            Key::A => "a",
            Key::B => "b",
        }
    }

    fn from_name(name: &str) -> Option<Key> {
        Key::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// The `x-request-id` prefix of `key`'s requests in `arm`'s `phase` (the
/// load client appends `-<n>`).
pub fn request_id_prefix(arm: Arm, phase: Phase, key: Key) -> String {
    format!("fair-{}-{}-{}", arm.name(), phase.name(), key.name())
}

/// The arm, phase and key of a request id made from
/// [`request_id_prefix`]; `None` for any other id.
pub fn parse_request_id(id: &str) -> Option<(Arm, Phase, Key)> {
    let mut parts = id.strip_prefix("fair-")?.split('-');
    let arm = Arm::from_name(parts.next()?)?;
    let phase = Phase::from_name(parts.next()?)?;
    let key = Key::from_name(parts.next()?)?;
    parts.next()?.parse::<u64>().ok()?;
    parts.next().is_none().then_some((arm, phase, key))
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` (the access log's `ts`) as Unix ms.
pub fn parse_ts_ms(ts: &str) -> Option<i64> {
    let b = ts.as_bytes();
    if b.len() != 24 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' {
        return None;
    }
    if b[16] != b':' || b[19] != b'.' || b[23] != b'Z' {
        return None;
    }
    let num = |from: usize, to: usize| -> Option<i64> {
        let text = ts.get(from..to)?;
        text.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| text.parse().ok())
            .flatten()
    };
    let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hour, minute, second, ms) = (num(11, 13)?, num(14, 16)?, num(17, 19)?, num(20, 23)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    if second > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000 + ms)
}

/// One request of this run, from its access-log line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestLine {
    /// Its arm.
    pub arm: Arm,
    /// Its phase.
    pub phase: Phase,
    /// Its key.
    pub key: Key,
    /// When the Edge had read it, Unix ms.
    pub read_ms: f64,
    /// When its first body byte left, Unix ms (none: it never got one).
    pub first_byte_ms: Option<f64>,
    /// When it ended, Unix ms.
    pub end_ms: f64,
    /// `completed`, or what ended it.
    pub outcome: String,
}

/// The request of one access-log line (JSON), if it is one of this run's.
pub fn parse_line(line: &str) -> Option<RequestLine> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let (arm, phase, key) = parse_request_id(v["request_id"].as_str()?)?;
    let end_ms = parse_ts_ms(v["ts"].as_str()?)? as f64;
    let read_ms = end_ms - v["duration_ms"].as_f64()?;
    Some(RequestLine {
        arm,
        phase,
        key,
        read_ms,
        first_byte_ms: v["ttft_ms"].as_f64().map(|t| read_ms + t),
        end_ms,
        outcome: v["outcome"].as_str()?.to_string(),
    })
}

/// One queue wait: measured, or a lower bound (cut off while queued).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Wait {
    /// Ms.
    pub ms: f64,
    /// A lower bound: the request never got a first byte.
    pub censored: bool,
}

/// A request's queue wait: the Edge's TTFT less the mock's; one without a
/// first byte waited at least until it ended.
pub fn wait_of(line: &RequestLine, mock_ttft_ms: f64) -> Wait {
    match line.first_byte_ms {
        Some(first) => Wait {
            ms: (first - line.read_ms - mock_ttft_ms).max(0.0),
            censored: false,
        },
        None => Wait {
            ms: (line.end_ms - line.read_ms).max(0.0),
            censored: true,
        },
    }
}

/// A percentile of waits, and whether it is only a lower bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WaitPercentile {
    /// Ms.
    pub ms: f64,
    /// A censored wait at or below it: the true percentile may be higher.
    pub lower_bound: bool,
}

/// The `q` percentile (nearest rank) of `waits`.
pub fn wait_percentile(waits: &[Wait], q: f64) -> Option<WaitPercentile> {
    if waits.is_empty() {
        return None;
    }
    let mut sorted: Vec<Wait> = waits.to_vec();
    sorted.sort_by(|a, b| a.ms.total_cmp(&b.ms));
    let rank = (q * sorted.len() as f64).ceil() as usize;
    let ms = sorted[rank.clamp(1, sorted.len()) - 1].ms;
    Some(WaitPercentile {
        ms,
        lower_bound: sorted.iter().any(|w| w.censored && w.ms <= ms),
    })
}

/// B's queue wait in one arm's latency phase.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WaitSummary {
    /// B's requests in the access log.
    pub requests: u64,
    /// Those that got a first byte.
    pub served: u64,
    /// p50.
    pub p50: Option<WaitPercentile>,
    /// p99.
    pub p99: Option<WaitPercentile>,
}

/// B's waits among `lines` (one arm's latency phase).
pub fn wait_summary(lines: &[&RequestLine], mock_ttft_ms: f64) -> WaitSummary {
    let waits: Vec<Wait> = lines
        .iter()
        .filter(|l| l.key == Key::B)
        .map(|l| wait_of(l, mock_ttft_ms))
        .collect();
    WaitSummary {
        requests: waits.len() as u64,
        served: waits.iter().filter(|w| !w.censored).count() as u64,
        p50: wait_percentile(&waits, 0.5),
        p99: wait_percentile(&waits, 0.99),
    }
}

/// One share window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    /// Its start, ms after the phase's first request was read.
    pub start_ms: u64,
    /// A's admissions in it.
    pub a: u64,
    /// B's admissions in it.
    pub b: u64,
    /// Both keys had a request queued through the whole window.
    pub both_backlogged: bool,
}

impl Window {
    /// B's share of its admissions (none without any).
    pub fn b_share(&self) -> Option<f64> {
        let all = self.a + self.b;
        (all > 0).then(|| self.b as f64 / all as f64)
    }
}

/// A request's admission, estimated: its first byte less the mock's TTFT.
fn admitted_ms(line: &RequestLine, mock_ttft_ms: f64) -> Option<f64> {
    line.first_byte_ms.map(|f| f - mock_ttft_ms)
}

/// Whether the intervals `(from, to)` together cover `[start, end]`
/// without a gap.
pub fn covered(intervals: &[(f64, f64)], start: f64, end: f64) -> bool {
    let mut sorted = intervals.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut until = start;
    for (from, to) in sorted {
        if from > until {
            break;
        }
        until = until.max(to);
        if until >= end {
            return true;
        }
    }
    false
}

/// Splits one arm's share phase (`lines`) into windows of `window_ms` from
/// its first request read to its last, but no further than `span_ms` from
/// the first (the phase's sending time: a loaded Edge may read requests
/// late), and counts each key's admissions per window. A key is backlogged through a window when at every moment
/// of it one of its requests was queued: read, and not yet admitted (nor
/// cut off).
pub fn share_windows(
    lines: &[&RequestLine],
    window_ms: u64,
    span_ms: u64,
    mock_ttft_ms: f64,
) -> Vec<Window> {
    let Some(first) = lines.iter().map(|l| l.read_ms).min_by(f64::total_cmp) else {
        return Vec::new();
    };
    let last = lines
        .iter()
        .map(|l| l.read_ms)
        .max_by(f64::total_cmp)
        .unwrap_or(first);
    let width = window_ms.max(1) as f64;
    let count = ((last - first).min(span_ms as f64) / width).floor() as u64;
    (0..count)
        .map(|k| {
            let start = first + k as f64 * width;
            let end = start + width;
            let admitted = |key: Key| {
                lines
                    .iter()
                    .filter(|l| l.key == key)
                    .filter_map(|l| admitted_ms(l, mock_ttft_ms))
                    .filter(|&t| t >= start && t < end)
                    .count() as u64
            };
            let backlogged = |key: Key| {
                let queued: Vec<(f64, f64)> = lines
                    .iter()
                    .filter(|l| l.key == key)
                    .map(|l| {
                        let left = admitted_ms(l, mock_ttft_ms).unwrap_or(l.end_ms);
                        (l.read_ms, left)
                    })
                    .collect();
                covered(&queued, start, end)
            };
            Window {
                start_ms: k * window_ms,
                a: admitted(Key::A),
                b: admitted(Key::B),
                both_backlogged: backlogged(Key::A) && backlogged(Key::B),
            }
        })
        .collect()
}

/// The shares over the windows during which both keys were backlogged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShareSummary {
    /// Windows of the phase.
    pub windows: u64,
    /// Of which both keys were backlogged.
    pub backlogged_windows: u64,
    /// A's admissions in those windows.
    pub a: u64,
    /// B's admissions in those windows.
    pub b: u64,
    /// B's share of all their admissions.
    pub b_share: Option<f64>,
    /// B's smallest share in one of them.
    pub b_share_min: Option<f64>,
    /// B's largest share in one of them.
    pub b_share_max: Option<f64>,
}

/// Sums the windows where both were backlogged.
pub fn share_summary(windows: &[Window]) -> ShareSummary {
    let both: Vec<&Window> = windows.iter().filter(|w| w.both_backlogged).collect();
    let a = both.iter().map(|w| w.a).sum::<u64>();
    let b = both.iter().map(|w| w.b).sum::<u64>();
    let shares: Vec<f64> = both.iter().filter_map(|w| w.b_share()).collect();
    ShareSummary {
        windows: windows.len() as u64,
        backlogged_windows: both.len() as u64,
        a,
        b,
        b_share: (a + b > 0).then(|| b as f64 / (a + b) as f64),
        b_share_min: shares.iter().copied().min_by(f64::total_cmp),
        b_share_max: shares.iter().copied().max_by(f64::total_cmp),
    }
}

/// Whether every window with both keys backlogged gave each key a share
/// within [`GOAL_TOLERANCE`] of half (two keys: B's share within it says
/// A's is too); `None` when no window had both backlogged.
pub fn fair_share_goal(summary: &ShareSummary) -> Option<bool> {
    let low = 0.5 * (1.0 - GOAL_TOLERANCE);
    let high = 0.5 * (1.0 + GOAL_TOLERANCE);
    match (summary.b_share_min, summary.b_share_max) {
        (Some(min), Some(max)) => Some(min >= low - 1e-9 && max <= high + 1e-9),
        _ => None,
    }
}

/// What the client saw of one key in one phase.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientSide {
    /// Requests sent.
    pub sent: u64,
    /// Complete responses.
    pub ok: u64,
    /// Cut off at the phase's end, or failed otherwise.
    pub not_ok: u64,
    /// The client's TTFT p50 of the complete ones, µs.
    pub ttft_p50_us: f64,
    /// The client's TTFT p99, µs.
    pub ttft_p99_us: f64,
}

impl ClientSide {
    /// From a load run's summary.
    pub fn of(summary: &LoadSummary) -> Self {
        ClientSide {
            sent: summary.requests_started,
            ok: summary.requests_ok,
            not_ok: summary.requests_started.saturating_sub(summary.requests_ok),
            ttft_p50_us: summary.ttft.p50_us,
            ttft_p99_us: summary.ttft.p99_us,
        }
    }
}

/// One arm's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmReport {
    /// The arm.
    pub arm: Arm,
    /// B's queue wait in the latency phase (from the access log).
    pub b_wait: WaitSummary,
    /// The client's view of B in the latency phase.
    pub b_client: ClientSide,
    /// The client's view of A in the latency phase.
    pub a_client: ClientSide,
    /// The share phase's windows.
    pub windows: Vec<Window>,
    /// The shares while both were backlogged.
    pub share: ShareSummary,
    /// The 1:1 goal (the wfq arm only).
    pub goal_met: Option<bool>,
}

/// One arm's report from its access-log lines and the client summaries
/// of the latency phase (A, B).
pub fn arm_report(
    arm: Arm,
    lines: &[RequestLine],
    client: (&LoadSummary, &LoadSummary),
    opts: &FairnessOptions,
) -> ArmReport {
    let mock_ttft = opts.ttft_ms as f64;
    let of = |phase: Phase| -> Vec<&RequestLine> {
        lines
            .iter()
            .filter(|l| l.arm == arm && l.phase == phase)
            .collect()
    };
    let windows = share_windows(&of(Phase::Share), opts.window_ms, opts.share_ms, mock_ttft);
    let share = share_summary(&windows);
    ArmReport {
        arm,
        b_wait: wait_summary(&of(Phase::Latency), mock_ttft),
        a_client: ClientSide::of(client.0),
        b_client: ClientSide::of(client.1),
        goal_met: (arm == Arm::Wfq).then(|| fair_share_goal(&share)).flatten(),
        windows,
        share,
    }
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct FairnessReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// When the report was made, Unix ms.
    pub created_unix_ms: i64,
    /// The machine.
    pub machine: MachineInfo,
    /// The commit measured, if known.
    pub commit: Option<String>,
    /// Whether the binaries are a debug build.
    pub debug_build: bool,
    /// The options.
    pub options: FairnessOptions,
    /// Requests/s each arm's provider serves at capacity.
    pub capacity_per_s: f64,
    /// Each arm.
    pub arms: Vec<ArmReport>,
    /// Access-log lines dropped by the Edge (its writer queue was full):
    /// those requests are missing from the figures.
    pub access_log_dropped_lines: u64,
    /// Notes on the method.
    pub notes: Vec<String>,
}

fn wait_text(p: Option<WaitPercentile>) -> String {
    match p {
        None => "-".into(),
        Some(p) => format!(
            "{}{}",
            if p.lower_bound { "≥ " } else { "" },
            format_us(p.ms * 1000.0)
        ),
    }
}

fn share_text(share: Option<f64>) -> String {
    share.map_or_else(|| "-".into(), |s| format!("{:.1} %", s * 100.0))
}

/// `a ÷ b` of two percentiles, marked `≥` when only `a` is a lower bound
/// and `≤` when only `b` is; unknown (`-`) when both are.
fn ratio_text(a: Option<WaitPercentile>, b: Option<WaitPercentile>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b.ms > 0.0 => {
            let mark = match (a.lower_bound, b.lower_bound) {
                (false, false) => "",
                (true, false) => "≥ ",
                (false, true) => "≤ ",
                // Both only bounds: the ratio could be anything.
                (true, true) => return "-".into(),
            };
            format!("{mark}{:.1}", a.ms / b.ms)
        }
        _ => "-".into(),
    }
}

/// The markdown tables printed after a run.
pub fn render_table(report: &FairnessReport) -> String {
    let o = &report.options;
    let mut out = format!(
        "\n## bench fairness ({} build{})\n\ncapacity {} per model ({:.1} requests/s: mock TTFT {} ms, then {} more tokens {} ms apart); \
         A floods at {:.0}× capacity; B at {:.1}× (latency phase, {} s) and {:.1}× (share phase, {} s, windows of {} s)\n\n",
        if report.debug_build { "debug" } else { "release" },
        if o.quick { ", quick" } else { "" },
        o.capacity,
        report.capacity_per_s,
        o.ttft_ms,
        o.tokens.saturating_sub(1),
        o.inter_token_ms,
        o.flood_factor,
        o.latency_b_factor,
        o.latency_ms as f64 / 1000.0,
        o.share_b_factor,
        o.share_ms as f64 / 1000.0,
        o.window_ms as f64 / 1000.0,
    );
    out.push_str(
        "| arm | B wait p50 | B wait p99 | B served | B client TTFT p50 | windows both backlogged | B share | B share min–max | A share min–max | goal (1:1 within 10 % of ½) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for arm in &report.arms {
        let s = &arm.share;
        let a_min = s.b_share_max.map(|b| 1.0 - b);
        let a_max = s.b_share_min.map(|b| 1.0 - b);
        out.push_str(&format!(
            "| {} | {} | {} | {} of {} | {} | {} of {} | {} | {} – {} | {} – {} | {} |\n",
            arm.arm.name(),
            wait_text(arm.b_wait.p50),
            wait_text(arm.b_wait.p99),
            arm.b_wait.served,
            arm.b_wait.requests,
            if arm.b_client.ok > 0 {
                format_us(arm.b_client.ttft_p50_us)
            } else {
                "-".into()
            },
            s.backlogged_windows,
            s.windows,
            share_text(s.b_share),
            share_text(s.b_share_min),
            share_text(s.b_share_max),
            share_text(a_min),
            share_text(a_max),
            match arm.goal_met {
                Some(true) => "**met**",
                Some(false) => "**missed**",
                None if arm.arm == Arm::Wfq => "not measured (no window with both backlogged)",
                None => "-",
            },
        ));
    }
    let find = |arm: Arm| report.arms.iter().find(|a| a.arm == arm);
    if let (Some(fifo), Some(wfq), Some(prio)) =
        (find(Arm::Fifo), find(Arm::Wfq), find(Arm::Priority))
    {
        out.push_str(&format!(
            "\n| ratio | p50 | p99 |\n|---|---|---|\n\
             | B wait fifo ÷ wfq | {} | {} |\n\
             | B wait fifo ÷ priority | {} | {} |\n\
             | B wait wfq ÷ priority | {} | {} |\n",
            ratio_text(fifo.b_wait.p50, wfq.b_wait.p50),
            ratio_text(fifo.b_wait.p99, wfq.b_wait.p99),
            ratio_text(fifo.b_wait.p50, prio.b_wait.p50),
            ratio_text(fifo.b_wait.p99, prio.b_wait.p99),
            ratio_text(wfq.b_wait.p50, prio.b_wait.p50),
            ratio_text(wfq.b_wait.p99, prio.b_wait.p99),
        ));
    }
    if report.access_log_dropped_lines > 0 {
        out.push_str(&format!(
            "\nthe Edge dropped {} access-log lines: those requests are missing above\n",
            report.access_log_dropped_lines
        ));
    }
    for note in &report.notes {
        out.push_str(&format!("\n- {note}"));
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(key: Key, read: f64, first: Option<f64>, end: f64) -> RequestLine {
        RequestLine {
            arm: Arm::Wfq,
            phase: Phase::Share,
            key,
            read_ms: read,
            first_byte_ms: first,
            end_ms: end,
            outcome: if first.is_some() {
                "completed"
            } else {
                "client_disconnect"
            }
            .into(),
        }
    }

    #[test]
    fn request_ids_round_trip_and_others_are_ignored() {
        for arm in Arm::ALL {
            for phase in Phase::ALL {
                for key in Key::ALL {
                    let id = format!("{}-17", request_id_prefix(arm, phase, key));
                    assert_eq!(parse_request_id(&id), Some((arm, phase, key)));
                }
            }
        }
        assert_eq!(
            request_id_prefix(Arm::Priority, Phase::Latency, Key::B),
            "fair-priority-latency-b"
        );
        for other in [
            "req_0123",
            "fair-wfq-share-a",
            "fair-wfq-share-a-x",
            "fair-wfq-share-c-1",
            "fair-lifo-share-a-1",
            "fair-wfq-share-a-1-2",
        ] {
            assert_eq!(parse_request_id(other), None, "{other}");
        }
    }

    #[test]
    fn timestamps_parse_as_the_edge_writes_them() {
        for ms in [0, 1_796_198_472_345, 951_782_400_999, 4_102_444_799_001] {
            let ts = edge_bin::plane::access::rfc3339_ms(ms);
            assert_eq!(parse_ts_ms(&ts), Some(ms), "{ts}");
        }
        assert_eq!(
            parse_ts_ms("2026-12-02T08:01:12.345Z"),
            Some(1_796_198_472_345)
        );
        assert_eq!(parse_ts_ms("2026-12-02 08:01:12.345Z"), None);
        assert_eq!(parse_ts_ms("2026-13-02T08:01:12.345Z"), None);
        assert_eq!(parse_ts_ms("2026-12-02T08:01:12.34Z"), None);
        assert_eq!(parse_ts_ms("2026-12-02T08:0x:12.345Z"), None);
    }

    #[test]
    fn access_log_lines_give_read_first_byte_and_end() {
        let text = r#"{"ts":"2026-12-02T08:01:12.345Z","request_id":"fair-fifo-latency-b-3","principal":"fifo","method":"POST","path":"/v1/chat/completions","model":"fifo","status":200,"outcome":"completed","attempts":1,"ttft_ms":1245.5,"duration_ms":1600.25,"bytes_in":90}"#;
        let l = parse_line(text).unwrap();
        let end = 1_796_198_472_345.0;
        assert_eq!(
            l,
            RequestLine {
                arm: Arm::Fifo,
                phase: Phase::Latency,
                key: Key::B,
                read_ms: end - 1600.25,
                first_byte_ms: Some(end - 1600.25 + 1245.5),
                end_ms: end,
                outcome: "completed".into(),
            }
        );
        let cut = r#"{"ts":"2026-12-02T08:01:12.345Z","request_id":"fair-wfq-share-a-9","ttft_ms":null,"duration_ms":500.0,"outcome":"client_disconnect"}"#;
        let l = parse_line(cut).unwrap();
        assert_eq!((l.first_byte_ms, l.read_ms), (None, end - 500.0));
        assert_eq!(parse_line(&text.replace("fair-fifo", "warm-fifo")), None);
        assert_eq!(parse_line("ts=2026 request_id=fair-wfq-share-a-1"), None);
    }

    #[test]
    fn waits_subtract_the_mock_and_censored_ones_mark_bounds() {
        let served = line(Key::B, 1000.0, Some(1350.0), 2000.0);
        assert_eq!(
            wait_of(&served, 50.0),
            Wait {
                ms: 300.0,
                censored: false
            }
        );
        // Faster than the mock's TTFT (clock rounding): no negative wait.
        assert_eq!(wait_of(&line(Key::B, 0.0, Some(40.0), 90.0), 50.0).ms, 0.0);
        let cut = line(Key::B, 1000.0, None, 9000.0);
        assert_eq!(
            wait_of(&cut, 50.0),
            Wait {
                ms: 8000.0,
                censored: true
            }
        );
        let w = |ms, censored| Wait { ms, censored };
        let waits = [
            w(10.0, false),
            w(40.0, false),
            w(20.0, false),
            w(30.0, false),
            w(900.0, true),
        ];
        assert_eq!(
            wait_percentile(&waits, 0.5),
            Some(WaitPercentile {
                ms: 30.0,
                lower_bound: false
            })
        );
        assert_eq!(
            wait_percentile(&waits, 0.99),
            Some(WaitPercentile {
                ms: 900.0,
                lower_bound: true
            })
        );
        // A censored wait below the median may hide a longer one.
        let waits = [w(5.0, true), w(20.0, false), w(30.0, false)];
        assert!(wait_percentile(&waits, 0.5).unwrap().lower_bound);
        assert_eq!(wait_percentile(&[], 0.5), None);
        let lines = [
            line(Key::B, 0.0, Some(150.0), 500.0),
            line(Key::A, 0.0, Some(5000.0), 5400.0),
            line(Key::B, 0.0, None, 700.0),
        ];
        let refs: Vec<&RequestLine> = lines.iter().collect();
        let s = wait_summary(&refs, 50.0);
        assert_eq!((s.requests, s.served), (2, 1));
        assert_eq!(s.p50.unwrap().ms, 100.0);
        assert_eq!(
            s.p99,
            Some(WaitPercentile {
                ms: 700.0,
                lower_bound: true
            })
        );
    }

    #[test]
    fn windows_count_admissions_and_backlog() {
        // Mock TTFT 10: admitted = first byte − 10. Windows of 100 ms from
        // t = 0 (the first read) to t = 350 (the last read): three.
        let lines = [
            // A: one read at 0, waits until 250 (admitted 250).
            line(Key::A, 0.0, Some(260.0), 600.0),
            // A: admitted at 20, 40 and 120.
            line(Key::A, 0.0, Some(30.0), 400.0),
            line(Key::A, 0.0, Some(50.0), 400.0),
            line(Key::A, 10.0, Some(130.0), 400.0),
            // B: admitted at 60; one read at 90 and cut off at 400.
            line(Key::B, 5.0, Some(70.0), 400.0),
            line(Key::B, 90.0, None, 400.0),
            // B admitted at 210; the last read at 350.
            line(Key::B, 100.0, Some(220.0), 400.0),
            line(Key::A, 350.0, None, 400.0),
            // A: read at 0, cut off at 400.
            line(Key::A, 0.0, None, 400.0),
        ];
        let refs: Vec<&RequestLine> = lines.iter().collect();
        let windows = share_windows(&refs, 100, 1000, 10.0);
        // The span cuts the windows off: reads after it do not count.
        assert_eq!(share_windows(&refs, 100, 250, 10.0), windows[..2]);
        assert_eq!(
            windows,
            vec![
                Window {
                    start_ms: 0,
                    a: 2,
                    b: 1,
                    // B's first request was read at 5, after the start.
                    both_backlogged: false
                },
                Window {
                    start_ms: 100,
                    a: 1,
                    b: 0,
                    both_backlogged: true
                },
                Window {
                    start_ms: 200,
                    a: 1,
                    b: 1,
                    both_backlogged: true
                },
            ]
        );
        let s = share_summary(&windows);
        assert_eq!(
            s,
            ShareSummary {
                windows: 3,
                backlogged_windows: 2,
                a: 2,
                b: 1,
                b_share: Some(1.0 / 3.0),
                b_share_min: Some(0.0),
                b_share_max: Some(0.5),
            }
        );
        assert_eq!(fair_share_goal(&s), Some(false));
        assert!(share_windows(&[], 100, 1000, 10.0).is_empty());
    }

    #[test]
    fn backlog_is_coverage_without_a_gap() {
        // Neither interval alone covers [100, 250]; together they do.
        assert!(covered(&[(120.0, 260.0), (0.0, 150.0)], 100.0, 250.0));
        // A gap from 150 to 160.
        assert!(!covered(&[(0.0, 150.0), (160.0, 260.0)], 100.0, 250.0));
        // Nothing queued at the start.
        assert!(!covered(&[(101.0, 400.0)], 100.0, 250.0));
        // Ends too early.
        assert!(!covered(&[(0.0, 249.0)], 100.0, 250.0));
        assert!(covered(&[(100.0, 250.0)], 100.0, 250.0));
        assert!(!covered(&[], 100.0, 250.0));
    }

    #[test]
    fn the_goal_is_ten_percent_of_half() {
        let summary = |min: f64, max: f64| ShareSummary {
            windows: 4,
            backlogged_windows: 3,
            a: 60,
            b: 60,
            b_share: Some(0.5),
            b_share_min: Some(min),
            b_share_max: Some(max),
        };
        assert_eq!(fair_share_goal(&summary(0.45, 0.55)), Some(true));
        assert_eq!(fair_share_goal(&summary(0.5, 0.5)), Some(true));
        assert_eq!(fair_share_goal(&summary(0.44, 0.5)), Some(false));
        assert_eq!(fair_share_goal(&summary(0.5, 0.56)), Some(false));
        let none = ShareSummary {
            backlogged_windows: 0,
            b_share: None,
            b_share_min: None,
            b_share_max: None,
            ..summary(0.0, 0.0)
        };
        assert_eq!(fair_share_goal(&none), None);
    }

    #[test]
    fn ratios_carry_bounds() {
        let p = |ms, lower_bound| Some(WaitPercentile { ms, lower_bound });
        assert_eq!(ratio_text(p(900.0, false), p(30.0, false)), "30.0");
        assert_eq!(ratio_text(p(900.0, true), p(30.0, false)), "≥ 30.0");
        assert_eq!(ratio_text(p(900.0, false), p(30.0, true)), "≤ 30.0");
        assert_eq!(ratio_text(p(900.0, true), p(30.0, true)), "-");
        assert_eq!(ratio_text(p(900.0, false), p(0.0, false)), "-");
        assert_eq!(ratio_text(None, p(1.0, false)), "-");
        assert_eq!(
            wait_text(p(1500.0, true)),
            format!("≥ {}", format_us(1.5e6))
        );
        assert_eq!(share_text(Some(0.4567)), "45.7 %");
    }
}
