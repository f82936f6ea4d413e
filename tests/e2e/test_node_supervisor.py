"""Node connectivity supervision with real processes (S1–S3).

CONTRACT: S1, S2 — an Edge restarted under a running Node: the Node
reconnects within its interval and serves again.
CONTRACT: S2, S3 — `max_attempts = 2` against a dead Edge address: two
attempts, then exit 1; SIGTERM exits 0.
"""

import json
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from iop_harness import BIN_DIR, Cluster, post_raw, start, wait_until

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(cluster) -> str:
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
    assert status == 200, body
    return json.loads(body)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(mock_args=["--tokens", "3"]) as c:
        yield c


def test_node_reconnects_after_an_edge_restart(cluster):
    # CONTRACT: S1, S2
    assert _chat(cluster) == "tok0 tok1 tok2 "
    cluster.restart_edge()
    # interval_sec = 1: the node is back well within a few intervals.
    wait_until(cluster.all_nodes_connected, timeout_s=10, what="node reconnected to the new edge")
    assert _chat(cluster) == "tok0 tok1 tok2 "
    node = cluster.nodes["node-a"]
    assert node.popen.poll() is None, node.log()


def test_sigterm_exits_zero(cluster):
    # CONTRACT: S3
    assert cluster.nodes["node-a"].stop(signal.SIGTERM) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_finite_attempts_against_a_dead_edge_exit_1():
    # CONTRACT: S2, S3
    d = Path(tempfile.mkdtemp(prefix="iop-e2e-dead-"))
    subprocess.run(
        [str(BIN_DIR / "edge-bin"), "certs", "--out", str(d / "certs"), "--trust-domain", "iop.test",
         "--edge-name", "edge-1", "--node", "node-a"],
        check=True, capture_output=True, text=True,
    )
    cfg = d / "node.toml"
    cfg.write_text("\n".join([
        'node_id = "node-a"',
        'trust_domain = "iop.test"',
        f'edge_addr = "127.0.0.1:{_free_port()}"',
        'edge_name = "edge-1"',
        "[tls]",
        'ca = "certs/ca.pem"',
        'cert = "certs/node-node-a.pem"',
        'key = "certs/node-node-a-key.pem"',
        "[reconnect]",
        "interval_sec = 1",
        "max_attempts = 2",
    ]) + "\n")
    node = start("dead-edge node", [str(BIN_DIR / "node-bin"), "--config", str(cfg), "--cores", "0"],
                 wait_ready=False)
    try:
        rc = node.popen.wait(timeout=20)
    finally:
        node.stop(signal.SIGKILL)
    log = node.log()
    assert rc == 1, log
    attempts = [line for line in log.splitlines() if "connection attempt failed" in line]
    assert len(attempts) == 2, log
    assert "reconnect attempts exhausted" in log
