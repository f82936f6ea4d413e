//! `GET /ui` and `GET /ui/events`: the status page.
//!
//! The page ([`PAGE_HTML`], HTML, CSS and JS in one file compiled into the
//! binary) opens `/ui/events` with `fetch` and reads it as server-sent
//! events: one `data: <json>\n\n` per [`EVENT_INTERVAL`], built by the
//! sans-IO [`event_json`] from a [`Snapshot`] of `Control` (nodes,
//! providers, models), the merged metrics and the state of the access log
//! and usage file, with rates from the previous event's [`Sample`].
//!
//! ```text
//!  viewer ─GET /ui/events─► slot (this core's share of VIEWERS_MAX, else 503)
//!     ▲                      │ every EVENT_INTERVAL, while it reads:
//!     │                      ▼
//!     └── data: {json} ◄── event_json(Snapshot{with_control, merged()}, previous Sample)
//! ```
//!
//! Cheap by construction: nothing runs unless a viewer is connected (each
//! viewer's loop is its own request; there is no background task), one
//! event is built and written at a time (never queued), and a viewer's
//! socket gets a small send buffer, so one that stops reading fills it in
//! a few events and is reset at `edge.client_write_stall_timeout_ms` like
//! any client that takes no bytes. The only cost when nobody watches is
//! [`crate::plane::request_metrics::count_response`]: a relaxed atomic add
//! per inference response.
//!
//! Access: with `[[client_keys]]`, `/ui/events` needs an admin-scoped key
//! (the page asks for it and sends it as `Authorization: Bearer`); the page
//! itself holds no data and is served to anyone. Without keys both answer
//! loopback peers only ([`crate::client::admin::authorize_route`]).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::rc::Rc;

use std::time::{Duration, Instant};

use crate::client::conn::ClientStream;
use bytes::Bytes;
use iop_engine::clock;
use iop_engine::http::{HttpError, ServerConn, Watched};
use iop_engine::metrics::buckets::Buckets;
use iop_engine::metrics::{self as engine_metrics, Histogram, Latency};
use iop_wire::pb;
use serde_json::{json, Value};

use crate::client::admin::Requester;
use crate::client::status::{self, OutlierView};
use crate::control::{ModelView, NodePhase, NodeView, ProviderView};
use crate::link::edge::Edge;
use crate::plane::access::AccessStatus;
use crate::plane::client_keys::Authority;
use crate::plane::request_metrics::Sample;
use crate::plane::usage::UsageStatus;

/// The page, served as is.
pub const PAGE_HTML: &str = include_str!("ui/page.html");

/// Time between two events of one viewer.
pub const EVENT_INTERVAL: Duration = Duration::from_secs(1);

/// Most viewers streaming events at once over every core (503 beyond):
/// each core takes its share ([`viewers_per_core`]).
pub const VIEWERS_MAX: usize = 16;

/// The send buffer asked for on a viewer's socket: a few events.
pub const VIEWER_SEND_BUFFER_BYTES: usize = 4 * 1024;

thread_local! {
    /// Viewers streaming now on this core (a shard is one thread).
    static VIEWERS: Cell<usize> = const { Cell::new(0) };
}

/// The viewers one core of `cores` streams to at most: an even share of
/// [`VIEWERS_MAX`], at least one.
pub fn viewers_per_core(cores: usize) -> usize {
    (VIEWERS_MAX / cores.max(1)).max(1)
}

/// Per-second rates between two samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// Inference responses per second.
    pub requests_per_sec: f64,
    /// Failed ones (5xx or cut off) per second.
    pub errors_per_sec: f64,
    /// Failed ones among those of the interval (`None`: none finished).
    pub error_ratio: Option<f64>,
}

