//! The audio operations, proven over real client sockets and real mTLS with
//! a hand-driven node:
//!
//! - `POST /v1/audio/transcriptions` and `/v1/audio/translations` take a
//!   `multipart/form-data` body: the node gets a tunnel naming the
//!   operation whose body is the client's form with only the `model`
//!   field's value replaced by the provider's target (the file's bytes,
//!   CRLFs and dashes included, as sent), whether `model` comes before the
//!   file (as the SDKs send it) or after (as curl examples do), and whose
//!   `content-type` is the client's, boundary and all.
//! - `POST /v1/audio/speech` is a JSON tunnel whose binary answer reaches
//!   the client byte for byte.
//! - A form without `model`, or a body that is not a form, is the client's
//!   400 in the OpenAI shape, and no node hears of it; a form over the body
//!   limit is a 413.
//! - To a node that takes streamed bodies (`accepts_tunnel_body`), an
//!   upload larger than `edge.max_request_body_bytes` streams: the tunnel
//!   carries the form's start with the model replaced and announces the
//!   rest (`body_follows_bytes`), which arrives in `ProviderTunnelBody`
//!   frames in order, never more than `TUNNEL_BODY_WINDOW` charged bytes
//!   beyond the credit the node granted; the node's answer reaches the
//!   client byte for byte. Over `edge.max_upload_body_bytes` it is a 413.

mod common;

use common::*;
use iop_wire::flow::{tunnel_body_charge, TUNNEL_BODY_WINDOW};
use iop_wire::pb;
use iop_wire::pb::frame::Body;

/// The form's boundary.
const BOUNDARY: &str = "----iop-test-7MA4YWxkTrZu0gW";
/// A file with bytes a careless parser would trip over: CRLFs, a dashed
/// line that is not the boundary, NUL and high bytes.
const AUDIO: &[u8] = b"RIFF\x24\x00\x00\x00WAVEfmt \r\n--\r\n------iop-test\x00\xff\xfe\r\n\r\n";

/// A form of `fields` (name, filename, value) in order.
fn form(fields: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, filename, value) in fields {
        out.extend_from_slice(format!("--{BOUNDARY}\r\n").as_bytes());
        match filename {
            Some(file) => out.extend_from_slice(
                format!(
                    "Content-Disposition: form-data; name=\"{name}\"; filename=\"{file}\"\r\n\
                     Content-Type: audio/wav\r\n\r\n"
                )
                .as_bytes(),
            ),
            None => out.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            ),
        }
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    out
}

/// A POST of `body` to `path` with `content_type`.
fn post(path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
         content-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

fn form_type() -> String {
    format!("multipart/form-data; boundary={BOUNDARY}")
}

/// The value of `name` among the tunnel's headers.
fn tunnel_header<'a>(tunnel: &'a iop_wire::pb::ProviderTunnelRequest, name: &str) -> &'a [u8] {
    tunnel
        .headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| &h.value[..])
        .unwrap_or_else(|| panic!("the tunnel has no {name}"))
}

