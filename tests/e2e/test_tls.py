"""TLS where users need it, with real processes: the Edge's client listener
over HTTPS (the official OpenAI and Anthropic SDKs trusting the test CA),
providers behind https:// base URLs (a tunnel and a normalized run,
streaming and not), a credential lease injected into an HTTPS provider
call, and the provider certificates a Node must refuse, each with its
error code to the client.

Certificates come from `bench tls-fixtures` (one test CA; an HTTPS
certificate for localhost/127.0.0.1, one for another host, an expired one,
one from a CA nobody trusts).
"""

import json
import re
import socket
import ssl
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from iop_harness import OLLAMA_MODEL, Cluster, post_raw, sse_data

TUNNEL_MODEL = "iop-test-model"
TOKENS = 6
EXPECTED_TEXT = "".join(f"tok{i} " for i in range(TOKENS))
MESSAGES = [{"role": "user", "content": "say something deterministic"}]


def _ids_out(raw: bytes) -> bytes:
    """The mock numbers its completions (chatcmpl-mock-<seq>) and stamps
    each object with its send time (iop_mock_sent_ns); everything else of
    two answers to one request is the same bytes."""
    raw = re.sub(rb"chatcmpl-mock-\d+", b"chatcmpl-mock-N", raw)
    return re.sub(rb'"iop_mock_sent_ns":\d+', b'"iop_mock_sent_ns":0', raw)


def _direct(cluster, path: str, body: dict) -> bytes:
    """The mock's own answer, asked over HTTPS directly."""
    req = urllib.request.Request(cluster.mock_url() + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=20, context=cluster.ssl_context()) as resp:
        return resp.read()


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ollama=True, provider_tls="https", client_tls=True,
                 mock_args=["--tokens", str(TOKENS)]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cluster.ca_file()))
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20,
                         http_client=http)


def test_the_client_listener_refuses_plain_http_and_untrusting_clients(cluster):
    assert cluster.base_url.startswith("https://localhost:")
    port = cluster.base_url.rsplit(":", 1)[1]
    # Plain HTTP to the HTTPS listener gets no HTTP answer.
    with pytest.raises(Exception):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5).read()
    # A client that does not trust the test CA refuses the certificate.
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(cluster.base_url + "/livez", timeout=5,
                               context=ssl.create_default_context()).read()
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
    # The listener offers http/1.1 by ALPN and presents the fixture
    # certificate.
    ctx = cluster.ssl_context()
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", int(port)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            assert tls.selected_alpn_protocol() == "http/1.1"
            assert tls.getpeercert()["serialNumber"].lower().lstrip("0") == \
                cluster.serials["https.pem"].lstrip("0")


@pytest.mark.parametrize("model", [TUNNEL_MODEL, OLLAMA_MODEL])
def test_sdk_over_https_through_an_https_provider(client, model):
    # The OpenAI SDK over HTTPS; the Node reaches the provider over HTTPS
    # (a tunnel for the OpenAI-compatible provider, a normalized run for
    # the Ollama one).
    r = client.chat.completions.create(model=model, messages=MESSAGES)
    assert r.choices[0].message.content == EXPECTED_TEXT
    assert r.model == "mock-model"
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == EXPECTED_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_tunnel_over_https_is_byte_exact(cluster):
    # CONTRACT: U1, U2 — the provider's bytes, through TLS on both hops.
    ctx = cluster.ssl_context()
    for stream in (False, True):
        body = {"model": TUNNEL_MODEL, "messages": MESSAGES, "stream": stream}
        status, headers, relayed = post_raw(cluster.base_url + "/v1/chat/completions", body, context=ctx)
        assert status == 200, relayed
        direct = {**body, "model": "mock-model"}
        if stream:
            # The Edge asks for the usage the client did not ask for; the
            # Node leaves that usage-only event out of the relayed bytes.
            direct["stream_options"] = {"include_usage": True}
        expected = _direct(cluster, "/v1/chat/completions", direct)
        if stream:
            events = expected.split(b"\n\n")
            kept = [e for e in events if b'"choices":[],"usage":{' not in e]
            assert len(kept) == len(events) - 1, expected
            expected = b"\n\n".join(kept)
        assert _ids_out(relayed) == _ids_out(expected)
        if stream:
            assert {k.lower(): v for k, v in headers.items()}["content-type"] == "text/event-stream"
            assert sse_data(relayed)[-1] == "[DONE]"


