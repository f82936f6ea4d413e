//! Forwarding in a cluster: a request for a model that this Edge has no
//! free slot for goes, before it is submitted to `Control`, to the peer
//! listener of the peer with the most free slots for it, or, when no peer
//! has one and this Edge owns none of the model's nodes, of the Edge
//! owning the most of them ([`crate::cluster::route`], from the capacity
//! summaries of [`crate::cluster::summaries`]); that Edge's answer goes
//! back to the client as it is.
//!
//! ```text
//! client ─► Edge A: key, model access, limits charged ─► route: Forward{B, fallbacks, reason}
//!             │ one mTLS connection per request in flight (pooled when idle),
//!             │ A's [tls] identity as the client certificate
//!             ▼
//!           Edge B peer listener: same client router, marked `peer=A`
//!             (never forwarded again; limits not charged again)
//! client ◄── status, headers, body pieces as B sends them (TCP flow control
//!            per request: a slow client stalls only its own upstream)
//! ```
//!
//! - **Before the request is written** a target that cannot be reached
//!   (connect, TLS, write) is skipped for the next fallback; with none
//!   left the client gets 503 `peer_unavailable` with `retry-after: 1`.
//! - **After it was written** it is never sent elsewhere. The one retry:
//!   a pooled idle connection that the peer had closed before it read the
//!   request (`ClosedBeforeResponse`, not a byte answered) is replaced by a
//!   fresh connection to the same Edge.
//! - **An answer that breaks off** ends the client's response the way a lost
//!   node does ([`GatewayError::node_lost`]): a 502 before anything was
//!   written, an SSE error event on a started event stream, else the
//!   connection is closed.
//! - **The client going away** drops the upstream connection: the peer sees
//!   its client leave and cancels the run (U6).

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{BodyFraming, ClientConn, Header, HttpError, Limits, Watched};
use iop_engine::tls::{MaybeTls, NodeTlsConnector, UpstreamStream};

use super::caller::{check_caller, write_caller_refusal};
use super::conn::*;
use super::endpoints::Endpoint;
use crate::api::error::{GatewayError, Surface};
use crate::api::openai;
use crate::cluster::route::{self, ForwardReason, PeerEdge, Route};
use crate::cluster::summaries;
use crate::link::edge::Edge;
use crate::plane::access::REQUEST_ID_HEADER;
use crate::plane::cluster::Forwarded;

/// Longest wait for a peer's TCP connect and TLS handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Idle connections kept per peer Edge on each shard.
pub const MAX_IDLE_PER_PEER: usize = 8;

/// An idle pooled connection older than this is closed, not reused: well
/// under the peer's `edge.client_keep_alive_timeout_ms` (60 s by default),
/// so the peer rarely closes one first.
pub const MAX_IDLE_AGE: Duration = Duration::from_secs(10);

/// A peer's answer with a `Content-Length` up to this size is relayed with
/// the same length (read whole, then written); a larger one, and every
/// chunked answer, is relayed piece by piece as it arrives.
pub const MAX_SIZED_BODY_BYTES: u64 = 1024 * 1024;

/// A connection to a peer's listener.
type Upstream = ClientConn<UpstreamStream>;

/// Where a pooled connection leads: from this Edge (its identity) to one
/// peer Edge at one address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    from: String,
    to: String,
    addr: SocketAddr,
}

struct Idle {
    conn: Upstream,
    since: Instant,
}

thread_local! {
    /// This shard's idle connections to peers (a connection lives on the
    /// shard that opened it).
    static POOL: RefCell<HashMap<PoolKey, Vec<Idle>>> = RefCell::new(HashMap::new());
}

/// An idle connection to `key`, the most recently used first; expired
/// ones are closed on the way.
fn pool_take(key: &PoolKey) -> Option<Upstream> {
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        let idle = pool.get_mut(key)?;
        let now = clock::now();
        let found = loop {
            let entry = idle.pop()?;
            if now.saturating_duration_since(entry.since) < MAX_IDLE_AGE {
                break Some(entry.conn);
            }
        };
        if idle.is_empty() {
            pool.remove(key);
        }
        found
    })
}

