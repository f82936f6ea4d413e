//! The fleet changing under a running [`Control`], with a manual clock and
//! no sockets: configuration reloads ([`Input::Reconfigure`]) that add,
//! remove and change nodes, providers and models; operator drains
//! ([`Input::SetDrain`]); owners that say they drain
//! ([`Input::NodeDraining`]). Every step's actions are asserted exactly.

use edge_bin::control::{RouteHint, RoutingSpec};
use std::time::{Duration, Instant};

use edge_bin::control::{
    Action, AttemptEnd, CancelReason, ConnId, Control, ControlModel, ControlNode, ControlProvider,
    ControlSpec, Dispatch, DispatchKind, DrainTarget, Event, Input, Operation, Operations, Outcome,
    ProviderKey, ProviderLease, Rejection, RequestId, Terminal, Tunables,
};
use iop_wire::{pb, CloseReason};

const C1: ConnId = ConnId(1);
const C2: ConnId = ConnId(2);
const C3: ConnId = ConnId(3);
const C4: ConnId = ConnId(4);
/// How long a removed node may go on running what it was given.
const GRACE_MS: u64 = 1_000;
/// How long a cancelled run's lease waits for its terminal.
const SETTLE_MS: u64 = 300;
const NOT_CONFIGURED: &str = "is not configured at this edge";

fn provider(id: &str, capacity: u32) -> ControlProvider {
    ControlProvider {
        id: id.into(),
        adapter: format!("adapter-{id}").into(),
        target: format!("target-{id}").into(),
        capacity,
        long_context_capacity: 0,
        response_stall_timeout_ms: 5_000,
        category: pb::ProviderCategory::LocalInference,
        kind: DispatchKind::Tunnel,
        operations: Operations::for_kind(DispatchKind::Tunnel),
        enabled: true,
    }
}

/// The payload node `id` gets at registration.
fn payload(id: &str) -> pb::NodeConfigPayload {
    pb::NodeConfigPayload {
        revision: u64::from(id.as_bytes()[1]),
        ..Default::default()
    }
}

/// Node `id` with `(provider id, capacity)` providers.
fn node(id: &str, providers: &[(&str, u32)]) -> ControlNode {
    ControlNode {
        id: id.into(),
        config: payload(id),
        providers: providers.iter().map(|&(p, c)| provider(p, c)).collect(),
    }
}

/// `"node/provider"`.
fn key(path: &str) -> ProviderKey {
    let (node, provider) = path.split_once('/').expect("node/provider");
    ProviderKey {
        node_id: node.into(),
        provider_id: provider.into(),
    }
}

fn model(name: &str, pool: &[&str], max_queue: u32) -> ControlModel {
    ControlModel {
        name: name.into(),
        providers: pool.iter().map(|p| key(p)).collect(),
        max_queue,
        queue_timeout: Duration::from_secs(60),
        max_attempts: 1,
        routing: RoutingSpec::default(),
    }
}

fn spec(nodes: Vec<ControlNode>, models: Vec<ControlModel>) -> ControlSpec {
    ControlSpec {
        nodes,
        models,
        tunables: Tunables {
            cancel_settle: Duration::from_millis(SETTLE_MS),
            retire_grace: Duration::from_millis(GRACE_MS),
            ..Tunables::default()
        },
    }
}

struct Fixture {
    control: Control,
    base: Instant,
    now: Instant,
    /// The configuration `control` runs with now.
    spec: ControlSpec,
}

impl Fixture {
    fn new(spec: ControlSpec) -> Self {
        let base = iop_engine::clock::now();
        Self {
            control: Control::new(spec.clone()),
            base,
            now: base,
            spec,
        }
    }

    fn handle(&mut self, input: Input) -> Vec<Action> {
        let mut out = Vec::new();
        self.control.handle(self.now, input, &mut out);
        out
    }

    /// Moves the clock to `ms` after the start and runs the timers due.
    fn at(&mut self, ms: u64) -> Vec<Action> {
        self.now = self.base + Duration::from_millis(ms);
        let mut out = Vec::new();
        self.control.handle_timeout(self.now, &mut out);
        out
    }

    fn reload(&mut self, spec: ControlSpec) -> Vec<Action> {
        self.spec = spec.clone();
        self.handle(Input::Reconfigure(Box::new(spec)))
    }

    fn register(&mut self, conn: ConnId, node: &str) -> Vec<Action> {
        self.handle(Input::Register {
            conn,
            tls_name: node.into(),
            node_id: node.into(),
        })
    }

