//! Sending a dispatched attempt's run to its node, answering the client
//! when the node's connection is gone: what every route that relays a run
//! (chat, the tunneled operations, Ollama embeddings, uploads) shares.

use std::rc::Rc;

use iop_engine::clock;
use iop_engine::http::HttpError;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

use super::conn::*;
use crate::api::error::{GatewayError, Surface};
use crate::control::{Dispatch, RequestId};
use crate::link::edge::Edge;
use crate::link::shards::NodeRequest;
use crate::plane::tracing::set_trace;

/// A frame carrying `body`.
pub(super) fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// Sends a run to the lease's node; on failure settles the request and
/// answers the client. Returns whether it was sent. A traced request
/// records the attempt's `dispatch` span here, and the run carries its
/// trace context to the node. `buffered`: its relay
/// writes only at the end (the commit point, [`crate::control::attempt`]).
pub(super) async fn send_attempt<S>(
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
    let mut run = run;
    if let (Some(trace), Some(tracer)) = (server.trace.as_mut(), &edge.settings.tracer) {
        let lease = &dispatch.lease;
        let ctx = trace.dispatch(
            tracer,
            clock::now(),
            &lease.provider.node_id,
            &lease.provider.provider_id,
            &lease.run_id,
        );
        if let Some(ctx) = ctx {
            set_trace(&mut run.frame, ctx);
        }
    }
    let sent = edge.start_attempt(request, dispatch, run, buffered).await;
    if let Some(trace) = server.trace.as_mut() {
        trace.dispatched(clock::now(), sent);
    }
    if !sent {
        edge.abandon(request);
        write_error(server, surface, &GatewayError::node_unavailable()).await?;
    }
    Ok(sent)
}