/// The rates from `previous` to `current`; `None` without a previous
/// sample or when no time passed. A counter that went backwards (never the
/// case in one process) counts as zero.
pub fn rates(previous: Option<&Sample>, current: &Sample) -> Option<Rates> {
    let previous = previous?;
    let elapsed_sec = current
        .at
        .checked_duration_since(previous.at)?
        .as_secs_f64();
    if elapsed_sec <= 0.0 {
        return None;
    }
    let requests = current.requests().saturating_sub(previous.requests());
    let failed = current.failed.saturating_sub(previous.failed);
    Some(Rates {
        requests_per_sec: round2(requests as f64 / elapsed_sec),
        errors_per_sec: round2(failed as f64 / elapsed_sec),
        error_ratio: (requests > 0).then(|| round2(failed as f64 / requests as f64)),
    })
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Percentiles of one latency histogram, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest sample.
    pub max_us: u64,
}

impl Percentiles {
    /// The percentiles of fixed buckets: each the upper bound of its
    /// bucket ([`Buckets::quantile_bound_us`]), `max` that of the highest
    /// non-empty one.
    pub fn of_buckets(b: &Buckets) -> Self {
        Self {
            count: b.count(),
            p50_us: b.quantile_bound_us(0.5),
            p90_us: b.quantile_bound_us(0.9),
            p99_us: b.quantile_bound_us(0.99),
            max_us: b.quantile_bound_us(1.0),
        }
    }

    /// The percentiles of `h` (all zero when empty).
    pub fn of(h: &Histogram) -> Self {
        Self {
            count: h.count(),
            p50_us: h.value_at_quantile_us(0.5),
            p90_us: h.value_at_quantile_us(0.9),
            p99_us: h.value_at_quantile_us(0.99),
            max_us: h.max_us(),
        }
    }

    fn json(&self) -> Value {
        json!({
            "count": self.count,
            "p50_us": self.p50_us,
            "p90_us": self.p90_us,
            "p99_us": self.p99_us,
            "max_us": self.max_us,
        })
    }
}

/// What one event shows, read at `now`.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// When `Control` was read.
    pub now: Instant,
    /// Every configured node.
    pub nodes: Vec<NodeView>,
    /// Every provider, as `/status` shows it.
    pub providers: Vec<pb::ProviderSnapshot>,
    /// Their passive-health state, by position.
    pub outliers: Vec<OutlierView>,
    /// Their drains and removal, by position.
    pub drains: Vec<ProviderView>,
    /// Every configured model.
    pub models: Vec<ModelView>,
    /// The response counters.
    pub sample: Sample,
    /// Time to first byte (admission to first body chunk written).
    pub time_to_first_byte: Percentiles,
    /// Added relay latency per body chunk.
    pub chunk_latency: Percentiles,
    /// Submit to admission answer.
    pub queue_wait: Percentiles,
    /// Inference request read to response finished.
    pub end_to_end: Percentiles,
    /// In a cluster: the owning Edge of every owned node, as this Edge's
    /// watch sees it; `None` for a single Edge.
    pub owners: Option<BTreeMap<String, String>>,
    /// The access log: where it writes, whether it fails.
    pub access_log: AccessStatus,
    /// The usage file, if any: where it writes, whether it fails.
    pub usage_log: Option<UsageStatus>,
}

fn age_ms(now: Instant, at: Option<Instant>) -> Option<u64> {
    at.map(|at| u64::try_from(now.saturating_duration_since(at).as_millis()).unwrap_or(u64::MAX))
}

/// A node's entry: its phase and ages and whether it takes new work
/// (`drained` by an operator, `draining` as its owner said, `removed` by a
/// reload), never its connection generation, which stays inside the Edge
/// (R5, X5).
fn node_json(now: Instant, n: &NodeView) -> Value {
    let since = match n.phase {
        NodePhase::Offline => n.offline_since,
        NodePhase::Registered => n.registered_at,
        NodePhase::Ready => n.ready_at,
    };
    json!({
        "node_id": n.node_id,
        "connected": n.phase == NodePhase::Ready,
        "phase": status::phase_name(n.phase),
        "since_ms": age_ms(now, since),
        "version": n.version,
        "registration_age_ms": age_ms(now, n.registered_at),
        "drained": n.drained,
        "draining": n.draining,
        "removed": n.removed,
    })
}

fn model_json(m: &ModelView) -> Value {
    json!({
        "model": m.model,
        "providers": m.providers,
        "candidates": m.candidates,
        "queued": m.queued,
        "max_queue": m.max_queue,
        "routing": status::routing_json(m),
    })
}