#[monoio::test_all(timer_enabled = true)]
async fn an_upload_reaches_the_node_with_only_its_model_replaced() {
    let pki = Pki::mint("audio-uploads");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut node = ready_node(&edge, &pki, "node-a").await;

        // The SDKs' order: fields first, the file last.
        let sent = form(&[
            ("model", None, MODEL.as_bytes()),
            ("response_format", None, b"text"),
            ("file", Some("a.wav"), AUDIO),
        ]);
        const TRANSCRIPT: &[u8] = b"hello from the mock\n";
        let (tunnel, response) = tunneled_request(
            &edge,
            &mut node,
            post("/v1/audio/transcriptions", &form_type(), &sent),
            b"text/plain; charset=utf-8",
            &[&TRANSCRIPT[..5], &TRANSCRIPT[5..]],
        )
        .await;
        assert_eq!(
            (
                tunnel.operation.as_str(),
                tunnel.stream,
                tunnel.target.as_str()
            ),
            ("transcriptions", false, TARGET)
        );
        let expected = form(&[
            ("model", None, TARGET.as_bytes()),
            ("response_format", None, b"text"),
            ("file", Some("a.wav"), AUDIO),
        ]);
        // CONTRACT: U5 — the form is the client's, the served target's name
        // written into the `model` field at the Edge, every other byte as sent.
        assert_eq!(&tunnel.body[..], &expected[..]);
        assert_eq!(
            tunnel_header(&tunnel, "content-type"),
            form_type().as_bytes()
        );
        assert_eq!(tunnel_header(&tunnel, "accept"), b"*/*");
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(
            response.header("content-type"),
            Some("text/plain; charset=utf-8")
        );
        assert_eq!(response.body, TRANSCRIPT);

        // curl's order in OpenAI's examples: the file first, `model` last;
        // a streamed translation.
        let sent = form(&[
            ("file", Some("b.wav"), AUDIO),
            ("model", None, MODEL.as_bytes()),
            ("stream", None, b"true"),
        ]);
        const EVENTS: [&[u8]; 2] = [
            b"data: {\"type\":\"transcript.text.delta\",\"delta\":\"hi\"}\n\n",
            b"data: [DONE]\n\n",
        ];
        let (tunnel, response) = tunneled_request(
            &edge,
            &mut node,
            post("/v1/audio/translations", &form_type(), &sent),
            b"text/event-stream",
            &EVENTS,
        )
        .await;
        assert_eq!(
            (tunnel.operation.as_str(), tunnel.stream),
            ("translations", true)
        );
        let expected = form(&[
            ("file", Some("b.wav"), AUDIO),
            ("model", None, TARGET.as_bytes()),
            ("stream", None, b"true"),
        ]);
        assert_eq!(&tunnel.body[..], &expected[..]);
        assert_eq!(tunnel_header(&tunnel, "accept"), b"text/event-stream");
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.body, EVENTS.concat());
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn speech_is_relayed_byte_for_byte() {
    let pki = Pki::mint("audio-speech");
    guarded(async {
        let edge = TestEdge::without_provider(&pki);
        let mut node = ready_node(&edge, &pki, "node-a").await;
        const SPEAK: &[u8] =
            br#"{"model":"chat-model","voice":"alloy","input":"Hi.","response_format":"mp3"}"#;
        const MP3: [&[u8]; 2] = [
            b"ID3\x04\x00\x00\x00\x00\x00\x00",
            b"\xff\xfb\x90\x00\r\n\x00",
        ];
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/audio/speech",
            SPEAK,
            b"audio/mpeg",
            &MP3,
        )
        .await;
        assert_eq!(tunnel.operation, "speech");
        assert_eq!(
            &tunnel.body[..],
            br#"{"model":"mock-target-7b","voice":"alloy","input":"Hi.","response_format":"mp3"}"#
        );
        assert_eq!(tunnel_header(&tunnel, "content-type"), b"application/json");
        assert_eq!(tunnel_header(&tunnel, "accept"), b"*/*");
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.header("content-type"), Some("audio/mpeg"));
        assert_eq!(response.body, MP3.concat());
        edge.stop().await;
    })
    .await;
}

