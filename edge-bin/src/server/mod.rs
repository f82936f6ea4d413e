//! Wiring: config → [`Control`] spec, listeners, accept loops. Shared by the
//! binary and the in-process integration tests.

pub mod front_door;

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iop_engine::tls::{EdgeTlsAcceptor, HttpsAcceptor, NodeTlsConnector, TlsMaterial};
use iop_wire::pb;
use monoio::net::TcpListener;

use crate::config::{ConfigDiff, EdgeConfig};
use crate::control::{control_spec, Control, Input};
use crate::link::edge::{Edge, CONTROL_SHARD};
use crate::link::settings::{access_log, request_metrics, settings, trace_export, usage_log};
use crate::link::shards::{Lifecycle, MeshPort, Outbox};
use crate::plane::access::AccessLog;
use crate::plane::budgets;
use crate::plane::client_keys::{ClientKeys, KeysChange};
use crate::plane::credentials::{CredentialPlane, CredentialsChange, RunningPlane};
use crate::plane::request_metrics::RequestMetrics;
use crate::plane::running::{digest_of, Running, RunningConfig};
use crate::plane::usage::UsageLog;

/// What a configuration reload did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReloadReport {
    /// The revision now in force.
    pub revision: u64,
    /// Nodes whose new config was pushed as a refresh to their ready owner.
    pub refreshed: Vec<String>,
    /// Nodes whose config changed but that are not dispatch-ready: they get
    /// it at their next registration (K3, X6). A pending owner (registered,
    /// not ready) is never sent a refresh.
    pub deferred: Vec<String>,
    /// Nodes whose refresh could not be sent: their ready owner's
    /// connection was gone by then. Not refreshed; they get the new config
    /// at their next registration.
    pub unsent: Vec<String>,
    /// Nodes added to the fleet (they may register at once).
    pub nodes_added: Vec<String>,
    /// Nodes removed from the fleet (closed when what they run ends).
    pub nodes_removed: Vec<String>,
    /// Models added, and removed.
    pub models_added: Vec<String>,
    /// Models removed (their queued requests end with 503).
    pub models_removed: Vec<String>,
    /// Sections whose changes need a restart and were not applied.
    pub restart_required: Vec<&'static str>,
    /// Models and nodes added by reloads past the metrics' room for them
    /// (`RELOAD_HEADROOM`): counted as model `other`, and without scrape
    /// error series, until a restart.
    pub unmetered: Vec<String>,
    /// What the new `[[client_keys]]` changed (applied at once).
    pub client_keys: KeysChange,
    /// The Edge's own files (the access log file, the usage file) whose
    /// new path could not be opened: each keeps writing where it did, the
    /// rest of the file was applied. One line each, `<file>: <key>:
    /// <reason>; keeping the running …`.
    pub kept_operational: Vec<String>,
    /// What the new `[credentials]` slots changed (applied at once).
    pub credentials: CredentialsChange,
}

/// Reloads the configuration file (SIGHUP) at `revision`. An invalid file
/// changes nothing and returns its error — except for the files the Edge
/// writes: an access log file or usage file that cannot be opened keeps
/// the running one and is reported in [`ReloadReport::kept_operational`],
/// and the rest of the file applies. Otherwise:
///
/// - The fleet (nodes, providers, models) and the passive-health and
///   response-wait settings go to `Control` as one `Input::Reconfigure`
///   (see `control/fleet.rs`): added nodes may register at once; removed
///   providers and nodes take no new work and are let go of when what
///   runs there ends; a removed model's waiting requests end with 503.
/// - The served models (`/v1/models`, long-context thresholds, queue
///   timeouts) and the `[edge]` limits read per request
///   (`max_request_body_bytes`, `flow_window_bytes`,
///   `client_write_stall_timeout_ms`) change on every shard at once
///   ([`RunningConfig`]).
/// - `[[client_keys]]` replace the running keys on every shard: a removed
///   key gets 401 from its next request on (requests already let in under
///   it run to their end), an added key works at once, scopes follow.
/// - `[credentials]` slots (added, removed, enabled, their revisions and
///   revoked revisions, their providers) and `lease_ttl_ms` apply from the
///   next lease issued on any shard: the next credential plane is built
///   first, reading the secrets of new slots and revisions, and a secret
///   that cannot be read refuses the whole reload
///   ([`crate::plane::credentials::RunningPlane::prepare`]).
/// - Each node's new adapter config replaces the one pushed at
///   registration, and nodes whose config changed get a
///   `NodeConfigRefreshRequest` — only dispatch-ready owners (K3, X6).
/// - The listeners and identity (`[edge]` addresses, name, trust domain),
///   TLS added or removed, `[credentials]` added or removed, another
///   issuer key and `[cluster]` are reported as needing a restart and are
///   not applied (compared with `started`, what the process started with,
///   so the warning repeats while the file differs). Certificates are
///   [`reload_tls`]'s.
/// - The access log file and the usage file are opened again by the paths
///   the file names now (rotation: rename, then SIGHUP; or a new path).
///   Turning either on or off, or another access log `format`, needs a
///   restart.
pub fn reload(
    edge: &Edge,
    started: &EdgeConfig,
    path: &std::path::Path,
    revision: u64,
) -> Result<(EdgeConfig, ReloadReport), crate::config::ConfigError> {
    // The operational paths are not checked here: each log opens its own
    // (below), and one that does not open keeps the running writer.
    let next = EdgeConfig::load_structure(path)?;
    // Removing the last key must not open the Edge to everyone.
    next.check_open_access()?;
    let digest = std::fs::read(path)
        .map(|bytes| digest_of(&bytes))
        .unwrap_or_default();
    apply(edge, started, next, digest, revision)
}

