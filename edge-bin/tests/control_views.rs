//! What `Control` tells the status page, driven with a manual clock: each
//! node's phase, reported version and the instants it registered, became
//! ready and went away (never its generation: R5, X5); each model's pool,
//! free candidates and queue; which nodes and providers are drained (by an
//! operator), draining (as their owner said) or removed (by a reload),
//! and that a removed model is in no model view.

use std::time::{Duration, Instant};

/// The model views without their routing counters (routing has tests of
/// its own).
fn views(c: &Control) -> Vec<ModelView> {
    let mut views = c.model_views();
    for view in &mut views {
        view.routing_stats = RoutingStats::default();
    }
    views
}

use edge_bin::control::{
    ConnId, Control, ControlModel, ControlNode, ControlProvider, ControlSpec, DispatchKind,
    DrainTarget, Input, ModelCapacity, ModelView, NodePhase, NodeView, Operation, Operations,
    ProviderKey, ProviderView, RequestId, Tunables, NODE_VERSION_CHARS_MAX,
};
use edge_bin::control::{RouteHint, RoutingPolicy, RoutingSpec, RoutingStats};
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

fn key(node: &str, p: &str) -> ProviderKey {
    ProviderKey {
        node_id: node.into(),
        provider_id: p.into(),
    }
}

fn node(id: &str, p: &str) -> ControlNode {
    ControlNode {
        id: id.into(),
        config: pb::NodeConfigPayload::default(),
        providers: vec![provider(p, 1)],
    }
}

fn model(name: &str, providers: Vec<ProviderKey>) -> ControlModel {
    ControlModel {
        name: name.into(),
        providers,
        max_queue: 8,
        queue_timeout: Duration::from_secs(60),
        max_attempts: 1,
        routing: RoutingSpec::default(),
    }
}

/// Nodes `a` (provider `pa`) and `b` (`pb`), model `m` over both.
fn spec() -> ControlSpec {
    ControlSpec {
        nodes: vec![node("a", "pa"), node("b", "pb")],
        models: vec![model("m", vec![key("a", "pa"), key("b", "pb")])],
        tunables: Tunables::default(),
    }
}

fn control() -> Control {
    Control::new(spec())
}

/// Registers and readies `node` on `conn`.
fn ready(c: &mut Control, now: Instant, conn: ConnId, node: &str) {
    let mut out = Vec::new();
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
        drained: false,
        draining: false,
        removed: false,
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
            runs_embeddings: false,
            accepts_tunnel_body: false,
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
            runs_embeddings: false,
            accepts_tunnel_body: false,
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
            runs_embeddings: false,
            accepts_tunnel_body: false,
        },
        &mut out,
    );
    assert_eq!(view(&c, "a").version, "v".repeat(NODE_VERSION_CHARS_MAX));

    c.handle(
        at(40),
        Input::Closed {
            conn,
            drained: false,
        },
        &mut out,
    );
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
        routing: RoutingPolicy::LeastLoaded,
        routing_stats: RoutingStats::default(),
        tree_bytes: 0,
        tree_budget_bytes: 0,
    };
    assert_eq!(views(&c), vec![model(2, 0, 0)], "no node connected");
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
    assert_eq!(views(&c), vec![model(2, 2, 0)]);
    let submit = |c: &mut Control, out: &mut Vec<_>, id| {
        c.handle(
            now,
            Input::Submit {
                request: RequestId(id),
                model: "m".into(),
                operation: Operation::ChatCompletions,
                long: false,
                hint: RouteHint::default(),
                share: edge_bin::control::fair::Share::default(),
            },
            out,
        );
    };
    // Capacity 1 each: the first two take the slots, the third waits.
    submit(&mut c, &mut out, 1);
    assert_eq!(views(&c), vec![model(2, 1, 0)]);
    submit(&mut c, &mut out, 2);
    submit(&mut c, &mut out, 3);
    assert_eq!(views(&c), vec![model(2, 0, 1)]);
    c.handle(
        now,
        Input::Closed {
            conn: ConnId(2),
            drained: false,
        },
        &mut out,
    );
    assert_eq!(views(&c)[0].candidates, 0);
}

/// `(node_id, provider_id, drained, node_drained, draining, removed)` of
/// every provider view.
fn provider_flags(c: &Control) -> Vec<(String, String, bool, bool, bool, bool)> {
    c.provider_views()
        .into_iter()
        .map(|p: ProviderView| {
            (
                p.node_id,
                p.provider_id,
                p.drained,
                p.node_drained,
                p.draining,
                p.removed,
            )
        })
        .collect()
}

/// `(drained, draining, removed)` of `node_id`'s view.
fn node_flags(c: &Control, node_id: &str) -> (bool, bool, bool) {
    let n = view(c, node_id);
    (n.drained, n.draining, n.removed)
}

