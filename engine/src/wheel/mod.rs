//! A hierarchical timing wheel: the per-core timer structure behind stall
//! watchdogs (W3–W10), heartbeats and close-grace timers.
//!
//! Sans-IO: the wheel reads no clock. Time is a `u64` tick count passed in;
//! [`TickLength`] and [`TickScale`] convert `Duration`/`Instant` to ticks,
//! rounding deadlines up and "now" down so a timer never fires early.
//!
//! ## Layout
//!
//! [`LEVELS`] levels of [`SLOTS`] slots. A slot at level `L` spans `64^L`
//! ticks, so the wheel covers `64^6 = 2^36` ticks ahead of its current tick
//! (about 2.2 years at 1 ms ticks); later deadlines wait in an overflow list.
//!
//! ```text
//!  deadline tick (u64):  … | overflow | L5 (6 bits) | L4 | L3 | L2 | L1 | L0 (6 bits) |
//!
//!  level 0  [0][1][2]…[63]   1 tick per slot         ── slot due ─► ready list ─► fired
//!  level 1  [0][1][2]…[63]   64 ticks per slot       ─┐
//!  level 2  [0][1][2]…[63]   4 096 ticks per slot     │ slot due: cascade, each
//!  level 3  [0][1][2]…[63]   262 144 ticks per slot   │ entry re-placed relative
//!  level 4  [0][1][2]…[63]   16 777 216 ticks         │ to the new current tick
//!  level 5  [0][1][2]…[63]   1 073 741 824 ticks     ─┘ (lands on a lower level
//!  overflow  one list, deadlines ≥ 2^36 ticks away        or straight in `ready`)
//!
//!  past deadlines (≤ current tick) ──────────────────────► ready list (sorted on use)
//! ```
//!
//! A timer with deadline `d` sits at the level of the highest 6-bit digit in
//! which `d` differs from the wheel's current tick `e`, in the slot named by
//! `d`'s digit at that level. Hence every occupied slot lies strictly ahead
//! of `e` at its level, every entry of a lower level expires before every
//! entry of a higher level, and the next slot to expire is the lowest set bit
//! of the lowest non-empty level's occupancy bitmap. Processing that slot moves
//! `e` to the slot's first tick: at level 0 its entries (all with deadline
//! exactly `e`) move to the ready list; at a higher level each entry is
//! re-placed relative to the new `e` — the cascade — landing one or more
//! levels lower, or in the ready list when its deadline is exactly `e`.
//! Overflow entries are re-placed when `e` reaches the 2^36-tick epoch of the
//! earliest of them.
//!
//! ## Storage
//!
//! Entries live in a [`slab::Slab`]; each slot, the overflow list and the
//! ready list are intrusive doubly-linked lists threaded through the entries
//! by slab index (no pointers, no unsafe), so cancel unlinks in O(1). A
//! [`TimerHandle`] carries the slab index and the timer's *generation* — a
//! wheel-wide insertion counter unique to every timer ever inserted — so a
//! handle whose timer has fired or been cancelled is inert, even after its
//! slab slot was reused (the ABA guard).
//!
//! ## Order
//!
//! Expired timers come out in deadline order, ties in insertion order (the
//! generation). Lists keep insertion order for equal deadlines because a
//! timer inserted later never sits at a higher level than an earlier one with
//! the same deadline. Past deadlines fire on the next poll, sorted among
//! themselves.
//!
//! ## Complexity
//!
//! | operation | cost |
//! |---|---|
//! | [`Wheel::insert`] | O(1) |
//! | [`Wheel::cancel`] | O(1) |
//! | [`Wheel::next_deadline`] | O(levels) |
//! | [`Wheel::poll_expired`] / [`Wheel::advance`] | O(levels) per slot visited + O(1) per fired timer; each timer cascades at most `LEVELS - 1` times |
//! | past deadlines inserted out of order | one O(k log k) sort of the k ready timers |
//! | overflow (≥ 2^36 ticks away) | every overflow entry is rescanned when the earliest one's epoch arrives |
//!
//! Idle ticks cost nothing: an advance jumps from occupied slot to occupied
//! slot, however far `now_tick` moves.

mod bench;
mod driver;
mod ticks;

use std::fmt;

use slab::Slab;

pub use self::bench::{bench_report, BenchFigures};
pub use self::driver::WheelDriver;
pub use self::ticks::{TickError, TickLength, TickScale};

