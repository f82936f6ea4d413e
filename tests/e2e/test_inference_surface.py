"""The inference surface beyond chat, end to end: the official OpenAI SDK (and
httpx2, the SDK's own HTTP client, for the routes the SDK has no method for)
→ Edge → mTLS → Node → mock provider, real processes.

For every operation: the bytes the mock sends are the bytes the client gets
(the mock's answer to the same request sent to it directly, its one volatile
field — a response id counted per request — masked on both sides), and the
mock saw the provider's target, not the external model, as `model`. A model
whose providers cannot serve an operation answers 400 naming it. A key's
token budget counts embeddings and text completions, and the usage file and
the request counters show each operation.

CONTRACT: U1, U2, U5, E2 — the client receives exactly what the provider sent,
addressed by the external model name and served under the provider's target.
"""

import json
import re
import struct
import tempfile
import time
from pathlib import Path

import httpx2
import openai
import pytest

from iop_harness import OLLAMA_MODEL, Cluster, wait_until

MODEL = "iop-test-model"
TARGET = "mock-model"
# A model whose name has a slash and a space, as many served names do.
SLASHED = "org/iop test model"
KEY = "sk-surface-e2e-4d1a9c"
EMBED_BUDGET_KEY = "sk-surface-e2e-embed-7f20b3"
COMPLETION_BUDGET_KEY = "sk-surface-e2e-cmpl-5c8e61"
TOKENS_PER_MINUTE = 100
# The mock's completion length (chat and text completions, before max_tokens).
MOCK_TOKENS = 200

# The ids the mock counts per request (`cmpl-mock-7`, `rerank-mock-8`, …).
MOCK_ID = re.compile(rb'"id":"[a-z]+-mock-[0-9]+"')


def masked(body: bytes) -> bytes:
    return MOCK_ID.sub(b'"id":"<id>"', body)


@pytest.fixture(scope="module")
def usage_path():
    return Path(tempfile.mkdtemp(prefix="iop-surface-usage-")) / "usage.jsonl"


@pytest.fixture(scope="module")
def cluster(usage_path):
    # vLLM's profile serves every operation; the Ollama-only model serves
    # chat alone (ollama=True).
    with Cluster(
        profile="vllm",
        ollama=True,
        mock_args=["--tokens", str(MOCK_TOKENS)],
        client_keys={
            "surface": KEY,
            "embed-budget": {"key": EMBED_BUDGET_KEY, "tokens_per_minute": TOKENS_PER_MINUTE},
            "cmpl-budget": {"key": COMPLETION_BUDGET_KEY, "tokens_per_minute": TOKENS_PER_MINUTE},
        },
        edge_extra=["[edge.usage_log]", f'path = "{usage_path}"'],
        extra_toml=["[[models]]", f'name = "{SLASHED}"', 'providers = ["node-a/mock-1"]'],
    ) as c:
        yield c


