//! Stream isolation on the node link, in process over real mTLS and real
//! client sockets: one Edge, a hand-driven node that answers tunnels as
//! its windows allow, clients that read and clients that never do.
//!
//! Proves that a client that never reads costs its own run alone (the other
//! clients of the same node connection finish byte for byte, and the node's
//! run stops at what its credit allows), that heartbeats are read and
//! answered while every route of the node is full (T4, receive side), that
//! a node sending beyond its credit is closed with `flow_control_overrun`,
//! and that a run of a node without flow control that outgrows its window
//! is cut off alone (its run cancelled, the connection and the other runs
//! untouched), and that a client taking no bytes for the write-stall
//! timeout is reset, its run cancelled with `client_write_stall` and its
//! lease returned.
//!
//! Waits are bounded by [`TEST_TIMEOUT`] only as a safety net; no assertion
//! depends on how fast anything runs.

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use iop_engine::conn::{ConnConfig, ConnEvent};
use iop_wire::flow::{self, SendWindow};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use monoio::io::AsyncWriteRentExt;
use monoio::net::TcpStream;

/// The window the Edge grants each run in these tests.
const WINDOW: u64 = 16 * 1024;
/// A "big" answer: far more than the window plus the client socket's
/// buffers.
const BIG_BYTES: usize = 16 * 1024 * 1024;
/// The body piece the node sends at most per frame.
const PIECE_BYTES: usize = 16 * 1024;

fn edge_options() -> EdgeOptions {
    EdgeOptions {
        edge_keys: format!("flow_window_bytes = {WINDOW}\n"),
        ..EdgeOptions::without_provider()
    }
}

/// What the scripted node saw and did, per run.
#[derive(Debug, Default)]
struct NodeLog {
    /// Body bytes sent, by run id.
    sent: HashMap<String, usize>,
    /// Runs whose answer was sent whole.
    finished: Vec<String>,
    /// Cancels received (run id, reason).
    cancels: Vec<(String, String)>,
    /// Credit frames received.
    credit_frames: usize,
    /// The windows tunnels were granted.
    granted: Vec<u64>,
}

/// An answer in progress: what is left to send and its window.
struct Answer {
    left: Bytes,
    window: SendWindow,
    seq: u64,
}

/// How the scripted node treats its windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Windows {
    /// Sends as its windows allow, more as credit arrives.
    Obey,
    /// Sends one piece beyond its first window at once, then nothing more.
    OverrunOnce,
}

/// Runs a node on `raw` that answers every tunnel: a request whose body
/// mentions `big` gets [`BIG_BYTES`] of SSE, any other a small answer.
fn serve_node(
    mut raw: RawNode,
    windows: Windows,
) -> (Rc<RefCell<NodeLog>>, monoio::task::JoinHandle<CloseReason>) {
    let log = Rc::new(RefCell::new(NodeLog::default()));
    let task_log = log.clone();
    let big_answer = big_answer();
    let task = monoio::spawn(async move {
        let mut answers: HashMap<String, Answer> = HashMap::new();
        loop {
            let body = match raw.events.recv().await {
                Some(ConnEvent::Frame(pb::Frame { body: Some(body) })) => body,
                Some(ConnEvent::Closed { reason }) => return reason,
                Some(ConnEvent::Frame(_) | ConnEvent::Chunk(_)) => continue,
                None => return CloseReason::ConnectionEnded,
            };
            match body {
                Body::ProviderTunnelRequest(req) => {
                    task_log.borrow_mut().granted.push(req.flow_window_bytes);
                    let big = std::str::from_utf8(&req.body).is_ok_and(|b| b.contains("big"));
                    let left = if big {
                        big_answer.clone()
                    } else {
                        Bytes::from_static(b"data: {\"small\":true}\n\ndata: [DONE]\n\n")
                    };
                    let start = pb::ProviderTunnelFrame {
                        run_id: req.run_id.clone(),
                        seq: 1,
                        kind: pb::TunnelFrameKind::ResponseStart as i32,
                        status: 200,
                        headers: vec![pb::Header {
                            name: "content-type".into(),
                            value: Bytes::from_static(b"text/event-stream"),
                        }],
                        adapter: ADAPTER.into(),
                        target: TARGET.into(),
                        ..Default::default()
                    };
                    let _ = raw
                        .conn
                        .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(start))))
                        .await;
                    let window = match windows {
                        Windows::Obey => SendWindow::new(req.flow_window_bytes),
                        Windows::OverrunOnce => SendWindow::new(
                            req.flow_window_bytes
                                + flow::tunnel_frame_charge(pb::TunnelFrameKind::Body, PIECE_BYTES),
                        ),
                    };
                    answers.insert(
                        req.run_id.clone(),
                        Answer {
                            left,
                            window,
                            seq: 2,
                        },
                    );
                    send_what_fits(&raw, &task_log, &req.run_id, &mut answers).await;
                }
                Body::FlowCredit(_) if windows == Windows::OverrunOnce => {}
                Body::FlowCredit(credit) => {
                    task_log.borrow_mut().credit_frames += 1;
                    for c in credit.credits {
                        if let Some(answer) = answers.get_mut(&c.run_id) {
                            answer.window.on_credit(c.max_offset);
                        }
                        send_what_fits(&raw, &task_log, &c.run_id, &mut answers).await;
                    }
                }
                Body::CancelRequest(cancel) => {
                    task_log
                        .borrow_mut()
                        .cancels
                        .push((cancel.run_id.clone(), cancel.reason.clone()));
                    if let Some(answer) = answers.remove(&cancel.run_id) {
                        let error = pb::ProviderTunnelFrame {
                            run_id: cancel.run_id,
                            seq: answer.seq,
                            kind: pb::TunnelFrameKind::Error as i32,
                            failure_code: "cancelled".into(),
                            error: "cancelled".into(),
                            adapter: ADAPTER.into(),
                            target: TARGET.into(),
                            ..Default::default()
                        };
                        let _ = raw
                            .conn
                            .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(error))))
                            .await;
                    }
                }
                _ => {}
            }
        }
    });
    (log, task)
}

