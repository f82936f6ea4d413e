//! One session with the Edge over one connection:
//! register → apply config → start adapters → ready (R2, R3), then serve
//! tunnels, runs, cancels, commands and refreshes until the connection ends,
//! stopping every active run when it does (F5).
//!
//! ```text
//! frames ─► ProviderTunnelRequest ─► RunTable::register ─► spawn tunnel::serve ─► finish
//!         ─► RunRequest            ─► RunTable::register ─► spawn normalized::serve ─► finish
//!         ─► CancelRequest         ─► RunTable::cancel (that run only, K1)
//!         ─► NodeCommandRequest    ─► spawn commands::handle ─► NodeCommandResponse (K2)
//!         ─► NodeConfigRefresh     ─► refresh::decide ─► swap adapters/settings (K3)
//! closed ─► RunTable::cancel_all(SessionEnded)  (F5)
//! ```
//!
//! The session owns the connection-scoped observation sequence (W7). The
//! per-core [`NodeCore`] outlives sessions: the timer wheel and the adapter
//! set whose capacity gates the next session keeps (P4), so attempts still
//! finishing from an old session count against the same gates.
//!
//! The shutdown drain ([`NodeCore::begin_drain`]) tells the ready session's
//! Edge `NodeDraining` on the control lane, when that Edge said at
//! registration that it understands it (`accepts_node_draining`); the Edge
//! then sends no new run or tunnel. An older Edge is not told.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

use iop_engine::clock;
use iop_engine::conn::{ConnEvent, ConnEvents, ConnHandle};
use iop_engine::sync::Notify;
use iop_wire::codec::body_name;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use tracing::Instrument;

pub mod commands;
pub mod normalized;
pub mod refresh;
pub mod runs;
pub mod tunnel;

use self::commands::CommandContext;
use self::refresh::RefreshDecision;
use self::runs::{RunKind, RunStart, RunTable};
use crate::adapters::Adapters;
use crate::attempt::flow::FlowGate;
use crate::attempt::observation::ObservationSeq;
use crate::attempt::watchdog::{RuntimeSettings, StopCause};
use crate::attempt::AttemptEnv;
use crate::calls::pool::{self, PoolConfig, ProviderPool};
use crate::calls::upload::UploadError;
use crate::calls::workers::Workers;
use crate::calls::CallSite;
use crate::credentials::{LeaseGate, NodeCredentials};
use crate::timers::Timers;

/// How a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// It never became dispatch-ready: registration or ready refused, or the
    /// connection ended first.
    NotReady(String),
    /// It was ready and then the connection ended, for this reason.
    Ended(CloseReason),
}

/// Per-core state that outlives sessions.
#[derive(Debug)]
pub struct NodeCore {
    /// The core's timer wheel (watchdog deadlines).
    pub timers: Rc<Timers>,
    /// Where every session's tunnels and normalized runs make their
    /// provider calls: on this core against its keep-alive pool, or on the
    /// provider worker cores (`--cores` of two or more), each with its own.
    pub calls: CallSite,
    /// The adapters of the last session, whose gates the next one reuses.
    last_adapters: RefCell<Option<Rc<Adapters>>>,
    /// The credential plane (C2): recipient key, issuer key and the replay
    /// cache, shared by every session so a replay over a new connection is
    /// still caught. `None` = unmanaged.
    credentials: Option<Rc<NodeCredentials>>,
    /// Runs and tunnels of every session not yet released (W10): what the
    /// shutdown drain waits for.
    active_runs: Cell<usize>,
    /// Woken when a run or tunnel is released.
    run_released: Notify,
    /// The ready session (told of the drain, closed at its end).
    ready: RefCell<Option<ReadySession>>,
    /// The shutdown drain began: a session that becomes ready tells its
    /// Edge at once.
    draining: Cell<bool>,
    /// The tracer every session's attempts use (`[tracing]`); `None`
    /// while tracing is off.
    tracer: RefCell<Option<Rc<iop_engine::trace::Tracer>>>,
}

