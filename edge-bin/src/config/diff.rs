//! What changes between two configurations: [`ConfigDiff::between`] the
//! one that runs and the next one (a SIGHUP's file, or
//! `edge-bin check-config --diff RUNNING FILE`).
//!
//! ```text
//! running, next ──between──► ConfigDiff (plain data, deterministic order)
//!                              ├─ nodes (adapters, recipient key), providers, models
//!                              ├─ [credentials] (table, issuer, slots), [[client_keys]]
//!                              └─ settings: every key of [edge], [tls],
//!                                 [outlier_detection], [cluster], [tracing] that changed,
//!                                 each Live or Restart (the table SETTINGS)
//! ConfigDiff ──lines / Display──► one line per change: `+` added, `-` removed, `~` changed
//! ```
//!
//! Order: the sections in the order above; within one, what was added (in
//! `next`'s file order), removed (in `running`'s), then changed (in
//! `next`'s); settings in [`SETTINGS`] order.
//!
//! Nothing here holds or prints a secret: a credential slot shows where
//! its secret lives (`secret_file` path or `secret_env` name), never its
//! value, and a client key shows its principal and its position in the
//! file, never its hash.
//!
//! [`SETTINGS`] is the one place that says which settings a reload applies
//! ([`Apply::Live`]) and which need a restart ([`Apply::Restart`]); the
//! comments of `examples/edge.toml` follow it (a test checks them). The
//! rule: a value the shells read per request, per connection or per run
//! from the settings a reload swaps (or Control reads per request from its
//! tunables) is live; one bound into a listener, an accept loop, a per-core
//! gate, a shared per-peer table or a writer started once at startup needs
//! a restart.

use std::fmt;
use std::path::Path;

use super::{
    AdapterKind, AdapterSpec, ClientKeySpec, CredentialsSpec, Destination, EdgeConfig,
    MetricsAccess, ModelSpec, ProviderSpec, SecretSource, SlotSpec,
};
use Apply::{Live, Restart};

/// How a change of a setting takes effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Apply {
    /// A reload applies it: new requests, connections and runs get the new
    /// value (those already open keep theirs).
    Live,
    /// Only a restart applies it; a reload leaves the running value.
    Restart,
}

impl Apply {
    /// How a diff line says it: `live` or `needs a restart`.
    pub fn as_str(self) -> &'static str {
        match self {
            Apply::Live => "live",
            Apply::Restart => "needs a restart",
        }
    }
}

/// One setting: its dotted key in `edge.toml`, how a change applies, and
/// how its value is shown.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// The dotted key (`edge.drain_grace_ms`); a table's own key
    /// (`edge.client_tls`, `tls`, `cluster`) is whether it is there (`on`
    /// or `off`).
    pub key: &'static str,
    /// How a change applies.
    pub apply: Apply,
    /// The value as a diff shows it; `None` when its table is absent (its
    /// presence is a setting of its own).
    value: fn(&EdgeConfig) -> Option<String>,
}

const fn setting(
    key: &'static str,
    apply: Apply,
    value: fn(&EdgeConfig) -> Option<String>,
) -> Setting {
    Setting { key, apply, value }
}

fn text(value: impl fmt::Display) -> Option<String> {
    Some(value.to_string())
}

fn on_off(on: bool) -> Option<String> {
    text(if on { "on" } else { "off" })
}

fn path(path: &Path) -> String {
    path.display().to_string()
}

fn or_none(value: Option<impl fmt::Display>) -> String {
    value.map_or_else(|| "none".to_owned(), |v| v.to_string())
}

fn list<T: fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    let items: Vec<String> = items.into_iter().map(|i| i.to_string()).collect();
    format!("[{}]", items.join(", "))
}

