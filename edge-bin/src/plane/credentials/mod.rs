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
//! ([`CredentialPlane::load`]) reads the issuer key and every slot secret at
//! startup.
//!
//! # Reloads
//!
//! A plane is never changed in place: a SIGHUP reload builds the next one
//! from the new file ([`RunningPlane::prepare`], nothing applied yet) and
//! swaps it in for every shard at once ([`RunningPlane::commit`]). The next
//! lease any shard issues comes from the new plane; a lease already issued
//! stays what it is.
//!
//! ```text
//!  SIGHUP ─► RunningPlane::prepare(next)
//!              ├─ slots added, removed, enabled, disabled, their revoked
//!              │  revisions, headers and providers, lease_ttl_ms ── from the file
//!              ├─ a slot's secret ── kept while its name, source and revision stay;
//!              │                     read again (secret_file) when one changes;
//!              │                     unreadable ─► the whole reload is refused
//!              ├─ issuer key ── kept (nodes trust its public key from their own
//!              │                config): a new one is reported as needing a restart
//!              ├─ projection key ── kept (projections stay stable, R5)
//!              └─ lease sequence counters ── shared, never restarted (C2 replay)
//!          RunningPlane::commit ─► every shard issues from the new plane
//! ```
//!
//! The environment of a running process does not change (and startup wipes
//! `secret_env` variables from it, C4), so a slot whose secret comes from
//! `secret_env` keeps the value read at startup: a reload that adds such a
//! slot or gives it a new revision is refused; `secret_file` secrets rotate
//! by reload. Turning the plane on or off needs a restart too: the reload
//! keeps the running state (see [`prepare_reload`]).
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
//! `route_revision` is [`ROUTE_REVISION`], fixed at 1: reloads do not number
//! routes (a lease binds its route by name, origin and request instead).
//! `projection_generation` is [`CredentialPlane::projection`] of the
//! connection generation of the selected node's lease in `Control`: a keyed
//! hash, never the generation itself (R5), under a key drawn at startup and
//! kept across reloads.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

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
use crate::config::{
    AdapterKind, AdapterSpec, ConfigError, CredentialsSpec, EdgeConfig, SecretSource, SlotSpec,
};

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

/// A slot with its secret loaded (shared with the planes that follow it
/// while its name, source and revision stay: a reload makes no copy).
struct Slot {
    name: String,
    secret: Arc<Zeroizing<Vec<u8>>>,
    header_name: String,
    header_format: String,
    revision: u64,
    enabled: bool,
    revoked: bool,
}

/// Where a slot-served provider's requests go, as the Node resolves it from
/// the config the Edge pushes (U4): its adapter's profile, origin and
/// provider TLS trust. A reload builds it again from the new file.
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

/// How a slot-served provider is bound: its slot and where its requests go
/// (`None`: nowhere a lease may be bound to, so none is issued).
#[derive(Debug)]
struct ProviderRoute {
    slot: usize,
    destination: Option<Destination>,
}

/// The exact binding of a lease about to be issued, with the slot it draws
/// on, the recipient it is sealed to and its place in the node's sequence.
struct Plan<'a> {
    binding: CredentialLeaseBinding,
    slot: &'a Slot,
    recipient: &'a Recipient,
}

/// A node's recipient key, its key id and its lease sequence counter.
#[derive(Debug)]
struct Recipient {
    key: PublicKey,
    key_id: String,
    /// The node's next lease sequence number, shared with every plane of
    /// this process ([`CredentialPlane::sequences`]).
    next_sequence: Arc<AtomicU64>,
}

