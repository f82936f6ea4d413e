//! Control's invariants, checked where they can break: after every
//! [`Control::handle`] and [`Control::handle_timeout`] in debug builds
//! (so every step of every simulated schedule, `tests/control_sim.rs`,
//! and of every debug-build test, checks them). A broken one panics
//! naming the invariant and what breaks it.
//!
//! The check reads every table once: its cost grows with the state
//! (nodes, providers, leases, waiting requests), which is why release
//! builds skip it (the decisions themselves stay indexed).
//!
//! - Registry (R1, R2, R5): a node's owner is bound to that node, under a
//!   generation no other owner has, and is never a connection ordered
//!   closed. In a cluster: an owner's generation is exactly the highest
//!   revision of its owner key seen here (nothing newer superseded it); a
//!   connection is bound or claiming, never both; an Edge without its etcd
//!   lease owns nothing and claims nothing.
//! - Leases (F1, H2, R4, X6): every live lease is filed under its
//!   connection, belongs to the current ready owner of its provider's node
//!   (a fenced, superseded or pending generation holds none), and serves a
//!   request that is dispatched under its run id or settling a cancel; a
//!   provider's `in_flight` and `long_in_flight` count exactly its live
//!   leases; a dispatch never takes them past its capacities, and a
//!   provider above them (a reload lowered them) is no candidate. No
//!   dispatch goes to a removed or drained provider or node, or a draining
//!   owner.
//! - Requests: each waits in exactly the queue, deadline set and lane its
//!   state says, every queue within its model's `max_queue`, no attempt
//!   past `max_attempts`; a step ends a request at most once, and only one
//!   that was live (or the one it just refused); every dispatch of a step
//!   holds a live lease; after a timeout step no request waits past its
//!   queue deadline.
//! - Candidates: a provider is filed in its lanes' candidate indexes
//!   exactly when it is a live candidate with a free slot, under its
//!   current load.
//! - Health (H4–H6, passive health): an overlay or an observation sequence
//!   belongs to the current ready generation; probe and ejection timers
//!   match the providers' state; at most `max_ejection_percent` of a pool
//!   is ejected; an outstanding probe names its provider's current ready
//!   owner, one per provider.

use std::collections::{BTreeSet, HashSet};
use std::time::Instant;

use super::tables::{Candidate, Load, RequestState};
use super::{Action, Control, Ownership, RequestId};

/// What a step's check needs from before the step ([`Control::begin_step`]).
#[derive(Debug)]
pub(super) struct StepStart {
    /// Actions already in the caller's buffer.
    actions: usize,
    /// Requests live before the step, in id order.
    live: Vec<RequestId>,
    /// The request a `Submit` step names (it may be refused in the step).
    submitted: Option<RequestId>,
}

impl Control {
    /// Notes what [`Control::end_step`] checks the step against.
    pub(super) fn begin_step(&self, submitted: Option<RequestId>, out: &[Action]) -> StepStart {
        StepStart {
            actions: out.len(),
            live: self.pending.keys().copied().collect(),
            submitted,
        }
    }

