//! The Node half of the credential plane (C2, C3, C5): the recipient key,
//! the Edge issuer's public key, the replay cache, and the per-tunnel lease
//! decision.
//!
//! ```text
//!  tunnel request ─► W1, adapter, path, capacity gate (P4) ─► LeaseGate::open
//!        managed (own [credentials] or payload.credential_leases_required)?
//!          no, and no lease ─────────────────────────────► provider call without credential
//!          lease, but no recipient key here ─────────────► ERROR lease_invalid
//!          otherwise iop_wire::lease::open: signature, digest, scope (node,
//!          upstream target, profile), recipient, window ± skew, replay
//!            ├─ failure ─► ERROR lease_missing | lease_invalid | lease_expired |
//!            │             lease_replayed | lease_scope_mismatch (no provider call)
//!            └─ OpenedSecret ─► header injected into the request head in memory,
//!                               dropped (zeroized) once the head is written
//! ```
//!
//! The decision ([`LeaseGate::open`]) is pure: `now` comes in. The replay
//! cache belongs to the Node process (it outlives sessions), so a lease
//! replayed over a new connection is still caught. Nothing here is logged
//! or cached beyond one request (C4, C5); every secret-holding type has a
//! redacted `Debug`.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

use ed25519_dalek::VerifyingKey;
use iop_engine::keys;
use iop_wire::lease::{
    self, ExpectedScope, LeaseError, OpenContext, OpenedSecret, RecipientKey, ReplayCache,
};
use iop_wire::pb;

use crate::config::{ConfigError, CredentialsSpec, NodeConfig};

/// Lease ids the replay cache holds at most. Entries leave when their lease
/// expires (at most ten minutes plus skew); a full cache rejects new leases
/// (`lease_replayed`, fail closed) instead of forgetting one.
pub const REPLAY_CACHE_ENTRIES: usize = 65_536;

/// The loaded credential plane of a managed Node.
pub struct NodeCredentials {
    recipient: RecipientKey,
    issuer: VerifyingKey,
    clock_skew_ms: u32,
    replay: RefCell<ReplayCache>,
}

impl fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeCredentials")
            .field("recipient_key_id", &self.recipient.key_id())
            .field("recipient_key", &"<redacted>")
            .field("issuer_key_id", &lease::issuer_key_id(&self.issuer))
            .field("clock_skew_ms", &self.clock_skew_ms)
            .field("replay_entries", &self.replay.borrow().len())
            .finish()
    }
}

impl NodeCredentials {
    /// The credential plane of `cfg`, reading its recipient key file
    /// (permission-checked); `None` when `cfg` has no `[credentials]`. A bad
    /// key file is a local credential error (exit 1, S3).
    pub fn load(cfg: &NodeConfig) -> Result<Option<Self>, ConfigError> {
        let Some(spec) = &cfg.credentials else {
            return Ok(None);
        };
        Self::load_spec(spec, cfg).map(Some)
    }

    fn load_spec(spec: &CredentialsSpec, cfg: &NodeConfig) -> Result<Self, ConfigError> {
        let recipient = keys::load_recipient_key(&spec.recipient_key).map_err(|e| {
            ConfigError::new(&cfg.source, "credentials.recipient_key", e.to_string())
        })?;
        Ok(Self::new(
            recipient,
            spec.issuer_public_key,
            spec.clock_skew_ms,
        ))
    }

    /// A credential plane from its parts, with an empty replay cache of
    /// [`REPLAY_CACHE_ENTRIES`].
    pub fn new(recipient: RecipientKey, issuer: VerifyingKey, clock_skew_ms: u32) -> Self {
        Self {
            recipient,
            issuer,
            clock_skew_ms,
            replay: RefCell::new(ReplayCache::new(REPLAY_CACHE_ENTRIES)),
        }
    }

    /// Our recipient key id (`CredentialLeaseBinding.recipient`).
    pub fn recipient_key_id(&self) -> &str {
        self.recipient.key_id()
    }

    /// Lease ids held by the replay cache now.
    pub fn replay_entries(&self) -> usize {
        self.replay.borrow().len()
    }
}

/// Why a tunnel's credential lease was rejected (C3): one `ERROR` terminal
/// with [`NodeLeaseError::failure_code`] and no provider call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeLeaseError {
    /// The request carries a lease but this Node has no recipient key
    /// (no `[credentials]`): it cannot be opened.
    #[error("credential lease received but this node has no recipient key")]
    NoRecipientKey,
    /// The lease was rejected by `iop_wire::lease::open`.
    #[error(transparent)]
    Lease(#[from] LeaseError),
}

impl NodeLeaseError {
    /// The contract failure code: `lease_missing`, `lease_invalid`,
    /// `lease_expired`, `lease_replayed` or `lease_scope_mismatch`.
    pub fn failure_code(&self) -> &'static str {
        match self {
            NodeLeaseError::NoRecipientKey => "lease_invalid",
            NodeLeaseError::Lease(e) => e.failure_code(),
        }
    }
}

