//! The Edge configuration file (`edge-bin --config edge.toml`).
//!
//! ```text
//! edge.toml ──read──► text ──toml + serde (unknown keys rejected, key path kept)──► Raw*
//!     Raw* ──validate (names, ranges, references, URLs)──► EdgeConfig
//!     EdgeConfig::validate_files ──► the TLS files exist and are readable
//!     NodeSpec::config_payload ──► pb::NodeConfigPayload for RegisterResponse (R2, U4)
//! ```
//!
//! Parse, don't validate: the `Raw*` structs mirror the file and stay private;
//! the public types hold only checked values (socket addresses, parsed base
//! URLs, resolved references, numbers in range). [`EdgeConfig::parse`] is pure
//! (no file system access), so tests and tools can check a file without its
//! certificates; [`EdgeConfig::load`] reads the file, parses it and checks the
//! TLS files.
//!
//! Every error is a [`ConfigError`] that displays as `<file>: <key>: <reason>`,
//! with `key` the dotted path of the offending key (`nodes[0].providers[1].capacity`)
//! or `-` when no key applies (a TOML syntax error, whose reason carries the
//! line and column). The binary prints it and exits 1 (S3).
//!
//! The credential plane (`[credentials]`, `[[credentials.slots]]`, per-node
//! `recipient_key`, `[[client_keys]]`, C1–C5) is validated here too, but this
//! module never reads a secret: a slot names where its secret lives
//! (`secret_file` or `secret_env`); `crate::credentials` reads it at startup.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use iop_engine::config::{
    check_name, check_trust_domain, open_regular_file, parse_toml, read_config_file, resolve_path,
    split_host_port, RawTls,
};
use iop_engine::http::Scheme;
use iop_engine::keys::decode_recipient_public_key;
use iop_engine::tls::{HttpsFiles, UpstreamTls, UpstreamTlsSettings};
use iop_wire::checks::effective_stall_timeout;
use iop_wire::lease::{
    decode_hex, MAX_HEADER_FORMAT_BYTES, MAX_HEADER_NAME_BYTES, MAX_LEASE_LIFETIME_MS,
    SECRET_PLACEHOLDER,
};
use iop_wire::limits::DEFAULT_MAX_FRAME_BYTES;
use iop_wire::pb;
use serde::Deserialize;
use x25519_dalek::{PublicKey, StaticSecret};

use crate::access::{self, AccessLogSpec};

// The config error (`<file>: <key>: <reason>`), the TLS file set and the
// limits on identity names and the trust domain are shared with the Node.
pub use iop_engine::config::{ConfigError, TlsFiles, MAX_NAME_BYTES, MAX_TRUST_DOMAIN_BYTES};

/// Default `edge.max_request_body_bytes`: 8 MiB; a larger client body gets 413.
pub const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Smallest accepted `edge.max_frame_bytes`.
pub const MIN_FRAME_BYTES: usize = 2 * FRAME_HEADROOM_BYTES;
/// Largest accepted `edge.max_frame_bytes` (1 GiB).
pub const MAX_FRAME_BYTES_LIMIT: usize = 1024 * 1024 * 1024;
/// Room a frame keeps for the fields of a tunnel request other than the
/// client body (headers, metadata, credential lease): the body limit must be
/// at most `max_frame_bytes - FRAME_HEADROOM_BYTES`.
pub const FRAME_HEADROOM_BYTES: usize = 64 * 1024;
/// Largest accepted capacity of an adapter or a provider.
pub const MAX_CAPACITY: u32 = 65_536;
/// Default `models[].max_queue`.
pub const DEFAULT_MAX_QUEUE: u32 = 256;
/// Largest accepted `models[].max_queue`.
pub const MAX_QUEUE_LIMIT: u32 = 1_000_000;
/// Default `models[].queue_timeout_ms`.
pub const DEFAULT_QUEUE_TIMEOUT_MS: u64 = 30_000;
/// Largest accepted `models[].queue_timeout_ms` (one day).
pub const MAX_QUEUE_TIMEOUT_MS: u64 = 86_400_000;
/// Default `edge.drain_grace_ms`: how long in-flight client requests may
/// run on after SIGTERM/SIGINT before the Edge exits anyway.
pub const DEFAULT_DRAIN_GRACE_MS: u64 = 30_000;
/// Largest accepted `edge.drain_grace_ms` (one hour).
pub const MAX_DRAIN_GRACE_MS: u64 = 3_600_000;
/// Default `edge.flow_window_bytes`: each run's flow-control window on
/// its node connection (charged bytes, `iop_wire::flow`). 256 KiB covers one
/// client's bandwidth-delay product at 100 MB/s and 2.5 ms.
pub const DEFAULT_FLOW_WINDOW_BYTES: u64 = 256 * 1024;
/// Largest accepted `edge.flow_window_bytes` (16 MiB).
pub const MAX_FLOW_WINDOW_BYTES: u64 = 16 * 1024 * 1024;
/// Default `edge.client_write_stall_timeout_ms`: a client socket that takes
/// no bytes of a response for this long is cut off.
pub const DEFAULT_CLIENT_WRITE_STALL_TIMEOUT_MS: u64 = 30_000;
/// Shortest accepted `edge.client_write_stall_timeout_ms`.
pub const MIN_CLIENT_WRITE_STALL_TIMEOUT_MS: u64 = 100;
/// Longest accepted `edge.client_write_stall_timeout_ms` (one hour).
pub const MAX_CLIENT_WRITE_STALL_TIMEOUT_MS: u64 = 3_600_000;
/// Default `edge.response_wait_timeout_ms`: a dispatched request whose
/// response has not started after this long is cancelled and answered 504
/// (U6). A backstop behind the Node's stall watchdog (300 s by default),
/// so a stall with its health evidence normally ends such a wait first.
pub const DEFAULT_RESPONSE_WAIT_TIMEOUT_MS: u64 = 600_000;
/// Shortest accepted `edge.response_wait_timeout_ms`.
pub const MIN_RESPONSE_WAIT_TIMEOUT_MS: u64 = 100;
/// Longest accepted `edge.response_wait_timeout_ms` (one day).
pub const MAX_RESPONSE_WAIT_TIMEOUT_MS: u64 = 86_400_000;
/// Default `outlier_detection.consecutive_failures`.
pub const DEFAULT_CONSECUTIVE_FAILURES: u32 = 5;
/// Largest accepted `outlier_detection.consecutive_failures`.
pub const MAX_CONSECUTIVE_FAILURES: u32 = 1_000;
/// Default `outlier_detection.base_ejection_time_ms`.
pub const DEFAULT_BASE_EJECTION_TIME_MS: u64 = 30_000;
/// Default `outlier_detection.max_ejection_time_ms`.
pub const DEFAULT_MAX_EJECTION_TIME_MS: u64 = 300_000;
/// Longest accepted ejection time (one day).
pub const MAX_EJECTION_TIME_LIMIT_MS: u64 = 86_400_000;
/// Default `outlier_detection.max_ejection_percent`.
pub const DEFAULT_MAX_EJECTION_PERCENT: u32 = 50;
/// Default `edge.node_metrics_max_age_ms`: a pull of the nodes' series
/// serves the scrapes of the next 5 s.
pub const DEFAULT_NODE_METRICS_MAX_AGE_MS: u64 = 5_000;
/// Largest accepted `edge.node_metrics_max_age_ms` (ten minutes).
pub const MAX_NODE_METRICS_MAX_AGE_MS: u64 = 600_000;
/// Default `models[].max_attempts`: one retry on another provider.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 2;
/// Largest accepted `models[].max_attempts`.
pub const MAX_ATTEMPTS_LIMIT: u32 = 5;
/// Defaults and bounds of the front door's limits (`[edge]` keys, see
/// [`ListenerLimits`]).
pub mod front_door {
    /// `edge.client_head_timeout_ms`: a whole request head.
    pub const CLIENT_HEAD_TIMEOUT_MS: u64 = 10_000;
    /// `edge.client_body_idle_timeout_ms`: the longest pause inside a body.
    pub const CLIENT_BODY_IDLE_TIMEOUT_MS: u64 = 30_000;
    /// `edge.client_body_grace_ms`: a body's time before its minimum rate
    /// counts.
    pub const CLIENT_BODY_GRACE_MS: u64 = 30_000;
    /// `edge.client_body_min_rate_bytes_per_sec`: the slowest average a
    /// body may arrive at after its grace (0: no minimum).
    pub const CLIENT_BODY_MIN_RATE_BYTES_PER_SEC: u64 = 1_024;
    /// `edge.client_keep_alive_timeout_ms`: an idle kept-alive connection.
    pub const CLIENT_KEEP_ALIVE_TIMEOUT_MS: u64 = 60_000;
    /// `edge.max_client_connections`: open client connections (the whole
    /// process; split evenly over the cores).
    pub const MAX_CLIENT_CONNECTIONS: u64 = 4_096;
    /// `edge.max_client_connections_per_peer`: open client connections of
    /// one peer address (the whole process).
    pub const MAX_CLIENT_CONNECTIONS_PER_PEER: u64 = 1_024;
    /// `edge.client_linger_time_ms`: a lingering close in all.
    pub const CLIENT_LINGER_TIME_MS: u64 = 30_000;
    /// `edge.client_linger_idle_timeout_ms`: a pause in a lingering close.
    pub const CLIENT_LINGER_IDLE_TIMEOUT_MS: u64 = 5_000;
    /// `edge.client_linger_max_bytes`: bytes a lingering close discards.
    pub const CLIENT_LINGER_MAX_BYTES: u64 = 128 * 1024 * 1024;
    /// `edge.node_handshake_timeout_ms`: a node's TLS handshake.
    pub const NODE_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
    /// `edge.max_node_handshakes`: node TLS handshakes in progress (the
    /// whole process; split evenly over the cores).
    pub const MAX_NODE_HANDSHAKES: u64 = 64;
    /// `edge.max_node_handshakes_per_peer`: node TLS handshakes in progress
    /// from one peer address (the whole process).
    pub const MAX_NODE_HANDSHAKES_PER_PEER: u64 = 8;
    /// `edge.node_first_byte_timeout_ms`: a new node connection's first
    /// byte (its TLS ClientHello).
    pub const NODE_FIRST_BYTE_TIMEOUT_MS: u64 = 3_000;
    /// `edge.max_json_depth`: nesting of a request body.
    pub const MAX_JSON_DEPTH: u64 = 64;
    /// `edge.max_json_elements`: values in a request body.
    pub const MAX_JSON_ELEMENTS: u64 = 250_000;
    /// `edge.max_json_members`: members of a request body's top-level
    /// object (a chat request has a few dozen at most).
    pub const MAX_JSON_MEMBERS: u64 = 1_024;

    /// Largest accepted timeout (one hour).
    pub const MAX_TIMEOUT_MS: u64 = 3_600_000;
    /// Largest accepted connection or handshake cap.
    pub const MAX_CONNECTIONS_LIMIT: u64 = 1_000_000;
    /// Largest accepted `edge.client_body_min_rate_bytes_per_sec` (1 GiB/s).
    pub const MAX_BODY_RATE_LIMIT: u64 = 1 << 30;
    /// Largest accepted `edge.client_linger_max_bytes` (16 GiB).
    pub const MAX_LINGER_BYTES_LIMIT: u64 = 16 * 1024 * 1024 * 1024;
    /// Largest accepted `edge.max_json_depth` (the JSON parser's own
    /// recursion limit).
    pub const MAX_JSON_DEPTH_LIMIT: u64 = 128;
    /// Largest accepted `edge.max_json_elements`.
    pub const MAX_JSON_ELEMENTS_LIMIT: u64 = 16_000_000;
}

/// Largest accepted `models[].long_context_threshold_tokens`.
pub const MAX_LONG_CONTEXT_THRESHOLD_TOKENS: u64 = 100_000_000;
/// Default `models[].owned_by`, shown in `/v1/models`.
pub const DEFAULT_OWNED_BY: &str = "iop";
/// Longest accepted model name, `owned_by` or provider target.
pub const MAX_TEXT_BYTES: usize = 512;
/// Default `credentials.lease_ttl_ms`: a lease is valid for 30 s after issue.
pub const DEFAULT_LEASE_TTL_MS: u64 = 30_000;
/// Shortest accepted `credentials.lease_ttl_ms`.
pub const MIN_LEASE_TTL_MS: u64 = 1_000;
/// Longest accepted `credentials.lease_ttl_ms` (the Node's cap on a lease's
/// lifetime).
pub const MAX_LEASE_TTL_MS: u64 = MAX_LEASE_LIFETIME_MS as u64;
/// Default `credentials.slots[].header`.
pub const DEFAULT_SLOT_HEADER: &str = "Authorization";
/// Default `credentials.slots[].format`.
pub const DEFAULT_SLOT_FORMAT: &str = "Bearer {secret}";
/// Longest accepted environment variable name (`secret_env`).
pub const MAX_ENV_NAME_BYTES: usize = 128;

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
    /// inference request; `crate::usage`); `None` = none.
    pub usage_log: Option<PathBuf>,
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
}

/// The `[outlier_detection]` table: providers that fail in a row are taken
/// out of rotation for a while (`crate::outlier`).
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
    pub limits: crate::limits::LimitSpec,
    /// `models = [...]`: the only models the key may use; `None` = every
    /// model.
    pub models: Option<Vec<String>>,
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
            health_path: self.health_path.clone(),
            auth_header_name: self.auth_header_name.clone(),
            auth_header_format: self.auth_header_format.clone(),
        }
    }
}

