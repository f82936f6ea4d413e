//! JSON projections for `GET /status` (P1–P3), with each provider's
//! passive-health state and whether it takes new work (operator drains,
//! an owner that drains, removal by a reload), each node's, and the state
//! of the Edge's own log files. Addresses, tokens and transport internals
//! are never included (X5).

use std::collections::BTreeSet;
use std::time::Instant;

use iop_wire::pb;
use serde_json::{json, Value};

use crate::control::outlier::OutlierState;
use crate::control::{Control, ModelView, NodePhase, NodeView, ProviderView};
use crate::plane::access::{destination_name, AccessStatus};
use crate::plane::budgets::{rfc3339_utc, PeriodView};
use crate::plane::client_keys::BudgetsStatus;
use crate::plane::usage::UsageStatus;

/// A provider's passive-health state as `/status` shows it (`outlier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutlierView {
    /// Out of rotation now.
    pub ejected: bool,
    /// The failure that tipped the ejection.
    pub reason: Option<&'static str>,
    /// Failures in a row so far.
    pub consecutive_failures: u32,
    /// Ejections in a row (the ejection time multiplier).
    pub ejections: u32,
    /// Until its re-admission by timer, while ejected.
    pub readmit_in_ms: Option<u64>,
}

impl OutlierView {
    /// The view of `state` at `now`.
    pub fn of(state: &OutlierState, now: Instant) -> Self {
        let ejection = state.ejection();
        Self {
            ejected: ejection.is_some(),
            reason: ejection.map(|e| e.reason.as_str()),
            consecutive_failures: state.consecutive_failures(),
            ejections: state.ejections_in_a_row(),
            readmit_in_ms: ejection.map(|e| {
                u64::try_from(e.until.saturating_duration_since(now).as_millis())
                    .unwrap_or(u64::MAX)
            }),
        }
    }

    fn json(&self) -> Value {
        json!({
            "ejected": self.ejected,
            "reason": self.reason,
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.ejections,
            "readmit_in_ms": self.readmit_in_ms,
        })
    }
}

fn status_name(status: i32) -> &'static str {
    match pb::ProviderStatus::try_from(status) {
        Ok(pb::ProviderStatus::Available) => "available",
        Ok(pb::ProviderStatus::Unavailable) => "unavailable",
        Ok(pb::ProviderStatus::Disabled) => "disabled",
        _ => "unspecified",
    }
}

fn health_name(health: i32) -> &'static str {
    match pb::ProviderHealth::try_from(health) {
        Ok(pb::ProviderHealth::Available) => "available",
        Ok(pb::ProviderHealth::Unavailable) => "unavailable",
        Ok(pb::ProviderHealth::Unknown) => "unknown",
        Ok(pb::ProviderHealth::Offline) => "offline",
        _ => "unspecified",
    }
}

fn category_name(category: i32) -> &'static str {
    match pb::ProviderCategory::try_from(category) {
        Ok(pb::ProviderCategory::Api) => "api",
        Ok(pb::ProviderCategory::LocalInference) => "local_inference",
        _ => "unspecified",
    }
}

/// What `/status` shows, read from `Control` at one instant: every
/// provider (snapshot, passive health, drains; by position, in
/// [`Control::snapshots`] order) and every node.
#[derive(Debug, Clone)]
pub struct Fleet {
    /// The provider snapshots.
    pub snapshots: Vec<pb::ProviderSnapshot>,
    /// Their passive-health state.
    pub outliers: Vec<OutlierView>,
    /// Their drains and removal.
    pub providers: Vec<ProviderView>,
    /// Every node.
    pub nodes: Vec<NodeView>,
    /// Every model: its routing policy and what the policy did.
    pub models: Vec<ModelView>,
}

impl Fleet {
    /// Reads it from `control` at `now`.
    pub fn read(control: &Control, now: Instant) -> Self {
        Self {
            snapshots: control.snapshots(),
            outliers: control
                .outliers()
                .into_iter()
                .map(|o| OutlierView::of(o, now))
                .collect(),
            providers: control.provider_views(),
            nodes: control.node_views(),
            models: control.model_views(),
        }
    }

