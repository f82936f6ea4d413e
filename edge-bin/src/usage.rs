//! The usage file (`[edge.usage_log] path`): one JSON line per inference
//! request, for billing or a database to ingest.
//!
//! Unlike the access log, which drops lines rather than stall a shard, the
//! usage file loses nothing: a shard appends its line to one process-wide
//! buffer (a lock held for a `memcpy`), and a writer thread takes the whole
//! buffer every [`FLUSH_INTERVAL`] (sooner past [`FLUSH_BYTES`]), appends
//! it with one `write` and `fdatasync`s the file. A failed write keeps the
//! batch for the next turn. SIGHUP reopens the file (for rotation: rename
//! it, then signal), and shutdown writes what is left after the drain.
//!
//! A record says what the provider reported and how complete it is
//! (`usage`): `reported` (the request completed and usage was observed),
//! `none` (it completed and the provider reported none, or it never
//! reached a provider; nothing is guessed), `partial` (it ended early: the
//! tokens are what was observed up to then, or null).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often buffered records are written.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// Buffered bytes that wake the writer before the interval.
pub const FLUSH_BYTES: usize = 256 * 1024;

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

#[derive(Debug, Default)]
struct Pending {
    lines: Vec<u8>,
    reopen: bool,
    closing: bool,
}

#[derive(Debug)]
struct Shared {
    path: PathBuf,
    pending: Mutex<Pending>,
    wake: Condvar,
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
    pub fn start(path: &Path) -> std::io::Result<Self> {
        let file = open_append(path)?;
        let shared = Arc::new(Shared {
            path: path.to_owned(),
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
        });
        let for_thread = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("iop-usage-log".into())
            .spawn(move || write_batches(&for_thread, file))?;
        Ok(Self {
            inner: Some(shared),
            writer: Some(Arc::new(Mutex::new(Some(handle)))),
        })
    }

    /// Whether records are written.
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// Appends one record (a whole line, ending `\n`).
    pub fn record(&self, line: &str) {
        let Some(shared) = &self.inner else { return };
        let mut pending = shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
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
}

fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)
}

/// The writer thread: every interval (or when woken) takes the whole
/// buffer and appends it; keeps a batch whose write failed and retries it.
fn write_batches(shared: &Shared, mut file: std::fs::File) {
    let mut batch: Vec<u8> = Vec::new();
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
            if batch.is_empty() {
                std::mem::swap(&mut batch, &mut pending.lines);
            } else {
                batch.append(&mut pending.lines);
            }
            (std::mem::take(&mut pending.reopen), pending.closing)
        };
        if reopen {
            match open_append(&shared.path) {
                Ok(f) => file = f,
                Err(e) => tracing::error!(
                    path = %shared.path.display(),
                    error = %e,
                    "usage log cannot be reopened; writing to the file already open"
                ),
            }
        }
        if !batch.is_empty() {
            match file.write_all(&batch).and_then(|()| file.sync_data()) {
                Ok(()) => batch.clear(),
                Err(e) => {
                    tracing::error!(
                        path = %shared.path.display(),
                        error = %e,
                        bytes = batch.len(),
                        "usage log write failed; keeping the records to retry"
                    );
                    if closing {
                        return;
                    }
                    std::thread::sleep(FLUSH_INTERVAL);
                }
            }
        }
        if closing && batch.is_empty() {
            let rest = shared
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .lines
                .is_empty();
            if rest {
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

    #[test]
    fn off_records_nothing() {
        let log = UsageLog::off();
        assert!(!log.is_on());
        log.record("x\n");
        log.reopen();
        log.close();
    }
}
