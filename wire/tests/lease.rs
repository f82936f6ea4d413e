//! Credential lease sealing and opening (C1–C5): round trip, every rejection
//! path with its failure code, the destination and request binding, the
//! Node's own policy (revocations, origin pins), the replay window's bounds,
//! redaction and zeroizing.

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use iop_wire::lease::{
    binding_digest, decode_hex, decode_hex_into, encode_hex, issue, issuer_key_id, open,
    provider_trust_digest, recipient_key_id, request_digest, sign, upstream_origin,
    upstream_target, BoundRequest, ExpectedScope, IssueError, IssueParams, LeaseEntropy,
    LeaseError, OpenContext, OpenedSecret, OriginPins, ProviderTrust, RecipientKey, ReplayGuard,
    MAX_LEASE_LIFETIME_MS, REPLAY_MAX_WINDOWS, REPLAY_WINDOW_LEASES,
};
use iop_wire::pb::{CredentialLease, CredentialLeaseBinding, Header, RevokedCredential};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::{Zeroize, ZeroizeOnDrop};

const SECRET: &[u8] = b"sk-live-TOPSECRET-0123456789";
const ISSUER_SEED: [u8; 32] = [7; 32];
const RECIPIENT_SEED: [u8; 32] = [9; 32];
const STARTED_MS: i64 = 990_000;
const NOT_BEFORE_MS: i64 = 1_000_000;
const EXPIRES_AT_MS: i64 = 1_060_000;
const NOW_MS: i64 = 1_030_000;
const SKEW_MS: u32 = 2_000;
const ORIGIN: &str = "http://10.0.0.5:8000";
const PATH: &str = "/v1/chat/completions";
const BODY: &[u8] = br#"{"model":"gpt-4o","messages":[]}"#;
/// [`BODY`] as the one piece a request is bound with.
static BODY_PIECES: [Bytes; 1] = [Bytes::from_static(BODY)];
/// Stand-ins for DER CA certificates (the digest reads them as bytes).
const CA_A: &[u8] = b"0\x82 private CA A";
const CA_B: &[u8] = b"0\x82 private CA B";
const CA_C: &[u8] = b"0\x82 private CA C";

struct Fixture {
    issuer: SigningKey,
    recipient: RecipientKey,
    binding: CredentialLeaseBinding,
    request_digest: [u8; 32],
    /// The fixture's provider trust: the private CA [`CA_A`].
    provider_trust: [u8; 32],
    pins: OriginPins,
}

fn headers() -> Vec<Header> {
    vec![Header {
        name: "content-type".into(),
        value: Bytes::from_static(b"application/json"),
    }]
}

fn request(headers: &[Header]) -> BoundRequest<'_> {
    BoundRequest {
        method: "POST",
        path: PATH,
        headers,
        body: &BODY_PIECES,
    }
}

fn fixture() -> Fixture {
    let recipient = RecipientKey::from_secret(StaticSecret::from(RECIPIENT_SEED));
    let digest = request_digest(&request(&headers()));
    let trust = provider_trust_digest(&ProviderTrust::PrivateCa(vec![CA_A]));
    let binding = CredentialLeaseBinding {
        principal: "client-a".into(),
        slot: "openai-primary".into(),
        route: "gpt-4o→openai".into(),
        profile: "openai".into(),
        upstream_target: upstream_target("openai-1", "gpt-4o"),
        selected_node: "node-a".into(),
        recipient: recipient.key_id().to_owned(),
        credential_revision: 3,
        route_revision: 5,
        projection_generation: 8,
        upstream_origin: ORIGIN.into(),
        run_id: "run-17".into(),
        request_digest: Bytes::copy_from_slice(&digest),
        provider_trust: Bytes::copy_from_slice(&trust),
    };
    Fixture {
        issuer: SigningKey::from_bytes(&ISSUER_SEED),
        recipient,
        binding,
        request_digest: digest,
        provider_trust: trust,
        pins: OriginPins::new(),
    }
}

fn entropy(seed: u8) -> LeaseEntropy {
    LeaseEntropy::from_seed([seed; 32])
}

fn params<'a>(lease_id: &'a str, binding: &'a CredentialLeaseBinding) -> IssueParams<'a> {
    IssueParams {
        lease_id,
        sequence: 1,
        binding,
        secret: SECRET,
        header_name: "Authorization",
        header_format: "Bearer {secret}",
        not_before_unix_ms: NOT_BEFORE_MS,
        expires_at_unix_ms: EXPIRES_AT_MS,
    }
}

fn issue_with(f: &Fixture, p: &IssueParams<'_>) -> CredentialLease {
    match issue(p, &f.issuer, &f.recipient.public_key(), entropy(3)) {
        Ok(lease) => lease,
        Err(e) => panic!("issue failed: {e}"),
    }
}

fn issue_for(f: &Fixture, lease_id: &str, binding: &CredentialLeaseBinding) -> CredentialLease {
    issue_with(f, &params(lease_id, binding))
}

/// Lease `sequence` of the fixture binding, valid from `not_before` for a
/// minute.
fn issue_seq(f: &Fixture, sequence: u64, not_before: i64) -> CredentialLease {
    issue_with(
        f,
        &IssueParams {
            sequence,
            not_before_unix_ms: not_before,
            expires_at_unix_ms: not_before + 60_000,
            ..params("lease-seq", &f.binding)
        },
    )
}

fn scope<'a>(f: &'a Fixture, binding: &'a CredentialLeaseBinding) -> ExpectedScope<'a> {
    ExpectedScope {
        selected_node: &binding.selected_node,
        upstream_target: &binding.upstream_target,
        upstream_origin: ORIGIN,
        provider_trust: &f.provider_trust,
        run_id: &binding.run_id,
        request_digest: &f.request_digest,
        profile: Some(&binding.profile),
        principal: Some(&binding.principal),
        slot: Some(&binding.slot),
        route: Some(&binding.route),
        credential_revision: Some(binding.credential_revision),
        route_revision: Some(binding.route_revision),
        projection_generation: Some(binding.projection_generation),
    }
}

fn context(f: &Fixture, now_unix_ms: i64) -> OpenContext<'_> {
    OpenContext {
        recipient: &f.recipient,
        issuer: f.issuer.as_ref(),
        scope: scope(f, &f.binding),
        revoked: &[],
        origin_pins: &f.pins,
        now_unix_ms,
        clock_skew_ms: SKEW_MS,
    }
}

fn guard() -> ReplayGuard {
    ReplayGuard::new(STARTED_MS)
}

/// Opens with a fresh replay guard and returns the error.
fn open_err(
    lease: &CredentialLease,
    binding: &CredentialLeaseBinding,
    ctx: &OpenContext<'_>,
) -> LeaseError {
    let mut replay = guard();
    match open(Some(lease), Some(binding), ctx, &mut replay) {
        Ok(opened) => panic!("lease unexpectedly opened: {opened:?}"),
        Err(e) => e,
    }
}