    /// Checks the step that `start` began and every invariant of the
    /// tables after it; `timeout_at`: the step ran the timers due then.
    pub(super) fn end_step(&self, start: StepStart, out: &[Action], timeout_at: Option<Instant>) {
        let mut ended = HashSet::new();
        for action in &out[start.actions..] {
            match action {
                Action::Done { request, outcome } => {
                    assert!(
                        ended.insert(*request),
                        "{request:?} ended twice in one step ({outcome:?})"
                    );
                    assert!(
                        start.live.binary_search(request).is_ok()
                            || start.submitted == Some(*request),
                        "{request:?} ended ({outcome:?}) but was not live"
                    );
                    assert!(
                        !self.pending.contains_key(request),
                        "{request:?} ended ({outcome:?}) but is still pending"
                    );
                }
                Action::Dispatch(d) => {
                    let entry = self.leases.get(&d.lease.run_id);
                    assert!(
                        entry.is_some_and(|e| e.lease == d.lease),
                        "dispatch of {:?} holds no live lease: {:?}",
                        d.request,
                        d.lease
                    );
                    let Some(entry) = entry else { continue };
                    let state = &self.providers[entry.provider];
                    let node = &self.nodes[state.node];
                    assert!(
                        !state.removed
                            && !state.drained
                            && !node.removed
                            && !node.drained
                            && node.ready_owner().is_some_and(|o| !o.draining),
                        "dispatch of {:?} to {}, which takes no new work \
                         (removed or drained, or its node is)",
                        d.request,
                        state.key
                    );
                    // Admission takes a free slot only (a free long slot
                    // for a long request): a capacity lowered by a reload
                    // below what runs admits nothing.
                    assert!(
                        state.in_flight <= state.spec.capacity
                            && (!d.lease.long
                                || state.long_in_flight <= state.spec.long_context_capacity),
                        "{} admitted over capacity: {}/{} in flight, {}/{} long",
                        state.key,
                        state.in_flight,
                        state.spec.capacity,
                        state.long_in_flight,
                        state.spec.long_context_capacity
                    );
                }
                _ => {}
            }
        }
        if let Some(now) = timeout_at {
            assert!(
                self.queue_deadlines.first().is_none_or(|&(at, _)| at > now),
                "a request waits past its queue deadline: {:?} at {now:?}",
                self.queue_deadlines.first()
            );
        }
        let ejected = out[start.actions..]
            .iter()
            .any(|a| matches!(a, Action::Event(super::Event::Ejected { .. })));
        self.check_tables(ejected);
    }

    /// Checks every invariant of Control's tables (see the module docs);
    /// panics naming the first one broken.
    #[cfg(test)]
    pub(super) fn check_invariants(&self) {
        self.check_tables(true);
    }

    /// [`Control::check_invariants`]; the bound on ejected providers only
    /// when `ejected` (an ejection is the only step that can break it; a
    /// reload that lowers `max_ejection_percent` leaves running ejections
    /// to their end).
    fn check_tables(&self, ejected: bool) {
        self.check_registry();
        self.check_leases();
        self.check_requests();
        self.check_candidates();
        self.check_health(ejected);
    }

    fn check_registry(&self) {
        let mut generations = HashSet::new();
        for (n, node) in self.nodes.iter().enumerate() {
            if node.removed && node.owner.is_some() {
                assert!(
                    self.retire_deadlines
                        .iter()
                        .any(|(_, id)| *id == node.spec.id),
                    "node `{}` was removed but its owner has no retire deadline",
                    node.spec.id
                );
            }
            let Some(owner) = node.owner else {
                continue;
            };
            let id = &node.spec.id;
            assert_eq!(
                self.bindings.get(&owner.conn),
                Some(&n),
                "R1: the owner {:?} of node `{id}` is not bound to it",
                owner.conn
            );
            assert!(
                !self.closing.contains(&owner.conn),
                "R3: node `{id}` is owned by {:?}, a connection ordered closed",
                owner.conn
            );
            let minted = match self.ownership {
                Ownership::Local => owner.generation.0 <= self.next_generation,
                Ownership::Cluster => owner.generation.0 > 0,
            };
            assert!(
                minted && generations.insert(owner.generation),
                "R2: node `{id}` owned under {:?}, not a generation of its own",
                owner.generation
            );
            if self.ownership == Ownership::Cluster {
                assert_eq!(
                    owner.generation.0, node.observed_revision,
                    "F1: node `{id}` owned under {:?}, but revision {} of its owner key was seen",
                    owner.generation, node.observed_revision
                );
                assert!(
                    self.cluster_up,
                    "F1: node `{id}` owned under {:?} without a cluster lease",
                    owner.generation
                );
            }
        }
        for (conn, &n) in &self.claims {
            assert!(
                self.cluster_up && self.ownership == Ownership::Cluster,
                "F1: {conn:?} claims node `{}` without a cluster lease",
                self.nodes[n].spec.id
            );
            assert!(
                !self.bindings.contains_key(conn),
                "R1: {conn:?} claims node `{}` and is bound too",
                self.nodes[n].spec.id
            );
        }
    }

