//! One session with the Edge over one connection:
//! register → apply config → start adapters → ready (R2, R3), then serve
//! tunnels and cancels until the connection ends, cancelling every active run
//! when it does (F5).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use iop_engine::conn::{ConnEvent, ConnEvents, ConnHandle};
use iop_wire::codec::body_name;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use local_sync::oneshot;

use crate::adapters::Adapters;
use crate::tunnel::{self, CancelCause};

/// How a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// It never became dispatch-ready: registration or ready refused, or the
    /// connection ended first.
    NotReady(String),
    /// It was ready and then the connection ended.
    Ended(String),
}

/// Active runs of the session, each with its cancel trigger (K1, F5).
#[derive(Debug, Default)]
struct Runs {
    cancels: HashMap<String, oneshot::Sender<CancelCause>>,
}

impl Runs {
    fn cancel(&mut self, run_id: &str, cause: CancelCause) -> bool {
        match self.cancels.remove(run_id) {
            Some(tx) => tx.send(cause).is_ok(),
            None => false,
        }
    }

    fn cancel_all(&mut self, cause: CancelCause) -> usize {
        let n = self.cancels.len();
        for (_, tx) in self.cancels.drain() {
            let _ = tx.send(cause);
        }
        n
    }
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// Waits for the next application frame; `Err(reason)` when the connection
/// closed.
async fn next_frame(events: &mut ConnEvents) -> Result<pb::Frame, String> {
    match events.recv().await {
        Some(ConnEvent::Frame(f)) => Ok(f),
        Some(ConnEvent::Closed { reason }) => Err(reason),
        None => Err("connection ended".into()),
    }
}

/// Runs a session on an established connection until it ends.
pub async fn run(node_id: &str, conn: ConnHandle, mut events: ConnEvents) -> SessionEnd {
    // R2: claim our node id.
    let register = frame(Body::RegisterRequest(pb::RegisterRequest {
        node_id: node_id.to_string(),
        node_version: env!("CARGO_PKG_VERSION").to_string(),
    }));
    if let Err(e) = conn.send_control(register) {
        return SessionEnd::NotReady(format!("send register: {e}"));
    }
    let config = match next_frame(&mut events).await {
        Ok(pb::Frame {
            body: Some(Body::RegisterResponse(resp)),
        }) => {
            if !resp.accepted {
                conn.close("registration_rejected");
                return SessionEnd::NotReady(format!("registration rejected: {}", resp.reason));
            }
            resp.config.unwrap_or_default()
        }
        Ok(other) => {
            conn.close("protocol_error");
            return SessionEnd::NotReady(format!(
                "expected RegisterResponse, got {:?}",
                other.body.map(|b| body_name(&b))
            ));
        }
        Err(reason) => {
            return SessionEnd::NotReady(format!("closed before registration: {reason}"))
        }
    };

    // R3: apply config and start adapters before saying ready.
    let adapters = match Adapters::from_payload(&config) {
        Ok(a) => Rc::new(a),
        Err(e) => {
            conn.close("config_invalid");
            return SessionEnd::NotReady(format!("config from the edge cannot be applied: {e}"));
        }
    };
    tracing::info!(
        adapters = adapters.iter().count(),
        revision = config.revision,
        "config applied"
    );
    let ready = frame(Body::NodeReadyRequest(pb::NodeReadyRequest {
        node_id: node_id.to_string(),
    }));
    if let Err(e) = conn.send_control(ready) {
        return SessionEnd::NotReady(format!("send ready: {e}"));
    }
    match next_frame(&mut events).await {
        Ok(pb::Frame {
            body: Some(Body::NodeReadyResponse(resp)),
        }) if resp.ready => {}
        Ok(pb::Frame {
            body: Some(Body::NodeReadyResponse(resp)),
        }) => {
            conn.close("not_ready");
            return SessionEnd::NotReady(format!("edge refused ready: {}", resp.reason));
        }
        Ok(other) => {
            conn.close("protocol_error");
            return SessionEnd::NotReady(format!(
                "expected NodeReadyResponse, got {:?}",
                other.body.map(|b| body_name(&b))
            ));
        }
        Err(reason) => return SessionEnd::NotReady(format!("closed before ready: {reason}")),
    }
    tracing::info!(node_id, "session ready");

    let runs = Rc::new(RefCell::new(Runs::default()));
    let end = loop {
        let frame = match next_frame(&mut events).await {
            Ok(f) => f,
            Err(reason) => break reason,
        };
        match frame.body {
            Some(Body::ProviderTunnelRequest(req)) => {
                let (tx, rx) = oneshot::channel();
                let run_id = req.run_id.clone();
                if runs
                    .borrow_mut()
                    .cancels
                    .insert(run_id.clone(), tx)
                    .is_some()
                {
                    tracing::warn!(%run_id, "duplicate run id; the older run keeps running untracked");
                }
                let (adapters, conn, runs) = (adapters.clone(), conn.clone(), runs.clone());
                monoio::spawn(async move {
                    tunnel::serve(req, adapters, conn, rx).await;
                    runs.borrow_mut().cancels.remove(&run_id);
                });
            }
            Some(Body::CancelRequest(req)) => {
                // K1: only that run.
                let found = runs
                    .borrow_mut()
                    .cancel(&req.run_id, CancelCause::Requested);
                tracing::debug!(run_id = %req.run_id, found, "cancel request");
            }
            Some(Body::RunRequest(req)) => {
                // Normalized runs are served by the adapters issue; answer
                // with one error terminal so the Edge's lease is released.
                let event = pb::RunEvent {
                    run_id: req.run_id.clone(),
                    seq: 1,
                    r#type: pb::RunEventType::Error as i32,
                    error: "normalized runs are not supported by this node".into(),
                    failure_code: "unsupported".into(),
                    adapter: req.adapter.clone(),
                    target: req.target.clone(),
                    session_id: req.session_id.clone(),
                    ..Default::default()
                };
                let _ = conn.send_bulk(self::frame(Body::RunEvent(event))).await;
            }
            Some(Body::NodeCommandRequest(req)) => {
                let resp = pb::NodeCommandResponse {
                    command_id: req.command_id,
                    ok: false,
                    error: "command not supported by this node version".into(),
                    ..Default::default()
                };
                let _ = conn.send_control(self::frame(Body::NodeCommandResponse(resp)));
            }
            Some(Body::NodeConfigRefreshRequest(req)) => {
                let resp = pb::NodeConfigRefreshResponse {
                    refresh_id: req.refresh_id,
                    status: pb::RefreshStatus::RestartRequired as i32,
                    reason: "live refresh not supported by this node version; reconnect to apply"
                        .into(),
                };
                let _ = conn.send_control(self::frame(Body::NodeConfigRefreshResponse(resp)));
            }
            Some(other) => {
                tracing::warn!(
                    frame = body_name(&other),
                    "unexpected frame from the edge; ignored"
                );
            }
            None => {}
        }
    };
    // F5: the session's lifetime ends every active run and tunnel.
    let cancelled = runs.borrow_mut().cancel_all(CancelCause::SessionEnded);
    tracing::info!(reason = %end, cancelled, "session ended");
    SessionEnd::Ended(end)
}
