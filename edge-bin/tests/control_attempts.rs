//! Focused tests of the [`Control`] policies around failing attempts, with
//! a manual clock and no sockets: the response-wait deadline (U6) and
//! candidates by operation.

use std::time::{Duration, Instant};

use edge_bin::control::{
    AbortReason, Action, CancelReason, ConnId, Control, ControlSpec, DispatchKind, Input,
    ModelSpec, NodeSpec, Operation, Operations, Outcome, ProviderKey, ProviderSpec, Rejection,
    RequestId, Terminal, Tunables,
};
use iop_wire::pb;

const NODE: &str = "n1";
const CONN: ConnId = ConnId(1);
const WAIT_MS: u64 = 1_000;
const SETTLE_MS: u64 = 300;

fn provider(id: &str, kind: DispatchKind) -> ProviderSpec {
    ProviderSpec {
        id: id.into(),
        adapter: format!("adapter-{id}"),
        target: format!("target-{id}"),
        capacity: 4,
        long_context_capacity: 0,
        response_stall_timeout_ms: 0,
        category: pb::ProviderCategory::LocalInference,
        kind,
        operations: Operations::for_kind(kind),
        enabled: true,
    }
}

fn key(provider: &str) -> ProviderKey {
    ProviderKey {
        node_id: NODE.into(),
        provider_id: provider.into(),
    }
}

fn model(name: &str, providers: &[&str]) -> ModelSpec {
    ModelSpec {
        name: name.into(),
        providers: providers.iter().map(|p| key(p)).collect(),
        max_queue: 4,
        queue_timeout: Duration::from_secs(10),
    }
}

/// One node `n1` with an Ollama-native provider `o1` and OpenAI-compatible
/// providers `p1`, `p2` (capacity 4 each); model `m` over `p1`, `p2`,
/// `mixed` over `o1`, `p1` (in that order) and `native` over `o1`.
struct Fixture {
    control: Control,
    base: Instant,
    now: Instant,
}

impl Fixture {
    fn new(tunables: Tunables) -> Self {
        let spec = ControlSpec {
            nodes: vec![NodeSpec {
                id: NODE.into(),
                config: pb::NodeConfigPayload::default(),
                providers: vec![
                    provider("o1", DispatchKind::Run),
                    provider("p1", DispatchKind::Tunnel),
                    provider("p2", DispatchKind::Tunnel),
                ],
            }],
            models: vec![
                model("m", &["p1", "p2"]),
                model("mixed", &["o1", "p1"]),
                model("native", &["o1"]),
            ],
            tunables,
        };
        let base = iop_engine::clock::now();
        let mut f = Self {
            control: Control::new(spec),
            base,
            now: base,
        };
        f.handle(Input::Register {
            conn: CONN,
            tls_name: NODE.into(),
            node_id: NODE.into(),
        });
        f.handle(Input::Ready {
            conn: CONN,
            node_id: NODE.into(),
        });
        f
    }

    fn waiting() -> Self {
        Self::new(Tunables {
            cancel_settle: Duration::from_millis(SETTLE_MS),
            response_wait_timeout: Some(Duration::from_millis(WAIT_MS)),
            ..Tunables::default()
        })
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

    fn submit(&mut self, id: u64) -> Vec<Action> {
        self.submit_to(id, "m", Operation::ChatCompletions)
    }

    fn submit_to(&mut self, id: u64, model: &str, operation: Operation) -> Vec<Action> {
        self.handle(Input::Submit {
            request: RequestId(id),
            model: model.into(),
            operation,
            long: false,
        })
    }

    /// `/status`'s `queued` of provider `id`.
    fn queued(&self, id: &str) -> u32 {
        self.control
            .snapshots()
            .iter()
            .find(|s| s.provider_id == id)
            .map(|s| s.queued)
            .expect("a snapshot")
    }

    fn terminal(&mut self, id: u64) -> Vec<Action> {
        let run_id = RequestId(id).run_id();
        let lease = self.control.lease(&run_id).expect("a live lease").clone();
        self.handle(Input::Terminal(Terminal {
            conn: lease.conn,
            run_id,
            adapter: lease.adapter,
            target: lease.target,
            stall: None,
        }))
    }
}

fn dispatched_to(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch(d) => Some(d.lease.provider.provider_id.clone()),
            _ => None,
        })
        .collect()
}

