//! The Edge's observation log events and metrics, proven downstream in the
//! real shell (O1, H3): an Edge served in process over real mTLS and real
//! client sockets, hand-driven nodes that answer tunnels with scripted
//! terminals, and a global `tracing` layer that captures every event (and
//! span) with all its fields, name → value.
//!
//! The layer is global because the Edge may run on other threads; every
//! test holds [`serial`] so that `cargo test`, which runs the tests of a
//! binary on threads of one process, never mixes two tests' events (nextest
//! gives each test a process of its own anyway).
//!
//! What is proven:
//! - H3: a validated, current, bound stall — fresh or sequence-stale — is
//!   routed out of the shell with `provider_id`, the validated
//!   `provider_health` and `recovery_handoff=confirmed`; unbound, mismatched
//!   or malformed evidence gets no handoff; no event ever says
//!   `recovery_eligible`.
//! - O1: `edge_provider_health_observation` (ejection, readmission, overlay
//!   transitions both ways) and `edge_liveness_recovery_observation` (stall
//!   handoff, failover) are emitted after Control's decision is final — at
//!   emission the lease is already released, the counter already moved, the
//!   overlay or ejection already in place — each with exactly the fields of
//!   an allowlist read off `edge_bin::link::edge`; no captured event at any level
//!   and no `/metrics` label carries the run id, the client's request id, the
//!   API key, the caller's identity, the prompt or the Node-owned ids.

mod common;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::{Mutex, MutexGuard, Once};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use edge_bin::control::ProviderKey;
use edge_bin::link::edge::Edge;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

// ---------------------------------------------------------------------------
// What the client and the node send that must never reach a log or a label

/// The client's API key (a configured `[[client_keys]]` entry).
const API_KEY: &str = "sk-obs-5f1c9a7e2d4b8c60-secret";
/// The principal the key authenticates: a caller identity.
const PRINCIPAL: &str = "obs-principal-a81f";
/// The client's own request id header.
const CLIENT_REQUEST_ID: &str = "client-req-3e7b91d0c2";
/// The caller identity in the body's `user` field.
const CALLER: &str = "caller-7c4e2a19@example.test";
/// The prompt text.
const PROMPT: &str = "obs-prompt-f00dfacecafe tell me a secret";
/// Node-owned run and attempt ids carried in the stall evidence (W5).
const NODE_RUN_ID: &str = "node-run-9a8b7c6d";
const ATTEMPT_ID: &str = "attempt-1d2c3b4a";

/// The two contract log events (O1).
const HEALTH_OBSERVATION: &str = "edge_provider_health_observation";
const RECOVERY_OBSERVATION: &str = "edge_liveness_recovery_observation";

/// A model served by both nodes, node-a first.
const BOTH: &str = "both-nodes";

/// The fields each observation event may carry, by message, read off
/// `edge_bin::link::edge` (`Action::StallHandoff` and `log_event`). Any other
/// field fails the test.
fn allowlist(event: &str, message: &str) -> Option<&'static [&'static str]> {
    let fields: &'static [&'static str] = match (event, message) {
        (RECOVERY_OBSERVATION, "stalled request handed off") => &[
            "event",
            "message",
            "provider_id",
            "provider_health",
            "recovery_handoff",
        ],
        (
            RECOVERY_OBSERVATION,
            "attempt failed before the first byte; retried on another provider",
        ) => &["event", "message", "from", "to", "attempt"],
        (HEALTH_OBSERVATION, "provider ejected: failing, out of rotation") => &[
            "event",
            "message",
            "provider",
            "reason",
            "consecutive_failures",
            "ejection_ms",
        ],
        (HEALTH_OBSERVATION, "provider re-admitted into rotation") => {
            &["event", "message", "provider", "via"]
        }
        (HEALTH_OBSERVATION, "provider health overlay changed") => {
            &["event", "message", "provider", "unavailable"]
        }
        _ => return None,
    };
    Some(fields)
}

// ---------------------------------------------------------------------------
// Capture

/// Control's state when an observation event was emitted (read on the
/// Edge's thread from inside the event).
#[derive(Debug, Clone, PartialEq, Eq)]
struct AtEmission {
    leases: usize,
    evidence_accepted: u64,
    overlaid_a: bool,
    ejected: usize,
}

