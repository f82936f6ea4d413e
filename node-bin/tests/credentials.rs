//! In-process integration of the credential plane on the Node (C2, C3,
//! C5): a real Node session (`node_bin::session::run`) over a loopback frame
//! connection to a scripted Edge that issues leases, against the `bench`
//! mock provider requiring an API key (`--require-api-key`).
//!
//! A valid lease makes the provider answer 200 (the mock answers 401 without
//! the injected header); every rejection is one `ERROR` terminal with its
//! exact failure code and no provider connection (the mock's counters). The
//! scripted Edge also plays the attacker who controls the link: it rewrites
//! the adapter's `base_url` by a config refresh, replays leases on other
//! requests, floods, and replays across a Node restart.
//! Waits are bounded by [`common::SAFETY`] only as a net against hangs.

mod common;

use bytes::Bytes;
use common::{
    chat_tunnel, is_tunnel_terminal, lease_binding, next_sequence, node_config, openai_adapter,
    openai_profile, recipient, Edge, Mock, TARGET,
};
use ed25519_dalek::SigningKey;
use iop_engine::certs::{DevCa, IssuedCert, Validity};
use iop_engine::http::Url;
use iop_engine::tls::{HttpsAcceptor, UpstreamTlsSettings};
use iop_wire::lease::{self, IssueParams, LeaseEntropy, ReplayGuard};
use iop_wire::pb;
use node_bin::credentials::NodeCredentials;

const SECRET: &str = "sk-iop-node-test-5e1d";
const RECIPIENT_SEED: [u8; 32] = [9; 32];
const ROTATED_SEED: [u8; 32] = [10; 32];
const ISSUER_SEED: [u8; 32] = [7; 32];
/// The node's `clock_skew_ms`.
const SKEW_MS: u32 = 5_000;

fn issuer() -> SigningKey {
    SigningKey::from_bytes(&ISSUER_SEED)
}

/// The mock provider, in process, requiring [`SECRET`].
fn keyed_mock() -> Mock {
    Mock::start(Mock::handler(3, 0).with_required_api_key(bench::mock::auth::ApiKey::new(SECRET)))
}

/// One OpenAI-compatible adapter `mock` at `base_url`.
fn payload_at(mock: &Mock, base_url: String, leases_required: bool) -> pb::NodeConfigPayload {
    let profile = pb::ProtocolProfile {
        base_url,
        health_path: "/v1/models".into(),
        auth_header_name: "Authorization".into(),
        auth_header_format: "Bearer {secret}".into(),
        ..openai_profile(mock)
    };
    pb::NodeConfigPayload {
        runtime: Some(pb::NodeRuntimeConfig::default()),
        ..node_config(vec![openai_adapter("mock", 4, profile)], leases_required)
    }
}

fn payload(mock: &Mock, leases_required: bool) -> pb::NodeConfigPayload {
    payload_at(mock, mock.base_url(), leases_required)
}

/// The node's credential plane; its replay state began a minute ago (the
/// node was started before the leases of the tests were issued).
fn node_credentials() -> NodeCredentials {
    NodeCredentials::new(recipient(RECIPIENT_SEED), issuer().verifying_key(), SKEW_MS)
        .with_replay_guard(ReplayGuard::new(iop_engine::clock::unix_ms() - 60_000))
}

/// What the scripted Edge varies per lease.
struct LeaseSpec {
    lease_id: &'static str,
    sealed_to: [u8; 32],
    header_name: &'static str,
    header_format: &'static str,
    /// Offset of `not_before` from now; the lease lives 30 s from there.
    not_before_offset_ms: i64,
}

impl LeaseSpec {
    fn valid(lease_id: &'static str) -> Self {
        Self {
            lease_id,
            sealed_to: RECIPIENT_SEED,
            header_name: "Authorization",
            header_format: "Bearer {secret}",
            not_before_offset_ms: 0,
        }
    }
}

fn issue(spec: &LeaseSpec, binding: &pb::CredentialLeaseBinding) -> pb::CredentialLease {
    let to = recipient(spec.sealed_to);
    let not_before = iop_engine::clock::unix_ms() + spec.not_before_offset_ms;
    lease::issue(
        &IssueParams {
            lease_id: spec.lease_id,
            sequence: next_sequence(),
            binding,
            secret: SECRET.as_bytes(),
            header_name: spec.header_name,
            header_format: spec.header_format,
            not_before_unix_ms: not_before,
            expires_at_unix_ms: not_before + 30_000,
        },
        &issuer(),
        &to.public_key(),
        LeaseEntropy::from_seed([3; 32]),
    )
    .expect("issue")
}

