//! The usage file (`[edge.usage_log] path`): one JSON line per inference
//! request, for billing or a database to ingest.
//!
//! Unlike the access log, which drops lines rather than stall a shard, the
//! usage file loses nothing while the file takes writes: a shard appends its
//! line to one process-wide buffer (a lock held for a `memcpy`), and a
//! writer thread takes the whole buffer every [`FLUSH_INTERVAL`] (sooner
//! past [`FLUSH_BYTES`]), appends it and `fdatasync`s the file. SIGHUP
//! reopens the file by the path the reloaded `edge.toml` names (rotation:
//! rename it, then signal; or a new path), and shutdown writes what is left
//! after the drain.
//!
//! # Reopening
//!
//! The reload opens the new file itself, on the reloading thread (an
//! `open(2)`, as the startup check does), and hands it to the writer, so
//! it knows at once whether the path works. One that cannot
//! be opened (a directory, a missing directory, no permission) changes
//! nothing for the writer — records go on to the file already open — and
//! does not refuse the rest of the reload ([`UsageLog::apply_reload`]): it
//! is reported, counted in `iop_edge_usage_log_open_errors_total`, and
//! `iop_edge_usage_log_failing` and the usage file's `/status` entry show
//! it ([`UsageStatus`]) until a reload opens the configured file.
//!
//! # When writes fail
//!
//! ```text
//! shard ─record─► [buffer] ─take─► [backlog] ─write─► file
//!                    │                 │ a failed or short write keeps
//!                    │                 │ only the bytes the file did not
//!                    │                 │ take: a record is never written
//!                    │                 │ twice
//!                    └─ buffer + backlog at MAX_BUFFERED_BYTES: the new
//!                       record is dropped and counted
//! ```
//!
//! A write that fails (or takes part of the bytes) leaves the rest for the
//! next turn, [`FLUSH_INTERVAL`] later: the records already in the file
//! are not written again. While the file takes nothing, records wait in
//! memory, the buffer and the backlog together at most
//! [`MAX_BUFFERED_BYTES`]; past that the **newest** records are dropped,
//! each counted in `iop_edge_usage_log_dropped_records_total` (logged at
//! most once a minute). Why the newest: the oldest waiting records are next
//! in the file's order (the first of them may be half written already), so
//! dropping them would leave a hole inside what the file holds; dropping
//! the newest leaves the file complete and in order up to the outage, with
//! the gap at one known point (the access log still has those requests).
//! Every failed write or sync counts in
//! `iop_edge_usage_log_write_errors_total` (logged at its first failure,
//! then at most once a minute, and when writes resume), and
//! `iop_edge_usage_log_failing` is 1 until a write succeeds again. A
//! record a failed write cut in two is finished in the file it began in;
//! when the file is rotated before that succeeds, its rest is dropped (and
//! counted). At shutdown, records the file still refuses are dropped and
//! counted.
//!
//! A record says what the provider reported and how complete it is
//! (`usage`): `reported` (the request completed and usage was observed),
//! `none` (it completed and the provider reported none, or it never
//! reached a provider; nothing is guessed), `partial` (it ended early: the
//! tokens are what was observed up to then, or null).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use iop_engine::clock;
use iop_engine::config::ConfigError;

use crate::config::{cannot_append, open_appending, OperationalPath};

/// How often buffered records are written.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// Buffered bytes that wake the writer before the interval.
pub const FLUSH_BYTES: usize = 256 * 1024;
/// Most bytes of records held in memory while the file does not take them
/// (the shards' buffer and the writer's backlog together); newer records
/// are dropped past it.
pub const MAX_BUFFERED_BYTES: usize = 64 * 1024 * 1024;
/// Least time between two log lines about failing writes or dropped
/// records.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// What a reload did to one of the Edge's own files (the usage file, the
/// access log): both empty when the new file's settings were applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogReload {
    /// The new path could not be opened: the running writer goes on
    /// writing where it did, and this says why (`<file>: <key>: <reason>;
    /// keeping the running …`).
    pub kept: Option<String>,
    /// A change this writer cannot take while running (not applied).
    pub restart_required: Option<&'static str>,
}

/// The usage file as `/status` and the status page show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageStatus {
    /// The file records go to, as it was named when it was opened.
    pub path: PathBuf,
    /// Why the file the last reload named could not be opened (records
    /// still go to `path`); cleared by a reload that opens it.
    pub open_error: Option<String>,
    /// Why the last write or sync failed, while writes fail.
    pub write_error: Option<String>,
    /// Failed writes and syncs so far.
    pub write_errors: u64,
    /// Reloads whose file could not be opened so far.
    pub open_errors: u64,
    /// Records dropped so far.
    pub dropped_records: u64,
}

impl UsageStatus {
    /// Records do not reach the file the configuration names: its last
    /// write failed, or the last reload could not open it.
    pub fn is_failing(&self) -> bool {
        self.open_error.is_some() || self.write_error.is_some()
    }
}