/// Every setting a diff compares, with how a change of it applies.
///
/// Why each is what it is (`edge-bin/src/server`, `link`, `client`):
///
/// - Restart: `name`, `trust_domain` (the TLS identity and acceptor, the
///   cluster view); `client_listen`, `node_listen`, `cluster.peer_listen`
///   (bound); `insecure_plaintext_nodes`, `tls` and `edge.client_tls`
///   added or removed (a listener with or without TLS); `max_frame_bytes`
///   (not among the swapped settings); `drain_grace_ms` (each shard's
///   stop is built at startup); `max_client_connections`,
///   `max_node_handshakes` (per-core accept gates built when the accept
///   loop starts); the `_per_peer` caps (one per-peer table built at
///   bind); `node_handshake_timeout_ms`, `node_first_byte_timeout_ms`
///   (read once by the node accept loop); the access log and the usage
///   file turned on or off, or the access log between stderr and a file
///   (`edge.access_log`, `edge.usage_log`: one writer started at startup);
///   `edge.budget_file` (replayed and opened once at startup); `[cluster]`
///   (the etcd lease and membership); `[tracing]` (the exporter thread
///   and each shard's sampler are built at startup).
/// - Live: the client limits and timeouts (read from the settings for each
///   new connection or request), `flow_window_bytes` (per run),
///   `metrics_access` (per request), `node_metrics_max_age_ms` (per
///   scrape), `allow_anonymous` (checked on every reload with the keys);
///   `response_wait_timeout_ms` and `[outlier_detection]` (Control's
///   tunables, read per dispatch and per failure); the certificate paths of
///   `[tls]` and `[edge.client_tls]` (SIGHUP re-reads them from the new
///   file); the access log file and the usage file paths (SIGHUP opens the
///   new path, keeping the running file when it cannot).
pub const SETTINGS: &[Setting] = &[
    setting("edge.name", Restart, |c| text(&c.edge.name)),
    setting("edge.trust_domain", Restart, |c| text(&c.edge.trust_domain)),
    setting("edge.client_listen", Restart, |c| {
        text(c.edge.client_listen)
    }),
    setting("edge.node_listen", Restart, |c| text(c.edge.node_listen)),
    setting("edge.max_request_body_bytes", Live, |c| {
        text(c.edge.max_request_body_bytes)
    }),
    setting("edge.max_upload_body_bytes", Live, |c| {
        text(c.edge.max_upload_body_bytes)
    }),
    setting("edge.max_frame_bytes", Restart, |c| {
        text(c.edge.max_frame_bytes)
    }),
    setting("edge.insecure_plaintext_nodes", Restart, |c| {
        text(c.edge.insecure_plaintext_nodes)
    }),
    setting("edge.allow_anonymous", Live, |c| {
        text(c.edge.allow_anonymous)
    }),
    setting("edge.metrics_access", Live, |c| {
        text(match c.edge.metrics_access {
            MetricsAccess::Open => "open",
            MetricsAccess::Key => "key",
        })
    }),
    setting("edge.node_metrics_max_age_ms", Live, |c| {
        text(c.edge.node_metrics_max_age_ms)
    }),
    setting("edge.drain_grace_ms", Restart, |c| {
        text(c.edge.drain_grace_ms)
    }),
    setting("edge.flow_window_bytes", Live, |c| {
        text(c.edge.flow_window_bytes)
    }),
    setting("edge.client_write_stall_timeout_ms", Live, |c| {
        text(c.edge.client_write_stall_timeout_ms)
    }),
    setting("edge.response_wait_timeout_ms", Live, |c| {
        text(c.edge.response_wait_timeout_ms)
    }),
    setting("edge.client_head_timeout_ms", Live, |c| {
        text(c.edge.limits.client_head_timeout_ms)
    }),
    setting("edge.client_body_idle_timeout_ms", Live, |c| {
        text(c.edge.limits.client_body_idle_timeout_ms)
    }),
    setting("edge.client_body_grace_ms", Live, |c| {
        text(c.edge.limits.client_body_grace_ms)
    }),
    setting("edge.client_body_min_rate_bytes_per_sec", Live, |c| {
        text(c.edge.limits.client_body_min_rate_bytes_per_sec)
    }),
    setting("edge.client_keep_alive_timeout_ms", Live, |c| {
        text(c.edge.limits.client_keep_alive_timeout_ms)
    }),
    setting("edge.max_client_connections", Restart, |c| {
        text(c.edge.limits.max_client_connections)
    }),
    setting("edge.max_client_connections_per_peer", Restart, |c| {
        text(c.edge.limits.max_client_connections_per_peer)
    }),
    setting("edge.client_linger_time_ms", Live, |c| {
        text(c.edge.limits.client_linger_time_ms)
    }),
    setting("edge.client_linger_idle_timeout_ms", Live, |c| {
        text(c.edge.limits.client_linger_idle_timeout_ms)
    }),
    setting("edge.client_linger_max_bytes", Live, |c| {
        text(c.edge.limits.client_linger_max_bytes)
    }),
    setting("edge.node_handshake_timeout_ms", Restart, |c| {
        text(c.edge.limits.node_handshake_timeout_ms)
    }),
    setting("edge.max_node_handshakes", Restart, |c| {
        text(c.edge.limits.max_node_handshakes)
    }),
    setting("edge.max_node_handshakes_per_peer", Restart, |c| {
        text(c.edge.limits.max_node_handshakes_per_peer)
    }),
    setting("edge.node_first_byte_timeout_ms", Restart, |c| {
        text(c.edge.limits.node_first_byte_timeout_ms)
    }),
    setting("edge.max_json_depth", Live, |c| {
        text(c.edge.limits.max_json_depth)
    }),
    setting("edge.max_json_elements", Live, |c| {
        text(c.edge.limits.max_json_elements)
    }),
    setting("edge.max_json_members", Live, |c| {
        text(c.edge.limits.max_json_members)
    }),
    setting("edge.access_log", Restart, |c| {
        text(match &c.access_log.destination {
            Destination::Off => "off",
            Destination::Stderr => "stderr",
            Destination::File(_) => "a file",
        })
    }),
    setting("edge.access_log.destination", Live, |c| {
        match &c.access_log.destination {
            Destination::File(file) => text(path(file)),
            Destination::Off | Destination::Stderr => None,
        }
    }),
    setting("edge.access_log.format", Restart, |c| {
        let format = match c.access_log.format {
            super::Format::Text => "text",
            super::Format::Json => "json",
        };
        text(if c.access_log.format_explicit {
            format
        } else {
            "from --log-format"
        })
    }),
    setting("edge.usage_log", Restart, |c| on_off(c.usage_log.is_some())),
    setting("edge.usage_log.path", Live, |c| {
        c.usage_log.as_deref().map(path)
    }),
    setting("edge.budget_file", Restart, |c| {
        Some(
            c.budget_file
                .as_deref()
                .map_or_else(|| "none".to_owned(), path),
        )
    }),
    setting("edge.client_tls", Restart, |c| {
        on_off(c.client_tls.is_some())
    }),
    setting("edge.client_tls.cert", Live, |c| {
        c.client_tls.as_ref().map(|t| path(&t.cert))
    }),
    setting("edge.client_tls.key", Live, |c| {
        c.client_tls.as_ref().map(|t| path(&t.key))
    }),
    setting("edge.client_tls.client_ca", Live, |c| {
        c.client_tls
            .as_ref()
            .map(|t| or_none(t.client_ca.as_deref().map(path)))
    }),
    setting("tls", Restart, |c| on_off(c.tls.is_some())),
    setting("tls.ca", Live, |c| c.tls.as_ref().map(|t| path(&t.ca))),
    setting("tls.cert", Live, |c| c.tls.as_ref().map(|t| path(&t.cert))),
    setting("tls.key", Live, |c| c.tls.as_ref().map(|t| path(&t.key))),
    setting("outlier_detection.enabled", Live, |c| {
        text(c.outlier_detection.enabled)
    }),
    setting("outlier_detection.consecutive_failures", Live, |c| {
        text(c.outlier_detection.consecutive_failures)
    }),
    setting("outlier_detection.base_ejection_time_ms", Live, |c| {
        text(c.outlier_detection.base_ejection_time_ms)
    }),
    setting("outlier_detection.max_ejection_time_ms", Live, |c| {
        text(c.outlier_detection.max_ejection_time_ms)
    }),
    setting("outlier_detection.max_ejection_percent", Live, |c| {
        text(c.outlier_detection.max_ejection_percent)
    }),
    setting("routing.prefix_tree_bytes", Live, |c| {
        text(c.routing.prefix_tree_bytes)
    }),
    setting("routing.prefix_bytes_max", Live, |c| {
        text(c.routing.prefix_bytes_max)
    }),
    setting("routing.match_threshold_percent", Live, |c| {
        text(c.routing.match_threshold_percent)
    }),
    setting("routing.balance_abs_threshold", Live, |c| {
        text(c.routing.balance_abs_threshold)
    }),
    setting("routing.balance_rel_threshold_percent", Live, |c| {
        text(c.routing.balance_rel_threshold_percent)
    }),
    setting("routing.affinity_wait_ms", Live, |c| {
        text(c.routing.affinity_wait_ms)
    }),
    setting("cluster", Restart, |c| on_off(c.cluster.is_some())),
    setting("cluster.name", Restart, |c| {
        c.cluster.as_ref().map(|k| k.name.clone())
    }),
    setting("cluster.etcd_endpoints", Restart, |c| {
        c.cluster.as_ref().map(|k| list(&k.etcd_endpoints))
    }),
    setting("cluster.lease_ttl_sec", Restart, |c| {
        c.cluster.as_ref().map(|k| k.lease_ttl_sec.to_string())
    }),
    setting("cluster.keepalive_interval_sec", Restart, |c| {
        c.cluster
            .as_ref()
            .map(|k| k.keepalive_interval_sec.to_string())
    }),
    setting("cluster.etcd_timeout_ms", Restart, |c| {
        c.cluster.as_ref().map(|k| k.etcd_timeout_ms.to_string())
    }),
    setting("cluster.peer_listen", Restart, |c| {
        c.cluster.as_ref().map(|k| or_none(k.peer_listen))
    }),
    setting("tracing", Restart, |c| on_off(c.tracing.is_some())),
    setting("tracing.otlp_endpoint", Restart, |c| {
        c.tracing
            .as_ref()
            .map(|t| t.otlp_endpoint.as_str().to_owned())
    }),
    setting("tracing.sample_ratio", Restart, |c| {
        c.tracing.as_ref().map(|t| t.sample_ratio.to_string())
    }),
    setting("tracing.service_name", Restart, |c| {
        c.tracing.as_ref().map(|t| t.service_name.clone())
    }),
];

