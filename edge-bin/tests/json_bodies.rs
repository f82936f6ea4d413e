//! Request bodies that are costly to read, sent to a real `edge-bin`
//! process over loopback: every body check is linear in the body, so one
//! request with a quarter of a million members is answered in well under
//! a second and never holds up `/livez` on the same core; the top-level
//! member cap (`edge.max_json_members`) refuses wider bodies with a 400 in
//! the route's error shape, counted with the other JSON-limit refusals.
//!
//! Time bounds are ten times what the checks take on a loaded debug build
//! ([`ANSWER_BOUND`]); the quadratic reading they replace took minutes
//! (333 s for the 250,000 top-level members in a debug build, where the
//! linear one takes 0.2 s).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use iop_engine::clock;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_edge-bin");

/// Longest wait for an answer to a costly body, or to `/livez` sent while
/// it is read: ten times what reading it takes on a loaded 2-core machine
/// (a debug build), and far below what the quadratic reading took (333 s
/// for 250,000 members in a debug build, about 90 s in a release build).
const ANSWER_BOUND: Duration = Duration::from_secs(10);

/// A model whose requests estimate their prompt size (every request is
/// long-context), so the Edge reads each message's members.
const LONG_MODEL: &str = "long-model";

/// A running `edge-bin`; killed on drop.
struct EdgeProcess {
    child: Child,
    client: SocketAddr,
}

impl EdgeProcess {
    /// Writes `toml` beside the test certificates and starts `edge-bin` on
    /// it; returns once it printed its `IOP_READY` line.
    fn start(pki: &Pki, toml: &str) -> Self {
        let path = pki.dir.join("edge.toml");
        std::fs::write(&path, toml).expect("write edge.toml");
        let mut child = Command::new(BIN)
            .args(["--config", &path.display().to_string()])
            .env_remove("NOTIFY_SOCKET")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn edge-bin");
        let stdout = child.stdout.take().expect("stdout");
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("IOP_READY") {
                    let _ = ready_tx.send(line);
                }
            }
        });
        let mut edge = Self {
            child,
            client: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let line = ready_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("edge-bin printed IOP_READY");
        edge.client = line
            .split(' ')
            .find_map(|w| w.strip_prefix("client="))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no client= in {line:?}"));
        edge
    }
}

impl Drop for EdgeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The test Edge config with `edge_keys` in `[edge]` and model
/// [`LONG_MODEL`] (served by node-a's provider, no node connected).
fn config(pki: &Pki, edge_keys: &str) -> String {
    let options = EdgeOptions {
        edge_keys: edge_keys.to_string(),
        extra_toml: format!(
            "\n[[models]]\nname = \"{LONG_MODEL}\"\nproviders = [\"node-a/a-mock\"]\n\
             queue_timeout_ms = 100\nlong_context_threshold_tokens = 1\n"
        ),
        ..EdgeOptions::without_provider()
    };
    edge_toml(pki, &options)
}

/// Sends `request` on a new connection; the time from the last byte sent
/// to the whole response read, and the response. Panics when no answer
/// came within [`ANSWER_BOUND`].
fn timed_exchange(addr: SocketAddr, request: &[u8]) -> (Duration, HttpResponse) {
    let mut tcp = TcpStream::connect(addr).expect("connect");
    tcp.write_all(request).expect("send the request");
    let sent_at = clock::now();
    tcp.set_read_timeout(Some(ANSWER_BOUND))
        .expect("read timeout");
    let mut raw = Vec::new();
    if let Err(e) = tcp.read_to_end(&mut raw) {
        panic!(
            "no whole answer within {ANSWER_BOUND:?} ({e}); read {:?}",
            String::from_utf8_lossy(&raw[..raw.len().min(200)])
        );
    }
    (sent_at.elapsed(), parse_response(&raw))
}

/// `{"k0000000":0,…}` members, `count` of them, each followed by a comma.
fn filler_members(count: usize) -> String {
    let mut out = String::with_capacity(count * 14);
    for i in 0..count {
        out.push_str(&format!("\"k{i:07}\":0,"));
    }
    out
}

/// A chat body for `model` with `extra` top-level members: 2 + `extra`
/// members, 2 + `extra` JSON values.
fn wide_chat_body(model: &str, extra: usize) -> Vec<u8> {
    format!(
        "{{{}\"model\":\"{model}\",\"messages\":[]}}",
        filler_members(extra)
    )
    .into_bytes()
}

/// The big request on one connection and `/livez` on another, sent half
/// a second after the whole big body was written (by then the Edge has
/// read it and is checking it: a check that holds the core holds `/livez`
/// too): both answers with their times.
fn costly_body_and_livez(
    addr: SocketAddr,
    request: Vec<u8>,
) -> ((Duration, HttpResponse), (Duration, HttpResponse)) {
    let (sent_tx, sent_rx) = mpsc::channel::<()>();
    let big = std::thread::spawn(move || {
        let mut tcp = TcpStream::connect(addr).expect("connect");
        tcp.write_all(&request).expect("send the body");
        let sent_at = clock::now();
        let _ = sent_tx.send(());
        tcp.set_read_timeout(Some(ANSWER_BOUND))
            .expect("read timeout");
        let mut raw = Vec::new();
        let read = tcp.read_to_end(&mut raw);
        (sent_at.elapsed(), read.map(|_| raw))
    });
    sent_rx.recv().expect("the body was sent");
    std::thread::sleep(Duration::from_millis(500));
    let livez = timed_exchange(
        addr,
        b"GET /livez HTTP/1.1\r\nhost: edge\r\nconnection: close\r\n\r\n",
    );
    let (big_took, raw) = big.join().expect("the big request's thread");
    let raw = raw.unwrap_or_else(|e| {
        panic!("no answer to the costly body within {ANSWER_BOUND:?} ({e}) after {big_took:?}")
    });
    ((big_took, parse_response(&raw)), livez)
}

