//! A Node that knows several Edges, over real loopback sockets: the real
//! supervisor (`node_bin::supervisor::run_sharded`) and configuration
//! (`NodeConfig::parse` of `edge_addr` and `edge_name` lists) against
//! scripted Edges that register the Node, make it ready and then close the
//! connection, so the Node redials at once (`interval_sec = 0`).
//!
//! Every Node here has `max_attempts = 1`: one failed attempt ends it with
//! `Exit::GaveUp`. A Node that keeps registering therefore proves that
//! each attempt found a live Edge within itself, past the dead ones.
//! The TLS Edges present certificates of a throw-away CA with the Edge name
//! under test. Waits are bounded by [`common::SAFETY`] only as a net
//! against hangs.

mod common;

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use common::{node_config, NODE_ID, SAFETY};
use iop_engine::certs::{DevCa, Validity};
use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnEvents, ConnHandle, SocketShutdown};
use iop_engine::tls::{EdgeTlsAcceptor, NodeAllowList, Role, TlsMaterial};
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use monoio::io::Splitable;
use monoio::net::TcpListener;
use node_bin::config::NodeConfig;
use node_bin::edges::{self, Candidate, CandidateFailure, EdgeTls};
use node_bin::supervisor::{self, Exit, Stop};

const TRUST_DOMAIN: &str = "iop.local";

/// What one scripted Edge saw.
#[derive(Debug, Default)]
struct EdgeLog {
    /// TCP connections accepted.
    accepted: Cell<u32>,
    /// TLS handshakes that failed (the Node refused our identity).
    handshakes_failed: Cell<u32>,
    /// Sessions the Node registered and made ready.
    sessions: Cell<u32>,
    /// Frames a registering Node should not send.
    errors: RefCell<Vec<String>>,
}

/// How a scripted Edge treats each connection.
enum Script {
    /// Accepts and closes at once, before registration (an Edge that is
    /// going away).
    Drop,
    /// Registers the Node, makes it ready, then closes (plain TCP).
    Serve,
    /// [`Script::Serve`] over TLS with this identity.
    ServeTls(Rc<EdgeTlsAcceptor>),
}

/// Sessions the serving Edges of a test still give, together. At 0 each
/// of them stops listening (the next connection it accepts is closed
/// first): the Node's next attempt finds no Edge and, with one attempt,
/// ends with `Exit::GaveUp`, so every count is final when it does.
type Budget = Rc<Cell<u32>>;

/// A scripted Edge on a fresh loopback port, serving connections one after
/// another while `budget` lasts.
fn spawn_edge(script: Script, budget: &Budget) -> (SocketAddr, Rc<EdgeLog>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind edge");
    let addr = listener.local_addr().expect("edge addr");
    let log = Rc::new(EdgeLog::default());
    let (seen, budget) = (log.clone(), budget.clone());
    monoio::spawn(async move {
        while budget.get() > 0 {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            seen.accepted.set(seen.accepted.get() + 1);
            let shutdown = SocketShutdown::for_socket(&tcp);
            let (conn, events) = match &script {
                _ if budget.get() == 0 => break,
                Script::Drop => continue,
                Script::Serve => {
                    let (r, w) = tcp.into_split();
                    spawn_conn(r, w, shutdown, ConnConfig::default())
                }
                Script::ServeTls(acceptor) => match acceptor.accept(tcp).await {
                    Ok((tls, node)) => {
                        if node.name() != NODE_ID {
                            seen.errors.borrow_mut().push(format!("node {node}"));
                        }
                        let (r, w) = tls.into_split();
                        spawn_conn(r, w, shutdown, ConnConfig::default())
                    }
                    Err(_) => {
                        seen.handshakes_failed.set(seen.handshakes_failed.get() + 1);
                        continue;
                    }
                },
            };
            match register_then_close(&conn, events).await {
                Ok(true) => {
                    seen.sessions.set(seen.sessions.get() + 1);
                    budget.set(budget.get() - 1);
                }
                Ok(false) => {}
                Err(e) => seen.errors.borrow_mut().push(e),
            }
        }
    });
    (addr, log)
}

/// The next frame's body; `None` when the connection ended.
async fn next_body(events: &mut ConnEvents) -> Option<Body> {
    match events.recv().await {
        Some(ConnEvent::Frame(pb::Frame { body: Some(body) })) => Some(body),
        _ => None,
    }
}

