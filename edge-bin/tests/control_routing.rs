//! The routing policies of [`Control`] (`[[models]] routing`), with a
//! manual clock and no sockets: `prefix` (match threshold, the imbalance
//! rule, a busy match never waited for, forgetting a fenced or ejected
//! provider, the tree kept across a reload), `session` (affinity, and a
//! removed provider moving only its own sessions), `least_loaded`, and the
//! queue's order under every policy: between keys (weighted fair queueing)
//! and priority classes ([`edge_bin::control::fair`]).

use std::time::{Duration, Instant};

use bytes::Bytes;
use edge_bin::control::fair::{Share, MIN_SHARE_EVERY};
use edge_bin::control::outlier::OutlierPolicy;
use edge_bin::control::prefix::{PrefixTree, PrefixTreeSpec};
use edge_bin::control::routing::session_hash;
use edge_bin::control::{
    Action, AttemptEnd, ConnId, Control, ControlModel, ControlNode, ControlProvider, ControlSpec,
    DispatchKind, FailureReason, Input, ModelView, Operation, Operations, ProviderKey, RequestId,
    RouteHint, RoutingPolicy, RoutingSpec, Terminal, Tunables,
};
use iop_wire::pb;

const CAPACITY: u32 = 8;
const WAIT_MS: u64 = 100;
const N1: ConnId = ConnId(1);
const N2: ConnId = ConnId(2);

fn provider(id: &str) -> ControlProvider {
    ControlProvider {
        id: id.into(),
        adapter: format!("adapter-{id}").into(),
        target: format!("target-{id}").into(),
        capacity: CAPACITY,
        long_context_capacity: 0,
        response_stall_timeout_ms: 0,
        category: pb::ProviderCategory::LocalInference,
        kind: DispatchKind::Tunnel,
        operations: Operations::for_kind(DispatchKind::Tunnel),
        enabled: true,
    }
}

fn routing(policy: RoutingPolicy) -> RoutingSpec {
    RoutingSpec {
        policy,
        tree: PrefixTreeSpec {
            budget_bytes: 1 << 20,
            prefix_bytes_max: 4096,
        },
        match_threshold_pct: 50,
        balance_abs_threshold: 2,
        balance_rel_threshold_pct: 150,
        affinity_wait: Duration::ZERO,
    }
}

fn model(name: &str, pool: &[(&str, &str)], policy: RoutingPolicy) -> ControlModel {
    ControlModel {
        name: name.into(),
        providers: pool
            .iter()
            .map(|(node, p)| ProviderKey {
                node_id: (*node).into(),
                provider_id: (*p).into(),
            })
            .collect(),
        max_queue: 16,
        queue_timeout: Duration::from_secs(10),
        max_attempts: 1,
        routing: routing(policy),
    }
}

const POOL: [(&str, &str); 3] = [("n1", "p1"), ("n1", "p2"), ("n1", "p3")];

/// Node `n1` with `p1`–`p3`, `n2` with `q1` (capacity 8 each); models
/// `pre` (prefix), `ses` (session) and `ll` (least_loaded) over `p1`–`p3`,
/// and `two` (prefix) over `n1/p1` and `n2/q1`.
fn spec(pool: &[(&str, &str)]) -> ControlSpec {
    ControlSpec {
        nodes: vec![
            ControlNode {
                id: "n1".into(),
                config: pb::NodeConfigPayload::default(),
                providers: ["p1", "p2", "p3"].into_iter().map(provider).collect(),
            },
            ControlNode {
                id: "n2".into(),
                config: pb::NodeConfigPayload::default(),
                providers: vec![provider("q1")],
            },
        ],
        models: vec![
            model("pre", pool, RoutingPolicy::Prefix),
            model("ses", pool, RoutingPolicy::Session),
            model("ll", pool, RoutingPolicy::LeastLoaded),
            model("two", &[("n1", "p1"), ("n2", "q1")], RoutingPolicy::Prefix),
        ],
        tunables: Tunables {
            outlier: Some(OutlierPolicy {
                consecutive_failures: 1,
                base_ejection_time: Duration::from_secs(30),
                max_ejection_time: Duration::from_secs(300),
                max_ejection_percent: 50,
            }),
            ..Tunables::default()
        },
    }
}

struct Fixture {
    control: Control,
    now: Instant,
    next: u64,
}

