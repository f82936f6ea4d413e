//! Which traces are exported: a head decision when the request starts
//! (the caller's `sampled` flag when a valid `traceparent` came in, else
//! `sample_ratio`), and the export decision when it ends (sampled, or it
//! ended in error).

use crate::rng::SplitMix64;

use super::context::{SpanId, TraceId, TraceParent};

/// The head sampler for traces this process starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampler {
    /// A draw below this is sampled; `None`: every trace is.
    threshold: Option<u64>,
}

impl Sampler {
    /// Samples `ratio` of new traces (clamped to 0.0–1.0).
    pub fn new(ratio: f64) -> Self {
        let threshold = if ratio >= 1.0 {
            None
        } else if ratio > 0.0 {
            // Exact enough: 2^64 × ratio, rounded down.
            Some((ratio * 18_446_744_073_709_551_616.0) as u64)
        } else {
            Some(0)
        };
        Self { threshold }
    }

    /// The head decision: the caller's flag when there is a caller,
    /// else a uniform `draw` against the ratio.
    pub fn decide(&self, parent: Option<&TraceParent>, draw: u64) -> bool {
        match (parent, self.threshold) {
            (Some(parent), _) => parent.sampled(),
            (None, None) => true,
            (None, Some(threshold)) => draw < threshold,
        }
    }
}

/// Whether a finished request's spans are exported: when it was sampled,
/// and always when it ended in error.
pub fn should_export(sampled: bool, error: bool) -> bool {
    sampled || error
}

/// Mints trace and span ids from a seeded generator (ids are random, not
/// secret). A zero id is never returned.
#[derive(Debug, Clone)]
pub struct IdSource {
    rng: SplitMix64,
}

impl IdSource {
    /// Ids drawn from `rng`.
    pub fn new(rng: SplitMix64) -> Self {
        Self { rng }
    }

    /// A new trace id.
    pub fn trace_id(&mut self) -> TraceId {
        loop {
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&self.rng.next_u64().to_be_bytes());
            id[8..].copy_from_slice(&self.rng.next_u64().to_be_bytes());
            if let Some(id) = TraceId::from_bytes(&id) {
                return id;
            }
        }
    }

    /// A new span id.
    pub fn span_id(&mut self) -> SpanId {
        loop {
            if let Some(id) = SpanId::from_bytes(&self.rng.next_u64().to_be_bytes()) {
                return id;
            }
        }
    }

    /// A uniform draw for [`Sampler::decide`].
    pub fn draw(&mut self) -> u64 {
        self.rng.next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent(flags: u8) -> TraceParent {
        TraceParent {
            trace_id: TraceId([7; 16]),
            parent_id: SpanId([9; 8]),
            flags,
        }
    }

    #[test]
    fn the_callers_flag_wins_over_the_ratio() {
        for ratio in [0.0, 0.5, 1.0] {
            let sampler = Sampler::new(ratio);
            assert!(sampler.decide(Some(&parent(0x01)), u64::MAX));
            assert!(!sampler.decide(Some(&parent(0x00)), 0));
            // Other flag bits are not the sampled bit.
            assert!(!sampler.decide(Some(&parent(0x02)), 0));
        }
    }

    #[test]
    fn new_traces_are_sampled_by_ratio() {
        assert!(Sampler::new(1.0).decide(None, u64::MAX));
        assert!(!Sampler::new(0.0).decide(None, 0));
        let half = Sampler::new(0.5);
        assert!(half.decide(None, (1 << 63) - 1));
        assert!(!half.decide(None, 1 << 63));
        // A seeded run: 10,000 draws at 0.25 give 2,500 ± 6 sigma (≈260).
        let mut ids = IdSource::new(SplitMix64::new(2024));
        let quarter = Sampler::new(0.25);
        let sampled = (0..10_000)
            .filter(|_| quarter.decide(None, ids.draw()))
            .count();
        assert!((2_240..=2_760).contains(&sampled), "{sampled}");
        // The same seed replays the same decisions.
        let mut again = IdSource::new(SplitMix64::new(2024));
        let replay = (0..10_000)
            .filter(|_| quarter.decide(None, again.draw()))
            .count();
        assert_eq!(replay, sampled);
    }

    #[test]
    fn errors_are_exported_whatever_the_head_decision() {
        assert!(should_export(true, false));
        assert!(should_export(false, true));
        assert!(should_export(true, true));
        assert!(!should_export(false, false));
    }

    #[test]
    fn minted_ids_follow_the_seed_and_are_never_zero() {
        let mut ids = IdSource::new(SplitMix64::new(0));
        // SplitMix64's reference outputs for seed 0.
        assert_eq!(
            ids.trace_id().to_string(),
            "e220a8397b1dcdaf6e789e6aa1b965f4"
        );
        assert_eq!(ids.span_id().to_string(), "06c45d188009454f");
    }
}