    /// Keeps the providers whose `visible` is true (by position, as
    /// [`Control::serves_any`] answers), the nodes of those, and the models
    /// `may_use` allows.
    pub fn retain(&mut self, visible: &[bool], may_use: impl Fn(&str) -> bool) {
        self.models.retain(|m| may_use(&m.model));
        fn keep<T>(items: &mut Vec<T>, visible: &[bool]) {
            let mut flags = visible.iter().copied();
            items.retain(|_| flags.next().unwrap_or(false));
        }
        keep(&mut self.snapshots, visible);
        keep(&mut self.outliers, visible);
        keep(&mut self.providers, visible);
        let nodes: BTreeSet<&str> = self.providers.iter().map(|p| p.node_id.as_str()).collect();
        self.nodes.retain(|n| nodes.contains(n.node_id.as_str()));
    }

    /// The `/status` document.
    pub fn json(&self) -> Value {
        let mut doc = status_json(&self.snapshots, &self.outliers, &self.providers);
        doc["nodes"] = self.nodes.iter().map(node_json).collect();
        doc["models"] = self.models.iter().map(model_json).collect();
        doc
    }
}

/// A model's `/status` entry: its queue, and its routing policy with what
/// it decided (dispatches by route) and its prefix tree's size.
pub fn model_json(m: &ModelView) -> Value {
    json!({
        "model": m.model,
        "queued": m.queued,
        "max_queue": m.max_queue,
        "routing": routing_json(m),
    })
}

/// A model's routing policy and what it decided (`/status`, `/ui`).
pub fn routing_json(m: &ModelView) -> Value {
    let s = &m.routing_stats;
    json!({
        "policy": m.routing.as_str(),
        "routed_by_load": s.by_load,
        "routed_by_match": s.by_match,
        "routed_by_session": s.by_session,
        "imbalance_fallbacks": s.imbalance_fallbacks,
        "affinity_waits": s.affinity_waits,
        "affinity_waits_expired": s.affinity_waits_expired,
        "tree_bytes": m.tree_bytes,
        "tree_budget_bytes": m.tree_budget_bytes,
    })
}

/// A node's `/status` entry: its phase and whether it takes new work.
pub fn node_json(n: &NodeView) -> Value {
    json!({
        "node_id": n.node_id,
        "phase": phase_name(n.phase),
        "drained": n.drained,
        "draining": n.draining,
        "removed": n.removed,
    })
}

/// A node phase's name in `/status` and the status page.
pub fn phase_name(phase: NodePhase) -> &'static str {
    match phase {
        NodePhase::Offline => "offline",
        NodePhase::Registered => "registered",
        NodePhase::Ready => "ready",
    }
}

/// One provider snapshot as JSON, with its passive-health state and its
/// drains (`drained`: the provider itself by an operator; `node_drained`:
/// its node by an operator; `draining`: its node's owner said it drains;
/// `removed`: a reload removed it, its leases run out).
pub fn snapshot_json(
    s: &pb::ProviderSnapshot,
    outlier: &OutlierView,
    drains: Option<&ProviderView>,
) -> Value {
    let flag = |f: fn(&ProviderView) -> bool| drains.is_some_and(f);
    json!({
        "node_id": s.node_id,
        "provider_id": s.provider_id,
        "adapter": s.adapter,
        "target": s.target,
        "category": category_name(s.category),
        "status": status_name(s.status),
        "health": health_name(s.health),
        "capacity": s.capacity,
        "long_context_capacity": s.long_context_capacity,
        "in_flight": s.in_flight,
        "long_in_flight": s.long_in_flight,
        "queued": s.queued,
        "long_queued": s.long_queued,
        "connected": s.connected,
        "outlier": outlier.json(),
        "drained": flag(|p| p.drained),
        "node_drained": flag(|p| p.node_drained),
        "draining": flag(|p| p.draining),
        "removed": flag(|p| p.removed),
    })
}

/// The providers of `/status`: `outliers` and `drains` pair with
/// `snapshots` by position.
pub fn status_json(
    snapshots: &[pb::ProviderSnapshot],
    outliers: &[OutlierView],
    drains: &[ProviderView],
) -> Value {
    json!({
        "providers": snapshots
            .iter()
            .enumerate()
            .map(|(i, s)| snapshot_json(
                s,
                &outliers.get(i).copied().unwrap_or_default(),
                drains.get(i),
            ))
            .collect::<Vec<_>>(),
    })
}

