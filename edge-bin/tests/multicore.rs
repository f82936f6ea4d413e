//! The Edge on two shards, each on its own thread and monoio runtime, as
//! `edge-bin --cores 0-1` runs it: Control on shard 0, clients and nodes on
//! both. Each shard gets listeners of its own here so the test decides
//! which shard owns which socket: the node dials shard 1, clients call
//! shard 0 (every body frame crosses cores, every control input crosses
//! back) and shard 1 (the same-core path next to a remote Control).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::*;
use edge_bin::config::EdgeConfig;
use edge_bin::link::shards::bind_reuseport;
use edge_bin::server::{DrainEnd, ShardedEdge, Stop};
use iop_engine::mailbox;
use iop_engine::tls::{EdgeTlsAcceptor, NodeAllowList, TlsFiles, TlsMaterial};
use iop_wire::CloseReason;
use node_bin::config::NodeConfig;
use node_bin::supervisor;
use serde_json::Value;

fn chat_body(model: &str) -> String {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"say three words"}}],"stream":true,"stream_options":{{"include_usage":true}}}}"#
    )
}

/// The SSE events of a body without the per-response fields (`id`,
/// `created`, the mock's send stamp); `[DONE]` as a string.
fn events(body: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(body).expect("UTF-8 body");
    text.strip_suffix("\n\n")
        .unwrap_or_else(|| panic!("SSE body ends with a blank line: {text:?}"))
        .split("\n\n")
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("SSE event {event:?}"));
            if data == "[DONE]" {
                return Value::String(data.into());
            }
            let mut json: Value = serde_json::from_str(data).expect("event JSON");
            let object = json.as_object_mut().expect("event object");
            for volatile in ["id", "created", "iop_mock_sent_ns"] {
                object.remove(volatile);
            }
            json
        })
        .collect()
}

struct Shards {
    client: [SocketAddr; 2],
    node: [SocketAddr; 2],
    stop: mailbox::MailboxSender<()>,
    threads: Vec<std::thread::JoinHandle<std::io::Result<DrainEnd>>>,
}

