"""Stream isolation on the node link with real processes.

One node connection carries every stream of its node. A client that never
reads must cost its own stream alone: its run fills its flow-control window
and stops reading its provider, while every other client of the node is
served whole and on time. A node frozen past the heartbeat timeout is fenced,
and once it runs again it reconnects and serves (it used to abort in a
channel destructor). Cancel storms while streams are back-pressured leave the
node alive with nothing in flight. A client that takes no bytes for the
write-stall timeout is reset, and its run cancelled with its reason.
"""

import json
import signal
import socket
import threading
import time
import urllib.request

import pytest

from iop_harness import Cluster, post_raw, sse_data, wait_until

MODEL = "iop-test-model"
TOKEN_BYTES = 4096
TOKENS = 4096  # 16 MiB of tokens for a client that never asks for fewer
WINDOW = 64 * 1024


def _never_reader(cluster) -> socket.socket:
    """A streaming client with a 4 KiB receive buffer that never reads."""
    host, port = cluster.edge.ready["client"].rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _stream(cluster, max_tokens: int, timeout_s: float = 30.0) -> list[str]:
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions",
                               {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": "hi"}]},
                               timeout_s=timeout_s)
    assert status == 200, body[:500]
    out = []
    for data in sse_data(body):
        if data == "[DONE]":
            continue
        delta = json.loads(data)["choices"][0]["delta"]
        if delta.get("content"):
            out.append(delta["content"])
    return out


def _expected(count: int) -> list[str]:
    tokens = []
    for i in range(count):
        text = f"tok{i}"
        tokens.append(text + "." * (TOKEN_BYTES - len(text) - 1) + " ")
    return tokens


def _stable(read, settle_s: float = 0.3, timeout_s: float = 30.0):
    """Waits until `read()` returns the same value twice `settle_s` apart."""
    last = read()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError("never settled")


@pytest.fixture(scope="module")
def cluster():
    with Cluster(mock_args=["--tokens", str(TOKENS), "--token-bytes", str(TOKEN_BYTES)],
                 edge_extra=[f"flow_window_bytes = {WINDOW}"]) as c:
        yield c


def test_a_never_reader_costs_only_its_own_stream(cluster):
    stuck = _never_reader(cluster)
    try:
        wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] == 1, what="stuck run dispatched")
        # Its run stops at its window plus the sockets' buffers: the mock's
        # writes stop far short of the 16 MiB answer (back-pressure).
        written = _stable(lambda: cluster.mock_stats()["stream_bytes_written"])
        assert written < TOKENS * TOKEN_BYTES // 2, written
        # Ten clients of the same node, four at a time, get every token.
        results = []
        errors = []

        def client():
            try:
                results.append(_stream(cluster, max_tokens=16))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client) for _ in range(10)]
        for i, t in enumerate(threads):
            t.start()
            if i % 4 == 3:
                threads[i - 3].join()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert results == [_expected(16)] * 10
        # The stuck stream is still there, still stuck.
        assert cluster.provider("node-a", "mock-1")["in_flight"] == 1
        assert cluster.mock_stats()["active_streams"] == 1
    finally:
        stuck.close()
    wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] == 0, timeout_s=20,
               what="the stuck run released once its client left")
    for name in ("edge", "node"):
        proc = cluster.edge if name == "edge" else cluster.nodes["node-a"]
        assert proc.popen.poll() is None, proc.log()


def test_cancel_storms_while_back_pressured_leave_the_node_alive(cluster):
    for round_ in range(3):
        stuck = [_never_reader(cluster) for _ in range(20)]
        wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] == 20, timeout_s=20,
                   what=f"round {round_}: twenty stuck runs")
        _stable(lambda: cluster.mock_stats()["stream_bytes_written"])
        # Every client leaves at once, while its run is parked on credit.
        for s in stuck:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()
        wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] == 0, timeout_s=20,
                   what=f"round {round_}: every lease back")
    wait_until(lambda: cluster.mock_stats()["active_streams"] == 0, timeout_s=20, what="no stream left")
    node = cluster.nodes["node-a"]
    assert node.popen.poll() is None, node.log()
    assert "panicked" not in node.log(), node.log()
    assert _stream(cluster, max_tokens=3) == _expected(3)


