//! The Edge shard's state and the one place [`Control`] decisions are carried
//! out.
//!
//! `Control` decides; [`Edge::apply`] feeds it an input with the current time
//! and executes the actions it returns: frames to node connections, admissions
//! and rejections to waiting client requests, lost runs to their routes. A
//! timer task ([`Edge::run_timers`]) does the same for `Control`'s deadlines.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use iop_engine::clock;
use iop_engine::conn::ConnHandle;
use iop_engine::sync::Notify;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use local_sync::mpsc::bounded;
use local_sync::oneshot;

use crate::control::{
    Action, ConnId, Control, Dispatch, Event, Input, Outcome, Rejection, RequestId,
};
use crate::credentials::{ClientKeys, CredentialPlane};
use crate::openai::ModelEntry;

/// What the node side delivers to a waiting client request.
// Frames move through the queue by value; boxing them would allocate per frame.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum RouteEvent {
    /// A tunnel frame from the connection that owns the lease (H1).
    Tunnel(pb::ProviderTunnelFrame),
    /// A normalized run event from the connection that owns the lease (H1).
    Run(pb::RunEvent),
    /// The lease was released without a terminal: the node's connection was
    /// fenced (F1) or superseded (R2).
    Lost,
}

/// A client request's run, waiting for frames.
pub struct Route {
    /// The connection the run was dispatched to; frames from any other
    /// connection are not for this route (H1).
    pub conn: ConnId,
    /// The request it serves.
    pub request: RequestId,
    /// Where its frames go.
    pub tx: bounded::Tx<RouteEvent>,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("conn", &self.conn)
            .field("request", &self.request)
            .finish_non_exhaustive()
    }
}

/// Frames buffered per waiting client before the node connection's reader
/// waits for the client to catch up.
pub const ROUTE_QUEUE_FRAMES: usize = 256;

/// The answer to a submitted request.
pub enum Admission {
    /// It won a lease; its frames arrive on `frames`.
    Dispatched {
        /// The decision.
        dispatch: Dispatch,
        /// Its route's receiving end.
        frames: bounded::Rx<RouteEvent>,
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

/// Static settings the shells need.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Largest client request body (413 above).
    pub max_request_body_bytes: usize,
    /// Models for `GET /v1/models`, in config order.
    pub models: Vec<ModelEntry>,
    /// Long-context threshold per model, in estimated prompt tokens.
    pub long_context_threshold_tokens: HashMap<String, u64>,
    /// Process start, Unix seconds (the `created` of listed models).
    pub started_unix_sec: i64,
    /// Client API keys (401 without one when configured).
    pub client_keys: ClientKeys,
    /// The loaded credential plane; `None` = disabled (tunnels carry no
    /// lease).
    pub credentials: Option<Rc<CredentialPlane>>,
}

/// An observer of `Control` events (the droppable fan-out: event bus
/// subscribers, audit sinks). Its failure is logged and never affects
/// correctness or terminal delivery (F4, O2).
pub type Observer = Box<dyn Fn(&Event) -> Result<(), String>>;

/// The shard's state.
pub struct Edge {
    /// The authoritative state machine. Borrow it only through [`Edge::apply`]
    /// or for reads that do not cross an await.
    pub control: RefCell<Control>,
    /// Live node connections by id.
    pub conns: RefCell<HashMap<ConnId, ConnHandle>>,
    /// Dispatched runs waiting for frames, by run id.
    pub routes: RefCell<HashMap<String, Route>>,
    /// Submitted requests waiting for admission.
    waiters: RefCell<HashMap<RequestId, oneshot::Sender<Admission>>>,
    /// Static settings.
    pub settings: Settings,
    timer_wake: Notify,
    observers: RefCell<Vec<Observer>>,
    next_conn: Cell<u64>,
    next_request: Cell<u64>,
    /// Set once SIGTERM/SIGINT closed the listeners.
    draining: Cell<bool>,
    /// Client requests being answered (read, response not finished).
    in_flight_requests: Cell<usize>,
    /// Woken when a client request finishes (the drain waits on it).
    request_finished: Notify,
}

/// A client request in flight ([`Edge::track_request`]); dropping it ends
/// the count.
#[derive(Debug)]
pub struct InFlightRequest<'a> {
    edge: &'a Edge,
}

impl Drop for InFlightRequest<'_> {
    fn drop(&mut self) {
        let count = &self.edge.in_flight_requests;
        count.set(count.get().saturating_sub(1));
        self.edge.request_finished.notify();
    }
}

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge")
            .field("conns", &self.conns.borrow().len())
            .field("routes", &self.routes.borrow().len())
            .field("waiters", &self.waiters.borrow().len())
            .field("observers", &self.observers.borrow().len())
            .finish_non_exhaustive()
    }
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

