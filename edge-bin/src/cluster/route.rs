//! Where a request for a model is served in a cluster: here, or on another
//! Edge (`docs/multi-edge.md`, "A request for a provider on another
//! Edge"). Sans-IO: the caller reads the owners, the announced peer
//! addresses and the free slots (this Edge's own summary and its peers'
//! fresh ones, [`crate::cluster::summaries`]) from its
//! [`crate::plane::cluster::ClusterView`] and acts on the [`Route`].
//!
//! ```text
//! a free slot here ──► Local
//! else a peer with a free slot ──► Forward{target: the peer with the most free
//!     slots (ties: name order), fallbacks: the other peers with free slots in
//!     that order, then the other owning Edges (most nodes first)}
//!     reason: LocalFull when a node of the model is owned here, else NoLocalNode
//! else (nobody has a free slot):
//!     a node of the model owned here, or none owned by anyone ──► Local
//!         (queued here as on a single Edge: its nodes may register here)
//!     owned elsewhere only ──► Forward{target: the Edge owning the most of them
//!         (ties: name order), fallbacks: the other owners}, reason NoLocalNode
//! only Edges that announced a peer address are chosen; with none of them
//! left the request stays Local (and waits as it did before)
//! ```
//!
//! A request that came from a peer is never routed again (the caller does
//! not ask): it is always served where it arrived.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::plane::cluster::FreeSlots;

/// An Edge a request can be forwarded to: its name (its certificate's
/// identity) and its peer listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerEdge {
    /// The Edge's name (`spiffe://<td>/edge/<name>`).
    pub name: String,
    /// Its announced `peer_addr`.
    pub addr: SocketAddr,
}

/// Why a request is forwarded rather than served here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ForwardReason {
    /// This Edge owns no node of the model.
    NoLocalNode,
    /// This Edge owns some, but none has a free slot, and a peer's has.
    LocalFull,
}

impl ForwardReason {
    /// The `reason` label of `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoLocalNode => "no_local_node",
            Self::LocalFull => "local_full",
        }
    }
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Admitted through this Edge's Control.
    Local,
    /// No Edge owns any node of the model now (its nodes are moving
    /// between Edges, or offline): neither queueing here nor forwarding
    /// can place it yet; ask again shortly.
    Unowned,
    /// Forwarded to `target`; when `target` cannot be reached before the
    /// request is written, to each of `fallbacks` in order.
    Forward {
        /// The peer with the most free slots, or (none has one) the Edge
        /// owning the most of the model's nodes.
        target: PeerEdge,
        /// The Edges to try next, in order (see the module docs).
        fallbacks: Vec<PeerEdge>,
        /// Why not here.
        reason: ForwardReason,
    },
}

