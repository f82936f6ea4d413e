//! Per-run flow control on the Node, in process over real sockets: a real
//! Node session against a scripted Edge that grants windows and credits as
//! a client would drain, and the `bench` mock provider.
//!
//! Proves that a run out of credit sends nothing beyond its window and stops
//! reading its provider (the provider's writes stop: back-pressure), that the
//! other runs of the connection keep flowing, that the time spent waiting for
//! credit is no stall, that the bytes that finally arrive are exactly the
//! provider's, and that cancelling runs or ending the session while their
//! provider calls are parked on full queues leaves the Node serving with
//! nothing held (the abort this replaces: local-sync's channel panicking in a
//! destructor).
//!
//! Waits are bounded by [`SAFETY`] only as a safety net against hangs; no
//! assertion depends on how fast anything runs.

mod common;

use std::time::Duration;

use common::{
    chat_tunnel, eventually, node_config, normalized_events, ollama_adapter, openai_adapter,
    openai_profile, Edge, Mock, TARGET,
};
use iop_engine::conn::ConnEvent;
use iop_wire::flow::{self, DrainWindow, RecvWindow};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use node_bin::session::SessionEnd;

fn payload(mock: &Mock, capacity: u32) -> pb::NodeConfigPayload {
    node_config(
        vec![
            openai_adapter("mock", capacity, openai_profile(mock)),
            ollama_adapter("ol", capacity, vec![TARGET.into()], mock),
        ],
        false,
    )
}

/// A streamed chat completion tunnel granted `window` charged bytes.
fn tunnel(run_id: &str, window: u64, stall_ms: i64) -> pb::ProviderTunnelRequest {
    let body = format!(
        r#"{{"model":"{TARGET}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    pb::ProviderTunnelRequest {
        stream: true,
        flow_window_bytes: window,
        response_stall_timeout_ms: stall_ms,
        ..chat_tunnel(run_id, body)
    }
}

