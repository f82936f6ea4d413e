//! What one request or a handful of sockets could take from an Edge, tried
//! as an attacker would, over real sockets: a wrong key with a 10 MB
//! `Content-Length`, sockets that never send their body, a body trickled
//! below the minimum rate, one address opening more than its share of
//! connections, idle keep-alive connections filling the cap, silent sockets
//! holding the node port's handshake places, a scrape flood on `/metrics`,
//! a restricted key reading `/status`, and a web page reaching `/admin`
//! through DNS rebinding or a cross-site form.
//!
//! Time bounds are generous (a loaded 2-core machine); each test would hang
//! far past them on an Edge without the defence it checks.

mod common;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::time::Duration;

use common::*;
use iop_engine::clock;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt, Splitable};
use monoio::net::TcpStream;
use node_bin::config::NodeConfig;
use node_bin::supervisor;
use serde_json::{json, Value};

/// Far above every configured limit below, even on a loaded machine.
const GENEROUS: Duration = Duration::from_secs(20);

const KEY: &str = "sk-hostile-test-key";
const METRICS_KEY: &str = "sk-hostile-metrics-key";
const LIMITED_KEY: &str = "sk-hostile-limited-key";

fn keyed_edge(pki: &Pki, edge_keys: &str) -> TestEdge {
    let key = |principal: &str, key: &str, extra: &str| {
        format!(
            "[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\n{extra}\n\n",
            blake3::hash(key.as_bytes()).to_hex()
        )
    };
    let options = EdgeOptions {
        edge_keys: edge_keys.to_string(),
        extra_toml: key("team-a", KEY, "")
            + &key("scraper", METRICS_KEY, "scopes = [\"metrics\"]")
            + &key("limited", LIMITED_KEY, &format!("models = [\"{MODEL}\"]")),
        ..EdgeOptions::without_provider()
    };
    TestEdge::start(pki, &edge_toml(pki, &options))
}

fn open_edge(pki: &Pki, edge_keys: &str) -> TestEdge {
    let options = EdgeOptions {
        edge_keys: edge_keys.to_string(),
        ..EdgeOptions::without_provider()
    };
    TestEdge::start(pki, &edge_toml(pki, &options))
}

async fn write(tcp: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    tcp.write_all(bytes.to_vec()).await.0.map(|_| ())
}

/// Reads until the peer closes or `limit` bytes, whichever first; what a
/// reset ends is returned as read so far.
async fn read_all(tcp: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let (res, buf) = tcp.read(Vec::with_capacity(16 * 1024)).await;
        match res {
            Ok(0) | Err(_) => return out,
            Ok(_) => out.extend_from_slice(&buf),
        }
    }
}

/// Reads one whole response (head and `content-length` body) and leaves
/// the connection open.
async fn read_response(tcp: &mut TcpStream) -> HttpResponse {
    let seen = read_one(tcp).await;
    assert!(!seen.is_empty(), "closed before a response");
    parse_response(&seen)
}

/// The bytes of one response on a kept-alive connection (head and
/// `content-length` body), or whatever came before the close.
async fn read_one(tcp: &mut TcpStream) -> Vec<u8> {
    let mut seen = Vec::new();
    loop {
        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap())
                .unwrap_or(0);
            if seen.len() >= end + 4 + len {
                seen.truncate(end + 4 + len);
                return seen;
            }
        }
        let (res, buf) = tcp.read(Vec::with_capacity(16 * 1024)).await;
        match res {
            Ok(0) | Err(_) => return seen,
            Ok(_) => seen.extend_from_slice(&buf),
        }
    }
}

/// A TCP connection to `to` from loopback address `source` (the kernel
/// routes all of 127/8 to loopback): a second "host" on one machine.
fn connect_from(source: Ipv4Addr, to: SocketAddr) -> std::net::TcpStream {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    let SocketAddr::V4(to) = to else {
        panic!("the test listeners are IPv4")
    };
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    bind(
        fd.as_raw_fd(),
        &SockaddrIn::from(SocketAddrV4::new(source, 0)),
    )
    .expect("bind");
    connect(fd.as_raw_fd(), &SockaddrIn::from(to)).expect("connect");
    std::net::TcpStream::from(fd)
}

/// [`connect_from`] as a monoio stream.
fn monoio_from(source: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let std = connect_from(source, to);
    std.set_nonblocking(true).expect("nonblocking");
    TcpStream::from_std(std).expect("monoio stream")
}

