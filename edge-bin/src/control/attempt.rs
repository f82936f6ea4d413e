//! What one attempt's frames show, in arrival order: whether its response
//! has been committed to the client, and how it ended. Sans-IO.
//!
//! The node connection's shell and the client's relay run one
//! [`AttemptTracker`] each over the same frames of an attempt, so they agree
//! exactly on the commit point without a message between them: Control
//! learns it from the node side (`Input::Committed`, `Terminal::committed`),
//! the relay writes nothing to the client before it.
//!
//! # What counts as committed
//!
//! - **Tunnel**: the first non-empty `BODY` after a `RESPONSE_START` below
//!   500. The response head alone commits nothing: the relay holds it until
//!   that first body byte, so a provider that sends its head and then
//!   stalls or breaks off can still be failed over. A head of 500 or more
//!   holds its body too, up to [`HOLD_MAX_BYTES`] (then it commits and goes
//!   to the client as it is).
//! - **Streamed run**: the first `delta` (the `start` event is held).
//! - **Buffered run** (a non-streaming chat completion on a normalized
//!   run): only its `complete` — the relay builds one JSON body from every
//!   event and writes it at the end, so nothing reaches the client before.
//!
//! # How an attempt ended ([`AttemptEnd`])
//!
//! | terminal | end |
//! |---|---|
//! | tunnel `END` after a head below 500, run `complete` | `Answered` |
//! | tunnel `END` after an uncommitted head of 500+ | `Failed(upstream_5xx)` |
//! | `ERROR` `provider_unreachable`, `provider_tls` | `Failed(connect_failure)` |
//! | `ERROR` `provider_error` before any response head/event | `Failed(reset_before_response)` |
//! | `ERROR` `response_stalled` | `Failed(stalled)` |
//! | `ERROR` `capacity_exhausted`, `unknown_adapter`, `bad_operation` | `Refused` |
//! | anything else (cancelled, request-shaped, credentials, …) | `Other` |
//!
//! Every failure code a Node sends (`node-bin/src/codes.rs`, the credential
//! lease codes, the watchdog's), by whether the provider got anything:
//!
//! - nothing reached it, and it is its fault: `provider_unreachable` (no
//!   connection: refused, reset, timed out, unresolvable) and
//!   `provider_tls` (the TCP connection was made but its TLS handshake
//!   failed: a certificate not valid for the name, expired or from an
//!   unknown issuer, or a handshake broken off; or a credential lease
//!   refused for a connection whose certificate is not verified). Both are
//!   a connect failure: failed over, and counted toward ejection;
//! - nothing reached it, for a reason of that node alone:
//!   `capacity_exhausted`, `unknown_adapter`, `bad_operation` (`Refused`:
//!   failed over, not counted);
//! - nothing reached it, for a reason every provider would share (the
//!   request or the Edge's settings): `invalid_stall_timeout`,
//!   `invalid_flow_window`, `invalid_input`, the credential lease codes
//!   (C5: final), `cancelled` (`Other`);
//! - the request may have reached it: `provider_error` (counted and failed
//!   over only before any response head), `response_stalled`.

use iop_wire::pb;

use crate::control::{AttemptEnd, FailureReason};

/// Most body bytes of a 5xx response held back from the client (then it
/// commits).
pub const HOLD_MAX_BYTES: usize = 64 * 1024;

/// The commit state of one attempt.
#[derive(Debug, Clone, Default)]
pub struct AttemptTracker {
    /// A buffered run: commits only at its end.
    buffered: bool,
    /// The response head's status, once seen.
    head_status: Option<u32>,
    /// A run event arrived.
    run_started: bool,
    /// Body bytes of a 5xx response held so far.
    held_bytes: usize,
    committed: bool,
}

impl AttemptTracker {
    /// A tracker for an attempt whose relay writes as frames come.
    pub fn new() -> Self {
        Self::default()
    }

    /// A tracker for a buffered run (a non-streaming chat completion over
    /// a normalized run).
    pub fn buffered() -> Self {
        Self {
            buffered: true,
            ..Self::default()
        }
    }

    /// Whether the attempt has committed.
    pub fn is_committed(&self) -> bool {
        self.committed
    }

    /// Feeds the next tunnel frame; true when this frame commits the
    /// attempt.
    pub fn on_tunnel_frame(&mut self, tf: &pb::ProviderTunnelFrame) -> bool {
        if self.committed {
            return false;
        }
        match tf.kind() {
            pb::TunnelFrameKind::ResponseStart if self.head_status.is_none() => {
                self.head_status = Some(tf.status);
                false
            }
            pb::TunnelFrameKind::Body => self.on_tunnel_body(tf.body.len()),
            _ => false,
        }
    }

