"""`edge-bin --cores 0-1` and `node-bin --cores 0-1`: the multi-core layout
serves the same bytes as one core.

The Edge runs Control on core 0 and accepts clients and nodes on both cores
(SO_REUSEPORT: the kernel spreads the connections), so with many client
connections some streams are relayed within a core and some cross from the
node's core to the client's. The Node keeps its Edge session on core 0 and
calls the provider from core 1. Every stream must arrive exactly as the
provider sent it (only the per-response `id`, `created` and the mock's send
stamp differ), and afterwards Control's state is clean: no lease, no
queued request, the provider ready.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from iop_harness import Cluster, post_raw, sse_data, wait_until

MODEL = "iop-test-model"
TARGET = "mock-model"
TOKENS = 40
STREAMS = 24
VOLATILE = ("id", "created", "iop_mock_sent_ns")


def normalized(raw: bytes) -> list:
    out = []
    for data in sse_data(raw):
        if data == "[DONE]":
            out.append(data)
            continue
        event = json.loads(data)
        for key in VOLATILE:
            event.pop(key, None)
        out.append(event)
    return out


@pytest.fixture(scope="module")
def cluster():
    with Cluster(mock_args=["--tokens", str(TOKENS)], cores="0-1") as c:
        yield c


def test_both_binaries_log_their_core_layout(cluster):
    edge_log = cluster.edge.log()
    assert "edge-bin starting" in edge_log and "cores=0,1" in edge_log, edge_log
    node_log = cluster.nodes["node-a"].log()
    assert "cores=0,1" in node_log, node_log
    assert "not implemented" not in edge_log + node_log


def test_concurrent_streams_are_byte_exact_across_cores(cluster):
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "count"}]}
    direct_body = dict(body, model=TARGET)
    status, _, direct = post_raw(f"http://{cluster.mock.ready['addr']}/v1/chat/completions", direct_body)
    assert status == 200
    expected = normalized(direct)
    assert len(expected) == 1 + TOKENS + 3  # role, tokens, finish, usage, [DONE]

    def one(_):
        return post_raw(cluster.base_url + "/v1/chat/completions", body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(STREAMS)))
    for status, headers, raw in results:
        assert status == 200, raw
        assert normalized(raw) == expected
        # Within a stream the Edge keeps the provider's event framing: one
        # `data:` line per event, events separated by one blank line.
        assert raw.endswith(b"data: [DONE]\n\n")

    # Every lease came back and nothing waits.
    def idle():
        provider = cluster.provider("node-a", "mock-1")
        return provider["in_flight"] == 0 and provider["queued"] == 0 and provider["connected"]

    wait_until(idle, timeout_s=10, what="provider idle")


def test_non_streaming_requests_across_cores(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}]}

    def one(_):
        return post_raw(cluster.base_url + "/v1/chat/completions", body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(STREAMS)))
    expected = "".join(f"tok{i} " for i in range(TOKENS))
    for status, _, raw in results:
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["message"]["content"] == expected
