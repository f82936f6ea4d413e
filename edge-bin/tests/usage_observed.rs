//! Usage of a streamed chat completion is observed whether or not the
//! client asked for it: client HTTP → Edge → real Node → a recording TCP
//! proxy → the `bench` mock provider, over real loopback sockets.
//!
//! What is proven, byte for byte: a client that did not ask for usage has
//! the provider asked for it (`stream_options.include_usage` spliced into
//! its body, nothing else changed), gets exactly the provider's bytes
//! without the usage-only event, and its key's token limit and its usage
//! record are charged the provider's real counts. A client that asked gets
//! every byte the provider sent; a request that does not stream goes to
//! the provider as the client wrote it. A node of before stripping is
//! asked nothing. The normalized (Ollama) path reports usage from its
//! run's `complete` event already. Embeddings and text completions are
//! charged and recorded the same way.

mod common;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;

use common::*;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt, Splitable};
use monoio::net::{TcpListener, TcpStream};
use node_bin::config::NodeConfig;
use node_bin::supervisor::{self, Exit};
use serde_json::{json, Value};

const KEY_LIMITED: &str = "sk-usage-limited-4f0c2a9e7d1b";
const KEY_FREE: &str = "sk-usage-free-9a3e6b1c0d57";
/// A second key with the token budget, for embeddings.
const KEY_EMBED: &str = "sk-usage-embed-71d0e4b2c8a3";
/// Tokens the mock streams per completion.
const TOKENS: u32 = 1500;
/// The limited key's budget: far below one completion, far above the
/// estimate of its small request body (so the first request is admitted
/// and, charged its real usage, the key waits many minutes).
const TOKENS_PER_MINUTE: u32 = 100;
/// The prompt every request sends: three words (the mock's prompt count).
const PROMPT: &str = "say three words";

/// A TCP proxy in front of the provider that keeps every byte each way.
struct Recorder {
    addr: SocketAddr,
    /// Bytes the provider received (requests).
    to_provider: Rc<RefCell<Vec<u8>>>,
    /// Bytes the provider sent (responses).
    from_provider: Rc<RefCell<Vec<u8>>>,
    service: Service,
}

impl Recorder {
    fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the recorder");
        let addr = listener.local_addr().expect("recorder address");
        let to_provider = Rc::new(RefCell::new(Vec::new()));
        let from_provider = Rc::new(RefCell::new(Vec::new()));
        let (up, down) = (to_provider.clone(), from_provider.clone());
        let service = Service::spawn(move |stopped| async move {
            let accept = async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    let provider = TcpStream::connect(upstream).await.expect("dial the mock");
                    let (client_r, client_w) = client.into_split();
                    let (provider_r, provider_w) = provider.into_split();
                    monoio::spawn(pipe(client_r, provider_w, up.clone()));
                    monoio::spawn(pipe(provider_r, client_w, down.clone()));
                }
            };
            monoio::select! {
                () = accept => {}
                () = stopped => {}
            }
        });
        Self {
            addr,
            to_provider,
            from_provider,
            service,
        }
    }

    /// The one request the provider received since the last call: its body.
    fn take_request_body(&self) -> Vec<u8> {
        let raw = std::mem::take(&mut *self.to_provider.borrow_mut());
        let head_end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a request head");
        let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .expect("a content-length")
            .trim()
            .parse()
            .expect("a number");
        let body = raw[head_end + 4..].to_vec();
        assert_eq!(body.len(), len, "exactly one request");
        body
    }

    /// The one response the provider sent since the last call, de-chunked.
    fn take_response(&self) -> HttpResponse {
        parse_response(&std::mem::take(&mut *self.from_provider.borrow_mut()))
    }

    async fn stop(self) {
        self.service.stop().await;
    }
}