/// The loaded credential plane: issuer key, slots with their secrets, which
/// provider each slot serves and where it goes, the nodes' recipient keys,
/// and the key of the generation projection. Immutable: a reload builds the
/// next one ([`CredentialPlane::successor`]).
pub struct CredentialPlane {
    /// The `[credentials]` table it was built from (places, never secrets):
    /// the next reload compares its slots with it.
    spec: CredentialsSpec,
    issuer: Arc<SigningKey>,
    projection_key: Arc<Zeroizing<[u8; 32]>>,
    lease_ttl_ms: u64,
    slots: Vec<Slot>,
    routes: HashMap<String, HashMap<String, ProviderRoute>>,
    recipients: HashMap<String, Recipient>,
    /// The lease sequence counter of every node that had a recipient key
    /// in this process, shared by the planes that follow this one: a
    /// node's numbers keep increasing across reloads, also when it is
    /// removed and added again (the Node refuses a number it has seen,
    /// C2). At most one entry per node id ever configured.
    sequences: HashMap<String, Arc<AtomicU64>>,
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
        let issuer = load_issuer(cfg, credentials)?;
        let mut secrets = Vec::with_capacity(credentials.slots.len());
        for (i, slot) in credentials.slots.iter().enumerate() {
            secrets.push(read_slot_secret(cfg, i, slot, Some(env))?);
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
        let spec = cfg.credentials.clone().unwrap_or_else(|| CredentialsSpec {
            issuer_key: Default::default(),
            lease_ttl_ms: crate::config::DEFAULT_LEASE_TTL_MS,
            slots: Vec::new(),
        });
        Self::build(
            cfg,
            spec,
            Arc::new(issuer),
            secrets.into_iter().map(Arc::new).collect(),
            Arc::new(projection_key),
            HashMap::new(),
        )
    }

    /// The plane of `spec` (whose secrets are `secrets`, in slot order) over
    /// the fleet of `cfg`, with these keys and sequence counters (a node
    /// without one starts at 1).
    fn build(
        cfg: &EdgeConfig,
        spec: CredentialsSpec,
        issuer: Arc<SigningKey>,
        secrets: Vec<Arc<Zeroizing<Vec<u8>>>>,
        projection_key: Arc<Zeroizing<[u8; 32]>>,
        mut sequences: HashMap<String, Arc<AtomicU64>>,
    ) -> Self {
        let slots: Vec<Slot> = spec
            .slots
            .iter()
            .zip(secrets)
            .map(|(slot, secret)| Slot {
                name: slot.name.clone(),
                secret,
                header_name: slot.header_name.clone(),
                header_format: slot.header_format.clone(),
                revision: slot.revision,
                enabled: slot.enabled,
                revoked: slot.revoked_revisions.contains(&slot.revision),
            })
            .collect();
        let mut routes: HashMap<String, HashMap<String, ProviderRoute>> = HashMap::new();
        for (index, slot) in spec.slots.iter().enumerate().take(slots.len()) {
            for provider in &slot.providers {
                routes.entry(provider.node_id.clone()).or_default().insert(
                    provider.provider_id.clone(),
                    ProviderRoute {
                        slot: index,
                        destination: Destination::of(cfg, &provider.node_id, &provider.provider_id),
                    },
                );
            }
        }
        let recipients = cfg
            .nodes
            .iter()
            .filter_map(|n| {
                n.recipient_key.map(|key| {
                    let next_sequence = sequences
                        .entry(n.id.clone())
                        .or_insert_with(|| Arc::new(AtomicU64::new(1)))
                        .clone();
                    let recipient = Recipient {
                        key,
                        key_id: lease::recipient_key_id(&key),
                        next_sequence,
                    };
                    (n.id.clone(), recipient)
                })
            })
            .collect();
        Self {
            lease_ttl_ms: spec.lease_ttl_ms,
            spec,
            issuer,
            projection_key,
            slots,
            routes,
            recipients,
            sequences,
        }
    }