/// One event's document: `snapshot`, with rates since `previous` (the
/// sample of the viewer's last event; `null` rates on its first).
pub fn event_json(snapshot: &Snapshot, previous: Option<&Sample>) -> Value {
    let now = snapshot.now;
    let sample = &snapshot.sample;
    let rates = rates(previous, sample);
    json!({
        "nodes": snapshot.nodes.iter().map(|n| {
            let mut node = node_json(now, n);
            if let Some(owners) = &snapshot.owners {
                node["edge"] = owners.get(&n.node_id).map_or(Value::Null, |e| json!(e));
            }
            node
        }).collect::<Vec<_>>(),
        "providers": status::status_json(
            &snapshot.providers,
            &snapshot.outliers,
            &snapshot.drains,
        )["providers"],
        "models": snapshot.models.iter().map(model_json).collect::<Vec<_>>(),
        "traffic": {
            "requests_total": sample.requests(),
            "ok_total": sample.ok,
            "rejected_total": sample.rejected,
            "failed_total": sample.failed,
            "requests_per_sec": rates.map(|r| r.requests_per_sec),
            "errors_per_sec": rates.map(|r| r.errors_per_sec),
            "error_ratio": rates.and_then(|r| r.error_ratio),
        },
        "latency": {
            "time_to_first_byte": snapshot.time_to_first_byte.json(),
            "chunk_latency": snapshot.chunk_latency.json(),
            "queue_wait": snapshot.queue_wait.json(),
            "end_to_end": snapshot.end_to_end.json(),
        },
        "logs": status::logs_json(&snapshot.access_log, snapshot.usage_log.as_ref()),
    })
}

/// A viewer's claim on one of this core's viewer slots, given back on drop
/// (on this core: it is not `Send`).
#[derive(Debug)]
pub struct ViewerSlot(PhantomData<Rc<()>>);

impl ViewerSlot {
    /// A slot of this core, if fewer than `limit` are taken.
    pub fn acquire(limit: usize) -> Option<Self> {
        VIEWERS.with(|n| {
            (n.get() < limit).then(|| {
                n.set(n.get() + 1);
                Self(PhantomData)
            })
        })
    }

    /// Viewers streaming now on this core.
    pub fn in_use() -> usize {
        VIEWERS.with(Cell::get)
    }
}

