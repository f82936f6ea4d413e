//! The client HTTP surface: OpenAI-compatible routes on keep-alive HTTP/1.1
//! connections. Requests are translated to internal dispatches here (E2, U5,
//! X4) and tunnel frames are relayed back unchanged (U1, U2).
//!
//! ```text
//! client ─POST /v1/chat/completions─► parse ─► Control::select ─► tunnel request
//!        ◄─ status+headers, body chunks ◄── RESPONSE_START, BODY* ◄── node conn
//! ```

use std::rc::Rc;

use bytes::Bytes;
use iop_engine::http::{HttpError, Limits, ServerConn};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use local_sync::mpsc::bounded;
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::TcpStream;

use crate::control::{Dispatch, DispatchKind, Input, Rejection};
use crate::openai::{self, ApiError, ChatRequest};
use crate::state::{Admission, Edge, RouteEvent};
use crate::translate::{ChunkStream, Completion, CompletionBuilder, ResponseId};
use crate::{metrics, status};

/// Serves one client connection until it closes.
pub async fn serve(edge: Rc<Edge>, tcp: TcpStream) {
    let _ = tcp.set_nodelay(true);
    let limits = Limits {
        max_body_bytes: edge.settings.max_request_body_bytes,
        ..Limits::default()
    };
    let mut server = ServerConn::new(tcp, limits);
    loop {
        let request = match server.read_request().await {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                if e.is_answerable() {
                    let api = http_error(&e, edge.settings.max_request_body_bytes);
                    let _ = write_api_error(&mut server, &api).await;
                }
                return;
            }
        };
        let path = request
            .head
            .target
            .split('?')
            .next()
            .unwrap_or_default()
            .to_string();
        let method = request.head.method.as_str();
        let result = match (method, path.as_str()) {
            ("GET", "/v1/models") => {
                let body =
                    openai::models_list(&edge.settings.models, edge.settings.started_unix_sec);
                write_json(&mut server, 200, body).await
            }
            ("POST", "/v1/chat/completions") => chat(&edge, &mut server, &request.body).await,
            ("GET", "/status") => {
                let snapshots = edge.control.borrow().snapshots();
                let body = Bytes::from(status::status_json(&snapshots).to_string());
                write_json(&mut server, 200, body).await
            }
            ("GET", "/metrics") => {
                let text = {
                    let control = edge.control.borrow();
                    metrics::render(control.counters(), &control.snapshots())
                };
                server
                    .write_response(
                        200,
                        [("content-type", metrics::CONTENT_TYPE)],
                        Bytes::from(text),
                    )
                    .await
            }
            ("POST", p) if p.starts_with(crate::admin::COMMANDS_PREFIX) => {
                let (status, body) = crate::admin::handle(&edge, p, &request.body).await;
                write_json(&mut server, status, body).await
            }
            ("GET", "/livez") | ("GET", "/readyz") => {
                server
                    .write_response(
                        200,
                        [("content-type", "text/plain")],
                        Bytes::from_static(b"ok\n"),
                    )
                    .await
            }
            (
                _,
                "/v1/models"
                | "/v1/chat/completions"
                | "/status"
                | "/metrics"
                | "/livez"
                | "/readyz",
            ) => write_api_error(&mut server, &ApiError::method_not_allowed(method, &path)).await,
            _ => write_api_error(&mut server, &ApiError::unknown_route(method, &path)).await,
        };
        if result.is_err() || !server.keep_alive() {
            return;
        }
    }
}

fn http_error(e: &HttpError, max_body_bytes: usize) -> ApiError {
    match e.status_code() {
        413 => ApiError::body_too_large(max_body_bytes),
        status => ApiError::from_http_status(status, e.to_string()),
    }
}

