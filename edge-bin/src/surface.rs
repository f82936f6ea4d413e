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
use iop_engine::http::{HttpError, Limits, ServerConn, Watched};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use local_sync::mpsc::bounded;
use monoio::io::{AsyncReadRent, AsyncWriteRent, CancelableAsyncReadRent};
use monoio::net::TcpStream;

use crate::control::{Dispatch, DispatchKind, Input, Rejection, RequestId};
use crate::openai::{self, ApiError, ChatRequest, PassthroughRequest, Surface};
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
            ("POST", "/v1/chat/completions") => {
                chat(&edge, &mut server, &request.head.headers, &request.body).await
            }
            ("POST", "/v1/responses") => {
                passthrough(
                    &edge,
                    &mut server,
                    RESPONSES,
                    &request.head.headers,
                    &request.body,
                )
                .await
            }
            ("POST", "/v1/messages") => {
                passthrough(
                    &edge,
                    &mut server,
                    MESSAGES,
                    &request.head.headers,
                    &request.body,
                )
                .await
            }
            ("POST", "/v1/messages/count_tokens") => {
                passthrough(
                    &edge,
                    &mut server,
                    COUNT_TOKENS,
                    &request.head.headers,
                    &request.body,
                )
                .await
            }
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
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    server
        .write_response(status, [("content-type", "application/json")], body)
        .await
}

async fn write_api_error<S>(server: &mut ServerConn<S>, e: &ApiError) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    write_error(server, Surface::OpenAi, e).await
}

async fn write_error<S>(
    server: &mut ServerConn<S>,
    surface: Surface,
    e: &ApiError,
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    let retry_after = e.retry_after_sec.map(|s| s.to_string());
    let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    if let Some(r) = retry_after.as_deref() {
        headers.push(("retry-after", r));
    }
    server
        .write_response(e.status, headers, e.body_for(surface))
        .await
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// `POST /v1/chat/completions`: admit through `Control`, then relay the
/// provider tunnel.
async fn chat<S>(
    edge: &Rc<Edge>,
    server: &mut ServerConn<S>,
    headers: &[iop_engine::http::Header],
    body: &[u8],
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
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
    let Some((request, dispatch, frames)) =
        admit(edge, server, Surface::OpenAi, &chat.model, long).await?
    else {
        return Ok(());
    };
    let lease = &dispatch.lease;
    // U7: the provider's type alone picks the path; the client surface is
    // the same either way.
    let run = match dispatch.kind {
        DispatchKind::Tunnel => tunnel_frame(
            CHAT_COMPLETIONS,
            &dispatch,
            tunnel_headers(CHAT_COMPLETIONS, chat.stream, headers),
            chat.body_for_target(&lease.target),
            chat.stream,
        ),
        DispatchKind::Run => run_request(&chat, &dispatch),
    };
    if !send_run(edge, server, Surface::OpenAi, request, &dispatch, run).await? {
        return Ok(());
    }
    let result = match dispatch.kind {
        DispatchKind::Tunnel => relay(server, Surface::OpenAi, frames).await,
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

/// Waits for `Control`'s answer to a submitted request.
async fn admit<S>(
    edge: &Rc<Edge>,
    server: &mut ServerConn<S>,
    surface: Surface,
    model: &str,
    long: bool,
) -> Result<Option<(RequestId, Dispatch, bounded::Rx<RouteEvent>)>, HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    let (request, mut admission) = edge.submit(model, long);
    // U6: a client that leaves while queued is removed from the queue; one
    // that leaves just as its lease was won settles the lease at once.
    let answer = match server.watch_peer(&mut admission).await {
        Watched::Done(answer) => answer,
        Watched::PeerClosed => {
            match admission.try_recv() {
                Ok(Admission::Dispatched { dispatch, .. }) => {
                    edge.routes.borrow_mut().remove(&dispatch.lease.run_id);
                    edge.apply(Input::Undeliverable { request });
                }
                _ => edge.apply(Input::Cancel { request }),
            }
            return Ok(None);
        }
    };
    let e = match answer {
        Ok(Admission::Dispatched { dispatch, frames }) => {
            return Ok(Some((request, dispatch, frames)))
        }
        Ok(Admission::Rejected(Rejection::UnknownModel)) => ApiError::model_not_found(model),
        Ok(Admission::Rejected(Rejection::QueueFull)) => ApiError::queue_full(model),
        Ok(Admission::Rejected(Rejection::QueueTimeout) | Admission::Ended) | Err(_) => {
            ApiError::no_provider(model)
        }
    };
    write_error(server, surface, &e).await?;
    Ok(None)
}

/// Sends a run to the lease's node; on failure settles the request and
/// answers the client. Returns whether it was sent.
async fn send_run<S>(
    edge: &Rc<Edge>,
    server: &mut ServerConn<S>,
    surface: Surface,
    request: RequestId,
    dispatch: &Dispatch,
    run: pb::Frame,
) -> Result<bool, HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    let lease = &dispatch.lease;
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
        write_error(server, surface, &e).await?;
    }
    Ok(sent)
}

