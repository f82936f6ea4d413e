//! What every shard may read of this Edge's place in a cluster: whether it
//! holds its etcd lease (`/readyz`), which Edge owns which node (from the
//! watch; `/status`), the other Edges, and the counters of `/metrics`.
//! Written by the cluster shell on the control shard (`crate::cluster`),
//! read anywhere; `None` in [`crate::link::settings::Settings`] for a
//! single Edge.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Who owns a node, as the watch last saw its owner key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeOwner {
    /// The owning Edge's name.
    pub edge: String,
    /// The key's revision (the owner's generation; never shown to clients,
    /// R5).
    pub revision: u64,
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
        let mut edges = lock(&self.edges);
        match value {
            Some(value) => edges.insert(name.to_string(), value),
            None => edges.remove(name),
        };
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