/// A streamed normalized run on the Ollama adapter granted `window`.
fn run(run_id: &str, window: u64) -> pb::RunRequest {
    pb::RunRequest {
        run_id: run_id.into(),
        adapter: "ol".into(),
        target: TARGET.into(),
        input: Some(pb::RunInput {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        flow_window_bytes: window,
        ..Default::default()
    }
}

/// The Edge's view of one run: its window checks and what it received.
struct Stream {
    recv: RecvWindow,
    drain: DrainWindow,
    body: Vec<u8>,
    text: String,
    frames: u64,
    terminal: Option<String>,
}

impl Stream {
    fn new(window: u64) -> Self {
        Self {
            recv: RecvWindow::new(window),
            drain: DrainWindow::new(window),
            body: Vec::new(),
            text: String::new(),
            frames: 0,
            terminal: None,
        }
    }

    /// Takes a frame as the Edge's reader does: an overrun fails the test.
    fn received(&mut self, charge: u64) {
        self.frames += 1;
        self.recv
            .on_received(charge)
            .unwrap_or_else(|e| panic!("the Node overran its window: {e}"));
    }

    /// The client drained a frame of `charge`: the credit to send, if any.
    fn drained(&mut self, charge: u64) -> Option<u64> {
        let credit = self.drain.on_consumed(charge)?;
        self.recv.on_credit_sent(credit);
        Some(credit)
    }
}

fn credit(edge: &Edge, run_id: &str, max_offset: u64) {
    edge.send(Body::FlowCredit(pb::FlowCredit {
        credits: vec![pb::RunCredit {
            run_id: run_id.into(),
            max_offset,
        }],
    }));
}

/// Receives one frame for `streams` (tunnel frames or run events), checks
/// it against its run's window, and when `drain` names the run, drains it
/// at once and sends the credit. Returns the run id.
async fn pump(edge: &mut Edge, streams: &mut [(&str, Stream)], drain: &[&str]) -> String {
    let f = edge.recv().await;
    let (run_id, charge, terminal) = match f.body {
        Some(Body::ProviderTunnelFrame(tf)) => {
            let charge = flow::charge_of_tunnel_frame(&tf);
            let terminal = matches!(
                tf.kind(),
                pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error
            )
            .then(|| format!("{:?}:{}", tf.kind(), tf.failure_code));
            let stream = find(streams, &tf.run_id);
            stream.received(charge);
            stream.body.extend_from_slice(&tf.body);
            (tf.run_id, charge, terminal)
        }
        Some(Body::RunEvent(ev)) => {
            let charge = flow::charge_of_run_event(&ev);
            let terminal = matches!(
                ev.r#type(),
                pb::RunEventType::Complete | pb::RunEventType::Error | pb::RunEventType::Cancelled
            )
            .then(|| format!("{:?}:{}", ev.r#type(), ev.failure_code));
            let stream = find(streams, &ev.run_id);
            stream.received(charge);
            stream.text.push_str(&ev.delta);
            (ev.run_id, charge, terminal)
        }
        other => panic!("unexpected frame {other:?}"),
    };
    let stream = find(streams, &run_id);
    if terminal.is_some() {
        stream.terminal = terminal;
    }
    if drain.contains(&run_id.as_str()) {
        if let Some(max_offset) = stream.drained(charge) {
            credit(edge, &run_id, max_offset);
        }
    }
    run_id
}

fn find<'a>(streams: &'a mut [(&str, Stream)], run_id: &str) -> &'a mut Stream {
    &mut streams
        .iter_mut()
        .find(|(id, _)| *id == run_id)
        .unwrap_or_else(|| panic!("a frame of unknown run {run_id}"))
        .1
}

/// Waits until the mock's written stream bytes stop growing (two reads
/// 200 ms apart agree) and returns them.
async fn settled_writes(mock: &Mock) -> u64 {
    let mut last = mock.counters().stream_bytes_written;
    for _ in 0..100 {
        monoio::time::sleep(Duration::from_millis(200)).await;
        let now = mock.counters().stream_bytes_written;
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the provider kept writing: no back-pressure");
}

// A tunnel out of credit sends no more than its window, and the provider
// stops being read: its writes stop well short of the 32 MiB answer. Then
// credit as the client drains brings every byte, exactly the provider's.
#[monoio::test_all(timer_enabled = true)]
async fn a_tunnel_out_of_credit_stops_reading_its_provider() {
    const WINDOW: u64 = 64 * 1024;
    const TOKENS: u32 = 4096;
    const TOKEN_BYTES: u32 = 4096;
    // 16 MiB of tokens: far more than the socket buffers between the mock
    // and the Node hold.
    const ANSWER_BYTES: u64 = TOKENS as u64 * TOKEN_BYTES as u64;
    let mock = Mock::start(Mock::handler(TOKENS, 0).with_token_bytes(TOKEN_BYTES));
    let mut edge = Edge::start(payload(&mock, 4)).await;

    edge.send(Body::ProviderTunnelRequest(Box::new(tunnel(
        "big", WINDOW, 0,
    ))));
    let mut streams = [("big", Stream::new(WINDOW))];
    // The Node fills its window (it splits what does not fit) and stops.
    while streams[0].1.recv.received() + flow::FRAME_CHARGE_BYTES < WINDOW {
        pump(&mut edge, &mut streams, &[]).await;
    }
    let written = settled_writes(&mock).await;
    assert!(
        written < ANSWER_BYTES / 2,
        "the provider wrote {written} bytes of a {ANSWER_BYTES}-byte answer: no back-pressure"
    );
    assert!(streams[0].1.terminal.is_none());
    // CONTRACT: T4 — a heartbeat-style control frame still goes both ways
    // while the run is blocked: a command is answered at once.
    edge.send(Body::NodeCommandRequest(pb::NodeCommandRequest {
        command_id: "status".into(),
        r#type: pb::CommandType::TransportStatus as i32,
        ..Default::default()
    }));
    match edge.recv().await.body {
        Some(Body::NodeCommandResponse(r)) => {
            assert_eq!(r.command_id, "status");
            assert_eq!(r.transport_status.expect("status").active_tunnels, 1);
        }
        other => panic!("expected the command answer, got {other:?}"),
    }
    // Now the client drains: everything it already has, then the rest.
    let consumed = streams[0].1.recv.received();
    let max_offset = streams[0]
        .1
        .drained(consumed)
        .expect("half a window drained");
    credit(&edge, "big", max_offset);
    while streams[0].1.terminal.is_none() {
        pump(&mut edge, &mut streams, &["big"]).await;
    }
    assert_eq!(streams[0].1.terminal.as_deref(), Some("End:"));
    // Every token, in order, then the finish and [DONE]; and exactly the
    // bytes the mock wrote, no more, no fewer.
    let events = normalized_events(&streams[0].1.body);
    assert_eq!(
        events.len(),
        TOKENS as usize + 3,
        "role, tokens, finish, [DONE]"
    );
    for (i, event) in events[1..=TOKENS as usize].iter().enumerate() {
        let content = event["choices"][0]["delta"]["content"].as_str();
        let expected = bench::mock::openai::padded_token_text(i as u32, TOKEN_BYTES);
        assert_eq!(content, Some(expected.as_str()), "token {i}");
    }
    assert_eq!(events.last(), Some(&serde_json::Value::from("[DONE]")));
    assert_eq!(
        mock.counters().stream_bytes_written,
        streams[0].1.body.len() as u64,
        "the bytes the provider wrote are the bytes that arrived"
    );
}

// One run out of credit costs that run alone: a second tunnel and a
// normalized run on the same connection complete while it stays blocked;
// cancelled, the blocked one ends with its one terminal and gives its
// capacity back.
#[monoio::test_all(timer_enabled = true)]
async fn one_blocked_run_leaves_the_others_flowing() {
    const WINDOW: u64 = 16 * 1024;
    let mock = Mock::start(Mock::handler(2048, 0).with_token_bytes(1024));
    let mut edge = Edge::start(payload(&mock, 8)).await;
    edge.send(Body::ProviderTunnelRequest(Box::new(tunnel(
        "stuck", WINDOW, 0,
    ))));
    let mut streams = [
        ("stuck", Stream::new(WINDOW)),
        ("fast", Stream::new(WINDOW)),
        ("norm", Stream::new(flow::MIN_WINDOW_BYTES)),
    ];
    while streams[0].1.recv.received() + flow::FRAME_CHARGE_BYTES < WINDOW {
        pump(&mut edge, &mut streams, &[]).await;
    }
    edge.send(Body::ProviderTunnelRequest(Box::new(tunnel(
        "fast", WINDOW, 0,
    ))));
    edge.send(Body::RunRequest(Box::new(run(
        "norm",
        flow::MIN_WINDOW_BYTES,
    ))));
    while streams[1].1.terminal.is_none() || streams[2].1.terminal.is_none() {
        pump(&mut edge, &mut streams, &["fast", "norm"]).await;
    }
    assert_eq!(streams[1].1.terminal.as_deref(), Some("End:"));
    assert_eq!(streams[2].1.terminal.as_deref(), Some("Complete:"));
    assert_eq!(
        streams[2].1.text,
        bench::mock::openai::completion_text(2048),
        "every delta, in order, through a 256-byte window"
    );
    assert!(streams[0].1.terminal.is_none(), "still blocked");

    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "stuck".into(),
        reason: "test".into(),
    }));
    while streams[0].1.terminal.is_none() {
        pump(&mut edge, &mut streams, &[]).await;
    }
    assert_eq!(streams[0].1.terminal.as_deref(), Some("Error:cancelled"));
    let core = edge.core.clone();
    eventually("every run released", || core.active_runs() == 0).await;
}

