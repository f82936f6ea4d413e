"""Official OpenAI SDK → Edge → mTLS → Node → mock provider, real processes.

CONTRACT: U1, U2, U5, E2 — the client receives exactly what the provider sent,
addressed by the external model name and served under the provider's target.
"""

import json
import urllib.error
import urllib.request

import openai
import pytest

from iop_harness import Cluster

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "say something deterministic"}]


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def direct(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.mock.ready['addr']}/v1", api_key="unused", max_retries=0)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "offline-model"]


def test_a_model_is_retrieved_from_the_edges_list(client):
    listed = {m.id: m for m in client.models.list().data}
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by, model.created) == (
        MODEL,
        "model",
        listed[MODEL].owned_by,
        listed[MODEL].created,
    )
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("no-such-model")
    assert refused.value.status_code == 404
    assert refused.value.body == {
        "message": "The model `no-such-model` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_non_streaming_text_equals_the_provider_text(client, direct):
    # CONTRACT: E2, U5
    relayed = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    expected = direct.chat.completions.create(model="mock-model", messages=MESSAGES)
    assert relayed.choices[0].message.content == expected.choices[0].message.content
    assert relayed.choices[0].message.content  # the mock always says something
    # The provider saw its own target name, not the external model (U5).
    assert relayed.model == "mock-model"
    assert relayed.usage.completion_tokens == expected.usage.completion_tokens


def test_streaming_text_equals_the_provider_text(client, direct):
    # CONTRACT: U1, U2
    relayed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        if c.choices
    )
    expected = "".join(
        c.choices[0].delta.content or ""
        for c in direct.chat.completions.create(model="mock-model", messages=MESSAGES, stream=True)
        if c.choices
    )
    assert relayed == expected and relayed


def test_include_usage_yields_the_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1
    assert usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens > 0
    assert chunks[-1] is usage_chunks[0]


def test_a_stream_without_include_usage_gets_no_usage_chunk(client):
    # The Edge asks the provider for usage anyway (limits, usage records,
    # metrics) and the Node leaves the usage chunk out: a client that reads
    # choices[0] of every chunk keeps working.
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found"


def _raw_sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_relayed_events_are_the_provider_events(cluster):
    # CONTRACT: U2 — body bytes pass through unchanged: every event the
    # provider produced arrives with identical content, in order.
    volatile = {"id", "created", "iop_mock_sent_ns"}
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    relayed = _raw_sse(cluster.base_url + "/v1/chat/completions", body)
    # The Edge asks the provider for the usage the client did not ask for,
    # and the Node leaves that one usage-only event out: the client gets
    # every other event the provider sent for the body the Edge built.
    direct = _raw_sse(
        f"http://{cluster.mock.ready['addr']}/v1/chat/completions",
        dict(body, model="mock-model", stream_options={"include_usage": True}),
    )
    assert direct[-1]["choices"] == [] and direct[-1]["usage"]["completion_tokens"] > 0
    strip = lambda evs: [{k: v for k, v in e.items() if k not in volatile} for e in evs]  # noqa: E731
    assert strip(relayed) == strip(direct[:-1])
    assert len({e["id"] for e in relayed}) == 1


@pytest.mark.parametrize(
    "body, status, code",
    [
        (b"{not json", 400, None),
        (json.dumps({"model": "nope", "messages": []}).encode(), 404, "model_not_found"),
    ],
)
def test_bad_requests_get_openai_errors(cluster, body, status, code):
    req = urllib.request.Request(
        cluster.base_url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == status
    err = json.loads(e.value.read())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code


def test_no_ready_provider_is_503_with_retry_after(cluster):
    # CONTRACT: R4 — a configured but never-ready node is no dispatch candidate.
    req = urllib.request.Request(
        cluster.base_url + "/v1/chat/completions",
        data=json.dumps({"model": "offline-model", "messages": MESSAGES}).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 503
    assert int(e.value.headers["retry-after"]) >= 1
    assert json.loads(e.value.read())["error"]["code"] == "no_provider_available"


def test_body_over_the_limit_is_413(cluster):
    # The Edge answers from the head alone: Content-Length over the limit is
    # refused before any of the body is read.
    import socket

    host, port = cluster.edge.ready["client"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 9437184\r\n\r\n"
        )
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = s.recv(65536)
            assert chunk, "connection closed before a response"
            raw += chunk
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 ")
        length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0].split(b":")[1])
        while len(rest) < length:
            chunk = s.recv(65536)
            assert chunk
            rest += chunk
        assert json.loads(rest[:length])["error"]["code"] == "request_too_large"