impl Fixture {
    fn new() -> Self {
        let mut f = Self {
            control: Control::new(spec(&POOL)),
            now: iop_engine::clock::now(),
            next: 0,
        };
        for (conn, node) in [(N1, "n1"), (N2, "n2")] {
            f.connect(conn, node);
        }
        f
    }

    /// No imbalance rule: only a full provider is passed over.
    fn without_imbalance_rule() -> Self {
        Self::configured(|_| {})
    }

    /// No imbalance rule, and a request waits up to [`WAIT_MS`] for its
    /// preferred provider.
    fn with_affinity_wait() -> Self {
        Self::configured(|routing| routing.affinity_wait = Duration::from_millis(WAIT_MS))
    }

    fn configured(change: impl Fn(&mut RoutingSpec)) -> Self {
        let mut f = Self::new();
        let mut spec = spec(&POOL);
        for m in &mut spec.models {
            m.routing.balance_abs_threshold = CAPACITY;
            change(&mut m.routing);
        }
        f.handle(Input::Reconfigure(Box::new(spec)));
        f
    }

    /// Model queues of `max_queue` (the floods below fit).
    fn with_queue(max_queue: u32) -> Self {
        let mut f = Self::new();
        let mut spec = spec(&POOL);
        for m in &mut spec.models {
            m.max_queue = max_queue;
            m.queue_timeout = Duration::from_secs(3600);
        }
        f.handle(Input::Reconfigure(Box::new(spec)));
        f
    }

    /// Submits a `ll` request charged `share`: its id and where it went.
    fn submit(&mut self, share: Share) -> (RequestId, Option<String>) {
        self.next += 1;
        let request = RequestId(self.next);
        let out = self.handle(Input::Submit {
            request,
            model: "ll".into(),
            operation: Operation::ChatCompletions,
            long: false,
            hint: RouteHint::default(),
            share,
        });
        (request, dispatched(&out, request))
    }

    /// Moves the clock `ms` on and runs the timers due.
    fn advance(&mut self, ms: u64) -> Vec<Action> {
        self.now += Duration::from_millis(ms);
        let mut out = Vec::new();
        self.control.handle_timeout(self.now, &mut out);
        out
    }

    fn connect(&mut self, conn: ConnId, node: &str) {
        self.handle(Input::Register {
            conn,
            tls_name: node.into(),
            node_id: node.into(),
        });
        self.handle(Input::Ready {
            conn,
            node_id: node.into(),
        });
    }

    fn handle(&mut self, input: Input) -> Vec<Action> {
        self.now += Duration::from_millis(1);
        let mut out = Vec::new();
        self.control.handle(self.now, input, &mut out);
        out
    }

    /// Submits a request for `model` with `hint`: its id, and the provider
    /// it was dispatched to (`None`: it queued).
    fn send(&mut self, model: &str, hint: RouteHint) -> (RequestId, Option<String>) {
        self.next += 1;
        let request = RequestId(self.next);
        let out = self.handle(Input::Submit {
            request,
            model: model.into(),
            operation: Operation::ChatCompletions,
            long: false,
            hint,
            share: edge_bin::control::fair::Share::default(),
        });
        (request, dispatched(&out, request))
    }

    /// Sends and ends at once (answered): where it went.
    fn once(&mut self, model: &str, hint: RouteHint) -> String {
        let (request, to) = self.send(model, hint);
        self.finish(request, AttemptEnd::Answered);
        to.expect("a free provider")
    }

    fn finish(&mut self, request: RequestId, end: AttemptEnd) -> Vec<Action> {
        let lease = self
            .control
            .leases()
            .find(|l| l.request == request)
            .expect("a live lease")
            .clone();
        self.handle(Input::Terminal(Terminal {
            conn: lease.conn,
            run_id: lease.run_id.clone(),
            adapter: lease.adapter.to_string(),
            target: lease.target.to_string(),
            stall: None,
            end,
            committed: false,
        }))
    }

    fn view(&self, model: &str) -> ModelView {
        self.control
            .model_views()
            .into_iter()
            .find(|m| m.model == model)
            .expect("the model's view")
    }
}

fn dispatched(out: &[Action], request: RequestId) -> Option<String> {
    out.iter().find_map(|a| match a {
        Action::Dispatch(d) if d.request == request => {
            Some(d.lease.provider.provider_id.to_string())
        }
        _ => None,
    })
}

fn prompt(text: &str) -> RouteHint {
    RouteHint {
        session: None,
        prompt: Some(Bytes::from(text.to_owned())),
    }
}

