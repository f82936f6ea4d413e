//! Deterministic simulation of the Edge [`Control`] state machine, and
//! focused tests of every requirement it implements (R, F, H, P, U7, W2, X6).
//!
//! # The simulation
//!
//! [`simulation`] drives `Control` with seeded random schedules: registers
//! (right id, id ≠ TLS name, unknown node, a second id on a bound
//! connection, a late one on a connection ordered closed), readies (current
//! pending owner, duplicate, superseded, never-registered, wrong id from a
//! current owner, late ones on connections ordered closed), closes of
//! ready, pending and stale connections, heartbeat timeouts (below), submits
//! (short and long, three models sharing providers, an unknown model),
//! cancels, terminals (current, stale, duplicate, wrong conn, wrong
//! evidence, random stall evidence including malformed pairs and random
//! sequences), undeliverable dispatches, command results (answers to the
//! recovery probes `Control` sent, late answers to answered or retired
//! probes, and bogus ones), clock advances, and the fleet changing
//! (below). Time is a fixed base `Instant` plus offsets; the shell's timer
//! is modelled both faithfully (every due deadline fires at its instant)
//! and late (one `handle_timeout` after a jump). Two shorter runs apply the same checks with the schedule
//! weighted towards one guarantee each:
//! [`simulation_connections_ordered_closed_never_own_or_receive_work`] and
//! [`simulation_fresh_available_answers_keep_older_unavailable_stalls_out`].
//!
//! The fleet changes at random points, interleaved with everything else:
//! configuration reloads (`Reconfigure`: capacities up and down, below
//! what runs included, providers disabled and enabled; providers, nodes
//! and models removed and added
//! back; a model moved to another pool; queue bounds and timeouts
//! changed; the same configuration again), operator drains and undrains
//! of nodes and providers (`SetDrain`, unknown targets included), and
//! owners, current or stale, saying they drain (`NodeDraining`). The
//! shadow tracks what `Control` keeps (a provider removed while leased, a
//! node removed while owned, each until it is idle or its grace ends;
//! drains across reconnects and reloads) and predicts every fleet step
//! exactly: the waiters of a removed model end `ModelRemoved`, a queue
//! over its new bound loses its newest waiters, a removed node is closed
//! `node_removed` in the step its last run ends (fenced if ready) or at
//! the end of its grace (its runs lost), a reload of the same
//! configuration and a drain change nothing a query shows. Which waiters
//! a reload or an undrain dispatches is checked as every pump is (least
//! loaded, arrival order, nothing left that fits), and no dispatch ever
//! goes to a removed, drained or draining provider, node or owner.
//!
//! A heartbeat timeout (T4) is its own operation, modelled on the shell:
//! the engine connection notices the missing answer itself and shuts the
//! socket (`heartbeat_timeout`); the Edge then gets the frames already
//! decoded, then one `Closed`. The schedule picks a connection, favouring
//! ones with a terminal or a ready to race (a ready owner running work, a
//! pending owner), composes the frames its node had sent by then (a
//! terminal for most of its runs, a late duplicate terminal, the ready of
//! a pending owner or a duplicate one, probe answers; in a random order),
//! delivers a random prefix (none, all, or a cut), drops the rest, and
//! feeds `Closed`. Runs `Control` dispatches to it in that window (a
//! decoded terminal freed a slot, a decoded ready made it ready) never
//! leave: the shell reports each `Undeliverable`, at a random point before
//! the `Closed` or after it. Besides the per-step checks, every lease the
//! connection held and every run dispatched into the window ends exactly
//! once: Completed when its terminal was decoded, Cancelled when reported
//! undeliverable before the `Closed`, otherwise Lost at the fence (F1); a
//! report after the fence is stale and changes nothing (F2).
//!
//! The semantics modelled: a connection `Control` orders closed (`Close`)
//! while it is the current owner is released in that step exactly as by
//! `Closed` (binding dropped, fenced if ready), and a connection ordered
//! closed is never an owner again, whatever late frames it sends; a
//! superseded owner is fenced first, then closed, and keeps its binding. A
//! fresh `available` CAPABILITIES answer about exactly one binding records
//! its sequence even when there is no overlay to clear. At most one
//! recovery probe per provider is outstanding: a new one retires the older,
//! whose late answer is an unknown command id (ignored, counted nowhere).
//!
//! After every step a shadow model, kept from the inputs and the actions,
//! checks the invariants listed on [`Sim::check_all`] and
//! [`Sim::process`]: dispatch only to the ready owner (R4, X6, F2), every
//! lease released exactly once (F1, H2), capacity and snapshot projections
//! (P1–P3, H5), exactly one end per request and no wait past a deadline,
//! stale inputs change nothing (F2, R1, R3), overlay transitions only as H4
//! and H6 allow, nothing dispatched or probed to a connection ordered closed
//! (R3, R4), W2/U7 on every dispatch, and that every dispatch went to the
//! least-loaded candidate with a free slot, ties to pool order (a scan of
//! the pool, the reference for `Control`'s candidate index). The focused
//! tests at the end pin the fixed bugs (connections ordered closed, probe
//! freshness) as regressions.
//!
//! A failure prints its seed; `IOP_SIM_SEED=<seed>` replays exactly that
//! schedule with a step log. The schedules derive from a printed base seed,
//! fixed by default and overridable with `IOP_SIM_BASE_SEED`.

use edge_bin::control::{RouteHint, RoutingSpec};
use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use edge_bin::control::{
    Action, AttemptEnd, CancelReason, ConnId, Control, ControlModel, ControlNode, ControlProvider,
    ControlSpec, Counters, Dispatch, DispatchKind, DrainTarget, Event, Generation, Handoff, Input,
    Operation, Operations, Outcome, ProviderKey, ProviderLease, Rejection, RequestId,
    StallEvidence, Terminal, Tunables,
};
use iop_wire::{pb, CloseReason};

mod sim_rng;
use sim_rng::Rng;

// ---------------------------------------------------------------------------
// The configured world
// ---------------------------------------------------------------------------

/// Node ids the Edge expects.
const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// A node id no configuration names.
const UNKNOWN_NODE: &str = "n9";
/// A model no configuration names.
const UNKNOWN_MODEL: &str = "m-unknown";

/// One provider resource of the fixed topology.
struct ProvDef {
    node: usize,
    id: &'static str,
    adapter: &'static str,
    target: &'static str,
    kind: DispatchKind,
    category: pb::ProviderCategory,
    enabled: bool,
}

/// Providers in `ProviderKey` order (the order of `Control::snapshots`).
/// n1/p1 and n1/p3 are two targets of one adapter instance; n2/p1 and
/// n2/p2 share adapter and target, so a CAPABILITIES answer naming them is
/// ambiguous (H6). n3/p2 is disabled.
const PROVIDERS: [ProvDef; 8] = [
    ProvDef {
        node: 0,
        id: "p1",
        adapter: "ollama-a",
        target: "llama3",
        kind: DispatchKind::Normalized,
        category: pb::ProviderCategory::LocalInference,
        enabled: true,
    },
    ProvDef {
        node: 0,
        id: "p2",
        adapter: "vllm-a",
        target: "qwen",
        kind: DispatchKind::Tunnel,
        category: pb::ProviderCategory::LocalInference,
        enabled: true,
    },
    ProvDef {
        node: 0,
        id: "p3",
        adapter: "ollama-a",
        target: "phi3",
        kind: DispatchKind::Normalized,
        category: pb::ProviderCategory::LocalInference,
        enabled: true,
    },
    ProvDef {
        node: 1,
        id: "p1",
        adapter: "vllm-b",
        target: "qwen",
        kind: DispatchKind::Tunnel,
        category: pb::ProviderCategory::LocalInference,
        enabled: true,
    },
    ProvDef {
        node: 1,
        id: "p2",
        adapter: "vllm-b",
        target: "qwen",
        kind: DispatchKind::Tunnel,
        category: pb::ProviderCategory::LocalInference,
        enabled: true,
    },
    ProvDef {
        node: 1,
        id: "p3",
        adapter: "ollama-b",
        target: "mistral",
        kind: DispatchKind::Normalized,
        category: pb::ProviderCategory::LocalInference,
        enabled: true,
    },
    ProvDef {
        node: 2,
        id: "p1",
        adapter: "api",
        target: "gpt",
        kind: DispatchKind::Tunnel,
        category: pb::ProviderCategory::Api,
        enabled: true,
    },
    ProvDef {
        node: 2,
        id: "p2",
        adapter: "ollama-c",
        target: "phi",
        kind: DispatchKind::Normalized,
        category: pb::ProviderCategory::LocalInference,
        enabled: false,
    },
];

/// Models and their pools (indices into [`PROVIDERS`]), sharing providers.
const MODELS: [(&str, &[usize]); 3] = [
    ("m-a", &[0, 3, 6]),
    ("m-b", &[1, 3, 5]),
    ("m-c", &[4, 7, 0, 2]),
];

/// The tunable numbers of a world.
#[derive(Debug, Clone)]
struct WorldParams {
    /// Per provider: (capacity, long-context capacity, stall timeout ms).
    providers: [(u32, u32, i64); 8],
    /// Per model: (max queue, queue timeout ms).
    models: [(u32, u64); 3],
    tunables: Tunables,
}

impl WorldParams {
    /// The fixed numbers the focused tests use.
    fn fixed() -> Self {
        Self {
            providers: [
                (2, 1, 11_000),
                (1, 0, 12_000),
                (1, 0, 13_000),
                (1, 1, 21_000),
                (1, 0, 22_000),
                (1, 0, 23_000),
                (1, 0, 31_000),
                (2, 0, 32_000),
            ],
            models: [(2, 100), (1, 200), (3, 150)],
            tunables: Tunables {
                cancel_settle: Duration::from_millis(50),
                recovery_probe_interval: Duration::from_millis(40),
                ..Tunables::default()
            },
        }
    }

    /// Small random capacities (1–3), long capacities (0–2), queues (1–3),
    /// short timeouts.
    fn random(rng: &mut Rng) -> Self {
        let mut providers = [(0, 0, 0); 8];
        for p in &mut providers {
            *p = (
                rng.range(1, 3) as u32,
                rng.range(0, 2) as u32,
                1_000 * rng.range(1, 600) as i64,
            );
        }
        let mut models = [(0, 0); 3];
        for m in &mut models {
            *m = (rng.range(1, 3) as u32, rng.range(30, 300));
        }
        Self {
            providers,
            models,
            tunables: Tunables {
                cancel_settle: Duration::from_millis(rng.range(10, 150)),
                recovery_probe_interval: Duration::from_millis(rng.range(20, 200)),
                retire_grace: Duration::from_millis(rng.range(20, 1_500)),
                ..Tunables::default()
            },
        }
    }
}

struct ProvInfo {
    key: ProviderKey,
    node: usize,
    spec: ControlProvider,
}

struct NodeInfo {
    id: String,
    config: pb::NodeConfigPayload,
    provs: Vec<usize>,
}

struct ModelInfo {
    name: String,
    provs: Vec<usize>,
    max_queue: u32,
    timeout: Duration,
}

/// The configuration `Control` runs with, with index tables for the shadow.
struct World {
    nodes: Vec<NodeInfo>,
    provs: Vec<ProvInfo>,
    models: Vec<ModelInfo>,
    tunables: Tunables,
}

impl World {
    fn new(params: &WorldParams) -> Self {
        let provs: Vec<ProvInfo> = PROVIDERS
            .iter()
            .zip(params.providers)
            .map(|(d, (capacity, long, stall_ms))| ProvInfo {
                key: ProviderKey {
                    node_id: NODES[d.node].to_string().into(),
                    provider_id: d.id.to_string().into(),
                },
                node: d.node,
                spec: ControlProvider {
                    id: d.id.to_string(),
                    adapter: d.adapter.to_string().into(),
                    target: d.target.to_string().into(),
                    capacity,
                    long_context_capacity: long,
                    response_stall_timeout_ms: stall_ms,
                    category: d.category,
                    kind: d.kind,
                    operations: Operations::for_kind(d.kind),
                    enabled: d.enabled,
                },
            })
            .collect();
        let nodes = NODES
            .iter()
            .enumerate()
            .map(|(i, id)| NodeInfo {
                id: id.to_string(),
                config: pb::NodeConfigPayload {
                    revision: i as u64 + 1,
                    ..Default::default()
                },
                provs: (0..provs.len()).filter(|&p| provs[p].node == i).collect(),
            })
            .collect();
        let models = MODELS
            .iter()
            .zip(params.models)
            .map(|((name, pool), (max_queue, timeout_ms))| ModelInfo {
                name: name.to_string(),
                provs: pool.to_vec(),
                max_queue,
                timeout: Duration::from_millis(timeout_ms),
            })
            .collect();
        Self {
            nodes,
            provs,
            models,
            tunables: params.tunables,
        }
    }

    fn spec(&self) -> ControlSpec {
        ControlSpec {
            nodes: self
                .nodes
                .iter()
                .map(|n| ControlNode {
                    id: n.id.clone(),
                    config: n.config.clone(),
                    providers: n
                        .provs
                        .iter()
                        .map(|&p| self.provs[p].spec.clone())
                        .collect(),
                })
                .collect(),
            models: self
                .models
                .iter()
                .map(|m| ControlModel {
                    name: m.name.clone(),
                    providers: m.provs.iter().map(|&p| self.provs[p].key.clone()).collect(),
                    max_queue: m.max_queue,
                    queue_timeout: m.timeout,
                    max_attempts: 1,
                    routing: RoutingSpec::default(),
                })
                .collect(),
            tunables: self.tunables,
        }
    }

    fn prov_index(&self, key: &ProviderKey) -> Option<usize> {
        self.provs.iter().position(|p| &p.key == key)
    }

    fn node_index(&self, id: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    fn model_index(&self, name: &str) -> Option<usize> {
        self.models.iter().position(|m| m.name == name)
    }
}

/// The figures of one provider a reload may change.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PSpec {
    capacity: u32,
    long: u32,
    enabled: bool,
}

/// One model's pool (indices into [`PROVIDERS`], in pool order) and queue.
#[derive(Debug, Clone, PartialEq)]
struct MSpec {
    pool: Vec<usize>,
    max_queue: u32,
    timeout: Duration,
}

/// What the Edge is configured with now: a subset of the world's nodes,
/// providers and models, with their figures. A reload
/// (`Input::Reconfigure`) replaces it. Identities (adapter, target, kind,
/// stall timeout), node payloads and tunables stay the world's.
#[derive(Debug, Clone, PartialEq)]
struct Config {
    nodes: Vec<bool>,
    /// A provider is configured only with its node.
    provs: Vec<Option<PSpec>>,
    /// A configured model's pool is non-empty and names configured
    /// providers only (as config validation demands).
    models: Vec<Option<MSpec>>,
}

impl Config {
    /// The world's configuration: everything, with the world's figures.
    fn of(world: &World) -> Self {
        Self {
            nodes: vec![true; world.nodes.len()],
            provs: world.provs.iter().map(|p| Some(Self::base(p))).collect(),
            models: world
                .models
                .iter()
                .map(|m| {
                    Some(MSpec {
                        pool: m.provs.clone(),
                        max_queue: m.max_queue,
                        timeout: m.timeout,
                    })
                })
                .collect(),
        }
    }

    /// A provider's figures as the world configures it.
    fn base(p: &ProvInfo) -> PSpec {
        PSpec {
            capacity: p.spec.capacity,
            long: p.spec.long_context_capacity,
            enabled: p.spec.enabled,
        }
    }

    fn spec(&self, world: &World) -> ControlSpec {
        ControlSpec {
            nodes: (0..world.nodes.len())
                .filter(|&n| self.nodes[n])
                .map(|n| ControlNode {
                    id: world.nodes[n].id.clone(),
                    config: world.nodes[n].config.clone(),
                    providers: world.nodes[n]
                        .provs
                        .iter()
                        .filter_map(|&p| {
                            let s = self.provs[p]?;
                            Some(ControlProvider {
                                capacity: s.capacity,
                                long_context_capacity: s.long,
                                enabled: s.enabled,
                                ..world.provs[p].spec.clone()
                            })
                        })
                        .collect(),
                })
                .collect(),
            models: (0..world.models.len())
                .filter_map(|m| {
                    let s = self.models[m].as_ref()?;
                    Some(ControlModel {
                        name: world.models[m].name.clone(),
                        providers: s.pool.iter().map(|&p| world.provs[p].key.clone()).collect(),
                        max_queue: s.max_queue,
                        queue_timeout: s.timeout,
                        max_attempts: 1,
                        routing: RoutingSpec::default(),
                    })
                })
                .collect(),
            tunables: world.tunables,
        }
    }

    /// The configuration `spec` describes, in the world's terms.
    fn from_spec(world: &World, spec: &ControlSpec) -> Result<Self, String> {
        let mut cfg = Self {
            nodes: vec![false; world.nodes.len()],
            provs: vec![None; world.provs.len()],
            models: vec![None; world.models.len()],
        };
        for node in &spec.nodes {
            let n = world
                .node_index(&node.id)
                .ok_or_else(|| format!("a reload names node {} of no world", node.id))?;
            cfg.nodes[n] = true;
            for provider in &node.providers {
                let key = ProviderKey {
                    node_id: node.id.as_str().into(),
                    provider_id: provider.id.as_str().into(),
                };
                let p = world
                    .prov_index(&key)
                    .ok_or_else(|| format!("a reload names provider {key} of no world"))?;
                cfg.provs[p] = Some(PSpec {
                    capacity: provider.capacity,
                    long: provider.long_context_capacity,
                    enabled: provider.enabled,
                });
            }
        }
        for model in &spec.models {
            let m = world
                .model_index(&model.name)
                .ok_or_else(|| format!("a reload names model {} of no world", model.name))?;
            let pool = model
                .providers
                .iter()
                .map(|key| world.prov_index(key).filter(|&p| cfg.provs[p].is_some()))
                .collect::<Option<Vec<usize>>>()
                .filter(|pool| !pool.is_empty())
                .ok_or_else(|| format!("model {} has an invalid pool", model.name))?;
            cfg.models[m] = Some(MSpec {
                pool,
                max_queue: model.max_queue,
                timeout: model.queue_timeout,
            });
        }
        Ok(cfg)
    }
}

// ---------------------------------------------------------------------------
// The shadow model
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    /// Open as far as the shell knows.
    Open,
    /// `Control` asked the shell to close it; its late frames may still
    /// arrive before the shell reports `Closed`.
    Closing,
    /// `Closed` was fed; the shell sends nothing more for it.
    Gone,
}

#[derive(Debug, Clone)]
struct SConn {
    id: ConnId,
    /// Its verified TLS identity name.
    identity: String,
    /// The node it registered (accepted), by index.
    bound: Option<usize>,
    life: Life,
    /// The node session's health observation sequence (W7).
    obs_seq: u64,
}

#[derive(Debug, Clone, Copy)]
struct SOwner {
    conn: ConnId,
    generation: Generation,
    ready: bool,
    /// It said it drains (`Input::NodeDraining`): no new work under this
    /// generation.
    draining: bool,
}

#[derive(Debug, Clone)]
enum SState {
    Queued { deadline: Instant },
    Dispatched { run_id: String },
    CancelPending { run_id: String, settle_at: Instant },
}

#[derive(Debug, Clone)]
struct SReq {
    model: Option<usize>,
    long: bool,
    state: SState,
    /// Whom it is charged to in its queue: one key's requests of one
    /// class run in arrival order.
    share: (u64, u8),
}

#[derive(Debug, Clone)]
struct SCmd {
    conn: ConnId,
    generation: Generation,
    node: usize,
    /// The provider whose overlay it probes (at most one outstanding probe
    /// per provider).
    prov: usize,
    adapter: String,
}

/// A lease that was released, kept to replay late/duplicate terminals.
#[derive(Debug, Clone)]
struct Released {
    run_id: String,
    conn: ConnId,
    adapter: String,
    target: String,
}

/// What the test knows `Control`'s state must be.
#[derive(Debug)]
struct Shadow {
    conns: Vec<SConn>,
    /// Connections not yet `Gone`, in creation order.
    live: Vec<ConnId>,
    owners: Vec<Option<SOwner>>,
    overlay: Vec<Option<Generation>>,
    next_probe: Vec<Option<Instant>>,
    in_flight: Vec<u32>,
    long_in_flight: Vec<u32>,
    /// Highest accepted observation sequence per (provider, generation).
    last_seq: HashMap<(usize, Generation), u64>,
    /// Bindings whose `last_seq` fresh `available` CAPABILITIES answers
    /// raised without clearing an overlay, with the `last_seq` before them
    /// (coverage of the H4 guard those answers add).
    answer_seq: HashMap<(usize, Generation), Option<u64>>,
    /// Requests not yet done.
    active: BTreeMap<RequestId, SReq>,
    /// `ended[id]`: the request got its one `Done`.
    ended: Vec<bool>,
    next_request: u64,
    leases: BTreeMap<String, ProviderLease>,
    released: Vec<Released>,
    /// Outstanding recovery probes.
    commands: BTreeMap<String, SCmd>,
    /// Probes no longer outstanding (answered, or retired by a newer probe
    /// of the same provider), kept to replay late answers: (id, conn, node).
    retired: Vec<(String, ConnId, usize)>,
    /// Every command id `Control` ever sent.
    issued: std::collections::HashSet<String>,
    /// Command ids retired by a newer probe of the same provider.
    superseded_probes: std::collections::HashSet<String>,
    counters: Counters,
    max_generation: u64,
    /// What the Edge is configured with now.
    cfg: Config,
    /// Per provider: `Control` has it (configured, or removed by a reload
    /// while leased). Its snapshots list exactly these, in this order.
    present: Vec<bool>,
    /// Per provider: removed by a reload, kept while its leases run out.
    prov_removed: Vec<bool>,
    /// Per provider: the figures `Control` holds for it (its last
    /// configured ones).
    pspec: Vec<PSpec>,
    /// Per provider: leases (all, long) over its capacity the last reload
    /// left running.
    over: Vec<(u32, u32)>,
    /// Per node: `Control` has it (configured, or removed by a reload
    /// while owned).
    node_present: Vec<bool>,
    /// Per node: removed by a reload, kept while its owner runs something.
    node_removed: Vec<bool>,
    /// Operator drains (`Input::SetDrain`), per provider and per node.
    prov_drained: Vec<bool>,
    node_drained: Vec<bool>,
    /// Per node: the end of a removed node's grace, while it is owned.
    retire: Vec<Option<Instant>>,
}

impl Shadow {
    fn new(world: &World) -> Self {
        let n = world.provs.len();
        Self {
            conns: Vec::new(),
            live: Vec::new(),
            owners: vec![None; world.nodes.len()],
            overlay: vec![None; n],
            next_probe: vec![None; n],
            in_flight: vec![0; n],
            long_in_flight: vec![0; n],
            last_seq: HashMap::new(),
            answer_seq: HashMap::new(),
            active: BTreeMap::new(),
            ended: vec![false],
            next_request: 1,
            leases: BTreeMap::new(),
            released: Vec::new(),
            commands: BTreeMap::new(),
            retired: Vec::new(),
            issued: std::collections::HashSet::new(),
            superseded_probes: std::collections::HashSet::new(),
            counters: Counters::default(),
            max_generation: 0,
            cfg: Config::of(world),
            present: vec![true; n],
            prov_removed: vec![false; n],
            pspec: world.provs.iter().map(Config::base).collect(),
            over: vec![(0, 0); n],
            node_present: vec![true; world.nodes.len()],
            node_removed: vec![false; world.nodes.len()],
            prov_drained: vec![false; n],
            node_drained: vec![false; world.nodes.len()],
            retire: vec![None; world.nodes.len()],
        }
    }

    fn conn(&self, id: ConnId) -> &SConn {
        &self.conns[id.0 as usize]
    }

    fn conn_mut(&mut self, id: ConnId) -> &mut SConn {
        &mut self.conns[id.0 as usize]
    }

    fn ready_owner(&self, node: usize) -> Option<SOwner> {
        self.owners[node].filter(|o| o.ready)
    }

    /// X6, H4: a provider is live (its snapshot shows it available, with
    /// its figures) when `Control` has it, it is enabled, its node has a
    /// ready owner, and it carries no overlay of that generation.
    fn live(&self, world: &World, p: usize) -> bool {
        self.present[p]
            && self.pspec[p].enabled
            && self
                .ready_owner(world.provs[p].node)
                .is_some_and(|o| self.overlay[p] != Some(o.generation))
    }

    /// A live provider takes new work unless a reload removed it or its
    /// node, an operator drained it or its node, or its node's owner
    /// drains.
    fn takes_new_work(&self, world: &World, p: usize) -> bool {
        let n = world.provs[p].node;
        self.live(world, p)
            && !self.prov_removed[p]
            && !self.prov_drained[p]
            && !self.node_removed[n]
            && !self.node_drained[n]
            && self.ready_owner(n).is_some_and(|o| !o.draining)
    }

    fn fits(&self, world: &World, p: usize, long: bool) -> bool {
        let spec = self.pspec[p];
        self.takes_new_work(world, p)
            && self.in_flight[p] < spec.capacity
            && (!long || self.long_in_flight[p] < spec.long)
    }

    /// Model `m`'s pool as configured now (empty: not configured).
    fn pool(&self, m: usize) -> &[usize] {
        self.cfg.models[m].as_ref().map_or(&[], |s| &s.pool)
    }

    fn queued_of_model(&self, model: usize) -> usize {
        self.active
            .values()
            .filter(|r| r.model == Some(model) && matches!(r.state, SState::Queued { .. }))
            .count()
    }

    fn live_conns(&self) -> Vec<ConnId> {
        self.live.clone()
    }

    /// Whether `conn` is the ready owner of its node id.
    fn ready_owner_of(&self, conn: ConnId) -> bool {
        self.conn(conn)
            .bound
            .and_then(|n| self.ready_owner(n))
            .is_some_and(|o| o.conn == conn)
    }

    fn is_owner(&self, conn: ConnId) -> bool {
        self.conn(conn)
            .bound
            .and_then(|n| self.owners[n])
            .is_some_and(|o| o.conn == conn)
    }

    /// Live connections `Control` has ordered closed.
    fn closing_conns(&self) -> Vec<ConnId> {
        self.live
            .iter()
            .copied()
            .filter(|&c| self.conn(c).life == Life::Closing)
            .collect()
    }

