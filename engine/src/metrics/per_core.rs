//! The per-core registries, the merged read, and the `SIGUSR1` dumper.

use std::io::{self, Write};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{render_wrk2, Count, Latency, Registry, Side};
use crate::clock;
use crate::rt::{Signal, SignalPipe};

/// Every live thread's registry, plus what exited threads left behind.
struct Cores {
    live: Vec<Arc<Mutex<Registry>>>,
    retired: Option<Registry>,
}

static CORES: Mutex<Cores> = Mutex::new(Cores {
    live: Vec::new(),
    retired: None,
});

/// A lock that survives a panic elsewhere: the data is plain counts, valid
/// at every step.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The calling thread's registry; registered on first use, folded into the
/// retired registry when the thread exits.
struct CoreSlot {
    registry: Arc<Mutex<Registry>>,
}

impl CoreSlot {
    fn register() -> Self {
        let registry = Arc::new(Mutex::new(Registry::new()));
        lock(&CORES).live.push(registry.clone());
        Self { registry }
    }
}

impl Drop for CoreSlot {
    fn drop(&mut self) {
        // Lock order everywhere: CORES, then a core's registry.
        let mut cores = lock(&CORES);
        cores.live.retain(|r| !Arc::ptr_eq(r, &self.registry));
        let mine = lock(&self.registry);
        match &mut cores.retired {
            Some(retired) => {
                if let Err(e) = retired.merge(&mine) {
                    tracing::warn!(error = %e, "metrics of an exited thread dropped");
                }
            }
            None => cores.retired = Some(mine.clone()),
        }
    }
}

thread_local! {
    static CORE: CoreSlot = CoreSlot::register();
}

/// Runs `f` on this thread's registry; nothing happens while the thread is
/// being torn down.
fn with_core(f: impl FnOnce(&mut Registry)) {
    let _ = CORE.try_with(|slot| f(&mut lock(&slot.registry)));
}

/// Records `elapsed` in this core's `key` histogram.
pub fn record(key: Latency, elapsed: Duration) {
    with_core(|r| r.record(key, elapsed));
}

/// Records the time from `since` to now ([`clock::now`]) in this core's
/// `key` histogram (0 if `since` is later).
pub fn record_since(key: Latency, since: Instant) {
    record_between(key, since, clock::now());
}

/// Records the time from `from` to `to` in this core's `key` histogram (0
/// if `to` is earlier).
pub fn record_between(key: Latency, from: Instant, to: Instant) {
    record(key, to.saturating_duration_since(from));
}

/// Registers this thread's registry and allocates its histograms for
/// `keys` now. Call once when a thread that records starts, so the first
/// request does not pay for them (~190 KiB a key) and a process's footprint
/// under load is the one it started with plus what its streams hold.
pub fn prepare(keys: &[Latency]) {
    with_core(|r| r.prepare(keys));
}

/// Adds `n` to this core's `key` counter.
pub fn add(key: Count, n: u64) {
    with_core(|r| r.add(key, n));
}

/// Every core's samples and counts added up (live threads and exited ones).
pub fn merged() -> Registry {
    let mut total = Registry::new();
    let cores = lock(&CORES);
    for core in &cores.live {
        if let Err(e) = total.merge(&lock(core)) {
            tracing::warn!(error = %e, "a core's metrics left out of the merge");
        }
    }
    if let Some(retired) = &cores.retired {
        if let Err(e) = total.merge(retired) {
            tracing::warn!(error = %e, "exited threads' metrics left out of the merge");
        }
    }
    total
}

/// Installs the `SIGUSR1` handler and spawns, on the current monoio runtime,
/// a task that writes [`render_wrk2`] of [`merged`] for `side` to stderr on
/// every `SIGUSR1`. Call once per process, on the runtime thread, before the
/// process announces it is ready (until then `SIGUSR1` kills it).
pub fn spawn_usr1_dumper(side: Side) -> io::Result<()> {
    let pipe = SignalPipe::install(Signal::Usr1)?;
    monoio::spawn(dump_on_sigusr1(pipe, side, merged, io::stderr()));
    Ok(())
}

/// Writes [`render_wrk2`] of `snapshot()` for `side` to `out`, in one
/// `write_all`, each time `pipe`'s signal arrives; returns when the pipe
/// fails. A failed write is logged and the loop goes on.
pub async fn dump_on_sigusr1<W: Write>(
    mut pipe: SignalPipe,
    side: Side,
    snapshot: impl Fn() -> Registry,
    mut out: W,
) {
    loop {
        if let Err(e) = pipe.recv().await {
            tracing::warn!(error = %e, "signal pipe failed; histogram dumps stop");
            return;
        }
        let text = render_wrk2(&snapshot(), side);
        if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
            tracing::warn!(error = %e, "histogram dump not written");
        }
    }
}
