//! The Edge configuration file (`edge-bin --config edge.toml`).
//!
//! ```text
//! edge.toml ──read──► text ──toml + serde (unknown keys rejected, key path kept)──► Raw*
//!     Raw* ──validate (names, ranges, references, URLs)──► EdgeConfig
//!     EdgeConfig::validate_files ──► the TLS files exist and are readable
//!     EdgeConfig::check_operational_paths ──► the access log file and the usage
//!         file can be opened for appending (fatal at startup; on reload a bad
//!         one keeps the running writer)
//!     NodeSpec::config_payload ──► pb::NodeConfigPayload for RegisterResponse (R2, U4)
//! running, next ──ConfigDiff::between──► what a reload changes ([`diff`])
//! ```
//!
//! Parse, don't validate: the `Raw*` structs mirror the file and stay private;
//! the public types hold only checked values (socket addresses, parsed base
//! URLs, resolved references, numbers in range). [`EdgeConfig::parse`] is pure
//! (no file system access), so tests and tools can check a file without its
//! certificates; [`EdgeConfig::load`] reads the file, parses it and checks the
//! TLS files and the files the Edge writes; [`EdgeConfig::load_structure`]
//! does all but the last, for a reload.
//!
//! Every error is a [`ConfigError`] that displays as `<file>: <key>: <reason>`,
//! with `key` the dotted path of the offending key (`nodes[0].providers[1].capacity`)
//! or `-` when no key applies (a TOML syntax error, whose reason carries the
//! line and column). The binary prints it and exits 1 (S3).
//!
//! The credential plane (`[credentials]`, `[[credentials.slots]]`, per-node
//! `recipient_key`, `[[client_keys]]`, C1–C5) is validated here too, but this
//! module never reads a secret: a slot names where its secret lives
//! (`secret_file` or `secret_env`); `crate::plane::credentials` reads it at startup.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use iop_engine::config::{
    check_name, check_trust_domain, open_regular_file, parse_toml, read_config_file, resolve_path,
    split_host_port,
};
use iop_engine::http::Scheme;
use iop_engine::keys::decode_recipient_public_key;
use iop_engine::tls::{HttpsFiles, UpstreamTls, UpstreamTlsSettings};
use iop_wire::checks::effective_stall_timeout;
use iop_wire::lease::{
    decode_hex, MAX_HEADER_FORMAT_BYTES, MAX_HEADER_NAME_BYTES, SECRET_PLACEHOLDER,
};
use iop_wire::limits::DEFAULT_MAX_FRAME_BYTES;
use iop_wire::pb;
use x25519_dalek::{PublicKey, StaticSecret};

// The config error (`<file>: <key>: <reason>`), the TLS file set and the
// limits on identity names and the trust domain are shared with the Node.
pub use iop_engine::config::{ConfigError, TlsFiles, MAX_NAME_BYTES, MAX_TRUST_DOMAIN_BYTES};
pub use iop_engine::trace::TracingSpec;

/// Default `edge.max_request_body_bytes`: 8 MiB; a larger client body gets 413.
mod checks;
mod defaults;
pub mod diff;
mod raw;
#[cfg(test)]
mod tests;
mod validate;

pub use defaults::*;
pub use diff::{Apply, ConfigDiff};
#[doc(hidden)]
pub use raw::deserialize_file_format;

use checks::*;
use raw::*;
use validate::*;

// ---------------------------------------------------------------------------
// The validated configuration
// ---------------------------------------------------------------------------

/// The validated Edge configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeConfig {
    /// The file this was read from (for messages).
    pub source: PathBuf,
    /// The `[edge]` table.
    pub edge: EdgeSettings,
    /// The TLS files, resolved against the config file's directory; `None`
    /// exactly when `edge.insecure_plaintext_nodes` is set (T5).
    pub tls: Option<TlsFiles>,
    /// `[edge.client_tls]`: the client listener serves HTTPS with this
    /// certificate (and requires client certificates chaining to
    /// `client_ca` when set); `None`: plain HTTP.
    pub client_tls: Option<HttpsFiles>,
    /// `[edge.access_log]`: where the one line per request goes and how it
    /// is written (default: text lines on stderr).
    pub access_log: AccessLogSpec,
    /// `[edge.usage_log] path`: the usage file (JSON lines, one per
    /// inference request; `crate::plane::usage`); `None` = none.
    pub usage_log: Option<PathBuf>,
    /// `[edge] budget_file`: where the Edge keeps the token budgets' usage
    /// across restarts (`crate::plane::budget_file`); required when a
    /// client key has `tokens_per_day` or `tokens_per_month`.
    pub budget_file: Option<PathBuf>,
    /// The configured nodes, in file order; ids are unique.
    pub nodes: Vec<NodeSpec>,
    /// The external models, in file order; names are unique.
    pub models: Vec<ModelSpec>,
    /// The credential plane (`[credentials]`, C1–C5); `None` = disabled.
    /// Never set together with `edge.insecure_plaintext_nodes` (T5).
    pub credentials: Option<CredentialsSpec>,
    /// Client API keys (`[[client_keys]]`), stored hashed. Empty = the
    /// client surface is open; otherwise every request but `/livez`,
    /// `/readyz` and `/metrics` needs one of them.
    pub client_keys: Vec<ClientKeySpec>,
    /// Passive health (`[outlier_detection]`).
    pub outlier_detection: OutlierDetection,
    /// The routing policies' settings (`[routing]`).
    pub routing: RoutingSettings,
    /// `[cluster]`: this Edge is one of several sharing the fleet through
    /// etcd (`docs/multi-edge.md`); `None`: a single Edge.
    pub cluster: Option<ClusterSpec>,
    /// `[tracing]`: spans exported over OTLP (`docs/tracing.md`); `None`:
    /// tracing is off (no `otlp_endpoint`).
    pub tracing: Option<TracingSpec>,
}

/// The `[cluster]` table: where etcd is and how this Edge keeps its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// The cluster's name: its keys live under `/iop/<name>/`.
    pub name: String,
    /// etcd client endpoints, `host:port` (plain HTTP, the v3 JSON API).
    pub etcd_endpoints: Vec<String>,
    /// The TTL of this Edge's etcd lease.
    pub lease_ttl_sec: u64,
    /// How often the lease is kept alive; the Edge fences what it owns
    /// `lease_ttl_sec − keepalive_interval_sec` after the last
    /// acknowledged keep-alive.
    pub keepalive_interval_sec: u64,
    /// Timeout of one etcd call.
    pub etcd_timeout_ms: u64,
    /// The peer listener (`peer_listen`): other Edges forward requests for
    /// the nodes this Edge owns to it, over mTLS with the `[tls]` identity.
    /// `None`: this Edge takes no forwarded request, so none is forwarded
    /// to it (it still forwards its own requests to Edges that have one).
    pub peer_listen: Option<SocketAddr>,
}

