//! In-process integration of the credential plane on the Node (C2, C3,
//! C5): a real Node session (`node_bin::session::run`) over a loopback frame
//! connection to a scripted Edge that issues leases, against the `bench`
//! mock provider requiring an API key (`--require-api-key`).
//!
//! A valid lease makes the provider answer 200 (the mock answers 401 without
//! the injected header); every rejection is one `ERROR` terminal with its
//! exact failure code and no provider connection (the mock's counters).
//! Waits are bounded by [`common::SAFETY`] only as a net against hangs.

mod common;

use bytes::Bytes;
use common::{
    chat_tunnel, lease_binding, node_config, openai_adapter, openai_profile, recipient, Edge, Mock,
    TARGET,
};
use ed25519_dalek::SigningKey;
use iop_wire::lease::{self, IssueParams, LeaseEntropy};
use iop_wire::pb;
use node_bin::credentials::NodeCredentials;

const SECRET: &str = "sk-iop-node-test-5e1d";
const RECIPIENT_SEED: [u8; 32] = [9; 32];
const ROTATED_SEED: [u8; 32] = [10; 32];
const ISSUER_SEED: [u8; 32] = [7; 32];

fn issuer() -> SigningKey {
    SigningKey::from_bytes(&ISSUER_SEED)
}

/// The mock provider, in process, requiring [`SECRET`].
fn keyed_mock() -> Mock {
    Mock::start(Mock::handler(3, 0).with_required_api_key(bench::mock::auth::ApiKey::new(SECRET)))
}

fn payload(mock: &Mock, leases_required: bool) -> pb::NodeConfigPayload {
    let profile = pb::ProtocolProfile {
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

fn node_credentials() -> NodeCredentials {
    NodeCredentials::new(recipient(RECIPIENT_SEED), issuer().verifying_key(), 5_000)
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
            binding,
            secret: SECRET.as_bytes(),
            header_name: spec.header_name,
            header_format: spec.header_format,
            not_before_unix_ms: not_before,
            expires_at_unix_ms: not_before + 30_000,
        },
        &issuer(),
        &to.public_key(),
        LeaseEntropy::from_bytes([3; 32], [4; 12]),
    )
    .expect("issue")
}

/// A tunnel request; with a lease and binding when `lease` is given.
fn tunnel(
    run_id: &str,
    credential: Option<(pb::CredentialLease, pb::CredentialLeaseBinding)>,
) -> pb::ProviderTunnelRequest {
    let body = format!(
        r#"{{"model":"{TARGET}","stream":false,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let (credential_lease, credential_binding) = match credential {
        Some((lease, binding)) => (Some(lease), Some(binding)),
        None => (None, None),
    };
    pb::ProviderTunnelRequest {
        credential_lease,
        credential_binding,
        ..chat_tunnel(run_id, body)
    }
}

fn leased(run_id: &str, spec: &LeaseSpec) -> pb::ProviderTunnelRequest {
    let binding = lease_binding(recipient(RECIPIENT_SEED).key_id());
    let lease = issue(spec, &binding);
    tunnel(run_id, Some((lease, binding)))
}

