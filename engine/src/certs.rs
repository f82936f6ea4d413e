//! Dev and test certificates: a throw-away CA and SPIFFE workload
//! certificates minted with rcgen.
//!
//! [`DevCa`] issues ECDSA P-256 leaf certificates whose single URI SAN is
//! `spiffe://<trust-domain>/<role>/<name>`, with both `serverAuth` and
//! `clientAuth` extended key usages (as SPIFFE X.509 SVIDs carry), so the role
//! is decided by the SAN alone. [`Validity`] covers the cases tests need:
//! current, expired, not yet valid. [`write_dev_certs`] backs
//! `edge-bin certs --out DIR`.
//!
//! Not for production: the CA key lives only in memory and is dropped after
//! minting, so adding a node later means minting a fresh set.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::string::Ia5String;
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};

use crate::tls::{Role, TlsFiles, WorkloadId, WorkloadIdError};

/// Seconds in a day.
const DAY_S: u64 = 86_400;
/// How far before "now" a fresh certificate starts, to absorb clock skew.
pub const BACKDATE_S: u64 = 3_600;
/// Validity of leaf certificates written by [`write_dev_certs`].
pub const DEV_LEAF_VALIDITY_DAYS: u32 = 365;
/// Validity of a [`DevCa`] made by [`DevCa::new`].
pub const DEV_CA_VALIDITY_DAYS: u32 = 3_650;
/// Latest time X.509 can express (9999-12-31T23:59:59Z); later times clamp to it.
const MAX_UNIX_S: u64 = 253_402_300_799;
/// File mode of written private keys.
const KEY_FILE_MODE: u32 = 0o600;

/// Why minting failed.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// rcgen could not generate a key or sign a certificate.
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    /// The trust domain or a name is not a valid identity part.
    #[error("invalid workload identity: {0}")]
    Identity(#[from] WorkloadIdError),
}

