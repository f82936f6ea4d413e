//! Focused tests of the [`Control`] policies around failing attempts, with
//! a manual clock and no sockets: the response-wait deadline (U6),
//! candidates by operation, passive health (outlier ejection) and
//! pre-commit failover.

use edge_bin::control::{RouteHint, RoutingSpec};
use std::time::{Duration, Instant};

use edge_bin::control::outlier::{OutlierPolicy, Readmission};
use edge_bin::control::{
    AbortReason, Action, AttemptEnd, CancelReason, ConnId, Control, ControlModel, ControlNode,
    ControlProvider, ControlSpec, DispatchKind, Event, FailureReason, Input, Operation, Operations,
    Outcome, ProviderKey, Rejection, RequestId, Terminal, Tunables,
};
use iop_wire::pb;

const NODE: &str = "n1";
const CONN: ConnId = ConnId(1);
const NODE_2: &str = "n2";
const CONN_2: ConnId = ConnId(2);
const WAIT_MS: u64 = 1_000;
const SETTLE_MS: u64 = 300;

fn provider(id: &str, kind: DispatchKind) -> ControlProvider {
    ControlProvider {
        id: id.into(),
        adapter: format!("adapter-{id}").into(),
        target: format!("target-{id}").into(),
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

fn model(name: &str, providers: &[&str], max_attempts: u32) -> ControlModel {
    ControlModel {
        name: name.into(),
        providers: providers
            .iter()
            .map(|p| match p.split_once('/') {
                Some((node, provider)) => ProviderKey {
                    node_id: node.into(),
                    provider_id: provider.into(),
                },
                None => key(p),
            })
            .collect(),
        max_queue: 4,
        queue_timeout: Duration::from_secs(10),
        max_attempts,
        routing: RoutingSpec::default(),
    }
}

/// Node `n1` with an Ollama-native provider `o1` and OpenAI-compatible
/// providers `p1`, `p2`, node `n2` with `q1` (capacity 4 each); model `m`
/// over `p1`, `p2`, `mixed` over `o1`, `p1` (in that order), `native`
/// over `o1`, `two` over `n1/p1`, `n2/q1`. `m` and `two` allow
/// `max_attempts` attempts.
struct Fixture {
    control: Control,
    base: Instant,
    now: Instant,
}

impl Fixture {
    fn new(tunables: Tunables) -> Self {
        Self::with_attempts(tunables, 1)
    }

    fn with_attempts(tunables: Tunables, max_attempts: u32) -> Self {
        let spec = ControlSpec {
            nodes: vec![
                ControlNode {
                    id: NODE.into(),
                    config: pb::NodeConfigPayload::default(),
                    providers: vec![
                        provider("o1", DispatchKind::Normalized),
                        provider("p1", DispatchKind::Tunnel),
                        provider("p2", DispatchKind::Tunnel),
                    ],
                },
                ControlNode {
                    id: NODE_2.into(),
                    config: pb::NodeConfigPayload::default(),
                    providers: vec![provider("q1", DispatchKind::Tunnel)],
                },
            ],
            models: vec![
                model("m", &["p1", "p2"], max_attempts),
                model("mixed", &["o1", "p1"], 1),
                model("native", &["o1"], 1),
                model("two", &["n1/p1", "n2/q1"], max_attempts),
            ],
            tunables,
        };
        let base = iop_engine::clock::now();
        let mut f = Self {
            control: Control::new(spec),
            base,
            now: base,
        };
        for (conn, node) in [(CONN, NODE), (CONN_2, NODE_2)] {
            f.handle(Input::Register {
                conn,
                tls_name: node.into(),
                node_id: node.into(),
            });
            f.handle(Input::Ready {
                conn,
                node_id: node.into(),
            });
        }
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
            hint: RouteHint::default(),
            share: edge_bin::control::fair::Share::default(),
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
        self.end(&RequestId(id).run_id(), AttemptEnd::Answered, true)
    }

    /// The terminal of run `run_id` on its lease's connection, ending as
    /// `end`.
    fn end(&mut self, run_id: &str, end: AttemptEnd, committed: bool) -> Vec<Action> {
        let lease = self.control.lease(run_id).expect("a live lease").clone();
        self.handle(Input::Terminal(Terminal {
            conn: lease.conn,
            run_id: run_id.into(),
            adapter: lease.adapter.to_string(),
            target: lease.target.to_string(),
            stall: None,
            end,
            committed,
        }))
    }

    /// The live lease of request `id`, as (run id, provider id).
    fn lease_of(&self, id: u64) -> Option<(String, String)> {
        self.control
            .leases()
            .find(|l| l.request == RequestId(id))
            .map(|l| (l.run_id.clone(), l.provider.provider_id.to_string()))
    }

    fn outlier(&self, provider: &str) -> edge_bin::control::outlier::OutlierState {
        let i = self
            .control
            .snapshots()
            .iter()
            .position(|s| s.provider_id == provider)
            .expect("a provider");
        self.control.outliers()[i].clone()
    }
}

fn dispatched_to(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch(d) => Some(d.lease.provider.provider_id.to_string()),
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

// Embeddings go to an Ollama-native provider only while its node's
// connection said it runs them (`RegisterRequest.runs_embeddings`): an older
// node would run a chat instead. Until then the OpenAI-compatible provider
// of a mixed pool takes them (though the native one is first by pool order),
// a native-only pool queues them, and chat on the native provider goes on;
// once the node says so, the queued request is dispatched to it and the
// mixed pool's ties go to it again by pool order.
#[test]
fn embeddings_go_to_a_native_provider_only_on_a_node_that_runs_them() {
    let mut f = Fixture::new(Tunables::default());
    assert_eq!(
        dispatched_to(&f.submit_to(1, "mixed", Operation::Embeddings)),
        ["p1"]
    );
    f.terminal(1);
    assert_eq!(f.submit_to(2, "native", Operation::Embeddings), []);
    assert_eq!(f.queued("o1"), 1);
    assert_eq!(
        dispatched_to(&f.submit_to(3, "mixed", Operation::ChatCompletions)),
        ["o1"]
    );
    f.terminal(3);
    let out = f.handle(Input::NodeVersion {
        conn: CONN,
        version: "v".into(),
        strips_usage_chunk: true,
        runs_embeddings: true,
        accepts_tunnel_body: false,
    });
    assert_eq!(dispatched_to(&out), ["o1"]);
    assert!(matches!(&out[0], Action::Dispatch(d) if d.request == RequestId(2)));
    f.terminal(2);
    assert_eq!(
        dispatched_to(&f.submit_to(4, "mixed", Operation::Embeddings)),
        ["o1"]
    );
    f.terminal(4);
    // Saying it again changes nothing.
    assert_eq!(
        f.handle(Input::NodeVersion {
            conn: CONN,
            version: "v".into(),
            strips_usage_chunk: true,
            runs_embeddings: true,
            accepts_tunnel_body: false,
        }),
        []
    );
}

// ---- passive health (outlier ejection) ---------------------------------------

const BASE_EJECTION_MS: u64 = 1_000;
const PROBE_MS: u64 = 200;

fn ejecting() -> Tunables {
    Tunables {
        recovery_probe_interval: Duration::from_millis(PROBE_MS),
        outlier: Some(OutlierPolicy {
            consecutive_failures: 2,
            base_ejection_time: Duration::from_millis(BASE_EJECTION_MS),
            max_ejection_time: Duration::from_millis(5 * BASE_EJECTION_MS),
            max_ejection_percent: 50,
        }),
        ..Tunables::default()
    }
}

fn connect_failure() -> AttemptEnd {
    AttemptEnd::Failed(FailureReason::ConnectFailure)
}

fn events(actions: &[Action]) -> Vec<&Event> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Event(e) => Some(e),
            _ => None,
        })
        .collect()
}

