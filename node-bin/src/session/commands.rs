//! Node commands (K2, H6): query/control only, never execution, answered
//! with a `NodeCommandResponse` correlated by `command_id`.
//!
//! | command | answer |
//! |---|---|
//! | CAPABILITIES | per adapter instance and target: `adapter_key`, `target`, normalized `provider_status` from the bounded fail-closed exact-target probe, the session's next `health_observation_seq` (W7); `adapter` and `instance_key` are diagnostic |
//! | TRANSPORT_STATUS | node id, session age, active runs/tunnels, frame counters — no addresses or tokens (X5) |
//! | PROVIDER_STATUS | per adapter instance: lifecycle, capacity, in-flight (P4), targets |
//! | METRICS | the Node's Prometheus text ([`crate::metrics`]) and its session gauges |
//! | OLLAMA_QUERY | read-only `GET` of exactly `/api/tags`, `/api/ps` or `/api/version` on an Ollama adapter; any other path is refused without a provider call |
//!
//! The pure helpers build every answer from plain inputs; [`handle`] is the
//! shell that runs probes and the Ollama GET.

use std::rc::Rc;

use iop_wire::pb;

use crate::adapters::probe::{self, ProbeTarget};
use crate::adapters::{AdapterInstance, AdapterKind, Adapters};
use crate::attempt::observation::ObservationSeq;
use crate::attempt::watchdog::{ProbeOutcome, RuntimeSettings};

/// The read-only Ollama paths OLLAMA_QUERY relays (K2).
pub const OLLAMA_QUERY_PATHS: [&str; 3] = ["/api/tags", "/api/ps", "/api/version"];

/// Why a command was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// Not one of the five command types.
    #[error("unknown command type {0}")]
    UnknownType(i32),
    /// No adapter instance with that name.
    #[error("no adapter instance named `{0}` on this node")]
    UnknownAdapter(String),
    /// The named adapter is not an Ollama adapter.
    #[error("adapter `{0}` is not an ollama adapter")]
    NotOllama(String),
    /// No adapter was named and there is not exactly one Ollama adapter.
    #[error("name the ollama adapter: this node has {0} ollama adapters")]
    OllamaAdapterAmbiguous(usize),
    /// The path is not one of the read-only Ollama paths.
    #[error("path `{0}` is not allowed: only /api/tags, /api/ps and /api/version")]
    PathNotAllowed(String),
    /// The Ollama GET failed.
    #[error("ollama query failed: {0}")]
    QueryFailed(String),
}

/// What a command may read from its session.
#[derive(Debug, Clone)]
pub struct CommandContext {
    /// The adapters in effect when the command arrived.
    pub adapters: Rc<Adapters>,
    /// Runtime settings (probe bound).
    pub settings: RuntimeSettings,
    /// The session's observation sequence (W7).
    pub observations: Rc<ObservationSeq>,
    /// TRANSPORT_STATUS answer, as of the command's arrival.
    pub transport: pb::TransportStatus,
}

/// The allowlisted Ollama path (K2); query strings and everything else are
/// refused.
pub fn ollama_query_path(path: &str) -> Result<&'static str, CommandError> {
    OLLAMA_QUERY_PATHS
        .iter()
        .copied()
        .find(|p| *p == path)
        .ok_or_else(|| CommandError::PathNotAllowed(path.to_string()))
}

/// The instances a CAPABILITIES/PROVIDER_STATUS command addresses: the named
/// one, or all when `name` is empty.
pub fn select_adapters(
    adapters: &Adapters,
    name: &str,
) -> Result<Vec<Rc<AdapterInstance>>, CommandError> {
    if name.is_empty() {
        return Ok(adapters.iter().cloned().collect());
    }
    adapters
        .get(name)
        .map(|a| vec![a.clone()])
        .ok_or_else(|| CommandError::UnknownAdapter(name.to_string()))
}

