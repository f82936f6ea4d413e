//! `iop_engine::conn` over real loopback TCP, on both monoio drivers.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use iop_engine::conn::{
    spawn_conn, spawn_conn_handled, ConnClosed, ConnConfig, ConnEvent, ConnEvents, ConnHandle,
    ConnRef, SendError, SocketShutdown,
};
use iop_wire::codec;
use iop_wire::pb::{self, frame::Body};
use iop_wire::FrameDecoder;
use iop_wire::{CloseReason, Inbound};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt, Splitable};
use monoio::net::{TcpListener, TcpStream};

/// Guard against a hang: a test that has not finished by then fails.
const TEST_GUARD: Duration = Duration::from_secs(20);

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let client = TcpStream::connect(addr).await.unwrap();
    let (server, _) = listener.accept().await.unwrap();
    client.set_nodelay(true).unwrap();
    server.set_nodelay(true).unwrap();
    (client, server)
}

fn start(stream: TcpStream, config: ConnConfig) -> (ConnHandle, ConnEvents) {
    let shutdown = SocketShutdown::for_socket(&stream);
    let (read_half, write_half) = stream.into_split();
    spawn_conn(read_half, write_half, shutdown, config)
}

/// A peer without the conn machinery: reads frames off a raw socket.
struct RawPeer {
    stream: TcpStream,
    decoder: FrameDecoder,
}

impl RawPeer {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            decoder: FrameDecoder::new(),
        }
    }

    /// The next frame, or `None` at EOF.
    async fn read_frame(&mut self) -> Option<pb::Frame> {
        loop {
            if let Some(frame) = self.decoder.decode().unwrap() {
                return Some(frame);
            }
            let buf = Vec::with_capacity(64 * 1024);
            let (result, buf) = self.stream.read(buf).await;
            match result.unwrap() {
                0 => {
                    assert_eq!(self.decoder.buffered_bytes(), 0, "EOF inside a frame");
                    return None;
                }
                _ => self.decoder.feed(&buf),
            }
        }
    }

    async fn write(&mut self, bytes: Vec<u8>) {
        let (result, _) = self.stream.write_all(bytes).await;
        result.unwrap();
    }
}

fn run_event(seq: u64) -> pb::Frame {
    codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
        run_id: "run-1".to_owned(),
        seq,
        delta: format!("token {seq}"),
        ..Default::default()
    })))
}

fn cancel(n: u64) -> pb::Frame {
    codec::frame(Body::CancelRequest(pb::CancelRequest {
        run_id: format!("run-{n}"),
        reason: "client_disconnect".to_owned(),
    }))
}

fn close_frame(reason: &str, detail: &str) -> pb::Frame {
    codec::frame(Body::Close(pb::Close {
        reason: reason.to_owned(),
        detail: detail.to_owned(),
    }))
}

/// Asserts `event` is exactly the tunnel frame `expected`, without dumping
/// large bodies on failure.
fn assert_tunnel_frame(event: Option<ConnEvent>, expected: pb::ProviderTunnelFrame) {
    let got = match event {
        Some(ConnEvent::Frame(pb::Frame {
            body: Some(Body::ProviderTunnelFrame(got)),
        })) => *got,
        other => panic!(
            "expected a tunnel frame, got {:?}",
            other.map(|_| "another event")
        ),
    };
    let first_difference = got
        .body
        .iter()
        .zip(expected.body.iter())
        .position(|(a, b)| a != b);
    assert_eq!(
        (got.body.len(), first_difference),
        (expected.body.len(), None),
        "body length and first differing byte"
    );
    assert_eq!(got, expected);
}

fn closed(reason: CloseReason) -> Option<ConnEvent> {
    Some(ConnEvent::Closed { reason })
}

/// Every event until the connection closes (the last one is `Closed`).
async fn drain(events: &mut ConnEvents) -> Vec<ConnEvent> {
    let mut all = Vec::new();
    while let Some(event) = events.recv().await {
        all.push(event);
    }
    all
}

