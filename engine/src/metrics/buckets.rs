//! Fixed-bucket latency histograms in Prometheus' shape (`_bucket{le}`,
//! `_sum`, `_count`), and the helpers to write the text format.
//!
//! The bounds are the same for every latency series ([`LATENCY_BOUNDS_US`],
//! 0.5 ms to 60 s), so histograms of every Edge and Node aggregate with
//! `sum by (le)`. Two forms hold the same counts:
//!
//! - [`Buckets`]: plain integers, for a single writer that already holds
//!   its data exclusively (the per-core [`super::Registry`]) and for the
//!   merged snapshot a scrape renders;
//! - [`AtomicBuckets`]: relaxed atomics, for cells one shard writes and a
//!   scrape on another reads — an observation is a bucket search over a
//!   constant array and two `fetch_add`s, with no lock and no allocation.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in microseconds (the `+Inf` bucket
/// follows): 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500 ms, 1, 2.5, 5, 10,
/// 20, 30, 60 s.
pub const LATENCY_BOUNDS_US: [u64; 17] = [
    500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
    2_500_000, 5_000_000, 10_000_000, 20_000_000, 30_000_000, 60_000_000,
];

/// Buckets per histogram: one per bound and `+Inf`.
pub const BUCKETS: usize = LATENCY_BOUNDS_US.len() + 1;

/// Microseconds per second (the Prometheus base unit).
const US_PER_SEC: f64 = 1_000_000.0;

/// The bucket of `value_us`: the first whose bound is at least the value
/// (`le` is inclusive), [`BUCKETS`]` - 1` (`+Inf`) above the last bound.
pub fn bucket_index(value_us: u64) -> usize {
    LATENCY_BOUNDS_US.partition_point(|&bound| bound < value_us)
}

/// Whole microseconds of `elapsed` (saturating).
pub fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

/// A fixed-bucket histogram: per-bucket (non-cumulative) counts and the
/// exact sum in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Buckets {
    counts: [u64; BUCKETS],
    sum_us: u64,
}

impl Buckets {
    /// Records one value in microseconds.
    pub fn observe_us(&mut self, value_us: u64) {
        let count = &mut self.counts[bucket_index(value_us)];
        *count = count.saturating_add(1);
        self.sum_us = self.sum_us.saturating_add(value_us);
    }

    /// Adds every observation of `other`.
    pub fn merge(&mut self, other: &Buckets) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine = mine.saturating_add(*theirs);
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
    }

    /// Observations in bucket `index` alone (not cumulative).
    pub fn bucket(&self, index: usize) -> u64 {
        self.counts.get(index).copied().unwrap_or(0)
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.counts.iter().fold(0u64, |a, &c| a.saturating_add(c))
    }

    /// The upper bound (µs) of the bucket holding the `q` quantile (0 when
    /// empty; the last finite bound for the overflow bucket): an estimate
    /// no finer than the buckets, as Prometheus' `histogram_quantile` is.
    pub fn quantile_bound_us(&self, q: f64) -> u64 {
        let count = self.count();
        if count == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * count as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen = seen.saturating_add(c);
            if seen >= rank {
                return LATENCY_BOUNDS_US[i.min(LATENCY_BOUNDS_US.len() - 1)];
            }
        }
        LATENCY_BOUNDS_US[LATENCY_BOUNDS_US.len() - 1]
    }

    /// Sum of the observations, in microseconds.
    pub fn sum_us(&self) -> u64 {
        self.sum_us
    }
}

/// [`Buckets`] in relaxed atomics: written by one shard, read by a scrape
/// anywhere. A reader may see a bucket incremented before the sum (or the
/// reverse) for an instant; every count is eventually exact.
#[derive(Debug, Default)]
pub struct AtomicBuckets {
    counts: [AtomicU64; BUCKETS],
    sum_us: AtomicU64,
}

impl AtomicBuckets {
    /// Records one value in microseconds.
    pub fn observe_us(&self, value_us: u64) {
        self.counts[bucket_index(value_us)].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(value_us, Ordering::Relaxed);
    }

    /// Records one duration (whole microseconds).
    pub fn observe(&self, elapsed: Duration) {
        self.observe_us(micros(elapsed));
    }

    /// Adds what this histogram holds now to `into`.
    pub fn add_to(&self, into: &mut Buckets) {
        for (total, cell) in into.counts.iter_mut().zip(&self.counts) {
            *total = total.saturating_add(cell.load(Ordering::Relaxed));
        }
        into.sum_us = into
            .sum_us
            .saturating_add(self.sum_us.load(Ordering::Relaxed));
    }
}

