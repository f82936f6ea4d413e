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
//! scopes.

mod common;

use std::net::SocketAddr;

use common::*;
use edge_bin::config::EdgeConfig;
use edge_bin::plane::client_keys::KeysChange;
use edge_bin::server;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};

const KEY_A: &str = "sk-reload-a-6f1d93c2e8b7";
const KEY_B: &str = "sk-reload-b-0a4e7c19d25f";

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
