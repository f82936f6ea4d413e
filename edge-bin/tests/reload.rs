//! `server::reload` — what the binary's SIGHUP handler calls — applied to an
//! Edge served in process over real client sockets and a hand-driven node
//! on real mTLS: `[[client_keys]]` take effect without a restart.
//!
//! What is proven, in order and without timing: a stream let in under a
//! key runs to its end after the key was revoked, while every later request
//! with that key — on a new connection and on the stream's own keep-alive
//! connection — gets 401 in the OpenAI error shape; a key added by the
//! reload is let through to the node at once; and the report names what
//! changed and nothing needing a restart. `/admin` then follows the new
//! scopes. A reload whose only fault is a log path that cannot be opened
//! (the usage file's path became a directory, the access log names one)
//! still revokes the key it removes; each log keeps writing to the file it
//! has open, exactly the records it should, and the report, `/metrics` and
//! `/status` say which path failed and why.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::*;
use edge_bin::config::EdgeConfig;
use edge_bin::plane::client_keys::KeysChange;
use edge_bin::server;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use serde_json::{json, Value};

const KEY_A: &str = "sk-reload-a-6f1d93c2e8b7";
const KEY_B: &str = "sk-reload-b-0a4e7c19d25f";
const KEY_OPS: &str = "sk-reload-ops-3b8e51d7c0a2";

/// The test Edge's config with these `(principal, key, scopes)` client keys.
fn edge_toml_with_keys(pki: &Pki, keys: &[(&str, &str, &str)]) -> String {
    let scoped: Vec<(&str, &str, String)> = keys
        .iter()
        .map(|&(principal, key, scopes)| (principal, key, format!("scopes = [{scopes}]")))
        .collect();
    let keys: Vec<(&str, &str, &str)> = scoped
        .iter()
        .map(|(principal, key, scopes)| (*principal, *key, scopes.as_str()))
        .collect();
    edge_toml_with_client_keys(pki, &keys)
}

