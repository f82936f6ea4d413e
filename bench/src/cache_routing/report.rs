//! The report of `bench cache-routing`: every window as measured, the
//! per-arm figures derived from them, the goals, and the markdown table.
//! Pure: windows in, numbers and text out.
//!
//! Definitions (docs/bench-cache-routing.md):
//!
//! - TTFT p50/p99: nearest-rank percentiles ([`percentile`]) of the arm's
//!   samples pooled over its windows; a multi-turn sample is a turn after
//!   the first, the others every successful request.
//! - cache hit rate: Σ Δ`cached_tokens_hit` ÷ Σ Δ`prompt_tokens_seen` over
//!   the arm's windows and every mock.
//! - requests/s: successful requests ÷ the sum of the windows' wall times.
//! - ratios: of the reported figures (the p50s in µs, the requests/s).

use std::fmt::Write;

use serde::Serialize;

use super::workload::{Policy, Workload};
use super::CacheRoutingOptions;
use crate::load::format_us;
use crate::procstat::MachineInfo;

/// The JSON schema id.
pub const SCHEMA: &str = "iop-bench-cache-routing/1";
/// Goal: the affinity policies' multi-turn TTFT p50 at most this many times
/// the pinned arm's.
pub const TTFT_RATIO_GOAL_MAX: f64 = 1.2;
/// Goal: the prefix policy's no-shared-prefix throughput at least this
/// share of least_loaded's.
pub const THROUGHPUT_RATIO_GOAL_MIN: f64 = 0.95;

/// The Edge's routing decisions for an arm's model(s) (`/status`
/// `models[].routing`): dispatches by route, and of those by load, the
/// ones where the imbalance rule passed over a preferred provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct EdgeRouting {
    /// To the least loaded free provider.
    pub routed_by_load: u64,
    /// To the holder of the longest matched prefix.
    pub routed_by_match: u64,
    /// To the session's provider.
    pub routed_by_session: u64,
    /// Of `routed_by_load`, passed over as too busy.
    pub imbalance_fallbacks: u64,
}

impl EdgeRouting {
    /// The counters of `after` less those of `self`.
    pub fn until(self, after: EdgeRouting) -> EdgeRouting {
        EdgeRouting {
            routed_by_load: after.routed_by_load.saturating_sub(self.routed_by_load),
            routed_by_match: after.routed_by_match.saturating_sub(self.routed_by_match),
            routed_by_session: after
                .routed_by_session
                .saturating_sub(self.routed_by_session),
            imbalance_fallbacks: after
                .imbalance_fallbacks
                .saturating_sub(self.imbalance_fallbacks),
        }
    }

    /// The sum of both.
    pub fn plus(self, other: EdgeRouting) -> EdgeRouting {
        EdgeRouting {
            routed_by_load: self.routed_by_load + other.routed_by_load,
            routed_by_match: self.routed_by_match + other.routed_by_match,
            routed_by_session: self.routed_by_session + other.routed_by_session,
            imbalance_fallbacks: self.imbalance_fallbacks + other.imbalance_fallbacks,
        }
    }
}

/// One arm's window as measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowRecord {
    /// The round (0-based).
    pub round: u32,
    /// Its place in the round's order (0-based).
    pub position: u32,
    /// The arm.
    pub policy: Policy,
    /// Requests the window meant to send.
    pub requests_planned: u64,
    /// Requests sent (fewer than planned only after a failed turn ended
    /// its conversation, or an interruption).
    pub requests_sent: u64,
    /// Requests answered with a complete stream.
    pub requests_ok: u64,
    /// Requests that failed.
    pub requests_failed: u64,
    /// The first failure, if any.
    pub first_error: Option<String>,
    /// First request written → last request ended, µs.
    pub wall_us: u64,
    /// Δ `prompt_tokens_seen`, summed over the mocks.
    pub prompt_tokens_seen: u64,
    /// Δ `cached_tokens_hit`, summed over the mocks.
    pub cached_tokens_hit: u64,
    /// Δ of the Edge's routing counters of the arm's model(s).
    pub edge_routing: EdgeRouting,
    /// The TTFT samples, µs, in request order: multi-turn turns after the
    /// first; every successful request otherwise.
    pub ttft_us: Vec<u64>,
    /// Multi-turn: the first turns' TTFTs, µs (empty otherwise).
    pub first_turn_ttft_us: Vec<u64>,
}