    /// The plane `cfg` describes, following this one (a SIGHUP reload; see
    /// the module docs): its slots, their revisions, revocations, headers
    /// and providers, the lease TTL, the nodes' recipient keys and the
    /// providers' destinations come from `cfg`, while the issuer key, the
    /// projection key and the nodes' sequence counters are this plane's. A
    /// slot keeps its secret while its name, source and revision stay; a
    /// slot that is new or has a new revision or source has its secret
    /// read — from its `secret_file` (a `secret_env` cannot be read again:
    /// refused). A `cfg` without `[credentials]` keeps this plane's slots.
    /// Errors name the file, the key and the reason, never a secret;
    /// nothing changes until the caller puts the result in force.
    pub fn successor(&self, cfg: &EdgeConfig) -> Result<(Self, CredentialsChange), ConfigError> {
        let spec = cfg.credentials.as_ref().unwrap_or(&self.spec);
        let mut change = CredentialsChange {
            slots: spec.slots.len(),
            ..CredentialsChange::default()
        };
        let mut secrets = Vec::with_capacity(spec.slots.len());
        for (i, slot) in spec.slots.iter().enumerate() {
            let running = self.spec.slots.iter().position(|s| s.name == slot.name);
            let kept = running.and_then(|r| {
                let old = &self.spec.slots[r];
                (old.secret == slot.secret && old.revision == slot.revision)
                    .then(|| self.slots.get(r).map(|s| s.secret.clone()))
                    .flatten()
            });
            match (running, &kept) {
                (None, _) => change.added.push(slot.name.clone()),
                (Some(_), None) => change.rotated.push(slot.name.clone()),
                (Some(r), Some(_)) if self.spec.slots[r] != *slot => {
                    change.changed.push(slot.name.clone());
                }
                (Some(_), Some(_)) => {}
            }
            let secret = match kept {
                Some(secret) => secret,
                None => Arc::new(read_slot_secret(cfg, i, slot, None)?),
            };
            secrets.push(secret);
        }
        change.removed = self
            .spec
            .slots
            .iter()
            .filter(|old| !spec.slots.iter().any(|s| s.name == old.name))
            .map(|old| old.name.clone())
            .collect();
        let next = Self::build(
            cfg,
            spec.clone(),
            self.issuer.clone(),
            secrets,
            self.projection_key.clone(),
            self.sequences.clone(),
        );
        Ok((next, change))
    }

    /// True when the issuer key `cfg` names is not this plane's: reads it
    /// (errors name the file, the key and the reason). `false` for a `cfg`
    /// without `[credentials]`.
    pub fn issuer_differs(&self, cfg: &EdgeConfig) -> Result<bool, ConfigError> {
        let Some(credentials) = &cfg.credentials else {
            return Ok(false);
        };
        let named = load_issuer(cfg, credentials)?;
        Ok(named.verifying_key() != self.issuer.verifying_key())
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
            let destination = route.destination.as_ref().ok_or_else(no_destination)?;
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

// ---------------------------------------------------------------------------
// Reloads

/// What a reload changed in the credential slots (names only, never a
/// secret).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CredentialsChange {
    /// Slots now configured.
    pub slots: usize,
    /// Slots added (their secrets read).
    pub added: Vec<String>,
    /// Slots removed: their providers get no lease from now on.
    pub removed: Vec<String>,
    /// Slots with a new revision or secret source: their secrets were read
    /// again.
    pub rotated: Vec<String>,
    /// Slots that kept their secret but changed otherwise: enabled,
    /// revoked revisions, header, format or providers.
    pub changed: Vec<String>,
}

/// A plane built for a reload, not yet in force ([`RunningPlane::commit`]).
pub struct NextPlane {
    plane: CredentialPlane,
    change: CredentialsChange,
    issuer_differs: bool,
}

impl NextPlane {
    /// True when the file names another issuer key than the running one:
    /// the running key keeps signing (the nodes trust its public key from
    /// their own config) until a restart.
    pub fn issuer_differs(&self) -> bool {
        self.issuer_differs
    }
}

impl fmt::Debug for NextPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NextPlane")
            .field("plane", &self.plane)
            .field("change", &self.change)
            .field("issuer_differs", &self.issuer_differs)
            .finish()
    }
}

/// The credential plane in force, shared by every shard (clones share it).
/// A reload builds the next plane ([`RunningPlane::prepare`]) and swaps it
/// in for every shard at once ([`RunningPlane::commit`]); a request takes
/// the plane in force when it issues its lease ([`RunningPlane::get`]).
#[derive(Clone)]
pub struct RunningPlane {
    current: Arc<RwLock<Arc<CredentialPlane>>>,
}

