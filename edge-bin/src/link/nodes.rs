//! The node-connection shell: accept mTLS (T2), run the frame connection, and
//! feed registration, readiness, terminals, command results, drain notices
//! (`NodeDraining`) and closes to [`Control`] through [`Edge::apply`] (R1–R4,
//! F1, F2, H1). It builds no HTTP response (X4).
//!
//! [`Control`]: crate::control::Control

use std::rc::Rc;
use std::time::Duration;

use iop_engine::conn::{spawn_conn_handled, ConnConfig, ConnRef, SocketShutdown};
use iop_engine::metrics::{self as engine_metrics, Count};
use iop_engine::net::Wait;
use iop_engine::tls::EdgeTlsAcceptor;
use iop_wire::codec::body_name;
use iop_wire::flow;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::{CloseReason, Inbound};
use monoio::io::Splitable;
use monoio::net::TcpStream;

use crate::control::attempt::AttemptTracker;
use crate::control::{ConnId, Input, StallEvidence, Terminal};
use crate::link::edge::Edge;
use crate::link::handshake::{HandshakeFailure, HandshakeSlot};
use crate::link::replies::{Delivery, ReplyEvent};

/// A node connection that has not registered within this long is closed.
pub const REGISTER_DEADLINE: Duration = Duration::from_secs(10);

/// Serves one accepted node connection to its end. The TLS handshake holds
/// `handshake`'s place under `edge.max_node_handshakes` and is cut off at
/// its deadline (the socket is shut down from outside; a TLS read is never
/// cancelled).
pub async fn serve(
    edge: Rc<Edge>,
    tcp: TcpStream,
    acceptor: Option<Rc<EdgeTlsAcceptor>>,
    handshake: HandshakeSlot,
) {
    let peer = tcp.peer_addr().ok();
    let _ = tcp.set_nodelay(true);
    let shutdown = SocketShutdown::for_socket(&tcp);
    // A tunnel's tokens come as chunks: no frame built or boxed per token.
    let mut config = ConnConfig::from_env_override();
    config.chunks = true;
    // T2: identity is verified in the handshake, before any frame.
    // The connection's id is given only once the handshake passed: a
    // rejected peer never reaches the frame layer.
    let (conn_id, conn, closed, tls_name) = match acceptor {
        Some(acceptor) => {
            engine_metrics::add(Count::EdgeNodeHandshakesStarted, 1);
            let deadline = edge.deadlines.watch(&tcp);
            // The first byte (the ClientHello) soon, or the place goes
            // back: a silent socket holds it for the short deadline only.
            deadline.arm(Wait::Handshake, handshake.first_byte_timeout);
            let ready = tcp.readable(false).await;
            if ready.is_err() || deadline.expired() == Some(Wait::Handshake) {
                drop(deadline);
                let error = match ready {
                    Err(e) => e.to_string(),
                    Ok(()) => "no byte before the first-byte deadline".to_string(),
                };
                handshake.finish(
                    peer.map(|p| p.ip()),
                    Some((HandshakeFailure::NoFirstByte, error)),
                );
                return;
            }
            let started_at = iop_engine::clock::now();
            deadline.arm_at(Wait::Handshake, started_at + handshake.timeout);
            let accepted = acceptor.accept(tcp).await;
            let timed_out = deadline.expired() == Some(Wait::Handshake);
            // Dropped with the stream (no await in between): the watchdog
            // never outlives the descriptor.
            drop(deadline);
            match accepted {
                Ok((tls, identity)) => {
                    handshake.finish(peer.map(|p| p.ip()), None);
                    let conn_id = edge.next_conn_id();
                    let tls_name = identity.name().to_string();
                    let handler = frame_handler(&edge, conn_id, Some(tls_name.clone()));
                    let (r, w) = tls.into_split();
                    let (conn, closed) = spawn_conn_handled(r, w, shutdown, config, handler);
                    (conn_id, conn, closed, Some(tls_name))
                }
                Err(e) => {
                    let failure = if timed_out {
                        HandshakeFailure::TimedOut
                    } else {
                        HandshakeFailure::Rejected
                    };
                    handshake.finish(peer.map(|p| p.ip()), Some((failure, format!("{e:?}"))));
                    return;
                }
            }
        }
        None => {
            handshake.release();
            let conn_id = edge.next_conn_id();
            let handler = frame_handler(&edge, conn_id, None);
            let (r, w) = tcp.into_split();
            let (conn, closed) = spawn_conn_handled(r, w, shutdown, config, handler);
            (conn_id, conn, closed, None)
        }
    };
    // Before the reader's first poll (it runs once this task yields): the
    // handler's first frame finds the connection known.
    edge.add_node_conn(conn_id, conn.clone());
    tracing::debug!(conn = conn_id.0, ?tls_name, "node connection open");

    // Close connections that never register.
    {
        let (edge, conn) = (edge.clone(), conn.clone());
        monoio::spawn(async move {
            monoio::time::sleep(REGISTER_DEADLINE).await;
            if conn.is_closed() {
                return;
            }
            let registered = edge
                .with_control(move |control| control.node_of(conn_id).is_some())
                .await;
            if registered == Some(false) {
                conn.close(CloseReason::RegisterTimeout);
            }
        });
    }

    // The frames go to the handler; this task waits for the close.
    let reason = closed.wait().await;
    tracing::info!(conn = conn_id.0, %reason, "node connection closed");
    edge.remove_node_conn(conn_id);
    edge.drop_replies_of(conn_id);
    // The node's promise that it started nothing more (see `Input::Closed`).
    let drained = reason == CloseReason::Peer(CloseReason::Drained.as_str().into_owned());
    edge.apply(Input::Closed {
        conn: conn_id,
        drained,
    });
}