/// The lease decision for the tunnels of one session: the Node's own
/// credential plane, whether the Edge's config requires leases, and our
/// node id.
#[derive(Debug, Clone)]
pub struct LeaseGate {
    credentials: Option<Rc<NodeCredentials>>,
    required_by_edge: bool,
    node_id: Rc<str>,
}

impl LeaseGate {
    /// The gate for node `node_id`. `required_by_edge` is the applied
    /// `NodeConfigPayload.credential_leases_required`.
    pub fn new(
        credentials: Option<Rc<NodeCredentials>>,
        required_by_edge: bool,
        node_id: impl Into<Rc<str>>,
    ) -> Self {
        Self {
            credentials,
            required_by_edge,
            node_id: node_id.into(),
        }
    }

    /// True when tunnels must carry a lease (C3): this Node has
    /// `[credentials]`, or the Edge said so.
    pub fn is_managed(&self) -> bool {
        self.credentials.is_some() || self.required_by_edge
    }

    /// Opens the lease of `req` for the adapter whose protocol profile is
    /// `profile` (C2). Call only after the capacity gate admitted the
    /// request and right before the provider call. `Ok(None)`: an
    /// unmanaged node and a request without a lease (legacy tunnel).
    pub fn open(
        &self,
        req: &pb::ProviderTunnelRequest,
        profile: Option<&str>,
        now_unix_ms: i64,
    ) -> Result<Option<OpenedSecret>, NodeLeaseError> {
        let carries_lease = req.credential_lease.is_some() || req.credential_binding.is_some();
        let Some(credentials) = &self.credentials else {
            return if carries_lease {
                Err(NodeLeaseError::NoRecipientKey)
            } else if self.required_by_edge {
                Err(LeaseError::LeaseMissing.into())
            } else {
                Ok(None)
            };
        };
        let upstream_target = lease::upstream_target(&req.adapter, &req.target);
        let ctx = OpenContext {
            recipient: &credentials.recipient,
            issuer: &credentials.issuer,
            // C5: a lease for another node, target or profile never opens
            // here; the other fields are the Edge's and covered by the
            // signature.
            scope: ExpectedScope {
                selected_node: &self.node_id,
                upstream_target: &upstream_target,
                profile,
                principal: None,
                slot: None,
                route: None,
                credential_revision: None,
                route_revision: None,
                projection_generation: None,
            },
            now_unix_ms,
            clock_skew_ms: credentials.clock_skew_ms,
        };
        let mut replay = credentials.replay.borrow_mut();
        let opened = lease::open(
            req.credential_lease.as_ref(),
            req.credential_binding.as_ref(),
            &ctx,
            &mut replay,
        )?;
        Ok(Some(opened))
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use ed25519_dalek::SigningKey;
    use iop_wire::lease::{issue, IssueParams, LeaseEntropy};
    use iop_wire::pb::CredentialLeaseBinding;
    use x25519_dalek::StaticSecret;

    use super::*;

    const NOW_MS: i64 = 1_700_000_000_000;
    const SECRET: &[u8] = b"sk-unit-test-secret";

    fn issuer() -> SigningKey {
        SigningKey::from_bytes(&[5; 32])
    }

    fn recipient(seed: u8) -> RecipientKey {
        RecipientKey::from_secret(StaticSecret::from([seed; 32]))
    }

    fn credentials(seed: u8) -> Rc<NodeCredentials> {
        Rc::new(NodeCredentials::new(
            recipient(seed),
            issuer().verifying_key(),
            5_000,
        ))
    }

    fn binding(recipient_id: &str, node: &str) -> CredentialLeaseBinding {
        CredentialLeaseBinding {
            principal: "team-a".into(),
            slot: "openai-main".into(),
            route: "gpt-x".into(),
            profile: "openai".into(),
            upstream_target: lease::upstream_target("mock", "mock-model"),
            selected_node: node.into(),
            recipient: recipient_id.into(),
            credential_revision: 2,
            route_revision: 1,
            projection_generation: 4,
        }
    }

    fn request(lease_id: &str, recipient_seed: u8, node: &str) -> pb::ProviderTunnelRequest {
        let to = recipient(recipient_seed);
        let binding = binding(to.key_id(), node);
        let lease = issue(
            &IssueParams {
                lease_id,
                binding: &binding,
                secret: SECRET,
                header_name: "Authorization",
                header_format: "Bearer {secret}",
                not_before_unix_ms: NOW_MS,
                expires_at_unix_ms: NOW_MS + 30_000,
            },
            &issuer(),
            &to.public_key(),
            LeaseEntropy::from_bytes([3; 32], [4; 12]),
        )
        .expect("issue");
        pb::ProviderTunnelRequest {
            run_id: "run-1".into(),
            adapter: "mock".into(),
            target: "mock-model".into(),
            body: Bytes::from_static(b"{}"),
            credential_lease: Some(lease),
            credential_binding: Some(binding),
            ..Default::default()
        }
    }

    fn code(result: Result<Option<OpenedSecret>, NodeLeaseError>) -> &'static str {
        match result {
            Ok(opened) => panic!("expected a rejection, opened {opened:?}"),
            Err(e) => e.failure_code(),
        }
    }

