//! The budget file (`[edge] budget_file`): the token budgets' usage
//! ([`crate::plane::budgets`]) on disk, so it outlives a restart.
//!
//! An append-only text file of [`Record`]s, one a line:
//!
//! ```text
//! <unix_ms> <principal id: 32 lowercase hex digits> <tokens>\n
//! ```
//!
//! The principal id is a hash of the principal's name
//! ([`crate::plane::budgets::principal_id`]): the file holds no key and no
//! name.
//!
//! ```text
//! shard ─append─► [pending bytes] ─take─► writer thread ─write+fdatasync─► file
//!                  (a lock held for a memcpy)   (at most one sync per GROUP_COMMIT)
//! ```
//!
//! A shard never waits for the disk: it copies the line into a buffer
//! shared by every shard; one writer thread takes the whole buffer, writes
//! it and `fdatasync`s, then waits [`GROUP_COMMIT`] before the next batch,
//! so the records of that time share one sync. `appended` and `durable`
//! count records given to the file and records synced; `/status` shows
//! both. Past [`MAX_PENDING_BYTES`] waiting (a disk that takes nothing),
//! new records are dropped from the file (counted; the running Edge still
//! counts them).
//!
//! At startup [`BudgetFile::open`] replays the file into a [`Ledger`]
//! (the current day's and month's usage per principal), then compacts it:
//! the ledger's [`Ledger::totals`] go to a new file, which is synced,
//! renamed over the old one, and the directory synced. A last line without
//! its newline (a crash mid-write) is skipped with a warning, as is any
//! line that does not parse; a file that cannot be read or written is a
//! startup error naming it.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use iop_wire::lease;

use crate::plane::budgets::{Ledger, PrincipalId, Record};

/// Least time between two syncs of the file: the records appended
/// meanwhile share the next one.
pub const GROUP_COMMIT: Duration = Duration::from_millis(50);

/// Most bytes of records waiting for the file; newer records are dropped
/// from the file past it.
pub const MAX_PENDING_BYTES: usize = 16 * 1024 * 1024;

/// The budget file as `/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetFileStatus {
    /// The file.
    pub path: PathBuf,
    /// Records given to the file since startup.
    pub appended: u64,
    /// Of them, records written and synced: all usage counted up to
    /// `appended` is on disk once `durable == appended`.
    pub durable: u64,
    /// Records dropped (the disk took nothing while
    /// [`MAX_PENDING_BYTES`] waited).
    pub dropped: u64,
    /// Failed writes and syncs.
    pub write_errors: u64,
}

/// What [`BudgetFile::open`] found in the file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replay {
    /// Whole records read.
    pub records: u64,
    /// Lines skipped: unparsable, or the torn last line.
    pub skipped_lines: u64,
    /// Records the compacted file holds.
    pub compacted_records: u64,
}

#[derive(Default)]
struct Pending {
    bytes: Vec<u8>,
    records: u64,
    closing: bool,
}

struct Shared {
    path: PathBuf,
    pending: Mutex<Pending>,
    wake: Condvar,
    appended: AtomicU64,
    durable: AtomicU64,
    dropped: AtomicU64,
    write_errors: AtomicU64,
}

/// The process's budget file; clones share it.
#[derive(Clone)]
pub struct BudgetFile {
    shared: Arc<Shared>,
    writer: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for BudgetFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BudgetFile")
            .field("path", &self.shared.path)
            .finish_non_exhaustive()
    }
}

/// One record as a line.
pub fn encode(record: &Record, out: &mut Vec<u8>) {
    let _ = writeln!(
        out,
        "{} {} {}",
        record.unix_ms,
        lease::encode_hex(&record.principal),
        record.tokens
    );
}

/// A line (without its newline) as a record, or `None` when it does not
/// parse.
pub fn decode(line: &[u8]) -> Option<Record> {
    let line = std::str::from_utf8(line).ok()?;
    let mut fields = line.split(' ');
    let unix_ms = fields.next()?.parse().ok()?;
    let id = fields.next()?;
    let tokens = fields.next()?.parse().ok()?;
    if fields.next().is_some() || id.len() != 32 {
        return None;
    }
    let mut principal: PrincipalId = [0; 16];
    for (i, byte) in principal.iter_mut().enumerate() {
        let digits = id.get(2 * i..2 * i + 2)?;
        if digits
            .bytes()
            .any(|b| !matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return None;
        }
        *byte = u8::from_str_radix(digits, 16).ok()?;
    }
    Some(Record {
        unix_ms,
        principal,
        tokens,
    })
}

fn named(path: &Path, what: &str, e: io::Error) -> String {
    format!("{}: budget file: {what}: {e}", path.display())
}