/// One arm's figures over its windows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmSummary {
    /// The arm.
    pub policy: Policy,
    /// Its windows.
    pub windows: u32,
    /// Σ requests sent.
    pub requests_sent: u64,
    /// Σ requests answered.
    pub requests_ok: u64,
    /// Σ requests failed.
    pub requests_failed: u64,
    /// TTFT samples pooled.
    pub samples: u64,
    /// TTFT p50, µs.
    pub ttft_p50_us: Option<u64>,
    /// TTFT p99, µs.
    pub ttft_p99_us: Option<u64>,
    /// Multi-turn: the first turns' TTFT p50, µs.
    pub first_turn_ttft_p50_us: Option<u64>,
    /// Σ cached ÷ Σ seen prompt tokens.
    pub cache_hit_rate: Option<f64>,
    /// Σ ok ÷ Σ wall time.
    pub requests_per_s: Option<f64>,
    /// Σ of the windows' Edge routing counters.
    pub edge_routing: EdgeRouting,
}

/// One workload on one pool.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadReport {
    /// Which.
    pub workload: Workload,
    /// Requests in flight at most: conversations (multi-turn) or workers.
    pub concurrency: u32,
    /// Requests each window means to send.
    pub requests_per_window: u64,
    /// Every window, in the order run.
    pub windows: Vec<WindowRecord>,
    /// Per arm, in [`Policy::ALL`] order.
    pub arms: Vec<ArmSummary>,
}

impl WorkloadReport {
    /// The summary of `policy`'s arm.
    pub fn arm(&self, policy: Policy) -> Option<&ArmSummary> {
        self.arms.iter().find(|a| a.policy == policy)
    }
}

/// A goal of the routing work: a ratio of two reported figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GoalCheck {
    /// Its JSON name.
    pub name: &'static str,
    /// What it compares, for the table.
    pub what: &'static str,
    /// The ratio, when both figures are there.
    pub value: Option<f64>,
    /// The bound.
    pub limit: f64,
    /// `true`: met when `value ≤ limit`; `false`: when `value ≥ limit`.
    pub at_most: bool,
    /// Whether it is met (`None` without a value).
    pub met: Option<bool>,
}

impl GoalCheck {
    fn of(
        name: &'static str,
        what: &'static str,
        value: Option<f64>,
        limit: f64,
        at_most: bool,
    ) -> Self {
        let met = value.map(|v| if at_most { v <= limit } else { v >= limit });
        GoalCheck {
            name,
            what,
            value,
            limit,
            at_most,
            met,
        }
    }
}

/// One pool size's measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolReport {
    /// P.
    pub providers: u32,
    /// C, the multi-turn conversations.
    pub conversations: u32,
    /// K, the shared system prompts.
    pub shared_prompts: u32,
    /// Each mock's prefix cache, tokens.
    pub cache_tokens_per_provider: u64,
    /// Every workload, in the order run.
    pub workloads: Vec<WorkloadReport>,
    /// The goals.
    pub goals: Vec<GoalCheck>,
}

impl PoolReport {
    /// The report of `workload`.
    pub fn workload(&self, workload: Workload) -> Option<&WorkloadReport> {
        self.workloads.iter().find(|w| w.workload == workload)
    }
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheRoutingReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// When it was made (Unix ms).
    pub created_unix_ms: i64,
    /// The machine.
    pub machine: MachineInfo,
    /// `git rev-parse --short HEAD`, when available.
    pub commit: Option<String>,
    /// The options, defaults resolved.
    pub options: CacheRoutingOptions,
    /// One per `--providers` entry.
    pub pools: Vec<PoolReport>,
    /// Σ failed requests over every window.
    pub failed_requests: u64,
    /// How to read the figures.
    pub notes: Vec<String>,
}

