//! `Control`: the Edge's authoritative state as a sans-IO state machine.
//!
//! It owns the node registry (which connection owns which node id, under which
//! generation, pending or ready), the provider resources of each node, model
//! pools, and the provider leases of running requests. It reads no clock and
//! opens no socket: the shells call one method per input and carry out what it
//! returns.
//!
//! ```text
//!             register (accepted)          ready (first)
//!  [no owner] ───────────────────► Pending ───────────────► Ready
//!       ▲                            │                        │
//!       └──── close / superseded ────┴── close / heartbeat ───┘
//!                                        timeout: fence (F1)
//! ```
//!
//! Invariants:
//! - A connection owns at most one node id (R1); a node id has at most one
//!   owner connection, tagged with an Edge-internal generation (R2, R5).
//! - Only a `Ready` owner is a dispatch candidate or reported connected (R4,
//!   X6).
//! - Every lease is released exactly once: on its terminal from the owning
//!   connection, on fencing of its generation, or on cancel settlement (F1).
//! - Stale inputs (from a connection that no longer owns its node id) change
//!   nothing (F2).

use std::collections::{BTreeMap, HashMap};

use iop_wire::pb;

/// Shell-assigned identity of one accepted node connection, unique for the
/// life of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Edge-internal connection generation of a node id (R2, R5); never on the
/// wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// Identity of a provider resource: `(node id, provider id)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderKey {
    /// Owning node.
    pub node_id: String,
    /// Provider id, unique per node.
    pub provider_id: String,
}

impl std::fmt::Display for ProviderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.node_id, self.provider_id)
    }
}

/// How a provider is driven (U7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchKind {
    /// OpenAI-compatible providers: raw HTTP tunnel.
    Tunnel,
    /// Ollama/native providers: normalized run.
    Run,
}

/// Static description of one provider resource.
#[derive(Debug, Clone)]
pub struct ProviderSpec {
    /// Provider id, unique per node.
    pub id: String,
    /// Adapter instance name on the node.
    pub adapter: String,
    /// Provider-side target.
    pub target: String,
    /// Lease capacity.
    pub capacity: u32,
    /// Long-context lease capacity.
    pub long_context_capacity: u32,
    /// Effective stall timeout copied into pool dispatches (W2).
    pub response_stall_timeout_ms: i64,
    /// Category (P1).
    pub category: pb::ProviderCategory,
    /// Tunnel or normalized run (U7).
    pub kind: DispatchKind,
    /// Disabled providers are never candidates.
    pub enabled: bool,
}

/// Static description of one expected node.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// Node id (equals its TLS identity name, T3).
    pub id: String,
    /// The config pushed at registration (R2).
    pub config: pb::NodeConfigPayload,
    /// Its provider resources.
    pub providers: Vec<ProviderSpec>,
}

/// Static description of one external model and its provider pool.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// External model name (E2).
    pub name: String,
    /// Pool members, in configured order (the deterministic tie-break).
    pub providers: Vec<ProviderKey>,
}

/// Everything `Control` is configured with.
#[derive(Debug, Clone, Default)]
pub struct ControlSpec {
    /// Expected nodes.
    pub nodes: Vec<NodeSpec>,
    /// Served models.
    pub models: Vec<ModelSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnerState {
    Pending,
    Ready,
}

#[derive(Debug, Clone, Copy)]
struct Owner {
    conn: ConnId,
    generation: Generation,
    state: OwnerState,
}

#[derive(Debug)]
struct NodeEntry {
    spec: NodeSpec,
    owner: Option<Owner>,
}

#[derive(Debug)]
struct ProviderState {
    spec: ProviderSpec,
    in_flight: u32,
}

/// An immutable record of one dispatched request's claim on a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The run id the request was dispatched under.
    pub run_id: String,
    /// Provider it occupies.
    pub provider: ProviderKey,
    /// The connection it was dispatched to.
    pub conn: ConnId,
    /// The generation of that connection's ownership.
    pub generation: Generation,
    /// Adapter evidence expected on the terminal (H2).
    pub adapter: String,
    /// Target evidence expected on the terminal (H2).
    pub target: String,
}

