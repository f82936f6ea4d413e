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

/// A hand-driven node registered and ready as `node_id`.
async fn ready_node(edge: &TestEdge, pki: &Pki, node_id: &str) -> RawNode {
    let mut node = RawNode::connect(edge.node_addr, &pki.connector(node_id)).await;
    assert!(node.register(node_id).await.accepted);
    assert_eq!(node.ready(node_id).await, ready_accepted());
    node
}

async fn next_tunnel(node: &mut RawNode) -> pb::ProviderTunnelRequest {
    match node.next_frame().await {
        Body::ProviderTunnelRequest(r) => r,
        other => panic!("expected ProviderTunnelRequest, got {other:?}"),
    }
}

fn tunnel_frame(run_id: &str, seq: u64, kind: pb::TunnelFrameKind) -> pb::ProviderTunnelFrame {
    pb::ProviderTunnelFrame {
        run_id: run_id.into(),
        seq,
        kind: kind as i32,
        adapter: ADAPTER.into(),
        target: TARGET.into(),
        ..Default::default()
    }
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
                .send_bulk(frame(Body::ProviderTunnelFrame(end)))
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
            .send_bulk(frame(Body::ProviderTunnelFrame(start)))
            .await
            .expect("send the start");
        monoio::time::sleep(std::time::Duration::from_millis(600)).await;
        let mut body = tunnel_frame(&request.run_id, 2, pb::TunnelFrameKind::Body);
        body.body = Bytes::from_static(b"{\"ok\":true}");
        let end = tunnel_frame(&request.run_id, 3, pb::TunnelFrameKind::End);
        for f in [body, end] {
            node.conn
                .send_bulk(frame(Body::ProviderTunnelFrame(f)))
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
