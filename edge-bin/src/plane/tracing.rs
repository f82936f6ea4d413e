//! The trace of one client request (`[tracing]`, `docs/tracing.md`): its
//! spans while it runs, as a few instants and ids, and the spans exported
//! when it ends — if it was sampled, or ended in error.
//!
//! ```text
//!  request read ─► RequestTrace::begin (the client's traceparent, or a new trace)
//!  admission    ─► queue_wait span (submit → answer)
//!  each attempt ─► dispatch span (answer or retry → sent to the node);
//!                  its TraceContext goes to the node on the wire
//!  line written ─► finish: sampled or error? ─► SpanRecords ─► exporter
//!
//!  request span (server, parent = the client's span)
//!   ├─ queue_wait
//!   └─ dispatch ── (node) provider_call ── (provider's own spans)
//! ```
//!
//! Only a request the Edge read has a trace (one refused before its head
//! was read has none). A trace exists only while tracing is on: off, the
//! connection's `Option` stays `None` and nothing here runs.

use std::time::Instant;

use bytes::Bytes;
use iop_engine::http::Header;
use iop_engine::trace::context::{tracestate, FLAG_SAMPLED};
use iop_engine::trace::{
    should_export, Attr, SpanId, SpanKind, SpanRecord, SpanStart, Timeline, TraceId, TraceParent,
    Tracer,
};
use iop_wire::pb;

/// The request header carrying the caller's trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// The request header carrying vendor trace state.
pub const TRACESTATE_HEADER: &str = "tracestate";
/// Dispatch spans kept per request at most (one per attempt; a request
/// that fails over more often keeps its first ones).
pub const DISPATCH_SPANS_MAX: usize = 8;

/// A start and, once it ended, an end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Interval {
    start: Instant,
    end: Option<Instant>,
}

/// One attempt's dispatch: its span, the provider it went to, and whether
/// the node got it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DispatchSpan {
    span_id: SpanId,
    at: Interval,
    node: String,
    provider: String,
    run_id: String,
    sent: bool,
}

/// How a request ended, as the access line says it.
#[derive(Debug, Clone, Copy)]
pub struct RequestEnd<'a> {
    /// The route's span name: method and path.
    pub method: &'a str,
    /// Request path (no query).
    pub path: &'a str,
    /// The response status, if one was written.
    pub status: Option<u16>,
    /// The outcome (`completed`, an error code, `client_disconnect`).
    pub outcome: &'a str,
    /// The model the client named.
    pub model: Option<&'a str>,
    /// The request id.
    pub request_id: &'a str,
}

impl RequestEnd<'_> {
    /// Whether the request ended in error, so its trace is exported
    /// whatever the sampler said: a 5xx or 429 answer, no answer, or a
    /// response that broke off after it started. A 4xx the client caused
    /// (bad body, unknown model, no key) is not: a client could otherwise
    /// have every one of its requests exported.
    pub fn is_error(&self) -> bool {
        match self.status {
            None => true,
            Some(s) if s >= 500 || s == 429 => true,
            Some(200..=399) => self.outcome != "completed",
            Some(_) => false,
        }
    }
}

/// The trace of one request while it runs.
#[derive(Debug)]
pub struct RequestTrace {
    trace_id: TraceId,
    span_id: SpanId,
    /// The client's span, when it sent a valid `traceparent`.
    parent: Option<SpanId>,
    sampled: bool,
    tracestate: Option<String>,
    timeline: Timeline,
    started_at: Instant,
    queue: Option<(SpanId, Interval)>,
    /// Where the next dispatch span starts: the admission answer.
    dispatch_from: Option<Instant>,
    dispatches: Vec<DispatchSpan>,
}

