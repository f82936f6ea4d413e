//! Ordered, exactly-once-terminal emission of tunnel frames (U1) — a pure
//! core the tunnel shell drives.
//!
//! ```text
//!            response_start        body*/usage*           end | error
//!  Fresh ───────────────────► Started ───────────► Started ───────────► Terminated
//!    └────────────────────────── error ───────────────────────────────────┘
//! ```
//!
//! Every emitted frame gets the next `seq` (1, 2, 3, …). Anything offered
//! after the terminal is dropped (late output, W10), and a second
//! `RESPONSE_START` or a body before the start is refused rather than sent.

use bytes::Bytes;
use iop_wire::pb;

/// Where a tunnel's emission stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmitState {
    /// Nothing sent yet.
    Fresh,
    /// `RESPONSE_START` sent.
    Started,
    /// The terminal (`END` or `ERROR`) sent; nothing more will be.
    Terminated,
}

/// Builds the ordered frames of one tunnel.
#[derive(Debug)]
pub struct TunnelEmitter {
    run_id: String,
    adapter: String,
    target: String,
    next_seq: u64,
    state: EmitState,
}

impl TunnelEmitter {
    /// An emitter for tunnel `run_id` served by `adapter`/`target` (the typed
    /// evidence the Edge checks, H2).
    pub fn new(run_id: &str, adapter: &str, target: &str) -> Self {
        Self {
            run_id: run_id.to_string(),
            adapter: adapter.to_string(),
            target: target.to_string(),
            next_seq: 1,
            state: EmitState::Fresh,
        }
    }

    /// Current state.
    pub fn state(&self) -> EmitState {
        self.state
    }

    /// Whether the terminal was emitted.
    pub fn is_terminated(&self) -> bool {
        self.state == EmitState::Terminated
    }

    fn frame(&mut self, kind: pb::TunnelFrameKind) -> pb::ProviderTunnelFrame {
        let seq = self.next_seq;
        self.next_seq += 1;
        pb::ProviderTunnelFrame {
            run_id: self.run_id.clone(),
            seq,
            kind: kind as i32,
            adapter: self.adapter.clone(),
            target: self.target.clone(),
            ..Default::default()
        }
    }

    /// `RESPONSE_START` with the provider's status and headers; `None` unless
    /// this is the first frame.
    pub fn response_start(
        &mut self,
        status: u16,
        headers: Vec<pb::Header>,
    ) -> Option<pb::ProviderTunnelFrame> {
        if self.state != EmitState::Fresh {
            return None;
        }
        self.state = EmitState::Started;
        let mut f = self.frame(pb::TunnelFrameKind::ResponseStart);
        f.status = u32::from(status);
        f.headers = headers;
        Some(f)
    }

    /// A `BODY` frame carrying `body` as-is (U2); `None` before the start or
    /// after the terminal. The body is returned separately from the frame so
    /// the writer can send it without copying it into the frame buffer.
    pub fn body(&mut self, body: Bytes) -> Option<(pb::ProviderTunnelFrame, Bytes)> {
        if self.state != EmitState::Started || body.is_empty() {
            return None;
        }
        Some((self.frame(pb::TunnelFrameKind::Body), body))
    }

    /// An observation-only `USAGE` frame (U1); `None` before the start or
    /// after the terminal.
    pub fn usage(&mut self, usage: pb::Usage) -> Option<pb::ProviderTunnelFrame> {
        if self.state != EmitState::Started {
            return None;
        }
        let mut f = self.frame(pb::TunnelFrameKind::Usage);
        f.usage = Some(usage);
        Some(f)
    }

    /// The `END` terminal; `None` before the start or after a terminal.
    pub fn end(&mut self) -> Option<pb::ProviderTunnelFrame> {
        if self.state != EmitState::Started {
            return None;
        }
        self.state = EmitState::Terminated;
        Some(self.frame(pb::TunnelFrameKind::End))
    }

    /// The `ERROR` terminal with a failure code and the legacy error string
    /// (W6) and, for stalls only, the structured failure (W4); `None` after a
    /// terminal.
    pub fn error(
        &mut self,
        failure_code: &str,
        message: &str,
        failure: Option<pb::ExecutionFailure>,
    ) -> Option<pb::ProviderTunnelFrame> {
        if self.state == EmitState::Terminated {
            return None;
        }
        self.state = EmitState::Terminated;
        let mut f = self.frame(pb::TunnelFrameKind::Error);
        f.failure_code = failure_code.to_string();
        f.error = message.to_string();
        f.failure = failure;
        Some(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(frames: &[pb::ProviderTunnelFrame]) -> Vec<(u64, pb::TunnelFrameKind)> {
        frames.iter().map(|f| (f.seq, f.kind())).collect()
    }

    // CONTRACT: U1 — one RESPONSE_START, BODY*, exactly one terminal, strictly
    // increasing seq, nothing after the terminal.
    #[test]
    fn frames_are_ordered_and_terminal_is_final() {
        use pb::TunnelFrameKind::*;
        let mut e = TunnelEmitter::new("run-1", "vllm", "llama");
        let mut out = Vec::new();
        assert!(e.body(Bytes::from_static(b"early")).is_none());
        assert!(e.end().is_none());
        out.push(e.response_start(200, vec![]).unwrap());
        assert!(e.response_start(200, vec![]).is_none());
        let (f, body) = e.body(Bytes::from_static(b"data: 1\n\n")).unwrap();
        assert_eq!(&body[..], b"data: 1\n\n");
        out.push(f);
        out.push(
            e.usage(pb::Usage {
                prompt_tokens: 1,
                completion_tokens: 2,
                total_tokens: 3,
            })
            .unwrap(),
        );
        out.push(e.end().unwrap());
        assert!(e.body(Bytes::from_static(b"late")).is_none());
        assert!(e.error("x", "y", None).is_none());
        assert!(e.end().is_none());
        assert_eq!(
            kinds(&out),
            vec![(1, ResponseStart), (2, Body), (3, Usage), (4, End)]
        );
        assert!(out
            .iter()
            .all(|f| f.run_id == "run-1" && f.adapter == "vllm" && f.target == "llama"));
    }

    // CONTRACT: U1, W6 — an error before the start is the one terminal and
    // carries the legacy error string without an ExecutionFailure.
    #[test]
    fn error_before_start_is_the_terminal() {
        let mut e = TunnelEmitter::new("run-2", "a", "t");
        let f = e
            .error("provider_unreachable", "connect refused", None)
            .unwrap();
        assert_eq!(f.seq, 1);
        assert_eq!(f.kind(), pb::TunnelFrameKind::Error);
        assert_eq!(f.failure_code, "provider_unreachable");
        assert_eq!(f.error, "connect refused");
        assert!(f.failure.is_none());
        assert!(e.response_start(200, vec![]).is_none());
        assert!(e.is_terminated());
    }
}