    // CONTRACT: C2 — a valid lease for this node, target and profile opens
    // to the declared header; the id is then in the replay cache.
    #[test]
    fn valid_lease_opens_to_the_declared_header() {
        let creds = credentials(9);
        let gate = LeaseGate::new(Some(creds.clone()), true, "node-a");
        let opened = gate
            .open(&request("l-1", 9, "node-a"), Some("openai"), NOW_MS + 1)
            .expect("opens")
            .expect("a lease");
        assert_eq!(opened.header_name(), "Authorization");
        assert_eq!(
            opened.declared_header_value().as_str(),
            "Bearer sk-unit-test-secret"
        );
        assert_eq!(creds.replay_entries(), 1);
        // CONTRACT: C4 — Debug never shows the secret.
        assert_eq!(format!("{opened:?}"), "OpenedSecret(<redacted>)");
        let debug = format!("{creds:?}");
        assert!(!debug.contains("sk-unit"), "{debug}");
        assert!(debug.contains("<redacted>"), "{debug}");
    }

    // CONTRACT: C3 — a managed node rejects a tunnel without a lease
    // (either field absent) with lease_missing.
    #[test]
    fn managed_node_requires_both_fields() {
        let gate = LeaseGate::new(Some(credentials(9)), false, "node-a");
        assert!(gate.is_managed());
        let mut req = request("l-2", 9, "node-a");
        req.credential_binding = None;
        assert_eq!(
            code(gate.open(&req, Some("openai"), NOW_MS)),
            "lease_missing"
        );
        req.credential_lease = None;
        assert_eq!(
            code(gate.open(&req, Some("openai"), NOW_MS)),
            "lease_missing"
        );
        // The Edge's flag alone also makes the node managed.
        let edge_only = LeaseGate::new(None, true, "node-a");
        assert!(edge_only.is_managed());
        assert_eq!(code(edge_only.open(&req, None, NOW_MS)), "lease_missing");
    }

    // CONTRACT: C3 — the legacy path: an unmanaged node and a request
    // without a lease; a lease sent to a node without a recipient key is
    // lease_invalid.
    #[test]
    fn unmanaged_node_opens_nothing() {
        let gate = LeaseGate::new(None, false, "node-a");
        assert!(!gate.is_managed());
        let mut req = request("l-3", 9, "node-a");
        assert_eq!(code(gate.open(&req, None, NOW_MS)), "lease_invalid");
        req.credential_lease = None;
        req.credential_binding = None;
        assert!(gate.open(&req, None, NOW_MS).expect("legacy").is_none());
    }

    // CONTRACT: C2, C5 — wrong recipient key (rotated), another node,
    // another target or profile, expiry and replay each fail with their code.
    #[test]
    fn rejections_have_their_failure_codes() {
        let gate = LeaseGate::new(Some(credentials(9)), true, "node-a");
        // Sealed to the old key of a node whose key was rotated.
        assert_eq!(
            code(gate.open(&request("r-1", 8, "node-a"), Some("openai"), NOW_MS)),
            "lease_invalid"
        );
        assert_eq!(
            code(gate.open(&request("r-2", 9, "node-b"), Some("openai"), NOW_MS)),
            "lease_scope_mismatch"
        );
        let mut other_target = request("r-3", 9, "node-a");
        other_target.target = "other-model".into();
        assert_eq!(
            code(gate.open(&other_target, Some("openai"), NOW_MS)),
            "lease_scope_mismatch"
        );
        assert_eq!(
            code(gate.open(&request("r-4", 9, "node-a"), Some("vllm"), NOW_MS)),
            "lease_scope_mismatch"
        );
        assert_eq!(
            code(gate.open(
                &request("r-5", 9, "node-a"),
                Some("openai"),
                NOW_MS + 30_000 + 5_000
            )),
            "lease_expired"
        );
        let replayed = request("r-6", 9, "node-a");
        assert!(gate.open(&replayed, Some("openai"), NOW_MS).is_ok());
        assert_eq!(
            code(gate.open(&replayed, Some("openai"), NOW_MS)),
            "lease_replayed"
        );
        assert_eq!(
            NodeLeaseError::NoRecipientKey.failure_code(),
            "lease_invalid"
        );
    }
}
