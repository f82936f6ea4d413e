//! Routing policies: which free candidate of a lane a request goes to
//! (`[[models]] routing`). Sans-IO, part of [`Control`]'s dispatch.
//!
//! ```text
//!   free candidates of the lane, by load ──┬─ least_loaded: the first
//!                                           ├─ session: the free candidate scoring
//!                                           │    highest for the session key
//!                                           │    (rendezvous hashing over the pool)
//!                                           └─ prefix: the least loaded free candidate
//!                                                among those holding the longest
//!                                                matched prefix of the prompt, when
//!                                                it covers match_threshold of it
//!   then, for session and prefix: if the chosen one is busier than the least
//!   loaded by more than balance_abs_threshold requests and balance_rel_threshold
//!   times, the least loaded (the SGLang router's imbalance rule)
//! ```
//!
//! - **Affinity wait.** At its arrival, a request whose preferred provider
//!   (the most recent holder of its matched prefix, or its session's best
//!   live provider) is full waits for it at most `affinity_wait`, out of
//!   its lane's queue ([`Control::wait_for`]), so the requests behind it go
//!   on. A slot of that provider that frees goes to its oldest waiter first
//!   ([`Control::admit_waiters`], run by the pump); at the end of the wait
//!   the request joins its lane's queue at its place of arrival and takes
//!   any provider ([`Control::end_affinity_waits`]). Zero never waits; a
//!   provider too busy beside the least loaded one (the imbalance rule) is
//!   never waited for. Otherwise only free candidates are chosen.
//! - `session`: each session has a home, the provider it went to last
//!   ([`Sessions`]: bounded, idle sessions forgotten). A new session (or one
//!   whose home left) goes by rendezvous (highest random weight) hashing:
//!   each provider scores the key by a hash of the key and its name, and the
//!   free provider scoring highest takes it, among those holding fewer than
//!   [`SESSION_LOAD_BOUND_PCT`] of the average sessions (consistent hashing
//!   with bounded loads: hashing alone put five of twelve conversations on
//!   one of four providers, whose cache held four). Adding a provider moves
//!   no session; removing one moves only its own.
//! - `prefix`: a [`PrefixTree`] per model of what prompt text went to which
//!   provider ([`super::prefix`]). Every dispatch of a request with a prompt
//!   is recorded; a provider that is fenced or ejected is forgotten.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::prefix::{PrefixTree, PrefixTreeSpec, ProviderId};
use super::{Action, Control, RequestId};

pub use crate::config::RoutingPolicy;

/// A model's routing configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingSpec {
    /// The policy.
    pub policy: RoutingPolicy,
    /// The bounds of a `prefix` model's tree.
    pub tree: PrefixTreeSpec,
    /// The smallest share of a prompt (its first `tree.prefix_bytes_max`
    /// bytes), in percent, a match must cover to route by it.
    pub match_threshold_pct: u32,
    /// A preferred provider busier than the least loaded one by more than
    /// this many requests in flight…
    pub balance_abs_threshold: u32,
    /// …and more than this many hundredths times as busy is passed over.
    pub balance_rel_threshold_pct: u32,
    /// The longest a request waits for its preferred provider (the holder
    /// of its prefix, its session's provider) when that one is full; then
    /// it takes any. Zero: it never waits.
    pub affinity_wait: Duration,
}

impl Default for RoutingSpec {
    /// `least_loaded`, with the documented defaults of the other settings.
    fn default() -> Self {
        Self {
            policy: RoutingPolicy::LeastLoaded,
            tree: PrefixTreeSpec {
                budget_bytes: 32 << 20,
                prefix_bytes_max: 16 << 10,
            },
            match_threshold_pct: 50,
            balance_abs_threshold: 4,
            balance_rel_threshold_pct: 150,
            affinity_wait: Duration::ZERO,
        }
    }
}

/// What a request offers the routing policy, read from the client's
/// request by the shell (without building a JSON tree).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteHint {
    /// A hash of its session key (`prompt_cache_key`, `x-session-id`, or
    /// `user`), for `session`.
    pub session: Option<u64>,
    /// The first bytes of its prompt text, for `prefix`.
    pub prompt: Option<Bytes>,
}

