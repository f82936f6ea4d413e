//! The cluster shell: this Edge as a member of its cluster, on the control
//! shard. Three tasks carry `Control`'s ownership decisions to etcd and
//! etcd's news back to `Control`:
//!
//! ```text
//! lease task   grant ──► announce /edges/<name> ──► ClusterSession{up: true}
//!              keep-alive every interval; at the fence deadline (TTL − interval
//!              after the last acknowledged keep-alive) or "lease gone":
//!              ClusterSession{up: false} (Control fences all it owns), grant again
//! ops task     Action::ClaimOwnership  ──► put owner key on the lease ──► OwnershipGranted{revision} / OwnershipFailed
//!              Action::ReleaseOwnership ──► delete owner key if mod_revision == revision
//! watch task   range /iop/<cluster>/ at revision R, then watch from R + 1:
//!              owner key put / delete ──► OwnerObserved{node, revision, deleted}
//!              edge key put / delete  ──► the member list of the view
//!              fleet key put          ──► adopt, or compose with this Edge's file and
//!                                         apply (`server::apply`) or refuse
//!              no fleet key (range) / fleet key deleted ──► publish the fleet in force
//! reload       (SIGHUP) a changed fleet in the file ──► put the fleet key if its
//!              mod_revision is the newest seen; the rest of the file applies here
//! summaries    this Edge's capacity summary, and its peers' (`crate::cluster::summaries`)
//! ```
//!
//! The keyspace (`docs/multi-edge.md`):
//!
//! ```text
//! /iop/<cluster>/edges/<edge name>      {"client_addr", "node_addr", ["peer_addr"], "incarnation"}   this Edge's lease
//! /iop/<cluster>/nodes/<node id>/owner  {"edge", "incarnation", "conn"}               the owner Edge's lease
//! /iop/<cluster>/fleet                  {"source", "digest", "fleet"}                 no lease; mod_revision = fleet revision
//! ```
//!
//! Every decision stays in `Control` (sans-IO, `control::ownership`), in
//! [`LeaseSession`] (when the lease can no longer be proven) and in
//! [`FleetSync`] (which fleet runs, when to publish); this file only moves
//! their inputs and outputs.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_engine::clock;

use crate::cluster::etcd::{EtcdClient, EtcdConfig, EtcdError, EventKind, LeaseId, WatchMessage};
use crate::cluster::fleet::{
    self, Document, Fleet, FleetError, FleetSync, Published, Reloaded, Seen,
};
use crate::cluster::session::{LeaseSession, LostReason, Status};
use crate::config::{ClusterSpec, ConfigError, EdgeConfig};
use crate::control::Input;
use crate::link::edge::Edge;
use crate::link::ownership::OwnershipOp;
use crate::plane::cluster::ClusterView;
use crate::plane::running::digest_of;

/// Puts a configuration in force on this Edge and logs what changed
/// (`server::apply` at the next revision; the server room gives it, from
/// above). Called with the configuration, its digest, and what it is, for
/// the log.
pub type ApplyConfig = Box<dyn Fn(EdgeConfig, String, &str)>;

/// Pause before trying etcd again after a failed grant or a broken watch.
const RETRY: Duration = Duration::from_millis(500);

/// Where this Edge's keys live.
#[derive(Debug, Clone)]
struct Keys {
    /// `/iop/<cluster>/`.
    root: String,
}

impl Keys {
    fn edge(&self, name: &str) -> String {
        format!("{}edges/{name}", self.root)
    }

    fn owner(&self, node_id: &str) -> String {
        format!("{}nodes/{node_id}/owner", self.root)
    }

    fn fleet(&self) -> String {
        format!("{}fleet", self.root)
    }
}

