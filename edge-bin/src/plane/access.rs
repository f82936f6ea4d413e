//! Request ids and the access log: one line per client request.
//!
//! ```text
//! request read ─► RequestIds::for_request (the client's valid x-request-id,
//!                 or a minted req_<32 hex>) ─► x-request-id on every response,
//!                 correlation_id on the node request, request_id in
//!                 Anthropic-shape errors
//!      route   ─► AccessRecord: model, provider, node, attempts, outcome,
//!                 tokens (from the node's usage observations)
//! response end ─► AccessLog::write: one text (logfmt) or JSON line, queued
//!                 for the process's writer thread (stderr or a file)
//! ```
//!
//! The writer thread does the blocking writes, so a slow disk or a full
//! stderr pipe never stalls a shard: its queue is bounded
//! ([`ACCESS_LOG_BACKLOG`]) and a line that does not fit is dropped and
//! counted ([`dropped_lines`]). Idle, the writer waits for the next line;
//! busy, it writes what has queued and then parks for
//! [`ACCESS_LOG_FLUSH_INTERVAL`] while more queues, so a shard that queues a
//! line finds no waiting writer to wake: lines reach the destination in
//! batches at most that long after they are queued, and a request costs no
//! thread wake-up and no system call of the shard's. [`AccessLog::close`]
//! writes what is queued at shutdown. A reload opens the file destination
//! again, by the path the file names now ([`AccessLog::apply_reload`]:
//! rotation by rename, or a new destination); one that cannot be opened
//! keeps the running destination, and that, like failing writes, shows in
//! `iop_edge_access_log_failing` and `/status` ([`AccessStatus`]).
//!
//! Lines never hold a body, a header value other than the request id, or a
//! key: the principal is the configured name of the client key, never the
//! key.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use iop_engine::clock;
use iop_engine::config::ConfigError;
use iop_engine::http::ExchangeStats;
use iop_engine::rng::SplitMix64;

use crate::config::{
    cannot_append, open_appending, AccessLogSpec, Destination, Format, OperationalPath,
};
use crate::plane::usage::LogReload;

/// The request id header, read from the client and set on every response.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Longest client-supplied request id accepted (longer ones are replaced).
pub const MAX_REQUEST_ID_BYTES: usize = 128;
/// Lines queued for the writer thread at most; more are dropped.
pub const ACCESS_LOG_BACKLOG: usize = 4096;
/// How long the writer, once it has written a batch, lets the next one
/// gather before it writes again (with [`ACCESS_LOG_BACKLOG`], up to about
/// 200,000 lines a second are kept).
pub const ACCESS_LOG_FLUSH_INTERVAL: Duration = Duration::from_millis(20);
/// How long [`AccessLog::close`] waits for the writer to write what is
/// queued (a sink that never takes it costs those lines, not the exit).
const ACCESS_LOG_CLOSE_WAIT: Duration = Duration::from_secs(2);
/// Longest model name written (a client may name any model).
const MAX_LOGGED_MODEL_BYTES: usize = 128;

/// Whether `value` is acceptable as a request id: 1 to
/// [`MAX_REQUEST_ID_BYTES`] bytes of letters, digits and `-_.:/+=@`, which
/// covers UUIDs, ULIDs, base64 and the ids proxies mint, and can be logged
/// and echoed without escaping.
pub fn is_valid_request_id(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= MAX_REQUEST_ID_BYTES
        && value
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"-_.:/+=@".contains(&b))
}

/// Mints request ids for one shard: `req_` and 32 hex digits from a
/// generator seeded by the OS (unique in practice across shards, processes
/// and restarts; not a secret and not used as one).
#[derive(Debug)]
pub struct RequestIds {
    rng: std::cell::RefCell<SplitMix64>,
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new(SplitMix64::from_os())
    }
}

impl RequestIds {
    /// Ids drawn from `rng` (a fixed seed gives fixed ids, for tests).
    pub fn new(rng: SplitMix64) -> Self {
        Self {
            rng: std::cell::RefCell::new(rng),
        }
    }

    /// A new id.
    pub fn mint(&self) -> String {
        let mut rng = self.rng.borrow_mut();
        let mut id = String::with_capacity(36);
        id.push_str("req_");
        push_hex16(&mut id, rng.next_u64());
        push_hex16(&mut id, rng.next_u64());
        id
    }

    /// The id of a request: the client's `x-request-id` when it is valid
    /// ([`is_valid_request_id`]), else a new one.
    pub fn for_request(&self, client: Option<&[u8]>) -> String {
        match client {
            Some(value) if is_valid_request_id(value) => {
                // Valid ids are ASCII.
                String::from_utf8_lossy(value).into_owned()
            }
            _ => self.mint(),
        }
    }
}

/// Everything one line says about one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AccessRecord {
    /// The request id (echoed as `x-request-id`).
    pub request_id: String,
    /// The authenticated principal (the client key's configured name), or
    /// `anonymous`.
    pub principal: String,
    /// Request method.
    pub method: String,
    /// Request path (no query).
    pub path: String,
    /// The model the client asked for, once the body was read.
    pub model: Option<String>,
    /// The provider of the last attempt (`node/provider`).
    pub provider: Option<String>,
    /// The node of the last attempt.
    pub node: Option<String>,
    /// Attempts dispatched to a provider (more than one after a failover).
    pub attempts: u32,
    /// How the request ended: `completed`, or the error code the client
    /// was given (`model_not_found`, `response_stalled`, ...), or what
    /// ended it (`client_disconnect`, `client_write_stall`).
    pub outcome: Option<String>,
    /// Request body bytes.
    pub bytes_in: u64,
    /// Prompt tokens, when the provider reported usage.
    pub prompt_tokens: Option<u64>,
    /// Completion tokens, when the provider reported usage.
    pub completion_tokens: Option<u64>,
    /// The Edge this request came from, when it arrived on the peer
    /// listener (a cluster member forwarded it): `peer=<edge name>`.
    pub peer: Option<String>,
    /// The Edge this request was forwarded to: `forwarded_to=<edge name>`.
    pub forwarded_to: Option<String>,
    /// The request's trace (`[tracing]`): `trace_id=<32 hex>`, on the
    /// lines of traced requests only.
    pub trace_id: Option<iop_engine::trace::TraceId>,
}

