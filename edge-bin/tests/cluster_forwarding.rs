//! Forwarding between the Edges of a cluster, every part a real process on
//! loopback: one `etcd`, two `edge-bin`s sharing it (`edge-1` = A,
//! `edge-2` = B, each with a peer listener), one `bench mock-provider`,
//! and two `node-bin`s: `node-a` (serving `model-a`) connected to B only,
//! `node-b` (serving `model-b`) connected to A only. Both Edges have the
//! same fleet and the same client key.
//!
//! - a chat completion for `model-a` sent to A is answered through B with
//!   the bytes B gives for the same request, streamed and not, with usage;
//!   the caller's rate limit is charged at A only;
//! - a request that arrives on B's peer listener is served by B, never
//!   forwarded again, and logged `peer=edge-1`;
//! - B's peer listener refuses a client without a certificate and one with
//!   a node certificate during the handshake;
//! - a client leaving a forwarded stream at A makes B cancel the run;
//! - with B gone, A answers 503 `peer_unavailable`.
//!
//! The processes are the cluster harness (`common/cluster.rs`). Build the
//! binaries first: `cargo build -p edge-bin -p node-bin -p bench --bins`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use iop_engine::clock;
use serde_json::json;

#[path = "common/cluster.rs"]
mod cluster;
use cluster::*;

/// `node-a` connects to B, `node-b` to A.
const NODES: &[(&str, &str)] = &[("node-a", "edge-2"), ("node-b", "edge-1")];

/// A cluster of this file's fleet; the team key has 8 requests a minute.
fn start(label: &str, mock_args: &[&str]) -> Cluster {
    Cluster::start(Setup {
        label,
        mock_args,
        fleet,
        nodes: NODES,
        team_limits: "requests_per_minute = 8\n",
    })
}

/// Both nodes and both models, the same on every Edge.
fn fleet(mock: SocketAddr) -> String {
    let mut text = String::new();
    for node in ["node-a", "node-b"] {
        text.push_str(&format!(
            "[[nodes]]\nid = \"{node}\"\n\
             [[nodes.adapters]]\nname = \"mock\"\nkind = \"openai_compat\"\n\
             profile = \"openai\"\nbase_url = \"http://{mock}\"\ncapacity = 4\n\
             [[nodes.providers]]\nid = \"mock\"\nadapter = \"mock\"\ntarget = \"mock-model\"\n\
             capacity = 4\n\n"
        ));
    }
    text.push_str(
        "[[models]]\nname = \"model-a\"\nproviders = [\"node-a/mock\"]\nqueue_timeout_ms = 1000\n\n\
         [[models]]\nname = \"model-b\"\nproviders = [\"node-b/mock\"]\nqueue_timeout_ms = 1000\n",
    );
    text
}

