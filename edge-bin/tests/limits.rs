//! Per-principal limits and model access (`[[client_keys]]`
//! `max_concurrent`, `requests_per_minute`, `models`) on an Edge served in
//! process, over real client sockets and a hand-driven node on real mTLS.
//!
//! What is proven: the request over a limit is refused with 429 before it
//! reaches the node (the node sees exactly the admitted requests), with
//! `retry-after`, `retry-after-ms` and OpenAI's `x-ratelimit-*` headers, in
//! the OpenAI shape on `/v1/chat/completions` and the Anthropic shape on
//! `/v1/messages`; a concurrency slot comes back when its stream ends; a
//! key restricted to some models gets 403 for the others and sees only its
//! own in `/v1/models`; and no lease is left behind.

mod common;

use common::*;

const KEY_A: &str = "sk-limits-a-2b6e01f4c9d3";
const KEY_B: &str = "sk-limits-b-7c3a58e0d1f6";

fn request(path: &str, key: &str, body: &str) -> Vec<u8> {
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

fn chat(key: &str, model: &str, stream: bool) -> Vec<u8> {
    let body = serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    });
    request("/v1/chat/completions", key, &body.to_string())
}

/// Answers the next tunnel the node gets with a small JSON body.
async fn answer_next(node: &mut RawNode) {
    let run = next_tunnel(node).await.run_id;
    tunnel_response_start(node, &run, b"application/json").await;
    tunnel_body(node, &run, 2, b"{\"ok\":true}").await;
    tunnel_end(node, &run, 3).await;
}

/// `retry-after` agrees with `retry-after-ms`; returns it in seconds.
fn retry_after(r: &HttpResponse) -> u64 {
    let secs: u64 = r
        .header("retry-after")
        .expect("retry-after")
        .parse()
        .unwrap();
    let ms: u64 = r
        .header("retry-after-ms")
        .expect("retry-after-ms")
        .parse()
        .unwrap();
    assert_eq!(
        secs,
        ms.div_ceil(1000).max(1),
        "retry-after {secs} vs {ms} ms"
    );
    secs
}

