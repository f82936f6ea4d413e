//! A streaming response holds no copy of its request once it commits.
//!
//! Until its first bytes reach the client, a chat completion keeps its
//! parsed request, so that another provider can be sent it if this attempt
//! fails (pre-commit failover). From the commit on no retry is possible,
//! and the request is released while the response streams on.
//!
//! A counting global allocator measures the bytes live in the process
//! (the Edge runs in this test's runtime) before and after the commit of a
//! stream whose request carries a 2 MiB prompt.

mod common;

use bytes::Bytes;
use common::*;
use iop_engine::memory::CountingAlloc;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn live_bytes() -> i64 {
    CountingAlloc::live_bytes()
}

/// The prompt's size: far above everything else the exchange allocates.
const PROMPT_BYTES: usize = 2 * 1024 * 1024;

/// Reads from `client` into `seen` until it holds `needle`.
async fn read_until(client: &mut TcpStream, seen: &mut Vec<u8>, needle: &[u8]) {
    while !seen.windows(needle.len()).any(|w| w == needle) {
        let (read, buf) = client.read(Vec::with_capacity(4096)).await;
        let n = read.expect("read the response");
        assert!(n > 0, "the response ended before {needle:?}");
        seen.extend_from_slice(&buf[..n]);
    }
}

async fn send(node: &RawNode, f: pb::ProviderTunnelFrame) {
    node.conn
        .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(f))))
        .await
        .expect("send a tunnel frame");
}

#[monoio::test_all(timer_enabled = true)]
async fn a_committed_stream_holds_no_copy_of_its_request() {
    let pki = Pki::mint("request-release");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut node = ready_node(&edge, &pki, "node-a").await;

        let mut client = TcpStream::connect(edge.client_addr).await.expect("connect");
        let body = format!(
            r#"{{"model":"{MODEL}","stream":true,"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(PROMPT_BYTES)
        );
        let (written, _) = client
            .write_all(request_bytes(
                "POST",
                "/v1/chat/completions",
                body.as_bytes(),
            ))
            .await;
        written.expect("send the request");
        drop(body);
        let request = next_tunnel(&mut node).await;
        assert!(request.body.len() > PROMPT_BYTES, "the node got the prompt");
        let run_id = request.run_id.clone();
        drop(request);

        // Admitted and sent, not committed: the Edge keeps the request for
        // another attempt.
        let held = live_bytes();
        let start = pb::ProviderTunnelFrame {
            status: 200,
            headers: vec![pb::Header {
                name: "content-type".into(),
                value: Bytes::from_static(b"text/event-stream"),
            }],
            ..tunnel_frame(&run_id, 1, pb::TunnelFrameKind::ResponseStart)
        };
        send(&node, start).await;
        let mut first = tunnel_frame(&run_id, 2, pb::TunnelFrameKind::Body);
        first.body = Bytes::from_static(b"data: first\n\n");
        send(&node, first).await;
        let mut seen = Vec::new();
        read_until(&mut client, &mut seen, b"data: first\n\n").await;

        // Committed and still streaming: the request is gone. (Less than
        // all of it shows: the first relayed chunk also allocates the
        // Edge's latency histograms, some hundreds of KiB; had the request
        // been kept, the difference would be that much below zero.)
        let released = held - live_bytes();
        assert!(
            released > i64::try_from(PROMPT_BYTES / 2).unwrap(),
            "{released} bytes released at the commit, expected about the prompt's {PROMPT_BYTES}"
        );

        let mut last = tunnel_frame(&run_id, 3, pb::TunnelFrameKind::Body);
        last.body = Bytes::from_static(b"data: [DONE]\n\n");
        send(&node, last).await;
        send(&node, tunnel_frame(&run_id, 4, pb::TunnelFrameKind::End)).await;
        read_until(&mut client, &mut seen, b"0\r\n\r\n").await;
        let response = parse_response(&seen);
        assert_eq!(
            (response.status, response.body.as_slice()),
            (200, &b"data: first\n\ndata: [DONE]\n\n"[..])
        );
        edge.stop().await;
    })
    .await;
}
