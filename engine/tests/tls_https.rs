//! HTTPS over real loopback sockets, on both monoio drivers: the provider
//! TLS client ([`UpstreamTls`]) against an [`HttpsAcceptor`], the HTTP
//! shells over the "plain or TLS" stream, certificate rejections with their
//! rustls reason, a cancelled read on a TLS stream, and listener reload.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use iop_engine::certs::{DevCa, IssuedCert, Validity};
use iop_engine::http::{accept, connect, ClientConn, Limits, ServerConn, Watched};
use iop_engine::pool::{BufferPool, PoolConfig};
use iop_engine::tls::{
    cert_serial_hex, HttpsAcceptor, HttpsFiles, ListenerStream, MaybeTls, TlsError, UpstreamStream,
    UpstreamTls, UpstreamTlsError, UpstreamTlsSettings,
};
use monoio::net::TcpListener;
use rustls::CertificateError;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

fn listen() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

fn ca() -> DevCa {
    DevCa::new("iop").unwrap()
}

fn server_cert(ca: &DevCa, hosts: &[&str]) -> IssuedCert {
    ca.issue_for_hosts(hosts, Validity::days_from_now(1))
        .unwrap()
}

fn acceptor(issued: &IssuedCert) -> HttpsAcceptor {
    HttpsAcceptor::from_pem(issued.cert_pem.as_bytes(), issued.key_pem.as_bytes(), None).unwrap()
}

fn trusting(ca: &DevCa) -> UpstreamTls {
    UpstreamTls::new(&UpstreamTlsSettings {
        ca_pem: Some(ca.cert_pem()),
        insecure_skip_verify: false,
    })
    .unwrap()
}

fn serial_of(pem: &str) -> String {
    cert_serial_hex(&CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()).unwrap()
}

/// Accepts one TLS connection; the server task answers with `serve`.
fn spawn_server<F, Fut>(
    listener: TcpListener,
    acceptor: HttpsAcceptor,
    serve: F,
) -> monoio::task::JoinHandle<Result<(), TlsError>>
where
    F: FnOnce(ServerConn<ListenerStream>) -> Fut + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    monoio::spawn(async move {
        let (tcp, _) = accept(&listener).await.unwrap();
        let tls = acceptor.accept(tcp).await?;
        assert!(tls.conn().alpn_protocol() == Some(b"http/1.1".as_slice()));
        serve(ServerConn::new(MaybeTls::from(tls), Limits::default())).await;
        Ok(())
    })
}

async fn dial(
    addr: SocketAddr,
    tls: &UpstreamTls,
    host: &str,
) -> Result<ClientConn<UpstreamStream>, UpstreamTlsError> {
    let tcp = connect(addr).await.unwrap();
    let stream = tls.connect(tcp, host).await?;
    Ok(ClientConn::new(MaybeTls::from(stream), Limits::default()).with_host(host.to_owned()))
}

/// A body larger than a TLS record, a rustls plaintext buffer and a pooled
/// read buffer, so every buffering boundary is crossed.
fn big_body() -> Bytes {
    Bytes::from(
        (0..300_000u32)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    )
}

