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
//! - A request never waits for its preferred provider while another has a
//!   free slot: only free candidates are ever chosen (the bound on that
//!   wait is zero).
//! - `session`: rendezvous (highest random weight) hashing. Each provider's
//!   score for a key is a hash of the key and the provider's name, so adding
//!   or removing a provider moves only the sessions whose best it is or
//!   becomes; when the best is busy, the next best takes the session.
//! - `prefix`: a [`PrefixTree`] per model of what prompt text went to which
//!   provider ([`super::prefix`]). Every dispatch of a request with a prompt
//!   is recorded; a provider that is fenced or ejected is forgotten.

use bytes::Bytes;

use super::prefix::{PrefixTree, PrefixTreeSpec, ProviderId};
use super::{Control, RequestId};

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
}

/// A model's routing state.
#[derive(Debug)]
pub(super) struct Router {
    pub(super) spec: RoutingSpec,
    /// `Some` for `prefix`.
    pub(super) tree: Option<PrefixTree>,
    pub(super) stats: RoutingStats,
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
                let best = std::iter::once(least)
                    .chain(free.copied())
                    .max_by_key(|c| {
                        // Ties (never in practice) go to configured order.
                        (
                            score(session, self.providers[c.provider].key_hash),
                            std::cmp::Reverse(c.position),
                        )
                    })
                    .unwrap_or(least);
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
    }

    /// Provider `p` no longer holds what it was sent (its node was fenced,
    /// or it was ejected): every tree forgets it.
    pub(super) fn forget_routes(&mut self, p: usize) {
        for model in &mut self.models {
            if let Some(tree) = &mut model.router.tree {
                tree.remove_provider(ProviderId(p as u32));
            }
        }
    }

    /// The routing hint of pending `request` (empty when it has none).
    pub(super) fn hint_of(&self, request: RequestId) -> RouteHint {
        self.pending
            .get(&request)
            .map(|p| p.hint.clone())
            .unwrap_or_default()
    }
}
