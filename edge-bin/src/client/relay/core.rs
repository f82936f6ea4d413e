//! The relay's decisions, sans-IO: fed the reply's events of one attempt,
//! a [`Relay`] says what to write to the client, what to credit back to the
//! node, and how the attempt ends. No socket, no clock, no `Edge`: the
//! shell in `relay/mod.rs` performs the steps.
//!
//! # What the core decides
//!
//! - **The commit point** ([`AttemptTracker`], the same one the node side
//!   runs): nothing reaches the client before it. A tunnel commits at its
//!   first body byte after a head below 500, or past
//!   [`HOLD_MAX_BYTES`](crate::control::attempt::HOLD_MAX_BYTES) of a 5xx
//!   body; a streamed run at its first delta; a buffered run at its end.
//! - **The held head and body**: the provider's response head waits for the
//!   first body byte and goes out with it in one write
//!   ([`Head::Provider`]); a 5xx head holds its body until the end, then is
//!   written as it is unless Control retries; a streamed run holds its
//!   events before the first delta and translates them, in order, at the
//!   commit.
//! - **The retry**: a failure before the commit that another provider may
//!   take waits for Control's verdict ([`Step::AwaitVerdict`]): a
//!   [`ReplyEvent::Retry`] ends the relay with the next dispatch, a
//!   [`ReplyEvent::Lost`] (or the reply's end) answers the failure. A
//!   failure after the commit is never retried.
//! - **How a failure reaches the client** ([`FailAs`]): an HTTP error before
//!   the response started, the error's SSE event inside a started event
//!   stream, a broken-off body otherwise. Overflow (the client drained too
//!   slowly) and node loss are failures like any other; an overflow also
//!   cuts the relay off ([`Failure::cuts_off`]).
//! - **Credit**: every event taken off the reply is credited back with its
//!   charge once its bytes are written (or held, or dropped): frames of an
//!   older attempt, of the wrong kind, or queued behind a failure only
//!   that.
//!
//! # The step protocol
//!
//! ```text
//!   loop {
//!       next = reply.recv()            // watched for the client leaving
//!       relay.handle(next, run_id)     //   while !relay.is_started()
//!       while let Some(step) = relay.poll() { perform(step) }
//!   }
//! ```
//!
//! Call [`Relay::handle`] with each event the reply gives (`None`: the
//! reply ended) and the run id the reply follows now, then [`Relay::poll`]
//! until it returns `None` before the next `handle`. One event's steps come
//! in this order, each at most once unless noted:
//!
//! `Usage` → `WriteHead` → `Release` → `WriteChunk`* (held output) →
//! `WriteChunk` (+ `Relayed`)* (this event's output) → `Relayed` → `Credit` →
//! one of `AwaitVerdict`, `Retry`, `Answer`, `Fail`, `Finish`.
//!
//! `Retry`, `Answer`, `Fail` and `Finish` end the relay: nothing more is fed.
//! The hot path may first call [`Relay::take_body`]: for a started
//! tunnel's body frame (`WriteChunk`, `Relayed`, `Credit` and nothing else)
//! it hands the three at once.
//! Bytes are moved, never copied: a tunnel body goes from the reply's frame
//! to [`Step::WriteChunk`] as the same [`Bytes`], with no allocation per
//! frame.

use std::collections::VecDeque;

use bytes::Bytes;
use iop_wire::pb;

use crate::api::embeddings::{Embedded, EmbeddingsAnswer};
use crate::api::error::GatewayError;
use crate::api::translate::{ChunkStream, Completion, CompletionBuilder, ResponseId};
use crate::control::attempt::AttemptTracker;
use crate::control::{AbortReason, Dispatch};
use crate::link::replies::ReplyEvent;

/// One thing for the shell to do, in the order [`Relay::poll`] gives them.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Record the provider's token usage (access log, usage file, limits).
    Usage(pb::Usage),
    /// Start the client's response.
    WriteHead(Head),
    /// The attempt committed: the reply drops what it kept of the request
    /// for another attempt.
    Release,
    /// Write these bytes as the next piece of the started response.
    WriteChunk(Bytes),
    /// A chunk of the event just taken reached the client (relay latency);
    /// `body_bytes` of a tunnel body were relayed with it.
    Relayed { body_bytes: u64 },
    /// Credit the node with this charge (`ReplyRx::drained`).
    Credit(u64),
    /// The attempt failed before the commit and another provider may take
    /// it: keep feeding the reply's events until Control's verdict.
    AwaitVerdict,
    /// Control dispatched the request again: relay this attempt instead.
    /// Ends the relay.
    Retry(Box<Dispatch>),
    /// A buffered run's whole answer: 200 with this JSON body. Ends the
    /// relay.
    Answer(Bytes),
    /// Answer the failure (boxed: once per request). Ends the relay.
    Fail(Box<Failure>),
    /// End the started response. Ends the relay.
    Finish,
}

/// How the client's response starts.
#[derive(Debug, PartialEq)]
pub(crate) enum Head {
    /// The provider's held response head (its status and relayed headers),
    /// written with `first`, its first body bytes (possibly none), in one
    /// write.
    Provider {
        head: Box<pb::ProviderTunnelFrame>,
        first: Bytes,
    },
    /// A normalized run's chunk stream: 200, `text/event-stream`.
    EventStream,
}

