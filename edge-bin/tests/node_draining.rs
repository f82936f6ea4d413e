//! `NodeDraining` (a Node's shutdown drain) through the node-connection
//! shell, over real mTLS and client sockets with hand-driven nodes:
//!
//! - the Edge says at registration that it understands the frame
//!   (`RegisterResponse.accepts_node_draining`);
//! - after node-a says it drains, every new request of a model node-a and
//!   node-b serve goes to node-b — a request that finds node-b full waits
//!   for node-b although node-a has a free slot — while node-a's stream in
//!   flight completes byte for byte; node-a is sent nothing new;
//! - the node's next registration starts undrained;
//! - a `NodeDraining` before registration is ignored, not a protocol error;
//! - a run that reached the node after its drain ended (`Close(drained)`:
//!   it started nothing more) waits for the node's next process, even with
//!   one attempt allowed; after any other close it is lost (502).

mod common;

use std::time::Duration;

use common::*;
use iop_engine::conn::ConnEvent;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use monoio::io::AsyncWriteRentExt;
use monoio::net::TcpStream;

/// A model served by node-a and node-b (capacity 2 each); ties go to
/// node-a, listed first.
const BOTH: &str = "both-nodes";

fn both_nodes() -> EdgeOptions {
    EdgeOptions {
        extra_toml: format!(
            "[[models]]\nname = \"{BOTH}\"\nproviders = [\"node-a/a-mock\", \"node-b/b-mock\"]\nrouting = \"least_loaded\"\n"
        ),
        ..EdgeOptions::without_provider()
    }
}

/// A model served by node-a alone, one attempt per request.
const A_ONLY: &str = "a-only";

fn both_and_a_only() -> EdgeOptions {
    let mut options = both_nodes();
    options.extra_toml += &format!(
        "[[models]]\nname = \"{A_ONLY}\"\nproviders = [\"node-a/a-mock\"]\nmax_attempts = 1\n"
    );
    options
}

fn chat(stream: bool) -> Vec<u8> {
    chat_for(BOTH, stream)
}

