//! The Edge half of the credential plane (C1, C3–C5): client API keys →
//! principals, credential slots, and issuing a sealed lease for a selected
//! provider and the one tunnel request it serves.
//!
//! ```text
//!  client ─Authorization: Bearer k─► ClientKeys::authenticate ─► principal (401 otherwise)
//!  Control selects (node, provider, generation); the surface builds the tunnel request
//!      └─► CredentialPlane::issue: slot of that provider? ── none ─► no lease (legacy tunnel)
//!            │ disabled slot / revoked revision ─► CredentialError (503, no provider call,
//!            │                                      no other slot tried: C3, C5)
//!            └─► exact CredentialLeaseBinding: who, which credential, the provider origin,
//!                TLS trust and profile the Node will use, the run id and the digest of
//!                the request
//!                ─► iop_wire::lease::issue (sealed to the node's recipient key with HPKE,
//!                signed by the issuer key, next sequence number of the node) ─► tunnel
//! ```
//!
//! The decisions are pure: [`CredentialPlane::issue`] takes `now`, the lease
//! id and the randomness as inputs; [`CredentialPlane::issue_now`] is the
//! shell that reads the clock and the OS random source. Loading
//! ([`CredentialPlane::load`]) reads the issuer key and every slot secret once
//! at startup; [`CredentialPlane::apply_config`] follows a reload's new
//! adapter origins, provider CAs and profiles.
//!
//! # Never leaked (C4)
//!
//! Slot secrets live in zeroize-on-drop buffers and the issuer key in a
//! zeroize-on-drop `SigningKey`; every type here that holds one has a
//! hand-written, redacted `Debug` and no `Display`. Errors name slots, files
//! and variables, never contents. An issued lease's `Debug` omits the sealed
//! blob.
//!
//! # Revisions and generations
//!
//! `credential_revision` is the slot's configured `revision`.
//! `route_revision` is [`ROUTE_REVISION`]: routes are static config, so their
//! revision changes only with a restart and is fixed at 1 (a future config
//! refresh would bump it). `projection_generation` is
//! [`CredentialPlane::projection`] of the connection generation of the
//! selected node's lease in `Control`: a keyed hash, never the generation
//! itself (R5).

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use iop_engine::config::open_regular_file;
use iop_engine::http::Header;
use iop_engine::keys;
use iop_engine::tls::UpstreamTlsSettings;
use iop_wire::codec::BodyParts;
use iop_wire::lease::{
    self, BoundRequest, IssueError, IssueParams, LeaseEntropy, ProviderTrust, MAX_SECRET_BYTES,
    PROVIDER_TRUST_BYTES,
};
use iop_wire::pb::{self, CredentialLease, CredentialLeaseBinding};
use x25519_dalek::PublicKey;
use zeroize::Zeroizing;

use crate::api::openai::ApiError;
use crate::config::{
    AdapterKind, AdapterSpec, ClientKeySpec, ConfigError, EdgeConfig, SecretSource,
};
use crate::plane::limits::{self, Limiter, Ticket};

/// The principal of requests when no client keys are configured.
pub const ANONYMOUS_PRINCIPAL: &str = "anonymous";
/// `CredentialLeaseBinding.route_revision` of every lease (see the module
/// docs).
pub const ROUTE_REVISION: u64 = 1;
/// The error `code` of a request refused because its provider's slot may
/// not issue a lease (503).
pub const CREDENTIAL_UNAVAILABLE: &str = "credential_unavailable";

// ---------------------------------------------------------------------------
// Client API keys

/// blake3 of a client API key: the `key_hash` stored in `[[client_keys]]`.
pub fn hash_client_key(key: &[u8]) -> [u8; 32] {
    *blake3::hash(key).as_bytes()
}

/// [`hash_client_key`] as lowercase hex, the config form.
pub fn client_key_hash_hex(key: &[u8]) -> String {
    lease::encode_hex(&hash_client_key(key))
}

/// The configured client API keys, by hash. Empty = the surface is open and
/// every request runs as [`ANONYMOUS_PRINCIPAL`].
///
/// Clones share one table: the shards of an Edge hold clones, and
/// [`ClientKeys::replace`] (SIGHUP) swaps the keys for all of them at once.
/// Each request is authenticated against the table as it is when its head
/// has been read; a request already authenticated runs on under a key
/// revoked after that.
///
/// The clones also share the principals' [`Limiter`]: a principal's limits
/// hold across shards. Its lock is taken once when a request is admitted
/// and once when it ends.
#[derive(Clone)]
pub struct ClientKeys {
    table: Arc<RwLock<HashMap<[u8; 32], Caller>>>,
    limiter: Arc<Mutex<Limiter>>,
    anonymous: Caller,
}

impl Default for ClientKeys {
    fn default() -> Self {
        Self {
            table: Arc::default(),
            limiter: Arc::default(),
            anonymous: Caller {
                principal: Arc::from(ANONYMOUS_PRINCIPAL),
                authority: Authority::Anonymous,
                models: None,
            },
        }
    }
}

impl fmt::Debug for ClientKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientKeys")
            .field("keys", &self.len())
            .finish()
    }
}

/// Who sent a request: the principal of its client key and what the key
/// may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The principal bound into every lease issued for the request.
    pub principal: Arc<str>,
    /// How the request was let in.
    pub authority: Authority,
    /// The only models the key may use (`models = [...]`); `None` = all.
    pub models: Option<Arc<[String]>>,
}

impl Caller {
    /// Whether the caller may use `model`.
    pub fn may_use(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|m| m == model))
    }
}

/// How a request was let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authority {
    /// No client keys are configured: every request is let in as
    /// [`ANONYMOUS_PRINCIPAL`] (the `/admin` routes then answer loopback
    /// peers only).
    Anonymous,
    /// A configured client key.
    Key {
        /// The key has `scopes = ["admin"]`: it may use the `/admin` routes.
        admin: bool,
        /// The key has `scopes = ["metrics"]`: it may read `/metrics` (under
        /// `edge.metrics_access = "key"`) and the whole of `/status`.
        metrics: bool,
    },
}

impl Authority {
    /// Whether the caller may see the whole fleet: every provider on
    /// `/status`, and `/metrics` under `edge.metrics_access = "key"`.
    /// Without client keys every caller may.
    pub fn sees_everything(self) -> bool {
        match self {
            Authority::Anonymous => true,
            Authority::Key { admin, metrics } => admin || metrics,
        }
    }
}

/// What [`ClientKeys::replace`] changed, by key (no key or hash appears).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeysChange {
    /// Keys now configured.
    pub keys: usize,
    /// Keys that were not configured before.
    pub added: usize,
    /// Keys no longer configured: their next request gets 401.
    pub revoked: usize,
    /// Keys still configured whose principal or scopes changed.
    pub changed: usize,
}

/// Why a client request was not authenticated (401).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No API key was presented.
    #[error("no API key")]
    Missing,
    /// The presented key is not a configured client key.
    #[error("invalid API key")]
    Invalid,
}

impl AuthError {
    /// The 401 answer. `x_api_key` says whether the route also accepts the
    /// key in `x-api-key` (Anthropic routes), for the message.
    pub fn api_error(&self, x_api_key: bool) -> ApiError {
        let how = if x_api_key {
            "`Authorization: Bearer <key>` or `x-api-key: <key>`"
        } else {
            "`Authorization: Bearer <key>`"
        };
        let (message, code) = match self {
            AuthError::Missing => (
                format!("You didn't provide an API key. Send it as {how}."),
                None,
            ),
            AuthError::Invalid => (
                "Incorrect API key provided.".to_owned(),
                Some("invalid_api_key".to_owned()),
            ),
        };
        ApiError {
            status: 401,
            message,
            kind: "invalid_request_error",
            param: None,
            code,
            retry_after_sec: None,
        }
    }
}

impl ClientKeys {
    /// The keys of `[[client_keys]]`.
    pub fn from_config(specs: &[ClientKeySpec]) -> Self {
        let keys = Self::default();
        keys.replace(specs);
        keys
    }

