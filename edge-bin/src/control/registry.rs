//! The registry: which connection owns which node id under which
//! generation, pending or ready (R1–R5); registration, readiness, closes,
//! and fencing of a ready owner's generation (F1, F2).

use iop_wire::{pb, CloseReason};

use super::tables::{NodeEntry, Owner, OwnerState};
use super::{
    Action, ConnId, Control, Event, Generation, Outcome, Ownership, NODE_VERSION_CHARS_MAX,
};

impl Control {
    // ---- registration, readiness, closes, fencing ----------------------------

    /// Orders `conn` closed and treats it as closed from this step on: a
    /// connection Control has let go of never becomes or stays an owner,
    /// even if more of its frames arrive before the shell reports the close.
    pub(super) fn close_conn(&mut self, conn: ConnId, reason: CloseReason, out: &mut Vec<Action>) {
        out.push(Action::Close { conn, reason });
        if self.generation_of(conn).is_some() {
            // The current owner: released now, fenced if it was ready.
            self.on_closed(conn, false, out);
        }
        // Otherwise it already owns nothing (rejected or superseded); its
        // binding stays so late frames get an accurate reason.
        self.closing.insert(conn);
    }

    pub(super) fn on_register(
        &mut self,
        conn: ConnId,
        tls_name: &str,
        node_id: &str,
        out: &mut Vec<Action>,
    ) {
        let reject = |reason: String, out: &mut Vec<Action>| {
            out.push(Action::RegisterResponse {
                conn,
                response: pb::RegisterResponse {
                    accepted: false,
                    reason,
                    config: None,
                    accepts_node_draining: false,
                },
            });
        };
        if let Some(&bound) = self.bindings.get(&conn).or(self.claims.get(&conn)) {
            // R1: one node id per connection; the first binding stays as is.
            let bound = &self.nodes[bound].spec.id;
            return reject(
                format!(
                    "connection already registered as node `{bound}`; one node id per connection"
                ),
                out,
            );
        }
        if self.closing.contains(&conn) {
            // Ordered closed (rejected, or let go of with its binding): a
            // late register must not make it an owner again (R3).
            return reject(
                "connection is closing; reconnect to register".to_string(),
                out,
            );
        }
        if node_id != tls_name {
            reject(
                format!("node id `{node_id}` does not match the TLS identity name `{tls_name}`"),
                out,
            );
            return self.close_conn(conn, CloseReason::RegistrationRejected, out);
        }
        let Some(&n) = self
            .node_index
            .get(node_id)
            .filter(|&&n| !self.nodes[n].removed)
        else {
            reject(
                format!("node `{node_id}` is not configured at this edge"),
                out,
            );
            return self.close_conn(conn, CloseReason::RegistrationRejected, out);
        };
        match self.ownership {
            Ownership::Local => {
                self.next_generation += 1;
                self.accept(conn, n, Generation(self.next_generation), out);
            }
            Ownership::Cluster => self.claim(conn, n, out),
        }
    }

    /// Makes `conn` the pending owner of node `n` under `generation` and
    /// answers its registration; a previous owner is fenced and closed
    /// (R2).
    pub(super) fn accept(
        &mut self,
        conn: ConnId,
        n: usize,
        generation: Generation,
        out: &mut Vec<Action>,
    ) {
        let node = &mut self.nodes[n];
        let previous = node.owner.replace(Owner {
            conn,
            generation,
            state: OwnerState::Pending,
            registered_at: self.now,
            ready_at: None,
            strips_usage_chunk: false,
            runs_embeddings: false,
            accepts_tunnel_body: false,
            draining: false,
            drained: false,
        });
        node.version.clear();
        node.offline_since = None;
        let config = node.spec.config.clone();
        self.bindings.insert(conn, n);
        out.push(Action::RegisterResponse {
            conn,
            response: pb::RegisterResponse {
                accepted: true,
                reason: String::new(),
                config: Some(config),
                // The link turns the owner's `NodeDraining` into
                // `Input::NodeDraining`: the node may send it.
                accepts_node_draining: true,
            },
        });
        if let Some(old) = previous {
            // R2: the older connection is fenced and closed.
            if old.state == OwnerState::Ready {
                self.fence(n, old, out);
            }
            self.close_conn(old.conn, CloseReason::Superseded, out);
        }
        // A pending owner offers no candidate.
        self.refresh_node(n);
    }

