//! The fleet changing under a running Control: configuration reloads
//! ([`Input::Reconfigure`]), operator drains ([`Input::SetDrain`]) and
//! owners that say they drain ([`Input::NodeDraining`]).
//!
//! A reload rebuilds the tables from the new spec and carries every
//! runtime state over by name (node id, provider key, model name), so
//! nothing that runs notices:
//!
//! - a kept node keeps its owner, generation, drain and version; a kept
//!   provider its leases, health, ejection and drain; a queued request its
//!   place (by arrival) and deadline, in its model's new lane for its
//!   operation;
//! - a provider that leaves the configuration while leased stays, marked
//!   removed, in no pool, until a later reload finds it idle; a node that
//!   leaves while owned stays, marked removed, until its owner has nothing
//!   in flight (then it is closed with `node_removed`) or its grace
//!   (`Tunables::retire_grace`) ends (closed anyway: what still runs there
//!   is fenced, F1, and goes on to another provider if it can);
//! - a removed model's queued requests end ([`Rejection::ModelRemoved`]);
//!   its dispatched ones run to their end, never queued again; so do
//!   dispatched requests whose model no longer serves their operation;
//! - a capacity lowered below what is in flight cuts nothing: the provider
//!   is no candidate until its leases are below the new capacity;
//! - a model's queue above its new `max_queue` loses its newest waiters
//!   (429, as if they had arrived to a full queue).
//!
//! ```text
//!   provider:  serving ──SetDrain / NodeDraining / removed──► no new work ──leases end──► idle
//!   removed node:  owned ──nothing in flight, or grace over──► closed (node_removed)
//! ```

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Instant;

use iop_wire::CloseReason;

use super::prefix::ProviderId;
use super::tables::RequestState;
use super::{
    Action, ConnId, Control, ControlModel, ControlSpec, DrainTarget, Outcome, ProviderKey,
    Rejection, RequestId,
};

impl Control {
    /// The owner on `conn` drains: no new dispatch under its generation.
    pub(super) fn on_node_draining(&mut self, conn: ConnId) {
        let Some(&n) = self.bindings.get(&conn) else {
            return;
        };
        let Some(owner) = self.nodes[n].owner.as_mut().filter(|o| o.conn == conn) else {
            // A stale connection says nothing about the node (F2).
            return;
        };
        if !owner.draining {
            owner.draining = true;
            self.refresh_node(n);
        }
    }

    pub(super) fn on_set_drain(
        &mut self,
        target: &DrainTarget,
        drained: bool,
        out: &mut Vec<Action>,
    ) {
        match target {
            DrainTarget::Node(id) => {
                let Some(&n) = self.node_index.get(id) else {
                    return;
                };
                if self.nodes[n].removed || self.nodes[n].drained == drained {
                    return;
                }
                self.nodes[n].drained = drained;
                self.refresh_node(n);
            }
            DrainTarget::Provider(key) => {
                let Some(&p) = self.provider_index.get(key) else {
                    return;
                };
                if self.providers[p].removed || self.providers[p].drained == drained {
                    return;
                }
                self.providers[p].drained = drained;
                self.refresh(p);
            }
        }
        if !drained {
            self.pump(out);
        }
    }

    /// Whether `target` names a node or provider of the configuration (not
    /// one a reload removed): the admin API's 404.
    pub fn has_drain_target(&self, target: &DrainTarget) -> bool {
        match target {
            DrainTarget::Node(id) => self
                .node_index
                .get(id)
                .is_some_and(|&n| !self.nodes[n].removed),
            DrainTarget::Provider(key) => self
                .provider_index
                .get(key)
                .is_some_and(|&p| !self.providers[p].removed),
        }
    }