/// Submits request `id` to model `m` and fails its attempt (on whichever
/// provider it got) with `end`; returns that provider and the actions.
fn fail_one(f: &mut Fixture, id: u64, end: AttemptEnd) -> (String, Vec<Action>) {
    f.submit(id);
    let (run_id, provider) = f.lease_of(id).expect("dispatched");
    (provider, f.end(&run_id, end, false))
}

// Consecutive failures eject a provider: out of rotation (no dispatch,
// `unavailable` in snapshots) for the base ejection time, with one event;
// the timer takes it back. A success in between starts the count over.
#[test]
fn consecutive_failures_eject_a_provider_until_its_ejection_time_is_over() {
    let mut f = Fixture::new(ejecting());
    assert_eq!(fail_one(&mut f, 1, connect_failure()).0, "p1");
    f.submit(2);
    assert_eq!(f.terminal(2).len(), 1, "p1 answered: the count starts over");
    assert_eq!(f.outlier("p1").consecutive_failures(), 0);
    assert_eq!(fail_one(&mut f, 3, connect_failure()).0, "p1");
    let (_, out) = fail_one(&mut f, 4, connect_failure());
    let ejection = f.outlier("p1").ejection().expect("ejected");
    assert_eq!(
        (ejection.reason, ejection.until - ejection.since),
        (
            FailureReason::ConnectFailure,
            Duration::from_millis(BASE_EJECTION_MS)
        )
    );
    assert_eq!(
        events(&out),
        [&Event::Ejected {
            provider: key("p1"),
            ejection,
            consecutive_failures: 2,
        }]
    );
    let p1 = f
        .control
        .snapshots()
        .into_iter()
        .find(|s| s.provider_id == "p1")
        .unwrap();
    assert_eq!(p1.status, pb::ProviderStatus::Unavailable as i32);
    assert_eq!(f.control.ejected_count(), 1);
    let c = f.control.counters();
    assert_eq!(
        (c.attempt_failures[0], c.ejections[0]),
        (3, 1),
        "by reason: connect_failure"
    );
    // Out of rotation: p2 takes everything, even when p1 would be less
    // loaded.
    for id in 5..8 {
        assert_eq!(dispatched_to(&f.submit(id)), ["p2"]);
    }
    // The timer takes it back (probes before it found nothing: no answer).
    let out = f.at(BASE_EJECTION_MS);
    assert_eq!(
        events(&out),
        [&Event::Readmitted {
            provider: key("p1"),
            via: Readmission::Timer,
        }]
    );
    assert_eq!(f.control.counters().readmissions_timer, 1);
    assert_eq!(dispatched_to(&f.submit(8)), ["p1"]);
}