/// A failure the relay ends with.
#[derive(Debug, PartialEq)]
pub(crate) struct Failure {
    pub error: GatewayError,
    pub shape: FailAs,
    /// The client drained too slowly ([`ReplyEvent::Overflow`]): the relay
    /// ends with the cut-off error whatever the answer's write did, so the
    /// connection closes and the run is cancelled.
    pub cuts_off: bool,
}

/// How a failure reaches the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailAs {
    /// Nothing was sent yet: an HTTP error in the route's shape.
    Response,
    /// Inside a started event stream: the error's SSE event, then the
    /// stream's end.
    SseEvent,
    /// Inside a started plain body, which cannot carry an error: cut short,
    /// so the client sees an incomplete response, not a complete one.
    BreakOff,
}

/// The relay of one attempt (see the module docs).
#[derive(Debug)]
pub(crate) struct Relay {
    form: Form,
    tracker: AttemptTracker,
    phase: Phase,
    /// The client's response started (its head was written).
    started: bool,
    /// The response is (or will be) an event stream: a failure after the
    /// start can be told as an SSE event.
    event_stream: bool,
    out: Outbox,
}

/// What the relay makes of the attempt's frames.
#[derive(Debug)]
enum Form {
    /// Tunnel frames, relayed as the provider sent them.
    Tunnel {
        /// The provider's response head, held until the commit.
        head: Option<Box<pb::ProviderTunnelFrame>>,
        /// Body of a 5xx head, held (and already credited) until it commits
        /// or ends.
        held: VecDeque<Bytes>,
    },
    /// A normalized run, as `chat.completion.chunk` SSE.
    Stream {
        chunks: ChunkStream,
        /// Events before the first delta (its `start`), held until the
        /// commit.
        held: Vec<pb::RunEvent>,
    },
    /// A normalized run, answered as one `chat.completion`.
    Buffered { builder: CompletionBuilder },
    /// An embeddings run, answered as one OpenAI embeddings list.
    Embeddings { answer: EmbeddingsAnswer },
}

#[derive(Debug)]
enum Phase {
    Relaying,
    /// Waiting for Control's verdict on a failure before the commit; this
    /// is the answer when no retry comes.
    AwaitingVerdict(Fallback),
    /// A step that ends the relay was given.
    Ended,
}

#[derive(Debug)]
enum Fallback {
    Fail(Box<GatewayError>),
    /// A tunnel's held 5xx response, written as it is.
    HeldResponse,
}

/// One event's steps, not yet polled (see the order in the module docs).
#[derive(Debug, Default)]
struct Outbox {
    usage: Option<pb::Usage>,
    head: Option<Head>,
    release: bool,
    /// Output held until the commit (a 5xx body, a run's held events).
    earlier: VecDeque<Bytes>,
    /// A tunnel body (empty: none).
    body: Bytes,
    /// A run event's chunks, each followed by `Relayed`.
    chunks: std::vec::IntoIter<Bytes>,
    chunk_written: bool,
    relayed: Option<u64>,
    credit: u64,
    last: Option<Step>,
}

impl Relay {
    /// The relay of a tunnel attempt.
    pub(crate) fn tunnel() -> Self {
        Self::new(
            Form::Tunnel {
                head: None,
                held: VecDeque::new(),
            },
            AttemptTracker::new(),
            false,
        )
    }

    /// The relay of a normalized run streamed as chunks.
    pub(crate) fn stream(id: ResponseId, include_usage: bool) -> Self {
        Self::new(
            Form::Stream {
                chunks: ChunkStream::new(id, include_usage),
                held: Vec::new(),
            },
            AttemptTracker::new(),
            true,
        )
    }

    /// The relay of a normalized run answered as one completion.
    pub(crate) fn buffered(id: ResponseId) -> Self {
        Self::new(
            Form::Buffered {
                builder: CompletionBuilder::new(id),
            },
            AttemptTracker::buffered(),
            false,
        )
    }

    /// The relay of an embeddings run (answered at its end, as a buffered
    /// run).
    pub(crate) fn embeddings(answer: EmbeddingsAnswer) -> Self {
        Self::new(
            Form::Embeddings { answer },
            AttemptTracker::buffered(),
            false,
        )
    }

    fn new(form: Form, tracker: AttemptTracker, event_stream: bool) -> Self {
        Self {
            form,
            tracker,
            phase: Phase::Relaying,
            started: false,
            event_stream,
            out: Outbox::default(),
        }
    }

    /// Whether the client's response started. Until then the shell watches
    /// for the client leaving while it waits for the next event.
    pub(crate) fn is_started(&self) -> bool {
        self.started
    }

