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

mod common;

use common::*;

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