#[monoio::test_all(timer_enabled = true)]
async fn a_bad_form_is_the_clients_400_and_no_node_hears_of_it() {
    let pki = Pki::mint("audio-bad-forms");
    guarded(async {
        let options = EdgeOptions {
            max_request_body_bytes: Some(4096),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = ready_node(&edge, &pki, "node-a").await;
        let cases = [
            (
                post(
                    "/v1/audio/transcriptions",
                    &form_type(),
                    &form(&[("file", Some("a.wav"), AUDIO)]),
                ),
                "The form has no `model` field.",
                Some("model"),
            ),
            (
                post(
                    "/v1/audio/transcriptions",
                    "application/json",
                    br#"{"model":"chat-model"}"#,
                ),
                "The request's Content-Type must be multipart/form-data with a boundary: \
                 the media type is another.",
                None,
            ),
            (
                post(
                    "/v1/audio/translations",
                    &form_type(),
                    format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nchat-model")
                        .as_bytes(),
                ),
                "The multipart body is malformed: the body ends inside a part.",
                None,
            ),
        ];
        for (request, message, param) in cases {
            let response = http_exchange(edge.client_addr, request).await;
            assert_eq!(response.status, 400, "{response:?}");
            assert_eq!(
                response.json(),
                api_error(message, "invalid_request_error", param, None)
            );
        }
        // Over the body limit: 413, before a byte reaches a node.
        let big = form(&[
            ("model", None, MODEL.as_bytes()),
            ("file", Some("big.wav"), &[7u8; 5000]),
        ]);
        let response = http_exchange(
            edge.client_addr,
            post("/v1/audio/transcriptions", &form_type(), &big),
        )
        .await;
        assert_eq!(response.status, 413, "{response:?}");
        // The node got nothing: the next tunnel it sees is this speech.
        let (tunnel, response) = tunneled(
            &edge,
            &mut node,
            "/v1/audio/speech",
            br#"{"model":"chat-model","input":"x","voice":"v"}"#,
            b"audio/wav",
            &[b"RIFF"],
        )
        .await;
        assert_eq!((tunnel.operation.as_str(), response.status), ("speech", 200));
        edge.stop().await;
    })
    .await;
}

/// node-a registered as a node that takes streamed tunnel bodies, then
/// ready.
async fn streaming_node(edge: &TestEdge, pki: &Pki) -> RawNode {
    let mut node = RawNode::connect(edge.node_addr, &pki.connector("node-a")).await;
    node.conn
        .send_control(frame(Body::RegisterRequest(pb::RegisterRequest {
            node_id: "node-a".into(),
            node_version: "test".into(),
            flow_control: 1,
            strips_usage_chunk: true,
            runs_embeddings: true,
            accepts_tunnel_body: true,
        })))
        .expect("send register");
    match node.next_frame().await {
        Body::RegisterResponse(r) => assert!(r.accepted),
        other => panic!("expected RegisterResponse, got {other:?}"),
    }
    assert_eq!(node.ready("node-a").await, ready_accepted());
    node
}

#[monoio::test_all(timer_enabled = true)]
async fn an_upload_larger_than_a_whole_body_streams_under_the_nodes_credit() {
    let pki = Pki::mint("audio-streamed");
    guarded(async {
        let options = EdgeOptions {
            max_request_body_bytes: Some(64 * 1024),
            extra_toml: String::new(),
            ..EdgeOptions::without_provider()
        };
        let edge = TestEdge::start(&pki, &edge_toml(&pki, &options));
        let mut node = streaming_node(&edge, &pki).await;
        // 1 MB of audio: sixteen times the whole-body limit.
        let audio: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let sent = form(&[
            ("model", None, MODEL.as_bytes()),
            ("file", Some("big.wav"), &audio),
        ]);
        let expected = form(&[
            ("model", None, TARGET.as_bytes()),
            ("file", Some("big.wav"), &audio),
        ]);
        let addr = edge.client_addr;
        let request = post("/v1/audio/transcriptions", &form_type(), &sent);
        let client = monoio::spawn(async move { http_exchange(addr, request).await });
        let tunnel = next_tunnel(&mut node).await;
        assert_eq!(tunnel.operation, "transcriptions");
        assert!(
            tunnel.body.len() <= 64 * 1024,
            "the first piece is at most a whole body: {}",
            tunnel.body.len()
        );
        assert_eq!(
            tunnel.body.len() as u64 + tunnel.body_follows_bytes,
            expected.len() as u64
        );
        let mut got = tunnel.body.to_vec();
        let (mut charged, mut granted) = (0u64, TUNNEL_BODY_WINDOW);
        let mut credits = 0;
        while got.len() < expected.len() {
            match node.next_frame().await {
                Body::ProviderTunnelBody(piece) => {
                    assert_eq!(piece.run_id, tunnel.run_id);
                    charged += tunnel_body_charge(piece.data.len());
                    assert!(charged <= granted, "{charged} charged, {granted} granted");
                    got.extend_from_slice(&piece.data);
                }
                Body::FlowCredit(_) => continue,
                other => panic!("unexpected frame {other:?}"),
            }
            // Credit as a provider would take the bytes: half a window at
            // a time, once half of it was used.
            if granted - charged < TUNNEL_BODY_WINDOW / 2 {
                granted = charged + TUNNEL_BODY_WINDOW;
                credits += 1;
                node.conn
                    .send_control(frame(Body::FlowCredit(pb::FlowCredit {
                        credits: vec![pb::RunCredit {
                            run_id: tunnel.run_id.clone(),
                            max_offset: granted,
                        }],
                    })))
                    .expect("send credit");
            }
        }
        assert!(credits >= 3, "{credits} credits");
        assert!(
            got == expected,
            "the node got the client's form, model replaced"
        );
        tunnel_answer(&mut node, &tunnel.run_id, b"{\"text\":\"ok\"}").await;
        let response = client.await;
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.body, b"{\"text\":\"ok\"}");
        edge.stop().await;
    })
    .await;
}

/// The node answers `run_id` with a 200 JSON `body` and its end.
async fn tunnel_answer(node: &mut RawNode, run_id: &str, body: &'static [u8]) {
    let frames = [
        answer(
            run_id,
            1,
            pb::TunnelFrameKind::ResponseStart,
            &[("content-type", b"application/json")],
            b"",
        ),
        answer(run_id, 2, pb::TunnelFrameKind::Body, &[], body),
        answer(run_id, 3, pb::TunnelFrameKind::End, &[], b""),
    ];
    for f in frames {
        node.conn.send_bulk(f).await.expect("send an answer frame");
    }
}

#[monoio::test_all(timer_enabled = true)]
async fn an_upload_over_its_limit_is_a_413_before_it_is_read() {
    let pki = Pki::mint("audio-upload-limit");
    guarded(async {
        let options = EdgeOptions {
            extra_toml: String::new(),
            ..EdgeOptions::without_provider()
        };
        let toml = edge_toml(&pki, &options).replacen(
            "[edge]\n",
            "[edge]\nmax_upload_body_bytes = 100000\n",
            1,
        );
        assert!(toml.contains("max_upload_body_bytes = 100000"));
        let edge = TestEdge::start(&pki, &toml);
        let _node = streaming_node(&edge, &pki).await;
        let sent = form(&[
            ("model", None, MODEL.as_bytes()),
            ("file", Some("big.wav"), &[1u8; 100_001]),
        ]);
        let response = http_exchange(
            edge.client_addr,
            post("/v1/audio/transcriptions", &form_type(), &sent),
        )
        .await;
        assert_eq!(response.status, 413, "{response:?}");
        assert_eq!(response.json()["error"]["code"], "request_too_large");
        assert_eq!(edge.edge.control().leases().count(), 0);
        edge.stop().await;
    })
    .await;
}
