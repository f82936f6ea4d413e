//! The connectivity supervisor (S1–S3): one task dials the Edge and redials
//! after every disconnect, serially, under one policy.
//!
//! ```text
//!  start ─► dial ─► session ─► ended ─┐          S1: the first dial needs no Edge
//!    ▲        │ failed before ready   │ was ready: budget resets
//!    │        ▼                        ▼
//!    └── RetryAfter(interval ± jitter) ◄── Supervisor::on_attempt_end ──► GiveUp (exit 1, S3)
//!  SIGTERM/SIGINT at any point ─► Shutdown (exit 0, S3)
//! ```
//!
//! Every wait is jittered ([`Jitter`], `reconnect.jitter_percent`, 50 by
//! default): uniform over `interval × (1 ± jitter)`, so `interval_sec`
//! stays the mean wait while a fleet that lost its Edge in one instant
//! redials spread over the whole window instead of in one burst. The
//! draws come from a generator seeded from the OS in the binary and
//! injected in tests ([`iop_engine::rng::SplitMix64`]).
//!
//! Shutdown drains ([`run_until`]): no more redials; the ready session's
//! Edge is told `NodeDraining` (when it accepts it: [`NodeCore::begin_drain`])
//! and sends no new work; the session keeps serving until its active runs
//! and tunnels are released or `drain_grace_ms` elapses, then its
//! connection is closed (`Close` with reason `shutdown`). A second signal
//! ends the drain at once. Before a session is ready there is nothing to
//! drain: the attempt is dropped.
//!
//! One attempt may try several Edges: every address of `edge_addr`, in a
//! fresh random order, until one gives a ready session ([`crate::edges`]);
//! the attempt fails, and the wait above applies, only when all failed. A
//! session that was ready and ended starts the next attempt with a fresh
//! order, so a Node whose Edge died lands on another.
//!
//! The policy decision is the pure [`Supervisor`] (and [`next_step`]);
//! [`run`] is the shell. Local configuration and credential errors never
//! reach the supervisor: the binary exits 1 before it starts (S3).

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::time::Duration;

use iop_engine::conn::{spawn_conn, ConnConfig, SocketShutdown};
use iop_engine::rng::SplitMix64;
use iop_engine::tls::NodeTlsConnector;
use iop_wire::checks::ReconnectPolicy;
use iop_wire::CloseReason;
use monoio::io::Splitable;
use tracing::Instrument;

use crate::calls::workers::Workers;
use crate::config::NodeConfig;
use crate::credentials::NodeCredentials;
use crate::edges::{self, AttemptFailures, Candidate, CandidateFailure, EdgeTls};
use crate::session::{self, NodeCore, SessionEnd};

/// The spread of every reconnect wait; [`Supervisor::new`] takes one.
pub use crate::jitter::Jitter;

/// What the supervisor does after a connection attempt or session ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Wait this long, then dial again.
    RetryAfter(Duration),
    /// The attempt budget is spent: exit 1 (S3).
    GiveUp,
}

/// The reconnect decision (S2, S3) before jitter. `failed_attempts`
/// counts consecutive attempts that did not reach a ready session,
/// including the one that just ended; a session that became ready resets
/// the count to 0 before calling.
pub fn next_step(policy: &ReconnectPolicy, failed_attempts: u32) -> Step {
    if policy.allows_attempt(failed_attempts) {
        Step::RetryAfter(policy.interval)
    } else {
        Step::GiveUp
    }
}

/// How one connection attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// The session reached ready, then ended (a retryable remote failure).
    WasReady,
    /// The attempt failed before ready: dial, TLS, registration or ready
    /// refused (retryable remote failures).
    Failed,
}

/// The reconnect accounting (S2, S3): consecutive failed attempts since the
/// last ready session, against the policy's budget, and the jittered wait
/// before the next attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Supervisor {
    policy: ReconnectPolicy,
    jitter: Jitter,
    rng: SplitMix64,
    failed_attempts: u32,
}

