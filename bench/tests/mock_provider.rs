//! End-to-end tests of `bench mock-provider`: the real binary on 127.0.0.1
//! port 0, driven with raw HTTP/1.1 over blocking std sockets.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

/// Safety net so a hung server fails a test instead of hanging it.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The spawned mock; killed (SIGKILL) on drop if still running, so a failing
/// test never leaks the process.
struct MockProcess {
    child: Child,
    addr: SocketAddr,
    stdout: BufReader<ChildStdout>,
}

impl MockProcess {
    fn spawn(extra_args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bench"))
            .args(["mock-provider", "--port", "0"])
            .args(extra_args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn bench");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut guard = MockProcess {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            stdout: BufReader::new(stdout),
        };
        let mut line = String::new();
        guard.stdout.read_line(&mut line).expect("read ready line");
        let addr = line
            .strip_prefix("IOP_READY mock-provider addr=")
            .and_then(|rest| rest.strip_suffix('\n'))
            .unwrap_or_else(|| panic!("unexpected ready line {line:?}"));
        guard.addr = addr.parse().expect("ready line address");
        assert_eq!(guard.addr.ip().to_string(), "127.0.0.1");
        assert_ne!(guard.addr.port(), 0);
        guard
    }

    fn connect(&self) -> Client {
        let stream = TcpStream::connect(self.addr).expect("connect");
        stream.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        stream.set_nodelay(true).expect("nodelay");
        Client {
            reader: BufReader::new(stream),
        }
    }

    /// Sends `signal` and waits (bounded) for the exit.
    fn stop_with(&mut self, signal: Signal) -> ExitStatus {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        kill(pid, signal).expect("send signal");
        for _ in 0..300 {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("mock provider did not exit within 30 s of {signal:?}");
    }
}

impl Drop for MockProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 client connection.
struct Client {
    reader: BufReader<TcpStream>,
}

/// A parsed response; `chunks` is set for `Transfer-Encoding: chunked`.
#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    chunks: Option<Vec<Vec<u8>>>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

impl Client {
    fn send(&mut self, raw: &[u8]) {
        self.reader.get_mut().write_all(raw).expect("write request");
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("read line");
        line.strip_suffix("\r\n")
            .unwrap_or_else(|| panic!("line without CRLF: {line:?}"))
            .to_string()
    }

    fn read_head(&mut self) -> (u16, Vec<(String, String)>) {
        let status_line = self.line();
        let status = status_line
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let mut headers = Vec::new();
        loop {
            let line = self.line();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').expect("header colon");
            headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
        }
        (status, headers)
    }

    /// Reads one chunk's data; `None` at the last (zero) chunk.
    fn read_chunk(&mut self) -> Option<Vec<u8>> {
        let size_line = self.line();
        let size_hex = size_line.split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size_hex.trim(), 16).expect("chunk size");
        if size == 0 {
            while !self.line().is_empty() {}
            return None;
        }
        let mut data = vec![0; size + 2];
        self.reader.read_exact(&mut data).expect("chunk data");
        assert_eq!(&data[size..], b"\r\n", "chunk not followed by CRLF");
        data.truncate(size);
        Some(data)
    }

    fn read_response(&mut self) -> Response {
        let (status, headers) = self.read_head();
        let mut response = Response {
            status,
            headers,
            body: Vec::new(),
            chunks: None,
        };
        if response.header("transfer-encoding") == Some("chunked") {
            let mut chunks = Vec::new();
            while let Some(chunk) = self.read_chunk() {
                response.body.extend_from_slice(&chunk);
                chunks.push(chunk);
            }
            response.chunks = Some(chunks);
        } else {
            let length: usize = response
                .header("content-length")
                .expect("content-length or chunked")
                .parse()
                .expect("numeric content-length");
            response.body = vec![0; length];
            self.reader
                .read_exact(&mut response.body)
                .expect("read body");
        }
        response
    }

    fn request(&mut self, raw: &[u8]) -> Response {
        self.send(raw);
        self.read_response()
    }
}

fn post(path: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: mock\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: mock\r\n\r\n").into_bytes()
}

