//! The Edge shard's state and the one place [`Control`] decisions are carried
//! out.
//!
//! `Control` decides; [`Edge::apply`] feeds it an input with the current time
//! and executes the actions it returns: frames to node connections, admissions
//! and rejections to waiting client requests, lost runs to their replies. A
//! timer task ([`Edge::run_timers`]) does the same for `Control`'s deadlines.
//!
//! The rest of the shard's work lives in sibling modules: the reply
//! types ([`crate::link::replies`]), the observer thread
//! ([`crate::link::observers`]), the drain and lifecycle steps
//! ([`crate::link::drain`], more `impl Edge`), and the messages from other
//! shards ([`crate::link::mesh`], more `impl Edge`).

use std::cell::{Cell, Ref, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::conn::ConnHandle;
use iop_engine::mailbox::{self, Mailbox};
use iop_engine::net::{Deadlines, LogThrottle};
use iop_engine::sync::oneshot;
use iop_engine::sync::{Notify, WakeList};
use iop_wire::flow::{self, DrainWindow, Overrun, RecvWindow};
use iop_wire::pb;
use iop_wire::pb::frame::Body;

use crate::config::EdgeConfig;
use crate::control::attempt::AttemptTracker;
use crate::control::fair::Share;
use crate::control::FastMap;
use crate::control::{
    control_spec, AbortReason, Action, ConnId, Control, Dispatch, Event, Input, Operation, Outcome,
    Rejection, RequestId, RouteHint,
};
use crate::link::node_metrics_cache::NodeMetricsCache;
use crate::link::observers::{Observer, ObserverMsg, Observers};
use crate::link::ownership::{OwnershipOp, OwnershipQueue};
use crate::link::replies::{
    compacted, push_notice, ClientReply, Delivery, NodeReply, ReplyEvent, ReplyRx,
};
use crate::link::settings::{access_log, usage_log, Settings};
use crate::link::shards::{self, Lifecycle, NodeRequest, Outbox, ShardMsg, StartAttempt};
use crate::plane::access::RequestIds;
use crate::plane::credentials::CredentialPlane;

/// A node connection of this shard.
struct NodeLink {
    handle: ConnHandle,
    /// The node advertised per-run flow control (`RegisterRequest`): its
    /// runs get a window, credit travels to it, and an overrun closes the
    /// connection. Without, its runs are still bounded here: one that
    /// outgrows its window is cut off.
    flow_control: Cell<bool>,
    /// Credit waiting for this turn's `FlowCredit` frame.
    pending_credit: RefCell<Vec<pb::RunCredit>>,
}

/// The index of the shard that runs `Control`.
pub const CONTROL_SHARD: usize = 0;

/// Shortest interval between two warnings about write-stalled clients on
/// one shard.
const WRITE_STALL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The answer to a submitted request.
// Moved once per request through a oneshot; boxing the large variant would
// only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Admission {
    /// It won a lease; its frames arrive on `frames`.
    Dispatched {
        /// The decision.
        dispatch: Dispatch,
        /// Its reply's receiving end.
        frames: ReplyRx,
    },
    /// It was refused.
    Rejected(Rejection),
    /// It ended before dispatch some other way (cancelled).
    Ended,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Admission::Dispatched { dispatch, .. } => {
                f.debug_tuple("Dispatched").field(dispatch).finish()
            }
            Admission::Rejected(r) => f.debug_tuple("Rejected").field(r).finish(),
            Admission::Ended => f.write_str("Ended"),
        }
    }
}

/// One shard's state. The control shard's also holds `Control`.
pub struct Edge {
    /// This shard's index (0 = the control shard).
    pub(super) shard: usize,
    /// The authoritative state machine, on the control shard only.
    pub(super) control: Option<RefCell<Control>>,
    /// Messages to the other shards (`None` with one shard).
    pub(super) outbox: Option<Outbox>,
    /// Live node connections of this shard, by id.
    conns: RefCell<FastMap<ConnId, NodeLink>>,
    /// Dispatched runs on this shard's node connections, by run id.
    /// Keyed by run ids this Edge made, looked up once per relayed frame:
    /// hashed with foldhash, not SipHash (no key comes from a client).
    node_replies: RefCell<HashMap<String, NodeReply, foldhash::fast::RandomState>>,
    /// This shard's dispatched client requests: a sender into each one's
    /// reply, for `Lost`.
    client_replies: RefCell<FastMap<RequestId, ClientReply>>,
    /// Submitted requests waiting for admission.
    waiters: RefCell<FastMap<RequestId, oneshot::Sender<Admission>>>,
    /// Static settings.
    pub settings: Settings,
    timer_wake: Notify,
    /// The observer thread, once an observer was added.
    observers: RefCell<Option<Observers>>,
    next_conn: Cell<u64>,
    next_request: Cell<u64>,
    /// Set once SIGTERM/SIGINT closed the listeners.
    pub(super) draining: Cell<bool>,
    /// Client requests being answered (read, response not finished).
    pub(super) in_flight_requests: Cell<usize>,
    /// Woken when a client request finishes (the drain waits on it).
    pub(super) request_finished: Notify,
    /// Set when the drain grace has elapsed: requests still relaying end
    /// now (through their normal end, so their lines and usage records are
    /// written).
    pub(super) cut_off: Cell<bool>,
    pub(super) cut_off_waiters: WakeList,
    /// Lifecycle steps received from the control shard.
    pub(super) lifecycle: RefCell<Vec<Lifecycle>>,
    pub(super) lifecycle_changed: WakeList,
    /// On the control shard: worker shards that finished draining, and
    /// the requests they cut off.
    pub(super) drained: Cell<(usize, usize)>,
    /// Throttles this shard's warnings about clients cut off for not
    /// reading (one line per interval, with the number suppressed).
    write_stall_log: RefCell<LogThrottle<()>>,
    /// Mints the ids of client requests without a usable `x-request-id`.
    request_ids: RequestIds,
    /// The read, write and handshake deadlines of this shard's client and
    /// node connections: one timing wheel and one tick task for them all.
    pub deadlines: Rc<Deadlines>,
    /// The last pull of this shard's nodes' `/metrics` series.
    pub node_metrics: NodeMetricsCache,
    /// On the control shard of a cluster member: ownership claims and
    /// releases for the cluster shell to carry out in etcd.
    pub ownership_ops: Rc<OwnershipQueue>,
}

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge")
            .field("shard", &self.shard)
            .field("conns", &self.conns.borrow().len())
            .field("node_replies", &self.node_replies.borrow().len())
            .field("client_replies", &self.client_replies.borrow().len())
            .field("waiters", &self.waiters.borrow().len())
            .field("observers", &self.observers.borrow().is_some())
            .finish_non_exhaustive()
    }
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// The shard state for `cfg` without a loaded credential plane: tunnels
/// carry no lease (a managed node then rejects them with `lease_missing`,
/// fail closed). The binary uses [`edge_state_with`].
pub fn edge_state(cfg: &EdgeConfig) -> Rc<Edge> {
    edge_state_with(cfg, None)
}