    /// Records that probe `id` is no longer outstanding; its late answers
    /// are replayed as unknown command ids.
    fn retire(&mut self, id: String, conn: ConnId, node: usize) {
        self.retired.push((id, conn, node));
        if self.retired.len() > 32 {
            self.retired.remove(0);
        }
    }
}

// ---------------------------------------------------------------------------
// Per-step expectations
// ---------------------------------------------------------------------------

/// A registry action, as compared.
#[derive(Debug, Clone, PartialEq)]
enum RegAct {
    Register {
        conn: ConnId,
        accepted: bool,
        config: Option<pb::NodeConfigPayload>,
    },
    Ready {
        conn: ConnId,
        ready: bool,
    },
    Close {
        conn: ConnId,
        reason: CloseReason,
    },
}

/// What one `handle`/`handle_timeout` call must emit, predicted from the
/// shadow before the call.
#[derive(Debug, Default)]
struct Expect {
    /// The call must change no observable state (F2, R1, R3 duplicates).
    unchanged: bool,
    /// The connection whose own binding a stale close may drop.
    unchanged_skip: Option<ConnId>,
    /// Exact registry actions, in order.
    registry: Vec<RegAct>,
    /// Exactly these requests end, with these outcomes.
    done: Vec<(RequestId, Outcome)>,
    /// Exactly these cancels are sent, each with its reason.
    cancels: Vec<(ConnId, String, CancelReason)>,
    /// Exactly these stall handoffs (H3).
    handoffs: Vec<(RequestId, Handoff)>,
    /// Exactly these events (as a multiset).
    events: Vec<Event>,
    /// Exactly these recovery probes, as (conn, adapter, provider index), in
    /// order: `Control` probes the due providers in `ProviderKey` order,
    /// which is how each command id is tied to its provider (H6).
    commands: Vec<(ConnId, String, usize)>,
    /// The request this Submit may dispatch.
    submit: Option<RequestId>,
    /// Whether queued requests may be dispatched (capacity or candidates
    /// may have appeared).
    pump: bool,
    /// An accepted register: (conn, node) becomes the pending owner.
    accepted: Option<(ConnId, usize)>,
    /// The step changes nothing observable, though it is not stale (a
    /// drain, a draining owner, a reload of the same configuration).
    quiet: bool,
    /// Owners of removed nodes this step lets go of, (node, conn): they
    /// own nothing after its actions (not before: a timeout step may
    /// probe them first).
    let_go: Vec<(usize, ConnId)>,
}

/// Everything `Control` shows through its queries, read once per step:
/// checked against the shadow, and compared before/after a stale input.
#[derive(Debug, PartialEq)]
struct Observed {
    snapshots: Vec<pb::ProviderSnapshot>,
    leases: Vec<ProviderLease>,
    pending: Vec<(RequestId, Option<Instant>)>,
    counters: Counters,
    poll: Option<Instant>,
    overlaid: Vec<bool>,
    /// Per live connection: node_of (as an index into NODES, `usize::MAX`
    /// for any other name), is_ready_owner, generation_of.
    registry: Vec<RegistryView>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct RegistryView {
    conn: ConnId,
    node: Option<usize>,
    ready_owner: bool,
    generation: Option<Generation>,
}

impl Observed {
    /// Equal, except for the registry entry of `skip` (a stale close drops
    /// that connection's own binding, as documented) and of connections
    /// first seen in this step (which must be unbound).
    fn same_as(&self, before: &Observed, skip: Option<ConnId>) -> bool {
        let registry_same = self.registry.iter().all(|after| {
            Some(after.conn) == skip
                || match before.registry.iter().find(|b| b.conn == after.conn) {
                    Some(b) => b == after,
                    None => {
                        after.node.is_none() && !after.ready_owner && after.generation.is_none()
                    }
                }
        }) && before
            .registry
            .iter()
            .all(|b| Some(b.conn) == skip || self.registry.iter().any(|a| a.conn == b.conn));
        registry_same
            && self.snapshots == before.snapshots
            && self.leases == before.leases
            && self.pending == before.pending
            && self.counters == before.counters
            && self.poll == before.poll
            && self.overlaid == before.overlaid
    }
}

/// How often each interesting path ran, summed over schedules.
#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    schedules: u64,
    steps: u64,
    dispatches: u64,
    completed: u64,
    lost: u64,
    cancelled: u64,
    queue_timeouts: u64,
    queue_full: u64,
    unknown_model: u64,
    fences: u64,
    supersedes: u64,
    first_readies: u64,
    overlays_set: u64,
    overlays_cleared: u64,
    handoffs: u64,
    probes: u64,
    stale_inputs: u64,
    timeouts: u64,
    /// Current owners released in the step `Control` ordered them closed
    /// (a ready naming another node id), pending or ready.
    released_on_close: u64,
    /// Of those, ready owners (fenced in that step).
    fenced_on_close: u64,
    /// Late frames of a connection ordered closed: registers and readies
    /// naming its own node id.
    late_frames: u64,
    /// Outstanding probes retired by a newer probe of the same provider.
    probes_retired: u64,
    /// Late answers to retired probes (unknown command ids).
    retired_answers: u64,
    /// Fresh `available` answers recorded on a binding without an overlay.
    answers_recorded: u64,
    /// Older `unavailable` stalls kept from overlaying by such an answer.
    freshness_guarded: u64,
    /// Heartbeat timeouts (T4) the schedule ran.
    heartbeat_timeouts: u64,
    /// Of those, of the ready owner (fenced in their `Closed`, F1).
    heartbeat_fences: u64,
    /// Terminals in flight at a heartbeat timeout, decoded before its
    /// `Closed` (the request completes).
    heartbeat_terminals_delivered: u64,
    /// Terminals in flight at a heartbeat timeout, lost with the socket
    /// (the request ends `Lost` at the fence).
    heartbeat_terminals_lost: u64,
    /// Readies of a pending owner decoded just before its heartbeat
    /// timeout's `Closed`: ready for that instant, then fenced.
    heartbeat_readies_delivered: u64,
    /// Readies of a pending owner lost with the socket: never ready.
    heartbeat_readies_lost: u64,
    /// Dispatches `Control` made to a timed-out connection before its
    /// `Closed` (undeliverable).
    heartbeat_undeliverable: u64,
    /// Of those, reported undeliverable before the `Closed` (cancelled);
    /// the rest end `Lost` at the fence and their report is stale.
    heartbeat_undeliverable_first: u64,
    /// Reloads fed (`Input::Reconfigure`).
    reconfigures: u64,
    /// Of those, of the configuration `Control` ran with, nothing left
    /// over from earlier ones: nothing observable may change.
    reloads_unchanged: u64,
    /// Operator drains and undrains fed (`Input::SetDrain`).
    set_drains: u64,
    /// Owners saying they drain, current or stale (`Input::NodeDraining`).
    node_drainings: u64,
    /// Providers a reload removed while leased (kept until idle).
    providers_retired: u64,
    /// Nodes a reload removed while owned.
    nodes_retired: u64,
    /// Removed nodes closed (`node_removed`) once nothing ran there.
    nodes_let_go: u64,
    /// Removed nodes closed at the end of their grace, runs lost.
    grace_ends: u64,
    /// Waiters ended by the reload that removed their model.
    model_removed: u64,
    /// Waiters over a queue bound a reload lowered (`QueueFull`).
    trimmed: u64,
    /// Reloads that left a provider with more leases than capacity.
    capacity_below_in_flight: u64,
    /// Dispatches in a reload step (room or pools a reload made).
    reload_dispatches: u64,
    /// Dispatches in an undrain step.
    undrain_dispatches: u64,
}

impl Stats {
    /// Fleet changes fed: reloads, operator drains, owners draining.
    fn fleet_inputs(&self) -> u64 {
        self.reconfigures + self.set_drains + self.node_drainings
    }

    fn add(&mut self, o: &Stats) {
        self.schedules += o.schedules;
        self.steps += o.steps;
        self.dispatches += o.dispatches;
        self.completed += o.completed;
        self.lost += o.lost;
        self.cancelled += o.cancelled;
        self.queue_timeouts += o.queue_timeouts;
        self.queue_full += o.queue_full;
        self.unknown_model += o.unknown_model;
        self.fences += o.fences;
        self.supersedes += o.supersedes;
        self.first_readies += o.first_readies;
        self.overlays_set += o.overlays_set;
        self.overlays_cleared += o.overlays_cleared;
        self.handoffs += o.handoffs;
        self.probes += o.probes;
        self.stale_inputs += o.stale_inputs;
        self.timeouts += o.timeouts;
        self.released_on_close += o.released_on_close;
        self.fenced_on_close += o.fenced_on_close;
        self.late_frames += o.late_frames;
        self.probes_retired += o.probes_retired;
        self.retired_answers += o.retired_answers;
        self.answers_recorded += o.answers_recorded;
        self.freshness_guarded += o.freshness_guarded;
        self.heartbeat_timeouts += o.heartbeat_timeouts;
        self.heartbeat_fences += o.heartbeat_fences;
        self.heartbeat_terminals_delivered += o.heartbeat_terminals_delivered;
        self.heartbeat_terminals_lost += o.heartbeat_terminals_lost;
        self.heartbeat_readies_delivered += o.heartbeat_readies_delivered;
        self.heartbeat_readies_lost += o.heartbeat_readies_lost;
        self.heartbeat_undeliverable += o.heartbeat_undeliverable;
        self.heartbeat_undeliverable_first += o.heartbeat_undeliverable_first;
        self.reconfigures += o.reconfigures;
        self.reloads_unchanged += o.reloads_unchanged;
        self.set_drains += o.set_drains;
        self.node_drainings += o.node_drainings;
        self.providers_retired += o.providers_retired;
        self.nodes_retired += o.nodes_retired;
        self.nodes_let_go += o.nodes_let_go;
        self.grace_ends += o.grace_ends;
        self.model_removed += o.model_removed;
        self.trimmed += o.trimmed;
        self.capacity_below_in_flight += o.capacity_below_in_flight;
        self.reload_dispatches += o.reload_dispatches;
        self.undrain_dispatches += o.undrain_dispatches;
    }
}

// ---------------------------------------------------------------------------
// The simulator
// ---------------------------------------------------------------------------

/// Most connections the schedule keeps open at once.
const MAX_LIVE_CONNS: usize = 7;

/// How a schedule weighs its operations: the main run, and two runs that
/// dwell on one guarantee each (same checks, different emphasis).
#[derive(Debug)]
struct Profile {
    /// Relative weights of: register, ready, close, heartbeat timeout,
    /// submit, cancel, terminal, undeliverable, command result, clock
    /// advance, reload, operator drain, owner draining.
    ops: [u64; 13],
    /// Percent of registers and readies aimed at the closing paths: a
    /// current owner naming another node id, and late frames of a
    /// connection `Control` ordered closed.
    closing_pct: u64,
    /// Percent of observation sequences just behind the session's latest,
    /// and of terminals whose unavailable evidence races a probe answer
    /// that recorded a newer sequence (observed before the answer, arriving
    /// after it).
    recent_seq_pct: u64,
}

/// The main run: every path, evenly.
const MAIN: Profile = Profile {
    ops: [10, 10, 7, 3, 19, 6, 18, 3, 10, 17, 3, 2, 1],
    closing_pct: 10,
    recent_seq_pct: 5,
};

/// Owners ordered closed while work waits, and their late frames.
const CLOSING: Profile = Profile {
    ops: [16, 22, 6, 2, 18, 3, 14, 2, 6, 13, 2, 1, 1],
    closing_pct: 45,
    recent_seq_pct: 5,
};

/// Stall evidence interleaved with recovery-probe answers.
const FRESHNESS: Profile = Profile {
    ops: [6, 6, 3, 1, 18, 3, 28, 1, 22, 13, 2, 1, 1],
    closing_pct: 5,
    recent_seq_pct: 35,
};

const WELL_FORMED: [(pb::ProviderHealth, pb::LivenessClassification); 3] = [
    (
        pb::ProviderHealth::Available,
        pb::LivenessClassification::RequestStalled,
    ),
    (
        pb::ProviderHealth::Unavailable,
        pb::LivenessClassification::ProviderUnhealthy,
    ),
    (
        pb::ProviderHealth::Unknown,
        pb::LivenessClassification::HealthUnknown,
    ),
];

const HEALTHS: [pb::ProviderHealth; 5] = [
    pb::ProviderHealth::Unspecified,
    pb::ProviderHealth::Available,
    pb::ProviderHealth::Unavailable,
    pb::ProviderHealth::Unknown,
    pb::ProviderHealth::Offline,
];

const CLASSIFICATIONS: [pb::LivenessClassification; 4] = [
    pb::LivenessClassification::Unspecified,
    pb::LivenessClassification::RequestStalled,
    pb::LivenessClassification::ProviderUnhealthy,
    pb::LivenessClassification::HealthUnknown,
];

/// W5: the shadow's own list of allowed (health, classification) pairs.
fn well_formed(s: &StallEvidence) -> bool {
    WELL_FORMED.contains(&(s.health, s.classification))
}

/// What a heartbeat timeout's drain did with the connection's runs.
#[derive(Debug, Default)]
struct Drained {
    /// Runs whose terminal was decoded before the `Closed`.
    delivered_terminals: Vec<String>,
    /// Runs whose terminal was in flight and lost with the socket.
    lost_terminals: Vec<String>,
    /// Requests dispatched into the window, and whether their undeliverable
    /// report came before the `Closed`.
    window: Vec<(RequestId, bool)>,
}

struct Sim<'w> {
    world: &'w World,
    control: Control,
    sh: Shadow,
    rng: Rng,
    now: Instant,
    base: Instant,
    out: Vec<Action>,
    verbose: bool,
    /// How the schedule weighs its operations.
    profile: &'static Profile,
    stats: Stats,
    /// The input of the step being checked (`None`: a timeout), for
    /// failure messages.
    current: Option<Input>,
    /// The connection the current step fed `Closed` for.
    just_closed: Option<ConnId>,
    /// What the previous step observed.
    last: Option<Observed>,
    /// The connection whose heartbeat timed out (T4) while the shell
    /// drains its decoded frames: nothing sent to it arrives.
    timed_out: Option<ConnId>,
    /// Requests `Control` dispatched to `timed_out` whose undeliverable
    /// report the shell has not fed yet.
    undeliverable: Vec<RequestId>,
    /// While set, every `Done` of every step, in order.
    done_log: Option<Vec<(RequestId, Outcome)>>,
}

impl<'w> Sim<'w> {
    fn new(
        world: &'w World,
        rng: Rng,
        base: Instant,
        verbose: bool,
        profile: &'static Profile,
    ) -> Self {
        Self {
            world,
            control: Control::new(world.spec()),
            sh: Shadow::new(world),
            rng,
            now: base,
            base,
            out: Vec::new(),
            verbose,
            profile,
            stats: Stats::default(),
            current: None,
            just_closed: None,
            last: None,
            timed_out: None,
            undeliverable: Vec::new(),
            done_log: None,
        }
    }

    fn ms(&self) -> u128 {
        self.now.duration_since(self.base).as_millis()
    }

    fn fail(&self, what: impl std::fmt::Display) -> String {
        format!(
            "step {} at t+{}ms, input {}: {what}",
            self.stats.steps,
            self.ms(),
            match &self.current {
                Some(input) => format!("{input:?}"),
                None => "handle_timeout".to_string(),
            }
        )
    }

    // ---- generators ------------------------------------------------------

    /// Runs schedule operations until at least `min_steps` Control calls ran.
    fn run(&mut self, min_steps: u64) -> Result<(), String> {
        while self.stats.steps < min_steps {
            self.op()?;
        }
        Ok(())
    }

    fn op(&mut self) -> Result<(), String> {
        let ops = &self.profile.ops;
        let mut roll = self.rng.below(ops.iter().sum());
        let mut op = 0;
        while op + 1 < ops.len() && roll >= ops[op] {
            roll -= ops[op];
            op += 1;
        }
        match op {
            0 => self.gen_register(),
            1 => self.gen_ready(),
            2 => self.gen_closed(),
            3 => self.gen_heartbeat_timeout(),
            4 => self.gen_submit(),
            5 => self.gen_cancel(),
            6 => self.gen_terminal(),
            7 => self.gen_undeliverable(),
            8 => self.gen_command_result(),
            9 => self.gen_advance(),
            10 => self.gen_reconfigure(),
            11 => self.gen_set_drain(),
            _ => self.gen_node_draining(),
        }
    }

    fn new_conn(&mut self, identity: String) -> ConnId {
        let id = ConnId(self.sh.conns.len() as u64);
        self.sh.conns.push(SConn {
            id,
            identity,
            bound: None,
            life: Life::Open,
            obs_seq: 0,
        });
        self.sh.live.push(id);
        id
    }

    fn random_node_name(&mut self) -> String {
        if self.rng.chance(12) {
            UNKNOWN_NODE.to_string()
        } else {
            NODES[self.rng.below(NODES.len() as u64) as usize].to_string()
        }
    }

    fn gen_register(&mut self) -> Result<(), String> {
        if self.rng.chance(self.profile.closing_pct) {
            // A late register of a connection ordered closed (rejected,
            // superseded, or let go of after a bad ready) naming its own
            // identity: it must reconnect instead (R3), never own again.
            if let Some(conn) = self.rng.pick(&self.sh.closing_conns()) {
                self.stats.late_frames += 1;
                let identity = self.sh.conn(conn).identity.clone();
                return self.apply(Input::Register {
                    conn,
                    tls_name: identity.clone(),
                    node_id: identity,
                });
            }
        }
        if self.sh.live_conns().len() >= MAX_LIVE_CONNS {
            return self.gen_closed();
        }
        if self.rng.chance(18) {
            // R1: a second RegisterRequest on an already bound connection.
            let bound: Vec<ConnId> = self
                .sh
                .conns
                .iter()
                .filter(|c| c.life != Life::Gone && c.bound.is_some())
                .map(|c| c.id)
                .collect();
            if let Some(conn) = self.rng.pick(&bound) {
                let node_id = self.random_node_name();
                let tls_name = self.sh.conn(conn).identity.clone();
                return self.apply(Input::Register {
                    conn,
                    tls_name,
                    node_id,
                });
            }
        }
        // A new connection; prefer nodes without a ready owner.
        let idle: Vec<usize> = (0..NODES.len())
            .filter(|&n| self.sh.ready_owner(n).is_none())
            .collect();
        let identity = if self.rng.chance(12) {
            UNKNOWN_NODE.to_string()
        } else if !idle.is_empty() && self.rng.chance(70) {
            let n = self.rng.pick(&idle).unwrap_or(0);
            NODES[n].to_string()
        } else {
            NODES[self.rng.below(NODES.len() as u64) as usize].to_string()
        };
        let node_id = match self.rng.below(100) {
            0..=79 => identity.clone(),
            80..=89 => NODES[self.rng.below(NODES.len() as u64) as usize].to_string(),
            _ => UNKNOWN_NODE.to_string(),
        };
        let conn = self.new_conn(identity.clone());
        self.apply(Input::Register {
            conn,
            tls_name: identity,
            node_id,
        })
    }

    fn gen_ready(&mut self) -> Result<(), String> {
        if self.rng.chance(self.profile.closing_pct) {
            if self.rng.chance(50) {
                // A current owner (pending or ready) naming another node
                // id: ordered closed, and released in the same step.
                let owners: Vec<(ConnId, usize)> = (0..NODES.len())
                    .filter_map(|n| self.sh.owners[n].map(|o| (o.conn, n)))
                    .collect();
                if let Some((conn, n)) = self.rng.pick(&owners) {
                    // Any name but its own: another node's, or (index 3) an
                    // unknown one.
                    let k = NODES.len() + 1;
                    let other = (n + 1 + self.rng.below(NODES.len() as u64) as usize) % k;
                    let node_id = NODES.get(other).copied().unwrap_or(UNKNOWN_NODE);
                    return self.apply(Input::Ready {
                        conn,
                        node_id: node_id.to_string(),
                    });
                }
            } else if let Some(conn) = self.rng.pick(&self.sh.closing_conns()) {
                // A late ready of a connection ordered closed, naming the
                // node id it registered (or claims): never activates it.
                self.stats.late_frames += 1;
                let c = self.sh.conn(conn);
                let node_id = c.bound.map_or(c.identity.clone(), |n| NODES[n].to_string());
                return self.apply(Input::Ready { conn, node_id });
            }
        }
        let pending: Vec<(ConnId, usize)> = (0..NODES.len())
            .filter_map(|n| self.sh.owners[n].filter(|o| !o.ready).map(|o| (o.conn, n)))
            .collect();
        let ready: Vec<(ConnId, usize)> = (0..NODES.len())
            .filter_map(|n| self.sh.ready_owner(n).map(|o| (o.conn, n)))
            .collect();
        let superseded: Vec<(ConnId, usize)> = self
            .sh
            .conns
            .iter()
            .filter(|c| c.life != Life::Gone)
            .filter_map(|c| c.bound.map(|n| (c.id, n)))
            .filter(|&(c, _)| !self.sh.is_owner(c))
            .collect();
        let bound: Vec<(ConnId, usize)> = self
            .sh
            .conns
            .iter()
            .filter(|c| c.life != Life::Gone)
            .filter_map(|c| c.bound.map(|n| (c.id, n)))
            .collect();
        let roll = self.rng.below(100);
        let chosen = match roll {
            0..=44 => self.rng.pick(&pending),
            45..=59 => self.rng.pick(&ready),
            60..=74 => self.rng.pick(&superseded),
            _ => None,
        };
        if let Some((conn, n)) = chosen {
            return self.apply(Input::Ready {
                conn,
                node_id: NODES[n].to_string(),
            });
        }
        if roll >= 85 {
            // A bound connection naming another node id.
            if let Some((conn, n)) = self.rng.pick(&bound) {
                let mut node_id = self.random_node_name();
                if node_id == NODES[n] {
                    node_id = UNKNOWN_NODE.to_string();
                }
                return self.apply(Input::Ready { conn, node_id });
            }
        }
        // A connection that never registered (new, or rejected earlier).
        let unbound: Vec<ConnId> = self
            .sh
            .conns
            .iter()
            .filter(|c| c.life != Life::Gone && c.bound.is_none())
            .map(|c| c.id)
            .collect();
        let conn = match self.rng.pick(&unbound) {
            Some(c) if self.rng.chance(50) => c,
            _ => {
                if self.sh.live_conns().len() >= MAX_LIVE_CONNS {
                    return self.gen_closed();
                }
                let identity = self.random_node_name();
                self.new_conn(identity)
            }
        };
        let node_id = self.random_node_name();
        self.apply(Input::Ready { conn, node_id })
    }

    fn gen_closed(&mut self) -> Result<(), String> {
        let live = self.sh.live_conns();
        let closing: Vec<ConnId> = live
            .iter()
            .copied()
            .filter(|&c| self.sh.conn(c).life == Life::Closing)
            .collect();
        let ready: Vec<ConnId> = (0..NODES.len())
            .filter_map(|n| self.sh.ready_owner(n).map(|o| o.conn))
            .collect();
        let pending: Vec<ConnId> = (0..NODES.len())
            .filter_map(|n| self.sh.owners[n].filter(|o| !o.ready).map(|o| o.conn))
            .collect();
        let stale: Vec<ConnId> = live
            .iter()
            .copied()
            .filter(|&c| !self.sh.is_owner(c))
            .collect();
        // A node that said it drains goes away soon after, as a rule.
        let draining: Vec<ConnId> = (0..NODES.len())
            .filter_map(|n| {
                self.sh
                    .ready_owner(n)
                    .filter(|o| o.draining)
                    .map(|o| o.conn)
            })
            .collect();
        let chosen = match self.rng.below(100) {
            0..=39 => self.rng.pick(&closing),
            40..=59 => match self.rng.pick(&draining) {
                Some(c) if self.rng.chance(60) => Some(c),
                _ => self.rng.pick(&ready),
            },
            60..=74 => self.rng.pick(&pending),
            _ => self.rng.pick(&stale),
        };
        match chosen.or_else(|| self.rng.pick(&live)) {
            Some(conn) => self.apply(Input::Closed {
                conn,
                drained: false,
            }),
            None => self.gen_submit(),
        }
    }

    /// T4: `conn`'s heartbeat goes unanswered. The engine connection
    /// closes the socket itself (`heartbeat_timeout`); the shell then gets
    /// the frames it had already decoded, and one `Closed`. Of the frames
    /// the node had sent by then ([`Sim::in_flight_frames`]), a random
    /// prefix was decoded and is delivered; the rest are lost with the
    /// socket. Runs `Control` dispatches to it meanwhile never leave: the
    /// shell reports each undeliverable, before or after the `Closed`
    /// (the send fails at once, the report races the drain).
    ///
    /// Beyond the per-step checks: every lease the connection held and
    /// every run dispatched into the window ends exactly once, Completed
    /// when its terminal was decoded, Cancelled when reported
    /// undeliverable before the `Closed`, otherwise Lost at the fence
    /// (F1); nothing of the connection survives the `Closed`.
    fn gen_heartbeat_timeout(&mut self) -> Result<(), String> {
        let live = self.sh.live_conns();
        // Favour connections with a terminal or a ready to race: ready
        // owners running work, pending owners.
        let favoured: Vec<ConnId> = live
            .iter()
            .copied()
            .filter(|&c| {
                self.sh.leases.values().any(|l| l.conn == c)
                    || self
                        .sh
                        .owners
                        .iter()
                        .flatten()
                        .any(|o| o.conn == c && !o.ready)
            })
            .collect();
        let conn = match self.rng.pick(&favoured) {
            Some(c) if self.rng.chance(85) => c,
            _ => match self.rng.pick(&live) {
                Some(c) => c,
                None => return self.gen_register(),
            },
        };
        self.stats.heartbeat_timeouts += 1;
        if self.sh.ready_owner_of(conn) {
            self.stats.heartbeat_fences += 1;
        }
        let held: Vec<(String, RequestId)> = self
            .sh
            .leases
            .values()
            .filter(|l| l.conn == conn)
            .map(|l| (l.run_id.clone(), l.request))
            .collect();
        let frames = self.in_flight_frames(conn);
        let decoded = match self.rng.below(100) {
            0..=19 => 0,
            20..=39 => frames.len(),
            _ => self.rng.below(frames.len() as u64 + 1) as usize,
        };
        if self.verbose {
            println!(
                "-- heartbeat timeout of {conn:?}: {decoded} of {} frames in flight decoded",
                frames.len()
            );
        }
        self.timed_out = Some(conn);
        self.undeliverable.clear();
        self.done_log = Some(Vec::new());
        let result = self.drain_timed_out(conn, frames, decoded);
        self.timed_out = None;
        let log = self.done_log.take().unwrap_or_default();
        let drained = result?;
        // Each request ends once, the way its frames decided.
        let mut decided: Vec<(RequestId, Outcome)> = Vec::new();
        for (run_id, request) in &held {
            let completed = drained.delivered_terminals.contains(run_id);
            if completed {
                self.stats.heartbeat_terminals_delivered += 1;
            } else if drained.lost_terminals.contains(run_id) {
                self.stats.heartbeat_terminals_lost += 1;
            }
            let want = if completed {
                Outcome::Completed
            } else {
                Outcome::Lost
            };
            decided.push((*request, want));
        }
        for &(request, cancelled) in &drained.window {
            let want = if cancelled {
                Outcome::Cancelled
            } else {
                Outcome::Lost
            };
            decided.push((request, want));
        }
        for (request, want) in decided {
            let got: Vec<&Outcome> = log
                .iter()
                .filter(|(r, _)| *r == request)
                .map(|(_, o)| o)
                .collect();
            if got != [&want] || self.sh.active.contains_key(&request) {
                return Err(self.fail(format!(
                    "heartbeat timeout of {conn:?} (F1, T4): {request:?} must end once, {want:?}; ended {got:?}"
                )));
            }
        }
        if self.sh.leases.values().any(|l| l.conn == conn) || self.control.node_of(conn).is_some() {
            return Err(self.fail(format!(
                "{conn:?} keeps a lease or a binding after its heartbeat timeout (F1)"
            )));
        }
        Ok(())
    }

