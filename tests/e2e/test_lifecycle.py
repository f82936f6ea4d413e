"""Process lifecycle: SIGTERM/SIGINT drains, systemd readiness notification.

CONTRACT: S3 — local shutdown (SIGTERM/SIGINT) exits 0, for the Edge and
the Node, after draining: in-flight streams finish in full; a second signal
stops at once (still 0).

- Edge: the first signal closes both listeners (new connections are
  refused), `/readyz` answers 503 while `/livez` stays 200 on an open
  keep-alive connection, other requests on open connections get 503 with
  `retry-after` and `connection: close`, and the in-flight stream completes.
- Node: the first signal stops redialling; the in-flight stream completes,
  then the Node closes its Edge connection and exits 0.
- systemd: with NOTIFY_SOCKET set, `READY=1` once listening (Edge) or once
  the first session is ready (Node), `RELOADING=1` + `MONOTONIC_USEC` then
  `READY=1` around the Edge's SIGHUP reload, `STOPPING=1` at shutdown.
"""

import http.client
import json
import re
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from iop_harness import Cluster, wait_until

MODEL = "iop-test-model"
TOKENS = 100
# 100 tokens 20 ms apart: a stream runs about two seconds.
SLOW_MOCK = ["--inter-token-ms", "20", "--tokens", str(TOKENS)]
EXPECTED_TEXT = "".join(f"tok{i} " for i in range(TOKENS))
EXIT_TIMEOUT_S = 15


def _client_addr(cluster) -> tuple[str, int]:
    host, port = cluster.edge.ready["client"].rsplit(":", 1)
    return host, int(port)


def _connect(cluster) -> http.client.HTTPConnection:
    host, port = _client_addr(cluster)
    conn = http.client.HTTPConnection(host, port, timeout=20)
    conn.connect()
    return conn


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read()


class Stream:
    """A streamed chat completion on its own connection, read line by line."""

    def __init__(self, cluster):
        self.conn = _connect(cluster)
        body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        self.conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.data: list[str] = []

    def read_event(self) -> str | None:
        """The next `data:` payload; None at the end of the body."""
        while True:
            try:
                line = self.resp.readline()
            except (http.client.IncompleteRead, ConnectionError):
                return None  # cut off: the process serving it is gone
            if not line:
                return None
            text = line.decode().rstrip("\r\n")
            if text.startswith("data: "):
                self.data.append(text[len("data: "):])
                return self.data[-1]

    def started(self) -> "Stream":
        """Reads until the first token arrived (the stream is in flight)."""
        while True:
            event = self.read_event()
            assert event is not None and event != "[DONE]", self.data
            if "tok0" in event:
                return self

    def read_to_end(self) -> list[str]:
        while self.read_event() is not None:
            pass
        return self.data

    def text(self) -> str:
        out = []
        for d in self.data:
            if d == "[DONE]":
                continue
            for choice in json.loads(d).get("choices", []):
                out.append(choice["delta"].get("content") or "")
        return "".join(out)


def _refused(cluster) -> bool:
    """True when a new connection to the client port is refused."""
    try:
        s = socket.create_connection(_client_addr(cluster), timeout=2)
    except ConnectionRefusedError:
        return True
    s.close()
    return False


def _exit_code(proc) -> int:
    return proc.popen.wait(timeout=EXIT_TIMEOUT_S)


# "0-1": Control and the Node session on core 0, the drain spans both
# shards of each process.
@pytest.mark.parametrize("cores", ["0", "0-1"])
def test_edge_drains_in_flight_streams_then_exits_0(cores):
    with Cluster(mock_args=SLOW_MOCK, cores=cores) as cluster:
        probe = _connect(cluster)
        assert _get(probe, "/readyz") == (200, b"ok\n")
        stream = Stream(cluster).started()

        cluster.edge.popen.send_signal(signal.SIGTERM)
        # On the connection opened before the signal: not ready, still live.
        wait_until(lambda: _get(probe, "/readyz") == (503, b"draining\n"), timeout_s=5, interval_s=0.01,
                   what="/readyz 503")
        assert _get(probe, "/livez") == (200, b"ok\n")
        # New connections are refused: the listeners are closed.
        wait_until(lambda: _refused(cluster), timeout_s=5, interval_s=0.01, what="connection refused")
        # Another request on the open connection: 503, retry-after, close.
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        probe.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        resp = probe.getresponse()
        assert resp.status == 503
        assert resp.getheader("retry-after") == "1"
        assert resp.getheader("connection") == "close"
        assert json.loads(resp.read()) == {"error": {
            "message": "The gateway is shutting down; retry shortly.",
            "type": "service_unavailable_error", "param": None, "code": "shutting_down"}}
        assert cluster.edge.popen.poll() is None, "the Edge exited with a stream in flight"

        # The in-flight stream completes in full, then the Edge exits 0.
        data = stream.read_to_end()
        assert data[-1] == "[DONE]"
        assert stream.text() == EXPECTED_TEXT
        assert _exit_code(cluster.edge) == 0
        assert "drained; shut down" in cluster.edge.log()


