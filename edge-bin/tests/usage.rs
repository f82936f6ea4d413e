//! The usage file (`[edge.usage_log]`) through the running Edge, over real
//! client sockets and a hand-driven node on real mTLS: one exact record
//! per inference request, with the tokens the node observed and how
//! complete they are, for a completed stream (`reported`), a completed
//! response the provider reported no usage for (`none`), and a stream the
//! client walked away from after a usage observation (`partial`, with what
//! was observed). Routes that are not inference get no record. The relayed
//! bytes are exactly the node's (usage is never merged into a body).

mod common;

use bytes::Bytes;
use common::*;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::AsyncWriteRentExt;
use monoio::net::TcpStream;
use serde_json::{json, Value};

fn chat(stream: bool, id: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "model": MODEL,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
         x-request-id: {id}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

async fn usage(node: &RawNode, run_id: &str, seq: u64, prompt: u64, completion: u64) {
    let frame = pb::ProviderTunnelFrame {
        usage: Some(Box::new(pb::Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        })),
        ..tunnel_frame(run_id, seq, pb::TunnelFrameKind::Usage)
    };
    node.conn
        .send_bulk(common::frame(Body::ProviderTunnelFrame(Box::new(frame))))
        .await
        .expect("send usage");
}

/// The record without its timing fields (checked apart).
fn without_timing(record: &Value) -> Value {
    let mut record = record.clone();
    let object = record.as_object_mut().expect("a JSON object");
    let ts = object.remove("ts").expect("ts");
    assert!(ts.as_str().is_some_and(|t| t.ends_with('Z')), "{ts}");
    let duration = object.remove("duration_ms").expect("duration_ms");
    assert!(duration.as_f64().is_some_and(|d| d >= 0.0), "{duration}");
    record
}

fn expected(id: &str, outcome: &str, usage: &str, tokens: Option<(u64, u64)>) -> Value {
    let (p, c, t) = match tokens {
        Some((p, c)) => (json!(p), json!(c), json!(p + c)),
        None => (Value::Null, Value::Null, Value::Null),
    };
    json!({
        "request_id": id, "principal": "anonymous", "path": "/v1/chat/completions",
        "model": MODEL, "provider": "node-a/a-mock", "node": "node-a", "status": 200,
        "outcome": outcome, "attempts": 1, "usage": usage,
        "prompt_tokens": p, "completion_tokens": c, "total_tokens": t,
    })
}

#[monoio::test_all(timer_enabled = true)]
async fn every_inference_request_gets_one_exact_usage_record() {
    let pki = Pki::mint("usage-file");
    guarded(async {
        let path = pki.dir.join("usage.jsonl");
        let _ = std::fs::remove_file(&path);
        let mut options = EdgeOptions::without_provider();
        options.extra_toml = format!("[edge.usage_log]\npath = \"{}\"\n", path.display());
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = ready_node(&edge, &pki, "node-a").await;

        // 1. A completed stream with a usage observation.
        let addr = edge.client_addr;
        let client = monoio::spawn(async move { http_exchange(addr, chat(true, "u-1")).await });
        let run = next_tunnel(&mut node).await.run_id;
        tunnel_response_start(&node, &run, b"text/event-stream").await;
        tunnel_body(&node, &run, 2, b"data: {\"n\":1}\n\ndata: [DONE]\n\n").await;
        usage(&node, &run, 3, 11, 3).await;
        tunnel_end(&node, &run, 4).await;
        let streamed = client.await;
        assert_eq!(streamed.status, 200);
        assert_eq!(streamed.body, b"data: {\"n\":1}\n\ndata: [DONE]\n\n");

        // 2. A completed response without usage.
        let client = monoio::spawn(async move { http_exchange(addr, chat(false, "u-2")).await });
        let run = next_tunnel(&mut node).await.run_id;
        tunnel_response_start(&node, &run, b"application/json").await;
        tunnel_body(&node, &run, 2, b"{\"ok\":true}").await;
        tunnel_end(&node, &run, 3).await;
        assert_eq!(client.await.body, b"{\"ok\":true}");

        // 3. A stream the client leaves after a usage observation: the Edge
        // cancels the run on the node.
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (res, _) = client.write_all(chat(true, "u-3")).await;
        res.unwrap();
        let run = next_tunnel(&mut node).await.run_id;
        tunnel_response_start(&node, &run, b"text/event-stream").await;
        usage(&node, &run, 2, 7, 2).await;
        tunnel_body(&node, &run, 3, b"data: {\"n\":1}\n\n").await;
        let mut seen = Vec::new();
        read_until(&mut client, &mut seen, b"data: {\"n\":1}").await;
        drop(client);
        // The node keeps streaming until the Edge notices the client left.
        let mut seq = 4;
        let cancel = loop {
            node.conn
                .send_body_frame(
                    tunnel_frame(&run, seq, pb::TunnelFrameKind::Body),
                    Bytes::from_static(b"data: {\"n\":2}\n\n"),
                )
                .await
                .expect("send body");
            seq += 1;
            if let Some(cancel) = next_cancel(&mut node).await {
                break cancel;
            }
        };
        assert_eq!(cancel.run_id, run);

        // 4. Not an inference route: no record.
        assert_eq!(
            http_request(addr, "GET", "/v1/models", b"").await.status,
            200
        );

        edge.stop().await;
        let text = std::fs::read_to_string(&path).expect("the usage file");
        let records: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        let records: Vec<Value> = records.iter().map(without_timing).collect();
        assert_eq!(
            records,
            vec![
                expected("u-1", "completed", "reported", Some((11, 3))),
                expected("u-2", "completed", "none", None),
                expected("u-3", "client_disconnect", "partial", Some((7, 2))),
            ]
        );
    })
    .await;
}

/// The next frame if it is the Edge's `CancelRequest`; flow-control and
/// other frames are skipped, and `None` says the Edge asked for nothing
/// yet (a window update arrived instead).
async fn next_cancel(node: &mut RawNode) -> Option<pb::CancelRequest> {
    let wait = monoio::time::sleep(std::time::Duration::from_millis(50));
    monoio::select! {
        frame = node.next_frame() => match frame {
            Body::CancelRequest(c) => Some(c),
            _ => None,
        },
        _ = wait => None,
    }
}

// A usage file that refuses every write (`/dev/full`: no space left) is
// counted in `/metrics`; the records wait for it in memory (none dropped
// while within the bound).
#[monoio::test_all(timer_enabled = true)]
async fn failed_usage_writes_are_counted_in_metrics() {
    let pki = Pki::mint("usage-full");
    guarded(async {
        let mut options = EdgeOptions::without_provider();
        options.extra_toml = "[edge.usage_log]\npath = \"/dev/full\"\n".into();
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        // An inference request no provider serves still gets its record.
        let refused = http_exchange(edge.client_addr, chat(false, "u-full")).await;
        assert_eq!(refused.status, 503);
        let errors = "iop_edge_usage_log_write_errors_total";
        while metric(edge.client_addr, errors).await == 0 {
            monoio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(
            metric(edge.client_addr, "iop_edge_usage_log_dropped_records_total").await,
            0
        );
        assert_eq!(edge.edge.settings.usage_log.dropped_records(), 0);
        assert!(edge.edge.settings.usage_log.write_errors() >= 1);
        edge.stop().await;
    })
    .await;
}
