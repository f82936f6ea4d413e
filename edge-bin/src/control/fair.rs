//! The queue discipline of a lane: who waits for a slot runs next.
//!
//! Two levels (README "Sharing a model between keys"):
//!
//! - **Priority classes.** A request of a higher class is admitted before
//!   any of a lower one, with one exception that keeps a lower class from
//!   starving: once [`MIN_SHARE_EVERY`] − 1 admissions in a row went to
//!   classes above a waiting class, the next goes to it (to the one passed
//!   over longest when several are due). So each waiting class gets one
//!   admission in [`MIN_SHARE_EVERY`] (plus one more for each other class
//!   due at the same time), and a class alone gets all of them.
//! - **Weighted fair queueing between principals**, within a class:
//!   start-time fair queueing (Goyal et al., SFQ) over each request's
//!   estimated tokens. A request of principal `p` with weight `w` and cost
//!   `c` gets the start tag `S = max(V, F(p))` and moves `F(p)` to
//!   `S + c / w`; the request with the smallest start tag runs next, and the
//!   class's virtual time `V` becomes its tag. While several principals are
//!   backlogged their admissions follow their weights (in tokens, within
//!   one request's cost of the ideal); a principal alone gets every slot;
//!   a principal that was idle starts at `V` (no credit is saved up). One
//!   principal's requests run in arrival order.
//!
//! Pure: no clock, no I/O. Ties go to arrival order (the request id).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::RequestId;

/// While a lower class waits, every this many admissions at least one goes
/// to a lower class.
pub const MIN_SHARE_EVERY: u32 = 10;

/// Fixed-point scale of tags: a cost of one token at weight 1 moves a tag
/// by this much, so small costs at large weights still move it.
const TAG_SCALE: u128 = 1 << 20;

/// Who a queued request is charged to, and how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Share {
    /// The principal (a stable hash of its name).
    pub principal: u64,
    /// Its priority class: higher runs first.
    pub class: u8,
    /// Its weight among the principals of its class (at least 1).
    pub weight: u32,
    /// Its estimated tokens (at least 1).
    pub cost: u64,
}

/// A request's place in its class: its start tag.
pub type Tag = u128;

#[derive(Debug, Default)]
struct Class {
    /// Queued requests by (start tag, arrival).
    order: BTreeSet<(Tag, RequestId)>,
    /// The start tag of the request served last.
    virtual_time: Tag,
    /// Each principal's finish tag: where its next request starts at the
    /// earliest.
    finish: HashMap<u64, Tag>,
}

/// The queue of one lane (and one context length): see the module docs.
#[derive(Debug, Default)]
pub struct FairQueue {
    /// Every queued request: its class and tag.
    entries: BTreeMap<RequestId, (u8, Tag)>,
    /// The classes with their orders, highest first when iterated in
    /// reverse.
    classes: BTreeMap<u8, Class>,
    /// Per waiting class: admissions in a row that went to classes above
    /// it.
    passed_over: BTreeMap<u8, u32>,
}

