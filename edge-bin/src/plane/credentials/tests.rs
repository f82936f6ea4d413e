//! The credential plane's tests: leases bound and sealed exactly, slots,
//! reloads, loading and redaction.

use std::cell::Cell;

use bytes::Bytes;
use std::sync::LazyLock;

use iop_wire::lease::{
    binding_digest, open, request_digest, ExpectedScope, OpenContext, OriginPins, RecipientKey,
    ReplayGuard,
};
use x25519_dalek::StaticSecret;

use super::*;
use crate::config::ClientKeySpec;
use crate::plane::client_keys::{hash_client_key, ClientKeys};

const SECRET: &[u8] = b"sk-edge-unit-secret-42";
const NOW_MS: i64 = 1_700_000_000_000;
const RECIPIENT_SEED: [u8; 32] = [9; 32];

fn recipient() -> RecipientKey {
    RecipientKey::from_secret(StaticSecret::from(RECIPIENT_SEED))
}

fn config(slot_extra: &str) -> EdgeConfig {
    match EdgeConfig::parse(&config_text(slot_extra), "conf/edge.toml") {
        Ok(cfg) => cfg,
        Err(e) => panic!("{e}"),
    }
}

fn config_text(slot_extra: &str) -> String {
    let recipient = keys::encode_recipient_public_key(&recipient().public_key());
    format!(
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
    )
}

fn plane_of(cfg: &EdgeConfig) -> CredentialPlane {
    CredentialPlane::from_parts(
        cfg,
        SigningKey::from_bytes(&[7; 32]),
        vec![Zeroizing::new(SECRET.to_vec())],
        Zeroizing::new([4; 32]),
    )
}

fn plane(slot_extra: &str) -> CredentialPlane {
    plane_of(&config(slot_extra))
}

/// The tunnel request the leases of these tests ride on.
static TUNNEL: LazyLock<pb::ProviderTunnelRequest> = LazyLock::new(|| pb::ProviderTunnelRequest {
    run_id: "run-7".into(),
    adapter: "openai".into(),
    target: "gpt-4o".into(),
    method: "POST".into(),
    path: "/v1/chat/completions".into(),
    operation: "chat_completions".into(),
    headers: vec![pb::Header {
        name: "content-type".into(),
        value: Bytes::from_static(b"application/json"),
    }],
    ..Default::default()
});

/// The body [`TUNNEL`] carries, in the pieces a spliced body is sent in.
static TUNNEL_BODY: LazyLock<BodyParts> = LazyLock::new(|| {
    BodyParts::spliced(
        Bytes::from_static(br#"{"model":"#),
        Bytes::from_static(br#""gpt-4o""#),
        Bytes::from_static(br#","messages":[]}"#),
    )
});

/// [`request_digest`] of [`TUNNEL`] sent to `path`.
fn tunnel_digest(path: &str) -> [u8; 32] {
    request_digest(&BoundRequest {
        method: "POST",
        path,
        headers: &TUNNEL.headers,
        body: &[Bytes::from_static(br#"{"model":"gpt-4o","messages":[]}"#)],
    })
}

fn request_for<'a>(
    node_id: &'a str,
    provider_id: &'a str,
    tunnel: &'a pb::ProviderTunnelRequest,
) -> LeaseRequest<'a> {
    LeaseRequest {
        principal: "team-a",
        route: "gpt-x",
        node_id,
        provider_id,
        generation: 6,
        tunnel,
        body: &TUNNEL_BODY,
    }
}

fn request<'a>(node_id: &'a str, provider_id: &'a str) -> LeaseRequest<'a> {
    request_for(node_id, provider_id, &TUNNEL)
}

fn entropy() -> LeaseEntropy {
    LeaseEntropy::from_seed([1; 32])
}

fn issued(plane: &CredentialPlane, req: &LeaseRequest<'_>) -> IssuedLease {
    match plane.issue(req, NOW_MS, "lease-1", entropy()) {
        Ok(Some(issued)) => issued,
        other => panic!("expected a lease, got {other:?}"),
    }
}

/// `plane`'s successor for `cfg` (a reload), which must build.
fn successor(plane: &CredentialPlane, cfg: &EdgeConfig) -> (CredentialPlane, CredentialsChange) {
    plane.successor(cfg).unwrap_or_else(|e| panic!("{e}"))
}

/// The provider trust of node-a's `openai` adapter (plain HTTP).
static PLAIN_HTTP: LazyLock<[u8; 32]> =
    LazyLock::new(|| lease::provider_trust_digest(&ProviderTrust::PlainHttp));

/// What node-a expects of [`TUNNEL`] (the scope it computes itself),
/// with the Edge-only fields left to the signature.
fn node_scope(digest: &[u8; 32]) -> ExpectedScope<'_> {
    ExpectedScope::computed_by_node(
        "node-a",
        "openai/gpt-4o",
        "http://127.0.0.1:9",
        &PLAIN_HTTP,
        "run-7",
        digest,
        Some("vllm"),
    )
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

// CONTRACT: C1 — after selection the Edge binds the exact scope
// (principal, slot, route, profile, upstream target, node, recipient,
// credential/route revision, projection generation), where the secret
// goes (the adapter's origin) and the one request it serves (run id,
// digest of method, path, headers and body); it signs it and seals the
// secret to the node's recipient key; the node opens it.
#[test]
fn issue_binds_the_exact_scope() {
    let plane = plane("");
    assert!(plane.is_managed("node-a", "gpt"));
    let issued = issued(&plane, &request("node-a", "gpt"));
    let recipient = recipient();
    let digest = tunnel_digest("/v1/chat/completions");
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
        projection_generation: plane.projection("node-a", 6),
        upstream_origin: "http://127.0.0.1:9".into(),
        run_id: "run-7".into(),
        request_digest: Bytes::copy_from_slice(&digest),
        provider_trust: Bytes::copy_from_slice(&PLAIN_HTTP[..]),
    };
    assert_eq!(issued.binding, expected);
    let lease = &issued.lease;
    assert_eq!(lease.lease_id, "lease-1");
    assert_eq!(lease.sequence, 1);
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
            principal: Some("team-a"),
            slot: Some("openai-main"),
            route: Some("gpt-x"),
            credential_revision: Some(3),
            route_revision: Some(1),
            projection_generation: Some(plane.projection("node-a", 6)),
            ..node_scope(&digest)
        },
        revoked: &[],
        origin_pins: &OriginPins::new(),
        now_unix_ms: NOW_MS + 1,
        clock_skew_ms: 0,
    };
    let mut replay = ReplayGuard::new(NOW_MS);
    let opened = open(Some(lease), Some(&issued.binding), &ctx, &mut replay)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(opened.secret_bytes(), SECRET);
    assert_eq!(
        plane.issuer_public_key(),
        keys::encode_issuer_public_key(&verifying)
    );
}

