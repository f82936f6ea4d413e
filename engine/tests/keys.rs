//! Lease key files: generation, permission refusal, round trips, parse errors
//! that name the file, public-key text encoding, and a full issue/open with
//! keys loaded from disk.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use iop_engine::keys::{
    decode_issuer_public_key, decode_recipient_public_key, encode_issuer_public_key,
    encode_recipient_public_key, generate_issuer_key, generate_recipient_key, lease_entropy,
    load_issuer_key, load_recipient_key, pkcs8, random_lease_id, KeyError,
};
use iop_wire::lease::{
    encode_hex, issue, open, provider_trust_digest, recipient_key_id, request_digest,
    upstream_target, BoundRequest, ExpectedScope, IssueParams, OpenContext, OriginPins,
    ProviderTrust, ReplayGuard,
};
use iop_wire::pb::CredentialLeaseBinding;

/// A scratch directory removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(label: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "iop-engine-keys-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        if let Err(e) = fs::create_dir_all(&dir) {
            panic!("create {}: {e}", dir.display());
        }
        ScratchDir(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn mode_of(path: &Path) -> u32 {
    match fs::metadata(path) {
        Ok(meta) => meta.permissions().mode() & 0o7777,
        Err(e) => panic!("stat {}: {e}", path.display()),
    }
}

fn chmod(path: &Path, mode: u32) {
    if let Err(e) = fs::set_permissions(path, fs::Permissions::from_mode(mode)) {
        panic!("chmod {}: {e}", path.display());
    }
}

fn write(path: &Path, contents: &str, mode: u32) {
    if let Err(e) = fs::write(path, contents) {
        panic!("write {}: {e}", path.display());
    }
    chmod(path, mode);
}

fn issuer_text(body: &str) -> String {
    format!("-----BEGIN IOP ISSUER KEY-----\n{body}\n-----END IOP ISSUER KEY-----\n")
}

#[test]
fn issuer_key_round_trips_through_a_0600_file() {
    let dir = ScratchDir::new("issuer");
    let path = dir.join("issuer.key");
    let public = match generate_issuer_key(&path) {
        Ok(public) => public,
        Err(e) => panic!("generate: {e}"),
    };
    assert_eq!(mode_of(&path), 0o600);
    let loaded = match load_issuer_key(&path) {
        Ok(key) => key,
        Err(e) => panic!("load: {e}"),
    };
    assert_eq!(loaded.verifying_key(), public);

    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => panic!("read: {e}"),
    };
    // PKCS#8 v1 (RFC 8410): the fixed Ed25519 header, then the seed.
    let der = pkcs8::encode_v1(pkcs8::Algorithm::Ed25519, loaded.as_bytes());
    let expected = format!(
        "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
        &pkcs8::base64_encode(&der[..])[..]
    );
    assert_eq!(text, expected);
    assert!(text.contains("\nMC4CAQAwBQYDK2VwBCIEI"), "{text}");
}

#[test]
fn recipient_key_round_trips_through_a_0600_file() {
    let dir = ScratchDir::new("recipient");
    let path = dir.join("recipient.key");
    let public = match generate_recipient_key(&path) {
        Ok(public) => public,
        Err(e) => panic!("generate: {e}"),
    };
    assert_eq!(mode_of(&path), 0o600);
    let loaded = match load_recipient_key(&path) {
        Ok(key) => key,
        Err(e) => panic!("load: {e}"),
    };
    assert_eq!(loaded.public_key(), public);
    assert_eq!(loaded.key_id(), recipient_key_id(&public));
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => panic!("read: {e}"),
    };
    // PKCS#8 v1 with the X25519 OID (1.3.101.110).
    assert!(text.starts_with("-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VuBCIEI"));
    assert!(text.ends_with("\n-----END PRIVATE KEY-----\n"));
    assert_eq!(text.len(), 28 + 65 + 26);
}

