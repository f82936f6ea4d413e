//! Ownership of node ids in a cluster ([`Control::clustered`]): a
//! registration is a claim in etcd, its revision the generation; every
//! Edge fences a generation the moment it learns of a newer revision of the
//! node's owner key; an Edge that cannot prove its etcd lease owns nothing.
//!
//! ```text
//!  Register ──► claim in flight ──OwnershipGranted{r ≥ observed}──► accept (generation r)
//!                     │   └────────OwnershipGranted{r < observed}──► refused: superseded
//!                     └──OwnershipFailed / ClusterSession{up: false}──► refused
//!
//!  OwnerObserved{r} / a grant of r: observed := max(observed, r);
//!                                   an owner under a generation < r is fenced (F1).
//! ```
//!
//! The one rule that makes it safe across Edges: the owner of a node, if
//! any, holds exactly the highest revision of its owner key this Edge has
//! seen (checked after every step in `invariants.rs`). etcd gives every
//! write a cluster-wide, increasing revision, so two Edges never both
//! believe in the same generation, and any message, answer or lease
//! settlement of an older generation is stale everywhere (F2).

use iop_wire::{pb, CloseReason};

use super::{Action, ConnId, Control};

impl Control {
    /// Claims node `n` for `conn` in etcd; the registration is answered
    /// when the claim's outcome comes back.
    pub(super) fn claim(&mut self, conn: ConnId, n: usize, out: &mut Vec<Action>) {
        if !self.cluster_up {
            refuse(
                conn,
                "this edge cannot reach the cluster store; reconnect (to another edge)",
                out,
            );
            return self.close_conn(conn, CloseReason::RegistrationRejected, out);
        }
        self.claims.insert(conn, n);
        out.push(Action::ClaimOwnership {
            conn,
            node_id: self.nodes[n].spec.id.clone(),
        });
    }

    pub(super) fn on_ownership_granted(
        &mut self,
        conn: ConnId,
        node_id: &str,
        revision: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(&n) = self
            .node_index
            .get(node_id)
            .filter(|&&n| !self.nodes[n].removed)
        else {
            // A reload removed the node while the claim was in flight (the
            // claim was refused then): the key it wrote is nobody's.
            self.claims.remove(&conn);
            return release(node_id, revision, out);
        };
        let claimed = self.claims.remove(&conn);
        let newest = self.observe_revision(n, revision, CloseReason::Superseded, out);
        match claimed {
            Some(m) if m == n && newest && self.cluster_up => {
                self.accept(conn, n, super::Generation(revision), out);
            }
            Some(_) => {
                let (why, reason) = if newest {
                    // The lease it was claimed under can't be proven.
                    (
                        "this edge lost its cluster lease; reconnect (to another edge)",
                        CloseReason::OwnershipLost,
                    )
                } else {
                    (
                        "superseded by a newer registration of this node id",
                        CloseReason::Superseded,
                    )
                };
                refuse(conn, why, out);
                if newest {
                    release(node_id, revision, out);
                }
                self.close_conn(conn, reason, out);
            }
            // The connection went away while its claim was in flight: the
            // key it wrote is nobody's.
            None if newest => release(node_id, revision, out),
            None => {}
        }
    }

    pub(super) fn on_ownership_failed(&mut self, conn: ConnId, out: &mut Vec<Action>) {
        if self.claims.remove(&conn).is_some() {
            refuse(
                conn,
                "could not claim the node id in the cluster store; reconnect",
                out,
            );
            self.close_conn(conn, CloseReason::RegistrationRejected, out);
        }
    }

    pub(super) fn on_owner_observed(
        &mut self,
        node_id: &str,
        revision: u64,
        deleted: bool,
        out: &mut Vec<Action>,
    ) {
        if let Some(&n) = self.node_index.get(node_id) {
            let reason = if deleted {
                CloseReason::OwnershipLost
            } else {
                CloseReason::Superseded
            };
            self.observe_revision(n, revision, reason, out);
        }
    }

    pub(super) fn on_cluster_session(&mut self, up: bool, out: &mut Vec<Action>) {
        self.cluster_up = up;
        if up {
            return;
        }
        // Nothing owned here can be proven any more: fence it all before
        // the lease can expire on the server, and let the Nodes move.
        for n in 0..self.nodes.len() {
            if let Some(owner) = self.nodes[n].owner {
                self.end_ownership(n, true, out);
                self.close_conn(owner.conn, CloseReason::OwnershipLost, out);
            }
        }
        let mut claims: Vec<ConnId> = self.claims.drain().map(|(conn, _)| conn).collect();
        claims.sort_unstable();
        for conn in claims {
            refuse(
                conn,
                "this edge lost its cluster lease; reconnect (to another edge)",
                out,
            );
            self.close_conn(conn, CloseReason::OwnershipLost, out);
        }
    }

    /// In a cluster's drain ([`super::Input::Drain`]): once no request
    /// waits in a queue, closes every owner with nothing in flight, so its
    /// node moves to another Edge while this one finishes its streams.
    pub(super) fn let_go_of_idle_nodes(&mut self, out: &mut Vec<Action>) {
        if !self.draining || self.ownership != super::Ownership::Cluster || !self.heads.is_empty() {
            return;
        }
        for n in 0..self.nodes.len() {
            let Some(owner) = self.nodes[n].owner else {
                continue;
            };
            if self
                .leases_of
                .get(&owner.conn)
                .is_some_and(|l| !l.is_empty())
            {
                continue;
            }
            self.end_ownership(n, true, out);
            self.close_conn(owner.conn, CloseReason::Shutdown, out);
        }
    }

    /// Records that node `n`'s owner key reached `revision`; an owner under
    /// an older generation is fenced and closed with `reason`. Returns
    /// false for old news (a revision below one already seen).
    fn observe_revision(
        &mut self,
        n: usize,
        revision: u64,
        reason: CloseReason,
        out: &mut Vec<Action>,
    ) -> bool {
        if revision < self.nodes[n].observed_revision {
            return false;
        }
        self.nodes[n].observed_revision = revision;
        if let Some(owner) = self.nodes[n].owner.filter(|o| o.generation.0 < revision) {
            // The key is already someone else's (or gone): nothing to
            // release.
            self.end_ownership(n, false, out);
            self.close_conn(owner.conn, reason, out);
        }
        true
    }
}

pub(super) fn refuse(conn: ConnId, why: &str, out: &mut Vec<Action>) {
    out.push(Action::RegisterResponse {
        conn,
        response: pb::RegisterResponse {
            accepted: false,
            reason: why.to_string(),
            config: None,
            accepts_node_draining: false,
        },
    });
}

fn release(node_id: &str, revision: u64, out: &mut Vec<Action>) {
    out.push(Action::ReleaseOwnership {
        node_id: node_id.to_string(),
        revision,
    });
}