// CONTRACT: C1, R5 — the projection of a connection generation is a
// keyed hash: the same (node, generation) gives the same value in one
// process, anything else — another generation, node or process — gives
// another, and only the issuing plane can check it.
#[test]
fn projection_generation_is_opaque_and_checked_by_its_edge() {
    let plane = plane("");
    let p = plane.projection("node-a", 6);
    assert_eq!(p, plane.projection("node-a", 6));
    assert!(plane.is_projection_of(p, "node-a", 6));
    assert_ne!(p, 6);
    for (node, generation) in [("node-a", 7), ("node-a", 5), ("node-b", 6)] {
        assert!(
            !plane.is_projection_of(p, node, generation),
            "{node} {generation}"
        );
    }
    // A restarted Edge (another projection key) never repeats it, even
    // though its generations start again at 1.
    let restarted = CredentialPlane::from_parts(
        &config(""),
        SigningKey::from_bytes(&[7; 32]),
        vec![Zeroizing::new(SECRET.to_vec())],
        Zeroizing::new([5; 32]),
    );
    assert!(!restarted.is_projection_of(p, "node-a", 6));
    // Consecutive generations leave no visible order.
    let values: Vec<u64> = (1..=4).map(|g| plane.projection("node-a", g)).collect();
    let mut sorted = values.clone();
    sorted.sort_unstable();
    assert_ne!(values, sorted, "{values:?}");
}

// CONTRACT: C1 — every lease of a node takes the next sequence number,
// the Node's replay window key; a request the destination has no path
// for gets no lease (fail closed).
#[test]
fn leases_are_numbered_per_node_and_need_a_destination() {
    let plane = plane("");
    let sequences: Vec<u64> = (0..3)
        .map(|_| issued(&plane, &request("node-a", "gpt")).lease.sequence)
        .collect();
    assert_eq!(sequences, [1, 2, 3]);
    let unknown = pb::ProviderTunnelRequest {
        operation: "images".into(),
        ..TUNNEL.clone()
    };
    assert_eq!(
        plane
            .issue(
                &request_for("node-a", "gpt", &unknown),
                NOW_MS,
                "l",
                entropy()
            )
            .map(|_| ()),
        Err(CredentialError::NoDestination {
            provider: "node-a/gpt".into()
        })
    );
    // The failed request took no sequence number.
    assert_eq!(issued(&plane, &request("node-a", "gpt")).lease.sequence, 4);
    // Without an operation the tunnel's path is the request target (U3).
    let by_path = pb::ProviderTunnelRequest {
        operation: String::new(),
        path: "v1/custom".into(),
        ..TUNNEL.clone()
    };
    let issued = plane
        .issue(
            &request_for("node-a", "gpt", &by_path),
            NOW_MS,
            "l",
            entropy(),
        )
        .expect("issues")
        .expect("a lease");
    assert_eq!(
        &issued.binding.request_digest[..],
        &tunnel_digest("/v1/custom")[..]
    );
}

