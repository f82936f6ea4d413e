//! `iop_engine::conn` over real loopback mutual TLS (engine::tls), on both
//! monoio drivers: the shape Edge and Node run in production.

use std::io::Write;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use bytes::Bytes;
use iop_engine::certs::{DevCa, IssuedCert, Validity};
use iop_engine::conn::{
    spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SendError, SocketShutdown,
};
use iop_engine::tls::{EdgeTlsAcceptor, NodeAllowList, NodeTlsConnector, Role, TlsMaterial};
use iop_wire::codec;
use iop_wire::pb::{self, frame::Body};
use iop_wire::CloseReason;
use monoio::net::{TcpListener, TcpStream};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

const TD: &str = "iop";
const EDGE: &str = "edge-1";
const NODE: &str = "node-a";

/// Guard against a hang: a test that has not finished by then fails.
const TEST_GUARD: Duration = Duration::from_secs(20);

struct Pair {
    edge: ConnHandle,
    edge_events: ConnEvents,
    node: ConnHandle,
    node_events: ConnEvents,
}

/// A Node dialing an Edge over mutual TLS, each side running a frame conn.
async fn tls_pair(config: ConnConfig) -> Pair {
    let ca = DevCa::new(TD).unwrap();
    let edge_cert = ca
        .issue(Role::Edge, EDGE, Validity::days_from_now(1))
        .unwrap();
    let node_cert = ca
        .issue(Role::Node, NODE, Validity::days_from_now(1))
        .unwrap();
    let ca_pem = ca.cert_pem();
    let edge_material = TlsMaterial::from_pem(
        ca_pem.as_bytes(),
        edge_cert.cert_pem.as_bytes(),
        edge_cert.key_pem.as_bytes(),
    )
    .unwrap();
    let node_material = TlsMaterial::from_pem(
        ca_pem.as_bytes(),
        node_cert.cert_pem.as_bytes(),
        node_cert.key_pem.as_bytes(),
    )
    .unwrap();
    let acceptor = EdgeTlsAcceptor::new(&edge_material, TD, NodeAllowList::new([NODE])).unwrap();
    let connector = NodeTlsConnector::new(&node_material, TD, EDGE).unwrap();

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let edge_side = monoio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        tcp.set_nodelay(true).unwrap();
        // The descriptor is taken before TLS wraps the stream.
        let shutdown = SocketShutdown::for_socket(&tcp);
        let (tls, identity) = acceptor.accept(tcp).await.unwrap();
        assert_eq!(identity.name(), NODE);
        (tls, shutdown)
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let node_shutdown = SocketShutdown::for_socket(&tcp);
    let node_tls = connector.connect(tcp).await.unwrap();
    let (edge_tls, edge_shutdown) = edge_side.await;

    let (read_half, write_half) = edge_tls.into_split();
    let (edge, edge_events) = spawn_conn(read_half, write_half, edge_shutdown, config.clone());
    let (read_half, write_half) = node_tls.into_split();
    let (node, node_events) = spawn_conn(read_half, write_half, node_shutdown, config);
    Pair {
        edge,
        edge_events,
        node,
        node_events,
    }
}

fn run_event(seq: u64) -> pb::Frame {
    codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
        run_id: "run-1".to_owned(),
        seq,
        delta: format!("token {seq}"),
        ..Default::default()
    })))
}

/// Asserts `event` is exactly the tunnel frame `expected`, without dumping
/// large bodies on failure.
fn assert_tunnel_frame(event: Option<ConnEvent>, expected: pb::ProviderTunnelFrame) {
    let got = match event {
        Some(ConnEvent::Frame(pb::Frame {
            body: Some(Body::ProviderTunnelFrame(got)),
        })) => *got,
        other => panic!(
            "expected a tunnel frame, got {:?}",
            other.map(|_| "another event")
        ),
    };
    let first_difference = got
        .body
        .iter()
        .zip(expected.body.iter())
        .position(|(a, b)| a != b);
    assert_eq!(
        (got.body.len(), first_difference),
        (expected.body.len(), None),
        "body length and first differing byte"
    );
    assert_eq!(got, expected);
}

fn closed(reason: CloseReason) -> ConnEvent {
    ConnEvent::Closed { reason }
}

async fn drain(events: &mut ConnEvents) -> Vec<ConnEvent> {
    let mut all = Vec::new();
    while let Some(event) = events.recv().await {
        all.push(event);
    }
    all
}

