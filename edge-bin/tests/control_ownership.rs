//! Ownership of node ids in a cluster, driven through `Control::clustered`
//! with a manual clock: a registration is a claim in etcd answered when its
//! revision comes back; that revision is the generation; a newer revision
//! of the owner key, seen in a grant or a watch event in any order, fences
//! the older generation (F1, F2 across Edges); an Edge without its etcd
//! lease owns nothing. Each test asserts the exact actions of each step.

use edge_bin::control::{RouteHint, RoutingSpec};
use std::time::{Duration, Instant};

use edge_bin::control::{
    Action, ConnId, Control, ControlModel, ControlNode, ControlProvider, ControlSpec, Dispatch,
    DispatchKind, Input, Operation, Operations, Outcome, Ownership, ProviderKey, RequestId,
    Tunables,
};
use iop_wire::{pb, CloseReason};

const NODE: &str = "a";

fn control() -> Control {
    let provider = ControlProvider {
        id: "p".into(),
        adapter: "mock".into(),
        target: "target".into(),
        capacity: 2,
        long_context_capacity: 0,
        response_stall_timeout_ms: 0,
        category: pb::ProviderCategory::LocalInference,
        kind: DispatchKind::Tunnel,
        operations: Operations::for_kind(DispatchKind::Tunnel),
        enabled: true,
    };
    Control::clustered(ControlSpec {
        nodes: vec![ControlNode {
            id: NODE.into(),
            config: pb::NodeConfigPayload::default(),
            providers: vec![provider],
        }],
        models: vec![ControlModel {
            name: "m".into(),
            providers: vec![ProviderKey {
                node_id: NODE.into(),
                provider_id: "p".into(),
            }],
            max_queue: 8,
            queue_timeout: Duration::from_secs(60),
            max_attempts: 1,
            routing: RoutingSpec::default(),
        }],
        tunables: Tunables::default(),
    })
}

struct Driver {
    control: Control,
    now: Instant,
}

impl Driver {
    fn new() -> Self {
        Self {
            control: control(),
            now: iop_engine::clock::now(),
        }
    }

    fn step(&mut self, input: Input) -> Vec<Action> {
        self.now += Duration::from_millis(1);
        let mut out = Vec::new();
        self.control.handle(self.now, input, &mut out);
        out
    }

    fn register(&mut self, conn: u64) -> Vec<Action> {
        self.step(Input::Register {
            conn: ConnId(conn),
            tls_name: NODE.into(),
            node_id: NODE.into(),
        })
    }

    fn granted(&mut self, conn: u64, revision: u64) -> Vec<Action> {
        self.step(Input::OwnershipGranted {
            conn: ConnId(conn),
            node_id: NODE.into(),
            revision,
        })
    }

    fn observed(&mut self, revision: u64, deleted: bool) -> Vec<Action> {
        self.step(Input::OwnerObserved {
            node_id: NODE.into(),
            revision,
            deleted,
        })
    }

    /// Registers `conn` under `revision` and makes it ready.
    fn own(&mut self, conn: u64, revision: u64) {
        assert_eq!(self.register(conn), vec![claim(conn)]);
        assert_eq!(self.granted(conn, revision), vec![accepted(conn)]);
        let ready = self.step(Input::Ready {
            conn: ConnId(conn),
            node_id: NODE.into(),
        });
        assert!(
            matches!(&ready[0], Action::ReadyResponse { response, .. } if response.ready),
            "{ready:?}"
        );
        assert_eq!(self.control.ready_conn(NODE), Some(ConnId(conn)));
    }

    /// Submits request `id` and returns its dispatch.
    fn dispatch(&mut self, id: u64) -> Dispatch {
        let out = self.step(Input::Submit {
            request: RequestId(id),
            model: "m".into(),
            operation: Operation::ChatCompletions,
            long: false,
            hint: RouteHint::default(),
            share: edge_bin::control::fair::Share::default(),
        });
        match out.as_slice() {
            [Action::Dispatch(d)] => d.clone(),
            other => panic!("expected one dispatch, got {other:?}"),
        }
    }
}

fn claim(conn: u64) -> Action {
    Action::ClaimOwnership {
        conn: ConnId(conn),
        node_id: NODE.into(),
    }
}

fn accepted(conn: u64) -> Action {
    Action::RegisterResponse {
        conn: ConnId(conn),
        response: pb::RegisterResponse {
            accepted: true,
            reason: String::new(),
            config: Some(pb::NodeConfigPayload::default()),
            accepts_node_draining: true,
        },
    }
}

fn refused(conn: u64, reason: &str) -> Action {
    Action::RegisterResponse {
        conn: ConnId(conn),
        response: pb::RegisterResponse {
            accepted: false,
            reason: reason.into(),
            config: None,
            accepts_node_draining: false,
        },
    }
}