/// `POST /v1/responses`, `/v1/messages`, `/v1/messages/count_tokens`: raw
/// passthrough over a provider tunnel (U1–U5).
async fn passthrough<S>(
    edge: &Rc<Edge>,
    server: &mut ServerConn<S>,
    route: PassRoute,
    headers: &[iop_engine::http::Header],
    body: &[u8],
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    let req = match PassthroughRequest::parse(body) {
        Ok(r) => r,
        Err(e) => return write_error(server, route.surface, &e).await,
    };
    let Some((request, dispatch, frames)) =
        admit(edge, server, route.surface, &req.model, false).await?
    else {
        return Ok(());
    };
    if dispatch.kind != DispatchKind::Tunnel {
        // Native (Ollama) providers speak only the normalized chat path.
        edge.routes.borrow_mut().remove(&dispatch.lease.run_id);
        edge.apply(Input::Undeliverable { request });
        let e = ApiError::invalid_request(
            format!(
                "The provider serving `{}` does not support {}.",
                req.model, route.path
            ),
            None,
        );
        return write_error(server, route.surface, &e).await;
    }
    let run = tunnel_frame(
        route,
        &dispatch,
        tunnel_headers(route, req.stream, headers),
        req.body_for_target(&dispatch.lease.target),
        req.stream,
    );
    if !send_run(edge, server, route.surface, request, &dispatch, run).await? {
        return Ok(());
    }
    let result = relay(server, route.surface, frames).await;
    if result.is_err() {
        edge.apply(Input::Cancel { request });
    }
    result
}

/// A passthrough route: which profile operation it is (U3) and which client
/// API it speaks.
#[derive(Debug, Clone, Copy)]
struct PassRoute {
    operation: &'static str,
    path: &'static str,
    surface: Surface,
}

const CHAT_COMPLETIONS: PassRoute = PassRoute {
    operation: "chat_completions",
    path: "/v1/chat/completions",
    surface: Surface::OpenAi,
};
const RESPONSES: PassRoute = PassRoute {
    operation: "responses",
    path: "/v1/responses",
    surface: Surface::OpenAi,
};
const MESSAGES: PassRoute = PassRoute {
    operation: "messages",
    path: "/v1/messages",
    surface: Surface::Anthropic,
};
const COUNT_TOKENS: PassRoute = PassRoute {
    operation: "count_tokens",
    path: "/v1/messages/count_tokens",
    surface: Surface::Anthropic,
};

/// The Anthropic API version sent upstream when the client gave none.
pub const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

/// Request headers forwarded to the provider on a tunnel: content type,
/// accept, and for Anthropic routes `anthropic-version` (defaulted) and
/// `anthropic-beta`. Client credentials are never forwarded.
fn tunnel_headers(
    route: PassRoute,
    stream: bool,
    client: &[iop_engine::http::Header],
) -> Vec<pb::Header> {
    let header = |name: &str, value: Bytes| pb::Header {
        name: name.to_string(),
        value,
    };
    let accept: &'static [u8] = if stream {
        b"text/event-stream"
    } else {
        b"application/json"
    };
    let mut headers = vec![
        header("content-type", Bytes::from_static(b"application/json")),
        header("accept", Bytes::from_static(accept)),
    ];
    if route.surface == Surface::Anthropic {
        let find = |name: &str| {
            client
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| h.value.clone())
        };
        let version = find("anthropic-version")
            .unwrap_or_else(|| Bytes::from_static(DEFAULT_ANTHROPIC_VERSION.as_bytes()));
        headers.push(header("anthropic-version", version));
        if let Some(beta) = find("anthropic-beta") {
            headers.push(header("anthropic-beta", beta));
        }
    }
    headers
}

