//! Provider failures as a client sees them, with every part a real process
//! on loopback: `edge-bin`, one `node-bin` and `bench mock-provider`s (over
//! HTTPS with the `bench tls-fixtures` certificates where a test needs it).
//!
//! - a provider whose TLS handshake fails is failed over and ejected like
//!   one that refuses connections (nothing reached it);
//! - a provider that answers `101 Switching Protocols` (a status that cannot
//!   answer a request) fails before its response starts, so another
//!   provider takes the request;
//! - a provider that cannot be reached is reported to the client without
//!   its address (the Edge's log keeps it).
//!
//! Build the binaries first: `cargo build -p edge-bin -p node-bin -p bench
//! --bins`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use iop_engine::clock;
use serde_json::{json, Value};

const TRUST_DOMAIN: &str = "iop.local";
const EDGE_NAME: &str = "edge-1";
const NODE: &str = "node-a";
const TARGET: &str = "mock-model";
/// Far above anything below takes on a loaded machine.
const GENEROUS: Duration = Duration::from_secs(60);

/// A binary built next to this test's `edge-bin`.
fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_edge-bin")).with_file_name(name);
    assert!(
        path.exists(),
        "{} is missing: cargo build -p edge-bin -p node-bin -p bench --bins",
        path.display()
    );
    path
}

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(label: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "provider-failures-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Self(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process, killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `command` with stderr to `log` and waits for its `IOP_READY`
/// line; returns the process and that line.
fn start_ready(mut command: Command, log: &str) -> (Running, String) {
    let stderr = std::fs::File::create(log).expect("log file");
    let mut child = command
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    let running = Running(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("IOP_READY") {
                let _ = tx.send(line);
            }
        }
    });
    let line = rx
        .recv_timeout(GENEROUS)
        .unwrap_or_else(|_| panic!("{command:?} printed no IOP_READY line; see {log}"));
    (running, line)
}

/// The `key=value` field of an `IOP_READY` line.
fn ready_field(line: &str, key: &str) -> String {
    line.split(' ')
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .to_string()
}

/// How one provider of the node is served.
enum Provider {
    /// A mock over HTTPS with fixture certificate `cert` (`https`: valid for
    /// localhost; `wrong-host`: valid for wrong.example only), reached as
    /// `https://localhost:<port>` trusting the fixtures' CA.
    Https { cert: &'static str },
    /// A plain HTTP mock with these extra `mock-provider` arguments.
    Http { args: &'static [&'static str] },
    /// Nothing listens on the port.
    Refused,
}

/// Edge, node and providers, each a process.
struct Cluster {
    dir: Scratch,
    client: SocketAddr,
    _procs: Vec<Running>,
}

