//! Pure statistics for the load harness: latency histograms (nanoseconds,
//! HdrHistogram, 3 significant figures), percentile summaries in
//! microseconds, and the medians of per-window deltas and ratios the
//! relay-vs-direct comparison reports.
//!
//! No IO and no clock: values come in, numbers come out.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Largest latency a histogram tells apart: 10 minutes. Larger values are
/// recorded as this value (saturating), never dropped.
pub const HISTOGRAM_MAX_NS: u64 = 600_000_000_000;

/// Significant figures every histogram keeps (0.1 % value resolution).
pub const HISTOGRAM_SIGFIG: u8 = 3;

/// A latency histogram in nanoseconds.
#[derive(Debug, Clone)]
pub struct LatencyHistogram {
    hist: Histogram<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    /// An empty histogram covering `0..=HISTOGRAM_MAX_NS`.
    pub fn new() -> Self {
        // The bounds are constants that satisfy HdrHistogram's rules
        // (low >= 1, high >= 2 * low, sigfig <= 5), so creation cannot fail.
        let hist = Histogram::new_with_bounds(1, HISTOGRAM_MAX_NS, HISTOGRAM_SIGFIG)
            .expect("constant histogram bounds are valid");
        Self { hist }
    }

    /// Records one value, clamped to [`HISTOGRAM_MAX_NS`].
    pub fn record_ns(&mut self, value_ns: u64) {
        self.hist.saturating_record(value_ns.min(HISTOGRAM_MAX_NS));
    }

    /// Adds every value of `other`. Both have the same bounds, so this
    /// cannot fail.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        // Same bounds on both sides: `add` only fails when `other` holds
        // values this one cannot, which the shared constructor rules out.
        let _ = self.hist.add(&other.hist);
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// The value at `quantile` (0.0..=1.0): the highest value equivalent
    /// to the recorded value at that rank. `None` when empty.
    pub fn quantile_ns(&self, quantile: f64) -> Option<u64> {
        if self.hist.is_empty() {
            None
        } else {
            Some(self.hist.value_at_quantile(quantile.clamp(0.0, 1.0)))
        }
    }

    /// Largest value recorded (its highest equivalent); `None` when empty.
    pub fn max_ns(&self) -> Option<u64> {
        if self.hist.is_empty() {
            None
        } else {
            Some(self.hist.max())
        }
    }

    /// The percentile summary in microseconds.
    pub fn summary(&self) -> LatencySummary {
        if self.hist.is_empty() {
            return LatencySummary::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        LatencySummary {
            count: self.hist.len(),
            min_us: us(self.hist.min()),
            mean_us: self.hist.mean() / 1000.0,
            p50_us: us(self.hist.value_at_quantile(0.50)),
            p90_us: us(self.hist.value_at_quantile(0.90)),
            p99_us: us(self.hist.value_at_quantile(0.99)),
            p999_us: us(self.hist.value_at_quantile(0.999)),
            max_us: us(self.hist.max()),
        }
    }
}

/// Percentiles of one latency distribution, in microseconds. All zero when
/// nothing was recorded (`count == 0`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Values recorded.
    pub count: u64,
    /// Smallest value.
    pub min_us: f64,
    /// Arithmetic mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Largest value.
    pub max_us: f64,
}

/// The median of `values`, ignoring NaN: the middle value of an odd count,
/// the mean of the two middle values of an even count. `None` when there
/// is no value.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    })
}

/// The median of the values that are present; `None` when none is.
pub fn median_present(values: &[Option<f64>]) -> Option<f64> {
    let present: Vec<f64> = values.iter().flatten().copied().collect();
    median(&present)
}

/// `b / a`, or `None` when `a` is zero, negative or not finite (a ratio to
/// nothing means nothing).
pub fn ratio(b: f64, a: f64) -> Option<f64> {
    if a > 0.0 && a.is_finite() && b.is_finite() {
        Some(b / a)
    } else {
        None
    }
}

