//! The admin API on a real Edge over real client sockets, with hand-driven
//! nodes on real mTLS: operator drains and the running configuration.
//!
//! What is proven, by order and outcome (no timing): a provider drained
//! through `POST /admin/providers/{node}/{provider}/drain` takes no new
//! request — the next one goes to the other provider of the pool although
//! the drained one comes first in it — while the stream it already carries
//! runs to its end byte for byte; `/status`, `/metrics` and the status
//! page's events show the drain; undrained, it serves again. A drained node
//! holds its model's requests in the queue and its undrain lets them in at
//! once. Only an admin-scoped key gets in (401 without a key, 403 with
//! another), a POST must be declared JSON (415), and a node or provider
//! the configuration does not name (or a reload removed) is 404.
//! `GET /admin/config` shows the revision, the digest of the file and the
//! configuration without any secret, and follows `server::reload`.

mod common;

use std::net::SocketAddr;

use common::*;
use edge_bin::config::EdgeConfig;
use edge_bin::server;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::AsyncReadRent;
use monoio::net::TcpStream;
use serde_json::{json, Value};

const ADMIN_KEY: &str = "sk-admin-drain-4e81b0c7d2a9";
const USER_KEY: &str = "sk-user-drain-93d2f6a1b0e5";
/// A model over node-a's and node-b's providers, node-a's first.
const BOTH: &str = "both-nodes";
/// The Edge's config: the harness's nodes and models, [`BOTH`], an admin
/// key and a user key. (Credential slots' secrets are kept out of
/// `/admin/config` as the unit tests of `client::admin` show.)
fn edge_toml_text(pki: &Pki) -> String {
    let key = |principal: &str, key: &str, scopes: &str| {
        format!(
            "[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\nscopes = [{scopes}]\n\n",
            blake3::hash(key.as_bytes()).to_hex()
        )
    };
    let options = EdgeOptions {
        extra_toml: format!(
            "[[models]]\nname = \"{BOTH}\"\nproviders = [\"node-a/a-mock\", \"node-b/b-mock\"]\nrouting = \"least_loaded\"\n\n{}{}",
            key("ops", ADMIN_KEY, "\"admin\""),
            key("app", USER_KEY, ""),
        ),
        ..EdgeOptions::without_provider()
    };
    edge_toml(pki, &options)
}

fn request(method: &str, path: &str, key: Option<&str>, json: bool, body: &str) -> Vec<u8> {
    let auth = key
        .map(|k| format!("authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let content_type = if json {
        "content-type: application/json\r\n"
    } else {
        ""
    };
    let mut bytes = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n{auth}\
         {content_type}content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    bytes.extend_from_slice(body.as_bytes());
    bytes
}

/// An admin POST with an empty JSON-declared body.
async fn admin(addr: SocketAddr, path: &str, key: Option<&str>) -> HttpResponse {
    http_exchange(addr, request("POST", path, key, true, "")).await
}

async fn get(addr: SocketAddr, path: &str, key: Option<&str>) -> HttpResponse {
    http_exchange(addr, request("GET", path, key, false, "")).await
}

/// A chat request for `model` under the user key.
fn chat(model: &str, stream: bool) -> Vec<u8> {
    let body = json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    request("POST", "/v1/chat/completions", Some(USER_KEY), true, &body)
}

fn admin_error(message: &str, code: &str) -> Value {
    json!({"error": {"message": message, "type": "admin_error", "param": null, "code": code}})
}

/// `/status` as the admin sees it.
async fn admin_status(addr: SocketAddr) -> Value {
    let response = get(addr, "/status", Some(ADMIN_KEY)).await;
    assert_eq!(response.status, 200);
    response.json()
}

fn entry<'v>(list: &'v Value, field: &str, id: &str) -> &'v Value {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .find(|e| e[field] == id)
        .unwrap_or_else(|| panic!("no {field} {id} in {list}"))
}

/// `(drained, node_drained, draining, removed)` of `node_id`'s provider.
fn provider_drains(status: &Value, node_id: &str) -> [Value; 4] {
    let p = entry(&status["providers"], "node_id", node_id);
    [
        p["drained"].clone(),
        p["node_drained"].clone(),
        p["draining"].clone(),
        p["removed"].clone(),
    ]
}

/// `(drained, draining, removed)` of `node_id`.
fn node_drains(status: &Value, node_id: &str) -> [Value; 3] {
    let n = entry(&status["nodes"], "node_id", node_id);
    [
        n["drained"].clone(),
        n["draining"].clone(),
        n["removed"].clone(),
    ]
}