fn open_ok(
    lease: &CredentialLease,
    binding: &CredentialLeaseBinding,
    ctx: &OpenContext<'_>,
    replay: &mut ReplayGuard,
) -> OpenedSecret {
    match open(Some(lease), Some(binding), ctx, replay) {
        Ok(opened) => opened,
        Err(e) => panic!("open failed: {e} ({})", e.failure_code()),
    }
}

fn flip(bytes: &Bytes, bit: usize) -> Bytes {
    let mut v = bytes.to_vec();
    v[bit / 8] ^= 1 << (bit % 8);
    Bytes::from(v)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn sealed_lease_opens_to_the_secret_and_header() {
    // CONTRACT: C1 — signed by the issuer, sealed to the recipient, bound to the binding.
    // CONTRACT: C2 — the Node verifies and injects the declared header.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    assert_eq!(lease.lease_id, "lease-1");
    assert_eq!(
        lease.binding_digest.as_ref(),
        &binding_digest(&f.binding)[..]
    );
    assert_eq!(lease.issuer_key_id, issuer_key_id(f.issuer.as_ref()));
    assert_eq!(lease.ephemeral_public_key.len(), 32);
    assert_eq!(lease.sequence, 1);
    assert_eq!(lease.sealed_secret.len(), SECRET.len() + 16);
    assert_eq!(lease.signature.len(), 64);
    assert!(!contains(&lease.sealed_secret, SECRET));
    assert!(!contains(&lease.sealed_secret, b"TOPSECRET"));

    let mut replay = guard();
    let opened = open_ok(&lease, &f.binding, &context(&f, NOW_MS), &mut replay);
    assert_eq!(opened.secret_bytes(), SECRET);
    assert_eq!(opened.header_name(), "Authorization");
    assert_eq!(opened.header_format(), "Bearer {secret}");
    assert_eq!(
        opened.declared_header_value().as_str(),
        "Bearer sk-live-TOPSECRET-0123456789"
    );
    assert_eq!(replay.windows(), 1);
    assert!(replay.contains(f.binding.projection_generation, 1));
    assert!(!replay.contains(f.binding.projection_generation, 2));
}

#[test]
fn issue_is_deterministic_in_its_entropy() {
    let f = fixture();
    let recipient = f.recipient.public_key();
    let p = params("lease-1", &f.binding);
    let a = issue(&p, &f.issuer, &recipient, entropy(3));
    let b = issue(&p, &f.issuer, &recipient, entropy(3));
    let c = issue(&p, &f.issuer, &recipient, entropy(4));
    assert_eq!(a, b);
    let (Ok(a), Ok(c)) = (a, c) else {
        panic!("issue failed")
    };
    assert_ne!(a.ephemeral_public_key, c.ephemeral_public_key);
    assert_ne!(a.sealed_secret, c.sealed_secret);
}

#[test]
fn absent_lease_or_binding_is_lease_missing() {
    // CONTRACT: C3 — absent lease or binding is rejected (managed mode).
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut replay = guard();
    let no_lease = open(None, Some(&f.binding), &ctx, &mut replay);
    assert_eq!(no_lease.as_ref().err(), Some(&LeaseError::LeaseMissing));
    let no_binding = open(Some(&lease), None, &ctx, &mut replay);
    assert_eq!(no_binding.as_ref().err(), Some(&LeaseError::BindingMissing));
    let neither = open(None, None, &ctx, &mut replay);
    assert_eq!(neither.as_ref().err(), Some(&LeaseError::LeaseMissing));
    assert_eq!(LeaseError::LeaseMissing.failure_code(), "lease_missing");
    assert_eq!(LeaseError::BindingMissing.failure_code(), "lease_missing");
    assert_eq!(replay.windows(), 0);
}

#[test]
fn every_signature_bit_flip_is_rejected() {
    // CONTRACT: C3 — invalid signature.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    for bit in 0..lease.signature.len() * 8 {
        let mut bad = lease.clone();
        bad.signature = flip(&lease.signature, bit);
        let err = open_err(&bad, &f.binding, &ctx);
        assert_eq!(err, LeaseError::BadSignature, "signature bit {bit}");
        assert_eq!(err.failure_code(), "lease_invalid");
    }
}

#[test]
fn every_sealed_blob_bit_flip_is_rejected_signed_or_not() {
    // CONTRACT: C3 — tampering with the ephemeral key (HPKE `enc`) or the
    // ciphertext is caught by the signature, and (re-signed) by the AEAD.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut replay = guard();
    type Field = fn(&mut CredentialLease) -> &mut Bytes;
    let fields: [(&str, Field); 2] = [
        ("ephemeral_public_key", |l| &mut l.ephemeral_public_key),
        ("sealed_secret", |l| &mut l.sealed_secret),
    ];
    let mut flips = 0;
    for (name, field) in fields {
        let len = field(&mut lease.clone()).len();
        for bit in 0..len * 8 {
            let mut bad = lease.clone();
            let slot = field(&mut bad);
            *slot = flip(slot, bit);
            let unsigned = open(Some(&bad), Some(&f.binding), &ctx, &mut replay);
            assert_eq!(
                unsigned.err(),
                Some(LeaseError::BadSignature),
                "{name} bit {bit} unsigned"
            );
            sign(&mut bad, &f.issuer);
            let resigned = open(Some(&bad), Some(&f.binding), &ctx, &mut replay);
            assert_eq!(
                resigned.err(),
                Some(LeaseError::Decrypt),
                "{name} bit {bit} re-signed"
            );
            flips += 1;
        }
    }
    assert_eq!(flips, (32 + SECRET.len() + 16) * 8);
    // Failed opens never enter the replay state; the intact lease still opens.
    assert_eq!(replay.windows(), 0);
    let opened = open_ok(&lease, &f.binding, &ctx, &mut replay);
    assert_eq!(opened.secret_bytes(), SECRET);
}

#[test]
fn header_fields_are_authenticated_data() {
    // CONTRACT: C2 — the declared header cannot be rewritten, even by a holder of
    // the issuer key after sealing.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut bad = lease.clone();
    bad.header_name = "X-Api-Key".into();
    assert_eq!(open_err(&bad, &f.binding, &ctx), LeaseError::BadSignature);
    sign(&mut bad, &f.issuer);
    assert_eq!(open_err(&bad, &f.binding, &ctx), LeaseError::Decrypt);

    let mut bad = lease.clone();
    bad.header_format = "Basic {secret}".into();
    sign(&mut bad, &f.issuer);
    assert_eq!(open_err(&bad, &f.binding, &ctx), LeaseError::Decrypt);
}

#[test]
fn lease_sealed_to_another_recipient_is_invalid() {
    // CONTRACT: C3 — wrong recipient.
    let f = fixture();
    let other = RecipientKey::from_secret(StaticSecret::from([11u8; 32]));
    let mut binding = f.binding.clone();
    binding.recipient = other.key_id().to_owned();
    let lease = match issue(
        &params("lease-1", &binding),
        &f.issuer,
        &other.public_key(),
        entropy(3),
    ) {
        Ok(lease) => lease,
        Err(e) => panic!("issue failed: {e}"),
    };
    let err = open_err(&lease, &binding, &context(&f, NOW_MS));
    assert_eq!(err, LeaseError::WrongRecipient);
    assert_eq!(err.failure_code(), "lease_invalid");

    // The intended recipient opens it.
    let ctx = OpenContext {
        recipient: &other,
        ..context(&f, NOW_MS)
    };
    let opened = open_ok(&lease, &binding, &ctx, &mut guard());
    assert_eq!(opened.secret_bytes(), SECRET);
}