/// Outcome of a `RegisterRequest`.
#[derive(Debug, Clone, PartialEq)]
pub struct RegisterDecision {
    /// The response to send on the registering connection.
    pub response: pb::RegisterResponse,
    /// An older connection superseded by this registration: the shell closes
    /// it (R2). Its leases were released in this same step (see
    /// `released`).
    pub superseded: Option<ConnId>,
    /// Leases released because a ready owner was superseded (F1).
    pub released: Vec<Lease>,
}

/// Outcome of a `NodeReadyRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyDecision {
    /// The response to send.
    pub response: pb::NodeReadyResponse,
    /// True only on the first ready of the current pending owner: the shell
    /// emits `node.connected` (R3).
    pub became_ready: bool,
    /// The connection must close (stale, superseded or rejected sender).
    pub close: bool,
}

/// Outcome of a connection close or heartbeat timeout.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CloseOutcome {
    /// The node id whose current owner this was, if any.
    pub node_id: Option<String>,
    /// True when a dispatch-ready owner was fenced (F1).
    pub fenced: bool,
    /// Leases released by the fence, each exactly once (F1).
    pub released: Vec<Lease>,
}

/// Why a request could not be dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SelectError {
    /// The model is not configured (404).
    UnknownModel,
    /// No live provider has a free slot (503 until the queue lands).
    NoProvider,
}

/// A dispatch decision: send the request to `lease.conn`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    /// The lease taken for it.
    pub lease: Lease,
    /// Tunnel or normalized run (U7).
    pub kind: DispatchKind,
    /// Effective stall timeout of the winning provider (W2).
    pub response_stall_timeout_ms: i64,
}

/// Outcome of a terminal received from a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TerminalOutcome {
    /// The terminal matched a live lease by reception identity; the lease was
    /// released (H1, H2).
    Released(Lease),
    /// No live lease for this run on this connection: ignored (F2).
    Stale,
}

/// The Edge control state machine.
#[derive(Debug)]
pub struct Control {
    nodes: BTreeMap<String, NodeEntry>,
    providers: BTreeMap<ProviderKey, ProviderState>,
    models: BTreeMap<String, ModelSpec>,
    /// Which node id each live connection registered (R1).
    bindings: HashMap<ConnId, String>,
    leases: HashMap<String, Lease>,
    next_generation: u64,
    next_run: u64,
}

impl Control {
    /// A control state for `spec`; no node is connected.
    pub fn new(spec: ControlSpec) -> Self {
        let mut nodes = BTreeMap::new();
        let mut providers = BTreeMap::new();
        for node in spec.nodes {
            for p in &node.providers {
                providers.insert(
                    ProviderKey {
                        node_id: node.id.clone(),
                        provider_id: p.id.clone(),
                    },
                    ProviderState {
                        spec: p.clone(),
                        in_flight: 0,
                    },
                );
            }
            nodes.insert(
                node.id.clone(),
                NodeEntry {
                    spec: node,
                    owner: None,
                },
            );
        }
        let models = spec
            .models
            .into_iter()
            .map(|m| (m.name.clone(), m))
            .collect();
        Self {
            nodes,
            providers,
            models,
            bindings: HashMap::new(),
            leases: HashMap::new(),
            next_generation: 0,
            next_run: 0,
        }
    }

