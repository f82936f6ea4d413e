//! One inference request from its parsed body to its relay: admission
//! through `Control`, the caller's limits and model access, the tunnel
//! request (or normalized run) with its credential lease, and the retry on
//! the next provider when an attempt failed before anything reached the
//! client (pre-commit failover).

use std::rc::Rc;

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{HttpError, Watched};
use iop_engine::metrics::{self as engine_metrics, Latency};
use iop_wire::codec::BodyParts;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

use super::attempt::*;
use super::caller::*;
use super::conn::*;
use super::endpoints::*;
use super::forward::{place, Placement};
use super::relay::*;
use crate::api::error::{GatewayError, Surface};
use crate::api::openai::{ChatRequest, PassthroughRequest};
use crate::api::route_hint::SESSION_HEADER;
use crate::api::translate::ResponseId;
use crate::control::fair::Share;
use crate::control::{
    CancelReason, Dispatch, DispatchKind, Input, Operation, Rejection, RequestId, RouteHint,
    RoutingPolicy,
};
use crate::link::edge::{Admission, Edge};
use crate::link::replies::ReplyRx;
use crate::link::shards::NodeRequest;
use crate::plane::credentials::{CredentialError, LeaseRequest};
use crate::plane::limits::estimate_prompt_tokens;
use crate::plane::running::Running;