// 250,000 top-level members (every value max_json_elements allows, the
// member cap raised to match): read in linear time. The quadratic check of
// repeated names took 333 s here (a debug build) and held the core, and
// `/livez` with it, the whole time.
#[test]
fn a_quarter_million_top_level_members_are_read_in_linear_time() {
    let pki = Pki::mint("json-wide");
    let edge = EdgeProcess::start(&pki, &config(&pki, "max_json_members = 250000\n"));
    let body = wide_chat_body("no-such-model", 249_998);
    assert_eq!(body.len(), 3_250_013);
    let ((took, answer), (livez_took, livez)) = costly_body_and_livez(
        edge.client,
        request_bytes("POST", "/v1/chat/completions", &body),
    );
    // Parsed, checked for repeated names, and routed: the model is unknown.
    assert_eq!(
        (answer.status, answer.json()),
        (
            404,
            api_error(
                "The model `no-such-model` does not exist or you do not have access to it.",
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            )
        )
    );
    assert_eq!((livez.status, &livez.body[..]), (200, &b"ok\n"[..]));
    eprintln!("250,000 members answered in {took:?}; /livez meanwhile in {livez_took:?}");
    // The same body with one name repeated at the very end is refused, as
    // fast.
    let mut repeated = wide_chat_body("no-such-model", 249_997);
    repeated.pop();
    repeated.extend_from_slice(b",\"k0000000\":1}");
    let (took, refused) = timed_exchange(
        edge.client,
        &request_bytes("POST", "/v1/chat/completions", &repeated),
    );
    assert_eq!(
        (refused.status, refused.json()),
        (
            400,
            api_error(
                "The request body has the member `k0000000` more than once.",
                "invalid_request_error",
                None,
                None,
            )
        )
    );
    eprintln!("a repeated name among 250,000 members refused in {took:?}");
}

// A nested object is read linearly too: one message with 249,990 members
// (its prompt size is estimated for a long-context model), where dropping
// an earlier repeat with `Vec::retain` took 427 s (a debug build).
#[test]
fn a_message_with_a_quarter_million_members_is_read_in_linear_time() {
    let pki = Pki::mint("json-nested");
    let edge = EdgeProcess::start(&pki, &config(&pki, ""));
    let members = filler_members(249_990);
    let body = format!(
        "{{\"model\":\"{LONG_MODEL}\",\"messages\":[{{{members}\"role\":\"user\",\"content\":\"hi\"}}]}}"
    );
    let ((took, answer), (livez_took, livez)) = costly_body_and_livez(
        edge.client,
        request_bytes("POST", "/v1/chat/completions", body.as_bytes()),
    );
    // Read, estimated, queued: no node serves the model.
    assert_eq!(
        (answer.status, answer.json()),
        (
            503,
            api_error(
                &format!(
                    "No provider for model `{LONG_MODEL}` is available right now; retry shortly."
                ),
                "service_unavailable_error",
                None,
                Some("no_provider_available"),
            )
        )
    );
    assert_eq!((livez.status, &livez.body[..]), (200, &b"ok\n"[..]));
    eprintln!(
        "a message of 249,990 members answered in {took:?}; /livez meanwhile in {livez_took:?}"
    );
}

// More top-level members than `edge.max_json_members` (default 1,024): 400
// `json_too_complex` in the route's error shape, before anything is parsed,
// counted in `iop_edge_client_json_limit_rejections_total`; exactly the
// cap is accepted.
#[test]
fn more_top_level_members_than_the_cap_are_refused() {
    let pki = Pki::mint("json-members-cap");
    let edge = EdgeProcess::start(&pki, &config(&pki, ""));
    let message = "The request body has more than 1024 top-level members.";
    let (_, at_cap) = timed_exchange(
        edge.client,
        &request_bytes(
            "POST",
            "/v1/chat/completions",
            &wide_chat_body("no-such-model", 1_022),
        ),
    );
    assert_eq!(at_cap.status, 404, "{:?}", at_cap.json());
    let (_, openai) = timed_exchange(
        edge.client,
        &request_bytes(
            "POST",
            "/v1/chat/completions",
            &wide_chat_body("no-such-model", 1_023),
        ),
    );
    assert_eq!(
        (openai.status, openai.json()),
        (
            400,
            api_error(
                message,
                "invalid_request_error",
                None,
                Some("json_too_complex")
            )
        )
    );
    let (_, anthropic) = timed_exchange(
        edge.client,
        &request_bytes(
            "POST",
            "/v1/messages",
            &wide_chat_body("no-such-model", 5_000),
        ),
    );
    let request_id = anthropic
        .header("x-request-id")
        .expect("x-request-id")
        .to_string();
    assert_eq!(
        (anthropic.status, anthropic.json()),
        (
            400,
            json!({
                "type": "error",
                "error": {"type": "invalid_request_error", "message": message},
                "request_id": request_id,
            })
        )
    );
    let (_, metrics) = timed_exchange(edge.client, &request_bytes("GET", "/metrics", b""));
    let text = String::from_utf8(metrics.body).expect("UTF-8 metrics");
    assert!(
        text.lines()
            .any(|l| l == "iop_edge_client_json_limit_rejections_total 2"),
        "{text}"
    );
}
