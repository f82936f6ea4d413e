//! `/metrics` through the running Edge: exact request counts by route,
//! model and code after a streamed answer, a 401, a 413, a 429 and a 503;
//! the rejections by reason, tokens from the node's usage observation, the
//! queue depth while a request waits, the latency histograms' counts, and
//! a node's own series pulled over its link and labelled `node`, with a
//! node that does not answer counted as a scrape error.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use iop_wire::pb;
use iop_wire::pb::frame::Body;

/// The client's API key (a configured `[[client_keys]]` entry).
const API_KEY: &str = "sk-metrics-0a1b2c3d4e5f";
/// A model with a one-request queue on a node that never connects.
const LIMITED: &str = "limited-model";

fn chat(model: &str, key: Option<&str>, extra_body: &str) -> Vec<u8> {
    let body = format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi{extra_body}"}}],"stream":true}}"#
    );
    let auth = key
        .map(|k| format!("authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n{auth}\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body.as_bytes());
    request
}

/// The sample lines of `/metrics` as `series → value`.
fn samples(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("`series value`");
            (series.to_owned(), value.to_owned())
        })
        .collect()
}

async fn scrape_text(addr: std::net::SocketAddr) -> String {
    let response = http_request(addr, "GET", "/metrics", b"").await;
    assert_eq!(response.status, 200);
    String::from_utf8(response.body).expect("UTF-8")
}

