//! The client HTTP surface: OpenAI-compatible routes on keep-alive HTTP/1.1
//! connections. Requests are translated to internal dispatches here (E2, U5,
//! X4) and tunnel frames are relayed back unchanged (U1, U2).
//!
//! ```text
//! client ─POST /v1/chat/completions─► parse ─► Control::select ─► tunnel request
//!        ◄─ status+headers, body chunks ◄── RESPONSE_START, BODY* ◄── node conn
//! ```

use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::ReadReadiness;
use iop_engine::http::{HttpError, Limits, LingerEnd, RequestHead, ServerConn, Watched};
use iop_engine::metrics::{self as engine_metrics, Count, Latency};
use iop_engine::net::{Deadline, Wait};
use iop_engine::sync::Either;
use iop_engine::tls::{ListenerStream, MaybeTls};
use iop_wire::codec::BodyParts;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::{AsyncReadRent, AsyncWriteRent, CancelableAsyncReadRent};
use monoio::net::TcpStream;

use crate::api::body_json::JsonLimits;
use crate::api::openai::{self, ApiError, ChatRequest, PassthroughRequest, Surface};
use crate::api::translate::{ChunkStream, Completion, CompletionBuilder, ResponseId};
use crate::config::MetricsAccess;
use crate::control::attempt::AttemptTracker;
use crate::control::{
    AbortReason, CancelReason, Dispatch, DispatchKind, Input, Operation, Rejection, RequestId,
};
use crate::link::edge::{Admission, Edge, RouteEvent, RouteRx};
use crate::link::shards::NodeRequest;
use crate::plane::access::{AccessRecord, REQUEST_ID_HEADER};
use crate::plane::credentials::{Caller, ClientKeys, CredentialError, LeaseRequest};
use crate::plane::limits::{self, Ticket};
use crate::plane::request_metrics::{ActiveStream, Finished, RequestMetrics, Route};
use crate::{client::metrics, client::status, server::front_door};

/// What a client connection's stream can do: plain TCP and TLS both
/// (`AsRawFd`: the TCP socket underneath, for socket options).
pub(crate) trait ClientStream:
    AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent + ReadReadiness + AsRawFd
{
}

impl<S> ClientStream for S where
    S: AsyncReadRent + AsyncWriteRent + CancelableAsyncReadRent + ReadReadiness + AsRawFd
{
}

/// A client connection and what the access log will say of its current
/// request; derefs to the connection.
struct Client<S> {
    edge: Rc<Edge>,
    conn: ServerConn<S>,
    rec: AccessRecord,
    /// When the current request was read; `None` once its line is written.
    read_at: Option<Instant>,
    /// Who sent the current request (set once it is authenticated).
    caller: Option<Caller>,
    /// The current request's claim on its principal's limits, given back
    /// when its line is written (or the connection ends).
    ticket: Option<Box<(ClientKeys, Ticket)>>,
    /// The Edge's per-request series and this shard's index in them.
    metrics: Arc<RequestMetrics>,
    shard: usize,
    /// The current request's route and model slot (its labels).
    route: Route,
    model: usize,
    /// When the last body chunk of the current response was written.
    last_chunk_at: Option<Instant>,
    /// Counts the current request in `iop_edge_active_streams` once
    /// admitted.
    active: Option<ActiveStream>,
}

impl<S> Drop for Client<S> {
    /// A connection task dropped mid-request: its line and usage record
    /// are still written, as `aborted`, and its limits claim given back.
    fn drop(&mut self) {
        if self.read_at.is_some() {
            self.rec.end("aborted");
        }
        self.log_access();
    }
}

impl<S> Client<S> {
    /// Gives the current request's limits claim back, settling its tokens
    /// against the usage observed (once; later calls do nothing).
    fn release_limits(&mut self) {
        if let Some((keys, ticket)) = self.ticket.take().map(|claim| *claim) {
            keys.finish(ticket, self.rec.total_tokens(), clock::now());
        }
    }

    /// [`ServerConn::watch_peer`], also ended by the drain's cut-off
    /// ([`Edge::cut_off`]): then the request ends as `aborted`, as if its
    /// client had left.
    async fn watch_peer<F: std::future::Future>(&mut self, work: F) -> Watched<F::Output>
    where
        S: ClientStream,
    {
        let edge = Rc::clone(&self.edge);
        let work = async move {
            monoio::select! {
                out = work => Some(out),
                _ = edge.cut_off() => None,
            }
        };
        match self.conn.watch_peer(work).await {
            Watched::Done(Some(out)) => Watched::Done(out),
            Watched::Done(None) => {
                self.rec.end("aborted");
                Watched::PeerClosed
            }
            Watched::PeerClosed => Watched::PeerClosed,
        }
    }

    /// Ends a started relay that the drain cut off, as `aborted`: checked
    /// after each event the relay takes (a flag read, nothing armed per
    /// chunk), so a stream is cut at its next event.
    fn check_cut_off(&mut self) -> Result<(), HttpError> {
        if self.edge.is_cut_off() {
            self.rec.end("aborted");
            return Err(HttpError::UnexpectedEof);
        }
        Ok(())
    }

    /// Records the current request's metrics, writes its access log line
    /// and usage record, and gives its limits claim back (once).
    fn log_access(&mut self) {
        let edge = Rc::clone(&self.edge);
        self.release_limits();
        let Some(read_at) = self.read_at.take() else {
            return;
        };
        if is_inference_route(&self.rec.path) {
            crate::client::ui::count_response(self.conn.exchange().status);
        }
        let (unix_ms, ended_at, stats) = (clock::unix_ms(), clock::now(), self.conn.exchange());
        self.active = None;
        self.metrics.finish(
            self.shard,
            &Finished {
                route: self.route,
                model: self.model,
                status: stats.status,
                outcome: self.rec.outcome.as_deref(),
                time_to_first_byte: stats
                    .first_body_byte_at
                    .map(|at| at.saturating_duration_since(read_at)),
                duration: ended_at.saturating_duration_since(read_at),
                tokens: self.rec.prompt_tokens.zip(self.rec.completion_tokens),
            },
        );
        let log = &edge.settings.access_log;
        if log.is_on() {
            log.write(
                self.rec
                    .line(log.format(), unix_ms, &stats, read_at, ended_at),
            );
        }
        // The usage file: inference requests that were authenticated.
        let usage = &edge.settings.usage_log;
        if usage.is_on() && self.caller.is_some() && is_inference_route(&self.rec.path) {
            usage.record(&self.rec.usage_line(unix_ms, &stats, read_at, ended_at));
        }
    }
}

impl<S> std::ops::Deref for Client<S> {
    type Target = ServerConn<S>;

    fn deref(&self) -> &ServerConn<S> {
        &self.conn
    }
}

impl<S> std::ops::DerefMut for Client<S> {
    fn deref_mut(&mut self) -> &mut ServerConn<S> {
        &mut self.conn
    }
}

impl<S: ClientStream> Client<S> {
    /// Starts the record of a request just read: its id (the client's
    /// valid `x-request-id` or a new one) goes on every response to it.
    fn begin(&mut self, edge: &Edge, head: &RequestHead, path: &str, body_len: usize, at: Instant) {
        let id = edge.request_id(head.header(REQUEST_ID_HEADER).map(|v| &v[..]));
        self.start_record(id, &head.method, path, body_len as u64, at);
    }

    /// Starts the record of a request that failed to read (answered with
    /// an early error): what of its head was read, if anything.
    fn begin_unread(&mut self, edge: &Edge, at: Instant) {
        let (method, path, client_id) = match self.conn.unfinished_head() {
            Some(head) => (
                head.method.clone(),
                head.target.split('?').next().unwrap_or_default().to_owned(),
                head.header(REQUEST_ID_HEADER).map(|v| v.to_vec()),
            ),
            None => ("-".to_owned(), "-".to_owned(), None),
        };
        let id = edge.request_id(client_id.as_deref());
        self.start_record(id, &method, &path, 0, at);
    }

    fn start_record(&mut self, id: String, method: &str, path: &str, bytes_in: u64, at: Instant) {
        self.conn
            .set_exchange_header(REQUEST_ID_HEADER, Bytes::from(id.clone()));
        self.rec = AccessRecord::new(id, method, path, bytes_in);
        self.read_at = Some(at);
        self.caller = None;
        self.route = Route::of(path);
        self.model = self.metrics.no_model();
        self.last_chunk_at = None;
        self.active = None;
    }

    /// Notes the model the client named (access log and metric labels).
    fn set_model(&mut self, model: &str) {
        self.rec.set_model(model);
        self.model = self.metrics.model_slot(model);
    }

