//! Admission: the lanes of every model (candidates with a free slot,
//! ordered by load; waiting requests by arrival), submits, cancels, the
//! choice of a provider and its lease, the pump, commits and
//! response-wait deadlines (U6), terminals, and pre-commit failover.

use std::time::Instant;

use super::routing::{Pick, RouteHint};
use super::tables::{Candidate, Indexed, LeaseEntry, Load, Pending, ProviderLease, RequestState};
use super::{
    AbortReason, Action, AttemptEnd, CancelReason, ConnId, Control, Dispatch, DispatchKind, Event,
    FailureReason, Handoff, Input, Outcome, Rejection, RequestId, Terminal,
};

impl Control {
    // ---- candidate indexes and queues ----------------------------------------

    /// Whether provider `p` is a live candidate with a free slot: enabled,
    /// its node's ready generation, no unavailable overlay of that
    /// generation (X6, H4), not ejected, a lease free.
    fn has_free_slot(&self, p: usize) -> bool {
        let state = &self.providers[p];
        state.in_flight < state.spec.capacity
            && self.takes_new_work(p)
            && state.outlier.ejection().is_none()
    }

    /// Whether provider `p` may be given new work at all: enabled, neither
    /// it nor its node drained or removed, its node's owner ready and not
    /// draining, no unavailable overlay of that generation (X6, H4).
    pub(super) fn takes_new_work(&self, p: usize) -> bool {
        let state = &self.providers[p];
        let node = &self.nodes[state.node];
        state.spec.enabled
            && !state.drained
            && !state.removed
            && !node.drained
            && !node.removed
            && node
                .ready_owner()
                .is_some_and(|owner| !owner.draining && state.overlay != Some(owner.generation))
    }

    /// How provider `p` belongs in its lanes' candidate indexes now: under
    /// its load, and whether it has a free long slot; `None` while it is no
    /// candidate with a free slot.
    pub(super) fn wanted_index(&self, p: usize) -> Option<Indexed> {
        self.has_free_slot(p).then(|| {
            let state = &self.providers[p];
            Indexed {
                in_flight: state.in_flight,
                long: state.long_in_flight < state.spec.long_context_capacity,
            }
        })
    }

    /// Files provider `p` in (or takes it out of) the candidate indexes of
    /// its models after anything that decides candidacy changed: its
    /// occupancy, its overlay, its node's owner.
    pub(super) fn refresh(&mut self, p: usize) {
        let want = self.wanted_index(p);
        let state = &self.providers[p];
        let had = state.indexed;
        if had == want {
            return;
        }
        let lacks_embedding_runs = self.lacks_embedding_runs(p);
        let state = &mut self.providers[p];
        state.indexed = want;
        let capacity = state.spec.capacity;
        let load = |in_flight| Load {
            in_flight,
            capacity,
        };
        for &(lane, position) in &state.pools {
            let model = &mut self.lanes[lane];
            if let Some(old) = had {
                let entry = Candidate {
                    load: load(old.in_flight),
                    position,
                    provider: p,
                };
                model.free.remove(&entry);
                if old.long {
                    model.free_long.remove(&entry);
                }
            }
            if let Some(new) =
                want.filter(|_| !(lacks_embedding_runs && model.needs_embedding_runs))
            {
                let entry = Candidate {
                    load: load(new.in_flight),
                    position,
                    provider: p,
                };
                model.free.insert(entry);
                if new.long {
                    model.free_long.insert(entry);
                }
            }
        }
    }

    /// Whether provider `p` is a normalized-run one on a Node that did not
    /// say it runs embeddings: then it is no candidate of a lane that
    /// needs them ([`super::tables::LaneState::needs_embedding_runs`]),
    /// and stays one of its other lanes.
    pub(super) fn lacks_embedding_runs(&self, p: usize) -> bool {
        let state = &self.providers[p];
        state.spec.kind == DispatchKind::Normalized
            && !self.nodes[state.node]
                .owner
                .is_some_and(|owner| owner.runs_embeddings)
    }