impl AccessRecord {
    /// A record for a request just read.
    pub fn new(request_id: String, method: &str, path: &str, bytes_in: u64) -> Self {
        Self {
            request_id,
            principal: crate::plane::client_keys::ANONYMOUS_PRINCIPAL.to_owned(),
            method: method.to_owned(),
            path: path.to_owned(),
            bytes_in,
            ..Self::default()
        }
    }

    /// Notes the model the client named (cut to a bounded length).
    pub fn set_model(&mut self, model: &str) {
        let mut end = model.len().min(MAX_LOGGED_MODEL_BYTES);
        while !model.is_char_boundary(end) {
            end -= 1;
        }
        self.model = Some(model[..end].to_owned());
    }

    /// Notes an attempt dispatched to `provider` on `node`.
    pub fn attempt(&mut self, node: &str, provider: &str) {
        self.attempts += 1;
        self.node = Some(node.to_owned());
        self.provider = Some(format!("{node}/{provider}"));
    }

    /// Notes how the request ended; the first outcome noted stands (an
    /// error answered, then the connection failing, is the error).
    pub fn end(&mut self, outcome: &str) {
        if self.outcome.is_none() {
            self.outcome = Some(outcome.to_owned());
        }
    }

    /// Notes a usage observation (the last one reported wins: providers
    /// report cumulative counts).
    pub fn usage(&mut self, prompt_tokens: u64, completion_tokens: u64) {
        self.prompt_tokens = Some(prompt_tokens);
        self.completion_tokens = Some(completion_tokens);
    }

    /// Prompt plus completion tokens observed (`None`: none observed);
    /// `u64::MAX` rather than a wrapped sum when a provider reports counts
    /// that large.
    pub fn total_tokens(&self) -> Option<u64> {
        match (self.prompt_tokens, self.completion_tokens) {
            (None, None) => None,
            (p, c) => Some(p.unwrap_or(0).saturating_add(c.unwrap_or(0))),
        }
    }

    /// How the request ended: the outcome noted, else what the response
    /// status says.
    pub fn outcome_of(&self, stats: &ExchangeStats) -> &str {
        self.outcome.as_deref().unwrap_or(match stats.status {
            Some(200..=399) => "completed",
            Some(_) => "error",
            None => "no_response",
        })
    }

    /// How complete the record's tokens are, for a request that ended
    /// with `outcome`.
    fn completeness(&self, outcome: &str) -> crate::plane::usage::Completeness {
        let observed = self.prompt_tokens.is_some() || self.completion_tokens.is_some();
        crate::plane::usage::Completeness::of(self.attempts > 0, outcome == "completed", observed)
    }

