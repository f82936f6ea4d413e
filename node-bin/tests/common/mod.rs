//! The harness shared by node-bin's integration tests: the in-process
//! `bench` mock provider, the building blocks of the `NodeConfigPayload`
//! the scripted Edge hands out, and the scripted Edge itself — the far end
//! of a real Node session (`node_bin::session::run`) over a loopback TCP
//! frame connection, which completes registration and readiness and then
//! sends and receives frames.
//!
//! Waits are bounded by [`SAFETY`] only as a safety net against hangs; no
//! assertion depends on how fast anything runs. Not every test file uses
//! every item.
#![allow(dead_code)]

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SocketShutdown};
use iop_engine::http::Url;
use iop_wire::lease::{self, RecipientKey};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::Splitable;
use monoio::net::{TcpListener, TcpStream};
use node_bin::calls::workers::{self, WorkerStats};
use node_bin::credentials::NodeCredentials;
use node_bin::session::{self, NodeCore, SessionEnd};
use x25519_dalek::StaticSecret;

/// The bound on every wait (a net against hangs, never a timed assertion).
pub const SAFETY: Duration = Duration::from_secs(20);
/// The one model the mock serves and every adapter targets.
pub const TARGET: &str = "mock-model";
/// The node id the Node session registers with.
pub const NODE_ID: &str = "node-a";

/// `body` as a frame.
pub fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// The mock provider, in process, with its handler shared with the test.
pub struct Mock {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its handler, for in-process counters ([`Mock::counters`]).
    pub provider: Rc<RefCell<bench::mock::MockProvider>>,
}

