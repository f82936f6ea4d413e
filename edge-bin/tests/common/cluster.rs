//! The process harness of the cluster tests: one `etcd`, two `edge-bin`s
//! sharing it (`edge-1` = A, `edge-2` = B, each with a peer listener), one
//! `bench mock-provider`, and `node-bin`s connected to either Edge; both
//! Edges have the same fleet and the same client keys. Plain HTTP/1.1 and
//! mTLS clients read whole responses; processes are killed by their pid
//! on drop.
//!
//! etcd is the shared test harness (`etcd.rs`: `/usr/bin/etcd` or
//! `PATH`). Build the binaries first: `cargo build -p edge-bin -p node-bin
//! -p bench --bins`.

// Each test binary uses a different subset of the harness.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use iop_engine::clock;
use serde_json::{json, Value};

#[path = "any_server_cert.rs"]
mod any_server_cert;
#[path = "etcd.rs"]
pub mod etcd;
use any_server_cert::AnyServerCert;
use etcd::EtcdCluster;

pub const TRUST_DOMAIN: &str = "iop.local";
pub const CLIENT_KEY: &str = "sk-cluster-test-key";
/// The operator's key (sees the cluster in `/status`; no limits).
pub const OPS_KEY: &str = "sk-cluster-test-ops";
/// Far above anything below takes on a loaded machine.
pub const GENEROUS: Duration = Duration::from_secs(90);

/// A binary built next to this test's `edge-bin`.
pub fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_edge-bin")).with_file_name(name);
    assert!(
        path.exists(),
        "{} is missing: cargo build -p edge-bin -p node-bin -p bench --bins",
        path.display()
    );
    path
}

/// A scratch directory, removed on drop.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(label: &str) -> Self {
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

    pub fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process, killed (by its pid) on drop.
pub struct Running(Child);

impl Running {
    /// Sends `signal` to the process (by its pid).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("pid"));
        nix::sys::signal::kill(pid, signal).expect("signal the process");
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `command` with stderr to `log` and waits for its `IOP_READY`
/// line; returns the process and that line.
pub fn start_ready(mut command: Command, log: &str) -> (Running, String) {
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
pub fn ready_field(line: &str, key: &str) -> String {
    line.split(' ')
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .to_string()
}

/// A whole HTTP/1.1 response read to EOF.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Response {
    pub fn parse(raw: &[u8]) -> Self {
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

    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.head, self.text()))
    }
}

