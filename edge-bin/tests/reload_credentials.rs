//! `server::reload` — what the binary's SIGHUP handler calls — applied to
//! `[credentials]` of an Edge served in process over real client sockets
//! and a hand-driven managed node on real mTLS, which opens every lease it
//! is given as node-bin does (its recipient key, the issuer's public key,
//! the scope it computes itself and one replay state).
//!
//! What is proven, in order and without timing: the first request's lease
//! carries the revision-1 secret; a reload that revokes revision 1 tells
//! the node (a config refresh naming it) and the next request gets 503
//! `credential_unavailable` without anything sent to the node; a reload
//! that bumps the revision with a new secret file puts it in force, and the
//! next request's lease carries exactly the new secret under revision 2,
//! with the node's next sequence number, which the node accepts; a reload
//! naming another issuer key is reported as needing a restart and the
//! running key goes on signing. That the refused request sent nothing is
//! shown by order: its answer came before any frame at the node, and the
//! next frame the node gets is the tunnel of the request after it.

mod common;

use common::*;
use edge_bin::config::EdgeConfig;
use edge_bin::plane::credentials::CredentialsChange;
use edge_bin::server;
use iop_engine::keys;
use iop_wire::lease::{self, ExpectedScope, OpenContext, OriginPins, RecipientKey, ReplayGuard};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use x25519_dalek::StaticSecret;

const SECRET_1: &[u8] = b"sk-reload-rev-1-4c7e01";
const SECRET_2: &[u8] = b"sk-reload-rev-2-9b3fd5";

/// node-a's recipient key (the hand-driven node holds the private half).
fn recipient() -> RecipientKey {
    RecipientKey::from_secret(StaticSecret::from([23; 32]))
}

