//! The request loop of a client connection: read the head, authenticate it,
//! read the body, route it (E2, U5, X4).
//!
//! ```text
//! client ─POST /v1/chat/completions─► head ─► key ─► body ─► route ─► pipeline
//!        ◄─ status+headers, body chunks ◄── relay ◄── node conn
//! ```

use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{HttpError, Limits, ServerConn};
use iop_engine::metrics::{self as engine_metrics, Count, Latency};
use iop_engine::net::{Deadline, Wait};
use iop_engine::sync::Either;
use iop_engine::tls::{EdgeTlsAcceptor, ListenerStream, MaybeTls};
use monoio::net::TcpStream;

use super::conn::*;
use super::endpoints::*;
use super::pipeline::*;
use super::relay::*;
use crate::api::error::{GatewayError, Surface};
use crate::api::openai;
use crate::client::{metrics, status};
use crate::cluster::summaries;
use crate::config::MetricsAccess;
use crate::link::edge::Edge;
use crate::plane::access::AccessRecord;
use crate::plane::client_keys::Caller;
use crate::plane::request_metrics::Route;

/// Serves one client connection to its end; `open` (its place under the
/// connection cap) is dropped with it. `deadline` is the socket's, made
/// by the accept loop (which watches it for idle reclaim).
///
/// A plain connection is served on its `TcpStream` itself, a TLS one on
/// the TLS stream, boxed: a connection's task is sized by the stream it
/// serves (a TLS write's state is several hundred bytes more, in every
/// streamed response), so plain connections do not carry room for TLS.
///
/// A function, not an `async fn`: the socket's options and deadline are
/// set at the call, and the future returned for a plain connection is
/// the request loop itself, holding the socket, the Edge and `open` once.
pub fn serve<G: 'static>(
    edge: Rc<Edge>,
    tcp: TcpStream,
    deadline: Deadline,
    open: G,
) -> impl std::future::Future<Output = ()> {
    let _ = tcp.set_nodelay(true);
    // The `/admin` routes of an Edge without client keys answer loopback
    // peers only.
    let peer = tcp.peer_addr().ok().map(|a| a.ip());
    if edge.settings.client_tls.is_none() {
        return Either::left(serve_requests(edge, tcp, deadline, peer, open, None));
    }
    Either::right(Box::pin(async move {
        // Boxed: the handshake's state is most of a kilobyte and only
        // needed until it is done.
        if let Some(stream) = Box::pin(handshake(&edge, tcp, &deadline, peer)).await {
            serve_requests(edge, stream, deadline, peer, open, None).await;
        }
    }))
}

/// Serves one connection on the peer listener of a cluster member
/// (`crate::server::front_door::serve_peers`): after an mTLS handshake in
/// which the peer proves it is an Edge of the trust domain (within
/// `edge.client_head_timeout_ms`), the same request loop as a client's,
/// every request marked as that Edge's (`peer=<name>` in the access log):
/// never forwarded again, and its caller's rate and concurrency limits
/// not charged again (the Edge that took it from its client did). The
/// client key is still checked: every Edge of a cluster has the same
/// `[[client_keys]]`.
pub async fn serve_peer<G: 'static>(
    edge: Rc<Edge>,
    tcp: TcpStream,
    deadline: Deadline,
    acceptor: Rc<EdgeTlsAcceptor>,
    open: G,
) {
    let _ = tcp.set_nodelay(true);
    let peer = tcp.peer_addr().ok().map(|a| a.ip());
    deadline.arm(
        Wait::Handshake,
        Duration::from_millis(edge.settings.running.get().limits.client_head_timeout_ms),
    );
    let accepted = Box::pin(acceptor.accept(tcp)).await;
    deadline.disarm();
    let (stream, id) = match accepted {
        Ok(accepted) => accepted,
        Err(e) => {
            // Debug only, as on the client listener: anyone who can reach
            // the port can cause these.
            tracing::debug!(?peer, error = %e, "peer edge TLS handshake failed");
            return;
        }
    };
    let from_peer: Rc<str> = Rc::from(id.name());
    serve_requests(
        edge,
        ListenerStream::from(stream),
        deadline,
        peer,
        open,
        Some(from_peer),
    )
    .await;
}