impl From<CertsError> for io::Error {
    fn from(e: CertsError) -> Self {
        let kind = match e {
            CertsError::Generate(_) => io::ErrorKind::Other,
            CertsError::Identity(_) => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

/// The validity window of a certificate, in Unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// First second the certificate is valid.
    pub not_before_unix_s: u64,
    /// Last second the certificate is valid.
    pub not_after_unix_s: u64,
}

impl Validity {
    /// Valid from [`BACKDATE_S`] ago until `days` days from now.
    pub fn days_from_now(days: u32) -> Self {
        let now_s = now_unix_s();
        Validity {
            not_before_unix_s: now_s.saturating_sub(BACKDATE_S),
            not_after_unix_s: now_s.saturating_add(u64::from(days) * DAY_S),
        }
    }

    /// Valid two days ago until one day ago: expired now.
    pub fn expired() -> Self {
        let now_s = now_unix_s();
        Validity {
            not_before_unix_s: now_s.saturating_sub(2 * DAY_S),
            not_after_unix_s: now_s.saturating_sub(DAY_S),
        }
    }

    /// Valid from one day from now until two days from now: not yet valid.
    pub fn not_yet_valid() -> Self {
        let now_s = now_unix_s();
        Validity {
            not_before_unix_s: now_s.saturating_add(DAY_S),
            not_after_unix_s: now_s.saturating_add(2 * DAY_S),
        }
    }

    fn apply(self, params: &mut CertificateParams) {
        // date_time_ymd(1970, 1, 1) is the epoch; the clamp keeps the sum
        // inside the range `time` (and X.509) can represent.
        let at =
            |unix_s: u64| date_time_ymd(1970, 1, 1) + Duration::from_secs(unix_s.min(MAX_UNIX_S));
        params.not_before = at(self.not_before_unix_s);
        params.not_after = at(self.not_after_unix_s);
    }
}

fn now_unix_s() -> u64 {
    u64::try_from(crate::clock::unix_ms()).unwrap_or(0) / 1_000
}

/// A PEM certificate and its PEM (PKCS#8) private key.
#[derive(Clone, PartialEq, Eq)]
pub struct IssuedCert {
    /// The leaf certificate, one `CERTIFICATE` block.
    pub cert_pem: String,
    /// Its private key, one `PRIVATE KEY` block.
    pub key_pem: String,
}

impl fmt::Debug for IssuedCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedCert")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// A throw-away certificate authority for one trust domain.
///
/// Every `DevCa` of a trust domain has the same subject name, so a
/// certificate from another `DevCa` names the "right" issuer and is rejected
/// only because its signature does not verify — the case a wrong-CA test
/// should exercise.
#[derive(Debug)]
pub struct DevCa {
    trust_domain: String,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl DevCa {
    /// A new CA (fresh key) valid for [`DEV_CA_VALIDITY_DAYS`].
    pub fn new(trust_domain: &str) -> Result<Self, CertsError> {
        Self::with_validity(trust_domain, Validity::days_from_now(DEV_CA_VALIDITY_DAYS))
    }

    /// A new CA (fresh key) with the given validity.
    pub fn with_validity(trust_domain: &str, validity: Validity) -> Result<Self, CertsError> {
        WorkloadId::validate_trust_domain(trust_domain)?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::OrganizationName, trust_domain);
        name.push(DnType::CommonName, "IOP dev CA");
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity.apply(&mut params);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(DevCa {
            trust_domain: trust_domain.to_owned(),
            issuer,
        })
    }

    /// The trust domain this CA issues identities in.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The CA certificate (the trust anchor), one `CERTIFICATE` block.
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// Issues `spiffe://<trust-domain>/<role>/<name>`.
    pub fn issue(
        &self,
        role: Role,
        name: &str,
        validity: Validity,
    ) -> Result<IssuedCert, CertsError> {
        let id = WorkloadId::new(&self.trust_domain, role, name)?;
        self.issue_with_uri_sans(&[&id.uri()], validity)
    }

    /// Issues a certificate whose URI SANs are exactly `uri_sans`, unchecked:
    /// for tests of malformed, missing or multiple identities.
    pub fn issue_with_uri_sans(
        &self,
        uri_sans: &[&str],
        validity: Validity,
    ) -> Result<IssuedCert, CertsError> {
        let mut params = CertificateParams::default();
        params.subject_alt_names = uri_sans
            .iter()
            .map(|uri| Ia5String::try_from(*uri).map(SanType::URI))
            .collect::<Result<_, _>>()?;
        self.sign_leaf(
            params,
            uri_sans.first().copied().unwrap_or("no identity"),
            // Workload certificates serve both ends of the mTLS link.
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
            validity,
        )
    }

    /// Issues an ordinary web-PKI server certificate for `hosts` (each a DNS
    /// name or an IP address, each a SAN) with the `serverAuth` usage: for
    /// HTTPS listeners and HTTPS mock providers.
    pub fn issue_for_hosts(
        &self,
        hosts: &[&str],
        validity: Validity,
    ) -> Result<IssuedCert, CertsError> {
        let params =
            CertificateParams::new(hosts.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>())?;
        let common_name = hosts.first().copied().unwrap_or("no host");
        self.sign_leaf(
            params,
            common_name,
            &[ExtendedKeyUsagePurpose::ServerAuth],
            validity,
        )
    }

    /// Issues a client certificate (the `clientAuth` usage) with common name
    /// `name`: for callers of an HTTPS listener that requires mTLS.
    pub fn issue_client(&self, name: &str, validity: Validity) -> Result<IssuedCert, CertsError> {
        let params = CertificateParams::default();
        self.sign_leaf(
            params,
            name,
            &[ExtendedKeyUsagePurpose::ClientAuth],
            validity,
        )
    }

    /// Signs a fresh key's leaf certificate with `params`' SANs, common
    /// name `common_name` and the extended usages `usages`.
    fn sign_leaf(
        &self,
        mut params: CertificateParams,
        common_name: &str,
        usages: &[ExtendedKeyUsagePurpose],
        validity: Validity,
    ) -> Result<IssuedCert, CertsError> {
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, common_name);
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = usages.to_vec();
        params.use_authority_key_identifier_extension = true;
        validity.apply(&mut params);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A certificate file and its key file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertKeyPaths {
    /// The certificate (`<name>.pem`).
    pub cert: PathBuf,
    /// The private key (`<name>-key.pem`, mode 0600).
    pub key: PathBuf,
}

/// The files [`write_dev_certs`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevCertFiles {
    /// The CA certificate, `ca.pem`.
    pub ca_cert: PathBuf,
    /// `edge.pem` and `edge-key.pem`.
    pub edge: CertKeyPaths,
    /// With several Edge names ([`write_cluster_dev_certs`]):
    /// `edge-<name>.pem` and `edge-<name>-key.pem` per name (the first
    /// name's pair is also `edge.pem`); empty otherwise.
    pub edges: BTreeMap<String, CertKeyPaths>,
    /// `node-<name>.pem` and `node-<name>-key.pem` per node name.
    pub nodes: BTreeMap<String, CertKeyPaths>,
    /// `https.pem` and `https-key.pem`, when HTTPS hosts were asked for.
    pub https: Option<CertKeyPaths>,
}

impl DevCertFiles {
    /// The Edge's CA, certificate and key paths.
    pub fn edge_tls_files(&self) -> TlsFiles {
        self.tls_files(&self.edge)
    }

    /// A Node's CA, certificate and key paths, if `name` was minted.
    pub fn node_tls_files(&self, name: &str) -> Option<TlsFiles> {
        self.nodes.get(name).map(|paths| self.tls_files(paths))
    }

    fn tls_files(&self, paths: &CertKeyPaths) -> TlsFiles {
        TlsFiles {
            ca_path: self.ca_cert.clone(),
            cert_path: paths.cert.clone(),
            key_path: paths.key.clone(),
        }
    }
}

/// Mints a fresh dev CA and certificates for one Edge and the given Nodes,
/// writing into `dir` (created if missing):
/// `ca.pem`, `edge.pem`, `edge-key.pem`, `node-<name>.pem`,
/// `node-<name>-key.pem`. Key files get mode 0600. Existing files are
/// overwritten. Names must be valid identity names, which also keeps them
/// safe as file names.
pub fn write_dev_certs<I, S>(
    dir: &Path,
    trust_domain: &str,
    edge_name: &str,
    node_names: I,
) -> io::Result<DevCertFiles>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    write_dev_certs_with_https(dir, trust_domain, edge_name, node_names, &[])
}

/// [`write_dev_certs`], plus (when `https_hosts` is not empty) an HTTPS
/// server certificate for those host names and addresses from the same CA:
/// `https.pem`, `https-key.pem`, for `[edge.client_tls]` or an HTTPS
/// provider in development (clients trust `ca.pem`).
pub fn write_dev_certs_with_https<I, S>(
    dir: &Path,
    trust_domain: &str,
    edge_name: &str,
    node_names: I,
    https_hosts: &[&str],
) -> io::Result<DevCertFiles>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    write_cluster_dev_certs(dir, trust_domain, &[edge_name], node_names, https_hosts)
}