    /// Takes the reply's next event (`None`: the reply ended); `run_id` is
    /// the run the reply follows now. Then [`Relay::poll`] until `None`.
    #[inline]
    pub(crate) fn handle(&mut self, next: Option<ReplyEvent>, run_id: &str) {
        debug_assert!(
            self.out.is_empty(),
            "handle before the last steps were polled"
        );
        let charge = next.as_ref().map_or(0, ReplyEvent::charge);
        match self.phase {
            Phase::Ended => debug_assert!(false, "an event after the relay ended"),
            Phase::AwaitingVerdict(_) => self.on_verdict_event(next, charge),
            Phase::Relaying => match next {
                Some(ReplyEvent::Chunk(chunk))
                    if chunk.run_id() == run_id && matches!(self.form, Form::Tunnel { .. }) =>
                {
                    self.on_tunnel_body(chunk.body, charge)
                }
                Some(ReplyEvent::Tunnel(tf))
                    if tf.run_id == run_id && matches!(self.form, Form::Tunnel { .. }) =>
                {
                    self.on_tunnel_frame(tf, charge)
                }
                Some(ReplyEvent::Run(ev))
                    if ev.run_id == run_id && !matches!(self.form, Form::Tunnel { .. }) =>
                {
                    self.on_run_event(ev, charge)
                }
                // Another attempt's, or not this relay's kind: nothing for
                // this one.
                Some(ReplyEvent::Tunnel(_) | ReplyEvent::Chunk(_) | ReplyEvent::Run(_)) => {
                    self.out.credit = charge
                }
                // Control never retries a committed attempt.
                Some(ReplyEvent::Retry(next)) if !self.started => self.end(Step::Retry(next)),
                Some(ReplyEvent::Retry(_)) => {}
                // A streamed upload's late credit: the upload is over.
                Some(ReplyEvent::UploadCredit(_)) => {}
                Some(ReplyEvent::Aborted(reason)) => self.fail(aborted(reason), false),
                Some(ReplyEvent::Overflow) => self.fail(GatewayError::client_too_slow(), true),
                Some(ReplyEvent::Lost) | None => self.fail(GatewayError::node_lost(), false),
            },
        }
    }

    /// The relay's hot path: when the last event left exactly
    /// `WriteChunk(body)`, `Relayed { body_bytes }` and (unless zero)
    /// `Credit(charge)` — a body frame of a started tunnel — takes them in
    /// one call as `(body, body_bytes, charge)`, leaving nothing to poll.
    /// Otherwise `None`, and [`Relay::poll`] gives the steps.
    pub(crate) fn take_body(&mut self) -> Option<(Bytes, u64, u64)> {
        let out = &mut self.out;
        let plain = !out.body.is_empty()
            && out.relayed.is_some()
            && out.usage.is_none()
            && out.head.is_none()
            && !out.release
            && out.earlier.is_empty()
            && !out.chunk_written
            && out.chunks.len() == 0
            && out.last.is_none();
        if !plain {
            return None;
        }
        let body_bytes = out.relayed.take()?;
        Some((
            std::mem::take(&mut out.body),
            body_bytes,
            std::mem::take(&mut out.credit),
        ))
    }

    /// The next step of the last event handled; `None` once they are all
    /// given (then feed the next event, unless a step ended the relay).
    pub(crate) fn poll(&mut self) -> Option<Step> {
        let out = &mut self.out;
        if let Some(usage) = out.usage.take() {
            return Some(Step::Usage(usage));
        }
        if let Some(head) = out.head.take() {
            return Some(Step::WriteHead(head));
        }
        if std::mem::take(&mut out.release) {
            return Some(Step::Release);
        }
        if let Some(bytes) = out.earlier.pop_front() {
            if out.earlier.is_empty() {
                // Hold no room for the rest of the stream.
                out.earlier = VecDeque::new();
            }
            return Some(Step::WriteChunk(bytes));
        }
        if !out.body.is_empty() {
            return Some(Step::WriteChunk(std::mem::take(&mut out.body)));
        }
        if std::mem::take(&mut out.chunk_written) {
            return Some(Step::Relayed { body_bytes: 0 });
        }
        if let Some(chunk) = out.chunks.next() {
            out.chunk_written = true;
            return Some(Step::WriteChunk(chunk));
        }
        if let Some(body_bytes) = out.relayed.take() {
            return Some(Step::Relayed { body_bytes });
        }
        if out.credit > 0 {
            return Some(Step::Credit(std::mem::take(&mut out.credit)));
        }
        out.last.take()
    }

    fn on_tunnel_frame(&mut self, mut tf: Box<pb::ProviderTunnelFrame>, charge: u64) {
        if tf.kind() == pb::TunnelFrameKind::Body {
            return self.on_tunnel_body(std::mem::take(&mut tf.body), charge);
        }
        // A head or a terminal never commits the attempt; the tracker
        // learns the head's status from it.
        self.tracker.on_tunnel_frame(&tf);
        let Form::Tunnel { head, .. } = &mut self.form else {
            return;
        };
        match tf.kind() {
            pb::TunnelFrameKind::ResponseStart => {
                if !self.started && head.is_none() {
                    self.event_stream = is_event_stream(&tf);
                    *head = Some(tf);
                }
            }
            // Taken by `on_tunnel_body` above.
            pb::TunnelFrameKind::Body => {}
            pb::TunnelFrameKind::Usage | pb::TunnelFrameKind::Unspecified => {
                self.out.usage = tf.usage.as_deref().copied();
                self.out.credit = charge;
            }
            pb::TunnelFrameKind::End => {
                if self.started {
                    self.end(Step::Finish);
                } else if self.tracker.end_of_tunnel(&tf).is_retryable() {
                    self.await_verdict(Fallback::HeldResponse);
                } else {
                    self.answer_held();
                }
            }
            pb::TunnelFrameKind::Error => {
                let retryable = !self.started && self.tracker.end_of_tunnel(&tf).is_retryable();
                let e = GatewayError::provider_failure(
                    failure_code(&tf.failure_code),
                    &tf.error,
                    retryable,
                );
                self.fail_or_await(e);
            }
        }
    }