#[monoio::test_all(timer_enabled = true)]
async fn over_its_limits_a_key_gets_429_with_rate_headers_before_the_node_sees_it() {
    guarded(async {
        let pki = Pki::mint("limits-rate");
        let text = edge_toml_with_client_keys(
            &pki,
            &[
                (
                    "team-a",
                    KEY_A,
                    "max_concurrent = 1\nrequests_per_minute = 2",
                ),
                ("team-b", KEY_B, ""),
            ],
        );
        let edge = TestEdge::start(&pki, &text);
        let mut node = ready_node(&edge, &pki, "node-a").await;

        // Request 1 streams and stays in flight: it holds team-a's one slot.
        let (mut client, run, mut seen) =
            stream_in_flight(edge.client_addr, &mut node, chat(KEY_A, MODEL, true)).await;

        // Request 2 while it is in flight: the concurrency limit.
        let busy = http_exchange(edge.client_addr, chat(KEY_A, MODEL, false)).await;
        assert_eq!(busy.status, 429);
        assert_eq!(
            busy.json(),
            api_error(
                "rate limit reached: at most 1 requests in flight for this key",
                "rate_limit_error",
                None,
                Some("rate_limit_concurrency"),
            )
        );
        assert_eq!(retry_after(&busy), 1);
        assert_eq!(busy.header("x-ratelimit-limit-requests"), Some("2"));
        assert_eq!(busy.header("x-ratelimit-remaining-requests"), Some("1"));
        assert!(busy.header("x-request-id").is_some());
        // Another principal is not held back by team-a's limits.
        let other = monoio::spawn(http_exchange(edge.client_addr, chat(KEY_B, MODEL, false)));
        answer_next(&mut node).await;
        assert_eq!(other.await.status, 200);

        // Request 1 ends: its slot comes back, and request 2 gets through.
        tunnel_body(&node, &run, 3, b"data: [DONE]\n\n").await;
        tunnel_end(&node, &run, 4).await;
        read_until(&mut client, &mut seen, b"\r\n0\r\n\r\n").await;
        let second = monoio::spawn(http_exchange(edge.client_addr, chat(KEY_A, MODEL, false)));
        answer_next(&mut node).await;
        let second = second.await;
        assert_eq!(
            (second.status, second.body),
            (200, b"{\"ok\":true}".to_vec())
        );

        // Request 3: two per minute are used up.
        let over = http_exchange(edge.client_addr, chat(KEY_A, MODEL, false)).await;
        assert_eq!(over.status, 429);
        let wait = retry_after(&over);
        // 30 s after the first request (one request refills in 30 s), less
        // the time since; the margin covers a slow machine.
        assert!((10..=30).contains(&wait), "retry-after {wait}");
        assert_eq!(
            over.json(),
            api_error(
                &format!(
                    "rate limit reached: 2 requests per minute for this key; retry in {wait}s"
                ),
                "rate_limit_error",
                None,
                Some("rate_limit_requests"),
            )
        );
        assert_eq!(over.header("x-ratelimit-limit-requests"), Some("2"));
        assert_eq!(over.header("x-ratelimit-remaining-requests"), Some("0"));
        let reset = over.header("x-ratelimit-reset-requests").unwrap();
        assert!(reset.ends_with('s') && !reset.ends_with("ms"), "{reset}");

        // The Anthropic surface answers in its own shape.
        let body = serde_json::json!({
            "model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
        });
        let messages = http_exchange(
            edge.client_addr,
            request("/v1/messages", KEY_A, &body.to_string()),
        )
        .await;
        assert_eq!(messages.status, 429);
        assert!(retry_after(&messages) <= wait);
        let json = messages.json();
        assert_eq!(json["type"], "error");
        assert_eq!(json["error"]["type"], "rate_limit_error");
        assert_eq!(
            json["request_id"].as_str(),
            messages.header("x-request-id"),
            "{json}"
        );

        // /metrics: three refusals by a limit (no principal label: O1
        // keeps caller identities out of metric labels).
        let text = String::from_utf8(
            http_exchange(
                edge.client_addr,
                b"GET /metrics HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n".to_vec(),
            )
            .await
            .body,
        )
        .unwrap();
        let line = "iop_edge_rejections_total{reason=\"rate_limited\"} 3";
        assert!(text.lines().any(|l| l == line), "no {line} in:\n{text}");
        assert!(!text.contains("team-a"), "a principal in /metrics:\n{text}");

        // Every lease came back: a refused request never took one (it would
        // still hold it, as nothing on the node side answers it).
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_key_limited_to_some_models_gets_403_for_others_and_lists_only_its_own() {
    guarded(async {
        let pki = Pki::mint("limits-models");
        let text = edge_toml_with_client_keys(
            &pki,
            &[
                ("team-a", KEY_A, &format!("models = [\"{MODEL_B}\"]")),
                ("team-b", KEY_B, ""),
            ],
        );
        let edge = TestEdge::start(&pki, &text);

        let refused = http_exchange(edge.client_addr, chat(KEY_A, MODEL, false)).await;
        assert_eq!(refused.status, 403);
        assert_eq!(
            refused.json(),
            api_error(
                &format!("This API key may not use model `{MODEL}`."),
                "permission_error",
                Some("model"),
                Some("model_not_allowed"),
            )
        );

        let list = |key: &str| {
            let key = key.to_owned();
            async move {
                let request = format!(
                    "GET /v1/models HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
                     authorization: Bearer {key}\r\n\r\n"
                );
                let r = http_exchange(edge.client_addr, request.into_bytes()).await;
                assert_eq!(r.status, 200);
                r.json()["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m["id"].as_str().unwrap().to_owned())
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(list(KEY_A).await, vec![MODEL_B.to_owned()]);
        assert_eq!(
            list(KEY_B).await,
            vec![MODEL.to_owned(), MODEL_B.to_owned()]
        );
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}