#[test]
fn issue_refuses_a_binding_for_another_recipient_key() {
    let f = fixture();
    let other = RecipientKey::from_secret(StaticSecret::from([11u8; 32]));
    let result = issue(
        &params("lease-1", &f.binding),
        &f.issuer,
        &other.public_key(),
        entropy(3),
    );
    assert_eq!(
        result.err(),
        Some(IssueError::Invalid {
            field: "binding.recipient"
        })
    );
}

#[test]
fn lease_for_another_node_is_scope_mismatch() {
    // CONTRACT: C5 — no lease accepted for another node.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = OpenContext {
        scope: ExpectedScope {
            selected_node: "node-b",
            ..scope(&f, &f.binding)
        },
        ..context(&f, NOW_MS)
    };
    let err = open_err(&lease, &f.binding, &ctx);
    assert_eq!(
        err,
        LeaseError::ScopeMismatch {
            field: "selected_node"
        }
    );
    assert_eq!(err.failure_code(), "lease_scope_mismatch");
}

type Mutation = fn(&mut CredentialLeaseBinding);

/// Each binding field changed alone, with the name `ScopeMismatch` reports.
fn mutations() -> Vec<(&'static str, Mutation)> {
    vec![
        ("principal", |b| b.principal = "client-b".into()),
        ("slot", |b| b.slot = "openai-secondary".into()),
        ("route", |b| b.route = "gpt-4o→azure".into()),
        ("profile", |b| b.profile = "anthropic".into()),
        ("upstream_target", |b| {
            b.upstream_target = upstream_target("openai-2", "gpt-4o")
        }),
        ("selected_node", |b| b.selected_node = "node-b".into()),
        ("credential_revision", |b| b.credential_revision = 4),
        ("route_revision", |b| b.route_revision = 6),
        ("projection_generation", |b| b.projection_generation = 9),
        ("upstream_origin", |b| {
            b.upstream_origin = "http://10.0.0.6:8000".into()
        }),
        ("provider_trust", |b| {
            let other = ProviderTrust::PrivateCa(vec![CA_A, CA_B]);
            b.provider_trust = Bytes::copy_from_slice(&provider_trust_digest(&other))
        }),
        ("run_id", |b| b.run_id = "run-18".into()),
        ("request_digest", |b| {
            b.request_digest = Bytes::copy_from_slice(&[0x5a; 32])
        }),
    ]
}

#[test]
fn each_binding_field_mismatch_is_rejected() {
    // CONTRACT: C5 — no lease accepted for another node/target/revision/generation:
    // a valid lease issued for a binding that differs in one field is refused.
    let f = fixture();
    let ctx = context(&f, NOW_MS);
    for (field, mutate) in mutations() {
        let mut binding = f.binding.clone();
        mutate(&mut binding);
        let lease = issue_for(&f, "lease-1", &binding);
        let err = open_err(&lease, &binding, &ctx);
        assert_eq!(err, LeaseError::ScopeMismatch { field }, "{field}");
        assert_eq!(err.failure_code(), "lease_scope_mismatch");
    }
}

#[test]
fn unknown_scope_fields_are_covered_by_the_signature_only() {
    // The Node checks the optional fields only when it knows them.
    let f = fixture();
    let mut binding = f.binding.clone();
    binding.principal = "client-b".into();
    binding.projection_generation = 99;
    let lease = issue_for(&f, "lease-1", &binding);
    let ctx = OpenContext {
        scope: ExpectedScope {
            principal: None,
            projection_generation: None,
            ..scope(&f, &f.binding)
        },
        ..context(&f, NOW_MS)
    };
    let opened = open_ok(&lease, &binding, &ctx, &mut guard());
    assert_eq!(opened.secret_bytes(), SECRET);
}

#[test]
fn binding_that_differs_from_the_signed_digest_is_invalid() {
    // CONTRACT: C3 — the binding sent beside the lease cannot be rewritten.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut all = mutations();
    all.push(("recipient", |b| {
        b.recipient = recipient_key_id(&PublicKey::from([1u8; 32]))
    }));
    for (field, mutate) in all {
        let mut binding = f.binding.clone();
        mutate(&mut binding);
        let err = open_err(&lease, &binding, &ctx);
        assert_eq!(err, LeaseError::DigestMismatch, "{field}");
        assert_eq!(err.failure_code(), "lease_invalid");
    }
}

#[test]
fn time_window_edges() {
    // CONTRACT: C3 — expired and not-yet-valid leases are refused; the window is
    // [not_before − skew, expires_at + skew).
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let skew = i64::from(SKEW_MS);

    let err = open_err(&lease, &f.binding, &context(&f, EXPIRES_AT_MS + skew));
    assert_eq!(err, LeaseError::Expired);
    assert_eq!(err.failure_code(), "lease_expired");
    let err = open_err(&lease, &f.binding, &context(&f, NOT_BEFORE_MS - skew - 1));
    assert_eq!(err, LeaseError::NotYetValid);
    assert_eq!(err.failure_code(), "lease_expired");

    for now in [NOT_BEFORE_MS - skew, EXPIRES_AT_MS + skew - 1] {
        let opened = open_ok(&lease, &f.binding, &context(&f, now), &mut guard());
        assert_eq!(opened.secret_bytes(), SECRET, "now {now}");
    }
}

#[test]
fn second_open_of_a_lease_is_replayed() {
    // CONTRACT: C2 — replay state is checked; C3 — a replayed lease is refused.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut replay = guard();
    drop(open_ok(&lease, &f.binding, &ctx, &mut replay));
    let again = open(Some(&lease), Some(&f.binding), &ctx, &mut replay);
    assert_eq!(again.as_ref().err(), Some(&LeaseError::Replayed));
    assert_eq!(LeaseError::Replayed.failure_code(), "lease_replayed");
    // Still refused at the last acceptable millisecond.
    let last = context(&f, EXPIRES_AT_MS + i64::from(SKEW_MS) - 1);
    let again = open(Some(&lease), Some(&f.binding), &last, &mut replay);
    assert_eq!(again.err(), Some(LeaseError::Replayed));
}

