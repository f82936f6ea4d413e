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
//! Invariants (checked by the deterministic simulation in
//! `tests/control_sim.rs` after every step):
//! - A connection owns at most one node id (R1); a node id has at most one
//!   owner connection, tagged with an Edge-internal generation (R2, R5).
//! - Only a `Ready` owner is a dispatch candidate or reported connected (R4,
//!   X6).
//! - Every lease is released exactly once: on its terminal from the owning
//!   connection, on fencing of its generation, or on cancel settlement (F1).
//!   `in_flight` of a provider equals its live leases and never exceeds its
//!   capacity; likewise for long-context leases.
//! - Every submitted request ends exactly once ([`Action::Done`]) and no
//!   request waits past its deadline.
//! - Stale inputs (from a connection that no longer owns its node id, or for
//!   a run it does not carry) change nothing and emit nothing (F2).
//! - The overlay changes only as H4 (set) and H6 (clear) allow.

pub mod attempt;
pub mod outlier;
mod spec;

pub use spec::{
    control_spec, outlier_policy, ControlSpec, ModelSpec, NodeSpec, Operations, ProviderSpec,
    Tunables,
};

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use iop_wire::pb;

use crate::control::outlier::{Ejection, OutlierPolicy, OutlierState, Readmission};

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
}

/// Shell-assigned identity of one accepted node connection, unique for the
/// life of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Edge-internal connection generation of a node id (R2, R5); never on the
/// wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// Shell-assigned identity of one client request, unique and increasing for
/// the life of the process (arrival order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl RequestId {
    /// The run id a dispatch of this request carries on the wire.
    pub fn run_id(self) -> String {
        format!("run-{}", self.0)
    }

    /// The run id of its `attempt`-th attempt (1-based): the first is
    /// [`RequestId::run_id`], a retry `run-<id>.<attempt>`.
    pub fn attempt_run_id(self, attempt: u32) -> String {
        if attempt <= 1 {
            self.run_id()
        } else {
            format!("run-{}.{attempt}", self.0)
        }
    }
}

/// Identity of a provider resource: `(node id, provider id)`. Shared
/// strings: every lease and dispatch of the provider carries its key, and
/// a clone is a reference count, not an allocation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderKey {
    /// Owning node.
    pub node_id: Arc<str>,
    /// Provider id, unique per node.
    pub provider_id: Arc<str>,
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

/// A client operation a provider may serve (U3): the profile operations
/// that carry inference requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operation {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
}

impl Operation {
    /// Every operation, in this order (the bit order of [`Operations`]).
    pub const ALL: [Operation; 4] = [
        Operation::ChatCompletions,
        Operation::Responses,
        Operation::Messages,
        Operation::CountTokens,
    ];

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// Stall evidence carried by a terminal (W4, W5), as the shell decoded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallEvidence {
    /// Probe health (available / unavailable / unknown).
    pub health: pb::ProviderHealth,
    /// Its paired classification.
    pub classification: pb::LivenessClassification,
    /// The session's observation sequence, when the session was bound (W7).
    pub seq: Option<u64>,
}

impl StallEvidence {
    /// Decodes the stall evidence of a terminal's `ExecutionFailure`.
    pub fn from_failure(failure: &pb::ExecutionFailure) -> Option<Self> {
        if failure.failure_code != "response_stalled" {
            return None;
        }
        let evidence = failure.provider_health.as_ref()?;
        Some(Self {
            health: pb::ProviderHealth::try_from(evidence.health)
                .unwrap_or(pb::ProviderHealth::Unspecified),
            classification: pb::LivenessClassification::try_from(evidence.liveness_classification)
                .unwrap_or(pb::LivenessClassification::Unspecified),
            seq: failure.health_observation_seq,
        })
    }

    /// Whether health and classification form one of the three allowed pairs
    /// (W5); anything else is malformed evidence.
    pub fn is_well_formed(&self) -> bool {
        use pb::LivenessClassification as L;
        use pb::ProviderHealth as H;
        matches!(
            (self.health, self.classification),
            (H::Available, L::RequestStalled)
                | (H::Unavailable, L::ProviderUnhealthy)
                | (H::Unknown, L::HealthUnknown)
        )
    }
}

/// Why an attempt counts against its provider's health (outlier
/// detection): the provider is unreachable or failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureReason {
    /// The Node could not connect (refused, reset, timed out:
    /// `provider_unreachable`) or its TLS handshake with the provider
    /// failed (`provider_tls`): nothing reached the provider.
    ConnectFailure,
    /// The provider's response broke off before it started
    /// (`provider_error` before any response head).
    ResetBeforeResponse,
    /// The provider answered 5xx and nothing reached the client yet.
    UpstreamStatus,
    /// The Node's stall watchdog ended the attempt (`response_stalled`).
    Stalled,
    /// No response started within the response-wait timeout (U6).
    ResponseWaitTimeout,
}

impl FailureReason {
    /// Every reason, in label order.
    pub const ALL: [FailureReason; 5] = [
        FailureReason::ConnectFailure,
        FailureReason::ResetBeforeResponse,
        FailureReason::UpstreamStatus,
        FailureReason::Stalled,
        FailureReason::ResponseWaitTimeout,
    ];

    /// Its metric label and `/status` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::ConnectFailure => "connect_failure",
            FailureReason::ResetBeforeResponse => "reset_before_response",
            FailureReason::UpstreamStatus => "upstream_5xx",
            FailureReason::Stalled => "stalled",
            FailureReason::ResponseWaitTimeout => "response_wait_timeout",
        }
    }
}

/// How one attempt ended, as its node connection classified its frames
/// (`crate::control::attempt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptEnd {
    /// The provider answered: a response below 500, or a complete run.
    Answered,
    /// The provider is unreachable or failing: counts toward its ejection;
    /// another provider may take the request if nothing reached the client.
    Failed(FailureReason),
    /// The Node refused the attempt for a reason another provider would not
    /// share (its capacity gate full, the adapter or operation unknown
    /// there): another provider may take it; not held against this one.
    Refused,
    /// Anything else (cancelled, a request another provider would refuse
    /// too, a credential lease failure, C5): final, not counted.
    Other,
}

impl AttemptEnd {
    /// Whether another provider may take the request (when nothing reached
    /// the client).
    pub fn is_retryable(self) -> bool {
        matches!(self, AttemptEnd::Failed(_) | AttemptEnd::Refused)
    }
}