fn close(conn: u64, reason: CloseReason) -> Action {
    Action::Close {
        conn: ConnId(conn),
        reason,
    }
}

fn release(revision: u64) -> Action {
    Action::ReleaseOwnership {
        node_id: NODE.into(),
        revision,
    }
}

fn lost(request: u64) -> Action {
    Action::Done {
        request: RequestId(request),
        outcome: Outcome::Lost,
    }
}

fn disconnected() -> Action {
    Action::Event(edge_bin::control::Event::NodeDisconnected {
        node_id: NODE.into(),
    })
}

fn up() -> Driver {
    let mut d = Driver::new();
    assert_eq!(d.control.ownership(), Ownership::Cluster);
    assert_eq!(d.step(Input::ClusterSession { up: true }), vec![]);
    d
}

// CONTRACT: R2
#[test]
fn nothing_registers_before_the_edge_holds_its_etcd_lease() {
    let mut d = Driver::new();
    assert_eq!(
        d.register(1),
        vec![
            refused(
                1,
                "this edge cannot reach the cluster store; reconnect (to another edge)"
            ),
            close(1, CloseReason::RegistrationRejected),
        ]
    );
}

// CONTRACT: R2
#[test]
fn a_registration_is_answered_when_its_claim_commits_and_its_revision_is_the_generation() {
    let mut d = up();
    assert_eq!(d.register(1), vec![claim(1)]);
    // Nothing owns the node while the claim is in flight.
    assert_eq!(d.control.generation_of(ConnId(1)), None);
    assert_eq!(d.granted(1, 41), vec![accepted(1)]);
    assert_eq!(d.control.generation_of(ConnId(1)).map(|g| g.0), Some(41));
    // A second Register on the claiming connection is refused (R1).
    assert_eq!(d.register(2), vec![claim(2)]);
    let again = d.step(Input::Register {
        conn: ConnId(2),
        tls_name: NODE.into(),
        node_id: NODE.into(),
    });
    assert_eq!(
        again,
        vec![refused(
            2,
            "connection already registered as node `a`; one node id per connection"
        )]
    );
}

// CONTRACT: F1
#[test]
fn a_newer_claim_seen_by_the_watch_fences_the_generation_and_settles_its_leases_once() {
    let mut d = up();
    d.own(1, 10);
    let run = d.dispatch(1);
    assert_eq!(run.lease.generation.0, 10);
    // Another Edge claimed the node at revision 12.
    assert_eq!(
        d.observed(12, false),
        vec![lost(1), disconnected(), close(1, CloseReason::Superseded)]
    );
    assert_eq!(d.control.ready_conn(NODE), None);
    // The key is the other Edge's: no release. A late terminal changes
    // nothing (F2), and the same event again is old news.
    assert_eq!(d.observed(12, false), vec![]);
    assert_eq!(d.observed(11, true), vec![]);
}

// CONTRACT: F1
#[test]
fn a_deleted_owner_key_means_the_ownership_is_lost() {
    let mut d = up();
    d.own(1, 10);
    assert_eq!(
        d.observed(15, true),
        vec![disconnected(), close(1, CloseReason::OwnershipLost)]
    );
}

#[test]
fn the_watch_may_see_a_claim_before_its_grant_arrives() {
    let mut d = up();
    d.own(1, 10);
    // The node reconnected to this Edge: connection 2 claims.
    assert_eq!(d.register(2), vec![claim(2)]);
    // The watch reports revision 20 (connection 2's own claim) first:
    // connection 1's generation is over.
    assert_eq!(
        d.observed(20, false),
        vec![disconnected(), close(1, CloseReason::Superseded)]
    );
    // Then the grant of the same revision: accepted.
    assert_eq!(d.granted(2, 20), vec![accepted(2)]);
    assert_eq!(d.control.generation_of(ConnId(2)).map(|g| g.0), Some(20));
}

#[test]
fn a_grant_older_than_a_revision_already_seen_is_refused_without_touching_the_newer_key() {
    let mut d = up();
    assert_eq!(d.register(1), vec![claim(1)]);
    d.observed(30, false);
    assert_eq!(
        d.granted(1, 25),
        vec![
            refused(1, "superseded by a newer registration of this node id"),
            close(1, CloseReason::Superseded),
        ]
    );
    assert_eq!(d.control.generation_of(ConnId(1)), None);
}

#[test]
fn an_owner_that_goes_away_releases_its_key_at_its_own_revision() {
    let mut d = up();
    d.own(1, 10);
    let _ = d.dispatch(1);
    assert_eq!(
        d.step(Input::Closed {
            conn: ConnId(1),
            drained: false
        }),
        vec![release(10), lost(1), disconnected()]
    );
}

