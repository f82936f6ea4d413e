//! The two ends of a provider call: the call's [`OutputTx`] and the
//! attempt's [`ProviderSide`], with the aborts that stop the call.
//!
//! ```text
//!  provider call (owns the socket)          attempt (session core)
//!  ───────────────────────────────          ──────────────────────
//!  OutputTx::send ──bounded queue──────────► ProviderSide::recv ──► drive
//!     (a core-local channel, or a cross-core mailbox; `send` waits while
//!      the queue is full: back-pressure reaches the provider socket)
//!  the call is dropped ◄──────(inline) / CrossAbort── ProviderSide::abort
//! ```
//!
//! A call on the session core itself runs *inline*: it has no task of its
//! own, the attempt's task polls it from [`ProviderSide::recv`] (one task
//! and one wake per provider read fewer; the call makes progress while
//! the attempt waits for output, as a task of its own would until its
//! queue filled). A call on a worker core runs in a task there.
//!
//! The queue closes when the provider call returns (its last sender is
//! dropped after the call future), which is how the attempt learns of the
//! return (W10).

use std::cell::Cell;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Instant;

use iop_engine::clock;
use iop_engine::mailbox::{Mailbox, MailboxSender};
use iop_engine::metrics::{self, Count, Latency};
use iop_engine::sync::channel;

use super::pool::ProviderPool;
use crate::adapters::Permit;

/// Provider outputs buffered between a provider call and its attempt.
pub const OUTPUT_QUEUE: usize = 8;

/// A provider call: the HTTP exchange of one attempt, producing outputs
/// through an [`OutputTx`]. Everything it carries is `Send` (endpoint,
/// request bytes, the opened credential), so it can run on the session
/// core or be handed to a worker core ([`super::workers`]); the future it
/// makes runs on the core it was started on, against that core's pool.
pub trait ProviderCall: Send + 'static {
    /// What the call produces (and the attempt's emitter takes).
    type Output: Send + 'static;

    /// Runs the exchange against `pool` (the running core's keep-alive
    /// pool), sending outputs to `out`, the last one a terminal.
    fn run(
        self,
        pool: Rc<ProviderPool>,
        out: OutputTx<Self::Output>,
    ) -> impl Future<Output = ()> + 'static;

    /// The failure terminal of a call that could not be started at all
    /// (no worker core took it).
    fn not_started(message: String) -> Self::Output;
}

/// One provider output with the moment the provider call handed it over
/// (right after its read), for the relay latency histograms.
#[derive(Debug)]
pub struct Stamped<O> {
    /// When the provider call handed the output over.
    pub read_at: Instant,
    /// The output.
    pub output: O,
}

/// Where a provider call's outputs go: a core-local channel, or the
/// cross-core mailbox of a call running on a worker core.
enum Sender<O> {
    Local(channel::Sender<Stamped<O>>),
    Remote(MailboxSender<Stamped<O>>),
}

/// The provider call's end of the output channel.
pub struct OutputTx<O> {
    tx: Sender<O>,
}

impl<O> std::fmt::Debug for OutputTx<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputTx").finish_non_exhaustive()
    }
}

impl<O> OutputTx<O> {
    /// The sending end of a core-local output channel.
    pub(super) fn local(tx: channel::Sender<Stamped<O>>) -> Self {
        Self {
            tx: Sender::Local(tx),
        }
    }

    /// The sending end of a cross-core output mailbox.
    pub(super) fn remote(tx: MailboxSender<Stamped<O>>) -> Self {
        Self {
            tx: Sender::Remote(tx),
        }
    }

    /// Hands one output to the attempt, waiting while the queue is full
    /// (backpressure reaches the provider socket). False once the attempt
    /// is gone.
    pub async fn send(&self, output: O) -> bool {
        let read_at = clock::now();
        let stamped = Stamped { read_at, output };
        match &self.tx {
            Sender::Local(tx) => tx.send(stamped).await.is_ok(),
            Sender::Remote(tx) => tx.send(stamped).await.is_ok(),
        }
    }
}

/// A call running inline, until it returns or is aborted: its future and
/// the capacity permit it holds (W10).
pub(super) struct InlineCall {
    future: Pin<Box<dyn Future<Output = ()>>>,
    _permit: Option<Permit>,
}

impl InlineCall {
    /// `future` holding `permit`.
    pub(super) fn new(future: impl Future<Output = ()> + 'static, permit: Option<Permit>) -> Self {
        Self {
            future: Box::pin(future),
            _permit: permit,
        }
    }
}

/// The driver's end of the outputs.
enum Receiver<O> {
    /// A call on this core, polled by [`Receiver::recv`] itself.
    Inline {
        outputs: channel::Receiver<Stamped<O>>,
        /// `None` once the call returned or was aborted.
        call: Cell<Option<InlineCall>>,
    },
    Remote {
        mailbox: Mailbox<Stamped<O>>,
        /// Outputs taken in one batch (one lock, at most one cross-core
        /// wake per batch), in reverse order: the next one is last.
        batch: Vec<Stamped<O>>,
    },
}

