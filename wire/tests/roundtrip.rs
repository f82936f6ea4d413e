//! Round trips of every `Frame` body through the codec, the field numbers the
//! contract fixes, zero-copy decoding of body bytes, and the split encoding of
//! tunnel `BODY` frames ([`codec::BodyFrameHead`]).
//!
//! "Every field populated" is checked, not assumed: proto3 leaves default
//! values off the wire, so [`FieldAudit`] walks the encoded bytes of each
//! message and compares the field numbers present with the field numbers the
//! schema file declares for that message.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bytes::{Bytes, BytesMut};
use iop_wire::codec::{
    self, BodyFrameHead, BodyParts, EncodeError, FrameDecoder, Inbound, RequestFrameHead,
    TunnelChunk,
};
use iop_wire::limits::{DEFAULT_MAX_FRAME_BYTES, LENGTH_PREFIX_BYTES};
use iop_wire::pb::{self, frame::Body};
use prost::Message;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Encodes `frame` with the codec and decodes it with a fresh decoder; checks
/// that exactly one frame comes out and no byte is left over.
fn codec_roundtrip(frame: &pb::Frame) -> pb::Frame {
    let mut wire = BytesMut::new();
    assert_eq!(codec::encode(frame, &mut wire), Ok(()));
    let announced = u32::from_be_bytes([wire[0], wire[1], wire[2], wire[3]]) as usize;
    assert_eq!(announced, frame.encoded_len());
    assert_eq!(wire.len(), LENGTH_PREFIX_BYTES + announced);

    let mut decoder = FrameDecoder::new();
    decoder.feed(&wire);
    let decoded = match decoder.decode() {
        Ok(Some(decoded)) => decoded,
        other => panic!("expected one frame, got {other:?}"),
    };
    assert_eq!(decoder.decode(), Ok(None));
    assert_eq!(decoder.buffered_bytes(), 0);
    decoded
}

/// Decodes `frame_bytes` (a protobuf `Frame` without prefix) through the
/// decoder, adding the length prefix.
fn decode_raw_frame(frame_bytes: &[u8]) -> pb::Frame {
    let mut wire = Vec::with_capacity(LENGTH_PREFIX_BYTES + frame_bytes.len());
    wire.extend_from_slice(&(frame_bytes.len() as u32).to_be_bytes());
    wire.extend_from_slice(frame_bytes);
    let mut decoder = FrameDecoder::new();
    decoder.feed(&wire);
    match decoder.decode() {
        Ok(Some(frame)) => frame,
        other => panic!("expected one frame, got {other:?}"),
    }
}

/// A length-delimited field: key for `field` with wire type 2, then length
/// and payload. Payloads here stay below 128 bytes (one-byte length).
fn ld_field(field: u8, payload: &[u8]) -> Vec<u8> {
    assert!(field < 16 && payload.len() < 128);
    let mut out = vec![(field << 3) | 2, payload.len() as u8];
    out.extend_from_slice(payload);
    out
}

fn map(entries: &[(&str, &str)]) -> HashMap<String, String> {
    entries
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

// ---------------------------------------------------------------------------
// Field audit against the schema file
// ---------------------------------------------------------------------------

/// The field numbers of one schema message.
#[derive(Debug, Default)]
struct SchemaMessage {
    /// Fields outside any `oneof`.
    plain: BTreeSet<u32>,
    /// Each `oneof` group's field numbers.
    oneofs: Vec<BTreeSet<u32>>,
}

/// Parses `proto/iop/runtime.proto` into message name → field numbers. The
/// schema has no nested messages; `oneof` blocks are tracked by brace depth.
fn parse_schema() -> BTreeMap<String, SchemaMessage> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto/iop/runtime.proto");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let mut messages = BTreeMap::new();
    let mut current: Option<(String, SchemaMessage)> = None;
    let mut in_oneof = false;
    for raw_line in text.lines() {
        let line = raw_line.split("//").next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("message ") {
            let name = rest.trim_end_matches('{').trim().to_owned();
            current = Some((name, SchemaMessage::default()));
            continue;
        }
        let Some((_, message)) = current.as_mut() else {
            continue;
        };
        if line.starts_with("oneof ") {
            in_oneof = true;
            message.oneofs.push(BTreeSet::new());
            continue;
        }
        if line == "}" {
            if in_oneof {
                in_oneof = false;
            } else if let Some((name, message)) = current.take() {
                messages.insert(name, message);
            }
            continue;
        }
        if line.starts_with("reserved") {
            // A retired number or name declares no field to set.
            continue;
        }
        if let Some((_, number)) = line.trim_end_matches(';').rsplit_once('=') {
            let number: u32 = number
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("field number in {line:?}: {e}"));
            if in_oneof {
                if let Some(group) = message.oneofs.last_mut() {
                    group.insert(number);
                }
            } else {
                message.plain.insert(number);
            }
        }
    }
    assert!(messages.len() > 30, "schema parse found too few messages");
    messages
}

/// Reads a base-128 varint.
fn read_varint(bytes: &[u8], pos: &mut usize) -> u64 {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = bytes[*pos];
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return value;
        }
    }
    panic!("varint longer than 10 bytes");
}

/// Top-level field numbers present in an encoded message (an independent
/// walk of the protobuf wire format, not prost's decoder).
fn present_fields(bytes: &[u8]) -> BTreeSet<u32> {
    let mut fields = BTreeSet::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let key = read_varint(bytes, &mut pos);
        fields.insert((key >> 3) as u32);
        match key & 7 {
            0 => {
                read_varint(bytes, &mut pos);
            }
            1 => pos += 8,
            2 => pos += read_varint(bytes, &mut pos) as usize,
            5 => pos += 4,
            other => panic!("unexpected wire type {other}"),
        }
    }
    assert_eq!(pos, bytes.len(), "message bytes end inside a field");
    fields
}

/// Checks that messages carry every schema field (plain fields all present,
/// exactly one member of each `oneof`), and records which messages it saw.
struct FieldAudit {
    schema: BTreeMap<String, SchemaMessage>,
    audited: BTreeSet<String>,
}

impl FieldAudit {
    fn new() -> Self {
        Self {
            schema: parse_schema(),
            audited: BTreeSet::new(),
        }
    }

    fn check<M: Message>(&mut self, name: &str, message: &M) {
        let schema = self
            .schema
            .get(name)
            .unwrap_or_else(|| panic!("message {name} is not in the schema"));
        let present = present_fields(&message.encode_to_vec());
        let mut expected = schema.plain.clone();
        for group in &schema.oneofs {
            let set: Vec<u32> = group.intersection(&present).copied().collect();
            assert_eq!(
                set.len(),
                1,
                "{name}: oneof {group:?} has members {set:?} set"
            );
            expected.extend(set);
        }
        assert_eq!(present, expected, "{name}: fields on the wire vs schema");
        self.audited.insert(name.to_owned());
    }

