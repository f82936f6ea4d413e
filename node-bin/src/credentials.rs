//! The Node half of the credential plane (C2, C3, C5): the recipient key,
//! the trusted lease issuers' public keys (one per Edge of a fleet), the
//! origin pins, the replay window, and the per-tunnel lease decision.
//!
//! ```text
//!  tunnel request ─► W1, adapter, path, capacity gate (P4) ─► LeaseGate::open
//!        managed (own [credentials] or payload.credential_leases_required)?
//!          no, and no lease ─────────────────────────────► provider call without credential
//!          lease, but no recipient key here ─────────────► ERROR lease_invalid
//!          otherwise iop_wire::lease::open under the trusted issuer key the
//!          lease's issuer_key_id names (none named: the first key, which
//!          the lease then fails as an unknown issuer), with what this Node
//!          will actually do:
//!          node, upstream target, profile, the adapter's origin and provider
//!          TLS trust, run id, digest of method + path + headers + body;
//!          revoked revisions (payload) and origin pins (node.toml);
//!          window ± skew; replay window
//!            ├─ failure ─► ERROR lease_missing | lease_invalid | lease_expired |
//!            │             lease_replayed | lease_scope_mismatch (no provider call)
//!            └─ OpenedSecret ─► header injected into the request head in memory,
//!                               dropped (zeroized) once the head is written
//! ```
//!
//! The decision ([`LeaseGate::open`]) is pure: `now` comes in. The replay
//! state belongs to the Node process (it outlives sessions), so a lease
//! replayed over a new connection is still caught; it starts with the
//! process, and a lease issued before that (minus skew) is refused, since
//! what was opened before a restart is not remembered. Nothing here is
//! logged or cached beyond one request (C4, C5); every secret-holding type
//! has a redacted `Debug`.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::Rc;

use ed25519_dalek::VerifyingKey;
use iop_engine::keys;
use iop_wire::lease::{
    self, BoundRequest, ExpectedScope, LeaseError, OpenContext, OpenedSecret, OriginPins,
    RecipientKey, ReplayGuard,
};
use iop_wire::pb;

use crate::config::{ConfigError, CredentialsSpec, NodeConfig};

/// The loaded credential plane of a managed Node.
pub struct NodeCredentials {
    recipient: RecipientKey,
    issuers: TrustedIssuers,
    clock_skew_ms: u32,
    origin_pins: OriginPins,
    replay: RefCell<ReplayGuard>,
    warned_near_full: Cell<bool>,
}

impl fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let replay = self.replay.borrow();
        f.debug_struct("NodeCredentials")
            .field("recipient_key_id", &self.recipient.key_id())
            .field("recipient_key", &"<redacted>")
            .field("issuer_key_ids", &self.issuers.key_ids())
            .field("clock_skew_ms", &self.clock_skew_ms)
            .field("origin_pins", &self.origin_pins)
            .field("replay_windows", &replay.windows())
            .field("replay_started_unix_ms", &replay.started_unix_ms())
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
        let mut pins = OriginPins::new();
        for (slot, origins) in &spec.allowed_origins {
            for origin in origins {
                pins.allow(slot.clone(), origin.clone());
            }
        }
        let mut keys = spec.issuer_public_keys.iter();
        let first = keys.next().ok_or_else(|| {
            ConfigError::new(
                &cfg.source,
                "credentials.issuer_public_key",
                "required key is missing",
            )
        })?;
        let credentials = keys.fold(
            Self::new(recipient, *first, spec.clock_skew_ms),
            |credentials, key| credentials.also_trusting(*key),
        );
        Ok(credentials.with_origin_pins(pins))
    }

    /// A credential plane from its parts: leases of `issuer` trusted, no
    /// origin pins, and a replay guard with the default bounds that starts
    /// now (the process's start).
    pub fn new(recipient: RecipientKey, issuer: VerifyingKey, clock_skew_ms: u32) -> Self {
        Self {
            recipient,
            issuers: TrustedIssuers::one(issuer),
            clock_skew_ms,
            origin_pins: OriginPins::new(),
            replay: RefCell::new(ReplayGuard::new(iop_engine::clock::unix_ms())),
            warned_near_full: Cell::new(false),
        }
    }

    /// Also trusting leases signed by `issuer` (another Edge of the fleet).
    /// The configuration bounds how many ([`crate::config::MAX_ISSUER_KEYS`]);
    /// a key already trusted changes nothing.
    pub fn also_trusting(mut self, issuer: VerifyingKey) -> Self {
        self.issuers.add(issuer);
        self
    }

    /// The key ids (`CredentialLease.issuer_key_id`) of the trusted
    /// issuers, in the order configured.
    pub fn issuer_key_ids(&self) -> Vec<&str> {
        self.issuers.key_ids()
    }

    /// With `pins`: slots whose secrets may reach only the listed origins.
    pub fn with_origin_pins(mut self, pins: OriginPins) -> Self {
        self.origin_pins = pins;
        self
    }

    /// With `replay` as the replay state (its bounds and start time).
    pub fn with_replay_guard(mut self, replay: ReplayGuard) -> Self {
        self.replay = RefCell::new(replay);
        self
    }

    /// Our recipient key id (`CredentialLeaseBinding.recipient`).
    pub fn recipient_key_id(&self) -> &str {
        self.recipient.key_id()
    }

    /// Replay windows held now (one per Edge session with valid leases).
    pub fn replay_windows(&self) -> usize {
        self.replay.borrow().windows()
    }

    /// Warns once when three quarters of the replay windows are in use, and
    /// again after usage fell below half: past the cap, leases of a new
    /// Edge session are refused (`lease_replayed`).
    fn watch_replay_pressure(&self) {
        let replay = self.replay.borrow();
        if replay.is_near_full() {
            if !self.warned_near_full.replace(true) {
                tracing::warn!(
                    windows = replay.windows(),
                    max_windows = replay.max_windows(),
                    "credential lease replay state is three quarters full: leases of new edge \
                     sessions will be refused (lease_replayed) once it is full; windows free \
                     up as their leases expire"
                );
            }
        } else if replay.windows() * 2 < replay.max_windows() {
            self.warned_near_full.set(false);
        }
    }
}