/// Removes the per-request fields (`id`, `iop_mock_sent_ns`) after checking
/// their shape; returns them.
fn strip_volatile(value: &mut Value) -> (String, u64) {
    let object = value.as_object_mut().expect("JSON object");
    let id = object
        .remove("id")
        .and_then(|id| id.as_str().map(str::to_string))
        .expect("string id");
    assert!(id.starts_with("chatcmpl-mock-"), "id {id}");
    let sent_ns = object
        .remove("iop_mock_sent_ns")
        .and_then(|ns| ns.as_u64())
        .expect("u64 iop_mock_sent_ns");
    assert!(sent_ns > 0);
    (id, sent_ns)
}

/// Splits a streamed response into its events, asserting each HTTP chunk is
/// exactly one `data: …\n\n` event; returns the data payloads.
fn sse_payloads(response: &Response) -> Vec<String> {
    let chunks = response.chunks.as_ref().expect("chunked stream");
    chunks
        .iter()
        .map(|chunk| {
            let text = std::str::from_utf8(chunk).expect("utf-8 event");
            let payload = text
                .strip_prefix("data: ")
                .and_then(|rest| rest.strip_suffix("\n\n"))
                .unwrap_or_else(|| panic!("chunk is not one SSE event: {text:?}"));
            assert!(!payload.contains('\n'), "one event per chunk: {text:?}");
            payload.to_string()
        })
        .collect()
}

/// Parses every payload but the final `[DONE]`, checks the ids agree and the
/// send stamps never go backwards, and returns the chunks without them.
fn stream_chunks(payloads: &[String]) -> Vec<Value> {
    let (done, events) = payloads.split_last().expect("non-empty stream");
    assert_eq!(done, "[DONE]");
    let mut first_id = None;
    let mut last_ns = 0;
    events
        .iter()
        .map(|payload| {
            let mut value: Value = serde_json::from_str(payload).expect("JSON chunk");
            let (id, sent_ns) = strip_volatile(&mut value);
            assert_eq!(first_id.get_or_insert_with(|| id.clone()), &id);
            assert!(sent_ns >= last_ns, "send stamps go backwards");
            last_ns = sent_ns;
            value
        })
        .collect()
}

fn chunk(model: &str, delta: Value, finish: Value, usage: Option<Value>) -> Value {
    let mut value = json!({
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
    });
    if let Some(usage) = usage {
        value["usage"] = usage;
    }
    value
}

#[test]
fn serves_models_stream_and_completion_on_one_keep_alive_connection() {
    let mut mock = MockProcess::spawn(&["--tokens", "3", "--model-list", "a, b"]);
    let mut client = mock.connect();

    let models = client.request(&get("/v1/models"));
    assert_eq!(models.status, 200);
    assert_eq!(models.header("content-type"), Some("application/json"));
    assert_eq!(
        std::str::from_utf8(&models.body).expect("utf-8"),
        concat!(
            r#"{"object":"list","data":["#,
            r#"{"id":"a","object":"model","created":1700000000,"owned_by":"mock"},"#,
            r#"{"id":"b","object":"model","created":1700000000,"owned_by":"mock"}]}"#
        )
    );

    let stream = client.request(&post(
        "/v1/chat/completions",
        r#"{"model":"m-stream","stream":true,"stream_options":{"include_usage":true},
            "messages":[{"role":"user","content":"hello big world"}]}"#,
    ));
    assert_eq!(stream.status, 200);
    assert_eq!(stream.header("content-type"), Some("text/event-stream"));
    assert_eq!(stream.header("content-length"), None);
    let payloads = sse_payloads(&stream);
    let null = Value::Null;
    assert_eq!(
        stream_chunks(&payloads),
        vec![
            chunk(
                "m-stream",
                json!({"role": "assistant", "content": ""}),
                null.clone(),
                Some(null.clone())
            ),
            chunk(
                "m-stream",
                json!({"content": "tok0 "}),
                null.clone(),
                Some(null.clone())
            ),
            chunk(
                "m-stream",
                json!({"content": "tok1 "}),
                null.clone(),
                Some(null.clone())
            ),
            chunk(
                "m-stream",
                json!({"content": "tok2 "}),
                null.clone(),
                Some(null.clone())
            ),
            chunk("m-stream", json!({}), json!("stop"), Some(null.clone())),
            json!({
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": "m-stream",
                "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            }),
        ]
    );

    // The same connection serves the next request.
    let completion = client.request(&post(
        "/v1/chat/completions",
        r#"{"model":"m-plain","messages":[{"role":"system","content":"one"},{"role":"user","content":"two three four"}]}"#,
    ));
    assert_eq!(completion.status, 200);
    assert_eq!(completion.header("content-type"), Some("application/json"));
    let mut body = completion.json();
    strip_volatile(&mut body);
    assert_eq!(
        body,
        json!({
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": "m-plain",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "tok0 tok1 tok2 "},
                "logprobs": null,
                "finish_reason": "stop",
            }],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        })
    );

    let status = mock.stop_with(Signal::SIGTERM);
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