/// Number of levels.
pub const LEVELS: usize = 6;
/// Slots per level (a power of two).
pub const SLOTS: usize = 64;
/// Bits of the deadline each level consumes.
const SLOT_BITS: u32 = SLOTS.trailing_zeros();
/// Mask of one level's digit.
const SLOT_MASK: u64 = (SLOTS as u64) - 1;
/// Ticks the levels cover ahead of the current tick: `64^6 = 2^36`.
pub const RANGE_TICKS: u64 = 1 << (SLOT_BITS as usize * LEVELS);

/// List id of the overflow list (after the `LEVELS * SLOTS` slot lists).
const OVERFLOW: u16 = (LEVELS * SLOTS) as u16;
/// List id of the ready list.
const READY: u16 = OVERFLOW + 1;
/// Number of lists.
const LIST_COUNT: usize = READY as usize + 1;
/// "No entry" in a link.
const NIL: usize = usize::MAX;

/// Identifies one inserted timer. Stale handles (fired or cancelled timers)
/// are inert: the generation is checked on every use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TimerHandle {
    index: usize,
    generation: u64,
}

impl TimerHandle {
    /// The slab index the timer occupies (reused after the timer is gone).
    pub fn index(self) -> usize {
        self.index
    }

    /// The timer's generation: the wheel-wide insertion number, unique to
    /// this timer within its wheel.
    pub fn generation(self) -> u64 {
        self.generation
    }
}

/// One expired timer, as handed out by [`Wheel::poll_expired`] and
/// [`Wheel::advance`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired<T> {
    /// The handle [`Wheel::insert`] returned (now stale).
    pub handle: TimerHandle,
    /// The deadline tick it was inserted with.
    pub deadline_tick: u64,
    /// The value it carried.
    pub value: T,
}

#[derive(Debug)]
struct Entry<T> {
    value: T,
    deadline_tick: u64,
    generation: u64,
    prev: usize,
    next: usize,
    list: u16,
}

#[derive(Debug, Clone, Copy)]
struct List {
    head: usize,
    tail: usize,
    /// A lower bound of the deadlines in the list (exact unless an entry was
    /// cancelled); `u64::MAX` when empty.
    min_deadline_tick: u64,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        min_deadline_tick: u64::MAX,
    };
}

/// A hierarchical timing wheel of timers carrying values of type `T`.
///
/// Drive it with [`poll_expired`](Self::poll_expired) (or
/// [`advance`](Self::advance)) and sleep until
/// [`next_deadline`](Self::next_deadline).
pub struct Wheel<T> {
    entries: Slab<Entry<T>>,
    lists: Box<[List; LIST_COUNT]>,
    /// Per level, bit `s` set iff slot `s` is non-empty.
    occupied: [u64; LEVELS],
    /// The wheel's current tick: every timer with a deadline at or before it
    /// is in the ready list.
    elapsed_tick: u64,
    /// Whether the ready list is in (deadline, generation) order.
    ready_sorted: bool,
    next_generation: u64,
    /// Scratch space for sorting the ready list.
    scratch: Vec<usize>,
}

impl<T> fmt::Debug for Wheel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wheel")
            .field("elapsed_tick", &self.elapsed_tick)
            .field("len", &self.entries.len())
            .field("occupied", &self.occupied)
            .finish_non_exhaustive()
    }
}

impl<T> Default for Wheel<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Wheel<T> {
    /// An empty wheel at tick 0.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty wheel at tick 0 with room for `timers` timers before the slab
    /// reallocates.
    pub fn with_capacity(timers: usize) -> Self {
        Self {
            entries: Slab::with_capacity(timers),
            lists: Box::new([List::EMPTY; LIST_COUNT]),
            occupied: [0; LEVELS],
            elapsed_tick: 0,
            ready_sorted: true,
            next_generation: 0,
            scratch: Vec::new(),
        }
    }

    /// Number of pending timers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no timer is pending.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The tick the wheel has been advanced to: every timer with a deadline at
    /// or before it is due. Never decreases.
    pub fn elapsed_tick(&self) -> u64 {
        self.elapsed_tick
    }

    /// Schedules `value` to expire at `deadline_tick`. A deadline at or before
    /// the current tick fires on the next poll; a deadline beyond
    /// [`RANGE_TICKS`] waits in the overflow list (never lost, never early).
    /// O(1).
    pub fn insert(&mut self, deadline_tick: u64, value: T) -> TimerHandle {
        let generation = self.next_generation;
        // 2^64 insertions are out of reach; wrapping keeps this panic-free.
        self.next_generation = self.next_generation.wrapping_add(1);
        let index = self.entries.insert(Entry {
            value,
            deadline_tick,
            generation,
            prev: NIL,
            next: NIL,
            list: READY,
        });
        self.place(index);
        TimerHandle { index, generation }
    }

