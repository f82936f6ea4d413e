"""Per-key limits and the usage file, real processes (Edge, Node, mock).

- The official OpenAI SDK meets a key's `requests_per_minute`: with retries
  off it raises `RateLimitError` carrying `retry-after`, `retry-after-ms` and
  the `x-ratelimit-*` headers; with retries on it waits as `retry-after-ms`
  says and then succeeds.
- A key limited to some models gets 403 (`PermissionDeniedError`) for the
  others, and `/v1/models` lists only its own.
- The usage file survives the SIGTERM drain: streams in flight when the Edge
  is told to stop run to their end, and every one of them has its record,
  with the tokens the provider reported.
"""

import json
import signal
import threading
import time

import openai
import pytest

from iop_harness import Cluster, wait_until

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "hi"}]
KEY_LIMITED = "sk-limited-4e1b9d0c7a23"
KEY_MODELS = "sk-models-0d8c2f7e19b4"
# 30 a minute: a burst of 30, then one back every 2 s.
RPM = 30


@pytest.fixture(scope="module")
def cluster():
    keys = {
        "ops": {"key": "sk-ops-a9e3c1f07b62", "scopes": ["admin"]},
        "limited": {"key": KEY_LIMITED, "requests_per_minute": RPM},
        "models-only": {"key": KEY_MODELS, "models": ["offline-model"]},
    }
    with Cluster(client_keys=keys, mock_args=["--tokens", "3"]) as c:
        yield c


def _client(cluster, key, retries=0):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=key, max_retries=retries, timeout=20)


def test_rate_limit_error_and_sdk_retry_honour_the_headers(cluster):
    client = _client(cluster, KEY_LIMITED)
    refused = None
    for _ in range(4 * RPM):
        try:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        except openai.RateLimitError as e:
            refused = e
            break
    assert refused is not None, "the limit never refused a request"
    headers = refused.response.headers
    assert refused.status_code == 429
    assert refused.code == "rate_limit_requests"
    assert headers["x-ratelimit-limit-requests"] == str(RPM)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    retry_ms = int(headers["retry-after-ms"])
    assert 0 < retry_ms <= 2000
    assert int(headers["retry-after"]) == max(1, -(-retry_ms // 1000))
    assert headers["x-request-id"].startswith("req_")

    # With retries the SDK waits what retry-after-ms says, then succeeds.
    started = time.monotonic()
    done = _client(cluster, KEY_LIMITED, retries=3).chat.completions.create(model=MODEL, messages=MESSAGES)
    waited = time.monotonic() - started
    assert done.choices[0].message.content
    # It waited for the bucket (order, not speed: at least most of the
    # refill the refusal announced).
    assert waited >= (retry_ms / 1000) * 0.5, (waited, retry_ms)


def test_a_key_limited_to_some_models(cluster):
    client = _client(cluster, KEY_MODELS)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert refused.value.code == "model_not_allowed"
    assert [m.id for m in client.models.list().data] == ["offline-model"]


def test_the_usage_file_survives_the_sigterm_drain(tmp_path):
    usage = tmp_path / "usage.jsonl"
    streams = 4
    # 20 tokens 100 ms apart: each stream is in flight for about 2 s.
    with Cluster(mock_args=["--tokens", "20", "--inter-token-ms", "100"],
                 edge_extra=["[edge.usage_log]", f'path = "{usage}"']) as c:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        started = threading.Barrier(streams + 1)
        results: list = [None] * streams

        def run(i):
            text, seen_usage = "", None
            stream = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True,
                stream_options={"include_usage": True}, extra_headers={"x-request-id": f"drain-{i}"})
            first = True
            for chunk in stream:
                if first:
                    started.wait(timeout=20)
                    first = False
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    seen_usage = chunk.usage
            results[i] = (text, seen_usage)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        started.wait(timeout=20)
        # Every stream has its first chunk: stop the Edge now.
        c.edge.popen.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
        assert c.edge.popen.wait(timeout=30) == 0
        wait_until(lambda: "drained; shut down" in c.edge.log(), timeout_s=5, what="drain logged")

    records = [json.loads(line) for line in usage.read_text().splitlines()]
    by_id = {r["request_id"]: r for r in records}
    assert sorted(by_id) == [f"drain-{i}" for i in range(streams)], records
    for i, (text, seen) in enumerate(results):
        assert text, f"stream {i} got no text"
        r = by_id[f"drain-{i}"]
        assert (r["status"], r["outcome"], r["usage"]) == (200, "completed", "reported")
        assert r["completion_tokens"] == seen.completion_tokens == 20
        assert r["prompt_tokens"] == seen.prompt_tokens
        assert r["total_tokens"] == seen.prompt_tokens + seen.completion_tokens
        assert r["principal"] == "anonymous" and r["model"] == MODEL


def test_usage_records_for_tunnels_and_runs_streamed_or_not(tmp_path):
    from iop_harness import OLLAMA_MODEL

    usage = tmp_path / "usage.jsonl"
    with Cluster(ollama=True, mock_args=["--tokens", "5"],
                 edge_extra=["[edge.usage_log]", f'path = "{usage}"']) as c:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)
        seen = {}
        for model, path in ((MODEL, "tunnel"), (OLLAMA_MODEL, "run")):
            r = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES)
            seen[r.headers["x-request-id"]] = (path, False, r.parse().usage)
            stream = client.chat.completions.with_raw_response.create(
                model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True})
            last = None
            for chunk in stream.parse():
                if chunk.usage is not None:
                    last = chunk.usage
            seen[stream.headers["x-request-id"]] = (path, True, last)
            # A stream that did not ask for usage: no usage chunk reaches
            # the client, and its record has the provider's counts (the
            # same as the non-streamed request's) all the same.
            plain = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, stream=True)
            chunks = list(plain.parse())
            assert chunks and all(c.choices and c.usage is None for c in chunks), path
            seen[plain.headers["x-request-id"]] = (path, True, r.parse().usage)
        c.edge.stop()

    records = {r["request_id"]: r for r in map(json.loads, usage.read_text().splitlines())}
    assert sorted(records) == sorted(seen)
    for request_id, (path, streamed, reported) in seen.items():
        r = records[request_id]
        assert reported is not None, (path, streamed)
        assert (r["outcome"], r["usage"]) == ("completed", "reported"), (path, streamed, r)
        assert (r["prompt_tokens"], r["completion_tokens"]) == (reported.prompt_tokens, reported.completion_tokens)
        assert r["completion_tokens"] == 5
        assert r["model"] == (MODEL if path == "tunnel" else OLLAMA_MODEL)


def test_a_stream_cut_by_the_drain_grace_is_recorded_as_aborted(tmp_path):
    usage = tmp_path / "usage.jsonl"
    # 100 tokens 100 ms apart: about 10 s, far past a 300 ms drain grace.
    with Cluster(mock_args=["--tokens", "100", "--inter-token-ms", "100"],
                 edge_extra=["drain_grace_ms = 300", "[edge.usage_log]", f'path = "{usage}"']) as c:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
            extra_headers={"x-request-id": "cut-1"})
        next(iter(stream))
        c.edge.popen.send_signal(signal.SIGTERM)
        with pytest.raises(Exception):
            for _ in stream:
                pass
        c.edge.popen.wait(timeout=30)
        assert "shut down with requests in flight" in c.edge.log()

    [record] = [json.loads(line) for line in usage.read_text().splitlines()]
    assert (record["request_id"], record["outcome"], record["usage"]) == ("cut-1", "aborted", "partial")
    assert record["total_tokens"] is None  # the mock reports usage only at the end
