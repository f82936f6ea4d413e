//! The running configuration every shard reads per request
//! ([`RunningConfig`]): the served models (`/v1/models`, long-context
//! thresholds, queue timeouts, the nodes behind each model), the `[edge]`
//! limits a reload may change, and the file's revision and digest
//! (`GET /admin/config`). A reload swaps the whole of it at once; a
//! request reads one consistent [`Running`] ([`RunningConfig::get`]).
//!
//! Control's own view of the fleet changes with it, through
//! `Input::Reconfigure` on the control shard.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use crate::api::openai::ModelEntry;
use crate::config::{EdgeConfig, ListenerLimits, MetricsAccess};
use crate::control::RoutingPolicy;

/// One configuration as the shards read it.
#[derive(Debug, Clone)]
pub struct Running {
    /// Its reload revision: 1 at start, one more for every reload that
    /// applied.
    pub revision: u64,
    /// BLAKE3 of the file's bytes, hex (empty when built without a file).
    pub digest: String,
    /// The validated configuration (secrets never leave it: `/admin/config`
    /// redacts); `None` for the bare settings of a test.
    pub config: Option<Arc<EdgeConfig>>,
    /// Models for `GET /v1/models`, in config order.
    pub models: Vec<ModelEntry>,
    /// Long-context threshold per model, in estimated prompt tokens.
    pub long_context_threshold_tokens: HashMap<String, u64>,
    /// Each model's routing policy (a request reads the hint its policy
    /// uses; none for `least_loaded`).
    pub model_routing: HashMap<String, RoutingPolicy>,
    /// `routing.prefix_bytes_max`: how much of a prompt a `prefix` model's
    /// request carries to Control.
    pub prefix_bytes_max: usize,
    /// The node ids of each model's providers (each once, in config
    /// order): where a cluster member looks for the model's owners.
    pub model_nodes: HashMap<String, Vec<String>>,
    /// Each model's queue timeout: in a cluster, also the longest a
    /// request waits for an Edge to own one of its nodes.
    pub model_queue_timeouts: HashMap<String, Duration>,
    /// Largest client request body (413 above); read when a client
    /// connection opens.
    pub max_request_body_bytes: usize,
    /// Largest upload (413 above); read per request.
    pub max_upload_body_bytes: u64,
    /// Each run's flow-control window on its node connection (charged
    /// bytes); read at each dispatch.
    pub flow_window_bytes: u64,
    /// A client socket that takes no bytes of a response for this long is
    /// cut off; read when a client connection opens.
    pub client_write_stall_timeout: Duration,
    /// The client connections' deadlines, lingering close and JSON bounds,
    /// read per connection and request (the accept loops' caps and the
    /// node handshake deadlines are read once at startup: `Settings`).
    pub limits: ListenerLimits,
    /// Who may read `/metrics` (`edge.metrics_access`), per request.
    pub metrics_access: MetricsAccess,
    /// How long one pull of the nodes' `/metrics` series serves later
    /// scrapes (`edge.node_metrics_max_age_ms`), per scrape.
    pub node_metrics_max_age: Duration,
}

impl Running {
    /// Settings without a configuration file: no model, the given
    /// limits (in-process tests of the shells).
    pub fn bare(
        max_request_body_bytes: usize,
        flow_window_bytes: u64,
        client_write_stall_timeout: Duration,
    ) -> Self {
        Self {
            revision: 1,
            digest: String::new(),
            config: None,
            models: Vec::new(),
            long_context_threshold_tokens: HashMap::new(),
            model_routing: HashMap::new(),
            prefix_bytes_max: 0,
            model_nodes: HashMap::new(),
            model_queue_timeouts: HashMap::new(),
            max_request_body_bytes,
            max_upload_body_bytes: crate::config::DEFAULT_MAX_UPLOAD_BODY_BYTES,
            flow_window_bytes,
            client_write_stall_timeout,
            limits: ListenerLimits::default(),
            metrics_access: MetricsAccess::Open,
            node_metrics_max_age: Duration::from_millis(
                crate::config::DEFAULT_NODE_METRICS_MAX_AGE_MS,
            ),
        }
    }