    /// Feeds the decoded prefix of a timed-out connection's frames, the
    /// undeliverable reports racing it, its `Closed`, then the reports
    /// that came after.
    fn drain_timed_out(
        &mut self,
        conn: ConnId,
        frames: Vec<Input>,
        decoded: usize,
    ) -> Result<Drained, String> {
        let mut drained = Drained::default();
        let mut frames = frames.into_iter();
        for frame in frames.by_ref().take(decoded) {
            match &frame {
                Input::Terminal(t) => {
                    drained.delivered_terminals.push(t.run_id.clone());
                }
                Input::Ready { .. } if self.sh.is_owner(conn) && !self.sh.ready_owner_of(conn) => {
                    self.stats.heartbeat_readies_delivered += 1;
                }
                _ => {}
            }
            self.apply(frame)?;
            self.report_undeliverable(&mut drained, false)?;
        }
        for frame in frames {
            match frame {
                Input::Terminal(t) => drained.lost_terminals.push(t.run_id),
                Input::Ready { .. } => self.stats.heartbeat_readies_lost += 1,
                _ => {}
            }
        }
        self.apply(Input::Closed {
            conn,
            drained: false,
        })?;
        // Reported after the `Closed`: their requests ended Lost at the
        // fence; the reports are stale.
        self.report_undeliverable(&mut drained, true)?;
        Ok(drained)
    }

    /// Feeds undeliverable reports of runs dispatched to the timed-out
    /// connection: each with even odds now, or every one when `all`.
    fn report_undeliverable(&mut self, drained: &mut Drained, all: bool) -> Result<(), String> {
        while let Some(i) = (0..self.undeliverable.len()).find(|_| all || self.rng.chance(50)) {
            let request = self.undeliverable.remove(i);
            drained.window.push((request, !all));
            if !all {
                self.stats.heartbeat_undeliverable_first += 1;
            }
            self.apply(Input::Undeliverable { request })?;
        }
        Ok(())
    }

    /// The frames `conn`'s node had sent when its heartbeat timed out, in
    /// the order it sent them: a terminal for most of its runs (random
    /// evidence, as [`Sim::gen_terminal`]), a late duplicate terminal of a
    /// run already released, the ready of a pending owner (or a duplicate
    /// of a ready one), answers to its outstanding recovery probes.
    fn in_flight_frames(&mut self, conn: ConnId) -> Vec<Input> {
        let mut frames = Vec::new();
        let leases: Vec<ProviderLease> = self
            .sh
            .leases
            .values()
            .filter(|l| l.conn == conn)
            .cloned()
            .collect();
        for l in leases {
            if !self.rng.chance(70) {
                continue;
            }
            let (adapter, target) = self.gen_evidence(&l.adapter, &l.target);
            let stall = self.gen_stall(conn);
            frames.push(Input::Terminal(Terminal {
                conn,
                run_id: l.run_id,
                adapter,
                target,
                stall,
                end: AttemptEnd::Other,
                committed: true,
            }));
        }
        let released: Vec<Released> = self
            .sh
            .released
            .iter()
            .filter(|r| r.conn == conn)
            .cloned()
            .collect();
        if let Some(r) = self.rng.pick(&released).filter(|_| self.rng.chance(15)) {
            frames.push(Input::Terminal(Terminal {
                conn,
                run_id: r.run_id,
                adapter: r.adapter,
                target: r.target,
                stall: None,
                end: AttemptEnd::Other,
                committed: true,
            }));
        }
        if let Some(n) = self.sh.conn(conn).bound {
            let pending = self.sh.is_owner(conn) && !self.sh.ready_owner_of(conn);
            if self.rng.chance(if pending { 75 } else { 10 }) {
                frames.push(Input::Ready {
                    conn,
                    node_id: NODES[n].to_string(),
                });
            }
        }
        let commands: Vec<(String, SCmd)> = self
            .sh
            .commands
            .iter()
            .filter(|(_, c)| c.conn == conn)
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect();
        for (id, cmd) in commands {
            if self.rng.chance(50) {
                let response = self.gen_answer(id, conn, cmd.node, &cmd.adapter);
                frames.push(Input::CommandResult { conn, response });
            }
        }
        // Any order is one the node could have sent them in.
        for i in (1..frames.len()).rev() {
            let j = self.rng.below(i as u64 + 1) as usize;
            frames.swap(i, j);
        }
        frames
    }

    fn gen_submit(&mut self) -> Result<(), String> {
        let model = if self.rng.chance(5) {
            UNKNOWN_MODEL.to_string()
        } else {
            MODELS[self.rng.below(MODELS.len() as u64) as usize]
                .0
                .to_string()
        };
        let long = self.rng.chance(30);
        let request = RequestId(self.sh.next_request);
        // Three keys, three classes, weights and costs at random: the
        // queue discipline is part of every schedule.
        let share = edge_bin::control::fair::Share {
            principal: self.rng.below(3),
            class: [10, 50, 90][self.rng.below(3) as usize],
            weight: 1 + self.rng.below(3) as u32,
            cost: 1 + self.rng.below(2_000),
        };
        self.apply(Input::Submit {
            request,
            model,
            operation: Operation::ChatCompletions,
            long,
            hint: RouteHint::default(),
            share,
        })
    }

    fn gen_cancel(&mut self) -> Result<(), String> {
        let queued: Vec<RequestId> = self
            .sh
            .active
            .iter()
            .filter(|(_, r)| matches!(r.state, SState::Queued { .. }))
            .map(|(id, _)| *id)
            .collect();
        let dispatched: Vec<RequestId> = self
            .sh
            .active
            .iter()
            .filter(|(_, r)| !matches!(r.state, SState::Queued { .. }))
            .map(|(id, _)| *id)
            .collect();
        let chosen = match self.rng.below(100) {
            0..=34 => self.rng.pick(&queued),
            35..=69 => self.rng.pick(&dispatched),
            70..=84 => self.ended_request(),
            _ => None,
        };
        let request = chosen.unwrap_or(RequestId(self.sh.next_request + 1000));
        let reason = match self.rng.below(3) {
            0 => CancelReason::ClientDisconnect,
            1 => CancelReason::ClientWriteStall,
            _ => CancelReason::ClientTooSlow,
        };
        self.apply(Input::Cancel { request, reason })
    }

    fn ended_request(&mut self) -> Option<RequestId> {
        if self.sh.next_request <= 1 {
            return None;
        }
        let id = self.rng.range(1, self.sh.next_request - 1);
        self.sh.ended[id as usize].then_some(RequestId(id))
    }

    fn gen_undeliverable(&mut self) -> Result<(), String> {
        let dispatched: Vec<RequestId> = self
            .sh
            .active
            .iter()
            .filter(|(_, r)| !matches!(r.state, SState::Queued { .. }))
            .map(|(id, _)| *id)
            .collect();
        let request = match self.rng.pick(&dispatched) {
            Some(r) if self.rng.chance(60) => r,
            _ => RequestId(self.rng.range(1, self.sh.next_request + 3)),
        };
        self.apply(Input::Undeliverable { request })
    }

    fn gen_seq(&mut self, conn: ConnId) -> Option<u64> {
        if self.rng.chance(self.profile.recent_seq_pct) {
            let behind = self.rng.below(3);
            return Some(self.sh.conn(conn).obs_seq.saturating_sub(behind));
        }
        let roll = self.rng.below(100);
        let step = self.rng.range(1, 2);
        let c = &mut self.sh.conns[conn.0 as usize];
        match roll {
            0..=14 => None,
            15..=74 => {
                c.obs_seq += step;
                Some(c.obs_seq)
            }
            _ => {
                let bound = c.obs_seq + 2;
                Some(self.rng.below(bound))
            }
        }
    }

    fn gen_stall(&mut self, conn: ConnId) -> Option<StallEvidence> {
        if self.rng.chance(40) {
            return None;
        }
        let (health, classification) = if self.rng.chance(75) {
            match self.rng.below(4) {
                0 => WELL_FORMED[0],
                1 | 2 => WELL_FORMED[1],
                _ => WELL_FORMED[2],
            }
        } else {
            (
                HEALTHS[self.rng.below(HEALTHS.len() as u64) as usize],
                CLASSIFICATIONS[self.rng.below(CLASSIFICATIONS.len() as u64) as usize],
            )
        };
        let seq = self.gen_seq(conn);
        Some(StallEvidence {
            health,
            classification,
            seq,
        })
    }

    /// Typed adapter/target evidence: usually right, sometimes another
    /// provider's or bogus (H2).
    fn gen_evidence(&mut self, adapter: &str, target: &str) -> (String, String) {
        match self.rng.below(100) {
            0..=79 => (adapter.to_string(), target.to_string()),
            80..=87 => {
                let other = &PROVIDERS[self.rng.below(PROVIDERS.len() as u64) as usize];
                (other.adapter.to_string(), target.to_string())
            }
            88..=95 => {
                let other = &PROVIDERS[self.rng.below(PROVIDERS.len() as u64) as usize];
                (adapter.to_string(), other.target.to_string())
            }
            _ => ("bogus".to_string(), "bogus".to_string()),
        }
    }

    fn gen_terminal(&mut self) -> Result<(), String> {
        let live = self.sh.live_conns();
        let leases: Vec<ProviderLease> = self.sh.leases.values().cloned().collect();
        let released: Vec<Released> = self
            .sh
            .released
            .iter()
            .filter(|r| self.sh.conn(r.conn).life != Life::Gone)
            .cloned()
            .collect();
        if self.rng.chance(self.profile.recent_seq_pct) {
            // A run of a provider a probe answer observed available without
            // clearing anything ends with unavailable evidence observed
            // before that answer (older than it, newer than anything else):
            // the H4 guard of fresh answers.
            let racing: Vec<(ProviderLease, u64, u64)> = leases
                .iter()
                .filter_map(|l| {
                    let p = self.world.prov_index(&l.provider)?;
                    let before = self.sh.answer_seq.get(&(p, l.generation))?;
                    let answered = *self.sh.last_seq.get(&(p, l.generation))?;
                    Some((l.clone(), before.map_or(0, |b| b + 1), answered))
                })
                .collect();
            if let Some((l, lo, hi)) = self.rng.pick(&racing) {
                let seq = self.rng.range(lo, hi);
                return self.apply(Input::Terminal(Terminal {
                    conn: l.conn,
                    run_id: l.run_id,
                    adapter: l.adapter.to_string(),
                    target: l.target.to_string(),
                    stall: Some(StallEvidence {
                        health: WELL_FORMED[1].0,
                        classification: WELL_FORMED[1].1,
                        seq: Some(seq),
                    }),
                    end: AttemptEnd::Other,
                    committed: true,
                }));
            }
        }
        let roll = self.rng.below(100);
        let (conn, run_id, adapter, target) = match roll {
            0..=64 if !leases.is_empty() => {
                let l = self.rng.pick(&leases).ok_or("no lease")?;
                (
                    l.conn,
                    l.run_id,
                    l.adapter.to_string(),
                    l.target.to_string(),
                )
            }
            65..=76 if !leases.is_empty() => {
                // H1: the right run id and evidence on another connection
                // (another node, or a superseded one of the same node).
                let l = self.rng.pick(&leases).ok_or("no lease")?;
                let others: Vec<ConnId> = live.iter().copied().filter(|&c| c != l.conn).collect();
                match self.rng.pick(&others) {
                    Some(c) => (c, l.run_id, l.adapter.to_string(), l.target.to_string()),
                    None => return self.gen_submit(),
                }
            }
            77..=92 if !released.is_empty() => {
                // Duplicate or late terminal of a released lease, from the
                // connection it ran on (possibly of an older generation).
                let r = self.rng.pick(&released).ok_or("no released lease")?;
                (r.conn, r.run_id, r.adapter, r.target)
            }
            _ => match self.rng.pick(&live) {
                Some(c) => (
                    c,
                    format!("run-{}", self.sh.next_request + 500),
                    "ollama-a".to_string(),
                    "llama3".to_string(),
                ),
                None => return self.gen_register(),
            },
        };
        let (adapter, target) = self.gen_evidence(&adapter, &target);
        let stall = self.gen_stall(conn);
        self.apply(Input::Terminal(Terminal {
            conn,
            run_id,
            adapter,
            target,
            stall,
            end: AttemptEnd::Other,
            committed: true,
        }))
    }

    fn gen_status(&mut self) -> i32 {
        match self.rng.below(100) {
            0..=64 => pb::ProviderHealth::Available as i32,
            65..=76 => pb::ProviderHealth::Unavailable as i32,
            77..=84 => pb::ProviderHealth::Unknown as i32,
            85..=89 => pb::ProviderHealth::Unspecified as i32,
            90..=94 => pb::ProviderHealth::Offline as i32,
            _ => 42,
        }
    }

    fn gen_capability(&mut self, conn: ConnId, p: Option<usize>) -> pb::AdapterCapability {
        let (adapter_key, mut target) = match p {
            Some(p) => (
                self.world.provs[p].spec.adapter.to_string(),
                self.world.provs[p].spec.target.to_string(),
            ),
            None => ("bogus".to_string(), "bogus".to_string()),
        };
        if self.rng.chance(8) {
            target = "other-target".to_string();
        }
        let provider_status = self.gen_status();
        let health_observation_seq = self.gen_seq(conn);
        pb::AdapterCapability {
            adapter_key,
            target,
            provider_status,
            health_observation_seq,
            adapter: "diagnostic".to_string(),
            instance_key: "diagnostic".to_string(),
        }
    }

    /// A CAPABILITIES answer for `node`, mostly about providers of
    /// `adapter`, sometimes empty, malformed, ambiguous or failed.
    fn gen_answer(
        &mut self,
        command_id: String,
        conn: ConnId,
        node: usize,
        adapter: &str,
    ) -> pb::NodeCommandResponse {
        let ok = self.rng.chance(90);
        let mut capabilities = Vec::new();
        if self.rng.chance(88) {
            let same: Vec<usize> = self.world.nodes[node]
                .provs
                .iter()
                .copied()
                .filter(|&p| *self.world.provs[p].spec.adapter == *adapter)
                .collect();
            let p = self.rng.pick(&same);
            capabilities.push(self.gen_capability(conn, p));
        }
        for _ in 0..self.rng.below(3) {
            let p = if self.rng.chance(80) {
                self.rng.pick(&self.world.nodes[node].provs)
            } else {
                None
            };
            capabilities.push(self.gen_capability(conn, p));
        }
        pb::NodeCommandResponse {
            command_id,
            ok,
            error: if ok {
                String::new()
            } else {
                "probe failed".into()
            },
            capabilities,
            ..Default::default()
        }
    }

    fn gen_command_result(&mut self) -> Result<(), String> {
        let live = self.sh.live_conns();
        let commands: Vec<(String, SCmd)> = if self.sh.commands.is_empty() {
            Vec::new()
        } else {
            let i = self.rng.below(self.sh.commands.len() as u64) as usize;
            self.sh
                .commands
                .iter()
                .nth(i)
                .map(|(id, c)| (id.clone(), c.clone()))
                .into_iter()
                .collect()
        };
        let retired: Vec<(String, ConnId, usize)> = self
            .sh
            .retired
            .iter()
            .filter(|(_, c, _)| self.sh.conn(*c).life != Life::Gone)
            .cloned()
            .collect();
        let roll = self.rng.below(100);
        let (conn, response) = match roll {
            0..=64 if !commands.is_empty() => {
                let (id, cmd) = self.rng.pick(&commands).ok_or("no command")?;
                let r = self.gen_answer(id, cmd.conn, cmd.node, &cmd.adapter);
                (cmd.conn, r)
            }
            65..=79 if !commands.is_empty() => {
                // The right id on the wrong connection.
                let (id, cmd) = self.rng.pick(&commands).ok_or("no command")?;
                let others: Vec<ConnId> = live.iter().copied().filter(|&c| c != cmd.conn).collect();
                let Some(conn) = self.rng.pick(&others) else {
                    return self.gen_advance();
                };
                let r = self.gen_answer(id, conn, cmd.node, &cmd.adapter);
                (conn, r)
            }
            80..=89 if !retired.is_empty() => {
                // A second answer to an answered command, or a late one to
                // a probe retired by a newer probe of the same provider.
                let (id, conn, node) = self.rng.pick(&retired).ok_or("no answer")?;
                let adapter = PROVIDERS[self.world.nodes[node].provs[0]].adapter;
                let r = self.gen_answer(id, conn, node, adapter);
                (conn, r)
            }
            _ => {
                let Some(conn) = self.rng.pick(&live) else {
                    return self.gen_advance();
                };
                let node = self.rng.below(NODES.len() as u64) as usize;
                let p = self.world.nodes[node].provs[0];
                let adapter = self.world.provs[p].spec.adapter.clone();
                let r = self.gen_answer("recovery-999999".into(), conn, node, &adapter);
                (conn, r)
            }
        };
        self.apply(Input::CommandResult { conn, response })
    }

    fn gen_advance(&mut self) -> Result<(), String> {
        let max_timeout_ms = self
            .world
            .models
            .iter()
            .map(|m| m.timeout.as_millis() as u64)
            .max()
            .unwrap_or(100);
        let d_ms = match self.rng.below(100) {
            0..=49 => self.rng.range(1, 20),
            50..=84 => self.rng.range(1, 2 * max_timeout_ms),
            _ => self.rng.range(1_000, 10_000),
        };
        let faithful = self.rng.chance(70);
        self.advance(Duration::from_millis(d_ms), faithful)
    }

    /// A configuration reload: the current configuration (sometimes the
    /// world's again, an operator reverting) with one or two changes
    /// (capacities up or down, below what runs included, a provider
    /// disabled or enabled; a provider, a node or a model removed or added
    /// back; a model moved to another pool; a queue bound or timeout
    /// changed), or none.
    fn gen_reconfigure(&mut self) -> Result<(), String> {
        let mut cfg = if self.rng.chance(30) {
            Config::of(self.world)
        } else {
            self.sh.cfg.clone()
        };
        if !self.rng.chance(8) {
            for _ in 0..self.rng.range(1, 2) {
                self.mutate(&mut cfg);
            }
        }
        self.stats.reconfigures += 1;
        self.apply(Input::Reconfigure(Box::new(cfg.spec(self.world))))
    }

    /// One change to `cfg`, keeping it valid: a model's pool is non-empty
    /// and names configured providers only (a model whose pool empties
    /// goes with it), a provider is configured only with its node.
    fn mutate(&mut self, cfg: &mut Config) {
        let world = self.world;
        let configured: Vec<usize> = (0..world.provs.len())
            .filter(|&p| cfg.provs[p].is_some())
            .collect();
        let leased: Vec<usize> = configured
            .iter()
            .copied()
            .filter(|&p| self.sh.in_flight[p] > 0)
            .collect();
        let models_on: Vec<usize> = (0..world.models.len())
            .filter(|&m| cfg.models[m].is_some())
            .collect();
        let leave_pools = |cfg: &mut Config, p: usize| {
            for model in &mut cfg.models {
                if let Some(spec) = model {
                    spec.pool.retain(|&q| q != p);
                    if spec.pool.is_empty() {
                        *model = None;
                    }
                }
            }
        };
        // Back into the pools the world puts it in.
        let join_pools = |cfg: &mut Config, p: usize| {
            for (m, model) in cfg.models.iter_mut().enumerate() {
                if let Some(spec) = model {
                    if world.models[m].provs.contains(&p) && !spec.pool.contains(&p) {
                        spec.pool.push(p);
                    }
                }
            }
        };
        match self.rng.below(100) {
            0..=24 => {
                let Some(p) = self.rng.pick(&configured) else {
                    return;
                };
                let in_flight = u64::from(self.sh.in_flight[p]);
                let capacity = if in_flight > 0 && self.rng.chance(50) {
                    self.rng.below(in_flight)
                } else {
                    self.rng.range(0, 4)
                };
                let long = self.rng.range(0, 2) as u32;
                let toggle = self.rng.chance(10);
                if let Some(spec) = &mut cfg.provs[p] {
                    spec.capacity = capacity as u32;
                    if self.rng.chance(40) {
                        spec.long = long;
                    }
                    spec.enabled ^= toggle;
                }
            }
            25..=36 => {
                let pick = match self.rng.pick(&leased) {
                    Some(p) if self.rng.chance(60) => Some(p),
                    _ => self.rng.pick(&configured),
                };
                if let Some(p) = pick {
                    cfg.provs[p] = None;
                    leave_pools(cfg, p);
                }
            }
            37..=46 => {
                let absent: Vec<usize> = (0..world.provs.len())
                    .filter(|&p| cfg.provs[p].is_none() && cfg.nodes[world.provs[p].node])
                    .collect();
                if let Some(p) = self.rng.pick(&absent) {
                    cfg.provs[p] = Some(Config::base(&world.provs[p]));
                    join_pools(cfg, p);
                }
            }
            47..=60 => {
                let Some(m) = self.rng.pick(&models_on) else {
                    return;
                };
                let mut pool = configured.clone();
                for i in (1..pool.len()).rev() {
                    let j = self.rng.below(i as u64 + 1) as usize;
                    pool.swap(i, j);
                }
                pool.truncate(self.rng.range(1, pool.len().max(1) as u64) as usize);
                if let (Some(spec), false) = (&mut cfg.models[m], pool.is_empty()) {
                    spec.pool = pool;
                }
            }
            61..=66 => {
                if let Some(m) = self.rng.pick(&models_on) {
                    cfg.models[m] = None;
                }
            }
            67..=78 => {
                let absent: Vec<usize> = (0..world.models.len())
                    .filter(|&m| cfg.models[m].is_none())
                    .collect();
                let Some(m) = self.rng.pick(&absent) else {
                    return;
                };
                let mut pool: Vec<usize> = world.models[m]
                    .provs
                    .iter()
                    .copied()
                    .filter(|&p| cfg.provs[p].is_some())
                    .collect();
                if pool.is_empty() {
                    pool.extend(self.rng.pick(&configured));
                }
                if !pool.is_empty() {
                    cfg.models[m] = Some(MSpec {
                        pool,
                        max_queue: world.models[m].max_queue,
                        timeout: world.models[m].timeout,
                    });
                }
            }
            79..=88 => {
                // Favour a node with runs (its grace, its last terminal).
                let on: Vec<usize> = (0..NODES.len()).filter(|&n| cfg.nodes[n]).collect();
                let busy: Vec<usize> = on
                    .iter()
                    .copied()
                    .filter(|&n| {
                        world.nodes[n]
                            .provs
                            .iter()
                            .any(|&p| self.sh.in_flight[p] > 0)
                    })
                    .collect();
                let pick = match self.rng.pick(&busy) {
                    Some(n) if self.rng.chance(60) => Some(n),
                    _ => self.rng.pick(&on),
                };
                if let Some(n) = pick {
                    cfg.nodes[n] = false;
                    for &p in &world.nodes[n].provs {
                        cfg.provs[p] = None;
                        leave_pools(cfg, p);
                    }
                }
            }
            89..=94 => {
                let off: Vec<usize> = (0..NODES.len()).filter(|&n| !cfg.nodes[n]).collect();
                if let Some(n) = self.rng.pick(&off) {
                    cfg.nodes[n] = true;
                    for &p in &world.nodes[n].provs {
                        cfg.provs[p] = Some(Config::base(&world.provs[p]));
                        join_pools(cfg, p);
                    }
                }
            }
            _ => {
                let Some(m) = self.rng.pick(&models_on) else {
                    return;
                };
                let max_queue = self.rng.range(1, 3) as u32;
                let timeout = Duration::from_millis(self.rng.range(30, 300));
                let new_timeout = self.rng.chance(30);
                if let Some(spec) = &mut cfg.models[m] {
                    spec.max_queue = max_queue;
                    if new_timeout {
                        spec.timeout = timeout;
                    }
                }
            }
        }
    }

    /// An operator drains or undrains a node or a provider (mostly
    /// flipping it; sometimes repeating its state, or naming something
    /// not configured).
    fn gen_set_drain(&mut self) -> Result<(), String> {
        let (target, current) = if self.rng.chance(50) {
            let n = self.rng.below(NODES.len() as u64 + 1) as usize;
            let id = NODES.get(n).copied().unwrap_or(UNKNOWN_NODE);
            let current = n < NODES.len() && self.sh.node_drained[n];
            (DrainTarget::Node(id.to_string()), current)
        } else {
            let p = self.rng.below(PROVIDERS.len() as u64 + 1) as usize;
            match self.world.provs.get(p) {
                Some(info) => (
                    DrainTarget::Provider(info.key.clone()),
                    self.sh.prov_drained[p],
                ),
                None => (DrainTarget::Provider(key(NODES[0], "p9")), false),
            }
        };
        // Undrains come more often: a drain stays a while, not for good.
        let flip = self.rng.chance(if current { 85 } else { 30 });
        let drained = current != flip;
        self.stats.set_drains += 1;
        self.apply(Input::SetDrain { target, drained })
    }

