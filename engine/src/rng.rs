//! Seeded pseudo-random numbers for policies and harnesses: reconnect
//! jitter, simulated fleets, probe choices. SplitMix64 (Steele, Lea and
//! Flood, "Fast splittable pseudorandom number generators", 2014): one
//! `u64` of state, full period 2^64, every seed usable (0 included), and
//! a given seed always gives the same sequence, so a test can inject a
//! seed and check a distribution.
//!
//! Not for secrets: lease keys and nonces come from the OS ([`crate::keys`]).

/// A SplitMix64 generator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator seeded from the OS's randomness: two processes (two
    /// Nodes of a fleet) get different sequences.
    pub fn from_os() -> Self {
        // A failing OS source leaves the clock, which still differs
        // between processes started at different instants.
        let seed = getrandom::u64().unwrap_or_else(|_| crate::clock::monotonic_raw_ns());
        Self::new(seed)
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..n` (0 when `n` is 0), by multiply-shift:
    /// no modulo bias worth measuring for the `n` this is used with.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_sequence_for_seed_zero() {
        // First outputs of SplitMix64 from state 0 (the published
        // reference implementation).
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(42);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            let v = rng.below(10);
            assert!(v < 10);
            seen[v as usize] += 1;
        }
        // Each bucket expects 1,000; 800 is more than six sigma away.
        assert!(seen.iter().all(|&c| c > 800), "{seen:?}");
        assert_eq!(rng.below(0), 0);
    }

    #[test]
    fn a_seed_replays_its_sequence() {
        let a: Vec<u64> = {
            let mut r = SplitMix64::new(7);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = SplitMix64::new(7);
            (0..5).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, {
            let mut r = SplitMix64::new(8);
            (0..5).map(|_| r.next_u64()).collect::<Vec<_>>()
        });
    }
}
