//! The span of one provider call (`[tracing]`, `docs/tracing.md`): a
//! client span under the Edge's `dispatch` span, from the call's start to
//! the attempt's release, with a `first_byte` event when the provider's
//! first output arrives; and the `traceparent` the provider gets, whose
//! parent is that span.
//!
//! ```text
//!  RunRequest / ProviderTunnelRequest.trace (the Edge's dispatch span)
//!     └─ provider_call (client span, here) ── traceparent ──► provider (vLLM's own spans)
//!           • first_byte
//! ```
//!
//! With tracing off a tunnel's provider still gets the Edge's context, as
//! a `traceparent` naming the Edge's dispatch span (no span is built
//! here); without a context from the Edge nothing is sent. A Node with
//! tracing on and no context from the Edge starts a trace of its own,
//! sampled by its `sample_ratio`. The spans are exported when the Edge
//! sampled the trace, or when the call failed.

use std::time::Instant;

use iop_engine::trace::context::{tracestate, FLAG_SAMPLED};
use iop_engine::trace::{
    should_export, Attr, SpanEvent, SpanId, SpanKind, SpanRecord, SpanStart, Timeline, TraceId,
    TraceParent, Tracer,
};
use iop_wire::pb;

/// The request header that carries the trace context to the provider.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// The request header that carries vendor trace state to the provider.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// The Edge's trace context, when its ids are valid (16 and 8 bytes, not
/// all zero); an invalid one is ignored, as an invalid `traceparent` is.
pub fn edge_context(ctx: Option<&pb::TraceContext>) -> Option<(TraceParent, Option<String>)> {
    let ctx = ctx?;
    let parent = TraceParent {
        trace_id: TraceId::from_bytes(&ctx.trace_id)?,
        parent_id: SpanId::from_bytes(&ctx.parent_span_id)?,
        flags: u8::try_from(ctx.flags & 0xff).unwrap_or(0),
    };
    let state = tracestate([ctx.tracestate.as_bytes()]);
    Some((parent, state))
}

/// The headers a provider gets for `parent` (its `traceparent`, and its
/// `tracestate` when there is one).
pub fn provider_headers(parent: &TraceParent, state: Option<&str>) -> Vec<pb::Header> {
    let mut headers = vec![pb::Header {
        name: TRACEPARENT_HEADER.to_owned(),
        value: parent.to_header().into(),
    }];
    if let Some(state) = state {
        headers.push(pb::Header {
            name: TRACESTATE_HEADER.to_owned(),
            value: state.to_owned().into(),
        });
    }
    headers
}

/// What the span says of the call it measures.
#[derive(Debug, Clone, Copy)]
pub struct CallLabels<'a> {
    /// `tunnel` or `run`.
    pub kind: &'static str,
    /// The run id the Edge gave.
    pub run_id: &'a str,
    /// The adapter instance.
    pub adapter: &'a str,
    /// The provider's target (model).
    pub target: &'a str,
}

/// The span of one provider call while it runs.
#[derive(Debug)]
pub struct ProviderSpan {
    trace_id: TraceId,
    span_id: SpanId,
    parent: Option<SpanId>,
    sampled: bool,
    tracestate: Option<String>,
    timeline: Timeline,
    started_at: Instant,
    first_byte_at: Option<Instant>,
    status: Option<u16>,
    failure: Option<String>,
    attributes: Vec<Attr>,
}

