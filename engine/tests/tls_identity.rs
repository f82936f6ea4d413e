//! Mutual TLS with SPIFFE workload identity over real loopback TCP (T2, T3).
//!
//! Every test runs on both monoio drivers (`test_all`). Rejections are
//! observed from both ends: the side that judges returns a typed error and
//! never yields a stream, and the judged side sees the alert. Under TLS 1.3 a
//! rejected client's `connect` succeeds and the alert arrives on its first
//! read, so client-rejection tests read.

use std::net::SocketAddr;
use std::sync::Arc;

use iop_engine::certs::{DevCa, IssuedCert, Validity};
use iop_engine::tls::{
    rustls_cause, EdgeTlsAcceptor, IdentityRejection, NodeAllowList, NodeTlsConnector, Role,
    TlsError, TlsMaterial, WorkloadId,
};
use monoio::io::{AsyncReadRent, AsyncReadRentExt, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};
use monoio::task::JoinHandle;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{AlertDescription, CertificateError, DigitallySignedStruct, SignatureScheme};

const TD: &str = "iop";
const EDGE: &str = "edge-1";

/// A CA with an edge certificate and two node certificates.
struct Pki {
    ca: DevCa,
    edge: IssuedCert,
    node_a: IssuedCert,
}

fn pki() -> Pki {
    let ca = DevCa::new(TD).expect("dev CA");
    let edge = ca
        .issue(Role::Edge, EDGE, Validity::days_from_now(1))
        .expect("edge cert");
    let node_a = ca
        .issue(Role::Node, "node-a", Validity::days_from_now(1))
        .expect("node cert");
    Pki { ca, edge, node_a }
}

fn material(ca_pem: &str, issued: &IssuedCert) -> TlsMaterial {
    TlsMaterial::from_pem(
        ca_pem.as_bytes(),
        issued.cert_pem.as_bytes(),
        issued.key_pem.as_bytes(),
    )
    .expect("material")
}

fn acceptor(pki: &Pki, allowed: &[&str]) -> EdgeTlsAcceptor {
    EdgeTlsAcceptor::new(
        &material(&pki.ca.cert_pem(), &pki.edge),
        TD,
        NodeAllowList::new(allowed.iter().copied()),
    )
    .expect("acceptor")
}

fn connector(ca_pem: &str, issued: &IssuedCert) -> NodeTlsConnector {
    NodeTlsConnector::new(&material(ca_pem, issued), TD, EDGE).expect("connector")
}

fn listen() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("local addr");
    (listener, addr)
}

/// What the Edge task saw on its one accepted connection.
type EdgeOutcome = Result<WorkloadId, TlsError>;

/// Accepts one connection; on success greets, reads `ping`, answers `pong`.
fn spawn_edge(acceptor: EdgeTlsAcceptor, listener: TcpListener) -> JoinHandle<EdgeOutcome> {
    monoio::spawn(async move {
        let (tcp, _) = listener.accept().await.map_err(TlsError::Io)?;
        let (mut stream, id) = acceptor.accept(tcp).await?;
        let (res, _) = stream.write_all(b"welcome".to_vec()).await;
        res.map_err(TlsError::Io)?;
        let (res, ping) = stream.read_exact(vec![0u8; 4]).await;
        res.map_err(TlsError::Io)?;
        let reply = if ping == b"ping" { b"pong" } else { b"what" };
        let (res, _) = stream.write_all(reply.to_vec()).await;
        res.map_err(TlsError::Io)?;
        Ok(id)
    })
}

/// The first read on a rejected client: the rustls error it carries.
async fn first_read_error<S: AsyncReadRent>(stream: &mut S) -> Option<rustls::Error> {
    let (res, _) = stream.read(vec![0u8; 64]).await;
    match res {
        Ok(_) => None,
        Err(e) => rustls_cause(&e).cloned(),
    }
}

fn access_denied() -> Option<rustls::Error> {
    Some(rustls::Error::AlertReceived(AlertDescription::AccessDenied))
}

