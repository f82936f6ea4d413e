//! Ordered, exactly-once-terminal emission of tunnel frames (U1) and run
//! events (E1) — pure cores the shells drive.
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
//! [`RunEmitter`] does the same for `RunEvent`s (`start`, `delta*`, one of
//! `complete | error | cancelled`).
//!
//! Both implement [`Emitter`], the interface the attempt shell ([`super::drive`]) uses to turn
//! provider output and watchdog decisions into outbound frames.

use std::collections::HashMap;
use std::rc::Rc;

use bytes::Bytes;
use iop_wire::{flow, pb};

use super::watchdog::{self, Activity, StopCause};
use crate::calls::output::{RunOutput, TunnelOutput};

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
    /// Shared with every chunk on its way out: a reference count per
    /// token, not a copy.
    run_id: Rc<str>,
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
            run_id: Rc::from(run_id),
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

    /// The next frame of `kind`. The typed adapter/target evidence (H2)
    /// rides on `RESPONSE_START` and the terminals, the frames the Edge
    /// reads it from; `BODY` and `USAGE` frames, the bulk of a stream, carry
    /// only the run id, the sequence number and their payload.
    fn frame(&mut self, kind: pb::TunnelFrameKind) -> pb::ProviderTunnelFrame {
        let seq = self.take_seq();
        let evidence = !matches!(kind, pb::TunnelFrameKind::Body | pb::TunnelFrameKind::Usage);
        let (adapter, target) = if evidence {
            (self.adapter.clone(), self.target.clone())
        } else {
            (String::new(), String::new())
        };
        pb::ProviderTunnelFrame {
            run_id: self.run_id.to_string(),
            seq,
            kind: kind as i32,
            adapter,
            target,
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

    /// The next frame's sequence number.
    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// A `BODY` frame carrying `body` as-is (U2), as an
    /// [`Outbound::Chunk`]: no frame is built for it, and the body travels
    /// apart from the head so the writer sends it without copying it into
    /// the frame buffer. `None` before the start or after the terminal.
    pub fn body(&mut self, body: Bytes) -> Option<Outbound> {
        if self.state != EmitState::Started || body.is_empty() {
            return None;
        }
        Some(Outbound::Chunk {
            run_id: Rc::clone(&self.run_id),
            seq: self.take_seq(),
            body,
        })
    }

    /// An observation-only `USAGE` frame (U1); `None` before the start or
    /// after the terminal.
    pub fn usage(&mut self, usage: pb::Usage) -> Option<pb::ProviderTunnelFrame> {
        if self.state != EmitState::Started {
            return None;
        }
        let mut f = self.frame(pb::TunnelFrameKind::Usage);
        f.usage = Some(Box::new(usage));
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
        f.failure = failure.map(Box::new);
        Some(f)
    }
}

/// Builds the ordered events of one normalized run (E1).
#[derive(Debug)]
pub struct RunEmitter {
    run_id: String,
    adapter: String,
    target: String,
    session_id: String,
    next_seq: u64,
    state: EmitState,
}

impl RunEmitter {
    /// An emitter for run `run_id` served by `adapter`/`target`, echoing
    /// `session_id` (E3).
    pub fn new(run_id: &str, adapter: &str, target: &str, session_id: &str) -> Self {
        Self {
            run_id: run_id.to_string(),
            adapter: adapter.to_string(),
            target: target.to_string(),
            session_id: session_id.to_string(),
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

    fn event(&mut self, kind: pb::RunEventType) -> pb::RunEvent {
        let seq = self.next_seq;
        self.next_seq += 1;
        pb::RunEvent {
            run_id: self.run_id.clone(),
            seq,
            r#type: kind as i32,
            adapter: self.adapter.clone(),
            target: self.target.clone(),
            session_id: self.session_id.clone(),
            ..Default::default()
        }
    }

    /// `start`; `None` unless this is the first event.
    pub fn start(&mut self) -> Option<pb::RunEvent> {
        self.start_with(HashMap::new())
    }

    /// `start` carrying `metadata` (e.g. `openai_text_tool_fallback`, which
    /// the Edge must know before the first delta, E5); `None` unless this is
    /// the first event.
    pub fn start_with(&mut self, metadata: HashMap<String, String>) -> Option<pb::RunEvent> {
        if self.state != EmitState::Fresh {
            return None;
        }
        self.state = EmitState::Started;
        let mut e = self.event(pb::RunEventType::Start);
        e.metadata = metadata;
        Some(e)
    }

    /// A `delta` with text and optional usage; `None` before `start` or
    /// after the terminal.
    pub fn delta(&mut self, text: &str, usage: Option<pb::Usage>) -> Option<pb::RunEvent> {
        if self.state != EmitState::Started {
            return None;
        }
        let mut e = self.event(pb::RunEventType::Delta);
        e.delta = text.to_string();
        e.usage = usage.map(Box::new);
        Some(e)
    }

    /// The `complete` terminal; `None` after a terminal.
    pub fn complete(
        &mut self,
        finish_reason: &str,
        usage: Option<pb::Usage>,
        metadata: HashMap<String, String>,
    ) -> Option<pb::RunEvent> {
        if self.state == EmitState::Terminated {
            return None;
        }
        self.state = EmitState::Terminated;
        let mut e = self.event(pb::RunEventType::Complete);
        e.finish_reason = finish_reason.to_string();
        e.usage = usage.map(Box::new);
        e.metadata = metadata;
        Some(e)
    }

    /// The `error` terminal with a failure code and the legacy error string
    /// (W6) and, for stalls only, the structured failure (W4, field 13);
    /// `None` after a terminal.
    pub fn error(
        &mut self,
        failure_code: &str,
        message: &str,
        failure: Option<pb::ExecutionFailure>,
    ) -> Option<pb::RunEvent> {
        if self.state == EmitState::Terminated {
            return None;
        }
        self.state = EmitState::Terminated;
        let mut e = self.event(pb::RunEventType::Error);
        e.failure_code = failure_code.to_string();
        e.error = message.to_string();
        e.failure = failure.map(Box::new);
        Some(e)
    }

    /// The `complete` terminal of an embeddings run, carrying its vectors;
    /// `None` after a terminal.
    pub fn embedded(
        &mut self,
        embeddings: Bytes,
        dimensions: u32,
        usage: pb::Usage,
    ) -> Option<pb::RunEvent> {
        let mut e = self.complete("stop", Some(usage), HashMap::new())?;
        e.embeddings = embeddings;
        e.embedding_dimensions = dimensions;
        Some(e)
    }

    /// The `cancelled` terminal (K1); `None` after a terminal.
    pub fn cancelled(&mut self, message: &str) -> Option<pb::RunEvent> {
        if self.state == EmitState::Terminated {
            return None;
        }
        self.state = EmitState::Terminated;
        let mut e = self.event(pb::RunEventType::Cancelled);
        e.failure_code = StopCause::Cancelled.failure_code().to_string();
        e.error = message.to_string();
        Some(e)
    }
}

/// A frame ready for the connection.
// Both variants hold a frame and move once, straight to the connection;
// boxing would cost an allocation per frame.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Outbound {
    /// A whole frame (bulk lane).
    Frame(pb::Frame),
    /// A tunnel `BODY` frame with no field but these (every token a
    /// provider streams), encoded with no frame built; the body travels
    /// without a copy.
    Chunk {
        /// The tunnel's run id.
        run_id: Rc<str>,
        /// The frame's sequence number (U1).
        seq: u64,
        /// The provider's bytes.
        body: Bytes,
    },
}

impl Outbound {
    /// A tunnel frame.
    pub fn tunnel(f: pb::ProviderTunnelFrame) -> Self {
        Outbound::Frame(pb::Frame {
            body: Some(pb::frame::Body::ProviderTunnelFrame(Box::new(f))),
        })
    }

    /// A run event.
    pub fn run(e: pb::RunEvent) -> Self {
        Outbound::Frame(pb::Frame {
            body: Some(pb::frame::Body::RunEvent(Box::new(e))),
        })
    }

    /// The frame this sends.
    pub fn into_frame(self) -> pb::Frame {
        match self {
            Outbound::Frame(frame) => frame,
            Outbound::Chunk { run_id, seq, body } => pb::Frame {
                body: Some(pb::frame::Body::ProviderTunnelFrame(Box::new(
                    iop_wire::TunnelChunk::new(&run_id, seq, body).into_tunnel_frame(),
                ))),
            },
        }
    }
}

/// What the watchdog driver needs from an emitter: classify provider output
/// (W3), turn it into frames, and build the terminals the watchdog decides.
/// Every method returns `None` when the emitter refuses (after its terminal).
pub trait Emitter {
    /// What the provider side of the attempt produces.
    type Output;

    /// The output's meaning to the watchdog (W3).
    fn activity(output: &Self::Output) -> Activity;

    /// The flow-control charge of the frame this output becomes
    /// (`iop_wire::flow`): payload bytes plus the per-frame part for body,
    /// usage and delta frames, 0 for everything else.
    fn charge(output: &Self::Output) -> u64;

    /// Splits off the head of `output` carrying at most `max_payload`
    /// payload bytes, leaving the rest in `output`; `None` when it cannot
    /// be split there (nothing fits, or it carries no payload).
    fn split_off(output: &mut Self::Output, max_payload: u64) -> Option<Self::Output>;

    /// The frame for a forwarded output.
    fn forward(&mut self, output: Self::Output) -> Option<Outbound>;

    /// The stall terminal (W4): `failure_code=response_stalled`, the legacy
    /// message and the `ExecutionFailure`.
    fn stall(&mut self, message: &str, failure: pb::ExecutionFailure) -> Option<Outbound>;

    /// The terminal of a stop cause (W9, K1, F5; no `ExecutionFailure`, W6).
    fn stopped(&mut self, cause: StopCause) -> Option<Outbound>;

    /// A non-stall failure terminal (W6).
    fn failed(&mut self, code: &str, message: &str) -> Option<Outbound>;

    /// What a traced call's span notes of the output (read only while
    /// tracing is on).
    fn trace_note(output: &Self::Output) -> TraceNote;
}

/// What an output means to the provider call's span
/// ([`crate::trace::ProviderSpan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceNote {
    /// Bytes from the provider: its first byte, when it is the first; a
    /// response head carries its HTTP status.
    Provider {
        /// The response status, on a tunnel's response head.
        status: Option<u16>,
    },
    /// The call failed with this code (W6).
    Failed(&'static str),
    /// Nothing the provider sent (an upload's credit).
    Local,
}

impl Emitter for TunnelEmitter {
    type Output = TunnelOutput;

    fn activity(output: &TunnelOutput) -> Activity {
        let (kind, body_bytes) = match output {
            TunnelOutput::Start { .. } => (pb::TunnelFrameKind::ResponseStart, 0),
            TunnelOutput::Body(b) => (pb::TunnelFrameKind::Body, b.len()),
            TunnelOutput::Usage(_) => (pb::TunnelFrameKind::Usage, 0),
            TunnelOutput::UploadCredit(_) => return Activity::Progress,
            TunnelOutput::End => (pb::TunnelFrameKind::End, 0),
            TunnelOutput::Failed { .. } => (pb::TunnelFrameKind::Error, 0),
        };
        watchdog::tunnel_activity(kind, body_bytes)
    }

    fn charge(output: &TunnelOutput) -> u64 {
        match output {
            TunnelOutput::Body(b) => flow::tunnel_frame_charge(pb::TunnelFrameKind::Body, b.len()),
            TunnelOutput::Usage(_) => flow::tunnel_frame_charge(pb::TunnelFrameKind::Usage, 0),
            _ => 0,
        }
    }

    fn split_off(output: &mut TunnelOutput, max_payload: u64) -> Option<TunnelOutput> {
        let TunnelOutput::Body(body) = output else {
            return None;
        };
        let cut = usize::try_from(max_payload)
            .unwrap_or(usize::MAX)
            .min(body.len());
        if cut == 0 || cut == body.len() {
            return None;
        }
        // A slice of the same buffer: no copy.
        Some(TunnelOutput::Body(body.split_to(cut)))
    }

    fn forward(&mut self, output: TunnelOutput) -> Option<Outbound> {
        match output {
            TunnelOutput::Start { status, headers } => {
                self.response_start(status, headers).map(Outbound::tunnel)
            }
            TunnelOutput::Body(body) => self.body(body),
            TunnelOutput::Usage(usage) => self.usage(usage).map(Outbound::tunnel),
            TunnelOutput::UploadCredit(max_offset) => (!self.is_terminated()).then(|| {
                Outbound::Frame(pb::Frame {
                    body: Some(pb::frame::Body::FlowCredit(pb::FlowCredit {
                        credits: vec![pb::RunCredit {
                            run_id: self.run_id.to_string(),
                            max_offset,
                        }],
                    })),
                })
            }),
            TunnelOutput::End => match self.end() {
                Some(f) => Some(Outbound::tunnel(f)),
                // END before RESPONSE_START cannot be relayed: still one terminal.
                None => self
                    .error(
                        crate::codes::PROVIDER_ERROR,
                        "the provider response ended before it started",
                        None,
                    )
                    .map(Outbound::tunnel),
            },
            TunnelOutput::Failed { code, message } => {
                self.error(code, &message, None).map(Outbound::tunnel)
            }
        }
    }

    fn stall(&mut self, message: &str, failure: pb::ExecutionFailure) -> Option<Outbound> {
        self.error(watchdog::FAILURE_RESPONSE_STALLED, message, Some(failure))
            .map(Outbound::tunnel)
    }

    fn stopped(&mut self, cause: StopCause) -> Option<Outbound> {
        self.error(cause.failure_code(), cause.message(), None)
            .map(Outbound::tunnel)
    }

    fn failed(&mut self, code: &str, message: &str) -> Option<Outbound> {
        self.error(code, message, None).map(Outbound::tunnel)
    }

    fn trace_note(output: &TunnelOutput) -> TraceNote {
        match output {
            TunnelOutput::Start { status, .. } => TraceNote::Provider {
                status: Some(*status),
            },
            TunnelOutput::Body(_) | TunnelOutput::Usage(_) | TunnelOutput::End => {
                TraceNote::Provider { status: None }
            }
            TunnelOutput::Failed { code, .. } => TraceNote::Failed(code),
            TunnelOutput::UploadCredit(_) => TraceNote::Local,
        }
    }
}

impl Emitter for RunEmitter {
    type Output = RunOutput;

    fn activity(output: &RunOutput) -> Activity {
        match output {
            RunOutput::Start { .. } => {
                watchdog::run_event_activity(pb::RunEventType::Start, 0, false)
            }
            RunOutput::Progress => Activity::Progress,
            RunOutput::Delta { text, usage } => {
                watchdog::run_event_activity(pb::RunEventType::Delta, text.len(), usage.is_some())
            }
            RunOutput::Complete { usage, .. } => {
                watchdog::run_event_activity(pb::RunEventType::Complete, 0, usage.is_some())
            }
            RunOutput::Embedded { .. } => {
                watchdog::run_event_activity(pb::RunEventType::Complete, 0, true)
            }
            RunOutput::Failed { .. } => {
                watchdog::run_event_activity(pb::RunEventType::Error, 0, false)
            }
        }
    }

    fn charge(output: &RunOutput) -> u64 {
        match output {
            RunOutput::Delta { text, .. } => {
                flow::run_event_charge(pb::RunEventType::Delta, text.len())
            }
            _ => 0,
        }
    }

    fn split_off(output: &mut RunOutput, max_payload: u64) -> Option<RunOutput> {
        let RunOutput::Delta { text, .. } = output else {
            return None;
        };
        let mut cut = usize::try_from(max_payload)
            .unwrap_or(usize::MAX)
            .min(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut == 0 || cut == text.len() {
            return None;
        }
        // The head carries no usage: usage stays with the delta's end.
        let rest = text.split_off(cut);
        let head = std::mem::replace(text, rest);
        Some(RunOutput::Delta {
            text: head,
            usage: None,
        })
    }

    fn forward(&mut self, output: RunOutput) -> Option<Outbound> {
        let event = match output {
            RunOutput::Start { metadata } => self.start_with(metadata),
            RunOutput::Progress => None,
            RunOutput::Delta { text, usage } => self.delta(&text, usage),
            RunOutput::Complete {
                finish_reason,
                usage,
                metadata,
            } => self.complete(&finish_reason, usage, metadata),
            RunOutput::Embedded {
                embeddings,
                dimensions,
                usage,
            } => self.embedded(embeddings, dimensions, usage),
            RunOutput::Failed { code, message } => self.error(code, &message, None),
        };
        event.map(Outbound::run)
    }

    fn stall(&mut self, message: &str, failure: pb::ExecutionFailure) -> Option<Outbound> {
        self.error(watchdog::FAILURE_RESPONSE_STALLED, message, Some(failure))
            .map(Outbound::run)
    }

    fn stopped(&mut self, cause: StopCause) -> Option<Outbound> {
        let event = match cause {
            StopCause::Cancelled => self.cancelled(cause.message()),
            StopCause::SessionEnded | StopCause::DeadlineExceeded => {
                self.error(cause.failure_code(), cause.message(), None)
            }
        };
        event.map(Outbound::run)
    }

    fn failed(&mut self, code: &str, message: &str) -> Option<Outbound> {
        self.error(code, message, None).map(Outbound::run)
    }

    fn trace_note(output: &RunOutput) -> TraceNote {
        match output {
            RunOutput::Failed { code, .. } => TraceNote::Failed(code),
            _ => TraceNote::Provider { status: None },
        }
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
        let Some(pb::frame::Body::ProviderTunnelFrame(f)) = e
            .body(Bytes::from_static(b"data: 1\n\n"))
            .unwrap()
            .into_frame()
            .body
        else {
            panic!("a body is a tunnel frame");
        };
        assert_eq!(&f.body[..], b"data: 1\n\n");
        out.push(pb::ProviderTunnelFrame {
            body: Bytes::new(),
            ..*f
        });
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
        assert!(out.iter().all(|f| f.run_id == "run-1"));
        // H2 evidence on the head and the terminal; bulk frames go without.
        let evidence: Vec<(&str, &str)> = out
            .iter()
            .map(|f| (f.adapter.as_str(), f.target.as_str()))
            .collect();
        assert_eq!(
            evidence,
            vec![("vllm", "llama"), ("", ""), ("", ""), ("vllm", "llama")]
        );
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

    // CONTRACT: E1, W6 — start, deltas, exactly one terminal with strictly
    // increasing seq; nothing after it; a non-stall error has no failure.
    #[test]
    fn run_events_are_ordered_and_terminal_is_final() {
        let mut e = RunEmitter::new("run-9", "ollama", "llama3", "sess-1");
        assert!(e.delta("early", None).is_none());
        let start = e.start().unwrap();
        assert!(e.start().is_none());
        let delta = e.delta("hi", None).unwrap();
        let err = e.error("provider_error", "reset", None).unwrap();
        assert!(e.complete("stop", None, HashMap::new()).is_none());
        assert!(e.cancelled("late").is_none());
        assert!(e.delta("late", None).is_none());
        let got: Vec<(u64, pb::RunEventType)> = [&start, &delta, &err]
            .iter()
            .map(|ev| (ev.seq, ev.r#type()))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, pb::RunEventType::Start),
                (2, pb::RunEventType::Delta),
                (3, pb::RunEventType::Error)
            ]
        );
        assert_eq!(delta.delta, "hi");
        assert_eq!(err.failure_code, "provider_error");
        assert_eq!(err.error, "reset");
        assert!(err.failure.is_none());
        assert!([&start, &delta, &err].iter().all(|ev| ev.run_id == "run-9"
            && ev.adapter == "ollama"
            && ev.target == "llama3"
            && ev.session_id == "sess-1"));
    }

    // CONTRACT: K1 — a cancelled run ends with one `cancelled` terminal.
    #[test]
    fn run_cancel_is_a_cancelled_terminal() {
        let mut e = RunEmitter::new("r", "a", "t", "");
        let Some(Outbound::Frame(pb::Frame {
            body: Some(pb::frame::Body::RunEvent(ev)),
        })) = e.stopped(StopCause::Cancelled)
        else {
            panic!("expected a run event");
        };
        assert_eq!(ev.r#type(), pb::RunEventType::Cancelled);
        assert_eq!(ev.failure_code, "cancelled");
        assert_eq!(ev.seq, 1);
        assert!(e.stopped(StopCause::SessionEnded).is_none());
    }

    // CONTRACT: U1 — an END before RESPONSE_START still yields exactly one
    // terminal (an ERROR), never zero.
    #[test]
    fn tunnel_end_before_start_becomes_one_error() {
        let mut e = TunnelEmitter::new("r", "a", "t");
        let Some(Outbound::Frame(pb::Frame {
            body: Some(pb::frame::Body::ProviderTunnelFrame(f)),
        })) = e.forward(TunnelOutput::End)
        else {
            panic!("expected a tunnel frame");
        };
        assert_eq!(f.kind(), pb::TunnelFrameKind::Error);
        assert_eq!(f.seq, 1);
        assert!(e.forward(TunnelOutput::End).is_none());
    }
}
