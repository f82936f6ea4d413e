//! The `edge-bin` command line, run as a real process: `--version`,
//! `check-config` (and `--diff`), `--log-format json` and `--help`.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use iop_engine::build::{IoUring, COMMIT, VERSION};

const BIN: &str = env!("CARGO_BIN_EXE_edge-bin");

/// A scratch directory removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(label: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "iop-edge-cli-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            panic!("create {}: {e}", dir.display());
        }
        ScratchDir(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

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

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// The example configs copied into `dir` with development certificates
/// minted beside them in `certs/` (where the examples look).
fn examples_with_certs(dir: &ScratchDir) {
    for name in ["edge.toml", "edge-ollama-vllm.toml"] {
        if let Err(e) = std::fs::copy(examples_dir().join(name), dir.join(name)) {
            panic!("copy {name}: {e}");
        }
    }
    let certs = dir.join("certs");
    let out = run(
        &[
            "certs",
            "--out",
            &certs.display().to_string(),
            "--node",
            "node-a",
        ],
        &[],
    );
    assert!(out.status.success(), "certs: {}", text(&out.stderr));
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
            "edge-bin {VERSION} (commit {COMMIT}, io_uring: {})\n",
            IoUring::probe()
        )
    );
    assert_eq!(VERSION, env!("CARGO_PKG_VERSION"));
    // The commit is one of this checkout's (unless the build was told
    // one): HEAD, or in a debug build the HEAD of when the engine was last
    // compiled, an ancestor of HEAD.
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| text(&o.stdout).trim().to_owned())
    };
    match (
        git(&["rev-parse", "--short=12", "HEAD"]),
        std::env::var("IOP_GIT_COMMIT"),
    ) {
        (Some(head), Err(_)) => {
            assert_eq!(COMMIT.len(), 12, "{COMMIT}");
            assert!(
                COMMIT == head || git(&["merge-base", "--is-ancestor", COMMIT, "HEAD"]).is_some(),
                "{COMMIT} is not HEAD ({head}) nor an ancestor of it"
            );
        }
        (None, Err(_)) => assert_eq!(COMMIT, "unknown"),
        (_, Ok(_)) => println!("IOP_GIT_COMMIT is set: the stamp is {COMMIT}"),
    }

    let out = run(&["--version"], &[("MONOIO_FORCE_LEGACY_DRIVER", "1")]);
    assert_eq!(
        text(&out.stdout),
        format!(
            "edge-bin {VERSION} (commit {COMMIT}, io_uring: disabled by \
             MONOIO_FORCE_LEGACY_DRIVER)\n"
        )
    );
}

#[test]
fn check_config_accepts_the_examples_without_binding() {
    let dir = ScratchDir::new("examples");
    examples_with_certs(&dir);
    // The Edge examples listen on 127.0.0.1:8080 and :7443: hold a port
    // and point the first example at it, so a check that bound would fail.
    let held = match std::net::TcpListener::bind("127.0.0.1:0") {
        Ok(l) => l,
        Err(e) => panic!("bind: {e}"),
    };
    let held_addr = match held.local_addr() {
        Ok(a) => a,
        Err(e) => panic!("local_addr: {e}"),
    };
    let edge = dir.join("edge.toml");
    edit(
        &edge,
        "client_listen = \"127.0.0.1:8080\"",
        &format!("client_listen = \"{held_addr}\""),
    );
    let path = edge.display().to_string();
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "{path}: ok\nedge edge-1: client_listen {held_addr}, node_listen 127.0.0.1:7443, \
             1 node(s), 2 model(s), 0 client key(s), node TLS on, client TLS off, \
             credential plane off\n"
        )
    );

    let path = dir.join("edge-ollama-vllm.toml").display().to_string();
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "{path}: ok\nedge edge-1: client_listen 127.0.0.1:8080, node_listen 127.0.0.1:7443, \
             2 node(s), 2 model(s), 0 client key(s), node TLS on, client TLS off, \
             credential plane off\n"
        )
    );
    drop(held);
}

