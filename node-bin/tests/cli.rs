//! The `node-bin` command line, run as a real process: `--version`,
//! `check-config`, `--log-format json`, `--help`, and what systemd hears
//! (`READY=1` while the Edge is down, `RELOADING=1`/`READY=1` around
//! SIGHUP, `STOPPING=1`).

mod scratch;

use scratch::ScratchDir;

use std::io::Read;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use iop_engine::build::{IoUring, COMMIT, VERSION};

const BIN: &str = env!("CARGO_BIN_EXE_node-bin");

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args).env_remove("NOTIFY_SOCKET");
    for (name, value) in env {
        command.env(name, value);
    }
    match command.output() {
        Ok(out) => out,
        Err(e) => panic!("run {BIN} {args:?}: {e}"),
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// examples/node.toml copied into `dir` with development certificates for
/// `nodes` minted beside it in `certs/` (where the example looks).
fn example_with_certs(dir: &ScratchDir, nodes: &[&str]) -> PathBuf {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/node.toml");
    let path = dir.join("node.toml");
    if let Err(e) = std::fs::copy(example, &path) {
        panic!("copy node.toml: {e}");
    }
    if let Err(e) =
        iop_engine::certs::write_dev_certs(&dir.join("certs"), "iop.local", "edge-1", nodes)
    {
        panic!("certs: {e}");
    }
    path
}

fn edit(path: &Path, from: &str, to: &str) {
    let content = match std::fs::read_to_string(path) {
        Ok(c) => c,
        Err(e) => panic!("read {}: {e}", path.display()),
    };
    assert!(content.contains(from), "{} lacks {from:?}", path.display());
    if let Err(e) = std::fs::write(path, content.replacen(from, to, 1)) {
        panic!("write {}: {e}", path.display());
    }
}

#[test]
fn version_names_version_commit_and_io_uring() {
    let out = run(&["--version"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "node-bin {VERSION} (commit {COMMIT}, io_uring: {})\n",
            IoUring::probe()
        )
    );
    let out = run(&["--version"], &[("MONOIO_FORCE_LEGACY_DRIVER", "true")]);
    assert_eq!(
        text(&out.stdout),
        format!(
            "node-bin {VERSION} (commit {COMMIT}, io_uring: disabled by \
             MONOIO_FORCE_LEGACY_DRIVER)\n"
        )
    );
}

#[test]
fn check_config_accepts_the_example_and_names_file_key_and_reason() {
    let dir = ScratchDir::new("cli-check");
    let node = example_with_certs(&dir, &["node-a", "node-b"]);
    let path = node.display().to_string();
    // Nothing listens on the example's Edge address: the check never dials.
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "{path}: ok\nnode node-a: edge 127.0.0.1:7443 (edge-1), TLS on, credential plane off\n"
        )
    );

    // The certificate must name node_id (checked past parsing).
    edit(&node, "node_id = \"node-a\"", "node_id = \"node-b\"");
    let expected = format!(
        "node-bin: error: {path}: node_id: `node-b` does not match the certificate identity \
         spiffe://iop.local/node/node-a\n"
    );
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "");
    assert_eq!(text(&out.stderr), expected);
    // Startup says the same.
    let out = run(&["--config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr), expected);

    // A bad value: the key and the reason.
    edit(&node, "node_id = \"node-b\"", "node_id = \"node-a\"");
    edit(&node, "drain_grace_ms = 30000", "drain_grace_ms = -1");
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with(&format!("node-bin: error: {path}: drain_grace_ms: ")),
        "{stderr}"
    );

    // The recipient key is read and checked: a world-readable one is refused.
    edit(&node, "drain_grace_ms = -1", "drain_grace_ms = 30000");
    let key = dir.join("node-a.key");
    let out = run(
        &["keys", "recipient", "--out", &key.display().to_string()],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let public = text(&out.stdout);
    assert!(public.starts_with("x25519:"), "{public}");
    let issuer = iop_engine::keys::encode_issuer_public_key(
        &ed25519_dalek::SigningKey::from_bytes(&[9; 32]).verifying_key(),
    );
    let mut content = match std::fs::read_to_string(&node) {
        Ok(c) => c,
        Err(e) => panic!("read: {e}"),
    };
    content.push_str(&format!(
        "\n[credentials]\nrecipient_key = \"node-a.key\"\nissuer_public_key = \"{issuer}\"\n"
    ));
    if let Err(e) = std::fs::write(&node, content) {
        panic!("write: {e}");
    }
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).ends_with("TLS on, credential plane on\n"),
        "{}",
        text(&out.stdout)
    );
    use std::os::unix::fs::PermissionsExt;
    if let Err(e) = std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)) {
        panic!("chmod: {e}");
    }
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "key file {} has mode 0644; a private key must not be accessible to group or \
             others (chmod 600)",
            key.display()
        )),
        "{stderr}"
    );
}