impl Mock {
    /// Serves `provider` on a fresh loopback port.
    pub fn start(provider: bench::mock::MockProvider) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind mock");
        let addr = listener.local_addr().expect("mock addr");
        let provider = Rc::new(RefCell::new(provider));
        let shared = provider.clone();
        monoio::spawn(async move {
            let never = bench::mock::serve_shared(listener, shared).await;
            match never {}
        });
        Self { addr, provider }
    }

    /// Serves [`Mock::handler_with_faults`].
    pub fn with_faults(tokens: u32, inter_token_ms: u64, faults: bench::mock::MockFaults) -> Self {
        Self::start(Self::handler_with_faults(tokens, inter_token_ms, faults))
    }

    /// The mock's config: `tokens` tokens `inter_token_ms` apart, serving
    /// [`TARGET`].
    pub fn config(tokens: u32, inter_token_ms: u64) -> bench::mock::MockConfig {
        bench::mock::MockConfig {
            ttft_ms: 0,
            inter_token_ms,
            tokens,
            models: vec![TARGET.to_string()],
        }
    }

    /// A fault-free handler for [`Mock::config`].
    pub fn handler(tokens: u32, inter_token_ms: u64) -> bench::mock::MockProvider {
        bench::mock::MockProvider::new(Self::config(tokens, inter_token_ms))
    }

    /// A handler for [`Mock::config`] with `faults` injected.
    pub fn handler_with_faults(
        tokens: u32,
        inter_token_ms: u64,
        faults: bench::mock::MockFaults,
    ) -> bench::mock::MockProvider {
        bench::mock::MockProvider::with_faults(Self::config(tokens, inter_token_ms), faults)
    }

    /// The mock's base URL.
    pub fn url(&self) -> Url {
        Url::parse(&format!("http://{}", self.addr)).expect("mock url")
    }

    /// The mock's base URL as a config string.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The mock's origin, as a lease binds it.
    pub fn origin(&self) -> String {
        self.url().origin()
    }

    /// The handler's counters, read in process (no connection).
    pub fn counters(&self) -> bench::mock::MockStats {
        self.provider.borrow().stats()
    }

    /// The counters from `GET /admin/stats` — over a connection of its own,
    /// which the counters include.
    pub async fn admin_stats(&self) -> serde_json::Value {
        let (status, body) =
            node_bin::adapters::probe::get((&self.url()).into(), "/admin/stats", SAFETY)
                .await
                .expect("mock admin GET");
        assert_eq!(status, 200);
        serde_json::from_slice(&body).expect("mock JSON")
    }

    /// Polls [`Mock::admin_stats`] until `done` holds (bounded).
    pub async fn wait_stats(&self, what: &str, done: impl Fn(&serde_json::Value) -> bool) {
        for _ in 0..400 {
            if done(&self.admin_stats().await) {
                return;
            }
            monoio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!(
            "mock never reached: {what}; last {:?}",
            self.admin_stats().await
        );
    }

    /// Sets the mock's health state (`POST /admin/health`).
    pub async fn set_health(&self, state: &str) {
        let tcp = TcpStream::connect(self.addr).await.expect("connect mock");
        let mut client = iop_engine::http::ClientConn::new(tcp, Default::default())
            .with_host(self.addr.to_string());
        client
            .send_request(
                "POST",
                "/admin/health",
                [("content-type", "application/json")],
                Bytes::from(format!(r#"{{"state":"{state}"}}"#)),
            )
            .await
            .expect("send");
        let head = client.read_response_head().await.expect("head");
        assert_eq!(head.status, 200);
        client.read_body_to_end(1 << 16).await.expect("body");
    }
}

/// The Node runtime config of the tests: short close grace and probe
/// timeout.
pub fn runtime() -> pb::NodeRuntimeConfig {
    pb::NodeRuntimeConfig {
        close_grace_ms: 300,
        probe_timeout_ms: 300,
        ..Default::default()
    }
}

/// Revision 1 of a config with [`runtime`] and `adapters`.
pub fn node_config(
    adapters: Vec<pb::AdapterConfig>,
    credential_leases_required: bool,
) -> pb::NodeConfigPayload {
    pb::NodeConfigPayload {
        runtime: Some(runtime()),
        adapters,
        revision: 1,
        credential_leases_required,
        revoked_credentials: Vec::new(),
    }
}

/// An OpenAI profile `openai` on the mock (models and chat completions
/// paths set; no health path, no auth header).
pub fn openai_profile(mock: &Mock) -> pb::ProtocolProfile {
    pb::ProtocolProfile {
        name: "openai".into(),
        base_url: mock.base_url(),
        models_path: "/v1/models".into(),
        chat_completions_path: "/v1/chat/completions".into(),
        ..Default::default()
    }
}

/// An OpenAI-compatible adapter `name` targeting [`TARGET`].
pub fn openai_adapter(
    name: &str,
    capacity: u32,
    profile: pb::ProtocolProfile,
) -> pb::AdapterConfig {
    pb::AdapterConfig {
        tls: None,
        name: name.into(),
        capacity,
        targets: vec![TARGET.into()],
        kind: Some(pb::adapter_config::Kind::OpenaiCompat(
            pb::OpenAiCompatAdapterConfig {
                protocol_profile: Some(profile),
            },
        )),
    }
}

/// An Ollama adapter `name` on the mock.
pub fn ollama_adapter(
    name: &str,
    capacity: u32,
    targets: Vec<String>,
    mock: &Mock,
) -> pb::AdapterConfig {
    pb::AdapterConfig {
        tls: None,
        name: name.into(),
        capacity,
        targets,
        kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
            base_url: mock.base_url(),
        })),
    }
}

/// A non-streaming chat completion tunnel to adapter `mock` carrying
/// `body` (JSON).
pub fn chat_tunnel(run_id: &str, body: String) -> pb::ProviderTunnelRequest {
    pb::ProviderTunnelRequest {
        run_id: run_id.into(),
        adapter: "mock".into(),
        target: TARGET.into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: vec![pb::Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"application/json"),
        }],
        body: Bytes::from(body),
        operation: "chat_completions".into(),
        ..Default::default()
    }
}

/// The Node's recipient key from `seed`.
pub fn recipient(seed: [u8; 32]) -> RecipientKey {
    RecipientKey::from_secret(StaticSecret::from(seed))
}

/// The path [`chat_tunnel`] resolves to with [`openai_profile`].
pub const CHAT_PATH: &str = "/v1/chat/completions";

