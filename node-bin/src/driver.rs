//! The watchdog shell shared by tunnels and normalized runs: it moves
//! provider output, timer expiries, stop causes and probe results into the
//! [`Watchdog`] core and carries out its [`Action`]s.
//!
//! ```text
//!  provider task (owns the capacity permit, the adapter Rc, the socket)
//!     │ outputs (bounded channel; closes when the provider call returns)
//!     ▼
//!  drive ──on_output──► Watchdog ──actions──► Emitter ──frames──► Edge connection
//!     ▲  timer (wheel) ──handle_timeout──┘   │ CancelProvider ──► abort the provider task
//!     ▲  stop (K1, F5) ──stop──────────────── │ StartProbe ─────► probe task ──result──┐
//!     └──────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! The provider's capacity permit and adapter ownership live in the provider
//! task and go when it returns; `drive` returns only after the watchdog's
//! [`Action::Release`], i.e. after the terminal *and* that return (W10), so
//! the caller removes the run-manager entry at the right moment. Output that
//! arrives after the terminal is drained and dropped, never sent.

use std::cell::Cell;
use std::future::Future;
use std::rc::Rc;
use std::time::Instant;

use iop_engine::clock;
use iop_engine::conn::ConnHandle;
use iop_engine::metrics::{self, Count, Latency};
use iop_engine::sync::Notify;
use local_sync::mpsc::bounded;
use local_sync::oneshot;

use crate::adapters::Permit;
use crate::emit::{Emitter, Outbound};
use crate::observation::ObservationSeq;
use crate::probe::{self, ProbeTarget};
use crate::provider_pool::ProviderPool;
use crate::timers::Timers;
use crate::watchdog::{
    Action, Activity, AttemptIdentity, ProbeOutcome, StallReport, StopCause, Verdict, Watchdog,
};

/// Provider outputs buffered between the provider task and the driver.
pub const OUTPUT_QUEUE: usize = 8;

/// What the driver needs from its session.
#[derive(Debug, Clone)]
pub struct AttemptEnv {
    /// The Edge connection the frames go to.
    pub conn: ConnHandle,
    /// The core's timer wheel.
    pub timers: Rc<Timers>,
    /// The session's observation sequence (W7).
    pub observations: Rc<ObservationSeq>,
    /// The core's keep-alive pool of provider connections (the provider
    /// task checks a connection out and returns it only after a clean end;
    /// an abort drops it).
    pub pool: Rc<ProviderPool>,
}

/// Cancels a provider task from outside.
#[derive(Debug, Default)]
pub struct AbortSignal {
    aborted: Cell<bool>,
    notify: Notify,
}

impl AbortSignal {
    /// Aborts the provider task (idempotent).
    pub fn abort(&self) {
        if !self.aborted.replace(true) {
            self.notify.notify();
        }
    }

    /// Whether [`abort`](Self::abort) was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted.get()
    }

    async fn aborted(&self) {
        while !self.aborted.get() {
            self.notify.notified().await;
        }
    }
}

/// One provider output with the moment the provider task handed it over
/// (right after its read), for the relay latency histograms.
struct Stamped<O> {
    read_at: Instant,
    output: O,
}

/// The provider task's end of the output channel.
pub struct OutputTx<O> {
    tx: bounded::Tx<Stamped<O>>,
}

impl<O> std::fmt::Debug for OutputTx<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputTx").finish_non_exhaustive()
    }
}

impl<O> OutputTx<O> {
    /// Hands one output to the driver, waiting while the queue is full.
    /// False once the driver is gone.
    pub async fn send(&self, output: O) -> bool {
        let read_at = clock::now();
        self.tx.send(Stamped { read_at, output }).await.is_ok()
    }
}

/// The driver's end of a spawned provider task.
pub struct ProviderSide<O> {
    outputs: bounded::Rx<Stamped<O>>,
    abort: Rc<AbortSignal>,
    /// When the provider call was spawned (metrics: provider TTFB).
    started_at: Instant,
}

impl<O> std::fmt::Debug for ProviderSide<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderSide")
            .field("abort", &self.abort)
            .finish_non_exhaustive()
    }
}

