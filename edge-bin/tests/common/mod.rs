//! Harness for the in-process walking-skeleton tests: dev certificates, an
//! Edge served by `edge_bin::server`, the `bench` mock provider, raw node
//! connections, and a small raw HTTP/1.1 client with an independent
//! de-chunker.
//!
//! Everything binds `127.0.0.1:0` and runs on the test's monoio runtime;
//! services stop through a oneshot, and whatever is still pending when the
//! test body returns is dropped with the runtime.

// Each test binary uses a different subset of the harness.
#![allow(dead_code)]

pub mod any_server_cert;
pub mod etcd;
pub use any_server_cert::AnyServerCert;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use edge_bin::config::EdgeConfig;
use edge_bin::control::Control;
use edge_bin::link::edge::Edge;
use edge_bin::link::settings;
use edge_bin::plane::credentials::{CredentialPlane, RunningPlane};
use edge_bin::server::{self, Listeners};
use iop_engine::certs::{write_dev_certs_with_https, DevCertFiles};
use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SocketShutdown};
use iop_engine::sync::oneshot;
use iop_engine::tls::{
    rustls_cause, EdgeTlsAcceptor, HttpsAcceptor, NodeAllowList, NodeTlsConnector, TlsFiles,
    TlsMaterial, UpstreamTls, UpstreamTlsSettings,
};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};
use monoio::task::JoinHandle;
use serde_json::Value;

/// SPIFFE trust domain of every test certificate.
pub const TRUST_DOMAIN: &str = "iop.local";
/// The Edge's identity name.
pub const EDGE_NAME: &str = "edge-1";
/// The external model clients ask for (E2).
pub const MODEL: &str = "chat-model";
/// The external model served by node-b.
pub const MODEL_B: &str = "chat-model-b";
/// The provider-side target the Edge writes into the body (U5).
pub const TARGET: &str = "mock-target-7b";
/// The adapter instance name on every node.
pub const ADAPTER: &str = "mock";
/// The stall timeout configured on node-a's provider, copied into every
/// pool dispatch (W2).
pub const STALL_TIMEOUT_MS: i64 = 120_000;
/// How long a request for [`MODEL`] waits for a lease before its 503.
pub const QUEUE_TIMEOUT_MS: u64 = 200;
/// A whole test must finish within this; a hang fails instead of blocking.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Polling period while waiting for a state change the test cannot await.
const POLL_PERIOD: Duration = Duration::from_millis(5);

/// Runs `body` under [`TEST_TIMEOUT`]. Only the whole test is wrapped, never
/// a single TLS read: when the timeout fires the test ends anyway.
pub async fn guarded<F: Future>(body: F) -> F::Output {
    match monoio::time::timeout(TEST_TIMEOUT, body).await {
        Ok(out) => out,
        Err(_) => panic!("the test did not finish within {TEST_TIMEOUT:?}"),
    }
}

// ---------------------------------------------------------------------------
// Certificates

/// Dev certificates (CA, `edge-1`, nodes `node-a`, `node-b`, `node-c`) in a
/// per-test directory under Cargo's target tmpdir, removed on drop.
#[derive(Debug)]
pub struct Pki {
    /// The directory holding the PEM files (and nominally the configs).
    pub dir: PathBuf,
    /// The files written.
    pub files: DevCertFiles,
}

impl Pki {
    /// Mints a fresh set for test `name`, in a directory of its own (the
    /// same test runs once per driver, concurrently).
    pub fn mint(name: &str) -> Self {
        static MINTED: AtomicUsize = AtomicUsize::new(0);
        let n = MINTED.fetch_add(1, Ordering::Relaxed);
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("edge-skeleton-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let files = write_dev_certs_with_https(
            &dir,
            TRUST_DOMAIN,
            EDGE_NAME,
            ["node-a", "node-b", "node-c"],
            &["localhost"],
        )
        .expect("mint dev certificates");
        Self { dir, files }
    }

    /// The `[edge.client_tls]` table serving the client listener over HTTPS
    /// with the dev HTTPS certificate (for `localhost`); goes last in
    /// [`EdgeOptions::edge_keys`].
    pub fn client_tls_keys(&self) -> String {
        let https = self
            .files
            .https
            .as_ref()
            .expect("minted with an HTTPS pair");
        format!(
            "[edge.client_tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            https.cert.display(),
            https.key.display()
        )
    }