    /// Every schema message was audited, and every oneof member of
    /// `AdapterConfig.kind` and `Frame.body` appeared somewhere.
    fn assert_complete(&self) {
        let all: BTreeSet<String> = self.schema.keys().cloned().collect();
        let missing: Vec<&String> = all.difference(&self.audited).collect();
        assert!(missing.is_empty(), "messages never audited: {missing:?}");
    }
}

// ---------------------------------------------------------------------------
// Fully populated messages
// ---------------------------------------------------------------------------

fn usage() -> pb::Usage {
    pb::Usage {
        prompt_tokens: 17,
        completion_tokens: 300,
        total_tokens: 317,
    }
}

fn headers() -> Vec<pb::Header> {
    // Order and duplicates matter (U1); values may be non-UTF-8.
    vec![
        pb::Header {
            name: "Set-Cookie".into(),
            value: Bytes::from_static(b"a=1"),
        },
        pb::Header {
            name: "content-type".into(),
            value: Bytes::from_static(b"text/event-stream"),
        },
        pb::Header {
            name: "Set-Cookie".into(),
            value: Bytes::from_static(b"b=2"),
        },
        pb::Header {
            name: "set-cookie".into(),
            value: Bytes::from_static(b"a=1"),
        },
        pb::Header {
            name: "X-Obs".into(),
            value: Bytes::from_static(&[0x80, 0xff, b' ', 0x09]),
        },
        pb::Header {
            name: "Set-Cookie".into(),
            value: Bytes::from_static(b"a=1"),
        },
    ]
}

fn profile() -> pb::ProtocolProfile {
    pb::ProtocolProfile {
        name: "vllm".into(),
        base_url: "http://127.0.0.1:8000".into(),
        models_path: "/v1/models".into(),
        chat_completions_path: "/v1/chat/completions".into(),
        messages_path: "/v1/messages".into(),
        count_tokens_path: "/v1/messages/count_tokens".into(),
        responses_path: "/v1/responses".into(),
        completions_path: "/v1/completions".into(),
        embeddings_path: "/v1/embeddings".into(),
        rerank_path: "/v1/rerank".into(),
        score_path: "/v1/score".into(),
        tokenize_path: "/tokenize".into(),
        detokenize_path: "/detokenize".into(),
        transcriptions_path: "/v1/audio/transcriptions".into(),
        translations_path: "/v1/audio/translations".into(),
        speech_path: "/v1/audio/speech".into(),
        health_path: "/health".into(),
        auth_header_name: "Authorization".into(),
        auth_header_format: "Bearer {secret}".into(),
    }
}

fn config_payload() -> pb::NodeConfigPayload {
    pb::NodeConfigPayload {
        runtime: Some(pb::NodeRuntimeConfig {
            concurrency: 8,
            default_response_stall_timeout_ms: 120_000,
            close_grace_ms: 2_500,
            probe_timeout_ms: 1_500,
        }),
        adapters: vec![
            pb::AdapterConfig {
                tls: Some(pb::ProviderTlsConfig {
                    ca_pem: "-----BEGIN CERTIFICATE-----\n".into(),
                    insecure_skip_verify: true,
                }),
                name: "ollama-a".into(),
                capacity: 2,
                targets: vec!["llama3:8b".into(), "qwen2:7b".into()],
                kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                    base_url: "http://127.0.0.1:11434".into(),
                })),
            },
            pb::AdapterConfig {
                tls: Some(pb::ProviderTlsConfig {
                    ca_pem: "-----BEGIN CERTIFICATE-----\n".into(),
                    insecure_skip_verify: true,
                }),
                name: "vllm-b".into(),
                capacity: 16,
                targets: vec!["meta/llama-3-70b".into()],
                kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                    pb::OpenAiCompatAdapterConfig {
                        protocol_profile: Some(profile()),
                    },
                )),
            },
        ],
        revision: 42,
        credential_leases_required: true,
        revoked_credentials: vec![pb::RevokedCredential {
            slot: "openai-main".into(),
            revisions: vec![3, 4],
        }],
    }
}

fn execution_failure() -> pb::ExecutionFailure {
    pb::ExecutionFailure {
        failure_code: "response_stalled".into(),
        provider_health: Some(pb::ProviderHealthEvidence {
            health: pb::ProviderHealth::Available as i32,
            liveness_classification: pb::LivenessClassification::RequestStalled as i32,
        }),
        idle_duration_ms: 300_017,
        node_run_id: "node-run-9".into(),
        attempt_id: "attempt-3".into(),
        fence: pb::Fence::Unconfirmed as i32,
        adapter: "vllm-b".into(),
        target: "meta/llama-3-70b".into(),
        health_observation_seq: Some(12),
    }
}

fn lease() -> pb::CredentialLease {
    pb::CredentialLease {
        lease_id: "lease-1".into(),
        not_before_unix_ms: 1_700_000_000_000,
        expires_at_unix_ms: 1_700_000_060_000,
        binding_digest: Bytes::from(vec![0xd1; 32]),
        ephemeral_public_key: Bytes::from(vec![0xe2; 32]),
        sealed_secret: Bytes::from(vec![0x5e; 48]),
        header_name: "Authorization".into(),
        header_format: "Bearer {secret}".into(),
        issuer_key_id: "ab12cd34".into(),
        signature: Bytes::from(vec![0x51; 64]),
        sequence: 9,
    }
}

fn binding() -> pb::CredentialLeaseBinding {
    pb::CredentialLeaseBinding {
        principal: "team-a".into(),
        slot: "openai-main".into(),
        route: "gpt-4o->vllm-b".into(),
        profile: "vllm".into(),
        upstream_target: "vllm-b/meta/llama-3-70b".into(),
        selected_node: "gpu-01".into(),
        recipient: "77aa".into(),
        credential_revision: 5,
        route_revision: 6,
        projection_generation: 7,
        upstream_origin: "http://10.0.0.5:8000".into(),
        run_id: "run-3".into(),
        request_digest: Bytes::from(vec![0xa7; 32]),
        provider_trust: Bytes::from(vec![0x3e; 32]),
    }
}