/// What the shutdown drain told the Edge ([`NodeCore::begin_drain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainNotice {
    /// `NodeDraining` went out on the ready session's control lane: the
    /// Edge sends no new run or tunnel.
    Sent,
    /// The ready session's Edge did not set
    /// `RegisterResponse.accepts_node_draining` (an older Edge, which would
    /// take the frame for a protocol error): it is not told, and may send
    /// new runs until the connection closes.
    EdgeNotTold,
    /// No session is ready (none yet, or its connection closed); one that
    /// becomes ready during the drain tells its Edge then.
    NoSession,
}

/// The ready session, as the drain sees it.
#[derive(Debug, Clone)]
struct ReadySession {
    conn: ConnHandle,
    node_id: String,
    /// Its Edge set `RegisterResponse.accepts_node_draining`.
    edge_accepts_draining: bool,
}

impl ReadySession {
    /// Tells the Edge this Node drains, if it understands it, and logs
    /// what happened.
    fn tell_draining(&self) -> DrainNotice {
        if !self.edge_accepts_draining {
            tracing::warn!(
                "draining: the edge does not understand NodeDraining (an older Edge); \
                 it is not told and may send new runs until the connection closes"
            );
            return DrainNotice::EdgeNotTold;
        }
        let notice = frame(Body::NodeDraining(pb::NodeDraining {
            node_id: self.node_id.clone(),
            reason: CloseReason::Shutdown.to_string(),
        }));
        match self.conn.send_control(notice) {
            Ok(()) => {
                tracing::info!(
                    node_id = %self.node_id,
                    "draining: told the edge (NodeDraining); it sends no new runs or tunnels"
                );
                DrainNotice::Sent
            }
            Err(e) => {
                tracing::debug!(error = %e, "NodeDraining not sent: the connection is closed");
                DrainNotice::NoSession
            }
        }
    }
}

impl NodeCore {
    /// Creates the core state of an unmanaged node and spawns its timer
    /// task on the current runtime (which must have its timer enabled).
    pub fn start() -> Rc<Self> {
        Self::start_with_credentials(None)
    }

    /// [`NodeCore::start`] for a node with the credential plane loaded
    /// (`[credentials]`): its tunnels must carry a valid lease (C3).
    pub fn start_with_credentials(credentials: Option<NodeCredentials>) -> Rc<Self> {
        Self::start_with_workers(credentials, None)
    }

    /// [`NodeCore::start_with_credentials`] for the control shard of a
    /// multi-core node: every provider call goes to one of `workers`.
    pub fn start_with_workers(
        credentials: Option<NodeCredentials>,
        workers: Option<Workers>,
    ) -> Rc<Self> {
        let timers = Timers::new(clock::now());
        monoio::spawn(timers.clone().run());
        // With worker cores every provider call runs there, against the
        // worker's own pool; this core keeps none.
        let calls = match workers {
            Some(workers) => CallSite::Workers(Rc::new(workers)),
            None => {
                let pool = ProviderPool::new(PoolConfig::default());
                pool::spawn_sweeper(&pool, &timers);
                CallSite::Here(pool)
            }
        };
        Rc::new(Self {
            timers,
            calls,
            last_adapters: RefCell::new(None),
            credentials: credentials.map(Rc::new),
            active_runs: Cell::new(0),
            run_released: Notify::default(),
            ready: RefCell::new(None),
            draining: Cell::new(false),
            tracer: RefCell::new(None),
        })
    }

    /// Traces the provider calls of the sessions that start from now on
    /// with `tracer` (`[tracing]`).
    pub fn trace_with(&self, tracer: iop_engine::trace::Tracer) {
        *self.tracer.borrow_mut() = Some(Rc::new(tracer));
    }

    /// Runs and tunnels not yet released, over every session (a cancelled
    /// one counts until its provider call returns, W10).
    pub fn active_runs(&self) -> usize {
        self.active_runs.get()
    }

