//! A tunnel whose request body streams in (`body_follows_bytes`,
//! `ProviderTunnelBody`): a real Node session against a scripted Edge and
//! the mock provider over real sockets.
//!
//! Proves: the provider gets the whole body, first piece and every later
//! one in order (the mock hashes the uploaded file), while the Edge never
//! has more than the window of it unacknowledged: it sends only under the
//! credit the Node grants as the provider takes the bytes; an Edge that
//! sends beyond its credit is closed with `flow_control_overrun`; pieces of
//! a body longer than announced are refused as a protocol error.
//!
//! Waits are bounded by [`common::SAFETY`] only as a net against hangs; no
//! assertion depends on how fast anything runs.

mod common;

use bytes::Bytes;
use common::{node_config, openai_adapter, openai_profile, Edge, Mock, SAFETY, TARGET};
use iop_engine::conn::ConnEvent;
use iop_wire::flow::{tunnel_body_charge, TUNNEL_BODY_WINDOW};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;

const BOUNDARY: &str = "up-7MA4YWxkTrZu0gW";

/// A transcription form around `file` as (head, file, tail).
fn form(file: &[u8]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let head = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{TARGET}\r\n\
         --{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.wav\"\r\n\
         Content-Type: audio/wav\r\n\r\n"
    );
    let tail = format!("\r\n--{BOUNDARY}--\r\n");
    (head.into_bytes(), file.to_vec(), tail.into_bytes())
}