/// The binding of a lease for `tunnel` — a [`chat_tunnel`] for [`TARGET`]
/// on adapter `mock` of [`NODE_ID`] — sealed to `recipient_id`, sending the
/// secret to `origin` (the mock's [`Mock::origin`]) over plain HTTP (set
/// `provider_trust` for an `https://` origin).
pub fn lease_binding(
    recipient_id: &str,
    origin: &str,
    tunnel: &pb::ProviderTunnelRequest,
) -> pb::CredentialLeaseBinding {
    let digest = lease::request_digest(&lease::BoundRequest {
        method: "POST",
        path: CHAT_PATH,
        headers: &tunnel.headers,
        body: std::slice::from_ref(&tunnel.body),
    });
    pb::CredentialLeaseBinding {
        principal: "team-a".into(),
        slot: "mock-key".into(),
        route: "iop-test-model".into(),
        profile: "openai".into(),
        upstream_target: lease::upstream_target("mock", TARGET),
        selected_node: NODE_ID.into(),
        recipient: recipient_id.into(),
        credential_revision: 1,
        route_revision: 1,
        projection_generation: 1,
        upstream_origin: origin.into(),
        run_id: tunnel.run_id.clone(),
        request_digest: Bytes::copy_from_slice(&digest),
        provider_trust: Bytes::copy_from_slice(&lease::provider_trust_digest(
            &lease::ProviderTrust::PlainHttp,
        )),
    }
}

/// Puts a fresh lease `lease_id` for `secret` into `tunnel` with its
/// binding ([`lease_binding`]): sent as `Authorization: Bearer {secret}` to
/// `origin`, valid for 30 s, sealed to the recipient key of
/// `recipient_seed` and signed by `issuer`.
pub fn attach_lease(
    tunnel: &mut pb::ProviderTunnelRequest,
    origin: &str,
    lease_id: &str,
    secret: &str,
    recipient_seed: [u8; 32],
    issuer: &ed25519_dalek::SigningKey,
) {
    let to = recipient(recipient_seed);
    let binding = lease_binding(to.key_id(), origin, tunnel);
    let not_before = iop_engine::clock::unix_ms();
    let sealed = lease::issue(
        &lease::IssueParams {
            lease_id,
            sequence: next_sequence(),
            binding: &binding,
            secret: secret.as_bytes(),
            header_name: "Authorization",
            header_format: "Bearer {secret}",
            not_before_unix_ms: not_before,
            expires_at_unix_ms: not_before + 30_000,
        },
        issuer,
        &to.public_key(),
        lease::LeaseEntropy::from_seed([5; 32]),
    )
    .expect("issue");
    tunnel.credential_lease = Some(sealed);
    tunnel.credential_binding = Some(binding);
}

/// Splits an SSE body into its `data:` payloads: JSON events without the
/// mock's volatile fields (`id`, `created`, `iop_mock_sent_ns`), and
/// `[DONE]` as a string. Every event must be exactly `data: <payload>\n\n`.
pub fn normalized_events(body: &[u8]) -> Vec<serde_json::Value> {
    let text = std::str::from_utf8(body).expect("SSE body is UTF-8");
    let trimmed = text
        .strip_suffix("\n\n")
        .unwrap_or_else(|| panic!("SSE body ends with a blank line"));
    trimmed
        .split("\n\n")
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("SSE event {event:?}"));
            if data == "[DONE]" {
                return serde_json::Value::String(data.to_string());
            }
            let mut json: serde_json::Value = serde_json::from_str(data).expect("SSE event JSON");
            let object = json.as_object_mut().expect("SSE event is an object");
            for volatile in ["id", "created", "iop_mock_sent_ns"] {
                object.remove(volatile);
            }
            json
        })
        .collect()
}

/// A fresh lease sequence number: increasing within the test process, as
/// the Edge numbers the leases of one node.
pub fn next_sequence() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Whether `kind` ends a tunnel.
/// Whether a tunnel frame of `kind` ends its tunnel.
pub fn is_tunnel_terminal(kind: pb::TunnelFrameKind) -> bool {
    matches!(kind, pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error)
}

