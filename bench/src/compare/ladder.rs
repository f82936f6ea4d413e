//! The concurrency ladder: for each level N (256, 512, … 8192 streams; 64
//! and 128 in quick mode), start N streams (spread over a short ramp), one
//! request each, and check that every one completes with `[DONE]` and no
//! inter-chunk gap over twice the inter-token delay. The climb stops at the
//! first failing level; a level this machine's limits cannot hold is
//! reported as impossible instead of being run.
//!
//! The climbing and judging are pure (`climb` takes the level runner as a
//! closure) so they are tested without sockets.

use crate::load::{format_us, LoadSummary};

use super::report::{LadderArm, LadderLevel, LevelOutcome, RssSample};
use super::CompareError;

/// Descriptors a process needs beyond one per stream (listeners, logs,
/// the io_uring, pipes, the Node's Edge connection).
pub const FD_MARGIN: u64 = 256;

/// The standard ladder.
pub const FULL_LEVELS: [u64; 6] = [256, 512, 1024, 2048, 4096, 8192];
/// The quick ladder.
pub const QUICK_LEVELS: [u64; 2] = [64, 128];

/// The limits that bound how many streams can exist at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_NOFILE` soft limit of this process (the children inherit it).
    pub nofile: u64,
    /// Local ports for outgoing connections, if known.
    pub local_ports: Option<u64>,
}

/// Why `streams` concurrent streams cannot fit this machine's limits, if
/// they cannot. Every process on the path holds one socket per stream
/// (the load generator, the Edge, the Node, the mock), and every
/// client-side socket takes a local port.
pub fn limit_problem(streams: u64, limits: &Limits) -> Option<String> {
    let needed_fds = streams + FD_MARGIN;
    if needed_fds > limits.nofile {
        return Some(format!(
            "{streams} streams need about {needed_fds} open files in each process, \
             but RLIMIT_NOFILE is {} (raised to the hard limit already)",
            limits.nofile
        ));
    }
    if let Some(ports) = limits.local_ports {
        if streams + FD_MARGIN > ports {
            return Some(format!(
                "{streams} streams need about {} local ports, but \
                 net.ipv4.ip_local_port_range holds {ports}",
                streams + FD_MARGIN
            ));
        }
    }
    None
}

/// Judges a level: the reasons it failed (empty when it passed).
pub fn judge_level(summary: &LoadSummary, streams: u64) -> Vec<String> {
    let mut reasons = Vec::new();
    if summary.requests_ok < streams {
        let mut why = format!(
            "{} of {streams} streams completed (errors {}, truncated {})",
            summary.requests_ok, summary.errors_total, summary.truncated
        );
        if let Some(first) = &summary.first_error {
            why.push_str(&format!("; first error: {first}"));
        }
        reasons.push(why);
    }
    if summary.streams_over_gap_limit > 0 {
        reasons.push(format!(
            "{} streams had an inter-chunk gap over {} (largest {})",
            summary.streams_over_gap_limit,
            format_us(summary.gap_limit_us.unwrap_or(0.0)),
            format_us(summary.max_gap_us)
        ));
    }
    reasons
}

/// What running one level measured.
#[derive(Debug, Clone, PartialEq)]
pub struct LevelRun {
    /// The load summary.
    pub summary: LoadSummary,
    /// Memory sampled with every stream started, when sampled.
    pub rss: Option<RssSample>,
}