/// Applies `next`, a validated configuration whose source has `digest`, at
/// `revision`: what [`reload`] does once the file is loaded (a cluster
/// applies a fleet published by another Edge the same way). Refused, with
/// nothing applied, when a credential secret or issuer key it must read
/// cannot be read.
pub fn apply(
    edge: &Edge,
    started: &EdgeConfig,
    mut next: EdgeConfig,
    digest: String,
    revision: u64,
) -> Result<(EdgeConfig, ReloadReport), crate::config::ConfigError> {
    let mut report = ReloadReport {
        revision,
        restart_required: restart_required(started, &next),
        ..ReloadReport::default()
    };
    // Before anything applies: the next credential plane, with the secrets
    // of new slots and revisions read (an unreadable one refuses it all).
    let credentials =
        crate::plane::credentials::prepare_reload(edge.settings.credentials.as_ref(), &mut next)?;
    if credentials.as_ref().is_some_and(|c| c.issuer_differs()) {
        report.restart_required.push(
            "[credentials] issuer_key (nodes trust the running issuer's public key; it keeps \
             signing until a restart)",
        );
    }
    let before = edge.settings.running.get();
    if let Some(previous) = &before.config {
        let names =
            |c: &EdgeConfig| -> Vec<String> { c.nodes.iter().map(|n| n.id.clone()).collect() };
        let models =
            |c: &EdgeConfig| -> Vec<String> { c.models.iter().map(|m| m.name.clone()).collect() };
        let (old_nodes, new_nodes) = (names(previous), names(&next));
        let (old_models, new_models) = (models(previous), models(&next));
        report.nodes_added = new_nodes
            .iter()
            .filter(|n| !old_nodes.contains(n))
            .cloned()
            .collect();
        report.nodes_removed = old_nodes
            .iter()
            .filter(|n| !new_nodes.contains(n))
            .cloned()
            .collect();
        report.models_added = new_models
            .iter()
            .filter(|m| !old_models.contains(m))
            .cloned()
            .collect();
        report.models_removed = old_models
            .iter()
            .filter(|m| !new_models.contains(m))
            .cloned()
            .collect();
    }
    drop(before);
    report.client_keys = edge.settings.client_keys.replace(&next.client_keys);
    // Rotation or a new path: each log opens what the file names now.
    for outcome in [
        edge.settings
            .access_log
            .apply_reload(&next.source, &next.access_log),
        edge.settings
            .usage_log
            .apply_reload(&next.source, next.usage_log.as_deref()),
    ] {
        report.kept_operational.extend(outcome.kept);
        report.restart_required.extend(outcome.restart_required);
    }
    // Leases issued from here on, on every shard, come from the new plane:
    // its slots, revocations, secrets, origins and paths.
    if let (Some(running), Some(plane)) = (&edge.settings.credentials, credentials) {
        report.credentials = running.commit(plane);
    }
    // The fleet: who may connect, Control (a request let in under the new
    // model list finds its model there), then what the shards read. A
    // removed node's open connection is Control's to let go of.
    if let Some(allowed) = &edge.settings.node_allow_list {
        allowed.replace(next.nodes.iter().map(|n| n.id.clone()));
    }
    edge.apply(Input::Reconfigure(Box::new(control_spec(&next))));
    edge.settings
        .running
        .replace(Running::of(&next, revision, digest));
    let models: Vec<String> = next.models.iter().map(|m| m.name.clone()).collect();
    let nodes: Vec<String> = next.nodes.iter().map(|n| n.id.clone()).collect();
    report.unmetered = edge.settings.request_metrics.add_names(&models, &nodes);
    for node in &next.nodes {
        let payload = next.node_config_payload(node, revision);
        if report.nodes_added.contains(&node.id) {
            // Not registered yet: it gets this at its registration.
            edge.set_node_config(&node.id, payload);
            continue;
        }
        let changed = {
            let control = edge.control();
            let Some(old) = control.node_config(&node.id) else {
                continue;
            };
            let mut old = old.clone();
            old.revision = revision;
            old != payload
        };
        if !changed {
            continue;
        }
        edge.set_node_config(&node.id, payload.clone());
        let conn = edge.control().ready_conn(&node.id);
        match conn {
            Some(conn) => {
                let refresh = pb::NodeConfigRefreshRequest {
                    refresh_id: format!("reload-{revision}-{}", node.id),
                    config: Some(payload),
                };
                let frame = pb::Frame {
                    body: Some(pb::frame::Body::NodeConfigRefreshRequest(Box::new(refresh))),
                };
                if edge.send_control_to(conn, frame) {
                    report.refreshed.push(node.id.clone());
                } else {
                    report.unsent.push(node.id.clone());
                }
            }
            None => report.deferred.push(node.id.clone()),
        }
    }
    Ok((next, report))
}

/// Logs what a reload (or a cluster's fleet) applied, as `what`: one info
/// line, and warnings for refreshes not sent, log paths kept, names past
/// the metrics' room and changes that need a restart.
pub fn log_report(report: &ReloadReport, what: &str) {
    tracing::info!(
        revision = report.revision,
        nodes_added = ?report.nodes_added,
        nodes_removed = ?report.nodes_removed,
        models_added = ?report.models_added,
        models_removed = ?report.models_removed,
        refreshed = ?report.refreshed,
        deferred = ?report.deferred,
        client_keys = report.client_keys.keys,
        client_keys_added = report.client_keys.added,
        client_keys_revoked = report.client_keys.revoked,
        client_keys_changed = report.client_keys.changed,
        credentials = ?report.credentials,
        "{what}"
    );
    if !report.unsent.is_empty() {
        tracing::warn!(
            nodes = ?report.unsent,
            "config refresh not sent: the node's connection closed; \
             it gets the new config when it registers again"
        );
    }
    for kept in &report.kept_operational {
        tracing::warn!(
            error = %kept,
            "a log path of the reloaded file cannot be opened; \
             the rest of the file is applied"
        );
    }
    if !report.unmetered.is_empty() {
        tracing::warn!(
            names = ?report.unmetered,
            "no room left for these models' and nodes' own /metrics series; \
             counted as model \"other\" until a restart"
        );
    }
    if !report.restart_required.is_empty() {
        tracing::warn!(
            sections = ?report.restart_required,
            "these changes need a restart and were not applied"
        );
    }
}