/// The five headline figures the comparison reports for every window, in
/// microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Headline {
    /// Time to first token, median.
    pub ttft_p50_us: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_us: f64,
    /// One-way per-chunk latency (mock send → client receive), median.
    pub chunk_latency_p50_us: f64,
    /// One-way per-chunk latency, 99th percentile.
    pub chunk_latency_p99_us: f64,
    /// Gap between consecutive content chunks of a stream, 99th percentile.
    pub inter_chunk_gap_p99_us: f64,
}

/// [`Headline`] ratios; `None` where the denominator was zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HeadlineRatio {
    /// See [`Headline::ttft_p50_us`].
    pub ttft_p50: Option<f64>,
    /// See [`Headline::ttft_p99_us`].
    pub ttft_p99: Option<f64>,
    /// See [`Headline::chunk_latency_p50_us`].
    pub chunk_latency_p50: Option<f64>,
    /// See [`Headline::chunk_latency_p99_us`].
    pub chunk_latency_p99: Option<f64>,
    /// See [`Headline::inter_chunk_gap_p99_us`].
    pub inter_chunk_gap_p99: Option<f64>,
}

impl Headline {
    /// Number of figures.
    pub const LEN: usize = 5;

    /// Human names of the figures, in [`Headline::to_array`] order.
    pub const LABELS: [&'static str; Self::LEN] = [
        "TTFT p50",
        "TTFT p99",
        "chunk latency p50",
        "chunk latency p99",
        "inter-chunk gap p99",
    ];

    /// The figures of a run's summaries.
    pub fn of(ttft: &LatencySummary, chunk: &LatencySummary, gap: &LatencySummary) -> Self {
        Headline {
            ttft_p50_us: ttft.p50_us,
            ttft_p99_us: ttft.p99_us,
            chunk_latency_p50_us: chunk.p50_us,
            chunk_latency_p99_us: chunk.p99_us,
            inter_chunk_gap_p99_us: gap.p99_us,
        }
    }

    /// The figures in a fixed order.
    pub fn to_array(self) -> [f64; Self::LEN] {
        [
            self.ttft_p50_us,
            self.ttft_p99_us,
            self.chunk_latency_p50_us,
            self.chunk_latency_p99_us,
            self.inter_chunk_gap_p99_us,
        ]
    }

    /// The inverse of [`Headline::to_array`].
    pub fn from_array(v: [f64; Self::LEN]) -> Self {
        Headline {
            ttft_p50_us: v[0],
            ttft_p99_us: v[1],
            chunk_latency_p50_us: v[2],
            chunk_latency_p99_us: v[3],
            inter_chunk_gap_p99_us: v[4],
        }
    }

    /// `self - base`, figure by figure.
    pub fn minus(self, base: Headline) -> Headline {
        let (a, b) = (self.to_array(), base.to_array());
        Headline::from_array(std::array::from_fn(|i| a[i] - b[i]))
    }

    /// `self / base`, figure by figure (see [`ratio`]).
    pub fn over(self, base: Headline) -> HeadlineRatio {
        let (a, b) = (self.to_array(), base.to_array());
        HeadlineRatio::from_array(std::array::from_fn(|i| ratio(a[i], b[i])))
    }

    /// The figure-by-figure median of `items`; `None` when empty.
    pub fn median_of(items: &[Headline]) -> Option<Headline> {
        if items.is_empty() {
            return None;
        }
        let columns: [Vec<f64>; Self::LEN] =
            std::array::from_fn(|i| items.iter().map(|h| h.to_array()[i]).collect());
        let mut out = [0.0; Self::LEN];
        for (slot, column) in out.iter_mut().zip(&columns) {
            *slot = median(column)?;
        }
        Some(Headline::from_array(out))
    }
}

