//! `Control`: the Edge's authoritative state as a sans-IO state machine.
//!
//! It owns the node registry (which connection owns which node id, under which
//! generation, pending or ready), the provider resources of each node with
//! their runtime health overlay, the per-model admission queues, and the
//! provider leases of running requests. It reads no clock and opens no socket:
//! the shell feeds it `(now, input)` through [`Control::handle`] and
//! [`Control::handle_timeout`], and carries out the [`Action`]s it appends.
//!
//! ```text
//!             register (accepted)          ready (first)
//!  [no owner] ───────────────────► Pending ───────────────► Ready
//!       ▲                            │                        │
//!       └──── close / superseded ────┴── close / heartbeat ───┘
//!                                        timeout: fence (F1)
//!
//!  request: Submit ──► Queued ──(pump)──► Dispatched(lease) ──terminal──► Done
//!               │          │ timeout/cancel/full                │ fence / cancel settle
//!               └──────────┴──────────────► Done ◄──────────────┘
//! ```
//!
//! The rooms, one way down (each uses only the ones below it):
//!
//! - `registry.rs`, `admission.rs`, `health.rs`, `views.rs`: what `Control`
//!   does, one concern each (`impl Control` blocks): the registry and
//!   fencing; lanes, queues, leases, terminals and pre-commit failover;
//!   passive health, the overlay and recovery probes; what it shows.
//!   `invariants.rs` checks the invariants below after every step in debug
//!   builds.
//! - this file: [`Control`] itself, what goes in ([`Input`]) and out
//!   ([`Action`], [`Event`]), and the dispatch of inputs and timers to the
//!   rooms above.
//! - `tables.rs`: the entries of Control's tables (nodes and owners,
//!   providers, leases, pending requests, lanes).
//! - `spec.rs` (what Control is configured with: [`ControlSpec`]),
//!   [`outlier`] (one provider's passive health), `terminal.rs` (how an
//!   attempt ended), `ids.rs` (the identities everything is named by).
//!
//! [`attempt`] stands apart: the node connection shell's classification of
//! one attempt's frames, which it reports as [`Input::Committed`] and
//! [`Terminal`].
//!
//! Invariants (asserted after every step in debug builds, and held against
//! a shadow model by the deterministic simulation in `tests/control_sim.rs`):
//! - A connection owns at most one node id (R1); a node id has at most one
//!   owner connection, tagged with an Edge-internal generation (R2, R5).
//! - Only a `Ready` owner is a dispatch candidate or reported connected (R4,
//!   X6).
//! - Every lease is released exactly once: on its terminal from the owning
//!   connection, on fencing of its generation, or on cancel settlement (F1).
//!   `in_flight` of a provider equals its live leases, and no admission
//!   takes it past its capacity (only a reload that lowers the capacity
//!   leaves it above, admitting nothing until it is below); likewise for
//!   long-context leases.
//! - No dispatch goes to a provider or node removed by a reload, drained by
//!   an operator, or whose owner drains (`fleet.rs`).
//! - Every submitted request ends exactly once ([`Action::Done`]) and no
//!   request waits past its deadline.
//! - Stale inputs (from a connection that no longer owns its node id, or for
//!   a run it does not carry) change nothing and emit nothing (F2).
//! - The overlay changes only as H4 (set) and H6 (clear) allow.

pub mod attempt;
pub mod fair;
pub mod outlier;
pub mod prefix;
pub mod routing;

mod admission;
mod fleet;
mod health;
mod ids;
mod invariants;
mod ownership;
mod registry;
mod spec;
mod tables;
mod terminal;
mod views;

pub use ids::{ConnId, Generation, ProviderKey, RequestId};
pub use routing::{RouteHint, RoutingPolicy, RoutingSpec, RoutingStats};
pub use spec::{
    control_spec, outlier_policy, ControlModel, ControlNode, ControlProvider, ControlSpec,
    DispatchKind, Operation, Operations, Tunables,
};
pub use tables::ProviderLease;

pub use terminal::{AttemptEnd, FailureReason, StallEvidence, Terminal};
pub use views::{ModelCapacity, ProviderView};

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// A map looked up on every request (by connection, request or run id, or
/// a configured name): hashed with foldhash, several times cheaper than
/// SipHash on these short keys. Seeded per map at random, like the
/// standard one; no client makes its keys grow.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
/// A set hashed as [`FastMap`] is.
pub(crate) type FastSet<K> = HashSet<K, foldhash::fast::RandomState>;
use std::time::Instant;

use iop_wire::{pb, CloseReason};

use crate::control::outlier::{Ejection, OutlierState, Readmission};
use crate::control::tables::{
    CommandRecord, LaneState, LeaseEntry, ModelState, NodeEntry, Pending, ProviderState,
    RequestState,
};

/// Longest node version string kept ([`Input::NodeVersion`]), in chars.
pub const NODE_VERSION_CHARS_MAX: usize = 64;