    fn check_leases(&self) {
        let mut in_flight = vec![0u32; self.providers.len()];
        let mut long_in_flight = vec![0u32; self.providers.len()];
        for (run_id, entry) in &self.leases {
            let lease = &entry.lease;
            let state = &self.providers[entry.provider];
            assert!(
                lease.run_id == *run_id && lease.provider == state.key,
                "lease {run_id} filed under the wrong run or provider: {lease:?}"
            );
            assert!(
                self.leases_of
                    .get(&lease.conn)
                    .is_some_and(|runs| runs.contains(run_id)),
                "F1: lease {run_id} is not filed under its connection {:?}",
                lease.conn
            );
            let owner = self.nodes[state.node].ready_owner();
            assert!(
                owner.is_some_and(|o| o.conn == lease.conn && o.generation == lease.generation),
                "F1, R4: lease {run_id} on {:?} {:?} outlived its generation (ready owner: {owner:?})",
                lease.conn,
                lease.generation
            );
            let serves = self
                .pending
                .get(&lease.request)
                .is_some_and(|p| match &p.state {
                    RequestState::Dispatched { run_id: r, .. }
                    | RequestState::CancelPending { run_id: r, .. } => r == run_id,
                    RequestState::Queued { .. } => false,
                });
            assert!(
                serves,
                "lease {run_id} serves {:?}, which is not dispatched under it",
                lease.request
            );
            in_flight[entry.provider] += 1;
            if lease.long {
                long_in_flight[entry.provider] += 1;
            }
        }
        let filed: usize = self.leases_of.values().map(BTreeSet::len).sum();
        assert!(
            filed == self.leases.len() && self.leases_of.values().all(|runs| !runs.is_empty()),
            "F1: {filed} runs filed by connection, {} live leases",
            self.leases.len()
        );
        for (p, state) in self.providers.iter().enumerate() {
            assert!(
                state.in_flight == in_flight[p] && state.long_in_flight == long_in_flight[p],
                "P2: {} counts {}/{} leases in flight, holds {}/{}",
                state.key,
                state.in_flight,
                state.long_in_flight,
                in_flight[p],
                long_in_flight[p]
            );
            // Over capacity only after a reload lowered it (never by an
            // admission: `end_step`), and then no candidate; over its long
            // capacity, no candidate for long requests (its free slots
            // still take short ones).
            assert!(
                (state.in_flight <= state.spec.capacity || state.indexed.is_none())
                    && (state.long_in_flight <= state.spec.long_context_capacity
                        || state.indexed.is_none_or(|i| !i.long)),
                "{} over capacity and a candidate: {}/{} in flight, {}/{} long",
                state.key,
                state.in_flight,
                state.spec.capacity,
                state.long_in_flight,
                state.spec.long_context_capacity
            );
            assert!(
                !state.removed || state.pools.is_empty(),
                "{} was removed but is still in a pool",
                state.key
            );
        }
    }

