//! `edge.toml` as written: private serde mirrors of the file (unknown keys
//! rejected, key paths kept), turned into the checked types by
//! [`super::validate`].

use iop_engine::config::RawTls;
use serde::{Deserialize, Deserializer};

/// Runs the serde mirror of `edge.toml` on `deserializer` and drops what it
/// built. Not an API: the configuration reference's test walks the file
/// format with it (every key `docs/configuration.md` must document).
#[doc(hidden)]
pub fn deserialize_file_format<'de, D: Deserializer<'de>>(deserializer: D) -> Result<(), D::Error> {
    RawEdgeFile::deserialize(deserializer).map(drop)
}

// ---------------------------------------------------------------------------
// The file as written
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEdgeFile {
    pub(super) edge: RawEdge,
    pub(super) tls: Option<RawTls>,
    pub(super) credentials: Option<RawCredentials>,
    #[serde(default)]
    pub(super) client_keys: Vec<RawClientKey>,
    #[serde(default)]
    pub(super) nodes: Vec<RawNode>,
    #[serde(default)]
    pub(super) models: Vec<RawModel>,
    pub(super) outlier_detection: Option<RawOutlierDetection>,
    pub(super) routing: Option<RawRouting>,
    pub(super) cluster: Option<RawCluster>,
    pub(super) tracing: Option<RawTracing>,
}

/// `[tracing]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    pub(super) otlp_endpoint: Option<String>,
    pub(super) sample_ratio: Option<f64>,
    pub(super) service_name: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouting {
    pub(super) prefix_tree_bytes: Option<i64>,
    pub(super) prefix_bytes_max: Option<i64>,
    pub(super) match_threshold_percent: Option<i64>,
    pub(super) balance_abs_threshold: Option<i64>,
    pub(super) balance_rel_threshold_percent: Option<i64>,
    pub(super) affinity_wait_ms: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    pub(super) name: Option<String>,
    pub(super) etcd_endpoints: Vec<String>,
    pub(super) lease_ttl_sec: Option<i64>,
    pub(super) keepalive_interval_sec: Option<i64>,
    pub(super) etcd_timeout_ms: Option<i64>,
    pub(super) peer_listen: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOutlierDetection {
    pub(super) enabled: Option<bool>,
    pub(super) consecutive_failures: Option<i64>,
    pub(super) base_ejection_time_ms: Option<i64>,
    pub(super) max_ejection_time_ms: Option<i64>,
    pub(super) max_ejection_percent: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEdge {
    pub(super) name: String,
    pub(super) trust_domain: String,
    pub(super) client_listen: String,
    pub(super) node_listen: String,
    pub(super) max_request_body_bytes: Option<i64>,
    pub(super) max_upload_body_bytes: Option<i64>,
    pub(super) max_frame_bytes: Option<i64>,
    #[serde(default)]
    pub(super) insecure_plaintext_nodes: bool,
    #[serde(default)]
    pub(super) allow_anonymous: bool,
    pub(super) metrics_access: Option<String>,
    pub(super) node_metrics_max_age_ms: Option<i64>,
    pub(super) drain_grace_ms: Option<i64>,
    pub(super) flow_window_bytes: Option<i64>,
    pub(super) client_write_stall_timeout_ms: Option<i64>,
    pub(super) response_wait_timeout_ms: Option<i64>,
    pub(super) client_head_timeout_ms: Option<i64>,
    pub(super) client_body_idle_timeout_ms: Option<i64>,
    pub(super) client_body_grace_ms: Option<i64>,
    pub(super) client_body_min_rate_bytes_per_sec: Option<i64>,
    pub(super) client_keep_alive_timeout_ms: Option<i64>,
    pub(super) max_client_connections: Option<i64>,
    pub(super) max_client_connections_per_peer: Option<i64>,
    pub(super) client_linger_time_ms: Option<i64>,
    pub(super) client_linger_idle_timeout_ms: Option<i64>,
    pub(super) client_linger_max_bytes: Option<i64>,
    pub(super) node_handshake_timeout_ms: Option<i64>,
    pub(super) max_node_handshakes: Option<i64>,
    pub(super) max_node_handshakes_per_peer: Option<i64>,
    pub(super) node_first_byte_timeout_ms: Option<i64>,
    pub(super) max_json_depth: Option<i64>,
    pub(super) max_json_elements: Option<i64>,
    pub(super) max_json_members: Option<i64>,
    pub(super) client_tls: Option<RawClientTls>,
    pub(super) access_log: Option<RawAccessLog>,
    pub(super) usage_log: Option<RawUsageLog>,
    pub(super) budget_file: Option<String>,
}

/// `[edge.usage_log]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUsageLog {
    pub(super) path: String,
}

/// `[edge.access_log]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAccessLog {
    pub(super) destination: Option<String>,
    pub(super) format: Option<String>,
}

/// `[edge.client_tls]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClientTls {
    pub(super) cert: String,
    pub(super) key: String,
    pub(super) client_ca: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawNode {
    pub(super) id: String,
    pub(super) recipient_key: Option<String>,
    #[serde(default)]
    pub(super) adapters: Vec<RawAdapter>,
    #[serde(default)]
    pub(super) providers: Vec<RawProvider>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCredentials {
    pub(super) issuer_key: String,
    pub(super) lease_ttl_ms: Option<i64>,
    #[serde(default)]
    pub(super) slots: Vec<RawSlot>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSlot {
    pub(super) name: String,
    pub(super) secret_file: Option<String>,
    pub(super) secret_env: Option<String>,
    pub(super) header: Option<String>,
    pub(super) format: Option<String>,
    pub(super) revision: Option<i64>,
    #[serde(default)]
    pub(super) revoked_revisions: Vec<i64>,
    pub(super) enabled: Option<bool>,
    pub(super) providers: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClientKey {
    pub(super) principal: String,
    pub(super) key_hash: String,
    #[serde(default)]
    pub(super) scopes: Vec<String>,
    pub(super) max_concurrent: Option<u32>,
    pub(super) requests_per_minute: Option<u32>,
    pub(super) tokens_per_minute: Option<u32>,
    pub(super) tokens_per_day: Option<u64>,
    pub(super) tokens_per_month: Option<u64>,
    pub(super) models: Option<Vec<String>>,
    pub(super) priority: Option<RawPriority>,
    pub(super) weight: Option<i64>,
}

/// `priority = "interactive"` or `priority = 70`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawPriority {
    Name(String),
    Number(i64),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdapter {
    pub(super) name: Option<String>,
    pub(super) kind: String,
    pub(super) profile: Option<String>,
    pub(super) base_url: String,
    pub(super) ca_file: Option<String>,
    pub(super) tls_insecure_skip_verify: Option<bool>,
    pub(super) capacity: Option<i64>,
    pub(super) health_path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProvider {
    pub(super) id: String,
    pub(super) adapter: String,
    pub(super) target: String,
    pub(super) capacity: i64,
    pub(super) long_context_capacity: Option<i64>,
    pub(super) response_stall_timeout_ms: Option<i64>,
    pub(super) category: Option<String>,
    pub(super) enabled: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    pub(super) name: String,
    pub(super) providers: Vec<String>,
    pub(super) long_context_threshold_tokens: Option<i64>,
    pub(super) max_queue: Option<i64>,
    pub(super) queue_timeout_ms: Option<i64>,
    pub(super) max_attempts: Option<i64>,
    pub(super) owned_by: Option<String>,
    pub(super) allow_no_providers: Option<bool>,
    pub(super) routing: Option<String>,
}
