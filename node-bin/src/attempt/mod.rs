//! One attempt, watched: the shell that moves a provider call's outputs,
//! timer expiries, stop causes and probe results into the [`Watchdog`] core
//! and carries out its [`Action`]s, turning outputs into frames through an
//! [`Emitter`]. Shared by tunnels and normalized runs.
//!
//! ```text
//!  calls (inline on this core, or a task on a worker core)
//!     │ ProviderSide: outputs (bounded; closes when the call returns)
//!     ▼
//!  drive ──on_output──► Watchdog ──actions──► Emitter ──frames──► Edge connection
//!     ▲  timer (wheel) ──handle_timeout──┘   │ CancelProvider ──► abort the provider call
//!     ▲  stop (K1, F5) ──stop──────────────── │ StartProbe ─────► probe task ──result──┐
//!     └──────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! The way is one-directional: `session` starts an attempt, the attempt
//! reads `calls`, and neither `calls` nor the attempt ever reaches back up.
//!
//! The provider's capacity permit is held until the provider call returns:
//! by the call's own future on a single core (dropped when it returns or
//! is aborted), by the `ProviderSide` (on the session core) for a call on
//! a worker core, released when the worker's output mailbox ends. `drive` returns only after the watchdog's
//! [`Action::Release`], i.e. after the terminal *and* that return (W10), so
//! the caller removes the run-manager entry at the right moment. Output that
//! arrives after the terminal is drained and dropped, never sent.

pub mod emit;
pub mod flow;
pub mod observation;
pub mod watchdog;

use std::rc::Rc;

use iop_engine::clock;
use iop_engine::conn::ConnHandle;
use iop_engine::metrics::{self, Latency};
use iop_engine::sync::{oneshot, Either};
use iop_engine::trace::Tracer;

use self::emit::{Emitter, Outbound, TraceNote};
use self::flow::FlowGate;
use self::observation::ObservationSeq;
use self::watchdog::{
    Action, Activity, AttemptIdentity, NodeRunIds, ProbeOutcome, StallReport, StopCause, Verdict,
    Watchdog,
};
use crate::adapters::probe::{self, ProbeTarget};
use crate::adapters::AdapterInstance;
use crate::calls::{CallSite, ProviderSide, Stamped};
use crate::timers::Timers;
use crate::trace::ProviderSpan;

/// What an attempt needs from its session.
#[derive(Debug, Clone)]
pub struct AttemptEnv {
    /// The Edge connection the frames go to.
    pub conn: ConnHandle,
    /// The core's timer wheel.
    pub timers: Rc<Timers>,
    /// The session's observation sequence (W7).
    pub observations: Rc<ObservationSeq>,
    /// Where provider calls run (this core, or the worker cores).
    pub calls: CallSite,
    /// The tracer (`[tracing]`); `None` while tracing is off.
    pub tracer: Option<Rc<Tracer>>,
}

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The provider's own terminal (or no terminal at all) was the end.
    Provider,
    /// The watchdog's stall terminal.
    Stalled(StallReport),
    /// A stop cause's terminal (W9).
    Stopped(StopCause),
}

/// The stall-terminal inputs of an attempt: what its identity and its
/// probe are made of, made into them only when a stall needs them (most
/// attempts never stall, and the ids and the probe's URLs are strings).
#[derive(Debug, Clone)]
pub struct StallSubject {
    ids: NodeRunIds,
    adapter: Rc<AdapterInstance>,
    target: String,
}

impl StallSubject {
    /// The subject of the attempt `ids` of `target` on `adapter`.
    pub fn new(ids: NodeRunIds, adapter: Rc<AdapterInstance>, target: &str) -> Self {
        Self {
            ids,
            adapter,
            target: target.to_owned(),
        }
    }

    /// Node-owned identity (W5).
    pub fn identity(&self) -> AttemptIdentity {
        AttemptIdentity {
            node_run_id: self.ids.node_run_id(),
            attempt_id: self.ids.attempt_id(),
            adapter: self.adapter.name.clone(),
            target: self.target.clone(),
        }
    }

    /// What the probe asks (W4): the attempt's exact target.
    pub fn probe(&self) -> ProbeTarget {
        ProbeTarget::of(&self.adapter, &self.target)
    }
}

/// An attempt whose provider call is under way: what [`drive`] takes.
pub struct Attempt<E: Emitter> {
    /// Turns the call's outputs into frames.
    pub emitter: E,
    /// The attempt's stall watchdog.
    pub watchdog: Watchdog,
    /// What a stall terminal reports.
    pub evidence: StallSubject,
    /// The provider call's outputs.
    pub provider: ProviderSide<E::Output>,
    /// The run's window.
    pub flow: Rc<FlowGate>,
    /// Fires on cancel or session end.
    pub stop: oneshot::Receiver<StopCause>,
    /// The provider call's span (`[tracing]`); `None` while tracing is
    /// off.
    pub trace: Option<Box<ProviderSpan>>,
}

impl<E: Emitter> std::fmt::Debug for Attempt<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt")
            .field("identity", &self.evidence.identity())
            .finish_non_exhaustive()
    }
}