/// A chat request for [`MODEL`] with `key`; `close` asks for
/// `connection: close`.
fn chat_request(key: &str, stream: bool, close: bool) -> Vec<u8> {
    let body = serde_json::json!({
        "model": MODEL,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    let connection = if close { "close" } else { "keep-alive" };
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: {connection}\r\n\
         authorization: Bearer {key}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

fn admin_request(key: &str) -> Vec<u8> {
    let body = br#"{"type":"provider_status"}"#;
    let mut request = format!(
        "POST /admin/nodes/node-a/commands HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
         authorization: Bearer {key}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

fn invalid_key() -> serde_json::Value {
    api_error(
        "Incorrect API key provided.",
        "invalid_request_error",
        None,
        Some("invalid_api_key"),
    )
}

#[monoio::test_all(timer_enabled = true)]
async fn a_key_revoked_by_reload_gets_401_next_while_its_stream_finishes() {
    guarded(async {
        let pki = Pki::mint("reload-keys");
        let path = pki.dir.join("edge.toml");
        let text = edge_toml_with_keys(&pki, &[("team-a", KEY_A, "")]);
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let running = EdgeConfig::load(&path).unwrap();
        let mut node = ready_node(&edge, &pki, "node-a").await;

        // A stream under KEY_A, in flight: its head and first event are out.
        let (mut client, run, mut seen) = stream_in_flight(
            edge.client_addr,
            &mut node,
            chat_request(KEY_A, true, false),
        )
        .await;

        // SIGHUP: team-a revoked, team-b added.
        std::fs::write(&path, edge_toml_with_keys(&pki, &[("team-b", KEY_B, "")])).unwrap();
        let (_, report) = server::reload(&edge.edge, &running, &path, 2).unwrap();
        assert_eq!(
            report.client_keys,
            KeysChange {
                keys: 1,
                added: 1,
                revoked: 1,
                changed: 0
            }
        );
        assert_eq!(report.restart_required, Vec::<&str>::new());

        let refused = http_exchange(edge.client_addr, chat_request(KEY_A, false, true)).await;
        assert_eq!(refused.status, 401);
        assert_eq!(refused.json(), invalid_key());

        // The added key is let in: its request reaches the node.
        let added = monoio::spawn(http_exchange(
            edge.client_addr,
            chat_request(KEY_B, false, true),
        ));
        let second = next_tunnel(&mut node).await.run_id;
        assert_ne!(second, run);
        tunnel_response_start(&node, &second, b"application/json").await;
        tunnel_body(&node, &second, 2, b"{\"ok\":true}").await;
        tunnel_end(&node, &second, 3).await;
        let added = added.await;
        assert_eq!((added.status, added.body), (200, b"{\"ok\":true}".to_vec()));

        // The stream let in under the revoked key runs to its end.
        tunnel_body(&node, &run, 3, b"data: {\"n\":2}\n\ndata: [DONE]\n\n").await;
        tunnel_end(&node, &run, 4).await;
        read_until(&mut client, &mut seen, b"\r\n0\r\n\r\n").await;
        let stream = parse_response(&seen);
        assert_eq!(stream.status, 200);
        assert_eq!(
            stream.body,
            b"data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n".to_vec()
        );

        // Its own keep-alive connection: the next request is refused.
        let (res, _) = client.write_all(chat_request(KEY_A, false, true)).await;
        res.unwrap();
        let mut rest = Vec::new();
        loop {
            let (res, buf) = client.read(Vec::with_capacity(4096)).await;
            match res.expect("read") {
                0 => break,
                _ => rest.extend_from_slice(&buf),
            }
        }
        let again = parse_response(&rest);
        assert_eq!(again.status, 401);
        assert_eq!(again.json(), invalid_key());
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn admin_follows_the_scopes_of_a_reload() {
    guarded(async {
        let pki = Pki::mint("reload-admin");
        let path = pki.dir.join("edge.toml");
        let text = edge_toml_with_keys(&pki, &[("ops", KEY_A, "\"admin\""), ("team-b", KEY_B, "")]);
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let running = EdgeConfig::load(&path).unwrap();
        let addr: SocketAddr = edge.client_addr;
        // No node is connected: a caller with the scope gets past the
        // check to the command route's own 404.
        let code = |r: &HttpResponse| {
            (
                r.status,
                r.json()["error"]["code"].as_str().unwrap().to_owned(),
            )
        };
        let ops = http_exchange(addr, admin_request(KEY_A)).await;
        assert_eq!(code(&ops), (404, "node_not_ready".to_owned()));
        let team = http_exchange(addr, admin_request(KEY_B)).await;
        assert_eq!(code(&team), (403, "admin_scope_required".to_owned()));

        std::fs::write(
            &path,
            edge_toml_with_keys(&pki, &[("ops", KEY_A, ""), ("team-b", KEY_B, "\"admin\"")]),
        )
        .unwrap();
        let (_, report) = server::reload(&edge.edge, &running, &path, 2).unwrap();
        assert_eq!(
            report.client_keys,
            KeysChange {
                keys: 2,
                added: 0,
                revoked: 0,
                changed: 2
            }
        );
        let ops = http_exchange(addr, admin_request(KEY_A)).await;
        assert_eq!(code(&ops), (403, "admin_scope_required".to_owned()));
        let team = http_exchange(addr, admin_request(KEY_B)).await;
        assert_eq!(code(&team), (404, "node_not_ready".to_owned()));
        edge.stop().await;
    })
    .await;
}

/// The test Edge's config with these `(principal, key, scopes)` client
/// keys, the usage file at `usage` and a JSON access log at `access`.
fn edge_toml_with_logs(
    pki: &Pki,
    keys: &[(&str, &str, &str)],
    usage: &Path,
    access: &Path,
) -> String {
    let keys: String = keys
        .iter()
        .map(|(principal, key, scopes)| {
            format!(
                "[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\nscopes = [{scopes}]\n\n",
                blake3::hash(key.as_bytes()).to_hex()
            )
        })
        .collect();
    let options = EdgeOptions {
        extra_toml: format!(
            "{keys}[edge.usage_log]\npath = \"{}\"\n\n\
             [edge.access_log]\ndestination = \"{}\"\nformat = \"json\"\n",
            usage.display(),
            access.display()
        ),
        ..EdgeOptions::without_provider()
    };
    edge_toml(pki, &options)
}

/// A chat request with `key` and `x-request-id: <id>`, on its own
/// connection.
fn chat_with_id(key: &str, id: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
         x-request-id: {id}\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

/// Sends [`chat_with_id`] and answers its tunnel on `node` with a small
/// JSON body: the client's response.
async fn answered(edge: &TestEdge, node: &mut RawNode, key: &str, id: &str) -> HttpResponse {
    let (addr, request) = (edge.client_addr, chat_with_id(key, id));
    let client = monoio::spawn(async move { http_exchange(addr, request).await });
    let run = next_tunnel(node).await.run_id;
    tunnel_response_start(node, &run, b"application/json").await;
    tunnel_body(node, &run, 2, b"{\"ok\":true}").await;
    tunnel_end(node, &run, 3).await;
    client.await
}

/// The usage record of a completed request `id` under `principal` (the
/// node reported no usage), without its timing fields.
fn usage_record(id: &str, principal: &str) -> Value {
    json!({
        "request_id": id, "principal": principal, "path": "/v1/chat/completions",
        "model": MODEL, "provider": "node-a/a-mock", "node": "node-a", "status": 200,
        "outcome": "completed", "attempts": 1, "usage": "none",
        "prompt_tokens": null, "completion_tokens": null, "total_tokens": null,
    })
}

/// The JSON lines of `path`, each without the fields that vary from run to
/// run (`ts`, `duration_ms`, `ttft_ms`; `ts` is checked to be there).
fn lines_without_timing(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let mut value: Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
            let object = value.as_object_mut().expect("a JSON object");
            assert!(object.remove("ts").is_some(), "{line}");
            object.remove("duration_ms");
            object.remove("ttft_ms");
            value
        })
        .collect()
}

/// Polls until `done` holds (an outcome; [`guarded`] bounds the test).
async fn wait_until(mut done: impl FnMut() -> bool) {
    while !done() {
        monoio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn a_log_path_that_cannot_be_opened_keeps_its_log_and_the_rest_applies() {
    guarded(async {
        let pki = Pki::mint("reload-logs");
        let path = pki.dir.join("edge.toml");
        let usage = pki.dir.join("usage.jsonl");
        let rotated = pki.dir.join("usage.jsonl.1");
        let access = pki.dir.join("access.log");
        let access_dir = pki.dir.join("access-dir");
        for stale in [&usage, &rotated, &access, &access_dir] {
            let _ = std::fs::remove_file(stale);
            let _ = std::fs::remove_dir(stale);
        }
        let text = edge_toml_with_logs(
            &pki,
            &[("ops", KEY_OPS, "\"admin\""), ("team-a", KEY_A, "")],
            &usage,
            &access,
        );
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start(&pki, &text);
        let running = EdgeConfig::load(&path).unwrap();
        let mut node = ready_node(&edge, &pki, "node-a").await;
        let addr = edge.client_addr;

        let first = answered(&edge, &mut node, KEY_A, "r-1").await;
        assert_eq!((first.status, first.body), (200, b"{\"ok\":true}".to_vec()));
        wait_until(|| lines_without_timing(&usage).len() == 1).await;

        // The usage file is rotated, and a directory takes its path; the
        // access log is pointed at a directory; team-a is revoked.
        std::fs::rename(&usage, &rotated).unwrap();
        std::fs::create_dir(&usage).unwrap();
        std::fs::create_dir(&access_dir).unwrap();
        std::fs::write(
            &path,
            edge_toml_with_logs(&pki, &[("ops", KEY_OPS, "\"admin\"")], &usage, &access_dir),
        )
        .unwrap();
        let (_, report) = server::reload(&edge.edge, &running, &path, 2).unwrap();
        let is_a_directory = |p: &Path| {
            format!(
                "cannot open {} for appending: Is a directory (os error 21)",
                p.display()
            )
        };
        assert_eq!(
            report.kept_operational,
            vec![
                format!(
                    "{}: edge.access_log.destination: {}; keeping the running access log ({})",
                    path.display(),
                    is_a_directory(&access_dir),
                    access.display()
                ),
                format!(
                    "{}: edge.usage_log.path: {}; keeping the running usage log (opened as {})",
                    path.display(),
                    is_a_directory(&usage),
                    usage.display()
                ),
            ]
        );
        assert_eq!(report.restart_required, Vec::<&str>::new());
        assert_eq!(
            report.client_keys,
            KeysChange {
                keys: 1,
                added: 0,
                revoked: 1,
                changed: 0
            }
        );

        // The revocation applied.
        let refused = http_exchange(addr, chat_with_id(KEY_A, "r-401")).await;
        assert_eq!(refused.status, 401);
        assert_eq!(refused.json(), invalid_key());
        let second = answered(&edge, &mut node, KEY_OPS, "r-2").await;
        assert_eq!(second.status, 200);

        // The failures are visible.
        for (name, value) in [
            ("iop_edge_usage_log_failing", 1),
            ("iop_edge_usage_log_open_errors_total", 1),
            ("iop_edge_usage_log_write_errors_total", 0),
            ("iop_edge_access_log_failing", 1),
            ("iop_edge_access_log_open_errors_total", 1),
            ("iop_edge_access_log_write_errors_total", 0),
        ] {
            assert_eq!(metric(addr, name).await, value, "{name}");
        }
        let get_status = format!(
            "GET /status HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
             authorization: Bearer {KEY_OPS}\r\n\r\n"
        );
        let status = http_exchange(addr, get_status.into_bytes()).await;
        assert_eq!(status.status, 200);
        let logs = status.json()["logs"].clone();
        assert_eq!(
            logs["usage_log"],
            json!({
                "path": usage.display().to_string(), "failing": true,
                "open_error": is_a_directory(&usage), "write_error": null,
                "open_errors_total": 1, "write_errors_total": 0, "dropped_records_total": 0,
            })
        );
        let access_entry = &logs["access_log"];
        assert_eq!(
            (
                &access_entry["destination"],
                &access_entry["failing"],
                &access_entry["open_error"],
                &access_entry["write_error"],
                &access_entry["open_errors_total"],
            ),
            (
                &json!(access.display().to_string()),
                &json!(true),
                &json!(is_a_directory(&access_dir)),
                &Value::Null,
                &json!(1),
            )
        );

        // The access log went on in its file: both chat requests and the
        // refused one, in order.
        let chats = || {
            lines_without_timing(&access)
                .into_iter()
                .filter(|l| l["path"] == "/v1/chat/completions")
                .map(|l| {
                    (
                        l["request_id"].clone(),
                        l["principal"].clone(),
                        l["status"].clone(),
                    )
                })
                .collect::<Vec<_>>()
        };
        wait_until(|| chats().len() == 3).await;
        assert_eq!(
            chats(),
            vec![
                (json!("r-1"), json!("team-a"), json!(200)),
                (json!("r-401"), json!("anonymous"), json!(401)),
                (json!("r-2"), json!("ops"), json!(200)),
            ]
        );
        edge.stop().await;
        // The usage file went on in the file it had open: exactly the two
        // authenticated requests.
        assert_eq!(
            lines_without_timing(&rotated),
            vec![usage_record("r-1", "team-a"), usage_record("r-2", "ops")]
        );
        assert!(usage.is_dir() && access_dir.is_dir());
    })
    .await;
}