// Flow control is not a stall (W3): a tunnel blocked on credit five times
// longer than its stall timeout does not stall, and finishes with END once
// the client drains.
#[monoio::test_all(timer_enabled = true)]
async fn waiting_for_credit_is_not_a_stall() {
    const WINDOW: u64 = 8 * 1024;
    let mock = Mock::start(Mock::handler(256, 0).with_token_bytes(1024));
    let mut edge = Edge::start(payload(&mock, 4)).await;
    edge.send(Body::ProviderTunnelRequest(Box::new(tunnel(
        "slow", WINDOW, 300,
    ))));
    let mut streams = [("slow", Stream::new(WINDOW))];
    while streams[0].1.recv.received() + flow::FRAME_CHARGE_BYTES < WINDOW {
        pump(&mut edge, &mut streams, &[]).await;
    }
    // Nothing arrives while blocked: no stall terminal within 5 stall
    // timeouts (a stall would have sent its ERROR after 300 ms).
    monoio::select! {
        ev = edge.events.recv() => panic!("a frame while blocked: {ev:?}"),
        _ = monoio::time::sleep(Duration::from_millis(1500)) => {}
    }
    let consumed = streams[0].1.recv.received();
    let max_offset = streams[0].1.drained(consumed).expect("credit");
    credit(&edge, "slow", max_offset);
    while streams[0].1.terminal.is_none() {
        pump(&mut edge, &mut streams, &["slow"]).await;
    }
    assert_eq!(streams[0].1.terminal.as_deref(), Some("End:"));
}