#[test]
fn generate_never_overwrites_an_existing_file() {
    let dir = ScratchDir::new("exists");
    let path = dir.join("issuer.key");
    write(&path, "keep me", 0o600);
    let err = generate_issuer_key(&path).err();
    let Some(KeyError::Write {
        path: named,
        source,
    }) = err
    else {
        panic!("expected a write error, got {err:?}");
    };
    assert_eq!(named, path);
    assert_eq!(source.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(fs::read_to_string(&path).ok().as_deref(), Some("keep me"));
}

#[test]
fn group_or_world_accessible_key_files_are_refused() {
    // CONTRACT: C4 — private keys are not left readable by other users.
    let dir = ScratchDir::new("perms");
    let issuer = dir.join("issuer.key");
    let recipient = dir.join("recipient.key");
    if let Err(e) = generate_issuer_key(&issuer) {
        panic!("generate: {e}");
    }
    if let Err(e) = generate_recipient_key(&recipient) {
        panic!("generate: {e}");
    }
    for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o610, 0o601] {
        chmod(&issuer, mode);
        chmod(&recipient, mode);
        let err = load_issuer_key(&issuer).err();
        let Some(KeyError::InsecurePermissions { path, mode: seen }) = &err else {
            panic!("mode {mode:o}: expected refusal, got {err:?}");
        };
        assert_eq!((path, *seen), (&issuer, mode));
        let message = err.map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            message,
            format!(
                "key file {} has mode {mode:04o}; a private key must not be accessible to \
                 group or others (chmod 600)",
                issuer.display()
            )
        );
        let err = load_recipient_key(&recipient).err();
        assert!(
            matches!(&err, Some(KeyError::InsecurePermissions { path, mode: m }) if *path == recipient && *m == mode),
            "mode {mode:o}: {err:?}"
        );
    }
    for mode in [0o600, 0o400] {
        chmod(&issuer, mode);
        chmod(&recipient, mode);
        assert!(load_issuer_key(&issuer).is_ok(), "mode {mode:o}");
        assert!(load_recipient_key(&recipient).is_ok(), "mode {mode:o}");
    }
}

#[test]
fn malformed_key_files_name_the_file_and_the_reason() {
    let dir = ScratchDir::new("parse");
    let good_body = "ab".repeat(32);
    let cases = [
        ("", "empty file"),
        ("hello\n", "missing BEGIN line"),
        (
            "-----BEGIN IOP RECIPIENT KEY-----\nxx\n-----END IOP RECIPIENT KEY-----\n",
            "an IOP RECIPIENT KEY file where an issuer key is expected",
        ),
        (
            "-----BEGIN CERTIFICATE-----\nMC4=\n-----END CERTIFICATE-----\n",
            "not a PKCS#8 PRIVATE KEY or IOP ISSUER KEY file",
        ),
        (
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMC4=\n-----END ENCRYPTED PRIVATE KEY-----\n",
            "encrypted PKCS#8 is not supported (decrypt it: openssl pkey -in FILE -out NEW)",
        ),
        (
            "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEI\n",
            "missing END line",
        ),
        (
            "-----BEGIN PRIVATE KEY-----\nMC4*\n-----END PRIVATE KEY-----\n",
            "PEM body is not base64",
        ),
        (
            "-----BEGIN PRIVATE KEY-----\nMC4=\n-----END PRIVATE KEY-----\nx\n",
            "data after END line",
        ),
        (
            // Base64 of a truncated key.
            "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIE\n-----END PRIVATE KEY-----\n",
            "not an unencrypted RFC 8410 PKCS#8 key (expected what openssl genpkey writes)",
        ),
        ("-----BEGIN IOP ISSUER KEY-----\n", "missing key line"),
        (
            "-----BEGIN IOP ISSUER KEY-----\nabcd\n-----END IOP ISSUER KEY-----\n",
            "key line is not 64 hex digits",
        ),
        (
            &format!("-----BEGIN IOP ISSUER KEY-----\n{good_body}\n"),
            "missing END line",
        ),
        (
            &format!(
                "-----BEGIN IOP ISSUER KEY-----\n{good_body}\n-----END IOP RECIPIENT KEY-----\n"
            ),
            "missing END line",
        ),
        (
            &format!("{}extra\n", issuer_text(&good_body)),
            "data after END line",
        ),
        (&"x".repeat(5000), "file too large"),
    ];
    for (i, (contents, reason)) in cases.iter().enumerate() {
        let path = dir.join(&format!("bad-{i}.key"));
        write(&path, contents, 0o600);
        let err = load_issuer_key(&path).err();
        let Some(KeyError::Parse {
            path: named,
            reason: seen,
        }) = &err
        else {
            panic!("case {i}: expected a parse error, got {err:?}");
        };
        assert_eq!((named, *seen), (&path, *reason), "case {i}");
        let message = err.map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            message,
            format!("key file {} is invalid: {reason}", path.display())
        );
    }

    // CRLF line ends and surrounding blank lines are accepted.
    let path = dir.join("crlf.key");
    let crlf = format!(
        "\r\n-----BEGIN IOP ISSUER KEY-----\r\n{good_body}\r\n-----END IOP ISSUER KEY-----\r\n\r\n"
    );
    write(&path, &crlf, 0o600);
    let loaded = load_issuer_key(&path).map(|key| key.to_bytes());
    assert_eq!(loaded.ok(), Some([0xab; 32]));

    // A recipient loader refuses an issuer file.
    let err = load_recipient_key(&path).err();
    assert!(
        matches!(
            err,
            Some(KeyError::Parse {
                reason: "an IOP ISSUER KEY file where a recipient key is expected",
                ..
            })
        ),
        "{err:?}"
    );

    // A missing file is a read error naming it.
    let missing = dir.join("missing.key");
    let err = load_issuer_key(&missing).err();
    let message = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        message.starts_with(&format!("cannot read key file {}: ", missing.display())),
        "{message}"
    );

    // A directory is not a key file.
    let sub = dir.join("sub");
    if let Err(e) = fs::create_dir(&sub) {
        panic!("mkdir: {e}");
    }
    chmod(&sub, 0o700);
    let err = load_issuer_key(&sub).err();
    assert!(
        matches!(
            err,
            Some(KeyError::Parse {
                reason: "not a regular file",
                ..
            })
        ),
        "{err:?}"
    );
}