/// A chat tunnel without a lease.
fn tunnel(run_id: &str) -> pb::ProviderTunnelRequest {
    let body = format!(
        r#"{{"model":"{TARGET}","stream":false,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    chat_tunnel(run_id, body)
}

/// `req` with `lease` and `binding`.
fn with_lease(
    mut req: pb::ProviderTunnelRequest,
    lease: pb::CredentialLease,
    binding: pb::CredentialLeaseBinding,
) -> pb::ProviderTunnelRequest {
    req.credential_lease = Some(lease);
    req.credential_binding = Some(binding);
    req
}

/// A chat tunnel with a genuine lease for exactly it, to `mock`.
fn leased(mock: &Mock, run_id: &str, spec: &LeaseSpec) -> pb::ProviderTunnelRequest {
    let req = tunnel(run_id);
    let binding = lease_binding(recipient(RECIPIENT_SEED).key_id(), &mock.origin(), &req);
    let lease = issue(spec, &binding);
    with_lease(req, lease, binding)
}

/// Asserts one `ERROR` terminal with `code` and no `ExecutionFailure`.
fn assert_rejected(frames: &[pb::ProviderTunnelFrame], code: &str) {
    assert_eq!(frames.len(), 1, "only a terminal: {frames:?}");
    let f = &frames[0];
    assert_eq!((f.seq, f.kind()), (1, pb::TunnelFrameKind::Error));
    assert_eq!(f.failure_code, code, "{}", f.error);
    assert!(f.failure.is_none(), "not a stall (W6)");
    assert!(!f.error.contains(SECRET));
}

/// Asserts a provider response with `status`, ended normally.
fn assert_answered(frames: &[pb::ProviderTunnelFrame], status: u32) {
    assert_eq!(frames[0].kind(), pb::TunnelFrameKind::ResponseStart);
    assert_eq!(frames[0].status, status);
    assert_eq!(
        frames.last().map(|f| f.kind()),
        Some(pb::TunnelFrameKind::End)
    );
}

// CONTRACT: C2 — a valid lease is opened after admission and the declared
// header reaches the provider (the mock answers 401 without it), also next
// to a forwarded header of the same name; both an `Authorization: Bearer`
// and an `x-api-key` slot work.
#[monoio::test(timer_enabled = true)]
async fn valid_lease_injects_the_declared_header() {
    let mock = keyed_mock();
    let mut edge =
        Edge::start_with_credentials(payload(&mock, true), Some(node_credentials())).await;
    let mut req = tunnel("ok-1");
    req.headers.push(pb::Header {
        name: "authorization".into(),
        value: Bytes::from_static(b"Bearer client-key"),
    });
    let binding = lease_binding(recipient(RECIPIENT_SEED).key_id(), &mock.origin(), &req);
    let lease = issue(&LeaseSpec::valid("lease-ok-1"), &binding);
    assert_answered(&edge.tunnel(with_lease(req, lease, binding)).await, 200);
    let x_api_key = LeaseSpec {
        header_name: "x-api-key",
        header_format: "{secret}",
        ..LeaseSpec::valid("lease-ok-2")
    };
    assert_answered(&edge.tunnel(leased(&mock, "ok-2", &x_api_key)).await, 200);
    let stats = mock.admin_stats().await;
    assert_eq!(stats["chat_requests"], 2);
}

// CONTRACT: C3, C5 — a managed node rejects missing, expired, not yet
// valid, wrongly scoped and wrongly sealed leases with their exact codes,
// before any provider connection.
#[monoio::test(timer_enabled = true)]
async fn invalid_leases_fail_closed_without_a_provider_call() {
    let mock = keyed_mock();
    let mut edge =
        Edge::start_with_credentials(payload(&mock, true), Some(node_credentials())).await;
    assert_rejected(&edge.tunnel(tunnel("m-1")).await, "lease_missing");
    let mut no_binding = leased(&mock, "m-2", &LeaseSpec::valid("lease-m-2"));
    no_binding.credential_binding = None;
    assert_rejected(&edge.tunnel(no_binding).await, "lease_missing");
    let expired = LeaseSpec {
        not_before_offset_ms: -60_000,
        ..LeaseSpec::valid("lease-expired")
    };
    assert_rejected(
        &edge.tunnel(leased(&mock, "e-1", &expired)).await,
        "lease_expired",
    );
    let early = LeaseSpec {
        not_before_offset_ms: 60_000,
        ..LeaseSpec::valid("lease-early")
    };
    assert_rejected(
        &edge.tunnel(leased(&mock, "e-2", &early)).await,
        "lease_expired",
    );
    // Issued for another node.
    let req = tunnel("s-1");
    let mut other_node = lease_binding(recipient(RECIPIENT_SEED).key_id(), &mock.origin(), &req);
    other_node.selected_node = "node-b".into();
    let lease = issue(&LeaseSpec::valid("lease-node-b"), &other_node);
    assert_rejected(
        &edge.tunnel(with_lease(req, lease, other_node)).await,
        "lease_scope_mismatch",
    );
    // Issued for another target of the same adapter.
    let mut other_target = leased(&mock, "s-2", &LeaseSpec::valid("lease-target"));
    other_target.target = "other-model".into();
    assert_rejected(&edge.tunnel(other_target).await, "lease_scope_mismatch");
    // Sealed to the key this node had before its key was rotated.
    let rotated = recipient(ROTATED_SEED);
    let req = tunnel("r-1");
    let old_binding = lease_binding(rotated.key_id(), &mock.origin(), &req);
    let lease = issue(
        &LeaseSpec {
            sealed_to: ROTATED_SEED,
            ..LeaseSpec::valid("lease-rotated")
        },
        &old_binding,
    );
    assert_rejected(
        &edge.tunnel(with_lease(req, lease, old_binding)).await,
        "lease_invalid",
    );
    let stats = mock.admin_stats().await;
    // Only the stats request itself ever connected.
    assert_eq!(stats["connections_accepted"], 1);
    assert_eq!(stats["chat_requests"], 0);
}

// CONTRACT: C2, C5 — a lease opens once, for its one request: the same
// tunnel again is lease_replayed; the lease moved onto another run, body or
// path is lease_scope_mismatch; none of them reaches the provider.
#[monoio::test(timer_enabled = true)]
async fn a_lease_serves_only_its_one_request() {
    let mock = keyed_mock();
    let mut edge =
        Edge::start_with_credentials(payload(&mock, true), Some(node_credentials())).await;
    let req = leased(&mock, "p-1", &LeaseSpec::valid("lease-once"));
    assert_answered(&edge.tunnel(req.clone()).await, 200);
    assert_rejected(&edge.tunnel(req.clone()).await, "lease_replayed");
    // A captured, not yet opened lease spent on other requests.
    let fresh = leased(&mock, "p-2", &LeaseSpec::valid("lease-captured"));
    let mut other_run = fresh.clone();
    other_run.run_id = "p-3".into();
    assert_rejected(&edge.tunnel(other_run).await, "lease_scope_mismatch");
    let mut other_body = fresh.clone();
    other_body.body = Bytes::from(format!(
        r#"{{"model":"{TARGET}","stream":false,"max_tokens":4000,"messages":[{{"role":"user","content":"spend"}}]}}"#
    ));
    assert_rejected(&edge.tunnel(other_body).await, "lease_scope_mismatch");
    let mut other_path = fresh.clone();
    other_path.operation = "models".into();
    other_path.method = "GET".into();
    other_path.body = Bytes::new();
    assert_rejected(&edge.tunnel(other_path).await, "lease_scope_mismatch");
    let mut extra_header = fresh.clone();
    extra_header.headers.push(pb::Header {
        name: "openai-project".into(),
        value: Bytes::from_static(b"proj_attacker"),
    });
    assert_rejected(&edge.tunnel(extra_header).await, "lease_scope_mismatch");
    assert_eq!(mock.admin_stats().await["chat_requests"], 1);
    // The captured lease still serves the request it was issued for.
    assert_answered(&edge.tunnel(fresh).await, 200);
    assert_eq!(mock.admin_stats().await["chat_requests"], 2);
}

// CONTRACT: C2, C5 — whoever speaks as the Edge can push a config that
// points the adapter's base_url at another host; a genuine lease, issued
// for the configured origin, then fails closed: the secret goes nowhere.
#[monoio::test(timer_enabled = true)]
async fn a_refresh_that_moves_base_url_makes_a_genuine_lease_fail_closed() {
    let mock = keyed_mock();
    // The host the secret would be sent to: it accepts anything and counts.
    let attacker = Mock::start(Mock::handler(3, 0));
    let mut edge =
        Edge::start_with_credentials(payload(&mock, true), Some(node_credentials())).await;
    assert_answered(
        &edge
            .tunnel(leased(&mock, "b-1", &LeaseSpec::valid("lease-b-1")))
            .await,
        200,
    );
    // The genuine Edge issues the next lease for the configured origin…
    let genuine = leased(&mock, "b-2", &LeaseSpec::valid("lease-b-2"));
    // …and the link rewrites the adapter's base_url before it arrives.
    let moved = payload_at(&mock, attacker.base_url(), true);
    let answer = edge
        .refresh(
            "move",
            pb::NodeConfigPayload {
                revision: 2,
                ..moved
            },
        )
        .await;
    assert_eq!(answer.status(), pb::RefreshStatus::Applied);
    assert_rejected(&edge.tunnel(genuine).await, "lease_scope_mismatch");
    let attacker_stats = attacker.admin_stats().await;
    assert_eq!(attacker_stats["chat_requests"], 0);
    // Only our own stats request reached the attacker's host.
    assert_eq!(attacker_stats["connections_accepted"], 1);
    assert_eq!(mock.admin_stats().await["chat_requests"], 1);
}

// CONTRACT: C3 — a revocation in the Edge's config reaches the Node, which
// refuses a lease of that revision itself (a lease issued before the
// revocation, still within its lifetime); other revisions still open.
#[monoio::test(timer_enabled = true)]
async fn a_revoked_revision_is_refused_by_the_node() {
    let mock = keyed_mock();
    let mut edge =
        Edge::start_with_credentials(payload(&mock, true), Some(node_credentials())).await;
    let before_revocation = leased(&mock, "v-1", &LeaseSpec::valid("lease-v-1"));
    let revoked = pb::NodeConfigPayload {
        revision: 2,
        revoked_credentials: vec![pb::RevokedCredential {
            slot: "mock-key".into(),
            revisions: vec![1],
        }],
        ..payload(&mock, true)
    };
    let answer = edge.refresh("revoke", revoked).await;
    assert_eq!(answer.status(), pb::RefreshStatus::Applied);
    let frames = edge.tunnel(before_revocation).await;
    assert_rejected(&frames, "lease_invalid");
    assert_eq!(frames[0].error, "credential revision 1 is revoked");
    // A lease of the next revision is served.
    let req = tunnel("v-2");
    let mut next = lease_binding(recipient(RECIPIENT_SEED).key_id(), &mock.origin(), &req);
    next.credential_revision = 2;
    let lease = issue(&LeaseSpec::valid("lease-v-2"), &next);
    assert_answered(&edge.tunnel(with_lease(req, lease, next)).await, 200);
    assert_eq!(mock.admin_stats().await["chat_requests"], 1);
}

// CONTRACT: C2 — a flood of opened leases (a client sending fast requests)
// only slides the session's replay window: with a window of 64 leases and
// room for one session's window only, 300 leases later a fresh lease still
// opens.
#[monoio::test(timer_enabled = true)]
async fn a_lease_flood_cannot_make_a_fresh_lease_fail() {
    let mock = keyed_mock();
    let started = iop_engine::clock::unix_ms() - 60_000;
    let credentials =
        NodeCredentials::new(recipient(RECIPIENT_SEED), issuer().verifying_key(), SKEW_MS)
            .with_replay_guard(ReplayGuard::with_limits(started, 64, 1));
    let mut edge = Edge::start_with_credentials(payload(&mock, true), Some(credentials)).await;
    for i in 0..300 {
        let req = leased(&mock, &format!("f-{i}"), &LeaseSpec::valid("lease-flood"));
        assert_answered(&edge.tunnel(req).await, 200);
    }
    let fresh = leased(&mock, "f-fresh", &LeaseSpec::valid("lease-fresh"));
    assert_answered(&edge.tunnel(fresh).await, 200);
    assert_eq!(mock.admin_stats().await["chat_requests"], 301);
}

// CONTRACT: C2 — replay state does not survive a Node restart, so a lease
// issued before the restart (beyond the clock skew) is refused after it,
// even though the new process never saw it opened; no provider call.
#[monoio::test(timer_enabled = true)]
async fn a_lease_from_before_a_restart_is_refused_after_it() {
    let mock = keyed_mock();
    let issued_early = LeaseSpec {
        not_before_offset_ms: -(i64::from(SKEW_MS) + 2_000),
        ..LeaseSpec::valid("lease-before-restart")
    };
    let captured = leased(&mock, "x-1", &issued_early);
    let mut before =
        Edge::start_with_credentials(payload(&mock, true), Some(node_credentials())).await;
    assert_answered(&before.tunnel(captured.clone()).await, 200);
    drop(before);
    // The restarted node: a fresh credential plane whose replay state
    // starts now.
    let restarted =
        NodeCredentials::new(recipient(RECIPIENT_SEED), issuer().verifying_key(), SKEW_MS);
    let mut after = Edge::start_with_credentials(payload(&mock, true), Some(restarted)).await;
    assert_rejected(&after.tunnel(captured).await, "lease_replayed");
    // A lease issued after the restart is served.
    let fresh = leased(&mock, "x-2", &LeaseSpec::valid("lease-after-restart"));
    assert_answered(&after.tunnel(fresh).await, 200);
    assert_eq!(mock.admin_stats().await["chat_requests"], 2);
}

// CONTRACT: C3 — without its own credential plane a node told by the Edge
// to require leases rejects a tunnel without one (lease_missing), and any
// lease it cannot open (no recipient key) is lease_invalid; an unmanaged
// node passes a legacy tunnel through (the mock then answers 401: no key).
#[monoio::test(timer_enabled = true)]
async fn nodes_without_a_recipient_key() {
    let mock = keyed_mock();
    let mut required = Edge::start(payload(&mock, true)).await;
    assert_rejected(&required.tunnel(tunnel("n-1")).await, "lease_missing");
    assert_rejected(
        &required
            .tunnel(leased(&mock, "n-2", &LeaseSpec::valid("lease-n-2")))
            .await,
        "lease_invalid",
    );
    let mut legacy = Edge::start(payload(&mock, false)).await;
    assert_rejected(
        &legacy
            .tunnel(leased(&mock, "n-3", &LeaseSpec::valid("lease-n-3")))
            .await,
        "lease_invalid",
    );
    assert_eq!(mock.admin_stats().await["chat_requests"], 0);
    assert_answered(&legacy.tunnel(tunnel("n-4")).await, 401);
}

// CONTRACT: C2, C5 — a config that asks the Node to skip verifying an
// https provider's certificate never gets a secret: the leased tunnel is
// refused with provider_tls before the lease is opened, and nothing
// connects to the provider.
#[monoio::test(timer_enabled = true)]
async fn no_lease_is_injected_into_an_unverified_tls_connection() {
    let mock = keyed_mock();
    let https = mock.base_url().replacen("http://", "https://", 1);
    let mut config = payload_at(&mock, https, true);
    config.adapters[0].tls = Some(pb::ProviderTlsConfig {
        ca_pem: String::new(),
        insecure_skip_verify: true,
    });
    let mut edge = Edge::start_with_credentials(config, Some(node_credentials())).await;
    let req = leased(&mock, "insecure-1", &LeaseSpec::valid("lease-insecure"));
    let frames = edge.tunnel(req.clone()).await;
    assert_rejected(&frames, "provider_tls");
    assert!(
        frames[0].error.contains("never injected"),
        "{}",
        frames[0].error
    );
    // The lease was not spent: it is refused for the same reason again, not
    // as a replay.
    assert_rejected(&edge.tunnel(req).await, "provider_tls");
    let stats = mock.admin_stats().await;
    assert_eq!(stats["connections_accepted"], 1, "only the stats request");
    assert_eq!(stats["chat_requests"], 0);
}

/// An HTTPS acceptor presenting `cert`.
fn presenting(cert: &IssuedCert) -> HttpsAcceptor {
    HttpsAcceptor::from_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes(), None)
        .expect("HTTPS acceptor")
}