/// Decides where a request for a model is served. `this_edge`: this
/// Edge's name; `owners`: for each of the model's nodes (each once), the
/// name of the Edge owning it, `None` when no Edge does; `peers`: the
/// Edges that announced a peer address; `free`: the free slots for the
/// request's operation here and at the peers whose summary is fresh.
pub fn decide<'a>(
    this_edge: &str,
    owners: impl IntoIterator<Item = Option<&'a str>>,
    peers: &BTreeMap<String, SocketAddr>,
    free: &FreeSlots,
) -> Route {
    if free.here > 0 {
        return Route::Local;
    }
    let mut owned_here = false;
    let mut owned: BTreeMap<&str, u64> = BTreeMap::new();
    for owner in owners.into_iter().flatten() {
        if owner == this_edge {
            owned_here = true;
        } else {
            *owned.entry(owner).or_insert(0) += 1;
        }
    }
    let peer = |name: &str| {
        peers.get(name).map(|&addr| PeerEdge {
            name: name.to_owned(),
            addr,
        })
    };
    // Most first; the maps give name order, which a stable sort keeps
    // among equals.
    let ranked = |counts: Vec<(&str, u64)>| {
        let mut ranked: Vec<(u64, PeerEdge)> = counts
            .into_iter()
            .filter(|&(name, n)| n > 0 && name != this_edge)
            .filter_map(|(name, n)| Some((n, peer(name)?)))
            .collect();
        ranked.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
        ranked.into_iter().map(|(_, peer)| peer).collect::<Vec<_>>()
    };
    let with_free = ranked(
        free.peers
            .iter()
            .map(|(name, &slots)| (name.as_str(), u64::from(slots)))
            .collect(),
    );
    let owned_elsewhere = !owned.is_empty();
    let owners_ranked = ranked(owned.into_iter().collect());
    let (mut order, reason) = if !with_free.is_empty() {
        let reason = if owned_here {
            ForwardReason::LocalFull
        } else {
            ForwardReason::NoLocalNode
        };
        let mut order = with_free;
        for owner in owners_ranked {
            if !order.iter().any(|p| p.name == owner.name) {
                order.push(owner);
            }
        }
        (order, reason)
    } else if owned_here {
        return Route::Local;
    } else {
        (owners_ranked, ForwardReason::NoLocalNode)
    };
    if order.is_empty() {
        // Owned only by Edges that announced no peer address: queue here,
        // as a single Edge would.
        return if owned_elsewhere {
            Route::Local
        } else {
            Route::Unowned
        };
    }
    let target = order.remove(0);
    Route::Forward {
        target,
        fallbacks: order,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(names: &[&str]) -> BTreeMap<String, SocketAddr> {
        names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let addr = SocketAddr::from(([127, 0, 0, 1], 7000 + i as u16));
                (name.to_string(), addr)
            })
            .collect()
    }

    fn peer(name: &str, all: &BTreeMap<String, SocketAddr>) -> PeerEdge {
        PeerEdge {
            name: name.into(),
            addr: all[name],
        }
    }

    /// Nothing free anywhere.
    fn full() -> FreeSlots {
        FreeSlots::default()
    }

    fn free(here: u32, peers: &[(&str, u32)]) -> FreeSlots {
        FreeSlots {
            here,
            peers: peers.iter().map(|&(n, s)| (n.to_string(), s)).collect(),
        }
    }

    #[test]
    fn a_free_slot_here_keeps_the_request_local_whatever_the_peers_have() {
        let all = peers(&["a", "b", "c"]);
        assert_eq!(
            decide("a", [Some("a"), Some("b")], &all, &free(1, &[("b", 9)])),
            Route::Local
        );
        // Even before the watch showed this Edge's own claim.
        assert_eq!(
            decide("a", [None, Some("b")], &all, &free(2, &[("b", 9)])),
            Route::Local
        );
    }

    #[test]
    fn with_this_edge_full_the_peer_with_most_free_slots_is_the_target() {
        let all = peers(&["a", "b", "c", "d", "e"]);
        // a owns a node (full): local_full. c and d have 2 each (name
        // order), b 1; then e, an owner without a free slot.
        assert_eq!(
            decide(
                "a",
                [Some("a"), Some("b"), Some("e"), Some("e"), Some("c")],
                &all,
                &free(0, &[("b", 1), ("d", 2), ("c", 2)]),
            ),
            Route::Forward {
                target: peer("c", &all),
                fallbacks: vec![peer("d", &all), peer("b", &all), peer("e", &all)],
                reason: ForwardReason::LocalFull,
            }
        );
        // The same without a node here: no_local_node.
        assert_eq!(
            decide("a", [Some("b"), Some("c")], &all, &free(0, &[("c", 1)])),
            Route::Forward {
                target: peer("c", &all),
                fallbacks: vec![peer("b", &all)],
                reason: ForwardReason::NoLocalNode,
            }
        );
    }

    #[test]
    fn with_nobody_free_a_node_owned_here_keeps_the_request_local_and_no_owner_at_all_is_unowned() {
        let all = peers(&["a", "b", "c"]);
        // One node of three here: queued here, however many are elsewhere.
        assert_eq!(
            decide("a", [Some("b"), Some("a"), Some("b")], &all, &full()),
            Route::Local
        );
        // Nobody owns a node now (they are moving, or offline): ask again.
        assert_eq!(decide("a", [None, None], &all, &full()), Route::Unowned);
        // A model without nodes (none configured).
        assert_eq!(decide("a", [], &all, &full()), Route::Unowned);
        // Owned only by an Edge without a peer listener: queued here, as a
        // single Edge would.
        assert_eq!(decide("a", [Some("x"), None], &all, &full()), Route::Local);
    }

    #[test]
    fn with_nobody_free_the_edge_owning_most_nodes_is_the_target() {
        let all = peers(&["a", "b", "c", "d"]);
        assert_eq!(
            decide(
                "a",
                [Some("b"), Some("c"), None, Some("c"), Some("d")],
                &all,
                &full(),
            ),
            Route::Forward {
                target: peer("c", &all),
                fallbacks: vec![peer("b", &all), peer("d", &all)],
                reason: ForwardReason::NoLocalNode,
            }
        );
        // Ties go by name, whatever order the nodes came in.
        assert_eq!(
            decide("a", [Some("d"), Some("c"), Some("b")], &all, &full()),
            Route::Forward {
                target: peer("b", &all),
                fallbacks: vec![peer("c", &all), peer("d", &all)],
                reason: ForwardReason::NoLocalNode,
            }
        );
    }

    #[test]
    fn edges_without_a_peer_address_and_this_edge_are_never_chosen() {
        let all = peers(&["a", "c"]);
        // b owns more, but announced no peer listener.
        assert_eq!(
            decide("a", [Some("b"), Some("b"), Some("c")], &all, &full()),
            Route::Forward {
                target: peer("c", &all),
                fallbacks: vec![],
                reason: ForwardReason::NoLocalNode,
            }
        );
        // b has the most free slots, but no peer listener; a summary
        // under this Edge's own name is not a peer.
        assert_eq!(
            decide(
                "a",
                [Some("a"), Some("b"), Some("c")],
                &all,
                &free(0, &[("b", 5), ("a", 4), ("c", 1)]),
            ),
            Route::Forward {
                target: peer("c", &all),
                fallbacks: vec![],
                reason: ForwardReason::LocalFull,
            }
        );
        // Only Edges without one own the model's nodes: waits here.
        assert_eq!(decide("a", [Some("b")], &all, &full()), Route::Local);
        assert_eq!(
            decide("a", [Some("b")], &all, &free(0, &[("b", 3)])),
            Route::Local
        );
    }
}