#[test]
fn key_file_errors_do_not_echo_contents() {
    // CONTRACT: C4 — a broken key file's contents are not repeated in errors.
    let dir = ScratchDir::new("echo");
    let path = dir.join("issuer.key");
    let body = "cd".repeat(31) + "zz";
    write(&path, &issuer_text(&body), 0o600);
    let err = load_issuer_key(&path).err();
    let message = err.map(|e| format!("{e} {e:?}")).unwrap_or_default();
    assert!(
        message.contains("key line is not 64 hex digits"),
        "{message}"
    );
    assert!(!message.contains("cdcd"), "{message}");
}

fn reason<T: std::fmt::Debug>(result: Result<T, KeyError>) -> &'static str {
    match result {
        Err(KeyError::PublicKey { reason }) => reason,
        other => panic!("expected a public key error, got {other:?}"),
    }
}

#[test]
fn public_keys_round_trip_as_config_text() {
    let dir = ScratchDir::new("public");
    let issuer = match generate_issuer_key(&dir.join("issuer.key")) {
        Ok(key) => key,
        Err(e) => panic!("generate: {e}"),
    };
    let recipient = match generate_recipient_key(&dir.join("recipient.key")) {
        Ok(key) => key,
        Err(e) => panic!("generate: {e}"),
    };
    let issuer_text = encode_issuer_public_key(&issuer);
    assert_eq!(
        issuer_text,
        format!("ed25519:{}", encode_hex(issuer.as_bytes()))
    );
    assert_eq!(decode_issuer_public_key(&issuer_text).ok(), Some(issuer));
    let recipient_text = encode_recipient_public_key(&recipient);
    assert_eq!(
        recipient_text,
        format!("x25519:{}", encode_hex(recipient.as_bytes()))
    );
    assert_eq!(
        decode_recipient_public_key(&format!(" {recipient_text}\n")).ok(),
        Some(recipient)
    );

    let hex = encode_hex(issuer.as_bytes());
    assert_eq!(
        reason(decode_issuer_public_key(&hex)),
        "expected ed25519:<64 hex digits>"
    );
    assert_eq!(
        reason(decode_issuer_public_key(&format!("x25519:{hex}"))),
        "expected ed25519:<64 hex digits>"
    );
    assert_eq!(
        reason(decode_issuer_public_key(&format!("ed25519:{}", &hex[2..]))),
        "expected ed25519:<64 hex digits>"
    );
    // The identity point is a weak (small-order) key.
    let mut identity = [0u8; 32];
    identity[0] = 1;
    assert_eq!(
        reason(decode_issuer_public_key(&format!(
            "ed25519:{}",
            encode_hex(&identity)
        ))),
        "weak Ed25519 public key"
    );
    assert_eq!(
        reason(decode_recipient_public_key(&issuer_text)),
        "expected x25519:<64 hex digits>"
    );
}

