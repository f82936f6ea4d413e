//! Forwarding between the Edges of a cluster, every part a real process on
//! loopback: one `etcd`, two `edge-bin`s sharing it (`edge-1` = A,
//! `edge-2` = B, each with a peer listener), one `bench mock-provider`,
//! and two `node-bin`s: `node-a` (serving `model-a`) connected to B only,
//! `node-b` (serving `model-b`) connected to A only. Both Edges have the
//! same fleet and the same client key.
//!
//! - a chat completion for `model-a` sent to A is answered through B with
//!   the bytes B gives for the same request, streamed and not, with usage;
//!   the caller's rate limit is charged at A only;
//! - a request that arrives on B's peer listener is served by B, never
//!   forwarded again, and logged `peer=edge-1`;
//! - B's peer listener refuses a client without a certificate and one with
//!   a node certificate during the handshake;
//! - a client leaving a forwarded stream at A makes B cancel the run;
//! - with B gone, A answers 503 `peer_unavailable`.
//!
//! etcd is the shared test harness (`common/etcd.rs`: `/usr/bin/etcd` or
//! `PATH`). Build the binaries first: `cargo build -p edge-bin -p node-bin
//! -p bench --bins`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use iop_engine::clock;
use serde_json::{json, Value};

#[path = "common/etcd.rs"]
#[allow(dead_code)]
mod etcd;
use etcd::EtcdCluster;

const TRUST_DOMAIN: &str = "iop.local";
const CLIENT_KEY: &str = "sk-cluster-test-key";
/// The operator's key (sees the cluster in `/status`; no limits).
const OPS_KEY: &str = "sk-cluster-test-ops";
/// Far above anything below takes on a loaded machine.
const GENEROUS: Duration = Duration::from_secs(90);

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
            "cluster-forwarding-{label}-{}-{}",
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

/// A child process, killed (by its pid) on drop.
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

    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
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

fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut text = format!(
        "{method} {path} HTTP/1.1\r\nhost: edge\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    text.push_str("\r\n");
    text.push_str(body);
    text.into_bytes()
}

/// One request on a new plain connection, the response read to EOF.
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<Response> {
    let mut tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(GENEROUS))?;
    tcp.write_all(&request_bytes(method, path, headers, body))?;
    let mut raw = Vec::new();
    tcp.read_to_end(&mut raw)?;
    Ok(Response::parse(&raw))
}

const AUTH: (&str, &str) = ("authorization", "Bearer sk-cluster-test-key");
const OPS: (&str, &str) = ("authorization", "Bearer sk-cluster-test-ops");

fn chat_body(model: &str, stream: bool) -> String {
    let usage = if stream {
        r#","stream_options":{"include_usage":true}"#
    } else {
        ""
    };
    format!(
        r#"{{"model":"{model}","stream":{stream}{usage},"messages":[{{"role":"user","content":"hi"}}]}}"#
    )
}

/// A rustls client for the peer listener: presents `identity` (the
/// `<name>.pem` / `<name>-key.pem` pair in `dir`), or nothing; accepts any
/// server certificate (only the listener's judgement of the client is
/// tested here).
fn peer_client(dir: &Scratch, identity: Option<&str>) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let algorithms = provider.signature_verification_algorithms;
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServerCert(algorithms)));
    let config = match identity {
        Some(name) => {
            let chain = CertificateDer::pem_file_iter(dir.path(&format!("{name}.pem")))
                .expect("cert file")
                .collect::<Result<Vec<_>, _>>()
                .expect("cert PEM");
            let key = PrivateKeyDer::from_pem_file(dir.path(&format!("{name}-key.pem")))
                .expect("key PEM");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client cert")
        }
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

/// One request over mTLS to `addr` with `config`: the response, or the
/// I/O error the exchange failed with (a refused handshake: the alert).
fn peer_request(
    config: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    headers: &[(&str, &str)],
    body: &str,
    path: &str,
) -> std::io::Result<Response> {
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let tls = rustls::ClientConnection::new(config, name).map_err(std::io::Error::other)?;
    let tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(GENEROUS))?;
    let mut stream = rustls::StreamOwned::new(tls, tcp);
    let method = if body.is_empty() { "GET" } else { "POST" };
    stream.write_all(&request_bytes(method, path, headers, body))?;
    stream.flush()?;
    let mut raw = Vec::new();
    match stream.read_to_end(&mut raw) {
        Ok(_) => {}
        // The Edge closes without close_notify once it answered.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e),
    }
    Ok(Response::parse(&raw))
}