fn keep_alive_get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n").into_bytes()
}

fn get_with_key(path: &str, key: Option<&str>) -> Vec<u8> {
    let auth = key
        .map(|k| format!("authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n{auth}\r\n")
        .into_bytes()
}

/// A chat request head announcing `content_length` body bytes, none sent.
fn head_only(path: &str, key_header: &str, content_length: usize) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\n{key_header}\
         content-type: application/json\r\ncontent-length: {content_length}\r\n\r\n"
    )
    .into_bytes()
}

// Finding 2: a wrong key is refused on the request head, before a byte of
// the body: the client announcing 10 MB gets its 401 (in the route's
// shape) having sent nothing more, with `connection: close`.
#[monoio::test_all(timer_enabled = true)]
async fn a_wrong_key_is_refused_on_the_head_before_any_body_byte() {
    guarded(async {
        let pki = Pki::mint("hostile-401");
        let edge = keyed_edge(&pki, "");
        for (path, key_header, shape) in [
            (
                "/v1/chat/completions",
                "authorization: Bearer sk-wrong\r\n",
                "openai",
            ),
            ("/v1/messages", "x-api-key: sk-wrong\r\n", "anthropic"),
            ("/v1/chat/completions", "", "openai"),
        ] {
            let mut tcp = TcpStream::connect(edge.client_addr).await.unwrap();
            write(&mut tcp, &head_only(path, key_header, 10_000_000))
                .await
                .unwrap();
            let started = clock::now();
            let answer = read_response(&mut tcp).await;
            assert!(clock::now().duration_since(started) < GENEROUS);
            assert_eq!(answer.status, 401, "{answer:?}");
            assert_eq!(answer.header("connection"), Some("close"));
            let body = answer.json();
            match shape {
                "openai" => assert_eq!(body["error"]["type"], "invalid_request_error", "{body}"),
                _ => {
                    assert_eq!(body["type"], "error", "{body}");
                    assert_eq!(body["error"]["type"], "authentication_error", "{body}");
                }
            }
            // The Edge lingers for the body it will never read, then ends.
            drop(tcp);
        }
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_auth_refusals_total").await,
            3
        );
        edge.stop().await;
    })
    .await;
}

// Finding 2: sockets without a key that announce a 10 MB body and then
// trickle a byte now and then cannot fill `max_client_connections`: each
// is answered 401 on its head and let go after a short lingering close,
// and a client with a key is served meanwhile.
#[monoio::test_all(timer_enabled = true)]
async fn keyless_sockets_that_never_send_their_body_cannot_fill_the_cap() {
    guarded(async {
        let pki = Pki::mint("hostile-fill");
        let edge = keyed_edge(
            &pki,
            "max_client_connections = 8\nclient_linger_idle_timeout_ms = 300\n",
        );
        let mut attackers = Vec::new();
        for _ in 0..32 {
            let addr = edge.client_addr;
            attackers.push(monoio::spawn(async move {
                let mut tcp = TcpStream::connect(addr).await.unwrap();
                write(&mut tcp, &head_only("/v1/chat/completions", "", 10_000_000))
                    .await
                    .unwrap();
                let trickle = async {
                    // A byte every 2 s: never idle past the body timeout.
                    loop {
                        monoio::time::sleep(Duration::from_secs(2)).await;
                        if write(&mut tcp, b"x").await.is_err() {
                            return;
                        }
                    }
                };
                let _ = monoio::time::timeout(Duration::from_secs(3), trickle).await;
            }));
        }
        // A keyed client gets through while they trickle.
        let started = clock::now();
        let mut tcp = TcpStream::connect(edge.client_addr).await.unwrap();
        write(&mut tcp, &get_with_key("/v1/models", Some(KEY)))
            .await
            .unwrap();
        let answer = parse_response(&read_all(&mut tcp).await);
        assert_eq!(answer.status, 200, "{answer:?}");
        assert!(clock::now().duration_since(started) < GENEROUS);
        for attacker in attackers {
            attacker.await;
        }
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_auth_refusals_total").await,
            32
        );
        edge.stop().await;
    })
    .await;
}