fn run_input() -> pb::RunInput {
    pb::RunInput {
        messages: vec![
            pb::ChatMessage {
                role: "assistant".into(),
                content: "calling a tool".into(),
                name: "helper".into(),
                tool_call_id: "call-1".into(),
                tool_calls_json: Bytes::from_static(br#"[{"id":"call-1"}]"#),
            },
            pb::ChatMessage {
                role: "user".into(),
                content: "héllo".into(),
                name: "bob".into(),
                tool_call_id: "call-2".into(),
                tool_calls_json: Bytes::from_static(b"[]"),
            },
        ],
        tools_json: Bytes::from_static(br#"[{"type":"function"}]"#),
        tool_choice_json: Bytes::from_static(br#""auto""#),
        max_tokens: Some(256),
        temperature: Some(0.25),
        top_p: Some(0.875),
        stop: vec!["\n\n".into(), "END".into()],
        seed: Some(-99),
        embed_input: vec!["embed me".into(), "".into()],
        dimensions: Some(768),
    }
}

fn all_frames() -> Vec<pb::Frame> {
    let bodies = vec![
        Body::RegisterRequest(pb::RegisterRequest {
            node_id: "gpu-01".into(),
            node_version: "0.1.0".into(),
            flow_control: 1,
            strips_usage_chunk: true,
            accepts_tunnel_body: true,
            runs_embeddings: true,
        }),
        Body::RegisterResponse(Box::new(pb::RegisterResponse {
            accepted: true,
            reason: "pending ready".into(),
            config: Some(config_payload()),
            accepts_node_draining: true,
        })),
        Body::NodeReadyRequest(pb::NodeReadyRequest {
            node_id: "gpu-01".into(),
        }),
        Body::NodeReadyResponse(pb::NodeReadyResponse {
            ready: true,
            reason: "already ready".into(),
        }),
        Body::Heartbeat(pb::Heartbeat { seq: u64::MAX }),
        Body::HeartbeatAck(pb::HeartbeatAck { seq: 1 << 40 }),
        Body::RunRequest(Box::new(pb::RunRequest {
            run_id: "run-1".into(),
            adapter: "ollama-a".into(),
            target: "llama3:8b".into(),
            input: Some(run_input()),
            metadata: map(&[("trace", "t-1"), ("team", "a")]),
            session_id: "sess-1".into(),
            timeout_sec: 600,
            response_stall_timeout_ms: -5,
            flow_window_bytes: 256 * 1024,
            correlation_id: "req_0123456789abcdef".into(),
            operation: "embeddings".into(),
            trace: Some(pb::TraceContext {
                trace_id: Bytes::from_static(&[0x4b; 16]),
                parent_span_id: Bytes::from_static(&[0x0e; 8]),
                flags: 1,
                tracestate: "rojo=1".into(),
            }),
        })),
        Body::RunEvent(Box::new(pb::RunEvent {
            run_id: "run-1".into(),
            seq: 4,
            r#type: pb::RunEventType::Error as i32,
            delta: "partial".into(),
            error: "response stalled".into(),
            usage: Some(Box::new(usage())),
            metadata: map(&[("done_reason", "stop"), ("openai_tool_calls", "[]")]),
            session_id: "sess-1".into(),
            finish_reason: "length".into(),
            failure_code: "response_stalled".into(),
            adapter: "ollama-a".into(),
            target: "llama3:8b".into(),
            failure: Some(Box::new(execution_failure())),
            embeddings: Bytes::from_static(&[0, 0, 0x80, 0x3f, 0, 0, 0, 0xbf]),
            embedding_dimensions: 2,
        })),
        Body::ProviderTunnelRequest(Box::new(pb::ProviderTunnelRequest {
            run_id: "tun-1".into(),
            adapter: "vllm-b".into(),
            target: "meta/llama-3-70b".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: headers(),
            body: Bytes::from_static(br#"{"model":"meta/llama-3-70b","stream":true}"#),
            stream: true,
            timeout_sec: 900,
            metadata: map(&[("k", "v")]),
            session_id: "sess-2".into(),
            response_stall_timeout_ms: i64::MIN,
            operation: "chat_completions".into(),
            credential_lease: Some(lease()),
            credential_binding: Some(binding()),
            flow_window_bytes: u64::MAX,
            correlation_id: "client-id-7".into(),
            strip_usage_chunk: true,
            body_follows_bytes: 25 << 20,
            trace: Some(pb::TraceContext {
                trace_id: Bytes::from_static(&[0xa1; 16]),
                parent_span_id: Bytes::from_static(&[0xb2; 8]),
                flags: 0x03,
                tracestate: "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE".into(),
            }),
        })),
        Body::ProviderTunnelFrame(Box::new(pb::ProviderTunnelFrame {
            run_id: "tun-1".into(),
            seq: 9,
            kind: pb::TunnelFrameKind::Error as i32,
            status: 200,
            headers: headers(),
            body: Bytes::from_static(b"data: {\"x\":1}\n\n"),
            usage: Some(Box::new(usage())),
            error: "stalled".into(),
            failure_code: "response_stalled".into(),
            adapter: "vllm-b".into(),
            target: "meta/llama-3-70b".into(),
            metadata: map(&[("obs", "1"), ("obs2", "")]).into_iter().collect(),
            failure: Some(Box::new(execution_failure())),
        })),
        Body::CancelRequest(pb::CancelRequest {
            run_id: "tun-1".into(),
            reason: "client_disconnect".into(),
        }),
        Body::NodeCommandRequest(pb::NodeCommandRequest {
            command_id: "cmd-1".into(),
            r#type: pb::CommandType::OllamaQuery as i32,
            adapter: "ollama-a".into(),
            path: "/api/tags".into(),
        }),
        Body::NodeCommandResponse(Box::new(pb::NodeCommandResponse {
            command_id: "cmd-1".into(),
            ok: true,
            error: "partial".into(),
            capabilities: vec![pb::AdapterCapability {
                adapter_key: "vllm-b".into(),
                target: "meta/llama-3-70b".into(),
                provider_status: pb::ProviderHealth::Unavailable as i32,
                health_observation_seq: Some(3),
                adapter: "openai_compat".into(),
                instance_key: "vllm-b#0".into(),
            }],
            transport_status: Some(pb::TransportStatus {
                node_id: "gpu-01".into(),
                session_age_sec: 3600,
                active_runs: 2,
                active_tunnels: 5,
                frames_sent: 1_000_000,
                frames_received: 999_999,
            }),
            providers: vec![pb::ProviderLifecycle {
                adapter_key: "ollama-a".into(),
                adapter: "ollama".into(),
                state: "running".into(),
                capacity: 2,
                in_flight: 1,
                targets: vec!["llama3:8b".into()],
            }],
            query_status: 200,
            query_body: Bytes::from_static(br#"{"models":[]}"#),
            metrics_text: "# TYPE iop_node_active_runs gauge\niop_node_active_runs 2\n".into(),
        })),
        Body::NodeConfigRefreshRequest(Box::new(pb::NodeConfigRefreshRequest {
            refresh_id: "ref-1".into(),
            config: Some(config_payload()),
        })),
        Body::NodeConfigRefreshResponse(pb::NodeConfigRefreshResponse {
            refresh_id: "ref-1".into(),
            status: pb::RefreshStatus::RestartRequired as i32,
            reason: "adapter set changed".into(),
        }),
        Body::Close(pb::Close {
            reason: "shutdown".into(),
            detail: "SIGTERM".into(),
        }),
        Body::FlowCredit(pb::FlowCredit {
            credits: vec![
                pb::RunCredit {
                    run_id: "run-1".into(),
                    max_offset: 512 * 1024,
                },
                pb::RunCredit {
                    run_id: "tun-1".into(),
                    max_offset: u64::MAX,
                },
            ],
        }),
        Body::NodeDraining(pb::NodeDraining {
            node_id: "gpu-01".into(),
            reason: "shutdown".into(),
        }),
        Body::ProviderTunnelBody(pb::ProviderTunnelBody {
            run_id: "tun-1".into(),
            data: Bytes::from_static(b"RIFF\r\n--\x00\xff"),
        }),
    ];
    bodies.into_iter().map(codec::frame).collect()
}

/// Audits every message inside `frame` (recursively, by hand).
fn audit_frame(audit: &mut FieldAudit, frame: &pb::Frame) {
    audit.check("Frame", frame);
    let Some(body) = &frame.body else {
        panic!("frame without body");
    };
    match body {
        Body::RegisterRequest(m) => audit.check("RegisterRequest", m),
        Body::RegisterResponse(m) => {
            audit.check("RegisterResponse", m);
            audit_config(audit, m.config.as_ref());
        }
        Body::NodeReadyRequest(m) => audit.check("NodeReadyRequest", m),
        Body::NodeReadyResponse(m) => audit.check("NodeReadyResponse", m),
        Body::Heartbeat(m) => audit.check("Heartbeat", m),
        Body::HeartbeatAck(m) => audit.check("HeartbeatAck", m),
        Body::RunRequest(m) => {
            audit.check("RunRequest", m);
            let input = m.input.as_ref().unwrap_or_else(|| panic!("input"));
            audit.check("RunInput", input);
            for message in &input.messages {
                audit.check("ChatMessage", message);
            }
            audit.check("TraceContext", m.trace.as_ref().expect("a trace context"));
        }
        Body::RunEvent(m) => {
            audit.check("RunEvent", m);
            audit_usage_and_failure(audit, m.usage.as_deref(), m.failure.as_deref());
        }
        Body::ProviderTunnelRequest(m) => {
            audit.check("ProviderTunnelRequest", m);
            audit.check("TraceContext", m.trace.as_ref().expect("a trace context"));
            for header in &m.headers {
                audit.check("Header", header);
            }
            let lease = m
                .credential_lease
                .as_ref()
                .unwrap_or_else(|| panic!("lease"));
            audit.check("CredentialLease", lease);
            let binding = m
                .credential_binding
                .as_ref()
                .unwrap_or_else(|| panic!("binding"));
            audit.check("CredentialLeaseBinding", binding);
        }
        Body::ProviderTunnelFrame(m) => {
            audit.check("ProviderTunnelFrame", m);
            for header in &m.headers {
                audit.check("Header", header);
            }
            audit_usage_and_failure(audit, m.usage.as_deref(), m.failure.as_deref());
        }
        Body::CancelRequest(m) => audit.check("CancelRequest", m),
        Body::NodeCommandRequest(m) => audit.check("NodeCommandRequest", m),
        Body::NodeCommandResponse(m) => {
            audit.check("NodeCommandResponse", m);
            for capability in &m.capabilities {
                audit.check("AdapterCapability", capability);
            }
            let status = m
                .transport_status
                .as_ref()
                .unwrap_or_else(|| panic!("status"));
            audit.check("TransportStatus", status);
            for provider in &m.providers {
                audit.check("ProviderLifecycle", provider);
            }
        }
        Body::NodeConfigRefreshRequest(m) => {
            audit.check("NodeConfigRefreshRequest", m);
            audit_config(audit, m.config.as_ref());
        }
        Body::NodeConfigRefreshResponse(m) => audit.check("NodeConfigRefreshResponse", m),
        Body::Close(m) => audit.check("Close", m),
        Body::FlowCredit(m) => {
            audit.check("FlowCredit", m);
            for credit in &m.credits {
                audit.check("RunCredit", credit);
            }
        }
        Body::NodeDraining(m) => audit.check("NodeDraining", m),
        Body::ProviderTunnelBody(m) => audit.check("ProviderTunnelBody", m),
    }
}

fn audit_config(audit: &mut FieldAudit, config: Option<&pb::NodeConfigPayload>) {
    let config = config.unwrap_or_else(|| panic!("config"));
    audit.check("NodeConfigPayload", config);
    let runtime = config.runtime.as_ref().unwrap_or_else(|| panic!("runtime"));
    audit.check("NodeRuntimeConfig", runtime);
    for revoked in &config.revoked_credentials {
        audit.check("RevokedCredential", revoked);
    }
    let mut kinds = BTreeSet::new();
    for adapter in &config.adapters {
        audit.check("AdapterConfig", adapter);
        let tls = adapter.tls.as_ref().unwrap_or_else(|| panic!("tls"));
        audit.check("ProviderTlsConfig", tls);
        match &adapter.kind {
            Some(pb::adapter_config::Kind::Ollama(ollama)) => {
                kinds.insert("ollama");
                audit.check("OllamaAdapterConfig", ollama);
            }
            Some(pb::adapter_config::Kind::OpenaiCompat(compat)) => {
                kinds.insert("openai_compat");
                audit.check("OpenAICompatAdapterConfig", compat);
                let profile = compat
                    .protocol_profile
                    .as_ref()
                    .unwrap_or_else(|| panic!("profile"));
                audit.check("ProtocolProfile", profile);
            }
            None => panic!("adapter without kind"),
        }
    }
    assert_eq!(kinds, BTreeSet::from(["ollama", "openai_compat"]));
}

fn audit_usage_and_failure(
    audit: &mut FieldAudit,
    usage: Option<&pb::Usage>,
    failure: Option<&pb::ExecutionFailure>,
) {
    audit.check("Usage", usage.unwrap_or_else(|| panic!("usage")));
    let failure = failure.unwrap_or_else(|| panic!("failure"));
    audit.check("ExecutionFailure", failure);
    let health = failure
        .provider_health
        .as_ref()
        .unwrap_or_else(|| panic!("health"));
    audit.check("ProviderHealthEvidence", health);
}

fn snapshot() -> pb::ProviderSnapshot {
    pb::ProviderSnapshot {
        node_id: "gpu-01".into(),
        provider_id: "p-1".into(),
        adapter: "vllm-b".into(),
        target: "meta/llama-3-70b".into(),
        category: pb::ProviderCategory::LocalInference as i32,
        status: pb::ProviderStatus::Unavailable as i32,
        health: pb::ProviderHealth::Offline as i32,
        capacity: 16,
        long_context_capacity: 4,
        in_flight: 3,
        long_in_flight: 1,
        queued: 7,
        long_queued: 2,
        connected: true,
    }
}

// ---------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------

#[test]
fn every_frame_body_round_trips_with_every_field_set() {
    // CONTRACT: T1 — every `Frame` body variant survives encode → decode.
    let frames = all_frames();
    let mut audit = FieldAudit::new();
    let mut frame_tags = BTreeSet::new();
    for frame in &frames {
        audit_frame(&mut audit, frame);
        frame_tags.extend(present_fields(&frame.encode_to_vec()));
        let decoded = codec_roundtrip(frame);
        assert_eq!(&decoded, frame);
    }
    // All 19 oneof variants, each exactly once.
    assert_eq!(frames.len(), 19);
    assert_eq!(frame_tags, (1..=19).collect::<BTreeSet<u32>>());
    assert_eq!(audit.schema["Frame"].oneofs[0], frame_tags);

    // `ProviderSnapshot` is not a frame body; it still round-trips as a
    // message so the audit covers the whole schema.
    let snapshot = snapshot();
    audit.check("ProviderSnapshot", &snapshot);
    assert_eq!(
        pb::ProviderSnapshot::decode(snapshot.encode_to_vec().as_slice()),
        Ok(snapshot)
    );
    audit.assert_complete();
}

#[test]
fn all_frames_concatenated_decode_in_order() {
    // CONTRACT: T1
    let frames = all_frames();
    let mut wire = BytesMut::new();
    for frame in &frames {
        assert_eq!(codec::encode(frame, &mut wire), Ok(()));
    }
    let mut decoder = FrameDecoder::new();
    decoder.feed(&wire);
    let mut decoded = Vec::new();
    while let Some(frame) = decoder.decode().unwrap_or_else(|e| panic!("decode: {e}")) {
        decoded.push(frame);
    }
    assert_eq!(decoded, frames);
    assert_eq!(decoder.buffered_bytes(), 0);
}

#[test]
fn optional_fields_distinguish_absent_from_zero() {
    // CONTRACT: W7 — an unbound session omits `health_observation_seq`;
    // `Some(0)` is a present value, not "absent".
    for seq in [None, Some(0), Some(1), Some(u64::MAX)] {
        let failure = pb::ExecutionFailure {
            health_observation_seq: seq,
            ..execution_failure()
        };
        let frame = codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
            failure: Some(Box::new(failure)),
            ..Default::default()
        })));
        let decoded = codec_roundtrip(&frame);
        let Some(Body::RunEvent(event)) = decoded.body else {
            panic!("not a run event: {decoded:?}");
        };
        let failure = event.failure.unwrap_or_else(|| panic!("failure dropped"));
        assert_eq!(failure.health_observation_seq, seq);
    }
    // RunInput's optional sampling fields: zero stays distinct from absent.
    let input = pb::RunInput {
        max_tokens: Some(0),
        temperature: Some(0.0),
        top_p: None,
        seed: Some(0),
        ..Default::default()
    };
    let decoded = pb::RunInput::decode(input.encode_to_vec().as_slice());
    assert_eq!(decoded, Ok(input));
}

#[test]
fn header_lists_keep_order_and_duplicates() {
    // CONTRACT: U1 — headers are an ordered list, duplicates kept.
    let expected = headers();
    let request = codec::frame(Body::ProviderTunnelRequest(Box::new(
        pb::ProviderTunnelRequest {
            headers: expected.clone(),
            ..Default::default()
        },
    )));
    let response = codec::frame(Body::ProviderTunnelFrame(Box::new(
        pb::ProviderTunnelFrame {
            kind: pb::TunnelFrameKind::ResponseStart as i32,
            headers: expected.clone(),
            ..Default::default()
        },
    )));
    let Some(Body::ProviderTunnelRequest(request)) = codec_roundtrip(&request).body else {
        panic!("not a tunnel request");
    };
    let Some(Body::ProviderTunnelFrame(response)) = codec_roundtrip(&response).body else {
        panic!("not a tunnel frame");
    };
    let names = |headers: &[pb::Header]| -> Vec<String> {
        headers.iter().map(|h| h.name.clone()).collect()
    };
    let expected_names = [
        "Set-Cookie",
        "content-type",
        "Set-Cookie",
        "set-cookie",
        "X-Obs",
        "Set-Cookie",
    ];
    assert_eq!(names(&request.headers), expected_names);
    assert_eq!(names(&response.headers), expected_names);
    assert_eq!(request.headers, expected);
    assert_eq!(response.headers, expected);
    assert_eq!(request.headers[4].value.as_ref(), &[0x80, 0xff, b' ', 0x09]);
}

// ---------------------------------------------------------------------------
// Field numbers fixed by the contract, from hand-built bytes
// ---------------------------------------------------------------------------

#[test]
fn tunnel_request_operation_is_field_13() {
    // CONTRACT: U1 — `ProviderTunnelRequest.operation` is field 13 (key 0x6a).
    let request = ld_field(13, b"chat_completions");
    assert_eq!(request[0], 0x6a);
    let frame_bytes = ld_field(9, &request); // Frame.provider_tunnel_request = 9
    let frame = decode_raw_frame(&frame_bytes);
    let expected = codec::frame(Body::ProviderTunnelRequest(Box::new(
        pb::ProviderTunnelRequest {
            operation: "chat_completions".into(),
            ..Default::default()
        },
    )));
    assert_eq!(frame, expected);
    // And the encoder writes exactly those bytes.
    assert_eq!(expected.encode_to_vec(), frame_bytes);
}

#[test]
fn tunnel_request_credential_fields_are_14_and_15() {
    // CONTRACT: U1 — `credential_lease` = 14, `credential_binding` = 15.
    let lease = ld_field(14, &ld_field(1, b"lease-1"));
    let binding = ld_field(15, &ld_field(6, b"gpu-01"));
    assert_eq!((lease[0], binding[0]), (0x72, 0x7a));
    let request = [lease, binding].concat();
    let frame = decode_raw_frame(&ld_field(9, &request));
    let Some(Body::ProviderTunnelRequest(request)) = frame.body else {
        panic!("not a tunnel request: {frame:?}");
    };
    assert_eq!(
        request.credential_lease.map(|l| l.lease_id),
        Some("lease-1".to_owned())
    );
    assert_eq!(
        request.credential_binding.map(|b| b.selected_node),
        Some("gpu-01".to_owned())
    );
}

#[test]
fn node_draining_is_frame_field_18() {
    // `Frame.node_draining` = 18: key (18 << 3) | 2 = 146, a two-byte
    // varint 0x92 0x01; `node_id` = 1, `reason` = 2.
    let notice = [ld_field(1, b"gpu-01"), ld_field(2, b"shutdown")].concat();
    let mut frame_bytes = vec![0x92, 0x01, notice.len() as u8];
    frame_bytes.extend_from_slice(&notice);
    let frame = decode_raw_frame(&frame_bytes);
    let expected = codec::frame(Body::NodeDraining(pb::NodeDraining {
        node_id: "gpu-01".into(),
        reason: "shutdown".into(),
    }));
    assert_eq!(frame, expected);
    assert_eq!(expected.encode_to_vec(), frame_bytes);
    assert_eq!(
        codec::body_name(&Body::NodeDraining(Default::default())),
        "NodeDraining"
    );
}

#[test]
fn register_response_accepts_node_draining_is_field_4_and_absent_means_false() {
    // `RegisterResponse.accepts_node_draining` = 4, a varint: key 0x20.
    let accepted = [0x08, 0x01];
    let said = [&accepted[..], &[0x20, 0x01]].concat();
    let decode = |bytes: &[u8]| {
        let frame = decode_raw_frame(&ld_field(2, bytes)); // Frame.register_response = 2
        let Some(Body::RegisterResponse(response)) = frame.body else {
            panic!("not a register response: {frame:?}");
        };
        *response
    };
    let from_this_edge = decode(&said);
    assert!(from_this_edge.accepted && from_this_edge.accepts_node_draining);
    // An older Edge never writes field 4: the Node reads false and does
    // not send `NodeDraining`.
    let from_an_older_edge = decode(&accepted);
    assert!(from_an_older_edge.accepted && !from_an_older_edge.accepts_node_draining);
    assert_eq!(
        pb::RegisterResponse {
            accepted: true,
            accepts_node_draining: true,
            ..Default::default()
        }
        .encode_to_vec(),
        said
    );
}

#[test]
fn run_event_failure_is_field_13() {
    // CONTRACT: W4 — `RunEvent.failure` is field 13 (key 0x6a).
    // ExecutionFailure { failure_code (1) = "response_stalled",
    //                    health_observation_seq (9) = 5 }
    let mut failure = ld_field(1, b"response_stalled");
    failure.extend_from_slice(&[0x48, 0x05]);
    let event = ld_field(13, &failure);
    assert_eq!(event[0], 0x6a);
    let frame_bytes = ld_field(8, &event); // Frame.run_event = 8
    let frame = decode_raw_frame(&frame_bytes);
    let expected = codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
        failure: Some(Box::new(pb::ExecutionFailure {
            failure_code: "response_stalled".into(),
            health_observation_seq: Some(5),
            ..Default::default()
        })),
        ..Default::default()
    })));
    assert_eq!(frame, expected);
    assert_eq!(expected.encode_to_vec(), frame_bytes);
}

