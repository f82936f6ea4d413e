//! Passive health: outlier detection of one provider, sans-IO (Envoy's
//! `consecutive_gateway_failure` model).
//!
//! ```text
//!   failure ×N in a row            ejection time over, or a fresh
//!  (connect, reset, 5xx, stall,    `available` CAPABILITIES answer
//!   response-wait timeout)
//!  [in rotation] ───────────────────► [ejected] ──────────────────► [in rotation]
//!        ▲ success: count back to 0       │ (the multiplier grows per
//!        └────────────────────────────────┘  ejection, back to 0 after
//!                                            max_ejection_time in rotation)
//! ```
//!
//! An ejection lasts `base_ejection_time × n` for the provider's `n`-th
//! ejection in a row, at most `max(base_ejection_time, max_ejection_time)`;
//! `n` starts over once the provider has stayed in rotation for
//! `max_ejection_time`. Whether an ejection may happen at all (at most
//! `max_ejection_percent` of a model's providers out, at least one) is
//! Control's decision: it knows the pools. This is separate from the stall
//! overlay (H4–H6), which keeps its own rules.

use std::time::{Duration, Instant};

use super::terminal::FailureReason;

/// The outlier-detection settings (`[outlier_detection]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutlierPolicy {
    /// Consecutive failures that eject a provider (≥ 1).
    pub consecutive_failures: u32,
    /// The first ejection's length.
    pub base_ejection_time: Duration,
    /// The longest ejection; also how long a provider must stay in rotation
    /// for its ejection multiplier to start over.
    pub max_ejection_time: Duration,
    /// At most this share (percent) of a model's providers is ejected at
    /// once, but at least one; 0 never ejects.
    pub max_ejection_percent: u32,
}

impl OutlierPolicy {
    /// How many of a pool of `pool` providers may be ejected at once.
    pub fn max_ejected(&self, pool: usize) -> usize {
        if self.max_ejection_percent == 0 || pool == 0 {
            return 0;
        }
        (pool * self.max_ejection_percent.min(100) as usize / 100).max(1)
    }
}

/// One ejection in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ejection {
    /// The failure that tipped it.
    pub reason: FailureReason,
    /// When it began.
    pub since: Instant,
    /// When it ends (re-admission by timer).
    pub until: Instant,
}

/// How an ejected provider came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readmission {
    /// Its ejection time was over.
    Timer,
    /// A fresh `available` CAPABILITIES answer about it.
    Probe,
}

impl Readmission {
    /// The metric label and log spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Readmission::Timer => "timer",
            Readmission::Probe => "probe",
        }
    }
}

/// The outlier state of one provider.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutlierState {
    consecutive: u32,
    ejected: Option<Ejection>,
    /// Ejections in a row (the ejection time multiplier).
    multiplier: u32,
    /// When it last came back into rotation.
    readmitted_at: Option<Instant>,
}

