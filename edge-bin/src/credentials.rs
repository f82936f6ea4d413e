//! The Edge half of the credential plane (C1, C3–C5): client API keys →
//! principals, credential slots, and issuing a sealed lease for a selected
//! provider.
//!
//! ```text
//!  client ─Authorization: Bearer k─► ClientKeys::authenticate ─► principal (401 otherwise)
//!  Control selects (node, provider, generation)
//!      └─► CredentialPlane::issue: slot of that provider? ── none ─► no lease (legacy tunnel)
//!            │ disabled slot / revoked revision ─► CredentialError (503, no provider call,
//!            │                                      no other slot tried: C3, C5)
//!            └─► exact CredentialLeaseBinding ─► iop_wire::lease::issue (sealed to the
//!                node's recipient key, signed by the issuer key) ─► tunnel request
//! ```
//!
//! The decisions are pure: [`CredentialPlane::issue`] takes `now`, the lease
//! id and the randomness as inputs; [`CredentialPlane::issue_now`] is the
//! shell that reads the clock and the OS random source. Loading
//! ([`CredentialPlane::load`]) reads the issuer key and every slot secret once
//! at startup.
//!
//! # Never leaked (C4)
//!
//! Slot secrets live in zeroize-on-drop buffers and the issuer key in a
//! zeroize-on-drop `SigningKey`; every type here that holds one has a
//! hand-written, redacted `Debug` and no `Display`. Errors name slots, files
//! and variables, never contents. An issued lease's `Debug` omits the sealed
//! blob.
//!
//! # Revisions
//!
//! `credential_revision` is the slot's configured `revision`.
//! `route_revision` is [`ROUTE_REVISION`]: routes are static config, so their
//! revision changes only with a restart and is fixed at 1 (a future config
//! refresh would bump it). `projection_generation` is the connection
//! generation of the selected node's lease in `Control`.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use ed25519_dalek::SigningKey;
use iop_engine::config::open_regular_file;
use iop_engine::http::Header;
use iop_engine::keys;
use iop_wire::lease::{self, IssueError, IssueParams, LeaseEntropy, MAX_SECRET_BYTES};
use iop_wire::pb::{CredentialLease, CredentialLeaseBinding};
use x25519_dalek::PublicKey;
use zeroize::Zeroizing;

use crate::config::{AdapterKind, ClientKeySpec, ConfigError, EdgeConfig, SecretSource};
use crate::openai::ApiError;

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
#[derive(Clone, Default)]
pub struct ClientKeys {
    principal_by_hash: HashMap<[u8; 32], String>,
}

impl fmt::Debug for ClientKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientKeys")
            .field("keys", &self.principal_by_hash.len())
            .finish()
    }
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
        Self {
            principal_by_hash: specs
                .iter()
                .map(|k| (k.key_hash, k.principal.clone()))
                .collect(),
        }
    }

    /// True when requests must present a key.
    pub fn is_enabled(&self) -> bool {
        !self.principal_by_hash.is_empty()
    }

    /// The principal of a request with `headers`: [`ANONYMOUS_PRINCIPAL`]
    /// when no keys are configured; otherwise the principal of the key in
    /// `Authorization: Bearer <key>` (or, when `x_api_key`, in
    /// `x-api-key: <key>`).
    pub fn authenticate(&self, headers: &[Header], x_api_key: bool) -> Result<&str, AuthError> {
        if !self.is_enabled() {
            return Ok(ANONYMOUS_PRINCIPAL);
        }
        let bearer = headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("authorization"))
            .map(|h| bearer_token(&h.value));
        let api_key = headers
            .iter()
            .filter(|h| x_api_key && h.name.eq_ignore_ascii_case("x-api-key"))
            .map(|h| Some(&h.value[..]));
        let mut presented = false;
        for candidate in bearer.chain(api_key) {
            presented = true;
            let Some(key) = candidate.filter(|k| !k.is_empty()) else {
                continue;
            };
            if let Some(principal) = self.principal_by_hash.get(&hash_client_key(key)) {
                return Ok(principal);
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

/// What a lease is requested for: the selected provider and the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRequest<'a> {
    /// The authenticated principal.
    pub principal: &'a str,
    /// The route: the external model name the client asked for.
    pub route: &'a str,
    /// The selected node.
    pub node_id: &'a str,
    /// The selected provider on that node.
    pub provider_id: &'a str,
    /// The provider's adapter instance.
    pub adapter: &'a str,
    /// The provider's target.
    pub target: &'a str,
    /// The connection generation the provider lease was taken under.
    pub generation: u64,
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

/// How a slot-served provider is bound.
#[derive(Debug, Clone, Copy)]
struct ProviderRoute {
    slot: usize,
    profile: &'static str,
}

/// The exact binding of a lease about to be issued, with the slot it draws
/// on and the recipient it is sealed to.
struct Plan<'a> {
    binding: CredentialLeaseBinding,
    slot: &'a Slot,
    recipient: &'a Recipient,
}

/// A node's recipient key and its key id.
#[derive(Debug, Clone)]
struct Recipient {
    key: PublicKey,
    key_id: String,
}

/// The loaded credential plane: issuer key, slots with their secrets, which
/// provider each slot serves, and the nodes' recipient keys.
pub struct CredentialPlane {
    issuer: SigningKey,
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
            .field("lease_ttl_ms", &self.lease_ttl_ms)
            .field("slots", &slots)
            .field("managed_nodes", &self.recipients.len())
            .finish()
    }
}