    /// Applies a reload: see the module docs.
    pub(super) fn on_reconfigure(&mut self, mut spec: ControlSpec, out: &mut Vec<Action>) {
        let kept_nodes: HashSet<String> = spec.nodes.iter().map(|n| n.id.clone()).collect();
        // Claims in flight for a node that leaves: refused now (their
        // grant, when it comes, releases the key: the node is unknown).
        let mut refused: Vec<ConnId> = self
            .claims
            .iter()
            .filter(|(_, &n)| !kept_nodes.contains(&self.nodes[n].spec.id))
            .map(|(&conn, _)| conn)
            .collect();
        refused.sort_unstable();
        for conn in refused {
            self.claims.remove(&conn);
            super::ownership::refuse(conn, "node removed from this edge's configuration", out);
            self.close_conn(conn, CloseReason::RegistrationRejected, out);
        }
        // What leaves the configuration but still holds something stays,
        // marked removed: providers with leases, nodes with an owner.
        let mut removed_providers: HashSet<ProviderKey> = HashSet::new();
        let mut removed_nodes: HashSet<String> = HashSet::new();
        for node in &mut spec.nodes {
            let Some(&n) = self.node_index.get(&node.id) else {
                continue;
            };
            for p in self.nodes[n].providers.clone() {
                let state = &self.providers[p];
                let kept = node
                    .providers
                    .iter()
                    .any(|q| *q.id == *state.key.provider_id);
                if !kept && state.in_flight > 0 {
                    node.providers.push(state.spec.clone());
                    removed_providers.insert(state.key.clone());
                }
            }
        }
        for old in &self.nodes {
            if kept_nodes.contains(&old.spec.id) || old.owner.is_none() {
                continue;
            }
            let mut node = old.spec.clone();
            node.providers = old
                .providers
                .clone()
                .filter(|&p| self.providers[p].in_flight > 0)
                .map(|p| self.providers[p].spec.clone())
                .collect();
            removed_nodes.insert(node.id.clone());
            spec.nodes.push(node);
        }
        // Models that leave while requests they admitted still run stay,
        // with an empty pool (those requests are never queued again).
        let kept_models: HashSet<&str> = spec.models.iter().map(|m| m.name.as_str()).collect();
        let mut retired_models: BTreeSet<usize> = BTreeSet::new();
        for p in self.pending.values() {
            let name = self.models[p.model].spec.name.as_str();
            let queued = matches!(p.state, RequestState::Queued { .. });
            if !queued && !kept_models.contains(name) {
                retired_models.insert(p.model);
            }
        }
        let mut removed_models: HashSet<String> = HashSet::new();
        for &m in &retired_models {
            let old = &self.models[m].spec;
            removed_models.insert(old.name.clone());
            spec.models.push(ControlModel {
                providers: Vec::new(),
                ..old.clone()
            });
        }

        let mut next = Control::new(spec);
        next.carry_registry(self, &removed_nodes);
        next.carry_providers(self, &removed_providers);
        for name in &removed_models {
            if let Some(m) = next.model_index.remove(name) {
                next.models[m].removed = true;
            }
        }
        next.carry_requests(self, out);
        next.carry_routing(self);
        for p in 0..next.providers.len() {
            next.refresh(p);
        }
        *self = next;
        self.pump(out);
    }

    /// Owners, bindings, claims and the connections' state, from `old`.
    fn carry_registry(&mut self, old: &mut Control, removed: &HashSet<String>) {
        let retire_at = old.now.map(|now| now + self.tunables.retire_grace);
        for node in &mut self.nodes {
            let Some(&o) = old.node_index.get(&node.spec.id) else {
                continue;
            };
            let was = &mut old.nodes[o];
            // The payload a node gets at registration is the shell's to
            // change (`set_node_config`): a kept node keeps its own.
            node.spec.config = std::mem::take(&mut was.spec.config);
            node.owner = was.owner;
            node.version = std::mem::take(&mut was.version);
            node.offline_since = was.offline_since;
            node.observed_revision = was.observed_revision;
            node.drained = was.drained;
            node.removed = removed.contains(&node.spec.id);
        }
        for node in self.nodes.iter().filter(|n| n.removed) {
            // An owner that was removed earlier keeps its first deadline.
            let earlier = old
                .retire_deadlines
                .iter()
                .find(|(_, id)| *id == node.spec.id)
                .map(|(at, _)| *at);
            if let Some(at) = earlier.or(retire_at) {
                self.retire_deadlines.insert((at, node.spec.id.clone()));
            }
        }
        let index = |c: &Control, n: usize| c.node_index.get(&old.nodes[n].spec.id).copied();
        self.bindings = old
            .bindings
            .iter()
            .filter_map(|(&conn, &n)| index(self, n).map(|m| (conn, m)))
            .collect();
        self.claims = old
            .claims
            .iter()
            .filter_map(|(&conn, &n)| index(self, n).map(|m| (conn, m)))
            .collect();
        self.closing = std::mem::take(&mut old.closing);
        self.leases_of = std::mem::take(&mut old.leases_of);
        self.commands = std::mem::take(&mut old.commands);
        self.next_generation = old.next_generation;
        self.next_command = old.next_command;
        self.counters = std::mem::take(&mut old.counters);
        self.ownership = old.ownership;
        self.cluster_up = old.cluster_up;
        self.draining = old.draining;
        self.now = old.now;
    }

