//! Runtime bootstrap: `--cores` lists, monoio runtimes with driver detection,
//! and signals as async streams.
//!
//! - [`CoreList::parse`] is the pure taskset-grammar parser (`0-3`,
//!   `0,2,5-7`, `0-31:2`).
//! - [`block_on`] builds one monoio runtime on the current thread (io_uring,
//!   or the legacy epoll driver when io_uring is unavailable or
//!   `MONOIO_FORCE_LEGACY_DRIVER=1`) and logs which driver runs.
//! - [`SignalPipe`] turns SIGTERM/SIGINT/SIGHUP/SIGUSR1 into an async stream for
//!   the shard that owns lifecycle, through signal-hook's self-pipe (no
//!   unsafe, async-signal-safe).
//! - [`notify`] tells systemd `READY=1`, `RELOADING=1` and `STOPPING=1`
//!   when `NOTIFY_SOCKET` is set.

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::io;
use std::os::unix::net::UnixStream as StdUnixStream;

use monoio::io::AsyncReadRent;

pub mod notify;

/// The environment variable that makes monoio use epoll instead of
/// io_uring (`1`, `true` or `yes`).
pub const FORCE_LEGACY_ENV: &str = "MONOIO_FORCE_LEGACY_DRIVER";

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event (the default).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields`
    /// (with `message`), and `span`/`spans` when inside spans.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!(
                "unknown log format `{other}`: expected text or json"
            )),
        }
    }
}

/// Logs to stderr in `format` without colours, at the level `RUST_LOG` sets
/// (default `info`). Every IOP binary calls this (or [`init_logging`]) once
/// at start.
pub fn init_logging_as(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
}

/// [`init_logging_as`] in [`LogFormat::Text`].
pub fn init_logging() {
    init_logging_as(LogFormat::Text);
}

/// Gives every other ready task of this thread a turn, then resumes.
///
/// Under io_uring every socket operation parks the task until its
/// completion arrives, so a writer loop takes turns by itself; under the
/// legacy epoll driver a write to a socket with room completes in place, and
/// a loop writing without pause starves the thread's other tasks (accepts,
/// admin requests) until its socket fills. Loops that produce without bound
/// call this once per item.
///
/// Waking itself is no yield on monoio: a task woken while it runs goes to
/// the *front* of the run queue and runs again at once. So the wake comes
/// from a task spawned at the back of the queue, which runs only after
/// every task already queued.
pub async fn yield_now() {
    let mut queued = false;
    std::future::poll_fn(|cx| {
        if queued {
            return std::task::Poll::Ready(());
        }
        queued = true;
        let waker = cx.waker().clone();
        monoio::spawn(async move { waker.wake() });
        std::task::Poll::Pending
    })
    .await
}

/// Which monoio driver a runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    /// Linux io_uring.
    IoUring,
    /// epoll (the legacy driver), used when io_uring is unavailable or forced.
    Legacy,
}

impl fmt::Display for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Driver::IoUring => "io_uring",
            Driver::Legacy => "legacy (epoll)",
        })
    }
}

/// The driver [`block_on`] will pick on this machine: io_uring unless it is
/// unavailable or `MONOIO_FORCE_LEGACY_DRIVER=1` forces epoll.
pub fn detect_driver() -> Driver {
    if monoio::utils::detect_uring() {
        Driver::IoUring
    } else {
        Driver::Legacy
    }
}

/// io_uring submission queue entries per runtime.
const RING_ENTRIES: u32 = 1024;

/// Runs `fut` to completion on a new monoio runtime (with timers) on the
/// current thread.
///
/// Under io_uring the ring is set up with `IORING_SETUP_COOP_TASKRUN` and
/// `IORING_SETUP_SINGLE_ISSUER` (Linux 5.19 and 6.0): a completion that
/// arrives while the thread runs its tasks no longer interrupts it with
/// an inter-processor interrupt to run the kernel's part of that
/// completion; that work waits for the thread's next system call, which
/// the runtime makes every turn of its loop (it submits, or waits, each
/// turn). Only this thread ever submits to its ring (cross-thread wakes
/// write an eventfd). On a kernel that refuses either flag the ring is
/// set up without them, as before.
pub fn block_on<F: Future>(fut: F) -> io::Result<F::Output> {
    let mut ring = io_uring::IoUring::builder();
    ring.setup_coop_taskrun().setup_single_issuer();
    let tuned = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .with_entries(RING_ENTRIES)
        .uring_builder(ring)
        .enable_timer()
        .build();
    let mut runtime = match tuned {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::debug!(error = %e, "io_uring refused COOP_TASKRUN/SINGLE_ISSUER; plain ring");
            monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                .with_entries(RING_ENTRIES)
                .enable_timer()
                .build()?
        }
    };
    Ok(runtime.block_on(fut))
}

/// Where a shard runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Position in the core list (0 = the control shard).
    pub index: usize,
    /// The CPU it is pinned to.
    pub core: usize,
    /// How many shards run in all.
    pub count: usize,
}

impl Shard {
    /// Whether this is the control shard (the first listed core).
    pub fn is_control(&self) -> bool {
        self.index == 0
    }
}

/// Ends the process if the thread holding it unwinds from a panic. Shards
/// depend on each other (a dead shard's inbox fills, its connections and
/// leases are never settled), so a crash the supervisor restarts is the
/// honest outcome. `what` names the thread in the message.
#[derive(Debug)]
pub struct AbortOnPanic(pub &'static str);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{} panicked; aborting the process", self.0);
            std::process::abort();
        }
    }
}

/// Runs one monoio runtime per listed core, each on its own thread pinned to
/// that core, and returns every shard's output in core-list order. The
/// control shard (index 0) runs on a new thread too, so the caller's thread
/// only waits. A shard that fails to pin or build its runtime reports the
/// error as its output; a shard that panics aborts the process
/// ([`AbortOnPanic`]).
pub fn run_shards<T, F, Fut>(cores: &CoreList, shard_main: F) -> Vec<io::Result<T>>
where
    T: Send + 'static,
    F: Fn(Shard) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T>,
{
    let shard_main = std::sync::Arc::new(shard_main);
    let count = cores.cores().len();
    let handles: Vec<_> = cores
        .cores()
        .iter()
        .enumerate()
        .map(|(index, &core)| {
            let shard_main = shard_main.clone();
            let shard = Shard { index, core, count };
            std::thread::Builder::new()
                .name(format!("iop-shard-{index}-cpu{core}"))
                .spawn(move || -> io::Result<T> {
                    let _abort_on_panic = AbortOnPanic("a shard thread");
                    pin_current_thread(core)?;
                    block_on(shard_main(shard))
                })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| match h {
            Ok(handle) => handle
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("shard thread panicked"))),
            Err(e) => Err(e),
        })
        .collect()
}

/// A `--cores` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreListError {
    /// The list is empty.
    #[error("core list is empty")]
    Empty,
    /// A token is not a number, range or stride range.
    #[error("`{0}` is not a core number, range (`0-3`) or stride range (`0-31:2`)")]
    Syntax(String),
    /// A range runs backwards.
    #[error("range `{0}` runs backwards")]
    Backwards(String),
    /// A stride of zero.
    #[error("stride in `{0}` must be at least 1")]
    ZeroStride(String),
    /// A CPU is listed twice.
    #[error("core {0} is listed more than once")]
    Duplicate(usize),
    /// A CPU is outside the set this process may run on.
    #[error("core {core} is not in this process's allowed CPU set ({allowed})")]
    NotAllowed {
        /// The offending core.
        core: usize,
        /// The allowed set, rendered.
        allowed: String,
    },
    /// The allowed set could not be read.
    #[error("cannot read this process's CPU affinity: {0}")]
    Affinity(String),
}

/// Largest CPU number accepted (the kernel's usual `CPU_SETSIZE`).
pub const MAX_CPU: usize = 1023;

/// An ordered list of distinct CPU numbers; the first is the control shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreList(Vec<usize>);

impl CoreList {
    /// Parses the taskset list grammar: comma-separated items, each `N`,
    /// `A-B` or `A-B:S` (every S-th core from A to B). Duplicates are an
    /// error. Order is kept: the first core is the control shard.
    pub fn parse(text: &str) -> Result<Self, CoreListError> {
        let mut cores = Vec::new();
        let mut seen = BTreeSet::new();
        let text = text.trim();
        if text.is_empty() {
            return Err(CoreListError::Empty);
        }
        for item in text.split(',') {
            let item = item.trim();
            let (range, stride) = match item.split_once(':') {
                Some((range, stride)) => (range, Some(stride)),
                None => (item, None),
            };
            let (first, last) = match range.split_once('-') {
                Some((a, b)) => (parse_cpu(a, item)?, parse_cpu(b, item)?),
                None if stride.is_none() => {
                    let cpu = parse_cpu(range, item)?;
                    (cpu, cpu)
                }
                None => return Err(CoreListError::Syntax(item.to_string())),
            };
            if last < first {
                return Err(CoreListError::Backwards(item.to_string()));
            }
            let stride = match stride {
                None => 1,
                Some(s) => match s.trim().parse::<usize>() {
                    Ok(0) => return Err(CoreListError::ZeroStride(item.to_string())),
                    Ok(s) => s,
                    Err(_) => return Err(CoreListError::Syntax(item.to_string())),
                },
            };
            for cpu in (first..=last).step_by(stride) {
                if !seen.insert(cpu) {
                    return Err(CoreListError::Duplicate(cpu));
                }
                cores.push(cpu);
            }
        }
        Ok(Self(cores))
    }

    /// Checks every core against `allowed` (the process's affinity set).
    pub fn check_allowed(&self, allowed: &BTreeSet<usize>) -> Result<(), CoreListError> {
        for &core in &self.0 {
            if !allowed.contains(&core) {
                return Err(CoreListError::NotAllowed {
                    core,
                    allowed: render_set(allowed),
                });
            }
        }
        Ok(())
    }

    /// Parses and checks against this process's `sched_getaffinity` set.
    pub fn parse_for_this_process(text: &str) -> Result<Self, CoreListError> {
        let list = Self::parse(text)?;
        list.check_allowed(&allowed_cpus()?)?;
        Ok(list)
    }

    /// The cores, control shard first.
    pub fn cores(&self) -> &[usize] {
        &self.0
    }

    /// The control shard's core.
    pub fn control(&self) -> usize {
        self.0[0]
    }
}

impl fmt::Display for CoreList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rendered: Vec<String> = self.0.iter().map(|c| c.to_string()).collect();
        f.write_str(&rendered.join(","))
    }
}

fn parse_cpu(text: &str, item: &str) -> Result<usize, CoreListError> {
    match text.trim().parse::<usize>() {
        Ok(cpu) if cpu <= MAX_CPU => Ok(cpu),
        _ => Err(CoreListError::Syntax(item.to_string())),
    }
}

fn render_set(set: &BTreeSet<usize>) -> String {
    let rendered: Vec<String> = set.iter().map(|c| c.to_string()).collect();
    rendered.join(",")
}

/// The CPUs this process may run on (`sched_getaffinity`).
pub fn allowed_cpus() -> Result<BTreeSet<usize>, CoreListError> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .map_err(|e| CoreListError::Affinity(e.to_string()))?;
    Ok((0..nix::sched::CpuSet::count())
        .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
        .collect())
}

/// Pins the calling thread to `core`.
pub fn pin_current_thread(core: usize) -> io::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(core).map_err(io::Error::other)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(io::Error::other)
}

/// A future that completes once.
pub type StopFuture = std::pin::Pin<Box<dyn Future<Output = ()>>>;

/// The first SIGTERM/SIGINT (drain: also tells systemd `STOPPING=1`) and the
/// second (stop at once), as two futures. Call on the runtime thread that
/// awaits them. If the signal pipe fails, neither ever completes (and the
/// failure is logged).
pub fn stop_signals() -> io::Result<(StopFuture, StopFuture)> {
    let mut term = SignalPipe::install(Signal::Term)?;
    let mut int = SignalPipe::install(Signal::Int)?;
    let (first_tx, first_rx) = crate::sync::oneshot::channel::<()>();
    let (second_tx, second_rx) = crate::sync::oneshot::channel::<()>();
    monoio::spawn(async move {
        for (nth, tx) in [first_tx, second_tx].into_iter().enumerate() {
            let signal = monoio::select! {
                s = term.recv() => s,
                s = int.recv() => s,
            };
            match signal {
                Ok(signal) if nth == 0 => {
                    tracing::info!(
                        ?signal,
                        "shutting down: draining (signal again to stop at once)"
                    );
                    notify::notify(notify::State::Stopping);
                }
                Ok(signal) => tracing::warn!(?signal, "second signal: stopping at once"),
                Err(e) => {
                    tracing::error!(error = %e, "signal pipe failed; signals are ignored");
                    std::future::pending::<()>().await;
                }
            }
            let _ = tx.send(());
        }
    });
    // A sender dropped without sending never stops the process.
    let wait = |rx: crate::sync::oneshot::Receiver<()>| -> StopFuture {
        Box::pin(async move {
            if rx.await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    };
    Ok((wait(first_rx), wait(second_rx)))
}

/// A process signal IOP reacts to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGTERM: drain and exit 0.
    Term,
    /// SIGINT: as SIGTERM.
    Int,
    /// SIGHUP: reload configuration.
    Hup,
    /// SIGUSR1: dump latency histograms.
    Usr1,
}

impl Signal {
    fn number(self) -> i32 {
        match self {
            Signal::Term => signal_hook::consts::SIGTERM,
            Signal::Int => signal_hook::consts::SIGINT,
            Signal::Hup => signal_hook::consts::SIGHUP,
            Signal::Usr1 => signal_hook::consts::SIGUSR1,
        }
    }

    /// True for the signals that ask the process to stop.
    pub fn is_shutdown(self) -> bool {
        matches!(self, Signal::Term | Signal::Int)
    }
}

/// One signal's self-pipe read end, readable on a monoio runtime.
#[derive(Debug)]
pub struct SignalPipe {
    signal: Signal,
    read: monoio::net::UnixStream,
}

impl SignalPipe {
    /// Installs a handler for `signal` that writes to a self-pipe, replacing
    /// the default action (so SIGTERM no longer kills the process). Call on
    /// the runtime thread that will await it.
    pub fn install(signal: Signal) -> io::Result<Self> {
        let (read, write) = StdUnixStream::pair()?;
        read.set_nonblocking(true)?;
        write.set_nonblocking(true)?;
        signal_hook::low_level::pipe::register(signal.number(), write)?;
        let read = monoio::net::UnixStream::from_std(read)?;
        Ok(Self { signal, read })
    }

    /// The signal this pipe reports.
    pub fn signal(&self) -> Signal {
        self.signal
    }

    /// Waits for the next delivery of the signal (deliveries that arrive
    /// while nobody waits are coalesced).
    pub async fn recv(&mut self) -> io::Result<Signal> {
        let buf = vec![0u8; 64];
        let (res, _buf) = self.read.read(buf).await;
        match res? {
            0 => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "signal pipe closed",
            )),
            _ => Ok(self.signal),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yield_now_lets_every_queued_task_run_before_resuming() {
        use std::cell::RefCell;
        use std::rc::Rc;
        let order = block_on(async {
            let order = Rc::new(RefCell::new(String::new()));
            let tasks: Vec<_> = ['a', 'b', 'c']
                .into_iter()
                .map(|name| {
                    let order = Rc::clone(&order);
                    monoio::spawn(async move {
                        for _ in 0..3 {
                            order.borrow_mut().push(name);
                            yield_now().await;
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await;
            }
            let order = order.borrow().clone();
            order
        })
        .expect("runtime");
        // Round robin: a task that yields goes behind the others, not
        // back to the front of the run queue.
        assert_eq!(order, "abcabcabc");
    }

    #[test]
    fn parses_single_range_list_and_stride() {
        assert_eq!(CoreList::parse("0").unwrap().cores(), &[0]);
        assert_eq!(CoreList::parse("0-3").unwrap().cores(), &[0, 1, 2, 3]);
        assert_eq!(
            CoreList::parse("0,2,5-7").unwrap().cores(),
            &[0, 2, 5, 6, 7]
        );
        assert_eq!(
            CoreList::parse("0-31:2").unwrap().cores(),
            (0..32).step_by(2).collect::<Vec<_>>().as_slice()
        );
        assert_eq!(CoreList::parse(" 3 , 1 ").unwrap().cores(), &[3, 1]);
        assert_eq!(CoreList::parse("3,1").unwrap().control(), 3);
        assert_eq!(CoreList::parse("1-7:3").unwrap().cores(), &[1, 4, 7]);
    }

    #[test]
    fn rejects_bad_lists_with_reasons() {
        assert_eq!(CoreList::parse(""), Err(CoreListError::Empty));
        assert_eq!(CoreList::parse("0,0"), Err(CoreListError::Duplicate(0)));
        assert_eq!(CoreList::parse("0-3,2"), Err(CoreListError::Duplicate(2)));
        assert_eq!(
            CoreList::parse("3-1"),
            Err(CoreListError::Backwards("3-1".into()))
        );
        assert_eq!(
            CoreList::parse("0-3:0"),
            Err(CoreListError::ZeroStride("0-3:0".into()))
        );
        assert_eq!(CoreList::parse("a"), Err(CoreListError::Syntax("a".into())));
        assert_eq!(CoreList::parse("1,"), Err(CoreListError::Syntax("".into())));
        assert_eq!(
            CoreList::parse("3:2"),
            Err(CoreListError::Syntax("3:2".into()))
        );
        assert_eq!(
            CoreList::parse("-1"),
            Err(CoreListError::Syntax("-1".into()))
        );
        assert_eq!(
            CoreList::parse("5000"),
            Err(CoreListError::Syntax("5000".into()))
        );
    }

    #[test]
    fn rejects_cores_outside_the_allowed_set() {
        let allowed: BTreeSet<usize> = [0, 1].into_iter().collect();
        assert_eq!(
            CoreList::parse("0-1").unwrap().check_allowed(&allowed),
            Ok(())
        );
        assert_eq!(
            CoreList::parse("0-2").unwrap().check_allowed(&allowed),
            Err(CoreListError::NotAllowed {
                core: 2,
                allowed: "0,1".into()
            })
        );
        let err = CoreList::parse("0-2")
            .unwrap()
            .check_allowed(&allowed)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "core 2 is not in this process's allowed CPU set (0,1)"
        );
    }

    #[test]
    fn shards_run_pinned_one_per_core() {
        let allowed = allowed_cpus().unwrap();
        let list: Vec<String> = allowed.iter().take(2).map(|c| c.to_string()).collect();
        let cores = CoreList::parse(&list.join(",")).unwrap();
        let outputs = run_shards(&cores, |shard| async move {
            let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
            let pinned: Vec<usize> = (0..nix::sched::CpuSet::count())
                .filter(|&c| set.is_set(c).unwrap_or(false))
                .collect();
            (shard, pinned)
        });
        for (i, out) in outputs.into_iter().enumerate() {
            let (shard, pinned) = out.unwrap();
            assert_eq!(shard.index, i);
            assert_eq!(shard.core, cores.cores()[i]);
            assert_eq!(shard.count, cores.cores().len());
            assert_eq!(shard.is_control(), i == 0);
            assert_eq!(pinned, vec![shard.core]);
        }
    }

    #[test]
    fn this_process_has_an_allowed_set() {
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        let first = *allowed.iter().next().unwrap();
        assert!(CoreList::parse_for_this_process(&first.to_string()).is_ok());
    }
}