/// The provider trust the genuine Edge binds for a private CA bundle
/// `ca_pem` (its certificates as the Edge reads them, not the Node's client).
fn private_ca_trust(ca_pem: &str) -> Bytes {
    let settings = UpstreamTlsSettings {
        ca_pem: Some(ca_pem.to_owned()),
        insecure_skip_verify: false,
    };
    let certs = settings
        .private_ca_certificates()
        .expect("CA bundle")
        .expect("a private CA");
    let trust = lease::ProviderTrust::PrivateCa(certs.iter().map(|c| c.as_ref()).collect());
    Bytes::copy_from_slice(&lease::provider_trust_digest(&trust))
}

/// [`payload_at`] for `https://` on the mock's address, trusting `ca_pem`
/// (the pushed `AdapterConfig.tls`; `None`: the Node's default roots).
fn https_payload(mock: &Mock, ca_pem: Option<String>, revision: u64) -> pb::NodeConfigPayload {
    let mut config = payload_at(mock, format!("https://{}", mock.addr), true);
    config.adapters[0].tls = ca_pem.map(|ca_pem| pb::ProviderTlsConfig {
        ca_pem,
        insecure_skip_verify: false,
    });
    pb::NodeConfigPayload { revision, ..config }
}

// CONTRACT: C2, C5 — the provider CA comes from the config the link pushes.
// Whoever can rewrite it pushes their own CA and intercepts the HTTPS
// connection to the genuine origin (here: an interceptor listening at that
// origin with a certificate from the attacker's CA, requiring the secret);
// a genuine lease, issued for the Edge's CA, then fails closed and not one
// byte reaches the origin — also when the rewrite drops the private CA for
// the Node's default roots. With the Edge's CA pushed again (and the
// genuine provider at the origin) the same lease is served.
#[monoio::test(timer_enabled = true)]
async fn a_refresh_that_swaps_the_provider_ca_makes_a_genuine_lease_fail_closed() {
    let genuine_ca = DevCa::new("provider.test").expect("genuine CA");
    let attacker_ca = DevCa::new("attacker.test").expect("attacker CA");
    let host = ["127.0.0.1"];
    let day = Validity::days_from_now(1);
    let interceptor = attacker_ca.issue_for_hosts(&host, day).expect("cert");
    let genuine = genuine_ca.issue_for_hosts(&host, day).expect("cert");
    let mock = Mock::start(
        Mock::handler(3, 0)
            .with_required_api_key(bench::mock::auth::ApiKey::new(SECRET))
            .with_tls(presenting(&interceptor)),
    );
    let origin = Url::parse(&format!("https://{}", mock.addr))
        .expect("url")
        .origin();
    let mut edge = Edge::start_with_credentials(
        https_payload(&mock, Some(genuine_ca.cert_pem()), 1),
        Some(node_credentials()),
    )
    .await;
    // The genuine Edge issues a lease for its adapter: this origin, its CA.
    let req = tunnel("ca-1");
    let mut binding = lease_binding(recipient(RECIPIENT_SEED).key_id(), &origin, &req);
    binding.provider_trust = private_ca_trust(&genuine_ca.cert_pem());
    let lease = issue(&LeaseSpec::valid("lease-ca-1"), &binding);
    let genuine_lease = with_lease(req, lease, binding);
    // The link rewrites the adapter's CA to the attacker's.
    let swapped = https_payload(&mock, Some(attacker_ca.cert_pem()), 2);
    let answer = edge.refresh("swap-ca", swapped).await;
    assert_eq!(answer.status(), pb::RefreshStatus::Applied);
    let frames = edge.tunnel(genuine_lease.clone()).await;
    assert_rejected(&frames, "lease_scope_mismatch");
    assert_eq!(
        frames[0].error,
        "credential binding scope mismatch: provider_trust"
    );
    // …or drops the private CA, so that any public CA could vouch.
    let dropped = https_payload(&mock, None, 3);
    let answer = edge.refresh("drop-ca", dropped).await;
    assert_eq!(answer.status(), pb::RefreshStatus::Applied);
    assert_rejected(
        &edge.tunnel(genuine_lease.clone()).await,
        "lease_scope_mismatch",
    );
    // Nothing reached the origin: no connection, no handshake, no request.
    let stats = mock.counters();
    assert_eq!(
        (
            stats.connections_accepted,
            stats.tls_handshake_failures,
            stats.chat_requests
        ),
        (0, 0, 0)
    );
    // The genuine provider at the origin, the Edge's CA pushed again: the
    // same lease (never opened) is served.
    {
        let mut provider = mock.provider.borrow_mut();
        let interceptor = std::mem::replace(&mut *provider, Mock::handler(0, 0));
        *provider = interceptor.with_tls(presenting(&genuine));
    }
    let restored = https_payload(&mock, Some(genuine_ca.cert_pem()), 4);
    let answer = edge.refresh("restore-ca", restored).await;
    assert_eq!(answer.status(), pb::RefreshStatus::Applied);
    assert_answered(&edge.tunnel(genuine_lease).await, 200);
    let stats = mock.counters();
    assert_eq!((stats.connections_accepted, stats.chat_requests), (1, 1));
}

