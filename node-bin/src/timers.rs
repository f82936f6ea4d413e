//! The Node core's timer service: one [`iop_engine::wheel::WheelDriver`]
//! per core, ticked by one task, driving every run's and tunnel's watchdog
//! deadlines.
//!
//! ```text
//!  RunTimer::arm(deadline) ──insert/cancel (O(1))──► WheelDriver<Weak<Slot>> ◄── tick task
//!        ▲                                                 │ sleeps until next_deadline
//!        └──────────── Slot::fired (Notify) ◄── pop_due ───┘ (or an earlier insert)
//! ```
//!
//! A [`RunTimer`] holds at most one wheel entry. Re-arming is lazy: a later
//! deadline keeps the earlier entry (the watchdog, woken early, finds nothing
//! due and re-arms), an earlier one replaces it. So progress on a busy stream
//! costs no wheel operation at all; only idle streams touch the wheel.
//! Deadlines round up to whole ticks, so a timer never fires early.

use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use iop_engine::sync::Notify;
use iop_engine::wheel::{TickLength, TimerHandle, WheelDriver};

/// Length of one wheel tick.
pub const TICK: Duration = Duration::from_millis(1);

/// Per-timer wake-up.
#[derive(Debug, Default)]
struct Slot {
    fired: Notify,
}

/// The per-core timer service. Create one with [`Timers::new`] and spawn
/// [`Timers::run`] on the same core.
#[derive(Debug)]
pub struct Timers {
    wheel: WheelDriver<Weak<Slot>>,
}

impl Timers {
    /// A service whose tick 0 is `origin`.
    pub fn new(origin: Instant) -> Rc<Self> {
        #[allow(clippy::expect_used)] // a non-zero constant, not input
        let length = TickLength::new(TICK).expect("TICK is a valid non-zero tick length");
        Rc::new(Self {
            wheel: WheelDriver::new(origin, length),
        })
    }

    /// Pending timers.
    pub fn len(&self) -> usize {
        self.wheel.len()
    }

    /// Whether no timer is pending.
    pub fn is_empty(&self) -> bool {
        self.wheel.is_empty()
    }

    /// A timer for one run; disarmed until [`RunTimer::arm`].
    pub fn timer(self: &Rc<Self>) -> RunTimer {
        RunTimer {
            timers: self.clone(),
            slot: Rc::new(Slot::default()),
            armed: None,
        }
    }

    /// Fires every timer due at `now` (wakes its run). Returns how many.
    pub fn fire_due(&self, now: Instant) -> usize {
        let mut fired = 0;
        while let Some(due) = self.wheel.pop_due(now) {
            if let Some(slot) = due.upgrade() {
                slot.fired.notify();
                fired += 1;
            }
        }
        fired
    }

    /// The tick task: sleeps until the next deadline (or an earlier insert)
    /// and fires what is due. Runs until its runtime stops.
    pub async fn run(self: Rc<Self>) {
        self.wheel
            .tick(|now| {
                self.fire_due(now);
            })
            .await;
    }

    fn insert(&self, deadline: Instant, slot: &Rc<Slot>) -> TimerHandle {
        self.wheel.insert(deadline, Rc::downgrade(slot))
    }

    fn cancel(&self, handle: TimerHandle) {
        self.wheel.cancel(handle);
    }

    fn is_pending(&self, handle: TimerHandle) -> bool {
        self.wheel.contains(handle)
    }
}

/// One run's timer: at most one pending wheel entry.
#[derive(Debug)]
pub struct RunTimer {
    timers: Rc<Timers>,
    slot: Rc<Slot>,
    armed: Option<(TimerHandle, Instant)>,
}

impl RunTimer {
    /// Makes [`fired`](Self::fired) complete at or after `deadline` (`None`:
    /// never). Lazy: a pending earlier entry is kept (the caller re-checks
    /// and re-arms when it fires).
    pub fn arm(&mut self, deadline: Option<Instant>) {
        let pending = self
            .armed
            .filter(|(handle, _)| self.timers.is_pending(*handle));
        match (pending, deadline) {
            (Some((_, at)), Some(d)) if at <= d => {}
            (pending, deadline) => {
                if let Some((handle, _)) = pending {
                    self.timers.cancel(handle);
                }
                self.armed = deadline.map(|d| (self.timers.insert(d, &self.slot), d));
            }
        }
    }

    /// Completes when the armed deadline passes (possibly early after a
    /// lazy re-arm). Cancel-safe.
    pub async fn fired(&self) {
        self.slot.fired.notified().await;
    }
}

impl Drop for RunTimer {
    fn drop(&mut self) {
        if let Some((handle, _)) = self.armed.take() {
            self.timers.cancel(handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll};

    use iop_engine::clock;

    use super::*;

    fn is_ready(f: impl Future<Output = ()>) -> bool {
        let mut f = pin!(f);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        matches!(f.as_mut().poll(&mut cx), Poll::Ready(()))
    }

    // The wheel drives watchdog deadlines: a timer fires at its deadline,
    // not a tick before; re-arming later keeps one entry; drop cancels.
    #[test]
    fn timers_fire_at_their_deadline_and_rearm_lazily() {
        let t0 = clock::now();
        let timers = Timers::new(t0);
        let mut a = timers.timer();
        let mut b = timers.timer();
        a.arm(Some(t0 + Duration::from_millis(10)));
        b.arm(Some(t0 + Duration::from_millis(20)));
        // Later deadline: lazily kept at 10 ms, still one entry.
        a.arm(Some(t0 + Duration::from_millis(15)));
        assert_eq!(timers.len(), 2);
        assert_eq!(timers.fire_due(t0 + Duration::from_micros(9_999)), 0);
        assert!(!is_ready(a.fired()));
        assert_eq!(timers.fire_due(t0 + Duration::from_millis(10)), 1);
        assert!(is_ready(a.fired()));
        assert!(!is_ready(b.fired()));
        // Earlier deadline replaces the pending entry.
        b.arm(Some(t0 + Duration::from_millis(12)));
        assert_eq!(timers.len(), 1);
        a.arm(Some(t0 + Duration::from_millis(15)));
        assert_eq!(timers.len(), 2);
        drop(a);
        assert_eq!(timers.len(), 1);
        assert_eq!(timers.fire_due(t0 + Duration::from_millis(30)), 1);
        assert!(is_ready(b.fired()));
        b.arm(None);
        assert!(timers.is_empty());
    }
}