/// A terminal received from a node (H1): its reception identity is the
/// connection it arrived on, never a payload field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminal {
    /// The connection it arrived on.
    pub conn: ConnId,
    /// The run it ends.
    pub run_id: String,
    /// Typed adapter evidence (H2).
    pub adapter: String,
    /// Typed target evidence (H2).
    pub target: String,
    /// Stall evidence, when the terminal is a `response_stalled` error.
    pub stall: Option<StallEvidence>,
    /// How the attempt ended.
    pub end: AttemptEnd,
    /// Whether a byte of its response reached (or is about to reach) the
    /// client: then it is never retried.
    pub committed: bool,
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
    /// (diagnostic only; after its `Register`), and whether it strips a
    /// usage chunk the Edge asked for (`RegisterRequest.strips_usage_chunk`,
    /// copied into its dispatches).
    NodeVersion {
        /// The connection.
        conn: ConnId,
        /// `RegisterRequest.node_version`.
        version: String,
        /// `RegisterRequest.strips_usage_chunk`.
        strips_usage_chunk: bool,
    },
    /// `conn` closed, failed, or timed out its heartbeat (F1, F2).
    Closed {
        /// The connection.
        conn: ConnId,
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
    /// A byte of run `run_id`'s response reached the client's route (the
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
    pub lease: Lease,
    /// Tunnel or normalized run (U7).
    pub kind: DispatchKind,
    /// Effective stall timeout of the winning provider (W2).
    pub response_stall_timeout_ms: i64,
    /// The node's connection honours `ProviderTunnelRequest.strip_usage_chunk`:
    /// only then does a tunnel ask its provider for usage the client did
    /// not ask for.
    pub strips_usage_chunk: bool,
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
        reason: &'static str,
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
    /// When its registration was accepted (the generation's start).
    registered_at: Option<Instant>,
    /// When it became dispatch-ready.
    ready_at: Option<Instant>,
    /// It strips a usage chunk the Edge asked for (`Input::NodeVersion`).
    strips_usage_chunk: bool,
}

#[derive(Debug)]
struct NodeEntry {
    spec: NodeSpec,
    owner: Option<Owner>,
    /// Its providers: a contiguous run of `Control::providers`, which is
    /// in `ProviderKey` (node id first) order.
    providers: Range<usize>,
    /// The software version its current owner reported (diagnostic).
    version: String,
    /// When its last owner's connection closed, while it has none.
    offline_since: Option<Instant>,
}

impl NodeEntry {
    fn ready_owner(&self) -> Option<Owner> {
        self.owner.filter(|o| o.state == OwnerState::Ready)
    }
}

/// A provider's lease occupancy, ordered by load fraction
/// `in_flight / capacity` (exactly, by cross multiplication), so equal
/// fractions compare equal whatever their terms.
#[derive(Debug, Clone, Copy)]
struct Load {
    in_flight: u32,
    capacity: u32,
}

impl Ord for Load {
    fn cmp(&self, other: &Self) -> Ordering {
        let lhs = u64::from(self.in_flight) * u64::from(other.capacity);
        let rhs = u64::from(other.in_flight) * u64::from(self.capacity);
        lhs.cmp(&rhs)
    }
}

impl PartialOrd for Load {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Load {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Load {}

/// One provider in one model's candidate index: least loaded first, ties
/// to the earlier pool position (the configured order). A position holds
/// one provider, so `(load, position)` is unique within a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    load: Load,
    position: usize,
    provider: usize,
}

/// Where a provider sits in the candidate indexes of its models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Indexed {
    /// The exact occupancy it was filed under (the key to remove it by).
    in_flight: u32,
    /// Filed among the candidates for long-context requests too.
    long: bool,
}

#[derive(Debug)]
struct ProviderState {
    key: ProviderKey,
    /// Its node (index into `Control::nodes`).
    node: usize,
    spec: ProviderSpec,
    in_flight: u32,
    long_in_flight: u32,
    /// Highest health observation sequence applied to this binding, and the
    /// generation it belongs to.
    last_seq: Option<(Generation, u64)>,
    /// The runtime unavailable overlay, tagged with the generation it
    /// belongs to (H4, H5).
    overlay: Option<Generation>,
    /// When the next recovery probe is due, while overlaid or ejected.
    next_probe: Option<Instant>,
    /// Passive health.
    outlier: OutlierState,
    /// Every lane it is filed in: (lane index, position in the model's
    /// pool).
    pools: Vec<(usize, usize)>,
    /// Its entry in those pools' candidate indexes, while it is a
    /// candidate with a free slot.
    indexed: Option<Indexed>,
}

impl ProviderState {
    fn reset_health(&mut self) {
        self.overlay = None;
        self.last_seq = None;
    }

    fn is_fresh(&self, generation: Generation, seq: u64) -> bool {
        match self.last_seq {
            Some((g, last)) if g == generation => seq > last,
            _ => true,
        }
    }
}

/// An immutable record of one dispatched request's claim on a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The request it serves.
    pub request: RequestId,
    /// The run id the request was dispatched under.
    pub run_id: String,
    /// Provider it occupies.
    pub provider: ProviderKey,
    /// The connection it was dispatched to.
    pub conn: ConnId,
    /// The generation of that connection's ownership.
    pub generation: Generation,
    /// Adapter evidence expected on the terminal (H2).
    pub adapter: Arc<str>,
    /// Target evidence expected on the terminal (H2).
    pub target: Arc<str>,
    /// Whether it holds a long-context slot.
    pub long: bool,
}

/// A live lease and the provider index it occupies.
#[derive(Debug)]
struct LeaseEntry {
    lease: Lease,
    provider: usize,
}

#[derive(Debug, Clone)]
enum RequestState {
    Queued {
        deadline: Instant,
    },
    Dispatched {
        run_id: String,
        /// The response-wait deadline, until the response starts (U6).
        response_by: Option<Instant>,
        /// A byte of the response reached the client: never retried.
        committed: bool,
    },
    CancelPending {
        run_id: String,
        settle_at: Instant,
    },
}

#[derive(Debug, Clone)]
struct Pending {
    /// Index into `Control::models`.
    model: usize,
    /// Index into `Control::lanes`: where it queues.
    lane: usize,
    long: bool,
    state: RequestState,
    /// Attempts dispatched so far (0 while queued).
    attempts: u32,
    /// The providers they went to (indexes into `Control::providers`).
    tried: Vec<usize>,
    /// Its response-wait deadline, set at its first dispatch: every
    /// attempt must start its response before it (U6).
    response_deadline: Option<Instant>,
}

impl Pending {
    fn new(model: usize, lane: usize, long: bool, state: RequestState) -> Self {
        Self {
            model,
            lane,
            long,
            state,
            attempts: 0,
            tried: Vec::new(),
            response_deadline: None,
        }
    }
}

/// One served model: its spec and its lanes.
#[derive(Debug)]
struct ModelState {
    spec: ModelSpec,
    /// Its lanes (indexes into `Control::lanes`).
    lanes: Vec<usize>,
    /// The lane of each operation ([`Operation::ALL`] order); `None` when
    /// no provider of the pool serves it.
    lane_of: [Option<usize>; Operation::ALL.len()],
}

