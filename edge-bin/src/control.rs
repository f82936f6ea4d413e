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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use iop_wire::pb;

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
}

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
    /// Most requests waiting for a lease (429 above).
    pub max_queue: u32,
    /// Longest wait for a lease.
    pub queue_timeout: Duration,
}

/// Tunables of the state machine.
#[derive(Debug, Clone, Copy)]
pub struct Tunables {
    /// After a cancel of a dispatched request, how long to wait for its
    /// terminal before the lease is released anyway (cancel settlement).
    pub cancel_settle: Duration,
    /// How often an overlaid provider gets a CAPABILITIES recovery probe (H6).
    pub recovery_probe_interval: Duration,
}

impl Default for Tunables {
    fn default() -> Self {
        Self {
            cancel_settle: Duration::from_secs(30),
            recovery_probe_interval: Duration::from_secs(5),
        }
    }
}

/// Everything `Control` is configured with.
#[derive(Debug, Clone, Default)]
pub struct ControlSpec {
    /// Expected nodes.
    pub nodes: Vec<NodeSpec>,
    /// Served models.
    pub models: Vec<ModelSpec>,
    /// Tunables.
    pub tunables: Tunables,
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
}

impl CancelReason {
    /// The wire reason.
    pub fn as_str(self) -> &'static str {
        match self {
            CancelReason::ClientDisconnect => "client_disconnect",
            CancelReason::ClientWriteStall => "client_write_stall",
            CancelReason::ClientTooSlow => "client_too_slow",
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
    /// no terminal will come (cancel settlement).
    Undeliverable {
        /// The request.
        request: RequestId,
    },
    /// A run or tunnel terminal from a node (H1–H5).
    Terminal(Terminal),
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
    long_in_flight: u32,
    /// Highest health observation sequence applied to this binding, and the
    /// generation it belongs to.
    last_seq: Option<(Generation, u64)>,
    /// The runtime unavailable overlay, tagged with the generation it
    /// belongs to (H4, H5).
    overlay: Option<Generation>,
    /// When the next recovery probe is due, while overlaid.
    next_probe: Option<Instant>,
}

impl ProviderState {
    fn reset_health(&mut self) {
        self.overlay = None;
        self.next_probe = None;
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
    pub adapter: String,
    /// Target evidence expected on the terminal (H2).
    pub target: String,
    /// Whether it holds a long-context slot.
    pub long: bool,
}

#[derive(Debug, Clone)]
enum RequestState {
    Queued { deadline: Instant },
    Dispatched { run_id: String },
    CancelPending { run_id: String, settle_at: Instant },
}

#[derive(Debug, Clone)]
struct Pending {
    model: String,
    long: bool,
    state: RequestState,
}

#[derive(Debug, Clone)]
struct CommandRecord {
    node_id: String,
    provider: ProviderKey,
    conn: ConnId,
    generation: Generation,
}

/// The Edge control state machine.
#[derive(Debug)]
pub struct Control {
    nodes: BTreeMap<String, NodeEntry>,
    providers: BTreeMap<ProviderKey, ProviderState>,
    models: BTreeMap<String, ModelSpec>,
    tunables: Tunables,
    /// Which node id each live connection registered (R1).
    bindings: HashMap<ConnId, String>,
    /// Connections ordered closed whose close the shell has not reported
    /// yet: a late register on one is refused (R3: it must reconnect).
    closing: HashSet<ConnId>,
    /// Live leases by run id.
    leases: BTreeMap<String, Lease>,
    /// Requests not yet done, by id (arrival order).
    pending: BTreeMap<RequestId, Pending>,
    /// Queued requests by deadline, for timeouts.
    queue_deadlines: BTreeSet<(Instant, RequestId)>,
    /// Cancel settlements by deadline.
    settle_deadlines: BTreeSet<(Instant, RequestId)>,
    /// Outstanding recovery probes.
    commands: HashMap<String, CommandRecord>,
    next_generation: u64,
    next_command: u64,
    counters: Counters,
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
                        long_in_flight: 0,
                        last_seq: None,
                        overlay: None,
                        next_probe: None,
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
            tunables: spec.tunables,
            bindings: HashMap::new(),
            closing: HashSet::new(),
            leases: BTreeMap::new(),
            pending: BTreeMap::new(),
            queue_deadlines: BTreeSet::new(),
            settle_deadlines: BTreeSet::new(),
            commands: HashMap::new(),
            next_generation: 0,
            next_command: 0,
            counters: Counters::default(),
        }
    }