impl ProviderSpan {
    /// The span of a call starting at `now` (`unix_ms` on the wall clock)
    /// under `edge`'s context, or of a new trace without one.
    pub fn begin(
        tracer: &Tracer,
        edge: Option<(TraceParent, Option<String>)>,
        labels: &CallLabels<'_>,
        now: Instant,
        unix_ms: i64,
    ) -> Box<Self> {
        let parent = edge.as_ref().map(|(p, _)| *p);
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
            tracestate: edge.and_then(|(_, state)| state),
            timeline: Timeline::new(now, unix_ms),
            started_at: now,
            first_byte_at: None,
            status: None,
            failure: None,
            attributes: vec![
                Attr::str("iop.call", labels.kind),
                Attr::str("iop.run_id", labels.run_id),
                Attr::str("iop.adapter", labels.adapter),
                Attr::str("gen_ai.request.model", labels.target),
            ],
        })
    }

    /// The trace id (the run's log lines carry it).
    pub fn trace_id(&self) -> TraceId {
        self.trace_id
    }

    /// The `traceparent` the provider gets: this span as its parent, the
    /// sampling decision in its flags.
    pub fn child_traceparent(&self) -> TraceParent {
        TraceParent {
            trace_id: self.trace_id,
            parent_id: self.span_id,
            flags: if self.sampled { FLAG_SAMPLED } else { 0 },
        }
    }

    /// The headers the provider gets.
    pub fn provider_headers(&self) -> Vec<pb::Header> {
        provider_headers(&self.child_traceparent(), self.tracestate.as_deref())
    }

    /// The provider's first output was read at `at` (for a tunnel, its
    /// response head with `status`). Later calls change nothing.
    pub fn first_output(&mut self, at: Instant, status: Option<u16>) {
        if self.first_byte_at.is_none() {
            self.first_byte_at = Some(at);
            self.status = status;
        }
    }

    /// The call failed with `code` (the first failure noted stands).
    pub fn failed(&mut self, code: &str) {
        if self.failure.is_none() {
            self.failure = Some(code.to_owned());
        }
    }

    /// The attempt was released at `now`: the span, when it is to be
    /// exported (sampled, or the call failed or answered 5xx/429).
    pub fn finish(self, now: Instant) -> Option<SpanRecord> {
        let status_error = self.status.is_some_and(|s| s >= 500 || s == 429);
        let error = match (&self.failure, status_error) {
            (Some(code), _) => Some(code.clone()),
            (None, true) => Some(format!("provider answered {}", self.status.unwrap_or(0))),
            (None, false) => None,
        };
        if !should_export(self.sampled, error.is_some()) {
            return None;
        }
        let mut attributes = self.attributes;
        if let Some(status) = self.status {
            attributes.push(Attr::int("http.response.status_code", status.into()));
        }
        Some(SpanRecord {
            trace_id: self.trace_id,
            span_id: self.span_id,
            parent_id: self.parent,
            tracestate: self.tracestate,
            name: "provider_call".to_owned(),
            kind: SpanKind::Client,
            start_unix_ns: self.timeline.unix_ns(self.started_at),
            end_unix_ns: self.timeline.unix_ns(now),
            attributes,
            events: self
                .first_byte_at
                .map(|at| SpanEvent {
                    name: "first_byte",
                    at_unix_ns: self.timeline.unix_ns(at),
                })
                .into_iter()
                .collect(),
            error,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use iop_engine::clock::{Clock, ManualClock};
    use iop_engine::metrics::Side;
    use iop_engine::rng::SplitMix64;
    use iop_engine::trace::export::channel;
    use iop_engine::trace::Sampler;

    use super::*;

    fn tracer(ratio: f64) -> Tracer {
        let (handle, _rx) = channel(Side::Node, 8);
        Tracer::new(Sampler::new(ratio), SplitMix64::new(11), handle)
    }

    const LABELS: CallLabels<'static> = CallLabels {
        kind: "tunnel",
        run_id: "run-1",
        adapter: "vllm",
        target: "llama",
    };

    fn ctx(flags: u32) -> pb::TraceContext {
        pb::TraceContext {
            trace_id: Bytes::from_static(&[0x4b; 16]),
            parent_span_id: Bytes::from_static(&[0x0e; 8]),
            flags,
            tracestate: "rojo=1".into(),
        }
    }

    #[test]
    fn the_edges_context_is_checked_before_it_is_used() {
        let (parent, state) = edge_context(Some(&ctx(1))).unwrap();
        assert_eq!(parent.trace_id, TraceId([0x4b; 16]));
        assert_eq!(parent.parent_id, SpanId([0x0e; 8]));
        assert!(parent.sampled());
        assert_eq!(state.as_deref(), Some("rojo=1"));
        assert_eq!(edge_context(None), None);
        let short = pb::TraceContext {
            trace_id: Bytes::from_static(&[1; 15]),
            ..ctx(1)
        };
        assert_eq!(edge_context(Some(&short)), None);
        let zero = pb::TraceContext {
            parent_span_id: Bytes::from_static(&[0; 8]),
            ..ctx(1)
        };
        assert_eq!(edge_context(Some(&zero)), None);
    }

    #[test]
    fn the_provider_span_is_a_child_of_the_edges_and_the_parent_of_the_providers() {
        let tracer = tracer(0.0);
        let clock = ManualClock::new(1_700_000_000_000);
        let mut span = ProviderSpan::begin(
            &tracer,
            edge_context(Some(&ctx(1))),
            &LABELS,
            clock.now(),
            clock.unix_ms(),
        );
        let headers = span.provider_headers();
        let child = span.child_traceparent();
        assert_eq!(headers[0].name, "traceparent");
        assert_eq!(
            headers[0].value,
            Bytes::from(format!(
                "00-4b4b4b4b4b4b4b4b4b4b4b4b4b4b4b4b-{}-01",
                child.parent_id
            ))
        );
        assert_eq!(
            (headers[1].name.as_str(), &headers[1].value[..]),
            ("tracestate", &b"rojo=1"[..])
        );
        clock.advance(Duration::from_millis(30));
        span.first_output(clock.now(), Some(200));
        clock.advance(Duration::from_millis(5));
        span.first_output(clock.now(), Some(500));
        clock.advance(Duration::from_millis(100));
        let record = span.finish(clock.now()).expect("the Edge sampled it");
        assert_eq!(record.trace_id, TraceId([0x4b; 16]));
        assert_eq!(record.parent_id, Some(SpanId([0x0e; 8])));
        assert_eq!(record.span_id, child.parent_id);
        assert_eq!(record.kind, SpanKind::Client);
        let at = |ms: u64| 1_700_000_000_000_000_000 + ms * 1_000_000;
        assert_eq!((record.start_unix_ns, record.end_unix_ns), (at(0), at(135)));
        assert_eq!(
            record.events,
            vec![SpanEvent {
                name: "first_byte",
                at_unix_ns: at(30)
            }]
        );
        assert!(record
            .attributes
            .contains(&Attr::int("http.response.status_code", 200)));
        assert_eq!(record.error, None);
    }

    #[test]
    fn an_unsampled_call_is_exported_only_when_it_fails() {
        let tracer = tracer(1.0);
        let now = iop_engine::clock::now();
        let begin = || ProviderSpan::begin(&tracer, edge_context(Some(&ctx(0))), &LABELS, now, 0);
        // The Edge's decision wins over this Node's ratio.
        assert_eq!(begin().child_traceparent().flags, 0);
        assert_eq!(begin().finish(now), None);
        let mut failed = begin();
        failed.failed("provider_unreachable");
        failed.failed("response_stalled");
        assert_eq!(
            failed.finish(now).unwrap().error.as_deref(),
            Some("provider_unreachable")
        );
        let mut answered_5xx = begin();
        answered_5xx.first_output(now, Some(503));
        assert_eq!(
            answered_5xx.finish(now).unwrap().error.as_deref(),
            Some("provider answered 503")
        );
    }

    #[test]
    fn without_the_edges_context_a_new_trace_is_sampled_by_ratio() {
        let now = iop_engine::clock::now();
        let span = ProviderSpan::begin(&tracer(1.0), None, &LABELS, now, 0);
        let record = span.finish(now).unwrap();
        assert_eq!(record.parent_id, None);
        assert_eq!(
            ProviderSpan::begin(&tracer(0.0), None, &LABELS, now, 0).finish(now),
            None
        );
    }
}
