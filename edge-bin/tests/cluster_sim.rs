//! Deterministic simulation of several Edges sharing one fleet through etcd:
//! two or three [`Control::clustered`] state machines, the Nodes that dial
//! them, and a model of etcd, driven by seeded random schedules.
//!
//! # The model
//!
//! - **etcd**: one store revision; an owner key per node id with its
//!   `mod_revision`, the Edge and connection that wrote it and the etcd
//!   lease it is attached to; one lease per Edge with a server-side expiry.
//!   A claim ([`Action::ClaimOwnership`]) is a put on the Edge's lease and
//!   commits at a random later step, in any order with every other Edge's
//!   claims and releases; a put on a lease that expired fails. A release
//!   ([`Action::ReleaseOwnership`]) is a delete if the key's `mod_revision`
//!   still equals the release's revision. An expired lease deletes every key
//!   still attached to it, in one revision. Every write is appended to one
//!   event log; each Edge's watch delivers it in revision order, at random
//!   steps, so watch events and claim answers interleave arbitrarily; a
//!   watch resumed after a partition delivers the events of the last
//!   revision it had delivered once more.
//! - **Edge sessions**: a keep-alive every [`KEEPALIVE_MS`]; it renews the
//!   lease on the server and is acknowledged unless the Edge is partitioned
//!   (then it is lost, or it reaches the server and only its answer is
//!   lost). An Edge fences itself (`ClusterSession{up: false}`) at its local
//!   deadline, the last acknowledged keep-alive's send time + [`TTL_MS`] −
//!   [`KEEPALIVE_MS`], always before the server can expire the lease; it
//!   abandons that lease and, once it reaches etcd again, takes a new one
//!   (`ClusterSession{up: true}`). Partitions are short (no fence), medium
//!   (fence, the lease survives on the server) or long (the lease expires
//!   and deletes its keys). While partitioned an Edge's watch delivers
//!   nothing, its claims fail (some after committing), its releases may be
//!   lost, and a grant answered in that time reaches it as a failure.
//! - **Nodes**: each node id has at most one live connection, to one Edge,
//!   and redials a random Edge after it closes (closed by the Edge, or
//!   dropped by the network). Frames on a connection arrive in order at
//!   random steps (register, ready, terminals), and a `Closed` follows the
//!   frames sent before the drop; when the Edge closes a connection it
//!   reads nothing more. A run dispatched to a connection its node has left
//!   is reported `Undeliverable` by the shell.
//! - **Requests**: submitted at random Edges for the model of one node (no
//!   forwarding between Edges yet: a request waits in its Edge's queue for
//!   that node to be ready there, or times out), completed by the node,
//!   cancelled by their clients.
//! - **Operators**: at random points an Edge reloads its configuration
//!   (drops a node with its model, takes it back, changes its provider's
//!   capacity) or drains or undrains a node. A dropped node's claim in
//!   flight is refused; its owner there is closed (`node_removed`, its key
//!   released) once nothing runs there or at the end of its grace, and its
//!   node dials again; requests for its model end. Before settling, every
//!   Edge is taken back to the full configuration, undrained.
//!
//! # What is checked
//!
//! After every step (besides `Control`'s own debug checks):
//! 1. an owner's generation is the revision of the put this Edge made for
//!    that very connection, on the Edge's current lease, and is at most the
//!    key's latest revision; at most one Edge has a ready owner at the key's
//!    current `mod_revision`;
//! 2. F1 across Edges: an Edge's owner of a node holds exactly the highest
//!    revision of its key the Edge has learned (from a grant or its watch):
//!    every newer revision fenced the older generation; every lease an Edge
//!    holds is on the ready owner under its generation; the generations an
//!    Edge accepts for a node strictly increase, and so do the generations
//!    a node sees accepted on its successive connections, whichever Edges
//!    they were to;
//! 3. an Edge that owns anything holds a live lease on the server (it fenced
//!    itself before the lease could expire);
//! 4. every request ends exactly once (`Done`);
//! 5. at quiescence (partitions healed, every claim committed and answered,
//!    every event delivered, every connection settled): every node's live
//!    connection wrote the last claim of its key, is the ready owner at its
//!    Edge under the key's revision, every other Edge owns nothing for it,
//!    every Edge has seen every revision; no request is pending, no lease
//!    is held, every provider's `in_flight` is 0;
//! 6. a release names a revision this Edge itself claimed for that node and
//!    no longer owns, so its compare can only ever delete this Edge's own
//!    write, never a newer claim's;
//! 7. an Edge dispatches nothing to a node its configuration dropped or an
//!    operator drained there.
//!
//! The literal "every accepted generation exceeds every earlier one,
//! cluster-wide" does not hold and is not asserted: a claim from a
//! connection its node already left may commit late and be accepted by its
//! Edge (which has not yet seen the close) at a revision below one another
//! Edge accepted meanwhile, or above the live connection's. Such a dead
//! connection never becomes ready, but its put supersedes the node's live
//! connection if that one claimed earlier (on any Edge, its own included:
//! the put was in flight when its connection closed), which is then fenced
//! and redials. The simulation counts both (`stale_accepts`,
//! `live_superseded_by_stale_claim`).
//!
//! The hand-written schedules at the end pin the interleavings this is
//! for: the watch before the grant, a grant after the self-fence, a
//! release racing a newer claim, a lease expiring after its Edge fenced
//! itself, a watch resumed after a partition.
//!
//! A failure prints its seed and step; `IOP_SIM_SEED=<seed>` replays that
//! schedule with a step log. Schedules derive from a base seed, fixed by
//! default and overridable with `IOP_SIM_BASE_SEED`.

use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use edge_bin::control::{
    Action, AttemptEnd, CancelReason, ConnId, Control, ControlModel, ControlNode, ControlProvider,
    ControlSpec, DispatchKind, DrainTarget, Event, Input, Operation, Operations, Outcome,
    ProviderKey, Rejection, RequestId, Terminal, Tunables,
};
use edge_bin::control::{RouteHint, RoutingSpec};
use iop_wire::{pb, CloseReason};

mod sim_rng;
use sim_rng::Rng;

// ---------------------------------------------------------------------------
// The configured world
// ---------------------------------------------------------------------------

/// Node ids every Edge expects (one provider each, one model each).
const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// The etcd lease's TTL.
const TTL_MS: u64 = 10_000;
/// How often an Edge sends a keep-alive; also its self-fencing margin.
const KEEPALIVE_MS: u64 = 3_000;
/// Queue timeout of every model.
const QUEUE_TIMEOUT_MS: u64 = 4_000;
/// Cancel settlement.
const CANCEL_SETTLE_MS: u64 = 2_000;
/// Slots of every provider.
const CAPACITY: u32 = 2;
/// Queue bound of every model.
const MAX_QUEUE: u32 = 3;
/// How long a node a reload removed may go on running what it has.
const RETIRE_GRACE_MS: u64 = 5_000;

fn model_of(n: usize) -> String {
    format!("m-{}", NODES[n])
}

fn node_index(node_id: &str) -> usize {
    NODES
        .iter()
        .position(|n| *n == node_id)
        .unwrap_or_else(|| panic!("unknown node id {node_id}"))
}

/// What one Edge is configured with: which nodes (each with its model),
/// their providers' capacities. Reloads change it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EdgeConfig {
    nodes: [bool; 3],
    capacity: [u32; 3],
}

impl EdgeConfig {
    /// Every node, every provider at [`CAPACITY`].
    const FULL: EdgeConfig = EdgeConfig {
        nodes: [true; 3],
        capacity: [CAPACITY; 3],
    };
}

fn spec() -> ControlSpec {
    spec_of(EdgeConfig::FULL)
}

/// The spec of `cfg`: each configured node with its provider and model.
fn spec_of(cfg: EdgeConfig) -> ControlSpec {
    let on: Vec<usize> = (0..NODES.len()).filter(|&n| cfg.nodes[n]).collect();
    ControlSpec {
        nodes: on
            .iter()
            .map(|&n| ControlNode {
                id: NODES[n].into(),
                config: pb::NodeConfigPayload::default(),
                providers: vec![ControlProvider {
                    id: "p".into(),
                    adapter: "vllm".into(),
                    target: "target".into(),
                    capacity: cfg.capacity[n],
                    long_context_capacity: 0,
                    response_stall_timeout_ms: 0,
                    category: pb::ProviderCategory::LocalInference,
                    kind: DispatchKind::Tunnel,
                    operations: Operations::for_kind(DispatchKind::Tunnel),
                    enabled: true,
                }],
            })
            .collect(),
        models: on
            .iter()
            .map(|&n| ControlModel {
                name: model_of(n),
                providers: vec![ProviderKey {
                    node_id: NODES[n].into(),
                    provider_id: "p".into(),
                }],
                max_queue: MAX_QUEUE,
                queue_timeout: Duration::from_millis(QUEUE_TIMEOUT_MS),
                max_attempts: 1,
                routing: RoutingSpec::default(),
            })
            .collect(),
        tunables: Tunables {
            cancel_settle: Duration::from_millis(CANCEL_SETTLE_MS),
            retire_grace: Duration::from_millis(RETIRE_GRACE_MS),
            ..Tunables::default()
        },
    }
}

