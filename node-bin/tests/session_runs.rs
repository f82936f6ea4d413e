//! In-process integration: a real Node session (`node_bin::session::run`)
//! over a loopback TCP frame connection to a scripted Edge, against the
//! `bench` mock provider with injected faults. Proves the watchdog, cancel,
//! hard deadline (`timeout_sec`) and its precedence (W9), session-end, W1,
//! command and refresh behaviour through real sockets.
//!
//! Waits are bounded by [`common::SAFETY`] only as a safety net against hangs; no
//! assertion depends on how fast anything runs.

mod common;

use std::collections::HashMap;

use common::{
    chat_tunnel, node_config, ollama_adapter, openai_adapter, openai_profile, Edge, Mock, TARGET,
};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use node_bin::session::SessionEnd;

fn payload(mock: &Mock, health_path: &str, capacity: u32) -> pb::NodeConfigPayload {
    let profile = pb::ProtocolProfile {
        health_path: health_path.into(),
        ..openai_profile(mock)
    };
    node_config(
        vec![
            openai_adapter("mock", capacity, profile),
            ollama_adapter("local-ollama", 1, vec![], mock),
        ],
        false,
    )
}

/// This file's commands and the gate's in-flight count.
impl Edge {
    async fn command(&mut self, command: pb::NodeCommandRequest) -> pb::NodeCommandResponse {
        let id = command.command_id.clone();
        self.send(Body::NodeCommandRequest(command));
        match self.recv().await.body {
            Some(Body::NodeCommandResponse(r)) => {
                assert_eq!(r.command_id, id, "correlated by command id");
                *r
            }
            other => panic!("expected a command response, got {other:?}"),
        }
    }

    async fn in_flight(&mut self) -> u32 {
        let r = self
            .command(pb::NodeCommandRequest {
                command_id: "in-flight".into(),
                r#type: pb::CommandType::ProviderStatus as i32,
                adapter: "mock".into(),
                path: String::new(),
            })
            .await;
        r.providers[0].in_flight
    }
}

fn tunnel(run_id: &str, stall_ms: i64, stream: bool) -> Body {
    Body::ProviderTunnelRequest(Box::new(tunnel_request(run_id, stall_ms, stream)))
}

fn tunnel_request(run_id: &str, stall_ms: i64, stream: bool) -> pb::ProviderTunnelRequest {
    let body = format!(
        r#"{{"model":"{TARGET}","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    pb::ProviderTunnelRequest {
        stream,
        metadata: HashMap::from([("user".to_string(), "caller-secret".to_string())]),
        response_stall_timeout_ms: stall_ms,
        ..chat_tunnel(run_id, body)
    }
}

fn stall_after(tokens: u32) -> bench::mock::MockFaults {
    bench::mock::MockFaults {
        stall_after_tokens: Some(tokens),
        ..Default::default()
    }
}

fn kinds(frames: &[pb::ProviderTunnelFrame]) -> Vec<(u64, pb::TunnelFrameKind)> {
    frames.iter().map(|f| (f.seq, f.kind())).collect()
}