impl Cluster {
    /// Node `node-a` with one adapter and provider per `(id, provider)`,
    /// the Edge with `models` (`(name, provider ids)`), outlier detection
    /// at three failures in a row. Returns once every provider is
    /// connected.
    fn start(label: &str, providers: &[(&str, Provider)], models: &[(&str, &[&str])]) -> Self {
        let dir = Scratch::new(label);
        bench::fixtures::write_tls_fixtures(&dir.0, TRUST_DOMAIN, EDGE_NAME, &[NODE.to_string()])
            .expect("TLS fixtures");
        let mut procs = Vec::new();
        let mut nodes_toml = format!("[[nodes]]\nid = \"{NODE}\"\n");
        for (id, provider) in providers {
            let (base_url, tls_line) = match provider {
                Provider::Https { cert } => {
                    let mut mock = Command::new(bin("bench"));
                    mock.args(["mock-provider", "--port", "0", "--tokens", "2"])
                        .args(["--tls-cert", &dir.path(&format!("{cert}.pem"))])
                        .args(["--tls-key", &dir.path(&format!("{cert}-key.pem"))]);
                    let (proc, line) = start_ready(mock, &dir.path(&format!("mock-{id}.log")));
                    procs.push(proc);
                    let addr: SocketAddr = ready_field(&line, "addr").parse().expect("addr");
                    (
                        format!("https://localhost:{}", addr.port()),
                        format!("ca_file = \"{}\"\n", dir.path("ca.pem")),
                    )
                }
                Provider::Http { args } => {
                    let mut mock = Command::new(bin("bench"));
                    mock.args(["mock-provider", "--port", "0", "--tokens", "2"])
                        .args(*args);
                    let (proc, line) = start_ready(mock, &dir.path(&format!("mock-{id}.log")));
                    procs.push(proc);
                    (
                        format!("http://{}", ready_field(&line, "addr")),
                        String::new(),
                    )
                }
                Provider::Refused => {
                    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
                    let addr = listener.local_addr().expect("address");
                    drop(listener);
                    (format!("http://{addr}"), String::new())
                }
            };
            nodes_toml.push_str(&format!(
                "\n[[nodes.adapters]]\nname = \"{id}\"\nkind = \"openai_compat\"\n\
                 profile = \"openai\"\nbase_url = \"{base_url}\"\n{tls_line}capacity = 8\n\n\
                 [[nodes.providers]]\nid = \"{id}\"\nadapter = \"{id}\"\ntarget = \"{TARGET}\"\n\
                 capacity = 4\n"
            ));
        }
        let models_toml: String = models
            .iter()
            .map(|(name, ids)| {
                let list: Vec<String> = ids.iter().map(|id| format!("\"{NODE}/{id}\"")).collect();
                format!(
                    "\n[[models]]\nname = \"{name}\"\nproviders = [{}]\nqueue_timeout_ms = 2000\n",
                    list.join(", ")
                )
            })
            .collect();
        let edge_toml = format!(
            "[edge]\nname = \"{EDGE_NAME}\"\ntrust_domain = \"{TRUST_DOMAIN}\"\n\
             client_listen = \"127.0.0.1:0\"\nnode_listen = \"127.0.0.1:0\"\nallow_anonymous = true\n\n\
             [tls]\nca = \"{ca}\"\ncert = \"{cert}\"\nkey = \"{key}\"\n\n\
             [outlier_detection]\nconsecutive_failures = 3\n\n{nodes_toml}{models_toml}",
            ca = dir.path("ca.pem"),
            cert = dir.path("edge.pem"),
            key = dir.path("edge-key.pem"),
        );
        std::fs::write(dir.0.join("edge.toml"), edge_toml).expect("edge.toml");
        let mut edge = Command::new(bin("edge-bin"));
        edge.args(["--config", &dir.path("edge.toml")])
            .env("RUST_LOG", "info");
        let (proc, line) = start_ready(edge, &dir.path("edge.log"));
        procs.push(proc);
        let client: SocketAddr = ready_field(&line, "client").parse().expect("client");
        let node_toml = format!(
            "node_id = \"{NODE}\"\ntrust_domain = \"{TRUST_DOMAIN}\"\n\
             edge_addr = \"{edge_addr}\"\nedge_name = \"{EDGE_NAME}\"\n\n\
             [tls]\nca = \"{ca}\"\ncert = \"{cert}\"\nkey = \"{key}\"\n\n\
             [reconnect]\ninterval_sec = 1\nmax_attempts = 0\n",
            edge_addr = ready_field(&line, "nodes"),
            ca = dir.path("ca.pem"),
            cert = dir.path(&format!("node-{NODE}.pem")),
            key = dir.path(&format!("node-{NODE}-key.pem")),
        );
        std::fs::write(dir.0.join("node.toml"), node_toml).expect("node.toml");
        let node = Command::new(bin("node-bin"))
            .args(["--config", &dir.path("node.toml")])
            .env_remove("NOTIFY_SOCKET")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path("node.log")).expect("node log"))
            .spawn()
            .expect("spawn node-bin");
        procs.push(Running(node));
        let cluster = Self {
            dir,
            client,
            _procs: procs,
        };
        let started = clock::now();
        loop {
            let status = cluster.status();
            let providers = status["providers"].as_array().expect("providers");
            if providers.iter().all(|p| p["connected"] == true) {
                break;
            }
            assert!(
                started.elapsed() < GENEROUS,
                "the node did not connect: {status}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    fn request(&self, method: &str, path: &str, body: &str) -> Response {
        let mut tcp = TcpStream::connect(self.client).expect("connect");
        tcp.set_read_timeout(Some(GENEROUS)).expect("timeout");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: edge\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        tcp.write_all(request.as_bytes()).expect("send");
        let mut raw = Vec::new();
        tcp.read_to_end(&mut raw).expect("read the response");
        Response::parse(&raw)
    }

    fn chat(&self, model: &str, stream: bool) -> Response {
        self.request(
            "POST",
            "/v1/chat/completions",
            &format!(
                r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
            ),
        )
    }

    fn status(&self) -> Value {
        let response = self.request("GET", "/status", "");
        assert_eq!(response.status, 200, "{}", response.text());
        response.json()
    }

    /// The `/status` entry of provider `id`.
    fn provider(&self, id: &str) -> Value {
        let status = self.status();
        status["providers"]
            .as_array()
            .expect("providers")
            .iter()
            .find(|p| p["provider_id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no provider {id} in {status}"))
    }

    /// Sample `name{labels}` of the Edge's `/metrics` (0 when absent).
    fn metric(&self, sample: &str) -> u64 {
        let text = self.request("GET", "/metrics", "").text();
        text.lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
            .map_or(0, |v| v.parse().expect("a number"))
    }

    fn edge_log(&self) -> String {
        std::fs::read_to_string(self.dir.path("edge.log")).expect("edge log")
    }
}