    /// An owner (pending or ready) says it drains; sometimes a connection
    /// that owns nothing (superseded, closing, never registered) does.
    fn gen_node_draining(&mut self) -> Result<(), String> {
        let owners: Vec<ConnId> = self.sh.owners.iter().flatten().map(|o| o.conn).collect();
        let conn = match self.rng.pick(&owners) {
            Some(c) if self.rng.chance(60) => c,
            _ => match self.rng.pick(&self.sh.live_conns()) {
                Some(c) => c,
                None => return self.gen_register(),
            },
        };
        self.stats.node_drainings += 1;
        self.apply(Input::NodeDraining { conn })
    }

    /// Moves the clock by `d`. A faithful shell fires every deadline at its
    /// instant; a late one wakes once at the end.
    fn advance(&mut self, d: Duration, faithful: bool) -> Result<(), String> {
        let target = self.now + d;
        if self.verbose {
            println!(
                "-- advance {}ms ({})",
                d.as_millis(),
                if faithful { "faithful" } else { "late" }
            );
        }
        if faithful {
            while let Some(at) = self.control.poll_timeout() {
                if at > target {
                    break;
                }
                self.now = self.now.max(at);
                self.timeout()?;
            }
            self.now = target;
        } else {
            self.now = target;
            if self.control.poll_timeout().is_some_and(|at| at <= self.now) {
                self.timeout()?;
            }
        }
        // No queued request waits past its deadline, no settlement or
        // probe is overdue (the shell's timer is armed at poll_timeout).
        self.check_timers(self.control.poll_timeout())
    }

    // ---- one step ----------------------------------------------------------

    fn apply(&mut self, input: Input) -> Result<(), String> {
        self.stats.steps += 1;
        self.current = Some(input.clone());
        self.just_closed = match input {
            Input::Closed { conn, .. } => Some(conn),
            _ => None,
        };
        let mut ex = self.predict(&input)?;
        if ex.unchanged {
            self.stats.stale_inputs += 1;
        }
        let fleet_pump = match &input {
            Input::Reconfigure(_) => Some(false),
            Input::SetDrain { drained: false, .. } => Some(true),
            _ => None,
        };
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        self.control.handle(self.now, input, &mut out);
        if self.verbose {
            if let Some(input) = &self.current {
                println!("[{}] t+{}ms {input:?}", self.stats.steps, self.ms());
            }
            for a in &out {
                println!("      -> {a:?}");
            }
        }
        let result = self.process(&mut ex, &out);
        let dispatches = out
            .iter()
            .filter(|a| matches!(a, Action::Dispatch(_)))
            .count() as u64;
        match fleet_pump {
            Some(false) => self.stats.reload_dispatches += dispatches,
            Some(true) => self.stats.undrain_dispatches += dispatches,
            None => {}
        }
        self.out = out;
        result?;
        self.release_let_go(&ex);
        self.check_all((ex.unchanged || ex.quiet).then_some(ex.unchanged_skip))
    }

    /// The owners this step let go of own nothing from now on; their
    /// probes are forgotten with them (F1).
    fn release_let_go(&mut self, ex: &Expect) {
        for &(n, conn) in &ex.let_go {
            if self.sh.owners[n].is_some_and(|o| o.conn == conn) {
                self.sh.owners[n] = None;
            }
            self.sh.commands.retain(|_, c| c.conn != conn);
        }
    }

    fn timeout(&mut self) -> Result<(), String> {
        self.stats.steps += 1;
        self.stats.timeouts += 1;
        self.current = None;
        self.just_closed = None;
        let mut ex = self.predict_timeout();
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        self.control.handle_timeout(self.now, &mut out);
        if self.verbose {
            println!("[{}] t+{}ms handle_timeout", self.stats.steps, self.ms());
            for a in &out {
                println!("      -> {a:?}");
            }
        }
        let result = self.process(&mut ex, &out);
        self.out = out;
        result?;
        self.release_let_go(&ex);
        self.check_all(None)
    }

    fn observe(&self) -> Observed {
        let c = &self.control;
        Observed {
            snapshots: c.snapshots(),
            leases: c.leases().cloned().collect(),
            pending: c
                .pending_requests()
                .map(|r| (r, c.queue_deadline(r)))
                .collect(),
            counters: c.counters().clone(),
            poll: c.poll_timeout(),
            overlaid: self
                .world
                .provs
                .iter()
                .map(|p| c.is_overlaid(&p.key))
                .collect(),
            registry: self
                .sh
                .live
                .iter()
                .map(|&conn| {
                    let node = c
                        .node_of(conn)
                        .map(|n| NODES.iter().position(|x| *x == n).unwrap_or(usize::MAX));
                    // An unbound connection owns nothing by definition;
                    // asking is_ready_owner/generation_of only for bound
                    // ones keeps the per-step cost down.
                    let (ready_owner, generation) = match node {
                        Some(_) => (c.is_ready_owner(conn), c.generation_of(conn)),
                        None => (false, None),
                    };
                    RegistryView {
                        conn,
                        node,
                        ready_owner,
                        generation,
                    }
                })
                .collect(),
        }
    }

    // ---- predictions ---------------------------------------------------------

    /// F1: the current ready owner `old` of `node` is fenced in this step.
    fn predict_fence(&mut self, node: usize, old: SOwner, ex: &mut Expect) {
        for l in self.sh.leases.values() {
            if l.conn == old.conn {
                ex.done.push((l.request, Outcome::Lost));
            }
        }
        ex.events.push(Event::NodeDisconnected {
            node_id: NODES[node].to_string(),
        });
        for &p in &self.world.nodes[node].provs {
            self.sh.overlay[p] = None;
            self.sh.next_probe[p] = None;
        }
        self.sh.commands.retain(|_, c| c.conn != old.conn);
        ex.pump = true;
        self.stats.fences += 1;
    }

    /// H4: a validated observation of provider `p` in `generation`.
    fn predict_observe(
        &mut self,
        p: usize,
        generation: Generation,
        seq: u64,
        health: pb::ProviderHealth,
        ex: &mut Expect,
    ) {
        let fresh = self
            .sh
            .last_seq
            .get(&(p, generation))
            .is_none_or(|&last| seq > last);
        if !fresh {
            let unavailable = health == pb::ProviderHealth::Unavailable;
            // Fresh but for an answer that cleared nothing: the guard.
            let guarded = self
                .sh
                .answer_seq
                .get(&(p, generation))
                .is_some_and(|before| before.is_none_or(|before| seq > before));
            if unavailable && self.sh.overlay[p] != Some(generation) && guarded {
                self.stats.freshness_guarded += 1;
            }
            return;
        }
        self.sh.last_seq.insert((p, generation), seq);
        self.sh.answer_seq.remove(&(p, generation));
        if health == pb::ProviderHealth::Unavailable && self.sh.overlay[p] != Some(generation) {
            self.sh.overlay[p] = Some(generation);
            self.sh.next_probe[p] = Some(self.now + self.world.tunables.recovery_probe_interval);
            self.sh.counters.health_transitions_unavailable += 1;
            ex.events.push(Event::HealthTransition {
                provider: self.world.provs[p].key.clone(),
                unavailable: true,
            });
            self.stats.overlays_set += 1;
        }
    }

    fn predict(&mut self, input: &Input) -> Result<Expect, String> {
        let mut ex = Expect::default();
        match input {
            Input::OwnershipGranted { .. }
            | Input::OwnershipFailed { .. }
            | Input::OwnerObserved { .. }
            | Input::ClusterSession { .. }
            | Input::Drain => {
                return Err(format!(
                    "the single-Edge simulation feeds no cluster input: {input:?}"
                ));
            }
            Input::Reconfigure(spec) => self.predict_reconfigure(spec, &mut ex)?,
            Input::SetDrain { target, drained } => {
                self.predict_set_drain(target, *drained, &mut ex)
            }
            Input::NodeDraining { conn } => {
                // Nothing a snapshot shows changes: only where new work
                // may go (F2 for a connection that owns nothing).
                ex.quiet = true;
                let owner = self.sh.conn(*conn).bound.and_then(|n| {
                    self.sh.owners[n]
                        .filter(|o| o.conn == *conn)
                        .map(|o| (n, o))
                });
                if let Some((n, o)) = owner {
                    self.sh.owners[n] = Some(SOwner {
                        draining: true,
                        ..o
                    });
                }
            }
            Input::Register {
                conn,
                tls_name,
                node_id,
            } => {
                let conn = *conn;
                if self.sh.conn(conn).bound.is_some() {
                    // R1: rejected, the first binding stays, no close.
                    ex.unchanged = true;
                    ex.registry.push(RegAct::Register {
                        conn,
                        accepted: false,
                        config: None,
                    });
                    return Ok(ex);
                }
                if self.sh.conn(conn).life == Life::Closing {
                    // R3: a connection ordered closed (rejected, or let go
                    // of after a bad ready) must reconnect; its late register
                    // is refused and it never owns a node id again. It is
                    // already closing: no second close.
                    ex.unchanged = true;
                    ex.registry.push(RegAct::Register {
                        conn,
                        accepted: false,
                        config: None,
                    });
                    return Ok(ex);
                }
                // Only a node the configuration names now registers.
                let node = self
                    .world
                    .node_index(node_id)
                    .filter(|&n| self.sh.cfg.nodes[n]);
                let Some(node) = node.filter(|_| node_id == tls_name) else {
                    // T3 / unknown node: rejected and closed.
                    ex.unchanged = true;
                    ex.registry.push(RegAct::Register {
                        conn,
                        accepted: false,
                        config: None,
                    });
                    ex.registry.push(RegAct::Close {
                        conn,
                        reason: CloseReason::RegistrationRejected,
                    });
                    return Ok(ex);
                };
                // R2: a pending claim under a new generation.
                ex.registry.push(RegAct::Register {
                    conn,
                    accepted: true,
                    config: Some(self.world.nodes[node].config.clone()),
                });
                if let Some(old) = self.sh.owners[node] {
                    // R2: the older owner is fenced (if ready), then closed;
                    // it keeps its binding so its late frames are refused
                    // as superseded.
                    if old.ready {
                        self.predict_fence(node, old, &mut ex);
                    }
                    ex.registry.push(RegAct::Close {
                        conn: old.conn,
                        reason: CloseReason::Superseded,
                    });
                    self.stats.supersedes += 1;
                }
                self.sh.conn_mut(conn).bound = Some(node);
                self.sh.owners[node] = Some(SOwner {
                    conn,
                    generation: Generation(u64::MAX),
                    ready: false,
                    draining: false,
                });
                ex.accepted = Some((conn, node));
            }
            Input::Ready { conn, node_id } => {
                let conn = *conn;
                let bound = self.sh.conn(conn).bound;
                let owner = bound
                    .filter(|&n| NODES[n] == node_id)
                    .and_then(|n| self.sh.owners[n].map(|o| (n, o)))
                    .filter(|(_, o)| o.conn == conn);
                match owner {
                    None => {
                        ex.registry.push(RegAct::Ready { conn, ready: false });
                        ex.registry.push(RegAct::Close {
                            conn,
                            reason: CloseReason::NotReady,
                        });
                        match bound.and_then(|n| self.sh.owners[n].map(|o| (n, o))) {
                            Some((n, o)) if o.conn == conn => {
                                // R3, R4, X6: the current owner named another
                                // node id. Ordered closed, it is released in
                                // this step exactly as by `Closed`: binding
                                // dropped, owner slot cleared, fenced if
                                // ready (F1).
                                self.sh.conn_mut(conn).bound = None;
                                self.sh.owners[n] = None;
                                self.stats.released_on_close += 1;
                                if o.ready {
                                    self.stats.fenced_on_close += 1;
                                    self.predict_fence(n, o, &mut ex);
                                }
                            }
                            // R3: stale, superseded, rejected, never
                            // registered, or already let go of.
                            _ => ex.unchanged = true,
                        }
                    }
                    Some((_, o)) if o.ready => {
                        // R3: duplicate ready, no side effect.
                        ex.unchanged = true;
                        ex.registry.push(RegAct::Ready { conn, ready: true });
                    }
                    Some((n, o)) => {
                        // R3, F3, H5: first ready of the generation.
                        ex.registry.push(RegAct::Ready { conn, ready: true });
                        ex.events.push(Event::NodeConnected {
                            node_id: NODES[n].to_string(),
                        });
                        self.sh.owners[n] = Some(SOwner { ready: true, ..o });
                        for &p in &self.world.nodes[n].provs {
                            self.sh.overlay[p] = None;
                            self.sh.next_probe[p] = None;
                        }
                        ex.pump = true;
                        self.stats.first_readies += 1;
                    }
                }
            }
            Input::NodeVersion { .. } => {
                // Diagnostic only: no dispatch state changes, no action.
                ex.unchanged = true;
            }
            Input::Closed { conn, .. } => {
                let conn = *conn;
                self.sh.live.retain(|&c| c != conn);
                let c = self.sh.conn_mut(conn);
                c.life = Life::Gone;
                ex.unchanged_skip = Some(conn);
                match c.bound.take() {
                    None => ex.unchanged = true,
                    Some(n) => match self.sh.owners[n] {
                        Some(o) if o.conn == conn => {
                            self.sh.owners[n] = None;
                            if o.ready {
                                self.predict_fence(n, o, &mut ex);
                            }
                        }
                        // F2: a late close of a stale connection.
                        _ => ex.unchanged = true,
                    },
                }
            }
            Input::Submit {
                request,
                model,
                long,
                share,
                ..
            } => {
                let id = *request;
                let share = (share.principal, share.class);
                if id.0 != self.sh.next_request {
                    return Err(self.fail("generator submitted out of order"));
                }
                self.sh.next_request += 1;
                self.sh.ended.push(false);
                match self
                    .world
                    .model_index(model)
                    .filter(|&m| self.sh.cfg.models[m].is_some())
                {
                    None => {
                        ex.done
                            .push((id, Outcome::Rejected(Rejection::UnknownModel)));
                        self.sh.active.insert(
                            id,
                            SReq {
                                model: None,
                                long: *long,
                                state: SState::Queued { deadline: self.now },
                                share,
                            },
                        );
                    }
                    Some(m) => {
                        let fits = self
                            .sh
                            .pool(m)
                            .iter()
                            .any(|&p| self.sh.fits(self.world, p, *long));
                        let Some(info) = &self.sh.cfg.models[m] else {
                            return Err(self.fail("shadow: a configured model without a spec"));
                        };
                        if !fits && self.sh.queued_of_model(m) >= info.max_queue as usize {
                            ex.done.push((id, Outcome::Rejected(Rejection::QueueFull)));
                        }
                        self.sh.active.insert(
                            id,
                            SReq {
                                model: Some(m),
                                long: *long,
                                state: SState::Queued {
                                    deadline: self.now + info.timeout,
                                },
                                share,
                            },
                        );
                        ex.submit = Some(id);
                    }
                }
            }
            Input::Cancel { request, reason } => {
                match self.sh.active.get(request).map(|r| r.state.clone()) {
                    Some(SState::Queued { .. }) => ex.done.push((*request, Outcome::Cancelled)),
                    Some(SState::Dispatched { run_id }) => {
                        let lease = self
                            .sh
                            .leases
                            .get(&run_id)
                            .ok_or_else(|| self.fail("shadow: dispatched without lease"))?;
                        ex.cancels.push((lease.conn, run_id.clone(), *reason));
                        let settle_at = self.now + self.world.tunables.cancel_settle;
                        if let Some(r) = self.sh.active.get_mut(request) {
                            r.state = SState::CancelPending { run_id, settle_at };
                        }
                    }
                    Some(SState::CancelPending { .. }) | None => ex.unchanged = true,
                }
            }
            // No response-wait timeout and no failover (max_attempts 1)
            // here: a response start or commit changes nothing observable.
            Input::Responded { .. } | Input::Committed { .. } => ex.unchanged = true,
            Input::Undeliverable { request } => {
                match self.sh.active.get(request).map(|r| &r.state) {
                    Some(SState::Dispatched { .. } | SState::CancelPending { .. }) => {
                        ex.done.push((*request, Outcome::Cancelled));
                        ex.pump = true;
                    }
                    _ => ex.unchanged = true,
                }
            }
            Input::Terminal(t) => {
                let lease = match self.sh.leases.get(&t.run_id) {
                    Some(l) if l.conn == t.conn => l.clone(),
                    // H1, F2: not the lease's reception identity.
                    _ => {
                        ex.unchanged = true;
                        return Ok(ex);
                    }
                };
                // H2: released exactly once, whatever the evidence says.
                ex.done.push((lease.request, Outcome::Completed));
                ex.pump = true;
                if let Some(stall) = t.stall {
                    let matches = *t.adapter == *lease.adapter && *t.target == *lease.target;
                    match stall.seq {
                        Some(seq) if matches && well_formed(&stall) => {
                            self.sh.counters.health_evidence_accepted += 1;
                            self.sh.counters.recovery_eligible += 1;
                            // H3: also for a sequence-stale handoff.
                            ex.handoffs.push((
                                lease.request,
                                Handoff {
                                    provider_id: lease.provider.provider_id.to_string(),
                                    provider_health: stall.health,
                                    recovery_handoff: "confirmed",
                                },
                            ));
                            let p = self
                                .world
                                .prov_index(&lease.provider)
                                .ok_or_else(|| self.fail("lease of an unknown provider"))?;
                            self.predict_observe(p, lease.generation, seq, stall.health, &mut ex);
                        }
                        _ => {
                            self.sh.counters.health_evidence_rejected += 1;
                            self.sh.counters.recovery_ineligible += 1;
                        }
                    }
                }
            }
            Input::CommandResult { conn, response } => {
                let record = match self.sh.commands.get(&response.command_id) {
                    Some(r) if r.conn == *conn => r.clone(),
                    // F2: unknown, answered, retired by a newer probe of the
                    // same provider, or on another connection. Ignored
                    // before any counting: no counter moves.
                    _ => {
                        if self.sh.superseded_probes.contains(&response.command_id) {
                            self.stats.retired_answers += 1;
                        }
                        ex.unchanged = true;
                        return Ok(ex);
                    }
                };
                self.sh.commands.remove(&response.command_id);
                self.sh
                    .retire(response.command_id.clone(), *conn, record.node);
                self.predict_command(&record, response, &mut ex);
            }
        }
        self.predict_let_go(&mut ex);
        Ok(ex)
    }

    /// A reload to `spec` (see `fleet.rs`): what it names is served from
    /// now on, with every runtime state of what stays; a provider that
    /// leaves while leased stays (removed, in no pool) until a reload finds
    /// it idle; a node that leaves while owned stays (removed) until its
    /// owner has nothing in flight or its grace ends; a removed model's
    /// waiters end (`ModelRemoved`), its running requests run on; a queue
    /// over its new bound loses its newest waiters (`QueueFull`). The pump
    /// that follows may dispatch anywhere the new configuration made room
    /// (checked like every pump: least loaded, arrival order, nothing left
    /// that fits).
    fn predict_reconfigure(&mut self, spec: &ControlSpec, ex: &mut Expect) -> Result<(), String> {
        let world = self.world;
        let cfg = Config::from_spec(world, spec).map_err(|e| self.fail(e))?;
        let leftovers =
            self.sh.prov_removed.iter().any(|&r| r) || self.sh.node_removed.iter().any(|&r| r);
        ex.quiet = cfg == self.sh.cfg && !leftovers;
        if ex.quiet {
            self.stats.reloads_unchanged += 1;
        }
        ex.pump = true;
        for p in 0..world.provs.len() {
            let was = self.sh.present[p];
            match cfg.provs[p] {
                Some(spec) => {
                    self.sh.present[p] = true;
                    self.sh.prov_removed[p] = false;
                    self.sh.pspec[p] = spec;
                }
                None if was && self.sh.in_flight[p] > 0 => {
                    if !self.sh.prov_removed[p] {
                        self.stats.providers_retired += 1;
                    }
                    self.sh.prov_removed[p] = true;
                }
                None => {
                    // Gone: added back later, it starts afresh.
                    self.sh.present[p] = false;
                    self.sh.prov_removed[p] = false;
                    self.sh.overlay[p] = None;
                    self.sh.next_probe[p] = None;
                    self.sh.last_seq.retain(|&(q, _), _| q != p);
                    self.sh.answer_seq.retain(|&(q, _), _| q != p);
                }
            }
            if !was || !self.sh.present[p] {
                self.sh.prov_drained[p] = false;
            }
            let spec = self.sh.pspec[p];
            let (all, long) = (self.sh.in_flight[p], self.sh.long_in_flight[p]);
            self.sh.over[p] = (
                if all > spec.capacity { all } else { 0 },
                if long > spec.long { long } else { 0 },
            );
            if self.sh.present[p] && (all > spec.capacity || long > spec.long) {
                self.stats.capacity_below_in_flight += 1;
            }
        }
        for n in 0..NODES.len() {
            let was = self.sh.node_present[n];
            if cfg.nodes[n] {
                self.sh.node_present[n] = true;
                self.sh.node_removed[n] = false;
                self.sh.retire[n] = None;
            } else if self.sh.owners[n].is_some() {
                if !self.sh.node_removed[n] {
                    self.stats.nodes_retired += 1;
                    self.sh.retire[n] = Some(self.now + world.tunables.retire_grace);
                }
                self.sh.node_removed[n] = true;
            } else {
                self.sh.node_present[n] = false;
                self.sh.node_removed[n] = false;
                self.sh.retire[n] = None;
                // Bindings to a node Control no longer has go with it.
                for c in &mut self.sh.conns {
                    if c.bound == Some(n) {
                        c.bound = None;
                    }
                }
            }
            if !was || !self.sh.node_present[n] {
                self.sh.node_drained[n] = false;
            }
        }
        let mut queued: Vec<Vec<RequestId>> = vec![Vec::new(); world.models.len()];
        for (&id, r) in &self.sh.active {
            if let (SState::Queued { .. }, Some(m)) = (&r.state, r.model) {
                if cfg.models[m].is_none() {
                    ex.done
                        .push((id, Outcome::Rejected(Rejection::ModelRemoved)));
                } else {
                    queued[m].push(id);
                }
            }
        }
        for (m, waiting) in queued.iter().enumerate() {
            let max = cfg.models[m].as_ref().map_or(0, |s| s.max_queue as usize);
            for &id in waiting.iter().skip(max) {
                ex.done.push((id, Outcome::Rejected(Rejection::QueueFull)));
                self.stats.trimmed += 1;
            }
        }
        self.sh.cfg = cfg;
        Ok(())
    }

    /// An operator drain: a drained node or provider takes no new work, an
    /// undrained one takes it again at once (the pump). Nothing a snapshot
    /// shows changes; an unknown, removed or unchanged target changes
    /// nothing at all.
    fn predict_set_drain(&mut self, target: &DrainTarget, drained: bool, ex: &mut Expect) {
        let flag = match target {
            DrainTarget::Node(id) => self
                .world
                .node_index(id)
                .filter(|&n| self.sh.node_present[n] && !self.sh.node_removed[n])
                .map(|n| &mut self.sh.node_drained[n]),
            DrainTarget::Provider(key) => self
                .world
                .prov_index(key)
                .filter(|&p| self.sh.present[p] && !self.sh.prov_removed[p])
                .map(|p| &mut self.sh.prov_drained[p]),
        };
        match flag {
            Some(flag) if *flag != drained => {
                *flag = drained;
                ex.pump = !drained;
                ex.quiet = drained;
            }
            _ => ex.quiet = true,
        }
    }

    /// After any step: a removed node whose owner has nothing left in
    /// flight once this step's ends (`ex.done`) are in is let go of, in
    /// the order of its grace's end: fenced if ready (nothing is lost:
    /// nothing runs there), closed `node_removed`.
    fn predict_let_go(&mut self, ex: &mut Expect) {
        let mut retiring: Vec<(Instant, usize)> = (0..NODES.len())
            .filter_map(|n| self.sh.retire[n].map(|t| (t, n)))
            .collect();
        retiring.sort_unstable();
        for (_, n) in retiring {
            let Some(owner) = self.sh.owners[n] else {
                // Its owner went away in this step.
                self.sh.retire[n] = None;
                continue;
            };
            let runs = self
                .sh
                .leases
                .values()
                .any(|l| l.conn == owner.conn && !ex.done.iter().any(|(r, _)| *r == l.request));
            if runs {
                continue;
            }
            self.sh.retire[n] = None;
            self.predict_release(n, owner, ex);
            self.stats.nodes_let_go += 1;
        }
    }

    /// Removed node `n`'s `owner` is let go of in this step: fenced if
    /// ready (its remaining leases are already in `ex.done`), closed
    /// `node_removed`; it owns nothing after the step's actions.
    fn predict_release(&mut self, n: usize, owner: SOwner, ex: &mut Expect) {
        if owner.ready {
            ex.events.push(Event::NodeDisconnected {
                node_id: NODES[n].to_string(),
            });
            for &p in &self.world.nodes[n].provs {
                self.sh.overlay[p] = None;
                self.sh.next_probe[p] = None;
            }
            ex.pump = true;
            self.stats.fences += 1;
        }
        ex.registry.push(RegAct::Close {
            conn: owner.conn,
            reason: CloseReason::NodeRemoved,
        });
        ex.let_go.push((n, owner.conn));
    }

