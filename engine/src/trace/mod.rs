//! Request tracing: W3C Trace Context in and out, spans as plain data, and
//! their OTLP/HTTP export — shared by the Edge and the Node
//! (`docs/tracing.md`).
//!
//! ```text
//!  client ─traceparent─► Edge: request span ─┬─ queue_wait
//!                                            └─ dispatch ─TraceContext (wire)─► Node: provider_call ─traceparent─► provider
//!  each process, at the end of a request: sampled or failed? ─► ExportHandle ─► exporter thread ─► POST /v1/traces
//! ```
//!
//! | module | what |
//! |---|---|
//! | [`context`] | ids, `traceparent` parse/format, `tracestate` bounds |
//! | [`sample`] | the head sampler, the export decision, id minting |
//! | [`span`] | finished spans, the instant → Unix-time timeline |
//! | [`otlp`] | the OTLP protobuf messages and a batch's encoding |
//! | [`export`] | the endpoint, the bounded queue and the exporter thread |
//!
//! Off (no `[tracing] otlp_endpoint`) there is no [`Tracer`]: the shells
//! hold an `Option` that is `None`, build no span and allocate nothing for
//! tracing (`iop_<side>_trace_spans_started_total` stays 0).

pub mod context;
pub mod export;
pub mod otlp;
pub mod sample;
pub mod span;

use std::cell::{RefCell, RefMut};

pub use self::context::{SpanId, TraceId, TraceParent};
pub use self::export::{ExportHandle, OtlpEndpoint};
pub use self::sample::{should_export, IdSource, Sampler};
pub use self::span::{Attr, SpanEvent, SpanKind, SpanRecord, Timeline};
use crate::metrics::{self, Side};
use crate::rng::SplitMix64;

/// The `[tracing]` table of `edge.toml` and `node.toml`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingSpec {
    /// `otlp_endpoint`: the collector's OTLP/HTTP base address.
    pub otlp_endpoint: OtlpEndpoint,
    /// `sample_ratio`: the share of new traces sampled (0.0–1.0).
    pub sample_ratio: f64,
    /// `service_name`: the `service.name` of this process's spans.
    pub service_name: String,
}

// `sample_ratio` is checked to lie in 0.0–1.0, so it is never NaN and
// equality is total.
impl Eq for TracingSpec {}

/// Default `sample_ratio` when an endpoint is set.
pub const DEFAULT_SAMPLE_RATIO: f64 = 1.0;
/// Longest `service_name`.
pub const SERVICE_NAME_BYTES_MAX: usize = 128;

impl TracingSpec {
    /// The table from its raw keys: `None` when no endpoint is set (off);
    /// else the key and the reason of the first bad value.
    pub fn from_raw(
        otlp_endpoint: Option<&str>,
        sample_ratio: Option<f64>,
        service_name: Option<&str>,
        default_service_name: &str,
    ) -> Result<Option<Self>, (&'static str, String)> {
        let ratio = match sample_ratio {
            Some(r) if !(0.0..=1.0).contains(&r) => {
                return Err(("sample_ratio", format!("{r} is not from 0.0 to 1.0")));
            }
            other => other,
        };
        let name = match service_name {
            Some(n)
                if n.is_empty()
                    || n.len() > SERVICE_NAME_BYTES_MAX
                    || n.chars().any(|c| c.is_control()) =>
            {
                return Err((
                    "service_name",
                    format!(
                        "must be 1 to {SERVICE_NAME_BYTES_MAX} bytes without control characters"
                    ),
                ));
            }
            other => other,
        };
        let Some(endpoint) = otlp_endpoint else {
            if ratio.is_some() || name.is_some() {
                return Err((
                    "otlp_endpoint",
                    "sample_ratio and service_name need otlp_endpoint (tracing is off without it)"
                        .to_owned(),
                ));
            }
            return Ok(None);
        };
        let otlp_endpoint = OtlpEndpoint::parse(endpoint).map_err(|why| ("otlp_endpoint", why))?;
        Ok(Some(Self {
            otlp_endpoint,
            sample_ratio: ratio.unwrap_or(DEFAULT_SAMPLE_RATIO),
            service_name: name.unwrap_or(default_service_name).to_owned(),
        }))
    }
}

