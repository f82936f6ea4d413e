//! Dev certificate files (`write_dev_certs`) and PEM loading errors that name
//! the file and the reason.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use iop_engine::certs::{write_dev_certs, DevCa, Validity};
use iop_engine::tls::{
    ConfigProblem, EdgeTlsAcceptor, HttpsAcceptor, HttpsFiles, NodeAllowList, NodeTlsConnector,
    Role, TlsError, TlsFiles, TlsMaterial, UpstreamTls, UpstreamTlsSettings,
};
use monoio::io::{AsyncReadRentExt, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

/// A scratch directory removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(label: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "iop-engine-tls-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        ScratchDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o777
}

fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read_dir")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

#[test]
fn tls_dev_certs_written_with_private_keys_0600() {
    let scratch = ScratchDir::new("layout");
    let dir = scratch.path().join("certs");
    let files = write_dev_certs(&dir, "iop", "edge-1", ["node-a", "node-b"]).expect("write");
    assert_eq!(
        file_names(&dir),
        [
            "ca.pem",
            "edge-key.pem",
            "edge.pem",
            "node-node-a-key.pem",
            "node-node-a.pem",
            "node-node-b-key.pem",
            "node-node-b.pem",
        ]
    );
    assert_eq!(files.ca_cert, dir.join("ca.pem"));
    assert_eq!(files.edge.key, dir.join("edge-key.pem"));
    assert_eq!(files.nodes.keys().collect::<Vec<_>>(), ["node-a", "node-b"]);
    for key in [
        &files.edge.key,
        &files.nodes["node-a"].key,
        &files.nodes["node-b"].key,
    ] {
        assert_eq!(mode(key), 0o600, "{}", key.display());
    }
    // Loadable, and each names the expected identity.
    let edge = TlsMaterial::from_files(&files.edge_tls_files()).expect("edge material");
    let acceptor =
        EdgeTlsAcceptor::new(&edge, "iop", NodeAllowList::new(["node-a"])).expect("edge acceptor");
    assert_eq!(acceptor.local_identity().uri(), "spiffe://iop/edge/edge-1");
    let node_b = files.node_tls_files("node-b").expect("node-b files");
    let connector = NodeTlsConnector::new(
        &TlsMaterial::from_files(&node_b).expect("node material"),
        "iop",
        "edge-1",
    )
    .expect("node connector");
    assert_eq!(connector.local_identity().uri(), "spiffe://iop/node/node-b");
    assert_eq!(files.node_tls_files("node-c"), None);
}

#[test]
fn tls_dev_certs_narrow_existing_key_file_permissions() {
    let scratch = ScratchDir::new("rewrite");
    let dir = scratch.path();
    fs::create_dir_all(dir).expect("mkdir");
    let key = dir.join("edge-key.pem");
    fs::write(&key, "old").expect("old key");
    fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).expect("chmod");
    write_dev_certs(dir, "iop", "edge-1", ["node-a"]).expect("write");
    assert_eq!(mode(&key), 0o600);
    assert!(fs::read_to_string(&key)
        .expect("key")
        .starts_with("-----BEGIN PRIVATE KEY-----"));
}

#[test]
fn tls_dev_certs_refuse_names_that_are_not_identity_names() {
    let scratch = ScratchDir::new("names");
    let err = write_dev_certs(scratch.path(), "iop", "edge-1", ["../escape"])
        .expect_err("path-like node name");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(
        err.to_string(),
        "invalid workload identity: SPIFFE ID path character '/' is not one of [A-Za-z0-9.-_]"
    );
    assert!(!scratch.path().exists(), "nothing written on bad input");
}

#[monoio::test_all]
async fn tls_handshake_with_file_loaded_material() {
    // CONTRACT: T2 — the dev files interoperate end to end.
    let scratch = ScratchDir::new("handshake");
    let files = write_dev_certs(scratch.path(), "iop", "edge-1", ["node-a"]).expect("write");
    let edge = EdgeTlsAcceptor::new(
        &TlsMaterial::from_files(&files.edge_tls_files()).expect("edge material"),
        "iop",
        NodeAllowList::new(["node-a"]),
    )
    .expect("acceptor");
    let node = NodeTlsConnector::new(
        &TlsMaterial::from_files(&files.node_tls_files("node-a").expect("files"))
            .expect("node material"),
        "iop",
        "edge-1",
    )
    .expect("connector");

    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = monoio::spawn(async move {
        let (tcp, _) = listener.accept().await.map_err(TlsError::Io)?;
        let (mut stream, id) = edge.accept(tcp).await?;
        let (res, _) = stream.write_all(b"hi".to_vec()).await;
        res.map_err(TlsError::Io)?;
        Ok::<_, TlsError>(id.uri())
    });
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let mut stream = node.connect(tcp).await.expect("handshake");
    let (res, hi) = stream.read_exact(vec![0u8; 2]).await;
    res.expect("read");
    assert_eq!(hi, b"hi");
    assert_eq!(
        server.await.ok(),
        Some("spiffe://iop/node/node-a".to_owned())
    );
}