    /// H6: clear only on a fresh `available` answer naming exactly one
    /// binding of the command's node in the command's generation.
    fn predict_command(
        &mut self,
        record: &SCmd,
        response: &pb::NodeCommandResponse,
        ex: &mut Expect,
    ) {
        let current = self
            .sh
            .ready_owner(record.node)
            .is_some_and(|o| o.conn == record.conn && o.generation == record.generation);
        let mut recovered = false;
        if current && response.ok {
            for cap in &response.capabilities {
                let Some(seq) = cap.health_observation_seq else {
                    continue;
                };
                // Among the providers Control has for the node now (a
                // reload may have dropped or added some since the probe).
                let matching: Vec<usize> = self.world.nodes[record.node]
                    .provs
                    .iter()
                    .copied()
                    .filter(|&p| self.sh.present[p])
                    .filter(|&p| {
                        let s = &self.world.provs[p].spec;
                        *s.adapter == *cap.adapter_key && *s.target == *cap.target
                    })
                    .collect();
                let [p] = matching.as_slice() else {
                    continue;
                };
                let p = *p;
                let last = self.sh.last_seq.get(&(p, record.generation)).copied();
                let fresh = last.is_none_or(|last| seq > last);
                if cap.provider_status != pb::ProviderHealth::Available as i32 || !fresh {
                    continue;
                }
                // A fresh available answer about this exact binding is an
                // observation whether or not it clears anything: an older
                // unavailable one must not overlay it afterwards (H4).
                self.sh.last_seq.insert((p, record.generation), seq);
                if self.sh.overlay[p] != Some(record.generation) {
                    self.sh
                        .answer_seq
                        .entry((p, record.generation))
                        .or_insert(last);
                    self.stats.answers_recorded += 1;
                    continue;
                }
                self.sh.answer_seq.remove(&(p, record.generation));
                self.sh.overlay[p] = None;
                self.sh.next_probe[p] = None;
                recovered = true;
                self.sh.counters.health_transitions_available += 1;
                ex.events.push(Event::HealthTransition {
                    provider: self.world.provs[p].key.clone(),
                    unavailable: false,
                });
                self.stats.overlays_cleared += 1;
            }
        }
        if recovered {
            self.sh.counters.recovery_probe_recovered += 1;
            ex.pump = true;
        } else {
            self.sh.counters.recovery_probe_unchanged += 1;
        }
    }

    fn predict_timeout(&mut self) -> Expect {
        let mut ex = Expect::default();
        for (id, r) in &self.sh.active {
            match r.state {
                SState::Queued { deadline } if deadline <= self.now => {
                    ex.done
                        .push((*id, Outcome::Rejected(Rejection::QueueTimeout)));
                }
                SState::CancelPending { settle_at, .. } if settle_at <= self.now => {
                    ex.done.push((*id, Outcome::Cancelled));
                    ex.pump = true;
                }
                _ => {}
            }
        }
        for p in 0..self.world.provs.len() {
            if self.sh.next_probe[p].is_none_or(|t| t > self.now) {
                continue;
            }
            let node = self.world.provs[p].node;
            match self.sh.ready_owner(node) {
                Some(o) if self.sh.overlay[p] == Some(o.generation) => {
                    ex.commands
                        .push((o.conn, self.world.provs[p].spec.adapter.to_string(), p));
                    self.sh.next_probe[p] =
                        Some(self.now + self.world.tunables.recovery_probe_interval);
                }
                _ => self.sh.next_probe[p] = None,
            }
        }
        // Removed nodes whose grace ended, in that order: closed whatever
        // still runs there (lost: F1 releases each lease once).
        let mut due: Vec<(Instant, usize)> = (0..NODES.len())
            .filter_map(|n| self.sh.retire[n].filter(|&t| t <= self.now).map(|t| (t, n)))
            .collect();
        due.sort_unstable();
        for (_, n) in due {
            self.sh.retire[n] = None;
            let Some(owner) = self.sh.owners[n] else {
                continue;
            };
            let lost: Vec<RequestId> = self
                .sh
                .leases
                .values()
                .filter(|l| l.conn == owner.conn && !ex.done.iter().any(|(r, _)| *r == l.request))
                .map(|l| l.request)
                .collect();
            ex.done.extend(lost.into_iter().map(|r| (r, Outcome::Lost)));
            self.predict_release(n, owner, &mut ex);
            self.stats.grace_ends += 1;
        }
        // Then those whose last run this step ended (a cancel settled).
        self.predict_let_go(&mut ex);
        ex
    }

    // ---- processing the actions ------------------------------------------------

    /// Walks the actions in order, updating the shadow, and checks each:
    /// - Dispatch: only to the current ready owner of the lease's node and
    ///   generation, never pending/superseded/closed or ordered closed (R3,
    ///   R4, X6, F2); only a
    ///   pending request, never twice, never after its Done (invariant 5);
    ///   within capacity and long capacity, to a live candidate of its
    ///   model's pool, not overlaid (P2, H4); kind and stall timeout as
    ///   configured (U7, W2); no earlier fitting request left waiting.
    /// - Done: exactly the predicted requests and outcomes; a dispatched
    ///   request's lease is released with it (F1, H2).
    /// - Registry actions, cancels, handoffs (H3), events: exactly as
    ///   predicted. Probes (H6): exactly as predicted and in `ProviderKey`
    ///   order, only to an open ready owner; each retires the older
    ///   outstanding probe of its provider.
    fn process(&mut self, ex: &mut Expect, actions: &[Action]) -> Result<(), String> {
        let mut registry = Vec::new();
        let mut dones = Vec::new();
        let mut cancels = Vec::new();
        let mut handoffs = Vec::new();
        let mut events = Vec::new();
        let mut commands = Vec::new();
        let mut dispatched: Vec<(RequestId, usize, bool)> = Vec::new();
        for a in actions {
            match a {
                Action::ClaimOwnership { .. } | Action::ReleaseOwnership { .. } => {
                    return Err(self.fail(format!("a single Edge asked etcd: {a:?}")));
                }
                Action::RegisterResponse { conn, response } => {
                    if response.accepted != response.reason.is_empty() {
                        return Err(
                            self.fail(format!("RegisterResponse reason mismatch: {response:?}"))
                        );
                    }
                    registry.push(RegAct::Register {
                        conn: *conn,
                        accepted: response.accepted,
                        config: response.config.clone(),
                    });
                }
                Action::ReadyResponse { conn, response } => {
                    if response.ready != response.reason.is_empty() {
                        return Err(
                            self.fail(format!("ReadyResponse reason mismatch: {response:?}"))
                        );
                    }
                    registry.push(RegAct::Ready {
                        conn: *conn,
                        ready: response.ready,
                    });
                }
                Action::Close { conn, reason } => {
                    registry.push(RegAct::Close {
                        conn: *conn,
                        reason: reason.clone(),
                    });
                    let c = self.sh.conn_mut(*conn);
                    if c.life == Life::Open {
                        c.life = Life::Closing;
                    }
                }
                Action::Dispatch(d) => {
                    self.on_dispatch(d, ex)?;
                    if self.timed_out == Some(d.lease.conn) {
                        // T4: the socket is shut; the run never leaves.
                        self.undeliverable.push(d.request);
                        self.stats.heartbeat_undeliverable += 1;
                    }
                    let p = self.world.prov_index(&d.lease.provider).unwrap_or(0);
                    dispatched.push((d.request, p, d.lease.long));
                }
                Action::SendCancel {
                    conn,
                    run_id,
                    reason,
                } => cancels.push((*conn, run_id.clone(), *reason)),
                Action::SendCommand { conn, command } => {
                    let got = (*conn, command.adapter.clone());
                    let Some((c, adapter, p)) = ex.commands.get(commands.len()).cloned() else {
                        return Err(self.fail(format!(
                            "unexpected recovery probe (H6) after {commands:?}: {command:?}\nexpected: {:?}",
                            ex.commands
                        )));
                    };
                    if got != (c, adapter.clone()) {
                        return Err(self.fail(format!(
                            "recovery probe #{} (H6, in ProviderKey order)\nexpected: {:?}\nactual:   {got:?}",
                            commands.len(),
                            (c, adapter)
                        )));
                    }
                    self.on_command(*conn, command, p)?;
                    commands.push(got);
                }
                Action::StallHandoff { request, handoff } => {
                    handoffs.push((*request, handoff.clone()));
                }
                Action::Done { request, outcome } => {
                    self.on_done(*request, outcome)?;
                    dones.push((*request, outcome.clone()));
                    if let Some(log) = &mut self.done_log {
                        log.push((*request, outcome.clone()));
                    }
                }
                Action::Event(e) => events.push(e.clone()),
                Action::Abort { request, reason } => {
                    return Err(self.fail(format!(
                        "{request:?} aborted ({reason:?}) without a response-wait timeout"
                    )));
                }
            }
        }
        if registry != ex.registry {
            return Err(self.fail(format!(
                "registry actions (R1–R3)\nexpected: {:?}\nactual:   {registry:?}",
                ex.registry
            )));
        }
        dones.sort_by_key(|(r, _)| *r);
        ex.done.sort_by_key(|(r, _)| *r);
        if dones != ex.done {
            return Err(self.fail(format!(
                "Done actions (F1, H2, invariant 5)\nexpected: {:?}\nactual:   {dones:?}",
                ex.done
            )));
        }
        if cancels != ex.cancels {
            return Err(self.fail(format!(
                "SendCancel actions\nexpected: {:?}\nactual:   {cancels:?}",
                ex.cancels
            )));
        }
        if handoffs != ex.handoffs {
            return Err(self.fail(format!(
                "StallHandoff actions (H3)\nexpected: {:?}\nactual:   {handoffs:?}",
                ex.handoffs
            )));
        }
        let key = |e: &Event| format!("{e:?}");
        let mut want: Vec<String> = ex.events.iter().map(key).collect();
        let mut got: Vec<String> = events.iter().map(key).collect();
        want.sort();
        got.sort();
        if want != got {
            return Err(self.fail(format!(
                "events (R3, F1, H4, H6)\nexpected: {want:?}\nactual:   {got:?}"
            )));
        }
        if commands.len() != ex.commands.len() {
            return Err(self.fail(format!(
                "recovery probes (H6)\nexpected: {:?}\nactual:   {commands:?}",
                ex.commands
            )));
        }
        self.stats.handoffs += handoffs.len() as u64;
        self.stats.probes += commands.len() as u64;
        // R2: the accepted registration owns the node under a fresh
        // generation.
        if let Some((conn, node)) = ex.accepted {
            let g = self
                .control
                .generation_of(conn)
                .ok_or_else(|| self.fail("accepted register has no generation"))?;
            if g.0 <= self.sh.max_generation {
                return Err(self.fail(format!(
                    "generation {g:?} not newer than {} (R2)",
                    self.sh.max_generation
                )));
            }
            self.sh.max_generation = g.0;
            self.sh.owners[node] = Some(SOwner {
                conn,
                generation: g,
                ready: false,
                draining: false,
            });
        }
        // Arrival order within a queue, key and class (the queue's
        // discipline, `control::fair`, orders the rest, and the earliest
        // head goes first among queues): no earlier request of the same
        // key and class in the same queue is left waiting while a later one
        // gets a provider.
        for &(r, p, long) in &dispatched {
            let Some((share, model)) = self.sh.active.get(&r).map(|sr| (sr.share, sr.model)) else {
                continue;
            };
            for (q, sq) in self.sh.active.range(..r) {
                let SState::Queued { .. } = sq.state else {
                    continue;
                };
                // One queue: one model, one context length.
                if sq.share != share || sq.model != model || sq.long != long {
                    continue;
                }
                let Some(m) = sq.model else { continue };
                if self.sh.pool(m).contains(&p) && (!sq.long || long) {
                    return Err(self.fail(format!(
                        "{r:?} was dispatched to {} while earlier {q:?} that fits it still waits",
                        self.world.provs[p].key
                    )));
                }
            }
        }
        Ok(())
    }

    fn on_dispatch(&mut self, d: &Dispatch, ex: &Expect) -> Result<(), String> {
        let world = self.world;
        let Some(req) = self.sh.active.get(&d.request) else {
            let why = if self.sh.ended.get(d.request.0 as usize) == Some(&true) {
                "after its Done"
            } else {
                "of an unknown request"
            };
            return Err(self.fail(format!("Dispatch {why}: {d:?}")));
        };
        let SState::Queued { .. } = req.state else {
            return Err(self.fail(format!("request dispatched twice: {d:?}")));
        };
        if Some(d.request) != ex.submit && !ex.pump {
            return Err(self.fail(format!(
                "queued request dispatched in a step that freed nothing: {d:?}"
            )));
        }
        let model = req
            .model
            .ok_or_else(|| self.fail("dispatch of an unknown-model request"))?;
        let long = req.long;
        let p = world
            .prov_index(&d.lease.provider)
            .ok_or_else(|| self.fail(format!("dispatch to an unknown provider: {d:?}")))?;
        let info = &world.provs[p];
        let spec = self.sh.pspec[p];
        if !self.sh.pool(model).contains(&p) {
            return Err(self.fail(format!("dispatch outside the model's pool (P1): {d:?}")));
        }
        // R4, X6, F2: only to the current ready owner of this generation.
        let owner = self.sh.ready_owner(info.node).ok_or_else(|| {
            self.fail(format!(
                "dispatch to a node with no ready owner (R4, X6): {d:?}"
            ))
        })?;
        if d.lease.conn != owner.conn || d.lease.generation != owner.generation {
            return Err(self.fail(format!(
                "dispatch to {:?}/{:?}, the ready owner is {:?}/{:?} (R4, F2): {d:?}",
                d.lease.conn, d.lease.generation, owner.conn, owner.generation
            )));
        }
        // R3, R4: never to a connection `Control` ordered closed or that
        // is gone.
        let life = self.sh.conn(d.lease.conn).life;
        if life != Life::Open {
            return Err(self.fail(format!("dispatch to a {life:?} connection: {d:?}")));
        }
        if !spec.enabled || self.sh.overlay[p] == Some(owner.generation) {
            return Err(self.fail(format!(
                "dispatch to a disabled or overlaid provider (H4): {d:?}"
            )));
        }
        if !self.sh.takes_new_work(world, p) {
            return Err(self.fail(format!(
                "dispatch to a provider that takes no new work (removed or drained, \
                 or its node is, or its owner drains): {d:?}"
            )));
        }
        // Invariant 3: within capacity and long capacity (a capacity a
        // reload lowered below what runs admits nothing until below it).
        if self.sh.in_flight[p] >= spec.capacity || (long && self.sh.long_in_flight[p] >= spec.long)
        {
            return Err(self.fail(format!(
                "dispatch over capacity: in_flight {} / {}, long {} / {}: {d:?}",
                self.sh.in_flight[p], spec.capacity, self.sh.long_in_flight[p], spec.long
            )));
        }
        // The least-loaded candidate with a free (long) slot wins, ties to
        // pool order: the reference scan over the pool.
        let mut best: Option<(usize, u64, u64)> = None;
        for &q in self.sh.pool(model) {
            if !self.sh.fits(world, q, long) {
                continue;
            }
            let num = u64::from(self.sh.in_flight[q]);
            let den = u64::from(self.sh.pspec[q].capacity);
            if best.is_none_or(|(_, bnum, bden)| num * bden < bnum * den) {
                best = Some((q, num, den));
            }
        }
        if best.map(|(q, _, _)| q) != Some(p) {
            return Err(self.fail(format!(
                "dispatch to {}, but the least-loaded candidate (ties to pool order) is {:?}: {d:?}",
                info.key,
                best.map(|(q, _, _)| &world.provs[q].key)
            )));
        }
        let expected_lease = ProviderLease {
            request: d.request,
            run_id: d.request.run_id(),
            provider: info.key.clone(),
            conn: owner.conn,
            generation: owner.generation,
            adapter: info.spec.adapter.clone(),
            target: info.spec.target.clone(),
            long,
        };
        if d.lease != expected_lease {
            return Err(self.fail(format!(
                "lease fields\nexpected: {expected_lease:?}\nactual:   {:?}",
                d.lease
            )));
        }
        // U7, W2.
        if d.kind != info.spec.kind {
            return Err(self.fail(format!("dispatch kind (U7): {d:?}")));
        }
        if d.response_stall_timeout_ms != info.spec.response_stall_timeout_ms {
            return Err(self.fail(format!("stall timeout not the provider's (W2): {d:?}")));
        }
        if let Some(r) = self.sh.active.get_mut(&d.request) {
            r.state = SState::Dispatched {
                run_id: d.lease.run_id.clone(),
            };
        }
        self.sh
            .leases
            .insert(d.lease.run_id.clone(), d.lease.clone());
        self.sh.in_flight[p] += 1;
        if long {
            self.sh.long_in_flight[p] += 1;
        }
        self.stats.dispatches += 1;
        Ok(())
    }

    /// A recovery probe for provider `p` (as predicted): at most one is
    /// outstanding per provider, so it retires the older one (H6).
    fn on_command(
        &mut self,
        conn: ConnId,
        command: &pb::NodeCommandRequest,
        p: usize,
    ) -> Result<(), String> {
        // R4: commands only to a ready owner, for an overlaid provider.
        let node = (0..NODES.len())
            .find(|&n| self.sh.ready_owner(n).is_some_and(|o| o.conn == conn))
            .ok_or_else(|| {
                self.fail(format!(
                    "SendCommand to a non-ready connection (R4): {command:?}"
                ))
            })?;
        if self.sh.conn(conn).life != Life::Open {
            return Err(self.fail(format!("SendCommand to a closing connection: {command:?}")));
        }
        if self.world.provs[p].node != node {
            return Err(self.fail(format!(
                "probe of {} sent to node {}: {command:?}",
                self.world.provs[p].key, NODES[node]
            )));
        }
        if command.r#type != pb::CommandType::Capabilities as i32 || !command.path.is_empty() {
            return Err(self.fail(format!("recovery probe is not CAPABILITIES: {command:?}")));
        }
        if !self.sh.issued.insert(command.command_id.clone()) {
            return Err(self.fail(format!("command id reused: {command:?}")));
        }
        let generation = self.sh.owners[node]
            .map(|o| o.generation)
            .unwrap_or(Generation(0));
        let older: Vec<(String, SCmd)> = self
            .sh
            .commands
            .iter()
            .filter(|(_, c)| c.prov == p)
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect();
        for (id, c) in older {
            self.sh.commands.remove(&id);
            self.sh.superseded_probes.insert(id.clone());
            self.sh.retire(id, c.conn, c.node);
            self.stats.probes_retired += 1;
        }
        self.sh.commands.insert(
            command.command_id.clone(),
            SCmd {
                conn,
                generation,
                node,
                prov: p,
                adapter: command.adapter.clone(),
            },
        );
        Ok(())
    }

    fn on_done(&mut self, request: RequestId, outcome: &Outcome) -> Result<(), String> {
        let req = self.sh.active.remove(&request).ok_or_else(|| {
            self.fail(format!(
                "Done {outcome:?} for {request:?}, which is not pending: ended twice or never submitted"
            ))
        })?;
        if let SState::Dispatched { run_id } | SState::CancelPending { run_id, .. } = req.state {
            let lease = self
                .sh
                .leases
                .remove(&run_id)
                .ok_or_else(|| self.fail(format!("shadow lost the lease of {request:?}")))?;
            let p = self.world.prov_index(&lease.provider).unwrap_or(0);
            self.sh.in_flight[p] -= 1;
            if lease.long {
                self.sh.long_in_flight[p] -= 1;
            }
            self.sh.released.push(Released {
                run_id,
                conn: lease.conn,
                adapter: lease.adapter.to_string(),
                target: lease.target.to_string(),
            });
            if self.sh.released.len() > 64 {
                self.sh.released.remove(0);
            }
        }
        self.sh.ended[request.0 as usize] = true;
        match outcome {
            Outcome::Completed => self.stats.completed += 1,
            Outcome::Lost => self.stats.lost += 1,
            Outcome::Cancelled => self.stats.cancelled += 1,
            Outcome::Rejected(Rejection::QueueTimeout) => self.stats.queue_timeouts += 1,
            Outcome::Rejected(Rejection::QueueFull) => self.stats.queue_full += 1,
            Outcome::Rejected(Rejection::UnknownModel) => self.stats.unknown_model += 1,
            Outcome::Rejected(Rejection::UnsupportedOperation) => {
                return Err(self.fail(format!(
                    "{request:?} refused as unsupported: every pool here serves chat"
                )))
            }
            Outcome::Rejected(Rejection::NoProviders) => {
                return Err(self.fail(format!(
                    "{request:?} refused for want of providers: every pool here has some"
                )))
            }
            Outcome::Rejected(Rejection::ModelRemoved) => self.stats.model_removed += 1,
        }
        Ok(())
    }

    // ---- state checks ------------------------------------------------------------

    /// Deadlines: nothing due is left undone after a step, and
    /// `poll_timeout` is exactly the earliest queue deadline, settlement or
    /// probe the shadow knows of.
    fn check_timers(&self, poll: Option<Instant>) -> Result<(), String> {
        let mut earliest: Option<Instant> = None;
        let mut note = |t: Instant| {
            earliest = Some(earliest.map_or(t, |e: Instant| e.min(t)));
        };
        for (id, r) in &self.sh.active {
            match r.state {
                SState::Queued { deadline } => {
                    if deadline <= self.now {
                        return Err(self.fail(format!(
                            "{id:?} still queued past its deadline (invariant 5)"
                        )));
                    }
                    note(deadline);
                }
                SState::CancelPending { settle_at, .. } => {
                    if settle_at <= self.now {
                        return Err(self.fail(format!("{id:?} cancel not settled by its deadline")));
                    }
                    note(settle_at);
                }
                SState::Dispatched { .. } => {}
            }
        }
        for t in self.sh.next_probe.iter().flatten() {
            note(*t);
        }
        for t in self.sh.retire.iter().flatten() {
            if *t <= self.now {
                return Err(self.fail("a removed node outlived its grace"));
            }
            note(*t);
        }
        if poll != earliest {
            return Err(self.fail(format!(
                "poll_timeout {:?} != earliest pending timer {:?}",
                poll.map(|t| t.duration_since(self.base)),
                earliest.map(|t| t.duration_since(self.base))
            )));
        }
        Ok(())
    }

    /// After every step:
    /// - leases() equals the shadow's live leases (a lease appears at its
    ///   Dispatch and disappears exactly at its request's Done: F1, H2);
    ///   every live lease belongs to the ready owner's generation (F1);
    /// - per provider, live leases counted from leases() ≤ capacity and
    ///   long ones ≤ long capacity (invariant 3);
    /// - pending_requests()/queue_deadline() equal the shadow (invariant 5);
    /// - snapshots equal the projection of the shadow: P1 identity, P2
    ///   occupancy and queued counts, P3 offline, H5 overlaid;
    /// - is_overlaid, counters, registry queries equal the shadow (H4, H6,
    ///   R1–R3); a connection ordered closed owns nothing (R3, R4, X6);
    /// - no idle fitting capacity while a request waits (F1, F3);
    /// - timers (see [`Sim::check_timers`]).
    ///
    /// `unchanged`: the step was a stale input (with the connection whose
    /// own binding it may drop); everything observed must equal the
    /// previous step's observation (F2, R1, R3, invariant 6).
    fn check_all(&mut self, unchanged: Option<Option<ConnId>>) -> Result<(), String> {
        let obs = self.observe();
        self.check_state(&obs)?;
        if let (Some(skip), Some(before)) = (unchanged, &self.last) {
            if !obs.same_as(before, skip) {
                return Err(self.fail(format!(
                    "a stale/duplicate input changed state (F2, R1, R3)\nbefore: {before:?}\nafter:  {obs:?}"
                )));
            }
        }
        self.last = Some(obs);
        Ok(())
    }

    fn check_state(&self, obs: &Observed) -> Result<(), String> {
        let c = &self.control;
        let world = self.world;
        // Leases.
        let mut count = vec![(0u32, 0u32); world.provs.len()];
        let mut n = 0;
        for lease in &obs.leases {
            n += 1;
            if self.sh.leases.get(&lease.run_id) != Some(lease) {
                return Err(self.fail(format!(
                    "Control holds a lease the shadow does not (leaked or changed): {lease:?}"
                )));
            }
            let p = world
                .prov_index(&lease.provider)
                .ok_or_else(|| self.fail("lease of an unknown provider"))?;
            let owner = self.sh.ready_owner(world.provs[p].node);
            if !owner.is_some_and(|o| o.conn == lease.conn && o.generation == lease.generation) {
                return Err(self.fail(format!("lease survives its generation (F1): {lease:?}")));
            }
            count[p].0 += 1;
            if lease.long {
                count[p].1 += 1;
            }
            if c.lease(&lease.run_id) != Some(lease) {
                return Err(self.fail("lease(run_id) disagrees with leases()"));
            }
        }
        if n != self.sh.leases.len() {
            return Err(self.fail(format!(
                "Control has {n} leases, the shadow {} (released without a Done?)",
                self.sh.leases.len()
            )));
        }
        for (p, &(all, long)) in count.iter().enumerate() {
            let spec = self.sh.pspec[p];
            if all != self.sh.in_flight[p] || long != self.sh.long_in_flight[p] {
                return Err(self.fail("shadow occupancy drifted"));
            }
            // Over capacity only by what a reload lowered it below.
            let (over, long_over) = self.sh.over[p];
            if all > spec.capacity.max(over) || long > spec.long.max(long_over) {
                return Err(self.fail(format!(
                    "{}: {all} leases / capacity {}, {long} long / {} (invariant 3)",
                    world.provs[p].key, spec.capacity, spec.long
                )));
            }
        }
        // Pending requests.
        let mut shadow_pending = self.sh.active.iter();
        for &(r, deadline) in &obs.pending {
            let Some((id, sr)) = shadow_pending.next() else {
                return Err(self.fail(format!("Control still holds {r:?}, which ended")));
            };
            if *id != r {
                return Err(self.fail(format!("pending mismatch: control {r:?}, shadow {id:?}")));
            }
            let want = match sr.state {
                SState::Queued { deadline } => Some(deadline),
                _ => None,
            };
            if deadline != want {
                return Err(self.fail(format!("queue_deadline({r:?})")));
            }
        }
        if let Some((id, _)) = shadow_pending.next() {
            return Err(self.fail(format!("{id:?} was dropped without a Done (invariant 5)")));
        }
        // Snapshots.
        let mut queued = vec![(0u32, 0u32); world.provs.len()];
        for r in self.sh.active.values() {
            let (SState::Queued { .. }, Some(m)) = (&r.state, r.model) else {
                continue;
            };
            for &p in self.sh.pool(m) {
                if self.sh.live(world, p) {
                    queued[p].0 += 1;
                    if r.long {
                        queued[p].1 += 1;
                    }
                }
            }
        }
        // Control lists exactly the providers it has, in `ProviderKey`
        // order (the world's).
        let snaps = &obs.snapshots;
        let listed: Vec<usize> = (0..world.provs.len())
            .filter(|&p| self.sh.present[p])
            .collect();
        if snaps.len() != listed.len() {
            return Err(self.fail(format!(
                "{} snapshots, Control has {} providers",
                snaps.len(),
                listed.len()
            )));
        }
        for p in 0..world.provs.len() {
            // H4, H5.
            let owner = self.sh.owners[world.provs[p].node];
            let overlaid = owner.is_some_and(|o| self.sh.overlay[p] == Some(o.generation));
            if obs.overlaid[p] != overlaid {
                return Err(self.fail(format!("is_overlaid({}) != {overlaid}", world.provs[p].key)));
            }
        }
        for (&p, s) in listed.iter().zip(snaps) {
            let info = &world.provs[p];
            let spec = self.sh.pspec[p];
            let owner = self.sh.owners[info.node];
            let connected = owner.is_some_and(|o| o.ready);
            let overlaid = owner.is_some_and(|o| self.sh.overlay[p] == Some(o.generation));
            use pb::ProviderHealth as H;
            use pb::ProviderStatus as S;
            let want = if !connected {
                (false, S::Unavailable, H::Offline, [0; 6])
            } else if overlaid {
                (true, S::Unavailable, H::Unavailable, [0; 6])
            } else if !spec.enabled {
                (true, S::Disabled, H::Available, [0; 6])
            } else {
                (
                    true,
                    S::Available,
                    H::Available,
                    [
                        spec.capacity,
                        spec.long,
                        count[p].0,
                        count[p].1,
                        queued[p].0,
                        queued[p].1,
                    ],
                )
            };
            let got = (
                s.connected,
                s.status,
                s.health,
                [
                    s.capacity,
                    s.long_context_capacity,
                    s.in_flight,
                    s.long_in_flight,
                    s.queued,
                    s.long_queued,
                ],
            );
            let identity_ok = *s.node_id == *info.key.node_id
                && *s.provider_id == *info.key.provider_id
                && *s.adapter == *info.spec.adapter
                && *s.target == *info.spec.target
                && s.category == info.spec.category as i32;
            if !identity_ok || got != (want.0, want.1 as i32, want.2 as i32, want.3) {
                return Err(self.fail(format!(
                    "snapshot of {} (P1–P3, H5)\nexpected: {want:?}\nactual:   {s:?}",
                    info.key
                )));
            }
        }
        // Work conservation: no waiting request fits a live candidate.
        for (id, r) in &self.sh.active {
            let (SState::Queued { .. }, Some(m)) = (&r.state, r.model) else {
                continue;
            };
            if let Some(&p) = self
                .sh
                .pool(m)
                .iter()
                .find(|&&p| self.sh.fits(world, p, r.long))
            {
                return Err(self.fail(format!(
                    "{id:?} waits while {} has a free slot (F1, F3)",
                    world.provs[p].key
                )));
            }
        }
        // Counters.
        if obs.counters != self.sh.counters {
            return Err(self.fail(format!(
                "counters (O1, H2–H6)\nexpected: {:?}\nactual:   {:?}",
                self.sh.counters, obs.counters
            )));
        }
        // Registry (a connection fed `Closed` is checked in that step).
        if let Some(gone) = self.just_closed {
            if c.node_of(gone).is_some() || c.generation_of(gone).is_some() {
                return Err(self.fail(format!("{gone:?} still bound after Closed")));
            }
        }
        for view in &obs.registry {
            let sc = self.sh.conn(view.conn);
            // R3, R4, X6: a connection ordered closed owns nothing, from the
            // step that ordered the close on, whatever frames follow.
            if sc.life == Life::Closing && (view.generation.is_some() || view.ready_owner) {
                return Err(self.fail(format!(
                    "{:?} owns a node id after Control ordered it closed (R3, R4, X6): {view:?}",
                    view.conn
                )));
            }
            let owner = sc
                .bound
                .and_then(|n| self.sh.owners[n])
                .filter(|o| o.conn == sc.id);
            let want = RegistryView {
                conn: sc.id,
                node: sc.bound,
                ready_owner: owner.is_some_and(|o| o.ready),
                generation: owner.map(|o| o.generation),
            };
            if *view != want {
                return Err(self.fail(format!(
                    "registry (R1–R3)\nexpected: {want:?}\nactual:   {view:?}"
                )));
            }
        }
        for (i, id) in NODES.iter().enumerate() {
            if c.ready_conn(id) != self.sh.ready_owner(i).map(|o| o.conn) {
                return Err(self.fail(format!("ready_conn({id})")));
            }
        }
        self.check_timers(obs.poll)
    }
}

