//! A bounded many-to-one channel between tasks of one core.
//!
//! ```text
//!  Sender ─try_send / send (waits while full)─► [ VecDeque, capacity ] ─recv─► Receiver
//!            └── parked senders: WakeList ◄── room made (a recv, the receiver's drop)
//! ```
//!
//! Every operation is safe to drop at any await point, in any order, also
//! while the runtime tears tasks down: no waker and no queued value is ever
//! woken or dropped while the channel's `RefCell` is borrowed. (Dropping a
//! waker can drop the last reference to a task, and with it a future that
//! holds another end of this very channel; doing that under a borrow is the
//! `RefCell already borrowed` abort this type exists to rule out.)
//!
//! Not `Send`: both ends live on the core that created them. Across cores
//! use [`crate::mailbox`].

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};

use super::WakeList;

/// Why [`Sender::try_send`] refused; the value comes back.
#[derive(PartialEq, Eq, thiserror::Error)]
pub enum TrySendError<T> {
    /// The channel holds its capacity.
    #[error("channel full")]
    Full(T),
    /// The receiver is gone.
    #[error("channel closed")]
    Closed(T),
}

impl<T> fmt::Debug for TrySendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrySendError::Full(_) => f.write_str("Full(..)"),
            TrySendError::Closed(_) => f.write_str("Closed(..)"),
        }
    }
}

/// The receiver is gone; the value comes back.
#[derive(PartialEq, Eq, thiserror::Error)]
#[error("channel closed")]
pub struct SendError<T>(pub T);

impl<T> fmt::Debug for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SendError(..)")
    }
}

struct State<T> {
    queue: VecDeque<T>,
    senders: usize,
    receiver_alive: bool,
    receiver_waker: Option<Waker>,
}

struct Shared<T> {
    state: RefCell<State<T>>,
    capacity: usize,
    /// Senders waiting for room.
    room: WakeList,
}

/// The sending end; cheap to clone.
pub struct Sender<T> {
    shared: Rc<Shared<T>>,
}

/// The receiving end.
pub struct Receiver<T> {
    shared: Rc<Shared<T>>,
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender")
            .field("capacity", &self.shared.capacity)
            .finish_non_exhaustive()
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("queued", &self.len())
            .finish_non_exhaustive()
    }
}

