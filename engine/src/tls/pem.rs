//! PEM loading: the CA bundle, this workload's certificate chain and its
//! private key, each error naming the file and the reason.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::sign::CertifiedKey;
use rustls::{InconsistentKeys, RootCertStore};
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::error::{ConfigProblem, TlsError};

/// Where the three PEM files of one workload live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA bundle: one or more `CERTIFICATE` blocks, the trust anchors.
    pub ca_path: PathBuf,
    /// This workload's certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// This workload's private key (PKCS#8, SEC1 or PKCS#1).
    pub key_path: PathBuf,
}

/// The loaded, checked key material of one workload: trust anchors, its own
/// certificate chain and a signing key that matches the leaf.
#[derive(Clone)]
pub struct TlsMaterial {
    pub(crate) roots: Arc<RootCertStore>,
    pub(crate) certified_key: Arc<CertifiedKey>,
    /// Where the certificate chain came from, for errors about it.
    pub(crate) cert_source: PathBuf,
    /// Where the CA bundle came from, for errors about it.
    pub(crate) ca_source: PathBuf,
}

impl fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("trust_anchors", &self.roots.len())
            .field("chain_len", &self.certified_key.cert.len())
            .field("cert_source", &self.cert_source)
            .finish_non_exhaustive()
    }
}

impl TlsMaterial {
    /// Loads and checks the three files.
    pub fn from_files(files: &TlsFiles) -> Result<Self, TlsError> {
        let ca_pem = read_file(&files.ca_path)?;
        let cert_pem = read_file(&files.cert_path)?;
        let key_pem = read_file(&files.key_path)?;
        Self::build(
            (&files.ca_path, &ca_pem),
            (&files.cert_path, &cert_pem),
            (&files.key_path, &key_pem),
        )
    }

    /// Loads from in-memory PEM (tests, or material fetched by other means).
    /// Errors name the sources `<ca pem>`, `<cert pem>` and `<key pem>`.
    pub fn from_pem(ca_pem: &[u8], cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, TlsError> {
        Self::build(
            (Path::new("<ca pem>"), ca_pem),
            (Path::new("<cert pem>"), cert_pem),
            (Path::new("<key pem>"), key_pem),
        )
    }

    /// The leaf certificate this workload presents.
    pub fn leaf_cert(&self) -> Option<&CertificateDer<'static>> {
        self.certified_key.cert.first()
    }

    fn build(
        ca: (&Path, &[u8]),
        cert: (&Path, &[u8]),
        key: (&Path, &[u8]),
    ) -> Result<Self, TlsError> {
        let roots = parse_ca_bundle(ca.0, ca.1)?;
        let certified_key = certified_key(cert, key)?;
        Ok(TlsMaterial {
            roots: Arc::new(roots),
            certified_key,
            cert_source: cert.0.to_path_buf(),
            ca_source: ca.0.to_path_buf(),
        })
    }
}

/// A certificate chain and the private key that matches its leaf.
pub(crate) fn certified_key(
    cert: (&Path, &[u8]),
    key: (&Path, &[u8]),
) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = parse_cert_chain(cert.0, cert.1)?;
    let key_der = parse_private_key(key.0, key.1)?;
    let provider = super::provider();
    CertifiedKey::from_der(chain, key_der, &provider)
        .map(Arc::new)
        .map_err(|e| match e {
            rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch) => {
                config_error(key.0, ConfigProblem::KeyMismatch)
            }
            // The leaf did not parse (checking the key against it needs its
            // public key): the certificate file is at fault, not the key.
            rustls::Error::InvalidCertificate(e) => config_error(
                cert.0,
                ConfigProblem::UnusableCertificate {
                    detail: format!("{e:?}"),
                },
            ),
            other => config_error(
                key.0,
                ConfigProblem::BadKey {
                    detail: other.to_string(),
                },
            ),
        })
}

pub(crate) fn config_error(file: &Path, reason: ConfigProblem) -> TlsError {
    TlsError::Config {
        file: file.to_path_buf(),
        reason,
    }
}

/// Reads a whole file, classifying "missing" apart from other read failures.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| {
        let reason = match e.kind() {
            io::ErrorKind::NotFound => ConfigProblem::Missing,
            _ => ConfigProblem::Unreadable {
                detail: e.to_string(),
            },
        };
        config_error(path, reason)
    })
}

fn malformed(path: &Path, e: pem::Error) -> TlsError {
    let reason = match e {
        pem::Error::Io(e) => ConfigProblem::Unreadable {
            detail: e.to_string(),
        },
        other => ConfigProblem::Malformed {
            detail: other.to_string(),
        },
    };
    config_error(path, reason)
}

/// All `CERTIFICATE` blocks of a PEM file, in order; at least one.
pub(crate) fn parse_cert_chain(
    path: &Path,
    pem_bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(pem_bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| malformed(path, e))?;
    if chain.is_empty() {
        return Err(config_error(path, ConfigProblem::NoCertificate));
    }
    Ok(chain)
}

/// The trust anchors of a CA bundle; every block must be a usable anchor.
pub(crate) fn parse_ca_bundle(path: &Path, pem_bytes: &[u8]) -> Result<RootCertStore, TlsError> {
    ca_roots(path, parse_cert_chain(path, pem_bytes)?)
}

/// The trust anchors made of `certs` (from `path`); each must be usable.
pub(crate) fn ca_roots(
    path: &Path,
    certs: impl IntoIterator<Item = CertificateDer<'static>>,
) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| {
            config_error(
                path,
                ConfigProblem::BadCertificate {
                    detail: e.to_string(),
                },
            )
        })?;
    }
    Ok(roots)
}

/// The first private key block of a PEM file.
pub(crate) fn parse_private_key(
    path: &Path,
    pem_bytes: &[u8],
) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem_bytes).map_err(|e| match e {
        pem::Error::NoItemsFound => config_error(path, ConfigProblem::NoPrivateKey),
        other => malformed(path, other),
    })
}