    /// A TLS client that trusts the dev CA (and nothing else).
    pub fn https_client(&self) -> UpstreamTls {
        UpstreamTls::new(&UpstreamTlsSettings {
            ca_pem: Some(std::fs::read_to_string(&self.files.ca_cert).expect("ca.pem")),
            insecure_skip_verify: false,
        })
        .expect("HTTPS client")
    }

    /// The TLS files of node `name`.
    pub fn node_files(&self, name: &str) -> TlsFiles {
        self.files
            .node_tls_files(name)
            .unwrap_or_else(|| panic!("no certificate minted for {name}"))
    }

    /// A Node-side connector presenting node `name`'s certificate.
    pub fn connector(&self, name: &str) -> NodeTlsConnector {
        let material = TlsMaterial::from_files(&self.node_files(name)).expect("node material");
        NodeTlsConnector::new(&material, TRUST_DOMAIN, EDGE_NAME).expect("node connector")
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------------------
// Services

/// A spawned service that runs until [`Service::stop`].
pub struct Service {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

impl Service {
    /// Spawns `run`, which is given a future that completes on stop.
    pub fn spawn<F, R>(run: F) -> Self
    where
        F: FnOnce(std::pin::Pin<Box<dyn Future<Output = ()>>>) -> R,
        R: Future<Output = ()> + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = monoio::spawn(run(Box::pin(async move {
            let _ = stopped.await;
        })));
        Self { stop, task }
    }

    /// Stops the service and waits for it to return.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await;
    }
}

/// The `bench` mock provider, in process.
#[derive(Debug)]
pub struct Mock {
    /// Where it listens.
    pub addr: SocketAddr,
    service: Service,
}

impl Mock {
    /// Starts a mock streaming `tokens` tokens without pauses.
    pub fn start(tokens: u32) -> Self {
        Self::start_paced(tokens, 0)
    }

    /// Starts a mock streaming `tokens` tokens `inter_token_ms` apart.
    pub fn start_paced(tokens: u32, inter_token_ms: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind mock provider");
        let addr = listener.local_addr().expect("mock address");
        let config = bench::mock::MockConfig {
            ttft_ms: 0,
            inter_token_ms,
            tokens,
            models: vec![TARGET.to_string()],
        };
        let service = Service::spawn(move |stopped| async move {
            monoio::select! {
                never = bench::mock::serve(listener, config) => match never {},
                _ = stopped => {}
            }
        });
        Self { addr, service }
    }

    /// Stops it.
    pub async fn stop(self) {
        self.service.stop().await;
    }
}

/// Options of the Edge config the tests vary.
#[derive(Debug, Clone)]
pub struct EdgeOptions {
    /// The provider base URL of every node's adapter.
    pub provider_addr: SocketAddr,
    /// `edge.max_request_body_bytes`, if set.
    pub max_request_body_bytes: Option<usize>,
    /// More `[edge]` lines (`key = value`, one per line).
    pub edge_keys: String,
    /// More TOML at the end of the file (e.g. more `[[models]]`).
    pub extra_toml: String,
}

impl EdgeOptions {
    /// Nodes whose adapters point at `provider_addr`.
    pub fn new(provider_addr: SocketAddr) -> Self {
        Self {
            provider_addr,
            max_request_body_bytes: None,
            edge_keys: String::new(),
            extra_toml: String::new(),
        }
    }

    /// Adapters pointing at the discard port: for raw nodes that answer
    /// tunnels by hand, so no provider is ever dialled.
    pub fn without_provider() -> Self {
        Self::new(SocketAddr::from(([127, 0, 0, 1], 9)))
    }
}

/// `allow_anonymous = true` unless the test configures client keys (or
/// says so itself): an Edge without keys must say it runs open.
fn open_access(options: &EdgeOptions) -> &'static str {
    if options.extra_toml.contains("[[client_keys]]")
        || options.edge_keys.contains("allow_anonymous")
    {
        ""
    } else {
        "allow_anonymous = true\n"
    }
}

