//! What every shard may read of this Edge's place in a cluster: whether it
//! holds its etcd lease (`/readyz`), which Edge owns which node (from the
//! watch; `/status`), the other Edges, the capacity summaries (this Edge's
//! own and its peers', for the forwarding decision), the fleet revision in
//! force, and the counters of `/metrics`.
//! Written by the cluster shell on the control shard (`crate::cluster`),
//! read anywhere; `None` in [`crate::link::settings::Settings`] for a
//! single Edge.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::control::{ModelCapacity, Operation};

/// One Edge's capacity summary: what each of its models has free, by
/// model name.
pub type CapacitySummary = BTreeMap<String, ModelCapacity>;

/// A peer's summary as last received.
#[derive(Debug)]
struct PeerSummary {
    received_at: Instant,
    summary: Arc<CapacitySummary>,
}

/// Free slots for one model and operation, here and at the peers whose
/// summary is fresh ([`ClusterView::free_slots`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FreeSlots {
    /// This Edge's, from its own latest summary.
    pub here: u32,
    /// Each peer's with at least one, by name.
    pub peers: BTreeMap<String, u32>,
}

/// Who owns a node, as the watch last saw its owner key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeOwner {
    /// The owning Edge's name.
    pub edge: String,
    /// The key's revision (the owner's generation; never shown to clients,
    /// R5).
    pub revision: u64,
}

/// The cluster's fleet as this Edge runs it (`crate::cluster::fleet`), for
/// `/status` and `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FleetView {
    /// The fleet revision in force (0: this Edge's file's, not seen in
    /// etcd yet).
    pub revision: u64,
    /// The digest of the fleet in force.
    pub digest: String,
    /// The Edge that published the fleet in force (empty for revision 0).
    pub source: String,
    /// The newest fleet revision seen in etcd (0: none).
    pub latest_revision: u64,
    /// Whether this Edge's file says another fleet than the one in force.
    pub file_differs: bool,
    /// The newest published fleet this Edge refused, while it is newer
    /// than the one in force.
    pub refused: Option<FleetRefusal>,
}

/// A published fleet this Edge refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetRefusal {
    /// Its fleet revision.
    pub revision: u64,
    /// Why.
    pub reason: String,
}

/// Counters of the cluster shell, cumulative.
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// etcd calls that failed (every endpoint, or an error answer).
    pub etcd_errors: AtomicU64,
    /// Ownership claims that committed.
    pub claims_granted: AtomicU64,
    /// Ownership claims that did not commit.
    pub claims_failed: AtomicU64,
    /// Owner keys deleted on a clean release.
    pub releases: AtomicU64,
    /// Times this Edge fenced everything it owned because it could no
    /// longer prove its etcd lease.
    pub self_fences: AtomicU64,
    /// Leases granted (the first, and one after each loss).
    pub leases_granted: AtomicU64,
    /// Times the watch was established again after it broke.
    pub watch_restarts: AtomicU64,
    /// Requests this Edge served for peers (arrived on its peer listener).
    pub peer_requests: AtomicU64,
    /// Requests forwarded to peers, by target Edge and outcome.
    forwarded: Mutex<BTreeMap<(String, Forwarded), u64>>,
    /// Requests forwarded because this Edge owns no node of their model.
    pub forwarded_no_local_node: AtomicU64,
    /// Requests forwarded because this Edge's own nodes of their model had
    /// no free slot and a peer's had.
    pub forwarded_local_full: AtomicU64,
    /// Polls of a peer's capacity summary that failed (no answer in time,
    /// an error status, or a summary that does not parse).
    pub summary_poll_failures: AtomicU64,
    /// Published fleets this Edge refused (they did not validate with its
    /// own file, or did not decode).
    pub fleet_refused: AtomicU64,
}