/// The Edge side of one Node session.
pub struct Edge {
    /// The Edge's end of the frame connection.
    pub conn: ConnHandle,
    /// Events of that connection.
    pub events: ConnEvents,
    /// The Node's per-core state (the provider pool lives there).
    pub core: Rc<NodeCore>,
    /// The Node session task.
    pub node: monoio::task::JoinHandle<SessionEnd>,
}

impl Edge {
    /// Starts an unmanaged Node session against a scripted Edge and
    /// completes registration (handing out `config`) and readiness.
    pub async fn start(config: pb::NodeConfigPayload) -> Self {
        Self::start_with_credentials(config, None).await
    }

    /// [`Edge::start`] for a Node with `credentials` (its credential plane).
    pub async fn start_with_credentials(
        config: pb::NodeConfigPayload,
        credentials: Option<NodeCredentials>,
    ) -> Self {
        Self::start_on(NodeCore::start_with_credentials(credentials), config).await
    }

    /// [`Edge::start`] for a Node session on `core` (e.g. a control shard
    /// with provider worker cores).
    pub async fn start_on(core: Rc<NodeCore>, config: pb::NodeConfigPayload) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind edge");
        let addr = listener.local_addr().expect("edge addr");
        let node_core = core.clone();
        let node = monoio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.expect("node dials");
            let shutdown = SocketShutdown::for_socket(&tcp);
            let (r, w) = tcp.into_split();
            let (conn, events) = spawn_conn(r, w, shutdown, ConnConfig::default());
            session::run(NODE_ID, &node_core, conn, events).await
        });
        let (tcp, _) = listener.accept().await.expect("edge accepts");
        let shutdown = SocketShutdown::for_socket(&tcp);
        let (r, w) = tcp.into_split();
        let (conn, events) = spawn_conn(r, w, shutdown, ConnConfig::default());
        let mut edge = Self {
            conn,
            events,
            core,
            node,
        };
        match edge.recv().await.body {
            Some(Body::RegisterRequest(r)) => assert_eq!(r.node_id, NODE_ID),
            other => panic!("expected RegisterRequest, got {other:?}"),
        }
        edge.send(Body::RegisterResponse(Box::new(pb::RegisterResponse {
            accepted: true,
            reason: String::new(),
            config: Some(config),
            accepts_node_draining: true,
        })));
        match edge.recv().await.body {
            Some(Body::NodeReadyRequest(_)) => {}
            other => panic!("expected NodeReadyRequest, got {other:?}"),
        }
        edge.send(Body::NodeReadyResponse(pb::NodeReadyResponse {
            ready: true,
            reason: String::new(),
        }));
        edge
    }

    /// Sends a config refresh and returns the Node's answer (K3).
    pub async fn refresh(
        &mut self,
        id: &str,
        config: pb::NodeConfigPayload,
    ) -> pb::NodeConfigRefreshResponse {
        self.send(Body::NodeConfigRefreshRequest(Box::new(
            pb::NodeConfigRefreshRequest {
                refresh_id: id.into(),
                config: Some(config),
            },
        )));
        match self.recv().await.body {
            Some(Body::NodeConfigRefreshResponse(r)) => r,
            other => panic!("expected a refresh response, got {other:?}"),
        }
    }

    /// Sends `body` on the control lane.
    pub fn send(&self, body: Body) {
        self.conn.send_control(frame(body)).expect("edge send");
    }

    /// The next frame from the Node (bounded by [`SAFETY`]).
    pub async fn recv(&mut self) -> pb::Frame {
        monoio::select! {
            ev = self.events.recv() => match ev {
                Some(ConnEvent::Frame(f)) => f,
                other => panic!("edge connection ended: {other:?}"),
            },
            _ = monoio::time::sleep(SAFETY) => panic!("no frame from the node within {SAFETY:?}"),
        }
    }

    /// The next frame, which must be a tunnel frame.
    pub async fn recv_tunnel(&mut self) -> pb::ProviderTunnelFrame {
        match self.recv().await.body {
            Some(Body::ProviderTunnelFrame(f)) => *f,
            other => panic!("expected a tunnel frame, got {other:?}"),
        }
    }

    /// Frames of `run_id` up to and including its terminal.
    pub async fn tunnel_frames(&mut self, run_id: &str) -> Vec<pb::ProviderTunnelFrame> {
        let mut out = Vec::new();
        loop {
            let f = self.recv_tunnel().await;
            assert_eq!(f.run_id, run_id, "only one tunnel is open");
            let terminal = is_tunnel_terminal(f.kind());
            out.push(f);
            if terminal {
                return out;
            }
        }
    }

    /// Sends `req` and returns its frames up to and including the terminal.
    pub async fn tunnel(&mut self, req: pb::ProviderTunnelRequest) -> Vec<pb::ProviderTunnelFrame> {
        let run_id = req.run_id.clone();
        self.send(Body::ProviderTunnelRequest(Box::new(req)));
        self.tunnel_frames(&run_id).await
    }

    /// The next frame, which must be a run event.
    pub async fn recv_event(&mut self) -> pb::RunEvent {
        match self.recv().await.body {
            Some(Body::RunEvent(e)) => *e,
            other => panic!("expected a run event, got {other:?}"),
        }
    }

    /// Events of `run_id` up to and including its terminal.
    pub async fn run_events(&mut self, run_id: &str) -> Vec<pb::RunEvent> {
        let mut out = Vec::new();
        loop {
            let e = self.recv_event().await;
            assert_eq!(e.run_id, run_id, "only one run is open");
            let terminal = matches!(
                e.r#type(),
                pb::RunEventType::Complete | pb::RunEventType::Error | pb::RunEventType::Cancelled
            );
            out.push(e);
            if terminal {
                return out;
            }
        }
    }

    /// Sends a run and returns its events up to and including the terminal.
    pub async fn run(&mut self, req: pb::RunRequest) -> Vec<pb::RunEvent> {
        let run_id = req.run_id.clone();
        self.send(Body::RunRequest(Box::new(req)));
        self.run_events(&run_id).await
    }
}