/// What a key under the cluster's root names.
#[derive(Debug, PartialEq, Eq)]
enum KeyOf<'a> {
    Edge(&'a str),
    Owner(&'a str),
    Fleet,
    Other,
}

impl Keys {
    fn parse<'a>(&self, key: &'a [u8]) -> KeyOf<'a> {
        let Some(rest) = std::str::from_utf8(key)
            .ok()
            .and_then(|k| k.strip_prefix(self.root.as_str()))
        else {
            return KeyOf::Other;
        };
        if let Some(name) = rest.strip_prefix("edges/") {
            return KeyOf::Edge(name);
        }
        if rest == "fleet" {
            return KeyOf::Fleet;
        }
        match rest
            .strip_prefix("nodes/")
            .and_then(|r| r.strip_suffix("/owner"))
        {
            Some(node) if !node.is_empty() && !node.contains('/') => KeyOf::Owner(node),
            _ => KeyOf::Other,
        }
    }
}

/// The value of an owner key: which Edge (and which run of it) owns the
/// node, on which connection.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct OwnerValue {
    edge: String,
    incarnation: String,
    conn: u64,
}

/// The fleet decisions and this Edge's own part of its file.
#[derive(Debug)]
struct FleetShell {
    sync: FleetSync,
    /// This Edge's file without the fleet sections, as last read valid.
    local: toml::Table,
    /// The digest of that file's bytes: the running configuration's
    /// digest while its own fleet runs (as on a single Edge).
    file_digest: String,
}

/// This Edge as a member of its cluster (see the module docs).
pub struct Member {
    edge: Rc<Edge>,
    client: EtcdClient,
    view: Arc<ClusterView>,
    session: RefCell<LeaseSession>,
    keys: Keys,
    /// Random per process start: tells this run's keys from an earlier
    /// run's under the same Edge name.
    incarnation: String,
    /// What this Edge announces under its edge key.
    announce: String,
    /// Set by [`Member::leave`]: no lease is taken again.
    left: std::cell::Cell<bool>,
    /// What the process started with (its file's path; the sections only
    /// a restart applies are compared with it).
    started: EdgeConfig,
    fleet: RefCell<FleetShell>,
    apply: ApplyConfig,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("keys", &self.keys)
            .field("incarnation", &self.incarnation)
            .field("fleet", &self.fleet)
            .finish_non_exhaustive()
    }
}

/// Where this Edge is in its cluster, for [`Member::start`].
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    /// The client listener.
    pub client: SocketAddr,
    /// The node listener.
    pub node: SocketAddr,
    /// The peer listener, if any.
    pub peer: Option<SocketAddr>,
}

impl Member {
    /// Starts the member's tasks on the calling (control) shard. `started`
    /// is the configuration the process started with (its file is read
    /// again for this Edge's own part); `apply` puts a configuration in
    /// force. Errors name what in `[cluster]` cannot be used, or the file.
    pub fn start(
        edge: Rc<Edge>,
        started: &EdgeConfig,
        view: Arc<ClusterView>,
        addresses: Addresses,
        apply: ApplyConfig,
    ) -> Result<Rc<Self>, String> {
        let Addresses {
            client: client_addr,
            node: node_addr,
            peer: peer_addr,
        } = addresses;
        let spec: &ClusterSpec = started
            .cluster
            .as_ref()
            .ok_or("cluster: no [cluster] table")?;
        let text =
            iop_engine::config::read_config_file(&started.source).map_err(|e| e.to_string())?;
        let file = fleet::split(&text).map_err(|e| format!("{}: {e}", started.source.display()))?;
        let client = EtcdClient::new(EtcdConfig {
            call_timeout: Duration::from_millis(spec.etcd_timeout_ms),
            ..EtcdConfig::new(spec.etcd_endpoints.clone())
        })
        .map_err(|e| format!("cluster.etcd_endpoints: {e}"))?;
        let session = LeaseSession::new(
            Duration::from_secs(spec.lease_ttl_sec),
            Duration::from_secs(spec.keepalive_interval_sec),
        )
        .map_err(|e| format!("cluster: {e}"))?;
        let incarnation = format!("{:016x}", iop_engine::rng::SplitMix64::from_os().next_u64());
        let mut announce = serde_json::json!({
            "client_addr": client_addr.to_string(),
            "node_addr": node_addr.to_string(),
            "incarnation": incarnation,
        });
        // Other Edges forward requests for our nodes here (`[cluster]
        // peer_listen`); without it they never choose this Edge.
        if let Some(peer_addr) = peer_addr {
            announce["peer_addr"] = peer_addr.to_string().into();
        }
        let announce = announce.to_string();
        let sync = FleetSync::new(file.fleet);
        view.set_fleet(sync.status());
        let member = Rc::new(Self {
            edge,
            client,
            view,
            session: RefCell::new(session),
            keys: Keys {
                root: format!("/iop/{}/", spec.name),
            },
            incarnation,
            announce,
            left: std::cell::Cell::new(false),
            started: started.clone(),
            fleet: RefCell::new(FleetShell {
                sync,
                local: file.local,
                file_digest: digest_of(text.as_bytes()),
            }),
            apply,
        });
        monoio::spawn(member.clone().run_lease());
        monoio::spawn(member.clone().run_ops());
        monoio::spawn(member.clone().run_watch());
        crate::cluster::summaries::start(member.edge.clone(), member.view.clone());
        Ok(member)
    }