/// How a model chooses among its free providers (`[[models]] routing`;
/// `crate::control::routing` decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RoutingPolicy {
    /// The least loaded free candidate; ties go to configured order.
    #[default]
    LeastLoaded,
    /// Affinity by session key, consistent-hashed over the pool.
    Session,
    /// The provider that served the longest prefix of the prompt.
    Prefix,
}

impl RoutingPolicy {
    /// Every policy, in this order.
    pub const ALL: [RoutingPolicy; 3] = [
        RoutingPolicy::LeastLoaded,
        RoutingPolicy::Session,
        RoutingPolicy::Prefix,
    ];

    /// The config, metrics and `/status` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingPolicy::LeastLoaded => "least_loaded",
            RoutingPolicy::Session => "session",
            RoutingPolicy::Prefix => "prefix",
        }
    }

    /// The policy spelled `text`.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == text)
    }
}

/// The `[routing]` table: the settings of the models' routing policies
/// (`crate::control::routing`), shared by every model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingSettings {
    /// The most bytes a `prefix` model's tree holds (LRU beyond).
    pub prefix_tree_bytes: u64,
    /// How much of a prompt the tree considers: its first this many bytes.
    pub prefix_bytes_max: u64,
    /// The smallest share of a prompt, in percent, a match must cover to
    /// route by it.
    pub match_threshold_percent: u32,
    /// A preferred provider with more than this many more requests in
    /// flight than the least loaded one…
    pub balance_abs_threshold: u32,
    /// …and more than this percentage of its load is passed over.
    pub balance_rel_threshold_percent: u32,
    /// The longest a request waits for its preferred provider when that
    /// one is full (0: never).
    pub affinity_wait_ms: u64,
}

impl Default for RoutingSettings {
    fn default() -> Self {
        Self {
            prefix_tree_bytes: DEFAULT_PREFIX_TREE_BYTES,
            prefix_bytes_max: DEFAULT_PREFIX_BYTES_MAX,
            match_threshold_percent: DEFAULT_MATCH_THRESHOLD_PERCENT,
            balance_abs_threshold: DEFAULT_BALANCE_ABS_THRESHOLD,
            balance_rel_threshold_percent: DEFAULT_BALANCE_REL_THRESHOLD_PERCENT,
            affinity_wait_ms: DEFAULT_AFFINITY_WAIT_MS,
        }
    }
}

/// The `[outlier_detection]` table: providers that fail in a row are taken
/// out of rotation for a while (`crate::control::outlier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutlierDetection {
    /// Whether providers are ejected at all.
    pub enabled: bool,
    /// Consecutive failures that eject a provider.
    pub consecutive_failures: u32,
    /// The first ejection's length.
    pub base_ejection_time_ms: u64,
    /// The longest ejection.
    pub max_ejection_time_ms: u64,
    /// At most this share of a model's providers is ejected at once (at
    /// least one); 0 never ejects.
    pub max_ejection_percent: u32,
}

impl Default for OutlierDetection {
    fn default() -> Self {
        Self {
            enabled: true,
            consecutive_failures: DEFAULT_CONSECUTIVE_FAILURES,
            base_ejection_time_ms: DEFAULT_BASE_EJECTION_TIME_MS,
            max_ejection_time_ms: DEFAULT_MAX_EJECTION_TIME_MS,
            max_ejection_percent: DEFAULT_MAX_EJECTION_PERCENT,
        }
    }
}

/// The `[credentials]` table: the Edge issuer key and the credential slots
/// (C1). Holds no secret: only where each one lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialsSpec {
    /// The Ed25519 issuer key file, resolved against the config file's
    /// directory (`edge-bin keys issuer --out …` writes one).
    pub issuer_key: PathBuf,
    /// Lifetime of an issued lease: `expires_at = not_before + lease_ttl_ms`.
    pub lease_ttl_ms: u64,
    /// The credential slots, in file order; names are unique.
    pub slots: Vec<SlotSpec>,
}

/// One credential slot (`[[credentials.slots]]`): a named provider secret,
/// the header it is injected as, its revision and the providers it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSpec {
    /// Slot name, unique (it goes into every binding).
    pub name: String,
    /// Where the secret is read from at startup.
    pub secret: SecretSource,
    /// Header the Node injects, e.g. `Authorization` or `x-api-key`.
    pub header_name: String,
    /// Header value format containing `{secret}`, e.g. `Bearer {secret}`.
    pub header_format: String,
    /// Credential revision of the secret (bound into every lease, C5).
    pub revision: u64,
    /// Revisions that must never be used; if `revision` is among them the
    /// slot issues no lease (C3).
    pub revoked_revisions: Vec<u64>,
    /// A disabled slot issues no lease (C3).
    pub enabled: bool,
    /// The providers (routes) it serves; a provider is served by at most one
    /// slot.
    pub providers: Vec<ProviderRef>,
}

impl SlotSpec {
    /// True when the slot may issue leases: enabled and its revision not
    /// revoked.
    pub fn is_usable(&self) -> bool {
        self.enabled && !self.revoked_revisions.contains(&self.revision)
    }
}

/// Where a slot's secret lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// A file (resolved against the config file's directory) holding the
    /// secret; one trailing newline is dropped.
    File(PathBuf),
    /// An environment variable of the Edge process.
    Env(String),
}