/// The shard state for `cfg` with its loaded credential plane
/// ([`CredentialPlane::load`]).
pub fn edge_state_with(cfg: &EdgeConfig, credentials: Option<CredentialPlane>) -> Rc<Edge> {
    let mut settings = crate::link::settings::settings(
        cfg,
        credentials.map(crate::plane::credentials::RunningPlane::new),
    );
    settings.usage_log = usage_log(cfg);
    settings.access_log = access_log(cfg);
    Rc::new(Edge::new(Control::new(control_spec(cfg)), settings))
}

// Here rather than in `replies`: crediting needs the Edge, and `replies` stays
// below it (the Edge, the shards and the relays all use the reply types).
impl ReplyRx {
    /// The client's socket took an event charged `charge` (its bytes were
    /// written, or a response builder consumed it): grants the node more
    /// credit once half a window has been taken since the last grant.
    pub fn drained(&mut self, edge: &Rc<Edge>, charge: u64) {
        if charge == 0 {
            return;
        }
        if let Some(max_offset) = self.drain.on_consumed(charge) {
            edge.credit(self.conn, &self.run_id, max_offset);
        }
    }
}

impl Edge {
    /// The state of a single-shard Edge (everything on one core).
    pub fn new(control: Control, settings: Settings) -> Self {
        Self::shard(0, Some(control), None, settings)
    }

    /// A client cut off at the write-stall timeout: `Some(suppressed)` when
    /// this one is to be logged (mentioning the `suppressed` ones not
    /// logged since the last line), `None` to stay quiet.
    pub fn write_stall_log(&self) -> Option<u64> {
        self.write_stall_log.borrow_mut().check((), clock::now())
    }

    /// The state of shard `index` of a multi-shard Edge: `control` is
    /// `Some` on shard 0 only; `outbox` reaches every shard.
    pub fn shard(
        index: usize,
        control: Option<Control>,
        outbox: Option<Outbox>,
        settings: Settings,
    ) -> Self {
        Self {
            shard: index,
            control: control.map(RefCell::new),
            outbox,
            conns: RefCell::new(FastMap::default()),
            node_replies: RefCell::new(HashMap::default()),
            client_replies: RefCell::new(FastMap::default()),
            waiters: RefCell::new(FastMap::default()),
            settings,
            timer_wake: Notify::default(),
            observers: RefCell::new(None),
            next_conn: Cell::new(0),
            next_request: Cell::new(0),
            draining: Cell::new(false),
            in_flight_requests: Cell::new(0),
            request_finished: Notify::default(),
            cut_off: Cell::new(false),
            cut_off_waiters: WakeList::default(),
            lifecycle: RefCell::new(Vec::new()),
            lifecycle_changed: WakeList::default(),
            drained: Cell::new((0, 0)),
            write_stall_log: RefCell::new(LogThrottle::new(WRITE_STALL_LOG_INTERVAL, 1)),
            request_ids: RequestIds::default(),
            deadlines: Deadlines::new(),
            node_metrics: NodeMetricsCache::default(),
            ownership_ops: Rc::default(),
        }
    }

    /// The id of a client request: its valid `x-request-id`, or a new one.
    pub fn request_id(&self, client: Option<&[u8]>) -> String {
        self.request_ids.for_request(client)
    }

    /// This shard's index (0 = the control shard).
    pub fn shard_index(&self) -> usize {
        self.shard
    }

    /// How many shards the Edge runs.
    pub fn shard_count(&self) -> usize {
        self.outbox.as_ref().map_or(1, Outbox::shards)
    }

    /// Whether `Control` lives on this shard.
    pub fn is_control_shard(&self) -> bool {
        self.control.is_some()
    }