impl Drop for ViewerSlot {
    fn drop(&mut self) {
        VIEWERS.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

async fn write_json<S: ClientStream>(
    server: &mut ServerConn<S>,
    (status, body): (u16, Bytes),
) -> Result<(), HttpError> {
    server
        .write_response(status, [("content-type", "application/json")], body)
        .await
}

/// `GET /ui`: the page. Without client keys, loopback peers only.
pub(crate) async fn page<S: ClientStream>(
    edge: &Edge,
    server: &mut ServerConn<S>,
    from: Requester,
) -> Result<(), HttpError> {
    if !edge.settings.client_keys.is_enabled() {
        if let Err(refused) =
            crate::client::admin::authorize_route(Authority::Anonymous, from, "/ui")
        {
            return write_json(server, refused).await;
        }
    }
    server
        .write_response(
            200,
            [
                ("content-type", "text/html; charset=utf-8"),
                ("cache-control", "no-store"),
                (
                    "content-security-policy",
                    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                     connect-src 'self'; img-src data:",
                ),
            ],
            Bytes::from_static(PAGE_HTML.as_bytes()),
        )
        .await
}

/// Reads what one event shows; `None` when `Control` cannot be reached
/// (the Edge is shutting down).
async fn snapshot(edge: &Edge) -> Option<Snapshot> {
    let (now, fleet, models) = edge
        .with_control(|control| {
            let now = clock::now();
            (
                now,
                status::Fleet::read(control, now),
                control.model_views(),
            )
        })
        .await?;
    let merged = engine_metrics::merged();
    let of = |key| Percentiles::of(merged.histogram(key));
    Some(Snapshot {
        now,
        nodes: fleet.nodes,
        providers: fleet.snapshots,
        outliers: fleet.outliers,
        drains: fleet.providers,
        models,
        sample: Sample::read(now),
        time_to_first_byte: Percentiles::of_buckets(
            &edge.settings.request_metrics.time_to_first_token(),
        ),
        chunk_latency: of(Latency::EdgeRelayChunkLatency),
        queue_wait: of(Latency::EdgeQueueWait),
        end_to_end: of(Latency::EdgeEndToEnd),
        owners: edge.settings.cluster.as_ref().map(|c| {
            c.owners()
                .into_iter()
                .map(|(node, owner)| (node, owner.edge))
                .collect()
        }),
        access_log: edge.settings.access_log.status(),
        usage_log: edge.settings.usage_log.status(),
    })
}

/// `GET /ui/events`: streams events to an admin (or, without client keys,
/// a loopback peer) until it leaves, stops reading (the write-stall reset:
/// the error is returned) or the Edge drains.
pub(crate) async fn events<S: ClientStream>(
    edge: &Rc<Edge>,
    server: &mut ServerConn<S>,
    authority: Authority,
    from: Requester,
) -> Result<(), HttpError> {
    if let Err(refused) = crate::client::admin::authorize_route(authority, from, "/ui/events") {
        return write_json(server, refused).await;
    }
    let limit = viewers_per_core(edge.shard_count());
    let Some(_slot) = ViewerSlot::acquire(limit) else {
        let e = crate::api::error::GatewayError::too_many_viewers(limit);
        return write_json(server, (e.status, e.body_bytes())).await;
    };
    if let Err(e) =
        iop_engine::net::set_send_buffer_bytes(server.stream(), VIEWER_SEND_BUFFER_BYTES)
    {
        tracing::debug!(error = %e, "status page viewer send buffer");
    }
    server
        .start_chunked(
            200,
            [
                ("content-type", "text/event-stream"),
                ("cache-control", "no-store"),
            ],
        )
        .await?;
    let mut previous: Option<Sample> = None;
    while !edge.is_draining() {
        let Some(snapshot) = snapshot(edge).await else {
            break;
        };
        let event = format!("data: {}\n\n", event_json(&snapshot, previous.as_ref()));
        previous = Some(snapshot.sample);
        server.write_chunk(Bytes::from(event)).await?;
        let pause = monoio::time::sleep(EVENT_INTERVAL);
        if let Watched::PeerClosed = server.watch_peer(pause).await {
            return Ok(());
        }
    }
    server.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{RoutingPolicy, RoutingStats};

    fn sample(at: Instant, ok: u64, rejected: u64, failed: u64) -> Sample {
        Sample {
            at,
            ok,
            rejected,
            failed,
        }
    }

    #[test]
    fn rates_come_from_two_samples() {
        let t0 = clock::now();
        let first = sample(t0, 10, 2, 1);
        assert_eq!(rates(None, &first), None, "one sample has no rate");
        assert_eq!(rates(Some(&first), &first), None, "no time passed");
        let later = sample(t0 + Duration::from_millis(2000), 16, 3, 4);
        assert_eq!(
            rates(Some(&first), &later),
            Some(Rates {
                requests_per_sec: 5.0,
                errors_per_sec: 1.5,
                error_ratio: Some(0.3),
            })
        );
        let idle = sample(t0 + Duration::from_millis(3000), 16, 3, 4);
        assert_eq!(
            rates(Some(&later), &idle),
            Some(Rates {
                requests_per_sec: 0.0,
                errors_per_sec: 0.0,
                error_ratio: None,
            })
        );
        // Backwards (never in one process): zero, not a wrap-around.
        assert_eq!(
            rates(
                Some(&idle),
                &sample(t0 + Duration::from_millis(4000), 1, 0, 0)
            )
            .map(|r| r.requests_per_sec),
            Some(0.0)
        );
        // A third of a request per second, rounded to hundredths.
        assert_eq!(
            rates(
                Some(&idle),
                &sample(t0 + Duration::from_millis(6000), 17, 3, 4)
            )
            .map(|r| r.requests_per_sec),
            Some(0.33)
        );
    }

    #[test]
    fn viewer_slots_are_bounded() {
        assert_eq!(viewers_per_core(1), 16);
        assert_eq!(viewers_per_core(4), 4);
        assert_eq!(viewers_per_core(0), 16, "no cores is read as one");
        assert_eq!(viewers_per_core(64), 1, "at least one");
        let slots: Vec<ViewerSlot> = std::iter::from_fn(|| ViewerSlot::acquire(3)).collect();
        assert_eq!(slots.len(), 3);
        assert_eq!(ViewerSlot::in_use(), 3);
        assert!(ViewerSlot::acquire(3).is_none(), "full");
        drop(slots);
        assert_eq!(ViewerSlot::in_use(), 0, "given back");
        assert!(ViewerSlot::acquire(3).is_some());
    }

    #[test]
    fn renders_an_event() {
        let t0 = clock::now();
        let now = t0 + Duration::from_secs(100);
        let snapshot = Snapshot {
            now,
            nodes: vec![
                NodeView {
                    node_id: "node-a".into(),
                    phase: NodePhase::Ready,
                    version: "0.1.0".into(),
                    registered_at: Some(t0 + Duration::from_secs(40)),
                    ready_at: Some(t0 + Duration::from_millis(40_250)),
                    offline_since: None,
                    drained: true,
                    draining: false,
                    removed: false,
                },
                NodeView {
                    node_id: "node-b".into(),
                    phase: NodePhase::Offline,
                    version: String::new(),
                    registered_at: None,
                    ready_at: None,
                    offline_since: Some(t0 + Duration::from_secs(95)),
                    drained: false,
                    draining: false,
                    removed: true,
                },
            ],
            providers: vec![pb::ProviderSnapshot {
                node_id: "node-a".into(),
                provider_id: "local".into(),
                adapter: "openai".into(),
                target: "llama".into(),
                category: pb::ProviderCategory::LocalInference as i32,
                status: pb::ProviderStatus::Available as i32,
                health: pb::ProviderHealth::Available as i32,
                capacity: 4,
                long_context_capacity: 1,
                in_flight: 2,
                long_in_flight: 1,
                queued: 3,
                long_queued: 0,
                connected: true,
            }],
            outliers: vec![OutlierView::default()],
            drains: vec![ProviderView {
                node_id: "node-a".into(),
                provider_id: "local".into(),
                drained: false,
                node_drained: true,
                draining: true,
                removed: false,
            }],
            models: vec![ModelView {
                model: "llama".into(),
                providers: 2,
                candidates: 1,
                queued: 3,
                max_queue: 64,
                routing: RoutingPolicy::Prefix,
                routing_stats: RoutingStats {
                    by_load: 5,
                    by_match: 12,
                    ..RoutingStats::default()
                },
                tree_bytes: 4096,
                tree_budget_bytes: 1 << 20,
            }],
            sample: sample(now, 20, 3, 1),
            time_to_first_byte: Percentiles {
                count: 24,
                p50_us: 1200,
                p90_us: 3000,
                p99_us: 9000,
                max_us: 9100,
            },
            chunk_latency: Percentiles::default(),
            queue_wait: Percentiles::default(),
            end_to_end: Percentiles::default(),
            owners: None,
            access_log: AccessStatus {
                destination: crate::config::Destination::Stderr,
                open_error: None,
                write_error: None,
                write_errors: 0,
                open_errors: 0,
                dropped_lines: 0,
            },
            usage_log: Some(UsageStatus {
                path: "/var/log/iop/usage.jsonl".into(),
                open_error: Some("cannot open /var/log/iop/usage.jsonl for appending".into()),
                write_error: None,
                write_errors: 0,
                open_errors: 2,
                dropped_records: 0,
            }),
        };
        let previous = sample(t0 + Duration::from_secs(99), 16, 3, 1);
        // CONTRACT: X5 — the exact document: no node entry carries a
        // generation or any transport internal.
        let zero = json!({"count": 0, "p50_us": 0, "p90_us": 0, "p99_us": 0, "max_us": 0});
        assert_eq!(
            event_json(&snapshot, Some(&previous)),
            json!({
                "nodes": [
                    {"node_id": "node-a", "connected": true, "phase": "ready",
                     "since_ms": 59_750, "version": "0.1.0",
                     "registration_age_ms": 60_000,
                     "drained": true, "draining": false, "removed": false},
                    {"node_id": "node-b", "connected": false, "phase": "offline",
                     "since_ms": 5000, "version": "",
                     "registration_age_ms": null,
                     "drained": false, "draining": false, "removed": true},
                ],
                "providers": [
                    {"node_id": "node-a", "provider_id": "local", "adapter": "openai",
                     "target": "llama", "category": "local_inference", "status": "available",
                     "health": "available", "capacity": 4, "long_context_capacity": 1,
                     "in_flight": 2, "long_in_flight": 1, "queued": 3, "long_queued": 0,
                     "connected": true,
                     "outlier": {"ejected": false, "reason": null, "consecutive_failures": 0,
                                 "ejections": 0, "readmit_in_ms": null},
                     "drained": false, "node_drained": true, "draining": true,
                     "removed": false},
                ],
                "models": [
                    {"model": "llama", "providers": 2, "candidates": 1, "queued": 3,
                     "max_queue": 64, "routing": {
                         "policy": "prefix", "routed_by_load": 5, "routed_by_match": 12,
                         "routed_by_session": 0, "imbalance_fallbacks": 0,
                         "affinity_waits": 0, "affinity_waits_expired": 0,
                         "tree_bytes": 4096, "tree_budget_bytes": 1048576}},
                ],
                "traffic": {
                    "requests_total": 24, "ok_total": 20, "rejected_total": 3,
                    "failed_total": 1, "requests_per_sec": 4.0, "errors_per_sec": 0.0,
                    "error_ratio": 0.0,
                },
                "latency": {
                    "time_to_first_byte": {"count": 24, "p50_us": 1200, "p90_us": 3000,
                                           "p99_us": 9000, "max_us": 9100},
                    "chunk_latency": zero,
                    "queue_wait": zero,
                    "end_to_end": zero,
                },
                "logs": {
                    "access_log": {"destination": "stderr", "failing": false,
                                   "open_error": null, "write_error": null,
                                   "open_errors_total": 0, "write_errors_total": 0,
                                   "dropped_lines_total": 0},
                    "usage_log": {"path": "/var/log/iop/usage.jsonl", "failing": true,
                                  "open_error": "cannot open /var/log/iop/usage.jsonl for appending",
                                  "write_error": null, "open_errors_total": 2,
                                  "write_errors_total": 0, "dropped_records_total": 0},
                },
            })
        );
        // In a cluster each node names its owning Edge (null: unowned).
        let clustered = Snapshot {
            owners: Some(BTreeMap::from([(
                "node-a".to_string(),
                "edge-2".to_string(),
            )])),
            ..snapshot
        };
        let doc = event_json(&clustered, Some(&previous));
        assert_eq!(doc["nodes"][0]["edge"], json!("edge-2"));
        assert_eq!(doc["nodes"][1]["edge"], Value::Null);
        let snapshot = Snapshot {
            owners: None,
            ..clustered
        };
        // A viewer's first event has no rates yet.
        let first = event_json(&snapshot, None);
        assert_eq!(
            first["traffic"],
            json!({"requests_total": 24, "ok_total": 20, "rejected_total": 3,
                   "failed_total": 1, "requests_per_sec": null, "errors_per_sec": null,
                   "error_ratio": null})
        );
    }

    #[test]
    fn percentiles_of_a_histogram() {
        let mut h = Histogram::new();
        for us in 1..=100 {
            h.record_us(us * 10);
        }
        assert_eq!(
            Percentiles::of(&h),
            Percentiles {
                count: 100,
                p50_us: 500,
                p90_us: 900,
                p99_us: 990,
                max_us: 1000,
            }
        );
    }

    #[test]
    fn the_page_is_self_contained() {
        assert!(PAGE_HTML.contains("<title>IOP Edge status</title>"));
        // Nothing is loaded from elsewhere.
        for outside in [
            "http://",
            "https://",
            "src=\"//",
            "<link rel=\"stylesheet\"",
        ] {
            assert!(!PAGE_HTML.contains(outside), "{outside}");
        }
        assert!(PAGE_HTML.contains("/ui/events"));
    }
}