    /// The current request was admitted: it counts as an active stream of
    /// its model until it ends.
    fn stream_started(&mut self) {
        self.active = Some(self.metrics.stream_started(self.shard, self.model));
    }

    /// metrics: a relayed chunk taken off the route queue at `taken_at`
    /// was written to the client (relay latency, and the gap since the
    /// previous chunk).
    fn chunk_written(&mut self, taken_at: Instant) {
        let now = clock::now();
        engine_metrics::record_between(Latency::EdgeRelayChunkLatency, taken_at, now);
        if let Some(previous) = self.last_chunk_at.replace(now) {
            self.metrics.chunk_interval(
                self.shard,
                self.route,
                self.model,
                now.saturating_duration_since(previous),
            );
        }
    }
}

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
        return Either::left(serve_requests(edge, tcp, deadline, peer, open));
    }
    Either::right(Box::pin(async move {
        // Boxed: the handshake's state is most of a kilobyte and only
        // needed until it is done.
        if let Some(stream) = Box::pin(handshake(&edge, tcp, &deadline, peer)).await {
            serve_requests(edge, stream, deadline, peer, open).await;
        }
    }))
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
    let e = ApiError::too_many_connections();
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
async fn handshake(
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
        Duration::from_millis(edge.settings.limits.client_head_timeout_ms),
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
#[allow(clippy::manual_async_fn)]
fn serve_requests<S: ClientStream, G: 'static>(
    edge: Rc<Edge>,
    stream: S,
    deadline: Deadline,
    peer: Option<std::net::IpAddr>,
    open: G,
) -> impl std::future::Future<Output = ()> {
    // Built before the loop's future: the future captures the connection
    // once, not the stream and deadline beside the connection made of them.
    let limits = Limits {
        max_body_bytes: edge.settings.max_request_body_bytes,
        ..Limits::default()
    };
    let timeouts = front_door::client_timeouts(
        &edge.settings.limits,
        edge.settings.client_write_stall_timeout,
    );
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
            // metrics: end to end starts when the request is read.
            let read_at = clock::now();
            server.begin(&edge, &head, &path, 0, read_at);
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
            let caller = match authenticate(&edge, &path, &head.headers) {
                Ok(caller) => caller,
                Err((surface, e)) => {
                    engine_metrics::add(Count::EdgeClientAuthRefusals, 1);
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
            // The body moves into the route that reads it (it is freed as soon
            // as the route is done with it, not when the response ends).
            let body = match server.read_body(&head).await {
                Ok(body) => body,
                Err(e) => {
                    drop(in_flight);
                    return refuse_request(&edge, &mut server, &e).await;
                }
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
            let result = match (method, path.as_str()) {
                ("GET", "/v1/models") => {
                    let visible: Vec<_> = edge
                        .settings
                        .models
                        .iter()
                        .filter(|m| caller.may_use(&m.id))
                        .cloned()
                        .collect();
                    let body = openai::models_list(&visible, edge.settings.started_unix_sec);
                    write_json(&mut server, 200, body).await
                }
                ("POST", "/v1/chat/completions") => {
                    drop(headers);
                    chat(&edge, &mut server, principal, body).await
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
                            let now = clock::now();
                            let outliers: Vec<status::OutlierView> = control
                                .outliers()
                                .into_iter()
                                .map(|o| status::OutlierView::of(o, now))
                                .collect();
                            let visible = match viewer {
                                Some(viewer) => control.serves_any(|m| viewer.may_use(m)),
                                None => Vec::new(),
                            };
                            (control.snapshots(), outliers, visible)
                        })
                        .await
                    {
                        Some((mut snapshots, mut outliers, visible)) => {
                            if !visible.is_empty() {
                                let mut keep = visible.iter().copied();
                                snapshots.retain(|_| keep.next().unwrap_or(false));
                                let mut keep = visible.iter().copied();
                                outliers.retain(|_| keep.next().unwrap_or(false));
                            }
                            let body =
                                Bytes::from(status::status_json(&snapshots, &outliers).to_string());
                            write_json(&mut server, 200, body).await
                        }
                        None => write_api_error(&mut server, &draining_error()).await,
                    }
                }
                ("GET", "/metrics")
                    if edge.settings.metrics_access == MetricsAccess::Key
                        && !caller.authority.sees_everything() =>
                {
                    write_api_error(&mut server, &ApiError::metrics_scope_required()).await
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
                ("POST", p) if p.starts_with(crate::client::admin::COMMANDS_PREFIX) => {
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
                    | "/status"
                    | "/metrics"
                    | "/livez"
                    | "/readyz"
                    | "/ui"
                    | "/ui/events",
                ) => {
                    write_api_error(&mut server, &ApiError::method_not_allowed(method, &path)).await
                }
                (_, "/v1/messages" | "/v1/messages/count_tokens") => {
                    let e = ApiError::method_not_allowed(method, &path);
                    write_error(&mut server, Surface::Anthropic, &e).await
                }
                _ => write_api_error(&mut server, &ApiError::unknown_route(method, &path)).await,
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

/// Counts and logs a client cut off for taking no bytes of its response
/// for `edge.client_write_stall_timeout_ms` (its connection was reset).
fn write_stalled(edge: &Edge, method: &str, path: &str) {
    engine_metrics::add(Count::EdgeClientWriteStalls, 1);
    if let Some(suppressed) = edge.write_stall_log() {
        tracing::warn!(
            method,
            path,
            stall_timeout_ms = edge.settings.client_write_stall_timeout.as_millis() as u64,
            suppressed,
            "client took no bytes of its response within the write-stall timeout: connection reset"
        );
    }
}

/// The principal of a request to `path`: open routes (`/livez`, `/readyz`,
/// `/metrics`, the `/ui` page) need no key; the others need a configured client key when
/// there are any. The error carries the shape to answer in (Anthropic on
/// `/v1/messages*`, which also accept `x-api-key`).
fn authenticate(
    edge: &Edge,
    path: &str,
    headers: &[iop_engine::http::Header],
) -> Result<Caller, (Surface, ApiError)> {
    // `/ui` is the status page: it holds no data and asks for a key.
    let open_metrics = edge.settings.metrics_access == MetricsAccess::Open;
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

/// The routes that go through admission and a node (metrics: end to end).
fn is_inference_route(path: &str) -> bool {
    [CHAT_COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS]
        .iter()
        .any(|route| route.path == path)
}

/// Answers a request that failed before it could be routed (bad or
/// oversized framing, a stalled head or body) and ends the connection:
/// counted, answered in the route's shape when the head was read (Anthropic
/// on `/v1/messages*`), then closed — with a lingering close when the
/// client may still be sending the request (not after a timeout: its read
/// side is already shut down).
async fn refuse_request<S>(edge: &Edge, server: &mut Client<S>, e: &HttpError)
where
    S: ClientStream,
{
    let counted = match e {
        HttpError::TimedOut(Wait::Head) => Some(Count::EdgeClientHeadTimeouts),
        HttpError::TimedOut(Wait::Body) => Some(Count::EdgeClientBodyTimeouts),
        // A `100 Continue` the client never took.
        HttpError::TimedOut(Wait::Write) => Some(Count::EdgeClientWriteStalls),
        HttpError::TimedOut(_) => Some(Count::EdgeClientIdleTimeouts),
        e if e.is_answerable() => Some(Count::EdgeClientRequestErrors),
        _ => None,
    };
    if let Some(count) = counted {
        engine_metrics::add(count, 1);
    }
    if !e.is_answerable() {
        return;
    }
    let surface = match server.unfinished_head() {
        Some(head) if head.target.starts_with(MESSAGES.path) => Surface::Anthropic,
        _ => Surface::OpenAi,
    };
    let api = http_error(e, edge.settings.max_request_body_bytes);
    if server.read_at.is_none() {
        // The head itself failed: a record of what of it was read.
        server.begin_unread(edge, clock::now());
    }
    let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    headers.push(("connection", "close"));
    let body = api.body_for_request(surface, &server.rec.request_id);
    server.rec.end(api.outcome());
    let written = server.write_response(api.status, headers, body).await;
    server.log_access();
    if written.is_err() {
        return;
    }
    if !matches!(e, HttpError::TimedOut(_)) {
        linger(edge, server).await;
    }
}

/// A lingering close with the configured bounds (counted), or a plain one
/// when lingering is off.
async fn linger<S>(edge: &Edge, server: &mut Client<S>)
where
    S: ClientStream,
{
    let Some(linger) = front_door::client_linger(&edge.settings.limits) else {
        let _ = server.close().await;
        return;
    };
    engine_metrics::add(Count::EdgeClientLingeringCloses, 1);
    let discarded_bytes = match server.linger_close(&linger).await {
        LingerEnd::PeerClosed { discarded_bytes } | LingerEnd::TimedOut { discarded_bytes } => {
            discarded_bytes
        }
        LingerEnd::ByteCapReached => linger.max_bytes,
        LingerEnd::Skipped => 0,
    };
    engine_metrics::add(Count::EdgeClientLingerDiscardedBytes, discarded_bytes);
}

/// The bounds on request JSON (`edge.max_json_depth`, `edge.max_json_elements`,
/// `edge.max_json_members`).
fn json_limits(edge: &Edge) -> JsonLimits {
    JsonLimits {
        max_depth: edge.settings.limits.max_json_depth,
        max_elements: edge.settings.limits.max_json_elements,
        max_members: edge.settings.limits.max_json_members,
    }
}

/// Answers a body the Edge cannot read (400); JSON-limit refusals are
/// counted.
async fn refuse_body<S>(
    server: &mut Client<S>,
    surface: Surface,
    e: &ApiError,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    if e.is_json_limit() {
        engine_metrics::add(Count::EdgeClientJsonLimitRejections, 1);
    }
    write_error(server, surface, e).await
}

fn http_error(e: &HttpError, max_body_bytes: usize) -> ApiError {
    match e.status_code() {
        413 => ApiError::body_too_large(max_body_bytes),
        408 => ApiError::request_timeout(e.to_string()),
        status => ApiError::from_http_status(status, e.to_string()),
    }
}

async fn write_json<S>(server: &mut Client<S>, status: u16, body: Bytes) -> Result<(), HttpError>
where
    S: ClientStream,
{
    server
        .write_response(status, [("content-type", "application/json")], body)
        .await
}

async fn write_api_error<S>(server: &mut Client<S>, e: &ApiError) -> Result<(), HttpError>
where
    S: ClientStream,
{
    write_error(server, Surface::OpenAi, e).await
}

async fn write_error<S>(
    server: &mut Client<S>,
    surface: Surface,
    e: &ApiError,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let retry_after = e.retry_after_sec.map(|s| s.to_string());
    let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    if let Some(r) = retry_after.as_deref() {
        headers.push(("retry-after", r));
    }
    server.rec.end(e.outcome());
    let body = e.body_for_request(surface, &server.rec.request_id);
    server.write_response(e.status, headers, body).await
}

/// The answer to a request that arrives on an already-open connection
/// during the shutdown drain.
pub fn draining_error() -> ApiError {
    ApiError {
        status: 503,
        message: "The gateway is shutting down; retry shortly.".into(),
        kind: "service_unavailable_error",
        param: None,
        code: Some("shutting_down".into()),
        retry_after_sec: Some(1),
    }
}

/// Answers [`draining_error`] (in the route's error shape: Anthropic on
/// `/v1/messages*`) with `connection: close`; the caller then drops the
/// connection.
async fn refuse_while_draining<S>(server: &mut Client<S>, path: &str) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let surface = if path.starts_with(MESSAGES.path) {
        Surface::Anthropic
    } else {
        Surface::OpenAi
    };
    let e = draining_error();
    let retry_after = e.retry_after_sec.unwrap_or(1).to_string();
    let headers = [
        ("content-type", "application/json"),
        ("retry-after", retry_after.as_str()),
        ("connection", "close"),
    ];
    server.rec.end(e.outcome());
    let body = e.body_for_request(surface, &server.rec.request_id);
    server.write_response(e.status, headers, body).await
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// `POST /v1/chat/completions`: admit through `Control`, then relay the
/// provider's answer — again from the next provider `Control` picks when an
/// attempt failed before anything reached the client (pre-commit
/// failover).
async fn chat<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    principal: &str,
    body: Bytes,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let chat = match ChatRequest::parse(body, &json_limits(edge)) {
        Ok(c) => c,
        // Boxed, as every once-per-request await in the streaming routes:
        // the route's future keeps room only for what it holds while the
        // response streams.
        Err(e) => return Box::pin(refuse_body(server, Surface::OpenAi, &e)).await,
    };
    server.set_model(&chat.model);
    let long = edge
        .settings
        .long_context_threshold_tokens
        .get(&chat.model)
        .is_some_and(|&threshold| chat.estimated_prompt_tokens() >= threshold);
    // E2: the external model selects a pool; the inner identifiers come from
    // the winning provider.
    // Boxed: waiting for admission (and answering a refusal) is held only
    // until the request is dispatched.
    let Some((request, mut dispatch, mut frames)) =
        Box::pin(admit(edge, server, CHAT_COMPLETIONS, &chat.model, long)).await?
    else {
        return Ok(());
    };
    // Kept for another attempt until the response commits; released then
    // (see `Release`), so a stream holds no copy of its request.
    let mut retained = Some(chat);
    loop {
        let Some(chat) = retained.as_ref() else {
            return retry_without_request(edge, request);
        };
        let lease = &dispatch.lease;
        server
            .rec
            .attempt(&lease.provider.node_id, &lease.provider.provider_id);
        // U7: the provider's type alone picks the path; the client surface
        // is the same either way. The body is kept for a later attempt.
        let run = match dispatch.kind {
            DispatchKind::Tunnel => {
                let mut tunnel = tunnel_request(
                    CHAT_COMPLETIONS,
                    &dispatch,
                    tunnel_headers(CHAT_COMPLETIONS, chat.stream, &[]),
                    chat.stream,
                    &server.rec.request_id,
                );
                // A stream's usage is always observed (limits, usage file,
                // metrics): a node that can strip the usage chunk has the
                // provider asked for it when the client did not.
                let asking = dispatch
                    .strips_usage_chunk
                    .then(|| chat.body_asking_usage(&lease.target))
                    .flatten();
                tunnel.strip_usage_chunk = asking.is_some();
                let body = asking.unwrap_or_else(|| chat.body_for_target(&lease.target));
                match with_lease(edge, principal, &chat.model, &dispatch, tunnel, body) {
                    Ok(frame) => frame,
                    Err(e) => {
                        return Box::pin(refuse(
                            edge,
                            server,
                            Surface::OpenAi,
                            request,
                            &dispatch,
                            &e,
                        ))
                        .await;
                    }
                }
            }
            DispatchKind::Run => {
                NodeRequest::frame_only(run_request(chat, &dispatch, &server.rec.request_id))
            }
        };
        let (stream, include_usage) = (chat.stream, chat.include_usage());
        let buffered = dispatch.kind == DispatchKind::Run && !stream;
        // Boxed: handing the request to its node is this future's largest
        // state, held only until the node has it, never while it streams.
        if !Box::pin(send_run(
            edge,
            server,
            Surface::OpenAi,
            request,
            &dispatch,
            run,
            buffered,
        ))
        .await?
        {
            return Ok(());
        }
        let release = &mut || retained = None;
        let result = match dispatch.kind {
            DispatchKind::Tunnel => {
                relay(edge, server, Surface::OpenAi, &mut frames, release).await
            }
            DispatchKind::Run => {
                let id = ResponseId {
                    id: format!("chatcmpl-{}", lease.run_id),
                    created: iop_engine::clock::unix_ms() / 1000,
                    model: lease.target.to_string(),
                };
                if stream {
                    relay_run(edge, server, &mut frames, id, include_usage, release).await
                } else {
                    relay_completion(edge, server, &mut frames, id).await
                }
            }
        };
        match settle(edge, request, result)? {
            Some(next) => {
                frames.retarget(&next);
                dispatch = next;
            }
            None => return Ok(()),
        }
    }
}

/// Called once by a relay when its response commits (its first bytes go
/// to the client): the route drops what it kept of the request for
/// another attempt (pre-commit failover only), so a stream holds none of
/// it while it lasts.
type Release<'a> = &'a mut dyn FnMut();

/// How a relay ended.
#[derive(Debug)]
enum Relayed {
    /// The client has its answer (or its error).
    Done,
    /// The attempt failed before anything reached the client and `Control`
    /// dispatched the request again: send and relay this one.
    Retry(Dispatch),
}

/// The next attempt of `request`, if its relay asks for one. A relay that
/// failed (the client is gone, or the response broke off) cancels the run
/// (U6): `Control` sends the node a `CancelRequest` and settles the lease
/// on its terminal.
fn settle(
    edge: &Rc<Edge>,
    request: RequestId,
    result: Result<Relayed, HttpError>,
) -> Result<Option<Dispatch>, HttpError> {
    match result {
        Ok(Relayed::Done) => Ok(None),
        Ok(Relayed::Retry(next)) => Ok(Some(next)),
        Err(e) => {
            edge.apply(Input::Cancel {
                request,
                reason: cancel_reason(&e),
            });
            Err(e)
        }
    }
}

/// A retry dispatched after the request was released. Unreachable: a
/// relay asks for another attempt only before its response commits, and
/// the request is released only at the commit. The new lease is given
/// back and the route ends.
fn retry_without_request(edge: &Edge, request: RequestId) -> Result<(), HttpError> {
    debug_assert!(false, "a retry after the request was released");
    edge.abandon(request);
    Ok(())
}

/// Waits for `Control`'s answer to a submitted request.
async fn admit<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    route: PassRoute,
    model: &str,
    long: bool,
) -> Result<Option<(RequestId, Dispatch, RouteRx)>, HttpError>
where
    S: ClientStream,
{
    if let Some(e) = check_caller(edge, server, model) {
        write_caller_refusal(server, route.surface, &e).await?;
        return Ok(None);
    }
    let submitted_at = clock::now(); // metrics: queue wait
    let (request, mut admission) = edge.submit(model, route.op, long);
    // U6: a client that leaves while queued is removed from the queue; one
    // that leaves just as its lease was won settles the lease at once.
    let answer = match server.watch_peer(&mut admission).await {
        Watched::Done(answer) => {
            engine_metrics::record_since(Latency::EdgeQueueWait, submitted_at);
            answer
        }
        Watched::PeerClosed => {
            match admission.try_recv() {
                Ok(Admission::Dispatched { .. }) => edge.abandon(request),
                _ => edge.apply(Input::Cancel {
                    request,
                    reason: CancelReason::ClientDisconnect,
                }),
            }
            return Ok(None);
        }
    };
    let e = match answer {
        Ok(Admission::Dispatched { dispatch, frames }) => {
            server.stream_started();
            return Ok(Some((request, dispatch, frames)));
        }
        Ok(Admission::Rejected(Rejection::UnknownModel)) => ApiError::model_not_found(model),
        Ok(Admission::Rejected(Rejection::UnsupportedOperation)) => unsupported(model, route),
        Ok(Admission::Rejected(Rejection::QueueFull)) => ApiError::queue_full(model),
        Ok(Admission::Rejected(Rejection::QueueTimeout) | Admission::Ended) | Err(_) => {
            ApiError::no_provider(model)
        }
    };
    write_error(server, route.surface, &e).await?;
    Ok(None)
}

/// Why the caller may not send this request: the key may not use the
/// model (403), or the principal is over a limit (429).
enum CallerRefusal {
    Model(ApiError),
    Limit(limits::Refusal),
}

/// The key's checks, before the request takes a place in the queue: model
/// access, then the principal's limits (on admission the request holds a
/// [`Ticket`] until its access line is written).
fn check_caller<S>(edge: &Edge, server: &mut Client<S>, model: &str) -> Option<CallerRefusal> {
    let caller = server.caller.as_ref()?;
    if !caller.may_use(model) {
        return Some(CallerRefusal::Model(ApiError::model_not_allowed(model)));
    }
    let keys = &edge.settings.client_keys;
    let estimate = limits::estimate_prompt_tokens(server.rec.bytes_in as usize);
    match keys.admit(&caller.principal, estimate, clock::now()) {
        limits::Admission::Granted(ticket, _) => {
            server.release_limits();
            server.ticket = Some(Box::new((keys.clone(), ticket)));
            None
        }
        limits::Admission::Refused(refusal) => Some(CallerRefusal::Limit(refusal)),
    }
}

/// Answers a [`CallerRefusal`]: a 429 carries `retry-after` (seconds, and
/// `retry-after-ms`, which the official SDKs prefer) and OpenAI's
/// `x-ratelimit-*` headers.
async fn write_caller_refusal<S>(
    server: &mut Client<S>,
    surface: Surface,
    refusal: &CallerRefusal,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let r = match refusal {
        CallerRefusal::Model(e) => return write_error(server, surface, e).await,
        CallerRefusal::Limit(r) => r,
    };
    let e = ApiError::rate_limited(r.kind.as_str(), r.message(), r.retry_after_secs());
    let retry_after = r.retry_after_secs().to_string();
    let retry_after_ms = r.retry_after.as_millis().max(1).to_string();
    let mut rate = String::new();
    r.headers.write_openai(&mut rate);
    let mut headers: Vec<(&str, &str)> = vec![
        ("content-type", "application/json"),
        ("retry-after", &retry_after),
        ("retry-after-ms", &retry_after_ms),
    ];
    headers.extend(
        rate.split_terminator("\r\n")
            .filter_map(|line| line.split_once(": ")),
    );
    server.rec.end(e.outcome());
    let body = e.body_for_request(surface, &server.rec.request_id);
    server.write_response(e.status, headers, body).await
}

/// 400: no provider of `model` serves `route`'s operation.
fn unsupported(model: &str, route: PassRoute) -> ApiError {
    ApiError::invalid_request(
        format!("No provider serving `{model}` supports {}.", route.path),
        None,
    )
}

/// Sends a run to the lease's node; on failure settles the request and
/// answers the client. Returns whether it was sent. `buffered`: its relay
/// writes only at the end (the commit point, [`crate::control::attempt`]).
async fn send_run<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    surface: Surface,
    request: RequestId,
    dispatch: &Dispatch,
    run: NodeRequest,
    buffered: bool,
) -> Result<bool, HttpError>
where
    S: ClientStream,
{
    let sent = edge.start_run(request, dispatch, run, buffered).await;
    if !sent {
        edge.abandon(request);
        let e = ApiError::upstream(
            "the selected node disconnected",
            Some("node_unavailable".into()),
        );
        write_error(server, surface, &e).await?;
    }
    Ok(sent)
}

/// `POST /v1/responses`, `/v1/messages`, `/v1/messages/count_tokens`: raw
/// passthrough over a provider tunnel (U1–U5), with pre-commit failover.
async fn passthrough<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    principal: &str,
    route: PassRoute,
    headers: Vec<iop_engine::http::Header>,
    body: Bytes,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let req = match PassthroughRequest::parse(body, &json_limits(edge)) {
        Ok(r) => r,
        Err(e) => return refuse_body(server, route.surface, &e).await,
    };
    // What the provider gets of the client's headers; the rest go now.
    let forwarded = tunnel_headers(route, req.stream, &headers);
    drop(headers);
    server.set_model(&req.model);
    let Some((request, mut dispatch, mut frames)) =
        admit(edge, server, route, &req.model, false).await?
    else {
        return Ok(());
    };
    // Kept for another attempt until the response commits, as in `chat`.
    let mut retained = Some((req, forwarded));
    loop {
        let Some((req, forwarded)) = retained.as_ref() else {
            return retry_without_request(edge, request);
        };
        if dispatch.kind != DispatchKind::Tunnel {
            // Control files native (Ollama) providers, which speak only the
            // normalized chat path, in no lane of these operations: this is
            // a wiring bug, answered as if no provider served it.
            edge.abandon(request);
            return write_error(server, route.surface, &unsupported(&req.model, route)).await;
        }
        let lease = &dispatch.lease;
        server
            .rec
            .attempt(&lease.provider.node_id, &lease.provider.provider_id);
        let tunnel = tunnel_request(
            route,
            &dispatch,
            forwarded.clone(),
            req.stream,
            &server.rec.request_id,
        );
        let body = req.body_for_target(&dispatch.lease.target);
        let run = match with_lease(edge, principal, &req.model, &dispatch, tunnel, body) {
            Ok(frame) => frame,
            Err(e) => return refuse(edge, server, route.surface, request, &dispatch, &e).await,
        };
        if !Box::pin(send_run(
            edge,
            server,
            route.surface,
            request,
            &dispatch,
            run,
            false,
        ))
        .await?
        {
            return Ok(());
        }
        let result = relay(edge, server, route.surface, &mut frames, &mut || {
            retained = None
        })
        .await;
        match settle(edge, request, result)? {
            Some(next) => {
                frames.retarget(&next);
                dispatch = next;
            }
            None => return Ok(()),
        }
    }
}

/// A passthrough route: which profile operation it is (U3) and which client
/// API it speaks.
#[derive(Debug, Clone, Copy)]
struct PassRoute {
    operation: &'static str,
    op: Operation,
    path: &'static str,
    surface: Surface,
}

const CHAT_COMPLETIONS: PassRoute = PassRoute {
    operation: "chat_completions",
    op: Operation::ChatCompletions,
    path: "/v1/chat/completions",
    surface: Surface::OpenAi,
};
const RESPONSES: PassRoute = PassRoute {
    operation: "responses",
    op: Operation::Responses,
    path: "/v1/responses",
    surface: Surface::OpenAi,
};
const MESSAGES: PassRoute = PassRoute {
    operation: "messages",
    op: Operation::Messages,
    path: "/v1/messages",
    surface: Surface::Anthropic,
};
const COUNT_TOKENS: PassRoute = PassRoute {
    operation: "count_tokens",
    op: Operation::CountTokens,
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

/// The frame for `tunnel` with its credential lease and binding (C1),
/// issued for exactly this request; none when the credential plane is
/// disabled or no slot serves the provider.
fn with_lease(
    edge: &Edge,
    principal: &str,
    model: &str,
    dispatch: &Dispatch,
    mut tunnel: pb::ProviderTunnelRequest,
    body: BodyParts,
) -> Result<NodeRequest, CredentialError> {
    if let Some(plane) = &edge.settings.credentials {
        let lease = &dispatch.lease;
        let issued = plane.issue_now(&LeaseRequest {
            principal,
            route: model,
            node_id: &lease.provider.node_id,
            provider_id: &lease.provider.provider_id,
            generation: lease.generation.0,
            tunnel: &tunnel,
            body: &body,
        })?;
        if let Some(issued) = issued {
            tunnel.credential_lease = Some(issued.lease);
            tunnel.credential_binding = Some(issued.binding);
        }
    }
    Ok(NodeRequest {
        frame: frame(Body::ProviderTunnelRequest(Box::new(tunnel))),
        body,
    })
}

/// Fails a dispatched request whose credential cannot be issued (C3, C5):
/// the provider lease is settled at once, nothing is sent to the node, no
/// other slot or provider is tried, and the client gets 503.
async fn refuse<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    surface: Surface,
    request: RequestId,
    dispatch: &Dispatch,
    e: &CredentialError,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let lease = &dispatch.lease;
    tracing::warn!(
        provider = %lease.provider,
        error = %e,
        "no credential lease issued; request refused"
    );
    edge.abandon(request);
    write_error(server, surface, &e.api_error()).await
}

/// The tunnel request for an OpenAI-compatible provider (U1, U3, U5, W2),
/// without its body (it travels in pieces beside the frame, see
/// [`NodeRequest`]) and without a credential lease yet ([`with_lease`]
/// adds both).
fn tunnel_request(
    route: PassRoute,
    dispatch: &Dispatch,
    headers: Vec<pb::Header>,
    stream: bool,
    correlation_id: &str,
) -> pb::ProviderTunnelRequest {
    let lease = &dispatch.lease;
    pb::ProviderTunnelRequest {
        run_id: lease.run_id.clone(),
        adapter: lease.adapter.to_string(),
        target: lease.target.to_string(),
        method: "POST".into(),
        path: route.path.into(),
        headers,
        stream,
        // W2: the winning provider's effective stall timeout.
        response_stall_timeout_ms: dispatch.response_stall_timeout_ms,
        operation: route.operation.into(),
        correlation_id: correlation_id.into(),
        ..Default::default()
    }
}

/// The normalized run for an Ollama/native provider (E1–E3, W2).
fn run_request(chat: &ChatRequest, dispatch: &Dispatch, correlation_id: &str) -> pb::Frame {
    let lease = &dispatch.lease;
    let run = pb::RunRequest {
        run_id: lease.run_id.clone(),
        adapter: lease.adapter.to_string(),
        target: lease.target.to_string(),
        input: Some(chat.run_input()),
        response_stall_timeout_ms: dispatch.response_stall_timeout_ms,
        correlation_id: correlation_id.into(),
        ..Default::default()
    };
    frame(Body::RunRequest(Box::new(run)))
}

/// The message a client gets when its node disconnected mid-request.
const NODE_LOST: &str = "the node serving this request disconnected";

/// A run cut off because its client drained slower than its node sent
/// ([`RouteEvent::Overflow`]).
#[derive(Debug, thiserror::Error)]
#[error("the run was cut off: the client drained slower than its node sent")]
struct CutOff;

/// The error a relay ends with when its run was cut off: the response broke
/// off, so the connection closes and the caller cancels the run (U6) with
/// [`CancelReason::ClientTooSlow`].
fn cut_off() -> HttpError {
    HttpError::Io(std::io::Error::other(CutOff))
}

/// Why a relay that failed with `e` cancels its run (U6).
fn cancel_reason(e: &HttpError) -> CancelReason {
    match e {
        HttpError::Io(io) if io.get_ref().is_some_and(|inner| inner.is::<CutOff>()) => {
            CancelReason::ClientTooSlow
        }
        HttpError::TimedOut(Wait::Write) => CancelReason::ClientWriteStall,
        _ => CancelReason::ClientDisconnect,
    }
}

/// Code and message of an answer to a client whose run was cut off.
const CUT_OFF_CODE: &str = "client_too_slow";
const CUT_OFF_MESSAGE: &str = "The response outgrew what this client was reading.";

/// Relays a normalized run as one `chat.completion` (E1, E5). Every event
/// taken from the route is credited back to the node as soon as the
/// builder took it. Nothing is written before the attempt commits
/// ([`crate::control::attempt`]): the answer waits for its `complete`; an attempt
/// that fails before may be retried elsewhere ([`Relayed::Retry`]).
///
/// Apart from [`relay_run`] (the streamed form), so neither's future keeps
/// room for the other's state.
async fn relay_completion<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    frames: &mut RouteRx,
    id: ResponseId,
) -> Result<Relayed, HttpError>
where
    S: ClientStream,
{
    let mut tracker = AttemptTracker::buffered();
    let mut builder = CompletionBuilder::new(id);
    loop {
        let next = match Box::pin(server.watch_peer(frames.recv())).await {
            Watched::Done(next) => next,
            Watched::PeerClosed => return Err(HttpError::UnexpectedEof),
        };
        let charge = next.as_ref().map_or(0, RouteEvent::charge);
        match next {
            Some(RouteEvent::Run(ev)) if ev.run_id == frames.run_id() => {
                tracker.on_run_event(&ev);
                if let Some(usage) = &ev.usage {
                    server
                        .rec
                        .usage(usage.prompt_tokens, usage.completion_tokens);
                }
                let done = builder.on_event(&ev);
                // The builder took it: the node may send more.
                frames.drained(edge, charge);
                match done {
                    Some(Completion::Done(v)) => {
                        let taken_at = clock::now();
                        Box::pin(write_json(server, 200, Bytes::from(v.to_string()))).await?;
                        server.chunk_written(taken_at);
                        return Ok(Relayed::Done);
                    }
                    Some(Completion::Failed { code, message }) => {
                        if tracker.end_of_run(&ev).is_retryable() {
                            if let Some(next) = Box::pin(verdict(edge, server, frames)).await? {
                                return Ok(Relayed::Retry(next));
                            }
                        }
                        return Box::pin(fail(
                            server,
                            Surface::OpenAi,
                            false,
                            false,
                            &message,
                            &code,
                        ))
                        .await
                        .map(|()| Relayed::Done);
                    }
                    None => {}
                }
            }
            // Another attempt's, or not a run's: nothing for this one.
            Some(RouteEvent::Run(_) | RouteEvent::Tunnel(_)) => frames.drained(edge, charge),
            Some(RouteEvent::Retry(next)) => return Ok(Relayed::Retry(*next)),
            Some(RouteEvent::Aborted(reason)) => {
                return Box::pin(abort(server, Surface::OpenAi, false, false, reason))
                    .await
                    .map(|()| Relayed::Done)
            }
            Some(RouteEvent::Overflow) => {
                let _ = Box::pin(fail(
                    server,
                    Surface::OpenAi,
                    false,
                    false,
                    CUT_OFF_MESSAGE,
                    CUT_OFF_CODE,
                ))
                .await;
                return Err(cut_off());
            }
            Some(RouteEvent::Lost) | None => {
                return Box::pin(fail(
                    server,
                    Surface::OpenAi,
                    false,
                    false,
                    NODE_LOST,
                    "node_disconnected",
                ))
                .await
                .map(|()| Relayed::Done)
            }
        }
    }
}

