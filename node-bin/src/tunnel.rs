//! The tunnel shell: one `ProviderTunnelRequest` → one provider HTTP request →
//! ordered `ProviderTunnelFrame`s back to the Edge (U1, U2), watched by the
//! stall watchdog (W3–W10).
//!
//! ```text
//! Edge ──ProviderTunnelRequest──► check (W1) ─► adapter, path (U3) ─► gate (P4)
//!        ─► provider task: HTTP request, head, body pieces ──outputs──► drive (watchdog)
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
//! parsing or copying (U2). The provider connection comes from the pool of
//! the core the call runs on ([`ProviderPool`]; a worker core's with
//! `--cores` of two or more, [`crate::workers`]) and goes back to it only
//! when the body was read to its end; a cancelled or stalled tunnel drops
//! it (U6, W4). On a worker core the body pieces reach the session core as
//! the same `Bytes` (a reference count crosses, not the bytes), and the
//! BODY frame carries them as they are.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{self, HttpError};
use iop_wire::lease::OpenedSecret;
use iop_wire::pb;
use local_sync::oneshot;

use crate::adapters::{AdapterInstance, Adapters, Endpoint, Permit};
use crate::credentials::{LeaseGate, TunnelTarget};
use crate::driver::{self, AttemptEnv, Ended, OutputTx, ProviderCall, StallEvidence};
use crate::emit::{Emitter, TunnelEmitter, TunnelOutput};
use crate::probe::ProbeTarget;
use crate::provider_pool::{ProviderPool, ProviderRequest, SecretHeader};
use crate::runs::RunTicket;
use crate::watchdog::{AttemptIdentity, RuntimeSettings, StopCause, Watchdog, WatchdogConfig};

/// Failure codes on tunnel `ERROR` frames that are not stalls (W6).
pub mod codes {
    /// `response_stall_timeout_ms` out of range (W1).
    pub const INVALID_STALL_TIMEOUT: &str = "invalid_stall_timeout";
    /// The adapter named by the request does not exist here.
    pub const UNKNOWN_ADAPTER: &str = "unknown_adapter";
    /// The operation/path could not be resolved (U3).
    pub const BAD_OPERATION: &str = "bad_operation";
    /// The adapter's capacity gate is full (P4).
    pub const CAPACITY_EXHAUSTED: &str = "capacity_exhausted";
    /// The provider could not be reached.
    pub const PROVIDER_UNREACHABLE: &str = "provider_unreachable";
    /// The provider's response broke off or was malformed.
    pub const PROVIDER_ERROR: &str = "provider_error";
}

/// Serves one tunnel to its release: the terminal is sent and the provider
/// call has returned. `stop` fires on `CancelRequest` or session end;
/// `leases` opens the request's credential lease (C2, C3).
pub async fn serve(
    env: &AttemptEnv,
    req: pb::ProviderTunnelRequest,
    ticket: &RunTicket,
    adapters: Rc<Adapters>,
    settings: RuntimeSettings,
    leases: LeaseGate,
    stop: oneshot::Receiver<StopCause>,
) -> Ended {
    let mut emit = TunnelEmitter::new(&req.run_id, &req.adapter, &req.target);
    let admitted = match admit(&req, &adapters, settings) {
        Ok(a) => a,
        Err((code, message)) => {
            tracing::info!(run_id = %req.run_id, code, error = %message, "tunnel rejected");
            if let Some(frame) = emit.failed(code, &message) {
                driver::send(&env.conn, frame).await;
            }
            return Ended::Provider;
        }
    };
    let Admitted {
        adapter,
        path,
        config,
        permit,
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
    let origin = adapter.base_url.origin();
    let target = TunnelTarget {
        profile: adapter.profile.as_ref().map(|p| p.name.as_str()),
        origin: &origin,
        path: &path,
        method: &method,
    };
    let credential = match leases.open(&req, &target, clock::unix_ms()) {
        Ok(credential) => credential,
        Err(e) => {
            let code = e.failure_code();
            tracing::warn!(run_id = %req.run_id, code, error = %e, "tunnel rejected: credential lease");
            if let Some(frame) = emit.failed(code, &e.to_string()) {
                driver::send(&env.conn, frame).await;
            }
            return Ended::Provider;
        }
    };
    // ----------------------------------------------------------------------
    let now = clock::now();
    let hard_deadline = u64::try_from(req.timeout_sec)
        .ok()
        .filter(|&s| s > 0)
        .and_then(|s| now.checked_add(Duration::from_secs(s)));
    let watchdog = Watchdog::new(config, now, hard_deadline);
    let evidence = StallEvidence {
        identity: AttemptIdentity {
            node_run_id: ticket.node_run_id(),
            attempt_id: ticket.attempt_id(),
            adapter: adapter.name.clone(),
            target: req.target.clone(),
        },
        probe: ProbeTarget::of(&adapter, &req.target),
    };
    let call = TunnelCall {
        endpoint: adapter.endpoint.clone(),
        method,
        path,
        headers: req.headers,
        body: req.body,
        credential,
    };
    let provider = driver::spawn_provider(env, Some(permit), call);
    let ended = driver::drive(env, emit, watchdog, evidence, provider, stop).await;
    tracing::debug!(run_id = %req.run_id, ?ended, "tunnel released");
    ended
}

struct Admitted {
    adapter: Rc<AdapterInstance>,
    path: String,
    config: WatchdogConfig,
    permit: Permit,
}

/// Every check before the provider call (W1, U3, P4).
fn admit(
    req: &pb::ProviderTunnelRequest,
    adapters: &Adapters,
    settings: RuntimeSettings,
) -> Result<Admitted, (&'static str, String)> {
    // W1: reject before any router or provider call.
    let config = settings
        .watchdog_config(req.response_stall_timeout_ms)
        .map_err(|e| (codes::INVALID_STALL_TIMEOUT, e.to_string()))?;
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
    })
}

