//! The IO shell around a [`Wheel`]: deadlines as `Instant`s, and one tick
//! task per runtime that sleeps until the earliest entry (or an earlier
//! insert) and hands what is due to its owner.
//!
//! ```text
//!  insert(deadline, value) ──(earlier than the tick task's sleep: wake it)──► Wheel<T>
//!                                                                                │
//!  tick(fire_due): loop { sleep until next_deadline (or a wake); fire_due(now) } │
//!                          └─ the owner drains pop_due(now) ◄──────────────────┘
//! ```
//!
//! The owners are the Node's run timers (`node-bin`'s `timers`) and the
//! connection deadlines ([`crate::net::Deadlines`]). Each keeps at most one
//! entry per timer and re-arms lazily, so progress on a busy stream costs
//! no wheel operation.

use std::cell::{Cell, RefCell};
use std::time::Instant;

use super::{TickLength, TickScale, TimerHandle, Wheel};
use crate::clock;
use crate::sync::Notify;

/// A timing wheel keyed by `Instant`, with the state its tick task needs.
/// `!Send`: one per runtime.
pub struct WheelDriver<T> {
    wheel: RefCell<Wheel<T>>,
    scale: TickScale,
    /// The tick the tick task sleeps until (`None`: no entry).
    sleeping_until: Cell<Option<u64>>,
    /// Wakes the tick task to re-read the next deadline.
    rearm: Notify,
}

impl<T> std::fmt::Debug for WheelDriver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WheelDriver")
            .field("pending", &self.len())
            .field("sleeping_until", &self.sleeping_until.get())
            .finish()
    }
}

impl<T> WheelDriver<T> {
    /// An empty wheel whose tick 0 is `origin`. Deadlines round up to whole
    /// ticks of `tick`, so nothing fires early.
    pub fn new(origin: Instant, tick: TickLength) -> Self {
        Self {
            wheel: RefCell::new(Wheel::new()),
            scale: TickScale::new(origin, tick),
            sleeping_until: Cell::new(None),
            rearm: Notify::default(),
        }
    }

    /// Pending entries.
    pub fn len(&self) -> usize {
        self.wheel.borrow().len()
    }

    /// Whether no entry is pending.
    pub fn is_empty(&self) -> bool {
        self.wheel.borrow().is_empty()
    }

    /// Adds an entry due at `deadline`; wakes the tick task if it sleeps
    /// past it.
    pub fn insert(&self, deadline: Instant, value: T) -> TimerHandle {
        let tick = self.scale.deadline_tick(deadline);
        let handle = self.wheel.borrow_mut().insert(tick, value);
        if self.sleeping_until.get().is_none_or(|t| tick < t) {
            self.sleeping_until.set(Some(tick));
            self.rearm.notify();
        }
        handle
    }

    /// Removes an entry; a handle that fired or was cancelled is inert.
    pub fn cancel(&self, handle: TimerHandle) -> Option<T> {
        self.wheel.borrow_mut().cancel(handle)
    }

    /// Whether the entry is still pending.
    pub fn contains(&self, handle: TimerHandle) -> bool {
        self.wheel.borrow().contains(handle)
    }

    /// The next entry due at `now`, if any, removed from the wheel. The
    /// wheel is not borrowed between calls, so handling one entry may
    /// insert another.
    pub fn pop_due(&self, now: Instant) -> Option<T> {
        let now_tick = self.scale.now_tick(now);
        let expired = self.wheel.borrow_mut().poll_expired(now_tick);
        expired.map(|expired| expired.value)
    }

    /// The tick task's loop: sleeps until the next entry (or until an
    /// earlier insert wakes it), then calls `fire_due` with the time, which
    /// drains [`pop_due`](Self::pop_due). Runs until its runtime stops;
    /// the runtime needs its timer enabled.
    pub async fn tick(&self, mut fire_due: impl FnMut(Instant)) {
        loop {
            let next = self.wheel.borrow().next_deadline();
            self.sleeping_until.set(next);
            match next.and_then(|tick| self.scale.instant_at(tick)) {
                Some(at) => {
                    let wait = at.saturating_duration_since(clock::now());
                    if !wait.is_zero() {
                        monoio::select! {
                            _ = monoio::time::sleep(wait) => {},
                            _ = self.rearm.notified() => {},
                        }
                    }
                }
                None => self.rearm.notified().await,
            }
            fire_due(clock::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    // Entries come out in deadline order, not a tick early, and handling
    // one may insert another (the wheel is not borrowed between pops).
    #[test]
    fn entries_are_due_at_their_deadline_in_order_and_may_reinsert() {
        let t0 = clock::now();
        let ms = Duration::from_millis;
        let tick = TickLength::new(ms(1)).expect("valid tick");
        let driver = WheelDriver::new(t0, tick);
        driver.insert(t0 + ms(20), "late");
        let early = driver.insert(t0 + ms(10), "early");
        driver.insert(t0 + ms(15), "middle");
        let cancelled = driver.insert(t0 + ms(15), "cancelled");
        assert_eq!(driver.cancel(cancelled), Some("cancelled"));
        assert_eq!(driver.len(), 3);

        assert_eq!(driver.pop_due(t0 + ms(9)), None);
        assert!(driver.contains(early));
        assert_eq!(driver.pop_due(t0 + ms(10)), Some("early"));
        assert!(!driver.contains(early));
        assert_eq!(driver.pop_due(t0 + ms(16)), Some("middle"));
        driver.insert(t0 + ms(18), "reinserted");
        assert_eq!(driver.pop_due(t0 + ms(25)), Some("reinserted"));
        assert_eq!(driver.pop_due(t0 + ms(25)), Some("late"));
        assert_eq!(driver.pop_due(t0 + ms(25)), None);
        assert!(driver.is_empty());
    }
}
