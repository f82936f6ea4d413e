//! Live figures shared by the load threads, and the once-a-second
//! progress line `bench load` rewrites on stderr.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::stats::LatencyHistogram;

/// Counters every load thread updates as it goes; read by the progress
/// line and by samplers (the comparison reads `in_flight` when it measures
/// memory per active stream).
#[derive(Debug, Default)]
pub struct Live {
    /// Requests completed cleanly.
    pub completed: AtomicU64,
    /// Requests that failed (errors and truncated streams).
    pub failed: AtomicU64,
    /// Requests currently in flight.
    pub in_flight: AtomicU64,
    /// Time to first token of every stream so far.
    pub ttft: Mutex<LatencyHistogram>,
    /// Set once every load thread has finished.
    pub finished: AtomicBool,
}

impl Live {
    /// A fresh set of counters, shareable across threads.
    pub fn new() -> Arc<Live> {
        Arc::new(Live::default())
    }

    /// Records one time to first token.
    pub fn record_ttft(&self, ttft_ns: u64) {
        if let Ok(mut hist) = self.ttft.lock() {
            hist.record_ns(ttft_ns);
        }
    }

    /// The current progress line (without `\r`).
    pub fn progress_line(&self, elapsed_ns: u64) -> String {
        let (p50, p99) = match self.ttft.lock() {
            Ok(hist) => (hist.quantile_ns(0.5), hist.quantile_ns(0.99)),
            Err(_) => (None, None),
        };
        render_progress(
            elapsed_ns,
            self.completed.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.in_flight.load(Ordering::Relaxed),
            p50,
            p99,
        )
    }
}

/// Renders a duration given in microseconds with a unit that keeps three
/// or four significant digits: `850 µs`, `12.3 ms`, `1.50 s`.
pub fn format_us(us: f64) -> String {
    let abs = us.abs();
    if abs < 1_000.0 {
        format!("{us:.1} µs")
    } else if abs < 1_000_000.0 {
        format!("{:.2} ms", us / 1_000.0)
    } else {
        format!("{:.2} s", us / 1_000_000.0)
    }
}

/// The progress line: elapsed seconds, completed, failed, in flight, and
/// TTFT p50/p99 so far (`-` before the first token).
pub fn render_progress(
    elapsed_ns: u64,
    completed: u64,
    failed: u64,
    in_flight: u64,
    ttft_p50_ns: Option<u64>,
    ttft_p99_ns: Option<u64>,
) -> String {
    let ttft =
        |ns: Option<u64>| ns.map_or_else(|| "-".to_string(), |ns| format_us(ns as f64 / 1e3));
    format!(
        "[{:6.1}s] completed {completed:>8}  errors {failed:>6}  in-flight {in_flight:>6}  TTFT p50 {}  p99 {}",
        elapsed_ns as f64 / 1e9,
        ttft(ttft_p50_ns),
        ttft(ttft_p99_ns),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_durations_with_sensible_units() {
        assert_eq!(format_us(12.34), "12.3 µs");
        assert_eq!(format_us(-850.0), "-850.0 µs");
        assert_eq!(format_us(12_345.0), "12.35 ms");
        assert_eq!(format_us(1_500_000.0), "1.50 s");
    }

    #[test]
    fn progress_line_is_exact() {
        assert_eq!(
            render_progress(3_050_000_000, 120, 2, 64, Some(1_230_000), Some(45_600_000)),
            "[   3.0s] completed      120  errors      2  in-flight     64  TTFT p50 1.23 ms  p99 45.60 ms"
        );
        assert_eq!(
            render_progress(0, 0, 0, 0, None, None),
            "[   0.0s] completed        0  errors      0  in-flight      0  TTFT p50 -  p99 -"
        );
    }

    #[test]
    fn live_line_reads_the_shared_histogram() {
        let live = Live::new();
        live.record_ttft(2_000);
        live.completed.store(1, Ordering::Relaxed);
        assert_eq!(
            live.progress_line(1_000_000_000),
            "[   1.0s] completed        1  errors      0  in-flight      0  TTFT p50 2.0 µs  p99 2.0 µs"
        );
    }
}