// ---------------------------------------------------------------------------
// Running schedules
// ---------------------------------------------------------------------------

/// Default base seed (printed; override with `IOP_SIM_BASE_SEED`).
const DEFAULT_BASE_SEED: u64 = 0x10B5_EED0_C0DE_0001;
/// Schedules in the main run.
const SCHEDULES: u64 = 10_000;
/// Schedules from a fresh base seed in every run.
const FRESH_SCHEDULES: u64 = 2_000;
/// Schedules in each of the two emphasis runs.
const FOCUS_SCHEDULES: u64 = 1_000;
/// Control calls per schedule, at least.
const MIN_STEPS: u64 = 200;

/// Runs one schedule; returns its stats or the failure (panics inside
/// `Control` are failures too).
fn run_schedule(
    seed: u64,
    base: Instant,
    verbose: bool,
    profile: &'static Profile,
) -> Result<Stats, String> {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut rng = Rng(seed);
        let params = WorldParams::random(&mut rng);
        if verbose {
            println!("world: {params:?}");
        }
        let world = World::new(&params);
        let mut sim = Sim::new(&world, rng, base, verbose, profile);
        sim.check_all(None)?;
        sim.run(MIN_STEPS)?;
        sim.stats.schedules = 1;
        Ok(sim.stats)
    }));
    match result {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panicked: {msg}"))
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let raw = std::env::var(name).ok()?;
    let raw = raw.trim();
    let parsed = match raw.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => raw.parse(),
    };
    match parsed {
        Ok(v) => Some(v),
        Err(e) => panic!("{name}={raw:?} is not a u64: {e}"),
    }
}

/// Runs `schedules` seeds from the base seed with `profile` (or only the
/// one `IOP_SIM_SEED` names, with a step log) and returns the summed stats.
/// Schedules are independent, so they are split over two threads; each
/// seed's run is the same whichever thread runs it.
fn run_all(profile: &'static Profile, schedules: u64, test_name: &str) -> Stats {
    let base_seed = env_u64("IOP_SIM_BASE_SEED").unwrap_or(DEFAULT_BASE_SEED);
    run_from(
        profile,
        schedules,
        test_name,
        base_seed,
        "IOP_SIM_BASE_SEED",
    )
}

/// [`run_all`] from `base_seed` (named by `seed_var` in the log, the
/// variable that sets it).
fn run_from(
    profile: &'static Profile,
    schedules: u64,
    test_name: &str,
    base_seed: u64,
    seed_var: &str,
) -> Stats {
    let base = iop_engine::clock::now();
    if let Some(seed) = env_u64("IOP_SIM_SEED") {
        println!("control_sim: replaying seed {seed} (IOP_SIM_SEED)");
        match run_schedule(seed, base, true, profile) {
            Ok(stats) => {
                println!("control_sim: seed {seed} passed: {stats:?}");
                return stats;
            }
            Err(failure) => panic!("control_sim: seed {seed} failed: {failure}"),
        }
    }
    println!("control_sim: base seed {base_seed:#x} ({seed_var}), {schedules} schedules");
    const THREADS: u64 = 2;
    let stop = AtomicBool::new(false);
    let results: Vec<Result<Stats, (u64, String)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let stop = &stop;
                scope.spawn(move || {
                    let mut total = Stats::default();
                    let mut i = t;
                    while i < schedules && !stop.load(Ordering::Relaxed) {
                        let seed = base_seed.wrapping_add(i);
                        match run_schedule(seed, base, false, profile) {
                            Ok(stats) => total.add(&stats),
                            Err(failure) => {
                                stop.store(true, Ordering::Relaxed);
                                return Err((seed, failure));
                            }
                        }
                        i += THREADS;
                    }
                    Ok(total)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r,
                Err(_) => Err((0, "a simulation thread panicked".to_string())),
            })
            .collect()
    });
    let mut total = Stats::default();
    for r in results {
        match r {
            Ok(stats) => total.add(&stats),
            Err((seed, failure)) => {
                println!("control_sim: seed {seed} FAILED");
                panic!(
                    "control_sim: seed {seed} failed: {failure}\n\
                     replay with: IOP_SIM_SEED={seed} cargo test -p edge-bin --test control_sim -- --nocapture --include-ignored --exact {test_name}"
                );
            }
        }
    }
    println!(
        "control_sim: {} schedules, {} steps (base seed {base_seed:#x})",
        total.schedules, total.steps
    );
    println!(
        "control_sim: {} fleet inputs ({} reloads, {} drains, {} owners draining)",
        total.fleet_inputs(),
        total.reconfigures,
        total.set_drains,
        total.node_drainings
    );
    println!("control_sim: coverage {total:?}");
    total
}

/// Fails unless the run reached every named path at least once.
fn assert_reached(stats: &Stats, paths: &[(&str, u64)]) {
    assert!(
        stats.steps >= stats.schedules * MIN_STEPS,
        "{} steps in {} schedules",
        stats.steps,
        stats.schedules
    );
    for (name, n) in paths {
        assert!(*n > 0, "the simulation never reached `{name}`: {stats:?}");
    }
}

#[test]
fn simulation() {
    // CONTRACT: R1, R2, R3, R4, R5, F1, F2, F3, F4, H1, H2, H3, H4, H5, H6, P1, P2, P3, T4, U7, W2, X6
    let stats = run_all(&MAIN, SCHEDULES, "simulation");
    if std::env::var_os("IOP_SIM_SEED").is_none() {
        assert_eq!(stats.schedules, SCHEDULES);
        // The generator reaches every path it is meant to check.
        assert_reached(
            &stats,
            &[
                ("dispatches", stats.dispatches),
                ("completed", stats.completed),
                ("lost", stats.lost),
                ("cancelled", stats.cancelled),
                ("queue_timeouts", stats.queue_timeouts),
                ("queue_full", stats.queue_full),
                ("unknown_model", stats.unknown_model),
                ("fences", stats.fences),
                ("supersedes", stats.supersedes),
                ("first_readies", stats.first_readies),
                ("overlays_set", stats.overlays_set),
                ("overlays_cleared", stats.overlays_cleared),
                ("handoffs", stats.handoffs),
                ("probes", stats.probes),
                ("stale_inputs", stats.stale_inputs),
                ("released_on_close", stats.released_on_close),
                ("fenced_on_close", stats.fenced_on_close),
                ("late_frames", stats.late_frames),
                ("probes_retired", stats.probes_retired),
                ("retired_answers", stats.retired_answers),
                ("answers_recorded", stats.answers_recorded),
                ("freshness_guarded", stats.freshness_guarded),
                ("heartbeat_timeouts", stats.heartbeat_timeouts),
                ("heartbeat_fences", stats.heartbeat_fences),
                (
                    "heartbeat_terminals_delivered",
                    stats.heartbeat_terminals_delivered,
                ),
                ("heartbeat_terminals_lost", stats.heartbeat_terminals_lost),
                (
                    "heartbeat_readies_delivered",
                    stats.heartbeat_readies_delivered,
                ),
                ("heartbeat_readies_lost", stats.heartbeat_readies_lost),
                ("heartbeat_undeliverable", stats.heartbeat_undeliverable),
                (
                    "heartbeat_undeliverable_first",
                    stats.heartbeat_undeliverable_first,
                ),
                ("reconfigures", stats.reconfigures),
                ("reloads_unchanged", stats.reloads_unchanged),
                ("set_drains", stats.set_drains),
                ("node_drainings", stats.node_drainings),
                ("providers_retired", stats.providers_retired),
                ("nodes_retired", stats.nodes_retired),
                ("nodes_let_go", stats.nodes_let_go),
                ("grace_ends", stats.grace_ends),
                ("model_removed", stats.model_removed),
                ("trimmed", stats.trimmed),
                ("capacity_below_in_flight", stats.capacity_below_in_flight),
                ("reload_dispatches", stats.reload_dispatches),
                ("undrain_dispatches", stats.undrain_dispatches),
            ],
        );
    }
}

#[test]
fn simulation_fresh_seeds() {
    // CONTRACT: R1, R2, R3, R4, R5, F1, F2, F3, F4, H1, H2, H3, H4, H5, H6, P1, P2, P3, T4, U7, W2, X6
    // The fixed seeds of `simulation` replay the same schedules every run;
    // these start from a base seed taken from the clock (printed), so every
    // run explores schedules no earlier run saw. A failure prints its seed
    // (`IOP_SIM_SEED` replays it); `IOP_SIM_FRESH_SEED` repeats a whole run.
    let base_seed = env_u64("IOP_SIM_FRESH_SEED").unwrap_or_else(fresh_seed);
    let stats = run_from(
        &MAIN,
        FRESH_SCHEDULES,
        "simulation_fresh_seeds",
        base_seed,
        "fresh: IOP_SIM_FRESH_SEED",
    );
    if std::env::var_os("IOP_SIM_SEED").is_none() {
        assert_eq!(stats.schedules, FRESH_SCHEDULES);
        assert_reached(
            &stats,
            &[
                ("dispatches", stats.dispatches),
                ("completed", stats.completed),
                ("lost", stats.lost),
                ("fences", stats.fences),
                ("heartbeat_fences", stats.heartbeat_fences),
                (
                    "heartbeat_terminals_delivered",
                    stats.heartbeat_terminals_delivered,
                ),
                ("heartbeat_terminals_lost", stats.heartbeat_terminals_lost),
                (
                    "heartbeat_readies_delivered",
                    stats.heartbeat_readies_delivered,
                ),
                ("heartbeat_undeliverable", stats.heartbeat_undeliverable),
                (
                    "heartbeat_undeliverable_first",
                    stats.heartbeat_undeliverable_first,
                ),
            ],
        );
    }
}

/// A base seed no earlier run used: the clock's nanoseconds and the wall
/// clock, mixed (SplitMix64's finalizer).
fn fresh_seed() -> u64 {
    let mut z = iop_engine::clock::monotonic_raw_ns()
        ^ (iop_engine::clock::unix_ms() as u64).rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn simulation_connections_ordered_closed_never_own_or_receive_work() {
    // CONTRACT: R3, R4, X6
    // Same checks as `simulation`, weighted towards owners ordered closed
    // (a ready naming another node id) while work waits, and late frames
    // (ready, register, terminals, answers) of connections ordered closed:
    // after every step no such connection owns a node id, and nothing is
    // dispatched or probed to it.
    let stats = run_all(
        &CLOSING,
        FOCUS_SCHEDULES,
        "simulation_connections_ordered_closed_never_own_or_receive_work",
    );
    if std::env::var_os("IOP_SIM_SEED").is_none() {
        assert_eq!(stats.schedules, FOCUS_SCHEDULES);
        assert_reached(
            &stats,
            &[
                ("dispatches", stats.dispatches),
                ("lost", stats.lost),
                ("released_on_close", stats.released_on_close),
                ("fenced_on_close", stats.fenced_on_close),
                ("late_frames", stats.late_frames),
                ("supersedes", stats.supersedes),
                ("probes", stats.probes),
            ],
        );
    }
}

#[test]
fn simulation_fresh_available_answers_keep_older_unavailable_stalls_out() {
    // CONTRACT: H4, H6
    // Same checks as `simulation`, weighted towards stall evidence
    // interleaved with recovery-probe answers: a fresh available answer
    // about exactly one binding raises its sequence even without an
    // overlay, so an older unavailable stall never sets one; a newer probe
    // retires the older one of its provider, whose late answer is ignored
    // uncounted.
    let stats = run_all(
        &FRESHNESS,
        FOCUS_SCHEDULES,
        "simulation_fresh_available_answers_keep_older_unavailable_stalls_out",
    );
    if std::env::var_os("IOP_SIM_SEED").is_none() {
        assert_eq!(stats.schedules, FOCUS_SCHEDULES);
        assert_reached(
            &stats,
            &[
                ("overlays_set", stats.overlays_set),
                ("overlays_cleared", stats.overlays_cleared),
                ("answers_recorded", stats.answers_recorded),
                ("freshness_guarded", stats.freshness_guarded),
                ("probes_retired", stats.probes_retired),
                ("retired_answers", stats.retired_answers),
            ],
        );
    }
}

// ---------------------------------------------------------------------------
// Focused tests, one per requirement, on the fixed world
// ---------------------------------------------------------------------------
//
// Fixed world (`WorldParams::fixed`): capacities n1/p1 2 (long 1), n1/p2 1,
// n1/p3 1, n2/p1 1 (long 1), n2/p2 1, n2/p3 1, n3/p1 1, n3/p2 disabled;
// m-a = [n1/p1, n2/p1, n3/p1] (max queue 2, 100 ms), m-b = [n1/p2, n2/p1,
// n2/p3] (1, 200 ms), m-c = [n2/p2, n3/p2, n1/p1, n1/p3] (3, 150 ms);
// cancel settle 50 ms, recovery probe every 40 ms.

const C1: ConnId = ConnId(1);
const C2: ConnId = ConnId(2);
const C3: ConnId = ConnId(3);

fn key(node: &str, provider: &str) -> ProviderKey {
    ProviderKey {
        node_id: node.to_string().into(),
        provider_id: provider.to_string().into(),
    }
}

fn rid(id: u64) -> RequestId {
    RequestId(id)
}

fn stall(
    health: pb::ProviderHealth,
    classification: pb::LivenessClassification,
    seq: Option<u64>,
) -> Option<StallEvidence> {
    Some(StallEvidence {
        health,
        classification,
        seq,
    })
}

fn unavailable(seq: u64) -> Option<StallEvidence> {
    stall(
        pb::ProviderHealth::Unavailable,
        pb::LivenessClassification::ProviderUnhealthy,
        Some(seq),
    )
}

fn available(seq: u64) -> Option<StallEvidence> {
    stall(
        pb::ProviderHealth::Available,
        pb::LivenessClassification::RequestStalled,
        Some(seq),
    )
}

fn done(id: u64, outcome: Outcome) -> Action {
    Action::Done {
        request: rid(id),
        outcome,
    }
}

fn connected(node: &str) -> Action {
    Action::Event(Event::NodeConnected {
        node_id: node.to_string(),
    })
}

fn disconnected(node: &str) -> Action {
    Action::Event(Event::NodeDisconnected {
        node_id: node.to_string(),
    })
}

fn transition(node: &str, provider: &str, unavailable: bool) -> Action {
    Action::Event(Event::HealthTransition {
        provider: key(node, provider),
        unavailable,
    })
}

fn ready_true(conn: ConnId) -> Action {
    Action::ReadyResponse {
        conn,
        response: pb::NodeReadyResponse {
            ready: true,
            reason: String::new(),
        },
    }
}

fn ready_false(conn: ConnId, reason: &str) -> Vec<Action> {
    vec![
        Action::ReadyResponse {
            conn,
            response: pb::NodeReadyResponse {
                ready: false,
                reason: reason.to_string(),
            },
        },
        Action::Close {
            conn,
            reason: CloseReason::NotReady,
        },
    ]
}

fn register_rejected(conn: ConnId, reason: &str) -> Action {
    Action::RegisterResponse {
        conn,
        response: pb::RegisterResponse {
            accepted: false,
            reason: reason.to_string(),
            config: None,
            accepts_node_draining: false,
        },
    }
}

const NOT_REGISTERED: &str = "this connection did not register this node id";
const SUPERSEDED: &str = "superseded by a newer registration of this node id";

fn capability(
    adapter: &str,
    target: &str,
    status: pb::ProviderHealth,
    seq: Option<u64>,
) -> pb::AdapterCapability {
    pb::AdapterCapability {
        adapter_key: adapter.to_string(),
        target: target.to_string(),
        provider_status: status as i32,
        health_observation_seq: seq,
        adapter: "diagnostic".to_string(),
        instance_key: "diagnostic".to_string(),
    }
}

fn answer(
    command_id: &str,
    ok: bool,
    capabilities: Vec<pb::AdapterCapability>,
) -> pb::NodeCommandResponse {
    pb::NodeCommandResponse {
        command_id: command_id.to_string(),
        ok,
        capabilities,
        ..Default::default()
    }
}

fn probe(conn: ConnId, n: u64, adapter: &str) -> Action {
    Action::SendCommand {
        conn,
        command: pb::NodeCommandRequest {
            command_id: format!("recovery-{n}"),
            r#type: pb::CommandType::Capabilities as i32,
            adapter: adapter.to_string(),
            path: String::new(),
        },
    }
}

/// A `Control` on the fixed world with a manual clock.
struct Fixture {
    world: World,
    control: Control,
    base: Instant,
    now: Instant,
}

impl Fixture {
    fn new() -> Self {
        let world = World::new(&WorldParams::fixed());
        let control = Control::new(world.spec());
        let base = iop_engine::clock::now();
        Self {
            world,
            control,
            base,
            now: base,
        }
    }

    fn handle(&mut self, input: Input) -> Vec<Action> {
        let mut out = Vec::new();
        self.control.handle(self.now, input, &mut out);
        out
    }

    /// Moves the clock by `ms` and runs the timers due.
    fn advance(&mut self, ms: u64) -> Vec<Action> {
        self.now += Duration::from_millis(ms);
        let mut out = Vec::new();
        self.control.handle_timeout(self.now, &mut out);
        out
    }

    fn at(&self, ms: u64) -> Instant {
        self.base + Duration::from_millis(ms)
    }

    fn register(&mut self, conn: ConnId, node: &str) -> Vec<Action> {
        self.handle(Input::Register {
            conn,
            tls_name: node.to_string(),
            node_id: node.to_string(),
        })
    }

    fn ready(&mut self, conn: ConnId, node: &str) -> Vec<Action> {
        self.handle(Input::Ready {
            conn,
            node_id: node.to_string(),
        })
    }

    fn accepted(&self, conn: ConnId, node: &str) -> Action {
        let n = self.world.node_index(node).unwrap_or(0);
        Action::RegisterResponse {
            conn,
            response: pb::RegisterResponse {
                accepted: true,
                reason: String::new(),
                config: Some(self.world.nodes[n].config.clone()),
                accepts_node_draining: true,
            },
        }
    }

    /// Registers and readies `node` on `conn`; returns the ready's actions.
    fn connect(&mut self, conn: ConnId, node: &str) -> Vec<Action> {
        let out = self.register(conn, node);
        assert_eq!(out[0], self.accepted(conn, node));
        self.ready(conn, node)
    }

    fn close(&mut self, conn: ConnId) -> Vec<Action> {
        self.handle(Input::Closed {
            conn,
            drained: false,
        })
    }

    fn submit(&mut self, id: u64, model: &str, long: bool) -> Vec<Action> {
        self.handle(Input::Submit {
            request: rid(id),
            model: model.to_string(),
            operation: Operation::ChatCompletions,
            long,
            hint: RouteHint::default(),
            share: edge_bin::control::fair::Share::default(),
        })
    }

    /// A terminal for request `id` on `conn` with the lease's own evidence
    /// (or the given provider's, when the lease is gone).
    fn terminal(&mut self, conn: ConnId, id: u64, stall: Option<StallEvidence>) -> Vec<Action> {
        let (adapter, target) = match self.control.lease(&rid(id).run_id()) {
            Some(l) => (l.adapter.to_string(), l.target.to_string()),
            None => ("ollama-a".to_string(), "llama3".to_string()),
        };
        self.terminal_with(conn, id, &adapter, &target, stall)
    }

    fn terminal_with(
        &mut self,
        conn: ConnId,
        id: u64,
        adapter: &str,
        target: &str,
        stall: Option<StallEvidence>,
    ) -> Vec<Action> {
        self.handle(Input::Terminal(Terminal {
            conn,
            run_id: rid(id).run_id(),
            adapter: adapter.to_string(),
            target: target.to_string(),
            stall,
            end: AttemptEnd::Other,
            committed: true,
        }))
    }

    fn command_result(&mut self, conn: ConnId, response: pb::NodeCommandResponse) -> Vec<Action> {
        self.handle(Input::CommandResult { conn, response })
    }

    /// The exact dispatch of request `id` to provider `node/provider` on
    /// `conn` under its current generation.
    fn dispatch(&self, id: u64, node: &str, provider: &str, conn: ConnId, long: bool) -> Action {
        let p = self.world.prov_index(&key(node, provider)).unwrap_or(0);
        let info = &self.world.provs[p];
        Action::Dispatch(Dispatch {
            request: rid(id),
            lease: ProviderLease {
                request: rid(id),
                run_id: rid(id).run_id(),
                provider: info.key.clone(),
                conn,
                generation: self.control.generation_of(conn).unwrap_or(Generation(0)),
                adapter: info.spec.adapter.clone(),
                target: info.spec.target.clone(),
                long,
            },
            kind: info.spec.kind,
            response_stall_timeout_ms: info.spec.response_stall_timeout_ms,
            // No node here says it strips a usage chunk.
            strips_usage_chunk: false,
            accepts_tunnel_body: false,
        })
    }

    fn snapshot(&self, node: &str, provider: &str) -> pb::ProviderSnapshot {
        let k = key(node, provider);
        self.control
            .snapshots()
            .into_iter()
            .find(|s| *s.node_id == *k.node_id && *s.provider_id == *k.provider_id)
            .unwrap_or_default()
    }

    /// The configured identity of a provider, every figure zero.
    fn identity(&self, node: &str, provider: &str) -> pb::ProviderSnapshot {
        let p = self.world.prov_index(&key(node, provider)).unwrap_or(0);
        let info = &self.world.provs[p];
        pb::ProviderSnapshot {
            node_id: node.to_string(),
            provider_id: provider.to_string(),
            adapter: info.spec.adapter.to_string(),
            target: info.spec.target.to_string(),
            category: info.spec.category as i32,
            ..Default::default()
        }
    }

    /// P3: the projection of an offline or pending node's provider.
    fn offline(&self, node: &str, provider: &str) -> pb::ProviderSnapshot {
        pb::ProviderSnapshot {
            connected: false,
            status: pb::ProviderStatus::Unavailable as i32,
            health: pb::ProviderHealth::Offline as i32,
            ..self.identity(node, provider)
        }
    }

    /// An available provider's projection with these live figures.
    fn live(
        &self,
        node: &str,
        provider: &str,
        in_flight: [u32; 2],
        queued: [u32; 2],
    ) -> pb::ProviderSnapshot {
        let p = self.world.prov_index(&key(node, provider)).unwrap_or(0);
        let spec = &self.world.provs[p].spec;
        pb::ProviderSnapshot {
            connected: true,
            status: pb::ProviderStatus::Available as i32,
            health: pb::ProviderHealth::Available as i32,
            capacity: spec.capacity,
            long_context_capacity: spec.long_context_capacity,
            in_flight: in_flight[0],
            long_in_flight: in_flight[1],
            queued: queued[0],
            long_queued: queued[1],
            ..self.identity(node, provider)
        }
    }

    fn lease_ids(&self) -> Vec<String> {
        self.control.leases().map(|l| l.run_id.clone()).collect()
    }

    fn pending(&self) -> Vec<RequestId> {
        self.control.pending_requests().collect()
    }

    /// Everything observable except the registry.
    fn state(&self) -> Observed {
        let c = &self.control;
        Observed {
            snapshots: c.snapshots(),
            leases: c.leases().cloned().collect(),
            pending: c
                .pending_requests()
                .map(|r| (r, c.queue_deadline(r)))
                .collect(),
            counters: c.counters().clone(),
            poll: c.poll_timeout(),
            overlaid: self
                .world
                .provs
                .iter()
                .map(|p| c.is_overlaid(&p.key))
                .collect(),
            registry: Vec::new(),
        }
    }
}

#[test]
fn r1_second_register_on_a_bound_connection_is_rejected_and_keeps_the_binding() {
    // CONTRACT: R1
    let mut f = Fixture::new();
    assert_eq!(f.register(C1, "n1"), vec![f.accepted(C1, "n1")]);
    let generation = f.control.generation_of(C1);
    assert!(generation.is_some());
    let already = "connection already registered as node `n1`; one node id per connection";
    for node_id in ["n2", "n1", UNKNOWN_NODE] {
        let out = f.handle(Input::Register {
            conn: C1,
            tls_name: "n1".to_string(),
            node_id: node_id.to_string(),
        });
        // Rejected, not closed; the first binding and its generation stay.
        assert_eq!(out, vec![register_rejected(C1, already)]);
        assert_eq!(f.control.node_of(C1), Some("n1"));
        assert_eq!(f.control.generation_of(C1), generation);
    }
    assert_eq!(f.control.ready_conn("n2"), None);
    // The first binding still works.
    assert_eq!(f.ready(C1, "n1"), vec![ready_true(C1), connected("n1")]);
    let out = f.handle(Input::Register {
        conn: C1,
        tls_name: "n1".to_string(),
        node_id: "n2".to_string(),
    });
    assert_eq!(out, vec![register_rejected(C1, already)]);
    assert!(f.control.is_ready_owner(C1));
    assert_eq!(f.control.generation_of(C1), generation);
}

#[test]
fn t3_register_id_must_match_the_tls_name_and_be_configured() {
    // CONTRACT: T3
    let mut f = Fixture::new();
    let out = f.handle(Input::Register {
        conn: C1,
        tls_name: "n2".to_string(),
        node_id: "n1".to_string(),
    });
    assert_eq!(
        out,
        vec![
            register_rejected(C1, "node id `n1` does not match the TLS identity name `n2`"),
            Action::Close {
                conn: C1,
                reason: CloseReason::RegistrationRejected
            },
        ]
    );
    let out = f.register(C2, UNKNOWN_NODE);
    assert_eq!(
        out,
        vec![
            register_rejected(C2, "node `n9` is not configured at this edge"),
            Action::Close {
                conn: C2,
                reason: CloseReason::RegistrationRejected
            },
        ]
    );
    assert_eq!(f.control.node_of(C1), None);
    assert_eq!(f.control.node_of(C2), None);
    assert_eq!(f.control.generation_of(C1), None);
}

#[test]
fn r2_register_is_a_pending_claim_and_a_newer_one_supersedes() {
    // CONTRACT: R2
    let mut f = Fixture::new();
    assert_eq!(f.register(C1, "n1"), vec![f.accepted(C1, "n1")]);
    let g1 = f
        .control
        .generation_of(C1)
        .expect("pending owner has a generation");
    assert!(!f.control.is_ready_owner(C1));
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    // A newer registration supersedes the pending one: closed, no fence.
    assert_eq!(
        f.register(C2, "n1"),
        vec![
            f.accepted(C2, "n1"),
            Action::Close {
                conn: C1,
                reason: CloseReason::Superseded
            },
        ]
    );
    let g2 = f
        .control
        .generation_of(C2)
        .expect("new owner has a generation");
    assert!(g2 > g1);
    assert_eq!(f.control.generation_of(C1), None);
    assert_eq!(f.ready(C1, "n1"), ready_false(C1, SUPERSEDED));
    assert_eq!(f.ready(C2, "n1"), vec![ready_true(C2), connected("n1")]);
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C2, false)]
    );
    // A ready owner superseded: fenced first (its lease lost), then closed.
    assert_eq!(
        f.register(C3, "n1"),
        vec![
            f.accepted(C3, "n1"),
            done(1, Outcome::Lost),
            disconnected("n1"),
            Action::Close {
                conn: C2,
                reason: CloseReason::Superseded
            },
        ]
    );
    assert!(f.control.generation_of(C3).expect("generation") > g2);
    // Superseded connections keep their binding: late frames get the
    // accurate reason.
    assert_eq!(f.control.node_of(C2), Some("n1"));
    assert_eq!(f.ready(C2, "n1"), ready_false(C2, SUPERSEDED));
    assert_eq!(f.lease_ids(), Vec::<String>::new());
    assert_eq!(f.pending(), vec![]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
}

