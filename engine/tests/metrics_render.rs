//! `iop_engine::metrics` registries and renderers: recording, merging, the
//! wrk2-style percentile distribution (parsed back) and exact Prometheus
//! text for known data sets.

use std::time::Duration;

use iop_engine::metrics::{
    render_prometheus, render_wrk2, Count, Histogram, Latency, Registry, Side,
};

/// One histogram section of a wrk2 dump, parsed.
#[derive(Debug)]
struct Section {
    title: String,
    /// `(percentile, milliseconds)` of the summary.
    summary: Vec<(f64, f64)>,
    /// `(value_ms, percentile, total_count, inverted)` rows; `inverted` is
    /// `None` for `inf`.
    rows: Vec<(f64, f64, u64, Option<f64>)>,
    mean_line: String,
    max_line: String,
    buckets_line: String,
}

/// Parses a dump; panics (fails the test) on any line out of shape.
fn parse_wrk2(text: &str) -> (Vec<Section>, Vec<(String, u64)>) {
    let mut lines = text.lines();
    let first = lines.next().unwrap();
    assert!(first.starts_with("# iop ") && first.ends_with(" latency histograms (milliseconds)"));
    let mut sections = Vec::new();
    let mut counters = Vec::new();
    loop {
        let line = lines.next().unwrap();
        if line == "  Counters:" {
            break;
        }
        let title = line
            .strip_prefix("  ")
            .and_then(|l| l.strip_suffix(" (HdrHistogram - Recorded Latency)"))
            .unwrap_or_else(|| panic!("title expected: {line:?}"))
            .to_string();
        let mut summary = Vec::new();
        for _ in 0..8 {
            let line = lines.next().unwrap();
            let (p, v) = line.split_once('%').unwrap();
            let v = v.trim().strip_suffix("ms").unwrap();
            summary.push((p.trim().parse().unwrap(), v.parse().unwrap()));
        }
        assert_eq!(lines.next(), Some(""));
        assert_eq!(lines.next(), Some("  Detailed Percentile spectrum:"));
        assert_eq!(
            lines.next(),
            Some("       Value   Percentile   TotalCount 1/(1-Percentile)")
        );
        assert_eq!(lines.next(), Some(""));
        let mut rows = Vec::new();
        let mean_line = loop {
            let line = lines.next().unwrap();
            if line.starts_with("#[Mean") {
                break line.to_string();
            }
            let cols: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(cols.len(), 4, "{line:?}");
            // Fixed-width columns of 12, as HdrHistogram's classic format.
            assert_eq!(line.len(), 4 * 12 + 3, "{line:?}");
            let inverted = match cols[3] {
                "inf" => None,
                v => Some(v.parse().unwrap()),
            };
            rows.push((
                cols[0].parse().unwrap(),
                cols[1].parse().unwrap(),
                cols[2].parse().unwrap(),
                inverted,
            ));
        };
        let max_line = lines.next().unwrap().to_string();
        let buckets_line = lines.next().unwrap().to_string();
        assert_eq!(
            lines.next(),
            Some("----------------------------------------------------------")
        );
        sections.push(Section {
            title,
            summary,
            rows,
            mean_line,
            max_line,
            buckets_line,
        });
    }
    loop {
        let line = lines.next().unwrap();
        if line.starts_with("# end iop ") {
            break;
        }
        let (name, value) = line.trim().split_once(' ').unwrap();
        counters.push((name.to_string(), value.parse().unwrap()));
    }
    assert_eq!(lines.next(), None);
    (sections, counters)
}

fn registry_with(key: Latency, values_us: impl IntoIterator<Item = u64>) -> Registry {
    let mut r = Registry::new();
    for v in values_us {
        r.record_us(key, v);
    }
    r
}

