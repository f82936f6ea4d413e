//! Failure codes on `ERROR` terminals that are not stalls (W6): the
//! `failure_code` of a tunnel frame or run event, next to the legacy error
//! string. Stalls carry `response_stalled` and an `ExecutionFailure` (W4);
//! credential lease failures their own codes (`credentials`).

/// `response_stall_timeout_ms` out of range (W1).
pub const INVALID_STALL_TIMEOUT: &str = "invalid_stall_timeout";
/// The request granted a flow-control window too small to work.
pub const INVALID_FLOW_WINDOW: &str = "invalid_flow_window";
/// The adapter named by the request does not exist here.
pub const UNKNOWN_ADAPTER: &str = "unknown_adapter";
/// The operation/path could not be resolved (U3).
pub const BAD_OPERATION: &str = "bad_operation";
/// The adapter's capacity gate is full (P4).
pub const CAPACITY_EXHAUSTED: &str = "capacity_exhausted";
/// The provider could not be reached.
pub const PROVIDER_UNREACHABLE: &str = "provider_unreachable";
/// The TLS handshake with an `https://` provider failed: its certificate
/// was refused (not valid for the host name, expired, issued by an unknown
/// CA) or the handshake broke off. The message says which.
pub const PROVIDER_TLS: &str = "provider_tls";
/// The provider's response broke off or was malformed (a status that
/// cannot answer a request, such as `101 Switching Protocols`, included).
pub const PROVIDER_ERROR: &str = "provider_error";
/// The normalized input cannot be mapped to the adapter's provider request.
pub const INVALID_INPUT: &str = "invalid_input";
