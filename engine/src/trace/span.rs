//! Finished spans as plain data, and the timeline that turns the monotonic
//! instants a request records into the Unix nanoseconds OTLP wants.

use std::time::Instant;

use super::context::{SpanId, TraceId};

/// What a span stands for, as OTLP names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// Work inside this process (queue wait, dispatch).
    Internal,
    /// A request this process serves (the Edge's request span).
    Server,
    /// A call this process makes (the Node's provider call).
    Client,
}

impl SpanKind {
    /// The OTLP `SpanKind` number.
    pub fn otlp(self) -> i32 {
        match self {
            SpanKind::Internal => 1,
            SpanKind::Server => 2,
            SpanKind::Client => 3,
        }
    }
}

/// An attribute value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttrValue {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
}

/// One attribute: a fixed key and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    /// The key (OpenTelemetry semantic conventions where one fits).
    pub key: &'static str,
    /// The value.
    pub value: AttrValue,
}

impl Attr {
    /// A string attribute.
    pub fn str(key: &'static str, value: impl Into<String>) -> Self {
        Self {
            key,
            value: AttrValue::Str(value.into()),
        }
    }

    /// An integer attribute.
    pub fn int(key: &'static str, value: i64) -> Self {
        Self {
            key,
            value: AttrValue::Int(value),
        }
    }
}

/// A point in time within a span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanEvent {
    /// What happened (`first_byte`).
    pub name: &'static str,
    /// When, in Unix nanoseconds.
    pub at_unix_ns: u64,
}

/// A finished span, ready to export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanRecord {
    /// Its trace.
    pub trace_id: TraceId,
    /// Its own id.
    pub span_id: SpanId,
    /// Its parent; `None` for a trace's root.
    pub parent_id: Option<SpanId>,
    /// The W3C `tracestate` in force, if any.
    pub tracestate: Option<String>,
    /// Its name (`POST /v1/chat/completions`, `queue_wait`).
    pub name: String,
    /// Its kind.
    pub kind: SpanKind,
    /// Start, Unix nanoseconds.
    pub start_unix_ns: u64,
    /// End, Unix nanoseconds (not before the start).
    pub end_unix_ns: u64,
    /// Its attributes.
    pub attributes: Vec<Attr>,
    /// Its events.
    pub events: Vec<SpanEvent>,
    /// `Some(message)`: the span ended in error (OTLP status `ERROR`).
    pub error: Option<String>,
}

/// Maps monotonic instants to Unix nanoseconds from one reading of both
/// clocks: the spans of one request keep their exact order and distances
/// whatever the wall clock does meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeline {
    origin: Instant,
    origin_unix_ns: u64,
}

impl Timeline {
    /// The timeline on which `origin` is `origin_unix_ms`.
    pub fn new(origin: Instant, origin_unix_ms: i64) -> Self {
        let origin_unix_ns = u64::try_from(origin_unix_ms)
            .unwrap_or(0)
            .saturating_mul(1_000_000);
        Self {
            origin,
            origin_unix_ns,
        }
    }

    /// `at` in Unix nanoseconds.
    pub fn unix_ns(&self, at: Instant) -> u64 {
        match at.checked_duration_since(self.origin) {
            Some(after) => self
                .origin_unix_ns
                .saturating_add(u64::try_from(after.as_nanos()).unwrap_or(u64::MAX)),
            None => self.origin_unix_ns.saturating_sub(
                u64::try_from(self.origin.duration_since(at).as_nanos()).unwrap_or(u64::MAX),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::{Clock, ManualClock};

    #[test]
    fn instants_map_to_unix_nanoseconds_both_ways_of_the_origin() {
        let clock = ManualClock::new(1_700_000_000_000);
        clock.advance(Duration::from_secs(1));
        let origin = clock.now();
        let timeline = Timeline::new(origin, clock.unix_ms());
        assert_eq!(timeline.unix_ns(origin), 1_700_000_001_000_000_000);
        assert_eq!(
            timeline.unix_ns(origin + Duration::from_nanos(1_500)),
            1_700_000_001_000_001_500
        );
        assert_eq!(
            timeline.unix_ns(origin - Duration::from_millis(2)),
            1_700_000_000_998_000_000
        );
    }
}
