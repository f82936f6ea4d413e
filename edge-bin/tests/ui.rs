//! The status page on a real Edge: `GET /ui` serves the page; `GET
//! /ui/events` streams server-sent events that show the nodes (never their
//! connection generation, X5), providers and models, and follow a node that
//! goes away; with client keys only an
//! admin-scoped key gets events (401 without a key, 403 for another key);
//! at most `VIEWERS_MAX` viewers stream at once (503 beyond); a viewer that
//! never reads is reset at the write-stall timeout while the Edge keeps
//! serving.
//!
//! The tests share process-wide metrics (the write-stall count), so they
//! run one at a time ([`serial`]), each on its own thread and runtime (the
//! viewer slots are per core, that is per thread). Waits are bounded by [`TEST_TIMEOUT`] only as a safety net.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

use common::*;
use edge_bin::client::ui::VIEWERS_MAX;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use serde_json::Value;

const ADMIN_KEY: &str = "sk-ui-admin-5d1c7a90e2b4";
const USER_KEY: &str = "sk-ui-user-83f0b6c2a1d9";

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs `test` on its own monoio runtime, one such test at a time.
fn serial<F: Future<Output = ()>>(test: F) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .enable_timer()
        .build()
        .expect("monoio runtime")
        .block_on(guarded(test));
}

fn keyed_edge_toml(pki: &Pki) -> String {
    let key = |principal: &str, key: &str, extra: &str| {
        format!(
            "[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\n{extra}\n\n",
            blake3::hash(key.as_bytes()).to_hex()
        )
    };
    let options = EdgeOptions {
        extra_toml: key("ops", ADMIN_KEY, "scopes = [\"admin\"]") + &key("app", USER_KEY, ""),
        ..EdgeOptions::without_provider()
    };
    edge_toml(pki, &options)
}

fn get(path: &str, key: Option<&str>) -> Vec<u8> {
    let auth = key
        .map(|k| format!("authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n{auth}\r\n")
        .into_bytes()
}

/// A viewer of `/ui/events` with the response head read.
struct Viewer {
    tcp: TcpStream,
    seen: Vec<u8>,
    /// Where the next event is looked for in `seen`.
    next: usize,
    /// The text of the last event read.
    last: String,
}

impl Viewer {
    async fn open(addr: SocketAddr, key: Option<&str>) -> Self {
        let mut tcp = TcpStream::connect(addr).await.expect("connect");
        let (res, _) = tcp.write_all(get("/ui/events", key)).await;
        res.expect("write the request");
        let mut seen = Vec::new();
        read_until(&mut tcp, &mut seen, b"\r\n\r\n").await;
        let head_end = seen.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let head = String::from_utf8_lossy(&seen[..head_end]).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("content-type: text/event-stream"), "{head}");
        assert!(head.contains("transfer-encoding: chunked"), "{head}");
        Self {
            tcp,
            seen,
            next: head_end,
            last: String::new(),
        }
    }

    /// The next event's JSON (each event is one `data: <json>\n\n` line;
    /// the JSON holds no newline, so chunk framing never falls inside it).
    async fn event(&mut self) -> Value {
        loop {
            let rest = &self.seen[self.next..];
            if let Some(start) = rest.windows(6).position(|w| w == b"data: ") {
                if let Some(len) = rest[start..].windows(2).position(|w| w == b"\n\n") {
                    let json = &rest[start + 6..start + len];
                    self.last = String::from_utf8_lossy(json).into_owned();
                    self.next += start + len + 2;
                    return serde_json::from_slice(json).unwrap_or_else(|e| {
                        panic!("event is not JSON ({e}): {}", String::from_utf8_lossy(json))
                    });
                }
            }
            let (res, buf) = self.tcp.read(Vec::with_capacity(16 * 1024)).await;
            let n = res.expect("read events");
            assert!(n > 0, "the event stream ended");
            self.seen.extend_from_slice(&buf);
        }
    }

    /// The text of the last event [`Viewer::event`] read, as it came.
    fn last_text(&self) -> &str {
        &self.last
    }

    /// The next event in which `node_id` shows `connected`.
    async fn until_node(&mut self, node_id: &str, connected: bool) -> Value {
        loop {
            let event = self.event().await;
            if node(&event, node_id)["connected"] == connected {
                return event;
            }
        }
    }
}