fn chat_for(model: &str, stream: bool) -> Vec<u8> {
    let body = format!(
        r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    request_bytes("POST", "/v1/chat/completions", body.as_bytes())
}

fn node_draining(node_id: &str) -> pb::Frame {
    frame(Body::NodeDraining(pb::NodeDraining {
        node_id: node_id.into(),
        reason: "shutdown".into(),
    }))
}

/// A non-streamed request for [`BOTH`], answered on its own task.
fn spawn_request(edge: &TestEdge) -> monoio::task::JoinHandle<HttpResponse> {
    spawn_request_for(edge, BOTH)
}

/// A non-streamed request for `model`, answered on its own task.
fn spawn_request_for(edge: &TestEdge, model: &str) -> monoio::task::JoinHandle<HttpResponse> {
    let client_addr = edge.client_addr;
    let request = chat_for(model, false);
    monoio::spawn(async move {
        let mut client = TcpStream::connect(client_addr).await.expect("connect");
        let (res, _) = client.write_all(request).await;
        res.expect("send the request");
        let mut raw = Vec::new();
        loop {
            let (res, buf) =
                monoio::io::AsyncReadRent::read(&mut client, Vec::with_capacity(4096)).await;
            match res {
                Ok(0) | Err(_) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
        parse_response(&raw)
    })
}

/// Answers tunnel `run_id` on `node` with a whole JSON body naming `by`.
async fn answer_json(node: &RawNode, run_id: &str, body: &'static [u8]) {
    tunnel_response_start(node, run_id, b"application/json").await;
    tunnel_body(node, run_id, 2, body).await;
    tunnel_end(node, run_id, 3).await;
}

/// Control's providers of [`BOTH`] with a free slot, and the requests
/// waiting for one.
fn model_view(edge: &TestEdge) -> (usize, usize) {
    let view = edge
        .edge
        .control()
        .model_views()
        .into_iter()
        .find(|m| m.model == BOTH)
        .expect("the model's view");
    (view.candidates, view.queued)
}

/// Waits until [`model_view`] is `(candidates, queued)`.
async fn wait_model(edge: &TestEdge, candidates: usize, queued: usize) {
    while model_view(edge) != (candidates, queued) {
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The run id of the next tunnel sent to `b`; any frame sent to the
/// draining `a` first fails the test.
async fn tunnel_on_b(a: &mut RawNode, b: &mut RawNode) -> String {
    monoio::select! {
        tunnel = next_tunnel(b) => tunnel.run_id,
        sent = a.next_frame() => panic!("node-a drains, yet it was sent {sent:?}"),
    }
}

/// The provider of every live lease, sorted.
fn leased_providers(edge: &TestEdge) -> Vec<String> {
    let mut providers: Vec<String> = edge
        .edge
        .control()
        .leases()
        .map(|l| format!("{}/{}", l.provider.node_id, l.provider.provider_id))
        .collect();
    providers.sort();
    providers
}

#[monoio::test_all(timer_enabled = true)]
async fn after_node_draining_new_requests_go_elsewhere_and_the_stream_in_flight_completes() {
    let pki = Pki::mint("node-draining");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &both_nodes()));
        let mut a = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        let registered = a.register("node-a").await;
        assert!(registered.accepted);
        // This Edge understands NodeDraining, and says so.
        assert!(registered.accepts_node_draining);
        assert_eq!(a.ready("node-a").await, ready_accepted());
        let mut b = ready_node(&edge, &pki, "node-b").await;

        // A stream in flight on node-a (the tie goes to it).
        let (mut client, run, mut seen) =
            stream_in_flight(edge.client_addr, &mut a, chat(true)).await;
        assert_eq!(leased_providers(&edge), ["node-a/a-mock"]);

        // node-a drains. The shell handles a connection's frames in order
        // and the control lane goes out first: once the client has the
        // event node-a sent after its notice, Control has the notice.
        assert_eq!(model_view(&edge), (2, 0));
        a.conn
            .send_control(node_draining("node-a"))
            .expect("send NodeDraining");
        tunnel_body(&a, &run, 3, b"data: {\"n\":2}\n\n").await;
        read_until(&mut client, &mut seen, b"data: {\"n\":2}").await;
        // node-a left the model's candidates although it has a free slot.
        assert_eq!(model_view(&edge), (1, 0));

        // Two requests fill node-b; a third waits for node-b rather than
        // take node-a's free slot.
        let first = spawn_request(&edge);
        let first_run = tunnel_on_b(&mut a, &mut b).await;
        let second = spawn_request(&edge);
        let second_run = tunnel_on_b(&mut a, &mut b).await;
        let third = spawn_request(&edge);
        wait_model(&edge, 0, 1).await;
        assert_eq!(
            leased_providers(&edge),
            ["node-a/a-mock", "node-b/b-mock", "node-b/b-mock"]
        );
        answer_json(&b, &first_run, b"{\"n\":\"first\"}").await;
        let third_run = tunnel_on_b(&mut a, &mut b).await;
        answer_json(&b, &second_run, b"{\"n\":\"second\"}").await;
        answer_json(&b, &third_run, b"{\"n\":\"third\"}").await;
        for (response, body) in [
            (first.await, &b"{\"n\":\"first\"}"[..]),
            (second.await, &b"{\"n\":\"second\"}"[..]),
            (third.await, &b"{\"n\":\"third\"}"[..]),
        ] {
            assert_eq!((response.status, response.body.as_slice()), (200, body));
        }

        // node-a's stream completes whole.
        tunnel_body(&a, &run, 4, b"data: [DONE]\n\n").await;
        tunnel_end(&a, &run, 5).await;
        let (end, _) = read_to_end_into(&mut client, &mut seen).await;
        assert_eq!(end, Ok(()));
        let response = parse_response(&seen);
        assert_eq!(response.status, 200);
        assert_eq!(
            String::from_utf8(response.body).expect("UTF-8"),
            "data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n"
        );
        assert_eq!(edge.edge.control().leases().count(), 0);

        // The node's next registration (here, its next process) starts
        // undrained: the tie goes to node-a again. The drained connection
        // was sent nothing after its notice, then closed as superseded.
        let mut again = ready_node(&edge, &pki, "node-a").await;
        match a.events.recv().await {
            Some(ConnEvent::Closed { reason }) => {
                assert_eq!(reason, CloseReason::Peer("superseded".into()))
            }
            other => panic!("expected the drained connection's close, got {other:?}"),
        }
        let fourth = spawn_request(&edge);
        let fourth_run = next_tunnel(&mut again).await.run_id;
        answer_json(&again, &fourth_run, b"{\"n\":\"fourth\"}").await;
        let response = fourth.await;
        assert_eq!(
            (response.status, response.body.as_slice()),
            (200, &b"{\"n\":\"fourth\"}"[..])
        );
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn node_draining_before_registration_is_ignored() {
    let pki = Pki::mint("node-draining-early");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &both_nodes()));
        let mut a = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        a.conn
            .send_control(node_draining("node-a"))
            .expect("send NodeDraining");
        // Not a protocol error: the connection registers and serves, and
        // the notice it sent before owning anything drains nothing.
        let registered = a.register("node-a").await;
        assert!(registered.accepted && registered.accepts_node_draining);
        assert_eq!(a.ready("node-a").await, ready_accepted());
        let _b = ready_node(&edge, &pki, "node-b").await;
        assert_eq!(model_view(&edge), (2, 0));
        let request = spawn_request(&edge);
        let run = next_tunnel(&mut a).await.run_id;
        answer_json(&a, &run, b"{\"n\":\"a\"}").await;
        let response = request.await;
        assert_eq!(
            (response.status, response.body.as_slice()),
            (200, &b"{\"n\":\"a\"}"[..])
        );
        edge.stop().await;
    })
    .await;
}