/// One captured event or span record.
#[derive(Debug, Clone)]
struct Captured {
    level: tracing::Level,
    target: String,
    /// `span` for span attributes and records.
    kind: &'static str,
    fields: BTreeMap<String, String>,
    /// Taken for the observation events only: `None` off the Edge's thread,
    /// `Err` when Control was borrowed (its decision still under way).
    at_emission: Option<Result<AtEmission, ()>>,
}

impl Captured {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }

    fn event(&self) -> Option<&str> {
        self.field("event")
    }

    fn message(&self) -> &str {
        self.field("message").unwrap_or("")
    }
}

static CAPTURED: Mutex<Vec<Captured>> = Mutex::new(Vec::new());
static SERIAL: Mutex<()> = Mutex::new(());

thread_local! {
    /// The Edge under test, for [`AtEmission`].
    static PROBE: RefCell<Option<Rc<Edge>>> = const { RefCell::new(None) };
}

#[derive(Default)]
struct FieldMap(BTreeMap<String, String>);

impl Visit for FieldMap {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
}

fn provider_a() -> ProviderKey {
    ProviderKey {
        node_id: "node-a".into(),
        provider_id: "a-mock".into(),
    }
}

fn at_emission() -> Option<Result<AtEmission, ()>> {
    PROBE.with(|probe| {
        let probe = probe.borrow();
        let edge = probe.as_ref()?;
        // `Edge::control` panics while Control is borrowed for a decision.
        Some(
            catch_unwind(AssertUnwindSafe(|| {
                let control = edge.control();
                AtEmission {
                    leases: control.leases().count(),
                    evidence_accepted: control.counters().health_evidence_accepted,
                    overlaid_a: control.is_overlaid(&provider_a()),
                    ejected: control.ejected_count(),
                }
            }))
            .map_err(|_| ()),
        )
    })
}

/// Captures every event and span record of every thread.
struct Capture;

impl Capture {
    fn push(&self, captured: Captured) {
        CAPTURED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(captured);
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = FieldMap::default();
        event.record(&mut fields);
        let observation = fields
            .0
            .get("event")
            .is_some_and(|e| e == HEALTH_OBSERVATION || e == RECOVERY_OBSERVATION);
        self.push(Captured {
            level: *event.metadata().level(),
            target: event.metadata().target().to_string(),
            kind: "event",
            fields: fields.0,
            at_emission: if observation { at_emission() } else { None },
        });
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        let mut fields = FieldMap::default();
        attrs.record(&mut fields);
        fields
            .0
            .insert("span".into(), attrs.metadata().name().to_string());
        self.push(Captured {
            level: *attrs.metadata().level(),
            target: attrs.metadata().target().to_string(),
            kind: "span",
            fields: fields.0,
            at_emission: None,
        });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let mut fields = FieldMap::default();
        values.record(&mut fields);
        let (level, target) = ctx
            .metadata(id)
            .map(|m| (*m.level(), m.target().to_string()))
            .unwrap_or((tracing::Level::TRACE, String::new()));
        self.push(Captured {
            level,
            target,
            kind: "span",
            fields: fields.0,
            at_emission: None,
        });
    }
}

/// Installs the capture layer (once per process) and serializes the tests;
/// what earlier tests captured is cleared.
fn serial() -> MutexGuard<'static, ()> {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let subscriber = tracing_subscriber::registry().with(Capture);
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
    });
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    captured_clear();
    guard
}