#[test]
fn max_tokens_caps_a_stream_without_usage_and_ends_with_length() {
    let mut mock = MockProcess::spawn(&["--tokens", "5"]);
    let mut client = mock.connect();
    let stream = client.request(&post(
        "/v1/chat/completions",
        r#"{"model":"capped","stream":true,"max_tokens":1,"messages":[]}"#,
    ));
    assert_eq!(stream.status, 200);
    let payloads = sse_payloads(&stream);
    assert_eq!(
        stream_chunks(&payloads),
        vec![
            chunk(
                "capped",
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                None
            ),
            chunk("capped", json!({"content": "tok0 "}), Value::Null, None),
            chunk("capped", json!({}), json!("length"), None),
        ]
    );
    let status = mock.stop_with(Signal::SIGINT);
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

#[test]
fn bad_requests_get_openai_errors_and_chunked_bodies_are_read() {
    let mut mock = MockProcess::spawn(&[]);
    let mut client = mock.connect();

    let malformed = client.request(&post("/v1/chat/completions", "{not json"));
    assert_eq!(malformed.status, 400);
    assert_eq!(malformed.header("content-type"), Some("application/json"));
    let error = malformed.json();
    let message = error["error"]["message"].as_str().expect("message");
    assert!(
        message.starts_with("invalid chat completion request body: "),
        "{message}"
    );
    assert_eq!(
        error,
        json!({"error": {
            "message": message,
            "type": "invalid_request_error",
            "param": null,
            "code": null,
        }})
    );

    // The connection survives a rejected body.
    let unknown = client.request(&get("/v1/engines"));
    assert_eq!(unknown.status, 404);
    assert_eq!(
        std::str::from_utf8(&unknown.body).expect("utf-8"),
        r#"{"error":{"message":"Invalid URL (GET /v1/engines)","type":"invalid_request_error","param":null,"code":null}}"#
    );

    // A chunked request body, split mid-JSON, is reassembled.
    let first = r#"{"model":"chunky","max_tokens":2,"#;
    let second = r#""messages":[{"role":"user","content":"a b"}]}"#;
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: mock\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{first}\r\n{:x}\r\n{second}\r\n0\r\n\r\n",
        first.len(),
        second.len()
    );
    let completion = client.request(raw.as_bytes());
    assert_eq!(completion.status, 200);
    let body = completion.json();
    assert_eq!(body["model"], "chunky");
    assert_eq!(body["choices"][0]["message"]["content"], "tok0 tok1 ");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4})
    );

    // Broken HTTP framing is answered in the same error shape, and the
    // connection is closed.
    let mut broken = mock.connect();
    let response = broken.request(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: mock\r\nContent-Length: ten\r\n\r\n",
    );
    assert_eq!(response.status, 400);
    assert_eq!(response.header("connection"), Some("close"));
    assert_eq!(
        std::str::from_utf8(&response.body).expect("utf-8"),
        r#"{"error":{"message":"invalid or conflicting Content-Length","type":"invalid_request_error","param":null,"code":null}}"#
    );
    let mut rest = Vec::new();
    broken.reader.read_to_end(&mut rest).expect("read to EOF");
    assert!(rest.is_empty(), "bytes after the error: {rest:?}");

    let status = mock.stop_with(Signal::SIGTERM);
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

