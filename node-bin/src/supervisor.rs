//! The connectivity supervisor (S1–S3): one task dials the Edge and redials
//! after every disconnect, serially, under one policy.
//!
//! ```text
//!  start ─► dial ─► session ─► ended ─┐          S1: the first dial needs no Edge
//!    ▲        │ failed before ready   │ was ready: budget resets
//!    │        ▼                        ▼
//!    └── RetryAfter(interval) ◄── Supervisor::on_attempt_end ──► GiveUp (exit 1, S3)
//!  SIGTERM/SIGINT at any point ─► Shutdown (exit 0, S3)
//! ```
//!
//! The policy decision is the pure [`Supervisor`] (and [`next_step`]);
//! [`run`] is the shell. Local configuration and credential errors never
//! reach the supervisor: the binary exits 1 before it starts (S3).

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::time::Duration;

use iop_engine::conn::{spawn_conn, ConnConfig, SocketShutdown};
use iop_engine::http;
use iop_engine::rt::{Signal, SignalPipe};
use iop_engine::tls::NodeTlsConnector;
use iop_wire::checks::ReconnectPolicy;
use monoio::io::Splitable;

use crate::config::NodeConfig;
use crate::credentials::NodeCredentials;
use crate::session::{self, NodeCore, SessionEnd};

/// What the supervisor does after a connection attempt or session ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Wait this long, then dial again.
    RetryAfter(Duration),
    /// The attempt budget is spent: exit 1 (S3).
    GiveUp,
}

/// The reconnect decision (S2, S3). `failed_attempts` counts consecutive
/// attempts that did not reach a ready session, including the one that just
/// ended; a session that became ready resets the count to 0 before calling.
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
/// last ready session, against the policy's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Supervisor {
    policy: ReconnectPolicy,
    failed_attempts: u32,
}

impl Supervisor {
    /// A supervisor with a fresh budget.
    pub fn new(policy: ReconnectPolicy) -> Self {
        Self {
            policy,
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
        match outcome {
            AttemptOutcome::WasReady => {
                self.failed_attempts = 0;
                Step::RetryAfter(self.policy.interval)
            }
            AttemptOutcome::Failed => {
                self.failed_attempts = self.failed_attempts.saturating_add(1);
                next_step(&self.policy, self.failed_attempts)
            }
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
    WasReady(String),
    /// The attempt failed before ready.
    Failed(String),
}

async fn attempt(
    cfg: &NodeConfig,
    core: &Rc<NodeCore>,
    connector: Option<&NodeTlsConnector>,
) -> Attempt {
    let tcp = match http::connect(cfg.edge_addr.to_string()).await {
        Ok(tcp) => tcp,
        Err(e) => return Attempt::Failed(format!("dial {}: {e}", cfg.edge_addr)),
    };
    let shutdown = SocketShutdown::for_socket(&tcp);
    let conn_config = ConnConfig::from_env_override();
    let (conn, events) = match connector {
        Some(connector) => match connector.connect(tcp).await {
            Ok(tls) => {
                let (r, w) = tls.into_split();
                spawn_conn(r, w, shutdown, conn_config)
            }
            Err(e) => return Attempt::Failed(format!("tls handshake with the edge: {e}")),
        },
        None => {
            let (r, w) = tcp.into_split();
            spawn_conn(r, w, shutdown, conn_config)
        }
    };
    match session::run(&cfg.node_id, core, conn, events).await {
        SessionEnd::NotReady(reason) => Attempt::Failed(reason),
        SessionEnd::Ended(reason) => Attempt::WasReady(reason),
    }
}

/// Completes when the process should stop (SIGTERM/SIGINT in the binary).
pub type Shutdown = Pin<Box<dyn Future<Output = ()>>>;

/// A [`Shutdown`] that completes on SIGTERM or SIGINT.
pub fn signal_shutdown() -> std::io::Result<Shutdown> {
    let mut term = SignalPipe::install(Signal::Term)?;
    let mut int = SignalPipe::install(Signal::Int)?;
    Ok(Box::pin(async move {
        monoio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    }))
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
/// C2, C3).
pub async fn run_with_credentials(
    cfg: NodeConfig,
    connector: Option<NodeTlsConnector>,
    credentials: Option<NodeCredentials>,
    mut shutdown: Shutdown,
) -> Exit {
    let core = NodeCore::start_with_credentials(credentials);
    let mut supervisor = Supervisor::new(cfg.reconnect);
    loop {
        let outcome = monoio::select! {
            a = attempt(&cfg, &core, connector.as_ref()) => a,
            _ = &mut shutdown => return Exit::Shutdown,
        };
        let step = match outcome {
            Attempt::WasReady(reason) => {
                tracing::warn!(%reason, "disconnected from the edge; reconnecting");
                supervisor.on_attempt_end(AttemptOutcome::WasReady)
            }
            Attempt::Failed(reason) => {
                let step = supervisor.on_attempt_end(AttemptOutcome::Failed);
                tracing::warn!(
                    attempt = supervisor.failed_attempts(),
                    %reason,
                    "connection attempt failed"
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut s = Supervisor::new(policy);
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
        let mut s = Supervisor::new(policy);
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
        let mut s = Supervisor::new(policy);
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
        let mut s = Supervisor::new(ReconnectPolicy::from_config(None, None).unwrap());
        for _ in 0..9 {
            assert_eq!(
                s.on_attempt_end(AttemptOutcome::Failed),
                Step::RetryAfter(Duration::from_secs(10))
            );
        }
        assert_eq!(s.on_attempt_end(AttemptOutcome::Failed), Step::GiveUp);
        let mut one = Supervisor::new(ReconnectPolicy::from_config(Some(1), Some(1)).unwrap());
        assert_eq!(one.on_attempt_end(AttemptOutcome::Failed), Step::GiveUp);
    }
}
