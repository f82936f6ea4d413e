//! The spread of a reconnect wait ([`Jitter`], `reconnect.jitter_percent`):
//! uniform over `interval × (1 ± p)`, so the configured interval stays the
//! mean while a fleet that lost its Edge in one instant redials spread over
//! the whole window. The configuration parses it; the supervisor draws each
//! wait through [`Jitter::spread`].

use std::time::Duration;

/// How far a reconnect wait may stray from the interval, either side, in
/// percent (`reconnect.jitter_percent`). The wait is uniform over
/// `[interval × (1 − p), interval × (1 + p)]`: its mean is the interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Jitter {
    percent: u8,
}

impl Jitter {
    /// Every wait is exactly the interval.
    pub const NONE: Jitter = Jitter { percent: 0 };
    /// The default: waits between half and one and a half intervals.
    pub const DEFAULT: Jitter = Jitter { percent: 50 };
    /// The largest jitter: waits between 0 and twice the interval.
    pub const MAX_PERCENT: u8 = 100;

    /// A jitter of `percent`; `None` above [`Jitter::MAX_PERCENT`].
    pub fn new(percent: u8) -> Option<Self> {
        (percent <= Self::MAX_PERCENT).then_some(Self { percent })
    }

    /// The percent either side.
    pub fn percent(self) -> u8 {
        self.percent
    }

    /// The wait for `interval` given one uniform 64-bit `draw`. Intervals
    /// beyond what nanoseconds in 64 bits hold (≈ 584 years) count as that.
    pub fn spread(self, interval: Duration, draw: u64) -> Duration {
        let interval_ns = interval.as_nanos().min(u128::from(u64::MAX));
        let span_ns = interval_ns * u128::from(self.percent) / 100;
        // span < 2^64 and draw < 2^64, so the product fits; shifted by 63
        // it is 2 × span × draw / 2^64, uniform over [0, 2 × span).
        let offset_ns = (span_ns * u128::from(draw)) >> 63;
        let wait_ns = interval_ns - span_ns + offset_ns;
        Duration::from_nanos(u64::try_from(wait_ns).unwrap_or(u64::MAX))
    }
}

impl Default for Jitter {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_lands_on_the_window_edges_and_saturates() {
        assert_eq!(Jitter::new(101), None);
        assert_eq!(Jitter::default().percent(), 50);
        // The extreme draws land on the window's edges exactly.
        let j = Jitter::DEFAULT;
        let interval = Duration::from_secs(10);
        assert_eq!(j.spread(interval, 0), Duration::from_secs(5));
        assert_eq!(
            j.spread(interval, u64::MAX),
            Duration::from_secs(15) - Duration::from_nanos(1)
        );
        assert_eq!(j.spread(Duration::ZERO, u64::MAX), Duration::ZERO);
        // Any configured interval: no overflow, the wait saturates.
        let full = Jitter::new(100).unwrap();
        assert_eq!(
            full.spread(Duration::MAX, u64::MAX),
            Duration::from_nanos(u64::MAX)
        );
        assert_eq!(full.spread(Duration::MAX, 0), Duration::ZERO);
        let huge = Duration::from_secs(1_000_000_000_000);
        assert_eq!(
            j.spread(huge, 0),
            Duration::from_nanos(u64::MAX - u64::MAX / 2)
        );
    }
}