/// The answer to a connection over its peer's cap
/// (`edge.max_client_connections_per_peer`): a 429 `too_many_connections`
/// in the OpenAI error shape (plain HTTP only: a TLS connection is just
/// closed), sent without waiting, then the close. Nothing of the request
/// is read.
pub fn refuse_over_peer_cap(tcp: &TcpStream, tls: bool) {
    if tls {
        iop_engine::net::answer_and_shut_now(tcp, b"");
        return;
    }
    let e = GatewayError::too_many_connections();
    let body = e.body_bytes();
    let mut answer = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    iop_engine::net::answer_and_shut_now(tcp, &answer);
}

/// The client TLS handshake of a listener with `[edge.client_tls]`; `None`
/// when it failed or timed out (counted, logged at debug).
pub(super) async fn handshake(
    edge: &Edge,
    tcp: TcpStream,
    deadline: &Deadline,
    peer: Option<std::net::IpAddr>,
) -> Option<ListenerStream> {
    let tls = edge.settings.client_tls.as_ref()?;
    // An expired handshake deadline shuts the socket down, and the
    // handshake fails on its own (a TLS read is never cancelled).
    deadline.arm(
        Wait::Handshake,
        Duration::from_millis(edge.settings.running.get().limits.client_head_timeout_ms),
    );
    let handshake = tls.accept(tcp).await;
    deadline.disarm();
    match handshake {
        Ok(stream) => Some(MaybeTls::from(stream)),
        Err(e) => {
            // Debug only: any peer on the network can cause these as fast
            // as it likes; the counters say how many.
            if deadline.expired() == Some(Wait::Handshake) {
                engine_metrics::add(Count::EdgeClientTlsHandshakeTimeouts, 1);
                tracing::debug!(?peer, error = %e, "client TLS handshake timed out");
            } else {
                engine_metrics::add(Count::EdgeClientTlsHandshakeFailures, 1);
                tracing::debug!(?peer, error = %e, "client TLS handshake failed");
            }
            None
        }
    }
}