// ---------------------------------------------------------------------------
// etcd
// ---------------------------------------------------------------------------

/// A node's owner key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    mod_revision: u64,
    edge: usize,
    conn: ConnId,
    lease: u64,
}

/// Who wrote the put of one revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Put {
    node: usize,
    edge: usize,
    conn: ConnId,
    lease: u64,
}

/// One watch event.
#[derive(Debug, Clone, Copy)]
struct WatchEvent {
    revision: u64,
    node: usize,
    deleted: bool,
}

#[derive(Debug)]
struct Lease {
    edge: usize,
    expiry_ms: u64,
    expired: bool,
}

/// A request an Edge sent to etcd, not committed yet.
#[derive(Debug, Clone, Copy)]
enum Op {
    Claim {
        edge: usize,
        conn: ConnId,
        node: usize,
        /// The lease the Edge held when it sent the put.
        lease: Option<u64>,
    },
    Release {
        edge: usize,
        node: usize,
        revision: u64,
    },
}

#[derive(Debug, Default)]
struct Etcd {
    revision: u64,
    keys: [Option<Key>; 3],
    /// Per node: the revision of the key's latest put or delete.
    last_revision: [u64; 3],
    puts: BTreeMap<u64, Put>,
    log: Vec<WatchEvent>,
    leases: BTreeMap<u64, Lease>,
    next_lease: u64,
    ops: Vec<Op>,
}

impl Etcd {
    fn lease_alive(&self, lease: u64) -> bool {
        self.leases.get(&lease).is_some_and(|l| !l.expired)
    }

    fn grant_lease(&mut self, edge: usize, now_ms: u64) -> u64 {
        self.next_lease += 1;
        self.leases.insert(
            self.next_lease,
            Lease {
                edge,
                expiry_ms: now_ms + TTL_MS,
                expired: false,
            },
        );
        self.next_lease
    }

    fn put(&mut self, node: usize, edge: usize, conn: ConnId, lease: u64) -> u64 {
        self.revision += 1;
        let revision = self.revision;
        self.keys[node] = Some(Key {
            mod_revision: revision,
            edge,
            conn,
            lease,
        });
        self.last_revision[node] = revision;
        self.puts.insert(
            revision,
            Put {
                node,
                edge,
                conn,
                lease,
            },
        );
        self.log.push(WatchEvent {
            revision,
            node,
            deleted: false,
        });
        revision
    }
}

// ---------------------------------------------------------------------------
// Edges, nodes, connections, requests
// ---------------------------------------------------------------------------

/// A claim's answer on its way back to its Edge.
#[derive(Debug, Clone, Copy)]
enum Reply {
    Granted {
        conn: ConnId,
        node: usize,
        revision: u64,
        /// The lease the claim was made on.
        lease: u64,
    },
    Failed {
        conn: ConnId,
    },
}

struct EdgeSim {
    control: Control,
    /// The lease `Control`'s `up` rests on (`None`: fenced, or never held).
    lease: Option<u64>,
    /// What `Control` was last told.
    up: bool,
    last_acked_send_ms: u64,
    next_keepalive_ms: u64,
    partitioned_until_ms: Option<u64>,
    watch_cursor: usize,
    replies: Vec<Reply>,
    undeliverable: Vec<RequestId>,
    /// Per node: the highest revision this Edge learned (grant or watch).
    learned: [u64; 3],
    /// Per node: the highest generation this Edge accepted.
    accepted: [u64; 3],
    /// What this Edge is configured with now (its reloads).
    config: EdgeConfig,
    /// Per node: drained here by an operator, as far as the sim can be
    /// sure (not after the node left the configuration: Control keeps the
    /// drain of a node kept while owned and added back, not of one gone
    /// meanwhile).
    drained: [bool; 3],
}

impl EdgeSim {
    fn partitioned(&self) -> bool {
        self.partitioned_until_ms.is_some()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodePhase {
    /// No live connection.
    Offline,
    /// Register sent.
    Dialed,
    /// Accepted, ready sent.
    Registered,
    /// Ready acknowledged.
    Ready,
}

#[derive(Debug, Clone)]
struct Run {
    run_id: String,
    conn: ConnId,
}

struct NodeSim {
    live: Option<ConnId>,
    phase: NodePhase,
    runs: Vec<Run>,
    /// The highest generation this node saw accepted, over all its
    /// connections (the sim reads it from the accepting Edge).
    accepted: u64,
}

struct ConnSim {
    edge: usize,
    node: usize,
    /// Frames on their way to the Edge, in order; a `Closed` last.
    frames: VecDeque<Input>,
    /// The node still uses it.
    node_open: bool,
}

struct RequestSim {
    edge: usize,
    done: u32,
}

/// What one run reached; summed over schedules and asserted non-zero.
#[derive(Debug, Default, Clone)]
struct Stats {
    schedules: u64,
    steps: u64,
    claims: u64,
    grants_accepted: u64,
    grants_refused_superseded: u64,
    grants_after_self_fence: u64,
    grants_lost: u64,
    claims_failed: u64,
    watch_before_grant: u64,
    watch_redelivered: u64,
    stale_accepts: u64,
    live_superseded_by_stale_claim: u64,
    self_fences: u64,
    new_leases: u64,
    expiries_deleting_keys: u64,
    keys_deleted_by_expiry: u64,
    releases_deleted: u64,
    releases_behind_newer_claim: u64,
    releases_lost: u64,
    fenced_by_watch: u64,
    closed_superseded: u64,
    closed_ownership_lost: u64,
    first_readies: u64,
    dispatches: u64,
    completed: u64,
    lost: u64,
    cancelled: u64,
    queue_timeouts: u64,
    queue_full: u64,
    undeliverable: u64,
    quiesce_steps: u64,
    /// Reloads and operator drains fed at random points (not counting
    /// the ones that restore every Edge before it settles).
    reloads: u64,
    drains: u64,
    /// Owners closed because a reload removed their node (after their
    /// last run, or at the end of their grace).
    closed_node_removed: u64,
    /// Registrations refused: of a node the Edge does not serve, or whose
    /// claim was in flight when a reload removed it.
    closed_registration_rejected: u64,
    /// Requests for a model a reload removed: refused, or ended waiting.
    unknown_model: u64,
    model_removed: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        macro_rules! sum {
            ($($f:ident),*) => { $(self.$f += o.$f;)* };
        }
        sum!(
            schedules,
            steps,
            claims,
            grants_accepted,
            grants_refused_superseded,
            grants_after_self_fence,
            grants_lost,
            claims_failed,
            watch_before_grant,
            watch_redelivered,
            stale_accepts,
            live_superseded_by_stale_claim,
            self_fences,
            new_leases,
            expiries_deleting_keys,
            keys_deleted_by_expiry,
            releases_deleted,
            releases_behind_newer_claim,
            releases_lost,
            fenced_by_watch,
            closed_superseded,
            closed_ownership_lost,
            first_readies,
            dispatches,
            completed,
            lost,
            cancelled,
            queue_timeouts,
            queue_full,
            undeliverable,
            quiesce_steps,
            reloads,
            drains,
            closed_node_removed,
            closed_registration_rejected,
            unknown_model,
            model_removed
        );
    }
}

/// A timed event, in the order of their kinds when due at the same instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timed {
    /// An Edge's local self-fencing deadline.
    LocalDeadline(usize),
    /// A lease's server-side expiry.
    Expiry(u64),
    /// A `Control` timer.
    ControlTimer(usize),
    /// An Edge's keep-alive (or new lease request).
    Keepalive(usize),
    /// A partition's end.
    Heal(usize),
}

/// The whole cluster.
struct Sim {
    rng: Rng,
    base: Instant,
    now_ms: u64,
    step: u64,
    verbose: bool,
    edges: Vec<EdgeSim>,
    etcd: Etcd,
    nodes: Vec<NodeSim>,
    conns: BTreeMap<ConnId, ConnSim>,
    next_conn: u64,
    requests: BTreeMap<RequestId, RequestSim>,
    next_request: u64,
    /// Every close an Edge ordered: (edge, conn, reason).
    closes: Vec<(usize, ConnId, CloseReason)>,
    stats: Stats,
}

