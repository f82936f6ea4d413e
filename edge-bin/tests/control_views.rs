//! What `Control` tells the status page, driven with a manual clock: each
//! node's phase, reported version and the instants it registered, became
//! ready and went away (never its generation: R5, X5); each model's pool,
//! free candidates and queue.

use std::time::{Duration, Instant};

use edge_bin::control::{
    ConnId, Control, ControlModel, ControlNode, ControlProvider, ControlSpec, DispatchKind, Input,
    ModelView, NodePhase, NodeView, Operation, Operations, ProviderKey, RequestId, Tunables,
    NODE_VERSION_CHARS_MAX,
};
use iop_wire::pb;

fn provider(id: &str, capacity: u32) -> ControlProvider {
    ControlProvider {
        id: id.into(),
        adapter: "mock".into(),
        target: "target".into(),
        capacity,
        long_context_capacity: 0,
        response_stall_timeout_ms: 0,
        category: pb::ProviderCategory::LocalInference,
        kind: DispatchKind::Tunnel,
        operations: Operations::for_kind(DispatchKind::Tunnel),
        enabled: true,
    }
}

fn control() -> Control {
    let node = |id: &str, p: &str| ControlNode {
        id: id.into(),
        config: pb::NodeConfigPayload::default(),
        providers: vec![provider(p, 1)],
    };
    let key = |node: &str, p: &str| ProviderKey {
        node_id: node.into(),
        provider_id: p.into(),
    };
    Control::new(ControlSpec {
        nodes: vec![node("a", "pa"), node("b", "pb")],
        models: vec![ControlModel {
            name: "m".into(),
            providers: vec![key("a", "pa"), key("b", "pb")],
            max_queue: 8,
            queue_timeout: Duration::from_secs(60),
            max_attempts: 1,
        }],
        tunables: Tunables::default(),
    })
}

fn view(control: &Control, node_id: &str) -> NodeView {
    control
        .node_views()
        .into_iter()
        .find(|n| n.node_id == node_id)
        .expect("configured node")
}

#[test]
fn node_views_follow_registration_readiness_and_close() {
    let mut c = control();
    let mut out = Vec::new();
    let t0 = iop_engine::clock::now();
    let at = |ms: u64| -> Instant { t0 + Duration::from_millis(ms) };
    let never = NodeView {
        node_id: "a".into(),
        phase: NodePhase::Offline,
        version: String::new(),
        registered_at: None,
        ready_at: None,
        offline_since: None,
    };
    assert_eq!(view(&c, "a"), never);

    let conn = ConnId(7);
    c.handle(
        at(10),
        Input::Register {
            conn,
            tls_name: "a".into(),
            node_id: "a".into(),
        },
        &mut out,
    );
    c.handle(
        at(10),
        Input::NodeVersion {
            conn,
            version: "0.3.1".into(),
            strips_usage_chunk: false,
        },
        &mut out,
    );
    assert_eq!(
        view(&c, "a"),
        NodeView {
            phase: NodePhase::Registered,
            version: "0.3.1".into(),
            registered_at: Some(at(10)),
            ..never.clone()
        }
    );
    let generation = c.generation_of(conn).expect("a generation");

    c.handle(
        at(25),
        Input::Ready {
            conn,
            node_id: "a".into(),
        },
        &mut out,
    );
    assert_eq!(
        view(&c, "a"),
        NodeView {
            phase: NodePhase::Ready,
            version: "0.3.1".into(),
            registered_at: Some(at(10)),
            ready_at: Some(at(25)),
            ..never.clone()
        }
    );
    // A version from a connection that does not own the node changes
    // nothing; a long one is cut.
    c.handle(
        at(30),
        Input::NodeVersion {
            conn: ConnId(99),
            version: "stale".into(),
            strips_usage_chunk: false,
        },
        &mut out,
    );
    assert_eq!(view(&c, "a").version, "0.3.1");
    c.handle(
        at(30),
        Input::NodeVersion {
            conn,
            version: "v".repeat(500),
            strips_usage_chunk: false,
        },
        &mut out,
    );
    assert_eq!(view(&c, "a").version, "v".repeat(NODE_VERSION_CHARS_MAX));

    c.handle(at(40), Input::Closed { conn }, &mut out);
    assert_eq!(
        view(&c, "a"),
        NodeView {
            offline_since: Some(at(40)),
            ..never.clone()
        }
    );

    // A new registration: a new generation, no version until it says one.
    let again = ConnId(8);
    c.handle(
        at(50),
        Input::Register {
            conn: again,
            tls_name: "a".into(),
            node_id: "a".into(),
        },
        &mut out,
    );
    let fresh = view(&c, "a");
    assert_eq!(fresh.phase, NodePhase::Registered);
    assert!(c.generation_of(again) > Some(generation), "{fresh:?}");
    assert_eq!(fresh.version, "");
    assert_eq!(fresh.registered_at, Some(at(50)));
    assert_eq!(fresh.offline_since, None);
}

#[test]
fn model_views_count_free_candidates_and_the_queue() {
    let mut c = control();
    let mut out = Vec::new();
    let now = iop_engine::clock::now();
    let model = |providers, candidates, queued| ModelView {
        model: "m".into(),
        providers,
        candidates,
        queued,
        max_queue: 8,
    };
    assert_eq!(c.model_views(), vec![model(2, 0, 0)], "no node connected");
    for (conn, node) in [(ConnId(1), "a"), (ConnId(2), "b")] {
        c.handle(
            now,
            Input::Register {
                conn,
                tls_name: node.into(),
                node_id: node.into(),
            },
            &mut out,
        );
        c.handle(
            now,
            Input::Ready {
                conn,
                node_id: node.into(),
            },
            &mut out,
        );
    }
    assert_eq!(c.model_views(), vec![model(2, 2, 0)]);
    let submit = |c: &mut Control, out: &mut Vec<_>, id| {
        c.handle(
            now,
            Input::Submit {
                request: RequestId(id),
                model: "m".into(),
                operation: Operation::ChatCompletions,
                long: false,
            },
            out,
        );
    };
    // Capacity 1 each: the first two take the slots, the third waits.
    submit(&mut c, &mut out, 1);
    assert_eq!(c.model_views(), vec![model(2, 1, 0)]);
    submit(&mut c, &mut out, 2);
    submit(&mut c, &mut out, 3);
    assert_eq!(c.model_views(), vec![model(2, 0, 1)]);
    c.handle(now, Input::Closed { conn: ConnId(2) }, &mut out);
    assert_eq!(c.model_views()[0].candidates, 0);
}