/// One client API key (`[[client_keys]]`): the principal it authenticates
/// and the blake3 hash of the key (`edge-bin keys hash-client-key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientKeySpec {
    /// The principal bound into every lease issued for its requests.
    pub principal: String,
    /// blake3 of the key bytes.
    pub key_hash: [u8; 32],
    /// `scopes = ["admin"]`: the key may also use the `/admin` routes (and
    /// read everything `metrics` may).
    /// Every key may use the inference routes, `/v1/models` and `/status`
    /// (filtered to its models).
    pub admin: bool,
    /// `scopes = ["metrics"]`: the key may read `/metrics` under
    /// `edge.metrics_access = "key"`, and the whole of `/status`.
    pub metrics: bool,
    /// `max_concurrent`, `requests_per_minute`, `tokens_per_minute`: the
    /// principal's limits (one key of a principal sets them; the principal's
    /// other keys share them).
    pub limits: LimitSpec,
    /// `tokens_per_day`, `tokens_per_month`: the principal's token budgets
    /// (set, like the limits, on one key of the principal).
    pub budgets: BudgetSpec,
    /// `models = [...]`: the only models the key may use; `None` = every
    /// model.
    pub models: Option<Vec<String>>,
    /// `priority`: its requests' class in a model's queue (higher first;
    /// README "Sharing a model between keys").
    pub priority: u8,
    /// `weight`: its share against the other principals of its class.
    pub weight: u32,
}

/// The named priority classes (`priority = "…"` in `[[client_keys]]` and
/// the `x-iop-priority` request header), and their numbers.
pub const PRIORITY_CLASSES: [(&str, u8); 3] =
    [("interactive", 90), ("standard", 50), ("batch", 10)];
/// The class of a key that names none.
pub const DEFAULT_PRIORITY: u8 = 50;
/// The highest priority number.
pub const MAX_PRIORITY: u8 = 100;
/// The largest `weight`.
pub const MAX_WEIGHT: u32 = 1000;

/// A priority class by name or number (`"batch"`, `"10"`); `None` for
/// anything else.
pub fn priority_class(text: &str) -> Option<u8> {
    PRIORITY_CLASSES
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(text))
        .map(|&(_, n)| n)
        .or_else(|| text.parse::<u8>().ok().filter(|&n| n <= MAX_PRIORITY))
}

/// The scope of a client key that may use the `/admin` routes.
pub const ADMIN_SCOPE: &str = "admin";
/// The scope of a client key that may read `/metrics` and all of `/status`.
pub const METRICS_SCOPE: &str = "metrics";

/// Who may read `GET /metrics` (`edge.metrics_access`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsAccess {
    /// `"open"` (default): anyone who reaches the client listener, without a
    /// key (a Prometheus scrape on an internal network).
    #[default]
    Open,
    /// `"key"`: a client key with `scopes = ["metrics"]` or `["admin"]`.
    Key,
}

/// The `[edge]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeSettings {
    /// Our identity name: `spiffe://<trust_domain>/edge/<name>` (T2).
    pub name: String,
    /// SPIFFE trust domain shared by the Edge and its Nodes (T2).
    pub trust_domain: String,
    /// The OpenAI-compatible HTTP listener.
    pub client_listen: SocketAddr,
    /// The Node listener (mTLS, or plain TCP in insecure mode).
    pub node_listen: SocketAddr,
    /// Largest accepted client request body; larger gets 413.
    pub max_request_body_bytes: usize,
    /// Largest accepted upload (`/v1/audio/transcriptions`,
    /// `/v1/audio/translations`) with a `Content-Length`: streamed to the
    /// provider as it arrives, never held whole; larger gets 413.
    pub max_upload_body_bytes: u64,
    /// Largest accepted frame on a Node connection (T1).
    pub max_frame_bytes: usize,
    /// Dev flag: Nodes connect over plain TCP and the credential plane is
    /// disabled (T5).
    pub insecure_plaintext_nodes: bool,
    /// `allow_anonymous = true`: with no `[[client_keys]]`, every client is
    /// served without a key. Without it an Edge with no keys does not
    /// start, and a reload that removes the last key is refused
    /// ([`EdgeConfig::check_open_access`]).
    pub allow_anonymous: bool,
    /// Who may read `GET /metrics` (`metrics_access`).
    pub metrics_access: MetricsAccess,
    /// One pull of the nodes' `/metrics` series serves the scrapes of this
    /// long after it (0: every scrape pulls; scrapes at the same time
    /// still share one pull).
    pub node_metrics_max_age_ms: u64,
    /// After SIGTERM/SIGINT, how long in-flight client requests may finish
    /// before the Edge exits anyway (0 = exit as soon as the listeners are
    /// closed).
    pub drain_grace_ms: u64,
    /// Each run's flow-control window on its node connection, in charged
    /// bytes: what the Edge buffers for one run at most while its client
    /// does not read.
    pub flow_window_bytes: u64,
    /// A client socket that takes no bytes of a response for this long is
    /// cut off: its run is cancelled on the Node, its lease released.
    pub client_write_stall_timeout_ms: u64,
    /// A dispatched request whose response has not started (no tunnel
    /// frame, no run event) this long after its dispatch is cancelled on
    /// the Node and answered 504 (U6).
    pub response_wait_timeout_ms: u64,
    /// Deadlines, caps and bounds of both listeners.
    pub limits: ListenerLimits,
}

