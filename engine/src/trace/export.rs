//! OTLP/HTTP export on a thread of its own, so a worker core never waits
//! for a collector.
//!
//! ```text
//!  shard/core ─submit(spans of one request)─► bounded queue ─► exporter thread
//!     (try_send: full → dropped and counted)       Batcher ─► encode ─► POST {endpoint}/v1/traces
//!                                                   (≤ BATCH_SPANS_MAX spans, ≤ FLUSH_INTERVAL old)
//! ```
//!
//! Every wait is bounded: the connect ([`CONNECT_TIMEOUT`]), each read and
//! write ([`IO_TIMEOUT`]), the retries ([`RETRIES_MAX`], with a doubling
//! pause, only for a transport error or 429/502/503/504). A batch that
//! still fails is dropped and counted: an unreachable collector loses
//! spans, never requests. While the thread retries, the queue fills and
//! what does not fit is dropped at the `submit`.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use crate::clock;
use crate::metrics::{self, Count, Side};

use super::otlp;
use super::span::SpanRecord;

/// Requests' span lists queued for the exporter thread at most.
pub const QUEUE_REQUESTS_MAX: usize = 4096;
/// Spans sent in one export request at most.
pub const BATCH_SPANS_MAX: usize = 512;
/// How long the first span of a batch waits for more before it is sent.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// Connecting to the collector.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Each read and write of an export request.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries of a failed export request (so at most 3 tries).
pub const RETRIES_MAX: u32 = 2;
/// The pause before the first retry; each next one doubles it.
pub const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// Longest response head read from the collector.
const RESPONSE_HEAD_BYTES_MAX: usize = 16 * 1024;

/// The collector's OTLP/HTTP address: `http://host[:port][/base]`, traces
/// posted to `/base/v1/traces`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpEndpoint {
    host: String,
    port: u16,
    traces_path: String,
    text: String,
}

impl OtlpEndpoint {
    /// Parses an `otlp_endpoint` value; the reason when it is not one.
    pub fn parse(text: &str) -> Result<Self, String> {
        let rest = text.strip_prefix("http://").ok_or_else(|| {
            if text.starts_with("https://") {
                "https is not supported: give the http:// address of a collector or agent \
                 on a trusted network (e.g. http://127.0.0.1:4318)"
                    .to_owned()
            } else {
                format!("{text:?} is not an http:// URL (e.g. http://127.0.0.1:4318)")
            }
        })?;
        let (authority, base) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        if base.contains(['?', '#']) {
            return Err("the endpoint takes no query or fragment".to_owned());
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(']') || authority.starts_with('[') => {
                let port: u16 = port
                    .parse()
                    .map_err(|_| format!("port {port:?} is not a number from 1 to 65535"))?;
                (host, port)
            }
            _ => (authority, 80),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || port == 0 {
            return Err(format!("{text:?} names no host and port"));
        }
        if !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:".contains(&b))
        {
            return Err(format!("host {host:?} is not a name or an address"));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
            traces_path: format!("{}/v1/traces", base.trim_end_matches('/')),
            text: text.to_owned(),
        })
    }

    /// The path traces are posted to.
    pub fn traces_path(&self) -> &str {
        &self.traces_path
    }

    /// The value as configured.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// The counters one side's exporter keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceCounts {
    /// Spans started.
    pub started: Count,
    /// Spans the collector accepted.
    pub exported: Count,
    /// Spans lost.
    pub dropped: Count,
    /// Failed export requests.
    pub failures: Count,
}

impl TraceCounts {
    /// The counters of `side`.
    pub fn of(side: Side) -> Self {
        match side {
            Side::Edge => Self {
                started: Count::EdgeTraceSpansStarted,
                exported: Count::EdgeTraceSpansExported,
                dropped: Count::EdgeTraceSpansDropped,
                failures: Count::EdgeTraceExportFailures,
            },
            Side::Node => Self {
                started: Count::NodeTraceSpansStarted,
                exported: Count::NodeTraceSpansExported,
                dropped: Count::NodeTraceSpansDropped,
                failures: Count::NodeTraceExportFailures,
            },
        }
    }
}

