//! Edge side: TLS server that requires a Node client certificate (T2).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use monoio::io::{AsyncReadRent, AsyncWriteRent};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{NoServerSessionStorage, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::SingleCertAndKey;
use rustls::{
    DigitallySignedStruct, DistinguishedName, ServerConfig, ServerConnection, SignatureScheme,
};
use rustls_pki_types::{CertificateDer, UnixTime};

use super::handshake;
use super::identity::{check_domain_and_role, workload_id_from_cert};
use super::{
    checked_trust_domain, handshake_outcome, provider, record_verdict, same_identity, ClockTime,
    IdentityRejection, LocalIdentity, Role, Swap, TlsError, TlsMaterial, TlsStream, VerdictSlot,
    WorkloadId, TLS13_ONLY,
};

/// The node names the Edge accepts, shared by every acceptor clone and
/// replaceable on config reload.
///
/// A replacement applies to handshakes that start after it; connections
/// already accepted are the caller's to re-check.
#[derive(Clone, Default)]
pub struct NodeAllowList {
    names: Arc<RwLock<Arc<BTreeSet<String>>>>,
}

impl NodeAllowList {
    /// An allow list holding `names`.
    pub fn new<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        NodeAllowList {
            names: Arc::new(RwLock::new(Arc::new(
                names.into_iter().map(Into::into).collect(),
            ))),
        }
    }

    /// Replaces the whole set (config reload).
    pub fn replace<I, S>(&self, names: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let names: BTreeSet<String> = names.into_iter().map(Into::into).collect();
        let mut guard = self.names.write().unwrap_or_else(PoisonError::into_inner);
        *guard = Arc::new(names);
    }

    /// Whether `name` is allowed.
    pub fn contains(&self, name: &str) -> bool {
        self.snapshot().contains(name)
    }

    /// The current set.
    pub fn snapshot(&self) -> Arc<BTreeSet<String>> {
        let guard = self.names.read().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(&guard)
    }
}

impl fmt::Debug for NodeAllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.snapshot().iter()).finish()
    }
}

/// The parts of the Edge's identity that a certificate reload replaces.
struct EdgeIdentity {
    webpki: Arc<dyn ClientCertVerifier>,
    cert_resolver: Arc<dyn ResolvesServerCert>,
    local: LocalIdentity,
}

/// Accepts TLS 1.3 connections from Nodes whose certificate chains to the CA
/// and names `spiffe://<trust-domain>/node/<name>` with `name` in the
/// [`NodeAllowList`]. Cheap to clone (one per core); every clone shares one
/// identity, which [`EdgeTlsAcceptor::reload`] replaces.
#[derive(Clone)]
pub struct EdgeTlsAcceptor {
    provider: Arc<CryptoProvider>,
    trust_domain: Arc<str>,
    allowed_nodes: NodeAllowList,
    /// Whom this acceptor takes: Nodes in the allow list (the node link),
    /// or any Edge of the trust domain (the peer listener of a cluster).
    peers: Role,
    identity: Swap<EdgeIdentity>,
}

impl fmt::Debug for EdgeTlsAcceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EdgeTlsAcceptor")
            .field("local_identity", &self.identity.load().local)
            .field("allowed_nodes", &self.allowed_nodes)
            .finish_non_exhaustive()
    }
}

impl EdgeTlsAcceptor {
    /// Builds an acceptor. Fails if `trust_domain` is invalid or if the
    /// configured certificate is not an edge identity in `trust_domain`.
    pub fn new(
        material: &TlsMaterial,
        trust_domain: &str,
        allowed_nodes: NodeAllowList,
    ) -> Result<Self, TlsError> {
        let trust_domain = checked_trust_domain(trust_domain)?;
        let provider = provider();
        let identity = Self::identity(material, &trust_domain, &provider)?;
        Ok(EdgeTlsAcceptor {
            provider,
            trust_domain,
            allowed_nodes,
            peers: Role::Node,
            identity: Swap::new(identity),
        })
    }

    /// The acceptor of this Edge's peer listener: the same identity (a
    /// reload through `self` reaches it), but it takes other Edges — any
    /// client certificate that chains to the CA and names
    /// `spiffe://<trust-domain>/edge/<name>` — and no Node.
    pub fn for_peer_edges(&self) -> Self {
        EdgeTlsAcceptor {
            allowed_nodes: NodeAllowList::default(),
            peers: Role::Edge,
            ..self.clone()
        }
    }

    fn identity(
        material: &TlsMaterial,
        trust_domain: &str,
        provider: &Arc<CryptoProvider>,
    ) -> Result<EdgeIdentity, TlsError> {
        let local = LocalIdentity::of(material, trust_domain, Role::Edge)?;
        let webpki =
            WebPkiClientVerifier::builder_with_provider(material.roots.clone(), provider.clone())
                .build()
                .map_err(|e| TlsError::Config {
                    file: material.ca_source.clone(),
                    reason: super::ConfigProblem::BadCertificate {
                        detail: e.to_string(),
                    },
                })?;
        Ok(EdgeIdentity {
            webpki,
            cert_resolver: Arc::new(SingleCertAndKey::from(material.certified_key.clone())),
            local,
        })
    }