#[test]
fn metrics_merging_two_registries_adds_counts_and_gives_the_percentiles_of_all_data() {
    let mut a = registry_with(Latency::EdgeQueueWait, 1..=500);
    a.add(Count::EdgeRelayBodyBytes, 10);
    let mut b = registry_with(Latency::EdgeQueueWait, 501..=999);
    b.record_us(Latency::NodeProviderCallDuration, 7);
    b.add(Count::EdgeRelayBodyBytes, 32);
    b.add(Count::NodeProviderCallsAborted, 1);

    a.merge(&b).unwrap();

    let h = a.histogram(Latency::EdgeQueueWait);
    assert_eq!(h.count(), 999);
    assert_eq!(h.sum_us(), 999 * 1000 / 2);
    assert_eq!(h.value_at_quantile_us(0.5), 500);
    assert_eq!(h.value_at_quantile_us(0.99), 990);
    assert_eq!(h.max_us(), 999);
    assert_eq!(a.histogram(Latency::NodeProviderCallDuration).count(), 1);
    assert_eq!(a.histogram(Latency::EdgeEndToEnd).count(), 0);
    assert_eq!(a.counter(Count::EdgeRelayBodyBytes), 42);
    assert_eq!(a.counter(Count::NodeProviderCallsAborted), 1);

    // Merged data renders exactly as the same data recorded in one place.
    let mut whole = registry_with(Latency::EdgeQueueWait, 1..=999);
    whole.record_us(Latency::NodeProviderCallDuration, 7);
    whole.add(Count::EdgeRelayBodyBytes, 42);
    whole.add(Count::NodeProviderCallsAborted, 1);
    for side in [Side::Edge, Side::Node] {
        assert_eq!(render_wrk2(&a, side), render_wrk2(&whole, side));
        assert_eq!(render_prometheus(&a, side), render_prometheus(&whole, side));
    }
}

#[test]
fn metrics_durations_are_recorded_in_whole_microseconds() {
    let mut h = Histogram::new();
    h.record(Duration::from_nanos(1_999));
    h.record(Duration::from_micros(1_500));
    h.record(Duration::ZERO);
    assert_eq!(h.count(), 3);
    assert_eq!(h.sum_us(), 1_501);
    assert_eq!(h.value_at_quantile_us(0.0), 0);
    assert_eq!(h.value_at_quantile_us(0.5), 1);
    assert_eq!(h.max_us(), 1_500);
}

#[test]
fn metrics_wrk2_dump_parses_back_with_exact_figures_for_a_known_data_set() {
    // 1..=999 µs once each: mean 500 µs, population standard deviation
    // sqrt((999² − 1) / 12) ≈ 288.386 µs, all values exact (< 2048 µs).
    let mut r = registry_with(Latency::EdgeQueueWait, 1..=999);
    for v in [100, 200, 300, 400] {
        r.record_us(Latency::EdgeEndToEnd, v);
    }
    r.add(Count::EdgeRelayBodyBytes, 42);
    let text = render_wrk2(&r, Side::Edge);
    let (sections, counters) = parse_wrk2(&text);

    let titles: Vec<&str> = sections.iter().map(|s| s.title.as_str()).collect();
    assert_eq!(
        titles,
        [
            "edge queue_wait",
            "edge relay_chunk_latency",
            "edge end_to_end"
        ]
    );
    let expected: Vec<(String, u64)> = Count::ALL
        .into_iter()
        .filter(|k| k.side() == Side::Edge)
        .map(|k| {
            let value = if k == Count::EdgeRelayBodyBytes {
                42
            } else {
                0
            };
            (format!("{}_total", k.name()), value)
        })
        .collect();
    assert_eq!(counters[0], ("relay_body_bytes_total".to_string(), 42));
    assert_eq!(counters, expected);

    let queue = &sections[0];
    assert_eq!(
        queue.summary,
        [
            (50.0, 0.5),
            (75.0, 0.75),
            (90.0, 0.9),
            (99.0, 0.99),
            (99.9, 0.999),
            (99.99, 0.999),
            (99.999, 0.999),
            (100.0, 0.999)
        ]
    );
    assert_eq!(
        queue.mean_line,
        "#[Mean    =        0.500, StdDeviation   =        0.288]"
    );
    assert_eq!(
        queue.max_line,
        "#[Max     =        0.999, Total count    =          999]"
    );
    assert_eq!(
        queue.buckets_line,
        "#[Buckets =           22, SubBuckets     =         2048]"
    );
    // The spectrum: starts at the minimum, ticks 5 per half distance, is
    // monotonic, and ends at percentile 1 with the total count.
    assert_eq!(queue.rows[0], (0.001, 0.0, 1, Some(1.0)));
    assert_eq!(queue.rows[1], (0.1, 0.1, 100, Some(1.11)));
    assert_eq!(queue.rows[5], (0.5, 0.5, 500, Some(2.0)));
    assert_eq!(queue.rows[6], (0.55, 0.55, 550, Some(2.22)));
    for pair in queue.rows.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        assert!(b.0 >= a.0, "values monotonic: {a:?} {b:?}");
        assert!(b.1 > a.1, "percentiles increase: {a:?} {b:?}");
        assert!(b.2 >= a.2, "counts monotonic: {a:?} {b:?}");
    }
    assert_eq!(*queue.rows.last().unwrap(), (0.999, 1.0, 999, None));
    for row in &queue.rows[..queue.rows.len() - 1] {
        // Both columns are rounded (6 and 2 decimals): compare loosely.
        let inverted = row.3.unwrap();
        let expected = 1.0 / (1.0 - row.1);
        assert!(
            (inverted - expected).abs() <= 0.005 + expected * 1e-3,
            "{row:?}"
        );
    }

    // An empty histogram: zero summary, no rows, zero footer.
    let empty = &sections[1];
    assert!(empty.summary.iter().all(|&(_, v)| v == 0.0));
    assert!(empty.rows.is_empty());
    assert_eq!(
        empty.max_line,
        "#[Max     =        0.000, Total count    =            0]"
    );

    // Four values: every spectrum row of HdrHistogram's classic output.
    let e2e = &sections[2];
    assert_eq!(
        e2e.rows,
        [
            (0.1, 0.0, 1, Some(1.0)),
            (0.1, 0.1, 1, Some(1.11)),
            (0.1, 0.2, 1, Some(1.25)),
            (0.2, 0.3, 2, Some(1.43)),
            (0.2, 0.4, 2, Some(1.67)),
            (0.2, 0.5, 2, Some(2.0)),
            (0.3, 0.55, 3, Some(2.22)),
            (0.3, 0.6, 3, Some(2.5)),
            (0.3, 0.65, 3, Some(2.86)),
            (0.3, 0.7, 3, Some(3.33)),
            (0.4, 0.75, 4, Some(4.0)),
            (0.4, 1.0, 4, None),
        ]
    );
    assert_eq!(
        e2e.mean_line,
        "#[Mean    =        0.250, StdDeviation   =        0.112]"
    );
    assert_eq!(
        e2e.max_line,
        "#[Max     =        0.400, Total count    =            4]"
    );
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.contains(&" 50.000%     0.200ms"));
    assert!(lines.contains(&"       0.400     1.000000            4          inf"));
}