/// How a change of the setting `key` (a [`Setting::key`]) applies; `None`
/// for a key that is not a setting.
pub fn apply_of(key: &str) -> Option<Apply> {
    SETTINGS.iter().find(|s| s.key == key).map(|s| s.apply)
}

/// One field of an item that changed: `field from -> to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldChange {
    /// The field's key in `edge.toml` (`capacity`).
    pub field: &'static str,
    /// The running value, as shown.
    pub from: String,
    /// The next value, as shown.
    pub to: String,
}

impl fmt::Display for FieldChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} -> {}", self.field, self.from, self.to)
    }
}

/// Collects the fields that differ.
#[derive(Debug, Default)]
struct Fields(Vec<FieldChange>);

impl Fields {
    fn compare<T: PartialEq + fmt::Display>(&mut self, field: &'static str, from: T, to: T) {
        if from != to {
            self.0.push(FieldChange {
                field,
                from: from.to_string(),
                to: to.to_string(),
            });
        }
    }
}

/// The items of one keyed section that were added, removed or changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section<C> {
    /// Keys only `next` has, in its file order.
    pub added: Vec<String>,
    /// Keys only `running` has, in its file order.
    pub removed: Vec<String>,
    /// Items both have that differ, in `next`'s file order.
    pub changed: Vec<C>,
}