/// Reads and answers the requests of one client connection over `stream`
/// until it closes. Every read has a deadline: the requests'
/// `edge.client_*_timeout_ms`; a request refused before its body was read
/// is answered and the connection closed with a lingering close.
/// `from_peer`: the Edge whose connection this is (the peer listener).
#[allow(clippy::manual_async_fn)]
pub(super) fn serve_requests<S: ClientStream, G: 'static>(
    edge: Rc<Edge>,
    stream: S,
    deadline: Deadline,
    peer: Option<std::net::IpAddr>,
    open: G,
    from_peer: Option<Rc<str>>,
) -> impl std::future::Future<Output = ()> {
    // Built before the loop's future: the future captures the connection
    // once, not the stream and deadline beside the connection made of them.
    let running = edge.settings.running.get();
    let limits = Limits {
        max_body_bytes: running.max_request_body_bytes,
        ..Limits::default()
    };
    let timeouts = client_timeouts(&running.limits, running.client_write_stall_timeout);
    drop(running);
    let mut server = Client {
        conn: ServerConn::new(stream, limits).with_deadline(deadline, timeouts),
        rec: AccessRecord::default(),
        read_at: None,
        caller: None,
        ticket: None,
        metrics: edge.settings.request_metrics.clone(),
        shard: edge.shard_index(),
        route: Route::Other,
        model: 0,
        last_chunk_at: None,
        active: None,
        trace: None,
        edge,
    };
    async move {
        let _open = open;
        let edge = Rc::clone(&server.edge);
        loop {
            // The head alone first: the request is authenticated before a
            // byte of its body is read.
            let mut head = match server.read_head().await {
                Ok(Some(head)) => head,
                Ok(None) => return,
                Err(e) => return refuse_request(&edge, &mut server, &e).await,
            };
            let path = head
                .target
                .split('?')
                .next()
                .unwrap_or_default()
                .to_string();
            let method = head.method.as_str();
            if from_peer.is_some() && path == summaries::SUMMARY_PATH {
                // Every peer polls this several times a second: answered
                // from the view, without a client key (the handshake
                // proved the caller is an Edge of the trust domain) and
                // without an access-log line.
                let answered = match (method, &edge.settings.cluster) {
                    ("GET", Some(cluster)) => match server.read_body(&head).await {
                        Ok(_) => {
                            let summary =
                                summaries::encode(&cluster.edge_name, &cluster.local_capacity());
                            write_json(&mut server, 200, Bytes::from(summary)).await
                        }
                        Err(e) => Err(e),
                    },
                    _ => {
                        server.skip_body(&head);
                        let e = GatewayError::method_not_allowed(method, &path);
                        write_api_error(&mut server, &e).await
                    }
                };
                if answered.is_err() || !server.keep_alive() {
                    return;
                }
                continue;
            }
            // metrics: end to end starts when the request is read.
            let read_at = clock::now();
            server.begin(&edge, &head, &path, 0, read_at);
            if let Some(from) = &from_peer {
                server.rec.peer = Some(from.to_string());
                if method == "POST" && is_inference_route(&path) {
                    if let Some(cluster) = &edge.settings.cluster {
                        cluster
                            .counters
                            .peer_requests
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            // The shutdown drain waits for this response to finish.
            let in_flight = edge.track_request();
            if edge.is_draining() && !matches!(path.as_str(), "/livez" | "/readyz") {
                server.skip_body(&head);
                let answered = refuse_while_draining(&mut server, &path).await.is_ok();
                server.log_access();
                // Answered: the drain need not wait for the lingering close.
                drop(in_flight);
                if answered {
                    linger(&edge, &mut server).await;
                }
                return;
            }
            // Client API keys: with keys configured, every route but the probes
            // and the metrics scrape needs one (401 in the route's shape),
            // answered before the body is read; a request with a body then
            // ends its connection with a lingering close.
            let checked = match authenticate(&edge, &path, &head.headers) {
                Ok(caller) => lowered_priority(caller, &path, &head.headers),
                Err(refused) => Err(refused),
            };
            let caller = match checked {
                Ok(caller) => caller,
                Err((surface, e)) => {
                    // A 400 is a bad priority header, not a refused key.
                    if e.status != 400 {
                        engine_metrics::add(Count::EdgeClientAuthRefusals, 1);
                    }
                    server.skip_body(&head);
                    let result = write_error(&mut server, surface, &e).await;
                    server.log_access();
                    drop(in_flight);
                    if result.is_err() {
                        return;
                    }
                    if !server.keep_alive() {
                        linger(&edge, &mut server).await;
                        return;
                    }
                    continue;
                }
            };
            // An upload with a length streams: its route reads the body.
            let upload = tunneled(&path)
                .filter(|e| method == "POST" && is_upload(e.op))
                .and_then(|e| server.body_pieces(&head).map(|pieces| (e, pieces)));
            // The body moves into the route that reads it (it is freed as soon
            // as the route is done with it, not when the response ends).
            let body = match &upload {
                Some(_) => Bytes::new(),
                None => match server.read_body(&head).await {
                    Ok(body) => body,
                    Err(e) => {
                        drop(in_flight);
                        return refuse_request(&edge, &mut server, &e).await;
                    }
                },
            };
            server.rec.bytes_in = body.len() as u64;
            let principal = &*caller.principal;
            server.rec.principal = principal.to_owned();
            server.caller = Some(caller.clone());
            // Who asks, for the admin routes of an Edge without keys.
            let from =
                crate::client::admin::Requester::of(peer, head.header("host").map(|h| &h[..]));
            // The routes that forward some of the client's headers take
            // them; for every other route they are freed here, not held
            // while its response streams.
            let headers = std::mem::take(&mut head.headers);
            // The OpenAI-shaped operations tunneled as they are.
            let tunnel = tunneled(&path).filter(|_| method == "POST");
            let result = if let Some((endpoint, pieces)) = upload {
                Box::pin(super::upload::upload(
                    &edge,
                    &mut server,
                    principal,
                    endpoint,
                    &head,
                    pieces,
                    headers,
                ))
                .await
            } else if let Some(endpoint) = tunnel {
                Box::pin(passthrough(
                    &edge,
                    &mut server,
                    principal,
                    endpoint,
                    headers,
                    body,
                ))
                .await
            } else {
                match (method, path.as_str()) {
                    ("GET", "/v1/models") => {
                        let visible: Vec<_> = edge
                            .settings
                            .running
                            .get()
                            .models
                            .iter()
                            .filter(|m| caller.may_use(&m.id))
                            .cloned()
                            .collect();
                        let body = openai::models_list(&visible, edge.settings.started_unix_sec);
                        write_json(&mut server, 200, body).await
                    }
                    ("GET", p) if p.starts_with("/v1/models/") => {
                        // Answered from the Edge's own model list: a model the
                        // key may not use is as unknown as one not served.
                        // The SDKs percent-encode the id (`org%2Fmodel`); one
                        // that does not decode names no model.
                        let raw = &p["/v1/models/".len()..];
                        let decoded = percent_decoded(raw);
                        let id = decoded.as_deref().unwrap_or(raw);
                        let running = edge.settings.running.get();
                        match running
                            .models
                            .iter()
                            .find(|m| decoded.is_some() && m.id == id && caller.may_use(&m.id))
                        {
                            Some(model) => {
                                let body =
                                    openai::model_retrieved(model, edge.settings.started_unix_sec);
                                write_json(&mut server, 200, body).await
                            }
                            None => {
                                write_api_error(&mut server, &GatewayError::model_not_found(id))
                                    .await
                            }
                        }
                    }
                    ("POST", "/v1/chat/completions") => {
                        chat(&edge, &mut server, principal, headers, body).await
                    }

                    // Boxed: the passthrough's future is the largest, and a
                    // connection's task is as large as its largest route; the chat
                    // relay, the one that streams, stays inline.
                    ("POST", "/v1/responses") => {
                        Box::pin(passthrough(
                            &edge,
                            &mut server,
                            principal,
                            RESPONSES,
                            headers,
                            body,
                        ))
                        .await
                    }
                    ("POST", "/v1/messages") => {
                        Box::pin(passthrough(
                            &edge,
                            &mut server,
                            principal,
                            MESSAGES,
                            headers,
                            body,
                        ))
                        .await
                    }
                    ("POST", "/v1/messages/count_tokens") => {
                        Box::pin(passthrough(
                            &edge,
                            &mut server,
                            principal,
                            COUNT_TOKENS,
                            headers,
                            body,
                        ))
                        .await
                    }
                    ("GET", "/status") => {
                        // A key limited to some models sees their providers
                        // only; the rest of the fleet is not its business.
                        let viewer = (!caller.authority.sees_everything()).then(|| caller.clone());
                        match edge
                            .with_control(move |control| {
                                let mut fleet = status::Fleet::read(control, clock::now());
                                if let Some(viewer) = viewer {
                                    let visible = control.serves_any(|m| viewer.may_use(m));
                                    fleet.retain(&visible, |m| viewer.may_use(m));
                                }
                                fleet
                            })
                            .await
                        {
                            Some(fleet) => {
                                let mut doc = fleet.json();
                                // Who owns which node is the fleet's shape:
                                // for keys that see everything.
                                if let Some(cluster) = edge
                                    .settings
                                    .cluster
                                    .as_ref()
                                    .filter(|_| caller.authority.sees_everything())
                                {
                                    doc["cluster"] = status::cluster_json(cluster, clock::now());
                                }
                                // The Edge's own files: the operator's business.
                                if caller.authority.sees_everything() {
                                    doc["logs"] = status::logs_json(
                                        &edge.settings.access_log.status(),
                                        edge.settings.usage_log.status().as_ref(),
                                    );
                                    if let Some(b) = edge.settings.client_keys.budgets_status() {
                                        doc["budgets"] = status::budgets_json(&b);
                                    }
                                }
                                write_json(&mut server, 200, Bytes::from(doc.to_string())).await
                            }
                            None => {
                                write_api_error(&mut server, &GatewayError::shutting_down()).await
                            }
                        }
                    }
                    ("GET", "/metrics")
                        if edge.settings.running.get().metrics_access == MetricsAccess::Key
                            && !caller.authority.sees_everything() =>
                    {
                        write_api_error(&mut server, &GatewayError::metrics_scope_required()).await
                    }
                    ("GET", "/metrics") => {
                        let text = metrics::scrape(&edge).await;
                        server
                            .write_response(
                                200,
                                [("content-type", metrics::CONTENT_TYPE)],
                                Bytes::from(text),
                            )
                            .await
                    }
                    // The status page (crate::client::ui).
                    ("GET", "/ui") => crate::client::ui::page(&edge, &mut server, from).await,
                    // Boxed like the passthrough (their timers are cache-line
                    // aligned, which would align every connection's task).
                    ("GET", "/ui/events") => {
                        Box::pin(crate::client::ui::events(
                            &edge,
                            &mut server,
                            caller.authority,
                            from,
                        ))
                        .await
                    }
                    ("GET", crate::client::admin::CONFIG_PATH) => {
                        let (status, body) =
                            match crate::client::admin::authorize(caller.authority, from) {
                                Ok(()) => crate::client::admin::config(&edge),
                                Err(refused) => refused,
                            };
                        write_json(&mut server, status, body).await
                    }
                    ("POST", p) if p.starts_with(crate::client::admin::ADMIN_PREFIX) => {
                        let content_type = headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case("content-type"))
                            .map(|h| &h.value[..]);
                        let allowed = crate::client::admin::authorize(caller.authority, from)
                            .and_then(|()| crate::client::admin::check_content_type(content_type));
                        let (status, body) = match allowed {
                            Ok(()) => Box::pin(crate::client::admin::handle(&edge, p, &body)).await,
                            Err(refused) => refused,
                        };
                        write_json(&mut server, status, body).await
                    }
                    ("GET", "/readyz") if edge.is_draining() => {
                        server
                            .write_response(
                                503,
                                [("content-type", "text/plain")],
                                Bytes::from_static(b"draining\n"),
                            )
                            .await
                    }
                    ("GET", "/readyz")
                        if edge.settings.cluster.as_ref().is_some_and(|c| !c.is_up()) =>
                    {
                        // A cluster member without its etcd lease owns no
                        // node and dispatches nothing: send clients elsewhere.
                        server
                            .write_response(
                                503,
                                [("content-type", "text/plain")],
                                Bytes::from_static(b"cluster store unreachable\n"),
                            )
                            .await
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
                        | "/v1/responses"
                        | "/v1/completions"
                        | "/v1/embeddings"
                        | "/v1/rerank"
                        | "/v2/rerank"
                        | "/v1/score"
                        | "/tokenize"
                        | "/detokenize"
                        | "/status"
                        | "/metrics"
                        | "/livez"
                        | "/readyz"
                        | "/ui"
                        | "/ui/events",
                    ) => {
                        write_api_error(
                            &mut server,
                            &GatewayError::method_not_allowed(method, &path),
                        )
                        .await
                    }
                    (_, "/v1/messages" | "/v1/messages/count_tokens") => {
                        let e = GatewayError::method_not_allowed(method, &path);
                        write_error(&mut server, Surface::Anthropic, &e).await
                    }
                    _ => {
                        write_api_error(&mut server, &GatewayError::unknown_route(method, &path))
                            .await
                    }
                }
            };
            if method == "POST" && is_inference_route(&path) {
                // metrics: end to end (request read → response finished).
                engine_metrics::record_since(Latency::EdgeEndToEnd, read_at);
            }
            if let Err(e) = &result {
                server.rec.end(cancel_reason(e).as_str());
            }
            server.log_access();
            drop(in_flight);
            if let Err(HttpError::TimedOut(Wait::Write)) = &result {
                write_stalled(&edge, method, &path);
            }
            if result.is_err() || !server.keep_alive() {
                return;
            }
        }
    }
}

/// The header with which a request lowers its own priority class (never
/// raises it above its key's).
pub const PRIORITY_HEADER: &str = "x-iop-priority";

/// `caller` with the class its request asks for in [`PRIORITY_HEADER`], if
/// lower than its key's; a value that names no class is the client's 400.
// The refusal is built once per refused request, as `authenticate`'s is.
#[allow(clippy::result_large_err)]
fn lowered_priority(
    mut caller: Caller,
    path: &str,
    headers: &[iop_engine::http::Header],
) -> Result<Caller, (Surface, GatewayError)> {
    let Some(header) = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case(PRIORITY_HEADER))
    else {
        return Ok(caller);
    };
    let asked = std::str::from_utf8(&header.value)
        .ok()
        .and_then(|v| crate::config::priority_class(v.trim()));
    let Some(asked) = asked else {
        let surface = if path.starts_with(MESSAGES.path) {
            Surface::Anthropic
        } else {
            Surface::OpenAi
        };
        return Err((
            surface,
            GatewayError::invalid_request(
                format!(
                    "{PRIORITY_HEADER} must be interactive, standard, batch or a number \
                     from 0 to {}.",
                    crate::config::MAX_PRIORITY
                ),
                None,
            ),
        ));
    };
    caller.priority = caller.priority.min(asked);
    Ok(caller)
}

/// `segment` of a request path with its `%XX` escapes decoded (RFC 3986:
/// `+` stays `+`); `None` when an escape is not two hex digits or the
/// bytes are not UTF-8.
pub(super) fn percent_decoded(segment: &str) -> Option<std::borrow::Cow<'_, str>> {
    if !segment.contains('%') {
        return Some(std::borrow::Cow::Borrowed(segment));
    }
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] != b'%' {
            out.push(bytes[at]);
            at += 1;
            continue;
        }
        let hex = bytes.get(at + 1..at + 3)?;
        if !hex.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        let digit = |b: u8| (b as char).to_digit(16).unwrap_or(0) as u8;
        out.push((digit(hex[0]) << 4) | digit(hex[1]));
        at += 3;
    }
    String::from_utf8(out).ok().map(std::borrow::Cow::Owned)
}