/// A whole HTTP/1.1 response read to EOF.
#[derive(Debug)]
struct Response {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Response {
    fn parse(raw: &[u8]) -> Self {
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(raw)));
        let head = String::from_utf8_lossy(&raw[..end]).into_owned();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("status line of {head:?}"));
        let mut body = raw[end + 4..].to_vec();
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            body = dechunk(&body);
        }
        Self { status, head, body }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.head, self.text()))
    }
}

fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let line = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("size line");
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..line]).expect("ASCII"), 16)
            .expect("chunk size");
        rest = &rest[line + 2..];
        if size == 0 {
            return body;
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// The text a chat completion of the mock (two tokens) carries.
fn completion_text(response: &Response) -> String {
    response.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content in {}", response.text()))
        .to_string()
}

// A pool of a provider whose certificate is for another host name (listed
// first: with no load it is tried first) and a good one. Nothing reaches
// the bad provider (its TLS handshake fails), so each failure is failed over
// like a refused connect and counted against it: after three in a row it
// is ejected, and every request is answered. Alone in its pool, the bad
// provider's failure reaches the client as `provider_tls`, without the
// host names the handshake error names.
#[test]
fn a_provider_whose_tls_handshake_fails_is_failed_over_and_ejected() {
    let cluster = Cluster::start(
        "tls",
        &[
            ("bad", Provider::Https { cert: "wrong-host" }),
            ("good", Provider::Https { cert: "https" }),
        ],
        &[("alone", &["bad"]), ("pool", &["bad", "good"])],
    );
    let response = cluster.chat("alone", false);
    assert_eq!(
        (response.status, response.json()),
        (
            502,
            json!({"error": {
                "message": "The TLS handshake with the provider failed (its certificate was refused or the handshake broke off).",
                "type": "upstream_error", "param": null, "code": "provider_tls"
            }})
        )
    );
    assert!(
        cluster
            .edge_log()
            .contains("certificate not valid for name"),
        "the Edge's log keeps the detail: {}",
        cluster.edge_log()
    );
    // One failure so far: two more in the pool eject it.
    for i in 0..20 {
        let response = cluster.chat("pool", false);
        assert_eq!(
            (response.status, completion_text(&response)),
            (200, "tok0 tok1 ".to_string()),
            "request {i}: {}",
            response.text()
        );
    }
    let mut outlier = cluster.provider("bad")["outlier"].clone();
    assert!(outlier["readmit_in_ms"].as_u64().is_some(), "{outlier}");
    outlier["readmit_in_ms"] = Value::Null;
    assert_eq!(
        outlier,
        json!({
            "ejected": true, "reason": "connect_failure", "consecutive_failures": 3,
            "ejections": 1, "readmit_in_ms": null
        })
    );
    assert_eq!(
        cluster.provider("good")["outlier"]["consecutive_failures"],
        0
    );
    assert_eq!(
        cluster.metric("iop_edge_provider_attempt_failures_total{reason=\"connect_failure\"}"),
        3
    );
}

// A provider answering `101 Switching Protocols` to a chat completion (no
// upgrade was asked for) has not answered: the node ends the attempt with
// `provider_error` before any response head, so the client never sees the
// 101 — alone in its pool it gets a 502, and with another provider in the
// pool that one takes the request. The failures count toward ejection.
#[test]
fn a_provider_answering_101_is_a_provider_error_before_the_response() {
    let cluster = Cluster::start(
        "switching",
        &[
            (
                "switching",
                Provider::Http {
                    args: &["--fail-status", "101"],
                },
            ),
            ("good", Provider::Http { args: &[] }),
        ],
        &[("alone", &["switching"]), ("pool", &["switching", "good"])],
    );
    let response = cluster.chat("alone", false);
    assert_eq!(
        (response.status, response.json()),
        (
            502,
            json!({"error": {
                "message": "provider: unexpected response status 101 (a request is answered with 200 to 599)",
                "type": "upstream_error", "param": null, "code": "provider_error"
            }})
        ),
        "{}",
        response.head
    );
    for stream in [false, true, false, true] {
        let response = cluster.chat("pool", stream);
        assert_eq!(
            response.status,
            200,
            "{} {}",
            response.head,
            response.text()
        );
        if stream {
            assert!(
                response.text().ends_with("data: [DONE]\n\n"),
                "{}",
                response.text()
            );
        } else {
            assert_eq!(completion_text(&response), "tok0 tok1 ");
        }
    }
    // One failure alone, two in the pool: ejected at the third.
    let outlier = cluster.provider("switching")["outlier"].clone();
    assert_eq!(
        (&outlier["ejected"], &outlier["reason"]),
        (&json!(true), &json!("reset_before_response")),
        "{outlier}"
    );
    assert_eq!(
        cluster
            .metric("iop_edge_provider_attempt_failures_total{reason=\"reset_before_response\"}"),
        3
    );
}

// A provider that refuses connections: the client is told the provider
// could not be reached, with the code, and nothing of its address — in the
// OpenAI shape, streamed or not, and in the Anthropic shape. The Edge's log
// keeps the node's words, address included.
#[test]
fn an_unreachable_provider_is_reported_without_its_address() {
    let cluster = Cluster::start(
        "refused",
        &[("down", Provider::Refused)],
        &[("down", &["down"])],
    );
    let expected = json!({"error": {
        "message": "The provider could not be reached.",
        "type": "upstream_error", "param": null, "code": "provider_unreachable"
    }});
    for stream in [false, true] {
        let response = cluster.chat("down", stream);
        assert_eq!((response.status, response.json()), (502, expected.clone()));
    }
    let response = cluster.request(
        "POST",
        "/v1/messages",
        r#"{"model":"down","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
    );
    let request_id = response
        .head
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .expect("x-request-id")
        .to_string();
    assert_eq!(
        (response.status, response.json()),
        (
            502,
            json!({
                "type": "error",
                "error": {"type": "api_error", "message": "The provider could not be reached."},
                "request_id": request_id,
            })
        )
    );
    let port = {
        let status = cluster.status();
        assert_eq!(status["providers"][0]["provider_id"], "down");
        std::fs::read_to_string(cluster.dir.0.join("edge.toml"))
            .expect("edge.toml")
            .split("base_url = \"http://127.0.0.1:")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("the refused port")
            .to_string()
    };
    let log = cluster.edge_log();
    assert!(
        log.contains(&format!("connect 127.0.0.1:{port}")),
        "the Edge's log keeps the detail: {log}"
    );
}