#[test]
fn os_randomness_is_fresh() {
    let a = random_lease_id();
    let b = random_lease_id();
    let (Ok(a), Ok(b)) = (a, b) else {
        panic!("OS randomness failed")
    };
    assert_eq!(a.len(), 32);
    assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b);
    assert!(lease_entropy().is_ok());
}

#[test]
fn leases_issued_and_opened_with_keys_from_disk() {
    // CONTRACT: C1 — Edge issuer key signs, Node recipient key opens.
    // CONTRACT: C2 — the Node verifies with the configured issuer public key.
    let dir = ScratchDir::new("e2e");
    let issuer_path = dir.join("issuer.key");
    let recipient_path = dir.join("recipient.key");
    let (Ok(issuer_public), Ok(recipient_public)) = (
        generate_issuer_key(&issuer_path),
        generate_recipient_key(&recipient_path),
    ) else {
        panic!("generate failed")
    };
    // Edge side: issuer key file + the node's recipient key from config text.
    let (Ok(issuer), Ok(node_public)) = (
        load_issuer_key(&issuer_path),
        decode_recipient_public_key(&encode_recipient_public_key(&recipient_public)),
    ) else {
        panic!("edge load failed")
    };
    // Node side: recipient key file + the issuer public key from config text.
    let (Ok(recipient), Ok(configured_issuer)) = (
        load_recipient_key(&recipient_path),
        decode_issuer_public_key(&encode_issuer_public_key(&issuer_public)),
    ) else {
        panic!("node load failed")
    };

    let digest = request_digest(&BoundRequest {
        method: "POST",
        path: "/v1/chat/completions",
        headers: &[],
        body: &[bytes::Bytes::from_static(b"{}")],
    });
    let trust = provider_trust_digest(&ProviderTrust::PlainHttp);
    let binding = CredentialLeaseBinding {
        principal: "client-a".into(),
        slot: "slot-1".into(),
        route: "route-1".into(),
        profile: "openai".into(),
        upstream_target: upstream_target("openai-1", "gpt-4o"),
        selected_node: "node-a".into(),
        recipient: recipient_key_id(&node_public),
        credential_revision: 1,
        route_revision: 1,
        projection_generation: 1,
        upstream_origin: "http://10.0.0.5:8000".into(),
        run_id: "run-1".into(),
        request_digest: bytes::Bytes::copy_from_slice(&digest),
        provider_trust: bytes::Bytes::copy_from_slice(&trust),
    };
    let lease_id = match random_lease_id() {
        Ok(id) => id,
        Err(e) => panic!("lease id: {e}"),
    };
    let entropy = match lease_entropy() {
        Ok(entropy) => entropy,
        Err(e) => panic!("entropy: {e}"),
    };
    let params = IssueParams {
        lease_id: &lease_id,
        sequence: 1,
        binding: &binding,
        secret: b"sk-disk-key-test",
        header_name: "Authorization",
        header_format: "Bearer {secret}",
        not_before_unix_ms: 5_000,
        expires_at_unix_ms: 65_000,
    };
    let lease = match issue(&params, &issuer, &node_public, entropy) {
        Ok(lease) => lease,
        Err(e) => panic!("issue: {e}"),
    };

    let ctx = OpenContext {
        recipient: &recipient,
        issuer: &configured_issuer,
        scope: ExpectedScope::computed_by_node(
            "node-a",
            "openai-1/gpt-4o",
            "http://10.0.0.5:8000",
            &trust,
            "run-1",
            &digest,
            Some("openai"),
        ),
        revoked: &[],
        origin_pins: &OriginPins::new(),
        now_unix_ms: 6_000,
        clock_skew_ms: 0,
    };
    let opened = open(
        Some(&lease),
        Some(&binding),
        &ctx,
        &mut ReplayGuard::new(5_000),
    );
    let header = opened.map(|o| o.declared_header_value().as_str().to_owned());
    assert_eq!(header.ok().as_deref(), Some("Bearer sk-disk-key-test"));
}