#[test]
fn tunnel_frame_failure_is_field_15() {
    // CONTRACT: W4 — `ProviderTunnelFrame.failure` is field 15 (key 0x7a).
    let failure = ld_field(1, b"response_stalled");
    let tunnel_frame = ld_field(15, &failure);
    assert_eq!(tunnel_frame[0], 0x7a);
    let frame_bytes = ld_field(10, &tunnel_frame); // Frame.provider_tunnel_frame = 10
    let frame = decode_raw_frame(&frame_bytes);
    let expected = codec::frame(Body::ProviderTunnelFrame(Box::new(
        pb::ProviderTunnelFrame {
            failure: Some(Box::new(pb::ExecutionFailure {
                failure_code: "response_stalled".into(),
                ..Default::default()
            })),
            ..Default::default()
        },
    )));
    assert_eq!(frame, expected);
    assert_eq!(expected.encode_to_vec(), frame_bytes);
}

#[test]
fn negative_stall_timeouts_round_trip_as_int64() {
    // CONTRACT: W1 — `response_stall_timeout_ms` is a signed int64 on both
    // requests, so a negative value reaches the Node boundary unchanged (to be
    // rejected there) rather than wrapping.
    // -1 as int64 varint: ten bytes, ff×9 01.
    let minus_one = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
    let run_request = [&[0x40][..], &minus_one].concat(); // RunRequest field 8
    let frame = decode_raw_frame(&ld_field(7, &run_request));
    let Some(Body::RunRequest(request)) = frame.body else {
        panic!("not a run request: {frame:?}");
    };
    assert_eq!(request.response_stall_timeout_ms, -1);
    let tunnel_request = [&[0x60][..], &minus_one].concat(); // field 12
    let frame = decode_raw_frame(&ld_field(9, &tunnel_request));
    let Some(Body::ProviderTunnelRequest(request)) = frame.body else {
        panic!("not a tunnel request: {frame:?}");
    };
    assert_eq!(request.response_stall_timeout_ms, -1);

    for value in [-1, -300_000, i64::MIN, i64::MAX, 0, 1] {
        let run = codec::frame(Body::RunRequest(Box::new(pb::RunRequest {
            response_stall_timeout_ms: value,
            ..Default::default()
        })));
        let tunnel = codec::frame(Body::ProviderTunnelRequest(Box::new(
            pb::ProviderTunnelRequest {
                response_stall_timeout_ms: value,
                ..Default::default()
            },
        )));
        assert_eq!(codec_roundtrip(&run), run);
        assert_eq!(codec_roundtrip(&tunnel), tunnel);
    }
}