impl Sim {
    /// `edges` Edges, each holding a fresh etcd lease at time 0, keep-alives
    /// staggered.
    fn new(edges: usize, rng: Rng, base: Instant, verbose: bool) -> Self {
        let mut sim = Sim {
            rng,
            base,
            now_ms: 0,
            step: 0,
            verbose,
            edges: Vec::new(),
            etcd: Etcd::default(),
            nodes: (0..NODES.len())
                .map(|_| NodeSim {
                    live: None,
                    phase: NodePhase::Offline,
                    runs: Vec::new(),
                    accepted: 0,
                })
                .collect(),
            conns: BTreeMap::new(),
            next_conn: 0,
            requests: BTreeMap::new(),
            next_request: 0,
            closes: Vec::new(),
            stats: Stats::default(),
        };
        for e in 0..edges {
            let lease = sim.etcd.grant_lease(e, 0);
            let stagger = sim.rng.below(KEEPALIVE_MS);
            sim.edges.push(EdgeSim {
                control: Control::clustered(spec()),
                lease: Some(lease),
                up: false,
                last_acked_send_ms: 0,
                next_keepalive_ms: stagger + 1,
                partitioned_until_ms: None,
                watch_cursor: 0,
                replies: Vec::new(),
                undeliverable: Vec::new(),
                learned: [0; 3],
                accepted: [0; 3],
                config: EdgeConfig::FULL,
                drained: [false; 3],
            });
            sim.set_up(e, true);
        }
        sim
    }

    fn at(&self, ms: u64) -> Instant {
        self.base + Duration::from_millis(ms)
    }

    // ---- feeding Control ----------------------------------------------------

    /// One input to Edge `e`: the step, its actions carried out, every
    /// invariant checked.
    fn feed(&mut self, e: usize, input: Input) {
        self.step += 1;
        self.stats.steps += 1;
        if self.verbose {
            println!("[{}] t={}ms edge {e} <- {input:?}", self.step, self.now_ms);
        }
        match &input {
            Input::OwnershipGranted {
                node_id, revision, ..
            }
            | Input::OwnerObserved {
                node_id, revision, ..
            } => {
                let n = node_index(node_id);
                let learned = &mut self.edges[e].learned[n];
                *learned = (*learned).max(*revision);
            }
            _ => {}
        }
        let observed = matches!(input, Input::OwnerObserved { .. });
        let ready_before: Vec<Option<ConnId>> = if observed {
            NODES
                .iter()
                .map(|id| self.edges[e].control.ready_conn(id))
                .collect()
        } else {
            Vec::new()
        };
        let mut out = Vec::new();
        let now = self.at(self.now_ms);
        self.edges[e].control.handle(now, input, &mut out);
        if observed {
            for (n, before) in ready_before.iter().enumerate() {
                if before.is_some() && self.edges[e].control.ready_conn(NODES[n]).is_none() {
                    self.stats.fenced_by_watch += 1;
                }
            }
        }
        self.carry_out(e, out);
        self.check();
    }

    /// Edge `e`'s due `Control` timers.
    fn fire_timers(&mut self, e: usize) {
        self.step += 1;
        self.stats.steps += 1;
        if self.verbose {
            println!("[{}] t={}ms edge {e} <- timeout", self.step, self.now_ms);
        }
        let mut out = Vec::new();
        let now = self.at(self.now_ms);
        self.edges[e].control.handle_timeout(now, &mut out);
        self.carry_out(e, out);
        self.check();
    }

    fn set_up(&mut self, e: usize, up: bool) {
        self.edges[e].up = up;
        self.feed(e, Input::ClusterSession { up });
    }

    /// The shell of Edge `e`: carries out `Control`'s actions.
    fn carry_out(&mut self, e: usize, out: Vec<Action>) {
        if self.verbose {
            for a in &out {
                println!("      -> {a:?}");
            }
        }
        for action in out {
            match action {
                Action::RegisterResponse { conn, response } => {
                    self.on_register_response(e, conn, response.accepted)
                }
                Action::ReadyResponse { conn, response } => {
                    if response.ready {
                        if let Some(c) = self.conns.get(&conn).filter(|c| c.node_open) {
                            self.nodes[c.node].phase = NodePhase::Ready;
                        }
                    }
                }
                Action::Close { conn, reason } => {
                    self.closes.push((e, conn, reason.clone()));
                    self.count_stale_supersede(e, conn, &reason);
                    match reason {
                        CloseReason::Superseded => self.stats.closed_superseded += 1,
                        CloseReason::OwnershipLost => self.stats.closed_ownership_lost += 1,
                        CloseReason::NodeRemoved => self.stats.closed_node_removed += 1,
                        CloseReason::RegistrationRejected => {
                            self.stats.closed_registration_rejected += 1
                        }
                        _ => {}
                    }
                    self.close_from_edge(conn);
                }
                Action::Dispatch(d) => {
                    self.stats.dispatches += 1;
                    let n = node_index(&d.lease.provider.node_id);
                    let edge = &self.edges[e];
                    assert!(
                        edge.config.nodes[n] && !edge.drained[n],
                        "edge {e} dispatched {:?} to {}, which it no longer serves or drained",
                        d.request,
                        NODES[n]
                    );
                    let conn = d.lease.conn;
                    let delivered = self
                        .conns
                        .get(&conn)
                        .filter(|c| c.node_open)
                        .map(|c| c.node);
                    match delivered {
                        Some(n) => self.nodes[n].runs.push(Run {
                            run_id: d.lease.run_id.clone(),
                            conn,
                        }),
                        // The node left this connection: the send fails.
                        None => self.edges[e].undeliverable.push(d.request),
                    }
                }
                Action::SendCancel { .. } => {
                    // The node answers with the run's terminal (a node
                    // terminal step), or the settlement deadline ends it.
                }
                Action::Done { request, outcome } => {
                    let r = self
                        .requests
                        .get_mut(&request)
                        .unwrap_or_else(|| panic!("Done for {request:?}, never submitted"));
                    r.done += 1;
                    assert_eq!(r.edge, e, "{request:?} ended at another edge");
                    assert_eq!(r.done, 1, "{request:?} ended twice ({outcome:?})");
                    match outcome {
                        Outcome::Completed => self.stats.completed += 1,
                        Outcome::Lost => self.stats.lost += 1,
                        Outcome::Cancelled => self.stats.cancelled += 1,
                        Outcome::Rejected(Rejection::QueueTimeout) => {
                            self.stats.queue_timeouts += 1
                        }
                        Outcome::Rejected(Rejection::QueueFull) => self.stats.queue_full += 1,
                        Outcome::Rejected(Rejection::UnknownModel) => self.stats.unknown_model += 1,
                        Outcome::Rejected(Rejection::ModelRemoved) => self.stats.model_removed += 1,
                        Outcome::Rejected(other) => panic!("{request:?} rejected: {other:?}"),
                    }
                }
                Action::Event(Event::NodeConnected { .. }) => self.stats.first_readies += 1,
                Action::Event(_) => {}
                Action::ClaimOwnership { conn, node_id } => {
                    self.stats.claims += 1;
                    let node = node_index(&node_id);
                    let lease = self.edges[e].lease;
                    assert!(
                        self.edges[e].up && lease.is_some(),
                        "edge {e} claims {node_id} for {conn:?} without a lease"
                    );
                    self.etcd.ops.push(Op::Claim {
                        edge: e,
                        conn,
                        node,
                        lease,
                    });
                }
                Action::ReleaseOwnership { node_id, revision } => {
                    let node = node_index(&node_id);
                    // (6) the release names this Edge's own put for this
                    // node, and this Edge no longer owns under it.
                    let put = self.etcd.puts.get(&revision).copied();
                    assert!(
                        put.is_some_and(|p| p.node == node && p.edge == e),
                        "edge {e} releases {node_id} at revision {revision}, not its own put ({put:?})"
                    );
                    let owner = self.owner_at(e, node);
                    assert!(
                        owner.is_none_or(|(_, g)| g != revision),
                        "edge {e} releases {node_id} at revision {revision} and still owns it"
                    );
                    self.etcd.ops.push(Op::Release {
                        edge: e,
                        node,
                        revision,
                    });
                }
                other => panic!("unexpected action {other:?}"),
            }
        }
    }

    fn on_register_response(&mut self, e: usize, conn: ConnId, accepted: bool) {
        let Some(c) = self.conns.get(&conn) else {
            panic!("RegisterResponse on {conn:?}, which has no connection");
        };
        let n = c.node;
        let node_open = c.node_open;
        if accepted {
            self.stats.grants_accepted += 1;
            let g = self.edges[e]
                .control
                .generation_of(conn)
                .unwrap_or_else(|| panic!("{conn:?} accepted but owns nothing"))
                .0;
            // (2) per Edge, per node: strictly increasing.
            assert!(
                g > self.edges[e].accepted[n],
                "edge {e} accepted {} under {g} after {}",
                NODES[n],
                self.edges[e].accepted[n]
            );
            self.edges[e].accepted[n] = g;
            let elsewhere = (0..self.edges.len())
                .map(|o| self.edges[o].accepted[n])
                .max()
                .unwrap_or(0);
            if g < elsewhere {
                self.stats.stale_accepts += 1;
            }
            if node_open {
                // (2) as the node sees it, across its connections and
                // Edges: strictly increasing.
                assert!(
                    g > self.nodes[n].accepted,
                    "{} accepted on {conn:?} (edge {e}) under {g} after {}",
                    NODES[n],
                    self.nodes[n].accepted
                );
                self.nodes[n].accepted = g;
                self.nodes[n].phase = NodePhase::Registered;
                let c = self.conns.get_mut(&conn).expect("checked above");
                c.frames.push_back(Input::Ready {
                    conn,
                    node_id: NODES[n].into(),
                });
            }
        }
    }