    fn table_of(specs: &[ClientKeySpec]) -> HashMap<[u8; 32], Caller> {
        specs
            .iter()
            .map(|k| {
                let caller = Caller {
                    principal: Arc::from(k.principal.as_str()),
                    authority: Authority::Key {
                        admin: k.admin,
                        metrics: k.metrics,
                    },
                    models: k.models.as_deref().map(Arc::from),
                };
                (k.key_hash, caller)
            })
            .collect()
    }

    /// Makes `specs` the configured keys, for every clone (SIGHUP): keys
    /// not in `specs` are refused from the next request on, new ones
    /// accepted; requests already authenticated are not affected.
    pub fn replace(&self, specs: &[ClientKeySpec]) -> KeysChange {
        let next = Self::table_of(specs);
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        let change = KeysChange {
            keys: next.len(),
            added: next.keys().filter(|h| !table.contains_key(*h)).count(),
            revoked: table.keys().filter(|h| !next.contains_key(*h)).count(),
            changed: next
                .iter()
                .filter(|(h, caller)| table.get(*h).is_some_and(|old| old != *caller))
                .count(),
        };
        *table = next;
        drop(table);
        self.limiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .configure(specs.iter().map(|k| (k.principal.as_str(), k.limits)));
        change
    }

    /// Admits a request of `principal` against its limits (before it takes
    /// a lease); see [`Limiter::admit`].
    pub fn admit(&self, principal: &str, estimated_tokens: u64, now: Instant) -> limits::Admission {
        self.limiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .admit(principal, estimated_tokens, now)
    }

    /// Ends an admitted request; see [`Limiter::finish`].
    pub fn finish(&self, ticket: Ticket, observed_tokens: Option<u64>, now: Instant) {
        self.limiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .finish(ticket, observed_tokens, now);
    }

    fn len(&self) -> usize {
        self.table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The caller of a route that needs no key (`/livez`, `/readyz`,
    /// `/metrics`).
    pub fn anonymous(&self) -> Caller {
        self.anonymous.clone()
    }

    /// True when requests must present a key.
    pub fn is_enabled(&self) -> bool {
        self.len() > 0
    }

    /// The caller of a request with `headers`: [`ANONYMOUS_PRINCIPAL`]
    /// when no keys are configured; otherwise the principal of the key in
    /// `Authorization: Bearer <key>` (or, when `x_api_key`, in
    /// `x-api-key: <key>`).
    pub fn authenticate(&self, headers: &[Header], x_api_key: bool) -> Result<Caller, AuthError> {
        let bearer = headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("authorization"))
            .map(|h| bearer_token(&h.value));
        let api_key = headers
            .iter()
            .filter(|h| x_api_key && h.name.eq_ignore_ascii_case("x-api-key"))
            .map(|h| Some(&h.value[..]));
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        if table.is_empty() {
            return Ok(self.anonymous.clone());
        }
        let mut presented = false;
        for candidate in bearer.chain(api_key) {
            presented = true;
            let Some(key) = candidate.filter(|k| !k.is_empty()) else {
                continue;
            };
            if let Some(caller) = table.get(&hash_client_key(key)) {
                return Ok(caller.clone());
            }
        }
        Err(if presented {
            AuthError::Invalid
        } else {
            AuthError::Missing
        })
    }
}

/// The token of an `Authorization: Bearer <token>` value (scheme
/// case-insensitive), or `None` for another scheme.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() < SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let token = &value[SCHEME.len()..];
    let start = token.iter().position(|&b| b != b' ').unwrap_or(token.len());
    Some(&token[start..])
}

// ---------------------------------------------------------------------------
// Slots and leases

/// Why the Edge issues no lease for a selected provider that needs one. The
/// request fails with 503 and no provider call (C3); no other slot is tried
/// (C5).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    /// The provider's slot is disabled.
    #[error("credential slot `{slot}` is disabled")]
    SlotDisabled {
        /// The slot.
        slot: String,
    },
    /// The slot's current revision is listed in `revoked_revisions`.
    #[error("credential slot `{slot}` revision {revision} is revoked")]
    RevisionRevoked {
        /// The slot.
        slot: String,
        /// Its revoked revision.
        revision: u64,
    },
    /// The selected node has no recipient key (config validation prevents
    /// this; checked again to fail closed).
    #[error("node `{node}` has no recipient key")]
    NoRecipientKey {
        /// The node.
        node: String,
    },
    /// The provider's adapter gives no destination to bind the lease to:
    /// it is not an OpenAI-compatible adapter (any more), its profile has
    /// no path for the request's operation, or its provider CA bundle does
    /// not parse (a loaded config never has one).
    #[error("provider `{provider}` has no OpenAI-compatible destination for this request")]
    NoDestination {
        /// The provider, `node/provider`.
        provider: String,
    },
    /// Sealing or signing failed.
    #[error("cannot issue a credential lease: {0}")]
    Issue(#[from] IssueError),
    /// The OS random source failed.
    #[error("cannot issue a credential lease: OS random source failed")]
    Random,
}

impl CredentialError {
    /// The 503 answer: the request was not sent to any provider.
    pub fn api_error(&self) -> ApiError {
        ApiError {
            status: 503,
            message: format!(
                "{self}; the request was not sent to the provider (no other credential is tried)."
            ),
            kind: "server_error",
            param: None,
            code: Some(CREDENTIAL_UNAVAILABLE.to_owned()),
            retry_after_sec: None,
        }
    }
}

/// What a lease is requested for: the selected provider and the one tunnel
/// request it will ride on (already built: the lease is bound to its run
/// id, operation path, headers and body).
#[derive(Debug, Clone, Copy)]
pub struct LeaseRequest<'a> {
    /// The authenticated principal.
    pub principal: &'a str,
    /// The route: the external model name the client asked for.
    pub route: &'a str,
    /// The selected node.
    pub node_id: &'a str,
    /// The selected provider on that node.
    pub provider_id: &'a str,
    /// The connection generation the provider lease was taken under.
    pub generation: u64,
    /// The tunnel request the lease goes into (adapter, target, run id,
    /// method, operation, headers; its `body` is not read).
    pub tunnel: &'a pb::ProviderTunnelRequest,
    /// The body the tunnel carries, in the pieces it is sent in.
    pub body: &'a BodyParts,
}

/// A lease and its binding, ready for `ProviderTunnelRequest` fields 14, 15.
pub struct IssuedLease {
    /// The sealed, signed lease.
    pub lease: CredentialLease,
    /// The exact binding it was issued for.
    pub binding: CredentialLeaseBinding,
}

impl fmt::Debug for IssuedLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedLease")
            .field("lease_id", &self.lease.lease_id)
            .field("sequence", &self.lease.sequence)
            .field("expires_at_unix_ms", &self.lease.expires_at_unix_ms)
            .field("binding", &self.binding)
            .field("sealed_secret", &"<redacted>")
            .finish()
    }
}

/// A slot with its secret loaded.
struct Slot {
    name: String,
    secret: Zeroizing<Vec<u8>>,
    header_name: String,
    header_format: String,
    revision: u64,
    enabled: bool,
    revoked: bool,
}

/// Where a slot-served provider's requests go, as the Node resolves it from
/// the config the Edge pushes (U4): its adapter's profile, origin and
/// provider TLS trust. It follows SIGHUP reloads
/// ([`CredentialPlane::apply_config`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Destination {
    profile: &'static str,
    origin: String,
    provider_trust: [u8; PROVIDER_TRUST_BYTES],
    paths: pb::ProtocolProfile,
}

impl Destination {
    /// The destination of `node_id/provider_id` in `cfg`; `None` when its
    /// adapter is not OpenAI-compatible or its CA bundle does not parse.
    fn of(cfg: &EdgeConfig, node_id: &str, provider_id: &str) -> Option<Self> {
        let node = cfg.node(node_id)?;
        let adapter = node.adapter(&node.provider(provider_id)?.adapter)?;
        match adapter.kind {
            AdapterKind::OpenAiCompat { profile } => Some(Self {
                profile: profile.as_str(),
                origin: adapter.base_url.origin(),
                provider_trust: provider_trust(node_id, adapter)?,
                paths: adapter.protocol_profile()?.to_pb(),
            }),
            AdapterKind::Ollama => None,
        }
    }