/// A mock whose streams (48 tokens of 4 KiB) outgrow a minimum window and
/// the Node's output queue (8 pieces of at most 16 KiB), so a call that
/// gets no credit parks on its full queue. (In process, a mock writing much
/// more without pauses keeps the thread to itself under the epoll driver,
/// where writes with room complete without yielding.)
fn parking_mock() -> bench::mock::MockProvider {
    Mock::handler(48, 0).with_token_bytes(4096)
}

// Cancels of runs whose provider calls are parked on full output queues,
// 100 at a time, ten times: every run gets its one terminal, every permit
// and run entry comes back, and the Node keeps serving. (local-sync's
// channel aborted the process here.)
#[monoio::test_all(timer_enabled = true)]
async fn cancelling_parked_runs_in_a_loop_leaves_the_node_serving() {
    const RUNS: usize = 100;
    let mock = Mock::start(parking_mock());
    let mut edge = Edge::start(payload(&mock, RUNS as u32)).await;
    for round in 0..10 {
        let ids: Vec<String> = (0..RUNS).map(|i| format!("p{round}-{i}")).collect();
        for id in &ids {
            edge.send(Body::ProviderTunnelRequest(Box::new(tunnel(
                id,
                flow::MIN_WINDOW_BYTES,
                0,
            ))));
        }
        let mut streams: Vec<(&str, Stream)> = ids
            .iter()
            .map(|id| (id.as_str(), Stream::new(flow::MIN_WINDOW_BYTES)))
            .collect();
        // Each fills its tiny window; the provider calls park behind it.
        let full =
            |s: &Stream| s.recv.received() + flow::FRAME_CHARGE_BYTES >= flow::MIN_WINDOW_BYTES;
        while !streams.iter().all(|(_, s)| full(s)) {
            pump(&mut edge, &mut streams, &[]).await;
        }
        for id in &ids {
            edge.send(Body::CancelRequest(pb::CancelRequest {
                run_id: id.clone(),
                reason: "test".into(),
            }));
        }
        while streams.iter().any(|(_, s)| s.terminal.is_none()) {
            pump(&mut edge, &mut streams, &[]).await;
        }
        assert!(
            streams
                .iter()
                .all(|(_, s)| s.terminal.as_deref() == Some("Error:cancelled")),
            "round {round}: one cancelled terminal each"
        );
        let core = edge.core.clone();
        eventually("every run released", || core.active_runs() == 0).await;
    }
    // Still serving.
    let frames = edge.tunnel(tunnel("after", 0, 0)).await;
    assert_eq!(
        frames.last().map(|f| f.kind()),
        Some(pb::TunnelFrameKind::End)
    );
}

// The session ends (the Edge's connection goes) with 50 runs parked on full
// queues: the session ends cleanly, every run is released, and a new
// session on the same core serves (F5).
#[monoio::test_all(timer_enabled = true)]
async fn a_session_ending_with_parked_runs_releases_them_all() {
    const RUNS: usize = 50;
    let mock = Mock::start(parking_mock());
    let mut edge = Edge::start(payload(&mock, RUNS as u32)).await;
    let ids: Vec<String> = (0..RUNS).map(|i| format!("s-{i}")).collect();
    for id in &ids {
        edge.send(Body::ProviderTunnelRequest(Box::new(tunnel(
            id,
            flow::MIN_WINDOW_BYTES,
            0,
        ))));
    }
    let mut streams: Vec<(&str, Stream)> = ids
        .iter()
        .map(|id| (id.as_str(), Stream::new(flow::MIN_WINDOW_BYTES)))
        .collect();
    let full = |s: &Stream| s.recv.received() + flow::FRAME_CHARGE_BYTES >= flow::MIN_WINDOW_BYTES;
    while !streams.iter().all(|(_, s)| full(s)) {
        pump(&mut edge, &mut streams, &[]).await;
    }
    let core = edge.core.clone();
    assert_eq!(core.active_runs(), RUNS);
    edge.conn.close(CloseReason::Superseded);
    while let Some(ConnEvent::Frame(_)) = edge.events.recv().await {}
    let end = edge.node.await;
    assert_eq!(
        end,
        SessionEnd::Ended(CloseReason::Peer("superseded".into()))
    );
    eventually("every run released", || core.active_runs() == 0).await;
    // The same core serves the next session.
    let mut next = Edge::start_on(core.clone(), payload(&mock, RUNS as u32)).await;
    let frames = next.tunnel(tunnel("next", 0, 0)).await;
    assert_eq!(
        frames.last().map(|f| f.kind()),
        Some(pb::TunnelFrameKind::End)
    );
}
