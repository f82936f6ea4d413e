//! Normalized runs (`RunRequest` → `RunEvent`s, E1): admission, then one
//! provider call by the adapter's protocol, watched by the stall watchdog
//! exactly like a tunnel (W3–W10).
//!
//! ```text
//! Edge ──RunRequest──► admit: W1 check, adapter, gate (P4)
//!        ─► provider call (calls::run: Ollama NDJSON | OpenAI SSE, E4, E5)
//!              ──RunOutput──► attempt::drive (watchdog) ──► RunEmitter
//!      ◄── start, delta*, complete | error | cancelled ◄───────┘
//! ```
//!
//! Every rejection before the provider call (bad stall timeout, unknown
//! adapter, an operation the adapter does not run, full gate) is one `error` terminal and opens no provider
//! connection (W1, W6).

use std::future::Future;
use std::rc::Rc;

use iop_wire::pb;

use super::runs::RunStart;
use crate::adapters::{AdapterInstance, Adapters, Permit};
use crate::attempt::emit::{Emitter, Outbound, RunEmitter};
use crate::attempt::flow::{FlowGate, WindowTooSmall};
use crate::attempt::watchdog::{RuntimeSettings, WatchdogConfig};
use crate::attempt::{self, Attempt, AttemptEnv, Ended};
use crate::calls::normalize::CallFailure;
use crate::calls::run::{RunCall, RunOperation};
use crate::codes;
use crate::trace::{self, CallLabels, ProviderSpan};

/// Serves one run to its release: the terminal is sent and the provider
/// call has returned (W10). `stop` fires on `CancelRequest` (K1) or session
/// end (F5).
///
/// Everything before the provider call runs here, at the call; the future
/// returned holds the attempt (see [`attempt::attempt`]), not the request.
pub fn serve<'a>(
    env: &'a AttemptEnv,
    req: Box<pb::RunRequest>,
    run: RunStart,
    adapters: &Adapters,
    settings: RuntimeSettings,
) -> impl Future<Output = Ended> + 'a {
    attempt::attempt(env, start(env, req, run, adapters, settings))
}

/// Checks the request and starts the provider call; or the `error`
/// terminal of a request refused before that call.
// Returned once per run and matched at once: boxing the refusal would only
// add an allocation.
#[allow(clippy::result_large_err)]
fn start(
    env: &AttemptEnv,
    req: Box<pb::RunRequest>,
    run: RunStart,
    adapters: &Adapters,
    settings: RuntimeSettings,
) -> Result<Attempt<RunEmitter>, Option<Outbound>> {
    let RunStart {
        ticket, stop, flow, ..
    } = run;
    let mut emit = RunEmitter::new(&req.run_id, &req.adapter, &req.target, &req.session_id);
    let Admitted {
        adapter,
        config,
        permit,
        flow,
        operation,
    } = match admit(&req, adapters, settings, flow) {
        Ok(a) => a,
        Err((code, message)) => {
            tracing::info!(run_id = %req.run_id, code, error = %message, "run rejected");
            return Err(emit.failed(code, &message));
        }
    };
    let (watchdog, evidence) =
        super::watch_attempt(config, req.timeout_sec, &ticket, &adapter, &req.target);
    // The provider call's span (a normalized run's provider gets no
    // `traceparent`: its requests are built by the adapter's protocol).
    let span = env.tracer.as_ref().map(|tracer| {
        let labels = CallLabels {
            kind: "run",
            run_id: &req.run_id,
            adapter: &req.adapter,
            target: &req.target,
        };
        ProviderSpan::begin(
            tracer,
            trace::edge_context(req.trace.as_ref()),
            &labels,
            iop_engine::clock::now(),
            iop_engine::clock::unix_ms(),
        )
    });
    // The request is freed here: what the call needs moves out of it.
    let pb::RunRequest { target, input, .. } = *req;
    let call = RunCall {
        endpoint: adapter.endpoint.clone(),
        target,
        input: input.unwrap_or_default(),
        operation,
    };
    let provider = env.calls.spawn(Some(permit), call);
    Ok(Attempt {
        emitter: emit,
        watchdog,
        evidence,
        provider,
        flow,
        stop,
        trace: span,
    })
}

struct Admitted {
    adapter: Rc<AdapterInstance>,
    config: WatchdogConfig,
    permit: Permit,
    flow: Rc<FlowGate>,
    operation: RunOperation,
}