/// The settings of `next` that differ from `started` and that only a
/// restart applies ([`ConfigDiff::restart_keys`]), and `[credentials]`
/// when it changed. The access log and the usage file say themselves what
/// of theirs needs a restart (their `apply_reload`).
fn restart_required(started: &EdgeConfig, next: &EdgeConfig) -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = ConfigDiff::between(started, next)
        .restart_keys()
        .into_iter()
        .filter(|key| {
            !matches!(
                *key,
                "edge.access_log" | "edge.access_log.format" | "edge.usage_log"
            )
        })
        .collect();
    // Slots, revisions, revocations and the lease TTL apply (see
    // `apply`); the plane turns on or off only at start (another issuer
    // key is found by reading it, in `apply`).
    match (&started.credentials, &next.credentials) {
        (None, Some(_)) => keys.push(
            "[credentials] added (the credential plane turns on only at start; no lease is issued \
             until a restart)",
        ),
        (Some(_), None) => keys.push(
            "[credentials] removed (the credential plane turns off only at start; its running \
             slots stay in force)",
        ),
        _ => {}
    }
    keys
}

/// The certificates one SIGHUP reloaded, or why one was kept.
#[derive(Debug, Default)]
pub struct TlsReloadReport {
    /// The node-link identity now presented (`[tls]`), or why the running
    /// one was kept.
    pub node_link: Option<Result<iop_engine::tls::LocalIdentity, String>>,
    /// The client-listener certificate now presented (`[edge.client_tls]`),
    /// or why the running one was kept.
    pub client_listener: Option<Result<iop_engine::tls::HttpsIdentity, String>>,
    /// In a cluster: the identity this Edge now presents when it forwards
    /// to a peer (the `[tls]` certificate too), or why the running one was
    /// kept.
    pub peer_client: Option<Result<iop_engine::tls::LocalIdentity, String>>,
}

/// Re-reads the certificate files `cfg` names (SIGHUP) and swaps them into
/// the running acceptors: handshakes from now on present the new
/// certificate, connections already open keep theirs. A file that does not
/// load, a key that does not match, or a certificate naming another Edge
/// identity is refused, the running certificate stays, and the report says
/// why. Also logs each outcome.
pub fn reload_tls(
    cfg: &EdgeConfig,
    node_link: Option<&EdgeTlsAcceptor>,
    client_listener: Option<&HttpsAcceptor>,
    peer_client: Option<&NodeTlsConnector>,
) -> TlsReloadReport {
    let mut report = TlsReloadReport::default();
    if let (Some(files), Some(connector)) = (&cfg.tls, peer_client) {
        // The same certificate as the node link: presented to peer Edges
        // when forwarding (clones share it, so every shard's forwards get
        // it).
        let outcome = TlsMaterial::from_files(&iop_engine::tls::TlsFiles::from(files))
            .and_then(|material| connector.reload(&material))
            .map_err(|e| format!("{}: tls: {e}", cfg.source.display()));
        if let Err(e) = &outcome {
            tracing::error!(
                error = %e,
                "peer-client certificate not reloaded; keeping the running one"
            );
        }
        report.peer_client = Some(outcome);
    }
    if let (Some(files), Some(acceptor)) = (&cfg.tls, node_link) {
        let outcome = TlsMaterial::from_files(&iop_engine::tls::TlsFiles::from(files))
            .and_then(|material| acceptor.reload(&material))
            .map_err(|e| format!("{}: tls: {e}", cfg.source.display()));
        match &outcome {
            Ok(id) => tracing::info!(
                identity = %id.id.uri(),
                cert_serial = %id.serial_hex,
                not_after_unix_s = id.not_after_unix_s,
                "node-link certificate reloaded: new node connections get it"
            ),
            Err(e) => tracing::error!(
                error = %e,
                "node-link certificate not reloaded; keeping the running one"
            ),
        }
        report.node_link = Some(outcome);
    }
    if let (Some(files), Some(acceptor)) = (&cfg.client_tls, client_listener) {
        let outcome = acceptor
            .reload_from(files)
            .map_err(|e| format!("{}: edge.client_tls: {e}", cfg.source.display()));
        match &outcome {
            Ok(id) => tracing::info!(
                cert_serial = %id.serial_hex,
                not_after_unix_s = id.not_after_unix_s,
                "client-listener certificate reloaded: new client connections get it"
            ),
            Err(e) => tracing::error!(
                error = %e,
                "client-listener certificate not reloaded; keeping the running one"
            ),
        }
        report.client_listener = Some(outcome);
    }
    report
}

/// Opens `edge.budget_file` for `keys` (replay, compaction, the writer
/// thread), with the budget clock moved by the test-only
/// [`budgets::CLOCK_OFFSET_ENV`] when it is set (warned about). The error
/// names the file.
fn open_budget_file(keys: &ClientKeys, path: &std::path::Path) -> std::io::Result<()> {
    let offset_ms = match std::env::var(budgets::CLOCK_OFFSET_ENV) {
        Err(_) => 0,
        Ok(value) => {
            let offset_ms: i64 = value.trim().parse().map_err(|_| {
                std::io::Error::other(format!(
                    "{}: expected a signed number of milliseconds, got {value:?}",
                    budgets::CLOCK_OFFSET_ENV
                ))
            })?;
            tracing::warn!(
                env = budgets::CLOCK_OFFSET_ENV,
                offset_ms,
                "TEST ONLY: the token budgets' clock is moved; budgets reset at the wrong \
                 time. Never set this in production"
            );
            offset_ms
        }
    };
    let replay = keys
        .open_budget_file(path, offset_ms)
        .map_err(std::io::Error::other)?;
    tracing::info!(
        file = %path.display(),
        records = replay.records,
        skipped_lines = replay.skipped_lines,
        compacted_records = replay.compacted_records,
        "budget file replayed and compacted"
    );
    Ok(())
}