/// The nearest-rank `q` percentile (0 < q ≤ 1) of `samples`: the smallest
/// sample with at least `q × n` samples at or below it.
pub fn percentile(samples: &[u64], q: f64) -> Option<u64> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// `a ÷ b`, when both are there and `b` is positive.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// The summary of `policy`'s windows among `windows`.
pub fn summarize_arm(policy: Policy, windows: &[WindowRecord]) -> ArmSummary {
    let mine: Vec<&WindowRecord> = windows.iter().filter(|w| w.policy == policy).collect();
    let sum = |f: fn(&WindowRecord) -> u64| mine.iter().map(|w| f(w)).sum::<u64>();
    let samples: Vec<u64> = mine
        .iter()
        .flat_map(|w| w.ttft_us.iter().copied())
        .collect();
    let first: Vec<u64> = mine
        .iter()
        .flat_map(|w| w.first_turn_ttft_us.iter().copied())
        .collect();
    let seen = sum(|w| w.prompt_tokens_seen);
    let hit = sum(|w| w.cached_tokens_hit);
    let ok = sum(|w| w.requests_ok);
    let wall_us = sum(|w| w.wall_us);
    ArmSummary {
        policy,
        windows: mine.len() as u32,
        requests_sent: sum(|w| w.requests_sent),
        requests_ok: ok,
        requests_failed: sum(|w| w.requests_failed),
        samples: samples.len() as u64,
        ttft_p50_us: percentile(&samples, 0.5),
        ttft_p99_us: percentile(&samples, 0.99),
        first_turn_ttft_p50_us: percentile(&first, 0.5),
        cache_hit_rate: (seen > 0).then(|| hit as f64 / seen as f64),
        requests_per_s: (wall_us > 0).then(|| ok as f64 * 1e6 / wall_us as f64),
        edge_routing: mine
            .iter()
            .fold(EdgeRouting::default(), |sum, w| sum.plus(w.edge_routing)),
    }
}

/// The goals of one pool from its workloads' arm summaries.
pub fn check_goals(workloads: &[WorkloadReport]) -> Vec<GoalCheck> {
    let figure = |workload: Workload, policy: Policy, f: fn(&ArmSummary) -> Option<f64>| {
        workloads
            .iter()
            .find(|w| w.workload == workload)
            .and_then(|w| w.arm(policy))
            .and_then(f)
    };
    let p50 = |a: &ArmSummary| a.ttft_p50_us.map(|us| us as f64);
    let rps = |a: &ArmSummary| a.requests_per_s;
    let mt = Workload::MultiTurn;
    let ns = Workload::NoSharedPrefix;
    vec![
        GoalCheck::of(
            "prefix_ttft_p50_over_pinned",
            "multi-turn TTFT p50 (turns > 1), prefix ÷ pinned",
            ratio(
                figure(mt, Policy::Prefix, p50),
                figure(mt, Policy::Pinned, p50),
            ),
            TTFT_RATIO_GOAL_MAX,
            true,
        ),
        GoalCheck::of(
            "session_ttft_p50_over_pinned",
            "multi-turn TTFT p50 (turns > 1), session ÷ pinned",
            ratio(
                figure(mt, Policy::Session, p50),
                figure(mt, Policy::Pinned, p50),
            ),
            TTFT_RATIO_GOAL_MAX,
            true,
        ),
        GoalCheck::of(
            "no_shared_throughput_prefix_over_least_loaded",
            "no-shared-prefix requests/s, prefix ÷ least_loaded",
            ratio(
                figure(ns, Policy::Prefix, rps),
                figure(ns, Policy::LeastLoaded, rps),
            ),
            THROUGHPUT_RATIO_GOAL_MIN,
            false,
        ),
    ]
}