/// How a request forwarded to a peer Edge went, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Forwarded {
    /// The peer answered (whatever the client did with the answer).
    Ok,
    /// No Edge could be reached before the request was written; counted
    /// against each Edge tried.
    Unavailable,
    /// The request was written, then the peer's answer broke off (or
    /// never came).
    Failed,
}

impl Forwarded {
    /// The `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Unavailable => "unavailable",
            Self::Failed => "failed",
        }
    }
}

impl ClusterCounters {
    /// Counts a request forwarded to `edge` that ended as `outcome`.
    pub fn forwarded(&self, edge: &str, outcome: Forwarded) {
        *lock(&self.forwarded)
            .entry((edge.to_string(), outcome))
            .or_insert(0) += 1;
    }

    /// Forwarded requests by target Edge and outcome, in that order.
    pub fn forwarded_totals(&self) -> Vec<(String, Forwarded, u64)> {
        lock(&self.forwarded)
            .iter()
            .map(|((edge, outcome), n)| (edge.clone(), *outcome, *n))
            .collect()
    }
}

/// One Edge's view of its cluster.
#[derive(Debug)]
pub struct ClusterView {
    /// The cluster's name (`[cluster] name`).
    pub name: String,
    /// This Edge's name (`[edge] name`).
    pub edge_name: String,
    up: AtomicBool,
    owners: Mutex<BTreeMap<String, NodeOwner>>,
    edges: Mutex<BTreeMap<String, String>>,
    /// The peer listener each Edge announced (`peer_addr`), for those that
    /// have one.
    peers: Mutex<BTreeMap<String, SocketAddr>>,
    /// This Edge's capacity summary, as last computed from Control.
    local_capacity: Mutex<Arc<CapacitySummary>>,
    /// The peers' summaries, by Edge name.
    peer_capacity: Mutex<BTreeMap<String, PeerSummary>>,
    /// The fleet in force.
    fleet: Mutex<FleetView>,
    /// The shell's counters.
    pub counters: ClusterCounters,
}

impl ClusterView {
    /// The view of a member that holds no lease yet.
    pub fn new(name: &str, edge_name: &str) -> Self {
        Self {
            name: name.to_string(),
            edge_name: edge_name.to_string(),
            up: AtomicBool::new(false),
            owners: Mutex::new(BTreeMap::new()),
            edges: Mutex::new(BTreeMap::new()),
            peers: Mutex::new(BTreeMap::new()),
            local_capacity: Mutex::new(Arc::new(CapacitySummary::new())),
            peer_capacity: Mutex::new(BTreeMap::new()),
            fleet: Mutex::new(FleetView::default()),
            counters: ClusterCounters::default(),
        }
    }