// A second ejection in a row lasts twice as long.
#[test]
fn a_repeated_ejection_lasts_longer() {
    let mut f = Fixture::new(ejecting());
    fail_one(&mut f, 1, connect_failure());
    fail_one(&mut f, 2, connect_failure());
    f.at(BASE_EJECTION_MS);
    assert!(f.outlier("p1").ejection().is_none());
    fail_one(&mut f, 3, AttemptEnd::Failed(FailureReason::Stalled));
    fail_one(&mut f, 4, AttemptEnd::Failed(FailureReason::UpstreamStatus));
    let e = f.outlier("p1").ejection().expect("ejected again");
    assert_eq!(
        (e.reason, e.until - e.since),
        (
            FailureReason::UpstreamStatus,
            Duration::from_millis(2 * BASE_EJECTION_MS)
        )
    );
}

// Never more than the model's share: with p1 out, p2 (half of `m`) stays
// in rotation however it fails; the suppressed ejection is counted.
#[test]
fn the_last_providers_of_a_model_are_not_ejected() {
    let mut f = Fixture::new(ejecting());
    fail_one(&mut f, 1, connect_failure());
    fail_one(&mut f, 2, connect_failure());
    for id in 3..6 {
        let (provider, out) = fail_one(&mut f, id, connect_failure());
        assert_eq!(provider, "p2");
        assert!(events(&out).is_empty(), "{out:?}");
    }
    assert!(f.outlier("p2").ejection().is_none());
    assert_eq!(f.control.counters().ejections_suppressed, 2);
}