impl fmt::Debug for RunningPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RunningPlane").field(&*self.get()).finish()
    }
}

impl RunningPlane {
    /// Starts at `plane`.
    pub fn new(plane: CredentialPlane) -> Self {
        Self {
            current: Arc::new(RwLock::new(Arc::new(plane))),
        }
    }

    /// The plane in force now.
    pub fn get(&self) -> Arc<CredentialPlane> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Builds the plane `next` describes, following the one in force
    /// ([`CredentialPlane::successor`]), and reads `next`'s issuer key to
    /// compare it with the running one. A file without `[credentials]`
    /// keeps the running slots (the plane turns off only with a restart):
    /// `next` is given the running `[credentials]`, so what the rest of the
    /// reload derives from it (the nodes' config payloads) matches what
    /// runs. Changes nothing in force.
    pub fn prepare(&self, next: &mut EdgeConfig) -> Result<NextPlane, ConfigError> {
        let running = self.get();
        let issuer_differs = running.issuer_differs(next)?;
        if next.credentials.is_none() {
            next.credentials = Some(running.spec.clone());
        }
        let (plane, change) = running.successor(next)?;
        Ok(NextPlane {
            plane,
            change,
            issuer_differs,
        })
    }

    /// Puts `next` in force on every shard: the next lease any of them
    /// issues comes from it. Returns what it changed.
    pub fn commit(&self, next: NextPlane) -> CredentialsChange {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(next.plane);
        next.change
    }
}

/// The credential side of a reload to `next`, prepared before anything
/// applies: with a plane running, the next one ([`RunningPlane::prepare`];
/// an error refuses the whole reload); without one, `next`'s
/// `[credentials]` is dropped (the plane turns on only at start, so nodes
/// are not told to require leases nobody issues) and `None`.
pub fn prepare_reload(
    running: Option<&RunningPlane>,
    next: &mut EdgeConfig,
) -> Result<Option<NextPlane>, ConfigError> {
    match running {
        Some(running) => running.prepare(next).map(Some),
        None => {
            next.credentials = None;
            Ok(None)
        }
    }
}

/// Reads the issuer key `credentials` names.
fn load_issuer(cfg: &EdgeConfig, credentials: &CredentialsSpec) -> Result<SigningKey, ConfigError> {
    keys::load_issuer_key(&credentials.issuer_key)
        .map_err(|e| ConfigError::new(&cfg.source, "credentials.issuer_key", e.to_string()))
}

/// Looks up an environment variable (`std::env::var_os` in the binary).
type EnvLookup<'a> = dyn Fn(&str) -> Option<OsString> + 'a;

/// Reads the secret of `slot`, `credentials.slots[index]` of `cfg`: from
/// its file, or from the environment through `env` (`None` on a reload: the
/// environment was read, and wiped of the secret, at startup).
fn read_slot_secret(
    cfg: &EdgeConfig,
    index: usize,
    slot: &SlotSpec,
    env: Option<&EnvLookup<'_>>,
) -> Result<Zeroizing<Vec<u8>>, ConfigError> {
    match &slot.secret {
        SecretSource::File(path) => read_secret_file(path).map_err(|why| {
            ConfigError::new(
                &cfg.source,
                format!("credentials.slots[{index}].secret_file"),
                why,
            )
        }),
        SecretSource::Env(name) => {
            let read = match env {
                Some(env) => read_secret_env(name, env),
                None => Err(format!(
                    "environment variable {name} is read only at startup (the environment of a \
                     running Edge does not change): a slot that is added, or gets a new revision \
                     or source, with secret_env needs a restart; use secret_file to rotate by \
                     reload"
                )),
            };
            read.map_err(|why| {
                ConfigError::new(
                    &cfg.source,
                    format!("credentials.slots[{index}].secret_env"),
                    why,
                )
            })
        }
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