/// Sends run `run_id`'s body pieces while its window allows (splitting a
/// piece to what fits), then `END` once all is sent.
async fn send_what_fits(
    raw: &RawNode,
    log: &Rc<RefCell<NodeLog>>,
    run_id: &str,
    answers: &mut HashMap<String, Answer>,
) {
    let Some(answer) = answers.get_mut(run_id) else {
        return;
    };
    while !answer.left.is_empty() {
        let allowance = usize::try_from(answer.window.payload_allowance()).unwrap_or(usize::MAX);
        let take = answer.left.len().min(PIECE_BYTES).min(allowance);
        if take == 0 {
            return;
        }
        let piece = answer.left.split_to(take);
        answer
            .window
            .consume(flow::tunnel_frame_charge(pb::TunnelFrameKind::Body, take));
        let body = pb::ProviderTunnelFrame {
            run_id: run_id.to_string(),
            seq: answer.seq,
            kind: pb::TunnelFrameKind::Body as i32,
            adapter: ADAPTER.into(),
            target: TARGET.into(),
            ..Default::default()
        };
        answer.seq += 1;
        *log.borrow_mut().sent.entry(run_id.to_string()).or_default() += take;
        if raw.conn.send_body_frame(body, piece).await.is_err() {
            return;
        }
    }
    let end = pb::ProviderTunnelFrame {
        run_id: run_id.to_string(),
        seq: answer.seq,
        kind: pb::TunnelFrameKind::End as i32,
        adapter: ADAPTER.into(),
        target: TARGET.into(),
        ..Default::default()
    };
    answers.remove(run_id);
    log.borrow_mut().finished.push(run_id.to_string());
    let _ = raw
        .conn
        .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(end))))
        .await;
}

/// [`BIG_BYTES`] of SSE events, built once (by whole-slice copies: the
/// scripted node shares the thread with the Edge, and a slow build would
/// hold up the heartbeats this file tests).
fn big_answer() -> Bytes {
    let event: &[u8] =
        b"data: {\"token\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}\n\n";
    let mut bytes = event.repeat(BIG_BYTES / event.len() + 1);
    bytes.truncate(BIG_BYTES);
    Bytes::from(bytes)
}

/// A client that sends a streamed chat request asking for a big answer and
/// never reads: a socket with a 4 KiB receive buffer.
async fn never_reader(addr: SocketAddr) -> TcpStream {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    socket.connect(&addr.into()).expect("connect");
    socket.set_nonblocking(true).expect("non-blocking");
    let mut tcp = TcpStream::from_std(socket.into()).expect("monoio stream");
    let body = format!(
        r#"{{"model":"{MODEL}","stream":true,"messages":[{{"role":"user","content":"big"}}]}}"#
    );
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let (res, _) = tcp.write_all(request.into_bytes()).await;
    res.expect("write the request");
    tcp
}

const SMALL_REQUEST: &str =
    r#"{"model":"chat-model","stream":true,"messages":[{"role":"user","content":"small"}]}"#;

