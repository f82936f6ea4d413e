//! What a provider call produces: the provider's own events, already
//! parsed, before any frame is built. The attempt's emitter turns them into
//! tunnel frames or run events ([`crate::attempt::emit`]).

use std::collections::HashMap;

use bytes::Bytes;
use iop_wire::pb;

/// Provider output of a tunnel attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum TunnelOutput {
    /// The response head.
    Start {
        /// HTTP status.
        status: u16,
        /// Headers, ordered.
        headers: Vec<pb::Header>,
    },
    /// Raw body bytes (U2).
    Body(Bytes),
    /// Observation-only usage (U1).
    Usage(pb::Usage),
    /// The provider took enough of a streamed request body
    /// ([`crate::calls::upload`]) for the Edge to send up to this many
    /// charged bytes of it in total: a `FlowCredit` to the Edge, and
    /// progress (W3: an upload under way is no stall).
    UploadCredit(u64),
    /// The response ended normally.
    End,
    /// The provider call failed (W6).
    Failed {
        /// Failure code.
        code: &'static str,
        /// Legacy error string.
        message: String,
    },
}

/// Provider output of a normalized run attempt (the adapters that produce
/// it parse Ollama NDJSON / OpenAI SSE into these).
#[derive(Debug, Clone, PartialEq)]
pub enum RunOutput {
    /// The provider accepted the run.
    Start {
        /// Event metadata (E5: `openai_text_tool_fallback`).
        metadata: HashMap<String, String>,
    },
    /// Provider progress that is no event of its own (tool-call argument
    /// pieces, usage before the end): resets the watchdog (W3), sends
    /// nothing.
    Progress,
    /// Content progress, optionally with usage.
    Delta {
        /// Text.
        text: String,
        /// Usage observed with it.
        usage: Option<pb::Usage>,
    },
    /// Success.
    Complete {
        /// `stop`, `length`, `tool_calls`.
        finish_reason: String,
        /// Final usage.
        usage: Option<pb::Usage>,
        /// Event metadata (E4, E5).
        metadata: HashMap<String, String>,
    },
    /// Success of an embeddings run: every vector at once (the terminal).
    Embedded {
        /// The vectors, packed as `RunEvent.embeddings`
        /// ([`iop_wire::embedding`]).
        embeddings: Bytes,
        /// The length of each.
        dimensions: u32,
        /// Prompt tokens (`total` the same).
        usage: pb::Usage,
    },
    /// The provider call failed (W6).
    Failed {
        /// Failure code.
        code: &'static str,
        /// Legacy error string.
        message: String,
    },
}