    /// Input: `RegisterRequest{node_id}` arrived on `conn`, whose verified TLS
    /// identity name is `tls_name` (T3).
    pub fn on_register(&mut self, conn: ConnId, tls_name: &str, node_id: &str) -> RegisterDecision {
        let reject = |reason: String| RegisterDecision {
            response: pb::RegisterResponse {
                accepted: false,
                reason,
                config: None,
            },
            superseded: None,
            released: Vec::new(),
        };
        if let Some(bound) = self.bindings.get(&conn) {
            // R1: one node id per connection; the first binding stays as is.
            return reject(format!(
                "connection already registered as node `{bound}`; one node id per connection"
            ));
        }
        if node_id != tls_name {
            return reject(format!(
                "node id `{node_id}` does not match the TLS identity name `{tls_name}`"
            ));
        }
        let Some(node) = self.nodes.get_mut(node_id) else {
            return reject(format!("node `{node_id}` is not configured at this edge"));
        };
        self.next_generation += 1;
        let generation = Generation(self.next_generation);
        let previous = node.owner.replace(Owner {
            conn,
            generation,
            state: OwnerState::Pending,
        });
        let config = node.spec.config.clone();
        self.bindings.insert(conn, node_id.to_string());
        let mut released = Vec::new();
        let superseded = previous.map(|old| {
            if old.state == OwnerState::Ready {
                released = self.fence(node_id, old);
            }
            old.conn
        });
        RegisterDecision {
            response: pb::RegisterResponse {
                accepted: true,
                reason: String::new(),
                config: Some(config),
            },
            superseded,
            released,
        }
    }

    /// Input: `NodeReadyRequest{node_id}` arrived on `conn` (R3).
    pub fn on_ready(&mut self, conn: ConnId, node_id: &str) -> ReadyDecision {
        let not_ready = |reason: &str| ReadyDecision {
            response: pb::NodeReadyResponse {
                ready: false,
                reason: reason.to_string(),
            },
            became_ready: false,
            close: true,
        };
        if self.bindings.get(&conn).map(String::as_str) != Some(node_id) {
            return not_ready("connection did not register this node id");
        }
        let Some(node) = self.nodes.get_mut(node_id) else {
            return not_ready("node is not configured");
        };
        match &mut node.owner {
            Some(owner) if owner.conn == conn => {
                let became_ready = owner.state == OwnerState::Pending;
                owner.state = OwnerState::Ready;
                ReadyDecision {
                    response: pb::NodeReadyResponse {
                        ready: true,
                        reason: String::new(),
                    },
                    became_ready,
                    close: false,
                }
            }
            _ => not_ready("superseded by a newer registration of this node id"),
        }
    }

    /// Input: `conn` closed or timed out its heartbeat (F1, F2).
    pub fn on_closed(&mut self, conn: ConnId) -> CloseOutcome {
        let Some(node_id) = self.bindings.remove(&conn) else {
            return CloseOutcome::default();
        };
        let Some(node) = self.nodes.get_mut(&node_id) else {
            return CloseOutcome::default();
        };
        match node.owner {
            Some(owner) if owner.conn == conn => {
                node.owner = None;
                let fenced = owner.state == OwnerState::Ready;
                let released = if fenced {
                    self.fence(&node_id, owner)
                } else {
                    Vec::new()
                };
                CloseOutcome {
                    node_id: Some(node_id),
                    fenced,
                    released,
                }
            }
            // A stale connection: nothing changes (F2).
            _ => CloseOutcome::default(),
        }
    }

    /// Releases every lease of `owner`'s generation exactly once (F1).
    fn fence(&mut self, node_id: &str, owner: Owner) -> Vec<Lease> {
        let run_ids: Vec<String> = self
            .leases
            .values()
            .filter(|l| l.provider.node_id == node_id && l.generation == owner.generation)
            .map(|l| l.run_id.clone())
            .collect();
        let mut released: Vec<Lease> = run_ids
            .iter()
            .filter_map(|run_id| self.release(run_id))
            .collect();
        released.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        released
    }

    fn release(&mut self, run_id: &str) -> Option<Lease> {
        let lease = self.leases.remove(run_id)?;
        if let Some(p) = self.providers.get_mut(&lease.provider) {
            p.in_flight = p.in_flight.saturating_sub(1);
        }
        Some(lease)
    }