// Finding 2: an authenticated body trickled below the minimum rate is cut
// off once its grace has passed (408), although it never pauses long
// enough for the idle bound.
#[monoio::test_all(timer_enabled = true)]
async fn a_body_below_the_minimum_rate_is_cut_off_after_its_grace() {
    guarded(async {
        let pki = Pki::mint("hostile-rate");
        let edge = keyed_edge(
            &pki,
            "client_body_grace_ms = 500\nclient_body_min_rate_bytes_per_sec = 1024\n",
        );
        let mut tcp = TcpStream::connect(edge.client_addr).await.unwrap();
        write(
            &mut tcp,
            &head_only(
                "/v1/chat/completions",
                &format!("authorization: Bearer {KEY}\r\n"),
                100_000,
            ),
        )
        .await
        .unwrap();
        let started = clock::now();
        // One task trickles a byte every 100 ms (10 bytes a second, never
        // idle for long) until the Edge cuts it off; the other reads.
        let (mut reader, mut writer) = tcp.into_split();
        let trickle = monoio::spawn(async move {
            while clock::now().duration_since(started) < GENEROUS {
                monoio::time::sleep(Duration::from_millis(100)).await;
                if writer.write_all(b"{".to_vec()).await.0.is_err() {
                    return;
                }
            }
        });
        let mut answer = Vec::new();
        loop {
            let (res, buf) = reader.read(Vec::with_capacity(4096)).await;
            match res {
                Ok(0) | Err(_) => break,
                Ok(_) => answer.extend_from_slice(&buf),
            }
        }
        trickle.await;
        let response = parse_response(&answer);
        assert_eq!(response.status, 408, "{response:?}");
        assert!(clock::now().duration_since(started) < GENEROUS);
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_body_timeouts_total").await,
            1
        );
        edge.stop().await;
    })
    .await;
}

// The per-peer cap: one address holds at most its share of connections;
// the one past it gets 429 `too_many_connections` at once, another address
// is served, and a place given back is taken again.
#[monoio::test_all(timer_enabled = true)]
async fn one_address_holds_at_most_its_share_of_client_connections() {
    guarded(async {
        let pki = Pki::mint("hostile-peer-cap");
        let edge = open_edge(&pki, "max_client_connections_per_peer = 4\n");
        let attacker = Ipv4Addr::new(127, 0, 0, 2);
        let mut held = Vec::new();
        for _ in 0..4 {
            let mut tcp = monoio_from(attacker, edge.client_addr);
            write(&mut tcp, &keep_alive_get("/livez")).await.unwrap();
            assert_eq!(read_response(&mut tcp).await.status, 200);
            held.push(tcp);
        }
        let mut fifth = monoio_from(attacker, edge.client_addr);
        let refused = parse_response(&read_all(&mut fifth).await);
        assert_eq!(refused.status, 429, "{refused:?}");
        assert_eq!(refused.header("retry-after"), Some("1"));
        assert_eq!(
            refused.json(),
            json!({"error": {
                "message": "Too many open connections from your address.",
                "type": "rate_limit_error",
                "param": null,
                "code": "too_many_connections",
            }})
        );
        // Another address is not affected.
        let other = http_request(edge.client_addr, "GET", "/livez", b"").await;
        assert_eq!(other.status, 200);
        // A place given back is taken again.
        drop(held.pop());
        let started = clock::now();
        loop {
            let mut tcp = monoio_from(attacker, edge.client_addr);
            write(&mut tcp, &keep_alive_get("/readyz")).await.unwrap();
            let answer = parse_response(&read_one(&mut tcp).await);
            if answer.status == 200 {
                break;
            }
            assert!(clock::now().duration_since(started) < GENEROUS);
            monoio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(metric(edge.client_addr, "iop_edge_client_peer_cap_refusals_total").await >= 1);
        edge.stop().await;
    })
    .await;
}

// Finding 3: at `max_client_connections` an idle keep-alive connection
// makes room for a new client: the longest idle one is closed, never one
// with a request in flight. With a cap of 2, a stream in flight and an idle
// connection: each new client is served at once, the idle connection is
// reclaimed, and the stream still finishes.
#[monoio::test_all(timer_enabled = true)]
async fn at_the_cap_the_longest_idle_keep_alive_connection_makes_room() {
    guarded(async {
        let pki = Pki::mint("hostile-idle");
        let edge = open_edge(&pki, "max_client_connections = 2\n");
        let mut node = ready_node(&edge, &pki, "node-a").await;
        // A stream in flight.
        let request = {
            let body = format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"stream":true}}"#
            );
            let mut r = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            r.extend_from_slice(body.as_bytes());
            r
        };
        let (mut streaming, run, mut seen) =
            stream_in_flight(edge.client_addr, &mut node, request).await;
        // An idle keep-alive connection.
        let mut idle = TcpStream::connect(edge.client_addr).await.unwrap();
        write(&mut idle, &keep_alive_get("/livez")).await.unwrap();
        assert_eq!(read_response(&mut idle).await.status, 200);
        // Two new clients, one after the other: each is served at once,
        // and the one idle before it is closed for it.
        let mut reclaimed = Vec::new();
        for path in ["/livez", "/readyz"] {
            let started = clock::now();
            let mut fresh = TcpStream::connect(edge.client_addr).await.unwrap();
            write(&mut fresh, &keep_alive_get(path)).await.unwrap();
            assert_eq!(read_response(&mut fresh).await.status, 200);
            assert!(clock::now().duration_since(started) < GENEROUS);
            // `fresh` stays open and idle: the next client reclaims it.
            reclaimed.push(std::mem::replace(&mut idle, fresh));
        }
        for mut tcp in reclaimed {
            // Closed by the Edge, with no answer to a request it never had.
            assert_eq!(read_all(&mut tcp).await, b"");
        }
        // The counter is read on a connection of its own, which reclaims
        // the last idle one too.
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_idle_reclaimed_total").await,
            3
        );
        // The stream in flight was never taken: it finishes whole.
        tunnel_body(&node, &run, 3, b"data: [DONE]\n\n").await;
        tunnel_end(&node, &run, 4).await;
        read_until(&mut streaming, &mut seen, b"data: [DONE]").await;
        edge.stop().await;
    })
    .await;
}