async fn write_json<S>(
    server: &mut ServerConn<S>,
    status: u16,
    body: Bytes,
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent,
{
    server
        .write_response(status, [("content-type", "application/json")], body)
        .await
}

async fn write_api_error<S>(server: &mut ServerConn<S>, e: &ApiError) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent,
{
    let retry_after = e.retry_after_sec.map(|s| s.to_string());
    let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    if let Some(r) = retry_after.as_deref() {
        headers.push(("retry-after", r));
    }
    server
        .write_response(e.status, headers, e.body_bytes())
        .await
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// `POST /v1/chat/completions`: admit through `Control`, then relay the
/// provider tunnel.
async fn chat<S>(edge: &Rc<Edge>, server: &mut ServerConn<S>, body: &[u8]) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent,
{
    let chat = match ChatRequest::parse(body) {
        Ok(c) => c,
        Err(e) => return write_api_error(server, &e).await,
    };
    let long = edge
        .settings
        .long_context_threshold_tokens
        .get(&chat.model)
        .is_some_and(|&threshold| chat.estimated_prompt_tokens() >= threshold);
    // E2: the external model selects a pool; the inner identifiers come from
    // the winning provider.
    let (request, admission) = edge.submit(&chat.model, long);
    let (dispatch, frames) = match admission.await {
        Ok(Admission::Dispatched { dispatch, frames }) => (dispatch, frames),
        Ok(Admission::Rejected(Rejection::UnknownModel)) => {
            return write_api_error(server, &ApiError::model_not_found(&chat.model)).await
        }
        Ok(Admission::Rejected(Rejection::QueueFull)) => {
            return write_api_error(server, &ApiError::queue_full(&chat.model)).await
        }
        Ok(Admission::Rejected(Rejection::QueueTimeout)) => {
            return write_api_error(server, &ApiError::no_provider(&chat.model)).await
        }
        Ok(Admission::Ended) | Err(_) => {
            return write_api_error(server, &ApiError::no_provider(&chat.model)).await
        }
    };
    let lease = &dispatch.lease;
    // U7: the provider's type alone picks the path; the client surface is
    // the same either way.
    let run = match dispatch.kind {
        DispatchKind::Tunnel => tunnel_request(&chat, &dispatch),
        DispatchKind::Run => run_request(&chat, &dispatch),
    };
    let conn = edge.conns.borrow().get(&lease.conn).cloned();
    let sent = match conn {
        Some(conn) => conn.send_bulk(run).await.is_ok(),
        None => false,
    };
    if !sent {
        edge.routes.borrow_mut().remove(&lease.run_id);
        edge.apply(Input::Undeliverable { request });
        let e = ApiError::upstream(
            "the selected node disconnected",
            Some("node_unavailable".into()),
        );
        return write_api_error(server, &e).await;
    }
    let result = match dispatch.kind {
        DispatchKind::Tunnel => relay(server, frames).await,
        DispatchKind::Run => {
            let id = ResponseId {
                id: format!("chatcmpl-{}", lease.run_id),
                created: iop_engine::clock::unix_ms() / 1000,
                model: lease.target.clone(),
            };
            relay_run(server, frames, id, &chat).await
        }
    };
    if result.is_err() {
        // U6: the client is gone (or the response broke off); Control sends
        // the node a CancelRequest and settles the lease on its terminal.
        edge.apply(Input::Cancel { request });
    }
    result
}

/// The tunnel request for an OpenAI-compatible provider (U1, U5, W2).
fn tunnel_request(chat: &ChatRequest, dispatch: &Dispatch) -> pb::Frame {
    let lease = &dispatch.lease;
    let accept = if chat.stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let tunnel = pb::ProviderTunnelRequest {
        run_id: lease.run_id.clone(),
        adapter: lease.adapter.clone(),
        target: lease.target.clone(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: vec![
            pb::Header {
                name: "content-type".into(),
                value: Bytes::from_static(b"application/json"),
            },
            pb::Header {
                name: "accept".into(),
                value: Bytes::from_static(accept.as_bytes()),
            },
        ],
        // U5: the body is built after selection, naming the served target.
        body: chat.body_for_target(&lease.target),
        stream: chat.stream,
        // W2: the winning provider's effective stall timeout.
        response_stall_timeout_ms: dispatch.response_stall_timeout_ms,
        operation: "chat_completions".into(),
        ..Default::default()
    };
    frame(Body::ProviderTunnelRequest(tunnel))
}

/// The normalized run for an Ollama/native provider (E1–E3, W2).
fn run_request(chat: &ChatRequest, dispatch: &Dispatch) -> pb::Frame {
    let lease = &dispatch.lease;
    let run = pb::RunRequest {
        run_id: lease.run_id.clone(),
        adapter: lease.adapter.clone(),
        target: lease.target.clone(),
        input: Some(chat.run_input()),
        response_stall_timeout_ms: dispatch.response_stall_timeout_ms,
        ..Default::default()
    };
    frame(Body::RunRequest(run))
}

/// Relays a normalized run as OpenAI chat completion chunks or one
/// `chat.completion` (E1, E4, E5).
async fn relay_run<S>(
    server: &mut ServerConn<S>,
    mut frames: bounded::Rx<RouteEvent>,
    id: ResponseId,
    chat: &ChatRequest,
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent,
{
    let lost = "the node serving this request disconnected";
    if !chat.stream {
        let mut builder = CompletionBuilder::new(id);
        loop {
            match frames.recv().await {
                Some(RouteEvent::Run(ev)) => match builder.on_event(&ev) {
                    Some(Completion::Done(v)) => {
                        return write_json(server, 200, Bytes::from(v.to_string())).await
                    }
                    Some(Completion::Failed { code, message }) => {
                        return fail(server, false, false, &message, &code).await
                    }
                    None => {}
                },
                Some(RouteEvent::Tunnel(_)) => {}
                Some(RouteEvent::Lost) | None => {
                    return fail(server, false, false, lost, "node_disconnected").await
                }
            }
        }
    }
    let mut stream = ChunkStream::new(id, chat.include_usage());
    let mut started = false;
    loop {
        let ev = match frames.recv().await {
            Some(RouteEvent::Run(ev)) => ev,
            Some(RouteEvent::Tunnel(_)) => continue,
            Some(RouteEvent::Lost) | None => {
                return fail(server, started, true, lost, "node_disconnected").await
            }
        };
        let is_error = matches!(
            ev.r#type(),
            pb::RunEventType::Error | pb::RunEventType::Cancelled
        );
        if !started && is_error {
            // Nothing was sent yet: answer with an HTTP error instead.
            let code = if ev.failure_code.is_empty() {
                "provider_error"
            } else {
                ev.failure_code.as_str()
            };
            return fail(server, false, true, &ev.error, code).await;
        }
        if !started {
            server
                .start_chunked(
                    200,
                    [
                        ("content-type", "text/event-stream"),
                        ("cache-control", "no-cache"),
                    ],
                )
                .await?;
            started = true;
        }
        for chunk in stream.on_event(&ev) {
            server.write_chunk(chunk).await?;
        }
        if stream.is_finished() {
            return server.finish().await;
        }
    }
}

/// Relays tunnel frames to the client until the terminal.
async fn relay<S>(
    server: &mut ServerConn<S>,
    mut frames: bounded::Rx<RouteEvent>,
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent,
{
    let mut started = false;
    let mut event_stream = false;
    loop {
        let tf = match frames.recv().await {
            Some(RouteEvent::Tunnel(tf)) => tf,
            Some(RouteEvent::Run(_)) => continue,
            Some(RouteEvent::Lost) | None => {
                let message = "the node serving this request disconnected";
                return fail(server, started, event_stream, message, "node_disconnected").await;
            }
        };
        match tf.kind() {
            pb::TunnelFrameKind::ResponseStart => {
                if started {
                    continue;
                }
                let status = u16::try_from(tf.status).unwrap_or(502);
                event_stream = tf.headers.iter().any(|h| {
                    h.name.eq_ignore_ascii_case("content-type")
                        && h.value.starts_with(b"text/event-stream")
                });
                let headers: Vec<(&str, &[u8])> = tf
                    .headers
                    .iter()
                    .filter(|h| !openai::is_hop_by_hop(&h.name))
                    .map(|h| (h.name.as_str(), &h.value[..]))
                    .collect();
                server.start_chunked(status, headers).await?;
                started = true;
            }
            pb::TunnelFrameKind::Body => {
                if started {
                    server.write_chunk(tf.body).await?;
                }
            }
            pb::TunnelFrameKind::Usage | pb::TunnelFrameKind::Unspecified => {}
            pb::TunnelFrameKind::End => {
                return if started {
                    server.finish().await
                } else {
                    let e = ApiError::upstream("the provider sent no response", None);
                    write_api_error(server, &e).await
                };
            }
            pb::TunnelFrameKind::Error => {
                let code = if tf.failure_code.is_empty() {
                    "provider_error"
                } else {
                    tf.failure_code.as_str()
                };
                return fail(server, started, event_stream, &tf.error, code).await;
            }
        }
    }
}

/// Ends a failed relay: an HTTP error before the response started, or an
/// SSE error event (then `[DONE]`) inside a started event stream.
async fn fail<S>(
    server: &mut ServerConn<S>,
    started: bool,
    event_stream: bool,
    message: &str,
    code: &str,
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent,
{
    if !started {
        let e = if code == "response_stalled" {
            ApiError::upstream_timeout(message.to_string(), Some(code.to_string()))
        } else {
            ApiError::upstream(message.to_string(), Some(code.to_string()))
        };
        return write_api_error(server, &e).await;
    }
    if event_stream {
        server
            .write_chunk(openai::sse_error_event(
                message,
                "upstream_error",
                Some(code),
            ))
            .await?;
        server.finish().await
    } else {
        // A plain body cannot carry an error after it started: cut it short
        // so the client sees an incomplete response, not a complete one.
        server.close().await?;
        Err(HttpError::UnexpectedEof)
    }
}