async fn ready_node(edge: &TestEdge, pki: &Pki, flow_control: u32, config: ConnConfig) -> RawNode {
    let mut raw = RawNode::connect_with(edge.node_addr, &pki.connector("node-a"), config).await;
    assert!(
        raw.register_with_flow_control("node-a", flow_control)
            .await
            .accepted
    );
    assert!(raw.ready("node-a").await.ready);
    raw
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..(TEST_TIMEOUT.as_millis() / 10) {
        if done() {
            return;
        }
        monoio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never reached: {what}");
}

// One client that never reads costs its own run alone: with it stuck, ten
// normal clients on the same node connection get their whole answers, one
// after another, and the stuck run's node side stops at what its credit
// allows (the socket buffers it filled, never the 16 MiB answer).
#[monoio::test_all(timer_enabled = true)]
async fn a_client_that_never_reads_costs_its_own_run_alone() {
    let pki = Pki::mint("isolation-never-reader");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &edge_options()));
        let raw = ready_node(&edge, &pki, flow::FLOW_CONTROL_V1, ConnConfig::default()).await;
        let (log, _node) = serve_node(raw, Windows::Obey);
        let _stuck = never_reader(edge.client_addr).await;
        wait_until("the stuck run started", || log.borrow().sent.len() == 1).await;
        // Let the stuck run fill everything it can.
        let mut last = 0;
        loop {
            monoio::time::sleep(Duration::from_millis(200)).await;
            let sent = log.borrow().sent.values().copied().max().unwrap_or(0);
            if sent == last {
                break;
            }
            last = sent;
        }
        assert!(last < BIG_BYTES / 2, "the stuck run sent {last} bytes");
        for i in 0..10 {
            let response = post_chat(edge.client_addr, SMALL_REQUEST).await;
            assert_eq!(response.status, 200, "client {i}");
            assert_eq!(
                response.body, b"data: {\"small\":true}\n\ndata: [DONE]\n\n",
                "client {i}: the node's bytes, exactly"
            );
        }
        {
            let log = log.borrow();
            assert_eq!(log.finished.len(), 10, "the ten, not the stuck one");
            assert!(
                log.granted.iter().all(|&w| w == WINDOW),
                "{:?}",
                log.granted
            );
        }
        edge.stop().await;
    })
    .await;
}

// CONTRACT: T4 — with every route of a node full (two clients that never
// read hold both of its leases, each run's window used up), heartbeats are
// still read and answered: the node's heartbeats, one every 50 ms, are
// acked ten times over while neither run moves a byte.
#[monoio::test_all(timer_enabled = true)]
async fn heartbeats_are_answered_while_every_reply_is_full() {
    const ACKS: u64 = 10;
    let pki = Pki::mint("isolation-heartbeats");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &edge_options()));
        // The node never closes for a late ack (an hour): the test counts
        // the acks instead, so a slow machine only makes it take longer.
        let config = ConnConfig::default()
            .with_heartbeat_timers(Duration::from_millis(50), Duration::from_secs(3600));
        let raw = ready_node(&edge, &pki, flow::FLOW_CONTROL_V1, config).await;
        let conn = raw.conn.clone();
        let (log, _node) = serve_node(raw, Windows::Obey);
        let _first = never_reader(edge.client_addr).await;
        let _second = never_reader(edge.client_addr).await;
        wait_until("two stuck runs started", || log.borrow().sent.len() == 2).await;
        // Until both runs have used up what the clients' sockets take, a
        // stretch may see body bytes move; the claim is a stretch of ACKS
        // acks with none.
        loop {
            let sent = log.borrow().sent.clone();
            let acked = conn.stats().heartbeat_acks_received;
            wait_until("ten more heartbeats acked", || {
                conn.stats().heartbeat_acks_received >= acked + ACKS
            })
            .await;
            if log.borrow().sent == sent {
                break;
            }
        }
        assert!(!conn.is_closed(), "closed: {:?}", conn.close_reason());
        {
            let log = log.borrow();
            assert!(log.finished.is_empty(), "both still stuck");
            assert!(
                log.sent.values().all(|&sent| sent < BIG_BYTES / 2),
                "{:?}",
                log.sent
            );
        }
        edge.stop().await;
    })
    .await;
}