impl OutlierState {
    /// Failures in a row so far.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive
    }

    /// The ejection in force, if any.
    pub fn ejection(&self) -> Option<Ejection> {
        self.ejected
    }

    /// Ejections in a row (1 during the first).
    pub fn ejections_in_a_row(&self) -> u32 {
        self.multiplier
    }

    /// An attempt succeeded: the failure count starts over (an ejection in
    /// force stays: it ends by time or probe).
    pub fn on_success(&mut self) {
        self.consecutive = 0;
    }

    /// An attempt failed; true when the count reached the policy's
    /// threshold and the provider is not ejected yet (Control then decides
    /// whether it may go: [`OutlierState::eject`]).
    pub fn on_failure(&mut self, policy: &OutlierPolicy) -> bool {
        self.consecutive = self.consecutive.saturating_add(1);
        self.ejected.is_none() && self.consecutive >= policy.consecutive_failures.max(1)
    }

    /// Ejects the provider at `now` for `reason`; returns the ejection.
    pub fn eject(
        &mut self,
        now: Instant,
        reason: FailureReason,
        policy: &OutlierPolicy,
    ) -> Ejection {
        let rested = self
            .readmitted_at
            .is_some_and(|at| now.saturating_duration_since(at) >= policy.max_ejection_time);
        if rested {
            self.multiplier = 0;
        }
        self.multiplier = self.multiplier.saturating_add(1);
        let longest = policy.max_ejection_time.max(policy.base_ejection_time);
        let length = policy
            .base_ejection_time
            .saturating_mul(self.multiplier)
            .min(longest);
        let ejection = Ejection {
            reason,
            since: now,
            until: now + length,
        };
        self.ejected = Some(ejection);
        ejection
    }

    /// Takes the provider back into rotation at `now`; the ejection that
    /// ended, if it was ejected.
    pub fn readmit(&mut self, now: Instant) -> Option<Ejection> {
        let ended = self.ejected.take()?;
        self.consecutive = 0;
        self.readmitted_at = Some(now);
        Some(ended)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: Duration = Duration::from_secs(10);
    const MAX: Duration = Duration::from_secs(35);

    fn policy() -> OutlierPolicy {
        OutlierPolicy {
            consecutive_failures: 3,
            base_ejection_time: BASE,
            max_ejection_time: MAX,
            max_ejection_percent: 50,
        }
    }

    #[test]
    fn the_threshold_counts_failures_in_a_row() {
        let (p, mut s) = (policy(), OutlierState::default());
        assert!(!s.on_failure(&p));
        assert!(!s.on_failure(&p));
        s.on_success();
        assert_eq!(s.consecutive_failures(), 0);
        assert!(!s.on_failure(&p));
        assert!(!s.on_failure(&p));
        assert!(s.on_failure(&p));
        // Control may refuse the ejection: the next failure asks again.
        assert!(s.on_failure(&p));
        assert_eq!(s.consecutive_failures(), 4);
    }

    #[test]
    fn ejections_grow_to_the_cap_and_start_over_after_a_rest() {
        let (p, mut s) = (policy(), OutlierState::default());
        let t0 = iop_engine::clock::now();
        let first = s.eject(t0, FailureReason::ConnectFailure, &p);
        assert_eq!(first.until - t0, BASE);
        assert!(
            !s.on_failure(&p),
            "an ejected provider is not ejected again"
        );
        assert_eq!(s.readmit(first.until), Some(first));
        assert_eq!(s.readmit(first.until), None, "once");
        assert_eq!(s.consecutive_failures(), 0);
        // Ejected again soon: twice as long, then three times, then capped.
        let t1 = first.until + Duration::from_secs(1);
        let lengths: Vec<Duration> = (0..3)
            .map(|i| {
                let at = t1 + Duration::from_secs(3 * i);
                let e = s.eject(at, FailureReason::Stalled, &p);
                s.readmit(at + Duration::from_secs(1));
                e.until - e.since
            })
            .collect();
        assert_eq!(lengths, [2 * BASE, 3 * BASE, MAX]);
        assert_eq!(s.ejections_in_a_row(), 4);
        // After max_ejection_time in rotation, the multiplier starts over.
        // Last re-admitted at t1 + 7 s.
        let rested = t1 + Duration::from_secs(7) + MAX;
        let e = s.eject(rested, FailureReason::UpstreamStatus, &p);
        assert_eq!((e.until - e.since, s.ejections_in_a_row()), (BASE, 1));
        assert_eq!(s.ejection(), Some(e));
    }

    #[test]
    fn the_share_of_a_pool_that_may_be_ejected() {
        let p = policy();
        assert_eq!(
            [0, 1, 2, 3, 4, 5].map(|n| p.max_ejected(n)),
            [0, 1, 1, 1, 2, 2]
        );
        let none = OutlierPolicy {
            max_ejection_percent: 0,
            ..p
        };
        assert_eq!(none.max_ejected(10), 0);
        let all = OutlierPolicy {
            max_ejection_percent: 100,
            ..p
        };
        assert_eq!(all.max_ejected(3), 3);
    }
}
