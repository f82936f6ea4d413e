//! The OTLP trace messages this process sends, as prost structs (the
//! subset of `opentelemetry/proto/collector/trace/v1/trace_service.proto`,
//! `trace/v1/trace.proto`, `common/v1/common.proto` and
//! `resource/v1/resource.proto` it fills; field numbers as there), and the
//! encoding of a batch of [`SpanRecord`]s into the body of
//! `POST /v1/traces` (`application/x-protobuf`).
//!
//! Written here rather than taken from `opentelemetry-proto`: that crate's
//! trace types come only with its `trace` feature, which builds the
//! `opentelemetry_sdk` trace pipeline (and a futures executor) that this
//! process never runs. The e2e suite decodes what is sent with the
//! reference Python `opentelemetry-proto` package.

use prost::Message;

use super::span::{AttrValue, SpanRecord};

/// `ExportTraceServiceRequest`.
#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceRequest {
    /// Spans grouped by the resource that made them.
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

/// `ResourceSpans`.
#[derive(Clone, PartialEq, Message)]
pub struct ResourceSpans {
    /// The process that made the spans.
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    /// Spans grouped by instrumentation scope.
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
}

/// `Resource`.
#[derive(Clone, PartialEq, Message)]
pub struct Resource {
    /// `service.name` and the like.
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

/// `ScopeSpans`.
#[derive(Clone, PartialEq, Message)]
pub struct ScopeSpans {
    /// The instrumentation that made the spans.
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    /// The spans.
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
}

/// `InstrumentationScope`.
#[derive(Clone, PartialEq, Message)]
pub struct InstrumentationScope {
    /// Its name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its version.
    #[prost(string, tag = "2")]
    pub version: String,
}

/// `Span`.
#[derive(Clone, PartialEq, Message)]
pub struct Span {
    /// 16 bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    /// 8 bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    /// W3C `tracestate`.
    #[prost(string, tag = "3")]
    pub trace_state: String,
    /// 8 bytes, or empty for a root span.
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    /// Its name.
    #[prost(string, tag = "5")]
    pub name: String,
    /// `SpanKind`.
    #[prost(int32, tag = "6")]
    pub kind: i32,
    /// Start, Unix nanoseconds.
    #[prost(fixed64, tag = "7")]
    pub start_time_unix_nano: u64,
    /// End, Unix nanoseconds.
    #[prost(fixed64, tag = "8")]
    pub end_time_unix_nano: u64,
    /// Attributes.
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
    /// Events.
    #[prost(message, repeated, tag = "11")]
    pub events: Vec<SpanEventMessage>,
    /// Status.
    #[prost(message, optional, tag = "15")]
    pub status: Option<Status>,
}

/// `Span.Event`.
#[derive(Clone, PartialEq, Message)]
pub struct SpanEventMessage {
    /// When, Unix nanoseconds.
    #[prost(fixed64, tag = "1")]
    pub time_unix_nano: u64,
    /// What.
    #[prost(string, tag = "2")]
    pub name: String,
}

/// `Status`.
#[derive(Clone, PartialEq, Message)]
pub struct Status {
    /// Why (for `ERROR`).
    #[prost(string, tag = "2")]
    pub message: String,
    /// `STATUS_CODE_UNSET` 0, `OK` 1, `ERROR` 2.
    #[prost(int32, tag = "3")]
    pub code: i32,
}

/// OTLP `STATUS_CODE_ERROR`.
pub const STATUS_CODE_ERROR: i32 = 2;

/// `KeyValue`.
#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    /// The key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

/// `AnyValue` (the string and integer cases).
#[derive(Clone, PartialEq, Message)]
pub struct AnyValue {
    /// The value.
    #[prost(oneof = "any_value::Value", tags = "1, 3")]
    pub value: Option<any_value::Value>,
}

/// The cases of [`AnyValue`].
pub mod any_value {
    /// `AnyValue.value`.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        /// `string_value`.
        #[prost(string, tag = "1")]
        StringValue(String),
        /// `int_value`.
        #[prost(int64, tag = "3")]
        IntValue(i64),
    }
}

/// The instrumentation scope named on every batch.
pub const SCOPE_NAME: &str = "iop";

fn key_value(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(value) }),
    }
}