// A node that speaks flow control and sends beyond its credit is closed
// with `flow_control_overrun`; its client learns the node is gone.
#[monoio::test_all(timer_enabled = true)]
async fn a_node_that_overruns_its_credit_is_closed() {
    let pki = Pki::mint("isolation-overrun");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &edge_options()));
        let raw = ready_node(&edge, &pki, flow::FLOW_CONTROL_V1, ConnConfig::default()).await;
        // Claims flow control, then sends a piece beyond its window.
        let (_log, node) = serve_node(raw, Windows::OverrunOnce);
        let _stuck = never_reader(edge.client_addr).await;
        let reason = node.await;
        assert_eq!(reason, CloseReason::Peer("flow_control_overrun".into()));
        wait_connected(edge.client_addr, "node-a", false).await;
        edge.stop().await;
    })
    .await;
}

// A node without flow control is held to the same window: its run that
// outgrows the window while its client does not read is cut off alone —
// the node gets the cancel, the connection stays up, and the next client
// on the same node is served.
#[monoio::test_all(timer_enabled = true)]
async fn a_run_of_a_node_without_flow_control_is_cut_off_alone() {
    let pki = Pki::mint("isolation-legacy");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &edge_options()));
        let raw = ready_node(&edge, &pki, 0, ConnConfig::default()).await;
        let conn = raw.conn.clone();
        let (log, _node) = serve_node(raw, Windows::Obey);
        let _stuck = never_reader(edge.client_addr).await;
        wait_until("the run was cancelled", || !log.borrow().cancels.is_empty()).await;
        {
            let log = log.borrow();
            assert_eq!(log.cancels.len(), 1);
            assert_eq!(log.cancels[0].1, "client_too_slow", "the cancel says why");
            assert_eq!(
                log.granted,
                vec![0],
                "no window granted to a node without flow control"
            );
            assert_eq!(log.credit_frames, 0, "no credit sent to it");
        }
        assert!(!conn.is_closed());
        let response = post_chat(edge.client_addr, SMALL_REQUEST).await;
        assert_eq!(response.status, 200);
        assert_eq!(response.body, b"data: {\"small\":true}\n\ndata: [DONE]\n\n");
        // The cut-off run's lease came back.
        let entry = node_entry(edge.client_addr, "node-a").await;
        assert_eq!(entry["in_flight"], 0, "{entry}");
        edge.stop().await;
    })
    .await;
}

// A client that takes no bytes of its stream for
// `client_write_stall_timeout_ms` is cut off: its connection is reset (its
// reads end in ECONNRESET, not in an end of stream that could pass for a
// complete answer), its node gets the cancel with reason
// `client_write_stall`, the lease comes back, the cut-off is counted, and
// the node connection serves the next client.
#[monoio::test_all(timer_enabled = true)]
async fn a_client_that_stops_reading_is_reset_at_the_write_stall_timeout() {
    let pki = Pki::mint("isolation-write-stall");
    guarded(async {
        let options = EdgeOptions {
            edge_keys: format!(
                "flow_window_bytes = {WINDOW}\nclient_write_stall_timeout_ms = 300\n"
            ),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let raw = ready_node(&edge, &pki, flow::FLOW_CONTROL_V1, ConnConfig::default()).await;
        let conn = raw.conn.clone();
        let (log, _node) = serve_node(raw, Windows::Obey);
        let mut stuck = never_reader(edge.client_addr).await;
        wait_until("the stuck run was cancelled", || {
            !log.borrow().cancels.is_empty()
        })
        .await;
        {
            let log = log.borrow();
            assert_eq!(log.cancels.len(), 1, "{:?}", log.cancels);
            assert_eq!(
                log.cancels[0].1, "client_write_stall",
                "the cancel says why"
            );
            // CONTRACT: U6 — an Edge write failure (the stall cut-off) sends
            // the CancelRequest for the run that was writing, by its id.
            let runs: Vec<&String> = log.sent.keys().collect();
            assert_eq!(runs, [&log.cancels[0].0], "the stuck run, and only it");
            assert!(log.finished.is_empty(), "the big answer was never finished");
        }
        let (end, read) = read_to_end(&mut stuck).await;
        assert_eq!(
            end,
            Err(std::io::ErrorKind::ConnectionReset),
            "after {read} bytes"
        );
        assert!(read < BIG_BYTES, "{read}");
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_write_stalls_total").await,
            1
        );
        assert!(!conn.is_closed(), "the node connection stays up");
        let response = post_chat(edge.client_addr, SMALL_REQUEST).await;
        assert_eq!(response.status, 200);
        assert_eq!(response.body, b"data: {\"small\":true}\n\ndata: [DONE]\n\n");
        let entry = node_entry(edge.client_addr, "node-a").await;
        assert_eq!(entry["in_flight"], 0, "{entry}");
        edge.stop().await;
    })
    .await;
}
