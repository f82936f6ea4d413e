//! The simulated nodes of a swarm: one task per node on the swarm thread,
//! each dialling the Edge over its own mutually authenticated TLS
//! connection, registering, becoming ready, answering heartbeats (the
//! engine's frame connection does that on its own, T4) and answering every
//! tunnel request in process — and redialling after every disconnect under
//! node-bin's reconnect policy, jitter included.
//!
//! ```text
//! attempt: the Edges' addresses in a fresh shuffled order (node-bin's dial_order)
//!   for each: dial ─► TLS ─► Register ─► RegisterResponse ─► NodeReadyRequest ─► ready
//!             failed before ready ─► the next address                           │
//!   ▲                                                                             │
//!   │      ProviderTunnelRequest ─► RESPONSE_START, BODY, END                     │
//!   └── Supervisor::on_attempt_end (interval ± jitter) ◄── closed ◄───────────────┘
//! ```
//!
//! With one Edge (the default) an attempt is one dial. With a cluster
//! (`--cluster N`) every node knows every Edge's node address, as a
//! node-bin with an `edge_addr` list does: each attempt shuffles them
//! anew ([`node_bin::edges::dial_order`]) and tries each until one gives a
//! ready session. A node holds one connector per Edge, each verifying that
//! Edge's name — what node-bin's `EdgeTls` settles on once it has seen
//! the name at each address.
//!
//! What the orchestrator reads lives in [`SwarmState`] (atomics, shared
//! across threads): which nodes are ready and on which Edge, when each
//! became ready and when the dial that got there started, the dial
//! counters, and when each probe's tunnel request reached its node.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use iop_engine::clock::monotonic_raw_ns;
use iop_engine::conn::{spawn_conn, ConnConfig, ConnEvent, ConnHandle, SocketShutdown};
use iop_engine::http;
use iop_engine::rng::SplitMix64;
use iop_engine::tls::NodeTlsConnector;
use iop_wire::checks::{Attempts, ReconnectPolicy};
use iop_wire::codec::body_name;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use iop_wire::CloseReason;
use node_bin::config::EdgeAddr;
use node_bin::edges::{dial_order, Candidate};
use node_bin::supervisor::{AttemptOutcome, Jitter, Step, Supervisor};

/// The content of every answer starts with this, then the node id.
pub const SERVED_BY: &str = "served by ";
/// A probe's user message: this, then its sequence number.
pub const PROBE_MARKER: &str = "swarm-probe-";
/// Problems kept for the report (the rest are only counted).
const MAX_NOTES: usize = 20;
/// Mixed into a node's seed for the generator of its dial orders.
const DIAL_ORDER_SALT: u64 = 0x6469_616c_6f72_6472;

/// One simulated node: its index in the fleet, its id and its connectors
/// (its own certificate, one per Edge).
#[derive(Debug, Clone)]
pub struct NodeIdentity {
    /// Index in the fleet (`Topology::node_id(index)` is `id`).
    pub index: usize,
    /// The node id (its certificate's name).
    pub id: String,
    /// Dial with this node's certificate; connector `i` verifies the name
    /// of Edge `i` (one entry with a single Edge).
    pub connectors: Vec<NodeTlsConnector>,
}

/// How the nodes redial and which heartbeat timers their next
/// connections use; the orchestrator changes it between phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DialPolicy {
    /// The mean wait before a redial.
    pub interval: Duration,
    /// The spread of that wait.
    pub jitter: Jitter,
    /// Test-only heartbeat timers (interval, timeout); `None`: the
    /// transport defaults (30 s / 45 s).
    pub heartbeat: Option<(Duration, Duration)>,
}

/// Per-node figures.
#[derive(Debug, Default)]
struct NodeSlot {
    ready: AtomicBool,
    /// When the dial that last became ready started.
    dialled_ns: AtomicU64,
    /// When that session got `ready: true`.
    ready_ns: AtomicU64,
    /// The Edge (index in the dial list) of that session.
    edge: AtomicUsize,
}