fn assert_rejected(outcome: &EdgeOutcome, expected: &IdentityRejection) {
    match outcome {
        Err(TlsError::IdentityRejected { reason }) => assert_eq!(reason, expected),
        other => panic!("expected identity rejection {expected:?}, got {other:?}"),
    }
}

/// Connects the real Node connector and returns what its first read saw.
async fn node_first_read(addr: SocketAddr, connector: &NodeTlsConnector) -> Option<rustls::Error> {
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let mut stream = connector
        .connect(tcp)
        .await
        .expect("TLS 1.3 client handshake completes before the server judges it");
    first_read_error(&mut stream).await
}

// ---------------------------------------------------------------------------
// Test-only raw peers: a client that trusts any server certificate (so the
// Edge's judgement is what is tested) and a server presenting any
// certificate (so the Node's judgement is what is tested).

/// Accepts any server certificate, still checking handshake signatures.
#[derive(Debug)]
struct AnyServerCert(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for AnyServerCert {
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
        verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

fn chain_and_key(issued: &IssuedCert) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    let chain = CertificateDer::pem_slice_iter(issued.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("cert pem");
    let key = PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes()).expect("key pem");
    (chain, key)
}

fn raw_client_config(
    versions: &[&'static rustls::SupportedProtocolVersion],
    client_cert: Option<&IssuedCert>,
) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let algorithms = provider.signature_verification_algorithms;
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServerCert(algorithms)));
    let config = match client_cert {
        Some(issued) => {
            let (chain, key) = chain_and_key(issued);
            builder
                .with_client_auth_cert(chain, key)
                .expect("client cert")
        }
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

fn raw_client(client_cert: Option<&IssuedCert>) -> monoio_rustls::TlsConnector {
    raw_client_config(&[&rustls::version::TLS13], client_cert).into()
}

/// Connects a raw client and returns what its first read saw.
async fn raw_first_read(
    addr: SocketAddr,
    client: &monoio_rustls::TlsConnector,
) -> Option<rustls::Error> {
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let name = ServerName::try_from("edge.test").expect("server name");
    let mut stream = client
        .connect(name, tcp)
        .await
        .expect("TLS 1.3 client handshake completes before the server judges it");
    first_read_error(&mut stream).await
}

/// A server presenting `issued`, asking for no client certificate.
fn raw_server(issued: &IssuedCert) -> monoio_rustls::TlsAcceptor {
    let (chain, key) = chain_and_key(issued);
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .expect("server cert");
    config.into()
}

/// Accepts one connection with a raw server; returns the rustls error it hit.
fn spawn_raw_server(
    server: monoio_rustls::TlsAcceptor,
    listener: TcpListener,
) -> JoinHandle<Result<(), TlsError>> {
    monoio::spawn(async move {
        let (tcp, _) = listener.accept().await.map_err(TlsError::Io)?;
        match server.accept(tcp).await {
            Ok(_) => Ok(()),
            Err(e) => Err(TlsError::from_monoio(e)),
        }
    })
}

/// Runs the real Node connector against a raw server; returns both outcomes.
async fn node_against(
    server_cert: &IssuedCert,
    connector: &NodeTlsConnector,
) -> (Result<(), TlsError>, Result<(), TlsError>) {
    let (listener, addr) = listen();
    let server = spawn_raw_server(raw_server(server_cert), listener);
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let client = connector.connect(tcp).await.map(|_| ());
    (client, server.await)
}

fn is_alert(result: &Result<(), TlsError>, alert: AlertDescription) -> bool {
    matches!(result, Err(TlsError::Handshake(rustls::Error::AlertReceived(a))) if *a == alert)
}

// ---------------------------------------------------------------------------
// The accepted path.

#[monoio::test_all]
async fn tls_mutual_handshake_yields_node_identity_and_carries_bytes() {
    // CONTRACT: T2 — both peers present CA-signed certs; the Edge learns the
    // Node's identity, whose name registration will compare with node_id (T3).
    let pki = pki();
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a", "node-b"]), listener);

    let node = connector(&pki.ca.cert_pem(), &pki.node_a);
    assert_eq!(node.local_identity().uri(), "spiffe://iop/node/node-a");
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let mut stream = node.connect(tcp).await.expect("node handshake");
    // Written before the Edge has finished its side of the handshake, as a
    // Node's RegisterRequest is: it may arrive in the same read as the
    // client Finished and must survive the hand-over to the stream.
    let (res, _) = stream.write_all(b"ping".to_vec()).await;
    res.expect("write ping");
    let (res, welcome) = stream.read_exact(vec![0u8; 7]).await;
    res.expect("read welcome");
    assert_eq!(welcome, b"welcome");
    let (res, pong) = stream.read_exact(vec![0u8; 4]).await;
    res.expect("read pong");
    assert_eq!(pong, b"pong");

    let id = edge.await.expect("edge accepted node-a");
    assert_eq!(id, WorkloadId::new(TD, Role::Node, "node-a").expect("id"));
    assert_eq!((id.role(), id.name()), (Role::Node, "node-a"));
}

/// Sends `conn`'s queued TLS bytes in a single socket write.
async fn flush_once(tcp: &mut TcpStream, conn: &mut rustls::ClientConnection) {
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).expect("write_tls");
    }
    let (res, _) = tcp.write_all(out).await;
    res.expect("socket write");
}

