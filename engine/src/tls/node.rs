//! Node side: TLS client that presents the Node certificate and accepts only
//! the configured Edge identity (T2).

use std::fmt;
use std::net::Ipv4Addr;
use std::sync::{Arc, OnceLock};

use monoio::io::{AsyncReadRent, AsyncWriteRent};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, ResolvesClientCert, Resumption};
use rustls::crypto::{
    verify_tls12_signature, verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms,
};
use rustls::server::ParsedCertificate;
use rustls::sign::SingleCertAndKey;
use rustls::{
    ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use super::handshake;
use super::identity::{check_domain_and_role, workload_id_from_cert};
use super::{
    checked_trust_domain, handshake_outcome, provider, record_verdict, same_identity, ClockTime,
    IdentityRejection, LocalIdentity, PeerCert, Role, Swap, TlsError, TlsMaterial, TlsStream,
    VerdictSlot, WorkloadId, TLS13_ONLY,
};

/// The placeholder server name every Node handshake uses (`0.0.0.0`).
///
/// rustls requires a DNS name or IP address, but Edge identity is the URI SAN
/// `spiffe://<td>/edge/<name>`, checked by the Node's own verifier; this
/// address is never compared with the certificate and, with SNI disabled (and
/// never sent for an IP anyway), never leaves the process. The unspecified
/// address names no real host, and building it cannot fail.
pub const EDGE_SERVER_NAME: Ipv4Addr = Ipv4Addr::UNSPECIFIED;

/// The parts of the Node's identity that a certificate reload replaces.
struct NodeIdentity {
    roots: Arc<RootCertStore>,
    client_cert: Arc<dyn ResolvesClientCert>,
    local: LocalIdentity,
}

/// Dials the Edge: presents the Node certificate, requires the Edge
/// certificate to chain to the CA and name `spiffe://<td>/edge/<edge name>`.
/// Clones share one identity, which [`NodeTlsConnector::reload`] replaces.
#[derive(Clone)]
pub struct NodeTlsConnector {
    provider: Arc<CryptoProvider>,
    trust_domain: Arc<str>,
    edge_name: Arc<str>,
    /// The role of the certificate presented: a Node's, or an Edge's when
    /// one Edge dials another ([`NodeTlsConnector::edge_to_edge`]).
    local_role: Role,
    identity: Swap<NodeIdentity>,
}

impl fmt::Debug for NodeTlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeTlsConnector")
            .field("local_identity", &self.identity.load().local)
            .field("edge_name", &self.edge_name)
            .finish_non_exhaustive()
    }
}

impl NodeTlsConnector {
    /// Builds a connector. Fails if `trust_domain` or `edge_name` is invalid
    /// or if the configured certificate is not a node identity in
    /// `trust_domain`.
    pub fn new(
        material: &TlsMaterial,
        trust_domain: &str,
        edge_name: &str,
    ) -> Result<Self, TlsError> {
        let trust_domain = checked_trust_domain(trust_domain)?;
        WorkloadId::validate_name(edge_name).map_err(|error| TlsError::BadSetting {
            setting: "edge_name",
            error,
        })?;
        let identity = Self::identity(material, &trust_domain, Role::Node)?;
        Ok(NodeTlsConnector {
            provider: provider(),
            trust_domain,
            edge_name: Arc::from(edge_name),
            local_role: Role::Node,
            identity: Swap::new(identity),
        })
    }

    /// A connector for one Edge dialling another (a cluster's peer
    /// listener): presents `material`, which must be an Edge identity in
    /// `trust_domain`, and accepts only the Edge named `edge_name`
    /// ([`NodeTlsConnector::to_edge`] for another one).
    pub fn edge_to_edge(
        material: &TlsMaterial,
        trust_domain: &str,
        edge_name: &str,
    ) -> Result<Self, TlsError> {
        let trust_domain = checked_trust_domain(trust_domain)?;
        WorkloadId::validate_name(edge_name).map_err(|error| TlsError::BadSetting {
            setting: "edge_name",
            error,
        })?;
        let identity = Self::identity(material, &trust_domain, Role::Edge)?;
        Ok(NodeTlsConnector {
            provider: provider(),
            trust_domain,
            edge_name: Arc::from(edge_name),
            local_role: Role::Edge,
            identity: Swap::new(identity),
        })
    }

    /// This connector (the same identity) accepting the Edge named
    /// `edge_name` instead.
    pub fn to_edge(&self, edge_name: &str) -> Result<Self, TlsError> {
        WorkloadId::validate_name(edge_name).map_err(|error| TlsError::BadSetting {
            setting: "edge_name",
            error,
        })?;
        Ok(NodeTlsConnector {
            edge_name: Arc::from(edge_name),
            ..self.clone()
        })
    }