/// Registration accepted (an empty config), ready, then the Edge closes:
/// `Ok(true)`. `Ok(false)`: the Node went away first; `Err`: it sent
/// something else.
async fn register_then_close(conn: &ConnHandle, mut events: ConnEvents) -> Result<bool, String> {
    match next_body(&mut events).await {
        Some(Body::RegisterRequest(r)) if r.node_id == NODE_ID => {}
        None => return Ok(false),
        Some(other) => return Err(format!("expected RegisterRequest, got {other:?}")),
    }
    let send = |body| conn.send_control(pb::Frame { body: Some(body) });
    send(Body::RegisterResponse(Box::new(pb::RegisterResponse {
        accepted: true,
        reason: String::new(),
        config: Some(node_config(Vec::new(), false)),
        accepts_node_draining: true,
    })))
    .map_err(|e| e.to_string())?;
    match next_body(&mut events).await {
        Some(Body::NodeReadyRequest(r)) if r.node_id == NODE_ID => {}
        None => return Ok(false),
        Some(other) => return Err(format!("expected NodeReadyRequest, got {other:?}")),
    }
    send(Body::NodeReadyResponse(pb::NodeReadyResponse {
        ready: true,
        reason: String::new(),
    }))
    .map_err(|e| e.to_string())?;
    conn.close(CloseReason::Shutdown);
    Ok(true)
}

/// A node.toml dialling `edges`, accepting `names`; one failed attempt
/// ends the Node, a lost session redials at once.
fn config(edges: &[SocketAddr], names: &[&str], tls: bool) -> NodeConfig {
    let list = |items: Vec<String>| format!("[{}]", items.join(", "));
    let edge_addr = list(edges.iter().map(|a| format!("\"{a}\"")).collect());
    let edge_name = list(names.iter().map(|n| format!("\"{n}\"")).collect());
    let transport = if tls {
        "[tls]\nca = \"ca.pem\"\ncert = \"node.pem\"\nkey = \"node-key.pem\"\n"
    } else {
        "insecure_plaintext = true\n"
    };
    let text = format!(
        "node_id = \"{NODE_ID}\"\ntrust_domain = \"{TRUST_DOMAIN}\"\nedge_addr = {edge_addr}\n\
         edge_name = {edge_name}\ndrain_grace_ms = 0\n{transport}\n\
         [reconnect]\ninterval_sec = 0\nmax_attempts = 1\njitter_percent = 0\n"
    );
    NodeConfig::parse(&text, "node.toml").expect("node.toml")
}

/// The Node's supervisor (never told to stop: it ends by giving up).
fn start_node(cfg: NodeConfig, tls: Option<EdgeTls>) -> monoio::task::JoinHandle<Exit> {
    monoio::spawn(supervisor::run_sharded(
        cfg,
        tls,
        None,
        Stop {
            shutdown: Box::pin(std::future::pending()),
            force: Box::pin(std::future::pending()),
            drain_grace: Duration::ZERO,
        },
        None,
    ))
}

/// The Node's end, which must come within [`SAFETY`].
async fn ended(node: monoio::task::JoinHandle<Exit>) -> Exit {
    monoio::select! {
        exit = node => exit,
        _ = monoio::time::sleep(SAFETY) => panic!("the node did not end within {SAFETY:?}"),
    }
}

