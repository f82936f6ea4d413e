//! The provider HTTP exchange of a tunnel: request out, response head,
//! body pieces as slices of the pooled read buffer (never parsed or copied,
//! U2), then `End`. Runs on the core that owns the provider socket.
//!
//! One exception to "never parsed": a streamed chat completion whose usage
//! the Edge asked for on the client's behalf (`strip_usage_chunk`) goes
//! through [`UsageChunkStrip`], which leaves out the usage-only event the
//! client did not ask for; the rest are still slices of the read buffer.

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use iop_engine::http::{self, HttpError};
use iop_engine::metrics::{self, Count};
use iop_wire::lease::OpenedSecret;
use iop_wire::pb;

use super::channel::{OutputTx, ProviderCall};
use super::output::TunnelOutput;
use super::pool::{ProviderPool, ProviderRequest, SecretHeader};
use super::upload::UploadSource;
use super::usage::{UsageChunkStrip, UsageWatcher};
use crate::adapters::Endpoint;
use crate::codes;

/// The provider HTTP exchange of one tunnel, run on this core (inline, by
/// its attempt) or on a worker core (everything here is `Send`; the opened
/// credential stays in its zeroizing buffers on the way).
#[derive(Debug)]
pub struct TunnelCall {
    /// The adapter instance's endpoint (base URL).
    pub endpoint: Arc<Endpoint>,
    /// Request method.
    pub method: String,
    /// Request target, under the base URL's prefix (U3).
    pub path: String,
    /// Forwarded request headers (hop-by-hop and `Host` are dropped).
    pub headers: Vec<pb::Header>,
    /// The request body, as built by the Edge (U5); its first piece when
    /// the rest streams in through `upload`.
    pub body: Bytes,
    /// The rest of a streamed request body ([`crate::calls::upload`]).
    pub upload: Option<UploadSource>,
    /// The opened credential (C2); taken when the request head is written.
    pub credential: Option<OpenedSecret>,
    /// The Edge asked the provider for a usage chunk the client did not
    /// ask for: leave it out of an event-stream body.
    pub strip_usage_chunk: bool,
}

impl ProviderCall for TunnelCall {
    type Output = TunnelOutput;

    // An `async move` block rather than an `async fn`, capturing the call
    // in a slot the exchange takes it from: the call is stored once, in
    // this future (an `async fn`, or an exchange taking it by value, would
    // keep a second copy of it in its own state).
    #[allow(clippy::manual_async_fn)]
    fn run(
        self,
        pool: Rc<ProviderPool>,
        out: OutputTx<TunnelOutput>,
    ) -> impl std::future::Future<Output = ()> + 'static {
        let mut call = Some(self);
        async move {
            if let Err((code, message)) = TunnelCall::exchange(&mut call, &pool, &out).await {
                out.send(TunnelOutput::Failed { code, message }).await;
            }
        }
    }

    fn not_started(message: String) -> TunnelOutput {
        TunnelOutput::Failed {
            code: codes::PROVIDER_UNREACHABLE,
            message,
        }
    }
}