fn session(key: &str) -> RouteHint {
    RouteHint {
        session: Some(session_hash(key.as_bytes())),
        prompt: None,
    }
}

const SYSTEM: &str = "[{\"role\":\"system\",\"content\":\"You are a careful assistant.\"}";

#[test]
fn a_prompt_goes_back_to_the_provider_that_served_its_prefix() {
    let mut f = Fixture::new();
    // Nothing known: the least loaded (ties: configured order).
    let (first, to) = f.send("pre", prompt(&format!("{SYSTEM},{{\"u\":\"one\"}}]")));
    assert_eq!(to.as_deref(), Some("p1"));
    // p1 is busier than p2 and p3, yet the next turn, which extends the
    // first prompt, goes there.
    let (second, to) = f.send(
        "pre",
        prompt(&format!("{SYSTEM},{{\"u\":\"one\"}},{{\"a\":\"x\"}}]")),
    );
    assert_eq!(to.as_deref(), Some("p1"));
    let stats = f.view("pre").routing_stats;
    assert_eq!((stats.by_load, stats.by_match, stats.by_session), (1, 1, 0));
    // Matched lengths: 0 for the first, the whole first prompt but its
    // last byte for the second.
    let whole = format!("{SYSTEM},{{\"u\":\"one\"}}").len() as u64;
    assert_eq!(stats.matched_bytes_sum, whole);
    assert_eq!(stats.matched_bytes.iter().sum::<u64>(), 2);
    assert_eq!(stats.matched_bytes[0], 1, "the first matched nothing");
    f.finish(first, AttemptEnd::Answered);
    f.finish(second, AttemptEnd::Answered);
    // An unrelated prompt matches under the threshold: the least loaded.
    let (_, to) = f.send(
        "pre",
        prompt("{\"something\":\"else entirely, and long enough\"}"),
    );
    assert_eq!(to.as_deref(), Some("p1"), "all idle: configured order");
    let (_, to) = f.send(
        "pre",
        prompt("{\"another\":\"unrelated prompt of some length\"}"),
    );
    assert_eq!(
        to.as_deref(),
        Some("p2"),
        "the least loaded, not p1's short match"
    );
    assert!(f.view("pre").tree_bytes > PrefixTree::EMPTY_BYTES);
}

#[test]
fn the_match_must_cover_the_threshold_share_of_the_prompt() {
    let mut f = Fixture::new();
    let (_, to) = f.send("pre", prompt("abcdefghij"));
    assert_eq!(to.as_deref(), Some("p1"));
    // 5 of 10 bytes match (50 %): by match, to the busier p1.
    let (_, to) = f.send("pre", prompt("abcde12345"));
    assert_eq!(to.as_deref(), Some("p1"));
    // 4 of 10 (40 %): by load.
    let (_, to) = f.send("pre", prompt("abcd123456"));
    assert_eq!(to.as_deref(), Some("p2"));
    let stats = f.view("pre").routing_stats;
    assert_eq!((stats.by_load, stats.by_match), (2, 1));
}

#[test]
fn a_match_too_busy_beside_an_idle_provider_is_passed_over() {
    let mut f = Fixture::new();
    let text = "{\"the same\":\"conversation, over and over\"}";
    // p1 takes 3: the third goes there with 2 in flight (2 > 0 + 2 is
    // false: not too busy).
    for _ in 0..3 {
        assert_eq!(f.send("pre", prompt(text)).1.as_deref(), Some("p1"));
    }
    // With 3 in flight against 0 (3 > 0 + 2 and 300 % > 150 %), the
    // imbalance rule sends it to the least loaded.
    assert_eq!(f.send("pre", prompt(text)).1.as_deref(), Some("p2"));
    let stats = f.view("pre").routing_stats;
    assert_eq!(
        (stats.by_load, stats.by_match, stats.imbalance_fallbacks),
        (2, 2, 1)
    );
    // p2 now holds the prompt too: the next goes to the least loaded of
    // the two holders.
    assert_eq!(f.send("pre", prompt(text)).1.as_deref(), Some("p2"));
}

#[test]
fn a_full_match_is_never_waited_for_while_another_provider_is_free() {
    let mut f = Fixture::without_imbalance_rule();
    let text = "{\"pinned\":\"by its prefix to p1 until p1 is full\"}";
    for _ in 0..CAPACITY {
        assert_eq!(f.send("pre", prompt(text)).1.as_deref(), Some("p1"));
    }
    assert_eq!(f.send("pre", prompt(text)).1.as_deref(), Some("p2"));
}