/// Everything an Edge running on several cores needs, prepared on the
/// main thread: each shard takes its part with [`ShardedEdge::take`].
pub struct ShardedEdge {
    cfg: EdgeConfig,
    /// One credential plane for every shard, so a reload reaches them all.
    credentials: Option<RunningPlane>,
    /// One table for every shard, so a reload reaches them all.
    client_keys: ClientKeys,
    /// One running configuration for every shard, so a reload reaches
    /// them all.
    running: RunningConfig,
    /// One usage file for every shard.
    usage_log: UsageLog,
    /// One access log writer for every shard.
    access_log: AccessLog,
    /// One OTLP exporter thread for every shard (`[tracing]`); `None`:
    /// tracing is off.
    trace_export: Option<iop_engine::trace::ExportHandle>,
    /// One set of request series for every shard (each writes its own
    /// cells).
    request_metrics: Arc<RequestMetrics>,
    /// Per-peer caps of both listeners, one table for every shard.
    peer_limits: crate::plane::limits::PeerLimits,
    /// This Edge's place in its cluster, one view for every shard.
    cluster: Option<Arc<crate::plane::cluster::ClusterView>>,
    acceptor: Option<EdgeTlsAcceptor>,
    client_tls: Option<HttpsAcceptor>,
    /// How this Edge dials other Edges' peer listeners (`[cluster]` with
    /// `[tls]`).
    peer_tls: Option<NodeTlsConnector>,
    parts: Mutex<Vec<Option<ShardPart>>>,
    client_addr: SocketAddr,
    node_addr: SocketAddr,
    /// The bound peer listener (`[cluster] peer_listen`).
    peer_addr: Option<SocketAddr>,
}

/// One shard's listeners and mailboxes.
struct ShardPart {
    client: std::net::TcpListener,
    nodes: std::net::TcpListener,
    /// The peer listener of a cluster member with `peer_listen`.
    peer: Option<std::net::TcpListener>,
    port: MeshPort,
}

impl std::fmt::Debug for ShardedEdge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedEdge")
            .field("client_addr", &self.client_addr)
            .field("node_addr", &self.node_addr)
            .finish_non_exhaustive()
    }
}

/// What one shard hands back when it stops.
#[derive(Debug)]
pub struct ShardEnd {
    /// How the drain ended (the control shard's answer covers every shard).
    pub drain: DrainEnd,
}

impl ShardedEdge {
    /// Binds `shards` `SO_REUSEPORT` listeners on each configured address
    /// and the mailboxes between the shards.
    pub fn bind(
        cfg: EdgeConfig,
        credentials: Option<CredentialPlane>,
        acceptor: Option<EdgeTlsAcceptor>,
        shards: usize,
    ) -> std::io::Result<Self> {
        let shards = shards.max(1);
        let clients = crate::link::shards::bind_reuseport(
            cfg.edge.client_listen,
            shards,
            "edge.client_listen",
        )?;
        let nodes =
            crate::link::shards::bind_reuseport(cfg.edge.node_listen, shards, "edge.node_listen")?;
        let peer_listen = cfg.cluster.as_ref().and_then(|c| c.peer_listen);
        let mut edge = Self::from_listeners(
            cfg,
            credentials,
            acceptor,
            clients.into_iter().zip(nodes).collect(),
        )?;
        if let Some(addr) = peer_listen {
            let peers = crate::link::shards::bind_reuseport(addr, shards, "cluster.peer_listen")?;
            edge.peer_addr = peers.first().map(|l| l.local_addr()).transpose()?;
            let mut parts = edge
                .parts
                .lock()
                .map_err(|_| std::io::Error::other("shard setup lock poisoned"))?;
            for (part, peer) in parts.iter_mut().zip(peers) {
                if let Some(part) = part {
                    part.peer = Some(peer);
                }
            }
        }
        Ok(edge)
    }

    /// One shard per `(client, node)` listener pair, in shard order; the
    /// first pair's addresses are the ones announced. Tests give shards
    /// listeners of their own to steer connections to a chosen shard.
    pub fn from_listeners(
        cfg: EdgeConfig,
        credentials: Option<CredentialPlane>,
        acceptor: Option<EdgeTlsAcceptor>,
        listeners: Vec<(std::net::TcpListener, std::net::TcpListener)>,
    ) -> std::io::Result<Self> {
        let Some((first_client, first_node)) = listeners.first() else {
            return Err(std::io::Error::other("an Edge needs at least one shard"));
        };
        let client_addr = first_client.local_addr()?;
        let node_addr = first_node.local_addr()?;
        let ports_len = listeners.len();
        let ports = crate::link::shards::mesh(ports_len);
        let parts = listeners
            .into_iter()
            .zip(ports)
            .map(|((client, nodes), port)| {
                Some(ShardPart {
                    client,
                    nodes,
                    peer: None,
                    port,
                })
            })
            .collect();
        let peer_tls = match (&cfg.cluster, &cfg.tls) {
            (Some(_), Some(files)) => {
                let connector = TlsMaterial::from_files(&iop_engine::tls::TlsFiles::from(files))
                    .and_then(|material| {
                        // Which peer it accepts is chosen per dial.
                        NodeTlsConnector::edge_to_edge(
                            &material,
                            &cfg.edge.trust_domain,
                            &cfg.edge.name,
                        )
                    })
                    .map_err(|e| {
                        std::io::Error::other(format!("{}: tls: {e}", cfg.source.display()))
                    })?;
                Some(connector)
            }
            _ => None,
        };
        let client_keys = ClientKeys::from_config(&cfg.client_keys);
        if let Some(path) = &cfg.budget_file {
            open_budget_file(&client_keys, path)?;
        }
        Ok(Self {
            client_keys,
            running: RunningConfig::new(Running::of(
                &cfg,
                1,
                std::fs::read(&cfg.source)
                    .map(|bytes| digest_of(&bytes))
                    .unwrap_or_default(),
            )),
            usage_log: usage_log(&cfg),
            access_log: access_log(&cfg),
            trace_export: trace_export(&cfg),
            request_metrics: request_metrics(&cfg, ports_len),
            peer_limits: crate::plane::limits::PeerLimits::new(&cfg.edge.limits),
            cluster: cfg.cluster.as_ref().map(|c| {
                Arc::new(crate::plane::cluster::ClusterView::new(
                    &c.name,
                    &cfg.edge.name,
                ))
            }),
            cfg,
            credentials: credentials.map(RunningPlane::new),
            acceptor,
            client_tls: None,
            peer_tls,
            parts: Mutex::new(parts),
            client_addr,
            node_addr,
            peer_addr: None,
        })
    }

