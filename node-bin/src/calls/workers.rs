//! Provider worker cores (`--cores` with two or more cores): the control
//! shard keeps the Edge session, the run manager, the watchdog wheel, the
//! emitters and the capacity gates; every provider call runs on a worker
//! core, against that core's own keep-alive [`ProviderPool`].
//!
//! ```text
//!  control shard (session core)                      worker core k
//!  ────────────────────────────                      ─────────────
//!  CallSite::spawn ─Job (Send: endpoint, request,──► inbox ─► task: call.run(pool_k, out)
//!    │ permit stays here      body Bytes, secret)         │ provider socket ─read─► Bytes
//!    │                                                     │
//!  drive ◄──outputs (mailbox, OUTPUT_QUEUE; the same ◄─────┘ send waits while full:
//!    │       Bytes, never copied)                             backpressure to the socket
//!    ├─ CancelProvider ──CrossAbort──────────────────────► the task drops the call
//!    │                                                       (socket closed, no check-in)
//!    └─ mailbox ends (the call returned or was dropped) ◄── last sender dropped after
//!       ⇒ permit released (W10)                              the call future
//! ```
//!
//! - **Selection**: the worker with the fewest active calls, ties broken
//!   round-robin.
//! - **No copy on the hot path**: a body piece read on the worker is a
//!   `Bytes`; moving it through the mailbox moves the handle, and the
//!   session core writes that same `Bytes` as the BODY frame's body.
//! - **W10 across cores**: the output mailbox ends only after the worker
//!   dropped the call future (returned or aborted) — its sockets are closed
//!   or pooled by then — so the permit and the run-manager entry, both on
//!   the session core, go only after the call really returned.
//! - **A call no worker takes** (its inbox closed) is answered with one
//!   failure terminal ([`ProviderCall::not_started`]), never left hanging.
//! - **One core** (`--cores 0`): no worker exists and
//!   [`super::CallSite::Here`] runs the call on the session core
//!   as before, with no mailbox hop.
//!
//! Each worker core records the provider metrics (call duration, aborts)
//! in its own per-core registry; `engine::metrics` merges them on read, so
//! the SIGUSR1 dump shows them with the rest.

use std::cell::Cell;
use std::fmt;
use std::io;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;
use std::time::Instant;

use iop_engine::clock;
use iop_engine::mailbox::{self, Mailbox, MailboxSender, TrySendError};
use iop_engine::metrics::{self, Count, Latency};
use iop_engine::rt;

use super::channel::{CrossAbort, OutputTx, ProviderCall, ProviderSide, Stamped, OUTPUT_QUEUE};
use super::pool::{self, PoolConfig, PoolStats, ProviderPool};
use crate::adapters::Permit;
use crate::timers::Timers;

/// Jobs queued for one worker core at most (a full inbox makes the
/// dispatching task wait; jobs are taken in batches, so this is rarely
/// reached).
pub const INBOX_CAPACITY: usize = 1024;
/// Jobs a worker takes from its inbox in one lock.
const INBOX_BATCH: usize = 64;
/// The failure message of a call no worker core took.
const NOT_STARTED: &str = "no provider worker core took the call";

/// What one worker publishes for the control shard (and tests): counters
/// written on the worker, read anywhere.
#[derive(Debug)]
struct WorkerShared {
    index: usize,
    thread: OnceLock<ThreadId>,
    /// Calls dispatched to this worker and not yet ended (selection).
    active_calls: AtomicUsize,
    calls: AtomicU64,
    aborted: AtomicU64,
    pool_hits: AtomicU64,
    pool_misses: AtomicU64,
    pool_stale_retries: AtomicU64,
    pool_checkins: AtomicU64,
    idle_connections: AtomicUsize,
}

impl WorkerShared {
    fn new(index: usize) -> Self {
        Self {
            index,
            thread: OnceLock::new(),
            active_calls: AtomicUsize::new(0),
            calls: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            pool_hits: AtomicU64::new(0),
            pool_misses: AtomicU64::new(0),
            pool_stale_retries: AtomicU64::new(0),
            pool_checkins: AtomicU64::new(0),
            idle_connections: AtomicUsize::new(0),
        }
    }

