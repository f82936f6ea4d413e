//! The Node's supervisor against a scripted Edge over real loopback TCP
//! (`insecure_plaintext`, T5): what the whole dial → register → ready
//! sequence does when the Edge refuses readiness, and what the shutdown
//! drain tells the Edge (`NodeDraining`, only to an Edge that accepts it).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{chat_tunnel, frame, node_config, openai_adapter, NODE_ID, SAFETY, TARGET};
use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SocketShutdown};
use iop_engine::sync::oneshot;
use iop_wire::checks::{Attempts, ReconnectPolicy};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use monoio::io::Splitable;
use monoio::net::TcpListener;
use node_bin::config::{EdgeAddr, NodeConfig};
use node_bin::supervisor::{self, Exit, Jitter, Stop};

/// A plain-TCP Node config dialling `edge`, redialling every 50 ms.
fn plain_config(edge: std::net::SocketAddr) -> NodeConfig {
    NodeConfig {
        source: PathBuf::from("node.toml"),
        node_id: NODE_ID.into(),
        trust_domain: "iop.local".into(),
        edge_addr: EdgeAddr::parse(&edge.to_string())
            .expect("edge address")
            .into(),
        edge_name: "edge-1".into(),
        insecure_plaintext: true,
        tls: None,
        reconnect: ReconnectPolicy {
            interval: Duration::from_millis(50),
            attempts: Attempts::Limited(5),
        },
        reconnect_jitter: Jitter::new(0).expect("no jitter"),
        credentials: None,
        drain_grace_ms: 0,
        metrics: Default::default(),
        tracing: None,
    }
}

/// The Edge's end of one accepted Node connection.
struct Accepted {
    conn: ConnHandle,
    events: ConnEvents,
}

impl Accepted {
    async fn accept(listener: &TcpListener) -> Self {
        let (tcp, _) = monoio::select! {
            accepted = listener.accept() => accepted.expect("edge accepts"),
            _ = monoio::time::sleep(SAFETY) => panic!("the node never dialled within {SAFETY:?}"),
        };
        let shutdown = SocketShutdown::for_socket(&tcp);
        let (r, w) = tcp.into_split();
        let (conn, events) = spawn_conn(r, w, shutdown, ConnConfig::default());
        Self { conn, events }
    }

    async fn next(&mut self) -> ConnEvent {
        monoio::select! {
            ev = self.events.recv() => ev.expect("an event before the end"),
            _ = monoio::time::sleep(SAFETY) => panic!("nothing from the node within {SAFETY:?}"),
        }
    }

