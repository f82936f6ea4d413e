//! TLS to providers (`https://` base URLs): the Node as an ordinary
//! HTTPS client.
//!
//! ```text
//! UpstreamTls::new(settings)           once per adapter instance (config apply)
//!   trust anchors: settings.ca_pem (a private CA, the only anchors)
//!                | the system store (rustls-native-certs), loaded once
//!                  per process, or the bundled Mozilla roots
//!                  (webpki-roots) when the system store is empty
//!   ClientConfig: ring, TLS 1.2 + 1.3, ALPN http/1.1, SNI on,
//!                 in-memory session resumption
//! UpstreamTls::connect(tcp, host)      per connection
//!   ServerName = the base URL's host (DNS name → SNI + name check;
//!                IP literal → IP SAN check, no SNI)
//!   handshake ─► ClientTls | UpstreamTlsError (→ failure code provider_tls)
//! ```
//!
//! Why the system store first: it is what the operator manages (a
//! corporate CA added with `update-ca-certificates`, distrusted roots
//! removed by OS updates), and `SSL_CERT_FILE` / `SSL_CERT_DIR` point it
//! elsewhere without a config change. Why the bundled roots as a fallback:
//! a minimal container image often has no CA bundle at all, and hosted
//! APIs must still verify there. `ca_file` replaces both for a provider
//! behind a private CA (like `curl --cacert`), so a public CA cannot vouch
//! for an internal host name.
//!
//! `insecure_skip_verify` (dev only) accepts any certificate chain and
//! name; the handshake signature is still checked (the peer holds the key
//! of the certificate it sent). It is logged at warn level when the config
//! is built and on every connection.

use std::fmt;
use std::sync::{Arc, OnceLock};

use monoio::net::TcpStream;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::{
    CertificateError, ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore,
    SignatureScheme,
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use super::error::{ConfigProblem, TlsError};
use super::stream::ClientTls;
use super::{handshake, pem, provider, ClockTime};

/// ALPN protocol every HTTPS connection offers.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// Where the default trust anchors came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootsSource {
    /// The operating system's store (rustls-native-certs).
    System,
    /// The Mozilla roots bundled at build time (webpki-roots): the system
    /// store had no usable certificate.
    Bundled,
}

/// The default trust anchors, loaded once per process.
#[derive(Debug)]
pub struct DefaultRoots {
    /// The anchors.
    pub store: Arc<RootCertStore>,
    /// Where they came from.
    pub source: RootsSource,
}

static DEFAULT_ROOTS: OnceLock<DefaultRoots> = OnceLock::new();

/// The system trust store, or the bundled roots when it has no usable
/// certificate. Read from disk on the first call only (it blocks: call it
/// at config time, not on a hot path).
pub fn default_roots() -> &'static DefaultRoots {
    DEFAULT_ROOTS.get_or_init(|| {
        let loaded = rustls_native_certs::load_native_certs();
        let mut store = RootCertStore::empty();
        let (added, ignored) = store.add_parsable_certificates(loaded.certs);
        for error in &loaded.errors {
            tracing::debug!(%error, "system trust store: an entry could not be read");
        }
        if added > 0 {
            tracing::info!(
                roots = added,
                ignored,
                "provider TLS: trusting the system certificate store"
            );
            return DefaultRoots {
                store: Arc::new(store),
                source: RootsSource::System,
            };
        }
        let store = RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        tracing::warn!(
            roots = store.len(),
            "provider TLS: the system certificate store is empty or unreadable; \
             trusting the bundled Mozilla roots (install ca-certificates or set \
             SSL_CERT_FILE to use the system's)"
        );
        DefaultRoots {
            store: Arc::new(store),
            source: RootsSource::Bundled,
        }
    })
}

/// How one provider's certificate is verified.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamTlsSettings {
    /// PEM CA certificates that are the only trust anchors (a private CA);
    /// `None`: [`default_roots`].
    pub ca_pem: Option<String>,
    /// Dev only: accept any certificate (see the module docs).
    pub insecure_skip_verify: bool,
}

impl UpstreamTlsSettings {
    /// The certificates (DER, in bundle order) of `ca_pem` that
    /// [`UpstreamTls::new`] makes the only trust anchors, checked as it
    /// checks them; `None` without a private CA (the default roots). The
    /// Edge binds credential leases to them without building a client.
    pub fn private_ca_certificates(
        &self,
    ) -> Result<Option<Vec<CertificateDer<'static>>>, TlsError> {
        Ok(self.private_roots()?.map(|(certificates, _)| certificates))
    }

    fn private_roots(
        &self,
    ) -> Result<Option<(Vec<CertificateDer<'static>>, RootCertStore)>, TlsError> {
        let Some(pem_text) = &self.ca_pem else {
            return Ok(None);
        };
        let source = std::path::Path::new("<ca_pem>");
        let certificates = pem::parse_cert_chain(source, pem_text.as_bytes())?;
        let roots = pem::ca_roots(source, certificates.iter().cloned())?;
        Ok(Some((certificates, roots)))
    }
}