// ---------------------------------------------------------------------------
// Zero copy
// ---------------------------------------------------------------------------

/// Byte offset of the first occurrence of `needle` in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("needle not found"))
}

/// The address range the decoder's buffer covers right now.
fn buffer_range(decoder: &mut FrameDecoder) -> std::ops::Range<usize> {
    let buffer = decoder.buffer_mut();
    let start = buffer.as_ptr() as usize;
    start..start + buffer.len()
}

#[test]
fn decoded_body_bytes_point_into_the_read_buffer() {
    // CONTRACT: T1, U2 — tunnel body bytes are slices of the decoder's buffer,
    // not copies: the decoded `Bytes` starts at the exact address where the
    // body's bytes sit in the buffer the shell read into.
    let tunnel_body: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    let request_body = b"{\"unique-request-body\":true}".to_vec();
    let frames = [
        codec::frame(Body::ProviderTunnelFrame(Box::new(
            pb::ProviderTunnelFrame {
                run_id: "tun-1".into(),
                seq: 2,
                kind: pb::TunnelFrameKind::Body as i32,
                body: Bytes::from(tunnel_body.clone()),
                ..Default::default()
            },
        ))),
        codec::frame(Body::ProviderTunnelRequest(Box::new(
            pb::ProviderTunnelRequest {
                run_id: "tun-2".into(),
                body: Bytes::from(request_body.clone()),
                ..Default::default()
            },
        ))),
    ];
    let mut wire = BytesMut::new();
    for frame in &frames {
        assert_eq!(codec::encode(frame, &mut wire), Ok(()));
    }

    // Read in two pieces, as a shell would: the first decode sees only part
    // of the first frame (and may grow the buffer), the second read completes
    // both frames. Addresses are taken once all bytes are in place.
    let mut decoder = FrameDecoder::new();
    decoder.buffer_mut().extend_from_slice(&wire[..100]);
    assert_eq!(decoder.decode(), Ok(None));
    decoder.buffer_mut().extend_from_slice(&wire[100..]);
    let region = buffer_range(&mut decoder);
    // The buffer now holds the tail of `wire` (the first prefix was consumed).
    let wire_start_addr = region.end - wire.len();
    assert_eq!(region.len(), wire.len() - LENGTH_PREFIX_BYTES);

    let Ok(Some(first)) = decoder.decode() else {
        panic!("first frame");
    };
    let Ok(Some(second)) = decoder.decode() else {
        panic!("second frame");
    };
    let Some(Body::ProviderTunnelFrame(first)) = first.body else {
        panic!("not a tunnel frame");
    };
    let Some(Body::ProviderTunnelRequest(second)) = second.body else {
        panic!("not a tunnel request");
    };
    assert_eq!(first.body.as_ref(), tunnel_body.as_slice());
    assert_eq!(second.body.as_ref(), request_body.as_slice());

    for (body, content) in [(&first.body, &tunnel_body), (&second.body, &request_body)] {
        let addr = body.as_ptr() as usize;
        assert!(region.contains(&addr) && addr + body.len() <= region.end);
        assert_eq!(addr, wire_start_addr + find(&wire, content));
    }
}

