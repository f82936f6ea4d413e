//! The usage chunk the Edge asked for on a client's behalf
//! (`ProviderTunnelRequest.strip_usage_chunk`): a real Node session against
//! a scripted Edge and a hand-written provider over real sockets, which
//! sends its event stream in chunked pieces cut where the test says (each
//! its own TCP write), so the usage event reaches the Node split across
//! reads.
//!
//! Proves: the BODY frames carry every byte the provider sent but the
//! usage-only event, and a USAGE frame carries its counts; without the flag
//! every byte goes through; a provider that ignores `include_usage` has its
//! body relayed whole, no usage is made up, and the miss is counted.
//!
//! Waits are bounded by [`common::SAFETY`] only as a net against hangs; no
//! assertion depends on how fast anything runs.

mod common;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use common::{chat_tunnel, node_config, openai_adapter, Edge};
use iop_engine::metrics::{self, Count};
use iop_wire::pb;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

const CONTENT: &str = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"mock-model\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
    data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"mock-model\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n";
const USAGE: &str = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"mock-model\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15}}\n\n";
const DONE: &str = "data: [DONE]\n\n";
/// The tunnel body, as the Edge builds it when it asks for usage.
const BODY: &str =
    r#"{"model":"mock-model","stream_options":{"include_usage":true},"messages":[],"stream":true}"#;

/// A provider that answers each request (on its own connection) with the
/// next scripted body, written as a chunked event stream in the given
/// pieces, one TCP write each, a moment apart; keeps each request's body.
struct Provider {
    addr: SocketAddr,
    bodies: Rc<RefCell<Vec<Vec<u8>>>>,
    task: monoio::task::JoinHandle<()>,
}

impl Provider {
    fn start(replies: Vec<Vec<&'static str>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind provider");
        let addr = listener.local_addr().expect("provider address");
        let bodies = Rc::new(RefCell::new(Vec::new()));
        let seen = bodies.clone();
        let task = monoio::spawn(async move {
            for pieces in replies {
                let (mut conn, _) = listener.accept().await.expect("accept");
                let body = read_request(&mut conn).await;
                seen.borrow_mut().push(body);
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                            transfer-encoding: chunked\r\nconnection: close\r\n\r\n";
                let (res, _) = conn.write_all(head.as_bytes().to_vec()).await;
                res.expect("write head");
                for piece in pieces {
                    monoio::time::sleep(Duration::from_millis(20)).await;
                    let chunk = format!("{:x}\r\n{piece}\r\n", piece.len());
                    let (res, _) = conn.write_all(chunk.into_bytes()).await;
                    res.expect("write chunk");
                }
                let (res, _) = conn.write_all(b"0\r\n\r\n".to_vec()).await;
                res.expect("write last chunk");
            }
        });
        Self { addr, bodies, task }
    }

    fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Reads one request with a `content-length` body; returns the body.
async fn read_request(conn: &mut TcpStream) -> Vec<u8> {
    let mut raw = Vec::new();
    loop {
        if let Some(head_end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().expect("content-length"));
            if raw.len() >= head_end + 4 + len {
                return raw[head_end + 4..head_end + 4 + len].to_vec();
            }
        }
        let (res, buf) = conn.read(Vec::with_capacity(4096)).await;
        assert!(res.expect("read request") > 0, "request cut short");
        raw.extend_from_slice(&buf);
    }
}

fn payload(provider: &Provider) -> pb::NodeConfigPayload {
    let profile = pb::ProtocolProfile {
        name: "openai".into(),
        base_url: provider.base_url(),
        models_path: "/v1/models".into(),
        chat_completions_path: "/v1/chat/completions".into(),
        ..Default::default()
    };
    node_config(vec![openai_adapter("mock", 4, profile)], false)
}