    /// Files every provider of `node` again from scratch: after something
    /// that decides candidacy changed without changing its index (its
    /// owner's `runs_embeddings`).
    pub(super) fn refile_node(&mut self, node: usize) {
        for p in self.nodes[node].providers.clone() {
            let Some(old) = self.providers[p].indexed.take() else {
                continue;
            };
            let state = &self.providers[p];
            for &(lane, position) in &state.pools {
                let entry = Candidate {
                    load: Load {
                        in_flight: old.in_flight,
                        capacity: state.spec.capacity,
                    },
                    position,
                    provider: p,
                };
                self.lanes[lane].free.remove(&entry);
                self.lanes[lane].free_long.remove(&entry);
            }
            self.refresh(p);
        }
    }

    pub(super) fn refresh_node(&mut self, node: usize) {
        for p in self.nodes[node].providers.clone() {
            self.refresh(p);
        }
    }

    /// Takes `request` out of its lane's queue (or out of its affinity
    /// wait).
    pub(super) fn unqueue(&mut self, request: RequestId, model: usize, long: bool) {
        if self.stop_waiting(request) {
            return;
        }
        let queue = self.lanes[model].queue(long);
        let old_head = queue.first();
        if !queue.remove(request) {
            return;
        }
        let head = queue.first();
        self.refile_head(model, long, old_head, head);
    }

    /// Puts `request` in its lane's queue: a new arrival charged its
    /// share, or one queued before at its old place.
    pub(super) fn enqueue(&mut self, request: RequestId, model: usize, long: bool) {
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        let queue = match long {
            true => &mut self.lanes[model].queued_long,
            false => &mut self.lanes[model].queued,
        };
        let old_head = queue.first();
        match p.place {
            Some((class, tag)) => queue.push_again(request, class, tag),
            None => {
                let tag = queue.push(request, p.share);
                p.place = Some((p.share.class, tag));
            }
        }
        let head = queue.first();
        self.refile_head(model, long, old_head, head);
    }

    /// The head of a lane's queue changed from `old` to `new`.
    fn refile_head(
        &mut self,
        lane: usize,
        long: bool,
        old: Option<RequestId>,
        new: Option<RequestId>,
    ) {
        if old != new {
            if let Some(old) = old {
                self.heads.remove(&(old, lane, long));
            }
            if let Some(new) = new {
                self.heads.insert((new, lane, long));
            }
        }
    }

    // ---- submit, cancel, undeliverable ---------------------------------------

