//! TLS for IOP: mutual TLS 1.3 between Edge and Node with SPIFFE workload
//! identity (T2, T3), and the ordinary web-PKI TLS of the HTTP hops.
//!
//! | module | what |
//! |---|---|
//! | `edge`, `node` | the node link: [`EdgeTlsAcceptor`], [`NodeTlsConnector`] (below) |
//! | `listener` | [`HttpsAcceptor`]: the Edge's HTTPS client listener, the HTTPS mock |
//! | `upstream` | [`UpstreamTls`]: the Node as an HTTPS client of `https://` providers |
//! | `stream` | [`TlsStream`] (cancel-safe, for the HTTP shells and the node link) and [`MaybeTls`], "plain TCP or TLS" |
//! | `split` | [`TlsReadHalf`], [`TlsWriteHalf`]: a [`TlsStream`] driven by a reader and a writer task at once (the node link) |
//! | `pem`, `identity`, `handshake`, `error` | PEM loading, SPIFFE IDs, the handshake driver, typed errors |
//!
//! Every identity here is **reloadable**: acceptors and connectors share
//! their certificate through a swap cell, so `reload` (SIGHUP) changes what
//! the next handshake presents while open connections keep theirs; a file
//! that does not load or names another identity is refused.
//!
//! Both peers present certificates signed by the configured CA; the identity
//! is the certificate's single URI SAN `spiffe://<trust-domain>/<role>/<name>`.
//!
//! ```text
//!  Node (TLS client)                                  Edge (TLS server)
//!  NodeTlsConnector::connect                          EdgeTlsAcceptor::accept
//!    EdgeIdentityVerifier                               NodeIdentityVerifier
//!      chain → CA, validity, server EKU (webpki)          chain → CA, validity, client EKU
//!      URI SAN == spiffe://<td>/edge/<edge name>          (WebPkiClientVerifier)
//!                                                         URI SAN == spiffe://<td>/node/<n>,
//!                                                         n in NodeAllowList
//!                                                         ──► per-connection verdict slot
//!  TlsStream<_, ClientConnection>                     (TlsStream<_, ServerConnection>, WorkloadId)
//!    └─ into_split: reader + writer task (conn)         └─ into_split
//! ```
//!
//! Design points:
//!
//! - **TLS 1.3 only**, ring provider, configs built with
//!   `builder_with_details(ring provider, clock time)` so certificate validity
//!   is judged by [`crate::clock`].
//! - **Identity capture.** monoio-rustls does not expose the peer certificate
//!   after the handshake, so the Edge builds a fresh `ServerConfig` per
//!   accepted connection (cheap: the signing key, the webpki verifier and the
//!   trust anchors are shared `Arc`s) whose verifier writes the verdict into a
//!   per-connection `OnceLock`. `accept` returns the verified [`WorkloadId`];
//!   registration then checks that its name equals the registered `node_id`
//!   (T3).
//! - **No resumption.** Session storage and TLS 1.3 tickets are off on the
//!   Edge and resumption is off on the Node: a resumed session would skip the
//!   verifiers.
//! - **Rejections are alerts.** A verifier that rejects an identity returns
//!   `ApplicationVerificationFailure`, so the peer receives `access_denied`.
//!   Under TLS 1.3 the client's `connect` completes before the server has
//!   judged the client certificate; a rejected Node sees the alert on its
//!   first read, usually while its writer sends `RegisterRequest` (use
//!   [`rustls_cause`] to log it; the frame connection closes with reason
//!   `tls_alert:access_denied`).
//! - **Own handshake driver and stream.** The private `handshake` module
//!   runs the handshake over the socket and hands the connection to a
//!   [`TlsStream`]: monoio-rustls' driver writes only the first queued TLS
//!   chunk when a handshake fails, so a Node's rejection alert could be lost
//!   behind its `ChangeCipherSpec` (ours flushes the alert every time), and
//!   monoio-rustls' split stream panics when the peer's alert arrives while
//!   the writer has a write in flight (see `split`). Dropping an
//!   `accept`/`connect` future (a handshake deadline) is safe: the socket
//!   goes with it.
//! - **Deadlines shut the socket down** (see `RUNTIME_NOTES.md`): the frame
//!   connection's reader is never cancelled.