    /// A tunnel `BODY` frame's body (a chunk, or a frame's).
    fn on_tunnel_body(&mut self, mut body: Bytes, charge: u64) {
        let commits = self.tracker.on_tunnel_body(body.len());
        let Form::Tunnel { head, held } = &mut self.form else {
            return;
        };
        let body_bytes = body.len() as u64;
        if commits {
            if let Some(head) = head.take() {
                // The head goes out with the first body bytes, in one write
                // (one wake-up of the client, not two).
                let first = held
                    .pop_front()
                    .unwrap_or_else(|| std::mem::take(&mut body));
                self.out.head = Some(Head::Provider { head, first });
            }
            self.started = true;
            self.out.release = true;
            self.out.earlier = std::mem::take(held);
        }
        if self.started {
            self.out.body = body;
            self.out.relayed = Some(body_bytes);
        } else if head.is_some() && !body.is_empty() {
            held.push_back(body);
        }
        self.out.credit = charge;
    }

    fn on_run_event(&mut self, ev: Box<pb::RunEvent>, charge: u64) {
        let commits = self.tracker.on_run_event(&ev);
        self.out.usage = ev.usage.as_deref().copied();
        match &mut self.form {
            Form::Tunnel { .. } => {}
            Form::Buffered { builder } => {
                let done = builder.on_event(&ev);
                // The builder took it: the node may send more.
                self.out.credit = charge;
                match done {
                    Some(Completion::Done(v)) => self.end(Step::Answer(Bytes::from(v.to_string()))),
                    Some(Completion::Failed { code, message }) => {
                        let retryable = self.tracker.end_of_run(&ev).is_retryable();
                        self.fail_or_await(GatewayError::provider_failure(
                            &code, &message, retryable,
                        ));
                    }
                    None => {}
                }
            }
            Form::Embeddings { answer } => {
                let done = answer.on_event(&ev);
                self.out.credit = charge;
                match done {
                    Some(Embedded::Done(body)) => self.end(Step::Answer(body)),
                    Some(Embedded::Failed { code, message }) => {
                        let retryable = self.tracker.end_of_run(&ev).is_retryable();
                        self.fail_or_await(GatewayError::provider_failure(
                            &code, &message, retryable,
                        ));
                    }
                    None => {}
                }
            }
            Form::Stream { chunks, held } => {
                let is_error = matches!(
                    ev.r#type(),
                    pb::RunEventType::Error | pb::RunEventType::Cancelled
                );
                if !self.started && is_error {
                    // Nothing was sent yet: another provider may take it,
                    // or the client gets an HTTP error.
                    let retryable = self.tracker.end_of_run(&ev).is_retryable();
                    let e = GatewayError::provider_failure(
                        failure_code(&ev.failure_code),
                        &ev.error,
                        retryable,
                    );
                    return self.fail_or_await(e);
                }
                if !self.started && !commits && ev.r#type() != pb::RunEventType::Complete {
                    held.push(*ev);
                    self.out.credit = charge;
                    return;
                }
                if !self.started {
                    self.started = true;
                    self.out.head = Some(Head::EventStream);
                    self.out.release = true;
                    self.out.earlier = std::mem::take(held)
                        .iter()
                        .flat_map(|earlier| chunks.on_event(earlier))
                        .collect();
                }
                self.out.chunks = chunks.on_event(&ev).into_iter();
                self.out.credit = charge;
                if chunks.is_finished() {
                    self.end(Step::Finish);
                }
            }
        }
    }

    /// While waiting for Control's verdict: everything on the reply but the
    /// verdict belongs to the failed attempt (credited only).
    fn on_verdict_event(&mut self, next: Option<ReplyEvent>, charge: u64) {
        match next {
            Some(ReplyEvent::Retry(next)) => self.end(Step::Retry(next)),
            Some(ReplyEvent::Lost) | None => {
                // The request ended there: the failure stands.
                let phase = std::mem::replace(&mut self.phase, Phase::Relaying);
                match phase {
                    Phase::AwaitingVerdict(Fallback::Fail(e)) => self.fail(*e, false),
                    _ => self.answer_held(),
                }
            }
            Some(_) => self.out.credit = charge,
        }
    }

    /// Answers a tunnel's held response as it is (a 5xx that no other
    /// provider could take, or an empty body), or `no_response` when the
    /// provider sent no head.
    fn answer_held(&mut self) {
        let Form::Tunnel { head, held } = &mut self.form else {
            return self.fail(GatewayError::no_response(), false);
        };
        let Some(head) = head.take() else {
            return self.fail(GatewayError::no_response(), false);
        };
        let first = held.pop_front().unwrap_or_default();
        self.out.head = Some(Head::Provider { head, first });
        self.out.earlier = std::mem::take(held);
        self.out.relayed = Some(0);
        self.end(Step::Finish);
    }

    /// A failure: retryable ones (before the commit only) wait for
    /// Control's verdict; the others are answered.
    fn fail_or_await(&mut self, e: GatewayError) {
        if e.retryable {
            self.await_verdict(Fallback::Fail(Box::new(e)));
        } else {
            self.fail(e, false);
        }
    }

    fn await_verdict(&mut self, fallback: Fallback) {
        debug_assert!(!self.started, "a verdict awaited after the commit");
        self.phase = Phase::AwaitingVerdict(fallback);
        self.out.last = Some(Step::AwaitVerdict);
    }

    fn fail(&mut self, error: GatewayError, cuts_off: bool) {
        let shape = match (self.started, self.event_stream) {
            (false, _) => FailAs::Response,
            (true, true) => FailAs::SseEvent,
            (true, false) => FailAs::BreakOff,
        };
        self.end(Step::Fail(Box::new(Failure {
            error,
            shape,
            cuts_off,
        })));
    }

    fn end(&mut self, last: Step) {
        self.phase = Phase::Ended;
        self.out.last = Some(last);
    }
}

