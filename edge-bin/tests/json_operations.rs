//! The OpenAI-shaped operations beyond chat, proven over real client
//! sockets and real mTLS with hand-driven nodes:
//!
//! - `POST /v1/completions` (streamed and not) and `POST /v1/embeddings`
//!   reach the node as a tunnel naming the operation, carrying the
//!   client's bytes with `model` replaced by the provider's target and
//!   nothing else changed; the client gets the node's bytes unchanged.
//! - A streamed completion whose client did not ask for usage has the
//!   provider asked for it (`stream_options.include_usage` spliced in, the
//!   node told to strip the usage chunk) when the node can strip it; not
//!   when the client asked, nor from a node that cannot.
//! - `GET /v1/models/{id}` is answered by the Edge from its model list,
//!   the id percent-decoded as the SDKs encode it: the model object, or a
//!   404 `model_not_found` for a model it does not serve or the key may
//!   not use.
//! - A `prefix` model's tree learns the prompts of generating operations,
//!   nothing of an embeddings request.
//! - `/tokenize` and `/detokenize` without a `model` answer 400 naming the
//!   parameter.
//! - A model whose providers cannot serve an operation answers 400 naming
//!   it: an Ollama-only model for `/v1/completions` (a normalized run
//!   speaks chat and embeddings only), an `openai`-profile model for
//!   `/v1/score` (its profile has no path for it).
//! - Embeddings on an Ollama provider are a normalized run
//!   (`operation: "embeddings"`, the texts and `dimensions` in its input)
//!   whose `complete` the client gets as OpenAI's list, exact to the byte;
//!   only on a node that registered `runs_embeddings` (an older one would
//!   run a chat): an older node's Ollama provider is no candidate for
//!   embeddings, and still one for chat.

mod common;

use common::*;
use iop_wire::pb;
use iop_wire::pb::frame::Body;
use serde_json::Value;

/// A model served by an Ollama adapter only (node-c, never connected).
const OLLAMA_MODEL: &str = "ollama-only";
const KEY: &str = "sk-json-ops-full-key";
const LIMITED_KEY: &str = "sk-json-ops-limited-key";

/// node-c with one Ollama adapter and provider, and the model it serves.
fn ollama_toml() -> String {
    format!(
        r#"
[[models]]
name = "{OLLAMA_MODEL}"
providers = ["node-c/c-ollama"]
queue_timeout_ms = 500

[[nodes]]
id = "node-c"

[[nodes.adapters]]
name = "ollama"
kind = "ollama"
base_url = "http://127.0.0.1:9"
capacity = 2

[[nodes.providers]]
id = "c-ollama"
adapter = "ollama"
target = "llama3:8b"
capacity = 2
"#
    )
}

/// The body the node got: the client's with `model` naming [`TARGET`].
fn for_target(client_body: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(client_body).expect("utf-8");
    text.replacen(
        &format!("\"model\":\"{MODEL}\""),
        &format!("\"model\":\"{TARGET}\""),
        1,
    )
    .into_bytes()
}

