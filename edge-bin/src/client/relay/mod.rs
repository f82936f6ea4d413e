//! The relays: a dispatched attempt's frames to the client — the tunnel's
//! bytes unchanged (U1, U2), a normalized run as OpenAI chunks, one
//! completion or one embeddings list — with the commit point, the held head and the retry.
//!
//! The decisions are the sans-IO [`core::Relay`]'s (its docs: what it
//! decides, the step protocol); the shells here feed it the reply's events
//! and perform its steps — the writes, the node's credit, the request's
//! release at the commit.
//!
//! ```text
//!  reply ──event──► Relay::handle ──► Relay::poll ──steps──► client writes
//!    ▲                                                     │
//!    └───────────────── credit (ReplyRx::drained) ◄────────┘
//! ```

mod core;

use std::future::Future;
use std::rc::Rc;

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{HttpError, Watched};
use iop_engine::metrics::{self as engine_metrics, Count};
use iop_engine::net::Wait;
use iop_wire::pb;

use self::core::{FailAs, Head, Relay, Step};
use super::conn::*;
use crate::api::embeddings::EmbeddingsAnswer;
use crate::api::error::{GatewayError, Surface};
use crate::api::openai;
use crate::api::translate::ResponseId;
use crate::control::{CancelReason, Dispatch};
use crate::link::edge::Edge;
use crate::link::replies::ReplyRx;

/// Called once by a relay when its response commits (its first bytes go
/// to the client): the reply drops what it kept of the request for
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
/// ([`crate::link::replies::ReplyEvent::Overflow`]).
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

/// Relays a normalized run as one `chat.completion` (E1, E5). Nothing is
/// written before the attempt commits: the answer waits for its
/// `complete`; an attempt that fails before may be retried elsewhere
/// ([`Relayed::Retry`]).
pub(super) async fn relay_completion<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    frames: &mut ReplyRx,
    id: ResponseId,
) -> Result<Relayed, HttpError>
where
    S: ClientStream,
{
    // Nothing of the request is released: a buffered run commits only at
    // its end, so no retry can follow.
    drive(
        edge,
        server,
        Surface::OpenAi,
        frames,
        Relay::buffered(id),
        &mut || {},
    )
    .await
}

/// Relays an embeddings run as one OpenAI embeddings list, written at its
/// `complete` (nothing before: an attempt that fails may be retried
/// elsewhere, [`Relayed::Retry`]).
pub(super) async fn relay_embeddings<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    frames: &mut ReplyRx,
    answer: EmbeddingsAnswer,
) -> Result<Relayed, HttpError>
where
    S: ClientStream,
{
    let core = Relay::embeddings(answer);
    drive(edge, server, Surface::OpenAi, frames, core, &mut || {}).await
}

/// Relays a normalized run as OpenAI chat completion chunks (E1, E4). The
/// stream's `start` waits for its first delta; an attempt that fails before
/// may be retried elsewhere ([`Relayed::Retry`]).
pub(super) async fn relay_run<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    frames: &mut ReplyRx,
    id: ResponseId,
    include_usage: bool,
    release: Release<'_>,
) -> Result<Relayed, HttpError>
where
    S: ClientStream,
{
    let core = Relay::stream(id, include_usage);
    drive(edge, server, Surface::OpenAi, frames, core, release).await
}

/// Relays tunnel frames to the client until the terminal (U1, U2). The
/// provider's response head is held until the attempt commits: its first
/// body byte, or for a 5xx head the end of its body (bounded). An attempt
/// that fails before may be retried elsewhere ([`Relayed::Retry`]).
pub(super) async fn relay<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    surface: Surface,
    frames: &mut ReplyRx,
    release: Release<'_>,
) -> Result<Relayed, HttpError>
where
    S: ClientStream,
{
    drive(edge, server, surface, frames, Relay::tunnel(), release).await
}