/// Where finished spans go: a sender to the exporter thread (cheap to
/// clone; each shard keeps one).
#[derive(Debug, Clone)]
pub struct ExportHandle {
    tx: SyncSender<Vec<SpanRecord>>,
    counts: TraceCounts,
}

impl ExportHandle {
    /// The counters of this exporter's side.
    pub fn counts(&self) -> TraceCounts {
        self.counts
    }

    /// Queues the spans of one request; never waits. When the queue is
    /// full (or the thread is gone) they are dropped and counted.
    pub fn submit(&self, spans: Vec<SpanRecord>) {
        if spans.is_empty() {
            return;
        }
        match self.tx.try_send(spans) {
            Ok(()) => {}
            Err(TrySendError::Full(spans) | TrySendError::Disconnected(spans)) => {
                metrics::add(self.counts.dropped, spans.len() as u64);
            }
        }
    }
}

/// Starts the exporter thread of `side` for `endpoint`, naming the
/// process `service_name` on every batch.
pub fn start(
    endpoint: OtlpEndpoint,
    service_name: String,
    side: Side,
) -> std::io::Result<ExportHandle> {
    let (tx, rx) = mpsc::sync_channel(QUEUE_REQUESTS_MAX);
    let counts = TraceCounts::of(side);
    std::thread::Builder::new()
        .name("iop-otlp".into())
        .spawn(move || run(&rx, &endpoint, &service_name, counts))?;
    Ok(ExportHandle { tx, counts })
}

/// A handle whose spans go to `rx` (tests read them there).
pub fn channel(side: Side, capacity: usize) -> (ExportHandle, mpsc::Receiver<Vec<SpanRecord>>) {
    let (tx, rx) = mpsc::sync_channel(capacity);
    (
        ExportHandle {
            tx,
            counts: TraceCounts::of(side),
        },
        rx,
    )
}

/// Gathers spans into batches: one is due when it holds
/// [`BATCH_SPANS_MAX`] spans or its first span is [`FLUSH_INTERVAL`] old.
#[derive(Debug, Default)]
pub struct Batcher {
    spans: Vec<SpanRecord>,
    first_at: Option<Instant>,
}

impl Batcher {
    /// Adds the spans of one request, received at `now`.
    pub fn push(&mut self, now: Instant, spans: Vec<SpanRecord>) {
        if self.spans.is_empty() {
            self.first_at = Some(now);
        }
        self.spans.extend(spans);
    }

    /// When the batch is due by age; `None` while it is empty.
    pub fn deadline(&self) -> Option<Instant> {
        self.first_at.map(|at| at + FLUSH_INTERVAL)
    }

    /// The batch to send now, if one is due (full, or old enough).
    pub fn take_due(&mut self, now: Instant) -> Option<Vec<SpanRecord>> {
        let full = self.spans.len() >= BATCH_SPANS_MAX;
        let old = self.deadline().is_some_and(|at| now >= at);
        (full || old).then(|| self.take_all()).flatten()
    }

    /// Whatever is gathered (at shutdown).
    pub fn take_all(&mut self) -> Option<Vec<SpanRecord>> {
        self.first_at = None;
        (!self.spans.is_empty()).then(|| std::mem::take(&mut self.spans))
    }
}

/// How one export request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostOutcome {
    /// The collector answered with this status.
    Status(u16),
    /// No answer: connect, write or read failed or timed out.
    Transport,
}

/// The pause before retry number `retry` (0 for the first) after
/// `outcome`; `None`: do not retry (success, a permanent refusal, or the
/// retries are used up).
pub fn retry_pause(outcome: PostOutcome, retry: u32) -> Option<Duration> {
    let retryable = match outcome {
        PostOutcome::Transport => true,
        PostOutcome::Status(status) => matches!(status, 429 | 502 | 503 | 504),
    };
    (retryable && retry < RETRIES_MAX).then(|| RETRY_PAUSE * 2u32.pow(retry))
}