/// Relays a normalized run as OpenAI chat completion chunks (E1, E4). Every
/// event taken from the route is credited back to the node as soon as the
/// client took its bytes (or the relay held it). Nothing is written before
/// the attempt commits ([`crate::control::attempt`]): the stream's `start` waits for
/// its first delta; an attempt that fails before may be retried elsewhere
/// ([`Relayed::Retry`]).
async fn relay_run<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    frames: &mut RouteRx,
    id: ResponseId,
    include_usage: bool,
    release: Release<'_>,
) -> Result<Relayed, HttpError>
where
    S: ClientStream,
{
    let mut tracker = AttemptTracker::new();
    let mut stream = ChunkStream::new(id, include_usage);
    // Events before the first delta (its `start`), held until it commits.
    let mut held: Vec<pb::RunEvent> = Vec::new();
    let mut started = false;
    loop {
        let next = if started {
            let next = frames.recv().await;
            server.check_cut_off()?;
            next
        } else {
            match Box::pin(server.watch_peer(frames.recv())).await {
                Watched::Done(next) => next,
                Watched::PeerClosed => return Err(HttpError::UnexpectedEof),
            }
        };
        // As in `relay`: `next` and the event move whole into calls and are
        // never borrowed here, so this future keeps no room for them.
        let (charge, ev) = match run_event(next, frames.run_id()) {
            Ok(taken) => taken,
            Err((charge, Some(RouteEvent::Run(_) | RouteEvent::Tunnel(_)))) => {
                frames.drained(edge, charge);
                continue;
            }
            Err((_, Some(RouteEvent::Retry(next)))) => {
                // Control never retries a committed attempt.
                if !started {
                    return Ok(Relayed::Retry(*next));
                }
                continue;
            }
            Err((_, Some(RouteEvent::Aborted(reason)))) => {
                return Box::pin(abort(server, Surface::OpenAi, started, true, reason))
                    .await
                    .map(|()| Relayed::Done)
            }
            Err((_, Some(RouteEvent::Overflow))) => {
                let _ = Box::pin(fail(
                    server,
                    Surface::OpenAi,
                    started,
                    true,
                    CUT_OFF_MESSAGE,
                    CUT_OFF_CODE,
                ))
                .await;
                return Err(cut_off());
            }
            Err((_, Some(RouteEvent::Lost) | None)) => {
                return Box::pin(fail(
                    server,
                    Surface::OpenAi,
                    started,
                    true,
                    NODE_LOST,
                    "node_disconnected",
                ))
                .await
                .map(|()| Relayed::Done)
            }
        };
        let taken_at = clock::now();
        let (earlier, chunks) = match run_step(
            *ev,
            &mut tracker,
            &mut server.rec,
            &mut stream,
            &mut held,
            started,
        ) {
            RunStep::Write { earlier, chunks } => (earlier, chunks),
            RunStep::Held => {
                frames.drained(edge, charge);
                continue;
            }
            RunStep::Failed(ev) => {
                // Nothing was sent yet: another provider may take it, or the
                // client gets an HTTP error.
                if tracker.end_of_run(&ev).is_retryable() {
                    if let Some(next) = Box::pin(verdict(edge, server, frames)).await? {
                        return Ok(Relayed::Retry(next));
                    }
                }
                let code = if ev.failure_code.is_empty() {
                    "provider_error"
                } else {
                    ev.failure_code.as_str()
                };
                return Box::pin(fail(server, Surface::OpenAi, false, true, &ev.error, code))
                    .await
                    .map(|()| Relayed::Done);
            }
        };
        if !started {
            Box::pin(server.start_chunked(
                200,
                [
                    ("content-type", "text/event-stream"),
                    ("cache-control", "no-cache"),
                ],
            ))
            .await?;
            started = true;
            release();
            for chunk in earlier {
                server.write_chunk(chunk).await?;
            }
        }
        for chunk in chunks {
            server.write_chunk(chunk).await?;
            server.chunk_written(taken_at);
        }
        frames.drained(edge, charge);
        if stream.is_finished() {
            return server.finish().await.map(|()| Relayed::Done);
        }
    }
}

