//! A tunnel's provider call holds no copy of its request while the body
//! streams.
//!
//! The call needs the request (its body, headers and target) until the
//! provider's response head arrives: a stale pooled connection is retried
//! with it. From then on it is freed, however long the body streams.
//!
//! A counting global allocator measures the bytes live in the process
//! (the Node session, the scripted Edge and the provider all run in this
//! test's runtime) before the request and while its response streams. The
//! provider is a hand-written one that reads the request into a small
//! reused buffer, so only the Node could hold the 2 MiB body.

mod common;

use bytes::Bytes;
use common::{chat_tunnel, node_config, openai_adapter, Edge};
use iop_engine::memory::CountingAlloc;
use iop_engine::sync::oneshot;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn live_bytes() -> i64 {
    CountingAlloc::live_bytes()
}

/// The prompt's size: far above everything else the exchange allocates.
const PROMPT_BYTES: usize = 2 * 1024 * 1024;

/// Reads and discards one request with a `content-length` body, through a
/// small buffer that is reused throughout.
async fn discard_request(stream: &mut TcpStream) {
    let mut seen: Vec<u8> = Vec::with_capacity(4096);
    let mut buf = vec![0u8; 16 * 1024];
    let (head_len, body_len) = loop {
        let (read, back) = stream.read(buf).await;
        buf = back;
        let n = read.expect("read the request");
        assert!(n > 0, "the request ended early");
        seen.extend_from_slice(&buf[..n]);
        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse::<usize>().expect("content-length"))
                .expect("the request has a content-length");
            break (end + 4, len);
        }
    };
    let mut left = body_len.saturating_sub(seen.len() - head_len);
    drop(seen);
    while left > 0 {
        let (read, back) = stream.read(buf).await;
        buf = back;
        let n = read.expect("read the body");
        assert!(n > 0, "the body ended early");
        left = left.saturating_sub(n);
    }
}

async fn write(stream: &mut TcpStream, bytes: &'static [u8]) {
    let (written, _) = stream.write_all(bytes).await;
    written.expect("write the response");
}

#[monoio::test(timer_enabled = true)]
async fn a_streaming_tunnel_holds_no_copy_of_its_request() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the provider");
    let addr = listener.local_addr().expect("provider address");
    let profile = pb::ProtocolProfile {
        name: "openai".into(),
        base_url: format!("http://{addr}"),
        models_path: "/v1/models".into(),
        chat_completions_path: "/v1/chat/completions".into(),
        ..Default::default()
    };
    let mut edge = Edge::start(node_config(vec![openai_adapter("mock", 4, profile)], false)).await;
    let (go_on, carry_on) = oneshot::channel::<()>();
    let provider = monoio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept the node");
        discard_request(&mut stream).await;
        write(
            &mut stream,
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
              transfer-encoding: chunked\r\n\r\nd\r\ndata: first\n\n\r\n",
        )
        .await;
        let _ = carry_on.await;
        write(&mut stream, b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n").await;
    });

    let before = live_bytes();
    let body = format!(
        r#"{{"model":"t","stream":true,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(PROMPT_BYTES)
    );
    edge.send(Body::ProviderTunnelRequest(Box::new(chat_tunnel(
        "release-1",
        body,
    ))));
    let mut frames = Vec::new();
    while !frames
        .iter()
        .any(|f: &pb::ProviderTunnelFrame| f.kind() == pb::TunnelFrameKind::Body)
    {
        frames.push(edge.recv_tunnel().await);
    }
    // Streaming: the provider waits with the rest of the body.
    let held = live_bytes() - before;
    assert!(
        held < i64::try_from(PROMPT_BYTES / 2).unwrap(),
        "{held} bytes more live while the body streams than before the {PROMPT_BYTES}-byte request"
    );

    let _ = go_on.send(());
    frames.extend(edge.tunnel_frames("release-1").await);
    provider.await;
    let body: Vec<u8> = frames
        .iter()
        .filter(|f| f.kind() == pb::TunnelFrameKind::Body)
        .flat_map(|f| f.body.iter().copied())
        .collect();
    assert_eq!(body, Bytes::from_static(b"data: first\n\ndata: [DONE]\n\n"));
    assert_eq!(
        frames.last().map(pb::ProviderTunnelFrame::kind),
        Some(pb::TunnelFrameKind::End)
    );
}