    /// What the shards read of `cfg`, at `revision`; `digest` names the
    /// file's bytes.
    pub fn of(cfg: &EdgeConfig, revision: u64, digest: String) -> Self {
        Self {
            revision,
            digest,
            config: Some(Arc::new(cfg.clone())),
            models: cfg
                .models
                .iter()
                .map(|m| ModelEntry {
                    id: m.name.clone(),
                    owned_by: m.owned_by.clone(),
                })
                .collect(),
            long_context_threshold_tokens: cfg
                .models
                .iter()
                .filter_map(|m| m.long_context_threshold_tokens.map(|t| (m.name.clone(), t)))
                .collect(),
            model_routing: cfg
                .models
                .iter()
                .map(|m| (m.name.clone(), m.routing))
                .collect(),
            prefix_bytes_max: usize::try_from(cfg.routing.prefix_bytes_max).unwrap_or(usize::MAX),
            model_nodes: cfg
                .models
                .iter()
                .map(|m| {
                    let mut nodes: Vec<String> = Vec::new();
                    for provider in &m.providers {
                        if !nodes.contains(&provider.node_id) {
                            nodes.push(provider.node_id.clone());
                        }
                    }
                    (m.name.clone(), nodes)
                })
                .collect(),
            model_queue_timeouts: cfg
                .models
                .iter()
                .map(|m| (m.name.clone(), Duration::from_millis(m.queue_timeout_ms)))
                .collect(),
            max_request_body_bytes: cfg.edge.max_request_body_bytes,
            max_upload_body_bytes: cfg.edge.max_upload_body_bytes,
            flow_window_bytes: cfg.edge.flow_window_bytes,
            client_write_stall_timeout: Duration::from_millis(
                cfg.edge.client_write_stall_timeout_ms,
            ),
            limits: cfg.edge.limits,
            metrics_access: cfg.edge.metrics_access,
            node_metrics_max_age: Duration::from_millis(cfg.edge.node_metrics_max_age_ms),
        }
    }
}

/// The running configuration, shared by every shard (clones share it).
#[derive(Debug, Clone)]
pub struct RunningConfig {
    current: Arc<RwLock<Arc<Running>>>,
}

impl RunningConfig {
    /// Starts at `running`.
    pub fn new(running: Running) -> Self {
        Self {
            current: Arc::new(RwLock::new(Arc::new(running))),
        }
    }

    /// The configuration in force now (a request keeps the one it read).
    pub fn get(&self) -> Arc<Running> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `next` in force on every shard.
    pub fn replace(&self, next: Running) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(next);
    }
}

/// BLAKE3 of `bytes`, hex: a configuration file's digest.
pub fn digest_of(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replacement_is_seen_by_every_clone_and_a_reader_keeps_its_own() {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/edge.toml");
        let cfg = EdgeConfig::parse(&std::fs::read_to_string(example).unwrap(), example).unwrap();
        let running = RunningConfig::new(Running::of(&cfg, 1, "a".into()));
        let other_shard = running.clone();
        let held = running.get();
        let mut next = cfg.clone();
        next.edge.max_request_body_bytes = 77;
        running.replace(Running::of(&next, 2, "b".into()));
        let now = other_shard.get();
        assert_eq!((now.revision, now.digest.as_str()), (2, "b"));
        assert_eq!(now.max_request_body_bytes, 77);
        assert_eq!((held.revision, held.digest.as_str()), (1, "a"));
        assert_eq!(held.max_request_body_bytes, cfg.edge.max_request_body_bytes);
    }

    #[test]
    fn the_digest_is_blake3_of_the_bytes() {
        assert_eq!(
            digest_of(b""),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }
}
