//! Latency histograms and counters: recorded per core, merged on read,
//! rendered as a wrk2-style percentile distribution (the `SIGUSR1` dump) and
//! as Prometheus text 0.0.4 (`/metrics`) with fixed buckets ([`buckets`]),
//! beside the `process_*` series and `iop_build_info` ([`process`]).
//!
//! ```text
//!  core 0 thread ─record─► Registry (its own, uncontended Mutex) ─┐
//!  core 1 thread ─record─► Registry                               ├─ merged() ─► Registry ─► render_wrk2 (SIGUSR1 → stderr)
//!  exited threads ────────► retired Registry (folded in on exit) ─┘                     └──► render_prometheus (/metrics)
//! ```
//!
//! - [`Histogram`] wraps an HdrHistogram of microseconds: 3 significant
//!   digits, bounded to [`MAX_TRACKABLE_US`] (one hour; longer values are
//!   clamped), plus the fixed Prometheus buckets ([`buckets::Buckets`],
//!   0.5 ms to 60 s) with the exact sum, filled by the same record.
//! - [`Registry`] holds the fixed set of histograms ([`Latency`]) and
//!   counters ([`Count`]) of both binaries; each key belongs to one [`Side`]
//!   and renderers show one side. The set is closed: no labels, no names
//!   taken from requests. A histogram is allocated when its key is first
//!   recorded, or up front by [`prepare`] (each binary prepares the keys a
//!   thread records as the thread starts).
//! - Recording goes to the calling thread's registry ([`record`],
//!   [`record_since`], [`add`]). Each thread registers its registry in a
//!   process-wide list the first time it records; [`merged`] adds them all
//!   up. A thread that exits folds its registry into a retired one, so no
//!   sample is lost and memory stays bounded by the live threads.
//! - [`render_wrk2`] matches wrk2's latency report: the summary percentiles,
//!   then HdrHistogram's `outputPercentileDistribution` (5 ticks per half
//!   distance, milliseconds) with the `#[Mean …]`, `#[Max …]`, `#[Buckets …]`
//!   footer. [`render_prometheus`] writes histograms in base units
//!   (`iop_<side>_<name>_seconds_bucket{le=…}`, `_sum`, `_count`) and
//!   `_total` counters.
//! - [`spawn_usr1_dumper`] writes [`render_wrk2`] of [`merged`] to stderr on
//!   every `SIGUSR1`.
//!
//! Why a `Mutex` per core rather than an `Rc<RefCell<_>>`: the reader on one
//! core must see other cores' samples without a round trip through their
//! mailboxes. The recording core is the only other user of its lock, so a
//! record is an uncontended lock (two atomic operations) plus the histogram
//! increment; contention happens only while a reader merges.

use std::fmt;
use std::time::Duration;

pub mod buckets;
mod per_core;
pub mod process;
mod render;

pub use per_core::{
    add, dump_on_sigusr1, merged, prepare, record, record_between, record_since, spawn_usr1_dumper,
};
pub use render::{render_prometheus, render_wrk2, WRK2_PERCENTILES};

/// Largest value a histogram tells apart: one hour, in microseconds. Larger
/// values are recorded as this value.
pub const MAX_TRACKABLE_US: u64 = 3_600_000_000;

/// Significant decimal digits kept by every histogram (values below 2048 µs
/// are exact; above, the error is under 0.1 %).
pub const SIGNIFICANT_DIGITS: u8 = 3;

/// Which binary a metric belongs to: its name prefix (`iop_edge_`,
/// `iop_node_`) and which dump shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The Edge gateway.
    Edge,
    /// A Node daemon.
    Node,
}