    fn ready_owner(&self, node_id: &str) -> Option<Owner> {
        self.nodes
            .get(node_id)
            .and_then(|n| n.owner)
            .filter(|o| o.state == OwnerState::Ready)
    }

    /// Whether `model` is configured.
    pub fn has_model(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// Input: a request for `model`. Takes a lease on the least-loaded live
    /// provider with a free slot (ties: configured order) (R4, X6, W2, U7).
    pub fn select(&mut self, model: &str) -> Result<Dispatch, SelectError> {
        let pool = self.models.get(model).ok_or(SelectError::UnknownModel)?;
        let mut best: Option<(&ProviderKey, Owner, u64, u64)> = None;
        for key in &pool.providers {
            let Some(state) = self.providers.get(key) else {
                continue;
            };
            if !state.spec.enabled || state.in_flight >= state.spec.capacity {
                continue;
            }
            let Some(owner) = self.ready_owner(&key.node_id) else {
                continue;
            };
            // Compare load fractions in_flight/capacity exactly by cross
            // multiplication; the first configured wins ties.
            let (num, den) = (u64::from(state.in_flight), u64::from(state.spec.capacity));
            let better = match best {
                None => true,
                Some((_, _, bnum, bden)) => num * bden < bnum * den,
            };
            if better {
                best = Some((key, owner, num, den));
            }
        }
        let (key, owner, _, _) = best.ok_or(SelectError::NoProvider)?;
        let key = key.clone();
        self.next_run += 1;
        let run_id = format!("run-{}", self.next_run);
        let state = self
            .providers
            .get_mut(&key)
            .ok_or(SelectError::NoProvider)?;
        state.in_flight += 1;
        let lease = Lease {
            run_id: run_id.clone(),
            provider: key,
            conn: owner.conn,
            generation: owner.generation,
            adapter: state.spec.adapter.clone(),
            target: state.spec.target.clone(),
        };
        self.leases.insert(run_id, lease.clone());
        Ok(Dispatch {
            lease,
            kind: state.spec.kind,
            response_stall_timeout_ms: state.spec.response_stall_timeout_ms,
        })
    }

    /// Input: a terminal for `run_id` received on `conn` (H1). Releases the
    /// lease exactly once when `conn` is the lease's connection.
    pub fn on_terminal(&mut self, conn: ConnId, run_id: &str) -> TerminalOutcome {
        match self.leases.get(run_id) {
            Some(lease) if lease.conn == conn => match self.release(run_id) {
                Some(lease) => TerminalOutcome::Released(lease),
                None => TerminalOutcome::Stale,
            },
            _ => TerminalOutcome::Stale,
        }
    }

    /// Input: the request of `run_id` settled without a terminal (client
    /// gone after cancel, send failure). Releases its lease if still held.
    pub fn on_abandoned(&mut self, run_id: &str) -> Option<Lease> {
        self.release(run_id)
    }

    /// The node id `conn` registered, if any.
    pub fn node_of(&self, conn: ConnId) -> Option<&str> {
        self.bindings.get(&conn).map(String::as_str)
    }

    /// Whether `conn` is the dispatch-ready owner of its node id (R4).
    pub fn is_ready_owner(&self, conn: ConnId) -> bool {
        self.node_of(conn)
            .and_then(|n| self.ready_owner(n))
            .is_some_and(|o| o.conn == conn)
    }

    /// Live leases (for status and tests).
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    /// Per-provider resource snapshots (P1, P3).
    pub fn snapshots(&self) -> Vec<pb::ProviderSnapshot> {
        self.providers
            .iter()
            .map(|(key, state)| {
                let connected = self.ready_owner(&key.node_id).is_some();
                let spec = &state.spec;
                let (status, health, capacity, long_capacity, in_flight) = if !connected {
                    (
                        pb::ProviderStatus::Unavailable,
                        pb::ProviderHealth::Offline,
                        0,
                        0,
                        0,
                    )
                } else if !spec.enabled {
                    (
                        pb::ProviderStatus::Disabled,
                        pb::ProviderHealth::Available,
                        0,
                        0,
                        state.in_flight,
                    )
                } else {
                    (
                        pb::ProviderStatus::Available,
                        pb::ProviderHealth::Available,
                        spec.capacity,
                        spec.long_context_capacity,
                        state.in_flight,
                    )
                };
                pb::ProviderSnapshot {
                    node_id: key.node_id.clone(),
                    provider_id: key.provider_id.clone(),
                    adapter: spec.adapter.clone(),
                    target: spec.target.clone(),
                    category: spec.category as i32,
                    status: status as i32,
                    health: health as i32,
                    capacity,
                    long_context_capacity: long_capacity,
                    in_flight,
                    long_in_flight: 0,
                    queued: 0,
                    long_queued: 0,
                    connected,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(id: &str, capacity: u32) -> ProviderSpec {
        ProviderSpec {
            id: id.into(),
            adapter: "vllm".into(),
            target: format!("target-{id}"),
            capacity,
            long_context_capacity: 0,
            response_stall_timeout_ms: 1234,
            category: pb::ProviderCategory::LocalInference,
            kind: DispatchKind::Tunnel,
            enabled: true,
        }
    }

    fn spec() -> ControlSpec {
        ControlSpec {
            nodes: vec![
                NodeSpec {
                    id: "node-a".into(),
                    config: pb::NodeConfigPayload {
                        revision: 1,
                        ..Default::default()
                    },
                    providers: vec![provider("p1", 2)],
                },
                NodeSpec {
                    id: "node-b".into(),
                    config: pb::NodeConfigPayload::default(),
                    providers: vec![provider("p2", 1)],
                },
            ],
            models: vec![ModelSpec {
                name: "m".into(),
                providers: vec![
                    ProviderKey {
                        node_id: "node-a".into(),
                        provider_id: "p1".into(),
                    },
                    ProviderKey {
                        node_id: "node-b".into(),
                        provider_id: "p2".into(),
                    },
                ],
            }],
        }
    }

    fn ready(c: &mut Control, conn: u64, node: &str) {
        assert!(c.on_register(ConnId(conn), node, node).response.accepted);
        assert!(c.on_ready(ConnId(conn), node).became_ready);
    }

    // CONTRACT: T3 — the registered node id must equal the TLS identity name.
    #[test]
    fn register_requires_tls_name_match() {
        let mut c = Control::new(spec());
        let d = c.on_register(ConnId(1), "node-b", "node-a");
        assert!(!d.response.accepted);
        assert_eq!(
            d.response.reason,
            "node id `node-a` does not match the TLS identity name `node-b`"
        );
        assert_eq!(c.node_of(ConnId(1)), None);
    }

    #[test]
    fn unknown_node_rejected() {
        let mut c = Control::new(spec());
        let d = c.on_register(ConnId(1), "node-z", "node-z");
        assert!(!d.response.accepted);
        assert!(d.response.config.is_none());
    }

    // CONTRACT: R4 — no dispatch and no connected snapshot before the ready ack.
    #[test]
    fn pending_owner_is_not_dispatchable_or_connected() {
        let mut c = Control::new(spec());
        let d = c.on_register(ConnId(1), "node-a", "node-a");
        assert!(d.response.accepted);
        assert_eq!(d.response.config.as_ref().map(|c| c.revision), Some(1));
        assert_eq!(c.select("m"), Err(SelectError::NoProvider));
        assert!(c
            .snapshots()
            .iter()
            .all(|s| !s.connected && s.capacity == 0));
        assert!(!c.is_ready_owner(ConnId(1)));
        let r = c.on_ready(ConnId(1), "node-a");
        assert!(r.response.ready && r.became_ready && !r.close);
        assert!(c.is_ready_owner(ConnId(1)));
        let d = c.select("m").unwrap();
        assert_eq!(d.lease.conn, ConnId(1));
        assert_eq!(d.response_stall_timeout_ms, 1234);
        // Duplicate ready: true, no side effect.
        let r = c.on_ready(ConnId(1), "node-a");
        assert!(r.response.ready && !r.became_ready);
    }

    #[test]
    fn second_node_id_on_a_connection_is_rejected() {
        let mut c = Control::new(spec());
        ready(&mut c, 1, "node-a");
        let d = c.on_register(ConnId(1), "node-b", "node-b");
        assert!(!d.response.accepted);
        assert_eq!(c.node_of(ConnId(1)), Some("node-a"));
        assert!(c.is_ready_owner(ConnId(1)));
    }

    #[test]
    fn selection_prefers_least_loaded_then_config_order_and_respects_capacity() {
        let mut c = Control::new(spec());
        ready(&mut c, 1, "node-a");
        ready(&mut c, 2, "node-b");
        let first = c.select("m").unwrap();
        assert_eq!(first.lease.provider.provider_id, "p1"); // tie → config order
        let second = c.select("m").unwrap();
        assert_eq!(second.lease.provider.provider_id, "p2"); // 1/2 vs 0/1
        let third = c.select("m").unwrap();
        assert_eq!(third.lease.provider.provider_id, "p1");
        assert_eq!(c.select("m"), Err(SelectError::NoProvider));
        assert_eq!(c.select("nope"), Err(SelectError::UnknownModel));
        assert!(matches!(
            c.on_terminal(ConnId(1), &first.lease.run_id),
            TerminalOutcome::Released(_)
        ));
        // A second terminal for the same run is stale: released once.
        assert_eq!(
            c.on_terminal(ConnId(1), &first.lease.run_id),
            TerminalOutcome::Stale
        );
        assert_eq!(c.lease_count(), 2);
    }

    #[test]
    fn terminal_from_another_connection_is_stale() {
        let mut c = Control::new(spec());
        ready(&mut c, 1, "node-a");
        let d = c.select("m").unwrap();
        assert_eq!(
            c.on_terminal(ConnId(9), &d.lease.run_id),
            TerminalOutcome::Stale
        );
        assert_eq!(c.lease_count(), 1);
    }

    #[test]
    fn close_of_ready_owner_fences_and_releases_its_leases() {
        let mut c = Control::new(spec());
        ready(&mut c, 1, "node-a");
        let a = c.select("m").unwrap();
        let out = c.on_closed(ConnId(1));
        assert!(out.fenced);
        assert_eq!(out.released, vec![a.lease.clone()]);
        assert_eq!(c.lease_count(), 0);
        assert!(c
            .snapshots()
            .iter()
            .all(|s| !s.connected && s.in_flight == 0));
        // Late terminal from the dead connection changes nothing.
        assert_eq!(
            c.on_terminal(ConnId(1), &a.lease.run_id),
            TerminalOutcome::Stale
        );
        assert_eq!(c.on_closed(ConnId(1)), CloseOutcome::default());
    }

    #[test]
    fn newer_registration_supersedes_the_older_connection() {
        let mut c = Control::new(spec());
        ready(&mut c, 1, "node-a");
        let a = c.select("m").unwrap();
        let d = c.on_register(ConnId(2), "node-a", "node-a");
        assert!(d.response.accepted);
        assert_eq!(d.superseded, Some(ConnId(1)));
        assert_eq!(d.released, vec![a.lease]);
        // The old connection's late ready is refused and told to close.
        let r = c.on_ready(ConnId(1), "node-a");
        assert!(!r.response.ready && r.close);
        // Its late close changes nothing about the new pending owner.
        assert_eq!(c.on_closed(ConnId(1)), CloseOutcome::default());
        assert!(c.on_ready(ConnId(2), "node-a").became_ready);
    }
}