/// Keeps `conn` for the next request to `key` if it can carry one and the
/// peer's idle list has room.
fn pool_put(key: PoolKey, conn: Upstream) {
    if !conn.is_reusable() {
        return;
    }
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        let idle = pool.entry(key).or_default();
        if idle.len() < MAX_IDLE_PER_PEER {
            idle.push(Idle {
                conn,
                since: clock::now(),
            });
        }
    });
}

/// The Edges a request is forwarded to, and why.
#[derive(Debug)]
pub(super) struct Targets {
    /// The target first, then the fallbacks in order.
    peers: Vec<PeerEdge>,
    reason: ForwardReason,
}

/// Where a request is served in a cluster ([`place`]).
pub(super) enum Placement {
    /// Here, through this Edge's Control (and always for a single Edge).
    Here,
    /// At the first of these peers that takes it.
    Forward(Targets),
    /// Nowhere: no Edge owned a node of the model for as long as the
    /// model's queue timeout; answer as a queue timeout would.
    Nowhere,
    /// The client left while it waited for an owner.
    ClientGone,
}

/// How often [`place`] looks again while no Edge owns a node of the model.
const UNOWNED_RECHECK: Duration = Duration::from_millis(100);

/// Where to serve a request to `endpoint` for `model`: here for a single
/// Edge, a request that came from a peer (never forwarded again), an Edge
/// that cannot dial peers, or a [`Route::Local`] decision (from the owners
/// of the model's nodes and the free slots for the endpoint's operation,
/// here and at the peers); else at the peers the decision names. While no
/// Edge owns any node of the model (they are moving between Edges, as in a
/// rolling restart) it looks again every [`UNOWNED_RECHECK`], up to the
/// model's queue timeout: queueing here would wait for a node that may
/// register elsewhere.
pub(super) async fn place<S>(
    edge: &Edge,
    server: &mut Client<S>,
    endpoint: Endpoint,
    model: &str,
) -> Placement
where
    S: ClientStream,
{
    let deadline = edge
        .settings
        .running
        .get()
        .model_queue_timeouts
        .get(model)
        .map(|&wait| clock::now() + wait);
    loop {
        match route_of(edge, server, endpoint, model) {
            None | Some(Route::Local) => return Placement::Here,
            Some(Route::Forward {
                target,
                mut fallbacks,
                reason,
            }) => {
                fallbacks.insert(0, target);
                return Placement::Forward(Targets {
                    peers: fallbacks,
                    reason,
                });
            }
            Some(Route::Unowned) => {
                let Some(deadline) = deadline else {
                    return Placement::Here;
                };
                let left = deadline.saturating_duration_since(clock::now());
                if left.is_zero() {
                    return Placement::Nowhere;
                }
                let pause = monoio::time::sleep(left.min(UNOWNED_RECHECK));
                if let Watched::PeerClosed = server.watch_peer(pause).await {
                    return Placement::ClientGone;
                }
            }
        }
    }
}

/// The route decision for `model`, `None` when the request is served here
/// whatever the cluster looks like (see [`place`]).
fn route_of<S>(edge: &Edge, server: &Client<S>, endpoint: Endpoint, model: &str) -> Option<Route> {
    if server.rec.peer.is_some() {
        return None;
    }
    let cluster = edge.settings.cluster.as_ref()?;
    edge.settings.peer_tls.as_ref()?;
    let running = edge.settings.running.get();
    let nodes = running.model_nodes.get(model)?;
    let owners = cluster.owners_of(nodes);
    let free = cluster.free_slots(model, endpoint.op, clock::now(), summaries::MAX_AGE);
    Some(route::decide(
        &cluster.edge_name,
        owners.iter().map(Option::as_deref),
        &cluster.peer_addrs(),
        &free,
    ))
}

