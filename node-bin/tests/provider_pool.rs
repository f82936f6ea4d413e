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

mod common;

use bytes::Bytes;
use common::{
    attach_lease, chat_tunnel, eventually, node_config, ollama_adapter, openai_adapter,
    openai_profile, recipient, Edge, Mock, TARGET,
};
use ed25519_dalek::SigningKey;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use node_bin::calls::pool::PoolStats;
use node_bin::credentials::NodeCredentials;

const SECRET: &str = "sk-iop-pool-test-77a0";
const RECIPIENT_SEED: [u8; 32] = [21; 32];
const ISSUER_SEED: [u8; 32] = [22; 32];

/// One OpenAI-compatible adapter `mock` and one Ollama adapter `ol`, both
/// on the mock.
fn payload(mock: &Mock, auth_header: bool, leases_required: bool) -> pb::NodeConfigPayload {
    let (auth_header_name, auth_header_format) = if auth_header {
        ("Authorization".to_string(), "Bearer {secret}".to_string())
    } else {
        (String::new(), String::new())
    };
    let profile = pb::ProtocolProfile {
        health_path: "/v1/models".into(),
        auth_header_name,
        auth_header_format,
        ..openai_profile(mock)
    };
    node_config(
        vec![
            openai_adapter("mock", 4, profile),
            ollama_adapter("ol", 4, vec![TARGET.into()], mock),
        ],
        leases_required,
    )
}

/// The pool's counters (the pool lives in the Node's per-core state).
impl Edge {
    fn pool_stats(&self) -> PoolStats {
        self.core
            .calls
            .pool()
            .expect("calls run on this core")
            .stats()
    }
}

/// A streamed chat completion tunnel, capped at `max_tokens` when given.
fn tunnel(run_id: &str, max_tokens: Option<u32>, stall_ms: i64) -> pb::ProviderTunnelRequest {
    let cap = max_tokens.map_or(String::new(), |n| format!(r#","max_tokens":{n}"#));
    let body = format!(
        r#"{{"model":"{TARGET}","stream":true{cap},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    pb::ProviderTunnelRequest {
        stream: true,
        response_stall_timeout_ms: stall_ms,
        ..chat_tunnel(run_id, body)
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
    let mut edge = Edge::start(payload(&mock, false, false)).await;
    assert_streamed(&edge.tunnel(tunnel("seq-1", None, 0)).await, 3);
    assert_eq!(
        edge.core
            .calls
            .pool()
            .expect("calls run on this core")
            .idle_connections(&mock.url()),
        1
    );
    assert_streamed(&edge.tunnel(tunnel("seq-2", None, 0)).await, 3);
    let stats = mock.counters();
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
    assert_eq!(
        edge.core
            .calls
            .pool()
            .expect("calls run on this core")
            .idle_connections(&mock.url()),
        1
    );
}

// CONTRACT: U6, K1 — a cancelled tunnel's provider connection is closed,
// never returned to the pool: the next tunnel connects anew.
#[monoio::test(timer_enabled = true)]
async fn cancelled_tunnel_connection_is_not_reused() {
    // 40 tokens 25 ms apart: a full stream outlives the cancel by far; the
    // quick requests ask for one token.
    let mock = Mock::start(Mock::handler(40, 25));
    let mut edge = Edge::start(payload(&mock, false, false)).await;
    assert_streamed(&edge.tunnel(tunnel("c-1", Some(1), 0)).await, 1);
    // The long one takes the pooled connection and is cancelled mid-stream.
    edge.send(Body::ProviderTunnelRequest(Box::new(tunnel(
        "c-2", None, 0,
    ))));
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
        let s = mock.counters();
        s.streams_aborted == 1 && s.connections_open == 0
    })
    .await;
    assert_eq!(
        edge.core
            .calls
            .pool()
            .expect("calls run on this core")
            .idle_connections(&mock.url()),
        0
    );
    assert_streamed(&edge.tunnel(tunnel("c-3", Some(1), 0)).await, 1);
    let stats = mock.counters();
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
    let handler = Mock::handler_with_faults(
        8,
        0,
        bench::mock::MockFaults {
            stall_after_tokens: Some(2),
            ..Default::default()
        },
    );
    let mock = Mock::start(handler);
    let mut edge = Edge::start(payload(&mock, false, false)).await;
    assert_streamed(&edge.tunnel(tunnel("s-1", Some(2), 0)).await, 2);
    let frames = edge.tunnel(tunnel("s-2", None, 200)).await;
    let last = frames.last().expect("terminal");
    assert_eq!(last.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(last.failure_code, "response_stalled");
    eventually("the stalled stream's connection closed", || {
        mock.counters().active_streams == 0
    })
    .await;
    assert_eq!(
        edge.core
            .calls
            .pool()
            .expect("calls run on this core")
            .idle_connections(&mock.url()),
        0
    );
    assert_streamed(&edge.tunnel(tunnel("s-3", Some(2), 0)).await, 2);
    let stats = mock.counters();
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
    let mut edge = Edge::start(payload(&mock, false, false)).await;
    assert_streamed(&edge.tunnel(tunnel("r-1", None, 0)).await, 3);
    // The reply looked keep-alive, so the connection went back to the pool;
    // then the provider closed it.
    assert_eq!(
        edge.core
            .calls
            .pool()
            .expect("calls run on this core")
            .idle_connections(&mock.url()),
        1
    );
    eventually("the provider closed the idle connection", || {
        mock.counters().connections_open == 0
    })
    .await;
    let frames = edge.tunnel(tunnel("r-2", None, 0)).await;
    assert_streamed(&frames, 3);
    assert_eq!(
        kinds(&frames[..1]),
        vec![pb::TunnelFrameKind::ResponseStart],
        "one response, no trace of the failed attempt"
    );
    let stats = mock.counters();
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

fn issuer() -> SigningKey {
    SigningKey::from_bytes(&ISSUER_SEED)
}

/// A tunnel carrying a fresh lease `lease_id` for [`SECRET`] to `mock`.
fn leased(mock: &Mock, run_id: &str, lease_id: &str) -> pb::ProviderTunnelRequest {
    let mut tunnel = tunnel(run_id, None, 0);
    attach_lease(
        &mut tunnel,
        &mock.origin(),
        lease_id,
        SECRET,
        RECIPIENT_SEED,
        &issuer(),
    );
    tunnel
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
    let mut edge =
        Edge::start_with_credentials(payload(&mock, true, true), Some(credentials)).await;
    assert_streamed(&edge.tunnel(leased(&mock, "l-1", "lease-l-1")).await, 3);
    eventually("the provider closed the idle connection", || {
        mock.counters().connections_open == 0
    })
    .await;
    let frames = edge.tunnel(leased(&mock, "l-2", "lease-l-2")).await;
    assert_streamed(&frames, 3);
    assert!(frames
        .iter()
        .all(|f| !f.body.windows(SECRET.len()).any(|w| w == SECRET.as_bytes())));
    let stats = mock.counters();
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
    let mut edge = Edge::start(payload(&mock, false, false)).await;
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
            edge.core
                .calls
                .pool()
                .expect("calls run on this core")
                .idle_connections(&url)
                == 1
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
        edge.core
            .calls
            .pool()
            .expect("calls run on this core")
            .idle_connections(&url)
            == 1
    })
    .await;
    let stats = mock.counters();
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
