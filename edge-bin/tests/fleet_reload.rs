//! `server::reload` — what the binary's SIGHUP handler calls — changing the
//! fleet of an Edge served in process, over real client sockets and
//! hand-driven nodes on real mTLS: a node, provider and model added by a
//! reload register and serve at once; a provider taken out of a pool
//! finishes its stream whole and gets no new request; a node removed from
//! the configuration is let go of (`node_removed`) only once what it runs
//! has ended, and may not register again.
//!
//! Everything is ordered by frames and answers, never by time.

mod common;

use common::*;
use edge_bin::config::EdgeConfig;
use edge_bin::server;
use iop_wire::CloseReason;

/// A node section: `id` with one provider `<id>-p` on the shared adapter.
fn node(id: &str) -> String {
    format!(
        r#"
[[nodes]]
id = "{id}"

[[nodes.adapters]]
name = "{ADAPTER}"
kind = "openai_compat"
profile = "openai"
base_url = "http://127.0.0.1:9"
capacity = 4

[[nodes.providers]]
id = "{id}-p"
adapter = "{ADAPTER}"
target = "{TARGET}"
capacity = 2
category = "api"
"#
    )
}

/// The Edge config with `nodes` and `models` (name, pool).
fn fleet_toml(pki: &Pki, nodes: &[&str], models: &[(&str, &[&str])]) -> String {
    let edge = pki.files.edge_tls_files();
    let nodes: String = nodes.iter().map(|id| node(id)).collect();
    let models: String = models
        .iter()
        .map(|(name, pool)| {
            let explicit = if pool.is_empty() {
                "allow_no_providers = true\n"
            } else {
                ""
            };
            let pool: Vec<String> = pool.iter().map(|p| format!("\"{p}\"")).collect();
            format!(
                "\n[[models]]\nname = \"{name}\"\nproviders = [{}]\nqueue_timeout_ms = 30000\n{explicit}",
                pool.join(", ")
            )
        })
        .collect();
    format!(
        r#"
[edge]
name = "{EDGE_NAME}"
trust_domain = "{TRUST_DOMAIN}"
client_listen = "127.0.0.1:0"
node_listen = "127.0.0.1:0"
allow_anonymous = true

[tls]
ca = "{ca}"
cert = "{cert}"
key = "{key}"
{nodes}{models}"#,
        ca = edge.ca_path.display(),
        cert = edge.cert_path.display(),
        key = edge.key_path.display(),
    )
}

fn chat(model: &str, stream: bool) -> Vec<u8> {
    let body = serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n").into_bytes()
}

/// Answers `node`'s next tunnel with `body` as a whole JSON response and
/// returns its run id.
async fn answer_next(node: &mut RawNode, body: &'static [u8]) -> String {
    let run = next_tunnel(node).await.run_id;
    tunnel_response_start(node, &run, b"application/json").await;
    tunnel_body(node, &run, 2, body).await;
    tunnel_end(node, &run, 3).await;
    run
}

/// Writes `text` to `path` and reloads it at `revision`.
fn reload(
    edge: &TestEdge,
    started: &EdgeConfig,
    path: &std::path::Path,
    text: &str,
    revision: u64,
) -> server::ReloadReport {
    std::fs::write(path, text).unwrap();
    let (_, report) = server::reload(&edge.edge, started, path, revision).unwrap();
    report
}