    /// Completes once no run or tunnel is active (at once when none is).
    /// One task waits at a time (the shutdown drain).
    pub async fn runs_released(&self) {
        while self.active_runs.get() > 0 {
            self.run_released.notified().await;
        }
    }

    /// The shutdown drain begins: tells the ready session's Edge
    /// `NodeDraining` if that Edge accepts it (see [`DrainNotice`]), before
    /// anything waits for the runs. A session that becomes ready from now
    /// on tells its Edge at once.
    pub fn begin_drain(&self) -> DrainNotice {
        self.draining.set(true);
        let ready = self.ready.borrow().clone();
        ready.map_or(DrainNotice::NoSession, |session| session.tell_draining())
    }

    /// Closes the ready session's connection with `reason` (queued frames
    /// go out first, then `Close`); its session then ends. False when no
    /// session is ready.
    pub fn close_ready_session(&self, reason: CloseReason) -> bool {
        let conn = self.ready.borrow().as_ref().map(|s| s.conn.clone());
        match conn {
            Some(conn) => {
                conn.close(reason);
                true
            }
            None => false,
        }
    }

    /// Counts a run or tunnel as active until the guard drops.
    pub(crate) fn run_started(self: &Rc<Self>) -> ActiveRun {
        self.active_runs.set(self.active_runs.get() + 1);
        ActiveRun { core: self.clone() }
    }

    /// A session became ready: remember it for the drain, and tell its
    /// Edge now if the drain already began. (systemd heard `READY=1` when
    /// the supervisor started dialling; see docs/deployment.md.)
    fn session_ready(&self, session: ReadySession) {
        if self.draining.get() {
            session.tell_draining();
        }
        *self.ready.borrow_mut() = Some(session);
    }
}

/// An active run or tunnel ([`NodeCore::run_started`]); dropping it
/// releases the count.
#[derive(Debug)]
pub(crate) struct ActiveRun {
    core: Rc<NodeCore>,
}

impl Drop for ActiveRun {
    fn drop(&mut self) {
        let count = &self.core.active_runs;
        count.set(count.get().saturating_sub(1));
        self.core.run_released.notify();
    }
}

/// The config in effect.
#[derive(Debug)]
struct Applied {
    payload: pb::NodeConfigPayload,
    adapters: Rc<Adapters>,
    settings: RuntimeSettings,
}