impl Outbox {
    fn is_empty(&self) -> bool {
        self.usage.is_none()
            && self.head.is_none()
            && !self.release
            && self.earlier.is_empty()
            && self.body.is_empty()
            && self.chunks.len() == 0
            && !self.chunk_written
            && self.relayed.is_none()
            && self.credit == 0
            && self.last.is_none()
    }
}

/// The error of an attempt Control gave up on (U6): the run is already
/// cancelled on its node.
fn aborted(reason: AbortReason) -> GatewayError {
    match reason {
        AbortReason::ResponseWaitTimeout => GatewayError::response_wait_timeout(),
    }
}

fn failure_code(code: &str) -> &str {
    if code.is_empty() {
        "provider_error"
    } else {
        code
    }
}

fn is_event_stream(head: &pb::ProviderTunnelFrame) -> bool {
    head.headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("content-type") && h.value.starts_with(b"text/event-stream")
    })
}

#[cfg(test)]
mod tests {
    use iop_wire::flow::FRAME_CHARGE_BYTES as F;

    use super::*;
    use crate::control::attempt::HOLD_MAX_BYTES;
    use crate::control::{ConnId, DispatchKind, Generation, ProviderKey, ProviderLease, RequestId};

    const RUN: &str = "run-1";

    fn frame(kind: pb::TunnelFrameKind, run: &str) -> Box<pb::ProviderTunnelFrame> {
        Box::new(pb::ProviderTunnelFrame {
            run_id: run.into(),
            kind: kind as i32,
            ..Default::default()
        })
    }

    fn head_of(status: u32, content_type: &'static str, run: &str) -> Box<pb::ProviderTunnelFrame> {
        let mut head = frame(pb::TunnelFrameKind::ResponseStart, run);
        head.status = status;
        head.headers = vec![pb::Header {
            name: "Content-Type".into(),
            value: Bytes::from_static(content_type.as_bytes()),
        }];
        head
    }

    fn head(status: u32, content_type: &'static str) -> ReplyEvent {
        ReplyEvent::Tunnel(head_of(status, content_type, RUN))
    }

    fn body_of(bytes: Bytes, run: &str) -> ReplyEvent {
        let mut tf = frame(pb::TunnelFrameKind::Body, run);
        tf.body = bytes;
        ReplyEvent::Tunnel(tf)
    }

    fn body(bytes: &'static [u8]) -> ReplyEvent {
        body_of(Bytes::from_static(bytes), RUN)
    }

    fn end() -> ReplyEvent {
        ReplyEvent::Tunnel(frame(pb::TunnelFrameKind::End, RUN))
    }

    fn error(code: &str) -> ReplyEvent {
        let mut tf = frame(pb::TunnelFrameKind::Error, RUN);
        tf.failure_code = code.into();
        tf.error = "upstream said no".into();
        ReplyEvent::Tunnel(tf)
    }

    fn usage(prompt_tokens: u64, completion_tokens: u64) -> pb::Usage {
        pb::Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }

    fn run_event(kind: pb::RunEventType, delta: &str) -> pb::RunEvent {
        pb::RunEvent {
            run_id: RUN.into(),
            r#type: kind as i32,
            delta: delta.into(),
            ..Default::default()
        }
    }

    fn run(kind: pb::RunEventType, delta: &str) -> ReplyEvent {
        ReplyEvent::Run(Box::new(run_event(kind, delta)))
    }

    fn run_error(code: &str) -> ReplyEvent {
        let mut ev = run_event(pb::RunEventType::Error, "");
        ev.failure_code = code.into();
        ev.error = "upstream said no".into();
        ReplyEvent::Run(Box::new(ev))
    }

    fn complete(usage: Option<pb::Usage>) -> ReplyEvent {
        let mut ev = run_event(pb::RunEventType::Complete, "");
        ev.finish_reason = "stop".into();
        ev.usage = usage.map(Box::new);
        ReplyEvent::Run(Box::new(ev))
    }

    fn id() -> ResponseId {
        ResponseId {
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
        }
    }

    fn dispatch(run: &str) -> Box<Dispatch> {
        Box::new(Dispatch {
            request: RequestId(1),
            lease: ProviderLease {
                request: RequestId(1),
                run_id: run.into(),
                provider: ProviderKey {
                    node_id: "node-b".into(),
                    provider_id: "p".into(),
                },
                conn: ConnId(2),
                generation: Generation(1),
                adapter: "openai".into(),
                target: "m".into(),
                long: false,
            },
            kind: DispatchKind::Tunnel,
            response_stall_timeout_ms: 0,
            strips_usage_chunk: false,
            accepts_tunnel_body: false,
        })
    }

    /// Feeds `event` (for the reply following `run`) and takes every step.
    fn feed_for(relay: &mut Relay, event: Option<ReplyEvent>, run: &str) -> Vec<Step> {
        relay.handle(event, run);
        std::iter::from_fn(|| relay.poll()).collect()
    }

    fn feed(relay: &mut Relay, event: ReplyEvent) -> Vec<Step> {
        feed_for(relay, Some(event), RUN)
    }

