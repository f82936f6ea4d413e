//! Text renderers: the wrk2-style percentile distribution and Prometheus
//! text exposition format 0.0.4. Pure functions of a [`Registry`].

use std::fmt::Write;

use super::buckets::{write_family, write_histogram};
use super::{Count, Histogram, Latency, Registry, Side, SIGNIFICANT_DIGITS};

/// The summary percentiles of the wrk2 report, in its order.
pub const WRK2_PERCENTILES: [f64; 8] = [50.0, 75.0, 90.0, 99.0, 99.9, 99.99, 99.999, 100.0];

/// Ticks per half distance to 100 % in the detailed spectrum (as wrk2 and
/// HdrHistogram's `outputPercentileDistribution` default).
const TICKS_PER_HALF_DISTANCE: u32 = 5;

/// Microseconds per millisecond (the wrk2 report's unit).
const US_PER_MS: f64 = 1_000.0;

/// The line closing each histogram's section, as wrk2 prints it.
const SEPARATOR: &str = "----------------------------------------------------------";

/// HdrHistogram's sub-bucket count for [`SIGNIFICANT_DIGITS`]: the power of
/// two that holds `2 * 10^digits` values at unit resolution.
fn sub_bucket_count() -> u64 {
    (2 * 10u64.pow(u32::from(SIGNIFICANT_DIGITS))).next_power_of_two()
}

/// The `SIGUSR1` dump of `side`: a first line `# iop <side> latency
/// histograms (milliseconds)`, then per histogram of that side the wrk2
/// report (title, summary percentiles, detailed percentile spectrum and
/// footer, closed by a dashed line), then `  Counters:` and the side's
/// counters as indented `<name>_total <value>` lines, and a last line `# end iop <side> latency
/// histograms`.
pub fn render_wrk2(registry: &Registry, side: Side) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# iop {side} latency histograms (milliseconds)");
    for key in Latency::ALL.into_iter().filter(|k| k.side() == side) {
        write_distribution(
            &mut out,
            &format!("{side} {}", key.name()),
            registry.histogram(key),
        );
    }
    let _ = writeln!(out, "  Counters:");
    for key in Count::ALL.into_iter().filter(|k| k.side() == side) {
        let _ = writeln!(out, "    {}_total {}", key.name(), registry.counter(key));
    }
    let _ = writeln!(out, "# end iop {side} latency histograms");
    out
}

/// One histogram in wrk2's `print_hdr_latency` layout: HdrHistogram's
/// classic `hdr_percentiles_print` with values scaled to milliseconds.
fn write_distribution(out: &mut String, title: &str, h: &Histogram) {
    let hdr = h.hdr();
    let _ = writeln!(out, "  {title} (HdrHistogram - Recorded Latency)");
    for percentile in WRK2_PERCENTILES {
        let value_ms = hdr.value_at_percentile(percentile) as f64 / US_PER_MS;
        let value = format!("{value_ms:.3}ms");
        let _ = writeln!(out, "{percentile:7.3}%{value:>12}");
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "  Detailed Percentile spectrum:");
    let _ = writeln!(
        out,
        "{:>12} {:>12} {:>12} {:>12}",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    );
    let _ = writeln!(out);
    let mut total_count: u64 = 0;
    for step in hdr.iter_quantiles(TICKS_PER_HALF_DISTANCE) {
        total_count += step.count_since_last_iteration();
        let value_ms = step.value_iterated_to() as f64 / US_PER_MS;
        let quantile = step.quantile_iterated_to();
        let inverted = 1.0 / (1.0 - quantile);
        let _ = writeln!(
            out,
            "{value_ms:12.3} {quantile:12.6} {total_count:12} {inverted:12.2}"
        );
    }
    let mean_ms = hdr.mean() / US_PER_MS;
    let stdev_ms = hdr.stdev() / US_PER_MS;
    let max_ms = h.max_us() as f64 / US_PER_MS;
    let _ = writeln!(
        out,
        "#[Mean    = {mean_ms:12.3}, StdDeviation   = {stdev_ms:12.3}]"
    );
    let _ = writeln!(
        out,
        "#[Max     = {max_ms:12.3}, Total count    = {:12}]",
        h.count()
    );
    let _ = writeln!(
        out,
        "#[Buckets = {:12}, SubBuckets     = {:12}]",
        hdr.buckets(),
        sub_bucket_count()
    );
    let _ = writeln!(out, "{SEPARATOR}");
}

/// Prometheus text 0.0.4 for `side`: each histogram with the fixed
/// buckets in seconds (`iop_<side>_<name>_seconds_bucket{le="…"}`, `_sum`,
/// `_count`), then each counter as `iop_<side>_<name>_total`.
pub fn render_prometheus(registry: &Registry, side: Side) -> String {
    let mut out = String::new();
    for key in Latency::ALL.into_iter().filter(|k| k.side() == side) {
        let name = format!("iop_{side}_{}_seconds", key.name());
        write_family(&mut out, &name, "histogram", key.help());
        write_histogram(&mut out, &name, "", registry.histogram(key).buckets());
    }
    for key in Count::ALL.into_iter().filter(|k| k.side() == side) {
        let name = format!("iop_{side}_{}_total", key.name());
        write_family(&mut out, &name, "counter", key.help());
        let _ = writeln!(out, "{name} {}", registry.counter(key));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_bucket_count_matches_hdrhistogram_for_three_digits() {
        assert_eq!(sub_bucket_count(), 2048);
    }
}