async fn guarded<F: std::future::Future<Output = ()>>(test: F) {
    if monoio::time::timeout(TEST_GUARD, test).await.is_err() {
        panic!("test did not finish within {TEST_GUARD:?}");
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_over_tls_carries_frames_bodies_and_heartbeats() {
    // CONTRACT: T1
    guarded(async {
        let config = ConnConfig::default()
            .with_heartbeat_timers(Duration::from_millis(20), Duration::from_secs(5));
        let Pair {
            edge,
            mut edge_events,
            node,
            mut node_events,
        } = tls_pair(config).await;

        let request = codec::frame(Body::RegisterRequest(pb::RegisterRequest {
            node_id: NODE.to_owned(),
            node_version: "0.1.0".to_owned(),
            ..Default::default()
        }));
        node.send_control(request.clone()).unwrap();
        assert_eq!(edge_events.recv().await, Some(ConnEvent::Frame(request)));

        // A body spanning many TLS records arrives byte-exact.
        let body: Bytes = (0..300_000u32)
            .map(|i| (i * 7 % 253) as u8)
            .collect::<Vec<u8>>()
            .into();
        let head = pb::ProviderTunnelFrame {
            run_id: "tunnel-1".to_owned(),
            seq: 1,
            kind: pb::TunnelFrameKind::Body as i32,
            ..Default::default()
        };
        node.send_body_frame(head.clone(), body.clone())
            .await
            .unwrap();
        for seq in 1..=50 {
            node.send_bulk(run_event(seq)).await.unwrap();
        }
        let expected = pb::ProviderTunnelFrame { body, ..head };
        assert_tunnel_frame(edge_events.recv().await, expected);
        for seq in 1..=50 {
            assert_eq!(
                edge_events.recv().await,
                Some(ConnEvent::Frame(run_event(seq)))
            );
        }

        // CONTRACT: T4 — heartbeats flow and are answered over TLS.
        while edge.stats().heartbeat_acks_received < 3 || node.stats().heartbeat_acks_received < 3 {
            monoio::time::sleep(Duration::from_millis(10)).await;
        }

        node.close(CloseReason::Shutdown);
        assert_eq!(
            drain(&mut node_events).await,
            vec![closed(CloseReason::Shutdown)]
        );
        assert_eq!(
            drain(&mut edge_events).await,
            vec![closed(CloseReason::Peer("shutdown".into()))]
        );
        assert_eq!(edge.send_control(run_event(1)), Err(SendError::Closed));
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn conn_over_tls_close_unblocks_idle_readers() {
    guarded(async {
        let Pair {
            edge,
            mut edge_events,
            node: _node,
            mut node_events,
        } = tls_pair(ConnConfig::default()).await;
        // Both readers sit in a TLS read; closing must end both without
        // cancelling either read.
        edge.close(CloseReason::Superseded);
        assert_eq!(
            drain(&mut edge_events).await,
            vec![closed(CloseReason::Superseded)]
        );
        assert_eq!(
            drain(&mut node_events).await,
            vec![closed(CloseReason::Peer("superseded".into()))]
        );
    })
    .await;
}

// ---------------------------------------------------------------------------
// A TLS failure on the reader while the writer has a write in flight.
//
// Both halves of the node link are driven at once: the reader task waits
// for frames while the writer task writes. When the peer's TLS stack fails
// the session (a refusal alert, a record that does not decrypt) the reader
// sees it while the writer may sit in a write the peer does not take. The
// monoio-rustls split stream panicked there ("buffer ref expected" /
// "buffer mut expected": its reader flushed through the write buffer the
// writer held). These tests hold the writer in a write on purpose (the peer
// does not read), then fail the session from the peer.

/// A CA with the Edge's and node-a's certificates.
struct Certs {
    ca: DevCa,
    edge: IssuedCert,
    node: IssuedCert,
}

impl Certs {
    fn new() -> Self {
        let ca = DevCa::new(TD).unwrap();
        let edge = ca
            .issue(Role::Edge, EDGE, Validity::days_from_now(1))
            .unwrap();
        let node = ca
            .issue(Role::Node, NODE, Validity::days_from_now(1))
            .unwrap();
        Certs { ca, edge, node }
    }

    fn material(&self, issued: &IssuedCert) -> TlsMaterial {
        TlsMaterial::from_pem(
            self.ca.cert_pem().as_bytes(),
            issued.cert_pem.as_bytes(),
            issued.key_pem.as_bytes(),
        )
        .unwrap()
    }
}

/// Queues 1 MiB run events until the bulk lane stays full for half a
/// second: the writer is then stuck in a socket write the peer does not
/// take (loopback buffers hold a few MiB; the lane holds 8 MiB).
async fn fill_until_the_writer_is_stuck(conn: &ConnHandle) {
    let big = codec::frame(Body::RunEvent(Box::new(pb::RunEvent {
        run_id: "flood".to_owned(),
        delta: "x".repeat(1 << 20),
        ..Default::default()
    })));
    for _ in 0..1_000 {
        match monoio::time::timeout(Duration::from_millis(500), conn.send_bulk(big.clone())).await {
            Ok(sent) => sent.unwrap(),
            Err(_) => return,
        }
    }
    panic!("1000 MiB went out although the peer reads nothing");
}

/// A client-certificate verifier that checks the chain like the Edge and
/// then refuses the identity as the Edge does for a node id it does not
/// list: `ApplicationVerificationFailure`, sent as `access_denied`.
#[derive(Debug)]
struct RefuseEveryNode(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for RefuseEveryNode {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.0.verify_client_cert(end_entity, intermediates, now)?;
        Err(rustls::Error::InvalidCertificate(
            CertificateError::ApplicationVerificationFailure,
        ))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A blocking TLS 1.3 server on its own thread, presenting the Edge's
/// certificate and refusing every node: it answers the ClientHello, then
/// reads nothing until `judge` fires, then reads the node's certificate,
/// sends `access_denied` and keeps the socket open until `finish` fires.
fn spawn_refusing_edge(
    certs: &Certs,
    listener: std::net::TcpListener,
    judge: mpsc::Receiver<()>,
    finish: mpsc::Receiver<()>,
) -> std::thread::JoinHandle<rustls::Error> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(certs.ca.cert_pem().as_bytes()).unwrap())
        .unwrap();
    let roots = Arc::new(roots);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let webpki = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .unwrap();
    let chain = vec![CertificateDer::from_pem_slice(certs.edge.cert_pem.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(certs.edge.key_pem.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(Arc::new(RefuseEveryNode(webpki)))
        .with_single_cert(chain, key)
        .unwrap();
    std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        let mut conn = rustls::ServerConnection::new(Arc::new(config)).unwrap();
        // The ClientHello in, the server's flight out.
        while !conn.wants_write() {
            conn.read_tls(&mut sock).unwrap();
            conn.process_new_packets().unwrap();
        }
        while conn.wants_write() {
            conn.write_tls(&mut sock).unwrap();
        }
        judge.recv().unwrap();
        // The node's certificate is the first thing it sent after that.
        let refusal = loop {
            conn.read_tls(&mut sock).unwrap();
            if let Err(e) = conn.process_new_packets() {
                break e;
            }
        };
        while conn.wants_write() {
            conn.write_tls(&mut sock).unwrap();
        }
        finish.recv().unwrap();
        refusal
    })
}

// A Node the Edge refuses sees `access_denied` after its handshake has
// finished, while its writer is stuck sending: the connection closes with
// reason `tls_alert:access_denied` (what node-bin logs as the refusal), and
// nothing panics.
#[monoio::test_all(timer_enabled = true)]
async fn refusal_alert_while_the_writer_is_stuck_closes_with_the_alert() {
    guarded(async {
        let certs = Certs::new();
        let connector = NodeTlsConnector::new(&certs.material(&certs.node), TD, EDGE).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (judge_tx, judge_rx) = mpsc::channel();
        let (finish_tx, finish_rx) = mpsc::channel();
        let edge = spawn_refusing_edge(&certs, listener, judge_rx, finish_rx);

        let tcp = TcpStream::connect(addr).await.unwrap();
        let shutdown = SocketShutdown::for_socket(&tcp);
        // TLS 1.3: the Node's handshake completes before the Edge judges it.
        let tls = connector.connect(tcp).await.unwrap();
        let (read_half, write_half) = tls.into_split();
        let (node, mut node_events) =
            spawn_conn(read_half, write_half, shutdown, ConnConfig::default());
        fill_until_the_writer_is_stuck(&node).await;

        judge_tx.send(()).unwrap();
        assert_eq!(
            drain(&mut node_events).await,
            vec![closed(CloseReason::TlsAlert("access_denied".into()))]
        );
        finish_tx.send(()).unwrap();
        assert_eq!(
            edge.join().unwrap(),
            rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure)
        );
    })
    .await;
}

// The Edge's side of the same hazard: a peer whose bytes stop decrypting
// while the Edge's writer is stuck sending to it closes the connection with
// reason `tls_error`; the Edge does not panic.
#[monoio::test_all(timer_enabled = true)]
async fn undecryptable_record_while_the_writer_is_stuck_closes_with_tls_error() {
    guarded(async {
        let certs = Certs::new();
        let acceptor =
            EdgeTlsAcceptor::new(&certs.material(&certs.edge), TD, NodeAllowList::new([NODE]))
                .unwrap();
        let connector = NodeTlsConnector::new(&certs.material(&certs.node), TD, EDGE).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let edge_side = monoio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let shutdown = SocketShutdown::for_socket(&tcp);
            let (tls, _) = acceptor.accept(tcp).await.unwrap();
            let (read_half, write_half) = tls.into_split();
            spawn_conn(read_half, write_half, shutdown, ConnConfig::default())
        });
        // The node's socket, and a second handle on it that writes around
        // its TLS session.
        let std_tcp = std::net::TcpStream::connect(addr).unwrap();
        std_tcp.set_nonblocking(true).unwrap();
        let mut raw = std_tcp.try_clone().unwrap();
        let node_tls = connector
            .connect(TcpStream::from_std(std_tcp).unwrap())
            .await
            .unwrap();
        let (edge, mut edge_events) = edge_side.await;
        // The node reads nothing: the Edge's writer gets stuck.
        fill_until_the_writer_is_stuck(&edge).await;

        // An application-data record that does not decrypt.
        let mut record = vec![0x17, 0x03, 0x03, 0x00, 0x20];
        record.extend_from_slice(&[0x5a; 0x20]);
        raw.write_all(&record).unwrap();
        assert_eq!(
            drain(&mut edge_events).await,
            vec![closed(CloseReason::TlsError)]
        );
        drop(node_tls);
    })
    .await;
}