/// Why a TLS connection to a provider failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamTlsError {
    /// The base URL's host cannot be a TLS server name.
    #[error("host {host:?} is not a valid TLS server name")]
    BadServerName {
        /// The host.
        host: String,
    },
    /// The handshake failed: rustls' reason (certificate not valid for the
    /// host, expired, unknown issuer, alert from the provider, …).
    #[error("TLS handshake with {host} failed: {source}")]
    Handshake {
        /// The host.
        host: String,
        /// rustls' error.
        source: rustls::Error,
    },
    /// The socket failed during the handshake.
    #[error("TLS handshake with {host} failed: {source}")]
    Io {
        /// The host.
        host: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl UpstreamTlsError {
    /// The certificate problem behind a handshake failure, if that is what
    /// it was.
    pub fn certificate_error(&self) -> Option<&CertificateError> {
        match self {
            UpstreamTlsError::Handshake {
                source: rustls::Error::InvalidCertificate(e),
                ..
            } => Some(e),
            _ => None,
        }
    }
}

/// The TLS client of one provider (adapter instance). Cheap to clone, `Send`
/// and `Sync`: it travels with the adapter's endpoint to the worker cores.
#[derive(Clone)]
pub struct UpstreamTls {
    config: Arc<ClientConfig>,
    insecure: bool,
    /// The private CA's certificates, the only anchors (`None`: default
    /// roots, or no verification at all).
    private_ca: Option<Arc<[CertificateDer<'static>]>>,
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("private_ca", &self.private_ca.is_some())
            .field("insecure", &self.insecure)
            .finish_non_exhaustive()
    }
}

impl PartialEq for UpstreamTls {
    /// Two clients are equal when they are the same client (config reuse
    /// compares endpoints; a rebuilt client is a new one).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.config, &other.config)
    }
}

impl Eq for UpstreamTls {}

impl UpstreamTls {
    /// Builds the client. Fails when `ca_pem` holds no usable CA
    /// certificate.
    pub fn new(settings: &UpstreamTlsSettings) -> Result<Self, TlsError> {
        let provider = provider();
        let builder = ClientConfig::builder_with_details(provider.clone(), Arc::new(ClockTime))
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Handshake)?;
        let mut private_ca = None;
        let builder = if settings.insecure_skip_verify {
            tracing::warn!(
                "provider TLS: tls_insecure_skip_verify is on: provider certificates are NOT \
                 verified (dev only; anyone on the path can read and change this traffic)"
            );
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate {
                    algorithms: provider.signature_verification_algorithms,
                }))
        } else {
            let roots = match settings.private_roots()? {
                Some((certificates, roots)) => {
                    private_ca = Some(Arc::from(certificates));
                    Arc::new(roots)
                }
                None => default_roots().store.clone(),
            };
            let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| TlsError::Config {
                    file: "<ca_pem>".into(),
                    reason: ConfigProblem::BadCertificate {
                        detail: e.to_string(),
                    },
                })?;
            builder.with_webpki_verifier(verifier)
        };
        let mut config = builder.with_no_client_auth();
        config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
        Ok(UpstreamTls {
            config: Arc::new(config),
            insecure: settings.insecure_skip_verify,
            private_ca,
        })
    }

    /// Whether certificates go unverified (`insecure_skip_verify`).
    pub fn is_insecure(&self) -> bool {
        self.insecure
    }

    /// The certificates (DER, in bundle order) of the private CA that are
    /// this client's only trust anchors; `None` when it trusts the default
    /// roots (or, insecure, verifies nothing).
    pub fn private_ca(&self) -> Option<&[CertificateDer<'static>]> {
        self.private_ca.as_deref()
    }

    /// Runs the handshake with `host` (the base URL's host: SNI and the name
    /// the certificate must carry) over `tcp`.
    pub async fn connect(&self, tcp: TcpStream, host: &str) -> Result<ClientTls, UpstreamTlsError> {
        let server_name =
            ServerName::try_from(host.to_owned()).map_err(|_| UpstreamTlsError::BadServerName {
                host: host.to_owned(),
            })?;
        if self.insecure {
            tracing::warn!(
                host,
                "provider TLS: connecting WITHOUT certificate verification \
                 (tls_insecure_skip_verify, dev only)"
            );
        }
        let mut conn =
            ClientConnection::new(self.config.clone(), server_name).map_err(|source| {
                UpstreamTlsError::Handshake {
                    host: host.to_owned(),
                    source,
                }
            })?;
        let mut tcp = tcp;
        match handshake::complete(&mut tcp, &mut conn).await {
            Ok(()) => Ok(ClientTls::new(tcp, conn)),
            Err(TlsError::Handshake(source)) => Err(UpstreamTlsError::Handshake {
                host: host.to_owned(),
                source,
            }),
            Err(TlsError::Io(source)) => Err(UpstreamTlsError::Io {
                host: host.to_owned(),
                source,
            }),
            Err(other) => Err(UpstreamTlsError::Io {
                host: host.to_owned(),
                source: std::io::Error::other(other.to_string()),
            }),
        }
    }
}

/// The dev-only verifier: any chain, any name; handshake signatures are
/// still verified with the provider's algorithms.
#[derive(Debug)]
struct AcceptAnyCertificate {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
