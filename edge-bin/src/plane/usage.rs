//! The usage file (`[edge.usage_log] path`): one JSON line per inference
//! request, for billing or a database to ingest.
//!
//! Unlike the access log, which drops lines rather than stall a shard, the
//! usage file loses nothing while the file takes writes: a shard appends its
//! line to one process-wide buffer (a lock held for a `memcpy`), and a
//! writer thread takes the whole buffer every [`FLUSH_INTERVAL`] (sooner
//! past [`FLUSH_BYTES`]), appends it and `fdatasync`s the file. SIGHUP
//! reopens the file (for rotation: rename it, then signal), and shutdown
//! writes what is left after the drain.
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
//! then at most once a minute, and when writes resume). A record a failed
//! write cut in two is finished in the file it began in; when the file is
//! rotated before that succeeds, its rest is dropped (and counted). At
//! shutdown, records the file still refuses are dropped and counted.
//!
//! A record says what the provider reported and how complete it is
//! (`usage`): `reported` (the request completed and usage was observed),
//! `none` (it completed and the provider reported none, or it never
//! reached a provider; nothing is guessed), `partial` (it ended early: the
//! tokens are what was observed up to then, or null).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use iop_engine::clock;

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

/// Failed writes and syncs of every usage file of the process
/// (`iop_edge_usage_log_write_errors_total`).
static WRITE_ERRORS: AtomicU64 = AtomicU64::new(0);
/// Records dropped by every usage file of the process
/// (`iop_edge_usage_log_dropped_records_total`).
static DROPPED_RECORDS: AtomicU64 = AtomicU64::new(0);

/// The usage file's series for `/metrics`.
pub fn render_prometheus() -> String {
    format!(
        "# HELP iop_edge_usage_log_write_errors_total Usage file writes or syncs that failed (the records not written are kept and retried).\n\
         # TYPE iop_edge_usage_log_write_errors_total counter\n\
         iop_edge_usage_log_write_errors_total {}\n\
         # HELP iop_edge_usage_log_dropped_records_total Usage records dropped: the newest, while the file took no writes and the records waiting for it reached their memory bound; or left unwritten at shutdown.\n\
         # TYPE iop_edge_usage_log_dropped_records_total counter\n\
         iop_edge_usage_log_dropped_records_total {}\n",
        WRITE_ERRORS.load(Ordering::Relaxed),
        DROPPED_RECORDS.load(Ordering::Relaxed),
    )
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

/// Opens the sink for a path (at start and on every reopen).
pub type Opener<S> = Box<dyn FnMut(&Path) -> io::Result<S> + Send>;

#[derive(Debug, Default)]
struct Pending {
    lines: Vec<u8>,
    /// Bytes of the writer's backlog, as of its last turn.
    backlog_bytes: usize,
    /// Records dropped and not logged yet.
    dropped_unlogged: u64,
    reopen: bool,
    closing: bool,
}

#[derive(Debug)]
struct Shared {
    path: PathBuf,
    max_buffered_bytes: usize,
    pending: Mutex<Pending>,
    wake: Condvar,
    write_errors: AtomicU64,
    dropped_records: AtomicU64,
}

impl Shared {
    fn dropped(&self, records: u64) {
        self.dropped_records.fetch_add(records, Ordering::Relaxed);
        DROPPED_RECORDS.fetch_add(records, Ordering::Relaxed);
    }

    fn write_failed(&self) {
        self.write_errors.fetch_add(1, Ordering::Relaxed);
        WRITE_ERRORS.fetch_add(1, Ordering::Relaxed);
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
        Self::start_with(path, Box::new(open_append), MAX_BUFFERED_BYTES)
    }

    /// [`UsageLog::start`] with the sink `open` gives for `path` (at start
    /// and on every [`UsageLog::reopen`]), holding at most
    /// `max_buffered_bytes` of records while it takes no writes.
    pub fn start_with<S: Sink>(
        path: &Path,
        mut open: Opener<S>,
        max_buffered_bytes: usize,
    ) -> io::Result<Self> {
        let sink = open(path)?;
        let shared = Arc::new(Shared {
            path: path.to_owned(),
            max_buffered_bytes,
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            write_errors: AtomicU64::new(0),
            dropped_records: AtomicU64::new(0),
        });
        let for_thread = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("iop-usage-log".into())
            .spawn(move || write_batches(&for_thread, sink, open))?;
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

    /// Reopens the file by its path before the next write (SIGHUP).
    pub fn reopen(&self) {
        if let Some(shared) = &self.inner {
            shared
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .reopen = true;
            shared.wake.notify_one();
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
}

fn open_append(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)
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
/// buffer into its backlog and appends it; what the file did not take
/// stays for the next turn.
fn write_batches<S: Sink>(shared: &Shared, mut sink: S, mut open: Opener<S>) {
    let mut backlog = Backlog::default();
    let mut reports = Reports::default();
    let mut dropped_unlogged = 0u64;
    loop {
        let (reopen, closing) = {
            let mut pending = shared
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !pending.closing && !pending.reopen && pending.lines.len() < FLUSH_BYTES {
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
            (std::mem::take(&mut pending.reopen), pending.closing)
        };
        if reopen {
            // A record cut by a failed write ends in the file it began in.
            if let Err(e) = backlog.finish_torn(&mut sink) {
                shared.write_failed();
                reports.write_failed(&shared.path, &e, &backlog);
            }
            match open(&shared.path) {
                Ok(s) => {
                    sink = s;
                    if backlog.drop_torn() {
                        shared.dropped(1);
                        dropped_unlogged += 1;
                    }
                }
                Err(e) => tracing::error!(
                    path = %shared.path.display(),
                    error = %e,
                    "usage log cannot be reopened; writing to the file already open"
                ),
            }
        }
        if !backlog.bytes.is_empty() {
            match backlog.write_all(&mut sink) {
                Ok(()) => reports.write_succeeded(&shared.path),
                Err(e) => {
                    shared.write_failed();
                    reports.write_failed(&shared.path, &e, &backlog);
                    if !closing {
                        std::thread::sleep(FLUSH_INTERVAL);
                    }
                }
            }
        }
        if reports.dropped(&shared.path, dropped_unlogged, shared.max_buffered_bytes) {
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
                    path = %shared.path.display(),
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
        log.reopen();
        log.record("{\"n\":2}\n");
        log.close();
        assert_eq!(std::fs::read_to_string(&rotated).unwrap(), "{\"n\":1}\n");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"n\":2}\n");
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
        let text = render_prometheus();
        let dropped = text
            .lines()
            .find_map(|l| l.strip_prefix("iop_edge_usage_log_dropped_records_total "))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap();
        assert!(dropped >= 16, "{text}");
        assert!(text.contains("# TYPE iop_edge_usage_log_write_errors_total counter\n"));
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
        log.reopen();
        log.close();
    }
}
