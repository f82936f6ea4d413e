//! The node-connection shell: accept mTLS (T2), run the frame connection, and
//! feed registration, readiness, terminals and closes to [`Control`]
//! (R1–R4, F1, F2, H1). It builds no HTTP response (X4).
//!
//! [`Control`]: crate::control::Control

use std::rc::Rc;
use std::time::Duration;

use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnHandle, SocketShutdown};
use iop_engine::tls::EdgeTlsAcceptor;
use iop_wire::codec::body_name;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::Splitable;
use monoio::net::TcpStream;

use crate::control::{ConnId, TerminalOutcome};
use crate::state::{Edge, RouteEvent};

/// A node connection that has not registered within this long is closed.
pub const REGISTER_DEADLINE: Duration = Duration::from_secs(10);

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// Serves one accepted node connection to its end.
pub async fn serve(edge: Rc<Edge>, tcp: TcpStream, acceptor: Option<Rc<EdgeTlsAcceptor>>) {
    let peer = tcp.peer_addr().ok();
    let _ = tcp.set_nodelay(true);
    let shutdown = SocketShutdown::for_socket(&tcp);
    let config = ConnConfig::from_env_override();
    // T2: identity is verified in the handshake, before any frame.
    let (conn, events, tls_name) = match acceptor {
        Some(acceptor) => match acceptor.accept(tcp).await {
            Ok((tls, identity)) => {
                let (r, w) = tls.into_split();
                let (conn, events) = spawn_conn(r, w, shutdown, config);
                (conn, events, Some(identity.name().to_string()))
            }
            Err(e) => {
                tracing::warn!(?peer, error = %e, "node connection rejected in the TLS handshake");
                return;
            }
        },
        None => {
            let (r, w) = tcp.into_split();
            let (conn, events) = spawn_conn(r, w, shutdown, config);
            (conn, events, None)
        }
    };
    let conn_id = edge.next_conn_id();
    edge.conns.borrow_mut().insert(conn_id, conn.clone());
    tracing::debug!(conn = conn_id.0, ?tls_name, "node connection open");

    // Close connections that never register.
    {
        let (edge, conn) = (edge.clone(), conn.clone());
        monoio::spawn(async move {
            monoio::time::sleep(REGISTER_DEADLINE).await;
            if edge.control.borrow().node_of(conn_id).is_none() && !conn.is_closed() {
                conn.close("register_timeout");
            }
        });
    }

    let mut events = events;
    let reason = loop {
        match events.recv().await {
            Some(ConnEvent::Frame(f)) => {
                handle_frame(&edge, conn_id, &conn, tls_name.as_deref(), f).await;
            }
            Some(ConnEvent::Closed { reason }) => break reason,
            None => break "connection ended".to_string(),
        }
    };
    edge.conns.borrow_mut().remove(&conn_id);
    let outcome = edge.control.borrow_mut().on_closed(conn_id);
    if let Some(node_id) = &outcome.node_id {
        if outcome.fenced {
            tracing::warn!(
                node_id,
                %reason,
                released = outcome.released.len(),
                "node.disconnected: generation fenced"
            );
        } else {
            tracing::info!(node_id, %reason, "pending node connection closed");
        }
    }
    edge.fail_routes(
        &outcome.released,
        "the node serving this request disconnected",
    );
}

async fn handle_frame(
    edge: &Rc<Edge>,
    conn_id: ConnId,
    conn: &ConnHandle,
    tls_name: Option<&str>,
    f: pb::Frame,
) {
    let Some(body) = f.body else { return };
    match body {
        Body::RegisterRequest(req) => {
            // Without TLS (T5 dev mode) the claimed id stands in for the
            // identity name.
            let name = tls_name.unwrap_or(&req.node_id).to_string();
            let decision = edge
                .control
                .borrow_mut()
                .on_register(conn_id, &name, &req.node_id);
            let accepted = decision.response.accepted;
            if accepted {
                tracing::info!(node_id = %req.node_id, conn = conn_id.0, "node registered (pending)");
            } else {
                tracing::warn!(node_id = %req.node_id, reason = %decision.response.reason, "registration rejected");
            }
            let _ = conn.send_control(frame(Body::RegisterResponse(decision.response)));
            if let Some(old) = decision.superseded {
                let old_conn = edge.conns.borrow().get(&old).cloned();
                if let Some(old_conn) = old_conn {
                    old_conn.close("superseded");
                }
                edge.fail_routes(
                    &decision.released,
                    "the node reconnected; this request was lost",
                );
            }
            if !accepted && edge.control.borrow().node_of(conn_id).is_none() {
                conn.close("registration_rejected");
            }
        }
        Body::NodeReadyRequest(req) => {
            let decision = edge.control.borrow_mut().on_ready(conn_id, &req.node_id);
            if decision.became_ready {
                tracing::info!(node_id = %req.node_id, conn = conn_id.0, "node.connected");
            }
            let _ = conn.send_control(frame(Body::NodeReadyResponse(decision.response)));
            if decision.close {
                conn.close("not_ready");
            }
        }
        Body::ProviderTunnelFrame(tf) => {
            // H1: the frame belongs to a route only if it arrived on the
            // connection the run was dispatched to.
            let kind = tf.kind();
            let terminal = matches!(kind, pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error);
            let tx = {
                let routes = edge.routes.borrow();
                routes
                    .get(&tf.run_id)
                    .filter(|r| r.conn == conn_id)
                    .map(|r| r.tx.clone())
            };
            let run_id = tf.run_id.clone();
            if terminal {
                if let TerminalOutcome::Released(_) =
                    edge.control.borrow_mut().on_terminal(conn_id, &run_id)
                {
                    edge.routes.borrow_mut().remove(&run_id);
                }
            }
            if let Some(tx) = tx {
                // The client may be gone; then the frame has no reader.
                let _ = tx.send(RouteEvent::Tunnel(tf)).await;
            }
        }
        Body::RunEvent(ev) => {
            let terminal = matches!(
                ev.r#type(),
                pb::RunEventType::Complete | pb::RunEventType::Error | pb::RunEventType::Cancelled
            );
            if terminal {
                if let TerminalOutcome::Released(_) =
                    edge.control.borrow_mut().on_terminal(conn_id, &ev.run_id)
                {
                    edge.routes.borrow_mut().remove(&ev.run_id);
                }
            }
        }
        Body::NodeCommandResponse(_) | Body::NodeConfigRefreshResponse(_) => {}
        other => {
            tracing::warn!(
                frame = body_name(&other),
                conn = conn_id.0,
                "unexpected frame from a node; closing"
            );
            conn.close("protocol_error");
        }
    }
}