@pytest.fixture()
def heartbeat_cluster():
    # A heartbeat every 0.5 s, the connection closed after 5 s without an
    # answer: only the freeze below (SIGSTOP) is that long, not the pauses
    # of a loaded machine.
    env = {"IOP_TEST_HEARTBEAT_MS": "500:5000"}
    with Cluster(mock_args=["--tokens", "400", "--inter-token-ms", "50"], edge_env=env, node_env=env) as c:
        yield c


def test_a_node_frozen_past_the_heartbeat_timeout_reconnects_and_serves(heartbeat_cluster):
    cluster = heartbeat_cluster
    node = cluster.nodes["node-a"]
    streams = []
    for _ in range(10):
        host, port = cluster.edge.ready["client"].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=20)
        body = json.dumps({"model": MODEL, "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        streams.append(s)
    wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] == 10, what="ten streams running")
    # Nothing closed the node's connection before the freeze.
    assert "node connection closed" not in cluster.edge.log(), cluster.edge.log()
    node.popen.send_signal(signal.SIGSTOP)
    try:
        # The Edge fences the frozen node after its heartbeat timeout.
        wait_until(lambda: not cluster.provider("node-a", "mock-1")["connected"], timeout_s=60,
                   what="the frozen node fenced")
    finally:
        node.popen.send_signal(signal.SIGCONT)
    closed = [line for line in cluster.edge.log().splitlines() if "node connection closed" in line]
    assert len(closed) == 1 and "reason=heartbeat_timeout" in closed[0], closed
    for s in streams:
        s.close()
    # It ends that session (cancelling its ten runs), stays up, reconnects.
    wait_until(cluster.all_nodes_connected, timeout_s=20, what="the node reconnected")
    assert node.popen.poll() is None, node.log()
    wait_until(lambda: "session ended" in node.log(), what="the old session ended")
    assert node.log().count("session ended") == 1, node.log()
    assert "panicked" not in node.log(), node.log()
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions",
                               {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == "tok0 tok1 "
    wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] == 0, what="nothing in flight")


def _metric(cluster, name: str) -> int:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return int(float(line.split()[1]))
    raise AssertionError(f"no {name} in /metrics")


def test_a_client_that_stops_reading_is_reset_at_the_write_stall_timeout():
    """The Edge, the Node and the mock as real processes: a streaming client
    that takes no bytes for `client_write_stall_timeout_ms` is reset (its
    reads end in ECONNRESET after the bytes its socket had taken), its run
    is cancelled on the Node with `client_write_stall`, the provider stream
    ends and the lease comes back; the node serves on."""
    with Cluster(mock_args=["--tokens", str(TOKENS), "--token-bytes", str(TOKEN_BYTES)],
                 edge_extra=[f"flow_window_bytes = {WINDOW}",
                             "client_write_stall_timeout_ms = 1000"],
                 node_env={"RUST_LOG": "info,node_bin::session=debug"}) as c:
        stuck = _never_reader(c)
        try:
            wait_until(lambda: _metric(c, "iop_edge_client_write_stalls_total") == 1, timeout_s=60,
                       what="the stalled client cut off")
            wait_until(lambda: c.provider("node-a", "mock-1")["in_flight"] == 0, timeout_s=20,
                       what="the stalled run's lease back")
            wait_until(lambda: c.mock_stats()["active_streams"] == 0, timeout_s=20,
                       what="the provider stream ended")
            stuck.settimeout(20)
            received = 0
            with pytest.raises(ConnectionResetError):
                while True:
                    chunk = stuck.recv(65536)
                    if not chunk:
                        break  # an end of stream would pass for a whole answer
                    received += len(chunk)
            assert received < TOKENS * TOKEN_BYTES, received
        finally:
            stuck.close()
        wait_until(lambda: "reason=client_write_stall" in c.nodes["node-a"].log(), timeout_s=10,
                   what="the node got the cancel with its reason")
        assert _stream(c, max_tokens=3) == _expected(3)
        for proc in (c.edge, c.nodes["node-a"]):
            assert proc.popen.poll() is None, proc.log()
