//! Per-principal limits: concurrent requests, requests per minute and tokens
//! per minute, checked before a request takes a lease.
//!
//! Sans-IO: every call takes `now`; the shell holds one [`Limiter`] for the
//! whole process (behind a lock taken once at admission and once at the
//! end, never per chunk) so a principal's limits hold across shards.
//!
//! The two rates are token buckets in the GCRA form: a bucket of `limit`
//! units refills continuously at `limit` per minute, and its state is one
//! instant, the *theoretical arrival time* (`tat`). With `T = 60 s / limit`
//! (the time one unit takes to refill), the bucket is full when
//! `tat <= now`, holds `(now + 60 s - tat) / T` units otherwise, and a
//! request costing `c` units is admitted when `max(tat, now) + c·T` is at
//! most one minute ahead of `now`.
//!
//! Tokens are known only after the provider reports usage, so admission
//! reserves an estimate and [`Limiter::finish`] settles it: the observed
//! total replaces the estimate (a refund or a debt), and a request without
//! observed usage keeps its estimate. The estimate is the documented
//! [`estimate_prompt_tokens`] (request body bytes ÷ 4), clamped to the
//! limit so that a large request waits for a full bucket instead of never
//! being admitted.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_engine::net::PeerLimit;

use crate::config::{LimitSpec, ListenerLimits};

/// The refill period of both rates.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Bytes of request body counted as one prompt token by the pre-dispatch
/// estimate.
pub const BYTES_PER_ESTIMATED_TOKEN: u64 = 4;

/// What one peer address may hold of each listener, for the whole process
/// (every shard shares the tables;
/// [`iop_engine::net::PeerLimit`] holds the counts).
#[derive(Debug, Clone)]
pub struct PeerLimits {
    /// Open client connections (`edge.max_client_connections_per_peer`).
    pub clients: Arc<PeerLimit>,
    /// Node handshakes in progress (`edge.max_node_handshakes_per_peer`).
    pub node_handshakes: Arc<PeerLimit>,
}

impl PeerLimits {
    /// Empty tables with `limits`' caps.
    pub fn new(limits: &ListenerLimits) -> Self {
        let cap = |limit: u64| usize::try_from(limit).unwrap_or(usize::MAX);
        Self {
            clients: PeerLimit::new(cap(limits.max_client_connections_per_peer)),
            node_handshakes: PeerLimit::new(cap(limits.max_node_handshakes_per_peer)),
        }
    }
}

/// The pre-dispatch prompt estimate: one token per
/// [`BYTES_PER_ESTIMATED_TOKEN`] bytes of request body, at least one.
pub fn estimate_prompt_tokens(body_bytes: usize) -> u64 {
    (body_bytes as u64)
        .div_ceil(BYTES_PER_ESTIMATED_TOKEN)
        .max(1)
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// `max_concurrent`.
    Concurrent,
    /// `requests_per_minute`.
    Requests,
    /// `tokens_per_minute`.
    Tokens,
}

impl LimitKind {
    /// The reason as it appears in errors, logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Concurrent => "concurrency",
            LimitKind::Requests => "requests",
            LimitKind::Tokens => "tokens",
        }
    }
}

/// One rate's state as OpenAI's `x-ratelimit-*` headers show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateWindow {
    /// `x-ratelimit-limit-*`: the per-minute limit.
    pub limit: u32,
    /// `x-ratelimit-remaining-*`: units available now.
    pub remaining: u32,
    /// `x-ratelimit-reset-*`: time until the bucket is full again.
    pub reset: Duration,
}

/// The rate headers of a response: each rate the principal has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    /// The requests-per-minute bucket.
    pub requests: Option<RateWindow>,
    /// The tokens-per-minute bucket.
    pub tokens: Option<RateWindow>,
}

impl RateHeaders {
    /// Appends the OpenAI `x-ratelimit-*` header lines (each ending CRLF).
    pub fn write_openai(&self, out: &mut String) {
        for (suffix, window) in [("requests", self.requests), ("tokens", self.tokens)] {
            let Some(w) = window else { continue };
            let _ = write!(
                out,
                "x-ratelimit-limit-{suffix}: {}\r\nx-ratelimit-remaining-{suffix}: {}\r\n\
                 x-ratelimit-reset-{suffix}: {}\r\n",
                w.limit,
                w.remaining,
                format_reset(w.reset)
            );
        }
    }
}

