//! A cap on connections in progress on one core, enforced by not
//! accepting: the accept loop takes a [`Permit`] before each `accept()`, so
//! at the cap further connections wait in the kernel's accept backlog (and
//! are served in arrival order as permits come back) instead of being
//! accepted and refused.

use std::cell::Cell;
use std::rc::Rc;

use crate::sync::WakeList;

struct Shared {
    limit: usize,
    in_use: Cell<usize>,
    room: WakeList,
}

/// A counting cap; see the module docs. Cheap to clone (clones share the
/// count).
#[derive(Clone)]
pub struct Gate {
    shared: Rc<Shared>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("limit", &self.shared.limit)
            .field("in_use", &self.shared.in_use.get())
            .finish()
    }
}

impl Gate {
    /// A gate letting `limit` holders in at once (at least one).
    pub fn new(limit: usize) -> Self {
        Self {
            shared: Rc::new(Shared {
                limit: limit.max(1),
                in_use: Cell::new(0),
                room: WakeList::default(),
            }),
        }
    }

    /// The cap.
    pub fn limit(&self) -> usize {
        self.shared.limit
    }

    /// Permits held now.
    pub fn in_use(&self) -> usize {
        self.shared.in_use.get()
    }

    /// A permit if one is free now.
    pub fn try_enter(&self) -> Option<Permit> {
        let in_use = self.shared.in_use.get();
        if in_use >= self.shared.limit {
            return None;
        }
        self.shared.in_use.set(in_use + 1);
        Some(Permit {
            shared: self.shared.clone(),
        })
    }

    /// A permit, waiting for one to come back while the gate is full.
    pub async fn enter(&self) -> Permit {
        loop {
            if let Some(permit) = self.try_enter() {
                return permit;
            }
            self.shared.room.wait().await;
        }
    }
}

/// One place inside a [`Gate`]; dropping it frees the place.
pub struct Permit {
    shared: Rc<Shared>,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Permit")
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let in_use = self.shared.in_use.get().saturating_sub(1);
        self.shared.in_use.set(in_use);
        self.shared.room.wake_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lets every other ready task run once.
    async fn yield_once() {
        let mut yielded = false;
        std::future::poll_fn(|cx| {
            if std::mem::replace(&mut yielded, true) {
                return std::task::Poll::Ready(());
            }
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        })
        .await
    }

    #[test]
    fn permits_are_counted_and_returned() {
        let gate = Gate::new(2);
        let a = gate.try_enter().expect("first");
        let b = gate.try_enter().expect("second");
        assert!(gate.try_enter().is_none());
        assert_eq!(gate.in_use(), 2);
        drop(a);
        assert_eq!(gate.in_use(), 1);
        let c = gate.try_enter().expect("a returned place");
        drop((b, c));
        assert_eq!(gate.in_use(), 0);
        assert_eq!(Gate::new(0).limit(), 1);
    }

    #[monoio::test_all]
    async fn enter_waits_for_a_permit_to_come_back() {
        let gate = Gate::new(1);
        let held = gate.enter().await;
        let waiter = {
            let gate = gate.clone();
            monoio::spawn(async move {
                let _permit = gate.enter().await;
                gate.in_use()
            })
        };
        // The waiter cannot get in while the permit is held.
        for _ in 0..10 {
            yield_once().await;
        }
        assert_eq!(gate.in_use(), 1);
        drop(held);
        assert_eq!(waiter.await, 1);
        assert_eq!(gate.in_use(), 0);
    }
}