fn us_text(us: Option<u64>) -> String {
    us.map_or_else(|| "-".into(), |us| format_us(us as f64))
}

fn percent_text(rate: Option<f64>) -> String {
    rate.map_or_else(|| "-".into(), |r| format!("{:.1} %", r * 100.0))
}

/// The markdown table (one section per pool) and the notes.
pub fn render_table(report: &CacheRoutingReport) -> String {
    let o = &report.options;
    let mut out = String::new();
    let _ = writeln!(out, "# bench cache-routing\n");
    let _ = writeln!(
        out,
        "mock: TTFT {} ms + {} µs per uncached prompt word, {} reply tokens {} ms apart; \
         {} rounds per workload, arm order reversed every other round",
        o.ttft_ms, o.prefill_us_per_token, o.reply_tokens, o.inter_token_ms, o.rounds
    );
    for pool in &report.pools {
        let _ = writeln!(
            out,
            "\n## {} providers (capacity {} each, prefix cache {} tokens each ≈ {} conversations)\n",
            pool.providers, o.capacity, pool.cache_tokens_per_provider, o.cache_conversations
        );
        let _ = writeln!(
            out,
            "multi-turn: {} conversations × {} turns; shared system prompt: {} prompts of {} words; \
             no shared prefix: prompts of {} words\n",
            pool.conversations, o.turns, pool.shared_prompts, o.shared_prompt_words, o.unique_prompt_words
        );
        let _ = writeln!(
            out,
            "| workload | policy | ok / sent | TTFT p50 | TTFT p99 | cache hit | req/s | routed load / match / session |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|");
        for workload in &pool.workloads {
            for arm in &workload.arms {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} / {} | {} | {} | {} | {} | {} / {} / {} |",
                    workload.workload.label(),
                    arm.policy.name(),
                    arm.requests_ok,
                    arm.requests_sent,
                    us_text(arm.ttft_p50_us),
                    us_text(arm.ttft_p99_us),
                    percent_text(arm.cache_hit_rate),
                    arm.requests_per_s
                        .map_or_else(|| "-".into(), |r| format!("{r:.1}")),
                    arm.edge_routing.routed_by_load,
                    arm.edge_routing.routed_by_match,
                    arm.edge_routing.routed_by_session,
                );
            }
        }
        let _ = writeln!(
            out,
            "\n| goal ({} providers) | ratio | target | |",
            pool.providers
        );
        let _ = writeln!(out, "|---|---:|---:|---|");
        for goal in &pool.goals {
            let _ = writeln!(
                out,
                "| {} | {} | {} {:.2} | {} |",
                goal.what,
                goal.value.map_or_else(|| "-".into(), |v| format!("{v:.3}")),
                if goal.at_most { "≤" } else { "≥" },
                goal.limit,
                match goal.met {
                    Some(true) => "met",
                    Some(false) => "MISSED",
                    None => "-",
                }
            );
        }
    }
    if report.failed_requests > 0 {
        let _ = writeln!(
            out,
            "\nFAILED: {} requests failed (first errors in the JSON windows)",
            report.failed_requests
        );
    }
    if !report.notes.is_empty() {
        let _ = writeln!(out);
        for note in &report.notes {
            let _ = writeln!(out, "- {note}");
        }
    }
    out
}

impl crate::compare::Report for CacheRoutingReport {
    fn created_unix_ms(&self) -> i64 {
        self.created_unix_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(policy: Policy, round: u32, ttft_us: Vec<u64>) -> WindowRecord {
        WindowRecord {
            round,
            position: 0,
            policy,
            requests_planned: 4,
            requests_sent: 4,
            requests_ok: 4,
            requests_failed: 0,
            first_error: None,
            wall_us: 500_000,
            prompt_tokens_seen: 1000,
            cached_tokens_hit: 250,
            edge_routing: EdgeRouting {
                routed_by_load: 1,
                routed_by_match: 3,
                routed_by_session: 0,
                imbalance_fallbacks: 1,
            },
            ttft_us,
            first_turn_ttft_us: vec![9, 7],
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[5], 0.99), Some(5));
        assert_eq!(percentile(&[4, 1, 3, 2], 0.5), Some(2));
        assert_eq!(percentile(&[5, 1, 3], 0.5), Some(3));
        let hundred: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(percentile(&hundred, 0.99), Some(99));
        assert_eq!(percentile(&hundred, 0.5), Some(50));
        assert_eq!(percentile(&[1, 2], 0.99), Some(2));
    }