/// The candidates and queues of the operations of one model that share
/// one candidate set: a provider is filed in a lane exactly when it serves
/// every operation of the lane. A model whose providers all serve the same
/// operations has one lane; one mixing an Ollama-native provider with
/// OpenAI-compatible ones has two (chat, over all of them; the others,
/// over the OpenAI-compatible ones).
#[derive(Debug)]
struct LaneState {
    /// Its model (index into `Control::models`).
    model: usize,
    /// Live providers of the lane with a free slot (X6, H4).
    free: BTreeSet<Candidate>,
    /// Those of them with a free long-context slot too.
    free_long: BTreeSet<Candidate>,
    /// Requests waiting for a slot, by arrival.
    queued: BTreeSet<RequestId>,
    /// Long-context requests waiting for a long slot, by arrival.
    queued_long: BTreeSet<RequestId>,
}

impl LaneState {
    fn candidates(&self, long: bool) -> &BTreeSet<Candidate> {
        if long {
            &self.free_long
        } else {
            &self.free
        }
    }

    fn queue(&mut self, long: bool) -> &mut BTreeSet<RequestId> {
        if long {
            &mut self.queued_long
        } else {
            &mut self.queued
        }
    }

    fn queued_count(&self) -> usize {
        self.queued.len() + self.queued_long.len()
    }
}