// ---------------------------------------------------------------------------
// BodyFrameHead
// ---------------------------------------------------------------------------

fn full_tunnel_frame() -> pb::ProviderTunnelFrame {
    pb::ProviderTunnelFrame {
        run_id: "tun-7".into(),
        seq: 300,
        kind: pb::TunnelFrameKind::Body as i32,
        status: 200,
        headers: headers(),
        body: Bytes::new(),
        usage: Some(Box::new(usage())),
        error: "e".into(),
        failure_code: "fc".into(),
        adapter: "vllm-b".into(),
        target: "meta/llama-3-70b".into(),
        metadata: map(&[("obs", "1")]).into_iter().collect(),
        failure: Some(Box::new(execution_failure())),
    }
}

/// Only fields numbered below `body` (6): the body is then the last field
/// prost writes, so head + body must be byte-identical to `encode`.
fn small_tunnel_frame() -> pb::ProviderTunnelFrame {
    pb::ProviderTunnelFrame {
        run_id: "tun-8".into(),
        seq: 1,
        kind: pb::TunnelFrameKind::Body as i32,
        ..Default::default()
    }
}

/// Body lengths around each varint boundary of the body length itself
/// (127/128, 16383/16384, 2^21) and of the enclosing message length (which
/// crosses the same boundaries `fields_len` bytes earlier).
fn interesting_body_lengths(fields_len: usize) -> Vec<usize> {
    let mut lengths = BTreeSet::new();
    for boundary in [128usize, 16_384, 2_097_152] {
        for center in [boundary, boundary.saturating_sub(fields_len + 3)] {
            for len in center.saturating_sub(3)..=center + 3 {
                lengths.insert(len);
            }
        }
    }
    lengths.extend([0, 1, 2, 126, 127, 128, 129, 16_383, 16_384]);
    lengths.into_iter().collect()
}