async fn pipe<R: AsyncReadRent, W: AsyncWriteRent>(
    mut from: R,
    mut to: W,
    record: Rc<RefCell<Vec<u8>>>,
) {
    loop {
        let (res, buf) = from.read(Vec::with_capacity(16 * 1024)).await;
        match res {
            Ok(n) if n > 0 => {
                record.borrow_mut().extend_from_slice(&buf);
                let (res, _) = to.write_all(buf).await;
                if res.is_err() {
                    return;
                }
            }
            _ => {
                let _ = to.shutdown().await;
                return;
            }
        }
    }
}

/// The Edge config: node-a's adapter behind `provider`, two keys (one
/// with a token budget), the usage file at `usage_path`, and node-c
/// serving [`OLLAMA_MODEL`] through an Ollama adapter on `ollama`.
fn config(pki: &Pki, provider: SocketAddr, ollama: SocketAddr, usage_path: &str) -> String {
    let key = |principal: &str, key: &str, extra: &str| {
        format!(
            "[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\n{extra}\n",
            blake3::hash(key.as_bytes()).to_hex()
        )
    };
    let extra = format!(
        "{}{}\
         [edge.usage_log]\npath = \"{usage_path}\"\n\n\
         [[nodes]]\nid = \"node-c\"\n\
         [[nodes.adapters]]\nname = \"ollama\"\nkind = \"ollama\"\nbase_url = \"http://{ollama}\"\n\
         [[nodes.providers]]\nid = \"c-ollama\"\nadapter = \"ollama\"\ntarget = \"{TARGET}\"\ncapacity = 2\n\n\
         [[models]]\nname = \"{OLLAMA_MODEL}\"\nproviders = [\"node-c/c-ollama\"]\n",
        key(
            "team-limited",
            KEY_LIMITED,
            &format!("tokens_per_minute = {TOKENS_PER_MINUTE}")
        ),
        key("team-free", KEY_FREE, ""),
    ) + &key(
        "team-embed",
        KEY_EMBED,
        &format!("tokens_per_minute = {TOKENS_PER_MINUTE}"),
    );
    edge_toml(
        pki,
        &EdgeOptions {
            extra_toml: extra,
            // The node's counters are read before and after a request:
            // every scrape pulls them fresh.
            edge_keys: "node_metrics_max_age_ms = 0\n".into(),
            ..EdgeOptions::new(provider)
        },
    )
}

/// The external model node-c serves through Ollama.
const OLLAMA_MODEL: &str = "chat-model-ollama";

/// A real node `node_id` dialling `edge`; stop it with the sender.
async fn start_node(
    pki: &Pki,
    edge: &TestEdge,
    node_id: &str,
) -> (
    iop_engine::sync::oneshot::Sender<()>,
    monoio::task::JoinHandle<Exit>,
) {
    let cfg = NodeConfig::parse(
        &node_toml(pki, node_id, edge.node_addr),
        pki.dir.join(format!("{node_id}.toml")),
    )
    .expect("node config");
    let (stop, stopped) = iop_engine::sync::oneshot::channel::<()>();
    let node = monoio::spawn(supervisor::run(
        cfg,
        Some(pki.connector(node_id)),
        Box::pin(async move {
            let _ = stopped.await;
        }),
    ));
    // `/status` wants a key here: ask Control directly.
    while edge.edge.control().ready_conn(node_id).is_none() {
        monoio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    (stop, node)
}

fn chat_request(key: &str, body: &str) -> Vec<u8> {
    post_request("/v1/chat/completions", key, body)
}

/// A `POST path` with `key` and the JSON `body`.
fn post_request(path: &str, key: &str, body: &str) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
         authorization: Bearer {key}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

/// The usage-only event of an SSE body, by its exact bytes.
fn usage_event(body: &[u8]) -> String {
    let text = std::str::from_utf8(body).expect("UTF-8");
    let events: Vec<&str> = text
        .split_inclusive("\n\n")
        .filter(|e| e.contains("\"choices\":[],\"usage\":{"))
        .collect();
    assert_eq!(events.len(), 1, "one usage event in {text:?}");
    events[0].to_string()
}

/// Every record of the usage file, without its timing fields.
fn usage_records(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("the usage file")
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            let object = v.as_object_mut().expect("an object");
            object.remove("ts");
            object.remove("duration_ms");
            v
        })
        .collect()
}