#[test]
fn a_fenced_or_ejected_provider_is_forgotten() {
    let mut f = Fixture::new();
    let text = "{\"served by q1\":\"and only by q1, as the first request\"}";
    // Fill p1 so the first request goes to q1.
    let (held, _) = f.send("two", prompt("{\"busy\":\"p1\"}"));
    assert_eq!(f.once("two", prompt(text)), "q1");
    f.finish(held, AttemptEnd::Answered);
    let learned = f.view("two").tree_bytes;
    // n2 goes away: q1's prefixes go with it.
    f.handle(Input::Closed {
        conn: N2,
        drained: false,
    });
    assert!(f.view("two").tree_bytes < learned);
    f.connect(ConnId(3), "n2");
    assert_eq!(
        f.once("two", prompt(text)),
        "p1",
        "nothing known: configured order"
    );
    // p1 holds it now; an ejection (one failure in a row) forgets p1.
    let (failing, to) = f.send("two", prompt(text));
    assert_eq!(to.as_deref(), Some("p1"));
    let out = f.finish(failing, AttemptEnd::Failed(FailureReason::ConnectFailure));
    assert!(
        out.iter()
            .any(|a| matches!(a, Action::Event(edge_bin::control::Event::Ejected { .. }))),
        "{out:?}"
    );
    assert_eq!(f.view("two").tree_bytes, PrefixTree::EMPTY_BYTES);
}

#[test]
fn a_session_stays_on_its_provider_and_a_removed_provider_moves_only_its_sessions() {
    let mut f = Fixture::new();
    let keys: Vec<String> = (0..120).map(|i| format!("conversation-{i}")).collect();
    let before: Vec<String> = keys.iter().map(|k| f.once("ses", session(k))).collect();
    // Spread over the pool, and the same again (affinity), whatever the load.
    for p in ["p1", "p2", "p3"] {
        assert!(
            before.iter().filter(|&to| to == p).count() >= 20,
            "{p}: {before:?}"
        );
    }
    let (held, _) = f.send("ll", RouteHint::default());
    let again: Vec<String> = keys.iter().map(|k| f.once("ses", session(k))).collect();
    assert_eq!(again, before);
    f.finish(held, AttemptEnd::Answered);
    // p3 leaves the pool: its sessions move, no other does.
    f.handle(Input::Reconfigure(Box::new(spec(&POOL[..2]))));
    let after: Vec<String> = keys.iter().map(|k| f.once("ses", session(k))).collect();
    for ((key, was), now) in keys.iter().zip(&before).zip(&after) {
        if was == "p3" {
            assert_ne!(now, "p3", "{key}");
        } else {
            assert_eq!(now, was, "{key} moved");
        }
    }
    // Without a key: the least loaded.
    let (_, to) = f.send("ses", RouteHint::default());
    assert_eq!(to.as_deref(), Some("p1"));
    let stats = f.view("ses").routing_stats;
    assert_eq!(stats.by_load, 1);
    assert_eq!(stats.by_session, 360);
}

#[test]
fn a_busy_sessions_provider_hands_it_on_and_the_session_follows() {
    let mut f = Fixture::without_imbalance_rule();
    let key = "a-busy-session";
    let home = f.once("ses", session(key));
    // Fill its provider: the session stays there while it has a slot.
    let mut held = Vec::new();
    while f.view("ses").candidates == 3 {
        let (r, to) = f.send("ses", session(key));
        held.push(r);
        assert_eq!(to.as_deref(), Some(home.as_str()));
    }
    // Full (and no affinity wait): the next in the session's order takes it,
    // and is its home from then on (it served the session last: its cache
    // holds the session's latest prefix), also once the first has room.
    let (r, next) = f.send("ses", session(key));
    let next = next.expect("a free provider");
    assert_ne!(next, home);
    f.finish(r, AttemptEnd::Answered);
    for r in held {
        f.finish(r, AttemptEnd::Answered);
    }
    assert_eq!(f.once("ses", session(key)), next);
}

