//! Heartbeat timeout at the Edge level (T4, F1), in a test binary of its
//! own: the Edge takes its transport timers from the test-only environment
//! override `IOP_TEST_HEARTBEAT_MS`, which is process-wide, so no other test
//! may share this process.

mod common;

use bytes::BytesMut;
use common::*;
use iop_engine::conn::HEARTBEAT_OVERRIDE_ENV;
use iop_engine::tls::ClientTls;
use iop_wire::pb::frame::Body;
use iop_wire::{codec, pb, FrameDecoder};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

/// Edge heartbeat interval and timeout for this test: `<interval>:<timeout>`
/// in milliseconds. The timeout leaves room for a loaded machine while the
/// node still answers.
const HEARTBEAT_MS: &str = "50:2000";

/// A node speaking frames by hand over its TLS stream, with no frame
/// connection: it answers heartbeats only while the test lets it.
struct HandNode {
    tls: ClientTls,
    decoder: FrameDecoder,
}

impl HandNode {
    /// Dials the Edge as node-a.
    async fn connect(pki: &Pki, addr: std::net::SocketAddr) -> Self {
        let tcp = TcpStream::connect(addr).await.expect("dial");
        let tls = pki
            .connector("node-a")
            .connect(tcp)
            .await
            .expect("TLS handshake");
        Self {
            tls,
            decoder: FrameDecoder::new(),
        }
    }

    /// Registers as node-a and becomes ready, answering heartbeats.
    async fn register_and_ready(&mut self) {
        self.send(Body::RegisterRequest(pb::RegisterRequest {
            node_id: "node-a".into(),
            node_version: "test".into(),
            ..Default::default()
        }))
        .await;
        match self.next_frame(true).await {
            Some(Body::RegisterResponse(r)) => assert!(r.accepted, "{r:?}"),
            other => panic!("expected RegisterResponse, got {other:?}"),
        }
        self.send(Body::NodeReadyRequest(pb::NodeReadyRequest {
            node_id: "node-a".into(),
        }))
        .await;
        match self.next_frame(true).await {
            Some(Body::NodeReadyResponse(r)) => assert!(r.ready, "{r:?}"),
            other => panic!("expected NodeReadyResponse, got {other:?}"),
        }
    }

    async fn send(&mut self, body: Body) {
        let mut wire = BytesMut::new();
        codec::encode(&frame(body), &mut wire).expect("encode");
        let (res, _) = self.tls.write_all(wire.to_vec()).await;
        res.expect("write frame");
        self.tls.flush().await.expect("flush");
    }

    /// The next frame other than a heartbeat, answering heartbeats when
    /// `ack` is set; `None` at the end of the stream.
    async fn next_frame(&mut self, ack: bool) -> Option<Body> {
        loop {
            while let Some(f) = self.decoder.decode().expect("frames from the edge decode") {
                match f.body.expect("decoder yields frames with a body") {
                    Body::Heartbeat(hb) => {
                        if ack {
                            self.send(Body::HeartbeatAck(pb::HeartbeatAck { seq: hb.seq }))
                                .await;
                        }
                    }
                    other => return Some(other),
                }
            }
            let (res, buf) = self.tls.read(Vec::with_capacity(16 * 1024)).await;
            match res {
                Ok(0) | Err(_) => return None,
                Ok(_) => self.decoder.feed(&buf),
            }
        }
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn heartbeat_timeout_fences_the_node() {
    // CONTRACT: T4, F1
    // This binary holds only this test (once per driver); both runs set the
    // same value, and only `std::env` reads it.
    std::env::set_var(HEARTBEAT_OVERRIDE_ENV, HEARTBEAT_MS);
    let pki = Pki::mint("heartbeat-timeout");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &EdgeOptions::without_provider()));
        let mut node = HandNode::connect(&pki, edge.node_addr).await;
        node.register_and_ready().await;

        // A request takes a lease on the node.
        let client_addr = edge.client_addr;
        let client = monoio::spawn(async move {
            let body = format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"stream":true}}"#
            );
            post_chat(client_addr, &body).await
        });
        match node.next_frame(true).await {
            Some(Body::ProviderTunnelRequest(r)) => assert_eq!(r.run_id, "run-1"),
            other => panic!("expected ProviderTunnelRequest, got {other:?}"),
        }
        assert_eq!(edge.edge.control().leases().count(), 1);
        assert_eq!(
            provider_entry(&status(edge.client_addr).await, "node-a"),
            ready_entry("node-a", "a-mock", 1)
        );

        // Stop answering heartbeats: the Edge closes with the reason, and
        // nothing else arrives before the close.
        match node.next_frame(false).await {
            Some(Body::Close(c)) => assert_eq!(c.reason, "heartbeat_timeout"),
            other => panic!("expected Close, got {other:?}"),
        }
        assert_eq!(node.next_frame(false).await, None);

        // F1: the fence released the lease; the waiting client is told.
        let response = client.await;
        assert_eq!(response.status, 502);
        assert_eq!(
            response.json(),
            api_error(
                "the node serving this request disconnected",
                "upstream_error",
                None,
                Some("node_disconnected"),
            )
        );
        assert_eq!(edge.edge.control().leases().count(), 0);
        assert_eq!(edge.edge.node_conn_count(), 0);
        assert_eq!(
            provider_entry(&status(edge.client_addr).await, "node-a"),
            offline_entry("node-a", "a-mock")
        );

        // F1, F3: the node's next generation starts with its configured
        // capacity and no leftover lease of the fenced one.
        let mut node = HandNode::connect(&pki, edge.node_addr).await;
        node.register_and_ready().await;
        assert_eq!(
            provider_entry(&status(edge.client_addr).await, "node-a"),
            ready_entry("node-a", "a-mock", 0)
        );
        edge.stop().await;
    })
    .await;
}