/// A ready session's shared state.
#[derive(Debug)]
struct Session {
    node_id: String,
    env: AttemptEnv,
    runs: RefCell<RunTable>,
    applied: RefCell<Applied>,
    ready_at: Instant,
    credentials: Option<Rc<NodeCredentials>>,
    core: Rc<NodeCore>,
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// Waits for the next application frame; `Err(reason)` when the connection
/// closed.
async fn next_frame(events: &mut ConnEvents) -> Result<pb::Frame, CloseReason> {
    match events.recv().await {
        Some(ConnEvent::Frame(f)) => Ok(f),
        // Not asked for (`ConnConfig::chunks` is off here), so never
        // handed over; were it, it is the frame it is.
        Some(ConnEvent::Chunk(chunk)) => Ok(frame(Body::ProviderTunnelFrame(Box::new(
            chunk.into_tunnel_frame(),
        )))),
        Some(ConnEvent::Closed { reason }) => Err(reason),
        None => Err(CloseReason::ConnectionEnded),
    }
}

/// Runs a session on an established connection until it ends.
pub async fn run(
    node_id: &str,
    core: &Rc<NodeCore>,
    conn: ConnHandle,
    mut events: ConnEvents,
) -> SessionEnd {
    // R2: claim our node id.
    let register = frame(Body::RegisterRequest(pb::RegisterRequest {
        node_id: node_id.to_string(),
        node_version: env!("CARGO_PKG_VERSION").to_string(),
        flow_control: iop_wire::flow::FLOW_CONTROL_V1,
        strips_usage_chunk: true,
        accepts_tunnel_body: true,
        runs_embeddings: true,
    }));
    if let Err(e) = conn.send_control(register) {
        return SessionEnd::NotReady(format!("send register: {e}"));
    }
    let (config, edge_accepts_draining) = match next_frame(&mut events).await {
        Ok(pb::Frame {
            body: Some(Body::RegisterResponse(resp)),
        }) => {
            if !resp.accepted {
                conn.close(CloseReason::RegistrationRejected);
                return SessionEnd::NotReady(format!("registration rejected: {}", resp.reason));
            }
            (resp.config.unwrap_or_default(), resp.accepts_node_draining)
        }
        Ok(other) => {
            conn.close(CloseReason::ProtocolError);
            return SessionEnd::NotReady(format!(
                "expected RegisterResponse, got {:?}",
                other.body.map(|b| body_name(&b))
            ));
        }
        Err(reason) => return SessionEnd::NotReady(closed_before_registration(node_id, &reason)),
    };

    // R3: apply config and start adapters before saying ready.
    let applied = match apply(core, config) {
        Ok(a) => a,
        Err(e) => {
            conn.close(CloseReason::ConfigInvalid);
            return SessionEnd::NotReady(format!("config from the edge cannot be applied: {e}"));
        }
    };
    tracing::info!(
        adapters = applied.adapters.len(),
        revision = applied.payload.revision,
        "config applied"
    );
    let ready = frame(Body::NodeReadyRequest(pb::NodeReadyRequest {
        node_id: node_id.to_string(),
    }));
    if let Err(e) = conn.send_control(ready) {
        return SessionEnd::NotReady(format!("send ready: {e}"));
    }
    match next_frame(&mut events).await {
        Ok(pb::Frame {
            body: Some(Body::NodeReadyResponse(resp)),
        }) if resp.ready => {}
        Ok(pb::Frame {
            body: Some(Body::NodeReadyResponse(resp)),
        }) => {
            conn.close(CloseReason::NotReady);
            return SessionEnd::NotReady(format!("edge refused ready: {}", resp.reason));
        }
        Ok(other) => {
            conn.close(CloseReason::ProtocolError);
            return SessionEnd::NotReady(format!(
                "expected NodeReadyResponse, got {:?}",
                other.body.map(|b| body_name(&b))
            ));
        }
        Err(reason) => return SessionEnd::NotReady(format!("closed before ready: {reason}")),
    }
    tracing::info!(node_id, edge_accepts_draining, "session ready");
    core.session_ready(ReadySession {
        conn: conn.clone(),
        node_id: node_id.to_string(),
        edge_accepts_draining,
    });

    let session = Rc::new(Session {
        node_id: node_id.to_string(),
        env: AttemptEnv {
            conn: conn.clone(),
            timers: core.timers.clone(),
            // W7: bound to this connection, starting at 1.
            observations: Rc::new(ObservationSeq::bound()),
            calls: core.calls.clone(),
            tracer: core.tracer.borrow().clone(),
        },
        runs: RefCell::new(RunTable::new()),
        applied: RefCell::new(applied),
        ready_at: clock::now(),
        credentials: core.credentials.clone(),
        core: core.clone(),
    });
    let end = loop {
        match next_frame(&mut events).await {
            Ok(f) => session.handle(f),
            Err(reason) => break reason,
        }
    };
    // F5: the session's lifetime ends every active run and tunnel.
    let cancelled = session
        .runs
        .borrow_mut()
        .cancel_all(StopCause::SessionEnded);
    *core.last_adapters.borrow_mut() = Some(session.applied.borrow().adapters.clone());
    core.ready.borrow_mut().take();
    tracing::info!(reason = %end, cancelled, "session ended");
    SessionEnd::Ended(end)
}

/// Why the connection closed before the Edge answered our registration,
/// for the log. A TLS alert there is the Edge refusing us: under TLS 1.3 it
/// judges our certificate after our handshake has finished, and its
/// `access_denied` arrives on our first read.
fn closed_before_registration(node_id: &str, reason: &CloseReason) -> String {
    match reason {
        CloseReason::TlsAlert(alert) if alert == "access_denied" => format!(
            "the Edge refused this node's identity in the TLS handshake (TLS alert \
             access_denied): its config must list node id \"{node_id}\" under [[nodes]] \
             and share our trust_domain"
        ),
        CloseReason::TlsAlert(alert) => format!(
            "the Edge refused our certificate in the TLS handshake (TLS alert {alert}): \
             it must be signed by the CA in the Edge's [tls] ca and valid now"
        ),
        _ => format!("closed before registration: {reason}"),
    }
}

fn apply(core: &NodeCore, payload: pb::NodeConfigPayload) -> Result<Applied, String> {
    let settings = RuntimeSettings::from_pb(payload.runtime.as_ref()).map_err(|e| e.to_string())?;
    let previous = core.last_adapters.borrow().clone();
    let adapters =
        Adapters::from_payload_reusing(&payload, previous.as_deref()).map_err(|e| e.to_string())?;
    Ok(Applied {
        payload,
        adapters: Rc::new(adapters),
        settings,
    })
}

impl Session {
    fn handle(self: &Rc<Self>, f: pb::Frame) {
        match f.body {
            // Received before the drain closed the connection but handled
            // after it: `Close(drained)` promised the Edge that nothing
            // more starts here, and the Edge sends it again.
            Some(Body::ProviderTunnelRequest(req)) if self.env.conn.is_closed() => {
                tracing::info!(run_id = %req.run_id, "tunnel request after the close; not started");
            }
            Some(Body::RunRequest(req)) if self.env.conn.is_closed() => {
                tracing::info!(run_id = %req.run_id, "run request after the close; not started");
            }
            Some(Body::ProviderTunnelRequest(req)) => self.start_tunnel(req),
            Some(Body::RunRequest(req)) => self.start_run(req),
            Some(Body::CancelRequest(req)) => {
                // K1: only that run.
                let found = self
                    .runs
                    .borrow_mut()
                    .cancel(&req.run_id, StopCause::Cancelled);
                tracing::debug!(run_id = %req.run_id, reason = %req.reason, found, "cancel request");
            }
            Some(Body::ProviderTunnelBody(piece)) => {
                let taken = self
                    .runs
                    .borrow_mut()
                    .upload_piece(&piece.run_id, piece.data);
                if let Err(e) = taken {
                    tracing::warn!(run_id = %piece.run_id, error = %e, "closing the edge connection");
                    self.env.conn.close(match e {
                        UploadError::Overrun { .. } => CloseReason::FlowControlOverrun,
                        UploadError::TooLong { .. } => CloseReason::ProtocolError,
                    });
                }
            }
            Some(Body::FlowCredit(credit)) => {
                let runs = self.runs.borrow();
                for c in &credit.credits {
                    runs.credit(&c.run_id, c.max_offset);
                }
            }
            Some(Body::NodeCommandRequest(req)) => self.start_command(req),
            Some(Body::NodeConfigRefreshRequest(req)) => self.refresh(*req),
            Some(other) => {
                tracing::warn!(
                    frame = body_name(&other),
                    "unexpected frame from the edge; ignored"
                );
            }
            None => {}
        }
    }

