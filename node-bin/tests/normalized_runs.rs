//! In-process integration of normalized runs: a real Node session
//! (`node_bin::session::run`) over a loopback frame connection to a
//! scripted Edge, against the `bench` mock provider speaking Ollama NDJSON
//! and OpenAI SSE over real sockets. Proves E1 (event order, one
//! terminal), E4 (native tool calls through both adapters), E5 (the text
//! tool-call fallback after the backend rejects `tools`), K1/U6 (cancel
//! aborts the provider request) and W3/W4 for runs.
//!
//! Waits are bounded by [`common::SAFETY`] only as a safety net against
//! hangs; no assertion depends on how fast anything runs.

mod common;

use std::collections::HashMap;

use bytes::Bytes;
use common::{node_config, ollama_adapter, openai_adapter, openai_profile, Edge, Mock, TARGET};
use iop_wire::pb;
use iop_wire::pb::frame::Body;

/// The mock with `faults` and tool `modes`.
fn start_mock(
    tokens: u32,
    inter_token_ms: u64,
    faults: bench::mock::MockFaults,
    modes: bench::mock::MockModes,
) -> Mock {
    Mock::start(Mock::handler_with_faults(tokens, inter_token_ms, faults).with_modes(modes))
}

/// The mock without faults or tool modes.
fn plain_mock(tokens: u32) -> Mock {
    start_mock(tokens, 0, Default::default(), Default::default())
}

/// An Ollama instance `ol` and an OpenAI-compatible instance `oa`, both on
/// the mock, each with `capacity`.
fn payload(mock: &Mock, capacity: u32) -> pb::NodeConfigPayload {
    let profile = pb::ProtocolProfile {
        name: "vllm".into(),
        health_path: "/health".into(),
        auth_header_name: "Authorization".into(),
        auth_header_format: "Bearer {secret}".into(),
        ..openai_profile(mock)
    };
    node_config(
        vec![
            ollama_adapter("ol", capacity, vec![TARGET.into()], mock),
            openai_adapter("oa", capacity, profile),
        ],
        false,
    )
}

fn user(text: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: "user".into(),
        content: text.into(),
        ..Default::default()
    }
}

const WEATHER_TOOLS: &str = r#"[{"type":"function","function":{"name":"get_weather","description":"Weather of a city","parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}}]"#;

fn run(run_id: &str, adapter: &str, input: pb::RunInput) -> Body {
    Body::RunRequest(Box::new(pb::RunRequest {
        run_id: run_id.into(),
        adapter: adapter.into(),
        target: TARGET.into(),
        input: Some(input),
        session_id: "sess-1".into(),
        ..Default::default()
    }))
}

fn text_input() -> pb::RunInput {
    pb::RunInput {
        messages: vec![user("say something deterministic")],
        ..Default::default()
    }
}

fn tool_input() -> pb::RunInput {
    pb::RunInput {
        messages: vec![
            pb::ChatMessage {
                role: "system".into(),
                content: "You are terse.".into(),
                ..Default::default()
            },
            user("weather in Seoul?"),
        ],
        tools_json: Bytes::from_static(WEATHER_TOOLS.as_bytes()),
        ..Default::default()
    }
}