    /// Cancels a pending timer and returns its value; `None` if the handle is
    /// stale (the timer already fired or was cancelled), and then nothing is
    /// touched. O(1).
    pub fn cancel(&mut self, handle: TimerHandle) -> Option<T> {
        if !self.contains(handle) {
            return None;
        }
        self.unlink(handle.index);
        Some(self.entries.remove(handle.index).value)
    }

    /// Whether `handle`'s timer is still pending.
    pub fn contains(&self, handle: TimerHandle) -> bool {
        self.entries
            .get(handle.index)
            .is_some_and(|e| e.generation == handle.generation)
    }

    /// The deadline tick of `handle`'s timer, if still pending.
    pub fn deadline_tick(&self, handle: TimerHandle) -> Option<u64> {
        self.entries
            .get(handle.index)
            .filter(|e| e.generation == handle.generation)
            .map(|e| e.deadline_tick)
    }

    /// A lower bound of the earliest pending deadline; `None` when empty.
    ///
    /// It is never later than the true next expiry, so sleeping until it and
    /// then polling never misses a timer. It is exact unless the timer that
    /// set the bound was cancelled, in which case the caller wakes early,
    /// the poll fires nothing, and the bound is recomputed once the stale
    /// slot is passed. A value at or before [`elapsed_tick`](Self::elapsed_tick)
    /// means a timer is due now. O(levels).
    pub fn next_deadline(&self) -> Option<u64> {
        let ready = &self.lists[usize::from(READY)];
        if ready.head != NIL {
            return Some(if self.ready_sorted {
                self.entries[ready.head].deadline_tick
            } else {
                ready.min_deadline_tick
            });
        }
        if let Some((list, _)) = self.next_slot() {
            return Some(self.lists[usize::from(list)].min_deadline_tick);
        }
        let overflow = &self.lists[usize::from(OVERFLOW)];
        (overflow.head != NIL).then_some(overflow.min_deadline_tick)
    }

    /// Returns the next timer due at `now_tick` (deadline ≤ `now_tick`), in
    /// deadline order with ties in insertion order; `None` once none is due,
    /// and then the wheel's current tick is `now_tick`.
    ///
    /// Call it repeatedly until `None`. Between calls the caller may insert
    /// and cancel (re-arming a heartbeat, for example); a timer inserted with
    /// a deadline ≤ `now_tick` comes out of the same drain. Stopping early is
    /// fine: the remaining due timers come out of the next poll. A `now_tick`
    /// earlier than [`elapsed_tick`](Self::elapsed_tick) is treated as
    /// `elapsed_tick` (time does not run backwards).
    pub fn poll_expired(&mut self, now_tick: u64) -> Option<Expired<T>> {
        loop {
            if let Some(expired) = self.pop_ready() {
                return Some(expired);
            }
            match self.next_slot() {
                Some((list, start_tick)) if start_tick <= now_tick => {
                    self.expire_list(list, start_tick);
                }
                _ => {
                    self.elapsed_tick = self.elapsed_tick.max(now_tick);
                    return None;
                }
            }
        }
    }

    /// Fires every timer due at `now_tick` into `on_expire`, in deadline order
    /// with ties in insertion order, and returns how many fired. Use
    /// [`poll_expired`](Self::poll_expired) to touch the wheel between
    /// expiries.
    pub fn advance(&mut self, now_tick: u64, mut on_expire: impl FnMut(Expired<T>)) -> usize {
        let mut fired = 0;
        while let Some(expired) = self.poll_expired(now_tick) {
            fired += 1;
            on_expire(expired);
        }
        fired
    }

    /// Every timer due at `now_tick`, in firing order.
    pub fn drain_expired(&mut self, now_tick: u64) -> Vec<Expired<T>> {
        let mut out = Vec::new();
        self.advance(now_tick, |e| out.push(e));
        out
    }

    // ---- internals ----

