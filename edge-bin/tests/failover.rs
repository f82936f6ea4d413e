//! The Edge over real loopback sockets with hand-driven nodes: what a
//! client sees when its provider fails — the response-wait timeout (U6).

mod common;

use bytes::Bytes;
use common::*;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

fn chat_body(model: &str, stream: bool) -> String {
    format!(
        r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
    )
}

// CONTRACT: U6 — a node that never starts a response: after
// `edge.response_wait_timeout_ms` the Edge sends it `CancelRequest` with
// reason `response_wait_timeout`, the client gets 504 in the OpenAI error
// shape, and the cancelled run's terminal releases the lease (in_flight back
// to 0).
#[monoio::test_all(timer_enabled = true)]
async fn a_response_that_never_starts_is_cancelled_and_answered_504() {
    let pki = Pki::mint("response-wait");
    guarded(async {
        let options = EdgeOptions {
            edge_keys: "response_wait_timeout_ms = 300\n".into(),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = ready_node(&edge, &pki, "node-a").await;
        for stream in [false, true] {
            let client_addr = edge.client_addr;
            let client =
                monoio::spawn(
                    async move { post_chat(client_addr, &chat_body(MODEL, stream)).await },
                );
            let request = next_tunnel(&mut node).await;
            // The node says nothing; the Edge gives up and cancels.
            let cancel = match node.next_frame().await {
                Body::CancelRequest(c) => c,
                other => panic!("expected CancelRequest, got {other:?}"),
            };
            assert_eq!(
                (cancel.run_id.as_str(), cancel.reason.as_str()),
                (request.run_id.as_str(), "response_wait_timeout") // CONTRACT: U6
            );
            let response = client.await;
            assert_eq!(response.status, 504);
            assert_eq!(
                response.json(),
                api_error(
                    "The provider did not start a response within edge.response_wait_timeout_ms.",
                    "upstream_error",
                    None,
                    Some("response_wait_timeout"),
                )
            );
            // Still leased until the cancelled run ends.
            assert_eq!(edge.edge.control().leases().count(), 1);
            let mut end = tunnel_frame(&request.run_id, 1, pb::TunnelFrameKind::Error);
            end.error = "cancelled".into();
            end.failure_code = "cancelled".into();
            node.conn
                .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(end))))
                .await
                .expect("send the terminal");
            let entry = wait_in_flight(edge.client_addr, "node-a", 0).await;
            assert_eq!(entry["in_flight"], 0);
            assert_eq!(edge.edge.control().leases().count(), 0);
            assert_eq!(
                edge.edge.control().counters().response_wait_timeouts,
                if stream { 2 } else { 1 }
            );
        }
        // A response that starts in time is not cut off by the deadline.
        let client_addr = edge.client_addr;
        let client =
            monoio::spawn(async move { post_chat(client_addr, &chat_body(MODEL, false)).await });
        let request = next_tunnel(&mut node).await;
        let mut start = tunnel_frame(&request.run_id, 1, pb::TunnelFrameKind::ResponseStart);
        start.status = 200;
        start.headers = vec![pb::Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }];
        node.conn
            .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(start))))
            .await
            .expect("send the start");
        monoio::time::sleep(std::time::Duration::from_millis(600)).await;
        let mut body = tunnel_frame(&request.run_id, 2, pb::TunnelFrameKind::Body);
        body.body = Bytes::from_static(b"{\"ok\":true}");
        let end = tunnel_frame(&request.run_id, 3, pb::TunnelFrameKind::End);
        for f in [body, end] {
            node.conn
                .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(f))))
                .await
                .expect("send");
        }
        let response = client.await;
        assert_eq!(
            (response.status, response.body.as_slice()),
            (200, &b"{\"ok\":true}"[..])
        );
        assert_eq!(edge.edge.control().counters().response_wait_timeouts, 2);
        edge.stop().await;
    })
    .await;
}

/// Polls `/status` until `node_id`'s provider shows `in_flight`.
async fn wait_in_flight(
    addr: std::net::SocketAddr,
    node_id: &str,
    in_flight: u64,
) -> serde_json::Value {
    for _ in 0..200 {
        let entry = node_entry(addr, node_id).await;
        if entry["in_flight"] == in_flight {
            return entry;
        }
        monoio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{node_id} never reached in_flight {in_flight}");
}

const BOTH: &str = "both-nodes";

fn both_nodes() -> EdgeOptions {
    EdgeOptions {
        extra_toml: format!(
            "[[models]]\nname = \"{BOTH}\"\nproviders = [\"node-a/a-mock\", \"node-b/b-mock\"]\n"
        ),
        ..EdgeOptions::without_provider()
    }
}

async fn send(node: &RawNode, frames: Vec<pb::ProviderTunnelFrame>) {
    for f in frames {
        node.conn
            .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(f))))
            .await
            .expect("send");
    }
}