// CONTRACT: C2 — the lease is opened only after the capacity gate admits
// the request: a leased tunnel refused with `capacity_exhausted` (its
// adapter's one slot held by a slow stream) never reached the provider and
// left its lease unopened, so the same request with the same lease is
// served once the slot is free.
#[monoio::test(timer_enabled = true)]
async fn a_request_refused_by_the_gate_leaves_its_lease_unopened() {
    // Ten tokens a second apart: the first stream holds the one slot.
    let mock = Mock::start(
        Mock::handler(10, 1_000).with_required_api_key(bench::mock::auth::ApiKey::new(SECRET)),
    );
    let mut config = payload(&mock, true);
    config.adapters[0].capacity = 1;
    let mut edge = Edge::start_with_credentials(config, Some(node_credentials())).await;
    let holder = chat_tunnel(
        "gate-1",
        format!(
            r#"{{"model":"{TARGET}","stream":true,"messages":[{{"role":"user","content":"hold"}}]}}"#
        ),
    );
    let binding = lease_binding(recipient(RECIPIENT_SEED).key_id(), &mock.origin(), &holder);
    let lease = issue(&LeaseSpec::valid("lease-holder"), &binding);
    let holder = with_lease(holder, lease, binding);
    edge.send(pb::frame::Body::ProviderTunnelRequest(Box::new(holder)));
    let start = edge.recv_tunnel().await;
    assert_eq!(
        (start.run_id.as_str(), start.kind()),
        ("gate-1", pb::TunnelFrameKind::ResponseStart),
        "{}: {}",
        start.failure_code,
        start.error
    );
    // One token: served at once when its turn comes.
    let refused = chat_tunnel(
        "gate-2",
        format!(
            r#"{{"model":"{TARGET}","stream":false,"max_tokens":1,"messages":[{{"role":"user","content":"hi"}}]}}"#
        ),
    );
    let binding = lease_binding(recipient(RECIPIENT_SEED).key_id(), &mock.origin(), &refused);
    let lease = issue(&LeaseSpec::valid("lease-refused"), &binding);
    let refused = with_lease(refused, lease, binding);
    edge.send(pb::frame::Body::ProviderTunnelRequest(Box::new(
        refused.clone(),
    )));
    let terminal = loop {
        let f = edge.recv_tunnel().await;
        if f.run_id == "gate-2" {
            break f;
        }
        assert_eq!(f.run_id, "gate-1", "{f:?}");
    };
    assert_eq!(terminal.kind(), pb::TunnelFrameKind::Error);
    assert_eq!(
        terminal.failure_code, "capacity_exhausted",
        "{}",
        terminal.error
    );
    assert_eq!(
        mock.admin_stats().await["chat_requests"],
        1,
        "only the holder"
    );
    // Free the slot: cancel the holder and take its terminal.
    edge.send(pb::frame::Body::CancelRequest(pb::CancelRequest {
        run_id: "gate-1".into(),
        reason: "client_disconnect".into(),
    }));
    loop {
        let f = edge.recv_tunnel().await;
        assert_eq!(f.run_id, "gate-1", "{f:?}");
        if is_tunnel_terminal(f.kind()) {
            break;
        }
    }
    // The refused request, its lease untouched, is served now.
    assert_answered(&edge.tunnel(refused).await, 200);
    assert_eq!(mock.admin_stats().await["chat_requests"], 2);
}