/// Starts a real Node (the node-bin supervisor) dialling `edge`; the
/// returned sender stops it.
fn start_node(
    edge: &TestEdge,
    pki: &Pki,
) -> (
    iop_engine::sync::oneshot::Sender<()>,
    monoio::task::JoinHandle<supervisor::Exit>,
) {
    let node_cfg = NodeConfig::parse(
        &node_toml(pki, "node-a", edge.node_addr),
        pki.dir.join("node.toml"),
    )
    .expect("node config");
    let (stop, stopped) = iop_engine::sync::oneshot::channel::<()>();
    let node = monoio::spawn(supervisor::run(
        node_cfg,
        Some(pki.connector("node-a")),
        Box::pin(async move {
            let _ = stopped.await;
        }),
    ));
    (stop, node)
}

// Finding 4: 80 silent sockets from one address cannot hold the node
// port: that address gets `max_node_handshakes_per_peer` handshake places,
// the rest are closed at once, and a real Node from another address
// registers at once (the deadlines here are a minute: only the per-peer
// cap can let it in within the bound).
#[monoio::test_all(timer_enabled = true)]
async fn silent_sockets_from_one_address_cannot_hold_the_node_port() {
    guarded(async {
        let pki = Pki::mint("hostile-node-peer");
        let edge = open_edge(
            &pki,
            "node_handshake_timeout_ms = 60000\nnode_first_byte_timeout_ms = 60000\n",
        );
        let attacker = Ipv4Addr::new(127, 0, 0, 2);
        let silent: Vec<_> = (0..80)
            .map(|_| connect_from(attacker, edge.node_addr))
            .collect();
        let started = clock::now();
        let (stop, node) = start_node(&edge, &pki);
        wait_connected(edge.client_addr, "node-a", true).await;
        let took = clock::now().duration_since(started);
        assert!(took < GENEROUS, "registered after {took:?}");
        assert_eq!(
            metric(edge.client_addr, "iop_edge_node_peer_cap_refusals_total").await,
            72
        );
        let _ = stop.send(());
        node.await;
        drop(silent);
        edge.stop().await;
    })
    .await;
}

