//! Per-thread figures of a load run (histograms and counters) and the
//! serializable [`LoadSummary`] they reduce to. Pure: the shell calls in
//! with what happened and when.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::chunk::{Observation, StreamEnd};
use crate::stats::{Headline, LatencyHistogram, LatencySummary};

/// Why a request did not complete cleanly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The TCP connection could not be opened.
    Connect,
    /// The response status was not 200.
    HttpStatus(u16),
    /// The connection failed mid-exchange (reset, malformed response, EOF
    /// before the end of the body).
    Io,
    /// The request was still running when its deadline passed.
    Timeout,
    /// A 200 stream carried an error event.
    ErrorEvent,
    /// A 200 stream ended cleanly at the HTTP level without `[DONE]`.
    Truncated,
    /// The open-loop schedule wanted to start a request while the
    /// in-flight cap was reached; it was not sent.
    Overload,
}

/// Failed requests by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorCounts {
    /// See [`Failure::Connect`].
    pub connect: u64,
    /// See [`Failure::HttpStatus`].
    pub http_status: u64,
    /// See [`Failure::Io`].
    pub io: u64,
    /// See [`Failure::Timeout`].
    pub timeout: u64,
    /// See [`Failure::ErrorEvent`].
    pub error_event: u64,
    /// See [`Failure::Overload`].
    pub dropped_overload: u64,
}

impl ErrorCounts {
    /// Every error (truncated streams are counted apart).
    pub fn total(&self) -> u64 {
        self.connect
            + self.http_status
            + self.io
            + self.timeout
            + self.error_event
            + self.dropped_overload
    }
}

/// Everything one load run measured; latencies in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadSummary {
    /// Wall time from the first scheduled start to the last response, in
    /// seconds.
    pub elapsed_s: f64,
    /// Requests sent (or attempted).
    pub requests_started: u64,
    /// Requests that got 200, a complete stream with `[DONE]` and no error
    /// event.
    pub requests_ok: u64,
    /// Failed requests by cause.
    pub errors: ErrorCounts,
    /// `errors.total()`, for readers of the JSON.
    pub errors_total: u64,
    /// 200 streams that ended without `[DONE]`.
    pub truncated: u64,
    /// Non-200 responses by status code.
    pub http_status_codes: BTreeMap<u16, u64>,
    /// The first failure's description, for diagnosis.
    pub first_error: Option<String>,
    /// Content chunks received (one per token).
    pub content_chunks: u64,
    /// Content chunks without an `iop_mock_sent_ns` stamp.
    pub unstamped_chunks: u64,
    /// SSE payloads that were not JSON chunks.
    pub unparsable_events: u64,
    /// The largest inter-chunk gap of any stream, in microseconds.
    pub max_gap_us: f64,
    /// The gap limit streams were judged against, if any, in microseconds.
    pub gap_limit_us: Option<f64>,
    /// Streams whose largest gap exceeded `gap_limit_us`.
    pub streams_over_gap_limit: u64,
    /// Completed requests per second of `elapsed_s`.
    pub requests_per_s: f64,
    /// Content chunks per second of `elapsed_s`.
    pub tokens_per_s: f64,
    /// Body bytes of 200 responses the client received (after chunked
    /// decoding; complete or not).
    #[serde(default)]
    pub body_bytes: u64,
    /// `body_bytes` per second of `elapsed_s`.
    #[serde(default)]
    pub body_bytes_per_s: f64,
    /// Request start → first content chunk.
    pub ttft: LatencySummary,
    /// Mock send → client receive, per content chunk.
    pub chunk_latency: LatencySummary,
    /// Between consecutive content chunks of a stream.
    pub inter_chunk_gap: LatencySummary,
    /// Request start → end of the response.
    pub end_to_end: LatencySummary,
}

impl LoadSummary {
    /// The five figures the comparison works with.
    pub fn headline(&self) -> Headline {
        Headline::of(&self.ttft, &self.chunk_latency, &self.inter_chunk_gap)
    }
}

/// Histograms and counters of one thread's share of a run.
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    /// Request start → first content chunk.
    pub ttft: LatencyHistogram,
    /// Per-chunk one-way latency.
    pub chunk_latency: LatencyHistogram,
    /// Inter-chunk gaps.
    pub inter_chunk_gap: LatencyHistogram,
    /// Request start → end of response.
    pub end_to_end: LatencyHistogram,
    started: u64,
    ok: u64,
    errors: ErrorCounts,
    truncated: u64,
    status_codes: BTreeMap<u16, u64>,
    first_error: Option<String>,
    content_chunks: u64,
    unstamped_chunks: u64,
    unparsable: u64,
    max_gap_ns: u64,
    gap_limit_ns: Option<u64>,
    streams_over_gap_limit: u64,
    body_bytes: u64,
}

