//! The front door against hostile and clumsy peers, over real sockets with
//! short configured limits: a head sent a byte at a time, a body that stops
//! half way, idle keep-alive connections, the client connection cap,
//! half-open TLS handshakes on the node port and the handshake cap, HTTPS
//! clients that never finish their handshake, and a client that writes a
//! 64 MiB body before it reads the 413. Each checks
//! that the connection ended and that `/metrics` counted it; time bounds
//! are generous (a loaded 2-core machine), orders are exact.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use iop_engine::clock;
use iop_engine::tls::UpstreamTls;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use serde_json::json;

/// Far above every configured limit below, even on a loaded machine.
const GENEROUS: Duration = Duration::from_secs(20);

fn edge_with(pki: &Pki, keys: &str) -> TestEdge {
    let mut options = EdgeOptions::without_provider();
    options.edge_keys = keys.to_string();
    TestEdge::start(pki, &edge_toml(pki, &options))
}

/// Polls `/metrics` until `name` reaches `at_least`.
async fn wait_metric(addr: SocketAddr, name: &str, at_least: u64) -> u64 {
    wait_metric_over(addr, None, name, at_least).await
}

/// [`wait_metric`], over HTTPS with `tls` when given.
async fn wait_metric_over(
    addr: SocketAddr,
    tls: Option<&UpstreamTls>,
    name: &str,
    at_least: u64,
) -> u64 {
    let started = clock::now();
    loop {
        let value = metric_over(addr, tls, name).await;
        if value >= at_least {
            return value;
        }
        assert!(
            clock::now().duration_since(started) < GENEROUS,
            "{name} stayed at {value}, expected {at_least}"
        );
        monoio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn write(tcp: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    tcp.write_all(bytes.to_vec()).await.0.map(|_| ())
}

/// Everything the peer sends until it closes (an error if it resets).
async fn read_to_end(tcp: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let (res, buf) = tcp.read(Vec::with_capacity(64 * 1024)).await;
        if res? == 0 {
            return Ok(out);
        }
        out.extend_from_slice(&buf);
    }
}

// A head trickling in a byte at a time is cut off at the head deadline:
// the Edge answers 408 and closes, so the client's writes start failing;
// the timeout is counted.
#[monoio::test_all(timer_enabled = true)]
async fn a_slowloris_head_is_cut_off_and_counted() {
    guarded(async {
        let pki = Pki::mint("slowloris");
        let edge = edge_with(&pki, "client_head_timeout_ms = 300\n");
        let mut tcp = TcpStream::connect(edge.client_addr).await.unwrap();
        let started = clock::now();
        let mut cut_off = false;
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nX-Slow: "
            .iter()
            .cycle()
        {
            if write(&mut tcp, &[*byte]).await.is_err() {
                cut_off = true;
                break;
            }
            if clock::now().duration_since(started) > GENEROUS {
                break;
            }
            monoio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            cut_off,
            "the Edge kept a trickling head open past {GENEROUS:?}"
        );
        assert_eq!(
            wait_metric(edge.client_addr, "iop_edge_client_head_timeouts_total", 1).await,
            1
        );
        edge.stop().await;
    })
    .await;
}

/// Sends 412 of 1,000 declared body bytes to `path`, then reads the answer.
async fn stalled_body(addr: SocketAddr, path: &str) -> HttpResponse {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
         content-length: 1000\r\n\r\n"
    )
    .into_bytes();
    request.extend(std::iter::repeat_n(b' ', 412));
    write(&mut tcp, &request).await.unwrap();
    parse_response(&read_to_end(&mut tcp).await.unwrap())
}