/// Answers the next METRICS command `node` gets with `text` (other frames
/// are skipped); returns without answering when `answer` is false.
async fn metrics_command(node: &mut RawNode, text: &str, answer: bool) {
    loop {
        match node.next_frame().await {
            Body::NodeCommandRequest(c) if c.r#type == pb::CommandType::Metrics as i32 => {
                if answer {
                    let resp = pb::NodeCommandResponse {
                        command_id: c.command_id,
                        ok: true,
                        metrics_text: text.to_owned(),
                        ..Default::default()
                    };
                    node.conn
                        .send_control(frame(Body::NodeCommandResponse(Box::new(resp))))
                        .expect("send the answer");
                }
                return;
            }
            _ => {}
        }
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn requests_rejections_tokens_and_node_series_are_counted_exactly() {
    let pki = Pki::mint("metrics");
    guarded(async {
        let key_hash = blake3::hash(API_KEY.as_bytes()).to_hex();
        let mut options = EdgeOptions::without_provider();
        options.max_request_body_bytes = Some(512);
        // Every scrape asks the node (the test answers each one).
        options.edge_keys = "node_metrics_max_age_ms = 0\n".into();
        options.extra_toml = format!(
            "[[models]]\nname = \"{LIMITED}\"\nproviders = [\"node-b/b-mock\"]\n\
             max_queue = 1\nqueue_timeout_ms = 3000\n\n\
             [[client_keys]]\nprincipal = \"metrics-test\"\nkey_hash = \"{key_hash}\"\n"
        );
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = ready_node(&edge, &pki, "node-a").await;
        let addr = edge.client_addr;

        // A streamed answer in two chunks with a usage observation.
        let client = monoio::spawn(http_exchange(addr, chat(MODEL, Some(API_KEY), "")));
        let tunnel = next_tunnel(&mut node).await;
        let run = tunnel.run_id.clone();
        let frames = [
            pb::ProviderTunnelFrame {
                status: 200,
                headers: vec![pb::Header {
                    name: "content-type".into(),
                    value: Bytes::from_static(b"text/event-stream"),
                }],
                ..tunnel_frame(&run, 1, pb::TunnelFrameKind::ResponseStart)
            },
            pb::ProviderTunnelFrame {
                body: Bytes::from_static(b"data: {\"n\":1}\n\n"),
                ..tunnel_frame(&run, 2, pb::TunnelFrameKind::Body)
            },
            pb::ProviderTunnelFrame {
                body: Bytes::from_static(b"data: [DONE]\n\n"),
                ..tunnel_frame(&run, 3, pb::TunnelFrameKind::Body)
            },
            pb::ProviderTunnelFrame {
                usage: Some(Box::new(pb::Usage {
                    prompt_tokens: 11,
                    completion_tokens: 3,
                    total_tokens: 14,
                })),
                ..tunnel_frame(&run, 4, pb::TunnelFrameKind::Usage)
            },
            tunnel_frame(&run, 5, pb::TunnelFrameKind::End),
        ];
        for f in frames {
            node.conn
                .send_bulk(frame(Body::ProviderTunnelFrame(Box::new(f))))
                .await
                .expect("send tunnel frame");
        }
        assert_eq!(client.await.status, 200);

        // 401: no key.
        assert_eq!(
            http_exchange(addr, chat(MODEL, None, "")).await.status,
            401
        );
        // 413: a body over the limit.
        let big = "x".repeat(1024);
        assert_eq!(
            http_exchange(addr, chat(MODEL, Some(API_KEY), &big))
                .await
                .status,
            413
        );
        // 429 while another request of the limited model waits (its node
        // never connects, so the waiting one ends 503 at its queue timeout).
        let waiting = monoio::spawn(http_exchange(addr, chat(LIMITED, Some(API_KEY), "")));
        let queued = format!("iop_edge_queue_depth{{model=\"{LIMITED}\"}}");
        let mut depth = String::new();
        for _ in 0..200 {
            // Scrapes need the node's answer: serve it alongside.
            let scrape = monoio::spawn(scrape_text(addr));
            metrics_command(&mut node, "", true).await;
            depth = samples(&scrape.await).remove(&queued).unwrap_or_default();
            if depth == "1" {
                break;
            }
            monoio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(depth, "1", "the limited model's request is queued");
        assert_eq!(
            http_exchange(addr, chat(LIMITED, Some(API_KEY), ""))
                .await
                .status,
            429
        );
        assert_eq!(waiting.await.status, 503);

        // The node's series come labelled with its id.
        let node_text = "# HELP iop_node_provider_call_duration_seconds Provider calls.\n\
                         # TYPE iop_node_provider_call_duration_seconds histogram\n\
                         iop_node_provider_call_duration_seconds_bucket{le=\"+Inf\"} 2\n\
                         iop_node_provider_call_duration_seconds_sum 0.25\n\
                         iop_node_provider_call_duration_seconds_count 2\n\
                         # HELP process_open_fds Number of open file descriptors.\n\
                         # TYPE process_open_fds gauge\n\
                         process_open_fds 9\n";
        let scrape = monoio::spawn(scrape_text(addr));
        metrics_command(&mut node, node_text, true).await;
        let text = scrape.await;
        let got = samples(&text);
        let value = |series: &str| {
            got.get(series)
                .unwrap_or_else(|| panic!("no {series} in\n{text}"))
                .as_str()
        };
        let requests = |route: &str, model: &str, code: &str| {
            value(&format!(
                "iop_edge_requests_total{{route=\"{route}\",model=\"{model}\",code=\"{code}\"}}"
            ))
            .to_owned()
        };
        assert_eq!(requests("chat_completions", MODEL, "200"), "1");
        assert_eq!(requests("chat_completions", "none", "401"), "1");
        assert_eq!(requests("chat_completions", "none", "413"), "1");
        assert_eq!(requests("chat_completions", LIMITED, "429"), "1");
        assert_eq!(requests("chat_completions", LIMITED, "503"), "1");
        let chat_series: Vec<&String> = got
            .keys()
            .filter(|k| k.starts_with("iop_edge_requests_total{route=\"chat_completions\""))
            .collect();
        assert_eq!(chat_series.len(), 5, "{chat_series:?}");
        for (reason, n) in [
            ("unauthorized", "1"),
            ("too_large", "1"),
            ("queue_full", "1"),
            ("no_provider", "1"),
            ("forbidden", "0"),
            ("bad_request", "0"),
        ] {
            assert_eq!(
                value(&format!("iop_edge_rejections_total{{reason=\"{reason}\"}}")),
                n,
                "{reason}"
            );
        }
        assert_eq!(
            value(&format!(
                "iop_edge_tokens_total{{model=\"{MODEL}\",kind=\"prompt\"}}"
            )),
            "11"
        );
        assert_eq!(
            value(&format!(
                "iop_edge_tokens_total{{model=\"{MODEL}\",kind=\"completion\"}}"
            )),
            "3"
        );
        assert_eq!(value(&queued), "0");
        assert_eq!(
            value(&format!("iop_edge_active_streams{{model=\"{MODEL}\"}}")),
            "0"
        );
        let chat_labels = format!("route=\"chat_completions\",model=\"{MODEL}\"");
        // One first byte, one gap between the two chunks, one duration.
        for name in [
            "iop_edge_time_to_first_token_seconds",
            "iop_edge_chunk_interval_seconds",
            "iop_edge_request_duration_seconds",
        ] {
            assert_eq!(
                value(&format!("{name}_count{{{chat_labels}}}")),
                "1",
                "{name}"
            );
            assert_eq!(
                value(&format!("{name}_bucket{{{chat_labels},le=\"+Inf\"}}")),
                "1",
                "{name}"
            );
        }
        // The 429 and the 503 have durations; the 401 and 413 (no model)
        // are under `none`.
        assert_eq!(
            value(&format!(
                "iop_edge_request_duration_seconds_count{{route=\"chat_completions\",model=\"{LIMITED}\"}}"
            )),
            "2"
        );
        assert_eq!(
            value("iop_node_provider_call_duration_seconds_bucket{node=\"node-a\",le=\"+Inf\"}"),
            "2"
        );
        assert_eq!(
            value("iop_node_provider_call_duration_seconds_count{node=\"node-a\"}"),
            "2"
        );
        assert_eq!(value("process_open_fds{node=\"node-a\"}"), "9");
        assert_ne!(value("process_open_fds"), "9", "the Edge's own");
        assert_eq!(
            text.matches("# TYPE process_open_fds gauge\n").count(),
            1,
            "one TYPE per family"
        );
        assert_eq!(
            value("iop_edge_node_scrape_errors_total{node=\"node-a\"}"),
            "0"
        );
        assert_eq!(
            value("iop_edge_node_scrape_errors_total{node=\"node-b\"}"),
            "0"
        );
        assert!(value(&format!(
            "iop_build_info{{version=\"{}\",commit=\"{}\"}}",
            env!("CARGO_PKG_VERSION"),
            iop_engine::build::COMMIT
        ))
        .eq("1"));
        assert!(text.contains("# TYPE iop_edge_time_to_first_token_seconds histogram\n"));
        assert!(!text.contains("time_to_first_byte"), "the old name is gone");

        // A node that does not answer is left out and counted.
        let scrape = monoio::spawn(scrape_text(addr));
        metrics_command(&mut node, "", false).await;
        let text = scrape.await;
        let got = samples(&text);
        assert_eq!(
            got.get("iop_edge_node_scrape_errors_total{node=\"node-a\"}")
                .map(String::as_str),
            Some("1"),
            "{text}"
        );
        assert!(!got.contains_key("process_open_fds{node=\"node-a\"}"));
        edge.stop().await;
    })
    .await;
}