/// The `/metrics` text.
async fn metrics_text(addr: SocketAddr) -> String {
    let response = get(addr, "/metrics", Some(ADMIN_KEY)).await;
    assert_eq!(response.status, 200);
    String::from_utf8(response.body).expect("UTF-8 metrics")
}

/// The first event of `/ui/events` under the admin key.
async fn first_ui_event(addr: SocketAddr) -> Value {
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    let (res, _) = monoio::io::AsyncWriteRentExt::write_all(
        &mut tcp,
        request("GET", "/ui/events", Some(ADMIN_KEY), false, ""),
    )
    .await;
    res.expect("write");
    let mut seen = Vec::new();
    loop {
        if let Some(start) = seen.windows(6).position(|w| w == b"data: ") {
            if let Some(len) = seen[start..].windows(2).position(|w| w == b"\n\n") {
                return serde_json::from_slice(&seen[start + 6..start + len])
                    .expect("an event is JSON");
            }
        }
        let (res, buf) = tcp.read(Vec::with_capacity(16 * 1024)).await;
        assert!(res.expect("read events") > 0, "the event stream ended");
        seen.extend_from_slice(&buf);
    }
}

/// Reads `client` to its end after `seen`: the whole response.
async fn rest_of(client: &mut TcpStream, mut seen: Vec<u8>) -> HttpResponse {
    loop {
        let (res, buf) = client.read(Vec::with_capacity(16 * 1024)).await;
        match res.expect("read the response") {
            0 => return parse_response(&seen),
            _ => seen.extend_from_slice(&buf),
        }
    }
}

/// The next tunnel request `node` gets, past credit frames and the
/// metrics commands of `/metrics` scrapes (a hand-driven node leaves them
/// unanswered: the scrape goes without its series).
async fn next_run(node: &mut RawNode) -> String {
    loop {
        match node.next_frame().await {
            Body::ProviderTunnelRequest(r) => return r.run_id,
            Body::FlowCredit(_) => {}
            Body::NodeCommandRequest(c) if c.r#type == pb::CommandType::Metrics as i32 => {}
            other => panic!("expected ProviderTunnelRequest, got {other:?}"),
        }
    }
}