/// The lease issuers a Node trusts, each with its key id as a lease names
/// it ([`lease::issuer_key_id`]: BLAKE3 of the public key). Never empty.
struct TrustedIssuers(Vec<(String, VerifyingKey)>);

impl TrustedIssuers {
    fn one(issuer: VerifyingKey) -> Self {
        Self(vec![(lease::issuer_key_id(&issuer), issuer)])
    }

    fn add(&mut self, issuer: VerifyingKey) {
        if !self.0.iter().any(|(_, key)| *key == issuer) {
            self.0.push((lease::issuer_key_id(&issuer), issuer));
        }
    }

    fn key_ids(&self) -> Vec<&str> {
        self.0.iter().map(|(id, _)| id.as_str()).collect()
    }

    /// The key to verify a lease naming `key_id` with: the trusted key of
    /// that id, or, when none has it (or there is no lease), the first
    /// trusted key, under which `lease::open` refuses the lease exactly as
    /// before there were several (`WrongIssuer` after the structure
    /// checks, or `LeaseMissing`).
    fn for_key_id(&self, key_id: Option<&str>) -> &VerifyingKey {
        let named = key_id.and_then(|id| self.0.iter().find(|(trusted, _)| trusted == id));
        &named.unwrap_or(&self.0[0]).1
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

/// Where this Node would send a tunnel, computed from its own adapter: what
/// the lease must be bound to (C2).
#[derive(Debug, Clone, Copy)]
pub struct TunnelTarget<'a> {
    /// The adapter's protocol profile name, when it has one.
    pub profile: Option<&'a str>,
    /// The adapter's origin ([`iop_engine::http::Url::origin`]).
    pub origin: &'a str,
    /// Whom the adapter's provider client trusts to be that origin
    /// ([`crate::adapters::Endpoint::provider_trust`]).
    pub provider_trust: &'a [u8; lease::PROVIDER_TRUST_BYTES],
    /// The request target the tunnel resolved to (U3).
    pub path: &'a str,
    /// The method it will be sent with.
    pub method: &'a str,
}

/// The lease decision for the tunnels of one session: the Node's own
/// credential plane, whether the Edge's config requires leases, the
/// revocations it sent, and our node id.
#[derive(Debug, Clone)]
pub struct LeaseGate {
    credentials: Option<Rc<NodeCredentials>>,
    required_by_edge: bool,
    revoked: Rc<[pb::RevokedCredential]>,
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
            revoked: Rc::new([]),
            node_id: node_id.into(),
        }
    }

    /// With `revoked`: the applied `NodeConfigPayload.revoked_credentials`,
    /// refused by this Node itself (C3).
    pub fn with_revoked(mut self, revoked: impl Into<Rc<[pb::RevokedCredential]>>) -> Self {
        self.revoked = revoked.into();
        self
    }

    /// True when tunnels must carry a lease (C3): this Node has
    /// `[credentials]`, or the Edge said so.
    pub fn is_managed(&self) -> bool {
        self.credentials.is_some() || self.required_by_edge
    }

    /// Opens the lease of `req` for a request to `target` (C2). Call only
    /// after the capacity gate admitted the request and right before the
    /// provider call, with the adapter and path that call will use.
    /// `Ok(None)`: an unmanaged node and a request without a lease (legacy
    /// tunnel).
    pub fn open(
        &self,
        req: &pb::ProviderTunnelRequest,
        target: &TunnelTarget<'_>,
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
        let request_digest = lease::request_digest(&BoundRequest {
            method: target.method,
            path: target.path,
            headers: &req.headers,
            body: std::slice::from_ref(&req.body),
        });
        let ctx = OpenContext {
            recipient: &credentials.recipient,
            issuer: credentials.issuers.for_key_id(
                req.credential_lease
                    .as_ref()
                    .map(|lease| lease.issuer_key_id.as_str()),
            ),
            // C5: a lease for another node, target, profile, origin, provider
            // trust, run or request never opens here; the other fields are
            // the Edge's and covered by the signature.
            scope: ExpectedScope::computed_by_node(
                &self.node_id,
                &upstream_target,
                target.origin,
                target.provider_trust,
                &req.run_id,
                &request_digest,
                target.profile,
            ),
            revoked: &self.revoked,
            origin_pins: &credentials.origin_pins,
            now_unix_ms,
            clock_skew_ms: credentials.clock_skew_ms,
        };
        let opened = {
            let mut replay = credentials.replay.borrow_mut();
            lease::open(
                req.credential_lease.as_ref(),
                req.credential_binding.as_ref(),
                &ctx,
                &mut replay,
            )
        };
        credentials.watch_replay_pressure();
        Ok(Some(opened?))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    use bytes::Bytes;
    use ed25519_dalek::SigningKey;
    use iop_wire::lease::{issue, IssueParams, LeaseEntropy, ProviderTrust};
    use iop_wire::pb::CredentialLeaseBinding;
    use x25519_dalek::StaticSecret;

    use super::*;

    const NOW_MS: i64 = 1_700_000_000_000;
    const SECRET: &[u8] = b"sk-unit-test-secret";
    const ORIGIN: &str = "http://127.0.0.1:8000";
    const PATH: &str = "/v1/chat/completions";
    /// The provider trust of [`ORIGIN`] (plain HTTP).
    static PLAIN_HTTP: LazyLock<[u8; 32]> =
        LazyLock::new(|| lease::provider_trust_digest(&ProviderTrust::PlainHttp));

    fn issuer() -> SigningKey {
        SigningKey::from_bytes(&[5; 32])
    }

    fn recipient(seed: u8) -> RecipientKey {
        RecipientKey::from_secret(StaticSecret::from([seed; 32]))
    }

    fn credentials(seed: u8) -> Rc<NodeCredentials> {
        Rc::new(
            NodeCredentials::new(recipient(seed), issuer().verifying_key(), 5_000)
                .with_replay_guard(ReplayGuard::new(NOW_MS - 60_000)),
        )
    }

    fn target() -> TunnelTarget<'static> {
        TunnelTarget {
            profile: Some("openai"),
            origin: ORIGIN,
            provider_trust: &PLAIN_HTTP,
            path: PATH,
            method: "POST",
        }
    }

    fn unsealed(run_id: &str) -> pb::ProviderTunnelRequest {
        pb::ProviderTunnelRequest {
            run_id: run_id.into(),
            adapter: "mock".into(),
            target: "mock-model".into(),
            body: Bytes::from_static(b"{}"),
            ..Default::default()
        }
    }

    fn binding(
        recipient_id: &str,
        node: &str,
        req: &pb::ProviderTunnelRequest,
    ) -> CredentialLeaseBinding {
        let digest = lease::request_digest(&BoundRequest {
            method: "POST",
            path: PATH,
            headers: &req.headers,
            body: std::slice::from_ref(&req.body),
        });
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
            upstream_origin: ORIGIN.into(),
            run_id: req.run_id.clone(),
            request_digest: Bytes::copy_from_slice(&digest),
            provider_trust: Bytes::copy_from_slice(&PLAIN_HTTP[..]),
        }
    }

    fn request_with(
        sequence: u64,
        recipient_seed: u8,
        node: &str,
        edit: impl FnOnce(&mut CredentialLeaseBinding),
    ) -> pb::ProviderTunnelRequest {
        request_signed(sequence, recipient_seed, node, &issuer(), edit)
    }

    /// [`request_with`], its lease signed by `signer`.
    fn request_signed(
        sequence: u64,
        recipient_seed: u8,
        node: &str,
        signer: &SigningKey,
        edit: impl FnOnce(&mut CredentialLeaseBinding),
    ) -> pb::ProviderTunnelRequest {
        let to = recipient(recipient_seed);
        let mut req = unsealed(&format!("run-{sequence}"));
        let mut binding = binding(to.key_id(), node, &req);
        edit(&mut binding);
        let lease = issue(
            &IssueParams {
                lease_id: "l-1",
                sequence,
                binding: &binding,
                secret: SECRET,
                header_name: "Authorization",
                header_format: "Bearer {secret}",
                not_before_unix_ms: NOW_MS,
                expires_at_unix_ms: NOW_MS + 30_000,
            },
            signer,
            &to.public_key(),
            LeaseEntropy::from_seed([3; 32]),
        )
        .expect("issue");
        req.credential_lease = Some(lease);
        req.credential_binding = Some(binding);
        req
    }

    fn request(sequence: u64, recipient_seed: u8, node: &str) -> pb::ProviderTunnelRequest {
        request_with(sequence, recipient_seed, node, |_| {})
    }

    fn code(result: Result<Option<OpenedSecret>, NodeLeaseError>) -> &'static str {
        match result {
            Ok(opened) => panic!("expected a rejection, opened {opened:?}"),
            Err(e) => e.failure_code(),
        }
    }

    // CONTRACT: C2 — a valid lease for this node, target, profile, origin
    // and request opens to the declared header; its sequence is then in the
    // replay window.
    #[test]
    fn valid_lease_opens_to_the_declared_header() {
        let creds = credentials(9);
        let gate = LeaseGate::new(Some(creds.clone()), true, "node-a");
        let opened = gate
            .open(&request(1, 9, "node-a"), &target(), NOW_MS + 1)
            .expect("opens")
            .expect("a lease");
        assert_eq!(opened.header_name(), "Authorization");
        assert_eq!(
            opened.declared_header_value().as_str(),
            "Bearer sk-unit-test-secret"
        );
        assert_eq!(creds.replay_windows(), 1);
        assert!(creds.replay.borrow().contains(4, 1));
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
        let mut req = request(2, 9, "node-a");
        req.credential_binding = None;
        assert_eq!(code(gate.open(&req, &target(), NOW_MS)), "lease_missing");
        req.credential_lease = None;
        assert_eq!(code(gate.open(&req, &target(), NOW_MS)), "lease_missing");
        // The Edge's flag alone also makes the node managed.
        let edge_only = LeaseGate::new(None, true, "node-a");
        assert!(edge_only.is_managed());
        assert_eq!(
            code(edge_only.open(&req, &target(), NOW_MS)),
            "lease_missing"
        );
    }

    // CONTRACT: C3 — the legacy path: an unmanaged node and a request
    // without a lease; a lease sent to a node without a recipient key is
    // lease_invalid.
    #[test]
    fn unmanaged_node_opens_nothing() {
        let gate = LeaseGate::new(None, false, "node-a");
        assert!(!gate.is_managed());
        let mut req = request(3, 9, "node-a");
        assert_eq!(code(gate.open(&req, &target(), NOW_MS)), "lease_invalid");
        req.credential_lease = None;
        req.credential_binding = None;
        assert!(gate
            .open(&req, &target(), NOW_MS)
            .expect("legacy")
            .is_none());
    }

    // CONTRACT: C2, C5 — wrong recipient key (rotated), another node,
    // target, profile, origin, path or body, expiry and replay each fail
    // with their code.
    #[test]
    fn rejections_have_their_failure_codes() {
        let gate = LeaseGate::new(Some(credentials(9)), true, "node-a");
        // Sealed to the old key of a node whose key was rotated.
        assert_eq!(
            code(gate.open(&request(1, 8, "node-a"), &target(), NOW_MS)),
            "lease_invalid"
        );
        assert_eq!(
            code(gate.open(&request(2, 9, "node-b"), &target(), NOW_MS)),
            "lease_scope_mismatch"
        );
        let mut other_target = request(3, 9, "node-a");
        other_target.target = "other-model".into();
        assert_eq!(
            code(gate.open(&other_target, &target(), NOW_MS)),
            "lease_scope_mismatch"
        );
        let vllm = TunnelTarget {
            profile: Some("vllm"),
            ..target()
        };
        assert_eq!(
            code(gate.open(&request(4, 9, "node-a"), &vllm, NOW_MS)),
            "lease_scope_mismatch"
        );
        // The adapter's origin was changed by the config the link pushed.
        let elsewhere = TunnelTarget {
            origin: "http://attacker.example:80",
            ..target()
        };
        assert_eq!(
            code(gate.open(&request(5, 9, "node-a"), &elsewhere, NOW_MS)),
            "lease_scope_mismatch"
        );
        // The adapter's provider TLS trust was changed by the config the
        // link pushed (here: its own CA).
        let attacker_ca = lease::provider_trust_digest(&ProviderTrust::PrivateCa(vec![b"ca"]));
        let other_trust = TunnelTarget {
            provider_trust: &attacker_ca,
            ..target()
        };
        let err = gate
            .open(&request(11, 9, "node-a"), &other_trust, NOW_MS)
            .expect_err("another trust");
        assert_eq!(err.failure_code(), "lease_scope_mismatch");
        assert_eq!(
            err.to_string(),
            "credential binding scope mismatch: provider_trust"
        );
        let other_path = TunnelTarget {
            path: "/v1/responses",
            ..target()
        };
        assert_eq!(
            code(gate.open(&request(6, 9, "node-a"), &other_path, NOW_MS)),
            "lease_scope_mismatch"
        );
        let mut other_body = request(7, 9, "node-a");
        other_body.body = Bytes::from_static(b"{\"x\":1}");
        assert_eq!(
            code(gate.open(&other_body, &target(), NOW_MS)),
            "lease_scope_mismatch"
        );
        let mut other_run = request(8, 9, "node-a");
        other_run.run_id = "run-other".into();
        assert_eq!(
            code(gate.open(&other_run, &target(), NOW_MS)),
            "lease_scope_mismatch"
        );
        let replayed = request(10, 9, "node-a");
        assert!(gate.open(&replayed, &target(), NOW_MS).is_ok());
        assert_eq!(
            code(gate.open(&replayed, &target(), NOW_MS)),
            "lease_replayed"
        );
        // Last: the replay guard's clock never goes back after this.
        assert_eq!(
            code(gate.open(&request(9, 9, "node-a"), &target(), NOW_MS + 30_000 + 5_000)),
            "lease_expired"
        );
        assert_eq!(
            NodeLeaseError::NoRecipientKey.failure_code(),
            "lease_invalid"
        );
    }

    // CONTRACT: C3 — a revocation the Edge sent is enforced by the Node;
    // origin pins from node.toml refuse a signed lease for another origin.
    #[test]
    fn revocations_and_origin_pins_are_the_nodes_own() {
        let revoked = vec![pb::RevokedCredential {
            slot: "openai-main".into(),
            revisions: vec![2],
        }];
        let gate = LeaseGate::new(Some(credentials(9)), true, "node-a").with_revoked(revoked);
        let err = gate
            .open(&request(1, 9, "node-a"), &target(), NOW_MS)
            .expect_err("revoked");
        assert_eq!(err.failure_code(), "lease_invalid");
        assert_eq!(err.to_string(), "credential revision 2 is revoked");

        let mut pins = OriginPins::new();
        pins.allow("openai-main", "http://10.0.0.9:8000");
        let pinned = Rc::new(
            NodeCredentials::new(recipient(9), issuer().verifying_key(), 5_000)
                .with_replay_guard(ReplayGuard::new(NOW_MS - 60_000))
                .with_origin_pins(pins),
        );
        let gate = LeaseGate::new(Some(pinned), true, "node-a");
        assert_eq!(
            code(gate.open(&request(2, 9, "node-a"), &target(), NOW_MS)),
            "lease_scope_mismatch"
        );
        let there = TunnelTarget {
            origin: "http://10.0.0.9:8000",
            ..target()
        };
        let to_pin = request_with(3, 9, "node-a", |b| {
            b.upstream_origin = "http://10.0.0.9:8000".into()
        });
        assert!(gate.open(&to_pin, &there, NOW_MS).expect("opens").is_some());
    }

    // CONTRACT: C2 — the replay state began with this process: a lease
    // issued before it (minus skew) is refused.
    #[test]
    fn lease_from_before_the_node_started_is_refused() {
        let restarted = Rc::new(
            NodeCredentials::new(recipient(9), issuer().verifying_key(), 5_000)
                .with_replay_guard(ReplayGuard::new(NOW_MS + 5_001)),
        );
        let gate = LeaseGate::new(Some(restarted), true, "node-a");
        assert_eq!(
            code(gate.open(&request(1, 9, "node-a"), &target(), NOW_MS + 6_000)),
            "lease_replayed"
        );
    }

    // CONTRACT: C2, C3 — a Node trusting the issuers of two Edges opens a
    // lease signed by the second (the key its issuer_key_id names); a lease
    // of an issuer it does not trust is refused as before, as an unknown
    // issuer (lease_invalid), and one naming a trusted key id but signed by
    // another key fails its signature.
    #[test]
    fn leases_of_any_trusted_issuer_open() {
        let second = SigningKey::from_bytes(&[6; 32]);
        let stranger = SigningKey::from_bytes(&[8; 32]);
        let two = Rc::new(
            NodeCredentials::new(recipient(9), issuer().verifying_key(), 5_000)
                .also_trusting(second.verifying_key())
                .also_trusting(issuer().verifying_key())
                .with_replay_guard(ReplayGuard::new(NOW_MS - 60_000)),
        );
        assert_eq!(
            two.issuer_key_ids(),
            [
                lease::issuer_key_id(&issuer().verifying_key()),
                lease::issuer_key_id(&second.verifying_key())
            ]
        );
        let gate = LeaseGate::new(Some(two), true, "node-a");
        let by_second = request_signed(1, 9, "node-a", &second, |_| {});
        let opened = gate
            .open(&by_second, &target(), NOW_MS)
            .expect("opens")
            .expect("a lease");
        assert_eq!(
            opened.declared_header_value().as_str(),
            "Bearer sk-unit-test-secret"
        );
        assert!(gate
            .open(&request(2, 9, "node-a"), &target(), NOW_MS)
            .expect("the first issuer's lease opens")
            .is_some());

        let by_stranger = request_signed(3, 9, "node-a", &stranger, |_| {});
        let err = gate
            .open(&by_stranger, &target(), NOW_MS)
            .expect_err("unknown");
        assert_eq!(err, NodeLeaseError::Lease(LeaseError::WrongIssuer));
        assert_eq!(err.failure_code(), "lease_invalid");
        assert_eq!(err.to_string(), "credential lease from an unknown issuer");
        // The same reason as a one-issuer Node gives it.
        let one = LeaseGate::new(Some(credentials(9)), true, "node-a");
        assert_eq!(
            one.open(&by_stranger, &target(), NOW_MS)
                .expect_err("unknown"),
            err
        );

        let mut forged = request_signed(4, 9, "node-a", &stranger, |_| {});
        if let Some(lease) = forged.credential_lease.as_mut() {
            lease.issuer_key_id = lease::issuer_key_id(&second.verifying_key());
        }
        assert_eq!(
            gate.open(&forged, &target(), NOW_MS).expect_err("forged"),
            NodeLeaseError::Lease(LeaseError::BadSignature)
        );
    }

    // CONTRACT: C2 — node.toml's issuer_public_key and issuer_public_keys
    // reach the loaded credential plane: every listed issuer is trusted.
    #[test]
    fn the_loaded_plane_trusts_every_configured_issuer() {
        let dir = std::env::temp_dir().join(format!("iop-node-issuers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("node-a.key");
        keys::generate_recipient_key(&key).unwrap();
        let text = |k: &SigningKey| keys::encode_issuer_public_key(&k.verifying_key());
        let (first, second) = (issuer(), SigningKey::from_bytes(&[6; 32]));
        let toml = format!(
            "node_id = \"node-a\"\ntrust_domain = \"iop.local\"\nedge_addr = \"127.0.0.1:7443\"\n\
             edge_name = \"edge-1\"\n[tls]\nca = \"ca.pem\"\ncert = \"n.pem\"\nkey = \"n-key.pem\"\n\
             [credentials]\nrecipient_key = \"{}\"\nissuer_public_key = \"{}\"\n\
             issuer_public_keys = [\"{}\", \"{}\"]\n",
            key.display(),
            text(&first),
            text(&second),
            text(&first),
        );
        let cfg = NodeConfig::parse(&toml, dir.join("node.toml")).unwrap();
        let loaded = NodeCredentials::load(&cfg).unwrap().expect("managed");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            loaded.issuer_key_ids(),
            [
                lease::issuer_key_id(&first.verifying_key()),
                lease::issuer_key_id(&second.verifying_key())
            ]
        );
    }
}