/// One node's last ready session: when its dial started, when it got
/// `ready: true` (`monotonic_raw_ns`), and on which Edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadyTimes {
    /// The dial started (TCP connect).
    pub dialled_ns: u64,
    /// `NodeReadyResponse{ready: true}` arrived.
    pub ready_ns: u64,
    /// The Edge of the session: its index in the list the node dials.
    pub edge: usize,
}

/// Dial counters since the last [`SwarmState::take_counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Dials started (one per Edge address tried; with one Edge, one per
    /// attempt).
    pub attempts: u64,
    /// Dials that ended before ready (refused, TLS, registration).
    pub failed: u64,
    /// Tunnel requests answered.
    pub tunnels: u64,
}

/// What the swarm thread and the orchestrator share.
#[derive(Debug)]
pub struct SwarmState {
    slots: Vec<NodeSlot>,
    ready_count: AtomicUsize,
    policy: Mutex<(u64, DialPolicy)>,
    attempts: AtomicU64,
    failed: AtomicU64,
    tunnels: AtomicU64,
    probes: Mutex<HashMap<u64, u64>>,
    notes: Mutex<Vec<String>>,
    notes_dropped: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SwarmState {
    /// The state of a fleet of `nodes`, dialling under `policy`.
    pub fn new(nodes: usize, policy: DialPolicy) -> Self {
        Self {
            slots: (0..nodes).map(|_| NodeSlot::default()).collect(),
            ready_count: AtomicUsize::new(0),
            policy: Mutex::new((0, policy)),
            attempts: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            tunnels: AtomicU64::new(0),
            probes: Mutex::new(HashMap::new()),
            notes: Mutex::new(Vec::new()),
            notes_dropped: AtomicU64::new(0),
        }
    }

    /// Nodes with a ready session now.
    pub fn ready_count(&self) -> usize {
        self.ready_count.load(Ordering::Acquire)
    }

    /// The policy in force and its epoch (bumped by every change).
    pub fn policy(&self) -> (u64, DialPolicy) {
        *lock(&self.policy)
    }

    /// Changes how nodes redial from their next wait on, and the heartbeat
    /// timers of their next connections.
    pub fn set_policy(&self, policy: DialPolicy) {
        let mut p = lock(&self.policy);
        *p = (p.0 + 1, policy);
    }

    /// Whether node `index` has a ready session now.
    pub fn is_ready(&self, index: usize) -> bool {
        self.slots
            .get(index)
            .is_some_and(|slot| slot.ready.load(Ordering::Acquire))
    }

    /// Node `index`'s last ready session, if it ever had one.
    pub fn ready_times(&self, index: usize) -> Option<ReadyTimes> {
        let slot = self.slots.get(index)?;
        let ready_ns = slot.ready_ns.load(Ordering::Acquire);
        (ready_ns > 0).then(|| ReadyTimes {
            dialled_ns: slot.dialled_ns.load(Ordering::Acquire),
            ready_ns,
            edge: slot.edge.load(Ordering::Acquire),
        })
    }

    /// The counters since the last call, reset.
    pub fn take_counters(&self) -> Counters {
        Counters {
            attempts: self.attempts.swap(0, Ordering::AcqRel),
            failed: self.failed.swap(0, Ordering::AcqRel),
            tunnels: self.tunnels.swap(0, Ordering::AcqRel),
        }
    }

    /// When probe `seq`'s tunnel request reached its node, taken out.
    pub fn take_probe(&self, seq: u64) -> Option<u64> {
        lock(&self.probes).remove(&seq)
    }

    /// The problems noted so far (the first few, then a count).
    pub fn notes(&self) -> Vec<String> {
        let mut notes = lock(&self.notes).clone();
        let dropped = self.notes_dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            notes.push(format!("… and {dropped} more"));
        }
        notes
    }