    /// The first slot (as list id) to expire and its first tick, or `None`
    /// when no level holds a timer; the overflow list counts as one slot whose
    /// first tick is the epoch of its earliest deadline.
    fn next_slot(&self) -> Option<(u16, u64)> {
        for (level, &bits) in self.occupied.iter().enumerate() {
            if bits == 0 {
                continue;
            }
            let slot = u64::from(bits.trailing_zeros());
            let shift = SLOT_BITS * level as u32;
            debug_assert!(slot > (self.elapsed_tick >> shift) & SLOT_MASK);
            let above_mask = !((1u64 << (shift + SLOT_BITS)) - 1);
            let start_tick = (self.elapsed_tick & above_mask) | (slot << shift);
            let list = (level * SLOTS) as u16 + slot as u16;
            return Some((list, start_tick));
        }
        let overflow = &self.lists[usize::from(OVERFLOW)];
        if overflow.head == NIL {
            return None;
        }
        let start_tick = overflow.min_deadline_tick & !(RANGE_TICKS - 1);
        debug_assert!(start_tick > self.elapsed_tick);
        Some((OVERFLOW, start_tick))
    }

    /// Moves the current tick to `start_tick` and re-places every entry of
    /// `list` (a slot or the overflow list) relative to it.
    fn expire_list(&mut self, list: u16, start_tick: u64) {
        self.elapsed_tick = start_tick;
        let mut index = self.lists[usize::from(list)].head;
        self.lists[usize::from(list)] = List::EMPTY;
        if list < OVERFLOW {
            let level = usize::from(list) / SLOTS;
            let slot = usize::from(list) % SLOTS;
            self.occupied[level] &= !(1u64 << slot);
        }
        while index != NIL {
            let next = self.entries[index].next;
            self.place(index);
            index = next;
        }
    }

    /// Links an entry into the list its deadline belongs to, relative to the
    /// current tick.
    fn place(&mut self, index: usize) {
        let deadline_tick = self.entries[index].deadline_tick;
        let list = if deadline_tick <= self.elapsed_tick {
            READY
        } else {
            let differing_bits = deadline_tick ^ self.elapsed_tick;
            let level = ((63 - differing_bits.leading_zeros()) / SLOT_BITS) as usize;
            if level >= LEVELS {
                OVERFLOW
            } else {
                let slot = (deadline_tick >> (SLOT_BITS as usize * level)) & SLOT_MASK;
                self.occupied[level] |= 1u64 << slot;
                (level * SLOTS) as u16 + slot as u16
            }
        };
        if list == READY && self.ready_sorted {
            let tail = self.lists[usize::from(READY)].tail;
            if tail != NIL {
                let last = &self.entries[tail];
                let entry = &self.entries[index];
                if (entry.deadline_tick, entry.generation) < (last.deadline_tick, last.generation) {
                    self.ready_sorted = false;
                }
            }
        }
        self.push_back(list, index);
    }

    fn push_back(&mut self, list: u16, index: usize) {
        let l = &mut self.lists[usize::from(list)];
        let tail = l.tail;
        l.tail = index;
        if tail == NIL {
            l.head = index;
        }
        let deadline_tick = self.entries[index].deadline_tick;
        l.min_deadline_tick = l.min_deadline_tick.min(deadline_tick);
        if tail != NIL {
            self.entries[tail].next = index;
        }
        let entry = &mut self.entries[index];
        entry.prev = tail;
        entry.next = NIL;
        entry.list = list;
    }

    /// Unlinks an entry from its list (the entry stays in the slab).
    fn unlink(&mut self, index: usize) {
        let (prev, next, list) = {
            let e = &self.entries[index];
            (e.prev, e.next, e.list)
        };
        if prev == NIL {
            self.lists[usize::from(list)].head = next;
        } else {
            self.entries[prev].next = next;
        }
        if next == NIL {
            self.lists[usize::from(list)].tail = prev;
        } else {
            self.entries[next].prev = prev;
        }
        if self.lists[usize::from(list)].head == NIL {
            self.lists[usize::from(list)] = List::EMPTY;
            if list < OVERFLOW {
                let level = usize::from(list) / SLOTS;
                let slot = usize::from(list) % SLOTS;
                self.occupied[level] &= !(1u64 << slot);
            } else if list == READY {
                self.ready_sorted = true;
            }
        }
    }

    /// Pops the earliest ready timer, sorting the ready list first if past
    /// deadlines were inserted out of order.
    fn pop_ready(&mut self) -> Option<Expired<T>> {
        let head = self.lists[usize::from(READY)].head;
        if head == NIL {
            return None;
        }
        if !self.ready_sorted {
            self.sort_ready();
        }
        let head = self.lists[usize::from(READY)].head;
        self.unlink(head);
        let entry = self.entries.remove(head);
        Some(Expired {
            handle: TimerHandle {
                index: head,
                generation: entry.generation,
            },
            deadline_tick: entry.deadline_tick,
            value: entry.value,
        })
    }