/// A channel holding at most `capacity` (≥ 1) values. Room for one value
/// is allocated at once, more as more wait (a one-value channel never
/// takes the four a growing queue starts with).
pub fn channel<T>(capacity: usize) -> (Sender<T>, Receiver<T>) {
    let shared = Rc::new(Shared {
        state: RefCell::new(State {
            queue: VecDeque::with_capacity(1),
            senders: 1,
            receiver_alive: true,
            receiver_waker: None,
        }),
        capacity: capacity.max(1),
        room: WakeList::default(),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.shared.state.borrow_mut().senders += 1;
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.shared.state.borrow_mut();
            state.senders -= 1;
            if state.senders == 0 {
                state.receiver_waker.take()
            } else {
                None
            }
        };
        // Woken (or dropped) outside the borrow.
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Sender<T> {
    /// Queues `value` now, or gives it back when the channel is full or
    /// the receiver is gone.
    pub fn try_send(&self, value: T) -> Result<(), TrySendError<T>> {
        let waker = {
            let mut state = self.shared.state.borrow_mut();
            if !state.receiver_alive {
                return Err(TrySendError::Closed(value));
            }
            if state.queue.len() >= self.shared.capacity {
                return Err(TrySendError::Full(value));
            }
            state.queue.push_back(value);
            state.receiver_waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// Queues `value`, waiting while the channel is full. Dropping the
    /// future while it waits drops `value` and nothing else.
    pub async fn send(&self, value: T) -> Result<(), SendError<T>> {
        let mut value = value;
        loop {
            // Created before the check: a wake between the check and the
            // first poll is not lost (the wait sees the new generation).
            let room = self.shared.room.wait();
            match self.try_send(value) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Closed(back)) => return Err(SendError(back)),
                Err(TrySendError::Full(back)) => {
                    value = back;
                    room.await;
                }
            }
        }
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        !self.shared.state.borrow().receiver_alive
    }
}

impl<T> Receiver<T> {
    /// The next value; `None` once every sender is gone and the queue is
    /// empty. Cancel-safe: a value is taken only when it is returned.
    pub async fn recv(&mut self) -> Option<T> {
        poll_fn(|cx| {
            let (result, stale) = {
                let mut state = self.shared.state.borrow_mut();
                match state.queue.pop_front() {
                    Some(value) => (Poll::Ready(Some(value)), None),
                    None if state.senders == 0 => (Poll::Ready(None), None),
                    None => {
                        let stale = match &state.receiver_waker {
                            Some(w) if w.will_wake(cx.waker()) => None,
                            _ => state.receiver_waker.replace(cx.waker().clone()),
                        };
                        (Poll::Pending, stale)
                    }
                }
            };
            drop(stale);
            if result.is_ready() && self.shared.room.has_waiters() {
                self.shared.room.wake_all();
            }
            result
        })
        .await
    }

    /// The next value if one is queued now.
    pub fn try_recv(&mut self) -> Option<T> {
        let value = self.shared.state.borrow_mut().queue.pop_front();
        if value.is_some() && self.shared.room.has_waiters() {
            self.shared.room.wake_all();
        }
        value
    }

    /// Values queued now.
    pub fn len(&self) -> usize {
        self.shared.state.borrow().queue.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let (unread, waker) = {
            let mut state = self.shared.state.borrow_mut();
            state.receiver_alive = false;
            (
                std::mem::take(&mut state.queue),
                state.receiver_waker.take(),
            )
        };
        // Unread values (they may hold pooled buffers, permits, or other
        // channels' ends) go now, outside the borrow.
        drop(unread);
        drop(waker);
        self.shared.room.wake_all();
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Wake};
    use std::time::Duration;

    use super::*;

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn try_send_is_bounded_and_fails_once_the_receiver_is_gone() {
        let (tx, mut rx) = channel::<u32>(2);
        assert_eq!(tx.try_send(1), Ok(()));
        assert_eq!(tx.try_send(2), Ok(()));
        assert_eq!(tx.try_send(3), Err(TrySendError::Full(3)));
        assert_eq!(rx.try_recv(), Some(1));
        assert_eq!(tx.try_send(3), Ok(()));
        assert_eq!(rx.len(), 2);
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.try_send(4), Err(TrySendError::Closed(4)));
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn recv_ends_after_the_last_sender_and_the_queue() {
        let (tx, mut rx) = channel::<u32>(4);
        let tx2 = tx.clone();
        tx.try_send(1).unwrap();
        drop(tx);
        tx2.try_send(2).unwrap();
        drop(tx2);
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(rx.recv().await, None);
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn a_parked_sender_resumes_when_room_is_made() {
        let (tx, mut rx) = channel::<u32>(1);
        tx.try_send(1).unwrap();
        let sender = monoio::spawn(async move { tx.send(2).await });
        monoio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(rx.len(), 1, "the second value waits");
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(sender.await, Ok(()));
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(rx.recv().await, None);
    }

    // A sender parked on a full queue, dropped (the task holding it is
    // cancelled): its value goes, its wait slot goes, and the channel keeps
    // working for everyone else.
    #[test]
    fn dropping_a_parked_send_drops_its_value_and_nothing_else() {
        let held = Rc::new(());
        let (tx, mut rx) = channel::<Rc<()>>(1);
        tx.try_send(held.clone()).unwrap();
        let waker = Waker::from(Arc::new(CountingWaker(AtomicUsize::new(0))));
        let mut cx = Context::from_waker(&waker);
        {
            let mut parked = pin!(tx.send(held.clone()));
            assert!(parked.as_mut().poll(&mut cx).is_pending());
            assert!(parked.as_mut().poll(&mut cx).is_pending());
            assert_eq!(Rc::strong_count(&held), 3);
            assert_eq!(tx.shared.room.len(), 1, "one slot however often polled");
        }
        assert_eq!(Rc::strong_count(&held), 2, "the parked value went with it");
        assert!(tx.shared.room.is_empty());
        assert!(rx.try_recv().is_some());
        assert_eq!(tx.try_send(held.clone()), Ok(()));
    }

    /// A value whose drop uses the channel it was queued on: dropping the
    /// receiver (which drops unread values) must not be under a borrow.
    struct SendsOnDrop {
        tx: Option<Sender<SendsOnDrop>>,
        dropped: Rc<Cell<u32>>,
    }

    impl Drop for SendsOnDrop {
        fn drop(&mut self) {
            self.dropped.set(self.dropped.get() + 1);
            if let Some(tx) = self.tx.take() {
                let _ = tx.try_send(SendsOnDrop {
                    tx: None,
                    dropped: self.dropped.clone(),
                });
                assert!(tx.is_closed());
            }
        }
    }

    #[test]
    fn values_dropped_with_the_receiver_may_use_the_channel() {
        let dropped = Rc::new(Cell::new(0));
        let (tx, rx) = channel::<SendsOnDrop>(4);
        tx.try_send(SendsOnDrop {
            tx: Some(tx.clone()),
            dropped: dropped.clone(),
        })
        .unwrap();
        drop(rx);
        // The queued value, then the one its drop tried to send (refused
        // and handed back, so dropped too).
        assert_eq!(dropped.get(), 2);
        drop(tx);
    }

    // The shape of the node-bin abort this channel replaces: many tasks
    // parked on full queues, cancelled (their futures dropped) in a loop
    // while their receivers are dropped too — the process stays up and
    // every value is accounted for.
    #[monoio::test_all(timer_enabled = true)]
    async fn cancelling_a_thousand_parked_senders_in_a_loop() {
        let held = Rc::new(());
        for round in 0..10 {
            let mut tasks = Vec::new();
            let mut receivers = Vec::new();
            for _ in 0..100 {
                let (tx, rx) = channel::<Rc<()>>(1);
                tx.try_send(held.clone()).unwrap();
                let value = held.clone();
                let abort = Rc::new(crate::sync::Notify::default());
                let task_abort = abort.clone();
                let task = monoio::spawn(async move {
                    monoio::select! {
                        _ = tx.send(value) => false,
                        _ = task_abort.notified() => true,
                    }
                });
                tasks.push((task, abort));
                receivers.push(rx);
            }
            monoio::time::sleep(Duration::from_millis(1)).await;
            // Half: receivers dropped first; half: the senders cancelled first.
            if round % 2 == 0 {
                receivers.clear();
            }
            for (_, abort) in &tasks {
                abort.notify();
            }
            for (task, _) in tasks {
                let _ = task.await;
            }
            receivers.clear();
            assert_eq!(
                Rc::strong_count(&held),
                1,
                "round {round}: every value dropped"
            );
        }
    }
}