/// A refusal: which limit, when to retry, and the rate headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The limit that refused.
    pub kind: LimitKind,
    /// The configured value of that limit.
    pub limit: u32,
    /// When a retry can succeed (for the concurrency limit, a short fixed
    /// pause: its capacity returns when some request ends, which no clock
    /// predicts).
    pub retry_after: Duration,
    /// The rate headers at refusal.
    pub headers: RateHeaders,
    /// In a cluster: the live Edges the key's limits are shared by (1:
    /// this Edge alone). With a limit of 0 here, this Edge's share is 0.
    pub shared_by: u32,
}

impl Refusal {
    /// `retry-after` in whole seconds, rounded up, at least 1.
    pub fn retry_after_secs(&self) -> u64 {
        ceil_secs(self.retry_after).max(1)
    }

    /// The error message for the client.
    pub fn message(&self) -> String {
        if self.limit == 0 && self.shared_by > 1 {
            return format!(
                "rate limit reached: this key's {} limit is shared by the cluster's {} edges and \
                 this edge's share is 0; send this key's requests to another edge",
                self.kind.as_str(),
                self.shared_by
            );
        }
        match self.kind {
            LimitKind::Concurrent => format!(
                "rate limit reached: at most {} requests in flight for this key",
                self.limit
            ),
            LimitKind::Requests => format!(
                "rate limit reached: {} requests per minute for this key; retry in {}",
                self.limit,
                format_reset(self.retry_after)
            ),
            LimitKind::Tokens => format!(
                "rate limit reached: {} tokens per minute for this key; retry in {}",
                self.limit,
                format_reset(self.retry_after)
            ),
        }
    }
}

/// How long a refusal by the concurrency limit asks the client to wait.
pub const CONCURRENCY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// An admitted request's claim on its principal's limits; give it back with
/// [`Limiter::finish`] exactly once. Not `Clone`: the claim is the request's.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket holds a concurrency slot until Limiter::finish"]
pub struct Ticket {
    /// `None` for a principal without limits.
    principal: Option<Arc<str>>,
    /// The limiter configuration the slot was taken under.
    epoch: u64,
    reserved_tokens: u64,
}

/// An admission's outcome.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Admitted; the headers are the state after this request's charge.
    Granted(Ticket, RateHeaders),
    /// Over a limit.
    Refused(Refusal),
}

/// A GCRA bucket of `limit` units per [`WINDOW`].
#[derive(Debug, Clone, Copy)]
struct Bucket {
    limit: u32,
    /// Nanoseconds one unit takes to refill.
    unit_ns: u64,
    /// Theoretical arrival time; `None` = full.
    tat: Option<Instant>,
}

impl Bucket {
    fn new(limit: u32) -> Bucket {
        let limit = limit.max(1);
        Bucket {
            limit,
            unit_ns: (WINDOW.as_nanos() as u64 / u64::from(limit)).max(1),
            tat: None,
        }
    }

    fn cost(&self, units: u64) -> Duration {
        Duration::from_nanos(units.saturating_mul(self.unit_ns))
    }

    fn base(&self, now: Instant) -> Instant {
        match self.tat {
            Some(tat) if tat > now => tat,
            _ => now,
        }
    }

    /// `Ok(())` after charging `units`, or `Err(wait)` until it would fit.
    fn try_charge(&mut self, units: u64, now: Instant) -> Result<(), Duration> {
        let new_tat = self.base(now) + self.cost(units);
        let ahead = new_tat.saturating_duration_since(now);
        if ahead > WINDOW {
            return Err(ahead - WINDOW);
        }
        self.tat = Some(new_tat);
        Ok(())
    }

    /// Adds `units` of debt (observed beyond the reservation).
    fn charge_debt(&mut self, units: u64, now: Instant) {
        self.tat = Some(self.base(now) + self.cost(units));
    }

    /// Gives `units` back.
    fn refund(&mut self, units: u64, now: Instant) {
        if let Some(tat) = self.tat {
            let back = tat.checked_sub(self.cost(units)).unwrap_or(now);
            self.tat = (back > now).then_some(back);
        }
    }

    fn window(&self, now: Instant) -> RateWindow {
        let ahead = self.base(now).saturating_duration_since(now);
        let free = WINDOW.saturating_sub(ahead);
        let remaining = (free.as_nanos() / u128::from(self.unit_ns)).min(u128::from(self.limit));
        RateWindow {
            limit: self.limit,
            remaining: remaining as u32,
            reset: ahead,
        }
    }
}

