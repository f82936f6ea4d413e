//! What Control shows: the provider snapshots (P1–P3, H5), the status
//! page's node, provider and model views (drains and removals included),
//! counters, queue depths, and reads of its leases and waiting requests.
//! A model a reload removed (kept only while its dispatched requests run
//! out) is in none of the model views.

use std::collections::BTreeSet;
use std::time::Instant;

use iop_wire::pb;

use super::outlier::OutlierState;
use super::tables::{OwnerState, ProviderLease, RequestState};
use super::{
    Control, Counters, DrainTarget, ModelView, NodePhase, NodeView, Operation, ProviderKey,
    RequestId,
};

/// What one model has free on this Edge now: the figures a cluster's
/// Edges exchange to decide where a request goes
/// ([`Control::model_capacities`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelCapacity {
    /// Free lease slots of the live candidates (ready, available, not
    /// ejected) of the lane serving each operation, in [`Operation::ALL`]
    /// order; 0 for an operation no provider of the pool serves.
    pub free_slots: [u32; Operation::ALL.len()],
    /// Requests waiting for a slot in any lane of the model.
    pub queued: u32,
}

/// Whether one provider takes new work, as the status views show it
/// ([`Control::provider_views`], in [`Control::snapshots`] order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderView {
    /// Its node id.
    pub node_id: String,
    /// Its provider id on that node.
    pub provider_id: String,
    /// Drained by an operator, itself ([`super::Input::SetDrain`] with
    /// [`DrainTarget::Provider`]).
    pub drained: bool,
    /// Its node drained by an operator ([`DrainTarget::Node`]).
    pub node_drained: bool,
    /// Its node's owner said it drains ([`super::Input::NodeDraining`]).
    pub draining: bool,
    /// No longer in the configuration (nor in any pool): kept only while
    /// its leases run out.
    pub removed: bool,
}

impl ModelCapacity {
    /// The free slots for requests of `op`.
    pub fn free_for(&self, op: Operation) -> u32 {
        self.free_slots[op as usize]
    }
}

impl Control {
    /// Whether `model` is configured.
    pub fn has_model(&self, model: &str) -> bool {
        self.model_index.contains_key(model)
    }

    /// Requests waiting for a slot now, per configured model
    /// (`iop_edge_queue_depth`).
    pub fn queue_depths(&self) -> Vec<(String, usize)> {
        (0..self.models.len())
            .filter(|&m| !self.models[m].removed)
            .map(|m| (self.models[m].spec.name.clone(), self.queued_count(m)))
            .collect()
    }

    /// Whether `target` is drained by an operator; `None` when it names no
    /// node or provider of the configuration (unknown, or removed by a
    /// reload): what the admin API answers after an
    /// [`super::Input::SetDrain`].
    pub fn drained(&self, target: &DrainTarget) -> Option<bool> {
        if !self.has_drain_target(target) {
            return None;
        }
        match target {
            DrainTarget::Node(id) => self.node_index.get(id).map(|&n| self.nodes[n].drained),
            DrainTarget::Provider(key) => self
                .provider_index
                .get(key)
                .map(|&p| self.providers[p].drained),
        }
    }

    /// The live lease of `run_id`.
    pub fn lease(&self, run_id: &str) -> Option<&ProviderLease> {
        self.leases.get(run_id).map(|e| &e.lease)
    }

    /// Every live lease, by run id.
    pub fn leases(&self) -> impl Iterator<Item = &ProviderLease> {
        self.leases.values().map(|e| &e.lease)
    }

    /// Requests not yet done, in arrival order.
    pub fn pending_requests(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.pending.keys().copied()
    }

    /// Whether `request` waits in a queue, and until when.
    pub fn queue_deadline(&self, request: RequestId) -> Option<Instant> {
        match self.pending.get(&request)?.state {
            RequestState::Queued { deadline } => Some(deadline),
            _ => None,
        }
    }

    /// Cumulative O1 counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Passive-health state of every provider, in `ProviderKey` order (the
    /// order of [`Control::snapshots`]).
    pub fn outliers(&self) -> Vec<&OutlierState> {
        self.providers.iter().map(|p| &p.outlier).collect()
    }

    /// Providers ejected now.
    pub fn ejected_count(&self) -> usize {
        self.providers
            .iter()
            .filter(|p| p.outlier.ejection().is_some())
            .count()
    }

    /// Whether `key` currently carries the unavailable overlay (H4, H5).
    pub fn is_overlaid(&self, key: &ProviderKey) -> bool {
        let Some(&p) = self.provider_index.get(key) else {
            return false;
        };
        let state = &self.providers[p];
        match self.nodes[state.node].owner {
            Some(owner) => state.overlay == Some(owner.generation),
            None => false,
        }
    }