impl Side {
    /// `edge` or `node`.
    pub fn name(self) -> &'static str {
        match self {
            Side::Edge => "edge",
            Side::Node => "node",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A latency histogram of the fixed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Latency {
    /// Edge: a request's submit to `Control` until its admission answer
    /// (lease won or rejected).
    EdgeQueueWait,
    /// Edge: added relay latency per body chunk, from the node frame being
    /// taken off the request's route queue until the client write completes.
    EdgeRelayChunkLatency,
    /// Edge: an inference request read until its response finished.
    EdgeEndToEnd,
    /// Node: provider call start (connect included) until its first output
    /// (the response head).
    NodeProviderTimeToFirstByte,
    /// Node: added relay latency per chunk, from the provider read until the
    /// frame is queued on the Edge connection.
    NodeRelayChunkLatency,
    /// Node: provider call start until the call returns or is aborted.
    NodeProviderCallDuration,
}

impl Latency {
    /// Every histogram, in rendering order.
    pub const ALL: [Latency; 6] = [
        Latency::EdgeQueueWait,
        Latency::EdgeRelayChunkLatency,
        Latency::EdgeEndToEnd,
        Latency::NodeProviderTimeToFirstByte,
        Latency::NodeRelayChunkLatency,
        Latency::NodeProviderCallDuration,
    ];

    /// The histograms `side` records.
    pub fn of_side(side: Side) -> &'static [Latency] {
        match side {
            Side::Edge => &Self::ALL[..3],
            Side::Node => &Self::ALL[3..],
        }
    }

    /// The binary that records it.
    pub fn side(self) -> Side {
        match self {
            Latency::EdgeQueueWait | Latency::EdgeRelayChunkLatency | Latency::EdgeEndToEnd => {
                Side::Edge
            }
            Latency::NodeProviderTimeToFirstByte
            | Latency::NodeRelayChunkLatency
            | Latency::NodeProviderCallDuration => Side::Node,
        }
    }

    /// The name within its side (`queue_wait`); the Prometheus name is
    /// `iop_<side>_<name>_seconds`.
    pub fn name(self) -> &'static str {
        match self {
            Latency::EdgeQueueWait => "queue_wait",
            Latency::EdgeRelayChunkLatency | Latency::NodeRelayChunkLatency => {
                "relay_chunk_latency"
            }
            Latency::EdgeEndToEnd => "end_to_end",
            Latency::NodeProviderTimeToFirstByte => "provider_time_to_first_byte",
            Latency::NodeProviderCallDuration => "provider_call_duration",
        }
    }

