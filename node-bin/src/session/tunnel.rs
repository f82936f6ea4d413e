//! The tunnel shell: one `ProviderTunnelRequest` → one provider HTTP request →
//! ordered `ProviderTunnelFrame`s back to the Edge (U1, U2), watched by the
//! stall watchdog (W3–W10).
//!
//! ```text
//! Edge ──ProviderTunnelRequest──► check (W1) ─► adapter, path (U3) ─► gate (P4)
//!        ─► provider call: HTTP request, head, body pieces ──outputs──► drive (watchdog)
//!      ◄── RESPONSE_START, BODY*, END | ERROR ◄─────────────────────────────┘
//! ```
//!
//! Every rejection before the provider call (bad stall timeout, unknown
//! adapter, unresolvable operation, full gate, credential lease) is one
//! `ERROR` terminal and opens no provider connection. The credential lease
//! is opened after the gate admitted the request, right before the provider
//! call, for the adapter origin, path and method that call uses (C2); its
//! header lives only until the request head is written (on a
//! reused pooled connection: until the response head, so the one stale
//! retry can resend it without opening the lease again). Body pieces are
//! slices of the provider read buffer, forwarded as they arrive without
//! parsing or copying (U2; a usage chunk the Edge asked for on the client's
//! behalf is left out, see [`crate::calls::usage`]). The provider
//! connection comes from the pool of the core the call runs on
//! ([`ProviderPool`](crate::calls::pool::ProviderPool); a worker core's
//! with `--cores` of two or more, [`crate::calls::workers`]) and goes back
//! to it only when the body was read to its end; a cancelled or stalled
//! tunnel drops it (U6, W4). On a worker core the body pieces reach the
//! session core as the same `Bytes` (a reference count crosses, not the
//! bytes), and the BODY frame carries them as they are.

use std::future::Future;
use std::rc::Rc;

use iop_engine::clock;
use iop_wire::pb;

use super::runs::RunStart;
use crate::adapters::{AdapterInstance, Adapters, Permit};
use crate::attempt::emit::{Emitter, Outbound, TunnelEmitter};
use crate::attempt::flow::{FlowGate, WindowTooSmall};
use crate::attempt::watchdog::{RuntimeSettings, WatchdogConfig};
use crate::attempt::{self, Attempt, AttemptEnv, Ended};
use crate::calls::tunnel::TunnelCall;
use crate::codes;
use crate::credentials::{LeaseGate, TunnelTarget};
use crate::trace::{self, CallLabels, ProviderSpan};

/// Serves one tunnel to its release: the terminal is sent and the provider
/// call has returned. `stop` fires on `CancelRequest` or session end;
/// `leases` opens the request's credential lease (C2, C3).
///
/// Everything before the provider call runs here, at the call; the future
/// returned holds the attempt (see [`attempt::attempt`]), not the request.
pub fn serve<'a>(
    env: &'a AttemptEnv,
    req: Box<pb::ProviderTunnelRequest>,
    run: RunStart,
    adapters: &Adapters,
    settings: RuntimeSettings,
    leases: LeaseGate,
) -> impl Future<Output = Ended> + 'a {
    attempt::attempt(env, start(env, req, run, adapters, settings, leases))
}