/// The Edge config text: nodes `node-a` and `node-b` (`node-c` has a
/// certificate but is not configured), each with one OpenAI-compatible
/// adapter `mock` and one provider of target [`TARGET`]; model [`MODEL`] on
/// node-a and [`MODEL_B`] on node-b.
pub fn edge_toml(pki: &Pki, options: &EdgeOptions) -> String {
    let edge = pki.files.edge_tls_files();
    let body_limit = options
        .max_request_body_bytes
        .map(|n| format!("max_request_body_bytes = {n}\n"))
        .unwrap_or_default()
        + open_access(options)
        + &options.edge_keys;
    let node = |id: &str, provider: &str, stall: i64| {
        format!(
            r#"
[[nodes]]
id = "{id}"

[[nodes.adapters]]
name = "{ADAPTER}"
kind = "openai_compat"
profile = "openai"
base_url = "http://{provider_addr}"
capacity = 4

[[nodes.providers]]
id = "{provider}"
adapter = "{ADAPTER}"
target = "{TARGET}"
capacity = 2
response_stall_timeout_ms = {stall}
category = "api"
"#,
            provider_addr = options.provider_addr,
        )
    };
    format!(
        r#"
[edge]
name = "{EDGE_NAME}"
trust_domain = "{TRUST_DOMAIN}"
client_listen = "127.0.0.1:0"
node_listen = "127.0.0.1:0"
{body_limit}
[tls]
ca = "{ca}"
cert = "{cert}"
key = "{key}"
{node_a}
{node_b}
[[models]]
name = "{MODEL}"
providers = ["node-a/a-mock"]
queue_timeout_ms = {QUEUE_TIMEOUT_MS}

[[models]]
name = "{MODEL_B}"
providers = ["node-b/b-mock"]
{extra}
"#,
        extra = options.extra_toml,
        ca = edge.ca_path.display(),
        cert = edge.cert_path.display(),
        key = edge.key_path.display(),
        node_a = node("node-a", "a-mock", STALL_TIMEOUT_MS),
        node_b = node("node-b", "b-mock", 0),
    )
}

/// An Edge served in process by `edge_bin::server`, wired as `main` wires
/// it: config parsed with `EdgeConfig::parse`, TLS material read from the
/// config's files, allow list from the configured nodes.
#[derive(Debug)]
pub struct TestEdge {
    /// The shard state (Control and the shell tables).
    pub edge: Rc<Edge>,
    /// The client HTTP listener.
    pub client_addr: SocketAddr,
    /// The node listener.
    pub node_addr: SocketAddr,
    service: Service,
}

impl TestEdge {
    /// Parses `toml` and starts serving it.
    pub fn start(pki: &Pki, toml: &str) -> Self {
        Self::start_with(pki, toml, false)
    }

    /// [`TestEdge::start`] with the credential plane of `toml`'s
    /// `[credentials]` loaded as the binary loads it (no environment
    /// variables: slot secrets come from files).
    pub fn start_with_credentials(pki: &Pki, toml: &str) -> Self {
        Self::start_with(pki, toml, true)
    }

    fn start_with(pki: &Pki, toml: &str, credentials: bool) -> Self {
        let cfg = EdgeConfig::parse(toml, pki.dir.join("edge.toml")).expect("edge config");
        cfg.validate_files().expect("edge TLS files");
        let tls = cfg.tls.as_ref().expect("the test config has [tls]");
        let material = TlsMaterial::from_files(&TlsFiles {
            ca_path: tls.ca.clone(),
            cert_path: tls.cert.clone(),
            key_path: tls.key.clone(),
        })
        .expect("edge material");
        let allowed = NodeAllowList::new(cfg.nodes.iter().map(|n| n.id.clone()));
        let acceptor = EdgeTlsAcceptor::new(&material, &cfg.edge.trust_domain, allowed)
            .expect("edge acceptor");
        let plane = credentials
            .then(|| {
                CredentialPlane::load(&cfg, &|_| None)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .map(RunningPlane::new)
            })
            .flatten();
        let mut settings = settings::settings(&cfg, plane);
        settings.node_allow_list = Some(acceptor.allowed_nodes().clone());
        settings.client_tls = cfg
            .client_tls
            .as_ref()
            .map(|files| HttpsAcceptor::from_files(files).expect("client listener TLS"));
        settings.usage_log = settings::usage_log(&cfg);
        settings.access_log = settings::access_log(&cfg);
        let edge = Rc::new(Edge::new(
            Control::new(edge_bin::control::control_spec(&cfg)),
            settings,
        ));
        let listeners = Listeners::bind(&cfg).expect("bind edge listeners");
        let client_addr = listeners.client_addr().expect("client address");
        let node_addr = listeners.node_addr().expect("node address");
        let served = edge.clone();
        let service = Service::spawn(move |stopped| {
            server::serve(served, listeners, Some(Rc::new(acceptor)), stopped)
        });
        Self {
            edge,
            client_addr,
            node_addr,
            service,
        }
    }

