//! The monoio shell of the cache-routing client: one window's requests on a
//! runtime of its own, each a raw HTTP/1.1 exchange with the Edge
//! (`iop_engine::http`), its SSE body split as it arrives and each payload
//! read by [`super::workload::read_payload`]. TTFT is the time from writing
//! the request to the arrival of the first content chunk.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use monoio::net::TcpStream;

use iop_engine::clock::monotonic_raw_ns;
use iop_engine::http::{ClientConn, Limits, SseSplitter};

use super::workload::{read_payload, Conversation, IndependentRequest, Payload};
use crate::load::Target;

/// Largest SSE event accepted.
const MAX_EVENT_BYTES: usize = 1024 * 1024;
/// Largest error body read.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;
/// Characters of an error body quoted in a record.
const ERROR_QUOTE_CHARS: usize = 300;
/// Every request is cut off after this long (a lost stream must not hang
/// the run).
pub(crate) const REQUEST_TIMEOUT_MS: u64 = 60_000;

/// One request as it went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestRecord {
    /// The conversation (multi-turn) or the request's index (otherwise).
    pub(crate) index: u32,
    /// The turn (0 for independent requests).
    pub(crate) turn: u32,
    /// Request written → first content chunk, µs (on success).
    pub(crate) ttft_us: Option<u64>,
    /// Why it failed.
    pub(crate) error: Option<String>,
}

/// What one window sent and got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    /// Every request sent, ordered by index then turn.
    pub(crate) records: Vec<RequestRecord>,
    /// From the first request written to the last one ended, µs.
    pub(crate) wall_us: u64,
}

/// A successful reply.
struct Reply {
    ttft_us: u64,
    content: String,
}

fn ns_to_us(ns: u64) -> u64 {
    ns / 1_000
}

async fn connect(target: &Target) -> Result<ClientConn<TcpStream>, String> {
    let stream = iop_engine::http::connect(target.addr)
        .await
        .map_err(|e| format!("connect {}: {e}", target.addr))?;
    Ok(ClientConn::new(stream, Limits::default()).with_host(target.authority.clone()))
}

/// Sends `body` on the connection in `slot` (a new one when there is none
/// or it cannot be reused; a reused one that fails before the response is
/// retried once on a new one) and reads the streamed reply. A reusable
/// connection is left in `slot`.
async fn exchange(
    target: &Target,
    slot: &mut Option<ClientConn<TcpStream>>,
    body: Bytes,
) -> Result<Reply, String> {
    let (mut client, mut reused) = match slot.take() {
        Some(c) if c.is_reusable() => (c, true),
        _ => (connect(target).await?, false),
    };
    let headers = [
        ("content-type", "application/json"),
        ("accept", "text/event-stream"),
    ];
    let (head, start_ns) = loop {
        let start_ns = monotonic_raw_ns();
        let sent = client
            .send_request("POST", &target.path, headers, body.clone())
            .await;
        let head = match sent {
            Ok(()) => client.read_response_head().await,
            Err(e) => Err(e),
        };
        match head {
            Ok(head) => break (head, start_ns),
            Err(_) if reused => {
                reused = false;
                client = connect(target).await?;
            }
            Err(e) => return Err(format!("request: {e}")),
        }
    };
    if head.status != 200 {
        let text: String = client
            .read_body_to_end(MAX_ERROR_BODY_BYTES)
            .await
            .map(|b| {
                String::from_utf8_lossy(&b)
                    .chars()
                    .take(ERROR_QUOTE_CHARS)
                    .collect()
            })
            .unwrap_or_default();
        if client.is_reusable() {
            *slot = Some(client);
        }
        return Err(format!("HTTP {}: {text}", head.status));
    }
    let mut splitter = SseSplitter::new(MAX_EVENT_BYTES);
    let mut ttft_ns = None;
    let mut content = String::new();
    let mut done = false;
    let mut read = |data: &str, arrival_ns: u64| -> Result<(), String> {
        match read_payload(data) {
            Payload::Content(text) => {
                ttft_ns.get_or_insert(arrival_ns.saturating_sub(start_ns));
                content.push_str(&text);
            }
            Payload::NoContent => {}
            Payload::Done => done = true,
            Payload::Error(message) => return Err(format!("error event: {message}")),
            Payload::Unparsable => {
                let quoted: String = data.chars().take(ERROR_QUOTE_CHARS).collect();
                return Err(format!("unparsable payload: {quoted}"));
            }
        }
        Ok(())
    };
    loop {
        let piece = client
            .read_body_chunk()
            .await
            .map_err(|e| format!("response body: {e}"))?;
        let arrival_ns = monotonic_raw_ns();
        let last = piece.is_none();
        match piece {
            Some(piece) => splitter.feed(&piece),
            None => splitter.finish(),
        }
        while let Some(event) = splitter
            .next_event()
            .map_err(|e| format!("response body: {e}"))?
        {
            if let Some(data) = event.data {
                read(&data, arrival_ns)?;
            }
        }
        if last {
            break;
        }
    }
    if client.is_reusable() {
        *slot = Some(client);
    }
    match (ttft_ns, done) {
        (Some(ttft_ns), true) => Ok(Reply {
            ttft_us: ns_to_us(ttft_ns),
            content,
        }),
        (None, _) => Err("the stream carried no content".into()),
        (Some(_), false) => Err("the stream ended without [DONE]".into()),
    }
}

