//! The connectivity supervisor (S1–S3): one task dials the Edge and redials
//! after every disconnect, serially, under one policy.
//!
//! The policy decision is the pure [`next_step`]; [`run`] is the shell.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use iop_engine::conn::{spawn_conn, ConnConfig, SocketShutdown};
use iop_engine::http;
use iop_engine::rt::{Signal, SignalPipe};
use iop_engine::tls::NodeTlsConnector;
use iop_wire::checks::ReconnectPolicy;
use monoio::io::Splitable;

use crate::config::NodeConfig;
use crate::session::{self, SessionEnd};

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

/// How the process should exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Local shutdown (SIGTERM/SIGINT): exit 0.
    Shutdown,
    /// Finite reconnect attempts exhausted: exit 1.
    GaveUp,
}

enum Attempt {
    /// The session reached ready, then ended.
    WasReady(String),
    /// The attempt failed before ready.
    Failed(String),
}

async fn attempt(cfg: &NodeConfig, connector: Option<&NodeTlsConnector>) -> Attempt {
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
    match session::run(&cfg.node_id, conn, events).await {
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

/// Dials and redials until `shutdown` or exhaustion (S1–S3).
pub async fn run(
    cfg: NodeConfig,
    connector: Option<NodeTlsConnector>,
    mut shutdown: Shutdown,
) -> Exit {
    let mut failed_attempts: u32 = 0;
    loop {
        let outcome = monoio::select! {
            a = attempt(&cfg, connector.as_ref()) => a,
            _ = &mut shutdown => return Exit::Shutdown,
        };
        match outcome {
            Attempt::WasReady(reason) => {
                failed_attempts = 0;
                tracing::warn!(%reason, "disconnected from the edge; reconnecting");
                failed_attempts += 1;
            }
            Attempt::Failed(reason) => {
                failed_attempts += 1;
                tracing::warn!(attempt = failed_attempts, %reason, "connection attempt failed");
            }
        }
        match next_step(&cfg.reconnect, failed_attempts) {
            Step::GiveUp => {
                tracing::error!(
                    attempts = failed_attempts,
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
}