#[test]
fn metrics_wrk2_dump_shows_only_its_side() {
    let mut r = registry_with(Latency::EdgeEndToEnd, [5]);
    r.record_us(Latency::NodeRelayChunkLatency, 3);
    r.add(Count::NodeProviderCallsAborted, 2);
    let (sections, counters) = parse_wrk2(&render_wrk2(&r, Side::Node));
    let titles: Vec<&str> = sections.iter().map(|s| s.title.as_str()).collect();
    assert_eq!(
        titles,
        [
            "node provider_time_to_first_byte",
            "node relay_chunk_latency",
            "node provider_call_duration"
        ]
    );
    assert_eq!(
        sections[1].max_line,
        "#[Max     =        0.003, Total count    =            1]"
    );
    assert_eq!(
        counters,
        [
            ("provider_calls_aborted_total".to_string(), 2),
            ("tunnel_usage_chunks_stripped_total".to_string(), 0),
            ("tunnel_usage_missing_total".to_string(), 0),
            ("tunnel_events_unchecked_total".to_string(), 0),
            ("trace_spans_started_total".to_string(), 0),
            ("trace_spans_exported_total".to_string(), 0),
            ("trace_spans_dropped_total".to_string(), 0),
            ("trace_export_failures_total".to_string(), 0),
        ]
    );
}