// Finding 4: silent sockets from many addresses fill every handshake
// place, but each gives its place back at the first-byte deadline, far
// sooner than the handshake deadline: a real Node registers within
// seconds.
#[monoio::test_all(timer_enabled = true)]
async fn silent_sockets_give_their_handshake_places_back_at_the_first_byte_deadline() {
    guarded(async {
        let pki = Pki::mint("hostile-node-first-byte");
        let edge = open_edge(
            &pki,
            "node_handshake_timeout_ms = 60000\nnode_first_byte_timeout_ms = 500\n",
        );
        let silent: Vec<_> = (0..80u8)
            .map(|i| connect_from(Ipv4Addr::new(127, 0, 1, i + 1), edge.node_addr))
            .collect();
        let started = clock::now();
        let (stop, node) = start_node(&edge, &pki);
        wait_connected(edge.client_addr, "node-a", true).await;
        let took = clock::now().duration_since(started);
        // Well inside the 60 s handshake timeout: the places came back at
        // the first-byte deadline.
        assert!(took < GENEROUS, "registered after {took:?}");
        // Each silent socket ended at its first-byte deadline; the Node,
        // which spoke, did not. (The Node can register before the last of
        // the first 64 is counted: their deadlines were armed as they were
        // accepted, so the count is awaited, then checked exactly.)
        let timeouts = loop {
            let n = metric(edge.client_addr, "iop_edge_node_first_byte_timeouts_total").await;
            if n >= 80 || clock::now().duration_since(started) > GENEROUS {
                break n;
            }
            monoio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(timeouts, 80);
        let _ = stop.send(());
        node.await;
        drop(silent);
        edge.stop().await;
    })
    .await;
}

// Finding 8: a flood of scrapes pulls the nodes' series once: the node
// gets one METRICS command for twenty concurrent scrapes, and the next
// frame it gets is an operator's admin command, not another scrape.
#[monoio::test_all(timer_enabled = true)]
async fn a_scrape_flood_asks_each_node_once() {
    guarded(async {
        let pki = Pki::mint("hostile-scrapes");
        let edge = open_edge(&pki, "");
        let mut node = ready_node(&edge, &pki, "node-a").await;
        let scrapes: Vec<_> = (0..20)
            .map(|_| monoio::spawn(http_request(edge.client_addr, "GET", "/metrics", b"")))
            .collect();
        let command = loop {
            match node.next_frame().await {
                Body::NodeCommandRequest(c) => break c,
                Body::FlowCredit(_) => {}
                other => panic!("unexpected frame {other:?}"),
            }
        };
        assert_eq!(command.r#type, pb::CommandType::Metrics as i32);
        node.conn
            .send_control(frame(Body::NodeCommandResponse(Box::new(
                pb::NodeCommandResponse {
                    command_id: command.command_id,
                    ok: true,
                    metrics_text: "iop_node_test_marker 7\n".into(),
                    ..Default::default()
                },
            ))))
            .unwrap();
        for scrape in scrapes {
            let text = String::from_utf8(scrape.await.body).unwrap();
            assert!(
                text.contains("iop_node_test_marker{node=\"node-a\"} 7"),
                "{text}"
            );
        }
        // An operator's command goes through; it is the next frame.
        let admin = monoio::spawn(http_request(
            edge.client_addr,
            "POST",
            "/admin/nodes/node-a/commands",
            br#"{"type":"capabilities"}"#,
        ));
        let command = loop {
            match node.next_frame().await {
                Body::NodeCommandRequest(c) => break c,
                Body::FlowCredit(_) => {}
                other => panic!("unexpected frame {other:?}"),
            }
        };
        assert_eq!(command.r#type, pb::CommandType::Capabilities as i32);
        node.conn
            .send_control(frame(Body::NodeCommandResponse(Box::new(
                pb::NodeCommandResponse {
                    command_id: command.command_id,
                    ok: true,
                    ..Default::default()
                },
            ))))
            .unwrap();
        assert_eq!(admin.await.status, 200);
        edge.stop().await;
    })
    .await;
}

fn providers_of(status: &Value) -> Vec<String> {
    status["providers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            format!(
                "{}/{}",
                p["node_id"].as_str().unwrap(),
                p["provider_id"].as_str().unwrap()
            )
        })
        .collect()
}

// Finding 9: `/status` shows a key limited to some models only their
// providers; a key of every model, and a `metrics` key, see the fleet.
// Finding 8: with `metrics_access = "key"`, `/metrics` needs a key with
// the `metrics` scope.
#[monoio::test_all(timer_enabled = true)]
async fn status_and_metrics_show_a_key_what_it_may_see() {
    guarded(async {
        let pki = Pki::mint("hostile-views");
        let edge = keyed_edge(&pki, "metrics_access = \"key\"\n");
        let addr = edge.client_addr;
        let status_as = |key: &'static str| async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            write(&mut tcp, &get_with_key("/status", Some(key))).await.unwrap();
            parse_response(&read_all(&mut tcp).await).json()
        };
        assert_eq!(
            providers_of(&status_as(LIMITED_KEY).await),
            ["node-a/a-mock"]
        );
        for key in [KEY, METRICS_KEY] {
            assert_eq!(
                providers_of(&status_as(key).await),
                ["node-a/a-mock", "node-b/b-mock"]
            );
        }
        let metrics_as = |key: Option<&'static str>| async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            write(&mut tcp, &get_with_key("/metrics", key)).await.unwrap();
            parse_response(&read_all(&mut tcp).await)
        };
        assert_eq!(metrics_as(None).await.status, 401);
        let refused = metrics_as(Some(KEY)).await;
        assert_eq!(refused.status, 403);
        assert_eq!(
            refused.json(),
            api_error(
                "This API key may not read /metrics: give it scopes = [\"metrics\"] in [[client_keys]].",
                "permission_error",
                None,
                Some("metrics_scope_required"),
            )
        );
        let scraped = metrics_as(Some(METRICS_KEY)).await;
        assert_eq!(scraped.status, 200);
        assert!(String::from_utf8_lossy(&scraped.body).contains("iop_edge_client_connections_open"));
        edge.stop().await;
    })
    .await;
}

