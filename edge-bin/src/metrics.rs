//! `GET /metrics`: Prometheus text exposition format 0.0.4 (O1). Base units,
//! `_total` counters, and only bounded labels: never raw payloads,
//! credentials, caller identities or unbounded ids.

use std::fmt::Write;

use iop_engine::metrics::{Count, Registry};
use iop_wire::pb;

use crate::control::{Counters, FailureReason};

/// The content type of the exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn counter(out: &mut String, name: &str, help: &str, samples: &[(&str, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} counter");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

fn gauge(out: &mut String, name: &str, help: &str, value: u64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name} {value}");
}

/// `(label, value)` per failure reason, in [`FailureReason::ALL`] order.
fn by_reason(values: &[u64; 5]) -> Vec<(String, u64)> {
    FailureReason::ALL
        .iter()
        .map(|r| (format!("reason=\"{}\"", r.as_str()), values[*r as usize]))
        .collect()
}

fn owned(samples: &[(String, u64)]) -> Vec<(&str, u64)> {
    samples.iter().map(|(l, v)| (l.as_str(), *v)).collect()
}

/// Renders the Edge's metrics; `ejected`: providers ejected now.
pub fn render(counters: &Counters, snapshots: &[pb::ProviderSnapshot], ejected: usize) -> String {
    let mut out = String::new();
    counter(
        &mut out,
        "iop_edge_provider_health_evidence_total",
        "Stall health evidence received on terminals, by validation result.",
        &[
            ("result=\"accepted\"", counters.health_evidence_accepted),
            ("result=\"rejected\"", counters.health_evidence_rejected),
        ],
    );
    counter(
        &mut out,
        "iop_edge_provider_health_transitions_total",
        "Runtime provider health overlay transitions.",
        &[
            (
                "to=\"unavailable\"",
                counters.health_transitions_unavailable,
            ),
            ("to=\"available\"", counters.health_transitions_available),
        ],
    );
    counter(
        &mut out,
        "iop_edge_liveness_recovery_eligibility_total",
        "Recovery eligibility: stalled requests by confirmed handoff (source stall_handoff); \
         retryable attempt failures by whether nothing had reached the client yet (source failover).",
        &[
            (
                "source=\"stall_handoff\",eligible=\"true\"",
                counters.recovery_eligible,
            ),
            (
                "source=\"stall_handoff\",eligible=\"false\"",
                counters.recovery_ineligible,
            ),
            (
                "source=\"failover\",eligible=\"true\"",
                counters.failover_eligible,
            ),
            (
                "source=\"failover\",eligible=\"false\"",
                counters.failover_ineligible,
            ),
        ],
    );
    counter(
        &mut out,
        "iop_edge_liveness_recovery_results_total",
        "Recovery results: CAPABILITIES probe answers by effect on the overlay (source \
         recovery_probe); eligible failures by what failover did (source failover).",
        &[
            (
                "source=\"recovery_probe\",result=\"recovered\"",
                counters.recovery_probe_recovered,
            ),
            (
                "source=\"recovery_probe\",result=\"unchanged\"",
                counters.recovery_probe_unchanged,
            ),
            (
                "source=\"failover\",result=\"retried\"",
                counters.failover_retried,
            ),
            (
                "source=\"failover\",result=\"recovered\"",
                counters.failover_recovered,
            ),
            (
                "source=\"failover\",result=\"attempts_exhausted\"",
                counters.failover_exhausted,
            ),
            (
                "source=\"failover\",result=\"no_candidate\"",
                counters.failover_no_candidate,
            ),
            (
                "source=\"failover\",result=\"requeued\"",
                counters.failover_requeued,
            ),
            (
                "source=\"failover\",result=\"deadline_passed\"",
                counters.failover_deadline,
            ),
        ],
    );
    counter(
        &mut out,
        "iop_edge_provider_attempt_failures_total",
        "Attempts held against their provider's health, by failure.",
        &owned(&by_reason(&counters.attempt_failures)),
    );
    counter(
        &mut out,
        "iop_edge_provider_ejections_total",
        "Providers taken out of rotation by passive health, by the failure that tipped it.",
        &owned(&by_reason(&counters.ejections)),
    );
    counter(
        &mut out,
        "iop_edge_provider_ejections_suppressed_total",
        "Ejections not made: the model's share of ejected providers was reached.",
        &[("", counters.ejections_suppressed)],
    );
    counter(
        &mut out,
        "iop_edge_provider_readmissions_total",
        "Ejected providers back in rotation, by how.",
        &[
            ("via=\"timer\"", counters.readmissions_timer),
            ("via=\"probe\"", counters.readmissions_probe),
        ],
    );
    gauge(
        &mut out,
        "iop_edge_providers_ejected",
        "Providers out of rotation by passive health now.",
        ejected as u64,
    );
    counter(
        &mut out,
        "iop_edge_response_wait_timeouts_total",
        "Dispatched requests cancelled because no response started within edge.response_wait_timeout_ms.",
        &[("", counters.response_wait_timeouts)],
    );
    let sum = |f: fn(&pb::ProviderSnapshot) -> u32| -> u64 {
        snapshots.iter().map(|s| u64::from(f(s))).sum()
    };
    gauge(
        &mut out,
        "iop_edge_providers_connected",
        "Providers whose node is dispatch-ready.",
        snapshots.iter().filter(|s| s.connected).count() as u64,
    );
    gauge(
        &mut out,
        "iop_edge_leases_in_flight",
        "Provider leases currently held.",
        sum(|s| s.in_flight),
    );
    gauge(
        &mut out,
        "iop_edge_effective_capacity",
        "Sum of effective provider capacity.",
        sum(|s| s.capacity),
    );
    out
}

