//! The relays: a dispatched attempt's frames to the client — the tunnel's
//! bytes unchanged (U1, U2), a normalized run as OpenAI chunks or one
//! completion — with the commit point, the held head and the retry.

use std::rc::Rc;

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{HttpError, Watched};
use iop_engine::metrics::{self as engine_metrics, Count};
use iop_engine::net::Wait;
use iop_wire::pb;

use super::conn::*;
use crate::api::error::{GatewayError, Surface};
use crate::api::openai;
use crate::api::translate::{ChunkStream, Completion, CompletionBuilder, ResponseId};
use crate::control::attempt::AttemptTracker;
use crate::control::{AbortReason, CancelReason, Dispatch};
use crate::link::edge::Edge;
use crate::link::routes::{RouteEvent, RouteRx};
use crate::plane::access::AccessRecord;

/// Called once by a relay when its response commits (its first bytes go
/// to the client): the route drops what it kept of the request for
/// another attempt (pre-commit failover only), so a stream holds none of
/// it while it lasts.
pub(super) type Release<'a> = &'a mut dyn FnMut();

/// How a relay ended.
#[derive(Debug)]
pub(super) enum Relayed {
    /// The client has its answer (or its error).
    Done,
    /// The attempt failed before anything reached the client and `Control`
    /// dispatched the request again: send and relay this one.
    Retry(Dispatch),
}

/// A run cut off because its client drained slower than its node sent
/// ([`RouteEvent::Overflow`]).
#[derive(Debug, thiserror::Error)]
#[error("the run was cut off: the client drained slower than its node sent")]
pub(super) struct CutOff;

/// The error a relay ends with when its run was cut off: the response broke
/// off, so the connection closes and the caller cancels the run (U6) with
/// [`CancelReason::ClientTooSlow`].
pub(super) fn cut_off() -> HttpError {
    HttpError::Io(std::io::Error::other(CutOff))
}

/// Why a relay that failed with `e` cancels its run (U6).
pub(super) fn cancel_reason(e: &HttpError) -> CancelReason {
    match e {
        HttpError::Io(io) if io.get_ref().is_some_and(|inner| inner.is::<CutOff>()) => {
            CancelReason::ClientTooSlow
        }
        HttpError::TimedOut(Wait::Write) => CancelReason::ClientWriteStall,
        _ => CancelReason::ClientDisconnect,
    }
}

/// Relays a normalized run as one `chat.completion` (E1, E5). Every event
/// taken from the route is credited back to the node as soon as the
/// builder took it. Nothing is written before the attempt commits
/// ([`crate::control::attempt`]): the answer waits for its `complete`; an attempt
/// that fails before may be retried elsewhere ([`Relayed::Retry`]).
///
/// Apart from [`relay_run`] (the streamed form), so neither's future keeps
/// room for the other's state.
pub(super) async fn relay_completion<S>(
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
                        let e = GatewayError::provider_failure(
                            &code,
                            &message,
                            tracker.end_of_run(&ev).is_retryable(),
                        );
                        if e.retryable {
                            if let Some(next) = Box::pin(verdict(edge, server, frames)).await? {
                                return Ok(Relayed::Retry(next));
                            }
                        }
                        return Box::pin(fail(server, Surface::OpenAi, false, false, &e))
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
                    &GatewayError::client_too_slow(),
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
                    &GatewayError::node_lost(),
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
pub(super) async fn relay_run<S>(
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
                    &GatewayError::client_too_slow(),
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
                    &GatewayError::node_lost(),
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
                let code = if ev.failure_code.is_empty() {
                    "provider_error"
                } else {
                    ev.failure_code.as_str()
                };
                let e = GatewayError::provider_failure(
                    code,
                    &ev.error,
                    tracker.end_of_run(&ev).is_retryable(),
                );
                if e.retryable {
                    if let Some(next) = Box::pin(verdict(edge, server, frames)).await? {
                        return Ok(Relayed::Retry(next));
                    }
                }
                return Box::pin(fail(server, Surface::OpenAi, false, true, &e))
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
pub(super) fn run_event(
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
pub(super) enum RunStep {
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
pub(super) fn run_step(
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
pub(super) async fn verdict<S>(
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
pub(super) async fn start_response<S>(
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
        .filter(|h| !openai::is_not_relayed(&h.name))
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
pub(super) async fn relay<S>(
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
                    &GatewayError::client_too_slow(),
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
                    &GatewayError::node_lost(),
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
                    let e = GatewayError::no_response();
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
                let code = if tf.failure_code.is_empty() {
                    "provider_error"
                } else {
                    tf.failure_code.as_str()
                };
                let e = GatewayError::provider_failure(
                    code,
                    &tf.error,
                    !started && tracker.end_of_tunnel(&tf).is_retryable(),
                );
                if e.retryable {
                    if let Some(next) = Box::pin(verdict(edge, server, frames)).await? {
                        return Ok(Relayed::Retry(next));
                    }
                }
                return Box::pin(fail(server, surface, started, event_stream, &e))
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
pub(super) fn tunnel_frame(
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
pub(super) enum TunnelStep {
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

pub(super) fn tunnel_step(
    mut tf: Box<pb::ProviderTunnelFrame>,
    tracker: &mut AttemptTracker,
) -> TunnelStep {
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
pub(super) async fn abort<S>(
    server: &mut Client<S>,
    surface: Surface,
    started: bool,
    event_stream: bool,
    reason: AbortReason,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let e = match reason {
        AbortReason::ResponseWaitTimeout => GatewayError::response_wait_timeout(),
    };
    fail(server, surface, started, event_stream, &e).await
}

/// Ends a failed relay with `e`: an HTTP error before the response
/// started, or `e`'s SSE error event (then the stream's end) inside a
/// started event stream. What the client is not shown of it
/// ([`GatewayError::detail`]) goes to the Edge's log.
pub(super) async fn fail<S>(
    server: &mut Client<S>,
    surface: Surface,
    started: bool,
    event_stream: bool,
    e: &GatewayError,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    server.rec.end(e.outcome());
    if let Some(detail) = &e.detail {
        tracing::warn!(
            request_id = %server.rec.request_id,
            node = server.rec.node.as_deref().unwrap_or_default(),
            provider = server.rec.provider.as_deref().unwrap_or_default(),
            code = e.outcome(),
            detail,
            "provider attempt failed"
        );
    }
    if !started {
        return write_error(server, surface, e).await;
    }
    if event_stream {
        server.write_chunk(e.sse_event(surface)).await?;
        server.finish().await
    } else {
        // A plain body cannot carry an error after it started: cut it short
        // so the client sees an incomplete response, not a complete one.
        server.close().await?;
        Err(HttpError::UnexpectedEof)
    }
}