// (a) A request for `model-a` (its node owned by B) sent to A is forwarded
// to B: A's client gets exactly the bytes B gives a client of its own for
// the same request (masked: the mock numbers its completions and stamps its send time),
// with usage, streamed and not. The rate limit (4 a minute) is charged at
// A only: after A forwarded two requests, B still lets three of its own
// clients' requests through. (e) A request arriving on B's peer listener
// (as A would send it, with A's certificate) for `model-b`, whose node A
// owns, is not forwarded back: it waits in B's queue and gets B's 503,
// while the same request to B's client listener is forwarded to A and
// answered; B's access log marks the peer's request `peer=edge-1`.
#[test]
fn a_forwarded_request_is_answered_byte_exact_and_never_forwarded_twice() {
    let cluster = start("exact", &["--tokens", "3"]);
    let (a, b) = (&cluster.a, &cluster.b);

    let via_a = cluster.chat(a, "model-a", false);
    let via_a_stream = cluster.chat(a, "model-a", true);
    let at_b = cluster.chat(b, "model-a", false);
    let at_b_stream = cluster.chat(b, "model-a", true);
    assert_eq!(via_a.status, 200, "{}", via_a.text());
    assert_eq!(at_b.status, 200, "{}", at_b.text());
    assert_eq!(masked(&via_a.body), masked(&at_b.body));
    assert_ne!(masked(&via_a.body), via_a.body, "the mask found its fields");
    assert_eq!(via_a.json()["usage"]["completion_tokens"], 3);
    assert_eq!(via_a_stream.status, 200, "{}", via_a_stream.text());
    assert_eq!(masked(&via_a_stream.body), masked(&at_b_stream.body));
    assert!(
        via_a_stream.text().contains(r#""usage":{"prompt_tokens":"#),
        "{}",
        via_a_stream.text()
    );
    assert!(via_a_stream.text().ends_with("data: [DONE]\n\n"));
    for (forwarded, direct) in [(&via_a, &at_b), (&via_a_stream, &at_b_stream)] {
        assert_eq!(
            forwarded.header("content-type"),
            direct.header("content-type")
        );
    }
    // One id for the request on both Edges.
    let id = via_a.header("x-request-id").expect("a request id");
    let line = cluster.log_line(b, |l| l.contains(&format!("request_id={id} ")));
    assert!(line.contains("peer=edge-1"), "{line}");
    assert_eq!(
        cluster.metric(
            a,
            "iop_edge_cluster_forwarded_total{edge=\"edge-2\",outcome=\"ok\"}"
        ),
        2
    );
    assert_eq!(cluster.metric(b, "iop_edge_cluster_peer_requests_total"), 2);

    // Eight requests a minute per key, split between the two Edges (four
    // each): A charged the two it forwarded, B only its own two; its third
    // and fourth (below) are admitted, a fifth is not.
    let third_at_b = cluster.chat(b, "model-a", false);
    assert_eq!(third_at_b.status, 200, "{}", third_at_b.text());

    // (e) On B's peer listener, as edge-1: served by B, not forwarded.
    let as_a = peer_client(&cluster.dir, Some("edge-edge-1"));
    let started = clock::now();
    let from_peer = peer_request(
        as_a.clone(),
        b.peer,
        &[AUTH],
        &chat_body("model-b", false),
        "/v1/chat/completions",
    )
    .expect("peer request");
    assert_eq!(
        (from_peer.status, from_peer.json()["error"]["code"].clone()),
        (503, json!("no_provider_available")),
        "{}",
        from_peer.text()
    );
    // It waited for B's queue timeout (1 s): B's own answer.
    assert!(started.elapsed() >= Duration::from_millis(1000));
    let line = cluster.log_line(b, |l| {
        l.contains("model=model-b") && l.contains("peer=edge-1")
    });
    assert!(line.contains("status=503"), "{line}");
    // The key is still checked on the peer listener.
    let keyless = peer_request(
        as_a,
        b.peer,
        &[],
        &chat_body("model-b", false),
        "/v1/chat/completions",
    )
    .expect("peer request");
    assert_eq!(keyless.status, 401, "{}", keyless.text());
    // The same request from a client of B: forwarded to A, answered.
    let from_client = cluster.chat(b, "model-b", false);
    assert_eq!(from_client.status, 200, "{}", from_client.text());
    assert_eq!(from_client.json()["usage"]["completion_tokens"], 3);
    assert_eq!(
        cluster.metric(
            b,
            "iop_edge_cluster_forwarded_total{edge=\"edge-1\",outcome=\"ok\"}"
        ),
        1
    );
    assert_eq!(cluster.metric(a, "iop_edge_cluster_peer_requests_total"), 1);
    cluster.log_line(b, |l| {
        l.contains("model=model-b") && l.contains("forwarded_to=edge-1")
    });
    // B's fifth request of its own is over its share of the key's limit
    // (the peer's request above was not charged at B).
    let fifth_at_b = cluster.chat(b, "model-a", false);
    assert_eq!(fifth_at_b.status, 429, "{}", fifth_at_b.text());
    assert!(
        fifth_at_b.text().contains("4 requests per minute"),
        "{}",
        fifth_at_b.text()
    );
}

// (d) B's peer listener takes Edges only: a client without a certificate
// and one presenting a node certificate (same CA) are refused in the
// handshake — the exchange fails with the TLS alert and no HTTP byte —
// while edge-1's certificate gets an answer.
#[test]
fn the_peer_listener_refuses_clients_without_an_edge_certificate() {
    let cluster = start("mtls", &["--tokens", "3"]);
    let b = &cluster.b;
    for (identity, alert) in [
        (None, rustls::AlertDescription::CertificateRequired),
        (Some("node-node-a"), rustls::AlertDescription::AccessDenied),
    ] {
        let refused = peer_request(
            peer_client(&cluster.dir, identity),
            b.peer,
            &[AUTH],
            "",
            "/livez",
        )
        .expect_err("refused");
        let cause = refused
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
            .unwrap_or_else(|| panic!("{identity:?}: not a TLS error: {refused:?}"));
        assert_eq!(cause, &rustls::Error::AlertReceived(alert), "{identity:?}");
    }
    let edge = peer_request(
        peer_client(&cluster.dir, Some("edge-edge-1")),
        b.peer,
        &[AUTH],
        "",
        "/livez",
    )
    .expect("an edge is served");
    assert_eq!((edge.status, edge.text()), (200, "ok\n".to_string()));
}

// (c) A client that leaves a forwarded stream at A: A closes its
// connection to B, B cancels the run (its provider's in_flight back to 0)
// and the mock sees the stream aborted. (b) Then, with B gone, A cannot
// reach an owner of `model-a`: 503 `peer_unavailable` with retry-after.
#[test]
fn a_client_leaving_at_a_cancels_the_run_at_b_and_without_b_a_answers_503() {
    let mut cluster = start("cancel", &["--inter-token-ms", "300", "--tokens", "200"]);
    let a_client = cluster.a.client;
    let mut tcp = TcpStream::connect(a_client).expect("connect");
    tcp.set_read_timeout(Some(GENEROUS)).expect("timeout");
    tcp.write_all(&request_bytes(
        "POST",
        "/v1/chat/completions",
        &[AUTH],
        &chat_body("model-a", true),
    ))
    .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("tok0") {
        let n = tcp.read(&mut buf).expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(cluster.in_flight(&cluster.b, "node-a"), 1);
    assert_eq!(cluster.mock_stats()["active_streams"], 1);
    drop(tcp);
    let started = clock::now();
    loop {
        let stats = cluster.mock_stats();
        // B's access line says why the run ended.
        let logged = cluster
            .log(&cluster.b)
            .lines()
            .any(|l| l.contains("peer=edge-1") && l.contains("outcome=client_disconnect"));
        if cluster.in_flight(&cluster.b, "node-a") == 0 && stats["streams_aborted"] == 1 && logged {
            assert_eq!(stats["active_streams"], 0);
            break;
        }
        assert!(
            started.elapsed() < GENEROUS,
            "B did not cancel the run: {stats}\n{}",
            cluster.log(&cluster.b)
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // (b) B is gone (its etcd lease, 60 s, still names it the owner).
    drop(cluster.b.proc.take());
    let response = cluster.chat(&cluster.a, "model-a", false);
    assert_eq!(response.status, 503, "{}", response.text());
    assert_eq!(response.header("retry-after").as_deref(), Some("1"));
    assert_eq!(
        response.json(),
        json!({"error": {
            "message": "The providers of model `model-a` are served by another gateway of this \
                        cluster, which cannot be reached right now; retry shortly.",
            "type": "service_unavailable_error", "param": null, "code": "peer_unavailable"
        }})
    );
    assert_eq!(
        cluster.metric(
            &cluster.a,
            "iop_edge_cluster_forwarded_total{edge=\"edge-2\",outcome=\"unavailable\"}"
        ),
        1
    );
}
