//! In-process integration of the provider connection pool
//! (`node_bin::provider_pool`): a real Node session over a loopback frame
//! connection to a scripted Edge, against the `bench` mock provider over
//! real sockets. The mock's handler is shared with the test, so its
//! connection counters are read without opening a connection of our own.
//!
//! Proves that sequential tunnels and normalized runs reuse one provider
//! connection, that a cancelled or stalled call's connection is never
//! reused (U6, W4, W10), and that a connection the provider closed while it
//! was idle is retried once, transparently, on a fresh one — with the
//! lease's header and without opening the lease again (C2, C5).
//!
//! Waits are bounded by [`SAFETY`] only as a safety net against hangs; no
//! assertion depends on how fast anything runs.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SocketShutdown};
use iop_engine::http::Url;
use iop_wire::lease::{self, IssueParams, LeaseEntropy, RecipientKey};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::Splitable;
use monoio::net::{TcpListener, TcpStream};
use node_bin::credentials::NodeCredentials;
use node_bin::provider_pool::PoolStats;
use node_bin::session::{self, NodeCore};
use x25519_dalek::StaticSecret;

const SAFETY: Duration = Duration::from_secs(20);
const TARGET: &str = "mock-model";
const SECRET: &str = "sk-iop-pool-test-77a0";
const RECIPIENT_SEED: [u8; 32] = [21; 32];
const ISSUER_SEED: [u8; 32] = [22; 32];

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

/// The mock provider, in process, with its handler shared with the test.
struct Mock {
    addr: SocketAddr,
    provider: Rc<RefCell<bench::mock::MockProvider>>,
}

impl Mock {
    fn start(provider: bench::mock::MockProvider) -> Self {
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

    fn handler(tokens: u32, inter_token_ms: u64) -> bench::mock::MockProvider {
        bench::mock::MockProvider::new(bench::mock::MockConfig {
            ttft_ms: 0,
            inter_token_ms,
            tokens,
            models: vec![TARGET.to_string()],
        })
    }

    fn url(&self) -> Url {
        Url::parse(&format!("http://{}", self.addr)).expect("mock url")
    }

    fn stats(&self) -> bench::mock::MockStats {
        self.provider.borrow().stats()
    }
}

/// Polls `done` until it holds (bounded by [`SAFETY`]).
async fn eventually(what: &str, done: impl Fn() -> bool) {
    for _ in 0..(SAFETY.as_millis() / 5) {
        if done() {
            return;
        }
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never reached: {what}");
}

/// One OpenAI-compatible adapter `mock` and one Ollama adapter `ol`, both
/// on the mock.
fn payload(mock: &Mock, auth_header: bool, leases_required: bool) -> pb::NodeConfigPayload {
    let (auth_header_name, auth_header_format) = if auth_header {
        ("Authorization".to_string(), "Bearer {secret}".to_string())
    } else {
        (String::new(), String::new())
    };
    pb::NodeConfigPayload {
        runtime: Some(pb::NodeRuntimeConfig {
            close_grace_ms: 300,
            probe_timeout_ms: 300,
            ..Default::default()
        }),
        adapters: vec![
            pb::AdapterConfig {
                name: "mock".into(),
                capacity: 4,
                targets: vec![TARGET.into()],
                kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                    pb::OpenAiCompatAdapterConfig {
                        protocol_profile: Some(pb::ProtocolProfile {
                            name: "openai".into(),
                            base_url: format!("http://{}", mock.addr),
                            models_path: "/v1/models".into(),
                            chat_completions_path: "/v1/chat/completions".into(),
                            health_path: "/v1/models".into(),
                            auth_header_name,
                            auth_header_format,
                            ..Default::default()
                        }),
                    },
                )),
            },
            pb::AdapterConfig {
                name: "ol".into(),
                capacity: 4,
                targets: vec![TARGET.into()],
                kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                    base_url: format!("http://{}", mock.addr),
                })),
            },
        ],
        revision: 1,
        credential_leases_required: leases_required,
    }
}

/// The Edge side of one Node session; `core` is the Node's per-core state
/// (the pool lives there).
struct Edge {
    conn: ConnHandle,
    events: ConnEvents,
    core: Rc<NodeCore>,
}