    /// [`TestEdge::start`] with the config of [`EdgeOptions::without_provider`].
    pub fn without_provider(pki: &Pki) -> Self {
        Self::start(pki, &edge_toml(pki, &EdgeOptions::without_provider()))
    }

    /// Stops accepting (connections already open are dropped with the
    /// test) and writes what the usage file has left, as the binary does
    /// after its drain.
    pub async fn stop(self) {
        self.service.stop().await;
        self.edge.settings.usage_log.close();
    }
}

/// The Node config text for `node_id` dialling `edge_addr`, with unlimited
/// reconnects one second apart.
pub fn node_toml(pki: &Pki, node_id: &str, edge_addr: SocketAddr) -> String {
    let files = pki.node_files(node_id);
    format!(
        r#"
node_id = "{node_id}"
trust_domain = "{TRUST_DOMAIN}"
edge_addr = "{edge_addr}"
edge_name = "{EDGE_NAME}"

[tls]
ca = "{ca}"
cert = "{cert}"
key = "{key}"

[reconnect]
interval_sec = 1
max_attempts = 0
"#,
        ca = files.ca_path.display(),
        cert = files.cert_path.display(),
        key = files.key_path.display(),
    )
}

// ---------------------------------------------------------------------------
// Raw HTTP/1.1 client

/// A parsed HTTP response; `body` is de-chunked when the response was
/// chunked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers in order, names lowercased.
    pub headers: Vec<(String, String)>,
    /// Whether the body was `transfer-encoding: chunked`.
    pub chunked: bool,
    /// The body bytes (de-chunked).
    pub body: Vec<u8>,
    /// Bytes of the whole response as it came off the socket.
    pub wire_bytes: usize,
}

