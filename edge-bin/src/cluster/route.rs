//! Where a request for a model is served in a cluster: here, or on the
//! Edge that owns the model's nodes (`docs/multi-edge.md`, "A request for
//! a provider on another Edge"). Sans-IO: the caller reads the owners and
//! the announced peer addresses from its [`crate::plane::cluster::ClusterView`]
//! and acts on the [`Route`].
//!
//! ```text
//! a node of the model owned here, or none owned by anyone ──► Local
//!     (queued here as on a single Edge: its nodes may register here)
//! owned elsewhere only ──► Forward{target: the Edge owning the most of them
//!                          (ties: name order), fallbacks: the other owners}
//!     only Edges that announced a peer address are chosen; with none of
//!     them left the request stays Local (and waits as it did before)
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;

/// An Edge a request can be forwarded to: its name (its certificate's
/// identity) and its peer listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerEdge {
    /// The Edge's name (`spiffe://<td>/edge/<name>`).
    pub name: String,
    /// Its announced `peer_addr`.
    pub addr: SocketAddr,
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Admitted through this Edge's Control.
    Local,
    /// Forwarded to `target`; when `target` cannot be reached before the
    /// request is written, to each of `fallbacks` in order.
    Forward {
        /// The Edge owning the most of the model's nodes.
        target: PeerEdge,
        /// The other owning Edges, most nodes first (ties: name order).
        fallbacks: Vec<PeerEdge>,
    },
}

/// Decides where a request for a model is served. `owners`: for each of
/// the model's nodes (each once), the name of the Edge owning it, `None`
/// when no Edge does; `this_edge`: this Edge's name; `peers`: the Edges
/// that announced a peer address.
pub fn decide<'a>(
    this_edge: &str,
    owners: impl IntoIterator<Item = Option<&'a str>>,
    peers: &BTreeMap<String, SocketAddr>,
) -> Route {
    let mut owned: BTreeMap<&str, usize> = BTreeMap::new();
    for owner in owners.into_iter().flatten() {
        if owner == this_edge {
            return Route::Local;
        }
        *owned.entry(owner).or_insert(0) += 1;
    }
    let mut ranked: Vec<(usize, PeerEdge)> = owned
        .into_iter()
        .filter_map(|(name, nodes)| {
            let addr = *peers.get(name)?;
            Some((
                nodes,
                PeerEdge {
                    name: name.to_owned(),
                    addr,
                },
            ))
        })
        .collect();
    // Most nodes first; the map gave name order, which a stable sort keeps
    // among equals.
    ranked.sort_by_key(|(nodes, _)| std::cmp::Reverse(*nodes));
    let mut ranked = ranked.into_iter().map(|(_, peer)| peer);
    match ranked.next() {
        Some(target) => Route::Forward {
            target,
            fallbacks: ranked.collect(),
        },
        None => Route::Local,
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

    #[test]
    fn a_node_owned_here_or_no_owner_at_all_keeps_the_request_local() {
        let all = peers(&["a", "b", "c"]);
        // One node of three here: served here, however many are elsewhere.
        assert_eq!(
            decide("a", [Some("b"), Some("a"), Some("b")], &all),
            Route::Local
        );
        // Nobody owns a node yet: they may register here.
        assert_eq!(decide("a", [None, None], &all), Route::Local);
        // A model without nodes (none configured).
        assert_eq!(decide("a", [], &all), Route::Local);
    }

    #[test]
    fn the_edge_owning_most_nodes_is_the_target_and_the_others_fall_back() {
        let all = peers(&["a", "b", "c", "d"]);
        assert_eq!(
            decide(
                "a",
                [Some("b"), Some("c"), None, Some("c"), Some("d")],
                &all
            ),
            Route::Forward {
                target: peer("c", &all),
                fallbacks: vec![peer("b", &all), peer("d", &all)],
            }
        );
        // Ties go by name, whatever order the nodes came in.
        assert_eq!(
            decide("a", [Some("d"), Some("c"), Some("b")], &all),
            Route::Forward {
                target: peer("b", &all),
                fallbacks: vec![peer("c", &all), peer("d", &all)],
            }
        );
    }

    #[test]
    fn edges_without_a_peer_address_are_never_chosen() {
        let all = peers(&["a", "c"]);
        // b owns more, but announced no peer listener.
        assert_eq!(
            decide("a", [Some("b"), Some("b"), Some("c")], &all),
            Route::Forward {
                target: peer("c", &all),
                fallbacks: vec![],
            }
        );
        // Only Edges without one own the model's nodes: waits here.
        assert_eq!(decide("a", [Some("b")], &all), Route::Local);
    }
}