    fn check_requests(&self) {
        let (mut queued, mut settling, mut awaiting_response) = (0, 0, 0);
        for (request, p) in &self.pending {
            let model = &self.models[p.model];
            match p.lane {
                Some(lane) => {
                    assert!(
                        model.lanes.contains(&lane),
                        "{request:?} waits in lane {lane} of another model"
                    );
                    assert!(
                        model.lane_of[p.operation as usize] == Some(lane),
                        "{request:?} waits in lane {lane}, not its operation's"
                    );
                }
                // A reload took its lane away: it runs to its end.
                None => assert!(
                    model.removed || model.lane_of[p.operation as usize].is_none(),
                    "{request:?} has no lane, but its model serves its operation"
                ),
            }
            assert!(
                p.counted_attempts() <= model.spec.max_attempts.max(1)
                    && p.unstarted <= p.attempts
                    && p.tried.len() <= p.counted_attempts() as usize,
                "{request:?}: attempt {} of at most {} ({} providers tried)",
                p.counted_attempts(),
                model.spec.max_attempts,
                p.tried.len()
            );
            let in_queue = p.lane.is_some_and(|lane| {
                let lane = &self.lanes[lane];
                if p.long {
                    lane.queued_long.contains(*request)
                } else {
                    lane.queued.contains(*request)
                }
            });
            let waits = self.waiting.get(request);
            match &p.state {
                RequestState::Queued { deadline } => {
                    queued += 1;
                    // In its lane's queue, or waiting for its provider:
                    // one of the two, with its deadlines filed.
                    let filed = match waits {
                        None => in_queue,
                        Some(w) => {
                            // Never for a provider that forgot what it
                            // was sent (fenced or ejected: `forget_routes`).
                            let provider = &self.providers[w.provider];
                            let live = provider.outlier.ejection().is_none()
                                && self.nodes[provider.node].ready_owner().is_some();
                            live && !in_queue
                                && Some(w.lane) == p.lane
                                && w.long == p.long
                                && self.affinity_deadlines.contains(&(w.until, *request))
                                && self
                                    .waiters
                                    .get(&w.provider)
                                    .is_some_and(|set| set.contains(request))
                        }
                    };
                    assert!(
                        filed && self.queue_deadlines.contains(&(*deadline, *request)),
                        "{request:?} is queued outside its lane's queue or deadlines"
                    );
                }
                RequestState::Dispatched {
                    run_id,
                    response_by,
                    ..
                } => {
                    assert!(!in_queue, "{request:?} is dispatched and queued");
                    assert!(
                        self.leases.contains_key(run_id),
                        "{request:?} is dispatched under {run_id} without its lease"
                    );
                    if let Some(at) = response_by {
                        awaiting_response += 1;
                        assert!(
                            *response_by == p.response_deadline
                                && self.response_deadlines.contains(&(*at, *request)),
                            "U6: {request:?}'s response-wait deadline is not filed"
                        );
                    }
                }
                RequestState::CancelPending { run_id, settle_at } => {
                    settling += 1;
                    assert!(
                        !in_queue
                            && self.leases.contains_key(run_id)
                            && self.settle_deadlines.contains(&(*settle_at, *request)),
                        "{request:?} settles a cancel of {run_id} without its lease or deadline"
                    );
                }
            }
        }
        assert_eq!(
            (
                self.queue_deadlines.len(),
                self.settle_deadlines.len(),
                self.response_deadlines.len()
            ),
            (queued, settling, awaiting_response),
            "deadlines filed for requests no longer in that state"
        );
        let mut heads = 0;
        let mut in_queues = 0;
        for (l, lane) in self.lanes.iter().enumerate() {
            for (long, queue) in [(false, &lane.queued), (true, &lane.queued_long)] {
                in_queues += queue.len();
                if let Some(head) = queue.first() {
                    heads += 1;
                    assert!(
                        self.heads.contains(&(head, l, long)),
                        "the head {head:?} of lane {l} (long: {long}) is not filed"
                    );
                }
            }
        }
        let waiting = self.waiting.len();
        assert!(
            in_queues + waiting == queued && heads == self.heads.len(),
            "{in_queues} requests in queues and {waiting} waiting for a provider, {queued} \
             queued; {heads} heads, {} filed",
            self.heads.len()
        );
        // Each session table's counts add up to its sessions.
        for model in &self.models {
            let sessions = &model.router.sessions;
            assert_eq!(
                sessions.counted(),
                sessions.len(),
                "model `{}`: its providers' session counts",
                model.spec.name
            );
        }
        // The affinity waits' three indexes agree, and each model counts its
        // own.
        let by_provider: usize = self.waiters.values().map(|set| set.len()).sum();
        let by_model: usize = self.models.iter().map(|m| m.router.waiting).sum();
        assert!(
            by_provider == waiting
                && self.affinity_deadlines.len() == waiting
                && by_model == waiting
                && self.waiters.values().all(|set| !set.is_empty()),
            "affinity waits: {waiting} requests, {by_provider} by provider, {} deadlines, \
             {by_model} by model",
            self.affinity_deadlines.len()
        );
        for (m, model) in self.models.iter().enumerate() {
            assert!(
                !model.removed
                    || (model.spec.providers.is_empty()
                        && !self.model_index.contains_key(&model.spec.name)),
                "model `{}` was removed but still serves",
                model.spec.name
            );
            let spec = &model.spec;
            assert!(
                self.queued_count(m) <= spec.max_queue as usize,
                "model `{}` queues {} requests, max_queue {}",
                spec.name,
                self.queued_count(m),
                spec.max_queue
            );
        }
    }

