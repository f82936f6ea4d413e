//! Per-request series of `/metrics`: requests by route, model and status
//! code, rejections by reason, tokens by model and kind, active streams
//! per model, and the time to first token, chunk interval and request
//! duration histograms (fixed buckets, [`iop_engine::metrics::buckets`]).
//!
//! ```text
//! request end (Client::log_access) ─► RequestMetrics::finish(shard, Finished)
//!      a handful of relaxed fetch_adds on the shard's own cells
//! each relayed chunk ─► RequestMetrics::chunk_interval (two fetch_adds)
//! GET /metrics ─► RequestMetrics::render: every shard's cells added up
//! ```
//!
//! Every label set is bounded by configuration or by a fixed enum: `route`
//! is a [`Route`], `model` a configured model name (or `other` for a name
//! not configured, `none` for a request that named none), `code` one of
//! [`CODES`] or `other`, `reason` a [`Reason`]. Nothing a client sends
//! becomes a label value by itself.
//!
//! Each shard writes only its own cells (the array is indexed by shard),
//! so observations never contend and never lock; a scrape reads all of
//! them with relaxed loads.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use iop_engine::metrics::buckets::{
    escape_label_value, micros, write_family, write_histogram, write_sample, AtomicBuckets, Buckets,
};

/// A client route: a fixed set, so it can be a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/responses`.
    Responses,
    /// `/v1/messages`.
    Messages,
    /// `/v1/messages/count_tokens`.
    CountTokens,
    /// `/v1/completions`.
    Completions,
    /// `/v1/embeddings`.
    Embeddings,
    /// `/v1/rerank` and `/v2/rerank`.
    Rerank,
    /// `/v1/score`.
    Score,
    /// `/tokenize`.
    Tokenize,
    /// `/detokenize`.
    Detokenize,
    /// `/v1/audio/transcriptions`.
    Transcriptions,
    /// `/v1/audio/translations`.
    Translations,
    /// `/v1/audio/speech`.
    Speech,
    /// `/v1/models` and `/v1/models/{id}`.
    Models,
    /// `/status`.
    Status,
    /// `/metrics`.
    Metrics,
    /// `/admin/...`.
    Admin,
    /// `/livez` and `/readyz`.
    Probe,
    /// Anything else (unknown paths, requests whose head was not read).
    Other,
}

impl Route {
    /// Every route, in rendering order.
    pub const ALL: [Route; 19] = [
        Route::ChatCompletions,
        Route::Responses,
        Route::Messages,
        Route::CountTokens,
        Route::Completions,
        Route::Embeddings,
        Route::Rerank,
        Route::Score,
        Route::Tokenize,
        Route::Detokenize,
        Route::Transcriptions,
        Route::Translations,
        Route::Speech,
        Route::Models,
        Route::Status,
        Route::Metrics,
        Route::Admin,
        Route::Probe,
        Route::Other,
    ];

