//! Credential lease sealing and opening (C1–C5): round trip, every rejection
//! path with its failure code, replay-cache bounds, redaction and zeroizing.

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use iop_wire::lease::{
    binding_digest, decode_hex, encode_hex, issue, issuer_key_id, open, recipient_key_id, sign,
    upstream_target, ExpectedScope, IssueError, IssueParams, LeaseEntropy, LeaseError, OpenContext,
    OpenedSecret, RecipientKey, ReplayCache, MAX_LEASE_LIFETIME_MS,
};
use iop_wire::pb::{CredentialLease, CredentialLeaseBinding};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::{Zeroize, ZeroizeOnDrop};

const SECRET: &[u8] = b"sk-live-TOPSECRET-0123456789";
const ISSUER_SEED: [u8; 32] = [7; 32];
const RECIPIENT_SEED: [u8; 32] = [9; 32];
const NOT_BEFORE_MS: i64 = 1_000_000;
const EXPIRES_AT_MS: i64 = 1_060_000;
const NOW_MS: i64 = 1_030_000;
const SKEW_MS: u32 = 2_000;

struct Fixture {
    issuer: SigningKey,
    recipient: RecipientKey,
    binding: CredentialLeaseBinding,
}

fn fixture() -> Fixture {
    let recipient = RecipientKey::from_secret(StaticSecret::from(RECIPIENT_SEED));
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
    };
    Fixture {
        issuer: SigningKey::from_bytes(&ISSUER_SEED),
        recipient,
        binding,
    }
}

fn entropy(seed: u8) -> LeaseEntropy {
    LeaseEntropy::from_bytes([seed; 32], [seed.wrapping_add(1); 12])
}

fn params<'a>(lease_id: &'a str, binding: &'a CredentialLeaseBinding) -> IssueParams<'a> {
    IssueParams {
        lease_id,
        binding,
        secret: SECRET,
        header_name: "Authorization",
        header_format: "Bearer {secret}",
        not_before_unix_ms: NOT_BEFORE_MS,
        expires_at_unix_ms: EXPIRES_AT_MS,
    }
}

fn issue_for(f: &Fixture, lease_id: &str, binding: &CredentialLeaseBinding) -> CredentialLease {
    let recipient = f.recipient.public_key();
    match issue(
        &params(lease_id, binding),
        &f.issuer,
        &recipient,
        entropy(3),
    ) {
        Ok(lease) => lease,
        Err(e) => panic!("issue failed: {e}"),
    }
}

fn scope(binding: &CredentialLeaseBinding) -> ExpectedScope<'_> {
    ExpectedScope {
        selected_node: &binding.selected_node,
        upstream_target: &binding.upstream_target,
        profile: Some(&binding.profile),
        principal: Some(&binding.principal),
        slot: Some(&binding.slot),
        route: Some(&binding.route),
        credential_revision: Some(binding.credential_revision),
        route_revision: Some(binding.route_revision),
        projection_generation: Some(binding.projection_generation),
    }
}

fn context<'a>(f: &'a Fixture, now_unix_ms: i64) -> OpenContext<'a> {
    OpenContext {
        recipient: &f.recipient,
        issuer: f.issuer.as_ref(),
        scope: scope(&f.binding),
        now_unix_ms,
        clock_skew_ms: SKEW_MS,
    }
}

/// Opens with a fresh replay cache and returns the error.
fn open_err(
    lease: &CredentialLease,
    binding: &CredentialLeaseBinding,
    ctx: &OpenContext<'_>,
) -> LeaseError {
    let mut replay = ReplayCache::new(16);
    match open(Some(lease), Some(binding), ctx, &mut replay) {
        Ok(opened) => panic!("lease unexpectedly opened: {opened:?}"),
        Err(e) => e,
    }
}

