//! HTTPS listeners: the Edge's client surface (`[edge.client_tls]`) and the
//! bench's HTTPS mock provider.
//!
//! ```text
//! HttpsAcceptor::from_files(cert, key, client_ca?)    at start
//!   ServerConfig: ring, TLS 1.2 + 1.3, ALPN http/1.1, session cache;
//!                 client_ca set: a client certificate chaining to it is
//!                 required (mTLS callers)
//! HttpsAcceptor::accept(tcp) ─► ServerTls             per connection
//! HttpsAcceptor::reload()                             SIGHUP: re-read the
//!   files; new handshakes use the new certificate, open connections keep
//!   theirs; a bad file is refused and the running certificate stays
//! ```
//!
//! Plain web PKI (host names in DNS/IP SANs), not workload identity: the
//! callers are ordinary HTTPS clients (the OpenAI and Anthropic SDKs, curl).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use monoio::net::TcpStream;
use rustls::server::{ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::SingleCertAndKey;
use rustls::{ServerConfig, ServerConnection};

use super::error::{ConfigProblem, TlsError};
use super::pem::{certified_key, parse_ca_bundle, read_file};
use super::stream::ServerTls;
use super::upstream::ALPN_HTTP11;
use super::{cert_not_after_unix_s, cert_serial_hex, handshake, provider, ClockTime, Swap};

/// The PEM files of an HTTPS listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpsFiles {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// CA certificates a client certificate must chain to; `None`: no
    /// client certificate is asked for.
    pub client_ca: Option<PathBuf>,
}

/// The certificate a listener presents now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpsIdentity {
    /// The leaf's serial number, lowercase hex.
    pub serial_hex: String,
    /// The leaf's `notAfter`, Unix seconds.
    pub not_after_unix_s: i64,
    /// Whether clients must present a certificate.
    pub requires_client_cert: bool,
}

struct Current {
    config: Arc<ServerConfig>,
    identity: HttpsIdentity,
}

/// Accepts TLS connections for an HTTP server. Cheap to clone; clones share
/// one certificate, replaced by [`HttpsAcceptor::reload`].
#[derive(Clone)]
pub struct HttpsAcceptor {
    current: Swap<Current>,
    files: Option<HttpsFiles>,
}

impl std::fmt::Debug for HttpsAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpsAcceptor")
            .field("identity", &self.current.load().identity)
            .field("files", &self.files)
            .finish()
    }
}

impl HttpsAcceptor {
    /// Loads the files. Errors name the file and the reason.
    pub fn from_files(files: &HttpsFiles) -> Result<Self, TlsError> {
        Ok(HttpsAcceptor {
            current: Swap::new(Self::load(files)?),
            files: Some(files.clone()),
        })
    }

    /// From in-memory PEM (tests); [`HttpsAcceptor::reload`] then has no
    /// files to read.
    pub fn from_pem(
        cert_pem: &[u8],
        key_pem: &[u8],
        client_ca_pem: Option<&[u8]>,
    ) -> Result<Self, TlsError> {
        let current = Self::build(
            (Path::new("<cert pem>"), cert_pem),
            (Path::new("<key pem>"), key_pem),
            client_ca_pem.map(|pem| (Path::new("<client ca pem>"), pem)),
        )?;
        Ok(HttpsAcceptor {
            current: Swap::new(current),
            files: None,
        })
    }

    /// The certificate presented now.
    pub fn identity(&self) -> HttpsIdentity {
        self.current.load().identity.clone()
    }

    /// Re-reads the files given at construction and, when they are good,
    /// presents the new certificate to every later handshake. A bad file
    /// changes nothing and says why.
    pub fn reload(&self) -> Result<HttpsIdentity, TlsError> {
        let Some(files) = &self.files else {
            return Ok(self.identity());
        };
        self.reload_from(files)
    }

    /// [`HttpsAcceptor::reload`] from `files` (the configuration named new
    /// paths).
    pub fn reload_from(&self, files: &HttpsFiles) -> Result<HttpsIdentity, TlsError> {
        let next = Self::load(files)?;
        let identity = next.identity.clone();
        self.current.store(next);
        Ok(identity)
    }

    /// Runs the server handshake on `tcp`. Dropping the future (a
    /// handshake deadline) closes the socket.
    pub async fn accept(&self, tcp: TcpStream) -> Result<ServerTls, TlsError> {
        let config = self.current.load().config.clone();
        let mut conn = ServerConnection::new(config).map_err(TlsError::Handshake)?;
        let mut tcp = tcp;
        handshake::complete(&mut tcp, &mut conn).await?;
        Ok(ServerTls::new(tcp, conn))
    }

    fn load(files: &HttpsFiles) -> Result<Current, TlsError> {
        let cert = read_file(&files.cert)?;
        let key = read_file(&files.key)?;
        let client_ca = match &files.client_ca {
            Some(path) => Some((path.as_path(), read_file(path)?)),
            None => None,
        };
        Self::build(
            (&files.cert, &cert),
            (&files.key, &key),
            client_ca
                .as_ref()
                .map(|(path, pem)| (*path, pem.as_slice())),
        )
    }

    fn build(
        cert: (&Path, &[u8]),
        key: (&Path, &[u8]),
        client_ca: Option<(&Path, &[u8])>,
    ) -> Result<Current, TlsError> {
        let certified = certified_key(cert, key)?;
        let leaf = certified.cert.first().ok_or(TlsError::Config {
            file: cert.0.to_path_buf(),
            reason: ConfigProblem::NoCertificate,
        })?;
        let identity = HttpsIdentity {
            serial_hex: cert_serial_hex(leaf).unwrap_or_default(),
            not_after_unix_s: cert_not_after_unix_s(leaf).unwrap_or_default(),
            requires_client_cert: client_ca.is_some(),
        };
        let provider = provider();
        let builder = ServerConfig::builder_with_details(provider.clone(), Arc::new(ClockTime))
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Handshake)?;
        let builder = match client_ca {
            Some((path, pem)) => {
                let roots = Arc::new(parse_ca_bundle(path, pem)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|e| TlsError::Config {
                        file: path.to_path_buf(),
                        reason: ConfigProblem::BadCertificate {
                            detail: e.to_string(),
                        },
                    })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let resolver: Arc<dyn ResolvesServerCert> = Arc::new(SingleCertAndKey::from(certified));
        let mut config = builder.with_cert_resolver(resolver);
        config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
        Ok(Current {
            config: Arc::new(config),
            identity,
        })
    }
}
