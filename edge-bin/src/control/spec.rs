//! What `Control` is configured with ([`ControlSpec`]): the providers of
//! every expected node, how each is driven and which operations it serves,
//! the models' pools, the tunables; and how it is made from the validated
//! `edge.toml` ([`control_spec`]).

use std::sync::Arc;
use std::time::Duration;

use iop_wire::pb;

use super::ids::ProviderKey;
use super::outlier::OutlierPolicy;
use super::prefix::PrefixTreeSpec;
use super::routing::{RoutingPolicy, RoutingSpec};
use crate::config::{self, EdgeConfig};

/// How a provider is driven (U7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchKind {
    /// OpenAI-compatible providers: raw HTTP tunnel.
    Tunnel,
    /// Ollama/native providers: normalized run.
    Normalized,
}

/// A client operation a provider may serve (U3): the profile operations
/// that carry inference requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operation {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/rerank`, `POST /v2/rerank`.
    Rerank,
    /// `POST /v1/score`.
    Score,
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /detokenize`.
    Detokenize,
    /// `POST /v1/audio/transcriptions`.
    Transcriptions,
    /// `POST /v1/audio/translations`.
    Translations,
    /// `POST /v1/audio/speech`.
    Speech,
}

impl Operation {
    /// Every operation, in this order (the bit order of [`Operations`]).
    pub const ALL: [Operation; 13] = [
        Operation::ChatCompletions,
        Operation::Responses,
        Operation::Messages,
        Operation::CountTokens,
        Operation::Completions,
        Operation::Embeddings,
        Operation::Rerank,
        Operation::Score,
        Operation::Tokenize,
        Operation::Detokenize,
        Operation::Transcriptions,
        Operation::Translations,
        Operation::Speech,
    ];

    /// The profile operation's name (U3): what a tunnel carries, what
    /// `/status` and the metrics call it.
    pub fn name(self) -> &'static str {
        match self {
            Operation::ChatCompletions => "chat_completions",
            Operation::Responses => "responses",
            Operation::Messages => "messages",
            Operation::CountTokens => "count_tokens",
            Operation::Completions => "completions",
            Operation::Embeddings => "embeddings",
            Operation::Rerank => "rerank",
            Operation::Score => "score",
            Operation::Tokenize => "tokenize",
            Operation::Detokenize => "detokenize",
            Operation::Transcriptions => "transcriptions",
            Operation::Translations => "translations",
            Operation::Speech => "speech",
        }
    }

    /// Whether a normalized-run provider serves `self` only on a Node that
    /// registered `runs_embeddings` (an older Node ignores
    /// `RunRequest.operation` and would run a chat): such a provider is a
    /// candidate of the operation's lane only while its Node's owner says
    /// so.
    pub fn needs_embedding_runs(self) -> bool {
        self == Operation::Embeddings
    }

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

/// The set of operations a provider serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Operations(u16);

impl Operations {
    /// Every operation: an OpenAI-compatible server whose profile defines
    /// them all (vLLM's).
    pub const ALL: Operations = Operations((1 << Operation::ALL.len()) - 1);
    /// What an Ollama-native adapter serves (normalized runs): chat
    /// completions, and embeddings over `/api/embed` — the latter only on
    /// Nodes that run them (`RegisterRequest.runs_embeddings`, see
    /// [`Operation::needs_embedding_runs`]).
    pub const RUNS: Operations = Operations(1 | 1 << Operation::Embeddings as u16);

    /// The set of `ops`.
    pub fn of(ops: &[Operation]) -> Self {
        Operations(ops.iter().fold(0, |bits, op| bits | op.bit()))
    }

    /// What a provider driven as `kind` serves when its profile defines
    /// every operation: a normalized run chat and embeddings; a tunnel all.
    /// A real tunnel's set is its profile's ([`Operations::of_profile`]).
    pub fn for_kind(kind: DispatchKind) -> Self {
        match kind {
            DispatchKind::Normalized => Operations::RUNS,
            DispatchKind::Tunnel => Operations::ALL,
        }
    }

    /// What a tunnel to a server of `profile` serves: the operations its
    /// profile has a path for.
    pub fn of_profile(profile: &pb::ProtocolProfile) -> Self {
        let served: Vec<Operation> = Operation::ALL
            .into_iter()
            .filter(|op| {
                profile
                    .operation_path(op.name())
                    .is_some_and(|p| !p.is_empty())
            })
            .collect();
        Operations::of(&served)
    }

    /// Whether `op` is in the set.
    pub fn contains(self, op: Operation) -> bool {
        self.0 & op.bit() != 0
    }
}

/// Static description of one provider resource.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlProvider {
    /// Provider id, unique per node.
    pub id: String,
    /// Adapter instance name on the node.
    pub adapter: Arc<str>,
    /// Provider-side target.
    pub target: Arc<str>,
    /// Lease capacity.
    pub capacity: u32,
    /// Long-context lease capacity.
    pub long_context_capacity: u32,
    /// Effective stall timeout copied into pool dispatches (W2).
    pub response_stall_timeout_ms: i64,
    /// Category (P1).
    pub category: pb::ProviderCategory,
    /// Tunnel or normalized run (U7).
    pub kind: DispatchKind,
    /// The operations it serves: it is a candidate for those only.
    pub operations: Operations,
    /// Disabled providers are never candidates.
    pub enabled: bool,
}

/// Static description of one expected node.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlNode {
    /// Node id (equals its TLS identity name, T3).
    pub id: String,
    /// The config pushed at registration (R2).
    pub config: pb::NodeConfigPayload,
    /// Its provider resources.
    pub providers: Vec<ControlProvider>,
}

/// Static description of one external model and its provider pool.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlModel {
    /// External model name (E2).
    pub name: String,
    /// Pool members, in configured order (the deterministic tie-break).
    pub providers: Vec<ProviderKey>,
    /// Most requests waiting for a lease (429 above).
    pub max_queue: u32,
    /// Longest wait for a lease.
    pub queue_timeout: Duration,
    /// Most attempts of one request (pre-commit failover): 1 never retries.
    pub max_attempts: u32,
    /// How a request chooses among the free providers of the pool.
    pub routing: RoutingSpec,
}

/// Tunables of the state machine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tunables {
    /// After a cancel of a dispatched request, how long to wait for its
    /// terminal before the lease is released anyway (cancel settlement).
    pub cancel_settle: Duration,
    /// How often an overlaid provider gets a CAPABILITIES recovery probe (H6).
    pub recovery_probe_interval: Duration,
    /// U6: the longest a dispatched request waits for its response to
    /// start (a tunnel's first frame, a run's first event), from its
    /// dispatch. Past it the run is cancelled on the node and the client is
    /// told (`Action::Abort`). `None`: no deadline.
    pub response_wait_timeout: Option<Duration>,
    /// Passive health (outlier detection); `None`: off.
    pub outlier: Option<OutlierPolicy>,
    /// How long a node removed by a reload may go on running what it was
    /// given before its connection is closed anyway.
    pub retire_grace: Duration,
}

impl Default for Tunables {
    /// The contract's timers only: no response-wait deadline.
    fn default() -> Self {
        Self {
            cancel_settle: Duration::from_secs(30),
            recovery_probe_interval: Duration::from_secs(5),
            response_wait_timeout: None,
            outlier: None,
            retire_grace: Duration::from_secs(30),
        }
    }
}

/// Everything `Control` is configured with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ControlSpec {
    /// Expected nodes.
    pub nodes: Vec<ControlNode>,
    /// Served models.
    pub models: Vec<ControlModel>,
    /// Tunables.
    pub tunables: Tunables,
}

/// Maps the validated config to the control machine's static spec.
///
/// A node with a recipient key is told to require a credential lease on
/// every tunnel when the issuer is configured (C3); config validation keeps
/// that out of insecure mode (T5).
pub fn control_spec(cfg: &EdgeConfig) -> ControlSpec {
    let nodes = cfg
        .nodes
        .iter()
        .map(|n| ControlNode {
            id: n.id.clone(),
            config: cfg.node_config_payload(n, 1),
            providers: n
                .providers
                .iter()
                .map(|p| {
                    let adapter = n.adapter(&p.adapter);
                    let kind = match adapter.map(|a| &a.kind) {
                        Some(config::AdapterKind::Ollama) => DispatchKind::Normalized,
                        _ => DispatchKind::Tunnel,
                    };
                    let operations = match adapter.and_then(|a| a.protocol_profile()) {
                        Some(profile) => Operations::of_profile(&profile.to_pb()),
                        None => Operations::for_kind(kind),
                    };
                    ControlProvider {
                        id: p.id.clone(),
                        adapter: p.adapter.as_str().into(),
                        target: p.target.as_str().into(),
                        capacity: p.capacity,
                        long_context_capacity: p.long_context_capacity,
                        response_stall_timeout_ms: p.response_stall_timeout_ms,
                        category: match p.category {
                            config::ProviderCategory::Api => pb::ProviderCategory::Api,
                            config::ProviderCategory::LocalInference => {
                                pb::ProviderCategory::LocalInference
                            }
                        },
                        kind,
                        operations,
                        enabled: p.enabled,
                    }
                })
                .collect(),
        })
        .collect();
    let models = cfg
        .models
        .iter()
        .map(|m| ControlModel {
            name: m.name.clone(),
            max_queue: m.max_queue,
            queue_timeout: Duration::from_millis(m.queue_timeout_ms),
            max_attempts: m.max_attempts,
            routing: routing_spec(m.routing, &cfg.routing),
            providers: m
                .providers
                .iter()
                .map(|r| ProviderKey {
                    node_id: r.node_id.as_str().into(),
                    provider_id: r.provider_id.as_str().into(),
                })
                .collect(),
        })
        .collect();
    ControlSpec {
        nodes,
        models,
        tunables: Tunables {
            response_wait_timeout: Some(Duration::from_millis(cfg.edge.response_wait_timeout_ms)),
            outlier: outlier_policy(&cfg.outlier_detection),
            retire_grace: Duration::from_millis(cfg.edge.drain_grace_ms),
            ..Tunables::default()
        },
    }
}

/// A model's routing spec: its policy with the `[routing]` settings.
pub fn routing_spec(policy: RoutingPolicy, settings: &config::RoutingSettings) -> RoutingSpec {
    RoutingSpec {
        policy,
        tree: PrefixTreeSpec {
            budget_bytes: usize::try_from(settings.prefix_tree_bytes).unwrap_or(usize::MAX),
            prefix_bytes_max: usize::try_from(settings.prefix_bytes_max).unwrap_or(usize::MAX),
        },
        match_threshold_pct: settings.match_threshold_percent,
        balance_abs_threshold: settings.balance_abs_threshold,
        balance_rel_threshold_pct: settings.balance_rel_threshold_percent,
        affinity_wait: Duration::from_millis(settings.affinity_wait_ms),
    }
}

/// The passive-health policy of `[outlier_detection]`; `None` when off.
pub fn outlier_policy(od: &config::OutlierDetection) -> Option<OutlierPolicy> {
    od.enabled.then(|| OutlierPolicy {
        consecutive_failures: od.consecutive_failures,
        base_ejection_time: Duration::from_millis(od.base_ejection_time_ms),
        max_ejection_time: Duration::from_millis(od.max_ejection_time_ms),
        max_ejection_percent: od.max_ejection_percent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{protocol_profile, BaseUrl, ProfileName};

    /// The operations of a tunnel to each profile: those its profile has a
    /// path for, and no other.
    #[test]
    fn a_tunnel_serves_what_its_profile_has_a_path_for() {
        use Operation::*;
        let url = BaseUrl::parse("http://127.0.0.1:8000/p").expect("a base URL");
        let chat_family = [ChatCompletions, Responses, Messages, CountTokens];
        let of = |profile| Operations::of_profile(&protocol_profile(profile, &url).to_pb());
        let with = |more: &[Operation]| Operations::of(&[&chat_family[..], more].concat());
        let every_but_speech: Vec<Operation> = Operation::ALL
            .into_iter()
            .filter(|op| *op != Speech)
            .collect();
        assert_eq!(of(ProfileName::Vllm), Operations::of(&every_but_speech));
        assert_eq!(
            of(ProfileName::Sglang),
            with(&[Completions, Embeddings, Rerank, Score, Tokenize, Detokenize])
        );
        assert_eq!(
            of(ProfileName::LlamaCpp),
            with(&[Completions, Embeddings, Rerank, Tokenize, Detokenize])
        );
        assert_eq!(
            of(ProfileName::OpenAi),
            with(&[
                Completions,
                Embeddings,
                Transcriptions,
                Translations,
                Speech
            ])
        );
        assert!(!of(ProfileName::OpenAi).contains(Score));
        // A normalized run serves chat and embeddings, and nothing else.
        let runs = Operations::for_kind(DispatchKind::Normalized);
        let served: Vec<Operation> = Operation::ALL
            .into_iter()
            .filter(|op| runs.contains(*op))
            .collect();
        assert_eq!(served, [ChatCompletions, Embeddings]);
        // Every operation is a profile operation (all but `models`).
        let mut names: Vec<&str> = Operation::ALL.iter().map(|op| op.name()).collect();
        names.sort_unstable();
        let mut profile_ops = iop_wire::profile::OPERATIONS[1..].to_vec();
        profile_ops.sort_unstable();
        assert_eq!(names, profile_ops);
    }
}