impl HeadlineRatio {
    /// The ratios in [`Headline::to_array`] order.
    pub fn to_array(self) -> [Option<f64>; Headline::LEN] {
        [
            self.ttft_p50,
            self.ttft_p99,
            self.chunk_latency_p50,
            self.chunk_latency_p99,
            self.inter_chunk_gap_p99,
        ]
    }

    /// The inverse of [`HeadlineRatio::to_array`].
    pub fn from_array(v: [Option<f64>; Headline::LEN]) -> Self {
        HeadlineRatio {
            ttft_p50: v[0],
            ttft_p99: v[1],
            chunk_latency_p50: v[2],
            chunk_latency_p99: v[3],
            inter_chunk_gap_p99: v[4],
        }
    }

    /// The figure-by-figure median of the present ratios of `items`.
    pub fn median_of(items: &[HeadlineRatio]) -> HeadlineRatio {
        HeadlineRatio::from_array(std::array::from_fn(|i| {
            let column: Vec<Option<f64>> = items.iter().map(|r| r.to_array()[i]).collect();
            median_present(&column)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_uniform_run_are_exact() {
        // Values up to 2048 are stored exactly at 3 significant figures.
        let mut h = LatencyHistogram::new();
        for v in 1..=1000 {
            h.record_ns(v);
        }
        assert_eq!(h.count(), 1000);
        assert_eq!(h.quantile_ns(0.5), Some(500));
        assert_eq!(h.quantile_ns(0.9), Some(900));
        assert_eq!(h.quantile_ns(0.99), Some(990));
        assert_eq!(h.quantile_ns(1.0), Some(1000));
        assert_eq!(h.max_ns(), Some(1000));
        let s = h.summary();
        assert_eq!(s.count, 1000);
        assert_eq!(s.min_us, 0.001);
        assert_eq!(s.p50_us, 0.5);
        assert_eq!(s.p90_us, 0.9);
        assert_eq!(s.p99_us, 0.99);
        assert_eq!(s.p999_us, 0.999);
        assert_eq!(s.max_us, 1.0);
        assert!((s.mean_us - 0.5005).abs() < 1e-9);
    }

    #[test]
    fn large_values_keep_three_significant_figures() {
        let mut h = LatencyHistogram::new();
        h.record_ns(20_000_000); // 20 ms
        h.record_ns(20_000_000);
        h.record_ns(45_000_000);
        let p50 = h.quantile_ns(0.5).unwrap();
        let p99 = h.quantile_ns(0.99).unwrap();
        // Highest equivalent values: within 0.1 % above the recorded ones.
        assert!((20_000_000..=20_020_000).contains(&p50), "{p50}");
        assert!((45_000_000..=45_045_000).contains(&p99), "{p99}");
    }

    #[test]
    fn empty_histograms_and_saturation() {
        let mut h = LatencyHistogram::new();
        assert_eq!(h.quantile_ns(0.5), None);
        assert_eq!(h.max_ns(), None);
        assert_eq!(h.summary(), LatencySummary::default());
        h.record_ns(u64::MAX);
        h.record_ns(0);
        assert_eq!(h.count(), 2);
        assert_eq!(h.quantile_ns(0.0), Some(0));
        assert!(h.max_ns().unwrap() >= HISTOGRAM_MAX_NS);
    }

    #[test]
    fn merge_adds_counts() {
        let mut a = LatencyHistogram::new();
        let mut b = LatencyHistogram::new();
        a.record_ns(10);
        b.record_ns(30);
        b.record_ns(20);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.quantile_ns(0.5), Some(20));
        assert_eq!(a.max_ns(), Some(30));
    }

    #[test]
    fn median_odd_even_and_nan() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[-1.0, 5.0]), Some(2.0));
        assert_eq!(median(&[f64::NAN, 1.0, 9.0, 5.0]), Some(5.0));
        assert_eq!(median(&[f64::NAN]), None);
        assert_eq!(median_present(&[None, Some(4.0), Some(2.0)]), Some(3.0));
        assert_eq!(median_present(&[None, None]), None);
    }

