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
use std::sync::{PoisonError, RwLock};

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use iop_engine::config::open_regular_file;
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

use crate::api::error::GatewayError;
use crate::config::{AdapterKind, AdapterSpec, ConfigError, EdgeConfig, SecretSource};

/// `CredentialLeaseBinding.route_revision` of every lease (see the module
/// docs).
pub const ROUTE_REVISION: u64 = 1;
/// The error `code` of a request refused because its provider's slot may
/// not issue a lease (503).
pub const CREDENTIAL_UNAVAILABLE: &str = "credential_unavailable";

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
    pub fn api_error(&self) -> GatewayError {
        GatewayError::credential_unavailable(
            format!(
                "{self}; the request was not sent to the provider (no other credential is tried)."
            ),
            CREDENTIAL_UNAVAILABLE,
        )
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
mod tests;
