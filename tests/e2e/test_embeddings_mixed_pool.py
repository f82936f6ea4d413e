"""Embeddings through the official OpenAI SDK on Ollama providers (a
normalized run over /api/embed, translated by the Edge) and on a mixed pool
(an OpenAI-compatible and an Ollama provider), real processes.

The mock provider computes the same vectors and token counts on both of its
routes (`/v1/embeddings`, `/api/embed`), so what the Edge answers from an
Ollama provider is compared, byte for byte, with what the mock itself
answers in the OpenAI shape: only `model` differs (the client's name on the
translated answer, the provider's target on the tunneled one). Usage records
and a key's tokens_per_minute count their prompt tokens either way.
"""

import base64
import json
import struct

import openai
import pytest

from iop_harness import MIXED_MODEL, MIXED_OLLAMA_FIRST_MODEL, OLLAMA_MODEL, Cluster, post_raw

TEXTS = ["the quick brown fox", "jumps over", "the lazy dog"]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ollama=True) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


def mock_answer(cluster, body: dict) -> bytes:
    """The mock's own OpenAI answer for `body` (model: the target)."""
    status, _, raw = post_raw(cluster.mock_url() + "/v1/embeddings", {**body, "model": "mock-model"})
    assert status == 200, raw
    return raw


def edge_raw(cluster, body: dict) -> bytes:
    status, headers, raw = post_raw(cluster.base_url + "/v1/embeddings", body)
    assert status == 200, raw
    assert headers["content-type"].startswith("application/json")
    return raw


def as_model(raw: bytes, model: str) -> bytes:
    """`raw` with its one `model` member naming `model`."""
    assert raw.count(b'"model":"mock-model"') == 1
    return raw.replace(b'"model":"mock-model"', b'"model":' + json.dumps(model).encode())


def floats(b64: str) -> list[float]:
    data = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def as_f32(values: list[float]) -> list[float]:
    """JSON numbers (the shortest decimals of f32s) as the f32s they name."""
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def test_an_ollama_pool_answers_as_openai_does(cluster, client):
    before = cluster.mock_stats()
    for body in (
        {"input": TEXTS[0]},
        {"input": TEXTS, "encoding_format": "float"},
        {"input": TEXTS, "encoding_format": "base64"},
        {"input": TEXTS[:2], "encoding_format": "float", "dimensions": 5},
    ):
        body = {"model": OLLAMA_MODEL, **body}
        assert edge_raw(cluster, body) == as_model(mock_answer(cluster, body), OLLAMA_MODEL), body
    after = cluster.mock_stats()
    assert after["ollama_embed_requests"] - before["ollama_embed_requests"] == 4
    assert after["embeddings_requests"] - before["embeddings_requests"] == 4, "only the test's own"

    # The SDK: float, base64 (the SDK decodes it), a list of inputs.
    expected = json.loads(mock_answer(cluster, {"input": TEXTS, "encoding_format": "base64"}))
    vectors = [floats(d["embedding"]) for d in expected["data"]]
    as_float = client.embeddings.create(model=OLLAMA_MODEL, input=TEXTS, encoding_format="float")
    assert as_float.model == OLLAMA_MODEL
    assert [d.index for d in as_float.data] == [0, 1, 2]
    assert [as_f32(d.embedding) for d in as_float.data] == vectors
    # Words: 4 + 2 + 3, as the mock counts tokens.
    assert (as_float.usage.prompt_tokens, as_float.usage.total_tokens) == (9, 9)
    as_base64 = client.embeddings.create(model=OLLAMA_MODEL, input=TEXTS, encoding_format="base64")
    assert [d.embedding for d in as_base64.data] == [d["embedding"] for d in expected["data"]]
    one = client.embeddings.create(model=OLLAMA_MODEL, input="jumps over", encoding_format="float")
    assert [as_f32(d.embedding) for d in one.data] == [vectors[1]]
    assert one.usage.prompt_tokens == 2