/// The tunnel request for an OpenAI-compatible provider (U1, U3, U5, W2).
fn tunnel_frame(
    route: PassRoute,
    dispatch: &Dispatch,
    headers: Vec<pb::Header>,
    body: Bytes,
    stream: bool,
) -> pb::Frame {
    let lease = &dispatch.lease;
    let tunnel = pb::ProviderTunnelRequest {
        run_id: lease.run_id.clone(),
        adapter: lease.adapter.clone(),
        target: lease.target.clone(),
        method: "POST".into(),
        path: route.path.into(),
        headers,
        // U5: the body is built after selection, naming the served target.
        body,
        stream,
        // W2: the winning provider's effective stall timeout.
        response_stall_timeout_ms: dispatch.response_stall_timeout_ms,
        operation: route.operation.into(),
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
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    let lost = "the node serving this request disconnected";
    if !chat.stream {
        let mut builder = CompletionBuilder::new(id);
        loop {
            let next = match server.watch_peer(frames.recv()).await {
                Watched::Done(next) => next,
                Watched::PeerClosed => return Err(HttpError::UnexpectedEof),
            };
            match next {
                Some(RouteEvent::Run(ev)) => match builder.on_event(&ev) {
                    Some(Completion::Done(v)) => {
                        return write_json(server, 200, Bytes::from(v.to_string())).await
                    }
                    Some(Completion::Failed { code, message }) => {
                        return fail(server, Surface::OpenAi, false, false, &message, &code).await
                    }
                    None => {}
                },
                Some(RouteEvent::Tunnel(_)) => {}
                Some(RouteEvent::Lost) | None => {
                    return fail(
                        server,
                        Surface::OpenAi,
                        false,
                        false,
                        lost,
                        "node_disconnected",
                    )
                    .await
                }
            }
        }
    }
    let mut stream = ChunkStream::new(id, chat.include_usage());
    let mut started = false;
    loop {
        let next = if started {
            frames.recv().await
        } else {
            match server.watch_peer(frames.recv()).await {
                Watched::Done(next) => next,
                Watched::PeerClosed => return Err(HttpError::UnexpectedEof),
            }
        };
        let ev = match next {
            Some(RouteEvent::Run(ev)) => ev,
            Some(RouteEvent::Tunnel(_)) => continue,
            Some(RouteEvent::Lost) | None => {
                return fail(
                    server,
                    Surface::OpenAi,
                    started,
                    true,
                    lost,
                    "node_disconnected",
                )
                .await
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
            return fail(server, Surface::OpenAi, false, true, &ev.error, code).await;
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
    surface: Surface,
    mut frames: bounded::Rx<RouteEvent>,
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    let mut started = false;
    let mut event_stream = false;
    loop {
        let next = if started {
            frames.recv().await
        } else {
            // Before the first byte goes out, a client that leaves is seen
            // at once (U6), not at the first write.
            match server.watch_peer(frames.recv()).await {
                Watched::Done(next) => next,
                Watched::PeerClosed => return Err(HttpError::UnexpectedEof),
            }
        };
        let tf = match next {
            Some(RouteEvent::Tunnel(tf)) => tf,
            Some(RouteEvent::Run(_)) => continue,
            Some(RouteEvent::Lost) | None => {
                let message = "the node serving this request disconnected";
                return fail(
                    server,
                    surface,
                    started,
                    event_stream,
                    message,
                    "node_disconnected",
                )
                .await;
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
                    write_error(server, surface, &e).await
                };
            }
            pb::TunnelFrameKind::Error => {
                let code = if tf.failure_code.is_empty() {
                    "provider_error"
                } else {
                    tf.failure_code.as_str()
                };
                return fail(server, surface, started, event_stream, &tf.error, code).await;
            }
        }
    }
}

/// Ends a failed relay: an HTTP error before the response started, or an
/// SSE error event (then `[DONE]`) inside a started event stream.
async fn fail<S>(
    server: &mut ServerConn<S>,
    surface: Surface,
    started: bool,
    event_stream: bool,
    message: &str,
    code: &str,
) -> Result<(), HttpError>
where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent,
{
    if !started {
        let e = if code == "response_stalled" {
            ApiError::upstream_timeout(message.to_string(), Some(code.to_string()))
        } else {
            ApiError::upstream(message.to_string(), Some(code.to_string()))
        };
        return write_error(server, surface, &e).await;
    }
    if event_stream {
        server
            .write_chunk(openai::sse_error_event_for(surface, message, code))
            .await?;
        server.finish().await
    } else {
        // A plain body cannot carry an error after it started: cut it short
        // so the client sees an incomplete response, not a complete one.
        server.close().await?;
        Err(HttpError::UnexpectedEof)
    }
}
