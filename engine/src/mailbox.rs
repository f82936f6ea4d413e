//! Bounded cross-core mailboxes: many senders on any thread, one receiver on
//! its core's monoio runtime.
//!
//! ```text
//!  core 1 ─try_send─┐
//!  core 2 ─try_send─┼─► [ bounded queue (mutex) ] ─recv_batch─► core 0 (control shard)
//!  core 3 ─send─────┘        wake only on empty → non-empty
//! ```
//!
//! Wake-ups are the expensive part of crossing cores (a cross-thread wake is
//! a syscall on the receiving runtime), so a sender wakes the receiver only
//! when it puts the first message into an empty queue, and the receiver
//! drains everything queued in one lock. Under load many messages share one
//! wake-up. The queue is bounded: [`MailboxSender::try_send`] refuses when
//! full, and [`MailboxSender::send`] waits for room.
//!
//! Requires monoio's `sync` feature (cross-thread wakers), which the
//! workspace enables.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// Why a message could not be queued; the message comes back.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum TrySendError<T> {
    /// The mailbox holds `capacity` messages.
    #[error("mailbox full")]
    Full(T),
    /// The receiver is gone.
    #[error("mailbox closed")]
    Closed(T),
}

/// The receiver is gone; the message comes back.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("mailbox closed")]
pub struct Closed<T>(pub T);

#[derive(Debug)]
struct State<T> {
    queue: VecDeque<T>,
    receiver_waker: Option<Waker>,
    sender_wakers: Vec<Waker>,
    closed: bool,
}