/// Where a node's owner is in registration (R1–R3), for the status page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePhase {
    /// No connection owns it.
    Offline,
    /// Registered, not dispatch-ready yet.
    Registered,
    /// Dispatch-ready.
    Ready,
}

/// One configured node as the status page shows it ([`Control::node_views`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// Node id.
    pub node_id: String,
    /// Its owner's phase.
    pub phase: NodePhase,
    /// The version its owner reported (empty: none, or offline).
    pub version: String,
    /// When its owner's registration was accepted. (The owner's generation
    /// is not here: it never leaves the Edge, R5, X5.)
    pub registered_at: Option<Instant>,
    /// When it became dispatch-ready.
    pub ready_at: Option<Instant>,
    /// When its last owner went away, while offline (`None`: never seen).
    pub offline_since: Option<Instant>,
    /// Drained by an operator ([`Input::SetDrain`]): none of its providers
    /// takes new work; what runs there finishes. Kept across reconnects
    /// and reloads.
    pub drained: bool,
    /// Its owner said it drains ([`Input::NodeDraining`]): no new work
    /// under that owner's generation.
    pub draining: bool,
    /// No longer in the configuration: kept only while its owner finishes
    /// what it was given.
    pub removed: bool,
}

/// One model's pool as the status page shows it ([`Control::model_views`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelView {
    /// External model name.
    pub model: String,
    /// Providers in its pool.
    pub providers: usize,
    /// Of those, the ones that are a candidate with a free slot now.
    pub candidates: usize,
    /// Requests waiting for a lease.
    pub queued: usize,
    /// Its `max_queue`.
    pub max_queue: u32,
    /// Its routing policy.
    pub routing: RoutingPolicy,
    /// Its routing counters.
    pub routing_stats: RoutingStats,
    /// The bytes its prefix tree holds (0 unless `prefix`).
    pub tree_bytes: usize,
    /// Its prefix tree's budget (0 unless `prefix`).
    pub tree_budget_bytes: usize,
}

/// Why a dispatched or queued request is cancelled (U6); dispatched ones
/// carry it to the node as `CancelRequest.reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CancelReason {
    /// The client closed its connection (or it broke) before the answer
    /// ended.
    ClientDisconnect,
    /// The client's socket took no bytes for `client_write_stall_timeout_ms`.
    ClientWriteStall,
    /// The client drained slower than a node without flow control sent:
    /// the run outgrew its window at the Edge.
    ClientTooSlow,
    /// No response started within [`Tunables::response_wait_timeout`]
    /// (U6); Control cancels on its own.
    ResponseWaitTimeout,
}

impl CancelReason {
    /// The wire reason.
    pub fn as_str(self) -> &'static str {
        match self {
            CancelReason::ClientDisconnect => "client_disconnect",
            CancelReason::ClientWriteStall => "client_write_stall",
            CancelReason::ClientTooSlow => "client_too_slow",
            CancelReason::ResponseWaitTimeout => "response_wait_timeout",
        }
    }
}

