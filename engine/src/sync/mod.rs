//! Single-threaded wake-ups and channels between tasks of one core (no
//! atomics, no allocation per wake).
//!
//! - [`Notify`]: wake one waiting task.
//! - [`WakeList`]: wake every waiting task.
//! - [`channel`]: a bounded many-to-one queue; [`oneshot`]: one value.
//! - [`Either`]: one of two futures, chosen before either is polled.
//!
//! Every type here is drop-safe: no waker and no value is woken or dropped
//! while a `RefCell` of ours is borrowed. Dropping a waker can drop the last
//! reference to a task and with it a future that holds another handle on
//! the same state; under a borrow that is a `RefCell already borrowed`
//! panic inside a destructor, which aborts the process.

pub mod channel;
mod either;
pub mod oneshot;

pub use either::Either;

use std::cell::{Cell, RefCell};
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// Wakes one waiting task; a notification sent while nobody waits is kept
/// for the next wait (like `tokio::sync::Notify::notify_one`).
#[derive(Debug, Default)]
pub struct Notify {
    notified: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Notify {
    /// Wakes the waiter, or lets its next wait return at once.
    pub fn notify(&self) {
        self.notified.set(true);
        let waker = self.waker.borrow_mut().take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Waits for a notification (consumes it).
    pub async fn notified(&self) {
        poll_fn(|cx| {
            if self.notified.replace(false) {
                return Poll::Ready(());
            }
            let stale = {
                let mut slot = self.waker.borrow_mut();
                match slot.as_ref() {
                    Some(waker) if waker.will_wake(cx.waker()) => None,
                    _ => slot.replace(cx.waker().clone()),
                }
            };
            // Dropped outside the borrow.
            drop(stale);
            Poll::Pending
        })
        .await
    }
}

/// Wakes every waiting task (senders waiting for bulk lane room, shards
/// waiting for a lifecycle step). Waiters re-check their condition after
/// waking.
///
/// Each waiting future owns one slot, updated in place when it is polled
/// again (a wait inside `select!` is re-polled on every wake of its task),
/// and freed when the future completes or is dropped: the list never holds
/// more wakers than there are waiting futures.
#[derive(Debug, Default)]
pub struct WakeList {
    waiters: RefCell<slab::Slab<Waker>>,
    /// Bumped by every [`wake_all`](Self::wake_all); a wait started in an
    /// older generation has been woken.
    generation: Cell<u64>,
}

impl WakeList {
    /// True when some task waits.
    pub fn has_waiters(&self) -> bool {
        !self.waiters.borrow().is_empty()
    }

    /// Wakers held now (one per waiting future).
    pub fn len(&self) -> usize {
        self.waiters.borrow().len()
    }

    /// True when no task waits.
    pub fn is_empty(&self) -> bool {
        !self.has_waiters()
    }

    /// Wakes every waiter.
    pub fn wake_all(&self) {
        self.generation.set(self.generation.get().wrapping_add(1));
        let waiters = std::mem::take(&mut *self.waiters.borrow_mut());
        for (_, waker) in waiters {
            waker.wake();
        }
    }

    /// Waits until the next [`wake_all`](Self::wake_all). The caller checks
    /// its condition before waiting; with one thread nothing can change in
    /// between, so no wake-up is lost.
    pub fn wait(&self) -> WakeListWait<'_> {
        WakeListWait {
            list: self,
            generation: self.generation.get(),
            slot: None,
        }
    }
}

/// The future of [`WakeList::wait`].
#[derive(Debug)]
pub struct WakeListWait<'a> {
    list: &'a WakeList,
    generation: u64,
    slot: Option<usize>,
}

impl WakeListWait<'_> {
    fn woken(&self) -> bool {
        self.list.generation.get() != self.generation
    }
}

impl Future for WakeListWait<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.woken() {
            // `wake_all` emptied the list, our slot included.
            self.slot = None;
            return Poll::Ready(());
        }
        let (slot, stale) = {
            let mut waiters = self.list.waiters.borrow_mut();
            match self.slot.and_then(|slot| waiters.get_mut(slot)) {
                Some(waker) if waker.will_wake(cx.waker()) => (None, None),
                Some(waker) => (None, Some(std::mem::replace(waker, cx.waker().clone()))),
                None => (Some(waiters.insert(cx.waker().clone())), None),
            }
        };
        // A replaced waker is dropped outside the borrow.
        drop(stale);
        if slot.is_some() {
            self.slot = slot;
        }
        Poll::Pending
    }
}

impl Drop for WakeListWait<'_> {
    fn drop(&mut self) {
        // Within a generation a slot is freed only by its own future, so it
        // is still ours unless `wake_all` ran since (which freed it).
        if let (Some(slot), false) = (self.slot, self.woken()) {
            let removed = self.list.waiters.borrow_mut().try_remove(slot);
            // Dropped outside the borrow.
            drop(removed);
        }
    }
}

#[cfg(test)]
mod wake_list_tests {
    use std::pin::pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    use super::*;

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn counting() -> (Arc<CountingWaker>, Waker) {
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = Waker::from(counter.clone());
        (counter, waker)
    }

    #[test]
    fn repolling_a_wait_holds_one_waker() {
        let list = WakeList::default();
        let (counter, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        let mut wait = pin!(list.wait());
        for _ in 0..1000 {
            assert_eq!(wait.as_mut().poll(&mut cx), Poll::Pending);
        }
        assert_eq!(list.len(), 1, "one slot however often it is polled");
        list.wake_all();
        assert_eq!(counter.0.load(Ordering::Relaxed), 1);
        assert!(list.is_empty());
        assert_eq!(wait.as_mut().poll(&mut cx), Poll::Ready(()));
    }

    #[test]
    fn a_dropped_wait_frees_its_slot_and_others_still_wake() {
        let list = WakeList::default();
        let (_counter, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        let mut kept = Box::pin(list.wait());
        {
            let mut dropped = Box::pin(list.wait());
            assert_eq!(dropped.as_mut().poll(&mut cx), Poll::Pending);
            assert_eq!(kept.as_mut().poll(&mut cx), Poll::Pending);
            assert_eq!(list.len(), 2);
        }
        assert_eq!(list.len(), 1, "the dropped wait's slot is free");
        list.wake_all();
        assert_eq!(kept.as_mut().poll(&mut cx), Poll::Ready(()));
        // A wait begun after the wake waits for the next one.
        let mut later = Box::pin(list.wait());
        assert_eq!(later.as_mut().poll(&mut cx), Poll::Pending);
        drop(kept);
        assert_eq!(list.len(), 1, "a woken wait's drop frees nothing");
        list.wake_all();
        assert_eq!(later.as_mut().poll(&mut cx), Poll::Ready(()));
    }
}