#[test]
fn swapped_issuer_key_is_invalid() {
    // CONTRACT: C3 — a lease signed by another issuer is refused.
    let f = fixture();
    let rogue = SigningKey::from_bytes(&[42u8; 32]);
    let lease = match issue(
        &params("lease-1", &f.binding),
        &rogue,
        &f.recipient.public_key(),
        entropy(3),
    ) {
        Ok(lease) => lease,
        Err(e) => panic!("issue failed: {e}"),
    };
    let ctx = context(&f, NOW_MS);
    let err = open_err(&lease, &f.binding, &ctx);
    assert_eq!(err, LeaseError::WrongIssuer);
    assert_eq!(err.failure_code(), "lease_invalid");

    // Claiming the configured issuer's key id does not help.
    let mut forged = lease.clone();
    forged.issuer_key_id = issuer_key_id(f.issuer.as_ref());
    sign(&mut forged, &rogue);
    assert_eq!(
        open_err(&forged, &f.binding, &ctx),
        LeaseError::BadSignature
    );

    // A Node configured with the rogue key refuses the genuine lease.
    let genuine = issue_for(&f, "lease-2", &f.binding);
    let rogue_public = rogue.verifying_key();
    let ctx = OpenContext {
        issuer: &rogue_public,
        ..context(&f, NOW_MS)
    };
    assert_eq!(
        open_err(&genuine, &f.binding, &ctx),
        LeaseError::WrongIssuer
    );
}

#[test]
fn malformed_fields_are_invalid_before_any_crypto() {
    // CONTRACT: C3 — invalid structure.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    type Tamper = fn(&mut CredentialLease);
    let cases: [(&str, Tamper); 12] = [
        ("lease_id", |l| l.lease_id.clear()),
        ("lease_id", |l| l.lease_id = "a b".into()),
        ("header_name", |l| l.header_name = "Auth\r\nX".into()),
        ("header_format", |l| l.header_format = "Bearer".into()),
        ("header_format", |l| {
            l.header_format = "Bearer {secret}\n".into()
        }),
        ("validity window", |l| {
            l.expires_at_unix_ms = l.not_before_unix_ms
        }),
        ("validity window", |l| {
            l.expires_at_unix_ms = l.not_before_unix_ms + MAX_LEASE_LIFETIME_MS + 1
        }),
        ("binding_digest", |l| {
            l.binding_digest = Bytes::from_static(&[0; 31])
        }),
        ("ephemeral_public_key", |l| {
            l.ephemeral_public_key = Bytes::new()
        }),
        ("ephemeral_public_key", |l| {
            l.ephemeral_public_key = Bytes::from_static(&[9; 33])
        }),
        ("sequence", |l| l.sequence = 0),
        ("sealed_secret", |l| {
            l.sealed_secret = Bytes::from_static(&[0; 16])
        }),
    ];
    for (field, tamper) in cases {
        let mut bad = lease.clone();
        tamper(&mut bad);
        let err = open_err(&bad, &f.binding, &ctx);
        assert_eq!(err, LeaseError::Malformed { field }, "{field}");
        assert_eq!(err.failure_code(), "lease_invalid");
    }
    let mut bad = lease.clone();
    bad.signature = Bytes::from_static(&[0; 63]);
    assert_eq!(
        open_err(&bad, &f.binding, &ctx),
        LeaseError::Malformed { field: "signature" }
    );
    let mut binding = f.binding.clone();
    binding.recipient = "ABC".into();
    assert_eq!(
        open_err(&lease, &binding, &ctx),
        LeaseError::Malformed {
            field: "binding.recipient"
        }
    );
    type BindingTamper = fn(&mut CredentialLeaseBinding);
    let binding_cases: [(&str, BindingTamper); 7] = [
        ("binding.upstream_origin", |b| b.upstream_origin.clear()),
        ("binding.upstream_origin", |b| {
            b.upstream_origin = "ftp://api.example.com:21".into()
        }),
        ("binding.upstream_origin", |b| {
            b.upstream_origin = "http://a b".into()
        }),
        ("binding.run_id", |b| b.run_id.clear()),
        ("binding.request_digest", |b| {
            b.request_digest = Bytes::from_static(&[0; 31])
        }),
        ("binding.provider_trust", |b| {
            b.provider_trust = Bytes::new()
        }),
        ("binding.provider_trust", |b| {
            b.provider_trust = Bytes::from_static(&[0; 33])
        }),
    ];
    for (field, tamper) in binding_cases {
        let mut binding = f.binding.clone();
        tamper(&mut binding);
        assert_eq!(
            open_err(&lease, &binding, &ctx),
            LeaseError::Malformed { field },
            "{field}"
        );
    }
    assert_eq!(
        open_err(&CredentialLease::default(), &f.binding, &ctx),
        LeaseError::Malformed { field: "lease_id" }
    );
}

#[test]
fn issue_refuses_what_a_node_would_refuse() {
    let f = fixture();
    let recipient = f.recipient.public_key();
    let check = |p: IssueParams<'_>, field: &'static str| {
        let result = issue(&p, &f.issuer, &recipient, entropy(3));
        assert_eq!(result.err(), Some(IssueError::Invalid { field }), "{field}");
    };
    check(
        IssueParams {
            secret: b"sk\r\nInjected: 1",
            ..params("lease-1", &f.binding)
        },
        "secret",
    );
    check(
        IssueParams {
            secret: b"",
            ..params("lease-1", &f.binding)
        },
        "secret",
    );
    check(
        IssueParams {
            header_format: "Bearer",
            ..params("lease-1", &f.binding)
        },
        "header_format",
    );
    check(
        IssueParams {
            header_name: "",
            ..params("lease-1", &f.binding)
        },
        "header_name",
    );
    check(
        IssueParams {
            expires_at_unix_ms: NOT_BEFORE_MS + MAX_LEASE_LIFETIME_MS + 1,
            ..params("lease-1", &f.binding)
        },
        "validity window",
    );
    check(
        IssueParams {
            sequence: 0,
            ..params("lease-1", &f.binding)
        },
        "sequence",
    );
    let mut empty_slot = f.binding.clone();
    empty_slot.slot.clear();
    check(params("lease-1", &empty_slot), "binding.slot");
    let mut no_origin = f.binding.clone();
    no_origin.upstream_origin.clear();
    check(params("lease-1", &no_origin), "binding.upstream_origin");
}

#[test]
fn low_order_recipient_key_is_refused_at_issue() {
    let f = fixture();
    let zero = PublicKey::from([0u8; 32]);
    let mut binding = f.binding.clone();
    binding.recipient = recipient_key_id(&zero);
    let result = issue(&params("lease-1", &binding), &f.issuer, &zero, entropy(3));
    assert_eq!(result.err(), Some(IssueError::NonContributory));
}

