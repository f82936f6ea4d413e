//! The monoio shell of the load generator: one thread's workers or
//! open-loop scheduler, each request a raw HTTP/1.1 exchange over a
//! `TCP_NODELAY` socket (`iop_engine::http`), its SSE body split as it
//! arrives and every payload handed to the pure [`StreamTracker`].
//!
//! Each request runs under a deadline (`monoio::time::timeout`). On a
//! plain TCP connection a cancelled read only loses that connection, which
//! is then dropped, so the engine's "never cancel a read" rule (about TLS
//! streams) does not bite here.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use monoio::net::TcpStream;

use iop_engine::clock::monotonic_raw_ns;
use iop_engine::http::{ClientConn, HttpError, Limits, SseSplitter};

use super::chunk::{classify, Observation, StreamEnd, StreamTracker};
use super::progress::Live;
use super::recorder::{Failure, Recorder};
use super::schedule::{stagger_ns, ArrivalSchedule};
use super::{ApiKey, LoadSpec, Mode};

/// Largest SSE event accepted from a server.
const MAX_EVENT_BYTES: usize = 1024 * 1024;
/// Largest error or JSON body read.
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// Pause after a failed connect before a closed-loop worker tries again,
/// so a dead server does not spin the thread.
const RECONNECT_PAUSE_MS: u64 = 10;
/// Poll period while waiting for open-loop requests to finish.
const DRAIN_POLL_MS: u64 = 2;

/// One thread's share of a run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ThreadPlan {
    /// This thread's index.
    pub thread: u64,
    /// Number of load threads.
    pub threads: u64,
    /// Streams this thread runs (closed-loop and one-shot modes).
    pub streams: u64,
    /// Global index of this thread's first stream.
    pub first_stream: u64,
    /// Total streams over every thread.
    pub total_streams: u64,
    /// When the run starts.
    pub start_ns: u64,
    /// No request starts at or after this.
    pub deadline_ns: u64,
    /// Every request is cut off at this time.
    pub hard_deadline_ns: u64,
}

/// What one thread hands back.
#[derive(Debug)]
pub(crate) struct ThreadResult {
    /// Its figures.
    pub recorder: Recorder,
    /// When its last response ended (or `start_ns` if none did).
    pub last_end_ns: u64,
}

/// The fixed parts of every request of a run, and the thread's figures.
struct Ctx {
    spec: Arc<LoadSpec>,
    live: Arc<Live>,
    body: Bytes,
    recorder: RefCell<Recorder>,
    in_flight: Cell<u64>,
    last_end_ns: Cell<u64>,
    hard_deadline_ns: u64,
    /// The next request's number (`x-request-id`).
    next_request: Cell<u64>,
}

/// Counts a request in flight from creation to drop, here and in [`Live`].
struct InFlight {
    ctx: Rc<Ctx>,
}

impl InFlight {
    fn new(ctx: &Rc<Ctx>) -> Self {
        ctx.in_flight.set(ctx.in_flight.get() + 1);
        ctx.live.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            ctx: Rc::clone(ctx),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let ctx = &self.ctx;
        ctx.in_flight.set(ctx.in_flight.get().saturating_sub(1));
        ctx.live.in_flight.fetch_sub(1, Ordering::Relaxed);
        let now = monotonic_raw_ns();
        if now > ctx.last_end_ns.get() {
            ctx.last_end_ns.set(now);
        }
    }
}

/// The chat-completions request body of a run.
pub(crate) fn request_body(model: &str, tokens: u32, stream: bool) -> Bytes {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "iop bench"}],
        "stream": stream,
        "max_tokens": tokens,
    });
    Bytes::from(body.to_string())
}

async fn sleep_until_ns(when_ns: u64) {
    let now = monotonic_raw_ns();
    if when_ns > now {
        monoio::time::sleep(Duration::from_nanos(when_ns - now)).await;
    }
}