/// `POST /v1/chat/completions`: admit through `Control`, then relay the
/// provider's answer — again from the next provider `Control` picks when an
/// attempt failed before anything reached the client (pre-commit
/// failover). In a cluster, a request this Edge has no free slot for is
/// forwarded to a peer that has one, or to the Edge owning the model's
/// nodes when this one owns none ([`super::forward`]).
pub(super) async fn chat<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    principal: &str,
    headers: Vec<iop_engine::http::Header>,
    body: Bytes,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    // The client's bytes, should the request be forwarded (a reference,
    // not a copy).
    let received = body.clone();
    let chat = match ChatRequest::parse(body, &json_limits(edge)) {
        Ok(c) => c,
        // Boxed, as every once-per-request await in the streaming routes:
        // the route's future keeps room only for what it holds while the
        // response streams.
        Err(e) => return Box::pin(refuse_body(server, Surface::OpenAi, &e)).await,
    };
    server.set_model(&chat.model);
    // A single Edge serves everything here (and boxes no future for it).
    let placement = match edge.settings.cluster {
        None => Placement::Here,
        Some(_) => Box::pin(place(edge, server, CHAT_COMPLETIONS, &chat.model)).await,
    };
    match placement {
        Placement::Here => {}
        Placement::Forward(targets) => {
            let model = chat.model.clone();
            drop(chat);
            return Box::pin(super::forward::forward(
                edge,
                server,
                CHAT_COMPLETIONS,
                &model,
                targets,
                headers,
                received,
            ))
            .await;
        }
        Placement::Nowhere => {
            return Box::pin(refuse_unplaced(edge, server, CHAT_COMPLETIONS, &chat.model)).await
        }
        Placement::ClientGone => return Ok(()),
    }
    let running = edge.settings.running.get();
    let hint = route_hint(&running, &headers, &chat.model, |header, policy, max| {
        chat.route_hint(header, policy, max)
    });
    drop((headers, received));
    let long = running
        .long_context_threshold_tokens
        .get(&chat.model)
        .is_some_and(|&threshold| chat.estimated_prompt_tokens() >= threshold);
    drop(running);
    // E2: the external model selects a pool; the inner identifiers come from
    // the winning provider.
    // Boxed: waiting for admission (and answering a refusal) is held only
    // until the request is dispatched.
    let Some((request, mut dispatch, mut frames)) = Box::pin(admit(
        edge,
        server,
        CHAT_COMPLETIONS,
        &chat.model,
        long,
        hint,
    ))
    .await?
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
            DispatchKind::Normalized => {
                NodeRequest::frame_only(run_request(chat, &dispatch, &server.rec.request_id))
            }
        };
        let (stream, include_usage) = (chat.stream, chat.include_usage());
        let buffered = dispatch.kind == DispatchKind::Normalized && !stream;
        // Boxed: handing the request to its node is this future's largest
        // state, held only until the node has it, never while it streams.
        if !Box::pin(send_attempt(
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
            DispatchKind::Normalized => {
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

/// The next attempt of `request`, if its relay asks for one. A relay that
/// failed (the client is gone, or the response broke off) cancels the run
/// (U6): `Control` sends the node a `CancelRequest` and settles the lease
/// on its terminal.
pub(super) fn settle(
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
/// back and the reply ends.
pub(super) fn retry_without_request(edge: &Edge, request: RequestId) -> Result<(), HttpError> {
    debug_assert!(false, "a retry after the request was released");
    edge.abandon(request);
    Ok(())
}

/// The routing hint of a request for `model`: what `read` (the parsed
/// request's own reader) takes of it under the model's policy, with the
/// session header if the client sent one.
fn route_hint(
    running: &Running,
    headers: &[iop_engine::http::Header],
    model: &str,
    read: impl FnOnce(Option<&[u8]>, RoutingPolicy, usize) -> RouteHint,
) -> RouteHint {
    let policy = running
        .model_routing
        .get(model)
        .copied()
        .unwrap_or_default();
    if policy == RoutingPolicy::LeastLoaded {
        return RouteHint::default();
    }
    let header = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case(SESSION_HEADER))
        .map(|h| &h.value[..]);
    read(header, policy, running.prefix_bytes_max)
}

/// Waits for `Control`'s answer to a submitted request.
pub(super) async fn admit<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    endpoint: Endpoint,
    model: &str,
    long: bool,
    hint: RouteHint,
) -> Result<Option<(RequestId, Dispatch, ReplyRx)>, HttpError>
where
    S: ClientStream,
{
    if let Some(e) = check_caller(edge, server, model) {
        write_caller_refusal(server, endpoint.surface, &e).await?;
        return Ok(None);
    }
    let submitted_at = clock::now(); // metrics: queue wait
    let share = queue_share(server);
    let (request, mut admission) = edge.submit(model, endpoint.op, long, hint, share);
    // U6: a client that leaves while queued is removed from the queue; one
    // that leaves just as its lease was won settles the lease at once.
    let answer = match server.watch_peer(&mut admission).await {
        Watched::Done(answer) => {
            engine_metrics::record_since(Latency::EdgeQueueWait, submitted_at);
            server.trace_queue_wait(submitted_at);
            answer
        }
        Watched::PeerClosed => {
            server.trace_queue_wait(submitted_at);
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
        Ok(Admission::Rejected(Rejection::UnknownModel)) => GatewayError::model_not_found(model),
        Ok(Admission::Rejected(Rejection::UnsupportedOperation)) => unsupported(model, endpoint),
        Ok(Admission::Rejected(Rejection::QueueFull)) => GatewayError::queue_full(model),
        Ok(Admission::Rejected(Rejection::ModelRemoved)) => GatewayError::model_removed(model),
        Ok(
            Admission::Rejected(Rejection::QueueTimeout | Rejection::NoProviders)
            | Admission::Ended,
        )
        | Err(_) => GatewayError::no_provider(model),
    };
    write_error(server, endpoint.surface, &e).await?;
    Ok(None)
}

/// Who a request is charged to while it queues: its caller's principal,
/// class and weight, and its estimated tokens (the body's, as the per-key
/// token limit estimates them).
fn queue_share<S>(server: &Client<S>) -> Share {
    let cost = estimate_prompt_tokens(usize::try_from(server.rec.bytes_in).unwrap_or(usize::MAX));
    match &server.caller {
        Some(caller) => Share {
            principal: caller.principal_id,
            class: caller.priority,
            weight: caller.weight,
            cost,
        },
        None => Share {
            principal: 0,
            class: crate::config::DEFAULT_PRIORITY,
            weight: 1,
            cost,
        },
    }
}

/// Answers a request no Edge of the cluster could take for as long as its
/// model's queue timeout ([`Placement::Nowhere`]): as a queue timeout
/// here would, after the caller's own checks (a key that may not use the
/// model still hears 403).
async fn refuse_unplaced<S>(
    edge: &Edge,
    server: &mut Client<S>,
    endpoint: Endpoint,
    model: &str,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    if let Some(refusal) = check_caller(edge, server, model) {
        return write_caller_refusal(server, endpoint.surface, &refusal).await;
    }
    write_error(server, endpoint.surface, &GatewayError::no_provider(model)).await
}

/// Issues the lease of `dispatch` into `tunnel` (with `body`) and sends
/// it to the node: false when the request was answered instead (the
/// credential plane refused, or the node's connection is gone).
#[allow(clippy::too_many_arguments)]
pub(super) async fn lease_and_send<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    principal: &str,
    model: &str,
    endpoint: Endpoint,
    request: RequestId,
    dispatch: &Dispatch,
    tunnel: pb::ProviderTunnelRequest,
    body: BodyParts,
) -> Result<bool, HttpError>
where
    S: ClientStream,
{
    let run = match with_lease(edge, principal, model, dispatch, tunnel, body) {
        Ok(run) => run,
        Err(e) => {
            refuse(edge, server, endpoint.surface, request, dispatch, &e).await?;
            return Ok(false);
        }
    };
    send_attempt(
        edge,
        server,
        endpoint.surface,
        request,
        dispatch,
        run,
        false,
    )
    .await
}

/// `POST /v1/responses`, `/v1/messages`, `/v1/messages/count_tokens`: raw
/// passthrough over a provider tunnel (U1–U5), with pre-commit failover.
pub(super) async fn passthrough<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    principal: &str,
    endpoint: Endpoint,
    headers: Vec<iop_engine::http::Header>,
    body: Bytes,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    let received = body.clone();
    let parsed = if is_upload(endpoint.op) {
        let content_type = headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-type"))
            .map(|h| h.value.clone())
            .unwrap_or_default();
        PassthroughRequest::parse_form(body, &content_type)
    } else {
        PassthroughRequest::parse(body, &json_limits(edge))
    };
    let req = match parsed {
        Ok(r) => r,
        Err(e) => return refuse_body(server, endpoint.surface, &e).await,
    };
    server.set_model(&req.model);
    let placement = match edge.settings.cluster {
        None => Placement::Here,
        Some(_) => Box::pin(place(edge, server, endpoint, &req.model)).await,
    };
    match placement {
        Placement::Here => {}
        Placement::Forward(targets) => {
            let model = req.model.clone();
            drop(req);
            return Box::pin(super::forward::forward(
                edge, server, endpoint, &model, targets, headers, received,
            ))
            .await;
        }
        Placement::Nowhere => return refuse_unplaced(edge, server, endpoint, &req.model).await,
        Placement::ClientGone => return Ok(()),
    }
    drop(received);
    // An operation whose body is no prompt offers none (`max` 0: nothing
    // copied); its session key still counts.
    let reads_prompt = crate::api::route_hint::reads_prompt(endpoint.op);
    let hint = route_hint(
        &edge.settings.running.get(),
        &headers,
        &req.model,
        |header, policy, max| req.route_hint(header, policy, if reads_prompt { max } else { 0 }),
    );
    // What the provider gets of the client's headers; the rest go now.
    let forwarded = tunnel_headers(endpoint, req.stream, &headers);
    drop(headers);
    server.set_model(&req.model);
    let Some((request, mut dispatch, mut frames)) =
        admit(edge, server, endpoint, &req.model, false, hint).await?
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
            // A native (Ollama) provider: embeddings as a normalized run.
            let result = match Box::pin(super::embeddings::attempt(
                edge,
                server,
                endpoint,
                request,
                &dispatch,
                &mut frames,
                req,
            ))
            .await
            {
                super::embeddings::RunAttempt::Relayed(result) => result,
                super::embeddings::RunAttempt::Answered(answered) => return answered,
            };
            match settle(edge, request, result)? {
                Some(next) => {
                    frames.retarget(&next);
                    dispatch = next;
                    continue;
                }
                None => return Ok(()),
            }
        }
        let lease = &dispatch.lease;
        server
            .rec
            .attempt(&lease.provider.node_id, &lease.provider.provider_id);
        let mut tunnel = tunnel_request(
            endpoint,
            &dispatch,
            forwarded.clone(),
            req.stream,
            &server.rec.request_id,
        );
        // A streamed text completion's usage is observed as chat's is: a
        // node that can strip the usage chunk has the provider asked for it.
        let asking = (endpoint.op == Operation::Completions && dispatch.strips_usage_chunk)
            .then(|| req.body_asking_usage(&dispatch.lease.target))
            .flatten();
        tunnel.strip_usage_chunk = asking.is_some();
        let body = asking.unwrap_or_else(|| req.body_for_target(&dispatch.lease.target));
        let sent = lease_and_send(
            edge, server, principal, &req.model, endpoint, request, &dispatch, tunnel, body,
        );
        if !Box::pin(sent).await? {
            return Ok(());
        }
        let result = relay(edge, server, endpoint.surface, &mut frames, &mut || {
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

/// The Anthropic API version sent upstream when the client gave none.
pub const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

/// Request headers forwarded to the provider on a tunnel: content type,
/// accept, and for Anthropic routes `anthropic-version` (defaulted) and
/// `anthropic-beta`. Client credentials are never forwarded.
pub(super) fn tunnel_headers(
    endpoint: Endpoint,
    stream: bool,
    client: &[iop_engine::http::Header],
) -> Vec<pb::Header> {
    let header = |name: &str, value: Bytes| pb::Header {
        name: name.to_string(),
        value,
    };
    let find = |name: &str| {
        client
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value.clone())
    };
    let accept: &'static [u8] = match endpoint.op {
        _ if stream => b"text/event-stream",
        // Audio, or a transcript as text, SRT or VTT.
        Operation::Speech | Operation::Transcriptions | Operation::Translations => b"*/*",
        _ => b"application/json",
    };
    // An upload's type carries its form's boundary.
    let content_type = is_upload(endpoint.op)
        .then(|| find("content-type"))
        .flatten()
        .unwrap_or_else(|| Bytes::from_static(b"application/json"));
    let mut headers = vec![
        header("content-type", content_type),
        header("accept", Bytes::from_static(accept)),
    ];
    if endpoint.surface == Surface::Anthropic {
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
pub(super) fn with_lease(
    edge: &Edge,
    principal: &str,
    model: &str,
    dispatch: &Dispatch,
    mut tunnel: pb::ProviderTunnelRequest,
    body: BodyParts,
) -> Result<NodeRequest, CredentialError> {
    if let Some(running) = &edge.settings.credentials {
        // The plane in force now: a reload's revocation or new secret
        // applies from the next lease issued.
        let plane = running.get();
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
pub(super) async fn refuse<S>(
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
pub(super) fn tunnel_request(
    endpoint: Endpoint,
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
        path: endpoint.path.into(),
        headers,
        stream,
        // W2: the winning provider's effective stall timeout.
        response_stall_timeout_ms: dispatch.response_stall_timeout_ms,
        operation: endpoint.operation.into(),
        correlation_id: correlation_id.into(),
        ..Default::default()
    }
}

/// The normalized run for an Ollama/native provider (E1–E3, W2).
pub(super) fn run_request(
    chat: &ChatRequest,
    dispatch: &Dispatch,
    correlation_id: &str,
) -> pb::Frame {
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

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;
    use iop_wire::lease::{request_digest, BoundRequest, RecipientKey};
    use prost::Message;
    use x25519_dalek::StaticSecret;
    use zeroize::Zeroizing;

    use super::*;
    use crate::api::body_json::JsonLimits;
    use crate::config::EdgeConfig;
    use crate::control::{ConnId, Generation, ProviderKey, ProviderLease};
    use crate::plane::credentials::CredentialPlane;

    const SECRET: &[u8] = b"sk-iop-surface-canary-1b2c";

    fn dispatch() -> Dispatch {
        Dispatch {
            request: RequestId(4),
            lease: ProviderLease {
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
            accepts_tunnel_body: false,
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
        let edge = crate::link::edge::edge_state_with(&cfg, Some(plane));
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
        let Some(plane) = edge.settings.credentials.as_ref().map(|r| r.get()) else {
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
        let bare = crate::link::edge::edge_state(&cfg);
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
        let edge = crate::link::edge::edge_state_with(&cfg, Some(plane));
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
}