#[derive(Debug)]
struct Shared<T> {
    state: Mutex<State<T>>,
    capacity: usize,
    /// Live senders; the receiver ends when this reaches 0 and the queue is
    /// empty.
    senders: AtomicUsize,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding this lock cannot leave the queue
        // inconsistent (every critical section is a push, a drain or a flag
        // write), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Sends into a [`Mailbox`]; cheap to clone, usable from any thread.
#[derive(Debug)]
pub struct MailboxSender<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for MailboxSender<T> {
    fn clone(&self) -> Self {
        self.shared.senders.fetch_add(1, Ordering::Relaxed);
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T> Drop for MailboxSender<T> {
    fn drop(&mut self) {
        if self.shared.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last sender: let a waiting receiver see the end.
            let waker = self.shared.lock().receiver_waker.take();
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

/// The receiving end, owned by one core.
#[derive(Debug)]
pub struct Mailbox<T> {
    shared: Arc<Shared<T>>,
}

/// A bounded mailbox holding at most `capacity` (≥ 1) messages.
pub fn mailbox<T>(capacity: usize) -> (MailboxSender<T>, Mailbox<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            // Grown on demand: most mailboxes (one per relayed stream)
            // hold a message or two at a time, and a ring allocated at full
            // capacity gets touched all the way round as the stream runs.
            queue: VecDeque::new(),
            receiver_waker: None,
            sender_wakers: Vec::new(),
            closed: false,
        }),
        capacity: capacity.max(1),
        senders: AtomicUsize::new(1),
    });
    (
        MailboxSender {
            shared: shared.clone(),
        },
        Mailbox { shared },
    )
}

impl<T> MailboxSender<T> {
    /// Queues `msg` now, or gives it back when the mailbox is full or closed.
    pub fn try_send(&self, msg: T) -> Result<(), TrySendError<T>> {
        let waker = {
            let mut state = self.shared.lock();
            if state.closed {
                return Err(TrySendError::Closed(msg));
            }
            if state.queue.len() >= self.shared.capacity {
                return Err(TrySendError::Full(msg));
            }
            let was_empty = state.queue.is_empty();
            state.queue.push_back(msg);
            // Only the empty → non-empty transition needs a wake-up: the
            // receiver drains everything once it runs.
            if was_empty {
                state.receiver_waker.take()
            } else {
                None
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// Queues `msg`, waiting for room while the mailbox is full.
    pub async fn send(&self, msg: T) -> Result<(), Closed<T>> {
        let mut msg = Some(msg);
        poll_fn(|cx| {
            let Some(m) = msg.take() else {
                return Poll::Ready(Ok(()));
            };
            match self.try_send(m) {
                Ok(()) => Poll::Ready(Ok(())),
                Err(TrySendError::Closed(m)) => Poll::Ready(Err(Closed(m))),
                Err(TrySendError::Full(m)) => {
                    let mut state = self.shared.lock();
                    if state.queue.len() < self.shared.capacity || state.closed {
                        // Room appeared (or the receiver left) meanwhile.
                        drop(state);
                        cx.waker().wake_by_ref();
                    } else if !state.sender_wakers.iter().any(|w| w.will_wake(cx.waker())) {
                        // One waker per waiting task, however often a
                        // parked send is polled again (inside `select!`).
                        state.sender_wakers.push(cx.waker().clone());
                    }
                    msg = Some(m);
                    Poll::Pending
                }
            }
        })
        .await
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// Messages queued now (the receiver has not taken them yet).
    pub fn len(&self) -> usize {
        self.shared.lock().queue.len()
    }

    /// Whether nothing is queued now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Mailbox<T> {
    /// Waits until at least one message is queued, then moves up to `max`
    /// messages into `out` in one lock. Returns how many moved; 0 only when
    /// every sender is gone and the queue is empty.
    pub async fn recv_batch(&mut self, out: &mut Vec<T>, max: usize) -> usize {
        let max = max.max(1);
        let taken = poll_fn(|cx| {
            self.poll_take(cx, |queue| {
                let n = queue.len().min(max);
                out.extend(queue.drain(..n));
                n
            })
        });
        taken.await.unwrap_or(0)
    }

    /// Waits for the next message; `None` when every sender is gone and the
    /// queue is empty.
    pub async fn recv(&mut self) -> Option<T> {
        let taken = poll_fn(|cx| self.poll_take(cx, VecDeque::pop_front));
        taken.await.flatten()
    }

    /// Runs `take` on the queue once it holds a message (`Ready(None)`: every
    /// sender is gone and the queue is empty), then wakes the senders
    /// waiting for room.
    fn poll_take<R>(
        &self,
        cx: &mut Context<'_>,
        take: impl FnOnce(&mut VecDeque<T>) -> R,
    ) -> Poll<Option<R>> {
        let (taken, senders) = {
            let mut state = self.shared.lock();
            if state.queue.is_empty() {
                if self.shared.senders.load(Ordering::Acquire) == 0 {
                    return Poll::Ready(None);
                }
                let stale = match &state.receiver_waker {
                    Some(w) if w.will_wake(cx.waker()) => None,
                    _ => state.receiver_waker.replace(cx.waker().clone()),
                };
                drop(state);
                // A replaced waker is dropped outside the lock (its drop
                // may end a task whose future holds a sender).
                drop(stale);
                return Poll::Pending;
            }
            let taken = take(&mut state.queue);
            (taken, std::mem::take(&mut state.sender_wakers))
        };
        for w in senders {
            w.wake();
        }
        Poll::Ready(Some(taken))
    }

    /// Messages queued now.
    pub fn len(&self) -> usize {
        self.shared.lock().queue.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Drop for Mailbox<T> {
    fn drop(&mut self) {
        // Messages nobody will read are dropped now, not when the last
        // sender goes (they may hold pooled buffers or large frames).
        let (senders, unread) = {
            let mut state = self.shared.lock();
            state.closed = true;
            (
                std::mem::take(&mut state.sender_wakers),
                std::mem::take(&mut state.queue),
            )
        };
        drop(unread);
        for w in senders {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_send_is_bounded_and_closed_after_drop() {
        let (tx, rx) = mailbox::<u32>(2);
        assert_eq!(tx.try_send(1), Ok(()));
        assert_eq!(tx.try_send(2), Ok(()));
        assert_eq!(tx.try_send(3), Err(TrySendError::Full(3)));
        assert_eq!(rx.len(), 2);
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.try_send(4), Err(TrySendError::Closed(4)));
    }

    #[test]
    fn unread_messages_are_dropped_with_the_receiver() {
        let held = std::sync::Arc::new(());
        let (tx, rx) = mailbox::<std::sync::Arc<()>>(4);
        assert!(tx.try_send(held.clone()).is_ok());
        assert!(tx.try_send(held.clone()).is_ok());
        assert_eq!(std::sync::Arc::strong_count(&held), 3);
        drop(rx);
        assert_eq!(
            std::sync::Arc::strong_count(&held),
            1,
            "queued messages went with the receiver while a sender lives"
        );
        drop(tx);
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn batches_drain_in_order_and_end_when_senders_leave() {
        let (tx, mut rx) = mailbox::<u32>(16);
        for i in 0..10 {
            tx.try_send(i).unwrap();
        }
        let mut out = Vec::new();
        assert_eq!(rx.recv_batch(&mut out, 4).await, 4);
        assert_eq!(rx.recv_batch(&mut out, 100).await, 6);
        assert_eq!(out, (0..10).collect::<Vec<_>>());
        drop(tx);
        assert_eq!(rx.recv().await, None);
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn send_waits_for_room() {
        let (tx, mut rx) = mailbox::<u32>(1);
        tx.try_send(1).unwrap();
        let tx2 = tx.clone();
        let sender = monoio::spawn(async move { tx2.send(2).await });
        monoio::time::sleep(std::time::Duration::from_millis(5)).await;
        assert_eq!(rx.len(), 1);
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(sender.await, Ok(()));
        assert_eq!(rx.recv().await, Some(2));
    }

    /// Two runtimes on two threads: every message arrives exactly once, in
    /// per-sender order, and the receiver sees the end when the senders go.
    #[test]
    fn crosses_threads_with_wakeups() {
        const PER_SENDER: u32 = 20_000;
        let (tx, mut rx) = mailbox::<(u8, u32)>(64);
        let producers: Vec<_> = (0..2u8)
            .map(|id| {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    crate::rt::block_on(async move {
                        for i in 0..PER_SENDER {
                            tx.send((id, i)).await.unwrap();
                        }
                    })
                    .unwrap();
                })
            })
            .collect();
        drop(tx);
        let (counts, batches) = crate::rt::block_on(async move {
            let mut next = [0u32; 2];
            let mut batches = 0u32;
            let mut out = Vec::new();
            loop {
                out.clear();
                if rx.recv_batch(&mut out, 256).await == 0 {
                    break;
                }
                batches += 1;
                for &(id, i) in &out {
                    assert_eq!(i, next[id as usize], "sender {id} out of order");
                    next[id as usize] += 1;
                }
            }
            (next, batches)
        })
        .unwrap();
        for p in producers {
            p.join().unwrap();
        }
        assert_eq!(counts, [PER_SENDER, PER_SENDER]);
        assert!(batches >= 1);
    }
}