    /// Registers a run or tunnel with the window its request granted; `None`
    /// for a duplicate of an active run id (answering would interleave with
    /// the active run's frames, so it is dropped).
    fn register(&self, run_id: &str, kind: RunKind, window_bytes: u64) -> Option<RunStart> {
        let flow = FlowGate::new(window_bytes);
        let registered = self
            .runs
            .borrow_mut()
            .register(run_id, kind, flow.as_ref().ok().cloned());
        match registered {
            Ok((ticket, stop)) => Some(RunStart {
                ticket,
                stop,
                flow,
                upload: None,
            }),
            Err(e) => {
                tracing::warn!(error = %e, ?kind, "duplicate request dropped");
                None
            }
        }
    }

    fn start_tunnel(self: &Rc<Self>, req: Box<pb::ProviderTunnelRequest>) {
        let Some(mut run) = self.register(&req.run_id, RunKind::Tunnel, req.flow_window_bytes)
        else {
            return;
        };
        if req.body_follows_bytes > 0 {
            // The rest of the body arrives in `ProviderTunnelBody` frames.
            let (sink, source) = crate::calls::upload::upload(req.body_follows_bytes);
            self.runs.borrow_mut().attach_upload(&req.run_id, sink);
            run.upload = Some(source);
        }
        let (adapters, settings, leases_required, revoked) = {
            let applied = self.applied.borrow();
            (
                applied.adapters.clone(),
                applied.settings,
                applied.payload.credential_leases_required,
                applied.payload.revoked_credentials.clone(),
            )
        };
        // C3: managed by our own [credentials] or by the Edge's payload,
        // which also names the revoked credential revisions.
        let leases = LeaseGate::new(
            self.credentials.clone(),
            leases_required,
            self.node_id.as_str(),
        )
        .with_revoked(revoked);
        let session = self.clone();
        let active = self.core.run_started();
        let span = run_span(
            RunKind::Tunnel,
            &req.run_id,
            &req.correlation_id,
            req.trace.as_ref(),
        );
        // The request stays boxed (as it was decoded): until `serve` frees
        // it, this task holds a pointer, not most of a kilobyte.
        monoio::spawn(
            async move {
                let ticket = run.ticket.clone();
                let ended =
                    tunnel::serve(&session.env, req, run, &adapters, settings, leases).await;
                session.runs.borrow_mut().finish(&ticket);
                drop(active);
                tracing::info!(?ended, "tunnel ended");
            }
            .instrument(span),
        );
    }