    pub(super) fn on_ready(&mut self, conn: ConnId, node_id: &str, out: &mut Vec<Action>) {
        let not_ready = |this: &mut Self, reason: &str, out: &mut Vec<Action>| {
            out.push(Action::ReadyResponse {
                conn,
                response: pb::NodeReadyResponse {
                    ready: false,
                    reason: reason.to_string(),
                },
            });
            this.close_conn(conn, CloseReason::NotReady, out);
        };
        let n = match self.bindings.get(&conn) {
            Some(&n) if self.nodes[n].spec.id == node_id => n,
            _ => return not_ready(self, "this connection did not register this node id", out),
        };
        let Some(owner) = self.nodes[n].owner.as_mut().filter(|o| o.conn == conn) else {
            return not_ready(
                self,
                "superseded by a newer registration of this node id",
                out,
            );
        };
        out.push(Action::ReadyResponse {
            conn,
            response: pb::NodeReadyResponse {
                ready: true,
                reason: String::new(),
            },
        });
        if owner.state == OwnerState::Ready {
            // Duplicate ready: true, no side effect (R3).
            return;
        }
        owner.state = OwnerState::Ready;
        owner.ready_at = self.now;
        // F3, H5: the new generation's resources start with configured
        // capacity and without the old overlay. An ejection outlives the
        // connection (it is about the provider server, and ends by time);
        // its probes resume under the new generation.
        let interval = self.tunables.recovery_probe_interval;
        for p in self.nodes[n].providers.clone() {
            self.reset_health(p);
            if let (Some(now), Some(_)) = (self.now, self.providers[p].outlier.ejection()) {
                self.set_next_probe(p, Some(now + interval));
            }
            self.refresh(p);
        }
        out.push(Action::Event(Event::NodeConnected {
            node_id: node_id.to_string(),
        }));
        self.pump(out);
    }

    pub(super) fn on_node_version(
        &mut self,
        conn: ConnId,
        version: String,
        strips_usage_chunk: bool,
        runs_embeddings: bool,
        accepts_tunnel_body: bool,
        out: &mut Vec<Action>,
    ) {
        let Some(&n) = self.bindings.get(&conn) else {
            return;
        };
        let node = &mut self.nodes[n];
        if let Some(owner) = node.owner.as_mut().filter(|o| o.conn == conn) {
            owner.strips_usage_chunk = strips_usage_chunk;
            owner.accepts_tunnel_body = accepts_tunnel_body;
            let changed = owner.runs_embeddings != runs_embeddings;
            owner.runs_embeddings = runs_embeddings;
            // Bounded: a diagnostic string, not a payload.
            node.version = version.chars().take(NODE_VERSION_CHARS_MAX).collect();
            if changed {
                // Its providers' candidacy in embeddings lanes follows (a
                // Node says it right after registering, before it is ready:
                // then there is no candidate to move yet).
                self.refile_node(n);
                self.pump(out);
            }
        }
    }

    pub(super) fn on_closed(&mut self, conn: ConnId, drained: bool, out: &mut Vec<Action>) {
        self.closing.remove(&conn);
        // A claim in flight: its grant, when it comes, releases the key.
        self.claims.remove(&conn);
        let Some(n) = self.bindings.remove(&conn) else {
            return;
        };
        if let Some(owner) = self.nodes[n].owner.as_mut().filter(|o| o.conn == conn) {
            owner.drained = drained;
            self.end_ownership(n, true, out);
        }
        // Otherwise a stale connection: nothing changes (F2).
    }

    /// Node `n` has no owner from now on: its owner's generation is fenced
    /// if it was ready. In a cluster, `release` also deletes the owner key
    /// if it is still this generation's (not when a newer claim already
    /// replaced it).
    pub(super) fn end_ownership(&mut self, n: usize, release: bool, out: &mut Vec<Action>) {
        let Some(owner) = self.nodes[n].owner.take() else {
            return;
        };
        self.nodes[n].offline_since = self.now;
        self.nodes[n].version.clear();
        if release && self.ownership == Ownership::Cluster {
            out.push(Action::ReleaseOwnership {
                node_id: self.nodes[n].spec.id.clone(),
                revision: owner.generation.0,
            });
        }
        if owner.state == OwnerState::Ready {
            self.fence(n, owner, out);
        }
    }