impl<C> Default for Section<C> {
    fn default() -> Self {
        Self {
            added: Vec::new(),
            removed: Vec::new(),
            changed: Vec::new(),
        }
    }
}

impl<C> Section<C> {
    /// Nothing added, removed or changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }

    /// Compares the items of `running` and `next` by key; `change` says
    /// how an item both have differs (`None`: it does not).
    fn keyed<T>(
        running: &[(String, T)],
        next: &[(String, T)],
        mut change: impl FnMut(&str, &T, &T) -> Option<C>,
    ) -> Self {
        let find = |items: &[(String, T)], key: &str| items.iter().position(|(k, _)| k == key);
        let mut section = Self::default();
        for (key, item) in next {
            match find(running, key) {
                None => section.added.push(key.clone()),
                Some(i) => section.changed.extend(change(key, &running[i].1, item)),
            }
        }
        section.removed = running
            .iter()
            .filter(|(key, _)| find(next, key).is_none())
            .map(|(key, _)| key.clone())
            .collect();
        section
    }
}

/// A node both configurations have whose adapters or recipient key
/// changed (its providers are in [`ConfigDiff::providers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeChange {
    /// The node id.
    pub node: String,
    /// Its adapter instances, by name.
    pub adapters: Section<AdapterChange>,
    /// `recipient_key` (a public key), when it changed.
    pub recipient_key: Option<FieldChange>,
}

/// An adapter instance whose settings changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterChange {
    /// The adapter's name.
    pub adapter: String,
    /// What changed: `kind`, `profile`, `base_url`, `health_path`,
    /// `capacity`, `ca_file` (its path, or its contents when the path is
    /// the same), `tls_insecure_skip_verify`.
    pub fields: Vec<FieldChange>,
}

/// A provider (`node/provider`) whose settings changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderChange {
    /// `node/provider`, as model pools name it.
    pub provider: String,
    /// What changed: `adapter`, `target`, `capacity`,
    /// `long_context_capacity`, `response_stall_timeout_ms`, `category`,
    /// `enabled`.
    pub fields: Vec<FieldChange>,
}

/// A model's provider pool before and after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolChange {
    /// The running pool, `node/provider` in configured order.
    pub from: Vec<String>,
    /// The next pool.
    pub to: Vec<String>,
    /// Providers only the next pool has.
    pub added: Vec<String>,
    /// Providers only the running pool has.
    pub removed: Vec<String>,
    /// The providers both have are in another order (the order breaks
    /// ties in dispatch).
    pub reordered: bool,
}

/// A model both configurations have that changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChange {
    /// The model name.
    pub model: String,
    /// Its pool, when it changed.
    pub pool: Option<PoolChange>,
    /// Its other keys that changed: `long_context_threshold_tokens`,
    /// `max_queue`, `queue_timeout_ms`, `max_attempts`, `owned_by`.
    pub fields: Vec<FieldChange>,
    /// The change leaves the model without an enabled provider (it had
    /// one): its requests can only queue and time out. A pool is never
    /// empty (validation), so this is every provider of it disabled.
    pub no_enabled_provider: bool,
}