mod edge;
mod error;
mod handshake;
mod identity;
mod listener;
mod node;
mod pem;
mod records;
mod split;
mod stream;
mod upstream;

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::time_provider::TimeProvider;
use rustls::{CertificateError, SupportedProtocolVersion};
use rustls_pki_types::{CertificateDer, UnixTime};

pub use edge::{EdgeTlsAcceptor, NodeAllowList};
pub use error::{alert_name, rustls_cause, ConfigProblem, TlsError};
pub use identity::{
    workload_id_from_cert, IdentityRejection, Role, WorkloadId, WorkloadIdError,
    MAX_TRUST_DOMAIN_BYTES, MAX_URI_BYTES, SPIFFE_SCHEME,
};
pub use listener::{HttpsAcceptor, HttpsFiles, HttpsIdentity};
pub use node::{NodeTlsConnector, EDGE_SERVER_NAME};
pub use pem::{TlsFiles, TlsMaterial};
pub use split::{TlsReadHalf, TlsWriteHalf};
pub use stream::{ClientTls, ListenerStream, MaybeTls, ServerTls, TlsStream, UpstreamStream};
pub use upstream::{
    default_roots, DefaultRoots, RootsSource, UpstreamTls, UpstreamTlsError, UpstreamTlsSettings,
    ALPN_HTTP11,
};

/// The only protocol version either side speaks (T1).
pub(crate) static TLS13_ONLY: &[&SupportedProtocolVersion] = &[&rustls::version::TLS13];

/// The ring crypto provider every config is built with.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// rustls' view of wall time, read through [`crate::clock`] (the one module
/// allowed to read the OS clock).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ClockTime;

impl TimeProvider for ClockTime {
    fn current_time(&self) -> Option<UnixTime> {
        let unix_ms = u64::try_from(crate::clock::unix_ms()).ok()?;
        Some(UnixTime::since_unix_epoch(Duration::from_millis(unix_ms)))
    }
}

/// A verified peer: its workload identity and the serial number of the
/// certificate it presented (logged, so a rotation can be seen).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCert {
    /// The SPIFFE identity in the peer's certificate.
    pub id: WorkloadId,
    /// The certificate's serial number, lowercase hex.
    pub serial_hex: String,
}

/// What a verifier concluded about the peer of one connection.
#[derive(Debug, Clone)]
pub(crate) enum Verdict {
    /// The certificate verified and carries an acceptable identity.
    Accepted(PeerCert),
    /// The certificate verified but its identity is rejected.
    Rejected(IdentityRejection),
}

/// The per-connection slot a verifier writes its verdict into.
pub(crate) type VerdictSlot = Arc<std::sync::OnceLock<Verdict>>;

/// Records a verifier's identity check of `end_entity` in the connection's
/// slot and answers rustls: a rejected identity fails the handshake with
/// `ApplicationVerificationFailure`, so the peer receives `access_denied`.
pub(crate) fn record_verdict(
    slot: &VerdictSlot,
    end_entity: &CertificateDer<'_>,
    checked: Result<WorkloadId, IdentityRejection>,
) -> Result<(), rustls::Error> {
    let verdict = match checked {
        Ok(id) => Verdict::Accepted(PeerCert {
            id,
            serial_hex: cert_serial_hex(end_entity).unwrap_or_default(),
        }),
        Err(reason) => Verdict::Rejected(reason),
    };
    let accepted = matches!(verdict, Verdict::Accepted(_));
    // A slot already filled means a second verification on one connection,
    // which TLS 1.3 never does: refuse it.
    if slot.set(verdict).is_err() || !accepted {
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::ApplicationVerificationFailure,
        ));
    }
    Ok(())
}