fn captured_clear() {
    CAPTURED.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

fn captured() -> Vec<Captured> {
    CAPTURED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

fn observations() -> Vec<Captured> {
    captured()
        .into_iter()
        .filter(|c| matches!(c.event(), Some(HEALTH_OBSERVATION | RECOVERY_OBSERVATION)))
        .collect()
}

fn handoffs() -> Vec<Captured> {
    observations()
        .into_iter()
        .filter(|c| c.message() == "stalled request handed off")
        .collect()
}

/// Points [`AtEmission`] at `edge` until dropped.
struct Probe;

impl Probe {
    fn install(edge: &Rc<Edge>) -> Self {
        PROBE.with(|p| *p.borrow_mut() = Some(edge.clone()));
        Probe
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        PROBE.with(|p| *p.borrow_mut() = None);
    }
}

// ---------------------------------------------------------------------------
// Client and nodes

fn edge_toml_with(pki: &Pki, outlier: &str) -> String {
    let key_hash = blake3::hash(API_KEY.as_bytes()).to_hex();
    let options = EdgeOptions {
        extra_toml: format!(
            "[[models]]\nname = \"{BOTH}\"\nproviders = [\"node-a/a-mock\", \"node-b/b-mock\"]\n\n\
             [[client_keys]]\nprincipal = \"{PRINCIPAL}\"\nkey_hash = \"{key_hash}\"\n\n\
             [outlier_detection]\n{outlier}\n"
        ),
        ..EdgeOptions::without_provider()
    };
    edge_toml(pki, &options)
}

/// A streamed chat request for `model` carrying every secret: the API key,
/// the client's request id, the caller in `user`, the prompt.
fn secret_request(model: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "model": model,
        "stream": true,
        "user": CALLER,
        "messages": [{"role": "user", "content": PROMPT}],
    })
    .to_string();
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
         authorization: Bearer {API_KEY}\r\nx-request-id: {CLIENT_REQUEST_ID}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

async fn send(node: &RawNode, frames: Vec<pb::ProviderTunnelFrame>) {
    for f in frames {
        node.conn
            .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(f))))
            .await
            .expect("send");
    }
}

/// A stall terminal's structured failure with this evidence and sequence.
fn stall_failure(
    health: pb::ProviderHealth,
    classification: pb::LivenessClassification,
    seq: Option<u64>,
) -> pb::ExecutionFailure {
    pb::ExecutionFailure {
        failure_code: "response_stalled".into(),
        provider_health: Some(pb::ProviderHealthEvidence {
            health: health as i32,
            liveness_classification: classification as i32,
        }),
        idle_duration_ms: 120_000,
        node_run_id: NODE_RUN_ID.into(),
        attempt_id: ATTEMPT_ID.into(),
        fence: pb::Fence::Confirmed as i32,
        adapter: ADAPTER.into(),
        target: TARGET.into(),
        health_observation_seq: seq,
    }
}

