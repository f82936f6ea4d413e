//! The watchdog shell shared by tunnels and normalized runs: it moves
//! provider output, timer expiries, stop causes and probe results into the
//! [`Watchdog`] core and carries out its [`Action`]s.
//!
//! ```text
//!  provider task (owns the socket; on this core, or on a worker core)
//!     │ outputs (bounded: a local channel, or a cross-core mailbox;
//!     │          closes when the provider call returns)
//!     ▼
//!  drive ──on_output──► Watchdog ──actions──► Emitter ──frames──► Edge connection
//!     ▲  timer (wheel) ──handle_timeout──┘   │ CancelProvider ──► abort the provider task
//!     ▲  stop (K1, F5) ──stop──────────────── │ StartProbe ─────► probe task ──result──┐
//!     └──────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! The provider's capacity permit is held until the provider call returns:
//! by the provider task on a single core, by the [`ProviderSide`] (on the
//! session core) for a call on a worker core, released when the worker's
//! output mailbox ends. `drive` returns only after the watchdog's
//! [`Action::Release`], i.e. after the terminal *and* that return (W10), so
//! the caller removes the run-manager entry at the right moment. Output that
//! arrives after the terminal is drained and dropped, never sent.

use std::cell::Cell;
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use iop_engine::clock;
use iop_engine::conn::ConnHandle;
use iop_engine::mailbox::{Mailbox, MailboxSender};
use iop_engine::metrics::{self, Count, Latency};
use iop_engine::sync::channel;
use iop_engine::sync::oneshot;
use iop_engine::sync::Notify;

use crate::adapters::Permit;
use crate::emit::{Emitter, Outbound};
use crate::observation::ObservationSeq;
use crate::probe::{self, ProbeTarget};
use crate::provider_pool::ProviderPool;
use crate::timers::Timers;
use crate::watchdog::{
    Action, Activity, AttemptIdentity, ProbeOutcome, StallReport, StopCause, Verdict, Watchdog,
};
use crate::workers::{CrossAbort, Workers};

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
    /// an abort drops it). Not used when `workers` is set.
    pub pool: Rc<ProviderPool>,
    /// The worker cores provider calls run on (multi-core); `None`: every
    /// call runs on this core against `pool`.
    pub workers: Option<Rc<Workers>>,
}

/// A provider call: the HTTP exchange of one attempt, producing outputs
/// through an [`OutputTx`]. Everything it carries is `Send` (endpoint,
/// request bytes, the opened credential), so it can run on the session
/// core or be handed to a worker core ([`crate::workers`]); the future it
/// makes runs on the core it was started on, against that core's pool.
pub trait ProviderCall: Send + 'static {
    /// What the call produces (and the driver's emitter takes).
    type Output: Send + 'static;

    /// Runs the exchange against `pool` (the running core's keep-alive
    /// pool), sending outputs to `out`, the last one a terminal.
    fn run(
        self,
        pool: Rc<ProviderPool>,
        out: OutputTx<Self::Output>,
    ) -> impl Future<Output = ()> + 'static;

    /// The failure terminal of a call that could not be started at all
    /// (no worker core took it).
    fn not_started(message: String) -> Self::Output;
}

/// Cancels a provider task on the same core from outside.
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
pub(crate) struct Stamped<O> {
    pub(crate) read_at: Instant,
    pub(crate) output: O,
}

/// Where a provider call's outputs go: a core-local channel, or the
/// cross-core mailbox of a call running on a worker core.
enum Sender<O> {
    Local(channel::Sender<Stamped<O>>),
    Remote(MailboxSender<Stamped<O>>),
}

/// The provider task's end of the output channel.
pub struct OutputTx<O> {
    tx: Sender<O>,
}

impl<O> std::fmt::Debug for OutputTx<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputTx").finish_non_exhaustive()
    }
}

impl<O> OutputTx<O> {
    /// The sending end of a cross-core output mailbox.
    pub(crate) fn remote(tx: MailboxSender<Stamped<O>>) -> Self {
        Self {
            tx: Sender::Remote(tx),
        }
    }

    /// Hands one output to the driver, waiting while the queue is full
    /// (backpressure reaches the provider socket). False once the driver
    /// is gone.
    pub async fn send(&self, output: O) -> bool {
        let read_at = clock::now();
        let stamped = Stamped { read_at, output };
        match &self.tx {
            Sender::Local(tx) => tx.send(stamped).await.is_ok(),
            Sender::Remote(tx) => tx.send(stamped).await.is_ok(),
        }
    }
}