/// The outcome of a handshake (`result`) judged with the verdict its
/// verifier recorded: the peer's verified identity, or why the connection
/// is refused. An identity rejection wins over the handshake error it caused.
pub(crate) fn handshake_outcome(
    result: Result<(), TlsError>,
    verdict: &VerdictSlot,
) -> Result<&PeerCert, TlsError> {
    match (result, verdict.get()) {
        (Ok(()), Some(Verdict::Accepted(peer))) => Ok(peer),
        (_, Some(Verdict::Rejected(reason))) => Err(TlsError::IdentityRejected {
            reason: reason.clone(),
        }),
        // Both sides require the peer's certificate, so a finished handshake
        // has always run the verifier; refuse rather than trust an unverified
        // peer.
        (Ok(()), None) => Err(TlsError::IdentityRejected {
            reason: IdentityRejection::NotVerified,
        }),
        (Err(e), _) => Err(e),
    }
}

/// The serial number of a DER certificate as lowercase hex (no leading
/// zero bytes), or `None` when it does not parse.
pub fn cert_serial_hex(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    Some(parsed.raw_serial_as_string().replace(':', ""))
}

/// The end of a DER certificate's validity, in Unix seconds.
pub(crate) fn cert_not_after_unix_s(cert: &CertificateDer<'_>) -> Option<i64> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    Some(parsed.validity().not_after.timestamp())
}

/// This side's own certificate: the identity it names, its serial number
/// and when it expires. Reported at start and after every reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalIdentity {
    /// The SPIFFE identity in the certificate.
    pub id: WorkloadId,
    /// The certificate's serial number, lowercase hex.
    pub serial_hex: String,
    /// The certificate's `notAfter`, Unix seconds.
    pub not_after_unix_s: i64,
}

impl LocalIdentity {
    /// Reads and checks the configured certificate: it must name this side
    /// (trust domain `trust_domain`, role `role`).
    pub(crate) fn of(
        material: &TlsMaterial,
        trust_domain: &str,
        role: Role,
    ) -> Result<Self, TlsError> {
        let own_error = |rejection| TlsError::Config {
            file: material.cert_source.clone(),
            reason: ConfigProblem::OwnIdentity { rejection },
        };
        let leaf = material.leaf_cert().ok_or(TlsError::Config {
            file: material.cert_source.clone(),
            reason: ConfigProblem::NoCertificate,
        })?;
        let id = workload_id_from_cert(leaf).map_err(own_error)?;
        identity::check_domain_and_role(&id, trust_domain, role).map_err(own_error)?;
        Ok(LocalIdentity {
            id,
            serial_hex: cert_serial_hex(leaf).unwrap_or_default(),
            not_after_unix_s: cert_not_after_unix_s(leaf).unwrap_or_default(),
        })
    }
}

/// Refuses a reloaded certificate that names another identity than the
/// running one (peers expect the running one by name).
pub(crate) fn same_identity(
    material: &TlsMaterial,
    current: &LocalIdentity,
    next: &LocalIdentity,
) -> Result<(), TlsError> {
    if current.id == next.id {
        return Ok(());
    }
    Err(TlsError::Config {
        file: material.cert_source.clone(),
        reason: ConfigProblem::OwnIdentity {
            rejection: IdentityRejection::WrongName {
                expected: current.id.uri(),
                found: next.id.uri(),
            },
        },
    })
}

/// A value shared by every clone of its holder (and every core) and
/// replaced as a whole: a reload stores a new `Arc`; whoever loaded the
/// old one keeps using it until they drop it.
pub(crate) struct Swap<T>(Arc<RwLock<Arc<T>>>);

impl<T> Clone for Swap<T> {
    fn clone(&self) -> Self {
        Swap(self.0.clone())
    }
}

impl<T> Swap<T> {
    pub(crate) fn new(value: T) -> Self {
        Swap(Arc::new(RwLock::new(Arc::new(value))))
    }

    /// The current value.
    pub(crate) fn load(&self) -> Arc<T> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces the value for every later [`Swap::load`].
    pub(crate) fn store(&self, value: T) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(value);
    }
}

/// Validates a trust-domain setting.
pub(crate) fn checked_trust_domain(trust_domain: &str) -> Result<Arc<str>, TlsError> {
    WorkloadId::validate_trust_domain(trust_domain).map_err(|error| TlsError::BadSetting {
        setting: "trust_domain",
        error,
    })?;
    Ok(Arc::from(trust_domain))
}