impl Supervisor {
    /// A supervisor with a fresh budget, drawing its jitter from `rng`.
    pub fn new(policy: ReconnectPolicy, jitter: Jitter, rng: SplitMix64) -> Self {
        Self {
            policy,
            jitter,
            rng,
            failed_attempts: 0,
        }
    }

    /// Consecutive failed attempts so far.
    pub fn failed_attempts(&self) -> u32 {
        self.failed_attempts
    }

    /// What to do after an attempt ended. A session that was ready resets
    /// the budget: the reconnects after it get the full `max_attempts`.
    pub fn on_attempt_end(&mut self, outcome: AttemptOutcome) -> Step {
        let step = match outcome {
            AttemptOutcome::WasReady => {
                self.failed_attempts = 0;
                Step::RetryAfter(self.policy.interval)
            }
            AttemptOutcome::Failed => {
                self.failed_attempts = self.failed_attempts.saturating_add(1);
                next_step(&self.policy, self.failed_attempts)
            }
        };
        match step {
            Step::RetryAfter(interval) => {
                Step::RetryAfter(self.jitter.spread(interval, self.rng.next_u64()))
            }
            Step::GiveUp => Step::GiveUp,
        }
    }
}

/// How the process should exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Local shutdown (SIGTERM/SIGINT): exit 0.
    Shutdown,
    /// Finite reconnect attempts exhausted: exit 1.
    GaveUp,
    /// A local credential error found by [`run`] (the recipient key file
    /// of `[credentials]` is unusable): exit 1 (S3).
    LocalError,
}

enum Attempt {
    /// The session reached ready, then ended.
    WasReady(CloseReason),
    /// The attempt failed before ready.
    Failed(String),
}

/// The longest one Edge address may take to give a TLS session (TCP
/// connect and handshake): an Edge machine that went away silently (its
/// packets dropped, not refused) costs this, not the kernel's minutes of
/// SYN retries, before the next address of the list is tried.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// One attempt (S1, S2): the Edges' addresses resolved and shuffled
/// ([`edges::dial_order`]), then tried in that order until one gives a
/// ready session; the attempt fails only when every one failed.
async fn attempt(
    cfg: &NodeConfig,
    core: &Rc<NodeCore>,
    tls: Option<&EdgeTls>,
    order: &mut SplitMix64,
) -> Attempt {
    let mut failures = AttemptFailures::default();
    let resolved = edges::resolve_candidates(&cfg.edge_addr, &mut failures).await;
    let candidates = edges::dial_order(resolved, order);
    let last = candidates.len().saturating_sub(1);
    for (i, candidate) in candidates.iter().enumerate() {
        let failure = match attempt_at(cfg, core, tls, candidate).await {
            Ok(reason) => return Attempt::WasReady(reason),
            Err(failure) => failure,
        };
        if i < last {
            tracing::info!(
                edge_addr = %candidate,
                reason = %failure.message(),
                "edge address failed; trying the next"
            );
        }
        match failure {
            // A dial failure's message names the address already.
            CandidateFailure::Dial(_) => failures.push(None, failure),
            _ => failures.push(Some(candidate.to_string()), failure),
        }
    }
    Attempt::Failed(failures.reason())
}