/// node-a takes a request for [`A_ONLY`] and, before answering anything,
/// says it drains and closes with `reason`. Returns the client's request,
/// the run id node-a was sent, and the edge.
async fn close_with_a_run_unanswered(
    pki: &Pki,
    reason: CloseReason,
) -> (TestEdge, monoio::task::JoinHandle<HttpResponse>, String) {
    let edge = TestEdge::start(pki, &edge_toml(pki, &both_and_a_only()));
    let mut a = ready_node(&edge, pki, "node-a").await;
    let request = spawn_request_for(&edge, A_ONLY);
    let run = next_tunnel(&mut a).await.run_id;
    a.conn
        .send_control(node_draining("node-a"))
        .expect("send NodeDraining");
    a.conn.close(reason);
    // The Edge has the close once node-a is offline.
    let offline = |edge: &TestEdge| {
        edge.edge
            .control()
            .node_views()
            .iter()
            .any(|n| n.node_id == "node-a" && n.offline_since.is_some())
    };
    while !offline(&edge) {
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
    (edge, request, run)
}

// The race a Node's drain has with its Edge: a run sent just before the
// Edge had the `NodeDraining` reaches the Node after its last run ended.
// The Node starts nothing more and says so (`Close(drained)`): the run
// never reached a provider, so the Edge sends it again — here to the
// node's next process, from the queue, although the model allows one
// attempt — and the client gets the answer whole.
#[monoio::test_all(timer_enabled = true)]
async fn a_run_the_drained_node_never_started_waits_for_its_next_process() {
    let pki = Pki::mint("node-drained-close");
    guarded(async {
        let (edge, request, run) = close_with_a_run_unanswered(&pki, CloseReason::Drained).await;
        let view = |edge: &TestEdge| {
            let v = edge
                .edge
                .control()
                .model_views()
                .into_iter()
                .find(|m| m.model == A_ONLY)
                .expect("the model's view");
            (v.candidates, v.queued)
        };
        assert_eq!(view(&edge), (0, 1), "the request waits in the queue");
        assert_eq!(edge.edge.control().counters().drain_redispatched, 1);
        let mut again = ready_node(&edge, &pki, "node-a").await;
        let retried = next_tunnel(&mut again).await.run_id;
        assert_ne!(retried, run, "a run id of its own");
        answer_json(&again, &retried, b"{\"n\":\"again\"}").await;
        let response = request.await;
        assert_eq!(
            (response.status, response.body.as_slice()),
            (200, &b"{\"n\":\"again\"}"[..])
        );
        assert_eq!(edge.edge.control().counters().failover_retried, 0);
        edge.stop().await;
    })
    .await;
}

// Without that promise (the drain's grace ran out: `Close(shutdown)`) the
// node may have called the provider: with one attempt allowed, the
// request ends 502.
#[monoio::test_all(timer_enabled = true)]
async fn after_any_other_close_the_unanswered_run_is_lost() {
    let pki = Pki::mint("node-shutdown-close");
    guarded(async {
        let (edge, request, _) = close_with_a_run_unanswered(&pki, CloseReason::Shutdown).await;
        let response = request.await;
        assert_eq!(response.status, 502, "{response:?}");
        assert_eq!(edge.edge.control().counters().drain_redispatched, 0);
        edge.stop().await;
    })
    .await;
}

/// Reads `stream` until it ends, appending to `seen`: `Ok` on a clean end.
async fn read_to_end_into(
    stream: &mut TcpStream,
    seen: &mut Vec<u8>,
) -> (Result<(), std::io::ErrorKind>, usize) {
    let mut read = 0usize;
    loop {
        let (res, buf) =
            monoio::io::AsyncReadRent::read(stream, Vec::with_capacity(64 * 1024)).await;
        match res {
            Ok(0) => return (Ok(()), read),
            Ok(n) => {
                read += n;
                seen.extend_from_slice(&buf[..n]);
            }
            Err(e) => return (Err(e.kind()), read),
        }
    }
}