    #[test]
    fn an_arm_pools_its_windows_only() {
        let windows = [
            window(Policy::Prefix, 0, vec![10, 30]),
            window(Policy::Pinned, 0, vec![1000]),
            window(Policy::Prefix, 1, vec![20, 40]),
        ];
        let arm = summarize_arm(Policy::Prefix, &windows);
        assert_eq!(arm.windows, 2);
        assert_eq!(
            (arm.requests_sent, arm.requests_ok, arm.requests_failed),
            (8, 8, 0)
        );
        assert_eq!(arm.samples, 4);
        assert_eq!(arm.ttft_p50_us, Some(20));
        assert_eq!(arm.ttft_p99_us, Some(40));
        assert_eq!(arm.first_turn_ttft_p50_us, Some(7));
        assert_eq!(arm.cache_hit_rate, Some(0.25));
        assert_eq!(arm.requests_per_s, Some(8.0));
        assert_eq!(
            arm.edge_routing,
            EdgeRouting {
                routed_by_load: 2,
                routed_by_match: 6,
                routed_by_session: 0,
                imbalance_fallbacks: 2,
            }
        );
        let none = summarize_arm(Policy::Session, &windows);
        assert_eq!(none.windows, 0);
        assert_eq!(
            (none.ttft_p50_us, none.cache_hit_rate, none.requests_per_s),
            (None, None, None)
        );
    }

    #[test]
    fn goals_are_ratios_of_the_reported_figures() {
        let arms = |p50s: [u64; 4], rps: [f64; 4]| {
            Policy::ALL
                .iter()
                .zip(p50s.iter().zip(rps))
                .map(|(&policy, (&p50, rps))| ArmSummary {
                    policy,
                    windows: 2,
                    requests_sent: 1,
                    requests_ok: 1,
                    requests_failed: 0,
                    samples: 1,
                    ttft_p50_us: Some(p50),
                    ttft_p99_us: Some(p50),
                    first_turn_ttft_p50_us: None,
                    cache_hit_rate: None,
                    requests_per_s: Some(rps),
                    edge_routing: EdgeRouting::default(),
                })
                .collect()
        };
        let workload = |workload, arms| WorkloadReport {
            workload,
            concurrency: 1,
            requests_per_window: 1,
            windows: Vec::new(),
            arms,
        };
        // least_loaded, session, prefix, pinned
        let workloads = [
            workload(Workload::MultiTurn, arms([900, 130, 110, 100], [1.0; 4])),
            workload(
                Workload::NoSharedPrefix,
                arms([1; 4], [100.0, 1.0, 94.0, 1.0]),
            ),
        ];
        let goals = check_goals(&workloads);
        let by_name = |n: &str| goals.iter().find(|g| g.name == n).unwrap();
        let prefix = by_name("prefix_ttft_p50_over_pinned");
        assert_eq!((prefix.value, prefix.met), (Some(1.1), Some(true)));
        let session = by_name("session_ttft_p50_over_pinned");
        assert_eq!((session.value, session.met), (Some(1.3), Some(false)));
        let tput = by_name("no_shared_throughput_prefix_over_least_loaded");
        assert_eq!((tput.value, tput.met), (Some(0.94), Some(false)));
        assert!(!tput.at_most);
        // Without the shared-prompt workload nothing else is needed; without
        // the multi-turn one its goals have no value.
        let goals = check_goals(&workloads[1..]);
        assert_eq!((goals[0].value, goals[0].met), (None, None));
    }
}
