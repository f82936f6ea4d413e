//! The tunnel shell: one `ProviderTunnelRequest` → one provider HTTP request →
//! ordered `ProviderTunnelFrame`s back to the Edge (U1, U2).
//!
//! ```text
//! Edge ──ProviderTunnelRequest──► check (W1) ─► gate (P4) ─► provider HTTP
//!      ◄── RESPONSE_START, BODY*, END | ERROR ◄── response head, body pieces
//! ```
//!
//! Body pieces are slices of the provider read buffer, forwarded as they
//! arrive without parsing or copying (U2). Ordering and the single terminal
//! are enforced by [`TunnelEmitter`]. A cancel (K1, U6) or the session's end
//! (F5) aborts the provider request and still ends with one `ERROR` terminal
//! when the connection is alive to carry it.

use std::rc::Rc;

use bytes::Bytes;
use iop_engine::conn::ConnHandle;
use iop_engine::http::{self, ClientConn, HttpError, Limits};
use iop_wire::{checks, pb};
use local_sync::oneshot;

use crate::adapters::{AdapterInstance, Adapters};
use crate::emit::TunnelEmitter;

/// Why a run was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelCause {
    /// The Edge sent `CancelRequest` (K1, U6).
    Requested,
    /// The session ended (F5).
    SessionEnded,
}

impl CancelCause {
    fn failure_code(self) -> &'static str {
        match self {
            CancelCause::Requested => "cancelled",
            CancelCause::SessionEnded => "session_ended",
        }
    }
}

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

/// Serves one tunnel to its end. `cancel` fires on `CancelRequest` or session
/// end.
pub async fn serve(
    req: pb::ProviderTunnelRequest,
    adapters: Rc<Adapters>,
    conn: ConnHandle,
    cancel: oneshot::Receiver<CancelCause>,
) {
    let mut emit = TunnelEmitter::new(&req.run_id, &req.adapter, &req.target);
    let outcome = run(&req, &adapters, &conn, &mut emit, cancel).await;
    if let Err(failure) = outcome {
        tracing::info!(
            run_id = %req.run_id,
            code = failure.code,
            error = %failure.message,
            "tunnel failed"
        );
        if let Some(frame) = emit.error(failure.code, &failure.message, None) {
            // The connection may already be gone (F5); nothing else to do.
            let _ = conn.send_bulk(frame_of(frame)).await;
        }
    }
}

/// A non-stall tunnel failure (W6): a code and the legacy error string.
#[derive(Debug)]
struct Failure {
    code: &'static str,
    message: String,
}

impl Failure {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

fn frame_of(f: pb::ProviderTunnelFrame) -> pb::Frame {
    pb::Frame {
        body: Some(pb::frame::Body::ProviderTunnelFrame(f)),
    }
}

async fn run(
    req: &pb::ProviderTunnelRequest,
    adapters: &Adapters,
    conn: &ConnHandle,
    emit: &mut TunnelEmitter,
    mut cancel: oneshot::Receiver<CancelCause>,
) -> Result<(), Failure> {
    // W1: reject before any router or provider call.
    checks::effective_stall_timeout(req.response_stall_timeout_ms)
        .map_err(|e| Failure::new(codes::INVALID_STALL_TIMEOUT, e.to_string()))?;
    let adapter: &Rc<AdapterInstance> = adapters.get(&req.adapter).ok_or_else(|| {
        Failure::new(
            codes::UNKNOWN_ADAPTER,
            format!("no adapter instance named `{}` on this node", req.adapter),
        )
    })?;
    let path = adapter
        .tunnel_path(&req.operation, &req.path)
        .map_err(|e| Failure::new(codes::BAD_OPERATION, e.to_string()))?;
    // P4: one gate per adapter instance, held until the provider call ends.
    let _permit = adapter.gate.try_acquire().ok_or_else(|| {
        Failure::new(
            codes::CAPACITY_EXHAUSTED,
            format!("adapter `{}` is at capacity", adapter.name),
        )
    })?;

    let method = if req.method.is_empty() {
        "POST"
    } else {
        req.method.as_str()
    };
    let provider = async {
        let tcp = http::connect_url(&adapter.base_url).await.map_err(|e| {
            Failure::new(
                codes::PROVIDER_UNREACHABLE,
                format!("connect {}: {e}", adapter.base_url),
            )
        })?;
        let mut client =
            ClientConn::new(tcp, Limits::default()).with_host(adapter.base_url.authority());
        let headers = req
            .headers
            .iter()
            .filter(|h| !http::is_hop_by_hop(&h.name) && !h.name.eq_ignore_ascii_case("host"))
            .map(|h| (h.name.as_str(), h.value.clone()));
        client
            .send_request(method, &path, headers, req.body.clone())
            .await
            .map_err(provider_failure)?;
        let head = client
            .read_response_head()
            .await
            .map_err(provider_failure)?;
        let headers = head
            .headers
            .iter()
            .map(|h| pb::Header {
                name: h.name.clone(),
                value: h.value.clone(),
            })
            .collect();
        if let Some(frame) = emit.response_start(head.status, headers) {
            send(conn, frame_of(frame)).await?;
        }
        while let Some(piece) = client.read_body_chunk().await.map_err(provider_failure)? {
            if let Some((frame, body)) = emit.body(piece) {
                send_body(conn, frame, body).await?;
            }
        }
        if let Some(frame) = emit.end() {
            send(conn, frame_of(frame)).await?;
        }
        Ok(())
    };
    // Dropping the provider future aborts the provider request: its socket is
    // plain TCP and is closed with it, so no TLS read is ever cancelled.
    monoio::select! {
        result = provider => result,
        cause = &mut cancel => {
            let cause = cause.unwrap_or(CancelCause::SessionEnded);
            Err(Failure::new(cause.failure_code(), "the run was cancelled"))
        }
    }
}

fn provider_failure(e: HttpError) -> Failure {
    Failure::new(codes::PROVIDER_ERROR, format!("provider: {e}"))
}

async fn send(conn: &ConnHandle, frame: pb::Frame) -> Result<(), Failure> {
    conn.send_bulk(frame)
        .await
        .map_err(|e| Failure::new("session_ended", e.to_string()))
}

async fn send_body(
    conn: &ConnHandle,
    frame: pb::ProviderTunnelFrame,
    body: Bytes,
) -> Result<(), Failure> {
    conn.send_body_frame(frame, body)
        .await
        .map_err(|e| Failure::new("session_ended", e.to_string()))
}
