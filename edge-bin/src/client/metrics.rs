//! `GET /metrics`: Prometheus text exposition format 0.0.4 (O1). Base units,
//! `_total` counters, and only bounded labels: never raw payloads,
//! credentials, caller identities or unbounded ids. Every metric is listed
//! in `docs/metrics.md`.
//!
//! ```text
//! scrape ─┬─ Control: counters, snapshots, drains, queue depths, ready nodes
//!         ├─ engine registries (histograms, relay counters), front door
//!         ├─ request series (crate::plane::request_metrics), access log,
//!         │  usage file (their write and open errors, whether failing)
//!         ├─ iop_build_info, process_*
//!         └─ the nodes' series (crate::link::node_metrics: pulled over their
//!            links at most once per node_metrics_max_age_ms) ─► their lines
//!            with node="<id>" added
//!               ─► Families: one HELP/TYPE per family, samples of all
//! ```

use std::collections::HashMap;
use std::fmt::Write;
use std::rc::Rc;

use iop_engine::metrics::buckets::escape_label_value;
use iop_engine::metrics::{self as engine_metrics, process, Count, Registry, Side};
use iop_wire::pb;

use crate::control::{Counters, FailureReason, ModelView, NodeView, ProviderView, RoutingPolicy};
use crate::link::edge::Edge;
use crate::plane::cluster::ClusterView;

/// Largest node exposition taken into a scrape, in lines (a node's text is
/// also bounded by the frame size limit).
pub const MAX_NODE_LINES: usize = 20_000;

/// The whole `/metrics` page of this Edge, its nodes' series included.
pub async fn scrape(edge: &Rc<Edge>) -> String {
    let (mut text, depths, nodes) = edge
        .with_control(|control| {
            let mut text = render(
                control.counters(),
                &control.snapshots(),
                control.ejected_count(),
            );
            text.push_str(&render_drains(
                &control.node_views(),
                &control.provider_views(),
            ));
            text.push_str(&render_routing(&control.model_views()));
            (text, control.queue_depths(), control.ready_nodes())
        })
        .await
        .unwrap_or_default();
    let answers = crate::link::node_metrics::node_series(edge, nodes).await;
    let requests = &edge.settings.request_metrics;
    // Latency histograms and relay counters, merged over cores.
    let latency = engine_metrics::merged();
    text.push_str(&engine_metrics::render_prometheus(&latency, Side::Edge));
    text.push_str(&render_front_door(&latency));
    text.push_str(&edge.settings.access_log.render_prometheus());
    text.push_str(&edge.settings.usage_log.render_prometheus());
    text.push_str(&requests.render(&depths));
    if let Some(budgets) = edge.settings.client_keys.budgets_status() {
        text.push_str(&render_budgets(&budgets));
    }
    if let Some(cluster) = &edge.settings.cluster {
        text.push_str(&render_cluster(cluster));
    }
    process::render_build_and_process(&mut text);
    let mut families = Families::default();
    families.add(&text, None);
    for (node, node_text) in answers.iter() {
        families.add(node_text, Some(node));
    }
    families.render()
}

/// Metric families gathered from several expositions: each family's HELP
/// and TYPE once (the first seen), then its samples from every source, in
/// order of first appearance.
#[derive(Debug, Default)]
pub struct Families {
    order: Vec<Family>,
    by_name: HashMap<String, usize>,
}

#[derive(Debug)]
struct Family {
    name: String,
    help: Option<String>,
    kind: Option<String>,
    samples: String,
}

impl Families {
    fn family(&mut self, name: &str) -> &mut Family {
        let i = match self.by_name.get(name) {
            Some(&i) => i,
            None => {
                self.order.push(Family {
                    name: name.to_owned(),
                    help: None,
                    kind: None,
                    samples: String::new(),
                });
                self.by_name.insert(name.to_owned(), self.order.len() - 1);
                self.order.len() - 1
            }
        };
        &mut self.order[i]
    }