/// Climbs `levels` in order with `run_level`, stopping at the first level
/// that fails or cannot fit `limits`; later levels are listed as skipped.
pub fn climb(
    levels: &[u64],
    limits: &Limits,
    mut run_level: impl FnMut(u64) -> Result<LevelRun, CompareError>,
) -> Result<LadderArm, CompareError> {
    let mut arm = LadderArm {
        highest_passing: None,
        levels: Vec::with_capacity(levels.len()),
    };
    let mut stopped = false;
    for &streams in levels {
        if stopped {
            arm.levels.push(LadderLevel {
                streams,
                outcome: LevelOutcome::Skipped,
                reasons: Vec::new(),
                summary: None,
                rss: None,
            });
            continue;
        }
        if let Some(problem) = limit_problem(streams, limits) {
            stopped = true;
            arm.levels.push(LadderLevel {
                streams,
                outcome: LevelOutcome::Impossible,
                reasons: vec![problem],
                summary: None,
                rss: None,
            });
            continue;
        }
        let run = run_level(streams)?;
        let reasons = judge_level(&run.summary, streams);
        let outcome = if reasons.is_empty() {
            arm.highest_passing = Some(streams);
            LevelOutcome::Pass
        } else {
            stopped = true;
            LevelOutcome::Fail
        };
        arm.levels.push(LadderLevel {
            streams,
            outcome,
            reasons,
            summary: Some(run.summary),
            rss: run.rss,
        });
    }
    Ok(arm)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_summary(streams: u64) -> LoadSummary {
        LoadSummary {
            requests_started: streams,
            requests_ok: streams,
            max_gap_us: 21_000.0,
            gap_limit_us: Some(40_000.0),
            ..Default::default()
        }
    }

    const ROOMY: Limits = Limits {
        nofile: 1_000_000,
        local_ports: Some(28_232),
    };

    #[test]
    fn judging_names_every_shortfall() {
        assert!(judge_level(&ok_summary(64), 64).is_empty());
        let bad = LoadSummary {
            requests_ok: 60,
            errors_total: 1,
            truncated: 3,
            first_error: Some("stream ended without [DONE]".into()),
            streams_over_gap_limit: 2,
            ..ok_summary(64)
        };
        assert_eq!(
            judge_level(&bad, 64),
            vec![
                "60 of 64 streams completed (errors 1, truncated 3); first error: stream ended without [DONE]"
                    .to_string(),
                "2 streams had an inter-chunk gap over 40.00 ms (largest 21.00 ms)".to_string(),
            ]
        );
    }

    #[test]
    fn limits_are_reported_plainly() {
        let tight = Limits {
            nofile: 1024,
            local_ports: Some(28_232),
        };
        assert_eq!(limit_problem(512, &tight), None);
        assert_eq!(
            limit_problem(1024, &tight).unwrap(),
            "1024 streams need about 1280 open files in each process, but RLIMIT_NOFILE is 1024 \
             (raised to the hard limit already)"
        );
        let few_ports = Limits {
            nofile: 1_000_000,
            local_ports: Some(1000),
        };
        assert!(limit_problem(1000, &few_ports)
            .unwrap()
            .contains("local ports"));
        assert_eq!(
            limit_problem(
                1000,
                &Limits {
                    nofile: 1_000_000,
                    local_ports: None
                }
            ),
            None
        );
    }

    #[test]
    fn climb_stops_at_the_first_failure() {
        let mut ran = Vec::new();
        let arm = climb(&[64, 128, 256, 512], &ROOMY, |n| {
            ran.push(n);
            let mut summary = ok_summary(n);
            if n == 256 {
                summary.requests_ok = n - 1;
            }
            Ok(LevelRun { summary, rss: None })
        })
        .unwrap();
        assert_eq!(ran, [64, 128, 256]);
        assert_eq!(arm.highest_passing, Some(128));
        let outcomes: Vec<LevelOutcome> = arm.levels.iter().map(|l| l.outcome).collect();
        assert_eq!(
            outcomes,
            [
                LevelOutcome::Pass,
                LevelOutcome::Pass,
                LevelOutcome::Fail,
                LevelOutcome::Skipped
            ]
        );
        assert!(arm.levels[3].summary.is_none());
    }

    #[test]
    fn climb_reports_impossible_levels_without_running_them() {
        let limits = Limits {
            nofile: 600,
            local_ports: None,
        };
        let mut ran = Vec::new();
        let arm = climb(&[256, 512, 1024], &limits, |n| {
            ran.push(n);
            Ok(LevelRun {
                summary: ok_summary(n),
                rss: None,
            })
        })
        .unwrap();
        assert_eq!(ran, [256]);
        assert_eq!(arm.highest_passing, Some(256));
        assert_eq!(arm.levels[1].outcome, LevelOutcome::Impossible);
        assert!(arm.levels[1].reasons[0].contains("RLIMIT_NOFILE is 600"));
        assert_eq!(arm.levels[2].outcome, LevelOutcome::Skipped);
    }

    #[test]
    fn climb_with_nothing_passing() {
        let arm = climb(&[64, 128], &ROOMY, |n| {
            Ok(LevelRun {
                summary: LoadSummary {
                    streams_over_gap_limit: 1,
                    ..ok_summary(n)
                },
                rss: None,
            })
        })
        .unwrap();
        assert_eq!(arm.highest_passing, None);
        assert_eq!(arm.levels[0].outcome, LevelOutcome::Fail);
        assert!(climb(&[64], &ROOMY, |_| Err(CompareError::Interrupted)).is_err());
    }
}