    /// A call ended on the worker (returned or aborted): count it and
    /// publish the pool's counters as they are now.
    fn call_ended(&self, aborted: bool, pool: &ProviderPool) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if aborted {
            self.aborted.fetch_add(1, Ordering::Relaxed);
        }
        let stats = pool.stats();
        self.pool_hits.store(stats.hits, Ordering::Relaxed);
        self.pool_misses.store(stats.misses, Ordering::Relaxed);
        self.pool_stale_retries
            .store(stats.stale_retries, Ordering::Relaxed);
        self.pool_checkins.store(stats.checkins, Ordering::Relaxed);
        self.idle_connections
            .store(pool.idle_total(), Ordering::Relaxed);
        self.active_calls.fetch_sub(1, Ordering::AcqRel);
    }

    fn snapshot(&self) -> WorkerStats {
        WorkerStats {
            index: self.index,
            thread: self.thread.get().copied(),
            active_calls: self.active_calls.load(Ordering::Acquire),
            calls: self.calls.load(Ordering::Relaxed),
            aborted: self.aborted.load(Ordering::Relaxed),
            pool: PoolStats {
                hits: self.pool_hits.load(Ordering::Relaxed),
                misses: self.pool_misses.load(Ordering::Relaxed),
                stale_retries: self.pool_stale_retries.load(Ordering::Relaxed),
                checkins: self.pool_checkins.load(Ordering::Relaxed),
            },
            idle_connections: self.idle_connections.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of one worker core's counters ([`Workers::stats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerStats {
    /// The worker's position (0 = the first worker core).
    pub index: usize,
    /// The thread its loop runs on (`None` until the loop started).
    pub thread: Option<ThreadId>,
    /// Calls dispatched to it that have not ended yet.
    pub active_calls: usize,
    /// Calls that ended on it (returned or aborted).
    pub calls: u64,
    /// Of those, calls that were aborted (cancel, stall, session end).
    pub aborted: u64,
    /// Its provider pool's counters, as of its last call's end.
    pub pool: PoolStats,
    /// Idle pooled connections, as of its last call's end.
    pub idle_connections: usize,
}

/// Runs a type-erased job on a worker core.
trait StartJob: Send {
    fn start(self: Box<Self>, worker: &WorkerCore);
}

/// One provider call on its way to a worker core.
struct Job(Box<dyn StartJob>);

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Job")
    }
}

/// A typed call with its output mailbox and abort. Dropped without being
/// started (no worker took it), it answers with the call's not-started
/// failure, so the attempt still gets its one terminal.
struct CallJob<C: ProviderCall> {
    call: Option<C>,
    out: MailboxSender<Stamped<C::Output>>,
    abort: Arc<CrossAbort>,
    started_at: Instant,
    shared: Arc<WorkerShared>,
}

impl<C: ProviderCall> StartJob for CallJob<C> {
    fn start(mut self: Box<Self>, worker: &WorkerCore) {
        let Some(call) = self.call.take() else { return };
        // `done` is dropped last, after the call future: the session core
        // sees the output mailbox end only once the call is gone (W10).
        let done = self.out.clone();
        let out = OutputTx::remote(self.out.clone());
        let abort = self.abort.clone();
        let shared = self.shared.clone();
        let started_at = self.started_at;
        let pool = worker.pool.clone();
        // Boxed, so the task holds it once (see `local::spawn`).
        let work = Box::pin(call.run(pool.clone(), out));
        monoio::spawn(async move {
            // Dropping `work` closes the provider socket (no check-in).
            let aborted = monoio::select! {
                biased;
                _ = abort.aborted() => true,
                _ = work => false,
            };
            if aborted {
                metrics::add(Count::NodeProviderCallsAborted, 1);
            }
            // metrics: provider call duration (returned or aborted), in this
            // worker core's registry (merged on read).
            metrics::record_since(Latency::NodeProviderCallDuration, started_at);
            shared.call_ended(aborted, &pool);
            drop(done);
        });
    }
}