#[test]
fn check_config_failures_exit_1_with_file_key_and_reason_as_startup_does() {
    let dir = ScratchDir::new("broken");
    examples_with_certs(&dir);
    let edge = dir.join("edge.toml");
    let path = edge.display().to_string();

    // A bad value: the key and the reason.
    edit(
        &edge,
        "max_request_body_bytes = 8388608",
        "max_request_body_bytes = \"lots\"",
    );
    let expected = format!(
        "edge-bin: error: {path}: edge.max_request_body_bytes: invalid type: string \"lots\", \
         expected i64 (line 30, column 26)\n"
    );
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "");
    assert_eq!(text(&out.stderr), expected);
    // Startup refuses it with the same message.
    let out = run(&["--config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr), expected);

    // A file the check has to read: the certificate authority.
    edit(
        &edge,
        "max_request_body_bytes = \"lots\"",
        "max_request_body_bytes = 8388608",
    );
    let ca = dir.join("certs/ca.pem");
    if let Err(e) = std::fs::remove_file(&ca) {
        panic!("rm {}: {e}", ca.display());
    }
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        format!(
            "edge-bin: error: {path}: tls.ca: cannot read {}: No such file or directory \
             (os error 2)\n",
            ca.display()
        )
    );

    // A certificate that does not name edge.name (checked past parsing).
    let certs = dir.join("certs2");
    let out = run(
        &[
            "certs",
            "--out",
            &certs.display().to_string(),
            "--edge-name",
            "edge-2",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    edit(&edge, "ca = \"certs/ca.pem\"", "ca = \"certs2/ca.pem\"");
    edit(
        &edge,
        "cert = \"certs/edge.pem\"",
        "cert = \"certs2/edge.pem\"",
    );
    edit(
        &edge,
        "key = \"certs/edge-key.pem\"",
        "key = \"certs2/edge-key.pem\"",
    );
    let out = run(&["check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        format!(
            "edge-bin: error: {path}: edge.name: `edge-1` does not match the certificate \
             identity spiffe://iop.local/edge/edge-2\n"
        )
    );

    // A missing file.
    let missing = dir.join("missing.toml").display().to_string();
    let out = run(&["check-config", &missing], &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with(&format!("edge-bin: error: {missing}: ")),
        "{stderr}"
    );
}

#[test]
fn check_config_diff_prints_what_changes_from_the_running_file() {
    let dir = ScratchDir::new("diff");
    examples_with_certs(&dir);
    let running = dir.join("edge.toml");
    let next = dir.join("edge-next.toml");
    if let Err(e) = std::fs::copy(&running, &next) {
        panic!("copy: {e}");
    }
    for (from, to) in [
        ("long_context_capacity = 2", "long_context_capacity = 1"),
        (
            // The model's pool (not the commented credential slot's list).
            "\nproviders = [\"node-a/a-llama\"]",
            "\nproviders = [\"node-a/a-llama\", \"node-a/a-qwen\"]",
        ),
        (
            "client_listen = \"127.0.0.1:8080\"",
            "client_listen = \"127.0.0.1:8081\"",
        ),
        ("drain_grace_ms = 30000", "drain_grace_ms = 5000"),
        (
            "client_head_timeout_ms = 10000",
            "client_head_timeout_ms = 5000",
        ),
    ] {
        edit(&next, from, to);
    }
    let (running, next) = (running.display().to_string(), next.display().to_string());
    // Log lines go to stderr; at `error` there are none, so stderr is
    // exactly what the command says.
    let quiet = [("RUST_LOG", "error")];

    let out = run(&["check-config", "--diff", &running, &next], &quiet);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "~ provider node-a/a-llama: long_context_capacity 2 -> 1\n\
         ~ model llama-3.1-8b: pool [node-a/a-llama] -> [node-a/a-llama, node-a/a-qwen]\n\
         ~ edge.client_listen: 127.0.0.1:8080 -> 127.0.0.1:8081 (needs a restart)\n\
         ~ edge.drain_grace_ms: 30000 -> 5000 (needs a restart)\n\
         ~ edge.client_head_timeout_ms: 10000 -> 5000 (live)\n"
    );
    assert_eq!(text(&out.stderr), "");

    let out = run(&["check-config", "--diff", &running, &running], &quiet);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "no changes\n");

    // An invalid file, new or running: its file, key and reason, exit 1,
    // no diff.
    edit(
        Path::new(&next),
        "max_request_body_bytes = 8388608",
        "max_request_body_bytes = -1",
    );
    let expected = format!(
        "edge-bin: error: {next}: edge.max_request_body_bytes: must be between 1 and \
         16711680 (got -1)\n"
    );
    for args in [[&running, &next], [&next, &running]] {
        let out = run(&["check-config", "--diff", args[0], args[1]], &quiet);
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(text(&out.stdout), "");
        assert_eq!(text(&out.stderr), expected);
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
    panic!("edge-bin did not exit within {limit:?}");
}

/// Every line is a JSON object: an access log line (it has a
/// `request_id`; returned as `access <path> <status>`) or a log line with the
/// fields tracing-subscriber's JSON format writes (returned as its message).
fn json_messages(stderr: &str) -> Vec<String> {
    let mut messages = Vec::new();
    for line in stderr.lines() {
        let value: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => panic!("not JSON ({e}): {line}"),
        };
        if value["request_id"].is_string() {
            messages.push(format!("access {} {}", value["path"], value["status"]));
            continue;
        }
        for key in ["timestamp", "level", "target"] {
            assert!(value[key].is_string(), "{key} in {line}");
        }
        let Some(message) = value["fields"]["message"].as_str() else {
            panic!("no fields.message in {line}");
        };
        messages.push(message.to_owned());
    }
    messages
}