#[test]
fn replay_window_flood_cannot_make_a_fresh_lease_fail() {
    // CONTRACT: C2 — replay state is bounded by construction: a flood of
    // opened leases on one session slides its window, it fills nothing, and
    // a fresh valid lease still opens.
    let f = fixture();
    let mut replay = ReplayGuard::with_limits(STARTED_MS, 64, 2);
    assert_eq!((replay.window_leases(), replay.max_windows()), (64, 2));
    assert_eq!(replay.memory_bound_bytes(), 2 * 8);
    let ctx = context(&f, NOW_MS);
    for sequence in 1..=1_000 {
        let lease = issue_seq(&f, sequence, NOT_BEFORE_MS);
        drop(open_ok(&lease, &f.binding, &ctx, &mut replay));
    }
    assert_eq!(replay.windows(), 1);
    let fresh = issue_seq(&f, 1_001, NOT_BEFORE_MS);
    assert_eq!(
        open_ok(&fresh, &f.binding, &ctx, &mut replay).secret_bytes(),
        SECRET
    );
    // Every lease of the flood inside the window is still a replay; older
    // ones are refused as older than the window.
    let again = issue_seq(&f, 990, NOT_BEFORE_MS);
    assert_eq!(
        open(Some(&again), Some(&f.binding), &ctx, &mut replay).err(),
        Some(LeaseError::Replayed)
    );
    let stale = issue_seq(&f, 900, NOT_BEFORE_MS);
    let err = open(Some(&stale), Some(&f.binding), &ctx, &mut replay).err();
    assert_eq!(err, Some(LeaseError::SequenceTooOld));
    assert_eq!(LeaseError::SequenceTooOld.failure_code(), "lease_replayed");
    // Within the window, a lease that arrives late (reordered) opens once.
    let mut late = ReplayGuard::with_limits(STARTED_MS, 64, 2);
    for sequence in [10, 3, 70, 8] {
        let lease = issue_seq(&f, sequence, NOT_BEFORE_MS);
        drop(open_ok(&lease, &f.binding, &ctx, &mut late));
    }
    for sequence in [10, 70, 8] {
        assert!(late.contains(8, sequence), "{sequence}");
        assert_eq!(late.check(8, sequence), Err(LeaseError::Replayed));
    }
    // 3 slid out of the window when 70 arrived (70 − 3 ≥ 64).
    assert_eq!(late.check(8, 3), Err(LeaseError::SequenceTooOld));
    assert_eq!(late.check(8, 9), Ok(()));
    assert_eq!(late.check(8, 71), Ok(()));
}

#[test]
fn replay_windows_are_per_session_and_fail_closed_when_all_are_in_use() {
    // CONTRACT: C2 — a lease of a new session finds no room only while every
    // window holds valid leases; it is refused (fail closed), the sessions
    // in use go on, and room returns when their leases expire.
    let f = fixture();
    let mut replay = ReplayGuard::with_limits(STARTED_MS, 64, 2);
    let session = |projection: u64, sequence: u64, not_before: i64| {
        let mut binding = f.binding.clone();
        binding.projection_generation = projection;
        let lease = issue_with(
            &f,
            &IssueParams {
                sequence,
                not_before_unix_ms: not_before,
                expires_at_unix_ms: not_before + 10_000,
                ..params("lease-s", &binding)
            },
        );
        (lease, binding)
    };
    let scoped = |binding: &CredentialLeaseBinding, now| {
        let mut ctx = context(&f, now);
        ctx.scope.projection_generation = Some(binding.projection_generation);
        ctx
    };
    let (a, ab) = session(1, 1, NOW_MS - 5_000);
    let (b, bb) = session(2, 1, NOW_MS);
    let (c, cb) = session(3, 1, NOW_MS);
    drop(open_ok(&a, &ab, &scoped(&ab, NOW_MS), &mut replay));
    drop(open_ok(&b, &bb, &scoped(&bb, NOW_MS), &mut replay));
    assert!(replay.is_near_full());
    let full = open(Some(&c), Some(&cb), &scoped(&cb, NOW_MS), &mut replay);
    assert_eq!(full.err(), Some(LeaseError::ReplayWindowsFull));
    assert_eq!(
        LeaseError::ReplayWindowsFull.failure_code(),
        "lease_replayed"
    );
    // The sessions in use still open their next leases.
    let (a2, _) = session(1, 2, NOW_MS - 5_000);
    drop(open_ok(&a2, &ab, &scoped(&ab, NOW_MS), &mut replay));
    // Session 1's leases are all past expires_at + skew at this time: its
    // window goes, and session 3 gets room.
    let a_gone = NOW_MS - 5_000 + 10_000 + i64::from(SKEW_MS);
    assert_eq!(replay.prune(a_gone - 1), 0);
    drop(open_ok(&c, &cb, &scoped(&cb, a_gone), &mut replay));
    assert_eq!(replay.windows(), 2);
    assert!(!replay.contains(1, 1));
    assert!(replay.contains(3, 1));
    // The defaults: 16,384 sequences per window, 1,024 windows, 2 MiB.
    let defaults = ReplayGuard::new(STARTED_MS);
    assert_eq!(defaults.window_leases(), REPLAY_WINDOW_LEASES);
    assert_eq!(defaults.max_windows(), REPLAY_MAX_WINDOWS);
    assert_eq!(defaults.memory_bound_bytes(), 2 * 1024 * 1024);
}

#[test]
fn lease_issued_before_the_guard_started_is_refused() {
    // CONTRACT: C2 — replay state does not survive a Node restart, so a
    // lease issued before the restart (minus skew) is refused after it,
    // even one the new process never saw.
    let f = fixture();
    let lease = issue_seq(&f, 1, NOT_BEFORE_MS);
    let ctx = context(&f, NOW_MS);
    let skew = i64::from(SKEW_MS);
    let mut before = ReplayGuard::new(NOT_BEFORE_MS);
    drop(open_ok(&lease, &f.binding, &ctx, &mut before));
    let mut restarted = ReplayGuard::new(NOT_BEFORE_MS + skew + 1);
    let err = open(Some(&lease), Some(&f.binding), &ctx, &mut restarted).err();
    assert_eq!(err, Some(LeaseError::IssuedBeforeStart));
    assert_eq!(
        LeaseError::IssuedBeforeStart.failure_code(),
        "lease_replayed"
    );
    // Within the skew of the start it is still accepted (clocks differ).
    let mut just_after = ReplayGuard::new(NOT_BEFORE_MS + skew);
    drop(open_ok(&lease, &f.binding, &ctx, &mut just_after));
    // A lease issued after the restart opens.
    let fresh = issue_seq(&f, 2, NOT_BEFORE_MS + skew + 1);
    drop(open_ok(&fresh, &f.binding, &ctx, &mut restarted));
}