    /// `Control`, on the control shard. Other shards read it with
    /// [`Edge::with_control`].
    ///
    /// # Panics
    ///
    /// On a worker shard (a wiring bug, never input-driven).
    pub fn control(&self) -> Ref<'_, Control> {
        match &self.control {
            Some(c) => c.borrow(),
            None => panic!(
                "Control read on worker shard {}: use Edge::with_control",
                self.shard
            ),
        }
    }

    /// Replaces the config pushed to `node_id` at registration (SIGHUP
    /// reload, control shard).
    pub fn set_node_config(&self, node_id: &str, config: pb::NodeConfigPayload) {
        if let Some(control) = &self.control {
            control.borrow_mut().set_node_config(node_id, config);
        }
    }

    /// Runs `read` on `Control` wherever it lives and returns its answer:
    /// at once on the control shard, by mailbox round trip from the others.
    /// `None` if the control shard is gone.
    pub async fn with_control<R, F>(&self, read: F) -> Option<R>
    where
        R: Send + 'static,
        F: FnOnce(&Control) -> R + Send + 'static,
    {
        if let Some(control) = &self.control {
            return Some(read(&control.borrow()));
        }
        let outbox = self.outbox.as_ref()?;
        let (tx, mut rx) = mailbox::mailbox(1);
        outbox.send(
            CONTROL_SHARD,
            ShardMsg::Query(Box::new(move |control: &Control| {
                let _ = tx.try_send(read(control));
            })),
        );
        rx.recv().await
    }

    /// Adds an observer of `Control` events (control shard); the first one
    /// starts the observer thread ([`Observer`]).
    pub fn observe(&self, observer: Observer) -> std::io::Result<()> {
        let mut observers = self.observers.borrow_mut();
        if observers.is_none() {
            *observers = Some(Observers::spawn()?);
        }
        let thread = observers.as_ref().expect("just started");
        thread
            .tx
            .send(ObserverMsg::Add(observer))
            .map_err(|_| std::io::Error::other("the observer thread ended"))
    }

    /// Events dropped because the observer thread's queue was full.
    pub fn observer_events_dropped(&self) -> u64 {
        self.observers
            .borrow()
            .as_ref()
            .map_or(0, |o| o.dropped.get())
    }

    fn notify_observers(&self, event: &Event) {
        log_event(event);
        let observers = self.observers.borrow();
        let Some(thread) = observers.as_ref() else {
            return;
        };
        // Never waits: O2, a slow observer costs its own events only.
        if thread
            .tx
            .try_send(ObserverMsg::Event(event.clone()))
            .is_err()
        {
            let dropped = thread.dropped.get() + 1;
            thread.dropped.set(dropped);
            if dropped.is_power_of_two() {
                tracing::warn!(
                    dropped,
                    "event observers are behind; events dropped for them"
                );
            }
        }
    }

    /// A new connection id (it names this shard).
    pub fn next_conn_id(&self) -> ConnId {
        let seq = self.next_conn.get() + 1;
        self.next_conn.set(seq);
        ConnId(shards::shard_id(self.shard, seq))
    }

    /// Submits a client request; the answer arrives on the returned channel.
    pub fn submit(
        &self,
        model: &str,
        operation: Operation,
        long: bool,
        hint: RouteHint,
        share: Share,
    ) -> (RequestId, oneshot::Receiver<Admission>) {
        let seq = self.next_request.get() + 1;
        self.next_request.set(seq);
        let request = RequestId(shards::shard_id(self.shard, seq));
        let (tx, rx) = oneshot::channel();
        self.waiters.borrow_mut().insert(request, tx);
        self.apply(Input::Submit {
            request,
            model: model.to_string(),
            operation,
            long,
            hint,
            share,
        });
        (request, rx)
    }

    /// Feeds `input` to `Control` and carries out its actions: now on the
    /// control shard, through the control shard's inbox elsewhere.
    pub fn apply(&self, input: Input) {
        self.apply_batch(std::iter::once(input));
    }

    /// Settles a dispatched request whose run was never sent (the client
    /// left, or no credential could be issued): the lease is released now.
    pub fn abandon(&self, request: RequestId) {
        self.apply(Input::Undeliverable { request });
    }

    pub(super) fn apply_batch(&self, inputs: impl IntoIterator<Item = Input>) {
        let Some(control) = &self.control else {
            if let Some(outbox) = &self.outbox {
                for input in inputs {
                    outbox.input(CONTROL_SHARD, input);
                }
            }
            return;
        };
        let mut actions = Vec::new();
        {
            let mut control = control.borrow_mut();
            let now = clock::now();
            for input in inputs {
                control.handle(now, input, &mut actions);
            }
        }
        self.execute(actions);
        // A new deadline may be earlier than the one the timer sleeps on.
        self.timer_wake.notify();
    }

    /// Runs `Control`'s timers forever (control shard; spawn once).
    pub async fn run_timers(&self) {
        let Some(control) = &self.control else {
            return std::future::pending().await;
        };
        loop {
            let deadline = control.borrow().poll_timeout();
            let wait = match deadline {
                Some(at) => at.saturating_duration_since(clock::now()),
                None => Duration::from_secs(3600),
            };
            monoio::select! {
                _ = monoio::time::sleep(wait) => {},
                _ = self.timer_wake.notified() => continue,
            }
            let mut actions = Vec::new();
            control
                .borrow_mut()
                .handle_timeout(clock::now(), &mut actions);
            self.execute(actions);
        }
    }

    pub(super) fn conn(&self, conn: ConnId) -> Option<ConnHandle> {
        self.conns
            .borrow()
            .get(&conn)
            .map(|link| link.handle.clone())
    }

    /// A node connection of this shard opened.
    pub fn add_node_conn(&self, conn: ConnId, handle: ConnHandle) {
        let link = NodeLink {
            handle,
            flow_control: Cell::new(false),
            pending_credit: RefCell::new(Vec::new()),
        };
        self.conns.borrow_mut().insert(conn, link);
    }

    /// A node connection of this shard closed.
    pub fn remove_node_conn(&self, conn: ConnId) {
        self.conns.borrow_mut().remove(&conn);
    }

    /// Node connections open on this shard.
    pub fn node_conn_count(&self) -> usize {
        self.conns.borrow().len()
    }

    /// The node on `conn` registered and said which flow control it speaks.
    pub fn set_flow_control(&self, conn: ConnId, version: u32) {
        if let Some(link) = self.conns.borrow().get(&conn) {
            link.flow_control.set(version >= flow::FLOW_CONTROL_V1);
        }
    }

    fn speaks_flow_control(&self, conn: ConnId) -> bool {
        self.conns
            .borrow()
            .get(&conn)
            .is_some_and(|link| link.flow_control.get())
    }

    /// The shard an action is for: the one owning its connection or request.
    fn action_shard(action: &Action) -> usize {
        match action {
            Action::RegisterResponse { conn, .. }
            | Action::ReadyResponse { conn, .. }
            | Action::Close { conn, .. }
            | Action::SendCancel { conn, .. }
            | Action::SendCommand { conn, .. } => shards::shard_of(conn.0),
            Action::Dispatch(d) => shards::shard_of(d.request.0),
            Action::Done { request, .. } | Action::Abort { request, .. } => {
                shards::shard_of(request.0)
            }
            Action::StallHandoff { .. }
            | Action::Event(_)
            | Action::ClaimOwnership { .. }
            | Action::ReleaseOwnership { .. } => CONTROL_SHARD,
        }
    }

    fn execute(&self, actions: Vec<Action>) {
        for action in actions {
            let to = Self::action_shard(&action);
            match &self.outbox {
                Some(outbox) if to != self.shard => outbox.action(to, action),
                _ => self.execute_here(action),
            }
        }
    }

    pub(super) fn execute_here(&self, action: Action) {
        match action {
            Action::RegisterResponse { conn, response } => {
                if let Some(c) = self.conn(conn) {
                    let _ = c.send_control(frame(Body::RegisterResponse(Box::new(response))));
                }
            }
            Action::ReadyResponse { conn, response } => {
                if let Some(c) = self.conn(conn) {
                    let _ = c.send_control(frame(Body::NodeReadyResponse(response)));
                }
            }
            Action::Close { conn, reason } => {
                // Fenced or refused: nothing it sends from now on reaches a
                // client (H1, F2); its clients hear `Lost` from Control.
                self.drop_replies_of(conn);
                if let Some(c) = self.conn(conn) {
                    c.close(reason);
                }
            }
            Action::Dispatch(dispatch) => self.admit(dispatch),
            Action::SendCancel {
                conn,
                run_id,
                reason,
            } => {
                if let Some(c) = self.conn(conn) {
                    let cancel = pb::CancelRequest {
                        run_id,
                        reason: reason.as_str().into(),
                    };
                    let _ = c.send_control(frame(Body::CancelRequest(cancel)));
                }
            }
            Action::SendCommand { conn, command } => {
                if let Some(c) = self.conn(conn) {
                    let _ = c.send_control(frame(Body::NodeCommandRequest(command)));
                }
            }
            Action::StallHandoff { handoff, .. } => {
                // H3, O1: the handoff is an observation for operators; it
                // is not replay approval. No request id: O1 allows no
                // unbounded identifier in general logs.
                tracing::info!(
                    event = "edge_liveness_recovery_observation",
                    provider_id = %handoff.provider_id,
                    provider_health = handoff.provider_health.as_str_name(),
                    recovery_handoff = handoff.recovery_handoff,
                    "stalled request handed off"
                );
            }
            Action::Abort { request, reason } => self.abort(request, reason),
            Action::Done { request, outcome } => self.finish(request, outcome),
            Action::Event(event) => self.notify_observers(&event),
            Action::ClaimOwnership { conn, node_id } => {
                self.ownership_ops
                    .push(OwnershipOp::Claim { conn, node_id });
            }
            Action::ReleaseOwnership { node_id, revision } => {
                self.ownership_ops
                    .push(OwnershipOp::Release { node_id, revision });
            }
        }
    }

    /// Hands a won lease to its waiting request, with a fresh reply.
    /// A later attempt of a dispatched request (pre-commit failover) goes
    /// to its relay through the reply it already has.
    fn admit(&self, dispatch: Dispatch) {
        let request = dispatch.request;
        let waiter = self.waiters.borrow_mut().remove(&request);
        if waiter.is_none() {
            let reply = self
                .client_replies
                .borrow()
                .get(&request)
                .map(|r| r.tx.clone());
            if let Some(tx) = reply {
                return push_notice(tx, ReplyEvent::Retry(Box::new(dispatch)));
            }
        }
        let window = self.settings.running.get().flow_window_bytes;
        // The window bounds the frames too (each flow-controlled frame is
        // charged `FRAME_CHARGE_BYTES` at least), plus the few uncharged
        // ones (response start, terminal, a lost notice).
        let capacity = usize::try_from(window / flow::FRAME_CHARGE_BYTES).unwrap_or(usize::MAX);
        let (tx, rx) = mailbox::mailbox(capacity.saturating_add(8));
        let lost = Rc::new(Cell::new(false));
        let frames = ReplyRx {
            rx,
            lost: lost.clone(),
            drain: DrainWindow::new(window),
            window,
            conn: dispatch.lease.conn,
            run_id: dispatch.lease.run_id.clone(),
            put_back: None,
        };
        let delivered = match waiter {
            Some(w) => w.send(Admission::Dispatched { dispatch, frames }).is_ok(),
            None => false,
        };
        if delivered {
            self.client_replies
                .borrow_mut()
                .insert(request, ClientReply { tx, lost });
        } else {
            // The client left before its run was sent: settle at once.
            self.abandon(request);
        }
    }

    /// Tells a dispatched request's relay that Control gave up on it; the
    /// reply stays until the request is done (the lease settles later).
    fn abort(&self, request: RequestId, reason: AbortReason) {
        let Some(tx) = self
            .client_replies
            .borrow()
            .get(&request)
            .map(|r| r.tx.clone())
        else {
            return;
        };
        tracing::warn!(
            reason = reason.as_str(),
            "dispatched request given up: no response in time; run cancelled"
        );
        push_notice(tx, ReplyEvent::Aborted(reason));
    }

    fn finish(&self, request: RequestId, outcome: Outcome) {
        let waiter = self.waiters.borrow_mut().remove(&request);
        if let Some(w) = waiter {
            let _ = w.send(match outcome {
                Outcome::Rejected(r) => Admission::Rejected(r),
                _ => Admission::Ended,
            });
        }
        let reply = self.client_replies.borrow_mut().remove(&request);
        if let (Some(reply), Outcome::Lost) = (reply, outcome) {
            reply.lost.set(true);
            // Wakes a relay waiting on an empty reply.
            push_notice(reply.tx, ReplyEvent::Lost);
        }
    }

    /// Sends a dispatched request's run to its node connection, on
    /// whichever shard owns it, with the reply its frames take back.
    /// False when the connection is gone (the caller settles the request
    /// and answers the client); a run handed to another shard that cannot
    /// send it ends its reply with `Lost` there.
    /// `buffered`: the relay writes only at the end (the commit point,
    /// `crate::control::attempt`).
    pub async fn start_attempt(
        &self,
        request: RequestId,
        dispatch: &Dispatch,
        run: NodeRequest,
        buffered: bool,
    ) -> bool {
        self.start_attempt_with(request, dispatch, run, buffered, None)
            .await
    }

    /// [`Edge::start_attempt`] for a tunnel whose request body streams
    /// (`body_follows_bytes`): the pieces put into `upload`'s sending end
    /// go to the node in order, right behind the tunnel request, each
    /// `ProviderTunnelBody` frame waiting for room on the connection's bulk
    /// lane. The node's credit for them comes back on the reply
    /// ([`ReplyEvent::UploadCredit`]); dropping the sender ends the
    /// forwarding.
    pub async fn start_upload(
        &self,
        request: RequestId,
        dispatch: &Dispatch,
        run: NodeRequest,
        upload: Mailbox<Bytes>,
    ) -> bool {
        self.start_attempt_with(request, dispatch, run, false, Some(upload))
            .await
    }

    async fn start_attempt_with(
        &self,
        request: RequestId,
        dispatch: &Dispatch,
        run: NodeRequest,
        buffered: bool,
        upload: Option<Mailbox<Bytes>>,
    ) -> bool {
        let lease = &dispatch.lease;
        let Some(reply) = self
            .client_replies
            .borrow()
            .get(&request)
            .map(|r| r.tx.clone())
        else {
            // Already settled (the node was fenced meanwhile).
            return false;
        };
        let start = StartAttempt {
            conn: lease.conn,
            request,
            run_id: lease.run_id.clone(),
            run,
            reply,
            buffered,
            upload,
        };
        let to = shards::shard_of(lease.conn.0);
        match &self.outbox {
            Some(outbox) if to != self.shard => {
                outbox.send(to, ShardMsg::StartAttempt(start));
                true
            }
            _ => self.send_attempt_here(start).await,
        }
    }

    pub(super) async fn send_attempt_here(&self, start: StartAttempt) -> bool {
        let StartAttempt {
            conn,
            request: _,
            run_id,
            run: NodeRequest { mut frame, body },
            reply,
            buffered,
            upload,
        } = start;
        let Some(handle) = self.conn(conn) else {
            return false;
        };
        // A node that speaks flow control is granted the window with the
        // run; one that does not is still held to it here.
        let window = self.settings.running.get().flow_window_bytes;
        let granted = if self.speaks_flow_control(conn) {
            window
        } else {
            0
        };
        match &mut frame.body {
            Some(Body::ProviderTunnelRequest(t)) => t.flow_window_bytes = granted,
            Some(Body::RunRequest(r)) => r.flow_window_bytes = granted,
            _ => {}
        }
        self.node_replies.borrow_mut().insert(
            run_id.clone(),
            NodeReply {
                conn,
                tx: reply,
                window: RecvWindow::new(window),
                responded: false,
                tracker: if buffered {
                    AttemptTracker::buffered()
                } else {
                    AttemptTracker::new()
                },
            },
        );
        let sent = match frame.body {
            Some(Body::ProviderTunnelRequest(tunnel)) => {
                handle.send_tunnel_request(&tunnel, body).await
            }
            body => handle.send_bulk(pb::Frame { body }).await,
        };
        if sent.is_ok() {
            if let Some(pieces) = upload {
                // Spawned once the request is on the bulk lane: every
                // piece goes behind it.
                monoio::spawn(forward_upload(handle, run_id, pieces));
            }
            return true;
        }
        self.node_replies.borrow_mut().remove(&run_id);
        // O1: no request or run id in general logs.
        tracing::debug!("run not sent: node connection closed");
        false
    }

    /// Delivers a frame of run `run_id` that arrived on `conn` to its
    /// client's reply, if `conn` is the connection it was dispatched to (H1:
    /// a frame belongs to a reply only then). Never waits: a frame within
    /// the run's window always fits its reply. `charge` is the frame's
    /// flow-control charge; a terminal retires the reply.
    pub fn deliver(
        &self,
        conn: ConnId,
        charge: u64,
        terminal: bool,
        event: ReplyEvent,
    ) -> Delivery {
        let mut replies = self.node_replies.borrow_mut();
        let Some(run_id) = event.run_id() else {
            return Delivery::NoReply;
        };
        let Some(reply) = replies.get_mut(run_id).filter(|r| r.conn == conn) else {
            return Delivery::NoReply;
        };
        let (commits, end) = match &event {
            ReplyEvent::Tunnel(tf) => {
                let commits = reply.tracker.on_tunnel_frame(tf);
                (commits, terminal.then(|| reply.tracker.end_of_tunnel(tf)))
            }
            // A body chunk is never a terminal.
            ReplyEvent::Chunk(chunk) => (reply.tracker.on_tunnel_body(chunk.body.len()), None),
            ReplyEvent::Run(ev) => {
                let commits = reply.tracker.on_run_event(ev);
                (commits, terminal.then(|| reply.tracker.end_of_run(ev)))
            }
            _ => (false, None),
        };
        let end = end.map(|end| (end, reply.tracker.is_committed()));
        // The id outlives the frame (moved to its client below) only where
        // it is needed: the run's first frame, its commit and its terminal,
        // not every frame.
        let run_id = (terminal || commits || !reply.responded).then(|| run_id.to_owned());
        // A refused frame comes back: its run id names the reply to retire.
        let refused = match reply.window.on_received(charge) {
            Err(overrun) => Some((overrun, event)),
            Ok(()) => match reply.tx.try_send(compacted(event, &reply.tx)) {
                // A gone client: its frames have no reader (Control
                // cancels the run).
                Ok(()) | Err(mailbox::TrySendError::Closed(_)) => None,
                Err(mailbox::TrySendError::Full(event)) => Some((
                    Overrun {
                        received: reply.window.received(),
                        granted: reply.window.granted(),
                    },
                    event,
                )),
            },
        };
        let Some((overrun, event)) = refused else {
            let first = !std::mem::replace(&mut reply.responded, true);
            if let (true, Some(run_id)) = (terminal, &run_id) {
                replies.remove(run_id);
            }
            return Delivery::Delivered {
                first,
                commits,
                end,
                run_id,
            };
        };
        let Some(reply) = event.run_id().and_then(|run_id| replies.remove(run_id)) else {
            return Delivery::NoReply;
        };
        drop(replies);
        if self.speaks_flow_control(conn) {
            return Delivery::Overrun(overrun);
        }
        tracing::warn!(
            conn = conn.0,
            received = overrun.received,
            granted = overrun.granted,
            "run cut off: its client drains slower than its node sends, and the node \
             speaks no flow control"
        );
        // The relay may be waiting on a full reply: the notice must get in.
        push_notice(reply.tx, ReplyEvent::Overflow);
        Delivery::CutOff
    }

    /// The client of run `run_id` on node connection `conn` drained enough
    /// for the node to send up to `max_offset`: records the grant and sends
    /// it (with every other grant of this turn, in one `FlowCredit` frame)
    /// on whichever shard owns the connection.
    pub fn credit(self: &Rc<Self>, conn: ConnId, run_id: &str, max_offset: u64) {
        let to = shards::shard_of(conn.0);
        match &self.outbox {
            Some(outbox) if to != self.shard => outbox.send(
                to,
                ShardMsg::Credit {
                    conn,
                    run_id: run_id.to_string(),
                    max_offset,
                },
            ),
            _ => self.credit_here(conn, run_id, max_offset),
        }
    }

    pub(super) fn credit_here(self: &Rc<Self>, conn: ConnId, run_id: &str, max_offset: u64) {
        {
            let mut replies = self.node_replies.borrow_mut();
            match replies.get_mut(run_id).filter(|r| r.conn == conn) {
                Some(reply) => reply.window.on_credit_sent(max_offset),
                // Ended meanwhile: nothing to grant.
                None => return,
            }
        }
        let conns = self.conns.borrow();
        let Some(link) = conns.get(&conn).filter(|l| l.flow_control.get()) else {
            return;
        };
        let first = {
            let mut pending = link.pending_credit.borrow_mut();
            pending.push(pb::RunCredit {
                run_id: run_id.to_string(),
                max_offset,
            });
            pending.len() == 1
        };
        if first {
            // Sent once this turn's other grants have joined it.
            let edge = self.clone();
            monoio::spawn(async move { edge.flush_credit(conn) });
        }
    }

    fn flush_credit(&self, conn: ConnId) {
        let conns = self.conns.borrow();
        let Some(link) = conns.get(&conn) else { return };
        let credits = std::mem::take(&mut *link.pending_credit.borrow_mut());
        if credits.is_empty() {
            return;
        }
        let frame = frame(Body::FlowCredit(pb::FlowCredit { credits }));
        if link.handle.send_control(frame).is_err() {
            tracing::debug!(conn = conn.0, "credit not sent: node connection closed");
        }
    }

    /// Credit from a node for the streamed request bodies of its runs on
    /// `conn`: each goes to its run's reply (a run of another connection,
    /// or ended, gets nothing). Never waits: a reply full of frames has a
    /// response under way, and the upload it would credit has stopped.
    pub fn upload_credit(&self, conn: ConnId, credit: &pb::FlowCredit) {
        let replies = self.node_replies.borrow();
        for c in &credit.credits {
            if let Some(reply) = replies.get(&c.run_id).filter(|r| r.conn == conn) {
                let _ = reply.tx.try_send(ReplyEvent::UploadCredit(c.max_offset));
            }
        }
    }

    /// Forgets every reply of node connection `conn` (it closed): their
    /// clients learn of the loss from `Control` (F1).
    pub fn drop_replies_of(&self, conn: ConnId) {
        self.node_replies.borrow_mut().retain(|_, r| r.conn != conn);
    }

    /// Sends a control frame on node connection `conn`, on whichever shard
    /// owns it. False when it is known to be gone.
    pub fn send_control_to(&self, conn: ConnId, frame: pb::Frame) -> bool {
        let to = shards::shard_of(conn.0);
        match &self.outbox {
            Some(outbox) if to != self.shard => {
                outbox.send(to, ShardMsg::SendControl { conn, frame });
                true
            }
            _ => self
                .conn(conn)
                .is_some_and(|c| c.send_control(frame).is_ok()),
        }
    }
}