impl Recorder {
    /// An empty recorder; streams whose largest gap exceeds `gap_limit_ns`
    /// are counted apart.
    pub fn new(gap_limit_ns: Option<u64>) -> Self {
        Recorder {
            gap_limit_ns,
            ..Recorder::default()
        }
    }

    /// A request was sent (or attempted).
    pub fn on_start(&mut self) {
        self.started += 1;
    }

    /// `bytes` more body bytes of a 200 response arrived.
    pub fn on_body_bytes(&mut self, bytes: usize) {
        self.body_bytes = self.body_bytes.saturating_add(bytes as u64);
    }

    /// Records what one payload added.
    pub fn on_observation(&mut self, observation: Observation) {
        if let Observation::Content {
            ttft_ns,
            latency_ns,
            gap_ns,
        } = observation
        {
            self.content_chunks += 1;
            if let Some(ttft) = ttft_ns {
                self.ttft.record_ns(ttft);
            }
            match latency_ns {
                Some(latency) => self.chunk_latency.record_ns(latency),
                None => self.unstamped_chunks += 1,
            }
            if let Some(gap) = gap_ns {
                self.inter_chunk_gap.record_ns(gap);
            }
        }
    }

    /// A 200 response's body ended (cleanly at the HTTP level). Returns
    /// the failure, if the stream was not complete.
    pub fn on_stream_end(&mut self, end: &StreamEnd) -> Option<Failure> {
        self.end_to_end.record_ns(end.end_to_end_ns);
        self.unparsable += end.unparsable;
        self.max_gap_ns = self.max_gap_ns.max(end.max_gap_ns);
        if self
            .gap_limit_ns
            .is_some_and(|limit| end.max_gap_ns > limit)
        {
            self.streams_over_gap_limit += 1;
        }
        let failure = if let Some(message) = &end.error {
            self.note_error(format!("error event: {message}"));
            Some(Failure::ErrorEvent)
        } else if !end.done {
            self.note_error("stream ended without [DONE]".to_string());
            Some(Failure::Truncated)
        } else {
            None
        };
        match failure {
            None => self.ok += 1,
            Some(Failure::Truncated) => self.truncated += 1,
            Some(_) => self.errors.error_event += 1,
        }
        failure
    }

    /// A request failed before or while its body was read.
    pub fn on_failure(&mut self, failure: Failure, message: impl FnOnce() -> String) {
        match failure {
            Failure::Connect => self.errors.connect += 1,
            Failure::HttpStatus(code) => {
                self.errors.http_status += 1;
                *self.status_codes.entry(code).or_insert(0) += 1;
            }
            Failure::Io => self.errors.io += 1,
            Failure::Timeout => self.errors.timeout += 1,
            Failure::ErrorEvent => self.errors.error_event += 1,
            Failure::Truncated => self.truncated += 1,
            Failure::Overload => self.errors.dropped_overload += 1,
        }
        if self.first_error.is_none() {
            self.first_error = Some(message());
        }
    }

    fn note_error(&mut self, message: String) {
        if self.first_error.is_none() {
            self.first_error = Some(message);
        }
    }

    /// Requests completed cleanly so far.
    pub fn ok(&self) -> u64 {
        self.ok
    }

    /// Errors so far (truncations not included).
    pub fn errors_total(&self) -> u64 {
        self.errors.total()
    }

    /// Adds another thread's figures.
    pub fn merge(&mut self, other: &Recorder) {
        self.ttft.merge(&other.ttft);
        self.chunk_latency.merge(&other.chunk_latency);
        self.inter_chunk_gap.merge(&other.inter_chunk_gap);
        self.end_to_end.merge(&other.end_to_end);
        self.started += other.started;
        self.ok += other.ok;
        let (a, b) = (&mut self.errors, &other.errors);
        a.connect += b.connect;
        a.http_status += b.http_status;
        a.io += b.io;
        a.timeout += b.timeout;
        a.error_event += b.error_event;
        a.dropped_overload += b.dropped_overload;
        self.truncated += other.truncated;
        for (code, n) in &other.status_codes {
            *self.status_codes.entry(*code).or_insert(0) += n;
        }
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
        self.content_chunks += other.content_chunks;
        self.unstamped_chunks += other.unstamped_chunks;
        self.unparsable += other.unparsable;
        self.max_gap_ns = self.max_gap_ns.max(other.max_gap_ns);
        self.streams_over_gap_limit += other.streams_over_gap_limit;
        self.body_bytes = self.body_bytes.saturating_add(other.body_bytes);
    }