impl TunnelCall {
    /// Takes the call from `slot`: its request (body, headers, target) is
    /// freed once the response head is here, not held while the body
    /// streams.
    async fn exchange(
        slot: &mut Option<TunnelCall>,
        pool: &Rc<ProviderPool>,
        out: &OutputTx<TunnelOutput>,
    ) -> Result<(), (&'static str, String)> {
        // Everything of the request and the response head lives in this
        // block, so none of it keeps room in this future (or memory) while
        // the body streams (a local that was borrowed keeps its room until
        // its scope ends).
        let (mut conn, mut usage, mut strip, start) = {
            let Some(TunnelCall {
                endpoint,
                method,
                path,
                headers: forwarded,
                body,
                upload,
                credential,
                strip_usage_chunk,
            }) = slot.take()
            else {
                return Ok(());
            };
            // --- provider pool: checkout, stale retry, credential header -------
            // C2: the declared header, built in a zeroizing buffer, replaces any
            // forwarded header of the same name. The opened secret goes right
            // here; the header value is owned by `send`, which drops it as soon
            // as no retry can need it (a stale pooled connection is retried
            // with this same value: the lease is never opened twice).
            let secret =
                credential.map(|c| SecretHeader::new(c.header_name(), c.declared_header_value()));
            let injected_name = secret.as_ref().map(|s| s.name().to_string());
            let headers: Vec<(&str, &[u8])> = forwarded
                .iter()
                .filter(|h| !http::is_hop_by_hop(&h.name) && !h.name.eq_ignore_ascii_case("host"))
                .filter(|h| {
                    injected_name
                        .as_deref()
                        .is_none_or(|name| !h.name.eq_ignore_ascii_case(name))
                })
                .map(|h| (h.name.as_str(), &h.value[..]))
                .collect();
            let request = ProviderRequest {
                method: &method,
                target: &path,
                headers: &headers,
                body,
            };
            // Boxed: checkout, connect (TLS included), the request write and the
            // response head are the largest state of this call, and an inline
            // future would keep their room through the whole body stream.
            let response = match upload {
                None => Box::pin(pool.send(endpoint.target(), &request, secret))
                    .await
                    .map_err(|e| e.into_failure())?,
                Some(upload) => {
                    Box::pin(send_upload(pool, &endpoint, &request, secret, upload, out)).await?
                }
            };
            let (conn, head) = (response.conn, response.head);
            // ----------------------------------------------------------------------
            // U1: usage is observed in the body, which goes on untouched
            // but for a usage chunk only the Edge asked for.
            let content_type = head
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-type"))
                .map(|h| &h.value[..]);
            let usage = content_type.and_then(UsageWatcher::for_content_type);
            let event_stream = content_type.is_some_and(|t| {
                t.get(..17)
                    .is_some_and(|t| t.eq_ignore_ascii_case(b"text/event-stream"))
            });
            // Boxed: it lives as long as the stream, in this future.
            let strip =
                (strip_usage_chunk && event_stream).then(|| Box::new(UsageChunkStrip::new()));
            let headers = head
                .headers
                .iter()
                .map(|h| pb::Header {
                    name: h.name.clone(),
                    value: h.value.clone(),
                })
                .collect();
            let start = TunnelOutput::Start {
                status: head.status,
                headers,
            };
            (conn, usage, strip, start)
        };
        if !out.send(start).await {
            return Ok(());
        }
        let mut relayed = Vec::new();
        loop {
            let piece = match conn.read_body_chunk().await {
                Ok(Some(piece)) => piece,
                Ok(None) => break,
                Err(e) => {
                    // What the filter held goes out before the failure, as
                    // it would have without it.
                    if let Some(held) = strip.as_mut().and_then(|s| s.take_held()) {
                        out.send(TunnelOutput::Body(held)).await;
                    }
                    return Err(provider_failure(e));
                }
            };
            let key_free_from = match usage.as_mut() {
                Some(usage) => usage.feed(&piece),
                None => piece.len(),
            };
            let Some(strip) = strip.as_mut() else {
                if !out.send(TunnelOutput::Body(piece)).await {
                    return Ok(());
                }
                continue;
            };
            strip.feed(&piece, key_free_from, &mut relayed);
            // Not kept across the sends (the slices hold the buffer).
            drop(piece);
            count(strip);
            for body in relayed.drain(..) {
                if !out.send(TunnelOutput::Body(body)).await {
                    return Ok(());
                }
            }
        }
        // The body ended: back to the pool before the terminal, so the
        // request that follows it can reuse the connection.
        conn.release();
        // An event the body ended in is relayed as it is.
        if let Some(held) = strip.as_mut().and_then(|s| s.take_held()) {
            if !out.send(TunnelOutput::Body(held)).await {
                return Ok(());
            }
        }
        let observed = usage.and_then(UsageWatcher::finish);
        if observed.is_none() && strip.is_some() {
            // Asked for and not sent: a provider that ignores
            // `stream_options.include_usage`. Nothing is guessed (the Edge
            // records `usage: "none"`); counted, so it shows.
            metrics::add(Count::NodeTunnelUsageMissing, 1);
            tracing::debug!("the provider sent no usage for a stream that asked for it");
        }
        if let Some(observed) = observed {
            if !out.send(TunnelOutput::Usage(observed)).await {
                return Ok(());
            }
        }
        out.send(TunnelOutput::End).await;
        Ok(())
    }
}

/// Sends a request whose body streams in through `upload`: the head and
/// the first piece, then each piece as it arrives, with the Edge credited
/// as the provider takes them; then the response head.
async fn send_upload(
    pool: &Rc<ProviderPool>,
    endpoint: &Endpoint,
    request: &ProviderRequest<'_>,
    secret: Option<SecretHeader>,
    mut upload: UploadSource,
    out: &OutputTx<TunnelOutput>,
) -> Result<super::pool::ProviderResponse, (&'static str, String)> {
    let len_bytes = request.body.len() as u64 + upload.left();
    let mut conn = pool
        .send_upload(endpoint.target(), request, len_bytes, secret)
        .await
        .map_err(|e| e.into_failure())?;
    while let Some(piece) = upload.next().await {
        let len = piece.len();
        conn.send_body(piece).await.map_err(provider_failure)?;
        if let Some(credit) = upload.written(len) {
            if !out.send(TunnelOutput::UploadCredit(credit)).await {
                return Err((codes::PROVIDER_ERROR, "the tunnel ended".to_string()));
            }
        }
    }
    if upload.left() > 0 {
        // The run ended (cancelled, the connection gone) before the whole
        // body came: the provider never gets a complete request.
        return Err((
            codes::PROVIDER_ERROR,
            format!("the request body broke off {} bytes short", upload.left()),
        ));
    }
    let head = conn.read_response_head().await.map_err(provider_failure)?;
    Ok(super::pool::ProviderResponse { conn, head })
}

/// Counts what `strip` did with the last piece.
fn count(strip: &mut UsageChunkStrip) {
    let counts = strip.take_counts();
    if counts.stripped > 0 {
        metrics::add(Count::NodeTunnelUsageChunksStripped, counts.stripped);
    }
    if counts.unchecked > 0 {
        metrics::add(Count::NodeTunnelEventsUnchecked, counts.unchecked);
        tracing::debug!(
            events = counts.unchecked,
            "stream events past the hold cap relayed without the usage-chunk check"
        );
    }
}

fn provider_failure(e: HttpError) -> (&'static str, String) {
    (codes::PROVIDER_ERROR, format!("provider: {e}"))
}