#[test]
fn a_clock_stepped_back_does_not_readmit_a_used_lease() {
    // CONTRACT: C2 — the guard's clock never goes backwards: once a
    // session's window was pruned, stepping the wall clock back into its
    // leases' validity does not make them openable again.
    let f = fixture();
    let lease = issue_seq(&f, 1, NOT_BEFORE_MS);
    let mut replay = guard();
    drop(open_ok(
        &lease,
        &f.binding,
        &context(&f, NOW_MS),
        &mut replay,
    ));
    let keep_until = NOT_BEFORE_MS + 60_000 + i64::from(SKEW_MS);
    assert_eq!(replay.prune(keep_until), 1);
    assert_eq!(replay.windows(), 0);
    // The wall clock is stepped back into the lease's window.
    let err = open(
        Some(&lease),
        Some(&f.binding),
        &context(&f, NOW_MS),
        &mut replay,
    )
    .err();
    assert_eq!(err, Some(LeaseError::Expired));
    assert_eq!(replay.clock_unix_ms(), keep_until);
    assert_eq!(replay.observe_clock(NOW_MS), keep_until);
    // Once the wall clock passes the guard's clock again, time moves on.
    assert_eq!(replay.observe_clock(keep_until + 5), keep_until + 5);
    // A replay inside the window is refused whatever the clock says.
    let second = issue_seq(&f, 2, keep_until);
    let ctx = context(&f, keep_until + 10);
    drop(open_ok(&second, &f.binding, &ctx, &mut replay));
    let back = context(&f, keep_until - 30_000);
    let err = open(Some(&second), Some(&f.binding), &back, &mut replay).err();
    assert_eq!(err, Some(LeaseError::Replayed));
}
#[test]
fn opened_secret_is_redacted_and_zeroizable() {
    // CONTRACT: C4 — plaintext never reaches Debug output.
    // CONTRACT: C5 — the plaintext is zeroized, not kept.
    fn zeroize_on_drop<T: ZeroizeOnDrop>(_: &T) {}
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let mut opened = open_ok(&lease, &f.binding, &context(&f, NOW_MS), &mut guard());
    zeroize_on_drop(&opened);
    assert_eq!(format!("{opened:?}"), "OpenedSecret(<redacted>)");
    assert_eq!(
        opened.header_value("{secret}|{secret}").as_str(),
        "sk-live-TOPSECRET-0123456789|sk-live-TOPSECRET-0123456789"
    );
    assert_eq!(
        opened.header_value("no placeholder").as_str(),
        "no placeholder"
    );
    opened.zeroize();
    assert_eq!(opened.secret_bytes(), b"");
    assert_eq!(opened.declared_header_value().as_str(), "Bearer ");
}

#[test]
fn debug_of_secret_holding_types_is_redacted() {
    // CONTRACT: C4 — neither the provider plaintext nor private keys appear in
    // Debug output of any type that holds them.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let mut replay = guard();
    let ctx = context(&f, NOW_MS);
    let opened = open_ok(&lease, &f.binding, &ctx, &mut replay);
    let p = params("lease-1", &f.binding);
    let entropy = LeaseEntropy::from_seed([0xab; 32]);
    let outputs = [
        format!("{opened:?}"),
        format!("{p:?}"),
        format!("{:?}", f.recipient),
        format!("{ctx:?}"),
        format!("{entropy:?}"),
        format!("{replay:?}"),
        format!("{:?}", f.issuer),
    ];
    let secret_text = String::from_utf8_lossy(SECRET).into_owned();
    let forbidden = [
        secret_text.clone(),
        "TOPSECRET".to_owned(),
        format!("{SECRET:?}"),
        encode_hex(SECRET),
        format!("{:?}", RECIPIENT_SEED),
        encode_hex(&RECIPIENT_SEED),
        format!("{:?}", ISSUER_SEED),
        encode_hex(&ISSUER_SEED),
        format!("{:?}", [0xabu8; 32]),
        "171, 171".to_owned(),
    ];
    for output in &outputs {
        for needle in &forbidden {
            assert!(
                !output.contains(needle.as_str()),
                "{output} contains {needle}"
            );
        }
    }
    assert_eq!(format!("{entropy:?}"), "LeaseEntropy(<redacted>)");
    assert!(outputs[2].contains(f.recipient.key_id()));
}

#[test]
fn digests_are_the_documented_canonical_encodings() {
    fn field(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
        out.push(tag);
        out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        out.extend_from_slice(bytes);
    }
    fn number(out: &mut Vec<u8>, tag: u8, value: u64) {
        out.push(tag);
        out.extend_from_slice(&value.to_be_bytes());
    }
    let f = fixture();
    let b = &f.binding;
    let mut enc = Vec::new();
    field(&mut enc, 0, b"iop-lease-binding-v2");
    field(&mut enc, 1, b.principal.as_bytes());
    field(&mut enc, 2, b.slot.as_bytes());
    field(&mut enc, 3, b.route.as_bytes());
    field(&mut enc, 4, b.profile.as_bytes());
    field(&mut enc, 5, b.upstream_target.as_bytes());
    field(&mut enc, 6, b.selected_node.as_bytes());
    field(&mut enc, 7, b.recipient.as_bytes());
    for (tag, v) in [(8u8, 3u64), (9, 5), (10, 8)] {
        number(&mut enc, tag, v);
    }
    field(&mut enc, 11, ORIGIN.as_bytes());
    field(&mut enc, 12, b"run-17");
    field(&mut enc, 13, &f.request_digest);
    field(&mut enc, 14, &f.provider_trust);
    assert_eq!(binding_digest(b), *blake3::hash(&enc).as_bytes());

    // The provider trust: its kind, then (a private CA) the certificates
    // sorted bytewise, without repetitions.
    let trust = |kind: u64, certificates: &[&[u8]]| {
        let mut enc = Vec::new();
        field(&mut enc, 0, b"iop-lease-provider-trust-v2");
        number(&mut enc, 1, kind);
        if kind == 3 {
            number(&mut enc, 2, certificates.len() as u64);
            for certificate in certificates {
                field(&mut enc, 3, certificate);
            }
        }
        *blake3::hash(&enc).as_bytes()
    };
    assert_eq!(f.provider_trust, trust(3, &[CA_A]));
    assert_eq!(
        provider_trust_digest(&ProviderTrust::PrivateCa(vec![CA_B, CA_A, CA_B])),
        trust(3, &[CA_A, CA_B])
    );
    for (kind, plain) in [
        (1, ProviderTrust::PlainHttp),
        (2, ProviderTrust::DefaultRoots),
        (4, ProviderTrust::Unverified),
    ] {
        assert_eq!(provider_trust_digest(&plain), trust(kind, &[]), "{kind}");
    }

    let mut enc = Vec::new();
    field(&mut enc, 0, b"iop-lease-request-v2");
    field(&mut enc, 1, b"POST");
    field(&mut enc, 2, PATH.as_bytes());
    number(&mut enc, 3, 1);
    field(&mut enc, 4, b"content-type");
    field(&mut enc, 5, b"application/json");
    field(&mut enc, 6, BODY);
    assert_eq!(f.request_digest, *blake3::hash(&enc).as_bytes());

    // Moving bytes across a field boundary changes the digest.
    let mut shifted = b.clone();
    shifted.principal = "client-ao".into();
    shifted.slot = "penai-primary".into();
    assert_ne!(binding_digest(b), binding_digest(&shifted));
    let split = [Header {
        name: "content-typ".into(),
        value: Bytes::from_static(b"eapplication/json"),
    }];
    assert_ne!(request_digest(&request(&split)), f.request_digest);
}
#[test]
fn key_ids_and_hex() {
    let f = fixture();
    let public = f.recipient.public_key();
    assert_eq!(
        recipient_key_id(&public),
        encode_hex(blake3::hash(public.as_bytes()).as_bytes())
    );
    assert_eq!(f.recipient.key_id(), recipient_key_id(&public));
    assert_eq!(f.recipient.key_id().len(), 64);
    let issuer_public = f.issuer.verifying_key();
    assert_eq!(
        issuer_key_id(&issuer_public),
        encode_hex(blake3::hash(issuer_public.as_bytes()).as_bytes())
    );
    assert_eq!(encode_hex(&[0x00, 0x9f, 0xff]), "009fff");
    assert_eq!(decode_hex::<3>("009FfF"), Some([0x00, 0x9f, 0xff]));
    assert_eq!(decode_hex::<3>("009ff"), None);
    assert_eq!(decode_hex::<3>("009ffg"), None);
    assert_eq!(decode_hex::<2>("009fff"), None);
    let mut out = [0u8; 2];
    assert!(decode_hex_into("a0B1", &mut out));
    assert_eq!(out, [0xa0, 0xb1]);
    assert!(!decode_hex_into("a0B", &mut out));
    assert_eq!(upstream_target("openai-1", "gpt-4o"), "openai-1/gpt-4o");
    assert_eq!(
        upstream_origin("http", "10.0.0.5", 8000),
        "http://10.0.0.5:8000"
    );
    assert_eq!(upstream_origin("http", "::1", 80), "http://[::1]:80");
    assert_eq!(
        upstream_origin("https", "api.example.com", 443),
        "https://api.example.com:443"
    );
}

