//! `iop_engine::conn` over real loopback mutual TLS (engine::tls), on both
//! monoio drivers: the shape Edge and Node run in production.

use std::time::Duration;

use bytes::Bytes;
use iop_engine::certs::{DevCa, Validity};
use iop_engine::conn::{
    spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SendError, SocketShutdown,
};
use iop_engine::tls::{EdgeTlsAcceptor, NodeAllowList, NodeTlsConnector, Role, TlsMaterial};
use iop_wire::codec;
use iop_wire::pb::{self, frame::Body};
use monoio::io::Splitable;
use monoio::net::{TcpListener, TcpStream};

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

fn closed(reason: &str) -> ConnEvent {
    ConnEvent::Closed {
        reason: reason.to_owned(),
    }
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

        node.close("shutdown");
        assert_eq!(drain(&mut node_events).await, vec![closed("shutdown")]);
        assert_eq!(drain(&mut edge_events).await, vec![closed("peer:shutdown")]);
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
        edge.close("superseded");
        assert_eq!(drain(&mut edge_events).await, vec![closed("superseded")]);
        assert_eq!(
            drain(&mut node_events).await,
            vec![closed("peer:superseded")]
        );
    })
    .await;
}