// ---------------------------------------------------------------------------
// Multi-core nodes
// ---------------------------------------------------------------------------

/// Polls `done` until it holds (bounded by [`SAFETY`]).
pub async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..(SAFETY.as_millis() / 5) {
        if done() {
            return;
        }
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never reached: {what}");
}

/// A control shard (on this thread) with one provider worker core on a
/// thread of its own.
pub fn control_with_one_worker() -> Rc<NodeCore> {
    control_with_one_worker_and(None)
}

/// [`control_with_one_worker`] with `credentials` (its credential plane).
pub fn control_with_one_worker_and(credentials: Option<NodeCredentials>) -> Rc<NodeCore> {
    let (workers, inboxes) = workers::channels(1);
    for inbox in inboxes {
        workers::spawn_thread(inbox, None).expect("worker thread");
    }
    NodeCore::start_with_workers(credentials, Some(workers))
}

/// A multi-core Node's view for the tests: its worker and its gates.
impl Edge {
    pub fn worker(&self) -> WorkerStats {
        let workers = self.core.calls.workers().expect("a multi-core node");
        workers.stats().remove(0)
    }

    /// Waits until every run and tunnel is released (the provider call
    /// returned on the worker, W10).
    pub async fn all_released(&self) {
        let core = self.core.clone();
        eventually("every run released", move || core.active_runs() == 0).await;
    }

    pub async fn adapter_in_flight(&mut self, adapter: &str) -> u32 {
        self.send(Body::NodeCommandRequest(pb::NodeCommandRequest {
            command_id: "in-flight".into(),
            r#type: pb::CommandType::ProviderStatus as i32,
            adapter: adapter.into(),
            path: String::new(),
        }));
        match self.recv().await.body {
            Some(Body::NodeCommandResponse(r)) => r.providers[0].in_flight,
            other => panic!("expected a command response, got {other:?}"),
        }
    }
}
