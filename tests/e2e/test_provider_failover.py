"""One model pooled over two mock providers (two processes), real processes
throughout: a provider killed with SIGKILL costs the clients nothing, is
ejected by passive health, and serves again once restarted; a provider that
stalls before its first byte is failed over, one that stalls after its first
tokens ends the stream with an error and is not retried.
"""

import json
import signal
import threading
import urllib.request

import pytest

from iop_harness import BIN_DIR, Cluster, http_json, post_raw, sse_data, start, wait_until

MODEL = "pooled"
TOKENS = 4
TEXT = "".join(f"tok{i} " for i in range(TOKENS))


class TwoProviders(Cluster):
    """Node `node-a` with two OpenAI-compatible adapters, each on its own
    mock process (`a` on `self.mock`, `b` on `self.mock_b`), and model
    `pooled` over both, `a` listed first (ties go to it)."""

    def __init__(self, mock_a_args=(), mock_b_args=(), provider_a_extra=(), outlier=(), **kw):
        super().__init__(node_ids=("node-a",), mock_args=mock_a_args, **kw)
        self.mock_b_args = list(mock_b_args)
        self.provider_a_extra = list(provider_a_extra)
        self.outlier = list(outlier)

    def _start(self):
        self.mock_b = start("mock-b", [str(BIN_DIR / "bench"), "mock-provider", "--port", "0"] + self.mock_b_args)
        self.procs.append(self.mock_b)
        super()._start()

    def edge_config(self, mock_addr: str) -> str:
        adapter = lambda name, addr: [  # noqa: E731
            "[[nodes.adapters]]", f'name = "{name}"', 'kind = "openai_compat"', 'profile = "llama_cpp"',
            f'base_url = "http://{addr}"', "capacity = 16",
        ]
        provider = lambda pid, adapter_name, extra: [  # noqa: E731
            "[[nodes.providers]]", f'id = "{pid}"', f'adapter = "{adapter_name}"', 'target = "mock-model"',
            "capacity = 8", "response_stall_timeout_ms = 1500",
        ] + list(extra)
        return "\n".join([
            "[edge]", 'name = "edge-1"', 'trust_domain = "iop.test"', 'client_listen = "127.0.0.1:0"',
            'node_listen = "127.0.0.1:0"', "allow_anonymous = true",
            "[tls]", 'ca = "certs/ca.pem"', 'cert = "certs/edge.pem"', 'key = "certs/edge-key.pem"',
            "[outlier_detection]",
        ] + self.outlier + [
            "[[nodes]]", 'id = "node-a"',
        ] + adapter("mock-a", mock_addr) + adapter("mock-b", self.mock_b.ready["addr"])
          + provider("a", "mock-a", self.provider_a_extra) + provider("b", "mock-b", ()) + [
            "[[models]]", f'name = "{MODEL}"', 'providers = ["node-a/a", "node-a/b"]', "max_attempts = 2",
            'routing = "least_loaded"',
        ]) + "\n"

    def all_nodes_connected(self) -> bool:
        return all(p["connected"] for p in self.status()["providers"])

    def entry(self, provider_id: str) -> dict:
        return self.provider("node-a", provider_id)

    def metric(self, line_prefix: str) -> int:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith(line_prefix + " "):
                return int(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {line_prefix!r}")


def chat(cluster, stream: bool) -> tuple[int, str]:
    """One chat completion; (status, the answer's text). A streamed answer
    must end with a stop and [DONE]."""
    body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    status, _, raw = post_raw(cluster.base_url + "/v1/chat/completions", body, timeout_s=30)
    if status != 200:
        return status, raw.decode()
    if not stream:
        return status, json.loads(raw)["choices"][0]["message"]["content"]
    data = sse_data(raw)
    assert data[-1] == "[DONE]", raw
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop", raw
    return status, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.fixture(scope="module")
def cluster():
    with TwoProviders(
        mock_a_args=["--tokens", str(TOKENS)], mock_b_args=["--tokens", str(TOKENS)],
        outlier=["consecutive_failures = 3", "base_ejection_time_ms = 60000", "max_ejection_time_ms = 120000"],
    ) as c:
        yield c


def test_a_killed_provider_costs_the_clients_nothing_and_serves_again_once_restarted(cluster):
    # Both serve: a is first by config order.
    assert chat(cluster, False) == (200, TEXT)
    assert cluster.mock_stats()["chat_requests"] == 1
    port = cluster.mock.ready["addr"].rsplit(":", 1)[1]
    cluster.mock.stop(signal.SIGKILL)

    # 40 requests, 20 of them streamed, 2 at a time: every one 200, whole.
    results: list = []
    lock = threading.Lock()

    def worker(stream: bool):
        for _ in range(10):
            for s in (stream, not stream):
                r = chat(cluster, s)
                with lock:
                    results.append((s, r))

    threads = [threading.Thread(target=worker, args=(s,)) for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 40
    assert [r for _, r in results if r != (200, TEXT)] == []
    assert sum(1 for s, _ in results if s) == 20

    # Ejected within the configured failure count, and visible.
    a = cluster.entry("a")
    assert a["status"] == "unavailable", a
    assert a["outlier"]["ejected"] and a["outlier"]["reason"] == "connect_failure", a
    assert a["outlier"]["ejections"] == 1
    assert cluster.metric('iop_edge_provider_ejections_total{reason="connect_failure"}') == 1
    assert cluster.metric("iop_edge_providers_ejected") == 1
    # Each failure before the ejection was failed over (2 at a time: up to
    # one more than the failure count reached a before it left rotation).
    retried = cluster.metric('iop_edge_liveness_recovery_results_total{source="failover",result="retried"}')
    assert 3 <= retried <= 4, retried
    assert cluster.metric('iop_edge_liveness_recovery_results_total{source="failover",result="recovered"}') == retried
    # The first may be a reset of a kept-alive connection, the rest refused.
    failures = sum(cluster.metric(f'iop_edge_provider_attempt_failures_total{{reason="{r}"}}')
                   for r in ("connect_failure", "reset_before_response"))
    assert failures == retried
    assert "provider ejected: failing, out of rotation" in cluster.edge.log()

    # Restarted on its port: a recovery probe finds it and re-admits it
    # before its 60 s ejection is over (by the probe, not the ejection
    # timer); it serves again.
    cluster.mock = start("mock", [str(BIN_DIR / "bench"), "mock-provider", "--port", port, "--tokens", str(TOKENS)])
    cluster.procs.append(cluster.mock)
    wait_until(lambda: not cluster.entry("a")["outlier"]["ejected"], timeout_s=30, what="a re-admitted")
    assert cluster.metric('iop_edge_provider_readmissions_total{via="probe"}') == 1
    assert cluster.metric('iop_edge_provider_readmissions_total{via="timer"}') == 0
    assert cluster.entry("a")["status"] == "available"
    for _ in range(4):
        assert chat(cluster, True) == (200, TEXT)
    # Ties go to a again: the restarted process serves all four.
    assert cluster.mock_stats()["chat_requests"] == 4, "the restarted provider serves"
    for p in ("a", "b"):
        e = cluster.entry(p)
        assert (e["in_flight"], e["queued"]) == (0, 0), e


@pytest.fixture(scope="module")
def stalling():
    # a stalls after 3 content tokens: a non-streamed answer (6 tokens)
    # never starts, a streamed one stops after its third token.
    with TwoProviders(
        mock_a_args=["--tokens", "6", "--stall-after-tokens", "3"], mock_b_args=["--tokens", "6"],
        provider_a_extra=(), outlier=["consecutive_failures = 100"],
    ) as c:
        yield c


def test_a_stall_before_the_first_byte_is_served_by_the_other_provider(stalling):
    status, text = chat(stalling, False)
    assert (status, text) == (200, "".join(f"tok{i} " for i in range(6)))
    assert stalling.mock_stats()["chat_requests"] == 1, "a was tried first"
    assert http_json(f"http://{stalling.mock_b.ready['addr']}/admin/stats")["chat_requests"] == 1


def test_a_stall_after_three_tokens_ends_the_stream_and_is_not_retried(stalling):
    before_b = http_json(f"http://{stalling.mock_b.ready['addr']}/admin/stats")["chat_requests"]
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    status, _, raw = post_raw(stalling.base_url + "/v1/chat/completions", body, timeout_s=30)
    assert status == 200
    data = sse_data(raw)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["code"] == "response_stalled"
    text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                   for d in data[:-2] if json.loads(d).get("choices"))
    assert text == "tok0 tok1 tok2 "
    assert http_json(f"http://{stalling.mock_b.ready['addr']}/admin/stats")["chat_requests"] == before_b
    wait_until(lambda: stalling.entry("a")["in_flight"] == 0, what="a's lease released")


def test_the_llama_cpp_probe_works_without_a_health_route(stalling):
    # llama-cpp-python's server has no /health (404): the llama_cpp
    # profile's probe asks /v1/models instead, which lists the target.
    b = stalling.mock_b.ready["addr"]
    for state, expected in (("healthy", "available"), ("missing", "available"), ("unhealthy", "unavailable")):
        status, _, raw = post_raw(f"http://{b}/admin/health", {"state": state})
        assert status == 200, raw
        status, _, raw = post_raw(f"{stalling.base_url}/admin/nodes/node-a/commands",
                                  {"type": "capabilities", "adapter": "mock-b"})
        assert status == 200, raw
        [cap] = json.loads(raw)["capabilities"]
        assert (cap["adapter_key"], cap["target"], cap["provider_status"]) == ("mock-b", "mock-model", expected), state
    post_raw(f"http://{b}/admin/health", {"state": "healthy"})