#[test]
fn failure_codes_cover_the_contract_list() {
    let cases = [
        (LeaseError::LeaseMissing, "lease_missing"),
        (LeaseError::BindingMissing, "lease_missing"),
        (LeaseError::Malformed { field: "sequence" }, "lease_invalid"),
        (LeaseError::WrongIssuer, "lease_invalid"),
        (LeaseError::BadSignature, "lease_invalid"),
        (LeaseError::DigestMismatch, "lease_invalid"),
        (LeaseError::WrongRecipient, "lease_invalid"),
        (LeaseError::Revoked { revision: 3 }, "lease_invalid"),
        (LeaseError::NoSharedSecret, "lease_invalid"),
        (LeaseError::Decrypt, "lease_invalid"),
        (LeaseError::BadSecret, "lease_invalid"),
        (LeaseError::NotYetValid, "lease_expired"),
        (LeaseError::Expired, "lease_expired"),
        (LeaseError::Replayed, "lease_replayed"),
        (LeaseError::SequenceTooOld, "lease_replayed"),
        (LeaseError::IssuedBeforeStart, "lease_replayed"),
        (LeaseError::ReplayWindowsFull, "lease_replayed"),
        (LeaseError::OriginNotAllowed, "lease_scope_mismatch"),
        (
            LeaseError::ScopeMismatch { field: "slot" },
            "lease_scope_mismatch",
        ),
    ];
    for (err, code) in cases {
        assert_eq!(err.failure_code(), code, "{err:?}");
    }
}

/// Curve25519 points of small order (and non-canonical encodings of them):
/// any clamped scalar times one of them is the all-zero point.
const LOW_ORDER_POINTS: [&str; 7] = [
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
    "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
];

#[test]
fn low_order_ephemeral_key_with_a_valid_signature_is_refused() {
    // CONTRACT: C3 — even an issuer-signed lease whose ephemeral key is a
    // low-order point (no shared secret) is refused before any decryption,
    // and leaves no replay state behind.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut replay = guard();
    for point in LOW_ORDER_POINTS {
        let Some(bytes) = decode_hex::<32>(point) else {
            panic!("bad test vector {point}")
        };
        let mut bad = lease.clone();
        bad.ephemeral_public_key = Bytes::copy_from_slice(&bytes);
        sign(&mut bad, &f.issuer);
        let err = open(Some(&bad), Some(&f.binding), &ctx, &mut replay).err();
        assert_eq!(err, Some(LeaseError::NoSharedSecret), "{point}");
        assert_eq!(LeaseError::NoSharedSecret.failure_code(), "lease_invalid");
        // And the Edge never seals to such a key.
        let to = PublicKey::from(bytes);
        let mut binding = f.binding.clone();
        binding.recipient = recipient_key_id(&to);
        let issued = issue(&params("lease-1", &binding), &f.issuer, &to, entropy(3));
        assert_eq!(issued.err(), Some(IssueError::NonContributory), "{point}");
    }
    assert_eq!(replay.windows(), 0);
    assert_eq!(
        open_ok(&lease, &f.binding, &ctx, &mut replay).secret_bytes(),
        SECRET
    );
}