    /// Leaves the cluster at the end of a drain: revokes the lease (every
    /// key of this Edge goes at once) and stops claiming. Bounded by one
    /// etcd call timeout per endpoint; a failure leaves the keys to expire.
    pub async fn leave(&self) {
        let Status::Up { lease, .. } = self.status() else {
            return;
        };
        self.left.set(true);
        self.session.borrow_mut().release();
        self.set_up(false);
        match self.client.lease_revoke(lease).await {
            Ok(_) => tracing::info!(cluster = %self.view.name, "cluster: left (lease revoked)"),
            Err(e) => self.etcd_error("revoking the lease at exit", &e),
        }
    }

    fn status(&self) -> Status {
        self.session.borrow_mut().poll(clock::now())
    }

    fn set_up(&self, up: bool) {
        self.view.set_up(up);
        self.edge.apply(Input::ClusterSession { up });
    }

    fn etcd_error(&self, what: &str, error: &dyn std::fmt::Display) {
        self.view
            .counters
            .etcd_errors
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(cluster = %self.view.name, %error, "etcd: {what} failed");
    }

    /// Holds this Edge's lease for as long as the process runs.
    async fn run_lease(self: Rc<Self>) {
        while !self.left.get() {
            let Some(lease) = self.grant().await else {
                monoio::time::sleep(RETRY).await;
                continue;
            };
            self.view
                .counters
                .leases_granted
                .fetch_add(1, Ordering::Relaxed);
            let key = self.keys.edge(&self.view.edge_name);
            if let Err(e) = self
                .client
                .put_with_lease(key.as_bytes(), self.announce.as_bytes(), lease)
                .await
            {
                self.etcd_error("announcing this edge", &e);
            }
            tracing::info!(
                cluster = %self.view.name,
                edge = %self.view.edge_name,
                lease = lease.0,
                "cluster: lease granted, claiming nodes"
            );
            self.set_up(true);
            let reason = self.keep_alive().await;
            if self.left.get() {
                return;
            }
            self.view
                .counters
                .self_fences
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                cluster = %self.view.name,
                reason = ?reason,
                "cluster: the etcd lease can no longer be proven; fencing every node this edge owns"
            );
            self.set_up(false);
            // Best effort: if etcd is reachable after all, its keys go now
            // rather than at expiry.
            let _ = self.client.lease_revoke(lease).await;
            monoio::time::sleep(RETRY).await;
        }
    }

    async fn grant(&self) -> Option<LeaseId> {
        let (token, ttl_sec) = {
            let mut session = self.session.borrow_mut();
            (session.grant_sent(clock::now()), session.ttl_sec())
        };
        match self.client.lease_grant(ttl_sec).await {
            Ok(grant) => {
                let ttl = Duration::from_secs(u64::try_from(grant.ttl_sec).unwrap_or(0));
                match self
                    .session
                    .borrow_mut()
                    .grant_answered(token, grant.lease, ttl)
                {
                    Ok(()) => Some(grant.lease),
                    Err(e) => {
                        self.etcd_error("granting a lease", &e);
                        None
                    }
                }
            }
            Err(e) => {
                self.etcd_error("granting a lease", &e);
                None
            }
        }
    }

    /// Keeps the lease alive until it can no longer be proven; returns why.
    async fn keep_alive(&self) -> LostReason {
        loop {
            let (deadline, due) = match self.status() {
                Status::Up { deadline, .. } => {
                    let due = self.session.borrow().next_keepalive_at();
                    (deadline, due.unwrap_or(deadline))
                }
                Status::Lost { reason, .. } => return reason,
                Status::NotGranted => return LostReason::Released,
            };
            sleep_until(due.min(deadline)).await;
            let Some(token) = self.session.borrow_mut().keepalive_sent(clock::now()) else {
                continue;
            };
            // The deadline does not wait for a slow answer.
            let answer = monoio::select! {
                answer = self.client.lease_keepalive(token.lease()) => Some(answer),
                _ = sleep_until(deadline) => None,
            };
            let now = clock::now();
            let mut session = self.session.borrow_mut();
            match answer {
                Some(Ok(Some(ttl))) => session.keepalive_acked(
                    token,
                    Duration::from_secs(u64::try_from(ttl).unwrap_or(0)),
                    now,
                ),
                Some(Ok(None)) => session.keepalive_lease_gone(token, now),
                Some(Err(e)) => {
                    drop(session);
                    self.etcd_error("keeping the lease alive", &e);
                    self.session.borrow_mut().keepalive_failed(token, now);
                }
                None => session.keepalive_failed(token, now),
            }
        }
    }

    /// Carries out Control's claims and releases, each as its own task:
    /// their order does not matter (revisions decide).
    async fn run_ops(self: Rc<Self>) {
        loop {
            let ops = self.edge.ownership_ops.take();
            if ops.is_empty() {
                self.edge.ownership_ops.changed().await;
                continue;
            }
            for op in ops {
                monoio::spawn(self.clone().run_op(op));
            }
        }
    }

    async fn run_op(self: Rc<Self>, op: OwnershipOp) {
        match op {
            OwnershipOp::Claim { conn, node_id } => {
                let Status::Up { lease, .. } = self.status() else {
                    self.view
                        .counters
                        .claims_failed
                        .fetch_add(1, Ordering::Relaxed);
                    return self.edge.apply(Input::OwnershipFailed { conn });
                };
                let value = serde_json::to_vec(&OwnerValue {
                    edge: self.view.edge_name.clone(),
                    incarnation: self.incarnation.clone(),
                    conn: conn.0,
                })
                .unwrap_or_default();
                let key = self.keys.owner(&node_id);
                match self
                    .client
                    .put_with_lease(key.as_bytes(), &value, lease)
                    .await
                {
                    Ok(revision) => {
                        self.view
                            .counters
                            .claims_granted
                            .fetch_add(1, Ordering::Relaxed);
                        self.view
                            .owner_put(&node_id, &self.view.edge_name, revision as u64);
                        self.edge.apply(Input::OwnershipGranted {
                            conn,
                            node_id,
                            revision: u64::try_from(revision).unwrap_or(0),
                        });
                    }
                    Err(e) => {
                        self.view
                            .counters
                            .claims_failed
                            .fetch_add(1, Ordering::Relaxed);
                        self.etcd_error("claiming a node", &e);
                        self.edge.apply(Input::OwnershipFailed { conn });
                    }
                }
            }
            OwnershipOp::Release { node_id, revision } => {
                let key = self.keys.owner(&node_id);
                let revision = i64::try_from(revision).unwrap_or(i64::MAX);
                match self
                    .client
                    .delete_if_mod_revision(key.as_bytes(), revision)
                    .await
                {
                    Ok(true) => {
                        self.view.counters.releases.fetch_add(1, Ordering::Relaxed);
                    }
                    // A newer owner's key: not ours to delete.
                    Ok(false) => {}
                    Err(e) => self.etcd_error("releasing a node", &e),
                }
            }
        }
    }

    /// Follows every change under the cluster's root, from a consistent
    /// read on, for as long as the process runs.
    async fn run_watch(self: Rc<Self>) {
        let root = self.keys.root.clone();
        let mut next: Option<i64> = None;
        loop {
            let start = match next {
                Some(start) => start,
                None => match self.client.range_prefix(root.as_bytes()).await {
                    Ok(answer) => {
                        for kv in &answer.kvs {
                            self.seen(EventKind::Put, &kv.key, &kv.value, kv.mod_revision);
                        }
                        if !answer
                            .kvs
                            .iter()
                            .any(|kv| self.keys.parse(&kv.key) == KeyOf::Fleet)
                        {
                            let step = self.fleet.borrow_mut().sync.on_absent();
                            self.fleet_step(step);
                        }
                        answer.revision + 1
                    }
                    Err(e) => {
                        self.etcd_error("reading the cluster", &e);
                        monoio::time::sleep(RETRY).await;
                        continue;
                    }
                },
            };
            next = Some(start);
            let mut watch = match self.client.watch_prefix(root.as_bytes(), start).await {
                Ok(watch) => watch,
                Err(e) => {
                    self.etcd_error("watching the cluster", &e);
                    monoio::time::sleep(RETRY).await;
                    continue;
                }
            };
            loop {
                match watch.next().await {
                    Ok(WatchMessage::Events { events, .. }) => {
                        for event in events {
                            self.seen(event.kind, &event.key, &event.value, event.mod_revision);
                            next = Some(event.mod_revision + 1);
                        }
                    }
                    Ok(WatchMessage::Created { .. } | WatchMessage::Progress { .. }) => {}
                    Ok(WatchMessage::Canceled {
                        compact_revision,
                        reason,
                    }) => {
                        tracing::warn!(compact_revision, %reason, "etcd: the watch was cancelled");
                        if compact_revision > 0 {
                            // Missed history: read the whole state again.
                            next = None;
                        }
                        break;
                    }
                    Err(e) => {
                        self.etcd_error("following the watch", &e);
                        break;
                    }
                }
            }
            self.view
                .counters
                .watch_restarts
                .fetch_add(1, Ordering::Relaxed);
            monoio::time::sleep(RETRY).await;
        }
    }

    /// One change of a key under the root, in revision order.
    fn seen(self: &Rc<Self>, kind: EventKind, key: &[u8], value: &[u8], revision: i64) {
        let revision = u64::try_from(revision).unwrap_or(0);
        match self.keys.parse(key) {
            KeyOf::Owner(node_id) => {
                let deleted = kind == EventKind::Delete;
                if deleted {
                    self.view.owner_deleted(node_id, revision);
                } else {
                    let edge = serde_json::from_slice::<OwnerValue>(value)
                        .map(|v| v.edge)
                        .unwrap_or_else(|_| "?".to_string());
                    self.view.owner_put(node_id, &edge, revision);
                }
                self.edge.apply(Input::OwnerObserved {
                    node_id: node_id.to_string(),
                    revision,
                    deleted,
                });
            }
            KeyOf::Edge(name) => {
                let value =
                    (kind == EventKind::Put).then(|| String::from_utf8_lossy(value).into_owned());
                self.view.edge_seen(name, value);
                // Every key's limits are shared by the live Edges.
                let (edges, rank) = self.view.share();
                self.edge
                    .settings
                    .client_keys
                    .set_cluster_share(edges, rank);
            }
            KeyOf::Fleet => self.fleet_seen(kind, value, revision),
            KeyOf::Other => {}
        }
    }

    /// The fleet key changed (see `crate::cluster::fleet`).
    fn fleet_seen(self: &Rc<Self>, kind: EventKind, value: &[u8], revision: u64) {
        let step = if kind == EventKind::Delete {
            tracing::warn!(
                cluster = %self.view.name,
                revision,
                "cluster: the fleet key was deleted; the running fleet stays and is published again"
            );
            self.fleet.borrow_mut().sync.on_deleted()
        } else {
            match Document::decode(value) {
                Ok((source, fleet)) => self.fleet.borrow_mut().sync.on_put(Published {
                    revision,
                    source,
                    fleet,
                }),
                Err(e) => {
                    let news = self
                        .fleet
                        .borrow_mut()
                        .sync
                        .on_malformed(revision, e.to_string());
                    if news {
                        self.fleet_refused(revision, "?", &e);
                    }
                    return;
                }
            }
        };
        self.fleet_step(step);
    }

    /// Carries out what [`FleetSync`] decided.
    fn fleet_step(self: &Rc<Self>, step: Seen) {
        match step {
            Seen::Nothing => {}
            Seen::Adopted => {
                let in_force = self.fleet.borrow().sync.in_force().clone();
                tracing::info!(
                    cluster = %self.view.name,
                    fleet_revision = in_force.revision,
                    source = %in_force.source,
                    "cluster: fleet revision in force (the fleet this Edge runs already)"
                );
                self.fleet_changed();
            }
            Seen::Apply(published) => self.apply_published(published),
            Seen::Publish { fleet } => {
                let member = self.clone();
                monoio::spawn(async move {
                    match member.publish(&fleet, 0).await {
                        Ok(Some(revision)) => tracing::info!(
                            cluster = %member.view.name,
                            fleet_revision = revision,
                            "cluster: the cluster had no fleet; published the one this Edge runs"
                        ),
                        // Another Edge published first: the watch brings it.
                        Ok(None) => {}
                        Err(e) => member.etcd_error("publishing the fleet", &e),
                    }
                });
            }
        }
    }

    /// Applies a published fleet with this Edge's own part of its file, or
    /// refuses it (the running fleet stays).
    fn apply_published(&self, published: Published) {
        let composed = {
            let shell = self.fleet.borrow();
            fleet::compose(&shell.local, &published.fleet, &self.started.source)
        };
        let checked = composed.and_then(|(mut config, composed_text)| {
            config.load_provider_cas().map_err(FleetError::Invalid)?;
            config.check_open_access().map_err(FleetError::Invalid)?;
            Ok((config, composed_text))
        });
        match checked {
            Ok((config, composed_text)) => {
                let (file_differs, digest) = {
                    let mut shell = self.fleet.borrow_mut();
                    shell.sync.applied(published.clone());
                    let file_differs = shell.sync.file() != &published.fleet;
                    // Its own file's fleet: the file itself runs.
                    let digest = if file_differs {
                        digest_of(composed_text.as_bytes())
                    } else {
                        shell.file_digest.clone()
                    };
                    (file_differs, digest)
                };
                (self.apply)(
                    config,
                    digest,
                    &format!(
                        "cluster: fleet revision {} (published by {}) applied",
                        published.revision, published.source
                    ),
                );
                if file_differs {
                    tracing::warn!(
                        cluster = %self.view.name,
                        fleet_revision = published.revision,
                        file = %self.started.source.display(),
                        "cluster: this Edge's file says another fleet than the cluster's; the \
                         cluster's is in force (edit the file's fleet sections and reload to publish one)"
                    );
                }
                self.fleet_changed();
            }
            Err(e) => {
                let news = {
                    let mut shell = self.fleet.borrow_mut();
                    let news = shell
                        .sync
                        .status()
                        .refused
                        .is_none_or(|r| r.revision != published.revision);
                    shell.sync.refused(published.revision, e.to_string());
                    news
                };
                if news {
                    self.fleet_refused(published.revision, &published.source, &e);
                } else {
                    self.fleet_changed();
                }
            }
        }
    }

    fn fleet_refused(&self, revision: u64, source: &str, error: &FleetError) {
        self.view
            .counters
            .fleet_refused
            .fetch_add(1, Ordering::Relaxed);
        let in_force = self.fleet.borrow().sync.in_force().revision;
        tracing::error!(
            cluster = %self.view.name,
            fleet_revision = revision,
            source,
            running_fleet_revision = in_force,
            error = %error,
            "cluster: fleet revision {revision} refused; the running fleet stays"
        );
        self.fleet_changed();
    }

    fn fleet_changed(&self) {
        self.view.set_fleet(self.fleet.borrow().sync.status());
    }

    /// Puts `fleet` as the cluster's if the key's `mod_revision` is still
    /// `expected`: its revision, or `None` if another Edge published since.
    async fn publish(&self, fleet: &Fleet, expected: u64) -> Result<Option<u64>, PublishError> {
        let value = Document::of(fleet, &self.view.edge_name)
            .encode()
            .map_err(PublishError::Fleet)?;
        let expected = i64::try_from(expected).unwrap_or(i64::MAX);
        let put = self
            .client
            .put_if_mod_revision(self.keys.fleet().as_bytes(), &value, expected)
            .await
            .map_err(PublishError::Etcd)?;
        Ok(put.map(|revision| u64::try_from(revision).unwrap_or(0)))
    }

    /// SIGHUP in a cluster: reads the file at `path` and validates it as a
    /// single Edge does (an invalid file changes nothing and returns its
    /// error). If its fleet changed, it is published for every Edge, this
    /// one included, to apply from the watch; the rest of the file applies
    /// here at once, with the fleet in force. Returns the file as loaded
    /// (its certificate paths).
    pub async fn reload(
        self: &Rc<Self>,
        path: &std::path::Path,
    ) -> Result<EdgeConfig, ConfigError> {
        let text = iop_engine::config::read_config_file(path)?;
        // As on a single Edge: a log path that cannot be opened keeps its
        // log (`server::apply`), the rest applies.
        let next = EdgeConfig::load_structure(path)?;
        next.check_open_access()?;
        let file = fleet::split(&text).map_err(|e| ConfigError::new(path, "-", e.to_string()))?;
        let step = self.fleet.borrow().sync.on_reload(&file.fleet);
        // This Edge's own part from now on: a fleet the watch applies while
        // the put below is under way composes with it.
        let previous_local = {
            let mut shell = self.fleet.borrow_mut();
            let digest = digest_of(text.as_bytes());
            (
                std::mem::replace(&mut shell.local, file.local.clone()),
                std::mem::replace(&mut shell.file_digest, digest),
            )
        };
        let mut published = None;
        match step {
            Reloaded::Unchanged => self.fleet.borrow_mut().sync.file_read(file.fleet.clone()),
            Reloaded::Stale { in_force } => {
                self.fleet.borrow_mut().sync.file_read(file.fleet.clone());
                tracing::warn!(
                    cluster = %self.view.name,
                    fleet_revision = in_force,
                    "cluster: the file's fleet differs from the cluster's fleet in force; not \
                     published, as its fleet sections did not change since this Edge last read \
                     them (edit them to publish a fleet)"
                );
            }
            Reloaded::Publish { expected } => {
                // Read already when the watch brings the fleet back (it
                // may before the put's answer); taken back if not put.
                let previous_file = self.fleet.borrow().sync.file().clone();
                self.fleet.borrow_mut().sync.file_read(file.fleet.clone());
                let outcome = self.publish(&file.fleet, expected).await;
                if !matches!(outcome, Ok(Some(_))) {
                    self.fleet.borrow_mut().sync.file_read(previous_file);
                    self.fleet_changed();
                }
                match outcome {
                    Ok(Some(revision)) => {
                        published = Some(revision);
                        tracing::info!(
                            cluster = %self.view.name,
                            fleet_revision = revision,
                            digest = %file.fleet.digest(),
                            "cluster: the file's fleet published; every Edge applies it from etcd"
                        );
                    }
                    Ok(None) => tracing::warn!(
                        cluster = %self.view.name,
                        expected_fleet_revision = expected,
                        "cluster: the file's fleet not published: another Edge published a fleet \
                         since this Edge's newest (it applies from the watch); check the file \
                         against it and reload again"
                    ),
                    Err(e) => {
                        if let PublishError::Etcd(e) = &e {
                            self.etcd_error("publishing the fleet", e);
                        }
                        tracing::error!(
                            cluster = %self.view.name,
                            error = %e,
                            "cluster: the file's fleet not published; reload again to retry"
                        );
                    }
                }
            }
        }
        self.fleet_changed();
        // The rest of the file, with the fleet in force now.
        let (composed, file_fleet_in_force, in_force) = {
            let shell = self.fleet.borrow();
            let in_force = shell.sync.in_force();
            (
                fleet::compose(&shell.local, &in_force.fleet, path),
                in_force.fleet == file.fleet,
                in_force.revision,
            )
        };
        let checked = composed.and_then(|(mut config, text)| {
            config.load_provider_cas().map_err(FleetError::Invalid)?;
            Ok((config, text))
        });
        match checked {
            Ok((config, composed_text)) => {
                // The file itself runs: its digest, as on a single Edge.
                let digest = if file_fleet_in_force {
                    self.fleet.borrow().file_digest.clone()
                } else {
                    digest_of(composed_text.as_bytes())
                };
                (self.apply)(config, digest, "configuration reloaded");
            }
            Err(e) if published.is_some() => tracing::info!(
                cluster = %self.view.name,
                reason = %e,
                "cluster: the rest of the file applies with the fleet just published"
            ),
            Err(e) => {
                let mut shell = self.fleet.borrow_mut();
                (shell.local, shell.file_digest) = previous_local;
                drop(shell);
                let reason = format!("with the cluster's fleet revision {in_force}: {e}");
                return Err(match e {
                    FleetError::Invalid(inner) => ConfigError::new(
                        path,
                        inner.key(),
                        format!(
                            "{} (with the cluster's fleet revision {in_force})",
                            inner.reason()
                        ),
                    ),
                    _ => ConfigError::new(path, "-", reason),
                });
            }
        }
        // A published fleet refused here may fit the file now.
        let pending = self.fleet.borrow().sync.pending();
        if let Some(published) = pending {
            self.apply_published(published);
        }
        Ok(next)
    }
}

