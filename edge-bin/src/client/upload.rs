//! Audio uploads (`POST /v1/audio/transcriptions`, `/v1/audio/translations`)
//! sent with a `Content-Length`: the form streams to the provider as it
//! arrives, never held whole, within `edge.max_upload_body_bytes`.
//!
//! ```text
//! client ─form head, model field─► prefix (scanned) ─► admit ─► tunnel(first piece,
//!        │                                                       body_follows_bytes)
//!        └─file bytes──► read_body_piece ─(under the node's credit)─► ProviderTunnelBody*
//!                                       ◄── UploadCredit ◄── FlowCredit ◄── node
//! client ◄── relay ◄── the provider's answer
//! ```
//!
//! Only the form's start is held: up to its `model` field, whose value is
//! replaced by the provider's target in that first piece (U5); everything
//! after goes as the client sent it. The Edge sends at most
//! `TUNNEL_BODY_WINDOW` charged bytes ahead of the node's credit, and reads
//! the client no faster than the node takes the bytes: a slow provider
//! slows the client's upload (TCP flow control), nothing piles up here.
//!
//! A form whose file comes before its `model` field (curl's order in
//! OpenAI's examples), a node that takes no streamed body, and a request
//! forwarded to another Edge are read whole first, within
//! `edge.max_request_body_bytes`, and go the way of every other body
//! ([`super::pipeline::passthrough`], [`super::forward::forward`]). A
//! streamed upload has one attempt: its bytes cannot be sent twice.

use std::rc::Rc;

use bytes::{Bytes, BytesMut};
use iop_engine::http::{BodyPieces, Header, HttpError, RequestHead};
use iop_engine::mailbox;
use iop_wire::codec::BodyParts;
use iop_wire::flow::{self, SendWindow, TUNNEL_BODY_WINDOW};

use super::conn::*;
use super::endpoints::*;
use super::forward::{forward, place, Placement};
use super::pipeline::*;
use super::relay::*;
use crate::api::error::GatewayError;
use crate::api::multipart::{self, Prefix};
use crate::control::{DispatchKind, RouteHint};
use crate::link::edge::Edge;
use crate::link::replies::ReplyEvent;

/// The most bytes of the client's body one `ProviderTunnelBody` carries.
const PIECE_BYTES: u64 = 64 * 1024;
/// Pieces queued for the node connection's bulk lane at most (the credit
/// bounds the bytes; this bounds the hand-off).
const QUEUED_PIECES: usize = 8;