/// The export request for `spans`, made by `service_name`.
pub fn export_request(service_name: &str, spans: &[SpanRecord]) -> ExportTraceServiceRequest {
    let spans = spans
        .iter()
        .map(|s| Span {
            trace_id: s.trace_id.0.to_vec(),
            span_id: s.span_id.0.to_vec(),
            trace_state: s.tracestate.clone().unwrap_or_default(),
            parent_span_id: s.parent_id.map(|p| p.0.to_vec()).unwrap_or_default(),
            name: s.name.clone(),
            kind: s.kind.otlp(),
            start_time_unix_nano: s.start_unix_ns,
            end_time_unix_nano: s.end_unix_ns.max(s.start_unix_ns),
            attributes: s
                .attributes
                .iter()
                .map(|a| {
                    let value = match &a.value {
                        AttrValue::Str(v) => any_value::Value::StringValue(v.clone()),
                        AttrValue::Int(v) => any_value::Value::IntValue(*v),
                    };
                    key_value(a.key, value)
                })
                .collect(),
            events: s
                .events
                .iter()
                .map(|e| SpanEventMessage {
                    time_unix_nano: e.at_unix_ns,
                    name: e.name.to_owned(),
                })
                .collect(),
            status: s.error.as_ref().map(|message| Status {
                message: message.clone(),
                code: STATUS_CODE_ERROR,
            }),
        })
        .collect();
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![key_value(
                    "service.name",
                    any_value::Value::StringValue(service_name.to_owned()),
                )],
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: SCOPE_NAME.to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                }),
                spans,
            }],
        }],
    }
}

/// The `POST /v1/traces` body for `spans`.
pub fn encode(service_name: &str, spans: &[SpanRecord]) -> Vec<u8> {
    export_request(service_name, spans).encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::context::{SpanId, TraceId};
    use crate::trace::span::{Attr, SpanEvent, SpanKind};

    fn record() -> SpanRecord {
        SpanRecord {
            trace_id: TraceId([0x11; 16]),
            span_id: SpanId([0x22; 8]),
            parent_id: Some(SpanId([0x33; 8])),
            tracestate: None,
            name: "provider_call".into(),
            kind: SpanKind::Client,
            start_unix_ns: 1_000,
            end_unix_ns: 2_000,
            attributes: vec![Attr::int("http.response.status_code", 200)],
            events: vec![SpanEvent {
                name: "first_byte",
                at_unix_ns: 1_500,
            }],
            error: Some("provider_error".into()),
        }
    }

    #[test]
    fn a_batch_round_trips_through_the_wire_format() {
        let bytes = encode("iop-node", &[record()]);
        let decoded = ExportTraceServiceRequest::decode(&bytes[..]).unwrap();
        assert_eq!(decoded, export_request("iop-node", &[record()]));
        let resource = &decoded.resource_spans[0];
        assert_eq!(
            resource.resource.as_ref().unwrap().attributes[0],
            key_value(
                "service.name",
                any_value::Value::StringValue("iop-node".into())
            )
        );
        let span = &resource.scope_spans[0].spans[0];
        assert_eq!(span.trace_id, vec![0x11; 16]);
        assert_eq!(span.parent_span_id, vec![0x33; 8]);
        assert_eq!(span.kind, 3);
        assert_eq!(span.events[0].time_unix_nano, 1_500);
        assert_eq!(span.status.as_ref().unwrap().code, STATUS_CODE_ERROR);
    }

    #[test]
    fn field_numbers_match_the_otlp_schema() {
        // A span with only its trace id, name and start: tag 1 (bytes,
        // wire type 2) = 0x0a, tag 5 (string) = 0x2a, tag 7 (fixed64,
        // wire type 1) = 0x39.
        let span = Span {
            trace_id: vec![0xab],
            name: "n".into(),
            start_time_unix_nano: 1,
            ..Default::default()
        };
        assert_eq!(
            span.encode_to_vec(),
            [0x0a, 0x01, 0xab, 0x2a, 0x01, b'n', 0x39, 1, 0, 0, 0, 0, 0, 0, 0]
        );
        let status = Status {
            message: "m".into(),
            code: 2,
        };
        assert_eq!(status.encode_to_vec(), [0x12, 0x01, b'm', 0x18, 0x02]);
    }
}