    /// Adds the families of exposition `text`; with `node`, every sample
    /// gets the label `node="<node>"` first. Lines out of shape (and, of a
    /// node's text, any past [`MAX_NODE_LINES`]) are skipped, never passed
    /// on. The Edge's own text is taken whole: its size follows its own
    /// configuration (models, providers), not a peer's answer.
    pub fn add(&mut self, text: &str, node: Option<&str>) {
        let node_label = node.map(|n| format!("node=\"{}\"", escape_label_value(n)));
        let cap = if node.is_some() {
            MAX_NODE_LINES
        } else {
            usize::MAX
        };
        // The family of the samples that follow (a histogram's `_bucket`,
        // `_sum` and `_count` lines belong to the family of its TYPE).
        let mut current: Option<String> = None;
        for line in text.lines().take(cap) {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                let mut words = comment.trim_start().splitn(3, ' ');
                let (Some(keyword), Some(name)) = (words.next(), words.next()) else {
                    continue;
                };
                if !is_metric_name(name) {
                    continue;
                }
                let rest = words.next().unwrap_or("").to_owned();
                match keyword {
                    "HELP" => {
                        let family = self.family(name);
                        family.help.get_or_insert(rest);
                    }
                    "TYPE" => {
                        let family = self.family(name);
                        family.kind.get_or_insert(rest);
                        current = Some(name.to_owned());
                    }
                    _ => {}
                }
                continue;
            }
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = &line[..name_end];
            if !is_metric_name(name) || name_end == line.len() {
                continue;
            }
            let family_name = match &current {
                Some(f) if name == f || is_part_of(name, f) => f.clone(),
                _ => name.to_owned(),
            };
            let rest = &line[name_end..];
            let sample = match (&node_label, rest.strip_prefix('{')) {
                (None, _) => line.to_owned(),
                (Some(label), Some(labels)) if labels.starts_with('}') => {
                    format!("{name}{{{label}{labels}")
                }
                (Some(label), Some(labels)) => format!("{name}{{{label},{labels}"),
                (Some(label), None) => format!("{name}{{{label}}}{rest}"),
            };
            let family = self.family(&family_name);
            family.samples.push_str(&sample);
            family.samples.push('\n');
        }
    }

    /// The gathered families as one exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for family in &self.order {
            if let Some(help) = &family.help {
                let _ = writeln!(out, "# HELP {} {help}", family.name);
            }
            if let Some(kind) = &family.kind {
                let _ = writeln!(out, "# TYPE {} {kind}", family.name);
            }
            out.push_str(&family.samples);
        }
        out
    }
}

/// Whether `name` is a valid metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`).
fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Whether sample `name` is a histogram or summary line of `family`.
fn is_part_of(name: &str, family: &str) -> bool {
    name.strip_prefix(family)
        .is_some_and(|suffix| matches!(suffix, "_bucket" | "_sum" | "_count"))
}

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

