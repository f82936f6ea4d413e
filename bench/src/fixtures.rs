//! `bench tls-fixtures --out DIR`: every certificate the TLS tests need,
//! minted in one run by one throw-away CA, with a manifest of serials.
//!
//! ```text
//! DIR/ca.pem                          the test CA (trust anchor)
//!     edge.pem  edge-key.pem          spiffe://<td>/edge/<edge name>
//!     edge-rotated.pem (+ -key)       the same identity, another serial
//!     node-<n>.pem (+ -key)           spiffe://<td>/node/<n>
//!     node-<n>-rotated.pem (+ -key)   the same identity, another serial
//!     https.pem (+ -key)              web PKI: localhost, 127.0.0.1, ::1
//!     https-rotated.pem (+ -key)      the same names, another serial
//!     wrong-host.pem (+ -key)         valid, for wrong.example only
//!     expired.pem (+ -key)            localhost, 127.0.0.1; expired
//!     unknown-ca.pem (+ -key)         localhost, 127.0.0.1; signed by a CA
//!                                     nobody trusts (not written)
//!     client.pem (+ -key)             a client certificate for mTLS callers
//!     manifest.json                   {"serials": {"edge.pem": "<hex>", …}}
//! ```
//!
//! Test material only: the CA key is dropped after minting. Key files get
//! mode 0600.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use iop_engine::certs::{DevCa, IssuedCert, Validity};
use iop_engine::tls::{cert_serial_hex, Role};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

/// Host names (and addresses) the HTTPS fixtures are valid for.
pub const HTTPS_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// Writes the fixtures into `dir` (created if missing) and returns the
/// serial of every certificate written, by file name.
pub fn write_tls_fixtures(
    dir: &Path,
    trust_domain: &str,
    edge_name: &str,
    nodes: &[String],
) -> io::Result<BTreeMap<String, String>> {
    let fresh = Validity::days_from_now(30);
    let ca = DevCa::new(trust_domain)?;
    // Another name, so its certificates fail as "unknown issuer".
    let stranger = DevCa::new(&format!("stranger.{trust_domain}"))?;
    let mut issued: Vec<(String, IssuedCert)> = vec![
        ("edge".into(), ca.issue(Role::Edge, edge_name, fresh)?),
        (
            "edge-rotated".into(),
            ca.issue(Role::Edge, edge_name, fresh)?,
        ),
        ("https".into(), ca.issue_for_hosts(&HTTPS_HOSTS, fresh)?),
        (
            "https-rotated".into(),
            ca.issue_for_hosts(&HTTPS_HOSTS, fresh)?,
        ),
        (
            "wrong-host".into(),
            ca.issue_for_hosts(&["wrong.example"], fresh)?,
        ),
        (
            "expired".into(),
            ca.issue_for_hosts(&HTTPS_HOSTS, Validity::expired())?,
        ),
        (
            "unknown-ca".into(),
            stranger.issue_for_hosts(&HTTPS_HOSTS, fresh)?,
        ),
        ("client".into(), ca.issue_client("test-client", fresh)?),
    ];
    for node in nodes {
        issued.push((format!("node-{node}"), ca.issue(Role::Node, node, fresh)?));
        issued.push((
            format!("node-{node}-rotated"),
            ca.issue(Role::Node, node, fresh)?,
        ));
    }
    fs::create_dir_all(dir)?;
    fs::write(dir.join("ca.pem"), ca.cert_pem())?;
    let mut serials = BTreeMap::new();
    for (stem, cert) in &issued {
        let file = format!("{stem}.pem");
        fs::write(dir.join(&file), &cert.cert_pem)?;
        write_private(
            &dir.join(format!("{stem}-key.pem")),
            cert.key_pem.as_bytes(),
        )?;
        let der = CertificateDer::from_pem_slice(cert.cert_pem.as_bytes())
            .map_err(|e| io::Error::other(format!("{file}: {e}")))?;
        serials.insert(file, cert_serial_hex(&der).unwrap_or_default());
    }
    let manifest = serde_json::json!({ "serials": serials });
    fs::write(dir.join("manifest.json"), manifest.to_string())?;
    Ok(serials)
}

fn write_private(path: &Path, contents: &[u8]) -> io::Result<()> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(fs::Permissions::from_mode(0o600))?;
    file.write_all(contents)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixtures_are_written_with_distinct_serials() {
        let dir = std::env::temp_dir().join(format!("iop-fixtures-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let serials = write_tls_fixtures(&dir, "iop", "edge-1", &["node-a".into()]).unwrap();
        let names: Vec<&str> = serials.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "client.pem",
                "edge-rotated.pem",
                "edge.pem",
                "expired.pem",
                "https-rotated.pem",
                "https.pem",
                "node-node-a-rotated.pem",
                "node-node-a.pem",
                "unknown-ca.pem",
                "wrong-host.pem",
            ]
        );
        let mut distinct: Vec<&String> = serials.values().collect();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), serials.len());
        assert!(serials.values().all(|s| !s.is_empty()));
        let mode = fs::metadata(dir.join("edge-key.pem"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let manifest: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(
            manifest["serials"]["edge.pem"],
            serials["edge.pem"].as_str()
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
