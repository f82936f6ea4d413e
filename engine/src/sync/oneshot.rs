//! A one-value channel between tasks of one core.
//!
//! Like [`super::channel`], safe to drop at any point: no waker and no
//! value is woken or dropped while its `RefCell` is borrowed.

use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// The sender was dropped without sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the sender was dropped")]
pub struct RecvError;

/// Why [`Receiver::try_recv`] has no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TryRecvError {
    /// Nothing sent yet.
    #[error("nothing sent yet")]
    Empty,
    /// The sender was dropped without sending (or the value was taken).
    #[error("the sender was dropped")]
    Closed,
}

struct State<T> {
    value: Option<T>,
    sender_alive: bool,
    receiver_alive: bool,
    receiver_waker: Option<Waker>,
}

/// Sends the one value.
pub struct Sender<T> {
    state: Rc<RefCell<State<T>>>,
}

/// Receives the one value; a future.
pub struct Receiver<T> {
    state: Rc<RefCell<State<T>>>,
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("oneshot::Sender").finish_non_exhaustive()
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("oneshot::Receiver").finish_non_exhaustive()
    }
}

/// A new one-value channel.
pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let state = Rc::new(RefCell::new(State {
        value: None,
        sender_alive: true,
        receiver_alive: true,
        receiver_waker: None,
    }));
    (
        Sender {
            state: state.clone(),
        },
        Receiver { state },
    )
}

impl<T> Sender<T> {
    /// Sends `value`; gives it back when the receiver is gone.
    pub fn send(self, value: T) -> Result<(), T> {
        let waker = {
            let mut state = self.state.borrow_mut();
            if !state.receiver_alive {
                return Err(value);
            }
            state.value = Some(value);
            state.receiver_waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        !self.state.borrow().receiver_alive
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.state.borrow_mut();
            state.sender_alive = false;
            state.receiver_waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Receiver<T> {
    /// The value if it was sent; does not wait.
    pub fn try_recv(&mut self) -> Result<T, TryRecvError> {
        let mut state = self.state.borrow_mut();
        match state.value.take() {
            Some(value) => Ok(value),
            None if state.sender_alive => Err(TryRecvError::Empty),
            None => Err(TryRecvError::Closed),
        }
    }
}

impl<T> Future for Receiver<T> {
    type Output = Result<T, RecvError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let stale = {
            let mut state = self.state.borrow_mut();
            if let Some(value) = state.value.take() {
                return Poll::Ready(Ok(value));
            }
            if !state.sender_alive {
                return Poll::Ready(Err(RecvError));
            }
            match &state.receiver_waker {
                Some(w) if w.will_wake(cx.waker()) => None,
                _ => state.receiver_waker.replace(cx.waker().clone()),
            }
        };
        drop(stale);
        Poll::Pending
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let (value, waker) = {
            let mut state = self.state.borrow_mut();
            state.receiver_alive = false;
            (state.value.take(), state.receiver_waker.take())
        };
        drop(value);
        drop(waker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[monoio::test_all(timer_enabled = true)]
    async fn the_value_arrives_once() {
        let (tx, rx) = channel::<u32>();
        let waiter = monoio::spawn(rx);
        assert_eq!(tx.send(7), Ok(()));
        assert_eq!(waiter.await, Ok(7));
    }

    #[monoio::test_all(timer_enabled = true)]
    async fn a_dropped_sender_ends_the_wait() {
        let (tx, rx) = channel::<u32>();
        let waiter = monoio::spawn(rx);
        drop(tx);
        assert_eq!(waiter.await, Err(RecvError));
    }

    #[test]
    fn try_recv_and_a_gone_receiver() {
        let (tx, mut rx) = channel::<u32>();
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        tx.send(1).unwrap();
        assert_eq!(rx.try_recv(), Ok(1));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Closed));
        let (tx, rx) = channel::<u32>();
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(2), Err(2));
    }

    // A value whose drop sends on another oneshot of the same core: the
    // receiver dropping it must not hold a borrow.
    #[test]
    fn a_value_dropped_with_the_receiver_may_use_channels() {
        struct Chain(Option<Sender<u8>>);
        impl Drop for Chain {
            fn drop(&mut self) {
                if let Some(tx) = self.0.take() {
                    let _ = tx.send(1);
                }
            }
        }
        let (next_tx, mut next_rx) = channel::<u8>();
        let (tx, rx) = channel::<Chain>();
        assert!(tx.send(Chain(Some(next_tx))).is_ok());
        drop(rx);
        assert_eq!(next_rx.try_recv(), Ok(1));
    }
}