/// A session with the Edge at `candidate`: `Ok` with the reason it ended
/// once it was ready, `Err` when it never was.
async fn attempt_at(
    cfg: &NodeConfig,
    core: &Rc<NodeCore>,
    tls: Option<&EdgeTls>,
    candidate: &Candidate,
) -> Result<CloseReason, CandidateFailure> {
    let timed_out = || {
        CandidateFailure::Dial(format!(
            "dial {candidate}: no TLS session within {} s",
            DIAL_TIMEOUT.as_secs()
        ))
    };
    let deadline = iop_engine::clock::now() + DIAL_TIMEOUT;
    let tcp = monoio::time::timeout(DIAL_TIMEOUT, edges::connect(candidate))
        .await
        .map_err(|_| timed_out())??;
    let conn_config = ConnConfig::from_env_override();
    let (edge_name, (conn, events)) = match tls {
        Some(tls) => {
            let left = deadline.saturating_duration_since(iop_engine::clock::now());
            let link = monoio::time::timeout(left, tls.handshake(candidate, tcp))
                .await
                .map_err(|_| timed_out())??;
            // Which Edge, and which of its certificates (a rotation shows).
            tracing::info!(
                peer = %link.edge.id.uri(),
                cert_serial = %link.edge.serial_hex,
                edge_addr = %candidate,
                "edge TLS identity verified"
            );
            let name = link.edge.id.name().to_owned();
            let (r, w) = link.tls.into_split();
            (name, spawn_conn(r, w, link.shutdown, conn_config))
        }
        None => {
            let shutdown = SocketShutdown::for_socket(&tcp);
            let (r, w) = tcp.into_split();
            (
                "unverified (insecure_plaintext)".to_owned(),
                spawn_conn(r, w, shutdown, conn_config),
            )
        }
    };
    // The session's lines (its "session ready" first) say which Edge.
    let span = tracing::info_span!("edge", edge_addr = %candidate, %edge_name);
    match session::run(&cfg.node_id, core, conn, events)
        .instrument(span)
        .await
    {
        SessionEnd::NotReady(reason) => Err(CandidateFailure::Session(reason)),
        SessionEnd::Ended(reason) => Ok(reason),
    }
}

/// Completes when the process should stop (SIGTERM/SIGINT in the binary).
pub type Shutdown = iop_engine::rt::StopFuture;

/// When and how the Node stops.
pub struct Stop {
    /// Completes on the first SIGTERM/SIGINT: the drain begins.
    pub shutdown: Shutdown,
    /// Completes on the second: the drain ends at once.
    pub force: Shutdown,
    /// How long active runs and tunnels may finish (`drain_grace_ms`).
    pub drain_grace: Duration,
}

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("drain_grace", &self.drain_grace)
            .finish_non_exhaustive()
    }
}

/// How long the end of a drain waits for the closed session to end (the
/// connection's own close linger bounds it first).
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The wait before the next dial, in ms, for the log (`None`: giving up).
fn retry_in_ms(step: Step) -> Option<u64> {
    match step {
        Step::RetryAfter(wait) => Some(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)),
        Step::GiveUp => None,
    }
}

/// `"; redialling in 1.3s"` for the log message (empty when giving up).
fn retry_in_text(step: Step) -> String {
    match step {
        Step::RetryAfter(wait) => format!("; redialling in {:.1}s", wait.as_secs_f64()),
        Step::GiveUp => String::new(),
    }
}

/// The first SIGTERM/SIGINT (drain) and the second (stop at once); see
/// [`iop_engine::rt::stop_signals`].
pub fn signal_stops() -> std::io::Result<(Shutdown, Shutdown)> {
    iop_engine::rt::stop_signals()
}

/// Dials and redials until `shutdown` or exhaustion (S1–S3). Loads the
/// credential plane of `cfg` first; an unusable recipient key ends with
/// [`Exit::LocalError`] (the binary loads it itself to report the file and
/// reason, and calls [`run_with_credentials`]).
pub async fn run(cfg: NodeConfig, connector: Option<NodeTlsConnector>, shutdown: Shutdown) -> Exit {
    match NodeCredentials::load(&cfg) {
        Ok(credentials) => run_with_credentials(cfg, connector, credentials, shutdown).await,
        Err(e) => {
            tracing::error!(error = %e, "credential plane cannot be loaded");
            Exit::LocalError
        }
    }
}

/// [`run`] with the credential plane already loaded (`None` = unmanaged,
/// C2, C3). `shutdown` stops without a drain grace: a ready session is
/// closed at once.
pub async fn run_with_credentials(
    cfg: NodeConfig,
    connector: Option<NodeTlsConnector>,
    credentials: Option<NodeCredentials>,
    shutdown: Shutdown,
) -> Exit {
    let stop = Stop {
        shutdown,
        force: Box::pin(std::future::pending()),
        drain_grace: Duration::ZERO,
    };
    run_until(cfg, connector, credentials, stop).await
}