/// An input to the state machine.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// `RegisterRequest{node_id}` on `conn`, whose verified TLS identity
    /// name is `tls_name` (T3).
    Register {
        /// The connection.
        conn: ConnId,
        /// Its verified identity name.
        tls_name: String,
        /// The claimed node id.
        node_id: String,
    },
    /// `NodeReadyRequest{node_id}` on `conn` (R3).
    Ready {
        /// The connection.
        conn: ConnId,
        /// The node id it names.
        node_id: String,
    },
    /// The software version `conn` reported in its `RegisterRequest`
    /// (diagnostic only; after its `Register`), whether it strips a
    /// usage chunk the Edge asked for (`RegisterRequest.strips_usage_chunk`,
    /// copied into its dispatches), and whether it runs embeddings on its
    /// Ollama adapters (`RegisterRequest.runs_embeddings`: only then are
    /// they candidates for embeddings).
    NodeVersion {
        /// The connection.
        conn: ConnId,
        /// `RegisterRequest.node_version`.
        version: String,
        /// `RegisterRequest.strips_usage_chunk`.
        strips_usage_chunk: bool,
        /// `RegisterRequest.runs_embeddings`.
        runs_embeddings: bool,
        /// `RegisterRequest.accepts_tunnel_body`.
        accepts_tunnel_body: bool,
    },
    /// `conn` closed, failed, or timed out its heartbeat (F1, F2).
    Closed {
        /// The connection.
        conn: ConnId,
        /// Its node closed it with `Close(drained)`: every run it started
        /// there has ended and its terminal came first, so a lease on it
        /// whose response never started is a run the node never started.
        /// Such a request is dispatched again, as if it had never left its
        /// queue (not an attempt, whatever `max_attempts`).
        drained: bool,
    },
    /// A client request for `model`.
    Submit {
        /// Its id (arrival order).
        request: RequestId,
        /// The external model (E2).
        model: String,
        /// What it asks for: only providers serving it are candidates.
        operation: Operation,
        /// Whether it needs a long-context slot.
        long: bool,
        /// What its model's routing policy may use.
        hint: RouteHint,
        /// Who it is charged to while it queues ([`fair`]).
        share: fair::Share,
    },
    /// The client of `request` went away or was cut off (U6).
    Cancel {
        /// The request.
        request: RequestId,
        /// Why (the `CancelRequest.reason` the node gets).
        reason: CancelReason,
    },
    /// The shell could not deliver a dispatched run to its node (the client
    /// left before it was sent, or the send failed): release the lease now;
    /// no terminal will come (cancel settlement). The client has given up:
    /// a request queued again after its node was fenced ends too.
    Undeliverable {
        /// The request.
        request: RequestId,
    },
    /// A run or tunnel terminal from a node (H1–H5).
    Terminal(Terminal),
    /// A byte of run `run_id`'s response reached the client's reply (the
    /// commit point, `crate::control::attempt`): from now on it is never retried.
    Committed {
        /// The connection it arrived on (H1: only the lease's counts).
        conn: ConnId,
        /// The run.
        run_id: String,
    },
    /// The first frame of run `run_id` (a tunnel's `RESPONSE_START` or
    /// first frame, a run's first event) arrived on `conn`: its response
    /// has started, the response-wait deadline is off (U6).
    Responded {
        /// The connection it arrived on (H1: only the lease's counts).
        conn: ConnId,
        /// The run.
        run_id: String,
    },
    /// A `NodeCommandResponse` from `conn` (H6).
    CommandResult {
        /// The connection it arrived on.
        conn: ConnId,
        /// The response.
        response: pb::NodeCommandResponse,
    },
    /// In a cluster: the claim of [`Action::ClaimOwnership`] for `conn`
    /// committed in etcd at `revision` (the owner key's new
    /// `mod_revision`).
    OwnershipGranted {
        /// The claiming connection.
        conn: ConnId,
        /// The node id claimed.
        node_id: String,
        /// The claim's revision: the generation, if it is still the newest.
        revision: u64,
    },
    /// In a cluster: the claim for `conn` did not commit (etcd unreachable
    /// or the call failed); the registration is refused and the Node
    /// retries, possibly at another Edge.
    OwnershipFailed {
        /// The claiming connection.
        conn: ConnId,
    },
    /// In a cluster: the watch saw `node_id`'s owner key written (a claim,
    /// by any Edge, this one included) or deleted (a release, or the
    /// expiry of its holder's etcd lease) at `revision`. Any owner here
    /// under an older generation is fenced (F1 across Edges). Events may
    /// arrive before or after the grant of the same claim.
    OwnerObserved {
        /// The node id.
        node_id: String,
        /// The event's revision.
        revision: u64,
        /// The key was deleted (not written).
        deleted: bool,
    },
    /// In a cluster: whether this Edge can prove it holds its etcd lease.
    /// `up: false` (lost etcd, or the local deadline before the lease can
    /// expire on the server passed) fences every owned generation, refuses
    /// claims in flight and new registrations until `up: true` again.
    ClusterSession {
        /// The lease is held.
        up: bool,
    },
    /// This Edge began its shutdown drain (no new client request comes).
    /// In a cluster, from now on every node whose owner has nothing in
    /// flight, once no request waits in a queue, is let go of (closed with
    /// `shutdown`) so it registers with another Edge now instead of when
    /// this one exits. A single Edge keeps its nodes to the end.
    Drain,
    /// The owner on `conn` said it is draining (`NodeDraining` on its
    /// link): nothing new is dispatched to it under this generation; what
    /// runs there finishes and nothing is queued again. A new registration
    /// of the node starts undrained.
    NodeDraining {
        /// The connection.
        conn: ConnId,
    },
    /// An operator drained (`drained: true`) or undrained a node or one
    /// provider (the admin API): a drained one takes no new dispatch,
    /// what runs there finishes. Kept across the node's reconnects and
    /// reloads. An unknown target changes nothing.
    SetDrain {
        /// What.
        target: DrainTarget,
        /// Drained or not.
        drained: bool,
    },
    /// A configuration reload: from now on Control serves `spec`'s nodes,
    /// providers, models and tunables, keeping every runtime state of what
    /// stays (owners, leases, health, queues, drains). See `fleet.rs`:
    /// removed providers and nodes take no new work and are let go of when
    /// what runs there ends; queued requests of a removed model end
    /// ([`Rejection::ModelRemoved`]); a capacity lowered below what is in
    /// flight cuts nothing and admits nothing until it is below again.
    Reconfigure(Box<ControlSpec>),
}