async fn guarded<F: std::future::Future<Output = ()>>(test: F) {
    if monoio::time::timeout(TEST_GUARD, test).await.is_err() {
        panic!("test did not finish within {TEST_GUARD:?}");
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_frames_round_trip_in_order_both_directions() {
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (a, mut a_events) = start(client, ConnConfig::default());
        let (b, mut b_events) = start(server, ConnConfig::default());

        for seq in 1..=300 {
            a.send_bulk(run_event(seq)).await.unwrap();
            b.send_bulk(run_event(1000 + seq)).await.unwrap();
            if seq % 30 == 0 {
                a.send_control(cancel(seq)).unwrap();
                b.send_control(cancel(1000 + seq)).unwrap();
            }
        }

        for (events, base) in [(&mut b_events, 0), (&mut a_events, 1000)] {
            let mut bulk = Vec::new();
            let mut control = Vec::new();
            while bulk.len() < 300 || control.len() < 10 {
                match events.recv().await {
                    Some(ConnEvent::Frame(frame)) => match &frame.body {
                        Some(Body::RunEvent(_)) => bulk.push(frame),
                        Some(Body::CancelRequest(_)) => control.push(frame),
                        other => panic!("unexpected frame {other:?}"),
                    },
                    other => panic!("unexpected event {other:?}"),
                }
            }
            // Each lane keeps its order exactly.
            let expected_bulk: Vec<_> = (1..=300).map(|seq| run_event(base + seq)).collect();
            let expected_control: Vec<_> = (1..=10).map(|n| cancel(base + 30 * n)).collect();
            assert_eq!(bulk, expected_bulk);
            assert_eq!(control, expected_control);
        }

        a.close(CloseReason::Shutdown);
        assert_eq!(
            drain(&mut a_events).await,
            vec![closed(CloseReason::Shutdown).unwrap()]
        );
        assert_eq!(
            drain(&mut b_events).await,
            vec![closed(CloseReason::Peer("shutdown".into())).unwrap()]
        );
        assert_eq!(a.stats().frames_received, 310);
        assert_eq!(b.stats().frames_received, 311); // 310 and the Close
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_body_frame_arrives_byte_exact() {
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (node, _node_events) = start(client, ConnConfig::default());
        let (_edge, mut edge_events) = start(server, ConnConfig::default());

        let large: Bytes = (0..1_000_000u32)
            .map(|i| (i * 31 % 251) as u8)
            .collect::<Vec<u8>>()
            .into();
        let small =
            Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n");
        let head = |seq| pb::ProviderTunnelFrame {
            run_id: "tunnel-7".to_owned(),
            seq,
            kind: pb::TunnelFrameKind::Body as i32,
            ..Default::default()
        };
        node.send_body_frame(head(1), large.clone()).await.unwrap();
        node.send_body_frame(head(2), small.clone()).await.unwrap();
        node.send_body_frame(head(3), Bytes::new()).await.unwrap();

        for (seq, body) in [(1, large), (2, small), (3, Bytes::new())] {
            let expected = pb::ProviderTunnelFrame { body, ..head(seq) };
            assert_tunnel_frame(edge_events.recv().await, expected);
        }
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_with_chunks_hands_over_plain_body_frames_as_chunks() {
    // CONTRACT: T1, U2 — a receiver that asks for chunks gets each plain
    // BODY frame as a chunk with its run id, seq and body bytes exactly as
    // sent; a tunnel frame with any other field set, and every other
    // frame, still come as frames.
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (node, _node_events) = start(client, ConnConfig::default());
        let mut config = ConnConfig::default();
        config.chunks = true;
        let (_edge, mut edge_events) = start(server, config);

        let large: Bytes = (0..200_000u32)
            .map(|i| (i * 31 % 251) as u8)
            .collect::<Vec<u8>>()
            .into();
        let small =
            Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n");
        let sent = [
            ("tunnel-7", 1, large),
            ("tunnel-8", 1, small.clone()),
            ("tunnel-7", 2, small.clone()),
        ];
        for (run_id, seq, body) in &sent {
            let encoded = node.encode_chunk(run_id, *seq, body.clone());
            node.push_bulk(encoded).await.unwrap();
        }
        let usage = pb::ProviderTunnelFrame {
            run_id: "tunnel-7".to_owned(),
            seq: 3,
            kind: pb::TunnelFrameKind::Usage as i32,
            usage: Some(Box::new(pb::Usage {
                prompt_tokens: 1,
                completion_tokens: 2,
                total_tokens: 3,
            })),
            ..Default::default()
        };
        node.send_bulk(codec::frame(Body::ProviderTunnelFrame(Box::new(
            usage.clone(),
        ))))
        .await
        .unwrap();
        node.send_bulk(run_event(4)).await.unwrap();

        for (run_id, seq, body) in sent {
            match edge_events.recv().await {
                Some(ConnEvent::Chunk(chunk)) => {
                    assert_eq!((chunk.run_id(), chunk.seq()), (run_id, seq));
                    assert!(chunk.body == body, "the body arrives byte for byte");
                }
                other => panic!("expected a chunk, got {other:?}"),
            }
        }
        assert_tunnel_frame(edge_events.recv().await, usage);
        assert_eq!(
            edge_events.recv().await,
            Some(ConnEvent::Frame(run_event(4)))
        );
    })
    .await;
}

/// Starts `stream` with its frames handed to `handler`.
fn start_handled(
    stream: TcpStream,
    config: ConnConfig,
    handler: impl FnMut(ConnRef<'_>, Inbound) + 'static,
) -> (ConnHandle, ConnClosed) {
    let shutdown = SocketShutdown::for_socket(&stream);
    let (read_half, write_half) = stream.into_split();
    spawn_conn_handled(read_half, write_half, shutdown, config, handler)
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_handled_hands_every_frame_to_the_handler_in_order_then_closes() {
    // CONTRACT: T1 — a connection read by a handler gets every frame and
    // chunk there, in the order sent and byte for byte; the close comes
    // after the handler had the last frame.
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (node, _node_events) = start(client, ConnConfig::default());
        let mut config = ConnConfig::default();
        config.chunks = true;
        let handled = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let (_edge, edge_closed) = start_handled(server, config, {
            let handled = handled.clone();
            move |conn: ConnRef<'_>, inbound| {
                assert!(!conn.is_closed());
                handled.borrow_mut().push(inbound);
            }
        });

        let body =
            Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n");
        node.send_bulk(run_event(1)).await.unwrap();
        for seq in 1..=3 {
            let encoded = node.encode_chunk("tunnel-7", seq, body.clone());
            node.push_bulk(encoded).await.unwrap();
        }
        node.send_bulk(run_event(2)).await.unwrap();
        node.close(CloseReason::Shutdown);

        assert_eq!(
            edge_closed.wait().await,
            CloseReason::Peer("shutdown".into())
        );
        let handled = handled.borrow();
        assert_eq!(handled.len(), 5, "{handled:?}");
        assert_eq!(handled[0], Inbound::Frame(run_event(1)));
        for (seq, event) in (1..=3).zip(&handled[1..4]) {
            match event {
                Inbound::Chunk(chunk) => {
                    assert_eq!((chunk.run_id(), chunk.seq()), ("tunnel-7", seq));
                    assert!(chunk.body == body, "the body arrives byte for byte");
                }
                other => panic!("expected a chunk, got {other:?}"),
            }
        }
        assert_eq!(handled[4], Inbound::Frame(run_event(2)));
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_handled_closes_from_the_handler_and_is_not_kept_open_by_it() {
    // CONTRACT: T1 — the handler closes the connection with its reason; and
    // the reader's view of the connection does not count as a handle, so
    // dropping the application's last one still closes it.
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (node, mut node_events) = start(client, ConnConfig::default());
        let (_edge, edge_closed) = start_handled(
            server,
            ConnConfig::default(),
            |conn: ConnRef<'_>, inbound| {
                if inbound == Inbound::Frame(run_event(1)) {
                    conn.close(CloseReason::ProtocolError);
                    assert!(conn.is_closed());
                }
            },
        );
        node.send_bulk(run_event(1)).await.unwrap();
        assert_eq!(edge_closed.wait().await, CloseReason::ProtocolError);
        assert_eq!(
            drain(&mut node_events).await,
            vec![closed(CloseReason::Peer("protocol_error".into())).unwrap()]
        );

        let (client, server) = tcp_pair().await;
        let mut peer = RawPeer::new(client);
        let (edge, edge_closed) = start_handled(server, ConnConfig::default(), |_, _| {});
        drop(edge);
        assert_eq!(
            peer.read_frame().await,
            Some(close_frame("handle_dropped", ""))
        );
        assert_eq!(edge_closed.wait().await, CloseReason::HandleDropped);
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_oversized_length_prefix_sends_close_frame_too_large() {
    // CONTRACT: T1
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (_conn, mut events) = start(server, ConnConfig::default());
        let mut peer = RawPeer::new(client);
        peer.write(vec![0xFF, 0xFF, 0xFF, 0xFF]).await;

        assert_eq!(
            peer.read_frame().await,
            Some(close_frame(
                "frame_too_large",
                "frame of 4294967295 bytes exceeds the maximum of 16777216 bytes"
            ))
        );
        assert_eq!(peer.read_frame().await, None);
        assert_eq!(events.recv().await, closed(CloseReason::FrameTooLarge));
        assert_eq!(events.recv().await, None);
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_garbage_frame_sends_close_decode_error() {
    // CONTRACT: T1
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (conn, mut events) = start(server, ConnConfig::default());
        let mut peer = RawPeer::new(client);
        // A valid frame first, delivered; then 3 bytes that are no protobuf.
        let mut wire = BytesMut::new();
        codec::encode(&run_event(1), &mut wire).unwrap();
        wire.extend_from_slice(&[0, 0, 0, 3, 0xFF, 0xFF, 0xFF]);
        peer.write(wire.to_vec()).await;

        match peer.read_frame().await.and_then(|frame| frame.body) {
            Some(Body::Close(close)) => assert_eq!(close.reason, "decode_error"),
            other => panic!("expected Close, got {other:?}"),
        }
        assert_eq!(peer.read_frame().await, None);
        assert_eq!(
            drain(&mut events).await,
            vec![
                ConnEvent::Frame(run_event(1)),
                closed(CloseReason::DecodeError).unwrap()
            ]
        );
        assert_eq!(conn.send_control(cancel(1)), Err(SendError::Closed));
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_heartbeat_timeout_when_peer_never_answers() {
    // CONTRACT: T4
    guarded(async {
        let (client, server) = tcp_pair().await;
        let config = ConnConfig::default()
            .with_heartbeat_timers(Duration::from_millis(50), Duration::from_millis(150));
        let (conn, mut events) = start(server, config);
        let mut peer = RawPeer::new(client);

        // The peer reads everything and answers nothing: heartbeats 1, 2, ...
        // (how many depends on scheduling), then Close, then EOF.
        let mut next_seq = 1;
        loop {
            match peer.read_frame().await.and_then(|frame| frame.body) {
                Some(Body::Heartbeat(heartbeat)) => {
                    assert_eq!(heartbeat.seq, next_seq);
                    next_seq += 1;
                }
                Some(Body::Close(close)) => {
                    assert_eq!(
                        close,
                        pb::Close {
                            reason: "heartbeat_timeout".to_owned(),
                            detail: "no heartbeat answer within 150 ms".to_owned(),
                        }
                    );
                    break;
                }
                other => panic!("unexpected frame {other:?}"),
            }
        }
        assert!(next_seq > 1, "a heartbeat precedes the timeout");
        assert_eq!(peer.read_frame().await, None);
        assert_eq!(
            drain(&mut events).await,
            vec![closed(CloseReason::HeartbeatTimeout).unwrap()]
        );
        assert_eq!(conn.close_reason(), Some(CloseReason::HeartbeatTimeout));
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_healthy_peer_stays_open_across_heartbeat_intervals() {
    // CONTRACT: T4
    guarded(async {
        let (client, server) = tcp_pair().await;
        // Short interval, generous timeout: several heartbeats are answered
        // long before any could time out, even on a loaded machine.
        let config = ConnConfig::default()
            .with_heartbeat_timers(Duration::from_millis(20), Duration::from_secs(5));
        let (a, mut a_events) = start(client, config.clone());
        let (b, mut b_events) = start(server, config);

        while a.stats().heartbeat_acks_received < 5 || b.stats().heartbeat_acks_received < 5 {
            monoio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!a.is_closed());
        assert!(!b.is_closed());

        b.close(CloseReason::Shutdown);
        // Heartbeats and acks were consumed by the connection, never delivered.
        assert_eq!(
            drain(&mut a_events).await,
            vec![closed(CloseReason::Peer("shutdown".into())).unwrap()]
        );
        assert_eq!(
            drain(&mut b_events).await,
            vec![closed(CloseReason::Shutdown).unwrap()]
        );
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_local_close_sends_close_then_eof_and_one_closed_event() {
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (conn, mut events) = start(server, ConnConfig::default());
        let mut peer = RawPeer::new(client);

        conn.send_bulk(run_event(1)).await.unwrap();
        conn.close(CloseReason::Shutdown);
        conn.close(CloseReason::ProtocolError); // ignored: already closing
        assert!(conn.is_closed());
        assert_eq!(conn.send_bulk(run_event(2)).await, Err(SendError::Closed));

        // Queued frames go out first, then Close, then EOF.
        assert_eq!(peer.read_frame().await, Some(run_event(1)));
        assert_eq!(peer.read_frame().await, Some(close_frame("shutdown", "")));
        assert_eq!(peer.read_frame().await, None);
        assert_eq!(events.recv().await, closed(CloseReason::Shutdown));
        assert_eq!(events.recv().await, None);
        assert_eq!(events.recv().await, None);
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_peer_eof_and_peer_close_are_reported() {
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (_conn, mut events) = start(server, ConnConfig::default());
        drop(client);
        assert_eq!(
            drain(&mut events).await,
            vec![closed(CloseReason::PeerClosed).unwrap()]
        );

        let (client, server) = tcp_pair().await;
        let (_conn, mut events) = start(server, ConnConfig::default());
        let mut peer = RawPeer::new(client);
        let mut wire = BytesMut::new();
        codec::encode(
            &close_frame("superseded", "a newer connection registered"),
            &mut wire,
        )
        .unwrap();
        peer.write(wire.to_vec()).await;
        assert_eq!(
            drain(&mut events).await,
            vec![closed(CloseReason::Peer("superseded".into())).unwrap()]
        );
        // We answer a peer's Close with EOF, not with a Close of our own.
        assert_eq!(peer.read_frame().await, None);
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_peer_heartbeat_is_answered_with_ack() {
    // CONTRACT: T4
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (_conn, mut events) = start(server, ConnConfig::default());
        let mut peer = RawPeer::new(client);
        let mut wire = BytesMut::new();
        codec::encode(
            &codec::frame(Body::Heartbeat(pb::Heartbeat { seq: 77 })),
            &mut wire,
        )
        .unwrap();
        codec::encode(&run_event(1), &mut wire).unwrap();
        peer.write(wire.to_vec()).await;

        assert_eq!(
            peer.read_frame().await,
            Some(codec::frame(Body::HeartbeatAck(pb::HeartbeatAck {
                seq: 77
            })))
        );
        // The heartbeat is consumed; the next application frame is delivered.
        assert_eq!(events.recv().await, Some(ConnEvent::Frame(run_event(1))));
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_dropping_the_last_handle_closes() {
    guarded(async {
        let (client, server) = tcp_pair().await;
        let (conn, mut events) = start(server, ConnConfig::default());
        let mut peer = RawPeer::new(client);
        let clone = conn.clone();
        drop(conn);
        assert!(!clone.is_closed());
        drop(clone);
        assert_eq!(
            peer.read_frame().await,
            Some(close_frame("handle_dropped", ""))
        );
        assert_eq!(peer.read_frame().await, None);
        assert_eq!(
            drain(&mut events).await,
            vec![closed(CloseReason::HandleDropped).unwrap()]
        );
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_bulk_sender_waits_on_a_full_lane_and_resumes_when_the_peer_reads() {
    guarded(async {
        let (client, server) = tcp_pair().await;
        let mut config = ConnConfig::default();
        config.bulk_lane_max_frames = 2;
        let (a, _a_events) = start(client, config);
        let mut peer = RawPeer::new(server);
        // Far more than the socket buffers hold while the peer reads nothing.
        const FRAMES: u64 = 200;
        let big = |seq: u64| {
            codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
                run_id: "run-1".to_owned(),
                seq,
                delta: format!("{seq:08}").repeat(8 * 1024),
                ..Default::default()
            })))
        };
        let queued = std::rc::Rc::new(std::cell::Cell::new(0u64));
        let sender = monoio::spawn({
            let (a, queued) = (a.clone(), queued.clone());
            async move {
                for seq in 1..=FRAMES {
                    a.send_bulk(big(seq)).await.unwrap();
                    queued.set(seq);
                }
            }
        });
        // The writer blocks on the full socket, the lane fills, and the
        // sender waits on it: it stops short of the end, and stays there.
        let mut stalled_at = 0;
        for _ in 0..50 {
            monoio::time::sleep(Duration::from_millis(20)).await;
            if queued.get() == stalled_at && stalled_at > 0 {
                break;
            }
            stalled_at = queued.get();
        }
        assert!(
            stalled_at > 0 && stalled_at < FRAMES,
            "the sender should wait on the full lane, queued {stalled_at} of {FRAMES}"
        );
        // The peer reads: room is made, the waiting sender resumes, and
        // every frame arrives once, in order, byte for byte.
        for seq in 1..=FRAMES {
            assert_eq!(peer.read_frame().await, Some(big(seq)));
        }
        sender.await;
        assert_eq!(queued.get(), FRAMES);
        assert_eq!(a.stats().frames_sent, FRAMES);
    })
    .await;
}