fn open_ok(
    lease: &CredentialLease,
    binding: &CredentialLeaseBinding,
    ctx: &OpenContext<'_>,
    replay: &mut ReplayCache,
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
    assert_eq!(lease.nonce.as_ref(), &[4u8; 12][..]);
    assert_eq!(lease.sealed_secret.len(), SECRET.len() + 16);
    assert_eq!(lease.signature.len(), 64);
    assert!(!contains(&lease.sealed_secret, SECRET));
    assert!(!contains(&lease.sealed_secret, b"TOPSECRET"));

    let mut replay = ReplayCache::new(16);
    let opened = open_ok(&lease, &f.binding, &context(&f, NOW_MS), &mut replay);
    assert_eq!(opened.secret_bytes(), SECRET);
    assert_eq!(opened.header_name(), "Authorization");
    assert_eq!(opened.header_format(), "Bearer {secret}");
    assert_eq!(
        opened.declared_header_value().as_str(),
        "Bearer sk-live-TOPSECRET-0123456789"
    );
    assert_eq!(replay.len(), 1);
    assert!(replay.contains("lease-1"));
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
    let mut replay = ReplayCache::new(16);
    let no_lease = open(None, Some(&f.binding), &ctx, &mut replay);
    assert_eq!(no_lease.as_ref().err(), Some(&LeaseError::LeaseMissing));
    let no_binding = open(Some(&lease), None, &ctx, &mut replay);
    assert_eq!(no_binding.as_ref().err(), Some(&LeaseError::BindingMissing));
    let neither = open(None, None, &ctx, &mut replay);
    assert_eq!(neither.as_ref().err(), Some(&LeaseError::LeaseMissing));
    assert_eq!(LeaseError::LeaseMissing.failure_code(), "lease_missing");
    assert_eq!(LeaseError::BindingMissing.failure_code(), "lease_missing");
    assert!(replay.is_empty());
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
    // CONTRACT: C3 — tampering with the ephemeral key, nonce or ciphertext is
    // caught by the signature, and (re-signed) by the AEAD.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut replay = ReplayCache::new(16);
    type Field = fn(&mut CredentialLease) -> &mut Bytes;
    let fields: [(&str, Field); 3] = [
        ("ephemeral_public_key", |l| &mut l.ephemeral_public_key),
        ("nonce", |l| &mut l.nonce),
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
    assert_eq!(flips, (32 + 12 + SECRET.len() + 16) * 8);
    // Failed opens never enter the replay cache; the intact lease still opens.
    assert!(replay.is_empty());
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
    let opened = open_ok(&lease, &binding, &ctx, &mut ReplayCache::new(4));
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
            ..scope(&f.binding)
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
            ..scope(&f.binding)
        },
        ..context(&f, NOW_MS)
    };
    let opened = open_ok(&lease, &binding, &ctx, &mut ReplayCache::new(4));
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
        let opened = open_ok(
            &lease,
            &f.binding,
            &context(&f, now),
            &mut ReplayCache::new(4),
        );
        assert_eq!(opened.secret_bytes(), SECRET, "now {now}");
    }
}

