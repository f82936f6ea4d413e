//! The node-connection shell (`edge_bin::nodes`) proven over real mTLS and
//! real client sockets, with hand-driven nodes:
//!
//! - F3: a request for a model whose only node is not ready waits in the
//!   model's queue; the node registers (still not ready: nothing is sent to
//!   it), then becomes ready, and the first frame after its ready answer is
//!   the waiting request's tunnel, which it answers to the client.
//! - H1: frames of a live run that arrive on another node's connection are
//!   refused: they reach no client and release no lease; the run's own
//!   connection then answers it.

mod common;

use common::*;
use iop_wire::pb;

/// A model served by node-a alone whose requests wait long enough for a
/// node to connect on a loaded machine (well inside [`TEST_TIMEOUT`]).
const WAITING_MODEL: &str = "waiting-model";
const WAITING_QUEUE_TIMEOUT_MS: u64 = 30_000;

fn chat(model: &str) -> String {
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#)
}

/// The three frames of a complete JSON answer to `run_id` whose head says
/// `x-answered-by: by`.
fn json_answer(run_id: &str, by: &'static [u8], body: &'static [u8]) -> [pb::Frame; 3] {
    [
        answer(
            run_id,
            1,
            pb::TunnelFrameKind::ResponseStart,
            &[("content-type", b"application/json"), ("x-answered-by", by)],
            b"",
        ),
        answer(run_id, 2, pb::TunnelFrameKind::Body, &[], body),
        answer(run_id, 3, pb::TunnelFrameKind::End, &[], b""),
    ]
}

#[monoio::test_all(timer_enabled = true)]
async fn a_waiting_request_is_dispatched_when_its_node_becomes_ready() {
    let pki = Pki::mint("f3-waiting-request");
    guarded(async {
        let options = EdgeOptions {
            extra_toml: format!(
                "\n[[models]]\nname = \"{WAITING_MODEL}\"\nproviders = [\"node-a/a-mock\"]\n\
                 queue_timeout_ms = {WAITING_QUEUE_TIMEOUT_MS}\n"
            ),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let client_addr = edge.client_addr;
        let mut client =
            monoio::spawn(async move { post_chat(client_addr, &chat(WAITING_MODEL)).await });
        // No node at all: the request waits in its model's queue.
        let queued = || {
            edge.edge
                .control()
                .queue_depths()
                .into_iter()
                .find(|(model, _)| model == WAITING_MODEL)
                .map(|(_, depth)| depth)
        };
        while queued() != Some(1) {
            monoio::time::sleep(std::time::Duration::from_millis(5)).await;
        }

        // Registered, not ready: still waiting, nothing dispatched (R4).
        let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        assert!(node.register("node-a").await.accepted);
        assert_eq!(queued(), Some(1));
        assert_eq!(edge.edge.control().leases().count(), 0);

        // Ready: the ready answer, then at once the waiting request's
        // tunnel on this connection.
        assert_eq!(node.ready("node-a").await, ready_accepted());
        let tunnel = monoio::select! {
            tunnel = next_tunnel(&mut node) => tunnel,
            response = &mut client => panic!("answered without a dispatch: {response:?}"),
        };
        // CONTRACT: F3 — the ready transition pumped the waiting request to
        // the new generation's provider, at its configured capacity.
        assert_eq!(
            (
                tunnel.run_id.as_str(),
                tunnel.adapter.as_str(),
                tunnel.target.as_str()
            ),
            ("run-1", ADAPTER, TARGET)
        );
        assert_eq!(queued(), Some(0));
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            ready_entry("node-a", "a-mock", 1)
        );

        for f in json_answer(&tunnel.run_id, b"node-a", b"{\"answer\":\"waited\"}") {
            node.conn.send_bulk(f).await.expect("send the answer");
        }
        let response = client.await;
        // CONTRACT: F3 — the client that waited gets the node's answer, not
        // a 503: nothing answered it before the node was ready.
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.header("x-answered-by"), Some("node-a"));
        assert_eq!(response.body, b"{\"answer\":\"waited\"}");
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn frames_of_a_run_count_only_on_its_own_connection() {
    let pki = Pki::mint("h1-other-connection");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut node_a = ready_node(&edge, &pki, "node-a").await;
        let mut node_b = ready_node(&edge, &pki, "node-b").await;
        let client_addr = edge.client_addr;
        let client = monoio::spawn(async move { post_chat(client_addr, &chat(MODEL)).await });
        let run_id = next_tunnel(&mut node_a).await.run_id;
        let owner = edge
            .edge
            .control()
            .lease(&run_id)
            .map(|lease| lease.conn)
            .expect("the run's lease");

        // node-b sends a whole answer for node-a's run, then a duplicate
        // ready on the same lane: its answer means every frame before it
        // was handled.
        for f in json_answer(&run_id, b"node-b", b"{\"answer\":\"forged\"}") {
            node_b.conn.send_control(f).expect("send on node-b");
        }
        assert_eq!(node_b.ready("node-b").await, ready_accepted());

        // CONTRACT: H1 — node-b's END did not end the run: the lease is
        // still node-a's, on node-a's connection.
        assert_eq!(
            edge.edge.control().lease(&run_id).map(|lease| lease.conn),
            Some(owner)
        );
        assert_eq!(
            node_entry(edge.client_addr, "node-a").await,
            ready_entry("node-a", "a-mock", 1)
        );

        for f in json_answer(&run_id, b"node-a", b"{\"answer\":\"real\"}") {
            node_a.conn.send_bulk(f).await.expect("send on node-a");
        }
        let response = client.await;
        // CONTRACT: H1 — the client got node-a's answer and nothing of
        // node-b's: the frames that came on another connection were refused.
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.header("x-answered-by"), Some("node-a"));
        assert_eq!(response.body, b"{\"answer\":\"real\"}");
        assert_eq!(edge.edge.control().leases().count(), 0);
        // node-b was not closed for it and still serves its own model.
        let client = monoio::spawn(async move { post_chat(client_addr, &chat(MODEL_B)).await });
        let own = next_tunnel(&mut node_b).await.run_id;
        for f in json_answer(&own, b"node-b", b"{\"answer\":\"b\"}") {
            node_b.conn.send_bulk(f).await.expect("send on node-b");
        }
        assert_eq!(client.await.body, b"{\"answer\":\"b\"}");
        edge.stop().await;
    })
    .await;
}