// A body that stops half way gets 408 at the body idle timeout, in the
// OpenAI shape (Anthropic on /v1/messages), and the connection closes.
#[monoio::test_all(timer_enabled = true)]
async fn a_stalled_body_gets_408_in_the_routes_shape_and_is_counted() {
    guarded(async {
        let pki = Pki::mint("stalled-body");
        let edge = edge_with(&pki, "client_body_idle_timeout_ms = 300\n");
        let response = stalled_body(edge.client_addr, "/v1/chat/completions").await;
        assert_eq!(response.status, 408);
        assert_eq!(response.header("connection"), Some("close"));
        assert_eq!(
            response.json(),
            api_error(
                "timed out waiting for the body (deadline passed)",
                "invalid_request_error",
                None,
                Some("request_timeout")
            )
        );
        let response = stalled_body(edge.client_addr, "/v1/messages").await;
        assert_eq!(response.status, 408);
        assert_eq!(
            response.json(),
            json!({"type": "error", "error": {
                "type": "timeout_error",
                "message": "timed out waiting for the body (deadline passed)"
            }, "request_id": response.header("x-request-id").expect("a request id")})
        );
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_body_timeouts_total").await,
            2
        );
        edge.stop().await;
    })
    .await;
}

// Kept-alive connections that made one request and went idle are closed
// at the keep-alive timeout, silently, and counted; the open-connections
// gauge returns to the scraping connection alone.
#[monoio::test_all(timer_enabled = true)]
async fn idle_keep_alive_connections_are_closed_and_counted() {
    guarded(async {
        let pki = Pki::mint("idle");
        let edge = edge_with(&pki, "client_keep_alive_timeout_ms = 300\n");
        let mut idle = Vec::new();
        for _ in 0..20 {
            let mut tcp = TcpStream::connect(edge.client_addr).await.unwrap();
            write(&mut tcp, b"GET /livez HTTP/1.1\r\nhost: t\r\n\r\n")
                .await
                .unwrap();
            idle.push(tcp);
        }
        for tcp in &mut idle {
            let raw = read_to_end(tcp).await.unwrap();
            // The answer, then the Edge's close (EOF) with nothing more.
            let response = parse_response(&raw);
            assert_eq!((response.status, &response.body[..]), (200, &b"ok\n"[..]));
        }
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_idle_timeouts_total").await,
            20
        );
        // The scrape's own connection is the only one open.
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_connections_open").await,
            1
        );
        edge.stop().await;
    })
    .await;
}