fn head_plus_body(tunnel_frame: &pb::ProviderTunnelFrame, body: &[u8]) -> BytesMut {
    let mut wire = BytesMut::new();
    let result =
        BodyFrameHead::encode(tunnel_frame, body.len(), &mut wire, DEFAULT_MAX_FRAME_BYTES);
    assert_eq!(result, Ok(()));
    wire.extend_from_slice(body);
    wire
}

fn decode_all(wire: &[u8]) -> Vec<pb::Frame> {
    let mut decoder = FrameDecoder::new();
    decoder.feed(wire);
    let mut frames = Vec::new();
    while let Some(frame) = decoder.decode().unwrap_or_else(|e| panic!("decode: {e}")) {
        frames.push(frame);
    }
    assert_eq!(decoder.buffered_bytes(), 0);
    frames
}

#[test]
fn body_frame_head_matches_full_encode_around_varint_boundaries() {
    // CONTRACT: T1, U2 — the head + the body bytes as they are decode to
    // exactly the frame `encode` produces for the whole frame.
    for template in [full_tunnel_frame(), small_tunnel_frame()] {
        let fields_len = template.encoded_len();
        for body_len in interesting_body_lengths(fields_len) {
            let body: Vec<u8> = (0..body_len).map(|i| (i % 253) as u8).collect();
            let with_body = pb::ProviderTunnelFrame {
                body: Bytes::from(body.clone()),
                ..template.clone()
            };
            let full_frame = codec::frame(Body::ProviderTunnelFrame(Box::new(with_body)));
            let mut encoded = BytesMut::new();
            assert_eq!(codec::encode(&full_frame, &mut encoded), Ok(()));

            let split = head_plus_body(&template, &body);
            assert_eq!(split.len(), encoded.len(), "body_len {body_len}");
            assert_eq!(split[..4], encoded[..4], "prefix, body_len {body_len}");
            let from_split = decode_all(&split);
            assert_eq!(from_split, decode_all(&encoded), "body_len {body_len}");
            assert_eq!(from_split, vec![full_frame], "body_len {body_len}");
        }
    }
}

#[test]
fn body_frame_head_is_byte_identical_when_body_is_the_last_field() {
    // CONTRACT: T1
    let template = small_tunnel_frame();
    for body_len in interesting_body_lengths(template.encoded_len()) {
        let body = vec![0xabu8; body_len];
        let full_frame = codec::frame(Body::ProviderTunnelFrame(Box::new(
            pb::ProviderTunnelFrame {
                body: Bytes::from(body.clone()),
                ..template.clone()
            },
        )));
        let mut encoded = BytesMut::new();
        assert_eq!(codec::encode(&full_frame, &mut encoded), Ok(()));
        assert_eq!(
            head_plus_body(&template, &body),
            encoded,
            "body_len {body_len}"
        );
    }
}

proptest::proptest! {
    /// A chunk's frame (only `run_id`, `seq`, `kind` and the body set) has
    /// its head written by hand: byte for byte what prost writes, for any
    /// values, empty and negative ones included.
    #[test]
    fn a_plain_body_frame_head_is_byte_identical_to_prost(
        run_id in "\\PC{0,40}",
        seq in proptest::prop_oneof![proptest::strategy::Just(0u64), proptest::num::u64::ANY],
        kind in proptest::prop_oneof![proptest::strategy::Just(0i32), -3i32..6, proptest::num::i32::ANY],
        body_len in proptest::prop_oneof![0usize..300, 16_370usize..16_400],
    ) {
        let template = pb::ProviderTunnelFrame { run_id, seq, kind, ..Default::default() };
        let body = vec![0x5au8; body_len];
        let full_frame = codec::frame(Body::ProviderTunnelFrame(Box::new(
            pb::ProviderTunnelFrame { body: Bytes::from(body.clone()), ..template.clone() },
        )));
        let mut encoded = BytesMut::new();
        proptest::prop_assert_eq!(codec::encode(&full_frame, &mut encoded), Ok(()));
        proptest::prop_assert_eq!(head_plus_body(&template, &body), encoded);
    }
}

proptest::proptest! {
    /// A chunk's head, written from its run id and seq alone, is the head
    /// of the frame they make; it decodes back to a chunk with the same
    /// run id, seq and body.
    #[test]
    fn a_chunk_head_is_the_plain_body_frame_head(
        run_id in "\\PC{0,40}",
        seq in proptest::num::u64::ANY,
        body_len in 0usize..300,
    ) {
        let template = pb::ProviderTunnelFrame {
            run_id: run_id.clone(),
            seq,
            kind: pb::TunnelFrameKind::Body as i32,
            ..Default::default()
        };
        let body = Bytes::from(vec![0xa5u8; body_len]);
        let mut chunk_head = BytesMut::new();
        proptest::prop_assert_eq!(
            BodyFrameHead::encode_chunk(&run_id, seq, body_len, &mut chunk_head, DEFAULT_MAX_FRAME_BYTES),
            Ok(())
        );
        let mut frame_head = BytesMut::new();
        proptest::prop_assert_eq!(
            BodyFrameHead::encode(&template, body_len, &mut frame_head, DEFAULT_MAX_FRAME_BYTES),
            Ok(())
        );
        proptest::prop_assert_eq!(&chunk_head, &frame_head);

        let mut decoder = FrameDecoder::new();
        decoder.feed(&chunk_head);
        decoder.feed(&body);
        let decoded = decoder.decode_inbound();
        proptest::prop_assert_eq!(
            decoded,
            Ok(Some(Inbound::Chunk(TunnelChunk::new(&run_id, seq, body))))
        );
    }
}