/// A whole SSE answer for `run_id`: head, one body, end.
fn answer(run_id: &str, text: &str) -> Vec<pb::ProviderTunnelFrame> {
    let mut start = tunnel_frame(run_id, 1, pb::TunnelFrameKind::ResponseStart);
    start.status = 200;
    start.headers = vec![pb::Header {
        name: "content-type".into(),
        value: Bytes::from_static(b"text/event-stream"),
    }];
    let mut body = tunnel_frame(run_id, 2, pb::TunnelFrameKind::Body);
    body.body = Bytes::from(format!("data: {text}\n\ndata: [DONE]\n\n"));
    vec![
        start,
        body,
        tunnel_frame(run_id, 3, pb::TunnelFrameKind::End),
    ]
}

// A provider that fails before the first byte — refused connection, a 5xx
// head, a head then a stall — costs the client nothing: the request goes to
// the other node under a new run id, the client gets that answer (200,
// whole), and every lease is released.
#[monoio::test_all(timer_enabled = true)]
async fn failures_before_the_first_byte_are_served_by_the_other_provider() {
    let pki = Pki::mint("failover-before-first-byte");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &both_nodes()));
        let mut a = ready_node(&edge, &pki, "node-a").await;
        let mut b = ready_node(&edge, &pki, "node-b").await;
        let failures: Vec<fn(&str) -> Vec<pb::ProviderTunnelFrame>> = vec![
            |run_id| {
                let mut e = tunnel_frame(run_id, 1, pb::TunnelFrameKind::Error);
                e.error = "connect: connection refused".into();
                e.failure_code = "provider_unreachable".into();
                vec![e]
            },
            |run_id| {
                let mut start = tunnel_frame(run_id, 1, pb::TunnelFrameKind::ResponseStart);
                start.status = 503;
                let mut body = tunnel_frame(run_id, 2, pb::TunnelFrameKind::Body);
                body.body = Bytes::from_static(b"{\"error\":\"overloaded\"}");
                vec![
                    start,
                    body,
                    tunnel_frame(run_id, 3, pb::TunnelFrameKind::End),
                ]
            },
            |run_id| {
                let mut start = tunnel_frame(run_id, 1, pb::TunnelFrameKind::ResponseStart);
                start.status = 200;
                let mut stall = tunnel_frame(run_id, 2, pb::TunnelFrameKind::Error);
                stall.error = "no progress".into();
                stall.failure_code = "response_stalled".into();
                vec![start, stall]
            },
        ];
        for (i, fail) in failures.into_iter().enumerate() {
            let client_addr = edge.client_addr;
            let client =
                monoio::spawn(async move { post_chat(client_addr, &chat_body(BOTH, true)).await });
            // Ties go to the first listed provider: node-a.
            let first = next_tunnel(&mut a).await;
            send(&a, fail(&first.run_id)).await;
            let retry = next_tunnel(&mut b).await;
            assert_eq!(retry.run_id, format!("{}.2", first.run_id), "case {i}");
            send(&b, answer(&retry.run_id, "from-b")).await;
            let response = client.await;
            assert_eq!(response.status, 200, "case {i}: {response:?}");
            assert_eq!(
                String::from_utf8(response.body).unwrap(),
                "data: from-b\n\ndata: [DONE]\n\n",
                "case {i}"
            );
            wait_in_flight(edge.client_addr, "node-b", 0).await;
            assert_eq!(edge.edge.control().leases().count(), 0);
        }
        let c = edge.edge.control().counters().clone();
        assert_eq!((c.failover_retried, c.failover_recovered), (3, 3));
        edge.stop().await;
    })
    .await;
}

// After the first body byte nothing is retried: a stream that stalls after
// its first tokens ends with the error event, and the other node gets no
// request.
#[monoio::test_all(timer_enabled = true)]
async fn a_stall_after_the_first_byte_ends_the_stream_with_an_error() {
    let pki = Pki::mint("failover-after-first-byte");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &both_nodes()));
        let mut a = ready_node(&edge, &pki, "node-a").await;
        let _b = ready_node(&edge, &pki, "node-b").await;
        let client_addr = edge.client_addr;
        let client =
            monoio::spawn(async move { post_chat(client_addr, &chat_body(BOTH, true)).await });
        let request = next_tunnel(&mut a).await;
        let mut frames = answer(&request.run_id, "tok0 tok1 tok2");
        frames.pop(); // no END: a stall instead
        let mut stall = tunnel_frame(&request.run_id, 3, pb::TunnelFrameKind::Error);
        stall.error = "no progress".into();
        stall.failure_code = "response_stalled".into();
        frames.push(stall);
        send(&a, frames).await;
        let response = client.await;
        assert_eq!(response.status, 200);
        let body = String::from_utf8(response.body).unwrap();
        assert!(body.starts_with("data: tok0 tok1 tok2\n\n"), "{body}");
        assert!(body.contains("\"code\":\"response_stalled\""), "{body}");
        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        assert_eq!(edge.edge.control().leases().count(), 0);
        let c = edge.edge.control().counters().clone();
        assert_eq!((c.failover_retried, c.failover_ineligible), (0, 1));
        edge.stop().await;
    })
    .await;
}