// Refusals and request-shaped failures say nothing about the provider.
#[test]
fn refusals_and_other_failures_are_not_held_against_the_provider() {
    let mut f = Fixture::new(ejecting());
    for id in 1..5 {
        let end = if id % 2 == 0 {
            AttemptEnd::Refused
        } else {
            AttemptEnd::Other
        };
        assert_eq!(fail_one(&mut f, id, end).0, "p1");
    }
    assert_eq!(f.outlier("p1").consecutive_failures(), 0);
    assert_eq!(f.control.counters().attempt_failures, [0; 5]);
}

// While ejected, the provider gets CAPABILITIES probes; a fresh
// `available` answer about exactly its binding re-admits it before its
// ejection time is over.
#[test]
fn a_fresh_available_probe_answer_readmits_early() {
    let mut f = Fixture::new(ejecting());
    fail_one(&mut f, 1, connect_failure());
    fail_one(&mut f, 2, connect_failure());
    let out = f.at(PROBE_MS);
    let [Action::SendCommand { conn, command }] = out.as_slice() else {
        panic!("one probe: {out:?}");
    };
    assert_eq!(
        (*conn, command.r#type, command.adapter.as_str()),
        (CONN, pb::CommandType::Capabilities as i32, "adapter-p1")
    );
    let answer = |seq: u64, status: pb::ProviderHealth| pb::NodeCommandResponse {
        command_id: command.command_id.clone(),
        ok: true,
        capabilities: vec![pb::AdapterCapability {
            adapter_key: "adapter-p1".into(),
            target: "target-p1".into(),
            provider_status: status as i32,
            health_observation_seq: Some(seq),
            ..Default::default()
        }],
        ..Default::default()
    };
    // Unavailable: nothing changes; the next probe goes out later.
    assert_eq!(
        f.handle(Input::CommandResult {
            conn: CONN,
            response: answer(1, pb::ProviderHealth::Unavailable),
        }),
        []
    );
    let out = f.at(2 * PROBE_MS);
    let [Action::SendCommand { command, .. }] = out.as_slice() else {
        panic!("a second probe: {out:?}");
    };
    let command_id = command.command_id.clone();
    let out = f.handle(Input::CommandResult {
        conn: CONN,
        response: pb::NodeCommandResponse {
            command_id,
            ..answer(2, pb::ProviderHealth::Available)
        },
    });
    assert_eq!(
        events(&out),
        [&Event::Readmitted {
            provider: key("p1"),
            via: Readmission::Probe,
        }]
    );
    assert!(f.outlier("p1").ejection().is_none());
    assert_eq!(f.control.counters().readmissions_probe, 1);
    // Back in rotation, and its ejection timer is gone.
    assert_eq!(f.at(BASE_EJECTION_MS), []);
    assert_eq!(dispatched_to(&f.submit(3)), ["p1"]);
}

// ---- pre-commit failover ------------------------------------------------------

fn failover() -> Tunables {
    Tunables {
        response_wait_timeout: Some(Duration::from_millis(WAIT_MS)),
        ..Tunables::default()
    }
}

fn retried(actions: &[Action]) -> Option<(String, String)> {
    actions.iter().find_map(|a| match a {
        Action::Dispatch(d) => Some((
            d.lease.run_id.clone(),
            d.lease.provider.provider_id.to_string(),
        )),
        _ => None,
    })
}

// An attempt that failed before anything reached the client goes to
// another provider under a new run id and lease (the failed one released),
// never the same provider; its answer ends the request once.
#[test]
fn a_failure_before_the_first_byte_is_retried_on_another_provider() {
    let mut f = Fixture::with_attempts(failover(), 2);
    assert_eq!(dispatched_to(&f.submit(1)), ["p1"]);
    let out = f.end(&RequestId(1).run_id(), connect_failure(), false);
    assert_eq!(retried(&out), Some(("run-1.2".into(), "p2".into())));
    assert!(out.iter().all(|a| !matches!(a, Action::Done { .. })));
    assert!(events(&out).contains(&&Event::Failover {
        request: RequestId(1),
        from: key("p1"),
        to: key("p2"),
        attempt: 2,
    }));
    assert_eq!(
        f.control.leases().count(),
        1,
        "the failed lease is released"
    );
    assert_eq!(
        f.end("run-1.2", AttemptEnd::Answered, true),
        [Action::Done {
            request: RequestId(1),
            outcome: Outcome::Completed,
        }]
    );
    assert_eq!(f.control.leases().count(), 0);
    let c = f.control.counters();
    assert_eq!(
        (
            c.failover_eligible,
            c.failover_retried,
            c.failover_recovered
        ),
        (1, 1, 1)
    );
}

// Committed (a byte reached the client, seen by `Committed` or on the
// terminal): never retried, the failure ends the request.
#[test]
fn a_committed_attempt_is_never_retried() {
    let mut f = Fixture::with_attempts(failover(), 3);
    f.submit(1);
    f.handle(Input::Committed {
        conn: CONN,
        run_id: RequestId(1).run_id(),
    });
    let stalled = AttemptEnd::Failed(FailureReason::Stalled);
    let done = |id| Action::Done {
        request: RequestId(id),
        outcome: Outcome::Completed,
    };
    assert_eq!(f.end(&RequestId(1).run_id(), stalled, false), [done(1)]);
    f.submit(2);
    assert_eq!(f.end(&RequestId(2).run_id(), stalled, true), [done(2)]);
    assert_eq!(f.control.counters().failover_ineligible, 2);
    // Not retryable at all: final, whatever the commit state.
    f.submit(3);
    assert_eq!(
        f.end(&RequestId(3).run_id(), AttemptEnd::Other, false),
        [done(3)]
    );
    assert_eq!(f.control.leases().count(), 0);
}

// At most max_attempts attempts, each on a provider not tried yet; a
// refusal (another provider would not share it) is retried too.
#[test]
fn attempts_stop_at_max_attempts_and_never_repeat_a_provider() {
    let mut f = Fixture::with_attempts(failover(), 3);
    f.submit(1);
    let out = f.end(&RequestId(1).run_id(), AttemptEnd::Refused, false);
    assert_eq!(retried(&out), Some(("run-1.2".into(), "p2".into())));
    // Both providers of `m` were tried: no third candidate.
    let out = f.end("run-1.2", connect_failure(), false);
    assert_eq!(
        out,
        [Action::Done {
            request: RequestId(1),
            outcome: Outcome::Completed,
        }]
    );
    assert_eq!(f.control.counters().failover_no_candidate, 1);
    let mut f = Fixture::with_attempts(failover(), 2);
    f.submit(1);
    f.end(&RequestId(1).run_id(), connect_failure(), false);
    let out = f.end("run-1.2", connect_failure(), false);
    assert!(matches!(out.as_slice(), [Action::Done { .. }]), "{out:?}");
    assert_eq!(f.control.counters().failover_exhausted, 1);
}

// A node that disconnects before the first byte: its requests go on to a
// provider of another node (F1 still releases every lease of the fenced
// generation once); a committed one is lost as before.
#[test]
fn a_fenced_attempt_before_the_first_byte_goes_to_another_node() {
    let mut f = Fixture::with_attempts(failover(), 2);
    for id in [1, 2] {
        f.handle(Input::Submit {
            request: RequestId(id),
            model: "two".into(),
            operation: Operation::ChatCompletions,
            long: false,
            hint: RouteHint::default(),
            share: edge_bin::control::fair::Share::default(),
        });
    }
    // Least loaded: 1 on n1/p1, 2 on n2/q1.
    assert_eq!(f.lease_of(1).unwrap().1, "p1");
    assert_eq!(f.lease_of(2).unwrap().1, "q1");
    f.submit(3); // model m, on n1 too
    f.handle(Input::Committed {
        conn: CONN,
        run_id: RequestId(3).run_id(),
    });
    let out = f.handle(Input::Closed {
        conn: CONN,
        drained: false,
    });
    assert_eq!(retried(&out), Some(("run-1.2".into(), "q1".into())));
    assert!(out.contains(&Action::Done {
        request: RequestId(3),
        outcome: Outcome::Lost,
    }));
    assert_eq!(f.control.leases().count(), 2);
    assert_eq!(f.lease_of(1).unwrap(), ("run-1.2".into(), "q1".into()));
}

/// `n1` closes with `Close(drained)` (or not) while `two`'s request 1
/// (on n1/p1, no frame of its response yet), request 3 (on n1/p1, its
/// response started) and `m`'s request 4 (on n1) are dispatched; request 2
/// is on n2/q1. `two` and `m` allow one attempt.
fn close_n1_with_runs_in_flight(drained: bool) -> (Fixture, Vec<Action>) {
    let mut f = Fixture::new(Tunables::default());
    for (id, model) in [(1, "two"), (2, "two"), (3, "two"), (4, "m")] {
        f.submit_to(id, model, Operation::ChatCompletions);
    }
    let on = |f: &Fixture, id| f.lease_of(id).map(|(_, p)| p);
    assert_eq!(
        [1, 2, 3, 4].map(|id| on(&f, id)),
        [Some("p1"), Some("q1"), Some("p1"), Some("p2")].map(|p| p.map(String::from))
    );
    f.handle(Input::Responded {
        conn: CONN,
        run_id: RequestId(3).run_id(),
    });
    let out = f.handle(Input::Closed {
        conn: CONN,
        drained,
    });
    (f, out)
}

// A Node that drained closes with `Close(drained)`: every run it started
// ended before, so a request whose response never started was never
// started there. It is sent again, not as an attempt (here with
// `max_attempts = 1`, where a lost attempt ends its request): to a free
// provider of another node, or back to its queue until the node's next
// process. A request whose response had started is lost as before.
#[test]
fn a_drained_close_sends_again_what_the_node_never_started() {
    let (mut f, out) = close_n1_with_runs_in_flight(true);
    assert_eq!(retried(&out), Some(("run-1.2".into(), "q1".into())));
    assert_eq!(
        out.iter()
            .filter(|a| matches!(a, Action::Done { .. }))
            .collect::<Vec<_>>(),
        [&Action::Done {
            request: RequestId(3),
            outcome: Outcome::Lost,
        }]
    );
    // Request 4 has no candidate but n1: it waits in `m`'s queue.
    assert!(f.control.queue_deadline(RequestId(4)).is_some());
    assert_eq!(f.control.counters().drain_redispatched, 2);
    assert_eq!(f.control.counters().failover_requeued, 0);
    assert_eq!(f.control.counters().failover_retried, 0);
    // n1's next process serves request 4, under a run id of its own.
    let conn = ConnId(7);
    f.handle(Input::Register {
        conn,
        tls_name: NODE.into(),
        node_id: NODE.into(),
    });
    let out = f.handle(Input::Ready {
        conn,
        node_id: NODE.into(),
    });
    assert_eq!(retried(&out), Some(("run-4.2".into(), "p1".into())));
    // Each answers: completed, and neither counts as recovered by a
    // failover (nothing failed).
    for run_id in ["run-1.2", "run-4.2"] {
        let id = if run_id == "run-1.2" { 1 } else { 4 };
        assert_eq!(
            f.end(run_id, AttemptEnd::Answered, true),
            [Action::Done {
                request: RequestId(id),
                outcome: Outcome::Completed,
            }]
        );
    }
    assert_eq!(f.control.counters().failover_recovered, 0);
    assert_eq!(f.control.pending_requests().count(), 1, "request 2 on q1");
}

// Without the node's promise (any other close), the same requests are
// lost attempts: with one attempt allowed each ends.
#[test]
fn any_other_close_loses_every_attempt_in_flight() {
    let (f, out) = close_n1_with_runs_in_flight(false);
    assert_eq!(retried(&out), None);
    let mut ended: Vec<_> = out
        .iter()
        .filter_map(|a| match a {
            Action::Done { request, outcome } => Some((request.0, outcome.clone())),
            _ => None,
        })
        .collect();
    ended.sort_unstable_by_key(|(id, _)| *id);
    assert_eq!(
        ended,
        [(1, Outcome::Lost), (3, Outcome::Lost), (4, Outcome::Lost)]
    );
    assert_eq!(f.control.counters().drain_redispatched, 0);
}

// A heartbeat timeout shuts the node's socket before the shell reports
// the close: the send of a run dispatched just before fails, and its
// undeliverable report can come after the fence queued the request again
// for another attempt. Its client has given up: the request ends there,
// once, and takes no lease when its node is back (no lease for nobody).
#[test]
fn an_undeliverable_report_after_the_fence_ends_the_requeued_request() {
    // CONTRACT: F1, T4
    let mut f = Fixture::with_attempts(failover(), 2);
    f.submit(1);
    assert_eq!(f.lease_of(1).unwrap().1, "p1");
    // The fence comes first: no other candidate, queued again.
    let out = f.handle(Input::Closed {
        conn: CONN,
        drained: false,
    });
    assert!(
        out.iter()
            .all(|a| !matches!(a, Action::Done { .. } | Action::Dispatch(_))),
        "{out:?}"
    );
    assert_eq!(f.control.counters().failover_requeued, 1);
    assert!(f.control.queue_deadline(RequestId(1)).is_some());
    // Then the client's report of the run it could not send.
    assert_eq!(
        f.handle(Input::Undeliverable {
            request: RequestId(1)
        }),
        vec![Action::Done {
            request: RequestId(1),
            outcome: Outcome::Cancelled,
        }]
    );
    assert_eq!(f.control.pending_requests().count(), 0);
    assert_eq!(f.control.poll_timeout(), None);
    assert_eq!(f.queued("p1"), 0);
    // A second report, and the node's return, change nothing for it.
    assert_eq!(
        f.handle(Input::Undeliverable {
            request: RequestId(1)
        }),
        vec![]
    );
    let conn = ConnId(7);
    f.handle(Input::Register {
        conn,
        tls_name: NODE.into(),
        node_id: NODE.into(),
    });
    let out = f.handle(Input::Ready {
        conn,
        node_id: NODE.into(),
    });
    assert_eq!(dispatched_to(&out), Vec::<String>::new());
    assert_eq!(f.control.leases().count(), 0);
    // A request never dispatched is not settled by such a report: only
    // its client's cancel removes it.
    f.handle(Input::Closed {
        conn,
        drained: false,
    });
    f.submit(2);
    assert_eq!(
        f.handle(Input::Undeliverable {
            request: RequestId(2)
        }),
        vec![]
    );
    assert!(f.control.queue_deadline(RequestId(2)).is_some());
}

// A request cancelled by its client, or past its response-wait deadline,
// is not retried.
#[test]
fn no_retry_after_a_cancel_or_past_the_deadline() {
    let mut f = Fixture::with_attempts(failover(), 2);
    f.submit(1);
    f.handle(Input::Cancel {
        request: RequestId(1),
        reason: CancelReason::ClientDisconnect,
    });
    let out = f.end(&RequestId(1).run_id(), connect_failure(), false);
    assert!(matches!(out.as_slice(), [Action::Done { .. }]), "{out:?}");
    // Responded in time, then failed before its first byte after the
    // deadline.
    f.submit(2);
    f.handle(Input::Responded {
        conn: CONN,
        run_id: RequestId(2).run_id(),
    });
    f.at(WAIT_MS + 1);
    let out = f.end(
        &RequestId(2).run_id(),
        AttemptEnd::Failed(FailureReason::Stalled),
        false,
    );
    assert!(matches!(out.as_slice(), [Action::Done { .. }]), "{out:?}");
    assert_eq!(f.control.counters().failover_deadline, 1);
}

// A retry keeps the request's response-wait deadline: the deadline of the
// first dispatch bounds every attempt.
#[test]
fn a_retry_keeps_the_requests_response_deadline() {
    let mut f = Fixture::with_attempts(failover(), 2);
    f.submit(1);
    f.at(WAIT_MS / 2);
    let out = f.end(&RequestId(1).run_id(), connect_failure(), false);
    assert_eq!(retried(&out).unwrap().1, "p2");
    assert_eq!(
        f.control.poll_timeout(),
        Some(f.base + Duration::from_millis(WAIT_MS))
    );
    let out = f.at(WAIT_MS);
    assert!(out.contains(&Action::SendCancel {
        conn: CONN,
        run_id: "run-1.2".into(),
        reason: CancelReason::ResponseWaitTimeout,
    }));
}

// A request lost with its node before its first byte, with no other
// candidate now, waits in its queue again: the same provider takes it
// after the node's reconnect, under the next run id; not reconnected in
// time, it ends at its deadline.
#[test]
fn a_fenced_request_with_no_other_candidate_waits_for_the_reconnect() {
    let mut f = Fixture::with_attempts(failover(), 2);
    f.submit(1);
    f.submit(2);
    assert_eq!(f.lease_of(1).unwrap().1, "p1");
    assert_eq!(f.lease_of(2).unwrap().1, "p2");
    let out = f.handle(Input::Closed {
        conn: CONN,
        drained: false,
    });
    assert!(
        out.iter()
            .all(|a| !matches!(a, Action::Done { .. } | Action::Dispatch(_))),
        "{out:?}"
    );
    assert_eq!(f.control.counters().failover_requeued, 2);
    assert_eq!(f.control.leases().count(), 0);
    assert!(f.control.queue_deadline(RequestId(1)).is_some());
    // Reconnected: both go back to their providers, new run ids.
    let conn = ConnId(7);
    f.handle(Input::Register {
        conn,
        tls_name: NODE.into(),
        node_id: NODE.into(),
    });
    let out = f.handle(Input::Ready {
        conn,
        node_id: NODE.into(),
    });
    let mut runs: Vec<(String, String)> = out
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch(d) => Some((
                d.lease.run_id.clone(),
                d.lease.provider.provider_id.to_string(),
            )),
            _ => None,
        })
        .collect();
    runs.sort();
    assert_eq!(
        runs,
        [
            ("run-1.2".to_string(), "p1".to_string()),
            ("run-2.2".to_string(), "p2".to_string())
        ]
    );
    // A second fence: both attempts used (max 2), so they are lost.
    let out = f.handle(Input::Closed {
        conn,
        drained: false,
    });
    let lost = |id| Action::Done {
        request: RequestId(id),
        outcome: Outcome::Lost,
    };
    assert!(out.contains(&lost(1)) && out.contains(&lost(2)), "{out:?}");
    // Not reconnected in time: the request ends at its deadline.
    f.handle(Input::Register {
        conn: ConnId(9),
        tls_name: NODE.into(),
        node_id: NODE.into(),
    });
    f.handle(Input::Ready {
        conn: ConnId(9),
        node_id: NODE.into(),
    });
    f.submit(4);
    assert_eq!(f.lease_of(4).unwrap().0, RequestId(4).run_id());
    f.handle(Input::Closed {
        conn: ConnId(9),
        drained: false,
    });
    assert_eq!(
        f.control.queue_deadline(RequestId(4)),
        Some(f.base + Duration::from_millis(WAIT_MS))
    );
    let out = f.at(WAIT_MS);
    assert!(
        out.contains(&Action::Done {
            request: RequestId(4),
            outcome: Outcome::Rejected(Rejection::QueueTimeout),
        }),
        "{out:?}"
    );
}
