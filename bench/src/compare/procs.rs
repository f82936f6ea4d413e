//! Child processes of a comparison (mock provider, Edge, Node) and the
//! temporary directory they work in. Every child is stopped by PID when
//! its guard drops — on success, on error and on panic: SIGTERM first,
//! SIGKILL after a grace period.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::CompareError;

/// How long a child gets to print its `IOP_READY` line.
pub const READY_TIMEOUT_MS: u64 = 30_000;
/// How long a child gets to exit after SIGTERM before SIGKILL.
pub const TERM_GRACE_MS: u64 = 5_000;
/// Poll period while waiting on a child.
const POLL_MS: u64 = 20;
/// Bytes of a child's log quoted in an error.
const LOG_TAIL_BYTES: u64 = 2_000;

/// The fields of an `IOP_READY <what> key=value ...` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyLine {
    /// The word after `IOP_READY` (`mock-provider`, `edge`).
    pub what: String,
    /// The `key=value` pairs.
    pub fields: BTreeMap<String, String>,
}

/// Parses an `IOP_READY` line; `None` for any other line.
pub fn parse_ready_line(line: &str) -> Option<ReadyLine> {
    let mut words = line.split_ascii_whitespace();
    if words.next()? != "IOP_READY" {
        return None;
    }
    let what = words.next()?.to_string();
    let fields = words
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Some(ReadyLine { what, fields })
}

/// A running child process, stopped when dropped.
#[derive(Debug)]
pub struct ChildProc {
    name: String,
    child: std::process::Child,
    log_path: PathBuf,
    ready: Option<ReadyLine>,
    stopped: bool,
}

impl ChildProc {
    /// Starts `program args` with stdout and stderr going to
    /// `<log_dir>/<name>.log` (stdout through a pipe, so the `IOP_READY`
    /// line can be caught). With `wait_ready`, waits (bounded) for that
    /// line; a child that exits first is an error quoting its log.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        log_dir: &Path,
        wait_ready: bool,
        stop: &AtomicBool,
    ) -> Result<ChildProc, CompareError> {
        Self::spawn_with_env(name, program, args, &[], log_dir, wait_ready, stop)
    }

    /// [`ChildProc::spawn`] with extra environment variables.
    pub fn spawn_with_env(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log_dir: &Path,
        wait_ready: bool,
        stop: &AtomicBool,
    ) -> Result<ChildProc, CompareError> {
        let log_path = log_dir.join(format!("{name}.log"));
        let io_error = |what: String| {
            let path = log_path.clone();
            move |source| CompareError::Io {
                what: format!("{what} {}", path.display()),
                source,
            }
        };
        // Both streams append, so neither overwrites the other's lines.
        File::create(&log_path).map_err(io_error("create".into()))?;
        let open_append = || OpenOptions::new().append(true).open(&log_path);
        let stderr_log = open_append().map_err(io_error("append to".into()))?;
        let mut child = Command::new(program)
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr_log))
            .spawn()
            .map_err(|source| CompareError::Spawn {
                name: name.to_string(),
                program: program.display().to_string(),
                source,
            })?;
        let (tx, rx) = mpsc::channel::<ReadyLine>();
        if let Some(stdout) = child.stdout.take() {
            let mut log = open_append().map_err(io_error("append to".into()))?;
            std::thread::spawn(move || {
                let mut sent = false;
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let _ = writeln!(log, "{line}");
                    if !sent {
                        if let Some(ready) = parse_ready_line(&line) {
                            sent = tx.send(ready).is_ok();
                        }
                    }
                }
            });
        }
        let mut proc = ChildProc {
            name: name.to_string(),
            child,
            log_path,
            ready: None,
            stopped: false,
        };
        if wait_ready {
            let mut waited_ms = 0;
            loop {
                match rx.recv_timeout(Duration::from_millis(POLL_MS)) {
                    Ok(ready) => {
                        proc.ready = Some(ready);
                        break;
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        // stdout closed without the line: the child exited
                        // or closed it; report whichever it was.
                        proc.check_running()?;
                        return Err(proc.not_ready("closed stdout without an IOP_READY line"));
                    }
                }
                proc.check_running()?;
                waited_ms += POLL_MS;
                if stop.load(Ordering::Relaxed) {
                    return Err(CompareError::Interrupted);
                }
                if waited_ms >= READY_TIMEOUT_MS {
                    return Err(proc.not_ready("no IOP_READY line within 30 s"));
                }
            }
        }
        Ok(proc)
    }

    fn not_ready(&self, reason: &str) -> CompareError {
        CompareError::NotReady {
            name: self.name.clone(),
            reason: reason.to_string(),
            log_tail: self.log_tail(),
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The child's name (`mock`, `edge`, `node`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A field of the child's `IOP_READY` line.
    pub fn ready_value(&self, key: &str) -> Result<&str, CompareError> {
        self.ready
            .as_ref()
            .and_then(|r| r.fields.get(key))
            .map(String::as_str)
            .ok_or_else(|| self.not_ready(&format!("its IOP_READY line has no `{key}=`")))
    }

    /// An error if the child has exited.
    pub fn check_running(&mut self) -> Result<(), CompareError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(CompareError::Exited {
                name: self.name.clone(),
                status: status.to_string(),
                log_tail: self.log_tail(),
            }),
            Err(source) => Err(CompareError::Io {
                what: format!("wait for {}", self.name),
                source,
            }),
        }
    }

    /// The last bytes of the child's log.
    pub fn log_tail(&self) -> String {
        read_tail(&self.log_path, LOG_TAIL_BYTES).unwrap_or_default()
    }

    /// Kills the child at once (SIGKILL: no drain, no cleanup, like a
    /// crash) and collects its exit status.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        if self.stopped {
            return None;
        }
        self.stopped = true;
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// Stops the child: SIGTERM, then SIGKILL after [`TERM_GRACE_MS`].
    /// Returns its exit status when it could be collected.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if self.stopped {
            return None;
        }
        self.stopped = true;
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let mut waited_ms = 0;
        while waited_ms < TERM_GRACE_MS {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(POLL_MS));
            waited_ms += POLL_MS;
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.stop();
    }
}