/// The Ollama adapter an OLLAMA_QUERY addresses: the named one, or the only
/// one.
pub fn ollama_adapter(
    adapters: &Adapters,
    name: &str,
) -> Result<Rc<AdapterInstance>, CommandError> {
    if !name.is_empty() {
        let a = adapters
            .get(name)
            .ok_or_else(|| CommandError::UnknownAdapter(name.to_string()))?;
        if a.kind != AdapterKind::Ollama {
            return Err(CommandError::NotOllama(name.to_string()));
        }
        return Ok(a.clone());
    }
    let ollama: Vec<_> = adapters
        .iter()
        .filter(|a| a.kind == AdapterKind::Ollama)
        .collect();
    match ollama.as_slice() {
        [only] => Ok((*only).clone()),
        other => Err(CommandError::OllamaAdapterAmbiguous(other.len())),
    }
}

/// The (instance, target) pairs of a CAPABILITIES answer, in order; an
/// instance without targets yields one entry with an empty target.
pub fn capability_entries(instances: &[Rc<AdapterInstance>]) -> Vec<(Rc<AdapterInstance>, String)> {
    let mut out = Vec::new();
    for a in instances {
        if a.targets.is_empty() {
            out.push((a.clone(), String::new()));
        }
        for t in &a.targets {
            out.push((a.clone(), t.clone()));
        }
    }
    out
}

/// One CAPABILITIES entry (H6, K2).
pub fn capability(
    adapter: &AdapterInstance,
    target: &str,
    outcome: ProbeOutcome,
    health_observation_seq: Option<u64>,
) -> pb::AdapterCapability {
    pb::AdapterCapability {
        adapter_key: adapter.name.clone(),
        target: target.to_string(),
        provider_status: outcome.health() as i32,
        health_observation_seq,
        adapter: adapter.kind.type_name().to_string(),
        instance_key: adapter.name.clone(),
    }
}

/// PROVIDER_STATUS entries (K2, P4).
pub fn provider_lifecycles(instances: &[Rc<AdapterInstance>]) -> Vec<pb::ProviderLifecycle> {
    instances
        .iter()
        .map(|a| pb::ProviderLifecycle {
            adapter_key: a.name.clone(),
            adapter: a.kind.type_name().to_string(),
            state: "running".to_string(),
            capacity: a.gate.capacity(),
            in_flight: a.gate.in_flight(),
            targets: a.targets.clone(),
        })
        .collect()
}

/// The refusal of `command_id`.
pub fn refused(command_id: &str, error: &CommandError) -> pb::NodeCommandResponse {
    pb::NodeCommandResponse {
        command_id: command_id.to_string(),
        ok: false,
        error: error.to_string(),
        ..Default::default()
    }
}

fn ok(command_id: &str) -> pb::NodeCommandResponse {
    pb::NodeCommandResponse {
        command_id: command_id.to_string(),
        ok: true,
        ..Default::default()
    }
}