impl RequestTrace {
    /// The trace of a request read at `now` (`unix_ms` on the wall clock)
    /// with `headers`: a child of the client's span when it sent exactly
    /// one valid `traceparent` (with its `tracestate`), else a new trace.
    pub fn begin(tracer: &Tracer, headers: &[Header], now: Instant, unix_ms: i64) -> Box<Self> {
        let mut parents = headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(TRACEPARENT_HEADER));
        let parent = match (parents.next(), parents.next()) {
            (Some(h), None) => TraceParent::parse(&h.value).ok(),
            _ => None,
        };
        let state = parent.and_then(|_| {
            tracestate(
                headers
                    .iter()
                    .filter(|h| h.name.eq_ignore_ascii_case(TRACESTATE_HEADER))
                    .map(|h| &h.value[..]),
            )
        });
        let SpanStart {
            trace_id,
            span_id,
            sampled,
        } = tracer.begin(parent.as_ref());
        Box::new(Self {
            trace_id,
            span_id,
            parent: parent.map(|p| p.parent_id),
            sampled,
            tracestate: state,
            timeline: Timeline::new(now, unix_ms),
            started_at: now,
            queue: None,
            dispatch_from: None,
            dispatches: Vec::new(),
        })
    }

    /// The trace id (the access log's `trace_id`).
    pub fn trace_id(&self) -> TraceId {
        self.trace_id
    }

    /// The request's own span (the server span).
    pub fn span_id(&self) -> SpanId {
        self.span_id
    }

    /// The head decision.
    pub fn sampled(&self) -> bool {
        self.sampled
    }

    /// The request waited for admission from `submitted_at` to `now`.
    pub fn queue_wait(&mut self, tracer: &Tracer, submitted_at: Instant, now: Instant) {
        if self.queue.is_none() {
            tracer.started(1);
            let span_id = tracer.ids().span_id();
            let at = Interval {
                start: submitted_at,
                end: Some(now),
            };
            self.queue = Some((span_id, at));
            self.dispatch_from = Some(now);
        }
    }

    /// An attempt is being sent to `node`'s `provider` as run `run_id` at
    /// `now`: starts its dispatch span and returns the trace context the
    /// node gets (`None` past [`DISPATCH_SPANS_MAX`] attempts: that
    /// attempt's node starts no span under this trace).
    pub fn dispatch(
        &mut self,
        tracer: &Tracer,
        now: Instant,
        node: &str,
        provider: &str,
        run_id: &str,
    ) -> Option<pb::TraceContext> {
        if self.dispatches.len() >= DISPATCH_SPANS_MAX {
            return None;
        }
        tracer.started(1);
        let span_id = tracer.ids().span_id();
        let start = self.dispatch_from.take().unwrap_or(now).min(now);
        self.dispatches.push(DispatchSpan {
            span_id,
            at: Interval { start, end: None },
            node: node.to_owned(),
            provider: provider.to_owned(),
            run_id: run_id.to_owned(),
            sent: false,
        });
        Some(pb::TraceContext {
            trace_id: Bytes::copy_from_slice(&self.trace_id.0),
            parent_span_id: Bytes::copy_from_slice(&span_id.0),
            flags: if self.sampled {
                u32::from(FLAG_SAMPLED)
            } else {
                0
            },
            tracestate: self.tracestate.clone().unwrap_or_default(),
        })
    }

    /// The last dispatch ended at `now`: the node has the run (`sent`), or
    /// its connection was gone.
    pub fn dispatched(&mut self, now: Instant, sent: bool) {
        if let Some(last) = self.dispatches.last_mut() {
            if last.at.end.is_none() {
                last.at.end = Some(now);
                last.sent = sent;
            }
        }
    }

    /// The request ended at `now` as `end` says: its spans when they are
    /// to be exported (sampled, or an error), else `None`.
    pub fn finish(self, now: Instant, end: &RequestEnd<'_>) -> Option<Vec<SpanRecord>> {
        let error = end.is_error();
        if !should_export(self.sampled, error) {
            return None;
        }
        let ns = |at: Instant| self.timeline.unix_ns(at);
        let record = |span_id, parent_id, name: String, kind, at: Interval| SpanRecord {
            trace_id: self.trace_id,
            span_id,
            parent_id,
            tracestate: self.tracestate.clone(),
            name,
            kind,
            start_unix_ns: ns(at.start),
            end_unix_ns: ns(at.end.unwrap_or(now)),
            attributes: Vec::new(),
            events: Vec::new(),
            error: None,
        };
        let mut spans = Vec::with_capacity(2 + self.dispatches.len());
        let mut request = record(
            self.span_id,
            self.parent,
            format!("{} {}", end.method, end.path),
            SpanKind::Server,
            Interval {
                start: self.started_at,
                end: Some(now),
            },
        );
        request
            .attributes
            .push(Attr::str("http.request.method", end.method));
        request.attributes.push(Attr::str("url.path", end.path));
        if let Some(status) = end.status {
            request
                .attributes
                .push(Attr::int("http.response.status_code", status.into()));
        }
        request
            .attributes
            .push(Attr::str("iop.outcome", end.outcome));
        request
            .attributes
            .push(Attr::str("iop.request_id", end.request_id));
        if let Some(model) = end.model {
            request
                .attributes
                .push(Attr::str("gen_ai.request.model", model));
        }
        if error {
            request.error = Some(end.outcome.to_owned());
        }
        spans.push(request);
        if let Some((span_id, queue)) = self.queue {
            spans.push(record(
                span_id,
                Some(self.span_id),
                "queue_wait".into(),
                SpanKind::Internal,
                queue,
            ));
        }
        for d in &self.dispatches {
            let mut span = record(
                d.span_id,
                Some(self.span_id),
                "dispatch".into(),
                SpanKind::Internal,
                d.at,
            );
            span.attributes.push(Attr::str("iop.node", d.node.as_str()));
            span.attributes
                .push(Attr::str("iop.provider", d.provider.as_str()));
            span.attributes
                .push(Attr::str("iop.run_id", d.run_id.as_str()));
            if !d.sent {
                span.error = Some("node_unavailable".into());
            }
            spans.push(span);
        }
        Some(spans)
    }
}