// At max_client_connections with no connection idle (each is reading a
// request) the Edge stops accepting: a further connection waits in the
// backlog, unanswered, and is served as soon as one of the open connections
// closes; the pause is counted. (An idle keep-alive connection would be
// closed for it instead: hostile_peers.rs.)
#[monoio::test_all(timer_enabled = true)]
async fn at_the_connection_cap_new_clients_wait_in_the_backlog() {
    guarded(async {
        let pki = Pki::mint("cap");
        let edge = edge_with(&pki, "max_client_connections = 2\n");
        let first = TcpStream::connect(edge.client_addr).await.unwrap();
        let mut second = TcpStream::connect(edge.client_addr).await.unwrap();
        // The second is served (so both are accepted).
        write(&mut second, b"GET /livez HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        let (res, buf) = second.read(Vec::with_capacity(1024)).await;
        assert!(res.unwrap() > 0);
        assert!(buf.starts_with(b"HTTP/1.1 200 OK\r\n"));
        // Its next request has begun: it is not idle.
        write(&mut second, b"GET /livez HTTP/1.1\r\n")
            .await
            .unwrap();
        let waiting = monoio::spawn({
            let addr = edge.client_addr;
            async move {
                let mut tcp = TcpStream::connect(addr).await.unwrap();
                write(
                    &mut tcp,
                    b"GET /livez HTTP/1.1\r\nconnection: close\r\n\r\n",
                )
                .await
                .unwrap();
                let raw = read_to_end(&mut tcp).await.unwrap();
                (clock::now(), parse_response(&raw))
            }
        });
        // Unanswered while both places are taken (a loaded machine only
        // delays the answer further).
        monoio::time::sleep(Duration::from_millis(300)).await;
        let closed_at = clock::now();
        drop(first);
        let (answered_at, response) = waiting.await;
        assert_eq!(response.status, 200);
        assert!(answered_at >= closed_at, "answered before a place was free");
        drop(second);
        assert!(metric(edge.client_addr, "iop_edge_client_accept_paused_total").await >= 1);
        // Three test connections and the two scrapes.
        assert_eq!(
            metric(
                edge.client_addr,
                "iop_edge_client_connections_accepted_total"
            )
            .await,
            5
        );
        edge.stop().await;
    })
    .await;
}

/// The first half of a TLS ClientHello record (the record says 512 bytes).
const HALF_CLIENT_HELLO: &[u8] = &[
    0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03, 0x11, 0x22, 0x33,
];

// Half-open handshakes on the node port are all closed and counted: the
// silent ones at the first-byte deadline, those that sent half a
// ClientHello at the handshake deadline.
#[monoio::test_all(timer_enabled = true)]
async fn half_open_tls_handshakes_are_closed_and_counted() {
    guarded(async {
        let pki = Pki::mint("half-open");
        let edge = edge_with(
            &pki,
            "node_handshake_timeout_ms = 300\nmax_node_handshakes_per_peer = 100\n",
        );
        let mut peers = Vec::new();
        for i in 0..20 {
            let mut tcp = TcpStream::connect(edge.node_addr).await.unwrap();
            if i % 2 == 1 {
                write(&mut tcp, HALF_CLIENT_HELLO).await.unwrap();
            }
            peers.push(tcp);
        }
        for tcp in &mut peers {
            // The Edge closes each one (EOF or reset), sending no alert
            // content a client could act on beyond the close.
            let _ = read_to_end(tcp).await;
        }
        assert_eq!(
            wait_metric(
                edge.client_addr,
                "iop_edge_node_handshake_timeouts_total",
                10
            )
            .await,
            10
        );
        assert_eq!(
            wait_metric(
                edge.client_addr,
                "iop_edge_node_first_byte_timeouts_total",
                10
            )
            .await,
            10
        );
        assert_eq!(
            metric(edge.client_addr, "iop_edge_node_handshakes_in_progress").await,
            0
        );
        edge.stop().await;
    })
    .await;
}

// On an HTTPS client listener the TLS handshake has the head deadline:
// clients that connect and send nothing, or half a ClientHello, are closed
// at it and counted as handshake timeouts; one that speaks plain HTTP fails
// its handshake at once, gets no HTTP answer, and is counted as a failure.
// A real HTTPS client is served throughout (it reads the counters).
#[monoio::test_all(timer_enabled = true)]
async fn https_clients_that_never_finish_their_handshake_are_closed_and_counted() {
    guarded(async {
        let pki = Pki::mint("client-tls-handshake");
        let keys = format!("client_head_timeout_ms = 300\n{}", pki.client_tls_keys());
        let edge = edge_with(&pki, &keys);
        let https = pki.https_client();
        let mut peers = Vec::new();
        for i in 0..4 {
            let mut tcp = TcpStream::connect(edge.client_addr).await.unwrap();
            if i % 2 == 1 {
                write(&mut tcp, HALF_CLIENT_HELLO).await.unwrap();
            }
            peers.push(tcp);
        }
        for tcp in &mut peers {
            // Closed (EOF or reset), with no byte of an HTTP answer.
            let answer = read_to_end(tcp).await.unwrap_or_default();
            assert!(!answer.starts_with(b"HTTP/"), "{answer:?}");
        }
        let timeouts = "iop_edge_client_tls_handshake_timeouts_total";
        let failures = "iop_edge_client_tls_handshake_failures_total";
        assert_eq!(
            wait_metric_over(edge.client_addr, Some(&https), timeouts, 4).await,
            4
        );
        assert_eq!(
            metric_over(edge.client_addr, Some(&https), failures).await,
            0
        );

        let mut plain = TcpStream::connect(edge.client_addr).await.unwrap();
        write(&mut plain, &request_bytes("GET", "/livez", b""))
            .await
            .unwrap();
        let answer = read_to_end(&mut plain).await.unwrap_or_default();
        assert!(!answer.starts_with(b"HTTP/"), "{answer:?}");
        assert_eq!(
            wait_metric_over(edge.client_addr, Some(&https), failures, 1).await,
            1
        );
        assert_eq!(
            metric_over(edge.client_addr, Some(&https), timeouts).await,
            4
        );
        let live = https_exchange(
            edge.client_addr,
            &https,
            request_bytes("GET", "/livez", b""),
        )
        .await;
        assert_eq!(live.status, 200);
        edge.stop().await;
    })
    .await;
}

// With max_node_handshakes = 1 a silent peer holds the only place: a real
// node that connects next waits in the backlog (it is not refused) and
// registers as soon as the silent connection's first-byte deadline passes.
#[monoio::test_all(timer_enabled = true)]
async fn at_the_handshake_cap_a_node_waits_and_then_registers() {
    guarded(async {
        let pki = Pki::mint("handshake-cap");
        let edge = edge_with(
            &pki,
            "max_node_handshakes = 1\nnode_handshake_timeout_ms = 500\n",
        );
        let _silent = TcpStream::connect(edge.node_addr).await.unwrap();
        // Let the silent connection take the place first.
        wait_metric(
            edge.client_addr,
            "iop_edge_node_handshakes_started_total",
            1,
        )
        .await;
        let connector = pki.connector("node-a");
        let mut node = RawNode::connect(edge.node_addr, &connector).await;
        // The node got through only after the silent one was cut off.
        assert_eq!(
            metric(edge.client_addr, "iop_edge_node_first_byte_timeouts_total").await,
            1
        );
        let response = node.register("node-a").await;
        assert!(response.accepted, "{response:?}");
        assert!(metric(edge.client_addr, "iop_edge_node_accept_paused_total").await >= 1);
        edge.stop().await;
    })
    .await;
}

/// Writes a whole `body_bytes` request body to `path` before reading
/// anything (as Python's urllib does), then reads the answer to EOF.
async fn write_all_then_read(addr: SocketAddr, path: &str, body_bytes: usize) -> HttpResponse {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
         content-length: {body_bytes}\r\n\r\n"
    );
    write(&mut tcp, head.as_bytes()).await.unwrap();
    let piece = vec![b' '; 1024 * 1024];
    let mut left = body_bytes;
    while left > 0 {
        let n = left.min(piece.len());
        write(&mut tcp, &piece[..n])
            .await
            .expect("the Edge keeps reading while the client writes the body");
        left -= n;
    }
    let raw = read_to_end(&mut tcp)
        .await
        .expect("the answer, not a reset");
    parse_response(&raw)
}