    async fn recv(&mut self) -> Body {
        match self.next().await {
            ConnEvent::Frame(pb::Frame { body: Some(body) }) => body,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    fn send(&self, body: Body) {
        self.conn.send_control(frame(body)).expect("edge send");
    }

    /// Registration accepted (with an empty config); returns at the
    /// Node's ready request.
    async fn register(&mut self) {
        self.register_with(node_config(Vec::new(), false), true)
            .await;
    }

    /// Registration accepted with `config`, saying whether this Edge
    /// understands `NodeDraining`; returns at the Node's ready request.
    async fn register_with(&mut self, config: pb::NodeConfigPayload, accepts_node_draining: bool) {
        match self.recv().await {
            Body::RegisterRequest(r) => assert_eq!(r.node_id, NODE_ID),
            other => panic!("expected RegisterRequest, got {other:?}"),
        }
        self.send(Body::RegisterResponse(Box::new(pb::RegisterResponse {
            accepted: true,
            reason: String::new(),
            config: Some(config),
            accepts_node_draining,
        })));
        match self.recv().await {
            Body::NodeReadyRequest(r) => assert_eq!(r.node_id, NODE_ID),
            other => panic!("expected NodeReadyRequest, got {other:?}"),
        }
    }

    fn answer_ready(&self, ready: bool, reason: &str) {
        self.send(Body::NodeReadyResponse(pb::NodeReadyResponse {
            ready,
            reason: reason.into(),
        }));
    }
}

// CONTRACT: R3 — an Edge that answers the ready request with `ready: false`
// gets its connection closed by the Node (reason `not_ready`), and the
// Node's supervisor dials again: a fresh connection registers from the
// start and, answered `ready: true`, is a working session (it answers a
// command). The refused attempt counts against the reconnect budget like
// any failed attempt, so a second refusal also redials; while the session
// is ready no further dial arrives (one dialler), and SIGTERM's stop ends
// the supervisor with `Exit::Shutdown` (the session's drain tells the Edge
// `NodeDraining`, then closes).
#[monoio::test(timer_enabled = true)]
async fn a_refused_ready_closes_the_connection_and_the_node_redials() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind edge");
    let cfg = plain_config(listener.local_addr().expect("edge addr"));
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let node = monoio::spawn(supervisor::run_until(
        cfg,
        None,
        None,
        Stop {
            shutdown: Box::pin(async move {
                let _ = stop_rx.await;
            }),
            force: Box::pin(std::future::pending()),
            drain_grace: Duration::ZERO,
        },
    ));

    for refusal in ["edge_draining", "node_superseded"] {
        let mut first = Accepted::accept(&listener).await;
        first.register().await;
        first.answer_ready(false, refusal);
        match first.next().await {
            ConnEvent::Closed { reason } => {
                assert_eq!(reason, CloseReason::Peer("not_ready".into()))
            }
            other => panic!("expected the node to close, got {other:?}"),
        }
    }

    let mut session = Accepted::accept(&listener).await;
    session.register().await;
    session.answer_ready(true, "");
    session.send(Body::NodeCommandRequest(pb::NodeCommandRequest {
        command_id: "after-ready".into(),
        r#type: pb::CommandType::ProviderStatus as i32,
        adapter: String::new(),
        path: String::new(),
    }));
    match session.recv().await {
        Body::NodeCommandResponse(r) => assert_eq!(r.command_id, "after-ready"),
        other => panic!("expected the command's answer, got {other:?}"),
    }
    // Ten reconnect intervals: a second dialler would have dialled by now.
    monoio::select! {
        accepted = listener.accept() => panic!("a dial while the session is ready: {accepted:?}"),
        _ = monoio::time::sleep(Duration::from_millis(500)) => {}
    }

    stop_tx.send(()).expect("supervisor listening");
    let exit = monoio::select! {
        exit = node => exit,
        _ = monoio::time::sleep(SAFETY) => panic!("the supervisor did not stop"),
    };
    assert!(matches!(exit, Exit::Shutdown), "{exit:?}");
    // The drain told this Edge (it accepts `NodeDraining`), then closed.
    match session.recv().await {
        Body::NodeDraining(notice) => assert_eq!(notice.node_id, NODE_ID),
        other => panic!("expected NodeDraining, got {other:?}"),
    }
    // Nothing ran: the drain is complete at once, and says so.
    match session.next().await {
        ConnEvent::Closed { reason } => assert_eq!(reason, CloseReason::Peer("drained".into())),
        other => panic!("expected the close, got {other:?}"),
    }
}

/// A provider that accepts connections and never answers: a tunnel to it
/// stays active until it is cancelled or its session ends.
fn silent_provider() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind provider");
    let addr = listener.local_addr().expect("provider addr");
    monoio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = listener.accept().await {
            held.push(tcp);
        }
    });
    addr
}