    /// The request target the Node sends `tunnel` to: the profile's path
    /// of its operation, or its fallback path when it names none (U3) — the
    /// Node's own resolution, on the origin-only base URL it is given.
    fn request_path(&self, tunnel: &pb::ProviderTunnelRequest) -> Option<String> {
        let path = if tunnel.operation.is_empty() {
            tunnel.path.as_str()
        } else {
            self.paths.operation_path(&tunnel.operation)?
        };
        (!path.is_empty()).then(|| format!("/{}", path.trim_start_matches('/')))
    }
}

/// Whom the Node trusts to be `adapter`'s provider
/// ([`lease::provider_trust_digest`]), read from the TLS settings the Edge
/// pushes for it (`AdapterConfig.tls`) the way the Node builds its provider
/// client from them: no TLS for `http://`; otherwise no verification, the
/// pushed CA certificates, or (none pushed) the Node's default roots. `None`
/// (logged) when the CA bundle does not parse: [`EdgeConfig::load`] refuses
/// such a file, so only a config that was never loaded gets here.
fn provider_trust(node_id: &str, adapter: &AdapterSpec) -> Option<[u8; PROVIDER_TRUST_BYTES]> {
    if !adapter.base_url.is_tls() {
        return Some(lease::provider_trust_digest(&ProviderTrust::PlainHttp));
    }
    let pushed = adapter.tls.to_pb();
    let settings = UpstreamTlsSettings {
        ca_pem: pushed
            .as_ref()
            .filter(|tls| !tls.ca_pem.is_empty())
            .map(|tls| tls.ca_pem.clone()),
        insecure_skip_verify: pushed.as_ref().is_some_and(|tls| tls.insecure_skip_verify),
    };
    if settings.insecure_skip_verify {
        return Some(lease::provider_trust_digest(&ProviderTrust::Unverified));
    }
    match settings.private_ca_certificates() {
        Ok(None) => Some(lease::provider_trust_digest(&ProviderTrust::DefaultRoots)),
        Ok(Some(certificates)) => Some(lease::provider_trust_digest(&ProviderTrust::PrivateCa(
            certificates.iter().map(|c| c.as_ref()).collect(),
        ))),
        Err(e) => {
            tracing::warn!(
                node = node_id,
                adapter = %adapter.name,
                error = %e,
                "provider CA bundle does not parse: no credential lease is issued for this adapter"
            );
            None
        }
    }
}

/// How a slot-served provider is bound: its slot (fixed at startup) and
/// where its requests go (follows reloads).
#[derive(Debug)]
struct ProviderRoute {
    slot: usize,
    destination: RwLock<Option<Destination>>,
}

/// The exact binding of a lease about to be issued, with the slot it draws
/// on, the recipient it is sealed to and its place in the node's sequence.
struct Plan<'a> {
    binding: CredentialLeaseBinding,
    slot: &'a Slot,
    recipient: &'a Recipient,
}

/// A node's recipient key, its key id and the next lease sequence number.
#[derive(Debug)]
struct Recipient {
    key: PublicKey,
    key_id: String,
    next_sequence: AtomicU64,
}

/// The loaded credential plane: issuer key, slots with their secrets, which
/// provider each slot serves and where it goes, the nodes' recipient keys,
/// and the key of the generation projection.
pub struct CredentialPlane {
    issuer: SigningKey,
    projection_key: Zeroizing<[u8; 32]>,
    lease_ttl_ms: u64,
    slots: Vec<Slot>,
    routes: HashMap<String, HashMap<String, ProviderRoute>>,
    recipients: HashMap<String, Recipient>,
}

impl fmt::Debug for CredentialPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slots: Vec<String> = self
            .slots
            .iter()
            .map(|s| {
                format!(
                    "{} (revision {}, enabled {}, revoked {})",
                    s.name, s.revision, s.enabled, s.revoked
                )
            })
            .collect();
        f.debug_struct("CredentialPlane")
            .field("issuer_key_id", &self.issuer_key_id())
            .field("issuer_key", &"<redacted>")
            .field("projection_key", &"<redacted>")
            .field("lease_ttl_ms", &self.lease_ttl_ms)
            .field("slots", &slots)
            .field("managed_nodes", &self.recipients.len())
            .finish()
    }
}

impl CredentialPlane {
    /// Reads the issuer key and every slot secret of `cfg` (`None` when the
    /// credential plane is disabled) and draws a fresh projection key.
    /// `env` looks up environment variables (`std::env::var_os` in the
    /// binary). Errors name the config key and the reason, never a secret.
    pub fn load(
        cfg: &EdgeConfig,
        env: &dyn Fn(&str) -> Option<OsString>,
    ) -> Result<Option<Self>, ConfigError> {
        let Some(credentials) = &cfg.credentials else {
            return Ok(None);
        };
        let issuer = keys::load_issuer_key(&credentials.issuer_key)
            .map_err(|e| ConfigError::new(&cfg.source, "credentials.issuer_key", e.to_string()))?;
        let mut secrets = Vec::with_capacity(credentials.slots.len());
        for (i, slot) in credentials.slots.iter().enumerate() {
            let secret = match &slot.secret {
                SecretSource::File(path) => read_secret_file(path).map_err(|why| {
                    ConfigError::new(
                        &cfg.source,
                        format!("credentials.slots[{i}].secret_file"),
                        why,
                    )
                })?,
                SecretSource::Env(name) => read_secret_env(name, env).map_err(|why| {
                    ConfigError::new(
                        &cfg.source,
                        format!("credentials.slots[{i}].secret_env"),
                        why,
                    )
                })?,
            };
            secrets.push(secret);
        }
        let projection_key = keys::random_key().map_err(|e| {
            ConfigError::new(&cfg.source, "credentials", format!("projection key: {e}"))
        })?;
        Ok(Some(Self::from_parts(cfg, issuer, secrets, projection_key)))
    }

    /// Builds the plane from `cfg`'s credential config, the issuer key, the
    /// slot secrets (in slot order) and the projection key (fresh random
    /// bytes per process). Pure; [`CredentialPlane::load`] reads the inputs.
    /// A disabled credential plane gives a plane without slots.
    pub fn from_parts(
        cfg: &EdgeConfig,
        issuer: SigningKey,
        secrets: Vec<Zeroizing<Vec<u8>>>,
        projection_key: Zeroizing<[u8; 32]>,
    ) -> Self {
        let specs = cfg.credentials.as_ref();
        let slot_specs = specs.map(|c| c.slots.as_slice()).unwrap_or_default();
        let slots: Vec<Slot> = slot_specs
            .iter()
            .zip(secrets)
            .map(|(spec, secret)| Slot {
                name: spec.name.clone(),
                secret,
                header_name: spec.header_name.clone(),
                header_format: spec.header_format.clone(),
                revision: spec.revision,
                enabled: spec.enabled,
                revoked: spec.revoked_revisions.contains(&spec.revision),
            })
            .collect();
        let mut routes: HashMap<String, HashMap<String, ProviderRoute>> = HashMap::new();
        for (index, spec) in slot_specs.iter().enumerate().take(slots.len()) {
            for provider in &spec.providers {
                let Some(destination) =
                    Destination::of(cfg, &provider.node_id, &provider.provider_id)
                else {
                    continue;
                };
                routes.entry(provider.node_id.clone()).or_default().insert(
                    provider.provider_id.clone(),
                    ProviderRoute {
                        slot: index,
                        destination: RwLock::new(Some(destination)),
                    },
                );
            }
        }
        let recipients = cfg
            .nodes
            .iter()
            .filter_map(|n| {
                n.recipient_key.map(|key| {
                    let key_id = lease::recipient_key_id(&key);
                    let recipient = Recipient {
                        key,
                        key_id,
                        next_sequence: AtomicU64::new(1),
                    };
                    (n.id.clone(), recipient)
                })
            })
            .collect();
        Self {
            issuer,
            projection_key,
            lease_ttl_ms: specs.map_or(crate::config::DEFAULT_LEASE_TTL_MS, |c| c.lease_ttl_ms),
            slots,
            routes,
            recipients,
        }
    }