// CONTRACT: C1 — after a reload moves an adapter, the leases issued
// from then on are bound to its new origin and profile paths.
#[test]
fn reloaded_destinations_are_bound_from_then_on() {
    let plane = plane("");
    let (same, change) = successor(&plane, &config(""));
    assert_eq!(
        change,
        CredentialsChange {
            slots: 1,
            ..CredentialsChange::default()
        }
    );
    assert_eq!(
        issued(&same, &request("node-a", "gpt"))
            .binding
            .upstream_origin,
        "http://127.0.0.1:9"
    );
    let text = "base_url = \"http://127.0.0.1:9\"";
    let moved = EdgeConfig::parse(
        &config_text("").replace(text, "base_url = \"http://10.1.1.1:8001/gw\""),
        "conf/edge.toml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let (moved, _) = successor(&plane, &moved);
    let issued = issued(&moved, &request("node-a", "gpt"));
    assert_eq!(issued.binding.upstream_origin, "http://10.1.1.1:8001");
    assert_eq!(
        &issued.binding.request_digest[..],
        &tunnel_digest("/gw/v1/chat/completions")[..]
    );
}

/// [`config_text`] with node-a's `openai` adapter on `https://` and
/// `ca_pem` as its CA bundle (what [`EdgeConfig::load`] reads from its
/// `ca_file`; `None`: the Node's default roots).
fn https_config(ca_pem: Option<String>) -> EdgeConfig {
    let text = config_text("").replace(
        "base_url = \"http://127.0.0.1:9\"",
        "base_url = \"https://127.0.0.1:9\"",
    );
    let mut cfg = EdgeConfig::parse(&text, "conf/edge.toml").unwrap_or_else(|e| panic!("{e}"));
    cfg.nodes[0].adapters[0].tls.ca_pem = ca_pem;
    cfg
}

/// The provider trust a Node computes from the client it builds for
/// `pushed` (its `AdapterConfig.tls`): the anchors of the client itself.
fn trust_of_client(pushed: Option<String>) -> [u8; 32] {
    let client = iop_engine::tls::UpstreamTls::new(&UpstreamTlsSettings {
        ca_pem: pushed,
        insecure_skip_verify: false,
    })
    .expect("client");
    let trust = match client.private_ca() {
        Some(certs) => ProviderTrust::PrivateCa(certs.iter().map(|c| c.as_ref()).collect()),
        None => ProviderTrust::DefaultRoots,
    };
    lease::provider_trust_digest(&trust)
}

// CONTRACT: C1, C5 — a lease is bound to whom the Node will trust to be
// the provider: the private CA the Edge pushes (the same digest the Node
// computes from the client it builds), or the Node's default roots
// without one. A reload that changes the CA binds the leases issued
// from then on to the new one; a reload that only reorders the bundle
// changes nothing.
#[test]
fn leases_are_bound_to_the_provider_trust_and_follow_reloads() {
    let ca_a = iop_engine::certs::DevCa::new("provider.test")
        .expect("CA")
        .cert_pem();
    let ca_b = iop_engine::certs::DevCa::new("provider.test")
        .expect("CA")
        .cert_pem();
    let plane = plane_of(&https_config(Some(ca_a.clone())));
    let trust = |plane: &CredentialPlane| {
        let issued = issued(plane, &request("node-a", "gpt"));
        assert_eq!(issued.binding.upstream_origin, "https://127.0.0.1:9");
        <[u8; 32]>::try_from(&issued.binding.provider_trust[..]).expect("32 bytes")
    };
    let bound_a = trust(&plane);
    assert_eq!(bound_a, trust_of_client(Some(ca_a.clone())));
    assert_ne!(bound_a, *PLAIN_HTTP);
    // The CA file rotated: a SIGHUP reload re-reads it.
    let reloaded = |ca_pem: Option<String>| successor(&plane, &https_config(ca_pem)).0;
    let bound_b = trust(&reloaded(Some(ca_b.clone())));
    assert_eq!(bound_b, trust_of_client(Some(ca_b.clone())));
    assert_ne!(bound_b, bound_a);
    // A bundle of both, in either order and with text around the
    // blocks, is one set of anchors.
    let both = format!("{ca_a}\n{ca_b}");
    let bound_both = trust(&reloaded(Some(both.clone())));
    let reordered = format!("# provider CAs\n\n{ca_b}\n\n{ca_a}\n");
    assert_eq!(trust(&reloaded(Some(reordered))), bound_both);
    assert_eq!(bound_both, trust_of_client(Some(both)));
    assert_ne!(bound_both, bound_b);
    // Without a private CA: the Node's default roots.
    assert_eq!(
        trust(&reloaded(None)),
        lease::provider_trust_digest(&ProviderTrust::DefaultRoots)
    );
    // A bundle that does not parse (only a config never loaded has one)
    // gives no destination: nothing is issued.
    assert_eq!(
        reloaded(Some("no PEM".into()))
            .issue(&request("node-a", "gpt"), NOW_MS, "l", entropy())
            .map(|_| ()),
        Err(CredentialError::NoDestination {
            provider: "node-a/gpt".into()
        })
    );
}

// CONTRACT: C3 — the revoked revisions of the slots serving a node's
// providers travel in that node's config payload.
#[test]
fn node_payloads_name_the_revoked_revisions() {
    let cfg = config("revoked_revisions = [1, 2]");
    let payload = cfg.node_config_payload(cfg.node("node-a").expect("node-a"), 4);
    assert_eq!(
        payload.revoked_credentials,
        [pb::RevokedCredential {
            slot: "openai-main".into(),
            revisions: vec![1, 2],
        }]
    );
    assert!(payload.credential_leases_required);
    let other = cfg.node_config_payload(cfg.node("node-b").expect("node-b"), 4);
    assert!(other.revoked_credentials.is_empty());
    let none = config("");
    let payload = none.node_config_payload(none.node("node-a").expect("node-a"), 4);
    assert!(payload.revoked_credentials.is_empty());
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
    assert_eq!((a.lease.sequence, b.lease.sequence), (1, 2));
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
    assert!(debug.contains("projection_key: \"<redacted>\""), "{debug}");
    assert!(!debug.contains("[4, 4"), "{debug}");
    let issued = issued(&plane, &request("node-a", "gpt"));
    let debug = format!("{issued:?}");
    assert!(debug.contains("sealed_secret: \"<redacted>\""), "{debug}");
    assert!(!debug.contains("signature"), "{debug}");
    let keys = ClientKeys::from_config(&[ClientKeySpec {
        principal: "team-a".into(),
        key_hash: hash_client_key(b"k"),
        admin: false,
        metrics: false,
        limits: Default::default(),
        budgets: Default::default(),
        models: None,
        priority: crate::config::DEFAULT_PRIORITY,
        weight: 1,
    }]);
    assert_eq!(format!("{keys:?}"), "ClientKeys { keys: 1 }");
}

// CONTRACT: C4 — the config pushed to a managed node says leases are
// required and carries no secret.
#[test]
fn node_config_payload_carries_no_secret() {
    use prost::Message;
    let cfg = config("");
    let spec = crate::control::control_spec(&cfg);
    assert!(spec.nodes[0].config.credential_leases_required);
    assert!(!spec.nodes[1].config.credential_leases_required);
    for node in &spec.nodes {
        assert!(!contains(&node.config.encode_to_vec(), SECRET));
    }
}

/// A fresh directory under the system temp dir.
fn temp_dir(tag: &str) -> std::path::PathBuf {
    thread_local!(static NEXT: Cell<u32> = const { Cell::new(0) });
    let n = NEXT.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    let dir = std::env::temp_dir().join(format!("iop-edge-cred-{tag}-{}-{n}", std::process::id()));
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
    let digest = tunnel_digest("/v1/chat/completions");
    let ctx = OpenContext {
        recipient: &recipient,
        issuer: &keys::load_issuer_key(&dir.join("issuer.key"))
            .expect("issuer")
            .verifying_key(),
        scope: node_scope(&digest),
        revoked: &[],
        origin_pins: &OriginPins::new(),
        now_unix_ms: issued.lease.not_before_unix_ms,
        clock_skew_ms: 0,
    };
    let opened = open(
        Some(&issued.lease),
        Some(&issued.binding),
        &ctx,
        &mut ReplayGuard::new(issued.lease.not_before_unix_ms),
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

// ---------------------------------------------------------------------------
// Reloads: the next plane swapped in

/// A directory with an issuer key and slot secret files, and configs that
/// read them: what a reload re-reads.
struct Rotation {
    dir: std::path::PathBuf,
}

impl Rotation {
    fn new(tag: &str) -> Self {
        let dir = temp_dir(tag);
        keys::generate_issuer_key(&dir.join("issuer.key")).expect("issuer key");
        Self { dir }
    }

    /// Writes the secret file `name` (mode 0600).
    fn write_secret(&self, name: &str, bytes: &[u8]) {
        write_mode(&self.dir.join(name), bytes, 0o600);
    }

    /// [`config_text`] with `slot_extra`, the issuer key file `issuer`, and
    /// the slot reading the secret file `secret` at `revision`.
    fn config_with(
        &self,
        issuer: &str,
        secret: &str,
        revision: u64,
        slot_extra: &str,
    ) -> EdgeConfig {
        let text = config_text(slot_extra)
            .replace(
                "issuer_key = \"issuer.key\"",
                &format!("issuer_key = \"{}\"", self.dir.join(issuer).display()),
            )
            .replace(
                "secret_env = \"OPENAI_KEY\"",
                &format!("secret_file = \"{}\"", self.dir.join(secret).display()),
            )
            .replace("revision = 3", &format!("revision = {revision}"));
        EdgeConfig::parse(&text, self.dir.join("edge.toml")).unwrap_or_else(|e| panic!("{e}"))
    }

    fn config(&self, secret: &str, revision: u64, slot_extra: &str) -> EdgeConfig {
        self.config_with("issuer.key", secret, revision, slot_extra)
    }

    /// The plane `cfg` loads, running.
    fn running(&self, cfg: &EdgeConfig) -> RunningPlane {
        let plane = CredentialPlane::load(cfg, &|_| None)
            .unwrap_or_else(|e| panic!("{e}"))
            .expect("enabled");
        RunningPlane::new(plane)
    }

    fn issuer(&self) -> ed25519_dalek::VerifyingKey {
        keys::load_issuer_key(&self.dir.join("issuer.key"))
            .expect("issuer")
            .verifying_key()
    }
}

impl Drop for Rotation {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What node-a does with `issued` ([`request`] on node-a), trusting
/// `issuer`, with `revoked` from its config and its replay state: the
/// secret it would inject, or why it refuses the lease.
fn node_a_opens(
    issued: &IssuedLease,
    issuer: &ed25519_dalek::VerifyingKey,
    revoked: &[pb::RevokedCredential],
    replay: &mut ReplayGuard,
) -> Result<Vec<u8>, lease::LeaseError> {
    let recipient = recipient();
    let digest = tunnel_digest("/v1/chat/completions");
    let ctx = OpenContext {
        recipient: &recipient,
        issuer,
        scope: node_scope(&digest),
        revoked,
        origin_pins: &OriginPins::new(),
        now_unix_ms: NOW_MS + 1,
        clock_skew_ms: 0,
    };
    open(Some(&issued.lease), Some(&issued.binding), &ctx, replay)
        .map(|opened| opened.secret_bytes().to_vec())
}

fn issued_as(plane: &CredentialPlane, req: &LeaseRequest<'_>, lease_id: &str) -> IssuedLease {
    match plane.issue(req, NOW_MS, lease_id, entropy()) {
        Ok(Some(issued)) => issued,
        other => panic!("expected a lease, got {other:?}"),
    }
}

// CONTRACT: C1 — a reload swaps the plane for every holder of the
// running one at once: a new revision's secret (read again from its
// file) is sealed into the next lease, which node-a opens to exactly
// those bytes; the issuer key and the projection stay; the node's
// sequence numbers go on increasing (a request that took the old plane
// before the swap draws from the same counter), so node-a's replay
// window accepts every one of them once.
#[test]
fn a_reload_seals_the_new_revision_and_carries_sequences_and_projection() {
    let r = Rotation::new("swap");
    r.write_secret("secret-3", b"sk-rev-3\n");
    let running = r.running(&r.config("secret-3", 3, ""));
    let shard = running.clone();
    let held = running.get();
    let issuer = r.issuer();
    let mut replay = ReplayGuard::new(NOW_MS);
    let first = issued_as(&shard.get(), &request("node-a", "gpt"), "lease-1");
    assert_eq!(
        (first.lease.sequence, first.binding.credential_revision),
        (1, 3)
    );
    assert_eq!(
        node_a_opens(&first, &issuer, &[], &mut replay).as_deref(),
        Ok(&b"sk-rev-3"[..])
    );

    r.write_secret("secret-4", b"sk-rev-4-rotated");
    let mut next = r.config("secret-4", 4, "revoked_revisions = [3]");
    let prepared = running.prepare(&mut next).unwrap_or_else(|e| panic!("{e}"));
    assert!(!prepared.issuer_differs());
    // Prepared is not in force.
    let before = issued_as(&shard.get(), &request("node-a", "gpt"), "lease-2");
    assert_eq!(
        (before.lease.sequence, before.binding.credential_revision),
        (2, 3)
    );
    let change = running.commit(prepared);
    assert_eq!(
        change,
        CredentialsChange {
            slots: 1,
            rotated: vec!["openai-main".into()],
            ..CredentialsChange::default()
        }
    );
    let after = issued_as(&shard.get(), &request("node-a", "gpt"), "lease-3");
    assert_eq!(
        (after.lease.sequence, after.binding.credential_revision),
        (3, 4)
    );
    assert_eq!(
        after.binding.projection_generation,
        held.projection("node-a", 6)
    );
    assert_eq!(after.lease.issuer_key_id, first.lease.issuer_key_id);
    let revoked = [pb::RevokedCredential {
        slot: "openai-main".into(),
        revisions: vec![3],
    }];
    assert_eq!(
        node_a_opens(&after, &issuer, &revoked, &mut replay).as_deref(),
        Ok(&b"sk-rev-4-rotated"[..])
    );
    // The plane a request took before the swap shares the counter: no
    // number is issued twice; its revision is revoked on node-a by now.
    let late = issued_as(&held, &request("node-a", "gpt"), "lease-4");
    assert_eq!(
        (late.lease.sequence, late.binding.credential_revision),
        (4, 3)
    );
    assert_eq!(
        node_a_opens(&late, &issuer, &revoked, &mut replay),
        Err(lease::LeaseError::Revoked { revision: 3 })
    );
    assert_eq!(
        issued_as(&shard.get(), &request("node-a", "gpt"), "lease-5")
            .lease
            .sequence,
        5
    );
}

// CONTRACT: C3, C5 — a reload that revokes the current revision, or
// disables the slot, refuses the next lease (503, no provider call);
// undoing it issues again with the secret kept from before: an
// unchanged revision is not read again (its file may be gone).
#[test]
fn a_reload_revokes_and_disables_from_the_next_lease() {
    let r = Rotation::new("revoke");
    r.write_secret("secret-3", b"sk-rev-3");
    let running = r.running(&r.config("secret-3", 3, ""));
    let issuer = r.issuer();
    let mut replay = ReplayGuard::new(NOW_MS);
    let first = issued_as(&running.get(), &request("node-a", "gpt"), "lease-1");
    assert_eq!(
        node_a_opens(&first, &issuer, &[], &mut replay).as_deref(),
        Ok(&b"sk-rev-3"[..])
    );
    let reload = |slot_extra: &str| {
        let mut next = r.config("secret-3", 3, slot_extra);
        let prepared = running.prepare(&mut next).unwrap_or_else(|e| panic!("{e}"));
        running.commit(prepared)
    };
    let changed = CredentialsChange {
        slots: 1,
        changed: vec!["openai-main".into()],
        ..CredentialsChange::default()
    };
    assert_eq!(reload("revoked_revisions = [1, 3]"), changed);
    let refused = running
        .get()
        .issue(&request("node-a", "gpt"), NOW_MS, "l", entropy())
        .map(|_| ());
    assert_eq!(
        refused,
        Err(CredentialError::RevisionRevoked {
            slot: "openai-main".into(),
            revision: 3
        })
    );
    let api = refused.expect_err("refused").api_error();
    assert_eq!(
        (api.status, api.body_json()["error"]["code"].clone()),
        (503, serde_json::json!("credential_unavailable"))
    );
    assert_eq!(reload("enabled = false"), changed);
    assert_eq!(
        running
            .get()
            .issue(&request("node-a", "gpt"), NOW_MS, "l", entropy())
            .map(|_| ()),
        Err(CredentialError::SlotDisabled {
            slot: "openai-main".into()
        })
    );
    // Back as it was, with the secret file gone: the secret read at start
    // is still the revision's.
    std::fs::remove_file(r.dir.join("secret-3")).expect("remove");
    assert_eq!(reload(""), changed);
    let again = issued_as(&running.get(), &request("node-a", "gpt"), "lease-2");
    assert_eq!(again.lease.sequence, 2);
    assert_eq!(
        node_a_opens(&again, &issuer, &[], &mut replay).as_deref(),
        Ok(&b"sk-rev-3"[..])
    );
}

// CONTRACT: C4 — a reload whose new secret cannot be read is refused
// whole, naming the file, the key and the reason (never a secret), and
// the running plane stays; a secret_env secret cannot be read again (the
// environment was read and wiped at start), so a new revision of one is
// refused while other changes to its slot apply.
#[test]
fn a_secret_that_cannot_be_read_refuses_the_reload() {
    let r = Rotation::new("refused");
    r.write_secret("secret-3", b"sk-rev-3");
    let running = r.running(&r.config("secret-3", 3, ""));
    write_mode(&r.dir.join("secret-4"), b"sk-rev-4", 0o644);
    let mut next = r.config("secret-4", 4, "");
    let err = running.prepare(&mut next).expect_err("group-readable");
    assert_eq!(err.key(), "credentials.slots[0].secret_file");
    assert_eq!(
        err.reason(),
        format!(
            "{} has mode 0644; a secret file must not be accessible to group or others \
             (chmod 600)",
            r.dir.join("secret-4").display()
        )
    );
    assert!(!err.to_string().contains("sk-rev-4"), "{err}");
    let mut next = r.config("secret-5", 5, "");
    let err = running.prepare(&mut next).expect_err("missing");
    assert_eq!(err.key(), "credentials.slots[0].secret_file");
    let mut next = r.config_with("missing.key", "secret-3", 3, "");
    assert_eq!(
        running.prepare(&mut next).expect_err("no issuer").key(),
        "credentials.issuer_key"
    );
    // The running plane is untouched.
    let still = issued_as(&running.get(), &request("node-a", "gpt"), "lease-1");
    assert_eq!(
        (still.lease.sequence, still.binding.credential_revision),
        (1, 3)
    );

    // A secret from the environment: kept while its revision stays.
    let env_config = |revision: u64, slot_extra: &str| {
        let mut cfg = r.config("secret-3", revision, slot_extra);
        if let Some(c) = cfg.credentials.as_mut() {
            c.slots[0].secret = SecretSource::Env("OPENAI_KEY".into());
        }
        cfg
    };
    let env = |name: &str| (name == "OPENAI_KEY").then(|| OsString::from("sk-from-env"));
    let running = RunningPlane::new(
        CredentialPlane::load(&env_config(3, ""), &env)
            .expect("loads")
            .expect("enabled"),
    );
    let mut next = env_config(4, "");
    let err = running.prepare(&mut next).expect_err("env revision");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: credentials.slots[0].secret_env: environment variable OPENAI_KEY is read only at \
             startup (the environment of a running Edge does not change): a slot that is added, \
             or gets a new revision or source, with secret_env needs a restart; use secret_file \
             to rotate by reload",
            r.dir.join("edge.toml").display()
        )
    );
    let mut next = env_config(3, "revoked_revisions = [2]");
    let prepared = running.prepare(&mut next).unwrap_or_else(|e| panic!("{e}"));
    running.commit(prepared);
    let issued = issued_as(&running.get(), &request("node-a", "gpt"), "lease-2");
    assert_eq!(
        node_a_opens(&issued, &r.issuer(), &[], &mut ReplayGuard::new(NOW_MS)).as_deref(),
        Ok(&b"sk-from-env"[..])
    );
}

// CONTRACT: C1 — slots added and removed by a reload, and a provider
// moved to another slot: each provider's next lease is bound to the
// slot serving it now, with that slot's secret; a provider no slot
// serves any more gets none; a node's sequence continues across it all.
#[test]
fn slots_added_removed_and_moved_by_reload() {
    let r = Rotation::new("slots");
    r.write_secret("secret-3", b"sk-main");
    r.write_secret("secret-b", b"sk-second");
    let running = r.running(&r.config("secret-3", 3, ""));
    let node_b_key = format!(
        "id = \"node-b\"\nrecipient_key = \"{}\"\n",
        keys::encode_recipient_public_key(&recipient().public_key())
    );
    let second_slot = format!(
        "\n[[credentials.slots]]\nname = \"openai-b\"\nsecret_file = \"{}\"\n\
         providers = [\"node-b/gpt\"]\n",
        r.dir.join("secret-b").display()
    );
    let reload = |text: String| {
        let mut next =
            EdgeConfig::parse(&text, r.dir.join("edge.toml")).unwrap_or_else(|e| panic!("{e}"));
        let prepared = running.prepare(&mut next).unwrap_or_else(|e| panic!("{e}"));
        running.commit(prepared)
    };
    let text = |slot_extra: &str, managed_b: bool| {
        let text = config_text(slot_extra)
            .replace(
                "issuer_key = \"issuer.key\"",
                &format!("issuer_key = \"{}\"", r.dir.join("issuer.key").display()),
            )
            .replace(
                "secret_env = \"OPENAI_KEY\"",
                &format!("secret_file = \"{}\"", r.dir.join("secret-3").display()),
            );
        if managed_b {
            text.replace("id = \"node-b\"\n", &node_b_key)
        } else {
            text
        }
    };
    let node_b = |plane: &CredentialPlane| {
        let digest = tunnel_digest("/v1/chat/completions");
        let issued = plane
            .issue(&request("node-b", "gpt"), NOW_MS, "lease-b", entropy())
            .unwrap_or_else(|e| panic!("{e}"))?;
        let recipient = recipient();
        let ctx = OpenContext {
            recipient: &recipient,
            issuer: &r.issuer(),
            scope: ExpectedScope::computed_by_node(
                "node-b",
                "openai/gpt-4o",
                "http://127.0.0.1:11",
                &PLAIN_HTTP,
                "run-7",
                &digest,
                None,
            ),
            revoked: &[],
            origin_pins: &OriginPins::new(),
            now_unix_ms: NOW_MS + 1,
            clock_skew_ms: 0,
        };
        let opened = open(
            Some(&issued.lease),
            Some(&issued.binding),
            &ctx,
            &mut ReplayGuard::new(NOW_MS),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        Some((
            issued.binding.slot.clone(),
            issued.lease.sequence,
            opened.secret_bytes().to_vec(),
        ))
    };
    assert_eq!(node_b(&running.get()), None);

    assert_eq!(
        reload(text(&second_slot, true)),
        CredentialsChange {
            slots: 2,
            added: vec!["openai-b".into()],
            ..CredentialsChange::default()
        }
    );
    assert_eq!(
        node_b(&running.get()),
        Some(("openai-b".into(), 1, b"sk-second".to_vec()))
    );

    // node-b/gpt moves to openai-main; openai-b goes.
    let both = text("", true).replace(
        "providers = [\"node-a/gpt\"]",
        "providers = [\"node-a/gpt\", \"node-b/gpt\"]",
    );
    assert_eq!(
        reload(both),
        CredentialsChange {
            slots: 1,
            removed: vec!["openai-b".into()],
            changed: vec!["openai-main".into()],
            ..CredentialsChange::default()
        }
    );
    assert_eq!(
        node_b(&running.get()),
        Some(("openai-main".into(), 2, b"sk-main".to_vec()))
    );

    // No slot serves node-b any more: its tunnels carry no lease.
    reload(text("", false));
    assert_eq!(node_b(&running.get()), None);
    assert!(!running.get().is_managed("node-b", "gpt"));
    // Managed again later: its numbers go on from where they were.
    reload(text(&second_slot, true));
    assert_eq!(
        node_b(&running.get()),
        Some(("openai-b".into(), 3, b"sk-second".to_vec()))
    );
}

// A file that names another issuer key: reported (the nodes trust the
// running issuer's public key), the running key keeps signing, and the
// rest of the reload applies. The same key under another path is no
// change. Without [credentials] in the file the running slots stay; an
// Edge started without a plane stays without one.
#[test]
fn the_issuer_key_and_the_plane_itself_stay_until_a_restart() {
    let r = Rotation::new("issuer");
    r.write_secret("secret-3", b"sk-rev-3");
    let running = r.running(&r.config("secret-3", 3, ""));
    let signing = running.get().issuer_key_id();
    keys::generate_issuer_key(&r.dir.join("issuer-2.key")).expect("issuer key");
    let mut next = r.config_with("issuer-2.key", "secret-3", 3, "revoked_revisions = [3]");
    let prepared = running.prepare(&mut next).unwrap_or_else(|e| panic!("{e}"));
    assert!(prepared.issuer_differs());
    running.commit(prepared);
    assert_eq!(running.get().issuer_key_id(), signing);
    assert!(matches!(
        running
            .get()
            .issue(&request("node-a", "gpt"), NOW_MS, "l", entropy()),
        Err(CredentialError::RevisionRevoked { revision: 3, .. })
    ));
    std::fs::copy(r.dir.join("issuer.key"), r.dir.join("issuer-copy.key")).expect("copy");
    let mut next = r.config_with("issuer-copy.key", "secret-3", 3, "");
    assert!(!running
        .prepare(&mut next)
        .unwrap_or_else(|e| panic!("{e}"))
        .issuer_differs());

    // [credentials] removed from the file: the running slots stay, and the
    // config the rest of the reload uses says so.
    let spec = running.get().spec.clone();
    let mut off = r.config("secret-3", 3, "");
    off.credentials = None;
    let prepared = prepare_reload(Some(&running), &mut off)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("a plane");
    assert!(!prepared.issuer_differs());
    running.commit(prepared);
    assert_eq!(off.credentials.as_ref(), Some(&spec));
    assert!(running.get().is_managed("node-a", "gpt"));
    // No plane running: a file with [credentials] turns none on, and its
    // nodes are not told to require leases.
    let mut on = r.config("secret-3", 3, "");
    assert!(prepare_reload(None, &mut on)
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());
    assert_eq!(on.credentials, None);
    assert!(
        !on.node_config_payload(on.node("node-a").expect("node-a"), 2)
            .credential_leases_required
    );
}