pub fn dechunk(mut rest: &[u8]) -> Vec<u8> {
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

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
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
pub fn request(
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

pub const AUTH: (&str, &str) = ("authorization", "Bearer sk-cluster-test-key");
pub const OPS: (&str, &str) = ("authorization", "Bearer sk-cluster-test-ops");

pub fn chat_body(model: &str, stream: bool) -> String {
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
pub fn peer_client(dir: &Scratch, identity: Option<&str>) -> Arc<rustls::ClientConfig> {
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
pub fn peer_request(
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

/// What a [`Cluster`] runs.
pub struct Setup<'a> {
    /// Names the scratch directory and the cluster.
    pub label: &'a str,
    /// The `mock-provider`'s arguments beside its port.
    pub mock_args: &'a [&'a str],
    /// The `[[nodes]]` and `[[models]]` of both Edges, given the mock's
    /// address.
    pub fleet: fn(SocketAddr) -> String,
    /// Each node with the Edge it connects to (`edge-1` = A or `edge-2` = B).
    pub nodes: &'a [(&'a str, &'a str)],
    /// Limit lines of the `team` client key (`AUTH`), or nothing.
    pub team_limits: &'a str,
}

/// One Edge of the cluster.
pub struct EdgeProc {
    pub name: &'static str,
    pub client: SocketAddr,
    pub peer: SocketAddr,
    pub proc: Option<Running>,
}

/// etcd, Edges A (`edge-1`) and B (`edge-2`), the mock, and the nodes.
pub struct Cluster {
    pub dir: Scratch,
    pub a: EdgeProc,
    pub b: EdgeProc,
    pub mock: SocketAddr,
    _procs: Vec<Running>,
    /// Dropped last (fields drop in order): the Edges go before etcd.
    _etcd: EtcdCluster,
}

impl Cluster {
    /// Starts everything as `setup` says; returns once both Edges see
    /// each node owned by the Edge it connects to.
    pub fn start(setup: Setup<'_>) -> Self {
        let Setup {
            label,
            mock_args,
            fleet,
            nodes,
            team_limits,
        } = setup;
        let dir = Scratch::new(label);
        let certs = Command::new(bin("edge-bin"))
            .args(["certs", "--out", &dir.path("")])
            .args(["--trust-domain", TRUST_DOMAIN])
            .args(["--edge-name", "edge-1", "--edge-name", "edge-2"])
            .args(nodes.iter().flat_map(|(node, _)| ["--node", node]))
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
                 {team_limits}\n\
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
        for &(node, edge_name) in nodes {
            let edge_addr = if edge_name == "edge-1" {
                &a_nodes
            } else {
                &b_nodes
            };
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
        let mut owned: Vec<(&str, &str)> = nodes.to_vec();
        owned.sort();
        let owned: Vec<Value> = owned
            .into_iter()
            .map(|(node, edge)| json!({"node_id": node, "edge": edge}))
            .collect();
        let owned = Value::from(owned);
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

    /// `edge`'s configuration file.
    pub fn config_path(&self, edge: &EdgeProc) -> String {
        self.dir.path(&format!("{}.toml", edge.name))
    }

    /// Rewrites `edge`'s configuration file with `change` and sends it
    /// SIGHUP.
    pub fn edit_and_reload(&self, edge: &EdgeProc, change: impl FnOnce(String) -> String) {
        let path = self.config_path(edge);
        let text = std::fs::read_to_string(&path).expect("edge.toml");
        let changed = change(text.clone());
        assert_ne!(changed, text, "the edit changed nothing");
        std::fs::write(&path, changed).expect("edge.toml");
        edge.proc
            .as_ref()
            .expect("running")
            .signal(nix::sys::signal::Signal::SIGHUP);
    }

    /// Kills Edge B (SIGKILL) and starts it again with its configuration
    /// file as it is now; returns once it holds its lease again. Its nodes
    /// (if any) do not find it again: its listeners have new ports.
    pub fn restart_b(&mut self) {
        drop(self.b.proc.take());
        let mut command = Command::new(bin("edge-bin"));
        command
            .args(["--config", &self.config_path(&self.b)])
            .env("RUST_LOG", "info");
        let (proc, line) = start_ready(command, &self.dir.path("edge-2.log"));
        self.b.client = ready_field(&line, "client").parse().expect("client");
        self.b.peer = ready_field(&line, "peer").parse().expect("peer");
        self.b.proc = Some(proc);
        let started = clock::now();
        while self.status(&self.b)["cluster"]["up"] != json!(true) {
            assert!(
                started.elapsed() < GENEROUS,
                "edge-2 did not take its lease"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn status(&self, edge: &EdgeProc) -> Value {
        let response = request(edge.client, "GET", "/status", &[OPS], "").expect("status");
        assert_eq!(response.status, 200, "{}", response.text());
        response.json()
    }

    /// `in_flight` of `node`'s provider as `edge` sees it.
    pub fn in_flight(&self, edge: &EdgeProc, node: &str) -> u64 {
        let status = self.status(edge);
        status["providers"]
            .as_array()
            .expect("providers")
            .iter()
            .find(|p| p["node_id"] == node)
            .unwrap_or_else(|| panic!("no {node} in {status}"))["in_flight"]
            .as_u64()
            .expect("in_flight")
    }

    pub fn chat(&self, edge: &EdgeProc, model: &str, stream: bool) -> Response {
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
    pub fn metric(&self, edge: &EdgeProc, sample: &str) -> u64 {
        let text = request(edge.client, "GET", "/metrics", &[OPS], "")
            .expect("metrics")
            .text();
        text.lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
            .map_or(0, |v| v.parse().expect("a number"))
    }

    pub fn mock_stats(&self) -> Value {
        request(self.mock, "GET", "/admin/stats", &[], "")
            .expect("mock stats")
            .json()
    }

    pub fn log(&self, edge: &EdgeProc) -> String {
        std::fs::read_to_string(self.dir.path(&format!("{}.log", edge.name))).expect("edge log")
    }

    /// The first line of `edge`'s log that `wanted` picks, waiting for the
    /// access log's writer to write it.
    pub fn log_line(&self, edge: &EdgeProc, wanted: impl Fn(&str) -> bool) -> String {
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
    pub fn with_nodes(self, nodes: String) -> (Self, String) {
        (self, nodes)
    }
}

/// `body` with what differs between two answers of the mock to the same
/// request masked: its completion id `chatcmpl-mock-<seq>` (it numbers
/// its completions) and the send time it stamps on each object
/// (`"iop_mock_sent_ns":<digits>`). Every other byte is kept.
pub fn masked(body: &[u8]) -> Vec<u8> {
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