    /// Whether this Edge holds its etcd lease (it may own nodes and
    /// dispatch).
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Records whether the lease is held.
    pub fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::Release);
    }

    /// The watch saw `node`'s owner key written by `edge` at `revision`.
    pub fn owner_put(&self, node: &str, edge: &str, revision: u64) {
        let mut owners = lock(&self.owners);
        if owners.get(node).is_none_or(|o| o.revision < revision) {
            owners.insert(
                node.to_string(),
                NodeOwner {
                    edge: edge.to_string(),
                    revision,
                },
            );
        }
    }

    /// The watch saw `node`'s owner key deleted at `revision`.
    pub fn owner_deleted(&self, node: &str, revision: u64) {
        let mut owners = lock(&self.owners);
        if owners.get(node).is_some_and(|o| o.revision < revision) {
            owners.remove(node);
        }
    }

    /// Every owned node with its owner, in node order.
    pub fn owners(&self) -> BTreeMap<String, NodeOwner> {
        lock(&self.owners).clone()
    }

    /// The owning Edge of each of `nodes`, in their order (`None`: no
    /// owner): one look-up per node, for a request's route.
    pub fn owners_of(&self, nodes: &[String]) -> Vec<Option<String>> {
        let owners = lock(&self.owners);
        nodes
            .iter()
            .map(|node| owners.get(node).map(|o| o.edge.clone()))
            .collect()
    }

    /// The watch saw Edge `name` announce itself (`value`: its announced
    /// addresses, as JSON text), or leave (`None`).
    pub fn edge_seen(&self, name: &str, value: Option<String>) {
        let peer = value.as_deref().and_then(announced_peer_addr);
        {
            let mut peers = lock(&self.peers);
            match peer {
                Some(addr) => peers.insert(name.to_string(), addr),
                None => peers.remove(name),
            };
        }
        if value.is_none() {
            self.peer_capacity_lost(name);
        }
        let mut edges = lock(&self.edges);
        match value {
            Some(value) => edges.insert(name.to_string(), value),
            None => edges.remove(name),
        };
    }

    /// Replaces this Edge's capacity summary; whether it changed.
    pub fn set_local_capacity(&self, summary: CapacitySummary) -> bool {
        let mut local = lock(&self.local_capacity);
        if **local == summary {
            return false;
        }
        *local = Arc::new(summary);
        true
    }

    /// This Edge's capacity summary, as last computed (what its peers
    /// are shown).
    pub fn local_capacity(&self) -> Arc<CapacitySummary> {
        lock(&self.local_capacity).clone()
    }

    /// Peer `edge`'s summary arrived at `now` (none is kept under this
    /// Edge's own name).
    pub fn peer_capacity_seen(&self, edge: &str, summary: CapacitySummary, now: Instant) {
        if edge == self.edge_name {
            return;
        }
        lock(&self.peer_capacity).insert(
            edge.to_string(),
            PeerSummary {
                received_at: now,
                summary: Arc::new(summary),
            },
        );
    }

    /// Peer `edge`'s summary could not be had (or it left): it counts as
    /// having nothing free until the next one arrives.
    pub fn peer_capacity_lost(&self, edge: &str) {
        lock(&self.peer_capacity).remove(edge);
    }

    /// The free slots for requests of `op` to `model`: this Edge's, and
    /// those of every peer whose summary arrived within `max_age` before
    /// `now` and shows at least one (older summaries count as nothing
    /// free).
    pub fn free_slots(
        &self,
        model: &str,
        op: Operation,
        now: Instant,
        max_age: Duration,
    ) -> FreeSlots {
        let here = lock(&self.local_capacity)
            .get(model)
            .map_or(0, |m| m.free_for(op));
        let peers = lock(&self.peer_capacity)
            .iter()
            .filter(|(_, peer)| now.saturating_duration_since(peer.received_at) <= max_age)
            .filter_map(|(name, peer)| {
                let free = peer.summary.get(model)?.free_for(op);
                (free > 0).then(|| (name.clone(), free))
            })
            .collect();
        FreeSlots { here, peers }
    }

    /// Each peer's last summary: how long ago it arrived at `now`, and the
    /// summary (for `/status`).
    pub fn peer_capacities(
        &self,
        now: Instant,
    ) -> BTreeMap<String, (Duration, Arc<CapacitySummary>)> {
        lock(&self.peer_capacity)
            .iter()
            .map(|(name, peer)| {
                (
                    name.clone(),
                    (
                        now.saturating_duration_since(peer.received_at),
                        peer.summary.clone(),
                    ),
                )
            })
            .collect()
    }

    /// The Edges that announced a peer listener, by name.
    pub fn peer_addrs(&self) -> BTreeMap<String, SocketAddr> {
        lock(&self.peers).clone()
    }

    /// The live Edges (this one included once announced), by name, with
    /// what each announced.
    pub fn edges(&self) -> BTreeMap<String, String> {
        lock(&self.edges).clone()
    }

    /// How many live Edges share the cluster's limits, and this Edge's
    /// rank among them in name order (this Edge counted even before its
    /// own announcement is seen).
    pub fn share(&self) -> (u32, u32) {
        let edges = lock(&self.edges);
        let others_before = edges
            .keys()
            .filter(|name| name.as_str() < self.edge_name.as_str())
            .count();
        let total = edges.len() + usize::from(!edges.contains_key(&self.edge_name));
        (
            u32::try_from(total).unwrap_or(u32::MAX),
            u32::try_from(others_before).unwrap_or(u32::MAX),
        )
    }

    /// Records where this Edge stands with the cluster's fleet.
    pub fn set_fleet(&self, fleet: FleetView) {
        *lock(&self.fleet) = fleet;
    }

    /// The fleet in force, as last recorded.
    pub fn fleet(&self) -> FleetView {
        lock(&self.fleet).clone()
    }

    /// Nodes owned per Edge name, for `/metrics`.
    pub fn nodes_per_edge(&self) -> BTreeMap<String, u64> {
        let mut counts = BTreeMap::new();
        for owner in lock(&self.owners).values() {
            *counts.entry(owner.edge.clone()).or_insert(0) += 1;
        }
        counts
    }
}