/// [`write_dev_certs_with_https`] for several Edges of one cluster, all
/// from one CA: the first name's certificate is `edge.pem`; with more than
/// one name, each also gets `edge-<name>.pem` and `edge-<name>-key.pem`.
pub fn write_cluster_dev_certs<I, S>(
    dir: &Path,
    trust_domain: &str,
    edge_names: &[&str],
    node_names: I,
    https_hosts: &[&str],
) -> io::Result<DevCertFiles>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let Some(&edge_name) = edge_names.first() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "at least one edge name",
        ));
    };
    let node_names: Vec<String> = node_names
        .into_iter()
        .map(|name| name.as_ref().to_owned())
        .collect();
    let validity = Validity::days_from_now(DEV_LEAF_VALIDITY_DAYS);
    let ca = DevCa::new(trust_domain)?;
    let edge = ca.issue(Role::Edge, edge_name, validity)?;
    let mut more_edges = Vec::new();
    if edge_names.len() > 1 {
        for name in edge_names {
            more_edges.push((name.to_string(), ca.issue(Role::Edge, name, validity)?));
        }
    }
    let mut nodes = Vec::with_capacity(node_names.len());
    for name in &node_names {
        nodes.push((name, ca.issue(Role::Node, name, validity)?));
    }
    let https = match https_hosts {
        [] => None,
        hosts => Some(ca.issue_for_hosts(hosts, validity)?),
    };

    fs::create_dir_all(dir)?;
    let ca_cert = dir.join("ca.pem");
    fs::write(&ca_cert, ca.cert_pem())?;
    let edge = write_pair(dir, "edge", &edge)?;
    let mut edges = BTreeMap::new();
    for (name, issued) in more_edges {
        let paths = write_pair(dir, &format!("edge-{name}"), &issued)?;
        edges.insert(name, paths);
    }
    let mut node_paths = BTreeMap::new();
    for (name, issued) in nodes {
        let paths = write_pair(dir, &format!("node-{name}"), &issued)?;
        node_paths.insert(name.clone(), paths);
    }
    let https = match https {
        Some(issued) => Some(write_pair(dir, "https", &issued)?),
        None => None,
    };
    Ok(DevCertFiles {
        ca_cert,
        edge,
        edges,
        nodes: node_paths,
        https,
    })
}