/// The route event's flow-control charge, and the run event of this
/// attempt or the event that is not one. Takes `next` whole (see `relay`).
// Large both ways, as the event itself is: matched at once by the caller
// (boxing it would allocate per event).
#[allow(clippy::result_large_err)]
fn run_event(
    next: Option<RouteEvent>,
    run_id: &str,
) -> Result<(u64, Box<pb::RunEvent>), (u64, Option<RouteEvent>)> {
    let charge = next.as_ref().map_or(0, RouteEvent::charge);
    match next {
        Some(RouteEvent::Run(ev)) if ev.run_id == run_id => Ok((charge, ev)),
        other => Err((charge, other)),
    }
}

/// What `relay_run` does with one event of its streamed attempt.
enum RunStep {
    /// An error before anything was sent (boxed: once per request).
    Failed(Box<pb::RunEvent>),
    /// Held until the attempt commits.
    Held,
    /// Chunks to write: those of the held events first (when this event
    /// starts the response), then this event's.
    Write {
        earlier: Vec<Bytes>,
        chunks: Vec<Bytes>,
    },
}

/// Takes one event of a streamed run: the attempt tracker and the usage
/// record see it, and it is translated (after the held events, in order)
/// or held. The event is consumed here, so only its chunks wait in
/// `relay_run`'s future for the client.
fn run_step(
    ev: pb::RunEvent,
    tracker: &mut AttemptTracker,
    rec: &mut AccessRecord,
    stream: &mut ChunkStream,
    held: &mut Vec<pb::RunEvent>,
    started: bool,
) -> RunStep {
    let commits = tracker.on_run_event(&ev);
    if let Some(usage) = &ev.usage {
        rec.usage(usage.prompt_tokens, usage.completion_tokens);
    }
    let is_error = matches!(
        ev.r#type(),
        pb::RunEventType::Error | pb::RunEventType::Cancelled
    );
    if !started && is_error {
        return RunStep::Failed(Box::new(ev));
    }
    if !started && !commits && ev.r#type() != pb::RunEventType::Complete {
        held.push(ev);
        return RunStep::Held;
    }
    let earlier = std::mem::take(held)
        .iter()
        .flat_map(|earlier| stream.on_event(earlier))
        .collect();
    RunStep::Write {
        earlier,
        chunks: stream.on_event(&ev),
    }
}

