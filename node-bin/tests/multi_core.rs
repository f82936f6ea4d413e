//! In-process integration of the multi-core Node (`node_bin::workers`):
//! a control shard (this test's thread: the Node session, run manager,
//! watchdog and capacity gates, with the scripted Edge and the providers)
//! and one provider worker core on a thread of its own, as
//! `node-bin --cores 0-1` runs them.
//!
//! Proves that provider calls run on the worker thread against the worker's
//! own keep-alive pool (the session core's pool stays untouched), that a
//! tunnel's body arrives byte-exact at the Edge across the core hop, that
//! normalized runs work across cores, and that a cancel crosses cores: one
//! terminal, the provider socket closed (never pooled), the permit and the
//! run entry released only after the worker's call returned (W10).
//!
//! Waits are bounded by [`SAFETY`] only as a safety net against hangs; no
//! assertion depends on how fast anything runs.

mod common;

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    chat_tunnel, control_with_one_worker, eventually, node_config, ollama_adapter, openai_adapter,
    openai_profile, Edge, Mock, SAFETY, TARGET,
};
use iop_engine::metrics::{self, Count};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};
use node_bin::calls::pool::PoolStats;
use node_bin::calls::pool::ProviderPool;
use node_bin::calls::{OutputTx, ProviderCall};

/// Asserts the call(s) ran on the worker thread, not this one, and the
/// session core has no provider pool of its own.
fn assert_ran_on_the_worker(edge: &Edge, calls: u64) {
    let worker = edge.worker();
    let thread = worker.thread.expect("the worker loop runs");
    assert_ne!(thread, std::thread::current().id());
    assert_eq!(worker.calls, calls);
    assert_eq!(worker.active_calls, 0);
    assert!(edge.core.calls.pool().is_none());
}

/// `len` bytes that repeat only after a long period (a 32-bit LCG).
fn pattern(len: usize) -> Bytes {
    let mut state: u32 = 0x1234_5678;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 24) as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// Length of the complete request at the front of `buf` (head and a
/// `content-length` body), if it is all there.
fn request_len(buf: &[u8]) -> Option<usize> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..head_end]).ok()?;
    let body_len = head
        .lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .map_or(Some(0), |(_, value)| value.trim().parse::<usize>().ok())?;
    (buf.len() >= head_end + body_len).then_some(head_end + body_len)
}

/// A keep-alive provider answering every request with `body`
/// (`application/octet-stream`, content-length), written in pieces of
/// varying sizes.
fn start_raw_provider(body: Bytes) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind provider");
    let addr = listener.local_addr().expect("provider addr");
    monoio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            monoio::spawn(serve_raw(conn, body.clone()));
        }
    });
    addr
}