/// What [`Input::SetDrain`] drains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainTarget {
    /// Every provider of a node.
    Node(String),
    /// One provider.
    Provider(ProviderKey),
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The model is not configured (404).
    UnknownModel,
    /// No provider of the model serves the operation (400).
    UnsupportedOperation,
    /// The model's queue is full (429 with retry-after).
    QueueFull,
    /// No lease within the queue timeout (503 with retry-after).
    QueueTimeout,
    /// A reload removed its model (or its operation from the model) while
    /// it waited (503: the fleet changed under it).
    ModelRemoved,
    /// The model is configured without providers (`allow_no_providers`):
    /// 503 at once.
    NoProviders,
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Refused before dispatch.
    Rejected(Rejection),
    /// Its terminal arrived from the owning connection; the lease is released.
    Completed,
    /// Its lease was released without a terminal because the owning
    /// connection was fenced (F1) or superseded (R2).
    Lost,
    /// The client cancelled: while queued, or settled after dispatch.
    Cancelled,
}

/// H3: what the Edge adds to a validated, current, bound stall before routing
/// it downstream. Not replay approval; never `recovery_eligible`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The provider that stalled.
    pub provider_id: String,
    /// The validated probe health.
    pub provider_health: pb::ProviderHealth,
    /// Always `confirmed`.
    pub recovery_handoff: &'static str,
}

/// Why Control gave up on a dispatched request before its terminal
/// ([`Action::Abort`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortReason {
    /// No response started within the response-wait timeout (U6): the run
    /// is cancelled on its node and the client gets 504.
    ResponseWaitTimeout,
}

impl AbortReason {
    /// The error code the client sees.
    pub fn as_str(self) -> &'static str {
        match self {
            AbortReason::ResponseWaitTimeout => "response_wait_timeout",
        }
    }
}

/// An observation the shell logs or fans out; correctness never depends on
/// its delivery (F4, O2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// First ready of a generation (R3).
    NodeConnected {
        /// The node.
        node_id: String,
    },
    /// The ready owner was fenced (F1).
    NodeDisconnected {
        /// The node.
        node_id: String,
    },
    /// Passive health took a provider out of rotation.
    Ejected {
        /// The provider.
        provider: ProviderKey,
        /// The ejection.
        ejection: Ejection,
        /// The failures in a row that tipped it.
        consecutive_failures: u32,
    },
    /// An ejected provider is back in rotation.
    Readmitted {
        /// The provider.
        provider: ProviderKey,
        /// How.
        via: Readmission,
    },
    /// A request whose attempt failed before anything reached its client
    /// was dispatched again, to another provider (pre-commit failover).
    Failover {
        /// The request.
        request: RequestId,
        /// The provider that failed.
        from: ProviderKey,
        /// The provider of the new attempt.
        to: ProviderKey,
        /// The new attempt's number (2 for the first retry).
        attempt: u32,
    },
    /// A provider's runtime overlay changed (H4, H6).
    HealthTransition {
        /// The provider.
        provider: ProviderKey,
        /// True when it became unavailable, false when it recovered.
        unavailable: bool,
    },
}

/// A dispatch decision: send the request's run to `lease.conn`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    /// The request.
    pub request: RequestId,
    /// The lease taken for it.
    pub lease: ProviderLease,
    /// Tunnel or normalized run (U7).
    pub kind: DispatchKind,
    /// Effective stall timeout of the winning provider (W2).
    pub response_stall_timeout_ms: i64,
    /// The node's connection honours `ProviderTunnelRequest.strip_usage_chunk`:
    /// only then does a tunnel ask its provider for usage the client did
    /// not ask for.
    pub strips_usage_chunk: bool,
    /// The node's connection takes a tunnel's request body in pieces
    /// (`RegisterRequest.accepts_tunnel_body`): only then may an upload
    /// stream to it rather than go whole.
    pub accepts_tunnel_body: bool,
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send this `RegisterResponse` on `conn`.
    RegisterResponse {
        /// The connection.
        conn: ConnId,
        /// The response.
        response: pb::RegisterResponse,
    },
    /// Send this `NodeReadyResponse` on `conn`.
    ReadyResponse {
        /// The connection.
        conn: ConnId,
        /// The response.
        response: pb::NodeReadyResponse,
    },
    /// Close `conn` with `reason`.
    Close {
        /// The connection.
        conn: ConnId,
        /// Why.
        reason: CloseReason,
    },
    /// A request won a lease: build and send its run.
    Dispatch(Dispatch),
    /// Send `CancelRequest{run_id, reason}` on `conn` (U6).
    SendCancel {
        /// The connection that runs it.
        conn: ConnId,
        /// The run.
        run_id: String,
        /// Why.
        reason: CancelReason,
    },
    /// Send a CAPABILITIES recovery probe on `conn` (H6).
    SendCommand {
        /// The connection.
        conn: ConnId,
        /// The command.
        command: pb::NodeCommandRequest,
    },
    /// A validated current bound stall: route it downstream with this
    /// handoff (H3).
    StallHandoff {
        /// The request.
        request: RequestId,
        /// What to add.
        handoff: Handoff,
    },
    /// Tell the client of `request` that Control gave up on it; its run
    /// was cancelled (a [`Action::SendCancel`] precedes this) and its lease
    /// settles on the terminal or at the cancel-settle deadline, ending in
    /// [`Action::Done`].
    Abort {
        /// The request.
        request: RequestId,
        /// Why.
        reason: AbortReason,
    },
    /// The request ended; its lease (if any) is released.
    Done {
        /// The request.
        request: RequestId,
        /// How.
        outcome: Outcome,
    },
    /// An observation event.
    Event(Event),
    /// In a cluster: write `node_id`'s owner key for `conn` on this Edge's
    /// etcd lease and report the revision ([`Input::OwnershipGranted`]) or
    /// the failure ([`Input::OwnershipFailed`]).
    ClaimOwnership {
        /// The registering connection.
        conn: ConnId,
        /// The node id.
        node_id: String,
    },
    /// In a cluster: delete `node_id`'s owner key if its `mod_revision` is
    /// still `revision` (this Edge's owner went away; a newer owner's key
    /// is never touched).
    ReleaseOwnership {
        /// The node id.
        node_id: String,
        /// The generation that ended.
        revision: u64,
    },
}