    /// Counts a node's live connection superseded by a claim whose own
    /// connection its node had already left (a put that was in flight
    /// when that connection closed).
    fn count_stale_supersede(&mut self, e: usize, conn: ConnId, reason: &CloseReason) {
        let Some(c) = self.conns.get(&conn).filter(|c| c.node_open) else {
            return;
        };
        let newest = self.etcd.puts.get(&self.edges[e].learned[c.node]);
        let stale = newest.is_some_and(|p| {
            p.conn != conn && !self.conns.get(&p.conn).is_some_and(|c| c.node_open)
        });
        if *reason == CloseReason::Superseded && stale {
            self.stats.live_superseded_by_stale_claim += 1;
        }
    }

    /// The Edge closes `conn`: its node leaves it, the shell reads nothing
    /// more from it and reports `Closed`.
    fn close_from_edge(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.node_open {
            c.node_open = false;
            let n = c.node;
            self.leave(n, conn);
        }
        // Frames not read yet are dropped; the shell reports the close.
        let c = self.conns.get_mut(&conn).expect("present");
        c.frames.clear();
        c.frames.push_back(Input::Closed {
            conn,
            drained: false,
        });
    }

    /// Node `n` no longer uses `conn`.
    fn leave(&mut self, n: usize, conn: ConnId) {
        let node = &mut self.nodes[n];
        if node.live == Some(conn) {
            node.live = None;
            node.phase = NodePhase::Offline;
        }
        node.runs.retain(|r| r.conn != conn);
    }

    /// The connection of Edge `e` that owns node `n` (pending or ready),
    /// with its generation.
    fn owner_at(&self, e: usize, n: usize) -> Option<(ConnId, u64)> {
        let control = &self.edges[e].control;
        self.conns
            .iter()
            .filter(|(_, c)| c.edge == e && c.node == n)
            .find_map(|(&id, _)| control.generation_of(id).map(|g| (id, g.0)))
    }

    // ---- the invariants -------------------------------------------------------

    fn check(&self) {
        let mut ready_at_key = [0u32; 3];
        for (e, edge) in self.edges.iter().enumerate() {
            let control = &edge.control;
            let mut owns_any = false;
            for (&id, c) in self.conns.iter().filter(|(_, c)| c.edge == e) {
                let Some(g) = control.generation_of(id).map(|g| g.0) else {
                    continue;
                };
                owns_any = true;
                let n = c.node;
                assert_eq!(
                    control.node_of(id),
                    Some(NODES[n]),
                    "edge {e}: {id:?} owns a node it did not register"
                );
                // (2) F1 across Edges: every newer revision learned fenced
                // the older generation.
                assert_eq!(
                    g, edge.learned[n],
                    "edge {e}: {} owned by {id:?} under {g}, but revision {} was learned",
                    NODES[n], edge.learned[n]
                );
                // (1) the generation is this very connection's claim, on
                // the Edge's current lease.
                let put = self.etcd.puts.get(&g);
                assert_eq!(
                    put,
                    edge.lease
                        .map(|lease| Put {
                            node: n,
                            edge: e,
                            conn: id,
                            lease,
                        })
                        .as_ref(),
                    "edge {e}: {} owned by {id:?} under {g}, not its own claim on lease {:?}",
                    NODES[n],
                    edge.lease
                );
                assert!(
                    g <= self.etcd.last_revision[n],
                    "edge {e}: {} owned under {g} beyond the key's revision {}",
                    NODES[n],
                    self.etcd.last_revision[n]
                );
                let ready = control.ready_conn(NODES[n]) == Some(id);
                if ready && self.etcd.keys[n].is_some_and(|k| k.mod_revision == g) {
                    ready_at_key[n] += 1;
                }
            }
            // (3) ownership only on a lease alive on the server.
            if owns_any {
                assert!(
                    edge.up && edge.lease.is_some_and(|l| self.etcd.lease_alive(l)),
                    "edge {e} owns nodes without a live etcd lease ({:?})",
                    edge.lease
                );
            }
            // Every lease held is on the ready owner, under its generation.
            for lease in control.leases() {
                let owner = control.ready_conn(&lease.provider.node_id);
                assert_eq!(
                    owner,
                    Some(lease.conn),
                    "edge {e}: lease {} on {:?}, not the ready owner",
                    lease.run_id,
                    lease.conn
                );
                assert_eq!(control.generation_of(lease.conn), Some(lease.generation));
            }
        }
        for (n, count) in ready_at_key.iter().enumerate() {
            assert!(
                *count <= 1,
                "{} is ready at {count} edges under the key's revision",
                NODES[n]
            );
        }
    }

    // ---- the operations of a schedule ---------------------------------------

    /// Node `n` dials Edge `e` and sends its registration.
    fn dial(&mut self, n: usize, e: usize) -> ConnId {
        assert!(self.nodes[n].live.is_none(), "{} dials twice", NODES[n]);
        self.next_conn += 1;
        let conn = ConnId(self.next_conn);
        let mut frames = VecDeque::new();
        frames.push_back(Input::Register {
            conn,
            tls_name: NODES[n].into(),
            node_id: NODES[n].into(),
        });
        self.conns.insert(
            conn,
            ConnSim {
                edge: e,
                node: n,
                frames,
                node_open: true,
            },
        );
        self.nodes[n].live = Some(conn);
        self.nodes[n].phase = NodePhase::Dialed;
        conn
    }

    /// The next frame on `conn` reaches its Edge.
    fn deliver_frame(&mut self, conn: ConnId) {
        let c = self.conns.get_mut(&conn).expect("a connection");
        let e = c.edge;
        let frame = c.frames.pop_front().expect("a frame");
        if matches!(frame, Input::Closed { .. }) {
            self.conns.remove(&conn);
        }
        self.feed(e, frame);
    }

    /// Every frame on `conn`, in order.
    fn deliver_frames(&mut self, conn: ConnId) {
        while self.conns.get(&conn).is_some_and(|c| !c.frames.is_empty()) {
            self.deliver_frame(conn);
        }
    }

    /// The network drops node `n`'s connection: its frames sent so far
    /// still arrive, then `Closed`.
    fn drop_conn(&mut self, n: usize) {
        let conn = self.nodes[n].live.expect("a live connection");
        self.leave(n, conn);
        let c = self.conns.get_mut(&conn).expect("present");
        c.node_open = false;
        c.frames.push_back(Input::Closed {
            conn,
            drained: false,
        });
        if self.verbose {
            println!("      t={}ms {} drops {conn:?}", self.now_ms, NODES[n]);
        }
    }

    /// Node `n` answers run `i` it holds.
    fn node_terminal(&mut self, n: usize, i: usize) {
        let run = self.nodes[n].runs.swap_remove(i);
        let c = self.conns.get_mut(&run.conn).expect("a live connection");
        c.frames.push_back(Input::Terminal(Terminal {
            conn: run.conn,
            run_id: run.run_id,
            adapter: "vllm".into(),
            target: "target".into(),
            stall: None,
            end: AttemptEnd::Answered,
            committed: true,
        }));
    }

    fn submit(&mut self, e: usize, n: usize) {
        self.next_request += 1;
        let request = RequestId(self.next_request);
        self.requests
            .insert(request, RequestSim { edge: e, done: 0 });
        self.feed(
            e,
            Input::Submit {
                request,
                model: model_of(n),
                operation: Operation::ChatCompletions,
                long: false,
                hint: RouteHint::default(),
                share: edge_bin::control::fair::Share::default(),
            },
        );
    }

    /// etcd commits in-flight op `i`.
    fn commit(&mut self, i: usize) {
        let op = self.etcd.ops.swap_remove(i);
        if self.verbose {
            println!("      t={}ms etcd commits {op:?}", self.now_ms);
        }
        match op {
            Op::Claim {
                edge,
                conn,
                node,
                lease,
            } => {
                let partitioned = self.edges[edge].partitioned();
                let reaches = !partitioned || self.rng.chance(50);
                let lease = lease.filter(|&l| reaches && self.etcd.lease_alive(l));
                let reply = match lease {
                    Some(lease) => {
                        let revision = self.etcd.put(node, edge, conn, lease);
                        if partitioned {
                            Reply::Failed { conn }
                        } else {
                            Reply::Granted {
                                conn,
                                node,
                                revision,
                                lease,
                            }
                        }
                    }
                    None => Reply::Failed { conn },
                };
                self.edges[edge].replies.push(reply);
            }
            Op::Release {
                edge,
                node,
                revision,
            } => {
                if self.edges[edge].partitioned() && self.rng.chance(50) {
                    self.stats.releases_lost += 1;
                    return;
                }
                match self.etcd.keys[node] {
                    Some(k) if k.mod_revision == revision => {
                        self.etcd.revision += 1;
                        let at = self.etcd.revision;
                        self.etcd.keys[node] = None;
                        self.etcd.last_revision[node] = at;
                        self.etcd.log.push(WatchEvent {
                            revision: at,
                            node,
                            deleted: true,
                        });
                        self.stats.releases_deleted += 1;
                    }
                    Some(k) => {
                        // (6) the key moved on: a newer claim's, untouched.
                        assert!(k.mod_revision > revision, "{k:?} older than {revision}");
                        self.stats.releases_behind_newer_claim += 1;
                    }
                    None => {}
                }
            }
        }
    }

