//! A client connection: the request it is answering, what the access log
//! will say of it, its claim on its principal's limits, and how it answers
//! early (errors, refusals, the lingering close).

use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::ReadReadiness;
use iop_engine::http::{
    BodyRate, HttpError, Linger, LingerEnd, RequestHead, ServerConn, ServerTimeouts, Watched,
};
use iop_engine::metrics::{self as engine_metrics, Count, Latency};
use iop_engine::net::Wait;
use monoio::io::{AsyncReadRent, AsyncWriteRent, CancelableAsyncReadRent};

use super::endpoints::*;
use crate::api::body_json::JsonLimits;
use crate::api::error::{GatewayError, Surface};
use crate::config::ListenerLimits;
use crate::link::edge::Edge;
use crate::plane::access::{AccessRecord, REQUEST_ID_HEADER};
use crate::plane::client_keys::{Caller, Claim, ClientKeys};
use crate::plane::request_metrics::{ActiveStream, Finished, RequestMetrics, Route};
use crate::plane::tracing::{RequestEnd, RequestTrace};

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
pub(super) struct Client<S> {
    pub(super) edge: Rc<Edge>,
    pub(super) conn: ServerConn<S>,
    pub(super) rec: AccessRecord,
    /// When the current request was read; `None` once its line is written.
    pub(super) read_at: Option<Instant>,
    /// Who sent the current request (set once it is authenticated).
    pub(super) caller: Option<Caller>,
    /// The current request's claim on its principal's limits, given back
    /// when its line is written (or the connection ends).
    pub(super) ticket: Option<Box<(ClientKeys, Claim)>>,
    /// The Edge's per-request series and this shard's index in them.
    pub(super) metrics: Arc<RequestMetrics>,
    pub(super) shard: usize,
    /// The current request's route and model slot (its labels).
    pub(super) route: Route,
    pub(super) model: usize,
    /// When the last body chunk of the current response was written.
    pub(super) last_chunk_at: Option<Instant>,
    /// Counts the current request in `iop_edge_active_streams` once
    /// admitted.
    pub(super) active: Option<ActiveStream>,
    /// The current inference request's trace (`[tracing]`); always `None`
    /// while tracing is off.
    pub(super) trace: Option<Box<RequestTrace>>,
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
    pub(super) fn release_limits(&mut self) {
        if let Some((keys, claim)) = self.ticket.take().map(|claim| *claim) {
            keys.finish(claim, self.rec.total_tokens(), clock::now());
        }
    }

    /// [`ServerConn::watch_peer`], also ended by the drain's cut-off
    /// ([`Edge::cut_off`]): then the request ends as `aborted`, as if its
    /// client had left.
    pub(super) async fn watch_peer<F: std::future::Future>(&mut self, work: F) -> Watched<F::Output>
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
    pub(super) fn check_cut_off(&mut self) -> Result<(), HttpError> {
        if self.edge.is_cut_off() {
            self.rec.end("aborted");
            return Err(HttpError::UnexpectedEof);
        }
        Ok(())
    }