    /// The summary of a run that took `elapsed_ns`.
    pub fn summary(&self, elapsed_ns: u64) -> LoadSummary {
        let elapsed_s = elapsed_ns as f64 / 1e9;
        let per_s = |n: u64| {
            if elapsed_s > 0.0 {
                n as f64 / elapsed_s
            } else {
                0.0
            }
        };
        LoadSummary {
            elapsed_s,
            requests_started: self.started,
            requests_ok: self.ok,
            errors: self.errors,
            errors_total: self.errors.total(),
            truncated: self.truncated,
            http_status_codes: self.status_codes.clone(),
            first_error: self.first_error.clone(),
            content_chunks: self.content_chunks,
            unstamped_chunks: self.unstamped_chunks,
            unparsable_events: self.unparsable,
            max_gap_us: self.max_gap_ns as f64 / 1000.0,
            gap_limit_us: self.gap_limit_ns.map(|ns| ns as f64 / 1000.0),
            streams_over_gap_limit: self.streams_over_gap_limit,
            requests_per_s: per_s(self.ok),
            tokens_per_s: per_s(self.content_chunks),
            body_bytes: self.body_bytes,
            body_bytes_per_s: per_s(self.body_bytes),
            ttft: self.ttft.summary(),
            chunk_latency: self.chunk_latency.summary(),
            inter_chunk_gap: self.inter_chunk_gap.summary(),
            end_to_end: self.end_to_end.summary(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(done: bool, error: Option<&str>, max_gap_ns: u64) -> StreamEnd {
        StreamEnd {
            end_to_end_ns: 2_000,
            ttft_ns: Some(1_000),
            content_chunks: 2,
            unstamped_chunks: 0,
            max_gap_ns,
            done,
            error: error.map(str::to_string),
            unparsable: 0,
        }
    }

    #[test]
    fn streams_are_judged_and_counted() {
        let mut r = Recorder::new(Some(40));
        for _ in 0..4 {
            r.on_start();
        }
        r.on_observation(Observation::Content {
            ttft_ns: Some(1_000),
            latency_ns: Some(50),
            gap_ns: None,
        });
        r.on_observation(Observation::Content {
            ttft_ns: None,
            latency_ns: None,
            gap_ns: Some(30),
        });
        r.on_observation(Observation::Done);
        r.on_body_bytes(1_500);
        r.on_body_bytes(500);
        assert_eq!(r.on_stream_end(&end(true, None, 30)), None);
        assert_eq!(
            r.on_stream_end(&end(false, None, 41)),
            Some(Failure::Truncated)
        );
        assert_eq!(
            r.on_stream_end(&end(true, Some("boom"), 0)),
            Some(Failure::ErrorEvent)
        );
        r.on_failure(Failure::HttpStatus(503), || "status 503".into());
        let s = r.summary(2_000_000_000);
        assert_eq!(s.requests_started, 4);
        assert_eq!(s.requests_ok, 1);
        assert_eq!(s.truncated, 1);
        assert_eq!(s.errors.error_event, 1);
        assert_eq!(s.errors.http_status, 1);
        assert_eq!(s.errors_total, 2);
        assert_eq!(s.http_status_codes, BTreeMap::from([(503, 1)]));
        assert_eq!(
            s.first_error.as_deref(),
            Some("stream ended without [DONE]")
        );
        assert_eq!(s.content_chunks, 2);
        assert_eq!(s.unstamped_chunks, 1);
        assert_eq!(s.streams_over_gap_limit, 1);
        assert_eq!(s.max_gap_us, 0.041);
        assert_eq!(s.gap_limit_us, Some(0.04));
        assert_eq!(s.requests_per_s, 0.5);
        assert_eq!(s.tokens_per_s, 1.0);
        assert_eq!(s.body_bytes, 2_000);
        assert_eq!(s.body_bytes_per_s, 1_000.0);
        assert_eq!(s.ttft.count, 1);
        assert_eq!(s.chunk_latency.count, 1);
        assert_eq!(s.inter_chunk_gap.count, 1);
        assert_eq!(s.end_to_end.count, 3);
    }

    #[test]
    fn merge_adds_everything() {
        let mut a = Recorder::new(None);
        let mut b = Recorder::new(None);
        a.on_start();
        b.on_start();
        b.on_failure(Failure::Connect, || "refused".into());
        b.on_failure(Failure::Overload, || "cap".into());
        b.on_failure(Failure::HttpStatus(429), || "429".into());
        assert_eq!(a.on_stream_end(&end(true, None, 7)), None);
        a.on_body_bytes(10);
        b.on_body_bytes(32);
        a.merge(&b);
        let s = a.summary(0);
        assert_eq!(s.requests_started, 2);
        assert_eq!(s.requests_ok, 1);
        assert_eq!(s.errors.connect, 1);
        assert_eq!(s.errors.dropped_overload, 1);
        assert_eq!(s.errors_total, 3);
        assert_eq!(s.http_status_codes, BTreeMap::from([(429, 1)]));
        assert_eq!(s.first_error.as_deref(), Some("refused"));
        assert_eq!(s.requests_per_s, 0.0);
        assert_eq!(s.max_gap_us, 0.007);
        assert_eq!(s.body_bytes, 42);
    }
}