// A client that writes a 64 MiB body before it reads gets the 413 (OpenAI
// shape; Anthropic shape on /v1/messages): the Edge answers at the head,
// then lingers, reading and discarding the body, before it closes.
#[monoio::test_all(timer_enabled = true)]
async fn a_64_mib_body_written_before_reading_gets_the_413() {
    guarded(async {
        let pki = Pki::mint("big-body");
        let edge = edge_with(&pki, "");
        let body_bytes = 64 * 1024 * 1024;
        let response =
            write_all_then_read(edge.client_addr, "/v1/chat/completions", body_bytes).await;
        assert_eq!(response.status, 413);
        assert_eq!(response.header("connection"), Some("close"));
        assert_eq!(
            response.json(),
            api_error(
                "Request body exceeds the limit of 8388608 bytes.",
                "invalid_request_error",
                None,
                Some("request_too_large")
            )
        );
        let response = write_all_then_read(edge.client_addr, "/v1/messages", body_bytes).await;
        assert_eq!(response.status, 413);
        assert_eq!(
            response.json(),
            json!({"type": "error", "error": {
                "type": "request_too_large",
                "message": "Request body exceeds the limit of 8388608 bytes."
            }, "request_id": response.header("x-request-id").expect("a request id")})
        );
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_lingering_closes_total").await,
            2
        );
        // The client sees the Edge's FIN when lingering starts; the count
        // lands once the Edge sees the client's close.
        let discarded = "iop_edge_client_linger_discarded_bytes_total";
        assert_eq!(
            wait_metric(edge.client_addr, discarded, 2 * body_bytes as u64).await,
            2 * body_bytes as u64
        );
        assert_eq!(
            metric(edge.client_addr, "iop_edge_client_request_errors_total").await,
            2
        );
        edge.stop().await;
    })
    .await;
}