fn assert_stall(
    terminal: &pb::ProviderTunnelFrame,
    stall_ms: i64,
    health: pb::ProviderHealth,
    class: pb::LivenessClassification,
    seq: u64,
) {
    assert_eq!(terminal.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(terminal.failure_code, "response_stalled");
    let f = terminal
        .failure
        .clone()
        .expect("ExecutionFailure on a stall");
    assert_eq!(f.failure_code, "response_stalled");
    assert_eq!(
        f.provider_health,
        Some(pb::ProviderHealthEvidence {
            health: health as i32,
            liveness_classification: class as i32,
        })
    );
    // Never early: the attempt was idle for at least the stall timeout.
    assert!(
        f.idle_duration_ms >= stall_ms,
        "idle {} ms",
        f.idle_duration_ms
    );
    assert_eq!(
        f.fence(),
        pb::Fence::Confirmed,
        "the aborted call returns at once"
    );
    assert_eq!(f.adapter, "mock");
    assert_eq!(f.target, TARGET);
    assert!(f.node_run_id.starts_with("nrun-"));
    assert_eq!(f.attempt_id, format!("{}-a1", f.node_run_id));
    assert_eq!(f.health_observation_seq, Some(seq));
    assert!(terminal.metadata.is_empty());
}

// CONTRACT: W3, W4, W5, W7 — a provider that stalls after two tokens ends
// the tunnel with one ERROR{response_stalled} carrying the allowlisted
// ExecutionFailure (available/request_stalled: the exact-target models
// probe lists the target); the next stall gets the next sequence; the slot
// and the provider stream are freed.
#[monoio::test(timer_enabled = true)]
async fn stalled_tunnel_ends_with_response_stalled() {
    let mock = Mock::with_faults(8, 0, stall_after(2));
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    for (run, seq) in [("t-1", 1), ("t-2", 2)] {
        edge.send(tunnel(run, 300, true));
        let frames = edge.tunnel_frames(run).await;
        let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
        assert_eq!(seqs, (1..=frames.len() as u64).collect::<Vec<_>>());
        assert_eq!(frames[0].kind(), pb::TunnelFrameKind::ResponseStart);
        let body: Vec<u8> = frames
            .iter()
            .filter(|f| f.kind() == pb::TunnelFrameKind::Body)
            .flat_map(|f| f.body.to_vec())
            .collect();
        let body = String::from_utf8(body).expect("utf-8 SSE");
        assert!(body.contains("tok1 "), "two tokens relayed: {body}");
        assert!(!body.contains("tok2 "), "nothing after the stall: {body}");
        assert_stall(
            frames.last().expect("terminal"),
            300,
            pb::ProviderHealth::Available,
            pb::LivenessClassification::RequestStalled,
            seq,
        );
    }
    assert_eq!(edge.in_flight().await, 0);
    mock.wait_stats("stalled streams closed", |s| s["active_streams"] == 0)
        .await;
}

// CONTRACT: W4, W5 — the probe hits the adapter's health path: 503 →
// unavailable/provider_unhealthy; a hanging health check → the bounded probe
// fails closed to unknown/health_unknown.
#[monoio::test(timer_enabled = true)]
async fn stall_probe_evidence_follows_provider_health() {
    let mock = Mock::with_faults(8, 0, stall_after(1));
    let mut edge = Edge::start(payload(&mock, "/health", 2)).await;
    mock.set_health("unhealthy").await;
    edge.send(tunnel("u-1", 200, true));
    let frames = edge.tunnel_frames("u-1").await;
    assert_stall(
        frames.last().expect("terminal"),
        200,
        pb::ProviderHealth::Unavailable,
        pb::LivenessClassification::ProviderUnhealthy,
        1,
    );
    mock.set_health("hanging").await;
    edge.send(tunnel("u-2", 200, true));
    let frames = edge.tunnel_frames("u-2").await;
    assert_stall(
        frames.last().expect("terminal"),
        200,
        pb::ProviderHealth::Unknown,
        pb::LivenessClassification::HealthUnknown,
        2,
    );
}

// CONTRACT: W4 — a non-streaming request that never answers ends with the
// stall ERROR before any RESPONSE_START.
#[monoio::test(timer_enabled = true)]
async fn silent_provider_stalls_before_the_response_starts() {
    let mock = Mock::with_faults(8, 0, stall_after(2));
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    edge.send(tunnel("n-1", 200, false));
    let frames = edge.tunnel_frames("n-1").await;
    assert_eq!(kinds(&frames), vec![(1, pb::TunnelFrameKind::Error)]);
    assert_stall(
        &frames[0],
        200,
        pb::ProviderHealth::Available,
        pb::LivenessClassification::RequestStalled,
        1,
    );
}

// CONTRACT: W6, P4 — a provider that drops the connection mid-stream is
// not a stall: ERROR provider_error without ExecutionFailure; the slot is
// free again.
#[monoio::test(timer_enabled = true)]
async fn dropped_provider_is_a_plain_error() {
    let faults = bench::mock::MockFaults {
        drop_after_tokens: Some(2),
        ..Default::default()
    };
    let mock = Mock::with_faults(8, 0, faults);
    let mut edge = Edge::start(payload(&mock, "/v1/models", 1)).await;
    edge.send(tunnel("d-1", 0, true));
    let frames = edge.tunnel_frames("d-1").await;
    let last = frames.last().expect("terminal");
    assert_eq!(last.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(last.failure_code, "provider_error");
    assert!(last.failure.is_none());
    assert!(!last.error.is_empty());
    assert_eq!(edge.in_flight().await, 0);
    // The one slot admits the next request.
    edge.send(tunnel("d-2", 0, true));
    let frames = edge.tunnel_frames("d-2").await;
    assert_eq!(
        frames.last().map(|f| f.failure_code.as_str()),
        Some("provider_error")
    );
}

// CONTRACT: W1 — negative and overflowing stall timeouts are rejected at the
// Node boundary before any provider call: no connection reaches the mock.
#[monoio::test(timer_enabled = true)]
async fn invalid_stall_timeout_is_rejected_before_the_provider() {
    let mock = Mock::with_faults(4, 0, Default::default());
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    for (run, ms) in [("w-neg", -1), ("w-big", i64::MAX)] {
        edge.send(tunnel(run, ms, true));
        let frames = edge.tunnel_frames(run).await;
        assert_eq!(kinds(&frames), vec![(1, pb::TunnelFrameKind::Error)]);
        assert_eq!(frames[0].failure_code, "invalid_stall_timeout");
        assert!(frames[0].failure.is_none());
    }
    let stats = mock.admin_stats().await;
    // Only the stats request itself ever connected.
    assert_eq!(stats["connections_accepted"], 1);
    assert_eq!(stats["chat_requests"], 0);
}

// CONTRACT: K1, U6 — cancelling one of two concurrent tunnels ends only that
// one, with exactly one ordered terminal; the other completes.
#[monoio::test(timer_enabled = true)]
async fn cancel_ends_only_that_tunnel() {
    let mock = Mock::with_faults(40, 25, Default::default());
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    edge.send(tunnel("k-a", 0, true));
    edge.send(tunnel("k-b", 0, true));
    let mut by_run: HashMap<String, Vec<pb::ProviderTunnelFrame>> = HashMap::new();
    let mut cancelled = false;
    let mut terminals = 0;
    while terminals < 2 {
        let f = edge.recv_tunnel().await;
        let terminal = matches!(
            f.kind(),
            pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error
        );
        let is_body = f.kind() == pb::TunnelFrameKind::Body;
        let run = f.run_id.clone();
        by_run.entry(run.clone()).or_default().push(f);
        if terminal {
            terminals += 1;
        }
        if !cancelled && run == "k-a" && is_body {
            edge.send(Body::CancelRequest(pb::CancelRequest {
                run_id: "k-a".into(),
                reason: "client_disconnect".into(),
            }));
            cancelled = true;
        }
    }
    let a = &by_run["k-a"];
    let b = &by_run["k-b"];
    for frames in [a, b] {
        let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
        assert_eq!(
            seqs,
            (1..=frames.len() as u64).collect::<Vec<_>>(),
            "ordered"
        );
        let terminals = frames
            .iter()
            .filter(|f| {
                matches!(
                    f.kind(),
                    pb::TunnelFrameKind::End | pb::TunnelFrameKind::Error
                )
            })
            .count();
        assert_eq!(terminals, 1, "exactly one terminal, last");
    }
    let a_end = a.last().expect("a terminal");
    assert_eq!(a_end.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(a_end.failure_code, "cancelled");
    assert!(a_end.failure.is_none());
    assert_eq!(b.last().map(|f| f.kind()), Some(pb::TunnelFrameKind::End));
    assert_eq!(edge.in_flight().await, 0);
}

// CONTRACT: U6 — a cancel that overtakes its run (the Edge sends cancels on
// the control lane, runs on the bulk lane) still stops it: one `cancelled`
// terminal, and the provider is never called.
#[monoio::test(timer_enabled = true)]
async fn a_cancel_before_its_run_stops_the_run_on_arrival() {
    let mock = Mock::with_faults(40, 25, Default::default());
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "early".into(),
        reason: "client_disconnect".into(),
    }));
    edge.send(tunnel("early", 0, true));
    let f = edge.recv_tunnel().await;
    assert_eq!(
        (f.run_id.as_str(), f.seq, f.kind(), f.failure_code.as_str()),
        ("early", 1, pb::TunnelFrameKind::Error, "cancelled"),
        "one terminal and nothing before it"
    );
    assert!(f.failure.is_none());
    assert_eq!(edge.in_flight().await, 0);
    // A run sent afterwards under another id is served normally.
    edge.send(tunnel("after", 0, true));
    let frames = edge.tunnel_frames("after").await;
    assert_eq!(
        frames.last().map(|f| f.kind()),
        Some(pb::TunnelFrameKind::End)
    );
    let stats = mock.admin_stats().await;
    assert_eq!(
        stats["chat_requests"], 1,
        "only the second run reached the provider"
    );
}

