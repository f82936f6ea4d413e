//! Helpers shared by the smoke tests that run the real `bench` binary
//! against real edge-bin and node-bin processes.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// Safety net so a hung harness fails the test instead of hanging it.
pub const RUN_LIMIT: Duration = Duration::from_secs(180);

/// The directory with `bench`, `edge-bin` and `node-bin`; fails with the
/// fix when the other binaries were not built.
pub fn bin_dir() -> PathBuf {
    let bench = Path::new(env!("CARGO_BIN_EXE_bench"));
    let dir = bench.parent().expect("bench has a directory").to_path_buf();
    for name in ["edge-bin", "node-bin"] {
        assert!(
            dir.join(name).is_file(),
            "{} is missing: run `cargo build --workspace --bins` first \
             (scripts/test.sh does), then run the tests again",
            dir.join(name).display()
        );
    }
    dir
}

pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iop-bench-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// Runs `bench args…` to completion (bounded); stdout, stderr, success.
/// Both pipes are drained while it runs, so a chatty run never blocks on a
/// full pipe.
pub fn run_bench(args: &[&str]) -> (String, String, bool) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bench");
    let stdout = drain(child.stdout.take().expect("piped stdout"));
    let stderr = drain(child.stderr.take().expect("piped stderr"));
    let mut waited = Duration::ZERO;
    while child.try_wait().expect("try_wait").is_none() {
        if waited >= RUN_LIMIT {
            // SIGKILL skips the harness's own cleanup; SIGTERM lets it stop
            // its children first.
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = child.wait();
            panic!(
                "bench {args:?} still running after {RUN_LIMIT:?}\nstderr:\n{}",
                stderr.join().expect("stderr reader")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
        waited += Duration::from_millis(50);
    }
    let status = child.wait().expect("wait");
    (
        stdout.join().expect("stdout reader"),
        stderr.join().expect("stderr reader"),
        status.success(),
    )
}

/// Reads `pipe` to EOF on a thread of its own.
fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// The JSON report whose path a run printed last (`JSON report: <path>`),
/// checked to lie in `out_dir` and to be named `<kind>-<ts>.json`.
pub fn printed_report(stdout: &str, out_dir: &Path, kind: &str) -> Value {
    let path = stdout
        .lines()
        .find_map(|l| l.strip_prefix("JSON report: "))
        .unwrap_or_else(|| panic!("no JSON path in\n{stdout}"));
    let path = PathBuf::from(path);
    assert_eq!(path.parent(), Some(out_dir), "{}", path.display());
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    assert!(
        name.starts_with(&format!("{kind}-")) && name.ends_with(".json"),
        "{name}"
    );
    serde_json::from_str(&std::fs::read_to_string(&path).expect("read report")).expect("JSON")
}

pub fn f64_at(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

pub fn u64_at(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("`{key}` is not a count in {v}"))
}

pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}