/// Whether a table was added or removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableChange {
    /// Only `next` has it.
    Added,
    /// Only `running` has it.
    Removed,
}

/// What changed in `[credentials]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CredentialsDiff {
    /// The table was added (the credential plane turned on) or removed.
    pub table: Option<TableChange>,
    /// `issuer_key` (the file's path), `lease_ttl_ms`; when both have the
    /// table.
    pub fields: Vec<FieldChange>,
    /// The slots, by name (a missing table counts as no slot).
    pub slots: Section<SlotChange>,
}

impl CredentialsDiff {
    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        self.table.is_none() && self.fields.is_empty() && self.slots.is_empty()
    }
}

/// A credential slot that changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotChange {
    /// The slot name.
    pub slot: String,
    /// What changed: `secret` (where it lives: `secret_file <path>` or
    /// `secret_env <name>`, never the value), `header`, `format`,
    /// `revision`, `revoked_revisions`, `enabled`, `providers`.
    pub fields: Vec<FieldChange>,
}

/// A client key both configurations have (the same key hash) whose
/// principal, scopes, limits or models changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientKeyChange {
    /// The key as shown: `<principal> (client_keys[<index in next>])`.
    pub key: String,
    /// What changed: `principal`, `scopes`, `max_concurrent`,
    /// `requests_per_minute`, `tokens_per_minute`, `tokens_per_day`,
    /// `tokens_per_month`, `models`.
    pub fields: Vec<FieldChange>,
}

/// A setting that changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingChange {
    /// Its key in [`SETTINGS`].
    pub key: &'static str,
    /// The running value, as shown.
    pub from: String,
    /// The next value, as shown.
    pub to: String,
    /// How the change applies.
    pub apply: Apply,
}

/// What changes from one configuration to the next; see the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigDiff {
    /// Nodes by id; a changed node is one whose adapters or recipient key
    /// changed.
    pub nodes: Section<NodeChange>,
    /// Providers by `node/provider` (those of an added or removed node
    /// too).
    pub providers: Section<ProviderChange>,
    /// Models by name.
    pub models: Section<ModelChange>,
    /// `[credentials]`.
    pub credentials: CredentialsDiff,
    /// `[[client_keys]]`, by key hash (shown by principal and position).
    pub client_keys: Section<ClientKeyChange>,
    /// The settings that changed, in [`SETTINGS`] order.
    pub settings: Vec<SettingChange>,
}

impl ConfigDiff {
    /// What changes from `running` to `next`. Pure: reads no file (a
    /// rotated CA file shows only when both were loaded with
    /// [`EdgeConfig::load`], which reads it). Relative paths were resolved
    /// against each file's directory, so the same relative path in files
    /// of different directories shows as a change.
    pub fn between(running: &EdgeConfig, next: &EdgeConfig) -> ConfigDiff {
        // Every section is compared below; a new one is a compile error
        // here until it is.
        let EdgeConfig {
            source: _,
            edge: _,
            tls: _,
            client_tls: _,
            access_log: _,
            usage_log: _,
            budget_file: _,
            nodes: _,
            models: _,
            credentials: _,
            client_keys: _,
            outlier_detection: _,
            routing: _,
            cluster: _,
            tracing: _,
        } = next;
        ConfigDiff {
            nodes: Section::keyed(&nodes(running), &nodes(next), |id, a, b| {
                node_change(id, a, b)
            }),
            providers: Section::keyed(&providers(running), &providers(next), |key, a, b| {
                let fields = provider_fields(a, b);
                (!fields.is_empty()).then(|| ProviderChange {
                    provider: key.to_owned(),
                    fields,
                })
            }),
            models: Section::keyed(&models(running), &models(next), |name, a, b| {
                model_change(name, (running, a), (next, b))
            }),
            credentials: credentials_diff(running.credentials.as_ref(), next.credentials.as_ref()),
            client_keys: client_keys_diff(&running.client_keys, &next.client_keys),
            settings: SETTINGS
                .iter()
                .filter_map(|s| match ((s.value)(running), (s.value)(next)) {
                    (Some(from), Some(to)) if from != to => Some(SettingChange {
                        key: s.key,
                        from,
                        to,
                        apply: s.apply,
                    }),
                    _ => None,
                })
                .collect(),
        }
    }

