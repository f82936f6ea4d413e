//! In-process integration tests of the walking skeleton: client HTTP →
//! Edge → mTLS frame connection → Node → mock provider, over real loopback
//! sockets on one monoio runtime per test.
//!
//! The Edge is `edge_bin::server::serve` wired as the binary wires it; the
//! Node is either the real `node_bin::supervisor::run` (with the in-process
//! `bench` mock provider behind it) or a raw node driven frame by frame by
//! the test, to probe the registration and readiness rules. The heartbeat
//! test lives in `heartbeat.rs`: it shortens the transport timers through a
//! process-wide environment variable, so it needs a process of its own.

mod common;

use bytes::Bytes;
use common::*;
use edge_bin::control::ConnId;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use node_bin::config::NodeConfig;
use node_bin::supervisor::{self, Exit};
use rustls::pki_types::ServerName;
use serde_json::Value;

/// The stream request every tunnel test sends (usage chunk included).
fn chat_body(model: &str) -> String {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"say three words"}}],"stream":true,"stream_options":{{"include_usage":true}}}}"#
    )
}

/// Splits an SSE body into its `data:` payloads: JSON events without the
/// volatile fields (`id`, `created`, `iop_mock_sent_ns`), and `[DONE]` as a
/// string. Every event must be exactly `data: <payload>\n\n`.
fn normalized_events(body: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(body).expect("SSE body is UTF-8");
    let trimmed = text
        .strip_suffix("\n\n")
        .unwrap_or_else(|| panic!("SSE body ends with a blank line: {text:?}"));
    trimmed
        .split("\n\n")
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("SSE event {event:?}"));
            if data == "[DONE]" {
                return Value::String(data.to_string());
            }
            let mut json: Value = serde_json::from_str(data).expect("SSE event JSON");
            let object = json.as_object_mut().expect("SSE event is an object");
            for volatile in ["id", "created", "iop_mock_sent_ns"] {
                object.remove(volatile);
            }
            json
        })
        .collect()
}

/// The `id` of every JSON event in an SSE body.
fn event_ids(body: &[u8]) -> Vec<String> {
    std::str::from_utf8(body)
        .expect("UTF-8")
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| {
            let json: Value = serde_json::from_str(d).expect("JSON");
            json["id"].as_str().expect("id").to_string()
        })
        .collect()
}