    fn check_candidates(&self) {
        let mut filed = 0;
        for (p, state) in self.providers.iter().enumerate() {
            let want = self.wanted_index(p);
            assert_eq!(
                state.indexed, want,
                "X6, H4: {} is filed as a candidate under a stale state",
                state.key
            );
            let Some(indexed) = state.indexed else {
                continue;
            };
            let load = Load {
                in_flight: indexed.in_flight,
                capacity: state.spec.capacity,
            };
            let lacks_embedding_runs = self.lacks_embedding_runs(p);
            for &(lane, position) in &state.pools {
                let lane = &self.lanes[lane];
                let entry = Candidate {
                    load,
                    position,
                    provider: p,
                };
                if lacks_embedding_runs && lane.needs_embedding_runs {
                    assert!(
                        !lane.free.contains(&entry) && !lane.free_long.contains(&entry),
                        "{} is filed for embeddings on a node that does not run them",
                        state.key
                    );
                    continue;
                }
                assert!(
                    lane.free.contains(&entry) && lane.free_long.contains(&entry) == indexed.long,
                    "{} is missing from a candidate index of its lanes",
                    state.key
                );
                filed += 1;
            }
        }
        let in_indexes: usize = self.lanes.iter().map(|lane| lane.free.len()).sum();
        assert_eq!(
            in_indexes, filed,
            "X6: the candidate indexes hold providers that are no candidates"
        );
        assert!(
            self.lanes
                .iter()
                .all(|lane| lane.free_long.is_subset(&lane.free)),
            "a long-context candidate without a free slot"
        );
    }