fn node<'e>(event: &'e Value, node_id: &str) -> &'e Value {
    event["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["node_id"] == node_id)
        .unwrap_or_else(|| panic!("no node {node_id} in {event}"))
}

fn provider<'e>(event: &'e Value, node_id: &str) -> &'e Value {
    event["providers"]
        .as_array()
        .expect("providers")
        .iter()
        .find(|p| p["node_id"] == node_id)
        .unwrap_or_else(|| panic!("no provider of {node_id} in {event}"))
}

#[test]
fn the_page_and_its_events_show_the_nodes() {
    let pki = Pki::mint("ui-events");
    serial(async {
        let edge = TestEdge::without_provider(&pki);
        let page = http_exchange(edge.client_addr, get("/ui", None)).await;
        assert_eq!(page.status, 200);
        assert_eq!(
            page.header("content-type"),
            Some("text/html; charset=utf-8")
        );
        let html = String::from_utf8(page.body).expect("UTF-8 page");
        assert!(html.contains("<title>IOP Edge status</title>"), "{html}");
        assert_eq!(
            http_exchange(edge.client_addr, get("/ui/nope", None))
                .await
                .status,
            404
        );

        let node_a = ready_node(&edge, &pki, "node-a").await;
        let mut viewer = Viewer::open(edge.client_addr, None).await;
        let first = viewer.event().await;
        let a = node(&first, "node-a");
        assert_eq!(a["connected"], true, "{first}");
        assert_eq!(a["phase"], "ready");
        assert_eq!(a["version"], "test", "RegisterRequest.node_version");
        let since_ms = a["since_ms"].as_u64().expect("since_ms");
        let registration_age_ms = a["registration_age_ms"].as_u64().expect("registered");
        assert!(
            registration_age_ms >= since_ms,
            "registered, then ready: {a}"
        );
        // CONTRACT: X5 — a node's entry is exactly these fields: its
        // connection generation never leaves the Edge (R5), neither in
        // the events nor in /status.
        assert_eq!(
            a,
            &serde_json::json!({"node_id": "node-a", "connected": true, "phase": "ready",
                   "since_ms": since_ms, "version": "test",
                   "registration_age_ms": registration_age_ms,
                   "drained": false, "draining": false, "removed": false})
        );
        assert_eq!(
            node(&first, "node-b"),
            &serde_json::json!({"node_id": "node-b", "connected": false, "phase": "offline",
                   "since_ms": null, "version": "", "registration_age_ms": null,
                   "drained": false, "draining": false, "removed": false}),
            "never connected"
        );
        assert_eq!(viewer.last_text().matches("generation").count(), 0);
        let status_text = http_exchange(edge.client_addr, get("/status", None))
            .await
            .body;
        let status_text = String::from_utf8(status_text).expect("UTF-8 status");
        assert!(status_text.contains("\"node-a\""), "{status_text}");
        assert_eq!(status_text.matches("generation").count(), 0);
        let pa = provider(&first, "node-a");
        assert_eq!(
            (&pa["provider_id"], &pa["status"], &pa["capacity"]),
            (&"a-mock".into(), &"available".into(), &2.into())
        );
        let model = &first["models"][0];
        assert_eq!(
            (
                &model["model"],
                &model["providers"],
                &model["candidates"],
                &model["queued"]
            ),
            (&MODEL.into(), &1.into(), &1.into(), &0.into()),
            "{model}"
        );
        assert_eq!(
            first["traffic"]["requests_per_sec"],
            Value::Null,
            "no rate yet"
        );
        let second = viewer.event().await;
        assert_eq!(node(&second, "node-a")["connected"], true);
        assert!(
            second["traffic"]["requests_per_sec"].as_f64().is_some(),
            "a rate from the second event on: {second}"
        );

        // The node goes away: the next events say so.
        drop(node_a);
        let gone = viewer.until_node("node-a", false).await;
        assert_eq!(node(&gone, "node-a")["phase"], "offline");
        assert!(node(&gone, "node-a")["since_ms"].as_u64().is_some());
        assert_eq!(provider(&gone, "node-a")["connected"], false);
        assert_eq!(gone["models"][0]["candidates"], 0);
        let _back = ready_node(&edge, &pki, "node-a").await;
        let back = viewer.until_node("node-a", true).await;
        assert_eq!(node(&back, "node-a")["phase"], "ready");
        edge.stop().await;
    });
}