impl HttpResponse {
    /// The value of header `name` (lowercase), if present once or more.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// Sends `request` (raw bytes, which should ask for `connection: close`) and
/// reads the response to EOF.
pub async fn http_exchange(addr: SocketAddr, request: Vec<u8>) -> HttpResponse {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    exchange(tcp, request).await
}

/// [`http_exchange`] over HTTPS to `localhost` at `addr`, with `client`.
pub async fn https_exchange(
    addr: SocketAddr,
    client: &UpstreamTls,
    request: Vec<u8>,
) -> HttpResponse {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let tls = client
        .connect(tcp, "localhost")
        .await
        .expect("TLS handshake");
    exchange(tls, request).await
}

/// Writes `request` on `stream`, then reads and parses the response to EOF.
async fn exchange<S: AsyncReadRent + AsyncWriteRent>(
    mut stream: S,
    request: Vec<u8>,
) -> HttpResponse {
    let (res, _) = stream.write_all(request).await;
    res.expect("write request");
    let mut raw = Vec::new();
    loop {
        let (res, buf) = stream.read(Vec::with_capacity(16 * 1024)).await;
        match res.expect("read response") {
            0 => break,
            _ => raw.extend_from_slice(&buf),
        }
    }
    parse_response(&raw)
}

/// The bytes of a `method path` request with `body` as
/// `application/json`, `connection: close`.
pub fn request_bytes(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// `method path` with `body` as `application/json`, `connection: close`.
pub async fn http_request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> HttpResponse {
    http_exchange(addr, request_bytes(method, path, body)).await
}

/// The value of counter or gauge `name` in the Edge's `/metrics`.
pub async fn metric(addr: SocketAddr, name: &str) -> u64 {
    metric_over(addr, None, name).await
}

/// [`metric`], over HTTPS with `tls` when given.
pub async fn metric_over(addr: SocketAddr, tls: Option<&UpstreamTls>, name: &str) -> u64 {
    let request = request_bytes("GET", "/metrics", b"");
    let response = match tls {
        Some(client) => https_exchange(addr, client, request).await,
        None => http_exchange(addr, request).await,
    };
    let text = String::from_utf8(response.body).expect("metrics are UTF-8");
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
        .parse()
        .expect("a number")
}

/// `POST /v1/chat/completions` with `body`.
pub async fn post_chat(addr: SocketAddr, body: &str) -> HttpResponse {
    http_request(addr, "POST", "/v1/chat/completions", body.as_bytes()).await
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Parses a complete response: head, then a chunked body (de-chunked
/// strictly: every size line, every CRLF, the last chunk, nothing after) or
/// a `content-length` body.
pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let head_end = find(raw, b"\r\n\r\n").expect("response head ends with CRLFCRLF");
    let head = std::str::from_utf8(&raw[..head_end]).expect("head is UTF-8");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let mut parts = status_line.splitn(3, ' ');
    assert_eq!(
        parts.next(),
        Some("HTTP/1.1"),
        "status line {status_line:?}"
    );
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .map(|line| {
            let (name, value) = line
                .split_once(':')
                .unwrap_or_else(|| panic!("header line {line:?}"));
            (name.trim().to_ascii_lowercase(), value.trim().to_string())
        })
        .collect();
    let rest = &raw[head_end + 4..];
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        let len: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .map(|(_, v)| v.parse().expect("content-length is a number"))
            .expect("a response without chunking has a content-length");
        assert_eq!(rest.len(), len, "body length vs content-length");
        rest.to_vec()
    };
    HttpResponse {
        status,
        headers,
        chunked,
        body,
        wire_bytes: raw.len(),
    }
}

/// De-chunks a complete chunked body, written independently of the engine's
/// codec so the test does not check the Edge with its own parser.
pub fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    loop {
        let line_end = find(rest, b"\r\n").expect("chunk size line ends with CRLF");
        let size_text = std::str::from_utf8(&rest[..line_end]).expect("chunk size is ASCII");
        let size = usize::from_str_radix(size_text, 16)
            .unwrap_or_else(|_| panic!("chunk size {size_text:?}"));
        rest = &rest[line_end + 2..];
        if size == 0 {
            assert_eq!(rest, b"\r\n", "the last chunk ends the body (no trailers)");
            return body;
        }
        assert!(rest.len() >= size + 2, "chunk of {size} bytes is complete");
        body.extend_from_slice(&rest[..size]);
        assert_eq!(&rest[size..size + 2], b"\r\n", "chunk data ends with CRLF");
        rest = &rest[size + 2..];
    }
}

/// `GET /status` as JSON.
pub async fn status(addr: SocketAddr) -> Value {
    let response = http_request(addr, "GET", "/status", b"").await;
    assert_eq!(response.status, 200);
    response.json()
}

/// The `/status` entry of `node_id`'s provider.
pub fn provider_entry(status: &Value, node_id: &str) -> Value {
    status["providers"]
        .as_array()
        .expect("providers array")
        .iter()
        .find(|p| p["node_id"] == node_id)
        .cloned()
        .unwrap_or_else(|| panic!("no provider of {node_id} in {status}"))
}

/// `node_id`'s provider entry in a fresh `GET /status`.
pub async fn node_entry(addr: SocketAddr, node_id: &str) -> Value {
    provider_entry(&status(addr).await, node_id)
}

/// Polls `/status` until `node_id`'s provider shows `connected`.
pub async fn wait_connected(addr: SocketAddr, node_id: &str, connected: bool) -> Value {
    loop {
        let entry = provider_entry(&status(addr).await, node_id);
        if entry["connected"] == connected {
            return entry;
        }
        monoio::time::sleep(POLL_PERIOD).await;
    }
}

/// The `/status` entry of a configured provider that is not dispatch-ready
/// (P3: every figure zero, unavailable/offline).
pub fn offline_entry(node_id: &str, provider_id: &str) -> Value {
    serde_json::json!({
        "node_id": node_id, "provider_id": provider_id, "adapter": ADAPTER,
        "target": TARGET, "category": "api", "status": "unavailable", "health": "offline",
        "capacity": 0, "long_context_capacity": 0, "in_flight": 0, "long_in_flight": 0,
        "queued": 0, "long_queued": 0, "connected": false, "outlier": in_rotation(),
        "drained": false, "node_drained": false, "draining": false, "removed": false
    })
}

/// The `/status` `outlier` of a provider in rotation with no failure.
pub fn in_rotation() -> Value {
    serde_json::json!({
        "ejected": false, "reason": null, "consecutive_failures": 0, "ejections": 0,
        "readmit_in_ms": null
    })
}

/// The `/status` entry of a dispatch-ready provider (capacity 2) with
/// `in_flight` leases.
pub fn ready_entry(node_id: &str, provider_id: &str, in_flight: u32) -> Value {
    serde_json::json!({
        "node_id": node_id, "provider_id": provider_id, "adapter": ADAPTER,
        "target": TARGET, "category": "api", "status": "available", "health": "available",
        "capacity": 2, "long_context_capacity": 0, "in_flight": in_flight,
        "long_in_flight": 0, "queued": 0, "long_queued": 0, "connected": true,
        "outlier": in_rotation(),
        "drained": false, "node_drained": false, "draining": false, "removed": false
    })
}

/// The answer to a `NodeReadyRequest` the Edge accepts.
pub fn ready_accepted() -> pb::NodeReadyResponse {
    pb::NodeReadyResponse {
        ready: true,
        reason: String::new(),
    }
}

/// The OpenAI error body `{"error":{"message","type","param","code"}}`.
pub fn api_error(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Value {
    serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": code}
    })
}