    fn check_health(&self, ejection_step: bool) {
        let (mut probes, mut ejected) = (0, 0);
        for (p, state) in self.providers.iter().enumerate() {
            let ready = self.nodes[state.node].ready_owner().map(|o| o.generation);
            assert!(
                state.overlay.is_none() || state.overlay == ready,
                "H5: {} keeps the overlay of {:?}, not of its ready generation {ready:?}",
                state.key,
                state.overlay
            );
            assert!(
                state.last_seq.is_none_or(|(g, _)| Some(g) == ready),
                "H4: {} keeps a sequence of another generation: {:?}",
                state.key,
                state.last_seq
            );
            let ejection = state.outlier.ejection();
            if let Some(at) = state.next_probe {
                probes += 1;
                assert!(
                    self.probe_deadlines.contains(&(at, p))
                        && (state.overlay.is_some() || ejection.is_some()),
                    "H6: {} has a probe due that is not filed or not needed",
                    state.key
                );
            }
            if let Some(ejection) = ejection {
                ejected += 1;
                assert!(
                    self.ejection_deadlines.contains(&(ejection.until, p)),
                    "{}'s ejection has no end filed",
                    state.key
                );
            }
        }
        assert!(
            probes == self.probe_deadlines.len() && ejected == self.ejection_deadlines.len(),
            "timers filed for providers that have none: {probes} probes, {ejected} ejections"
        );
        let policy = self.tunables.outlier;
        // Only an ejection can break the bound (most steps have none).
        let models = if ejected == 0 || !ejection_step {
            &[][..]
        } else {
            &self.models[..]
        };
        for model in models {
            let pool: Vec<usize> = model
                .spec
                .providers
                .iter()
                .filter_map(|key| self.provider_index.get(key).copied())
                .collect();
            let out = pool
                .iter()
                .filter(|&&q| self.providers[q].outlier.ejection().is_some())
                .count();
            let max = policy.map_or(0, |policy| policy.max_ejected(pool.len()));
            assert!(
                out <= max,
                "model `{}` has {out} of {} providers ejected, at most {max}",
                model.spec.name,
                pool.len()
            );
        }
        let mut probed = HashSet::new();
        for (command_id, record) in &self.commands {
            let current = self
                .node_index
                .get(&record.node_id)
                .and_then(|&n| self.nodes[n].ready_owner())
                .is_some_and(|o| o.conn == record.conn && o.generation == record.generation);
            assert!(
                current
                    && *record.node_id == *record.provider.node_id
                    && probed.insert(&record.provider),
                "H6: probe {command_id} outlived its generation or is not the only one of {}",
                record.provider
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! The checks can fail: each test breaks one table the way a bug would
    //! and expects the check to name the invariant.

    use super::super::RouteHint;
    use std::time::Duration;

    use iop_wire::pb;

    use super::super::{
        ConnId, Control, ControlModel, ControlNode, ControlProvider, ControlSpec, DispatchKind,
        Input, Operation, Operations, ProviderKey, RequestId, Tunables,
    };

    const CONN: ConnId = ConnId(1);

    /// One node `n1` with provider `p1` (capacity 2) serving model `m`,
    /// its owner ready, one request dispatched.
    fn busy() -> Control {
        let provider = ControlProvider {
            id: "p1".into(),
            adapter: "a".into(),
            target: "t".into(),
            capacity: 2,
            long_context_capacity: 0,
            response_stall_timeout_ms: 0,
            category: pb::ProviderCategory::LocalInference,
            kind: DispatchKind::Tunnel,
            operations: Operations::for_kind(DispatchKind::Tunnel),
            enabled: true,
        };
        let mut control = Control::new(ControlSpec {
            nodes: vec![ControlNode {
                id: "n1".into(),
                config: pb::NodeConfigPayload::default(),
                providers: vec![provider],
            }],
            models: vec![ControlModel {
                name: "m".into(),
                providers: vec![ProviderKey {
                    node_id: "n1".into(),
                    provider_id: "p1".into(),
                }],
                max_queue: 4,
                queue_timeout: Duration::from_secs(10),
                max_attempts: 1,
                routing: super::super::RoutingSpec::default(),
            }],
            tunables: Tunables::default(),
        });
        let now = iop_engine::clock::now();
        let mut out = Vec::new();
        for input in [
            Input::Register {
                conn: CONN,
                tls_name: "n1".into(),
                node_id: "n1".into(),
            },
            Input::Ready {
                conn: CONN,
                node_id: "n1".into(),
            },
            Input::Submit {
                request: RequestId(1),
                model: "m".into(),
                operation: Operation::ChatCompletions,
                long: false,
                hint: RouteHint::default(),
                share: crate::control::fair::Share::default(),
            },
        ] {
            control.handle(now, input, &mut out);
        }
        assert_eq!(control.leases.len(), 1, "{out:?}");
        control.check_invariants();
        control
    }

    #[test]
    #[should_panic(expected = "P2: n1/p1 counts 2/0 leases in flight, holds 1/0")]
    fn an_occupancy_that_is_not_the_live_leases_is_caught() {
        let mut control = busy();
        control.providers[0].in_flight += 1;
        control.check_invariants();
    }

    #[test]
    #[should_panic(expected = "F1, R4: lease")]
    fn a_lease_that_outlived_its_generation_is_caught() {
        let mut control = busy();
        let owner = control.nodes[0].owner.as_mut().expect("an owner");
        owner.generation.0 += 7;
        control.check_leases();
    }

    #[test]
    #[should_panic(expected = "R3: node `n1` is owned by ConnId(1), a connection ordered closed")]
    fn an_owner_ordered_closed_is_caught() {
        let mut control = busy();
        control.closing.insert(CONN);
        control.check_registry();
    }

    #[test]
    #[should_panic(expected = "deadlines filed for requests no longer in that state")]
    fn a_stale_deadline_is_caught() {
        let mut control = busy();
        let at = iop_engine::clock::now();
        control.queue_deadlines.insert((at, RequestId(9)));
        control.check_requests();
    }
}