/// How a dispatch chose its provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The least loaded free candidate (the policy, or its fallback).
    Load,
    /// The provider holding the longest matched prefix.
    Match,
    /// The session's provider.
    Session,
}

/// A routing decision ([`Control::pick`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pick {
    /// The provider.
    pub(super) provider: usize,
    /// How it was chosen.
    pub(super) route: Route,
    /// For `prefix`: how many bytes of the prompt the tree matched.
    pub(super) matched: Option<usize>,
    /// A preferred provider was free but passed over as too busy.
    pub(super) fell_back: bool,
}

/// Upper bounds (bytes, inclusive) of the matched-prefix histogram's
/// buckets; a last bucket takes the rest.
pub const MATCHED_BYTES_BUCKETS: [usize; 6] = [0, 256, 1024, 4096, 16384, 65536];

/// A model's routing counters, cumulative.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutingStats {
    /// Dispatches to the least loaded free candidate.
    pub by_load: u64,
    /// Dispatches to the holder of the longest matched prefix.
    pub by_match: u64,
    /// Dispatches to the session's provider.
    pub by_session: u64,
    /// Of `by_load`, dispatches where a preferred provider was free but
    /// passed over as too busy (the imbalance rule).
    pub imbalance_fallbacks: u64,
    /// Matched prefix lengths of `prefix` dispatches, per
    /// [`MATCHED_BYTES_BUCKETS`] bucket (not cumulative), the last for the
    /// rest.
    pub matched_bytes: [u64; MATCHED_BYTES_BUCKETS.len() + 1],
    /// The sum of those lengths.
    pub matched_bytes_sum: u64,
    /// Requests that waited for their preferred provider, full at their
    /// arrival.
    pub affinity_waits: u64,
    /// Of those, the ones whose wait ended before it freed (they went to
    /// any provider).
    pub affinity_waits_expired: u64,
}

/// A model's routing state.
#[derive(Debug)]
pub(super) struct Router {
    pub(super) spec: RoutingSpec,
    /// `Some` for `prefix`.
    pub(super) tree: Option<PrefixTree>,
    pub(super) stats: RoutingStats,
    /// Its requests in an affinity wait now.
    pub(super) waiting: usize,
    /// For `session`: where each recent session went.
    pub(super) sessions: Sessions,
}

/// A session left alone this long is forgotten (its provider's cache has
/// moved on).
pub const SESSION_IDLE: Duration = Duration::from_secs(600);
/// Most sessions a model remembers (the least recently used go first):
/// about 64 bytes each.
pub const SESSIONS_MAX: usize = 65_536;
/// A new session's provider holds at most this many hundredths of the
/// average of the live providers' sessions (consistent hashing with
/// bounded loads): a provider whose share of the hash would overfill its
/// cache passes the session to the next in the session's order.
pub const SESSION_LOAD_BOUND_PCT: usize = 125;

/// The recent sessions of a `session` model: each one's home (the provider
/// it went to last, which holds its cache), and how many each provider
/// holds. Bounded by [`SESSIONS_MAX`] and [`SESSION_IDLE`].
#[derive(Debug, Default)]
pub(super) struct Sessions {
    home: HashMap<u64, (usize, Instant)>,
    by_use: BTreeSet<(Instant, u64)>,
    per_provider: HashMap<usize, usize>,
}

impl Sessions {
    /// Where `session` went last, if it is remembered.
    pub(super) fn home(&self, session: u64) -> Option<usize> {
        self.home.get(&session).map(|&(p, _)| p)
    }

    /// The sessions provider `p` holds.
    pub(super) fn count(&self, p: usize) -> usize {
        self.per_provider.get(&p).copied().unwrap_or(0)
    }