// ---------------------------------------------------------------------------
// Raw nodes

/// A frame with `body`.
pub fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// A hand-driven node: the engine's frame connection over the node's mTLS
/// stream, with registration, readiness and tunnel answers sent by the test.
#[derive(Debug)]
pub struct RawNode {
    /// Sends frames.
    pub conn: ConnHandle,
    /// Received frames, then the close.
    pub events: ConnEvents,
}

impl RawNode {
    /// Dials `addr` and completes the TLS handshake with `connector`.
    pub async fn connect(addr: SocketAddr, connector: &NodeTlsConnector) -> Self {
        Self::connect_with(addr, connector, ConnConfig::default()).await
    }

    /// [`RawNode::connect`] with `config` for its frame connection (e.g.
    /// test heartbeat timers).
    pub async fn connect_with(
        addr: SocketAddr,
        connector: &NodeTlsConnector,
        config: ConnConfig,
    ) -> Self {
        let tcp = TcpStream::connect(addr).await.expect("dial the edge");
        let shutdown = SocketShutdown::for_socket(&tcp);
        let tls = connector.connect(tcp).await.expect("TLS handshake");
        let (r, w) = tls.into_split();
        let (conn, events) = spawn_conn(r, w, shutdown, config);
        Self { conn, events }
    }

    /// The next application frame; panics if the connection closed.
    pub async fn next_frame(&mut self) -> Body {
        match self.events.recv().await {
            Some(ConnEvent::Frame(pb::Frame { body: Some(body) })) => body,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    /// Waits for the close; panics if a frame arrives first.
    pub async fn closed_reason(&mut self) -> CloseReason {
        match self.events.recv().await {
            Some(ConnEvent::Closed { reason }) => reason,
            other => panic!("expected the close, got {other:?}"),
        }
    }

    /// Sends `RegisterRequest{node_id}` (a node without flow control) and
    /// returns the response.
    pub async fn register(&mut self, node_id: &str) -> pb::RegisterResponse {
        self.register_with_flow_control(node_id, 0).await
    }

    /// Sends `RegisterRequest{node_id, flow_control}` and returns the
    /// response.
    pub async fn register_with_flow_control(
        &mut self,
        node_id: &str,
        flow_control: u32,
    ) -> pb::RegisterResponse {
        self.conn
            .send_control(frame(Body::RegisterRequest(pb::RegisterRequest {
                node_id: node_id.to_string(),
                node_version: "test".to_string(),
                flow_control,
                // A node of before usage-chunk stripping and embeddings
                // runs.
                strips_usage_chunk: false,
                runs_embeddings: false,
                accepts_tunnel_body: false,
            })))
            .expect("send register");
        match self.next_frame().await {
            Body::RegisterResponse(r) => *r,
            other => panic!("expected RegisterResponse, got {other:?}"),
        }
    }

    /// Sends `NodeReadyRequest{node_id}` and returns the response.
    pub async fn ready(&mut self, node_id: &str) -> pb::NodeReadyResponse {
        self.conn
            .send_control(frame(Body::NodeReadyRequest(pb::NodeReadyRequest {
                node_id: node_id.to_string(),
            })))
            .expect("send ready");
        match self.next_frame().await {
            Body::NodeReadyResponse(r) => r,
            other => panic!("expected NodeReadyResponse, got {other:?}"),
        }
    }
}

/// The rustls error a TLS stream's first read fails with (`None` when the
/// read returned data or EOF instead).
pub async fn first_read_error<S: AsyncReadRent>(stream: &mut S) -> Option<rustls::Error> {
    let (res, _) = stream.read(vec![0u8; 64]).await;
    match res {
        Ok(_) => None,
        Err(e) => rustls_cause(&e).cloned(),
    }
}

/// A raw TLS 1.3 client presenting the certificate and key in these PEM
/// files, whatever identity they carry.
pub fn raw_tls_client(cert_path: &Path, key_path: &Path) -> monoio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let cert_pem = std::fs::read(cert_path).expect("read cert");
    let key_pem = std::fs::read(key_path).expect("read key");
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .expect("cert PEM");
    let key = PrivateKeyDer::from_pem_slice(&key_pem).expect("key PEM");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let algorithms = provider.signature_verification_algorithms;
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServerCert(algorithms)))
        .with_client_auth_cert(chain, key)
        .expect("client cert");
    Arc::new(config).into()
}