/// Writes the `# HELP` and `# TYPE` lines of family `name` (`kind`:
/// `counter`, `gauge`, `histogram`).
pub fn write_family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Writes the samples of histogram `name` with `labels` (already rendered
/// `key="value"` pairs joined by commas, or empty): one cumulative
/// `_bucket` line per bound and `+Inf`, then `_sum` in seconds and
/// `_count`.
pub fn write_histogram(out: &mut String, name: &str, labels: &str, buckets: &Buckets) {
    let sep = if labels.is_empty() { "" } else { "," };
    let mut cumulative = 0u64;
    for (i, bound_us) in LATENCY_BOUNDS_US.iter().enumerate() {
        cumulative = cumulative.saturating_add(buckets.counts[i]);
        let le = *bound_us as f64 / US_PER_SEC;
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
        );
    }
    cumulative = cumulative.saturating_add(buckets.counts[BUCKETS - 1]);
    let _ = writeln!(
        out,
        "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}"
    );
    let sum = buckets.sum_us as f64 / US_PER_SEC;
    if labels.is_empty() {
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {cumulative}");
    } else {
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

/// Writes one sample line: `name value` or `name{labels} value`.
pub fn write_sample(out: &mut String, name: &str, labels: &str, value: impl std::fmt::Display) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// `value` escaped for a label value: backslash, double quote and line
/// feed as `\\`, `\"`, `\n`.
pub fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// `help` escaped for a `# HELP` line: backslash and line feed.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_bucket_bounds() {
        let mut b = Buckets::default();
        assert_eq!(b.quantile_bound_us(0.5), 0);
        for _ in 0..90 {
            b.observe_us(700); // the 1 ms bucket
        }
        for _ in 0..10 {
            b.observe_us(70_000); // the 100 ms bucket
        }
        assert_eq!(b.quantile_bound_us(0.5), 1_000);
        assert_eq!(b.quantile_bound_us(0.9), 1_000);
        assert_eq!(b.quantile_bound_us(0.91), 100_000);
        assert_eq!(b.quantile_bound_us(1.0), 100_000);
        b.observe_us(u64::MAX / 4); // past the last bound
        assert_eq!(b.quantile_bound_us(1.0), 60_000_000);
    }

    #[test]
    fn values_fall_in_the_first_bucket_whose_bound_is_at_least_them() {
        assert_eq!(bucket_index(0), 0);
        assert_eq!(bucket_index(500), 0, "le is inclusive");
        assert_eq!(bucket_index(501), 1);
        assert_eq!(bucket_index(1_000), 1);
        assert_eq!(bucket_index(99_999), 7);
        assert_eq!(bucket_index(60_000_000), 16);
        assert_eq!(bucket_index(60_000_001), 17, "+Inf");
        assert_eq!(bucket_index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn atomic_and_plain_buckets_agree_and_merge() {
        let cells = AtomicBuckets::default();
        let mut plain = Buckets::default();
        for v in [1, 500, 501, 120_000, 90_000_000] {
            cells.observe_us(v);
            plain.observe_us(v);
        }
        let mut snapshot = Buckets::default();
        cells.add_to(&mut snapshot);
        assert_eq!(snapshot, plain);
        assert_eq!(plain.count(), 5);
        assert_eq!(plain.sum_us(), 90_121_002);
        assert_eq!(
            (0..BUCKETS).map(|i| plain.bucket(i)).collect::<Vec<_>>(),
            [2, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1]
        );
        let mut twice = plain;
        twice.merge(&snapshot);
        assert_eq!(twice.count(), 10);
        assert_eq!(twice.bucket(0), 4);
    }

    #[test]
    fn histogram_text_is_cumulative_in_seconds() {
        let mut b = Buckets::default();
        b.observe_us(300);
        b.observe_us(2_000);
        b.observe_us(2_000);
        b.observe_us(75_000_000);
        let mut out = String::new();
        write_family(
            &mut out,
            "x_seconds",
            "histogram",
            "A test.\nSecond line \\.",
        );
        write_histogram(&mut out, "x_seconds", "route=\"chat\"", &b);
        let expected = "\
# HELP x_seconds A test.\\nSecond line \\\\.
# TYPE x_seconds histogram
x_seconds_bucket{route=\"chat\",le=\"0.0005\"} 1
x_seconds_bucket{route=\"chat\",le=\"0.001\"} 1
x_seconds_bucket{route=\"chat\",le=\"0.0025\"} 3
x_seconds_bucket{route=\"chat\",le=\"0.005\"} 3
x_seconds_bucket{route=\"chat\",le=\"0.01\"} 3
x_seconds_bucket{route=\"chat\",le=\"0.025\"} 3
x_seconds_bucket{route=\"chat\",le=\"0.05\"} 3
x_seconds_bucket{route=\"chat\",le=\"0.1\"} 3
x_seconds_bucket{route=\"chat\",le=\"0.25\"} 3
x_seconds_bucket{route=\"chat\",le=\"0.5\"} 3
x_seconds_bucket{route=\"chat\",le=\"1\"} 3
x_seconds_bucket{route=\"chat\",le=\"2.5\"} 3
x_seconds_bucket{route=\"chat\",le=\"5\"} 3
x_seconds_bucket{route=\"chat\",le=\"10\"} 3
x_seconds_bucket{route=\"chat\",le=\"20\"} 3
x_seconds_bucket{route=\"chat\",le=\"30\"} 3
x_seconds_bucket{route=\"chat\",le=\"60\"} 3
x_seconds_bucket{route=\"chat\",le=\"+Inf\"} 4
x_seconds_sum{route=\"chat\"} 75.0043
x_seconds_count{route=\"chat\"} 4
";
        assert_eq!(out, expected);
        let mut bare = String::new();
        write_histogram(&mut bare, "y", "", &Buckets::default());
        assert!(bare.starts_with("y_bucket{le=\"0.0005\"} 0\n"));
        assert!(bare.ends_with("y_bucket{le=\"+Inf\"} 0\ny_sum 0\ny_count 0\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(escape_label_value("node-a"), "node-a");
    }
}
