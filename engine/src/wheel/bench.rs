//! Wheel micro-benchmark, run by `bench wheel --timers N`. Not a test: it
//! reports figures and asserts nothing about speed.

use std::hint::black_box;
use std::time::{Duration, Instant};

use super::Wheel;
use crate::clock;

/// Nanoseconds per operation measured by [`bench_report`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BenchFigures {
    /// Number of timers the wheel held.
    pub timers: usize,
    /// Deadlines were spread uniformly over `1..=span_ticks`.
    pub span_ticks: u64,
    /// Mean ns per [`Wheel::insert`] into a wheel growing to `timers`.
    pub insert_ns: f64,
    /// Mean ns per [`Wheel::cancel`] of a pending timer (random slot order).
    pub cancel_ns: f64,
    /// Mean ns per expired timer while advancing one tick at a time across
    /// the whole span (includes cascades and the per-tick poll cost).
    pub expire_ns: f64,
}

/// Measures insert, cancel and expire costs at `timers` timers (at least 1)
/// with deadlines spread over `max(4 * timers, 4096)` ticks, so timers land on
/// several levels and cascade. Deterministic inputs; wall time from
/// [`clock::now`].
pub fn bench_report(timers: usize) -> BenchFigures {
    let timers = timers.max(1);
    let span_ticks = (timers as u64).saturating_mul(4).max(4096);
    let mut rng = XorShift64(0x9E37_79B9_7F4A_7C15);
    let deadlines: Vec<u64> = (0..timers).map(|_| 1 + rng.next() % span_ticks).collect();

    // insert
    let mut wheel: Wheel<u64> = Wheel::with_capacity(timers);
    let mut handles = Vec::with_capacity(timers);
    let start = clock::now();
    for (i, &deadline_tick) in deadlines.iter().enumerate() {
        handles.push(wheel.insert(black_box(deadline_tick), i as u64));
    }
    let insert = since(start);

    // cancel (handles are in insertion order, so slots are visited at random)
    let start = clock::now();
    let mut cancelled = 0u64;
    for &handle in &handles {
        if let Some(value) = wheel.cancel(black_box(handle)) {
            cancelled = cancelled.wrapping_add(value);
        }
    }
    let cancel = since(start);
    black_box(cancelled);

    // expire
    for (i, &deadline_tick) in deadlines.iter().enumerate() {
        wheel.insert(deadline_tick, i as u64);
    }
    let start = clock::now();
    let mut fired = 0usize;
    let mut checksum = 0u64;
    for now_tick in 1..=span_ticks {
        fired += wheel.advance(now_tick, |e| checksum = checksum.wrapping_add(e.value));
    }
    let expire = since(start);
    black_box(checksum);

    BenchFigures {
        timers,
        span_ticks,
        insert_ns: per_op_ns(insert, timers),
        cancel_ns: per_op_ns(cancel, timers),
        expire_ns: per_op_ns(expire, fired.max(1)),
    }
}

fn since(start: Instant) -> Duration {
    clock::now().saturating_duration_since(start)
}

fn per_op_ns(total: Duration, ops: usize) -> f64 {
    total.as_nanos() as f64 / ops as f64
}

/// xorshift64: deterministic, dependency-free deadline spread.
struct XorShift64(u64);

impl XorShift64 {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}