    /// The client keys every shard shares (with the principals' limits and
    /// budgets): [`ClientKeys::close_budget_file`] after the drain.
    pub fn client_keys(&self) -> &ClientKeys {
        &self.client_keys
    }

    /// The process's usage file: [`UsageLog::close`] it after the drain.
    pub fn usage_log(&self) -> &UsageLog {
        &self.usage_log
    }

    /// The process's access log: [`AccessLog::close`] it after the drain.
    pub fn access_log(&self) -> &AccessLog {
        &self.access_log
    }

    /// Serves the client listener over HTTPS with `acceptor`
    /// (`[edge.client_tls]`) on every shard.
    pub fn with_client_tls(mut self, acceptor: Option<HttpsAcceptor>) -> Self {
        self.client_tls = acceptor;
        self
    }

    /// The node-link acceptor (`None` in insecure mode); clones share its
    /// identity, so a reload through one reaches every shard.
    pub fn node_acceptor(&self) -> Option<&EdgeTlsAcceptor> {
        self.acceptor.as_ref()
    }

    /// The client listener's HTTPS acceptor, if `[edge.client_tls]` is set.
    pub fn client_tls(&self) -> Option<&HttpsAcceptor> {
        self.client_tls.as_ref()
    }

    /// The bound client address.
    pub fn client_addr(&self) -> SocketAddr {
        self.client_addr
    }

    /// The bound node address.
    pub fn node_addr(&self) -> SocketAddr {
        self.node_addr
    }

    /// The bound peer listener (`[cluster] peer_listen`), if any.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// Prints the `IOP_READY` line scripts and tests wait for (with
    /// `peer=<addr>` when the Edge has a peer listener).
    pub fn announce(&self) -> std::io::Result<()> {
        announce(self.client_addr, self.node_addr, self.peer_addr)
    }

    /// Builds shard `index`'s state and listeners on the calling shard's
    /// runtime and starts its mesh tasks. Each index once.
    pub fn take(
        &self,
        index: usize,
    ) -> std::io::Result<(Rc<Edge>, Listeners, Option<Rc<EdgeTlsAcceptor>>)> {
        let part = self
            .parts
            .lock()
            .map_err(|_| std::io::Error::other("shard setup lock poisoned"))?
            .get_mut(index)
            .and_then(Option::take)
            .ok_or_else(|| std::io::Error::other(format!("shard {index} taken twice")))?;
        let count = part.port.peers.len();
        let control = (index == CONTROL_SHARD).then(|| {
            let spec = control_spec(&self.cfg);
            match self.cfg.cluster {
                Some(_) => Control::clustered(spec),
                None => Control::new(spec),
            }
        });
        let outbox = (count > 1).then(|| Outbox::new(part.port.peers));
        let mut settings = settings(&self.cfg, self.credentials.clone());
        settings.client_tls = self.client_tls.clone();
        settings.client_keys = self.client_keys.clone();
        settings.running = self.running.clone();
        settings.usage_log = self.usage_log.clone();
        settings.access_log = self.access_log.clone();
        settings.tracer = self
            .cfg
            .tracing
            .as_ref()
            .zip(self.trace_export.as_ref())
            .map(|(spec, export)| {
                Rc::new(iop_engine::trace::Tracer::for_spec(spec, export.clone()))
            });
        settings.request_metrics = self.request_metrics.clone();
        settings.peer_limits = self.peer_limits.clone();
        settings.cluster = self.cluster.clone();
        settings.peer_tls = self.peer_tls.clone();
        settings.node_allow_list = self.acceptor.as_ref().map(|a| a.allowed_nodes().clone());
        let edge = Rc::new(Edge::shard(index, control, outbox, settings));
        monoio::spawn(edge.clone().run_mesh(part.port.inbox));
        let peer = match (part.peer, &self.acceptor) {
            (Some(listener), Some(acceptor)) => Some(PeerListener {
                listener: TcpListener::from_std(listener)?,
                acceptor: Rc::new(acceptor.for_peer_edges()),
            }),
            _ => None,
        };
        let listeners = Listeners {
            client: TcpListener::from_std(part.client)?,
            nodes: TcpListener::from_std(part.nodes)?,
            peer,
        };
        Ok((edge, listeners, self.acceptor.clone().map(Rc::new)))
    }

    /// Serves shard `index` until the whole Edge has drained. The control
    /// shard (index 0) takes the process signals from `stop` and passes
    /// them on; worker shards follow the control shard and ignore `stop`'s
    /// futures.
    pub async fn serve_shard<S, F>(
        &self,
        index: usize,
        stop: Stop<S, F>,
    ) -> std::io::Result<ShardEnd>
    where
        S: Future<Output = ()> + 'static,
        F: Future<Output = ()> + 'static,
    {
        let (edge, listeners, acceptor) = self.take(index)?;
        let member = self.start_member(&edge)?;
        self.serve_taken(edge, member, listeners, acceptor, stop)
            .await
    }