/// Reads one socket chunk into `conn` and processes it.
async fn feed_once(tcp: &mut TcpStream, conn: &mut rustls::ClientConnection) {
    let (res, buf) = tcp.read(Vec::with_capacity(32 * 1024)).await;
    let read_bytes = res.expect("socket read");
    assert!(read_bytes > 0, "server closed early");
    let mut input = &buf[..read_bytes];
    while !input.is_empty() {
        conn.read_tls(&mut input).expect("read_tls");
        conn.process_new_packets().expect("process");
    }
}

#[monoio::test_all]
async fn tls_edge_keeps_application_data_sent_with_client_finished() {
    // The client's Finished and its first application record leave in one
    // socket write, so the Edge's handshake read takes both; the record must
    // reach the stream the Edge is handed.
    use monoio::io::AsyncWriteRent;
    use std::io::{Read, Write};

    let pki = pki();
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let config = raw_client_config(&[&rustls::version::TLS13], Some(&pki.node_a));
    let name = ServerName::try_from("edge.test").expect("server name");
    let mut conn = rustls::ClientConnection::new(config, name).expect("client");
    let mut tcp = TcpStream::connect(addr).await.expect("tcp connect");
    flush_once(&mut tcp, &mut conn).await; // ClientHello
    while conn.is_handshaking() {
        feed_once(&mut tcp, &mut conn).await;
    }
    conn.writer().write_all(b"ping").expect("queue ping");
    flush_once(&mut tcp, &mut conn).await; // Certificate..Finished + "ping"
                                           // Half-close: an Edge that lost "ping" reads end-of-stream and fails,
                                           // closing the socket, instead of waiting forever.
    tcp.shutdown().await.expect("half-close");

    let mut plaintext = Vec::new();
    while plaintext.len() < b"welcomepong".len() {
        feed_once(&mut tcp, &mut conn).await;
        let mut chunk = [0u8; 64];
        match conn.reader().read(&mut chunk) {
            Ok(n) => plaintext.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("plaintext read: {e}"),
        }
    }
    assert_eq!(plaintext, b"welcomepong");
    assert_eq!(
        edge.await.map(|id| id.uri()).ok(),
        Some("spiffe://iop/node/node-a".to_owned())
    );
}

#[test]
fn tls_edge_identity_is_read_from_its_certificate() {
    let pki = pki();
    let edge = acceptor(&pki, &["node-a"]);
    assert_eq!(edge.local_identity().uri(), "spiffe://iop/edge/edge-1");
    assert!(edge.allowed_nodes().contains("node-a"));
    assert!(!edge.allowed_nodes().contains("node-b"));
}