    /// One line for Prometheus `# HELP`.
    pub fn help(self) -> &'static str {
        match self {
            Latency::EdgeQueueWait => "Time from request submit to its admission answer.",
            Latency::EdgeRelayChunkLatency => {
                "Added relay latency per body chunk: route queue to client write completion."
            }
            Latency::EdgeEndToEnd => "Time from inference request read to response finished.",
            Latency::NodeProviderTimeToFirstByte => {
                "Time from provider call start to its first output."
            }
            Latency::NodeRelayChunkLatency => {
                "Added relay latency per chunk: provider read to frame queued for the Edge."
            }
            Latency::NodeProviderCallDuration => {
                "Time from provider call start to its return or abort."
            }
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A counter of the fixed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Count {
    /// Edge: response body bytes relayed from tunnel frames to clients.
    EdgeRelayBodyBytes,
    /// Edge: client connections accepted.
    EdgeClientConnectionsAccepted,
    /// Edge: client connections closed (accepted minus closed is the
    /// number open).
    EdgeClientConnectionsClosed,
    /// Edge: times the client accept loop stopped at
    /// `edge.max_client_connections` (new connections waited in the
    /// kernel's backlog).
    EdgeClientAcceptPaused,
    /// Edge: idle keep-alive client connections closed at
    /// `edge.max_client_connections` to admit a new connection.
    EdgeClientIdleReclaimed,
    /// Edge: client connections refused at
    /// `edge.max_client_connections_per_peer`.
    EdgeClientPeerCapRefusals,
    /// Edge: client connections cut off because a request head did not
    /// arrive within `edge.client_head_timeout_ms`.
    EdgeClientHeadTimeouts,
    /// Edge: client connections cut off because a request body paused
    /// longer than `edge.client_body_idle_timeout_ms`.
    EdgeClientBodyTimeouts,
    /// Edge: kept-alive client connections closed after
    /// `edge.client_keep_alive_timeout_ms` without a request.
    EdgeClientIdleTimeouts,
    /// Edge: client connections reset because the client took no bytes of
    /// a response for `edge.client_write_stall_timeout_ms`.
    EdgeClientWriteStalls,
    /// Edge: requests refused before routing because their HTTP framing
    /// was bad or over a limit (400, 413, 431, 501).
    EdgeClientRequestErrors,
    /// Edge: requests answered 401 or 403 on their head, before their body
    /// was read (no key, an unknown key, or a key without the scope).
    EdgeClientAuthRefusals,
    /// Edge: request bodies refused because their JSON nesting, element
    /// count or top-level member count is over `edge.max_json_depth` /
    /// `edge.max_json_elements` / `edge.max_json_members`.
    EdgeClientJsonLimitRejections,
    /// Edge: lingering closes after an early answer.
    EdgeClientLingeringCloses,
    /// Edge: request bytes read and discarded by lingering closes.
    EdgeClientLingerDiscardedBytes,
    /// Edge: HTTPS client connections cut off because their TLS handshake
    /// did not finish within `edge.client_head_timeout_ms`.
    EdgeClientTlsHandshakeTimeouts,
    /// Edge: HTTPS client connections whose TLS handshake failed (not TLS,
    /// no shared protocol, a client certificate refused).
    EdgeClientTlsHandshakeFailures,
    /// Edge: node TLS handshakes started.
    EdgeNodeHandshakesStarted,
    /// Edge: node TLS handshakes ended (done, failed or timed out; started
    /// minus ended is the number in progress).
    EdgeNodeHandshakesEnded,
    /// Edge: node TLS handshakes cut off at `edge.node_handshake_timeout_ms`.
    EdgeNodeHandshakeTimeouts,
    /// Edge: node TLS handshakes that failed (bad certificate, wrong
    /// identity, not TLS).
    EdgeNodeHandshakeFailures,
    /// Edge: node connections closed because no byte (no TLS ClientHello)
    /// arrived within `edge.node_first_byte_timeout_ms`.
    EdgeNodeFirstByteTimeouts,
    /// Edge: node connections closed at once at
    /// `edge.max_node_handshakes_per_peer`.
    EdgeNodePeerCapRefusals,
    /// Edge: times the node accept loop stopped at
    /// `edge.max_node_handshakes` (new connections waited in the kernel's
    /// backlog).
    EdgeNodeAcceptPaused,
    /// Node: provider calls aborted before they returned (watchdog, cancel,
    /// session end).
    NodeProviderCallsAborted,
    /// Node: usage-only events left out of tunnelled streams whose client
    /// did not ask for usage (the Edge asked on its behalf).
    NodeTunnelUsageChunksStripped,
    /// Node: tunnelled streams that asked for usage and ended without any
    /// (a provider that ignores `stream_options.include_usage`).
    NodeTunnelUsageMissing,
    /// Node: events of such streams relayed without the usage-chunk check,
    /// still undecided past the hold cap.
    NodeTunnelEventsUnchecked,
    /// Edge: spans started by request tracing (`[tracing]`); stays 0 while
    /// tracing is off.
    EdgeTraceSpansStarted,
    /// Edge: spans the OTLP collector accepted.
    EdgeTraceSpansExported,
    /// Edge: finished spans lost: the export queue was full, or their batch
    /// failed after its retries.
    EdgeTraceSpansDropped,
    /// Edge: OTLP export requests that failed after their retries.
    EdgeTraceExportFailures,
    /// Node: spans started by provider-call tracing (`[tracing]`); stays 0
    /// while tracing is off.
    NodeTraceSpansStarted,
    /// Node: spans the OTLP collector accepted.
    NodeTraceSpansExported,
    /// Node: finished spans lost (queue full, or failed export).
    NodeTraceSpansDropped,
    /// Node: OTLP export requests that failed after their retries.
    NodeTraceExportFailures,
}

impl Count {
    /// Every counter, in rendering order.
    pub const ALL: [Count; 36] = [
        Count::EdgeRelayBodyBytes,
        Count::EdgeClientConnectionsAccepted,
        Count::EdgeClientConnectionsClosed,
        Count::EdgeClientAcceptPaused,
        Count::EdgeClientIdleReclaimed,
        Count::EdgeClientPeerCapRefusals,
        Count::EdgeClientHeadTimeouts,
        Count::EdgeClientBodyTimeouts,
        Count::EdgeClientIdleTimeouts,
        Count::EdgeClientWriteStalls,
        Count::EdgeClientRequestErrors,
        Count::EdgeClientAuthRefusals,
        Count::EdgeClientJsonLimitRejections,
        Count::EdgeClientLingeringCloses,
        Count::EdgeClientLingerDiscardedBytes,
        Count::EdgeClientTlsHandshakeTimeouts,
        Count::EdgeClientTlsHandshakeFailures,
        Count::EdgeNodeHandshakesStarted,
        Count::EdgeNodeHandshakesEnded,
        Count::EdgeNodeHandshakeTimeouts,
        Count::EdgeNodeHandshakeFailures,
        Count::EdgeNodeFirstByteTimeouts,
        Count::EdgeNodePeerCapRefusals,
        Count::EdgeNodeAcceptPaused,
        Count::NodeProviderCallsAborted,
        Count::NodeTunnelUsageChunksStripped,
        Count::NodeTunnelUsageMissing,
        Count::NodeTunnelEventsUnchecked,
        Count::EdgeTraceSpansStarted,
        Count::EdgeTraceSpansExported,
        Count::EdgeTraceSpansDropped,
        Count::EdgeTraceExportFailures,
        Count::NodeTraceSpansStarted,
        Count::NodeTraceSpansExported,
        Count::NodeTraceSpansDropped,
        Count::NodeTraceExportFailures,
    ];

    /// The binary that counts it.
    pub fn side(self) -> Side {
        match self {
            Count::NodeProviderCallsAborted
            | Count::NodeTunnelUsageChunksStripped
            | Count::NodeTunnelUsageMissing
            | Count::NodeTunnelEventsUnchecked
            | Count::NodeTraceSpansStarted
            | Count::NodeTraceSpansExported
            | Count::NodeTraceSpansDropped
            | Count::NodeTraceExportFailures => Side::Node,
            _ => Side::Edge,
        }
    }

    /// The name within its side; the Prometheus name is
    /// `iop_<side>_<name>_total`.
    pub fn name(self) -> &'static str {
        match self {
            Count::EdgeRelayBodyBytes => "relay_body_bytes",
            Count::EdgeClientConnectionsAccepted => "client_connections_accepted",
            Count::EdgeClientConnectionsClosed => "client_connections_closed",
            Count::EdgeClientAcceptPaused => "client_accept_paused",
            Count::EdgeClientIdleReclaimed => "client_idle_reclaimed",
            Count::EdgeClientPeerCapRefusals => "client_peer_cap_refusals",
            Count::EdgeClientAuthRefusals => "client_auth_refusals",
            Count::EdgeNodeFirstByteTimeouts => "node_first_byte_timeouts",
            Count::EdgeNodePeerCapRefusals => "node_peer_cap_refusals",
            Count::EdgeClientHeadTimeouts => "client_head_timeouts",
            Count::EdgeClientBodyTimeouts => "client_body_timeouts",
            Count::EdgeClientIdleTimeouts => "client_idle_timeouts",
            Count::EdgeClientWriteStalls => "client_write_stalls",
            Count::EdgeClientRequestErrors => "client_request_errors",
            Count::EdgeClientJsonLimitRejections => "client_json_limit_rejections",
            Count::EdgeClientLingeringCloses => "client_lingering_closes",
            Count::EdgeClientLingerDiscardedBytes => "client_linger_discarded_bytes",
            Count::EdgeClientTlsHandshakeTimeouts => "client_tls_handshake_timeouts",
            Count::EdgeClientTlsHandshakeFailures => "client_tls_handshake_failures",
            Count::EdgeNodeHandshakesStarted => "node_handshakes_started",
            Count::EdgeNodeHandshakesEnded => "node_handshakes_ended",
            Count::EdgeNodeHandshakeTimeouts => "node_handshake_timeouts",
            Count::EdgeNodeHandshakeFailures => "node_handshake_failures",
            Count::EdgeNodeAcceptPaused => "node_accept_paused",
            Count::NodeProviderCallsAborted => "provider_calls_aborted",
            Count::NodeTunnelUsageChunksStripped => "tunnel_usage_chunks_stripped",
            Count::NodeTunnelUsageMissing => "tunnel_usage_missing",
            Count::NodeTunnelEventsUnchecked => "tunnel_events_unchecked",
            Count::EdgeTraceSpansStarted | Count::NodeTraceSpansStarted => "trace_spans_started",
            Count::EdgeTraceSpansExported | Count::NodeTraceSpansExported => "trace_spans_exported",
            Count::EdgeTraceSpansDropped | Count::NodeTraceSpansDropped => "trace_spans_dropped",
            Count::EdgeTraceExportFailures | Count::NodeTraceExportFailures => {
                "trace_export_failures"
            }
        }
    }

    /// One line for Prometheus `# HELP`.
    pub fn help(self) -> &'static str {
        match self {
            Count::EdgeRelayBodyBytes => "Response body bytes relayed from tunnels to clients.",
            Count::EdgeClientConnectionsAccepted => "Client connections accepted.",
            Count::EdgeClientConnectionsClosed => "Client connections closed.",
            Count::EdgeClientAcceptPaused => {
                "Times the client accept loop stopped at edge.max_client_connections."
            }
            Count::EdgeClientIdleReclaimed => {
                "Idle keep-alive client connections closed at edge.max_client_connections to admit a new one."
            }
            Count::EdgeClientPeerCapRefusals => {
                "Client connections refused at edge.max_client_connections_per_peer."
            }
            Count::EdgeClientAuthRefusals => {
                "Requests answered 401 or 403 on their head, before their body was read."
            }
            Count::EdgeNodeFirstByteTimeouts => {
                "Node connections closed at edge.node_first_byte_timeout_ms (no TLS ClientHello)."
            }
            Count::EdgeNodePeerCapRefusals => {
                "Node connections closed at edge.max_node_handshakes_per_peer."
            }
            Count::EdgeClientHeadTimeouts => {
                "Client connections cut off at edge.client_head_timeout_ms."
            }
            Count::EdgeClientBodyTimeouts => {
                "Client connections cut off at edge.client_body_idle_timeout_ms or below edge.client_body_min_rate_bytes_per_sec."
            }
            Count::EdgeClientIdleTimeouts => {
                "Idle keep-alive client connections closed at edge.client_keep_alive_timeout_ms."
            }
            Count::EdgeClientWriteStalls => {
                "Client connections reset at edge.client_write_stall_timeout_ms (the client stopped reading)."
            }
            Count::EdgeClientRequestErrors => {
                "Requests refused for bad or oversized HTTP framing (400, 413, 431, 501)."
            }
            Count::EdgeClientJsonLimitRejections => {
                "Request bodies refused at edge.max_json_depth, edge.max_json_elements or edge.max_json_members."
            }
            Count::EdgeClientLingeringCloses => "Lingering closes after an early answer.",
            Count::EdgeClientLingerDiscardedBytes => {
                "Request bytes read and discarded by lingering closes."
            }
            Count::EdgeClientTlsHandshakeTimeouts => {
                "HTTPS client handshakes cut off at edge.client_head_timeout_ms."
            }
            Count::EdgeClientTlsHandshakeFailures => "HTTPS client handshakes that failed.",
            Count::EdgeNodeHandshakesStarted => "Node TLS handshakes started.",
            Count::EdgeNodeHandshakesEnded => "Node TLS handshakes ended (any outcome).",
            Count::EdgeNodeHandshakeTimeouts => {
                "Node TLS handshakes cut off at edge.node_handshake_timeout_ms."
            }
            Count::EdgeNodeHandshakeFailures => "Node TLS handshakes that failed.",
            Count::EdgeNodeAcceptPaused => {
                "Times the node accept loop stopped at edge.max_node_handshakes."
            }
            Count::NodeProviderCallsAborted => "Provider calls aborted before they returned.",
            Count::NodeTunnelUsageChunksStripped => {
                "Usage-only stream events left out for clients that did not ask for usage."
            }
            Count::NodeTunnelUsageMissing => {
                "Tunnelled streams that asked the provider for usage and got none."
            }
            Count::NodeTunnelEventsUnchecked => {
                "Stream events relayed without the usage-chunk check (past the hold cap)."
            }
            Count::EdgeTraceSpansStarted | Count::NodeTraceSpansStarted => {
                "Spans started by request tracing ([tracing]); 0 while tracing is off."
            }
            Count::EdgeTraceSpansExported | Count::NodeTraceSpansExported => {
                "Spans the OTLP collector accepted."
            }
            Count::EdgeTraceSpansDropped | Count::NodeTraceSpansDropped => {
                "Finished spans lost: export queue full, or their batch failed after its retries."
            }
            Count::EdgeTraceExportFailures | Count::NodeTraceExportFailures => {
                "OTLP export requests that failed after their retries."
            }
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A metrics operation that cannot be carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    /// The histograms have different bounds (never the case for histograms
    /// built by [`Histogram::new`]).
    #[error("cannot merge histograms with different bounds: {0:?}")]
    Merge(hdrhistogram::AdditionError),
}

/// A latency histogram in microseconds with an exact sum, and the same
/// samples in the fixed Prometheus buckets.
#[derive(Clone)]
pub struct Histogram {
    hdr: hdrhistogram::Histogram<u64>,
    sum_us: u64,
    buckets: buckets::Buckets,
}

impl Histogram {
    /// An empty histogram: 1 µs to [`MAX_TRACKABLE_US`], [`SIGNIFICANT_DIGITS`].
    pub fn new() -> Self {
        // Constant bounds (checked by a test): this cannot fail.
        let hdr = hdrhistogram::Histogram::new_with_bounds(1, MAX_TRACKABLE_US, SIGNIFICANT_DIGITS)
            .expect("constant histogram bounds are valid");
        Self {
            hdr,
            sum_us: 0,
            buckets: buckets::Buckets::default(),
        }
    }

    /// Records one value in microseconds (clamped to [`MAX_TRACKABLE_US`]).
    pub fn record_us(&mut self, value_us: u64) {
        let value_us = value_us.min(MAX_TRACKABLE_US);
        self.hdr.saturating_record(value_us);
        self.sum_us = self.sum_us.saturating_add(value_us);
        self.buckets.observe_us(value_us);
    }

    /// Records one duration, truncated to whole microseconds.
    pub fn record(&mut self, elapsed: Duration) {
        self.record_us(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX));
    }

    /// Adds every sample of `other` to this one.
    pub fn merge(&mut self, other: &Histogram) -> Result<(), MetricsError> {
        self.hdr.add(&other.hdr).map_err(MetricsError::Merge)?;
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
        self.buckets.merge(&other.buckets);
        Ok(())
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.hdr.len()
    }

    /// Exact sum of the samples, in microseconds.
    pub fn sum_us(&self) -> u64 {
        self.sum_us
    }

    /// Largest sample (its bucket's highest equivalent value), 0 when empty.
    pub fn max_us(&self) -> u64 {
        self.hdr.max()
    }

    /// The value at `quantile` (0.0–1.0), 0 when empty.
    pub fn value_at_quantile_us(&self, quantile: f64) -> u64 {
        self.hdr.value_at_quantile(quantile)
    }

    /// The samples in the fixed Prometheus buckets.
    pub fn buckets(&self) -> &buckets::Buckets {
        &self.buckets
    }

    /// The HdrHistogram underneath, for renderers.
    pub fn hdr(&self) -> &hdrhistogram::Histogram<u64> {
        &self.hdr
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Histogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Histogram")
            .field("count", &self.count())
            .field("sum_us", &self.sum_us)
            .field("max_us", &self.max_us())
            .finish()
    }
}

/// The fixed set of histograms and counters of one core (or of several,
/// merged).
///
/// A histogram takes its memory (~190 KiB, mostly HdrHistogram counts) when
/// its key is first recorded or [`prepared`](Self::prepare), so a process
/// holds only the keys of its own [`Side`], and a registry that only counts
/// (or an empty merge target) costs a few hundred bytes.
#[derive(Debug, Clone)]
pub struct Registry {
    histograms: [Option<Box<Histogram>>; Latency::ALL.len()],
    counters: [u64; Count::ALL.len()],
}

/// What [`Registry::histogram`] shows for a key nothing recorded.
static EMPTY_HISTOGRAM: std::sync::OnceLock<Histogram> = std::sync::OnceLock::new();

impl Registry {
    /// Every histogram empty, every counter 0; nothing allocated yet.
    pub fn new() -> Self {
        Self {
            histograms: std::array::from_fn(|_| None),
            counters: [0; Count::ALL.len()],
        }
    }