/// Forwards the request (its `endpoint`, the client's `headers` and `body`
/// as received) to the first of `targets` that takes it and relays the
/// answer; see the module docs. The caller's model access and limits are
/// checked (and charged) here first, as for a local request.
pub(super) async fn forward<S>(
    edge: &Edge,
    server: &mut Client<S>,
    endpoint: Endpoint,
    model: &str,
    targets: Targets,
    headers: Vec<Header>,
    body: Bytes,
) -> Result<(), HttpError>
where
    S: ClientStream,
{
    if let Some(refusal) = check_caller(edge, server, model) {
        return write_caller_refusal(server, endpoint.surface, &refusal).await;
    }
    let (Some(cluster), Some(tls)) = (&edge.settings.cluster, &edge.settings.peer_tls) else {
        // `targets_of` found both.
        return write_error(
            server,
            endpoint.surface,
            &GatewayError::peer_unavailable(model),
        )
        .await;
    };
    let Targets {
        peers: targets,
        reason,
    } = targets;
    let reasons = &cluster.counters;
    match reason {
        ForwardReason::NoLocalNode => &reasons.forwarded_no_local_node,
        ForwardReason::LocalFull => &reasons.forwarded_local_full,
    }
    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let request_headers = peer_request_headers(&headers, &server.rec.request_id);
    drop(headers);
    for peer in targets {
        let key = PoolKey {
            from: cluster.edge_name.clone(),
            to: peer.name.clone(),
            addr: peer.addr,
        };
        let sent =
            match write_request(&key, tls, &peer, endpoint.path, &request_headers, &body).await {
                Ok(sent) => sent,
                Err(why) => {
                    cluster
                        .counters
                        .forwarded(&peer.name, Forwarded::Unavailable);
                    tracing::warn!(
                        request_id = %server.rec.request_id,
                        peer = %peer.name,
                        addr = %peer.addr,
                        error = %why,
                        "cannot forward to the peer edge"
                    );
                    continue;
                }
            };
        server.rec.forwarded_to = Some(peer.name.clone());
        server.stream_started();
        let Some((outcome, result)) = Box::pin(relay(
            server,
            endpoint.surface,
            sent,
            &key,
            tls,
            &peer,
            endpoint.path,
            &request_headers,
            &body,
        ))
        .await
        else {
            // The peer is draining and admitted nothing: the next one may.
            cluster
                .counters
                .forwarded(&peer.name, Forwarded::Unavailable);
            tracing::info!(
                request_id = %server.rec.request_id,
                peer = %peer.name,
                "the peer edge is draining; trying the next"
            );
            server.rec.forwarded_to = None;
            continue;
        };
        cluster.counters.forwarded(&peer.name, outcome);
        if outcome == Forwarded::Failed {
            tracing::warn!(
                request_id = %server.rec.request_id,
                peer = %peer.name,
                "the peer edge's answer broke off"
            );
        }
        return result;
    }
    write_error(
        server,
        endpoint.surface,
        &GatewayError::peer_unavailable(model),
    )
    .await
}

/// The client's headers as the peer gets them: without hop-by-hop and
/// framing headers, `host` (the connection sets its own) and `expect` (the
/// body goes with the head), and with this request's id as
/// `x-request-id`, so both Edges log it under one id.
fn peer_request_headers(client: &[Header], request_id: &str) -> Vec<(String, Bytes)> {
    client
        .iter()
        .filter(|h| {
            !openai::is_not_relayed(&h.name)
                && !["host", "expect", REQUEST_ID_HEADER]
                    .iter()
                    .any(|name| h.name.eq_ignore_ascii_case(name))
        })
        .map(|h| (h.name.clone(), h.value.clone()))
        .chain(std::iter::once((
            REQUEST_ID_HEADER.to_string(),
            Bytes::copy_from_slice(request_id.as_bytes()),
        )))
        .collect()
}

/// A connection with the request written on it, and whether it came from
/// the pool.
struct Sent {
    conn: Upstream,
    reused: bool,
}

/// Writes the request to `peer` on a pooled connection, or on a new one
/// when there is none or the pooled one fails the write. `Err`: nothing
/// was (completely) written; the peer cannot have acted on it.
async fn write_request(
    key: &PoolKey,
    tls: &NodeTlsConnector,
    peer: &PeerEdge,
    path: &str,
    headers: &[(String, Bytes)],
    body: &Bytes,
) -> Result<Sent, String> {
    let fields = || headers.iter().map(|(k, v)| (k.as_str(), &v[..]));
    if let Some(mut conn) = pool_take(key) {
        if conn
            .send_request("POST", path, fields(), body.clone())
            .await
            .is_ok()
        {
            return Ok(Sent { conn, reused: true });
        }
    }
    let mut conn = connect(tls, peer).await?;
    conn.send_request("POST", path, fields(), body.clone())
        .await
        .map_err(|e| format!("writing the request: {e}"))?;
    Ok(Sent {
        conn,
        reused: false,
    })
}