/// Asserts one `ERROR` terminal with `code` and no `ExecutionFailure`.
fn assert_rejected(frames: &[pb::ProviderTunnelFrame], code: &str) {
    assert_eq!(frames.len(), 1, "only a terminal: {frames:?}");
    let f = &frames[0];
    assert_eq!((f.seq, f.kind()), (1, pb::TunnelFrameKind::Error));
    assert_eq!(f.failure_code, code);
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
    let mut req = leased("ok-1", &LeaseSpec::valid("lease-ok-1"));
    req.headers.push(pb::Header {
        name: "authorization".into(),
        value: Bytes::from_static(b"Bearer client-key"),
    });
    assert_answered(&edge.tunnel(req).await, 200);
    let x_api_key = LeaseSpec {
        header_name: "x-api-key",
        header_format: "{secret}",
        ..LeaseSpec::valid("lease-ok-2")
    };
    assert_answered(&edge.tunnel(leased("ok-2", &x_api_key)).await, 200);
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
    assert_rejected(&edge.tunnel(tunnel("m-1", None)).await, "lease_missing");
    let mut no_binding = leased("m-2", &LeaseSpec::valid("lease-m-2"));
    no_binding.credential_binding = None;
    assert_rejected(&edge.tunnel(no_binding).await, "lease_missing");
    let expired = LeaseSpec {
        not_before_offset_ms: -60_000,
        ..LeaseSpec::valid("lease-expired")
    };
    assert_rejected(&edge.tunnel(leased("e-1", &expired)).await, "lease_expired");
    let early = LeaseSpec {
        not_before_offset_ms: 60_000,
        ..LeaseSpec::valid("lease-early")
    };
    assert_rejected(&edge.tunnel(leased("e-2", &early)).await, "lease_expired");
    // Issued for another node.
    let mut other_node = lease_binding(recipient(RECIPIENT_SEED).key_id());
    other_node.selected_node = "node-b".into();
    let lease = issue(&LeaseSpec::valid("lease-node-b"), &other_node);
    assert_rejected(
        &edge.tunnel(tunnel("s-1", Some((lease, other_node)))).await,
        "lease_scope_mismatch",
    );
    // Issued for another target of the same adapter.
    let mut other_target = leased("s-2", &LeaseSpec::valid("lease-target"));
    other_target.target = "other-model".into();
    assert_rejected(&edge.tunnel(other_target).await, "lease_scope_mismatch");
    // Sealed to the key this node had before its key was rotated.
    let rotated = recipient(ROTATED_SEED);
    let old_binding = lease_binding(rotated.key_id());
    let lease = issue(
        &LeaseSpec {
            sealed_to: ROTATED_SEED,
            ..LeaseSpec::valid("lease-rotated")
        },
        &old_binding,
    );
    assert_rejected(
        &edge.tunnel(tunnel("r-1", Some((lease, old_binding)))).await,
        "lease_invalid",
    );
    let stats = mock.admin_stats().await;
    // Only the stats request itself ever connected.
    assert_eq!(stats["connections_accepted"], 1);
    assert_eq!(stats["chat_requests"], 0);
}

// CONTRACT: C2, C5 — a lease opens once: the same lease again is
// lease_replayed and makes no second provider call.
#[monoio::test(timer_enabled = true)]
async fn replayed_lease_is_rejected() {
    let mock = keyed_mock();
    let mut edge =
        Edge::start_with_credentials(payload(&mock, true), Some(node_credentials())).await;
    let req = leased("p-1", &LeaseSpec::valid("lease-once"));
    let mut replay = req.clone();
    replay.run_id = "p-2".into();
    assert_answered(&edge.tunnel(req).await, 200);
    assert_rejected(&edge.tunnel(replay).await, "lease_replayed");
    assert_eq!(mock.admin_stats().await["chat_requests"], 1);
}

// CONTRACT: C3 — without its own credential plane a node told by the Edge
// to require leases rejects a tunnel without one (lease_missing), and any
// lease it cannot open (no recipient key) is lease_invalid; an unmanaged
// node passes a legacy tunnel through (the mock then answers 401: no key).
#[monoio::test(timer_enabled = true)]
async fn nodes_without_a_recipient_key() {
    let mock = keyed_mock();
    let mut required = Edge::start(payload(&mock, true)).await;
    assert_rejected(&required.tunnel(tunnel("n-1", None)).await, "lease_missing");
    assert_rejected(
        &required
            .tunnel(leased("n-2", &LeaseSpec::valid("lease-n-2")))
            .await,
        "lease_invalid",
    );
    let mut legacy = Edge::start(payload(&mock, false)).await;
    assert_rejected(
        &legacy
            .tunnel(leased("n-3", &LeaseSpec::valid("lease-n-3")))
            .await,
        "lease_invalid",
    );
    assert_eq!(mock.admin_stats().await["chat_requests"], 0);
    assert_answered(&legacy.tunnel(tunnel("n-4", None)).await, 401);
}