impl<C: ProviderCall> Drop for CallJob<C> {
    fn drop(&mut self) {
        if self.call.take().is_some() {
            // Never started: the mailbox is empty (only this job sends), so
            // the failure fits; the mailbox then ends with this job.
            let output = C::not_started(NOT_STARTED.to_string());
            let _ = self.out.try_send(Stamped {
                read_at: clock::now(),
                output,
            });
            self.shared.active_calls.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The control shard's handle on the worker cores: dispatches provider
/// calls to them ([`super::CallSite::Workers`]).
pub struct Workers {
    links: Vec<WorkerLink>,
    /// Where the next tie-break starts (round-robin).
    next: Cell<usize>,
}

struct WorkerLink {
    inbox: MailboxSender<Job>,
    shared: Arc<WorkerShared>,
}

impl fmt::Debug for Workers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Workers")
            .field("workers", &self.links.len())
            .finish_non_exhaustive()
    }
}

/// One worker core's end: its job inbox. Hand it to [`run`] on that core
/// (or to [`spawn_thread`]).
pub struct WorkerInbox {
    inbox: Mailbox<Job>,
    shared: Arc<WorkerShared>,
}

impl fmt::Debug for WorkerInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerInbox")
            .field("index", &self.shared.index)
            .finish_non_exhaustive()
    }
}

/// The control shard's [`Workers`] and one [`WorkerInbox`] per worker
/// core (`count` ≥ 1). A worker's loop ends once every `Workers` handle is
/// gone (the control shard ended).
pub fn channels(count: usize) -> (Workers, Vec<WorkerInbox>) {
    let (links, inboxes) = (0..count.max(1))
        .map(|index| {
            let (tx, rx) = mailbox::mailbox(INBOX_CAPACITY);
            let shared = Arc::new(WorkerShared::new(index));
            (
                WorkerLink {
                    inbox: tx,
                    shared: shared.clone(),
                },
                WorkerInbox { inbox: rx, shared },
            )
        })
        .unzip();
    (
        Workers {
            links,
            next: Cell::new(0),
        },
        inboxes,
    )
}

impl Workers {
    /// Number of worker cores.
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether there is no worker (never, from [`channels`]).
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    /// Every worker's counters, by index.
    pub fn stats(&self) -> Vec<WorkerStats> {
        self.links.iter().map(|l| l.shared.snapshot()).collect()
    }

    /// The worker with the fewest active calls; among equals, the first at
    /// or after the round-robin cursor.
    fn pick(&self) -> usize {
        let count = self.links.len();
        let start = self.next.get() % count.max(1);
        let mut best = start;
        let mut best_load = usize::MAX;
        for step in 0..count {
            let index = (start + step) % count;
            let load = self.links[index]
                .shared
                .active_calls
                .load(Ordering::Acquire);
            if load < best_load {
                best = index;
                best_load = load;
            }
        }
        self.next.set(best + 1);
        best
    }

    /// Hands `call` to a worker core (see the module docs); `permit` is
    /// held by the returned side until the worker reports the call's end.
    pub fn dispatch<C: ProviderCall>(
        &self,
        permit: Option<Permit>,
        call: C,
    ) -> ProviderSide<C::Output> {
        let (tx, rx) = mailbox::mailbox(OUTPUT_QUEUE);
        let abort = Arc::new(CrossAbort::default());
        let started_at = clock::now();
        let side = ProviderSide::remote(rx, abort.clone(), permit, started_at);
        let Some(link) = self.links.get(self.pick()) else {
            // No worker at all (not from `channels`): still one terminal.
            let _ = tx.try_send(Stamped {
                read_at: started_at,
                output: C::not_started(NOT_STARTED.to_string()),
            });
            return side;
        };
        link.shared.active_calls.fetch_add(1, Ordering::AcqRel);
        let job = Job(Box::new(CallJob {
            call: Some(call),
            out: tx,
            abort,
            started_at,
            shared: link.shared.clone(),
        }));
        match link.inbox.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job)) => {
                // Wait for room off this task; a closed inbox drops the job
                // (its failure terminal).
                let inbox = link.inbox.clone();
                monoio::spawn(async move {
                    let _ = inbox.send(job).await;
                });
            }
            Err(TrySendError::Closed(job)) => drop(job),
        }
        side
    }
}