/// The token budgets' series: per principal with a budget and period
/// (`day`, `month`), the tokens used in the current period and this
/// Edge's budget (its share in a cluster).
pub fn render_budgets(budgets: &crate::plane::client_keys::BudgetsStatus) -> String {
    let mut out = String::new();
    for (name, help, value) in [
        (
            "iop_edge_key_budget_used_tokens",
            "Tokens a principal used in the current UTC day or month (tokens_per_day, \
             tokens_per_month).",
            (|p: &crate::plane::budgets::PeriodView| p.used) as fn(&_) -> u64,
        ),
        (
            "iop_edge_key_budget_limit_tokens",
            "A principal's token budget for the UTC day or month (this Edge's share).",
            |p| p.limit,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for b in &budgets.principals {
            for (period, view) in [("day", &b.day), ("month", &b.month)] {
                if let Some(view) = view {
                    let _ = writeln!(
                        out,
                        "{name}{{principal=\"{}\",period=\"{period}\"}} {}",
                        escape_label_value(&b.principal),
                        value(view)
                    );
                }
            }
        }
    }
    out
}

/// The cluster member's series: etcd health, ownership claims, and the
/// cluster's nodes per owning Edge (as this Edge's watch sees them).
pub fn render_cluster(cluster: &ClusterView) -> String {
    let c = &cluster.counters;
    let load = |v: &std::sync::atomic::AtomicU64| v.load(std::sync::atomic::Ordering::Relaxed);
    let mut out = String::new();
    gauge(
        &mut out,
        "iop_edge_cluster_up",
        "1 while this Edge holds its etcd lease (it may own nodes and dispatch), else 0.",
        u64::from(cluster.is_up()),
    );
    counter(
        &mut out,
        "iop_edge_cluster_etcd_errors_total",
        "etcd calls that failed on every endpoint or were answered with an error.",
        &[("", load(&c.etcd_errors))],
    );
    counter(
        &mut out,
        "iop_edge_cluster_claims_total",
        "Ownership claims of node ids in etcd, by outcome.",
        &[
            ("outcome=\"granted\"", load(&c.claims_granted)),
            ("outcome=\"failed\"", load(&c.claims_failed)),
        ],
    );
    counter(
        &mut out,
        "iop_edge_cluster_releases_total",
        "Owner keys this Edge deleted when its owner connection went away.",
        &[("", load(&c.releases))],
    );
    counter(
        &mut out,
        "iop_edge_cluster_leases_granted_total",
        "etcd leases this Edge was granted (the first and one after each loss).",
        &[("", load(&c.leases_granted))],
    );
    counter(
        &mut out,
        "iop_edge_cluster_self_fences_total",
        "Times this Edge fenced every node it owned because it could no longer prove its lease.",
        &[("", load(&c.self_fences))],
    );
    counter(
        &mut out,
        "iop_edge_cluster_watch_restarts_total",
        "Times the watch of the cluster's keys broke and was established again.",
        &[("", load(&c.watch_restarts))],
    );
    let per_edge: Vec<(String, u64)> = cluster
        .nodes_per_edge()
        .into_iter()
        .map(|(edge, n)| {
            (
                format!(
                    "edge=\"{}\"",
                    iop_engine::metrics::buckets::escape_label_value(&edge)
                ),
                n,
            )
        })
        .collect();
    let _ = writeln!(
        out,
        "# HELP iop_edge_cluster_nodes Nodes of the cluster owned by each Edge."
    );
    let _ = writeln!(out, "# TYPE iop_edge_cluster_nodes gauge");
    for (labels, n) in per_edge {
        let _ = writeln!(out, "iop_edge_cluster_nodes{{{labels}}} {n}");
    }
    gauge(
        &mut out,
        "iop_edge_cluster_edges",
        "Edges of the cluster announced in etcd (this one included).",
        cluster.edges().len() as u64,
    );
    let forwarded: Vec<(String, u64)> = c
        .forwarded_totals()
        .into_iter()
        .map(|(edge, outcome, n)| {
            (
                format!(
                    "edge=\"{}\",outcome=\"{}\"",
                    iop_engine::metrics::buckets::escape_label_value(&edge),
                    outcome.as_str()
                ),
                n,
            )
        })
        .collect();
    counter(
        &mut out,
        "iop_edge_cluster_forwarded_total",
        "Requests forwarded to another Edge's peer listener, by target and outcome \
         (ok: it answered; unavailable: not reached before the request was written; \
         failed: its answer broke off).",
        &owned(&forwarded),
    );
    counter(
        &mut out,
        "iop_edge_cluster_forward_reasons_total",
        "Requests forwarded to another Edge, by why they were not served here \
         (no_local_node: this Edge owns no node of the model; local_full: its own \
         had no free slot and a peer's had).",
        &[
            ("reason=\"no_local_node\"", load(&c.forwarded_no_local_node)),
            ("reason=\"local_full\"", load(&c.forwarded_local_full)),
        ],
    );
    counter(
        &mut out,
        "iop_edge_cluster_summary_poll_failures_total",
        "Polls of a peer Edge's capacity summary that failed (no answer in time, \
         an error status, or a summary that does not parse).",
        &[("", load(&c.summary_poll_failures))],
    );
    gauge(
        &mut out,
        "iop_edge_cluster_fleet_revision",
        "The fleet revision in force (the etcd revision of the cluster's fleet key; \
         0 while this Edge runs its own file's fleet, not seen in etcd).",
        cluster.fleet().revision,
    );
    counter(
        &mut out,
        "iop_edge_cluster_fleet_refused_total",
        "Fleets published in the cluster that this Edge refused (they do not validate \
         with its own file); its running fleet stayed.",
        &[("", load(&c.fleet_refused))],
    );
    counter(
        &mut out,
        "iop_edge_cluster_peer_requests_total",
        "Inference requests other Edges forwarded to this one (its peer listener).",
        &[("", load(&c.peer_requests))],
    );
    out
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
        "iop_edge_node_drain_redispatched_total",
        "Requests sent to a node that closed its drain (Close drained) before it started \
         them, dispatched again: not attempts, never seen by a provider.",
        &[("", counters.drain_redispatched)],
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

/// One 0/1 gauge family with a sample per item (`labels` of each).
fn flags<T>(
    out: &mut String,
    name: &str,
    help: &str,
    items: &[T],
    labels: impl Fn(&T) -> String,
    on: impl Fn(&T) -> bool,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for item in items {
        let _ = writeln!(out, "{name}{{{}}} {}", labels(item), u8::from(on(item)));
    }
}

/// Which nodes and providers take no new work, and why: one sample per
/// node and provider of the configuration (and per one a reload removed,
/// while what it runs finishes), so the label sets are bounded by it.
/// The routing series of every model: dispatches by policy and route, the
/// imbalance fallbacks, the matched prefix lengths (a histogram) and the
/// prefix trees' size.
pub fn render_routing(models: &[ModelView]) -> String {
    use crate::control::routing::MATCHED_BYTES_BUCKETS;
    let mut out = String::new();
    let label = |m: &ModelView| format!("model=\"{}\"", escape_label_value(&m.model));
    let _ = writeln!(
        out,
        "# HELP iop_edge_routing_decisions_total Dispatches by the model's routing policy and how \
         the provider was chosen: by load (least loaded, or a policy's fallback), by prefix match, \
         or by session."
    );
    let _ = writeln!(out, "# TYPE iop_edge_routing_decisions_total counter");
    for m in models {
        let s = &m.routing_stats;
        for (route, n) in [
            ("load", s.by_load),
            ("match", s.by_match),
            ("session", s.by_session),
        ] {
            let _ = writeln!(
                out,
                "iop_edge_routing_decisions_total{{{},policy=\"{}\",route=\"{route}\"}} {n}",
                label(m),
                m.routing.as_str()
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP iop_edge_routing_imbalance_fallbacks_total Dispatches to the least loaded provider \
         because the preferred one was too busy beside it (routing.balance_*)."
    );
    let _ = writeln!(
        out,
        "# TYPE iop_edge_routing_imbalance_fallbacks_total counter"
    );
    for m in models {
        let _ = writeln!(
            out,
            "iop_edge_routing_imbalance_fallbacks_total{{{}}} {}",
            label(m),
            m.routing_stats.imbalance_fallbacks
        );
    }
    let _ = writeln!(
        out,
        "# HELP iop_edge_routing_affinity_waits_total Requests that waited for their preferred \
         provider, full at their arrival (routing.affinity_wait_ms), by how the wait ended: \
         served (it freed in time) or expired (then any provider)."
    );
    let _ = writeln!(out, "# TYPE iop_edge_routing_affinity_waits_total counter");
    for m in models {
        let s = &m.routing_stats;
        let expired = s.affinity_waits_expired;
        for (result, n) in [
            ("served", s.affinity_waits.saturating_sub(expired)),
            ("expired", expired),
        ] {
            let _ = writeln!(
                out,
                "iop_edge_routing_affinity_waits_total{{{},result=\"{result}\"}} {n}",
                label(m)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP iop_edge_routing_matched_prefix_bytes How many bytes of each prefix-routed \
         request's prompt the model's tree matched."
    );
    let _ = writeln!(
        out,
        "# TYPE iop_edge_routing_matched_prefix_bytes histogram"
    );
    for m in models.iter().filter(|m| m.routing == RoutingPolicy::Prefix) {
        let s = &m.routing_stats;
        let mut cumulative = 0;
        for (i, upper) in MATCHED_BYTES_BUCKETS.iter().enumerate() {
            cumulative += s.matched_bytes[i];
            let _ = writeln!(
                out,
                "iop_edge_routing_matched_prefix_bytes_bucket{{{},le=\"{upper}\"}} {cumulative}",
                label(m)
            );
        }
        let count: u64 = s.matched_bytes.iter().sum();
        let _ = writeln!(
            out,
            "iop_edge_routing_matched_prefix_bytes_bucket{{{},le=\"+Inf\"}} {count}",
            label(m)
        );
        let _ = writeln!(
            out,
            "iop_edge_routing_matched_prefix_bytes_sum{{{}}} {}",
            label(m),
            s.matched_bytes_sum
        );
        let _ = writeln!(
            out,
            "iop_edge_routing_matched_prefix_bytes_count{{{}}} {count}",
            label(m)
        );
    }
    let _ = writeln!(
        out,
        "# HELP iop_edge_routing_tree_bytes The bytes a prefix model's tree holds (at most \
         routing.prefix_tree_bytes)."
    );
    let _ = writeln!(out, "# TYPE iop_edge_routing_tree_bytes gauge");
    for m in models.iter().filter(|m| m.routing == RoutingPolicy::Prefix) {
        let _ = writeln!(
            out,
            "iop_edge_routing_tree_bytes{{{}}} {}",
            label(m),
            m.tree_bytes
        );
    }
    out
}

pub fn render_drains(nodes: &[NodeView], providers: &[ProviderView]) -> String {
    let mut out = String::new();
    let node = |n: &NodeView| format!("node=\"{}\"", escape_label_value(&n.node_id));
    let provider = |p: &ProviderView| {
        format!(
            "node=\"{}\",provider=\"{}\"",
            escape_label_value(&p.node_id),
            escape_label_value(&p.provider_id)
        )
    };
    flags(
        &mut out,
        "iop_edge_node_drained",
        "1 while an operator drains the node (POST /admin/nodes/{node}/drain): none of its \
         providers takes new work.",
        nodes,
        node,
        |n| n.drained,
    );
    flags(
        &mut out,
        "iop_edge_node_draining",
        "1 while the node's connection says the node drains: it takes no new work.",
        nodes,
        node,
        |n| n.draining,
    );
    flags(
        &mut out,
        "iop_edge_node_removed",
        "1 while a node a reload removed still finishes what it was given.",
        nodes,
        node,
        |n| n.removed,
    );
    flags(
        &mut out,
        "iop_edge_provider_drained",
        "1 while an operator drains the provider itself \
         (POST /admin/providers/{node}/{provider}/drain): it takes no new work.",
        providers,
        provider,
        |p| p.drained,
    );
    flags(
        &mut out,
        "iop_edge_provider_removed",
        "1 while a provider a reload removed still finishes its leases.",
        providers,
        provider,
        |p| p.removed,
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

    #[test]
    fn node_expositions_are_labelled_and_merged_by_family() {
        let edge = "# HELP process_open_fds Number of open file descriptors.\n\
                    # TYPE process_open_fds gauge\n\
                    process_open_fds 12\n";
        let node = "# HELP iop_node_x_seconds X.\n\
                    # TYPE iop_node_x_seconds histogram\n\
                    iop_node_x_seconds_bucket{le=\"+Inf\"} 2\n\
                    iop_node_x_seconds_sum 0.5\n\
                    iop_node_x_seconds_count 2\n\
                    # HELP process_open_fds Other help.\n\
                    # TYPE process_open_fds gauge\n\
                    process_open_fds 7\n\
                    empty{} 1\n\
                    \n\
                    # a comment\n\
                    {broken} 1\n\
                    novalue\n";
        let mut families = Families::default();
        families.add(edge, None);
        families.add(node, Some("node-a"));
        families.add(node, Some("node-\"b"));
        assert_eq!(
            families.render(),
            "# HELP process_open_fds Number of open file descriptors.\n\
             # TYPE process_open_fds gauge\n\
             process_open_fds 12\n\
             process_open_fds{node=\"node-a\"} 7\n\
             process_open_fds{node=\"node-\\\"b\"} 7\n\
             # HELP iop_node_x_seconds X.\n\
             # TYPE iop_node_x_seconds histogram\n\
             iop_node_x_seconds_bucket{node=\"node-a\",le=\"+Inf\"} 2\n\
             iop_node_x_seconds_sum{node=\"node-a\"} 0.5\n\
             iop_node_x_seconds_count{node=\"node-a\"} 2\n\
             iop_node_x_seconds_bucket{node=\"node-\\\"b\",le=\"+Inf\"} 2\n\
             iop_node_x_seconds_sum{node=\"node-\\\"b\"} 0.5\n\
             iop_node_x_seconds_count{node=\"node-\\\"b\"} 2\n\
             empty{node=\"node-a\"} 1\n\
             empty{node=\"node-\\\"b\"} 1\n"
        );
    }

    // The line cap is for a node's answer; the Edge's own series (one per
    // model and provider, so many in a large fleet) are all kept.
    #[test]
    fn only_a_nodes_exposition_is_cut_at_the_line_cap() {
        let lines = MAX_NODE_LINES + 5;
        let text: String = (0..lines).map(|i| format!("m{{i=\"{i}\"}} 1\n")).collect();
        let mut edge = Families::default();
        edge.add(&text, None);
        assert_eq!(edge.render().lines().count(), lines);
        let mut node = Families::default();
        node.add(&text, Some("n"));
        assert_eq!(node.render().lines().count(), MAX_NODE_LINES);
    }

    #[test]
    fn budgets_are_one_sample_per_principal_and_period() {
        use crate::plane::budgets::{BudgetView, PeriodView};
        let view = |used, limit| PeriodView {
            used,
            limit,
            resets_at_unix_ms: 0,
        };
        let text = render_budgets(&crate::plane::client_keys::BudgetsStatus {
            now_unix_ms: 0,
            principals: vec![
                BudgetView {
                    principal: "team-a".into(),
                    day: Some(view(1034, 1000)),
                    month: Some(view(5000, 90000)),
                },
                BudgetView {
                    principal: "b\"q".into(),
                    day: None,
                    month: Some(view(0, 7)),
                },
            ],
            file: None,
        });
        assert_eq!(
            text,
            "# HELP iop_edge_key_budget_used_tokens Tokens a principal used in the current UTC \
             day or month (tokens_per_day, tokens_per_month).\n\
             # TYPE iop_edge_key_budget_used_tokens gauge\n\
             iop_edge_key_budget_used_tokens{principal=\"team-a\",period=\"day\"} 1034\n\
             iop_edge_key_budget_used_tokens{principal=\"team-a\",period=\"month\"} 5000\n\
             iop_edge_key_budget_used_tokens{principal=\"b\\\"q\",period=\"month\"} 0\n\
             # HELP iop_edge_key_budget_limit_tokens A principal's token budget for the UTC day \
             or month (this Edge's share).\n\
             # TYPE iop_edge_key_budget_limit_tokens gauge\n\
             iop_edge_key_budget_limit_tokens{principal=\"team-a\",period=\"day\"} 1000\n\
             iop_edge_key_budget_limit_tokens{principal=\"team-a\",period=\"month\"} 90000\n\
             iop_edge_key_budget_limit_tokens{principal=\"b\\\"q\",period=\"month\"} 7\n"
        );
    }

    #[test]
    fn drains_are_one_sample_per_node_and_provider() {
        let node = |id: &str, drained, draining, removed| NodeView {
            node_id: id.into(),
            phase: crate::control::NodePhase::Ready,
            version: String::new(),
            registered_at: None,
            ready_at: None,
            offline_since: None,
            drained,
            draining,
            removed,
        };
        let provider = |n: &str, p: &str, drained, removed| ProviderView {
            node_id: n.into(),
            provider_id: p.into(),
            drained,
            node_drained: false,
            draining: false,
            removed,
        };
        let text = render_drains(
            &[
                node("a", true, false, false),
                node("b\"", false, true, true),
            ],
            &[
                provider("a", "p1", false, false),
                provider("b\"", "p2", true, true),
            ],
        );
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            samples,
            [
                "iop_edge_node_drained{node=\"a\"} 1",
                "iop_edge_node_drained{node=\"b\\\"\"} 0",
                "iop_edge_node_draining{node=\"a\"} 0",
                "iop_edge_node_draining{node=\"b\\\"\"} 1",
                "iop_edge_node_removed{node=\"a\"} 0",
                "iop_edge_node_removed{node=\"b\\\"\"} 1",
                "iop_edge_provider_drained{node=\"a\",provider=\"p1\"} 0",
                "iop_edge_provider_drained{node=\"b\\\"\",provider=\"p2\"} 1",
                "iop_edge_provider_removed{node=\"a\",provider=\"p1\"} 0",
                "iop_edge_provider_removed{node=\"b\\\"\",provider=\"p2\"} 1",
            ]
        );
        assert!(text.contains("# TYPE iop_edge_provider_drained gauge\n"));
        assert_eq!(text.matches("# HELP ").count(), 5);
    }

    #[test]
    fn routing_is_counted_per_model_and_route_with_a_histogram_of_matches() {
        let model = |name: &str, routing, stats| ModelView {
            model: name.into(),
            providers: 2,
            candidates: 2,
            queued: 0,
            max_queue: 8,
            routing,
            routing_stats: stats,
            tree_bytes: 4096,
            tree_budget_bytes: 65536,
        };
        let mut matched = [0; 7];
        matched[0] = 2; // 0 bytes
        matched[2] = 3; // 257..=1024
        matched[6] = 1; // above 65536
        let text = render_routing(&[
            model(
                "p",
                RoutingPolicy::Prefix,
                crate::control::RoutingStats {
                    by_load: 3,
                    by_match: 3,
                    imbalance_fallbacks: 1,
                    matched_bytes: matched,
                    matched_bytes_sum: 70_000,
                    affinity_waits: 4,
                    affinity_waits_expired: 1,
                    ..Default::default()
                },
            ),
            model(
                "s",
                RoutingPolicy::Session,
                crate::control::RoutingStats::default(),
            ),
        ]);
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            samples,
            [
                "iop_edge_routing_decisions_total{model=\"p\",policy=\"prefix\",route=\"load\"} 3",
                "iop_edge_routing_decisions_total{model=\"p\",policy=\"prefix\",route=\"match\"} 3",
                "iop_edge_routing_decisions_total{model=\"p\",policy=\"prefix\",route=\"session\"} 0",
                "iop_edge_routing_decisions_total{model=\"s\",policy=\"session\",route=\"load\"} 0",
                "iop_edge_routing_decisions_total{model=\"s\",policy=\"session\",route=\"match\"} 0",
                "iop_edge_routing_decisions_total{model=\"s\",policy=\"session\",route=\"session\"} 0",
                "iop_edge_routing_imbalance_fallbacks_total{model=\"p\"} 1",
                "iop_edge_routing_imbalance_fallbacks_total{model=\"s\"} 0",
                "iop_edge_routing_affinity_waits_total{model=\"p\",result=\"served\"} 3",
                "iop_edge_routing_affinity_waits_total{model=\"p\",result=\"expired\"} 1",
                "iop_edge_routing_affinity_waits_total{model=\"s\",result=\"served\"} 0",
                "iop_edge_routing_affinity_waits_total{model=\"s\",result=\"expired\"} 0",
                "iop_edge_routing_matched_prefix_bytes_bucket{model=\"p\",le=\"0\"} 2",
                "iop_edge_routing_matched_prefix_bytes_bucket{model=\"p\",le=\"256\"} 2",
                "iop_edge_routing_matched_prefix_bytes_bucket{model=\"p\",le=\"1024\"} 5",
                "iop_edge_routing_matched_prefix_bytes_bucket{model=\"p\",le=\"4096\"} 5",
                "iop_edge_routing_matched_prefix_bytes_bucket{model=\"p\",le=\"16384\"} 5",
                "iop_edge_routing_matched_prefix_bytes_bucket{model=\"p\",le=\"65536\"} 5",
                "iop_edge_routing_matched_prefix_bytes_bucket{model=\"p\",le=\"+Inf\"} 6",
                "iop_edge_routing_matched_prefix_bytes_sum{model=\"p\"} 70000",
                "iop_edge_routing_matched_prefix_bytes_count{model=\"p\"} 6",
                "iop_edge_routing_tree_bytes{model=\"p\"} 4096",
            ]
        );
        assert_eq!(text.matches("# TYPE ").count(), 5);
    }

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
