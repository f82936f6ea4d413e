"""The official OpenAI SDK against both provider kinds, real processes.

One mock process speaks both protocols: the OpenAI-compatible provider
(`mock-1`, tunnelled) and the Ollama-kind provider (`ollama-1`, normalized
runs: Node NDJSON adapter → RunEvents → Edge chunk translation). Every text
is compared with what the mock itself produces when asked directly.

CONTRACT: E1, E3, E4, U7 — normalized runs and tunnels give the client the
same OpenAI surface, text and tool calls included.
"""

import json
import urllib.request

import openai
import pytest

from iop_harness import MIXED_MODEL, MIXED_OLLAMA_FIRST_MODEL, OLLAMA_MODEL, Cluster, post_raw

TUNNEL_MODEL = "iop-test-model"
TOKENS = 6
EXPECTED_TEXT = "".join(f"tok{i} " for i in range(TOKENS))
MESSAGES = [{"role": "user", "content": "say something deterministic"}]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]
# The mock's deterministic call: each property's position decides its value.
EXPECTED_ARGUMENTS = {"city": "tok0", "days": 1}


@pytest.fixture(scope="module")
def cluster():
    # Paced so a stream is still in flight while a second request is admitted
    # (the mixed-dispatch test); --tool-calls answers requests with tools.
    with Cluster(ollama=True, mock_args=["--tokens", str(TOKENS), "--inter-token-ms", "50", "--tool-calls"]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


def _mock_post(cluster, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://{cluster.mock.ready['addr']}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        return json.loads(resp.read())


def _stream_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_mock_says_the_same_in_both_protocols(cluster):
    # The reference the relayed texts are compared with.
    ollama = _mock_post(cluster, "/api/chat", {"model": "mock-model", "messages": MESSAGES, "stream": False})
    openai_direct = _mock_post(cluster, "/v1/chat/completions", {"model": "mock-model", "messages": MESSAGES})
    assert ollama["message"]["content"] == EXPECTED_TEXT
    assert openai_direct["choices"][0]["message"]["content"] == EXPECTED_TEXT


@pytest.mark.parametrize("model", [OLLAMA_MODEL, TUNNEL_MODEL])
def test_non_streaming_text_equals_the_mock_text(client, model):
    # CONTRACT: E1, U7
    r = client.chat.completions.create(model=model, messages=MESSAGES)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == EXPECTED_TEXT
    assert r.choices[0].finish_reason == "stop"
    assert r.model == "mock-model"
    # prompt_eval_count / eval_count (Ollama) and usage (OpenAI) agree.
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, TOKENS, 3 + TOKENS)


@pytest.mark.parametrize("model", [OLLAMA_MODEL, TUNNEL_MODEL])
def test_streaming_text_equals_the_mock_text(client, model):
    # CONTRACT: E1, U7
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True}))
    assert _stream_text(chunks) == EXPECTED_TEXT
    assert len({c.id for c in chunks}) == 1, "one id for every chunk"
    assert len({c.created for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == TOKENS


def test_max_tokens_caps_the_ollama_run(client):
    # CONTRACT: E3 — max_tokens reaches Ollama as options.num_predict.
    r = client.chat.completions.create(model=OLLAMA_MODEL, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].message.content == "tok0 tok1 "
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("model", [OLLAMA_MODEL, TUNNEL_MODEL])
def test_tool_calls_arrive_as_sdk_objects(client, model):
    # CONTRACT: E4 — native tool calls: metadata["openai_tool_calls"] on the
    # normalized path, the provider's own bytes on the tunnel.
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function"
    assert call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == EXPECTED_ARGUMENTS


@pytest.mark.parametrize("model", [OLLAMA_MODEL, TUNNEL_MODEL])
def test_streamed_tool_calls_arrive_as_sdk_deltas(client, model):
    # CONTRACT: E4 — index on every tool-call delta; id, type and name only
    # in the first.
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas, "tool-call deltas"
    assert all(d.index == 0 for d in deltas)
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.type is None and (d.function.name is None) for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == EXPECTED_ARGUMENTS
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["tool_calls"]
    assert _stream_text(chunks) == ""


def test_mixed_dispatch_gives_one_surface(cluster, client):
    # CONTRACT: U7 — one model, an OpenAI-compatible provider (tunnel) and an
    # Ollama provider (normalized run): the first request takes the first
    # provider in config order; while it is in flight the least-loaded
    # choice sends the second to the Ollama provider. Same text, same shape.
    before = cluster.mock_stats()
    first = client.chat.completions.create(model=MIXED_MODEL, messages=MESSAGES, stream=True)
    first_chunks = [next(first)]
    assert cluster.provider("node-a", "mock-1")["in_flight"] == 1
    second = list(client.chat.completions.create(model=MIXED_MODEL, messages=MESSAGES, stream=True))
    first_chunks += list(first)
    after = cluster.mock_stats()
    assert after["chat_requests"] - before["chat_requests"] == 1, "one request took the tunnel"
    assert after["ollama_chat_requests"] - before["ollama_chat_requests"] == 1, "one took the run"
    assert _stream_text(first_chunks) == _stream_text(second) == EXPECTED_TEXT
    for chunks in (first_chunks, second):
        assert all(c.object == "chat.completion.chunk" and c.model == "mock-model" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert first_chunks[0].id.startswith("chatcmpl-mock-"), "the provider's own chunks"
    assert not second[0].id.startswith("chatcmpl-mock-"), "chunks the Edge built from RunEvents"


def test_non_chat_operations_go_only_to_the_openai_compatible_provider(cluster):
    # A model listing its Ollama provider first: /v1/responses and
    # /v1/messages (which the Ollama adapter cannot serve) go to the
    # OpenAI-compatible one every time, never answered 400; chat still
    # takes the first provider by config order.
    before = cluster.mock_stats()
    for _ in range(3):
        status, _, raw = post_raw(cluster.base_url + "/v1/responses",
                                  {"model": MIXED_OLLAMA_FIRST_MODEL, "input": "say hi"})
        assert status == 200, raw
        assert json.loads(raw)["output"][0]["content"][0]["text"] == EXPECTED_TEXT
        status, _, raw = post_raw(cluster.base_url + "/v1/messages",
                                  {"model": MIXED_OLLAMA_FIRST_MODEL, "max_tokens": 16, "messages": MESSAGES})
        assert status == 200, raw
        assert json.loads(raw)["content"][0]["text"] == EXPECTED_TEXT
    status, _, raw = post_raw(cluster.base_url + "/v1/chat/completions",
                              {"model": MIXED_OLLAMA_FIRST_MODEL, "messages": MESSAGES})
    assert status == 200, raw
    after = cluster.mock_stats()
    assert after["ollama_chat_requests"] - before["ollama_chat_requests"] == 1
    assert after["chat_requests"] == before["chat_requests"]
    # A model of Ollama providers only has no candidate: the 400 stays.
    status, _, raw = post_raw(cluster.base_url + "/v1/responses", {"model": OLLAMA_MODEL, "input": "say hi"})
    assert status == 400, raw
    assert json.loads(raw)["error"]["message"] == f"No provider serving `{OLLAMA_MODEL}` supports /v1/responses."


def test_ollama_capabilities_prove_the_target(cluster):
    # CONTRACT: H6, K2 — the Ollama adapter's exact-target probe reads
    # /api/tags, which lists the provider's target.
    status, _, raw = post_raw(f"{cluster.base_url}/admin/nodes/node-a/commands",
                              {"type": "capabilities", "adapter": "ollama"})
    assert status == 200, raw
    [cap] = json.loads(raw)["capabilities"]
    assert (cap["adapter_key"], cap["target"], cap["provider_status"]) == ("ollama", "mock-model", "available")