    fn note(&self, note: String) {
        let mut notes = lock(&self.notes);
        if notes.len() < MAX_NOTES {
            notes.push(note);
        } else {
            self.notes_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn mark_ready(&self, index: usize, dialled_ns: u64, edge: usize) {
        let Some(slot) = self.slots.get(index) else {
            return;
        };
        slot.edge.store(edge, Ordering::Release);
        slot.dialled_ns.store(dialled_ns, Ordering::Release);
        slot.ready_ns.store(monotonic_raw_ns(), Ordering::Release);
        if !slot.ready.swap(true, Ordering::AcqRel) {
            self.ready_count.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn mark_down(&self, index: usize) {
        if let Some(slot) = self.slots.get(index) {
            if slot.ready.swap(false, Ordering::AcqRel) {
                self.ready_count.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    fn saw_tunnel(&self, request: &pb::ProviderTunnelRequest) {
        self.tunnels.fetch_add(1, Ordering::Relaxed);
        if let Some(seq) = probe_seq(&request.body) {
            lock(&self.probes).insert(seq, monotonic_raw_ns());
        }
    }
}

/// The probe sequence number in a request body (`swarm-probe-<seq>`).
pub fn probe_seq(body: &[u8]) -> Option<u64> {
    let marker = PROBE_MARKER.as_bytes();
    let at = body.windows(marker.len()).position(|w| w == marker)? + marker.len();
    let digits = body[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&body[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

/// The frames answering one tunnel request: `RESPONSE_START` (200), one
/// `BODY` with a chat completion (an SSE stream when the request asked
/// for one) whose content is `served by <node id>`, and `END`.
#[derive(Debug, Clone, PartialEq)]
pub struct TunnelReply {
    /// Status and headers.
    pub start: pb::ProviderTunnelFrame,
    /// The body frame, without its body.
    pub body_frame: pb::ProviderTunnelFrame,
    /// The body.
    pub body: Bytes,
    /// The terminal.
    pub end: pb::ProviderTunnelFrame,
}

/// [`TunnelReply`] for `request` on node `node_id`.
pub fn tunnel_reply(request: &pb::ProviderTunnelRequest, node_id: &str) -> TunnelReply {
    let frame = |seq: u64, kind: pb::TunnelFrameKind| pb::ProviderTunnelFrame {
        run_id: request.run_id.clone(),
        seq,
        kind: kind as i32,
        adapter: request.adapter.clone(),
        target: request.target.clone(),
        ..Default::default()
    };
    let content = format!("{SERVED_BY}{node_id}");
    let (content_type, body) = if request.stream {
        let chunk = serde_json::json!({
            "id": format!("swarm-{}", request.run_id),
            "object": "chat.completion.chunk",
            "created": 0,
            "model": request.target,
            "choices": [{
                "index": 0,
                "delta": {"role": "assistant", "content": content},
                "finish_reason": "stop"
            }]
        });
        (
            "text/event-stream",
            format!("data: {chunk}\n\ndata: [DONE]\n\n"),
        )
    } else {
        let completion = serde_json::json!({
            "id": format!("swarm-{}", request.run_id),
            "object": "chat.completion",
            "created": 0,
            "model": request.target,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop"
            }],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
        });
        ("application/json", completion.to_string())
    };
    let mut start = frame(1, pb::TunnelFrameKind::ResponseStart);
    start.status = 200;
    start.headers = vec![pb::Header {
        name: "content-type".into(),
        value: Bytes::from_static(content_type.as_bytes()),
    }];
    TunnelReply {
        start,
        body_frame: frame(2, pb::TunnelFrameKind::Body),
        body: Bytes::from(body),
        end: frame(3, pb::TunnelFrameKind::End),
    }
}

/// The answer to a node command: `METRICS` (which the Edge sends every
/// node when its `/metrics` is scraped) gets an empty series — a
/// simulated node has none — so a scrape neither waits nor counts an
/// error; every other command is refused, naming why.
pub fn command_reply(request: &pb::NodeCommandRequest) -> pb::NodeCommandResponse {
    let metrics = request.r#type == pb::CommandType::Metrics as i32;
    pb::NodeCommandResponse {
        command_id: request.command_id.clone(),
        ok: metrics,
        error: if metrics {
            String::new()
        } else {
            "a bench swarm node runs no commands but METRICS".into()
        },
        ..Default::default()
    }
}

fn frame(body: Body) -> pb::Frame {
    pb::Frame { body: Some(body) }
}

async fn answer(conn: ConnHandle, request: pb::ProviderTunnelRequest, node_id: Rc<str>) {
    let reply = tunnel_reply(&request, &node_id);
    // A closed connection fails the sends; the Edge has fenced the run.
    if conn
        .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(reply.start))))
        .await
        .is_err()
    {
        return;
    }
    if conn
        .send_body_frame(reply.body_frame, reply.body)
        .await
        .is_err()
    {
        return;
    }
    let _ = conn
        .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(reply.end))))
        .await;
}

/// One session with the Edge at `edges[edge]`, to its end: whether it
/// was ready.
async fn session(
    node: &NodeIdentity,
    node_id: &Rc<str>,
    edge: usize,
    addr: SocketAddr,
    state: &SwarmState,
) -> bool {
    let dialled_ns = monotonic_raw_ns();
    state.attempts.fetch_add(1, Ordering::Relaxed);
    let failed = || {
        state.failed.fetch_add(1, Ordering::Relaxed);
        false
    };
    let Some(connector) = node.connectors.get(edge) else {
        state.note(format!("{}: no connector for Edge {edge}", node.id));
        return failed();
    };
    let Ok(tcp) = http::connect(addr).await else {
        // Refused: the Edge is not (yet, or any more) listening.
        return failed();
    };
    let shutdown = SocketShutdown::for_socket(&tcp);
    let tls = match connector.connect(tcp).await {
        Ok(tls) => tls,
        Err(e) => {
            state.note(format!("{}: TLS handshake failed: {e:?}", node.id));
            return failed();
        }
    };
    let config = match state.policy().1.heartbeat {
        Some((interval, timeout)) => ConnConfig::default().with_heartbeat_timers(interval, timeout),
        None => ConnConfig::default(),
    };
    let (r, w) = tls.into_split();
    let (conn, mut events) = spawn_conn(r, w, shutdown, config);
    let register = pb::RegisterRequest {
        node_id: node.id.clone(),
        node_version: concat!("bench-swarm/", env!("CARGO_PKG_VERSION")).into(),
        // Its answers are far smaller than any window, so it never needs
        // the credit it is granted.
        flow_control: iop_wire::flow::FLOW_CONTROL_V1,
        // It answers tunnels with its own scripted bodies.
        strips_usage_chunk: false,
        // It reads no streamed request body.
        accepts_tunnel_body: false,
        // It runs no embeddings.
        runs_embeddings: false,
    };
    if conn
        .send_control(frame(Body::RegisterRequest(register)))
        .is_err()
    {
        return failed();
    }
    let mut ready = false;
    while let Some(ConnEvent::Frame(f)) = events.recv().await {
        match f.body {
            Some(Body::RegisterResponse(r)) if r.accepted => {
                let request = pb::NodeReadyRequest {
                    node_id: node.id.clone(),
                };
                let _ = conn.send_control(frame(Body::NodeReadyRequest(request)));
            }
            Some(Body::RegisterResponse(r)) => {
                state.note(format!("{}: registration refused: {}", node.id, r.reason));
                conn.close(CloseReason::RegistrationRejected);
            }
            Some(Body::NodeReadyResponse(r)) if r.ready => {
                ready = true;
                state.mark_ready(node.index, dialled_ns, edge);
            }
            Some(Body::NodeReadyResponse(r)) => {
                state.note(format!("{}: ready refused: {}", node.id, r.reason));
                conn.close(CloseReason::NotReady);
            }
            Some(Body::ProviderTunnelRequest(request)) => {
                state.saw_tunnel(&request);
                monoio::spawn(answer(conn.clone(), *request, node_id.clone()));
            }
            Some(Body::NodeCommandRequest(request)) => {
                let reply = command_reply(&request);
                let _ = conn.send_control(frame(Body::NodeCommandResponse(Box::new(reply))));
            }
            // Every tunnel is answered at once; a cancel finds it done.
            Some(Body::CancelRequest(_)) | None => {}
            Some(other) => {
                state.note(format!(
                    "{}: unexpected {} frame",
                    node.id,
                    body_name(&other)
                ));
            }
        }
    }
    if ready {
        state.mark_down(node.index);
        true
    } else {
        failed()
    }
}

/// The Edges a node dials: each Edge's node address as a dial candidate,
/// in Edge order.
pub fn candidates(edges: &[SocketAddr]) -> Vec<Candidate> {
    edges
        .iter()
        .filter_map(|&addr| {
            let entry = EdgeAddr::parse(&addr.to_string()).ok()?;
            Some(Candidate { addr, entry })
        })
        .collect()
}

/// One attempt (node-bin's S1/S2 with several Edges): every Edge in a
/// fresh shuffled order, each tried until one gives a ready session.
async fn attempt(
    node: &NodeIdentity,
    node_id: &Rc<str>,
    edges: &[Candidate],
    order: &mut SplitMix64,
    state: &SwarmState,
) -> AttemptOutcome {
    for candidate in dial_order(edges.to_vec(), order) {
        let Some(edge) = edges.iter().position(|c| c.addr == candidate.addr) else {
            continue;
        };
        if session(node, node_id, edge, candidate.addr, state).await {
            return AttemptOutcome::WasReady;
        }
    }
    AttemptOutcome::Failed
}

/// Runs node `node` forever: the first attempt at once (S1), then another
/// after every attempt under the state's [`DialPolicy`], its jitter drawn
/// from a generator seeded with `seed`, the dial order of each attempt
/// from another.
pub async fn run_node(
    node: NodeIdentity,
    edges: Arc<[SocketAddr]>,
    state: Arc<SwarmState>,
    seed: u64,
) {
    let node_id: Rc<str> = Rc::from(node.id.as_str());
    let edges = candidates(&edges);
    let mut rng = SplitMix64::new(seed);
    // Its own stream, so the jitter draws are those of a single Edge run
    // with the same seed.
    let mut order = SplitMix64::new(seed ^ DIAL_ORDER_SALT);
    let mut current: Option<(u64, Supervisor)> = None;
    loop {
        let outcome = attempt(&node, &node_id, &edges, &mut order, &state).await;
        let (epoch, policy) = state.policy();
        let supervisor = match &mut current {
            Some((e, s)) if *e == epoch => s,
            _ => {
                let reconnect = ReconnectPolicy {
                    interval: policy.interval,
                    attempts: Attempts::Unlimited,
                };
                let s = Supervisor::new(reconnect, policy.jitter, SplitMix64::new(rng.next_u64()));
                &mut current.insert((epoch, s)).1
            }
        };
        match supervisor.on_attempt_end(outcome) {
            Step::RetryAfter(wait) => monoio::time::sleep(wait).await,
            Step::GiveUp => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_edge_is_a_candidate_in_edge_order() {
        let edges: Vec<SocketAddr> = ["127.0.0.1:7001", "127.0.0.1:7002", "[::1]:7003"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let found = candidates(&edges);
        assert_eq!(
            found.iter().map(|c| c.addr).collect::<Vec<_>>(),
            edges,
            "{found:?}"
        );
        assert_eq!(
            found.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
            ["127.0.0.1:7001", "127.0.0.1:7002", "[::1]:7003"]
        );
    }

    #[test]
    fn metrics_commands_get_an_empty_series_and_others_a_refusal() {
        let metrics = pb::NodeCommandRequest {
            command_id: "c-1".into(),
            r#type: pb::CommandType::Metrics as i32,
            ..Default::default()
        };
        assert_eq!(
            command_reply(&metrics),
            pb::NodeCommandResponse {
                command_id: "c-1".into(),
                ok: true,
                ..Default::default()
            }
        );
        let capabilities = pb::NodeCommandRequest {
            command_id: "c-2".into(),
            r#type: pb::CommandType::Capabilities as i32,
            ..Default::default()
        };
        assert_eq!(
            command_reply(&capabilities),
            pb::NodeCommandResponse {
                command_id: "c-2".into(),
                ok: false,
                error: "a bench swarm node runs no commands but METRICS".into(),
                ..Default::default()
            }
        );
    }

    #[test]
    fn probe_numbers_are_found_in_any_body() {
        assert_eq!(
            probe_seq(br#"{"messages":[{"content":"swarm-probe-1234"}]}"#),
            Some(1234)
        );
        assert_eq!(probe_seq(b"swarm-probe-"), None);
        assert_eq!(probe_seq(b"no marker"), None);
        assert_eq!(probe_seq(b"swarm-probe-7x"), Some(7));
    }

    #[test]
    fn a_tunnel_is_answered_with_three_ordered_frames_naming_the_node() {
        let request = pb::ProviderTunnelRequest {
            run_id: "run-9".into(),
            adapter: "mock".into(),
            target: "swarm-target".into(),
            ..Default::default()
        };
        let reply = tunnel_reply(&request, "n00003");
        let seqs: Vec<(u64, i32)> = [&reply.start, &reply.body_frame, &reply.end]
            .iter()
            .map(|f| (f.seq, f.kind))
            .collect();
        assert_eq!(
            seqs,
            [
                (1, pb::TunnelFrameKind::ResponseStart as i32),
                (2, pb::TunnelFrameKind::Body as i32),
                (3, pb::TunnelFrameKind::End as i32)
            ]
        );
        assert_eq!(reply.start.status, 200);
        assert!([&reply.start, &reply.body_frame, &reply.end]
            .iter()
            .all(|f| f.run_id == "run-9" && f.adapter == "mock" && f.target == "swarm-target"));
        let json: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(json["choices"][0]["message"]["content"], "served by n00003");
        assert_eq!(json["object"], "chat.completion");

        let streamed = tunnel_reply(
            &pb::ProviderTunnelRequest {
                stream: true,
                ..request
            },
            "n00003",
        );
        let text = std::str::from_utf8(&streamed.body).unwrap();
        assert!(text.ends_with("\n\ndata: [DONE]\n\n"), "{text}");
        assert!(text.contains(r#""content":"served by n00003""#), "{text}");
        assert_eq!(&streamed.start.headers[0].value[..], b"text/event-stream");
    }

    #[test]
    fn readiness_is_counted_once_per_node_and_policy_changes_bump_the_epoch() {
        let policy = DialPolicy {
            interval: Duration::from_secs(1),
            jitter: Jitter::DEFAULT,
            heartbeat: None,
        };
        let state = SwarmState::new(2, policy);
        assert_eq!(state.ready_count(), 0);
        assert_eq!(state.ready_times(0), None);
        state.mark_ready(0, 5, 0);
        state.mark_ready(0, 6, 2);
        assert_eq!(state.ready_count(), 1);
        assert!(state.is_ready(0) && !state.is_ready(1) && !state.is_ready(9));
        let times = state.ready_times(0).unwrap();
        assert_eq!((times.dialled_ns, times.edge), (6, 2));
        state.mark_down(0);
        state.mark_down(0);
        assert_eq!(state.ready_count(), 0);
        assert!(!state.is_ready(0));
        assert_eq!(state.policy(), (0, policy));
        let changed = DialPolicy {
            jitter: Jitter::NONE,
            ..policy
        };
        state.set_policy(changed);
        assert_eq!(state.policy(), (1, changed));
        for i in 0..MAX_NOTES + 3 {
            state.note(format!("n{i}"));
        }
        let notes = state.notes();
        assert_eq!(notes.len(), MAX_NOTES + 1);
        assert_eq!(notes.last().map(String::as_str), Some("… and 3 more"));
    }
}