/// O1 counters, cumulative.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Stall evidence accepted (validated, current, bound).
    pub health_evidence_accepted: u64,
    /// Stall evidence rejected (mismatched, malformed, unbound).
    pub health_evidence_rejected: u64,
    /// Overlay set (H4).
    pub health_transitions_unavailable: u64,
    /// Overlay cleared (H6).
    pub health_transitions_available: u64,
    /// Stalled requests with a confirmed handoff.
    pub recovery_eligible: u64,
    /// Stalled requests without one.
    pub recovery_ineligible: u64,
    /// CAPABILITIES answers that cleared an overlay.
    pub recovery_probe_recovered: u64,
    /// CAPABILITIES answers that changed nothing.
    pub recovery_probe_unchanged: u64,
    /// Dispatched requests cancelled because no response started in time
    /// (U6).
    pub response_wait_timeouts: u64,
    /// Failed attempts held against their provider, by
    /// [`FailureReason::ALL`] index.
    pub attempt_failures: [u64; 5],
    /// Ejections, by the [`FailureReason::ALL`] index of the failure that
    /// tipped them.
    pub ejections: [u64; 5],
    /// Ejections not made: the model's share of ejected providers was
    /// reached.
    pub ejections_suppressed: u64,
    /// Re-admissions when the ejection time was over.
    pub readmissions_timer: u64,
    /// Re-admissions on a fresh `available` CAPABILITIES answer.
    pub readmissions_probe: u64,
    /// Retryable failures of a model with failover, before anything
    /// reached the client (eligible for another attempt).
    pub failover_eligible: u64,
    /// Retryable failures after the response was committed (not eligible).
    pub failover_ineligible: u64,
    /// New attempts dispatched to another provider.
    pub failover_retried: u64,
    /// Retried requests whose later attempt answered.
    pub failover_recovered: u64,
    /// Eligible failures not retried: `max_attempts` reached.
    pub failover_exhausted: u64,
    /// Eligible failures not retried: no other candidate had a free slot.
    pub failover_no_candidate: u64,
    /// Requests whose node was fenced before their first byte, queued
    /// again for a candidate (their provider after a reconnect included).
    pub failover_requeued: u64,
    /// Eligible failures not retried: the request's response-wait deadline
    /// had passed.
    pub failover_deadline: u64,
    /// Requests sent to a node that closed with `Close(drained)` before it
    /// started them, dispatched again (not attempts).
    pub drain_redispatched: u64,
}