#[test]
fn drains_show_in_the_node_and_provider_views() {
    let mut c = control();
    let mut out = Vec::new();
    let now = iop_engine::clock::now();
    ready(&mut c, now, ConnId(1), "a");
    ready(&mut c, now, ConnId(2), "b");
    let flags = |n: &str, p: &str, drained, node_drained, draining| {
        (
            n.to_string(),
            p.to_string(),
            drained,
            node_drained,
            draining,
            false,
        )
    };
    assert_eq!(
        provider_flags(&c),
        [
            flags("a", "pa", false, false, false),
            flags("b", "pb", false, false, false)
        ]
    );
    let pa = DrainTarget::Provider(key("a", "pa"));
    assert_eq!(c.drained(&pa), Some(false));

    // The operator drains provider a/pa: it alone, not its node.
    c.handle(
        now,
        Input::SetDrain {
            target: pa.clone(),
            drained: true,
        },
        &mut out,
    );
    assert_eq!(c.drained(&pa), Some(true));
    assert_eq!(node_flags(&c, "a"), (false, false, false));
    assert_eq!(
        provider_flags(&c),
        [
            flags("a", "pa", true, false, false),
            flags("b", "pb", false, false, false)
        ]
    );
    assert_eq!(views(&c)[0].candidates, 1, "a/pa is no candidate");

    // Node b drained: its provider shows its node's drain.
    let b = DrainTarget::Node("b".into());
    c.handle(
        now,
        Input::SetDrain {
            target: b.clone(),
            drained: true,
        },
        &mut out,
    );
    assert_eq!(c.drained(&b), Some(true));
    assert_eq!(node_flags(&c, "b"), (true, false, false));
    assert_eq!(provider_flags(&c)[1], flags("b", "pb", false, true, false));
    assert_eq!(views(&c)[0].candidates, 0);

    // Node a's owner says it drains: node and provider show it.
    c.handle(now, Input::NodeDraining { conn: ConnId(1) }, &mut out);
    assert_eq!(node_flags(&c, "a"), (false, true, false));
    assert_eq!(provider_flags(&c)[0], flags("a", "pa", true, false, true));

    // Undrained: back as before; a's owner still drains (its own word,
    // for its generation).
    for target in [pa.clone(), b.clone()] {
        c.handle(
            now,
            Input::SetDrain {
                target,
                drained: false,
            },
            &mut out,
        );
    }
    assert_eq!((c.drained(&pa), c.drained(&b)), (Some(false), Some(false)));
    assert_eq!(
        provider_flags(&c),
        [
            flags("a", "pa", false, false, true),
            flags("b", "pb", false, false, false)
        ]
    );
    assert_eq!(views(&c)[0].candidates, 1, "b/pb only");
    // A new registration of a starts undraining.
    c.handle(
        now,
        Input::Closed {
            conn: ConnId(1),
            drained: false,
        },
        &mut out,
    );
    ready(&mut c, now, ConnId(3), "a");
    assert_eq!(node_flags(&c, "a"), (false, false, false));
    assert_eq!(views(&c)[0].candidates, 2);

    // Unknown targets read as nothing.
    assert_eq!(c.drained(&DrainTarget::Node("zz".into())), None);
    assert_eq!(c.drained(&DrainTarget::Provider(key("a", "pb"))), None);
}

#[test]
fn removed_nodes_and_providers_show_and_removed_models_do_not() {
    let mut c = control();
    let mut out = Vec::new();
    let now = iop_engine::clock::now();
    ready(&mut c, now, ConnId(1), "a");
    ready(&mut c, now, ConnId(2), "b");
    // Request 1 runs on a/pa (equal load: the first of the pool).
    c.handle(
        now,
        Input::Submit {
            request: RequestId(1),
            model: "m".into(),
            operation: Operation::ChatCompletions,
            long: false,
            hint: RouteHint::default(),
            share: edge_bin::control::fair::Share::default(),
        },
        &mut out,
    );
    assert_eq!(
        c.leases().map(|l| l.provider.clone()).collect::<Vec<_>>(),
        [key("a", "pa")]
    );
    // A reload keeps only node b, under a new model m2: node a and its
    // provider stay while request 1 runs, removed; model m, kept for
    // request 1, is in no model view.
    c.handle(
        now,
        Input::Reconfigure(Box::new(ControlSpec {
            nodes: vec![node("b", "pb")],
            models: vec![model("m2", vec![key("b", "pb")])],
            tunables: Tunables::default(),
        })),
        &mut out,
    );
    assert_eq!(node_flags(&c, "a"), (false, false, true));
    assert_eq!(node_flags(&c, "b"), (false, false, false));
    assert_eq!(
        provider_flags(&c),
        [
            ("a".into(), "pa".into(), false, false, false, true),
            ("b".into(), "pb".into(), false, false, false, false)
        ]
    );
    assert_eq!(
        views(&c),
        vec![ModelView {
            model: "m2".into(),
            providers: 1,
            candidates: 1,
            queued: 0,
            max_queue: 8,
            routing: RoutingPolicy::LeastLoaded,
            routing_stats: RoutingStats::default(),
            tree_bytes: 0,
            tree_budget_bytes: 0,
        }]
    );
    assert_eq!(c.queue_depths(), vec![("m2".to_string(), 0)]);
    let capacities = c.model_capacities();
    assert_eq!(
        capacities
            .iter()
            .map(|(m, _)| m.as_str())
            .collect::<Vec<_>>(),
        ["m2"]
    );
    assert_eq!(
        capacities[0].1,
        ModelCapacity {
            free_slots: [1; 13],
            queued: 0
        }
    );
    assert!(!c.has_model("m"));
    // Only m2's provider serves a model now, whatever a key may use.
    assert_eq!(c.serves_any(|_| true), [false, true]);
    // A removed node or provider is no drain target.
    assert_eq!(c.drained(&DrainTarget::Node("a".into())), None);
    assert_eq!(c.drained(&DrainTarget::Provider(key("a", "pa"))), None);
    assert_eq!(c.drained(&DrainTarget::Node("b".into())), Some(false));
}