// CONTRACT: C4 — scrubbing a secret variable removes it from the
// environment; a variable that is not in the initial environment block (set
// at run time, or absent) leaves the block untouched and is reported as not
// found there. (The initial-block wipe itself is proven against a real Edge
// process in tests/e2e/test_credentials.py.)
#[test]
fn scrubbing_an_env_secret_removes_it() {
    const NAME: &str = "IOP_KEYS_TEST_SCRUBBED_SECRET";
    let before = std::fs::read("/proc/self/environ").expect("environ");
    std::env::set_var(NAME, "sk-scrub-canary");
    assert_eq!(std::env::var(NAME).as_deref(), Ok("sk-scrub-canary"));
    assert!(matches!(iop_engine::keys::scrub_env_var(NAME), Ok(false)));
    assert!(std::env::var_os(NAME).is_none());
    assert!(matches!(
        iop_engine::keys::scrub_env_var("IOP_KEYS_TEST_NEVER_SET"),
        Ok(false)
    ));
    assert_eq!(
        std::fs::read("/proc/self/environ").expect("environ"),
        before
    );
}

/// The standard output of `openssl` with `args`. The interop checks need
/// the real tool: without it they fail (scripts/test.sh installs Debian's
/// `openssl` as root with apt).
fn openssl(args: &[&str]) -> Vec<u8> {
    let out = match std::process::Command::new("openssl").args(args).output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "openssl is not installed, and the interop checks need it \
             (apt-get install openssl; scripts/test.sh does so as root)"
        ),
        Err(e) => panic!("openssl {args:?}: {e}"),
    };
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The hex bytes under `label:` in `openssl pkey -text` output.
fn openssl_text_field(text: &str, label: &str) -> Vec<u8> {
    let mut lines = text.lines().skip_while(|line| line.trim() != label).skip(1);
    let mut hex = String::new();
    for line in lines.by_ref() {
        if !line.starts_with(' ') {
            break;
        }
        hex.extend(line.trim().split(':').filter(|b| !b.is_empty()));
    }
    iop_wire::lease::decode_hex::<32>(&hex)
        .map(|b| b.to_vec())
        .unwrap_or_else(|| panic!("no 32-byte {label} in {text}"))
}

#[test]
fn keys_we_write_are_read_by_openssl_pkey() {
    let dir = ScratchDir::new("openssl-read");
    let issuer_path = dir.join("issuer.key");
    let Ok(issuer) = generate_issuer_key(&issuer_path) else {
        panic!("generate issuer");
    };
    let recipient_path = dir.join("recipient.key");
    let Ok(recipient) = generate_recipient_key(&recipient_path) else {
        panic!("generate recipient");
    };
    for (path, heading, public) in [
        (&issuer_path, "ED25519 Private-Key:", issuer.to_bytes()),
        (&recipient_path, "X25519 Private-Key:", recipient.to_bytes()),
    ] {
        let out = openssl(&[
            "pkey",
            "-in",
            &path.display().to_string(),
            "-noout",
            "-text",
        ]);
        let text = String::from_utf8_lossy(&out);
        assert_eq!(text.lines().next(), Some(heading), "{text}");
        assert_eq!(openssl_text_field(&text, "pub:"), public.to_vec(), "{text}");
    }
    let Ok(loaded) = load_issuer_key(&issuer_path) else {
        panic!("load issuer");
    };
    let out = openssl(&[
        "pkey",
        "-in",
        &issuer_path.display().to_string(),
        "-noout",
        "-text",
    ]);
    assert_eq!(
        openssl_text_field(&String::from_utf8_lossy(&out), "priv:"),
        loaded.to_bytes().to_vec()
    );
}