/// The front door's limits: `[edge]` keys of the same names, defaults in
/// [`front_door`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// A whole request head must arrive within this (from the accept for a
    /// connection's first request, from its first byte for later ones);
    /// else 408 and close.
    pub client_head_timeout_ms: u64,
    /// A request body may pause at most this long between reads; else 408
    /// and close.
    pub client_body_idle_timeout_ms: u64,
    /// A request body must be complete this long after its first read
    /// began, plus one second per `client_body_min_rate_bytes_per_sec`
    /// bytes that arrived; else 408 and close.
    pub client_body_grace_ms: u64,
    /// The slowest average a request body may arrive at once its grace has
    /// passed (0: no minimum rate, only the idle bound).
    pub client_body_min_rate_bytes_per_sec: u64,
    /// A kept-alive connection without a request for this long is closed.
    pub client_keep_alive_timeout_ms: u64,
    /// Open client connections (process-wide, split evenly over the
    /// cores). At the cap the Edge stops accepting: new connections wait in
    /// the kernel's accept backlog until one closes.
    pub max_client_connections: u64,
    /// Open client connections of one peer address (IPv6: its `/64`), for
    /// the whole process. A connection past it is answered 429
    /// `too_many_connections` and closed.
    pub max_client_connections_per_peer: u64,
    /// After an early answer (413, 431, 400, 503 while draining): longest
    /// time spent reading and discarding what the client still sends
    /// (0: no lingering, just close).
    pub client_linger_time_ms: u64,
    /// Longest pause while lingering.
    pub client_linger_idle_timeout_ms: u64,
    /// Most bytes discarded while lingering.
    pub client_linger_max_bytes: u64,
    /// A node's TLS handshake must finish within this; else the connection
    /// is closed and counted.
    pub node_handshake_timeout_ms: u64,
    /// Node TLS handshakes in progress (process-wide, split evenly over the
    /// cores). At the cap the Edge stops accepting node connections: they
    /// wait in the kernel's accept backlog (a reconnect burst is shed by
    /// waiting, not by failing).
    pub max_node_handshakes: u64,
    /// Node TLS handshakes in progress from one peer address (IPv6: its
    /// `/64`), for the whole process. A connection past it is closed at
    /// once (the Node redials).
    pub max_node_handshakes_per_peer: u64,
    /// A new node connection must send its first byte (the TLS ClientHello)
    /// within this; else it is closed and counted.
    pub node_first_byte_timeout_ms: u64,
    /// Deepest nesting of arrays/objects in a request body; deeper gets 400.
    pub max_json_depth: u64,
    /// Most values (array elements and object members, counted through the
    /// whole body) in a request body; more gets 400.
    pub max_json_elements: u64,
    /// Most members of a request body's top-level object; more gets 400.
    pub max_json_members: u64,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        use front_door::*;
        Self {
            client_head_timeout_ms: CLIENT_HEAD_TIMEOUT_MS,
            client_body_idle_timeout_ms: CLIENT_BODY_IDLE_TIMEOUT_MS,
            client_body_grace_ms: CLIENT_BODY_GRACE_MS,
            client_body_min_rate_bytes_per_sec: CLIENT_BODY_MIN_RATE_BYTES_PER_SEC,
            client_keep_alive_timeout_ms: CLIENT_KEEP_ALIVE_TIMEOUT_MS,
            max_client_connections: MAX_CLIENT_CONNECTIONS,
            max_client_connections_per_peer: MAX_CLIENT_CONNECTIONS_PER_PEER,
            client_linger_time_ms: CLIENT_LINGER_TIME_MS,
            client_linger_idle_timeout_ms: CLIENT_LINGER_IDLE_TIMEOUT_MS,
            client_linger_max_bytes: CLIENT_LINGER_MAX_BYTES,
            node_handshake_timeout_ms: NODE_HANDSHAKE_TIMEOUT_MS,
            max_node_handshakes: MAX_NODE_HANDSHAKES,
            max_node_handshakes_per_peer: MAX_NODE_HANDSHAKES_PER_PEER,
            node_first_byte_timeout_ms: NODE_FIRST_BYTE_TIMEOUT_MS,
            max_json_depth: MAX_JSON_DEPTH,
            max_json_elements: MAX_JSON_ELEMENTS,
            max_json_members: MAX_JSON_MEMBERS,
        }
    }
}

/// One configured Node (`[[nodes]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    /// The node id; must equal the Node's certificate name (T3).
    pub id: String,
    /// Adapter instances, in file order; names are unique on this node.
    pub adapters: Vec<AdapterSpec>,
    /// Provider resources, in file order; ids are unique on this node.
    pub providers: Vec<ProviderSpec>,
    /// The Node's X25519 recipient public key (`recipient_key =
    /// "x25519:…"`): leases for this node are sealed to it (C1). With an
    /// issuer configured, a node with a key is managed: its tunnels must
    /// carry a lease (C3).
    pub recipient_key: Option<PublicKey>,
}

/// One adapter instance of a Node (`[[nodes.adapters]]`, P4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSpec {
    /// Instance name, unique on its node; defaults to the kind's name (P4).
    pub name: String,
    /// Adapter type and its settings.
    pub kind: AdapterKind,
    /// Where the provider server listens.
    pub base_url: BaseUrl,
    /// How the Node verifies an `https://` provider's certificate.
    pub tls: ProviderTlsSpec,
    /// Node-local capacity gate (P4); 0 = unlimited.
    pub capacity: u32,
    /// An OpenAI-compatible adapter's health path (under the base URL's
    /// prefix), replacing its profile's: for a server that serves health
    /// elsewhere. `None`: the profile's.
    pub health_path: Option<String>,
}

impl AdapterSpec {
    /// The resolved protocol profile of an OpenAI-compatible adapter (U4):
    /// its profile at its base URL, with its own health path if it has
    /// one; `None` for an Ollama adapter.
    pub fn protocol_profile(&self) -> Option<ProtocolProfileSpec> {
        let AdapterKind::OpenAiCompat { profile } = self.kind else {
            return None;
        };
        let mut spec = protocol_profile(profile, &self.base_url);
        if let Some(path) = &self.health_path {
            spec.health_path = self.base_url.join(path);
        }
        Some(spec)
    }
}

/// Provider TLS settings of an adapter (`ca_file`,
/// `tls_insecure_skip_verify`); only for an `https://` base URL. Sent to the
/// Node in `AdapterConfig.tls` (a CA certificate is public: C4 holds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProviderTlsSpec {
    /// A private CA bundle (resolved against the config file's directory),
    /// the only trust anchors for this provider; `None`: the Node's system
    /// store (bundled Mozilla roots as a fallback).
    pub ca_file: Option<PathBuf>,
    /// The bundle's PEM, read by [`EdgeConfig::load`] (and on every reload,
    /// so a rotated CA file reaches the Nodes); `None` until then.
    pub ca_pem: Option<String>,
    /// Dev only: the Node accepts any provider certificate.
    pub insecure_skip_verify: bool,
}

impl ProviderTlsSpec {
    /// The wire form, `None` when there is nothing to say (the Node's
    /// defaults).
    pub fn to_pb(&self) -> Option<pb::ProviderTlsConfig> {
        if self.ca_pem.is_none() && !self.insecure_skip_verify {
            return None;
        }
        Some(pb::ProviderTlsConfig {
            ca_pem: self.ca_pem.clone().unwrap_or_default(),
            insecure_skip_verify: self.insecure_skip_verify,
        })
    }
}

/// The type of an adapter instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterKind {
    /// An OpenAI-compatible server speaking the given protocol profile.
    OpenAiCompat {
        /// Which server family, fixing the operation paths (U4).
        profile: ProfileName,
    },
    /// Ollama's native API.
    Ollama,
}

impl AdapterKind {
    /// The kind's config spelling, also the default adapter name (P4).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::OpenAiCompat { .. } => "openai_compat",
            Self::Ollama => "ollama",
        }
    }
}