/// Waits until `done` holds (bounded by [`SAFETY`]).
async fn eventually(what: &str, done: impl Fn() -> bool) {
    for _ in 0..(SAFETY.as_millis() / 5) {
        if done() {
            return;
        }
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never reached: {what}");
}

/// An address nothing listens on (connections are refused).
fn dead_address() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

fn no_errors(logs: &[&Rc<EdgeLog>]) {
    for log in logs {
        assert_eq!(*log.errors.borrow(), Vec::<String>::new());
    }
}

// CONTRACT: S2 — edge_addr = [dead address, Edge that drops the
// connection, live Edge]: every attempt registers with the live Edge,
// whatever the order, within the attempt (one failed attempt would end this
// Node, max_attempts = 1), and a session the Edge ended redials.
#[monoio::test(timer_enabled = true)]
async fn a_dead_address_is_passed_over_within_the_attempt() {
    let budget: Budget = Rc::new(Cell::new(40));
    let dead = dead_address();
    let (dropping, drops) = spawn_edge(Script::Drop, &budget);
    let (live, served) = spawn_edge(Script::Serve, &budget);
    let node = start_node(config(&[dead, dropping, live], &["edge-1"], false), None);
    // The 41st attempt finds every Edge gone.
    assert!(matches!(ended(node).await, Exit::GaveUp));
    assert_eq!(served.sessions.get(), 40, "{served:?}");
    // One connection per session.
    assert_eq!(served.accepted.get(), 40, "{served:?}");
    // Each attempt's order is a fresh uniform shuffle, so the dropping
    // Edge came before the live one in some of the 40 (in none:
    // probability 2^-40).
    assert!(drops.accepted.get() >= 2, "{drops:?}");
    assert_eq!(drops.sessions.get(), 0);
    no_errors(&[&drops, &served]);
}

// CONTRACT: S2 — two live Edges: the Node picks either, afresh at each
// redial. Over 40 sessions both are chosen (one of them alone: probability
// 2 × 2^-40).
#[monoio::test(timer_enabled = true)]
async fn two_live_edges_are_both_chosen_across_redials() {
    let budget: Budget = Rc::new(Cell::new(40));
    let (a, at_a) = spawn_edge(Script::Serve, &budget);
    let (b, at_b) = spawn_edge(Script::Serve, &budget);
    let node = start_node(config(&[a, b], &["edge-1"], false), None);
    assert!(matches!(ended(node).await, Exit::GaveUp));
    let (sa, sb) = (at_a.sessions.get(), at_b.sessions.get());
    assert_eq!(sa + sb, 40);
    assert!(sa >= 1 && sb >= 1, "edge a: {sa}, edge b: {sb}");
    // One connection per session (the first address of each attempt
    // answered), and one more: the last attempt's, which the Edge that did
    // not serve the 40th session accepted and closed (the other had
    // stopped listening).
    assert_eq!(at_a.accepted.get() + at_b.accepted.get(), 41);
    no_errors(&[&at_a, &at_b]);
}

/// A throw-away CA's material for the Node (`node-a`) and for Edges.
struct Pki {
    ca: DevCa,
}

impl Pki {
    fn new() -> Self {
        Self {
            ca: DevCa::new(TRUST_DOMAIN).expect("CA"),
        }
    }

    fn material(&self, role: Role, name: &str) -> TlsMaterial {
        let cert = self
            .ca
            .issue(role, name, Validity::days_from_now(1))
            .expect("issue");
        TlsMaterial::from_pem(
            self.ca.cert_pem().as_bytes(),
            cert.cert_pem.as_bytes(),
            cert.key_pem.as_bytes(),
        )
        .expect("material")
    }

    /// An Edge presenting `spiffe://iop.local/edge/<name>`, knowing node-a.
    fn edge(&self, name: &str) -> Script {
        let acceptor = EdgeTlsAcceptor::new(
            &self.material(Role::Edge, name),
            TRUST_DOMAIN,
            NodeAllowList::new([NODE_ID]),
        )
        .expect("acceptor");
        Script::ServeTls(Rc::new(acceptor))
    }

    /// The Node's TLS, accepting `cfg.edge_name`.
    fn node(&self, cfg: &NodeConfig) -> EdgeTls {
        EdgeTls::new(
            &self.material(Role::Node, NODE_ID),
            TRUST_DOMAIN,
            &cfg.edge_name,
        )
        .expect("node TLS")
    }
}

fn candidate(addr: SocketAddr) -> Candidate {
    Candidate {
        addr,
        entry: node_bin::config::EdgeAddr::parse(&addr.to_string()).expect("addr"),
    }
}

/// The TLS handshake of `tls` with the Edge at `addr`: the verified Edge
/// name, or why not.
async fn handshake(tls: &EdgeTls, addr: SocketAddr) -> Result<String, CandidateFailure> {
    let at = candidate(addr);
    let tcp = edges::connect(&at).await?;
    let link = tls.handshake(&at, tcp).await?;
    Ok(link.edge.id.name().to_owned())
}

// CONTRACT: T2 — the Node accepts an Edge whose certificate names any
// listed edge_name: an Edge named by the second name registers the Node at
// every redial. The one-name connector the first dial tried refuses it
// (one failed handshake on the Edge), the Node dials again verifying the
// name the certificate carries, and remembers it for the address: later
// dials take one handshake each.
#[monoio::test(timer_enabled = true)]
async fn an_edge_with_the_second_listed_name_registers_the_node() {
    let pki = Pki::new();
    let budget: Budget = Rc::new(Cell::new(5));
    let (addr, log) = spawn_edge(pki.edge("edge-2"), &budget);
    let cfg = config(&[addr], &["edge-1", "edge-2"], true);
    let tls = pki.node(&cfg);
    assert!(matches!(
        ended(start_node(cfg, Some(tls))).await,
        Exit::GaveUp
    ));
    assert_eq!(log.sessions.get(), 5, "{log:?}");
    assert_eq!(log.handshakes_failed.get(), 1, "{log:?}");
    // 5 sessions and the refused first handshake (the last attempt found
    // the Edge no longer listening).
    assert_eq!(log.accepted.get(), 6, "{log:?}");
    no_errors(&[&log]);
}

// CONTRACT: T2 — an Edge whose identity name is not listed is refused in
// the handshake, before registration: the attempt fails (and this Node,
// with one attempt, gives up) and the Edge never saw a RegisterRequest.
#[monoio::test(timer_enabled = true)]
async fn an_edge_whose_name_is_not_listed_is_refused() {
    let pki = Pki::new();
    let budget: Budget = Rc::new(Cell::new(1));
    let (addr, log) = spawn_edge(pki.edge("edge-3"), &budget);
    let cfg = config(&[addr], &["edge-1", "edge-2"], true);
    let tls = pki.node(&cfg);
    assert_eq!(
        handshake(&tls, addr).await,
        Err(CandidateFailure::Tls(
            "tls handshake with the edge: peer identity rejected: edge name \"edge-3\" is not \
             one of the configured [\"edge-1\", \"edge-2\"]"
                .into()
        ))
    );
    assert!(matches!(
        ended(start_node(cfg, Some(tls))).await,
        Exit::GaveUp
    ));
    // The direct handshake and the Node's one attempt, each refused once
    // (the name is not listed: no second dial).
    eventually("the Edge saw both refusals", || {
        log.handshakes_failed.get() == 2
    })
    .await;
    assert_eq!(log.accepted.get(), 2, "{log:?}");
    assert_eq!(log.sessions.get(), 0);
    no_errors(&[&log]);

    // With one name the refusal reads as it always did.
    let one = config(&[addr], &["edge-1"], true);
    assert_eq!(
        handshake(&pki.node(&one), addr).await,
        Err(CandidateFailure::Tls(
            "tls handshake with the edge: peer identity rejected: edge name \"edge-3\" is not \
             the configured \"edge-1\""
                .into()
        ))
    );
    // A listed name verifies at once.
    let named = config(&[addr], &["edge-3", "edge-1"], true);
    assert_eq!(
        handshake(&pki.node(&named), addr).await,
        Ok("edge-3".into())
    );
}

// CONTRACT: T2 — Edges of several names in one fleet: with both names
// listed, a Node dialling both registers with each across its redials.
#[monoio::test(timer_enabled = true)]
async fn edges_of_two_listed_names_are_both_reached() {
    let pki = Pki::new();
    let budget: Budget = Rc::new(Cell::new(40));
    let (one, at_one) = spawn_edge(pki.edge("edge-1"), &budget);
    let (two, at_two) = spawn_edge(pki.edge("edge-2"), &budget);
    let cfg = config(&[one, two], &["edge-1", "edge-2"], true);
    let tls = pki.node(&cfg);
    assert!(matches!(
        ended(start_node(cfg, Some(tls))).await,
        Exit::GaveUp
    ));
    let (s1, s2) = (at_one.sessions.get(), at_two.sessions.get());
    assert_eq!(s1 + s2, 40);
    // Both chosen (one alone: probability 2 × 2^-40).
    assert!(s1 >= 1 && s2 >= 1, "edge-1: {s1}, edge-2: {s2}");
    // edge-2's address cost one refused handshake, once.
    assert_eq!(at_one.handshakes_failed.get(), 0, "{at_one:?}");
    assert_eq!(at_two.handshakes_failed.get(), 1, "{at_two:?}");
    no_errors(&[&at_one, &at_two]);
}

// CONTRACT: S2 — an Edge address that takes the TCP connection but never
// answers the TLS handshake (a stopped Edge: the kernel accepts into its
// backlog) costs `DIAL_TIMEOUT`, not forever: the attempt fails and this
// Node, with one attempt, gives up.
#[monoio::test(timer_enabled = true)]
async fn an_edge_that_never_answers_the_handshake_is_given_up_on_after_the_dial_timeout() {
    let pki = Pki::new();
    // Listening, never accepting: connections complete in the kernel and
    // then hear nothing.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr");
    let cfg = config(&[addr], &["edge-1"], true);
    let tls = pki.node(&cfg);
    let started = iop_engine::clock::now();
    assert!(matches!(
        ended(start_node(cfg, Some(tls))).await,
        Exit::GaveUp
    ));
    assert!(
        started.elapsed() >= supervisor::DIAL_TIMEOUT,
        "gave up after {:?}, before the dial timeout",
        started.elapsed()
    );
    drop(silent);
}