/// The node answers `run` with a JSON `body`, whole.
async fn answer_json(node: &RawNode, run: &str, body: &'static [u8]) {
    tunnel_response_start(node, run, b"application/json").await;
    tunnel_body(node, run, 2, body).await;
    tunnel_end(node, run, 3).await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_drained_provider_takes_no_new_work_and_finishes_its_stream() {
    let pki = Pki::mint("admin-drain");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml_text(&pki));
        let addr = edge.client_addr;
        let mut node_a = ready_node(&edge, &pki, "node-a").await;
        let mut node_b = ready_node(&edge, &pki, "node-b").await;

        // One stream on each provider (the first to node-a, the first of
        // the pool; the second to the less loaded node-b): equal load, so
        // node-a would take the next one.
        let (mut stream_a, run_a, seen_a) =
            stream_in_flight(addr, &mut node_a, chat(BOTH, true)).await;
        let (mut stream_b, run_b, seen_b) =
            stream_in_flight(addr, &mut node_b, chat(BOTH, true)).await;

        let drained = admin(
            addr,
            "/admin/providers/node-a/a-mock/drain",
            Some(ADMIN_KEY),
        )
        .await;
        assert_eq!(drained.status, 200);
        assert_eq!(
            drained.json(),
            json!({"provider": "node-a/a-mock", "drained": true})
        );
        assert_eq!(drained.header("content-type"), Some("application/json"));
        // Idempotent.
        let again = admin(
            addr,
            "/admin/providers/node-a/a-mock/drain",
            Some(ADMIN_KEY),
        )
        .await;
        assert_eq!(
            (again.status, again.json()),
            (200, json!({"provider": "node-a/a-mock", "drained": true}))
        );

        // Shown in /status, /metrics and the status page.
        let status = admin_status(addr).await;
        let (t, f) = (json!(true), json!(false));
        assert_eq!(
            provider_drains(&status, "node-a"),
            [t.clone(), f.clone(), f.clone(), f.clone()]
        );
        assert_eq!(
            provider_drains(&status, "node-b"),
            [f.clone(), f.clone(), f.clone(), f.clone()]
        );
        assert_eq!(
            node_drains(&status, "node-a"),
            [f.clone(), f.clone(), f.clone()],
            "the node itself is not drained"
        );
        assert_eq!(
            entry(&status["providers"], "node_id", "node-a")["in_flight"],
            1
        );
        let metrics = metrics_text(addr).await;
        for line in [
            "iop_edge_provider_drained{node=\"node-a\",provider=\"a-mock\"} 1\n",
            "iop_edge_provider_drained{node=\"node-b\",provider=\"b-mock\"} 0\n",
            "iop_edge_node_drained{node=\"node-a\"} 0\n",
            "iop_edge_node_draining{node=\"node-a\"} 0\n",
            "iop_edge_provider_removed{node=\"node-a\",provider=\"a-mock\"} 0\n",
        ] {
            assert!(metrics.contains(line), "no {line:?} in\n{metrics}");
        }
        let event = first_ui_event(addr).await;
        let a = entry(&event["providers"], "node_id", "node-a");
        assert_eq!((&a["drained"], &a["node_drained"]), (&t, &f), "{a}");
        assert_eq!(
            entry(&event["providers"], "node_id", "node-b")["drained"],
            f
        );

        // The next request goes to node-b, although node-a comes first
        // in the pool at equal load.
        let next = monoio::spawn(http_exchange(addr, chat(BOTH, false)));
        let run = next_run(&mut node_b).await;
        answer_json(&node_b, &run, b"{\"served_by\":\"node-b\"}").await;
        let served = next.await;
        assert_eq!(
            (served.status, served.body.as_slice()),
            (200, &b"{\"served_by\":\"node-b\"}"[..])
        );

        // The stream on the drained provider runs to its end, whole.
        tunnel_body(&node_a, &run_a, 3, b"data: {\"n\":2}\n\n").await;
        tunnel_body(&node_a, &run_a, 4, b"data: [DONE]\n\n").await;
        tunnel_end(&node_a, &run_a, 5).await;
        let whole = rest_of(&mut stream_a, seen_a).await;
        assert_eq!(whole.status, 200);
        assert_eq!(
            whole.body,
            b"data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n"
        );
        tunnel_end(&node_b, &run_b, 3).await;
        let whole_b = rest_of(&mut stream_b, seen_b).await;
        assert_eq!(whole_b.body, FIRST_EVENT);

        // Undrained: node-a, first of the pool at equal (zero) load,
        // serves the next request.
        let undrained = admin(
            addr,
            "/admin/providers/node-a/a-mock/undrain",
            Some(ADMIN_KEY),
        )
        .await;
        assert_eq!(
            (undrained.status, undrained.json()),
            (200, json!({"provider": "node-a/a-mock", "drained": false}))
        );
        let status = admin_status(addr).await;
        assert_eq!(provider_drains(&status, "node-a")[0], f);
        assert!(metrics_text(addr)
            .await
            .contains("iop_edge_provider_drained{node=\"node-a\",provider=\"a-mock\"} 0\n"));
        let next = monoio::spawn(http_exchange(addr, chat(BOTH, false)));
        let run = next_run(&mut node_a).await;
        answer_json(&node_a, &run, b"{\"served_by\":\"node-a\"}").await;
        let served = next.await;
        assert_eq!(
            (served.status, served.body.as_slice()),
            (200, &b"{\"served_by\":\"node-a\"}"[..])
        );
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_drained_node_holds_its_queue_until_undrained_and_only_admins_drain() {
    let pki = Pki::mint("admin-node-drain");
    guarded(async {
        let edge = TestEdge::start(&pki, &edge_toml_text(&pki));
        let addr = edge.client_addr;
        let mut node_b = ready_node(&edge, &pki, "node-b").await;
        let path = "/admin/nodes/node-b/drain";

        // Who may: an admin key only; a POST declared JSON only.
        let anonymous = admin(addr, path, None).await;
        assert_eq!(anonymous.status, 401);
        let user = admin(addr, path, Some(USER_KEY)).await;
        assert_eq!(user.status, 403);
        assert_eq!(
            user.json(),
            admin_error(
                "this API key may not use /admin: give it scopes = [\"admin\"] in [[client_keys]]",
                "admin_scope_required"
            )
        );
        let form = http_exchange(addr, request("POST", path, Some(ADMIN_KEY), false, "")).await;
        assert_eq!(form.status, 415);
        let body = http_exchange(
            addr,
            request("POST", path, Some(ADMIN_KEY), true, "{\"x\":1}"),
        )
        .await;
        assert_eq!(body.status, 400);
        assert_eq!(body.json()["error"]["code"], "invalid_request");
        // None of those drained anything.
        assert_eq!(
            node_drains(&admin_status(addr).await, "node-b")[0],
            json!(false)
        );

        // Unknown targets.
        let unknown = admin(addr, "/admin/nodes/node-c/drain", Some(ADMIN_KEY)).await;
        assert_eq!(
            (unknown.status, unknown.json()),
            (
                404,
                admin_error(
                    "no node `node-c` in the running configuration",
                    "unknown_node"
                )
            )
        );
        let unknown = admin(
            addr,
            "/admin/providers/node-a/b-mock/undrain",
            Some(ADMIN_KEY),
        )
        .await;
        assert_eq!(
            (unknown.status, unknown.json()),
            (
                404,
                admin_error(
                    "no provider `node-a/b-mock` in the running configuration",
                    "unknown_provider"
                )
            )
        );
        let no_route = admin(addr, "/admin/nodes/node-b/drainage", Some(ADMIN_KEY)).await;
        assert_eq!(no_route.status, 404);
        assert_eq!(no_route.json()["error"]["code"], "not_found");

        // The admin drains node-b (a `{}` body is as good as none).
        let drained = http_exchange(addr, request("POST", path, Some(ADMIN_KEY), true, "{}")).await;
        assert_eq!(
            (drained.status, drained.json()),
            (200, json!({"node": "node-b", "drained": true}))
        );
        let status = admin_status(addr).await;
        let (t, f) = (json!(true), json!(false));
        assert_eq!(
            node_drains(&status, "node-b"),
            [t.clone(), f.clone(), f.clone()]
        );
        assert_eq!(
            provider_drains(&status, "node-b"),
            [f.clone(), t.clone(), f.clone(), f.clone()]
        );
        assert!(metrics_text(addr)
            .await
            .contains("iop_edge_node_drained{node=\"node-b\"} 1\n"));
        let event = first_ui_event(addr).await;
        assert_eq!(entry(&event["nodes"], "node_id", "node-b")["drained"], t);

        // A request for node-b's model waits in its queue ...
        let waiting = monoio::spawn(http_exchange(addr, chat(MODEL_B, false)));
        loop {
            let status = admin_status(addr).await;
            if entry(&status["providers"], "node_id", "node-b")["queued"] == 1 {
                break;
            }
            monoio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // ... and goes to node-b as soon as it is undrained.
        let undrained = admin(addr, "/admin/nodes/node-b/undrain", Some(ADMIN_KEY)).await;
        assert_eq!(
            (undrained.status, undrained.json()),
            (200, json!({"node": "node-b", "drained": false}))
        );
        let run = next_run(&mut node_b).await;
        answer_json(&node_b, &run, b"{\"after\":\"undrain\"}").await;
        let served = waiting.await;
        assert_eq!(
            (served.status, served.body.as_slice()),
            (200, &b"{\"after\":\"undrain\"}"[..])
        );
        assert_eq!(node_drains(&admin_status(addr).await, "node-b")[0], f);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn the_running_configuration_shows_no_secret_and_follows_a_reload() {
    let pki = Pki::mint("admin-config");
    guarded(async {
        let path = pki.dir.join("edge.toml");
        let text = edge_toml_text(&pki);
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let started = EdgeConfig::load(&path).unwrap();
        let addr = edge.client_addr;
        let mut node_b = ready_node(&edge, &pki, "node-b").await;

        assert_eq!(get(addr, "/admin/config", None).await.status, 401);
        let user = get(addr, "/admin/config", Some(USER_KEY)).await;
        assert_eq!(user.status, 403);
        assert_eq!(user.json()["error"]["code"], "admin_scope_required");
        assert_eq!(
            http_exchange(
                addr,
                request("POST", "/admin/config", Some(ADMIN_KEY), true, "")
            )
            .await
            .status,
            405
        );

        let first = get(addr, "/admin/config", Some(ADMIN_KEY)).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.header("content-type"), Some("application/json"));
        let body = String::from_utf8(first.body.clone()).unwrap();
        let secrets = [
            ADMIN_KEY.to_string(),
            USER_KEY.to_string(),
            blake3::hash(ADMIN_KEY.as_bytes()).to_hex().to_string(),
            blake3::hash(USER_KEY.as_bytes()).to_hex().to_string(),
        ];
        for secret in &secrets {
            assert!(!body.contains(secret.as_str()), "{secret} in {body}");
        }
        assert!(!body.contains("PRIVATE KEY"), "{body}");
        let doc = first.json();
        assert_eq!(doc["revision"], 1);
        let config = &doc["config"];
        assert_eq!(
            config["client_keys"],
            json!([
                {"principal": "ops", "scopes": ["admin"], "max_concurrent": null,
                 "requests_per_minute": null, "tokens_per_minute": null, "models": null},
                {"principal": "app", "scopes": [], "max_concurrent": null,
                 "requests_per_minute": null, "tokens_per_minute": null, "models": null},
            ])
        );
        assert_eq!(config["credentials"], Value::Null);
        assert_eq!(
            config["tls"]["key"],
            json!(pki.files.edge_tls_files().key_path.display().to_string()),
            "the path of the key, not the key"
        );
        let models: Vec<&Value> = config["models"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| &m["name"])
            .collect();
        assert_eq!(models, [MODEL, MODEL_B, BOTH]);

        // A stream on node-b, then a reload that removes node-b: it stays,
        // removed, while the stream runs, and is no drain target.
        let (mut stream, run, seen) =
            stream_in_flight(addr, &mut node_b, chat(MODEL_B, true)).await;
        let next_text = text
            .replace(
                &format!("[[models]]\nname = \"{MODEL_B}\"\nproviders = [\"node-b/b-mock\"]\n"),
                "",
            )
            .replace(
                "providers = [\"node-a/a-mock\", \"node-b/b-mock\"]",
                "providers = [\"node-a/a-mock\"]",
            );
        let node_b_table = next_text
            .find("[[nodes]]\nid = \"node-b\"")
            .expect("node-b's table");
        let node_b_end = next_text[node_b_table..]
            .find("[[models]]")
            .map(|i| node_b_table + i)
            .expect("models after the nodes");
        let next_text = format!("{}{}", &next_text[..node_b_table], &next_text[node_b_end..]);
        std::fs::write(&path, &next_text).unwrap();
        let (_, report) = server::reload(&edge.edge, &started, &path, 2).unwrap();
        assert_eq!(report.nodes_removed, ["node-b"]);

        let reloaded = get(addr, "/admin/config", Some(ADMIN_KEY)).await;
        let doc = reloaded.json();
        assert_eq!(doc["revision"], 2);
        assert_eq!(
            doc["digest"],
            blake3::hash(next_text.as_bytes()).to_hex().to_string()
        );
        let body = String::from_utf8(reloaded.body).unwrap();
        for secret in &secrets {
            assert!(!body.contains(secret.as_str()), "{secret} in {body}");
        }
        let nodes: Vec<&Value> = doc["config"]["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| &n["id"])
            .collect();
        assert_eq!(nodes, ["node-a"]);

        let status = admin_status(addr).await;
        let (t, f) = (json!(true), json!(false));
        assert_eq!(
            node_drains(&status, "node-b"),
            [f.clone(), f.clone(), t.clone()]
        );
        assert_eq!(
            provider_drains(&status, "node-b"),
            [f.clone(), f.clone(), f.clone(), t.clone()]
        );
        let metrics = metrics_text(addr).await;
        for line in [
            "iop_edge_node_removed{node=\"node-b\"} 1\n",
            "iop_edge_provider_removed{node=\"node-b\",provider=\"b-mock\"} 1\n",
            "iop_edge_node_removed{node=\"node-a\"} 0\n",
        ] {
            assert!(metrics.contains(line), "no {line:?} in\n{metrics}");
        }
        let gone = admin(addr, "/admin/nodes/node-b/drain", Some(ADMIN_KEY)).await;
        assert_eq!(
            (gone.status, gone.json()["error"]["code"].clone()),
            (404, json!("unknown_node"))
        );
        let gone = admin(
            addr,
            "/admin/providers/node-b/b-mock/drain",
            Some(ADMIN_KEY),
        )
        .await;
        assert_eq!(
            (gone.status, gone.json()["error"]["code"].clone()),
            (404, json!("unknown_provider"))
        );
        // The removed model is in no model view of the status page.
        let event = first_ui_event(addr).await;
        let shown: Vec<&Value> = event["models"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| &m["model"])
            .collect();
        assert_eq!(shown, [MODEL, BOTH]);

        // The stream still ends whole.
        tunnel_body(&node_b, &run, 3, b"data: [DONE]\n\n").await;
        tunnel_end(&node_b, &run, 4).await;
        let whole = rest_of(&mut stream, seen).await;
        assert_eq!(whole.body, b"data: {\"n\":1}\n\ndata: [DONE]\n\n");
        edge.stop().await;
    })
    .await;
}