/// Runs one thread's share of `spec` on the current monoio runtime.
pub(crate) async fn run_thread(
    spec: Arc<LoadSpec>,
    live: Arc<Live>,
    plan: ThreadPlan,
) -> ThreadResult {
    let body = request_body(&spec.model, spec.tokens, spec.stream);
    let ctx = Rc::new(Ctx {
        recorder: RefCell::new(Recorder::new(spec.gap_limit_ns)),
        spec,
        live,
        body,
        in_flight: Cell::new(0),
        last_end_ns: Cell::new(plan.start_ns),
        hard_deadline_ns: plan.hard_deadline_ns,
        next_request: Cell::new(0),
    });
    match ctx.spec.mode {
        Mode::Concurrency { .. } | Mode::OneShot { .. } => {
            let one_shot = matches!(ctx.spec.mode, Mode::OneShot { .. });
            let ramp_ns = ctx.spec.ramp_ms.saturating_mul(1_000_000);
            let workers: Vec<_> = (0..plan.streams)
                .map(|j| {
                    let index = plan.first_stream + j;
                    let start_at = plan.start_ns + stagger_ns(index, plan.total_streams, ramp_ns);
                    monoio::spawn(worker(
                        Rc::clone(&ctx),
                        start_at,
                        plan.deadline_ns,
                        one_shot,
                    ))
                })
                .collect();
            for handle in workers {
                handle.await;
            }
        }
        Mode::Rate { per_s } => {
            let schedule = ArrivalSchedule::new(plan.start_ns, per_s, plan.thread, plan.threads);
            open_loop(&ctx, schedule, plan.deadline_ns).await;
        }
    }
    let recorder = ctx.recorder.borrow().clone();
    ThreadResult {
        last_end_ns: ctx.last_end_ns.get(),
        recorder,
    }
}

/// A closed-loop stream: requests back to back on one connection until
/// the deadline (or exactly one request in one-shot mode).
async fn worker(ctx: Rc<Ctx>, start_at_ns: u64, deadline_ns: u64, one_shot: bool) {
    sleep_until_ns(start_at_ns).await;
    let mut conn: Option<ClientConn<TcpStream>> = None;
    let mut first = true;
    loop {
        let out_of_time = !one_shot && monotonic_raw_ns() >= deadline_ns;
        if ctx.spec.stop.load(Ordering::Relaxed) || out_of_time || (one_shot && !first) {
            break;
        }
        first = false;
        let guard = InFlight::new(&ctx);
        let failure = run_request(&ctx, &mut conn, monotonic_raw_ns()).await;
        drop(guard);
        if failure == Some(Failure::Connect) {
            monoio::time::sleep(Duration::from_millis(RECONNECT_PAUSE_MS)).await;
        }
    }
}