    /// Allocates the histograms of `keys` now, so that recording them
    /// later allocates nothing.
    pub fn prepare(&mut self, keys: &[Latency]) {
        for &key in keys {
            self.slot(key);
        }
    }

    fn slot(&mut self, key: Latency) -> &mut Histogram {
        self.histograms[key.index()].get_or_insert_with(Box::default)
    }

    /// Records `elapsed` in `key`'s histogram.
    pub fn record(&mut self, key: Latency, elapsed: Duration) {
        self.slot(key).record(elapsed);
    }

    /// Records a value in microseconds in `key`'s histogram.
    pub fn record_us(&mut self, key: Latency, value_us: u64) {
        self.slot(key).record_us(value_us);
    }

    /// Adds `n` to `key`'s counter (saturating).
    pub fn add(&mut self, key: Count, n: u64) {
        let counter = &mut self.counters[key.index()];
        *counter = counter.saturating_add(n);
    }

    /// `key`'s histogram (an empty one if nothing was recorded).
    pub fn histogram(&self, key: Latency) -> &Histogram {
        match &self.histograms[key.index()] {
            Some(histogram) => histogram,
            None => EMPTY_HISTOGRAM.get_or_init(Histogram::new),
        }
    }

    /// Whether `key`'s histogram holds memory (it was recorded or
    /// prepared).
    pub fn is_allocated(&self, key: Latency) -> bool {
        self.histograms[key.index()].is_some()
    }