    /// The usage file's JSON line for this record ([`crate::plane::usage`]).
    pub fn usage_line(
        &self,
        unix_ms: i64,
        stats: &ExchangeStats,
        read_at: Instant,
        ended_at: Instant,
    ) -> String {
        let outcome = self.outcome_of(stats);
        let usage = self.completeness(outcome);
        let total = self.total_tokens();
        let tokens = |n: Option<u64>| n.map_or(Value::Null, Value::U64);
        let fields: [(&str, Value<'_>); 15] = [
            ("ts", Value::Ts(Timestamp(unix_ms))),
            ("request_id", Value::Str(&self.request_id)),
            ("principal", Value::Str(&self.principal)),
            ("path", Value::Str(&self.path)),
            ("model", opt_str(self.model.as_deref())),
            ("provider", opt_str(self.provider.as_deref())),
            ("node", opt_str(self.node.as_deref())),
            (
                "status",
                stats.status.map_or(Value::Null, |s| Value::U64(s.into())),
            ),
            ("outcome", Value::Str(outcome)),
            ("attempts", Value::U64(self.attempts.into())),
            ("usage", Value::Str(usage.as_str())),
            ("prompt_tokens", tokens(self.prompt_tokens)),
            ("completion_tokens", tokens(self.completion_tokens)),
            ("total_tokens", tokens(total)),
            (
                "duration_ms",
                Value::Ms(ended_at.saturating_duration_since(read_at)),
            ),
        ];
        json_line(&fields)
    }

    /// The line for this record, the response's `stats`, and its timing.
    pub fn line(
        &self,
        format: Format,
        unix_ms: i64,
        stats: &ExchangeStats,
        read_at: Instant,
        ended_at: Instant,
    ) -> String {
        let ttft = stats
            .first_body_byte_at
            .map(|at| at.saturating_duration_since(read_at));
        let duration = ended_at.saturating_duration_since(read_at);
        let outcome = self.outcome_of(stats);
        let usage = self.completeness(outcome);
        let ts = Timestamp(unix_ms);
        let trace_id = self.trace_id.map(|id| id.to_string());
        // Room for every field, the optional ones included: no regrowth.
        let mut fields: Vec<(&str, Value<'_>)> = Vec::with_capacity(21);
        fields.extend([
            ("ts", Value::Ts(ts)),
            ("request_id", Value::Str(&self.request_id)),
            ("principal", Value::Str(&self.principal)),
            ("method", Value::Str(&self.method)),
            ("path", Value::Str(&self.path)),
            ("model", opt_str(self.model.as_deref())),
            ("provider", opt_str(self.provider.as_deref())),
            ("node", opt_str(self.node.as_deref())),
            (
                "status",
                stats.status.map_or(Value::Null, |s| Value::U64(s.into())),
            ),
            ("outcome", Value::Str(outcome)),
            ("attempts", Value::U64(self.attempts.into())),
            ("ttft_ms", ttft.map_or(Value::Null, Value::Ms)),
            ("duration_ms", Value::Ms(duration)),
            ("bytes_in", Value::U64(self.bytes_in)),
            ("bytes_out", Value::U64(stats.bytes_out)),
            (
                "prompt_tokens",
                self.prompt_tokens.map_or(Value::Null, Value::U64),
            ),
            (
                "completion_tokens",
                self.completion_tokens.map_or(Value::Null, Value::U64),
            ),
            ("usage", Value::Str(usage.as_str())),
        ]);
        // Only on the lines of a cluster's forwarded requests.
        if let Some(peer) = &self.peer {
            fields.push(("peer", Value::Str(peer)));
        }
        if let Some(edge) = &self.forwarded_to {
            fields.push(("forwarded_to", Value::Str(edge)));
        }
        if let Some(id) = &trace_id {
            fields.push(("trace_id", Value::Str(id)));
        }
        match format {
            Format::Text => text_line(&fields),
            Format::Json => json_line(&fields),
        }
    }
}

/// A field value of a line.
enum Value<'a> {
    Str(&'a str),
    /// A wall-clock time, written as [`rfc3339_ms`] writes it.
    Ts(Timestamp),
    U64(u64),
    /// A duration, written in milliseconds with microsecond precision.
    Ms(Duration),
    Null,
}

/// Milliseconds since the Unix epoch, written as `YYYY-MM-DDTHH:MM:SS.mmmZ`
/// (UTC) by [`Timestamp::write_to`].
#[derive(Clone, Copy)]
struct Timestamp(i64);

impl Timestamp {
    /// Appends the time to `out`: the digits written one by one, as the
    /// line is written once per request and `format!` costs several
    /// times as much.
    fn write_to(self, out: &mut String) {
        let secs = self.0.div_euclid(1000);
        let ms = self.0.rem_euclid(1000);
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        if (0..=9999).contains(&year) {
            push_digits(out, year.unsigned_abs(), 4);
        } else {
            // Outside four digits: what `{:04}` writes (a sign, no padding
            // past four digits).
            let _ = write!(out, "{year:04}");
        }
        out.push('-');
        push_digits(out, month.into(), 2);
        out.push('-');
        push_digits(out, day.into(), 2);
        out.push('T');
        push_digits(out, rem.unsigned_abs() / 3600, 2);
        out.push(':');
        push_digits(out, rem.unsigned_abs() % 3600 / 60, 2);
        out.push(':');
        push_digits(out, rem.unsigned_abs() % 60, 2);
        out.push('.');
        push_digits(out, ms.unsigned_abs(), 3);
        out.push('Z');
    }
}

/// Appends the last `width` decimal digits of `n`, zero-padded.
fn push_digits(out: &mut String, n: u64, width: u32) {
    let mut rest = n;
    let mut digits = [b'0'; 20];
    let width = width.min(20) as usize;
    for slot in digits[..width].iter_mut().rev() {
        // `rest % 10` is a single digit: the cast cannot truncate.
        *slot = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    // Every byte is an ASCII digit.
    out.push_str(std::str::from_utf8(&digits[..width]).unwrap_or_default());
}

/// Appends `n` as 16 lowercase hex digits (`{:016x}`).
fn push_hex16(out: &mut String, n: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..16).rev() {
        out.push(char::from(HEX[((n >> (shift * 4)) & 0xf) as usize]));
    }
}

/// Appends `n` in decimal.
fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// Appends `d` in milliseconds with three decimals (microseconds, rounded
/// to the nearest), as `{:.3}` of the milliseconds would.
fn push_ms(out: &mut String, d: Duration) {
    let micros = (d.as_nanos() + 500) / 1000;
    let micros = u64::try_from(micros).unwrap_or(u64::MAX);
    push_u64(out, micros / 1000);
    out.push('.');
    push_digits(out, micros % 1000, 3);
}

fn opt_str(value: Option<&str>) -> Value<'_> {
    value.map_or(Value::Null, Value::Str)
}

fn text_line(fields: &[(&str, Value<'_>)]) -> String {
    let mut line = String::with_capacity(512);
    for (i, (key, value)) in fields.iter().enumerate() {
        if i > 0 {
            line.push(' ');
        }
        line.push_str(key);
        line.push('=');
        match value {
            Value::Str(s) if needs_quotes(s) => {
                // A JSON string is a valid logfmt quoted value.
                line.push_str(&serde_json::Value::from(*s).to_string());
            }
            Value::Str(s) => line.push_str(s),
            Value::Ts(ts) => ts.write_to(&mut line),
            Value::U64(n) => push_u64(&mut line, *n),
            Value::Ms(d) => push_ms(&mut line, *d),
            Value::Null => line.push('-'),
        }
    }
    line.push('\n');
    line
}

fn needs_quotes(s: &str) -> bool {
    s.is_empty()
        || s == "-"
        || s.bytes()
            .any(|b| b <= b' ' || b == b'"' || b == b'=' || b == b'\\' || b >= 0x7f)
}

fn json_line(fields: &[(&str, Value<'_>)]) -> String {
    let mut object = serde_json::Map::with_capacity(fields.len());
    for (key, value) in fields {
        let value = match value {
            Value::Str(s) => serde_json::Value::from(*s),
            Value::Ts(ts) => {
                let mut text = String::with_capacity(24);
                ts.write_to(&mut text);
                serde_json::Value::from(text)
            }
            Value::U64(n) => serde_json::Value::from(*n),
            Value::Ms(d) => {
                // Microsecond precision, as in the text form.
                let micros = d.as_micros() as f64;
                serde_json::Value::from(micros / 1000.0)
            }
            Value::Null => serde_json::Value::Null,
        };
        object.insert((*key).to_owned(), value);
    }
    let mut line = serde_json::Value::Object(object).to_string();
    line.push('\n');
    line
}

/// `unix_ms` as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC).
pub fn rfc3339_ms(unix_ms: i64) -> String {
    let mut text = String::with_capacity(24);
    Timestamp(unix_ms).write_to(&mut text);
    text
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Access log lines dropped because the writer's queue was full, process-wide
/// (`iop_edge_access_log_dropped_lines_total`).
pub fn dropped_lines() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// The access log as `/status` and the status page show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessStatus {
    /// Where lines go (from the writer's next batch on).
    pub destination: Destination,
    /// Why the file the last reload named could not be opened (lines
    /// still go to `destination`); cleared by a reload that opens it.
    pub open_error: Option<String>,
    /// Why the last batch could not be written, while writes fail.
    pub write_error: Option<String>,
    /// Batches that could not be written so far.
    pub write_errors: u64,
    /// Reloads whose file could not be opened so far.
    pub open_errors: u64,
    /// Lines dropped because the writer's queue was full (process-wide).
    pub dropped_lines: u64,
}

impl AccessStatus {
    /// Lines do not reach the configured destination: the last batch
    /// failed, or the last reload could not open the file.
    pub fn is_failing(&self) -> bool {
        self.open_error.is_some() || self.write_error.is_some()
    }
}

/// The access log: lines go to one writer thread, shared by every shard
/// (clones are handles to one writer).
#[derive(Debug, Clone)]
pub struct AccessLog {
    tx: Option<mpsc::SyncSender<Queued>>,
    writer: Option<Arc<Mutex<Option<JoinHandle<()>>>>>,
    format: Format,
    shared: Option<Arc<Shared>>,
}

/// What the writer's queue holds.
#[derive(Debug)]
enum Queued {
    Line(String),
    /// Write what is queued and stop.
    Close,
}

type BoxedSink = Box<dyn std::io::Write + Send>;

/// What the writer and the reloads share.
struct Shared {
    /// The format edge.toml set (`None`: it follows `--log-format`).
    requested_format: Option<Format>,
    /// A destination a reload opened, taken by the writer before its next
    /// batch.
    next_sink: Mutex<Option<BoxedSink>>,
    state: Mutex<State>,
    write_errors: AtomicU64,
    open_errors: AtomicU64,
}

#[derive(Debug)]
struct State {
    destination: Destination,
    open_error: Option<String>,
    write_error: Option<String>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("requested_format", &self.requested_format)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl AccessLog {
    /// No access log.
    pub fn off() -> Self {
        Self {
            tx: None,
            writer: None,
            format: Format::Text,
            shared: None,
        }
    }

    /// Starts a writer thread for `spec` (none when it is off). A file is
    /// opened here, so an unwritable path is an error at startup.
    pub fn start(spec: &AccessLogSpec) -> std::io::Result<Self> {
        let sink: BoxedSink = match &spec.destination {
            Destination::Off => return Ok(Self::off()),
            Destination::Stderr => Box::new(std::io::stderr()),
            Destination::File(path) => Box::new(open_appending(path)?),
        };
        Self::with_sink(sink, spec, ACCESS_LOG_BACKLOG, ACCESS_LOG_FLUSH_INTERVAL)
    }

    fn with_sink(
        sink: BoxedSink,
        spec: &AccessLogSpec,
        backlog: usize,
        interval: Duration,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            requested_format: spec.format_explicit.then_some(spec.format),
            next_sink: Mutex::new(None),
            state: Mutex::new(State {
                destination: spec.destination.clone(),
                open_error: None,
                write_error: None,
            }),
            write_errors: AtomicU64::new(0),
            open_errors: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::sync_channel::<Queued>(backlog);
        let for_thread = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("iop-access-log".into())
            .spawn(move || write_lines(rx, sink, interval, &for_thread))?;
        Ok(Self {
            tx: Some(tx),
            writer: Some(Arc::new(Mutex::new(Some(handle)))),
            format: spec.format,
            shared: Some(shared),
        })
    }

    /// Whether lines are written at all.
    pub fn is_on(&self) -> bool {
        self.tx.is_some()
    }

    /// The format lines are written in.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Queues `line` (never waits; a full queue drops it, counted).
    pub fn write(&self, line: String) {
        if let Some(tx) = &self.tx {
            if tx.try_send(Queued::Line(line)).is_err() {
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Follows a reload's `[edge.access_log]` (`next`, from the file
    /// `source`). A file destination — the same path (rotation: rename
    /// it, then reload) or another — is opened here and lines go to it
    /// from the writer's next batch on, as they do when the destination
    /// becomes stderr or a file instead of stderr. A file that cannot be
    /// opened keeps the running destination (lines go on to it) and is
    /// reported in [`LogReload::kept`], counted
    /// (`iop_edge_access_log_open_errors_total`) and shown as the log's
    /// `open_error` until a reload opens its file. Turning the access log
    /// on or off, and another `format`, need a restart.
    pub fn apply_reload(&self, source: &Path, next: &AccessLogSpec) -> LogReload {
        let Some(shared) = &self.shared else {
            let turned_on = next.destination != Destination::Off;
            return LogReload {
                kept: None,
                restart_required: turned_on.then_some("[edge.access_log] turned on"),
            };
        };
        if next.destination == Destination::Off {
            return LogReload {
                kept: None,
                restart_required: Some("[edge.access_log] turned off"),
            };
        }
        let requested = next.format_explicit.then_some(next.format);
        let restart_required =
            (requested != shared.requested_format).then_some("[edge.access_log] format");
        let sink: BoxedSink = match &next.destination {
            Destination::Stderr if shared.state().destination == Destination::Stderr => {
                return LogReload {
                    kept: None,
                    restart_required,
                };
            }
            Destination::Off | Destination::Stderr => Box::new(std::io::stderr()),
            Destination::File(path) => match open_appending(path) {
                Ok(file) => Box::new(file),
                Err(e) => {
                    let why = cannot_append(path, &e);
                    shared.open_errors.fetch_add(1, Ordering::Relaxed);
                    let mut state = shared.state();
                    tracing::error!(
                        path = %path.display(),
                        error = %e,
                        "access log file cannot be opened; writing where it did"
                    );
                    state.open_error = Some(why.clone());
                    let error = ConfigError::new(source, OperationalPath::AccessLog.key(), why);
                    return LogReload {
                        kept: Some(format!(
                            "{error}; keeping the running access log ({})",
                            destination_name(&state.destination)
                        )),
                        restart_required,
                    };
                }
            },
        };
        *shared
            .next_sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(sink);
        let mut state = shared.state();
        state.destination = next.destination.clone();
        state.open_error = None;
        LogReload {
            kept: None,
            restart_required,
        }
    }

    /// Where lines go and what went wrong (destination `off` when off).
    pub fn status(&self) -> AccessStatus {
        let dropped_lines = dropped_lines();
        let Some(shared) = &self.shared else {
            return AccessStatus {
                destination: Destination::Off,
                open_error: None,
                write_error: None,
                write_errors: 0,
                open_errors: 0,
                dropped_lines,
            };
        };
        let state = shared.state();
        AccessStatus {
            destination: state.destination.clone(),
            open_error: state.open_error.clone(),
            write_error: state.write_error.clone(),
            write_errors: shared.write_errors.load(Ordering::Relaxed),
            open_errors: shared.open_errors.load(Ordering::Relaxed),
            dropped_lines,
        }
    }

    /// The access log's series for `/metrics`.
    pub fn render_prometheus(&self) -> String {
        let status = self.status();
        format!(
            "# HELP iop_edge_access_log_dropped_lines_total Access log lines dropped because the writer's queue was full.\n\
             # TYPE iop_edge_access_log_dropped_lines_total counter\n\
             iop_edge_access_log_dropped_lines_total {}\n\
             # HELP iop_edge_access_log_write_errors_total Access log batches that could not be written.\n\
             # TYPE iop_edge_access_log_write_errors_total counter\n\
             iop_edge_access_log_write_errors_total {}\n\
             # HELP iop_edge_access_log_open_errors_total Reloads whose access log file could not be opened (lines went on to the running destination).\n\
             # TYPE iop_edge_access_log_open_errors_total counter\n\
             iop_edge_access_log_open_errors_total {}\n\
             # HELP iop_edge_access_log_failing 1 while lines do not reach the configured destination: its last batch failed, or the last reload could not open its file.\n\
             # TYPE iop_edge_access_log_failing gauge\n\
             iop_edge_access_log_failing {}\n",
            status.dropped_lines,
            status.write_errors,
            status.open_errors,
            u8::from(status.is_failing()),
        )
    }

    /// Writes every line queued so far and stops the writer (at shutdown,
    /// after the drain); waits [`ACCESS_LOG_CLOSE_WAIT`] at most. Lines
    /// queued after this are not written.
    pub fn close(&self) {
        let (Some(tx), Some(writer)) = (&self.tx, &self.writer) else {
            return;
        };
        let Some(handle) = writer.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            return;
        };
        let deadline = clock::now() + ACCESS_LOG_CLOSE_WAIT;
        let mut close = Queued::Close;
        while clock::now() < deadline && !handle.is_finished() {
            match tx.try_send(close) {
                Ok(()) => {
                    handle.thread().unpark();
                    break;
                }
                Err(mpsc::TrySendError::Full(back)) => close = back,
                Err(mpsc::TrySendError::Disconnected(_)) => return,
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        while clock::now() < deadline && !handle.is_finished() {
            std::thread::sleep(Duration::from_millis(1));
        }
        if handle.is_finished() {
            let _ = handle.join();
        } else {
            tracing::warn!("access log writer did not finish; lines still queued are lost");
        }
    }
}

/// A destination as messages and `/status` name it.
pub fn destination_name(destination: &Destination) -> String {
    match destination {
        Destination::Off => "off".to_owned(),
        Destination::Stderr => "stderr".to_owned(),
        Destination::File(path) => path.display().to_string(),
    }
}

/// The writer thread: waits for a line when idle; then writes what has
/// queued (whole lines, flushed as one batch: appends of whole lines do not
/// interleave with another writer's), parks `interval` while more queues,
/// and goes on while there is more. Before each batch it takes the
/// destination a reload opened, if any (what the old one was given is
/// flushed to it first). Ends at [`Queued::Close`] or when every sender
/// is gone, having written what was queued.
fn write_lines(rx: mpsc::Receiver<Queued>, sink: BoxedSink, interval: Duration, shared: &Shared) {
    const BUFFER_BYTES: usize = 64 * 1024;
    let mut out = std::io::BufWriter::with_capacity(BUFFER_BYTES, sink);
    let mut failing = false;
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(head) = next.take() {
            let reopened = shared
                .next_sink
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(sink) = reopened {
                // Dropping the old writer flushes what it still holds.
                out = std::io::BufWriter::with_capacity(BUFFER_BYTES, sink);
            }
            let mut failed: Option<std::io::Error> = None;
            let mut closing = false;
            for queued in std::iter::once(head).chain(rx.try_iter()) {
                match queued {
                    Queued::Line(line) => {
                        if let Err(e) = out.write_all(line.as_bytes()) {
                            failed.get_or_insert(e);
                        }
                    }
                    Queued::Close => closing = true,
                }
            }
            if let Err(e) = out.flush() {
                failed.get_or_insert(e);
            }
            match failed {
                Some(e) => {
                    // Nowhere to say it but the process log; once per batch.
                    tracing::warn!(error = %e, "access log write failed");
                    shared.state().write_error = Some(e.to_string());
                    shared.write_errors.fetch_add(1, Ordering::Relaxed);
                    failing = true;
                }
                None if failing => {
                    shared.state().write_error = None;
                    failing = false;
                }
                None => {}
            }
            if closing {
                return;
            }
            // Senders find no receiver waiting while this parks: queueing
            // a line wakes nobody. `close` unparks it.
            std::thread::park_timeout(interval);
            next = match rx.try_recv() {
                Ok(queued) => Some(queued),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_the_clients_when_valid_else_minted() {
        let ids = RequestIds::new(SplitMix64::new(7));
        assert_eq!(
            ids.for_request(Some(b"abc-123_x.y:z/+=@")),
            "abc-123_x.y:z/+=@"
        );
        let uuid = b"0b8f7a4e-3c1d-4f5e-9a2b-7c6d5e4f3a2b";
        assert_eq!(ids.for_request(Some(uuid)).as_bytes(), uuid);
        let long = vec![b'a'; MAX_REQUEST_ID_BYTES];
        assert_eq!(ids.for_request(Some(&long)).len(), MAX_REQUEST_ID_BYTES);
        let too_long = vec![b'a'; MAX_REQUEST_ID_BYTES + 1];
        for bad in [
            &b""[..],
            b"has space",
            b"quote\"",
            b"new\nline",
            b"caf\xc3\xa9",
            &too_long,
        ] {
            let minted = ids.for_request(Some(bad));
            assert!(minted.starts_with("req_") && minted.len() == 36, "{minted}");
            assert!(is_valid_request_id(minted.as_bytes()));
        }
        let a = ids.for_request(None);
        let b = ids.for_request(None);
        assert_ne!(a, b);
        // A fixed seed gives fixed ids.
        let again = RequestIds::new(SplitMix64::new(7));
        assert_eq!(again.mint(), ids_first(7));
    }

    fn ids_first(seed: u64) -> String {
        let mut rng = SplitMix64::new(seed);
        format!("req_{:016x}{:016x}", rng.next_u64(), rng.next_u64())
    }

    #[test]
    fn timestamps_are_utc_rfc3339_with_milliseconds() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339_ms(1_796_197_014_999), "2026-12-02T07:36:54.999Z");
        assert_eq!(rfc3339_ms(-1), "1969-12-31T23:59:59.999Z");
    }

    /// The digits written by hand are what `format!` wrote before, over a
    /// seeded sweep of times (from before 1970 to past 9999) and of
    /// durations (whole, half and odd microseconds).
    #[test]
    fn hand_written_numbers_match_format() {
        fn by_format(unix_ms: i64) -> String {
            let secs = unix_ms.div_euclid(1000);
            let ms = unix_ms.rem_euclid(1000);
            let rem = secs.rem_euclid(86_400);
            let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
            format!(
                "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
                rem / 3600,
                rem % 3600 / 60,
                rem % 60
            )
        }
        let seed = 0x005e_ed0f_71e5_u64;
        println!("seed {seed:#x}");
        let mut rng = iop_engine::rng::SplitMix64::new(seed);
        let far = 400_000_000_000_000_i64; // about the year 14,700
        for _ in 0..20_000 {
            let t = (rng.next_u64() % (2 * far as u64)) as i64 - far;
            assert_eq!(rfc3339_ms(t), by_format(t), "unix_ms {t}");
        }
        for t in [
            i64::MIN / 2,
            -62_167_219_200_001,
            -62_167_219_200_000,
            253_402_300_799_999,
            253_402_300_800_000,
        ] {
            assert_eq!(rfc3339_ms(t), by_format(t), "unix_ms {t}");
        }
        for _ in 0..20_000 {
            let nanos = rng.next_u64() % 10_000_000_000_000;
            // Away from a tie, where f64 rounding and ours may differ.
            if (nanos % 1000).abs_diff(500) < 2 {
                continue;
            }
            let d = Duration::from_nanos(nanos);
            let mut ours = String::new();
            push_ms(&mut ours, d);
            assert_eq!(
                ours,
                format!("{:.3}", d.as_secs_f64() * 1000.0),
                "{nanos} ns"
            );
        }
        for n in [0, 1, 9, 10, 99, 1234567, u64::MAX] {
            let mut ours = String::new();
            push_u64(&mut ours, n);
            assert_eq!(ours, n.to_string());
        }
        for n in [0, 1, 0xa, 0xdead_beef, u64::MAX, rng.next_u64()] {
            let mut ours = String::new();
            push_hex16(&mut ours, n);
            assert_eq!(ours, format!("{n:016x}"));
        }
    }

    fn record() -> AccessRecord {
        let mut r = AccessRecord::new("req-1".into(), "POST", "/v1/chat/completions", 42);
        r.principal = "team a".into();
        r.set_model("gpt-x");
        r.attempt("node-a", "p1");
        r.attempt("node-b", "p2");
        r.usage(5, 7);
        r.end("completed");
        r.end("client_disconnect");
        r
    }

    fn stats(read_at: Instant) -> ExchangeStats {
        ExchangeStats {
            status: Some(200),
            bytes_out: 1234,
            first_body_byte_at: Some(read_at + Duration::from_micros(12_345)),
        }
    }

    #[test]
    fn a_text_line_is_logfmt_with_every_field() {
        let read_at = iop_engine::clock::now();
        let line = record().line(
            Format::Text,
            0,
            &stats(read_at),
            read_at,
            read_at + Duration::from_millis(500),
        );
        assert_eq!(
            line,
            "ts=1970-01-01T00:00:00.000Z request_id=req-1 principal=\"team a\" method=POST \
             path=/v1/chat/completions model=gpt-x provider=node-b/p2 node=node-b status=200 \
             outcome=completed attempts=2 ttft_ms=12.345 duration_ms=500.000 bytes_in=42 \
             bytes_out=1234 prompt_tokens=5 completion_tokens=7 usage=reported\n"
        );
    }

    #[test]
    fn a_json_line_parses_with_nulls_for_what_is_unknown() {
        let read_at = iop_engine::clock::now();
        let bare = AccessRecord::new("req-2".into(), "GET", "/nope", 0);
        let line = bare.line(
            Format::Json,
            0,
            &ExchangeStats {
                status: Some(404),
                bytes_out: 99,
                first_body_byte_at: None,
            },
            read_at,
            read_at,
        );
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "ts": "1970-01-01T00:00:00.000Z", "request_id": "req-2",
                "principal": "anonymous", "method": "GET", "path": "/nope",
                "model": null, "provider": null, "node": null, "status": 404,
                "outcome": "error", "attempts": 0, "ttft_ms": null, "duration_ms": 0.0,
                "bytes_in": 0, "bytes_out": 99, "prompt_tokens": null,
                "completion_tokens": null, "usage": "none"
            })
        );
    }

    #[test]
    fn a_traced_request_names_its_trace_and_others_do_not() {
        let read_at = iop_engine::clock::now();
        let stats = ExchangeStats {
            status: Some(200),
            bytes_out: 1,
            first_body_byte_at: None,
        };
        let mut traced = AccessRecord::new("req-t".into(), "POST", "/v1/chat/completions", 2);
        traced.trace_id = Some(iop_engine::trace::TraceId([0xab; 16]));
        let line = traced.line(Format::Json, 0, &stats, read_at, read_at);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["trace_id"], "abababababababababababababababab");
        let text = traced.line(Format::Text, 0, &stats, read_at, read_at);
        assert!(
            text.trim_end()
                .ends_with(" trace_id=abababababababababababababababab"),
            "{text}"
        );
        traced.trace_id = None;
        let v: serde_json::Value =
            serde_json::from_str(&traced.line(Format::Json, 0, &stats, read_at, read_at)).unwrap();
        assert_eq!(v.get("trace_id"), None);
    }

    #[test]
    fn a_usage_line_says_how_complete_its_tokens_are() {
        let read_at = iop_engine::clock::now();
        let end = read_at + Duration::from_millis(250);
        let line = record().usage_line(0, &stats(read_at), read_at, end);
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "ts": "1970-01-01T00:00:00.000Z", "request_id": "req-1",
                "principal": "team a", "path": "/v1/chat/completions", "model": "gpt-x",
                "provider": "node-b/p2", "node": "node-b", "status": 200,
                "outcome": "completed", "attempts": 2, "usage": "reported",
                "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                "duration_ms": 250.0
            })
        );
        // Cut short after an observation: partial, with what was seen.
        let mut cut = AccessRecord::new("req-3".into(), "POST", "/v1/chat/completions", 9);
        cut.attempt("node-a", "p1");
        cut.usage(11, 3);
        cut.end("client_disconnect");
        let v: serde_json::Value =
            serde_json::from_str(&cut.usage_line(0, &stats(read_at), read_at, end)).unwrap();
        assert_eq!(
            (&v["usage"], &v["outcome"], &v["total_tokens"]),
            (&"partial".into(), &"client_disconnect".into(), &14.into())
        );
        // Completed without usage: none, and no tokens are made up.
        let mut bare = AccessRecord::new("req-4".into(), "POST", "/v1/chat/completions", 9);
        bare.attempt("node-a", "p1");
        let v: serde_json::Value =
            serde_json::from_str(&bare.usage_line(0, &stats(read_at), read_at, end)).unwrap();
        assert_eq!(v["usage"], "none");
        assert_eq!(
            (
                &v["prompt_tokens"],
                &v["completion_tokens"],
                &v["total_tokens"]
            ),
            (
                &serde_json::Value::Null,
                &serde_json::Value::Null,
                &serde_json::Value::Null
            )
        );
    }

    // Counts a provider reports near u64::MAX add up to u64::MAX, never a
    // small wrapped total: the usage line and the token limit's settlement
    // (`total_tokens`) read the same sum.
    #[test]
    fn the_token_total_saturates() {
        let read_at = iop_engine::clock::now();
        let mut r = AccessRecord::new("req-5".into(), "POST", "/v1/chat/completions", 9);
        r.attempt("node-a", "p1");
        assert_eq!(r.total_tokens(), None);
        r.usage(u64::MAX, 2);
        assert_eq!(r.total_tokens(), Some(u64::MAX));
        let v: serde_json::Value =
            serde_json::from_str(&r.usage_line(0, &stats(read_at), read_at, read_at)).unwrap();
        assert_eq!(
            (
                &v["prompt_tokens"],
                &v["completion_tokens"],
                &v["total_tokens"]
            ),
            (&u64::MAX.into(), &2.into(), &u64::MAX.into())
        );
        r.usage(u64::MAX - 3, 3);
        assert_eq!(r.total_tokens(), Some(u64::MAX));
        r.usage(7, 0);
        assert_eq!(r.total_tokens(), Some(7));
    }

    #[test]
    fn models_are_cut_to_a_bounded_length() {
        let mut r = AccessRecord::default();
        r.set_model(&"é".repeat(100));
        let model = r.model.unwrap();
        assert!(model.len() <= MAX_LOGGED_MODEL_BYTES && model.chars().all(|c| c == 'é'));
    }

    /// The spec of a log whose sink a test gives.
    fn memory() -> AccessLogSpec {
        AccessLogSpec {
            destination: Destination::File("(memory)".into()),
            format: Format::Text,
            format_explicit: true,
        }
    }

    fn file_spec(path: &Path) -> AccessLogSpec {
        AccessLogSpec {
            destination: Destination::File(path.to_owned()),
            format: Format::Json,
            format_explicit: true,
        }
    }

    /// Polls `done` every 10 ms, at most a minute (an outcome, not a
    /// timing bound: the writer works when lines arrive).
    fn wait_for(what: &str, done: impl Fn() -> bool) {
        for _ in 0..6_000 {
            if done() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("{what} did not happen within a minute");
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("iop-access-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    // A reload whose access log file cannot be opened keeps the running
    // file (lines go on to it), says why and shows it until a reload opens
    // a file, which takes the lines from then on.
    #[test]
    fn a_file_that_cannot_be_opened_keeps_the_running_destination() {
        let dir = temp("kept");
        let (first, second) = (dir.join("a.log"), dir.join("b.log"));
        let broken = dir.join("sub");
        std::fs::create_dir(&broken).unwrap();
        let source = dir.join("edge.toml");
        let log = AccessLog::start(&file_spec(&first)).unwrap();
        log.write("1\n".into());
        wait_for("the first line", || {
            std::fs::read_to_string(&first).unwrap() == "1\n"
        });
        let why = format!(
            "cannot open {} for appending: Is a directory (os error 21)",
            broken.display()
        );
        assert_eq!(
            log.apply_reload(&source, &file_spec(&broken)),
            LogReload {
                kept: Some(format!(
                    "{}: edge.access_log.destination: {why}; keeping the running access log ({})",
                    source.display(),
                    first.display()
                )),
                restart_required: None,
            }
        );
        let status = log.status();
        assert_eq!(
            (
                &status.destination,
                status.open_error.as_deref(),
                status.write_error.as_deref(),
                status.open_errors,
                status.write_errors,
            ),
            (
                &Destination::File(first.clone()),
                Some(why.as_str()),
                None,
                1,
                0
            )
        );
        let text = log.render_prometheus();
        assert!(text.contains("\niop_edge_access_log_failing 1\n"), "{text}");
        assert!(
            text.contains("\niop_edge_access_log_open_errors_total 1\n"),
            "{text}"
        );
        log.write("2\n".into());
        wait_for("the second line", || {
            std::fs::read_to_string(&first).unwrap() == "1\n2\n"
        });
        // Another file that opens: the next lines go there.
        assert_eq!(
            log.apply_reload(&source, &file_spec(&second)),
            LogReload::default()
        );
        assert!(!log.status().is_failing());
        log.write("3\n".into());
        log.close();
        assert_eq!(std::fs::read_to_string(&first).unwrap(), "1\n2\n");
        assert_eq!(std::fs::read_to_string(&second).unwrap(), "3\n");
        assert!(log
            .render_prometheus()
            .contains("\niop_edge_access_log_failing 0\n"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    // What the writer cannot take while running is reported as needing a
    // restart, not applied: turning it on or off, another format.
    #[test]
    fn on_off_and_format_changes_need_a_restart() {
        let source = Path::new("edge.toml");
        let restart = |what| LogReload {
            kept: None,
            restart_required: Some(what),
        };
        let off = AccessLog::off();
        assert_eq!(
            off.apply_reload(source, &AccessLogSpec::default()),
            restart("[edge.access_log] turned on")
        );
        let spec_off = AccessLogSpec {
            destination: Destination::Off,
            ..AccessLogSpec::default()
        };
        assert_eq!(off.apply_reload(source, &spec_off), LogReload::default());
        let log = AccessLog::with_sink(
            Box::new(Recorded::default()),
            &AccessLogSpec::default(),
            4,
            Duration::ZERO,
        )
        .unwrap();
        assert_eq!(
            log.apply_reload(source, &spec_off),
            restart("[edge.access_log] turned off")
        );
        // Stderr with the format left to --log-format: nothing changed.
        assert_eq!(
            log.apply_reload(source, &AccessLogSpec::default()),
            LogReload::default()
        );
        let json = AccessLogSpec {
            format: Format::Json,
            format_explicit: true,
            ..AccessLogSpec::default()
        };
        assert_eq!(
            log.apply_reload(source, &json),
            restart("[edge.access_log] format")
        );
        assert_eq!(log.status().destination, Destination::Stderr);
        log.close();
    }

    /// A sink every write of which fails.
    struct Full;

    impl std::io::Write for Full {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("no space left on device"))
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    // A batch that cannot be written is counted and shown while writes
    // fail; a working destination clears it with its first batch.
    #[test]
    fn failed_writes_are_counted_and_shown_until_a_batch_succeeds() {
        let dir = temp("full");
        let good = dir.join("good.log");
        let log = AccessLog::with_sink(Box::new(Full), &memory(), 16, Duration::ZERO).unwrap();
        log.write("lost\n".into());
        wait_for("a failed batch", || log.status().write_errors >= 1);
        let status = log.status();
        assert_eq!(
            status.write_error.as_deref(),
            Some("no space left on device")
        );
        assert!(status.is_failing());
        assert!(log
            .render_prometheus()
            .contains("\niop_edge_access_log_failing 1\n"));
        let next = AccessLogSpec {
            format: Format::Text,
            ..file_spec(&good)
        };
        assert_eq!(
            log.apply_reload(&dir.join("edge.toml"), &next),
            LogReload::default()
        );
        log.write("kept\n".into());
        log.close();
        assert_eq!(std::fs::read_to_string(&good).unwrap(), "kept\n");
        assert_eq!(log.status().write_error, None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A sink whose first write reports itself and then blocks until
    /// released.
    struct Stuck {
        entered: mpsc::Sender<()>,
        release: mpsc::Receiver<()>,
    }

    impl std::io::Write for Stuck {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.entered.send(());
            let _ = self.release.recv();
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stuck_writer_costs_lines_not_the_shard() {
        let (entered, writing) = mpsc::channel();
        let (release, released) = mpsc::channel();
        let sink = Stuck {
            entered,
            release: released,
        };
        let log = AccessLog::with_sink(Box::new(sink), &memory(), 4, Duration::ZERO).unwrap();
        let before = dropped_lines();
        log.write("first\n".into());
        // The buffered writer passes a line to the sink only when flushing.
        writing.recv().unwrap();
        // The writer is stuck in the sink: 4 lines queue, 3 are dropped, and
        // no write waits.
        for i in 0..7 {
            log.write(format!("line {i}\n"));
        }
        assert_eq!(dropped_lines() - before, 3);
        drop(release);
    }

    /// A sink that keeps each write it is given.
    #[derive(Clone, Default)]
    struct Recorded(Arc<Mutex<Vec<String>>>);

    impl Recorded {
        fn writes(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
    }

    impl std::io::Write for Recorded {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let text = String::from_utf8(buf.to_vec()).map_err(std::io::Error::other)?;
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(text);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_busy_writer_gathers_lines_into_one_write_and_close_writes_them() {
        let sink = Recorded::default();
        // An interval no test outlasts: only `close` ends the wait.
        let log = AccessLog::with_sink(
            Box::new(sink.clone()),
            &memory(),
            16,
            Duration::from_secs(3600),
        )
        .unwrap();
        // Idle, the writer takes the first line at once.
        log.write("a\n".into());
        let started = clock::now();
        while sink.writes().is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "first line never written"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // Busy, it lets the next lines gather: they are queued, not written.
        for line in ["b\n", "c\n", "d\n"] {
            log.write(line.into());
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(sink.writes(), ["a\n"]);
        // Closing writes them, in order, in one write.
        log.close();
        assert_eq!(sink.writes(), ["a\n", "b\nc\nd\n"]);
    }

    #[test]
    fn a_file_destination_gets_whole_lines() {
        let dir = std::env::temp_dir().join(format!("iop-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        let _ = std::fs::remove_file(&path);
        let log = AccessLog::start(&AccessLogSpec {
            destination: Destination::File(path.clone()),
            format: Format::Json,
            format_explicit: true,
        })
        .unwrap();
        assert!(log.is_on());
        log.write("{\"a\":1}\n".into());
        log.write("{\"a\":2}\n".into());
        // Closing writes what is queued before it returns.
        log.clone().close();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"a\":1}\n{\"a\":2}\n");
        // Lines after the close are not written (and do not block).
        log.write("{\"a\":3}\n".into());
        log.close();
        assert!(!AccessLog::off().is_on());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