#[test]
fn a_connection_gone_while_its_claim_was_in_flight_releases_the_key_when_granted() {
    let mut d = up();
    assert_eq!(d.register(1), vec![claim(1)]);
    assert_eq!(
        d.step(Input::Closed {
            conn: ConnId(1),
            drained: false
        }),
        vec![]
    );
    assert_eq!(d.granted(1, 7), vec![release(7)]);
    assert_eq!(d.control.ready_conn(NODE), None);
}

#[test]
fn a_failed_claim_refuses_the_registration() {
    let mut d = up();
    assert_eq!(d.register(1), vec![claim(1)]);
    assert_eq!(
        d.step(Input::OwnershipFailed { conn: ConnId(1) }),
        vec![
            refused(
                1,
                "could not claim the node id in the cluster store; reconnect"
            ),
            close(1, CloseReason::RegistrationRejected),
        ]
    );
}

// CONTRACT: F1
#[test]
fn losing_the_etcd_lease_fences_everything_owned_and_refuses_claims_in_flight() {
    let mut d = up();
    d.own(1, 10);
    let _ = d.dispatch(1);
    // Connection 2 (a second connection of the same node id, as after a
    // redial) is claiming.
    assert_eq!(d.register(2), vec![claim(2)]);
    assert_eq!(
        d.step(Input::ClusterSession { up: false }),
        vec![
            release(10),
            lost(1),
            disconnected(),
            close(1, CloseReason::OwnershipLost),
            refused(
                2,
                "this edge lost its cluster lease; reconnect (to another edge)"
            ),
            close(2, CloseReason::OwnershipLost),
        ]
    );
    // The claim committed after all: its key is released, not owned.
    assert_eq!(d.granted(2, 11), vec![release(11)]);
    // Nothing registers until the lease is back.
    assert_eq!(
        d.register(3),
        vec![
            refused(
                3,
                "this edge cannot reach the cluster store; reconnect (to another edge)"
            ),
            close(3, CloseReason::RegistrationRejected),
        ]
    );
    assert_eq!(d.step(Input::ClusterSession { up: true }), vec![]);
    assert_eq!(d.register(4), vec![claim(4)]);
}

#[test]
fn a_single_edge_never_asks_etcd() {
    let mut d = Driver::new();
    d.control = Control::new(ControlSpec {
        nodes: vec![ControlNode {
            id: NODE.into(),
            config: pb::NodeConfigPayload::default(),
            providers: vec![],
        }],
        ..ControlSpec::default()
    });
    assert_eq!(d.control.ownership(), Ownership::Local);
    // Accepted at once under a local generation; closing releases nothing.
    assert_eq!(d.register(1), vec![accepted(1)]);
    assert_eq!(d.control.generation_of(ConnId(1)).map(|g| g.0), Some(1));
    assert_eq!(
        d.step(Input::Closed {
            conn: ConnId(1),
            drained: false
        }),
        vec![]
    );
}

// A draining cluster member lets go of each node as soon as nothing runs
// on it, so the node registers with another Edge during the drain instead
// of after it.
#[test]
fn a_draining_member_lets_go_of_idle_nodes_at_once_and_of_busy_ones_when_their_runs_end() {
    let mut d = up();
    d.own(1, 10);
    let run = d.dispatch(1);
    // Busy: kept.
    assert_eq!(d.step(Input::Drain), vec![]);
    assert_eq!(d.control.ready_conn(NODE), Some(ConnId(1)));
    // Its run ends (here: never delivered): let go of.
    let out = d.step(Input::Undeliverable {
        request: run.request,
    });
    assert!(
        matches!(&out[0], Action::Done { request, .. } if *request == run.request),
        "{out:?}"
    );
    assert_eq!(
        out[1..],
        [release(10), disconnected(), close(1, CloseReason::Shutdown)]
    );
    assert_eq!(d.control.ready_conn(NODE), None);

    // An idle node: let go of at the drain's first step.
    let mut d = up();
    d.own(2, 20);
    assert_eq!(
        d.step(Input::Drain),
        vec![release(20), disconnected(), close(2, CloseReason::Shutdown)]
    );
}

#[test]
fn a_single_edge_keeps_its_nodes_through_its_drain() {
    let mut d = Driver::new();
    d.control = Control::new(ControlSpec {
        nodes: vec![ControlNode {
            id: NODE.into(),
            config: pb::NodeConfigPayload::default(),
            providers: vec![],
        }],
        ..ControlSpec::default()
    });
    assert_eq!(d.register(1), vec![accepted(1)]);
    assert_eq!(d.step(Input::Drain), vec![]);
    assert_eq!(d.control.generation_of(ConnId(1)).map(|g| g.0), Some(1));
}