#[test]
fn metrics_prometheus_text_is_exact_for_a_known_data_set() {
    let mut r = registry_with(Latency::NodeProviderTimeToFirstByte, [100, 200, 300, 400]);
    for v in 1..=1000 {
        r.record_us(Latency::NodeRelayChunkLatency, v);
    }
    r.record(
        Latency::NodeProviderCallDuration,
        Duration::from_millis(1500),
    );
    r.add(Count::NodeProviderCallsAborted, 3);
    // Edge data never shows on the Node's page.
    r.record_us(Latency::EdgeEndToEnd, 9);
    r.add(Count::EdgeRelayBodyBytes, 9);
    let expected = "\
# HELP iop_node_provider_time_to_first_byte_seconds Time from provider call start to its first output.
# TYPE iop_node_provider_time_to_first_byte_seconds histogram
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.0005\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.001\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.0025\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.005\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.01\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.025\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.05\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.1\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.25\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"0.5\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"1\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"2.5\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"5\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"10\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"20\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"30\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"60\"} 4
iop_node_provider_time_to_first_byte_seconds_bucket{le=\"+Inf\"} 4
iop_node_provider_time_to_first_byte_seconds_sum 0.001
iop_node_provider_time_to_first_byte_seconds_count 4
# HELP iop_node_relay_chunk_latency_seconds Added relay latency per chunk: provider read to frame queued for the Edge.
# TYPE iop_node_relay_chunk_latency_seconds histogram
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.0005\"} 500
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.001\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.0025\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.005\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.01\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.025\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.05\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.1\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.25\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"0.5\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"1\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"2.5\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"5\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"10\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"20\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"30\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"60\"} 1000
iop_node_relay_chunk_latency_seconds_bucket{le=\"+Inf\"} 1000
iop_node_relay_chunk_latency_seconds_sum 0.5005
iop_node_relay_chunk_latency_seconds_count 1000
# HELP iop_node_provider_call_duration_seconds Time from provider call start to its return or abort.
# TYPE iop_node_provider_call_duration_seconds histogram
iop_node_provider_call_duration_seconds_bucket{le=\"0.0005\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.001\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.0025\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.005\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.01\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.025\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.05\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.1\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.25\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"0.5\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"1\"} 0
iop_node_provider_call_duration_seconds_bucket{le=\"2.5\"} 1
iop_node_provider_call_duration_seconds_bucket{le=\"5\"} 1
iop_node_provider_call_duration_seconds_bucket{le=\"10\"} 1
iop_node_provider_call_duration_seconds_bucket{le=\"20\"} 1
iop_node_provider_call_duration_seconds_bucket{le=\"30\"} 1
iop_node_provider_call_duration_seconds_bucket{le=\"60\"} 1
iop_node_provider_call_duration_seconds_bucket{le=\"+Inf\"} 1
iop_node_provider_call_duration_seconds_sum 1.5
iop_node_provider_call_duration_seconds_count 1
# HELP iop_node_provider_calls_aborted_total Provider calls aborted before they returned.
# TYPE iop_node_provider_calls_aborted_total counter
iop_node_provider_calls_aborted_total 3
# HELP iop_node_tunnel_usage_chunks_stripped_total Usage-only stream events left out for clients that did not ask for usage.
# TYPE iop_node_tunnel_usage_chunks_stripped_total counter
iop_node_tunnel_usage_chunks_stripped_total 0
# HELP iop_node_tunnel_usage_missing_total Tunnelled streams that asked the provider for usage and got none.
# TYPE iop_node_tunnel_usage_missing_total counter
iop_node_tunnel_usage_missing_total 0
# HELP iop_node_tunnel_events_unchecked_total Stream events relayed without the usage-chunk check (past the hold cap).
# TYPE iop_node_tunnel_events_unchecked_total counter
iop_node_tunnel_events_unchecked_total 0
# HELP iop_node_trace_spans_started_total Spans started by request tracing ([tracing]); 0 while tracing is off.
# TYPE iop_node_trace_spans_started_total counter
iop_node_trace_spans_started_total 0
# HELP iop_node_trace_spans_exported_total Spans the OTLP collector accepted.
# TYPE iop_node_trace_spans_exported_total counter
iop_node_trace_spans_exported_total 0
# HELP iop_node_trace_spans_dropped_total Finished spans lost: export queue full, or their batch failed after its retries.
# TYPE iop_node_trace_spans_dropped_total counter
iop_node_trace_spans_dropped_total 0
# HELP iop_node_trace_export_failures_total OTLP export requests that failed after their retries.
# TYPE iop_node_trace_export_failures_total counter
iop_node_trace_export_failures_total 0
";
    assert_eq!(render_prometheus(&r, Side::Node), expected);
}

#[test]
fn metrics_prometheus_histogram_of_no_samples_has_zero_buckets_sum_and_count() {
    let text = render_prometheus(&Registry::new(), Side::Edge);
    let e2e: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("iop_edge_end_to_end_seconds"))
        .collect();
    assert_eq!(
        e2e,
        [
            "iop_edge_end_to_end_seconds_bucket{le=\"0.0005\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.001\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.0025\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.005\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.01\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.025\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.05\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.1\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.25\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"0.5\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"1\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"2.5\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"5\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"10\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"20\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"30\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"60\"} 0",
            "iop_edge_end_to_end_seconds_bucket{le=\"+Inf\"} 0",
            "iop_edge_end_to_end_seconds_sum 0",
            "iop_edge_end_to_end_seconds_count 0",
        ]
    );
    // Every sample is `name{bounded label} value` or `name value`, with a
    // base-unit or `_total` name and no other labels.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(value.parse::<f64>().is_ok(), "{line}");
        let bare = name.split('{').next().unwrap();
        assert!(bare.starts_with("iop_edge_"), "{line}");
        assert!(
            bare.ends_with("_seconds_bucket")
                || bare.ends_with("_seconds_sum")
                || bare.ends_with("_seconds_count")
                || bare.ends_with("_total"),
            "{line}"
        );
        if let Some(labels) = name.strip_prefix(bare) {
            assert!(labels.is_empty() || labels.starts_with("{le=\""), "{line}");
        }
    }
}