/// Spawns the provider call: `call` produces outputs through the given
/// sender. The task holds `permit` (and whatever `call` captures, such as
/// the adapter instance) until the call returns or is aborted (W10).
pub fn spawn_provider<O, F>(
    permit: Option<Permit>,
    call: impl FnOnce(OutputTx<O>) -> F,
) -> ProviderSide<O>
where
    O: 'static,
    F: Future<Output = ()> + 'static,
{
    let (tx, rx) = bounded::channel(OUTPUT_QUEUE);
    let abort = Rc::new(AbortSignal::default());
    let started_at = clock::now();
    let work = call(OutputTx { tx });
    let task_abort = abort.clone();
    monoio::spawn(async move {
        let _permit = permit;
        // Dropping `work` closes the provider socket (plain TCP; the
        // runtime cancels the in-flight operation).
        monoio::select! {
            biased;
            _ = task_abort.aborted() => metrics::add(Count::NodeProviderCallsAborted, 1),
            _ = work => {},
        }
        // metrics: provider call duration (returned or aborted).
        metrics::record_since(Latency::NodeProviderCallDuration, started_at);
    });
    ProviderSide {
        outputs: rx,
        abort,
        started_at,
    }
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

/// The stall-terminal inputs of an attempt.
#[derive(Debug, Clone)]
pub struct StallEvidence {
    /// Node-owned identity (W5).
    pub identity: AttemptIdentity,
    /// What the probe asks (W4).
    pub probe: ProbeTarget,
}

enum Event<O> {
    Output(Option<Stamped<O>>),
    Stop(Option<StopCause>),
    Probe(ProbeOutcome),
    Timer,
}

/// Runs one attempt to its release. See the module docs.
pub async fn drive<E: Emitter>(
    env: &AttemptEnv,
    mut emitter: E,
    mut watchdog: Watchdog,
    evidence: StallEvidence,
    mut provider: ProviderSide<E::Output>,
    mut stop: oneshot::Receiver<StopCause>,
) -> Ended {
    let mut timer = env.timers.timer();
    let mut outputs_open = true;
    let mut stop_open = true;
    let mut probe_rx: Option<oneshot::Receiver<ProbeOutcome>> = None;
    let mut ended = Ended::Provider;
    let mut first_output_seen = false;
    loop {
        timer.arm(watchdog.poll_timeout());
        let probing = probe_rx.is_some();
        let event = monoio::select! {
            // Stops and timers first: a busy stream must not starve them.
            biased;
            cause = &mut stop, if stop_open => Event::Stop(cause.ok()),
            _ = timer.fired() => Event::Timer,
            outcome = wait_probe(&mut probe_rx), if probing => Event::Probe(outcome),
            out = provider.outputs.recv(), if outputs_open => Event::Output(out),
        };
        let now = clock::now();
        match event {
            Event::Output(Some(Stamped { read_at, output })) => {
                if !first_output_seen {
                    // metrics: provider time to first byte (its first output).
                    first_output_seen = true;
                    metrics::record_between(
                        Latency::NodeProviderTimeToFirstByte,
                        provider.started_at,
                        read_at,
                    );
                }
                let activity = E::activity(&output);
                if watchdog.on_output(now, activity) == Verdict::Forward {
                    if let Some(frame) = emitter.forward(output) {
                        send(&env.conn, frame).await;
                        if activity == Activity::Progress {
                            // metrics: relay chunk latency (read → frame queued).
                            metrics::record_since(Latency::NodeRelayChunkLatency, read_at);
                        }
                    }
                }
            }
            Event::Output(None) => {
                outputs_open = false;
                watchdog.handle_provider_returned(now);
            }
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
        while let Some(action) = watchdog.poll_action() {
            match action {
                Action::CancelProvider => provider.abort.abort(),
                Action::StartProbe => {
                    probe_rx = Some(probe::spawn_probe(
                        evidence.probe.clone(),
                        watchdog.config().probe_timeout,
                    ));
                }
                Action::EmitStall(report) => {
                    let seq = env.observations.next();
                    let failure = report.execution_failure(&evidence.identity, seq);
                    tracing::warn!(
                        node_run_id = %evidence.identity.node_run_id,
                        adapter = %evidence.identity.adapter,
                        target = %evidence.identity.target,
                        idle_ms = report.idle.as_millis() as u64,
                        fence = ?report.fence,
                        health = ?report.health,
                        health_observation_seq = ?seq,
                        "node_stall: response stalled"
                    );
                    ended = Ended::Stalled(report);
                    if let Some(frame) = emitter.stall(&report.message(), failure) {
                        send(&env.conn, frame).await;
                    }
                }
                Action::EmitStopped(cause) => {
                    ended = Ended::Stopped(cause);
                    if let Some(frame) = emitter.stopped(cause) {
                        send(&env.conn, frame).await;
                    }
                }
                Action::Release => {}
            }
        }
        if watchdog.is_released() {
            return ended;
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

/// Sends one frame; a closed connection is ignored (the session's end stops
/// every attempt, F5).
pub async fn send(conn: &ConnHandle, frame: Outbound) {
    let result = match frame {
        Outbound::Frame(f) => conn.send_bulk(f).await,
        Outbound::Body { frame, body } => conn.send_body_frame(frame, body).await,
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "frame dropped: the connection is closed");
    }
}
