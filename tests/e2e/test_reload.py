"""SIGHUP reloads the Edge configuration and pushes refreshes to ready nodes.

CONTRACT: K3 — a changed node config reaches the dispatch-ready owner as a
NodeConfigRefreshRequest and is APPLIED (the node's gate takes the new
capacity); an invalid file keeps the running configuration.
"""

import json
import signal

import pytest

from iop_harness import Cluster, post_raw, wait_until


# "0-1": the command or refresh leaves from Control's core and may have to
# reach the node's connection on the other core.
@pytest.fixture(scope="module", params=["0", "0-1"])
def cluster(request):
    with Cluster(cores=request.param) as c:
        yield c


def _gate_capacity(cluster) -> int:
    status, _, raw = post_raw(f"{cluster.base_url}/admin/nodes/node-a/commands", {"type": "provider_status"})
    assert status == 200, raw
    [p] = json.loads(raw)["providers"]
    return p["capacity"]


def _edge_log(cluster) -> str:
    return cluster.edge.log()


def test_sighup_pushes_the_new_adapter_config(cluster):
    assert _gate_capacity(cluster) == 64
    path = cluster.dir / "edge.toml"
    text = path.read_text()
    # The node-a adapter capacity is the first `capacity = 64` of its block.
    start = text.index('id = "node-a"')
    i = text.index("capacity = 64", start)
    path.write_text(text[:i] + "capacity = 7" + text[i + len("capacity = 64"):])
    cluster.edge.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: _gate_capacity(cluster) == 7, timeout_s=10, what="refresh applied on the node")
    wait_until(lambda: "REFRESH_STATUS_APPLIED" in _edge_log(cluster), timeout_s=5, what="refresh answer logged")
    # Still serving.
    status, _, raw = post_raw(
        f"{cluster.base_url}/v1/chat/completions",
        {"model": "iop-test-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
    )
    assert status == 200, raw


def test_an_invalid_file_keeps_the_running_configuration(cluster):
    path = cluster.dir / "edge.toml"
    good = path.read_text()
    path.write_text(good + "\nunknown_key = 1\n")
    try:
        cluster.edge.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: "configuration reload failed" in _edge_log(cluster), timeout_s=10, what="reload failure")
        assert "unknown_key" in _edge_log(cluster)
        assert cluster.edge.popen.poll() is None
        status, _, _ = post_raw(
            f"{cluster.base_url}/v1/chat/completions",
            {"model": "iop-test-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
        )
        assert status == 200
    finally:
        path.write_text(good)