#[test]
fn sigterm_during_a_paced_stream_exits_zero() {
    // A one-hour pause after the first token: the stream cannot finish
    // before the signal, so this proves shutdown does not wait for open
    // streams, and reading `tok0` at all proves each event is flushed as it
    // is produced (not held until the stream ends).
    let mut mock = MockProcess::spawn(&["--ttft-ms", "1", "--inter-token-ms", "3600000"]);
    let mut client = mock.connect();
    client.send(&post(
        "/v1/chat/completions",
        r#"{"model":"slow","stream":true,"messages":[]}"#,
    ));
    let (status, _headers) = client.read_head();
    assert_eq!(status, 200);
    let role = client.read_chunk().expect("role chunk");
    assert!(std::str::from_utf8(&role)
        .expect("utf-8")
        .contains(r#""delta":{"role":"assistant","content":""}"#));
    let first = client.read_chunk().expect("first token chunk");
    let payload = std::str::from_utf8(&first)
        .expect("utf-8")
        .strip_prefix("data: ")
        .and_then(|rest| rest.strip_suffix("\n\n"))
        .expect("one SSE event");
    let mut value: Value = serde_json::from_str(payload).expect("JSON chunk");
    strip_volatile(&mut value);
    assert_eq!(
        value,
        chunk("slow", json!({"content": "tok0 "}), Value::Null, None)
    );

    let status = mock.stop_with(Signal::SIGTERM);
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

#[test]
fn close_after_requests_closes_a_keep_alive_connection_without_notice() {
    let mut mock = MockProcess::spawn(&["--tokens", "2", "--close-after-requests", "2"]);
    let mut client = mock.connect();
    for _ in 0..2 {
        let response = client.request(&post(
            "/v1/chat/completions",
            r#"{"model":"m","stream":true,"messages":[]}"#,
        ));
        assert_eq!(response.status, 200);
        // Nothing announces the close: the reply looks keep-alive.
        assert_eq!(response.header("connection"), None);
        assert_eq!(
            sse_payloads(&response).last().map(String::as_str),
            Some("[DONE]")
        );
    }
    // After its second request the connection is closed: EOF, no bytes.
    let mut rest = Vec::new();
    client.reader.read_to_end(&mut rest).expect("read to EOF");
    assert!(rest.is_empty(), "bytes after the close: {rest:?}");
    // A new connection is served again.
    let models = mock.connect().request(&get("/v1/models"));
    assert_eq!(models.status, 200);

    let status = mock.stop_with(Signal::SIGTERM);
    assert_eq!(status.code(), Some(0), "exit status {status:?}");

    let refused = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args([
            "mock-provider",
            "--port",
            "0",
            "--close-after-requests",
            "0",
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run bench");
    assert_eq!(refused.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&refused.stderr).trim_end(),
        "bench mock-provider: --close-after-requests: must be at least 1"
    );
}

/// The chat request of a two-message conversation, streamed.
fn conversation(system: &str, user: &str) -> Vec<u8> {
    post(
        "/v1/chat/completions",
        &json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
        .to_string(),
    )
}

/// `(prompt_tokens_seen, cached_tokens_hit)` of `/admin/stats`.
fn prefix_counters(client: &mut Client) -> (u64, u64) {
    let stats = client.request(&get("/admin/stats")).json();
    (
        stats["prompt_tokens_seen"]
            .as_u64()
            .expect("prompt_tokens_seen"),
        stats["cached_tokens_hit"]
            .as_u64()
            .expect("cached_tokens_hit"),
    )
}

/// The `usage.prompt_tokens` of a streamed reply with `include_usage`.
fn streamed_prompt_tokens(response: &Response) -> u64 {
    assert_eq!(response.status, 200);
    let chunks = stream_chunks(&sse_payloads(response));
    let usage = chunks.last().expect("a usage chunk")["usage"].clone();
    usage["prompt_tokens"].as_u64().expect("prompt_tokens")
}

#[test]
fn prefix_cache_counts_the_shared_prefix_of_a_second_request() {
    let mut mock = MockProcess::spawn(&[
        "--tokens",
        "2",
        "--prefix-cache-tokens",
        "1000",
        "--prefill-us-per-token",
        "100",
    ]);
    let mut client = mock.connect();
    let system: String = (0..200).map(|i| format!("sys{i} ")).collect();
    assert_eq!(prefix_counters(&mut client), (0, 0));

    let first = client.request(&conversation(&system, "alpha beta"));
    assert_eq!(streamed_prompt_tokens(&first), 202);
    assert_eq!(prefix_counters(&mut client), (202, 0));

    // Only "gamma delta epsilon" is prefilled: the 200 system words hit.
    let second = client.request(&conversation(&system, "gamma delta epsilon"));
    assert_eq!(streamed_prompt_tokens(&second), 203);
    assert_eq!(prefix_counters(&mut client), (202 + 203, 200));

    // The same conversation again on a new connection: all of it is cached.
    let mut other = mock.connect();
    let third = other.request(&conversation(&system, "gamma delta epsilon"));
    assert_eq!(streamed_prompt_tokens(&third), 203);
    assert_eq!(prefix_counters(&mut other), (202 + 203 + 203, 200 + 203));

    let status = mock.stop_with(Signal::SIGTERM);
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

#[test]
fn without_prefix_cache_options_the_counters_stay_zero() {
    let mut mock = MockProcess::spawn(&["--tokens", "2"]);
    let mut client = mock.connect();
    let system: String = (0..200).map(|i| format!("sys{i} ")).collect();
    for (user, words) in [
        ("alpha beta", 202),
        ("gamma delta epsilon", 203),
        ("gamma delta epsilon", 203),
    ] {
        let response = client.request(&conversation(&system, user));
        assert_eq!(streamed_prompt_tokens(&response), words);
    }
    assert_eq!(prefix_counters(&mut client), (0, 0));
    let status = mock.stop_with(Signal::SIGTERM);
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

/// `GET /admin/stats` as JSON.
fn stats(client: &mut Client) -> Value {
    let response = client.request(&get("/admin/stats"));
    assert_eq!(response.status, 200);
    response.json()
}

fn text(response: &Response) -> &str {
    std::str::from_utf8(&response.body).expect("utf-8 body")
}

#[test]
fn text_completions_echo_the_model_and_mark_the_suffix_plain_and_streamed() {
    let mock = MockProcess::spawn(&["--tokens", "3"]);
    let mut client = mock.connect();

    let plain = client.request(&post(
        "/v1/completions",
        r#"{"model":"target-a","prompt":["one two","three"],"suffix":"}\n","max_tokens":2}"#,
    ));
    assert_eq!(plain.status, 200);
    assert_eq!(plain.header("content-type"), Some("application/json"));
    assert_eq!(
        text(&plain),
        concat!(
            r#"{"id":"cmpl-mock-1","object":"text_completion","created":1700000000,"model":"target-a","#,
            r#""choices":[{"index":0,"text":"tok0 tok1 [suffix:2]","finish_reason":"length","logprobs":null}],"#,
            r#""usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#
        )
    );

    let stream = client.request(&post(
        "/v1/completions",
        r#"{"model":"target-b","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}"#,
    ));
    assert_eq!(stream.status, 200);
    assert_eq!(stream.header("content-type"), Some("text/event-stream"));
    let head = r#"{"id":"cmpl-mock-2","object":"text_completion","created":1700000000,"model":"target-b","choices":"#;
    let token = |t: &str| {
        format!(
            r#"{head}[{{"index":0,"text":"{t}","finish_reason":null,"logprobs":null}}],"usage":null}}"#
        )
    };
    assert_eq!(
        sse_payloads(&stream),
        vec![
            token("tok0 "),
            token("tok1 "),
            token("tok2 "),
            format!(
                r#"{head}[{{"index":0,"text":"","finish_reason":"stop","logprobs":null}}],"usage":null}}"#
            ),
            format!(
                r#"{head}[],"usage":{{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}}}}"#
            ),
            "[DONE]".to_string(),
        ]
    );

    let bad = client.request(&post("/v1/completions", r#"{"model":"m","prompt":[1]}"#));
    assert_eq!(bad.status, 400);
    assert_eq!(
        text(&bad),
        r#"{"error":{"message":"prompt must be a string or an array of strings","type":"invalid_request_error","param":null,"code":null}}"#
    );
    assert_eq!(stats(&mut client)["completions_requests"], 3);
}

#[test]
fn embeddings_are_deterministic_in_float_base64_and_ollama_shapes() {
    use bench::mock::embeddings::{base64_vector, EmbedInput};

    let mock = MockProcess::spawn(&[]);
    let mut client = mock.connect();
    let a = EmbedInput::Text("alpha beta".into()).vector(3);
    let b = EmbedInput::Text("gamma".into()).vector(3);

    // Vectors are written as `f32`s in their shortest form.
    let list = |v: &[f32]| serde_json::to_string(v).expect("f32 list");
    let float = client.request(&post(
        "/v1/embeddings",
        r#"{"model":"embed-x","input":["alpha beta","gamma"],"dimensions":3}"#,
    ));
    assert_eq!(float.status, 200);
    assert_eq!(
        text(&float),
        format!(
            concat!(
                r#"{{"object":"list","data":[{{"object":"embedding","index":0,"embedding":{}}},"#,
                r#"{{"object":"embedding","index":1,"embedding":{}}}],"model":"embed-x","#,
                r#""usage":{{"prompt_tokens":3,"total_tokens":3}}}}"#
            ),
            list(&a),
            list(&b)
        )
    );
    // The same request gives the same bytes; every component is in [-1, 1).
    let again = client.request(&post(
        "/v1/embeddings",
        r#"{"model":"embed-x","input":["alpha beta","gamma"],"dimensions":3}"#,
    ));
    assert_eq!(again.body, float.body);
    assert!(a.iter().chain(&b).all(|x| (-1.0..1.0).contains(x)));
    assert_ne!(a, b);

    let encoded = client.request(&post(
        "/v1/embeddings",
        r#"{"model":"embed-x","input":"alpha beta","dimensions":3,"encoding_format":"base64"}"#,
    ));
    assert_eq!(encoded.status, 200);
    let data = &encoded.json()["data"][0]["embedding"];
    assert_eq!(data, &json!(base64_vector(&a)));
    // 3 little-endian f32s = 12 bytes = 16 base64 characters.
    assert_eq!(data.as_str().map(str::len), Some(16));

    let ids = client.request(&post(
        "/v1/embeddings",
        r#"{"model":"e","input":[[7,8,9],[10]]}"#,
    ));
    assert_eq!(ids.status, 200);
    let ids = ids.json();
    assert_eq!(ids["usage"], json!({"prompt_tokens": 4, "total_tokens": 4}));
    assert_eq!(
        ids["data"][1]["embedding"].to_string(),
        list(&EmbedInput::Ids(vec![10]).vector(8))
    );

    let ollama = client.request(&post(
        "/api/embed",
        r#"{"model":"embed-x","input":["alpha beta","gamma"],"dimensions":3}"#,
    ));
    assert_eq!(ollama.status, 200);
    assert_eq!(
        text(&ollama),
        format!(
            r#"{{"model":"embed-x","embeddings":[{},{}],"prompt_eval_count":3}}"#,
            list(&a),
            list(&b)
        )
    );

    let bad = client.request(&post("/v1/embeddings", r#"{"model":"e","input":[]}"#));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["message"], "input must not be empty");

    let counters = stats(&mut client);
    assert_eq!(counters["embeddings_requests"], 5);
    assert_eq!(counters["ollama_embed_requests"], 1);
}

#[test]
fn rerank_and_score_are_word_overlap_exact() {
    let mock = MockProcess::spawn(&[]);
    let mut client = mock.connect();
    let body = r#"{"model":"rr","query":"red apple","documents":["green pear","red apple pie","apple"],"top_n":2,"return_documents":true}"#;
    for (seq, path) in [(1, "/v1/rerank"), (2, "/v2/rerank")] {
        let rerank = client.request(&post(path, body));
        assert_eq!(rerank.status, 200, "{path}");
        // "red apple" vs "red apple pie": 2 shared of 3; vs "apple": 1 of 2.
        assert_eq!(
            text(&rerank),
            format!(
                concat!(
                    r#"{{"id":"rerank-mock-{}","model":"rr","results":["#,
                    r#"{{"index":1,"relevance_score":0.6666666666666666,"document":{{"text":"red apple pie"}}}},"#,
                    r#"{{"index":2,"relevance_score":0.5,"document":{{"text":"apple"}}}}],"#,
                    r#""usage":{{"total_tokens":8}}}}"#
                ),
                seq
            )
        );
    }

    let score = client.request(&post(
        "/v1/score",
        r#"{"model":"sc","text_1":"a b","text_2":["a b","b c","d"]}"#,
    ));
    assert_eq!(score.status, 200);
    assert_eq!(
        text(&score),
        concat!(
            r#"{"id":"score-mock-3","object":"list","created":1700000000,"model":"sc","data":["#,
            r#"{"index":0,"object":"score","score":1.0},"#,
            r#"{"index":1,"object":"score","score":0.3333333333333333},"#,
            r#"{"index":2,"object":"score","score":0.0}],"#,
            r#""usage":{"prompt_tokens":11,"total_tokens":11,"completion_tokens":0}}"#
        )
    );
    let bad = client.request(&post(
        "/v1/score",
        r#"{"model":"sc","text_1":["a","b"],"text_2":["a","b","c"]}"#,
    ));
    assert_eq!(bad.status, 400);
    assert_eq!(
        bad.json()["error"]["message"],
        "text_1 has 2 texts and text_2 3: they must be as many, or text_1 one"
    );

    let counters = stats(&mut client);
    assert_eq!(counters["rerank_requests"], 2);
    assert_eq!(counters["score_requests"], 2);
}

#[test]
fn tokenize_then_detokenize_round_trips_through_the_process_vocabulary() {
    use bench::mock::tokenize::token_id;

    let mock = MockProcess::spawn(&[]);
    let mut client = mock.connect();
    let ids = [token_id("the"), token_id("quick"), token_id("fox")];

    let tokens = client.request(&post(
        "/tokenize",
        r#"{"model":"tk","prompt":"the quick  fox"}"#,
    ));
    assert_eq!(tokens.status, 200);
    assert_eq!(
        tokens.json(),
        json!({"count": 3, "max_model_len": 32768, "tokens": ids})
    );

    let words = client.request(&post(
        "/detokenize",
        &format!(
            r#"{{"model":"tk","tokens":[{},{},50000,{}]}}"#,
            ids[2], ids[0], ids[1]
        ),
    ));
    assert_eq!(words.status, 200);
    assert_eq!(text(&words), r#"{"prompt":"fox the <unk:50000> quick"}"#);

    let counters = stats(&mut client);
    assert_eq!(counters["tokenize_requests"], 1);
    assert_eq!(counters["detokenize_requests"], 1);
}

/// A `multipart/form-data` request with boundary `mockb`.
fn multipart(path: &str, parts: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, filename, value) in parts {
        body.extend_from_slice(
            format!("--mockb\r\nContent-Disposition: form-data; name=\"{name}\"").as_bytes(),
        );
        if let Some(filename) = filename {
            body.extend_from_slice(
                format!("; filename=\"{filename}\"\r\nContent-Type: audio/wav").as_bytes(),
            );
        }
        body.extend_from_slice(b"\r\n\r\n");
        body.extend_from_slice(value);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"--mockb--\r\n");
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: mock\r\nContent-Type: multipart/form-data; boundary=mockb\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(&body);
    raw
}

#[test]
fn audio_uploads_are_parsed_counted_and_answered_per_format() {
    use bench::mock::digest::fnv1a;

    let mock = MockProcess::spawn(&[]);
    let mut client = mock.connect();
    // Binary audio with CR, LF and boundary-like runs (a delimiter needs
    // CRLF right before `--mockb`).
    let audio: Vec<u8> = (0..=255u8).chain(*b"\r\n--mock\r\nx--mockb--").collect();
    let hash = format!("{:016x}", fnv1a(&audio));

    let json_reply = client.request(&multipart(
        "/v1/audio/transcriptions",
        &[
            ("file", Some("clip.wav"), &audio),
            ("model", None, b"whisper-1"),
            ("language", None, b"en"),
        ],
    ));
    assert_eq!(json_reply.status, 200);
    assert_eq!(json_reply.header("content-type"), Some("application/json"));
    assert_eq!(
        text(&json_reply),
        format!(
            r#"{{"text":"transcript of {} bytes {}"}}"#,
            audio.len(),
            &hash[..8]
        )
    );

    let text_reply = client.request(&multipart(
        "/v1/audio/translations",
        &[
            ("model", None, b"whisper-2"),
            ("response_format", None, b"text"),
            ("file", Some("b.wav"), b"abc"),
        ],
    ));
    assert_eq!(text_reply.status, 200);
    assert_eq!(
        text_reply.header("content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(
        text(&text_reply),
        format!(
            "translation of 3 bytes {}",
            &format!("{:016x}", fnv1a(b"abc"))[..8]
        )
    );

    let counters = stats(&mut client);
    assert_eq!(counters["transcription_requests"], 1);
    assert_eq!(counters["translation_requests"], 1);
    assert_eq!(counters["audio_file_bytes"], audio.len() + 3);
    assert_eq!(
        counters["last_audio"],
        json!({
            "model": "whisper-2",
            "filename": "b.wav",
            "file_bytes": 3,
            "file_hash": format!("{:016x}", fnv1a(b"abc")),
            "response_format": "text",
            "language": null,
        })
    );

    // No boundary, and a body cut before its closing delimiter: 400s that
    // say why, and the connection goes on.
    let no_boundary = client.request(
        b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: mock\r\nContent-Type: multipart/form-data\r\nContent-Length: 2\r\n\r\n--",
    );
    assert_eq!(no_boundary.status, 400);
    assert_eq!(
        text(&no_boundary),
        r#"{"error":{"message":"multipart content-type has no boundary parameter","type":"invalid_request_error","param":null,"code":null}}"#
    );
    let mut cut = multipart(
        "/v1/audio/transcriptions",
        &[("file", Some("c.wav"), b"xyz"), ("model", None, b"w")],
    );
    cut.truncate(cut.len() - "--mockb--\r\n".len());
    let cut_len = cut.len();
    // Fix the Content-Length to the shortened body.
    let raw = String::from_utf8(cut).expect("ascii request");
    let (head, body) = raw.split_once("\r\n\r\n").expect("head");
    let old_length = format!("Content-Length: {}", body.len() + "--mockb--\r\n".len());
    let head = head.replace(&old_length, &format!("Content-Length: {}", body.len()));
    assert!(cut_len > head.len());
    let truncated = client.request(format!("{head}\r\n\r\n{body}").as_bytes());
    assert_eq!(truncated.status, 400);
    assert_eq!(
        truncated.json()["error"]["message"],
        "multipart body truncated: no closing boundary delimiter"
    );
    let counters = stats(&mut client);
    assert_eq!(counters["transcription_requests"], 3);
    assert_eq!(counters["audio_file_bytes"], audio.len() + 3);
}

#[test]
fn speech_is_binary_deterministic_and_typed_by_format() {
    use bench::mock::audio::speech_bytes;

    let mock = MockProcess::spawn(&[]);
    let mut client = mock.connect();
    let mp3 = client.request(&post(
        "/v1/audio/speech",
        r#"{"model":"tts-1","input":"hello there","voice":"alloy"}"#,
    ));
    assert_eq!(mp3.status, 200);
    assert_eq!(mp3.header("content-type"), Some("audio/mpeg"));
    let expected = speech_bytes("mp3", "hello there");
    assert_eq!(&expected[..12], b"IOPMOCK mp3\n");
    assert_eq!(expected.len(), 12 + 11 * 32);
    assert_eq!(mp3.header("content-length"), Some("364"));
    assert_eq!(mp3.body, expected);

    let wav = client.request(&post(
        "/v1/audio/speech",
        r#"{"model":"tts-1","input":"hello there","voice":"alloy","response_format":"wav"}"#,
    ));
    assert_eq!(wav.header("content-type"), Some("audio/wav"));
    assert_eq!(&wav.body[..12], b"IOPMOCK wav\n");
    // Same input, same audio after the header.
    assert_eq!(wav.body[12..], mp3.body[12..]);

    let bad = client.request(&post(
        "/v1/audio/speech",
        r#"{"model":"tts-1","input":"x"}"#,
    ));
    assert_eq!(bad.status, 400);
    assert_eq!(
        bad.json()["error"]["message"],
        "voice is required (a string)"
    );
    assert_eq!(stats(&mut client)["speech_requests"], 3);
}

#[test]
fn a_model_is_found_by_id_only_when_listed() {
    let mock = MockProcess::spawn(&["--model-list", "alpha,beta"]);
    let mut client = mock.connect();
    let found = client.request(&get("/v1/models/beta"));
    assert_eq!(found.status, 200);
    assert_eq!(
        text(&found),
        r#"{"id":"beta","object":"model","created":1700000000,"owned_by":"mock"}"#
    );
    let missing = client.request(&get("/v1/models/gamma"));
    assert_eq!(missing.status, 404);
    assert_eq!(
        text(&missing),
        r#"{"error":{"message":"The model 'gamma' does not exist","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#
    );
    assert_eq!(stats(&mut client)["model_requests"], 2);
}
