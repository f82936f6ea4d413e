//! Normalized runs (`RunRequest` → `RunEvent`s, E1): the admission checks
//! every run passes before any provider call. The provider adapters that
//! produce [`RunOutput`](crate::emit::RunOutput)s (Ollama NDJSON, OpenAI
//! SSE) are not part of this Node version: an admitted run ends with one
//! `error` terminal (`unsupported`), so the Edge's lease is released. When
//! they arrive, they plug into [`crate::driver::drive`] with a
//! [`RunEmitter`], exactly as tunnels do with a `TunnelEmitter`.

use iop_wire::pb;

use crate::adapters::Adapters;
use crate::driver::{self, AttemptEnv};
use crate::emit::{Emitter, RunEmitter};
use crate::tunnel::codes;
use crate::watchdog::RuntimeSettings;

/// Failure code of an admitted run this Node cannot execute yet.
pub const UNSUPPORTED: &str = "unsupported";

/// Checks a run (W1 first, before any router or provider call) and returns
/// the failure terminal's code and message.
pub fn admit(
    req: &pb::RunRequest,
    adapters: &Adapters,
    settings: RuntimeSettings,
) -> (&'static str, String) {
    if let Err(e) = settings.watchdog_config(req.response_stall_timeout_ms) {
        return (codes::INVALID_STALL_TIMEOUT, e.to_string());
    }
    if adapters.get(&req.adapter).is_none() {
        return (
            codes::UNKNOWN_ADAPTER,
            format!("no adapter instance named `{}` on this node", req.adapter),
        );
    }
    (
        UNSUPPORTED,
        "normalized runs are not supported by this node version".to_string(),
    )
}

/// Serves one run: its single terminal.
pub async fn serve(
    env: &AttemptEnv,
    req: pb::RunRequest,
    adapters: &Adapters,
    settings: RuntimeSettings,
) {
    let (code, message) = admit(&req, adapters, settings);
    let mut emit = RunEmitter::new(&req.run_id, &req.adapter, &req.target, &req.session_id);
    if let Some(frame) = emit.failed(code, &message) {
        driver::send(&env.conn, frame).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // CONTRACT: W1 — a normalized run with a negative or overflowing stall
    // timeout is rejected before anything else.
    #[test]
    fn stall_timeout_is_checked_first() {
        let adapters = Adapters::default();
        let settings = RuntimeSettings::default();
        let req = |ms| pb::RunRequest {
            run_id: "r".into(),
            adapter: "nope".into(),
            response_stall_timeout_ms: ms,
            ..Default::default()
        };
        assert_eq!(
            admit(&req(-1), &adapters, settings),
            (
                codes::INVALID_STALL_TIMEOUT,
                "response_stall_timeout_ms must not be negative (got -1)".to_string()
            )
        );
        assert_eq!(
            admit(&req(i64::MAX), &adapters, settings).0,
            codes::INVALID_STALL_TIMEOUT
        );
        assert_eq!(
            admit(&req(0), &adapters, settings).0,
            codes::UNKNOWN_ADAPTER
        );
    }
}