// Consistent hashing with bounded loads: whatever the keys' hashes, no
// provider takes more than 125 % of the average of the new sessions.
#[test]
fn new_sessions_are_spread_within_the_load_bound() {
    let mut f = Fixture::new();
    let mut per_provider = std::collections::HashMap::<String, usize>::new();
    for i in 0..12 {
        *per_provider
            .entry(f.once("ses", session(&format!("conversation-{i}"))))
            .or_default() += 1;
    }
    // 12 sessions over 3: at most ceil(1.25 × 12 / 3) = 5 each.
    assert!(per_provider.values().all(|&n| n <= 5), "{per_provider:?}");
    assert_eq!(per_provider.values().sum::<usize>(), 12);
}

#[test]
fn least_loaded_ignores_every_hint() {
    let mut f = Fixture::new();
    let text = "{\"a prompt\":\"p1 would hold under prefix\"}";
    assert_eq!(f.send("ll", prompt(text)).1.as_deref(), Some("p1"));
    assert_eq!(f.send("ll", prompt(text)).1.as_deref(), Some("p2"));
    assert_eq!(f.send("ll", session("s")).1.as_deref(), Some("p3"));
    let view = f.view("ll");
    assert_eq!(view.routing, RoutingPolicy::LeastLoaded);
    assert_eq!(view.routing_stats.by_load, 3);
    assert_eq!((view.tree_bytes, view.tree_budget_bytes), (0, 0));
}

#[test]
fn a_reload_keeps_what_the_tree_learned() {
    let mut f = Fixture::new();
    let text = "{\"learned\":\"before the reload, by p1\"}";
    let (held, to) = f.send("pre", prompt(text));
    assert_eq!(to.as_deref(), Some("p1"));
    let learned = f.view("pre").tree_bytes;
    f.handle(Input::Reconfigure(Box::new(spec(&POOL))));
    assert_eq!(f.view("pre").tree_bytes, learned);
    assert_eq!(f.view("pre").routing_stats.by_load, 1, "counters carried");
    // p1 is busier, and still chosen by the match.
    assert_eq!(f.send("pre", prompt(text)).1.as_deref(), Some("p1"));
    f.finish(held, AttemptEnd::Answered);
    // A pool without p1: what p1 held is forgotten.
    f.handle(Input::Reconfigure(Box::new(spec(&POOL[1..]))));
    assert_eq!(f.view("pre").tree_bytes, PrefixTree::EMPTY_BYTES);
}

#[test]
fn queued_requests_are_admitted_in_arrival_order_whatever_they_prefer() {
    let mut f = Fixture::new();
    // p1 holds prompt A; then every slot fills.
    let a = "{\"prompt A\":\"the one p1 served first of all\"}";
    let b = "{\"prompt B\":\"one nobody served before now\"}";
    let mut held = vec![f.send("pre", prompt(a)).0];
    while f.view("pre").candidates > 0 {
        held.push(f.send("pre", prompt(b)).0);
    }
    // Three wait: B, A, B.
    let waiting: Vec<RequestId> = [b, a, b]
        .into_iter()
        .map(|text| {
            let (r, to) = f.send("pre", prompt(text));
            assert_eq!(to, None);
            r
        })
        .collect();
    assert_eq!(f.view("pre").queued, 3);
    // Whichever slot frees, the head goes first.
    let p3_request = *held
        .iter()
        .find(|&&r| {
            f.control
                .leases()
                .any(|l| l.request == r && *l.provider.provider_id == *"p3")
        })
        .expect("a lease on p3");
    let out = f.finish(p3_request, AttemptEnd::Answered);
    assert_eq!(dispatched(&out, waiting[0]).as_deref(), Some("p3"));
    let p1_request = held[0];
    let out = f.finish(p1_request, AttemptEnd::Answered);
    assert_eq!(dispatched(&out, waiting[1]).as_deref(), Some("p1"));
    assert_eq!(f.view("pre").queued, 1);
}

/// Fills p1 with `CAPACITY` requests of `text` (all by match once the
/// first is there); their ids.
fn fill_p1(f: &mut Fixture, model: &str, hint: &RouteHint) -> Vec<RequestId> {
    (0..CAPACITY)
        .map(|_| {
            let (r, to) = f.send(model, hint.clone());
            assert_eq!(to.as_deref(), Some("p1"));
            r
        })
        .collect()
}