    /// On the control shard of a cluster member (`[cluster]`): starts the
    /// cluster shell ([`crate::cluster::member`]), which claims its nodes
    /// in etcd, follows the cluster, and applies the cluster's fleet with
    /// [`apply`]. `None` for a single Edge and on other shards.
    pub fn start_member(
        &self,
        edge: &Rc<Edge>,
    ) -> std::io::Result<Option<Rc<crate::cluster::member::Member>>> {
        let (Some(view), true) = (&self.cluster, edge.is_control_shard()) else {
            return Ok(None);
        };
        let started = self.cfg.clone();
        let applied_to = edge.clone();
        let apply_config: crate::cluster::member::ApplyConfig =
            Box::new(move |next, digest, what| {
                let revision = applied_to.settings.running.get().revision + 1;
                match apply(&applied_to, &started, next, digest, revision) {
                    Ok((_, report)) => log_report(&report, what),
                    // A credential secret of the composed file could not be
                    // read: nothing of it applied.
                    Err(e) => tracing::error!(
                        error = %e,
                        "{what}: not applied; keeping the running configuration"
                    ),
                }
            });
        crate::cluster::member::Member::start(
            edge.clone(),
            &self.cfg,
            view.clone(),
            crate::cluster::member::Addresses {
                client: self.client_addr,
                node: self.node_addr,
                peer: self.peer_addr,
            },
            apply_config,
        )
        .map(Some)
        .map_err(std::io::Error::other)
    }

    /// [`ShardedEdge::serve_shard`] for a shard already taken (the control
    /// shard's caller may hook into its state first, e.g. SIGHUP reload),
    /// with its cluster member if any ([`ShardedEdge::start_member`]).
    pub async fn serve_taken<S, F>(
        &self,
        edge: Rc<Edge>,
        member: Option<Rc<crate::cluster::member::Member>>,
        listeners: Listeners,
        acceptor: Option<Rc<EdgeTlsAcceptor>>,
        stop: Stop<S, F>,
    ) -> std::io::Result<ShardEnd>
    where
        S: Future<Output = ()> + 'static,
        F: Future<Output = ()> + 'static,
    {
        let drain_grace = stop.drain_grace;
        if edge.is_control_shard() {
            // The process signals become lifecycle steps of every shard,
            // this one included, for as long as the runtime runs (a second
            // signal must still cut the drain short while this shard waits
            // for the others).
            let (shutdown, force) = (stop.shutdown, stop.force);
            for (signal, step) in [
                (
                    Box::pin(shutdown) as std::pin::Pin<Box<dyn Future<Output = ()>>>,
                    Lifecycle::Shutdown,
                ),
                (Box::pin(force), Lifecycle::Force),
            ] {
                let edge = edge.clone();
                monoio::spawn(async move {
                    signal.await;
                    edge.step(step);
                });
            }
            let stop = Stop {
                shutdown: edge.lifecycle_reached(Lifecycle::Shutdown),
                force: edge.lifecycle_reached(Lifecycle::Force),
                drain_grace,
            };
            let own = serve_with_drain(edge.clone(), listeners, acceptor, stop).await;
            // Control keeps deciding (queue timeouts, terminals) for the
            // workers' requests until they are done; a second signal
            // reaches them as Force and ends their drains at once.
            let cut_off = monoio::select! {
                cut_off = edge.workers_drained() => cut_off,
                _ = edge.run_timers() => 0,
            };
            // Drained: this Edge's keys go now, not at its lease's expiry.
            if let Some(member) = member {
                member.leave().await;
            }
            edge.broadcast(Lifecycle::Exit);
            // The workers wait for this message; this runtime (and its
            // flusher) ends when we return.
            edge.outbox_flushed().await;
            let forced = edge.lifecycle_has(Lifecycle::Force);
            let drain = match own {
                DrainEnd::Forced { in_flight } => DrainEnd::Forced {
                    in_flight: in_flight + cut_off,
                },
                _ if forced => DrainEnd::Forced { in_flight: cut_off },
                DrainEnd::Finished if cut_off == 0 => DrainEnd::Finished,
                DrainEnd::Finished => DrainEnd::GraceElapsed { in_flight: cut_off },
                DrainEnd::GraceElapsed { in_flight } => DrainEnd::GraceElapsed {
                    in_flight: in_flight + cut_off,
                },
            };
            return Ok(ShardEnd { drain });
        }
        let stop = Stop {
            shutdown: edge.lifecycle_reached(Lifecycle::Shutdown),
            force: edge.lifecycle_reached(Lifecycle::Force),
            drain_grace,
        };
        let drain = serve_with_drain(edge.clone(), listeners, acceptor, stop).await;
        let in_flight = match drain {
            DrainEnd::Finished => 0,
            DrainEnd::GraceElapsed { in_flight } | DrainEnd::Forced { in_flight } => in_flight,
        };
        edge.report_drained(in_flight);
        // Node connections of this shard keep carrying other shards'
        // streams until every shard is done.
        edge.lifecycle_reached(Lifecycle::Exit).await;
        Ok(ShardEnd { drain })
    }
}

fn announce(
    client: SocketAddr,
    nodes: SocketAddr,
    peer: Option<SocketAddr>,
) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match peer {
        Some(peer) => {
            tracing::info!(%client, %nodes, %peer, "listening");
            writeln!(
                out,
                "IOP_READY edge client={client} nodes={nodes} peer={peer}"
            )?;
        }
        None => {
            tracing::info!(%client, %nodes, "listening");
            writeln!(out, "IOP_READY edge client={client} nodes={nodes}")?;
        }
    }
    out.flush()
}

/// Bound listeners, before serving.
#[derive(Debug)]
pub struct Listeners {
    /// The client HTTP listener.
    pub client: TcpListener,
    /// The node listener.
    pub nodes: TcpListener,
    /// The peer listener of a cluster member (`[cluster] peer_listen`).
    pub peer: Option<PeerListener>,
}

/// A cluster member's peer listener: other Edges forward requests to it
/// over mTLS (see [`crate::client::router::serve_peer`]).
#[derive(Debug)]
pub struct PeerListener {
    /// The bound socket.
    pub listener: TcpListener,
    /// Takes Edges of the trust domain, presenting this Edge's `[tls]`
    /// identity (shared with the node link: a reload reaches both).
    pub acceptor: Rc<EdgeTlsAcceptor>,
}