    /// Feeds a tunnel `BODY` frame's body length (a chunk: the frame not
    /// built); true when this body commits the attempt.
    pub fn on_tunnel_body(&mut self, body_len: usize) -> bool {
        if self.committed || body_len == 0 {
            return false;
        }
        match self.head_status {
            Some(status) if status < 500 => self.commit(),
            Some(_) => {
                self.held_bytes = self.held_bytes.saturating_add(body_len);
                self.held_bytes > HOLD_MAX_BYTES && self.commit()
            }
            // A body before any head is never relayed.
            None => false,
        }
    }

    /// Feeds the next run event; true when this event commits the attempt.
    pub fn on_run_event(&mut self, ev: &pb::RunEvent) -> bool {
        if self.committed {
            return false;
        }
        self.run_started = true;
        match ev.r#type() {
            pb::RunEventType::Delta if !self.buffered => self.commit(),
            _ => false,
        }
    }

    fn commit(&mut self) -> bool {
        self.committed = true;
        true
    }

    /// How the attempt ended, given its terminal tunnel frame (fed to
    /// [`AttemptTracker::on_tunnel_frame`] already or not: terminals do not
    /// commit).
    pub fn end_of_tunnel(&self, tf: &pb::ProviderTunnelFrame) -> AttemptEnd {
        match tf.kind() {
            pb::TunnelFrameKind::End => match self.head_status {
                Some(status) if status >= 500 && !self.committed => {
                    AttemptEnd::Failed(FailureReason::UpstreamStatus)
                }
                Some(_) => AttemptEnd::Answered,
                // No response at all: nothing to say about the provider.
                None => AttemptEnd::Other,
            },
            _ => self.end_of_error(&tf.failure_code, self.head_status.is_some()),
        }
    }

    /// How the attempt ended, given its terminal run event.
    pub fn end_of_run(&self, ev: &pb::RunEvent) -> AttemptEnd {
        match ev.r#type() {
            pb::RunEventType::Complete => AttemptEnd::Answered,
            _ => self.end_of_error(&ev.failure_code, self.run_started),
        }
    }

    fn end_of_error(&self, code: &str, response_started: bool) -> AttemptEnd {
        match code {
            // Nothing reached the provider: the connection or its TLS
            // handshake failed.
            "provider_unreachable" | "provider_tls" => {
                AttemptEnd::Failed(FailureReason::ConnectFailure)
            }
            "provider_error" if !response_started => {
                AttemptEnd::Failed(FailureReason::ResetBeforeResponse)
            }
            "response_stalled" => AttemptEnd::Failed(FailureReason::Stalled),
            "capacity_exhausted" | "unknown_adapter" | "bad_operation" => AttemptEnd::Refused,
            _ => AttemptEnd::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn frame(kind: pb::TunnelFrameKind) -> pb::ProviderTunnelFrame {
        pb::ProviderTunnelFrame {
            kind: kind as i32,
            ..Default::default()
        }
    }

    fn head(status: u32) -> pb::ProviderTunnelFrame {
        pb::ProviderTunnelFrame {
            status,
            ..frame(pb::TunnelFrameKind::ResponseStart)
        }
    }

    fn body(len: usize) -> pb::ProviderTunnelFrame {
        pb::ProviderTunnelFrame {
            body: Bytes::from(vec![b'x'; len]),
            ..frame(pb::TunnelFrameKind::Body)
        }
    }

    fn error(code: &str) -> pb::ProviderTunnelFrame {
        pb::ProviderTunnelFrame {
            failure_code: code.into(),
            ..frame(pb::TunnelFrameKind::Error)
        }
    }

    fn event(kind: pb::RunEventType, code: &str) -> pb::RunEvent {
        pb::RunEvent {
            r#type: kind as i32,
            failure_code: code.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_tunnel_commits_at_its_first_body_byte_not_its_head() {
        let mut t = AttemptTracker::new();
        assert!(!t.on_tunnel_frame(&head(200)));
        assert!(!t.on_tunnel_frame(&body(0)));
        assert!(!t.is_committed());
        // Head, then a stall: uncommitted, retryable.
        assert_eq!(
            t.end_of_tunnel(&error("response_stalled")),
            AttemptEnd::Failed(FailureReason::Stalled)
        );
        assert!(t.on_tunnel_frame(&body(1)));
        assert!(t.is_committed());
        assert!(!t.on_tunnel_frame(&body(5)), "commits once");
        assert_eq!(
            t.end_of_tunnel(&frame(pb::TunnelFrameKind::End)),
            AttemptEnd::Answered
        );
        // A stall after the first byte is still a stall (counted), but
        // committed.
        assert_eq!(
            t.end_of_tunnel(&error("response_stalled")),
            AttemptEnd::Failed(FailureReason::Stalled)
        );
        // A reset after the response started says nothing retryable.
        assert_eq!(t.end_of_tunnel(&error("provider_error")), AttemptEnd::Other);
    }

    #[test]
    fn a_5xx_head_holds_its_body_up_to_the_bound() {
        let mut t = AttemptTracker::new();
        t.on_tunnel_frame(&head(503));
        assert!(!t.on_tunnel_frame(&body(HOLD_MAX_BYTES)));
        assert_eq!(
            t.end_of_tunnel(&frame(pb::TunnelFrameKind::End)),
            AttemptEnd::Failed(FailureReason::UpstreamStatus)
        );
        assert!(
            t.on_tunnel_frame(&body(1)),
            "one byte past the bound commits"
        );
        assert_eq!(
            t.end_of_tunnel(&frame(pb::TunnelFrameKind::End)),
            AttemptEnd::Answered
        );
        // A 4xx is the provider's answer.
        let mut t = AttemptTracker::new();
        t.on_tunnel_frame(&head(404));
        assert_eq!(
            t.end_of_tunnel(&frame(pb::TunnelFrameKind::End)),
            AttemptEnd::Answered
        );
        assert!(t.on_tunnel_frame(&body(3)));
    }

    #[test]
    fn errors_are_classified_by_failure_code() {
        let t = AttemptTracker::new();
        for (code, end) in [
            (
                "provider_unreachable",
                AttemptEnd::Failed(FailureReason::ConnectFailure),
            ),
            (
                "provider_tls",
                AttemptEnd::Failed(FailureReason::ConnectFailure),
            ),
            (
                "provider_error",
                AttemptEnd::Failed(FailureReason::ResetBeforeResponse),
            ),
            (
                "response_stalled",
                AttemptEnd::Failed(FailureReason::Stalled),
            ),
            ("capacity_exhausted", AttemptEnd::Refused),
            ("unknown_adapter", AttemptEnd::Refused),
            ("bad_operation", AttemptEnd::Refused),
            ("cancelled", AttemptEnd::Other),
            ("invalid_input", AttemptEnd::Other),
            ("invalid_stall_timeout", AttemptEnd::Other),
            ("invalid_flow_window", AttemptEnd::Other),
            ("lease_invalid", AttemptEnd::Other),
            ("", AttemptEnd::Other),
        ] {
            assert_eq!(t.end_of_tunnel(&error(code)), end, "{code}");
            assert_eq!(
                t.end_of_run(&event(pb::RunEventType::Error, code)),
                end,
                "{code}"
            );
        }
        assert_eq!(
            t.end_of_tunnel(&frame(pb::TunnelFrameKind::End)),
            AttemptEnd::Other
        );
        assert!(AttemptEnd::Refused.is_retryable());
        assert!(AttemptEnd::Failed(FailureReason::Stalled).is_retryable());
        assert!(!AttemptEnd::Other.is_retryable());
        assert!(!AttemptEnd::Answered.is_retryable());
    }

    #[test]
    fn a_streamed_run_commits_at_its_first_delta_a_buffered_one_never() {
        let mut t = AttemptTracker::new();
        assert!(!t.on_run_event(&event(pb::RunEventType::Start, "")));
        assert_eq!(
            t.end_of_run(&event(pb::RunEventType::Error, "provider_error")),
            AttemptEnd::Other,
            "the run had started"
        );
        assert!(t.on_run_event(&event(pb::RunEventType::Delta, "")));
        assert!(t.is_committed());
        let mut t = AttemptTracker::buffered();
        assert!(!t.on_run_event(&event(pb::RunEventType::Delta, "")));
        assert!(!t.on_run_event(&event(pb::RunEventType::Delta, "")));
        assert!(!t.is_committed());
        assert_eq!(
            t.end_of_run(&event(pb::RunEventType::Error, "response_stalled")),
            AttemptEnd::Failed(FailureReason::Stalled)
        );
        assert_eq!(
            t.end_of_run(&event(pb::RunEventType::Complete, "")),
            AttemptEnd::Answered
        );
    }
}
