//! The static settings every shard's shells read ([`Settings`]), built
//! from the validated `edge.toml`.

use std::rc::Rc;
use std::sync::Arc;

use iop_engine::tls::HttpsAcceptor;

use crate::config::{EdgeConfig, ListenerLimits};
use crate::plane::access::AccessLog;
use crate::plane::client_keys::ClientKeys;
use crate::plane::credentials::RunningPlane;
use crate::plane::request_metrics::RequestMetrics;
use crate::plane::running::{Running, RunningConfig};
use crate::plane::usage::UsageLog;

/// Static settings the shells need.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The running configuration the shards read per request: the served
    /// models and the `[edge]` limits a reload may change (see
    /// [`RunningConfig`]); a reload replaces it on every shard.
    pub running: RunningConfig,
    /// Process start, Unix seconds (the `created` of listed models).
    pub started_unix_sec: i64,
    /// The HTTPS certificate of the client listener (`[edge.client_tls]`),
    /// shared by every shard and replaced on SIGHUP; `None`: plain HTTP.
    pub client_tls: Option<HttpsAcceptor>,
    /// Client API keys (401 without one when configured).
    pub client_keys: ClientKeys,
    /// The credential plane in force, shared by every shard and replaced
    /// for all of them by a reload; `None` = disabled (tunnels carry no
    /// lease; only a restart turns it on).
    pub credentials: Option<RunningPlane>,
    /// The front door's deadlines, caps and bounds (`[edge]`) as the
    /// process started: the accept loops' caps and the node handshake
    /// deadlines are read from here once; the client ones follow reloads
    /// ([`RunningConfig`]'s `limits`).
    pub limits: ListenerLimits,
    /// What one peer address holds of each listener, shared by every
    /// shard.
    pub peer_limits: crate::plane::limits::PeerLimits,
    /// The access log (`[edge.access_log]`; one writer for every shard).
    pub access_log: AccessLog,
    /// The process's usage file (`[edge.usage_log]`), shared by the shards.
    pub usage_log: crate::plane::usage::UsageLog,
    /// The per-request series of `/metrics`, shared by every shard.
    pub request_metrics: Arc<crate::plane::request_metrics::RequestMetrics>,
    /// This Edge's place in its cluster, shared by every shard; `None`: a
    /// single Edge.
    pub cluster: Option<Arc<crate::plane::cluster::ClusterView>>,
    /// The node names the node listener accepts (its TLS acceptor's list,
    /// shared): a reload replaces it with the configured nodes. `None` in
    /// insecure mode.
    pub node_allow_list: Option<iop_engine::tls::NodeAllowList>,
    /// How this Edge dials the peer listeners of other Edges (its `[tls]`
    /// identity, presented as a client certificate); `None`: it forwards
    /// nothing (no `[cluster]`, or no `[tls]`).
    pub peer_tls: Option<iop_engine::tls::NodeTlsConnector>,
    /// This shard's tracer (`[tracing]`): its sampler, ids and the
    /// process's exporter; `None` while tracing is off (no request builds
    /// a span).
    pub tracer: Option<Rc<iop_engine::trace::Tracer>>,
}

/// The usage file `cfg` names, started (its writer thread runs until
/// [`UsageLog::close`]), or off.
pub fn usage_log(cfg: &EdgeConfig) -> UsageLog {
    let Some(path) = &cfg.usage_log else {
        return UsageLog::off();
    };
    UsageLog::start(path).unwrap_or_else(|e| {
        // `EdgeConfig::check_operational_paths` checked the file at startup.
        tracing::error!(path = %path.display(), error = %e, "usage log cannot be started");
        UsageLog::off()
    })
}

/// The access log `cfg` names, started (its writer thread runs until
/// [`AccessLog::close`]), or off.
pub fn access_log(cfg: &EdgeConfig) -> AccessLog {
    AccessLog::start(&cfg.access_log).unwrap_or_else(|e| {
        // `EdgeConfig::check_operational_paths` checked the file at startup.
        tracing::error!(error = %e, "access log cannot be started; no access log");
        AccessLog::off()
    })
}

/// The OTLP exporter `cfg`'s `[tracing]` names, its thread started; `None`
/// when tracing is off (or the thread cannot start: then it is off, and
/// the error logged).
pub fn trace_export(cfg: &EdgeConfig) -> Option<iop_engine::trace::ExportHandle> {
    let spec = cfg.tracing.as_ref()?;
    match iop_engine::trace::start_export(spec, iop_engine::metrics::Side::Edge) {
        Ok(handle) => {
            tracing::info!(
                otlp_endpoint = spec.otlp_endpoint.as_str(),
                sample_ratio = spec.sample_ratio,
                "tracing on"
            );
            Some(handle)
        }
        Err(e) => {
            tracing::error!(error = %e, "the OTLP exporter cannot start; tracing is off");
            None
        }
    }
}

/// The shells' static settings for `cfg` (the usage file and the access
/// log off: each is one per process, see [`usage_log`] and [`access_log`]).
pub fn settings(cfg: &EdgeConfig, credentials: Option<RunningPlane>) -> Settings {
    Settings {
        running: RunningConfig::new(Running::of(cfg, 1, String::new())),
        started_unix_sec: iop_engine::clock::unix_ms() / 1000,
        client_tls: None,
        client_keys: ClientKeys::from_config(&cfg.client_keys),
        credentials,
        limits: cfg.edge.limits,
        peer_limits: crate::plane::limits::PeerLimits::new(&cfg.edge.limits),
        access_log: AccessLog::off(),
        usage_log: UsageLog::off(),
        request_metrics: request_metrics(cfg, 1),
        cluster: cfg.cluster.as_ref().map(|c| {
            Arc::new(crate::plane::cluster::ClusterView::new(
                &c.name,
                &cfg.edge.name,
            ))
        }),
        peer_tls: None,
        node_allow_list: None,
        tracer: None,
    }
}

/// The per-request series of `/metrics` for `cfg`'s models and nodes, with
/// cells for `shards` shards.
pub fn request_metrics(cfg: &EdgeConfig, shards: usize) -> Arc<RequestMetrics> {
    RequestMetrics::new(
        cfg.models.iter().map(|m| m.name.clone()).collect(),
        cfg.nodes.iter().map(|n| n.id.clone()).collect(),
        shards,
    )
}
