//! The inference endpoints: each one's path, operation and error shape
//! (the operation descriptor the pipeline is driven by).

use crate::api::error::Surface;
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

/// The routes that go through admission and a node (metrics: end to end).
pub(super) fn is_inference_route(path: &str) -> bool {
    [CHAT_COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS]
        .iter()
        .any(|route| route.path == path)
}