@pytest.mark.parametrize("cores", ["0", "0-1"])
def test_edge_second_signal_stops_at_once_with_exit_0(cores):
    with Cluster(mock_args=SLOW_MOCK, cores=cores) as cluster:
        probe = _connect(cluster)
        stream = Stream(cluster).started()
        cluster.edge.popen.send_signal(signal.SIGINT)
        wait_until(lambda: _get(probe, "/readyz")[0] == 503, timeout_s=5, interval_s=0.01, what="/readyz 503")
        cluster.edge.popen.send_signal(signal.SIGINT)
        assert _exit_code(cluster.edge) == 0
        # The stream was cut off: no [DONE], fewer than every token.
        data = stream.read_to_end()
        assert "[DONE]" not in data
        assert len(stream.text()) < len(EXPECTED_TEXT)
        assert "second signal; shut down with requests in flight" in cluster.edge.log()


@pytest.mark.parametrize("cores", ["0", "0-1"])
def test_node_drains_in_flight_streams_then_exits_0(cores):
    with Cluster(mock_args=SLOW_MOCK, cores=cores) as cluster:
        node = cluster.nodes["node-a"]
        stream = Stream(cluster).started()
        node.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: "shutting down: draining" in node.log(), timeout_s=5, what="node draining")
        data = stream.read_to_end()
        assert data[-1] == "[DONE]"
        assert stream.text() == EXPECTED_TEXT
        assert _exit_code(node) == 0
        log = node.log()
        assert "drained: every run and tunnel released" in log
        # It did not redial after its session closed.
        assert log.count("session ready") == 1
        wait_until(lambda: not cluster.provider("node-a", "mock-1")["connected"], timeout_s=5,
                   what="node gone from the Edge")


@pytest.mark.parametrize("cores", ["0", "0-1"])
def test_node_second_signal_stops_at_once_with_exit_0(cores):
    with Cluster(mock_args=SLOW_MOCK, cores=cores) as cluster:
        node = cluster.nodes["node-a"]
        stream = Stream(cluster).started()
        node.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: "shutting down: draining" in node.log(), timeout_s=5, what="node draining")
        node.popen.send_signal(signal.SIGTERM)
        assert _exit_code(node) == 0
        assert "second signal; stopping at once" in node.log()
        # The stream cannot finish without its node: it ends early with an
        # error event.
        data = stream.read_to_end()
        assert len(stream.text()) < len(EXPECTED_TEXT), data
        errors = [json.loads(d)["error"] for d in data if d != "[DONE]" and "error" in json.loads(d)]
        assert len(errors) == 1, data


def _notify_socket(directory: str, name: str) -> tuple[socket.socket, str]:
    path = str(Path(directory) / name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    return sock, path


def test_systemd_notifications():
    with tempfile.TemporaryDirectory(prefix="iop-notify-") as tmp:
        edge_sock, edge_path = _notify_socket(tmp, "edge")
        node_sock, node_path = _notify_socket(tmp, "node")
        with Cluster(edge_env={"NOTIFY_SOCKET": edge_path}, node_env={"NOTIFY_SOCKET": node_path}) as cluster:
            assert edge_sock.recv(4096) == b"READY=1"
            # The Node says ready once it dials (before its session is up;
            # node-bin/tests/cli.rs shows it with no Edge at all).
            assert node_sock.recv(4096) == b"READY=1"

            cluster.edge.popen.send_signal(signal.SIGHUP)
            reloading = edge_sock.recv(4096).decode()
            assert re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=[1-9][0-9]*", reloading), reloading
            assert edge_sock.recv(4096) == b"READY=1"

            cluster.nodes["node-a"].popen.send_signal(signal.SIGTERM)
            assert node_sock.recv(4096) == b"STOPPING=1"
            assert _exit_code(cluster.nodes["node-a"]) == 0

            cluster.edge.popen.send_signal(signal.SIGTERM)
            assert edge_sock.recv(4096) == b"STOPPING=1"
            assert _exit_code(cluster.edge) == 0
        edge_sock.close()
        node_sock.close()


@pytest.mark.parametrize("value", ["", "relative/notify"])
def test_an_unusable_notify_socket_is_never_fatal(value):
    with Cluster(edge_env={"NOTIFY_SOCKET": value}) as cluster:
        probe = _connect(cluster)
        assert _get(probe, "/readyz") == (200, b"ok\n")
        if value:
            wait_until(lambda: "systemd notification skipped" in cluster.edge.log(), timeout_s=5,
                       what="the notification error logged")
        cluster.edge.popen.send_signal(signal.SIGTERM)
        assert _exit_code(cluster.edge) == 0