fn write_pair(dir: &Path, stem: &str, issued: &IssuedCert) -> io::Result<CertKeyPaths> {
    let cert = dir.join(format!("{stem}.pem"));
    let key = dir.join(format!("{stem}-key.pem"));
    fs::write(&cert, &issued.cert_pem)?;
    write_private(&key, issued.key_pem.as_bytes())?;
    Ok(CertKeyPaths { cert, key })
}

/// Writes a secret: created with mode 0600, and narrowed to 0600 before any
/// byte is written if the file already existed with a wider mode.
fn write_private(path: &Path, contents: &[u8]) -> io::Result<()> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(KEY_FILE_MODE)
        .open(path)?;
    file.set_permissions(fs::Permissions::from_mode(KEY_FILE_MODE))?;
    file.write_all(contents)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validity_windows_relative_to_now() {
        let fresh = Validity::days_from_now(1);
        assert_eq!(
            fresh.not_after_unix_s - fresh.not_before_unix_s,
            DAY_S + BACKDATE_S
        );
        let expired = Validity::expired();
        assert_eq!(expired.not_after_unix_s - expired.not_before_unix_s, DAY_S);
        assert!(expired.not_after_unix_s < fresh.not_before_unix_s + BACKDATE_S);
        let future = Validity::not_yet_valid();
        assert!(future.not_before_unix_s > fresh.not_before_unix_s + BACKDATE_S);
    }

    #[test]
    fn issue_rejects_invalid_names() {
        let ca = DevCa::new("iop");
        let issued = ca.as_ref().map_err(|e| e.to_string()).and_then(|ca| {
            ca.issue(Role::Node, "../etc", Validity::days_from_now(1))
                .map_err(|e| e.to_string())
        });
        assert_eq!(
            issued,
            Err("invalid workload identity: SPIFFE ID path character '/' is not one of [A-Za-z0-9.-_]".to_owned())
        );
        assert_eq!(
            DevCa::new("Bad Domain")
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Err(
                "invalid workload identity: trust domain character 'B' is not one of [a-z0-9.-_]"
                    .to_owned()
            )
        );
    }

    #[test]
    fn issued_cert_debug_redacts_key() {
        let issued = IssuedCert {
            cert_pem: "C".to_owned(),
            key_pem: "SECRET".to_owned(),
        };
        assert_eq!(
            format!("{issued:?}"),
            "IssuedCert { cert_pem: \"C\", key_pem: \"<redacted>\" }"
        );
    }
}