    /// Edge `e` gets claim answer `i`.
    fn deliver_reply(&mut self, e: usize, i: usize) {
        let reply = self.edges[e].replies.swap_remove(i);
        let input = match reply {
            // The call timed out in the partition: the shell reports a
            // failure, whatever etcd did.
            Reply::Granted { conn, .. } if self.edges[e].partitioned() => {
                self.stats.grants_lost += 1;
                Input::OwnershipFailed { conn }
            }
            Reply::Granted {
                conn,
                node,
                revision,
                lease,
            } => {
                if self.edges[e].lease != Some(lease) {
                    self.stats.grants_after_self_fence += 1;
                }
                if self.edges[e].learned[node] > revision {
                    self.stats.grants_refused_superseded += 1;
                }
                Input::OwnershipGranted {
                    conn,
                    node_id: NODES[node].into(),
                    revision,
                }
            }
            Reply::Failed { conn } => {
                self.stats.claims_failed += 1;
                Input::OwnershipFailed { conn }
            }
        };
        self.feed(e, input);
    }

    /// Edge `e`'s watch delivers its next event.
    fn deliver_watch(&mut self, e: usize) {
        let ev = self.etcd.log[self.edges[e].watch_cursor];
        self.edges[e].watch_cursor += 1;
        if self.edges[e]
            .replies
            .iter()
            .any(|r| matches!(r, Reply::Granted { revision, .. } if *revision == ev.revision))
        {
            self.stats.watch_before_grant += 1;
        }
        self.feed(
            e,
            Input::OwnerObserved {
                node_id: NODES[ev.node].into(),
                revision: ev.revision,
                deleted: ev.deleted,
            },
        );
    }

    fn watch_pending(&self, e: usize) -> bool {
        !self.edges[e].partitioned() && self.edges[e].watch_cursor < self.etcd.log.len()
    }

    // ---- time ----------------------------------------------------------------

    fn next_timed(&self) -> Option<(u64, Timed)> {
        let mut best: Option<(u64, Timed)> = None;
        let mut consider = |t: u64, what: Timed| {
            if best.is_none_or(|b| (t, what) < b) {
                best = Some((t, what));
            }
        };
        for (e, edge) in self.edges.iter().enumerate() {
            if edge.up && edge.lease.is_some() {
                consider(
                    edge.last_acked_send_ms + TTL_MS - KEEPALIVE_MS,
                    Timed::LocalDeadline(e),
                );
            }
            if let Some(t) = edge.control.poll_timeout() {
                let ms = u64::try_from(t.saturating_duration_since(self.base).as_millis())
                    .unwrap_or(u64::MAX);
                consider(ms, Timed::ControlTimer(e));
            }
            consider(edge.next_keepalive_ms, Timed::Keepalive(e));
            if let Some(t) = edge.partitioned_until_ms {
                consider(t, Timed::Heal(e));
            }
        }
        for (&id, lease) in &self.etcd.leases {
            if !lease.expired {
                consider(lease.expiry_ms, Timed::Expiry(id));
            }
        }
        best
    }

    /// Time moves to `target_ms`; every timed event due by then runs at its
    /// own instant, in order.
    fn advance_to(&mut self, target_ms: u64) {
        let mut fired = 0u32;
        while let Some((t, what)) = self.next_timed().filter(|(t, _)| *t <= target_ms) {
            fired += 1;
            assert!(fired < 10_000, "{what:?} due at {t}ms keeps firing");
            self.now_ms = self.now_ms.max(t);
            self.run_timed(what);
        }
        self.now_ms = self.now_ms.max(target_ms);
    }

    fn run_timed(&mut self, what: Timed) {
        match what {
            Timed::LocalDeadline(e) => {
                // The lease can't be proven past here: fence, abandon it.
                self.stats.self_fences += 1;
                self.edges[e].lease = None;
                self.set_up(e, false);
            }
            Timed::Expiry(id) => {
                let lease = self.etcd.leases.get_mut(&id).expect("a lease");
                lease.expired = true;
                let holder = lease.edge;
                let attached: Vec<usize> = (0..NODES.len())
                    .filter(|&n| self.etcd.keys[n].is_some_and(|k| k.lease == id))
                    .collect();
                if self.verbose {
                    println!(
                        "      t={}ms lease {id} of edge {holder} expires, deleting {attached:?}",
                        self.now_ms
                    );
                }
                if !attached.is_empty() {
                    self.stats.expiries_deleting_keys += 1;
                    self.etcd.revision += 1;
                    let at = self.etcd.revision;
                    for n in attached {
                        self.stats.keys_deleted_by_expiry += 1;
                        self.etcd.keys[n] = None;
                        self.etcd.last_revision[n] = at;
                        self.etcd.log.push(WatchEvent {
                            revision: at,
                            node: n,
                            deleted: true,
                        });
                    }
                }
                self.check();
            }
            Timed::ControlTimer(e) => self.fire_timers(e),
            Timed::Keepalive(e) => {
                self.edges[e].next_keepalive_ms += KEEPALIVE_MS;
                let now = self.now_ms;
                let lease = self.edges[e].lease;
                if self.edges[e].partitioned() {
                    // Lost, or it reached the server and its answer is lost.
                    if let Some(l) = lease.filter(|&l| self.etcd.lease_alive(l)) {
                        if self.rng.chance(30) {
                            self.etcd.leases.get_mut(&l).expect("alive").expiry_ms = now + TTL_MS;
                        }
                    }
                    return;
                }
                match lease {
                    Some(l) if self.etcd.lease_alive(l) => {
                        self.etcd.leases.get_mut(&l).expect("alive").expiry_ms = now + TTL_MS;
                        self.edges[e].last_acked_send_ms = now;
                    }
                    _ => {
                        if lease.is_some() {
                            // "lease not found": it expired while this Edge
                            // still counted on it.
                            self.edges[e].lease = None;
                            self.set_up(e, false);
                        }
                        // Back in touch: a new lease.
                        self.stats.new_leases += 1;
                        let l = self.etcd.grant_lease(e, now);
                        self.edges[e].lease = Some(l);
                        self.edges[e].last_acked_send_ms = now;
                        self.set_up(e, true);
                    }
                }
            }
            Timed::Heal(e) => self.heal(e),
        }
    }

    /// Edge `e` reaches etcd again. Its watch resumes from the revision
    /// of the last event it delivered, inclusive: the events of that
    /// revision come again (old news to `Control`).
    fn heal(&mut self, e: usize) {
        if self.verbose {
            println!("      t={}ms edge {e} reaches etcd again", self.now_ms);
        }
        let edge = &mut self.edges[e];
        edge.partitioned_until_ms = None;
        if let Some(last) = edge
            .watch_cursor
            .checked_sub(1)
            .map(|i| self.etcd.log[i].revision)
        {
            while edge.watch_cursor > 0 && self.etcd.log[edge.watch_cursor - 1].revision == last {
                edge.watch_cursor -= 1;
                self.stats.watch_redelivered += 1;
            }
        }
    }

    fn partition(&mut self, e: usize, until_ms: u64) {
        if self.verbose {
            println!(
                "      t={}ms edge {e} partitioned until {until_ms}ms",
                self.now_ms
            );
        }
        self.edges[e].partitioned_until_ms = Some(until_ms);
    }

    // ---- schedules -------------------------------------------------------------