/// The Edge control state machine.
///
/// Every decision is indexed so its cost does not grow with the fleet:
/// each model keeps its candidates with a free slot ordered by load (a
/// dispatch takes the first), and its waiting requests in two arrival
/// queues, short and long (the pump looks at queue heads only); leases are
/// filed by connection (a fence touches only its own), timers by deadline.
#[derive(Debug)]
pub struct Control {
    /// Nodes in id order.
    nodes: Vec<NodeEntry>,
    node_index: FastMap<String, usize>,
    /// Providers in `ProviderKey` order (each node's a contiguous run).
    providers: Vec<ProviderState>,
    provider_index: FastMap<ProviderKey, usize>,
    models: Vec<ModelState>,
    model_index: FastMap<String, usize>,
    tunables: Tunables,
    /// Which node (index) each live connection registered (R1).
    bindings: FastMap<ConnId, usize>,
    /// Connections ordered closed whose close the shell has not reported
    /// yet: a late register on one is refused (R3: it must reconnect).
    closing: FastSet<ConnId>,
    /// Live leases by run id.
    leases: BTreeMap<String, LeaseEntry>,
    /// Run ids of the live leases, by the connection they were dispatched
    /// to (one connection owns one generation: R1, R2).
    leases_of: FastMap<ConnId, BTreeSet<String>>,
    /// Requests not yet done, by id (arrival order).
    pending: BTreeMap<RequestId, Pending>,
    /// Candidate sets and queues, by operation, of every model.
    lanes: Vec<LaneState>,
    /// The head of every non-empty queue: (request, lane, long).
    heads: BTreeSet<(RequestId, usize, bool)>,
    /// Queued requests by deadline, for timeouts.
    queue_deadlines: BTreeSet<(Instant, RequestId)>,
    /// Queued requests waiting for their preferred provider (affinity
    /// wait), not in their lane's queue until `until`.
    waiting: FastMap<RequestId, routing::Waiting>,
    /// The same, by provider, in arrival order.
    waiters: BTreeMap<usize, BTreeSet<RequestId>>,
    /// Ends of affinity waits.
    affinity_deadlines: BTreeSet<(Instant, RequestId)>,
    /// Cancel settlements by deadline.
    settle_deadlines: BTreeSet<(Instant, RequestId)>,
    /// Response-wait deadlines of dispatched requests (U6).
    response_deadlines: BTreeSet<(Instant, RequestId)>,
    /// Ends of ejections: (instant, provider index).
    ejection_deadlines: BTreeSet<(Instant, usize)>,
    /// The `now` of the input or timeout being handled.
    now: Option<Instant>,
    /// Recovery probes by due time: (instant, provider index).
    probe_deadlines: BTreeSet<(Instant, usize)>,
    /// Outstanding recovery probes.
    commands: FastMap<String, CommandRecord>,
    next_generation: u64,
    next_command: u64,
    counters: Counters,
    /// Who grants ownership of a node id: this process, or etcd.
    ownership: Ownership,
    /// In a cluster: connections whose ownership claim is in flight, with
    /// their node (index). Not bound yet: they own nothing until granted.
    claims: FastMap<ConnId, usize>,
    /// In a cluster: this Edge holds a live etcd lease (it may claim and
    /// keep ownership). Starts false: nothing registers before the first
    /// lease.
    cluster_up: bool,
    /// The shutdown drain began ([`Input::Drain`]).
    draining: bool,
    /// Nodes removed by a reload whose owner still runs something, by the
    /// end of their grace (`Tunables::retire_grace`): then they are closed
    /// whatever runs.
    retire_deadlines: BTreeSet<(Instant, String)>,
}

/// Who grants ownership of a node id ([`Control::clustered`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// This process alone: a registration is accepted at once, under the
    /// next value of a local counter (the single-Edge mode).
    Local,
    /// etcd: a registration becomes an [`Action::ClaimOwnership`]; it is
    /// accepted when the claim's revision comes back
    /// ([`Input::OwnershipGranted`]), and that revision is its generation,
    /// comparable across Edges.
    Cluster,
}