/// After an attempt failed before anything reached the client: waits for
/// `Control`'s verdict. The next attempt's dispatch, or `None` when the
/// request ended there (the failure stands and is answered). Anything
/// else still queued on the route belongs to the failed attempt.
async fn verdict<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    frames: &mut RouteRx,
) -> Result<Option<Dispatch>, HttpError>
where
    S: ClientStream,
{
    loop {
        match server.watch_peer(frames.recv()).await {
            Watched::PeerClosed => return Err(HttpError::UnexpectedEof),
            Watched::Done(Some(RouteEvent::Retry(next))) => return Ok(Some(*next)),
            Watched::Done(Some(RouteEvent::Lost) | None) => return Ok(None),
            Watched::Done(Some(other)) => frames.drained(edge, other.charge()),
        }
    }
}

/// Starts the client's response with a provider's held response head
/// and `first` (the first body bytes, possibly empty) in one write.
async fn start_response<S>(
    server: &mut Client<S>,
    head: &pb::ProviderTunnelFrame,
    first: Bytes,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let status = u16::try_from(head.status).unwrap_or(502);
    let headers: Vec<(&str, &[u8])> = head
        .headers
        .iter()
        .filter(|h| !openai::is_hop_by_hop(&h.name))
        .map(|h| (h.name.as_str(), &h.value[..]))
        .collect();
    server.start_chunked_with(status, headers, first).await
}