/// A Node under `run_until` with `drain_grace`, registered by `edge`
/// (saying `accepts_node_draining`) with adapter `mock` on a silent
/// provider, ready, and running one tunnel (`run-1`) that never ends by
/// itself. Returns the Edge's side, the stop trigger and the supervisor.
async fn node_with_a_run_in_flight(
    accepts_node_draining: bool,
    drain_grace: Duration,
) -> (
    Accepted,
    oneshot::Sender<()>,
    monoio::task::JoinHandle<Exit>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind edge");
    let cfg = plain_config(listener.local_addr().expect("edge addr"));
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let node = monoio::spawn(supervisor::run_until(
        cfg,
        None,
        None,
        Stop {
            shutdown: Box::pin(async move {
                let _ = stop_rx.await;
            }),
            force: Box::pin(std::future::pending()),
            drain_grace,
        },
    ));
    let profile = pb::ProtocolProfile {
        name: "openai".into(),
        base_url: format!("http://{}", silent_provider()),
        chat_completions_path: "/v1/chat/completions".into(),
        ..Default::default()
    };
    let mut edge = Accepted::accept(&listener).await;
    edge.register_with(
        node_config(vec![openai_adapter("mock", 4, profile)], false),
        accepts_node_draining,
    )
    .await;
    edge.answer_ready(true, "");
    let body = format!(r#"{{"model":"{TARGET}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    edge.send(Body::ProviderTunnelRequest(Box::new(chat_tunnel(
        "run-1", body,
    ))));
    // The run is active once a command sent after it sees it (frames are
    // handled in order).
    edge.send(Body::NodeCommandRequest(pb::NodeCommandRequest {
        command_id: "status".into(),
        r#type: pb::CommandType::TransportStatus as i32,
        adapter: String::new(),
        path: String::new(),
    }));
    match edge.recv().await {
        Body::NodeCommandResponse(r) => {
            assert_eq!(r.transport_status.map(|t| t.active_tunnels), Some(1))
        }
        other => panic!("expected the command's answer, got {other:?}"),
    }
    (edge, stop_tx, node)
}

// At the start of its shutdown drain a Node whose Edge accepted
// `NodeDraining` sends it on the control lane, before its runs end: the
// run in flight ends only when the Edge cancels it, after the notice; then
// the drain ends (every run released) with `Close(drained)`.
#[monoio::test(timer_enabled = true)]
async fn the_drain_tells_an_edge_that_accepts_node_draining() {
    let (mut edge, stop_tx, node) = node_with_a_run_in_flight(true, SAFETY).await;
    stop_tx.send(()).expect("supervisor listening");
    match edge.recv().await {
        Body::NodeDraining(notice) => assert_eq!(
            notice,
            pb::NodeDraining {
                node_id: NODE_ID.into(),
                reason: "shutdown".into(),
            }
        ),
        other => panic!("expected NodeDraining, got {other:?}"),
    }
    // The run is still active: it ends when the Edge cancels it.
    edge.send(Body::CancelRequest(pb::CancelRequest {
        run_id: "run-1".into(),
        reason: "test".into(),
    }));
    match edge.recv().await {
        Body::ProviderTunnelFrame(f) => {
            assert_eq!(
                (f.run_id.as_str(), f.kind()),
                ("run-1", pb::TunnelFrameKind::Error)
            )
        }
        other => panic!("expected the run's terminal, got {other:?}"),
    }
    // Every run ended, its terminal first: `Close(drained)` says so.
    match edge.next().await {
        ConnEvent::Closed { reason } => assert_eq!(reason, CloseReason::Peer("drained".into())),
        other => panic!("expected the close, got {other:?}"),
    }
    let exit = monoio::select! {
        exit = node => exit,
        _ = monoio::time::sleep(SAFETY) => panic!("the supervisor did not stop"),
    };
    assert!(matches!(exit, Exit::Shutdown), "{exit:?}");
}

// An Edge that did not set `accepts_node_draining` (an older Edge, which
// would take the frame for a protocol error) is not told: the drain runs
// its grace with the run in flight and closes with `Close(shutdown)`, and
// nothing comes before that close.
#[monoio::test(timer_enabled = true)]
async fn an_edge_that_did_not_accept_node_draining_is_not_told() {
    let (mut edge, stop_tx, node) =
        node_with_a_run_in_flight(false, Duration::from_millis(300)).await;
    stop_tx.send(()).expect("supervisor listening");
    match edge.next().await {
        ConnEvent::Closed { reason } => assert_eq!(reason, CloseReason::Peer("shutdown".into())),
        other => panic!("expected the close at the end of the grace, got {other:?}"),
    }
    let exit = monoio::select! {
        exit = node => exit,
        _ = monoio::time::sleep(SAFETY) => panic!("the supervisor did not stop"),
    };
    assert!(matches!(exit, Exit::Shutdown), "{exit:?}");
}
