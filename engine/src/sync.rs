//! Single-threaded wake-ups between tasks of one core (no atomics, no
//! allocation per wake).

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::task::{Poll, Waker};

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
            let mut slot = self.waker.borrow_mut();
            match slot.as_ref() {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                _ => *slot = Some(cx.waker().clone()),
            }
            Poll::Pending
        })
        .await
    }
}

/// Wakes every waiting task (senders waiting for bulk lane room). Waiters
/// re-check their condition after waking.
#[derive(Debug, Default)]
pub struct WakeList {
    wakers: RefCell<Vec<Waker>>,
}

impl WakeList {
    /// True when some task waits.
    pub fn has_waiters(&self) -> bool {
        !self.wakers.borrow().is_empty()
    }

    /// Wakes every waiter.
    pub fn wake_all(&self) {
        let wakers = std::mem::take(&mut *self.wakers.borrow_mut());
        for waker in wakers {
            waker.wake();
        }
    }

    /// Waits until the next [`wake_all`](Self::wake_all). The caller checks
    /// its condition before waiting; with one thread nothing can change in
    /// between, so no wake-up is lost.
    pub async fn wait(&self) {
        let mut registered = false;
        poll_fn(|cx| {
            if registered {
                return Poll::Ready(());
            }
            registered = true;
            self.wakers.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}