fn start_two_shards(pki: &Pki, toml: &str) -> Shards {
    let cfg = EdgeConfig::parse(toml, pki.dir.join("edge.toml")).expect("edge config");
    let tls = cfg.tls.as_ref().expect("[tls]");
    let material = TlsMaterial::from_files(&TlsFiles {
        ca_path: tls.ca.clone(),
        cert_path: tls.cert.clone(),
        key_path: tls.key.clone(),
    })
    .expect("edge material");
    let allowed = NodeAllowList::new(cfg.nodes.iter().map(|n| n.id.clone()));
    let acceptor =
        EdgeTlsAcceptor::new(&material, &cfg.edge.trust_domain, allowed).expect("acceptor");
    let any: SocketAddr = "127.0.0.1:0".parse().expect("address");
    let mut listeners = Vec::new();
    for _ in 0..2 {
        let client = bind_reuseport(any, 1, "client").expect("bind").remove(0);
        let node = bind_reuseport(any, 1, "nodes").expect("bind").remove(0);
        listeners.push((client, node));
    }
    let addr = |l: &std::net::TcpListener| l.local_addr().expect("address");
    let client = [addr(&listeners[0].0), addr(&listeners[1].0)];
    let node = [addr(&listeners[0].1), addr(&listeners[1].1)];
    let edge = Arc::new(
        ShardedEdge::from_listeners(cfg, None, Some(acceptor), listeners).expect("shards"),
    );
    let (stop, stop_rx) = mailbox::mailbox::<()>(1);
    let stop_rx = Arc::new(std::sync::Mutex::new(Some(stop_rx)));
    let threads = (0..2)
        .map(|index| {
            let (edge, stop_rx) = (edge.clone(), stop_rx.clone());
            std::thread::spawn(move || {
                iop_engine::rt::block_on(async move {
                    let mut stop_rx = match index {
                        0 => stop_rx.lock().ok().and_then(|mut s| s.take()),
                        _ => None,
                    };
                    let stop = Stop {
                        shutdown: async move {
                            match stop_rx.as_mut() {
                                Some(rx) => {
                                    rx.recv().await;
                                }
                                None => std::future::pending().await,
                            }
                        },
                        force: std::future::pending(),
                        drain_grace: std::time::Duration::from_secs(5),
                    };
                    edge.serve_shard(index, stop).await.map(|end| end.drain)
                })?
            })
        })
        .collect();
    Shards {
        client,
        node,
        stop,
        threads,
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn two_shards_relay_byte_exact_streams_across_cores() {
    let pki = Pki::mint("two-shards");
    guarded(async {
        let mock = Mock::start(5);
        let shards = start_two_shards(&pki, &edge_toml(&pki, &EdgeOptions::new(mock.addr)));

        // The node dials shard 1.
        let node_cfg = NodeConfig::parse(
            &node_toml(&pki, "node-a", shards.node[1]),
            pki.dir.join("node.toml"),
        )
        .expect("node config");
        let (stop_node, node_stopped) = iop_engine::sync::oneshot::channel::<()>();
        let node = monoio::spawn(supervisor::run(
            node_cfg,
            Some(pki.connector("node-a")),
            Box::pin(async move {
                let _ = node_stopped.await;
            }),
        ));

        // Control (shard 0) saw it register and become ready on shard 1;
        // shard 1 reads the same state by asking shard 0.
        assert_eq!(
            wait_connected(shards.client[0], "node-a", true).await,
            ready_entry("node-a", "a-mock", 0)
        );
        assert_eq!(
            node_entry(shards.client[1], "node-a").await,
            ready_entry("node-a", "a-mock", 0)
        );

        let direct = post_chat(mock.addr, &chat_body(TARGET)).await;
        assert_eq!(direct.status, 200);
        let expected = events(&direct.body);
        assert_eq!(
            expected.len(),
            1 + 5 + 3,
            "role, 5 tokens, finish, usage, [DONE]"
        );

        // Cross-core (client on shard 0) and same-core (shard 1) streams,
        // several at once on each.
        let mut calls = Vec::new();
        for round in 0..8 {
            let addr = shards.client[round % 2];
            calls.push(monoio::spawn(async move {
                (addr, post_chat(addr, &chat_body(MODEL)).await)
            }));
        }
        for call in calls {
            let (addr, relayed) = call.await;
            assert_eq!(relayed.status, 200, "via {addr}: {relayed:?}");
            assert_eq!(relayed.header("content-type"), Some("text/event-stream"));
            assert_eq!(events(&relayed.body), expected, "via {addr}");
        }

        // Every lease came back: the same state read from both shards.
        for addr in shards.client {
            assert_eq!(
                node_entry(addr, "node-a").await,
                ready_entry("node-a", "a-mock", 0)
            );
        }

        // An operator command asked on shard 0 goes to the node's
        // connection on shard 1 and its answer comes back to shard 0.
        let answer = http_request(
            shards.client[0],
            "POST",
            "/admin/nodes/node-a/commands",
            br#"{"type":"capabilities"}"#,
        )
        .await;
        assert_eq!(answer.status, 200, "{answer:?}");
        let answer = answer.json();
        assert_eq!(answer["ok"], true, "{answer}");
        assert!(
            answer["command_id"]
                .as_str()
                .is_some_and(|id| id.starts_with("admin-0-")),
            "the command id names the asking shard: {answer}"
        );
        assert_eq!(answer["capabilities"][0]["target"], TARGET, "{answer}");

        // Shutdown: the control shard drains and takes shard 1 with it.
        let _ = stop_node.send(());
        assert_eq!(node.await, supervisor::Exit::Shutdown);
        shards.stop.try_send(()).expect("stop signal");
        for thread in shards.threads {
            let end = thread.join().expect("shard thread").expect("shard runtime");
            assert_eq!(end, DrainEnd::Finished);
        }
        mock.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_client_leaving_on_one_shard_cancels_the_run_on_the_other() {
    // CONTRACT: U6
    use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
    let pki = Pki::mint("two-shards-cancel");
    guarded(async {
        // 500 tokens 20 ms apart: the stream would run ten seconds.
        let mock = Mock::start_paced(500, 20);
        let shards = start_two_shards(&pki, &edge_toml(&pki, &EdgeOptions::new(mock.addr)));
        let node_cfg = NodeConfig::parse(
            &node_toml(&pki, "node-a", shards.node[1]),
            pki.dir.join("node.toml"),
        )
        .expect("node config");
        let (stop_node, node_stopped) = iop_engine::sync::oneshot::channel::<()>();
        let node = monoio::spawn(supervisor::run(
            node_cfg,
            Some(pki.connector("node-a")),
            Box::pin(async move {
                let _ = node_stopped.await;
            }),
        ));
        wait_connected(shards.client[0], "node-a", true).await;

        // A stream from a client on shard 0 to the node on shard 1, read
        // until the first token, then the client leaves.
        let body = chat_body(MODEL);
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut tcp = monoio::net::TcpStream::connect(shards.client[0])
            .await
            .expect("connect");
        let (res, _) = tcp.write_all(request.into_bytes()).await;
        res.expect("send request");
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"tok0") {
            let (res, buf) = tcp.read(Vec::with_capacity(4096)).await;
            assert!(res.expect("read") > 0, "stream ended early: {seen:?}");
            seen.extend_from_slice(&buf);
        }
        assert_eq!(
            node_entry(shards.client[1], "node-a").await,
            ready_entry("node-a", "a-mock", 1),
            "the run holds its lease while streaming"
        );
        drop(tcp);

        // U6 across cores: shard 0 tells Control, Control has shard 1 send
        // the CancelRequest, the node's terminal comes back on shard 1 and
        // the lease is released. Poll /status (no time bound asserted).
        let mut entry = node_entry(shards.client[0], "node-a").await;
        for _ in 0..500 {
            if entry == ready_entry("node-a", "a-mock", 0) {
                break;
            }
            monoio::time::sleep(std::time::Duration::from_millis(10)).await;
            entry = node_entry(shards.client[0], "node-a").await;
        }
        assert_eq!(entry, ready_entry("node-a", "a-mock", 0));

        let _ = stop_node.send(());
        assert_eq!(node.await, supervisor::Exit::Shutdown);
        shards.stop.try_send(()).expect("stop signal");
        for thread in shards.threads {
            let end = thread.join().expect("shard thread").expect("shard runtime");
            assert_eq!(end, DrainEnd::Finished);
        }
        mock.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_superseded_node_connection_on_another_shard_never_reaches_the_client_again() {
    // CONTRACT: R2, F1
    use bytes::Bytes;
    use iop_wire::pb;
    use iop_wire::pb::frame::Body;
    let pki = Pki::mint("two-shards-superseded");
    guarded(async {
        let shards = start_two_shards(&pki, &edge_toml(&pki, &EdgeOptions::without_provider()));
        // The first connection of node-a lands on shard 1.
        let mut first = RawNode::connect(shards.node[1], &pki.connector("node-a")).await;
        assert!(first.register("node-a").await.accepted);
        assert_eq!(first.ready("node-a").await, ready_accepted());
        wait_connected(shards.client[0], "node-a", true).await;

        // A client on shard 0 is being served over it.
        let client_addr = shards.client[0];
        let client = monoio::spawn(async move { post_chat(client_addr, &chat_body(MODEL)).await });
        let run_id = match first.next_frame().await {
            Body::ProviderTunnelRequest(r) => r.run_id,
            other => panic!("expected ProviderTunnelRequest, got {other:?}"),
        };
        let tunnel = |seq: u64, kind: pb::TunnelFrameKind, body: &'static [u8]| {
            frame(Body::ProviderTunnelFrame(Box::new(
                pb::ProviderTunnelFrame {
                    run_id: run_id.clone(),
                    seq,
                    kind: kind as i32,
                    adapter: ADAPTER.into(),
                    target: TARGET.into(),
                    status: if seq == 1 { 200 } else { 0 },
                    headers: if seq == 1 {
                        vec![pb::Header {
                            name: "content-type".into(),
                            value: Bytes::from_static(b"text/event-stream"),
                        }]
                    } else {
                        Vec::new()
                    },
                    body: Bytes::from_static(body),
                    ..Default::default()
                },
            )))
        };
        for f in [
            tunnel(1, pb::TunnelFrameKind::ResponseStart, b""),
            tunnel(2, pb::TunnelFrameKind::Body, b"data: {\"n\":1}\n\n"),
        ] {
            first.conn.send_bulk(f).await.expect("send tunnel frame");
        }
        // Wait until the first body chunk is in flight to the client: the
        // lease is held.
        assert_eq!(
            node_entry(shards.client[0], "node-a").await,
            ready_entry("node-a", "a-mock", 1)
        );

        // node-a connects again, to shard 0: Control fences the first
        // connection (R2) on shard 1 and the client's lease is lost (F1).
        let mut second = RawNode::connect(shards.node[0], &pki.connector("node-a")).await;
        assert!(second.register("node-a").await.accepted);
        assert_eq!(
            first.closed_reason().await,
            CloseReason::Peer("superseded".into())
        );
        // Whatever the old connection still manages to send is never
        // relayed.
        let _ = first
            .conn
            .send_bulk(tunnel(3, pb::TunnelFrameKind::Body, b"data: stale\n\n"))
            .await;
        let _ = first
            .conn
            .send_bulk(tunnel(4, pb::TunnelFrameKind::End, b""))
            .await;

        let response = client.await;
        assert_eq!(response.status, 200);
        let body = String::from_utf8(response.body).expect("UTF-8 body");
        assert!(body.starts_with("data: {\"n\":1}\n\n"), "{body}");
        assert!(body.contains("node_disconnected"), "{body}");
        assert!(!body.contains("stale"), "{body}");
        assert_eq!(
            node_entry(shards.client[1], "node-a").await,
            offline_entry("node-a", "a-mock")
        );

        shards.stop.try_send(()).expect("stop signal");
        for thread in shards.threads {
            let end = thread.join().expect("shard thread").expect("shard runtime");
            assert_eq!(end, DrainEnd::Finished);
        }
        drop(second);
    })
    .await;
}