// ---------------------------------------------------------------------------
// Edge side: the T2 rejection matrix.

#[monoio::test_all]
async fn tls_edge_rejects_client_without_certificate() {
    // CONTRACT: T2 — no client cert: rejected before any frame.
    let pki = pki();
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let seen = raw_first_read(addr, &raw_client(None)).await;
    assert_eq!(
        seen,
        Some(rustls::Error::AlertReceived(
            AlertDescription::CertificateRequired
        ))
    );
    let outcome = edge.await;
    assert!(
        matches!(
            outcome,
            Err(TlsError::Handshake(rustls::Error::NoCertificatesPresented))
        ),
        "{outcome:?}"
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_client_cert_from_another_ca() {
    // CONTRACT: T2 — wrong CA: the chain does not verify.
    let pki = pki();
    let other_ca = DevCa::new(TD).expect("other CA");
    let forged = other_ca
        .issue(Role::Node, "node-a", Validity::days_from_now(1))
        .expect("forged node cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    // Trusts the real CA (so it accepts the Edge) but presents the forged cert.
    let node = connector(&pki.ca.cert_pem(), &forged);
    let seen = node_first_read(addr, &node).await;
    assert_eq!(
        seen,
        Some(rustls::Error::AlertReceived(AlertDescription::DecryptError))
    );
    let outcome = edge.await;
    assert!(
        matches!(
            outcome,
            Err(TlsError::Handshake(rustls::Error::InvalidCertificate(
                CertificateError::BadSignature
            )))
        ),
        "{outcome:?}"
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_client_with_edge_role() {
    // CONTRACT: T2 — wrong role: an edge identity may not connect as a Node.
    let pki = pki();
    let edge_as_client = pki
        .ca
        .issue(Role::Edge, "node-a", Validity::days_from_now(1))
        .expect("edge-role cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let seen = raw_first_read(addr, &raw_client(Some(&edge_as_client))).await;
    assert_eq!(seen, access_denied());
    assert_rejected(
        &edge.await,
        &IdentityRejection::WrongRole {
            expected: Role::Node,
            found: Role::Edge,
        },
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_node_name_not_in_allowed_set() {
    // CONTRACT: T2 — wrong name: only configured node names are accepted.
    let pki = pki();
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-b", "node-c"]), listener);
    let node = connector(&pki.ca.cert_pem(), &pki.node_a);
    assert_eq!(node_first_read(addr, &node).await, access_denied());
    assert_rejected(
        &edge.await,
        &IdentityRejection::NameNotAllowed {
            name: "node-a".to_owned(),
        },
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_expired_client_cert() {
    // CONTRACT: T2 — expired cert.
    let pki = pki();
    let expired = pki
        .ca
        .issue(Role::Node, "node-a", Validity::expired())
        .expect("expired cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let node = connector(&pki.ca.cert_pem(), &expired);
    assert_eq!(
        node_first_read(addr, &node).await,
        Some(rustls::Error::AlertReceived(
            AlertDescription::CertificateExpired
        ))
    );
    let outcome = edge.await;
    assert!(
        matches!(
            outcome,
            Err(TlsError::Handshake(rustls::Error::InvalidCertificate(
                CertificateError::ExpiredContext { .. }
            )))
        ),
        "{outcome:?}"
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_not_yet_valid_client_cert() {
    // CONTRACT: T2 — a cert outside its validity window is rejected.
    let pki = pki();
    let future = pki
        .ca
        .issue(Role::Node, "node-a", Validity::not_yet_valid())
        .expect("future cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let node = connector(&pki.ca.cert_pem(), &future);
    assert_eq!(
        node_first_read(addr, &node).await,
        Some(rustls::Error::AlertReceived(
            AlertDescription::CertificateExpired
        ))
    );
    let outcome = edge.await;
    assert!(
        matches!(
            outcome,
            Err(TlsError::Handshake(rustls::Error::InvalidCertificate(
                CertificateError::NotValidYetContext { .. }
            )))
        ),
        "{outcome:?}"
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_client_from_another_trust_domain() {
    // CONTRACT: T2 — same CA, but the identity names another trust domain.
    let pki = pki();
    let other_domain = pki
        .ca
        .issue_with_uri_sans(&["spiffe://other/node/node-a"], Validity::days_from_now(1))
        .expect("cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let seen = raw_first_read(addr, &raw_client(Some(&other_domain))).await;
    assert_eq!(seen, access_denied());
    assert_rejected(
        &edge.await,
        &IdentityRejection::WrongTrustDomain {
            expected: "iop".to_owned(),
            found: "other".to_owned(),
        },
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_client_without_spiffe_id() {
    // CONTRACT: T2 — a CA-signed cert without a URI SAN carries no identity.
    let pki = pki();
    let anonymous = pki
        .ca
        .issue_with_uri_sans(&[], Validity::days_from_now(1))
        .expect("cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let seen = raw_first_read(addr, &raw_client(Some(&anonymous))).await;
    assert_eq!(seen, access_denied());
    assert_rejected(&edge.await, &IdentityRejection::NoUriSan);
}

#[monoio::test_all]
async fn tls_edge_rejects_client_with_two_spiffe_ids() {
    // CONTRACT: T2 — an X.509 SVID has exactly one URI SAN.
    let pki = pki();
    let ambiguous = pki
        .ca
        .issue_with_uri_sans(
            &["spiffe://iop/node/node-a", "spiffe://iop/node/node-b"],
            Validity::days_from_now(1),
        )
        .expect("cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a", "node-b"]), listener);
    let seen = raw_first_read(addr, &raw_client(Some(&ambiguous))).await;
    assert_eq!(seen, access_denied());
    assert_rejected(
        &edge.await,
        &IdentityRejection::MultipleUriSans { count: 2 },
    );
}

#[monoio::test_all]
async fn tls_edge_rejects_malformed_spiffe_id() {
    // CONTRACT: T2 — the URI SAN must parse strictly.
    let pki = pki();
    let malformed = pki
        .ca
        .issue_with_uri_sans(
            &["spiffe://iop/node/node-a/extra"],
            Validity::days_from_now(1),
        )
        .expect("cert");
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let seen = raw_first_read(addr, &raw_client(Some(&malformed))).await;
    assert_eq!(seen, access_denied());
    assert_rejected(
        &edge.await,
        &IdentityRejection::MalformedId {
            uri: "spiffe://iop/node/node-a/extra".to_owned(),
            error: iop_engine::tls::WorkloadIdError::WrongSegmentCount { segments: 3 },
        },
    );
}

#[monoio::test_all]
async fn tls_edge_refuses_tls12() {
    // CONTRACT: T1 — TLS 1.3 only.
    let pki = pki();
    let (listener, addr) = listen();
    let edge = spawn_edge(acceptor(&pki, &["node-a"]), listener);
    let tls12: monoio_rustls::TlsConnector =
        raw_client_config(&[&rustls::version::TLS12], Some(&pki.node_a)).into();
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let name = ServerName::try_from("edge.test").expect("server name");
    let client = tls12
        .connect(name, tcp)
        .await
        .map(|_| ())
        .map_err(TlsError::from_monoio);
    assert!(
        is_alert(&client, AlertDescription::ProtocolVersion),
        "{client:?}"
    );
    let outcome = edge.await;
    assert!(
        matches!(
            outcome,
            Err(TlsError::Handshake(rustls::Error::PeerIncompatible(_)))
        ),
        "{outcome:?}"
    );
}

#[monoio::test_all]
async fn tls_edge_reverifies_every_connection_and_applies_allow_list_reload() {
    // CONTRACT: T2 — no session resumption skips the verifier: a client that
    // would resume is judged afresh against the reloaded allow list.
    let pki = pki();
    let edge_acceptor = acceptor(&pki, &["node-a"]);
    let client = raw_client(Some(&pki.node_a));

    let (listener, addr) = listen();
    let edge = spawn_edge(edge_acceptor.clone(), listener);
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let name = ServerName::try_from("edge.test").expect("server name");
    let mut stream = client.connect(name, tcp).await.expect("first handshake");
    let (res, welcome) = stream.read_exact(vec![0u8; 7]).await;
    res.expect("welcome");
    assert_eq!(welcome, b"welcome");
    let (res, _) = stream.write_all(b"ping".to_vec()).await;
    res.expect("ping");
    let (res, _) = stream.read_exact(vec![0u8; 4]).await;
    res.expect("pong");
    assert_eq!(
        edge.await.map(|id| id.uri()).ok(),
        Some("spiffe://iop/node/node-a".to_owned())
    );

    edge_acceptor.allowed_nodes().replace(["node-b"]);
    let (listener, addr) = listen();
    let edge = spawn_edge(edge_acceptor.clone(), listener);
    assert_eq!(raw_first_read(addr, &client).await, access_denied());
    assert_rejected(
        &edge.await,
        &IdentityRejection::NameNotAllowed {
            name: "node-a".to_owned(),
        },
    );

    edge_acceptor.allowed_nodes().replace(["node-a"]);
    let (listener, addr) = listen();
    let edge = spawn_edge(edge_acceptor, listener);
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let name = ServerName::try_from("edge.test").expect("server name");
    let mut stream = client.connect(name, tcp).await.expect("third handshake");
    let (res, welcome) = stream.read_exact(vec![0u8; 7]).await;
    res.expect("welcome");
    assert_eq!(welcome, b"welcome");
    let (res, _) = stream.write_all(b"ping".to_vec()).await;
    res.expect("ping");
    let (res, _) = stream.read_exact(vec![0u8; 4]).await;
    res.expect("pong");
    assert!(edge.await.is_ok());
}

// ---------------------------------------------------------------------------
// Node side: the Node judges the Edge.

#[monoio::test_all]
async fn tls_node_rejects_server_with_node_role() {
    // CONTRACT: T2 — the Node requires role edge.
    let pki = pki();
    let impostor = pki
        .ca
        .issue(Role::Node, EDGE, Validity::days_from_now(1))
        .expect("cert");
    let node = connector(&pki.ca.cert_pem(), &pki.node_a);
    let (client, server) = node_against(&impostor, &node).await;
    assert!(
        matches!(
            &client,
            Err(TlsError::IdentityRejected {
                reason: IdentityRejection::WrongRole {
                    expected: Role::Edge,
                    found: Role::Node
                }
            })
        ),
        "{client:?}"
    );
    assert!(
        is_alert(&server, AlertDescription::AccessDenied),
        "{server:?}"
    );
}

#[monoio::test_all]
async fn tls_node_rejects_server_with_wrong_edge_name() {
    // CONTRACT: T2 — the Node requires its configured edge name.
    let pki = pki();
    let other_edge = pki
        .ca
        .issue(Role::Edge, "edge-2", Validity::days_from_now(1))
        .expect("cert");
    let node = connector(&pki.ca.cert_pem(), &pki.node_a);
    let (client, server) = node_against(&other_edge, &node).await;
    match &client {
        Err(TlsError::IdentityRejected { reason }) => assert_eq!(
            reason,
            &IdentityRejection::WrongName {
                expected: "edge-1".to_owned(),
                found: "edge-2".to_owned()
            }
        ),
        other => panic!("expected wrong-name rejection, got {other:?}"),
    }
    assert_eq!(
        client.map_err(|e| e.to_string()),
        Err(
            "peer identity rejected: edge name \"edge-2\" is not the configured \"edge-1\""
                .to_owned()
        )
    );
    assert!(
        is_alert(&server, AlertDescription::AccessDenied),
        "{server:?}"
    );
}

#[monoio::test_all]
async fn tls_node_rejects_server_from_another_ca() {
    // CONTRACT: T2 — wrong CA on the Edge side.
    let pki = pki();
    let other_ca = DevCa::new(TD).expect("other CA");
    let forged_edge = other_ca
        .issue(Role::Edge, EDGE, Validity::days_from_now(1))
        .expect("cert");
    let node = connector(&pki.ca.cert_pem(), &pki.node_a);
    let (client, server) = node_against(&forged_edge, &node).await;
    assert!(
        matches!(
            &client,
            Err(TlsError::Handshake(rustls::Error::InvalidCertificate(
                CertificateError::BadSignature
            )))
        ),
        "{client:?}"
    );
    assert!(
        is_alert(&server, AlertDescription::DecryptError),
        "{server:?}"
    );
}

#[monoio::test_all]
async fn tls_node_rejects_expired_server_cert() {
    // CONTRACT: T2 — expired Edge cert.
    let pki = pki();
    let expired_edge = pki
        .ca
        .issue(Role::Edge, EDGE, Validity::expired())
        .expect("cert");
    let node = connector(&pki.ca.cert_pem(), &pki.node_a);
    let (client, server) = node_against(&expired_edge, &node).await;
    assert!(
        matches!(
            &client,
            Err(TlsError::Handshake(rustls::Error::InvalidCertificate(
                CertificateError::ExpiredContext { .. }
            )))
        ),
        "{client:?}"
    );
    assert!(
        is_alert(&server, AlertDescription::CertificateExpired),
        "{server:?}"
    );
}

#[monoio::test_all]
async fn tls_node_rejects_server_from_another_trust_domain() {
    // CONTRACT: T2 — same CA, other trust domain.
    let pki = pki();
    let other_domain = pki
        .ca
        .issue_with_uri_sans(&["spiffe://other/edge/edge-1"], Validity::days_from_now(1))
        .expect("cert");
    let node = connector(&pki.ca.cert_pem(), &pki.node_a);
    let (client, server) = node_against(&other_domain, &node).await;
    assert!(
        matches!(
            &client,
            Err(TlsError::IdentityRejected {
                reason: IdentityRejection::WrongTrustDomain { .. }
            })
        ),
        "{client:?}"
    );
    assert!(
        is_alert(&server, AlertDescription::AccessDenied),
        "{server:?}"
    );
}

// ---------------------------------------------------------------------------
// Configuration: each side refuses a certificate that does not name it.

#[test]
fn tls_sides_refuse_certificates_of_the_other_role() {
    let pki = pki();
    let ca_pem = pki.ca.cert_pem();
    let node_as_edge = EdgeTlsAcceptor::new(
        &material(&ca_pem, &pki.node_a),
        TD,
        NodeAllowList::new(["node-a"]),
    )
    .map(|_| ())
    .map_err(|e| e.to_string());
    assert_eq!(
        node_as_edge,
        Err("<cert pem>: certificate identity unusable here: role node presented where role edge is required".to_owned())
    );
    let edge_as_node = NodeTlsConnector::new(&material(&ca_pem, &pki.edge), TD, EDGE)
        .map(|_| ())
        .map_err(|e| e.to_string());
    assert_eq!(
        edge_as_node,
        Err("<cert pem>: certificate identity unusable here: role edge presented where role node is required".to_owned())
    );
    let wrong_domain = NodeTlsConnector::new(&material(&ca_pem, &pki.node_a), "prod", EDGE)
        .map(|_| ())
        .map_err(|e| e.to_string());
    assert_eq!(
        wrong_domain,
        Err("<cert pem>: certificate identity unusable here: trust domain \"iop\" is not the configured \"prod\"".to_owned())
    );
    let bad_setting = NodeTlsConnector::new(&material(&ca_pem, &pki.node_a), TD, "edge/1")
        .map(|_| ())
        .map_err(|e| e.to_string());
    assert_eq!(
        bad_setting,
        Err(
            "setting edge_name: SPIFFE ID path character '/' is not one of [A-Za-z0-9.-_]"
                .to_owned()
        )
    );
}
