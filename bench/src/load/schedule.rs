//! When requests start: the open-loop arrival schedule and how work is
//! split across load threads. Pure arithmetic on nanosecond timestamps.
//!
//! Open loop means request `n` is due at `start + n / rate` whatever
//! happened to the earlier ones; its latency is measured from that due
//! time, so a slow system cannot hide its queueing by delaying the
//! generator (no coordinated omission).

/// Request `n` (counting across every thread) is due at
/// `start_ns + n * 1e9 / rate_per_s`. With `threads` load threads, thread
/// `k` owns the requests `n = i * threads + k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArrivalSchedule {
    start_ns: u64,
    rate_per_s: f64,
    thread: u64,
    threads: u64,
}

impl ArrivalSchedule {
    /// Thread `thread` of `threads` sharing `rate_per_s` from `start_ns`.
    /// A non-positive or non-finite rate schedules nothing (every due time
    /// is `u64::MAX`).
    pub fn new(start_ns: u64, rate_per_s: f64, thread: u64, threads: u64) -> Self {
        ArrivalSchedule {
            start_ns,
            rate_per_s,
            thread,
            threads: threads.max(1),
        }
    }

    /// When this thread's `i`-th request is due.
    pub fn due_ns(&self, i: u64) -> u64 {
        if !(self.rate_per_s.is_finite() && self.rate_per_s > 0.0) {
            return u64::MAX;
        }
        let n = i.saturating_mul(self.threads).saturating_add(self.thread);
        let offset_ns = n as f64 * 1e9 / self.rate_per_s;
        if offset_ns >= u64::MAX as f64 {
            return u64::MAX;
        }
        self.start_ns.saturating_add(offset_ns as u64)
    }
}

/// `total` split into `parts` shares that differ by at most one, larger
/// shares first.
pub fn split_evenly(total: u64, parts: usize) -> Vec<u64> {
    let parts_u64 = parts.max(1) as u64;
    let (base, extra) = (total / parts_u64, total % parts_u64);
    (0..parts_u64)
        .map(|i| base + u64::from(i < extra))
        .collect()
}

/// Start offset of stream `index` of `count` when their starts are spread
/// evenly over `ramp_ns` (the first at 0).
pub fn stagger_ns(index: u64, count: u64, ramp_ns: u64) -> u64 {
    if count == 0 {
        return 0;
    }
    let offset = u128::from(index) * u128::from(ramp_ns) / u128::from(count);
    u64::try_from(offset).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_thread_schedule_is_evenly_spaced() {
        let s = ArrivalSchedule::new(1_000, 100.0, 0, 1);
        assert_eq!(s.due_ns(0), 1_000);
        assert_eq!(s.due_ns(1), 10_001_000);
        assert_eq!(s.due_ns(100), 1_000_001_000);
    }

    #[test]
    fn threads_interleave_into_the_same_schedule() {
        let one = ArrivalSchedule::new(0, 1000.0, 0, 1);
        let t0 = ArrivalSchedule::new(0, 1000.0, 0, 3);
        let t1 = ArrivalSchedule::new(0, 1000.0, 1, 3);
        let t2 = ArrivalSchedule::new(0, 1000.0, 2, 3);
        let mut merged: Vec<u64> = (0..4)
            .flat_map(|i| [t0.due_ns(i), t1.due_ns(i), t2.due_ns(i)])
            .collect();
        merged.sort_unstable();
        let single: Vec<u64> = (0..12).map(|i| one.due_ns(i)).collect();
        assert_eq!(merged, single);
    }

    #[test]
    fn degenerate_rates_schedule_nothing() {
        assert_eq!(ArrivalSchedule::new(5, 0.0, 0, 1).due_ns(0), u64::MAX);
        assert_eq!(ArrivalSchedule::new(5, -1.0, 0, 1).due_ns(3), u64::MAX);
        assert_eq!(ArrivalSchedule::new(5, f64::NAN, 0, 1).due_ns(3), u64::MAX);
        assert_eq!(
            ArrivalSchedule::new(0, 1e-9, 0, 1).due_ns(u64::MAX),
            u64::MAX
        );
    }

    #[test]
    fn splits_and_staggers() {
        assert_eq!(split_evenly(10, 3), vec![4, 3, 3]);
        assert_eq!(split_evenly(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(split_evenly(5, 0), vec![5]);
        assert_eq!(stagger_ns(0, 4, 1_000), 0);
        assert_eq!(stagger_ns(3, 4, 1_000), 750);
        assert_eq!(stagger_ns(1, 0, 1_000), 0);
    }
}