    /// The route of a request path (without query).
    pub fn of(path: &str) -> Route {
        match path {
            "/v1/chat/completions" => Route::ChatCompletions,
            "/v1/responses" => Route::Responses,
            "/v1/messages" => Route::Messages,
            "/v1/messages/count_tokens" => Route::CountTokens,
            "/v1/completions" => Route::Completions,
            "/v1/embeddings" => Route::Embeddings,
            "/v1/rerank" | "/v2/rerank" => Route::Rerank,
            "/v1/score" => Route::Score,
            "/tokenize" => Route::Tokenize,
            "/detokenize" => Route::Detokenize,
            "/v1/audio/transcriptions" => Route::Transcriptions,
            "/v1/audio/translations" => Route::Translations,
            "/v1/audio/speech" => Route::Speech,
            "/v1/models" => Route::Models,
            p if p.starts_with("/v1/models/") => Route::Models,
            "/status" => Route::Status,
            "/metrics" => Route::Metrics,
            "/livez" | "/readyz" => Route::Probe,
            p if p.starts_with("/admin/") => Route::Admin,
            _ => Route::Other,
        }
    }

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat_completions",
            Route::Responses => "responses",
            Route::Messages => "messages",
            Route::CountTokens => "count_tokens",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
            Route::Rerank => "rerank",
            Route::Score => "score",
            Route::Tokenize => "tokenize",
            Route::Detokenize => "detokenize",
            Route::Transcriptions => "transcriptions",
            Route::Translations => "translations",
            Route::Speech => "speech",
            Route::Models => "models",
            Route::Status => "status",
            Route::Metrics => "metrics",
            Route::Admin => "admin",
            Route::Probe => "probe",
            Route::Other => "other",
        }
    }

    /// Whether requests on it go through admission and a provider (the
    /// routes of the latency histograms).
    pub fn is_inference(self) -> bool {
        matches!(
            self,
            Route::ChatCompletions
                | Route::Responses
                | Route::Messages
                | Route::CountTokens
                | Route::Completions
                | Route::Embeddings
                | Route::Rerank
                | Route::Score
                | Route::Tokenize
                | Route::Detokenize
                | Route::Transcriptions
                | Route::Translations
                | Route::Speech
        )
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The status codes that are label values of their own; any other is
/// `other`. A request that got no response at all (the client left first)
/// counts as `499`, as nginx does.
pub const CODES: [u16; 15] = [
    200, 400, 401, 403, 404, 405, 408, 413, 429, 431, 499, 500, 502, 503, 504,
];

/// Code label slots: [`CODES`] and `other`.
const CODE_SLOTS: usize = CODES.len() + 1;

fn code_index(status: Option<u16>) -> usize {
    let status = status.unwrap_or(499);
    CODES
        .iter()
        .position(|&c| c == status)
        .unwrap_or(CODES.len())
}

fn code_name(index: usize) -> String {
    CODES
        .get(index)
        .map_or_else(|| "other".to_owned(), u16::to_string)
}

/// Why the Edge refused a request itself (before or instead of a
/// provider's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// 401: no API key, or an unknown one.
    Unauthorized,
    /// 403: the key may not use `/admin`, or `/admin` from a remote peer
    /// without client keys.
    Forbidden,
    /// 400 or 501: bad framing, JSON, or JSON over `edge.max_json_*`; an
    /// operation no provider of the model serves; an unsupported transfer
    /// coding.
    BadRequest,
    /// 413 or 431: a body over `edge.max_request_body_bytes`, or a head
    /// over its limit.
    TooLarge,
    /// 408: a request head or body stalled past its deadline.
    RequestTimeout,
    /// 404 `model_not_found`: the model is not configured.
    UnknownModel,
    /// 404 or 405 on a path: no such route, or the wrong method.
    UnknownRoute,
    /// 429 `queue_full`: the model's queue is at `max_queue`.
    QueueFull,
    /// 503 `no_provider_available`: no lease within the queue timeout.
    NoProvider,
    /// 503 `shutting_down`: the Edge is draining.
    Draining,
    /// 503 `credential_unavailable`: the credential plane had no lease.
    CredentialUnavailable,
    /// 429 `rate_limit_*`: the key's principal is over one of its limits.
    RateLimited,
}

