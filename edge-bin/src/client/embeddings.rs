//! `POST /v1/embeddings` on an Ollama provider: one attempt as a normalized
//! run over the provider's `/api/embed` ([`crate::api::embeddings`]),
//! answered in the OpenAI shape. The pipeline's passthrough takes a
//! dispatch of kind `Normalized` here; every other provider gets the
//! client's bytes through a tunnel as before.
//!
//! ```text
//! passthrough loop ─dispatch kind Normalized─► attempt:
//!   read the body (a 400 for token ids) ─► RunRequest{operation "embeddings"}
//!   ─► node ─► start, complete{vectors} ─► relay_embeddings ─► 200 list
//! ```

use std::rc::Rc;

use iop_engine::http::HttpError;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

use super::attempt::{frame, send_attempt};
use super::conn::*;
use super::endpoints::unsupported;
use super::endpoints::Endpoint;
use super::relay::{relay_embeddings, Relayed};
use crate::api::embeddings::{EmbeddingsAnswer, EmbeddingsRun};
use crate::api::openai::PassthroughRequest;
use crate::control::{Dispatch, Operation, RequestId};
use crate::link::edge::Edge;
use crate::link::replies::ReplyRx;
use crate::link::shards::NodeRequest;

/// `RunRequest.operation` of an embeddings run.
pub const OPERATION: &str = "embeddings";

/// How a normalized attempt went.
pub(super) enum RunAttempt {
    /// It was sent and relayed: settle it as the pipeline settles a
    /// tunnel's relay.
    Relayed(Result<Relayed, HttpError>),
    /// It was refused before it was sent (the request is settled and the
    /// client answered, or gone).
    Answered(Result<(), HttpError>),
}

/// One attempt of `req` at `endpoint` on the normalized-run provider of
/// `dispatch`.
pub(super) async fn attempt<S>(
    edge: &Rc<Edge>,
    server: &mut Client<S>,
    endpoint: Endpoint,
    request: RequestId,
    dispatch: &Dispatch,
    frames: &mut ReplyRx,
    req: &PassthroughRequest,
) -> RunAttempt
where
    S: ClientStream,
{
    if endpoint.op != Operation::Embeddings {
        // Control files native (Ollama) providers in no lane of the other
        // tunneled operations: this is a wiring bug, answered as if no
        // provider served it.
        edge.abandon(request);
        let e = unsupported(&req.model, endpoint);
        return RunAttempt::Answered(write_error(server, endpoint.surface, &e).await);
    }
    let run = match EmbeddingsRun::parse(|name| req.member(name)) {
        Ok(run) => run,
        Err(e) => {
            edge.abandon(request);
            return RunAttempt::Answered(write_error(server, endpoint.surface, &e).await);
        }
    };
    let lease = &dispatch.lease;
    server
        .rec
        .attempt(&lease.provider.node_id, &lease.provider.provider_id);
    let sent = send_attempt(
        edge,
        server,
        endpoint.surface,
        request,
        dispatch,
        NodeRequest::frame_only(run_request(&run, dispatch, &server.rec.request_id)),
        true,
    )
    .await;
    match sent {
        Ok(true) => {}
        Ok(false) => return RunAttempt::Answered(Ok(())),
        Err(e) => return RunAttempt::Answered(Err(e)),
    }
    let answer = EmbeddingsAnswer::new(&req.model, &run);
    RunAttempt::Relayed(relay_embeddings(edge, server, frames, answer).await)
}

/// The embeddings run for the lease's provider (E2: its adapter and
/// target, never the client's model).
fn run_request(run: &EmbeddingsRun, dispatch: &Dispatch, correlation_id: &str) -> pb::Frame {
    let lease = &dispatch.lease;
    frame(Body::RunRequest(Box::new(pb::RunRequest {
        run_id: lease.run_id.clone(),
        adapter: lease.adapter.to_string(),
        target: lease.target.to_string(),
        input: Some(run.run_input()),
        response_stall_timeout_ms: dispatch.response_stall_timeout_ms,
        correlation_id: correlation_id.into(),
        operation: OPERATION.into(),
        ..Default::default()
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{ConnId, DispatchKind, Generation, ProviderKey, ProviderLease};

    #[test]
    fn the_run_names_the_operation_and_the_providers_target() {
        let dispatch = Dispatch {
            request: RequestId(7),
            lease: ProviderLease {
                request: RequestId(7),
                run_id: "run-7".into(),
                provider: ProviderKey {
                    node_id: "node-a".into(),
                    provider_id: "ol".into(),
                },
                conn: ConnId(1),
                generation: Generation(1),
                adapter: "ollama".into(),
                target: "nomic-embed-text".into(),
                long: false,
            },
            kind: DispatchKind::Normalized,
            response_stall_timeout_ms: 1500,
            strips_usage_chunk: false,
            accepts_tunnel_body: false,
        };
        let run = EmbeddingsRun {
            inputs: vec!["a".into(), "b".into()],
            dimensions: Some(4),
            base64: true,
        };
        let Some(Body::RunRequest(sent)) = run_request(&run, &dispatch, "req-1").body else {
            panic!("a run request");
        };
        assert_eq!(
            *sent,
            pb::RunRequest {
                run_id: "run-7".into(),
                adapter: "ollama".into(),
                target: "nomic-embed-text".into(),
                input: Some(pb::RunInput {
                    embed_input: vec!["a".into(), "b".into()],
                    dimensions: Some(4),
                    ..Default::default()
                }),
                response_stall_timeout_ms: 1500,
                correlation_id: "req-1".into(),
                operation: "embeddings".into(),
                ..Default::default()
            }
        );
    }
}
