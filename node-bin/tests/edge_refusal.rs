//! A Node the Edge refuses in the TLS handshake (its node id is not among
//! the Edge's `[[nodes]]`) stays up, says why, redials under its reconnect
//! policy, and registers once an Edge that accepts it listens on the same
//! address: a real `edge-bin` and a real `node-bin` over real sockets.
//!
//! Under TLS 1.3 the Node's handshake has finished before the Edge judges
//! the Node's certificate, so the refusal (`access_denied`) arrives on the
//! Node's first read, while its writer sends `RegisterRequest`. The
//! monoio-rustls stream the link used to run on panicked there
//! ("buffer ref expected") and the process exited 101.
//!
//! `edge-bin` runs from the same target directory as `node-bin` (build it
//! first: `cargo build -p edge-bin --bins`).

mod scratch;

use scratch::ScratchDir;
use std::sync::atomic::{AtomicUsize, Ordering};

use std::cell::RefCell;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

const NODE_BIN: &str = env!("CARGO_BIN_EXE_node-bin");
/// Every wait is bounded by this; the steps take a few seconds.
const PATIENCE: Duration = Duration::from_secs(60);
/// What the refused Node logs as the reason of each failed attempt.
const REFUSAL: &str = "the Edge refused this node's identity in the TLS handshake (TLS alert \
     access_denied): its config must list node id \"node-z\" under [[nodes]] and share our \
     trust_domain";