/// Checks the request, opens its credential lease and starts the provider
/// call; or the `ERROR` terminal of a request refused before that call.
// Returned once per tunnel and matched at once: boxing the refusal would
// only add an allocation.
#[allow(clippy::result_large_err)]
fn start(
    env: &AttemptEnv,
    req: Box<pb::ProviderTunnelRequest>,
    run: RunStart,
    adapters: &Adapters,
    settings: RuntimeSettings,
    leases: LeaseGate,
) -> Result<Attempt<TunnelEmitter>, Option<Outbound>> {
    let RunStart {
        ticket,
        stop,
        flow,
        upload,
    } = run;
    let mut emit = TunnelEmitter::new(&req.run_id, &req.adapter, &req.target);
    let admitted = match admit(&req, adapters, settings, flow) {
        Ok(a) => a,
        Err((code, message)) => {
            tracing::info!(run_id = %req.run_id, code, error = %message, "tunnel rejected");
            return Err(emit.failed(code, &message));
        }
    };
    let Admitted {
        adapter,
        path,
        config,
        permit,
        flow,
    } = admitted;
    // --- credential lease (C2, C3) ---------------------------------------
    // Opened only now that the capacity gate admitted the request, right
    // before the provider call, for the origin, path and method that call
    // uses; any failure drops the permit and sends one ERROR with the lease
    // failure code, without touching the provider.
    let method = if req.method.is_empty() {
        "POST".to_string()
    } else {
        req.method.clone()
    };
    // A secret never goes over a connection whose certificate is not
    // verified (the Edge's config refuses that combination; a pushed config
    // that asks for it anyway is refused here before the lease is opened).
    let unverified = adapter.tls.as_ref().is_some_and(|t| t.is_insecure());
    if unverified && req.credential_lease.is_some() {
        let message = "a credential lease is never injected into a provider connection \
                       whose certificate is not verified (tls_insecure_skip_verify)";
        tracing::warn!(run_id = %req.run_id, adapter = %adapter.name, "tunnel rejected: {message}");
        return Err(emit.failed(codes::PROVIDER_TLS, message));
    }
    let origin = adapter.base_url.origin();
    let target = TunnelTarget {
        profile: adapter.profile.as_ref().map(|p| p.name.as_str()),
        origin: &origin,
        provider_trust: &adapter.provider_trust,
        path: &path,
        method: &method,
    };
    let credential = match leases.open(&req, &target, clock::unix_ms()) {
        Ok(credential) => credential,
        Err(e) => {
            let code = e.failure_code();
            tracing::warn!(run_id = %req.run_id, code, error = %e, "tunnel rejected: credential lease");
            return Err(emit.failed(code, &e.to_string()));
        }
    };
    // ----------------------------------------------------------------------
    let (watchdog, evidence) =
        super::watch_attempt(config, req.timeout_sec, &ticket, &adapter, &req.target);
    // The trace: the provider call's span under the Edge's dispatch span,
    // and the provider's `traceparent` (see `crate::trace`).
    let edge_trace = trace::edge_context(req.trace.as_ref());
    let span = env.tracer.as_ref().map(|tracer| {
        let labels = CallLabels {
            kind: "tunnel",
            run_id: &req.run_id,
            adapter: &req.adapter,
            target: &req.target,
        };
        ProviderSpan::begin(
            tracer,
            edge_trace.clone(),
            &labels,
            clock::now(),
            clock::unix_ms(),
        )
    });
    let trace_headers = match (&span, edge_trace) {
        (Some(span), _) => span.provider_headers(),
        (None, Some((parent, state))) => trace::provider_headers(&parent, state.as_deref()),
        (None, None) => Vec::new(),
    };
    // The request is freed here: what the call needs moves out of it.
    let pb::ProviderTunnelRequest {
        mut headers,
        body,
        strip_usage_chunk,
        ..
    } = *req;
    if !trace_headers.is_empty() {
        headers.retain(|h| {
            !h.name.eq_ignore_ascii_case(trace::TRACEPARENT_HEADER)
                && !h.name.eq_ignore_ascii_case(trace::TRACESTATE_HEADER)
        });
        headers.extend(trace_headers);
    }
    let call = TunnelCall {
        endpoint: adapter.endpoint.clone(),
        method,
        path,
        headers,
        body,
        upload,
        credential,
        strip_usage_chunk,
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
    path: String,
    config: WatchdogConfig,
    permit: Permit,
    flow: Rc<FlowGate>,
}

/// Every check before the provider call (W1, U3, P4).
fn admit(
    req: &pb::ProviderTunnelRequest,
    adapters: &Adapters,
    settings: RuntimeSettings,
    flow: Result<Rc<FlowGate>, WindowTooSmall>,
) -> Result<Admitted, (&'static str, String)> {
    // W1: reject before any router or provider call.
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
    let path = adapter
        .tunnel_path(&req.operation, &req.path)
        .map_err(|e| (codes::BAD_OPERATION, e.to_string()))?;
    // P4: one gate per adapter instance, held until the provider call ends.
    let permit = adapter.gate.try_acquire().ok_or_else(|| {
        (
            codes::CAPACITY_EXHAUSTED,
            format!("adapter `{}` is at capacity", adapter.name),
        )
    })?;
    Ok(Admitted {
        adapter: adapter.clone(),
        path,
        config,
        permit,
        flow,
    })
}