/// Dials and redials until `stop.shutdown` or exhaustion (S1–S3), then
/// drains (see the module docs) and returns [`Exit::Shutdown`]. `connector`
/// accepts the one Edge name it was built with (the first of
/// `cfg.edge_name`); [`run_sharded`] takes an [`EdgeTls`] that accepts
/// every listed name.
pub async fn run_until(
    cfg: NodeConfig,
    connector: Option<NodeTlsConnector>,
    credentials: Option<NodeCredentials>,
    stop: Stop,
) -> Exit {
    let tls = connector.map(|c| EdgeTls::single(cfg.edge_name.first(), c));
    run_sharded(cfg, tls, credentials, stop, None).await
}

/// [`run_until`] on the control shard of a multi-core node: provider
/// calls go to `workers` (`None`: they run on this core); `tls` (`None`:
/// plain TCP, T5) accepts the Edge names it was built with.
pub async fn run_sharded(
    cfg: NodeConfig,
    tls: Option<EdgeTls>,
    credentials: Option<NodeCredentials>,
    stop: Stop,
    workers: Option<Workers>,
) -> Exit {
    let Stop {
        mut shutdown,
        force,
        drain_grace,
    } = stop;
    let core = NodeCore::start_with_workers(credentials, workers);
    // `[tracing]`: provider-call spans, exported from a thread of their own.
    if let Some(spec) = &cfg.tracing {
        match iop_engine::trace::start_export(spec, iop_engine::metrics::Side::Node) {
            Ok(export) => {
                tracing::info!(
                    otlp_endpoint = spec.otlp_endpoint.as_str(),
                    sample_ratio = spec.sample_ratio,
                    "tracing on"
                );
                core.trace_with(iop_engine::trace::Tracer::for_spec(spec, export));
            }
            Err(e) => tracing::error!(error = %e, "the OTLP exporter cannot start; tracing is off"),
        }
    }
    // `[metrics] textfile`: rewritten every interval for node_exporter.
    if let Err(e) = crate::metrics::spawn_textfile_writer(&cfg.metrics) {
        tracing::error!(error = %e, "metrics textfile writer not started");
    }
    let mut supervisor =
        Supervisor::new(cfg.reconnect, cfg.reconnect_jitter, SplitMix64::from_os());
    // Each attempt's order of the Edges' addresses: seeded from the OS, so
    // the Nodes of a fleet spread over the Edges.
    let mut dial_order = SplitMix64::from_os();
    loop {
        let mut current = std::pin::pin!(attempt(&cfg, &core, tls.as_ref(), &mut dial_order));
        let outcome = monoio::select! {
            a = &mut current => a,
            _ = &mut shutdown => {
                drain(&core, current, force, drain_grace).await;
                return Exit::Shutdown;
            }
        };
        let step = match outcome {
            Attempt::WasReady(reason) => {
                let step = supervisor.on_attempt_end(AttemptOutcome::WasReady);
                tracing::warn!(
                    %reason,
                    retry_in_ms = retry_in_ms(step),
                    "disconnected from the edge; reconnecting{}",
                    retry_in_text(step)
                );
                step
            }
            Attempt::Failed(reason) => {
                let step = supervisor.on_attempt_end(AttemptOutcome::Failed);
                tracing::warn!(
                    attempt = supervisor.failed_attempts(),
                    %reason,
                    retry_in_ms = retry_in_ms(step),
                    "connection attempt failed{}",
                    retry_in_text(step)
                );
                step
            }
        };
        match step {
            Step::GiveUp => {
                tracing::error!(
                    attempts = supervisor.failed_attempts(),
                    "reconnect attempts exhausted (reconnect.max_attempts); exiting"
                );
                return Exit::GaveUp;
            }
            Step::RetryAfter(wait) => {
                monoio::select! {
                    _ = monoio::time::sleep(wait) => {},
                    _ = &mut shutdown => return Exit::Shutdown,
                }
            }
        }
    }
}