/// Serves an upload to `endpoint` whose body, announced by `head`, is read
/// through `pieces`. Answers every error itself; `Err` only when the
/// client connection failed.
pub(super) async fn upload<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    principal: &str,
    endpoint: Endpoint,
    head: &RequestHead,
    mut pieces: BodyPieces,
    headers: Vec<Header>,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let (max_upload, max_whole) = {
        let running = edge.settings.running.get();
        (
            running.max_upload_body_bytes,
            running.max_request_body_bytes,
        )
    };
    if pieces.left() > max_upload {
        return too_large(edge, server, endpoint, head, max_upload).await;
    }
    let content_type = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-type"))
        .map(|h| h.value.clone())
        .unwrap_or_default();
    // The form's start, up to its model field.
    let mut prefix = BytesMut::new();
    let scanned = loop {
        let scanned = match multipart::scan_prefix(&prefix, &content_type) {
            Ok(scanned) => scanned,
            Err(e) => {
                server.skip_body(head);
                refuse_body(server, endpoint.surface, &e).await?;
                linger(edge, server).await;
                return Ok(());
            }
        };
        if pieces.left() == 0 || !matches!(scanned, Prefix::More) || prefix.len() >= max_whole {
            break scanned;
        }
        // Never more than a whole body may be: a body read to its end here
        // is within `max_request_body_bytes`, as any other.
        let room = (max_whole - prefix.len()) as u64;
        match read_piece(edge, server, head, &mut pieces, room.min(PIECE_BYTES)).await {
            Some(piece) => prefix.extend_from_slice(&piece),
            None => return Ok(()),
        }
    };
    let Prefix::Model {
        model,
        value,
        stream,
    } = scanned
    else {
        // The model is not at the start (or the body is whole already):
        // the form is read whole and parsed as any body is.
        let Some(body) =
            read_whole(edge, server, endpoint, head, &mut pieces, prefix, max_whole).await?
        else {
            return Ok(());
        };
        return Box::pin(passthrough(
            edge, server, principal, endpoint, headers, body,
        ))
        .await;
    };
    if pieces.left() == 0 {
        return Box::pin(passthrough(
            edge,
            server,
            principal,
            endpoint,
            headers,
            prefix.freeze(),
        ))
        .await;
    }
    server.set_model(&model);
    // The body is not read to its end before the answer may start: the
    // connection ends after it.
    server.skip_body(head);
    if edge.settings.cluster.is_some() {
        match Box::pin(place(edge, server, endpoint, &model)).await {
            Placement::Here => {}
            Placement::Forward(targets) => {
                let Some(body) =
                    read_whole(edge, server, endpoint, head, &mut pieces, prefix, max_whole)
                        .await?
                else {
                    return Ok(());
                };
                return Box::pin(forward(
                    edge, server, endpoint, &model, targets, headers, body,
                ))
                .await;
            }
            Placement::Nowhere => {
                write_error(server, endpoint.surface, &GatewayError::no_provider(&model)).await?;
                linger(edge, server).await;
                return Ok(());
            }
            Placement::ClientGone => return Ok(()),
        }
    }
    let forwarded = tunnel_headers(endpoint, stream, &headers);
    drop(headers);
    let Some((request, dispatch, mut frames)) =
        admit(edge, server, endpoint, &model, false, RouteHint::default()).await?
    else {
        linger(edge, server).await;
        return Ok(());
    };
    if dispatch.kind != DispatchKind::Tunnel {
        edge.abandon(request);
        write_error(server, endpoint.surface, &unsupported(&model, endpoint)).await?;
        linger(edge, server).await;
        return Ok(());
    }
    let lease = &dispatch.lease;
    server
        .rec
        .attempt(&lease.provider.node_id, &lease.provider.provider_id);
    let prefix = prefix.freeze();
    let first = BodyParts::spliced(
        prefix.slice(..value.start),
        Bytes::copy_from_slice(lease.target.as_bytes()),
        prefix.slice(value.end..),
    );
    let mut tunnel = tunnel_request(
        endpoint,
        &dispatch,
        forwarded,
        stream,
        &server.rec.request_id,
    );
    if !dispatch.accepts_tunnel_body {
        // A node that takes no streamed body gets it whole.
        let room = max_whole.saturating_sub(first.len());
        let Some(rest) = read_whole(
            edge,
            server,
            endpoint,
            head,
            &mut pieces,
            BytesMut::new(),
            room,
        )
        .await?
        else {
            edge.abandon(request);
            return Ok(());
        };
        let mut whole = BytesMut::from(&first.to_bytes()[..]);
        whole.extend_from_slice(&rest);
        let whole = BodyParts::whole(whole.freeze());
        let sent = lease_and_send(
            edge, server, principal, &model, endpoint, request, &dispatch, tunnel, whole,
        );
        if !Box::pin(sent).await? {
            return Ok(());
        }
    } else {
        tunnel.body_follows_bytes = pieces.left();
        let run = match with_lease(edge, principal, &model, &dispatch, tunnel, first) {
            Ok(run) => run,
            Err(e) => {
                refuse(edge, server, endpoint.surface, request, &dispatch, &e).await?;
                linger(edge, server).await;
                return Ok(());
            }
        };
        let (tx, rx) = mailbox::mailbox(QUEUED_PIECES);
        if !edge.start_upload(request, &dispatch, run, rx).await {
            edge.abandon(request);
            write_error(server, endpoint.surface, &GatewayError::node_unavailable()).await?;
            linger(edge, server).await;
            return Ok(());
        }
        // The rest, under the node's credit, until it is all sent or the
        // response (or the run's end) comes first.
        let mut window = SendWindow::new(TUNNEL_BODY_WINDOW);
        while pieces.left() > 0 {
            let room = window.payload_allowance();
            if room == 0 {
                match frames.recv().await {
                    Some(ReplyEvent::UploadCredit(max_offset)) => {
                        window.on_credit(max_offset);
                        continue;
                    }
                    Some(other) => {
                        frames.put_back(other);
                        break;
                    }
                    None => break,
                }
            }
            let Some(piece) =
                read_piece(edge, server, head, &mut pieces, room.min(PIECE_BYTES)).await
            else {
                // The client's body broke off (answered): the run is
                // cancelled, its lease settled on its terminal.
                edge.apply(crate::control::Input::Cancel {
                    request,
                    reason: crate::control::CancelReason::ClientDisconnect,
                });
                return Ok(());
            };
            window.consume(flow::tunnel_body_charge(piece.len()));
            if tx.send(piece).await.is_err() {
                // The node connection is gone: Control ends the run.
                break;
            }
        }
    }
    // One attempt: a streamed body cannot be sent again.
    let result = relay(edge, server, endpoint.surface, &mut frames, &mut || {}).await;
    let settled = settle(edge, request, result)?;
    if pieces.left() > 0 {
        // Answered before the client finished sending.
        linger(edge, server).await;
    }
    match settled {
        Some(_) => retry_without_request(edge, request),
        None => Ok(()),
    }
}

/// The next piece of the client's body, at most `max` bytes (counted in
/// the access record); `None` when reading failed (answered: 408, 400).
async fn read_piece<S>(
    edge: &Edge,
    server: &mut Client<S>,
    head: &RequestHead,
    pieces: &mut BodyPieces,
    max: u64,
) -> Option<Bytes>
where
    S: ClientStream,
{
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    match server.read_body_piece(head, pieces, max).await {
        Ok(Some(piece)) => {
            server.rec.bytes_in += piece.len() as u64;
            Some(piece)
        }
        Ok(None) => Some(Bytes::new()),
        Err(e) => {
            refuse_request(edge, server, &e).await;
            None
        }
    }
}

/// The whole body: `prefix` and the rest of it; `None` when it was
/// answered instead (over `max`: 413; a read that failed).
async fn read_whole<S>(
    edge: &Edge,
    server: &mut Client<S>,
    endpoint: Endpoint,
    head: &RequestHead,
    pieces: &mut BodyPieces,
    mut prefix: BytesMut,
    max: usize,
) -> Result<Option<Bytes>, HttpError>
where
    S: ClientStream,
{
    if prefix.len() as u64 + pieces.left() > max as u64 {
        too_large(edge, server, endpoint, head, max as u64).await?;
        return Ok(None);
    }
    while pieces.left() > 0 {
        let Some(piece) = read_piece(edge, server, head, pieces, PIECE_BYTES).await else {
            return Ok(None);
        };
        prefix.extend_from_slice(&piece);
    }
    Ok(Some(prefix.freeze()))
}

/// 413 for a body over `limit` bytes, without reading it; then a
/// lingering close.
async fn too_large<S>(
    edge: &Edge,
    server: &mut Client<S>,
    endpoint: Endpoint,
    head: &RequestHead,
    limit: u64,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    server.skip_body(head);
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    write_error(
        server,
        endpoint.surface,
        &GatewayError::body_too_large(limit),
    )
    .await?;
    linger(edge, server).await;
    Ok(())
}