#[test]
fn r3_only_the_first_ready_of_the_pending_owner_activates() {
    // CONTRACT: R3
    let mut f = Fixture::new();
    assert_eq!(f.submit(1, "m-a", false), vec![]);
    assert_eq!(f.register(C1, "n1"), vec![f.accepted(C1, "n1")]);
    // First ready: ack, node.connected, and the stranded waiter is pumped.
    assert_eq!(
        f.ready(C1, "n1"),
        vec![
            ready_true(C1),
            connected("n1"),
            f.dispatch(1, "n1", "p1", C1, false)
        ]
    );
    // Duplicate: ready true, no side effect.
    let before = f.state();
    assert_eq!(f.ready(C1, "n1"), vec![ready_true(C1)]);
    assert_eq!(f.state(), before);
    // Superseded, never registered, rejected: ready false and close.
    assert_eq!(
        f.register(ConnId(5), "n2"),
        vec![f.accepted(ConnId(5), "n2")]
    );
    assert_eq!(f.register(ConnId(6), "n2")[0], f.accepted(ConnId(6), "n2"));
    let before = f.state();
    assert_eq!(f.ready(ConnId(5), "n2"), ready_false(ConnId(5), SUPERSEDED));
    assert_eq!(
        f.ready(ConnId(9), "n3"),
        ready_false(ConnId(9), NOT_REGISTERED)
    );
    let out = f.handle(Input::Register {
        conn: ConnId(7),
        tls_name: "n2".to_string(),
        node_id: "n3".to_string(),
    });
    assert_eq!(out.len(), 2);
    assert_eq!(
        f.ready(ConnId(7), "n3"),
        ready_false(ConnId(7), NOT_REGISTERED)
    );
    assert_eq!(f.state(), before);
    assert_eq!(f.control.ready_conn("n2"), None);
    assert_eq!(f.control.ready_conn("n3"), None);
    assert_eq!(f.control.ready_nodes(), vec![("n1".to_string(), C1)]);
}

#[test]
fn r4_nothing_is_dispatched_to_or_reported_for_a_connection_before_its_ready_ack() {
    // CONTRACT: R4
    let mut f = Fixture::new();
    assert_eq!(f.register(C1, "n1"), vec![f.accepted(C1, "n1")]);
    assert_eq!(f.submit(1, "m-a", false), vec![]);
    assert_eq!(f.control.queue_deadline(rid(1)), Some(f.at(100)));
    assert!(!f.control.is_ready_owner(C1));
    assert_eq!(f.control.ready_conn("n1"), None);
    assert_eq!(f.control.ready_nodes(), vec![]);
    for p in ["p1", "p2"] {
        assert_eq!(f.snapshot("n1", p), f.offline("n1", p));
    }
    let out = f.ready(C1, "n1");
    // The ack goes out before the first run.
    assert_eq!(
        out,
        vec![
            ready_true(C1),
            connected("n1"),
            f.dispatch(1, "n1", "p1", C1, false)
        ]
    );
}