    /// `Input::Submit`: dispatched at once, queued, or refused.
    pub(super) fn on_submit(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        let Input::Submit {
            request,
            model,
            operation,
            long,
            hint,
            share,
        } = input
        else {
            return;
        };
        let model = model.as_str();
        if self.pending.contains_key(&request) {
            return;
        }
        let Some(&m) = self.model_index.get(model) else {
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(Rejection::UnknownModel),
            });
        };
        let Some(lane) = self.models[m].lane_of[operation as usize] else {
            let why = if self.models[m].spec.providers.is_empty() {
                Rejection::NoProviders
            } else {
                Rejection::UnsupportedOperation
            };
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(why),
            });
        };
        let wait_for = self.preferred_busy(lane, long, &hint);
        let dispatch = match wait_for {
            Some(_) => None,
            None => self.try_admit(request, lane, long, 1, &[], &hint),
        };
        if let Some(dispatch) = dispatch {
            // Filed as queued for an instant: starting the attempt makes
            // it dispatched.
            let state = RequestState::Queued { deadline: now };
            self.pending.insert(
                request,
                Pending::new(m, operation, lane, long, state, hint, share),
            );
            self.start_attempt(request, &dispatch);
            return out.push(Action::Dispatch(dispatch));
        }
        let spec = &self.models[m].spec;
        let (max_queue, queue_timeout) = (spec.max_queue as usize, spec.queue_timeout);
        if self.queued_count(m) >= max_queue {
            return out.push(Action::Done {
                request,
                outcome: Outcome::Rejected(Rejection::QueueFull),
            });
        }
        let deadline = now + queue_timeout;
        self.queue_deadlines.insert((deadline, request));
        self.pending.insert(
            request,
            Pending::new(
                m,
                operation,
                lane,
                long,
                RequestState::Queued { deadline },
                hint,
                share,
            ),
        );
        match wait_for {
            // Its preferred provider is busy: it waits for it, for a while.
            Some(p) => self.wait_for(now, request, m, p),
            None => self.enqueue(request, lane, long),
        }
    }

    pub(super) fn on_cancel(
        &mut self,
        now: Instant,
        request: RequestId,
        reason: CancelReason,
        out: &mut Vec<Action>,
    ) {
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        match p.state.clone() {
            RequestState::Queued { deadline } => {
                let (lane, long) = (p.lane, p.long);
                self.queue_deadlines.remove(&(deadline, request));
                self.pending.remove(&request);
                if let Some(lane) = lane {
                    self.unqueue(request, lane, long);
                }
                out.push(Action::Done {
                    request,
                    outcome: Outcome::Cancelled,
                });
            }
            RequestState::Dispatched {
                run_id,
                response_by,
                ..
            } => {
                if let Some(at) = response_by {
                    self.response_deadlines.remove(&(at, request));
                }
                let settle_at = now + self.tunables.cancel_settle;
                p.state = RequestState::CancelPending {
                    run_id: run_id.clone(),
                    settle_at,
                };
                self.settle_deadlines.insert((settle_at, request));
                if let Some(entry) = self.leases.get(&run_id) {
                    out.push(Action::SendCancel {
                        conn: entry.lease.conn,
                        run_id,
                        reason,
                    });
                }
            }
            RequestState::CancelPending { .. } => {}
        }
    }

    pub(super) fn on_undeliverable(&mut self, request: RequestId, out: &mut Vec<Action>) {
        let run_id = match self.pending.get(&request) {
            Some(Pending {
                state:
                    RequestState::Dispatched { run_id, .. } | RequestState::CancelPending { run_id, .. },
                ..
            }) => Some(run_id.clone()),
            // Queued again after its node was fenced (pre-commit failover)
            // while its client was still sending the lost attempt: a
            // heartbeat timeout shuts the socket before the shell reports
            // the close, so the send fails and its report can come after
            // the fence. Its client has given up: end it, or a later lease
            // would serve nobody.
            Some(p) if p.attempts > 0 => None,
            _ => return,
        };
        self.forget_request(request);
        out.push(Action::Done {
            request,
            outcome: Outcome::Cancelled,
        });
        if let Some(run_id) = run_id {
            self.release(&run_id);
            self.pump(out);
        }
    }

    /// Requests waiting in any lane of model `m`, or for a provider of it.
    pub(super) fn queued_count(&self, m: usize) -> usize {
        self.models[m]
            .lanes
            .iter()
            .map(|&lane| self.lanes[lane].queued_count())
            .sum::<usize>()
            + self.models[m].router.waiting
    }

    // ---- leases and the pump -------------------------------------------------

    /// Takes a lease for `request`'s `attempt`-th attempt on the
    /// least-loaded live candidate of `lane` with a free slot (and a free
    /// long slot for long requests) that is not in `exclude`; ties go to
    /// configured order. The first such entry of the lane's candidate
    /// index (`exclude` holds the providers already tried: at most
    /// `max_attempts - 1`).
    fn try_admit(
        &mut self,
        request: RequestId,
        lane: usize,
        long: bool,
        attempt: u32,
        exclude: &[usize],
        hint: &RouteHint,
    ) -> Option<Dispatch> {
        let pick = self.pick(lane, long, exclude, hint)?;
        self.take_lease(request, lane, long, attempt, pick, hint)
    }

    /// Takes the lease `pick` chose for `request`'s `attempt`-th attempt.
    pub(super) fn take_lease(
        &mut self,
        request: RequestId,
        lane: usize,
        long: bool,
        attempt: u32,
        pick: Pick,
        hint: &RouteHint,
    ) -> Option<Dispatch> {
        let p = pick.provider;
        let owner = self.nodes[self.providers[p].node].ready_owner()?;
        debug_assert!(
            !self.closing.contains(&owner.conn),
            "R4: dispatch to {:?}, a connection ordered closed",
            owner.conn
        );
        let state = &mut self.providers[p];
        debug_assert!(
            state.in_flight < state.spec.capacity
                && (!long || state.long_in_flight < state.spec.long_context_capacity),
            "{} leased beyond its capacity",
            state.key
        );
        state.in_flight += 1;
        if long {
            state.long_in_flight += 1;
        }
        let run_id = request.attempt_run_id(attempt);
        let lease = ProviderLease {
            request,
            run_id: run_id.clone(),
            provider: state.key.clone(),
            conn: owner.conn,
            generation: owner.generation,
            adapter: state.spec.adapter.clone(),
            target: state.spec.target.clone(),
            long,
        };
        let dispatch = Dispatch {
            request,
            lease: lease.clone(),
            kind: state.spec.kind,
            response_stall_timeout_ms: state.spec.response_stall_timeout_ms,
            strips_usage_chunk: owner.strips_usage_chunk,
            accepts_tunnel_body: owner.accepts_tunnel_body,
        };
        self.refresh(p);
        self.routed(lane, pick, hint);
        self.leases_of
            .entry(owner.conn)
            .or_default()
            .insert(run_id.clone());
        self.leases
            .insert(run_id, LeaseEntry { lease, provider: p });
        Some(dispatch)
    }

    /// Admits waiting requests, in arrival order, wherever they now fit.
    ///
    /// Requests of one queue (one model, short or long) fit exactly when
    /// its head does, and admitting only ever takes capacity, so the
    /// earliest waiting request that fits is the earliest queue head that
    /// fits: admit it, repeat until no head fits. (A request queued again
    /// after its node was fenced has no provider to avoid: it fits like
    /// any other.)
    pub(super) fn pump(&mut self, out: &mut Vec<Action>) {
        // Requests waiting for their provider go first, wherever it is free.
        self.admit_waiters(out);
        loop {
            let head = self
                .heads
                .iter()
                .find(|&&(_, lane, long)| !self.lanes[lane].candidates(long).is_empty())
                .copied();
            let Some((request, m, long)) = head else {
                return;
            };
            let attempt = self.pending.get(&request).map_or(1, |p| p.attempts + 1);
            let hint = self.hint_of(request);
            let Some(dispatch) = self.try_admit(request, m, long, attempt, &[], &hint) else {
                return;
            };
            self.unqueue(request, m, long);
            self.start_attempt(request, &dispatch);
            out.push(Action::Dispatch(dispatch));
        }
    }

    /// `request` (pending, queued or between attempts) got `dispatch`:
    /// it is dispatched under the new attempt, with the request's
    /// response-wait deadline (set at its first dispatch) filed (U6).
    pub(super) fn start_attempt(&mut self, request: RequestId, dispatch: &Dispatch) {
        let provider = self.leases.get(&dispatch.lease.run_id).map(|e| e.provider);
        let first_deadline = match (self.now, self.tunables.response_wait_timeout) {
            (Some(now), Some(timeout)) => Some(now + timeout),
            _ => None,
        };
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        match p.state {
            RequestState::Queued { deadline } => {
                self.queue_deadlines.remove(&(deadline, request));
            }
            RequestState::Dispatched {
                response_by: Some(at),
                ..
            } => {
                self.response_deadlines.remove(&(at, request));
            }
            _ => {}
        }
        if p.response_deadline.is_none() {
            p.response_deadline = first_deadline;
        }
        let response_by = p.response_deadline;
        if let Some(at) = response_by {
            self.response_deadlines.insert((at, request));
        }
        p.attempts += 1;
        p.tried.extend(provider);
        p.state = RequestState::Dispatched {
            run_id: dispatch.lease.run_id.clone(),
            response_by,
            committed: false,
            responded: false,
        };
    }

    // ---- response start and commit (U6) --------------------------------------

    /// The request of `run_id`'s live lease, when `conn` is the lease's
    /// connection (H1: frames from any other say nothing about it).
    fn leased_request(&self, conn: ConnId, run_id: &str) -> Option<RequestId> {
        self.leases
            .get(run_id)
            .filter(|entry| entry.lease.conn == conn)
            .map(|entry| entry.lease.request)
    }

    /// A byte of `run_id`'s response reached its client's reply: it is
    /// committed, never retried. Only the lease's own connection counts
    /// (H1).
    pub(super) fn on_committed(&mut self, conn: ConnId, run_id: &str) {
        let Some(request) = self.leased_request(conn, run_id) else {
            return;
        };
        if let Some(Pending {
            state: RequestState::Dispatched { committed, .. },
            hint,
            ..
        }) = self.pending.get_mut(&request)
        {
            *committed = true;
            // Never dispatched again: a stream holds no copy of its prompt.
            *hint = RouteHint::default();
        }
    }

    /// U6: the response of `run_id` started; its deadline is off. Only the
    /// lease's own connection counts (H1).
    pub(super) fn on_responded(&mut self, conn: ConnId, run_id: &str) {
        let Some(request) = self.leased_request(conn, run_id) else {
            return;
        };
        if let Some(Pending {
            state:
                RequestState::Dispatched {
                    response_by,
                    responded,
                    ..
                },
            ..
        }) = self.pending.get_mut(&request)
        {
            *responded = true;
            if let Some(at) = response_by.take() {
                self.response_deadlines.remove(&(at, request));
            }
        }
    }

    /// U6: `request` got no response in time: its run is cancelled on the
    /// node, its client told, and its lease settles like a client cancel
    /// (on the terminal, or at the settle deadline).
    pub(super) fn on_response_wait_timeout(
        &mut self,
        now: Instant,
        request: RequestId,
        out: &mut Vec<Action>,
    ) {
        let Some(p) = self.pending.get_mut(&request) else {
            return;
        };
        let RequestState::Dispatched {
            run_id,
            response_by: Some(_),
            ..
        } = p.state.clone()
        else {
            return;
        };
        let settle_at = now + self.tunables.cancel_settle;
        p.state = RequestState::CancelPending {
            run_id: run_id.clone(),
            settle_at,
        };
        self.settle_deadlines.insert((settle_at, request));
        self.counters.response_wait_timeouts += 1;
        let Some((conn, provider)) = self
            .leases
            .get(&run_id)
            .map(|entry| (entry.lease.conn, entry.provider))
        else {
            return;
        };
        out.push(Action::SendCancel {
            conn,
            run_id,
            reason: CancelReason::ResponseWaitTimeout,
        });
        out.push(Action::Abort {
            request,
            reason: AbortReason::ResponseWaitTimeout,
        });
        self.record_end(
            now,
            provider,
            AttemptEnd::Failed(FailureReason::ResponseWaitTimeout),
            out,
        );
    }

    // ---- pre-commit failover -------------------------------------------------

    /// Puts dispatched `request` (its lease already released) back in its
    /// lane's queue until a candidate frees, at most until its response-wait
    /// deadline or the model's queue timeout; false when the queue is full.
    fn requeue(&mut self, request: RequestId) -> bool {
        let Some(now) = self.now else {
            return false;
        };
        let Some(p) = self.pending.get(&request) else {
            return false;
        };
        let spec = &self.models[p.model].spec;
        let (Some(lane), long, model) = (p.lane, p.long, p.model) else {
            return false;
        };
        if self.queued_count(model) >= spec.max_queue as usize {
            return false;
        }
        let mut deadline = now + spec.queue_timeout;
        if let Some(response_deadline) = p.response_deadline {
            deadline = deadline.min(response_deadline);
        }
        if let Some(Pending {
            state:
                RequestState::Dispatched {
                    response_by: Some(at),
                    ..
                },
            ..
        }) = self.pending.get(&request)
        {
            self.response_deadlines.remove(&(*at, request));
        }
        if let Some(p) = self.pending.get_mut(&request) {
            p.state = RequestState::Queued { deadline };
        }
        self.queue_deadlines.insert((deadline, request));
        self.enqueue(request, lane, long);
        true
    }

    /// `request`'s attempt failed (its lease already released) in a way
    /// another provider may not share: dispatches the next attempt to
    /// another candidate when nothing reached the client (`committed` or
    /// seen committed), the model allows more attempts, the response-wait
    /// deadline has not passed and a candidate not tried yet has a free
    /// slot. True when it did (the request goes on); false: the caller ends
    /// it.
    ///
    /// `fenced`: the attempt was lost with its node's connection (F1), not
    /// failed by its provider, so that provider is not held against the
    /// request: with no candidate now, a request that no provider failed
    /// waits in its queue again (until its response-wait deadline) for one,
    /// the same provider after its node's reconnect included.
    pub(super) fn try_failover(
        &mut self,
        request: RequestId,
        committed: bool,
        fenced: Option<usize>,
        out: &mut Vec<Action>,
    ) -> bool {
        if let (Some(q), Some(p)) = (fenced, self.pending.get_mut(&request)) {
            p.tried.retain(|&t| t != q);
        }
        let Some(p) = self.pending.get(&request) else {
            return false;
        };
        let RequestState::Dispatched {
            committed: seen_committed,
            ..
        } = p.state
        else {
            // Cancelled (by its client or the response-wait deadline).
            return false;
        };
        let max_attempts = self.models[p.model].spec.max_attempts;
        if max_attempts <= 1 {
            return false;
        }
        if committed || seen_committed {
            self.counters.failover_ineligible += 1;
            return false;
        }
        self.counters.failover_eligible += 1;
        if p.counted_attempts() >= max_attempts {
            self.counters.failover_exhausted += 1;
            return false;
        }
        if p.response_deadline
            .zip(self.now)
            .is_some_and(|(deadline, now)| now >= deadline)
        {
            self.counters.failover_deadline += 1;
            return false;
        }
        let Some(lane) = p.lane else {
            // A reload removed its model or the operation from the model:
            // it is not dispatched again.
            self.counters.failover_no_candidate += 1;
            return false;
        };
        let (long, attempt, tried, hint) =
            (p.long, p.attempts + 1, p.tried.clone(), p.hint.clone());
        let Some(dispatch) = self.try_admit(request, lane, long, attempt, &tried, &hint) else {
            if fenced.is_some() && tried.is_empty() && self.requeue(request) {
                self.counters.failover_requeued += 1;
                return true;
            }
            self.counters.failover_no_candidate += 1;
            return false;
        };
        self.counters.failover_retried += 1;
        // The provider the attempt was on: a fenced one is no longer in
        // `tried`.
        let from = fenced
            .or(tried.last().copied())
            .map(|q| self.providers[q].key.clone())
            .unwrap_or_else(|| dispatch.lease.provider.clone());
        self.start_attempt(request, &dispatch);
        out.push(Action::Event(Event::Failover {
            request,
            from,
            to: dispatch.lease.provider.clone(),
            attempt,
        }));
        out.push(Action::Dispatch(dispatch));
        true
    }

    /// `request`'s lease on `provider` (already released) was on a node
    /// that closed with `Close(drained)`, before any frame of its response:
    /// the node never started it, so it is not an attempt. It goes to a
    /// free candidate now (the fenced provider is none) or back to its
    /// queue, whatever `max_attempts`. False when it had started (it goes
    /// the way of any lost attempt) or cannot go on now: no free candidate
    /// it has not failed on, and it cannot wait in its queue (full, or a
    /// provider already failed it). Then it goes the way of a fenced
    /// attempt ([`Self::try_failover`]), with this dispatch not counted.
    pub(super) fn redispatch_unstarted(
        &mut self,
        request: RequestId,
        provider: Option<usize>,
        out: &mut Vec<Action>,
    ) -> bool {
        let Some(p) = self.pending.get_mut(&request) else {
            return false;
        };
        let RequestState::Dispatched {
            responded: false,
            committed: false,
            ..
        } = p.state
        else {
            return false;
        };
        let Some(lane) = p.lane else {
            return false;
        };
        // Not an attempt: neither counted nor held against the provider
        // (its next dispatch still gets a run id of its own).
        p.unstarted += 1;
        if let Some(q) = provider {
            if let Some(at) = p.tried.iter().rposition(|&t| t == q) {
                p.tried.remove(at);
            }
        }
        let (long, attempt, tried, hint) =
            (p.long, p.attempts + 1, p.tried.clone(), p.hint.clone());
        let sent = match self.try_admit(request, lane, long, attempt, &tried, &hint) {
            Some(dispatch) => {
                self.start_attempt(request, &dispatch);
                out.push(Action::Dispatch(dispatch));
                true
            }
            // The queue's pump does not avoid providers that failed the
            // request: only one that none failed waits there (as after a
            // fence).
            None if tried.is_empty() => self.requeue(request),
            None => false,
        };
        if sent {
            self.counters.drain_redispatched += 1;
        }
        sent
    }

    // ---- ends of leases and requests -----------------------------------------

    /// Releases the live lease of `run_id`: its slot frees. Every caller
    /// knows the lease is live (F1: released exactly once).
    pub(super) fn release(&mut self, run_id: &str) -> Option<ProviderLease> {
        let entry = self.leases.remove(run_id);
        debug_assert!(
            entry.is_some(),
            "F1: lease {run_id} released twice, or never taken"
        );
        let LeaseEntry { lease, provider } = entry?;
        if let Some(runs) = self.leases_of.get_mut(&lease.conn) {
            runs.remove(run_id);
            if runs.is_empty() {
                self.leases_of.remove(&lease.conn);
            }
        }
        let p = &mut self.providers[provider];
        debug_assert!(
            p.in_flight > 0 && (!lease.long || p.long_in_flight > 0),
            "P2: {} releases lease {run_id} with none in flight",
            p.key
        );
        p.in_flight = p.in_flight.saturating_sub(1);
        if lease.long {
            p.long_in_flight = p.long_in_flight.saturating_sub(1);
        }
        self.refresh(provider);
        Some(lease)
    }

    pub(super) fn forget_request(&mut self, request: RequestId) {
        if let Some(p) = self.pending.remove(&request) {
            match p.state {
                RequestState::CancelPending { settle_at, .. } => {
                    self.settle_deadlines.remove(&(settle_at, request));
                }
                RequestState::Queued { deadline } => {
                    self.queue_deadlines.remove(&(deadline, request));
                    if let Some(lane) = p.lane {
                        self.unqueue(request, lane, p.long);
                    }
                }
                RequestState::Dispatched { response_by, .. } => {
                    if let Some(at) = response_by {
                        self.response_deadlines.remove(&(at, request));
                    }
                }
            }
        }
    }

    pub(super) fn on_terminal(&mut self, now: Instant, t: Terminal, out: &mut Vec<Action>) {
        // H1: the reception identity must be the lease's connection.
        match self.leases.get(&t.run_id) {
            Some(entry) if entry.lease.conn == t.conn => {}
            _ => return,
        }
        let Some(provider) = self.leases.get(&t.run_id).map(|entry| entry.provider) else {
            return;
        };
        let Some(lease) = self.release(&t.run_id) else {
            return;
        };
        let request = lease.request;
        // H2: the evidence must match the immutable lease; the lease is
        // released either way.
        if let Some(stall) = t.stall {
            let matches = *t.adapter == *lease.adapter && *t.target == *lease.target;
            match stall.seq {
                Some(seq) if matches && stall.is_well_formed() => {
                    self.counters.health_evidence_accepted += 1;
                    self.counters.recovery_eligible += 1;
                    out.push(Action::StallHandoff {
                        request,
                        handoff: Handoff {
                            provider_id: lease.provider.provider_id.to_string(),
                            provider_health: stall.health,
                            recovery_handoff: "confirmed",
                        },
                    });
                    self.observe(
                        now,
                        &lease.provider,
                        lease.generation,
                        seq,
                        stall.health,
                        out,
                    );
                }
                _ => {
                    self.counters.health_evidence_rejected += 1;
                    self.counters.recovery_ineligible += 1;
                }
            }
        }
        self.record_end(now, provider, t.end, out);
        if t.end.is_retryable() && self.try_failover(request, t.committed, None, out) {
            self.pump(out);
            return;
        }
        if t.end == AttemptEnd::Answered
            && self
                .pending
                .get(&request)
                .is_some_and(|p| p.counted_attempts() > 1)
        {
            self.counters.failover_recovered += 1;
        }
        self.forget_request(request);
        out.push(Action::Done {
            request,
            outcome: Outcome::Completed,
        });
        self.pump(out);
    }
}