#[test]
fn a_request_waits_a_while_for_its_full_provider_and_others_go_on() {
    let mut f = Fixture::with_affinity_wait();
    let a = prompt("{\"conversation A\":\"whose prefix p1 holds, and p1 is full\"}");
    let held = fill_p1(&mut f, "pre", &a);
    // p2 and p3 are free, yet the next turn of A waits for p1...
    let (waiting, to) = f.send("pre", a.clone());
    assert_eq!(to, None);
    assert_eq!(f.view("pre").queued, 1);
    // ...and does not hold up a request that prefers nothing.
    let (_, to) = f.send(
        "pre",
        prompt("{\"conversation B\":\"new, held by nobody at all\"}"),
    );
    assert_eq!(to.as_deref(), Some("p2"));
    // A slot of p1 frees within the wait: it is the waiting request's.
    let out = f.finish(held[3], AttemptEnd::Answered);
    assert_eq!(dispatched(&out, waiting).as_deref(), Some("p1"));
    let stats = f.view("pre").routing_stats;
    assert_eq!((stats.affinity_waits, stats.affinity_waits_expired), (1, 0));
    assert_eq!(stats.by_match, CAPACITY as u64 - 1 + 1);
    assert_eq!(f.view("pre").queued, 0);
}

#[test]
fn an_affinity_wait_is_bounded_then_any_free_provider_takes_it() {
    let mut f = Fixture::with_affinity_wait();
    let a = prompt("{\"conversation A\":\"whose prefix p1 holds, and p1 is full\"}");
    fill_p1(&mut f, "pre", &a);
    let (waiting, to) = f.send("pre", a.clone());
    assert_eq!(to, None);
    assert_eq!(dispatched(&f.advance(WAIT_MS - 2), waiting), None);
    // At the bound: the least loaded free provider.
    let out = f.advance(2);
    assert_eq!(dispatched(&out, waiting).as_deref(), Some("p2"));
    let stats = f.view("pre").routing_stats;
    assert_eq!((stats.affinity_waits, stats.affinity_waits_expired), (1, 1));
}

#[test]
fn a_session_waits_for_its_provider_and_a_cancel_ends_the_wait() {
    let mut f = Fixture::with_affinity_wait();
    let key = session("a-busy-session");
    let home = f.once("ses", key.clone());
    let held: Vec<RequestId> = (0..CAPACITY)
        .map(|_| {
            let (r, to) = f.send("ses", key.clone());
            assert_eq!(to.as_deref(), Some(home.as_str()));
            r
        })
        .collect();
    let (first, to) = f.send("ses", key.clone());
    assert_eq!(to, None);
    let (second, to) = f.send("ses", key.clone());
    assert_eq!(to, None);
    assert_eq!(f.view("ses").queued, 2);
    // The first leaves while it waits: the second gets the freed slot.
    let out = f.handle(Input::Cancel {
        request: first,
        reason: edge_bin::control::CancelReason::ClientDisconnect,
    });
    assert!(out.contains(&Action::Done {
        request: first,
        outcome: edge_bin::control::Outcome::Cancelled,
    }));
    assert_eq!(f.view("ses").queued, 1);
    let out = f.finish(held[0], AttemptEnd::Answered);
    assert_eq!(dispatched(&out, second).as_deref(), Some(home.as_str()));
    assert_eq!(f.view("ses").routing_stats.affinity_waits, 2);
    // Nothing left to time out.
    assert_eq!(f.advance(WAIT_MS * 10), []);
}

/// A request waiting for a provider that forgets what it was sent (its
/// node fenced, or itself ejected) does not wait out the rest of its
/// bound: it goes to a free provider at once. The simulation checks that
/// no request ever waits for such a provider.
#[test]
fn a_wait_for_a_provider_that_leaves_ends_at_once() {
    // Ejected: a failure of one of p1's requests.
    let mut f = Fixture::with_affinity_wait();
    let a = prompt("{\"conversation A\":\"whose prefix p1 holds, and p1 is full\"}");
    let held = fill_p1(&mut f, "pre", &a);
    let (waiting, to) = f.send("pre", a.clone());
    assert_eq!(to, None);
    let out = f.finish(held[0], AttemptEnd::Failed(FailureReason::ConnectFailure));
    assert!(
        out.iter()
            .any(|a| matches!(a, Action::Event(edge_bin::control::Event::Ejected { .. }))),
        "{out:?}"
    );
    assert_eq!(dispatched(&out, waiting).as_deref(), Some("p2"));
    let stats = f.view("pre").routing_stats;
    assert_eq!((stats.affinity_waits, stats.affinity_waits_expired), (1, 0));

    // Fenced: p1's node closes; the request waiting for p1 goes to q1.
    let mut f = Fixture::with_affinity_wait();
    let held = fill_p1(&mut f, "two", &a);
    let (waiting, to) = f.send("two", a.clone());
    assert_eq!(to, None);
    let out = f.handle(Input::Closed {
        conn: N1,
        drained: false,
    });
    assert_eq!(dispatched(&out, waiting).as_deref(), Some("q1"));
    assert!(held.iter().all(|&r| dispatched(&out, r).is_none()));
}