/// A child process whose stdout and stderr go to files; killed on drop (a
/// failed assertion must not leave it running).
struct Proc {
    name: &'static str,
    child: RefCell<Child>,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Proc {
    fn spawn(name: &'static str, dir: &ScratchDir, command: &mut Command) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let stdout = dir.join(&format!("{name}-{n}.out"));
        let stderr = dir.join(&format!("{name}-{n}.log"));
        let file = |path: &Path| match File::create(path) {
            Ok(f) => f,
            Err(e) => panic!("create {}: {e}", path.display()),
        };
        let child = command
            .env_remove("NOTIFY_SOCKET")
            .env("RUST_LOG", "info")
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(file(&stdout))
            .stderr(file(&stderr))
            .spawn();
        match child {
            Ok(child) => Proc {
                name,
                child: RefCell::new(child),
                stdout,
                stderr,
            },
            Err(e) => panic!("spawn {name}: {e}"),
        }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The JSON log lines (`--log-format json`) so far.
    fn log_lines(&self) -> Vec<Value> {
        self.log()
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect()
    }

    /// Panics with the log if the process has exited.
    fn assert_running(&self) {
        let exited = self.child.borrow_mut().try_wait();
        match exited {
            Ok(None) => {}
            Ok(Some(status)) => panic!(
                "{} exited ({status}) while it should run; its log:\n{}",
                self.name,
                self.log()
            ),
            Err(e) => panic!("wait {}: {e}", self.name),
        }
    }

    /// Sends SIGTERM and returns the exit code.
    fn stop(&self) -> Option<i32> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.borrow().id().to_string()])
            .status();
        assert!(
            status.as_ref().is_ok_and(|s| s.success()),
            "kill -TERM {}: {status:?}",
            self.name
        );
        let start = iop_engine::clock::now();
        while start.elapsed() < PATIENCE {
            let exited = self.child.borrow_mut().try_wait();
            match exited {
                Ok(Some(status)) => return status.code(),
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => panic!("wait {}: {e}", self.name),
            }
        }
        panic!("{} did not exit within {PATIENCE:?}", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let child = self.child.get_mut();
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Polls `check` until it answers, failing after [`PATIENCE`] with the
/// logs of `procs`; every process must stay up meanwhile.
fn wait_for<T>(what: &str, procs: &[&Proc], mut check: impl FnMut() -> Option<T>) -> T {
    let start = iop_engine::clock::now();
    loop {
        if let Some(found) = check() {
            return found;
        }
        for proc in procs {
            proc.assert_running();
        }
        if start.elapsed() > PATIENCE {
            let logs: Vec<String> = procs
                .iter()
                .map(|p| format!("--- {}:\n{}", p.name, p.log()))
                .collect();
            panic!("{what}: not within {PATIENCE:?}\n{}", logs.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `edge-bin`, beside `node-bin` in the target directory.
fn edge_bin() -> PathBuf {
    let path = Path::new(NODE_BIN).with_file_name("edge-bin");
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build -p edge-bin --bins)",
        path.display()
    );
    path
}

/// An Edge config accepting exactly `node_ids`, its node listener on
/// `node_listen`.
fn edge_toml(dir: &ScratchDir, node_listen: &str, node_ids: &[&str]) -> PathBuf {
    let nodes: String = node_ids
        .iter()
        .map(|id| format!("\n[[nodes]]\nid = \"{id}\"\n"))
        .collect();
    let text = format!(
        r#"[edge]
name = "edge-1"
trust_domain = "iop.local"
client_listen = "127.0.0.1:0"
node_listen = "{node_listen}"
allow_anonymous = true

[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"
{nodes}"#
    );
    let path = dir.join(&format!("edge-{}.toml", node_ids.join("-")));
    if let Err(e) = std::fs::write(&path, text) {
        panic!("write {}: {e}", path.display());
    }
    path
}

/// Starts an Edge on `toml` and returns it with its node listener address
/// (from its `IOP_READY` line).
fn start_edge(dir: &ScratchDir, toml: &Path, legacy_driver: bool) -> (Proc, String) {
    let mut command = Command::new(edge_bin());
    command.args([
        "--log-format",
        "json",
        "--config",
        &toml.display().to_string(),
    ]);
    if legacy_driver {
        command.env("MONOIO_FORCE_LEGACY_DRIVER", "1");
    }
    let edge = Proc::spawn("edge-bin", dir, &mut command);
    let nodes = wait_for("the Edge's IOP_READY line", &[&edge], || {
        edge.stdout()
            .lines()
            .find_map(|line| line.strip_prefix("IOP_READY edge "))
            .and_then(|rest| rest.split(' ').find_map(|kv| kv.strip_prefix("nodes=")))
            .map(str::to_owned)
    });
    (edge, nodes)
}

/// The `fields` of the log lines of `target` whose message is `message`.
fn events(proc: &Proc, target: &str, message: &str) -> Vec<Value> {
    proc.log_lines()
        .into_iter()
        .filter(|line| line["target"] == target && line["fields"]["message"] == message)
        .map(|line| line["fields"].clone())
        .collect()
}

fn refused_node_redials_and_registers_once_configured(legacy_driver: bool) {
    let dir = ScratchDir::new(if legacy_driver { "legacy" } else { "uring" });
    if let Err(e) = iop_engine::certs::write_dev_certs(
        &dir.join("certs"),
        "iop.local",
        "edge-1",
        ["node-a", "node-z"],
    ) {
        panic!("certs: {e}");
    }

    // An Edge that knows node-a only.
    let (edge, node_listen) = start_edge(
        &dir,
        &edge_toml(&dir, "127.0.0.1:0", &["node-a"]),
        legacy_driver,
    );

    // node-z dials it, one second between attempts, no jitter, forever.
    let node_toml = dir.join("node.toml");
    let text = format!(
        r#"node_id = "node-z"
trust_domain = "iop.local"
edge_addr = "{node_listen}"
edge_name = "edge-1"

[tls]
ca = "certs/ca.pem"
cert = "certs/node-node-z.pem"
key = "certs/node-node-z-key.pem"

[reconnect]
interval_sec = 1
jitter_percent = 0
max_attempts = 0
"#
    );
    if let Err(e) = std::fs::write(&node_toml, text) {
        panic!("write node.toml: {e}");
    }
    let mut command = Command::new(NODE_BIN);
    command.args([
        "--log-format",
        "json",
        "--config",
        &node_toml.display().to_string(),
    ]);
    if legacy_driver {
        command.env("MONOIO_FORCE_LEGACY_DRIVER", "1");
    }
    let node = Proc::spawn("node-bin", &dir, &mut command);

    // Refused three times in a row: each attempt is logged with the reason
    // and the wait, and the process stays up (wait_for checks it).
    let attempts = "connection attempt failed; redialling in 1.0s";
    let refusals = wait_for("three refused attempts", &[&node, &edge], || {
        let failed = events(&node, "node_bin::supervisor", attempts);
        (failed.len() >= 3).then_some(failed)
    });
    for (i, fields) in refusals.iter().take(3).enumerate() {
        assert_eq!(fields["attempt"], i + 1, "{fields}");
        assert_eq!(fields["reason"], REFUSAL, "{fields}");
        assert_eq!(fields["retry_in_ms"], 1000, "{fields}");
    }
    // Each attempt was a fresh dial and TLS handshake.
    let dials = events(&node, "node_bin::supervisor", "edge TLS identity verified");
    assert!(dials.len() >= 3, "{dials:?}");
    // The Edge says why it refused (its log is throttled per peer address).
    let rejected = events(
        &edge,
        "edge_bin::link::handshake",
        "node connection rejected in the TLS handshake",
    );
    assert!(
        rejected.first().is_some_and(|f| f["error"]
            .as_str()
            .is_some_and(|e| e.contains("NameNotAllowed { name: \"node-z\" }"))),
        "{rejected:?}"
    );
    assert!(!node.log().contains("panicked"), "{}", node.log());

    // The operator fixes the Edge's config: an Edge that knows node-z takes
    // the same address. The Node registers on one of its next attempts.
    assert_eq!(edge.stop(), Some(0));
    let (fixed_edge, fixed_listen) = start_edge(
        &dir,
        &edge_toml(&dir, &node_listen, &["node-a", "node-z"]),
        legacy_driver,
    );
    assert_eq!(fixed_listen, node_listen);
    wait_for("the session", &[&node, &fixed_edge], || {
        let ready = events(&node, "node_bin::session", "session ready");
        ready
            .first()
            .map(|f| assert_eq!(f["node_id"], "node-z", "{f}"))
    });
    wait_for("node.connected on the Edge", &[&node, &fixed_edge], || {
        let connected = events(&fixed_edge, "edge_bin::link::edge", "node.connected");
        connected
            .first()
            .map(|f| assert_eq!(f["node_id"], "node-z", "{f}"))
    });
    assert!(!node.log().contains("panicked"), "{}", node.log());

    assert_eq!(node.stop(), Some(0), "{}", node.log());
    assert_eq!(fixed_edge.stop(), Some(0), "{}", fixed_edge.log());
}

#[test]
fn refused_node_stays_up_redials_and_registers_once_configured_io_uring() {
    refused_node_redials_and_registers_once_configured(false);
}

#[test]
fn refused_node_stays_up_redials_and_registers_once_configured_epoll() {
    refused_node_redials_and_registers_once_configured(true);
}