/// The front door's gauges, from the merged per-core counters (every core's
/// accepts and closes): open client connections and node TLS handshakes in
/// progress.
pub fn render_front_door(registry: &Registry) -> String {
    let mut out = String::new();
    let open = |started: Count, ended: Count| {
        registry
            .counter(started)
            .saturating_sub(registry.counter(ended))
    };
    gauge(
        &mut out,
        "iop_edge_client_connections_open",
        "Client connections open now.",
        open(
            Count::EdgeClientConnectionsAccepted,
            Count::EdgeClientConnectionsClosed,
        ),
    );
    gauge(
        &mut out,
        "iop_edge_node_handshakes_in_progress",
        "Node TLS handshakes in progress now.",
        open(
            Count::EdgeNodeHandshakesStarted,
            Count::EdgeNodeHandshakesEnded,
        ),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // CONTRACT: O1 — the four contract counters are exposed with bounded
    // labels only.
    #[test]
    fn renders_contract_counters() {
        let counters = Counters {
            health_evidence_accepted: 2,
            health_evidence_rejected: 1,
            health_transitions_unavailable: 1,
            response_wait_timeouts: 3,
            ..Default::default()
        };
        let text = render(&counters, &[], 1);
        assert!(text.contains("iop_edge_response_wait_timeouts_total 3\n"));
        assert!(text.contains("iop_edge_providers_ejected 1\n"));
        assert!(text.contains("iop_edge_provider_health_evidence_total{result=\"accepted\"} 2\n"));
        assert!(text.contains("iop_edge_provider_health_evidence_total{result=\"rejected\"} 1\n"));
        assert!(text.contains("iop_edge_provider_health_transitions_total{to=\"unavailable\"} 1\n"));
        assert!(text.contains(
            "iop_edge_liveness_recovery_eligibility_total{source=\"stall_handoff\",eligible=\"true\"} 0\n"
        ));
        assert!(text.contains(
            "iop_edge_liveness_recovery_results_total{source=\"recovery_probe\",result=\"recovered\"} 0\n"
        ));
        assert!(text.contains("# TYPE iop_edge_provider_health_evidence_total counter\n"));
        let mut registry = Registry::new();
        registry.add(Count::EdgeClientConnectionsAccepted, 5);
        registry.add(Count::EdgeClientConnectionsClosed, 3);
        registry.add(Count::EdgeNodeHandshakesStarted, 2);
        assert_eq!(
            render_front_door(&registry),
            "# HELP iop_edge_client_connections_open Client connections open now.\n\
             # TYPE iop_edge_client_connections_open gauge\n\
             iop_edge_client_connections_open 2\n\
             # HELP iop_edge_node_handshakes_in_progress Node TLS handshakes in progress now.\n\
             # TYPE iop_edge_node_handshakes_in_progress gauge\n\
             iop_edge_node_handshakes_in_progress 2\n"
        );
        let failing = Counters {
            attempt_failures: [4, 1, 0, 2, 0],
            ejections: [1, 0, 0, 1, 0],
            readmissions_probe: 2,
            failover_eligible: 6,
            failover_ineligible: 1,
            failover_retried: 5,
            failover_no_candidate: 1,
            ..Default::default()
        };
        let text = render(&failing, &[], 0);
        for line in [
            "iop_edge_provider_attempt_failures_total{reason=\"connect_failure\"} 4\n",
            "iop_edge_provider_attempt_failures_total{reason=\"reset_before_response\"} 1\n",
            "iop_edge_provider_attempt_failures_total{reason=\"upstream_5xx\"} 0\n",
            "iop_edge_provider_attempt_failures_total{reason=\"stalled\"} 2\n",
            "iop_edge_provider_attempt_failures_total{reason=\"response_wait_timeout\"} 0\n",
            "iop_edge_provider_ejections_total{reason=\"connect_failure\"} 1\n",
            "iop_edge_provider_ejections_total{reason=\"stalled\"} 1\n",
            "iop_edge_provider_readmissions_total{via=\"timer\"} 0\n",
            "iop_edge_provider_readmissions_total{via=\"probe\"} 2\n",
            "iop_edge_providers_ejected 0\n",
            // CONTRACT: O1 — the failover series of the two recovery counters.
            "iop_edge_liveness_recovery_eligibility_total{source=\"failover\",eligible=\"true\"} 6\n",
            "iop_edge_liveness_recovery_eligibility_total{source=\"failover\",eligible=\"false\"} 1\n",
            "iop_edge_liveness_recovery_results_total{source=\"failover\",result=\"retried\"} 5\n",
            "iop_edge_liveness_recovery_results_total{source=\"failover\",result=\"no_candidate\"} 1\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        // Every sample line is `name{bounded labels} value` or `name value`.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(value.parse::<u64>().is_ok(), "{line}");
            assert!(name.starts_with("iop_edge_"), "{line}");
        }
    }
}