fn run(
    rx: &mpsc::Receiver<Vec<SpanRecord>>,
    endpoint: &OtlpEndpoint,
    service_name: &str,
    counts: TraceCounts,
) {
    let mut batcher = Batcher::default();
    loop {
        let received = match batcher.deadline() {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(at) => rx.recv_timeout(at.saturating_duration_since(clock::now())),
        };
        match received {
            Ok(spans) => batcher.push(clock::now(), spans),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                if let Some(batch) = batcher.take_all() {
                    send(endpoint, service_name, &batch, counts);
                }
                return;
            }
        }
        if let Some(batch) = batcher.take_due(clock::now()) {
            send(endpoint, service_name, &batch, counts);
        }
    }
}

/// Sends one batch with its retries, and counts what became of it.
fn send(endpoint: &OtlpEndpoint, service_name: &str, batch: &[SpanRecord], counts: TraceCounts) {
    let body = otlp::encode(service_name, batch);
    let mut retry = 0;
    loop {
        let outcome = post(endpoint, &body);
        if matches!(outcome, PostOutcome::Status(200..=299)) {
            metrics::add(counts.exported, batch.len() as u64);
            return;
        }
        match retry_pause(outcome, retry) {
            Some(pause) => {
                std::thread::sleep(pause);
                retry += 1;
            }
            None => {
                tracing::debug!(
                    endpoint = endpoint.as_str(),
                    ?outcome,
                    spans = batch.len(),
                    "OTLP export failed; spans dropped"
                );
                metrics::add(counts.failures, 1);
                metrics::add(counts.dropped, batch.len() as u64);
                return;
            }
        }
    }
}

/// One `POST {base}/v1/traces` on a new connection (closed after it).
fn post(endpoint: &OtlpEndpoint, body: &[u8]) -> PostOutcome {
    match try_post(endpoint, body) {
        Ok(status) => PostOutcome::Status(status),
        Err(_) => PostOutcome::Transport,
    }
}

