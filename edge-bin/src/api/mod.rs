//! The client-facing shapes: what a request body is ([`body_json`]: the
//! client's bytes, bounded and validated, members read on demand and
//! spliced), the gateway's errors in the OpenAI and Anthropic shapes
//! ([`error`]), the OpenAI and Anthropic requests and answers ([`openai`]),
//! and the translation of a normalized run into OpenAI chat
//! chunks and completions ([`translate`]) or an embeddings list
//! ([`embeddings`]). Pure: no sockets, no state.

pub mod body_json;
pub mod embeddings;
pub mod error;
pub mod multipart;
pub mod openai;
pub mod route_hint;
pub mod translate;