impl FairQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues `request` as a new arrival charged `share`; returns its tag
    /// (kept by the caller to queue it again at the same place).
    pub fn push(&mut self, request: RequestId, share: Share) -> Tag {
        let class = self.classes.entry(share.class).or_default();
        let finish = class.finish.get(&share.principal).copied().unwrap_or(0);
        let start = finish.max(class.virtual_time);
        let step = u128::from(share.cost.max(1)) * TAG_SCALE / u128::from(share.weight.max(1));
        class.finish.insert(share.principal, start + step.max(1));
        self.insert(request, share.class, start);
        start
    }

    /// Queues `request` again with the tag it had (a request back from a
    /// failed attempt keeps its place); its principal is not charged again.
    pub fn push_again(&mut self, request: RequestId, class: u8, tag: Tag) {
        self.classes.entry(class).or_default();
        self.insert(request, class, tag);
    }

    fn insert(&mut self, request: RequestId, class: u8, tag: Tag) {
        if let Some((old_class, old_tag)) = self.entries.insert(request, (class, tag)) {
            if let Some(c) = self.classes.get_mut(&old_class) {
                c.order.remove(&(old_tag, request));
            }
        }
        if let Some(c) = self.classes.get_mut(&class) {
            c.order.insert((tag, request));
        }
    }

    /// The request that runs next, if any.
    pub fn first(&self) -> Option<RequestId> {
        let class = self.next_class()?;
        self.classes[&class].order.first().map(|&(_, r)| r)
    }

    /// The class the next admission comes from: the highest that waits,
    /// unless a class was passed over its due (then the one passed over
    /// longest, the lowest on a tie).
    fn next_class(&self) -> Option<u8> {
        let top = self
            .classes
            .iter()
            .rev()
            .find(|(_, c)| !c.order.is_empty())
            .map(|(&k, _)| k)?;
        let due = self
            .passed_over
            .iter()
            .filter(|&(_, &n)| n + 1 >= MIN_SHARE_EVERY)
            .max_by_key(|&(&class, &n)| (n, std::cmp::Reverse(class)))
            .map(|(&class, _)| class);
        Some(due.unwrap_or(top))
    }

    /// Takes `request` out, as admitted now if it is the one [`first`]
    /// names (that moves the class's virtual time and the starvation
    /// count); as removed otherwise (cancelled, timed out). False if it was
    /// not queued.
    ///
    /// [`first`]: FairQueue::first
    pub fn remove(&mut self, request: RequestId) -> bool {
        let admitted = self.first() == Some(request);
        let Some((class, tag)) = self.entries.remove(&request) else {
            return false;
        };
        if let Some(c) = self.classes.get_mut(&class) {
            c.order.remove(&(tag, request));
            if admitted {
                c.virtual_time = c.virtual_time.max(tag);
            }
        }
        if admitted {
            self.passed_over.remove(&class);
            // Every class below it that still waits was passed over once
            // more.
            for (&lower, c) in self.classes.range(..class) {
                if !c.order.is_empty() {
                    *self.passed_over.entry(lower).or_insert(0) += 1;
                }
            }
        }
        if self.classes.get(&class).is_some_and(|c| c.order.is_empty()) {
            self.passed_over.remove(&class);
        }
        true
    }

    /// Whether `request` is queued.
    pub fn contains(&self, request: RequestId) -> bool {
        self.entries.contains_key(&request)
    }

    /// Queued requests.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is queued.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The newest queued request (the first to go when a queue shrinks).
    pub fn newest(&self) -> Option<RequestId> {
        self.entries.keys().next_back().copied()
    }

    /// Every queued request, by arrival.
    pub fn iter(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.entries.keys().copied()
    }

    /// The class and tag `request` is queued with.
    pub fn place(&self, request: RequestId) -> Option<(u8, Tag)> {
        self.entries.get(&request).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(principal: u64, class: u8, weight: u32, cost: u64) -> Share {
        Share {
            principal,
            class,
            weight,
            cost,
        }
    }

    /// Admits `n` requests (the head each time), returning their ids.
    fn admit(q: &mut FairQueue, n: usize) -> Vec<u64> {
        (0..n)
            .map_while(|_| {
                let r = q.first()?;
                assert!(q.remove(r));
                Some(r.0)
            })
            .collect()
    }

    #[test]
    fn a_lone_principal_runs_in_arrival_order() {
        let mut q = FairQueue::new();
        for i in 0..5 {
            q.push(RequestId(i), share(7, 1, 1, 10 + i));
        }
        assert_eq!(admit(&mut q, 10), [0, 1, 2, 3, 4]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_flood_does_not_hold_up_another_principal() {
        let mut q = FairQueue::new();
        // A queued 100 requests first; B's one arrives after them.
        for i in 0..100 {
            q.push(RequestId(i), share(1, 1, 1, 100));
        }
        q.push(RequestId(100), share(2, 1, 1, 100));
        let order = admit(&mut q, 3);
        assert!(order.contains(&100), "B is among the next two: {order:?}");
    }

    #[test]
    fn backlogged_principals_share_by_weight_in_tokens() {
        let mut q = FairQueue::new();
        let mut next = 0;
        let mut push = |q: &mut FairQueue, p: u64, w: u32, c: u64| {
            q.push(RequestId(next), share(p, 0, w, c));
            next += 1;
        };
        // A (weight 1, 50 tokens each) and B (weight 3, 200 tokens each),
        // both always backlogged.
        for _ in 0..400 {
            push(&mut q, 1, 1, 50);
            push(&mut q, 2, 3, 200);
        }
        let (mut a, mut b) = (0u64, 0u64);
        for _ in 0..300 {
            let r = q.first().unwrap();
            let cost = if r.0 % 2 == 0 { 50 } else { 200 };
            if r.0 % 2 == 0 {
                a += cost;
            } else {
                b += cost;
            }
            q.remove(r);
        }
        // Tokens served follow the weights 1:3, within one request's cost.
        let total = (a + b) as f64;
        let share_a = a as f64 / total;
        assert!(
            (share_a - 0.25).abs() < 0.02,
            "A got {share_a:.3} of the tokens"
        );
    }

    #[test]
    fn an_idle_principal_saves_up_no_credit() {
        let mut q = FairQueue::new();
        for i in 0..50 {
            q.push(RequestId(i), share(1, 0, 1, 10));
        }
        assert_eq!(admit(&mut q, 40).len(), 40);
        // B arrives late: it runs next, then they alternate, B does not
        // get 40 in a row for the time it was away.
        for i in 50..60 {
            q.push(RequestId(i), share(2, 0, 1, 10));
        }
        let order = admit(&mut q, 6);
        let b = order.iter().filter(|&&r| r >= 50).count();
        assert!((2..=4).contains(&b), "{order:?}");
    }

    #[test]
    fn a_higher_class_runs_first_and_a_lower_one_is_never_starved() {
        let mut q = FairQueue::new();
        for i in 0..100 {
            q.push(RequestId(i), share(1, 0, 1, 10)); // batch
        }
        for i in 100..200 {
            q.push(RequestId(i), share(2, 2, 1, 10)); // interactive
        }
        let order = admit(&mut q, 30);
        let batch = order.iter().filter(|&&r| r < 100).count();
        // One in MIN_SHARE_EVERY goes to the waiting lower class.
        assert_eq!(batch, 3, "{order:?}");
        assert!(order[..9].iter().all(|&r| r >= 100), "{order:?}");
        assert!(order[9] < 100, "{order:?}");
        // Alone, the lower class gets everything.
        let mut q = FairQueue::new();
        for i in 0..5 {
            q.push(RequestId(i), share(1, 0, 1, 10));
        }
        assert_eq!(admit(&mut q, 5), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_removed_request_is_gone_and_one_queued_again_keeps_its_place() {
        let mut q = FairQueue::new();
        let t0 = q.push(RequestId(0), share(1, 0, 1, 10));
        q.push(RequestId(1), share(1, 0, 1, 10));
        q.push(RequestId(2), share(2, 0, 1, 10));
        assert_eq!(q.first(), Some(RequestId(0)));
        assert!(q.remove(RequestId(0)));
        assert!(!q.remove(RequestId(0)));
        // A cancel of a request that is not the head.
        assert!(q.remove(RequestId(1)));
        assert_eq!(q.iter().collect::<Vec<_>>(), [RequestId(2)]);
        // 0 failed and comes back: it goes first again.
        q.push_again(RequestId(0), 0, t0);
        assert_eq!(q.first(), Some(RequestId(0)));
        assert_eq!(q.newest(), Some(RequestId(2)));
        assert_eq!((q.len(), q.contains(RequestId(0))), (2, true));
    }

    proptest::proptest! {
        /// Any mix of pushes and removals keeps every queued request
        /// reachable: draining the queue admits each exactly once.
        #[test]
        fn every_queued_request_is_admitted_once(
            ops in proptest::collection::vec((0u8..3, 0u64..4, 0u8..3, 1u32..4, 1u64..500), 1..200)
        ) {
            let mut q = FairQueue::new();
            let mut queued = BTreeSet::new();
            for (i, (op, p, class, w, cost)) in ops.into_iter().enumerate() {
                match op {
                    0 | 1 => {
                        q.push(RequestId(i as u64), share(p, class, w, cost));
                        queued.insert(i as u64);
                    }
                    _ => {
                        if let Some(&r) = queued.iter().nth(cost as usize % queued.len().max(1)) {
                            proptest::prop_assert!(q.remove(RequestId(r)));
                            queued.remove(&r);
                        }
                    }
                }
                proptest::prop_assert_eq!(q.len(), queued.len());
            }
            let mut drained = admit(&mut q, queued.len() + 1);
            drained.sort_unstable();
            proptest::prop_assert_eq!(drained, queued.into_iter().collect::<Vec<_>>());
        }
    }
}