/// Writes the CA, node cert and key PEMs of a fresh PKI into `dir`.
fn pem_files(dir: &Path) -> TlsFiles {
    fs::create_dir_all(dir).expect("mkdir");
    let ca = DevCa::new("iop").expect("ca");
    let node = ca
        .issue(Role::Node, "node-a", Validity::days_from_now(1))
        .expect("node");
    let files = TlsFiles {
        ca_path: dir.join("ca.pem"),
        cert_path: dir.join("node.pem"),
        key_path: dir.join("node-key.pem"),
    };
    fs::write(&files.ca_path, ca.cert_pem()).expect("ca");
    fs::write(&files.cert_path, &node.cert_pem).expect("cert");
    fs::write(&files.key_path, &node.key_pem).expect("key");
    files
}

fn load_error(files: &TlsFiles) -> (PathBuf, ConfigProblem) {
    match TlsMaterial::from_files(files) {
        Err(TlsError::Config { file, reason }) => (file, reason),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn tls_pem_loading_names_missing_file() {
    let scratch = ScratchDir::new("missing");
    let mut files = pem_files(scratch.path());
    files.ca_path = scratch.path().join("absent.pem");
    assert_eq!(
        load_error(&files),
        (files.ca_path.clone(), ConfigProblem::Missing)
    );
    let err = TlsMaterial::from_files(&files).expect_err("missing");
    assert_eq!(
        err.to_string(),
        format!("{}: file not found", files.ca_path.display())
    );
}

#[test]
fn tls_pem_loading_names_unreadable_file() {
    let scratch = ScratchDir::new("unreadable");
    let mut files = pem_files(scratch.path());
    files.cert_path = scratch.path().to_path_buf(); // a directory
    let (file, reason) = load_error(&files);
    assert_eq!(file, files.cert_path);
    assert_eq!(
        reason,
        ConfigProblem::Unreadable {
            detail: "Is a directory (os error 21)".to_owned()
        }
    );
}

#[test]
fn tls_pem_loading_names_file_without_certificate() {
    let scratch = ScratchDir::new("nocert");
    let mut files = pem_files(scratch.path());
    files.cert_path = files.key_path.clone(); // a key where the chain should be
    assert_eq!(
        load_error(&files),
        (files.key_path.clone(), ConfigProblem::NoCertificate)
    );
    files = pem_files(scratch.path());
    fs::write(&files.ca_path, "not pem at all\n").expect("write");
    assert_eq!(
        load_error(&files),
        (files.ca_path.clone(), ConfigProblem::NoCertificate)
    );
}

#[test]
fn tls_pem_loading_names_file_without_key() {
    let scratch = ScratchDir::new("nokey");
    let mut files = pem_files(scratch.path());
    files.key_path = files.cert_path.clone();
    assert_eq!(
        load_error(&files),
        (files.cert_path.clone(), ConfigProblem::NoPrivateKey)
    );
}

#[test]
fn tls_pem_loading_names_malformed_pem() {
    let scratch = ScratchDir::new("malformed");
    let files = pem_files(scratch.path());
    fs::write(
        &files.cert_path,
        "-----BEGIN CERTIFICATE-----\nAAAA\n", // no END line
    )
    .expect("write");
    let (file, reason) = load_error(&files);
    assert_eq!(file, files.cert_path);
    assert!(
        matches!(reason, ConfigProblem::Malformed { .. }),
        "{reason:?}"
    );
}

#[test]
fn tls_pem_loading_rejects_key_of_another_certificate() {
    let scratch = ScratchDir::new("mismatch");
    let files = pem_files(scratch.path());
    let other = DevCa::new("iop")
        .expect("ca")
        .issue(Role::Node, "node-a", Validity::days_from_now(1))
        .expect("other");
    fs::write(&files.key_path, &other.key_pem).expect("write");
    assert_eq!(
        load_error(&files),
        (files.key_path.clone(), ConfigProblem::KeyMismatch)
    );
    assert_eq!(
        TlsMaterial::from_files(&files)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        Err(format!(
            "{}: private key does not match the certificate",
            files.key_path.display()
        ))
    );
}

#[test]
fn tls_pem_loading_rejects_key_the_provider_cannot_load() {
    let scratch = ScratchDir::new("badkey");
    let files = pem_files(scratch.path());
    fs::write(
        &files.key_path,
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .expect("write");
    let (file, reason) = load_error(&files);
    assert_eq!(file, files.key_path);
    assert!(matches!(reason, ConfigProblem::BadKey { .. }), "{reason:?}");
}

#[test]
fn tls_pem_loading_rejects_ca_that_is_not_a_trust_anchor() {
    let scratch = ScratchDir::new("badca");
    let files = pem_files(scratch.path());
    fs::write(
        &files.ca_path,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .expect("write");
    let (file, reason) = load_error(&files);
    assert_eq!(file, files.ca_path);
    assert!(
        matches!(reason, ConfigProblem::BadCertificate { .. }),
        "{reason:?}"
    );
}

// The dev HTTPS pair serves an HTTPS listener that a client trusting only
// `ca.pem` accepts for each host asked for, and for no other.
#[monoio::test_all]
async fn tls_dev_certs_can_include_an_https_certificate_from_the_same_ca() {
    let scratch = ScratchDir::new("https");
    let dir = scratch.path().join("certs");
    let files = iop_engine::certs::write_dev_certs_with_https(
        &dir,
        "iop",
        "edge-1",
        ["node-a"],
        &["localhost", "127.0.0.1"],
    )
    .expect("write");
    let https = files.https.clone().expect("https pair");
    assert_eq!(https.cert, dir.join("https.pem"));
    assert_eq!(https.key, dir.join("https-key.pem"));
    assert_eq!(mode(&https.key), 0o600);
    let acceptor = HttpsAcceptor::from_files(&HttpsFiles {
        cert: https.cert.clone(),
        key: https.key.clone(),
        client_ca: None,
    })
    .expect("an HTTPS listener loads it");
    assert!(!acceptor.identity().requires_client_cert);
    let client = UpstreamTls::new(&UpstreamTlsSettings {
        ca_pem: Some(fs::read_to_string(&files.ca_cert).expect("ca.pem")),
        insecure_skip_verify: false,
    })
    .expect("client");

    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = monoio::spawn(async move {
        for _ in 0..3 {
            let (tcp, _) = listener.accept().await.expect("accept");
            // The refused handshake fails on the server side too.
            if let Ok(mut tls) = acceptor.accept(tcp).await {
                let (res, _) = tls.write_all(b"ok".to_vec()).await;
                res.expect("write");
            }
        }
    });
    for host in ["localhost", "127.0.0.1"] {
        let tcp = TcpStream::connect(addr).await.expect("connect");
        let mut tls = client.connect(tcp, host).await.expect(host);
        let (res, ok) = tls.read_exact(vec![0u8; 2]).await;
        res.expect("read");
        assert_eq!(ok, b"ok", "{host}");
    }
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let err = client
        .connect(tcp, "elsewhere.example")
        .await
        .expect_err("a host the certificate does not name");
    assert!(
        matches!(
            err.certificate_error(),
            Some(rustls::CertificateError::NotValidForNameContext { .. })
        ),
        "{err}"
    );
    server.await;

    // Without HTTPS hosts there is no HTTPS pair, and none is written.
    let plain = scratch.path().join("plain");
    assert!(write_dev_certs(&plain, "iop", "edge-1", ["node-a"])
        .expect("write")
        .https
        .is_none());
    assert!(!plain.join("https.pem").exists());
}

// A reload swaps the identity every clone presents; one for another
// workload, or a file that does not load, is refused and the running
// identity stays.
#[test]
fn tls_reload_replaces_the_identity_of_every_clone_and_refuses_another_name() {
    let ca = DevCa::new("iop").expect("ca");
    let material = |role, name: &str| {
        let issued = ca
            .issue(role, name, Validity::days_from_now(1))
            .expect("issue");
        TlsMaterial::from_pem(
            ca.cert_pem().as_bytes(),
            issued.cert_pem.as_bytes(),
            issued.key_pem.as_bytes(),
        )
        .expect("material")
    };
    let first = material(Role::Edge, "edge-1");
    let acceptor =
        EdgeTlsAcceptor::new(&first, "iop", NodeAllowList::new(["node-a"])).expect("acceptor");
    let clone = acceptor.clone();
    let before = clone.local_certificate();
    let rotated = acceptor
        .reload(&material(Role::Edge, "edge-1"))
        .expect("same identity");
    assert_ne!(rotated.serial_hex, before.serial_hex);
    assert_eq!(
        clone.local_certificate(),
        rotated,
        "clones share the identity"
    );
    let err = acceptor
        .reload(&material(Role::Edge, "edge-2"))
        .expect_err("another name");
    let rejection = iop_engine::tls::IdentityRejection::WrongName {
        expected: "spiffe://iop/edge/edge-1".into(),
        found: "spiffe://iop/edge/edge-2".into(),
    };
    assert_eq!(
        err.to_string(),
        format!("<cert pem>: certificate identity unusable here: {rejection}")
    );
    assert!(acceptor.reload(&material(Role::Node, "edge-1")).is_err());
    assert_eq!(clone.local_certificate(), rotated);

    let node_first = material(Role::Node, "node-a");
    let connector = NodeTlsConnector::new(&node_first, "iop", "edge-1").expect("connector");
    let node_clone = connector.clone();
    let rotated = connector
        .reload(&material(Role::Node, "node-a"))
        .expect("same identity");
    assert_eq!(node_clone.local_certificate(), rotated);
    assert!(connector.reload(&material(Role::Node, "node-b")).is_err());
    assert_eq!(node_clone.local_certificate(), rotated);
}