fn types(events: &[pb::RunEvent]) -> Vec<(u64, pb::RunEventType)> {
    events.iter().map(|e| (e.seq, e.r#type())).collect()
}

fn text(events: &[pb::RunEvent]) -> String {
    events.iter().map(|e| e.delta.as_str()).collect()
}

/// The expected sequence of a `tokens`-token text run: start, one delta
/// per token, complete.
fn text_run_types(tokens: u64) -> Vec<(u64, pb::RunEventType)> {
    std::iter::once((1, pb::RunEventType::Start))
        .chain((2..2 + tokens).map(|s| (s, pb::RunEventType::Delta)))
        .chain(std::iter::once((2 + tokens, pb::RunEventType::Complete)))
        .collect()
}

// CONTRACT: E1, E3 — an Ollama run is start, one delta per NDJSON content
// line, one complete with usage (prompt_eval_count/eval_count) and
// done_reason; the run and session ids are echoed; the gate slot is freed.
#[monoio::test(timer_enabled = true)]
async fn ollama_run_streams_deltas_and_completes() {
    let mock = plain_mock(3);
    let mut edge = Edge::start(payload(&mock, 1)).await;
    edge.send(run("ol-1", "ol", text_input()));
    let events = edge.run_events("ol-1").await;
    assert_eq!(types(&events), text_run_types(3));
    assert_eq!(text(&events), "tok0 tok1 tok2 ");
    let done = events.last().expect("terminal");
    assert_eq!(done.finish_reason, "stop");
    assert_eq!(
        done.usage,
        Some(Box::new(pb::Usage {
            prompt_tokens: 3,
            completion_tokens: 3,
            total_tokens: 6
        }))
    );
    assert_eq!(
        done.metadata,
        HashMap::from([("done_reason".to_string(), "stop".to_string())])
    );
    assert!(events
        .iter()
        .all(|e| e.session_id == "sess-1" && e.adapter == "ol" && e.target == TARGET));
    assert_eq!(edge.adapter_in_flight("ol").await, 0);
    // max_tokens → num_predict caps the answer: finish_reason length.
    let capped = pb::RunInput {
        max_tokens: Some(1),
        ..text_input()
    };
    edge.send(run("ol-2", "ol", capped));
    let events = edge.run_events("ol-2").await;
    assert_eq!(text(&events), "tok0 ");
    assert_eq!(
        events.last().map(|e| e.finish_reason.as_str()),
        Some("length")
    );
    let stats = mock.admin_stats().await;
    assert_eq!(stats["ollama_chat_requests"], 2);
}

// CONTRACT: E1 — an OpenAI-compatible normalized run is start, deltas, one
// complete with the usage chunk's figures.
#[monoio::test(timer_enabled = true)]
async fn openai_run_streams_deltas_and_completes() {
    let mock = plain_mock(4);
    let mut edge = Edge::start(payload(&mock, 1)).await;
    edge.send(run("oa-1", "oa", text_input()));
    let events = edge.run_events("oa-1").await;
    assert_eq!(types(&events), text_run_types(4));
    assert_eq!(text(&events), "tok0 tok1 tok2 tok3 ");
    let done = events.last().expect("terminal");
    assert_eq!(done.finish_reason, "stop");
    assert_eq!(
        done.usage,
        Some(Box::new(pb::Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            total_tokens: 7
        }))
    );
    assert!(done.metadata.is_empty());
    assert_eq!(edge.adapter_in_flight("oa").await, 0);
}

const WEATHER_CALL: &str = r#"{"id":"call_0","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"tok0\",\"days\":1}"}}"#;

// CONTRACT: E4 — native tool calls come back on complete as
// metadata["openai_tool_calls"] (arguments as JSON strings) through both
// adapters: Ollama's object arguments and OpenAI's streamed pieces.
#[monoio::test(timer_enabled = true)]
async fn native_tool_calls_through_both_adapters() {
    let modes = bench::mock::MockModes {
        tool_calls: true,
        ..Default::default()
    };
    let mock = start_mock(3, 0, Default::default(), modes);
    let mut edge = Edge::start(payload(&mock, 2)).await;

    edge.send(run("t-ol", "ol", tool_input()));
    let events = edge.run_events("t-ol").await;
    assert_eq!(
        types(&events),
        vec![
            (1, pb::RunEventType::Start),
            (2, pb::RunEventType::Complete)
        ]
    );
    let done = &events[1];
    assert_eq!(done.finish_reason, "tool_calls");
    assert_eq!(
        done.metadata["openai_tool_calls"],
        format!("[{WEATHER_CALL}]")
    );
    assert!(!done.metadata.contains_key("openai_text_tool_fallback"));

    edge.send(run("t-oa", "oa", tool_input()));
    let events = edge.run_events("t-oa").await;
    assert_eq!(
        types(&events),
        vec![
            (1, pb::RunEventType::Start),
            (2, pb::RunEventType::Complete)
        ]
    );
    let done = &events[1];
    assert_eq!(done.finish_reason, "tool_calls");
    let calls: serde_json::Value =
        serde_json::from_str(&done.metadata["openai_tool_calls"]).expect("JSON calls");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(
        calls[0]["function"]["arguments"],
        r#"{"city":"tok0","days":1}"#
    );
    assert!(calls[0]["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("call_mock_")));
    assert!(!done.metadata.contains_key("openai_text_tool_fallback"));
}

// CONTRACT: E5 — the backend rejects `tools` with 400; the adapter retries
// once without tools, the instruction merged into the leading system
// message, and flags the run on start and complete; the text (with the
// <tool_call> block the backend wrote) passes through unparsed.
#[monoio::test(timer_enabled = true)]
async fn rejected_tools_fall_back_to_text_tool_calls() {
    let modes = bench::mock::MockModes {
        reject_tools: true,
        ..Default::default()
    };
    let mock = start_mock(3, 0, Default::default(), modes);
    let mut edge = Edge::start(payload(&mock, 1)).await;
    edge.send(run("e5", "oa", tool_input()));
    let events = edge.run_events("e5").await;
    let flag = ("openai_text_tool_fallback".to_string(), "true".to_string());
    assert_eq!(events[0].r#type(), pb::RunEventType::Start);
    assert_eq!(events[0].metadata, HashMap::from([flag.clone()]));
    let done = events.last().expect("terminal");
    assert_eq!(done.r#type(), pb::RunEventType::Complete);
    assert_eq!(done.metadata, HashMap::from([flag]));
    assert_eq!(done.finish_reason, "stop");
    assert_eq!(
        text(&events),
        r#"<tool_call>{"name":"get_weather","arguments":{"city":"tok0","days":1}}</tool_call>"#
    );
    let stats = mock.admin_stats().await;
    assert_eq!(stats["tools_rejected"], 1, "exactly one rejected attempt");
    assert_eq!(stats["chat_requests"], 2, "one retry");
    // Without tools the same backend answers plainly, no flag.
    edge.send(run("e5-plain", "oa", text_input()));
    let events = edge.run_events("e5-plain").await;
    assert!(events.iter().all(|e| e.metadata.is_empty()));
    assert_eq!(text(&events), "tok0 tok1 tok2 ");
}

// CONTRACT: W6 — a provider error status is one error terminal with the
// provider's message and no ExecutionFailure.
#[monoio::test(timer_enabled = true)]
async fn provider_errors_are_plain_error_terminals() {
    let faults = bench::mock::MockFaults {
        fail_status: Some(503),
        ..Default::default()
    };
    let mock = start_mock(3, 0, faults, Default::default());
    let mut edge = Edge::start(payload(&mock, 1)).await;
    edge.send(run("f-ol", "ol", text_input()));
    let events = edge.run_events("f-ol").await;
    assert_eq!(types(&events), vec![(1, pb::RunEventType::Error)]);
    assert_eq!(events[0].failure_code, "provider_error");
    assert_eq!(
        events[0].error,
        "ollama: HTTP 503: injected failure (status 503)"
    );
    assert!(events[0].failure.is_none());
    edge.send(run("f-oa", "oa", tool_input()));
    let events = edge.run_events("f-oa").await;
    assert_eq!(types(&events), vec![(1, pb::RunEventType::Error)]);
    assert_eq!(
        events[0].error,
        "vllm: HTTP 503: injected failure (status 503)"
    );
    assert_eq!(edge.adapter_in_flight("ol").await, 0);
}

// CONTRACT: K1, U6 — a CancelRequest mid-stream ends the run with one
// `cancelled` terminal; the provider request is aborted (the mock sees its
// stream fail) and the gate slot is freed.
#[monoio::test(timer_enabled = true)]
async fn cancel_aborts_the_provider_request() {
    let mock = start_mock(400, 20, Default::default(), Default::default());
    let mut edge = Edge::start(payload(&mock, 1)).await;
    for (run_id, adapter) in [("c-ol", "ol"), ("c-oa", "oa")] {
        let aborted_before = mock.admin_stats().await["streams_aborted"]
            .as_u64()
            .unwrap_or(0);
        edge.send(run(run_id, adapter, text_input()));
        let start = edge.recv_event().await;
        assert_eq!(start.r#type(), pb::RunEventType::Start);
        let first = edge.recv_event().await;
        assert_eq!(
            (first.r#type(), first.delta.as_str()),
            (pb::RunEventType::Delta, "tok0 ")
        );
        edge.send(Body::CancelRequest(pb::CancelRequest {
            run_id: run_id.into(),
            reason: "client_disconnected".into(),
        }));
        let rest = edge.run_events(run_id).await;
        let last = rest.last().expect("terminal");
        assert_eq!(last.r#type(), pb::RunEventType::Cancelled);
        assert_eq!(last.failure_code, "cancelled");
        assert!(rest[..rest.len() - 1]
            .iter()
            .all(|e| e.r#type() == pb::RunEventType::Delta));
        let seqs: Vec<u64> = [start.seq, first.seq]
            .into_iter()
            .chain(rest.iter().map(|e| e.seq))
            .collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        mock.wait_stats("the provider stream aborted", |s| {
            s["streams_aborted"].as_u64() == Some(aborted_before + 1) && s["active_streams"] == 0
        })
        .await;
        assert_eq!(edge.adapter_in_flight(adapter).await, 0);
    }
}

// CONTRACT: W3, W4 — a normalized run whose provider stalls after two
// deltas ends with one error{response_stalled} carrying the ExecutionFailure
// (the exact-target /api/tags probe lists the target: available).
#[monoio::test(timer_enabled = true)]
async fn stalled_ollama_run_ends_with_response_stalled() {
    let faults = bench::mock::MockFaults {
        stall_after_tokens: Some(2),
        ..Default::default()
    };
    let mock = start_mock(8, 0, faults, Default::default());
    let mut edge = Edge::start(payload(&mock, 1)).await;
    edge.send(Body::RunRequest(Box::new(pb::RunRequest {
        run_id: "s-1".into(),
        adapter: "ol".into(),
        target: TARGET.into(),
        input: Some(text_input()),
        response_stall_timeout_ms: 300,
        ..Default::default()
    })));
    let events = edge.run_events("s-1").await;
    assert_eq!(text(&events), "tok0 tok1 ");
    let last = events.last().expect("terminal");
    assert_eq!(last.r#type(), pb::RunEventType::Error);
    assert_eq!(last.failure_code, "response_stalled");
    let f = last.failure.clone().expect("ExecutionFailure on a stall");
    assert_eq!(
        f.provider_health,
        Some(pb::ProviderHealthEvidence {
            health: pb::ProviderHealth::Available as i32,
            liveness_classification: pb::LivenessClassification::RequestStalled as i32,
        })
    );
    assert!(f.idle_duration_ms >= 300, "idle {} ms", f.idle_duration_ms);
    assert_eq!((f.adapter.as_str(), f.target.as_str()), ("ol", TARGET));
    assert_eq!(f.health_observation_seq, Some(1));
    assert_eq!(edge.adapter_in_flight("ol").await, 0);
}

// CONTRACT: P4 — a normalized run and a tunnel on one adapter contend for
// its one gate: with capacity 1, a streaming run in progress makes a tunnel
// to the same adapter fail `capacity_exhausted` (and a tunnel in progress
// does the same to a run), while another adapter is untouched. The legacy
// node-wide `NodeRuntimeConfig.concurrency = 1` gates nothing: both
// adapters serve at once.
#[monoio::test(timer_enabled = true)]
async fn runs_and_tunnels_share_their_adapters_one_gate() {
    // The first token at once, the next a minute later: a held stream
    // sends nothing while the test looks at the gate.
    let mock = start_mock(400, 60_000, Default::default(), Default::default());
    let mut config = payload(&mock, 1);
    config.runtime = Some(pb::NodeRuntimeConfig {
        concurrency: 1,
        ..common::runtime()
    });
    let mut edge = Edge::start(config).await;
    let chat = |run_id: &str, stream: bool| pb::ProviderTunnelRequest {
        adapter: "oa".into(),
        ..common::chat_tunnel(
            run_id,
            format!(
                r#"{{"model":"{TARGET}","stream":{stream},"max_tokens":1,"messages":[{{"role":"user","content":"hi"}}]}}"#
            ),
        )
    };
    // A run holds `oa`'s one slot.
    edge.send(run("held-run", "oa", text_input()));
    assert_eq!(edge.recv_event().await.r#type(), pb::RunEventType::Start);
    assert_eq!(edge.recv_event().await.delta, "tok0 ");
    assert_eq!(edge.adapter_in_flight("oa").await, 1);
    // A tunnel to the same adapter is refused at once …
    let refused = edge.tunnel(chat("t-refused", false)).await;
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].kind(), pb::TunnelFrameKind::Error);
    assert_eq!(refused[0].failure_code, "capacity_exhausted");
    // … and the other adapter serves beside it: concurrency = 1 is no
    // node-wide gate.
    edge.send(run(
        "other-adapter",
        "ol",
        pb::RunInput {
            max_tokens: Some(1),
            ..text_input()
        },
    ));
    let mut other = Vec::new();
    while other.last().map(|e: &pb::RunEvent| e.r#type()) != Some(pb::RunEventType::Complete) {
        let e = edge.recv_event().await;
        if e.run_id == "other-adapter" {
            other.push(e);
        }
    }
    assert_eq!(text(&other), "tok0 ");
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "held-run".into(),
        reason: "client_disconnect".into(),
    }));
    while edge.recv_event().await.r#type() != pb::RunEventType::Cancelled {}
    assert_eq!(edge.adapter_in_flight("oa").await, 0);
    // The other way round: a streaming tunnel holds the slot, a run waits
    // for nothing and is refused.
    let mut stream = chat("t-held", true);
    stream.body = Bytes::from(format!(
        r#"{{"model":"{TARGET}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
    ));
    edge.send(Body::ProviderTunnelRequest(Box::new(stream)));
    assert_eq!(
        edge.recv_tunnel().await.kind(),
        pb::TunnelFrameKind::ResponseStart
    );
    edge.send(run("refused-run", "oa", text_input()));
    let refused = loop {
        match edge.recv().await.body {
            Some(Body::RunEvent(e)) => break e,
            Some(Body::ProviderTunnelFrame(f)) => assert_eq!(f.run_id, "t-held"),
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(
        (
            refused.run_id.as_str(),
            refused.r#type(),
            refused.failure_code.as_str()
        ),
        ("refused-run", pb::RunEventType::Error, "capacity_exhausted")
    );
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "t-held".into(),
        reason: "client_disconnect".into(),
    }));
    loop {
        let f = edge.recv_tunnel().await;
        if common::is_tunnel_terminal(f.kind()) {
            break;
        }
    }
    assert_eq!(edge.adapter_in_flight("oa").await, 0);
}

// CONTRACT: E3 — metadata is caller-defined and never a control surface,
// and runs sharing a `session_id` stay independent: a run whose metadata
// names control fields (run id, adapter, target, session, directories)
// runs as its own fields say, and cancelling one run of a session leaves
// the other run of that session to finish whole.
#[monoio::test(timer_enabled = true)]
async fn metadata_is_inert_and_runs_sharing_a_session_are_independent() {
    // `oa` on a mock that sends one token and then nothing for a minute;
    // `ol` on one that answers three tokens at once.
    let slow = start_mock(400, 60_000, Default::default(), Default::default());
    let fast = plain_mock(3);
    let mut config = payload(&slow, 1);
    config.adapters[0] = ollama_adapter("ol", 1, vec![TARGET.into()], &fast);
    let mut edge = Edge::start(config).await;
    let metadata: HashMap<String, String> = [
        ("run_id", "victim"),
        ("adapter", "ol"),
        ("target", "elsewhere"),
        ("session_id", "sess-other"),
        ("working_directory", "/etc"),
        ("session_owner", "attacker"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let with = |run_id: &str, adapter: &str, max_tokens: Option<i64>| {
        Body::RunRequest(Box::new(pb::RunRequest {
            run_id: run_id.into(),
            adapter: adapter.into(),
            target: TARGET.into(),
            input: Some(pb::RunInput {
                max_tokens,
                ..text_input()
            }),
            session_id: "sess-1".into(),
            metadata: metadata.clone(),
            ..Default::default()
        }))
    };
    // Run A holds `oa` (one token, then a minute of nothing).
    edge.send(with("run-a", "oa", None));
    let start = edge.recv_event().await;
    assert_eq!(
        (
            start.run_id.as_str(),
            start.r#type(),
            start.adapter.as_str()
        ),
        ("run-a", pb::RunEventType::Start, "oa")
    );
    assert_eq!(start.target, TARGET);
    assert_eq!(start.session_id, "sess-1", "an opaque correlation value");
    assert_eq!(edge.recv_event().await.delta, "tok0 ");
    // Run B of the same session, on `ol`.
    edge.send(with("run-b", "ol", None));
    // Cancelling A (by its run id) touches A only.
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "run-a".into(),
        reason: "client_disconnect".into(),
    }));
    let mut a = Vec::new();
    let mut b = Vec::new();
    while !(a.last().is_some_and(is_terminal) && b.last().is_some_and(is_terminal)) {
        let e = edge.recv_event().await;
        match e.run_id.as_str() {
            "run-a" => a.push(e),
            "run-b" => b.push(e),
            other => panic!("an event of {other}: {e:?}"),
        }
    }
    assert_eq!(
        a.last().map(|e| e.r#type()),
        Some(pb::RunEventType::Cancelled)
    );
    assert_eq!(b.first().map(|e| e.r#type()), Some(pb::RunEventType::Start));
    assert_eq!(
        b.last().map(|e| e.r#type()),
        Some(pb::RunEventType::Complete)
    );
    assert!(b
        .iter()
        .all(|e| e.adapter == "ol" && e.session_id == "sess-1"));
    assert_eq!(text(&b), "tok0 tok1 tok2 ");
    assert_eq!(edge.adapter_in_flight("oa").await, 0);
    assert_eq!(edge.adapter_in_flight("ol").await, 0);
}

fn is_terminal(e: &pb::RunEvent) -> bool {
    matches!(
        e.r#type(),
        pb::RunEventType::Complete | pb::RunEventType::Error | pb::RunEventType::Cancelled
    )
}