fn timed_out(id: u64) -> Vec<Action> {
    vec![
        Action::SendCancel {
            conn: CONN,
            run_id: RequestId(id).run_id(),
            reason: CancelReason::ResponseWaitTimeout,
        },
        Action::Abort {
            request: RequestId(id),
            reason: AbortReason::ResponseWaitTimeout,
        },
    ]
}

// CONTRACT: U6 — a dispatched request with no response start within the
// response-wait timeout is cancelled on its node with reason
// `response_wait_timeout` and its client told; the lease is released once,
// by the terminal the cancel brings.
#[test]
fn no_response_in_time_cancels_the_run_and_releases_the_lease_once() {
    let mut f = Fixture::waiting();
    assert_eq!(dispatched_to(&f.submit(1)), ["p1"]);
    assert_eq!(
        f.control.poll_timeout(),
        Some(f.base + Duration::from_millis(WAIT_MS))
    );
    assert_eq!(f.at(WAIT_MS - 1), []);
    assert_eq!(f.at(WAIT_MS), timed_out(1)); // CONTRACT: U6
    assert_eq!(f.control.counters().response_wait_timeouts, 1);
    // The lease is held until the cancelled run's terminal…
    assert_eq!(f.control.leases().count(), 1);
    assert_eq!(
        f.terminal(1),
        [Action::Done {
            request: RequestId(1),
            outcome: Outcome::Completed,
        }]
    );
    assert_eq!(f.control.leases().count(), 0);
    // …and nothing fires later: no second cancel, no second end.
    assert_eq!(f.at(WAIT_MS + SETTLE_MS + 1), []);
    assert_eq!(f.control.poll_timeout(), None);
}

// CONTRACT: U6 — without a terminal the lease settles at the
// cancel-settle deadline, once.
#[test]
fn a_timed_out_run_without_terminal_settles_at_the_cancel_deadline() {
    let mut f = Fixture::waiting();
    f.submit(1);
    assert_eq!(f.at(WAIT_MS), timed_out(1));
    assert_eq!(f.at(WAIT_MS + SETTLE_MS - 1), []);
    assert_eq!(
        f.at(WAIT_MS + SETTLE_MS),
        [Action::Done {
            request: RequestId(1),
            outcome: Outcome::Cancelled,
        }]
    );
    assert_eq!(f.control.leases().count(), 0);
    assert_eq!(f.at(10 * WAIT_MS), []);
}

// A response that started ends the wait; a frame on another connection
// does not (H1), nor one for another run.
#[test]
fn only_the_leases_own_response_start_ends_the_wait() {
    let mut f = Fixture::waiting();
    f.submit(1);
    f.submit(2);
    f.handle(Input::Responded {
        conn: ConnId(9),
        run_id: RequestId(1).run_id(),
    });
    f.handle(Input::Responded {
        conn: CONN,
        run_id: RequestId(2).run_id(),
    });
    assert_eq!(f.at(WAIT_MS), timed_out(1));
    assert_eq!(
        f.at(100 * WAIT_MS),
        [Action::Done {
            request: RequestId(1),
            outcome: Outcome::Cancelled,
        }]
    );
    // Request 2 keeps its lease: its response is running.
    assert_eq!(f.control.leases().count(), 1);
    assert_eq!(f.terminal(2).len(), 1);
}