/// Writes a slot secret file (mode 0600).
fn write_secret(path: &std::path::Path, bytes: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// The test Edge's config with node-a managed: its recipient key, and its
/// provider served by slot `mock-main` reading `secret_file` at
/// `revision`, with `revoked` revisions.
fn edge_toml_managed(pki: &Pki, secret_file: &str, revision: u64, revoked: &str) -> String {
    edge_toml_signed(pki, "issuer.key", secret_file, revision, revoked)
}

/// [`edge_toml_managed`] with the issuer key file `issuer_key`.
fn edge_toml_signed(
    pki: &Pki,
    issuer_key: &str,
    secret_file: &str,
    revision: u64,
    revoked: &str,
) -> String {
    let credentials = format!(
        "\n[credentials]\nissuer_key = \"{issuer}\"\n\n[[credentials.slots]]\n\
         name = \"mock-main\"\nsecret_file = \"{secret}\"\nrevision = {revision}\n\
         revoked_revisions = [{revoked}]\nproviders = [\"node-a/a-mock\"]\n",
        issuer = pki.dir.join(issuer_key).display(),
        secret = pki.dir.join(secret_file).display(),
    );
    let options = EdgeOptions {
        extra_toml: credentials,
        ..EdgeOptions::without_provider()
    };
    edge_toml(pki, &options).replacen(
        "id = \"node-a\"\n",
        &format!(
            "id = \"node-a\"\nrecipient_key = \"{}\"\n",
            keys::encode_recipient_public_key(&recipient().public_key())
        ),
        1,
    )
}

/// A non-streamed chat request for [`MODEL`] on its own connection.
fn chat_request() -> Vec<u8> {
    let body = format!(
        "{{\"model\":\"{MODEL}\",\"stream\":false,\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}"
    );
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

/// What node-a does with the lease of `tunnel`: checks it against what it
/// computes itself and its replay state, and opens the secret.
fn node_opens(
    tunnel: &pb::ProviderTunnelRequest,
    issuer: &ed25519_dalek::VerifyingKey,
    revoked: &[pb::RevokedCredential],
    replay: &mut ReplayGuard,
) -> Vec<u8> {
    let recipient = recipient();
    let target = lease::upstream_target(&tunnel.adapter, &tunnel.target);
    let trust = lease::provider_trust_digest(&lease::ProviderTrust::PlainHttp);
    let body = [tunnel.body.clone()];
    let digest = lease::request_digest(&lease::BoundRequest {
        method: "POST",
        path: "/v1/chat/completions",
        headers: &tunnel.headers,
        body: &body,
    });
    let ctx = OpenContext {
        recipient: &recipient,
        issuer,
        scope: ExpectedScope::computed_by_node(
            "node-a",
            &target,
            "http://127.0.0.1:9",
            &trust,
            &tunnel.run_id,
            &digest,
            Some("openai"),
        ),
        revoked,
        origin_pins: &OriginPins::new(),
        now_unix_ms: iop_engine::clock::unix_ms(),
        clock_skew_ms: 0,
    };
    let opened = lease::open(
        tunnel.credential_lease.as_ref(),
        tunnel.credential_binding.as_ref(),
        &ctx,
        replay,
    )
    .unwrap_or_else(|e| panic!("node-a refuses the lease: {e}"));
    opened.secret_bytes().to_vec()
}

/// Answers `run` with a 200 JSON body.
async fn answer(node: &RawNode, run: &str) {
    tunnel_response_start(node, run, b"application/json").await;
    tunnel_body(node, run, 2, b"{\"ok\":true}").await;
    tunnel_end(node, run, 3).await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_reload_revokes_the_current_revision_and_a_new_one_brings_its_secret() {
    guarded(async {
        let pki = Pki::mint("reload-credentials");
        let issuer = keys::generate_issuer_key(&pki.dir.join("issuer.key")).unwrap();
        write_secret(&pki.dir.join("secret-1"), SECRET_1);
        let path = pki.dir.join("edge.toml");
        let text = edge_toml_managed(&pki, "secret-1", 1, "");
        std::fs::write(&path, &text).unwrap();
        let edge = TestEdge::start_with_credentials(&pki, &text);
        let running = EdgeConfig::load(&path).unwrap();
        // node-a's replay state lives as long as its process would.
        let mut replay = ReplayGuard::new(iop_engine::clock::unix_ms());
        let mut node = ready_node(&edge, &pki, "node-a").await;

        // Revision 1.
        let first = monoio::spawn(http_exchange(edge.client_addr, chat_request()));
        let tunnel = next_tunnel(&mut node).await;
        let binding = tunnel.credential_binding.clone().expect("a binding");
        assert_eq!(
            (binding.slot.as_str(), binding.credential_revision),
            ("mock-main", 1)
        );
        assert_eq!(
            tunnel.credential_lease.as_ref().map(|l| l.sequence),
            Some(1)
        );
        assert_eq!(node_opens(&tunnel, &issuer, &[], &mut replay), SECRET_1);
        answer(&node, &tunnel.run_id).await;
        let first = first.await;
        assert_eq!((first.status, first.body), (200, b"{\"ok\":true}".to_vec()));

        // SIGHUP: revision 1 revoked.
        std::fs::write(&path, edge_toml_managed(&pki, "secret-1", 1, "1")).unwrap();
        let (_, report) = server::reload(&edge.edge, &running, &path, 2).unwrap();
        assert_eq!(
            report.credentials,
            CredentialsChange {
                slots: 1,
                changed: vec!["mock-main".into()],
                ..CredentialsChange::default()
            }
        );
        assert_eq!(report.restart_required, Vec::<&str>::new());
        assert_eq!(report.refreshed, ["node-a"]);
        let revoked = [pb::RevokedCredential {
            slot: "mock-main".into(),
            revisions: vec![1],
        }];
        match node.next_frame().await {
            Body::NodeConfigRefreshRequest(refresh) => assert_eq!(
                refresh.config.expect("a config").revoked_credentials,
                revoked
            ),
            other => panic!("expected the config refresh, got {other:?}"),
        }

        // CONTRACT: C3 — the Edge issues no lease for a revoked revision:
        // 503, and nothing reaches the node (whichever comes first, the
        // answer or a frame at the node, decides).
        let refused = monoio::select! {
            refused = http_exchange(edge.client_addr, chat_request()) => refused,
            frame = node.next_frame() => panic!("the revoked revision reached the node: {frame:?}"),
        };
        assert_eq!(refused.status, 503);
        assert_eq!(
            refused.json(),
            api_error(
                "credential slot `mock-main` revision 1 is revoked; the request was not sent \
                 to the provider (no other credential is tried).",
                "server_error",
                None,
                Some("credential_unavailable"),
            )
        );
        assert_eq!(edge.edge.control().leases().count(), 0);

        // SIGHUP: revision 2 from a new secret file; 1 stays revoked (the
        // node's config does not change: no refresh).
        write_secret(&pki.dir.join("secret-2"), SECRET_2);
        std::fs::write(&path, edge_toml_managed(&pki, "secret-2", 2, "1")).unwrap();
        let (_, report) = server::reload(&edge.edge, &running, &path, 3).unwrap();
        assert_eq!(
            report.credentials,
            CredentialsChange {
                slots: 1,
                rotated: vec!["mock-main".into()],
                ..CredentialsChange::default()
            }
        );
        assert_eq!(report.refreshed, Vec::<String>::new());

        let third = monoio::spawn(http_exchange(edge.client_addr, chat_request()));
        // The first frame since the refresh: the refused request sent none.
        let tunnel = next_tunnel(&mut node).await;
        let binding = tunnel.credential_binding.clone().expect("a binding");
        assert_eq!(
            (binding.slot.as_str(), binding.credential_revision),
            ("mock-main", 2)
        );
        assert_eq!(
            tunnel.credential_lease.as_ref().map(|l| l.sequence),
            Some(2)
        );
        assert_eq!(
            node_opens(&tunnel, &issuer, &revoked, &mut replay),
            SECRET_2
        );
        let sealed = &tunnel
            .credential_lease
            .as_ref()
            .expect("a lease")
            .sealed_secret;
        assert!(!sealed.windows(SECRET_2.len()).any(|w| w == SECRET_2));
        answer(&node, &tunnel.run_id).await;
        let third = third.await;
        assert_eq!((third.status, third.body), (200, b"{\"ok\":true}".to_vec()));

        // SIGHUP: another issuer key. Not applied (node-a trusts the
        // running one), said so; the running key keeps signing.
        keys::generate_issuer_key(&pki.dir.join("issuer-2.key")).unwrap();
        std::fs::write(
            &path,
            edge_toml_signed(&pki, "issuer-2.key", "secret-2", 2, "1"),
        )
        .unwrap();
        let (_, report) = server::reload(&edge.edge, &running, &path, 4).unwrap();
        assert_eq!(
            report.restart_required,
            [
                "[credentials] issuer_key (nodes trust the running issuer's public key; it keeps \
              signing until a restart)"
            ]
        );
        assert_eq!(
            report.credentials,
            CredentialsChange {
                slots: 1,
                ..CredentialsChange::default()
            }
        );
        let fourth = monoio::spawn(http_exchange(edge.client_addr, chat_request()));
        let tunnel = next_tunnel(&mut node).await;
        let lease_of = tunnel.credential_lease.as_ref().expect("a lease");
        assert_eq!(lease_of.issuer_key_id, lease::issuer_key_id(&issuer));
        assert_eq!(lease_of.sequence, 3);
        assert_eq!(
            node_opens(&tunnel, &issuer, &revoked, &mut replay),
            SECRET_2
        );
        answer(&node, &tunnel.run_id).await;
        assert_eq!(fourth.await.status, 200);
        edge.stop().await;
    })
    .await;
}