/// A hand-driven node registered and ready as `node_id`.
pub async fn ready_node(edge: &TestEdge, pki: &Pki, node_id: &str) -> RawNode {
    let mut node = RawNode::connect(edge.node_addr, &pki.connector(node_id)).await;
    assert!(node.register(node_id).await.accepted);
    assert_eq!(node.ready(node_id).await, ready_accepted());
    node
}

/// The next tunnel request `node` gets, skipping credit frames.
pub async fn next_tunnel(node: &mut RawNode) -> pb::ProviderTunnelRequest {
    loop {
        match node.next_frame().await {
            Body::ProviderTunnelRequest(r) => return *r,
            Body::FlowCredit(_) => {}
            other => panic!("expected ProviderTunnelRequest, got {other:?}"),
        }
    }
}

/// A tunnel frame of `run_id` from adapter [`ADAPTER`] serving [`TARGET`].
pub fn tunnel_frame(run_id: &str, seq: u64, kind: pb::TunnelFrameKind) -> pb::ProviderTunnelFrame {
    pb::ProviderTunnelFrame {
        run_id: run_id.into(),
        seq,
        kind: kind as i32,
        adapter: ADAPTER.into(),
        target: TARGET.into(),
        ..Default::default()
    }
}

/// One tunnel frame of `run_id` with `headers` and `body`.
pub fn answer(
    run_id: &str,
    seq: u64,
    kind: pb::TunnelFrameKind,
    headers: &[(&str, &'static [u8])],
    body: &'static [u8],
) -> pb::Frame {
    frame(Body::ProviderTunnelFrame(Box::new(
        pb::ProviderTunnelFrame {
            status: if kind == pb::TunnelFrameKind::ResponseStart {
                200
            } else {
                0
            },
            headers: headers
                .iter()
                .map(|(name, value)| pb::Header {
                    name: (*name).into(),
                    value: Bytes::from_static(value),
                })
                .collect(),
            body: Bytes::from_static(body),
            ..tunnel_frame(run_id, seq, kind)
        },
    )))
}

/// Sends `path` with JSON `body` to the Edge; the node gets the tunnel,
/// which is returned with the node's answer of `content_type` in `pieces`
/// delivered and the client's response.
pub async fn tunneled(
    edge: &TestEdge,
    node: &mut RawNode,
    path: &'static str,
    body: &'static [u8],
    content_type: &'static [u8],
    pieces: &[&'static [u8]],
) -> (pb::ProviderTunnelRequest, HttpResponse) {
    let request = request_bytes("POST", path, body);
    tunneled_request(edge, node, request, content_type, pieces).await
}

/// [`tunneled`] for a whole HTTP `request` of the test's making.
pub async fn tunneled_request(
    edge: &TestEdge,
    node: &mut RawNode,
    request: Vec<u8>,
    content_type: &'static [u8],
    pieces: &[&'static [u8]],
) -> (pb::ProviderTunnelRequest, HttpResponse) {
    let addr = edge.client_addr;
    let mut client = monoio::spawn(async move { http_exchange(addr, request).await });
    let tunnel = monoio::select! {
        tunnel = next_tunnel(node) => tunnel,
        response = &mut client => panic!("answered without a tunnel: {response:?}"),
    };
    let mut seq = 1;
    let head = answer(
        &tunnel.run_id,
        seq,
        pb::TunnelFrameKind::ResponseStart,
        &[("content-type", content_type)],
        b"",
    );
    node.conn.send_bulk(head).await.expect("send the head");
    for piece in pieces {
        seq += 1;
        let f = answer(&tunnel.run_id, seq, pb::TunnelFrameKind::Body, &[], piece);
        node.conn.send_bulk(f).await.expect("send a piece");
    }
    let end = answer(&tunnel.run_id, seq + 1, pb::TunnelFrameKind::End, &[], b"");
    node.conn.send_bulk(end).await.expect("send the end");
    (tunnel, client.await)
}

/// The node answers `run_id` with a 200 head of `content_type`.
pub async fn tunnel_response_start(node: &RawNode, run_id: &str, content_type: &'static [u8]) {
    let start = pb::ProviderTunnelFrame {
        status: 200,
        headers: vec![pb::Header {
            name: "content-type".into(),
            value: Bytes::from_static(content_type),
        }],
        ..tunnel_frame(run_id, 1, pb::TunnelFrameKind::ResponseStart)
    };
    node.conn
        .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(start))))
        .await
        .expect("send head");
}

/// The node sends body bytes of `run_id` as frame `seq`.
pub async fn tunnel_body(node: &RawNode, run_id: &str, seq: u64, piece: &'static [u8]) {
    node.conn
        .send_body_frame(
            tunnel_frame(run_id, seq, pb::TunnelFrameKind::Body),
            Bytes::from_static(piece),
        )
        .await
        .expect("send body");
}

/// The node ends `run_id` with frame `seq`.
pub async fn tunnel_end(node: &RawNode, run_id: &str, seq: u64) {
    node.conn
        .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(tunnel_frame(
            run_id,
            seq,
            pb::TunnelFrameKind::End,
        )))))
        .await
        .expect("send end");
}