    /// `key`'s counter.
    pub fn counter(&self, key: Count) -> u64 {
        self.counters[key.index()]
    }

    /// Adds every sample and count of `other` to this one.
    pub fn merge(&mut self, other: &Registry) -> Result<(), MetricsError> {
        for key in Latency::ALL {
            if let Some(theirs) = &other.histograms[key.index()] {
                self.slot(key).merge(theirs)?;
            }
        }
        for (mine, theirs) in self.counters.iter_mut().zip(&other.counters) {
            *mine = mine.saturating_add(*theirs);
        }
        Ok(())
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_indexed_in_order_and_named_per_side() {
        for (i, key) in Latency::ALL.iter().enumerate() {
            assert_eq!(key.index(), i);
        }
        for (i, key) in Count::ALL.iter().enumerate() {
            assert_eq!(key.index(), i);
        }
        let edge: Vec<&str> = Latency::ALL
            .iter()
            .filter(|k| k.side() == Side::Edge)
            .map(|k| k.name())
            .collect();
        assert_eq!(edge, ["queue_wait", "relay_chunk_latency", "end_to_end"]);
        let node: Vec<&str> = Latency::ALL
            .iter()
            .filter(|k| k.side() == Side::Node)
            .map(|k| k.name())
            .collect();
        assert_eq!(
            node,
            [
                "provider_time_to_first_byte",
                "relay_chunk_latency",
                "provider_call_duration"
            ]
        );
    }

    #[test]
    fn a_registry_allocates_only_the_histograms_it_records_or_prepares() {
        let mut r = Registry::new();
        assert!(Latency::ALL.iter().all(|&k| !r.is_allocated(k)));
        assert_eq!(r.histogram(Latency::EdgeEndToEnd).count(), 0);
        assert!(
            !r.is_allocated(Latency::EdgeEndToEnd),
            "reading allocates nothing"
        );

        r.prepare(Latency::of_side(Side::Node));
        let allocated: Vec<Latency> = Latency::ALL
            .into_iter()
            .filter(|&k| r.is_allocated(k))
            .collect();
        assert_eq!(
            allocated,
            [
                Latency::NodeProviderTimeToFirstByte,
                Latency::NodeRelayChunkLatency,
                Latency::NodeProviderCallDuration
            ]
        );
        assert!(Latency::of_side(Side::Edge)
            .iter()
            .all(|k| k.side() == Side::Edge));
        assert_eq!(
            Latency::of_side(Side::Edge).len() + Latency::of_side(Side::Node).len(),
            Latency::ALL.len()
        );

        r.record_us(Latency::EdgeQueueWait, 250);
        assert!(r.is_allocated(Latency::EdgeQueueWait));
        assert!(!r.is_allocated(Latency::EdgeEndToEnd));

        // A merge allocates the keys the other side holds, and only those.
        let mut total = Registry::new();
        total.merge(&r).expect("same bounds");
        total.merge(&r).expect("same bounds");
        assert_eq!(total.histogram(Latency::EdgeQueueWait).count(), 2);
        assert_eq!(total.histogram(Latency::EdgeQueueWait).sum_us(), 500);
        assert!(total.is_allocated(Latency::NodeRelayChunkLatency));
        assert!(!total.is_allocated(Latency::EdgeRelayChunkLatency));
    }

    #[test]
    fn histogram_bounds_are_valid_and_clamp_at_one_hour() {
        let mut h = Histogram::new();
        assert_eq!(h.hdr().buckets(), 22);
        h.record(Duration::from_secs(7200));
        assert_eq!(h.count(), 1);
        assert_eq!(h.sum_us(), MAX_TRACKABLE_US);
        assert!(h.hdr().equivalent(h.max_us(), MAX_TRACKABLE_US));
        h.record(Duration::from_nanos(999));
        assert_eq!(h.value_at_quantile_us(0.0), 0);
        assert_eq!(h.sum_us(), MAX_TRACKABLE_US);
    }
}