/// The shutdown drain of `attempt` (not finished): tell the Edge, then wait
/// for the active runs, the grace, a second signal or the session's end;
/// then close a ready session and give it [`CLOSE_WAIT`] to end.
async fn drain<A>(core: &NodeCore, mut attempt: Pin<&mut A>, mut force: Shutdown, grace: Duration)
where
    A: Future<Output = Attempt>,
{
    // First, so that no new run is sent while the runs are waited for.
    let notice = core.begin_drain();
    tracing::info!(
        ?notice,
        active_runs = core.active_runs(),
        drain_grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
        "draining: no more redials; waiting for active runs"
    );
    // `Drained` promises the Edge that every run started here has ended
    // (its terminal is queued before the `Close`): the Edge then sends
    // again, elsewhere or to our next process, any run still on its way.
    let reason = monoio::select! {
        _ = core.runs_released() => {
            tracing::info!("drained: every run and tunnel released");
            CloseReason::Drained
        }
        _ = attempt.as_mut() => {
            tracing::info!("the edge connection ended during the drain");
            return;
        }
        _ = monoio::time::sleep(grace) => {
            tracing::warn!(
                active_runs = core.active_runs(),
                "drain_grace_ms elapsed; closing with runs active"
            );
            CloseReason::Shutdown
        }
        _ = &mut force => {
            tracing::warn!(active_runs = core.active_runs(), "second signal; stopping at once");
            return;
        }
    };
    if core.close_ready_session(reason) {
        monoio::select! {
            _ = attempt.as_mut() => {},
            _ = monoio::time::sleep(CLOSE_WAIT) => {},
            _ = &mut force => {},
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A supervisor without jitter: every wait is the interval.
    fn exact(policy: ReconnectPolicy) -> Supervisor {
        Supervisor::new(policy, Jitter::NONE, SplitMix64::new(0))
    }

    // CONTRACT: S2, S3 — finite budgets give up after exactly that many
    // failed attempts; unlimited never gives up.
    #[test]
    fn policy_steps() {
        let two = ReconnectPolicy::from_config(Some(3), Some(2)).unwrap();
        assert_eq!(next_step(&two, 1), Step::RetryAfter(Duration::from_secs(3)));
        assert_eq!(next_step(&two, 2), Step::GiveUp);
        let unlimited = ReconnectPolicy::from_config(Some(1), Some(0)).unwrap();
        assert_eq!(
            next_step(&unlimited, 1_000_000),
            Step::RetryAfter(Duration::from_secs(1))
        );
        let default = ReconnectPolicy::from_config(None, None).unwrap();
        assert_eq!(
            next_step(&default, 9),
            Step::RetryAfter(Duration::from_secs(10))
        );
        assert_eq!(next_step(&default, 10), Step::GiveUp);
    }

    // CONTRACT: S2 — `max_attempts = 2`: exactly two failed attempts, then
    // give up; the wait between them is the interval.
    #[test]
    fn finite_budget_counts_consecutive_failures() {
        let policy = ReconnectPolicy::from_config(Some(1), Some(2)).unwrap();
        let mut s = exact(policy);
        assert_eq!(
            s.on_attempt_end(AttemptOutcome::Failed),
            Step::RetryAfter(Duration::from_secs(1))
        );
        assert_eq!(s.on_attempt_end(AttemptOutcome::Failed), Step::GiveUp);
        assert_eq!(s.failed_attempts(), 2);
    }

    // CONTRACT: S1, S2 — a ready session resets the budget: after an Edge
    // restart the Node gets `max_attempts` fresh attempts.
    #[test]
    fn ready_session_resets_the_budget() {
        let policy = ReconnectPolicy::from_config(Some(2), Some(2)).unwrap();
        let mut s = exact(policy);
        assert_eq!(
            s.on_attempt_end(AttemptOutcome::Failed),
            Step::RetryAfter(Duration::from_secs(2))
        );
        assert_eq!(
            s.on_attempt_end(AttemptOutcome::WasReady),
            Step::RetryAfter(Duration::from_secs(2))
        );
        assert_eq!(s.failed_attempts(), 0);
        assert_eq!(
            s.on_attempt_end(AttemptOutcome::Failed),
            Step::RetryAfter(Duration::from_secs(2))
        );
        assert_eq!(s.on_attempt_end(AttemptOutcome::Failed), Step::GiveUp);
    }

    // CONTRACT: S1, S2 — unlimited (`max_attempts = 0`): an Edge that is
    // down at start or forever never ends the process.
    #[test]
    fn unlimited_never_gives_up() {
        let policy = ReconnectPolicy::from_config(Some(3), Some(0)).unwrap();
        let mut s = exact(policy);
        for _ in 0..10_000 {
            assert_eq!(
                s.on_attempt_end(AttemptOutcome::Failed),
                Step::RetryAfter(Duration::from_secs(3))
            );
        }
        assert_eq!(s.failed_attempts(), 10_000);
    }

    // CONTRACT: S2 — omitted settings: 10 attempts, 10 s apart; one attempt
    // budget gives up after the first failure.
    #[test]
    fn defaults_and_single_attempt() {
        let mut s = exact(ReconnectPolicy::from_config(None, None).unwrap());
        for _ in 0..9 {
            assert_eq!(
                s.on_attempt_end(AttemptOutcome::Failed),
                Step::RetryAfter(Duration::from_secs(10))
            );
        }
        assert_eq!(s.on_attempt_end(AttemptOutcome::Failed), Step::GiveUp);
        let mut one = exact(ReconnectPolicy::from_config(Some(1), Some(1)).unwrap());
        assert_eq!(one.on_attempt_end(AttemptOutcome::Failed), Step::GiveUp);
    }

    /// The waits `draws` attempt ends give under `jitter`, in ms.
    fn waits_ms(interval_s: i64, jitter: Jitter, seed: u64, draws: usize) -> Vec<u64> {
        let policy = ReconnectPolicy::from_config(Some(interval_s), Some(0)).unwrap();
        let mut s = Supervisor::new(policy, jitter, SplitMix64::new(seed));
        (0..draws)
            .map(|i| {
                let outcome = if i % 3 == 0 {
                    AttemptOutcome::WasReady
                } else {
                    AttemptOutcome::Failed
                };
                match s.on_attempt_end(outcome) {
                    Step::RetryAfter(wait) => wait.as_millis() as u64,
                    Step::GiveUp => panic!("unlimited attempts gave up"),
                }
            })
            .collect()
    }

    // CONTRACT: S2 — reconnect waits are jittered around
    // `reconnect.interval_sec`, which stays their mean: with the default
    // ±50 % the waits of a 10 s interval cover 5–15 s evenly (ten 1 s
    // buckets each near a tenth of the draws) and average 10 s, after a
    // ready session as after a failed attempt. A fleet that lost its Edge
    // together does not redial together.
    #[test]
    fn reconnect_waits_spread_evenly_around_the_interval() {
        let waits = waits_ms(10, Jitter::DEFAULT, 7, 20_000);
        let (min, max) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(*min >= 5_000 && *max < 15_000, "{min}..{max}");
        // Draws cover the window's ends, not a narrow middle.
        assert!(*min < 5_100 && *max > 14_900, "{min}..{max}");
        let mean = waits.iter().sum::<u64>() as f64 / waits.len() as f64;
        assert!((mean - 10_000.0).abs() < 50.0, "mean {mean} ms");
        let mut buckets = [0u32; 10];
        for w in &waits {
            buckets[((w - 5_000) / 1_000) as usize] += 1;
        }
        // 2,000 expected per bucket; 1,750 is more than five sigma away.
        assert!(buckets.iter().all(|&b| b > 1_750), "{buckets:?}");
        // Different nodes (seeds) wait differently; one seed replays.
        assert_ne!(waits_ms(10, Jitter::DEFAULT, 8, 10), waits[..10]);
        assert_eq!(waits_ms(10, Jitter::DEFAULT, 7, 10), waits[..10]);
    }

    // CONTRACT: S2 — no jitter: every wait is the interval; full jitter
    // spreads over 0–2 intervals with the same mean.
    #[test]
    fn jitter_bounds_from_none_to_full() {
        assert!(waits_ms(3, Jitter::NONE, 1, 1_000)
            .iter()
            .all(|&w| w == 3_000));
        let full = waits_ms(2, Jitter::new(100).unwrap(), 1, 20_000);
        assert!(full.iter().all(|&w| w < 4_000));
        assert!(full.iter().any(|&w| w < 200) && full.iter().any(|&w| w > 3_800));
        let mean = full.iter().sum::<u64>() as f64 / full.len() as f64;
        assert!((mean - 2_000.0).abs() < 40.0, "mean {mean} ms");
    }

    // CONTRACT: S2, S3 — jitter never changes the budget: a finite budget
    // still gives up after exactly that many failed attempts.
    #[test]
    fn jitter_keeps_the_attempt_budget() {
        let policy = ReconnectPolicy::from_config(Some(1), Some(3)).unwrap();
        let mut s = Supervisor::new(policy, Jitter::DEFAULT, SplitMix64::new(5));
        for _ in 0..2 {
            let Step::RetryAfter(wait) = s.on_attempt_end(AttemptOutcome::Failed) else {
                panic!("gave up early");
            };
            assert!(wait >= Duration::from_millis(500) && wait < Duration::from_millis(1_500));
        }
        assert_eq!(s.on_attempt_end(AttemptOutcome::Failed), Step::GiveUp);
    }

    /// Spawns `drain` of an attempt that never ends on its own (no ready
    /// session); the flag turns true when the drain returns.
    fn spawn_drain(
        core: &Rc<NodeCore>,
        force: Shutdown,
        grace: Duration,
    ) -> (Rc<std::cell::Cell<bool>>, monoio::task::JoinHandle<()>) {
        let done = Rc::new(std::cell::Cell::new(false));
        let handle = {
            let (core, done) = (core.clone(), done.clone());
            monoio::spawn(async move {
                let attempt = std::pin::pin!(std::future::pending::<Attempt>());
                drain(&core, attempt, force, grace).await;
                done.set(true);
            })
        };
        (done, handle)
    }

    // CONTRACT: S3 — the shutdown drain waits for the active runs and
    // tunnels to be released (then the session is closed and the process
    // exits 0); with none active it ends at once.
    #[monoio::test_all(timer_enabled = true)]
    async fn drain_waits_for_every_active_run() {
        let core = NodeCore::start();
        let (done, handle) = spawn_drain(
            &core,
            Box::pin(std::future::pending()),
            Duration::from_secs(3600),
        );
        handle.await;
        assert!(done.get(), "nothing active: the drain ends at once");

        let first = core.run_started();
        let second = core.run_started();
        assert_eq!(core.active_runs(), 2);
        let (done, handle) = spawn_drain(
            &core,
            Box::pin(std::future::pending()),
            Duration::from_secs(3600),
        );
        monoio::time::sleep(Duration::from_millis(1)).await;
        assert!(!done.get());
        drop(first);
        monoio::time::sleep(Duration::from_millis(1)).await;
        assert!(!done.get(), "one run is still active");
        drop(second);
        handle.await;
        assert!(done.get());
        assert_eq!(core.active_runs(), 0);
        assert!(
            !core.close_ready_session(CloseReason::Shutdown),
            "no session was ready"
        );
    }

    // CONTRACT: S3 — the grace bounds the drain, and a second signal ends it
    // at once, with runs still active.
    #[monoio::test_all(timer_enabled = true)]
    async fn drain_ends_at_the_grace_or_the_second_signal() {
        let core = NodeCore::start();
        let _active = core.run_started();
        let (done, handle) = spawn_drain(
            &core,
            Box::pin(std::future::pending()),
            Duration::from_millis(5),
        );
        handle.await;
        assert!(done.get());
        assert_eq!(core.active_runs(), 1);

        let (second_tx, second_rx) = iop_engine::sync::oneshot::channel::<()>();
        let force: Shutdown = Box::pin(async move {
            let _ = second_rx.await;
        });
        let (done, handle) = spawn_drain(&core, force, Duration::from_secs(3600));
        monoio::time::sleep(Duration::from_millis(1)).await;
        assert!(!done.get());
        let _ = second_tx.send(());
        handle.await;
        assert!(done.get());
        assert_eq!(core.active_runs(), 1);
    }
}