#[test]
fn events_need_an_admin_key_when_keys_are_configured() {
    let pki = Pki::mint("ui-keys");
    serial(async {
        let edge = TestEdge::start(&pki, &keyed_edge_toml(&pki));
        // The page holds no data: anyone gets it (it asks for the key).
        let page = http_exchange(edge.client_addr, get("/ui", None)).await;
        assert_eq!(page.status, 200);

        let anonymous = http_exchange(edge.client_addr, get("/ui/events", None)).await;
        assert_eq!(anonymous.status, 401, "{:?}", anonymous);
        let user = http_exchange(edge.client_addr, get("/ui/events", Some(USER_KEY))).await;
        assert_eq!(user.status, 403);
        assert_eq!(
            user.json(),
            serde_json::json!({"error": {
                "message": "this API key may not use /ui/events: give it scopes = [\"admin\"] in [[client_keys]]",
                "type": "admin_error", "param": null, "code": "admin_scope_required"}})
        );
        let mut admin = Viewer::open(edge.client_addr, Some(ADMIN_KEY)).await;
        let event = admin.event().await;
        assert_eq!(node(&event, "node-a")["connected"], false);
        edge.stop().await;
    });
}

#[test]
fn at_most_viewers_max_viewers_stream_at_once() {
    let pki = Pki::mint("ui-viewers");
    serial(async {
        let edge = TestEdge::without_provider(&pki);
        let mut viewers = Vec::new();
        for _ in 0..VIEWERS_MAX {
            let mut viewer = Viewer::open(edge.client_addr, None).await;
            viewer.event().await;
            viewers.push(viewer);
        }
        let refused = http_exchange(edge.client_addr, get("/ui/events", None)).await;
        assert_eq!(refused.status, 503);
        // The OpenAI error shape, `param` included, as every other error.
        assert_eq!(
            refused.json(),
            api_error(
                &format!("at most {VIEWERS_MAX} status page viewers at once on this core"),
                "ui_error",
                None,
                Some("too_many_viewers"),
            )
        );
        // A viewer that leaves gives its slot back (noticed while it waits
        // for its next event).
        drop(viewers.pop());
        let mut next = loop {
            monoio::time::sleep(std::time::Duration::from_millis(20)).await;
            let mut tcp = TcpStream::connect(edge.client_addr).await.expect("connect");
            let (res, _) = tcp.write_all(get("/ui/events", None)).await;
            res.expect("write");
            let mut seen = Vec::new();
            read_until(&mut tcp, &mut seen, b"\r\n\r\n").await;
            if seen.starts_with(b"HTTP/1.1 200") {
                break Viewer {
                    tcp,
                    seen,
                    next: 0,
                    last: String::new(),
                };
            }
            assert!(seen.starts_with(b"HTTP/1.1 503"), "{seen:?}");
        };
        next.event().await;
        edge.stop().await;
    });
}

#[test]
fn a_viewer_that_never_reads_is_reset_and_the_edge_keeps_serving() {
    let pki = Pki::mint("ui-stuck");
    serial(async {
        let options = EdgeOptions {
            edge_keys: "client_write_stall_timeout_ms = 300\n".into(),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let _node = ready_node(&edge, &pki, "node-a").await;
        // A small receive buffer: the Edge's writes stall after a few events.
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        socket.connect(&edge.client_addr.into()).expect("connect");
        socket.set_nonblocking(true).expect("non-blocking");
        let mut stuck = TcpStream::from_std(socket.into()).expect("monoio stream");
        let (res, _) = stuck.write_all(get("/ui/events", None)).await;
        res.expect("write the request");

        // Meanwhile another viewer streams on.
        let mut live = Viewer::open(edge.client_addr, None).await;
        loop {
            live.event().await;
            if metric(edge.client_addr, "iop_edge_client_write_stalls_total").await == 1 {
                break;
            }
        }
        let (end, read) = read_to_end(&mut stuck).await;
        assert_eq!(
            end,
            Err(std::io::ErrorKind::ConnectionReset),
            "after {read} bytes"
        );
        let event = live.event().await;
        assert_eq!(node(&event, "node-a")["connected"], true);
        let page = http_exchange(edge.client_addr, get("/ui", None)).await;
        assert_eq!(page.status, 200);
        edge.stop().await;
    });
}