/// Counts and logs a client cut off for taking no bytes of its response
/// for `edge.client_write_stall_timeout_ms` (its connection was reset).
pub(super) fn write_stalled(edge: &Edge, method: &str, path: &str) {
    engine_metrics::add(Count::EdgeClientWriteStalls, 1);
    if let Some(suppressed) = edge.write_stall_log() {
        tracing::warn!(
            method,
            path,
            stall_timeout_ms = edge
                .settings
                .running
                .get()
                .client_write_stall_timeout
                .as_millis() as u64,
            suppressed,
            "client took no bytes of its response within the write-stall timeout: connection reset"
        );
    }
}

/// The principal of a request to `path`: open routes (`/livez`, `/readyz`,
/// `/metrics`, the `/ui` page) need no key; the others need a configured client key when
/// there are any. The error carries the shape to answer in (Anthropic on
/// `/v1/messages*`, which also accept `x-api-key`).
// The error is as large as the `GatewayError` it carries, once per refused
// request and matched at once by the caller: boxing it buys nothing.
#[allow(clippy::result_large_err)]
pub(super) fn authenticate(
    edge: &Edge,
    path: &str,
    headers: &[iop_engine::http::Header],
) -> Result<Caller, (Surface, GatewayError)> {
    // `/ui` is the status page: it holds no data and asks for a key.
    let open_metrics = edge.settings.running.get().metrics_access == MetricsAccess::Open;
    if matches!(path, "/livez" | "/readyz" | "/ui") || (path == "/metrics" && open_metrics) {
        return Ok(edge.settings.client_keys.anonymous());
    }
    let anthropic = path.starts_with(MESSAGES.path);
    let surface = if anthropic {
        Surface::Anthropic
    } else {
        Surface::OpenAi
    };
    edge.settings
        .client_keys
        .authenticate(headers, anthropic)
        .map_err(|e| (surface, e.api_error(anthropic)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EdgeConfig;

    #[test]
    #[allow(clippy::result_large_err)]
    fn a_request_may_lower_its_class_never_raise_it() {
        let header = |value: &'static [u8]| {
            vec![iop_engine::http::Header {
                name: "X-IOP-Priority".into(),
                value: Bytes::from_static(value),
            }]
        };
        let keys = crate::plane::client_keys::ClientKeys::default();
        let mut caller = keys.anonymous();
        caller.priority = 90;
        let class = |caller: &Caller, value| {
            lowered_priority(caller.clone(), "/v1/chat/completions", &header(value))
                .map(|c| c.priority)
        };
        assert_eq!(class(&caller, b"batch"), Ok(10));
        assert_eq!(class(&caller, b" 60 "), Ok(60));
        caller.priority = 10;
        assert_eq!(class(&caller, b"interactive"), Ok(10));
        let Err((surface, e)) = class(&caller, b"urgent") else {
            panic!("a value that is no class is refused");
        };
        assert_eq!((surface, e.status), (Surface::OpenAi, 400));
        assert_eq!(
            e.body_json()["error"]["message"],
            "x-iop-priority must be interactive, standard, batch or a number from 0 to 100."
        );
        // Without the header, the key's class.
        let plain = lowered_priority(caller, "/v1/messages", &[]).map(|c| c.priority);
        assert_eq!(plain, Ok(10));
    }

    async fn exchange(
        client: &mut iop_engine::http::ClientConn<TcpStream>,
        method: &str,
        path: &str,
        body: &'static [u8],
    ) -> (iop_engine::http::ResponseHead, Bytes) {
        client
            .send_request(
                method,
                path,
                [("content-type", "application/json")],
                Bytes::from_static(body),
            )
            .await
            .unwrap_or_else(|e| panic!("send {path}: {e}"));
        let head = client
            .read_response_head()
            .await
            .unwrap_or_else(|e| panic!("head of {path}: {e}"));
        let body = client
            .read_body_to_end(1 << 20)
            .await
            .unwrap_or_else(|e| panic!("body of {path}: {e}"));
        (head, body)
    }

    fn header<'h>(head: &'h iop_engine::http::ResponseHead, name: &str) -> Option<&'h [u8]> {
        head.header(name).map(|v| &v[..])
    }

    /// Serves the Edge's client surface on one accepted connection per
    /// `connections`, and returns a connected client for each.
    async fn connect_clients(
        edge: &Rc<Edge>,
        connections: usize,
    ) -> (
        Vec<iop_engine::http::ClientConn<TcpStream>>,
        monoio::task::JoinHandle<()>,
    ) {
        let listener = monoio::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let served = edge.clone();
        let server = monoio::spawn(async move {
            let mut served_conns = Vec::new();
            for _ in 0..connections {
                let (tcp, _) = listener.accept().await.expect("accept");
                let deadline = served.deadlines.watch(&tcp);
                served_conns.push(monoio::spawn(serve(served.clone(), tcp, deadline, ())));
            }
            for conn in served_conns {
                conn.await;
            }
        });
        let mut clients = Vec::new();
        for _ in 0..connections {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            clients
                .push(iop_engine::http::ClientConn::new(tcp, Limits::default()).with_host("edge"));
        }
        (clients, server)
    }

    #[test]
    fn a_path_segment_is_percent_decoded() {
        assert_eq!(percent_decoded("org%2Fmodel").as_deref(), Some("org/model"));
        assert_eq!(percent_decoded("org%2fmodel").as_deref(), Some("org/model"));
        assert_eq!(percent_decoded("plain-id").as_deref(), Some("plain-id"));
        assert_eq!(percent_decoded("a+b%20c").as_deref(), Some("a+b c"));
        assert_eq!(percent_decoded("caf%C3%A9").as_deref(), Some("café"));
        // Not two hex digits, cut short, or not UTF-8: no name.
        for bad in ["%zz", "%+1", "a%2", "%", "%C3", "%FF"] {
            assert_eq!(percent_decoded(bad), None, "{bad}");
        }
    }

    // The shutdown drain as an open keep-alive connection sees it: /readyz
    // turns 503, /livez stays 200, and any other request gets 503 with
    // retry-after and connection: close (OpenAI shape; Anthropic shape on
    // /v1/messages), after which the Edge closes the connection.
    #[monoio::test_all(timer_enabled = true)]
    async fn a_draining_edge_refuses_requests_on_open_connections() {
        let cfg = EdgeConfig::parse(
            "[edge]\nname = \"e\"\ntrust_domain = \"t\"\nclient_listen = \"127.0.0.1:0\"\n\
             node_listen = \"127.0.0.1:0\"\ninsecure_plaintext_nodes = true\n",
            "edge.toml",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let edge = crate::link::edge::edge_state(&cfg);
        let (mut clients, server) = connect_clients(&edge, 2).await;
        let (head, body) = exchange(&mut clients[0], "GET", "/readyz", b"").await;
        assert_eq!((head.status, &body[..]), (200, &b"ok\n"[..]));

        edge.begin_drain();
        let (head, body) = exchange(&mut clients[0], "GET", "/readyz", b"").await;
        assert_eq!((head.status, &body[..]), (503, &b"draining\n"[..]));
        assert_eq!(header(&head, "connection"), None);
        let (head, body) = exchange(&mut clients[0], "GET", "/livez", b"").await;
        assert_eq!((head.status, &body[..]), (200, &b"ok\n"[..]));
        let (head, body) = exchange(&mut clients[0], "POST", "/v1/chat/completions", b"{}").await;
        assert_eq!(head.status, 503);
        assert_eq!(header(&head, "retry-after"), Some(&b"1"[..]));
        assert_eq!(header(&head, "connection"), Some(&b"close"[..]));
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            "{\"error\":{\"message\":\"The gateway is shutting down; retry shortly.\",\
             \"type\":\"service_unavailable_error\",\"param\":null,\"code\":\"shutting_down\"}}"
        );
        assert!(!head.keep_alive);
        let (head, body) = exchange(&mut clients[1], "POST", "/v1/messages", b"{}").await;
        assert_eq!(head.status, 503);
        assert_eq!(header(&head, "retry-after"), Some(&b"1"[..]));
        assert_eq!(header(&head, "connection"), Some(&b"close"[..]));
        let request_id =
            std::str::from_utf8(header(&head, "x-request-id").expect("an id")).unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            format!(
                "{{\"type\":\"error\",\"error\":{{\"type\":\"overloaded_error\",\
                 \"message\":\"The gateway is shutting down; retry shortly.\"}},\
                 \"request_id\":\"{request_id}\"}}"
            )
        );
        // Both connections were closed by the Edge; nothing is in flight.
        server.await;
        assert_eq!(edge.in_flight_requests(), 0);
    }
}