impl CredentialPlane {
    /// Reads the issuer key and every slot secret of `cfg` (`None` when the
    /// credential plane is disabled). `env` looks up environment variables
    /// (`std::env::var_os` in the binary). Errors name the config key and
    /// the reason, never a secret.
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
        Ok(Some(Self::from_parts(cfg, issuer, secrets)))
    }

    /// Builds the plane from `cfg`'s credential config, the issuer key and
    /// the slot secrets (in slot order). Pure; [`CredentialPlane::load`]
    /// reads the inputs. A disabled credential plane gives a plane without
    /// slots.
    pub fn from_parts(
        cfg: &EdgeConfig,
        issuer: SigningKey,
        secrets: Vec<Zeroizing<Vec<u8>>>,
    ) -> Self {
        let specs = cfg.credentials.as_ref();
        let slots: Vec<Slot> = specs
            .map(|c| c.slots.as_slice())
            .unwrap_or_default()
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
        for (index, spec) in specs
            .map(|c| c.slots.as_slice())
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            if index >= slots.len() {
                break;
            }
            for provider in &spec.providers {
                let profile = cfg
                    .node(&provider.node_id)
                    .and_then(|n| {
                        n.provider(&provider.provider_id)
                            .and_then(|p| n.adapter(&p.adapter))
                    })
                    .and_then(|a| match a.kind {
                        AdapterKind::OpenAiCompat { profile } => Some(profile.as_str()),
                        AdapterKind::Ollama => None,
                    });
                if let Some(profile) = profile {
                    routes.entry(provider.node_id.clone()).or_default().insert(
                        provider.provider_id.clone(),
                        ProviderRoute {
                            slot: index,
                            profile,
                        },
                    );
                }
            }
        }
        let recipients = cfg
            .nodes
            .iter()
            .filter_map(|n| {
                n.recipient_key.map(|key| {
                    let key_id = lease::recipient_key_id(&key);
                    (n.id.clone(), Recipient { key, key_id })
                })
            })
            .collect();
        Self {
            issuer,
            lease_ttl_ms: specs.map_or(crate::config::DEFAULT_LEASE_TTL_MS, |c| c.lease_ttl_ms),
            slots,
            routes,
            recipients,
        }
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

    /// The exact binding for `req`, with the slot it draws on: `Ok(None)`
    /// when no slot serves the provider (the tunnel carries no lease).
    fn plan(&self, req: &LeaseRequest<'_>) -> Result<Option<Plan<'_>>, CredentialError> {
        let Some(route) = self
            .routes
            .get(req.node_id)
            .and_then(|providers| providers.get(req.provider_id))
        else {
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
        let binding = CredentialLeaseBinding {
            principal: req.principal.to_owned(),
            slot: slot.name.clone(),
            route: req.route.to_owned(),
            profile: route.profile.to_owned(),
            upstream_target: lease::upstream_target(req.adapter, req.target),
            selected_node: req.node_id.to_owned(),
            recipient: recipient.key_id.clone(),
            credential_revision: slot.revision,
            route_revision: ROUTE_REVISION,
            projection_generation: req.generation,
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
    /// provider; an error (and no lease) for a disabled slot or a revoked
    /// revision (C3). Valid from `now_unix_ms` for the lease TTL. Pure.
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
        let params = IssueParams {
            lease_id,
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
    use iop_wire::lease::{
        binding_digest, open, ExpectedScope, OpenContext, RecipientKey, ReplayCache,
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
        let recipient = keys::encode_recipient_public_key(&recipient().public_key());
        let text = format!(
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
        );
        match EdgeConfig::parse(&text, "conf/edge.toml") {
            Ok(cfg) => cfg,
            Err(e) => panic!("{e}"),
        }
    }

    fn plane(slot_extra: &str) -> CredentialPlane {
        CredentialPlane::from_parts(
            &config(slot_extra),
            SigningKey::from_bytes(&[7; 32]),
            vec![Zeroizing::new(SECRET.to_vec())],
        )
    }

    fn request<'a>(node_id: &'a str, provider_id: &'a str) -> LeaseRequest<'a> {
        LeaseRequest {
            principal: "team-a",
            route: "gpt-x",
            node_id,
            provider_id,
            adapter: "openai",
            target: "gpt-4o",
            generation: 6,
        }
    }

    fn entropy() -> LeaseEntropy {
        LeaseEntropy::from_bytes([1; 32], [2; 12])
    }

    fn issued(plane: &CredentialPlane, req: &LeaseRequest<'_>) -> IssuedLease {
        match plane.issue(req, NOW_MS, "lease-1", entropy()) {
            Ok(Some(issued)) => issued,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    // CONTRACT: C1 — after selection the Edge binds the exact scope
    // (principal, slot, route, profile, upstream target, node, recipient,
    // credential/route revision, projection generation), signs it and seals
    // the secret to the node's recipient key; the node opens it.
    #[test]
    fn issue_binds_the_exact_scope() {
        let plane = plane("");
        assert!(plane.is_managed("node-a", "gpt"));
        let issued = issued(&plane, &request("node-a", "gpt"));
        let recipient = recipient();
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
            projection_generation: 6,
        };
        assert_eq!(issued.binding, expected);
        let lease = &issued.lease;
        assert_eq!(lease.lease_id, "lease-1");
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
                selected_node: "node-a",
                upstream_target: "openai/gpt-4o",
                profile: Some("vllm"),
                principal: Some("team-a"),
                slot: Some("openai-main"),
                route: Some("gpt-x"),
                credential_revision: Some(3),
                route_revision: Some(1),
                projection_generation: Some(6),
            },
            now_unix_ms: NOW_MS + 1,
            clock_skew_ms: 0,
        };
        let mut replay = ReplayCache::new(4);
        let opened = open(Some(lease), Some(&issued.binding), &ctx, &mut replay)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opened.secret_bytes(), SECRET);
        assert_eq!(
            plane.issuer_public_key(),
            keys::encode_issuer_public_key(&verifying)
        );
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
        let issued = issued(&plane, &request("node-a", "gpt"));
        let debug = format!("{issued:?}");
        assert!(debug.contains("sealed_secret: \"<redacted>\""), "{debug}");
        assert!(!debug.contains("signature"), "{debug}");
        let keys = ClientKeys::from_config(&[ClientKeySpec {
            principal: "team-a".into(),
            key_hash: hash_client_key(b"k"),
        }]);
        assert_eq!(format!("{keys:?}"), "ClientKeys { keys: 1 }");
    }

    // CONTRACT: C4 — the config pushed to a managed node says leases are
    // required and carries no secret.
    #[test]
    fn node_config_payload_carries_no_secret() {
        use prost::Message;
        let cfg = config("");
        let spec = crate::server::control_spec(&cfg);
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
        assert_eq!(open.authenticate(&[], false), Ok(ANONYMOUS_PRINCIPAL));
        let keys = ClientKeys::from_config(&[
            ClientKeySpec {
                principal: "team-a".into(),
                key_hash: hash_client_key(b"key-a"),
            },
            ClientKeySpec {
                principal: "team-b".into(),
                key_hash: hash_client_key(b"key-b"),
            },
        ]);
        assert_eq!(
            keys.authenticate(&[header("Authorization", "Bearer key-a")], false),
            Ok("team-a")
        );
        assert_eq!(
            keys.authenticate(&[header("authorization", "bearer  key-b")], false),
            Ok("team-b")
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
            Ok("team-b")
        );
        assert_eq!(
            client_key_hash_hex(b"key-a"),
            blake3::hash(b"key-a").to_hex().to_string()
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
            serde_json::from_slice(&invalid.body_for(crate::openai::Surface::Anthropic))
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
        let ctx = OpenContext {
            recipient: &recipient,
            issuer: &keys::load_issuer_key(&dir.join("issuer.key"))
                .expect("issuer")
                .verifying_key(),
            scope: ExpectedScope {
                selected_node: "node-a",
                upstream_target: "openai/gpt-4o",
                profile: None,
                principal: None,
                slot: None,
                route: None,
                credential_revision: None,
                route_revision: None,
                projection_generation: None,
            },
            now_unix_ms: issued.lease.not_before_unix_ms,
            clock_skew_ms: 0,
        };
        let opened = open(
            Some(&issued.lease),
            Some(&issued.binding),
            &ctx,
            &mut ReplayCache::new(1),
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