    /// Providers' occupancy, health, timers and drains, and the leases,
    /// from `old`.
    fn carry_providers(&mut self, old: &mut Control, removed: &HashSet<ProviderKey>) {
        for p in 0..self.providers.len() {
            let node_removed = self.nodes[self.providers[p].node].removed;
            let state = &mut self.providers[p];
            state.removed = node_removed || removed.contains(&state.key);
            let Some(&q) = old.provider_index.get(&state.key) else {
                continue;
            };
            let was = &old.providers[q];
            state.in_flight = was.in_flight;
            state.long_in_flight = was.long_in_flight;
            state.last_seq = was.last_seq;
            state.overlay = was.overlay;
            // Passive health turned off: nothing stays ejected.
            if self.tunables.outlier.is_some() {
                state.outlier = was.outlier.clone();
            }
            state.drained = was.drained;
            if let Some(ejection) = state.outlier.ejection() {
                self.ejection_deadlines.insert((ejection.until, p));
            }
            let needs_probe = state.overlay.is_some() || state.outlier.ejection().is_some();
            if let (Some(at), true) = (was.next_probe, needs_probe) {
                self.set_next_probe(p, Some(at));
            }
        }
        let mut leases = std::mem::take(&mut old.leases);
        for entry in leases.values_mut() {
            entry.provider = self.provider_index[&entry.lease.provider];
        }
        self.leases = leases;
    }

    /// Each kept model's routing counters, and its prefix tree when its
    /// policy and tree bounds are unchanged, the providers renumbered (those
    /// no longer in the pool forgotten).
    fn carry_routing(&mut self, old: &mut Control) {
        for m in 0..self.models.len() {
            let name = &self.models[m].spec.name;
            let Some(&o) = old.model_index.get(name) else {
                continue;
            };
            let was = &mut old.models[o].router;
            let router = &mut self.models[m].router;
            router.stats = std::mem::take(&mut was.stats);
            if router.spec.policy != was.spec.policy {
                continue;
            }
            let pool: HashSet<usize> = self.models[m]
                .spec
                .providers
                .iter()
                .filter_map(|key| self.provider_index.get(key).copied())
                .collect();
            let renumber = |q: usize| {
                let p = *self.provider_index.get(&old.providers[q].key)?;
                pool.contains(&p).then_some(p)
            };
            let mut sessions = std::mem::take(&mut old.models[o].router.sessions);
            sessions.remap(renumber);
            self.models[m].router.sessions = sessions;
            let was = &mut old.models[o].router;
            if self.models[m].router.spec.tree != was.spec.tree {
                continue;
            }
            let (Some(mut tree), Some(_)) = (was.tree.take(), self.models[m].router.tree.as_ref())
            else {
                continue;
            };
            tree.remap_providers(|ProviderId(q)| {
                renumber(q as usize).map(|p| ProviderId(p as u32))
            });
            self.models[m].router.tree = Some(tree);
        }
    }