    fn fail(error: GatewayError, shape: FailAs, cuts_off: bool) -> Step {
        Step::Fail(Box::new(Failure {
            error,
            shape,
            cuts_off,
        }))
    }

    fn chunk(s: &str) -> Step {
        Step::WriteChunk(Bytes::copy_from_slice(s.as_bytes()))
    }

    const JSON: &str = "application/json";
    const SSE: &str = "text/event-stream; charset=utf-8";

    #[test]
    fn take_body_gives_what_poll_would_for_a_plain_body_frame_and_nothing_else() {
        let (mut polled, mut taken) = (Relay::tunnel(), Relay::tunnel());
        // The committing frame writes the head: not a plain body.
        for relay in [&mut polled, &mut taken] {
            relay.handle(Some(head(200, SSE)), RUN);
            assert_eq!(relay.take_body(), None);
            relay.handle(Some(body(b"data: 1\n\n")), RUN);
        }
        assert_eq!(taken.take_body(), None);
        assert_eq!(
            std::iter::from_fn(|| taken.poll()).count(),
            std::iter::from_fn(|| polled.poll()).count()
        );
        // A body frame of the started tunnel: one call, the same three steps.
        let next = Bytes::from_static(b"data: 2\n\n");
        assert_eq!(
            feed(&mut polled, body_of(next.clone(), RUN)),
            [
                Step::WriteChunk(next.clone()),
                Step::Relayed { body_bytes: 9 },
                Step::Credit(F + 9),
            ]
        );
        taken.handle(Some(body_of(next.clone(), RUN)), RUN);
        let (bytes, body_bytes, credit) = taken.take_body().expect("a plain body");
        assert_eq!((&bytes, body_bytes, credit), (&next, 9, F + 9));
        assert_eq!(bytes.as_ptr(), next.as_ptr());
        assert_eq!(taken.poll(), None);
        // Usage and the end are not bodies.
        taken.handle(
            Some(ReplyEvent::Tunnel(frame(pb::TunnelFrameKind::End, RUN))),
            RUN,
        );
        assert_eq!(taken.take_body(), None);
        assert_eq!(taken.poll(), Some(Step::Finish));
    }

    #[test]
    fn a_tunnel_commits_at_its_first_body_byte_head_and_first_in_one_step() {
        let mut relay = Relay::tunnel();
        assert_eq!(feed(&mut relay, head(200, JSON)), []);
        // An empty body commits nothing, and is only credited.
        assert_eq!(feed(&mut relay, body(b"")), [Step::Credit(F)]);
        assert!(!relay.is_started());
        let first = Bytes::from_static(b"{\"a\"");
        let steps = feed(&mut relay, body_of(first.clone(), RUN));
        assert_eq!(
            steps,
            [
                Step::WriteHead(Head::Provider {
                    head: head_of(200, JSON, RUN),
                    first: first.clone(),
                }),
                Step::Release,
                Step::Relayed { body_bytes: 4 },
                Step::Credit(F + 4),
            ]
        );
        assert!(relay.is_started());
        // Moved, not copied: the client is written the reply's own bytes.
        let Step::WriteHead(Head::Provider { first: written, .. }) = &steps[0] else {
            unreachable!()
        };
        assert_eq!(written.as_ptr(), first.as_ptr());
        let rest = Bytes::from_static(b":1}");
        let steps = feed(&mut relay, body_of(rest.clone(), RUN));
        assert_eq!(
            steps,
            [
                Step::WriteChunk(rest.clone()),
                Step::Relayed { body_bytes: 3 },
                Step::Credit(F + 3),
            ]
        );
        let Step::WriteChunk(written) = &steps[0] else {
            unreachable!()
        };
        assert_eq!(written.as_ptr(), rest.as_ptr());
        // Usage is recorded and credited, and writes nothing.
        let mut tf = frame(pb::TunnelFrameKind::Usage, RUN);
        tf.usage = Some(Box::new(usage(5, 9)));
        assert_eq!(
            feed(&mut relay, ReplyEvent::Tunnel(tf)),
            [Step::Usage(usage(5, 9)), Step::Credit(F)]
        );
        assert_eq!(feed(&mut relay, end()), [Step::Finish]);
    }

    #[test]
    fn a_5xx_head_holds_its_body_to_the_end_then_is_written_as_it_is() {
        let mut relay = Relay::tunnel();
        assert_eq!(feed(&mut relay, head(503, JSON)), []);
        assert_eq!(
            feed(&mut relay, body(b"{\"error\":")),
            [Step::Credit(F + 9)]
        );
        assert_eq!(feed(&mut relay, body(b"\"busy\"}")), [Step::Credit(F + 7)]);
        assert!(!relay.is_started());
        // upstream_5xx: another provider may take it.
        assert_eq!(feed(&mut relay, end()), [Step::AwaitVerdict]);
        // No retry came: the provider's answer as it is, never released.
        assert_eq!(
            feed_for(&mut relay, Some(ReplyEvent::Lost), RUN),
            [
                Step::WriteHead(Head::Provider {
                    head: head_of(503, JSON, RUN),
                    first: Bytes::from_static(b"{\"error\":"),
                }),
                chunk("\"busy\"}"),
                Step::Relayed { body_bytes: 0 },
                Step::Finish,
            ]
        );
    }