def test_normalized_run_over_https_streams_every_token(cluster):
    ctx = cluster.ssl_context()
    status, _, raw = post_raw(cluster.base_url + "/v1/chat/completions",
                              {"model": OLLAMA_MODEL, "messages": MESSAGES, "stream": True}, context=ctx)
    assert status == 200, raw
    events = sse_data(raw)
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert [d for d in deltas if d] == [f"tok{i} " for i in range(TOKENS)]


def test_anthropic_sdk_over_https(cluster):
    http = anthropic.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cluster.ca_file()))
    client = anthropic.Anthropic(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=20,
                                 http_client=http)
    message = client.messages.create(model=TUNNEL_MODEL, max_tokens=64, messages=MESSAGES)
    assert message.type == "message"
    assert "".join(b.text for b in message.content if b.type == "text")
    with client.messages.stream(model=TUNNEL_MODEL, max_tokens=64, messages=MESSAGES) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == "".join(b.text for b in message.content if b.type == "text")


def test_the_ssl_cert_file_variable_is_enough_for_the_sdk(cluster, monkeypatch):
    # The SDKs' default client honours SSL_CERT_FILE: no code change needed
    # to trust a private CA.
    monkeypatch.setenv("SSL_CERT_FILE", cluster.ca_file())
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)
    assert [m.id for m in client.models.list().data][0] == TUNNEL_MODEL


@pytest.fixture(scope="module")
def managed():
    # CONTRACT: C2 — the lease's header reaches an https:// provider; the
    # mock answers 401 without it.
    with Cluster(provider_tls="https", credentials={"secret": "sk-over-tls"},
                 mock_args=["--require-api-key", "sk-over-tls", "--tokens", str(TOKENS)]) as c:
        yield c


def test_a_credential_lease_is_injected_into_an_https_provider_call(managed):
    ctx = managed.ssl_context()
    for stream in (False, True):
        status, _, raw = post_raw(managed.base_url + "/v1/chat/completions",
                                  {"model": TUNNEL_MODEL, "messages": MESSAGES, "stream": stream}, context=ctx)
        assert status == 200, raw
        if stream:
            text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                           for e in sse_data(raw)[:-1] if json.loads(e)["choices"])
        else:
            text = json.loads(raw)["choices"][0]["message"]["content"]
        assert text == EXPECTED_TEXT
    # The lease was bound to the https origin the Node calls; the provider
    # never saw a request without the key.
    assert managed.mock_stats()["chat_requests"] == 2
    # C4: the secret never shows in a log.
    assert "sk-over-tls" not in managed.edge.log()
    assert "sk-over-tls" not in managed.nodes["node-a"].log()


# The fixture, and rustls' words for why the Node refused it.
REFUSALS = [
    ("wrong-host", 'certificate not valid for name "localhost"'),
    ("expired", "certificate expired"),
    ("unknown-ca", "UnknownIssuer"),
]


@pytest.fixture(scope="module", params=REFUSALS, ids=[r[0] for r in REFUSALS])
def refusing(request):
    fixture, reason = request.param
    with Cluster(ollama=True, provider_tls=fixture) as c:
        yield c, reason


@pytest.mark.parametrize("model", [TUNNEL_MODEL, OLLAMA_MODEL])
def test_a_refused_provider_certificate_is_provider_tls_to_the_client(refusing, model):
    cluster, reason = refusing
    for stream in (False, True):
        status, _, raw = post_raw(cluster.base_url + "/v1/chat/completions",
                                  {"model": model, "messages": MESSAGES, "stream": stream})
        assert status == 502, raw
        # CONTRACT: W6 — a failure that is not a stall: code and message.
        # The message names no host (the handshake error's words, which
        # do, stay in the Edge's log).
        error = json.loads(raw)["error"]
        assert error["code"] == "provider_tls", error
        assert error["message"] == ("The TLS handshake with the provider failed (its certificate "
                                    "was refused or the handshake broke off)."), error
    # The log line quotes the detail (its inner quotes escaped).
    log = cluster.edge.log()
    assert reason.replace('"', '\\"') in log, log
    assert "TLS handshake with localhost failed" in log, log
    # The mock saw the Node refuse its certificate, and no request.
    stats = cluster.mock_stats()
    assert stats["tls_handshake_failures"] >= 2
    assert stats["chat_requests"] == 0 and stats["ollama_chat_requests"] == 0