/// How complete a record's usage is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completeness {
    /// Completed, usage observed.
    Reported,
    /// Completed with no usage reported by the provider, or never reached
    /// a provider.
    None,
    /// Ended early; tokens are what was observed until then.
    Partial,
}

impl Completeness {
    /// Of a request that reached a provider (`dispatched`) or not, ended
    /// `completed` or not, and had tokens `observed` or not. One that never
    /// reached a provider (refused, rate limited, no provider) used none.
    pub fn of(dispatched: bool, completed: bool, observed: bool) -> Self {
        match (dispatched, completed, observed) {
            (false, _, _) => Completeness::None,
            (true, true, true) => Completeness::Reported,
            (true, true, false) => Completeness::None,
            (true, false, _) => Completeness::Partial,
        }
    }

    /// The record's `usage` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Completeness::Reported => "reported",
            Completeness::None => "none",
            Completeness::Partial => "partial",
        }
    }
}

/// Where the writer appends records: the usage file, or a test's stand-in.
pub trait Sink: Send + 'static {
    /// Appends from `buf`; how many bytes were taken (as
    /// [`io::Write::write`]: possibly fewer than `buf` holds).
    fn write(&mut self, buf: &[u8]) -> io::Result<usize>;
    /// Makes what was written durable (`fdatasync`).
    fn sync(&mut self) -> io::Result<()>;
}

impl Sink for std::fs::File {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        io::Write::write(self, buf)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.sync_data()
    }
}

impl Sink for Box<dyn Sink> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (**self).write(buf)
    }

    fn sync(&mut self) -> io::Result<()> {
        (**self).sync()
    }
}

/// Opens the sink for a path (at start and on every reopen).
pub type Opener<S> = Box<dyn FnMut(&Path) -> io::Result<S> + Send>;

/// An [`Opener`] of any sink.
type AnyOpener = Opener<Box<dyn Sink>>;

/// A file a reload opened, for the writer to take at its next turn.
struct NextFile {
    path: PathBuf,
    sink: Box<dyn Sink>,
}

impl fmt::Debug for NextFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NextFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Pending {
    lines: Vec<u8>,
    /// Bytes of the writer's backlog, as of its last turn.
    backlog_bytes: usize,
    /// Records dropped and not logged yet.
    dropped_unlogged: u64,
    /// The file to write from the next turn on (a reload opened it).
    reopen: Option<NextFile>,
    closing: bool,
}

/// Which file records go to, and what went wrong lately.
#[derive(Debug)]
struct FileState {
    /// The file records go to (from the writer's next turn on).
    path: PathBuf,
    /// Why the last reload's file could not be opened.
    open_error: Option<String>,
    /// Why the last write failed, while writes fail.
    write_error: Option<String>,
}