// A client cancel before the deadline takes the wait off: no second
// cancel for the same run.
#[test]
fn a_client_cancel_takes_the_wait_off() {
    let mut f = Fixture::waiting();
    f.submit(1);
    assert_eq!(
        f.handle(Input::Cancel {
            request: RequestId(1),
            reason: CancelReason::ClientDisconnect,
        }),
        [Action::SendCancel {
            conn: CONN,
            run_id: RequestId(1).run_id(),
            reason: CancelReason::ClientDisconnect,
        }]
    );
    // The settle deadline (before the wait's) ends it; the wait's instant
    // brings nothing more.
    assert_eq!(
        f.at(WAIT_MS),
        [Action::Done {
            request: RequestId(1),
            outcome: Outcome::Cancelled,
        }]
    );
    assert_eq!(f.control.poll_timeout(), None);
}

// Without a configured timeout (the contract's default) nothing waits.
#[test]
fn no_timeout_configured_means_no_deadline() {
    let mut f = Fixture::new(Tunables::default());
    f.submit(1);
    assert_eq!(f.control.poll_timeout(), None);
    assert_eq!(f.at(3_600_000), []);
    assert_eq!(f.control.leases().count(), 1);
}

// ---- candidates by operation ------------------------------------------------

// An operation goes only to providers that serve it: on a model mixing an
// Ollama-native provider (listed first, least loaded) with an
// OpenAI-compatible one, chat still takes the first by pool order, while
// responses, messages and count_tokens always go to the OpenAI-compatible
// one — never to the adapter that would answer 400.
#[test]
fn an_operation_is_dispatched_only_to_providers_that_serve_it() {
    let mut f = Fixture::new(Tunables::default());
    assert_eq!(
        dispatched_to(&f.submit_to(1, "mixed", Operation::ChatCompletions)),
        ["o1"]
    );
    for (id, op) in (2..).zip([
        Operation::Responses,
        Operation::Messages,
        Operation::CountTokens,
    ]) {
        // o1 holds one lease, p1 none: o1 is not less loaded, but ties
        // would go to it by pool order; it serves none of these.
        assert_eq!(
            dispatched_to(&f.submit_to(id, "mixed", op)),
            ["p1"],
            "{op:?}"
        );
        f.terminal(id);
    }
}

// The operation's candidates are full: the request waits for one of them
// (counted as queued on that provider only), a later chat request still
// gets the free native provider, and the waiter is admitted when its
// provider frees.
#[test]
fn a_request_waits_for_a_provider_of_its_operation_without_blocking_others() {
    let mut f = Fixture::new(Tunables::default());
    for id in 1..=4 {
        assert_eq!(
            dispatched_to(&f.submit_to(id, "mixed", Operation::Messages)),
            ["p1"]
        );
    }
    assert_eq!(f.submit_to(5, "mixed", Operation::Responses), []);
    assert_eq!((f.queued("p1"), f.queued("o1")), (1, 0));
    assert_eq!(
        dispatched_to(&f.submit_to(6, "mixed", Operation::ChatCompletions)),
        ["o1"]
    );
    let out = f.terminal(2);
    assert_eq!(dispatched_to(&out), ["p1"]);
    assert!(matches!(&out[1], Action::Dispatch(d) if d.request == RequestId(5)));
    assert_eq!((f.queued("p1"), f.queued("o1")), (0, 0));
}

// A model none of whose providers serves the operation refuses it at once.
#[test]
fn a_model_without_a_provider_for_the_operation_refuses_it() {
    let mut f = Fixture::new(Tunables::default());
    for op in [
        Operation::Responses,
        Operation::Messages,
        Operation::CountTokens,
    ] {
        assert_eq!(
            f.submit_to(1, "native", op),
            [Action::Done {
                request: RequestId(1),
                outcome: Outcome::Rejected(Rejection::UnsupportedOperation),
            }]
        );
    }
    assert_eq!(
        dispatched_to(&f.submit_to(1, "native", Operation::ChatCompletions)),
        ["o1"]
    );
}
