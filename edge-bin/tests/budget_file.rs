//! The budget file on disk: usage survives a process that stops without
//! flushing anything (a kill), a torn last line is skipped, the file is
//! compacted to the current periods' totals at startup, and a file that
//! cannot be used is an error naming it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use edge_bin::plane::budget_file::{BudgetFile, Replay};
use edge_bin::plane::budgets::{principal_id, Period, Record};

/// 2026-12-07T12:00:00Z.
const NOON_MS: i64 = 1_796_644_800_000;
/// 2026-12-07T00:00:00Z.
const DAY_START_MS: i64 = 1_796_601_600_000;
/// 2026-12-01T00:00:00Z.
const MONTH_START_MS: i64 = 1_796_083_200_000;

fn scratch(label: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "budget-file-{label}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

fn hex(principal: &str) -> String {
    blake3::hash(principal.as_bytes()).to_hex()[..32].to_owned()
}

/// Waits until every record given to `file` is synced (the writer thread
/// syncs every 50 ms; the bound is for a loaded machine).
fn wait_durable(file: &BudgetFile, appended: u64) {
    for _ in 0..2000 {
        let status = file.status();
        assert_eq!(status.appended, appended);
        if status.durable == appended {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("records not durable: {:?}", file.status());
}

#[test]
fn usage_outlives_a_process_that_stops_without_flushing_and_the_file_is_compacted() {
    let dir = scratch("kill");
    let path = dir.join("budgets.log");
    let (file, ledger, replay) = BudgetFile::open(&path, NOON_MS).expect("open");
    assert_eq!(replay, Replay::default());
    assert_eq!(
        ledger.used(&principal_id("team-a"), Period::Day, NOON_MS),
        0
    );
    let (a, b) = (principal_id("team-a"), principal_id("team-b"));
    let records = [
        // Last month: dropped by the compaction.
        (MONTH_START_MS - 1, a, 500),
        // Earlier this month.
        (MONTH_START_MS + 3_600_000, a, 40),
        (MONTH_START_MS + 7_200_000, b, 7),
        // Today.
        (DAY_START_MS + 1, a, 600),
        (NOON_MS - 1, a, 434),
    ];
    for (unix_ms, principal, tokens) in records {
        file.append(&Record {
            unix_ms,
            principal,
            tokens,
        });
    }
    wait_durable(&file, records.len() as u64);
    // A kill: nothing in memory is flushed or closed, the process's state
    // is simply gone.
    std::mem::forget(file);

    let (again, ledger, replay) = BudgetFile::open(&path, NOON_MS).expect("reopen");
    assert_eq!(
        replay,
        Replay {
            records: 5,
            skipped_lines: 0,
            compacted_records: 3,
        }
    );
    assert_eq!(ledger.used(&a, Period::Day, NOON_MS), 1034);
    assert_eq!(ledger.used(&a, Period::Month, NOON_MS), 1074);
    assert_eq!(ledger.used(&b, Period::Day, NOON_MS), 0);
    assert_eq!(ledger.used(&b, Period::Month, NOON_MS), 7);
    // The file now holds the totals only: the month before today at the
    // month's start, today at the day's start.
    let mut want = [
        (MONTH_START_MS, hex("team-a"), 40),
        (MONTH_START_MS, hex("team-b"), 7),
        (DAY_START_MS, hex("team-a"), 1034),
    ];
    want.sort();
    let text: String = want
        .iter()
        .map(|(ms, id, tokens)| format!("{ms} {id} {tokens}\n"))
        .collect();
    assert_eq!(std::fs::read_to_string(&path).expect("read"), text);
    assert!(!dir.join("budgets.log.compacting").exists());
    // New records go after the totals; a clean close writes what waits.
    again.append(&Record {
        unix_ms: NOON_MS,
        principal: b,
        tokens: 1,
    });
    again.close();
    assert_eq!(again.status().durable, 1);
    let (_, ledger, _) = BudgetFile::open(&path, NOON_MS).expect("reopen");
    assert_eq!(ledger.used(&b, Period::Day, NOON_MS), 1);
    assert_eq!(ledger.used(&b, Period::Month, NOON_MS), 8);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_torn_last_line_and_unparsable_lines_are_skipped() {
    let dir = scratch("torn");
    let path = dir.join("budgets.log");
    let a = hex("team-a");
    std::fs::write(
        &path,
        format!(
            "{DAY_START_MS} {a} 100\nnot a record\n{} {a} 20\n{NOON_MS} {a} 99",
            DAY_START_MS + 5
        ),
    )
    .expect("write");
    let (file, ledger, replay) = BudgetFile::open(&path, NOON_MS).expect("open");
    assert_eq!(
        replay,
        Replay {
            records: 2,
            skipped_lines: 2,
            compacted_records: 1,
        }
    );
    assert_eq!(
        ledger.used(&principal_id("team-a"), Period::Day, NOON_MS),
        120
    );
    file.close();
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        format!("{DAY_START_MS} {a} 120\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_that_cannot_be_used_is_an_error_naming_it() {
    let dir = scratch("bad");
    // A directory where the file should be.
    let as_dir = dir.join("budgets.log");
    std::fs::create_dir_all(&as_dir).expect("mkdir");
    let e = BudgetFile::open(&as_dir, NOON_MS).expect_err("a directory");
    assert!(
        e.starts_with(&format!(
            "{}: budget file: cannot read it:",
            as_dir.display()
        )),
        "{e}"
    );
    // A directory that does not exist.
    let missing = dir.join("no-such-dir").join("budgets.log");
    let e = BudgetFile::open(&missing, NOON_MS).expect_err("a missing directory");
    assert_eq!(
        e,
        format!(
            "{}: budget file: cannot create {}.compacting: No such file or directory (os error \
             2)",
            missing.display(),
            missing.display()
        )
    );
    let _ = std::fs::remove_dir_all(&dir);
}