/// A streamed chat tunnel whose body asks for usage, `strip` as given.
fn stream_tunnel(run_id: &str, strip: bool) -> pb::ProviderTunnelRequest {
    pb::ProviderTunnelRequest {
        stream: true,
        strip_usage_chunk: strip,
        ..chat_tunnel(run_id, BODY.into())
    }
}

/// The BODY bytes of a tunnel's frames, and its USAGE observations.
fn body_and_usage(frames: &[pb::ProviderTunnelFrame]) -> (String, Vec<pb::Usage>) {
    let kinds: Vec<_> = frames.iter().map(pb::ProviderTunnelFrame::kind).collect();
    assert_eq!(kinds.first(), Some(&pb::TunnelFrameKind::ResponseStart));
    assert_eq!(kinds.last(), Some(&pb::TunnelFrameKind::End), "{frames:?}");
    let body: Vec<u8> = frames
        .iter()
        .filter(|f| f.kind() == pb::TunnelFrameKind::Body)
        .flat_map(|f| f.body.to_vec())
        .collect();
    let usage = frames
        .iter()
        .filter(|f| f.kind() == pb::TunnelFrameKind::Usage)
        .filter_map(|f| f.usage.as_deref().copied())
        .collect();
    (String::from_utf8(body).expect("UTF-8"), usage)
}

#[monoio::test_all(timer_enabled = true)]
async fn a_usage_event_split_across_reads_is_observed_and_left_out() {
    let usage_at = CONTENT.len();
    let stream = format!("{CONTENT}{USAGE}{DONE}");
    let s: &'static str = Box::leak(stream.into_boxed_str());
    // Cut inside the usage event before its `choices`, inside its usage
    // object, and between the two LFs of its blank line.
    let cut1 = usage_at + 20;
    let cut2 = usage_at + USAGE.find("completion").unwrap();
    let cut3 = usage_at + USAGE.len() - 1;
    let pieces = vec![&s[..cut1], &s[cut1..cut2], &s[cut2..cut3], &s[cut3..]];
    let provider = Provider::start(vec![pieces.clone(), pieces]);
    let mut edge = Edge::start(payload(&provider)).await;
    let stripped = metrics::merged().counter(Count::NodeTunnelUsageChunksStripped);

    let frames = edge.tunnel(stream_tunnel("run-strip", true)).await;
    let (body, usage) = body_and_usage(&frames);
    assert_eq!(body, format!("{CONTENT}{DONE}"));
    let counts = pb::Usage {
        prompt_tokens: 12,
        completion_tokens: 3,
        total_tokens: 15,
    };
    assert_eq!(usage, vec![counts]);
    assert_eq!(
        metrics::merged().counter(Count::NodeTunnelUsageChunksStripped),
        stripped + 1
    );

    // Without the flag (the client asked for usage): every byte.
    let frames = edge.tunnel(stream_tunnel("run-keep", false)).await;
    let (body, usage) = body_and_usage(&frames);
    assert_eq!(body, s);
    assert_eq!(usage, vec![counts]);
    // The provider got the body as the Edge built it.
    assert_eq!(*provider.bodies.borrow(), vec![BODY.as_bytes().to_vec(); 2]);
    provider.task.await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_provider_that_ignores_include_usage_is_relayed_whole_and_counted() {
    let stream: &'static str = Box::leak(format!("{CONTENT}{DONE}").into_boxed_str());
    let provider = Provider::start(vec![vec![&stream[..50], &stream[50..]]]);
    let mut edge = Edge::start(payload(&provider)).await;
    let missing = metrics::merged().counter(Count::NodeTunnelUsageMissing);

    let frames = edge.tunnel(stream_tunnel("run-old", true)).await;
    let (body, usage) = body_and_usage(&frames);
    assert_eq!(body, stream);
    // Nothing is guessed: no USAGE frame, the Edge records `none`.
    assert_eq!(usage, vec![]);
    assert_eq!(
        metrics::merged().counter(Count::NodeTunnelUsageMissing),
        missing + 1
    );
    provider.task.await;
}