/// Relays tunnel frames to the client until the terminal, crediting each
/// body back to the node once the client's socket took it (or the relay
/// held it). The provider's response head is held until the attempt
/// commits ([`crate::control::attempt`]): its first body byte, or for a 5xx head
/// the end of its body (bounded). An attempt that fails before may be
/// retried elsewhere ([`Relayed::Retry`]).
async fn relay<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    surface: Surface,
    frames: &mut RouteRx,
    release: Release<'_>,
) -> Result<Relayed, HttpError>
where
    S: ClientStream,
{
    let mut tracker = AttemptTracker::new();
    // Boxed, like everything this future holds only for a moment: the
    // future is sized by what it holds at its largest await, for the life
    // of the stream.
    let mut head: Option<Box<pb::ProviderTunnelFrame>> = None;
    // Body of a 5xx head, held (and already credited) until it commits.
    let mut held: Vec<Bytes> = Vec::new();
    let mut started = false;
    let mut event_stream = false;
    loop {
        let next = if started {
            let next = frames.recv().await;
            server.check_cut_off()?;
            next
        } else {
            // Before the first byte goes out, a client that leaves is seen
            // at once (U6), not at the first write. The watch is boxed: it
            // is this future's largest state, and only needed until then.
            match Box::pin(server.watch_peer(frames.recv())).await {
                Watched::Done(next) => next,
                Watched::PeerClosed => return Err(HttpError::UnexpectedEof),
            }
        };
        // `next`, and the frame it holds, move whole into calls and are
        // never borrowed here: a borrowed local keeps its room in this
        // future across every later await (this turn's writes included).
        let (charge, tf) = match tunnel_frame(next, frames.run_id()) {
            Ok(taken) => taken,
            Err((charge, Some(RouteEvent::Tunnel(_) | RouteEvent::Run(_)))) => {
                frames.drained(edge, charge);
                continue;
            }
            Err((_, Some(RouteEvent::Retry(next)))) => {
                // Control never retries a committed attempt.
                if !started {
                    return Ok(Relayed::Retry(*next));
                }
                continue;
            }
            Err((_, Some(RouteEvent::Aborted(reason)))) => {
                return Box::pin(abort(server, surface, started, event_stream, reason))
                    .await
                    .map(|()| Relayed::Done)
            }
            Err((_, Some(RouteEvent::Overflow))) => {
                let _ = Box::pin(fail(
                    server,
                    surface,
                    started,
                    event_stream,
                    CUT_OFF_MESSAGE,
                    CUT_OFF_CODE,
                ))
                .await;
                return Err(cut_off());
            }
            Err((_, Some(RouteEvent::Lost) | None)) => {
                return Box::pin(fail(
                    server,
                    surface,
                    started,
                    event_stream,
                    NODE_LOST,
                    "node_disconnected",
                ))
                .await
                .map(|()| Relayed::Done);
            }
        };
        match tunnel_step(tf, &mut tracker) {
            TunnelStep::Head(tf) => {
                if !started && head.is_none() {
                    event_stream = tf.headers.iter().any(|h| {
                        h.name.eq_ignore_ascii_case("content-type")
                            && h.value.starts_with(b"text/event-stream")
                    });
                    head = Some(tf);
                }
            }
            TunnelStep::Body { mut body, commits } => {
                let (taken_at, len) = (clock::now(), body.len() as u64);
                if commits {
                    if let Some(h) = head.take() {
                        // The head goes out with the first body bytes, in
                        // one write (one wake-up of the client, not two).
                        let first = if held.is_empty() {
                            std::mem::take(&mut body)
                        } else {
                            held.remove(0)
                        };
                        Box::pin(start_response(server, &h, first)).await?;
                    }
                    started = true;
                    release();
                    for body in std::mem::take(&mut held) {
                        server.write_chunk(body).await?;
                    }
                }
                if started {
                    server.write_chunk(body).await?;
                    server.chunk_written(taken_at);
                    engine_metrics::add(Count::EdgeRelayBodyBytes, len);
                } else if head.is_some() && !body.is_empty() {
                    held.push(body);
                }
                frames.drained(edge, charge);
            }
            TunnelStep::Other { usage } => {
                if let Some(usage) = usage {
                    server
                        .rec
                        .usage(usage.prompt_tokens, usage.completion_tokens);
                }
                frames.drained(edge, charge);
            }
            TunnelStep::End(tf) => {
                if started {
                    return server.finish().await.map(|()| Relayed::Done);
                }
                if tracker.end_of_tunnel(&tf).is_retryable() {
                    if let Some(next) = Box::pin(verdict(edge, server, frames)).await? {
                        return Ok(Relayed::Retry(next));
                    }
                }
                let Some(h) = head.take() else {
                    let e = ApiError::upstream("the provider sent no response", None);
                    return Box::pin(write_error(server, surface, &e))
                        .await
                        .map(|()| Relayed::Done);
                };
                // The provider's answer as it is (a 5xx that no other
                // provider could take, or an empty body).
                let first = if held.is_empty() {
                    Bytes::new()
                } else {
                    held.remove(0)
                };
                Box::pin(start_response(server, &h, first)).await?;
                for body in std::mem::take(&mut held) {
                    server.write_chunk(body).await?;
                }
                server.chunk_written(clock::now());
                return server.finish().await.map(|()| Relayed::Done);
            }
            TunnelStep::Error(tf) => {
                if !started && tracker.end_of_tunnel(&tf).is_retryable() {
                    if let Some(next) = Box::pin(verdict(edge, server, frames)).await? {
                        return Ok(Relayed::Retry(next));
                    }
                }
                let code = if tf.failure_code.is_empty() {
                    "provider_error"
                } else {
                    tf.failure_code.as_str()
                };
                return Box::pin(fail(
                    server,
                    surface,
                    started,
                    event_stream,
                    &tf.error,
                    code,
                ))
                .await
                .map(|()| Relayed::Done);
            }
        }
    }
}