    fn ready(&mut self, conn: ConnId, node: &str) -> Vec<Action> {
        self.handle(Input::Ready {
            conn,
            node_id: node.into(),
        })
    }

    /// Registers `node` on `conn` and makes it ready, with nothing waiting
    /// for it.
    fn connect(&mut self, conn: ConnId, node: &str) {
        assert_eq!(self.register(conn, node), [registered(conn, node)]);
        assert_eq!(self.ready(conn, node), [ready_true(conn), connected(node)]);
    }

    fn submit(&mut self, id: u64, model: &str) -> Vec<Action> {
        self.submit_as(id, model, false)
    }

    fn submit_as(&mut self, id: u64, model: &str, long: bool) -> Vec<Action> {
        self.handle(Input::Submit {
            request: RequestId(id),
            model: model.into(),
            operation: Operation::ChatCompletions,
            long,
            hint: RouteHint::default(),
            share: edge_bin::control::fair::Share::default(),
        })
    }

    fn set_drain(&mut self, target: DrainTarget, drained: bool) -> Vec<Action> {
        self.handle(Input::SetDrain { target, drained })
    }

    /// The answer of request `id`'s live run, on its lease's connection.
    fn terminal(&mut self, id: u64) -> Vec<Action> {
        let lease = self
            .control
            .leases()
            .find(|l| l.request == RequestId(id))
            .unwrap_or_else(|| panic!("request {id} holds no lease"))
            .clone();
        self.handle(Input::Terminal(Terminal {
            conn: lease.conn,
            run_id: lease.run_id,
            adapter: lease.adapter.to_string(),
            target: lease.target.to_string(),
            stall: None,
            end: AttemptEnd::Answered,
            committed: true,
        }))
    }

    /// The dispatch of request `id`'s first attempt to provider `path`
    /// on `conn`, as configured now.
    fn dispatch(&self, id: u64, conn: ConnId, path: &str) -> Action {
        self.dispatch_attempt(id, 1, conn, path)
    }

    /// [`Fixture::dispatch`] of a long-context request.
    fn dispatch_long(&self, id: u64, conn: ConnId, path: &str) -> Action {
        let mut action = self.dispatch(id, conn, path);
        if let Action::Dispatch(d) = &mut action {
            d.lease.long = true;
        }
        action
    }

    fn dispatch_attempt(&self, id: u64, attempt: u32, conn: ConnId, path: &str) -> Action {
        let provider = key(path);
        let spec = self
            .spec
            .nodes
            .iter()
            .find(|n| *n.id == *provider.node_id)
            .and_then(|n| n.providers.iter().find(|p| *p.id == *provider.provider_id))
            .unwrap_or_else(|| panic!("{path} is not configured"));
        let request = RequestId(id);
        Action::Dispatch(Dispatch {
            request,
            lease: ProviderLease {
                request,
                run_id: request.attempt_run_id(attempt),
                provider,
                conn,
                generation: self.control.generation_of(conn).expect("an owner"),
                adapter: spec.adapter.clone(),
                target: spec.target.clone(),
                long: false,
            },
            kind: spec.kind,
            response_stall_timeout_ms: spec.response_stall_timeout_ms,
            strips_usage_chunk: false,
            accepts_tunnel_body: false,
        })
    }

    /// `(capacity, in_flight, queued)` of provider `path` on the status
    /// page; `None` when Control no longer lists it.
    fn occupancy(&self, path: &str) -> Option<(u32, u32, u32)> {
        let key = key(path);
        self.control
            .snapshots()
            .into_iter()
            .find(|s| *s.node_id == *key.node_id && *s.provider_id == *key.provider_id)
            .map(|s| (s.capacity, s.in_flight, s.queued))
    }

    fn waiting(&self) -> Vec<RequestId> {
        self.control.queued_requests()
    }
}

fn registered(conn: ConnId, node: &str) -> Action {
    Action::RegisterResponse {
        conn,
        response: pb::RegisterResponse {
            accepted: true,
            reason: String::new(),
            config: Some(payload(node)),
            accepts_node_draining: true,
        },
    }
}

/// A registration of `node` refused because this Edge does not serve it,
/// and the close that goes with it.
fn not_configured(conn: ConnId, node: &str) -> [Action; 2] {
    [
        Action::RegisterResponse {
            conn,
            response: pb::RegisterResponse {
                accepted: false,
                reason: format!("node `{node}` {NOT_CONFIGURED}"),
                config: None,
                accepts_node_draining: false,
            },
        },
        close(conn, CloseReason::RegistrationRejected),
    ]
}