#[test]
fn r5_the_generation_is_never_a_wire_field() {
    // CONTRACT: R5
    // Exhaustive destructuring: a generation field added to any message
    // the Edge sends a node fails to compile here.
    let pb::RegisterResponse {
        accepted: _,
        reason: _,
        config: _,
        accepts_node_draining: _,
    } = pb::RegisterResponse::default();
    let pb::NodeReadyResponse {
        ready: _,
        reason: _,
    } = pb::NodeReadyResponse::default();
    let pb::RunRequest {
        run_id: _,
        adapter: _,
        target: _,
        input: _,
        metadata: _,
        session_id: _,
        timeout_sec: _,
        response_stall_timeout_ms: _,
        flow_window_bytes: _,
        correlation_id: _,
        operation: _,
        trace: _,
    } = pb::RunRequest::default();
    let pb::ProviderTunnelRequest {
        run_id: _,
        adapter: _,
        target: _,
        method: _,
        path: _,
        headers: _,
        body: _,
        stream: _,
        timeout_sec: _,
        metadata: _,
        session_id: _,
        response_stall_timeout_ms: _,
        operation: _,
        credential_lease: _,
        credential_binding: _,
        flow_window_bytes: _,
        correlation_id: _,
        strip_usage_chunk: _,
        body_follows_bytes: _,
        trace: _,
    } = pb::ProviderTunnelRequest::default();
    let pb::FlowCredit { credits: _ } = pb::FlowCredit::default();
    let pb::RunCredit {
        run_id: _,
        max_offset: _,
    } = pb::RunCredit::default();
    let pb::NodeCommandRequest {
        command_id: _,
        r#type: _,
        adapter: _,
        path: _,
    } = pb::NodeCommandRequest::default();
    let pb::CancelRequest {
        run_id: _,
        reason: _,
    } = pb::CancelRequest::default();
    // And the messages of two generations of one node are byte-identical:
    // ownership is (node id, connection), never a number on the wire.
    let mut f = Fixture::new();
    let first = f.register(C1, "n1");
    f.close(C1);
    let second = f.register(C2, "n1");
    assert_ne!(f.control.generation_of(C2), Some(Generation(0)));
    let wire = |a: &Action| match a {
        Action::RegisterResponse { response, .. } => prost::Message::encode_to_vec(response),
        Action::ReadyResponse { response, .. } => prost::Message::encode_to_vec(response),
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(wire(&first[0]), wire(&second[0]));
    let ready1 = f.ready(C2, "n1");
    f.close(C2);
    f.register(C3, "n1");
    let ready2 = f.ready(C3, "n1");
    assert_eq!(wire(&ready1[0]), wire(&ready2[0]));
}

#[test]
fn f1_close_of_the_ready_owner_fences_its_generation_once() {
    // CONTRACT: F1
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-a", false),
        vec![f.dispatch(2, "n2", "p1", C2, false)]
    );
    assert_eq!(
        f.submit(3, "m-a", false),
        vec![f.dispatch(3, "n1", "p1", C1, false)]
    );
    assert_eq!(f.submit(4, "m-a", false), vec![]);
    // One step: both leases of the generation released once, resources
    // offline, the queue re-evaluated against the live candidates.
    assert_eq!(
        f.close(C1),
        vec![
            done(1, Outcome::Lost),
            done(3, Outcome::Lost),
            disconnected("n1")
        ]
    );
    assert_eq!(f.lease_ids(), vec!["run-2".to_string()]);
    assert_eq!(f.pending(), vec![rid(2), rid(4)]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    assert_eq!(f.snapshot("n2", "p1"), f.live("n2", "p1", [1, 0], [1, 0]));
    // Nothing is released twice: a second close and late terminals are no-ops.
    let before = f.state();
    assert_eq!(f.close(C1), vec![]);
    assert_eq!(f.terminal(C1, 1, None), vec![]);
    assert_eq!(f.terminal(C1, 3, unavailable(1)), vec![]);
    assert_eq!(f.state(), before);
    // The waiter gets the surviving provider's next free slot.
    assert_eq!(
        f.terminal(C2, 2, None),
        vec![
            done(2, Outcome::Completed),
            f.dispatch(4, "n2", "p1", C2, false)
        ]
    );
}

#[test]
fn f2_callbacks_from_stale_connections_change_nothing() {
    // CONTRACT: F2
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    // Overlay n1/p1 so a recovery probe is outstanding on C1.
    assert_eq!(
        f.submit(2, "m-a", false),
        vec![f.dispatch(2, "n2", "p1", C2, false)]
    );
    f.terminal(C1, 1, unavailable(4));
    assert_eq!(f.advance(40), vec![probe(C1, 1, "ollama-a")]);
    assert_eq!(
        f.submit(3, "m-b", false),
        vec![f.dispatch(3, "n1", "p2", C1, false)]
    );
    // C1 is superseded: fenced once, then closed.
    assert_eq!(
        f.register(C3, "n1"),
        vec![
            f.accepted(C3, "n1"),
            done(3, Outcome::Lost),
            disconnected("n1"),
            Action::Close {
                conn: C1,
                reason: CloseReason::Superseded
            },
        ]
    );
    let before = f.state();
    // Late ready, terminal, command result, heartbeat timeout/close from C1.
    assert_eq!(f.ready(C1, "n1"), ready_false(C1, SUPERSEDED));
    assert_eq!(f.terminal(C1, 3, unavailable(9)), vec![]);
    assert_eq!(
        f.terminal_with(C1, 2, "vllm-b", "qwen", unavailable(9)),
        vec![]
    );
    let late = answer(
        "recovery-1",
        true,
        vec![capability(
            "ollama-a",
            "llama3",
            pb::ProviderHealth::Available,
            Some(10),
        )],
    );
    assert_eq!(f.command_result(C1, late), vec![]);
    assert_eq!(f.close(C1), vec![]);
    assert_eq!(f.state(), before);
    assert!(f.control.generation_of(C3).is_some());
    assert_eq!(f.control.node_of(C1), None);
    assert_eq!(f.control.node_of(C3), Some("n1"));
    // A connection that never registered: nothing either.
    assert_eq!(f.close(ConnId(40)), vec![]);
    assert_eq!(
        f.terminal_with(ConnId(40), 2, "vllm-b", "qwen", None),
        vec![]
    );
    assert_eq!(f.state(), before);
}

#[test]
fn f3_a_new_generation_activates_configured_capacity_and_pumps_at_once() {
    // CONTRACT: F3
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-a", true),
        vec![f.dispatch(2, "n1", "p1", C1, true)]
    );
    assert_eq!(
        f.submit(3, "m-c", false),
        vec![f.dispatch(3, "n1", "p3", C1, false)]
    );
    assert_eq!(f.submit(4, "m-a", true), vec![]);
    assert_eq!(f.submit(5, "m-c", false), vec![]);
    assert_eq!(
        f.close(C1),
        vec![
            done(1, Outcome::Lost),
            done(2, Outcome::Lost),
            done(3, Outcome::Lost),
            disconnected("n1")
        ]
    );
    assert_eq!(f.register(C2, "n1"), vec![f.accepted(C2, "n1")]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    assert_eq!(
        f.ready(C2, "n1"),
        vec![
            ready_true(C2),
            connected("n1"),
            f.dispatch(4, "n1", "p1", C2, true),
            f.dispatch(5, "n1", "p3", C2, false),
        ]
    );
    assert_eq!(f.snapshot("n1", "p1"), f.live("n1", "p1", [1, 1], [0, 0]));
    assert_eq!(f.snapshot("n1", "p3"), f.live("n1", "p3", [1, 0], [0, 0]));
}

#[test]
fn f4_correctness_transitions_happen_in_the_handle_call_without_events() {
    // CONTRACT: F4
    // The shell drops every Event action here; lease release, overlay,
    // fencing and queue settlement are complete in the state (and in the
    // non-event actions) when handle() returns.
    let mut f = Fixture::new();
    let handle = |f: &mut Fixture, input: Input| -> Vec<Action> {
        let mut out = f.handle(input);
        out.retain(|a| !matches!(a, Action::Event(_)));
        out
    };
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    for (id, node, conn) in [(1, "n1", C1), (2, "n2", C2), (3, "n1", C1)] {
        let out = handle(
            &mut f,
            Input::Submit {
                request: rid(id),
                model: "m-a".to_string(),
                operation: Operation::ChatCompletions,
                long: false,
                hint: RouteHint::default(),
                share: edge_bin::control::fair::Share::default(),
            },
        );
        assert_eq!(out, vec![f.dispatch(id, node, "p1", conn, false)]);
    }
    assert_eq!(f.submit(4, "m-a", false), vec![]);
    // A stall with unavailable evidence: released and overlaid in one call.
    let out = handle(
        &mut f,
        Input::Terminal(Terminal {
            conn: C2,
            run_id: rid(2).run_id(),
            adapter: "vllm-b".to_string(),
            target: "qwen".to_string(),
            stall: unavailable(1),
            end: AttemptEnd::Other,
            committed: true,
        }),
    );
    assert_eq!(
        out,
        vec![
            Action::StallHandoff {
                request: rid(2),
                handoff: Handoff {
                    provider_id: "p1".to_string(),
                    provider_health: pb::ProviderHealth::Unavailable,
                    recovery_handoff: "confirmed",
                },
            },
            done(2, Outcome::Completed),
        ]
    );
    assert!(f.control.is_overlaid(&key("n2", "p1")));
    assert_eq!(f.control.lease("run-2"), None);
    // The fence: every lease released and the request ended in the call.
    assert_eq!(
        handle(
            &mut f,
            Input::Closed {
                conn: C1,
                drained: false
            }
        ),
        vec![done(1, Outcome::Lost), done(3, Outcome::Lost)]
    );
    assert_eq!(f.lease_ids(), Vec::<String>::new());
    assert_eq!(f.pending(), vec![rid(4)]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    // Queue settlement by the timer alone.
    assert_eq!(
        f.advance(100),
        vec![
            done(4, Outcome::Rejected(Rejection::QueueTimeout)),
            probe(C2, 1, "vllm-b")
        ]
    );
    assert_eq!(f.pending(), vec![]);
}

#[test]
fn h1_a_terminal_is_identified_by_its_connection_not_its_payload() {
    // CONTRACT: H1
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    let before = f.state();
    // The right run id and evidence on another node's connection.
    assert_eq!(
        f.terminal_with(C2, 1, "ollama-a", "llama3", unavailable(3)),
        vec![]
    );
    assert_eq!(f.state(), before);
    // On its own connection, even with another provider's payload fields.
    assert_eq!(
        f.terminal_with(C1, 1, "vllm-b", "qwen", None),
        vec![done(1, Outcome::Completed)]
    );
    assert_eq!(f.control.lease("run-1"), None);
}

#[test]
fn h2_a_current_terminal_releases_once_even_with_rejected_evidence() {
    // CONTRACT: H2
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-a", false),
        vec![f.dispatch(2, "n1", "p1", C1, false)]
    );
    // Mismatched adapter evidence with a fresh unavailable observation.
    assert_eq!(
        f.terminal_with(C1, 1, "vllm-a", "llama3", unavailable(5)),
        vec![done(1, Outcome::Completed)]
    );
    assert!(!f.control.is_overlaid(&key("n1", "p1")));
    assert_eq!(f.lease_ids(), vec!["run-2".to_string()]);
    // Duplicate: nothing.
    let before = f.state();
    assert_eq!(f.terminal(C1, 1, unavailable(6)), vec![]);
    assert_eq!(f.state(), before);
    // Malformed pair (unavailable + request_stalled), then unbound (no seq).
    assert_eq!(
        f.terminal(
            C1,
            2,
            stall(
                pb::ProviderHealth::Unavailable,
                pb::LivenessClassification::RequestStalled,
                Some(7)
            )
        ),
        vec![done(2, Outcome::Completed)]
    );
    assert_eq!(
        f.submit(3, "m-a", false),
        vec![f.dispatch(3, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.terminal(
            C1,
            3,
            stall(
                pb::ProviderHealth::Unavailable,
                pb::LivenessClassification::ProviderUnhealthy,
                None
            )
        ),
        vec![done(3, Outcome::Completed)]
    );
    assert!(!f.control.is_overlaid(&key("n1", "p1")));
    assert_eq!(
        f.control.counters(),
        &Counters {
            health_evidence_rejected: 3,
            recovery_ineligible: 3,
            ..Counters::default()
        }
    );
    assert_eq!(f.snapshot("n1", "p1"), f.live("n1", "p1", [0, 0], [0, 0]));
}

#[test]
fn h3_a_validated_current_bound_stall_gets_a_confirmed_handoff() {
    // CONTRACT: H3
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    let handoff = |request: u64, health: pb::ProviderHealth| Action::StallHandoff {
        request: rid(request),
        handoff: Handoff {
            provider_id: "p1".to_string(),
            provider_health: health,
            recovery_handoff: "confirmed",
        },
    };
    f.submit(1, "m-a", false);
    assert_eq!(
        f.terminal(C1, 1, available(3)),
        vec![
            handoff(1, pb::ProviderHealth::Available),
            done(1, Outcome::Completed)
        ]
    );
    // Sequence-stale, still a request-local handoff.
    f.submit(2, "m-a", false);
    assert_eq!(
        f.terminal(
            C1,
            2,
            stall(
                pb::ProviderHealth::Unknown,
                pb::LivenessClassification::HealthUnknown,
                Some(2)
            )
        ),
        vec![
            handoff(2, pb::ProviderHealth::Unknown),
            done(2, Outcome::Completed)
        ]
    );
    // Unbound evidence (no sequence): no handoff.
    f.submit(3, "m-a", false);
    assert_eq!(
        f.terminal(
            C1,
            3,
            stall(
                pb::ProviderHealth::Available,
                pb::LivenessClassification::RequestStalled,
                None
            )
        ),
        vec![done(3, Outcome::Completed)]
    );
    assert_eq!(
        f.control.counters(),
        &Counters {
            health_evidence_accepted: 2,
            health_evidence_rejected: 1,
            recovery_eligible: 2,
            recovery_ineligible: 1,
            ..Counters::default()
        }
    );
}

#[test]
fn h4_only_a_fresh_unavailable_observation_sets_the_overlay() {
    // CONTRACT: H4
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    let n1p1 = key("n1", "p1");
    let run = |f: &mut Fixture, id: u64, evidence: Option<StallEvidence>| {
        assert_eq!(
            f.submit(id, "m-a", false),
            vec![f.dispatch(id, "n1", "p1", C1, false)]
        );
        f.terminal(C1, id, evidence)
    };
    run(&mut f, 1, available(5));
    // Older and equal sequences: stale.
    run(&mut f, 2, unavailable(4));
    run(&mut f, 3, unavailable(5));
    assert!(!f.control.is_overlaid(&n1p1));
    // Fresh but not unavailable.
    run(
        &mut f,
        4,
        stall(
            pb::ProviderHealth::Unknown,
            pb::LivenessClassification::HealthUnknown,
            Some(6),
        ),
    );
    assert!(!f.control.is_overlaid(&n1p1));
    // Fresh unavailable.
    let out = run(&mut f, 5, unavailable(7));
    assert_eq!(
        out,
        vec![
            Action::StallHandoff {
                request: rid(5),
                handoff: Handoff {
                    provider_id: "p1".to_string(),
                    provider_health: pb::ProviderHealth::Unavailable,
                    recovery_handoff: "confirmed",
                },
            },
            transition("n1", "p1", true),
            done(5, Outcome::Completed),
        ]
    );
    assert!(f.control.is_overlaid(&n1p1));
    assert!(!f.control.is_overlaid(&key("n1", "p2")));
    assert_eq!(f.control.counters().health_transitions_unavailable, 1);
    // The overlaid provider is no candidate.
    assert_eq!(f.submit(6, "m-a", false), vec![]);
}

#[test]
fn h5_an_overlaid_provider_projects_unavailable_and_a_new_generation_drops_it() {
    // CONTRACT: H5
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.submit(1, "m-a", false);
    f.submit(2, "m-a", false);
    f.terminal(C1, 1, unavailable(1));
    // Catalog identity kept, every effective figure zero, although run-2
    // still holds a lease on it.
    assert_eq!(
        f.snapshot("n1", "p1"),
        pb::ProviderSnapshot {
            connected: true,
            status: pb::ProviderStatus::Unavailable as i32,
            health: pb::ProviderHealth::Unavailable as i32,
            ..f.identity("n1", "p1")
        }
    );
    assert_eq!(f.lease_ids(), vec!["run-2".to_string()]);
    assert_eq!(f.snapshot("n1", "p2"), f.live("n1", "p2", [0, 0], [0, 0]));
    // A new generation starts without the old overlay.
    f.register(C2, "n1");
    assert!(!f.control.is_overlaid(&key("n1", "p1")));
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    f.ready(C2, "n1");
    assert!(!f.control.is_overlaid(&key("n1", "p1")));
    assert_eq!(f.snapshot("n1", "p1"), f.live("n1", "p1", [0, 0], [0, 0]));
    assert_eq!(
        f.submit(3, "m-a", false),
        vec![f.dispatch(3, "n1", "p1", C2, false)]
    );
}

#[test]
fn h6_a_recovery_probe_clears_only_on_a_fresh_exact_available_answer() {
    // CONTRACT: H6
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C3, "n3");
    f.submit(1, "m-a", false);
    f.terminal(C1, 1, unavailable(10));
    assert!(f.control.is_overlaid(&key("n1", "p1")));
    assert_eq!(f.control.poll_timeout(), Some(f.at(40)));
    let a = |status, seq| vec![capability("ollama-a", "llama3", status, seq)];
    use pb::ProviderHealth::{Available, Unavailable};
    let unchanged = |f: &Fixture| f.control.counters().recovery_probe_unchanged;
    // Probe 1: stale answers (wrong conn, unknown id) change nothing and
    // are not counted; an unavailable answer changes nothing.
    assert_eq!(f.advance(40), vec![probe(C1, 1, "ollama-a")]);
    assert_eq!(
        f.command_result(C3, answer("recovery-1", true, a(Available, Some(11)))),
        vec![]
    );
    assert_eq!(
        f.command_result(C1, answer("recovery-77", true, a(Available, Some(11)))),
        vec![]
    );
    assert_eq!(unchanged(&f), 0);
    assert_eq!(
        f.command_result(C1, answer("recovery-1", true, a(Unavailable, Some(11)))),
        vec![]
    );
    assert_eq!(unchanged(&f), 1);
    // Probe 2: stale sequence (≤ 10).
    assert_eq!(f.advance(40), vec![probe(C1, 2, "ollama-a")]);
    assert_eq!(
        f.command_result(C1, answer("recovery-2", true, a(Available, Some(10)))),
        vec![]
    );
    // Probe 3: mismatched target.
    assert_eq!(f.advance(40), vec![probe(C1, 3, "ollama-a")]);
    let mismatched = vec![capability("ollama-a", "other", Available, Some(12))];
    assert_eq!(
        f.command_result(C1, answer("recovery-3", true, mismatched)),
        vec![]
    );
    // Probe 4: a failed command; probe 5: empty; probe 6: no sequence;
    // probe 7: malformed status.
    assert_eq!(f.advance(40), vec![probe(C1, 4, "ollama-a")]);
    assert_eq!(
        f.command_result(C1, answer("recovery-4", false, a(Available, Some(12)))),
        vec![]
    );
    assert_eq!(f.advance(40), vec![probe(C1, 5, "ollama-a")]);
    assert_eq!(
        f.command_result(C1, answer("recovery-5", true, vec![])),
        vec![]
    );
    assert_eq!(f.advance(40), vec![probe(C1, 6, "ollama-a")]);
    assert_eq!(
        f.command_result(C1, answer("recovery-6", true, a(Available, None))),
        vec![]
    );
    assert_eq!(f.advance(40), vec![probe(C1, 7, "ollama-a")]);
    let mut malformed = a(Available, Some(12));
    malformed[0].provider_status = 42;
    assert_eq!(
        f.command_result(C1, answer("recovery-7", true, malformed)),
        vec![]
    );
    assert_eq!(unchanged(&f), 7);
    assert!(f.control.is_overlaid(&key("n1", "p1")));
    // Probe 8: fresh, exact, available: cleared, and the waiter pumped.
    assert_eq!(f.advance(40), vec![probe(C1, 8, "ollama-a")]);
    // A long m-c request: its only long-capable candidate is n1/p1.
    assert_eq!(f.submit(2, "m-c", true), vec![]);
    assert_eq!(
        f.command_result(C1, answer("recovery-8", true, a(Available, Some(12)))),
        vec![
            transition("n1", "p1", false),
            f.dispatch(2, "n1", "p1", C1, true)
        ]
    );
    assert!(!f.control.is_overlaid(&key("n1", "p1")));
    assert_eq!(f.control.counters().recovery_probe_recovered, 1);
    assert_eq!(f.control.counters().health_transitions_available, 1);
    // Answered once: a repeat is stale; no probe is due any more.
    assert_eq!(
        f.command_result(C1, answer("recovery-8", true, a(Available, Some(13)))),
        vec![]
    );
    assert_eq!(f.control.poll_timeout(), None);
    assert_eq!(f.advance(400), vec![]);
}

#[test]
fn h6_an_ambiguous_or_previous_generation_answer_changes_nothing() {
    // CONTRACT: H6
    let mut f = Fixture::new();
    f.connect(C2, "n2");
    // n2/p1 and n2/p2 share adapter `vllm-b` and target `qwen`.
    assert_eq!(
        f.submit(1, "m-b", false),
        vec![f.dispatch(1, "n2", "p1", C2, false)]
    );
    f.terminal(C2, 1, unavailable(1));
    assert!(f.control.is_overlaid(&key("n2", "p1")));
    assert_eq!(f.advance(40), vec![probe(C2, 1, "vllm-b")]);
    let ambiguous = vec![capability(
        "vllm-b",
        "qwen",
        pb::ProviderHealth::Available,
        Some(2),
    )];
    assert_eq!(
        f.command_result(C2, answer("recovery-1", true, ambiguous)),
        vec![]
    );
    assert!(f.control.is_overlaid(&key("n2", "p1")));
    // A probe of the previous generation: its answer is stale on both the
    // old and the new connection.
    assert_eq!(f.advance(40), vec![probe(C2, 2, "vllm-b")]);
    f.close(C2);
    f.connect(C3, "n2");
    let exact = vec![capability(
        "vllm-b",
        "qwen",
        pb::ProviderHealth::Available,
        Some(3),
    )];
    let before = f.state();
    assert_eq!(
        f.command_result(C2, answer("recovery-2", true, exact.clone())),
        vec![]
    );
    assert_eq!(
        f.command_result(C3, answer("recovery-2", true, exact)),
        vec![]
    );
    assert_eq!(f.state(), before);
}

#[test]
fn p1_snapshots_carry_every_configured_resource() {
    // CONTRACT: P1
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    f.connect(C3, "n3");
    let disabled = pb::ProviderSnapshot {
        connected: true,
        status: pb::ProviderStatus::Disabled as i32,
        health: pb::ProviderHealth::Available as i32,
        ..f.identity("n3", "p2")
    };
    assert_eq!(
        f.control.snapshots(),
        vec![
            f.live("n1", "p1", [0, 0], [0, 0]),
            f.live("n1", "p2", [0, 0], [0, 0]),
            f.live("n1", "p3", [0, 0], [0, 0]),
            f.live("n2", "p1", [0, 0], [0, 0]),
            f.live("n2", "p2", [0, 0], [0, 0]),
            f.live("n2", "p3", [0, 0], [0, 0]),
            f.live("n3", "p1", [0, 0], [0, 0]),
            disabled,
        ]
    );
    assert_eq!(
        f.snapshot("n3", "p1").category,
        pb::ProviderCategory::Api as i32
    );
    assert_eq!(f.snapshot("n1", "p1").capacity, 2);
    assert_eq!(f.snapshot("n1", "p1").long_context_capacity, 1);
    // The disabled provider is never dispatched to.
    for id in 1..=3 {
        f.submit(id, "m-c", false);
    }
    assert!(f.control.leases().all(|l| l.provider != key("n3", "p2")));
}

#[test]
fn p2_in_flight_is_lease_occupancy_and_queued_counts_unique_waiters_per_candidate() {
    // CONTRACT: P2
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-a", true),
        vec![f.dispatch(2, "n2", "p1", C2, true)]
    );
    assert_eq!(
        f.submit(3, "m-a", true),
        vec![f.dispatch(3, "n1", "p1", C1, true)]
    );
    assert_eq!(
        f.submit(4, "m-b", false),
        vec![f.dispatch(4, "n1", "p2", C1, false)]
    );
    assert_eq!(
        f.submit(5, "m-b", false),
        vec![f.dispatch(5, "n2", "p3", C2, false)]
    );
    assert_eq!(
        f.submit(6, "m-c", false),
        vec![f.dispatch(6, "n2", "p2", C2, false)]
    );
    // Waiters: m-a long and short, m-b long (one request counts in
    // several providers).
    assert_eq!(f.submit(7, "m-a", true), vec![]);
    assert_eq!(f.submit(8, "m-a", false), vec![]);
    assert_eq!(f.submit(9, "m-b", true), vec![]);
    assert_eq!(
        f.submit(10, "m-a", false),
        vec![done(10, Outcome::Rejected(Rejection::QueueFull))]
    );
    assert_eq!(f.snapshot("n1", "p1"), f.live("n1", "p1", [2, 1], [2, 1]));
    assert_eq!(f.snapshot("n2", "p1"), f.live("n2", "p1", [1, 1], [3, 2]));
    assert_eq!(f.snapshot("n1", "p2"), f.live("n1", "p2", [1, 0], [1, 1]));
    assert_eq!(f.snapshot("n2", "p3"), f.live("n2", "p3", [1, 0], [1, 1]));
    assert_eq!(f.snapshot("n2", "p2"), f.live("n2", "p2", [1, 0], [0, 0]));
    // n3 is offline: not a live candidate, not counted.
    assert_eq!(f.snapshot("n3", "p1"), f.offline("n3", "p1"));
}

#[test]
fn p3_offline_and_pending_nodes_project_zero_and_return_with_configured_capacity() {
    // CONTRACT: P3
    let mut f = Fixture::new();
    let all_offline = |f: &Fixture| {
        f.world
            .provs
            .iter()
            .map(|p| f.offline(&p.key.node_id, &p.key.provider_id))
            .collect::<Vec<_>>()
    };
    assert_eq!(f.control.snapshots(), all_offline(&f));
    f.register(C1, "n1");
    assert_eq!(f.submit(1, "m-a", false), vec![]);
    assert_eq!(f.control.snapshots(), all_offline(&f));
    f.ready(C1, "n1");
    assert_eq!(f.snapshot("n1", "p1"), f.live("n1", "p1", [1, 0], [0, 0]));
    f.close(C1);
    assert_eq!(f.control.snapshots(), all_offline(&f));
    f.connect(C2, "n1");
    assert_eq!(f.snapshot("n1", "p1"), f.live("n1", "p1", [0, 0], [0, 0]));
    assert_eq!(f.snapshot("n1", "p2"), f.live("n1", "p2", [0, 0], [0, 0]));
}

#[test]
fn u7_the_provider_kind_alone_picks_tunnel_or_run() {
    // CONTRACT: U7
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    // m-b mixes OpenAI-compatible (tunnel) and Ollama (run) providers; both
    // kinds are candidates.
    let kinds: Vec<(String, DispatchKind)> = [(1, "m-b"), (2, "m-b"), (3, "m-b"), (4, "m-a")]
        .into_iter()
        .flat_map(|(id, model)| f.submit(id, model, false))
        .filter_map(|a| match a {
            Action::Dispatch(d) => Some((d.lease.provider.to_string(), d.kind)),
            _ => None,
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("n1/p2".to_string(), DispatchKind::Tunnel),
            ("n2/p1".to_string(), DispatchKind::Tunnel),
            ("n2/p3".to_string(), DispatchKind::Normalized),
            ("n1/p1".to_string(), DispatchKind::Normalized),
        ]
    );
}

#[test]
fn w2_dispatch_carries_the_winning_providers_stall_timeout() {
    // CONTRACT: W2
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    let stall_ms = |actions: Vec<Action>| -> Vec<(String, i64)> {
        actions
            .into_iter()
            .filter_map(|a| match a {
                Action::Dispatch(d) => {
                    Some((d.lease.provider.to_string(), d.response_stall_timeout_ms))
                }
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        stall_ms(f.submit(1, "m-b", false)),
        vec![("n1/p2".to_string(), 12_000)]
    );
    assert_eq!(
        stall_ms(f.submit(2, "m-b", false)),
        vec![("n2/p1".to_string(), 21_000)]
    );
    assert_eq!(
        stall_ms(f.submit(3, "m-b", false)),
        vec![("n2/p3".to_string(), 23_000)]
    );
    assert_eq!(f.submit(4, "m-b", false), vec![]);
    // Re-resolved after waiting: the provider that freed up wins, with its
    // own value.
    assert_eq!(
        stall_ms(f.terminal(C2, 3, None)),
        vec![("n2/p3".to_string(), 23_000)]
    );
}

#[test]
fn x6_an_accepted_but_not_ready_node_is_no_candidate_snapshot_or_recipient() {
    // CONTRACT: X6
    let mut f = Fixture::new();
    f.connect(C2, "n2");
    // n1 accepted but not ready: no event, no candidate.
    assert_eq!(f.register(C1, "n1"), vec![f.accepted(C1, "n1")]);
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n2", "p1", C2, false)]
    );
    // m-a's only free provider would be n1/p1: the request waits.
    assert_eq!(f.submit(2, "m-a", false), vec![]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    assert_eq!(f.snapshot("n2", "p1"), f.live("n2", "p1", [1, 0], [1, 0]));
    assert_eq!(f.control.ready_nodes(), vec![("n2".to_string(), C2)]);
    assert_eq!(f.control.ready_conn("n1"), None);
    assert!(!f.control.is_ready_owner(C1));
    // It times out rather than ever reaching the pending connection.
    assert_eq!(
        f.advance(100),
        vec![done(2, Outcome::Rejected(Rejection::QueueTimeout))]
    );
}

// ---------------------------------------------------------------------------
// Regressions: connections ordered closed, probe freshness, probe retirement
// ---------------------------------------------------------------------------

const CLOSING_REASON: &str = "connection is closing; reconnect to register";

#[test]
fn r3_a_pending_owner_ordered_closed_is_released_and_never_made_ready() {
    // CONTRACT: R3, R4
    let mut f = Fixture::new();
    assert_eq!(f.submit(1, "m-a", false), vec![]);
    assert_eq!(f.register(C1, "n1"), vec![f.accepted(C1, "n1")]);
    // The pending owner names another node id: ready false, closed, and
    // released in the same step (no fence: it was never ready).
    assert_eq!(f.ready(C1, "n2"), ready_false(C1, NOT_REGISTERED));
    assert_eq!(f.control.node_of(C1), None);
    assert_eq!(f.control.generation_of(C1), None);
    // A ready queued behind it arrives before the shell reports the close:
    // refused, and the waiter is not dispatched to it.
    let before = f.state();
    assert_eq!(f.ready(C1, "n1"), ready_false(C1, NOT_REGISTERED));
    assert!(!f.control.is_ready_owner(C1));
    assert_eq!(f.control.ready_conn("n1"), None);
    assert_eq!(f.state(), before);
    assert_eq!(f.pending(), vec![rid(1)]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    // The shell's close changes nothing more; a new connection registers.
    assert_eq!(f.close(C1), vec![]);
    assert_eq!(f.state(), before);
    assert_eq!(f.register(C2, "n1"), vec![f.accepted(C2, "n1")]);
    assert_eq!(
        f.ready(C2, "n1"),
        vec![
            ready_true(C2),
            connected("n1"),
            f.dispatch(1, "n1", "p1", C2, false)
        ]
    );
}

#[test]
fn r3_a_ready_owner_ordered_closed_is_fenced_in_the_same_step() {
    // CONTRACT: R3, R4, F1
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-a", false),
        vec![f.dispatch(2, "n2", "p1", C2, false)]
    );
    assert_eq!(
        f.submit(3, "m-a", false),
        vec![f.dispatch(3, "n1", "p1", C1, false)]
    );
    assert_eq!(f.submit(4, "m-a", false), vec![]);
    // The ready owner of n1 names another node id: refused, closed, and
    // fenced exactly as by `Closed` (its leases lost once, n1 offline, the
    // queue re-evaluated: n2/p1 is still full).
    let mut want = ready_false(C1, NOT_REGISTERED);
    want.extend([
        done(1, Outcome::Lost),
        done(3, Outcome::Lost),
        disconnected("n1"),
    ]);
    assert_eq!(f.ready(C1, UNKNOWN_NODE), want);
    assert_eq!(f.control.node_of(C1), None);
    assert!(!f.control.is_ready_owner(C1));
    assert_eq!(f.control.ready_nodes(), vec![("n2".to_string(), C2)]);
    assert_eq!(f.lease_ids(), vec!["run-2".to_string()]);
    assert_eq!(f.pending(), vec![rid(2), rid(4)]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    // Nothing more reaches it: a new request waits for n2 rather than
    // going to C1; its late frames and the shell's close change nothing.
    let before = f.state();
    assert_eq!(f.ready(C1, "n1"), ready_false(C1, NOT_REGISTERED));
    assert_eq!(f.terminal(C1, 1, unavailable(3)), vec![]);
    assert_eq!(f.close(C1), vec![]);
    assert_eq!(f.state(), before);
    assert_eq!(
        f.terminal(C2, 2, None),
        vec![
            done(2, Outcome::Completed),
            f.dispatch(4, "n2", "p1", C2, false)
        ]
    );
}

#[test]
fn r3_a_connection_ordered_closed_cannot_register_again() {
    // CONTRACT: R1, R3, T3
    let mut f = Fixture::new();
    // Rejected at registration (unknown node id), then a late register
    // with the right id on the same connection: refused, not closed twice.
    let out = f.handle(Input::Register {
        conn: C1,
        tls_name: "n1".to_string(),
        node_id: UNKNOWN_NODE.to_string(),
    });
    assert_eq!(out.len(), 2);
    assert_eq!(
        f.register(C1, "n1"),
        vec![register_rejected(C1, CLOSING_REASON)]
    );
    assert_eq!(f.control.node_of(C1), None);
    assert_eq!(f.control.generation_of(C1), None);
    // Let go of after a bad ready: its binding is gone, but a late
    // register (here a dev-mode connection, whose claimed id stands in for
    // the TLS name) neither owns again nor supersedes the ready owner of
    // another node.
    f.connect(C2, "n2");
    assert_eq!(f.register(C3, "n1"), vec![f.accepted(C3, "n1")]);
    assert_eq!(f.ready(C3, "n3"), ready_false(C3, NOT_REGISTERED));
    let before = f.state();
    assert_eq!(
        f.register(C3, "n1"),
        vec![register_rejected(C3, CLOSING_REASON)]
    );
    assert_eq!(
        f.register(C3, "n2"),
        vec![register_rejected(C3, CLOSING_REASON)]
    );
    assert_eq!(f.ready(C3, "n1"), ready_false(C3, NOT_REGISTERED));
    assert_eq!(f.state(), before);
    assert_eq!(f.control.generation_of(C3), None);
    assert_eq!(f.control.ready_nodes(), vec![("n2".to_string(), C2)]);
    // Once the shell reports the close, the id is never reused; a new
    // connection registers normally.
    assert_eq!(f.close(C3), vec![]);
    assert_eq!(f.close(C1), vec![]);
    assert_eq!(
        f.register(ConnId(4), "n1"),
        vec![f.accepted(ConnId(4), "n1")]
    );
}

#[test]
fn h4_an_older_unavailable_stall_does_not_overlay_after_a_newer_available_answer() {
    // CONTRACT: H4, H6
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-c", false),
        vec![f.dispatch(2, "n1", "p3", C1, false)]
    );
    f.terminal(C1, 1, unavailable(10));
    assert_eq!(f.advance(40), vec![probe(C1, 1, "ollama-a")]);
    // The probe of adapter `ollama-a` reports both its targets: llama3
    // (n1/p1) still unavailable, phi3 (n1/p3, not overlaid) available at
    // sequence 20. Nothing clears; the answer is counted unchanged.
    let both = vec![
        capability(
            "ollama-a",
            "llama3",
            pb::ProviderHealth::Unavailable,
            Some(11),
        ),
        capability("ollama-a", "phi3", pb::ProviderHealth::Available, Some(20)),
    ];
    assert_eq!(
        f.command_result(C1, answer("recovery-1", true, both)),
        vec![]
    );
    assert_eq!(f.control.counters().recovery_probe_unchanged, 1);
    // A stall of run-2 whose probe observed n1/p3 earlier (sequence 15)
    // arrives late: a request-local handoff, but not fresh, so it does not
    // overlay n1/p3.
    let out = f.terminal(C1, 2, unavailable(15));
    assert_eq!(
        out,
        vec![
            Action::StallHandoff {
                request: rid(2),
                handoff: Handoff {
                    provider_id: "p3".to_string(),
                    provider_health: pb::ProviderHealth::Unavailable,
                    recovery_handoff: "confirmed",
                },
            },
            done(2, Outcome::Completed),
        ]
    );
    assert!(!f.control.is_overlaid(&key("n1", "p3")));
    assert_eq!(f.control.counters().health_transitions_unavailable, 1);
    // A newer unavailable one still does.
    assert_eq!(
        f.submit(3, "m-c", false),
        vec![f.dispatch(3, "n1", "p3", C1, false)]
    );
    let out = f.terminal(C1, 3, unavailable(21));
    assert_eq!(out[1], transition("n1", "p3", true));
    assert!(f.control.is_overlaid(&key("n1", "p3")));
}

#[test]
fn h6_a_new_recovery_probe_retires_the_older_one_of_the_same_provider() {
    // CONTRACT: H6
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    // n1/p1 and n1/p3 are two targets of adapter `ollama-a`; overlay both,
    // 20 ms apart.
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-c", false),
        vec![f.dispatch(2, "n1", "p3", C1, false)]
    );
    f.terminal(C1, 1, unavailable(10));
    assert_eq!(f.advance(20), vec![]);
    f.terminal(C1, 2, unavailable(11));
    assert!(f.control.is_overlaid(&key("n1", "p1")));
    assert!(f.control.is_overlaid(&key("n1", "p3")));
    // Unanswered probes: n1/p1 at 40 and 80 ms, n1/p3 at 60 ms.
    assert_eq!(f.advance(20), vec![probe(C1, 1, "ollama-a")]);
    assert_eq!(f.advance(20), vec![probe(C1, 2, "ollama-a")]);
    assert_eq!(f.advance(20), vec![probe(C1, 3, "ollama-a")]);
    // recovery-1 (n1/p1) was retired by recovery-3: its late answer is an
    // unknown command id, ignored before any counting, even though it
    // would clear n1/p1.
    let llama3 = |seq| {
        vec![capability(
            "ollama-a",
            "llama3",
            pb::ProviderHealth::Available,
            Some(seq),
        )]
    };
    let before = f.state();
    assert_eq!(
        f.command_result(C1, answer("recovery-1", true, llama3(12))),
        vec![]
    );
    assert_eq!(f.state(), before);
    assert_eq!(f.control.counters(), &before.counters);
    assert!(f.control.is_overlaid(&key("n1", "p1")));
    // Another provider's probe is not retired by it: recovery-2 (n1/p3)
    // still counts, and clears n1/p3.
    let phi3 = vec![capability(
        "ollama-a",
        "phi3",
        pb::ProviderHealth::Available,
        Some(13),
    )];
    assert_eq!(
        f.command_result(C1, answer("recovery-2", true, phi3)),
        vec![transition("n1", "p3", false)]
    );
    // The newest probe of n1/p1 clears it.
    assert_eq!(
        f.command_result(C1, answer("recovery-3", true, llama3(14))),
        vec![transition("n1", "p1", false)]
    );
    assert_eq!(
        f.control.counters(),
        &Counters {
            health_evidence_accepted: 2,
            recovery_eligible: 2,
            health_transitions_unavailable: 2,
            health_transitions_available: 2,
            recovery_probe_recovered: 2,
            ..Counters::default()
        }
    );
    assert_eq!(f.control.poll_timeout(), None);
}

// ---------------------------------------------------------------------------
// Heartbeat timeouts (T4) racing terminals, readies and dispatches
// ---------------------------------------------------------------------------

#[test]
fn f1_a_heartbeat_timeout_ends_decoded_terminals_completed_and_lost_ones_lost() {
    // CONTRACT: F1, T4
    let mut f = Fixture::new();
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n1", "p1", C1, false)]
    );
    assert_eq!(
        f.submit(2, "m-a", false),
        vec![f.dispatch(2, "n2", "p1", C2, false)]
    );
    assert_eq!(
        f.submit(3, "m-a", false),
        vec![f.dispatch(3, "n1", "p1", C1, false)]
    );
    assert_eq!(f.submit(4, "m-a", false), vec![]);
    assert_eq!(f.submit(5, "m-a", false), vec![]);
    // C1's heartbeat times out: the engine shuts its socket. The terminal
    // of run-1 was already decoded and is delivered: completed, and its
    // slot goes to the head of the queue, on C1 (Control cannot know yet).
    assert_eq!(
        f.terminal(C1, 1, None),
        vec![
            done(1, Outcome::Completed),
            f.dispatch(4, "n1", "p1", C1, false)
        ]
    );
    // That run never leaves; its report comes before the `Closed`: the
    // request is settled and the slot goes to the next waiter, on C1 again.
    assert_eq!(
        f.handle(Input::Undeliverable { request: rid(4) }),
        vec![
            done(4, Outcome::Cancelled),
            f.dispatch(5, "n1", "p1", C1, false)
        ]
    );
    // The terminal of run-3 was still in the socket: lost. The `Closed`
    // fences the generation in one step: run-3 and run-5 lost once each.
    assert_eq!(
        f.close(C1),
        vec![
            done(3, Outcome::Lost),
            done(5, Outcome::Lost),
            disconnected("n1")
        ]
    );
    assert_eq!(f.lease_ids(), vec!["run-2".to_string()]);
    assert_eq!(f.pending(), vec![rid(2)]);
    assert_eq!(f.snapshot("n1", "p1"), f.offline("n1", "p1"));
    // Run-5's report after the fence is stale: nothing changes.
    let before = f.state();
    assert_eq!(f.handle(Input::Undeliverable { request: rid(5) }), vec![]);
    assert_eq!(f.state(), before);
    assert_eq!(f.control.counters(), &Counters::default());
}

#[test]
fn f1_a_ready_decoded_before_a_heartbeat_timeout_is_fenced_by_its_close() {
    // CONTRACT: F1, T4, R3
    let mut f = Fixture::new();
    f.connect(C2, "n2");
    assert_eq!(
        f.submit(1, "m-a", false),
        vec![f.dispatch(1, "n2", "p1", C2, false)]
    );
    assert_eq!(f.submit(2, "m-a", false), vec![]);
    // A pending owner of n3 times out with its ready still in the socket:
    // it never was ready; its close fences nothing and the waiter stays.
    assert_eq!(f.register(C3, "n3"), vec![f.accepted(C3, "n3")]);
    assert_eq!(f.close(C3), vec![]);
    assert_eq!(f.pending(), vec![rid(1), rid(2)]);
    assert_eq!(f.snapshot("n3", "p1"), f.offline("n3", "p1"));
    // The next one times out with its ready decoded: ready for an instant,
    // the waiter dispatched to it, then fenced by its close (F1).
    let c4 = ConnId(4);
    assert_eq!(f.register(c4, "n3"), vec![f.accepted(c4, "n3")]);
    assert_eq!(
        f.ready(c4, "n3"),
        vec![
            ready_true(c4),
            connected("n3"),
            f.dispatch(2, "n3", "p1", c4, false)
        ]
    );
    assert_eq!(
        f.close(c4),
        vec![done(2, Outcome::Lost), disconnected("n3")]
    );
    assert_eq!(f.lease_ids(), vec!["run-1".to_string()]);
    assert_eq!(f.control.ready_conn("n3"), None);
    // The run's undeliverable report after the fence is stale.
    let before = f.state();
    assert_eq!(f.handle(Input::Undeliverable { request: rid(2) }), vec![]);
    assert_eq!(f.state(), before);
}