/// Reads from `client` into `seen` until it contains `needle`.
pub async fn read_until(client: &mut TcpStream, seen: &mut Vec<u8>, needle: &[u8]) {
    while !seen.windows(needle.len()).any(|w| w == needle) {
        let (res, buf) = client.read(Vec::with_capacity(4096)).await;
        let n = res.expect("read from the edge");
        assert!(
            n > 0,
            "the edge closed the connection; got {:?}",
            String::from_utf8_lossy(seen)
        );
        seen.extend_from_slice(&buf);
    }
}

/// The test Edge's config ([`EdgeOptions::without_provider`]) with these
/// `(principal, key, extra lines)` client keys.
pub fn edge_toml_with_client_keys(pki: &Pki, keys: &[(&str, &str, &str)]) -> String {
    let extra: String = keys
        .iter()
        .map(|(principal, key, extra)| {
            format!(
                "[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\n{extra}\n\n",
                blake3::hash(key.as_bytes()).to_hex()
            )
        })
        .collect();
    let options = EdgeOptions {
        extra_toml: extra,
        ..EdgeOptions::without_provider()
    };
    edge_toml(pki, &options)
}

/// The first event of [`stream_in_flight`]'s stream.
pub const FIRST_EVENT: &[u8] = b"data: {\"n\":1}\n\n";

/// Sends `request` (a streamed chat request) on a new connection to
/// `client_addr`, answers its tunnel on `node` with an event-stream head
/// and [`FIRST_EVENT`], and reads until the client has that event: a
/// stream in flight. Returns the connection, the run id and what the
/// client read so far.
pub async fn stream_in_flight(
    client_addr: SocketAddr,
    node: &mut RawNode,
    request: Vec<u8>,
) -> (TcpStream, String, Vec<u8>) {
    let mut client = TcpStream::connect(client_addr).await.expect("connect");
    let (res, _) = client.write_all(request).await;
    res.expect("send the request");
    let run = next_tunnel(node).await.run_id;
    tunnel_response_start(node, &run, b"text/event-stream").await;
    tunnel_body(node, &run, 2, FIRST_EVENT).await;
    let mut seen = Vec::new();
    read_until(
        &mut client,
        &mut seen,
        &FIRST_EVENT[..FIRST_EVENT.len() - 2],
    )
    .await;
    (client, run, seen)
}

/// Reads `stream` until it ends: `Ok` on a clean end of stream, else the
/// error's kind, with the bytes read before it.
pub async fn read_to_end(stream: &mut TcpStream) -> (Result<(), std::io::ErrorKind>, usize) {
    let mut read = 0usize;
    loop {
        let (res, buf) = stream.read(Vec::with_capacity(64 * 1024)).await;
        match res {
            Ok(0) => return (Ok(()), read),
            Ok(n) => read += n,
            Err(e) => return (Err(e.kind()), read),
        }
        drop(buf);
    }
}