fn ready_true(conn: ConnId) -> Action {
    Action::ReadyResponse {
        conn,
        response: pb::NodeReadyResponse {
            ready: true,
            reason: String::new(),
        },
    }
}

fn close(conn: ConnId, reason: CloseReason) -> Action {
    Action::Close { conn, reason }
}

fn connected(node: &str) -> Action {
    Action::Event(Event::NodeConnected {
        node_id: node.into(),
    })
}

fn disconnected(node: &str) -> Action {
    Action::Event(Event::NodeDisconnected {
        node_id: node.into(),
    })
}

fn done(id: u64, outcome: Outcome) -> Action {
    Action::Done {
        request: RequestId(id),
        outcome,
    }
}

fn completed(id: u64) -> Action {
    done(id, Outcome::Completed)
}

fn provider_target(path: &str) -> DrainTarget {
    DrainTarget::Provider(key(path))
}

fn node_target(id: &str) -> DrainTarget {
    DrainTarget::Node(id.into())
}

// ---- reloads: what is added --------------------------------------------------

// A node, its provider and a model over it, added by a reload: before it
// the node is refused and the model unknown; after it the node registers
// with its payload, and its first ready serves a request that waited for
// it.
#[test]
fn a_reload_adds_a_node_and_a_model_that_serve_once_the_node_is_ready() {
    let before = spec(
        vec![node("n1", &[("p1", 2)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    let mut f = Fixture::new(before);
    f.connect(C1, "n1");
    assert_eq!(f.register(C2, "n2"), not_configured(C2, "n2"));
    assert_eq!(
        f.handle(Input::Closed {
            conn: C2,
            drained: false
        }),
        []
    );
    assert_eq!(
        f.submit(1, "m2"),
        [done(1, Outcome::Rejected(Rejection::UnknownModel))]
    );

    let after = spec(
        vec![node("n1", &[("p1", 2)]), node("n2", &[("q1", 1)])],
        vec![model("m", &["n1/p1"], 4), model("m2", &["n2/q1"], 4)],
    );
    assert_eq!(f.reload(after), []);
    assert_eq!(f.occupancy("n2/q1"), Some((0, 0, 0)), "listed, offline");
    assert!(f.control.has_drain_target(&node_target("n2")));
    // Known now, with nowhere to go yet: it waits.
    assert_eq!(f.submit(2, "m2"), []);
    assert_eq!(f.waiting(), [RequestId(2)]);
    assert_eq!(f.register(C3, "n2"), [registered(C3, "n2")]);
    assert_eq!(
        f.ready(C3, "n2"),
        [ready_true(C3), connected("n2"), f.dispatch(2, C3, "n2/q1")]
    );
    assert_eq!(f.terminal(2), [completed(2)]);
    // What was there goes on as before.
    assert_eq!(f.submit(3, "m"), [f.dispatch(3, C1, "n1/p1")]);
    assert_eq!(f.submit(4, "m2"), [f.dispatch(4, C3, "n2/q1")]);
}

// Reloading the configuration Control already runs changes nothing:
// leases, waiters, snapshots and timers stay as they are.
#[test]
fn a_reload_of_the_same_configuration_changes_nothing() {
    let same = spec(
        vec![node("n1", &[("p1", 1), ("p2", 1)])],
        vec![model("m", &["n1/p1", "n1/p2"], 4)],
    );
    let mut f = Fixture::new(same.clone());
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    assert_eq!(f.submit(2, "m"), [f.dispatch(2, C1, "n1/p2")]);
    assert_eq!(f.submit(3, "m"), []);
    let snapshots = f.control.snapshots();
    let leases: Vec<ProviderLease> = f.control.leases().cloned().collect();
    let poll = f.control.poll_timeout();
    assert_eq!(f.reload(same), []);
    assert_eq!(f.control.snapshots(), snapshots);
    assert_eq!(f.control.leases().cloned().collect::<Vec<_>>(), leases);
    assert_eq!(f.waiting(), [RequestId(3)]);
    assert_eq!(f.control.poll_timeout(), poll);
    assert_eq!(f.terminal(1), [completed(1), f.dispatch(3, C1, "n1/p1")]);
}

// ---- reloads: providers and capacities ---------------------------------------

// A provider removed while it runs requests keeps them: their terminals
// complete them, nothing new goes to it (a waiter stays queued though it
// has a free slot), and it is listed until a later reload finds it idle.
#[test]
fn a_removed_provider_finishes_its_runs_takes_nothing_new_and_goes_at_a_later_reload() {
    let both = spec(
        vec![node("n1", &[("p1", 1), ("p2", 2)])],
        vec![model("m", &["n1/p1", "n1/p2"], 4)],
    );
    let mut f = Fixture::new(both);
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    assert_eq!(f.submit(2, "m"), [f.dispatch(2, C1, "n1/p2")]);

    let only_p1 = spec(
        vec![node("n1", &[("p1", 1)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    assert_eq!(f.reload(only_p1.clone()), []);
    assert_eq!(f.occupancy("n1/p2"), Some((2, 1, 0)), "kept while it runs");
    assert!(!f.control.has_drain_target(&provider_target("n1/p2")));
    assert_eq!(f.submit(3, "m"), [], "p2 has a free slot but was removed");
    assert_eq!(f.terminal(2), [completed(2)]);
    assert_eq!(f.occupancy("n1/p2"), Some((2, 0, 0)));
    assert_eq!(f.waiting(), [RequestId(3)]);
    // The next reload finds it idle: gone.
    assert_eq!(f.reload(only_p1), []);
    assert_eq!(f.occupancy("n1/p2"), None);
    assert_eq!(f.terminal(1), [completed(1), f.dispatch(3, C1, "n1/p1")]);
}

// A provider removed while it runs and added back by the next reload
// keeps its occupancy: its slots are what the configured capacity leaves.
#[test]
fn a_provider_added_back_while_it_runs_keeps_its_occupancy() {
    let both = spec(
        vec![node("n1", &[("p1", 1), ("p2", 2)])],
        vec![model("m", &["n1/p1", "n1/p2"], 4)],
    );
    let mut f = Fixture::new(both.clone());
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    assert_eq!(f.submit(2, "m"), [f.dispatch(2, C1, "n1/p2")]);
    let only_p1 = spec(
        vec![node("n1", &[("p1", 1)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    assert_eq!(f.reload(only_p1), []);
    assert_eq!(f.submit(3, "m"), []);
    assert_eq!(f.submit(4, "m"), []);
    // Back, with one of its two slots taken: one waiter goes there.
    assert_eq!(f.reload(both), [f.dispatch(3, C1, "n1/p2")]);
    assert_eq!(f.occupancy("n1/p2"), Some((2, 2, 1)));
    assert_eq!(f.terminal(2), [completed(2), f.dispatch(4, C1, "n1/p2")]);
}

// A capacity lowered below what runs cancels nothing; the provider admits
// nothing until its leases are below the new capacity.
#[test]
fn a_capacity_lowered_below_what_runs_cuts_nothing_and_admits_only_below_it() {
    let four = spec(
        vec![node("n1", &[("p1", 4)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    let mut f = Fixture::new(four);
    f.connect(C1, "n1");
    for id in 1..=3 {
        assert_eq!(f.submit(id, "m"), [f.dispatch(id, C1, "n1/p1")]);
    }
    let one = spec(
        vec![node("n1", &[("p1", 1)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    assert_eq!(f.reload(one), []);
    assert_eq!(f.control.leases().count(), 3);
    assert_eq!(f.occupancy("n1/p1"), Some((1, 3, 0)));
    assert_eq!(f.submit(4, "m"), []);
    assert_eq!(f.occupancy("n1/p1"), Some((1, 3, 1)));
    assert_eq!(f.terminal(1), [completed(1)]);
    assert_eq!(f.terminal(2), [completed(2)], "1 in flight: not below 1");
    assert_eq!(f.terminal(3), [completed(3), f.dispatch(4, C1, "n1/p1")]);
    assert_eq!(f.occupancy("n1/p1"), Some((1, 1, 0)));
}

// A long-context capacity lowered below the long runs cuts nothing and
// admits no long request until below it, while the provider's free slots
// go on taking short ones.
#[test]
fn a_long_context_capacity_lowered_below_its_long_runs_still_admits_short_requests() {
    let with_long = |long| {
        let mut p1 = provider("p1", 4);
        p1.long_context_capacity = long;
        spec(
            vec![ControlNode {
                providers: vec![p1],
                ..node("n1", &[])
            }],
            vec![model("m", &["n1/p1"], 4)],
        )
    };
    let mut f = Fixture::new(with_long(2));
    f.connect(C1, "n1");
    assert_eq!(f.submit_as(1, "m", true), [f.dispatch_long(1, C1, "n1/p1")]);
    assert_eq!(f.submit_as(2, "m", true), [f.dispatch_long(2, C1, "n1/p1")]);
    assert_eq!(f.reload(with_long(1)), []);
    assert_eq!(f.submit_as(3, "m", true), []);
    assert_eq!(f.submit(4, "m"), [f.dispatch(4, C1, "n1/p1")]);
    assert_eq!(f.terminal(1), [completed(1)], "1 long run: not below 1");
    assert_eq!(
        f.terminal(2),
        [completed(2), f.dispatch_long(3, C1, "n1/p1")]
    );
}

// A capacity raised admits the waiters it now has room for in the reload
// step itself, in arrival order.
#[test]
fn a_capacity_raised_dispatches_the_waiters_in_the_reload_step() {
    let one = spec(
        vec![node("n1", &[("p1", 1)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    let mut f = Fixture::new(one);
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    for id in 2..=4 {
        assert_eq!(f.submit(id, "m"), []);
    }
    let three = spec(
        vec![node("n1", &[("p1", 3)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    let out = f.reload(three);
    assert_eq!(
        out,
        [f.dispatch(2, C1, "n1/p1"), f.dispatch(3, C1, "n1/p1")]
    );
    assert_eq!(f.waiting(), [RequestId(4)]);
}

// ---- reloads: models --------------------------------------------------------

// A model removed while one of its requests waits and one runs: the
// waiter ends in the reload step (ModelRemoved), the running one completes
// normally, and the model is unknown from then on; another model's waiter
// gets the freed slot.
#[test]
fn a_removed_model_ends_its_waiters_and_lets_its_running_request_finish() {
    let two_models = spec(
        vec![node("n1", &[("p1", 1)])],
        vec![model("m", &["n1/p1"], 4), model("k", &["n1/p1"], 4)],
    );
    let mut f = Fixture::new(two_models);
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    assert_eq!(f.submit(2, "m"), []);
    assert_eq!(f.submit(3, "k"), []);
    let without_m = spec(
        vec![node("n1", &[("p1", 1)])],
        vec![model("k", &["n1/p1"], 4)],
    );
    assert_eq!(
        f.reload(without_m),
        [done(2, Outcome::Rejected(Rejection::ModelRemoved))]
    );
    assert!(!f.control.has_model("m"));
    assert_eq!(
        f.submit(4, "m"),
        [done(4, Outcome::Rejected(Rejection::UnknownModel))]
    );
    assert_eq!(f.terminal(1), [completed(1), f.dispatch(3, C1, "n1/p1")]);
    assert_eq!(f.terminal(3), [completed(3)]);
    assert_eq!(f.control.pending_requests().count(), 0);
}

// A model moved to another provider: its waiters keep their arrival order
// and go to the new pool (in the reload step while it has room); the old
// provider's slot, freed later, no longer serves the model.
#[test]
fn a_model_moved_to_another_pool_keeps_its_waiters_in_arrival_order() {
    let nodes = || vec![node("n1", &[("p1", 1)]), node("n2", &[("q1", 1)])];
    let mut f = Fixture::new(spec(nodes(), vec![model("m", &["n1/p1"], 4)]));
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    for id in 2..=4 {
        assert_eq!(f.submit(id, "m"), []);
    }
    assert_eq!(
        f.reload(spec(nodes(), vec![model("m", &["n2/q1"], 4)])),
        [f.dispatch(2, C2, "n2/q1")]
    );
    assert_eq!(f.occupancy("n2/q1"), Some((1, 1, 2)));
    assert_eq!(f.occupancy("n1/p1"), Some((1, 1, 0)));
    assert_eq!(f.terminal(1), [completed(1)], "p1 is out of m's pool");
    assert_eq!(f.terminal(2), [completed(2), f.dispatch(3, C2, "n2/q1")]);
    assert_eq!(f.terminal(3), [completed(3), f.dispatch(4, C2, "n2/q1")]);
}

// A model's queue above its new `max_queue` loses its newest waiters (as
// if they had come to a full queue); the oldest keep their places.
#[test]
fn a_queue_above_its_new_max_queue_loses_its_newest_waiters() {
    let nodes = || vec![node("n1", &[("p1", 1)])];
    let mut f = Fixture::new(spec(nodes(), vec![model("m", &["n1/p1"], 4)]));
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    for id in 2..=5 {
        assert_eq!(f.submit(id, "m"), []);
    }
    let full = Outcome::Rejected(Rejection::QueueFull);
    assert_eq!(
        f.reload(spec(nodes(), vec![model("m", &["n1/p1"], 2)])),
        [done(5, full.clone()), done(4, full.clone())]
    );
    assert_eq!(f.waiting(), [RequestId(2), RequestId(3)]);
    assert_eq!(f.submit(6, "m"), [done(6, full)]);
    assert_eq!(f.terminal(1), [completed(1), f.dispatch(2, C1, "n1/p1")]);
}

// ---- reloads: nodes ------------------------------------------------------------

/// Nodes `n1` (p1) and `n2` (q1), capacity 1 each, model `m` over both,
/// each ready; request 1 runs on n1/p1, request 2 on n2/q1.
fn two_busy_nodes(max_attempts: u32, p1_capacity: u32) -> Fixture {
    let nodes = vec![node("n1", &[("p1", p1_capacity)]), node("n2", &[("q1", 1)])];
    let m = ControlModel {
        max_attempts,
        routing: RoutingSpec::default(),
        ..model("m", &["n1/p1", "n2/q1"], 4)
    };
    let mut f = Fixture::new(spec(nodes, vec![m]));
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    assert_eq!(f.submit(2, "m"), [f.dispatch(2, C2, "n2/q1")]);
    f
}

/// [`two_busy_nodes`] without n2.
fn without_n2(max_attempts: u32, p1_capacity: u32) -> ControlSpec {
    let m = ControlModel {
        max_attempts,
        routing: RoutingSpec::default(),
        ..model("m", &["n1/p1"], 4)
    };
    spec(vec![node("n1", &[("p1", p1_capacity)])], vec![m])
}

// A node removed while it runs a request keeps its owner until that
// request's terminal, then is closed (`node_removed`) in the same step;
// meanwhile it takes no new work and a registration of it is refused as
// not configured, before and after.
#[test]
fn a_removed_node_is_let_go_of_when_its_last_run_ends() {
    let mut f = two_busy_nodes(1, 1);
    assert_eq!(f.reload(without_n2(1, 1)), []);
    assert_eq!(f.control.ready_conn("n2"), Some(C2), "kept while it runs");
    assert!(!f.control.has_drain_target(&node_target("n2")));
    assert_eq!(
        f.control.poll_timeout(),
        Some(f.base + Duration::from_millis(GRACE_MS))
    );
    assert_eq!(f.register(C3, "n2"), not_configured(C3, "n2"));
    assert_eq!(f.submit(3, "m"), []);
    assert_eq!(
        f.terminal(2),
        [
            completed(2),
            disconnected("n2"),
            close(C2, CloseReason::NodeRemoved)
        ]
    );
    assert_eq!(f.control.ready_conn("n2"), None);
    assert_eq!(
        f.control.poll_timeout(),
        f.control.queue_deadline(RequestId(3)),
        "no grace left to end"
    );
    assert_eq!(
        f.handle(Input::Closed {
            conn: C2,
            drained: false
        }),
        []
    );
    assert_eq!(
        f.handle(Input::Closed {
            conn: C3,
            drained: false
        }),
        []
    );
    assert_eq!(f.register(C4, "n2"), not_configured(C4, "n2"));
    assert_eq!(f.terminal(1), [completed(1), f.dispatch(3, C1, "n1/p1")]);
}

// Removed nodes with nothing in flight are let go of in the reload step:
// a ready owner is fenced (disconnected) and closed, a pending one closed.
#[test]
fn removed_nodes_with_nothing_in_flight_are_let_go_of_in_the_reload_step() {
    let nodes = vec![
        node("n1", &[("p1", 1)]),
        node("n2", &[("q1", 1)]),
        node("n3", &[("r1", 1)]),
    ];
    let mut f = Fixture::new(spec(nodes, vec![model("m", &["n1/p1", "n2/q1"], 4)]));
    f.connect(C1, "n1");
    f.connect(C2, "n2");
    assert_eq!(f.register(C3, "n3"), [registered(C3, "n3")]);
    let only_n1 = spec(
        vec![node("n1", &[("p1", 1)])],
        vec![model("m", &["n1/p1"], 4)],
    );
    assert_eq!(
        f.reload(only_n1),
        [
            disconnected("n2"),
            close(C2, CloseReason::NodeRemoved),
            close(C3, CloseReason::NodeRemoved),
        ]
    );
    assert_eq!(f.control.poll_timeout(), None);
    // A late ready of the pending owner is refused.
    assert_eq!(
        f.ready(C3, "n3"),
        [
            Action::ReadyResponse {
                conn: C3,
                response: pb::NodeReadyResponse {
                    ready: false,
                    reason: "superseded by a newer registration of this node id".into(),
                },
            },
            close(C3, CloseReason::NotReady),
        ]
    );
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
}

// A removed node whose grace ends before its runs do is closed anyway:
// what still runs there is lost (F1 releases each lease once).
#[test]
fn a_removed_node_whose_grace_ends_first_is_closed_and_its_runs_lost() {
    let mut f = two_busy_nodes(1, 1);
    assert_eq!(f.reload(without_n2(1, 1)), []);
    assert_eq!(f.at(GRACE_MS - 1), []);
    assert_eq!(
        f.at(GRACE_MS),
        [
            done(2, Outcome::Lost),
            disconnected("n2"),
            close(C2, CloseReason::NodeRemoved)
        ]
    );
    assert_eq!(f.control.leases().count(), 1);
    assert_eq!(f.control.poll_timeout(), None);
    // Its late terminal is stale.
    let late = Terminal {
        conn: C2,
        run_id: RequestId(2).run_id(),
        adapter: "adapter-q1".into(),
        target: "target-q1".into(),
        stall: None,
        end: AttemptEnd::Answered,
        committed: true,
    };
    assert_eq!(f.handle(Input::Terminal(late)), []);
    assert_eq!(f.terminal(1), [completed(1)]);
}

// With failover, a run cut off by the end of its node's grace before its
// first byte goes on to a provider that stays.
#[test]
fn a_run_cut_off_by_the_end_of_the_grace_fails_over_to_a_provider_that_stays() {
    let mut f = two_busy_nodes(2, 2);
    assert_eq!(f.reload(without_n2(2, 2)), []);
    assert_eq!(
        f.at(GRACE_MS),
        [
            Action::Event(Event::Failover {
                request: RequestId(2),
                from: key("n2/q1"),
                to: key("n1/p1"),
                attempt: 2,
            }),
            f.dispatch_attempt(2, 2, C1, "n1/p1"),
            disconnected("n2"),
            close(C2, CloseReason::NodeRemoved),
        ]
    );
    assert_eq!(f.terminal(2), [completed(2)]);
}

// The last run of a removed node settled by a timer (a cancel whose
// terminal never came) lets the node go in that timer's step, not at the
// end of its grace.
#[test]
fn a_removed_node_whose_last_run_settles_by_timer_is_let_go_of_then() {
    let mut f = two_busy_nodes(1, 1);
    assert_eq!(f.reload(without_n2(1, 1)), []);
    assert_eq!(
        f.handle(Input::Cancel {
            request: RequestId(2),
            reason: CancelReason::ClientDisconnect,
        }),
        [Action::SendCancel {
            conn: C2,
            run_id: RequestId(2).run_id(),
            reason: CancelReason::ClientDisconnect,
        }]
    );
    assert_eq!(
        f.at(SETTLE_MS),
        [
            done(2, Outcome::Cancelled),
            disconnected("n2"),
            close(C2, CloseReason::NodeRemoved)
        ]
    );
    assert_eq!(f.control.poll_timeout(), None);
    assert_eq!(f.at(GRACE_MS), []);
}

// A node removed and added back before its run ends keeps its owner: no
// close, no grace; it serves again.
#[test]
fn a_node_added_back_before_its_run_ends_keeps_its_owner() {
    let mut f = two_busy_nodes(1, 1);
    let both = f.spec.clone();
    assert_eq!(f.reload(without_n2(1, 1)), []);
    assert_eq!(f.submit(3, "m"), []);
    assert_eq!(f.reload(both), []);
    // No grace runs any more: the only timer is request 3's queue deadline.
    let queue_deadline = f.control.queue_deadline(RequestId(3));
    assert!(queue_deadline.is_some());
    assert_eq!(f.control.poll_timeout(), queue_deadline);
    assert_eq!(f.terminal(2), [completed(2), f.dispatch(3, C2, "n2/q1")]);
    assert_eq!(f.control.ready_conn("n2"), Some(C2));
}

// ---- operator drains -----------------------------------------------------------

// A drained provider takes no new dispatch (not even with free slots, nor
// after a reload), its runs complete, and undraining it admits the
// waiters at once.
#[test]
fn a_drained_provider_finishes_its_runs_and_undraining_it_pumps_the_queue() {
    let nodes = |p1| vec![node("n1", &[("p1", p1), ("p2", 2)])];
    let m = || vec![model("m", &["n1/p1", "n1/p2"], 4)];
    let mut f = Fixture::new(spec(nodes(2), m()));
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    assert!(f.control.has_drain_target(&provider_target("n1/p1")));
    assert_eq!(f.set_drain(provider_target("n1/p1"), true), []);
    assert_eq!(f.submit(2, "m"), [f.dispatch(2, C1, "n1/p2")]);
    assert_eq!(f.submit(3, "m"), [f.dispatch(3, C1, "n1/p2")]);
    assert_eq!(f.submit(4, "m"), []);
    assert_eq!(f.terminal(1), [completed(1)], "p1 is drained");
    // Kept across a reload that gives it more room; a second drain and
    // an unknown target change nothing.
    assert_eq!(f.reload(spec(nodes(3), m())), []);
    assert_eq!(f.set_drain(provider_target("n1/p1"), true), []);
    assert_eq!(f.set_drain(provider_target("n1/p9"), false), []);
    assert!(!f.control.has_drain_target(&provider_target("n1/p9")));
    assert_eq!(f.waiting(), [RequestId(4)]);
    assert_eq!(
        f.set_drain(provider_target("n1/p1"), false),
        [f.dispatch(4, C1, "n1/p1")]
    );
    assert_eq!(f.set_drain(provider_target("n1/p1"), false), []);
}

// A drained node stays drained when its owner reconnects (the new
// generation's first ready pumps nothing to it) and across a reload;
// undraining it admits the waiter on its new connection.
#[test]
fn a_drained_node_stays_drained_across_its_reconnect_and_a_reload() {
    let mut f = two_busy_nodes(1, 1);
    assert_eq!(f.set_drain(node_target("n1"), true), []);
    assert_eq!(f.submit(3, "m"), []);
    assert_eq!(f.terminal(1), [completed(1)], "n1 is drained");
    assert_eq!(
        f.handle(Input::Closed {
            conn: C1,
            drained: false
        }),
        [disconnected("n1")]
    );
    assert_eq!(f.register(C3, "n1"), [registered(C3, "n1")]);
    assert_eq!(f.ready(C3, "n1"), [ready_true(C3), connected("n1")]);
    let roomier = spec(
        vec![node("n1", &[("p1", 2)]), node("n2", &[("q1", 1)])],
        vec![model("m", &["n1/p1", "n2/q1"], 5)],
    );
    assert_eq!(f.reload(roomier), []);
    assert_eq!(f.waiting(), [RequestId(3)]);
    assert_eq!(
        f.set_drain(node_target("n1"), false),
        [f.dispatch(3, C3, "n1/p1")]
    );
    assert_eq!(f.submit(4, "m"), [f.dispatch(4, C3, "n1/p1")]);
}

// ---- owners that drain ---------------------------------------------------------

// An owner that says it drains takes no new dispatch under its generation
// while its runs finish; the same word from a connection that no longer
// owns the node changes nothing (F2); a new registration of the node
// starts undrained and gets the waiter.
#[test]
fn a_draining_owner_takes_no_new_work_and_its_successor_does() {
    let mut f = Fixture::new(spec(
        vec![node("n1", &[("p1", 2)])],
        vec![model("m", &["n1/p1"], 4)],
    ));
    f.connect(C1, "n1");
    assert_eq!(f.submit(1, "m"), [f.dispatch(1, C1, "n1/p1")]);
    assert_eq!(f.handle(Input::NodeDraining { conn: C1 }), []);
    assert_eq!(f.handle(Input::NodeDraining { conn: C1 }), []);
    assert_eq!(f.submit(2, "m"), []);
    assert_eq!(f.terminal(1), [completed(1)], "its owner drains");
    assert_eq!(f.control.ready_conn("n1"), Some(C1), "still its owner");
    // Its node reconnects: the new owner is undrained.
    assert_eq!(
        f.register(C2, "n1"),
        [
            registered(C2, "n1"),
            disconnected("n1"),
            close(C1, CloseReason::Superseded)
        ]
    );
    assert_eq!(
        f.ready(C2, "n1"),
        [ready_true(C2), connected("n1"), f.dispatch(2, C2, "n1/p1")]
    );
    // CONTRACT: F2
    let snapshots = f.control.snapshots();
    assert_eq!(f.handle(Input::NodeDraining { conn: C1 }), []);
    assert_eq!(f.handle(Input::NodeDraining { conn: C4 }), []);
    assert_eq!(f.control.snapshots(), snapshots);
    assert_eq!(f.submit(3, "m"), [f.dispatch(3, C2, "n1/p1")]);
    // The new owner drains in turn.
    assert_eq!(f.handle(Input::NodeDraining { conn: C2 }), []);
    assert_eq!(f.terminal(2), [completed(2)]);
    assert_eq!(f.submit(4, "m"), []);
    assert_eq!(f.waiting(), [RequestId(4)]);
}