/// Polls until Control holds no lease.
async fn wait_no_leases(edge: &TestEdge) {
    while edge.edge.control().leases().count() > 0 {
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One secret-carrying request for [`MODEL`], answered by node-a with a
/// head, one body piece (committed) and a stall terminal with `failure` and
/// the frame's adapter evidence `target`. Returns the run id; the lease is
/// released when it returns.
async fn stalled_request(
    edge: &TestEdge,
    node: &mut RawNode,
    failure: pb::ExecutionFailure,
    target: &str,
) -> String {
    let client_addr = edge.client_addr;
    let client =
        monoio::spawn(async move { http_exchange(client_addr, secret_request(MODEL)).await });
    let request = next_tunnel(node).await;
    let mut start = tunnel_frame(&request.run_id, 1, pb::TunnelFrameKind::ResponseStart);
    start.status = 200;
    start.headers = vec![pb::Header {
        name: "content-type".into(),
        value: Bytes::from_static(b"text/event-stream"),
    }];
    let mut body = tunnel_frame(&request.run_id, 2, pb::TunnelFrameKind::Body);
    body.body = Bytes::from_static(b"data: {\"tok\":0}\n\n");
    let mut stall = tunnel_frame(&request.run_id, 3, pb::TunnelFrameKind::Error);
    stall.error = "no progress".into();
    stall.failure_code = "response_stalled".into();
    stall.target = target.into();
    stall.failure = Some(Box::new(failure));
    send(node, vec![start, body, stall]).await;
    let response = client.await;
    assert_eq!(response.status, 200, "{response:?}");
    let text = String::from_utf8(response.body).expect("UTF-8 stream");
    assert!(text.starts_with("data: {\"tok\":0}\n\n"), "{text}");
    assert!(text.contains("\"code\":\"response_stalled\""), "{text}");
    wait_no_leases(edge).await;
    request.run_id
}

// ---------------------------------------------------------------------------
// Checks shared by the tests

/// Every observation event has exactly an allowlisted field set, was
/// emitted on the Edge's thread once Control's decision was taken, and
/// nothing says `recovery_eligible`.
fn check_observation_fields() {
    let all = captured();
    for c in &all {
        assert!(
            !c.fields
                .iter()
                .any(|(k, v)| k.contains("recovery_eligible") || v.contains("recovery_eligible")),
            "H3: no event says recovery_eligible: {c:?}"
        );
        let Some(event) = c.event() else { continue };
        if event != HEALTH_OBSERVATION && event != RECOVERY_OBSERVATION {
            continue;
        }
        let allowed = allowlist(event, c.message())
            .unwrap_or_else(|| panic!("O1: an observation event no allowlist knows: {c:?}"));
        let names: BTreeSet<&str> = c.fields.keys().map(String::as_str).collect();
        let allowed: BTreeSet<&str> = allowed.iter().copied().collect();
        assert_eq!(names, allowed, "O1: fields of {c:?}"); // CONTRACT: O1
        assert!(
            matches!(c.at_emission, Some(Ok(_))),
            "O1: emitted on the Edge's thread after the decision, with Control free: {c:?}"
        );
    }
}

/// No captured event or span at any level carries a secret or an unbounded
/// id, nor a field named for one.
fn check_no_secret_in_logs(run_ids: &[String]) {
    let all = captured();
    assert!(!all.is_empty(), "the layer captured the Edge's events");
    let mut needles: Vec<&str> = vec![
        API_KEY,
        PRINCIPAL,
        CLIENT_REQUEST_ID,
        CALLER,
        PROMPT,
        "obs-prompt-f00dfacecafe",
        NODE_RUN_ID,
        ATTEMPT_ID,
    ];
    needles.extend(run_ids.iter().map(String::as_str));
    let key_hash = blake3::hash(API_KEY.as_bytes()).to_hex().to_string();
    needles.push(&key_hash);
    for c in &all {
        for (name, value) in &c.fields {
            for needle in &needles {
                assert!(
                    !value.contains(needle),
                    "O1: field {name} of a {} {} from {} carries {needle:?}: {c:?}",
                    c.level,
                    c.kind,
                    c.target
                );
            }
            assert!(
                !matches!(
                    name.as_str(),
                    "request" | "request_id" | "run_id" | "principal" | "api_key" | "user"
                ),
                "O1: no field names a request, run or caller: {c:?}"
            );
        }
    }
}

/// `/metrics` carries none of the secrets anywhere, and every label is
/// one of the bounded ones with a plain value.
async fn check_metrics(addr: std::net::SocketAddr, run_ids: &[String]) -> String {
    let response = http_request(addr, "GET", "/metrics", b"").await;
    assert_eq!(response.status, 200);
    let text = String::from_utf8(response.body).expect("metrics are UTF-8");
    let mut needles = vec![
        API_KEY,
        PRINCIPAL,
        CLIENT_REQUEST_ID,
        CALLER,
        PROMPT,
        NODE_RUN_ID,
        ATTEMPT_ID,
    ];
    needles.extend(run_ids.iter().map(String::as_str));
    for needle in needles {
        assert!(
            !text.contains(needle),
            "O1: /metrics carries {needle:?}:\n{text}"
        );
    }
    // Fixed lists, or names from the configuration (model, node,
    // provider, adapter).
    let bounded: BTreeSet<&str> = [
        "result", "to", "source", "eligible", "reason", "via", "le", "route", "model", "code",
        "kind", "node", "provider", "adapter", "version", "commit", "policy",
    ]
    .into();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((_, labels)) = line.split_once('{') else {
            continue;
        };
        let (labels, _) = labels.split_once('}').expect("labels close");
        for pair in labels.split(',') {
            let (name, value) = pair.split_once('=').expect("name=value");
            assert!(
                bounded.contains(name),
                "O1: unbounded label {name} in {line}"
            ); // CONTRACT: O1
            let value = value.trim_matches('"');
            assert!(
                value == "+Inf"
                    || value.bytes().all(|b| b.is_ascii_lowercase()
                        || b.is_ascii_digit()
                        || b"_.-".contains(&b)),
                "O1: label value {value:?} in {line}"
            );
        }
    }
    text
}

fn sample(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .expect("a number")
}

// ---------------------------------------------------------------------------
// Tests

// CONTRACT: O1, H3 — stall terminals from a scripted node through the real
// shell: (1) fresh validated current bound evidence and (2) sequence-stale
// request-local evidence get the confirmed handoff event with the
// provider id and the validated health; unbound, mismatched and malformed
// evidence get none; (4) a fresh `unavailable` stall sets the overlay and a
// CAPABILITIES answer clears it, both as health observation events. Every
// observation event is allowlisted and emitted after the decision; no
// secret or unbounded id reaches a log or a metric label.
#[monoio::test_all(timer_enabled = true)]
// The guard of `serial` only serializes this binary's tests: no task takes it.
#[allow(clippy::await_holding_lock)]
async fn validated_stalls_are_handed_off_confirmed_and_logged_without_identifiers() {
    let _serial = serial();
    let pki = Pki::mint("observations-stall");
    guarded(async {
        // Stalls count as failures: keep passive health out of this test.
        let edge = TestEdge::start(&pki, &edge_toml_with(&pki, "enabled = false"));
        let probe = Probe::install(&edge.edge);
        let mut node = ready_node(&edge, &pki, "node-a").await;
        let mut run_ids = Vec::new();
        use pb::LivenessClassification as L;
        use pb::ProviderHealth as H;

        // (1) Fresh, validated, current, bound: a confirmed handoff.
        let run = stalled_request(
            &edge,
            &mut node,
            stall_failure(H::Available, L::RequestStalled, Some(5)),
            TARGET,
        )
        .await;
        run_ids.push(run);
        let after_fresh = handoffs();
        assert_eq!(after_fresh.len(), 1, "{after_fresh:?}");
        let h = &after_fresh[0];
        // CONTRACT: H3
        assert_eq!(
            (
                h.field("provider_id"),
                h.field("provider_health"),
                h.field("recovery_handoff")
            ),
            (
                Some("a-mock"),
                Some("PROVIDER_HEALTH_AVAILABLE"),
                Some("confirmed")
            )
        );
        // CONTRACT: O1 — emitted once the terminal was decided: its lease
        // already released, its evidence already counted.
        assert_eq!(
            h.at_emission,
            Some(Ok(AtEmission {
                leases: 0,
                evidence_accepted: 1,
                overlaid_a: false,
                ejected: 0,
            }))
        );

        // (2) Sequence-stale (3 < 5), still a request-local handoff.
        let run = stalled_request(
            &edge,
            &mut node,
            stall_failure(H::Unknown, L::HealthUnknown, Some(3)),
            TARGET,
        )
        .await;
        run_ids.push(run);
        let after_stale = handoffs();
        assert_eq!(after_stale.len(), 2, "{after_stale:?}");
        let h = &after_stale[1];
        // CONTRACT: H3
        assert_eq!(
            (
                h.field("provider_id"),
                h.field("provider_health"),
                h.field("recovery_handoff")
            ),
            (
                Some("a-mock"),
                Some("PROVIDER_HEALTH_UNKNOWN"),
                Some("confirmed")
            )
        );
        assert_eq!(
            h.at_emission.as_ref().map(|a| a.as_ref().map(|a| a.evidence_accepted)),
            Some(Ok(2))
        );

        // Not validated: unbound (no sequence), adapter evidence that does
        // not match the lease, a malformed health/classification pair. No
        // handoff for any of them.
        for (failure, target) in [
            (stall_failure(H::Available, L::RequestStalled, None), TARGET),
            (
                stall_failure(H::Available, L::RequestStalled, Some(6)),
                "other-target",
            ),
            (
                stall_failure(H::Available, L::ProviderUnhealthy, Some(7)),
                TARGET,
            ),
        ] {
            let run = stalled_request(&edge, &mut node, failure, target).await;
            run_ids.push(run);
            assert_eq!(handoffs().len(), 2, "H3: no handoff without validation");
        }
        let c = edge.edge.control().counters().clone();
        assert_eq!(
            (c.health_evidence_accepted, c.health_evidence_rejected),
            (2, 3)
        );
        assert!(observations().iter().all(|o| o.event() == Some(RECOVERY_OBSERVATION)));

        // (4) A fresh unavailable observation: a handoff, then the overlay.
        let run = stalled_request(
            &edge,
            &mut node,
            stall_failure(H::Unavailable, L::ProviderUnhealthy, Some(8)),
            TARGET,
        )
        .await;
        run_ids.push(run);
        let seen = observations();
        let tail: Vec<_> = seen[seen.len() - 2..].to_vec();
        // CONTRACT: H3
        assert_eq!(
            (
                tail[0].message(),
                tail[0].field("provider_health"),
                tail[0].field("recovery_handoff")
            ),
            (
                "stalled request handed off",
                Some("PROVIDER_HEALTH_UNAVAILABLE"),
                Some("confirmed")
            )
        );
        assert_eq!(
            (
                tail[1].event(),
                tail[1].field("provider"),
                tail[1].field("unavailable")
            ),
            (Some(HEALTH_OBSERVATION), Some("node-a/a-mock"), Some("true"))
        );
        // CONTRACT: O1 — the overlay was set before either event.
        for o in &tail {
            assert_eq!(
                o.at_emission.as_ref().map(|a| a.as_ref().map(|a| a.overlaid_a)),
                Some(Ok(true)),
                "{o:?}"
            );
        }
        assert_eq!(handoffs().len(), 3);

        // The Edge probes the overlaid provider (every 5 s); a fresh
        // `available` answer clears the overlay.
        let command = loop {
            match node.next_frame().await {
                Body::NodeCommandRequest(c) => break c,
                Body::FlowCredit(_) => {}
                other => panic!("expected the recovery probe, got {other:?}"),
            }
        };
        assert_eq!(command.r#type, pb::CommandType::Capabilities as i32);
        node.conn
            .send_control(frame(Body::NodeCommandResponse(Box::new(pb::NodeCommandResponse {
                command_id: command.command_id,
                ok: true,
                capabilities: vec![pb::AdapterCapability {
                    adapter_key: ADAPTER.into(),
                    target: TARGET.into(),
                    provider_status: pb::ProviderHealth::Available as i32,
                    health_observation_seq: Some(9),
                    adapter: "openai_compat".into(),
                    instance_key: ADAPTER.into(),
                }],
                ..Default::default()
            }))))
            .expect("send the probe answer");
        while edge.edge.control().is_overlaid(&provider_a()) {
            monoio::time::sleep(Duration::from_millis(5)).await;
        }
        let last = observations().pop().expect("the recovery event");
        assert_eq!(
            (last.event(), last.field("provider"), last.field("unavailable")),
            (Some(HEALTH_OBSERVATION), Some("node-a/a-mock"), Some("false"))
        );
        // CONTRACT: O1 — logged once the overlay was cleared.
        assert_eq!(
            last.at_emission
                .as_ref()
                .map(|a| a.as_ref().map(|a| a.overlaid_a)),
            Some(Ok(false))
        );

        check_observation_fields();
        check_no_secret_in_logs(&run_ids);
        let text = check_metrics(edge.client_addr, &run_ids).await;
        for (series, value) in [
            ("iop_edge_provider_health_evidence_total{result=\"accepted\"}", 3),
            ("iop_edge_provider_health_evidence_total{result=\"rejected\"}", 3),
            ("iop_edge_provider_health_transitions_total{to=\"unavailable\"}", 1),
            ("iop_edge_provider_health_transitions_total{to=\"available\"}", 1),
            (
                "iop_edge_liveness_recovery_eligibility_total{source=\"stall_handoff\",eligible=\"true\"}",
                3,
            ),
        ] {
            assert_eq!(sample(&text, series), value, "{series}"); // CONTRACT: O1
        }
        drop(probe);
        edge.stop().await;
    })
    .await;
}

// CONTRACT: O1 — (3) a provider that fails before the first byte is
// ejected and the request fails over to the other node; the timer
// re-admits it. The ejection, the failover and the readmission are logged
// as observation events with allowlisted fields only, each after Control's
// decision, and no secret or unbounded id reaches a log or a metric label.
#[monoio::test_all(timer_enabled = true)]
// The guard of `serial` only serializes this binary's tests: no task takes it.
#[allow(clippy::await_holding_lock)]
async fn ejection_failover_and_readmission_are_logged_without_identifiers() {
    let _serial = serial();
    let pki = Pki::mint("observations-eject");
    guarded(async {
        let edge = TestEdge::start(
            &pki,
            &edge_toml_with(
                &pki,
                "consecutive_failures = 1\nbase_ejection_time_ms = 300\nmax_ejection_percent = 50",
            ),
        );
        let probe = Probe::install(&edge.edge);
        let mut a = ready_node(&edge, &pki, "node-a").await;
        let mut b = ready_node(&edge, &pki, "node-b").await;
        let client_addr = edge.client_addr;
        let client =
            monoio::spawn(async move { http_exchange(client_addr, secret_request(BOTH)).await });
        // Ties go to the first listed provider: node-a, which is unreachable.
        let first = next_tunnel(&mut a).await;
        let mut refused = tunnel_frame(&first.run_id, 1, pb::TunnelFrameKind::Error);
        refused.error = "connect: connection refused".into();
        refused.failure_code = "provider_unreachable".into();
        send(&a, vec![refused]).await;
        let retry = next_tunnel(&mut b).await;
        let mut start = tunnel_frame(&retry.run_id, 1, pb::TunnelFrameKind::ResponseStart);
        start.status = 200;
        start.headers = vec![pb::Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"text/event-stream"),
        }];
        let mut body = tunnel_frame(&retry.run_id, 2, pb::TunnelFrameKind::Body);
        body.body = Bytes::from_static(b"data: from-b\n\ndata: [DONE]\n\n");
        let end = tunnel_frame(&retry.run_id, 3, pb::TunnelFrameKind::End);
        send(&b, vec![start, body, end]).await;
        let response = client.await;
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(
            String::from_utf8(response.body).unwrap(),
            "data: from-b\n\ndata: [DONE]\n\n"
        );
        wait_no_leases(&edge).await;
        // The ejection ends on its timer.
        while edge.edge.control().ejected_count() > 0 {
            monoio::time::sleep(Duration::from_millis(5)).await;
        }
        let seen = observations();
        let summary: Vec<(&str, &str)> = seen
            .iter()
            .map(|o| (o.event().unwrap_or(""), o.message()))
            .collect();
        assert_eq!(
            summary,
            vec![
                (HEALTH_OBSERVATION, "provider ejected: failing, out of rotation"),
                (
                    RECOVERY_OBSERVATION,
                    "attempt failed before the first byte; retried on another provider"
                ),
                (HEALTH_OBSERVATION, "provider re-admitted into rotation"),
            ]
        );
        let (ejected, failover, readmitted) = (&seen[0], &seen[1], &seen[2]);
        assert_eq!(
            (
                ejected.field("provider"),
                ejected.field("reason"),
                ejected.field("consecutive_failures"),
                ejected.field("ejection_ms")
            ),
            (
                Some("node-a/a-mock"),
                Some("connect_failure"),
                Some("1"),
                Some("300")
            )
        );
        assert_eq!(
            (
                failover.field("from"),
                failover.field("to"),
                failover.field("attempt")
            ),
            (Some("node-a/a-mock"), Some("node-b/b-mock"), Some("2"))
        );
        assert_eq!(
            (readmitted.field("provider"), readmitted.field("via")),
            (Some("node-a/a-mock"), Some("timer"))
        );
        // CONTRACT: O1 — each after its decision: ejected before the
        // ejection and failover events (the retry's lease already taken),
        // back in rotation before the readmission event.
        let state = |o: &Captured| o.at_emission.clone().and_then(Result::ok).map(|a| (a.ejected, a.leases));
        assert_eq!(
            [state(ejected), state(failover), state(readmitted)],
            [Some((1, 1)), Some((1, 1)), Some((0, 0))]
        );
        check_observation_fields();
        let run_ids = vec![first.run_id.clone(), retry.run_id.clone()];
        check_no_secret_in_logs(&run_ids);
        let text = check_metrics(edge.client_addr, &run_ids).await;
        for (series, value) in [
            ("iop_edge_provider_ejections_total{reason=\"connect_failure\"}", 1),
            ("iop_edge_provider_readmissions_total{via=\"timer\"}", 1),
            (
                "iop_edge_liveness_recovery_results_total{source=\"failover\",result=\"retried\"}",
                1,
            ),
            (
                "iop_edge_liveness_recovery_results_total{source=\"failover\",result=\"recovered\"}",
                1,
            ),
        ] {
            assert_eq!(sample(&text, series), value, "{series}"); // CONTRACT: O1
        }
        drop(probe);
        edge.stop().await;
    })
    .await;
}