/// The `cluster` member of `/status`: this Edge, whether it holds its etcd
/// lease, the fleet revision in force, the Edges announced, and every owned node of the cluster with
/// its owning Edge (as this Edge's watch sees them; never a generation,
/// R5), and the capacity summaries: this Edge's and its peers' with their
/// age at `now`.
pub fn cluster_json(cluster: &crate::plane::cluster::ClusterView, now: Instant) -> Value {
    let models = |summary: &crate::plane::cluster::CapacitySummary| {
        summary
            .iter()
            .map(|(model, c)| {
                let free: serde_json::Map<String, Value> = crate::control::Operation::ALL
                    .iter()
                    .map(|&op| (op.name().to_string(), json!(c.free_for(op))))
                    .collect();
                (
                    model.clone(),
                    json!({ "free_slots": free, "queued": c.queued }),
                )
            })
            .collect::<serde_json::Map<String, Value>>()
    };
    let peers: serde_json::Map<String, Value> = cluster
        .peer_capacities(now)
        .into_iter()
        .map(|(edge, (age, summary))| {
            let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            (
                edge,
                json!({ "age_ms": age_ms, "models": models(&summary) }),
            )
        })
        .collect();
    let fleet = cluster.fleet();
    json!({
        "name": cluster.name,
        "edge": cluster.edge_name,
        "up": cluster.is_up(),
        // The cluster's fleet as this Edge runs it: the fleet revision in
        // force (0: its own file's, not seen in etcd yet), the newest seen,
        // and the newest it refused while that is newer than the one in
        // force.
        "fleet": {
            "revision": fleet.revision,
            "digest": fleet.digest,
            "source": fleet.source,
            "latest_revision": fleet.latest_revision,
            "file_differs": fleet.file_differs,
            "refused": fleet.refused.map(|r| json!({ "revision": r.revision, "reason": r.reason })),
        },
        "edges": cluster.edges().into_keys().collect::<Vec<_>>(),
        "nodes": cluster
            .owners()
            .into_iter()
            .map(|(node, owner)| json!({ "node_id": node, "edge": owner.edge }))
            .collect::<Vec<_>>(),
        // What each Edge has free per model: this one's own summary, and
        // each peer's as last polled (`age_ms` ago; older than the
        // summaries' limit counts as nothing free).
        "capacity": {
            "here": models(&cluster.local_capacity()),
            "peers": peers,
        },
    })
}

/// The `logs` member of `/status` (for keys that see everything) and of
/// the status page's events: where the access log and the usage file
/// write, whether they fail and why (`usage_log` is null without a usage
/// file). `failing` is what `iop_edge_access_log_failing` and
/// `iop_edge_usage_log_failing` say.
pub fn logs_json(access: &AccessStatus, usage: Option<&UsageStatus>) -> Value {
    json!({
        "access_log": {
            "destination": destination_name(&access.destination),
            "failing": access.is_failing(),
            "open_error": access.open_error,
            "write_error": access.write_error,
            "open_errors_total": access.open_errors,
            "write_errors_total": access.write_errors,
            "dropped_lines_total": access.dropped_lines,
        },
        "usage_log": usage.map(|u| json!({
            "path": u.path.display().to_string(),
            "failing": u.is_failing(),
            "open_error": u.open_error,
            "write_error": u.write_error,
            "open_errors_total": u.open_errors,
            "write_errors_total": u.write_errors,
            "dropped_records_total": u.dropped_records,
        })),
    })
}