/// What the connection's reader does with each frame, as it decodes it
/// (no queue, no second task per frame). It never waits on a client: each
/// run's frames go to its own reply, which its flow-control window bounds,
/// so heartbeats and every other run keep flowing whatever one client does
/// (T4).
fn frame_handler(
    edge: &Rc<Edge>,
    conn_id: ConnId,
    tls_name: Option<String>,
) -> impl FnMut(ConnRef<'_>, Inbound) + 'static {
    let edge = edge.clone();
    move |conn, inbound| match inbound {
        Inbound::Frame(f) => handle_frame(&edge, conn_id, conn, tls_name.as_deref(), f),
        // A tunnel's token: never a terminal, so no evidence for Control.
        Inbound::Chunk(chunk) => {
            let charge = flow::tunnel_frame_charge(pb::TunnelFrameKind::Body, chunk.body.len());
            deliver(&edge, conn_id, conn, charge, None, ReplyEvent::Chunk(chunk));
        }
    }
}

/// Longest part of a peer's text (a claimed node id, a reason) a log line
/// shows.
const PEER_TEXT_LOG_CHARS: usize = 128;

/// Text the peer sent, for a log line: at most [`PEER_TEXT_LOG_CHARS`]
/// characters (logged with `Debug`, which escapes control characters).
fn peer_text_for_log(text: &str) -> &str {
    match text.char_indices().nth(PEER_TEXT_LOG_CHARS) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

fn handle_frame(
    edge: &Rc<Edge>,
    conn_id: ConnId,
    conn: ConnRef<'_>,
    tls_name: Option<&str>,
    f: pb::Frame,
) {
    let Some(body) = f.body else { return };
    match body {
        Body::RegisterRequest(req) => {
            // Without TLS (T5 dev mode) the claimed id stands in for the
            // identity name.
            let tls_name = tls_name.unwrap_or(&req.node_id).to_string();
            // Only the verified identity is logged as it is: a claimed id
            // that differs is the peer's text (escaped, cut short).
            if req.node_id == tls_name {
                tracing::info!(
                    node_id = %tls_name,
                    conn = conn_id.0,
                    flow_control = req.flow_control,
                    "register request"
                );
            } else {
                tracing::warn!(
                    identity = %tls_name,
                    claimed_node_id = ?peer_text_for_log(&req.node_id),
                    conn = conn_id.0,
                    "register request names another node than its TLS identity; refused"
                );
            }
            edge.set_flow_control(conn_id, req.flow_control);
            edge.apply(Input::Register {
                conn: conn_id,
                tls_name,
                node_id: req.node_id,
            });
            edge.apply(Input::NodeVersion {
                conn: conn_id,
                version: req.node_version,
                strips_usage_chunk: req.strips_usage_chunk,
                runs_embeddings: req.runs_embeddings,
                accepts_tunnel_body: req.accepts_tunnel_body,
            });
        }
        Body::NodeReadyRequest(req) => edge.apply(Input::Ready {
            conn: conn_id,
            node_id: req.node_id,
        }),
        Body::NodeDraining(notice) => {
            // The connection names the node, not the frame: Control applies
            // the notice to this connection's generation if it owns its
            // node id, and ignores it otherwise (before registration, or a
            // stale connection: F2), never a protocol error.
            let reason = peer_text_for_log(&notice.reason);
            match tls_name {
                Some(identity) => tracing::info!(
                    node_id = %identity,
                    conn = conn_id.0,
                    ?reason,
                    "node draining: no new runs or tunnels go to it; what runs there finishes"
                ),
                None => tracing::info!(
                    claimed_node_id = ?peer_text_for_log(&notice.node_id),
                    conn = conn_id.0,
                    ?reason,
                    "node draining: no new runs or tunnels go to it; what runs there finishes"
                ),
            }
            edge.apply(Input::NodeDraining { conn: conn_id });
        }
        Body::ProviderTunnelFrame(tf) => {
            let terminal = matches!(
                tf.kind(),
                pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error
            );
            // Without a reply (cut off), the terminal alone classifies it,
            // as committed: health evidence, never a retry.
            let evidence = terminal.then(|| Terminal {
                conn: conn_id,
                run_id: tf.run_id.clone(),
                adapter: tf.adapter.clone(),
                target: tf.target.clone(),
                stall: tf.failure.as_deref().and_then(StallEvidence::from_failure),
                end: AttemptTracker::new().end_of_tunnel(&tf),
                committed: true,
            });
            let charge = flow::charge_of_tunnel_frame(&tf);
            deliver(
                edge,
                conn_id,
                conn,
                charge,
                evidence,
                ReplyEvent::Tunnel(tf),
            );
        }
        Body::RunEvent(ev) => {
            let terminal = matches!(
                ev.r#type(),
                pb::RunEventType::Complete | pb::RunEventType::Error | pb::RunEventType::Cancelled
            );
            let evidence = terminal.then(|| Terminal {
                conn: conn_id,
                run_id: ev.run_id.clone(),
                adapter: ev.adapter.clone(),
                target: ev.target.clone(),
                stall: ev.failure.as_deref().and_then(StallEvidence::from_failure),
                end: AttemptTracker::new().end_of_run(&ev),
                committed: true,
            });
            let charge = flow::charge_of_run_event(&ev);
            deliver(edge, conn_id, conn, charge, evidence, ReplyEvent::Run(ev));
        }
        Body::NodeCommandResponse(response)
            if crate::link::commands::is_admin_command(&response.command_id) =>
        {
            let to = crate::link::commands::command_shard(&response.command_id);
            edge.forward_command_answer(to, conn_id, *response);
        }
        Body::NodeCommandResponse(response) => edge.apply(Input::CommandResult {
            conn: conn_id,
            response: *response,
        }),
        // Credit for streamed request bodies (`body_follows_bytes`).
        Body::FlowCredit(credit) => edge.upload_credit(conn_id, &credit),
        Body::NodeConfigRefreshResponse(resp) => {
            // K3: the outcome is the node's; the Edge reports it.
            let status = pb::RefreshStatus::try_from(resp.status)
                .map(|s| s.as_str_name())
                .unwrap_or("REFRESH_STATUS_UNKNOWN");
            tracing::info!(
                conn = conn_id.0,
                refresh_id = %resp.refresh_id,
                status,
                reason = %resp.reason,
                "node config refresh answered"
            );
        }
        other => {
            tracing::warn!(
                frame = body_name(&other),
                conn = conn_id.0,
                "unexpected frame from a node; closing"
            );
            conn.close(CloseReason::ProtocolError);
        }
    }
}

/// Hands a run's frame to its client's reply (H1: only from the
/// connection it was dispatched to; `Edge::deliver`), then a terminal
/// (`evidence`) to Control. A node that sent beyond its credit is closed.
fn deliver(
    edge: &Edge,
    conn_id: ConnId,
    conn: ConnRef<'_>,
    charge: u64,
    evidence: Option<Terminal>,
    event: ReplyEvent,
) {
    let mut evidence = evidence;
    let delivery = edge.deliver(conn_id, charge, evidence.is_some(), event);
    if let Delivery::Delivered {
        first,
        commits,
        end,
        run_id: Some(run_id),
    } = &delivery
    {
        if *first && evidence.is_none() {
            // U6: the response started; a terminal ends the wait by
            // itself.
            edge.apply(Input::Responded {
                conn: conn_id,
                run_id: run_id.clone(),
            });
        }
        if *commits && evidence.is_none() {
            edge.apply(Input::Committed {
                conn: conn_id,
                run_id: run_id.clone(),
            });
        }
        if let (Some(t), Some((end, committed))) = (evidence.as_mut(), end) {
            t.end = *end;
            t.committed = *committed;
        }
    }
    if let Delivery::Overrun(overrun) = delivery {
        tracing::warn!(
            conn = conn_id.0,
            received = overrun.received,
            granted = overrun.granted,
            "node sent beyond its flow-control credit; closing"
        );
        conn.close(CloseReason::FlowControlOverrun);
    }
    if let Some(t) = evidence {
        edge.apply(Input::Terminal(t));
    }
}