def sdk(cluster, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def client(cluster):
    return sdk(cluster)


@pytest.fixture(scope="module")
def http(cluster):
    with httpx2.Client(base_url=cluster.base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=20) as c:
        yield c


@pytest.fixture(scope="module")
def direct(cluster):
    """The mock itself, asked as the Node asks it (model = the target)."""
    with httpx2.Client(base_url=cluster.mock_url(), timeout=20) as c:
        yield c


def provider_saw_target(cluster) -> None:
    assert cluster.mock_stats()["last_model"] == TARGET


def as_target(body: dict) -> dict:
    return dict(body, model=TARGET)


def f32(x: float) -> float:
    """`x` rounded to the nearest f32: the value whose shortest form the mock
    writes into a float embedding."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


PROMPT = "def add(a, b):"
SUFFIX = "\n    return total\n"


def test_a_completion_with_a_suffix_is_the_providers(client, cluster, direct):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, suffix=SUFFIX, max_tokens=3)
    provider_saw_target(cluster)
    completion = raw.parse()
    # The mock ends the text with the suffix's length: it was passed through.
    assert completion.choices[0].text == f"tok0 tok1 tok2 [suffix:{len(SUFFIX)}]"
    assert (completion.model, completion.choices[0].finish_reason) == (TARGET, "length")
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 3)
    expected = direct.post("/v1/completions", json={"model": TARGET, "prompt": PROMPT, "suffix": SUFFIX,
                                                    "max_tokens": 3})
    relayed = raw.http_response.content
    assert masked(relayed) == masked(expected.content)
    assert masked(relayed) != relayed, "the mask found the id"


def test_a_streamed_completion_is_the_providers_events(client, cluster, direct):
    body = {"model": MODEL, "prompt": PROMPT, "suffix": SUFFIX, "max_tokens": 4, "stream": True}
    text = "".join(c.choices[0].text for c in client.completions.create(**body) if c.choices)
    assert text == f"tok0 tok1 tok2 tok3 [suffix:{len(SUFFIX)}]"
    with client.completions.with_streaming_response.create(**body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        relayed = b"".join(response.iter_bytes())
    provider_saw_target(cluster)
    # The Edge asks the provider for usage (limits, usage records) and the
    # Node leaves the usage-only event out: the client gets every other
    # event of the provider's answer to that request.
    expected = direct.post("/v1/completions", json=dict(as_target(body), stream_options={"include_usage": True}))
    events = [e + b"\n\n" for e in expected.content.split(b"\n\n") if e]
    usage_events = [e for e in events if b'"choices":[],"usage":{' in e]
    assert len(usage_events) == 1
    assert json.loads(usage_events[0][len(b"data: "):])["usage"]["completion_tokens"] == 4
    assert masked(relayed) == masked(b"".join(e for e in events if e not in usage_events))
    assert relayed.endswith(b"data: [DONE]\n\n")


def test_embeddings_of_a_list_as_floats_are_the_providers(client, cluster, direct):
    inputs = ["the first text", "a second one"]
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=inputs, encoding_format="float")
    provider_saw_target(cluster)
    expected = direct.post("/v1/embeddings", json={"model": TARGET, "input": inputs, "encoding_format": "float"})
    assert raw.http_response.content == expected.content
    parsed = raw.parse()
    vectors = [d["embedding"] for d in expected.json()["data"]]
    assert [d.embedding for d in parsed.data] == vectors
    assert len(vectors) == 2 and len(vectors[0]) == 8 and vectors[0] != vectors[1]
    assert (parsed.model, parsed.usage.prompt_tokens) == (TARGET, 6)


def test_base64_embeddings_decode_to_the_providers_floats(client, cluster, direct):
    # Without encoding_format the SDK asks for base64 and decodes it.
    raw = client.embeddings.with_raw_response.create(model=MODEL, input="one text to embed")
    assert json.loads(raw.http_response.request.content)["encoding_format"] == "base64"
    provider_saw_target(cluster)
    expected = direct.post("/v1/embeddings", json={"model": TARGET, "input": "one text to embed",
                                                   "encoding_format": "base64"})
    assert raw.http_response.content == expected.content
    assert isinstance(expected.json()["data"][0]["embedding"], str)
    floats = direct.post("/v1/embeddings", json={"model": TARGET, "input": "one text to embed"}).json()
    decoded = raw.parse().data[0].embedding
    assert decoded == [f32(x) for x in floats["data"][0]["embedding"]]
    assert len(decoded) == 8


def test_a_model_is_retrieved_by_a_percent_encoded_id(client):
    listed = {m.id: m for m in client.models.list().data}
    raw = client.models.with_raw_response.retrieve(SLASHED)
    # The SDK encodes the slash and the space; the Edge decodes them.
    assert raw.http_response.request.url.raw_path == b"/v1/models/org%2Fiop%20test%20model"
    model = raw.parse()
    assert (model.id, model.object, model.owned_by, model.created) == (
        SLASHED, "model", listed[SLASHED].owned_by, listed[SLASHED].created)
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize(
    "path, documents",
    [
        # Jina's shape: documents as strings.
        ("/v1/rerank", ["a cat sat", "the cat sat on the mat", "dogs bark"]),
        # Cohere's: documents may be objects with a text.
        ("/v2/rerank", [{"text": "a cat sat"}, {"text": "the cat sat on the mat"}, {"text": "dogs bark"}]),
    ],
)
def test_a_rerank_is_the_providers(http, cluster, direct, path, documents):
    body = {"model": MODEL, "query": "the cat sat", "documents": documents, "top_n": 2,
            "return_documents": True}
    relayed = http.post(path, json=body)
    assert relayed.status_code == 200, relayed.text
    provider_saw_target(cluster)
    expected = direct.post(path, json=as_target(body))
    assert masked(relayed.content) == masked(expected.content)
    answer = relayed.json()
    assert answer["model"] == TARGET
    # Word-set overlap with the query: 3/5, then 2/4.
    assert [(r["index"], r["document"]["text"], r["relevance_score"]) for r in answer["results"]] == [
        (1, "the cat sat on the mat", 0.6), (0, "a cat sat", 0.5)]


def test_a_score_is_the_providers(http, cluster, direct):
    body = {"model": MODEL, "text_1": "the cat sat", "text_2": ["the cat sat", "a dog ran"]}
    relayed = http.post("/v1/score", json=body)
    assert relayed.status_code == 200, relayed.text
    provider_saw_target(cluster)
    expected = direct.post("/v1/score", json=as_target(body))
    assert masked(relayed.content) == masked(expected.content)
    assert [d["score"] for d in relayed.json()["data"]] == [1.0, 0.0]


def test_tokenize_and_detokenize_are_the_providers(http, cluster, direct):
    body = {"model": MODEL, "prompt": "hello tokenizer world"}
    relayed = http.post("/tokenize", json=body)
    assert relayed.status_code == 200, relayed.text
    provider_saw_target(cluster)
    expected = direct.post("/tokenize", json=as_target(body))
    assert relayed.content == expected.content
    tokens = relayed.json()["tokens"]
    assert relayed.json()["count"] == 3
    back = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert back.status_code == 200, back.text
    provider_saw_target(cluster)
    assert back.content == direct.post("/detokenize", json={"model": TARGET, "tokens": tokens}).content
    assert back.json() == {"prompt": "hello tokenizer world"}


def openai_error(message: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def test_an_operation_no_provider_serves_is_a_400_naming_it(client, http, cluster):
    # The Ollama-only model's providers speak chat alone.
    stats_before = cluster.mock_stats()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=OLLAMA_MODEL, prompt="hi")
    assert refused.value.status_code == 400
    assert refused.value.body == openai_error(f"No provider serving `{OLLAMA_MODEL}` supports /v1/completions.")[
        "error"]
    for path, body in [
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
        ("/v2/rerank", {"query": "q", "documents": ["d"]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/tokenize", {"prompt": "a b"}),
        ("/detokenize", {"tokens": [1]}),
    ]:
        answer = http.post(path, json=dict(body, model=OLLAMA_MODEL))
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json() == openai_error(f"No provider serving `{OLLAMA_MODEL}` supports {path}."), path
    # A tokenizer route without a model: the Edge picks none.
    answer = http.post("/tokenize", json={"prompt": "a b"})
    assert answer.status_code == 400
    assert answer.json() == openai_error("You must provide a `model` parameter.", param="model")
    # None of these reached the provider.
    after = cluster.mock_stats()
    for counter in ("completions_requests", "rerank_requests", "score_requests", "tokenize_requests",
                    "detokenize_requests"):
        assert after[counter] == stats_before[counter], counter


def test_a_keys_token_budget_counts_embeddings(cluster):
    budget = sdk(cluster, EMBED_BUDGET_KEY)
    # 120 one-letter words: estimated (bytes / 4) within the budget, charged
    # the provider's 120 prompt tokens.
    words = " ".join(["a"] * 120)
    first = budget.embeddings.create(model=MODEL, input=words, encoding_format="float")
    assert first.usage.prompt_tokens == 120
    with pytest.raises(openai.RateLimitError) as refused:
        budget.embeddings.create(model=MODEL, input=words, encoding_format="float")
    assert refused.value.body["code"] == "rate_limit_tokens"


def test_a_keys_token_budget_counts_a_streamed_completion(cluster):
    budget = sdk(cluster, COMPLETION_BUDGET_KEY)
    # The client asks no usage; the Edge does, and charges the 150 tokens.
    chunks = list(budget.completions.create(model=MODEL, prompt="hi", max_tokens=150, stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("tok0 tok1 ")
    with pytest.raises(openai.RateLimitError) as refused:
        budget.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert refused.value.body["code"] == "rate_limit_tokens"


def usage_records(path: Path) -> dict:
    if not path.exists():
        return {}
    return {r["request_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def requests_total(cluster, route: str, code: str) -> float:
    text = httpx2.get(cluster.base_url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=10).text
    wanted = f'iop_edge_requests_total{{route="{route}",model="{MODEL}",code="{code}"}} '
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    return float(lines[0][len(wanted):]) if lines else 0.0


def test_each_operation_has_its_usage_record_and_counter(client, http, cluster, usage_path):
    before = {route: requests_total(cluster, route, "200") for route in
              ("completions", "embeddings", "rerank", "score", "tokenize", "detokenize")}
    tag = f"surface-{time.monotonic_ns()}"
    ids = {op: f"{tag}-{op}" for op in ("completions", "embeddings", "rerank", "score", "tokenize",
                                        "detokenize")}
    client.completions.create(model=MODEL, prompt="one two", max_tokens=2,
                              extra_headers={"x-request-id": ids["completions"]})
    client.embeddings.create(model=MODEL, input=["a b c", "d"],
                             extra_headers={"x-request-id": ids["embeddings"]})
    for op, path, body in [
        ("rerank", "/v1/rerank", {"query": "a b", "documents": ["a", "b c"]}),
        ("score", "/v1/score", {"text_1": "a b", "text_2": ["a", "c d e"]}),
        ("tokenize", "/tokenize", {"prompt": "x y"}),
        ("detokenize", "/detokenize", {"tokens": [1, 2]}),
    ]:
        answer = http.post(path, json=dict(body, model=MODEL), headers={"x-request-id": ids[op]})
        assert answer.status_code == 200, (op, answer.text)
    wait_until(lambda: set(ids.values()) <= set(usage_records(usage_path)), what="the usage records")
    records = usage_records(usage_path)

    def tokens(op):
        r = records[ids[op]]
        assert (r["principal"], r["model"], r["provider"], r["status"], r["outcome"]) == (
            "surface", MODEL, "node-a/mock-1", 200, "completed"), r
        return r["path"], r["usage"], r["prompt_tokens"], r["completion_tokens"], r["total_tokens"]

    # The provider's counts: words as tokens (score counts each pair's);
    # rerank's usage has a total alone (the words of the query and
    # documents, counted as prompt); the tokenizer routes report none.
    assert tokens("completions") == ("/v1/completions", "reported", 2, 2, 4)
    assert tokens("embeddings") == ("/v1/embeddings", "reported", 4, 0, 4)
    assert tokens("rerank") == ("/v1/rerank", "reported", 5, 0, 5)
    assert tokens("score") == ("/v1/score", "reported", 8, 0, 8)
    assert tokens("tokenize") == ("/tokenize", "none", None, None, None)
    assert tokens("detokenize") == ("/detokenize", "none", None, None, None)
    # The request counters, by operation.
    for route, count in before.items():
        assert requests_total(cluster, route, "200") == count + 1, route