/// The route event's flow-control charge, and the tunnel frame of this
/// attempt or the event that is not one. Takes `next` whole (see `relay`).
// Large both ways, as the event itself is: matched at once by the caller
// (boxing it would allocate per event).
#[allow(clippy::result_large_err)]
fn tunnel_frame(
    next: Option<RouteEvent>,
    run_id: &str,
) -> Result<(u64, Box<pb::ProviderTunnelFrame>), (u64, Option<RouteEvent>)> {
    let charge = next.as_ref().map_or(0, RouteEvent::charge);
    match next {
        Some(RouteEvent::Tunnel(tf)) if tf.run_id == run_id => Ok((charge, tf)),
        other => Err((charge, other)),
    }
}

/// One frame of the attempt, as `relay` acts on it. The frame is consumed
/// here; the once-per-request frames (the head, the terminal) are boxed,
/// so a body frame leaves only its bytes in `relay`'s future.
enum TunnelStep {
    Head(Box<pb::ProviderTunnelFrame>),
    Body {
        body: Bytes,
        commits: bool,
    },
    /// `USAGE` (observation only), or a kind this Edge does not know.
    Other {
        usage: Option<pb::Usage>,
    },
    End(Box<pb::ProviderTunnelFrame>),
    Error(Box<pb::ProviderTunnelFrame>),
}

fn tunnel_step(mut tf: Box<pb::ProviderTunnelFrame>, tracker: &mut AttemptTracker) -> TunnelStep {
    let commits = tracker.on_tunnel_frame(&tf);
    match tf.kind() {
        pb::TunnelFrameKind::ResponseStart => TunnelStep::Head(tf),
        pb::TunnelFrameKind::Body => TunnelStep::Body {
            body: std::mem::take(&mut tf.body),
            commits,
        },
        pb::TunnelFrameKind::Usage | pb::TunnelFrameKind::Unspecified => TunnelStep::Other {
            usage: tf.usage.as_deref().copied(),
        },
        pb::TunnelFrameKind::End => TunnelStep::End(tf),
        pb::TunnelFrameKind::Error => TunnelStep::Error(tf),
    }
}

/// Ends a relay Control gave up on ([`RouteEvent::Aborted`]): the run is
/// already cancelled on its node, so the client only gets the error — 504
/// in the route's shape when nothing was sent yet (U6).
async fn abort<S>(
    server: &mut Client<S>,
    surface: Surface,
    started: bool,
    event_stream: bool,
    reason: AbortReason,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let message = match reason {
        AbortReason::ResponseWaitTimeout => {
            "The provider did not start a response within edge.response_wait_timeout_ms."
        }
    };
    fail(
        server,
        surface,
        started,
        event_stream,
        message,
        reason.as_str(),
    )
    .await
}