/// The `budgets` member of `/status` (for keys that see everything):
/// per principal with a budget, each period's `used`, `limit` (this
/// Edge's share in a cluster) and `resets_at` (RFC 3339 UTC, and as Unix
/// ms); and the budget file's `appended` and `durable` record counts
/// (usage shown is on disk once they are equal).
pub fn budgets_json(budgets: &BudgetsStatus) -> Value {
    let period = |p: &Option<PeriodView>| {
        p.map(|p| {
            json!({
                "used": p.used,
                "limit": p.limit,
                "resets_at": rfc3339_utc(p.resets_at_unix_ms),
                "resets_at_unix_ms": p.resets_at_unix_ms,
            })
        })
    };
    let keys: serde_json::Map<String, Value> = budgets
        .principals
        .iter()
        .map(|b| {
            (
                b.principal.to_string(),
                json!({ "day": period(&b.day), "month": period(&b.month) }),
            )
        })
        .collect();
    json!({
        "now_unix_ms": budgets.now_unix_ms,
        "keys": keys,
        "file": budgets.file.as_ref().map(|f| json!({
            "path": f.path.display().to_string(),
            "appended": f.appended,
            "durable": f.durable,
            "dropped_records_total": f.dropped,
            "write_errors_total": f.write_errors,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_budgets() {
        let status = BudgetsStatus {
            now_unix_ms: 1_796_644_800_000,
            principals: vec![crate::plane::budgets::BudgetView {
                principal: "team-a".into(),
                day: Some(PeriodView {
                    used: 1034,
                    limit: 1000,
                    resets_at_unix_ms: 1_796_688_000_000,
                }),
                month: None,
            }],
            file: Some(crate::plane::budget_file::BudgetFileStatus {
                path: "/var/lib/iop/budgets.log".into(),
                appended: 3,
                durable: 2,
                dropped: 0,
                write_errors: 0,
            }),
        };
        assert_eq!(
            budgets_json(&status),
            json!({
                "now_unix_ms": 1_796_644_800_000_i64,
                "keys": {"team-a": {
                    "day": {"used": 1034, "limit": 1000,
                            "resets_at": "2026-12-08T00:00:00Z",
                            "resets_at_unix_ms": 1_796_688_000_000_i64},
                    "month": null,
                }},
                "file": {"path": "/var/lib/iop/budgets.log", "appended": 3, "durable": 2,
                         "dropped_records_total": 0, "write_errors_total": 0},
            })
        );
    }

    #[test]
    fn renders_the_logs() {
        let access = AccessStatus {
            destination: crate::config::Destination::File("/var/log/iop/access.log".into()),
            open_error: None,
            write_error: Some("No space left on device (os error 28)".into()),
            write_errors: 3,
            open_errors: 0,
            dropped_lines: 7,
        };
        let usage = UsageStatus {
            path: "/var/log/iop/usage.jsonl".into(),
            open_error: Some(
                "cannot open /var/log/iop/usage.jsonl for appending: Is a directory (os error 21)"
                    .into(),
            ),
            write_error: None,
            write_errors: 0,
            open_errors: 1,
            dropped_records: 0,
        };
        assert_eq!(
            logs_json(&access, Some(&usage)),
            json!({
                "access_log": {
                    "destination": "/var/log/iop/access.log", "failing": true,
                    "open_error": null,
                    "write_error": "No space left on device (os error 28)",
                    "open_errors_total": 0, "write_errors_total": 3, "dropped_lines_total": 7,
                },
                "usage_log": {
                    "path": "/var/log/iop/usage.jsonl", "failing": true,
                    "open_error": "cannot open /var/log/iop/usage.jsonl for appending: \
                                   Is a directory (os error 21)",
                    "write_error": null,
                    "open_errors_total": 1, "write_errors_total": 0, "dropped_records_total": 0,
                },
            })
        );
        let healthy = AccessStatus {
            destination: crate::config::Destination::Stderr,
            write_error: None,
            ..access
        };
        assert_eq!(
            logs_json(&healthy, None),
            json!({
                "access_log": {
                    "destination": "stderr", "failing": false, "open_error": null,
                    "write_error": null, "open_errors_total": 0, "write_errors_total": 3,
                    "dropped_lines_total": 7,
                },
                "usage_log": null,
            })
        );
    }

    // CONTRACT: P3 — an offline provider projects unavailable/offline with
    // zeroed figures; names are readable strings.
    #[test]
    fn renders_snapshot_fields() {
        let s = pb::ProviderSnapshot {
            node_id: "n".into(),
            provider_id: "p".into(),
            adapter: "a".into(),
            target: "t".into(),
            category: pb::ProviderCategory::LocalInference as i32,
            status: pb::ProviderStatus::Unavailable as i32,
            health: pb::ProviderHealth::Offline as i32,
            connected: false,
            ..Default::default()
        };
        assert_eq!(
            snapshot_json(&s, &OutlierView::default(), None),
            json!({
                "node_id": "n", "provider_id": "p", "adapter": "a", "target": "t",
                "category": "local_inference", "status": "unavailable", "health": "offline",
                "capacity": 0, "long_context_capacity": 0, "in_flight": 0, "long_in_flight": 0,
                "queued": 0, "long_queued": 0, "connected": false,
                "outlier": {"ejected": false, "reason": null, "consecutive_failures": 0,
                            "ejections": 0, "readmit_in_ms": null},
                "drained": false, "node_drained": false, "draining": false, "removed": false
            })
        );
        let ejected = OutlierView {
            ejected: true,
            reason: Some("connect_failure"),
            consecutive_failures: 5,
            ejections: 2,
            readmit_in_ms: Some(1500),
        };
        let drains = ProviderView {
            node_id: "n".into(),
            provider_id: "p".into(),
            drained: true,
            node_drained: false,
            draining: true,
            removed: false,
        };
        let doc = status_json(&[s], &[ejected], &[drains]);
        assert_eq!(
            doc["providers"][0]["outlier"],
            json!({"ejected": true, "reason": "connect_failure", "consecutive_failures": 5,
                   "ejections": 2, "readmit_in_ms": 1500})
        );
        assert_eq!(
            [
                &doc["providers"][0]["drained"],
                &doc["providers"][0]["node_drained"],
                &doc["providers"][0]["draining"],
                &doc["providers"][0]["removed"],
            ],
            [&json!(true), &json!(false), &json!(true), &json!(false)]
        );
    }

    fn node(id: &str, drained: bool) -> NodeView {
        NodeView {
            node_id: id.into(),
            phase: NodePhase::Ready,
            version: "0.1.0".into(),
            registered_at: None,
            ready_at: None,
            offline_since: None,
            drained,
            draining: false,
            removed: !drained,
        }
    }

    fn provider(node_id: &str, provider_id: &str) -> ProviderView {
        ProviderView {
            node_id: node_id.into(),
            provider_id: provider_id.into(),
            drained: false,
            node_drained: false,
            draining: false,
            removed: false,
        }
    }

    // A key that sees some providers sees their nodes only; the node
    // entries carry no generation, version or time (X5).
    #[test]
    fn a_limited_view_keeps_the_visible_providers_and_their_nodes() {
        let snapshot = |n: &str, p: &str| pb::ProviderSnapshot {
            node_id: n.into(),
            provider_id: p.into(),
            ..Default::default()
        };
        let mut fleet = Fleet {
            snapshots: vec![snapshot("a", "1"), snapshot("a", "2"), snapshot("b", "1")],
            outliers: vec![OutlierView::default(); 3],
            providers: vec![provider("a", "1"), provider("a", "2"), provider("b", "1")],
            nodes: vec![node("a", true), node("b", false)],
            models: ["seen", "hidden"].map(model).to_vec(),
        };
        fleet.retain(&[false, true, false], |m| m == "seen");
        let doc = fleet.json();
        let ids: Vec<(&Value, &Value)> = doc["providers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (&p["node_id"], &p["provider_id"]))
            .collect();
        assert_eq!(ids, [(&json!("a"), &json!("2"))]);
        assert_eq!(
            doc["nodes"],
            json!([{"node_id": "a", "phase": "ready", "drained": true, "draining": false,
                    "removed": false}])
        );
        assert_eq!(fleet.outliers.len(), 1);
        // The models it may use, with their routing.
        assert_eq!(
            doc["models"],
            json!([{"model": "seen", "queued": 1, "max_queue": 8, "routing": {
                "policy": "prefix", "routed_by_load": 3, "routed_by_match": 5,
                "routed_by_session": 0, "imbalance_fallbacks": 1, "affinity_waits": 0,
                "affinity_waits_expired": 0, "tree_bytes": 2048, "tree_budget_bytes": 65536}}])
        );
    }

    fn model(name: &str) -> ModelView {
        ModelView {
            model: name.into(),
            providers: 2,
            candidates: 1,
            queued: 1,
            max_queue: 8,
            routing: crate::control::RoutingPolicy::Prefix,
            routing_stats: crate::control::RoutingStats {
                by_load: 3,
                by_match: 5,
                imbalance_fallbacks: 1,
                ..Default::default()
            },
            tree_bytes: 2048,
            tree_budget_bytes: 65536,
        }
    }
}