#[test]
fn help_names_env_vars_signals_and_docs() {
    let out = run(&["--help"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    for needle in [
        "RUST_LOG",
        "MONOIO_FORCE_LEGACY_DRIVER",
        "NOTIFY_SOCKET",
        "SIGHUP",
        "SIGTERM, SIGINT",
        "SIGUSR1",
        "docs/deployment.md",
        "README.md",
        "check-config",
        "--log-format",
        "--version",
    ] {
        assert!(help.contains(needle), "{needle} not in:\n{help}");
    }
}

/// Kills the child on drop (a failed assertion must not leave it running).
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status();
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "kill -{name}: {status:?}"
    );
}

fn wait_exit(child: &mut Child, limit: Duration) -> Option<i32> {
    let start = iop_engine::clock::now();
    while start.elapsed() < limit {
        match child.try_wait() {
            Ok(Some(status)) => return status.code(),
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("wait: {e}"),
        }
    }
    panic!("node-bin did not exit within {limit:?}");
}

fn recv(socket: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    match socket.recv(&mut buf) {
        Ok(n) => text(&buf[..n]),
        Err(e) => panic!("no notification: {e}"),
    }
}

#[test]
fn ready_while_the_edge_is_down_reloading_around_sighup_and_json_logs() {
    let dir = ScratchDir::new("cli-notify");
    let node = example_with_certs(&dir, &["node-a"]);
    // An Edge address nothing listens on: bound for a port, then closed.
    let edge_addr = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(addr) => addr,
        Err(e) => panic!("bind: {e}"),
    };
    edit(
        &node,
        "edge_addr = \"127.0.0.1:7443\"",
        &format!("edge_addr = \"{edge_addr}\""),
    );
    edit(&node, "interval_sec = 10", "interval_sec = 1");
    edit(&node, "max_attempts = 10", "max_attempts = 0");
    let notify_path = dir.join("notify.sock");
    let socket = match UnixDatagram::bind(&notify_path) {
        Ok(s) => s,
        Err(e) => panic!("bind {}: {e}", notify_path.display()),
    };
    if let Err(e) = socket.set_read_timeout(Some(Duration::from_secs(60))) {
        panic!("timeout: {e}");
    }
    let child = Command::new(BIN)
        .args([
            "--log-format",
            "json",
            "--config",
            &node.display().to_string(),
        ])
        .env("NOTIFY_SOCKET", &notify_path)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => Running(c),
        Err(e) => panic!("spawn: {e}"),
    };
    // READY=1 although no Edge answers: systemctl start does not wait for
    // the Edge, the Node keeps redialling.
    assert_eq!(recv(&socket), "READY=1");
    signal(&child.0, "HUP");
    let reloading = recv(&socket);
    let usec = reloading
        .strip_prefix("RELOADING=1\nMONOTONIC_USEC=")
        .and_then(|n| n.parse::<u64>().ok());
    assert!(usec.is_some_and(|n| n > 0), "{reloading:?}");
    assert_eq!(recv(&socket), "READY=1");
    signal(&child.0, "TERM");
    assert_eq!(recv(&socket), "STOPPING=1");
    assert_eq!(wait_exit(&mut child.0, Duration::from_secs(60)), Some(0));

    let mut stderr = String::new();
    if let Some(mut pipe) = child.0.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let mut messages = Vec::new();
    for line in stderr.lines() {
        let value: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => panic!("not JSON ({e}): {line}"),
        };
        for key in ["timestamp", "level", "target"] {
            assert!(value[key].is_string(), "{key} in {line}");
        }
        match value["fields"]["message"].as_str() {
            Some(m) => messages.push(m.to_owned()),
            None => panic!("no fields.message in {line}"),
        }
    }
    for expected in [
        "node-bin starting",
        "node certificate reloaded: the next Edge connection presents it",
    ] {
        assert!(
            messages.iter().any(|m| m == expected),
            "{expected:?} not in {messages:?}"
        );
    }
}