#[monoio::test_all(timer_enabled = true)]
async fn completions_and_embeddings_are_tunneled_byte_for_byte() {
    let pki = Pki::mint("json-ops-tunnels");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut node = ready_node(&edge, &pki, "node-a").await;

        // Completions, not streamed: `suffix` and the spacing are the
        // client's, untouched.
        const COMPLETION: &[u8] = br#"{ "prompt": "def f(", "model":"chat-model", "suffix":"\n  return 1", "max_tokens": 7 }"#;
        const COMPLETION_ANSWER: &[u8] = br#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"x):","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10}}"#;
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/completions",
            COMPLETION,
            b"application/json",
            &[&COMPLETION_ANSWER[..40], &COMPLETION_ANSWER[40..]],
        )
        .await;
        assert_eq!(
            (tunnel.operation.as_str(), tunnel.stream, tunnel.target.as_str()),
            ("completions", false, TARGET)
        );
        // CONTRACT: U5 — the body is the client's, the served target's name
        // written into `model` at the Edge, every other byte unchanged.
        assert_eq!(&tunnel.body[..], &for_target(COMPLETION)[..]);
        assert_eq!(
            &tunnel.body[..],
            br#"{ "prompt": "def f(", "model":"mock-target-7b", "suffix":"\n  return 1", "max_tokens": 7 }"#
        );
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.header("content-type"), Some("application/json"));
        assert_eq!(response.body, COMPLETION_ANSWER);

        // Completions, streamed: the events come as the node sent them.
        const STREAMED: &[u8] = br#"{"model":"chat-model","prompt":"hi","stream":true}"#;
        const EVENTS: [&[u8]; 3] = [
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
            b"data: {\"choices\":[{\"text\":\"b\"}]}\n\n",
            b"data: [DONE]\n\n",
        ];
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/completions",
            STREAMED,
            b"text/event-stream",
            &EVENTS,
        )
        .await;
        assert_eq!(
            (tunnel.operation.as_str(), tunnel.stream),
            ("completions", true)
        );
        assert_eq!(
            &tunnel.body[..],
            br#"{"model":"mock-target-7b","prompt":"hi","stream":true}"#
        );
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.header("content-type"), Some("text/event-stream"));
        assert_eq!(response.body, EVENTS.concat());

        // Embeddings.
        const EMBED: &[u8] =
            br#"{"input":["a","b"],"model":"chat-model","encoding_format":"float"}"#;
        const EMBEDDED: &[u8] = br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,-1.0]},{"object":"embedding","index":1,"embedding":[0.25,2e-3]}],"model":"mock-target-7b","usage":{"prompt_tokens":2,"total_tokens":2}}"#;
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/embeddings",
            EMBED,
            b"application/json",
            &[EMBEDDED],
        )
        .await;
        assert_eq!(
            (tunnel.operation.as_str(), tunnel.stream),
            ("embeddings", false)
        );
        assert_eq!(
            &tunnel.body[..],
            br#"{"input":["a","b"],"model":"mock-target-7b","encoding_format":"float"}"#
        );
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.body, EMBEDDED);
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn an_operation_no_provider_serves_is_a_400_naming_it() {
    let pki = Pki::mint("json-ops-unsupported");
    guarded(async {
        let edge = ollama_edge(&pki);
        let complete = format!(r#"{{"model":"{OLLAMA_MODEL}","prompt":"hi"}}"#);
        let response = http_request(
            edge.client_addr,
            "POST",
            "/v1/completions",
            complete.as_bytes(),
        )
        .await;
        assert_eq!(response.status, 400, "{response:?}");
        assert_eq!(
            response.json(),
            api_error(
                "No provider serving `ollama-only` supports /v1/completions.",
                "invalid_request_error",
                None,
                None
            )
        );
        // The `openai` profile has no path for `score`: its providers are
        // no candidates for it.
        let score = format!(r#"{{"model":"{MODEL}","text_1":"a","text_2":"b"}}"#);
        let response = http_request(edge.client_addr, "POST", "/v1/score", score.as_bytes()).await;
        assert_eq!(response.status, 400, "{response:?}");
        assert_eq!(
            response.json(),
            api_error(
                "No provider serving `chat-model` supports /v1/score.",
                "invalid_request_error",
                None,
                None
            )
        );
        // `/tokenize` and `/detokenize` need a model as every route does
        // (vLLM defaults it; the Edge routes by it): without one, the
        // OpenAI error naming the parameter; an empty one, the same 400.
        for (path, body) in [
            ("/tokenize", &br#"{"prompt":"a b"}"#[..]),
            ("/detokenize", br#"{"tokens":[1,2]}"#),
        ] {
            let response = http_request(edge.client_addr, "POST", path, body).await;
            assert_eq!(response.status, 400, "{path}: {response:?}");
            assert_eq!(
                response.json(),
                api_error(
                    "You must provide a `model` parameter.",
                    "invalid_request_error",
                    Some("model"),
                    None
                ),
                "{path}"
            );
        }
        let response = http_request(
            edge.client_addr,
            "POST",
            "/tokenize",
            br#"{"model":"","prompt":"a"}"#,
        )
        .await;
        assert_eq!(response.status, 400, "{response:?}");
        assert_eq!(
            response.json(),
            api_error(
                "`model` must be a non-empty string.",
                "invalid_request_error",
                Some("model"),
                None
            )
        );
        // A GET on a tunneled operation is the wrong method.
        let response = http_request(edge.client_addr, "GET", "/v1/embeddings", b"").await;
        assert_eq!(response.status, 405, "{response:?}");
        edge.stop().await;
    })
    .await;
}

async fn get_model(edge: &TestEdge, id: &str, key: &str) -> HttpResponse {
    let request = format!(
        "GET /v1/models/{id} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
         authorization: Bearer {key}\r\n\r\n"
    );
    http_exchange(edge.client_addr, request.into_bytes()).await
}

#[monoio::test_all(timer_enabled = true)]
async fn a_model_is_retrieved_from_the_edges_own_list() {
    let pki = Pki::mint("json-ops-models");
    guarded(async {
        let key = |principal: &str, key: &str, extra: &str| {
            format!(
                "[[client_keys]]\nprincipal = \"{principal}\"\nkey_hash = \"{}\"\n{extra}\n\n",
                blake3::hash(key.as_bytes()).to_hex()
            )
        };
        let options = EdgeOptions {
            extra_toml: key("full", KEY, "")
                + &key("limited", LIMITED_KEY, &format!("models = [\"{MODEL}\"]"))
                + "[[models]]\nname = \"org/chat model\"\nproviders = [\"node-a/a-mock\"]\n",
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let created = edge.edge.settings.started_unix_sec;

        let response = get_model(&edge, MODEL_B, KEY).await;
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.header("content-type"), Some("application/json"));
        assert_eq!(
            String::from_utf8(response.body).unwrap(),
            format!(
                r#"{{"id":"chat-model-b","object":"model","created":{created},"owned_by":"iop"}}"#
            )
        );
        let response = get_model(&edge, MODEL, LIMITED_KEY).await;
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.json()["id"], Value::from(MODEL));

        // Not served, and served but not for this key: the same 404.
        let not_found = |id: &str| {
            api_error(
                &format!("The model `{id}` does not exist or you do not have access to it."),
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            )
        };
        let response = get_model(&edge, "gpt-unknown", KEY).await;
        assert_eq!(response.status, 404, "{response:?}");
        assert_eq!(response.json(), not_found("gpt-unknown"));
        let response = get_model(&edge, MODEL_B, LIMITED_KEY).await;
        assert_eq!(response.status, 404, "{response:?}");
        assert_eq!(response.json(), not_found(MODEL_B));

        // The SDKs percent-encode the id: it is decoded (either case of
        // hex digit), and the raw slash form names the same model.
        for path_id in [
            "org%2Fchat%20model",
            "org%2fchat%20model",
            "org/chat%20model",
        ] {
            let response = get_model(&edge, path_id, KEY).await;
            assert_eq!(response.status, 200, "{path_id}: {response:?}");
            assert_eq!(response.json()["id"], Value::from("org/chat model"));
        }
        // Decoded, a model the key may not use is still unknown; an id that
        // does not decode names no model (and the 404 quotes it as sent).
        let response = get_model(&edge, "org%2Fchat%20model", LIMITED_KEY).await;
        assert_eq!(response.status, 404, "{response:?}");
        assert_eq!(response.json(), not_found("org/chat model"));
        let response = get_model(&edge, "org%2Gchat", KEY).await;
        assert_eq!(response.status, 404, "{response:?}");
        assert_eq!(response.json(), not_found("org%2Gchat"));
        edge.stop().await;
    })
    .await;
}

/// A node registered as one that strips usage chunks, then ready.
async fn stripping_node(edge: &TestEdge, pki: &Pki, node_id: &str) -> RawNode {
    let mut node = RawNode::connect(edge.node_addr, &pki.connector(node_id)).await;
    node.conn
        .send_control(frame(Body::RegisterRequest(pb::RegisterRequest {
            node_id: node_id.to_string(),
            node_version: "test".to_string(),
            flow_control: 0,
            strips_usage_chunk: true,
            runs_embeddings: false,
            accepts_tunnel_body: false,
        })))
        .expect("send register");
    match node.next_frame().await {
        Body::RegisterResponse(r) => assert!(r.accepted),
        other => panic!("expected RegisterResponse, got {other:?}"),
    }
    assert_eq!(node.ready(node_id).await, ready_accepted());
    node
}

#[monoio::test_all(timer_enabled = true)]
async fn a_streamed_completion_asks_for_usage_as_chat_does() {
    let pki = Pki::mint("json-ops-usage");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        const EVENTS: [&[u8]; 2] = [b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n", b"data: [DONE]\n\n"];

        // A node that strips the usage chunk: the provider is asked for it.
        let mut node = stripping_node(&edge, &pki, "node-a").await;
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/completions",
            br#"{"model":"chat-model","prompt":"hi","stream":true}"#,
            b"text/event-stream",
            &EVENTS,
        )
        .await;
        assert_eq!(
            (tunnel.operation.as_str(), tunnel.strip_usage_chunk),
            ("completions", true)
        );
        assert_eq!(
            &tunnel.body[..],
            br#"{"model":"mock-target-7b","stream_options":{"include_usage":true},"prompt":"hi","stream":true}"#
        );
        assert_eq!(response.body, EVENTS.concat());

        // The client asked: its bytes, nothing to strip.
        const ASKED: &[u8] = br#"{"model":"chat-model","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}"#;
        let (tunnel, _) = tunneled(
            &edge,
            &mut node,
            "/v1/completions",
            ASKED,
            b"text/event-stream",
            &EVENTS,
        )
        .await;
        assert!(!tunnel.strip_usage_chunk);
        assert_eq!(&tunnel.body[..], &for_target(ASKED)[..]);

        // Embeddings are never asked for a usage chunk.
        const EMBED: &[u8] = br#"{"model":"chat-model","input":"hi","stream":true}"#;
        let (tunnel, _) = tunneled(
            &edge,
            &mut node,
            "/v1/embeddings",
            EMBED,
            b"application/json",
            &[b"{}"],
        )
        .await;
        assert!(!tunnel.strip_usage_chunk);
        assert_eq!(&tunnel.body[..], &for_target(EMBED)[..]);

        // A node that cannot strip it: the client's bytes as they are.
        let mut old = ready_node(&edge, &pki, "node-b").await;
        const FOR_B: &[u8] = br#"{"model":"chat-model-b","prompt":"hi","stream":true}"#;
        let (tunnel, _) = tunneled(
            &edge,
            &mut old,
            "/v1/completions",
            FOR_B,
            b"text/event-stream",
            &EVENTS,
        )
        .await;
        assert!(!tunnel.strip_usage_chunk);
        assert_eq!(
            &tunnel.body[..],
            br#"{"model":"mock-target-7b","prompt":"hi","stream":true}"#
        );
        edge.stop().await;
    })
    .await;
}

/// An Edge of node-a's models and [`ollama_toml`]'s.
fn ollama_edge(pki: &Pki) -> TestEdge {
    let options = EdgeOptions {
        extra_toml: ollama_toml(),
        ..EdgeOptions::without_provider()
    };
    TestEdge::start(pki, &edge_toml(pki, &options))
}

/// node-c registered (saying whether it runs embeddings), then ready.
async fn ollama_node(edge: &TestEdge, pki: &Pki, runs_embeddings: bool) -> RawNode {
    let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-c")).await;
    node.conn
        .send_control(frame(Body::RegisterRequest(pb::RegisterRequest {
            node_id: "node-c".into(),
            node_version: "test".into(),
            flow_control: 0,
            strips_usage_chunk: true,
            runs_embeddings,
            accepts_tunnel_body: false,
        })))
        .expect("send register");
    match node.next_frame().await {
        Body::RegisterResponse(r) => assert!(r.accepted),
        other => panic!("expected RegisterResponse, got {other:?}"),
    }
    assert_eq!(node.ready("node-c").await, ready_accepted());
    node
}

/// The next run request `node` gets, skipping credit frames.
async fn next_run(node: &mut RawNode) -> pb::RunRequest {
    loop {
        match node.next_frame().await {
            Body::RunRequest(r) => return *r,
            Body::FlowCredit(_) => {}
            other => panic!("expected RunRequest, got {other:?}"),
        }
    }
}

/// A run event of `run_id` from node-c's Ollama provider.
fn run_event(run_id: &str, seq: u64, kind: pb::RunEventType) -> pb::RunEvent {
    pb::RunEvent {
        run_id: run_id.into(),
        seq,
        r#type: kind as i32,
        adapter: "ollama".into(),
        target: "llama3:8b".into(),
        ..Default::default()
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn embeddings_on_an_ollama_provider_are_a_normalized_run() {
    let pki = Pki::mint("json-ops-embed-run");
    guarded(async {
        let edge = ollama_edge(&pki);
        let mut node = ollama_node(&edge, &pki, true).await;
        let addr = edge.client_addr;
        let body = format!(
            r#"{{"model":"{OLLAMA_MODEL}","input":["a b","c"],"encoding_format":"base64","dimensions":2}}"#
        );
        let mut client = monoio::spawn(async move {
            http_request(addr, "POST", "/v1/embeddings", body.as_bytes()).await
        });
        let run = monoio::select! {
            run = next_run(&mut node) => run,
            response = &mut client => panic!("answered without a run: {response:?}"),
        };
        assert_eq!(
            (run.operation.as_str(), run.adapter.as_str(), run.target.as_str()),
            ("embeddings", "ollama", "llama3:8b")
        );
        assert_eq!(
            run.input,
            Some(pb::RunInput {
                embed_input: vec!["a b".into(), "c".into()],
                dimensions: Some(2),
                ..Default::default()
            })
        );
        node.conn
            .send_bulk(frame(Body::RunEvent(Box::new(run_event(
                &run.run_id,
                1,
                pb::RunEventType::Start,
            )))))
            .await
            .expect("send start");
        let complete = pb::RunEvent {
            embeddings: iop_wire::embedding::pack([&[1.0f32, -0.5][..], &[0.25, 2.0][..]]),
            embedding_dimensions: 2,
            usage: Some(Box::new(pb::Usage {
                prompt_tokens: 3,
                completion_tokens: 0,
                total_tokens: 3,
            })),
            finish_reason: "stop".into(),
            ..run_event(&run.run_id, 2, pb::RunEventType::Complete)
        };
        node.conn
            .send_bulk(frame(Body::RunEvent(Box::new(complete))))
            .await
            .expect("send complete");
        let response = client.await;
        assert_eq!(response.status, 200, "{response:?}");
        // 1.0, -0.5 and 0.25, 2.0 as little-endian f32 bytes, in base64.
        assert_eq!(
            std::str::from_utf8(&response.body).expect("utf-8"),
            concat!(
                r#"{"object":"list","data":["#,
                r#"{"object":"embedding","index":0,"embedding":"AACAPwAAAL8="},"#,
                r#"{"object":"embedding","index":1,"embedding":"AACAPgAAAEA="}],"#,
                r#""model":"ollama-only","usage":{"prompt_tokens":3,"total_tokens":3}}"#
            )
        );

        // Token ids have no Ollama form: a 400 naming `input`, and no run.
        let ids = format!(r#"{{"model":"{OLLAMA_MODEL}","input":[[1,2]]}}"#);
        let response = http_request(addr, "POST", "/v1/embeddings", ids.as_bytes()).await;
        assert_eq!(response.status, 400, "{response:?}");
        assert_eq!(
            response.json(),
            api_error(
                "Token-id `input` cannot be embedded by an Ollama provider; send text.",
                "invalid_request_error",
                Some("input"),
                None
            )
        );
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn an_older_nodes_ollama_provider_gets_no_embeddings() {
    let pki = Pki::mint("json-ops-embed-older");
    guarded(async {
        let edge = ollama_edge(&pki);
        let mut node = ollama_node(&edge, &pki, false).await;
        let addr = edge.client_addr;
        // The provider is free, but no candidate: the request waits out
        // the model's queue timeout; the node gets nothing.
        let embed = format!(r#"{{"model":"{OLLAMA_MODEL}","input":"hi"}}"#);
        let response = http_request(addr, "POST", "/v1/embeddings", embed.as_bytes()).await;
        assert_eq!(response.status, 503, "{response:?}");
        assert_eq!(
            response.json()["error"]["code"],
            Value::from("no_provider_available")
        );
        // Chat still reaches it: the first frame it gets is that run.
        let chat = format!(
            r#"{{"model":"{OLLAMA_MODEL}","messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        let client = monoio::spawn(async move {
            http_request(addr, "POST", "/v1/chat/completions", chat.as_bytes()).await
        });
        let run = next_run(&mut node).await;
        assert_eq!(run.operation, "");
        assert_eq!(run.input.as_ref().map(|i| i.messages.len()), Some(1));
        for (seq, kind) in [
            (1, pb::RunEventType::Start),
            (2, pb::RunEventType::Complete),
        ] {
            node.conn
                .send_bulk(frame(Body::RunEvent(Box::new(run_event(
                    &run.run_id,
                    seq,
                    kind,
                )))))
                .await
                .expect("send an event");
        }
        let response = client.await;
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.json()["object"], Value::from("chat.completion"));
        edge.stop().await;
    })
    .await;
}

/// The bytes `model`'s prefix tree holds.
fn tree_bytes(edge: &TestEdge, model: &str) -> usize {
    edge.edge
        .control()
        .model_views()
        .into_iter()
        .find(|m| m.model == model)
        .map(|m| m.tree_bytes)
        .expect("the model's view")
}

// A `prefix` model files the prompts of the operations that generate
// (here a text completion) in its tree, and nothing of an embeddings
// request: its input is text to embed, not a prompt a KV cache reuses
// (`api::route_hint::reads_prompt`).
#[monoio::test_all(timer_enabled = true)]
async fn only_prompts_feed_a_prefix_models_tree() {
    let pki = Pki::mint("json-ops-prefix");
    guarded(async {
        let options = EdgeOptions {
            extra_toml: "[[models]]\nname = \"prefix-model\"\nproviders = [\"node-a/a-mock\"]\n\
                         routing = \"prefix\"\n"
                .into(),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = ready_node(&edge, &pki, "node-a").await;
        let empty = tree_bytes(&edge, "prefix-model");

        const EMBED: &[u8] = br#"{"model":"prefix-model","input":"a long shared document text"}"#;
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/embeddings",
            EMBED,
            b"application/json",
            &[b"{}"],
        )
        .await;
        assert_eq!(tunnel.operation, "embeddings");
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(tree_bytes(&edge, "prefix-model"), empty);

        const COMPLETE: &[u8] =
            br#"{"model":"prefix-model","prompt":"a long shared document text"}"#;
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/completions",
            COMPLETE,
            b"application/json",
            &[b"{}"],
        )
        .await;
        assert_eq!(tunnel.operation, "completions");
        assert_eq!(response.status, 200, "{response:?}");
        assert!(tree_bytes(&edge, "prefix-model") > empty);
        edge.stop().await;
    })
    .await;
}