#[derive(Debug)]
struct AnyServerCert(rustls::crypto::WebPkiSupportedAlgorithms);

impl rustls::client::danger::ServerCertVerifier for AnyServerCert {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// One Edge of the cluster.
struct EdgeProc {
    name: &'static str,
    client: SocketAddr,
    peer: SocketAddr,
    proc: Option<Running>,
}

/// etcd, Edges A (`edge-1`) and B (`edge-2`), the mock, and the nodes.
struct Cluster {
    dir: Scratch,
    a: EdgeProc,
    b: EdgeProc,
    mock: SocketAddr,
    _procs: Vec<Running>,
    /// Dropped last (fields drop in order): the Edges go before etcd.
    _etcd: EtcdCluster,
}

impl Cluster {
    /// Starts everything; `mock_args`: the `mock-provider`'s arguments
    /// beside its port.
    /// Returns once both Edges see `node-a` owned by B and `node-b` by A.
    fn start(label: &str, mock_args: &[&str]) -> Self {
        let dir = Scratch::new(label);
        let certs = Command::new(bin("edge-bin"))
            .args(["certs", "--out", &dir.path("")])
            .args(["--trust-domain", TRUST_DOMAIN])
            .args(["--edge-name", "edge-1", "--edge-name", "edge-2"])
            .args(["--node", "node-a", "--node", "node-b"])
            .output()
            .expect("edge-bin certs");
        assert!(certs.status.success(), "{certs:?}");
        let mut procs = Vec::new();
        let etcd = EtcdCluster::start(1);
        let etcd_addr = etcd.endpoint(0);
        let mut mock = Command::new(bin("bench"));
        mock.args(["mock-provider", "--port", "0"]).args(mock_args);
        let (proc, line) = start_ready(mock, &dir.path("mock.log"));
        procs.push(proc);
        let mock: SocketAddr = ready_field(&line, "addr").parse().expect("mock addr");
        let key_hash = blake3::hash(CLIENT_KEY.as_bytes()).to_hex();
        let ops_hash = blake3::hash(OPS_KEY.as_bytes()).to_hex();
        let edge = |name: &'static str| {
            let toml = format!(
                "[edge]\nname = \"{name}\"\ntrust_domain = \"{TRUST_DOMAIN}\"\n\
                 client_listen = \"127.0.0.1:0\"\nnode_listen = \"127.0.0.1:0\"\n\n\
                 [tls]\nca = \"{ca}\"\ncert = \"{cert}\"\nkey = \"{key}\"\n\n\
                 [[client_keys]]\nprincipal = \"team\"\nkey_hash = \"{key_hash}\"\n\
                 requests_per_minute = 8\n\n\
                 [[client_keys]]\nprincipal = \"ops\"\nkey_hash = \"{ops_hash}\"\n\
                 scopes = [\"admin\"]\n\n\
                 [cluster]\nname = \"{label}\"\netcd_endpoints = [\"{etcd_addr}\"]\n\
                 lease_ttl_sec = 60\nkeepalive_interval_sec = 3\npeer_listen = \"127.0.0.1:0\"\n\n\
                 {fleet}",
                ca = dir.path("ca.pem"),
                cert = dir.path(&format!("edge-{name}.pem")),
                key = dir.path(&format!("edge-{name}-key.pem")),
                fleet = fleet(mock),
            );
            let file = dir.path(&format!("{name}.toml"));
            std::fs::write(&file, toml).expect("edge.toml");
            let mut command = Command::new(bin("edge-bin"));
            command.args(["--config", &file]).env("RUST_LOG", "info");
            let (proc, line) = start_ready(command, &dir.path(&format!("{name}.log")));
            EdgeProc {
                name,
                client: ready_field(&line, "client").parse().expect("client"),
                peer: ready_field(&line, "peer").parse().expect("peer"),
                proc: Some(proc),
            }
            .with_nodes(ready_field(&line, "nodes"))
        };
        let (a, a_nodes) = edge("edge-1");
        let (b, b_nodes) = edge("edge-2");
        for (node, edge_name, edge_addr) in [
            ("node-a", "edge-2", &b_nodes),
            ("node-b", "edge-1", &a_nodes),
        ] {
            let toml = format!(
                "node_id = \"{node}\"\ntrust_domain = \"{TRUST_DOMAIN}\"\n\
                 edge_addr = \"{edge_addr}\"\nedge_name = \"{edge_name}\"\n\n\
                 [tls]\nca = \"{ca}\"\ncert = \"{cert}\"\nkey = \"{key}\"\n\n\
                 [reconnect]\ninterval_sec = 1\nmax_attempts = 0\n",
                ca = dir.path("ca.pem"),
                cert = dir.path(&format!("node-{node}.pem")),
                key = dir.path(&format!("node-{node}-key.pem")),
            );
            let file = dir.path(&format!("{node}.toml"));
            std::fs::write(&file, toml).expect("node.toml");
            let child = Command::new(bin("node-bin"))
                .args(["--config", &file])
                .env_remove("NOTIFY_SOCKET")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.path(&format!("{node}.log"))).expect("log"))
                .spawn()
                .expect("spawn node-bin");
            procs.push(Running(child));
        }
        let cluster = Self {
            dir,
            a,
            b,
            mock,
            _procs: procs,
            _etcd: etcd,
        };
        let owned = json!([
            {"node_id": "node-a", "edge": "edge-2"},
            {"node_id": "node-b", "edge": "edge-1"},
        ]);
        let started = clock::now();
        for edge in [&cluster.a, &cluster.b] {
            loop {
                let status = cluster.status(edge);
                let cluster_view = &status["cluster"];
                if cluster_view["nodes"] == owned
                    && cluster_view["edges"] == json!(["edge-1", "edge-2"])
                {
                    break;
                }
                assert!(
                    started.elapsed() < GENEROUS,
                    "{}: the cluster did not form: {status}",
                    edge.name
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        cluster
    }

    fn status(&self, edge: &EdgeProc) -> Value {
        let response = request(edge.client, "GET", "/status", &[OPS], "").expect("status");
        assert_eq!(response.status, 200, "{}", response.text());
        response.json()
    }

    /// `in_flight` of `node-a`'s provider as B sees it.
    fn in_flight_at_b(&self) -> u64 {
        let status = self.status(&self.b);
        status["providers"]
            .as_array()
            .expect("providers")
            .iter()
            .find(|p| p["node_id"] == "node-a")
            .unwrap_or_else(|| panic!("no node-a in {status}"))["in_flight"]
            .as_u64()
            .expect("in_flight")
    }

    fn chat(&self, edge: &EdgeProc, model: &str, stream: bool) -> Response {
        request(
            edge.client,
            "POST",
            "/v1/chat/completions",
            &[AUTH],
            &chat_body(model, stream),
        )
        .expect("chat")
    }

    /// Sample `name{labels}` of `edge`'s `/metrics` (0 when absent).
    fn metric(&self, edge: &EdgeProc, sample: &str) -> u64 {
        let text = request(edge.client, "GET", "/metrics", &[OPS], "")
            .expect("metrics")
            .text();
        text.lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
            .map_or(0, |v| v.parse().expect("a number"))
    }

    fn mock_stats(&self) -> Value {
        request(self.mock, "GET", "/admin/stats", &[], "")
            .expect("mock stats")
            .json()
    }

    fn log(&self, edge: &EdgeProc) -> String {
        std::fs::read_to_string(self.dir.path(&format!("{}.log", edge.name))).expect("edge log")
    }

    /// The first line of `edge`'s log that `wanted` picks, waiting for the
    /// access log's writer to write it.
    fn log_line(&self, edge: &EdgeProc, wanted: impl Fn(&str) -> bool) -> String {
        let started = clock::now();
        loop {
            let log = self.log(edge);
            if let Some(line) = log.lines().find(|l| wanted(l)) {
                return line.to_string();
            }
            assert!(
                started.elapsed() < GENEROUS,
                "no such line in {}'s log:\n{log}",
                edge.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl EdgeProc {
    fn with_nodes(self, nodes: String) -> (Self, String) {
        (self, nodes)
    }
}

/// Both nodes and both models, the same on every Edge.
fn fleet(mock: SocketAddr) -> String {
    let mut text = String::new();
    for node in ["node-a", "node-b"] {
        text.push_str(&format!(
            "[[nodes]]\nid = \"{node}\"\n\
             [[nodes.adapters]]\nname = \"mock\"\nkind = \"openai_compat\"\n\
             profile = \"openai\"\nbase_url = \"http://{mock}\"\ncapacity = 4\n\
             [[nodes.providers]]\nid = \"mock\"\nadapter = \"mock\"\ntarget = \"mock-model\"\n\
             capacity = 4\n\n"
        ));
    }
    text.push_str(
        "[[models]]\nname = \"model-a\"\nproviders = [\"node-a/mock\"]\nqueue_timeout_ms = 1000\n\n\
         [[models]]\nname = \"model-b\"\nproviders = [\"node-b/mock\"]\nqueue_timeout_ms = 1000\n",
    );
    text
}

/// `body` with what differs between two answers of the mock to the same
/// request masked: its completion id `chatcmpl-mock-<seq>` (it numbers
/// its completions) and the send time it stamps on each object
/// (`"iop_mock_sent_ns":<digits>`). Every other byte is kept.
fn masked(body: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(body);
    let mut out = String::with_capacity(text.len());
    let mut rest = &text[..];
    loop {
        let next = [
            (
                rest.find("\"chatcmpl-mock-"),
                "\"chatcmpl-mock-",
                "\"chatcmpl-mock-N",
            ),
            (
                rest.find("\"iop_mock_sent_ns\":"),
                "\"iop_mock_sent_ns\":",
                "\"iop_mock_sent_ns\":N",
            ),
        ]
        .into_iter()
        .filter_map(|(at, prefix, mask)| Some((at?, prefix, mask)))
        .min_by_key(|(at, _, _)| *at);
        let Some((at, prefix, mask)) = next else {
            out.push_str(rest);
            return out.into_bytes();
        };
        out.push_str(&rest[..at]);
        out.push_str(mask);
        rest = rest[at + prefix.len()..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
}

// (a) A request for `model-a` (its node owned by B) sent to A is forwarded
// to B: A's client gets exactly the bytes B gives a client of its own for
// the same request (masked: the mock numbers its completions and stamps its send time),
// with usage, streamed and not. The rate limit (4 a minute) is charged at
// A only: after A forwarded two requests, B still lets three of its own
// clients' requests through. (e) A request arriving on B's peer listener
// (as A would send it, with A's certificate) for `model-b`, whose node A
// owns, is not forwarded back: it waits in B's queue and gets B's 503,
// while the same request to B's client listener is forwarded to A and
// answered; B's access log marks the peer's request `peer=edge-1`.
#[test]
fn a_forwarded_request_is_answered_byte_exact_and_never_forwarded_twice() {
    let cluster = Cluster::start("exact", &["--tokens", "3"]);
    let (a, b) = (&cluster.a, &cluster.b);

    let via_a = cluster.chat(a, "model-a", false);
    let via_a_stream = cluster.chat(a, "model-a", true);
    let at_b = cluster.chat(b, "model-a", false);
    let at_b_stream = cluster.chat(b, "model-a", true);
    assert_eq!(via_a.status, 200, "{}", via_a.text());
    assert_eq!(at_b.status, 200, "{}", at_b.text());
    assert_eq!(masked(&via_a.body), masked(&at_b.body));
    assert_ne!(masked(&via_a.body), via_a.body, "the mask found its fields");
    assert_eq!(via_a.json()["usage"]["completion_tokens"], 3);
    assert_eq!(via_a_stream.status, 200, "{}", via_a_stream.text());
    assert_eq!(masked(&via_a_stream.body), masked(&at_b_stream.body));
    assert!(
        via_a_stream.text().contains(r#""usage":{"prompt_tokens":"#),
        "{}",
        via_a_stream.text()
    );
    assert!(via_a_stream.text().ends_with("data: [DONE]\n\n"));
    for (forwarded, direct) in [(&via_a, &at_b), (&via_a_stream, &at_b_stream)] {
        assert_eq!(
            forwarded.header("content-type"),
            direct.header("content-type")
        );
    }
    // One id for the request on both Edges.
    let id = via_a.header("x-request-id").expect("a request id");
    let line = cluster.log_line(b, |l| l.contains(&format!("request_id={id} ")));
    assert!(line.contains("peer=edge-1"), "{line}");
    assert_eq!(
        cluster.metric(
            a,
            "iop_edge_cluster_forwarded_total{edge=\"edge-2\",outcome=\"ok\"}"
        ),
        2
    );
    assert_eq!(cluster.metric(b, "iop_edge_cluster_peer_requests_total"), 2);

    // Eight requests a minute per key, split between the two Edges (four
    // each): A charged the two it forwarded, B only its own two; its third
    // and fourth (below) are admitted, a fifth is not.
    let third_at_b = cluster.chat(b, "model-a", false);
    assert_eq!(third_at_b.status, 200, "{}", third_at_b.text());

    // (e) On B's peer listener, as edge-1: served by B, not forwarded.
    let as_a = peer_client(&cluster.dir, Some("edge-edge-1"));
    let started = clock::now();
    let from_peer = peer_request(
        as_a.clone(),
        b.peer,
        &[AUTH],
        &chat_body("model-b", false),
        "/v1/chat/completions",
    )
    .expect("peer request");
    assert_eq!(
        (from_peer.status, from_peer.json()["error"]["code"].clone()),
        (503, json!("no_provider_available")),
        "{}",
        from_peer.text()
    );
    // It waited for B's queue timeout (1 s): B's own answer.
    assert!(started.elapsed() >= Duration::from_millis(1000));
    let line = cluster.log_line(b, |l| {
        l.contains("model=model-b") && l.contains("peer=edge-1")
    });
    assert!(line.contains("status=503"), "{line}");
    // The key is still checked on the peer listener.
    let keyless = peer_request(
        as_a,
        b.peer,
        &[],
        &chat_body("model-b", false),
        "/v1/chat/completions",
    )
    .expect("peer request");
    assert_eq!(keyless.status, 401, "{}", keyless.text());
    // The same request from a client of B: forwarded to A, answered.
    let from_client = cluster.chat(b, "model-b", false);
    assert_eq!(from_client.status, 200, "{}", from_client.text());
    assert_eq!(from_client.json()["usage"]["completion_tokens"], 3);
    assert_eq!(
        cluster.metric(
            b,
            "iop_edge_cluster_forwarded_total{edge=\"edge-1\",outcome=\"ok\"}"
        ),
        1
    );
    assert_eq!(cluster.metric(a, "iop_edge_cluster_peer_requests_total"), 1);
    cluster.log_line(b, |l| {
        l.contains("model=model-b") && l.contains("forwarded_to=edge-1")
    });
    // B's fifth request of its own is over its share of the key's limit
    // (the peer's request above was not charged at B).
    let fifth_at_b = cluster.chat(b, "model-a", false);
    assert_eq!(fifth_at_b.status, 429, "{}", fifth_at_b.text());
    assert!(
        fifth_at_b.text().contains("4 requests per minute"),
        "{}",
        fifth_at_b.text()
    );
}

// (d) B's peer listener takes Edges only: a client without a certificate
// and one presenting a node certificate (same CA) are refused in the
// handshake — the exchange fails with the TLS alert and no HTTP byte —
// while edge-1's certificate gets an answer.
#[test]
fn the_peer_listener_refuses_clients_without_an_edge_certificate() {
    let cluster = Cluster::start("mtls", &["--tokens", "3"]);
    let b = &cluster.b;
    for (identity, alert) in [
        (None, rustls::AlertDescription::CertificateRequired),
        (Some("node-node-a"), rustls::AlertDescription::AccessDenied),
    ] {
        let refused = peer_request(
            peer_client(&cluster.dir, identity),
            b.peer,
            &[AUTH],
            "",
            "/livez",
        )
        .expect_err("refused");
        let cause = refused
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
            .unwrap_or_else(|| panic!("{identity:?}: not a TLS error: {refused:?}"));
        assert_eq!(cause, &rustls::Error::AlertReceived(alert), "{identity:?}");
    }
    let edge = peer_request(
        peer_client(&cluster.dir, Some("edge-edge-1")),
        b.peer,
        &[AUTH],
        "",
        "/livez",
    )
    .expect("an edge is served");
    assert_eq!((edge.status, edge.text()), (200, "ok\n".to_string()));
}

// (c) A client that leaves a forwarded stream at A: A closes its
// connection to B, B cancels the run (its provider's in_flight back to 0)
// and the mock sees the stream aborted. (b) Then, with B gone, A cannot
// reach an owner of `model-a`: 503 `peer_unavailable` with retry-after.
#[test]
fn a_client_leaving_at_a_cancels_the_run_at_b_and_without_b_a_answers_503() {
    let mut cluster = Cluster::start("cancel", &["--inter-token-ms", "300", "--tokens", "200"]);
    let a_client = cluster.a.client;
    let mut tcp = TcpStream::connect(a_client).expect("connect");
    tcp.set_read_timeout(Some(GENEROUS)).expect("timeout");
    tcp.write_all(&request_bytes(
        "POST",
        "/v1/chat/completions",
        &[AUTH],
        &chat_body("model-a", true),
    ))
    .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("tok0") {
        let n = tcp.read(&mut buf).expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(cluster.in_flight_at_b(), 1);
    assert_eq!(cluster.mock_stats()["active_streams"], 1);
    drop(tcp);
    let started = clock::now();
    loop {
        let stats = cluster.mock_stats();
        // B's access line says why the run ended.
        let logged = cluster
            .log(&cluster.b)
            .lines()
            .any(|l| l.contains("peer=edge-1") && l.contains("outcome=client_disconnect"));
        if cluster.in_flight_at_b() == 0 && stats["streams_aborted"] == 1 && logged {
            assert_eq!(stats["active_streams"], 0);
            break;
        }
        assert!(
            started.elapsed() < GENEROUS,
            "B did not cancel the run: {stats}\n{}",
            cluster.log(&cluster.b)
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // (b) B is gone (its etcd lease, 60 s, still names it the owner).
    drop(cluster.b.proc.take());
    let response = cluster.chat(&cluster.a, "model-a", false);
    assert_eq!(response.status, 503, "{}", response.text());
    assert_eq!(response.header("retry-after").as_deref(), Some("1"));
    assert_eq!(
        response.json(),
        json!({"error": {
            "message": "The providers of model `model-a` are served by another gateway of this \
                        cluster, which cannot be reached right now; retry shortly.",
            "type": "service_unavailable_error", "param": null, "code": "peer_unavailable"
        }})
    );
    assert_eq!(
        cluster.metric(
            &cluster.a,
            "iop_edge_cluster_forwarded_total{edge=\"edge-2\",outcome=\"unavailable\"}"
        ),
        1
    );
}