impl Reason {
    /// Every reason, in rendering order.
    pub const ALL: [Reason; 12] = [
        Reason::Unauthorized,
        Reason::Forbidden,
        Reason::BadRequest,
        Reason::TooLarge,
        Reason::RequestTimeout,
        Reason::UnknownModel,
        Reason::UnknownRoute,
        Reason::QueueFull,
        Reason::NoProvider,
        Reason::Draining,
        Reason::CredentialUnavailable,
        Reason::RateLimited,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Unauthorized => "unauthorized",
            Reason::Forbidden => "forbidden",
            Reason::BadRequest => "bad_request",
            Reason::TooLarge => "too_large",
            Reason::RequestTimeout => "request_timeout",
            Reason::UnknownModel => "unknown_model",
            Reason::UnknownRoute => "unknown_route",
            Reason::QueueFull => "queue_full",
            Reason::NoProvider => "no_provider",
            Reason::Draining => "draining",
            Reason::CredentialUnavailable => "credential_unavailable",
            Reason::RateLimited => "rate_limited",
        }
    }

    /// The rejection a request answered with `status` and error code (or
    /// type) `outcome` was, if the Edge refused it itself. Provider answers
    /// (any status with outcome `completed`/none) and upstream failures
    /// (502, 504, `node_unavailable`) are not rejections.
    pub fn of(status: Option<u16>, outcome: Option<&str>) -> Option<Reason> {
        let outcome = outcome?;
        match (status?, outcome) {
            (401, _) => Some(Reason::Unauthorized),
            (403, "admin_scope_required" | "admin_loopback_only" | "model_not_allowed") => {
                Some(Reason::Forbidden)
            }
            (
                429,
                "rate_limit_concurrency"
                | "rate_limit_requests"
                | "rate_limit_tokens"
                | "budget_exhausted",
            ) => Some(Reason::RateLimited),
            (413 | 431, _) => Some(Reason::TooLarge),
            (408, _) => Some(Reason::RequestTimeout),
            (404, "model_not_found") => Some(Reason::UnknownModel),
            (404, "unknown_url") | (405, _) => Some(Reason::UnknownRoute),
            (429, "queue_full") => Some(Reason::QueueFull),
            (503, "no_provider_available") => Some(Reason::NoProvider),
            (503, "shutting_down") => Some(Reason::Draining),
            (503, "credential_unavailable") => Some(Reason::CredentialUnavailable),
            (400 | 501, "invalid_request_error") => Some(Reason::BadRequest),
            _ => None,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Token kinds of `iop_edge_tokens_total`.
const KINDS: [&str; 2] = ["prompt", "completion"];

/// What [`RequestMetrics::finish`] records of one request.
#[derive(Debug, Clone, Copy)]
pub struct Finished<'a> {
    /// Its route.
    pub route: Route,
    /// Its model slot ([`RequestMetrics::model_slot`]).
    pub model: usize,
    /// The response status, if a response was started.
    pub status: Option<u16>,
    /// Its outcome code, if one was noted (an error answered, or what
    /// ended it).
    pub outcome: Option<&'a str>,
    /// Request read until its first response body byte.
    pub time_to_first_byte: Option<Duration>,
    /// Request read until its response finished.
    pub duration: Duration,
    /// Tokens of the last usage observation, if the provider reported one.
    pub tokens: Option<(u64, u64)>,
}

/// One shard's cells.
struct Cells {
    /// Route × model slot × code slot.
    requests: Box<[AtomicU64]>,
    rejections: [AtomicU64; Reason::ALL.len()],
    /// Model slot × kind.
    tokens: Box<[AtomicU64]>,
    /// Model slot.
    active_streams: Box<[AtomicI64]>,
    /// Route × model slot.
    time_to_first_token: Box<[AtomicBuckets]>,
    chunk_interval: Box<[AtomicBuckets]>,
    duration: Box<[AtomicBuckets]>,
}

impl Cells {
    fn new(model_slots: usize) -> Self {
        let atomics = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect();
        let histograms = |n: usize| (0..n).map(|_| AtomicBuckets::default()).collect();
        let routes = Route::ALL.len();
        Self {
            requests: atomics(routes * model_slots * CODE_SLOTS),
            rejections: std::array::from_fn(|_| AtomicU64::new(0)),
            tokens: atomics(model_slots * KINDS.len()),
            active_streams: (0..model_slots).map(|_| AtomicI64::new(0)).collect(),
            time_to_first_token: histograms(routes * model_slots),
            chunk_interval: histograms(routes * model_slots),
            duration: histograms(routes * model_slots),
        }
    }
}

/// Named slots kept free at startup for the models and nodes a reload
/// adds (each name keeps its slot for the life of the process, so its
/// counters never go back; past these, a new model counts as `other` and a
/// new node's scrape errors are not counted until a restart).
pub const RELOAD_HEADROOM: usize = 32;

/// The per-request series of one Edge, shared by its shards.
pub struct RequestMetrics {
    /// Model names, in slot order: the configured ones, then those added
    /// by reloads. Slot `named` is `other`, the next `none`.
    models: RwLock<Vec<String>>,
    /// Named model slots the cells have room for.
    named: usize,
    shards: Box<[Cells]>,
    /// Node ids in slot order (configured, then added by reloads), and per
    /// slot the METRICS pulls that got no answer.
    nodes: RwLock<Vec<String>>,
    node_scrape_errors: Box<[AtomicU64]>,
}

impl std::fmt::Debug for RequestMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestMetrics")
            .field("models", &self.models)
            .field("shards", &self.shards.len())
            .field("nodes", &self.nodes)
            .finish()
    }
}

impl RequestMetrics {
    /// Cells for `shards` shards (at least one), the configured `models`
    /// and `nodes`.
    pub fn new(models: Vec<String>, nodes: Vec<String>, shards: usize) -> Arc<Self> {
        let named = models.len() + RELOAD_HEADROOM;
        let node_slots = nodes.len() + RELOAD_HEADROOM;
        Arc::new(Self {
            models: RwLock::new(models),
            named,
            shards: (0..shards.max(1)).map(|_| Cells::new(named + 2)).collect(),
            node_scrape_errors: (0..node_slots).map(|_| AtomicU64::new(0)).collect(),
            nodes: RwLock::new(nodes),
        })
    }

