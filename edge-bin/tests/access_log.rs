//! Request ids and the access log through the running Edge: a client's
//! `x-request-id` reaches the node as the run's correlation id and comes
//! back on the response; one access log line per request, its fields
//! exact; an unusable id is replaced by a minted one.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use serde_json::{json, Value};

/// The JSON access log lines written so far (polled: the writer thread
/// writes them shortly after each response).
async fn access_lines(path: &std::path::Path, want: usize) -> Vec<Value> {
    for _ in 0..400 {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.lines().count() >= want {
            return text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                .collect();
        }
        monoio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "fewer than {want} access log lines: {:?}",
        std::fs::read_to_string(path)
    );
}

/// A streamed chat completion for `model`.
fn chat_body(model: &str) -> String {
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"stream":true}}"#)
}

/// A request with extra header lines (each `name: value\r\n`).
fn request_with(method: &str, path: &str, extra: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n{extra}\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// The fields of a line that vary from run to run, checked apart.
fn without_timing(line: &Value) -> Value {
    let mut line = line.clone();
    let object = line.as_object_mut().expect("a JSON object");
    for key in ["ts", "ttft_ms", "duration_ms"] {
        object.remove(key);
    }
    line
}

// The request id round trip: the client's x-request-id is
// the correlation id of the tunnel the node gets and the x-request-id of
// the response; the access log line names the request, route, model,
// provider, node, status, outcome, attempts, bytes in and out (exactly
// what the client sent and read) and the tokens the node observed.
#[monoio::test_all(timer_enabled = true)]
async fn a_request_id_goes_to_the_node_and_back_and_the_line_is_exact() {
    let pki = Pki::mint("access-log");
    guarded(async {
        let log_path = pki.dir.join("access.jsonl");
        let _ = std::fs::remove_file(&log_path);
        let mut options = EdgeOptions::without_provider();
        options.extra_toml = format!(
            "[edge.access_log]\ndestination = \"{}\"\nformat = \"json\"\n",
            log_path.display()
        );
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        assert!(node.register("node-a").await.accepted);
        assert_eq!(node.ready("node-a").await, ready_accepted());

        let body = chat_body(MODEL);
        let request = request_with(
            "POST",
            "/v1/chat/completions",
            "x-request-id: client-req-42\r\n",
            body.as_bytes(),
        );
        let client_addr = edge.client_addr;
        let client = monoio::spawn(async move { http_exchange(client_addr, request).await });
        let tunnel = match node.next_frame().await {
            Body::ProviderTunnelRequest(r) => r,
            other => panic!("expected ProviderTunnelRequest, got {other:?}"),
        };
        assert_eq!(tunnel.correlation_id, "client-req-42");
        let frame = |seq: u64, kind: pb::TunnelFrameKind| pb::ProviderTunnelFrame {
            run_id: tunnel.run_id.clone(),
            seq,
            kind: kind as i32,
            ..Default::default()
        };
        let frames = [
            pb::ProviderTunnelFrame {
                status: 200,
                headers: vec![pb::Header {
                    name: "content-type".into(),
                    value: Bytes::from_static(b"text/event-stream"),
                }],
                ..frame(1, pb::TunnelFrameKind::ResponseStart)
            },
            pb::ProviderTunnelFrame {
                body: Bytes::from_static(b"data: {\"n\":1}\n\ndata: [DONE]\n\n"),
                ..frame(2, pb::TunnelFrameKind::Body)
            },
            pb::ProviderTunnelFrame {
                usage: Some(Box::new(pb::Usage {
                    prompt_tokens: 11,
                    completion_tokens: 3,
                    total_tokens: 14,
                })),
                ..frame(3, pb::TunnelFrameKind::Usage)
            },
            frame(4, pb::TunnelFrameKind::End),
        ];
        for f in frames {
            node.conn
                .send_bulk(common::frame(Body::ProviderTunnelFrame(Box::new(f))))
                .await
                .expect("send tunnel frame");
        }
        let response = client.await;
        assert_eq!(response.status, 200);
        assert_eq!(response.header("x-request-id"), Some("client-req-42"));
        assert_eq!(response.body, b"data: {\"n\":1}\n\ndata: [DONE]\n\n");

        // An id with a space is not taken: a minted one replaces it, on an
        // error answer too.
        let missing = http_exchange(
            edge.client_addr,
            request_with("GET", "/v1/nope", "x-request-id: has space\r\n", b""),
        )
        .await;
        assert_eq!(missing.status, 404);
        let minted = missing.header("x-request-id").expect("an id").to_owned();
        assert!(minted.starts_with("req_") && minted.len() == 36, "{minted}");

        let lines = access_lines(&log_path, 2).await;
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(
            without_timing(&lines[0]),
            json!({
                "request_id": "client-req-42", "principal": "anonymous",
                "method": "POST", "path": "/v1/chat/completions", "model": MODEL,
                "provider": "node-a/a-mock", "node": "node-a", "status": 200,
                "outcome": "completed", "attempts": 1,
                "bytes_in": body.len(), "bytes_out": response.wire_bytes,
                "prompt_tokens": 11, "completion_tokens": 3, "usage": "reported",
            })
        );
        assert_eq!(
            without_timing(&lines[1]),
            json!({
                "request_id": minted, "principal": "anonymous", "method": "GET",
                "path": "/v1/nope", "model": null, "provider": null, "node": null,
                "status": 404, "outcome": "unknown_url", "attempts": 0,
                "bytes_in": 0, "bytes_out": missing.wire_bytes,
                "prompt_tokens": null, "completion_tokens": null, "usage": "none",
            })
        );
        let (ttft, duration) = (
            lines[0]["ttft_ms"].as_f64().expect("a first byte"),
            lines[0]["duration_ms"].as_f64().expect("a duration"),
        );
        assert!(0.0 <= ttft && ttft <= duration, "{ttft} {duration}");
        let ts = lines[0]["ts"].as_str().expect("a timestamp");
        assert!(
            ts.len() == 24 && ts.ends_with('Z') && ts.as_bytes()[10] == b'T',
            "{ts}"
        );
        edge.stop().await;
    })
    .await;
}

// An early error (a body over the limit, answered before it was read) is
// one line too, with the id the client sent and the error's code.
#[monoio::test_all(timer_enabled = true)]
async fn an_early_error_is_logged_with_the_clients_id() {
    let pki = Pki::mint("access-log-early");
    guarded(async {
        let log_path = pki.dir.join("access.log");
        let _ = std::fs::remove_file(&log_path);
        let mut options = EdgeOptions::without_provider();
        options.max_request_body_bytes = Some(1024);
        options.extra_toml = format!(
            "[edge.access_log]\ndestination = \"{}\"\nformat = \"json\"\n",
            log_path.display()
        );
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let big = vec![b' '; 4096];
        let response = http_exchange(
            edge.client_addr,
            request_with("POST", "/v1/messages", "x-request-id: early-7\r\n", &big),
        )
        .await;
        assert_eq!(response.status, 413);
        assert_eq!(response.header("x-request-id"), Some("early-7"));
        assert_eq!(response.json()["request_id"], "early-7");
        let lines = access_lines(&log_path, 1).await;
        assert_eq!(
            without_timing(&lines[0]),
            json!({
                "request_id": "early-7", "principal": "anonymous", "method": "POST",
                "path": "/v1/messages", "model": null, "provider": null, "node": null,
                "status": 413, "outcome": "request_too_large", "attempts": 0,
                "bytes_in": 0, "bytes_out": response.wire_bytes,
                "prompt_tokens": null, "completion_tokens": null, "usage": "none",
            })
        );
        edge.stop().await;
    })
    .await;
}
