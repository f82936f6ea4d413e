//! Capacity summaries and forwarding when local capacity is full, every
//! part a real process on loopback (the cluster harness,
//! `common/cluster.rs`): one `etcd`, Edges A (`edge-1`) and B (`edge-2`),
//! a mock provider with slow streams, and two nodes serving the same
//! model `model-x` with one slot each: `node-a` connected to A, `node-b`
//! to B.
//!
//! - with A's only slot busy (a slow stream through A), a second request
//!   to A is forwarded to B, where a slot is free, and answered with the
//!   bytes B gives its own client for the same request; so is an
//!   embeddings request (the summaries carry every operation);
//! - with both slots busy, a third request to A waits in A's queue (it is
//!   not forwarded) and is served by A's node when A's stream ends;
//! - B's peer listener answers `GET /cluster/summary` to an Edge only, with
//!   B's free slots.
//!
//! Build the binaries first: `cargo build -p edge-bin -p node-bin -p bench
//! --bins`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use iop_engine::clock;
use serde_json::{json, Value};

#[path = "common/cluster.rs"]
mod cluster;
use cluster::*;

/// `node-a` connects to A, `node-b` to B.
const NODES: &[(&str, &str)] = &[("node-a", "edge-1"), ("node-b", "edge-2")];

/// Both nodes serve `model-x` with one slot each; a queued request waits
/// up to a minute.
fn fleet(mock: SocketAddr) -> String {
    let mut text = String::new();
    for node in ["node-a", "node-b"] {
        text.push_str(&format!(
            "[[nodes]]\nid = \"{node}\"\n\
             [[nodes.adapters]]\nname = \"mock\"\nkind = \"openai_compat\"\n\
             profile = \"openai\"\nbase_url = \"http://{mock}\"\ncapacity = 1\n\
             [[nodes.providers]]\nid = \"mock\"\nadapter = \"mock\"\ntarget = \"mock-model\"\n\
             capacity = 1\n\n"
        ));
    }
    text.push_str(
        "[[models]]\nname = \"model-x\"\nproviders = [\"node-a/mock\", \"node-b/mock\"]\n\
         queue_timeout_ms = 60000\n",
    );
    text
}

/// A chat completion for `model-x` of at most `max_tokens` tokens.
fn body(stream: bool, max_tokens: u32) -> String {
    format!(
        r#"{{"model":"model-x","stream":{stream},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"hi"}}]}}"#
    )
}