#[test]
fn the_destination_and_the_request_are_bound() {
    // CONTRACT: C2, C5 — a genuine lease opens only for a request to the
    // origin it was issued for and for exactly the request it was issued
    // for: another origin (a `base_url` rewritten by config), another run,
    // method, path, header set or body is a scope mismatch.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let base = headers();
    let mismatch = |origin: &str, run_id: &str, req: BoundRequest<'_>| {
        let digest = request_digest(&req);
        let ctx = OpenContext {
            scope: ExpectedScope {
                upstream_origin: origin,
                run_id,
                request_digest: &digest,
                ..scope(&f, &f.binding)
            },
            ..context(&f, NOW_MS)
        };
        open_err(&lease, &f.binding, &ctx)
    };
    let field = |field| LeaseError::ScopeMismatch { field };
    assert_eq!(
        mismatch("http://attacker.example:8000", "run-17", request(&base)),
        field("upstream_origin")
    );
    assert_eq!(
        mismatch("http://10.0.0.5:8001", "run-17", request(&base)),
        field("upstream_origin")
    );
    assert_eq!(mismatch(ORIGIN, "run-18", request(&base)), field("run_id"));
    let other_path = BoundRequest {
        path: "/v1/responses",
        ..request(&base)
    };
    let other_method = BoundRequest {
        method: "PUT",
        ..request(&base)
    };
    let other_body = BoundRequest {
        body: &[Bytes::from_static(br#"{"model":"gpt-4o","messages":[1]}"#)],
        ..request(&base)
    };
    let mut extra = base.clone();
    extra.push(Header {
        name: "openai-project".into(),
        value: Bytes::from_static(b"proj_other"),
    });
    for (what, req) in [
        ("path", other_path),
        ("method", other_method),
        ("body", other_body),
        ("headers", request(&extra)),
        ("no headers", request(&[])),
    ] {
        assert_eq!(
            mismatch(ORIGIN, "run-17", req),
            field("request_digest"),
            "{what}"
        );
    }
    assert_eq!(
        field("request_digest").failure_code(),
        "lease_scope_mismatch"
    );
    // The request it was issued for opens.
    let ok = open_ok(&lease, &f.binding, &context(&f, NOW_MS), &mut guard());
    assert_eq!(ok.secret_bytes(), SECRET);
}

#[test]
fn the_provider_trust_digest_names_the_set_of_anchors() {
    // CONTRACT: C5 — the digest a lease binds changes with whom the Node
    // trusts: another CA, one CA more or less, no private CA (default
    // roots), no TLS or no verification; it does not change with the order
    // of a bundle or a certificate listed twice.
    let digest = |trust: ProviderTrust<'_>| provider_trust_digest(&trust);
    let a = digest(ProviderTrust::PrivateCa(vec![CA_A]));
    let ab = digest(ProviderTrust::PrivateCa(vec![CA_A, CA_B]));
    assert_eq!(ab, digest(ProviderTrust::PrivateCa(vec![CA_B, CA_A])));
    assert_eq!(ab, digest(ProviderTrust::PrivateCa(vec![CA_B, CA_A, CA_A])));
    assert_eq!(a, digest(ProviderTrust::PrivateCa(vec![CA_A, CA_A])));
    let all = [
        a,
        ab,
        digest(ProviderTrust::PrivateCa(vec![CA_B])),
        digest(ProviderTrust::PrivateCa(vec![CA_A, CA_B, CA_C])),
        // The empty set is not "no private CA".
        digest(ProviderTrust::PrivateCa(Vec::new())),
        digest(ProviderTrust::DefaultRoots),
        digest(ProviderTrust::PlainHttp),
        digest(ProviderTrust::Unverified),
    ];
    for (i, x) in all.iter().enumerate() {
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
    // Bytes moved between two certificates make another set.
    assert_ne!(
        digest(ProviderTrust::PrivateCa(vec![b"ab", b"c"])),
        digest(ProviderTrust::PrivateCa(vec![b"a", b"bc"]))
    );
}

#[test]
fn a_lease_opens_only_under_the_provider_trust_it_was_issued_for() {
    // CONTRACT: C2, C5 — the provider CA comes from the config the link
    // pushes: a Node whose client trusts another CA set (the attacker's,
    // one more CA next to the genuine one, or the default roots instead of
    // the private CA) refuses a genuine lease with a scope mismatch, before
    // any decryption; under the trust it was issued for it opens.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    for other in [
        ProviderTrust::PrivateCa(vec![CA_B]),
        ProviderTrust::PrivateCa(vec![CA_A, CA_B]),
        ProviderTrust::DefaultRoots,
        ProviderTrust::Unverified,
    ] {
        let trust = provider_trust_digest(&other);
        let ctx = OpenContext {
            scope: ExpectedScope {
                provider_trust: &trust,
                ..scope(&f, &f.binding)
            },
            ..context(&f, NOW_MS)
        };
        let err = open_err(&lease, &f.binding, &ctx);
        assert_eq!(
            err,
            LeaseError::ScopeMismatch {
                field: "provider_trust"
            },
            "{other:?}"
        );
        assert_eq!(err.failure_code(), "lease_scope_mismatch");
        assert_eq!(
            err.to_string(),
            "credential binding scope mismatch: provider_trust"
        );
    }
    // The same set of anchors, with the CA listed twice in the bundle.
    let same = provider_trust_digest(&ProviderTrust::PrivateCa(vec![CA_A, CA_A]));
    let ctx = OpenContext {
        scope: ExpectedScope {
            provider_trust: &same,
            ..scope(&f, &f.binding)
        },
        ..context(&f, NOW_MS)
    };
    assert_eq!(
        open_ok(&lease, &f.binding, &ctx, &mut guard()).secret_bytes(),
        SECRET
    );
}

#[test]
fn a_revoked_revision_is_refused_by_the_node() {
    // CONTRACT: C3 — revocations reach the Node, which refuses a lease of a
    // revoked revision itself, even one issued before the revocation.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let revoked = [
        RevokedCredential {
            slot: "other-slot".into(),
            revisions: vec![3],
        },
        RevokedCredential {
            slot: "openai-primary".into(),
            revisions: vec![1, 3],
        },
    ];
    let ctx = OpenContext {
        revoked: &revoked,
        ..context(&f, NOW_MS)
    };
    let err = open_err(&lease, &f.binding, &ctx);
    assert_eq!(err, LeaseError::Revoked { revision: 3 });
    assert_eq!(err.failure_code(), "lease_invalid");
    assert_eq!(err.to_string(), "credential revision 3 is revoked");
    // Another slot's revocation of the same number, or an older revision of
    // this slot, is no obstacle.
    let unrelated = [
        RevokedCredential {
            slot: "other-slot".into(),
            revisions: vec![3],
        },
        RevokedCredential {
            slot: "openai-primary".into(),
            revisions: vec![2],
        },
    ];
    let ctx = OpenContext {
        revoked: &unrelated,
        ..context(&f, NOW_MS)
    };
    assert_eq!(
        open_ok(&lease, &f.binding, &ctx, &mut guard()).secret_bytes(),
        SECRET
    );
}

#[test]
fn origin_pins_keep_a_signed_lease_from_other_origins() {
    // CONTRACT: C2, C5 — a slot pinned in node.toml opens only for its
    // origins, even for a lease the issuer signed for another origin.
    let mut f = fixture();
    let mut elsewhere = f.binding.clone();
    elsewhere.upstream_origin = "http://10.9.9.9:8000".into();
    let lease = issue_for(&f, "lease-1", &elsewhere);
    f.pins.allow("openai-primary", ORIGIN);
    f.pins.allow("openai-primary", "http://10.0.0.7:8000");
    assert!(!f.pins.is_empty());
    assert!(f.pins.allows("unpinned-slot", "http://anywhere:1"));
    let ctx = OpenContext {
        scope: ExpectedScope {
            upstream_origin: "http://10.9.9.9:8000",
            ..scope(&f, &elsewhere)
        },
        ..context(&f, NOW_MS)
    };
    let err = open_err(&lease, &elsewhere, &ctx);
    assert_eq!(err, LeaseError::OriginNotAllowed);
    assert_eq!(err.failure_code(), "lease_scope_mismatch");
    // A pinned origin opens.
    let lease = issue_for(&f, "lease-2", &f.binding);
    assert_eq!(
        open_ok(&lease, &f.binding, &context(&f, NOW_MS), &mut guard()).secret_bytes(),
        SECRET
    );
}

#[test]
fn the_request_digest_covers_the_body_however_it_is_cut() {
    // CONTRACT: C1, C2 — the Edge binds a lease to the body it sends in pieces
    // (the client's bytes with `model` spliced in); the Node checks it
    // against the one buffer it received: the same bytes, the same digest.
    let base = headers();
    let whole = request_digest(&request(&base));
    let body = Bytes::from_static(BODY);
    for (a, b) in [(0, 0), (3, 9), (9, 9), (BODY.len(), BODY.len())] {
        let pieces = [body.slice(..a), body.slice(a..b), body.slice(b..)];
        let cut = BoundRequest {
            body: &pieces,
            ..request(&base)
        };
        assert_eq!(request_digest(&cut), whole, "cut at {a}/{b}");
    }
    // One byte moved between pieces is still the same body; one byte
    // changed is not.
    let mut changed = BODY.to_vec();
    changed[2] ^= 1;
    let changed = [Bytes::from(changed)];
    assert_ne!(
        request_digest(&BoundRequest {
            body: &changed,
            ..request(&base)
        }),
        whole
    );
}