#[derive(Debug, Clone)]
struct CommandRecord {
    node_id: String,
    provider: ProviderKey,
    conn: ConnId,
    generation: Generation,
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
    node_index: HashMap<String, usize>,
    /// Providers in `ProviderKey` order (each node's a contiguous run).
    providers: Vec<ProviderState>,
    provider_index: HashMap<ProviderKey, usize>,
    models: Vec<ModelState>,
    model_index: HashMap<String, usize>,
    tunables: Tunables,
    /// Which node (index) each live connection registered (R1).
    bindings: HashMap<ConnId, usize>,
    /// Connections ordered closed whose close the shell has not reported
    /// yet: a late register on one is refused (R3: it must reconnect).
    closing: HashSet<ConnId>,
    /// Live leases by run id.
    leases: BTreeMap<String, LeaseEntry>,
    /// Run ids of the live leases, by the connection they were dispatched
    /// to (one connection owns one generation: R1, R2).
    leases_of: HashMap<ConnId, BTreeSet<String>>,
    /// Requests not yet done, by id (arrival order).
    pending: BTreeMap<RequestId, Pending>,
    /// Candidate sets and queues, by operation, of every model.
    lanes: Vec<LaneState>,
    /// The head of every non-empty queue: (request, lane, long).
    heads: BTreeSet<(RequestId, usize, bool)>,
    /// Queued requests by deadline, for timeouts.
    queue_deadlines: BTreeSet<(Instant, RequestId)>,
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
    commands: HashMap<String, CommandRecord>,
    next_generation: u64,
    next_command: u64,
    counters: Counters,
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
                });
            }
            nodes.push(NodeEntry {
                spec: node,
                owner: None,
                providers: first..providers.len(),
                version: String::new(),
                offline_since: None,
            });
        }
        let node_index = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.spec.id.clone(), i))
            .collect();
        let provider_index: HashMap<ProviderKey, usize> = providers
            .iter()
            .enumerate()
            .map(|(i, p)| (p.key.clone(), i))
            .collect();
        let mut models = Vec::with_capacity(spec.models.len());
        let mut model_index = HashMap::new();
        let mut lanes = Vec::new();
        for m in spec.models {
            if model_index.contains_key(&m.name) {
                continue;
            }
            let index = models.len();
            // One lane per distinct set of pool positions serving an
            // operation.
            let mut model_lanes: Vec<(Vec<usize>, usize)> = Vec::new();
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
                if let Some((_, lane)) = model_lanes.iter().find(|(set, _)| *set == members) {
                    lane_of[o] = Some(*lane);
                    continue;
                }
                let lane = lanes.len();
                for &position in &members {
                    if let Some(&p) = provider_index.get(&m.providers[position]) {
                        providers[p].pools.push((lane, position));
                    }
                }
                lanes.push(LaneState {
                    model: index,
                    free: BTreeSet::new(),
                    free_long: BTreeSet::new(),
                    queued: BTreeSet::new(),
                    queued_long: BTreeSet::new(),
                });
                lane_of[o] = Some(lane);
                model_lanes.push((members, lane));
            }
            model_index.insert(m.name.clone(), index);
            models.push(ModelState {
                spec: m,
                lanes: model_lanes.into_iter().map(|(_, lane)| lane).collect(),
                lane_of,
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
            bindings: HashMap::new(),
            closing: HashSet::new(),
            leases: BTreeMap::new(),
            leases_of: HashMap::new(),
            pending: BTreeMap::new(),
            heads: BTreeSet::new(),
            queue_deadlines: BTreeSet::new(),
            settle_deadlines: BTreeSet::new(),
            response_deadlines: BTreeSet::new(),
            ejection_deadlines: BTreeSet::new(),
            now: None,
            probe_deadlines: BTreeSet::new(),
            commands: HashMap::new(),
            next_generation: 0,
            next_command: 0,
            counters: Counters::default(),
        }
    }

    /// Feeds one input at `now`; appends what the shell must do to `out`.
    pub fn handle(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        self.now = Some(now);
        match input {
            Input::Register {
                conn,
                tls_name,
                node_id,
            } => self.on_register(conn, &tls_name, &node_id, out),
            Input::Ready { conn, node_id } => self.on_ready(conn, &node_id, out),
            Input::Closed { conn } => self.on_closed(conn, out),
            Input::NodeVersion {
                conn,
                version,
                strips_usage_chunk,
            } => self.on_node_version(conn, version, strips_usage_chunk),
            Input::Submit {
                request,
                model,
                operation,
                long,
            } => self.on_submit(now, request, &model, operation, long, out),
            Input::Cancel { request, reason } => self.on_cancel(now, request, reason, out),
            Input::Undeliverable { request } => self.on_undeliverable(request, out),
            Input::Terminal(t) => self.on_terminal(now, t, out),
            Input::Responded { conn, run_id } => self.on_responded(conn, &run_id),
            Input::Committed { conn, run_id } => self.on_committed(conn, &run_id),
            Input::CommandResult { conn, response } => self.on_command_result(conn, &response, out),
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
        [queue, settle, response, probe, ejection]
            .into_iter()
            .flatten()
            .min()
    }

    /// Runs every timer due at `now` (deadlines at or before `now`).
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Action>) {
        self.now = Some(now);
        while let Some(&(at, request)) = self.queue_deadlines.first() {
            if at > now {
                break;
            }
            self.queue_deadlines.remove(&(at, request));
            if let Some(p) = self.pending.remove(&request) {
                self.unqueue(request, p.lane, p.long);
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
        let mut released = false;
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
    }

    // ---- indexes --------------------------------------------------------

    /// Whether provider `p` is a live candidate with a free slot: enabled,
    /// its node's ready generation, no unavailable overlay of that
    /// generation (X6, H4), not ejected, a lease free.
    fn has_free_slot(&self, p: usize) -> bool {
        let state = &self.providers[p];
        state.spec.enabled
            && state.outlier.ejection().is_none()
            && state.in_flight < state.spec.capacity
            && self.nodes[state.node]
                .ready_owner()
                .is_some_and(|owner| state.overlay != Some(owner.generation))
    }

    /// Files provider `p` in (or takes it out of) the candidate indexes of
    /// its models after anything that decides candidacy changed: its
    /// occupancy, its overlay, its node's owner.
    fn refresh(&mut self, p: usize) {
        let want = self.has_free_slot(p).then(|| {
            let state = &self.providers[p];
            Indexed {
                in_flight: state.in_flight,
                long: state.long_in_flight < state.spec.long_context_capacity,
            }
        });
        let state = &mut self.providers[p];
        let had = state.indexed;
        if had == want {
            return;
        }
        state.indexed = want;
        let capacity = state.spec.capacity;
        let load = |in_flight| Load {
            in_flight,
            capacity,
        };
        for &(lane, position) in &state.pools {
            let model = &mut self.lanes[lane];
            if let Some(old) = had {
                let entry = Candidate {
                    load: load(old.in_flight),
                    position,
                    provider: p,
                };
                model.free.remove(&entry);
                if old.long {
                    model.free_long.remove(&entry);
                }
            }
            if let Some(new) = want {
                let entry = Candidate {
                    load: load(new.in_flight),
                    position,
                    provider: p,
                };
                model.free.insert(entry);
                if new.long {
                    model.free_long.insert(entry);
                }
            }
        }
    }

    fn refresh_node(&mut self, node: usize) {
        for p in self.nodes[node].providers.clone() {
            self.refresh(p);
        }
    }

    /// Sets when provider `p`'s next recovery probe is due.
    fn set_next_probe(&mut self, p: usize, at: Option<Instant>) {
        if let Some(old) = self.providers[p].next_probe {
            self.probe_deadlines.remove(&(old, p));
        }
        self.providers[p].next_probe = at;
        if let Some(at) = at {
            self.probe_deadlines.insert((at, p));
        }
    }

    /// Clears provider `p`'s overlay, sequence and probe (F3, H5).
    fn reset_health(&mut self, p: usize) {
        self.providers[p].reset_health();
        self.set_next_probe(p, None);
    }

    /// Takes `request` out of its lane's queue.
    fn unqueue(&mut self, request: RequestId, model: usize, long: bool) {
        let queue = self.lanes[model].queue(long);
        let was_head = queue.first() == Some(&request);
        if !queue.remove(&request) || !was_head {
            return;
        }
        let next = queue.first().copied();
        self.heads.remove(&(request, model, long));
        if let Some(next) = next {
            self.heads.insert((next, model, long));
        }
    }

    /// Puts `request` at the end of its lane's queue.
    fn enqueue(&mut self, request: RequestId, model: usize, long: bool) {
        let queue = self.lanes[model].queue(long);
        let old_head = queue.first().copied();
        queue.insert(request);
        let head = queue.first().copied();
        if head != old_head {
            if let Some(old) = old_head {
                self.heads.remove(&(old, model, long));
            }
            if let Some(new) = head {
                self.heads.insert((new, model, long));
            }
        }
    }

    // ---- registry ---------------------------------------------------------

    /// Orders `conn` closed and treats it as closed from this step on: a
    /// connection Control has let go of never becomes or stays an owner,
    /// even if more of its frames arrive before the shell reports the close.
    fn close_conn(&mut self, conn: ConnId, reason: &'static str, out: &mut Vec<Action>) {
        out.push(Action::Close { conn, reason });
        if self.generation_of(conn).is_some() {
            // The current owner: released now, fenced if it was ready.
            self.on_closed(conn, out);
        }
        // Otherwise it already owns nothing (rejected or superseded); its
        // binding stays so late frames get an accurate reason.
        self.closing.insert(conn);
    }

    fn on_register(&mut self, conn: ConnId, tls_name: &str, node_id: &str, out: &mut Vec<Action>) {
        let reject = |reason: String, out: &mut Vec<Action>| {
            out.push(Action::RegisterResponse {
                conn,
                response: pb::RegisterResponse {
                    accepted: false,
                    reason,
                    config: None,
                },
            });
        };
        if let Some(&bound) = self.bindings.get(&conn) {
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
            return self.close_conn(conn, "registration_rejected", out);
        }
        let Some(&n) = self.node_index.get(node_id) else {
            reject(
                format!("node `{node_id}` is not configured at this edge"),
                out,
            );
            return self.close_conn(conn, "registration_rejected", out);
        };
        self.next_generation += 1;
        let generation = Generation(self.next_generation);
        let node = &mut self.nodes[n];
        let previous = node.owner.replace(Owner {
            conn,
            generation,
            state: OwnerState::Pending,
            registered_at: self.now,
            ready_at: None,
            strips_usage_chunk: false,
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
            },
        });
        if let Some(old) = previous {
            // R2: the older connection is fenced and closed.
            if old.state == OwnerState::Ready {
                self.fence(n, old, out);
            }
            self.close_conn(old.conn, "superseded", out);
        }
        // A pending owner offers no candidate.
        self.refresh_node(n);
    }

    fn on_ready(&mut self, conn: ConnId, node_id: &str, out: &mut Vec<Action>) {
        let not_ready = |this: &mut Self, reason: &str, out: &mut Vec<Action>| {
            out.push(Action::ReadyResponse {
                conn,
                response: pb::NodeReadyResponse {
                    ready: false,
                    reason: reason.to_string(),
                },
            });
            this.close_conn(conn, "not_ready", out);
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

    fn on_node_version(&mut self, conn: ConnId, version: String, strips_usage_chunk: bool) {
        let Some(&n) = self.bindings.get(&conn) else {
            return;
        };
        let node = &mut self.nodes[n];
        if let Some(owner) = node.owner.as_mut().filter(|o| o.conn == conn) {
            owner.strips_usage_chunk = strips_usage_chunk;
            // Bounded: a diagnostic string, not a payload.
            node.version = version.chars().take(NODE_VERSION_CHARS_MAX).collect();
        }
    }

    fn on_closed(&mut self, conn: ConnId, out: &mut Vec<Action>) {
        self.closing.remove(&conn);
        let Some(n) = self.bindings.remove(&conn) else {
            return;
        };
        let owner = match self.nodes[n].owner {
            Some(owner) if owner.conn == conn => owner,
            // A stale connection: nothing changes (F2).
            _ => return,
        };
        self.nodes[n].owner = None;
        self.nodes[n].offline_since = self.now;
        self.nodes[n].version.clear();
        if owner.state == OwnerState::Ready {
            self.fence(n, owner, out);
        }
    }

    /// F1: in one step, release every lease of `owner`'s generation exactly
    /// once, take its resources offline, and re-evaluate the queue.
    /// Requests whose attempt was lost before anything reached their
    /// client go on to another provider instead (pre-commit failover).
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
        }
        // In arrival order, now that the fenced providers are no
        // candidates.
        lost.sort_unstable();
        for (request, provider) in lost {
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

    // ---- admission ---------------------------------------------------------

    fn on_submit(
        &mut self,
        now: Instant,
        request: RequestId,
        model: &str,
        operation: Operation,
        long: bool,
        out: &mut Vec<Action>,
    ) {
        if self.pending.contains_key(&request) {
            return;
        }
        let Some(&m) = self.model_index.get(model) else {
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(Rejection::UnknownModel),
            });
        };
        let Some(lane) = self.models[m].lane_of[operation as usize] else {
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(Rejection::UnsupportedOperation),
            });
        };
        if let Some(dispatch) = self.try_admit(request, lane, long, 1, &[]) {
            // Filed as queued for an instant: starting the attempt makes
            // it dispatched.
            let state = RequestState::Queued { deadline: now };
            self.pending
                .insert(request, Pending::new(m, lane, long, state));
            self.start_attempt(request, &dispatch);
            return out.push(Action::Dispatch(dispatch));
        }
        let spec = &self.models[m].spec;
        let (max_queue, queue_timeout) = (spec.max_queue as usize, spec.queue_timeout);
        if self.queued_count(m) >= max_queue {
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(Rejection::QueueFull),
            });
        }
        let deadline = now + queue_timeout;
        self.queue_deadlines.insert((deadline, request));
        self.enqueue(request, lane, long);
        self.pending.insert(
            request,
            Pending::new(m, lane, long, RequestState::Queued { deadline }),
        );
    }

    fn on_cancel(
        &mut self,
        now: Instant,
        request: RequestId,
        reason: CancelReason,
        out: &mut Vec<Action>,
    ) {
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        match p.state.clone() {
            RequestState::Queued { deadline } => {
                let (lane, long) = (p.lane, p.long);
                self.queue_deadlines.remove(&(deadline, request));
                self.pending.remove(&request);
                self.unqueue(request, lane, long);
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Cancelled,
                });
            }
            RequestState::Dispatched {
                run_id,
                response_by,
                ..
            } => {
                if let Some(at) = response_by {
                    self.response_deadlines.remove(&(at, request));
                }
                let settle_at = now + self.tunables.cancel_settle;
                p.state = RequestState::CancelPending {
                    run_id: run_id.clone(),
                    settle_at,
                };
                self.settle_deadlines.insert((settle_at, request));
                if let Some(entry) = self.leases.get(&run_id) {
                    out.push(Action::SendCancel {
                        conn: entry.lease.conn,
                        run_id,
                        reason,
                    });
                }
            }
            RequestState::CancelPending { .. } => {}
        }
    }

    fn on_undeliverable(&mut self, request: RequestId, out: &mut Vec<Action>) {
        let run_id = match self.pending.get(&request) {
            Some(Pending {
                state:
                    RequestState::Dispatched { run_id, .. } | RequestState::CancelPending { run_id, .. },
                ..
            }) => Some(run_id.clone()),
            // Queued again after its node was fenced (pre-commit failover)
            // while its client was still sending the lost attempt: a
            // heartbeat timeout shuts the socket before the shell reports
            // the close, so the send fails and its report can come after
            // the fence. Its client has given up: end it, or a later lease
            // would serve nobody.
            Some(p) if p.attempts > 0 => None,
            _ => return,
        };
        self.forget_request(request);
        out.push(Action::Done {
            request,
            outcome: Outcome::Cancelled,
        });
        if let Some(run_id) = run_id {
            self.release(&run_id);
            self.pump(out);
        }
    }

    /// Requests waiting in any lane of model `m`.
    fn queued_count(&self, m: usize) -> usize {
        self.models[m]
            .lanes
            .iter()
            .map(|&lane| self.lanes[lane].queued_count())
            .sum()
    }

    /// Takes a lease for `request`'s `attempt`-th attempt on the
    /// least-loaded live candidate of `lane` with a free slot (and a free
    /// long slot for long requests) that is not in `exclude`; ties go to
    /// configured order. The first such entry of the lane's candidate
    /// index (`exclude` holds the providers already tried: at most
    /// `max_attempts - 1`).
    fn try_admit(
        &mut self,
        request: RequestId,
        lane: usize,
        long: bool,
        attempt: u32,
        exclude: &[usize],
    ) -> Option<Dispatch> {
        let p = self.lanes[lane]
            .candidates(long)
            .iter()
            .find(|c| !exclude.contains(&c.provider))?
            .provider;
        let owner = self.nodes[self.providers[p].node].ready_owner()?;
        let state = &mut self.providers[p];
        state.in_flight += 1;
        if long {
            state.long_in_flight += 1;
        }
        let run_id = request.attempt_run_id(attempt);
        let lease = Lease {
            request,
            run_id: run_id.clone(),
            provider: state.key.clone(),
            conn: owner.conn,
            generation: owner.generation,
            adapter: state.spec.adapter.clone(),
            target: state.spec.target.clone(),
            long,
        };
        let dispatch = Dispatch {
            request,
            lease: lease.clone(),
            kind: state.spec.kind,
            response_stall_timeout_ms: state.spec.response_stall_timeout_ms,
            strips_usage_chunk: owner.strips_usage_chunk,
        };
        self.refresh(p);
        self.leases_of
            .entry(owner.conn)
            .or_default()
            .insert(run_id.clone());
        self.leases
            .insert(run_id, LeaseEntry { lease, provider: p });
        Some(dispatch)
    }

    /// Admits waiting requests, in arrival order, wherever they now fit.
    ///
    /// Requests of one queue (one model, short or long) fit exactly when
    /// its head does, and admitting only ever takes capacity, so the
    /// earliest waiting request that fits is the earliest queue head that
    /// fits: admit it, repeat until no head fits. (A request queued again
    /// after its node was fenced has no provider to avoid: it fits like
    /// any other.)
    fn pump(&mut self, out: &mut Vec<Action>) {
        loop {
            let head = self
                .heads
                .iter()
                .find(|&&(_, lane, long)| !self.lanes[lane].candidates(long).is_empty())
                .copied();
            let Some((request, m, long)) = head else {
                return;
            };
            let attempt = self.pending.get(&request).map_or(1, |p| p.attempts + 1);
            let Some(dispatch) = self.try_admit(request, m, long, attempt, &[]) else {
                return;
            };
            self.unqueue(request, m, long);
            self.start_attempt(request, &dispatch);
            out.push(Action::Dispatch(dispatch));
        }
    }

    /// `request` (pending, queued or between attempts) got `dispatch`:
    /// it is dispatched under the new attempt, with the request's
    /// response-wait deadline (set at its first dispatch) filed (U6).
    fn start_attempt(&mut self, request: RequestId, dispatch: &Dispatch) {
        let provider = self.leases.get(&dispatch.lease.run_id).map(|e| e.provider);
        let first_deadline = match (self.now, self.tunables.response_wait_timeout) {
            (Some(now), Some(timeout)) => Some(now + timeout),
            _ => None,
        };
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        match p.state {
            RequestState::Queued { deadline } => {
                self.queue_deadlines.remove(&(deadline, request));
            }
            RequestState::Dispatched {
                response_by: Some(at),
                ..
            } => {
                self.response_deadlines.remove(&(at, request));
            }
            _ => {}
        }
        if p.response_deadline.is_none() {
            p.response_deadline = first_deadline;
        }
        let response_by = p.response_deadline;
        if let Some(at) = response_by {
            self.response_deadlines.insert((at, request));
        }
        p.attempts += 1;
        p.tried.extend(provider);
        p.state = RequestState::Dispatched {
            run_id: dispatch.lease.run_id.clone(),
            response_by,
            committed: false,
        };
    }

    /// The request of `run_id`'s live lease, when `conn` is the lease's
    /// connection (H1: frames from any other say nothing about it).
    fn leased_request(&self, conn: ConnId, run_id: &str) -> Option<RequestId> {
        self.leases
            .get(run_id)
            .filter(|entry| entry.lease.conn == conn)
            .map(|entry| entry.lease.request)
    }

    /// A byte of `run_id`'s response reached its client's route: it is
    /// committed, never retried. Only the lease's own connection counts
    /// (H1).
    fn on_committed(&mut self, conn: ConnId, run_id: &str) {
        let Some(request) = self.leased_request(conn, run_id) else {
            return;
        };
        if let Some(Pending {
            state: RequestState::Dispatched { committed, .. },
            ..
        }) = self.pending.get_mut(&request)
        {
            *committed = true;
        }
    }

    /// U6: the response of `run_id` started; its deadline is off. Only the
    /// lease's own connection counts (H1).
    fn on_responded(&mut self, conn: ConnId, run_id: &str) {
        let Some(request) = self.leased_request(conn, run_id) else {
            return;
        };
        if let Some(Pending {
            state: RequestState::Dispatched { response_by, .. },
            ..
        }) = self.pending.get_mut(&request)
        {
            if let Some(at) = response_by.take() {
                self.response_deadlines.remove(&(at, request));
            }
        }
    }

    /// U6: `request` got no response in time: its run is cancelled on the
    /// node, its client told, and its lease settles like a client cancel
    /// (on the terminal, or at the settle deadline).
    fn on_response_wait_timeout(
        &mut self,
        now: Instant,
        request: RequestId,
        out: &mut Vec<Action>,
    ) {
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        let RequestState::Dispatched {
            run_id,
            response_by: Some(_),
            ..
        } = p.state.clone()
        else {
            return;
        };
        let settle_at = now + self.tunables.cancel_settle;
        p.state = RequestState::CancelPending {
            run_id: run_id.clone(),
            settle_at,
        };
        self.settle_deadlines.insert((settle_at, request));
        self.counters.response_wait_timeouts += 1;
        let Some((conn, provider)) = self
            .leases
            .get(&run_id)
            .map(|entry| (entry.lease.conn, entry.provider))
        else {
            return;
        };
        out.push(Action::SendCancel {
            conn,
            run_id,
            reason: CancelReason::ResponseWaitTimeout,
        });
        out.push(Action::Abort {
            request,
            reason: AbortReason::ResponseWaitTimeout,
        });
        self.record_end(
            now,
            provider,
            AttemptEnd::Failed(FailureReason::ResponseWaitTimeout),
            out,
        );
    }

    // ---- passive health (outlier detection) ---------------------------------

    /// Holds how an attempt on provider `p` ended against its health: a
    /// success starts its failure count over, a failure may eject it.
    fn record_end(&mut self, now: Instant, p: usize, end: AttemptEnd, out: &mut Vec<Action>) {
        let reason = match end {
            AttemptEnd::Answered => return self.providers[p].outlier.on_success(),
            AttemptEnd::Failed(reason) => reason,
            AttemptEnd::Refused | AttemptEnd::Other => return,
        };
        self.counters.attempt_failures[reason as usize] += 1;
        let Some(policy) = self.tunables.outlier else {
            return;
        };
        if !self.providers[p].outlier.on_failure(&policy) {
            return;
        }
        if !self.may_eject(p, &policy) {
            self.counters.ejections_suppressed += 1;
            return;
        }
        let state = &mut self.providers[p];
        let ejection = state.outlier.eject(now, reason, &policy);
        let consecutive_failures = state.outlier.consecutive_failures();
        let provider = state.key.clone();
        self.ejection_deadlines.insert((ejection.until, p));
        self.counters.ejections[reason as usize] += 1;
        if self.providers[p].next_probe.is_none() {
            // Probed meanwhile: a fresh `available` answer re-admits early.
            self.set_next_probe(p, Some(now + self.tunables.recovery_probe_interval));
        }
        self.refresh(p);
        out.push(Action::Event(Event::Ejected {
            provider,
            ejection,
            consecutive_failures,
        }));
    }

    /// Whether ejecting provider `p` keeps every model it serves within
    /// `max_ejection_percent` of its providers ejected (at least one may
    /// go).
    fn may_eject(&self, p: usize, policy: &OutlierPolicy) -> bool {
        let mut models: Vec<usize> = self.providers[p]
            .pools
            .iter()
            .map(|&(lane, _)| self.lanes[lane].model)
            .collect();
        models.sort_unstable();
        models.dedup();
        models.iter().all(|&m| {
            let pool: Vec<usize> = self.models[m]
                .spec
                .providers
                .iter()
                .filter_map(|key| self.provider_index.get(key).copied())
                .collect();
            let ejected = pool
                .iter()
                .filter(|&&q| self.providers[q].outlier.ejection().is_some())
                .count();
            ejected < policy.max_ejected(pool.len())
        })
    }

    /// Takes ejected provider `p` back into rotation.
    fn readmit(&mut self, now: Instant, p: usize, via: Readmission, out: &mut Vec<Action>) {
        let state = &mut self.providers[p];
        let Some(ended) = state.outlier.readmit(now) else {
            return;
        };
        let provider = state.key.clone();
        self.ejection_deadlines.remove(&(ended.until, p));
        match via {
            Readmission::Timer => self.counters.readmissions_timer += 1,
            Readmission::Probe => self.counters.readmissions_probe += 1,
        }
        if !self.is_overlaid_index(p) {
            self.set_next_probe(p, None);
        }
        self.refresh(p);
        out.push(Action::Event(Event::Readmitted { provider, via }));
    }

    fn is_overlaid_index(&self, p: usize) -> bool {
        let state = &self.providers[p];
        self.nodes[state.node]
            .owner
            .is_some_and(|owner| state.overlay == Some(owner.generation))
    }

    // ---- pre-commit failover ------------------------------------------------

    /// Puts dispatched `request` (its lease already released) back in its
    /// lane's queue until a candidate frees, at most until its response-wait
    /// deadline or the model's queue timeout; false when the queue is full.
    fn requeue(&mut self, request: RequestId) -> bool {
        let Some(now) = self.now else {
            return false;
        };
        let Some(p) = self.pending.get(&request) else {
            return false;
        };
        let spec = &self.models[p.model].spec;
        let (lane, long, model) = (p.lane, p.long, p.model);
        if self.queued_count(model) >= spec.max_queue as usize {
            return false;
        }
        let mut deadline = now + spec.queue_timeout;
        if let Some(response_deadline) = p.response_deadline {
            deadline = deadline.min(response_deadline);
        }
        if let Some(Pending {
            state:
                RequestState::Dispatched {
                    response_by: Some(at),
                    ..
                },
            ..
        }) = self.pending.get(&request)
        {
            self.response_deadlines.remove(&(*at, request));
        }
        if let Some(p) = self.pending.get_mut(&request) {
            p.state = RequestState::Queued { deadline };
        }
        self.queue_deadlines.insert((deadline, request));
        self.enqueue(request, lane, long);
        self.counters.failover_requeued += 1;
        true
    }

    /// `request`'s attempt failed (its lease already released) in a way
    /// another provider may not share: dispatches the next attempt to
    /// another candidate when nothing reached the client (`committed` or
    /// seen committed), the model allows more attempts, the response-wait
    /// deadline has not passed and a candidate not tried yet has a free
    /// slot. True when it did (the request goes on); false: the caller ends
    /// it.
    ///
    /// `fenced`: the attempt was lost with its node's connection (F1), not
    /// failed by its provider, so that provider is not held against the
    /// request: with no candidate now, a request that no provider failed
    /// waits in its queue again (until its response-wait deadline) for one,
    /// the same provider after its node's reconnect included.
    fn try_failover(
        &mut self,
        request: RequestId,
        committed: bool,
        fenced: Option<usize>,
        out: &mut Vec<Action>,
    ) -> bool {
        if let (Some(q), Some(p)) = (fenced, self.pending.get_mut(&request)) {
            p.tried.retain(|&t| t != q);
        }
        let Some(p) = self.pending.get(&request) else {
            return false;
        };
        let RequestState::Dispatched {
            committed: seen_committed,
            ..
        } = p.state
        else {
            // Cancelled (by its client or the response-wait deadline).
            return false;
        };
        let max_attempts = self.models[p.model].spec.max_attempts;
        if max_attempts <= 1 {
            return false;
        }
        if committed || seen_committed {
            self.counters.failover_ineligible += 1;
            return false;
        }
        self.counters.failover_eligible += 1;
        if p.attempts >= max_attempts {
            self.counters.failover_exhausted += 1;
            return false;
        }
        if p.response_deadline
            .zip(self.now)
            .is_some_and(|(deadline, now)| now >= deadline)
        {
            self.counters.failover_deadline += 1;
            return false;
        }
        let (lane, long, attempt, tried) = (p.lane, p.long, p.attempts + 1, p.tried.clone());
        let Some(dispatch) = self.try_admit(request, lane, long, attempt, &tried) else {
            if fenced.is_some() && tried.is_empty() && self.requeue(request) {
                return true;
            }
            self.counters.failover_no_candidate += 1;
            return false;
        };
        self.counters.failover_retried += 1;
        let from = tried
            .last()
            .map(|&q| self.providers[q].key.clone())
            .unwrap_or_else(|| dispatch.lease.provider.clone());
        self.start_attempt(request, &dispatch);
        out.push(Action::Event(Event::Failover {
            request,
            from,
            to: dispatch.lease.provider.clone(),
            attempt,
        }));
        out.push(Action::Dispatch(dispatch));
        true
    }

    fn release(&mut self, run_id: &str) -> Option<Lease> {
        let LeaseEntry { lease, provider } = self.leases.remove(run_id)?;
        if let Some(runs) = self.leases_of.get_mut(&lease.conn) {
            runs.remove(run_id);
            if runs.is_empty() {
                self.leases_of.remove(&lease.conn);
            }
        }
        let p = &mut self.providers[provider];
        p.in_flight = p.in_flight.saturating_sub(1);
        if lease.long {
            p.long_in_flight = p.long_in_flight.saturating_sub(1);
        }
        self.refresh(provider);
        Some(lease)
    }

    fn forget_request(&mut self, request: RequestId) {
        if let Some(p) = self.pending.remove(&request) {
            match p.state {
                RequestState::CancelPending { settle_at, .. } => {
                    self.settle_deadlines.remove(&(settle_at, request));
                }
                RequestState::Queued { deadline } => {
                    self.queue_deadlines.remove(&(deadline, request));
                    self.unqueue(request, p.lane, p.long);
                }
                RequestState::Dispatched { response_by, .. } => {
                    if let Some(at) = response_by {
                        self.response_deadlines.remove(&(at, request));
                    }
                }
            }
        }
    }

    // ---- terminals and health ---------------------------------------------

    fn on_terminal(&mut self, now: Instant, t: Terminal, out: &mut Vec<Action>) {
        // H1: the reception identity must be the lease's connection.
        match self.leases.get(&t.run_id) {
            Some(entry) if entry.lease.conn == t.conn => {}
            _ => return,
        }
        let Some(provider) = self.leases.get(&t.run_id).map(|entry| entry.provider) else {
            return;
        };
        let Some(lease) = self.release(&t.run_id) else {
            return;
        };
        let request = lease.request;
        // H2: the evidence must match the immutable lease; the lease is
        // released either way.
        if let Some(stall) = t.stall {
            let matches = *t.adapter == *lease.adapter && *t.target == *lease.target;
            match stall.seq {
                Some(seq) if matches && stall.is_well_formed() => {
                    self.counters.health_evidence_accepted += 1;
                    self.counters.recovery_eligible += 1;
                    out.push(Action::StallHandoff {
                        request,
                        handoff: Handoff {
                            provider_id: lease.provider.provider_id.to_string(),
                            provider_health: stall.health,
                            recovery_handoff: "confirmed",
                        },
                    });
                    self.observe(
                        now,
                        &lease.provider,
                        lease.generation,
                        seq,
                        stall.health,
                        out,
                    );
                }
                _ => {
                    self.counters.health_evidence_rejected += 1;
                    self.counters.recovery_ineligible += 1;
                }
            }
        }
        self.record_end(now, provider, t.end, out);
        if t.end.is_retryable() && self.try_failover(request, t.committed, None, out) {
            self.pump(out);
            return;
        }
        if t.end == AttemptEnd::Answered
            && self.pending.get(&request).is_some_and(|p| p.attempts > 1)
        {
            self.counters.failover_recovered += 1;
        }
        self.forget_request(request);
        out.push(Action::Done {
            request,
            outcome: Outcome::Completed,
        });
        self.pump(out);
    }

    /// Applies one validated health observation of `key` in `generation`:
    /// only a fresh (higher-sequence) `unavailable` sets the overlay (H4).
    fn observe(
        &mut self,
        now: Instant,
        key: &ProviderKey,
        generation: Generation,
        seq: u64,
        health: pb::ProviderHealth,
        out: &mut Vec<Action>,
    ) {
        let interval = self.tunables.recovery_probe_interval;
        let Some(&p) = self.provider_index.get(key) else {
            return;
        };
        let state = &mut self.providers[p];
        if !state.is_fresh(generation, seq) {
            return;
        }
        state.last_seq = Some((generation, seq));
        if health == pb::ProviderHealth::Unavailable && state.overlay != Some(generation) {
            state.overlay = Some(generation);
            self.set_next_probe(p, Some(now + interval));
            self.refresh(p);
            self.counters.health_transitions_unavailable += 1;
            out.push(Action::Event(Event::HealthTransition {
                provider: key.clone(),
                unavailable: true,
            }));
        }
    }

    fn send_recovery_probe(&mut self, now: Instant, p: usize, out: &mut Vec<Action>) {
        let interval = self.tunables.recovery_probe_interval;
        let state = &self.providers[p];
        match self.nodes[state.node].ready_owner() {
            Some(owner)
                if state.overlay == Some(owner.generation)
                    || state.outlier.ejection().is_some() =>
            {
                let key = state.key.clone();
                let adapter = state.spec.adapter.clone();
                self.set_next_probe(p, Some(now + interval));
                self.next_command += 1;
                let command_id = format!("recovery-{}", self.next_command);
                // At most one outstanding probe per provider: a node that
                // never answers cannot grow this table.
                self.commands.retain(|_, c| c.provider != key);
                self.commands.insert(
                    command_id.clone(),
                    CommandRecord {
                        node_id: key.node_id.to_string(),
                        provider: key,
                        conn: owner.conn,
                        generation: owner.generation,
                    },
                );
                out.push(Action::SendCommand {
                    conn: owner.conn,
                    command: pb::NodeCommandRequest {
                        command_id,
                        r#type: pb::CommandType::Capabilities as i32,
                        adapter: adapter.to_string(),
                        path: String::new(),
                    },
                });
            }
            _ => self.set_next_probe(p, None),
        }
    }

    /// H6: a CAPABILITIES answer clears an overlay only when a higher-sequence
    /// `available` answer identifies exactly one same-generation binding.
    /// The same answer re-admits that binding's provider if passive health
    /// ejected it.
    fn on_command_result(
        &mut self,
        conn: ConnId,
        response: &pb::NodeCommandResponse,
        out: &mut Vec<Action>,
    ) {
        let now = self.now;
        match self.commands.get(&response.command_id) {
            Some(record) if record.conn == conn => {}
            // Unknown, or answered on another connection: stale (F2).
            _ => return,
        }
        let Some(record) = self.commands.remove(&response.command_id) else {
            return;
        };
        let Some(&n) = self.node_index.get(&record.node_id) else {
            return;
        };
        let current = self.nodes[n]
            .ready_owner()
            .is_some_and(|o| o.conn == record.conn && o.generation == record.generation);
        let mut recovered = false;
        let mut readmitted = false;
        if current && response.ok {
            for cap in &response.capabilities {
                if cap.provider_status != pb::ProviderHealth::Available as i32 {
                    continue;
                }
                let Some(seq) = cap.health_observation_seq else {
                    continue;
                };
                let matching = {
                    let mut it = self.nodes[n].providers.clone().filter(|&p| {
                        let spec = &self.providers[p].spec;
                        *spec.adapter == *cap.adapter_key && *spec.target == *cap.target
                    });
                    (it.next(), it.next())
                };
                let (Some(p), None) = matching else {
                    continue; // none, or ambiguous
                };
                let state = &mut self.providers[p];
                if !state.is_fresh(record.generation, seq) {
                    continue;
                }
                // A fresh available observation is recorded even when there is
                // no overlay to clear, so an older unavailable one arriving
                // later cannot set one (H4).
                state.last_seq = Some((record.generation, seq));
                if let (Some(now), Some(_)) = (now, state.outlier.ejection()) {
                    self.readmit(now, p, Readmission::Probe, out);
                    readmitted = true;
                }
                let state = &mut self.providers[p];
                if state.overlay != Some(record.generation) {
                    continue;
                }
                state.overlay = None;
                let key = state.key.clone();
                self.set_next_probe(p, None);
                self.refresh(p);
                recovered = true;
                self.counters.health_transitions_available += 1;
                out.push(Action::Event(Event::HealthTransition {
                    provider: key,
                    unavailable: false,
                }));
            }
        }
        if recovered {
            self.counters.recovery_probe_recovered += 1;
        } else {
            self.counters.recovery_probe_unchanged += 1;
        }
        if recovered || readmitted {
            self.pump(out);
        }
    }

    // ---- queries -------------------------------------------------------------

    fn node(&self, node_id: &str) -> Option<&NodeEntry> {
        self.node_index.get(node_id).map(|&n| &self.nodes[n])
    }

    /// Whether `model` is configured.
    pub fn has_model(&self, model: &str) -> bool {
        self.model_index.contains_key(model)
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

    /// Requests waiting for a slot now, per model (`iop_edge_queue_depth`).
    pub fn queue_depths(&self) -> Vec<(String, usize)> {
        (0..self.models.len())
            .map(|m| (self.models[m].spec.name.clone(), self.queued_count(m)))
            .collect()
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

    /// The live lease of `run_id`.
    pub fn lease(&self, run_id: &str) -> Option<&Lease> {
        self.leases.get(run_id).map(|e| &e.lease)
    }

    /// Every live lease, by run id.
    pub fn leases(&self) -> impl Iterator<Item = &Lease> {
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
            .filter(|m| may_use(&m.spec.name))
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
            })
            .collect()
    }

    /// Every configured model, in configured order, for the status page.
    pub fn model_views(&self) -> Vec<ModelView> {
        self.models
            .iter()
            .enumerate()
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
                }
            })
            .collect()
    }
}