    #[test]
    fn ratio_refuses_empty_denominators() {
        assert_eq!(ratio(6.0, 3.0), Some(2.0));
        assert_eq!(ratio(0.0, 3.0), Some(0.0));
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(ratio(1.0, -2.0), None);
        assert_eq!(ratio(f64::INFINITY, 2.0), None);
    }

    fn headline(base: f64) -> Headline {
        Headline::from_array([base, base * 2.0, base * 3.0, base * 4.0, base * 5.0])
    }

    #[test]
    fn per_window_deltas_and_ratios_take_medians_odd() {
        // Three windows: A figures 10, 20, 30; B figures 15, 50, 33.
        let a = [headline(10.0), headline(20.0), headline(30.0)];
        let b = [headline(15.0), headline(50.0), headline(33.0)];
        let deltas: Vec<Headline> = b.iter().zip(&a).map(|(b, a)| b.minus(*a)).collect();
        let ratios: Vec<HeadlineRatio> = b.iter().zip(&a).map(|(b, a)| b.over(*a)).collect();
        // Deltas of the first figure: 5, 30, 3 → median 5.
        let med = Headline::median_of(&deltas).unwrap();
        assert_eq!(med, headline(5.0));
        // Ratios of every figure: 1.5, 2.5, 1.1 → median 1.5.
        let med_ratio = HeadlineRatio::median_of(&ratios);
        assert_eq!(med_ratio.to_array(), [Some(1.5); 5]);
        // The median of the deltas is not the delta of the medians in
        // general; here A median 20, B median 33 → 13, but the report uses 5.
        let a_med = Headline::median_of(&a).unwrap();
        let b_med = Headline::median_of(&b).unwrap();
        assert_eq!(b_med.minus(a_med).ttft_p50_us, 13.0);
    }

    #[test]
    fn per_window_deltas_and_ratios_take_medians_even() {
        let a = [
            headline(10.0),
            headline(10.0),
            headline(20.0),
            headline(40.0),
        ];
        let b = [
            headline(12.0),
            headline(20.0),
            headline(20.0),
            headline(44.0),
        ];
        let deltas: Vec<Headline> = b.iter().zip(&a).map(|(b, a)| b.minus(*a)).collect();
        // Deltas 2, 10, 0, 4 → sorted 0, 2, 4, 10 → median 3.
        assert_eq!(Headline::median_of(&deltas).unwrap(), headline(3.0));
        let ratios: Vec<HeadlineRatio> = b.iter().zip(&a).map(|(b, a)| b.over(*a)).collect();
        // Ratios 1.2, 2.0, 1.0, 1.1 → sorted 1.0, 1.1, 1.2, 2.0 → 1.15.
        let med = HeadlineRatio::median_of(&ratios).ttft_p50.unwrap();
        assert!((med - 1.15).abs() < 1e-12, "{med}");
        assert_eq!(Headline::median_of(&[]), None);
    }

    #[test]
    fn ratio_medians_skip_windows_with_a_zero_base() {
        let zero = Headline::default();
        let r = [headline(2.0).over(zero), headline(2.0).over(headline(1.0))];
        assert_eq!(r[0], HeadlineRatio::default());
        assert_eq!(HeadlineRatio::median_of(&r).ttft_p99, Some(2.0));
    }

    #[test]
    fn headline_takes_the_named_percentiles() {
        let ttft = LatencySummary {
            p50_us: 1.0,
            p99_us: 2.0,
            ..Default::default()
        };
        let chunk = LatencySummary {
            p50_us: 3.0,
            p99_us: 4.0,
            ..Default::default()
        };
        let gap = LatencySummary {
            p50_us: 100.0,
            p99_us: 5.0,
            ..Default::default()
        };
        assert_eq!(
            Headline::of(&ttft, &chunk, &gap).to_array(),
            [1.0, 2.0, 3.0, 4.0, 5.0]
        );
    }
}