/// The open-loop scheduler: starts each request when it is due, whatever
/// the earlier ones are doing, then waits for the stragglers (each is cut
/// off at the hard deadline).
async fn open_loop(ctx: &Rc<Ctx>, schedule: ArrivalSchedule, deadline_ns: u64) {
    let pool: Rc<RefCell<Vec<ClientConn<TcpStream>>>> = Rc::new(RefCell::new(Vec::new()));
    let max_in_flight = ctx.spec.max_in_flight.max(1);
    let mut i = 0u64;
    loop {
        let due = schedule.due_ns(i);
        if ctx.spec.stop.load(Ordering::Relaxed) || due >= deadline_ns {
            break;
        }
        let now = monotonic_raw_ns();
        if due > now {
            monoio::time::sleep(Duration::from_nanos(due - now)).await;
            continue;
        }
        i += 1;
        if ctx.in_flight.get() >= max_in_flight {
            let mut recorder = ctx.recorder.borrow_mut();
            recorder.on_start();
            recorder.on_failure(Failure::Overload, || {
                format!("{max_in_flight} requests in flight: a due request was not sent")
            });
            ctx.live.failed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let guard = InFlight::new(ctx);
        let (ctx, pool) = (Rc::clone(ctx), Rc::clone(&pool));
        monoio::spawn(async move {
            let mut conn = pool.borrow_mut().pop();
            run_request(&ctx, &mut conn, due).await;
            drop(guard);
            if let Some(conn) = conn {
                pool.borrow_mut().push(conn);
            }
        });
    }
    while ctx.in_flight.get() > 0 {
        monoio::time::sleep(Duration::from_millis(DRAIN_POLL_MS)).await;
    }
}

/// Runs one request started (or due) at `start_ns` on `conn` (opening a
/// connection when there is none or it cannot be reused), records it, and
/// leaves a reusable connection in `conn`. Returns the failure, if any.
async fn run_request(
    ctx: &Ctx,
    conn: &mut Option<ClientConn<TcpStream>>,
    start_ns: u64,
) -> Option<Failure> {
    ctx.recorder.borrow_mut().on_start();
    let now = monotonic_raw_ns();
    let budget = Duration::from_nanos(ctx.hard_deadline_ns.saturating_sub(now).max(1));
    let outcome = monoio::time::timeout(budget, exchange(ctx, conn, start_ns)).await;
    let failure = match outcome {
        Ok(failure) => failure,
        Err(_) => {
            *conn = None;
            ctx.recorder.borrow_mut().on_failure(Failure::Timeout, || {
                "request cut off at the deadline".into()
            });
            Some(Failure::Timeout)
        }
    };
    let counter = if failure.is_none() {
        &ctx.live.completed
    } else {
        &ctx.live.failed
    };
    counter.fetch_add(1, Ordering::Relaxed);
    failure
}

async fn connect(ctx: &Ctx) -> Result<ClientConn<TcpStream>, Failure> {
    match iop_engine::http::connect(ctx.spec.target.addr).await {
        Ok(stream) => {
            Ok(ClientConn::new(stream, Limits::default())
                .with_host(ctx.spec.target.authority.clone()))
        }
        Err(e) => {
            let addr = ctx.spec.target.addr;
            ctx.recorder
                .borrow_mut()
                .on_failure(Failure::Connect, || format!("connect {addr}: {e}"));
            Err(Failure::Connect)
        }
    }
}

fn fail(ctx: &Ctx, failure: Failure, message: impl FnOnce() -> String) -> Option<Failure> {
    ctx.recorder.borrow_mut().on_failure(failure, message);
    Some(failure)
}

/// Sends the request and reads the response, recording as it goes.
async fn exchange(
    ctx: &Ctx,
    slot: &mut Option<ClientConn<TcpStream>>,
    start_ns: u64,
) -> Option<Failure> {
    let (mut client, mut reused) = match slot.take() {
        Some(c) if c.is_reusable() => (c, true),
        _ => match connect(ctx).await {
            Ok(c) => (c, false),
            Err(f) => return Some(f),
        },
    };
    let auth = ctx
        .spec
        .api_key
        .as_ref()
        .map(|key| ("authorization", key.authorization()));
    let request_id = ctx.spec.request_id_prefix.as_ref().map(|prefix| {
        let n = ctx.next_request.get();
        ctx.next_request.set(n + 1);
        format!("{prefix}-{n}")
    });
    let head = loop {
        let headers = [
            ("content-type", "application/json"),
            ("accept", "text/event-stream"),
        ]
        .into_iter()
        .chain(auth)
        .chain(request_id.as_deref().map(|id| ("x-request-id", id)));
        let sent = client
            .send_request("POST", &ctx.spec.target.path, headers, ctx.body.clone())
            .await;
        let result = match sent {
            Ok(()) => client.read_response_head().await,
            Err(e) => Err(e),
        };
        match result {
            Ok(head) => break head,
            // A kept-alive connection the server had closed: retry once on
            // a fresh one.
            Err(_) if reused => {
                reused = false;
                client = match connect(ctx).await {
                    Ok(c) => c,
                    Err(f) => return Some(f),
                };
            }
            Err(e) => return fail(ctx, Failure::Io, || format!("request: {e}")),
        }
    };
    if head.status != 200 {
        let status = head.status;
        let body = client
            .read_body_to_end(MAX_BODY_BYTES)
            .await
            .unwrap_or_default();
        if client.is_reusable() {
            *slot = Some(client);
        }
        return fail(ctx, Failure::HttpStatus(status), || {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            format!("HTTP {status}: {text}")
        });
    }
    let result = if ctx.spec.stream {
        read_stream(ctx, &mut client, start_ns).await
    } else {
        read_json(ctx, &mut client, start_ns).await
    };
    match result {
        Ok(end) => {
            let failure = ctx.recorder.borrow_mut().on_stream_end(&end);
            if client.is_reusable() {
                *slot = Some(client);
            }
            failure
        }
        Err(e) => fail(ctx, Failure::Io, || format!("response body: {e}")),
    }
}

fn observe(ctx: &Ctx, observation: Observation) {
    if let Observation::Content {
        ttft_ns: Some(ttft),
        ..
    } = observation
    {
        ctx.live.record_ttft(ttft);
    }
    ctx.recorder.borrow_mut().on_observation(observation);
}

/// Reads an SSE body to its end, timing every payload on arrival.
async fn read_stream(
    ctx: &Ctx,
    client: &mut ClientConn<TcpStream>,
    start_ns: u64,
) -> Result<StreamEnd, HttpError> {
    let mut tracker = StreamTracker::new(start_ns);
    let mut splitter = SseSplitter::new(MAX_EVENT_BYTES);
    while let Some(piece) = client.read_body_chunk().await? {
        let arrival_ns = monotonic_raw_ns();
        ctx.recorder.borrow_mut().on_body_bytes(piece.len());
        splitter.feed(&piece);
        while let Some(event) = splitter.next_event()? {
            if let Some(data) = event.data {
                observe(ctx, tracker.on_data(&data, arrival_ns));
            }
        }
    }
    splitter.finish();
    let end_ns = monotonic_raw_ns();
    while let Some(event) = splitter.next_event()? {
        if let Some(data) = event.data {
            observe(ctx, tracker.on_data(&data, end_ns));
        }
    }
    Ok(tracker.finish(end_ns))
}

/// Reads a non-streamed JSON completion: its arrival is both the first and
/// only "chunk" (TTFT = end to end).
async fn read_json(
    ctx: &Ctx,
    client: &mut ClientConn<TcpStream>,
    start_ns: u64,
) -> Result<StreamEnd, HttpError> {
    let body = client.read_body_to_end(MAX_BODY_BYTES).await?;
    let end_ns = monotonic_raw_ns();
    ctx.recorder.borrow_mut().on_body_bytes(body.len());
    let text = String::from_utf8_lossy(&body);
    let chunk = classify(&text);
    let error = match chunk.kind {
        super::chunk::ChunkKind::Error { message } => Some(message),
        super::chunk::ChunkKind::Unparsable => Some("response is not JSON".to_string()),
        _ => None,
    };
    let latency_ns = chunk.sent_ns.map(|sent| end_ns.saturating_sub(sent));
    if error.is_none() {
        observe(
            ctx,
            Observation::Content {
                ttft_ns: Some(end_ns.saturating_sub(start_ns)),
                latency_ns,
                gap_ns: None,
            },
        );
    }
    Ok(StreamEnd {
        end_to_end_ns: end_ns.saturating_sub(start_ns),
        ttft_ns: Some(end_ns.saturating_sub(start_ns)),
        content_chunks: 1,
        unstamped_chunks: u64::from(latency_ns.is_none()),
        max_gap_ns: 0,
        done: true,
        error,
        unparsable: 0,
    })
}

/// `GET path` on a fresh connection to `target`; the status and the body
/// (at most 16 MiB).
pub(crate) async fn get(
    target: &super::Target,
    path: &str,
    key: Option<&ApiKey>,
) -> Result<(u16, Bytes), HttpError> {
    let stream = iop_engine::http::connect(target.addr).await?;
    let mut client = ClientConn::new(stream, Limits::default()).with_host(target.authority.clone());
    let headers = [("connection", "close")]
        .into_iter()
        .chain(key.map(|key| ("authorization", key.authorization())));
    client
        .send_request("GET", path, headers, Bytes::new())
        .await?;
    let head = client.read_response_head().await?;
    let body = client.read_body_to_end(MAX_BODY_BYTES).await?;
    Ok((head.status, body))
}