/// Resolves `profile` at `base_url` (U4). Every profile serves the same
/// operation paths (`/v1/models`, `/v1/chat/completions`, `/v1/messages`,
/// `/v1/messages/count_tokens`, `/v1/responses`) and authenticates with
/// `Authorization: Bearer {secret}`; they differ in the health path:
/// `/v1/models` for `openai`, `/health` for `vllm`, `llama_cpp` and `sglang`.
pub fn protocol_profile(profile: ProfileName, base_url: &BaseUrl) -> ProtocolProfileSpec {
    let health_path = match profile {
        ProfileName::OpenAi => "/v1/models",
        ProfileName::Vllm | ProfileName::LlamaCpp | ProfileName::Sglang => "/health",
    };
    ProtocolProfileSpec {
        name: profile,
        base_url: base_url.origin(),
        models_path: base_url.join("/v1/models"),
        chat_completions_path: base_url.join("/v1/chat/completions"),
        messages_path: base_url.join("/v1/messages"),
        count_tokens_path: base_url.join("/v1/messages/count_tokens"),
        responses_path: base_url.join("/v1/responses"),
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

    /// Reads `path`, parses and validates it ([`EdgeConfig::parse`]), then
    /// checks the TLS files ([`EdgeConfig::validate_files`]) and reads the
    /// adapters' provider CA files ([`EdgeConfig::load_provider_cas`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = read_config_file(path)?;
        let mut config = Self::parse(&text, path)?;
        config.validate_files()?;
        config.load_provider_cas()?;
        Ok(config)
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
    /// key (`tls.cert`) and the resolved path.
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
        if let access::Destination::File(path) = &self.access_log.destination {
            access::check_writable(path).map_err(|why| {
                ConfigError::new(&self.source, "edge.access_log.destination", why)
            })?;
        }
        if let Some(path) = &self.usage_log {
            access::check_writable(path)
                .map_err(|why| ConfigError::new(&self.source, "edge.usage_log.path", why))?;
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

// ---------------------------------------------------------------------------
// The file as written
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdgeFile {
    edge: RawEdge,
    tls: Option<RawTls>,
    credentials: Option<RawCredentials>,
    #[serde(default)]
    client_keys: Vec<RawClientKey>,
    #[serde(default)]
    nodes: Vec<RawNode>,
    #[serde(default)]
    models: Vec<RawModel>,
    outlier_detection: Option<RawOutlierDetection>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutlierDetection {
    enabled: Option<bool>,
    consecutive_failures: Option<i64>,
    base_ejection_time_ms: Option<i64>,
    max_ejection_time_ms: Option<i64>,
    max_ejection_percent: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdge {
    name: String,
    trust_domain: String,
    client_listen: String,
    node_listen: String,
    max_request_body_bytes: Option<i64>,
    max_frame_bytes: Option<i64>,
    #[serde(default)]
    insecure_plaintext_nodes: bool,
    #[serde(default)]
    allow_anonymous: bool,
    metrics_access: Option<String>,
    node_metrics_max_age_ms: Option<i64>,
    drain_grace_ms: Option<i64>,
    flow_window_bytes: Option<i64>,
    client_write_stall_timeout_ms: Option<i64>,
    response_wait_timeout_ms: Option<i64>,
    client_head_timeout_ms: Option<i64>,
    client_body_idle_timeout_ms: Option<i64>,
    client_body_grace_ms: Option<i64>,
    client_body_min_rate_bytes_per_sec: Option<i64>,
    client_keep_alive_timeout_ms: Option<i64>,
    max_client_connections: Option<i64>,
    max_client_connections_per_peer: Option<i64>,
    client_linger_time_ms: Option<i64>,
    client_linger_idle_timeout_ms: Option<i64>,
    client_linger_max_bytes: Option<i64>,
    node_handshake_timeout_ms: Option<i64>,
    max_node_handshakes: Option<i64>,
    max_node_handshakes_per_peer: Option<i64>,
    node_first_byte_timeout_ms: Option<i64>,
    max_json_depth: Option<i64>,
    max_json_elements: Option<i64>,
    max_json_members: Option<i64>,
    client_tls: Option<RawClientTls>,
    access_log: Option<RawAccessLog>,
    usage_log: Option<RawUsageLog>,
}

/// `[edge.usage_log]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUsageLog {
    path: String,
}

/// `[edge.access_log]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAccessLog {
    destination: Option<String>,
    format: Option<String>,
}

/// `[edge.client_tls]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClientTls {
    cert: String,
    key: String,
    client_ca: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    id: String,
    recipient_key: Option<String>,
    #[serde(default)]
    adapters: Vec<RawAdapter>,
    #[serde(default)]
    providers: Vec<RawProvider>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredentials {
    issuer_key: String,
    lease_ttl_ms: Option<i64>,
    #[serde(default)]
    slots: Vec<RawSlot>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSlot {
    name: String,
    secret_file: Option<String>,
    secret_env: Option<String>,
    header: Option<String>,
    format: Option<String>,
    revision: Option<i64>,
    #[serde(default)]
    revoked_revisions: Vec<i64>,
    enabled: Option<bool>,
    providers: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClientKey {
    principal: String,
    key_hash: String,
    #[serde(default)]
    scopes: Vec<String>,
    max_concurrent: Option<u32>,
    requests_per_minute: Option<u32>,
    tokens_per_minute: Option<u32>,
    models: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdapter {
    name: Option<String>,
    kind: String,
    profile: Option<String>,
    base_url: String,
    ca_file: Option<String>,
    tls_insecure_skip_verify: Option<bool>,
    capacity: Option<i64>,
    health_path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    id: String,
    adapter: String,
    target: String,
    capacity: i64,
    long_context_capacity: Option<i64>,
    response_stall_timeout_ms: Option<i64>,
    category: Option<String>,
    enabled: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    providers: Vec<String>,
    long_context_threshold_tokens: Option<i64>,
    max_queue: Option<i64>,
    queue_timeout_ms: Option<i64>,
    max_attempts: Option<i64>,
    owned_by: Option<String>,
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

struct Validator<'a> {
    file: &'a Path,
}

impl Validator<'_> {
    fn err(&self, key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
        ConfigError::new(self.file, key, reason)
    }

    fn edge_config(&self, mut raw: RawEdgeFile) -> Result<EdgeConfig, ConfigError> {
        let client_tls = match raw.edge.client_tls.take() {
            None => None,
            Some(t) => Some(HttpsFiles {
                cert: resolve_path(self.file, "edge.client_tls.cert", &t.cert)?,
                key: resolve_path(self.file, "edge.client_tls.key", &t.key)?,
                client_ca: match t.client_ca {
                    None => None,
                    Some(ca) => Some(resolve_path(self.file, "edge.client_tls.client_ca", &ca)?),
                },
            }),
        };
        let access_log = self.access_log(raw.edge.access_log.take())?;
        let usage_log = match raw.edge.usage_log.take() {
            None => None,
            Some(RawUsageLog { path }) if path.is_empty() => {
                return Err(self.err("edge.usage_log.path", "must be a file path"))
            }
            Some(RawUsageLog { path }) => {
                Some(resolve_path(self.file, "edge.usage_log.path", &path)?)
            }
        };
        let edge = self.edge(raw.edge)?;
        let tls = match (edge.insecure_plaintext_nodes, raw.tls) {
            (true, _) => None,
            (false, Some(tls)) => Some(tls.resolve(self.file)?),
            (false, None) => {
                return Err(self.err(
                    "tls",
                    "required unless edge.insecure_plaintext_nodes = true",
                ))
            }
        };
        let mut nodes: Vec<NodeSpec> = Vec::with_capacity(raw.nodes.len());
        for (i, raw_node) in raw.nodes.into_iter().enumerate() {
            let node = self.node(i, raw_node)?;
            if let Some(first) = nodes.iter().position(|n| n.id == node.id) {
                return Err(self.err(
                    format!("nodes[{i}].id"),
                    format!("duplicate node id {:?} (also nodes[{first}])", node.id),
                ));
            }
            nodes.push(node);
        }
        let mut models: Vec<ModelSpec> = Vec::with_capacity(raw.models.len());
        for (i, raw_model) in raw.models.into_iter().enumerate() {
            let model = self.model(i, raw_model, &nodes)?;
            if let Some(first) = models.iter().position(|m| m.name == model.name) {
                return Err(self.err(
                    format!("models[{i}].name"),
                    format!(
                        "duplicate model name {:?} (also models[{first}])",
                        model.name
                    ),
                ));
            }
            models.push(model);
        }
        let credentials = match raw.credentials {
            None => None,
            Some(_) if edge.insecure_plaintext_nodes => {
                // T5: plain TCP carries no lease; refuse instead of silently
                // sending provider traffic without the credential plane.
                return Err(self.err(
                    "credentials",
                    "the credential plane needs mTLS to the nodes: remove [credentials] or \
                     edge.insecure_plaintext_nodes",
                ));
            }
            Some(raw) => Some(self.credentials(raw, &nodes)?),
        };
        if let Some(credentials) = &credentials {
            self.check_managed_nodes(credentials, &nodes)?;
        }
        let client_keys = self.client_keys(raw.client_keys, &models)?;
        if edge.metrics_access == MetricsAccess::Key
            && !client_keys.iter().any(|k| k.admin || k.metrics)
        {
            return Err(self.err(
                "edge.metrics_access",
                "\"key\" needs a [[client_keys]] entry with scopes = [\"metrics\"] (or \"admin\") \
                 to read /metrics",
            ));
        }
        let outlier_detection = self.outlier_detection(raw.outlier_detection)?;
        Ok(EdgeConfig {
            source: self.file.to_path_buf(),
            edge,
            tls,
            client_tls,
            access_log,
            usage_log,
            nodes,
            models,
            credentials,
            client_keys,
            outlier_detection,
        })
    }

    fn access_log(&self, raw: Option<RawAccessLog>) -> Result<AccessLogSpec, ConfigError> {
        let Some(raw) = raw else {
            return Ok(AccessLogSpec::default());
        };
        let destination = match raw.destination.as_deref() {
            None | Some("stderr") => access::Destination::Stderr,
            Some("off") => access::Destination::Off,
            Some("") => {
                return Err(self.err(
                    "edge.access_log.destination",
                    "must be \"stderr\", \"off\" or a file path",
                ))
            }
            Some(path) => access::Destination::File(resolve_path(
                self.file,
                "edge.access_log.destination",
                path,
            )?),
        };
        let format = match raw.format.as_deref() {
            None | Some("text") => access::Format::Text,
            Some("json") => access::Format::Json,
            Some(other) => {
                return Err(self.err(
                    "edge.access_log.format",
                    format!("must be \"text\" or \"json\", not {other:?}"),
                ))
            }
        };
        Ok(AccessLogSpec {
            destination,
            format,
            format_explicit: raw.format.is_some(),
        })
    }

    fn outlier_detection(
        &self,
        raw: Option<RawOutlierDetection>,
    ) -> Result<OutlierDetection, ConfigError> {
        let defaults = OutlierDetection::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let value = |v: Option<i64>, key: &str, default: u64, min: u64, max: u64| match v {
            None => Ok(default),
            Some(v) => in_range(v, min, max)
                .map_err(|why| self.err(format!("outlier_detection.{key}"), why)),
        };
        let base_ejection_time_ms = value(
            raw.base_ejection_time_ms,
            "base_ejection_time_ms",
            defaults.base_ejection_time_ms,
            1,
            MAX_EJECTION_TIME_LIMIT_MS,
        )?;
        let max_ejection_time_ms = value(
            raw.max_ejection_time_ms,
            "max_ejection_time_ms",
            defaults.max_ejection_time_ms.max(base_ejection_time_ms),
            base_ejection_time_ms,
            MAX_EJECTION_TIME_LIMIT_MS,
        )?;
        Ok(OutlierDetection {
            enabled: raw.enabled.unwrap_or(true),
            consecutive_failures: value(
                raw.consecutive_failures,
                "consecutive_failures",
                u64::from(defaults.consecutive_failures),
                1,
                u64::from(MAX_CONSECUTIVE_FAILURES),
            )? as u32,
            base_ejection_time_ms,
            max_ejection_time_ms,
            max_ejection_percent: value(
                raw.max_ejection_percent,
                "max_ejection_percent",
                u64::from(defaults.max_ejection_percent),
                0,
                100,
            )? as u32,
        })
    }

    fn credentials(
        &self,
        raw: RawCredentials,
        nodes: &[NodeSpec],
    ) -> Result<CredentialsSpec, ConfigError> {
        let issuer_key = resolve_path(self.file, "credentials.issuer_key", &raw.issuer_key)?;
        let lease_ttl_ms = match raw.lease_ttl_ms {
            None => DEFAULT_LEASE_TTL_MS,
            Some(v) => in_range(v, MIN_LEASE_TTL_MS, MAX_LEASE_TTL_MS)
                .map_err(|why| self.err("credentials.lease_ttl_ms", why))?,
        };
        let mut slots: Vec<SlotSpec> = Vec::with_capacity(raw.slots.len());
        for (i, raw_slot) in raw.slots.into_iter().enumerate() {
            let key = format!("credentials.slots[{i}]");
            let slot = self.slot(&key, raw_slot, nodes)?;
            if let Some(first) = slots.iter().position(|s| s.name == slot.name) {
                return Err(self.err(
                    format!("{key}.name"),
                    format!(
                        "duplicate slot name {:?} (also credentials.slots[{first}])",
                        slot.name
                    ),
                ));
            }
            for (j, provider) in slot.providers.iter().enumerate() {
                if let Some(other) = slots.iter().find(|s| s.providers.contains(provider)) {
                    // C5: one slot per route, so there is never another slot
                    // to fall back to.
                    return Err(self.err(
                        format!("{key}.providers[{j}]"),
                        format!(
                            "\"{provider}\" is already served by slot {:?}; a provider is served by \
                             at most one slot",
                            other.name
                        ),
                    ));
                }
            }
            slots.push(slot);
        }
        Ok(CredentialsSpec {
            issuer_key,
            lease_ttl_ms,
            slots,
        })
    }

    fn slot(&self, key: &str, raw: RawSlot, nodes: &[NodeSpec]) -> Result<SlotSpec, ConfigError> {
        check_name(&raw.name).map_err(|why| self.err(format!("{key}.name"), why))?;
        let secret = match (raw.secret_file, raw.secret_env) {
            (Some(file), None) => SecretSource::File(resolve_path(
                self.file,
                &format!("{key}.secret_file"),
                &file,
            )?),
            (None, Some(env)) => {
                check_env_name(&env).map_err(|why| self.err(format!("{key}.secret_env"), why))?;
                SecretSource::Env(env)
            }
            (Some(_), Some(_)) | (None, None) => {
                return Err(self.err(key, "set exactly one of secret_file or secret_env"))
            }
        };
        let header_name = raw.header.unwrap_or_else(|| DEFAULT_SLOT_HEADER.to_owned());
        check_header_name(&header_name).map_err(|why| self.err(format!("{key}.header"), why))?;
        let header_format = raw.format.unwrap_or_else(|| DEFAULT_SLOT_FORMAT.to_owned());
        check_header_format(&header_format)
            .map_err(|why| self.err(format!("{key}.format"), why))?;
        let revision = match raw.revision {
            None => 1,
            Some(v) => in_range(v, 1, i64::MAX as u64)
                .map_err(|why| self.err(format!("{key}.revision"), why))?,
        };
        let mut revoked_revisions: Vec<u64> = Vec::with_capacity(raw.revoked_revisions.len());
        for (j, v) in raw.revoked_revisions.into_iter().enumerate() {
            let rkey = format!("{key}.revoked_revisions[{j}]");
            let v = in_range(v, 1, i64::MAX as u64).map_err(|why| self.err(&rkey, why))?;
            if revoked_revisions.contains(&v) {
                return Err(self.err(rkey, format!("revision {v} is listed twice")));
            }
            revoked_revisions.push(v);
        }
        if raw.providers.is_empty() {
            return Err(self.err(
                format!("{key}.providers"),
                "must list at least one provider",
            ));
        }
        let mut providers: Vec<ProviderRef> = Vec::with_capacity(raw.providers.len());
        for (j, text) in raw.providers.iter().enumerate() {
            let pkey = format!("{key}.providers[{j}]");
            let provider = self.provider_ref(&pkey, text, nodes)?;
            if let Some(first) = providers.iter().position(|p| *p == provider) {
                return Err(self.err(
                    pkey,
                    format!("{text:?} is listed twice (also {key}.providers[{first}])"),
                ));
            }
            let node = nodes.iter().find(|n| n.id == provider.node_id);
            let kind = node
                .and_then(|n| n.provider(&provider.provider_id))
                .and_then(|p| node.and_then(|n| n.adapter(&p.adapter)))
                .map(|a| a.kind);
            if !matches!(kind, Some(AdapterKind::OpenAiCompat { .. })) {
                return Err(self.err(
                    pkey,
                    format!(
                        "{text:?} is not served by an openai_compat adapter; credential leases \
                         travel only on provider tunnels"
                    ),
                ));
            }
            let unverified = node
                .and_then(|n| n.provider(&provider.provider_id))
                .and_then(|p| node.and_then(|n| n.adapter(&p.adapter)))
                .is_some_and(|a| a.tls.insecure_skip_verify);
            if unverified {
                return Err(self.err(
                    pkey,
                    format!(
                        "{text:?} is served by an adapter with tls_insecure_skip_verify; a \
                         credential is never sent to a provider whose certificate is not verified"
                    ),
                ));
            }
            providers.push(provider);
        }
        Ok(SlotSpec {
            name: raw.name,
            secret,
            header_name,
            header_format,
            revision,
            revoked_revisions,
            enabled: raw.enabled.unwrap_or(true),
            providers,
        })
    }

    /// With the issuer configured: every node a slot serves has a recipient
    /// key, and every tunnel provider of a node with a key is served by a
    /// slot (that node rejects tunnels without a lease, C3).
    fn check_managed_nodes(
        &self,
        credentials: &CredentialsSpec,
        nodes: &[NodeSpec],
    ) -> Result<(), ConfigError> {
        for (i, node) in nodes.iter().enumerate() {
            let has_key = node.recipient_key.is_some();
            let served = credentials.slots.iter().find_map(|slot| {
                slot.providers
                    .iter()
                    .find(|p| p.node_id == node.id)
                    .map(|p| (slot, p))
            });
            if let (false, Some((slot, provider))) = (has_key, served) {
                return Err(self.err(
                    format!("nodes[{i}].recipient_key"),
                    format!(
                        "required: provider \"{provider}\" is served by credential slot {:?} \
                         (node-bin keys recipient --out … prints it)",
                        slot.name
                    ),
                ));
            }
            if !has_key {
                continue;
            }
            for (j, provider) in node.providers.iter().enumerate() {
                let tunnel = matches!(
                    node.adapter(&provider.adapter).map(|a| a.kind),
                    Some(AdapterKind::OpenAiCompat { .. })
                );
                let reference = ProviderRef {
                    node_id: node.id.clone(),
                    provider_id: provider.id.clone(),
                };
                let has_slot = credentials
                    .slots
                    .iter()
                    .any(|s| s.providers.contains(&reference));
                if tunnel && !has_slot {
                    return Err(self.err(
                        format!("nodes[{i}].providers[{j}]"),
                        format!(
                            "node {:?} is managed (it has a recipient_key), so it rejects tunnels \
                             without a credential lease: serve \"{reference}\" by a credential slot",
                            node.id
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn client_keys(
        &self,
        raw: Vec<RawClientKey>,
        models: &[ModelSpec],
    ) -> Result<Vec<ClientKeySpec>, ConfigError> {
        let mut keys: Vec<ClientKeySpec> = Vec::with_capacity(raw.len());
        for (i, raw_key) in raw.into_iter().enumerate() {
            let key = format!("client_keys[{i}]");
            check_name(&raw_key.principal)
                .map_err(|why| self.err(format!("{key}.principal"), why))?;
            let is_lower_hex = raw_key
                .key_hash
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            let key_hash = decode_hex::<32>(&raw_key.key_hash)
                .filter(|_| is_lower_hex)
                .ok_or_else(|| {
                    self.err(
                        format!("{key}.key_hash"),
                        "expected 64 lowercase hex digits (edge-bin keys hash-client-key prints it)",
                    )
                })?;
            if let Some(first) = keys.iter().position(|k| k.key_hash == key_hash) {
                return Err(self.err(
                    format!("{key}.key_hash"),
                    format!("the same key is also client_keys[{first}]"),
                ));
            }
            let (mut admin, mut metrics) = (false, false);
            for (j, scope) in raw_key.scopes.iter().enumerate() {
                match scope.as_str() {
                    ADMIN_SCOPE => admin = true,
                    METRICS_SCOPE => metrics = true,
                    _ => {
                        return Err(self.err(
                            format!("{key}.scopes[{j}]"),
                            format!(
                                "unknown scope {scope:?}; the scopes are \"{ADMIN_SCOPE}\" and \
                                 \"{METRICS_SCOPE}\""
                            ),
                        ))
                    }
                }
            }
            let positive = |field: &str, v: Option<u32>| match v {
                Some(0) => Err(self.err(
                    format!("{key}.{field}"),
                    "must be at least 1 (leave it out for no limit)",
                )),
                _ => Ok(v),
            };
            let limits = crate::limits::LimitSpec {
                max_concurrent: positive("max_concurrent", raw_key.max_concurrent)?,
                requests_per_minute: positive("requests_per_minute", raw_key.requests_per_minute)?,
                tokens_per_minute: positive("tokens_per_minute", raw_key.tokens_per_minute)?,
            };
            if !limits.is_unlimited() {
                if let Some(first) = keys
                    .iter()
                    .position(|k| k.principal == raw_key.principal && !k.limits.is_unlimited())
                {
                    return Err(self.err(
                        key.clone(),
                        format!(
                            "principal {:?} already has limits from client_keys[{first}]; \
                             set them on one of its keys",
                            raw_key.principal
                        ),
                    ));
                }
            }
            if let Some(allowed) = &raw_key.models {
                for (j, name) in allowed.iter().enumerate() {
                    if !models.iter().any(|m| &m.name == name) {
                        return Err(self.err(
                            format!("{key}.models[{j}]"),
                            format!("no [[models]] entry is named {name:?}"),
                        ));
                    }
                }
            }
            keys.push(ClientKeySpec {
                principal: raw_key.principal,
                key_hash,
                admin,
                metrics,
                limits,
                models: raw_key.models,
            });
        }
        Ok(keys)
    }

    /// Resolves `"<node id>/<provider id>"` against the configured nodes.
    fn provider_ref(
        &self,
        key: &str,
        text: &str,
        nodes: &[NodeSpec],
    ) -> Result<ProviderRef, ConfigError> {
        let Some((node_id, provider_id)) = text.split_once('/') else {
            return Err(self.err(
                key,
                format!("{text:?}: expected \"<node id>/<provider id>\""),
            ));
        };
        let Some(node) = nodes.iter().find(|n| n.id == node_id) else {
            return Err(self.err(key, format!("{text:?}: no node {node_id:?} is configured")));
        };
        if node.provider(provider_id).is_none() {
            return Err(self.err(
                key,
                format!("{text:?}: node {node_id:?} has no provider {provider_id:?}"),
            ));
        }
        Ok(ProviderRef {
            node_id: node_id.to_owned(),
            provider_id: provider_id.to_owned(),
        })
    }

    fn edge(&self, raw: RawEdge) -> Result<EdgeSettings, ConfigError> {
        check_name(&raw.name).map_err(|why| self.err("edge.name", why))?;
        check_trust_domain(&raw.trust_domain).map_err(|why| self.err("edge.trust_domain", why))?;
        let client_listen = parse_socket_addr(&raw.client_listen)
            .map_err(|why| self.err("edge.client_listen", why))?;
        let node_listen =
            parse_socket_addr(&raw.node_listen).map_err(|why| self.err("edge.node_listen", why))?;
        if client_listen == node_listen && client_listen.port() != 0 {
            return Err(self.err(
                "edge.node_listen",
                format!("{node_listen} is also edge.client_listen"),
            ));
        }
        let max_frame_bytes = match raw.max_frame_bytes {
            None => DEFAULT_MAX_FRAME_BYTES,
            Some(v) => in_range(v, MIN_FRAME_BYTES as u64, MAX_FRAME_BYTES_LIMIT as u64)
                .map(|v| v as usize)
                .map_err(|why| self.err("edge.max_frame_bytes", why))?,
        };
        let body_limit = max_frame_bytes - FRAME_HEADROOM_BYTES;
        let max_request_body_bytes = match raw.max_request_body_bytes {
            None => DEFAULT_MAX_REQUEST_BODY_BYTES,
            Some(v) => in_range(v, 1, body_limit as u64)
                .map(|v| v as usize)
                .map_err(|why| self.err("edge.max_request_body_bytes", why))?,
        };
        if max_request_body_bytes > body_limit {
            // Only reachable with the default body limit and a small frame limit.
            return Err(self.err(
                "edge.max_request_body_bytes",
                format!(
                    "the default {max_request_body_bytes} does not fit edge.max_frame_bytes \
                     {max_frame_bytes} minus {FRAME_HEADROOM_BYTES} bytes of headroom; set it to at most {body_limit}"
                ),
            ));
        }
        let drain_grace_ms = match raw.drain_grace_ms {
            None => DEFAULT_DRAIN_GRACE_MS,
            Some(v) => in_range(v, 0, MAX_DRAIN_GRACE_MS)
                .map_err(|why| self.err("edge.drain_grace_ms", why))?,
        };
        let flow_window_bytes = match raw.flow_window_bytes {
            None => DEFAULT_FLOW_WINDOW_BYTES,
            Some(v) => in_range(v, iop_wire::flow::MIN_WINDOW_BYTES, MAX_FLOW_WINDOW_BYTES)
                .map_err(|why| self.err("edge.flow_window_bytes", why))?,
        };
        let client_write_stall_timeout_ms = match raw.client_write_stall_timeout_ms {
            None => DEFAULT_CLIENT_WRITE_STALL_TIMEOUT_MS,
            Some(v) => in_range(
                v,
                MIN_CLIENT_WRITE_STALL_TIMEOUT_MS,
                MAX_CLIENT_WRITE_STALL_TIMEOUT_MS,
            )
            .map_err(|why| self.err("edge.client_write_stall_timeout_ms", why))?,
        };
        let response_wait_timeout_ms = match raw.response_wait_timeout_ms {
            None => DEFAULT_RESPONSE_WAIT_TIMEOUT_MS,
            Some(v) => in_range(
                v,
                MIN_RESPONSE_WAIT_TIMEOUT_MS,
                MAX_RESPONSE_WAIT_TIMEOUT_MS,
            )
            .map_err(|why| self.err("edge.response_wait_timeout_ms", why))?,
        };
        let metrics_access = match raw.metrics_access.as_deref() {
            None | Some("open") => MetricsAccess::Open,
            Some("key") => MetricsAccess::Key,
            Some(other) => {
                return Err(self.err(
                    "edge.metrics_access",
                    format!("expected \"open\" or \"key\" (got {other:?})"),
                ))
            }
        };
        let node_metrics_max_age_ms = match raw.node_metrics_max_age_ms {
            None => DEFAULT_NODE_METRICS_MAX_AGE_MS,
            Some(v) => in_range(v, 0, MAX_NODE_METRICS_MAX_AGE_MS)
                .map_err(|why| self.err("edge.node_metrics_max_age_ms", why))?,
        };
        use front_door::*;
        let limit = |value: Option<i64>, key: &str, default: u64, min: u64, max: u64| match value {
            None => Ok(default),
            Some(v) => in_range(v, min, max).map_err(|why| self.err(format!("edge.{key}"), why)),
        };
        let limits = ListenerLimits {
            client_head_timeout_ms: limit(
                raw.client_head_timeout_ms,
                "client_head_timeout_ms",
                CLIENT_HEAD_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_body_idle_timeout_ms: limit(
                raw.client_body_idle_timeout_ms,
                "client_body_idle_timeout_ms",
                CLIENT_BODY_IDLE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_body_grace_ms: limit(
                raw.client_body_grace_ms,
                "client_body_grace_ms",
                CLIENT_BODY_GRACE_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_body_min_rate_bytes_per_sec: limit(
                raw.client_body_min_rate_bytes_per_sec,
                "client_body_min_rate_bytes_per_sec",
                CLIENT_BODY_MIN_RATE_BYTES_PER_SEC,
                0,
                MAX_BODY_RATE_LIMIT,
            )?,
            client_keep_alive_timeout_ms: limit(
                raw.client_keep_alive_timeout_ms,
                "client_keep_alive_timeout_ms",
                CLIENT_KEEP_ALIVE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            max_client_connections: limit(
                raw.max_client_connections,
                "max_client_connections",
                MAX_CLIENT_CONNECTIONS,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            max_client_connections_per_peer: limit(
                raw.max_client_connections_per_peer,
                "max_client_connections_per_peer",
                MAX_CLIENT_CONNECTIONS_PER_PEER,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            client_linger_time_ms: limit(
                raw.client_linger_time_ms,
                "client_linger_time_ms",
                CLIENT_LINGER_TIME_MS,
                0,
                MAX_TIMEOUT_MS,
            )?,
            client_linger_idle_timeout_ms: limit(
                raw.client_linger_idle_timeout_ms,
                "client_linger_idle_timeout_ms",
                CLIENT_LINGER_IDLE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_linger_max_bytes: limit(
                raw.client_linger_max_bytes,
                "client_linger_max_bytes",
                CLIENT_LINGER_MAX_BYTES,
                0,
                MAX_LINGER_BYTES_LIMIT,
            )?,
            node_handshake_timeout_ms: limit(
                raw.node_handshake_timeout_ms,
                "node_handshake_timeout_ms",
                NODE_HANDSHAKE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            max_node_handshakes: limit(
                raw.max_node_handshakes,
                "max_node_handshakes",
                MAX_NODE_HANDSHAKES,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            max_node_handshakes_per_peer: limit(
                raw.max_node_handshakes_per_peer,
                "max_node_handshakes_per_peer",
                MAX_NODE_HANDSHAKES_PER_PEER,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            node_first_byte_timeout_ms: limit(
                raw.node_first_byte_timeout_ms,
                "node_first_byte_timeout_ms",
                NODE_FIRST_BYTE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            max_json_depth: limit(
                raw.max_json_depth,
                "max_json_depth",
                MAX_JSON_DEPTH,
                1,
                MAX_JSON_DEPTH_LIMIT,
            )?,
            max_json_elements: limit(
                raw.max_json_elements,
                "max_json_elements",
                MAX_JSON_ELEMENTS,
                1,
                MAX_JSON_ELEMENTS_LIMIT,
            )?,
            max_json_members: limit(
                raw.max_json_members,
                "max_json_members",
                MAX_JSON_MEMBERS,
                1,
                MAX_JSON_ELEMENTS_LIMIT,
            )?,
        };
        Ok(EdgeSettings {
            name: raw.name,
            trust_domain: raw.trust_domain,
            client_listen,
            node_listen,
            max_request_body_bytes,
            max_frame_bytes,
            insecure_plaintext_nodes: raw.insecure_plaintext_nodes,
            allow_anonymous: raw.allow_anonymous,
            metrics_access,
            node_metrics_max_age_ms,
            drain_grace_ms,
            flow_window_bytes,
            client_write_stall_timeout_ms,
            response_wait_timeout_ms,
            limits,
        })
    }

    fn node(&self, i: usize, raw: RawNode) -> Result<NodeSpec, ConfigError> {
        check_name(&raw.id).map_err(|why| self.err(format!("nodes[{i}].id"), why))?;
        let mut adapters: Vec<AdapterSpec> = Vec::with_capacity(raw.adapters.len());
        for (j, raw_adapter) in raw.adapters.into_iter().enumerate() {
            let adapter = self.adapter(&format!("nodes[{i}].adapters[{j}]"), raw_adapter)?;
            if let Some(first) = adapters.iter().position(|a| a.name == adapter.name) {
                return Err(self.err(
                    format!("nodes[{i}].adapters[{j}].name"),
                    format!(
                        "duplicate adapter name {:?} on node {:?} (also nodes[{i}].adapters[{first}])",
                        adapter.name, raw.id
                    ),
                ));
            }
            adapters.push(adapter);
        }
        let mut providers: Vec<ProviderSpec> = Vec::with_capacity(raw.providers.len());
        for (j, raw_provider) in raw.providers.into_iter().enumerate() {
            let key = format!("nodes[{i}].providers[{j}]");
            let provider = self.provider(&key, raw_provider)?;
            if let Some(first) = providers.iter().position(|p| p.id == provider.id) {
                return Err(self.err(
                    format!("{key}.id"),
                    format!(
                        "duplicate provider id {:?} on node {:?} (also nodes[{i}].providers[{first}])",
                        provider.id, raw.id
                    ),
                ));
            }
            if !adapters.iter().any(|a| a.name == provider.adapter) {
                return Err(self.err(
                    format!("{key}.adapter"),
                    format!(
                        "node {:?} has no adapter named {:?}",
                        raw.id, provider.adapter
                    ),
                ));
            }
            providers.push(provider);
        }
        let recipient_key = match raw.recipient_key {
            None => None,
            Some(text) => Some(
                parse_recipient_key(&text)
                    .map_err(|why| self.err(format!("nodes[{i}].recipient_key"), why))?,
            ),
        };
        Ok(NodeSpec {
            id: raw.id,
            adapters,
            providers,
            recipient_key,
        })
    }

    fn adapter(&self, key: &str, raw: RawAdapter) -> Result<AdapterSpec, ConfigError> {
        let kind = match (raw.kind.as_str(), raw.profile) {
            ("openai_compat", None) => AdapterKind::OpenAiCompat {
                profile: ProfileName::OpenAi,
            },
            ("openai_compat", Some(profile)) => AdapterKind::OpenAiCompat {
                profile: ProfileName::from_name(&profile).ok_or_else(|| {
                    self.err(
                        format!("{key}.profile"),
                        format!(
                            "unknown profile {profile:?}: expected \"openai\", \"vllm\", \"llama_cpp\" or \"sglang\""
                        ),
                    )
                })?,
            },
            ("ollama", None) => AdapterKind::Ollama,
            ("ollama", Some(_)) => {
                return Err(self.err(
                    format!("{key}.profile"),
                    "only an openai_compat adapter has a profile",
                ))
            }
            (other, _) => {
                return Err(self.err(
                    format!("{key}.kind"),
                    format!("unknown adapter kind {other:?}: expected \"openai_compat\" or \"ollama\""),
                ))
            }
        };
        let name = match raw.name {
            Some(name) => {
                check_name(&name).map_err(|why| self.err(format!("{key}.name"), why))?;
                name
            }
            None => kind.as_str().to_owned(),
        };
        let base_url = BaseUrl::parse(&raw.base_url)
            .map_err(|why| self.err(format!("{key}.base_url"), why))?;
        let insecure_skip_verify = raw.tls_insecure_skip_verify.unwrap_or(false);
        let ca_file = match raw.ca_file {
            None => None,
            Some(file) => Some(resolve_path(self.file, &format!("{key}.ca_file"), &file)?),
        };
        for (set, name) in [
            (ca_file.is_some(), "ca_file"),
            (
                raw.tls_insecure_skip_verify.is_some(),
                "tls_insecure_skip_verify",
            ),
        ] {
            if set && !base_url.is_tls() {
                return Err(self.err(
                    format!("{key}.{name}"),
                    "only an https:// base_url has provider TLS settings",
                ));
            }
        }
        if insecure_skip_verify && ca_file.is_some() {
            return Err(self.err(
                format!("{key}.tls_insecure_skip_verify"),
                "verifies nothing, so ca_file would be ignored: set one of them",
            ));
        }
        let tls = ProviderTlsSpec {
            ca_file,
            ca_pem: None,
            insecure_skip_verify,
        };
        let capacity = match raw.capacity {
            None => 0,
            Some(v) => in_range(v, 0, u64::from(MAX_CAPACITY))
                .map(|v| v as u32)
                .map_err(|why| self.err(format!("{key}.capacity"), why))?,
        };
        let health_path = match (raw.health_path, kind) {
            (None, _) => None,
            (Some(path), AdapterKind::OpenAiCompat { .. }) => {
                Some(check_path(&path).map_err(|why| self.err(format!("{key}.health_path"), why))?)
            }
            (Some(_), AdapterKind::Ollama) => {
                return Err(self.err(
                    format!("{key}.health_path"),
                    "only an openai_compat adapter has a health path (Ollama's is /api/tags)",
                ))
            }
        };
        Ok(AdapterSpec {
            name,
            kind,
            base_url,
            tls,
            capacity,
            health_path,
        })
    }

    fn provider(&self, key: &str, raw: RawProvider) -> Result<ProviderSpec, ConfigError> {
        check_name(&raw.id).map_err(|why| self.err(format!("{key}.id"), why))?;
        check_text(&raw.target).map_err(|why| self.err(format!("{key}.target"), why))?;
        let capacity = in_range(raw.capacity, 1, u64::from(MAX_CAPACITY))
            .map(|v| v as u32)
            .map_err(|why| self.err(format!("{key}.capacity"), why))?;
        let long_context_capacity = match raw.long_context_capacity {
            None => 0,
            Some(v) => in_range(v, 0, u64::from(capacity))
                .map(|v| v as u32)
                .map_err(|why| {
                    self.err(
                        format!("{key}.long_context_capacity"),
                        format!("{why} (it may not exceed capacity)"),
                    )
                })?,
        };
        let response_stall_timeout_ms = raw.response_stall_timeout_ms.unwrap_or(0);
        effective_stall_timeout(response_stall_timeout_ms).map_err(|e| {
            // The wire error leads with the field name; the key already says it.
            let reason = e.to_string();
            let reason = reason
                .strip_prefix("response_stall_timeout_ms")
                .map_or(reason.as_str(), str::trim_start);
            self.err(format!("{key}.response_stall_timeout_ms"), reason)
        })?;
        let category = match raw.category.as_deref() {
            None | Some("local_inference") => ProviderCategory::LocalInference,
            Some("api") => ProviderCategory::Api,
            Some(other) => {
                return Err(self.err(
                    format!("{key}.category"),
                    format!("unknown category {other:?}: expected \"api\" or \"local_inference\""),
                ))
            }
        };
        Ok(ProviderSpec {
            id: raw.id,
            adapter: raw.adapter,
            target: raw.target,
            capacity,
            long_context_capacity,
            response_stall_timeout_ms,
            category,
            enabled: raw.enabled.unwrap_or(true),
        })
    }

    fn model(&self, i: usize, raw: RawModel, nodes: &[NodeSpec]) -> Result<ModelSpec, ConfigError> {
        let key = format!("models[{i}]");
        check_text(&raw.name).map_err(|why| self.err(format!("{key}.name"), why))?;
        if raw.providers.is_empty() {
            return Err(self.err(
                format!("{key}.providers"),
                "must list at least one provider",
            ));
        }
        let mut providers: Vec<ProviderRef> = Vec::with_capacity(raw.providers.len());
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (j, text) in raw.providers.iter().enumerate() {
            let pkey = format!("{key}.providers[{j}]");
            if let Some(first) = seen.insert(text.as_str(), j) {
                return Err(self.err(
                    pkey,
                    format!("{text:?} is listed twice (also {key}.providers[{first}])"),
                ));
            }
            providers.push(self.provider_ref(&pkey, text, nodes)?);
        }
        let long_context_threshold_tokens = match raw.long_context_threshold_tokens {
            None => None,
            Some(v) => Some(
                in_range(v, 1, MAX_LONG_CONTEXT_THRESHOLD_TOKENS)
                    .map_err(|why| self.err(format!("{key}.long_context_threshold_tokens"), why))?,
            ),
        };
        let max_queue = match raw.max_queue {
            None => DEFAULT_MAX_QUEUE,
            Some(v) => in_range(v, 1, u64::from(MAX_QUEUE_LIMIT))
                .map(|v| v as u32)
                .map_err(|why| self.err(format!("{key}.max_queue"), why))?,
        };
        let queue_timeout_ms = match raw.queue_timeout_ms {
            None => DEFAULT_QUEUE_TIMEOUT_MS,
            Some(v) => in_range(v, 1, MAX_QUEUE_TIMEOUT_MS)
                .map_err(|why| self.err(format!("{key}.queue_timeout_ms"), why))?,
        };
        let max_attempts = match raw.max_attempts {
            None => DEFAULT_MAX_ATTEMPTS,
            Some(v) => in_range(v, 1, u64::from(MAX_ATTEMPTS_LIMIT))
                .map(|v| v as u32)
                .map_err(|why| self.err(format!("{key}.max_attempts"), why))?,
        };
        let owned_by = match raw.owned_by {
            None => DEFAULT_OWNED_BY.to_owned(),
            Some(owned_by) => {
                check_text(&owned_by).map_err(|why| self.err(format!("{key}.owned_by"), why))?;
                owned_by
            }
        };
        Ok(ModelSpec {
            name: raw.name,
            providers,
            long_context_threshold_tokens,
            max_queue,
            queue_timeout_ms,
            max_attempts,
            owned_by,
        })
    }
}

/// Longest accepted `health_path`.
pub const MAX_HEALTH_PATH_BYTES: usize = 256;

/// A request path: starts with `/`, bounded, printable ASCII without
/// spaces, `?` or `#`.
fn check_path(path: &str) -> Result<String, String> {
    if !path.starts_with('/') {
        return Err(format!("must start with `/` (got {path:?})"));
    }
    if path.len() > MAX_HEALTH_PATH_BYTES {
        return Err(format!(
            "must be at most {MAX_HEALTH_PATH_BYTES} bytes (got {})",
            path.len()
        ));
    }
    if let Some(c) = path
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '?' | '#'))
    {
        return Err(format!(
            "must be a plain path: printable ASCII without spaces, `?` or `#` (found {c:?})"
        ));
    }
    Ok(path.to_string())
}

/// `value` as `u64` when `min <= value <= max`.
fn in_range(value: i64, min: u64, max: u64) -> Result<u64, String> {
    match u64::try_from(value) {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(format!("must be between {min} and {max} (got {value})")),
    }
}

/// Free text such as a model name or target: non-empty, bounded, no control
/// characters.
fn check_text(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err("must not be empty".to_owned());
    }
    if text.len() > MAX_TEXT_BYTES {
        return Err(format!(
            "must be at most {MAX_TEXT_BYTES} bytes (got {})",
            text.len()
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(format!("{text:?} must not contain control characters"));
    }
    Ok(())
}

/// An `x25519:<64 hex>` recipient public key that yields a shared secret
/// (low-order points are refused: nothing sealed to them is secret).
fn parse_recipient_key(text: &str) -> Result<PublicKey, String> {
    let key = decode_recipient_public_key(text).map_err(|e| e.to_string())?;
    // Any fixed scalar works: a low-order point gives a non-contributory
    // result for every scalar.
    if !StaticSecret::from([1u8; 32])
        .diffie_hellman(&key)
        .was_contributory()
    {
        return Err("invalid public key: a low-order X25519 point".to_owned());
    }
    Ok(key)
}

/// A POSIX environment variable name: `[A-Za-z_][A-Za-z0-9_]*`, bounded.
fn check_env_name(name: &str) -> Result<(), String> {
    let mut bytes = name.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    let rest_ok = bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !first_ok || !rest_ok || name.len() > MAX_ENV_NAME_BYTES {
        return Err(format!(
            "{name:?} must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*, at most \
             {MAX_ENV_NAME_BYTES} characters)"
        ));
    }
    Ok(())
}

/// A header name the Node may inject: an HTTP token, and not a header that
/// frames or routes the request.
fn check_header_name(name: &str) -> Result<(), String> {
    let token = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if name.is_empty() || name.len() > MAX_HEADER_NAME_BYTES || !token {
        return Err(format!(
            "{name:?} must be an HTTP header name of 1 to {MAX_HEADER_NAME_BYTES} token characters"
        ));
    }
    const RESERVED: [&str; 6] = [
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "content-type",
        "accept",
    ];
    if RESERVED.iter().any(|r| name.eq_ignore_ascii_case(r)) {
        return Err(format!("{name:?} cannot carry a credential"));
    }
    Ok(())
}

/// A header value format: visible ASCII, space and tab, with `{secret}`.
fn check_header_format(format: &str) -> Result<(), String> {
    let valid = format
        .bytes()
        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b));
    if format.is_empty() || format.len() > MAX_HEADER_FORMAT_BYTES || !valid {
        return Err(format!(
            "{format:?} must be 1 to {MAX_HEADER_FORMAT_BYTES} characters of visible ASCII, space \
             or tab"
        ));
    }
    if !format.contains(SECRET_PLACEHOLDER) {
        return Err(format!("{format:?} must contain {SECRET_PLACEHOLDER}"));
    }
    Ok(())
}

fn parse_socket_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not an IP:port socket address (e.g. 127.0.0.1:8080)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid file that exercises every table; variants are made by
    /// replacing one snippet.
    const BASE: &str = r#"
[edge]
name = "edge-1"
trust_domain = "iop.local"
client_listen = "127.0.0.1:8080"
node_listen = "127.0.0.1:7443"

[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"

[[nodes]]
id = "node-a"

[[nodes.adapters]]
name = "vllm-main"
kind = "openai_compat"
profile = "vllm"
base_url = "http://127.0.0.1:8000"
capacity = 8

[[nodes.adapters]]
kind = "ollama"
base_url = "http://127.0.0.1:11434"

[[nodes.providers]]
id = "a-llama"
adapter = "vllm-main"
target = "meta-llama/Llama-3.1-8B-Instruct"
capacity = 8
long_context_capacity = 2

[[nodes.providers]]
id = "a-qwen"
adapter = "ollama"
target = "qwen2.5:7b"
capacity = 4

[[models]]
name = "llama-3.1-8b"
providers = ["node-a/a-llama"]
"#;

    /// `BASE` with the one occurrence of `old` replaced by `new`.
    fn variant(old: &str, new: &str) -> String {
        assert_eq!(
            BASE.matches(old).count(),
            1,
            "snippet {old:?} must occur once"
        );
        BASE.replacen(old, new, 1)
    }

    fn parse(text: &str) -> Result<EdgeConfig, ConfigError> {
        EdgeConfig::parse(text, "conf/edge.toml")
    }

    /// The error text for `text`.
    fn error(text: &str) -> String {
        match parse(text) {
            Ok(config) => panic!("expected an error, parsed {config:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn error_of(old: &str, new: &str) -> String {
        error(&variant(old, new))
    }

    fn example_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/edge.toml")
    }

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    fn base_url(text: &str) -> BaseUrl {
        match BaseUrl::parse(text) {
            Ok(url) => url,
            Err(why) => panic!("{why}"),
        }
    }

    #[test]
    fn example_file_parses_into_the_documented_values() {
        let path = example_path();
        let text = std::fs::read_to_string(&path).unwrap();
        let config = EdgeConfig::parse(&text, &path).unwrap();
        let dir = path.parent().unwrap();
        let expected = EdgeConfig {
            source: path.clone(),
            edge: EdgeSettings {
                name: "edge-1".into(),
                trust_domain: "iop.local".into(),
                client_listen: "127.0.0.1:8080".parse().unwrap(),
                node_listen: "127.0.0.1:7443".parse().unwrap(),
                max_request_body_bytes: 8 * 1024 * 1024,
                max_frame_bytes: 16 * 1024 * 1024,
                insecure_plaintext_nodes: false,
                allow_anonymous: true,
                metrics_access: MetricsAccess::Open,
                node_metrics_max_age_ms: 5_000,
                drain_grace_ms: 30_000,
                flow_window_bytes: 256 * 1024,
                client_write_stall_timeout_ms: 30_000,
                response_wait_timeout_ms: 600_000,
                limits: ListenerLimits::default(),
            },
            tls: Some(TlsFiles {
                ca: dir.join("certs/ca.pem"),
                cert: dir.join("certs/edge.pem"),
                key: dir.join("certs/edge-key.pem"),
            }),
            client_tls: None,
            access_log: AccessLogSpec::default(),
            usage_log: None,
            nodes: vec![NodeSpec {
                id: "node-a".into(),
                adapters: vec![
                    AdapterSpec {
                        name: "vllm-main".into(),
                        kind: AdapterKind::OpenAiCompat {
                            profile: ProfileName::Vllm,
                        },
                        base_url: base_url("http://127.0.0.1:8000"),
                        tls: ProviderTlsSpec::default(),
                        capacity: 8,
                        health_path: None,
                    },
                    AdapterSpec {
                        name: "ollama".into(),
                        kind: AdapterKind::Ollama,
                        base_url: base_url("http://127.0.0.1:11434"),
                        tls: ProviderTlsSpec::default(),
                        capacity: 4,
                        health_path: None,
                    },
                ],
                providers: vec![
                    ProviderSpec {
                        id: "a-llama".into(),
                        adapter: "vllm-main".into(),
                        target: "meta-llama/Llama-3.1-8B-Instruct".into(),
                        capacity: 8,
                        long_context_capacity: 2,
                        response_stall_timeout_ms: 0,
                        category: ProviderCategory::LocalInference,
                        enabled: true,
                    },
                    ProviderSpec {
                        id: "a-qwen".into(),
                        adapter: "ollama".into(),
                        target: "qwen2.5:7b".into(),
                        capacity: 4,
                        long_context_capacity: 0,
                        response_stall_timeout_ms: 120_000,
                        category: ProviderCategory::LocalInference,
                        enabled: true,
                    },
                ],
                recipient_key: None,
            }],
            models: vec![
                ModelSpec {
                    name: "llama-3.1-8b".into(),
                    providers: vec![ProviderRef {
                        node_id: "node-a".into(),
                        provider_id: "a-llama".into(),
                    }],
                    long_context_threshold_tokens: Some(32_000),
                    max_queue: 256,
                    queue_timeout_ms: 30_000,
                    max_attempts: 2,
                    owned_by: "iop".into(),
                },
                ModelSpec {
                    name: "qwen2.5-7b".into(),
                    providers: vec![ProviderRef {
                        node_id: "node-a".into(),
                        provider_id: "a-qwen".into(),
                    }],
                    long_context_threshold_tokens: None,
                    max_queue: 256,
                    queue_timeout_ms: 30_000,
                    max_attempts: 2,
                    owned_by: "iop".into(),
                },
            ],
            credentials: None,
            outlier_detection: OutlierDetection::default(),
            client_keys: vec![],
        };
        assert_eq!(config, expected);
    }

    #[test]
    fn omitted_keys_take_their_defaults() {
        let config = parse(BASE).unwrap();
        assert_eq!(config.edge.max_request_body_bytes, 8_388_608);
        assert_eq!(config.edge.max_frame_bytes, 16_777_216);
        assert!(!config.edge.insecure_plaintext_nodes);
        let node = config.node("node-a").unwrap();
        let ollama = node.adapter("ollama").unwrap();
        assert_eq!((ollama.kind, ollama.capacity), (AdapterKind::Ollama, 0));
        let qwen = node.provider("a-qwen").unwrap();
        assert_eq!(qwen.long_context_capacity, 0);
        assert_eq!(qwen.response_stall_timeout_ms, 0);
        assert_eq!(qwen.category, ProviderCategory::LocalInference);
        assert!(qwen.enabled);
        let model = config.model("llama-3.1-8b").unwrap();
        assert_eq!(model.long_context_threshold_tokens, None);
        assert_eq!(model.max_queue, 256);
        assert_eq!(model.queue_timeout_ms, 30_000);
        assert_eq!(model.owned_by, "iop");
        assert!(config.node("node-b").is_none());
        assert!(config.model("gpt-4").is_none());
    }

    #[test]
    fn openai_compat_profile_defaults_to_openai() {
        let config = parse(&variant("profile = \"vllm\"\n", "")).unwrap();
        let adapter = config.node("node-a").unwrap().adapter("vllm-main").unwrap();
        assert_eq!(
            adapter.kind,
            AdapterKind::OpenAiCompat {
                profile: ProfileName::OpenAi
            }
        );
    }

    #[test]
    fn explicit_values_are_kept() {
        let config = parse(&variant(
            "capacity = 4\n",
            "capacity = 4\nresponse_stall_timeout_ms = 5000\ncategory = \"api\"\nenabled = false\n",
        ))
        .unwrap();
        let qwen = config.node("node-a").unwrap().provider("a-qwen").unwrap();
        assert_eq!(qwen.response_stall_timeout_ms, 5000);
        assert_eq!(qwen.category, ProviderCategory::Api);
        assert!(!qwen.enabled);
    }

    #[test]
    fn toml_syntax_error_has_no_key_and_a_location() {
        assert_eq!(
            error_of("id = \"node-a\"", "id = \"node-a"),
            "conf/edge.toml: -: invalid basic string, expected `\"` (line 14, column 13)"
        );
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_path() {
        assert_eq!(
            error_of("[tls]", "colour = \"blue\"\n[tls]"),
            "conf/edge.toml: edge.colour: unknown field `colour`, expected one of `name`, `trust_domain`, \
             `client_listen`, `node_listen`, `max_request_body_bytes`, `max_frame_bytes`, \
             `insecure_plaintext_nodes`, `allow_anonymous`, `metrics_access`, \
             `node_metrics_max_age_ms`, `drain_grace_ms`, `flow_window_bytes`, \
             `client_write_stall_timeout_ms`, `response_wait_timeout_ms`, \
             `client_head_timeout_ms`, `client_body_idle_timeout_ms`, `client_body_grace_ms`, \
             `client_body_min_rate_bytes_per_sec`, `client_keep_alive_timeout_ms`, \
             `max_client_connections`, `max_client_connections_per_peer`, `client_linger_time_ms`, \
             `client_linger_idle_timeout_ms`, `client_linger_max_bytes`, `node_handshake_timeout_ms`, \
             `max_node_handshakes`, `max_node_handshakes_per_peer`, `node_first_byte_timeout_ms`, \
             `max_json_depth`, `max_json_elements`, `max_json_members`, `client_tls`, `access_log`, \
             `usage_log` (line 8, column 1)"
        );
        assert_eq!(
            error_of("target = \"qwen2.5:7b\"", "target = \"qwen2.5:7b\"\nmodel = \"x\""),
            "conf/edge.toml: nodes[0].providers[1].model: unknown field `model`, expected one of `id`, \
             `adapter`, `target`, `capacity`, `long_context_capacity`, `response_stall_timeout_ms`, \
             `category`, `enabled` (line 38, column 1)"
        );
        assert_eq!(
            error(&format!("{BASE}\n[metrics]\nlisten = \"x\"\n")),
            "conf/edge.toml: metrics: unknown field `metrics`, expected one of `edge`, `tls`, \
             `credentials`, `client_keys`, `nodes`, `models`, `outlier_detection` (line 44, column 2)"
        );
    }

    #[test]
    fn missing_and_mistyped_keys_name_the_key() {
        assert_eq!(
            error(""),
            "conf/edge.toml: edge: required key is missing (line 1, column 1)"
        );
        assert_eq!(
            error_of("name = \"edge-1\"\n", ""),
            "conf/edge.toml: edge.name: required key is missing (line 2, column 1)"
        );
        assert_eq!(
            error_of("capacity = 4\n", ""),
            "conf/edge.toml: nodes[0].providers[1].capacity: required key is missing (line 34, column 1)"
        );
        assert_eq!(
            error_of("capacity = 4\n", "capacity = \"4\"\n"),
            "conf/edge.toml: nodes[0].providers[1].capacity: invalid type: string \"4\", expected i64 \
             (line 38, column 12)"
        );
    }

    #[test]
    fn identity_names_are_spiffe_path_segments() {
        let rule = "must be 1 to 128 characters of A-Z a-z 0-9 . _ -";
        assert_eq!(
            error_of("name = \"edge-1\"", "name = \"edge/1\""),
            format!("conf/edge.toml: edge.name: \"edge/1\" {rule}")
        );
        assert_eq!(
            error_of("id = \"node-a\"", "id = \"\""),
            format!("conf/edge.toml: nodes[0].id: \"\" {rule}")
        );
        let long = "n".repeat(129);
        assert_eq!(
            error_of("id = \"node-a\"", &format!("id = \"{long}\"")),
            format!("conf/edge.toml: nodes[0].id: \"{long}\" {rule}")
        );
        assert_eq!(
            error_of("id = \"node-a\"", "id = \"..\""),
            "conf/edge.toml: nodes[0].id: \"..\" is not a valid name"
        );
        assert_eq!(
            error_of("name = \"vllm-main\"", "name = \"vllm main\""),
            format!("conf/edge.toml: nodes[0].adapters[0].name: \"vllm main\" {rule}")
        );
        assert_eq!(
            error_of("id = \"a-qwen\"", "id = \"a:qwen\""),
            format!("conf/edge.toml: nodes[0].providers[1].id: \"a:qwen\" {rule}")
        );
    }

    #[test]
    fn a_128_character_node_id_is_accepted() {
        let long = "n".repeat(128);
        let text = variant("id = \"node-a\"", &format!("id = \"{long}\"")).replacen(
            "\"node-a/a-llama\"",
            &format!("\"{long}/a-llama\""),
            1,
        );
        let config = parse(&text).unwrap();
        assert_eq!(config.nodes[0].id, long);
        assert_eq!(config.models[0].providers[0].node_id, long);
    }

    #[test]
    fn trust_domain_is_checked() {
        assert_eq!(
            error_of("trust_domain = \"iop.local\"", "trust_domain = \"IOP.local\""),
            "conf/edge.toml: edge.trust_domain: \"IOP.local\" must be 1 to 255 characters of a-z 0-9 . _ -"
        );
    }

    #[test]
    fn listen_addresses_are_socket_addresses() {
        assert_eq!(
            error_of("client_listen = \"127.0.0.1:8080\"", "client_listen = \"localhost:8080\""),
            "conf/edge.toml: edge.client_listen: \"localhost:8080\" is not an IP:port socket address \
             (e.g. 127.0.0.1:8080)"
        );
        assert_eq!(
            error_of(
                "node_listen = \"127.0.0.1:7443\"",
                "node_listen = \"127.0.0.1\""
            ),
            "conf/edge.toml: edge.node_listen: \"127.0.0.1\" is not an IP:port socket address \
             (e.g. 127.0.0.1:8080)"
        );
        assert_eq!(
            error_of(
                "node_listen = \"127.0.0.1:7443\"",
                "node_listen = \"127.0.0.1:8080\""
            ),
            "conf/edge.toml: edge.node_listen: 127.0.0.1:8080 is also edge.client_listen"
        );
        let both_ephemeral = variant(
            "client_listen = \"127.0.0.1:8080\"",
            "client_listen = \"127.0.0.1:0\"",
        )
        .replacen(
            "node_listen = \"127.0.0.1:7443\"",
            "node_listen = \"127.0.0.1:0\"",
            1,
        );
        assert!(parse(&both_ephemeral).is_ok());
    }

    #[test]
    fn frame_and_body_limits_are_in_range() {
        let edge = "node_listen = \"127.0.0.1:7443\"";
        assert_eq!(
            error_of(edge, &format!("{edge}\nmax_frame_bytes = 1000")),
            "conf/edge.toml: edge.max_frame_bytes: must be between 131072 and 1073741824 (got 1000)"
        );
        assert_eq!(
            error_of(edge, &format!("{edge}\nmax_frame_bytes = 1048576\nmax_request_body_bytes = 1048576")),
            "conf/edge.toml: edge.max_request_body_bytes: must be between 1 and 983040 (got 1048576)"
        );
        assert_eq!(
            error_of(edge, &format!("{edge}\nmax_request_body_bytes = 0")),
            "conf/edge.toml: edge.max_request_body_bytes: must be between 1 and 16711680 (got 0)"
        );
        assert_eq!(
            error_of(edge, &format!("{edge}\nmax_frame_bytes = 1048576")),
            "conf/edge.toml: edge.max_request_body_bytes: the default 8388608 does not fit \
             edge.max_frame_bytes 1048576 minus 65536 bytes of headroom; set it to at most 983040"
        );
        let config = parse(&variant(
            edge,
            &format!("{edge}\nmax_frame_bytes = 1048576\nmax_request_body_bytes = 983040"),
        ))
        .unwrap();
        assert_eq!(
            (
                config.edge.max_frame_bytes,
                config.edge.max_request_body_bytes
            ),
            (1_048_576, 983_040)
        );
    }

    #[test]
    fn drain_grace_defaults_and_is_in_range() {
        let edge = "node_listen = \"127.0.0.1:7443\"";
        assert_eq!(parse(BASE).unwrap().edge.drain_grace_ms, 30_000);
        assert_eq!(
            error_of(edge, &format!("{edge}\ndrain_grace_ms = -1")),
            "conf/edge.toml: edge.drain_grace_ms: must be between 0 and 3600000 (got -1)"
        );
        assert_eq!(
            error_of(edge, &format!("{edge}\ndrain_grace_ms = 3600001")),
            "conf/edge.toml: edge.drain_grace_ms: must be between 0 and 3600000 (got 3600001)"
        );
        assert_eq!(
            error_of(edge, &format!("{edge}\ndrain_grace_ms = \"5s\"")),
            "conf/edge.toml: edge.drain_grace_ms: invalid type: string \"5s\", expected i64 \
             (line 7, column 18)"
        );
        for (value, expected) in [("0", 0), ("3600000", 3_600_000), ("250", 250)] {
            let config =
                parse(&variant(edge, &format!("{edge}\ndrain_grace_ms = {value}"))).unwrap();
            assert_eq!(config.edge.drain_grace_ms, expected);
        }
    }

    #[test]
    fn flow_window_and_write_stall_timeout_default_and_are_in_range() {
        let edge = "node_listen = \"127.0.0.1:7443\"";
        let base = parse(BASE).unwrap();
        assert_eq!(base.edge.flow_window_bytes, 262_144);
        assert_eq!(base.edge.client_write_stall_timeout_ms, 30_000);
        assert_eq!(
            error_of(edge, &format!("{edge}\nflow_window_bytes = 255")),
            "conf/edge.toml: edge.flow_window_bytes: must be between 256 and 16777216 (got 255)"
        );
        assert_eq!(
            error_of(edge, &format!("{edge}\nclient_write_stall_timeout_ms = 99")),
            "conf/edge.toml: edge.client_write_stall_timeout_ms: must be between 100 and 3600000 \
             (got 99)"
        );
        let config = parse(&variant(
            edge,
            &format!("{edge}\nflow_window_bytes = 65536\nclient_write_stall_timeout_ms = 2500"),
        ))
        .unwrap();
        assert_eq!(
            (
                config.edge.flow_window_bytes,
                config.edge.client_write_stall_timeout_ms
            ),
            (65_536, 2_500)
        );
    }

    #[test]
    fn response_wait_timeout_defaults_and_is_in_range() {
        let edge = "node_listen = \"127.0.0.1:7443\"";
        assert_eq!(parse(BASE).unwrap().edge.response_wait_timeout_ms, 600_000);
        assert_eq!(
            error_of(edge, &format!("{edge}\nresponse_wait_timeout_ms = 99")),
            "conf/edge.toml: edge.response_wait_timeout_ms: must be between 100 and 86400000 \
             (got 99)"
        );
        let config = parse(&variant(
            edge,
            &format!("{edge}\nresponse_wait_timeout_ms = 1500"),
        ))
        .unwrap();
        assert_eq!(config.edge.response_wait_timeout_ms, 1_500);
    }

    #[test]
    fn outlier_detection_and_max_attempts_default_parse_and_are_in_range() {
        let base = parse(BASE).unwrap();
        assert_eq!(base.outlier_detection, OutlierDetection::default());
        assert_eq!(
            base.outlier_detection,
            OutlierDetection {
                enabled: true,
                consecutive_failures: 5,
                base_ejection_time_ms: 30_000,
                max_ejection_time_ms: 300_000,
                max_ejection_percent: 50,
            }
        );
        assert_eq!(base.models[0].max_attempts, 2);
        let with = |table: &str| format!("{BASE}\n[outlier_detection]\n{table}\n");
        let config = parse(&with(
            "enabled = false\nconsecutive_failures = 3\nbase_ejection_time_ms = 500\n\
             max_ejection_time_ms = 2000\nmax_ejection_percent = 100",
        ))
        .unwrap();
        assert_eq!(
            config.outlier_detection,
            OutlierDetection {
                enabled: false,
                consecutive_failures: 3,
                base_ejection_time_ms: 500,
                max_ejection_time_ms: 2_000,
                max_ejection_percent: 100,
            }
        );
        // A base longer than the default maximum raises the maximum with it.
        let config = parse(&with("base_ejection_time_ms = 600000")).unwrap();
        assert_eq!(config.outlier_detection.max_ejection_time_ms, 600_000);
        for (table, why) in [
            (
                "consecutive_failures = 0",
                "outlier_detection.consecutive_failures: must be between 1 and 1000 (got 0)",
            ),
            (
                "max_ejection_percent = 101",
                "outlier_detection.max_ejection_percent: must be between 0 and 100 (got 101)",
            ),
            (
                "base_ejection_time_ms = 1000\nmax_ejection_time_ms = 999",
                "outlier_detection.max_ejection_time_ms: must be between 1000 and 86400000 (got 999)",
            ),
        ] {
            assert_eq!(error(&with(table)), format!("conf/edge.toml: {why}"));
        }
        assert!(error(&with("colour = 1"))
            .starts_with("conf/edge.toml: outlier_detection.colour: unknown field `colour`"));
        let model = "providers = [\"node-a/a-llama\"]";
        let config = parse(&variant(model, &format!("{model}\nmax_attempts = 1"))).unwrap();
        assert_eq!(config.models[0].max_attempts, 1);
        assert_eq!(
            error_of(model, &format!("{model}\nmax_attempts = 6")),
            "conf/edge.toml: models[0].max_attempts: must be between 1 and 5 (got 6)"
        );
    }

    #[test]
    fn front_door_limits_default_parse_and_are_in_range() {
        let edge = "node_listen = \"127.0.0.1:7443\"";
        assert_eq!(parse(BASE).unwrap().edge.limits, ListenerLimits::default());
        let all = format!(
            "{edge}\nclient_head_timeout_ms = 1\nclient_body_idle_timeout_ms = 2\n\
             client_keep_alive_timeout_ms = 3\nmax_client_connections = 4\n\
             client_linger_time_ms = 0\nclient_linger_idle_timeout_ms = 6\n\
             client_linger_max_bytes = 7\nnode_handshake_timeout_ms = 8\n\
             max_node_handshakes = 9\nmax_json_depth = 10\nmax_json_elements = 11\n\
             client_body_grace_ms = 12\nclient_body_min_rate_bytes_per_sec = 0\n\
             max_client_connections_per_peer = 14\nmax_node_handshakes_per_peer = 15\n\
             node_first_byte_timeout_ms = 16\nmax_json_members = 17"
        );
        assert_eq!(
            parse(&variant(edge, &all)).unwrap().edge.limits,
            ListenerLimits {
                client_head_timeout_ms: 1,
                client_body_idle_timeout_ms: 2,
                client_body_grace_ms: 12,
                client_body_min_rate_bytes_per_sec: 0,
                client_keep_alive_timeout_ms: 3,
                max_client_connections: 4,
                max_client_connections_per_peer: 14,
                client_linger_time_ms: 0,
                client_linger_idle_timeout_ms: 6,
                client_linger_max_bytes: 7,
                node_handshake_timeout_ms: 8,
                max_node_handshakes: 9,
                max_node_handshakes_per_peer: 15,
                node_first_byte_timeout_ms: 16,
                max_json_depth: 10,
                max_json_elements: 11,
                max_json_members: 17,
            }
        );
        for (key, bad, range) in [
            ("client_head_timeout_ms", "0", "1 and 3600000"),
            ("client_body_idle_timeout_ms", "3600001", "1 and 3600000"),
            ("client_keep_alive_timeout_ms", "-5", "1 and 3600000"),
            ("max_client_connections", "0", "1 and 1000000"),
            ("client_linger_time_ms", "-1", "0 and 3600000"),
            ("client_linger_idle_timeout_ms", "0", "1 and 3600000"),
            (
                "client_linger_max_bytes",
                "17179869185",
                "0 and 17179869184",
            ),
            ("node_handshake_timeout_ms", "0", "1 and 3600000"),
            ("max_node_handshakes", "1000001", "1 and 1000000"),
            ("max_json_depth", "129", "1 and 128"),
            ("max_json_elements", "0", "1 and 16000000"),
            ("client_body_grace_ms", "0", "1 and 3600000"),
            (
                "client_body_min_rate_bytes_per_sec",
                "1073741825",
                "0 and 1073741824",
            ),
            ("max_client_connections_per_peer", "0", "1 and 1000000"),
            ("max_node_handshakes_per_peer", "0", "1 and 1000000"),
            ("node_first_byte_timeout_ms", "0", "1 and 3600000"),
            ("max_json_members", "16000001", "1 and 16000000"),
        ] {
            assert_eq!(
                error_of(edge, &format!("{edge}\n{key} = {bad}")),
                format!("conf/edge.toml: edge.{key}: must be between {range} (got {bad})")
            );
        }
    }

    #[test]
    fn an_edge_without_client_keys_must_say_it_runs_open() {
        let no_keys = parse(BASE).unwrap();
        assert!(no_keys.client_keys.is_empty());
        assert_eq!(
            no_keys.check_open_access().unwrap_err().to_string(),
            "conf/edge.toml: client_keys: no client key is configured, so every client would be \
             served without one; add [[client_keys]], or set edge.allow_anonymous = true to run open"
        );
        let edge = "node_listen = \"127.0.0.1:7443\"";
        let open = parse(&variant(edge, &format!("{edge}\nallow_anonymous = true"))).unwrap();
        assert!(open.edge.allow_anonymous);
        assert_eq!(open.check_open_access(), Ok(()));
    }

    #[test]
    fn the_nodes_metrics_cache_age_defaults_to_five_seconds_and_is_bounded() {
        let edge = "node_listen = \"127.0.0.1:7443\"";
        assert_eq!(parse(BASE).unwrap().edge.node_metrics_max_age_ms, 5_000);
        let off = parse(&variant(
            edge,
            &format!("{edge}\nnode_metrics_max_age_ms = 0"),
        ))
        .unwrap();
        assert_eq!(off.edge.node_metrics_max_age_ms, 0);
        assert_eq!(
            error_of(edge, &format!("{edge}\nnode_metrics_max_age_ms = 600001")),
            "conf/edge.toml: edge.node_metrics_max_age_ms: must be between 0 and 600000 (got 600001)"
        );
    }

    #[test]
    fn tls_is_required_unless_insecure() {
        let tls = "[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge-key.pem\"\n";
        assert_eq!(
            error_of(tls, ""),
            "conf/edge.toml: tls: required unless edge.insecure_plaintext_nodes = true"
        );
        assert_eq!(
            error_of("cert = \"certs/edge.pem\"", "cert = \"\""),
            "conf/edge.toml: tls.cert: must not be empty"
        );
        // CONTRACT: T5 — plain TCP only behind the explicit flag; no TLS files then.
        let insecure = variant(tls, "").replacen(
            "node_listen = \"127.0.0.1:7443\"",
            "node_listen = \"127.0.0.1:7443\"\ninsecure_plaintext_nodes = true",
            1,
        );
        let config = parse(&insecure).unwrap();
        assert!(config.edge.insecure_plaintext_nodes);
        assert_eq!(config.tls, None);
        assert_eq!(config.validate_files(), Ok(()));
    }

    #[test]
    fn tls_paths_resolve_against_the_config_directory() {
        let config = parse(&variant(
            "key = \"certs/edge-key.pem\"",
            "key = \"/etc/iop/edge-key.pem\"",
        ))
        .unwrap();
        assert_eq!(
            config.tls,
            Some(TlsFiles {
                ca: PathBuf::from("conf/certs/ca.pem"),
                cert: PathBuf::from("conf/certs/edge.pem"),
                key: PathBuf::from("/etc/iop/edge-key.pem"),
            })
        );
        let bare = EdgeConfig::parse(BASE, "edge.toml").unwrap();
        assert_eq!(bare.tls.map(|t| t.ca), Some(PathBuf::from("certs/ca.pem")));
    }

    #[test]
    fn validate_files_accepts_readable_files() {
        let config = EdgeConfig::parse(BASE, fixture("edge.toml")).unwrap();
        assert_eq!(config.validate_files(), Ok(()));
    }

    #[test]
    fn validate_files_names_the_key_and_path() {
        let config = EdgeConfig::parse(BASE, "/nonexistent-iop/edge.toml").unwrap();
        assert_eq!(
            config.validate_files().unwrap_err().to_string(),
            "/nonexistent-iop/edge.toml: tls.ca: cannot read /nonexistent-iop/certs/ca.pem: \
             No such file or directory (os error 2)"
        );
        // A directory is not a readable file.
        let dir = fixture("");
        let text = variant("cert = \"certs/edge.pem\"", "cert = \"certs\"");
        let config = EdgeConfig::parse(&text, fixture("edge.toml")).unwrap();
        assert_eq!(
            config.validate_files().unwrap_err().to_string(),
            format!(
                "{}: tls.cert: cannot read {}: not a regular file",
                fixture("edge.toml").display(),
                dir.join("certs").display()
            )
        );
    }

    #[test]
    fn load_reads_parses_and_checks_files() {
        assert_eq!(
            EdgeConfig::load("/nonexistent-iop/edge.toml").unwrap_err().to_string(),
            "/nonexistent-iop/edge.toml: -: cannot read config file: No such file or directory (os error 2)"
        );
        let config = EdgeConfig::load(fixture("edge.toml")).unwrap();
        assert_eq!(config.source, fixture("edge.toml"));
        assert_eq!(config.models[0].name, "qwen2.5-7b");
    }

    #[test]
    fn duplicates_are_rejected() {
        assert_eq!(
            error(&format!("{BASE}\n[[nodes]]\nid = \"node-a\"\n")),
            "conf/edge.toml: nodes[1].id: duplicate node id \"node-a\" (also nodes[0])"
        );
        assert_eq!(
            error_of("name = \"vllm-main\"", "name = \"ollama\""),
            "conf/edge.toml: nodes[0].adapters[1].name: duplicate adapter name \"ollama\" on node \"node-a\" \
             (also nodes[0].adapters[0])"
        );
        assert_eq!(
            error_of("id = \"a-qwen\"", "id = \"a-llama\""),
            "conf/edge.toml: nodes[0].providers[1].id: duplicate provider id \"a-llama\" on node \"node-a\" \
             (also nodes[0].providers[0])"
        );
        assert_eq!(
            error(&format!("{BASE}\n[[models]]\nname = \"llama-3.1-8b\"\nproviders = [\"node-a/a-qwen\"]\n")),
            "conf/edge.toml: models[1].name: duplicate model name \"llama-3.1-8b\" (also models[0])"
        );
        // The same provider id on two nodes is fine.
        let second_node = format!(
            "{BASE}\n[[nodes]]\nid = \"node-b\"\n[[nodes.adapters]]\nkind = \"ollama\"\n\
             base_url = \"http://10.0.0.2:11434\"\n[[nodes.providers]]\nid = \"a-qwen\"\n\
             adapter = \"ollama\"\ntarget = \"qwen2.5:7b\"\ncapacity = 1\n"
        );
        assert_eq!(parse(&second_node).unwrap().nodes.len(), 2);
    }

    #[test]
    fn adapter_kind_and_profile_are_checked() {
        assert_eq!(
            error_of("kind = \"ollama\"", "kind = \"tgi\""),
            "conf/edge.toml: nodes[0].adapters[1].kind: unknown adapter kind \"tgi\": \
             expected \"openai_compat\" or \"ollama\""
        );
        assert_eq!(
            error_of("profile = \"vllm\"", "profile = \"vLLM\""),
            "conf/edge.toml: nodes[0].adapters[0].profile: unknown profile \"vLLM\": \
             expected \"openai\", \"vllm\", \"llama_cpp\" or \"sglang\""
        );
        assert_eq!(
            error_of("kind = \"ollama\"", "kind = \"ollama\"\nprofile = \"vllm\""),
            "conf/edge.toml: nodes[0].adapters[1].profile: only an openai_compat adapter has a profile"
        );
        assert_eq!(
            error_of("capacity = 8\n\n", "capacity = -1\n\n"),
            "conf/edge.toml: nodes[0].adapters[0].capacity: must be between 0 and 65536 (got -1)"
        );
    }

    #[test]
    fn base_url_must_be_http_host_port_or_https() {
        let url = "base_url = \"http://127.0.0.1:8000\"";
        let key = "conf/edge.toml: nodes[0].adapters[0].base_url:";
        let cases = [
            (
                "ftp://api.openai.com:443",
                "\"ftp://api.openai.com:443\": expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "https://[::1:8443",
                "\"https://[::1:8443\": unclosed [ in host; expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            ("127.0.0.1:8000", "\"127.0.0.1:8000\": expected http://host:port[/prefix] or https://host[:port][/prefix]"),
            (
                "http://127.0.0.1",
                "\"http://127.0.0.1\": missing :port; expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "http://127.0.0.1:0",
                "\"http://127.0.0.1:0\": \"0\" is not a port (1-65535); expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "http://h:8000/x?y=1",
                "\"http://h:8000/x?y=1\": must not have a query or fragment; expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "http://u:p@h:8000",
                "\"http://u:p@h:8000\": must not contain user info; expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "http://h_1:8000",
                "\"http://h_1:8000\": \"h_1\" is not a host name or IP address; expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "http://[::1:8000",
                "\"http://[::1:8000\": unclosed [ in host; expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "http://h:8000//x",
                "\"http://h:8000//x\": path has an empty segment; expected http://host:port[/prefix] or https://host[:port][/prefix]",
            ),
            (
                "http://h:8000/v1",
                "\"http://h:8000/v1\": drop the trailing /v1: operation paths already start with /v1",
            ),
        ];
        for (bad, reason) in cases {
            assert_eq!(
                error_of(url, &format!("base_url = \"{bad}\"")),
                format!("{key} {reason}")
            );
        }
    }

    #[test]
    fn base_url_parts() {
        let url = base_url("HTTP://gpu-1.lan:8000/serving/");
        assert_eq!(
            (url.host(), url.port(), url.path_prefix()),
            ("gpu-1.lan", 8000, "/serving")
        );
        assert_eq!(url.origin(), "http://gpu-1.lan:8000");
        assert_eq!(url.to_string(), "http://gpu-1.lan:8000/serving");
        assert_eq!(url.join("/health"), "/serving/health");
        let v6 = base_url("http://[::1]:11434");
        assert_eq!((v6.host(), v6.port(), v6.path_prefix()), ("::1", 11434, ""));
        assert_eq!(v6.to_string(), "http://[::1]:11434");
        assert_eq!(base_url("http://h:1/").to_string(), "http://h:1");
        let hosted = base_url("HTTPS://API.openai.com");
        assert!(hosted.is_tls());
        assert_eq!((hosted.host(), hosted.port()), ("API.openai.com", 443));
        assert_eq!(hosted.origin(), "https://api.openai.com:443");
        let gateway = base_url("https://[::1]:8443/gw/");
        assert_eq!((gateway.host(), gateway.port()), ("::1", 8443));
        assert_eq!(gateway.to_string(), "https://[::1]:8443/gw");
        assert!(!base_url("http://h:1").is_tls());
        assert_eq!(
            BaseUrl::parse("httpé://h:1"),
            Err("\"httpé://h:1\": expected http://host:port[/prefix] or https://host[:port][/prefix]".to_owned())
        );
    }

    #[test]
    fn provider_values_are_checked() {
        let key = "conf/edge.toml: nodes[0].providers[1]";
        assert_eq!(
            error_of("capacity = 4\n", "capacity = 0\n"),
            format!("{key}.capacity: must be between 1 and 65536 (got 0)")
        );
        assert_eq!(
            error_of("capacity = 4\n", "capacity = 4\nlong_context_capacity = 5\n"),
            format!("{key}.long_context_capacity: must be between 0 and 4 (got 5) (it may not exceed capacity)")
        );
        assert_eq!(
            error_of(
                "capacity = 4\n",
                "capacity = 4\nresponse_stall_timeout_ms = -1\n"
            ),
            format!("{key}.response_stall_timeout_ms: must not be negative (got -1)")
        );
        assert_eq!(
            error_of(
                "capacity = 4\n",
                "capacity = 4\nresponse_stall_timeout_ms = 9223372036855\n"
            ),
            format!(
                "{key}.response_stall_timeout_ms: 9223372036855 overflows a nanosecond duration \
                 (max 9223372036854)"
            )
        );
        assert_eq!(
            error_of("capacity = 4\n", "capacity = 4\ncategory = \"cloud\"\n"),
            format!("{key}.category: unknown category \"cloud\": expected \"api\" or \"local_inference\"")
        );
        assert_eq!(
            error_of("target = \"qwen2.5:7b\"", "target = \"\""),
            format!("{key}.target: must not be empty")
        );
        assert_eq!(
            error_of("adapter = \"ollama\"", "adapter = \"olama\""),
            format!("{key}.adapter: node \"node-a\" has no adapter named \"olama\"")
        );
    }

    #[test]
    fn model_references_resolve() {
        let refs = "providers = [\"node-a/a-llama\"]";
        let key = "conf/edge.toml: models[0].providers";
        assert_eq!(
            error_of(refs, "providers = []"),
            format!("{key}: must list at least one provider")
        );
        assert_eq!(
            error_of(refs, "providers = [\"a-llama\"]"),
            format!("{key}[0]: \"a-llama\": expected \"<node id>/<provider id>\"")
        );
        assert_eq!(
            error_of(refs, "providers = [\"node-a/a-llama\", \"node-z/a-llama\"]"),
            format!("{key}[1]: \"node-z/a-llama\": no node \"node-z\" is configured")
        );
        assert_eq!(
            error_of(refs, "providers = [\"node-a/a-mistral\"]"),
            format!(
                "{key}[0]: \"node-a/a-mistral\": node \"node-a\" has no provider \"a-mistral\""
            )
        );
        assert_eq!(
            error_of(refs, "providers = [\"node-a/a-llama\", \"node-a/a-llama\"]"),
            format!("{key}[1]: \"node-a/a-llama\" is listed twice (also models[0].providers[0])")
        );
        let config = parse(&variant(
            refs,
            "providers = [\"node-a/a-llama\", \"node-a/a-qwen\"]",
        ))
        .unwrap();
        let listed: Vec<String> = config.models[0]
            .providers
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(listed, ["node-a/a-llama", "node-a/a-qwen"]);
    }

    #[test]
    fn model_values_are_checked() {
        let refs = "providers = [\"node-a/a-llama\"]";
        let key = "conf/edge.toml: models[0]";
        assert_eq!(
            error_of(refs, &format!("{refs}\nlong_context_threshold_tokens = 0")),
            format!("{key}.long_context_threshold_tokens: must be between 1 and 100000000 (got 0)")
        );
        assert_eq!(
            error_of(refs, &format!("{refs}\nmax_queue = 0")),
            format!("{key}.max_queue: must be between 1 and 1000000 (got 0)")
        );
        assert_eq!(
            error_of(refs, &format!("{refs}\nqueue_timeout_ms = -5")),
            format!("{key}.queue_timeout_ms: must be between 1 and 86400000 (got -5)")
        );
        assert_eq!(
            error_of(refs, &format!("{refs}\nowned_by = \"\"")),
            format!("{key}.owned_by: must not be empty")
        );
        assert_eq!(
            error_of("name = \"llama-3.1-8b\"", "name = \"llama\\u0007\""),
            format!("{key}.name: \"llama\\u{{7}}\" must not contain control characters")
        );
        let long = "m".repeat(513);
        assert_eq!(
            error_of("name = \"llama-3.1-8b\"", &format!("name = \"{long}\"")),
            format!("{key}.name: must be at most 512 bytes (got 513)")
        );
    }

    #[test]
    fn profile_table() {
        let url = base_url("http://10.1.2.3:8000");
        for profile in ProfileName::ALL {
            let spec = protocol_profile(profile, &url);
            let health = if profile == ProfileName::OpenAi {
                "/v1/models"
            } else {
                "/health"
            };
            assert_eq!(
                spec,
                ProtocolProfileSpec {
                    name: profile,
                    base_url: "http://10.1.2.3:8000".into(),
                    models_path: "/v1/models".into(),
                    chat_completions_path: "/v1/chat/completions".into(),
                    messages_path: "/v1/messages".into(),
                    count_tokens_path: "/v1/messages/count_tokens".into(),
                    responses_path: "/v1/responses".into(),
                    health_path: health.into(),
                    auth_header_name: "Authorization".into(),
                    auth_header_format: "Bearer {secret}".into(),
                }
            );
            assert_eq!(ProfileName::from_name(profile.as_str()), Some(profile));
        }
        let names: Vec<&str> = ProfileName::ALL.iter().map(ProfileName::as_str).collect();
        assert_eq!(names, ["openai", "vllm", "llama_cpp", "sglang"]);
        assert_eq!(ProfileName::from_name("tgi"), None);
    }

    #[test]
    fn an_adapter_health_path_replaces_the_profiles() {
        let adapter = "base_url = \"http://127.0.0.1:8000\"\ncapacity = 8";
        let config = parse(&variant(
            adapter,
            "base_url = \"http://127.0.0.1:8000/llama\"\ncapacity = 8\nhealth_path = \"/v1/models\"",
        ))
        .unwrap();
        let spec = config.nodes[0].adapters[0].protocol_profile().unwrap();
        assert_eq!(spec.health_path, "/llama/v1/models");
        assert_eq!(spec.models_path, "/llama/v1/models");
        let payload = config.node_config_payload(&config.nodes[0], 1);
        let Some(pb::adapter_config::Kind::OpenaiCompat(oa)) = &payload.adapters[0].kind else {
            panic!("an openai_compat adapter");
        };
        assert_eq!(
            oa.protocol_profile.as_ref().unwrap().health_path,
            "/llama/v1/models"
        );
        // Without one, the profile's.
        let base = parse(BASE).unwrap();
        assert_eq!(
            base.nodes[0].adapters[0]
                .protocol_profile()
                .unwrap()
                .health_path,
            "/health"
        );
        assert_eq!(base.nodes[0].adapters[1].protocol_profile(), None);
        let key = "conf/edge.toml: nodes[0].adapters[0].health_path";
        for (bad, why) in [
            ("health", "must start with `/` (got \"health\")"),
            (
                "/health?x=1",
                "must be a plain path: printable ASCII without spaces, `?` or `#` (found '?')",
            ),
            (
                "/he alth",
                "must be a plain path: printable ASCII without spaces, `?` or `#` (found ' ')",
            ),
        ] {
            assert_eq!(
                error_of(adapter, &format!("{adapter}\nhealth_path = \"{bad}\"")),
                format!("{key}: {why}")
            );
        }
        assert_eq!(
            error_of(
                "kind = \"ollama\"",
                "kind = \"ollama\"\nhealth_path = \"/api/version\""
            ),
            "conf/edge.toml: nodes[0].adapters[1].health_path: only an openai_compat adapter \
             has a health path (Ollama's is /api/tags)"
        );
    }

    #[test]
    fn profile_paths_sit_under_the_base_url_prefix() {
        let spec = protocol_profile(ProfileName::Sglang, &base_url("http://gw:80/sglang/a"));
        assert_eq!(spec.base_url, "http://gw:80");
        assert_eq!(spec.models_path, "/sglang/a/v1/models");
        assert_eq!(spec.chat_completions_path, "/sglang/a/v1/chat/completions");
        assert_eq!(spec.messages_path, "/sglang/a/v1/messages");
        assert_eq!(spec.count_tokens_path, "/sglang/a/v1/messages/count_tokens");
        assert_eq!(spec.responses_path, "/sglang/a/v1/responses");
        assert_eq!(spec.health_path, "/sglang/a/health");
    }

    #[test]
    fn node_config_payload_carries_adapters_targets_and_profiles() {
        // CONTRACT: U4 — the resolved profile travels in
        // OpenAICompatAdapterConfig.protocol_profile of NodeConfigPayload.
        let text = variant(
            "capacity = 4\n",
            "capacity = 4\n\n[[nodes.providers]]\nid = \"a-llama-long\"\nadapter = \"vllm-main\"\n\
             target = \"meta-llama/Llama-3.1-8B-Instruct\"\ncapacity = 1\n\n[[nodes.providers]]\n\
             id = \"a-phi\"\nadapter = \"vllm-main\"\ntarget = \"phi-4\"\ncapacity = 1\n",
        );
        let config = parse(&text).unwrap();
        let payload = config.node("node-a").unwrap().config_payload(7, true);
        let expected = pb::NodeConfigPayload {
            runtime: Some(pb::NodeRuntimeConfig::default()),
            adapters: vec![
                pb::AdapterConfig {
                    tls: None,
                    name: "vllm-main".into(),
                    capacity: 8,
                    targets: vec!["meta-llama/Llama-3.1-8B-Instruct".into(), "phi-4".into()],
                    kind: Some(pb::adapter_config::Kind::OpenaiCompat(
                        pb::OpenAiCompatAdapterConfig {
                            protocol_profile: Some(pb::ProtocolProfile {
                                name: "vllm".into(),
                                base_url: "http://127.0.0.1:8000".into(),
                                models_path: "/v1/models".into(),
                                chat_completions_path: "/v1/chat/completions".into(),
                                messages_path: "/v1/messages".into(),
                                count_tokens_path: "/v1/messages/count_tokens".into(),
                                responses_path: "/v1/responses".into(),
                                health_path: "/health".into(),
                                auth_header_name: "Authorization".into(),
                                auth_header_format: "Bearer {secret}".into(),
                            }),
                        },
                    )),
                },
                pb::AdapterConfig {
                    tls: None,
                    name: "ollama".into(),
                    capacity: 0,
                    targets: vec!["qwen2.5:7b".into()],
                    kind: Some(pb::adapter_config::Kind::Ollama(pb::OllamaAdapterConfig {
                        base_url: "http://127.0.0.1:11434".into(),
                    })),
                },
            ],
            revision: 7,
            credential_leases_required: true,
            revoked_credentials: Vec::new(),
        };
        assert_eq!(payload, expected);
        assert!(
            !config
                .node("node-a")
                .unwrap()
                .config_payload(1, false)
                .credential_leases_required
        );
    }

    // -----------------------------------------------------------------------
    // Credential plane (C1–C5)

    fn recipient_text(seed: u8) -> String {
        let public = PublicKey::from(&StaticSecret::from([seed; 32]));
        iop_engine::keys::encode_recipient_public_key(&public)
    }

    const CLIENT_KEY_HASH: &str =
        "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    /// `BASE` with a recipient key on node-a, an issuer, one slot serving
    /// node-a/a-llama (the only tunnel provider) and one client key;
    /// `slot_extra` is added to the slot.
    fn managed(slot_extra: &str) -> String {
        format!(
            "{}\n[credentials]\nissuer_key = \"keys/issuer.key\"\n\n[[credentials.slots]]\n\
             name = \"openai-main\"\nsecret_file = \"secrets/openai\"\n\
             providers = [\"node-a/a-llama\"]\n{slot_extra}\n\n[[client_keys]]\n\
             principal = \"team-a\"\nkey_hash = \"{CLIENT_KEY_HASH}\"\n",
            variant(
                "id = \"node-a\"",
                &format!("id = \"node-a\"\nrecipient_key = \"{}\"", recipient_text(9))
            )
        )
    }

    #[test]
    fn https_adapters_take_provider_tls_settings() {
        let https = "base_url = \"https://api.example.com/openai\"";
        let config = parse(&variant(
            "base_url = \"http://127.0.0.1:8000\"",
            &format!("{https}\nca_file = \"ca/provider.pem\""),
        ))
        .unwrap();
        let adapter = &config.nodes[0].adapters[0];
        assert!(adapter.base_url.is_tls());
        assert_eq!(adapter.base_url.origin(), "https://api.example.com:443");
        assert_eq!(
            adapter.tls,
            ProviderTlsSpec {
                ca_file: Some(PathBuf::from("conf/ca/provider.pem")),
                ca_pem: None,
                insecure_skip_verify: false,
            }
        );
        // Without a CA file or the dev switch the Node uses its defaults.
        let plain = parse(&variant("base_url = \"http://127.0.0.1:8000\"", https)).unwrap();
        assert_eq!(plain.nodes[0].adapters[0].tls.to_pb(), None);
        let insecure = parse(&variant(
            "base_url = \"http://127.0.0.1:8000\"",
            &format!("{https}\ntls_insecure_skip_verify = true"),
        ))
        .unwrap();
        let payload = insecure.node_config_payload(&insecure.nodes[0], 1);
        assert_eq!(
            payload.adapters[0].tls,
            Some(pb::ProviderTlsConfig {
                ca_pem: String::new(),
                insecure_skip_verify: true,
            })
        );
        assert_eq!(
            payload.adapters[0]
                .kind
                .as_ref()
                .and_then(|k| match k {
                    pb::adapter_config::Kind::OpenaiCompat(o) => o.protocol_profile.clone(),
                    pb::adapter_config::Kind::Ollama(_) => None,
                })
                .map(|p| (p.base_url, p.chat_completions_path)),
            Some((
                "https://api.example.com:443".to_owned(),
                "/openai/v1/chat/completions".to_owned()
            ))
        );
    }

    #[test]
    fn provider_tls_settings_are_refused_where_they_mean_nothing() {
        let key = "conf/edge.toml: nodes[0].adapters[0]";
        assert_eq!(
            error_of("capacity = 8\n\n", "capacity = 8\nca_file = \"ca.pem\"\n\n"),
            format!("{key}.ca_file: only an https:// base_url has provider TLS settings")
        );
        assert_eq!(
            error_of(
                "capacity = 8\n\n",
                "capacity = 8\ntls_insecure_skip_verify = false\n\n"
            ),
            format!(
                "{key}.tls_insecure_skip_verify: only an https:// base_url has provider TLS \
                 settings"
            )
        );
        assert_eq!(
            error_of(
                "base_url = \"http://127.0.0.1:8000\"",
                "base_url = \"https://h\"\nca_file = \"ca.pem\"\ntls_insecure_skip_verify = true"
            ),
            format!(
                "{key}.tls_insecure_skip_verify: verifies nothing, so ca_file would be ignored: \
                 set one of them"
            )
        );
    }

    #[test]
    fn no_credential_is_sent_to_an_unverified_provider() {
        let text = managed("").replace(
            "base_url = \"http://127.0.0.1:8000\"",
            "base_url = \"https://api.example.com\"\ntls_insecure_skip_verify = true",
        );
        assert_eq!(
            error(&text),
            "conf/edge.toml: credentials.slots[0].providers[0]: \"node-a/a-llama\" is served by \
             an adapter with tls_insecure_skip_verify; a credential is never sent to a provider \
             whose certificate is not verified"
        );
    }

    #[test]
    fn client_tls_resolves_its_files_and_load_checks_them() {
        let text = variant(
            "node_listen = \"127.0.0.1:7443\"",
            "node_listen = \"127.0.0.1:7443\"\n[edge.client_tls]\ncert = \"https.pem\"\n\
             key = \"/etc/iop/https-key.pem\"\nclient_ca = \"callers.pem\"",
        );
        let config = parse(&text).unwrap();
        assert_eq!(
            config.client_tls,
            Some(HttpsFiles {
                cert: PathBuf::from("conf/https.pem"),
                key: PathBuf::from("/etc/iop/https-key.pem"),
                client_ca: Some(PathBuf::from("conf/callers.pem")),
            })
        );
        assert_eq!(
            error(&text.replace("client_ca", "client_cert")),
            "conf/edge.toml: edge.client_tls.client_cert: unknown field `client_cert`, expected \
             one of `cert`, `key`, `client_ca` (line 10, column 1)"
        );
        // Files are checked by load: the missing certificate is named.
        let dir = std::env::temp_dir().join(format!("iop-edge-client-tls-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("certs")).unwrap();
        for f in ["certs/ca.pem", "certs/edge.pem", "certs/edge-key.pem"] {
            std::fs::write(dir.join(f), "x").unwrap();
        }
        let path = dir.join("edge.toml");
        std::fs::write(&path, &text).unwrap();
        let err = EdgeConfig::load(&path).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{}: edge.client_tls.cert: cannot read {}",
                path.display(),
                dir.join("https.pem").display()
            )),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn load_reads_and_checks_provider_ca_files() {
        let dir = std::env::temp_dir().join(format!("iop-edge-provider-ca-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("certs")).unwrap();
        for f in ["certs/ca.pem", "certs/edge.pem", "certs/edge-key.pem"] {
            std::fs::write(dir.join(f), "x").unwrap();
        }
        let text = variant(
            "base_url = \"http://127.0.0.1:8000\"",
            "base_url = \"https://gw.internal:8443\"\nca_file = \"private-ca.pem\"",
        );
        let path = dir.join("edge.toml");
        std::fs::write(&path, &text).unwrap();
        let key = format!("{}: nodes[0].adapters[0].ca_file", path.display());
        let err = EdgeConfig::load(&path).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{key}: cannot read ")), "{err}");
        std::fs::write(dir.join("private-ca.pem"), "no PEM here").unwrap();
        let err = EdgeConfig::load(&path).unwrap_err().to_string();
        assert!(err.ends_with("no certificate found"), "{err}");
        let ca = iop_engine::certs::DevCa::new("iop").unwrap().cert_pem();
        std::fs::write(dir.join("private-ca.pem"), &ca).unwrap();
        let config = EdgeConfig::load(&path).unwrap();
        let payload = config.node_config_payload(&config.nodes[0], 1);
        assert_eq!(
            payload.adapters[0].tls,
            Some(pb::ProviderTlsConfig {
                ca_pem: ca,
                insecure_skip_verify: false,
            })
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    // CONTRACT: C1 — the credential plane parses into slots bound to
    // providers, the node's recipient key and hashed client keys, with the
    // documented defaults; the issuer key path resolves against the config.
    #[test]
    fn credentials_parse_with_defaults() {
        let config = parse(&managed("")).unwrap();
        let slot = SlotSpec {
            name: "openai-main".into(),
            secret: SecretSource::File(PathBuf::from("conf/secrets/openai")),
            header_name: "Authorization".into(),
            header_format: "Bearer {secret}".into(),
            revision: 1,
            revoked_revisions: vec![],
            enabled: true,
            providers: vec![ProviderRef {
                node_id: "node-a".into(),
                provider_id: "a-llama".into(),
            }],
        };
        assert_eq!(
            config.credentials,
            Some(CredentialsSpec {
                issuer_key: PathBuf::from("conf/keys/issuer.key"),
                lease_ttl_ms: 30_000,
                slots: vec![slot.clone()],
            })
        );
        let node = config.node("node-a").unwrap();
        assert_eq!(
            node.recipient_key,
            Some(PublicKey::from(&StaticSecret::from([9; 32])))
        );
        assert!(config.credential_leases_required(node));
        assert_eq!(config.slot_for(&slot.providers[0]), Some(&slot));
        let qwen = ProviderRef {
            node_id: "node-a".into(),
            provider_id: "a-qwen".into(),
        };
        assert_eq!(config.slot_for(&qwen), None);
        assert!(slot.is_usable());
        let mut key_hash = [0u8; 32];
        for (i, b) in key_hash.iter_mut().enumerate() {
            *b = ((i % 16) as u8) * 0x11;
        }
        assert_eq!(
            config.client_keys,
            vec![ClientKeySpec {
                principal: "team-a".into(),
                key_hash,
                admin: false,
                metrics: false,
                limits: Default::default(),
                models: None,
            }]
        );
        // Without [credentials] a recipient key is inert: no lease required.
        let unmanaged = variant(
            "id = \"node-a\"",
            &format!("id = \"node-a\"\nrecipient_key = \"{}\"", recipient_text(9)),
        );
        let config = parse(&unmanaged).unwrap();
        assert!(!config.credential_leases_required(config.node("node-a").unwrap()));
    }

    // CONTRACT: C1 — a slot's header, format, revision and state are kept.
    #[test]
    fn slot_explicit_values_are_kept() {
        let config = parse(&managed(
            "header = \"x-api-key\"\nformat = \"{secret}\"\nrevision = 3\n\
             revoked_revisions = [1, 2]\nenabled = false",
        ))
        .unwrap()
        .credentials
        .unwrap();
        let slot = &config.slots[0];
        assert_eq!(
            (
                slot.header_name.as_str(),
                slot.header_format.as_str(),
                slot.revision,
                slot.revoked_revisions.as_slice(),
                slot.enabled
            ),
            ("x-api-key", "{secret}", 3, &[1u64, 2][..], false)
        );
        assert!(!slot.is_usable());
        let revoked = parse(&managed("revision = 2\nrevoked_revisions = [2]"))
            .unwrap()
            .credentials
            .unwrap();
        // CONTRACT: C3 — a slot whose current revision is revoked may not issue.
        assert!(!revoked.slots[0].is_usable());
        let env = managed("").replacen(
            "secret_file = \"secrets/openai\"",
            "secret_env = \"OPENAI_API_KEY\"",
            1,
        );
        let config = parse(&env).unwrap().credentials.unwrap();
        assert_eq!(
            config.slots[0].secret,
            SecretSource::Env("OPENAI_API_KEY".into())
        );
        let ttl = managed("").replacen(
            "issuer_key = \"keys/issuer.key\"",
            "issuer_key = \"keys/issuer.key\"\nlease_ttl_ms = 5000",
            1,
        );
        assert_eq!(parse(&ttl).unwrap().credentials.unwrap().lease_ttl_ms, 5000);
    }

    // CONTRACT: C1 — every slot key is validated with file, key and reason.
    #[test]
    fn slot_values_are_checked() {
        let key = "conf/edge.toml: credentials.slots[0]";
        let cases = [
            (
                "secret_env = \"X\"",
                format!("{key}: set exactly one of secret_file or secret_env"),
            ),
            (
                "header = \"Bad Header\"",
                format!(
                    "{key}.header: \"Bad Header\" must be an HTTP header name of 1 to 128 token \
                     characters"
                ),
            ),
            (
                "header = \"Host\"",
                format!("{key}.header: \"Host\" cannot carry a credential"),
            ),
            (
                "format = \"Bearer\"",
                format!("{key}.format: \"Bearer\" must contain {{secret}}"),
            ),
            (
                "format = \"Bearer {secret}\\n\"",
                format!(
                    "{key}.format: \"Bearer {{secret}}\\n\" must be 1 to 1024 characters of \
                     visible ASCII, space or tab"
                ),
            ),
            (
                "revision = 0",
                format!("{key}.revision: must be between 1 and 9223372036854775807 (got 0)"),
            ),
            (
                "revoked_revisions = [1, 1]",
                format!("{key}.revoked_revisions[1]: revision 1 is listed twice"),
            ),
        ];
        for (extra, expected) in cases {
            assert_eq!(error(&managed(extra)), expected, "{extra}");
        }
        let no_source = managed("").replacen("secret_file = \"secrets/openai\"\n", "", 1);
        assert_eq!(
            error(&no_source),
            format!("{key}: set exactly one of secret_file or secret_env")
        );
        let bad_env = managed("").replacen(
            "secret_file = \"secrets/openai\"",
            "secret_env = \"1BAD\"",
            1,
        );
        assert_eq!(
            error(&bad_env),
            format!(
                "{key}.secret_env: \"1BAD\" must be an environment variable name \
                 ([A-Za-z_][A-Za-z0-9_]*, at most 128 characters)"
            )
        );
        let ttl = managed("").replacen(
            "issuer_key = \"keys/issuer.key\"",
            "issuer_key = \"keys/issuer.key\"\nlease_ttl_ms = 600001",
            1,
        );
        assert_eq!(
            error(&ttl),
            "conf/edge.toml: credentials.lease_ttl_ms: must be between 1000 and 600000 (got 600001)"
        );
        let no_issuer =
            managed("").replacen("issuer_key = \"keys/issuer.key\"", "issuer_key = \"\"", 1);
        assert_eq!(
            error(&no_issuer),
            "conf/edge.toml: credentials.issuer_key: must not be empty"
        );
        assert_eq!(
            error(&managed("colour = \"blue\"")),
            "conf/edge.toml: credentials.slots[0].colour: unknown field `colour`, expected one of \
             `name`, `secret_file`, `secret_env`, `header`, `format`, `revision`, \
             `revoked_revisions`, `enabled`, `providers` (line 52, column 1)"
        );
    }

    // CONTRACT: C1 — slots serve configured tunnel providers only.
    #[test]
    fn slot_providers_resolve_to_tunnel_providers() {
        let with_providers = |list: &str| {
            managed("").replacen(
                "providers = [\"node-a/a-llama\"]\n\n\n[[client_keys]]",
                &format!("providers = [{list}]\n\n\n[[client_keys]]"),
                1,
            )
        };
        let key = "conf/edge.toml: credentials.slots[0].providers";
        assert_eq!(
            error(&with_providers("")),
            format!("{key}: must list at least one provider")
        );
        assert_eq!(
            error(&with_providers("\"node-a/nope\"")),
            format!("{key}[0]: \"node-a/nope\": node \"node-a\" has no provider \"nope\"")
        );
        assert_eq!(
            error(&with_providers("\"node-a/a-llama\", \"node-a/a-llama\"")),
            format!("{key}[1]: \"node-a/a-llama\" is listed twice (also credentials.slots[0].providers[0])")
        );
        assert_eq!(
            error(&with_providers("\"node-a/a-llama\", \"node-a/a-qwen\"")),
            format!(
                "{key}[1]: \"node-a/a-qwen\" is not served by an openai_compat adapter; credential \
                 leases travel only on provider tunnels"
            )
        );
        // CONTRACT: C5 — a provider is served by at most one slot, so a
        // bound route never has another slot to fall back to.
        let second = format!(
            "{}\n[[credentials.slots]]\nname = \"openai-backup\"\nsecret_env = \"B\"\n\
             providers = [\"node-a/a-llama\"]\n",
            managed("")
        );
        assert_eq!(
            error(&second),
            "conf/edge.toml: credentials.slots[1].providers[0]: \"node-a/a-llama\" is already served \
             by slot \"openai-main\"; a provider is served by at most one slot"
        );
        let duplicate = second.replacen("name = \"openai-backup\"", "name = \"openai-main\"", 1);
        assert_eq!(
            error(&duplicate),
            "conf/edge.toml: credentials.slots[1].name: duplicate slot name \"openai-main\" (also \
             credentials.slots[0])"
        );
    }

    // CONTRACT: C1, C3 — a node a slot serves needs a recipient key, and
    // every tunnel provider of a managed node must be served by a slot
    // (the node rejects tunnels without a lease).
    #[test]
    fn managed_nodes_are_consistent() {
        let without_key = managed("").replacen(
            &format!("recipient_key = \"{}\"\n", recipient_text(9)),
            "",
            1,
        );
        assert_eq!(
            error(&without_key),
            "conf/edge.toml: nodes[0].recipient_key: required: provider \"node-a/a-llama\" is served \
             by credential slot \"openai-main\" (node-bin keys recipient --out … prints it)"
        );
        let unslotted = managed("").replacen(
            "[[nodes.providers]]\nid = \"a-qwen\"",
            "[[nodes.providers]]\nid = \"a-phi\"\nadapter = \"vllm-main\"\ntarget = \"phi\"\n\
             capacity = 1\n\n[[nodes.providers]]\nid = \"a-qwen\"",
            1,
        );
        assert_eq!(
            error(&unslotted),
            "conf/edge.toml: nodes[0].providers[1]: node \"node-a\" is managed (it has a \
             recipient_key), so it rejects tunnels without a credential lease: serve \
             \"node-a/a-phi\" by a credential slot"
        );
        let bad_key = variant(
            "id = \"node-a\"",
            "id = \"node-a\"\nrecipient_key = \"ed25519:00\"",
        );
        assert_eq!(
            error(&bad_key),
            "conf/edge.toml: nodes[0].recipient_key: invalid public key: expected x25519:<64 hex digits>"
        );
        let low_order = variant(
            "id = \"node-a\"",
            &format!(
                "id = \"node-a\"\nrecipient_key = \"x25519:{}\"",
                "0".repeat(64)
            ),
        );
        assert_eq!(
            error(&low_order),
            "conf/edge.toml: nodes[0].recipient_key: invalid public key: a low-order X25519 point"
        );
    }

    // CONTRACT: T5, C3 — insecure mode disables the credential plane: a
    // config with both is refused.
    #[test]
    fn credentials_are_refused_in_insecure_mode() {
        let tls = "[tls]\nca = \"certs/ca.pem\"\ncert = \"certs/edge.pem\"\nkey = \"certs/edge-key.pem\"\n";
        let insecure = managed("").replacen(tls, "", 1).replacen(
            "node_listen = \"127.0.0.1:7443\"",
            "node_listen = \"127.0.0.1:7443\"\ninsecure_plaintext_nodes = true",
            1,
        );
        assert_eq!(
            error(&insecure),
            "conf/edge.toml: credentials: the credential plane needs mTLS to the nodes: remove \
             [credentials] or edge.insecure_plaintext_nodes"
        );
    }

    // CONTRACT: C1 — client keys (the principals bound into leases) are
    // stored hashed and validated.
    #[test]
    fn client_keys_are_checked() {
        let key = "conf/edge.toml: client_keys[0]";
        let upper = managed("").replacen(CLIENT_KEY_HASH, &CLIENT_KEY_HASH.to_uppercase(), 1);
        let reason = "expected 64 lowercase hex digits (edge-bin keys hash-client-key prints it)";
        assert_eq!(error(&upper), format!("{key}.key_hash: {reason}"));
        let short = managed("").replacen(CLIENT_KEY_HASH, "abcd", 1);
        assert_eq!(error(&short), format!("{key}.key_hash: {reason}"));
        let principal = managed("").replacen("principal = \"team-a\"", "principal = \"team a\"", 1);
        assert_eq!(
            error(&principal),
            format!("{key}.principal: \"team a\" must be 1 to 128 characters of A-Z a-z 0-9 . _ -")
        );
        let twice = format!(
            "{}\n[[client_keys]]\nprincipal = \"team-b\"\nkey_hash = \"{CLIENT_KEY_HASH}\"\n",
            managed("")
        );
        assert_eq!(
            error(&twice),
            "conf/edge.toml: client_keys[1].key_hash: the same key is also client_keys[0]"
        );
        let with_scope = |scopes: &str| {
            managed("").replacen(
                "principal = \"team-a\"",
                &format!("principal = \"team-a\"\nscopes = {scopes}"),
                1,
            )
        };
        assert_eq!(
            error(&with_scope("[\"admin\", \"root\"]")),
            format!(
                "{key}.scopes[1]: unknown scope \"root\"; the scopes are \"admin\" and \"metrics\""
            )
        );
        let admin = parse(&with_scope("[\"admin\"]")).unwrap();
        assert!(admin.client_keys[0].admin);
        let metrics = parse(&with_scope("[\"metrics\"]")).unwrap();
        assert!(metrics.client_keys[0].metrics && !metrics.client_keys[0].admin);
        // `/metrics` behind a key needs a key that may read it.
        let keyed_metrics = |scopes: &str| {
            with_scope(scopes).replacen(
                "name = \"edge-1\"",
                "name = \"edge-1\"\nmetrics_access = \"key\"",
                1,
            )
        };
        assert_eq!(
            parse(&keyed_metrics("[\"metrics\"]"))
                .unwrap()
                .edge
                .metrics_access,
            MetricsAccess::Key
        );
        assert_eq!(
            error(&keyed_metrics("[]")),
            "conf/edge.toml: edge.metrics_access: \"key\" needs a [[client_keys]] entry with \
             scopes = [\"metrics\"] (or \"admin\") to read /metrics"
        );
        assert_eq!(
            error(&keyed_metrics("[]").replace("\"key\"", "\"secret\"")),
            "conf/edge.toml: edge.metrics_access: expected \"open\" or \"key\" (got \"secret\")"
        );
        let none = parse(&with_scope("[]")).unwrap();
        assert!(!none.client_keys[0].admin);
    }

    // Per-principal limits and model access on client keys.
    #[test]
    fn client_key_limits_and_models_are_checked() {
        let key = "conf/edge.toml: client_keys[0]";
        let with = |extra: &str| {
            managed("").replacen(
                "principal = \"team-a\"",
                &format!("principal = \"team-a\"\n{extra}"),
                1,
            )
        };
        let ok = parse(&with(
            "max_concurrent = 4\nrequests_per_minute = 60\ntokens_per_minute = 90000\n\
             models = [\"llama-3.1-8b\"]",
        ))
        .unwrap();
        assert_eq!(
            ok.client_keys[0].limits,
            crate::limits::LimitSpec {
                max_concurrent: Some(4),
                requests_per_minute: Some(60),
                tokens_per_minute: Some(90_000),
            }
        );
        assert_eq!(
            ok.client_keys[0].models,
            Some(vec!["llama-3.1-8b".to_string()])
        );
        let plain = parse(&managed("")).unwrap();
        assert!(plain.client_keys[0].limits.is_unlimited());
        assert_eq!(plain.client_keys[0].models, None);

        assert_eq!(
            error(&with("requests_per_minute = 0")),
            format!("{key}.requests_per_minute: must be at least 1 (leave it out for no limit)")
        );
        assert_eq!(
            error(&with("models = [\"llama-3.1-8b\", \"gpt-9\"]")),
            format!("{key}.models[1]: no [[models]] entry is named \"gpt-9\"")
        );
        let second = format!(
            "{}\n[[client_keys]]\nprincipal = \"team-a\"\nkey_hash = \"{}\"\nmax_concurrent = 2\n",
            with("max_concurrent = 4"),
            "ab".repeat(32)
        );
        assert_eq!(
            error(&second),
            "conf/edge.toml: client_keys[1]: principal \"team-a\" already has limits from \
             client_keys[0]; set them on one of its keys"
        );
    }

    #[test]
    fn access_log_format_is_explicit_only_when_written() {
        let unset = parse(BASE).unwrap().access_log;
        assert_eq!(
            (unset.format, unset.format_explicit),
            (access::Format::Text, false)
        );
        let table = parse(&variant(
            "[tls]\n",
            "[edge.access_log]\ndestination = \"stderr\"\n\n[tls]\n",
        ))
        .unwrap()
        .access_log;
        assert_eq!(
            (table.format, table.format_explicit),
            (access::Format::Text, false)
        );
        let text = parse(&variant(
            "[tls]\n",
            "[edge.access_log]\nformat = \"text\"\n\n[tls]\n",
        ))
        .unwrap()
        .access_log;
        assert_eq!(
            (text.format, text.format_explicit),
            (access::Format::Text, true)
        );
        let json = parse(&variant(
            "[tls]\n",
            "[edge.access_log]\nformat = \"json\"\n\n[tls]\n",
        ))
        .unwrap()
        .access_log;
        assert_eq!(
            (json.format, json.format_explicit),
            (access::Format::Json, true)
        );
    }

    #[test]
    fn error_accessors() {
        let e = parse(&variant("capacity = 4\n", "capacity = 0\n")).unwrap_err();
        assert_eq!(e.file(), "conf/edge.toml");
        assert_eq!(e.key(), "nodes[0].providers[1].capacity");
        assert_eq!(e.reason(), "must be between 1 and 65536 (got 0)");
    }
}