    /// The most sessions a provider may hold and still take a new one,
    /// with `live` providers: [`SESSION_LOAD_BOUND_PCT`] of the average
    /// with the new one, rounded up.
    pub(super) fn bound(&self, live: usize) -> usize {
        let total = self.home.len() + 1;
        (total * SESSION_LOAD_BOUND_PCT).div_ceil(100 * live.max(1))
    }

    /// `session` went to `p` at `now`: its home from now on. Forgets the
    /// sessions idle past [`SESSION_IDLE`] and the least recently used
    /// beyond [`SESSIONS_MAX`].
    pub(super) fn record(&mut self, session: u64, p: usize, now: Instant) {
        if let Some((was, at)) = self.home.insert(session, (p, now)) {
            self.by_use.remove(&(at, session));
            self.release(was);
        }
        self.by_use.insert((now, session));
        *self.per_provider.entry(p).or_default() += 1;
        while let Some(&(at, oldest)) = self.by_use.first() {
            let idle = now.saturating_duration_since(at) > SESSION_IDLE;
            if !idle && self.home.len() <= SESSIONS_MAX {
                break;
            }
            self.by_use.remove(&(at, oldest));
            if let Some((was, _)) = self.home.remove(&oldest) {
                self.release(was);
            }
        }
    }

    /// Forgets every session of provider `p`.
    pub(super) fn forget_provider(&mut self, p: usize) {
        if self.per_provider.remove(&p).is_none() {
            return;
        }
        let gone: Vec<(u64, Instant)> = self
            .home
            .iter()
            .filter(|(_, &(q, _))| q == p)
            .map(|(&s, &(_, at))| (s, at))
            .collect();
        for (session, at) in gone {
            self.home.remove(&session);
            self.by_use.remove(&(at, session));
        }
    }

    fn release(&mut self, p: usize) {
        if let Some(n) = self.per_provider.get_mut(&p) {
            *n -= 1;
            if *n == 0 {
                self.per_provider.remove(&p);
            }
        }
    }

    /// Renumbers the providers through `map` (a reload), dropping the
    /// sessions of those it maps to `None`.
    pub(super) fn remap(&mut self, map: impl Fn(usize) -> Option<usize>) {
        let old = std::mem::take(&mut self.home);
        self.by_use.clear();
        self.per_provider.clear();
        for (session, (p, at)) in old {
            if let Some(q) = map(p) {
                self.home.insert(session, (q, at));
                self.by_use.insert((at, session));
                *self.per_provider.entry(q).or_default() += 1;
            }
        }
    }

    /// How many sessions it remembers.
    pub(super) fn len(&self) -> usize {
        self.home.len()
    }

    /// The sum of the providers' counts (equal to [`Self::len`]).
    pub(super) fn counted(&self) -> usize {
        debug_assert_eq!(self.by_use.len(), self.home.len());
        self.per_provider.values().sum()
    }
}

/// A queued request waiting for its preferred provider.
#[derive(Debug, Clone, Copy)]
pub(super) struct Waiting {
    pub(super) provider: usize,
    pub(super) until: Instant,
    pub(super) lane: usize,
    pub(super) long: bool,
}

impl Router {
    pub(super) fn new(spec: RoutingSpec) -> Self {
        let tree = (spec.policy == RoutingPolicy::Prefix)
            // A budget below an empty tree's is refused by config
            // validation; a spec built elsewhere falls back to the least.
            .then(|| PrefixTree::new(spec.tree).ok())
            .flatten();
        Self {
            spec,
            tree,
            stats: RoutingStats::default(),
            waiting: 0,
            sessions: Sessions::default(),
        }
    }
}