    /// One random step.
    fn random_step(&mut self) {
        let edges = self.edges.len();
        let mut choices: Vec<(u64, Choice)> = Vec::with_capacity(24);
        for n in 0..NODES.len() {
            match self.nodes[n].live {
                None => choices.push((8, Choice::Dial(n))),
                Some(_) => {
                    choices.push((2, Choice::Drop(n)));
                    if !self.nodes[n].runs.is_empty() {
                        choices.push((8, Choice::NodeTerminal(n)));
                    }
                }
            }
            choices.push((3, Choice::Submit(n)));
        }
        for (&id, c) in &self.conns {
            if !c.frames.is_empty() {
                choices.push((6, Choice::Frame(id)));
            }
        }
        if !self.etcd.ops.is_empty() {
            choices.push((10, Choice::Commit));
        }
        for e in 0..edges {
            if !self.edges[e].replies.is_empty() {
                choices.push((8, Choice::Reply(e)));
            }
            if self.watch_pending(e) {
                choices.push((7, Choice::Watch(e)));
            }
            if !self.edges[e].undeliverable.is_empty() {
                choices.push((4, Choice::Undeliverable(e)));
            }
        }
        if self.requests.values().any(|r| r.done == 0) {
            choices.push((2, Choice::Cancel));
        }
        if self.edges.iter().all(|e| !e.partitioned()) {
            choices.push((2, Choice::Partition));
        }
        choices.push((7, Choice::Advance));
        choices.push((1, Choice::Reload));
        choices.push((1, Choice::Drain));
        let total: u64 = choices.iter().map(|(w, _)| w).sum();
        let mut pick = self.rng.below(total);
        let choice = choices
            .iter()
            .find(|(w, _)| {
                if pick < *w {
                    true
                } else {
                    pick -= w;
                    false
                }
            })
            .map(|(_, c)| *c)
            .expect("a choice");
        match choice {
            Choice::Dial(n) => {
                let e = self.rng.below(edges as u64) as usize;
                self.dial(n, e);
            }
            Choice::Drop(n) => self.drop_conn(n),
            Choice::NodeTerminal(n) => {
                let i = self.rng.below(self.nodes[n].runs.len() as u64) as usize;
                self.node_terminal(n, i);
            }
            Choice::Submit(n) => {
                // Mostly at an Edge the node is connected to.
                let e = match self.nodes[n].live.map(|c| self.conns[&c].edge) {
                    Some(e) if self.rng.chance(70) => e,
                    _ => self.rng.below(edges as u64) as usize,
                };
                self.submit(e, n);
            }
            Choice::Frame(conn) => self.deliver_frame(conn),
            Choice::Commit => {
                let i = self.rng.below(self.etcd.ops.len() as u64) as usize;
                self.commit(i);
            }
            Choice::Reply(e) => {
                let i = self.rng.below(self.edges[e].replies.len() as u64) as usize;
                self.deliver_reply(e, i);
            }
            Choice::Watch(e) => self.deliver_watch(e),
            Choice::Undeliverable(e) => {
                let list = &mut self.edges[e].undeliverable;
                let i = self.rng.below(list.len() as u64) as usize;
                let request = list.swap_remove(i);
                self.stats.undeliverable += 1;
                self.feed(e, Input::Undeliverable { request });
            }
            Choice::Cancel => {
                let open: Vec<(RequestId, usize)> = self
                    .requests
                    .iter()
                    .filter(|(_, r)| r.done == 0)
                    .map(|(&id, r)| (id, r.edge))
                    .collect();
                let (request, e) = open[self.rng.below(open.len() as u64) as usize];
                self.feed(
                    e,
                    Input::Cancel {
                        request,
                        reason: CancelReason::ClientDisconnect,
                    },
                );
            }
            Choice::Partition => {
                let e = self.rng.below(edges as u64) as usize;
                // Short: no fence; medium: a fence, the lease survives on
                // the server; long: the lease expires.
                let span = match self.rng.below(3) {
                    0 => self.rng.range(500, 3_000),
                    1 => self.rng.range(7_000, 11_000),
                    _ => self.rng.range(14_000, 24_000),
                };
                self.partition(e, self.now_ms + span);
            }
            Choice::Reload => {
                // An Edge drops a node (with its model), takes it back, or
                // changes its provider's capacity.
                let e = self.rng.below(edges as u64) as usize;
                let n = self.rng.below(NODES.len() as u64) as usize;
                let mut cfg = self.edges[e].config;
                if !cfg.nodes[n] {
                    cfg.nodes[n] = true;
                } else if self.rng.chance(60) {
                    cfg.nodes[n] = false;
                } else {
                    cfg.capacity[n] = self.rng.range(1, 3) as u32;
                }
                self.stats.reloads += 1;
                self.reload(e, cfg);
            }
            Choice::Drain => {
                let e = self.rng.below(edges as u64) as usize;
                let n = self.rng.below(NODES.len() as u64) as usize;
                let drained = !self.edges[e].drained[n];
                self.stats.drains += 1;
                self.drain(e, n, drained);
            }
            Choice::Advance => {
                let by = if self.rng.chance(80) {
                    self.rng.range(50, 1_500)
                } else {
                    self.rng.range(2_000, 8_000)
                };
                self.advance_to(self.now_ms + by);
            }
        }
    }

    /// Whether nothing is in flight: every claim committed and answered,
    /// every event delivered, every connection settled, every node ready on
    /// its live connection, every request ended.
    fn quiescent(&self) -> bool {
        self.etcd.ops.is_empty()
            && self.edges.iter().enumerate().all(|(e, edge)| {
                edge.replies.is_empty()
                    && edge.undeliverable.is_empty()
                    && !self.watch_pending(e)
                    && edge.control.pending_requests().next().is_none()
            })
            && self.conns.values().all(|c| c.frames.is_empty())
            && self
                .nodes
                .iter()
                .all(|n| n.phase == NodePhase::Ready && n.runs.is_empty())
    }

    /// Edge `e` reloads to `cfg`.
    fn reload(&mut self, e: usize, cfg: EdgeConfig) {
        self.edges[e].config = cfg;
        for n in 0..NODES.len() {
            // A node that leaves the configuration may keep its drain (kept
            // while owned, then added back) or lose it (gone, then added
            // back): the sim only counts on drains of nodes configured
            // all along since.
            if !cfg.nodes[n] {
                self.edges[e].drained[n] = false;
            }
        }
        self.feed(e, Input::Reconfigure(Box::new(spec_of(cfg))));
    }

    /// An operator drains (or undrains) node `n` at Edge `e`.
    fn drain(&mut self, e: usize, n: usize, drained: bool) {
        if self.edges[e].config.nodes[n] {
            self.edges[e].drained[n] = drained;
        }
        self.feed(
            e,
            Input::SetDrain {
                target: DrainTarget::Node(NODES[n].into()),
                drained,
            },
        );
    }

    /// Heals every partition, takes every Edge back to the full
    /// configuration undrained, and runs only the steps that settle what
    /// is in flight (no new requests, drops or partitions) until
    /// quiescence; then checks (4) and (5).
    fn quiesce(&mut self) {
        for e in 0..self.edges.len() {
            if self.edges[e].partitioned() {
                self.heal(e);
            }
            if self.edges[e].config != EdgeConfig::FULL {
                self.reload(e, EdgeConfig::FULL);
            }
            for n in 0..NODES.len() {
                self.drain(e, n, false);
            }
        }
        const QUIESCE_STEPS_MAX: u64 = 2_000;
        for _ in 0..QUIESCE_STEPS_MAX {
            if self.quiescent() {
                self.check_quiescent();
                return;
            }
            self.stats.quiesce_steps += 1;
            let mut choices: Vec<Choice> = Vec::new();
            for n in 0..NODES.len() {
                if self.nodes[n].live.is_none() {
                    choices.push(Choice::Dial(n));
                }
                if !self.nodes[n].runs.is_empty() {
                    choices.push(Choice::NodeTerminal(n));
                }
            }
            for (&id, c) in &self.conns {
                if !c.frames.is_empty() {
                    choices.push(Choice::Frame(id));
                }
            }
            if !self.etcd.ops.is_empty() {
                choices.push(Choice::Commit);
            }
            for e in 0..self.edges.len() {
                if !self.edges[e].replies.is_empty() {
                    choices.push(Choice::Reply(e));
                }
                if self.watch_pending(e) {
                    choices.push(Choice::Watch(e));
                }
                if !self.edges[e].undeliverable.is_empty() {
                    choices.push(Choice::Undeliverable(e));
                }
            }
            let Some(choice) = self.rng.pick(&choices) else {
                // Only time is left: queue and settle deadlines, Edges
                // taking a new lease.
                let (t, _) = self.next_timed().expect("keep-alives are always due");
                self.advance_to(t);
                continue;
            };
            match choice {
                Choice::Dial(n) => {
                    // A node's dial reaches an Edge that holds a lease if
                    // there is one (others refuse it; it would dial again).
                    let up: Vec<usize> = (0..self.edges.len())
                        .filter(|&e| self.edges[e].up)
                        .collect();
                    match self.rng.pick(&up) {
                        Some(e) => {
                            self.dial(n, e);
                        }
                        None => {
                            let (t, _) = self.next_timed().expect("keep-alives are always due");
                            self.advance_to(t);
                        }
                    }
                }
                Choice::NodeTerminal(n) => {
                    let i = self.rng.below(self.nodes[n].runs.len() as u64) as usize;
                    self.node_terminal(n, i);
                }
                Choice::Frame(conn) => self.deliver_frame(conn),
                Choice::Commit => {
                    let i = self.rng.below(self.etcd.ops.len() as u64) as usize;
                    self.commit(i);
                }
                Choice::Reply(e) => {
                    let i = self.rng.below(self.edges[e].replies.len() as u64) as usize;
                    self.deliver_reply(e, i);
                }
                Choice::Watch(e) => self.deliver_watch(e),
                Choice::Undeliverable(e) => {
                    let request = self.edges[e].undeliverable.swap_remove(0);
                    self.feed(e, Input::Undeliverable { request });
                }
                _ => unreachable!("not a settling step"),
            }
        }
        panic!("no quiescence after {QUIESCE_STEPS_MAX} settling steps");
    }