    /// Nothing changes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
            && self.providers.is_empty()
            && self.models.is_empty()
            && self.credentials.is_empty()
            && self.client_keys.is_empty()
            && self.settings.is_empty()
    }

    /// The keys of the changed settings a reload does not apply
    /// ([`Apply::Restart`]), in [`SETTINGS`] order.
    pub fn restart_keys(&self) -> Vec<&'static str> {
        self.settings
            .iter()
            .filter(|s| s.apply == Apply::Restart)
            .map(|s| s.key)
            .collect()
    }

    /// One line per change, in the documented order (empty when nothing
    /// changes): `+ node node-b`, `- provider node-a/a-qwen`,
    /// `~ provider node-a/a-llama: capacity 4 -> 2`,
    /// `~ edge.drain_grace_ms: 30000 -> 5000 (needs a restart)`.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        keys(&mut out, "node", &self.nodes);
        for node in &self.nodes.changed {
            let id = &node.node;
            let adapters = &node.adapters;
            out.extend(
                adapters
                    .added
                    .iter()
                    .map(|a| format!("~ node {id}: + adapter {a}")),
            );
            out.extend(
                adapters
                    .removed
                    .iter()
                    .map(|a| format!("~ node {id}: - adapter {a}")),
            );
            out.extend(
                adapters
                    .changed
                    .iter()
                    .map(|a| format!("~ node {id}: adapter {}: {}", a.adapter, joined(&a.fields))),
            );
            out.extend(
                node.recipient_key
                    .iter()
                    .map(|k| format!("~ node {id}: {k}")),
            );
        }
        keys(&mut out, "provider", &self.providers);
        out.extend(
            self.providers
                .changed
                .iter()
                .map(|p| format!("~ provider {}: {}", p.provider, joined(&p.fields))),
        );
        keys(&mut out, "model", &self.models);
        for model in &self.models.changed {
            let mut parts: Vec<String> = Vec::new();
            if let Some(pool) = &model.pool {
                parts.push(format!("pool {} -> {}", list(&pool.from), list(&pool.to)));
            }
            parts.extend(model.fields.iter().map(|f| f.to_string()));
            if model.no_enabled_provider {
                parts.push("no enabled provider left".to_owned());
            }
            out.push(format!("~ model {}: {}", model.model, parts.join(", ")));
        }
        let credentials = &self.credentials;
        match credentials.table {
            Some(TableChange::Added) => out.push("+ credentials".to_owned()),
            Some(TableChange::Removed) => out.push("- credentials".to_owned()),
            None => {}
        }
        out.extend(
            credentials
                .fields
                .iter()
                .map(|f| format!("~ credentials.{}: {} -> {}", f.field, f.from, f.to)),
        );
        keys(&mut out, "credentials.slot", &credentials.slots);
        out.extend(
            credentials
                .slots
                .changed
                .iter()
                .map(|s| format!("~ credentials.slot {}: {}", s.slot, joined(&s.fields))),
        );
        keys(&mut out, "client_key", &self.client_keys);
        out.extend(
            self.client_keys
                .changed
                .iter()
                .map(|k| format!("~ client_key {}: {}", k.key, joined(&k.fields))),
        );
        out.extend(
            self.settings
                .iter()
                .map(|s| format!("~ {}: {} -> {} ({})", s.key, s.from, s.to, s.apply.as_str())),
        );
        out
    }
}

/// The lines of `section`'s added keys (`+ <kind> <key>`), then of its
/// removed ones (`- <kind> <key>`).
fn keys<C>(out: &mut Vec<String>, kind: &str, section: &Section<C>) {
    out.extend(section.added.iter().map(|k| format!("+ {kind} {k}")));
    out.extend(section.removed.iter().map(|k| format!("- {kind} {k}")));
}

/// [`ConfigDiff::lines`], one per line, or `no changes`.
impl fmt::Display for ConfigDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines = self.lines();
        if lines.is_empty() {
            return f.write_str("no changes");
        }
        f.write_str(&lines.join("\n"))
    }
}

fn joined(fields: &[FieldChange]) -> String {
    let parts: Vec<String> = fields.iter().map(|f| f.to_string()).collect();
    parts.join(", ")
}

fn nodes(cfg: &EdgeConfig) -> Vec<(String, &super::NodeSpec)> {
    cfg.nodes.iter().map(|n| (n.id.clone(), n)).collect()
}

fn providers(cfg: &EdgeConfig) -> Vec<(String, &ProviderSpec)> {
    cfg.nodes
        .iter()
        .flat_map(|n| {
            n.providers
                .iter()
                .map(move |p| (format!("{}/{}", n.id, p.id), p))
        })
        .collect()
}

fn models(cfg: &EdgeConfig) -> Vec<(String, &ModelSpec)> {
    cfg.models.iter().map(|m| (m.name.clone(), m)).collect()
}