/// Sets `ctx` on the run `frame` carries (a tunnel or a normalized run).
pub fn set_trace(frame: &mut pb::Frame, ctx: pb::TraceContext) {
    match &mut frame.body {
        Some(pb::frame::Body::ProviderTunnelRequest(t)) => t.trace = Some(ctx),
        Some(pb::frame::Body::RunRequest(r)) => r.trace = Some(ctx),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use iop_engine::clock::{Clock, ManualClock};
    use iop_engine::metrics::Side;
    use iop_engine::rng::SplitMix64;
    use iop_engine::trace::export::channel;
    use iop_engine::trace::Sampler;

    use super::*;

    fn tracer(ratio: f64) -> Tracer {
        let (handle, _rx) = channel(Side::Edge, 8);
        Tracer::new(Sampler::new(ratio), SplitMix64::new(5), handle)
    }

    fn header(name: &str, value: &str) -> Header {
        Header {
            name: name.into(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        }
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn end(status: Option<u16>, outcome: &'static str) -> RequestEnd<'static> {
        RequestEnd {
            method: "POST",
            path: "/v1/chat/completions",
            status,
            outcome,
            model: Some("m"),
            request_id: "req-1",
        }
    }

    #[test]
    fn the_span_tree_follows_the_request_on_a_manual_clock() {
        let tracer = tracer(0.0);
        let clock = ManualClock::new(1_700_000_000_000);
        let t0 = clock.now();
        let mut trace = RequestTrace::begin(
            &tracer,
            &[
                header("TraceParent", PARENT),
                header("tracestate", "rojo=1"),
            ],
            t0,
            clock.unix_ms(),
        );
        assert!(
            trace.sampled(),
            "the client's sampled flag wins over ratio 0"
        );
        clock.advance(Duration::from_millis(2));
        let submitted = clock.now();
        clock.advance(Duration::from_millis(5));
        trace.queue_wait(&tracer, submitted, clock.now());
        clock.advance(Duration::from_millis(1));
        let ctx = trace
            .dispatch(&tracer, clock.now(), "node-a", "gpt", "run-1")
            .expect("a context for the node");
        clock.advance(Duration::from_millis(1));
        trace.dispatched(clock.now(), true);
        clock.advance(Duration::from_millis(40));
        let spans = trace
            .finish(clock.now(), &end(Some(200), "completed"))
            .unwrap();

        let trace_id =
            TraceId(*b"\x4b\xf9\x2f\x35\x77\xb3\x4d\xa6\xa3\xce\x92\x9d\x0e\x0e\x47\x36");
        let client_span = SpanId(*b"\x00\xf0\x67\xaa\x0b\xa9\x02\xb7");
        assert_eq!(spans.len(), 3);
        let (request, queue, dispatch) = (&spans[0], &spans[1], &spans[2]);
        assert!(spans.iter().all(|s| s.trace_id == trace_id));
        assert_eq!(request.parent_id, Some(client_span));
        assert_eq!(request.kind, SpanKind::Server);
        assert_eq!(request.name, "POST /v1/chat/completions");
        assert_eq!(queue.parent_id, Some(request.span_id));
        assert_eq!(dispatch.parent_id, Some(request.span_id));
        assert_eq!(queue.name, "queue_wait");
        assert_ne!(queue.span_id, request.span_id);
        // Times: request 0–49 ms, queue 2–7 ms, dispatch 7–9 ms (it starts
        // at the admission answer, the lease included).
        let at = |ms: u64| 1_700_000_000_000_000_000 + ms * 1_000_000;
        assert_eq!(
            (request.start_unix_ns, request.end_unix_ns),
            (at(0), at(49))
        );
        assert_eq!((queue.start_unix_ns, queue.end_unix_ns), (at(2), at(7)));
        assert_eq!(
            (dispatch.start_unix_ns, dispatch.end_unix_ns),
            (at(7), at(9))
        );
        assert_eq!(request.tracestate.as_deref(), Some("rojo=1"));
        assert_eq!(request.error, None);
        assert!(dispatch
            .attributes
            .contains(&Attr::str("iop.provider", "gpt")));
        // The node's context: same trace, the dispatch span as parent,
        // sampled, the tracestate passed on.
        assert_eq!(&ctx.trace_id[..], &trace_id.0);
        assert_eq!(&ctx.parent_span_id[..], &dispatch.span_id.0);
        assert_eq!((ctx.flags, ctx.tracestate.as_str()), (1, "rojo=1"));
    }

    #[test]
    fn an_invalid_or_repeated_traceparent_starts_a_new_trace() {
        let tracer = tracer(1.0);
        let now = iop_engine::clock::now();
        for headers in [
            vec![header(
                "traceparent",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            )],
            vec![header("traceparent", PARENT), header("traceparent", PARENT)],
            vec![header("traceparent", "ff-junk")],
        ] {
            let trace = RequestTrace::begin(&tracer, &headers, now, 0);
            assert_ne!(trace.trace_id().to_string(), &PARENT[3..35]);
            let spans = trace.finish(now, &end(Some(200), "completed")).unwrap();
            assert_eq!(spans[0].parent_id, None);
            // Its tracestate goes with the invalid traceparent.
            assert_eq!(spans[0].tracestate, None);
        }
    }

    #[test]
    fn an_unsampled_request_is_exported_only_when_it_fails() {
        let tracer = tracer(0.0);
        let now = iop_engine::clock::now();
        let unsampled = |tracer: &Tracer| RequestTrace::begin(tracer, &[], now, 0);
        assert!(!unsampled(&tracer).sampled());
        assert_eq!(
            unsampled(&tracer).finish(now, &end(Some(200), "completed")),
            None
        );
        // A client error is not forced out.
        assert_eq!(
            unsampled(&tracer).finish(now, &end(Some(404), "model_not_found")),
            None
        );
        for (status, outcome) in [
            (Some(502), "provider_error"),
            (Some(429), "queue_full"),
            (Some(200), "response_stalled"),
            (None, "client_disconnect"),
        ] {
            let spans = unsampled(&tracer)
                .finish(now, &end(status, outcome))
                .unwrap_or_else(|| panic!("{status:?} {outcome} exported"));
            assert_eq!(spans[0].error.as_deref(), Some(outcome));
        }
    }

    #[test]
    fn dispatch_spans_are_capped_and_an_unsent_one_is_an_error() {
        let tracer = tracer(1.0);
        let now = iop_engine::clock::now();
        let mut trace = RequestTrace::begin(&tracer, &[], now, 0);
        for i in 0..DISPATCH_SPANS_MAX {
            assert!(trace.dispatch(&tracer, now, "n", "p", "r").is_some(), "{i}");
            trace.dispatched(now, i > 0);
        }
        assert_eq!(trace.dispatch(&tracer, now, "n", "p", "r"), None);
        let spans = trace.finish(now, &end(Some(200), "completed")).unwrap();
        assert_eq!(spans.len(), 1 + DISPATCH_SPANS_MAX);
        assert_eq!(spans[1].error.as_deref(), Some("node_unavailable"));
        assert_eq!(spans[2].error, None);
    }

    #[test]
    fn the_context_is_set_on_either_kind_of_run() {
        let ctx = pb::TraceContext {
            flags: 1,
            ..Default::default()
        };
        let mut tunnel = pb::Frame {
            body: Some(pb::frame::Body::ProviderTunnelRequest(Box::default())),
        };
        set_trace(&mut tunnel, ctx.clone());
        let Some(pb::frame::Body::ProviderTunnelRequest(t)) = tunnel.body else {
            panic!("a tunnel");
        };
        assert_eq!(t.trace, Some(ctx.clone()));
        let mut run = pb::Frame {
            body: Some(pb::frame::Body::RunRequest(Box::default())),
        };
        set_trace(&mut run, ctx.clone());
        let Some(pb::frame::Body::RunRequest(r)) = run.body else {
            panic!("a run");
        };
        assert_eq!(r.trace, Some(ctx));
    }
}