impl Edge {
    /// A fresh shard state.
    pub fn new(control: Control, settings: Settings) -> Self {
        Self {
            control: RefCell::new(control),
            conns: RefCell::new(HashMap::new()),
            routes: RefCell::new(HashMap::new()),
            waiters: RefCell::new(HashMap::new()),
            settings,
            timer_wake: Notify::default(),
            observers: RefCell::new(Vec::new()),
            next_conn: Cell::new(0),
            next_request: Cell::new(0),
            draining: Cell::new(false),
            in_flight_requests: Cell::new(0),
            request_finished: Notify::default(),
        }
    }

    /// Starts the shutdown drain: from now on `/readyz` answers 503 and new
    /// requests on open connections are refused. Never undone.
    pub fn begin_drain(&self) {
        self.draining.set(true);
    }

    /// Whether the shutdown drain has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.get()
    }

    /// Counts a client request as in flight until the guard drops.
    pub fn track_request(&self) -> InFlightRequest<'_> {
        self.in_flight_requests
            .set(self.in_flight_requests.get() + 1);
        InFlightRequest { edge: self }
    }

    /// Client requests being answered now.
    pub fn in_flight_requests(&self) -> usize {
        self.in_flight_requests.get()
    }

    /// Completes once no client request is in flight (at once when none
    /// is). One task waits at a time (the drain).
    pub async fn requests_finished(&self) {
        while self.in_flight_requests.get() > 0 {
            self.request_finished.notified().await;
        }
    }

    /// Adds an observer of `Control` events.
    pub fn observe(&self, observer: Observer) {
        self.observers.borrow_mut().push(observer);
    }

    fn notify_observers(&self, event: &Event) {
        log_event(event);
        for observer in self.observers.borrow().iter() {
            if let Err(reason) = observer(event) {
                // O2: a failing observer is reported and otherwise ignored.
                tracing::warn!(%reason, "event observer failed; event dropped for it");
            }
        }
    }

    /// A new connection id.
    pub fn next_conn_id(&self) -> ConnId {
        let id = self.next_conn.get() + 1;
        self.next_conn.set(id);
        ConnId(id)
    }

    /// Submits a client request; the answer arrives on the returned channel.
    pub fn submit(&self, model: &str, long: bool) -> (RequestId, oneshot::Receiver<Admission>) {
        let id = self.next_request.get() + 1;
        self.next_request.set(id);
        let request = RequestId(id);
        let (tx, rx) = oneshot::channel();
        self.waiters.borrow_mut().insert(request, tx);
        self.apply(Input::Submit {
            request,
            model: model.to_string(),
            long,
        });
        (request, rx)
    }

    /// Feeds `input` to `Control` now and carries out its actions.
    pub fn apply(&self, input: Input) {
        let mut actions = Vec::new();
        self.control
            .borrow_mut()
            .handle(clock::now(), input, &mut actions);
        self.execute(actions);
        // A new deadline may be earlier than the one the timer sleeps on.
        self.timer_wake.notify();
    }

    /// Runs `Control`'s timers forever (spawn once per shard).
    pub async fn run_timers(&self) {
        loop {
            let deadline = self.control.borrow().poll_timeout();
            let wait = match deadline {
                Some(at) => at.saturating_duration_since(clock::now()),
                None => Duration::from_secs(3600),
            };
            monoio::select! {
                _ = monoio::time::sleep(wait) => {},
                _ = self.timer_wake.notified() => continue,
            }
            let mut actions = Vec::new();
            self.control
                .borrow_mut()
                .handle_timeout(clock::now(), &mut actions);
            self.execute(actions);
        }
    }

    fn conn(&self, conn: ConnId) -> Option<ConnHandle> {
        self.conns.borrow().get(&conn).cloned()
    }

    fn execute(&self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::RegisterResponse { conn, response } => {
                    if let Some(c) = self.conn(conn) {
                        let _ = c.send_control(frame(Body::RegisterResponse(response)));
                    }
                }
                Action::ReadyResponse { conn, response } => {
                    if let Some(c) = self.conn(conn) {
                        let _ = c.send_control(frame(Body::NodeReadyResponse(response)));
                    }
                }
                Action::Close { conn, reason } => {
                    if let Some(c) = self.conn(conn) {
                        c.close(reason);
                    }
                }
                Action::Dispatch(dispatch) => self.admit(dispatch),
                Action::SendCancel { conn, run_id } => {
                    if let Some(c) = self.conn(conn) {
                        let cancel = pb::CancelRequest {
                            run_id,
                            reason: "client_disconnect".into(),
                        };
                        let _ = c.send_control(frame(Body::CancelRequest(cancel)));
                    }
                }
                Action::SendCommand { conn, command } => {
                    if let Some(c) = self.conn(conn) {
                        let _ = c.send_control(frame(Body::NodeCommandRequest(command)));
                    }
                }
                Action::StallHandoff { request, handoff } => {
                    // H3, O1: the handoff is an observation for operators; it
                    // is not replay approval.
                    tracing::info!(
                        event = "edge_liveness_recovery_observation",
                        request = request.0,
                        provider_id = %handoff.provider_id,
                        provider_health = handoff.provider_health.as_str_name(),
                        recovery_handoff = handoff.recovery_handoff,
                        "stalled request handed off"
                    );
                }
                Action::Done { request, outcome } => self.finish(request, outcome),
                Action::Event(event) => self.notify_observers(&event),
            }
        }
    }

    /// Hands a won lease to its waiting request, with a fresh route.
    fn admit(&self, dispatch: Dispatch) {
        let request = dispatch.request;
        let waiter = self.waiters.borrow_mut().remove(&request);
        let (tx, rx) = bounded::channel(ROUTE_QUEUE_FRAMES);
        self.routes.borrow_mut().insert(
            dispatch.lease.run_id.clone(),
            Route {
                conn: dispatch.lease.conn,
                request,
                tx,
            },
        );
        let run_id = dispatch.lease.run_id.clone();
        let delivered = match waiter {
            Some(w) => w
                .send(Admission::Dispatched {
                    dispatch,
                    frames: rx,
                })
                .is_ok(),
            None => false,
        };
        if !delivered {
            // The client left before its run was sent: settle at once.
            self.routes.borrow_mut().remove(&run_id);
            self.apply(Input::Undeliverable { request });
        }
    }

    fn finish(&self, request: RequestId, outcome: Outcome) {
        let waiter = self.waiters.borrow_mut().remove(&request);
        if let Some(w) = waiter {
            let _ = w.send(match outcome {
                Outcome::Rejected(r) => Admission::Rejected(r),
                _ => Admission::Ended,
            });
        }
        if outcome == Outcome::Lost {
            let route = self.routes.borrow_mut().remove(&request.run_id());
            if let Some(route) = route {
                monoio::spawn(async move {
                    let _ = route.tx.send(RouteEvent::Lost).await;
                });
            }
        }
    }
}