fn node_change(id: &str, a: &super::NodeSpec, b: &super::NodeSpec) -> Option<NodeChange> {
    fn named(n: &super::NodeSpec) -> Vec<(String, &AdapterSpec)> {
        n.adapters.iter().map(|a| (a.name.clone(), a)).collect()
    }
    let adapters = Section::keyed(&named(a), &named(b), |name, a, b| {
        let fields = adapter_fields(a, b);
        (!fields.is_empty()).then(|| AdapterChange {
            adapter: name.to_owned(),
            fields,
        })
    });
    let key = |n: &super::NodeSpec| {
        or_none(
            n.recipient_key
                .as_ref()
                .map(iop_engine::keys::encode_recipient_public_key),
        )
    };
    let mut recipient = Fields::default();
    recipient.compare("recipient_key", key(a), key(b));
    let recipient_key = recipient.0.pop();
    (!adapters.is_empty() || recipient_key.is_some()).then(|| NodeChange {
        node: id.to_owned(),
        adapters,
        recipient_key,
    })
}

fn adapter_fields(a: &AdapterSpec, b: &AdapterSpec) -> Vec<FieldChange> {
    let profile = |a: &AdapterSpec| match a.kind {
        AdapterKind::OpenAiCompat { profile } => profile.as_str(),
        AdapterKind::Ollama => "none",
    };
    let mut fields = Fields::default();
    fields.compare("kind", a.kind.as_str(), b.kind.as_str());
    fields.compare("profile", profile(a), profile(b));
    fields.compare("base_url", &a.base_url, &b.base_url);
    fields.compare(
        "health_path",
        or_none(a.health_path.as_ref()),
        or_none(b.health_path.as_ref()),
    );
    fields.compare("capacity", a.capacity, b.capacity);
    let ca_file = |a: &AdapterSpec| or_none(a.tls.ca_file.as_deref().map(path));
    if a.tls.ca_file == b.tls.ca_file && a.tls.ca_pem != b.tls.ca_pem {
        fields.compare(
            "ca_file",
            ca_file(a),
            format!("{} (contents changed)", ca_file(b)),
        );
    } else {
        fields.compare("ca_file", ca_file(a), ca_file(b));
    }
    fields.compare(
        "tls_insecure_skip_verify",
        a.tls.insecure_skip_verify,
        b.tls.insecure_skip_verify,
    );
    fields.0
}

fn provider_fields(a: &ProviderSpec, b: &ProviderSpec) -> Vec<FieldChange> {
    let mut fields = Fields::default();
    fields.compare("adapter", &a.adapter, &b.adapter);
    fields.compare("target", &a.target, &b.target);
    fields.compare("capacity", a.capacity, b.capacity);
    fields.compare(
        "long_context_capacity",
        a.long_context_capacity,
        b.long_context_capacity,
    );
    fields.compare(
        "response_stall_timeout_ms",
        a.response_stall_timeout_ms,
        b.response_stall_timeout_ms,
    );
    fields.compare("category", a.category.as_str(), b.category.as_str());
    fields.compare("enabled", a.enabled, b.enabled);
    fields.0
}

/// Whether some provider of `model`'s pool is enabled in `cfg`.
fn has_enabled_provider(cfg: &EdgeConfig, model: &ModelSpec) -> bool {
    model.providers.iter().any(|r| {
        cfg.node(&r.node_id)
            .and_then(|n| n.provider(&r.provider_id))
            .is_some_and(|p| p.enabled)
    })
}

fn model_change(
    name: &str,
    (running, a): (&EdgeConfig, &ModelSpec),
    (next, b): (&EdgeConfig, &ModelSpec),
) -> Option<ModelChange> {
    let pool = (a.providers != b.providers).then(|| {
        let from: Vec<String> = a.providers.iter().map(|r| r.to_string()).collect();
        let to: Vec<String> = b.providers.iter().map(|r| r.to_string()).collect();
        let added: Vec<String> = to.iter().filter(|p| !from.contains(p)).cloned().collect();
        let removed: Vec<String> = from.iter().filter(|p| !to.contains(p)).cloned().collect();
        let kept = |pool: &[String], other: &[String]| -> Vec<String> {
            pool.iter().filter(|p| other.contains(p)).cloned().collect()
        };
        let reordered = kept(&from, &to) != kept(&to, &from);
        PoolChange {
            from,
            to,
            added,
            removed,
            reordered,
        }
    });
    let mut fields = Fields::default();
    fields.compare(
        "long_context_threshold_tokens",
        or_none(a.long_context_threshold_tokens),
        or_none(b.long_context_threshold_tokens),
    );
    fields.compare("max_queue", a.max_queue, b.max_queue);
    fields.compare("queue_timeout_ms", a.queue_timeout_ms, b.queue_timeout_ms);
    fields.compare("max_attempts", a.max_attempts, b.max_attempts);
    fields.compare("owned_by", &a.owned_by, &b.owned_by);
    fields.compare("routing", a.routing.as_str(), b.routing.as_str());
    let no_enabled_provider = has_enabled_provider(running, a) && !has_enabled_provider(next, b);
    (pool.is_some() || !fields.0.is_empty() || no_enabled_provider).then(|| ModelChange {
        model: name.to_owned(),
        pool,
        fields: fields.0,
        no_enabled_provider,
    })
}