/// The driver's end of the outputs.
enum Receiver<O> {
    Local(channel::Receiver<Stamped<O>>),
    Remote {
        mailbox: Mailbox<Stamped<O>>,
        /// Outputs taken in one batch (one lock, at most one cross-core
        /// wake per batch), in reverse order: the next one is last.
        batch: Vec<Stamped<O>>,
    },
}

impl<O> Receiver<O> {
    /// The next output; `None` once the call returned (every sender is
    /// gone). Cancel-safe: nothing is taken unless it is returned.
    async fn recv(&mut self) -> Option<Stamped<O>> {
        match self {
            Receiver::Local(rx) => rx.recv().await,
            Receiver::Remote { mailbox, batch } => {
                if batch.is_empty() {
                    if mailbox.recv_batch(batch, OUTPUT_QUEUE).await == 0 {
                        return None;
                    }
                    batch.reverse();
                }
                batch.pop()
            }
        }
    }
}

/// Aborts the provider call, on this core or on a worker core.
#[derive(Debug)]
enum Abort {
    Local(Rc<AbortSignal>),
    Remote(Arc<CrossAbort>),
}

/// The driver's end of a spawned provider task.
pub struct ProviderSide<O> {
    outputs: Receiver<O>,
    abort: Abort,
    /// The capacity permit of a call running on a worker core: it stays on
    /// the session core and is dropped when the worker reports the call's
    /// return (W10). `None` for a local call (its task holds the permit).
    held: Option<Permit>,
    /// When the provider call was spawned (metrics: provider TTFB).
    started_at: Instant,
}

impl<O> std::fmt::Debug for ProviderSide<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderSide")
            .field("abort", &self.abort)
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl<O> ProviderSide<O> {
    /// The session side of a call handed to a worker core: its output
    /// mailbox, its cross-core abort, and the permit held here until the
    /// mailbox ends (the call returned on the worker).
    pub(crate) fn remote(
        mailbox: Mailbox<Stamped<O>>,
        abort: Arc<CrossAbort>,
        permit: Option<Permit>,
        started_at: Instant,
    ) -> Self {
        Self {
            outputs: Receiver::Remote {
                mailbox,
                batch: Vec::with_capacity(OUTPUT_QUEUE),
            },
            abort: Abort::Remote(abort),
            held: permit,
            started_at,
        }
    }

    /// Aborts the provider call (idempotent): it is dropped on its core,
    /// closing its socket without a check-in.
    pub fn abort(&self) {
        match &self.abort {
            Abort::Local(signal) => signal.abort(),
            Abort::Remote(signal) => signal.abort(),
        }
    }

    /// The call returned: a permit held for it here is released now.
    fn returned(&mut self) {
        self.held = None;
    }

    /// The next output without its stamp; `None` (and the held permit
    /// released) once the call returned. For callers that read a call's
    /// outputs without a watchdog (tests, probes); attempts use [`drive`].
    pub async fn next_output(&mut self) -> Option<O> {
        match self.outputs.recv().await {
            Some(stamped) => Some(stamped.output),
            None => {
                self.returned();
                None
            }
        }
    }
}

impl<O> Drop for ProviderSide<O> {
    fn drop(&mut self) {
        // A call whose driver is gone has nobody to report to. (`drive`
        // only returns after the call's return, when this is a no-op.)
        if let Abort::Remote(signal) = &self.abort {
            signal.abort();
        }
    }
}

/// Starts the provider call of an attempt. With worker cores
/// ([`AttemptEnv::workers`]) the call goes to one of them and runs against
/// that core's pool, its outputs coming back over a bounded cross-core
/// mailbox; `permit` stays here until the worker reports the call's
/// return. Without, the call runs in a task on this core against
/// [`AttemptEnv::pool`], and that task holds `permit` until the call
/// returns or is aborted (W10).
pub fn spawn_provider<C: ProviderCall>(
    env: &AttemptEnv,
    permit: Option<Permit>,
    call: C,
) -> ProviderSide<C::Output> {
    match &env.workers {
        Some(workers) => workers.dispatch(permit, call),
        None => spawn_local(env.pool.clone(), permit, call),
    }
}

/// [`spawn_provider`] on this core.
fn spawn_local<C: ProviderCall>(
    pool: Rc<ProviderPool>,
    permit: Option<Permit>,
    call: C,
) -> ProviderSide<C::Output> {
    let (tx, rx) = channel::channel(OUTPUT_QUEUE);
    let abort = Rc::new(AbortSignal::default());
    let started_at = clock::now();
    let work = call.run(
        pool,
        OutputTx {
            tx: Sender::Local(tx),
        },
    );
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
        outputs: Receiver::Local(rx),
        abort: Abort::Local(abort),
        held: None,
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
                provider.returned();
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
                Action::CancelProvider => provider.abort(),
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