fn read_tail(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(max_bytes)))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// A temporary directory removed (with its contents) when dropped, unless
/// kept.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    /// Creates `<tmp>/iop-bench-<pid>-<unix ms>-<n>` (`n` counts the
    /// directories this process made, so two are never the same).
    pub fn create(keep: bool) -> Result<TempDir, CompareError> {
        static CREATED: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "iop-bench-{}-{}-{}",
            std::process::id(),
            iop_engine::clock::unix_ms(),
            CREATED.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&path).map_err(|source| CompareError::Io {
            what: format!("create {}", path.display()),
            source,
        })?;
        Ok(TempDir { path, keep })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_lines_parse() {
        assert_eq!(
            parse_ready_line("IOP_READY edge client=127.0.0.1:1 nodes=127.0.0.1:2\n"),
            Some(ReadyLine {
                what: "edge".into(),
                fields: BTreeMap::from([
                    ("client".into(), "127.0.0.1:1".into()),
                    ("nodes".into(), "127.0.0.1:2".into())
                ])
            })
        );
        let mock = parse_ready_line("IOP_READY mock-provider addr=127.0.0.1:5 junk").unwrap();
        assert_eq!(mock.what, "mock-provider");
        assert_eq!(mock.fields.len(), 1);
        assert_eq!(parse_ready_line("2026 INFO IOP_READY x"), None);
        assert_eq!(parse_ready_line("IOP_READY"), None);
    }

    #[test]
    fn a_child_is_waited_for_and_stopped() {
        let dir = TempDir::create(false).unwrap();
        let stop = AtomicBool::new(false);
        let script = "echo hello; echo 'IOP_READY test k=v'; exec sleep 30".to_string();
        let mut child = ChildProc::spawn(
            "sh",
            Path::new("/bin/sh"),
            &["-c".into(), script],
            dir.path(),
            true,
            &stop,
        )
        .unwrap();
        assert_eq!(child.ready_value("k").unwrap(), "v");
        assert!(child.ready_value("missing").is_err());
        child.check_running().unwrap();
        let status = child.stop().unwrap();
        // sleep dies of the SIGTERM.
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(15)
        );
        assert!(child.log_tail().starts_with("hello\nIOP_READY test k=v\n"));
        let path = dir.path().to_path_buf();
        drop(child);
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn a_child_that_exits_early_is_reported_with_its_log() {
        let dir = TempDir::create(false).unwrap();
        let stop = AtomicBool::new(false);
        let err = ChildProc::spawn(
            "early",
            Path::new("/bin/sh"),
            &["-c".into(), "echo bad config >&2; exit 3".into()],
            dir.path(),
            true,
            &stop,
        )
        .unwrap_err();
        match err {
            CompareError::Exited { name, log_tail, .. }
            | CompareError::NotReady { name, log_tail, .. } => {
                assert_eq!(name, "early");
                assert_eq!(log_tail, "bad config\n");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