/// A worker core's own state.
struct WorkerCore {
    pool: Rc<ProviderPool>,
}

/// A worker core's loop: its timer wheel, its provider pool (with the idle
/// sweeper) and the jobs of its inbox, each a task on this core. Returns
/// once the control shard is gone (every [`Workers`] handle dropped and the
/// inbox drained). Run it on the worker's runtime, timer enabled.
pub async fn run(inbox: WorkerInbox) {
    let WorkerInbox { mut inbox, shared } = inbox;
    let _ = shared.thread.set(std::thread::current().id());
    let timers = Timers::new(clock::now());
    monoio::spawn(timers.clone().run());
    let pool = ProviderPool::new(PoolConfig::default());
    pool::spawn_sweeper(&pool, &timers);
    let worker = WorkerCore { pool };
    let mut jobs = Vec::with_capacity(INBOX_BATCH);
    while inbox.recv_batch(&mut jobs, INBOX_BATCH).await > 0 {
        for Job(job) in jobs.drain(..) {
            job.start(&worker);
        }
    }
    tracing::debug!(worker = shared.index, "provider worker stops");
}

/// Starts a worker core: a thread (pinned to `core` when given) with its
/// own monoio runtime running [`run`]. Returns once the runtime runs; a
/// failure to pin or to build the runtime is the error.
pub fn spawn_thread(
    inbox: WorkerInbox,
    core: Option<usize>,
) -> io::Result<std::thread::JoinHandle<()>> {
    let index = inbox.shared.index;
    let name = match core {
        Some(core) => format!("iop-worker-{index}-cpu{core}"),
        None => format!("iop-worker-{index}"),
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        // A panicking worker would leave the calls on it holding their runs'
        // permits and run-manager entries forever (W10): crash instead.
        let _abort_on_panic = rt::AbortOnPanic("node-bin: a provider worker thread");
        if let Some(core) = core {
            if let Err(e) = rt::pin_current_thread(core) {
                let _ = ready_tx.send(Err(e));
                return;
            }
        }
        let started = ready_tx.clone();
        let result = rt::block_on(async move {
            // A worker records only its calls' durations.
            metrics::prepare(&[Latency::NodeProviderCallDuration]);
            let _ = started.send(Ok(()));
            run(inbox).await;
        });
        if let Err(e) = result {
            let _ = ready_tx.send(Err(e));
        }
    })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::other(
            "the worker thread ended before it started",
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;
    use crate::calls::scripted::Scripted;

    fn one_worker() -> (Rc<Workers>, std::thread::JoinHandle<()>) {
        let (workers, mut inboxes) = channels(1);
        let inbox = inboxes.pop().expect("one inbox");
        let thread = spawn_thread(inbox, None).expect("worker thread");
        (Rc::new(workers), thread)
    }

    async fn recv_all(side: &mut ProviderSide<Bytes>) -> Vec<Bytes> {
        let mut out = Vec::new();
        while let Some(s) = side.next_output().await {
            out.push(s);
        }
        out
    }

    // The body pieces cross cores as the same `Bytes` (same memory, no
    // copy), in order; the call ran on the worker thread; the mailbox ends
    // when it returned, and the worker's loop ends with the last handle.
    #[monoio::test(timer_enabled = true)]
    async fn outputs_cross_cores_without_a_copy() {
        let (workers, thread) = one_worker();
        let pieces: Vec<Bytes> = (0..40).map(|i| Bytes::from(format!("piece-{i}"))).collect();
        let addresses: Vec<usize> = pieces.iter().map(|b| b.as_ptr() as usize).collect();
        let call = Scripted::new(pieces.clone(), false);
        let ran_on = call.ran_on.clone();
        let mut side = workers.dispatch(None, call);
        let got = recv_all(&mut side).await;
        assert_eq!(got, pieces);
        let got_addresses: Vec<usize> = got.iter().map(|b| b.as_ptr() as usize).collect();
        assert_eq!(got_addresses, addresses, "the same memory, not a copy");
        let worker_thread = ran_on.get().copied().expect("the call ran");
        assert_ne!(worker_thread, std::thread::current().id());
        let stats = workers.stats();
        assert_eq!(stats[0].thread, Some(worker_thread));
        assert_eq!((stats[0].calls, stats[0].aborted), (1, 0));
        assert_eq!(stats[0].active_calls, 0);
        drop(side);
        drop(workers);
        thread
            .join()
            .expect("the worker loop ends with the last handle");
    }

    // CONTRACT: W10 — an abort crosses cores: the worker drops the call,
    // and only then does the output mailbox end and the permit held on
    // this core go.
    #[monoio::test(timer_enabled = true)]
    async fn abort_crosses_cores_and_the_permit_waits_for_the_return() {
        let (workers, _thread) = one_worker();
        let gate = crate::adapters::CapacityGate::new(1);
        let permit = gate.try_acquire();
        let call = Scripted::new(vec![Bytes::from_static(b"first")], true);
        let mut side = workers.dispatch(permit, call);
        assert_eq!(side.next_output().await, Some(Bytes::from_static(b"first")));
        assert_eq!(gate.in_flight(), 1, "held while the call runs");
        assert_eq!(workers.stats()[0].active_calls, 1);
        side.abort();
        assert_eq!(side.next_output().await, None, "the call was dropped");
        assert_eq!(gate.in_flight(), 0, "released at the call's end");
        let stats = workers.stats();
        assert_eq!((stats[0].calls, stats[0].aborted), (1, 1));
        assert_eq!(stats[0].active_calls, 0);
    }

    // A call no worker takes still gets its one failure output.
    #[monoio::test(timer_enabled = true)]
    async fn a_call_no_worker_takes_fails_once() {
        let (workers, inboxes) = channels(1);
        drop(inboxes);
        let gate = crate::adapters::CapacityGate::new(1);
        let call = Scripted::new(vec![Bytes::from_static(b"never")], false);
        let mut side = workers.dispatch(gate.try_acquire(), call);
        assert_eq!(
            recv_all(&mut side).await,
            vec![Bytes::from_static(b"no provider worker core took the call")]
        );
        assert_eq!(gate.in_flight(), 0);
        assert_eq!(workers.stats()[0].active_calls, 0);
    }

    #[test]
    fn the_least_loaded_worker_is_picked_round_robin_among_equals() {
        let (workers, _inboxes) = channels(3);
        assert_eq!(
            (0..4).map(|_| workers.pick()).collect::<Vec<_>>(),
            vec![0, 1, 2, 0]
        );
        workers.links[1]
            .shared
            .active_calls
            .store(0, Ordering::Relaxed);
        workers.links[0]
            .shared
            .active_calls
            .store(2, Ordering::Relaxed);
        workers.links[2]
            .shared
            .active_calls
            .store(1, Ordering::Relaxed);
        assert_eq!(workers.pick(), 1);
        assert_eq!(workers.pick(), 1, "still the least loaded");
    }

    #[monoio::test(timer_enabled = true)]
    async fn cross_abort_wakes_a_waiter_on_another_thread() {
        let abort = Arc::new(CrossAbort::default());
        let remote = abort.clone();
        let waiter = std::thread::spawn(move || {
            rt::block_on(async move { remote.aborted().await }).expect("runtime");
        });
        monoio::time::sleep(Duration::from_millis(5)).await;
        assert!(!abort.is_aborted());
        abort.abort();
        abort.abort();
        waiter.join().expect("the waiter woke");
        assert!(abort.is_aborted());
    }
}