// CONTRACT: F5 — when the connection drops, the session cancels every
// active tunnel: the provider streams are closed and the session ends.
#[monoio::test(timer_enabled = true)]
async fn session_end_cancels_every_run() {
    let mock = Mock::with_faults(8, 0, stall_after(1));
    let mut edge = Edge::start(payload(&mock, "/v1/models", 4)).await;
    edge.send(tunnel("f-1", 0, true));
    edge.send(tunnel("f-2", 0, true));
    let mut started = 0;
    while started < 2 {
        if edge.recv_tunnel().await.kind() == pb::TunnelFrameKind::ResponseStart {
            started += 1;
        }
    }
    mock.wait_stats("two streams stalled", |s| s["active_streams"] == 2)
        .await;
    edge.conn.close(CloseReason::Superseded);
    let end = edge.node.await;
    assert_eq!(
        end,
        SessionEnd::Ended(CloseReason::Peer("superseded".into()))
    );
    mock.wait_stats("provider streams closed", |s| {
        s["active_streams"] == 0 && s["connections_open"] == 1
    })
    .await;
}

// CONTRACT: K2, H6, W7, X5 — commands are answered by command id:
// CAPABILITIES per adapter instance and target with the probe status and the
// session's next sequence; PROVIDER_STATUS with the gate; TRANSPORT_STATUS
// without addresses; OLLAMA_QUERY read-only.
#[monoio::test(timer_enabled = true)]
async fn commands_are_answered() {
    let mock = Mock::with_faults(4, 0, Default::default());
    let mut edge = Edge::start(payload(&mock, "/v1/models", 3)).await;
    let cmd = |id: &str, t: pb::CommandType, adapter: &str, path: &str| pb::NodeCommandRequest {
        command_id: id.into(),
        r#type: t as i32,
        adapter: adapter.into(),
        path: path.into(),
    };
    let caps = edge
        .command(cmd("c1", pb::CommandType::Capabilities, "mock", ""))
        .await;
    assert!(caps.ok, "{}", caps.error);
    assert_eq!(
        caps.capabilities,
        vec![pb::AdapterCapability {
            adapter_key: "mock".into(),
            target: TARGET.into(),
            provider_status: pb::ProviderHealth::Available as i32,
            health_observation_seq: Some(1),
            adapter: "openai_compat".into(),
            instance_key: "mock".into(),
        }]
    );
    let all = edge
        .command(cmd("c2", pb::CommandType::Capabilities, "", ""))
        .await;
    let keys: Vec<(String, String, Option<u64>)> = all
        .capabilities
        .iter()
        .map(|c| {
            (
                c.adapter_key.clone(),
                c.target.clone(),
                c.health_observation_seq,
            )
        })
        .collect();
    assert_eq!(
        keys,
        vec![
            ("local-ollama".to_string(), String::new(), Some(2)),
            ("mock".to_string(), TARGET.to_string(), Some(3)),
        ]
    );
    // The mock serves the Ollama API: the probe's /api/tags answers 2xx
    // (no target to prove for an instance without targets) → available.
    assert_eq!(
        all.capabilities[0].provider_status(),
        pb::ProviderHealth::Available
    );

    let status = edge
        .command(cmd("c3", pb::CommandType::ProviderStatus, "", ""))
        .await;
    assert_eq!(
        status.providers[1],
        pb::ProviderLifecycle {
            adapter_key: "mock".into(),
            adapter: "openai_compat".into(),
            state: "running".into(),
            capacity: 3,
            in_flight: 0,
            targets: vec![TARGET.into()],
        }
    );
    let transport = edge
        .command(cmd("c4", pb::CommandType::TransportStatus, "", ""))
        .await;
    let t = transport.transport_status.expect("transport status");
    assert_eq!(t.node_id, "node-a");
    assert_eq!((t.active_runs, t.active_tunnels), (0, 0));
    assert!(t.frames_received >= 4);

    let refused = edge
        .command(cmd("c5", pb::CommandType::OllamaQuery, "", "/api/pull"))
        .await;
    assert!(!refused.ok);
    let not_ollama = edge
        .command(cmd("c6", pb::CommandType::OllamaQuery, "mock", "/api/tags"))
        .await;
    assert_eq!(not_ollama.error, "adapter `mock` is not an ollama adapter");
    let relayed = edge
        .command(cmd("c7", pb::CommandType::OllamaQuery, "", "/api/tags"))
        .await;
    assert!(relayed.ok, "{}", relayed.error);
    // The mock's Ollama tag list is relayed as it is.
    assert_eq!(relayed.query_status, 200);
    let body: serde_json::Value = serde_json::from_slice(&relayed.query_body).expect("JSON body");
    assert_eq!(body["models"][0]["name"], TARGET);

    // METRICS: the Node's Prometheus text, with its session's gauges.
    let metrics = edge
        .command(cmd("c8", pb::CommandType::Metrics, "", ""))
        .await;
    assert!(metrics.ok, "{}", metrics.error);
    let text = &metrics.metrics_text;
    for line in [
        "# TYPE iop_node_provider_call_duration_seconds histogram\n",
        "# TYPE iop_build_info gauge\n",
        "# TYPE process_resident_memory_bytes gauge\n",
        "iop_node_active_runs 0\n",
        "iop_node_active_tunnels 0\n",
        "iop_node_adapter_capacity{adapter=\"local-ollama\"} 1\n",
        "iop_node_adapter_capacity{adapter=\"mock\"} 3\n",
        "iop_node_adapter_in_flight{adapter=\"mock\"} 0\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

// CONTRACT: K3 — a refresh is APPLIED (new capacity for new requests),
// RESTART_REQUIRED when the credential mode flips, FAILED (old config kept)
// when invalid.
#[monoio::test(timer_enabled = true)]
async fn config_refresh_outcomes() {
    let mock = Mock::with_faults(4, 0, Default::default());
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    let mut bigger = payload(&mock, "/v1/models", 7);
    bigger.revision = 2;
    let r = edge.refresh("r1", bigger.clone()).await;
    assert_eq!(
        r,
        pb::NodeConfigRefreshResponse {
            refresh_id: "r1".into(),
            status: pb::RefreshStatus::Applied as i32,
            reason: String::new(),
        }
    );
    let status = edge
        .command(pb::NodeCommandRequest {
            command_id: "s".into(),
            r#type: pb::CommandType::ProviderStatus as i32,
            adapter: "mock".into(),
            path: String::new(),
        })
        .await;
    assert_eq!(status.providers[0].capacity, 7);

    let mut managed = bigger.clone();
    managed.revision = 3;
    managed.credential_leases_required = true;
    let r = edge.refresh("r2", managed).await;
    assert_eq!(r.status(), pb::RefreshStatus::RestartRequired);

    let mut invalid = bigger.clone();
    invalid.revision = 4;
    invalid.adapters[0].kind = None;
    let r = edge.refresh("r3", invalid).await;
    assert_eq!(r.status(), pb::RefreshStatus::Failed);
    assert_eq!(
        r.reason,
        "adapter `mock` has no kind (ollama or openai_compat)"
    );
    // The applied config still serves tunnels.
    edge.send(tunnel("after-refresh", 0, true));
    let frames = edge.tunnel_frames("after-refresh").await;
    assert_eq!(
        frames.last().map(|f| f.kind()),
        Some(pb::TunnelFrameKind::End)
    );
}

// CONTRACT: W7 — one session, three observations at once: a normalized run
// that stalls, a tunnel that stalls and a CAPABILITIES command, all in
// flight together. Their `health_observation_seq` values are unique and
// together exactly 1..=n: one counter of the transport session numbers
// them all, whichever finishes first.
#[monoio::test(timer_enabled = true)]
async fn concurrent_run_tunnel_and_capabilities_share_one_sequence() {
    let mock = Mock::with_faults(8, 0, stall_after(1));
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    edge.send(Body::RunRequest(Box::new(pb::RunRequest {
        run_id: "w7-run".into(),
        adapter: "mock".into(),
        target: TARGET.into(),
        input: Some(pb::RunInput {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        response_stall_timeout_ms: 300,
        ..Default::default()
    })));
    edge.send(tunnel("w7-tunnel", 300, true));
    edge.send(Body::NodeCommandRequest(pb::NodeCommandRequest {
        command_id: "w7-caps".into(),
        r#type: pb::CommandType::Capabilities as i32,
        adapter: String::new(),
        path: String::new(),
    }));
    let mut seqs: Vec<(&str, u64)> = Vec::new();
    let (mut run_done, mut tunnel_done, mut caps_done) = (false, false, false);
    while !(run_done && tunnel_done && caps_done) {
        match edge.recv().await.body {
            Some(Body::RunEvent(e)) if e.r#type() == pb::RunEventType::Error => {
                assert_eq!(e.failure_code, "response_stalled", "{e:?}");
                let f = e.failure.expect("an ExecutionFailure on a stall");
                seqs.push(("run", f.health_observation_seq.expect("bound session")));
                run_done = true;
            }
            Some(Body::RunEvent(e)) => {
                assert!(
                    matches!(
                        e.r#type(),
                        pb::RunEventType::Start | pb::RunEventType::Delta
                    ),
                    "{e:?}"
                );
            }
            Some(Body::ProviderTunnelFrame(f)) if f.kind() == pb::TunnelFrameKind::Error => {
                assert_eq!(f.failure_code, "response_stalled", "{f:?}");
                let failure = f.failure.expect("an ExecutionFailure on a stall");
                let seq = failure.health_observation_seq.expect("bound session");
                seqs.push(("tunnel", seq));
                tunnel_done = true;
            }
            Some(Body::ProviderTunnelFrame(f)) => {
                assert!(
                    matches!(
                        f.kind(),
                        pb::TunnelFrameKind::ResponseStart | pb::TunnelFrameKind::Body
                    ),
                    "{f:?}"
                );
            }
            Some(Body::NodeCommandResponse(r)) => {
                assert_eq!(r.command_id, "w7-caps");
                assert!(r.ok, "{}", r.error);
                assert_eq!(r.capabilities.len(), 2, "both adapters");
                for c in &r.capabilities {
                    seqs.push(("capabilities", c.health_observation_seq.expect("bound")));
                }
                caps_done = true;
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
    let mut numbers: Vec<u64> = seqs.iter().map(|(_, s)| *s).collect();
    numbers.sort_unstable();
    assert_eq!(
        numbers,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "{seqs:?}"
    );
}

/// The body bytes of `frames` as text.
fn body_text(frames: &[pb::ProviderTunnelFrame]) -> String {
    let body: Vec<u8> = frames
        .iter()
        .filter(|f| f.kind() == pb::TunnelFrameKind::Body)
        .flat_map(|f| f.body.to_vec())
        .collect();
    String::from_utf8(body).expect("utf-8 SSE")
}

/// Asserts `frames` are one tunnel's whole stream: `seq` 1, 2, … and
/// exactly one terminal, the last frame.
fn assert_one_terminal_last(frames: &[pb::ProviderTunnelFrame]) {
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, (1..=frames.len() as u64).collect::<Vec<_>>());
    let terminals: Vec<usize> = frames
        .iter()
        .enumerate()
        .filter(|(_, f)| common::is_tunnel_terminal(f.kind()))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(terminals, vec![frames.len() - 1], "{:?}", kinds(frames));
}

/// A request refused at once (W1): its lone `ERROR` frame, read after
/// everything else the session sent, shows that no frame of an earlier run
/// came after that run's terminal (`tunnel_frames` accepts only its run's
/// frames).
async fn assert_nothing_more(edge: &mut Edge) {
    edge.send(tunnel("sentinel", -1, true));
    let frames = edge.tunnel_frames("sentinel").await;
    assert_eq!(kinds(&frames), vec![(1, pb::TunnelFrameKind::Error)]);
    assert_eq!(frames[0].failure_code, "invalid_stall_timeout");
}

// CONTRACT: W9 — a run's `timeout_sec` is a hard deadline the session
// enforces: a provider that keeps streaming (steady progress, so the stall
// watchdog never fires) is cut at it with one ERROR{deadline_exceeded}
// without ExecutionFailure (W6), not let run to its end; the provider
// stream is aborted and the slot freed.
#[monoio::test(timer_enabled = true)]
async fn a_hard_deadline_cuts_a_tunnel_that_keeps_streaming() {
    // 400 tokens 25 ms apart: ten seconds of steady progress.
    let mock = Mock::with_faults(400, 25, Default::default());
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    let sent_at = iop_engine::clock::now();
    let frames = edge
        .tunnel(pb::ProviderTunnelRequest {
            timeout_sec: 1,
            ..tunnel_request("deadline-tunnel", 60_000, true)
        })
        .await;
    let waited = iop_engine::clock::now() - sent_at;
    assert_one_terminal_last(&frames);
    assert_eq!(frames[0].kind(), pb::TunnelFrameKind::ResponseStart);
    let body = body_text(&frames);
    assert!(body.contains("tok0 "), "it was streaming: {body}");
    assert!(!body.contains("[DONE]"), "cut before its end: {body}");
    let terminal = frames.last().expect("terminal");
    assert_eq!(
        (
            terminal.kind(),
            terminal.failure_code.as_str(),
            terminal.error.as_str()
        ),
        (
            pb::TunnelFrameKind::Error,
            "deadline_exceeded",
            "the run's deadline passed"
        )
    );
    assert_eq!(terminal.failure, None, "not a stall");
    assert!(
        waited >= std::time::Duration::from_secs(1),
        "not before the deadline: {waited:?}"
    );
    mock.wait_stats("the provider stream was aborted", |s| {
        s["active_streams"] == 0 && s["streams_aborted"] == 1
    })
    .await;
    assert_eq!(mock.counters().chat_requests, 1);
    assert_eq!(edge.in_flight().await, 0);
    assert_nothing_more(&mut edge).await;
}

// CONTRACT: W9 — the same deadline on a normalized run: deltas flow, then
// one ERROR{deadline_exceeded} without ExecutionFailure, never `complete`.
#[monoio::test(timer_enabled = true)]
async fn a_hard_deadline_cuts_a_normalized_run_that_keeps_streaming() {
    let mock = Mock::with_faults(400, 25, Default::default());
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    let events = edge
        .run(pb::RunRequest {
            run_id: "deadline-run".into(),
            adapter: "mock".into(),
            target: TARGET.into(),
            input: Some(pb::RunInput {
                messages: vec![pb::ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            timeout_sec: 1,
            response_stall_timeout_ms: 60_000,
            ..Default::default()
        })
        .await;
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    let (terminal, before) = events.split_last().expect("a terminal");
    assert!(
        before.iter().all(|e| matches!(
            e.r#type(),
            pb::RunEventType::Start | pb::RunEventType::Delta
        )),
        "{before:?}"
    );
    assert!(
        before.iter().any(|e| !e.delta.is_empty()),
        "it was streaming: {before:?}"
    );
    assert_eq!(
        (
            terminal.r#type(),
            terminal.failure_code.as_str(),
            terminal.error.as_str()
        ),
        (
            pb::RunEventType::Error,
            "deadline_exceeded",
            "the run's deadline passed"
        )
    );
    assert_eq!(terminal.failure, None, "not a stall");
    mock.wait_stats("the provider stream was aborted", |s| {
        s["active_streams"] == 0 && s["streams_aborted"] == 1
    })
    .await;
    assert_eq!(edge.in_flight().await, 0);
}

// CONTRACT: W9 — a hard deadline that comes before the stall watchdog
// would fire keeps its own terminal: the provider went silent, the stall
// timeout is far off, the deadline ends the tunnel without stall evidence.
#[monoio::test(timer_enabled = true)]
async fn a_hard_deadline_before_the_stall_keeps_its_own_terminal() {
    let mock = Mock::with_faults(8, 0, stall_after(1));
    let mut edge = Edge::start(payload(&mock, "/v1/models", 2)).await;
    let frames = edge
        .tunnel(pb::ProviderTunnelRequest {
            timeout_sec: 1,
            ..tunnel_request("silent", 60_000, true)
        })
        .await;
    assert_one_terminal_last(&frames);
    let terminal = frames.last().expect("terminal");
    assert_eq!(
        (terminal.kind(), terminal.failure_code.as_str()),
        (pb::TunnelFrameKind::Error, "deadline_exceeded")
    );
    assert_eq!(terminal.failure, None, "not a stall");
    assert_eq!(edge.in_flight().await, 0);
}

// CONTRACT: W9 — once the watchdog claimed a stall, a cancel and the hard
// deadline that both come during its join change nothing: the one terminal
// is the stall's. The probe hangs (bounded at 8 s), so the join outlasts
// the cancel, sent once the provider stream was aborted by the claim, and
// the 3 s deadline.
#[monoio::test(timer_enabled = true)]
async fn a_cancel_and_a_deadline_after_the_stall_claim_change_nothing() {
    let mock = Mock::with_faults(8, 0, stall_after(1));
    let mut config = payload(&mock, "/health", 2);
    if let Some(runtime) = config.runtime.as_mut() {
        runtime.probe_timeout_ms = 8_000;
    }
    let mut edge = Edge::start(config).await;
    mock.set_health("hanging").await;
    let sent_at = iop_engine::clock::now();
    edge.send(Body::ProviderTunnelRequest(Box::new(
        pb::ProviderTunnelRequest {
            timeout_sec: 3,
            ..tunnel_request("claimed", 200, true)
        },
    )));
    let mut frames = vec![edge.recv_tunnel().await];
    assert_eq!(frames[0].kind(), pb::TunnelFrameKind::ResponseStart);
    // The claim cancels the provider call: the mock's stream ends.
    common::eventually("the stalled stream aborted by the claim", || {
        mock.counters().active_streams == 0
    })
    .await;
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "claimed".into(),
        reason: "client_disconnect".into(),
    }));
    frames.extend(edge.tunnel_frames("claimed").await);
    let waited = iop_engine::clock::now() - sent_at;
    assert_one_terminal_last(&frames);
    assert_stall(
        frames.last().expect("terminal"),
        200,
        pb::ProviderHealth::Unknown,
        pb::LivenessClassification::HealthUnknown,
        1,
    );
    assert!(
        waited >= std::time::Duration::from_secs(3),
        "the deadline passed during the join: {waited:?}"
    );
    assert_nothing_more(&mut edge).await;
    assert_eq!(edge.in_flight().await, 0);
}

// CONTRACT: W9, E1 — a cancel racing the stall watchdog: the cancel is sent
// at offsets around the 200 ms stall timeout, so it lands before the stall
// fires, during its join (the probe of a hanging health check takes its
// 300 ms bound) or after its terminal. Whichever wins, each tunnel ends
// with exactly one terminal, the last of its frames, and nothing of it
// follows: `cancelled` without ExecutionFailure, or the stall's with it.
#[monoio::test(timer_enabled = true)]
async fn a_cancel_racing_the_stall_watchdog_ends_the_tunnel_once() {
    let mock = Mock::with_faults(8, 0, stall_after(1));
    let mut edge = Edge::start(payload(&mock, "/health", 2)).await;
    mock.set_health("hanging").await;
    let offsets_ms = [0u64, 100, 150, 180, 200, 220, 260, 320, 400, 480, 560, 700];
    let (mut cancelled, mut stalled) = (0u64, 0u64);
    for (i, offset_ms) in offsets_ms.into_iter().enumerate() {
        let run = format!("race-{i}");
        edge.send(tunnel(&run, 200, true));
        // The first body frame: the provider made progress; the idle
        // clock runs from about now.
        let mut frames = Vec::new();
        while !frames
            .iter()
            .any(|f: &pb::ProviderTunnelFrame| f.kind() == pb::TunnelFrameKind::Body)
        {
            let f = edge.recv_tunnel().await;
            assert_eq!(f.run_id, run);
            assert!(!common::is_tunnel_terminal(f.kind()), "{f:?}");
            frames.push(f);
        }
        monoio::time::sleep(std::time::Duration::from_millis(offset_ms)).await;
        edge.send(Body::CancelRequest(pb::CancelRequest {
            run_id: run.clone(),
            reason: "client_disconnect".into(),
        }));
        frames.extend(edge.tunnel_frames(&run).await);
        assert_one_terminal_last(&frames);
        let terminal = frames.last().expect("terminal");
        assert_eq!(terminal.kind(), pb::TunnelFrameKind::Error);
        match terminal.failure_code.as_str() {
            "cancelled" => {
                assert_eq!(terminal.failure, None, "{terminal:?}");
                cancelled += 1;
            }
            "response_stalled" => {
                stalled += 1;
                assert_stall(
                    terminal,
                    200,
                    pb::ProviderHealth::Unknown,
                    pb::LivenessClassification::HealthUnknown,
                    stalled,
                );
            }
            other => panic!("terminal {other:?} after a cancel at {offset_ms} ms"),
        }
    }
    eprintln!("cancel won {cancelled}, the stall won {stalled}");
    assert_eq!(cancelled + stalled, offsets_ms.len() as u64);
    assert_nothing_more(&mut edge).await;
    assert_eq!(edge.in_flight().await, 0);
    mock.wait_stats("every provider stream closed", |s| s["active_streams"] == 0)
        .await;
}