    #[test]
    fn a_5xx_body_past_the_hold_bound_commits_with_its_held_bytes_first() {
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(500, JSON));
        let held = Bytes::from(vec![b'x'; HOLD_MAX_BYTES]);
        let charge = F + HOLD_MAX_BYTES as u64;
        assert_eq!(
            feed(&mut relay, body_of(held.clone(), RUN)),
            [Step::Credit(charge)]
        );
        assert_eq!(
            feed(&mut relay, body(b"y")),
            [
                Step::WriteHead(Head::Provider {
                    head: head_of(500, JSON, RUN),
                    first: held,
                }),
                Step::Release,
                chunk("y"),
                Step::Relayed { body_bytes: 1 },
                Step::Credit(F + 1),
            ]
        );
        assert_eq!(feed(&mut relay, end()), [Step::Finish]);
    }

    #[test]
    fn a_tunnel_end_without_a_head_is_no_response() {
        let mut relay = Relay::tunnel();
        // A body before any head is never relayed.
        assert_eq!(feed(&mut relay, body(b"x")), [Step::Credit(F + 1)]);
        assert_eq!(
            feed(&mut relay, end()),
            [fail(GatewayError::no_response(), FailAs::Response, false)]
        );
    }

    #[test]
    fn a_failure_before_the_commit_awaits_the_verdict_then_the_retry_is_relayed() {
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(200, SSE));
        assert_eq!(
            feed(&mut relay, error("response_stalled")),
            [Step::AwaitVerdict]
        );
        // Queued behind the failure: the failed attempt's, credited only
        // (its own frames and notices alike).
        assert_eq!(feed(&mut relay, body(b"late")), [Step::Credit(F + 4)]);
        assert_eq!(feed(&mut relay, ReplyEvent::Overflow), []);
        assert_eq!(
            feed(&mut relay, ReplyEvent::Retry(dispatch("run-2"))),
            [Step::Retry(dispatch("run-2"))]
        );
        // The next attempt's relay follows run-2: run-1's stale frames are
        // only credited, run-2's are relayed.
        let mut relay = Relay::tunnel();
        let next = |relay: &mut Relay, event| feed_for(relay, Some(event), "run-2");
        assert_eq!(
            next(&mut relay, body_of(Bytes::from_static(b"old"), RUN)),
            [Step::Credit(F + 3)]
        );
        assert_eq!(
            next(&mut relay, ReplyEvent::Tunnel(head_of(200, JSON, "run-2"))),
            []
        );
        assert_eq!(
            next(&mut relay, body_of(Bytes::from_static(b"new"), "run-2")),
            [
                Step::WriteHead(Head::Provider {
                    head: head_of(200, JSON, "run-2"),
                    first: Bytes::from_static(b"new"),
                }),
                Step::Release,
                Step::Relayed { body_bytes: 3 },
                Step::Credit(F + 3),
            ]
        );
    }

    #[test]
    fn a_failure_that_no_verdict_retries_is_answered() {
        let mut relay = Relay::tunnel();
        assert_eq!(
            feed(&mut relay, error("provider_unreachable")),
            [Step::AwaitVerdict]
        );
        assert_eq!(
            feed_for(&mut relay, None, RUN),
            [fail(
                GatewayError::provider_failure("provider_unreachable", "upstream said no", true),
                FailAs::Response,
                false,
            )]
        );
        // Not retryable (every provider would refuse it): answered at once.
        let mut relay = Relay::tunnel();
        assert_eq!(
            feed(&mut relay, error("invalid_input")),
            [fail(
                GatewayError::provider_failure("invalid_input", "upstream said no", false),
                FailAs::Response,
                false,
            )]
        );
    }

    #[test]
    fn no_retry_after_the_commit_the_failure_is_told_in_the_stream() {
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(200, SSE));
        feed(&mut relay, body(b"data: {}\n\n"));
        assert!(relay.is_started());
        // Control never retries a committed attempt; a stray one is ignored.
        assert_eq!(feed(&mut relay, ReplyEvent::Retry(dispatch("run-2"))), []);
        assert_eq!(
            feed(&mut relay, error("response_stalled")),
            [fail(
                GatewayError::provider_failure("response_stalled", "upstream said no", false),
                FailAs::SseEvent,
                false,
            )]
        );
        // A plain body cannot carry it: broken off.
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(200, JSON));
        feed(&mut relay, body(b"{"));
        assert_eq!(
            feed(&mut relay, error("provider_error")),
            [fail(
                GatewayError::provider_failure("provider_error", "upstream said no", false),
                FailAs::BreakOff,
                false,
            )]
        );
    }

    #[test]
    fn an_overflow_cuts_the_relay_off() {
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(200, SSE));
        assert_eq!(
            feed(&mut relay, ReplyEvent::Overflow),
            [fail(
                GatewayError::client_too_slow(),
                FailAs::Response,
                true
            )]
        );
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(200, SSE));
        feed(&mut relay, body(b"data: {}\n\n"));
        assert_eq!(
            feed(&mut relay, ReplyEvent::Overflow),
            [fail(
                GatewayError::client_too_slow(),
                FailAs::SseEvent,
                true
            )]
        );
    }

    #[test]
    fn a_lost_node_fails_the_relay_before_and_after_the_start() {
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(200, JSON));
        assert_eq!(
            feed(&mut relay, ReplyEvent::Lost),
            [fail(GatewayError::node_lost(), FailAs::Response, false)]
        );
        // The reply's end is a loss too.
        let mut relay = Relay::stream(id(), false);
        assert_eq!(
            feed_for(&mut relay, None, RUN),
            [fail(GatewayError::node_lost(), FailAs::Response, false)]
        );
        let mut relay = Relay::tunnel();
        feed(&mut relay, head(200, JSON));
        feed(&mut relay, body(b"{"));
        assert_eq!(
            feed(&mut relay, ReplyEvent::Lost),
            [fail(GatewayError::node_lost(), FailAs::BreakOff, false)]
        );
        let mut relay = Relay::stream(id(), false);
        feed(&mut relay, run(pb::RunEventType::Delta, "Hi"));
        assert_eq!(
            feed(&mut relay, ReplyEvent::Lost),
            [fail(GatewayError::node_lost(), FailAs::SseEvent, false)]
        );
    }

    #[test]
    fn an_abort_answers_the_response_wait_timeout() {
        let mut relay = Relay::buffered(id());
        assert_eq!(
            feed(
                &mut relay,
                ReplyEvent::Aborted(AbortReason::ResponseWaitTimeout)
            ),
            [fail(
                GatewayError::response_wait_timeout(),
                FailAs::Response,
                false
            )]
        );
    }

    const ROLE: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\
        \"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\
        \"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";

    const STOP: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\
        \"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\
        \"finish_reason\":\"stop\"}]}\n\n";

    fn content(text: &str) -> String {
        format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\
             \"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\
             \"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
        )
    }

    #[test]
    fn a_runs_held_events_are_flushed_in_order_at_the_commit() {
        let mut relay = Relay::stream(id(), false);
        // `start` is held (charged nothing).
        assert_eq!(feed(&mut relay, run(pb::RunEventType::Start, "")), []);
        assert!(!relay.is_started());
        assert_eq!(
            feed(&mut relay, run(pb::RunEventType::Delta, "Hi")),
            [
                Step::WriteHead(Head::EventStream),
                Step::Release,
                chunk(ROLE),
                chunk(&content("Hi")),
                Step::Relayed { body_bytes: 0 },
                Step::Credit(F + 2),
            ]
        );
        assert_eq!(
            feed(&mut relay, run(pb::RunEventType::Delta, "!")),
            [
                chunk(&content("!")),
                Step::Relayed { body_bytes: 0 },
                Step::Credit(F + 1),
            ]
        );
        // Usage is recorded before the chunks go out.
        assert_eq!(
            feed(&mut relay, complete(Some(usage(3, 2)))),
            [
                Step::Usage(usage(3, 2)),
                chunk(STOP),
                Step::Relayed { body_bytes: 0 },
                chunk("data: [DONE]\n\n"),
                Step::Relayed { body_bytes: 0 },
                Step::Finish,
            ]
        );
    }

    #[test]
    fn a_run_that_fails_before_its_first_delta_awaits_the_verdict() {
        let mut relay = Relay::stream(id(), false);
        feed(&mut relay, run(pb::RunEventType::Start, ""));
        assert_eq!(
            feed(&mut relay, run_error("response_stalled")),
            [Step::AwaitVerdict]
        );
        assert_eq!(
            feed(&mut relay, run(pb::RunEventType::Delta, "late")),
            [Step::Credit(F + 4)]
        );
        assert_eq!(
            feed(&mut relay, ReplyEvent::Retry(dispatch("run-2"))),
            [Step::Retry(dispatch("run-2"))]
        );
        // After the first delta an error is the stream's own SSE error.
        let mut relay = Relay::stream(id(), false);
        feed(&mut relay, run(pb::RunEventType::Delta, "Hi"));
        assert_eq!(
            feed(&mut relay, run_error("response_stalled")),
            [
                chunk(
                    "data: {\"error\":{\"message\":\"upstream said no\",\"type\":\"upstream_error\",\
                     \"param\":null,\"code\":\"response_stalled\"}}\n\ndata: [DONE]\n\n"
                ),
                Step::Relayed { body_bytes: 0 },
                Step::Finish,
            ]
        );
    }

    #[test]
    fn a_buffered_run_answers_once_with_its_usage_recorded() {
        let mut relay = Relay::buffered(id());
        assert_eq!(
            feed(&mut relay, run(pb::RunEventType::Delta, "Hel")),
            [Step::Credit(F + 3)]
        );
        assert_eq!(
            feed(&mut relay, run(pb::RunEventType::Delta, "lo")),
            [Step::Credit(F + 2)]
        );
        assert!(!relay.is_started());
        assert_eq!(
            feed(&mut relay, complete(Some(usage(4, 2)))),
            [
                Step::Usage(usage(4, 2)),
                Step::Answer(Bytes::from_static(
                    b"{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\",\"created\":7,\
                      \"model\":\"m\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\
                      \"content\":\"Hello\"},\"logprobs\":null,\"finish_reason\":\"stop\"}],\
                      \"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,\"total_tokens\":6}}"
                )),
            ]
        );
        // Refused by its node: retried elsewhere, or answered.
        let mut relay = Relay::buffered(id());
        feed(&mut relay, run(pb::RunEventType::Delta, "Hel"));
        assert_eq!(
            feed(&mut relay, run_error("capacity_exhausted")),
            [Step::AwaitVerdict]
        );
        assert_eq!(
            feed(&mut relay, ReplyEvent::Lost),
            [fail(
                GatewayError::provider_failure("capacity_exhausted", "upstream said no", true),
                FailAs::Response,
                false,
            )]
        );
    }
}