    fn start_run(self: &Rc<Self>, req: Box<pb::RunRequest>) {
        let Some(run) = self.register(&req.run_id, RunKind::Normalized, req.flow_window_bytes)
        else {
            return;
        };
        let (adapters, settings) = {
            let applied = self.applied.borrow();
            (applied.adapters.clone(), applied.settings)
        };
        let session = self.clone();
        let active = self.core.run_started();
        let span = run_span(
            RunKind::Normalized,
            &req.run_id,
            &req.correlation_id,
            req.trace.as_ref(),
        );
        monoio::spawn(
            async move {
                let ticket = run.ticket.clone();
                let ended = normalized::serve(&session.env, req, run, &adapters, settings).await;
                session.runs.borrow_mut().finish(&ticket);
                drop(active);
                tracing::info!(?ended, "run ended");
            }
            .instrument(span),
        );
    }

    fn start_command(self: &Rc<Self>, req: pb::NodeCommandRequest) {
        let ctx = {
            let applied = self.applied.borrow();
            let runs = self.runs.borrow();
            let stats = self.env.conn.stats();
            CommandContext {
                adapters: applied.adapters.clone(),
                settings: applied.settings,
                observations: self.env.observations.clone(),
                // X5: no addresses, tokens or transport internals.
                transport: pb::TransportStatus {
                    node_id: self.node_id.clone(),
                    session_age_sec: clock::now()
                        .saturating_duration_since(self.ready_at)
                        .as_secs(),
                    active_runs: count_u32(runs.count(RunKind::Normalized)),
                    active_tunnels: count_u32(runs.count(RunKind::Tunnel)),
                    frames_sent: stats.frames_sent,
                    frames_received: stats.frames_received,
                },
            }
        };
        let conn = self.env.conn.clone();
        monoio::spawn(async move {
            let resp = commands::handle(req, ctx).await;
            if conn
                .send_bulk(frame(Body::NodeCommandResponse(Box::new(resp))))
                .await
                .is_err()
            {
                tracing::debug!("command response dropped: the connection is closed");
            }
        });
    }