fn record(id: &str, principal: &str, model: &str, provider: &str, tokens: (u64, u64)) -> Value {
    record_of(
        "/v1/chat/completions",
        id,
        principal,
        model,
        provider,
        tokens,
    )
}

/// The usage record of a completed request to `path`.
fn record_of(
    path: &str,
    id: &str,
    principal: &str,
    model: &str,
    provider: &str,
    tokens: (u64, u64),
) -> Value {
    let node = provider.split('/').next().unwrap_or_default();
    json!({
        "request_id": id, "principal": principal, "path": path,
        "model": model, "provider": provider, "node": node, "status": 200,
        "outcome": "completed", "attempts": 1, "usage": "reported",
        "prompt_tokens": tokens.0, "completion_tokens": tokens.1,
        "total_tokens": tokens.0 + tokens.1,
    })
}

fn with_id(mut request: Vec<u8>, id: &str) -> Vec<u8> {
    let at = request
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let header = format!("\r\nx-request-id: {id}");
    request.splice(at..at, header.into_bytes());
    request
}

#[monoio::test_all(timer_enabled = true)]
async fn a_stream_that_did_not_ask_for_usage_is_charged_and_recorded_with_the_providers_counts() {
    let pki = Pki::mint("usage-unasked");
    guarded(async {
        let mock = Mock::start(TOKENS);
        let recorder = Recorder::start(mock.addr);
        let usage_path = pki.dir.join("usage.jsonl");
        let _ = std::fs::remove_file(&usage_path);
        let edge = TestEdge::start(
            &pki,
            &config(
                &pki,
                recorder.addr,
                mock.addr,
                &usage_path.display().to_string(),
            ),
        );
        let (stop_node, node) = start_node(&pki, &edge, "node-a").await;
        let stripped_metric = "iop_node_tunnel_usage_chunks_stripped_total{node=\"node-a\"}";
        let stripped_before = metric(edge.client_addr, stripped_metric).await;

        let client_body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{PROMPT}"}}],"stream":true}}"#
        );
        let relayed = http_exchange(
            edge.client_addr,
            with_id(chat_request(KEY_LIMITED, &client_body), "unasked-1"),
        )
        .await;
        assert_eq!(relayed.status, 200, "{relayed:?}");

        // The provider was asked for usage, and for nothing else new.
        assert_eq!(
            String::from_utf8(recorder.take_request_body()).unwrap(),
            format!(
                r#"{{"model":"{TARGET}","stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"{PROMPT}"}}],"stream":true}}"#
            )
        );
        // The client got every byte the provider sent but its usage event.
        let provided = recorder.take_response();
        assert_eq!(provided.status, 200);
        let usage = usage_event(&provided.body);
        assert!(
            usage.contains(&format!(
                r#""usage":{{"prompt_tokens":3,"completion_tokens":{TOKENS},"total_tokens":{}}}"#,
                TOKENS + 3
            )),
            "{usage}"
        );
        let provided_text = String::from_utf8(provided.body.clone()).unwrap();
        let expected = provided_text.replacen(&usage, "", 1);
        assert_eq!(String::from_utf8(relayed.body.clone()).unwrap(), expected);
        assert!(expected.ends_with("data: [DONE]\n\n"));
        assert_eq!(
            metric(edge.client_addr, stripped_metric).await,
            stripped_before + 1
        );

        // The key was charged the real 1503 tokens: its next request waits.
        let refused = http_exchange(
            edge.client_addr,
            with_id(chat_request(KEY_LIMITED, &client_body), "unasked-2"),
        )
        .await;
        assert_eq!(refused.status, 429, "{refused:?}");
        assert_eq!(refused.json()["error"]["code"], "rate_limit_tokens");

        let _ = stop_node.send(());
        assert_eq!(node.await, Exit::Shutdown);
        edge.stop().await;
        let records = usage_records(&usage_path);
        assert_eq!(
            records[0],
            record(
                "unasked-1",
                "team-limited",
                MODEL,
                "node-a/a-mock",
                (3, u64::from(TOKENS))
            )
        );
        assert_eq!(
            (records.len(), &records[1]["status"], &records[1]["usage"]),
            (2, &json!(429), &json!("none"))
        );
        recorder.stop().await;
        mock.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_client_that_asked_for_usage_and_one_that_does_not_stream_get_the_providers_bytes() {
    let pki = Pki::mint("usage-asked");
    guarded(async {
        let mock = Mock::start(5);
        let recorder = Recorder::start(mock.addr);
        let usage_path = pki.dir.join("usage.jsonl");
        let _ = std::fs::remove_file(&usage_path);
        let edge = TestEdge::start(
            &pki,
            &config(
                &pki,
                recorder.addr,
                mock.addr,
                &usage_path.display().to_string(),
            ),
        );
        let (stop_a, node_a) = start_node(&pki, &edge, "node-a").await;

        // Asked: the body goes as written (but `model`), nothing stripped.
        let asked = format!(
            r#"{{"model":"{MODEL}","stream":true,"stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"{PROMPT}"}}]}}"#
        );
        let relayed = http_exchange(
            edge.client_addr,
            with_id(chat_request(KEY_FREE, &asked), "asked"),
        )
        .await;
        assert_eq!(relayed.status, 200, "{relayed:?}");
        assert_eq!(
            String::from_utf8(recorder.take_request_body()).unwrap(),
            asked.replace(MODEL, TARGET)
        );
        let provided = recorder.take_response();
        assert_eq!(relayed.body, provided.body);
        usage_event(&relayed.body);

        // Not streamed: the body goes as written (but `model`), the answer
        // comes back whole, its usage read from it.
        let plain = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{PROMPT}"}}]}}"#
        );
        let relayed = http_exchange(
            edge.client_addr,
            with_id(chat_request(KEY_FREE, &plain), "plain"),
        )
        .await;
        assert_eq!(relayed.status, 200, "{relayed:?}");
        assert_eq!(
            String::from_utf8(recorder.take_request_body()).unwrap(),
            plain.replace(MODEL, TARGET)
        );
        assert_eq!(relayed.body, recorder.take_response().body);

        // The normalized path: usage from the run's `complete`, no usage
        // chunk for a client that did not ask.
        let (stop_c, node_c) = start_node(&pki, &edge, "node-c").await;
        let normalized = format!(
            r#"{{"model":"{OLLAMA_MODEL}","messages":[{{"role":"user","content":"{PROMPT}"}}],"stream":true}}"#
        );
        let relayed = http_exchange(
            edge.client_addr,
            with_id(chat_request(KEY_FREE, &normalized), "ollama"),
        )
        .await;
        assert_eq!(relayed.status, 200, "{relayed:?}");
        let text = String::from_utf8(relayed.body).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert!(!text.contains("\"usage\""), "{text}");

        for (stop, node) in [(stop_a, node_a), (stop_c, node_c)] {
            let _ = stop.send(());
            assert_eq!(node.await, Exit::Shutdown);
        }
        edge.stop().await;
        assert_eq!(
            usage_records(&usage_path),
            vec![
                record("asked", "team-free", MODEL, "node-a/a-mock", (3, 5)),
                record("plain", "team-free", MODEL, "node-a/a-mock", (3, 5)),
                record("ollama", "team-free", OLLAMA_MODEL, "node-c/c-ollama", (3, 5)),
            ]
        );
        recorder.stop().await;
        mock.stop().await;
    })
    .await;
}

// Text completions and embeddings are charged to their key's token budget
// and recorded with the provider's counts, as chat is: an embeddings
// request its prompt tokens (its usage has no completion), a text
// completion, streamed or not, its prompt and completion tokens. Past the budget, the next request of the
// same key is refused. Each usage record names its operation's path.
#[monoio::test_all(timer_enabled = true)]
async fn embeddings_and_text_completions_are_charged_and_recorded() {
    let pki = Pki::mint("usage-operations");
    guarded(async {
        let mock = Mock::start(TOKENS);
        let recorder = Recorder::start(mock.addr);
        let usage_path = pki.dir.join("usage.jsonl");
        let _ = std::fs::remove_file(&usage_path);
        let edge = TestEdge::start(
            &pki,
            &config(
                &pki,
                recorder.addr,
                mock.addr,
                &usage_path.display().to_string(),
            ),
        );
        let (stop_node, node) = start_node(&pki, &edge, "node-a").await;

        // Embeddings: 120 one-letter words, estimated below the budget
        // (the body's bytes / 4), charged the provider's 120 prompt tokens.
        let words = vec!["a"; 120].join(" ");
        let embed = format!(r#"{{"model":"{MODEL}","input":"{words}"}}"#);
        assert!((embed.len() as u32).div_ceil(4) < TOKENS_PER_MINUTE);
        let relayed = http_exchange(
            edge.client_addr,
            with_id(post_request("/v1/embeddings", KEY_EMBED, &embed), "embed-1"),
        )
        .await;
        assert_eq!(relayed.status, 200, "{relayed:?}");
        assert_eq!(recorder.take_request_body(), embed.replace(MODEL, TARGET).into_bytes());
        let provided = recorder.take_response();
        assert_eq!(relayed.body, provided.body);
        assert_eq!(
            relayed.json()["usage"],
            json!({"prompt_tokens": 120, "total_tokens": 120})
        );
        let refused = http_exchange(
            edge.client_addr,
            with_id(post_request("/v1/embeddings", KEY_EMBED, &embed), "embed-2"),
        )
        .await;
        assert_eq!(refused.status, 429, "{refused:?}");
        assert_eq!(refused.json()["error"]["code"], "rate_limit_tokens");

        // A streamed text completion that asked for usage: the client gets
        // every byte the provider sent, the key is charged 3 + 1500 tokens.
        // (One that did not ask has the provider asked, as chat does: the
        // splice is json_operations', the charge the e2e suite's. Here it
        // would strip a usage event, and the test above counts those in a
        // counter of the whole process.)
        let streamed = format!(
            r#"{{"model":"{MODEL}","prompt":"{PROMPT}","stream":true,"stream_options":{{"include_usage":true}}}}"#
        );
        let relayed = http_exchange(
            edge.client_addr,
            with_id(
                post_request("/v1/completions", KEY_LIMITED, &streamed),
                "cmpl-1",
            ),
        )
        .await;
        assert_eq!(relayed.status, 200, "{relayed:?}");
        assert_eq!(
            recorder.take_request_body(),
            streamed.replace(MODEL, TARGET).into_bytes()
        );
        let provided = recorder.take_response();
        assert_eq!(relayed.body, provided.body);
        assert!(
            usage_event(&relayed.body).contains(&format!(
                r#""usage":{{"prompt_tokens":3,"completion_tokens":{TOKENS},"total_tokens":{}}}"#,
                TOKENS + 3
            )),
            "{relayed:?}"
        );
        let refused = http_exchange(
            edge.client_addr,
            with_id(post_request("/v1/completions", KEY_LIMITED, &streamed), "cmpl-2"),
        )
        .await;
        assert_eq!(refused.status, 429, "{refused:?}");
        assert_eq!(refused.json()["error"]["code"], "rate_limit_tokens");

        // Not streamed, on the key without a budget: recorded all the same.
        let plain = format!(r#"{{"model":"{MODEL}","prompt":"{PROMPT}","max_tokens":4}}"#);
        let relayed = http_exchange(
            edge.client_addr,
            with_id(post_request("/v1/completions", KEY_FREE, &plain), "cmpl-plain"),
        )
        .await;
        assert_eq!(relayed.status, 200, "{relayed:?}");
        assert_eq!(recorder.take_request_body(), plain.replace(MODEL, TARGET).into_bytes());
        assert_eq!(relayed.body, recorder.take_response().body);

        let _ = stop_node.send(());
        assert_eq!(node.await, Exit::Shutdown);
        edge.stop().await;
        let records = usage_records(&usage_path);
        let provider = "node-a/a-mock";
        assert_eq!(records.len(), 5, "{records:#?}");
        assert_eq!(
            records[0],
            record_of("/v1/embeddings", "embed-1", "team-embed", MODEL, provider, (120, 0))
        );
        assert_eq!(
            (&records[1]["request_id"], &records[1]["path"], &records[1]["status"], &records[1]["usage"]),
            (&json!("embed-2"), &json!("/v1/embeddings"), &json!(429), &json!("none"))
        );
        assert_eq!(
            records[2],
            record_of(
                "/v1/completions",
                "cmpl-1",
                "team-limited",
                MODEL,
                provider,
                (3, u64::from(TOKENS))
            )
        );
        assert_eq!(
            (&records[3]["request_id"], &records[3]["path"], &records[3]["status"], &records[3]["usage"]),
            (&json!("cmpl-2"), &json!("/v1/completions"), &json!(429), &json!("none"))
        );
        assert_eq!(
            records[4],
            record_of("/v1/completions", "cmpl-plain", "team-free", MODEL, provider, (3, 4))
        );
        recorder.stop().await;
        mock.stop().await;
    })
    .await;
}

/// A node that does not say it strips the usage chunk (an older one) gets
/// the client's body with only `model` replaced, and no strip flag: its
/// clients never see a usage event they did not ask for.
#[monoio::test_all(timer_enabled = true)]
async fn an_older_node_is_not_asked_to_strip_and_its_provider_is_not_asked_for_usage() {
    let pki = Pki::mint("usage-older-node");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut older = ready_node(&edge, &pki, "node-a").await;
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"stream":true}}"#
        );
        let addr = edge.client_addr;
        let sent = body.clone();
        let client = monoio::spawn(async move { post_chat(addr, &sent).await });
        let tunnel = next_tunnel(&mut older).await;
        assert!(!tunnel.strip_usage_chunk);
        assert_eq!(
            String::from_utf8(tunnel.body.to_vec()).unwrap(),
            body.replace(MODEL, TARGET)
        );
        tunnel_response_start(&older, &tunnel.run_id, b"text/event-stream").await;
        tunnel_body(&older, &tunnel.run_id, 2, b"data: [DONE]\n\n").await;
        tunnel_end(&older, &tunnel.run_id, 3).await;
        assert_eq!(client.await.body, b"data: [DONE]\n\n");
        drop(older);

        // The same node id registering as one that strips: asked.
        let mut newer = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
        newer
            .conn
            .send_control(common::frame(Body::RegisterRequest(pb::RegisterRequest {
                node_id: "node-a".into(),
                node_version: "test".into(),
                flow_control: 0,
                strips_usage_chunk: true,
                runs_embeddings: false,
                accepts_tunnel_body: false,
            })))
            .expect("register");
        assert!(matches!(newer.next_frame().await, Body::RegisterResponse(r) if r.accepted));
        assert_eq!(newer.ready("node-a").await, ready_accepted());
        let sent = body.clone();
        let client = monoio::spawn(async move { post_chat(addr, &sent).await });
        let tunnel = next_tunnel(&mut newer).await;
        assert!(tunnel.strip_usage_chunk);
        assert_eq!(
            String::from_utf8(tunnel.body.to_vec()).unwrap(),
            format!(
                r#"{{"model":"{TARGET}","stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"hi"}}],"stream":true}}"#
            )
        );
        tunnel_response_start(&newer, &tunnel.run_id, b"text/event-stream").await;
        tunnel_body(&newer, &tunnel.run_id, 2, b"data: [DONE]\n\n").await;
        tunnel_end(&newer, &tunnel.run_id, 3).await;
        assert_eq!(client.await.body, b"data: [DONE]\n\n");
        edge.stop().await;
    })
    .await;
}