    /// The Edge's own identity, read from its certificate.
    pub fn local_identity(&self) -> WorkloadId {
        self.identity.load().local.id.clone()
    }

    /// The Edge's own certificate as presented now (identity, serial,
    /// expiry).
    pub fn local_certificate(&self) -> LocalIdentity {
        self.identity.load().local.clone()
    }

    /// Replaces the certificate, key and CA bundle with `material` for
    /// handshakes that start from now on; connections already accepted
    /// keep theirs. `material` must name the same Edge identity, or it is
    /// refused and the current identity stays.
    pub fn reload(&self, material: &TlsMaterial) -> Result<LocalIdentity, TlsError> {
        let next = Self::identity(material, &self.trust_domain, &self.provider)?;
        let current = self.identity.load();
        same_identity(material, &current.local, &next.local)?;
        let local = next.local.clone();
        self.identity.store(next);
        Ok(local)
    }

    /// The allow list this acceptor consults (replace it to reload).
    pub fn allowed_nodes(&self) -> &NodeAllowList {
        &self.allowed_nodes
    }

    /// Runs the server handshake on `io` and returns the stream with the
    /// Node's verified identity. On an identity rejection the Node has been
    /// sent `access_denied` and the error is [`TlsError::IdentityRejected`].
    /// Split the stream ([`TlsStream::into_split`]) to read and write from
    /// two tasks.
    pub async fn accept<IO>(
        &self,
        io: IO,
    ) -> Result<(TlsStream<IO, ServerConnection>, WorkloadId), TlsError>
    where
        IO: AsyncReadRent + AsyncWriteRent,
    {
        let verdict: VerdictSlot = Arc::new(OnceLock::new());
        let config = self.server_config(verdict.clone())?;
        let mut conn = ServerConnection::new(config).map_err(TlsError::Handshake)?;
        let mut io = io;
        let result = handshake::complete(&mut io, &mut conn).await;
        let peer = handshake_outcome(result, &verdict)?;
        match self.peers {
            Role::Node => tracing::info!(
                peer = %peer.id.uri(),
                cert_serial = %peer.serial_hex,
                "node TLS identity verified"
            ),
            // One per forwarded request: not worth a line each.
            Role::Edge => tracing::debug!(
                peer = %peer.id.uri(),
                cert_serial = %peer.serial_hex,
                "peer edge TLS identity verified"
            ),
        }
        Ok((TlsStream::new(io, conn), peer.id.clone()))
    }

    /// A config for one connection: the current key and verifier pieces
    /// (shared), a fresh verdict slot, no session storage and no tickets.
    fn server_config(&self, verdict: VerdictSlot) -> Result<Arc<ServerConfig>, TlsError> {
        let identity = self.identity.load();
        let verifier = Arc::new(NodeIdentityVerifier {
            webpki: identity.webpki.clone(),
            trust_domain: self.trust_domain.clone(),
            allowed_nodes: self.allowed_nodes.clone(),
            peers: self.peers,
            verdict,
        });
        let mut config =
            ServerConfig::builder_with_details(self.provider.clone(), Arc::new(ClockTime))
                .with_protocol_versions(TLS13_ONLY)
                .map_err(TlsError::Handshake)?
                .with_client_cert_verifier(verifier)
                .with_cert_resolver(identity.cert_resolver.clone());
        config.session_storage = Arc::new(NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        config.max_early_data_size = 0;
        Ok(Arc::new(config))
    }
}

/// Client-certificate verifier of one connection: webpki path validation, then
/// the SPIFFE identity check, with the verdict written to the connection's slot.
#[derive(Debug)]
struct NodeIdentityVerifier {
    webpki: Arc<dyn ClientCertVerifier>,
    trust_domain: Arc<str>,
    allowed_nodes: NodeAllowList,
    peers: Role,
    verdict: VerdictSlot,
}

impl NodeIdentityVerifier {
    fn check_identity(
        &self,
        end_entity: &CertificateDer<'_>,
    ) -> Result<WorkloadId, IdentityRejection> {
        let id = workload_id_from_cert(end_entity)?;
        check_domain_and_role(&id, &self.trust_domain, self.peers)?;
        if self.peers == Role::Node && !self.allowed_nodes.contains(id.name()) {
            return Err(IdentityRejection::NameNotAllowed {
                name: id.name().to_owned(),
            });
        }
        Ok(id)
    }
}

impl ClientCertVerifier for NodeIdentityVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.webpki.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.webpki
            .verify_client_cert(end_entity, intermediates, now)?;
        record_verdict(&self.verdict, end_entity, self.check_identity(end_entity))?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