#[monoio::test_all]
async fn https_carries_length_and_chunked_bodies_byte_exact_into_pooled_buffers() {
    let ca = ca();
    let issued = server_cert(&ca, &["localhost", "127.0.0.1"]);
    let (listener, addr) = listen();
    let body = big_body();
    let served = body.clone();
    let server = spawn_server(listener, acceptor(&issued), move |mut conn| async move {
        // A request with a body, answered with a length.
        let request = conn.read_request().await.unwrap().unwrap();
        assert_eq!(request.body, served);
        conn.write_response(
            200,
            [("content-type", "application/octet-stream")],
            served.clone(),
        )
        .await
        .unwrap();
        // Keep-alive: a streamed (chunked) answer on the same connection.
        let request = conn.read_request().await.unwrap().unwrap();
        assert_eq!(request.head.target, "/stream");
        conn.start_chunked(200, [("content-type", "text/event-stream")])
            .await
            .unwrap();
        for piece in served.chunks(70_000) {
            conn.write_chunk(Bytes::copy_from_slice(piece))
                .await
                .unwrap();
        }
        conn.finish().await.unwrap();
        assert!(
            conn.read_request().await.unwrap().is_none(),
            "client closed"
        );
    });
    let pool = BufferPool::new(PoolConfig {
        buffer_size_bytes: 16 * 1024,
        buffer_count_max: 64,
    })
    .unwrap();
    let tls = trusting(&ca);
    let mut client = dial(addr, &tls, "localhost")
        .await
        .unwrap()
        .with_read_pool(pool.clone());
    client
        .send_request(
            "POST",
            "/upload",
            [("content-type", "application/octet-stream")],
            body.clone(),
        )
        .await
        .unwrap();
    let head = client.read_response_head().await.unwrap();
    assert_eq!(head.status, 200);
    let echoed = client.read_body_to_end(1 << 20).await.unwrap();
    assert_eq!(echoed, body);
    assert!(client.is_reusable());

    client
        .send_request(
            "GET",
            "/stream",
            std::iter::empty::<(&str, &str)>(),
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(client.read_response_head().await.unwrap().status, 200);
    let mut streamed = Vec::new();
    let mut pooled_pieces = 0;
    while let Some(piece) = client.read_body_chunk().await.unwrap() {
        // Body pieces are slices of the pooled read buffers, as over TCP.
        if pool.locate(piece.as_ptr()).is_some() {
            pooled_pieces += 1;
        }
        streamed.extend_from_slice(&piece);
    }
    assert_eq!(Bytes::from(streamed), body);
    assert!(pooled_pieces > 0);
    assert!(client.is_reusable());
    drop(client);
    server.await.unwrap();
}

#[monoio::test_all]
async fn certificate_rejections_name_their_reason() {
    let ca = ca();
    let tls = trusting(&ca);
    let cases: [(&str, IssuedCert, &str, CertificateError); 3] = [
        (
            "wrong host",
            server_cert(&ca, &["other.example"]),
            "localhost",
            CertificateError::NotValidForName,
        ),
        (
            "expired",
            ca.issue_for_hosts(&["localhost"], Validity::expired())
                .unwrap(),
            "localhost",
            CertificateError::Expired,
        ),
        (
            // Another CA with another name: nothing in the trust store
            // issued it. (A CA with the same name would be a bad signature.)
            "unknown CA",
            server_cert(&DevCa::new("elsewhere").unwrap(), &["localhost"]),
            "localhost",
            CertificateError::UnknownIssuer,
        ),
    ];
    for (case, issued, host, expected) in cases {
        let (listener, addr) = listen();
        let server = spawn_server(listener, acceptor(&issued), |_| async {});
        let err = match dial(addr, &tls, host).await {
            Ok(_) => panic!("{case}: the handshake succeeded"),
            Err(e) => e,
        };
        let found = err.certificate_error().cloned();
        // rustls reports contextual variants; compare their kind.
        let kind = |e: &CertificateError| match e {
            CertificateError::NotValidForNameContext { .. } => CertificateError::NotValidForName,
            CertificateError::ExpiredContext { .. } => CertificateError::Expired,
            other => other.clone(),
        };
        assert_eq!(found.as_ref().map(kind), Some(expected), "{case}: {err}");
        assert!(
            err.to_string()
                .starts_with(&format!("TLS handshake with {host} failed: ")),
            "{case}: {err}"
        );
        // The server saw the client's alert, not a success.
        assert!(server.await.is_err(), "{case}");
    }
}

#[monoio::test_all]
async fn insecure_skip_verify_accepts_an_unknown_ca_and_an_ip_host_is_checked_against_ip_sans() {
    let stranger = server_cert(&DevCa::new("iop").unwrap(), &["localhost"]);
    let (listener, addr) = listen();
    let server = spawn_server(listener, acceptor(&stranger), |mut conn| async move {
        conn.read_request().await.unwrap().unwrap();
        conn.write_response(
            200,
            std::iter::empty::<(&str, &str)>(),
            Bytes::from_static(b"ok"),
        )
        .await
        .unwrap();
    });
    let insecure = UpstreamTls::new(&UpstreamTlsSettings {
        ca_pem: None,
        insecure_skip_verify: true,
    })
    .unwrap();
    assert!(insecure.is_insecure());
    let mut client = dial(addr, &insecure, "localhost").await.unwrap();
    client
        .send_request("GET", "/", std::iter::empty::<(&str, &str)>(), Bytes::new())
        .await
        .unwrap();
    assert_eq!(client.read_response_head().await.unwrap().status, 200);
    assert_eq!(
        client.read_body_to_end(16).await.unwrap(),
        Bytes::from_static(b"ok")
    );
    server.await.unwrap();

    // An IP literal host is verified against the certificate's IP SANs.
    let ca = ca();
    let tls = trusting(&ca);
    let (listener, addr) = listen();
    let server = spawn_server(
        listener,
        acceptor(&server_cert(&ca, &["127.0.0.1"])),
        |_| async {},
    );
    assert!(dial(addr, &tls, "127.0.0.1").await.is_ok());
    server.await.unwrap();
    let (listener, addr) = listen();
    let server = spawn_server(
        listener,
        acceptor(&server_cert(&ca, &["127.0.0.2"])),
        |_| async {},
    );
    let err = dial(addr, &tls, "127.0.0.1").await.expect_err("wrong IP");
    assert!(matches!(
        err.certificate_error(),
        Some(CertificateError::NotValidForNameContext { .. } | CertificateError::NotValidForName)
    ));
    assert!(server.await.is_err());
}

// A cancelled read on a TLS stream leaves it whole: the next request on the
// same connection is read in full (the Edge's surface watches a waiting
// client with such a read).
#[monoio::test_all(timer_enabled = true)]
async fn a_cancelled_tls_read_keeps_the_stream_usable() {
    let ca = ca();
    let issued = server_cert(&ca, &["localhost"]);
    let (listener, addr) = listen();
    let server = spawn_server(listener, acceptor(&issued), |mut conn| async move {
        let first = conn.read_request().await.unwrap().unwrap();
        assert_eq!(first.head.target, "/first");
        // The work finishes while the client is silent: the watch's read is
        // cancelled.
        let watched = conn
            .watch_peer(monoio::time::sleep(Duration::from_millis(50)))
            .await;
        assert!(matches!(watched, Watched::Done(())));
        conn.write_response(
            200,
            std::iter::empty::<(&str, &str)>(),
            Bytes::from_static(b"1"),
        )
        .await
        .unwrap();
        // The client sends its next request during the next watch: the
        // read completes with it, and nothing of it is lost.
        let watched = conn
            .watch_peer(monoio::time::sleep(Duration::from_millis(300)))
            .await;
        assert!(matches!(watched, Watched::Done(())));
        let second = conn.read_request().await.unwrap().unwrap();
        assert_eq!(second.head.target, "/second");
        assert_eq!(second.body, Bytes::from_static(b"payload"));
        conn.write_response(
            200,
            std::iter::empty::<(&str, &str)>(),
            Bytes::from_static(b"2"),
        )
        .await
        .unwrap();
        // A client that goes away is seen by the watch.
        let watched = conn.watch_peer(std::future::pending::<()>()).await;
        assert!(matches!(watched, Watched::PeerClosed));
    });
    let tls = trusting(&ca);
    let mut client = dial(addr, &tls, "localhost").await.unwrap();
    client
        .send_request(
            "GET",
            "/first",
            std::iter::empty::<(&str, &str)>(),
            Bytes::new(),
        )
        .await
        .unwrap();
    assert_eq!(client.read_response_head().await.unwrap().status, 200);
    assert_eq!(
        client.read_body_to_end(16).await.unwrap(),
        Bytes::from_static(b"1")
    );
    client
        .send_request(
            "POST",
            "/second",
            std::iter::empty::<(&str, &str)>(),
            Bytes::from_static(b"payload"),
        )
        .await
        .unwrap();
    assert_eq!(client.read_response_head().await.unwrap().status, 200);
    assert_eq!(
        client.read_body_to_end(16).await.unwrap(),
        Bytes::from_static(b"2")
    );
    drop(client);
    server.await.unwrap();
}

#[monoio::test_all]
async fn a_listener_reload_serves_the_new_certificate_and_refuses_a_bad_file() {
    let dir = std::env::temp_dir().join(format!("iop-https-reload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ca = ca();
    let first = server_cert(&ca, &["localhost"]);
    let second = server_cert(&ca, &["localhost"]);
    let files = HttpsFiles {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
        client_ca: None,
    };
    std::fs::write(&files.cert, &first.cert_pem).unwrap();
    std::fs::write(&files.key, &first.key_pem).unwrap();
    let acceptor = HttpsAcceptor::from_files(&files).unwrap();
    assert_eq!(acceptor.identity().serial_hex, serial_of(&first.cert_pem));

    // A malformed replacement is refused; the running certificate stays.
    std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    let err = acceptor.reload().unwrap_err();
    assert!(err.to_string().contains("cert.pem"), "{err}");
    assert_eq!(acceptor.identity().serial_hex, serial_of(&first.cert_pem));
    // A key that does not match the certificate is refused too.
    std::fs::write(&files.cert, &second.cert_pem).unwrap();
    let err = acceptor.reload().unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
    assert_eq!(acceptor.identity().serial_hex, serial_of(&first.cert_pem));

    std::fs::write(&files.key, &second.key_pem).unwrap();
    let reloaded = acceptor.reload().unwrap();
    assert_eq!(reloaded.serial_hex, serial_of(&second.cert_pem));
    assert_ne!(reloaded.serial_hex, serial_of(&first.cert_pem));
    // A new connection gets the new certificate.
    let (listener, addr) = listen();
    let server = spawn_server(listener, acceptor.clone(), |_| async {});
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let tls = trusting(&ca);
    let client = dial(addr, &tls, "localhost").await.unwrap();
    let MaybeTls::Tls(stream) = client.into_inner() else {
        panic!("not TLS")
    };
    let presented = stream.conn().peer_certificates().unwrap()[0].clone();
    *seen.lock().unwrap() = cert_serial_hex(&presented);
    assert_eq!(
        seen.lock().unwrap().clone(),
        Some(serial_of(&second.cert_pem))
    );
    server.await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[monoio::test_all]
async fn a_listener_with_a_client_ca_requires_a_client_certificate() {
    let ca = ca();
    let issued = server_cert(&ca, &["localhost"]);
    let acceptor = HttpsAcceptor::from_pem(
        issued.cert_pem.as_bytes(),
        issued.key_pem.as_bytes(),
        Some(ca.cert_pem().as_bytes()),
    )
    .unwrap();
    assert!(acceptor.identity().requires_client_cert);
    let (listener, addr) = listen();
    let server = spawn_server(listener, acceptor, |_| async {});
    // The provider client presents no certificate: TLS 1.3 lets its
    // handshake finish, and the server refuses it.
    let tls = trusting(&ca);
    let _client = dial(addr, &tls, "localhost").await;
    let err = server.await.unwrap_err();
    assert!(
        matches!(
            err,
            TlsError::Handshake(rustls::Error::NoCertificatesPresented)
        ),
        "{err:?}"
    );
}