impl Control {
    /// A control state for `spec`; no node is connected.
    pub fn new(spec: ControlSpec) -> Self {
        let mut node_specs = spec.nodes;
        node_specs.sort_by(|a, b| a.id.cmp(&b.id));
        // Later duplicates of a node id are ignored (config validation
        // refuses them).
        node_specs.dedup_by(|b, a| a.id == b.id);
        let mut nodes = Vec::with_capacity(node_specs.len());
        let mut providers = Vec::new();
        for (n, node) in node_specs.into_iter().enumerate() {
            let mut specs = node.providers.clone();
            specs.sort_by(|a, b| a.id.cmp(&b.id));
            specs.dedup_by(|b, a| a.id == b.id);
            let first = providers.len();
            for p in specs {
                providers.push(ProviderState {
                    key_hash: routing::provider_hash(&node.id, &p.id),
                    key: ProviderKey {
                        node_id: node.id.as_str().into(),
                        provider_id: p.id.as_str().into(),
                    },
                    node: n,
                    spec: p,
                    in_flight: 0,
                    long_in_flight: 0,
                    last_seq: None,
                    overlay: None,
                    next_probe: None,
                    outlier: OutlierState::default(),
                    pools: Vec::new(),
                    indexed: None,
                    drained: false,
                    removed: false,
                });
            }
            nodes.push(NodeEntry {
                spec: node,
                owner: None,
                providers: first..providers.len(),
                version: String::new(),
                offline_since: None,
                observed_revision: 0,
                drained: false,
                removed: false,
            });
        }
        let node_index = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.spec.id.clone(), i))
            .collect();
        let provider_index: FastMap<ProviderKey, usize> = providers
            .iter()
            .enumerate()
            .map(|(i, p)| (p.key.clone(), i))
            .collect();
        let mut models = Vec::with_capacity(spec.models.len());
        let mut model_index = FastMap::default();
        let mut lanes = Vec::new();
        for m in spec.models {
            if model_index.contains_key(&m.name) {
                continue;
            }
            let index = models.len();
            // One lane per distinct set of pool positions serving an
            // operation, apart for an operation whose normalized-run members
            // serve it only on Nodes that run it (their candidacy there
            // follows their Node, not the other lanes').
            let mut model_lanes: Vec<((Vec<usize>, bool), usize)> = Vec::new();
            let mut lane_of = [None; Operation::ALL.len()];
            for (o, &op) in Operation::ALL.iter().enumerate() {
                let members: Vec<usize> = m
                    .providers
                    .iter()
                    .enumerate()
                    .filter(|(_, key)| {
                        provider_index
                            .get(*key)
                            .is_some_and(|&p| providers[p].spec.operations.contains(op))
                    })
                    .map(|(position, _)| position)
                    .collect();
                if members.is_empty() {
                    continue;
                }
                let needs_embedding_runs = op.needs_embedding_runs()
                    && members.iter().any(|&position| {
                        provider_index
                            .get(&m.providers[position])
                            .is_some_and(|&p| providers[p].spec.kind == DispatchKind::Normalized)
                    });
                let members = (members, needs_embedding_runs);
                if let Some((_, lane)) = model_lanes.iter().find(|(set, _)| *set == members) {
                    lane_of[o] = Some(*lane);
                    continue;
                }
                let lane = lanes.len();
                for &position in &members.0 {
                    if let Some(&p) = provider_index.get(&m.providers[position]) {
                        providers[p].pools.push((lane, position));
                    }
                }
                lanes.push(LaneState {
                    model: index,
                    free: BTreeSet::new(),
                    free_long: BTreeSet::new(),
                    queued: fair::FairQueue::new(),
                    queued_long: fair::FairQueue::new(),
                    needs_embedding_runs,
                    members: members
                        .0
                        .iter()
                        .filter_map(|&position| provider_index.get(&m.providers[position]).copied())
                        .collect(),
                });
                lane_of[o] = Some(lane);
                model_lanes.push((members, lane));
            }
            model_index.insert(m.name.clone(), index);
            models.push(ModelState {
                router: routing::Router::new(m.routing),
                spec: m,
                lanes: model_lanes.into_iter().map(|(_, lane)| lane).collect(),
                lane_of,
                removed: false,
            });
        }
        Self {
            nodes,
            node_index,
            providers,
            provider_index,
            models,
            model_index,
            lanes,
            tunables: spec.tunables,
            bindings: FastMap::default(),
            closing: FastSet::default(),
            leases: BTreeMap::new(),
            leases_of: FastMap::default(),
            pending: BTreeMap::new(),
            heads: BTreeSet::new(),
            queue_deadlines: BTreeSet::new(),
            waiting: FastMap::default(),
            waiters: BTreeMap::new(),
            affinity_deadlines: BTreeSet::new(),
            settle_deadlines: BTreeSet::new(),
            response_deadlines: BTreeSet::new(),
            ejection_deadlines: BTreeSet::new(),
            now: None,
            probe_deadlines: BTreeSet::new(),
            commands: FastMap::default(),
            next_generation: 0,
            next_command: 0,
            counters: Counters::default(),
            ownership: Ownership::Local,
            claims: FastMap::default(),
            cluster_up: false,
            draining: false,
            retire_deadlines: BTreeSet::new(),
        }
    }

    /// A control state for `spec` in a cluster: ownership of a node id is
    /// claimed in etcd ([`Action::ClaimOwnership`]), generations are the
    /// claims' revisions, and nothing registers until
    /// [`Input::ClusterSession`] says this Edge holds an etcd lease.
    pub fn clustered(spec: ControlSpec) -> Self {
        Self {
            ownership: Ownership::Cluster,
            ..Self::new(spec)
        }
    }

    /// Who grants ownership of node ids here.
    pub fn ownership(&self) -> Ownership {
        self.ownership
    }

    /// Feeds one input at `now`; appends what the shell must do to `out`.
    /// In debug builds, checks the step and every invariant after it (the
    /// `invariants` room).
    pub fn handle(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        let step = cfg!(debug_assertions).then(|| {
            let submitted = match &input {
                Input::Submit { request, .. } => Some(*request),
                _ => None,
            };
            self.begin_step(submitted, out)
        });
        self.now = Some(now);
        match input {
            Input::Register {
                conn,
                tls_name,
                node_id,
            } => self.on_register(conn, &tls_name, &node_id, out),
            Input::Ready { conn, node_id } => self.on_ready(conn, &node_id, out),
            Input::Closed { conn, drained } => self.on_closed(conn, drained, out),
            Input::NodeVersion {
                conn,
                version,
                strips_usage_chunk,
                runs_embeddings,
                accepts_tunnel_body,
            } => self.on_node_version(
                conn,
                version,
                strips_usage_chunk,
                runs_embeddings,
                accepts_tunnel_body,
                out,
            ),
            submit @ Input::Submit { .. } => self.on_submit(now, submit, out),
            Input::Cancel { request, reason } => self.on_cancel(now, request, reason, out),
            Input::Undeliverable { request } => self.on_undeliverable(request, out),
            Input::Terminal(t) => self.on_terminal(now, t, out),
            Input::Responded { conn, run_id } => self.on_responded(conn, &run_id),
            Input::Committed { conn, run_id } => self.on_committed(conn, &run_id),
            Input::CommandResult { conn, response } => self.on_command_result(conn, &response, out),
            Input::OwnershipGranted {
                conn,
                node_id,
                revision,
            } => self.on_ownership_granted(conn, &node_id, revision, out),
            Input::OwnershipFailed { conn } => self.on_ownership_failed(conn, out),
            Input::OwnerObserved {
                node_id,
                revision,
                deleted,
            } => self.on_owner_observed(&node_id, revision, deleted, out),
            Input::ClusterSession { up } => self.on_cluster_session(up, out),
            Input::Drain => self.draining = true,
            Input::NodeDraining { conn } => self.on_node_draining(conn),
            Input::SetDrain { target, drained } => self.on_set_drain(&target, drained, out),
            Input::Reconfigure(spec) => self.on_reconfigure(*spec, out),
        }
        self.let_go_of_removed_nodes(out);
        self.let_go_of_idle_nodes(out);
        if let Some(step) = step {
            self.end_step(step, out, None);
        }
    }

    /// The earliest instant at which [`Control::handle_timeout`] has work:
    /// a queue deadline, a cancel settlement, a response-wait deadline or a
    /// recovery probe.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let queue = self.queue_deadlines.first().map(|(t, _)| *t);
        let settle = self.settle_deadlines.first().map(|(t, _)| *t);
        let response = self.response_deadlines.first().map(|(t, _)| *t);
        let probe = self.probe_deadlines.first().map(|(t, _)| *t);
        let ejection = self.ejection_deadlines.first().map(|(t, _)| *t);
        let retire = self.retire_deadlines.first().map(|(t, _)| *t);
        let affinity = self.affinity_deadlines.first().map(|(t, _)| *t);
        [queue, settle, response, probe, ejection, retire, affinity]
            .into_iter()
            .flatten()
            .min()
    }

    /// Runs every timer due at `now` (deadlines at or before `now`). In
    /// debug builds, checks the step and every invariant after it.
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Action>) {
        let step = cfg!(debug_assertions).then(|| self.begin_step(None, out));
        self.now = Some(now);
        while let Some(&(at, request)) = self.queue_deadlines.first() {
            if at > now {
                break;
            }
            self.queue_deadlines.remove(&(at, request));
            if let Some(p) = self.pending.remove(&request) {
                if let Some(lane) = p.lane {
                    self.unqueue(request, lane, p.long);
                }
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Rejected(Rejection::QueueTimeout),
                });
            }
        }
        while let Some(&(at, request)) = self.response_deadlines.first() {
            if at > now {
                break;
            }
            self.response_deadlines.remove(&(at, request));
            self.on_response_wait_timeout(now, request, out);
        }
        let mut released = self.end_affinity_waits(now);
        while let Some(&(at, request)) = self.settle_deadlines.first() {
            if at > now {
                break;
            }
            self.settle_deadlines.remove(&(at, request));
            if let Some(Pending {
                state: RequestState::CancelPending { run_id, .. },
                ..
            }) = self.pending.remove(&request)
            {
                self.release(&run_id);
                released = true;
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Cancelled,
                });
            }
        }
        // Ejections over: back into rotation, in `ProviderKey` order.
        let mut readmit = Vec::new();
        while let Some(&(at, p)) = self.ejection_deadlines.first() {
            if at > now {
                break;
            }
            self.ejection_deadlines.remove(&(at, p));
            readmit.push(p);
        }
        readmit.sort_unstable();
        for &p in &readmit {
            self.readmit(now, p, Readmission::Timer, out);
        }
        released |= !readmit.is_empty();
        // Due probes go out in `ProviderKey` order.
        let mut due = Vec::new();
        while let Some(&(at, p)) = self.probe_deadlines.first() {
            if at > now {
                break;
            }
            self.probe_deadlines.remove(&(at, p));
            self.providers[p].next_probe = None;
            due.push(p);
        }
        due.sort_unstable();
        for p in due {
            self.send_recovery_probe(now, p, out);
        }
        if released {
            self.pump(out);
        }
        self.retire_due_nodes(now, out);
        // A settled cancel may have ended a removed node's last run.
        self.let_go_of_removed_nodes(out);
        self.let_go_of_idle_nodes(out);
        if let Some(step) = step {
            self.end_step(step, out, Some(now));
        }
    }
}