/// The future of an attempt: [`drive`] for one whose provider call was
/// started, or the one terminal of a request refused before its call.
///
/// Meant for a shell that checks the request and starts the call
/// synchronously, before it returns this: the request, its checks' locals
/// and the shell's arguments are then gone before the body streams (an
/// `async fn` shell keeps room for all of them, for its whole life), and
/// only the chosen future is stored.
pub fn attempt<'a, E: Emitter + 'a>(
    env: &'a AttemptEnv,
    started: Result<Attempt<E>, Option<Outbound>>,
) -> impl std::future::Future<Output = Ended> + 'a {
    match started {
        Ok(a) => Either::left(drive(
            env, a.emitter, a.watchdog, a.evidence, a.provider, a.flow, a.stop, a.trace,
        )),
        Err(refusal) => {
            let sent = send(&env.conn, refusal);
            Either::right(async move {
                sent.await;
                Ended::Provider
            })
        }
    }
}

enum Event<O> {
    Output(Option<Stamped<O>>),
    Credit,
    Stop(Option<StopCause>),
    Probe(ProbeOutcome),
    Timer,
}

/// Runs one attempt to its release. See the module docs. `flow` is the
/// run's window: an output that does not fit is split where it can be and
/// otherwise held, and while one is held nothing more is read from the
/// provider call (back-pressure to its socket) and the idle clock stops.
///
/// A function returning an `async move` block rather than an `async fn`:
/// an `async fn` keeps its arguments and, beside them, the locals it moves
/// them into, for its whole life; the block uses what it captured in
/// place (the watchdog and the stall evidence are most of a kilobyte,
/// held for every stream).
///
/// A traced call's span (`trace`) notes the first output, the failure
/// that ended it, and is finished and handed to the exporter at the
/// release.
#[allow(clippy::manual_async_fn, clippy::too_many_arguments)]
pub fn drive<'a, E: Emitter + 'a>(
    env: &'a AttemptEnv,
    mut emitter: E,
    mut watchdog: Watchdog,
    evidence: StallSubject,
    mut provider: ProviderSide<E::Output>,
    flow: Rc<FlowGate>,
    mut stop: oneshot::Receiver<StopCause>,
    mut trace: Option<Box<ProviderSpan>>,
) -> impl std::future::Future<Output = Ended> + 'a {
    async move {
        let mut timer = env.timers.timer();
        let mut outputs_open = true;
        let mut stop_open = true;
        let mut probe_rx: Option<oneshot::Receiver<ProbeOutcome>> = None;
        let mut ended = Ended::Provider;
        let mut first_output_seen = false;
        // An output waiting for flow-control credit.
        let mut held: Option<Stamped<E::Output>> = None;
        loop {
            timer.arm(watchdog.poll_timeout());
            let probing = probe_rx.is_some();
            let blocked = held.is_some();
            let event = monoio::select! {
                // Stops and timers first: a busy stream must not starve them.
                biased;
                cause = &mut stop, if stop_open => Event::Stop(cause.ok()),
                _ = timer.fired() => Event::Timer,
                outcome = wait_probe(&mut probe_rx), if probing => Event::Probe(outcome),
                _ = flow.credited(), if blocked => Event::Credit,
                out = provider.recv(), if outputs_open && !blocked => Event::Output(out),
            };
            let now = clock::now();
            // What goes to `forward` this turn: a fresh output, or the held one
            // once credit came (one call site: its future is stored once).
            let mut to_forward: Option<(Stamped<E::Output>, bool)> = None;
            match event {
                Event::Output(Some(stamped)) => {
                    if !first_output_seen {
                        // metrics: provider time to first byte (its first output).
                        first_output_seen = true;
                        metrics::record_between(
                            Latency::NodeProviderTimeToFirstByte,
                            provider.started_at(),
                            stamped.read_at,
                        );
                    }
                    if let Some(span) = trace.as_mut() {
                        match E::trace_note(&stamped.output) {
                            TraceNote::Provider { status } => {
                                span.first_output(stamped.read_at, status)
                            }
                            TraceNote::Failed(code) => span.failed(code),
                            TraceNote::Local => {}
                        }
                    }
                    let activity = E::activity(&stamped.output);
                    if watchdog.on_output(now, activity) == Verdict::Forward {
                        to_forward = Some((stamped, false));
                    }
                }
                Event::Output(None) => {
                    outputs_open = false;
                    watchdog.handle_provider_returned(now);
                }
                Event::Credit => to_forward = held.take().map(|stamped| (stamped, true)),
                Event::Stop(cause) => {
                    stop_open = false;
                    if let Some(cause) = cause {
                        watchdog.stop(now, cause);
                    }
                }
                Event::Probe(outcome) => {
                    probe_rx = None;
                    watchdog.handle_probe_result(now, outcome);
                }
                Event::Timer => watchdog.handle_timeout(now),
            }
            if let Some((stamped, credited)) = to_forward {
                let activity = E::activity(&stamped.output);
                held = forward(&env.conn, &mut emitter, &flow, stamped, activity).await;
                match (credited, held.is_some()) {
                    // Blocked by this output: the idle clock stops.
                    (false, true) => watchdog.flow_blocked(now),
                    // The held output went out whole after the credit.
                    (true, false) => watchdog.flow_resumed(clock::now()),
                    _ => {}
                }
            }
            while let Some(action) = watchdog.poll_action() {
                match action {
                    Action::CancelProvider => provider.abort(),
                    Action::StartProbe => {
                        probe_rx = Some(probe::spawn_probe(
                            evidence.probe(),
                            watchdog.config().probe_timeout,
                        ));
                    }
                    Action::EmitStall(report) => {
                        let seq = env.observations.next();
                        let identity = evidence.identity();
                        let failure = report.execution_failure(&identity, seq);
                        tracing::warn!(
                            node_run_id = %identity.node_run_id,
                            adapter = %identity.adapter,
                            target = %identity.target,
                            idle_ms = report.idle.as_millis() as u64,
                            fence = ?report.fence,
                            health = ?report.health,
                            health_observation_seq = ?seq,
                            "node_stall: response stalled"
                        );
                        ended = Ended::Stalled(report);
                        if let Some(span) = trace.as_mut() {
                            span.failed(watchdog::FAILURE_RESPONSE_STALLED);
                        }
                        send(&env.conn, emitter.stall(&report.message(), failure)).await;
                    }
                    Action::EmitStopped(cause) => {
                        ended = Ended::Stopped(cause);
                        if let Some(span) = trace.as_mut() {
                            span.failed(cause.failure_code());
                        }
                        send(&env.conn, emitter.stopped(cause)).await;
                    }
                    Action::Release => {}
                }
            }
            if held.is_some() && !watchdog.accepts_output() {
                // The terminal is out (stop, deadline): what waited for credit
                // is late output now (W10), and the provider's remaining
                // outputs are drained until its call returns.
                held = None;
            }
            if watchdog.is_released() {
                if let (Some(span), Some(tracer)) = (trace.take(), &env.tracer) {
                    if let Some(record) = span.finish(clock::now()) {
                        tracer.submit(vec![record]);
                    }
                }
                return ended;
            }
        }
    }
}