def test_token_ids_are_a_clear_400_for_an_ollama_pool(cluster, client):
    before = cluster.mock_stats()
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=OLLAMA_MODEL, input=[[1, 2, 3]], encoding_format="float")
    assert refused.value.body == {
        "message": "Token-id `input` cannot be embedded by an Ollama provider; send text.",
        "type": "invalid_request_error",
        "param": "input",
        "code": None,
    }
    assert cluster.mock_stats()["ollama_embed_requests"] == before["ollama_embed_requests"]


def test_a_mixed_pool_routes_embeddings_both_ways(cluster, client):
    # MIXED_MODEL lists the OpenAI-compatible provider first, the other one
    # the Ollama provider first: with both free, each takes its first.
    body = {"input": TEXTS, "encoding_format": "float"}
    before = cluster.mock_stats()
    tunneled = edge_raw(cluster, {"model": MIXED_MODEL, **body})
    middle = cluster.mock_stats()
    translated = edge_raw(cluster, {"model": MIXED_OLLAMA_FIRST_MODEL, **body})
    after = cluster.mock_stats()
    direct = mock_answer(cluster, body)
    assert (middle["embeddings_requests"] - before["embeddings_requests"],
            middle["ollama_embed_requests"] - before["ollama_embed_requests"]) == (1, 0), "the tunnel"
    assert (after["embeddings_requests"] - middle["embeddings_requests"],
            after["ollama_embed_requests"] - middle["ollama_embed_requests"]) == (0, 1), "the run"
    # The tunnel relays the provider's bytes (its target as `model`); the
    # run's answer is the same list under the client's model name.
    assert tunneled == direct
    assert translated == as_model(direct, MIXED_OLLAMA_FIRST_MODEL)
    # And through the SDK, base64 both ways.
    for model in (MIXED_MODEL, MIXED_OLLAMA_FIRST_MODEL):
        got = client.embeddings.create(model=model, input=TEXTS[:1], encoding_format="base64")
        want = json.loads(mock_answer(cluster, {"input": TEXTS[:1], "encoding_format": "base64"}))
        assert [d.embedding for d in got.data] == [want["data"][0]["embedding"]]
        assert got.usage.prompt_tokens == 4


def test_embeddings_usage_is_recorded_and_counts_against_the_token_limit(tmp_path):
    # The usage file has the prompt tokens of a run and of a tunnel; a key's
    # tokens_per_minute is spent by them: with 10 a minute, a 9-token
    # request leaves too little for the next.
    usage = tmp_path / "usage.jsonl"
    keys = {"run": "sk-embed-run-5b0e7f", "tunnel": "sk-embed-tunnel-91c3d2"}
    with Cluster(ollama=True,
                 client_keys={name: {"key": key, "tokens_per_minute": 10} for name, key in keys.items()},
                 edge_extra=["[edge.usage_log]", f'path = "{usage}"']) as c:
        seen = []
        for name, model in (("run", OLLAMA_MODEL), ("tunnel", MIXED_MODEL)):
            client = openai.OpenAI(base_url=c.base_url + "/v1", api_key=keys[name], max_retries=0, timeout=20)
            # 9 tokens: 4 + 2 + 3 words.
            r = client.embeddings.with_raw_response.create(model=model, input=TEXTS, encoding_format="float")
            assert r.parse().usage.prompt_tokens == 9
            seen.append((r.headers["x-request-id"], model))
            with pytest.raises(openai.RateLimitError) as refused:
                client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
            assert refused.value.code == "rate_limit_tokens", name
        stats = c.mock_stats()
        assert (stats["ollama_embed_requests"], stats["embeddings_requests"]) == (1, 1)
        c.edge.stop()
    records = {r["request_id"]: r for r in map(json.loads, usage.read_text().splitlines())}
    for request_id, model in seen:
        r = records[request_id]
        assert (r["model"], r["outcome"], r["usage"]) == (model, "completed", "reported"), r
        assert (r["prompt_tokens"], r["completion_tokens"]) == (9, 0), r
