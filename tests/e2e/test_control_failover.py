"""Two nodes serve one model; killing the node of a running stream ends that
stream with an error, fences the node, and later requests go to the other;
a non-streamed request in flight on the killed node is failed over to the
other and answered whole.

CONTRACT: F1 — the fenced generation's lease is released at once, its
providers show offline with zero in-flight, and the queue re-evaluates.
"""

import json
import signal
import threading
import urllib.request

import pytest

from iop_harness import Cluster, wait_until

MODEL = "iop-test-model"


@pytest.fixture(scope="module")
def cluster():
    # Slow tokens so a stream is still running when its node dies.
    with Cluster(node_ids=("node-a", "node-b"), mock_args=["--inter-token-ms", "50", "--tokens", "200"]) as c:
        yield c


def _stream(cluster, out: list, started: threading.Event):
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(
        cluster.base_url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        buf = b""
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            buf += chunk
            if b"tok0" in buf:
                started.set()
        out.append(buf.decode())


def _providers(cluster):
    return {p["node_id"]: p for p in cluster.status()["providers"] if p["node_id"] != "node-offline"}


def test_killing_the_serving_node_fails_the_stream_and_fences_it(cluster):
    out: list = []
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(cluster, out, started))
    t.start()
    assert started.wait(20), "stream did not start"
    providers = _providers(cluster)
    serving = [n for n, p in providers.items() if p["in_flight"] == 1]
    assert len(serving) == 1, providers
    victim = serving[0]
    survivor = ({"node-a", "node-b"} - {victim}).pop()

    cluster.nodes[victim].stop(signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    raw = out[0]
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "node_disconnected"

    # Fenced at once: offline, zero figures (P3), the survivor untouched.
    wait_until(lambda: not _providers(cluster)[victim]["connected"], what="victim offline")
    p = _providers(cluster)[victim]
    assert (p["status"], p["health"], p["in_flight"], p["capacity"]) == ("unavailable", "offline", 0, 0)
    assert _providers(cluster)[survivor]["connected"]

    # The next requests are served by the survivor.
    for _ in range(3):
        body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}).encode()
        req = urllib.request.Request(
            cluster.base_url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=20) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"] == "tok0 tok1 "
    assert _providers(cluster)[survivor]["in_flight"] == 0


def test_a_non_streamed_request_in_flight_on_a_killed_node_is_served_by_the_other(cluster):
    # Nothing of a non-streamed answer reaches the client before it is
    # whole: when its node dies, Control fails it over to the other node
    # (pre-commit failover) and the client gets the whole answer.
    for node_id, proc in list(cluster.nodes.items()):
        if proc.popen.poll() is not None:
            cluster.start_node(node_id)  # killed by the test before
    wait_until(lambda: all(p["connected"] for p in _providers(cluster).values()), what="both nodes up")
    out: list = []

    def post():
        body = json.dumps({"model": MODEL, "max_tokens": 60,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(cluster.base_url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            out.append((resp.status, json.loads(resp.read())))

    t = threading.Thread(target=post)
    t.start()
    wait_until(lambda: sum(p["in_flight"] for p in _providers(cluster).values()) == 1, what="in flight")
    victim = next(n for n, p in _providers(cluster).items() if p["in_flight"] == 1)
    cluster.nodes[victim].stop(signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    status, answer = out[0]
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == "".join(f"tok{i} " for i in range(60))
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert 'iop_edge_liveness_recovery_results_total{source="failover",result="retried"} 1\n' in metrics
    assert 'iop_edge_liveness_recovery_results_total{source="failover",result="recovered"} 1\n' in metrics
    survivor = ({"node-a", "node-b"} - {victim}).pop()
    wait_until(lambda: _providers(cluster)[survivor]["in_flight"] == 0, what="survivor idle")