/// A streamed request to `edge` whose first token has arrived; the stream
/// goes on until the connection is dropped.
fn open_stream(edge: &EdgeProc) -> TcpStream {
    let mut tcp = TcpStream::connect(edge.client).expect("connect");
    tcp.set_read_timeout(Some(GENEROUS)).expect("timeout");
    tcp.write_all(&request_bytes(
        "POST",
        "/v1/chat/completions",
        &[AUTH],
        &body(true, 1000),
    ))
    .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("tok0") {
        let n = tcp.read(&mut buf).expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    tcp
}

/// Free chat slots for `model-x` in `edge`'s `/status`: its own (`None`)
/// or its latest summary of `peer` (`None` when it has none).
fn free_chat_slots(status: &Value, peer: Option<&str>) -> Option<u64> {
    let capacity = &status["cluster"]["capacity"];
    let models = match peer {
        None => &capacity["here"],
        Some(peer) => &capacity["peers"][peer]["models"],
    };
    models["model-x"]["free_slots"]["chat_completions"].as_u64()
}

/// Waits until A's `/status` shows `here` free chat slots of its own and
/// `at_b` in its summary of B.
fn wait_for_a_to_see(cluster: &Cluster, here: u64, at_b: u64) {
    let started = clock::now();
    loop {
        let status = cluster.status(&cluster.a);
        if free_chat_slots(&status, None) == Some(here)
            && free_chat_slots(&status, Some("edge-2")) == Some(at_b)
        {
            return;
        }
        assert!(
            started.elapsed() < GENEROUS,
            "A never saw {here} free here and {at_b} at B: {}",
            status["cluster"]
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// A full Edge forwards to the peer with a free slot; with no slot free
// anywhere it queues the request at home.
#[test]
fn a_full_edge_forwards_to_a_free_peer_and_queues_when_every_slot_is_busy() {
    let cluster = Cluster::start(Setup {
        label: "summaries",
        mock_args: &["--inter-token-ms", "200", "--tokens", "1000"],
        fleet,
        nodes: NODES,
        team_limits: "",
    });
    let (a, b) = (&cluster.a, &cluster.b);
    wait_for_a_to_see(&cluster, 1, 1);

    // A's slot: a slow stream, served by A's own node.
    let first = open_stream(a);
    assert_eq!(cluster.in_flight(a, "node-a"), 1);
    wait_for_a_to_see(&cluster, 0, 1);

    // A second request to A goes to B's free slot.
    let second = request(
        a.client,
        "POST",
        "/v1/chat/completions",
        &[AUTH],
        &body(false, 3),
    )
    .expect("second");
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.json()["usage"]["completion_tokens"], 3);
    let id = second.header("x-request-id").expect("a request id");
    let line = cluster.log_line(a, |l| l.contains(&format!("request_id={id} ")));
    assert!(line.contains("forwarded_to=edge-2"), "{line}");
    let line = cluster.log_line(b, |l| l.contains(&format!("request_id={id} ")));
    assert!(
        line.contains("peer=edge-1") && line.contains("node=node-b"),
        "{line}"
    );
    // Byte for byte what B gives its own client for the same request
    // (served at B: its slot is free again).
    let at_b = request(
        b.client,
        "POST",
        "/v1/chat/completions",
        &[AUTH],
        &body(false, 3),
    )
    .expect("at B");
    assert_eq!(at_b.status, 200, "{}", at_b.text());
    assert_eq!(masked(&second.body), masked(&at_b.body));
    assert_ne!(
        masked(&second.body),
        second.body,
        "the mask found its fields"
    );
    assert_eq!(second.header("content-type"), at_b.header("content-type"));
    assert_eq!(
        cluster.metric(
            a,
            "iop_edge_cluster_forward_reasons_total{reason=\"local_full\"}"
        ),
        1
    );
    assert_eq!(
        cluster.metric(
            b,
            "iop_edge_cluster_forwarded_total{edge=\"edge-1\",outcome=\"ok\"}"
        ),
        0
    );

    // The summaries carry every operation: an embeddings request to A,
    // which has no free slot for it, is placed at B's free one (not queued
    // at A behind the slow stream), and gets B's bytes.
    wait_for_a_to_see(&cluster, 0, 1);
    const EMBED: &str = r#"{"model":"model-x","input":["a b","c"]}"#;
    let embedded = request(a.client, "POST", "/v1/embeddings", &[AUTH], EMBED).expect("embeddings");
    assert_eq!(embedded.status, 200, "{}", embedded.text());
    let id = embedded.header("x-request-id").expect("a request id");
    let line = cluster.log_line(a, |l| l.contains(&format!("request_id={id} ")));
    assert!(line.contains("forwarded_to=edge-2"), "{line}");
    let line = cluster.log_line(b, |l| l.contains(&format!("request_id={id} ")));
    assert!(
        line.contains("peer=edge-1") && line.contains("node=node-b"),
        "{line}"
    );
    let at_b = request(b.client, "POST", "/v1/embeddings", &[AUTH], EMBED).expect("at B");
    assert_eq!(at_b.status, 200, "{}", at_b.text());
    assert_eq!(embedded.body, at_b.body);
    assert_eq!(cluster.mock_stats()["embeddings_requests"], 2);

    // B's slot too: a slow stream sent to A, forwarded to B.
    wait_for_a_to_see(&cluster, 0, 1);
    let second_stream = open_stream(a);
    assert_eq!(cluster.in_flight(b, "node-b"), 1);
    assert_eq!(cluster.mock_stats()["active_streams"], 2);
    assert_eq!(cluster.metric(b, "iop_edge_cluster_peer_requests_total"), 3);
    wait_for_a_to_see(&cluster, 0, 0);

    // Nothing free anywhere: a third request to A waits in A's queue.
    let a_client = a.client;
    let third = std::thread::spawn(move || {
        request(
            a_client,
            "POST",
            "/v1/chat/completions",
            &[AUTH],
            &body(false, 3),
        )
        .expect("third")
    });
    let started = clock::now();
    while cluster.metric(a, "iop_edge_queue_depth{model=\"model-x\"}") != 1 {
        assert!(
            started.elapsed() < GENEROUS,
            "the third request never queued at A"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        cluster.metric(b, "iop_edge_queue_depth{model=\"model-x\"}"),
        0
    );
    assert_eq!(
        cluster.metric(
            a,
            "iop_edge_cluster_forward_reasons_total{reason=\"local_full\"}"
        ),
        3
    );
    assert_eq!(
        cluster.metric(
            a,
            "iop_edge_cluster_forward_reasons_total{reason=\"no_local_node\"}"
        ),
        0
    );

    // A's stream ends (its client leaves): the third request takes A's slot.
    drop(first);
    let third = third.join().expect("third request thread");
    assert_eq!(third.status, 200, "{}", third.text());
    assert_eq!(third.json()["usage"]["completion_tokens"], 3);
    let id = third.header("x-request-id").expect("a request id");
    let line = cluster.log_line(a, |l| l.contains(&format!("request_id={id} ")));
    assert!(
        line.contains("node=node-a") && !line.contains("forwarded_to="),
        "{line}"
    );
    assert_eq!(cluster.metric(b, "iop_edge_cluster_peer_requests_total"), 3);
    assert_eq!(cluster.in_flight(b, "node-b"), 1);
    drop(second_stream);
}

// B's summary route answers Edges on the peer listener only: to edge-1's
// certificate, B's free slots (one per operation of `model-x`, nothing
// queued); on B's client listener the route does not exist.
#[test]
fn the_summary_route_answers_peers_only() {
    let cluster = Cluster::start(Setup {
        label: "summary-route",
        mock_args: &["--tokens", "3"],
        fleet,
        nodes: NODES,
        team_limits: "",
    });
    let b = &cluster.b;
    let as_a = peer_client(&cluster.dir, Some("edge-edge-1"));
    let started = clock::now();
    let summary = loop {
        let answer =
            peer_request(as_a.clone(), b.peer, &[], "", "/cluster/summary").expect("summary");
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(
            answer.header("content-type").as_deref(),
            Some("application/json")
        );
        let summary = answer.json();
        if summary["models"]["model-x"]["free_slots"][0] == 1 {
            break summary;
        }
        assert!(
            started.elapsed() < GENEROUS,
            "B never showed its slot: {summary}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        summary,
        json!({"edge": "edge-2", "models": {"model-x": {
            "free_slots": [1, 1, 1, 1],
            // completions, embeddings and the three audio operations; the
            // `openai` profile serves no rerank, score, tokenize or
            // detokenize.
            "more_free_slots": [1, 1, 0, 0, 0, 0, 1, 1, 1],
            "queued": 0
        }}})
    );
    let on_client_listener =
        request(b.client, "GET", "/cluster/summary", &[OPS], "").expect("client listener");
    assert_eq!(
        on_client_listener.status,
        404,
        "{}",
        on_client_listener.text()
    );
    let refused = peer_request(
        peer_client(&cluster.dir, Some("node-node-a")),
        b.peer,
        &[],
        "",
        "/cluster/summary",
    );
    assert!(refused.is_err(), "{refused:?}");
}