/// A provider's name hashed, for rendezvous scores.
pub(super) fn provider_hash(node_id: &str, provider_id: &str) -> u64 {
    let mut hasher = blake3::Hasher::new();
    hasher.update(node_id.as_bytes());
    hasher.update(b"/");
    hasher.update(provider_id.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// A session key hashed (the shell's half of [`RouteHint::session`]).
pub fn session_hash(key: &[u8]) -> u64 {
    let digest = blake3::hash(key);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// The rendezvous score of a provider for a session: SplitMix64's
/// finalizer over both hashes (well mixed, stable across processes).
fn score(session: u64, provider: u64) -> u64 {
    let mut z = session ^ provider.rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Control {
    /// The free candidate of `lane` (not in `exclude`) a request with
    /// `hint` goes to under its model's policy. `None` when no candidate is
    /// free.
    pub(super) fn pick(
        &self,
        lane: usize,
        long: bool,
        exclude: &[usize],
        hint: &RouteHint,
    ) -> Option<Pick> {
        let mut free = self.lanes[lane]
            .candidates(long)
            .iter()
            .filter(|c| !exclude.contains(&c.provider));
        let least = *free.next()?;
        let by_load = |matched| Pick {
            provider: least.provider,
            route: Route::Load,
            matched,
            fell_back: false,
        };
        let router = &self.models[self.lanes[lane].model].router;
        let (preferred, route, matched) = match router.spec.policy {
            RoutingPolicy::LeastLoaded => return Some(by_load(None)),
            RoutingPolicy::Session => {
                let Some(session) = hint.session else {
                    return Some(by_load(None));
                };
                let mut free: Vec<_> = std::iter::once(least).chain(free.copied()).collect();
                // Its home, if free; else the free provider scoring highest
                // for it among those under the session bound (ties, never
                // in practice, go to configured order).
                let home = router.sessions.home(session);
                let best = match free.iter().find(|c| Some(c.provider) == home) {
                    Some(c) => *c,
                    None => {
                        free.sort_by_key(|c| {
                            std::cmp::Reverse((
                                score(session, self.providers[c.provider].key_hash),
                                std::cmp::Reverse(c.position),
                            ))
                        });
                        let bound = router.sessions.bound(self.live_members(lane, long).count());
                        free.iter()
                            .find(|c| router.sessions.count(c.provider) < bound)
                            .copied()
                            .unwrap_or(free[0])
                    }
                };
                (best, Route::Session, None)
            }
            RoutingPolicy::Prefix => {
                let (Some(tree), Some(prompt)) = (&router.tree, &hint.prompt) else {
                    return Some(by_load(None));
                };
                let considered = prompt.len().min(router.spec.tree.prefix_bytes_max);
                let m = tree.longest_match(prompt);
                let covers = considered > 0
                    && m.matched_len as u64 * 100
                        >= u64::from(router.spec.match_threshold_pct) * considered as u64;
                let holder = if covers {
                    std::iter::once(least).chain(free.copied()).find(|c| {
                        m.providers
                            .binary_search_by_key(&ProviderId(c.provider as u32), |&(p, _)| p)
                            .is_ok()
                    })
                } else {
                    None
                };
                match holder {
                    Some(c) => (c, Route::Match, Some(m.matched_len)),
                    None => return Some(by_load(Some(m.matched_len))),
                }
            }
        };
        if preferred.provider != least.provider
            && self.too_busy(preferred.provider, least.provider, &router.spec)
        {
            return Some(Pick {
                fell_back: true,
                ..by_load(matched)
            });
        }
        Some(Pick {
            provider: preferred.provider,
            route,
            matched,
            fell_back: false,
        })
    }

    /// The imbalance rule: `preferred` has more than the absolute threshold
    /// more requests in flight than `least`, and more than the relative
    /// threshold times as many.
    fn too_busy(&self, preferred: usize, least: usize, spec: &RoutingSpec) -> bool {
        let busy = u64::from(self.providers[preferred].in_flight);
        let idle = u64::from(self.providers[least].in_flight);
        busy > idle + u64::from(spec.balance_abs_threshold)
            && busy * 100 > idle * u64::from(spec.balance_rel_threshold_pct)
    }

    /// Records a dispatch of a request with `hint` chosen by `pick` in its
    /// model's routing state: the counters, and the prompt in the tree.
    pub(super) fn routed(&mut self, lane: usize, pick: Pick, hint: &RouteHint) {
        let Pick {
            provider,
            route,
            matched,
            fell_back,
        } = pick;
        let now = self.now;
        let router = &mut self.models[self.lanes[lane].model].router;
        let stats = &mut router.stats;
        match route {
            Route::Load => stats.by_load += 1,
            Route::Match => stats.by_match += 1,
            Route::Session => stats.by_session += 1,
        }
        if fell_back {
            stats.imbalance_fallbacks += 1;
        }
        if let Some(len) = matched {
            let bucket = MATCHED_BYTES_BUCKETS
                .iter()
                .position(|&upper| len <= upper)
                .unwrap_or(MATCHED_BYTES_BUCKETS.len());
            stats.matched_bytes[bucket] += 1;
            stats.matched_bytes_sum += len as u64;
        }
        if let (Some(tree), Some(prompt), Some(now)) = (&mut router.tree, &hint.prompt, now) {
            tree.insert(prompt, ProviderId(provider as u32), now);
        }
        if let (RoutingPolicy::Session, Some(session), Some(now)) =
            (router.spec.policy, hint.session, now)
        {
            router.sessions.record(session, provider, now);
        }
    }

    /// The provider a request with `hint` should wait for: its preferred
    /// one (the most recent holder of a match covering the threshold, or
    /// the session's best of the live providers), when the model waits at
    /// all, that provider is live but full, and it is not too busy beside
    /// the least loaded live provider (then the request goes anywhere).
    pub(super) fn preferred_busy(
        &self,
        lane: usize,
        long: bool,
        hint: &RouteHint,
    ) -> Option<usize> {
        let router = &self.models[self.lanes[lane].model].router;
        if router.spec.affinity_wait.is_zero() {
            return None;
        }
        let live = |p: usize| {
            self.takes_new_work(p)
                && self.providers[p].outlier.ejection().is_none()
                && (!long || self.providers[p].spec.long_context_capacity > 0)
        };
        let members = &self.lanes[lane].members;
        let preferred = match router.spec.policy {
            RoutingPolicy::LeastLoaded => None,
            RoutingPolicy::Session => router
                .sessions
                .home(hint.session?)
                .filter(|&p| members.contains(&p) && live(p)),
            RoutingPolicy::Prefix => {
                let (tree, prompt) = (router.tree.as_ref()?, hint.prompt.as_ref()?);
                let considered = prompt.len().min(router.spec.tree.prefix_bytes_max);
                let m = tree.longest_match(prompt);
                let covers = considered > 0
                    && m.matched_len as u64 * 100
                        >= u64::from(router.spec.match_threshold_pct) * considered as u64;
                if !covers {
                    return None;
                }
                m.providers
                    .iter()
                    .filter(|&&(ProviderId(p), _)| {
                        members.contains(&(p as usize)) && live(p as usize)
                    })
                    .max_by_key(|&&(_, at)| at)
                    .map(|&(ProviderId(p), _)| p as usize)
            }
        }?;
        if self.lanes[lane]
            .candidates(long)
            .iter()
            .any(|c| c.provider == preferred)
        {
            return None; // Free: `pick` takes it.
        }
        let least = members
            .iter()
            .copied()
            .filter(|&p| live(p))
            .min_by_key(|&p| self.providers[p].in_flight)?;
        (!self.too_busy(preferred, least, &router.spec)).then_some(preferred)
    }

    /// Queued `request` of model `m` waits for provider `p`, out of its
    /// lane's queue, until the model's affinity wait is over.
    pub(super) fn wait_for(&mut self, now: Instant, request: RequestId, m: usize, p: usize) {
        let Some(pending) = self.pending.get(&request) else {
            return;
        };
        let (lane, long) = (pending.lane, pending.long);
        let Some(lane) = lane else {
            return;
        };
        let router = &mut self.models[m].router;
        let until = now + router.spec.affinity_wait;
        router.waiting += 1;
        router.stats.affinity_waits += 1;
        self.waiting.insert(
            request,
            Waiting {
                provider: p,
                until,
                lane,
                long,
            },
        );
        self.waiters.entry(p).or_default().insert(request);
        self.affinity_deadlines.insert((until, request));
    }

    /// Ends `request`'s affinity wait, if it waits; true if it did.
    pub(super) fn stop_waiting(&mut self, request: RequestId) -> bool {
        let Some(w) = self.waiting.remove(&request) else {
            return false;
        };
        if let Some(set) = self.waiters.get_mut(&w.provider) {
            set.remove(&request);
            if set.is_empty() {
                self.waiters.remove(&w.provider);
            }
        }
        self.affinity_deadlines.remove(&(w.until, request));
        let model = self.lanes[w.lane].model;
        self.models[model].router.waiting -= 1;
        true
    }

    /// Dispatches the requests waiting for a provider that has a free slot
    /// now, the oldest first, to that provider.
    pub(super) fn admit_waiters(&mut self, out: &mut Vec<Action>) {
        loop {
            let next = self.waiters.iter().find_map(|(&p, requests)| {
                requests.iter().copied().find(|r| {
                    let w = &self.waiting[r];
                    self.lanes[w.lane]
                        .candidates(w.long)
                        .iter()
                        .any(|c| c.provider == p)
                })
            });
            let Some(request) = next else {
                return;
            };
            let w = self.waiting[&request];
            self.stop_waiting(request);
            let policy = self.models[self.lanes[w.lane].model].router.spec.policy;
            let route = match policy {
                RoutingPolicy::Session => Route::Session,
                _ => Route::Match,
            };
            let attempt = self.pending.get(&request).map_or(1, |p| p.attempts + 1);
            let hint = self.hint_of(request);
            let pick = Pick {
                provider: w.provider,
                route,
                matched: None,
                fell_back: false,
            };
            match self.take_lease(request, w.lane, w.long, attempt, pick, &hint) {
                Some(dispatch) => {
                    self.start_attempt(request, &dispatch);
                    out.push(Action::Dispatch(dispatch));
                }
                // Not reachable (a free candidate has a ready owner): it
                // waits in its lane's queue like any other.
                None => self.enqueue(request, w.lane, w.long),
            }
        }
    }

    /// Affinity waits over at `now`: those requests join their lane's
    /// queue at their place of arrival. True if any did (the pump runs).
    pub(super) fn end_affinity_waits(&mut self, now: Instant) -> bool {
        let mut any = false;
        while let Some(&(at, request)) = self.affinity_deadlines.first() {
            if at > now {
                break;
            }
            let w = self.waiting[&request];
            self.stop_waiting(request);
            let model = self.lanes[w.lane].model;
            self.models[model].router.stats.affinity_waits_expired += 1;
            self.enqueue(request, w.lane, w.long);
            any = true;
        }
        any
    }

    /// Provider `p` no longer holds what it was sent (its node was fenced,
    /// or it was ejected): every tree and session table forgets it, and the
    /// requests waiting for it join their lanes' queues now rather than at
    /// the end of their wait. True if any did (the caller pumps).
    pub(super) fn forget_routes(&mut self, p: usize) -> bool {
        for model in &mut self.models {
            if let Some(tree) = &mut model.router.tree {
                tree.remove_provider(ProviderId(p as u32));
            }
            model.router.sessions.forget_provider(p);
        }
        let waiting: Vec<RequestId> = self
            .waiters
            .get(&p)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        for &request in &waiting {
            let w = self.waiting[&request];
            self.stop_waiting(request);
            self.enqueue(request, w.lane, w.long);
        }
        !waiting.is_empty()
    }

    /// The providers of `lane` that may take new work (ejected or not).
    fn live_members(&self, lane: usize, long: bool) -> impl Iterator<Item = usize> + '_ {
        self.lanes[lane].members.iter().copied().filter(move |&p| {
            self.takes_new_work(p)
                && self.providers[p].outlier.ejection().is_none()
                && (!long || self.providers[p].spec.long_context_capacity > 0)
        })
    }

    /// The routing hint of pending `request` (empty when it has none).
    pub(super) fn hint_of(&self, request: RequestId) -> RouteHint {
        self.pending
            .get(&request)
            .map(|p| p.hint.clone())
            .unwrap_or_default()
    }
}
