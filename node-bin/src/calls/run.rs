//! The provider call of a normalized run: by the adapter's protocol, an
//! Ollama NDJSON exchange ([`super::ollama`]) or an OpenAI-compatible SSE
//! exchange with the E5 retry ([`super::openai`]); for an embeddings run
//! ([`RunOperation::Embeddings`]) Ollama's `/api/embed`.

use std::rc::Rc;
use std::sync::Arc;

use iop_wire::pb;

use super::channel::{OutputTx, ProviderCall};
use super::output::RunOutput;
use super::pool::ProviderPool;
use super::{ollama, openai};
use crate::adapters::{AdapterKind, Endpoint};
use crate::codes;

/// The provider call of one run, by the adapter's protocol; any failure
/// becomes the run's `error` terminal (W6).
///
/// The whole call — HTTP exchange, the E5 retry, stream framing and the
/// adapter's parser — runs on the core that owns the provider socket (a
/// worker core with `--cores` of two or more): the retry needs the
/// exchange at hand, the parse work then spreads over the worker cores
/// instead of loading the control shard, and what crosses to the session
/// core is the small parsed [`RunOutput`]s, fewer and smaller than the
/// raw NDJSON/SSE pieces.
#[derive(Debug)]
pub struct RunCall {
    /// The adapter instance's endpoint.
    pub endpoint: Arc<Endpoint>,
    /// The target (model) of the run.
    pub target: String,
    /// The normalized input (E3).
    pub input: pb::RunInput,
    /// What the run does.
    pub operation: RunOperation,
}

/// What a normalized run does (`RunRequest.operation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOperation {
    /// A chat over `RunInput.messages` (`""` or `"chat_completions"`).
    Chat,
    /// The vectors of `RunInput.embed_input` (`"embeddings"`; Ollama
    /// adapters only).
    Embeddings,
}

impl RunOperation {
    /// The operation `RunRequest.operation` names on an adapter of `kind`;
    /// `None` when this Node does not run it there.
    pub fn of(operation: &str, kind: AdapterKind) -> Option<Self> {
        match (operation, kind) {
            ("" | "chat_completions", _) => Some(RunOperation::Chat),
            ("embeddings", AdapterKind::Ollama) => Some(RunOperation::Embeddings),
            _ => None,
        }
    }
}

impl ProviderCall for RunCall {
    type Output = RunOutput;

    async fn run(self, pool: Rc<ProviderPool>, out: OutputTx<RunOutput>) {
        let RunCall {
            endpoint,
            target,
            input,
            operation,
        } = self;
        let result = match (endpoint.kind, operation) {
            (AdapterKind::Ollama, RunOperation::Embeddings) => {
                ollama::embed(&pool, &endpoint, &target, &input, &out).await
            }
            (_, RunOperation::Embeddings) => Err((
                codes::BAD_OPERATION,
                "embeddings runs are served by Ollama adapters only".to_string(),
            )),
            (AdapterKind::Ollama, RunOperation::Chat) => {
                ollama::call(&pool, &endpoint, &target, &input, &out).await
            }
            (AdapterKind::OpenAiCompat, RunOperation::Chat) => {
                // C2 hook: a credential lease opened after admission would
                // add the profile's auth header here
                // (`openai::auth_header`).
                let auth: Option<(String, String)> = None;
                openai::call(&pool, &endpoint, &target, &input, auth, &out).await
            }
        };
        if let Err((code, message)) = result {
            out.send(RunOutput::Failed { code, message }).await;
        }
    }

    fn not_started(message: String) -> RunOutput {
        RunOutput::Failed {
            code: codes::PROVIDER_UNREACHABLE,
            message,
        }
    }
}
