//! Defaults and bounds of `edge.toml`'s values.

use iop_wire::lease::MAX_LEASE_LIFETIME_MS;

pub const DEFAULT_MAX_REQUEST_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Default `edge.max_upload_body_bytes`: 25 MiB, OpenAI's limit on an
/// audio file (and vLLM's default).
pub const DEFAULT_MAX_UPLOAD_BODY_BYTES: u64 = 25 * 1024 * 1024;
/// Largest accepted `edge.max_upload_body_bytes` (4 GiB): an upload streams,
/// so memory does not bound it; the provider's own limit does.
pub const MAX_UPLOAD_BODY_BYTES_LIMIT: u64 = 4 * 1024 * 1024 * 1024;
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

/// `[cluster] name`: the cluster's keys live under `/iop/<name>/`.
pub const DEFAULT_CLUSTER_NAME: &str = "default";

/// The `service.name` of the Edge's spans unless `[tracing] service_name`
/// says otherwise.
pub const DEFAULT_TRACING_SERVICE_NAME: &str = "iop-edge";

/// `[cluster] lease_ttl_sec`: the TTL of an Edge's etcd lease.
pub const DEFAULT_LEASE_TTL_SEC: u64 = 10;

/// `[cluster] keepalive_interval_sec`: how often the lease is kept alive
/// (the Edge self-fences `TTL − interval` after its last acknowledged
/// keep-alive: 7 s with the defaults).
pub const DEFAULT_KEEPALIVE_INTERVAL_SEC: u64 = 3;

/// `[cluster] etcd_timeout_ms`: timeout of one etcd call.
pub const DEFAULT_ETCD_TIMEOUT_MS: u64 = 2_000;

/// Default `routing.prefix_tree_bytes`: each `prefix` model's tree.
pub const DEFAULT_PREFIX_TREE_BYTES: u64 = 32 * 1024 * 1024;
/// Smallest accepted `routing.prefix_tree_bytes` (a few thousand nodes).
pub const MIN_PREFIX_TREE_BYTES: u64 = 64 * 1024;
/// Largest accepted `routing.prefix_tree_bytes` (4 GiB).
pub const MAX_PREFIX_TREE_BYTES: u64 = 4 * 1024 * 1024 * 1024;
/// Default `routing.prefix_bytes_max`: the part of a prompt the tree
/// considers.
pub const DEFAULT_PREFIX_BYTES_MAX: u64 = 16 * 1024;
/// Largest accepted `routing.prefix_bytes_max` (1 MiB).
pub const MAX_PREFIX_BYTES_MAX: u64 = 1024 * 1024;
/// Default `routing.match_threshold_percent`.
pub const DEFAULT_MATCH_THRESHOLD_PERCENT: u32 = 50;
/// Default `routing.balance_abs_threshold`.
pub const DEFAULT_BALANCE_ABS_THRESHOLD: u32 = 4;
/// Largest accepted `routing.balance_abs_threshold`.
pub const MAX_BALANCE_ABS_THRESHOLD: u32 = 65_536;
/// Default `routing.balance_rel_threshold_percent` (1.5 times).
pub const DEFAULT_BALANCE_REL_THRESHOLD_PERCENT: u32 = 150;
/// Largest accepted `routing.balance_rel_threshold_percent` (100 times).
pub const MAX_BALANCE_REL_THRESHOLD_PERCENT: u32 = 10_000;
/// Default `routing.affinity_wait_ms`: how long a request waits for its
/// preferred provider (holder of its prefix, its session's) when that one
/// is full, before it takes any.
pub const DEFAULT_AFFINITY_WAIT_MS: u64 = 200;
/// Largest accepted `routing.affinity_wait_ms` (one minute).
pub const MAX_AFFINITY_WAIT_MS: u64 = 60_000;