impl Listeners {
    /// Binds both listeners of `cfg`. Errors name the config key.
    pub fn bind(cfg: &EdgeConfig) -> std::io::Result<Self> {
        let bind = |addr: SocketAddr, key: &str| {
            TcpListener::bind(addr)
                .map_err(|e| std::io::Error::new(e.kind(), format!("bind {key} {addr}: {e}")))
        };
        Ok(Self {
            client: bind(cfg.edge.client_listen, "edge.client_listen")?,
            nodes: bind(cfg.edge.node_listen, "edge.node_listen")?,
            peer: None,
        })
    }

    /// The bound client address.
    pub fn client_addr(&self) -> std::io::Result<SocketAddr> {
        self.client.local_addr()
    }

    /// The bound node address.
    pub fn node_addr(&self) -> std::io::Result<SocketAddr> {
        self.nodes.local_addr()
    }

    /// Prints the `IOP_READY` line scripts and tests wait for.
    pub fn announce(&self) -> std::io::Result<()> {
        let peer = self
            .peer
            .as_ref()
            .map(|p| p.listener.local_addr())
            .transpose()?;
        announce(self.client_addr()?, self.node_addr()?, peer)
    }
}

/// Serves both listeners until `shutdown` completes, then stops at once
/// (connections still open are left to the caller's runtime). The binary
/// drains instead: [`serve_with_drain`].
pub async fn serve(
    edge: Rc<Edge>,
    listeners: Listeners,
    acceptor: Option<Rc<EdgeTlsAcceptor>>,
    shutdown: impl Future<Output = ()>,
) {
    let stop = Stop {
        shutdown,
        force: std::future::pending(),
        drain_grace: Duration::ZERO,
    };
    serve_with_drain(edge, listeners, acceptor, stop).await;
}

/// When and how the Edge stops.
#[derive(Debug)]
pub struct Stop<S, F> {
    /// Completes on the first SIGTERM/SIGINT: the drain begins.
    pub shutdown: S,
    /// Completes on the second: the drain ends at once.
    pub force: F,
    /// How long in-flight client requests may run on (`edge.drain_grace_ms`).
    pub drain_grace: Duration,
}

/// How the shutdown drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainEnd {
    /// Every in-flight client request finished.
    Finished,
    /// The grace elapsed with this many requests still in flight.
    GraceElapsed {
        /// Requests cut off.
        in_flight: usize,
    },
    /// A second signal ended the drain with this many requests in flight.
    Forced {
        /// Requests cut off.
        in_flight: usize,
    },
}

/// Serves both listeners until `stop.shutdown` completes, then drains:
/// both listeners are closed (new client and node connections are
/// refused), [`Edge::begin_drain`] makes `/readyz` answer 503 and requests
/// on open connections get 503 with `retry-after`, while node connections
/// and the requests already in flight carry on until they finish, the
/// grace elapses or `stop.force` completes.
pub async fn serve_with_drain<S, F>(
    edge: Rc<Edge>,
    listeners: Listeners,
    acceptor: Option<Rc<EdgeTlsAcceptor>>,
    stop: Stop<S, F>,
) -> DrainEnd
where
    S: Future<Output = ()>,
    F: Future<Output = ()>,
{
    let Listeners {
        client: client_listener,
        nodes: node_listener,
        peer: peer_listener,
    } = listeners;
    let node_loop = crate::server::front_door::serve_nodes(edge.clone(), node_listener, acceptor);
    let client_loop = crate::server::front_door::serve_clients(edge.clone(), client_listener);
    let peer_loop = {
        let edge = edge.clone();
        async move {
            match peer_listener {
                Some(peer) => {
                    crate::server::front_door::serve_peers(edge, peer.listener, peer.acceptor).await
                }
                None => std::future::pending().await,
            }
        }
    };
    if edge.is_control_shard() {
        monoio::spawn(crate::server::front_door::trim_heaps());
    }
    let timers = {
        let edge = edge.clone();
        async move { edge.run_timers().await }
    };
    let mut timers = std::pin::pin!(timers);
    // The accept loops own the listeners: when this select ends they are
    // dropped and the listening sockets close.
    monoio::select! {
        _ = &mut timers => {},
        _ = node_loop => {},
        _ = client_loop => {},
        _ = peer_loop => {},
        _ = stop.shutdown => {},
    }
    edge.begin_drain();
    tracing::info!(
        in_flight = edge.in_flight_requests(),
        drain_grace_ms = u64::try_from(stop.drain_grace.as_millis()).unwrap_or(u64::MAX),
        "draining: listeners closed, /readyz answers 503"
    );
    // Control's timers keep running (queue timeouts, heartbeats); they
    // never end on their own.
    let end = monoio::select! {
        _ = &mut timers => DrainEnd::Finished,
        _ = edge.requests_finished() => DrainEnd::Finished,
        _ = monoio::time::sleep(stop.drain_grace) => DrainEnd::GraceElapsed {
            in_flight: edge.in_flight_requests(),
        },
        _ = stop.force => DrainEnd::Forced {
            in_flight: edge.in_flight_requests(),
        },
    };
    if end != DrainEnd::Finished {
        // The requests still relaying end now, through their normal end
        // (cancelled on their nodes, their lines and usage records
        // written); a request stuck writing to a client that reads nothing
        // is not waited for past CUT_OFF_WAIT.
        edge.cut_off_requests();
        monoio::select! {
            _ = edge.requests_finished() => {},
            _ = monoio::time::sleep(CUT_OFF_WAIT) => {},
        }
    }
    end
}