#[monoio::test_all(timer_enabled = true)]
async fn a_node_and_model_added_by_reload_register_and_serve_at_once() {
    guarded(async {
        let pki = Pki::mint("fleet-add");
        let path = pki.dir.join("edge.toml");
        let text = fleet_toml(&pki, &["node-a"], &[("m-a", &["node-a/node-a-p"])]);
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let started = EdgeConfig::load(&path).unwrap();
        let _a = ready_node(&edge, &pki, "node-a").await;

        let before = http_exchange(edge.client_addr, chat("m-b", false)).await;
        assert_eq!(before.status, 404);

        let next = fleet_toml(
            &pki,
            &["node-a", "node-b"],
            &[("m-a", &["node-a/node-a-p"]), ("m-b", &["node-b/node-b-p"])],
        );
        let report = reload(&edge, &started, &path, &next, 2);
        assert_eq!(report.nodes_added, vec!["node-b".to_string()]);
        assert_eq!(report.models_added, vec!["m-b".to_string()]);
        assert_eq!(report.restart_required, Vec::<&str>::new());

        // The node's certificate is accepted now, its registration too, and
        // it gets the new revision's config.
        let mut b = RawNode::connect(edge.node_addr, &pki.connector("node-b")).await;
        let registered = b.register("node-b").await;
        assert!(registered.accepted, "{registered:?}");
        assert_eq!(registered.config.map(|c| c.revision), Some(2));
        assert_eq!(b.ready("node-b").await, ready_accepted());

        let listed = http_exchange(edge.client_addr, get("/v1/models")).await;
        let ids: Vec<String> = listed.json()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ids, vec!["m-a", "m-b"]);

        let served = monoio::spawn(http_exchange(edge.client_addr, chat("m-b", false)));
        answer_next(&mut b, b"{\"from\":\"node-b\"}").await;
        let served = served.await;
        assert_eq!(
            (served.status, served.body),
            (200, b"{\"from\":\"node-b\"}".to_vec())
        );
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_provider_taken_out_of_a_pool_finishes_its_stream_and_gets_no_new_request() {
    guarded(async {
        let pki = Pki::mint("fleet-repool");
        let path = pki.dir.join("edge.toml");
        let both: &[&str] = &["node-a/node-a-p", "node-b/node-b-p"];
        let text = fleet_toml(&pki, &["node-a", "node-b"], &[("m", both)]);
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let started = EdgeConfig::load(&path).unwrap();
        let mut a = ready_node(&edge, &pki, "node-a").await;
        let mut b = ready_node(&edge, &pki, "node-b").await;

        // Equal load: the first of the pool, node-a, gets the stream.
        let (mut client, run, mut seen) =
            stream_in_flight(edge.client_addr, &mut a, chat("m", true)).await;

        let next = fleet_toml(&pki, &["node-a", "node-b"], &[("m", &["node-b/node-b-p"])]);
        let report = reload(&edge, &started, &path, &next, 2);
        assert_eq!(report.nodes_removed, Vec::<String>::new());

        // Two more requests: both go to node-b although node-a has a free
        // slot (capacity 2, one in flight).
        for n in 0..2 {
            let served = monoio::spawn(http_exchange(edge.client_addr, chat("m", false)));
            answer_next(&mut b, b"{\"from\":\"node-b\"}").await;
            let served = served.await;
            assert_eq!(
                (served.status, served.body),
                (200, b"{\"from\":\"node-b\"}".to_vec()),
                "request {n}"
            );
        }

        // node-a's stream runs to its end, whole.
        tunnel_body(&a, &run, 3, b"data: {\"n\":2}\n\ndata: [DONE]\n\n").await;
        tunnel_end(&a, &run, 4).await;
        read_until(&mut client, &mut seen, b"\r\n0\r\n\r\n").await;
        let stream = parse_response(&seen);
        assert_eq!(stream.status, 200);
        assert_eq!(
            stream.body,
            b"data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n".to_vec()
        );
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_removed_node_is_let_go_of_when_its_stream_ends_and_may_not_register_again() {
    guarded(async {
        let pki = Pki::mint("fleet-remove");
        let path = pki.dir.join("edge.toml");
        let text = fleet_toml(
            &pki,
            &["node-a", "node-b"],
            &[("m-a", &["node-a/node-a-p"]), ("m-b", &["node-b/node-b-p"])],
        );
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let started = EdgeConfig::load(&path).unwrap();
        let mut a = ready_node(&edge, &pki, "node-a").await;
        let mut b = ready_node(&edge, &pki, "node-b").await;
        let (mut client, run, mut seen) =
            stream_in_flight(edge.client_addr, &mut a, chat("m-a", true)).await;

        let next = fleet_toml(&pki, &["node-b"], &[("m-b", &["node-b/node-b-p"])]);
        let report = reload(&edge, &started, &path, &next, 2);
        assert_eq!(report.nodes_removed, vec!["node-a".to_string()]);
        assert_eq!(report.models_removed, vec!["m-a".to_string()]);

        // The removed model is unknown from now on; the other one serves.
        let gone = http_exchange(edge.client_addr, chat("m-a", false)).await;
        assert_eq!(gone.status, 404);
        let served = monoio::spawn(http_exchange(edge.client_addr, chat("m-b", false)));
        answer_next(&mut b, b"{\"ok\":1}").await;
        assert_eq!(served.await.status, 200);

        // node-a still runs its stream: not closed until it ends.
        tunnel_body(&a, &run, 3, b"data: [DONE]\n\n").await;
        tunnel_end(&a, &run, 4).await;
        read_until(&mut client, &mut seen, b"\r\n0\r\n\r\n").await;
        assert_eq!(
            parse_response(&seen).body,
            b"data: {\"n\":1}\n\ndata: [DONE]\n\n".to_vec()
        );
        assert_eq!(
            a.closed_reason().await,
            CloseReason::Peer("node_removed".into())
        );

        // Its certificate is no longer accepted: the Edge answers the
        // handshake's client certificate with `access_denied`.
        let mut again = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        assert_eq!(
            again.closed_reason().await,
            CloseReason::TlsAlert("access_denied".into())
        );
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_model_left_without_providers_ends_its_waiters_and_answers_503() {
    guarded(async {
        let pki = Pki::mint("fleet-empty");
        let path = pki.dir.join("edge.toml");
        let text = fleet_toml(&pki, &["node-a"], &[("m", &["node-a/node-a-p"])]);
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let started = EdgeConfig::load(&path).unwrap();

        // node-a is not connected: the request waits in m's queue.
        let waiting = monoio::spawn(http_exchange(edge.client_addr, chat("m", false)));
        while edge.edge.control().pending_requests().count() == 0 {
            monoio::time::sleep(std::time::Duration::from_millis(5)).await;
        }

        // The file says explicitly that m has no provider now.
        let next = fleet_toml(&pki, &["node-a"], &[("m", &[])]);
        reload(&edge, &started, &path, &next, 2);
        let ended = waiting.await;
        assert_eq!(ended.status, 503);
        assert_eq!(ended.json()["error"]["code"], "model_removed");

        // Still listed, and answered at once: no provider.
        let refused = http_exchange(edge.client_addr, chat("m", false)).await;
        assert_eq!(refused.status, 503);
        assert_eq!(refused.json()["error"]["code"], "no_provider_available");
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn the_per_request_limits_follow_a_reload() {
    guarded(async {
        let pki = Pki::mint("fleet-limits");
        let path = pki.dir.join("edge.toml");
        let text = fleet_toml(&pki, &["node-a"], &[("m", &["node-a/node-a-p"])]);
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let started = EdgeConfig::load(&path).unwrap();
        let mut a = ready_node(&edge, &pki, "node-a").await;

        let next = text.replace(
            "allow_anonymous = true",
            "allow_anonymous = true\nmax_request_body_bytes = 64",
        );
        let report = reload(&edge, &started, &path, &next, 2);
        assert_eq!(report.restart_required, Vec::<&str>::new());

        // A chat body of more than 64 bytes: 413 before any dispatch.
        let refused = http_exchange(edge.client_addr, chat("m", false)).await;
        assert_eq!(refused.status, 413);
        assert_eq!(edge.edge.control().leases().count(), 0);

        // Back: the same request is served.
        let report = reload(&edge, &started, &path, &text, 3);
        assert_eq!(report.revision, 3);
        let served = monoio::spawn(http_exchange(edge.client_addr, chat("m", false)));
        answer_next(&mut a, b"{\"ok\":2}").await;
        assert_eq!(served.await.status, 200);
        edge.stop().await;
    })
    .await;
}