/// A protocol profile of an OpenAI-compatible server (U4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProfileName {
    /// OpenAI's API (health = `/v1/models`).
    OpenAi,
    /// vLLM.
    Vllm,
    /// llama.cpp's `llama-server`.
    LlamaCpp,
    /// SGLang.
    Sglang,
}

impl ProfileName {
    /// Every profile, in documentation order.
    pub const ALL: [ProfileName; 4] = [Self::OpenAi, Self::Vllm, Self::LlamaCpp, Self::Sglang];

    /// The config and wire spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::OpenAi => "openai",
            Self::Vllm => "vllm",
            Self::LlamaCpp => "llama_cpp",
            Self::Sglang => "sglang",
        }
    }

    /// The profile spelled `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

/// One provider resource of a Node (`[[nodes.providers]]`, P1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderSpec {
    /// Provider id, unique on its node.
    pub id: String,
    /// Name of the adapter instance (on the same node) that serves it.
    pub adapter: String,
    /// Provider-side model name.
    pub target: String,
    /// Edge lease capacity (> 0).
    pub capacity: u32,
    /// Leases of it that long-context requests may hold (≤ `capacity`).
    pub long_context_capacity: u32,
    /// Copied into every pool dispatch to this provider (W2); 0 = Node default.
    pub response_stall_timeout_ms: i64,
    /// Resource category shown in snapshots (P1).
    pub category: ProviderCategory,
    /// Whether it takes traffic.
    pub enabled: bool,
}

/// Category of a provider resource (P1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderCategory {
    /// A remote API.
    Api,
    /// Inference on the Node's own hardware.
    LocalInference,
}

impl ProviderCategory {
    /// The config and snapshot spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::LocalInference => "local_inference",
        }
    }
}

/// One external model (`[[models]]`, E2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The OpenAI `model` clients ask for.
    pub name: String,
    /// Candidate providers; non-empty, unique, each resolving to a configured
    /// provider.
    pub providers: Vec<ProviderRef>,
    /// Requests estimated at or above this many tokens are long-context;
    /// `None` = no request is.
    pub long_context_threshold_tokens: Option<u64>,
    /// Most requests waiting for a lease.
    pub max_queue: u32,
    /// Longest wait for a lease.
    pub queue_timeout_ms: u64,
    /// Most attempts of one request: a failure before anything reached the
    /// client is retried on another provider until this many (1: never).
    pub max_attempts: u32,
    /// `owned_by` shown in `/v1/models`.
    pub owned_by: String,
    /// How a request chooses among the free providers of the pool
    /// (`routing`): by default `prefix` for a pool of two or more
    /// OpenAI-compatible providers, else `least_loaded`.
    pub routing: RoutingPolicy,
}

/// A reference `"<node id>/<provider id>"` to a provider resource.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProviderRef {
    /// The node id.
    pub node_id: String,
    /// The provider id on that node.
    pub provider_id: String,
}

impl fmt::Display for ProviderRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.node_id, self.provider_id)
    }
}

/// A provider base URL: `http://host:port[/prefix]`, or
/// `https://host[:port][/prefix]` (port 443 when omitted) for a provider the
/// Node reaches over TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    scheme: Scheme,
    host: String,
    port: u16,
    path_prefix: String,
}

impl BaseUrl {
    /// Parses `http://host:port[/prefix]` or `https://host[:port][/prefix]`.
    /// The host is a DNS name, an IPv4 address or a bracketed IPv6 address;
    /// the port is required for `http` and defaults to 443 for `https`; a
    /// trailing `/` is dropped. The error is the reason, for a
    /// [`ConfigError`].
    pub fn parse(text: &str) -> Result<Self, String> {
        const FORM: &str = "expected http://host:port[/prefix] or https://host[:port][/prefix]";
        let has_scheme = |scheme: &str| {
            text.get(..scheme.len())
                .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
        };
        let (scheme, rest) = if has_scheme("http://") {
            (Scheme::Http, &text[7..])
        } else if has_scheme("https://") {
            (Scheme::Https, &text[8..])
        } else {
            return Err(format!("{text:?}: {FORM}"));
        };
        if rest.contains(['?', '#']) {
            return Err(format!(
                "{text:?}: must not have a query or fragment; {FORM}"
            ));
        }
        if rest.contains(|c: char| c.is_whitespace() || c.is_control()) {
            return Err(format!("{text:?}: must not contain whitespace; {FORM}"));
        }
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        if authority.contains('@') {
            return Err(format!("{text:?}: must not contain user info; {FORM}"));
        }
        let names_port = match authority.strip_prefix('[') {
            Some(bracketed) => !bracketed.ends_with(']'),
            None => authority.contains(':'),
        };
        let (host, port) = if scheme == Scheme::Https && !names_port {
            split_host_port(&format!("{authority}:{}", scheme.default_port()))
        } else {
            split_host_port(authority)
        }
        .map_err(|why| format!("{text:?}: {why}; {FORM}"))?;
        let path_prefix = path.trim_end_matches('/');
        if path_prefix.contains("//") {
            return Err(format!("{text:?}: path has an empty segment; {FORM}"));
        }
        if path_prefix.ends_with("/v1") {
            return Err(format!(
                "{text:?}: drop the trailing /v1: operation paths already start with /v1"
            ));
        }
        Ok(Self {
            scheme,
            host,
            port,
            path_prefix: path_prefix.to_owned(),
        })
    }

    /// `http` or `https`.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Whether the Node reaches this provider over TLS (`https`).
    pub fn is_tls(&self) -> bool {
        self.scheme == Scheme::Https
    }

    /// The host: a DNS name, an IPv4 address, or an IPv6 address without brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The path prefix: empty, or `/`-led without a trailing `/`.
    pub fn path_prefix(&self) -> &str {
        &self.path_prefix
    }

    /// `scheme://host:port`, without the path prefix, the host lowercased:
    /// the origin the Node's adapter resolves and a credential lease is
    /// bound to ([`iop_wire::lease::upstream_origin`]).
    pub fn origin(&self) -> String {
        iop_wire::lease::upstream_origin(
            self.scheme.as_str(),
            &self.host.to_ascii_lowercase(),
            self.port,
        )
    }

    /// `path` (which starts with `/`) under the path prefix.
    pub fn join(&self, path: &str) -> String {
        format!("{}{}", self.path_prefix, path)
    }
}