    /// Feeds one input at `now`; appends what the shell must do to `out`.
    pub fn handle(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        match input {
            Input::Register {
                conn,
                tls_name,
                node_id,
            } => self.on_register(conn, &tls_name, &node_id, out),
            Input::Ready { conn, node_id } => self.on_ready(conn, &node_id, out),
            Input::Closed { conn } => self.on_closed(conn, out),
            Input::Submit {
                request,
                model,
                long,
            } => self.on_submit(now, request, model, long, out),
            Input::Cancel { request, reason } => self.on_cancel(now, request, reason, out),
            Input::Undeliverable { request } => self.on_undeliverable(request, out),
            Input::Terminal(t) => self.on_terminal(now, t, out),
            Input::CommandResult { conn, response } => self.on_command_result(conn, &response, out),
        }
    }

    /// The earliest instant at which [`Control::handle_timeout`] has work:
    /// a queue deadline, a cancel settlement or a recovery probe.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let queue = self.queue_deadlines.first().map(|(t, _)| *t);
        let settle = self.settle_deadlines.first().map(|(t, _)| *t);
        let probe = self.providers.values().filter_map(|p| p.next_probe).min();
        [queue, settle, probe].into_iter().flatten().min()
    }

    /// Runs every timer due at `now` (deadlines at or before `now`).
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Action>) {
        while let Some(&(at, request)) = self.queue_deadlines.first() {
            if at > now {
                break;
            }
            self.queue_deadlines.remove(&(at, request));
            if self.pending.remove(&request).is_some() {
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Rejected(Rejection::QueueTimeout),
                });
            }
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
        let due: Vec<ProviderKey> = self
            .providers
            .iter()
            .filter(|(_, p)| p.next_probe.is_some_and(|t| t <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            self.send_recovery_probe(now, &key, out);
        }
        if released {
            self.pump(out);
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
        if let Some(bound) = self.bindings.get(&conn) {
            // R1: one node id per connection; the first binding stays as is.
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
        let Some(node) = self.nodes.get_mut(node_id) else {
            reject(
                format!("node `{node_id}` is not configured at this edge"),
                out,
            );
            return self.close_conn(conn, "registration_rejected", out);
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
                self.fence(node_id, old, out);
            }
            self.close_conn(old.conn, "superseded", out);
        }
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
        if self.bindings.get(&conn).map(String::as_str) != Some(node_id) {
            return not_ready(self, "this connection did not register this node id", out);
        }
        let Some(node) = self.nodes.get_mut(node_id) else {
            return not_ready(self, "node is not configured", out);
        };
        let Some(owner) = node.owner.as_mut().filter(|o| o.conn == conn) else {
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
        // F3, H5: the new generation's resources start with configured
        // capacity and without the old overlay.
        for (key, p) in self.providers.iter_mut() {
            if key.node_id == node_id {
                p.reset_health();
            }
        }
        out.push(Action::Event(Event::NodeConnected {
            node_id: node_id.to_string(),
        }));
        self.pump(out);
    }

    fn on_closed(&mut self, conn: ConnId, out: &mut Vec<Action>) {
        self.closing.remove(&conn);
        let Some(node_id) = self.bindings.remove(&conn) else {
            return;
        };
        let Some(node) = self.nodes.get_mut(&node_id) else {
            return;
        };
        let owner = match node.owner {
            Some(owner) if owner.conn == conn => owner,
            // A stale connection: nothing changes (F2).
            _ => return,
        };
        node.owner = None;
        if owner.state == OwnerState::Ready {
            self.fence(&node_id, owner, out);
        }
    }

    /// F1: in one step, release every lease of `owner`'s generation exactly
    /// once, take its resources offline, and re-evaluate the queue.
    fn fence(&mut self, node_id: &str, owner: Owner, out: &mut Vec<Action>) {
        let run_ids: Vec<String> = self
            .leases
            .values()
            .filter(|l| l.provider.node_id == node_id && l.generation == owner.generation)
            .map(|l| l.run_id.clone())
            .collect();
        for run_id in run_ids {
            if let Some(lease) = self.release(&run_id) {
                self.forget_request(lease.request);
                out.push(Action::Done {
                    request: lease.request,
                    outcome: Outcome::Lost,
                });
            }
        }
        for (key, p) in self.providers.iter_mut() {
            if key.node_id == node_id {
                p.reset_health();
            }
        }
        self.commands.retain(|_, c| c.conn != owner.conn);
        out.push(Action::Event(Event::NodeDisconnected {
            node_id: node_id.to_string(),
        }));
        self.pump(out);
    }

    // ---- admission ---------------------------------------------------------

    fn on_submit(
        &mut self,
        now: Instant,
        request: RequestId,
        model: String,
        long: bool,
        out: &mut Vec<Action>,
    ) {
        if self.pending.contains_key(&request) {
            return;
        }
        let Some(spec) = self.models.get(&model) else {
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(Rejection::UnknownModel),
            });
        };
        let (max_queue, queue_timeout) = (spec.max_queue as usize, spec.queue_timeout);
        if let Some(dispatch) = self.try_admit(request, &model, long) {
            self.pending.insert(
                request,
                Pending {
                    model,
                    long,
                    state: RequestState::Dispatched {
                        run_id: dispatch.lease.run_id.clone(),
                    },
                },
            );
            return out.push(Action::Dispatch(dispatch));
        }
        let queued = self
            .pending
            .values()
            .filter(|p| p.model == model && matches!(p.state, RequestState::Queued { .. }))
            .count();
        if queued >= max_queue {
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(Rejection::QueueFull),
            });
        }
        let deadline = now + queue_timeout;
        self.queue_deadlines.insert((deadline, request));
        self.pending.insert(
            request,
            Pending {
                model,
                long,
                state: RequestState::Queued { deadline },
            },
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
                self.queue_deadlines.remove(&(deadline, request));
                self.pending.remove(&request);
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Cancelled,
                });
            }
            RequestState::Dispatched { run_id } => {
                let settle_at = now + self.tunables.cancel_settle;
                p.state = RequestState::CancelPending {
                    run_id: run_id.clone(),
                    settle_at,
                };
                self.settle_deadlines.insert((settle_at, request));
                if let Some(lease) = self.leases.get(&run_id) {
                    out.push(Action::SendCancel {
                        conn: lease.conn,
                        run_id,
                        reason,
                    });
                }
            }
            RequestState::CancelPending { .. } => {}
        }
    }

    fn on_undeliverable(&mut self, request: RequestId, out: &mut Vec<Action>) {
        let run_id = match self.pending.get(&request).map(|p| &p.state) {
            Some(
                RequestState::Dispatched { run_id } | RequestState::CancelPending { run_id, .. },
            ) => run_id.clone(),
            _ => return,
        };
        self.forget_request(request);
        self.release(&run_id);
        out.push(Action::Done {
            request,
            outcome: Outcome::Cancelled,
        });
        self.pump(out);
    }

    /// Whether a provider is a live candidate: ready generation, enabled, no
    /// unavailable overlay (X6, H4). Returns the ready owner.
    fn live_owner(&self, key: &ProviderKey, p: &ProviderState) -> Option<Owner> {
        if !p.spec.enabled {
            return None;
        }
        let owner = self.ready_owner(&key.node_id)?;
        if p.overlay == Some(owner.generation) {
            return None;
        }
        Some(owner)
    }

    /// Picks the least-loaded live candidate of `model` with a free slot
    /// (and a free long slot for long requests); ties go to configured order.
    fn try_admit(&mut self, request: RequestId, model: &str, long: bool) -> Option<Dispatch> {
        let pool = self.models.get(model)?;
        let mut best: Option<(&ProviderKey, Owner, u64, u64)> = None;
        for key in &pool.providers {
            let Some(p) = self.providers.get(key) else {
                continue;
            };
            let Some(owner) = self.live_owner(key, p) else {
                continue;
            };
            if p.in_flight >= p.spec.capacity {
                continue;
            }
            if long && p.long_in_flight >= p.spec.long_context_capacity {
                continue;
            }
            // Compare load fractions exactly by cross multiplication.
            let (num, den) = (u64::from(p.in_flight), u64::from(p.spec.capacity));
            let better = match best {
                None => true,
                Some((_, _, bnum, bden)) => num * bden < bnum * den,
            };
            if better {
                best = Some((key, owner, num, den));
            }
        }
        let (key, owner, _, _) = best?;
        let key = key.clone();
        let p = self.providers.get_mut(&key)?;
        p.in_flight += 1;
        if long {
            p.long_in_flight += 1;
        }
        let run_id = request.run_id();
        let lease = Lease {
            request,
            run_id: run_id.clone(),
            provider: key,
            conn: owner.conn,
            generation: owner.generation,
            adapter: p.spec.adapter.clone(),
            target: p.spec.target.clone(),
            long,
        };
        let dispatch = Dispatch {
            request,
            lease: lease.clone(),
            kind: p.spec.kind,
            response_stall_timeout_ms: p.spec.response_stall_timeout_ms,
        };
        self.leases.insert(run_id, lease);
        Some(dispatch)
    }

    /// Admits waiting requests, in arrival order, wherever they now fit.
    fn pump(&mut self, out: &mut Vec<Action>) {
        let waiting: Vec<(RequestId, String, bool, Instant)> = self
            .pending
            .iter()
            .filter_map(|(id, p)| match p.state {
                RequestState::Queued { deadline } => Some((*id, p.model.clone(), p.long, deadline)),
                _ => None,
            })
            .collect();
        for (request, model, long, deadline) in waiting {
            if let Some(dispatch) = self.try_admit(request, &model, long) {
                self.queue_deadlines.remove(&(deadline, request));
                if let Some(p) = self.pending.get_mut(&request) {
                    p.state = RequestState::Dispatched {
                        run_id: dispatch.lease.run_id.clone(),
                    };
                }
                out.push(Action::Dispatch(dispatch));
            }
        }
    }

    fn release(&mut self, run_id: &str) -> Option<Lease> {
        let lease = self.leases.remove(run_id)?;
        if let Some(p) = self.providers.get_mut(&lease.provider) {
            p.in_flight = p.in_flight.saturating_sub(1);
            if lease.long {
                p.long_in_flight = p.long_in_flight.saturating_sub(1);
            }
        }
        Some(lease)
    }

    fn forget_request(&mut self, request: RequestId) {
        if let Some(p) = self.pending.remove(&request) {
            if let RequestState::CancelPending { settle_at, .. } = p.state {
                self.settle_deadlines.remove(&(settle_at, request));
            }
        }
    }

    // ---- terminals and health ---------------------------------------------

    fn on_terminal(&mut self, now: Instant, t: Terminal, out: &mut Vec<Action>) {
        // H1: the reception identity must be the lease's connection.
        match self.leases.get(&t.run_id) {
            Some(lease) if lease.conn == t.conn => {}
            _ => return,
        }
        let Some(lease) = self.release(&t.run_id) else {
            return;
        };
        let request = lease.request;
        self.forget_request(request);
        // H2: the evidence must match the immutable lease; the lease is
        // released either way.
        if let Some(stall) = t.stall {
            let matches = t.adapter == lease.adapter && t.target == lease.target;
            match stall.seq {
                Some(seq) if matches && stall.is_well_formed() => {
                    self.counters.health_evidence_accepted += 1;
                    self.counters.recovery_eligible += 1;
                    out.push(Action::StallHandoff {
                        request,
                        handoff: Handoff {
                            provider_id: lease.provider.provider_id.clone(),
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
        let Some(p) = self.providers.get_mut(key) else {
            return;
        };
        if !p.is_fresh(generation, seq) {
            return;
        }
        p.last_seq = Some((generation, seq));
        if health == pb::ProviderHealth::Unavailable && p.overlay != Some(generation) {
            p.overlay = Some(generation);
            p.next_probe = Some(now + interval);
            self.counters.health_transitions_unavailable += 1;
            out.push(Action::Event(Event::HealthTransition {
                provider: key.clone(),
                unavailable: true,
            }));
        }
    }

    fn send_recovery_probe(&mut self, now: Instant, key: &ProviderKey, out: &mut Vec<Action>) {
        let interval = self.tunables.recovery_probe_interval;
        let owner = self.ready_owner(&key.node_id);
        let Some(p) = self.providers.get_mut(key) else {
            return;
        };
        match owner {
            Some(owner) if p.overlay == Some(owner.generation) => {
                p.next_probe = Some(now + interval);
                self.next_command += 1;
                let command_id = format!("recovery-{}", self.next_command);
                // At most one outstanding probe per provider: a node that
                // never answers cannot grow this table.
                self.commands.retain(|_, c| &c.provider != key);
                self.commands.insert(
                    command_id.clone(),
                    CommandRecord {
                        node_id: key.node_id.clone(),
                        provider: key.clone(),
                        conn: owner.conn,
                        generation: owner.generation,
                    },
                );
                out.push(Action::SendCommand {
                    conn: owner.conn,
                    command: pb::NodeCommandRequest {
                        command_id,
                        r#type: pb::CommandType::Capabilities as i32,
                        adapter: p.spec.adapter.clone(),
                        path: String::new(),
                    },
                });
            }
            _ => p.next_probe = None,
        }
    }

    /// H6: a CAPABILITIES answer clears an overlay only when a higher-sequence
    /// `available` answer identifies exactly one same-generation binding.
    fn on_command_result(
        &mut self,
        conn: ConnId,
        response: &pb::NodeCommandResponse,
        out: &mut Vec<Action>,
    ) {
        match self.commands.get(&response.command_id) {
            Some(record) if record.conn == conn => {}
            // Unknown, or answered on another connection: stale (F2).
            _ => return,
        }
        let Some(record) = self.commands.remove(&response.command_id) else {
            return;
        };
        let current = self
            .ready_owner(&record.node_id)
            .is_some_and(|o| o.conn == record.conn && o.generation == record.generation);
        let mut recovered = false;
        if current && response.ok {
            for cap in &response.capabilities {
                if cap.provider_status != pb::ProviderHealth::Available as i32 {
                    continue;
                }
                let Some(seq) = cap.health_observation_seq else {
                    continue;
                };
                let matching: Vec<ProviderKey> = self
                    .providers
                    .iter()
                    .filter(|(k, p)| {
                        k.node_id == record.node_id
                            && p.spec.adapter == cap.adapter_key
                            && p.spec.target == cap.target
                    })
                    .map(|(k, _)| k.clone())
                    .collect();
                let [key] = matching.as_slice() else {
                    continue; // none, or ambiguous
                };
                let Some(p) = self.providers.get_mut(key) else {
                    continue;
                };
                if !p.is_fresh(record.generation, seq) {
                    continue;
                }
                // A fresh available observation is recorded even when there is
                // no overlay to clear, so an older unavailable one arriving
                // later cannot set one (H4).
                p.last_seq = Some((record.generation, seq));
                if p.overlay != Some(record.generation) {
                    continue;
                }
                p.overlay = None;
                p.next_probe = None;
                recovered = true;
                self.counters.health_transitions_available += 1;
                out.push(Action::Event(Event::HealthTransition {
                    provider: key.clone(),
                    unavailable: false,
                }));
            }
        }
        if recovered {
            self.counters.recovery_probe_recovered += 1;
            self.pump(out);
        } else {
            self.counters.recovery_probe_unchanged += 1;
        }
    }

    // ---- queries -------------------------------------------------------------

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

    /// The config payload a node gets at registration (R2).
    pub fn node_config(&self, node_id: &str) -> Option<&pb::NodeConfigPayload> {
        self.nodes.get(node_id).map(|n| &n.spec.config)
    }

    /// Replaces the payload `node_id` gets at its next registration (config
    /// reload, K3). Returns false for an unknown node.
    pub fn set_node_config(&mut self, node_id: &str, config: pb::NodeConfigPayload) -> bool {
        match self.nodes.get_mut(node_id) {
            Some(n) => {
                n.spec.config = config;
                true
            }
            None => false,
        }
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

    /// The ready owner connection of `node_id`, if any (K3, X6).
    pub fn ready_conn(&self, node_id: &str) -> Option<ConnId> {
        self.ready_owner(node_id).map(|o| o.conn)
    }

    /// Every node id with a dispatch-ready owner, with its connection.
    pub fn ready_nodes(&self) -> Vec<(String, ConnId)> {
        self.nodes
            .iter()
            .filter_map(|(id, n)| {
                n.owner
                    .filter(|o| o.state == OwnerState::Ready)
                    .map(|o| (id.clone(), o.conn))
            })
            .collect()
    }

    /// The generation `conn` owns its node id under, if it is the current
    /// owner (pending or ready).
    pub fn generation_of(&self, conn: ConnId) -> Option<Generation> {
        let node_id = self.node_of(conn)?;
        self.nodes
            .get(node_id)
            .and_then(|n| n.owner)
            .filter(|o| o.conn == conn)
            .map(|o| o.generation)
    }

    /// The live lease of `run_id`.
    pub fn lease(&self, run_id: &str) -> Option<&Lease> {
        self.leases.get(run_id)
    }

    /// Every live lease, by run id.
    pub fn leases(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
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

    /// Whether `key` currently carries the unavailable overlay (H4, H5).
    pub fn is_overlaid(&self, key: &ProviderKey) -> bool {
        let Some(p) = self.providers.get(key) else {
            return false;
        };
        match self.nodes.get(&key.node_id).and_then(|n| n.owner) {
            Some(owner) => p.overlay == Some(owner.generation),
            None => false,
        }
    }

    /// Per-provider resource snapshots (P1–P3, H5).
    pub fn snapshots(&self) -> Vec<pb::ProviderSnapshot> {
        // P2: unique pending requests listing the provider as a live
        // candidate, and the long ones among them.
        let mut queued: HashMap<&ProviderKey, (u32, u32)> = HashMap::new();
        for p in self.pending.values() {
            if !matches!(p.state, RequestState::Queued { .. }) {
                continue;
            }
            let Some(model) = self.models.get(&p.model) else {
                continue;
            };
            for key in &model.providers {
                let live = self
                    .providers
                    .get(key)
                    .is_some_and(|state| self.live_owner(key, state).is_some());
                if live {
                    let e = queued.entry(key).or_default();
                    e.0 += 1;
                    if p.long {
                        e.1 += 1;
                    }
                }
            }
        }
        self.providers
            .iter()
            .map(|(key, state)| {
                let spec = &state.spec;
                let owner = self.ready_owner(&key.node_id);
                let connected = owner.is_some();
                let overlaid = owner.is_some_and(|o| state.overlay == Some(o.generation));
                let (q, lq) = queued.get(key).copied().unwrap_or((0, 0));
                let mut s = pb::ProviderSnapshot {
                    node_id: key.node_id.clone(),
                    provider_id: key.provider_id.clone(),
                    adapter: spec.adapter.clone(),
                    target: spec.target.clone(),
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
                } else {
                    s.status = pb::ProviderStatus::Available as i32;
                    s.health = pb::ProviderHealth::Available as i32;
                    s.capacity = spec.capacity;
                    s.long_context_capacity = spec.long_context_capacity;
                    s.in_flight = state.in_flight;
                    s.long_in_flight = state.long_in_flight;
                    s.queued = q;
                    s.long_queued = lq;
                }
                s
            })
            .collect()
    }
}