/// Forwards `stamped` as far as the window allows: whole when it fits,
/// else the part that fits (split without copying) and then the rest, and
/// what cannot go now is handed back to be held until credit arrives.
///
/// An `async move` block, not an `async fn`: the block uses its arguments
/// in place, where an `async fn` would keep them and the locals they move
/// into (the output among them), in every stream's task.
#[allow(clippy::manual_async_fn)]
fn forward<'a, E: Emitter>(
    conn: &'a ConnHandle,
    emitter: &'a mut E,
    flow: &'a FlowGate,
    mut stamped: Stamped<E::Output>,
    activity: Activity,
) -> impl std::future::Future<Output = Option<Stamped<E::Output>>> + 'a {
    async move {
        loop {
            let charge = E::charge(&stamped.output);
            if charge == 0 || flow.fits(charge) {
                // Nothing borrows the frame before it moves into `send`, so
                // this future keeps no room for it (see `send`). The window is
                // charged after the push, before this task yields: no credit
                // for the frame can arrive in between.
                if send(conn, emitter.forward(stamped.output)).await {
                    flow.consume(charge);
                    if activity == Activity::Progress {
                        // metrics: relay chunk latency (read → frame queued).
                        metrics::record_since(Latency::NodeRelayChunkLatency, stamped.read_at);
                    }
                }
                return None;
            }
            let Some(head) = E::split_off(&mut stamped.output, flow.payload_allowance()) else {
                return Some(stamped);
            };
            let head_charge = E::charge(&head);
            if send(conn, emitter.forward(head)).await {
                flow.consume(head_charge);
            }
        }
    }
}

async fn wait_probe(rx: &mut Option<oneshot::Receiver<ProbeOutcome>>) -> ProbeOutcome {
    match rx {
        // A probe task that vanished is no evidence (fail closed).
        Some(rx) => rx.await.unwrap_or(ProbeOutcome::Unknown),
        None => std::future::pending().await,
    }
}

/// Sends one frame, if there is one (an emitter's `None`: nothing), and
/// says whether there was; a closed connection is ignored (the session's
/// end stops every attempt, F5).
///
/// The frame is encoded at the call, and the future holds its bytes, not
/// the frame (most of a kilobyte, see [`ConnHandle::send_bulk`]). Pass the
/// emitter's result straight in: a frame bound to a local and borrowed
/// (even by `is_some()`) before it moves here keeps its room in the
/// caller's future across the `.await`.
pub fn send(
    conn: &ConnHandle,
    frame: impl Into<Option<Outbound>>,
) -> impl std::future::Future<Output = bool> + '_ {
    let encoded = frame.into().map(|frame| match frame {
        Outbound::Frame(f) => conn.encode_bulk(&f),
        Outbound::Chunk { run_id, seq, body } => conn.encode_chunk(&run_id, seq, body),
    });
    async move {
        let Some(encoded) = encoded else {
            return false;
        };
        if let Err(e) = conn.push_bulk(encoded).await {
            tracing::debug!(error = %e, "frame dropped: the connection is closed");
        }
        true
    }
}