/// A new mTLS connection to `peer`'s listener, within [`CONNECT_TIMEOUT`]
/// (dropping a connect or handshake closes its socket).
async fn connect(tls: &NodeTlsConnector, peer: &PeerEdge) -> Result<Upstream, String> {
    let connector = tls.to_edge(&peer.name).map_err(|e| e.to_string())?;
    let dial = async {
        let tcp = iop_engine::http::connect(peer.addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let stream = connector
            .connect(tcp)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        Ok::<_, String>(
            ClientConn::new(MaybeTls::from(stream), Limits::default())
                .with_host(peer.addr.to_string()),
        )
    };
    match monoio::time::timeout(CONNECT_TIMEOUT, dial).await {
        Ok(dialled) => dialled,
        Err(_) => Err(format!("no connection within {CONNECT_TIMEOUT:?}")),
    }
}

/// Relays the peer's answer to the request written on `sent`: waits for
/// its head while watching the client, then writes status, headers and
/// body as they arrive. Returns how the forward went (for `/metrics`) and
/// the client connection's result; `None` when the peer answered that it
/// admitted nothing (it is draining: [`NOT_ADMITTED_HEADER`]), before
/// anything was written to the client.
#[allow(clippy::too_many_arguments)]
async fn relay<S>(
    server: &mut Client<S>,
    surface: Surface,
    sent: Sent,
    key: &PoolKey,
    tls: &NodeTlsConnector,
    peer: &PeerEdge,
    path: &str,
    headers: &[(String, Bytes)],
    body: &Bytes,
) -> Option<(Forwarded, Result<(), HttpError>)>
where
    S: ClientStream,
{
    let Sent {
        mut conn,
        mut reused,
    } = sent;
    let head = loop {
        match server.watch_peer(conn.read_response_head()).await {
            // The client left first: dropping the connection tells the
            // peer, which cancels the run.
            Watched::PeerClosed => return Some((Forwarded::Ok, Err(HttpError::UnexpectedEof))),
            Watched::Done(Ok(head)) => break head,
            // A pooled connection the peer had closed before the request
            // came: it read none of it.
            Watched::Done(Err(HttpError::ClosedBeforeResponse)) if reused => {
                reused = false;
                let fresh = async {
                    let mut fresh = connect(tls, peer).await?;
                    let fields = headers.iter().map(|(k, v)| (k.as_str(), &v[..]));
                    fresh
                        .send_request("POST", path, fields, body.clone())
                        .await
                        .map_err(|e| format!("writing the request: {e}"))?;
                    Ok::<_, String>(fresh)
                };
                match fresh.await {
                    Ok(fresh) => conn = fresh,
                    Err(why) => {
                        tracing::warn!(peer = %peer.name, error = %why, "cannot forward to the peer edge");
                        let written =
                            write_error(server, surface, &GatewayError::node_lost()).await;
                        return Some((Forwarded::Failed, written));
                    }
                }
            }
            Watched::Done(Err(e)) => {
                tracing::warn!(peer = %peer.name, error = %e, "no answer from the peer edge");
                let written = write_error(server, surface, &GatewayError::node_lost()).await;
                return Some((Forwarded::Failed, written));
            }
        }
    };
    if head.status == 503
        && head
            .headers
            .iter()
            .any(|h| h.name.eq_ignore_ascii_case(NOT_ADMITTED_HEADER))
    {
        return None;
    }
    let event_stream = head
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-type"))
        .is_some_and(|h| h.value.starts_with(b"text/event-stream"));
    let relayed: Vec<(&str, &[u8])> = head
        .headers
        .iter()
        // The client's connection has its own framing, and its own
        // `x-request-id` (the same id: the peer was given it).
        .filter(|h| {
            !openai::is_not_relayed(&h.name) && !h.name.eq_ignore_ascii_case(REQUEST_ID_HEADER)
        })
        .map(|h| (h.name.as_str(), &h.value[..]))
        .collect();
    match head.framing {
        BodyFraming::None => {
            let written = server
                .write_response(head.status, relayed, Bytes::new())
                .await;
            pool_put(key.clone(), conn);
            Some((Forwarded::Ok, written))
        }
        BodyFraming::ContentLength { len_bytes } if len_bytes <= MAX_SIZED_BODY_BYTES => {
            let answer = match conn.read_body_to_end(len_bytes as usize).await {
                Ok(answer) => answer,
                Err(e) => {
                    tracing::warn!(peer = %peer.name, error = %e, "the peer edge's answer broke off");
                    let written = write_error(server, surface, &GatewayError::node_lost()).await;
                    return Some((Forwarded::Failed, written));
                }
            };
            observe_usage(server, head.status, &answer);
            let written = server.write_response(head.status, relayed, answer).await;
            pool_put(key.clone(), conn);
            Some((Forwarded::Ok, written))
        }
        _ => {
            if let Err(e) = server.start_chunked(head.status, relayed).await {
                return Some((Forwarded::Ok, Err(e)));
            }
            loop {
                match conn.read_body_chunk().await {
                    Ok(Some(piece)) => {
                        if let Err(e) = server.write_chunk(piece).await {
                            return Some((Forwarded::Ok, Err(e)));
                        }
                        if let Err(e) = server.check_cut_off() {
                            return Some((Forwarded::Ok, Err(e)));
                        }
                    }
                    Ok(None) => {
                        let finished = server.finish().await;
                        pool_put(key.clone(), conn);
                        return Some((Forwarded::Ok, finished));
                    }
                    Err(e) => {
                        tracing::debug!(peer = %peer.name, error = %e, "the peer edge's answer broke off");
                        let e = GatewayError::node_lost();
                        server.rec.end(e.outcome());
                        let ended = if event_stream {
                            match server.write_chunk(e.sse_event(surface)).await {
                                Ok(()) => server.finish().await,
                                Err(e) => Err(e),
                            }
                        } else {
                            match server.close().await {
                                Ok(()) => Err(HttpError::UnexpectedEof),
                                Err(e) => Err(e),
                            }
                        };
                        return Some((Forwarded::Failed, ended));
                    }
                }
            }
        }
    }
}

/// Notes the usage of a whole JSON answer (`usage.prompt_tokens`,
/// `usage.completion_tokens`, or Anthropic's `input_tokens`/`output_tokens`)
/// on the access record, so the caller's token limits are settled against
/// it. A streamed answer's usage is observed at the Edge that served it.
fn observe_usage<S>(server: &mut Client<S>, status: u16, answer: &[u8]) {
    if status != 200 {
        return;
    }
    let Ok(answer) = serde_json::from_slice::<serde_json::Value>(answer) else {
        return;
    };
    let usage = &answer["usage"];
    let count = |a: &str, b: &str| usage[a].as_u64().or_else(|| usage[b].as_u64());
    if let (Some(prompt), Some(completion)) = (
        count("prompt_tokens", "input_tokens"),
        count("completion_tokens", "output_tokens"),
    ) {
        server.rec.usage(prompt, completion);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_gets_the_clients_headers_without_hop_by_hop_ones_and_with_this_requests_id() {
        let header = |name: &str, value: &'static str| Header {
            name: name.into(),
            value: Bytes::from_static(value.as_bytes()),
        };
        let client = [
            header("Host", "edge-a"),
            header("Authorization", "Bearer sk-1"),
            header("Connection", "keep-alive"),
            header("Content-Length", "17"),
            header("Transfer-Encoding", "chunked"),
            header("Expect", "100-continue"),
            header("X-Request-Id", "client-chosen"),
            header("Content-Type", "application/json"),
            header("anthropic-version", "2023-06-01"),
            header("Keep-Alive", "timeout=5"),
        ];
        let sent: Vec<(String, Bytes)> = peer_request_headers(&client, "req-7");
        let sent: Vec<(&str, &[u8])> = sent.iter().map(|(k, v)| (k.as_str(), &v[..])).collect();
        assert_eq!(
            sent,
            [
                ("Authorization", &b"Bearer sk-1"[..]),
                ("Content-Type", b"application/json"),
                ("anthropic-version", b"2023-06-01"),
                ("x-request-id", b"req-7"),
            ]
        );
    }
}