    /// (4) and (5), at quiescence.
    fn check_quiescent(&self) {
        for (n, node) in self.nodes.iter().enumerate() {
            let id = NODES[n];
            let conn = node.live.expect("quiescent: every node is connected");
            let e = self.conns[&conn].edge;
            let key = self.etcd.keys[n].unwrap_or_else(|| panic!("quiescent: {id} has no key"));
            assert_eq!(
                (key.edge, key.conn),
                (e, conn),
                "quiescent: {id}'s key is not its live connection's claim"
            );
            assert_eq!(
                self.edges[e].control.ready_conn(id),
                Some(conn),
                "quiescent: {id} is not ready on its live connection at edge {e}"
            );
            assert_eq!(
                self.edges[e].control.generation_of(conn).map(|g| g.0),
                Some(key.mod_revision),
                "quiescent: {id} owned at edge {e} under another generation than its key's"
            );
            for (o, edge) in self.edges.iter().enumerate() {
                assert_eq!(
                    edge.learned[n], self.etcd.last_revision[n],
                    "quiescent: edge {o} did not learn {id}'s latest revision"
                );
                if o != e {
                    let phase = &edge
                        .control
                        .node_views()
                        .into_iter()
                        .find(|v| v.node_id == id)
                        .expect("configured")
                        .phase;
                    assert_eq!(
                        *phase,
                        edge_bin::control::NodePhase::Offline,
                        "quiescent: edge {o} still owns {id}, which is at edge {e}"
                    );
                    assert_eq!(self.owner_at(o, n), None);
                }
            }
        }
        for (request, r) in &self.requests {
            assert_eq!(r.done, 1, "quiescent: {request:?} ended {} times", r.done);
        }
        for (e, edge) in self.edges.iter().enumerate() {
            assert_eq!(edge.control.leases().count(), 0, "edge {e} holds leases");
            for s in edge.control.snapshots() {
                assert_eq!(
                    s.in_flight, 0,
                    "edge {e}: {}/{} in flight",
                    s.node_id, s.provider_id
                );
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Choice {
    Dial(usize),
    Drop(usize),
    NodeTerminal(usize),
    Submit(usize),
    Frame(ConnId),
    Commit,
    Reply(usize),
    Watch(usize),
    Undeliverable(usize),
    Cancel,
    Partition,
    Advance,
    Reload,
    Drain,
}

// ---------------------------------------------------------------------------
// Running schedules
// ---------------------------------------------------------------------------

/// Default base seed (printed; override with `IOP_SIM_BASE_SEED`).
const DEFAULT_BASE_SEED: u64 = 0xC1A5_7E55_1E0D_0001;
/// Schedules in the main run.
const SCHEDULES: u64 = 10_000;
/// Random steps per schedule, before it settles.
const STEPS: u64 = 40;

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Runs one schedule: two or three Edges, [`STEPS`] random steps, then
/// settling. Returns its stats, or the failure with its step.
fn run_schedule(seed: u64, base: Instant, verbose: bool) -> Result<Stats, String> {
    let mut rng = Rng(seed);
    let edges = rng.range(2, 3) as usize;
    let mut sim = None;
    let result = catch_unwind(AssertUnwindSafe(|| {
        let s = sim.insert(Sim::new(edges, rng, base, verbose));
        for _ in 0..STEPS {
            s.random_step();
        }
        s.quiesce();
    }));
    match (result, sim) {
        (Ok(()), Some(mut sim)) => {
            sim.stats.schedules = 1;
            Ok(sim.stats)
        }
        (Ok(()), None) => unreachable!("the schedule ran"),
        (Err(panic), sim) => {
            let (step, now_ms) = sim.map_or((0, 0), |s| (s.step, s.now_ms));
            Err(format!(
                "{edges} edges, step {step} (t={now_ms}ms): {}",
                panic_message(panic.as_ref())
            ))
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

/// Runs `schedules` seeds from the base seed (or only the one
/// `IOP_SIM_SEED` names, with a step log), split over two threads; each
/// seed's run is the same whichever thread runs it.
fn run_all(schedules: u64) -> Stats {
    let base = iop_engine::clock::now();
    if let Some(seed) = env_u64("IOP_SIM_SEED") {
        println!("cluster_sim: replaying seed {seed} (IOP_SIM_SEED)");
        match run_schedule(seed, base, true) {
            Ok(stats) => {
                println!("cluster_sim: seed {seed} passed: {stats:?}");
                return stats;
            }
            Err(failure) => panic!("cluster_sim: seed {seed} failed: {failure}"),
        }
    }
    let base_seed = env_u64("IOP_SIM_BASE_SEED").unwrap_or(DEFAULT_BASE_SEED);
    println!("cluster_sim: base seed {base_seed:#x} (IOP_SIM_BASE_SEED), {schedules} schedules");
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
                        match run_schedule(seed, base, false) {
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
            Err((seed, failure)) => panic!(
                "cluster_sim: seed {seed} failed: {failure}\n\
                 replay with: IOP_SIM_SEED={seed} cargo test -p edge-bin --test cluster_sim -- --nocapture --exact simulation"
            ),
        }
    }
    println!(
        "cluster_sim: {} schedules, {} steps (base seed {base_seed:#x})",
        total.schedules, total.steps
    );
    println!("cluster_sim: coverage {total:?}");
    total
}

#[test]
fn simulation() {
    // CONTRACT: F1, R2
    let stats = run_all(SCHEDULES);
    if std::env::var_os("IOP_SIM_SEED").is_some() {
        return;
    }
    assert_eq!(stats.schedules, SCHEDULES);
    // The generator reaches every interleaving it is meant to check.
    for (name, n) in [
        ("claims", stats.claims),
        ("grants_accepted", stats.grants_accepted),
        ("grants_refused_superseded", stats.grants_refused_superseded),
        ("grants_after_self_fence", stats.grants_after_self_fence),
        ("grants_lost", stats.grants_lost),
        ("claims_failed", stats.claims_failed),
        ("watch_before_grant", stats.watch_before_grant),
        ("watch_redelivered", stats.watch_redelivered),
        ("stale_accepts", stats.stale_accepts),
        (
            "live_superseded_by_stale_claim",
            stats.live_superseded_by_stale_claim,
        ),
        ("self_fences", stats.self_fences),
        ("new_leases", stats.new_leases),
        ("expiries_deleting_keys", stats.expiries_deleting_keys),
        ("releases_deleted", stats.releases_deleted),
        (
            "releases_behind_newer_claim",
            stats.releases_behind_newer_claim,
        ),
        ("releases_lost", stats.releases_lost),
        ("fenced_by_watch", stats.fenced_by_watch),
        ("closed_superseded", stats.closed_superseded),
        ("closed_ownership_lost", stats.closed_ownership_lost),
        ("first_readies", stats.first_readies),
        ("dispatches", stats.dispatches),
        ("completed", stats.completed),
        ("lost", stats.lost),
        ("cancelled", stats.cancelled),
        ("queue_timeouts", stats.queue_timeouts),
        ("queue_full", stats.queue_full),
        ("undeliverable", stats.undeliverable),
        ("reloads", stats.reloads),
        ("drains", stats.drains),
        ("closed_node_removed", stats.closed_node_removed),
        (
            "closed_registration_rejected",
            stats.closed_registration_rejected,
        ),
        ("unknown_model", stats.unknown_model),
        ("model_removed", stats.model_removed),
    ] {
        assert!(n > 0, "the simulation never reached `{name}`: {stats:?}");
    }
}

// ---------------------------------------------------------------------------
// Hand-written schedules: the interleavings the simulation is for, each
// driven step by step through the same model and checks.
// ---------------------------------------------------------------------------

impl Sim {
    /// A scripted cluster: `edges` Edges holding their leases at time 0.
    fn scripted(edges: usize) -> Self {
        Sim::new(edges, Rng(7), iop_engine::clock::now(), false)
    }

    /// etcd commits the claim for `conn`.
    fn commit_claim(&mut self, conn: ConnId) {
        let i = self
            .etcd
            .ops
            .iter()
            .position(|op| matches!(op, Op::Claim { conn: c, .. } if *c == conn))
            .unwrap_or_else(|| panic!("no claim in flight for {conn:?}"));
        self.commit(i);
    }

    /// etcd commits the release of `node` at `revision`.
    fn commit_release(&mut self, node: usize, revision: u64) {
        let i = self
            .etcd
            .ops
            .iter()
            .position(|op| {
                matches!(op, Op::Release { node: n, revision: r, .. } if *n == node && *r == revision)
            })
            .unwrap_or_else(|| panic!("no release of {} at {revision}", NODES[node]));
        self.commit(i);
    }

    /// Edge `e` gets the answer to the claim of `conn`.
    fn reply(&mut self, e: usize, conn: ConnId) {
        let i = self.edges[e]
            .replies
            .iter()
            .position(|r| match r {
                Reply::Granted { conn: c, .. } | Reply::Failed { conn: c } => *c == conn,
            })
            .unwrap_or_else(|| panic!("no answer for {conn:?} at edge {e}"));
        self.deliver_reply(e, i);
    }

    /// Edge `e`'s watch delivers everything written so far.
    fn watch_all(&mut self, e: usize) {
        while self.watch_pending(e) {
            self.deliver_watch(e);
        }
    }

    /// Node `n` dials Edge `e` and becomes its ready owner; returns the
    /// connection and its generation.
    fn own(&mut self, n: usize, e: usize) -> (ConnId, u64) {
        let conn = self.dial(n, e);
        self.deliver_frames(conn);
        self.commit_claim(conn);
        self.reply(e, conn);
        self.deliver_frames(conn);
        assert_eq!(self.edges[e].control.ready_conn(NODES[n]), Some(conn));
        let g = self.edges[e].control.generation_of(conn).expect("owner").0;
        (conn, g)
    }

    fn generation(&self, e: usize, conn: ConnId) -> Option<u64> {
        self.edges[e].control.generation_of(conn).map(|g| g.0)
    }

    fn key(&self, n: usize) -> Option<(u64, usize, ConnId)> {
        self.etcd.keys[n].map(|k| (k.mod_revision, k.edge, k.conn))
    }

    fn closed(&self, e: usize, conn: ConnId) -> Vec<CloseReason> {
        self.closes
            .iter()
            .filter(|(edge, c, _)| *edge == e && *c == conn)
            .map(|(_, _, reason)| reason.clone())
            .collect()
    }
}

#[test]
fn the_watch_reports_a_claim_before_its_grant_and_a_move_to_another_edge_before_the_close() {
    let mut s = Sim::scripted(2);
    let a = s.dial(0, 0);
    s.deliver_frames(a);
    s.commit_claim(a);
    // Edge 0 sees its own claim's revision before the claim's answer: it
    // owns nothing yet, and the grant of that revision is then accepted.
    s.watch_all(0);
    assert_eq!(s.generation(0, a), None);
    s.reply(0, a);
    assert_eq!(s.generation(0, a), Some(1));
    s.deliver_frames(a);
    assert_eq!(s.edges[0].control.ready_conn("n1"), Some(a));
    // The node loses its connection and dials edge 1, whose claim commits
    // before edge 0 has read the close.
    s.drop_conn(0);
    let b = s.dial(0, 1);
    s.deliver_frames(b);
    s.commit_claim(b);
    assert_eq!(s.key(0), Some((2, 1, b)));
    // Edge 0's watch fences generation 1 (F1 across Edges) and closes it:
    // the key is edge 1's now, so nothing is released.
    s.watch_all(0);
    assert_eq!(s.edges[0].control.ready_conn("n1"), None);
    assert_eq!(s.closed(0, a), vec![CloseReason::Superseded]);
    s.deliver_frames(a);
    assert!(s.etcd.ops.is_empty(), "{:?}", s.etcd.ops);
    // Edge 1 too sees revision 2 before its grant; then accepts it.
    s.watch_all(1);
    assert_eq!(s.generation(1, b), None);
    s.reply(1, b);
    assert_eq!(s.generation(1, b), Some(2));
    s.deliver_frames(b);
    assert_eq!(s.edges[1].control.ready_conn("n1"), Some(b));
    assert!(s.closed(1, b).is_empty());
    s.quiesce();
}

#[test]
fn a_grant_that_arrives_after_the_edge_fenced_itself_releases_the_key_it_wrote() {
    let mut s = Sim::scripted(2);
    let a = s.dial(0, 0);
    s.deliver_frames(a);
    s.commit_claim(a);
    assert_eq!(s.key(0), Some((1, 0, a)));
    // Edge 0 loses etcd with the claim's answer on its way; at its local
    // deadline it fences itself and refuses the claim in flight.
    s.partition(0, 60_000);
    let deadline = s.edges[0].last_acked_send_ms + TTL_MS - KEEPALIVE_MS;
    s.advance_to(deadline);
    assert!(!s.edges[0].up);
    assert_eq!(s.closed(0, a), vec![CloseReason::OwnershipLost]);
    assert_eq!(s.nodes[0].live, None);
    // The answer gets through after all: the claim is nobody's, so the key
    // it wrote is released at its own revision, and nothing is owned.
    s.heal(0);
    s.reply(0, a);
    assert_eq!(s.stats.grants_after_self_fence, 1);
    assert_eq!(s.generation(0, a), None);
    s.commit_release(0, 1);
    assert_eq!(s.key(0), None);
    assert_eq!(s.etcd.last_revision[0], 2);
    // The node redials the other Edge and owns the node there.
    let (b, g) = s.own(0, 1);
    assert_eq!(g, 3);
    s.watch_all(0);
    s.watch_all(1);
    assert_eq!(s.edges[1].control.ready_conn("n1"), Some(b));
    s.quiesce();
}

#[test]
fn a_release_that_commits_after_a_newer_claim_leaves_the_newer_key_alone() {
    let mut s = Sim::scripted(2);
    let (a, g) = s.own(0, 0);
    assert_eq!(g, 1);
    s.drop_conn(0);
    let b = s.dial(0, 1);
    s.deliver_frames(b);
    // Edge 0 reads the close and releases generation 1; edge 1's claim
    // commits first.
    s.deliver_frames(a);
    assert_eq!(s.closed(0, a), vec![]);
    s.commit_claim(b);
    s.commit_release(0, 1);
    assert_eq!(s.stats.releases_behind_newer_claim, 1);
    assert_eq!(s.key(0), Some((2, 1, b)));
    s.reply(1, b);
    s.deliver_frames(b);
    s.watch_all(0);
    s.watch_all(1);
    assert_eq!(s.edges[1].control.ready_conn("n1"), Some(b));
    assert_eq!(s.generation(1, b), Some(2));
    assert_eq!(s.edges[0].control.ready_conn("n1"), None);
    s.quiesce();
}

#[test]
fn an_expired_lease_deletes_only_the_keys_still_attached_to_it_after_its_edge_fenced_itself() {
    let mut s = Sim::scripted(2);
    let (a1, g1) = s.own(0, 0);
    let (a2, g2) = s.own(1, 0);
    assert_eq!((g1, g2), (1, 2));
    let lease = s.edges[0].lease.expect("a lease");
    // Edge 0 is cut off long enough for its lease to expire on the server.
    s.partition(0, 40_000);
    let deadline = s.edges[0].last_acked_send_ms + TTL_MS - KEEPALIVE_MS;
    s.advance_to(deadline);
    // It fenced itself first, at its local deadline: both owners closed,
    // their releases lost in the partition (not committed yet).
    assert_eq!(s.closed(0, a1), vec![CloseReason::OwnershipLost]);
    assert_eq!(s.closed(0, a2), vec![CloseReason::OwnershipLost]);
    assert!(s.etcd.lease_alive(lease));
    s.deliver_frames(a1);
    s.deliver_frames(a2);
    // n1 moves to edge 1 before the expiry: its key leaves the old lease.
    let (b1, g3) = s.own(0, 1);
    assert_eq!(g3, 3);
    let expiry = s.etcd.leases[&lease].expiry_ms;
    s.advance_to(expiry);
    assert!(!s.etcd.lease_alive(lease));
    // Only n2's key was still on the lease: one delete, at revision 4.
    assert_eq!(s.key(0), Some((3, 1, b1)));
    assert_eq!(s.key(1), None);
    assert_eq!(s.etcd.last_revision[1], 4);
    assert_eq!(s.stats.keys_deleted_by_expiry, 1);
    // Edge 1 learns all of it: its owner of n1 stands.
    s.watch_all(1);
    assert_eq!(s.edges[1].control.ready_conn("n1"), Some(b1));
    assert_eq!(s.generation(1, b1), Some(3));
    // Edge 0's releases finally reach etcd: they match no key any more.
    s.heal(0);
    s.commit_release(0, 1);
    s.commit_release(1, 2);
    assert_eq!(s.key(0), Some((3, 1, b1)));
    assert_eq!(s.key(1), None);
    assert_eq!(s.etcd.revision, 4);
    // Edge 0 takes a new lease at its next keep-alive and n2 owns there.
    s.advance_to(s.edges[0].next_keepalive_ms);
    assert!(s.edges[0].up);
    assert_ne!(s.edges[0].lease, Some(lease));
    let (_, g5) = s.own(1, 0);
    assert_eq!(g5, 5);
    s.quiesce();
}

#[test]
fn a_watch_resumed_after_a_short_partition_repeats_old_news_and_changes_nothing() {
    let mut s = Sim::scripted(2);
    let (a, g) = s.own(0, 0);
    s.watch_all(0);
    s.watch_all(1);
    let actions_before = s.closes.len();
    // Cut off for less than the self-fencing margin: no fence.
    s.partition(0, s.now_ms + 1_000);
    s.advance_to(s.now_ms + 1_000);
    assert!(s.edges[0].up);
    // The watch comes back from revision 1, inclusive: delivered again.
    assert_eq!(s.stats.watch_redelivered, 1);
    assert!(s.watch_pending(0));
    s.watch_all(0);
    assert_eq!(s.edges[0].control.ready_conn("n1"), Some(a));
    assert_eq!(s.generation(0, a), Some(g));
    assert_eq!(s.closes.len(), actions_before);
    assert!(s.etcd.ops.is_empty());
    s.quiesce();
}