#[derive(Debug)]
struct PrincipalState {
    spec: LimitSpec,
    /// The configuration the buckets were created under.
    buckets_epoch: u64,
    /// The configuration since which the principal has been listed: older
    /// tickets hold no slot in `in_flight`.
    listed_since: u64,
    in_flight: u32,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl PrincipalState {
    fn new(spec: LimitSpec, epoch: u64) -> PrincipalState {
        PrincipalState {
            spec,
            buckets_epoch: epoch,
            listed_since: epoch,
            in_flight: 0,
            requests: spec.requests_per_minute.map(Bucket::new),
            tokens: spec.tokens_per_minute.map(Bucket::new),
        }
    }

    fn headers(&self, now: Instant) -> RateHeaders {
        RateHeaders {
            requests: self.requests.map(|b| b.window(now)),
            tokens: self.tokens.map(|b| b.window(now)),
        }
    }
}

/// Every principal's limits and what they have used.
#[derive(Debug, Default)]
pub struct Limiter {
    index: HashMap<Arc<str>, usize>,
    states: Vec<PrincipalState>,
    /// Bumped by [`Limiter::configure`]: a ticket settles tokens only into
    /// buckets at least as old as itself.
    epoch: u64,
    /// The limits as configured (for the whole cluster), in config order.
    configured: Vec<(Arc<str>, LimitSpec)>,
    /// Live Edges sharing the limits ([`Limiter::set_share`]); 0 and 1
    /// mean this Edge alone.
    edges: u32,
    /// This Edge's rank among them.
    rank: u32,
}

/// The part of `limits` that the Edge of rank `rank` (0-based, in the
/// order of the live Edges' names) of `edges` live Edges enforces: each
/// limit split so the parts add up to it exactly — every Edge gets
/// `limit / edges`, and the first `limit % edges` one more. With a limit
/// below the number of Edges some Edges' part is 0: they refuse the key
/// (the cluster as a whole still admits up to the limit).
pub fn share_of(limits: LimitSpec, edges: u32, rank: u32) -> LimitSpec {
    let edges = edges.max(1);
    let part = |v: Option<u32>| v.map(|v| v / edges + u32::from(rank < v % edges));
    LimitSpec {
        max_concurrent: part(limits.max_concurrent),
        requests_per_minute: part(limits.requests_per_minute),
        tokens_per_minute: part(limits.tokens_per_minute),
    }
}

impl Limiter {
    /// A limiter for these principals.
    pub fn new<'a>(specs: impl IntoIterator<Item = (&'a str, LimitSpec)>) -> Limiter {
        let mut limiter = Limiter::default();
        limiter.configure(specs);
        limiter
    }

    /// Applies a new configuration (SIGHUP). A principal whose limits are
    /// unchanged keeps its usage; one whose limits changed keeps its
    /// in-flight count and starts with full buckets; one no longer listed is
    /// forgotten (its in-flight requests finish without effect).
    pub fn configure<'a>(&mut self, specs: impl IntoIterator<Item = (&'a str, LimitSpec)>) {
        self.configured = specs
            .into_iter()
            .map(|(name, spec)| (Arc::<str>::from(name), spec))
            .collect();
        self.apply();
    }

    /// In a cluster: the limits are shared by `edges` live Edges, of which
    /// this one is `rank` in name order, and this one enforces its
    /// [`share_of`] them. A change is applied like a reload
    /// ([`Limiter::configure`]): in-flight counts stay, buckets of a
    /// changed share start full.
    pub fn set_share(&mut self, edges: u32, rank: u32) {
        let edges = edges.max(1);
        let rank = rank.min(edges - 1);
        if (edges, rank) != (self.edges.max(1), self.rank) {
            self.edges = edges;
            self.rank = rank;
            self.apply();
        }
    }

    /// Applies [`Limiter::configure`]'s limits under the current share.
    fn apply(&mut self) {
        self.epoch += 1;
        let mut index = HashMap::new();
        let mut states = Vec::new();
        let configured = std::mem::take(&mut self.configured);
        for (name, spec) in &configured {
            let (name, spec) = (&**name, share_of(*spec, self.edges, self.rank));
            if spec.is_unlimited() || index.contains_key(name) {
                continue;
            }
            let state = match self.index.get(name).map(|&i| &self.states[i]) {
                Some(old) if old.spec == spec => PrincipalState {
                    spec,
                    buckets_epoch: old.buckets_epoch,
                    listed_since: old.listed_since,
                    in_flight: old.in_flight,
                    requests: old.requests,
                    tokens: old.tokens,
                },
                Some(old) => PrincipalState {
                    listed_since: old.listed_since,
                    in_flight: old.in_flight,
                    ..PrincipalState::new(spec, self.epoch)
                },
                None => PrincipalState::new(spec, self.epoch),
            };
            index.insert(Arc::<str>::from(name), states.len());
            states.push(state);
        }
        self.index = index;
        self.states = states;
        self.configured = configured;
    }

    /// Admits a request of `principal` whose prompt is estimated at
    /// `estimated_tokens`, or says which limit refuses it. A principal the
    /// limiter doesn't know is unlimited.
    pub fn admit(&mut self, principal: &str, estimated_tokens: u64, now: Instant) -> Admission {
        let Some((name, &i)) = self.index.get_key_value(principal) else {
            return Admission::Granted(
                Ticket {
                    principal: None,
                    epoch: self.epoch,
                    reserved_tokens: 0,
                },
                RateHeaders::default(),
            );
        };
        let shared_by = self.edges.max(1);
        let st = &mut self.states[i];
        // A share of 0 (a cluster limit below the number of Edges).
        for (kind, value, retry_after) in [
            (
                LimitKind::Concurrent,
                st.spec.max_concurrent,
                CONCURRENCY_RETRY_AFTER,
            ),
            (LimitKind::Requests, st.spec.requests_per_minute, WINDOW),
            (LimitKind::Tokens, st.spec.tokens_per_minute, WINDOW),
        ] {
            if value == Some(0) {
                return Admission::Refused(Refusal {
                    kind,
                    limit: 0,
                    retry_after,
                    headers: st.headers(now),
                    shared_by,
                });
            }
        }
        if let Some(max) = st.spec.max_concurrent {
            if st.in_flight >= max {
                return Admission::Refused(Refusal {
                    kind: LimitKind::Concurrent,
                    limit: max,
                    retry_after: CONCURRENCY_RETRY_AFTER,
                    headers: st.headers(now),
                    shared_by,
                });
            }
        }
        // Check both buckets before charging either.
        let mut requests = st.requests;
        if let Some(b) = requests.as_mut() {
            if let Err(wait) = b.try_charge(1, now) {
                return Admission::Refused(Refusal {
                    kind: LimitKind::Requests,
                    limit: b.limit,
                    retry_after: wait,
                    headers: st.headers(now),
                    shared_by,
                });
            }
        }
        let mut tokens = st.tokens;
        let mut reserved = 0;
        if let Some(b) = tokens.as_mut() {
            reserved = estimated_tokens.min(u64::from(b.limit));
            if let Err(wait) = b.try_charge(reserved, now) {
                return Admission::Refused(Refusal {
                    kind: LimitKind::Tokens,
                    limit: b.limit,
                    retry_after: wait,
                    headers: st.headers(now),
                    shared_by,
                });
            }
        }
        st.requests = requests;
        st.tokens = tokens;
        st.in_flight += 1;
        Admission::Granted(
            Ticket {
                principal: Some(Arc::clone(name)),
                epoch: self.epoch,
                reserved_tokens: reserved,
            },
            st.headers(now),
        )
    }

    /// Ends an admitted request: frees its concurrency slot and settles its
    /// token reservation against `observed_tokens` (prompt + completion as
    /// the provider reported them; `None` keeps the estimate).
    pub fn finish(&mut self, ticket: Ticket, observed_tokens: Option<u64>, now: Instant) {
        let Some(name) = ticket.principal else { return };
        let Some(&i) = self.index.get(&name) else {
            return; // no longer limited
        };
        let st = &mut self.states[i];
        if ticket.epoch < st.listed_since {
            return; // taken before a reload listed the principal again
        }
        st.in_flight = st.in_flight.saturating_sub(1);
        if ticket.epoch < st.buckets_epoch {
            return; // reserved in buckets a reload replaced
        }
        if let (Some(b), Some(seen)) = (st.tokens.as_mut(), observed_tokens) {
            if seen > ticket.reserved_tokens {
                b.charge_debt(seen - ticket.reserved_tokens, now);
            } else {
                b.refund(ticket.reserved_tokens - seen, now);
            }
        }
    }

    /// The rate headers of `principal` now (for responses that were
    /// admitted earlier, e.g. at the end of a stream).
    pub fn headers(&self, principal: &str, now: Instant) -> RateHeaders {
        self.index
            .get(principal)
            .map(|&i| self.states[i].headers(now))
            .unwrap_or_default()
    }

    /// Requests of `principal` in flight.
    pub fn in_flight(&self, principal: &str) -> u32 {
        self.index
            .get(principal)
            .map_or(0, |&i| self.states[i].in_flight)
    }
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// A reset time as OpenAI writes it: `250ms` under a second, else whole
/// seconds rounded up as `1s`, `1m5s`, `6m0s`, `1h0m0s`.
pub fn format_reset(d: Duration) -> String {
    let ms = d.as_nanos().div_ceil(1_000_000);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = ceil_secs(d);
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iop_engine::clock::{Clock, ManualClock};
    use iop_engine::rng::SplitMix64;

    const SEC: Duration = Duration::from_secs(1);

    fn spec(c: Option<u32>, rpm: Option<u32>, tpm: Option<u32>) -> LimitSpec {
        LimitSpec {
            max_concurrent: c,
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
        }
    }

    fn granted(a: Admission) -> (Ticket, RateHeaders) {
        match a {
            Admission::Granted(t, h) => (t, h),
            Admission::Refused(r) => panic!("refused: {r:?}"),
        }
    }

    fn refused(a: Admission) -> Refusal {
        match a {
            Admission::Refused(r) => r,
            Admission::Granted(t, _) => panic!("granted: {t:?}"),
        }
    }

    fn window(limit: u32, remaining: u32, reset: Duration) -> Option<RateWindow> {
        Some(RateWindow {
            limit,
            remaining,
            reset,
        })
    }

    #[test]
    fn requests_per_minute_refuses_the_request_over_the_limit_and_recovers() {
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([("team-a", spec(None, Some(3), None))]);
        let (_, h1) = granted(l.admit("team-a", 1, clock.now()));
        assert_eq!(h1.requests, window(3, 2, 20 * SEC));
        let _ = granted(l.admit("team-a", 1, clock.now()));
        let (_, h3) = granted(l.admit("team-a", 1, clock.now()));
        assert_eq!(h3.requests, window(3, 0, 60 * SEC));
        assert_eq!(h3.tokens, None);

        let r = refused(l.admit("team-a", 1, clock.now()));
        assert_eq!(r.kind, LimitKind::Requests);
        assert_eq!(r.limit, 3);
        assert_eq!(r.retry_after, 20 * SEC);
        assert_eq!(r.retry_after_secs(), 20);
        assert_eq!(r.headers.requests, window(3, 0, 60 * SEC));
        assert_eq!(
            r.message(),
            "rate limit reached: 3 requests per minute for this key; retry in 20s"
        );

        clock.advance(20 * SEC - Duration::from_millis(1));
        let r = refused(l.admit("team-a", 1, clock.now()));
        assert_eq!(r.retry_after, Duration::from_millis(1));
        assert_eq!(r.retry_after_secs(), 1);
        clock.advance(Duration::from_millis(1));
        let (_, h) = granted(l.admit("team-a", 1, clock.now()));
        assert_eq!(h.requests, window(3, 0, 60 * SEC));
        // A full minute later the bucket is full again.
        clock.advance(60 * SEC);
        assert_eq!(
            l.headers("team-a", clock.now()).requests,
            window(3, 3, Duration::ZERO)
        );
    }

    #[test]
    fn a_cluster_member_enforces_its_exact_share_and_keeps_its_in_flight_on_a_change() {
        // The parts add up to the limit: 5 = 2 + 2 + 1, 60 = 20 × 3,
        // 1000 = 334 + 333 + 333.
        let parts = |edges: u32| -> Vec<LimitSpec> {
            (0..edges)
                .map(|rank| share_of(spec(Some(5), Some(60), Some(1000)), edges, rank))
                .collect()
        };
        assert_eq!(
            parts(3),
            vec![
                spec(Some(2), Some(20), Some(334)),
                spec(Some(2), Some(20), Some(333)),
                spec(Some(1), Some(20), Some(333)),
            ]
        );
        assert_eq!(parts(1), vec![spec(Some(5), Some(60), Some(1000))]);
        assert_eq!(
            share_of(spec(Some(4), None, None), 0, 0),
            spec(Some(4), None, None)
        );
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([("team-a", spec(Some(4), None, None))]);
        l.set_share(2, 1);
        let (a, _) = granted(l.admit("team-a", 1, clock.now()));
        let (b, _) = granted(l.admit("team-a", 1, clock.now()));
        let r = refused(l.admit("team-a", 1, clock.now()));
        assert_eq!(
            (r.kind, r.limit, r.shared_by),
            (LimitKind::Concurrent, 2, 2)
        );
        // An Edge left: this one's share grows; the two in flight still count.
        l.set_share(1, 0);
        assert_eq!(l.in_flight("team-a"), 2);
        let (c, _) = granted(l.admit("team-a", 1, clock.now()));
        let (d, _) = granted(l.admit("team-a", 1, clock.now()));
        assert_eq!(refused(l.admit("team-a", 1, clock.now())).limit, 4);
        // A reload keeps the share.
        l.configure([("team-a", spec(Some(2), Some(2), None))]);
        for t in [a, b, c, d] {
            l.finish(t, None, clock.now());
        }
        // Two of three Edges get the key's 2 slots; the third refuses it,
        // saying why.
        l.set_share(3, 1);
        let (e, _) = granted(l.admit("team-a", 1, clock.now()));
        assert_eq!(refused(l.admit("team-a", 1, clock.now())).limit, 1);
        l.finish(e, None, clock.now());
        l.set_share(3, 2);
        let r = refused(l.admit("team-a", 1, clock.now()));
        assert_eq!(
            (r.kind, r.limit, r.shared_by),
            (LimitKind::Concurrent, 0, 3)
        );
        assert_eq!(
            r.message(),
            "rate limit reached: this key's concurrency limit is shared by the cluster's 3 \
             edges and this edge's share is 0; send this key's requests to another edge"
        );
        assert_eq!(r.retry_after_secs(), 1);
    }

    #[test]
    fn concurrency_limit_counts_requests_in_flight() {
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([("team-a", spec(Some(2), None, None))]);
        let (a, h) = granted(l.admit("team-a", 1, clock.now()));
        assert_eq!(h, RateHeaders::default());
        let (b, _) = granted(l.admit("team-a", 1, clock.now()));
        let r = refused(l.admit("team-a", 1, clock.now()));
        assert_eq!(r.kind, LimitKind::Concurrent);
        assert_eq!(r.retry_after, CONCURRENCY_RETRY_AFTER);
        assert_eq!(
            r.message(),
            "rate limit reached: at most 2 requests in flight for this key"
        );
        assert_eq!(l.in_flight("team-a"), 2);
        l.finish(a, None, clock.now());
        assert_eq!(l.in_flight("team-a"), 1);
        let (c, _) = granted(l.admit("team-a", 1, clock.now()));
        l.finish(b, None, clock.now());
        l.finish(c, None, clock.now());
        assert_eq!(l.in_flight("team-a"), 0);
    }

    #[test]
    fn tokens_reserve_the_estimate_and_settle_on_observed_usage() {
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([("team-a", spec(None, None, Some(1000)))]);
        // 60 ms refill per token.
        let (t, h) = granted(l.admit("team-a", 400, clock.now()));
        assert_eq!(h.tokens, window(1000, 600, Duration::from_millis(24_000)));
        // Observed less than reserved: the difference comes back.
        l.finish(t, Some(100), clock.now());
        assert_eq!(
            l.headers("team-a", clock.now()).tokens,
            window(1000, 900, 6 * SEC)
        );

        // Observed more than reserved: the excess is debt.
        let (t, _) = granted(l.admit("team-a", 100, clock.now()));
        l.finish(t, Some(1500), clock.now());
        // 100 + 1500 tokens charged: 96 s ahead, 36 s of it past the window.
        let r = refused(l.admit("team-a", 1, clock.now()));
        assert_eq!(r.kind, LimitKind::Tokens);
        assert_eq!(r.retry_after, Duration::from_millis(36_060));
        assert_eq!(r.headers.tokens, window(1000, 0, 96 * SEC));
        assert_eq!(
            r.message(),
            "rate limit reached: 1000 tokens per minute for this key; retry in 37s"
        );
        clock.advance(Duration::from_millis(36_060));
        let _ = granted(l.admit("team-a", 1, clock.now()));
    }

    #[test]
    fn no_observed_usage_keeps_the_estimate() {
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([("team-a", spec(None, None, Some(1000)))]);
        let (t, _) = granted(l.admit("team-a", 250, clock.now()));
        l.finish(t, None, clock.now());
        assert_eq!(
            l.headers("team-a", clock.now()).tokens.unwrap().remaining,
            750
        );
    }

    #[test]
    fn an_estimate_over_the_limit_waits_for_a_full_bucket() {
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([("team-a", spec(None, None, Some(100)))]);
        let (t, h) = granted(l.admit("team-a", 10_000, clock.now()));
        assert_eq!(h.tokens, window(100, 0, 60 * SEC));
        l.finish(t, None, clock.now());
        let r = refused(l.admit("team-a", 10_000, clock.now()));
        assert_eq!(r.retry_after, 60 * SEC);
        clock.advance(60 * SEC);
        let _ = granted(l.admit("team-a", 10_000, clock.now()));
    }

    #[test]
    fn a_refusal_charges_nothing() {
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([("team-a", spec(Some(5), Some(10), Some(100)))]);
        let (_t, _) = granted(l.admit("team-a", 100, clock.now()));
        let before = l.headers("team-a", clock.now());
        let r = refused(l.admit("team-a", 50, clock.now()));
        assert_eq!(r.kind, LimitKind::Tokens);
        assert_eq!(l.headers("team-a", clock.now()), before);
        assert_eq!(before.requests, window(10, 9, 6 * SEC));
        assert_eq!(l.in_flight("team-a"), 1);
    }

    #[test]
    fn principals_are_independent_and_unknown_ones_unlimited() {
        let clock = ManualClock::new(0);
        let mut l = Limiter::new([
            ("team-a", spec(None, Some(1), None)),
            ("team-b", spec(None, Some(1), None)),
        ]);
        let _ = granted(l.admit("team-a", 1, clock.now()));
        let _ = refused(l.admit("team-a", 1, clock.now()));
        let _ = granted(l.admit("team-b", 1, clock.now()));
        for _ in 0..100 {
            let (t, h) = granted(l.admit("team-c", 1, clock.now()));
            assert_eq!(h, RateHeaders::default());
            l.finish(t, Some(1_000_000), clock.now());
        }
    }

    #[test]
    fn reload_keeps_usage_of_unchanged_limits_and_slots_of_changed_ones() {
        let clock = ManualClock::new(0);
        let a = spec(Some(1), Some(2), Some(1000));
        let mut l = Limiter::new([("team-a", a), ("team-b", a)]);
        let (ta, _) = granted(l.admit("team-a", 500, clock.now()));
        let (tb, _) = granted(l.admit("team-b", 500, clock.now()));
        let b = spec(Some(1), Some(4), Some(1000));
        l.configure([("team-a", a), ("team-b", b)]);
        // Unchanged: same buckets, same slot.
        assert_eq!(
            l.headers("team-a", clock.now()).requests,
            window(2, 1, 30 * SEC)
        );
        assert_eq!(
            refused(l.admit("team-a", 1, clock.now())).kind,
            LimitKind::Concurrent
        );
        // Changed: fresh buckets, the in-flight request still holds its slot.
        assert_eq!(
            l.headers("team-b", clock.now()).requests,
            window(4, 4, Duration::ZERO)
        );
        assert_eq!(
            refused(l.admit("team-b", 1, clock.now())).kind,
            LimitKind::Concurrent
        );
        l.finish(ta, Some(100), clock.now());
        l.finish(tb, Some(100), clock.now());
        assert_eq!(
            l.headers("team-a", clock.now()).tokens.unwrap().remaining,
            900
        );
        // team-b's reservation was in the replaced bucket: nothing settled.
        assert_eq!(
            l.headers("team-b", clock.now()).tokens.unwrap().remaining,
            1000
        );
        assert_eq!((l.in_flight("team-a"), l.in_flight("team-b")), (0, 0));

        // Unlisted then listed again: an old ticket holds no new slot.
        let (old, _) = granted(l.admit("team-a", 1, clock.now()));
        l.configure([]);
        l.configure([("team-a", a)]);
        let (new, _) = granted(l.admit("team-a", 1, clock.now()));
        l.finish(old, None, clock.now());
        assert_eq!(l.in_flight("team-a"), 1);
        l.finish(new, None, clock.now());
        assert_eq!(l.in_flight("team-a"), 0);
    }

    #[test]
    fn rate_headers_in_openai_form() {
        let h = RateHeaders {
            requests: window(60, 59, Duration::from_millis(1000)),
            tokens: window(150_000, 149_984, Duration::from_millis(6)),
        };
        let mut out = String::new();
        h.write_openai(&mut out);
        assert_eq!(
            out,
            "x-ratelimit-limit-requests: 60\r\nx-ratelimit-remaining-requests: 59\r\n\
             x-ratelimit-reset-requests: 1s\r\nx-ratelimit-limit-tokens: 150000\r\n\
             x-ratelimit-remaining-tokens: 149984\r\nx-ratelimit-reset-tokens: 6ms\r\n"
        );
    }

    #[test]
    fn reset_times_read_like_openai_s() {
        let cases = [
            (Duration::ZERO, "0ms"),
            (Duration::from_micros(1), "1ms"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_micros(999_500), "1s"),
            (SEC, "1s"),
            (Duration::from_millis(1200), "2s"),
            (65 * SEC, "1m5s"),
            (360 * SEC, "6m0s"),
            (3600 * SEC, "1h0m0s"),
        ];
        for (d, want) in cases {
            assert_eq!(format_reset(d), want, "{d:?}");
        }
    }

    #[test]
    fn estimate_is_a_token_per_four_bytes() {
        assert_eq!(estimate_prompt_tokens(0), 1);
        assert_eq!(estimate_prompt_tokens(4), 1);
        assert_eq!(estimate_prompt_tokens(5), 2);
        assert_eq!(estimate_prompt_tokens(4000), 1000);
    }

    /// Seeded random admissions, finishes, time steps and reloads. After
    /// every step: no principal has more in flight than its limit or than
    /// the tickets it holds, and over every span of admissions the request
    /// bucket admitted at most `limit + span / T` (the bucket's burst plus
    /// its refill). Every ticket is finished once at the end, and the
    /// in-flight counts return to zero.
    #[test]
    fn seeded_simulation_holds_the_limits() {
        let seed = std::env::var("IOP_LIMITS_SEED")
            .ok()
            .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
            .unwrap_or(0x5eed_0021);
        println!("limits simulation seed 0x{seed:x} (IOP_LIMITS_SEED)");
        let mut rng = SplitMix64::new(seed);
        let clock = ManualClock::new(0);
        let names = ["a", "b", "c"];
        let specs = [
            spec(Some(3), Some(20), Some(5000)),
            spec(Some(8), Some(5), None),
            spec(None, None, Some(300)),
        ];
        let mut l = Limiter::new(names.iter().copied().zip(specs));
        let mut held: Vec<(usize, Ticket)> = Vec::new();
        let mut admitted: Vec<Vec<Instant>> = vec![Vec::new(); names.len()];
        for _ in 0..20_000 {
            match rng.below(10) {
                0..=4 => {
                    let p = rng.below(3) as usize;
                    let est = 1 + rng.below(400);
                    if let Admission::Granted(t, _) = l.admit(names[p], est, clock.now()) {
                        held.push((p, t));
                        admitted[p].push(clock.now());
                    }
                }
                5..=7 if !held.is_empty() => {
                    let (_, t) = held.swap_remove(rng.below(held.len() as u64) as usize);
                    let seen = (rng.below(3) > 0).then(|| rng.below(800));
                    l.finish(t, seen, clock.now());
                }
                8 => clock.advance(Duration::from_millis(rng.below(5_000))),
                _ => {
                    // Reload with the same limits: usage must carry over.
                    l.configure(names.iter().copied().zip(specs));
                }
            }
            for (p, name) in names.iter().enumerate() {
                let holding = held.iter().filter(|(q, _)| *q == p).count() as u32;
                assert_eq!(l.in_flight(name), holding, "seed 0x{seed:x}");
                if let Some(max) = specs[p].max_concurrent {
                    assert!(holding <= max, "seed 0x{seed:x}");
                }
            }
        }
        for (p, times) in admitted.iter().enumerate() {
            let Some(rpm) = specs[p].requests_per_minute else {
                continue;
            };
            let unit = WINDOW / rpm;
            for (i, start) in times.iter().enumerate() {
                for (j, end) in times.iter().enumerate().skip(i) {
                    let count = (j - i + 1) as u32;
                    let refill = (*end - *start).as_nanos() / unit.as_nanos();
                    assert!(
                        u128::from(count) <= u128::from(rpm) + refill,
                        "seed 0x{seed:x}: {} admitted {count} in {:?}",
                        names[p],
                        *end - *start
                    );
                }
            }
        }
        for (_, t) in held.drain(..) {
            l.finish(t, None, clock.now());
        }
        for name in names {
            assert_eq!(l.in_flight(name), 0, "seed 0x{seed:x}");
        }
    }
}