impl BudgetFile {
    /// Replays `path` (a missing file is empty) into the usage of the day
    /// and month holding `now_unix_ms`, compacts it, opens it for
    /// appending (created mode 0640) and starts the writer thread. The
    /// error names the file.
    pub fn open(path: &Path, now_unix_ms: i64) -> Result<(BudgetFile, Ledger, Replay), String> {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(named(path, "cannot read it", e)),
        };
        let mut ledger = Ledger::default();
        let mut replay = Replay::default();
        let mut lines = bytes.split(|&b| b == b'\n').peekable();
        while let Some(line) = lines.next() {
            let last = lines.peek().is_none();
            if last {
                if !line.is_empty() {
                    replay.skipped_lines += 1;
                    tracing::warn!(
                        file = %path.display(),
                        bytes = line.len(),
                        "budget file: skipping a torn last line (the Edge stopped mid-write)"
                    );
                }
                break;
            }
            match decode(line) {
                Some(record) => {
                    replay.records += 1;
                    ledger.add(record);
                }
                None => {
                    replay.skipped_lines += 1;
                    tracing::warn!(
                        file = %path.display(),
                        line = %String::from_utf8_lossy(line),
                        "budget file: skipping a line that does not parse"
                    );
                }
            }
        }
        let totals = ledger.totals(now_unix_ms);
        replay.compacted_records = totals.len() as u64;
        compact(path, &totals)?;
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .open(path)
            .map_err(|e| named(path, "cannot open it for appending", e))?;
        let shared = Arc::new(Shared {
            path: path.to_owned(),
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            appended: AtomicU64::new(0),
            durable: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
        });
        let for_thread = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("iop-budget-file".into())
            .spawn(move || write_batches(&for_thread, file))
            .map_err(|e| named(path, "cannot start its writer thread", e))?;
        Ok((
            BudgetFile {
                shared,
                writer: Arc::new(Mutex::new(Some(handle))),
            },
            ledger,
            replay,
        ))
    }

    /// Gives `record` to the file (never waits for the disk).
    pub fn append(&self, record: &Record) {
        let mut pending = self
            .shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if pending.closing || pending.bytes.len() >= MAX_PENDING_BYTES {
            drop(pending);
            if self.shared.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    file = %self.shared.path.display(),
                    "budget file: records wait past the bound; newer ones are not written \
                     (the running Edge still counts them)"
                );
            }
            return;
        }
        let was_empty = pending.bytes.is_empty();
        encode(record, &mut pending.bytes);
        pending.records += 1;
        self.shared.appended.fetch_add(1, Ordering::Relaxed);
        drop(pending);
        if was_empty {
            self.shared.wake.notify_one();
        }
    }

    /// The file's counters.
    pub fn status(&self) -> BudgetFileStatus {
        BudgetFileStatus {
            path: self.shared.path.clone(),
            appended: self.shared.appended.load(Ordering::Acquire),
            durable: self.shared.durable.load(Ordering::Acquire),
            dropped: self.shared.dropped.load(Ordering::Relaxed),
            write_errors: self.shared.write_errors.load(Ordering::Relaxed),
        }
    }

    /// Writes and syncs what waits, then stops the writer (at shutdown,
    /// after the drain). Later records are dropped.
    pub fn close(&self) {
        self.shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .closing = true;
        self.shared.wake.notify_one();
        let handle = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

/// Replaces `path` with a file of `records`: a new file next to it,
/// synced, renamed over it, and the directory synced.
fn compact(path: &Path, records: &[Record]) -> Result<(), String> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".compacting");
    let tmp = PathBuf::from(tmp);
    let mut bytes = Vec::with_capacity(records.len() * 56);
    for r in records {
        encode(r, &mut bytes);
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o640)
        .open(&tmp)
        .map_err(|e| named(path, &format!("cannot create {}", tmp.display()), e))?;
    file.write_all(&bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| named(path, &format!("cannot write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| named(path, "cannot replace it", e))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| named(path, "cannot sync its directory", e))
}

fn write_batches(shared: &Shared, mut file: File) {
    // Bytes taken from `pending` that the file has not taken yet, and how
    // many whole records they end.
    let mut backlog: Vec<u8> = Vec::new();
    let mut backlog_records = 0u64;
    let mut failing = false;
    loop {
        let closing = {
            let mut pending = shared
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            while pending.bytes.is_empty() && !pending.closing && backlog.is_empty() {
                pending = shared
                    .wake
                    .wait(pending)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            backlog.append(&mut pending.bytes);
            backlog_records += std::mem::take(&mut pending.records);
            pending.closing
        };
        if !backlog.is_empty() {
            match write_and_sync(&mut file, &mut backlog) {
                Ok(()) => {
                    shared
                        .durable
                        .fetch_add(std::mem::take(&mut backlog_records), Ordering::Release);
                    if failing {
                        failing = false;
                        tracing::info!(file = %shared.path.display(), "budget file: writes resumed");
                    }
                }
                Err(e) => {
                    shared.write_errors.fetch_add(1, Ordering::Relaxed);
                    if !failing {
                        failing = true;
                        tracing::error!(
                            file = %shared.path.display(),
                            error = %e,
                            "budget file: write failed; retrying (usage counted meanwhile is \
                             not durable)"
                        );
                    }
                    if closing {
                        return;
                    }
                }
            }
        }
        if closing && backlog.is_empty() {
            return;
        }
        std::thread::sleep(GROUP_COMMIT);
    }
}

/// Writes `backlog` (keeping what a failed write did not take) and syncs.
fn write_and_sync(file: &mut File, backlog: &mut Vec<u8>) -> io::Result<()> {
    while !backlog.is_empty() {
        match file.write(backlog) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                backlog.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    file.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plane::budgets::principal_id;

    #[test]
    fn a_record_is_one_line_that_decodes_to_itself() {
        let r = Record {
            unix_ms: 1_796_601_600_000,
            principal: principal_id("team-a"),
            tokens: 1034,
        };
        let mut out = Vec::new();
        encode(&r, &mut out);
        let text = String::from_utf8(out.clone()).expect("utf-8");
        assert_eq!(
            text,
            format!(
                "1796601600000 {} 1034\n",
                &blake3::hash(b"team-a").to_hex()[..32]
            )
        );
        assert_eq!(decode(&out[..out.len() - 1]), Some(r));
        for bad in [
            "",
            "1 2 3",
            "x 00000000000000000000000000000000 1",
            "1 0000000000000000000000000000000G 1",
            "1 00000000000000000000000000000000 -1",
            "1 00000000000000000000000000000000 1 1",
            "1 00000000000000000000000000000000",
        ] {
            assert_eq!(decode(bad.as_bytes()), None, "{bad:?}");
        }
    }
}