/// A file of `len` bytes that no boundary can be found in.
fn file(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

async fn node_for(mock: &Mock) -> Edge {
    let profile = pb::ProtocolProfile {
        transcriptions_path: "/v1/audio/transcriptions".into(),
        ..openai_profile(mock)
    };
    Edge::start(node_config(vec![openai_adapter("mock", 4, profile)], false)).await
}

fn upload_tunnel(run_id: &str, first: Vec<u8>, follows: u64) -> pb::ProviderTunnelRequest {
    pb::ProviderTunnelRequest {
        run_id: run_id.into(),
        adapter: "mock".into(),
        target: TARGET.into(),
        method: "POST".into(),
        headers: vec![pb::Header {
            name: "content-type".into(),
            value: Bytes::from(format!("multipart/form-data; boundary={BOUNDARY}")),
        }],
        body: Bytes::from(first),
        operation: "transcriptions".into(),
        body_follows_bytes: follows,
        flow_window_bytes: 1 << 20,
        ..Default::default()
    }
}

fn piece(run_id: &str, data: &[u8]) -> Body {
    Body::ProviderTunnelBody(pb::ProviderTunnelBody {
        run_id: run_id.into(),
        data: Bytes::copy_from_slice(data),
    })
}

#[monoio::test_all(timer_enabled = true)]
async fn a_streamed_body_reaches_the_provider_whole_under_the_nodes_credit() {
    let mock = Mock::start(Mock::handler(1, 0));
    let mut edge = node_for(&mock).await;
    let audio = file(1_000_000);
    let (head, audio, tail) = form(&audio);
    // The first piece: the form's head and 1,000 bytes of the file.
    let mut first = head.clone();
    first.extend_from_slice(&audio[..1000]);
    let mut rest = audio[1000..].to_vec();
    rest.extend_from_slice(&tail);
    edge.send(Body::ProviderTunnelRequest(Box::new(upload_tunnel(
        "up-1",
        first,
        rest.len() as u64,
    ))));
    let mut granted = TUNNEL_BODY_WINDOW;
    let mut sent_charge = 0u64;
    let mut credits = 0;
    let mut offset = 0;
    let mut frames = Vec::new();
    while offset < rest.len() {
        let len = (60 * 1024).min(rest.len() - offset);
        if sent_charge + tunnel_body_charge(len) > granted {
            // Out of credit: nothing more goes until the Node grants it.
            match edge.recv().await.body {
                Some(Body::FlowCredit(c)) => {
                    assert_eq!(c.credits.len(), 1);
                    assert_eq!(c.credits[0].run_id, "up-1");
                    assert!(c.credits[0].max_offset > granted, "credit grows: {c:?}");
                    granted = c.credits[0].max_offset;
                    credits += 1;
                }
                Some(Body::ProviderTunnelFrame(f)) => panic!("answered mid-upload: {f:?}"),
                other => panic!("unexpected frame {other:?}"),
            }
            continue;
        }
        edge.send(piece("up-1", &rest[offset..offset + len]));
        sent_charge += tunnel_body_charge(len);
        offset += len;
    }
    // A million bytes through a 256 KiB window took several grants.
    assert!(credits >= 3, "{credits} credits");
    loop {
        match edge.recv().await.body {
            // Late credits for the last pieces are harmless.
            Some(Body::FlowCredit(_)) => {}
            Some(Body::ProviderTunnelFrame(f)) => {
                let end = common::is_tunnel_terminal(f.kind());
                frames.push(*f);
                if end {
                    break;
                }
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
    let kinds: Vec<_> = frames.iter().map(|f| f.kind()).collect();
    assert_eq!(kinds.first(), Some(&pb::TunnelFrameKind::ResponseStart));
    assert_eq!(kinds.last(), Some(&pb::TunnelFrameKind::End), "{frames:?}");
    assert_eq!(frames[0].status, 200);
    let body: Vec<u8> = frames.iter().flat_map(|f| f.body.to_vec()).collect();
    let hash = bench::mock::digest::fnv1a(&audio);
    let expected = format!(
        "{{\"text\":\"transcript of {} bytes {:08x}\"}}",
        audio.len(),
        hash >> 32
    );
    assert_eq!(String::from_utf8_lossy(&body), expected);
    let seen = &mock.admin_stats().await["last_audio"];
    assert_eq!(seen["model"], TARGET);
    assert_eq!(seen["file_bytes"], audio.len() as u64);
    assert_eq!(seen["file_hash"], format!("{hash:016x}"));
}

/// The Node's close of the connection, with its reason.
async fn closed(edge: &mut Edge) -> CloseReason {
    loop {
        let event = monoio::select! {
            ev = edge.events.recv() => ev,
            _ = monoio::time::sleep(SAFETY) => panic!("the node did not close within {SAFETY:?}"),
        };
        match event {
            Some(ConnEvent::Frame(_) | ConnEvent::Chunk(_)) => continue,
            Some(ConnEvent::Closed { reason }) => return reason,
            None => panic!("events ended without a close"),
        }
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn an_edge_that_sends_beyond_its_credit_is_closed() {
    let mock = Mock::start(Mock::handler(1, 0));
    let mut edge = node_for(&mock).await;
    let (head, audio, _) = form(&file(10));
    let mut first = head;
    first.extend_from_slice(&audio);
    edge.send(Body::ProviderTunnelRequest(Box::new(upload_tunnel(
        "up-2",
        first,
        1 << 30,
    ))));
    // 200 KiB, then 600 KiB: beyond any credit the Node can have granted
    // (what it wrote, at most the first piece, plus one window).
    edge.send(piece("up-2", &vec![7u8; 200 * 1024]));
    edge.send(piece("up-2", &vec![7u8; 600 * 1024]));
    assert_eq!(
        closed(&mut edge).await.as_str(),
        "peer:flow_control_overrun"
    );
}

#[monoio::test_all(timer_enabled = true)]
async fn a_body_longer_than_announced_is_refused() {
    let mock = Mock::start(Mock::handler(1, 0));
    let mut edge = node_for(&mock).await;
    let (head, _, _) = form(b"");
    edge.send(Body::ProviderTunnelRequest(Box::new(upload_tunnel(
        "up-3", head, 5,
    ))));
    edge.send(piece("up-3", b"123456"));
    assert_eq!(closed(&mut edge).await.as_str(), "peer:protocol_error");
}
