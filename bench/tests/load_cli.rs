//! `bench load` against the real mock provider: the counts in its JSON
//! summary must add up exactly (one TTFT per stream, one latency per
//! stamped token, tokens − 1 gaps per stream), in both closed-loop and
//! open-loop mode, and a dead server must show up as connection errors.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// The mock provider, SIGKILLed on drop.
struct Mock {
    child: Child,
    addr: String,
}

impl Mock {
    fn start() -> Mock {
        Self::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Mock {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bench"))
            .args([
                "mock-provider",
                "--port",
                "0",
                "--tokens",
                "16",
                "--inter-token-ms",
                "2",
            ])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn mock");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("ready line");
        let addr = line
            .trim()
            .strip_prefix("IOP_READY mock-provider addr=")
            .unwrap_or_else(|| panic!("unexpected ready line {line:?}"))
            .to_string();
        Mock { child, addr }
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn load(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .arg("load")
        .args(args)
        .args(["--json", "-", "--quiet", "--drain-s", "60"])
        .env_remove("IOP_API_KEY")
        .stdin(Stdio::null())
        .output()
        .expect("run bench load");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench load failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The table comes first, then the JSON document.
    let json_start = stdout.find("\n{").expect("JSON after the table") + 1;
    let doc: Value = serde_json::from_str(&stdout[json_start..]).expect("JSON summary");
    doc["summary"].clone()
}

fn count(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

fn assert_counts_add_up(s: &Value, tokens: u64) {
    let ok = count(s, "requests_ok");
    assert!(ok > 0, "{s}");
    assert_eq!(count(s, "requests_started"), ok, "{s}");
    assert_eq!(count(s, "errors_total"), 0, "{s}");
    assert_eq!(count(s, "truncated"), 0, "{s}");
    assert_eq!(count(s, "content_chunks"), ok * tokens, "{s}");
    assert_eq!(count(s, "unstamped_chunks"), 0, "{s}");
    assert_eq!(count(&s["ttft"], "count"), ok, "{s}");
    assert_eq!(count(&s["chunk_latency"], "count"), ok * tokens, "{s}");
    assert_eq!(
        count(&s["inter_chunk_gap"], "count"),
        ok * (tokens - 1),
        "{s}"
    );
    assert_eq!(count(&s["end_to_end"], "count"), ok, "{s}");
    let ttft = &s["ttft"];
    assert!(ttft["p50_us"].as_f64().unwrap() <= ttft["p99_us"].as_f64().unwrap());
}

#[test]
fn closed_loop_counts_add_up() {
    let mock = Mock::start();
    let url = format!("http://{}", mock.addr);
    let s = load(&[
        "--url",
        &url,
        "--model",
        "m",
        "--concurrency",
        "4",
        "--duration-s",
        "0.3",
        "--tokens",
        "5",
    ]);
    assert_counts_add_up(&s, 5);
}

#[test]
fn open_loop_counts_add_up() {
    let mock = Mock::start();
    let url = format!("http://{}/v1", mock.addr);
    let s = load(&[
        "--url",
        &url,
        "--model",
        "m",
        "--rate",
        "100/s",
        "--duration-s",
        "0.2",
        "--tokens",
        "3",
    ]);
    // 0.2 s at 100/s: requests due at 0, 10, …, 190 ms.
    assert_eq!(count(&s, "requests_started"), 20, "{s}");
    assert_counts_add_up(&s, 3);
}

#[test]
fn a_dead_server_counts_connection_errors() {
    // Bind and drop a listener to find a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let s = load(&[
        "--url",
        &url,
        "--model",
        "m",
        "--rate",
        "50",
        "--duration-s",
        "0.1",
    ]);
    assert_eq!(count(&s, "requests_started"), 5, "{s}");
    assert_eq!(count(&s, "requests_ok"), 0);
    assert_eq!(count(&s["errors"], "connect"), 5);
    assert_eq!(count(&s, "errors_total"), 5);
    assert!(s["first_error"]
        .as_str()
        .unwrap()
        .starts_with(&format!("connect 127.0.0.1:{port}")));
}

#[test]
fn non_streamed_completions_count_one_chunk_each() {
    let mock = Mock::start();
    let url = format!("http://{}", mock.addr);
    let s = load(&[
        "--url",
        &url,
        "--model",
        "m",
        "--concurrency",
        "2",
        "--duration-s",
        "0.2",
        "--tokens",
        "4",
        "--stream",
        "false",
    ]);
    let ok = count(&s, "requests_ok");
    assert!(ok > 0, "{s}");
    assert_eq!(count(&s, "errors_total"), 0, "{s}");
    assert_eq!(count(&s, "content_chunks"), ok);
    assert_eq!(count(&s["ttft"], "count"), ok);
    assert_eq!(count(&s["chunk_latency"], "count"), ok);
    assert_eq!(count(&s["inter_chunk_gap"], "count"), 0);
}

// `--api-key` reaches a server that wants one (an Edge with
// `[[client_keys]]`; here the mock with `--require-api-key`): every request
// succeeds with it, none without it.
#[test]
fn the_api_key_is_sent_with_every_request() {
    const KEY: &str = "sk-load-7c3e91";
    let mock = Mock::start_with(&["--require-api-key", KEY]);
    let url = format!("http://{}", mock.addr);
    let args = [
        "--url",
        &url,
        "--model",
        "m",
        "--rate",
        "50",
        "--duration-s",
        "0.1",
        "--tokens",
        "3",
    ];
    let with_key = load(&[&args[..], &["--api-key", KEY]].concat());
    assert_eq!(count(&with_key, "requests_started"), 5, "{with_key}");
    assert_counts_add_up(&with_key, 3);
    let without = load(&args);
    assert_eq!(count(&without, "requests_ok"), 0, "{without}");
    assert_eq!(count(&without, "errors_total"), 5, "{without}");
    assert!(
        without["first_error"].as_str().unwrap().contains("401"),
        "{without}"
    );
}
