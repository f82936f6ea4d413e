//! O2 on the observation paths the binary ships, over real sockets.
//!
//! The binary attaches no `edge_bin::state::Observer`: `Edge::observe` is
//! called nowhere in `main` or `server`, so `Control`'s events reach only
//! `log_event` (lines on the process log). What observes a request's end
//! in the binary is the access log and the usage file (each written by a
//! thread of its own from a bounded queue) and the status page's
//! `/ui/events` viewers (each its own task, reading snapshots of `Control`;
//! not a subscription to its events). Here all of them fail at once: both
//! logs write to `/dev/full`, where every write fails (ENOSPC), and a
//! viewer stops reading until the Edge's writes to it block. Streamed
//! requests still get their terminal, whole, and release their lease.

mod common;

use std::time::Duration;

use common::*;
use monoio::io::AsyncWriteRentExt;
use monoio::net::TcpStream;

/// A stuck viewer is reset only after this long; longer than the test.
const WRITE_STALL_TIMEOUT_MS: u64 = 120_000;

fn stream_request() -> Vec<u8> {
    request_bytes(
        "POST",
        "/v1/chat/completions",
        format!(
            r#"{{"model":"{MODEL}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
        .as_bytes(),
    )
}

/// The bytes waiting in `socket`'s receive queue (peeked, not read).
fn queued(socket: &std::net::TcpStream) -> Vec<u8> {
    let mut buf = vec![0u8; 1 << 20];
    match socket.peek(&mut buf) {
        Ok(n) => buf.truncate(n),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => buf.clear(),
        Err(e) => panic!("peek the viewer's socket: {e}"),
    }
    buf
}

#[monoio::test_all(timer_enabled = true)]
async fn failing_observers_never_suppress_terminal_delivery() {
    let pki = Pki::mint("o2-failing-observers");
    guarded(async {
        let options = EdgeOptions {
            edge_keys: format!("client_write_stall_timeout_ms = {WRITE_STALL_TIMEOUT_MS}\n"),
            extra_toml: "\n[edge.usage_log]\npath = \"/dev/full\"\n\n\
                         [edge.access_log]\ndestination = \"/dev/full\"\n"
                .to_string(),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = ready_node(&edge, &pki, "node-a").await;

        // A viewer that never reads: small buffers, so the Edge's writes
        // to it block after a few events. Its queue stops growing then.
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        socket.connect(&edge.client_addr.into()).expect("connect");
        socket.set_nonblocking(true).expect("non-blocking");
        let peek: std::net::TcpStream = socket
            .try_clone()
            .expect("a second handle to peek with")
            .into();
        let mut stuck = TcpStream::from_std(socket.into()).expect("monoio stream");
        let (res, _) = stuck
            .write_all(b"GET /ui/events HTTP/1.1\r\nhost: localhost\r\n\r\n".to_vec())
            .await;
        res.expect("write the viewer's request");
        let (mut seen, mut unchanged) = (Vec::new(), 0);
        while unchanged < 2 {
            // Events come once a second: unchanged over two checks 1.5 s
            // apart, the Edge's writes to it are blocked.
            monoio::time::sleep(Duration::from_millis(1500)).await;
            let now = queued(&peek);
            unchanged = if !now.is_empty() && now == seen {
                unchanged + 1
            } else {
                0
            };
            seen = now;
        }
        assert!(seen.starts_with(b"HTTP/1.1 200"), "{seen:?}");
        let events = seen.windows(6).filter(|w| w == b"data: ").count();
        assert!(events >= 2, "a viewer of {events} events");

        let addr = edge.client_addr;
        for i in 0..3u64 {
            let client = monoio::spawn(async move { http_exchange(addr, stream_request()).await });
            let run = next_tunnel(&mut node).await.run_id;
            tunnel_response_start(&node, &run, b"text/event-stream").await;
            tunnel_body(&node, &run, 2, b"data: {\"n\":1}\n\ndata: [DONE]\n\n").await;
            tunnel_end(&node, &run, 3).await;
            let response = client.await;
            // CONTRACT: O2 — with every observer of the request's end
            // failing, its terminal reached the client whole and its lease
            // was released.
            assert_eq!(response.status, 200, "request {i}: {response:?}");
            assert_eq!(response.body, b"data: {\"n\":1}\n\ndata: [DONE]\n\n");
            assert_eq!(
                node_entry(addr, "node-a").await,
                ready_entry("node-a", "a-mock", 0),
                "request {i}"
            );
        }

        // The observers did fail: the usage file's writes failed, and the
        // viewer is still stuck, not reset.
        while edge.edge.settings.usage_log.write_errors() == 0 {
            monoio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(metric(addr, "iop_edge_client_write_stalls_total").await, 0);
        drop(stuck);
        edge.stop().await;
    })
    .await;
}