// Finding 9: without client keys, `/admin` and `/ui/events` answer a
// loopback peer only when it names the Edge by a loopback `Host` (a page
// whose name was rebound to 127.0.0.1 sends its own name), and an admin
// command must be declared JSON (a cross-site form cannot).
#[monoio::test_all(timer_enabled = true)]
async fn an_open_edge_keeps_web_pages_out_of_admin() {
    guarded(async {
        let pki = Pki::mint("hostile-rebinding");
        let edge = open_edge(&pki, "");
        let addr = edge.client_addr;
        let send = |raw: String| async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            write(&mut tcp, raw.as_bytes()).await.unwrap();
            parse_response(&read_all(&mut tcp).await)
        };
        let body = r#"{"type":"capabilities"}"#;
        let admin = |host: &str, content_type: &str| {
            format!(
                "POST /admin/nodes/node-a/commands HTTP/1.1\r\nhost: {host}\r\n\
                 connection: close\r\ncontent-type: {content_type}\r\n\
                 content-length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        let rebound = send(admin("evil.example:8080", "application/json")).await;
        assert_eq!(rebound.status, 403, "{rebound:?}");
        assert_eq!(rebound.json()["error"]["code"], "admin_host_not_loopback");
        let form = send(admin("127.0.0.1", "text/plain")).await;
        assert_eq!(form.status, 415, "{form:?}");
        assert_eq!(form.json()["error"]["code"], "unsupported_media_type");
        // The node is not connected: a well-formed local command reaches
        // the command path (404 for an unknown node), past both checks.
        let local = send(admin("localhost", "application/json")).await;
        assert_eq!(local.status, 404, "{local:?}");
        let events = send(
            "GET /ui/events HTTP/1.1\r\nhost: evil.example\r\nconnection: close\r\n\r\n".into(),
        )
        .await;
        assert_eq!(events.status, 403, "{events:?}");
        assert_eq!(events.json()["error"]["code"], "admin_host_not_loopback");
        edge.stop().await;
    })
    .await;
}

/// Log lines written on this thread while the guard lives.
#[derive(Clone, Default)]
struct CapturedLogs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("log buffer poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLogs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

// Finding 9: a node that registers under another name than its certificate
// gets its claim logged only as the peer's text: escaped (a newline cannot
// start a forged line) and cut short, beside the verified identity.
#[monoio::test_all(timer_enabled = true)]
async fn a_claimed_node_id_is_logged_escaped_beside_the_verified_identity() {
    let logs = CapturedLogs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    guarded(async {
        let pki = Pki::mint("hostile-claim");
        let edge = open_edge(&pki, "");
        let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        let forged = format!(
            "node-b\nINFO edge_bin: node.connected node_id=node-b{}",
            "x".repeat(500)
        );
        let response = node.register(&forged).await;
        assert!(!response.accepted);
        edge.stop().await;
    })
    .await;
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("register request names another node than its TLS identity"))
        .unwrap_or_else(|| panic!("no refusal line in:\n{text}"));
    assert!(line.contains("identity=node-a"), "{line}");
    assert!(
        line.contains(r#"claimed_node_id="node-b\nINFO edge_bin: node.connected"#),
        "{line}"
    );
    // Cut short: 128 characters of the claim at most.
    assert!(!line.contains(&"x".repeat(200)), "{line}");
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("INFO edge_bin: node.connected")),
        "{text}"
    );
}