/// Runs one command. Bounded: probes and the Ollama GET take at most the
/// runtime probe bound (probes run concurrently).
pub async fn handle(req: pb::NodeCommandRequest, ctx: CommandContext) -> pb::NodeCommandResponse {
    let id = req.command_id.clone();
    let result = match pb::CommandType::try_from(req.r#type) {
        Ok(pb::CommandType::Capabilities) => capabilities(&req, &ctx).await,
        Ok(pb::CommandType::TransportStatus) => Ok(pb::NodeCommandResponse {
            transport_status: Some(ctx.transport.clone()),
            ..ok(&id)
        }),
        Ok(pb::CommandType::ProviderStatus) => {
            select_adapters(&ctx.adapters, &req.adapter).map(|instances| pb::NodeCommandResponse {
                providers: provider_lifecycles(&instances),
                ..ok(&id)
            })
        }
        Ok(pb::CommandType::OllamaQuery) => ollama_query(&req, &ctx).await,
        Ok(pb::CommandType::Metrics) => {
            let mut instances: Vec<Rc<AdapterInstance>> = ctx.adapters.iter().cloned().collect();
            instances.sort_by(|a, b| a.name.cmp(&b.name));
            let mut text = crate::metrics::render();
            text.push_str(&crate::metrics::render_session(
                &ctx.transport,
                &provider_lifecycles(&instances),
            ));
            Ok(pb::NodeCommandResponse {
                metrics_text: text,
                ..ok(&id)
            })
        }
        Ok(pb::CommandType::Unspecified) | Err(_) => Err(CommandError::UnknownType(req.r#type)),
    };
    result.unwrap_or_else(|e| refused(&id, &e))
}

async fn capabilities(
    req: &pb::NodeCommandRequest,
    ctx: &CommandContext,
) -> Result<pb::NodeCommandResponse, CommandError> {
    let instances = select_adapters(&ctx.adapters, &req.adapter)?;
    let entries = capability_entries(&instances);
    // Probe every entry concurrently; each is bounded and fails closed.
    let pending: Vec<_> = entries
        .iter()
        .map(|(a, t)| probe::spawn_probe(ProbeTarget::of(a, t), ctx.settings.probe_timeout))
        .collect();
    let mut capabilities = Vec::with_capacity(entries.len());
    for ((adapter, target), rx) in entries.iter().zip(pending) {
        let outcome = rx.await.unwrap_or(ProbeOutcome::Unknown);
        // Each finalized observation takes the session's next sequence (W7).
        capabilities.push(capability(
            adapter,
            target,
            outcome,
            ctx.observations.next(),
        ));
    }
    Ok(pb::NodeCommandResponse {
        capabilities,
        ..ok(&req.command_id)
    })
}

async fn ollama_query(
    req: &pb::NodeCommandRequest,
    ctx: &CommandContext,
) -> Result<pb::NodeCommandResponse, CommandError> {
    // Refuse before touching any provider.
    let path = ollama_query_path(&req.path)?;
    let adapter = ollama_adapter(&ctx.adapters, &req.adapter)?;
    let url_path = adapter.base_url.join(path);
    let (status, body) = probe::get(adapter.target(), &url_path, ctx.settings.probe_timeout)
        .await
        .map_err(|e| CommandError::QueryFailed(e.to_string()))?;
    Ok(pb::NodeCommandResponse {
        query_status: u32::from(status),
        query_body: body,
        ..ok(&req.command_id)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapters() -> Adapters {
        Adapters::from_payload(&pb::NodeConfigPayload {
            adapters: vec![
                pb::AdapterConfig {
                    tls: None,
                    name: "vllm-a".into(),
                    capacity: 4,
                    targets: vec!["m1".into(), "m2".into()],
                    kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                        pb::OpenAiCompatAdapterConfig {
                            protocol_profile: Some(pb::ProtocolProfile {
                                base_url: "http://127.0.0.1:9".into(),
                                health_path: "/health".into(),
                                ..Default::default()
                            }),
                        },
                    )),
                },
                pb::AdapterConfig {
                    tls: None,
                    name: "local".into(),
                    capacity: 0,
                    targets: vec![],
                    kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                        base_url: "http://127.0.0.1:11434".into(),
                    })),
                },
            ],
            ..Default::default()
        })
        .unwrap()
    }

    // CONTRACT: K2 — OLLAMA_QUERY relays only the read-only paths.
    #[test]
    fn ollama_paths_are_allowlisted() {
        assert_eq!(ollama_query_path("/api/tags"), Ok("/api/tags"));
        assert_eq!(ollama_query_path("/api/ps"), Ok("/api/ps"));
        assert_eq!(ollama_query_path("/api/version"), Ok("/api/version"));
        for bad in [
            "/api/generate",
            "/api/pull",
            "/api/delete",
            "/api/tags?x=1",
            "/api/tags/../pull",
            "api/tags",
            "",
        ] {
            assert_eq!(
                ollama_query_path(bad),
                Err(CommandError::PathNotAllowed(bad.into()))
            );
        }
    }

    // CONTRACT: K2 — the Ollama adapter is the named one (and must be an
    // Ollama adapter) or the only one.
    #[test]
    fn ollama_adapter_resolution() {
        let a = adapters();
        assert_eq!(ollama_adapter(&a, "").unwrap().name, "local");
        assert_eq!(ollama_adapter(&a, "local").unwrap().name, "local");
        assert_eq!(
            ollama_adapter(&a, "vllm-a").unwrap_err(),
            CommandError::NotOllama("vllm-a".into())
        );
        assert_eq!(
            ollama_adapter(&a, "nope").unwrap_err(),
            CommandError::UnknownAdapter("nope".into())
        );
        assert_eq!(
            ollama_adapter(&Adapters::default(), "").unwrap_err(),
            CommandError::OllamaAdapterAmbiguous(0)
        );
    }

    // CONTRACT: K2, H6, W7 — one CAPABILITIES entry per instance and target
    // with the stable keys; adapter/instance_key are diagnostic.
    #[test]
    fn capability_entries_and_keys() {
        let a = adapters();
        let all = select_adapters(&a, "").unwrap();
        let entries: Vec<(String, String)> = capability_entries(&all)
            .into_iter()
            .map(|(i, t)| (i.name.clone(), t))
            .collect();
        assert_eq!(
            entries,
            vec![
                ("local".to_string(), String::new()),
                ("vllm-a".to_string(), "m1".to_string()),
                ("vllm-a".to_string(), "m2".to_string()),
            ]
        );
        let vllm = a.get("vllm-a").unwrap();
        assert_eq!(
            capability(vllm, "m2", ProbeOutcome::Available, Some(7)),
            pb::AdapterCapability {
                adapter_key: "vllm-a".into(),
                target: "m2".into(),
                provider_status: pb::ProviderHealth::Available as i32,
                health_observation_seq: Some(7),
                adapter: "openai_compat".into(),
                instance_key: "vllm-a".into(),
            }
        );
        assert_eq!(
            capability(vllm, "m1", ProbeOutcome::Unknown, None).provider_status(),
            pb::ProviderHealth::Unknown
        );
        assert_eq!(
            select_adapters(&a, "zzz").unwrap_err(),
            CommandError::UnknownAdapter("zzz".into())
        );
    }

    // CONTRACT: K2, P4 — PROVIDER_STATUS reports each instance's gate.
    #[test]
    fn provider_status_reports_the_gate() {
        let a = adapters();
        let vllm = a.get("vllm-a").unwrap();
        let _p1 = vllm.gate.try_acquire().unwrap();
        let _p2 = vllm.gate.try_acquire().unwrap();
        let status = provider_lifecycles(&select_adapters(&a, "vllm-a").unwrap());
        assert_eq!(
            status,
            vec![pb::ProviderLifecycle {
                adapter_key: "vllm-a".into(),
                adapter: "openai_compat".into(),
                state: "running".into(),
                capacity: 4,
                in_flight: 2,
                targets: vec!["m1".into(), "m2".into()],
            }]
        );
    }

    // CONTRACT: K2 — unknown types and refused queries answer ok=false with
    // the command id; no provider is called for a refused path.
    #[monoio::test(timer_enabled = true)]
    async fn refusals_are_correlated() {
        let ctx = CommandContext {
            adapters: Rc::new(adapters()),
            settings: RuntimeSettings::default(),
            observations: Rc::new(ObservationSeq::bound()),
            transport: pb::TransportStatus::default(),
        };
        let resp = handle(
            pb::NodeCommandRequest {
                command_id: "c-1".into(),
                r#type: 99,
                ..Default::default()
            },
            ctx.clone(),
        )
        .await;
        assert_eq!(
            resp,
            pb::NodeCommandResponse {
                command_id: "c-1".into(),
                ok: false,
                error: "unknown command type 99".into(),
                ..Default::default()
            }
        );
        let resp = handle(
            pb::NodeCommandRequest {
                command_id: "c-2".into(),
                r#type: pb::CommandType::OllamaQuery as i32,
                adapter: String::new(),
                path: "/api/pull".into(),
            },
            ctx.clone(),
        )
        .await;
        assert_eq!(resp.command_id, "c-2");
        assert!(!resp.ok);
        assert_eq!(
            resp.error,
            "path `/api/pull` is not allowed: only /api/tags, /api/ps and /api/version"
        );
        let resp = handle(
            pb::NodeCommandRequest {
                command_id: "c-3".into(),
                r#type: pb::CommandType::TransportStatus as i32,
                ..Default::default()
            },
            ctx,
        )
        .await;
        assert!(resp.ok);
        assert_eq!(resp.transport_status, Some(pb::TransportStatus::default()));
    }
}