/// How long the end of the drain waits for cut-off requests to finish.
pub const CUT_OFF_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{ConnId, Input};
    use crate::link::edge::edge_state;

    fn config_text(base_url: &str) -> String {
        config_text_with(base_url, "allow_anonymous = true\n", "")
    }

    /// The test config with more `[edge]` lines and more TOML at the end.
    fn config_text_with(base_url: &str, edge_lines: &str, tail: &str) -> String {
        format!(
            "[edge]\nname = \"edge-1\"\ntrust_domain = \"iop.test\"\n\
             client_listen = \"127.0.0.1:0\"\nnode_listen = \"127.0.0.1:0\"\n\
             insecure_plaintext_nodes = true\n{edge_lines}\
             [[nodes]]\nid = \"node-a\"\n\
             [[nodes.adapters]]\nname = \"mock\"\nkind = \"openai_compat\"\n\
             base_url = \"{base_url}\"\n\
             [[nodes.providers]]\nid = \"mock-1\"\nadapter = \"mock\"\ntarget = \"m\"\ncapacity = 1\n\
             [[nodes]]\nid = \"node-b\"\n\
             [[nodes.adapters]]\nname = \"mock\"\nkind = \"openai_compat\"\n\
             base_url = \"{base_url}\"\n\
             [[nodes.providers]]\nid = \"mock-1\"\nadapter = \"mock\"\ntarget = \"m\"\ncapacity = 1\n\
             [[models]]\nname = \"model\"\nproviders = [\"node-a/mock-1\", \"node-b/mock-1\"]\n{tail}"
        )
    }

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "iop-{tag}-{}-{}",
            std::process::id(),
            iop_engine::clock::monotonic_raw_ns()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    // SIGHUP re-reads `[tls]` into the connector an Edge of a cluster
    // forwards with: its forwards present the new certificate.
    #[test]
    fn a_reload_gives_forwards_to_peers_the_new_certificate() {
        let dir = temp_dir("peer-reload");
        let mint = || {
            iop_engine::certs::write_cluster_dev_certs(
                &dir,
                "iop.test",
                &["edge-1"],
                ["node-a"],
                &[],
            )
            .unwrap()
        };
        let first = mint();
        let material = TlsMaterial::from_files(&first.edge_tls_files()).unwrap();
        let connector = NodeTlsConnector::edge_to_edge(&material, "iop.test", "edge-1").unwrap();
        // A forward picks its peer per dial from a clone: clones share it.
        let per_dial = connector.to_edge("edge-2").unwrap();
        let before = per_dial.local_certificate().serial_hex;
        let path = dir.join("edge.toml");
        let text = config_text_with("http://127.0.0.1:9000", "", "").replace(
            "insecure_plaintext_nodes = true\n",
            "allow_anonymous = true\n",
        ) + "[tls]\nca = \"ca.pem\"\ncert = \"edge.pem\"\nkey = \"edge-key.pem\"\n";
        std::fs::write(&path, text).unwrap();
        let cfg = EdgeConfig::load(&path).unwrap();
        // The same identity, a new certificate (and CA).
        mint();
        let report = reload_tls(&cfg, None, None, Some(&connector));
        let reloaded = report.peer_client.expect("reloaded").expect("accepted");
        assert_ne!(reloaded.serial_hex, before);
        assert_eq!(per_dial.local_certificate().serial_hex, reloaded.serial_hex);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    // A reload that would remove the last client key (and so open the
    // Edge to every client) is refused, and the running keys stay; only a
    // file that says `allow_anonymous = true` may run open.
    #[test]
    fn a_reload_that_removes_the_last_key_is_refused_unless_open_access_is_explicit() {
        let dir = temp_dir("open-access");
        let path = dir.join("edge.toml");
        let key = format!(
            "[[client_keys]]\nprincipal = \"team-a\"\nkey_hash = \"{}\"\n",
            blake3::hash(b"sk-team-a").to_hex()
        );
        let base = "http://127.0.0.1:9000";
        std::fs::write(&path, config_text_with(base, "", &key)).unwrap();
        let cfg = EdgeConfig::load(&path).unwrap();
        let edge = edge_state(&cfg);
        assert!(edge.settings.client_keys.is_enabled());
        // The revocation procedure with one key: delete it, SIGHUP.
        std::fs::write(&path, config_text_with(base, "", "")).unwrap();
        let refused = reload(&edge, &cfg, &path, 2).unwrap_err();
        assert_eq!(refused.key(), "client_keys");
        assert!(
            refused.reason().contains("set edge.allow_anonymous = true"),
            "{refused}"
        );
        assert!(
            edge.settings.client_keys.is_enabled(),
            "the key still applies"
        );
        // Said explicitly: the Edge runs open from now on.
        std::fs::write(
            &path,
            config_text_with(base, "allow_anonymous = true\n", ""),
        )
        .unwrap();
        let (_, report) = reload(&edge, &cfg, &path, 3).unwrap();
        assert_eq!(report.client_keys.revoked, 1);
        assert_eq!(report.restart_required, Vec::<&str>::new());
        assert!(!edge.settings.client_keys.is_enabled());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    // CONTRACT: R4, X6, K3 — a reload that changes both nodes' adapters
    // refreshes neither a pending owner (registered, not ready: deferred to
    // its next registration) nor a ready owner whose connection is gone by
    // the time the refresh is sent: that one is reported as not refreshed,
    // never as refreshed.
    #[test]
    fn reload_refreshes_only_ready_owners_it_could_reach() {
        let dir = std::env::temp_dir().join(format!(
            "iop-reload-{}-{}",
            std::process::id(),
            iop_engine::clock::monotonic_raw_ns()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("edge.toml");
        std::fs::write(&path, config_text("http://127.0.0.1:9000")).unwrap();
        let cfg = EdgeConfig::load(&path).unwrap();
        let edge = edge_state(&cfg);
        // node-a: pending (registered only); node-b: ready, but its
        // connection is not (or no longer) on this shard.
        edge.apply(Input::Register {
            conn: ConnId(1),
            tls_name: "node-a".into(),
            node_id: "node-a".into(),
        });
        edge.apply(Input::Register {
            conn: ConnId(2),
            tls_name: "node-b".into(),
            node_id: "node-b".into(),
        });
        edge.apply(Input::Ready {
            conn: ConnId(2),
            node_id: "node-b".into(),
        });
        std::fs::write(&path, config_text("http://127.0.0.1:9001")).unwrap();
        let (_, report) = reload(&edge, &cfg, &path, 2).unwrap();
        assert_eq!(
            report,
            ReloadReport {
                revision: 2,
                deferred: vec!["node-a".into()],
                unsent: vec!["node-b".into()],
                ..ReloadReport::default()
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