/// The `peer_addr` of an Edge's announcement (`{"client_addr", "node_addr",
/// "peer_addr", "incarnation"}`), if it has a valid one.
fn announced_peer_addr(value: &str) -> Option<SocketAddr> {
    let announced: serde_json::Value = serde_json::from_str(value).ok()?;
    announced.get("peer_addr")?.as_str()?.parse().ok()
}

/// The map behind `mutex`, also after a panic elsewhere poisoned it (the
/// maps are replaced entry by entry and stay consistent).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_event_never_replaces_a_newer_owner() {
        let view = ClusterView::new("c", "e1");
        view.owner_put("n1", "e1", 5);
        view.owner_put("n1", "e2", 9);
        view.owner_put("n1", "e1", 7);
        view.owner_deleted("n1", 8);
        assert_eq!(
            view.owners().get("n1"),
            Some(&NodeOwner {
                edge: "e2".into(),
                revision: 9
            })
        );
        view.owner_deleted("n1", 10);
        assert_eq!(view.owners().get("n1"), None);
        view.owner_put("n2", "e1", 11);
        view.owner_put("n3", "e1", 12);
        assert_eq!(
            view.nodes_per_edge(),
            BTreeMap::from([("e1".to_string(), 2)])
        );
        assert_eq!(
            view.owners_of(&["n2".into(), "n1".into(), "n3".into()]),
            [Some("e1".to_string()), None, Some("e1".to_string())]
        );
    }

    #[test]
    fn peer_addresses_come_from_the_announcements_that_carry_a_valid_one() {
        let view = ClusterView::new("c", "e1");
        view.edge_seen(
            "e1",
            Some(
                r#"{"client_addr":"127.0.0.1:1","node_addr":"127.0.0.1:2","incarnation":"x"}"#
                    .into(),
            ),
        );
        view.edge_seen(
            "e2",
            Some(r#"{"client_addr":"127.0.0.1:1","peer_addr":"127.0.0.1:7444"}"#.into()),
        );
        view.edge_seen("e3", Some(r#"{"peer_addr":"not an address"}"#.into()));
        view.edge_seen("e4", Some("not json".into()));
        let e2: SocketAddr = "127.0.0.1:7444".parse().unwrap();
        assert_eq!(view.peer_addrs(), BTreeMap::from([("e2".to_string(), e2)]));
        assert_eq!(view.edges().len(), 4);
        // Announced again without one, then gone.
        view.edge_seen("e2", Some(r#"{"client_addr":"127.0.0.1:1"}"#.into()));
        assert_eq!(view.peer_addrs(), BTreeMap::new());
        view.edge_seen("e2", Some(r#"{"peer_addr":"127.0.0.1:7444"}"#.into()));
        view.edge_seen("e2", None);
        assert_eq!(view.peer_addrs(), BTreeMap::new());
        assert_eq!(view.edges().len(), 3);
    }

    /// The first four operations' free slots (the others have none).
    fn capacity(first: [u32; 4], queued: u32) -> ModelCapacity {
        let mut free_slots = [0; crate::control::Operation::ALL.len()];
        free_slots[..4].copy_from_slice(&first);
        ModelCapacity { free_slots, queued }
    }

    #[test]
    fn free_slots_come_from_this_edges_summary_and_the_fresh_ones_of_peers() {
        let view = ClusterView::new("c", "e1");
        let t0 = iop_engine::clock::now();
        let max_age = Duration::from_millis(1000);
        // Nothing known yet: nothing free anywhere.
        assert_eq!(
            view.free_slots("m", Operation::ChatCompletions, t0, max_age),
            FreeSlots::default()
        );
        assert!(view.set_local_capacity(BTreeMap::from([(
            "m".to_string(),
            capacity([2, 0, 0, 0], 0)
        )])));
        // The same summary again is no change.
        assert!(!view.set_local_capacity(BTreeMap::from([(
            "m".to_string(),
            capacity([2, 0, 0, 0], 0)
        )])));
        view.peer_capacity_seen(
            "e2",
            BTreeMap::from([("m".to_string(), capacity([1, 1, 1, 1], 0))]),
            t0,
        );
        view.peer_capacity_seen(
            "e3",
            BTreeMap::from([
                ("m".to_string(), capacity([0, 3, 3, 3], 4)),
                ("other".to_string(), capacity([5, 5, 5, 5], 0)),
            ]),
            t0 + Duration::from_millis(600),
        );
        // No summary is kept for this Edge as a peer.
        view.peer_capacity_seen(
            "e1",
            BTreeMap::from([("m".to_string(), capacity([9, 9, 9, 9], 0))]),
            t0,
        );
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(
            view.free_slots("m", Operation::ChatCompletions, at(1000), max_age),
            FreeSlots {
                here: 2,
                peers: BTreeMap::from([("e2".to_string(), 1)]),
            }
        );
        assert_eq!(
            view.free_slots("m", Operation::Responses, at(1000), max_age),
            FreeSlots {
                here: 0,
                peers: BTreeMap::from([("e2".to_string(), 1), ("e3".to_string(), 3)]),
            }
        );
        // e2's summary is now older than the limit: nothing free there.
        assert_eq!(
            view.free_slots("m", Operation::Responses, at(1001), max_age),
            FreeSlots {
                here: 0,
                peers: BTreeMap::from([("e3".to_string(), 3)]),
            }
        );
        // A model a peer does not list has nothing free there.
        assert_eq!(
            view.free_slots("absent", Operation::Responses, at(1000), max_age),
            FreeSlots::default()
        );
        let ages: Vec<(String, Duration)> = view
            .peer_capacities(at(1000))
            .into_iter()
            .map(|(name, (age, _))| (name, age))
            .collect();
        assert_eq!(
            ages,
            [
                ("e2".to_string(), Duration::from_millis(1000)),
                ("e3".to_string(), Duration::from_millis(400)),
            ]
        );
        // A lost poll, or the peer leaving the cluster, drops its summary.
        view.peer_capacity_lost("e3");
        view.edge_seen("e2", Some("{}".into()));
        view.edge_seen("e2", None);
        assert_eq!(
            view.free_slots("m", Operation::Responses, at(0), max_age),
            FreeSlots::default()
        );
    }

    #[test]
    fn the_share_counts_this_edge_and_ranks_it_by_name() {
        let view = ClusterView::new("c", "e2");
        assert_eq!(view.share(), (1, 0));
        view.edge_seen("e3", Some("{}".into()));
        view.edge_seen("e1", Some("{}".into()));
        assert_eq!(view.share(), (3, 1));
        view.edge_seen("e2", Some("{}".into()));
        assert_eq!(view.share(), (3, 1));
        view.edge_seen("e1", None);
        assert_eq!(view.share(), (2, 0));
    }
}