async fn serve_raw(mut conn: TcpStream, body: Bytes) {
    let mut buf = Vec::new();
    loop {
        let len = loop {
            if let Some(len) = request_len(&buf) {
                break len;
            }
            let (res, chunk) = conn.read(vec![0u8; 4096]).await;
            match res {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        buf.drain(..len);
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        if conn.write_all(head.into_bytes()).await.0.is_err() {
            return;
        }
        let (mut at, mut step) = (0, 1usize);
        while at < body.len() {
            let n = (step * 7919 % 20_000 + 1).min(body.len() - at);
            if conn.write_all(body.slice(at..at + n)).await.0.is_err() {
                return;
            }
            at += n;
            step += 1;
        }
    }
}

fn body_of(frames: &[pb::ProviderTunnelFrame]) -> Vec<u8> {
    frames
        .iter()
        .filter(|f| f.kind() == pb::TunnelFrameKind::Body)
        .flat_map(|f| f.body.iter().copied())
        .collect()
}

fn assert_ordered_with_one_terminal(frames: &[pb::ProviderTunnelFrame]) {
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, (1..=frames.len() as u64).collect::<Vec<_>>());
    let terminals: Vec<usize> = frames
        .iter()
        .enumerate()
        .filter(|(_, f)| {
            matches!(
                f.kind(),
                pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error
            )
        })
        .map(|(i, _)| i)
        .collect();
    assert_eq!(terminals, vec![frames.len() - 1], "one terminal, last");
}

// CONTRACT: U1, U2 — across the core hop a tunnel's body arrives at the
// Edge byte-exact (half a MiB in pieces of every size, through the bounded
// output mailbox), ordered, with one END; the call ran on the worker core
// and its connection went back to the worker's pool, not the session's.
#[monoio::test(timer_enabled = true)]
async fn tunnel_bytes_arrive_byte_exact_from_the_worker_core() {
    let body = pattern(512 * 1024);
    let provider = start_raw_provider(body.clone());
    let profile = pb::ProtocolProfile {
        base_url: format!("http://{provider}"),
        ..Default::default()
    };
    let config = node_config(vec![openai_adapter("mock", 2, profile)], false);
    let mut edge = Edge::start_on(control_with_one_worker(), config).await;
    for run_id in ["raw-1", "raw-2"] {
        let req = pb::ProviderTunnelRequest {
            operation: String::new(),
            path: "/v1/raw".into(),
            ..chat_tunnel(run_id, r#"{"any":"thing"}"#.into())
        };
        let frames = edge.tunnel(req).await;
        assert_ordered_with_one_terminal(&frames);
        assert_eq!(
            (frames[0].kind(), frames[0].status),
            (pb::TunnelFrameKind::ResponseStart, 200)
        );
        assert_eq!(
            frames.last().map(|f| f.kind()),
            Some(pb::TunnelFrameKind::End)
        );
        let relayed = body_of(&frames);
        assert_eq!(relayed.len(), body.len());
        assert!(relayed == body[..], "the body differs from the provider's");
        edge.all_released().await;
    }
    assert_ran_on_the_worker(&edge, 2);
    let worker = edge.worker();
    assert_eq!(
        worker.pool,
        PoolStats {
            hits: 1,
            misses: 1,
            stale_retries: 0,
            checkins: 2,
        },
        "the second tunnel reused the worker's pooled connection"
    );
    assert_eq!(worker.idle_connections, 1);
    assert_eq!(edge.adapter_in_flight("mock").await, 0);
}

fn sse_tunnel(run_id: &str) -> pb::ProviderTunnelRequest {
    let body = format!(
        r#"{{"model":"{TARGET}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    pb::ProviderTunnelRequest {
        stream: true,
        ..chat_tunnel(run_id, body)
    }
}

fn user_input() -> pb::RunInput {
    pb::RunInput {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "say something deterministic".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn run(run_id: &str, adapter: &str) -> Body {
    Body::RunRequest(Box::new(pb::RunRequest {
        run_id: run_id.into(),
        adapter: adapter.into(),
        target: TARGET.into(),
        input: Some(user_input()),
        session_id: "sess-mc".into(),
        ..Default::default()
    }))
}

fn run_shape(events: &[pb::RunEvent]) -> (Vec<(u64, pb::RunEventType)>, String) {
    (
        events.iter().map(|e| (e.seq, e.r#type())).collect(),
        events.iter().map(|e| e.delta.as_str()).collect(),
    )
}

// CONTRACT: E1 — normalized runs (Ollama NDJSON and OpenAI SSE) work across
// cores: the call and its stream parser run on the worker, the session core
// emits start, one delta per token and one complete; the gates are free.
#[monoio::test(timer_enabled = true)]
async fn normalized_runs_work_across_cores() {
    let mock = Mock::start(Mock::handler(3, 0));
    let config = node_config(
        vec![
            ollama_adapter("ol", 1, vec![TARGET.into()], &mock),
            openai_adapter("oa", 1, openai_profile(&mock)),
        ],
        false,
    );
    let mut edge = Edge::start_on(control_with_one_worker(), config).await;
    let expected = (
        vec![
            (1, pb::RunEventType::Start),
            (2, pb::RunEventType::Delta),
            (3, pb::RunEventType::Delta),
            (4, pb::RunEventType::Delta),
            (5, pb::RunEventType::Complete),
        ],
        "tok0 tok1 tok2 ".to_string(),
    );
    for (run_id, adapter) in [("mc-ol", "ol"), ("mc-oa", "oa")] {
        edge.send(run(run_id, adapter));
        let events = edge.run_events(run_id).await;
        assert_eq!(run_shape(&events), expected, "{adapter}");
        assert_eq!(
            events.last().map(|e| e.finish_reason.as_str()),
            Some("stop")
        );
        edge.all_released().await;
        assert_eq!(edge.adapter_in_flight(adapter).await, 0);
    }
    assert_ran_on_the_worker(&edge, 2);
    let counters = mock.counters();
    assert_eq!(
        (counters.ollama_chat_requests, counters.chat_requests),
        (1, 1)
    );
}

// CONTRACT: K1, U6, W10 — a cancel crosses cores: the stream ends with one
// `cancelled` terminal, the worker drops the call (the provider sees its
// stream aborted; the connection is closed, never pooled), and only after
// that return are the permit (gate back to full) and the run entry
// released. The abort is counted in the worker core's metrics registry and
// shows in the merged view (the SIGUSR1 dump's source).
#[monoio::test(timer_enabled = true)]
async fn cancel_crosses_cores_and_releases_after_the_return() {
    // 400 tokens 20 ms apart: the stream outlives the cancel by far.
    let mock = Mock::start(Mock::handler(400, 20));
    let config = node_config(
        vec![openai_adapter("mock", 1, openai_profile(&mock))],
        false,
    );
    let mut edge = Edge::start_on(control_with_one_worker(), config).await;
    edge.send(Body::ProviderTunnelRequest(Box::new(sse_tunnel(
        "mc-cancel",
    ))));
    let mut frames = Vec::new();
    loop {
        let f = edge.recv_tunnel().await;
        let is_body = f.kind() == pb::TunnelFrameKind::Body;
        frames.push(f);
        if is_body {
            break;
        }
    }
    assert_eq!(edge.worker().active_calls, 1, "running on the worker");
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "mc-cancel".into(),
        reason: "client_disconnect".into(),
    }));
    frames.extend(edge.tunnel_frames("mc-cancel").await);
    assert_ordered_with_one_terminal(&frames);
    let last = frames.last().expect("terminal");
    assert_eq!(
        (last.kind(), last.failure_code.as_str()),
        (pb::TunnelFrameKind::Error, "cancelled")
    );
    assert!(last.failure.is_none());
    edge.all_released().await;
    assert_eq!(
        edge.adapter_in_flight("mock").await,
        0,
        "the gate is back to full"
    );
    let worker = edge.worker();
    assert_eq!((worker.calls, worker.aborted), (1, 1));
    assert_eq!(
        (worker.pool.checkins, worker.idle_connections),
        (0, 0),
        "the cancelled call's connection is never pooled"
    );
    assert_ran_on_the_worker(&edge, 1);
    eventually("the provider stream aborted", || {
        let s = mock.counters();
        s.streams_aborted == 1 && s.active_streams == 0 && s.connections_open == 0
    })
    .await;
    // Only this test of this binary aborts a call.
    assert_eq!(
        metrics::merged().counter(Count::NodeProviderCallsAborted),
        1
    );
    // The worker read the provider's response into its pooled buffers,
    // and after the cancel every one of them came home (the body pieces
    // were dropped on this core, the in-flight read was cancelled on the
    // worker): the pool is back to its baseline, nothing stale.
    let mut stats = edge.worker_read_pool().await;
    for _ in 0..(SAFETY.as_millis() / 5) {
        if stats.in_use == 0 {
            break;
        }
        monoio::time::sleep(Duration::from_millis(5)).await;
        stats = edge.worker_read_pool().await;
    }
    assert!(
        stats.allocated > 0,
        "the response was read into pooled buffers: {stats:?}"
    );
    assert_eq!(
        (stats.in_use, stats.available, stats.stale_returns),
        (0, stats.allocated, 0),
        "{stats:?}"
    );
}

/// A "call" that reports the worker core's provider read pool.
struct ReadPoolProbe;

impl ProviderCall for ReadPoolProbe {
    type Output = Option<iop_engine::pool::PoolStats>;

    async fn run(self, _pool: Rc<ProviderPool>, out: OutputTx<Self::Output>) {
        out.send(Some(iop_engine::http::provider_read_pool_stats()))
            .await;
    }

    fn not_started(_message: String) -> Self::Output {
        None
    }
}

impl Edge {
    /// The worker core's provider read pool, read on the worker.
    async fn worker_read_pool(&self) -> iop_engine::pool::PoolStats {
        let workers = self.core.calls.workers().expect("a multi-core node");
        let mut side = workers.dispatch(None, ReadPoolProbe);
        let stats = side.next_output().await.flatten();
        while side.next_output().await.is_some() {}
        stats.expect("the worker answered")
    }
}