/// The provider HTTP exchange of one tunnel, run in the provider task (on
/// this core or a worker core: everything here is `Send`; the opened
/// credential stays in its zeroizing buffers on the way).
#[derive(Debug)]
pub struct TunnelCall {
    /// The adapter instance's endpoint (base URL).
    pub endpoint: Arc<Endpoint>,
    /// Request method.
    pub method: String,
    /// Request target, under the base URL's prefix (U3).
    pub path: String,
    /// Forwarded request headers (hop-by-hop and `Host` are dropped).
    pub headers: Vec<pb::Header>,
    /// The request body, as built by the Edge (U5).
    pub body: Bytes,
    /// The opened credential (C2); taken when the request head is written.
    pub credential: Option<OpenedSecret>,
}

impl ProviderCall for TunnelCall {
    type Output = TunnelOutput;

    async fn run(mut self, pool: Rc<ProviderPool>, out: OutputTx<TunnelOutput>) {
        if let Err((code, message)) = self.exchange(&pool, &out).await {
            out.send(TunnelOutput::Failed { code, message }).await;
        }
    }

    fn not_started(message: String) -> TunnelOutput {
        TunnelOutput::Failed {
            code: codes::PROVIDER_UNREACHABLE,
            message,
        }
    }
}

impl TunnelCall {
    async fn exchange(
        &mut self,
        pool: &Rc<ProviderPool>,
        out: &OutputTx<TunnelOutput>,
    ) -> Result<(), (&'static str, String)> {
        // --- provider pool: checkout, stale retry, credential header -------
        // C2: the declared header, built in a zeroizing buffer, replaces any
        // forwarded header of the same name. The opened secret goes right
        // here; the header value is owned by `send`, which drops it as soon
        // as no retry can need it (a stale pooled connection is retried
        // with this same value: the lease is never opened twice).
        let secret = self
            .credential
            .take()
            .map(|c| SecretHeader::new(c.header_name(), c.declared_header_value()));
        let injected_name = secret.as_ref().map(|s| s.name().to_string());
        let headers: Vec<(&str, &[u8])> = self
            .headers
            .iter()
            .filter(|h| !http::is_hop_by_hop(&h.name) && !h.name.eq_ignore_ascii_case("host"))
            .filter(|h| {
                injected_name
                    .as_deref()
                    .is_none_or(|name| !h.name.eq_ignore_ascii_case(name))
            })
            .map(|h| (h.name.as_str(), &h.value[..]))
            .collect();
        let request = ProviderRequest {
            method: &self.method,
            target: &self.path,
            headers: &headers,
            body: self.body.clone(),
        };
        let response = pool
            .send(&self.endpoint.base_url, &request, secret)
            .await
            .map_err(|e| e.into_failure())?;
        let (mut conn, head) = (response.conn, response.head);
        // ----------------------------------------------------------------------
        let headers = head
            .headers
            .iter()
            .map(|h| pb::Header {
                name: h.name.clone(),
                value: h.value.clone(),
            })
            .collect();
        let start = TunnelOutput::Start {
            status: head.status,
            headers,
        };
        if !out.send(start).await {
            return Ok(());
        }
        while let Some(piece) = conn.read_body_chunk().await.map_err(provider_failure)? {
            if !out.send(TunnelOutput::Body(piece)).await {
                return Ok(());
            }
        }
        // The body ended: back to the pool before the terminal, so the
        // request that follows it can reuse the connection.
        conn.release();
        out.send(TunnelOutput::End).await;
        Ok(())
    }
}

fn provider_failure(e: HttpError) -> (&'static str, String) {
    (codes::PROVIDER_ERROR, format!("provider: {e}"))
}
