//! Sending a dispatched attempt's run to its node, answering the client
//! when the node's connection is gone: what every route that relays a run
//! (chat, the tunneled operations, Ollama embeddings, uploads) shares.

use std::rc::Rc;

use iop_engine::http::HttpError;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

use super::conn::*;
use crate::api::error::{GatewayError, Surface};
use crate::control::{Dispatch, RequestId};
use crate::link::edge::Edge;
use crate::link::shards::NodeRequest;

/// A frame carrying `body`.
pub(super) fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// Sends a run to the lease's node; on failure settles the request and
/// answers the client. Returns whether it was sent. `buffered`: its relay
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
    let sent = edge.start_attempt(request, dispatch, run, buffered).await;
    if !sent {
        edge.abandon(request);
        write_error(server, surface, &GatewayError::node_unavailable()).await?;
    }
    Ok(sent)
}