    /// Gives every model and node of a reloaded configuration a slot of
    /// its own, while there is room ([`RELOAD_HEADROOM`]); names already
    /// known keep theirs (a removed model's series stay). Returns the
    /// names left without one.
    pub fn add_names(&self, models: &[String], nodes: &[String]) -> Vec<String> {
        let mut left = Vec::new();
        let mut add = |table: &RwLock<Vec<String>>, room: usize, names: &[String]| {
            let mut known = table.write().unwrap_or_else(PoisonError::into_inner);
            for name in names {
                if known.contains(name) {
                    continue;
                }
                if known.len() < room {
                    known.push(name.clone());
                } else {
                    left.push(name.clone());
                }
            }
        };
        add(&self.models, self.named, models);
        add(&self.nodes, self.node_scrape_errors.len(), nodes);
        left
    }

    /// Counts a METRICS pull from `node` that got no usable answer.
    pub fn node_scrape_failed(&self, node: &str) {
        let nodes = self.nodes.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = nodes.iter().position(|n| n == node) {
            self.node_scrape_errors[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn slots(&self) -> usize {
        self.named + 2
    }

    /// The slot of the `other` model (a name with no slot).
    pub fn other_model(&self) -> usize {
        self.named
    }

    /// The slot of the `none` model (no model named).
    pub fn no_model(&self) -> usize {
        self.named + 1
    }

    /// The slot of a model name: its own, or `other`.
    pub fn model_slot(&self, model: &str) -> usize {
        self.models
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .position(|m| m == model)
            .unwrap_or(self.named)
    }

    fn cells(&self, shard: usize) -> &Cells {
        &self.shards[shard % self.shards.len()]
    }

    /// Records a finished request on `shard`'s cells.
    pub fn finish(&self, shard: usize, done: &Finished<'_>) {
        let cells = self.cells(shard);
        let model = done.model.min(self.slots() - 1);
        let at = done.route.index() * self.slots() + model;
        cells.requests[at * CODE_SLOTS + code_index(done.status)].fetch_add(1, Ordering::Relaxed);
        if let Some(reason) = Reason::of(done.status, done.outcome) {
            cells.rejections[reason.index()].fetch_add(1, Ordering::Relaxed);
        }
        if let Some((prompt, completion)) = done.tokens {
            add_saturating(&cells.tokens[model * 2], prompt);
            add_saturating(&cells.tokens[model * 2 + 1], completion);
        }
        if done.route.is_inference() {
            if let Some(ttft) = done.time_to_first_byte {
                cells.time_to_first_token[at].observe(ttft);
            }
            cells.duration[at].observe(done.duration);
        }
    }

    /// Every inference request's time to first token so far, over every
    /// shard, route and model (the status page's percentiles).
    pub fn time_to_first_token(&self) -> Buckets {
        let mut total = Buckets::default();
        for cells in self.shards.iter() {
            for cell in cells.time_to_first_token.iter() {
                cell.add_to(&mut total);
            }
        }
        total
    }

    /// Records the gap between two consecutive body chunks written to a
    /// client of `route` and `model` on `shard`.
    pub fn chunk_interval(&self, shard: usize, route: Route, model: usize, gap: Duration) {
        let at = route.index() * self.slots() + model.min(self.slots() - 1);
        self.cells(shard).chunk_interval[at].observe_us(micros(gap));
    }

    /// A stream of `model` is being relayed on `shard` until the guard is
    /// dropped.
    pub fn stream_started(self: &Arc<Self>, shard: usize, model: usize) -> ActiveStream {
        let model = model.min(self.slots() - 1);
        self.cells(shard).active_streams[model].fetch_add(1, Ordering::Relaxed);
        ActiveStream {
            metrics: self.clone(),
            shard,
            model,
        }
    }

    /// The series, summed over shards; `queue_depths` are the waiting
    /// requests per configured model (from Control), in any order.
    pub fn render(&self, queue_depths: &[(String, usize)]) -> String {
        let mut out = String::new();
        let slots = self.slots();
        let sum = |f: &dyn Fn(&Cells) -> u64| -> u64 {
            self.shards.iter().fold(0u64, |a, c| a.saturating_add(f(c)))
        };
        let models = self
            .models
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let named = models.len();
        let label = |slot: usize| {
            escape_label_value(match models.get(slot) {
                Some(name) => name,
                None if slot == self.named => "other",
                None => "none",
            })
        };

        let name = "iop_edge_requests_total";
        write_family(
            &mut out,
            name,
            "counter",
            "Client requests finished, by route, model and status code (499: no response).",
        );
        for route in Route::ALL {
            for model in 0..slots {
                for code in 0..CODE_SLOTS {
                    let i = (route.index() * slots + model) * CODE_SLOTS + code;
                    let n = sum(&|c| c.requests[i].load(Ordering::Relaxed));
                    if n > 0 {
                        let labels = format!(
                            "route=\"{}\",model=\"{}\",code=\"{}\"",
                            route.name(),
                            label(model),
                            code_name(code)
                        );
                        write_sample(&mut out, name, &labels, n);
                    }
                }
            }
        }

        let name = "iop_edge_rejections_total";
        write_family(
            &mut out,
            name,
            "counter",
            "Requests the Edge refused itself, by reason.",
        );
        for reason in Reason::ALL {
            let n = sum(&|c| c.rejections[reason.index()].load(Ordering::Relaxed));
            write_sample(&mut out, name, &format!("reason=\"{}\"", reason.name()), n);
        }

        let name = "iop_edge_tokens_total";
        write_family(
            &mut out,
            name,
            "counter",
            "Tokens reported by providers' usage observations, by model and kind.",
        );
        for model in 0..slots {
            for (k, kind) in KINDS.iter().enumerate() {
                let n = sum(&|c| c.tokens[model * 2 + k].load(Ordering::Relaxed));
                // Configured models always; `other`/`none` once seen.
                if model < named || n > 0 {
                    let labels = format!("model=\"{}\",kind=\"{kind}\"", label(model));
                    write_sample(&mut out, name, &labels, n);
                }
            }
        }

        let name = "iop_edge_queue_depth";
        write_family(
            &mut out,
            name,
            "gauge",
            "Requests waiting for a provider slot now, by model.",
        );
        for (slot, model) in models.iter().enumerate() {
            let depth = queue_depths
                .iter()
                .find(|(m, _)| m == model)
                .map_or(0, |(_, d)| *d);
            write_sample(&mut out, name, &format!("model=\"{}\"", label(slot)), depth);
        }

        let name = "iop_edge_active_streams";
        write_family(
            &mut out,
            name,
            "gauge",
            "Admitted requests whose response is being relayed now, by model.",
        );
        for model in 0..slots {
            let n: i64 = self
                .shards
                .iter()
                .map(|c| c.active_streams[model].load(Ordering::Relaxed))
                .sum();
            if model < named || n != 0 {
                write_sample(
                    &mut out,
                    name,
                    &format!("model=\"{}\"", label(model)),
                    n.max(0),
                );
            }
        }

        let name = "iop_edge_node_scrape_errors_total";
        write_family(
            &mut out,
            name,
            "counter",
            "Pulls of a node's metrics that got no answer in time (its series are left out of that scrape).",
        );
        let nodes = self
            .nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for (node, errors) in nodes.iter().zip(self.node_scrape_errors.iter()) {
            let labels = format!("node=\"{}\"", escape_label_value(node));
            write_sample(&mut out, name, &labels, errors.load(Ordering::Relaxed));
        }

        type Pick = fn(&Cells) -> &[AtomicBuckets];
        let histograms: [(&str, &str, Pick); 3] = [
            (
                "iop_edge_time_to_first_token_seconds",
                "Time from request read to the first response body byte handed to the client socket.",
                |c| &c.time_to_first_token,
            ),
            (
                "iop_edge_chunk_interval_seconds",
                "Time between consecutive response body chunks written to a client (inter-token latency of streams).",
                |c| &c.chunk_interval,
            ),
            (
                "iop_edge_request_duration_seconds",
                "Time from request read to response finished.",
                |c| &c.duration,
            ),
        ];
        for (name, help, pick) in histograms {
            write_family(&mut out, name, "histogram", help);
            for route in Route::ALL.into_iter().filter(|r| r.is_inference()) {
                for model in 0..slots {
                    let at = route.index() * slots + model;
                    let mut total = Buckets::default();
                    for cells in self.shards.iter() {
                        pick(cells)[at].add_to(&mut total);
                    }
                    if total.count() > 0 {
                        let mut labels = String::new();
                        let _ = write!(
                            labels,
                            "route=\"{}\",model=\"{}\"",
                            route.name(),
                            label(model)
                        );
                        write_histogram(&mut out, name, &labels, &total);
                    }
                }
            }
        }
        out
    }
}

/// An admitted request counted in `iop_edge_active_streams` until dropped.
#[derive(Debug)]
pub struct ActiveStream {
    metrics: Arc<RequestMetrics>,
    shard: usize,
    model: usize,
}

impl Drop for ActiveStream {
    fn drop(&mut self) {
        self.metrics.cells(self.shard).active_streams[self.model].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Adds `n` to `cell`, stopping at `u64::MAX`: token counts come from a
/// provider's usage report, and a wrapped counter would read as a reset.
fn add_saturating(cell: &AtomicU64, n: u64) {
    // The closure always answers `Some`: the update cannot fail.
    let _ = cell.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_add(n))
    });
}

/// Inference responses finished, by class (see [`count_response`]).
static RESPONSES_OK: AtomicU64 = AtomicU64::new(0);
static RESPONSES_REJECTED: AtomicU64 = AtomicU64::new(0);
static RESPONSES_FAILED: AtomicU64 = AtomicU64::new(0);

/// Counts one finished inference response by its status: below 400 it
/// answered, 4xx was refused (the caller's fault or a limit: 401, 429…),
/// 5xx or no head at all failed.
pub fn count_response(status: Option<u16>) {
    let counter = match status {
        Some(s) if s < 400 => &RESPONSES_OK,
        Some(s) if s < 500 => &RESPONSES_REJECTED,
        _ => &RESPONSES_FAILED,
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The response counters at one instant: what rates are computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// When they were read.
    pub at: Instant,
    /// Inference responses that answered (status below 400).
    pub ok: u64,
    /// Inference responses refused with a 4xx.
    pub rejected: u64,
    /// Inference responses that failed (5xx, or cut off before a head).
    pub failed: u64,
}

impl Sample {
    /// The process's counters now.
    pub fn read(at: Instant) -> Self {
        Self {
            at,
            ok: RESPONSES_OK.load(Ordering::Relaxed),
            rejected: RESPONSES_REJECTED.load(Ordering::Relaxed),
            failed: RESPONSES_FAILED.load(Ordering::Relaxed),
        }
    }

    /// Every inference response counted.
    pub fn requests(&self) -> u64 {
        self.ok + self.rejected + self.failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_counted_by_class() {
        let before = Sample::read(iop_engine::clock::now());
        count_response(Some(200));
        count_response(Some(429));
        count_response(Some(502));
        count_response(None);
        let after = Sample::read(iop_engine::clock::now());
        // Other tests of this process may count too: at least these.
        assert!(after.ok > before.ok);
        assert!(after.rejected > before.rejected);
        assert!(after.failed >= before.failed + 2);
    }

    fn done(route: Route, model: usize, status: Option<u16>) -> Finished<'static> {
        Finished {
            route,
            model,
            status,
            outcome: None,
            time_to_first_byte: None,
            duration: Duration::from_millis(3),
            tokens: None,
        }
    }

    #[test]
    fn routes_codes_and_reasons_are_bounded() {
        assert_eq!(Route::of("/v1/chat/completions"), Route::ChatCompletions);
        assert_eq!(Route::of("/admin/nodes/a/commands"), Route::Admin);
        assert_eq!(Route::of("/readyz"), Route::Probe);
        assert_eq!(Route::of("/v1/completions"), Route::Completions);
        assert_eq!(Route::of("/v2/rerank"), Route::Rerank);
        assert_eq!(Route::of("/v1/rerank"), Route::Rerank);
        assert_eq!(Route::of("/detokenize"), Route::Detokenize);
        assert_eq!(Route::of("/v1/models/m"), Route::Models);
        assert_eq!(Route::Embeddings.name(), "embeddings");
        assert_eq!(Route::of("/etc/passwd"), Route::Other);
        for (i, r) in Route::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        assert_eq!(code_name(code_index(Some(429))), "429");
        assert_eq!(code_name(code_index(None)), "499");
        assert_eq!(code_name(code_index(Some(418))), "other");
        let of = |s, o| Reason::of(Some(s), Some(o));
        assert_eq!(of(401, "invalid_api_key"), Some(Reason::Unauthorized));
        assert_eq!(of(401, "invalid_request_error"), Some(Reason::Unauthorized));
        assert_eq!(of(413, "request_too_large"), Some(Reason::TooLarge));
        assert_eq!(of(429, "queue_full"), Some(Reason::QueueFull));
        assert_eq!(of(503, "no_provider_available"), Some(Reason::NoProvider));
        assert_eq!(of(404, "model_not_found"), Some(Reason::UnknownModel));
        assert_eq!(of(403, "admin_scope_required"), Some(Reason::Forbidden));
        assert_eq!(of(403, "model_not_allowed"), Some(Reason::Forbidden));
        assert_eq!(of(429, "rate_limit_tokens"), Some(Reason::RateLimited));
        assert_eq!(of(429, "budget_exhausted"), Some(Reason::RateLimited));
        assert_eq!(of(502, "node_unavailable"), None);
        // A provider's own 429 relayed as it is is not the Edge's refusal.
        assert_eq!(Reason::of(Some(429), None), None);
        assert_eq!(of(429, "rate_limit_exceeded"), None);
    }

    // Token counts come from the wire: a provider reporting u64::MAX
    // tokens stops the counter at u64::MAX instead of wrapping it.
    #[test]
    fn token_counters_saturate() {
        let m = RequestMetrics::new(vec!["m1".into()], Vec::new(), 1);
        let m1 = m.model_slot("m1");
        for tokens in [(u64::MAX - 1, 1), (5, u64::MAX), (7, 7)] {
            m.finish(
                0,
                &Finished {
                    tokens: Some(tokens),
                    ..done(Route::ChatCompletions, m1, Some(200))
                },
            );
        }
        let text = m.render(&[]);
        for kind in ["prompt", "completion"] {
            let line = format!(
                "iop_edge_tokens_total{{model=\"m1\",kind=\"{kind}\"}} {}",
                u64::MAX
            );
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
    }

    #[test]
    fn a_model_added_by_a_reload_gets_its_own_series_while_there_is_room() {
        let m = RequestMetrics::new(vec!["m1".into()], vec!["node-a".into()], 1);
        assert_eq!(m.model_slot("m2"), m.other_model());
        let extra: Vec<String> = (0..RELOAD_HEADROOM).map(|i| format!("x{i}")).collect();
        let mut models = vec!["m1".to_string(), "m2".to_string()];
        models.extend(extra);
        // m1 keeps its slot; m2 and the first 31 others get one; one is left.
        let left = m.add_names(&models, &["node-b".into()]);
        assert_eq!(left, vec![format!("x{}", RELOAD_HEADROOM - 1)]);
        assert_eq!(m.model_slot("m1"), 0);
        assert_eq!(m.model_slot("m2"), 1);
        assert_eq!(
            m.model_slot(&format!("x{}", RELOAD_HEADROOM - 1)),
            m.other_model()
        );
        m.finish(
            0,
            &done(Route::ChatCompletions, m.model_slot("m2"), Some(200)),
        );
        m.node_scrape_failed("node-b");
        let text = m.render(&[]);
        for line in [
            "iop_edge_requests_total{route=\"chat_completions\",model=\"m2\",code=\"200\"} 1",
            "iop_edge_node_scrape_errors_total{node=\"node-b\"} 1",
            "iop_edge_queue_depth{model=\"x0\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        // Known names are not added twice.
        assert_eq!(
            m.add_names(&["m2".into()], &["node-b".into()]),
            Vec::<String>::new()
        );
    }

    #[test]
    fn render_is_exact_for_a_known_set_of_requests() {
        let m = RequestMetrics::new(vec!["m1".into(), "m\"2".into()], vec!["node-a".into()], 2);
        m.node_scrape_failed("node-a");
        m.node_scrape_failed("unknown");
        let m1 = m.model_slot("m1");
        assert_eq!(m.model_slot("nope"), m.other_model());
        m.finish(
            0,
            &Finished {
                time_to_first_byte: Some(Duration::from_micros(700)),
                tokens: Some((10, 4)),
                ..done(Route::ChatCompletions, m1, Some(200))
            },
        );
        m.finish(
            1,
            &Finished {
                outcome: Some("queue_full"),
                ..done(Route::ChatCompletions, m1, Some(429))
            },
        );
        m.finish(
            1,
            &Finished {
                outcome: Some("invalid_api_key"),
                ..done(Route::Models, m.no_model(), Some(401))
            },
        );
        m.chunk_interval(1, Route::ChatCompletions, m1, Duration::from_millis(20));
        let stream = m.stream_started(0, 1);
        let text = m.render(&[("m1".into(), 3)]);
        drop(stream);
        let bucket_lines = |name: &str, labels: &str, cum: [u64; 18], sum: &str, count: u64| {
            let bounds = [
                "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25",
                "0.5", "1", "2.5", "5", "10", "20", "30", "60", "+Inf",
            ];
            let mut s = String::new();
            for (b, c) in bounds.iter().zip(cum) {
                s.push_str(&format!("{name}_bucket{{{labels},le=\"{b}\"}} {c}\n"));
            }
            s.push_str(&format!("{name}_sum{{{labels}}} {sum}\n"));
            s.push_str(&format!("{name}_count{{{labels}}} {count}\n"));
            s
        };
        let chat = "route=\"chat_completions\",model=\"m1\"";
        let mut ttft = [1; 18];
        ttft[0] = 0;
        let mut chunk = [1; 18];
        chunk[..5].fill(0);
        let mut e2e = [2; 18];
        e2e[..3].fill(0);
        let expected = format!(
            "\
# HELP iop_edge_requests_total Client requests finished, by route, model and status code (499: no response).
# TYPE iop_edge_requests_total counter
iop_edge_requests_total{{route=\"chat_completions\",model=\"m1\",code=\"200\"}} 1
iop_edge_requests_total{{route=\"chat_completions\",model=\"m1\",code=\"429\"}} 1
iop_edge_requests_total{{route=\"models\",model=\"none\",code=\"401\"}} 1
# HELP iop_edge_rejections_total Requests the Edge refused itself, by reason.
# TYPE iop_edge_rejections_total counter
iop_edge_rejections_total{{reason=\"unauthorized\"}} 1
iop_edge_rejections_total{{reason=\"forbidden\"}} 0
iop_edge_rejections_total{{reason=\"bad_request\"}} 0
iop_edge_rejections_total{{reason=\"too_large\"}} 0
iop_edge_rejections_total{{reason=\"request_timeout\"}} 0
iop_edge_rejections_total{{reason=\"unknown_model\"}} 0
iop_edge_rejections_total{{reason=\"unknown_route\"}} 0
iop_edge_rejections_total{{reason=\"queue_full\"}} 1
iop_edge_rejections_total{{reason=\"no_provider\"}} 0
iop_edge_rejections_total{{reason=\"draining\"}} 0
iop_edge_rejections_total{{reason=\"credential_unavailable\"}} 0
iop_edge_rejections_total{{reason=\"rate_limited\"}} 0
# HELP iop_edge_tokens_total Tokens reported by providers' usage observations, by model and kind.
# TYPE iop_edge_tokens_total counter
iop_edge_tokens_total{{model=\"m1\",kind=\"prompt\"}} 10
iop_edge_tokens_total{{model=\"m1\",kind=\"completion\"}} 4
iop_edge_tokens_total{{model=\"m\\\"2\",kind=\"prompt\"}} 0
iop_edge_tokens_total{{model=\"m\\\"2\",kind=\"completion\"}} 0
# HELP iop_edge_queue_depth Requests waiting for a provider slot now, by model.
# TYPE iop_edge_queue_depth gauge
iop_edge_queue_depth{{model=\"m1\"}} 3
iop_edge_queue_depth{{model=\"m\\\"2\"}} 0
# HELP iop_edge_active_streams Admitted requests whose response is being relayed now, by model.
# TYPE iop_edge_active_streams gauge
iop_edge_active_streams{{model=\"m1\"}} 0
iop_edge_active_streams{{model=\"m\\\"2\"}} 1
# HELP iop_edge_node_scrape_errors_total Pulls of a node's metrics that got no answer in time (its series are left out of that scrape).
# TYPE iop_edge_node_scrape_errors_total counter
iop_edge_node_scrape_errors_total{{node=\"node-a\"}} 1
# HELP iop_edge_time_to_first_token_seconds Time from request read to the first response body byte handed to the client socket.
# TYPE iop_edge_time_to_first_token_seconds histogram
{}\
# HELP iop_edge_chunk_interval_seconds Time between consecutive response body chunks written to a client (inter-token latency of streams).
# TYPE iop_edge_chunk_interval_seconds histogram
{}\
# HELP iop_edge_request_duration_seconds Time from request read to response finished.
# TYPE iop_edge_request_duration_seconds histogram
{}",
            bucket_lines("iop_edge_time_to_first_token_seconds", chat, ttft, "0.0007", 1),
            bucket_lines("iop_edge_chunk_interval_seconds", chat, chunk, "0.02", 1),
            bucket_lines("iop_edge_request_duration_seconds", chat, e2e, "0.006", 2),
        );
        assert_eq!(text, expected);
        let after = m.render(&[]);
        assert!(after.contains("iop_edge_active_streams{model=\"m\\\"2\"} 0\n"));
    }
}