impl fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.origin(), self.path_prefix)
    }
}

/// A resolved protocol profile (U3, U4): where each operation lives on the
/// provider and how it authenticates. `base_url` is the origin; every path
/// already includes the base URL's path prefix. It travels to the Node in
/// `OpenAICompatAdapterConfig.protocol_profile`; tunnels carry only the
/// operation name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolProfileSpec {
    /// The profile.
    pub name: ProfileName,
    /// `http://host:port`.
    pub base_url: String,
    /// Path of operation `models`.
    pub models_path: String,
    /// Path of operation `chat_completions`.
    pub chat_completions_path: String,
    /// Path of operation `messages`.
    pub messages_path: String,
    /// Path of operation `count_tokens`.
    pub count_tokens_path: String,
    /// Path of operation `responses`.
    pub responses_path: String,
    /// Path of operation `completions`; this and the paths below are empty
    /// when the profile does not serve the operation.
    pub completions_path: String,
    /// Path of operation `embeddings`.
    pub embeddings_path: String,
    /// Path of operation `rerank`.
    pub rerank_path: String,
    /// Path of operation `score`.
    pub score_path: String,
    /// Path of operation `tokenize`.
    pub tokenize_path: String,
    /// Path of operation `detokenize`.
    pub detokenize_path: String,
    /// Path of operation `transcriptions`.
    pub transcriptions_path: String,
    /// Path of operation `translations`.
    pub translations_path: String,
    /// Path of operation `speech`.
    pub speech_path: String,
    /// Path probed for health (W4, H6).
    pub health_path: String,
    /// Auth header name; the secret arrives only in a credential lease (C4).
    pub auth_header_name: String,
    /// Auth header value with a `{secret}` placeholder.
    pub auth_header_format: String,
}

impl ProtocolProfileSpec {
    /// The wire form (U4).
    pub fn to_pb(&self) -> pb::ProtocolProfile {
        pb::ProtocolProfile {
            name: self.name.as_str().to_owned(),
            base_url: self.base_url.clone(),
            models_path: self.models_path.clone(),
            chat_completions_path: self.chat_completions_path.clone(),
            messages_path: self.messages_path.clone(),
            count_tokens_path: self.count_tokens_path.clone(),
            responses_path: self.responses_path.clone(),
            completions_path: self.completions_path.clone(),
            embeddings_path: self.embeddings_path.clone(),
            rerank_path: self.rerank_path.clone(),
            score_path: self.score_path.clone(),
            tokenize_path: self.tokenize_path.clone(),
            detokenize_path: self.detokenize_path.clone(),
            transcriptions_path: self.transcriptions_path.clone(),
            translations_path: self.translations_path.clone(),
            speech_path: self.speech_path.clone(),
            health_path: self.health_path.clone(),
            auth_header_name: self.auth_header_name.clone(),
            auth_header_format: self.auth_header_format.clone(),
        }
    }
}

/// Resolves `profile` at `base_url` (U4). Every profile serves the same
/// chat-family paths (`/v1/models`, `/v1/chat/completions`, `/v1/messages`,
/// `/v1/messages/count_tokens`, `/v1/responses`) and authenticates with
/// `Authorization: Bearer {secret}`; they differ in the health path
/// (`/v1/models` for `openai`, `/health` for `vllm`, `llama_cpp` and
/// `sglang`) and in which of the other operations they serve (an empty path:
/// not served, and such a provider is no candidate for it):
///
/// | operation     | path              | openai | vllm | llama_cpp | sglang |
/// |---------------|-------------------|--------|------|-----------|--------|
/// | `completions` | `/v1/completions` | yes    | yes  | yes       | yes    |
/// | `embeddings`  | `/v1/embeddings`  | yes    | yes  | yes       | yes    |
/// | `rerank`      | `/v1/rerank`      |        | yes  | yes       | yes    |
/// | `score`       | `/v1/score`       |        | yes  |           | yes    |
/// | `tokenize`    | `/tokenize`       |        | yes  | yes       | yes    |
/// | `detokenize`  | `/detokenize`     |        | yes  | yes       | yes    |
/// | `transcriptions` | `/v1/audio/transcriptions` | yes | yes |        |        |
/// | `translations`   | `/v1/audio/translations`   | yes | yes |        |        |
/// | `speech`         | `/v1/audio/speech`         | yes |     |        |        |
pub fn protocol_profile(profile: ProfileName, base_url: &BaseUrl) -> ProtocolProfileSpec {
    let health_path = match profile {
        ProfileName::OpenAi => "/v1/models",
        ProfileName::Vllm | ProfileName::LlamaCpp | ProfileName::Sglang => "/health",
    };
    let served = |path: &str, by: bool| {
        if by {
            base_url.join(path)
        } else {
            String::new()
        }
    };
    let openai = profile == ProfileName::OpenAi;
    let scores = matches!(profile, ProfileName::Vllm | ProfileName::Sglang);
    // vLLM serves Whisper-class models; speech is OpenAI's (and its
    // compatible servers', configured as profile `openai`).
    let hears = matches!(profile, ProfileName::OpenAi | ProfileName::Vllm);
    ProtocolProfileSpec {
        name: profile,
        base_url: base_url.origin(),
        models_path: base_url.join("/v1/models"),
        chat_completions_path: base_url.join("/v1/chat/completions"),
        messages_path: base_url.join("/v1/messages"),
        count_tokens_path: base_url.join("/v1/messages/count_tokens"),
        responses_path: base_url.join("/v1/responses"),
        completions_path: base_url.join("/v1/completions"),
        embeddings_path: base_url.join("/v1/embeddings"),
        rerank_path: served("/v1/rerank", !openai),
        score_path: served("/v1/score", scores),
        tokenize_path: served("/tokenize", !openai),
        detokenize_path: served("/detokenize", !openai),
        transcriptions_path: served("/v1/audio/transcriptions", hears),
        translations_path: served("/v1/audio/translations", hears),
        speech_path: served("/v1/audio/speech", openai),
        health_path: base_url.join(health_path),
        auth_header_name: "Authorization".to_owned(),
        auth_header_format: "Bearer {secret}".to_owned(),
    }
}

impl NodeSpec {
    /// The adapter instance named `name`.
    pub fn adapter(&self, name: &str) -> Option<&AdapterSpec> {
        self.adapters.iter().find(|a| a.name == name)
    }