/// Feeds the reply's events to `core` and performs its steps
/// ([`core`]): the writes, the node's credit as the client's socket takes
/// each event (or the core held it), the request's release at the commit.
///
/// A function returning an `async move` block, not an `async fn`: an
/// `async fn` keeps its arguments twice in its state (as they came and as
/// the body's locals), and this future lives as long as the stream — the
/// relay core alone is some 400 bytes.
#[allow(clippy::manual_async_fn)]
fn drive<'a, S>(
    edge: &'a Rc<Edge>,
    server: &'a mut Client<S>,
    surface: Surface,
    frames: &'a mut ReplyRx,
    mut core: Relay,
    release: Release<'a>,
) -> impl Future<Output = Result<Relayed, HttpError>> + 'a
where
    S: ClientStream + 'a,
{
    async move {
        loop {
            let next = if core.is_started() {
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
            let taken_at = clock::now();
            // `next` moves whole into the core: a borrowed local keeps its room
            // in this future across every later await.
            core.handle(next, frames.run_id());
            // Most events are a started tunnel's body: its three steps at once.
            if let Some((body, body_bytes, charge)) = core.take_body() {
                server.write_chunk(body).await?;
                server.chunk_written(taken_at);
                engine_metrics::add(Count::EdgeRelayBodyBytes, body_bytes);
                if charge > 0 {
                    frames.drained(edge, charge);
                }
                continue;
            }
            while let Some(step) = core.poll() {
                match step {
                    Step::Usage(usage) => server
                        .rec
                        .usage(usage.prompt_tokens, usage.completion_tokens),
                    // Boxed, like everything this future awaits only once: the
                    // future is sized by its largest await, for the life of the
                    // stream.
                    Step::WriteHead(Head::Provider { head, first }) => {
                        Box::pin(start_response(server, &head, first)).await?
                    }
                    Step::WriteHead(Head::EventStream) => {
                        Box::pin(server.start_chunked(
                            200,
                            [
                                ("content-type", "text/event-stream"),
                                ("cache-control", "no-cache"),
                            ],
                        ))
                        .await?
                    }
                    Step::Release => release(),
                    Step::WriteChunk(bytes) => server.write_chunk(bytes).await?,
                    Step::Relayed { body_bytes } => {
                        server.chunk_written(taken_at);
                        if body_bytes > 0 {
                            engine_metrics::add(Count::EdgeRelayBodyBytes, body_bytes);
                        }
                    }
                    Step::Credit(charge) => frames.drained(edge, charge),
                    // Control's verdict comes on the reply, like the events.
                    Step::AwaitVerdict => {}
                    Step::Retry(next) => return Ok(Relayed::Retry(*next)),
                    Step::Answer(body) => {
                        Box::pin(write_json(server, 200, body)).await?;
                        server.chunk_written(taken_at);
                        return Ok(Relayed::Done);
                    }
                    Step::Fail(failure) => {
                        let written =
                            Box::pin(fail(server, surface, failure.shape, &failure.error)).await;
                        if failure.cuts_off {
                            return Err(cut_off());
                        }
                        return written.map(|()| Relayed::Done);
                    }
                    Step::Finish => return server.finish().await.map(|()| Relayed::Done),
                }
            }
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
        .filter(|h| !openai::is_not_relayed(&h.name))
        .map(|h| (h.name.as_str(), &h.value[..]))
        .collect();
    server.start_chunked_with(status, headers, first).await
}

/// Ends a failed relay with `e`, in the `shape` the core chose. What the
/// client is not shown of it ([`GatewayError::detail`]) goes to the Edge's
/// log.
async fn fail<S>(
    server: &mut Client<S>,
    surface: Surface,
    shape: FailAs,
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
    match shape {
        FailAs::Response => write_error(server, surface, e).await,
        FailAs::SseEvent => {
            server.write_chunk(e.sse_event(surface)).await?;
            server.finish().await
        }
        FailAs::BreakOff => {
            server.close().await?;
            Err(HttpError::UnexpectedEof)
        }
    }
}