    /// F1: in one step, release every lease of `owner`'s generation exactly
    /// once, take its resources offline, and re-evaluate the queue.
    /// Requests whose attempt was lost before anything reached their
    /// client go on to another provider instead (pre-commit failover).
    /// After `Close(drained)`, a request whose response never started was
    /// never started by the node: it is dispatched again, not an attempt.
    fn fence(&mut self, n: usize, owner: Owner, out: &mut Vec<Action>) {
        let mut lost = Vec::new();
        for run_id in self.leases_of.remove(&owner.conn).unwrap_or_default() {
            let provider = self.leases.get(&run_id).map(|entry| entry.provider);
            if let Some(lease) = self.release(&run_id) {
                lost.push((lease.request, provider));
            }
        }
        for p in self.nodes[n].providers.clone() {
            self.reset_health(p);
            self.refresh(p);
            // Its engines may restart with it: what they cached is unknown.
            // Requests waiting for it rejoin their queues (pumped below).
            self.forget_routes(p);
        }
        // In arrival order, now that the fenced providers are no
        // candidates.
        lost.sort_unstable();
        for (request, provider) in lost {
            if owner.drained && self.redispatch_unstarted(request, provider, out) {
                continue;
            }
            if !self.try_failover(request, false, provider, out) {
                self.forget_request(request);
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Lost,
                });
            }
        }
        self.commands.retain(|_, c| c.conn != owner.conn);
        out.push(Action::Event(Event::NodeDisconnected {
            node_id: self.nodes[n].spec.id.clone(),
        }));
        self.pump(out);
    }

    // ---- reads ---------------------------------------------------------------

    fn node(&self, node_id: &str) -> Option<&NodeEntry> {
        self.node_index.get(node_id).map(|&n| &self.nodes[n])
    }

    /// The config payload a node gets at registration (R2).
    pub fn node_config(&self, node_id: &str) -> Option<&pb::NodeConfigPayload> {
        self.node(node_id).map(|n| &n.spec.config)
    }

    /// Replaces the payload `node_id` gets at its next registration (config
    /// reload, K3). Returns false for an unknown node.
    pub fn set_node_config(&mut self, node_id: &str, config: pb::NodeConfigPayload) -> bool {
        match self.node_index.get(node_id) {
            Some(&n) => {
                self.nodes[n].spec.config = config;
                true
            }
            None => false,
        }
    }

    /// The node id `conn` registered, if any.
    pub fn node_of(&self, conn: ConnId) -> Option<&str> {
        self.bindings
            .get(&conn)
            .map(|&n| self.nodes[n].spec.id.as_str())
    }

    /// Whether `conn` is the dispatch-ready owner of its node id (R4).
    pub fn is_ready_owner(&self, conn: ConnId) -> bool {
        self.bindings
            .get(&conn)
            .and_then(|&n| self.nodes[n].ready_owner())
            .is_some_and(|o| o.conn == conn)
    }

    /// The ready owner connection of `node_id`, if any (K3, X6).
    pub fn ready_conn(&self, node_id: &str) -> Option<ConnId> {
        self.node(node_id)
            .and_then(NodeEntry::ready_owner)
            .map(|o| o.conn)
    }

    /// Every node id with a dispatch-ready owner, with its connection.
    pub fn ready_nodes(&self) -> Vec<(String, ConnId)> {
        self.nodes
            .iter()
            .filter_map(|n| n.ready_owner().map(|o| (n.spec.id.clone(), o.conn)))
            .collect()
    }

    /// The generation `conn` owns its node id under, if it is the current
    /// owner (pending or ready).
    pub fn generation_of(&self, conn: ConnId) -> Option<Generation> {
        let &n = self.bindings.get(&conn)?;
        self.nodes[n]
            .owner
            .filter(|o| o.conn == conn)
            .map(|o| o.generation)
    }
}