    /// The provider with id `id`.
    pub fn provider(&self, id: &str) -> Option<&ProviderSpec> {
        self.providers.iter().find(|p| p.id == id)
    }

    /// The targets of the providers using adapter `name`, in file order,
    /// without repeats.
    pub fn adapter_targets(&self, name: &str) -> Vec<String> {
        let mut targets: Vec<String> = Vec::new();
        for provider in self.providers.iter().filter(|p| p.adapter == name) {
            if !targets.contains(&provider.target) {
                targets.push(provider.target.clone());
            }
        }
        targets
    }

    /// The `NodeConfigPayload` sent to this node in `RegisterResponse` and
    /// config refreshes (R2, K3): each adapter with its capacity (P4), the
    /// targets of its providers and, for OpenAI-compatible adapters, the
    /// resolved protocol profile (U4). Runtime settings are left at 0 (Node
    /// defaults). Pass `credential_leases_required = false` when
    /// `edge.insecure_plaintext_nodes` is set (T5). Carries no credential (C4).
    pub fn config_payload(
        &self,
        revision: u64,
        credential_leases_required: bool,
    ) -> pb::NodeConfigPayload {
        let adapters = self
            .adapters
            .iter()
            .map(|adapter| {
                let kind = match adapter.kind {
                    AdapterKind::OpenAiCompat { .. } => {
                        pb::adapter_config::Kind::OpenaiCompat(pb::OpenAiCompatAdapterConfig {
                            protocol_profile: adapter.protocol_profile().map(|p| p.to_pb()),
                        })
                    }
                    AdapterKind::Ollama => {
                        pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                            base_url: adapter.base_url.to_string(),
                        })
                    }
                };
                pb::AdapterConfig {
                    tls: adapter.tls.to_pb(),
                    name: adapter.name.clone(),
                    capacity: adapter.capacity,
                    targets: self.adapter_targets(&adapter.name),
                    kind: Some(kind),
                }
            })
            .collect();
        pb::NodeConfigPayload {
            runtime: Some(pb::NodeRuntimeConfig::default()),
            adapters,
            revision,
            credential_leases_required,
            revoked_credentials: Vec::new(),
        }
    }
}

impl EdgeConfig {
    /// Refuses a configuration that would serve every client without a
    /// key, unless it says so (`edge.allow_anonymous = true`): checked when
    /// the Edge starts and on every reload, so removing the last client
    /// key never opens the Edge by accident.
    pub fn check_open_access(&self) -> Result<(), ConfigError> {
        if self.client_keys.is_empty() && !self.edge.allow_anonymous {
            return Err(ConfigError::new(
                &self.source,
                "client_keys",
                "no client key is configured, so every client would be served without one; \
                 add [[client_keys]], or set edge.allow_anonymous = true to run open",
            ));
        }
        Ok(())
    }

    /// Reads `path` and checks all of it: [`EdgeConfig::load_structure`],
    /// then [`EdgeConfig::check_operational_paths`], the first bad path
    /// being the error. What the Edge starts with (there is no running
    /// writer to keep at startup) and what `check-config` checks.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let config = Self::load_structure(path)?;
        match config.check_operational_paths().into_iter().next() {
            Some(broken) => Err(broken.error),
            None => Ok(config),
        }
    }

    /// Reads `path`, parses and validates it ([`EdgeConfig::parse`]), then
    /// checks the TLS files ([`EdgeConfig::validate_files`]) and reads the
    /// adapters' provider CA files ([`EdgeConfig::load_provider_cas`]):
    /// everything but the files the Edge writes while it runs. A reload
    /// refuses the whole file when this fails; the operational paths are
    /// the access log's and usage file's own business (a path they cannot
    /// open keeps the running one, `crate::plane::usage::LogReload`).
    pub fn load_structure(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = read_config_file(path)?;
        let mut config = Self::parse(&text, path)?;
        config.validate_files()?;
        config.load_provider_cas()?;
        Ok(config)
    }

    /// The files the Edge appends to while it runs (the access log's file
    /// destination, the usage file) that cannot be opened for appending
    /// (each is created if missing), in that order, each with its key and
    /// reason.
    pub fn check_operational_paths(&self) -> Vec<BrokenPath> {
        let mut broken = Vec::new();
        if let Destination::File(path) = &self.access_log.destination {
            if let Err(why) = check_writable(path) {
                broken.push(BrokenPath {
                    part: OperationalPath::AccessLog,
                    error: ConfigError::new(&self.source, OperationalPath::AccessLog.key(), why),
                });
            }
        }
        if let Some(path) = &self.usage_log {
            if let Err(why) = check_writable(path) {
                broken.push(BrokenPath {
                    part: OperationalPath::UsageLog,
                    error: ConfigError::new(&self.source, OperationalPath::UsageLog.key(), why),
                });
            }
        }
        broken
    }

    /// Reads every adapter's `ca_file` into its [`ProviderTlsSpec::ca_pem`]
    /// and checks that it holds usable CA certificates (as the Node will
    /// use them). The error names the key and the reason.
    pub fn load_provider_cas(&mut self) -> Result<(), ConfigError> {
        for (i, node) in self.nodes.iter_mut().enumerate() {
            for (j, adapter) in node.adapters.iter_mut().enumerate() {
                let Some(path) = &adapter.tls.ca_file else {
                    continue;
                };
                let key = format!("nodes[{i}].adapters[{j}].ca_file");
                let err = |why: String| ConfigError::new(&self.source, &key, why);
                let pem = std::fs::read_to_string(path)
                    .map_err(|e| err(format!("cannot read {}: {e}", path.display())))?;
                UpstreamTls::new(&UpstreamTlsSettings {
                    ca_pem: Some(pem.clone()),
                    insecure_skip_verify: false,
                })
                .map_err(|e| err(format!("{}: {e}", path.display())))?;
                adapter.tls.ca_pem = Some(pem);
            }
        }
        Ok(())
    }

    /// Parses and validates `text`; `path` names the file in errors and
    /// anchors relative TLS paths. Touches no file.
    pub fn parse(text: &str, path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let raw: RawEdgeFile = parse_toml(text, path)?;
        Validator { file: path }.edge_config(raw)
    }

    /// Checks that every TLS file exists, is a regular file and can be opened
    /// for reading (nothing to check in insecure mode). The error names the
    /// key (`tls.cert`) and the resolved path. The files the Edge writes are
    /// [`EdgeConfig::check_operational_paths`]'.
    pub fn validate_files(&self) -> Result<(), ConfigError> {
        if let Some(tls) = &self.tls {
            tls.validate_files(&self.source)?;
        }
        if let Some(client_tls) = &self.client_tls {
            let files = [
                ("edge.client_tls.cert", Some(&client_tls.cert)),
                ("edge.client_tls.key", Some(&client_tls.key)),
                ("edge.client_tls.client_ca", client_tls.client_ca.as_ref()),
            ];
            for (key, path) in files {
                if let Some(path) = path {
                    open_regular_file(path)
                        .map_err(|why| ConfigError::new(&self.source, key, why))?;
                }
            }
        }
        Ok(())
    }

    /// The node with id `id`.
    pub fn node(&self, id: &str) -> Option<&NodeSpec> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The model named `name`.
    pub fn model(&self, name: &str) -> Option<&ModelSpec> {
        self.models.iter().find(|m| m.name == name)
    }

    /// The `NodeConfigPayload` for `node` at `revision` (R2, K3): its
    /// adapters ([`NodeSpec::config_payload`]), whether it must require
    /// leases, and the revoked revisions of every slot serving one of its
    /// providers, so the Node refuses those leases itself (C3).
    pub fn node_config_payload(&self, node: &NodeSpec, revision: u64) -> pb::NodeConfigPayload {
        let mut payload = node.config_payload(revision, self.credential_leases_required(node));
        payload.revoked_credentials = self
            .credentials
            .iter()
            .flat_map(|c| &c.slots)
            .filter(|s| !s.revoked_revisions.is_empty())
            .filter(|s| s.providers.iter().any(|p| p.node_id == node.id))
            .map(|s| pb::RevokedCredential {
                slot: s.name.clone(),
                revisions: s.revoked_revisions.clone(),
            })
            .collect();
        payload
    }

    /// True when the Edge tells node `node` to require a lease on every
    /// tunnel (`NodeConfigPayload.credential_leases_required`, C3): the
    /// issuer is configured and the node has a recipient key.
    pub fn credential_leases_required(&self, node: &NodeSpec) -> bool {
        self.credentials.is_some() && node.recipient_key.is_some()
    }

    /// The environment variables slot secrets are read from
    /// (`secret_env`), in slot order.
    pub fn secret_env_names(&self) -> Vec<&str> {
        self.credentials
            .iter()
            .flat_map(|c| &c.slots)
            .filter_map(|s| match &s.secret {
                SecretSource::Env(name) => Some(name.as_str()),
                SecretSource::File(_) => None,
            })
            .collect()
    }

    /// The slot serving provider `provider`, if any.
    pub fn slot_for(&self, provider: &ProviderRef) -> Option<&SlotSpec> {
        self.credentials
            .as_ref()?
            .slots
            .iter()
            .find(|s| s.providers.contains(provider))
    }
}