/// [`exchange`] under [`REQUEST_TIMEOUT_MS`]; a request cut off loses its
/// connection.
async fn timed_exchange(
    target: &Target,
    slot: &mut Option<ClientConn<TcpStream>>,
    body: Bytes,
) -> Result<Reply, String> {
    let limit = Duration::from_millis(REQUEST_TIMEOUT_MS);
    match monoio::time::timeout(limit, exchange(target, slot, body)).await {
        Ok(result) => result,
        Err(_) => {
            *slot = None;
            Err(format!("no complete reply within {REQUEST_TIMEOUT_MS} ms"))
        }
    }
}

/// Records and the end of the last request, shared by a window's tasks.
struct Shared {
    records: RefCell<Vec<RequestRecord>>,
    last_end_ns: Cell<u64>,
}

impl Shared {
    fn new(start_ns: u64) -> Rc<Self> {
        Rc::new(Shared {
            records: RefCell::new(Vec::new()),
            last_end_ns: Cell::new(start_ns),
        })
    }

    fn record(&self, index: u32, turn: u32, outcome: &Result<Reply, String>) {
        let now = monotonic_raw_ns();
        if now > self.last_end_ns.get() {
            self.last_end_ns.set(now);
        }
        self.records.borrow_mut().push(RequestRecord {
            index,
            turn,
            ttft_us: outcome.as_ref().ok().map(|r| r.ttft_us),
            error: outcome.as_ref().err().cloned(),
        });
    }

    fn batch(&self, start_ns: u64) -> Batch {
        let mut records = self.records.borrow().clone();
        records.sort_by_key(|r| (r.index, r.turn));
        Batch {
            records,
            wall_us: ns_to_us(self.last_end_ns.get().saturating_sub(start_ns)),
        }
    }
}

/// Runs every conversation at once (conversation `i` starts `i ×
/// stagger_ms` in), each turn its think time after the previous reply, each
/// on a keep-alive connection of its own. A failed turn ends its conversation;
/// `stop` ends every conversation before its next turn.
pub(crate) fn run_conversations(
    target: &Target,
    conversations: Vec<Conversation>,
    stagger_ms: u64,
    stop: &Arc<AtomicBool>,
) -> std::io::Result<Batch> {
    iop_engine::rt::block_on(async {
        let start_ns = monotonic_raw_ns();
        let shared = Shared::new(start_ns);
        let tasks: Vec<_> = conversations
            .into_iter()
            .enumerate()
            .map(|(i, mut conv)| {
                let (shared, target, stop) = (Rc::clone(&shared), target.clone(), Arc::clone(stop));
                let delay = Duration::from_millis(stagger_ms * i as u64);
                monoio::spawn(async move {
                    monoio::time::sleep(delay).await;
                    let mut conn = None;
                    let mut turn = 0;
                    loop {
                        let think = conv.think_before_next();
                        if think > 0 {
                            monoio::time::sleep(Duration::from_millis(think)).await;
                        }
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let Some(body) = conv.next_turn() else { break };
                        let outcome = timed_exchange(&target, &mut conn, body).await;
                        shared.record(conv.index, turn, &outcome);
                        match outcome {
                            Ok(reply) => conv.add_reply(reply.content),
                            Err(_) => break,
                        }
                        turn += 1;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await;
        }
        shared.batch(start_ns)
    })
}

/// Runs `requests` over `concurrency` workers, each taking the next
/// request when its last one ended, on a keep-alive connection of its own;
/// `stop` ends every worker before its next request.
pub(crate) fn run_independent(
    target: &Target,
    requests: Vec<IndependentRequest>,
    concurrency: u32,
    stop: &Arc<AtomicBool>,
) -> std::io::Result<Batch> {
    iop_engine::rt::block_on(async {
        let start_ns = monotonic_raw_ns();
        let shared = Shared::new(start_ns);
        let queue: Rc<RefCell<VecDeque<(u32, IndependentRequest)>>> =
            Rc::new(RefCell::new((0..).zip(requests).collect()));
        let workers: Vec<_> = (0..concurrency.max(1))
            .map(|_| {
                let (shared, target, stop) = (Rc::clone(&shared), target.clone(), Arc::clone(stop));
                let queue = Rc::clone(&queue);
                monoio::spawn(async move {
                    let mut conn = None;
                    while !stop.load(Ordering::Relaxed) {
                        let Some((index, request)) = queue.borrow_mut().pop_front() else {
                            break;
                        };
                        let outcome = timed_exchange(&target, &mut conn, request.body).await;
                        shared.record(index, 0, &outcome);
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.await;
        }
        shared.batch(start_ns)
    })
}