    fn refresh(&self, req: pb::NodeConfigRefreshRequest) {
        let decision = {
            let applied = self.applied.borrow();
            refresh::decide(&applied.payload, &applied.adapters, req.config.as_ref())
        };
        let resp = decision.response(&req.refresh_id);
        match decision {
            RefreshDecision::Apply {
                adapters,
                settings,
                payload,
            } => {
                tracing::info!(
                    revision = payload.revision,
                    adapters = adapters.len(),
                    "config refresh applied"
                );
                *self.applied.borrow_mut() = Applied {
                    payload,
                    adapters: Rc::new(adapters),
                    settings,
                };
            }
            RefreshDecision::RestartRequired(reason) | RefreshDecision::Failed(reason) => {
                tracing::warn!(%reason, status = ?resp.status(), "config refresh not applied");
            }
        }
        if self
            .env
            .conn
            .send_control(frame(Body::NodeConfigRefreshResponse(resp)))
            .is_err()
        {
            tracing::debug!("refresh response dropped: the connection is closed");
        }
    }
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The watchdog of an attempt starting now (its hard deadline
/// `timeout_sec` from now; 0 or less: none) and the evidence a stall of it
/// reports: the attempt's identity and the probe of its exact target.
fn watch_attempt(
    config: crate::attempt::watchdog::WatchdogConfig,
    timeout_sec: i64,
    ticket: &runs::RunTicket,
    adapter: &Rc<crate::adapters::AdapterInstance>,
    target: &str,
) -> (
    crate::attempt::watchdog::Watchdog,
    crate::attempt::StallSubject,
) {
    let now = iop_engine::clock::now();
    let hard_deadline = u64::try_from(timeout_sec)
        .ok()
        .filter(|&s| s > 0)
        .and_then(|s| now.checked_add(std::time::Duration::from_secs(s)));
    let evidence = crate::attempt::StallSubject::new(ticket.node_ids(), Rc::clone(adapter), target);
    (
        crate::attempt::watchdog::Watchdog::new(config, now, hard_deadline),
        evidence,
    )
}

/// Longest Edge request id written into this Node's log lines.
const MAX_CORRELATION_ID_BYTES: usize = 128;

/// The span of one run or tunnel: every log line about it carries its run
/// id and the client request's id (`correlation_id`, opaque, from the
/// Edge's `x-request-id`), so the Node's lines join the Edge's access log;
/// and, when the Edge sent a valid trace context, its `trace_id`.
fn run_span(
    kind: RunKind,
    run_id: &str,
    correlation_id: &str,
    trace: Option<&pb::TraceContext>,
) -> tracing::Span {
    let mut end = correlation_id.len().min(MAX_CORRELATION_ID_BYTES);
    while !correlation_id.is_char_boundary(end) {
        end -= 1;
    }
    let request_id = &correlation_id[..end];
    let trace_id = tracing::field::Empty;
    let span = match kind {
        RunKind::Tunnel => tracing::info_span!("tunnel", %run_id, %request_id, trace_id),
        RunKind::Normalized => tracing::info_span!("run", %run_id, %request_id, trace_id),
    };
    if let Some((parent, _)) = crate::trace::edge_context(trace) {
        span.record("trace_id", tracing::field::display(parent.trace_id));
    }
    span
}

#[cfg(test)]
mod tests {
    use iop_wire::CloseReason;

    use super::closed_before_registration;

    // A TLS alert before registration is the Edge refusing us, named as
    // such; any other close reason is passed on as it is.
    #[test]
    fn a_tls_alert_before_registration_reads_as_the_edges_refusal() {
        assert_eq!(
            closed_before_registration("node-z", &CloseReason::TlsAlert("access_denied".into())),
            "the Edge refused this node's identity in the TLS handshake (TLS alert \
             access_denied): its config must list node id \"node-z\" under [[nodes]] and \
             share our trust_domain"
        );
        assert_eq!(
            closed_before_registration("node-z", &CloseReason::TlsAlert("unknown_ca".into())),
            "the Edge refused our certificate in the TLS handshake (TLS alert unknown_ca): \
             it must be signed by the CA in the Edge's [tls] ca and valid now"
        );
        assert_eq!(
            closed_before_registration("node-z", &CloseReason::PeerClosed),
            "closed before registration: peer_closed"
        );
    }
}