    /// Every pending request, in arrival order, with its model, lane,
    /// queue place and deadlines, from `old`; queued requests the new
    /// configuration cannot serve end.
    fn carry_requests(&mut self, old: &mut Control, out: &mut Vec<Action>) {
        self.settle_deadlines = std::mem::take(&mut old.settle_deadlines);
        self.response_deadlines = std::mem::take(&mut old.response_deadlines);
        let provider_of: HashMap<usize, usize> = (0..old.providers.len())
            .filter_map(|q| {
                self.provider_index
                    .get(&old.providers[q].key)
                    .map(|&p| (q, p))
            })
            .collect();
        for (request, mut p) in std::mem::take(&mut old.pending) {
            let name = &old.models[p.model].spec.name;
            let model = self.model_index.get(name).copied().or_else(|| {
                self.models
                    .iter()
                    .position(|m| m.removed && m.spec.name == *name)
            });
            let lane = model.and_then(|m| self.models[m].lane_of[p.operation as usize]);
            p.tried = p
                .tried
                .iter()
                .filter_map(|q| provider_of.get(q).copied())
                .collect();
            p.lane = lane;
            match (&p.state, model, lane) {
                (RequestState::Queued { deadline }, Some(m), Some(lane)) => {
                    p.model = m;
                    self.queue_deadlines.insert((*deadline, request));
                    // A new queue: tags of the old one mean nothing there,
                    // so each is charged anew, in arrival order.
                    p.place = None;
                    let long = p.long;
                    self.pending.insert(request, p);
                    self.enqueue(request, lane, long);
                }
                (RequestState::Queued { .. }, ..) => out.push(Action::Done {
                    request,
                    outcome: Outcome::Rejected(Rejection::ModelRemoved),
                }),
                (_, Some(m), _) => {
                    p.model = m;
                    self.pending.insert(request, p);
                }
                (_, None, _) => {
                    // Not reachable: a model with a dispatched request is
                    // kept (removed) above. Settle like a lost request
                    // rather than keep a request without a model.
                    debug_assert!(false, "{request:?} lost its model `{name}` in a reload");
                }
            }
        }
        // A queue over its new bound loses its newest waiters.
        for m in 0..self.models.len() {
            let max = self.models[m].spec.max_queue as usize;
            while self.queued_count(m) > max {
                let newest = self.models[m]
                    .lanes
                    .iter()
                    .flat_map(|&lane| {
                        let lane = &self.lanes[lane];
                        lane.queued
                            .newest()
                            .into_iter()
                            .chain(lane.queued_long.newest())
                    })
                    .max();
                let Some(request) = newest else {
                    break;
                };
                self.forget_request(request);
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Rejected(Rejection::QueueFull),
                });
            }
        }
    }

    /// Lets go of every removed node whose owner has nothing in flight
    /// (closed with `node_removed`), and forgets those whose owner left.
    pub(super) fn let_go_of_removed_nodes(&mut self, out: &mut Vec<Action>) {
        if self.retire_deadlines.is_empty() {
            return;
        }
        let entries: Vec<(Instant, String)> = self.retire_deadlines.iter().cloned().collect();
        for (at, id) in entries {
            let Some(&n) = self.node_index.get(&id) else {
                self.retire_deadlines.remove(&(at, id));
                continue;
            };
            match self.nodes[n].owner {
                None => {
                    self.retire_deadlines.remove(&(at, id));
                }
                Some(owner) if !self.leases_of.contains_key(&owner.conn) => {
                    self.retire_deadlines.remove(&(at, id));
                    self.end_ownership(n, true, out);
                    self.close_conn(owner.conn, CloseReason::NodeRemoved, out);
                }
                Some(_) => {}
            }
        }
    }

    /// Closes every removed node whose grace ended at `now`, whatever it
    /// still runs (fenced, F1).
    pub(super) fn retire_due_nodes(&mut self, now: Instant, out: &mut Vec<Action>) {
        while let Some((at, id)) = self.retire_deadlines.first().cloned() {
            if at > now {
                break;
            }
            self.retire_deadlines.remove(&(at, id.clone()));
            let Some(&n) = self.node_index.get(&id) else {
                continue;
            };
            if let Some(owner) = self.nodes[n].owner {
                self.end_ownership(n, true, out);
                self.close_conn(owner.conn, CloseReason::NodeRemoved, out);
            }
        }
    }

    /// The requests waiting in queues, by arrival (the simulation's view).
    pub fn queued_requests(&self) -> Vec<RequestId> {
        let mut queued: Vec<RequestId> = self
            .lanes
            .iter()
            .flat_map(|lane| lane.queued.iter().chain(lane.queued_long.iter()))
            .collect();
        queued.sort_unstable();
        queued
    }
}