/// Ends a failed relay: an HTTP error before the response started, or an
/// SSE error event (then `[DONE]`) inside a started event stream. The
/// client gets [`openai::client_message`]; a node's words it is not shown
/// (they name the provider's address) go to the Edge's log.
async fn fail<S>(
    server: &mut Client<S>,
    surface: Surface,
    started: bool,
    event_stream: bool,
    message: &str,
    code: &str,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    server.rec.end(code);
    let detail = message;
    let message = openai::client_message(code, detail);
    if message != detail {
        tracing::warn!(
            request_id = %server.rec.request_id,
            node = server.rec.node.as_deref().unwrap_or_default(),
            provider = server.rec.provider.as_deref().unwrap_or_default(),
            code,
            detail,
            "provider attempt failed"
        );
    }
    if !started {
        let e = if matches!(code, "response_stalled" | "response_wait_timeout") {
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

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;
    use iop_wire::lease::{request_digest, BoundRequest, RecipientKey};
    use prost::Message;
    use x25519_dalek::StaticSecret;
    use zeroize::Zeroizing;

    use super::*;
    use crate::config::EdgeConfig;
    use crate::control::{ConnId, Generation, Lease, ProviderKey};
    use crate::plane::credentials::CredentialPlane;

    const SECRET: &[u8] = b"sk-iop-surface-canary-1b2c";

    fn dispatch() -> Dispatch {
        Dispatch {
            request: RequestId(4),
            lease: Lease {
                request: RequestId(4),
                run_id: "run-4".into(),
                provider: ProviderKey {
                    node_id: "node-a".into(),
                    provider_id: "gpt".into(),
                },
                conn: ConnId(1),
                generation: Generation(2),
                adapter: "openai".into(),
                target: "gpt-4o".into(),
                long: false,
            },
            kind: DispatchKind::Tunnel,
            response_stall_timeout_ms: 0,
            strips_usage_chunk: true,
        }
    }

    fn plane() -> (EdgeConfig, CredentialPlane) {
        let recipient = RecipientKey::from_secret(StaticSecret::from([9; 32]));
        let text = format!(
            "[edge]\nname = \"e\"\ntrust_domain = \"t\"\nclient_listen = \"127.0.0.1:0\"\n\
             node_listen = \"127.0.0.1:0\"\n[tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n\
             [credentials]\nissuer_key = \"i\"\n[[credentials.slots]]\nname = \"s\"\n\
             secret_env = \"K\"\nproviders = [\"node-a/gpt\"]\n[[nodes]]\nid = \"node-a\"\n\
             recipient_key = \"{}\"\n[[nodes.adapters]]\nname = \"openai\"\n\
             kind = \"openai_compat\"\nbase_url = \"http://127.0.0.1:9/serving\"\n\
             [[nodes.providers]]\n\
             id = \"gpt\"\nadapter = \"openai\"\ntarget = \"gpt-4o\"\ncapacity = 1\n\
             [[models]]\nname = \"gpt-x\"\nproviders = [\"node-a/gpt\"]\n",
            iop_engine::keys::encode_recipient_public_key(&recipient.public_key())
        );
        let cfg = EdgeConfig::parse(&text, "edge.toml").unwrap_or_else(|e| panic!("{e}"));
        let plane = CredentialPlane::from_parts(
            &cfg,
            SigningKey::from_bytes(&[7; 32]),
            vec![Zeroizing::new(SECRET.to_vec())],
            Zeroizing::new([3; 32]),
        );
        (cfg, plane)
    }

    // CONTRACT: C1, C4 — the tunnel request carries the lease and binding
    // in fields 14/15, issued for exactly this request (its run, the
    // provider origin and the digest of path, headers and body); the
    // plaintext appears nowhere in the encoded frame (only sealed), and no
    // credential goes into headers or metadata.
    #[test]
    fn tunnel_frame_carries_only_the_sealed_lease() {
        let dispatch = dispatch();
        let (cfg, plane) = plane();
        let edge = crate::link::settings::edge_state_with(&cfg, Some(plane));
        let client = [iop_engine::http::Header {
            name: "authorization".into(),
            value: Bytes::from_static(b"Bearer client-key"),
        }];
        let tunnel = tunnel_request(
            CHAT_COMPLETIONS,
            &dispatch,
            tunnel_headers(CHAT_COMPLETIONS, true, &client),
            true,
            "req-test",
        );
        // The body in pieces, as a spliced one travels.
        let body = || {
            BodyParts::spliced(
                Bytes::from_static(b"{"),
                Bytes::new(),
                Bytes::from_static(b"}"),
            )
        };
        let frame = with_lease(
            &edge,
            "anonymous",
            "gpt-x",
            &dispatch,
            tunnel.clone(),
            body(),
        )
        .expect("issues")
        .joined();
        let encoded = frame.encode_to_vec();
        assert!(!encoded.windows(SECRET.len()).any(|w| w == SECRET));
        let Some(Body::ProviderTunnelRequest(sent)) = frame.body else {
            panic!("a tunnel request");
        };
        let binding = sent.credential_binding.clone().expect("a binding");
        assert_eq!(binding.run_id, "run-4");
        assert_eq!(binding.upstream_origin, "http://127.0.0.1:9");
        let digest = request_digest(&BoundRequest {
            method: "POST",
            path: "/serving/v1/chat/completions",
            headers: &tunnel.headers,
            body: &[Bytes::from_static(b"{}")],
        });
        assert_eq!(&binding.request_digest[..], &digest[..]);
        assert_eq!(sent.body, Bytes::from_static(b"{}"));
        let Some(plane) = &edge.settings.credentials else {
            panic!("the plane")
        };
        assert!(plane.is_projection_of(binding.projection_generation, "node-a", 2));
        let lease = sent.credential_lease.clone().expect("a lease");
        assert_eq!(lease.lease_id.len(), 32);
        assert_eq!(lease.sequence, 1);
        assert!(sent.metadata.is_empty());
        let names: Vec<&str> = sent.headers.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["content-type", "accept"]);
        // Without a credential plane both fields are absent (legacy tunnel).
        let bare = crate::link::settings::edge_state(&cfg);
        let Some(Body::ProviderTunnelRequest(legacy)) =
            with_lease(&bare, "anonymous", "gpt-x", &dispatch, tunnel, body())
                .expect("no lease needed")
                .joined()
                .body
        else {
            panic!("a tunnel request");
        };
        assert_eq!(
            (legacy.credential_lease, legacy.credential_binding),
            (None, None)
        );
    }

    // CONTRACT: C1 — a stream whose usage the Edge asks for is sealed over
    // the body the node sends: the one with `stream_options` spliced in
    // (the node's `request_digest` of that body matches the binding's).
    #[test]
    fn the_lease_covers_the_body_that_asks_for_usage() {
        let dispatch = dispatch();
        let (cfg, plane) = plane();
        let edge = crate::link::settings::edge_state_with(&cfg, Some(plane));
        let chat = ChatRequest::parse(
            Bytes::from_static(br#"{"model":"gpt-x","messages":[],"stream":true}"#),
            &JsonLimits::default(),
        )
        .unwrap();
        let tunnel = tunnel_request(
            CHAT_COMPLETIONS,
            &dispatch,
            tunnel_headers(CHAT_COMPLETIONS, true, &[]),
            true,
            "req-test",
        );
        let body = chat
            .body_asking_usage(&dispatch.lease.target)
            .expect("asks for usage");
        let frame = with_lease(&edge, "anonymous", "gpt-x", &dispatch, tunnel, body)
            .expect("issues")
            .joined();
        let Some(Body::ProviderTunnelRequest(sent)) = frame.body else {
            panic!("a tunnel request");
        };
        assert_eq!(
            sent.body,
            Bytes::from_static(
                br#"{"model":"gpt-4o","stream_options":{"include_usage":true},"messages":[],"stream":true}"#
            )
        );
        let binding = sent.credential_binding.clone().expect("a binding");
        let digest = request_digest(&BoundRequest {
            method: "POST",
            path: "/serving/v1/chat/completions",
            headers: &sent.headers,
            body: std::slice::from_ref(&sent.body),
        });
        assert_eq!(&binding.request_digest[..], &digest[..]);
    }

    // CONTRACT: X2, E2 — the external `model` is never the inner execution
    // identifier: the wire requests name the provider's adapter and target,
    // the external name appears nowhere in the encoded frames, and neither
    // message has a `model` field at all.
    #[test]
    fn the_external_model_never_reaches_the_wire() {
        let chat = ChatRequest::parse(
            Bytes::from_static(
                br#"{"model":"public-model-name","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
            ),
            &JsonLimits::default(),
        )
        .unwrap();
        let dispatch = dispatch();
        let tunnel = NodeRequest {
            frame: frame(Body::ProviderTunnelRequest(Box::new(tunnel_request(
                CHAT_COMPLETIONS,
                &dispatch,
                tunnel_headers(CHAT_COMPLETIONS, chat.stream, &[]),
                chat.stream,
                "req-test",
            )))),
            body: chat.body_for_target(&dispatch.lease.target),
        }
        .joined();
        let run = run_request(&chat, &dispatch, "req-test");
        for frame in [tunnel, run] {
            let bytes = frame.encode_to_vec();
            let found = bytes
                .windows(b"public-model-name".len())
                .any(|w| w == b"public-model-name");
            assert!(!found, "external model on the wire: {frame:?}");
            match frame.body {
                Some(Body::ProviderTunnelRequest(t)) => {
                    assert_eq!(
                        (t.adapter.as_str(), t.target.as_str()),
                        ("openai", "gpt-4o")
                    );
                }
                Some(Body::RunRequest(r)) => {
                    assert_eq!(
                        (r.adapter.as_str(), r.target.as_str()),
                        ("openai", "gpt-4o")
                    );
                }
                other => panic!("unexpected frame {other:?}"),
            }
        }
        let proto = include_str!("../../../proto/iop/runtime.proto");
        for message in ["RunRequest", "ProviderTunnelRequest"] {
            let start = proto.find(&format!("message {message} {{")).unwrap();
            let body = &proto[start..start + proto[start..].find("\n}").unwrap()];
            assert!(
                !body
                    .lines()
                    .any(|l| l.trim_start().starts_with("string model ")),
                "{message} has a `model` field"
            );
        }
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
        let edge = crate::link::settings::edge_state(&cfg);
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