    /// Follows a reloaded configuration (SIGHUP): every slot-served
    /// provider's destination (its adapter's origin, provider CA and profile
    /// paths) is read from `cfg`, so leases issued from now on are bound to
    /// what the refreshed Node will send and whom it will trust. Slots, the providers they serve and keys
    /// change only with a restart. Returns how many destinations changed.
    pub fn apply_config(&self, cfg: &EdgeConfig) -> usize {
        let mut changed = 0;
        for (node_id, providers) in &self.routes {
            for (provider_id, route) in providers {
                let next = Destination::of(cfg, node_id, provider_id);
                let mut current = route
                    .destination
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                if *current != next {
                    *current = next;
                    changed += 1;
                }
            }
        }
        changed
    }

    /// The issuer's key id (lowercase hex blake3 of its public key).
    pub fn issuer_key_id(&self) -> String {
        lease::issuer_key_id(&self.issuer.verifying_key())
    }

    /// The issuer public key in config form, `ed25519:<hex>`, for node.toml.
    pub fn issuer_public_key(&self) -> String {
        keys::encode_issuer_public_key(&self.issuer.verifying_key())
    }

    /// Lifetime of issued leases.
    pub fn lease_ttl_ms(&self) -> u64 {
        self.lease_ttl_ms
    }

    /// `CredentialLeaseBinding.projection_generation` of `generation` of
    /// `node_id`: a keyed blake3 hash under this process's projection key,
    /// so the wire learns nothing of the generation (R5) — not its value,
    /// not its order, not whether two leases share it across Edge restarts
    /// — while this Edge can recompute and check it
    /// ([`CredentialPlane::is_projection_of`]).
    pub fn projection(&self, node_id: &str, generation: u64) -> u64 {
        let mut hasher = blake3::Hasher::new_keyed(&self.projection_key);
        hasher.update(b"iop-projection-generation-v1");
        hasher.update(&(node_id.len() as u64).to_be_bytes());
        hasher.update(node_id.as_bytes());
        hasher.update(&generation.to_be_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
        u64::from_be_bytes(first)
    }

    /// True when `projection` is [`CredentialPlane::projection`] of
    /// `generation` of `node_id`: a binding issued by this process for that
    /// connection generation.
    pub fn is_projection_of(&self, projection: u64, node_id: &str, generation: u64) -> bool {
        self.projection(node_id, generation) == projection
    }

    fn route(&self, req: &LeaseRequest<'_>) -> Option<&ProviderRoute> {
        self.routes
            .get(req.node_id)
            .and_then(|providers| providers.get(req.provider_id))
    }

    /// The exact binding for `req`, with the slot it draws on: `Ok(None)`
    /// when no slot serves the provider (the tunnel carries no lease).
    fn plan(&self, req: &LeaseRequest<'_>) -> Result<Option<Plan<'_>>, CredentialError> {
        let Some(route) = self.route(req) else {
            return Ok(None);
        };
        let Some(slot) = self.slots.get(route.slot) else {
            return Ok(None);
        };
        if !slot.enabled {
            return Err(CredentialError::SlotDisabled {
                slot: slot.name.clone(),
            });
        }
        if slot.revoked {
            return Err(CredentialError::RevisionRevoked {
                slot: slot.name.clone(),
                revision: slot.revision,
            });
        }
        let recipient =
            self.recipients
                .get(req.node_id)
                .ok_or_else(|| CredentialError::NoRecipientKey {
                    node: req.node_id.to_owned(),
                })?;
        let no_destination = || CredentialError::NoDestination {
            provider: format!("{}/{}", req.node_id, req.provider_id),
        };
        let tunnel = req.tunnel;
        let (profile, origin, provider_trust, path) = {
            let destination = route
                .destination
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            let destination = destination.as_ref().ok_or_else(no_destination)?;
            let path = destination
                .request_path(tunnel)
                .ok_or_else(no_destination)?;
            (
                destination.profile,
                destination.origin.clone(),
                destination.provider_trust,
                path,
            )
        };
        // The method the Node uses (POST when the request names none).
        let method = if tunnel.method.is_empty() {
            "POST"
        } else {
            tunnel.method.as_str()
        };
        let request_digest = lease::request_digest(&BoundRequest {
            method,
            path: &path,
            headers: &tunnel.headers,
            body: req.body.parts(),
        });
        let binding = CredentialLeaseBinding {
            principal: req.principal.to_owned(),
            slot: slot.name.clone(),
            route: req.route.to_owned(),
            profile: profile.to_owned(),
            upstream_target: lease::upstream_target(&tunnel.adapter, &tunnel.target),
            selected_node: req.node_id.to_owned(),
            recipient: recipient.key_id.clone(),
            credential_revision: slot.revision,
            route_revision: ROUTE_REVISION,
            projection_generation: self.projection(req.node_id, req.generation),
            upstream_origin: origin,
            run_id: tunnel.run_id.clone(),
            request_digest: Bytes::copy_from_slice(&request_digest),
            provider_trust: Bytes::copy_from_slice(&provider_trust),
        };
        Ok(Some(Plan {
            binding,
            slot,
            recipient,
        }))
    }

    /// True when the provider `node_id/provider_id` is served by a slot.
    pub fn is_managed(&self, node_id: &str, provider_id: &str) -> bool {
        self.routes
            .get(node_id)
            .is_some_and(|providers| providers.contains_key(provider_id))
    }

    /// Issues the lease for `req` (C1): `Ok(None)` when no slot serves the
    /// provider; an error (and no lease) for a disabled slot, a revoked
    /// revision or a request without a destination (C3). Valid from
    /// `now_unix_ms` for the lease TTL; takes the node's next sequence
    /// number. Pure but for that counter.
    pub fn issue(
        &self,
        req: &LeaseRequest<'_>,
        now_unix_ms: i64,
        lease_id: &str,
        entropy: LeaseEntropy,
    ) -> Result<Option<IssuedLease>, CredentialError> {
        let Some(plan) = self.plan(req)? else {
            return Ok(None);
        };
        self.seal(plan, now_unix_ms, lease_id, entropy).map(Some)
    }

    /// [`CredentialPlane::issue`] now, with a fresh random lease id and
    /// fresh randomness (drawn only when a lease is needed).
    pub fn issue_now(
        &self,
        req: &LeaseRequest<'_>,
    ) -> Result<Option<IssuedLease>, CredentialError> {
        let Some(plan) = self.plan(req)? else {
            return Ok(None);
        };
        let lease_id = keys::random_lease_id().map_err(|_| CredentialError::Random)?;
        let entropy = keys::lease_entropy().map_err(|_| CredentialError::Random)?;
        self.seal(plan, iop_engine::clock::unix_ms(), &lease_id, entropy)
            .map(Some)
    }

    fn seal(
        &self,
        plan: Plan<'_>,
        now_unix_ms: i64,
        lease_id: &str,
        entropy: LeaseEntropy,
    ) -> Result<IssuedLease, CredentialError> {
        let Plan {
            binding,
            slot,
            recipient,
        } = plan;
        let ttl_ms = i64::try_from(self.lease_ttl_ms).unwrap_or(i64::MAX);
        // Taken last, right before sealing: issue order is sequence order.
        let sequence = recipient.next_sequence.fetch_add(1, Ordering::Relaxed);
        let params = IssueParams {
            lease_id,
            sequence,
            binding: &binding,
            secret: &slot.secret,
            header_name: &slot.header_name,
            header_format: &slot.header_format,
            not_before_unix_ms: now_unix_ms,
            expires_at_unix_ms: now_unix_ms.saturating_add(ttl_ms),
        };
        let lease = lease::issue(&params, &self.issuer, &recipient.key, entropy)?;
        Ok(IssuedLease { lease, binding })
    }
}

/// Reads a slot secret file: refused when group/world-accessible, at most
/// [`MAX_SECRET_BYTES`] after one trailing newline is dropped, visible
/// ASCII, space and tab only. The reason never contains the contents.
fn read_secret_file(path: &Path) -> Result<Zeroizing<Vec<u8>>, String> {
    let (file, meta) = open_regular_file(path)?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{} has mode {mode:04o}; a secret file must not be accessible to group or others \
             (chmod 600)",
            path.display()
        ));
    }
    // Allocated once at the cap so reading never reallocates (no stray copies).
    let cap = MAX_SECRET_BYTES + 2;
    let mut raw = Zeroizing::new(Vec::with_capacity(cap + 1));
    file.take(cap as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if raw.ends_with(b"\n") {
        raw.pop();
        if raw.ends_with(b"\r") {
            raw.pop();
        }
    }
    check_secret(&raw).map_err(|why| format!("{}: {why}", path.display()))?;
    Ok(raw)
}