fn key(principal: u64, class: u8, weight: u32) -> Share {
    Share {
        principal,
        class,
        weight,
        cost: 100,
    }
}

/// Fills the model `ll` (three providers of [`CAPACITY`]) with `filler`'s
/// requests, queues `queued` after it, then frees one slot at a time
/// `admissions` times: who got each freed slot, in order.
fn admissions(f: &mut Fixture, queued: &[Share], admissions: usize) -> Vec<Share> {
    let mut running: Vec<(RequestId, Share)> = (0..3 * CAPACITY)
        .map(|_| {
            let filler = key(99, 50, 1);
            let (r, to) = f.submit(filler);
            assert!(to.is_some());
            (r, filler)
        })
        .collect();
    let mut waiting = std::collections::HashMap::new();
    for &share in queued {
        let (r, to) = f.submit(share);
        assert_eq!(to, None, "the model is full");
        waiting.insert(r, share);
    }
    let mut got = Vec::new();
    for _ in 0..admissions {
        let (oldest, _) = running.remove(0);
        let out = f.finish(oldest, AttemptEnd::Answered);
        let admitted: Vec<RequestId> = out
            .iter()
            .filter_map(|a| match a {
                Action::Dispatch(d) => Some(d.request),
                _ => None,
            })
            .collect();
        assert_eq!(admitted.len(), 1, "one slot, one admission: {out:?}");
        let share = waiting.remove(&admitted[0]).expect("a queued request");
        running.push((admitted[0], share));
        got.push(share);
    }
    got
}

/// A key that floods a saturated model gets its share and no more: with
/// weights 1:1 each backlogged key's admissions stay within 10 % of half,
/// in every window of 20; with weights 1:3, a quarter and three quarters.
#[test]
fn backlogged_keys_share_a_full_model_by_their_weights() {
    let mut f = Fixture::with_queue(1_000);
    // A queued 300 before B's 300 arrived: FIFO would give A all of the
    // first 300 admissions.
    let (a, b) = (key(1, 50, 1), key(2, 50, 1));
    let queued: Vec<Share> = [a; 300].into_iter().chain([b; 300]).collect();
    let got = admissions(&mut f, &queued, 200);
    for window in got.chunks(20) {
        let of_a = window.iter().filter(|s| s.principal == 1).count();
        assert!((9..=11).contains(&of_a), "A got {of_a} of 20: {window:?}");
    }
    let mut f = Fixture::with_queue(1_000);
    let (a, b) = (key(1, 50, 1), key(2, 50, 3));
    let queued: Vec<Share> = [a; 300].into_iter().chain([b; 300]).collect();
    let got = admissions(&mut f, &queued, 200);
    let of_b = got.iter().filter(|s| s.principal == 2).count();
    assert!(
        (145..=155).contains(&of_b),
        "B got {of_b} of 200 at weight 3 to 1"
    );
}

/// A higher class is admitted first; a lower class waiting behind it still
/// gets one admission in [`MIN_SHARE_EVERY`]; alone, all of them.
#[test]
fn a_higher_class_goes_first_and_a_lower_one_is_not_starved() {
    let mut f = Fixture::with_queue(1_000);
    let (batch, interactive) = (key(1, 10, 1), key(2, 90, 1));
    let queued: Vec<Share> = [batch; 100].into_iter().chain([interactive; 50]).collect();
    let got = admissions(&mut f, &queued, 120);
    let first_batch = got.iter().position(|s| s.class == 10).unwrap();
    assert_eq!(first_batch as u32, MIN_SHARE_EVERY - 1, "{got:?}");
    // While the interactive key waits: one batch admission in ten.
    let while_both = &got[..50];
    let batch_share = while_both.iter().filter(|s| s.class == 10).count();
    assert_eq!(batch_share, 5, "{while_both:?}");
    // Then the batch key alone gets every slot.
    assert!(got[60..].iter().all(|s| s.class == 10));
}
