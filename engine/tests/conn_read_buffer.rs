//! A connection's read buffer keeps nothing of a large frame once the frame
//! is handled, however the frame's bytes were split across reads.
//!
//! The reader reads straight into the decoder's buffer, which makes room
//! for exactly the rest of a frame once its length is known, so a frame's
//! `bytes` fields are slices of one allocation that is freed with them.
//! Were that buffer grown again while the last few bytes of the frame were
//! still to come (less than the reader's minimum free room), it would
//! double, and the spare tail left after the frame would keep the whole
//! doubled allocation, the frame's bytes included, alive after the frame
//! was dropped.
//!
//! A counting global allocator measures the bytes live in the process
//! before the frame and after it is dropped. The peer writes the frame in
//! two parts and sends the second only once the reader has taken all of the
//! first, so the split is the same on every run.

use std::time::Duration;

use bytes::BytesMut;
use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SocketShutdown};
use iop_engine::memory::CountingAlloc;
use iop_wire::codec;
use iop_wire::pb::{self, frame::Body};
use iop_wire::CloseReason;
use monoio::io::{AsyncWriteRentExt, Splitable};
use monoio::net::{TcpListener, TcpStream};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// The frame's payload: far above everything else the exchange allocates.
const PAYLOAD_BYTES: usize = 2 * 1024 * 1024;

/// Guard against a hang: a test that has not finished by then fails.
const TEST_GUARD: Duration = Duration::from_secs(60);

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local address");
    let client = TcpStream::connect(addr).await.expect("connect");
    let (server, _) = listener.accept().await.expect("accept");
    (client, server)
}

fn start(stream: TcpStream) -> (ConnHandle, ConnEvents) {
    let shutdown = SocketShutdown::for_socket(&stream);
    let (read_half, write_half) = stream.into_split();
    spawn_conn(read_half, write_half, shutdown, ConnConfig::default())
}

fn run_event(delta: String) -> Vec<u8> {
    let frame = codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
        run_id: "run-1".to_owned(),
        seq: 1,
        delta,
        ..Default::default()
    })));
    let mut wire = BytesMut::new();
    codec::encode(&frame, &mut wire).expect("encode");
    wire.to_vec()
}

async fn next_delta_len(events: &mut ConnEvents) -> usize {
    match events.recv().await {
        Some(ConnEvent::Frame(pb::Frame {
            body: Some(Body::RunEvent(event)),
        })) => event.delta.len(),
        other => panic!("expected a run event, got {other:?}"),
    }
}

/// Sends a [`PAYLOAD_BYTES`] frame whose last `tail` bytes arrive in a read
/// of their own, and returns the bytes still live once it was handled and
/// dropped, over what was live before it.
async fn live_after_a_large_frame(tail: usize) -> i64 {
    let (mut peer, local) = tcp_pair().await;
    let (conn, mut events) = start(local);
    // One small frame first, so the reader's own first buffer is counted
    // in the baseline.
    let (written, _) = peer.write_all(run_event("warm-up".into())).await;
    written.expect("write the warm-up frame");
    assert_eq!(next_delta_len(&mut events).await, 7);
    let received = conn.stats().bytes_received;

    let before = CountingAlloc::live_bytes();
    let mut wire = run_event("x".repeat(PAYLOAD_BYTES));
    let len = wire.len();
    let last = wire.split_off(len - tail);
    let (written, _) = peer.write_all(wire).await;
    written.expect("write the frame but its tail");
    let head_bytes = u64::try_from(len - tail).expect("length");
    while conn.stats().bytes_received < received + head_bytes {
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    let (written, _) = peer.write_all(last).await;
    written.expect("write the frame's tail");
    assert_eq!(next_delta_len(&mut events).await, PAYLOAD_BYTES);
    let live = CountingAlloc::live_bytes() - before;
    conn.close(CloseReason::Shutdown);
    drop(events);
    live
}

#[monoio::test_all(timer_enabled = true)]
async fn a_large_frame_leaves_nothing_in_the_read_buffer() {
    let test = async {
        // Whole, and with a tail of a byte, of a few hundred bytes and of
        // just under the reader's minimum free room (4 KiB).
        for tail in [0, 1, 300, 4000] {
            let live = live_after_a_large_frame(tail).await;
            assert!(
                live < i64::try_from(PAYLOAD_BYTES / 4).expect("bound"),
                "{live} bytes more live after a {PAYLOAD_BYTES}-byte frame whose last {tail} \
                 bytes came in a read of their own was handled and dropped"
            );
        }
    };
    if monoio::time::timeout(TEST_GUARD, test).await.is_err() {
        panic!("test did not finish within {TEST_GUARD:?}");
    }
}
