//! JSON projections for `GET /status` (P1–P3). Addresses, tokens and
//! transport internals are never included (X5).

use iop_wire::pb;
use serde_json::{json, Value};

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

/// One provider snapshot as JSON.
pub fn snapshot_json(s: &pb::ProviderSnapshot) -> Value {
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
    })
}

/// The `/status` document.
pub fn status_json(snapshots: &[pb::ProviderSnapshot]) -> Value {
    json!({
        "providers": snapshots.iter().map(snapshot_json).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
            snapshot_json(&s),
            json!({
                "node_id": "n", "provider_id": "p", "adapter": "a", "target": "t",
                "category": "local_inference", "status": "unavailable", "health": "offline",
                "capacity": 0, "long_context_capacity": 0, "in_flight": 0, "long_in_flight": 0,
                "queued": 0, "long_queued": 0, "connected": false
            })
        );
    }
}