    /// Records the current request's metrics, writes its access log line
    /// and usage record, and gives its limits claim back (once).
    pub(super) fn log_access(&mut self) {
        let edge = Rc::clone(&self.edge);
        self.release_limits();
        let Some(read_at) = self.read_at.take() else {
            return;
        };
        if is_inference_route(&self.rec.path) {
            crate::plane::request_metrics::count_response(self.conn.exchange().status);
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
        if let (Some(trace), Some(tracer)) = (self.trace.take(), &edge.settings.tracer) {
            let end = RequestEnd {
                method: &self.rec.method,
                path: &self.rec.path,
                status: stats.status,
                outcome: self.rec.outcome_of(&stats),
                model: self.rec.model.as_deref(),
                request_id: &self.rec.request_id,
            };
            if let Some(spans) = trace.finish(ended_at, &end) {
                tracer.submit(spans);
            }
        }
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
    pub(super) fn begin(
        &mut self,
        edge: &Edge,
        head: &RequestHead,
        path: &str,
        body_len: usize,
        at: Instant,
    ) {
        let id = edge.request_id(head.header(REQUEST_ID_HEADER).map(|v| &v[..]));
        self.start_record(id, &head.method, path, body_len as u64, at);
        // Inference requests only: probes, scrapes and admin calls are no
        // part of a request's path to a provider.
        if let Some(tracer) = edge.settings.tracer.as_ref() {
            if is_inference_route(path) {
                let trace = RequestTrace::begin(tracer, &head.headers, at, clock::unix_ms());
                self.rec.trace_id = Some(trace.trace_id());
                self.trace = Some(trace);
            }
        }
    }

    /// Starts the record of a request that failed to read (answered with
    /// an early error): what of its head was read, if anything.
    pub(super) fn begin_unread(&mut self, edge: &Edge, at: Instant) {
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

    pub(super) fn start_record(
        &mut self,
        id: String,
        method: &str,
        path: &str,
        bytes_in: u64,
        at: Instant,
    ) {
        self.conn
            .set_exchange_header(REQUEST_ID_HEADER, Bytes::from(id.clone()));
        self.rec = AccessRecord::new(id, method, path, bytes_in);
        self.read_at = Some(at);
        self.caller = None;
        self.route = Route::of(path);
        self.model = self.metrics.no_model();
        self.last_chunk_at = None;
        self.active = None;
        self.trace = None;
    }

    /// The request waited for admission from `submitted_at` until now
    /// (its `queue_wait` span, when traced).
    pub(super) fn trace_queue_wait(&mut self, submitted_at: Instant) {
        if let (Some(trace), Some(tracer)) = (self.trace.as_mut(), &self.edge.settings.tracer) {
            trace.queue_wait(tracer, submitted_at, clock::now());
        }
    }

    /// Notes the model the client named (access log and metric labels).
    pub(super) fn set_model(&mut self, model: &str) {
        self.rec.set_model(model);
        self.model = self.metrics.model_slot(model);
    }

    /// The current request was admitted: it counts as an active stream of
    /// its model until it ends.
    pub(super) fn stream_started(&mut self) {
        self.active = Some(self.metrics.stream_started(self.shard, self.model));
    }

    /// metrics: a relayed chunk taken off the route queue at `taken_at`
    /// was written to the client (relay latency, and the gap since the
    /// previous chunk).
    pub(super) fn chunk_written(&mut self, taken_at: Instant) {
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

/// Answers a request that failed before it could be routed (bad or
/// oversized framing, a stalled head or body) and ends the connection:
/// counted, answered in the route's shape when the head was read (Anthropic
/// on `/v1/messages*`), then closed — with a lingering close when the
/// client may still be sending the request (not after a timeout: its read
/// side is already shut down).
pub(super) async fn refuse_request<S>(edge: &Edge, server: &mut Client<S>, e: &HttpError)
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
    let api = http_error(e, edge.settings.running.get().max_request_body_bytes);
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
pub(super) async fn linger<S>(edge: &Edge, server: &mut Client<S>)
where
    S: ClientStream,
{
    let Some(linger) = client_linger(&edge.settings.running.get().limits) else {
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
pub(super) fn json_limits(edge: &Edge) -> JsonLimits {
    let limits = edge.settings.running.get().limits;
    JsonLimits {
        max_depth: limits.max_json_depth,
        max_elements: limits.max_json_elements,
        max_members: limits.max_json_members,
    }
}

/// Answers a body the Edge cannot read (400); JSON-limit refusals are
/// counted.
pub(super) async fn refuse_body<S>(
    server: &mut Client<S>,
    surface: Surface,
    e: &GatewayError,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    if e.is_json_limit() {
        engine_metrics::add(Count::EdgeClientJsonLimitRejections, 1);
    }
    write_error(server, surface, e).await
}

pub(super) fn http_error(e: &HttpError, max_body_bytes: usize) -> GatewayError {
    match e.status_code() {
        413 => GatewayError::body_too_large(max_body_bytes),
        408 => GatewayError::request_timeout(e.to_string()),
        status => GatewayError::from_http_status(status, e.to_string()),
    }
}

pub(super) async fn write_json<S>(
    server: &mut Client<S>,
    status: u16,
    body: Bytes,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    server
        .write_response(status, [("content-type", "application/json")], body)
        .await
}

pub(super) async fn write_api_error<S>(
    server: &mut Client<S>,
    e: &GatewayError,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    write_error(server, Surface::OpenAi, e).await
}

pub(super) async fn write_error<S>(
    server: &mut Client<S>,
    surface: Surface,
    e: &GatewayError,
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

/// Marks an answer to a request forwarded by a peer Edge that this Edge
/// did not admit (it is draining): the peer may send the request to
/// another Edge, nothing of it ran here.
pub(super) const NOT_ADMITTED_HEADER: &str = "x-iop-not-admitted";

/// Answers [`GatewayError::shutting_down`] (in the route's error shape: Anthropic on
/// `/v1/messages*`) with `connection: close`; the caller then drops the
/// connection.
pub(super) async fn refuse_while_draining<S>(
    server: &mut Client<S>,
    path: &str,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let surface = if path.starts_with(MESSAGES.path) {
        Surface::Anthropic
    } else {
        Surface::OpenAi
    };
    let e = GatewayError::shutting_down();
    let retry_after = e.retry_after_sec.unwrap_or(1).to_string();
    let mut headers = vec![
        ("content-type", "application/json"),
        ("retry-after", retry_after.as_str()),
        ("connection", "close"),
    ];
    if server.rec.peer.is_some() {
        // A peer Edge forwarded it: tell it nothing was admitted here, so
        // it may try another Edge.
        headers.push((NOT_ADMITTED_HEADER, "draining"));
    }
    server.rec.end(e.outcome());
    let body = e.body_for_request(surface, &server.rec.request_id);
    server.write_response(e.status, headers, body).await
}

/// The deadlines of a client connection: its reads, and its response
/// writes (`write_stall`: `edge.client_write_stall_timeout_ms`).
pub fn client_timeouts(limits: &ListenerLimits, write_stall: Duration) -> ServerTimeouts {
    ServerTimeouts {
        keep_alive_idle: Duration::from_millis(limits.client_keep_alive_timeout_ms),
        head: Duration::from_millis(limits.client_head_timeout_ms),
        body_idle: Duration::from_millis(limits.client_body_idle_timeout_ms),
        body_min_rate: (limits.client_body_min_rate_bytes_per_sec > 0).then(|| BodyRate {
            grace: Duration::from_millis(limits.client_body_grace_ms),
            bytes_per_sec: limits.client_body_min_rate_bytes_per_sec,
        }),
        write_stall: Some(write_stall),
    }
}

/// The lingering close after an early answer; `None` when disabled
/// (`client_linger_time_ms = 0`).
pub fn client_linger(limits: &ListenerLimits) -> Option<Linger> {
    (limits.client_linger_time_ms > 0).then(|| Linger {
        time: Duration::from_millis(limits.client_linger_time_ms),
        idle: Duration::from_millis(limits.client_linger_idle_timeout_ms),
        max_bytes: limits.client_linger_max_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_map_to_connection_timeouts_and_linger() {
        let limits = ListenerLimits::default();
        assert_eq!(
            client_timeouts(&limits, Duration::from_secs(30)),
            ServerTimeouts {
                keep_alive_idle: Duration::from_secs(60),
                head: Duration::from_secs(10),
                body_idle: Duration::from_secs(30),
                body_min_rate: Some(BodyRate {
                    grace: Duration::from_secs(30),
                    bytes_per_sec: 1024,
                }),
                write_stall: Some(Duration::from_secs(30)),
            }
        );
        assert_eq!(
            client_linger(&limits),
            Some(Linger {
                time: Duration::from_secs(30),
                idle: Duration::from_secs(5),
                max_bytes: 128 * 1024 * 1024,
            })
        );
        let off = ListenerLimits {
            client_linger_time_ms: 0,
            ..limits
        };
        assert_eq!(client_linger(&off), None);
        let no_rate = ListenerLimits {
            client_body_min_rate_bytes_per_sec: 0,
            ..limits
        };
        assert_eq!(
            client_timeouts(&no_rate, Duration::from_secs(30)).body_min_rate,
            None
        );
    }
}