struct Shared {
    max_buffered_bytes: usize,
    pending: Mutex<Pending>,
    wake: Condvar,
    /// Opens the file for a reload (on the reloading thread, so the reload
    /// knows at once whether the new file opens).
    open: Mutex<AnyOpener>,
    state: Mutex<FileState>,
    write_errors: AtomicU64,
    open_errors: AtomicU64,
    dropped_records: AtomicU64,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("state", &self.state)
            .field("write_errors", &self.write_errors)
            .field("open_errors", &self.open_errors)
            .field("dropped_records", &self.dropped_records)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn dropped(&self, records: u64) {
        self.dropped_records.fetch_add(records, Ordering::Relaxed);
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FileState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `e` as the current write failure, then counts it (a
    /// reader that sees the count sees the reason).
    fn write_failed(&self, e: &io::Error) {
        self.state().write_error = Some(e.to_string());
        self.write_errors.fetch_add(1, Ordering::Relaxed);
    }

    fn write_resumed(&self) {
        self.state().write_error = None;
    }
}

/// The usage file, shared by every shard (clones are handles to one
/// writer). [`UsageLog::off`] records nothing.
#[derive(Debug, Clone, Default)]
pub struct UsageLog {
    inner: Option<Arc<Shared>>,
    writer: Option<Arc<Mutex<Option<JoinHandle<()>>>>>,
}

impl UsageLog {
    /// No usage file.
    pub fn off() -> Self {
        Self::default()
    }

    /// Opens (creates, mode 0640) `path` for appending and starts its
    /// writer thread.
    pub fn start(path: &Path) -> io::Result<Self> {
        Self::start_with(path, Box::new(open_appending), MAX_BUFFERED_BYTES)
    }

    /// [`UsageLog::start`] with the sink `open` gives for `path` (at start
    /// and on every [`UsageLog::reopen_at`]), holding at most
    /// `max_buffered_bytes` of records while it takes no writes.
    pub fn start_with<S: Sink>(
        path: &Path,
        mut open: Opener<S>,
        max_buffered_bytes: usize,
    ) -> io::Result<Self> {
        let sink: Box<dyn Sink> = Box::new(open(path)?);
        let open: AnyOpener = Box::new(move |path| Ok(Box::new(open(path)?) as Box<dyn Sink>));
        let shared = Arc::new(Shared {
            max_buffered_bytes,
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            open: Mutex::new(open),
            state: Mutex::new(FileState {
                path: path.to_owned(),
                open_error: None,
                write_error: None,
            }),
            write_errors: AtomicU64::new(0),
            open_errors: AtomicU64::new(0),
            dropped_records: AtomicU64::new(0),
        });
        let for_thread = Arc::clone(&shared);
        let path = path.to_owned();
        let handle = std::thread::Builder::new()
            .name("iop-usage-log".into())
            .spawn(move || write_batches(&for_thread, sink, path))?;
        Ok(Self {
            inner: Some(shared),
            writer: Some(Arc::new(Mutex::new(Some(handle)))),
        })
    }

    /// Whether records are written.
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// Appends one record (a whole line, ending `\n`); drops it (counted)
    /// when the records waiting for the file are at their bound.
    pub fn record(&self, line: &str) {
        let Some(shared) = &self.inner else { return };
        let mut pending = shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let held = pending.lines.len() + pending.backlog_bytes;
        if held + line.len() > shared.max_buffered_bytes {
            pending.dropped_unlogged += 1;
            drop(pending);
            shared.dropped(1);
            return;
        }
        pending.lines.extend_from_slice(line.as_bytes());
        if pending.lines.len() >= FLUSH_BYTES {
            shared.wake.notify_one();
        }
    }

    /// Reopens the file by the path it was opened with (rotation: rename
    /// it, then reopen): [`UsageLog::reopen_at`] that path.
    pub fn reopen(&self) -> Result<(), String> {
        let Some(shared) = &self.inner else {
            return Ok(());
        };
        let path = shared.state().path.clone();
        self.reopen_at(&path)
    }

    /// Opens `path` (created if missing) on the calling thread; records
    /// written from the writer's next turn on go to it (a record a failed
    /// write cut in two is finished in the old file first). When `path`
    /// cannot be opened, the running file stays (records go on to it), the
    /// failure is counted (`iop_edge_usage_log_open_errors_total`) and kept
    /// as the log's `open_error` until a later call opens its file; the
    /// reason, naming the path, is returned. Nothing to do when off.
    pub fn reopen_at(&self, path: &Path) -> Result<(), String> {
        let Some(shared) = &self.inner else {
            return Ok(());
        };
        let opened = {
            let mut open = shared.open.lock().unwrap_or_else(PoisonError::into_inner);
            open(path)
        };
        match opened {
            Ok(sink) => {
                shared
                    .pending
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .reopen = Some(NextFile {
                    path: path.to_owned(),
                    sink,
                });
                shared.wake.notify_one();
                let mut state = shared.state();
                state.path = path.to_owned();
                state.open_error = None;
                Ok(())
            }
            Err(e) => {
                let why = cannot_append(path, &e);
                shared.open_errors.fetch_add(1, Ordering::Relaxed);
                let mut state = shared.state();
                tracing::error!(
                    path = %path.display(),
                    running = %state.path.display(),
                    error = %e,
                    "usage log cannot be opened; writing to the file already open"
                );
                state.open_error = Some(why.clone());
                Err(why)
            }
        }
    }

    /// Follows a reload's `[edge.usage_log] path` (`next`, from the file
    /// `source`): a path — the same (rotation) or a new one — is opened
    /// ([`UsageLog::reopen_at`]); one that cannot be opened keeps the
    /// running file and is reported in [`LogReload::kept`]. Adding or
    /// removing the usage file needs a restart.
    pub fn apply_reload(&self, source: &Path, next: Option<&Path>) -> LogReload {
        let Some(shared) = &self.inner else {
            return LogReload {
                kept: None,
                restart_required: next.map(|_| "[edge.usage_log] added"),
            };
        };
        let Some(path) = next else {
            return LogReload {
                kept: None,
                restart_required: Some("[edge.usage_log] removed"),
            };
        };
        match self.reopen_at(path) {
            Ok(()) => LogReload::default(),
            Err(why) => {
                let error = ConfigError::new(source, OperationalPath::UsageLog.key(), why);
                let running = shared.state().path.clone();
                LogReload {
                    kept: Some(format!(
                        "{error}; keeping the running usage log (opened as {})",
                        running.display()
                    )),
                    restart_required: None,
                }
            }
        }
    }

    /// Writes everything recorded so far and stops the writer (at
    /// shutdown, after the drain). Records after this are not written.
    pub fn close(&self) {
        let (Some(shared), Some(writer)) = (&self.inner, &self.writer) else {
            return;
        };
        shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .closing = true;
        shared.wake.notify_one();
        let handle = writer.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }

    /// Failed writes and syncs of this file so far.
    pub fn write_errors(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(0, |s| s.write_errors.load(Ordering::Relaxed))
    }

    /// Records of this file dropped so far.
    pub fn dropped_records(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(0, |s| s.dropped_records.load(Ordering::Relaxed))
    }

    /// Where records go and what went wrong; `None` when off.
    pub fn status(&self) -> Option<UsageStatus> {
        let shared = self.inner.as_ref()?;
        let state = shared.state();
        Some(UsageStatus {
            path: state.path.clone(),
            open_error: state.open_error.clone(),
            write_error: state.write_error.clone(),
            write_errors: shared.write_errors.load(Ordering::Relaxed),
            open_errors: shared.open_errors.load(Ordering::Relaxed),
            dropped_records: shared.dropped_records.load(Ordering::Relaxed),
        })
    }

    /// The usage file's series for `/metrics` (zero when off).
    pub fn render_prometheus(&self) -> String {
        let status = self.status();
        let count = |f: fn(&UsageStatus) -> u64| status.as_ref().map_or(0, f);
        format!(
            "# HELP iop_edge_usage_log_write_errors_total Usage file writes or syncs that failed (the records not written are kept and retried).\n\
             # TYPE iop_edge_usage_log_write_errors_total counter\n\
             iop_edge_usage_log_write_errors_total {}\n\
             # HELP iop_edge_usage_log_open_errors_total Reloads whose usage file could not be opened (records went on to the file already open).\n\
             # TYPE iop_edge_usage_log_open_errors_total counter\n\
             iop_edge_usage_log_open_errors_total {}\n\
             # HELP iop_edge_usage_log_dropped_records_total Usage records dropped: the newest, while the file took no writes and the records waiting for it reached their memory bound; or left unwritten at shutdown.\n\
             # TYPE iop_edge_usage_log_dropped_records_total counter\n\
             iop_edge_usage_log_dropped_records_total {}\n\
             # HELP iop_edge_usage_log_failing 1 while records do not reach the configured usage file: its last write failed, or the last reload could not open it.\n\
             # TYPE iop_edge_usage_log_failing gauge\n\
             iop_edge_usage_log_failing {}\n",
            count(|s| s.write_errors),
            count(|s| s.open_errors),
            count(|s| s.dropped_records),
            u8::from(status.as_ref().is_some_and(UsageStatus::is_failing)),
        )
    }
}

/// The bytes the writer took and the file has not: whole records, except
/// that the first may be the rest of one a failed write cut (`torn`: its
/// head is in the file already).
#[derive(Debug, Default)]
struct Backlog {
    bytes: Vec<u8>,
    torn: bool,
}

impl Backlog {
    /// Writes everything to `sink` and syncs it. Whatever happens, the
    /// bytes the sink took leave the backlog (they are never written
    /// twice); on an error the rest stays for the next turn.
    fn write_all(&mut self, sink: &mut impl Sink) -> io::Result<()> {
        let len = self.bytes.len();
        self.write_prefix(sink, len)?;
        sink.sync()
    }

    /// Finishes a torn record (writes up to its end), so what follows can
    /// go to another file.
    fn finish_torn(&mut self, sink: &mut impl Sink) -> io::Result<()> {
        if !self.torn {
            return Ok(());
        }
        let end = self
            .bytes
            .iter()
            .position(|&b| b == b'\n')
            .map_or(self.bytes.len(), |i| i + 1);
        self.write_prefix(sink, end)?;
        sink.sync()
    }

    /// Drops the rest of a torn record; true when there was one.
    fn drop_torn(&mut self) -> bool {
        if !self.torn {
            return false;
        }
        let end = self
            .bytes
            .iter()
            .position(|&b| b == b'\n')
            .map_or(self.bytes.len(), |i| i + 1);
        self.bytes.drain(..end);
        self.torn = false;
        true
    }

    /// Writes `bytes[..end]`, removing what the sink took.
    fn write_prefix(&mut self, sink: &mut impl Sink, end: usize) -> io::Result<()> {
        let mut written = 0;
        let result = loop {
            if written == end {
                break Ok(());
            }
            match sink.write(&self.bytes[written..end]) {
                Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => written += n.min(end - written),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        if written > 0 {
            self.torn = self.bytes[written - 1] != b'\n';
            self.bytes.drain(..written);
        }
        result
    }

    /// Whole or torn records held (for the count of what is lost).
    fn records(&self) -> u64 {
        let ends = self.bytes.iter().filter(|&&b| b == b'\n').count() as u64;
        let unterminated = u64::from(self.bytes.last().is_some_and(|&b| b != b'\n'));
        ends + unterminated
    }
}

/// When the writer last logged, and what it has not logged yet.
#[derive(Debug, Default)]
struct Reports {
    /// Failed writes since the last log line about them.
    failures_unlogged: u64,
    /// Writes have been failing since the last success.
    failing: bool,
    last_failure_log: Option<Instant>,
    last_drop_log: Option<Instant>,
}

impl Reports {
    fn due(last: Option<Instant>, now: Instant) -> bool {
        last.is_none_or(|at| now.saturating_duration_since(at) >= LOG_EVERY)
    }

    fn write_failed(&mut self, path: &Path, e: &io::Error, backlog: &Backlog) {
        self.failures_unlogged += 1;
        let now = clock::now();
        if !self.failing || Self::due(self.last_failure_log, now) {
            tracing::error!(
                path = %path.display(),
                error = %e,
                failed_writes = self.failures_unlogged,
                unwritten_bytes = backlog.bytes.len(),
                "usage log write failed; keeping the unwritten records to retry"
            );
            self.failures_unlogged = 0;
            self.last_failure_log = Some(now);
        }
        self.failing = true;
    }

    fn write_succeeded(&mut self, path: &Path) {
        if self.failing {
            tracing::warn!(path = %path.display(), "usage log writes resumed");
        }
        self.failing = false;
        self.failures_unlogged = 0;
    }

    /// Logs `records` dropped since the last such line, when one is due;
    /// true when it logged.
    fn dropped(&mut self, path: &Path, records: u64, max_buffered_bytes: usize) -> bool {
        let now = clock::now();
        if records == 0 || !Self::due(self.last_drop_log, now) {
            return false;
        }
        tracing::error!(
            path = %path.display(),
            dropped_records = records,
            max_buffered_bytes,
            "usage log: the file takes no writes and the records waiting for it reached their \
             bound; the newest records are dropped"
        );
        self.last_drop_log = Some(now);
        true
    }
}

/// The writer thread: every interval (or when woken) takes the whole
/// buffer into its backlog and appends it to `sink` (opened as `path`);
/// what the file did not take stays for the next turn. A file a reload
/// opened replaces `sink` at the start of the next turn.
fn write_batches(shared: &Shared, mut sink: Box<dyn Sink>, mut path: PathBuf) {
    let mut backlog = Backlog::default();
    let mut reports = Reports::default();
    let mut dropped_unlogged = 0u64;
    loop {
        let (reopen, closing) = {
            let mut pending = shared
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !pending.closing && pending.reopen.is_none() && pending.lines.len() < FLUSH_BYTES {
                pending = shared
                    .wake
                    .wait_timeout(pending, FLUSH_INTERVAL)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            if backlog.bytes.is_empty() {
                std::mem::swap(&mut backlog.bytes, &mut pending.lines);
            } else {
                backlog.bytes.append(&mut pending.lines);
            }
            pending.backlog_bytes = backlog.bytes.len();
            dropped_unlogged += std::mem::take(&mut pending.dropped_unlogged);
            (pending.reopen.take(), pending.closing)
        };
        if let Some(next) = reopen {
            // A record cut by a failed write ends in the file it began in.
            if let Err(e) = backlog.finish_torn(&mut sink) {
                shared.write_failed(&e);
                reports.write_failed(&path, &e, &backlog);
            }
            sink = next.sink;
            path = next.path;
            if backlog.drop_torn() {
                shared.dropped(1);
                dropped_unlogged += 1;
            }
        }
        if !backlog.bytes.is_empty() {
            match backlog.write_all(&mut sink) {
                Ok(()) => {
                    if reports.failing {
                        shared.write_resumed();
                    }
                    reports.write_succeeded(&path);
                }
                Err(e) => {
                    shared.write_failed(&e);
                    reports.write_failed(&path, &e, &backlog);
                    if !closing {
                        std::thread::sleep(FLUSH_INTERVAL);
                    }
                }
            }
        }
        if reports.dropped(&path, dropped_unlogged, shared.max_buffered_bytes) {
            dropped_unlogged = 0;
        }
        // What the file took makes room for new records at once.
        shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .backlog_bytes = backlog.bytes.len();
        if closing {
            let mut pending = shared
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if backlog.bytes.is_empty() && pending.lines.is_empty() {
                return;
            }
            if !backlog.bytes.is_empty() {
                // The file refuses what is left: give up, and say so.
                backlog.bytes.append(&mut pending.lines);
                let lost = backlog.records();
                drop(pending);
                shared.dropped(lost);
                tracing::error!(
                    path = %path.display(),
                    dropped_records = lost,
                    "usage log: records left unwritten at shutdown"
                );
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("iop-usage-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn completeness_of_a_request() {
        assert_eq!(Completeness::of(true, true, true).as_str(), "reported");
        assert_eq!(Completeness::of(true, true, false).as_str(), "none");
        assert_eq!(Completeness::of(true, false, true).as_str(), "partial");
        assert_eq!(Completeness::of(true, false, false).as_str(), "partial");
        assert_eq!(Completeness::of(false, false, false).as_str(), "none");
    }

    #[test]
    fn close_writes_every_record_in_order() {
        let dir = temp("close");
        let path = dir.join("usage.jsonl");
        let log = UsageLog::start(&path).unwrap();
        let clone = log.clone();
        let mut want = String::new();
        for i in 0..10_000 {
            let line = format!("{{\"n\":{i}}}\n");
            want.push_str(&line);
            if i % 2 == 0 { &log } else { &clone }.record(&line);
        }
        log.close();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), want);
        // After close nothing more is written, and closing again is a no-op.
        clone.record("{\"late\":1}\n");
        clone.close();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), want);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn reopen_follows_a_rotation() {
        let dir = temp("rotate");
        let path = dir.join("usage.jsonl");
        let rotated = dir.join("usage.jsonl.1");
        let log = UsageLog::start(&path).unwrap();
        log.record("{\"n\":1}\n");
        // Wait for the interval flush (order, not a timing bound: poll).
        while std::fs::read_to_string(&path).unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::rename(&path, &rotated).unwrap();
        assert_eq!(log.reopen(), Ok(()));
        log.record("{\"n\":2}\n");
        log.close();
        assert_eq!(std::fs::read_to_string(&rotated).unwrap(), "{\"n\":1}\n");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"n\":2}\n");
        let _ = std::fs::remove_dir_all(&dir);
    }

    // A reload whose usage path cannot be opened (it became a directory
    // after a rotation) keeps the running file: records go on to it,
    // exactly; the failure is reported, counted and shown until a reload
    // opens the configured path, from which on records go there.
    #[test]
    fn a_path_that_cannot_be_opened_keeps_the_running_file() {
        let dir = temp("kept");
        let path = dir.join("usage.jsonl");
        let rotated = dir.join("usage.jsonl.1");
        let source = dir.join("edge.toml");
        let log = UsageLog::start(&path).unwrap();
        log.record("{\"n\":1}\n");
        std::fs::rename(&path, &rotated).unwrap();
        std::fs::create_dir(&path).unwrap();
        let why = format!(
            "cannot open {} for appending: Is a directory (os error 21)",
            path.display()
        );
        assert_eq!(
            log.apply_reload(&source, Some(&path)),
            LogReload {
                kept: Some(format!(
                    "{}: edge.usage_log.path: {why}; keeping the running usage log \
                     (opened as {})",
                    source.display(),
                    path.display()
                )),
                restart_required: None,
            }
        );
        assert_eq!(
            log.status(),
            Some(UsageStatus {
                path: path.clone(),
                open_error: Some(why.clone()),
                write_error: None,
                write_errors: 0,
                open_errors: 1,
                dropped_records: 0,
            })
        );
        let text = log.render_prometheus();
        assert!(text.contains("\niop_edge_usage_log_failing 1\n"), "{text}");
        assert!(
            text.contains("\niop_edge_usage_log_open_errors_total 1\n"),
            "{text}"
        );
        // Records go on to the file already open.
        log.record("{\"n\":2}\n");
        wait_for("the second record", || {
            std::fs::read_to_string(&rotated).unwrap() == "{\"n\":1}\n{\"n\":2}\n"
        });
        // The path is fixed: the next reload opens it, and it is written.
        std::fs::remove_dir(&path).unwrap();
        assert_eq!(log.apply_reload(&source, Some(&path)), LogReload::default());
        let status = log.status().unwrap();
        assert!(!status.is_failing(), "{status:?}");
        assert_eq!((status.open_errors, status.write_errors), (1, 0));
        log.record("{\"n\":3}\n");
        log.close();
        assert_eq!(
            std::fs::read_to_string(&rotated).unwrap(),
            "{\"n\":1}\n{\"n\":2}\n"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"n\":3}\n");
        assert!(log
            .render_prometheus()
            .contains("\niop_edge_usage_log_failing 0\n"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    // A reload naming another path moves the records there; one that
    // removes the usage file needs a restart and changes nothing.
    #[test]
    fn a_new_path_takes_the_records_from_the_reload_on() {
        let dir = temp("moved");
        let (first, second) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
        let source = dir.join("edge.toml");
        let log = UsageLog::start(&first).unwrap();
        log.record("{\"n\":1}\n");
        wait_for("the first record", || {
            std::fs::read_to_string(&first).unwrap() == "{\"n\":1}\n"
        });
        assert_eq!(
            log.apply_reload(&source, Some(&second)),
            LogReload::default()
        );
        assert_eq!(log.status().unwrap().path, second);
        log.record("{\"n\":2}\n");
        assert_eq!(
            log.apply_reload(&source, None),
            LogReload {
                kept: None,
                restart_required: Some("[edge.usage_log] removed"),
            }
        );
        log.record("{\"n\":3}\n");
        log.close();
        assert_eq!(std::fs::read_to_string(&first).unwrap(), "{\"n\":1}\n");
        assert_eq!(
            std::fs::read_to_string(&second).unwrap(),
            "{\"n\":2}\n{\"n\":3}\n"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A file in memory (one per open) whose writes follow a script.
    #[derive(Debug, Clone, Default)]
    struct Disk {
        files: Arc<Mutex<Vec<Vec<u8>>>>,
        script: Arc<Mutex<Script>>,
    }

    #[derive(Debug, Default)]
    struct Script {
        /// Each write takes at most this many bytes (0: all it is given).
        max_write_bytes: usize,
        /// Every write fails.
        failing: bool,
        /// The write after this many more bytes fails, once.
        fail_after_bytes: Option<usize>,
        /// Every sync fails.
        syncs_fail: bool,
    }

    #[derive(Debug)]
    struct DiskSink {
        disk: Disk,
        file: usize,
    }

    impl Sink for DiskSink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let mut script = self
                .disk
                .script
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if script.failing {
                return Err(io::Error::other("no space left on device"));
            }
            let mut n = buf.len();
            if script.max_write_bytes > 0 {
                n = n.min(script.max_write_bytes);
            }
            if let Some(left) = script.fail_after_bytes {
                if left == 0 {
                    script.fail_after_bytes = None;
                    return Err(io::Error::other("input/output error"));
                }
                n = n.min(left);
                script.fail_after_bytes = Some(left - n);
            }
            self.disk
                .files
                .lock()
                .unwrap_or_else(PoisonError::into_inner)[self.file]
                .extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn sync(&mut self) -> io::Result<()> {
            let script = self.disk.script.lock();
            if script.unwrap_or_else(PoisonError::into_inner).syncs_fail {
                return Err(io::Error::other("sync failed"));
            }
            Ok(())
        }
    }

    impl Disk {
        fn opener(&self) -> Opener<DiskSink> {
            let disk = self.clone();
            Box::new(move |_| {
                let mut files = disk.files.lock().unwrap();
                files.push(Vec::new());
                Ok(DiskSink {
                    disk: disk.clone(),
                    file: files.len() - 1,
                })
            })
        }

        fn sink(&self) -> DiskSink {
            let mut open = self.opener();
            open(Path::new("unused")).unwrap()
        }

        fn file(&self, i: usize) -> String {
            String::from_utf8(self.files.lock().unwrap()[i].clone()).unwrap()
        }

        fn script(&self) -> std::sync::MutexGuard<'_, Script> {
            self.script.lock().unwrap()
        }
    }

    /// Polls `done` every 10 ms, at most a minute (an outcome, not a timing
    /// bound: the writer works every FLUSH_INTERVAL).
    fn wait_for(what: &str, done: impl Fn() -> bool) {
        for _ in 0..6_000 {
            if done() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("{what} did not happen within a minute");
    }

    fn lines(range: std::ops::Range<usize>) -> Vec<String> {
        range.map(|i| format!("{{\"n\":{i:04}}}\n")).collect()
    }

    // A write that takes part of the bytes and one that fails leave exactly
    // the unwritten rest: what the sink took is never offered again.
    #[test]
    fn a_short_or_failed_write_leaves_only_the_unwritten_rest() {
        let disk = Disk::default();
        let mut sink = disk.sink();
        let mut backlog = Backlog {
            bytes: b"aaaa\nbbbb\n".to_vec(),
            torn: false,
        };
        disk.script().max_write_bytes = 2;
        disk.script().fail_after_bytes = Some(3);
        assert_eq!(
            backlog.write_all(&mut sink).unwrap_err().to_string(),
            "input/output error"
        );
        assert_eq!(disk.file(0), "aaa");
        assert_eq!(
            (&backlog.bytes[..], backlog.torn),
            (&b"a\nbbbb\n"[..], true)
        );
        assert_eq!(backlog.records(), 2);
        backlog.write_all(&mut sink).unwrap();
        assert_eq!(disk.file(0), "aaaa\nbbbb\n");
        assert!(backlog.bytes.is_empty());
        // A failed sync after the bytes were taken: they are not taken again.
        backlog.bytes.extend_from_slice(b"cc\n");
        disk.script().syncs_fail = true;
        assert!(backlog.write_all(&mut sink).is_err());
        assert!(backlog.bytes.is_empty());
        assert_eq!(disk.file(0), "aaaa\nbbbb\ncc\n");
    }

    // Before a rotation the rest of a torn record goes to the file it began
    // in; when that file refuses it, the rest is dropped, never written to
    // the new file as half a line.
    #[test]
    fn a_torn_record_ends_in_its_file_or_is_dropped() {
        let disk = Disk::default();
        let mut old = disk.sink();
        let torn = || Backlog {
            bytes: b"a\nbbbb\n".to_vec(),
            torn: true,
        };
        let mut backlog = torn();
        backlog.finish_torn(&mut old).unwrap();
        assert_eq!(
            (disk.file(0).as_str(), &backlog.bytes[..]),
            ("a\n", &b"bbbb\n"[..])
        );
        assert!(!backlog.torn && !backlog.drop_torn());
        let mut backlog = torn();
        disk.script().failing = true;
        assert!(backlog.finish_torn(&mut old).is_err());
        assert!(backlog.drop_torn());
        assert_eq!((&backlog.bytes[..], backlog.torn), (&b"bbbb\n"[..], false));
        // A whole backlog has nothing torn to finish.
        let mut whole = Backlog {
            bytes: b"x\n".to_vec(),
            torn: false,
        };
        whole.finish_torn(&mut old).unwrap();
        assert_eq!(&whole.bytes[..], b"x\n");
    }

    // Short writes, then a write that fails in the middle of a record: the
    // writer retries the rest a turn later, and the file holds every record
    // once, in order.
    #[test]
    fn a_failed_write_is_retried_from_where_it_stopped() {
        let disk = Disk::default();
        disk.script().max_write_bytes = 7;
        disk.script().fail_after_bytes = Some(30);
        let log = UsageLog::start_with(Path::new("usage.jsonl"), disk.opener(), 1 << 20).unwrap();
        let want = lines(0..100);
        for line in &want {
            log.record(line);
        }
        wait_for("the failed write", || log.write_errors() == 1);
        wait_for("the retry", || disk.file(0).len() == want.concat().len());
        log.record("{\"n\":\"late\"}\n");
        log.close();
        assert_eq!(disk.file(0), want.concat() + "{\"n\":\"late\"}\n");
        assert_eq!((log.write_errors(), log.dropped_records()), (1, 0));
        assert_eq!(disk.files.lock().unwrap().len(), 1);
    }

    // While the file takes nothing, records wait up to the bound; past it
    // the newest are dropped and counted. Once writes resume, the file
    // holds the records kept, in order, each once.
    #[test]
    fn at_the_bound_the_newest_records_are_dropped() {
        let disk = Disk::default();
        disk.script().failing = true;
        let record_bytes = lines(0..1)[0].len();
        let log = UsageLog::start_with(Path::new("usage.jsonl"), disk.opener(), 10 * record_bytes)
            .unwrap();
        let all = lines(0..25);
        for line in &all {
            log.record(line);
        }
        assert_eq!(log.dropped_records(), 15);
        wait_for("a failed write", || log.write_errors() >= 1);
        let status = log.status().unwrap();
        assert_eq!(
            status.write_error.as_deref(),
            Some("no space left on device")
        );
        assert!(status.is_failing() && status.open_error.is_none());
        assert!(log
            .render_prometheus()
            .contains("\niop_edge_usage_log_failing 1\n"));
        // Still full while the file refuses: one more is dropped.
        log.record("{\"n\":\"more\"}\n");
        assert_eq!(log.dropped_records(), 16);
        disk.script().failing = false;
        wait_for("the kept records written", || {
            disk.file(0) == all[..10].concat()
        });
        // Room again at once.
        log.record(&all[24]);
        log.close();
        assert_eq!(disk.file(0), all[..10].concat() + &all[24]);
        assert_eq!(log.dropped_records(), 16);
        let text = log.render_prometheus();
        let sample = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("{name} in {text}"))
        };
        assert_eq!(sample("iop_edge_usage_log_dropped_records_total"), 16);
        assert_eq!(
            sample("iop_edge_usage_log_write_errors_total"),
            log.write_errors()
        );
        assert!(log.write_errors() >= 1);
        // Writes resumed before the close: not failing.
        assert_eq!(sample("iop_edge_usage_log_failing"), 0);
        assert!(text.contains("# TYPE iop_edge_usage_log_write_errors_total counter\n"));
        assert!(text.contains("# TYPE iop_edge_usage_log_failing gauge\n"));
    }

    // At shutdown, records the file still refuses are dropped and counted.
    #[test]
    fn records_the_file_refuses_at_shutdown_are_counted_as_dropped() {
        let disk = Disk::default();
        disk.script().failing = true;
        let log = UsageLog::start_with(Path::new("usage.jsonl"), disk.opener(), 1 << 20).unwrap();
        for line in lines(0..3) {
            log.record(&line);
        }
        log.close();
        assert_eq!(disk.file(0), "");
        assert_eq!(log.dropped_records(), 3);
        assert!(log.write_errors() >= 1);
    }

    #[test]
    fn off_records_nothing() {
        let log = UsageLog::off();
        assert!(!log.is_on());
        log.record("x\n");
        assert_eq!(log.reopen(), Ok(()));
        assert_eq!(log.status(), None);
        assert_eq!(
            log.apply_reload(Path::new("edge.toml"), None),
            LogReload::default()
        );
        // Turning the usage file on takes a restart.
        assert_eq!(
            log.apply_reload(Path::new("edge.toml"), Some(Path::new("usage.jsonl"))),
            LogReload {
                kept: None,
                restart_required: Some("[edge.usage_log] added"),
            }
        );
        assert!(log
            .render_prometheus()
            .contains("\niop_edge_usage_log_failing 0\n"));
        log.close();
    }
}