/// Sends the pieces of run `run_id`'s streamed request body on `handle`,
/// in order, until the sender is dropped or the connection is gone (then
/// `Control` learns of the loss from the connection's close).
async fn forward_upload(handle: ConnHandle, run_id: String, mut pieces: Mailbox<Bytes>) {
    while let Some(data) = pieces.recv().await {
        let piece = frame(Body::ProviderTunnelBody(pb::ProviderTunnelBody {
            run_id: run_id.clone(),
            data,
        }));
        if handle.send_bulk(piece).await.is_err() {
            return;
        }
    }
}

fn log_event(event: &Event) {
    match event {
        Event::NodeConnected { node_id } => tracing::info!(%node_id, "node.connected"),
        Event::NodeDisconnected { node_id } => {
            tracing::warn!(%node_id, "node.disconnected: generation fenced")
        }
        Event::Ejected {
            provider,
            ejection,
            consecutive_failures,
        } => tracing::warn!(
            event = "edge_provider_health_observation",
            %provider,
            reason = ejection.reason.as_str(),
            consecutive_failures,
            ejection_ms = u64::try_from((ejection.until - ejection.since).as_millis())
                .unwrap_or(u64::MAX),
            "provider ejected: failing, out of rotation"
        ),
        Event::Readmitted { provider, via } => tracing::info!(
            event = "edge_provider_health_observation",
            %provider,
            via = via.as_str(),
            "provider re-admitted into rotation"
        ),
        Event::Failover {
            from, to, attempt, ..
        } => tracing::info!(
            event = "edge_liveness_recovery_observation",
            %from,
            %to,
            attempt,
            "attempt failed before the first byte; retried on another provider"
        ),
        Event::HealthTransition {
            provider,
            unavailable,
        } => tracing::warn!(
            event = "edge_provider_health_observation",
            %provider,
            unavailable,
            "provider health overlay changed"
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::ListenerLimits;
    use crate::control::{
        ControlModel, ControlNode, ControlProvider, ControlSpec, DispatchKind, ProviderKey,
        Terminal, Tunables,
    };
    use crate::link::observers::OBSERVER_BACKLOG;
    use crate::plane::access::AccessLog;
    use crate::plane::client_keys::ClientKeys;

    fn edge() -> Edge {
        let spec = ControlSpec {
            nodes: vec![ControlNode {
                id: "n".into(),
                config: pb::NodeConfigPayload::default(),
                providers: vec![ControlProvider {
                    id: "p".into(),
                    adapter: "a".into(),
                    target: "t".into(),
                    capacity: 1,
                    long_context_capacity: 0,
                    response_stall_timeout_ms: 0,
                    category: pb::ProviderCategory::LocalInference,
                    kind: DispatchKind::Tunnel,
                    operations: crate::control::Operations::ALL,
                    enabled: true,
                }],
            }],
            models: vec![ControlModel {
                name: "m".into(),
                providers: vec![ProviderKey {
                    node_id: "n".into(),
                    provider_id: "p".into(),
                }],
                max_queue: 4,
                queue_timeout: Duration::from_secs(30),
                max_attempts: 1,
                routing: crate::control::RoutingSpec::default(),
            }],
            tunables: Tunables::default(),
        };
        let settings = Settings {
            running: crate::plane::running::RunningConfig::new(
                crate::plane::running::Running::bare(1024, 64 * 1024, Duration::from_secs(30)),
            ),
            started_unix_sec: 0,
            client_tls: None,
            client_keys: ClientKeys::default(),
            credentials: None,
            limits: ListenerLimits::default(),
            peer_limits: crate::plane::limits::PeerLimits::new(&ListenerLimits::default()),
            access_log: AccessLog::off(),
            usage_log: crate::plane::usage::UsageLog::off(),
            request_metrics: crate::plane::request_metrics::RequestMetrics::new(
                Vec::new(),
                Vec::new(),
                1,
            ),
            cluster: None,
            peer_tls: None,
            node_allow_list: None,
            tracer: None,
        };
        Edge::new(Control::new(spec), settings)
    }

    // CONTRACT: O2, F4 — observers that fail on every event, panic on every
    // event, or block for good change nothing: readiness, admission, the
    // terminal and its lease release, and fencing all happen; the events the blocked observer thread cannot take are
    // dropped and counted, and the shard never waits for it.
    #[monoio::test_all(timer_enabled = true)]
    async fn failing_panicking_and_blocked_observers_never_suppress_terminals() {
        use std::sync::mpsc;
        let edge = edge();
        let (seen_tx, seen) = mpsc::channel::<Event>();
        edge.observe(Box::new(move |event| {
            let _ = seen_tx.send(event.clone());
            Err("observer is down".into())
        }))
        .unwrap();
        edge.observe(Box::new(|_| panic!("observer panics")))
            .unwrap();
        // Blocks its thread for good from the second event on (the test
        // never answers).
        let (_never_tx, never) = mpsc::channel::<()>();
        let never = std::sync::Mutex::new(never);
        let calls = std::sync::atomic::AtomicU32::new(0);
        edge.observe(Box::new(move |_| {
            if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
                let _ = never.lock().unwrap().recv();
            }
            Ok(())
        }))
        .unwrap();
        let wait = std::time::Duration::from_secs(20);
        for round in 0..(OBSERVER_BACKLOG as u64 + 8) {
            let conn = ConnId(round + 1);
            edge.apply(Input::Register {
                conn,
                tls_name: "n".into(),
                node_id: "n".into(),
            });
            edge.apply(Input::Ready {
                conn,
                node_id: "n".into(),
            });
            let (request, mut rx) = edge.submit(
                "m",
                Operation::ChatCompletions,
                false,
                RouteHint::default(),
                Share::default(),
            );
            let Ok(Admission::Dispatched { dispatch, .. }) = rx.try_recv() else {
                panic!("round {round}: request not dispatched")
            };
            assert_eq!(dispatch.lease.conn, conn);
            if round == 0 {
                // The first events reached the observer before the one
                // after it started blocking.
                let first = seen.recv_timeout(wait).unwrap();
                assert_eq!(
                    first,
                    Event::NodeConnected {
                        node_id: "n".into()
                    }
                );
            }
            // The run's terminal: the lease comes back and the request is
            // done (its reply gone).
            edge.apply(Input::Terminal(Terminal {
                conn,
                run_id: request.run_id(),
                adapter: "a".into(),
                target: "t".into(),
                stall: None,
                end: crate::control::AttemptEnd::Answered,
                committed: true,
            }));
            assert_eq!(edge.control().leases().count(), 0, "round {round}");
            assert!(edge.control().pending_requests().next().is_none());
            assert!(edge.client_replies.borrow().is_empty());
            // Then the node goes away: fenced.
            edge.apply(Input::Closed {
                conn,
                drained: false,
            });
            assert!(!edge.control().is_ready_owner(conn));
        }
        // Two events per round; the blocked thread holds at most the
        // backlog: the rest were dropped, not waited for.
        assert!(edge.observer_events_dropped() > 0);
    }

    // CONTRACT: F1 — once Control fenced the connection that owned a
    // lease, its client gets `Lost` and nothing queued behind that
    // decision, even frames read before the node's shard closed it.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_fenced_lease_ends_its_reply_before_queued_frames() {
        let edge = edge();
        let conn = ConnId(1);
        edge.apply(Input::Register {
            conn,
            tls_name: "n".into(),
            node_id: "n".into(),
        });
        edge.apply(Input::Ready {
            conn,
            node_id: "n".into(),
        });
        let (request, mut rx) = edge.submit(
            "m",
            Operation::ChatCompletions,
            false,
            RouteHint::default(),
            Share::default(),
        );
        let Ok(Admission::Dispatched { mut frames, .. }) = rx.try_recv() else {
            panic!("request not dispatched")
        };
        let tx = edge.client_replies.borrow()[&request].tx.clone();
        let frame = |seq| {
            ReplyEvent::Tunnel(Box::new(pb::ProviderTunnelFrame {
                run_id: request.run_id(),
                seq,
                ..Default::default()
            }))
        };
        assert!(tx.try_send(frame(1)).is_ok());
        assert!(matches!(frames.recv().await, Some(ReplyEvent::Tunnel(f)) if f.seq == 1));
        // Frame 2 is queued, then the connection is fenced.
        assert!(tx.try_send(frame(2)).is_ok());
        edge.apply(Input::Closed {
            conn,
            drained: false,
        });
        assert!(matches!(frames.recv().await, Some(ReplyEvent::Lost)));
        assert!(matches!(frames.recv().await, Some(ReplyEvent::Lost)));
        assert!(edge.client_replies.borrow().is_empty());
        assert_eq!(edge.control().leases().count(), 0);
    }

    #[test]
    fn drain_flag_and_in_flight_count() {
        let edge = edge();
        assert!(!edge.is_draining());
        let first = edge.track_request();
        let second = edge.track_request();
        assert_eq!(edge.in_flight_requests(), 2);
        edge.begin_drain();
        assert!(edge.is_draining());
        drop(first);
        assert_eq!(edge.in_flight_requests(), 1);
        drop(second);
        assert_eq!(edge.in_flight_requests(), 0);
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn requests_finished_waits_for_the_last_request() {
        let edge = Rc::new(edge());
        // Nothing in flight: completes at once.
        edge.requests_finished().await;
        let finished = Rc::new(Cell::new(false));
        let waiter = {
            let (edge, finished) = (edge.clone(), finished.clone());
            monoio::spawn(async move {
                edge.requests_finished().await;
                finished.set(true);
            })
        };
        let first = edge.track_request();
        let second = edge.track_request();
        monoio::time::sleep(Duration::from_millis(1)).await;
        assert!(!finished.get());
        drop(first);
        monoio::time::sleep(Duration::from_millis(1)).await;
        assert!(!finished.get(), "one request is still in flight");
        drop(second);
        waiter.await;
        assert!(finished.get());
    }
}
