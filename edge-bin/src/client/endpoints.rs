//! The inference endpoints: each one's path, operation and error shape
//! (the operation descriptor the pipeline is driven by).

use crate::api::error::{GatewayError, Surface};
use crate::control::Operation;

/// An inference endpoint: which profile operation it is (U3) and which
/// client API it speaks.
#[derive(Debug, Clone, Copy)]
pub(super) struct Endpoint {
    pub(super) operation: &'static str,
    pub(super) op: Operation,
    pub(super) path: &'static str,
    pub(super) surface: Surface,
}

pub(super) const CHAT_COMPLETIONS: Endpoint = Endpoint {
    operation: "chat_completions",
    op: Operation::ChatCompletions,
    path: "/v1/chat/completions",
    surface: Surface::OpenAi,
};
pub(super) const RESPONSES: Endpoint = Endpoint {
    operation: "responses",
    op: Operation::Responses,
    path: "/v1/responses",
    surface: Surface::OpenAi,
};
pub(super) const MESSAGES: Endpoint = Endpoint {
    operation: "messages",
    op: Operation::Messages,
    path: "/v1/messages",
    surface: Surface::Anthropic,
};
pub(super) const COUNT_TOKENS: Endpoint = Endpoint {
    operation: "count_tokens",
    op: Operation::CountTokens,
    path: "/v1/messages/count_tokens",
    surface: Surface::Anthropic,
};

pub(super) const COMPLETIONS: Endpoint = Endpoint {
    operation: "completions",
    op: Operation::Completions,
    path: "/v1/completions",
    surface: Surface::OpenAi,
};
pub(super) const EMBEDDINGS: Endpoint = Endpoint {
    operation: "embeddings",
    op: Operation::Embeddings,
    path: "/v1/embeddings",
    surface: Surface::OpenAi,
};
pub(super) const RERANK: Endpoint = Endpoint {
    operation: "rerank",
    op: Operation::Rerank,
    path: "/v1/rerank",
    surface: Surface::OpenAi,
};
/// The same operation as [`RERANK`] (vLLM serves both paths alike).
pub(super) const RERANK_V2: Endpoint = Endpoint {
    operation: "rerank",
    op: Operation::Rerank,
    path: "/v2/rerank",
    surface: Surface::OpenAi,
};
pub(super) const SCORE: Endpoint = Endpoint {
    operation: "score",
    op: Operation::Score,
    path: "/v1/score",
    surface: Surface::OpenAi,
};
pub(super) const TOKENIZE: Endpoint = Endpoint {
    operation: "tokenize",
    op: Operation::Tokenize,
    path: "/tokenize",
    surface: Surface::OpenAi,
};
pub(super) const DETOKENIZE: Endpoint = Endpoint {
    operation: "detokenize",
    op: Operation::Detokenize,
    path: "/detokenize",
    surface: Surface::OpenAi,
};

pub(super) const TRANSCRIPTIONS: Endpoint = Endpoint {
    operation: "transcriptions",
    op: Operation::Transcriptions,
    path: "/v1/audio/transcriptions",
    surface: Surface::OpenAi,
};
pub(super) const TRANSLATIONS: Endpoint = Endpoint {
    operation: "translations",
    op: Operation::Translations,
    path: "/v1/audio/translations",
    surface: Surface::OpenAi,
};
pub(super) const SPEECH: Endpoint = Endpoint {
    operation: "speech",
    op: Operation::Speech,
    path: "/v1/audio/speech",
    surface: Surface::OpenAi,
};

/// 400: no provider of `model` serves `endpoint`'s operation.
pub(super) fn unsupported(model: &str, endpoint: Endpoint) -> GatewayError {
    GatewayError::invalid_request(
        format!("No provider serving `{model}` supports {}.", endpoint.path),
        None,
    )
}

/// Whether `op`'s body is a `multipart/form-data` upload (its `model`
/// field is replaced; everything else passes as sent).
pub(super) fn is_upload(op: Operation) -> bool {
    matches!(op, Operation::Transcriptions | Operation::Translations)
}

/// The chat family: routes of their own in [`super::pipeline`].
pub(super) const CHAT_FAMILY: [Endpoint; 4] = [CHAT_COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS];

/// The OpenAI-shaped endpoints tunneled as they are, through
/// [`super::pipeline::passthrough`] (the chat family has routes of its own).
pub(super) const TUNNELED: [Endpoint; 10] = [
    COMPLETIONS,
    EMBEDDINGS,
    RERANK,
    RERANK_V2,
    SCORE,
    TOKENIZE,
    DETOKENIZE,
    TRANSCRIPTIONS,
    TRANSLATIONS,
    SPEECH,
];

/// The tunneled endpoint at `path`, if any.
pub(super) fn tunneled(path: &str) -> Option<Endpoint> {
    TUNNELED.into_iter().find(|e| e.path == path)
}

/// Every inference endpoint.
pub(super) fn all() -> impl Iterator<Item = Endpoint> {
    CHAT_FAMILY.into_iter().chain(TUNNELED)
}

/// The routes that go through admission and a node (metrics: end to end).
pub(super) fn is_inference_route(path: &str) -> bool {
    all().any(|route| route.path == path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_endpoint_names_its_operation() {
        assert_eq!(all().count(), 14);
        for e in all() {
            assert_eq!(e.operation, e.op.name(), "{}", e.path);
        }
        assert_eq!(tunneled("/v2/rerank").map(|e| e.operation), Some("rerank"));
        assert_eq!(tunneled("/v1/chat/completions").map(|e| e.path), None);
    }
}