    fn identity(
        material: &TlsMaterial,
        trust_domain: &str,
        role: Role,
    ) -> Result<NodeIdentity, TlsError> {
        Ok(NodeIdentity {
            roots: material.roots.clone(),
            client_cert: Arc::new(SingleCertAndKey::from(material.certified_key.clone())),
            local: LocalIdentity::of(material, trust_domain, role)?,
        })
    }

    /// The Node's own identity, read from its certificate. Its name is the
    /// `node_id` the Node must register with (T3).
    pub fn local_identity(&self) -> WorkloadId {
        self.identity.load().local.id.clone()
    }

    /// The Node's own certificate as presented now (identity, serial,
    /// expiry).
    pub fn local_certificate(&self) -> LocalIdentity {
        self.identity.load().local.clone()
    }

    /// Replaces the certificate, key and CA bundle with `material` for
    /// connections dialled from now on; the current connection keeps its
    /// own. `material` must name the same Node identity, or it is refused
    /// and the current identity stays.
    pub fn reload(&self, material: &TlsMaterial) -> Result<LocalIdentity, TlsError> {
        let next = Self::identity(material, &self.trust_domain, self.local_role)?;
        let current = self.identity.load();
        same_identity(material, &current.local, &next.local)?;
        let local = next.local.clone();
        self.identity.store(next);
        Ok(local)
    }

    /// Runs the client handshake on `io`.
    ///
    /// Success means the Edge proved its identity; it does not yet mean the
    /// Edge accepted ours. Under TLS 1.3 the Edge judges the client
    /// certificate after this returns, and a rejection arrives as an
    /// `access_denied` alert on the first read. Split the stream
    /// ([`TlsStream::into_split`]) to read and write from two tasks.
    pub async fn connect<IO>(&self, io: IO) -> Result<TlsStream<IO, ClientConnection>, TlsError>
    where
        IO: AsyncReadRent + AsyncWriteRent,
    {
        Ok(self.connect_verified(io).await?.0)
    }

    /// [`NodeTlsConnector::connect`], also answering which Edge certificate
    /// was verified (its identity and serial, for the Node's log).
    pub async fn connect_verified<IO>(
        &self,
        io: IO,
    ) -> Result<(TlsStream<IO, ClientConnection>, PeerCert), TlsError>
    where
        IO: AsyncReadRent + AsyncWriteRent,
    {
        let verdict: VerdictSlot = Arc::new(OnceLock::new());
        let config = self.client_config(verdict.clone())?;
        let server_name = ServerName::IpAddress(EDGE_SERVER_NAME.into());
        let mut conn = ClientConnection::new(config, server_name).map_err(TlsError::Handshake)?;
        let mut io = io;
        let result = handshake::complete(&mut io, &mut conn).await;
        let peer = handshake_outcome(result, &verdict)?.clone();
        Ok((TlsStream::new(io, conn), peer))
    }

    /// A config for one connection: the current identity, a fresh verdict
    /// slot, TLS 1.3, no SNI, no resumption.
    fn client_config(&self, verdict: VerdictSlot) -> Result<Arc<ClientConfig>, TlsError> {
        let identity = self.identity.load();
        let verifier = Arc::new(EdgeIdentityVerifier {
            roots: identity.roots.clone(),
            algorithms: self.provider.signature_verification_algorithms,
            trust_domain: self.trust_domain.clone(),
            edge_name: self.edge_name.clone(),
            verdict,
        });
        let mut config =
            ClientConfig::builder_with_details(self.provider.clone(), Arc::new(ClockTime))
                .with_protocol_versions(TLS13_ONLY)
                .map_err(TlsError::Handshake)?
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_client_cert_resolver(identity.client_cert.clone());
        config.enable_sni = false;
        config.resumption = Resumption::disabled();
        Ok(Arc::new(config))
    }
}

/// Server-certificate verifier of one connection: chain to the CA with
/// signature and validity checks, then the Edge identity check.
#[derive(Debug)]
struct EdgeIdentityVerifier {
    roots: Arc<RootCertStore>,
    algorithms: WebPkiSupportedAlgorithms,
    trust_domain: Arc<str>,
    edge_name: Arc<str>,
    verdict: VerdictSlot,
}

impl EdgeIdentityVerifier {
    fn check_identity(
        &self,
        end_entity: &CertificateDer<'_>,
    ) -> Result<WorkloadId, IdentityRejection> {
        let id = workload_id_from_cert(end_entity)?;
        check_domain_and_role(&id, &self.trust_domain, Role::Edge)?;
        if id.name() != &*self.edge_name {
            return Err(IdentityRejection::WrongName {
                expected: self.edge_name.to_string(),
                found: id.name().to_owned(),
            });
        }
        Ok(id)
    }
}

impl ServerCertVerifier for EdgeIdentityVerifier {
    /// `server_name` is the [`EDGE_SERVER_NAME`] placeholder and is ignored:
    /// the identity is the URI SAN.
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        record_verdict(&self.verdict, end_entity, self.check_identity(end_entity))?;
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