/// What [`Tracer::begin`] decided for a process's first span of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanStart {
    /// The request's trace.
    pub trace_id: TraceId,
    /// The span's own id.
    pub span_id: SpanId,
    /// Whether it is exported whatever its outcome.
    pub sampled: bool,
}

/// One thread's tracer: the sampler, the ids it mints and where its
/// finished spans go. Exists only while tracing is on.
#[derive(Debug)]
pub struct Tracer {
    sampler: Sampler,
    ids: RefCell<IdSource>,
    export: ExportHandle,
}

impl Tracer {
    /// A tracer sampling by `sampler`, minting ids from `rng`, exporting
    /// through `export`.
    pub fn new(sampler: Sampler, rng: SplitMix64, export: ExportHandle) -> Self {
        Self {
            sampler,
            ids: RefCell::new(IdSource::new(rng)),
            export,
        }
    }

    /// A tracer for `spec` on this thread, exporting through `export`,
    /// minting ids from the OS's randomness.
    pub fn for_spec(spec: &TracingSpec, export: ExportHandle) -> Self {
        Self::new(
            Sampler::new(spec.sample_ratio),
            SplitMix64::from_os(),
            export,
        )
    }

    /// The id source (borrowed for one call; never held across an await).
    pub fn ids(&self) -> RefMut<'_, IdSource> {
        self.ids.borrow_mut()
    }

    /// The head decision for a request whose caller sent `parent`.
    pub fn sample(&self, parent: Option<&TraceParent>) -> bool {
        let draw = self.ids().draw();
        self.sampler.decide(parent, draw)
    }

    /// The first span of a process's part of a request: its trace (the
    /// caller's, or a new one), its own id and the head decision, counted
    /// as started.
    pub fn begin(&self, parent: Option<&TraceParent>) -> SpanStart {
        let sampled = self.sample(parent);
        let mut ids = self.ids();
        let trace_id = parent.map_or_else(|| ids.trace_id(), |p| p.trace_id);
        let span_id = ids.span_id();
        drop(ids);
        self.started(1);
        SpanStart {
            trace_id,
            span_id,
            sampled,
        }
    }

    /// Counts `n` spans started.
    pub fn started(&self, n: u64) {
        metrics::add(self.export.counts().started, n);
    }

    /// Hands the spans of one finished request to the exporter.
    pub fn submit(&self, spans: Vec<SpanRecord>) {
        self.export.submit(spans);
    }
}

/// Starts the exporter thread for `spec` on `side`.
pub fn start_export(spec: &TracingSpec, side: Side) -> std::io::Result<ExportHandle> {
    export::start(spec.otlp_endpoint.clone(), spec.service_name.clone(), side)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_off_without_an_endpoint_and_checked_with_one() {
        assert_eq!(
            TracingSpec::from_raw(None, None, None, "iop-edge"),
            Ok(None)
        );
        let spec = TracingSpec::from_raw(Some("http://127.0.0.1:4318"), None, None, "iop-edge")
            .unwrap()
            .unwrap();
        assert_eq!(spec.sample_ratio, 1.0);
        assert_eq!(spec.service_name, "iop-edge");
        let spec = TracingSpec::from_raw(
            Some("http://127.0.0.1:4318"),
            Some(0.25),
            Some("gw"),
            "iop-edge",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (spec.sample_ratio, spec.service_name.as_str()),
            (0.25, "gw")
        );
        let err = |e: Option<&str>, r: Option<f64>, n: Option<&str>| {
            TracingSpec::from_raw(e, r, n, "iop-edge").unwrap_err().0
        };
        assert_eq!(err(Some("http://c:1"), Some(1.5), None), "sample_ratio");
        assert_eq!(err(Some("http://c:1"), Some(-0.1), None), "sample_ratio");
        assert_eq!(err(Some("http://c:1"), None, Some("")), "service_name");
        assert_eq!(err(Some("ftp://c:1"), None, None), "otlp_endpoint");
        assert_eq!(err(None, Some(0.5), None), "otlp_endpoint");
    }
}