/// Reads a slot secret from the environment variable `name`.
fn read_secret_env(
    name: &str,
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Zeroizing<Vec<u8>>, String> {
    let value = env(name).ok_or_else(|| format!("environment variable {name} is not set"))?;
    let value = Zeroizing::new(value.into_vec());
    check_secret(&value).map_err(|why| format!("environment variable {name}: {why}"))?;
    Ok(value)
}

/// A secret usable as (part of) a header value.
fn check_secret(secret: &[u8]) -> Result<(), String> {
    if secret.is_empty() {
        return Err("the secret is empty".to_owned());
    }
    if secret.len() > MAX_SECRET_BYTES {
        return Err(format!(
            "the secret is longer than {MAX_SECRET_BYTES} bytes"
        ));
    }
    if !secret
        .iter()
        .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b))
    {
        return Err(
            "the secret must be visible ASCII, space or tab (it becomes a header value)".to_owned(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use bytes::Bytes;
    use std::sync::LazyLock;

    use iop_wire::lease::{
        binding_digest, open, request_digest, ExpectedScope, OpenContext, OriginPins, RecipientKey,
        ReplayGuard,
    };
    use x25519_dalek::StaticSecret;

    use super::*;

    const SECRET: &[u8] = b"sk-edge-unit-secret-42";
    const NOW_MS: i64 = 1_700_000_000_000;
    const RECIPIENT_SEED: [u8; 32] = [9; 32];

    fn recipient() -> RecipientKey {
        RecipientKey::from_secret(StaticSecret::from(RECIPIENT_SEED))
    }

    fn config(slot_extra: &str) -> EdgeConfig {
        match EdgeConfig::parse(&config_text(slot_extra), "conf/edge.toml") {
            Ok(cfg) => cfg,
            Err(e) => panic!("{e}"),
        }
    }

    fn config_text(slot_extra: &str) -> String {
        let recipient = keys::encode_recipient_public_key(&recipient().public_key());
        format!(
            r#"
[edge]
name = "edge-1"
trust_domain = "iop.local"
client_listen = "127.0.0.1:0"
node_listen = "127.0.0.1:0"

[tls]
ca = "ca.pem"
cert = "edge.pem"
key = "edge-key.pem"

[credentials]
issuer_key = "issuer.key"
lease_ttl_ms = 20000

[[credentials.slots]]
name = "openai-main"
secret_env = "OPENAI_KEY"
header = "x-api-key"
format = "{{secret}}"
revision = 3
providers = ["node-a/gpt"]
{slot_extra}

[[nodes]]
id = "node-a"
recipient_key = "{recipient}"

[[nodes.adapters]]
name = "openai"
kind = "openai_compat"
profile = "vllm"
base_url = "http://127.0.0.1:9"

[[nodes.adapters]]
kind = "ollama"
base_url = "http://127.0.0.1:10"

[[nodes.providers]]
id = "gpt"
adapter = "openai"
target = "gpt-4o"
capacity = 2

[[nodes.providers]]
id = "local"
adapter = "ollama"
target = "qwen"
capacity = 1

[[nodes]]
id = "node-b"

[[nodes.adapters]]
name = "openai"
kind = "openai_compat"
base_url = "http://127.0.0.1:11"

[[nodes.providers]]
id = "gpt"
adapter = "openai"
target = "gpt-4o"
capacity = 2

[[models]]
name = "gpt-x"
providers = ["node-a/gpt", "node-b/gpt"]
"#
        )
    }

    fn plane_of(cfg: &EdgeConfig) -> CredentialPlane {
        CredentialPlane::from_parts(
            cfg,
            SigningKey::from_bytes(&[7; 32]),
            vec![Zeroizing::new(SECRET.to_vec())],
            Zeroizing::new([4; 32]),
        )
    }

    fn plane(slot_extra: &str) -> CredentialPlane {
        plane_of(&config(slot_extra))
    }

    /// The tunnel request the leases of these tests ride on.
    static TUNNEL: LazyLock<pb::ProviderTunnelRequest> =
        LazyLock::new(|| pb::ProviderTunnelRequest {
            run_id: "run-7".into(),
            adapter: "openai".into(),
            target: "gpt-4o".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            operation: "chat_completions".into(),
            headers: vec![pb::Header {
                name: "content-type".into(),
                value: Bytes::from_static(b"application/json"),
            }],
            ..Default::default()
        });

    /// The body [`TUNNEL`] carries, in the pieces a spliced body is sent in.
    static TUNNEL_BODY: LazyLock<BodyParts> = LazyLock::new(|| {
        BodyParts::spliced(
            Bytes::from_static(br#"{"model":"#),
            Bytes::from_static(br#""gpt-4o""#),
            Bytes::from_static(br#","messages":[]}"#),
        )
    });

    /// [`request_digest`] of [`TUNNEL`] sent to `path`.
    fn tunnel_digest(path: &str) -> [u8; 32] {
        request_digest(&BoundRequest {
            method: "POST",
            path,
            headers: &TUNNEL.headers,
            body: &[Bytes::from_static(br#"{"model":"gpt-4o","messages":[]}"#)],
        })
    }

    fn request_for<'a>(
        node_id: &'a str,
        provider_id: &'a str,
        tunnel: &'a pb::ProviderTunnelRequest,
    ) -> LeaseRequest<'a> {
        LeaseRequest {
            principal: "team-a",
            route: "gpt-x",
            node_id,
            provider_id,
            generation: 6,
            tunnel,
            body: &TUNNEL_BODY,
        }
    }

    fn request<'a>(node_id: &'a str, provider_id: &'a str) -> LeaseRequest<'a> {
        request_for(node_id, provider_id, &TUNNEL)
    }

    fn entropy() -> LeaseEntropy {
        LeaseEntropy::from_seed([1; 32])
    }

    fn issued(plane: &CredentialPlane, req: &LeaseRequest<'_>) -> IssuedLease {
        match plane.issue(req, NOW_MS, "lease-1", entropy()) {
            Ok(Some(issued)) => issued,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    /// The provider trust of node-a's `openai` adapter (plain HTTP).
    static PLAIN_HTTP: LazyLock<[u8; 32]> =
        LazyLock::new(|| lease::provider_trust_digest(&ProviderTrust::PlainHttp));

    /// What node-a expects of [`TUNNEL`] (the scope it computes itself),
    /// with the Edge-only fields left to the signature.
    fn node_scope(digest: &[u8; 32]) -> ExpectedScope<'_> {
        ExpectedScope::computed_by_node(
            "node-a",
            "openai/gpt-4o",
            "http://127.0.0.1:9",
            &PLAIN_HTTP,
            "run-7",
            digest,
            Some("vllm"),
        )
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    // CONTRACT: C1 — after selection the Edge binds the exact scope
    // (principal, slot, route, profile, upstream target, node, recipient,
    // credential/route revision, projection generation), where the secret
    // goes (the adapter's origin) and the one request it serves (run id,
    // digest of method, path, headers and body); it signs it and seals the
    // secret to the node's recipient key; the node opens it.
    #[test]
    fn issue_binds_the_exact_scope() {
        let plane = plane("");
        assert!(plane.is_managed("node-a", "gpt"));
        let issued = issued(&plane, &request("node-a", "gpt"));
        let recipient = recipient();
        let digest = tunnel_digest("/v1/chat/completions");
        let expected = CredentialLeaseBinding {
            principal: "team-a".into(),
            slot: "openai-main".into(),
            route: "gpt-x".into(),
            profile: "vllm".into(),
            upstream_target: "openai/gpt-4o".into(),
            selected_node: "node-a".into(),
            recipient: recipient.key_id().into(),
            credential_revision: 3,
            route_revision: 1,
            projection_generation: plane.projection("node-a", 6),
            upstream_origin: "http://127.0.0.1:9".into(),
            run_id: "run-7".into(),
            request_digest: Bytes::copy_from_slice(&digest),
            provider_trust: Bytes::copy_from_slice(&PLAIN_HTTP[..]),
        };
        assert_eq!(issued.binding, expected);
        let lease = &issued.lease;
        assert_eq!(lease.lease_id, "lease-1");
        assert_eq!(lease.sequence, 1);
        assert_eq!(lease.not_before_unix_ms, NOW_MS);
        assert_eq!(lease.expires_at_unix_ms, NOW_MS + 20_000);
        assert_eq!(lease.header_name, "x-api-key");
        assert_eq!(lease.header_format, "{secret}");
        assert_eq!(lease.issuer_key_id, plane.issuer_key_id());
        assert_eq!(&lease.binding_digest[..], &binding_digest(&expected)[..]);
        // CONTRACT: C4 — the plaintext is only inside the sealed blob.
        assert!(!contains(&lease.sealed_secret, SECRET));
        let verifying = SigningKey::from_bytes(&[7; 32]).verifying_key();
        let ctx = OpenContext {
            recipient: &recipient,
            issuer: &verifying,
            scope: ExpectedScope {
                principal: Some("team-a"),
                slot: Some("openai-main"),
                route: Some("gpt-x"),
                credential_revision: Some(3),
                route_revision: Some(1),
                projection_generation: Some(plane.projection("node-a", 6)),
                ..node_scope(&digest)
            },
            revoked: &[],
            origin_pins: &OriginPins::new(),
            now_unix_ms: NOW_MS + 1,
            clock_skew_ms: 0,
        };
        let mut replay = ReplayGuard::new(NOW_MS);
        let opened = open(Some(lease), Some(&issued.binding), &ctx, &mut replay)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opened.secret_bytes(), SECRET);
        assert_eq!(
            plane.issuer_public_key(),
            keys::encode_issuer_public_key(&verifying)
        );
    }

    // CONTRACT: C1, R5 — the projection of a connection generation is a
    // keyed hash: the same (node, generation) gives the same value in one
    // process, anything else — another generation, node or process — gives
    // another, and only the issuing plane can check it.
    #[test]
    fn projection_generation_is_opaque_and_checked_by_its_edge() {
        let plane = plane("");
        let p = plane.projection("node-a", 6);
        assert_eq!(p, plane.projection("node-a", 6));
        assert!(plane.is_projection_of(p, "node-a", 6));
        assert_ne!(p, 6);
        for (node, generation) in [("node-a", 7), ("node-a", 5), ("node-b", 6)] {
            assert!(
                !plane.is_projection_of(p, node, generation),
                "{node} {generation}"
            );
        }
        // A restarted Edge (another projection key) never repeats it, even
        // though its generations start again at 1.
        let restarted = CredentialPlane::from_parts(
            &config(""),
            SigningKey::from_bytes(&[7; 32]),
            vec![Zeroizing::new(SECRET.to_vec())],
            Zeroizing::new([5; 32]),
        );
        assert!(!restarted.is_projection_of(p, "node-a", 6));
        // Consecutive generations leave no visible order.
        let values: Vec<u64> = (1..=4).map(|g| plane.projection("node-a", g)).collect();
        let mut sorted = values.clone();
        sorted.sort_unstable();
        assert_ne!(values, sorted, "{values:?}");
    }

    // CONTRACT: C1 — every lease of a node takes the next sequence number,
    // the Node's replay window key; a request the destination has no path
    // for gets no lease (fail closed).
    #[test]
    fn leases_are_numbered_per_node_and_need_a_destination() {
        let plane = plane("");
        let sequences: Vec<u64> = (0..3)
            .map(|_| issued(&plane, &request("node-a", "gpt")).lease.sequence)
            .collect();
        assert_eq!(sequences, [1, 2, 3]);
        let unknown = pb::ProviderTunnelRequest {
            operation: "embeddings".into(),
            ..TUNNEL.clone()
        };
        assert_eq!(
            plane
                .issue(
                    &request_for("node-a", "gpt", &unknown),
                    NOW_MS,
                    "l",
                    entropy()
                )
                .map(|_| ()),
            Err(CredentialError::NoDestination {
                provider: "node-a/gpt".into()
            })
        );
        // The failed request took no sequence number.
        assert_eq!(issued(&plane, &request("node-a", "gpt")).lease.sequence, 4);
        // Without an operation the tunnel's path is the request target (U3).
        let by_path = pb::ProviderTunnelRequest {
            operation: String::new(),
            path: "v1/custom".into(),
            ..TUNNEL.clone()
        };
        let issued = plane
            .issue(
                &request_for("node-a", "gpt", &by_path),
                NOW_MS,
                "l",
                entropy(),
            )
            .expect("issues")
            .expect("a lease");
        assert_eq!(
            &issued.binding.request_digest[..],
            &tunnel_digest("/v1/custom")[..]
        );
    }

    // CONTRACT: C1 — after a reload moves an adapter, the leases issued
    // from then on are bound to its new origin and profile paths.
    #[test]
    fn reloaded_destinations_are_bound_from_then_on() {
        let plane = plane("");
        assert_eq!(plane.apply_config(&config("")), 0);
        let text = "base_url = \"http://127.0.0.1:9\"";
        let moved = EdgeConfig::parse(
            &config_text("").replace(text, "base_url = \"http://10.1.1.1:8001/gw\""),
            "conf/edge.toml",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plane.apply_config(&moved), 1);
        let issued = issued(&plane, &request("node-a", "gpt"));
        assert_eq!(issued.binding.upstream_origin, "http://10.1.1.1:8001");
        assert_eq!(
            &issued.binding.request_digest[..],
            &tunnel_digest("/gw/v1/chat/completions")[..]
        );
    }

    /// [`config_text`] with node-a's `openai` adapter on `https://` and
    /// `ca_pem` as its CA bundle (what [`EdgeConfig::load`] reads from its
    /// `ca_file`; `None`: the Node's default roots).
    fn https_config(ca_pem: Option<String>) -> EdgeConfig {
        let text = config_text("").replace(
            "base_url = \"http://127.0.0.1:9\"",
            "base_url = \"https://127.0.0.1:9\"",
        );
        let mut cfg = EdgeConfig::parse(&text, "conf/edge.toml").unwrap_or_else(|e| panic!("{e}"));
        cfg.nodes[0].adapters[0].tls.ca_pem = ca_pem;
        cfg
    }

    /// The provider trust a Node computes from the client it builds for
    /// `pushed` (its `AdapterConfig.tls`): the anchors of the client itself.
    fn trust_of_client(pushed: Option<String>) -> [u8; 32] {
        let client = iop_engine::tls::UpstreamTls::new(&UpstreamTlsSettings {
            ca_pem: pushed,
            insecure_skip_verify: false,
        })
        .expect("client");
        let trust = match client.private_ca() {
            Some(certs) => ProviderTrust::PrivateCa(certs.iter().map(|c| c.as_ref()).collect()),
            None => ProviderTrust::DefaultRoots,
        };
        lease::provider_trust_digest(&trust)
    }

    // CONTRACT: C1, C5 — a lease is bound to whom the Node will trust to be
    // the provider: the private CA the Edge pushes (the same digest the Node
    // computes from the client it builds), or the Node's default roots
    // without one. A reload that changes the CA binds the leases issued
    // from then on to the new one; a reload that only reorders the bundle
    // changes nothing.
    #[test]
    fn leases_are_bound_to_the_provider_trust_and_follow_reloads() {
        let ca_a = iop_engine::certs::DevCa::new("provider.test")
            .expect("CA")
            .cert_pem();
        let ca_b = iop_engine::certs::DevCa::new("provider.test")
            .expect("CA")
            .cert_pem();
        let plane = plane_of(&https_config(Some(ca_a.clone())));
        let trust = |plane: &CredentialPlane| {
            let issued = issued(plane, &request("node-a", "gpt"));
            assert_eq!(issued.binding.upstream_origin, "https://127.0.0.1:9");
            <[u8; 32]>::try_from(&issued.binding.provider_trust[..]).expect("32 bytes")
        };
        let bound_a = trust(&plane);
        assert_eq!(bound_a, trust_of_client(Some(ca_a.clone())));
        assert_ne!(bound_a, *PLAIN_HTTP);
        // The CA file rotated: a SIGHUP reload re-reads it.
        assert_eq!(plane.apply_config(&https_config(Some(ca_b.clone()))), 1);
        let bound_b = trust(&plane);
        assert_eq!(bound_b, trust_of_client(Some(ca_b.clone())));
        assert_ne!(bound_b, bound_a);
        // A bundle of both, in either order and with text around the
        // blocks, is one set of anchors.
        let both = format!("{ca_a}\n{ca_b}");
        assert_eq!(plane.apply_config(&https_config(Some(both.clone()))), 1);
        let bound_both = trust(&plane);
        let reordered = format!("# provider CAs\n\n{ca_b}\n\n{ca_a}\n");
        assert_eq!(plane.apply_config(&https_config(Some(reordered))), 0);
        assert_eq!(trust(&plane), bound_both);
        assert_eq!(bound_both, trust_of_client(Some(both)));
        // Without a private CA: the Node's default roots.
        assert_eq!(plane.apply_config(&https_config(None)), 1);
        assert_eq!(
            trust(&plane),
            lease::provider_trust_digest(&ProviderTrust::DefaultRoots)
        );
        // A bundle that does not parse (only a config never loaded has one)
        // gives no destination: nothing is issued.
        assert_eq!(plane.apply_config(&https_config(Some("no PEM".into()))), 1);
        assert_eq!(
            plane
                .issue(&request("node-a", "gpt"), NOW_MS, "l", entropy())
                .map(|_| ()),
            Err(CredentialError::NoDestination {
                provider: "node-a/gpt".into()
            })
        );
    }

    // CONTRACT: C3 — the revoked revisions of the slots serving a node's
    // providers travel in that node's config payload.
    #[test]
    fn node_payloads_name_the_revoked_revisions() {
        let cfg = config("revoked_revisions = [1, 2]");
        let payload = cfg.node_config_payload(cfg.node("node-a").expect("node-a"), 4);
        assert_eq!(
            payload.revoked_credentials,
            [pb::RevokedCredential {
                slot: "openai-main".into(),
                revisions: vec![1, 2],
            }]
        );
        assert!(payload.credential_leases_required);
        let other = cfg.node_config_payload(cfg.node("node-b").expect("node-b"), 4);
        assert!(other.revoked_credentials.is_empty());
        let none = config("");
        let payload = none.node_config_payload(none.node("node-a").expect("node-a"), 4);
        assert!(payload.revoked_credentials.is_empty());
    }

    // CONTRACT: C3 — a provider no slot serves gets no lease (legacy
    // tunnel), and so does an unknown provider.
    #[test]
    fn provider_without_slot_gets_no_lease() {
        let plane = plane("");
        assert!(!plane.is_managed("node-b", "gpt"));
        assert!(plane
            .issue(&request("node-b", "gpt"), NOW_MS, "l", entropy())
            .expect("no error")
            .is_none());
        assert!(plane
            .issue(&request("node-a", "local"), NOW_MS, "l", entropy())
            .expect("no error")
            .is_none());
        assert!(plane
            .issue_now(&request("node-z", "gpt"))
            .expect("no error")
            .is_none());
    }

    // CONTRACT: C3, C5 — a disabled slot or a revoked revision issues
    // nothing: an error that answers 503 (no provider call, no other slot).
    #[test]
    fn disabled_slot_and_revoked_revision_issue_nothing() {
        let disabled = plane("enabled = false");
        assert_eq!(
            disabled
                .issue(&request("node-a", "gpt"), NOW_MS, "l", entropy())
                .map(|_| ()),
            Err(CredentialError::SlotDisabled {
                slot: "openai-main".into()
            })
        );
        let revoked = plane("revoked_revisions = [2, 3]");
        let err = match revoked.issue_now(&request("node-a", "gpt")) {
            Err(e) => e,
            Ok(other) => panic!("expected an error, got {other:?}"),
        };
        assert_eq!(
            err,
            CredentialError::RevisionRevoked {
                slot: "openai-main".into(),
                revision: 3
            }
        );
        let api = err.api_error();
        assert_eq!(api.status, 503);
        assert_eq!(
            api.body_json(),
            serde_json::json!({"error": {
                "message": "credential slot `openai-main` revision 3 is revoked; the request was \
                            not sent to the provider (no other credential is tried).",
                "type": "server_error",
                "param": null,
                "code": "credential_unavailable",
            }})
        );
        // An earlier revision revoked is no obstacle.
        assert!(plane("revoked_revisions = [1, 2]")
            .issue(&request("node-a", "gpt"), NOW_MS, "l", entropy())
            .expect("issues")
            .is_some());
    }

    // CONTRACT: C1 — every lease gets a fresh id and fresh randomness and
    // lives for the configured TTL.
    #[test]
    fn issue_now_draws_fresh_ids_and_the_clock() {
        let plane = plane("");
        let a = plane
            .issue_now(&request("node-a", "gpt"))
            .expect("issues")
            .expect("a lease");
        let b = plane
            .issue_now(&request("node-a", "gpt"))
            .expect("issues")
            .expect("a lease");
        assert_ne!(a.lease.lease_id, b.lease.lease_id);
        assert_eq!(a.lease.lease_id.len(), 32);
        assert_eq!((a.lease.sequence, b.lease.sequence), (1, 2));
        assert_eq!(
            a.lease.expires_at_unix_ms - a.lease.not_before_unix_ms,
            20_000
        );
        assert_ne!(a.lease.ephemeral_public_key, b.lease.ephemeral_public_key);
    }

    // CONTRACT: C4 — Debug of every secret-holding type is redacted.
    #[test]
    fn debug_never_shows_secrets() {
        let plane = plane("");
        let debug = format!("{plane:?}");
        assert!(!debug.contains("sk-edge"), "{debug}");
        assert!(debug.contains("issuer_key: \"<redacted>\""), "{debug}");
        assert!(debug.contains("projection_key: \"<redacted>\""), "{debug}");
        assert!(!debug.contains("[4, 4"), "{debug}");
        let issued = issued(&plane, &request("node-a", "gpt"));
        let debug = format!("{issued:?}");
        assert!(debug.contains("sealed_secret: \"<redacted>\""), "{debug}");
        assert!(!debug.contains("signature"), "{debug}");
        let keys = ClientKeys::from_config(&[ClientKeySpec {
            principal: "team-a".into(),
            key_hash: hash_client_key(b"k"),
            admin: false,
            metrics: false,
            limits: Default::default(),
            models: None,
        }]);
        assert_eq!(format!("{keys:?}"), "ClientKeys { keys: 1 }");
    }

    // CONTRACT: C4 — the config pushed to a managed node says leases are
    // required and carries no secret.
    #[test]
    fn node_config_payload_carries_no_secret() {
        use prost::Message;
        let cfg = config("");
        let spec = crate::control::control_spec(&cfg);
        assert!(spec.nodes[0].config.credential_leases_required);
        assert!(!spec.nodes[1].config.credential_leases_required);
        for node in &spec.nodes {
            assert!(!contains(&node.config.encode_to_vec(), SECRET));
        }
    }

    fn header(name: &str, value: &str) -> Header {
        Header {
            name: name.into(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        }
    }

    // CONTRACT: C1 — the principal bound into a lease comes from the
    // client's key.
    #[test]
    fn client_keys_map_keys_to_principals() {
        let open = ClientKeys::default();
        assert!(!open.is_enabled());
        let anonymous = Caller {
            principal: ANONYMOUS_PRINCIPAL.into(),
            authority: Authority::Anonymous,
            models: None,
        };
        assert_eq!(open.authenticate(&[], false), Ok(anonymous));
        let spec = |principal: &str, key: &[u8], admin: bool| ClientKeySpec {
            principal: principal.into(),
            key_hash: hash_client_key(key),
            admin,
            metrics: false,
            limits: Default::default(),
            models: None,
        };
        let caller = |principal: &str, admin: bool| {
            Ok(Caller {
                principal: principal.into(),
                authority: Authority::Key {
                    admin,
                    metrics: false,
                },
                models: None,
            })
        };
        let keys = ClientKeys::from_config(&[
            spec("team-a", b"key-a", false),
            spec("team-b", b"key-b", true),
        ]);
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Bearer key-a")], false),
            caller("team-a", false)
        );
        assert_eq!(
            keys.authenticate(&[header("authorization", "bearer  key-b")], false),
            caller("team-b", true)
        );
        assert_eq!(keys.authenticate(&[], false), Err(AuthError::Missing));
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Bearer nope")], false),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Basic key-a")], false),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Bearer ")], false),
            Err(AuthError::Invalid)
        );
        // x-api-key only where the route accepts it (Anthropic).
        assert_eq!(
            keys.authenticate(&[header("x-api-key", "key-b")], false),
            Err(AuthError::Missing)
        );
        assert_eq!(
            keys.authenticate(&[header("x-api-key", "key-b")], true),
            caller("team-b", true)
        );
        assert_eq!(
            client_key_hash_hex(b"key-a"),
            blake3::hash(b"key-a").to_hex().to_string()
        );
    }

    // A replace reaches every clone: a revoked key is refused from the
    // next request on, an added one accepted, a changed scope applied.
    #[test]
    fn replacing_keys_reaches_every_clone() {
        let spec = |principal: &str, key: &[u8], admin: bool| ClientKeySpec {
            principal: principal.into(),
            key_hash: hash_client_key(key),
            admin,
            metrics: false,
            limits: Default::default(),
            models: None,
        };
        let keys = ClientKeys::from_config(&[
            spec("team-a", b"key-a", false),
            spec("team-b", b"key-b", false),
        ]);
        let shard = keys.clone();
        let change = keys.replace(&[
            spec("team-b", b"key-b", true),
            spec("team-c", b"key-c", false),
        ]);
        assert_eq!(
            change,
            KeysChange {
                keys: 2,
                added: 1,
                revoked: 1,
                changed: 1
            }
        );
        let bearer = |key: &str| [header("authorization", &format!("Bearer {key}"))];
        assert_eq!(
            shard.authenticate(&bearer("key-a"), false),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            shard
                .authenticate(&bearer("key-c"), false)
                .map(|c| c.principal),
            Ok("team-c".into())
        );
        assert_eq!(
            shard
                .authenticate(&bearer("key-b"), false)
                .map(|c| c.authority),
            Ok(Authority::Key {
                admin: true,
                metrics: false
            })
        );
        // Removing every key opens the surface again.
        assert_eq!(keys.replace(&[]).revoked, 2);
        assert!(!shard.is_enabled());
        assert_eq!(
            shard
                .authenticate(&bearer("key-b"), false)
                .map(|c| c.authority),
            Ok(Authority::Anonymous)
        );
    }

    // CONTRACT: C1 — no principal, no lease: 401 in the route's shape.
    #[test]
    fn unauthenticated_answers_in_both_shapes() {
        let missing = AuthError::Missing.api_error(false);
        assert_eq!(missing.status, 401);
        assert_eq!(
            missing.body_json(),
            serde_json::json!({"error": {
                "message": "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                "type": "invalid_request_error",
                "param": null,
                "code": null,
            }})
        );
        let invalid = AuthError::Invalid.api_error(true);
        assert_eq!(
            invalid.body_json()["error"]["code"],
            serde_json::json!("invalid_api_key")
        );
        let anthropic: serde_json::Value =
            serde_json::from_slice(&invalid.body_for(crate::api::openai::Surface::Anthropic))
                .expect("json");
        assert_eq!(
            anthropic,
            serde_json::json!({"type": "error", "error": {
                "type": "authentication_error",
                "message": "Incorrect API key provided.",
            }})
        );
    }

    /// A fresh directory under the system temp dir.
    fn temp_dir(tag: &str) -> std::path::PathBuf {
        thread_local!(static NEXT: Cell<u32> = const { Cell::new(0) });
        let n = NEXT.with(|c| {
            c.set(c.get() + 1);
            c.get()
        });
        let dir =
            std::env::temp_dir().join(format!("iop-edge-cred-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    fn write_mode(path: &Path, bytes: &[u8], mode: u32) {
        std::fs::write(path, bytes).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    // CONTRACT: C4 — secrets are read once at startup from a 0600 file or
    // the environment; errors name the key and file, never the contents.
    #[test]
    fn load_reads_the_issuer_key_and_secrets() {
        let dir = temp_dir("load");
        keys::generate_issuer_key(&dir.join("issuer.key")).expect("issuer key");
        let mut cfg = config("");
        cfg.source = dir.join("edge.toml");
        if let Some(c) = cfg.credentials.as_mut() {
            c.issuer_key = dir.join("issuer.key");
        }
        let env = |name: &str| (name == "OPENAI_KEY").then(|| OsString::from("sk-from-env\n"));
        // A newline is not a valid header byte: refused, and not echoed.
        let err = CredentialPlane::load(&cfg, &env).expect_err("newline refused");
        assert_eq!(
            err.to_string(),
            format!(
                "{}: credentials.slots[0].secret_env: environment variable OPENAI_KEY: the secret \
                 must be visible ASCII, space or tab (it becomes a header value)",
                cfg.source.display()
            )
        );
        let env = |name: &str| (name == "OPENAI_KEY").then(|| OsString::from("sk-from-env"));
        let plane = CredentialPlane::load(&cfg, &env)
            .expect("loads")
            .expect("enabled");
        assert!(plane.is_managed("node-a", "gpt"));
        let none = |_: &str| None;
        assert_eq!(
            CredentialPlane::load(&cfg, &none)
                .expect_err("unset")
                .reason(),
            "environment variable OPENAI_KEY is not set"
        );

        let secret = dir.join("secret");
        if let Some(c) = cfg.credentials.as_mut() {
            c.slots[0].secret = SecretSource::File(secret.clone());
        }
        write_mode(&secret, b"sk-from-file\n", 0o640);
        let err = CredentialPlane::load(&cfg, &none).expect_err("group-readable");
        assert_eq!(err.key(), "credentials.slots[0].secret_file");
        assert_eq!(
            err.reason(),
            format!(
                "{} has mode 0640; a secret file must not be accessible to group or others \
                 (chmod 600)",
                secret.display()
            )
        );
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let plane = CredentialPlane::load(&cfg, &none)
            .expect("loads")
            .expect("enabled");
        let issued = plane
            .issue_now(&request("node-a", "gpt"))
            .expect("issues")
            .expect("a lease");
        let recipient = recipient();
        let digest = tunnel_digest("/v1/chat/completions");
        let ctx = OpenContext {
            recipient: &recipient,
            issuer: &keys::load_issuer_key(&dir.join("issuer.key"))
                .expect("issuer")
                .verifying_key(),
            scope: node_scope(&digest),
            revoked: &[],
            origin_pins: &OriginPins::new(),
            now_unix_ms: issued.lease.not_before_unix_ms,
            clock_skew_ms: 0,
        };
        let opened = open(
            Some(&issued.lease),
            Some(&issued.binding),
            &ctx,
            &mut ReplayGuard::new(issued.lease.not_before_unix_ms),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        // One trailing newline dropped.
        assert_eq!(opened.secret_bytes(), b"sk-from-file");

        if let Some(c) = cfg.credentials.as_mut() {
            c.issuer_key = dir.join("missing.key");
        }
        assert_eq!(
            CredentialPlane::load(&cfg, &none)
                .expect_err("no issuer")
                .key(),
            "credentials.issuer_key"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