/// Every check before the provider call (W1 first, then the adapter, then
/// its capacity gate, P4).
fn admit(
    req: &pb::RunRequest,
    adapters: &Adapters,
    settings: RuntimeSettings,
    flow: Result<Rc<FlowGate>, WindowTooSmall>,
) -> Result<Admitted, CallFailure> {
    let config = settings
        .watchdog_config(req.response_stall_timeout_ms)
        .map_err(|e| (codes::INVALID_STALL_TIMEOUT, e.to_string()))?;
    let flow = flow.map_err(|e| (codes::INVALID_FLOW_WINDOW, e.to_string()))?;
    let adapter = adapters.get(&req.adapter).ok_or_else(|| {
        (
            codes::UNKNOWN_ADAPTER,
            format!("no adapter instance named `{}` on this node", req.adapter),
        )
    })?;
    // An operation this Node does not run on this adapter is refused, never
    // run as a chat.
    let operation = RunOperation::of(&req.operation, adapter.endpoint.kind).ok_or_else(|| {
        (
            codes::BAD_OPERATION,
            format!(
                "adapter `{}` does not run operation `{}`",
                req.adapter,
                // Bounded: the name is the peer's text.
                req.operation.chars().take(64).collect::<String>()
            ),
        )
    })?;
    // P4: the same gate as the adapter's tunnels, held until the call ends.
    let permit = adapter.gate.try_acquire().ok_or_else(|| {
        (
            codes::CAPACITY_EXHAUSTED,
            format!("adapter `{}` is at capacity", adapter.name),
        )
    })?;
    Ok(Admitted {
        adapter: adapter.clone(),
        config,
        permit,
        flow,
        operation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapters(capacity: u32) -> Adapters {
        Adapters::from_payload(&pb::NodeConfigPayload {
            adapters: vec![pb::AdapterConfig {
                tls: None,
                name: "ol".into(),
                capacity,
                targets: vec!["llama3".into()],
                kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                    base_url: "http://127.0.0.1:9".into(),
                })),
            }],
            ..Default::default()
        })
        .unwrap()
    }

    fn req(adapter: &str, ms: i64) -> pb::RunRequest {
        pb::RunRequest {
            run_id: "r".into(),
            adapter: adapter.into(),
            response_stall_timeout_ms: ms,
            ..Default::default()
        }
    }

    fn unlimited() -> Result<Rc<FlowGate>, WindowTooSmall> {
        Ok(FlowGate::unlimited())
    }

    fn code(r: Result<Admitted, CallFailure>) -> &'static str {
        match r {
            Ok(_) => "admitted",
            Err((code, _)) => code,
        }
    }

    // CONTRACT: W1 — a normalized run with a negative or overflowing stall
    // timeout is rejected before anything else.
    #[test]
    fn stall_timeout_is_checked_first() {
        let settings = RuntimeSettings::default();
        let none = Adapters::default();
        let Err((c, message)) = admit(&req("nope", -1), &none, settings, unlimited()) else {
            panic!("admitted")
        };
        assert_eq!(
            (c, message.as_str()),
            (
                codes::INVALID_STALL_TIMEOUT,
                "response_stall_timeout_ms must not be negative (got -1)"
            )
        );
        assert_eq!(
            code(admit(&req("nope", i64::MAX), &none, settings, unlimited())),
            codes::INVALID_STALL_TIMEOUT
        );
        assert_eq!(
            code(admit(&req("nope", 0), &none, settings, unlimited())),
            codes::UNKNOWN_ADAPTER
        );
    }

    // CONTRACT: P4 — a run takes a slot of its adapter's one gate and holds
    // it until the permit (owned by the provider call) drops.
    #[test]
    fn runs_share_the_adapter_gate() {
        let adapters = adapters(1);
        let settings = RuntimeSettings::default();
        let first = admit(&req("ol", 0), &adapters, settings, unlimited());
        assert_eq!(adapters.get("ol").unwrap().gate.in_flight(), 1);
        assert_eq!(
            code(admit(&req("ol", 0), &adapters, settings, unlimited())),
            codes::CAPACITY_EXHAUSTED
        );
        drop(first);
        assert_eq!(
            code(admit(&req("ol", 0), &adapters, settings, unlimited())),
            "admitted"
        );
    }

    // An operation this node does not run is refused before the gate,
    // never run as a chat; embeddings run on an Ollama adapter.
    #[test]
    fn an_unknown_operation_is_refused_not_run_as_chat() {
        let adapters = adapters(1);
        let settings = RuntimeSettings::default();
        let with = |operation: &str| pb::RunRequest {
            operation: operation.into(),
            ..req("ol", 0)
        };
        let Err((c, message)) = admit(&with("rerank"), &adapters, settings, unlimited()) else {
            panic!("admitted")
        };
        assert_eq!(
            (c, message.as_str()),
            (
                codes::BAD_OPERATION,
                "adapter `ol` does not run operation `rerank`"
            )
        );
        assert_eq!(adapters.get("ol").unwrap().gate.in_flight(), 0);
        for (operation, expected) in [
            ("", RunOperation::Chat),
            ("chat_completions", RunOperation::Chat),
            ("embeddings", RunOperation::Embeddings),
        ] {
            let admitted = admit(&with(operation), &adapters, settings, unlimited())
                .unwrap_or_else(|(c, m)| panic!("{operation}: {c} {m}"));
            assert_eq!(admitted.operation, expected);
        }
    }

    // A window too small to work is refused after W1, before the adapter
    // or its gate are touched.
    #[test]
    fn an_unusable_flow_window_is_refused_before_the_gate() {
        let adapters = adapters(1);
        let settings = RuntimeSettings::default();
        let tiny = FlowGate::new(10);
        assert_eq!(
            code(admit(
                &req("ol", -1),
                &adapters,
                settings,
                FlowGate::new(10)
            )),
            codes::INVALID_STALL_TIMEOUT
        );
        let Err((c, message)) = admit(&req("ol", 0), &adapters, settings, tiny) else {
            panic!("admitted")
        };
        assert_eq!(
            (c, message.as_str()),
            (
                codes::INVALID_FLOW_WINDOW,
                "flow_window_bytes 10 is below the minimum of 256"
            )
        );
        assert_eq!(adapters.get("ol").unwrap().gate.in_flight(), 0);
    }
}