/// Where access log lines go (`[edge.access_log] destination`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Destination {
    /// No access log.
    Off,
    /// Standard error, beside the process log (the default).
    #[default]
    Stderr,
    /// Appended to this file (created if missing, mode 0640).
    File(PathBuf),
}

/// How a line is written (`[edge.access_log] format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// `key=value` pairs (logfmt), values quoted when they need it.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The `[edge.access_log]` table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AccessLogSpec {
    /// Where lines go.
    pub destination: Destination,
    /// How they are written.
    pub format: Format,
    /// Whether edge.toml sets `format`; when it does not, `--log-format`
    /// picks it (so `--log-format json` makes stderr JSON throughout).
    pub format_explicit: bool,
}

/// A principal's limits (`[[client_keys]]` `max_concurrent`,
/// `requests_per_minute`, `tokens_per_minute`); `None` = unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitSpec {
    /// Requests in flight at once.
    pub max_concurrent: Option<u32>,
    /// Requests admitted per minute.
    pub requests_per_minute: Option<u32>,
    /// Prompt + completion tokens per minute.
    pub tokens_per_minute: Option<u32>,
}

/// A principal's token budgets per UTC calendar period (`[[client_keys]]`
/// `tokens_per_day`, `tokens_per_month`; `crate::plane::budgets`); `None`
/// = no budget for that period.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BudgetSpec {
    /// Prompt + completion tokens per UTC day.
    pub tokens_per_day: Option<u64>,
    /// Prompt + completion tokens per UTC calendar month.
    pub tokens_per_month: Option<u64>,
}

impl BudgetSpec {
    /// No budget at all.
    pub fn is_unlimited(&self) -> bool {
        *self == BudgetSpec::default()
    }
}

impl LimitSpec {
    /// No limit at all.
    pub fn is_unlimited(&self) -> bool {
        *self == LimitSpec::default()
    }
}

/// Whether `path` (the access log file, the usage file) can be opened for
/// appending (it is created if missing, mode 0640): the reason, naming the
/// path, when not ([`cannot_append`]).
pub fn check_writable(path: &Path) -> Result<(), String> {
    open_appending(path)
        .map(drop)
        .map_err(|e| cannot_append(path, &e))
}

/// Opens `path` for appending, creating it (mode 0640) if missing: how the
/// access log and the usage file open their files, at startup and reload.
pub fn open_appending(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)
}

/// The reason `path` could not be opened for appending, as every message
/// about an operational path says it.
pub fn cannot_append(path: &Path, e: &std::io::Error) -> String {
    format!("cannot open {} for appending: {e}", path.display())
}

/// A file the Edge writes while it runs, named by its key: at startup one
/// that cannot be opened stops the Edge; on reload it keeps the running
/// writer and the rest of the file applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationalPath {
    /// `[edge.access_log] destination` (a file).
    AccessLog,
    /// `[edge.usage_log] path`.
    UsageLog,
}

impl OperationalPath {
    /// The key errors name.
    pub fn key(self) -> &'static str {
        match self {
            OperationalPath::AccessLog => "edge.access_log.destination",
            OperationalPath::UsageLog => "edge.usage_log.path",
        }
    }
}

/// An operational path that cannot be opened
/// ([`EdgeConfig::check_operational_paths`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokenPath {
    /// Which file.
    pub part: OperationalPath,
    /// `<file>: <key>: cannot open <path> for appending: <reason>`.
    pub error: ConfigError,
}