    fn sort_ready(&mut self) {
        let mut order = std::mem::take(&mut self.scratch);
        order.clear();
        let mut index = self.lists[usize::from(READY)].head;
        while index != NIL {
            order.push(index);
            index = self.entries[index].next;
        }
        order
            .sort_unstable_by_key(|&i| (self.entries[i].deadline_tick, self.entries[i].generation));
        self.lists[usize::from(READY)] = List::EMPTY;
        for &i in &order {
            self.push_back(READY, i);
        }
        self.ready_sorted = true;
        order.clear();
        self.scratch = order;
    }

    /// Checks every structural invariant; panics on a violation (tests only).
    #[cfg(test)]
    fn check_invariants(&self) {
        let mut seen = 0;
        for list in 0..LIST_COUNT {
            let l = self.lists[list];
            let mut prev = NIL;
            let mut index = l.head;
            let mut last_key = (0, 0);
            let mut last_generation_by_deadline = std::collections::HashMap::new();
            while index != NIL {
                let e = &self.entries[index];
                assert_eq!(usize::from(e.list), list);
                assert_eq!(e.prev, prev);
                assert!(e.deadline_tick >= l.min_deadline_tick);
                let key = (e.deadline_tick, e.generation);
                if list < usize::from(OVERFLOW) {
                    let (level, slot) = (list / SLOTS, (list % SLOTS) as u64);
                    let shift = SLOT_BITS * level as u32;
                    assert!(e.deadline_tick > self.elapsed_tick);
                    let differing = e.deadline_tick ^ self.elapsed_tick;
                    assert_eq!(
                        ((63 - differing.leading_zeros()) / SLOT_BITS) as usize,
                        level
                    );
                    assert_eq!((e.deadline_tick >> shift) & SLOT_MASK, slot);
                } else if list == usize::from(OVERFLOW) {
                    assert!(e.deadline_tick ^ self.elapsed_tick >= RANGE_TICKS);
                    assert!(e.deadline_tick > self.elapsed_tick);
                } else {
                    assert!(e.deadline_tick <= self.elapsed_tick);
                    if self.ready_sorted && prev != NIL {
                        assert!(key > last_key);
                    }
                }
                // ties in insertion order within every list
                if let Some(earlier) =
                    last_generation_by_deadline.insert(e.deadline_tick, e.generation)
                {
                    assert!(e.generation > earlier);
                }
                last_key = key;
                prev = index;
                index = e.next;
                seen += 1;
            }
            assert_eq!(l.tail, prev);
            if list < usize::from(OVERFLOW) {
                let bit = self.occupied[list / SLOTS] >> (list % SLOTS) & 1;
                assert_eq!(bit == 1, l.head != NIL);
            }
        }
        assert_eq!(seen, self.entries.len());
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert { ahead: u64 },
        InsertPast { behind: u64 },
        Cancel { pick: usize },
        Poll { jump: u64 },
        Advance { jump: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => prop_oneof![0u64..130, 0u64..5000, 0u64..(1 << 20), 0u64..(1 << 40), Just(u64::MAX)]
                .prop_map(|ahead| Op::Insert { ahead }),
            1 => (0u64..100).prop_map(|behind| Op::InsertPast { behind }),
            2 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
            1 => (0u64..300).prop_map(|jump| Op::Poll { jump }),
            2 => prop_oneof![0u64..70, 0u64..5000, 0u64..(1 << 22), 0u64..(1 << 38)]
                .prop_map(|jump| Op::Advance { jump }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The structural invariants (placement level/slot, links, occupancy
        /// bits, list order) hold after every operation.
        #[test]
        fn invariants_hold_after_every_op(ops in proptest::collection::vec(op(), 1..150)) {
            let mut wheel = Wheel::new();
            let mut handles = Vec::new();
            let mut now = 0u64;
            for op in ops {
                match op {
                    Op::Insert { ahead } => handles.push(wheel.insert(now.saturating_add(ahead), ())),
                    Op::InsertPast { behind } => handles.push(wheel.insert(now.saturating_sub(behind), ())),
                    Op::Cancel { pick } => {
                        if !handles.is_empty() {
                            let _ = wheel.cancel(handles[pick % handles.len()]);
                        }
                    }
                    Op::Poll { jump } => {
                        now = now.saturating_add(jump);
                        let _ = wheel.poll_expired(now);
                    }
                    Op::Advance { jump } => {
                        now = now.saturating_add(jump);
                        let _ = wheel.drain_expired(now);
                    }
                }
                wheel.check_invariants();
            }
        }
    }
}