#[test]
fn json_log_lines_parse_as_json() {
    let dir = ScratchDir::new("json");
    examples_with_certs(&dir);
    let edge = dir.join("edge.toml");
    edit(
        &edge,
        "client_listen = \"127.0.0.1:8080\"",
        "client_listen = \"127.0.0.1:0\"",
    );
    edit(
        &edge,
        "node_listen = \"127.0.0.1:7443\"",
        "node_listen = \"127.0.0.1:0\"",
    );
    let path = edge.display().to_string();

    let out = run(&["--log-format", "json", "check-config", &path], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let messages = json_messages(&text(&out.stderr));
    // The example runs open (no client keys): it says so.
    assert_eq!(
        messages,
        [
            "node-link certificate loaded (SIGHUP reloads it)",
            "edge.allow_anonymous = true and no [[client_keys]]: every client is served without a key"
        ],
        "{}",
        text(&out.stderr)
    );

    // A running Edge: startup, a reload and the drain, all JSON.
    let child = Command::new(BIN)
        .args(["--log-format", "json", "--config", &path])
        .env_remove("NOTIFY_SOCKET")
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => Running(c),
        Err(e) => panic!("spawn: {e}"),
    };
    let Some(stdout) = child.0.stdout.take() else {
        panic!("no stdout");
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("IOP_READY") {
                let _ = ready_tx.send(line);
            }
        }
    });
    let ready = ready_rx.recv_timeout(Duration::from_secs(60));
    let Some(client) = ready.ok().and_then(|line| {
        line.split(' ')
            .find_map(|w| w.strip_prefix("client=").map(str::to_owned))
    }) else {
        panic!("no IOP_READY line with client=");
    };
    // One request, so the access log writes a line (it follows
    // --log-format: the example leaves `format` out).
    let mut conn = match std::net::TcpStream::connect(&client) {
        Ok(c) => c,
        Err(e) => panic!("connect {client}: {e}"),
    };
    use std::io::Write;
    if let Err(e) =
        conn.write_all(b"GET /livez HTTP/1.1\r\nhost: edge\r\nconnection: close\r\n\r\n")
    {
        panic!("write: {e}");
    }
    let mut response = String::new();
    let _ = conn.read_to_string(&mut response);
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    signal(&child.0, "HUP");
    std::thread::sleep(Duration::from_millis(500));
    signal(&child.0, "TERM");
    assert_eq!(wait_exit(&mut child.0, Duration::from_secs(60)), Some(0));
    let mut stderr = String::new();
    if let Some(mut pipe) = child.0.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let messages = json_messages(&stderr);
    for expected in [
        "access \"/livez\" 200",
        "configuration reloaded",
        "drained; shut down",
    ] {
        assert!(
            messages.iter().any(|m| m == expected),
            "{expected:?} not in {messages:?}"
        );
    }
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

    let out = run(&["--log-format", "yaml", "--version"], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("unknown log format `yaml`: expected text or json"),
        "{}",
        text(&out.stderr)
    );
}