#[test]
fn keys_openssl_generates_load_with_the_public_key_openssl_derives() {
    let dir = ScratchDir::new("openssl-write");
    for algorithm in ["ed25519", "x25519"] {
        let path = dir.join(&format!("{algorithm}.pem"));
        let file = path.display().to_string();
        openssl(&["genpkey", "-algorithm", algorithm, "-out", &file]);
        chmod(&path, 0o600);
        // SubjectPublicKeyInfo DER: a 12-byte header, then the 32-byte key.
        let spki = openssl(&["pkey", "-in", &file, "-pubout", "-outform", "DER"]);
        assert_eq!(spki.len(), 44, "{algorithm}");
        let expected = &spki[12..];
        let public = match algorithm {
            "ed25519" => load_issuer_key(&path).map(|k| k.verifying_key().to_bytes()),
            _ => load_recipient_key(&path).map(|k| k.public_key().to_bytes()),
        };
        match public {
            Ok(public) => assert_eq!(&public[..], expected, "{algorithm}"),
            Err(e) => panic!("{algorithm}: {e}"),
        }
    }

    // The wrong curve is named as such.
    let x25519 = dir.join("x25519.pem");
    let err = load_issuer_key(&x25519).err().map(|e| e.to_string());
    assert_eq!(
        err.as_deref(),
        Some(&*format!(
            "key file {} is invalid: the PKCS#8 key is X25519 (a recipient key); an issuer \
                 key must be Ed25519 (openssl genpkey -algorithm ed25519)",
            x25519.display()
        ))
    );
    let ed25519 = dir.join("ed25519.pem");
    let err = load_recipient_key(&ed25519).err().map(|e| e.to_string());
    assert_eq!(
        err.as_deref(),
        Some(&*format!(
            "key file {} is invalid: the PKCS#8 key is Ed25519 (an issuer key); a recipient \
                 key must be X25519 (openssl genpkey -algorithm x25519)",
            ed25519.display()
        ))
    );

    // Another algorithm altogether.
    let ec = dir.join("ec.pem");
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        &ec.display().to_string(),
    ]);
    chmod(&ec, 0o600);
    let err = load_issuer_key(&ec).err();
    assert!(
        matches!(
            err,
            Some(KeyError::Parse {
                reason: "the PKCS#8 key is not Ed25519; an issuer key must be \
                         (openssl genpkey -algorithm ed25519)",
                ..
            })
        ),
        "{err:?}"
    );
}

#[test]
fn pkcs8_v2_keys_must_carry_their_own_public_key() {
    let dir = ScratchDir::new("v2");
    // RFC 8410 section 10.3: version 1 with attributes and the public key.
    let body = "MHICAQEwBQYDK2VwBCIEINTuctv5E1hK1bbY8fdp+K06/nwoy/HU++CXqI9EdVhC\n\
                oB8wHQYKKoZIhvcNAQkJFDEPDA1DdXJkbGUgQ2hhaXJzgSEAGb9ECWmEzf6FQbrB\n\
                Z9w7lshQhqowtrbLDFw4rXAxZuE=";
    let good = dir.join("good.pem");
    write(
        &good,
        &format!("-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----\n"),
        0o600,
    );
    let public = load_issuer_key(&good).map(|k| encode_hex(k.verifying_key().as_bytes()));
    assert_eq!(
        public.ok().as_deref(),
        Some("19bf44096984cdfe8541bac167dc3b96c85086aa30b6b6cb0c5c38ad703166e1")
    );
    // The same with the public key's last byte changed (…ZuE= → …ZuA=).
    let bad = dir.join("bad.pem");
    let changed = body.replace("ZuE=", "ZuA=");
    write(
        &bad,
        &format!("-----BEGIN PRIVATE KEY-----\n{changed}\n-----END PRIVATE KEY-----\n"),
        0o600,
    );
    let err = load_issuer_key(&bad).err();
    assert!(
        matches!(
            err,
            Some(KeyError::Parse {
                reason: "the public key in the file does not match its private key",
                ..
            })
        ),
        "{err:?}"
    );
}

#[test]
fn keys_in_the_earlier_iop_format_still_load() {
    let dir = ScratchDir::new("legacy");
    let issuer = dir.join("issuer.key");
    write(&issuer, &issuer_text(&"11".repeat(32)), 0o600);
    let loaded = load_issuer_key(&issuer).map(|k| k.to_bytes());
    assert_eq!(loaded.ok(), Some([0x11; 32]));
    let recipient = dir.join("recipient.key");
    write(
        &recipient,
        &format!(
            "-----BEGIN IOP RECIPIENT KEY-----\n{}\n-----END IOP RECIPIENT KEY-----\n",
            "22".repeat(32)
        ),
        0o600,
    );
    let loaded = load_recipient_key(&recipient).map(|k| k.public_key());
    let expected = x25519_dalek::PublicKey::from(&x25519_dalek::StaticSecret::from([0x22; 32]));
    assert_eq!(loaded.ok(), Some(expected));
}