    /// Per-provider resource snapshots (P1–P3, H5), in `ProviderKey`
    /// order.
    pub fn snapshots(&self) -> Vec<pb::ProviderSnapshot> {
        self.providers
            .iter()
            .map(|state| {
                let spec = &state.spec;
                let owner = self.nodes[state.node].ready_owner();
                let connected = owner.is_some();
                let overlaid = owner.is_some_and(|o| state.overlay == Some(o.generation));
                let mut s = pb::ProviderSnapshot {
                    node_id: state.key.node_id.to_string(),
                    provider_id: state.key.provider_id.to_string(),
                    adapter: spec.adapter.to_string(),
                    target: spec.target.to_string(),
                    category: spec.category as i32,
                    connected,
                    ..Default::default()
                };
                if !connected {
                    // P3: offline figures are all zero.
                    s.status = pb::ProviderStatus::Unavailable as i32;
                    s.health = pb::ProviderHealth::Offline as i32;
                } else if overlaid {
                    // H5: catalog identity kept, every effective figure zero.
                    s.status = pb::ProviderStatus::Unavailable as i32;
                    s.health = pb::ProviderHealth::Unavailable as i32;
                } else if !spec.enabled {
                    s.status = pb::ProviderStatus::Disabled as i32;
                    s.health = pb::ProviderHealth::Available as i32;
                } else if state.outlier.ejection().is_some() {
                    // Ejected by passive health: out of rotation (no
                    // candidate, so nothing queued for it); its leases
                    // still run out. `/status` adds the ejection.
                    s.status = pb::ProviderStatus::Unavailable as i32;
                    s.health = pb::ProviderHealth::Available as i32;
                    s.capacity = spec.capacity;
                    s.long_context_capacity = spec.long_context_capacity;
                    s.in_flight = state.in_flight;
                    s.long_in_flight = state.long_in_flight;
                } else {
                    // P2: unique pending requests listing it as a live
                    // candidate (every waiter of every lane it is filed
                    // in: a request waits in one lane), and the long ones
                    // among them.
                    let (queued, long_queued) =
                        state.pools.iter().fold((0, 0), |(q, lq), &(lane, _)| {
                            let lane = &self.lanes[lane];
                            (q + lane.queued_count(), lq + lane.queued_long.len())
                        });
                    s.status = pb::ProviderStatus::Available as i32;
                    s.health = pb::ProviderHealth::Available as i32;
                    s.capacity = spec.capacity;
                    s.long_context_capacity = spec.long_context_capacity;
                    s.in_flight = state.in_flight;
                    s.long_in_flight = state.long_in_flight;
                    s.queued = u32::try_from(queued).unwrap_or(u32::MAX);
                    s.long_queued = u32::try_from(long_queued).unwrap_or(u32::MAX);
                }
                s
            })
            .collect()
    }

    /// For each provider, in [`Control::snapshots`] order, whether it is
    /// in the pool of a model `may_use` accepts (`/status` for a key
    /// limited to some models shows only those providers).
    pub fn serves_any(&self, may_use: impl Fn(&str) -> bool) -> Vec<bool> {
        let allowed: BTreeSet<&ProviderKey> = self
            .models
            .iter()
            .filter(|m| !m.removed && may_use(&m.spec.name))
            .flat_map(|m| m.spec.providers.iter())
            .collect();
        self.providers
            .iter()
            .map(|state| allowed.contains(&state.key))
            .collect()
    }

    /// Every configured node, in id order, for the status page.
    pub fn node_views(&self) -> Vec<NodeView> {
        self.nodes
            .iter()
            .map(|n| NodeView {
                node_id: n.spec.id.clone(),
                phase: match n.owner.map(|o| o.state) {
                    None => NodePhase::Offline,
                    Some(OwnerState::Pending) => NodePhase::Registered,
                    Some(OwnerState::Ready) => NodePhase::Ready,
                },
                version: n.version.clone(),
                registered_at: n.owner.and_then(|o| o.registered_at),
                ready_at: n.owner.and_then(|o| o.ready_at),
                offline_since: n.offline_since,
                drained: n.drained,
                draining: n.owner.is_some_and(|o| o.draining),
                removed: n.removed,
            })
            .collect()
    }

    /// Every provider's drains and removal, in [`Control::snapshots`]
    /// order, for `/status`, `/metrics` and the status page.
    pub fn provider_views(&self) -> Vec<ProviderView> {
        self.providers
            .iter()
            .map(|state| {
                let node = &self.nodes[state.node];
                ProviderView {
                    node_id: state.key.node_id.to_string(),
                    provider_id: state.key.provider_id.to_string(),
                    drained: state.drained,
                    node_drained: node.drained,
                    draining: node.owner.is_some_and(|o| o.draining),
                    removed: state.removed,
                }
            })
            .collect()
    }

    /// Every configured model by name, with its free slots per operation
    /// and its queue length now (for the capacity summary a cluster member
    /// shows its peers).
    pub fn model_capacities(&self) -> Vec<(String, ModelCapacity)> {
        self.models
            .iter()
            .enumerate()
            .filter(|(_, model)| !model.removed)
            .map(|(m, model)| {
                let mut free_slots = [0u32; Operation::ALL.len()];
                for (slots, lane) in free_slots.iter_mut().zip(model.lane_of) {
                    if let Some(lane) = lane {
                        *slots = self.lanes[lane].free.iter().fold(0u32, |sum, c| {
                            sum.saturating_add(c.load.capacity.saturating_sub(c.load.in_flight))
                        });
                    }
                }
                let queued = u32::try_from(self.queued_count(m)).unwrap_or(u32::MAX);
                (
                    model.spec.name.clone(),
                    ModelCapacity { free_slots, queued },
                )
            })
            .collect()
    }

    /// Every configured model, in configured order, for the status page.
    pub fn model_views(&self) -> Vec<ModelView> {
        self.models
            .iter()
            .enumerate()
            .filter(|(_, model)| !model.removed)
            .map(|(m, model)| {
                let candidates: BTreeSet<usize> = model
                    .lanes
                    .iter()
                    .flat_map(|&lane| self.lanes[lane].free.iter().map(|c| c.provider))
                    .collect();
                ModelView {
                    model: model.spec.name.clone(),
                    providers: model.spec.providers.len(),
                    candidates: candidates.len(),
                    queued: self.queued_count(m),
                    max_queue: model.spec.max_queue,
                    routing: model.router.spec.policy,
                    routing_stats: model.router.stats.clone(),
                    tree_bytes: model.router.tree.as_ref().map_or(0, |t| t.bytes()),
                    tree_budget_bytes: model
                        .router
                        .tree
                        .as_ref()
                        .map_or(0, |_| model.router.spec.tree.budget_bytes),
                }
            })
            .collect()
    }
}