/// Why a fleet was not published.
#[derive(Debug, thiserror::Error)]
enum PublishError {
    /// It cannot be encoded (too large).
    #[error("{0}")]
    Fleet(FleetError),
    /// etcd did not take it.
    #[error("{0}")]
    Etcd(EtcdError),
}

async fn sleep_until(at: Instant) {
    monoio::time::sleep(at.saturating_duration_since(clock::now())).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_edges_and_owners_under_the_cluster_root_only() {
        let keys = Keys {
            root: "/iop/c1/".into(),
        };
        assert_eq!(keys.owner("gpu-1"), "/iop/c1/nodes/gpu-1/owner");
        assert_eq!(keys.edge("edge-a"), "/iop/c1/edges/edge-a");
        assert_eq!(
            keys.parse(b"/iop/c1/nodes/gpu-1/owner"),
            KeyOf::Owner("gpu-1")
        );
        assert_eq!(keys.parse(b"/iop/c1/edges/edge-a"), KeyOf::Edge("edge-a"));
        assert_eq!(keys.fleet(), "/iop/c1/fleet");
        assert_eq!(keys.parse(b"/iop/c1/fleet"), KeyOf::Fleet);
        for other in [
            &b"/iop/c2/nodes/gpu-1/owner"[..],
            b"/iop/c1/nodes//owner",
            b"/iop/c1/nodes/a/b/owner",
            b"/iop/c1/nodes/gpu-1",
            b"/iop/c1/config/revision",
            b"/iop/c1/fleet/x",
            b"/iop/c2/fleet",
            b"\xff\xfe",
        ] {
            assert_eq!(keys.parse(other), KeyOf::Other, "{other:?}");
        }
    }
}