impl<O> Receiver<O> {
    /// The next output; `None` once the call returned (every sender is
    /// gone). Cancel-safe: nothing is taken unless it is returned.
    async fn recv(&mut self, started_at: Instant) -> Option<Stamped<O>> {
        match self {
            Receiver::Inline { outputs, call } => {
                poll_fn(|cx| loop {
                    if let Some(output) = outputs.try_recv() {
                        return Poll::Ready(Some(output));
                    }
                    let Some(mut running) = call.take() else {
                        // Returned (or aborted): its sender is gone and
                        // nothing is queued.
                        return Poll::Ready(None);
                    };
                    if running.future.as_mut().poll(cx).is_pending() {
                        call.set(Some(running));
                        return match outputs.try_recv() {
                            Some(output) => Poll::Ready(Some(output)),
                            None => Poll::Pending,
                        };
                    }
                    // Returned (its permit goes with it): what it queued
                    // last, then the end.
                    drop(running);
                    // metrics: provider call duration (returned).
                    metrics::record_since(Latency::NodeProviderCallDuration, started_at);
                })
                .await
            }
            Receiver::Remote { mailbox, batch } => {
                if batch.is_empty() {
                    if mailbox.recv_batch(batch, OUTPUT_QUEUE).await == 0 {
                        return None;
                    }
                    batch.reverse();
                }
                batch.pop()
            }
        }
    }
}

/// The driver's end of a provider call.
pub struct ProviderSide<O> {
    outputs: Receiver<O>,
    /// Aborts a call running on a worker core (an inline call is dropped).
    remote_abort: Option<Arc<CrossAbort>>,
    /// The capacity permit of a call running on a worker core: it stays on
    /// the session core and is dropped when the worker reports the call's
    /// return (W10). `None` for an inline call (its future holds it).
    held: Option<Permit>,
    /// When the provider call was spawned (metrics: provider TTFB).
    started_at: Instant,
}

impl<O> std::fmt::Debug for ProviderSide<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderSide")
            .field("remote_abort", &self.remote_abort)
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl<O> ProviderSide<O> {
    /// The attempt's side of `call`, which runs inline (polled by
    /// [`recv`](Self::recv)) and holds the permit until it returns or is
    /// aborted.
    pub(super) fn inline(
        outputs: channel::Receiver<Stamped<O>>,
        call: InlineCall,
        started_at: Instant,
    ) -> Self {
        Self {
            outputs: Receiver::Inline {
                outputs,
                call: Cell::new(Some(call)),
            },
            remote_abort: None,
            held: None,
            started_at,
        }
    }

    /// The session side of a call handed to a worker core: its output
    /// mailbox, its cross-core abort, and the permit held here until the
    /// mailbox ends (the call returned on the worker).
    pub(super) fn remote(
        mailbox: Mailbox<Stamped<O>>,
        abort: Arc<CrossAbort>,
        permit: Option<Permit>,
        started_at: Instant,
    ) -> Self {
        Self {
            outputs: Receiver::Remote {
                mailbox,
                batch: Vec::with_capacity(OUTPUT_QUEUE),
            },
            remote_abort: Some(abort),
            held: permit,
            started_at,
        }
    }

    /// Aborts the provider call (idempotent): it is dropped on its core,
    /// closing its socket without a check-in (and, inline, releasing its
    /// permit) at once.
    pub fn abort(&self) {
        match (&self.outputs, &self.remote_abort) {
            (Receiver::Inline { call, .. }, _) => {
                if let Some(running) = call.take() {
                    drop(running);
                    metrics::add(Count::NodeProviderCallsAborted, 1);
                    // metrics: provider call duration (aborted).
                    metrics::record_since(Latency::NodeProviderCallDuration, self.started_at);
                }
            }
            (Receiver::Remote { .. }, Some(signal)) => signal.abort(),
            (Receiver::Remote { .. }, None) => {}
        }
    }

    /// When the call was started (metrics: provider time to first byte).
    pub fn started_at(&self) -> Instant {
        self.started_at
    }

    /// The next output with its stamp; `None` once the call returned, and
    /// then a permit held for it here is released. Cancel-safe: nothing is
    /// taken unless it is returned.
    pub async fn recv(&mut self) -> Option<Stamped<O>> {
        let next = self.outputs.recv(self.started_at).await;
        if next.is_none() {
            self.held = None;
        }
        next
    }

    /// [`recv`](Self::recv) without the stamp, for callers that read a
    /// call's outputs without a watchdog (tests, probes).
    pub async fn next_output(&mut self) -> Option<O> {
        self.recv().await.map(|stamped| stamped.output)
    }
}

impl<O> Drop for ProviderSide<O> {
    fn drop(&mut self) {
        // A call whose attempt is gone has nobody to report to. (`drive`
        // only returns after the call's return, when this is a no-op; an
        // inline call goes with this side.)
        if let Some(signal) = &self.remote_abort {
            signal.abort();
        }
    }
}

/// Aborts a provider call running on another core: a flag and the waker of
/// the task that waits for it.
#[derive(Debug, Default)]
pub struct CrossAbort {
    aborted: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl CrossAbort {
    fn waker_slot(&self) -> MutexGuard<'_, Option<Waker>> {
        // The critical sections only swap an `Option<Waker>`: a poisoned
        // lock still holds a consistent value.
        self.waker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Aborts the call (idempotent); wakes its task on whatever core.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            let waker = self.waker_slot().take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }

    /// Whether [`abort`](Self::abort) was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Completes once the call is aborted.
    pub async fn aborted(&self) {
        poll_fn(|cx| {
            if self.is_aborted() {
                return Poll::Ready(());
            }
            let stale = {
                let mut slot = self.waker_slot();
                match slot.as_ref() {
                    Some(waker) if waker.will_wake(cx.waker()) => None,
                    _ => slot.replace(cx.waker().clone()),
                }
            };
            // Dropped outside the lock.
            drop(stale);
            // An abort between the first check and the registration took
            // no waker (or ours): look again.
            if self.is_aborted() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }
}