fn credentials_diff(
    running: Option<&CredentialsSpec>,
    next: Option<&CredentialsSpec>,
) -> CredentialsDiff {
    let table = match (running, next) {
        (None, Some(_)) => Some(TableChange::Added),
        (Some(_), None) => Some(TableChange::Removed),
        _ => None,
    };
    let mut fields = Fields::default();
    if let (Some(a), Some(b)) = (running, next) {
        fields.compare("issuer_key", path(&a.issuer_key), path(&b.issuer_key));
        fields.compare("lease_ttl_ms", a.lease_ttl_ms, b.lease_ttl_ms);
    }
    fn slots(c: Option<&CredentialsSpec>) -> Vec<(String, &SlotSpec)> {
        c.into_iter()
            .flat_map(|c| &c.slots)
            .map(|s| (s.name.clone(), s))
            .collect()
    }
    let slots = Section::keyed(&slots(running), &slots(next), |name, a, b| {
        let fields = slot_fields(a, b);
        (!fields.is_empty()).then(|| SlotChange {
            slot: name.to_owned(),
            fields,
        })
    });
    CredentialsDiff {
        table,
        fields: fields.0,
        slots,
    }
}

fn slot_fields(a: &SlotSpec, b: &SlotSpec) -> Vec<FieldChange> {
    // Where the secret lives; the value is never read here.
    let secret = |s: &SlotSpec| match &s.secret {
        SecretSource::File(file) => format!("secret_file {}", path(file)),
        SecretSource::Env(name) => format!("secret_env {name}"),
    };
    let mut fields = Fields::default();
    fields.compare("secret", secret(a), secret(b));
    fields.compare("header", &a.header_name, &b.header_name);
    fields.compare("format", &a.header_format, &b.header_format);
    fields.compare("revision", a.revision, b.revision);
    fields.compare(
        "revoked_revisions",
        list(&a.revoked_revisions),
        list(&b.revoked_revisions),
    );
    fields.compare("enabled", a.enabled, b.enabled);
    fields.compare("providers", list(&a.providers), list(&b.providers));
    fields.0
}

fn client_keys_diff(running: &[ClientKeySpec], next: &[ClientKeySpec]) -> Section<ClientKeyChange> {
    let label = |i: usize, k: &ClientKeySpec| format!("{} (client_keys[{i}])", k.principal);
    let mut section = Section::default();
    for (i, b) in next.iter().enumerate() {
        match running.iter().find(|a| a.key_hash == b.key_hash) {
            None => section.added.push(label(i, b)),
            Some(a) => {
                let fields = client_key_fields(a, b);
                if !fields.is_empty() {
                    section.changed.push(ClientKeyChange {
                        key: label(i, b),
                        fields,
                    });
                }
            }
        }
    }
    section.removed = running
        .iter()
        .enumerate()
        .filter(|(_, a)| !next.iter().any(|b| b.key_hash == a.key_hash))
        .map(|(i, a)| label(i, a))
        .collect();
    section
}

fn client_key_fields(a: &ClientKeySpec, b: &ClientKeySpec) -> Vec<FieldChange> {
    let scopes = |k: &ClientKeySpec| {
        let scopes = [
            (k.admin, super::ADMIN_SCOPE),
            (k.metrics, super::METRICS_SCOPE),
        ];
        list(scopes.iter().filter(|(on, _)| *on).map(|(_, s)| s))
    };
    let models = |k: &ClientKeySpec| k.models.as_ref().map_or_else(|| "all".to_owned(), list);
    let mut fields = Fields::default();
    fields.compare("principal", &a.principal, &b.principal);
    fields.compare("scopes", scopes(a), scopes(b));
    fields.compare(
        "max_concurrent",
        or_none(a.limits.max_concurrent),
        or_none(b.limits.max_concurrent),
    );
    fields.compare(
        "requests_per_minute",
        or_none(a.limits.requests_per_minute),
        or_none(b.limits.requests_per_minute),
    );
    fields.compare(
        "tokens_per_minute",
        or_none(a.limits.tokens_per_minute),
        or_none(b.limits.tokens_per_minute),
    );
    fields.compare(
        "tokens_per_day",
        or_none(a.budgets.tokens_per_day),
        or_none(b.budgets.tokens_per_day),
    );
    fields.compare(
        "tokens_per_month",
        or_none(a.budgets.tokens_per_month),
        or_none(b.budgets.tokens_per_month),
    );
    fields.compare("models", models(a), models(b));
    fields.0
}