fn try_post(endpoint: &OtlpEndpoint, body: &[u8]) -> std::io::Result<u16> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    let mut stream = None;
    for addr in (endpoint.host.as_str(), endpoint.port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let mut stream = stream.ok_or(last)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let host = if endpoint.host.contains(':') {
        format!("[{}]:{}", endpoint.host, endpoint.port)
    } else {
        format!("{}:{}", endpoint.host, endpoint.port)
    };
    let head = format!(
        "POST {} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/x-protobuf\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        endpoint.traces_path,
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut buf = vec![0u8; RESPONSE_HEAD_BYTES_MAX];
    let mut filled = 0;
    loop {
        let n = stream.read(&mut buf[filled..])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        filled += n;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(&buf[..filled]) {
            Ok(httparse::Status::Complete(_)) => {
                return response
                    .code
                    .ok_or_else(|| std::io::ErrorKind::InvalidData.into());
            }
            Ok(httparse::Status::Partial) if filled < buf.len() => {}
            _ => return Err(std::io::ErrorKind::InvalidData.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::trace::context::{SpanId, TraceId};
    use crate::trace::span::SpanKind;

    fn span(n: u8) -> SpanRecord {
        SpanRecord {
            trace_id: TraceId([n; 16]),
            span_id: SpanId([n; 8]),
            parent_id: None,
            tracestate: None,
            name: "request".into(),
            kind: SpanKind::Server,
            start_unix_ns: 1,
            end_unix_ns: 2,
            attributes: Vec::new(),
            events: Vec::new(),
            error: None,
        }
    }

    #[test]
    fn endpoints_parse_to_host_port_and_traces_path() {
        let e = OtlpEndpoint::parse("http://127.0.0.1:4318").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 4318));
        assert_eq!(e.traces_path(), "/v1/traces");
        let e = OtlpEndpoint::parse("http://collector.local/otlp/").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("collector.local", 80));
        assert_eq!(e.traces_path(), "/otlp/v1/traces");
        let e = OtlpEndpoint::parse("http://[::1]:4318").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 4318));
        for bad in [
            "https://127.0.0.1:4318",
            "127.0.0.1:4318",
            "http://:4318",
            "http://127.0.0.1:0",
            "http://127.0.0.1:x",
            "http://127.0.0.1:4318/v1?x=1",
            "http://bad host:1",
        ] {
            assert!(OtlpEndpoint::parse(bad).is_err(), "{bad}");
        }
        assert!(OtlpEndpoint::parse("https://c:4318")
            .unwrap_err()
            .contains("https is not supported"));
    }

    #[test]
    fn a_batch_is_due_when_full_or_old_enough() {
        let now = clock::now();
        let mut b = Batcher::default();
        assert_eq!(b.deadline(), None);
        assert_eq!(b.take_due(now), None);
        b.push(now, vec![span(1), span(2)]);
        assert_eq!(b.deadline(), Some(now + FLUSH_INTERVAL));
        assert_eq!(b.take_due(now + FLUSH_INTERVAL / 2), None);
        b.push(now + FLUSH_INTERVAL / 2, vec![span(3)]);
        let due = b.take_due(now + FLUSH_INTERVAL).unwrap();
        assert_eq!(due, vec![span(1), span(2), span(3)]);
        assert_eq!(b.deadline(), None);
        // Full: due at once.
        b.push(now, (0..BATCH_SPANS_MAX).map(|i| span(i as u8)).collect());
        assert_eq!(b.take_due(now).map(|v| v.len()), Some(BATCH_SPANS_MAX));
    }

    #[test]
    fn only_transport_errors_and_overload_are_retried_and_the_retries_are_bounded() {
        assert_eq!(retry_pause(PostOutcome::Transport, 0), Some(RETRY_PAUSE));
        assert_eq!(
            retry_pause(PostOutcome::Status(503), 1),
            Some(RETRY_PAUSE * 2)
        );
        assert_eq!(retry_pause(PostOutcome::Status(429), RETRIES_MAX), None);
        assert_eq!(retry_pause(PostOutcome::Status(400), 0), None);
        assert_eq!(retry_pause(PostOutcome::Status(200), 0), None);
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let (handle, rx) = channel(Side::Node, 1);
        let before = metrics::merged().counter(Count::NodeTraceSpansDropped);
        handle.submit(vec![span(1)]);
        handle.submit(vec![span(2), span(3)]);
        assert_eq!(rx.try_recv().unwrap(), vec![span(1)]);
        assert!(rx.try_recv().is_err());
        let after = metrics::merged().counter(Count::NodeTraceSpansDropped);
        assert!(after >= before + 2, "{before} → {after}");
    }

    #[test]
    fn a_post_reaches_the_collector_with_the_protobuf_body() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let n = conn.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
                if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&got[..end]).to_string();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .unwrap()
                        .parse()
                        .unwrap();
                    if got.len() >= end + 4 + len {
                        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                            .unwrap();
                        return (head, got[end + 4..].to_vec());
                    }
                }
            }
        });
        let endpoint = OtlpEndpoint::parse(&format!("http://127.0.0.1:{port}/base")).unwrap();
        let body = otlp::encode("svc", &[span(7)]);
        assert_eq!(post(&endpoint, &body), PostOutcome::Status(200));
        let (head, received) = server.join().unwrap();
        assert!(
            head.starts_with("POST /base/v1/traces HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(
            head.contains("content-type: application/x-protobuf"),
            "{head}"
        );
        assert_eq!(received, body);
    }

    #[test]
    fn an_unreachable_collector_is_a_transport_failure() {
        // A port that was just free: nothing listens there.
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let endpoint = OtlpEndpoint::parse(&format!("http://127.0.0.1:{port}")).unwrap();
        assert_eq!(post(&endpoint, b"x"), PostOutcome::Transport);
    }
}