impl Edge {
    async fn start(config: pb::NodeConfigPayload, credentials: Option<NodeCredentials>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind edge");
        let addr = listener.local_addr().expect("edge addr");
        let core = NodeCore::start_with_credentials(credentials);
        let node_core = core.clone();
        monoio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.expect("node dials");
            let shutdown = SocketShutdown::for_socket(&tcp);
            let (r, w) = tcp.into_split();
            let (conn, events) = spawn_conn(r, w, shutdown, ConnConfig::default());
            session::run("node-a", &node_core, conn, events).await
        });
        let (tcp, _) = listener.accept().await.expect("edge accepts");
        let shutdown = SocketShutdown::for_socket(&tcp);
        let (r, w) = tcp.into_split();
        let (conn, events) = spawn_conn(r, w, shutdown, ConnConfig::default());
        let mut edge = Self { conn, events, core };
        assert!(matches!(
            edge.recv().await.body,
            Some(Body::RegisterRequest(_))
        ));
        edge.send(Body::RegisterResponse(pb::RegisterResponse {
            accepted: true,
            reason: String::new(),
            config: Some(config),
        }));
        assert!(matches!(
            edge.recv().await.body,
            Some(Body::NodeReadyRequest(_))
        ));
        edge.send(Body::NodeReadyResponse(pb::NodeReadyResponse {
            ready: true,
            reason: String::new(),
        }));
        edge
    }

    fn pool_stats(&self) -> PoolStats {
        self.core.pool.stats()
    }

    fn send(&self, body: Body) {
        self.conn.send_control(frame(body)).expect("edge send");
    }

    async fn recv(&mut self) -> pb::Frame {
        monoio::select! {
            ev = self.events.recv() => match ev {
                Some(ConnEvent::Frame(f)) => f,
                other => panic!("edge connection ended: {other:?}"),
            },
            _ = monoio::time::sleep(SAFETY) => panic!("no frame from the node within {SAFETY:?}"),
        }
    }

    async fn recv_tunnel(&mut self) -> pb::ProviderTunnelFrame {
        match self.recv().await.body {
            Some(Body::ProviderTunnelFrame(f)) => f,
            other => panic!("expected a tunnel frame, got {other:?}"),
        }
    }

    /// Frames of `run_id` up to and including its terminal.
    async fn tunnel_frames(&mut self, run_id: &str) -> Vec<pb::ProviderTunnelFrame> {
        let mut out = Vec::new();
        loop {
            let f = self.recv_tunnel().await;
            assert_eq!(f.run_id, run_id, "only one tunnel is open");
            let terminal = matches!(
                f.kind(),
                pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error
            );
            out.push(f);
            if terminal {
                return out;
            }
        }
    }

    /// Sends `req` and returns its frames up to and including the terminal.
    async fn tunnel(&mut self, req: pb::ProviderTunnelRequest) -> Vec<pb::ProviderTunnelFrame> {
        let run_id = req.run_id.clone();
        self.send(Body::ProviderTunnelRequest(req));
        self.tunnel_frames(&run_id).await
    }

    /// Sends a run and returns its events up to and including the terminal.
    async fn run(&mut self, req: pb::RunRequest) -> Vec<pb::RunEvent> {
        let run_id = req.run_id.clone();
        self.send(Body::RunRequest(req));
        let mut out = Vec::new();
        loop {
            let e = match self.recv().await.body {
                Some(Body::RunEvent(e)) => e,
                other => panic!("expected a run event, got {other:?}"),
            };
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
}

/// A streamed chat completion tunnel, capped at `max_tokens` when given.
fn tunnel(run_id: &str, max_tokens: Option<u32>, stall_ms: i64) -> pb::ProviderTunnelRequest {
    let cap = max_tokens.map_or(String::new(), |n| format!(r#","max_tokens":{n}"#));
    let body = format!(
        r#"{{"model":"{TARGET}","stream":true{cap},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
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
        stream: true,
        response_stall_timeout_ms: stall_ms,
        operation: "chat_completions".into(),
        ..Default::default()
    }
}

fn kinds(frames: &[pb::ProviderTunnelFrame]) -> Vec<pb::TunnelFrameKind> {
    frames.iter().map(|f| f.kind()).collect()
}

fn body_text(frames: &[pb::ProviderTunnelFrame]) -> String {
    let body: Vec<u8> = frames
        .iter()
        .filter(|f| f.kind() == pb::TunnelFrameKind::Body)
        .flat_map(|f| f.body.to_vec())
        .collect();
    String::from_utf8(body).expect("utf-8 SSE")
}

/// Asserts a complete 200 stream of `tokens` tokens, ordered, ending in END.
fn assert_streamed(frames: &[pb::ProviderTunnelFrame], tokens: u32) {
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, (1..=frames.len() as u64).collect::<Vec<_>>());
    assert_eq!(frames[0].kind(), pb::TunnelFrameKind::ResponseStart);
    assert_eq!(frames[0].status, 200);
    assert_eq!(
        frames.last().map(|f| f.kind()),
        Some(pb::TunnelFrameKind::End)
    );
    let body = body_text(frames);
    let content: String = (0..tokens).map(|i| format!("tok{i} ")).collect();
    let streamed: String = body
        .split("\"content\":\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect();
    assert_eq!(streamed, content, "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
}

// Two sequential tunnels to one provider share one TCP connection: the
// second checks out the connection the first returned after its END.
#[monoio::test(timer_enabled = true)]
async fn sequential_tunnels_reuse_one_provider_connection() {
    let mock = Mock::start(Mock::handler(3, 0));
    let mut edge = Edge::start(payload(&mock, false, false), None).await;
    assert_streamed(&edge.tunnel(tunnel("seq-1", None, 0)).await, 3);
    assert_eq!(edge.core.pool.idle_connections(&mock.url()), 1);
    assert_streamed(&edge.tunnel(tunnel("seq-2", None, 0)).await, 3);
    let stats = mock.stats();
    assert_eq!(stats.connections_accepted, 1);
    assert_eq!(stats.chat_requests, 2);
    assert_eq!(
        edge.pool_stats(),
        PoolStats {
            hits: 1,
            misses: 1,
            stale_retries: 0,
            checkins: 2,
        }
    );
    assert_eq!(edge.core.pool.idle_connections(&mock.url()), 1);
}

// CONTRACT: U6, K1 — a cancelled tunnel's provider connection is closed,
// never returned to the pool: the next tunnel connects anew.
#[monoio::test(timer_enabled = true)]
async fn cancelled_tunnel_connection_is_not_reused() {
    // 40 tokens 25 ms apart: a full stream outlives the cancel by far; the
    // quick requests ask for one token.
    let mock = Mock::start(Mock::handler(40, 25));
    let mut edge = Edge::start(payload(&mock, false, false), None).await;
    assert_streamed(&edge.tunnel(tunnel("c-1", Some(1), 0)).await, 1);
    // The long one takes the pooled connection and is cancelled mid-stream.
    edge.send(Body::ProviderTunnelRequest(tunnel("c-2", None, 0)));
    let mut frames = Vec::new();
    loop {
        let f = edge.recv_tunnel().await;
        assert_eq!(f.run_id, "c-2");
        let is_body = f.kind() == pb::TunnelFrameKind::Body;
        frames.push(f);
        if is_body {
            break;
        }
    }
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "c-2".into(),
        reason: "client_disconnect".into(),
    }));
    frames.extend(edge.tunnel_frames("c-2").await);
    let last = frames.last().expect("terminal");
    assert_eq!(last.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(last.failure_code, "cancelled");
    // The provider saw its stream aborted: the socket was closed.
    eventually("the cancelled stream's connection closed", || {
        let s = mock.stats();
        s.streams_aborted == 1 && s.connections_open == 0
    })
    .await;
    assert_eq!(edge.core.pool.idle_connections(&mock.url()), 0);
    assert_streamed(&edge.tunnel(tunnel("c-3", Some(1), 0)).await, 1);
    let stats = mock.stats();
    assert_eq!(stats.connections_accepted, 2);
    assert_eq!(stats.chat_requests, 3);
    assert_eq!(
        edge.pool_stats(),
        PoolStats {
            hits: 1,
            misses: 2,
            stale_retries: 0,
            checkins: 2,
        }
    );
}

// CONTRACT: W4, W10 — a stalled tunnel's provider connection is closed
// with the aborted call, never reused; the stall's health probe opens its
// own connection and leaves the pool alone.
#[monoio::test(timer_enabled = true)]
async fn stalled_tunnel_connection_is_not_reused() {
    // Streams stall forever after two tokens; a two-token request ends
    // before the stall.
    let handler = bench::mock::MockProvider::with_faults(
        bench::mock::MockConfig {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens: 8,
            models: vec![TARGET.to_string()],
        },
        bench::mock::MockFaults {
            stall_after_tokens: Some(2),
            ..Default::default()
        },
    );
    let mock = Mock::start(handler);
    let mut edge = Edge::start(payload(&mock, false, false), None).await;
    assert_streamed(&edge.tunnel(tunnel("s-1", Some(2), 0)).await, 2);
    let frames = edge.tunnel(tunnel("s-2", None, 200)).await;
    let last = frames.last().expect("terminal");
    assert_eq!(last.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(last.failure_code, "response_stalled");
    eventually("the stalled stream's connection closed", || {
        mock.stats().active_streams == 0
    })
    .await;
    assert_eq!(edge.core.pool.idle_connections(&mock.url()), 0);
    assert_streamed(&edge.tunnel(tunnel("s-3", Some(2), 0)).await, 2);
    let stats = mock.stats();
    // s-1's (reused by s-2, then closed), the probe's, s-3's.
    assert_eq!(stats.connections_accepted, 3);
    assert_eq!(stats.chat_requests, 3);
    assert_eq!(
        edge.pool_stats(),
        PoolStats {
            hits: 1,
            misses: 2,
            stale_retries: 0,
            checkins: 2,
        }
    );
}

// A pooled connection the provider closed while it was idle fails before
// any response byte; the request goes once more on a fresh connection and
// the tunnel answers as if nothing happened.
#[monoio::test(timer_enabled = true)]
async fn stale_pooled_connection_is_retried_once_on_a_fresh_one() {
    let mock = Mock::start(Mock::handler(3, 0).with_close_after_requests(1));
    let mut edge = Edge::start(payload(&mock, false, false), None).await;
    assert_streamed(&edge.tunnel(tunnel("r-1", None, 0)).await, 3);
    // The reply looked keep-alive, so the connection went back to the pool;
    // then the provider closed it.
    assert_eq!(edge.core.pool.idle_connections(&mock.url()), 1);
    eventually("the provider closed the idle connection", || {
        mock.stats().connections_open == 0
    })
    .await;
    let frames = edge.tunnel(tunnel("r-2", None, 0)).await;
    assert_streamed(&frames, 3);
    assert_eq!(
        kinds(&frames[..1]),
        vec![pb::TunnelFrameKind::ResponseStart],
        "one response, no trace of the failed attempt"
    );
    let stats = mock.stats();
    assert_eq!(stats.connections_accepted, 2);
    assert_eq!(stats.chat_requests, 2);
    assert_eq!(
        edge.pool_stats(),
        PoolStats {
            hits: 1,
            misses: 1,
            stale_retries: 1,
            checkins: 2,
        }
    );
}

fn recipient(seed: [u8; 32]) -> RecipientKey {
    RecipientKey::from_secret(StaticSecret::from(seed))
}

fn issuer() -> SigningKey {
    SigningKey::from_bytes(&ISSUER_SEED)
}

/// A tunnel carrying a fresh lease `lease_id` for [`SECRET`].
fn leased(run_id: &str, lease_id: &str) -> pb::ProviderTunnelRequest {
    let to = recipient(RECIPIENT_SEED);
    let binding = pb::CredentialLeaseBinding {
        principal: "team-a".into(),
        slot: "mock-key".into(),
        route: "iop-test-model".into(),
        profile: "openai".into(),
        upstream_target: lease::upstream_target("mock", TARGET),
        selected_node: "node-a".into(),
        recipient: to.key_id().into(),
        credential_revision: 1,
        route_revision: 1,
        projection_generation: 1,
    };
    let not_before = iop_engine::clock::unix_ms();
    let lease = lease::issue(
        &IssueParams {
            lease_id,
            binding: &binding,
            secret: SECRET.as_bytes(),
            header_name: "Authorization",
            header_format: "Bearer {secret}",
            not_before_unix_ms: not_before,
            expires_at_unix_ms: not_before + 30_000,
        },
        &issuer(),
        &to.public_key(),
        LeaseEntropy::from_bytes([5; 32], [6; 12]),
    )
    .expect("issue");
    pb::ProviderTunnelRequest {
        credential_lease: Some(lease),
        credential_binding: Some(binding),
        ..tunnel(run_id, None, 0)
    }
}

// CONTRACT: C2, C5 — the stale retry carries the lease's header again (the
// mock answers 401 without it) from the value built for this call: the
// lease is opened once (a second open would be `lease_replayed`).
#[monoio::test(timer_enabled = true)]
async fn stale_retry_resends_the_credential_header_without_reopening_the_lease() {
    let handler = Mock::handler(3, 0)
        .with_required_api_key(bench::mock::auth::ApiKey::new(SECRET))
        .with_close_after_requests(1);
    let mock = Mock::start(handler);
    let credentials =
        NodeCredentials::new(recipient(RECIPIENT_SEED), issuer().verifying_key(), 5_000);
    let mut edge = Edge::start(payload(&mock, true, true), Some(credentials)).await;
    assert_streamed(&edge.tunnel(leased("l-1", "lease-l-1")).await, 3);
    eventually("the provider closed the idle connection", || {
        mock.stats().connections_open == 0
    })
    .await;
    let frames = edge.tunnel(leased("l-2", "lease-l-2")).await;
    assert_streamed(&frames, 3);
    assert!(frames
        .iter()
        .all(|f| !f.body.windows(SECRET.len()).any(|w| w == SECRET.as_bytes())));
    let stats = mock.stats();
    // Both answered 200 by the key-checking mock: the retry had the header.
    assert_eq!(stats.chat_requests, 2);
    assert_eq!(stats.connections_accepted, 2);
    assert_eq!(edge.pool_stats().stale_retries, 1);
    assert_eq!(edge.pool_stats().hits, 1);
}

fn run(run_id: &str, adapter: &str, input: pb::RunInput) -> pb::RunRequest {
    pb::RunRequest {
        run_id: run_id.into(),
        adapter: adapter.into(),
        target: TARGET.into(),
        input: Some(input),
        ..Default::default()
    }
}

fn say(text: &str) -> pb::RunInput {
    pb::RunInput {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: text.into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn delta_text(events: &[pb::RunEvent]) -> String {
    events.iter().map(|e| e.delta.as_str()).collect()
}

// Normalized runs return their connection once the run's content ended
// and the rest of the body was drained: sequential Ollama runs share one
// connection, and the E5 retry after a tool rejection reuses the rejected
// request's connection.
#[monoio::test(timer_enabled = true)]
async fn normalized_runs_reuse_the_provider_connection() {
    let modes = bench::mock::MockModes {
        reject_tools: true,
        ..Default::default()
    };
    let mock = Mock::start(Mock::handler(2, 0).with_modes(modes));
    let mut edge = Edge::start(payload(&mock, false, false), None).await;
    let url = mock.url();
    for id in ["ol-1", "ol-2"] {
        let events = edge.run(run(id, "ol", say("hello"))).await;
        assert_eq!(
            events.last().map(|e| e.r#type()),
            Some(pb::RunEventType::Complete)
        );
        assert_eq!(delta_text(&events), "tok0 tok1 ");
        // The call returns (and checks in) just after its terminal.
        eventually("the run's connection is back in the pool", || {
            edge.core.pool.idle_connections(&url) == 1
        })
        .await;
    }
    let tools = pb::RunInput {
        tools_json: Bytes::from_static(
            br#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#,
        ),
        ..say("weather in Seoul?")
    };
    let events = edge.run(run("oa-1", "mock", tools)).await;
    let done = events.last().expect("terminal");
    assert_eq!(done.r#type(), pb::RunEventType::Complete);
    assert_eq!(
        done.metadata
            .get("openai_text_tool_fallback")
            .map(String::as_str),
        Some("true")
    );
    eventually("the E5 run's connection is back in the pool", || {
        edge.core.pool.idle_connections(&url) == 1
    })
    .await;
    let stats = mock.stats();
    assert_eq!(stats.connections_accepted, 1);
    assert_eq!(stats.ollama_chat_requests, 2);
    assert_eq!(stats.tools_rejected, 1);
    assert_eq!(stats.chat_requests, 2);
    assert_eq!(
        edge.pool_stats(),
        PoolStats {
            hits: 3,
            misses: 1,
            stale_retries: 0,
            checkins: 4,
        }
    );
}