fn log_event(event: &Event) {
    match event {
        Event::NodeConnected { node_id } => tracing::info!(%node_id, "node.connected"),
        Event::NodeDisconnected { node_id } => {
            tracing::warn!(%node_id, "node.disconnected: generation fenced")
        }
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
    use crate::control::{
        ControlSpec, DispatchKind, ModelSpec, NodeSpec, ProviderKey, ProviderSpec, Terminal,
        Tunables,
    };

    fn edge() -> Edge {
        let spec = ControlSpec {
            nodes: vec![NodeSpec {
                id: "n".into(),
                config: pb::NodeConfigPayload::default(),
                providers: vec![ProviderSpec {
                    id: "p".into(),
                    adapter: "a".into(),
                    target: "t".into(),
                    capacity: 1,
                    long_context_capacity: 0,
                    response_stall_timeout_ms: 0,
                    category: pb::ProviderCategory::LocalInference,
                    kind: DispatchKind::Tunnel,
                    enabled: true,
                }],
            }],
            models: vec![ModelSpec {
                name: "m".into(),
                providers: vec![ProviderKey {
                    node_id: "n".into(),
                    provider_id: "p".into(),
                }],
                max_queue: 4,
                queue_timeout: Duration::from_secs(30),
            }],
            tunables: Tunables::default(),
        };
        let settings = Settings {
            max_request_body_bytes: 1024,
            models: Vec::new(),
            long_context_threshold_tokens: HashMap::new(),
            started_unix_sec: 0,
            client_keys: ClientKeys::default(),
            credentials: None,
        };
        Edge::new(Control::new(spec), settings)
    }

    // CONTRACT: O2, F4 — observers that fail on every event change nothing:
    // readiness, admission, terminal handling and lease release still happen.
    #[test]
    fn failing_observers_never_suppress_terminals() {
        let edge = edge();
        let seen = std::rc::Rc::new(Cell::new(0u32));
        let counter = seen.clone();
        edge.observe(Box::new(move |_| {
            counter.set(counter.get() + 1);
            Err("observer is down".into())
        }));
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
        assert_eq!(seen.get(), 1, "node.connected reached the observer");
        let (request, mut rx) = edge.submit("m", false);
        let Ok(Admission::Dispatched { dispatch, .. }) = rx.try_recv() else {
            panic!("request not dispatched")
        };
        assert_eq!(dispatch.lease.conn, conn);
        edge.apply(Input::Terminal(Terminal {
            conn,
            run_id: request.run_id(),
            adapter: "a".into(),
            target: "t".into(),
            stall: None,
        }));
        assert_eq!(edge.control.borrow().leases().count(), 0);
        assert!(edge.control.borrow().pending_requests().next().is_none());
        edge.apply(Input::Closed { conn });
        assert_eq!(seen.get(), 2, "node.disconnected reached the observer");
        assert!(!edge.control.borrow().is_ready_owner(conn));
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