#[test]
fn body_frame_head_ignores_a_body_already_in_the_template() {
    // CONTRACT: T1
    let template = pb::ProviderTunnelFrame {
        body: Bytes::from_static(b"stale body that must not be written"),
        ..small_tunnel_frame()
    };
    let wire = head_plus_body(&template, b"fresh");
    let expected = codec::frame(Body::ProviderTunnelFrame(Box::new(
        pb::ProviderTunnelFrame {
            body: Bytes::from_static(b"fresh"),
            ..small_tunnel_frame()
        },
    )));
    assert_eq!(decode_all(&wire), vec![expected]);
}

#[test]
fn body_frame_head_refuses_oversized_frames() {
    // CONTRACT: T1 — the sender refuses what the receiver would reject.
    let template = small_tunnel_frame();
    let body_len = 1000;
    // key(10) + len varint(2 bytes) + fields + key(6) + varint(2) + body.
    let frame_len = 1 + 2 + template.encoded_len() + 1 + 2 + body_len;

    let mut wire = BytesMut::new();
    assert_eq!(
        BodyFrameHead::encode(&template, body_len, &mut wire, frame_len),
        Ok(())
    );
    assert_eq!(wire.len(), LENGTH_PREFIX_BYTES + frame_len - body_len);
    assert_eq!(wire[..4], (frame_len as u32).to_be_bytes());

    let mut refused = BytesMut::new();
    assert_eq!(
        BodyFrameHead::encode(&template, body_len, &mut refused, frame_len - 1),
        Err(EncodeError::FrameTooLarge {
            len: frame_len,
            max: frame_len - 1
        })
    );
    assert!(refused.is_empty());
}

#[test]
fn body_frame_head_never_truncates_the_u32_length_prefix() {
    // CONTRACT: T1 — even with an unbounded cap, a frame longer than a u32
    // can announce is refused instead of being sent with a wrapped length.
    let template = small_tunnel_frame();
    let body_len = u32::MAX as usize + 1;
    let mut wire = BytesMut::new();
    let result = BodyFrameHead::encode(&template, body_len, &mut wire, usize::MAX);
    let Err(EncodeError::FrameTooLarge { len, max }) = result else {
        panic!("expected FrameTooLarge, got {result:?}");
    };
    assert_eq!(max, u32::MAX as usize);
    assert!(len > body_len);
    assert!(wire.is_empty());
}

// ---------------------------------------------------------------------------
// RequestFrameHead and BodyParts
// ---------------------------------------------------------------------------

fn full_tunnel_request() -> pb::ProviderTunnelRequest {
    pb::ProviderTunnelRequest {
        run_id: "run-9".into(),
        adapter: "vllm-b".into(),
        target: "meta/llama-3-70b".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: headers(),
        body: Bytes::new(),
        stream: true,
        timeout_sec: 30,
        metadata: map(&[("obs", "1")]),
        session_id: "s".into(),
        response_stall_timeout_ms: 5_000,
        operation: "chat_completions".into(),
        flow_window_bytes: 262_144,
        ..Default::default()
    }
}

/// A body cut into prefix ‖ value ‖ suffix at `cut_a` and `cut_b`.
fn cut(body: &[u8], cut_a: usize, cut_b: usize) -> BodyParts {
    let body = Bytes::copy_from_slice(body);
    BodyParts::spliced(
        body.slice(..cut_a),
        body.slice(cut_a..cut_b),
        body.slice(cut_b..),
    )
}

#[test]
fn request_frame_head_plus_the_pieces_is_the_whole_request_frame() {
    // CONTRACT: T1, U5 — a tunnel request sent as a head and its body's
    // pieces (never joined) decodes to exactly the request `encode` makes
    // of the joined body, however the body is cut, around every varint
    // boundary of the body and message lengths.
    let template = full_tunnel_request();
    for body_len in interesting_body_lengths(template.encoded_len()) {
        let body: Vec<u8> = (0..body_len).map(|i| (i % 251) as u8).collect();
        let whole = codec::frame(Body::ProviderTunnelRequest(Box::new(
            pb::ProviderTunnelRequest {
                body: Bytes::from(body.clone()),
                ..template.clone()
            },
        )));
        let mut encoded = BytesMut::new();
        assert_eq!(codec::encode(&whole, &mut encoded), Ok(()));
        for (a, b) in [
            (0, 0),
            (0, body_len),
            (body_len / 3, body_len / 2),
            (body_len, body_len),
        ] {
            let parts = cut(&body, a, b);
            assert_eq!(parts.len(), body_len);
            assert_eq!(parts.to_bytes(), body[..]);
            let mut wire = BytesMut::new();
            assert_eq!(
                RequestFrameHead::encode(
                    &template,
                    parts.len(),
                    &mut wire,
                    DEFAULT_MAX_FRAME_BYTES
                ),
                Ok(())
            );
            for part in parts.parts() {
                wire.extend_from_slice(part);
            }
            assert_eq!(wire.len(), encoded.len(), "body_len {body_len} cut {a}/{b}");
            assert_eq!(
                decode_all(&wire),
                vec![whole.clone()],
                "body_len {body_len}"
            );
        }
    }
}

#[test]
fn request_frame_head_ignores_a_body_in_the_template_and_refuses_oversize() {
    // CONTRACT: T1
    let template = pb::ProviderTunnelRequest {
        body: Bytes::from_static(b"stale"),
        ..full_tunnel_request()
    };
    let mut wire = BytesMut::new();
    assert_eq!(
        RequestFrameHead::encode(&template, 5, &mut wire, DEFAULT_MAX_FRAME_BYTES),
        Ok(())
    );
    wire.extend_from_slice(b"fresh");
    let expected = codec::frame(Body::ProviderTunnelRequest(Box::new(
        pb::ProviderTunnelRequest {
            body: Bytes::from_static(b"fresh"),
            ..full_tunnel_request()
        },
    )));
    assert_eq!(decode_all(&wire), vec![expected.clone()]);

    let frame_len = wire.len() - LENGTH_PREFIX_BYTES;
    let mut refused = BytesMut::new();
    assert_eq!(
        RequestFrameHead::encode(&template, 5, &mut refused, frame_len - 1),
        Err(EncodeError::FrameTooLarge {
            len: frame_len,
            max: frame_len - 1
        })
    );
    assert!(refused.is_empty());
}

#[test]
fn body_parts_join_only_when_cut() {
    let one = Bytes::from_static(b"whole body");
    let whole = BodyParts::whole(one.clone());
    assert_eq!(
        whole.to_bytes().as_ptr(),
        one.as_ptr(),
        "one piece: no copy"
    );
    assert!(BodyParts::default().is_empty());
    assert_eq!(BodyParts::default().to_bytes(), Bytes::new());
    let spliced = cut(b"{\"model\":\"x\"}", 9, 12);
    assert_eq!(spliced.to_bytes(), Bytes::from_static(b"{\"model\":\"x\"}"));
}