#[test]
fn second_open_of_a_lease_is_replayed() {
    // CONTRACT: C2 — replay state is checked; C3 — a replayed lease is refused.
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let ctx = context(&f, NOW_MS);
    let mut replay = ReplayCache::new(16);
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
    let cases: [(&str, Tamper); 11] = [
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
        ("nonce", |l| l.nonce = Bytes::from_static(&[0; 24])),
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
    let mut empty_slot = f.binding.clone();
    empty_slot.slot.clear();
    check(params("lease-1", &empty_slot), "binding.slot");
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
fn replay_cache_is_bounded_and_fails_closed() {
    // CONTRACT: C2 — replay state is bounded without forgetting live leases.
    let f = fixture();
    let recipient = f.recipient.public_key();
    let short = |id| {
        let p = IssueParams {
            expires_at_unix_ms: NOT_BEFORE_MS + 10_000,
            ..params(id, &f.binding)
        };
        issue(&p, &f.issuer, &recipient, entropy(5))
    };
    let (Ok(a), Ok(b)) = (short("lease-a"), short("lease-b")) else {
        panic!("issue failed")
    };
    let long = issue_for(&f, "lease-long", &f.binding);
    let c = issue_for(&f, "lease-c", &f.binding);
    let mut replay = ReplayCache::new(2);
    assert_eq!(replay.max_entries(), 2);
    let ctx = context(&f, NOT_BEFORE_MS + 1_000);
    drop(open_ok(&a, &f.binding, &ctx, &mut replay));
    drop(open_ok(&long, &f.binding, &ctx, &mut replay));
    let full = open(Some(&b), Some(&f.binding), &ctx, &mut replay);
    assert_eq!(full.as_ref().err(), Some(&LeaseError::ReplayCacheFull));
    assert_eq!(LeaseError::ReplayCacheFull.failure_code(), "lease_replayed");
    assert_eq!(replay.len(), 2);
    assert!(!replay.contains("lease-b"));

    // lease-a is kept until its expires_at + skew: no eviction before that.
    let a_keep_until = NOT_BEFORE_MS + 10_000 + i64::from(SKEW_MS);
    assert_eq!(replay.prune(a_keep_until - 1), 0);
    let still_full = open(
        Some(&c),
        Some(&f.binding),
        &context(&f, a_keep_until - 1),
        &mut replay,
    );
    assert_eq!(still_full.err(), Some(LeaseError::ReplayCacheFull));

    // At a's keep-until the next open prunes it and there is room again.
    drop(open_ok(
        &c,
        &f.binding,
        &context(&f, a_keep_until),
        &mut replay,
    ));
    assert!(!replay.contains("lease-a"));
    assert!(replay.contains("lease-long"));
    assert!(replay.contains("lease-c"));
    assert_eq!(replay.len(), 2);

    let long_keep_until = EXPIRES_AT_MS + i64::from(SKEW_MS);
    assert_eq!(replay.prune(long_keep_until - 1), 0);
    assert_eq!(replay.prune(long_keep_until), 2);
    assert!(replay.is_empty());
}

#[test]
fn opened_secret_is_redacted_and_zeroizable() {
    // CONTRACT: C4 — plaintext never reaches Debug output.
    // CONTRACT: C5 — the plaintext is zeroized, not kept.
    fn zeroize_on_drop<T: ZeroizeOnDrop>(_: &T) {}
    let f = fixture();
    let lease = issue_for(&f, "lease-1", &f.binding);
    let mut opened = open_ok(
        &lease,
        &f.binding,
        &context(&f, NOW_MS),
        &mut ReplayCache::new(4),
    );
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
    let mut replay = ReplayCache::new(4);
    let ctx = context(&f, NOW_MS);
    let opened = open_ok(&lease, &f.binding, &ctx, &mut replay);
    let p = params("lease-1", &f.binding);
    let entropy = LeaseEntropy::from_bytes([0xab; 32], [0xcd; 12]);
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
        "205, 205".to_owned(),
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
fn binding_digest_is_the_documented_canonical_encoding() {
    fn field(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
        out.push(tag);
        out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        out.extend_from_slice(bytes);
    }
    let f = fixture();
    let b = &f.binding;
    let mut enc = Vec::new();
    field(&mut enc, 0, b"iop-lease-binding-v1");
    field(&mut enc, 1, b.principal.as_bytes());
    field(&mut enc, 2, b.slot.as_bytes());
    field(&mut enc, 3, b.route.as_bytes());
    field(&mut enc, 4, b.profile.as_bytes());
    field(&mut enc, 5, b.upstream_target.as_bytes());
    field(&mut enc, 6, b.selected_node.as_bytes());
    field(&mut enc, 7, b.recipient.as_bytes());
    for (tag, v) in [(8u8, 3u64), (9, 5), (10, 8)] {
        enc.push(tag);
        enc.extend_from_slice(&v.to_be_bytes());
    }
    assert_eq!(binding_digest(b), *blake3::hash(&enc).as_bytes());

    // Moving bytes across a field boundary changes the digest.
    let mut shifted = b.clone();
    shifted.principal = "client-ao".into();
    shifted.slot = "penai-primary".into();
    assert_ne!(binding_digest(b), binding_digest(&shifted));
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
    assert_eq!(upstream_target("openai-1", "gpt-4o"), "openai-1/gpt-4o");
}

#[test]
fn failure_codes_cover_the_contract_list() {
    let cases = [
        (LeaseError::LeaseMissing, "lease_missing"),
        (LeaseError::BindingMissing, "lease_missing"),
        (LeaseError::Malformed { field: "nonce" }, "lease_invalid"),
        (LeaseError::WrongIssuer, "lease_invalid"),
        (LeaseError::BadSignature, "lease_invalid"),
        (LeaseError::DigestMismatch, "lease_invalid"),
        (LeaseError::WrongRecipient, "lease_invalid"),
        (LeaseError::Decrypt, "lease_invalid"),
        (LeaseError::BadSecret, "lease_invalid"),
        (LeaseError::NotYetValid, "lease_expired"),
        (LeaseError::Expired, "lease_expired"),
        (LeaseError::Replayed, "lease_replayed"),
        (LeaseError::ReplayCacheFull, "lease_replayed"),
        (
            LeaseError::ScopeMismatch { field: "slot" },
            "lease_scope_mismatch",
        ),
    ];
    for (err, code) in cases {
        assert_eq!(err.failure_code(), code, "{err:?}");
    }
}