#[monoio::test_all(timer_enabled = true)]
async fn register_ready_and_one_tunnel_stream() {
    // CONTRACT: U1, U2, U5, E2
    // CONTRACT: R3
    let pki = Pki::mint("tunnel-stream");
    guarded(async {
        let mock = Mock::start(3);
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &EdgeOptions::new(mock.addr)));
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            offline_entry("node-a", "a-mock")
        );

        let node_cfg = NodeConfig::parse(
            &node_toml(&pki, "node-a", edge.node_addr),
            pki.dir.join("node.toml"),
        )
        .expect("node config");
        node_cfg.validate_files().expect("node TLS files");
        let connector = pki.connector("node-a");
        assert_eq!(connector.local_identity().name(), node_cfg.node_id);
        let (stop_node, node_stopped) = iop_engine::sync::oneshot::channel::<()>();
        let node = monoio::spawn(supervisor::run(
            node_cfg,
            Some(connector),
            Box::pin(async move {
                let _ = node_stopped.await;
            }),
        ));

        // R3: the node applies its config and says ready; only then is it
        // reported connected, with its configured capacity.
        assert_eq!(
            wait_connected(edge.client_addr, "node-a", true).await,
            ready_entry("node-a", "a-mock", 0)
        );

        let relayed = post_chat(edge.client_addr, &chat_body(MODEL)).await;
        assert_eq!(relayed.status, 200, "{relayed:?}");
        assert!(relayed.chunked);
        assert_eq!(relayed.header("content-type"), Some("text/event-stream"));
        assert_eq!(relayed.header("cache-control"), Some("no-cache"));

        // The same request straight to the provider, as the Edge built it
        // (U5: the served target in `model`).
        let direct = post_chat(mock.addr, &chat_body(TARGET)).await;
        assert_eq!(direct.status, 200, "{direct:?}");

        // U1, U2: the provider's body bytes arrive unchanged; only the
        // per-completion fields differ between two provider calls.
        let relayed_events = normalized_events(&relayed.body);
        assert_eq!(relayed_events, normalized_events(&direct.body));
        // Role, three tokens, finish, usage, [DONE].
        assert_eq!(relayed_events.len(), 7);
        assert_eq!(relayed_events[1]["choices"][0]["delta"]["content"], "tok0 ");
        assert_eq!(relayed_events[6], "[DONE]");
        // Exactly one provider call went through the relay, before ours.
        assert_eq!(event_ids(&relayed.body), vec!["chatcmpl-mock-1"; 6]);
        assert_eq!(event_ids(&direct.body), vec!["chatcmpl-mock-2"; 6]);
        // U5, E2: the provider saw the target, never the external model.
        for event in &relayed_events[..6] {
            assert_eq!(event["model"], TARGET, "{event}");
        }

        // The END terminal released the lease.
        assert_eq!(edge.edge.control().leases().count(), 0);
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            ready_entry("node-a", "a-mock", 0)
        );

        let _ = stop_node.send(());
        assert_eq!(node.await, Exit::Shutdown);
        edge.stop().await;
        mock.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn no_dispatch_before_ready() {
    // CONTRACT: R4
    let pki = Pki::mint("no-dispatch-before-ready");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        let registered = node.register("node-a").await;
        assert!(registered.accepted, "{registered:?}");
        assert_eq!(registered.reason, "");
        assert!(registered.config.is_some());

        // Pending: not a candidate, not connected. The request waits in the
        // model's queue (no candidate is ready) and times out.
        let refused = post_chat(edge.client_addr, &chat_body(MODEL)).await;
        assert_eq!(refused.status, 503);
        assert_eq!(refused.header("retry-after"), Some("1"));
        assert_eq!(
            refused.json(),
            api_error(
                "No provider for model `chat-model` is available right now; retry shortly.",
                "service_unavailable_error",
                None,
                Some("no_provider_available"),
            )
        );
        assert_eq!(edge.edge.control().leases().count(), 0);
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            offline_entry("node-a", "a-mock")
        );

        // Ready: the next frame on the connection is the ready answer — no
        // tunnel request was sent while pending.
        assert_eq!(node.ready("node-a").await, ready_accepted());
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            ready_entry("node-a", "a-mock", 0)
        );

        let client_addr = edge.client_addr;
        let client = monoio::spawn(async move { post_chat(client_addr, &chat_body(MODEL)).await });
        let request = match node.next_frame().await {
            Body::ProviderTunnelRequest(r) => *r,
            other => panic!("expected ProviderTunnelRequest, got {other:?}"),
        };
        // The second request of this Edge (the first was refused above).
        assert_eq!(
            request,
            pb::ProviderTunnelRequest {
                run_id: "run-2".into(),
                adapter: ADAPTER.into(),
                target: TARGET.into(),
                method: "POST".into(),
                path: "/v1/chat/completions".into(),
                headers: vec![
                    pb::Header {
                        name: "content-type".into(),
                        value: Bytes::from_static(b"application/json"),
                    },
                    pb::Header {
                        name: "accept".into(),
                        value: Bytes::from_static(b"text/event-stream"),
                    },
                ],
                body: Bytes::from(chat_body(TARGET)),
                stream: true,
                response_stall_timeout_ms: STALL_TIMEOUT_MS,
                operation: "chat_completions".into(),
                // The request id the Edge minted (the client sent none).
                correlation_id: request.correlation_id.clone(),
                ..Default::default()
            }
        );
        assert!(
            request.correlation_id.starts_with("req_") && request.correlation_id.len() == 36,
            "{}",
            request.correlation_id
        );
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            ready_entry("node-a", "a-mock", 1)
        );

        // Answer by hand; the client gets exactly these bytes.
        let tunnel = |seq: u64, kind: pb::TunnelFrameKind| pb::ProviderTunnelFrame {
            run_id: "run-2".into(),
            seq,
            kind: kind as i32,
            adapter: ADAPTER.into(),
            target: TARGET.into(),
            ..Default::default()
        };
        let frames = [
            pb::ProviderTunnelFrame {
                status: 200,
                headers: vec![
                    pb::Header {
                        name: "content-type".into(),
                        value: Bytes::from_static(b"text/event-stream"),
                    },
                    pb::Header {
                        name: "x-provider".into(),
                        value: Bytes::from_static(b"by-hand"),
                    },
                ],
                ..tunnel(1, pb::TunnelFrameKind::ResponseStart)
            },
            pb::ProviderTunnelFrame {
                body: Bytes::from_static(b"data: {\"n\":1}\n\n"),
                ..tunnel(2, pb::TunnelFrameKind::Body)
            },
            pb::ProviderTunnelFrame {
                body: Bytes::from_static(b"data: [DONE]\n\n"),
                ..tunnel(3, pb::TunnelFrameKind::Body)
            },
            tunnel(4, pb::TunnelFrameKind::End),
        ];
        for f in frames {
            node.conn
                .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(f))))
                .await
                .expect("send tunnel frame");
        }
        let response = client.await;
        assert_eq!(response.status, 200);
        assert!(response.chunked);
        assert_eq!(response.header("content-type"), Some("text/event-stream"));
        assert_eq!(response.header("x-provider"), Some("by-hand"));
        // The client learns the id the node's log lines carry.
        assert_eq!(
            response.header("x-request-id"),
            Some(request.correlation_id.as_str())
        );
        assert_eq!(response.body, b"data: {\"n\":1}\n\ndata: [DONE]\n\n");
        assert_eq!(edge.edge.control().leases().count(), 0);

        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn register_with_a_name_other_than_the_certificate_is_rejected() {
    // CONTRACT: T3
    let pki = Pki::mint("register-other-name");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let before = status(edge.client_addr).await;
        // The certificate says node-a; node-b is configured too.
        let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        assert_eq!(
            node.register("node-b").await,
            pb::RegisterResponse {
                accepted: false,
                reason: "node id `node-b` does not match the TLS identity name `node-a`".into(),
                config: None,
                accepts_node_draining: false,
            }
        );
        assert_eq!(
            node.closed_reason().await,
            CloseReason::Peer("registration_rejected".into())
        );
        assert_eq!(edge.edge.control().node_of(ConnId(1)), None);
        assert_eq!(status(edge.client_addr).await, before);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn second_node_id_on_one_connection_is_rejected() {
    // CONTRACT: R1
    let pki = Pki::mint("second-node-id");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        assert!(node.register("node-a").await.accepted);
        assert_eq!(
            node.register("node-b").await,
            pb::RegisterResponse {
                accepted: false,
                reason:
                    "connection already registered as node `node-a`; one node id per connection"
                        .into(),
                config: None,
                accepts_node_draining: false,
            }
        );
        // The first binding stands: same connection, still the pending
        // owner, so its ready is accepted.
        assert_eq!(edge.edge.control().node_of(ConnId(1)), Some("node-a"));
        assert_eq!(node.ready("node-a").await, ready_accepted());
        assert!(edge.edge.control().is_ready_owner(ConnId(1)));
        let status = status(edge.client_addr).await;
        assert_eq!(
            provider_entry(&status, "node-a"),
            ready_entry("node-a", "a-mock", 0)
        );
        assert_eq!(
            provider_entry(&status, "node-b"),
            offline_entry("node-b", "b-mock")
        );
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn newer_registration_supersedes_older_connection() {
    // CONTRACT: R2
    let pki = Pki::mint("supersede");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let connector = pki.connector("node-a");
        let mut first = RawNode::connect(edge.node_addr, &connector).await;
        assert!(first.register("node-a").await.accepted);
        assert!(first.ready("node-a").await.ready);
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            ready_entry("node-a", "a-mock", 0)
        );

        let mut second = RawNode::connect(edge.node_addr, &connector).await;
        let accepted = second.register("node-a").await;
        assert!(accepted.accepted, "{accepted:?}");
        assert!(accepted.config.is_some());
        // The older connection is fenced and closed with the reason.
        assert_eq!(
            first.closed_reason().await,
            CloseReason::Peer("superseded".into())
        );
        // The newer one is only pending: not connected yet (R4).
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            offline_entry("node-a", "a-mock")
        );
        assert_eq!(edge.edge.control().node_of(ConnId(2)), Some("node-a"));
        assert!(!edge.edge.control().is_ready_owner(ConnId(1)));

        assert_eq!(second.ready("node-a").await, ready_accepted());
        assert!(edge.edge.control().is_ready_owner(ConnId(2)));
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            ready_entry("node-a", "a-mock", 0)
        );
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn tls_rejections_happen_before_any_frame() {
    // CONTRACT: T2
    let pki = Pki::mint("tls-rejections");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let before = status(edge.client_addr).await;

        // A node certificate from another CA (the node trusts the real CA,
        // so it accepts the Edge; the Edge must refuse it).
        let foreign = Pki::mint("tls-rejections-foreign-ca");
        let forged_files = foreign.node_files("node-a");
        let forged = iop_engine::tls::TlsMaterial::from_pem(
            &std::fs::read(&pki.files.ca_cert).expect("real CA"),
            &std::fs::read(&forged_files.cert_path).expect("forged cert"),
            &std::fs::read(&forged_files.key_path).expect("forged key"),
        )
        .expect("forged material");
        let forged = iop_engine::tls::NodeTlsConnector::new(&forged, TRUST_DOMAIN, EDGE_NAME)
            .expect("forged connector");
        let tcp = monoio::net::TcpStream::connect(edge.node_addr)
            .await
            .expect("dial");
        let mut stream = forged
            .connect(tcp)
            .await
            .expect("TLS 1.3: the client finishes before the Edge judges it");
        assert_eq!(
            first_read_error(&mut stream).await,
            Some(rustls::Error::AlertReceived(
                rustls::AlertDescription::DecryptError
            ))
        );

        // A certificate of role edge (the Edge's own) presented as a client.
        let edge_files = pki.files.edge_tls_files();
        let client = raw_tls_client(&edge_files.cert_path, &edge_files.key_path);
        let tcp = monoio::net::TcpStream::connect(edge.node_addr)
            .await
            .expect("dial");
        let mut stream = client
            .connect(ServerName::try_from("edge.test").expect("name"), tcp)
            .await
            .expect("TLS 1.3: the client finishes before the Edge judges it");
        assert_eq!(
            first_read_error(&mut stream).await,
            Some(rustls::Error::AlertReceived(
                rustls::AlertDescription::AccessDenied
            ))
        );

        // A node the Edge is not configured to expect.
        let tcp = monoio::net::TcpStream::connect(edge.node_addr)
            .await
            .expect("dial");
        let mut stream = pki
            .connector("node-c")
            .connect(tcp)
            .await
            .expect("TLS 1.3: the client finishes before the Edge judges it");
        assert_eq!(
            first_read_error(&mut stream).await,
            Some(rustls::Error::AlertReceived(
                rustls::AlertDescription::AccessDenied
            ))
        );

        // None of them reached the frame layer: no connection was given an
        // id, no registry entry changed, and the next valid node is the
        // Edge's first connection.
        assert_eq!(edge.edge.node_conn_count(), 0);
        assert_eq!(status(edge.client_addr).await, before);
        let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        assert!(node.register("node-a").await.accepted);
        assert_eq!(edge.edge.control().node_of(ConnId(1)), Some("node-a"));
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn client_errors_have_openai_shape() {
    let pki = Pki::mint("client-errors");
    guarded(async {
        let options = EdgeOptions {
            max_request_body_bytes: Some(1024),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));

        let malformed = post_chat(edge.client_addr, "{not json").await;
        assert_eq!(malformed.status, 400);
        assert_eq!(malformed.header("content-type"), Some("application/json"));
        assert_eq!(
            malformed.json(),
            api_error(
                "The request body is not valid JSON: key must be a string at line 1 column 2",
                "invalid_request_error",
                None,
                None,
            )
        );

        let unknown = post_chat(edge.client_addr, &chat_body("no-such-model")).await;
        assert_eq!(unknown.status, 404);
        assert_eq!(unknown.header("content-type"), Some("application/json"));
        assert_eq!(
            unknown.json(),
            api_error(
                "The model `no-such-model` does not exist or you do not have access to it.",
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            )
        );

        // Refused on the declared length, before any body byte is read.
        let too_large = http_exchange(
            edge.client_addr,
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\n\
              content-type: application/json\r\ncontent-length: 1025\r\n\r\n"
                .to_vec(),
        )
        .await;
        assert_eq!(too_large.status, 413);
        assert_eq!(too_large.header("content-type"), Some("application/json"));
        assert_eq!(
            too_large.json(),
            api_error(
                "Request body exceeds the limit of 1024 bytes.",
                "invalid_request_error",
                None,
                Some("request_too_large"),
            )
        );
        edge.stop().await;
    })
    .await;
}
