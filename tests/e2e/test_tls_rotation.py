"""Certificate rotation on SIGHUP with real processes.

For the Edge's node-link identity, the Node's own identity and the Edge's
client-listener certificate: the certificate files are replaced and SIGHUP
sent while a stream is in flight; the stream finishes whole, the next new
connection presents the new certificate (its serial, as logged by the peer
or seen by the client), and a malformed replacement is refused with the
running certificate kept.
"""

import json
import shutil
import signal
import socket
import threading

import pytest

from iop_harness import Cluster, post_raw, sse_data, wait_until

MODEL = "iop-test-model"
TOKENS = 20
# 20 tokens 100 ms apart: a stream is in flight for about two seconds.
PACED = ["--tokens", str(TOKENS), "--inter-token-ms", "100"]
EXPECTED_TEXT = "".join(f"tok{i} " for i in range(TOKENS))
MESSAGES = [{"role": "user", "content": "count"}]
MALFORMED = "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"


class InFlight:
    """A streaming chat completion running in a thread."""

    def __init__(self, cluster):
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(cluster,), daemon=True)
        self.thread.start()

    def _run(self, cluster):
        self.result = post_raw(cluster.base_url + "/v1/chat/completions",
                               {"model": MODEL, "messages": MESSAGES, "stream": True},
                               timeout_s=30, context=cluster.ssl_context())

    def text(self) -> str:
        self.thread.join(30)
        status, _, raw = self.result
        assert status == 200, raw
        events = sse_data(raw)
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1] if json.loads(e)["choices"])


def _replace(cluster, stem: str, with_stem: str):
    tls = cluster.dir / "tls"
    shutil.copyfile(tls / f"{with_stem}.pem", tls / f"{stem}.pem")
    shutil.copyfile(tls / f"{with_stem}-key.pem", tls / f"{stem}-key.pem")


def _mock_streaming(cluster) -> bool:
    return cluster.mock_stats()["active_streams"] == 1


def _count(proc, text: str) -> int:
    return proc.log().count(text)


@pytest.fixture()
def cluster():
    with Cluster(tls_fixtures=True, mock_args=PACED) as c:
        yield c


def test_node_identity_rotates_on_sighup_mid_stream(cluster):
    node = cluster.nodes["node-a"]
    old, new = cluster.serials["node-node-a.pem"], cluster.serials["node-node-a-rotated.pem"]
    assert f"cert_serial={old}" in cluster.edge.log()
    stream = InFlight(cluster)
    wait_until(lambda: _mock_streaming(cluster), what="a stream in flight")
    _replace(cluster, "node-node-a", "node-node-a-rotated")
    node.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: f"node certificate reloaded: the next Edge connection presents it" in node.log()
               and f"cert_serial={new}" in node.log(), what="node reload logged")
    # The open connection keeps serving: the stream finishes whole.
    assert stream.text() == EXPECTED_TEXT
    assert node.popen.poll() is None
    # A new node connection (the Edge restarts on the same node port, the
    # Node redials) presents the new certificate.
    edge = cluster.restart_edge()
    wait_until(cluster.all_nodes_connected, what="node reconnected")
    assert f'peer=spiffe://iop.test/node/node-a cert_serial={new}' in edge.log()
    assert f"cert_serial={old}" not in edge.log()
    # A malformed replacement is refused and the running identity kept.
    (cluster.dir / "tls" / "node-node-a.pem").write_text(MALFORMED)
    node.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: "node certificate not reloaded; keeping the running one" in node.log(),
               what="refusal logged")
    assert "tls/node-node-a.pem: not a usable certificate: BadEncoding" in node.log()
    edge = cluster.restart_edge()
    wait_until(cluster.all_nodes_connected, what="node reconnected with the kept identity")
    assert f'peer=spiffe://iop.test/node/node-a cert_serial={new}' in edge.log()
    status, _, raw = post_raw(cluster.base_url + "/v1/chat/completions",
                              {"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert status == 200, raw


def test_edge_node_link_identity_rotates_on_sighup_mid_stream(cluster):
    edge = cluster.edge
    old, new = cluster.serials["edge.pem"], cluster.serials["edge-rotated.pem"]
    assert f"peer=spiffe://iop.test/edge/edge-1 cert_serial={old}" in cluster.nodes["node-a"].log()
    stream = InFlight(cluster)
    wait_until(lambda: _mock_streaming(cluster), what="a stream in flight")
    _replace(cluster, "edge", "edge-rotated")
    edge.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: "node-link certificate reloaded" in edge.log() and f"cert_serial={new}" in edge.log(),
               what="edge reload logged")
    assert stream.text() == EXPECTED_TEXT
    # A new node connection sees the Edge's new certificate.
    cluster.nodes["node-a"].stop()
    wait_until(lambda: not cluster.provider("node-a", "mock-1")["connected"], what="node gone")
    node = cluster.start_node("node-a")
    wait_until(cluster.all_nodes_connected, what="node back")
    assert f"peer=spiffe://iop.test/edge/edge-1 cert_serial={new}" in node.log()
    # A malformed replacement is refused; new connections keep getting the
    # running certificate.
    (cluster.dir / "tls" / "edge.pem").write_text(MALFORMED)
    edge.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: "node-link certificate not reloaded; keeping the running one" in edge.log(),
               what="refusal logged")
    assert "tls/edge.pem: not a usable certificate: BadEncoding" in edge.log()
    assert edge.popen.poll() is None
    node.stop()
    wait_until(lambda: not cluster.provider("node-a", "mock-1")["connected"], what="node gone")
    node = cluster.start_node("node-a")
    wait_until(cluster.all_nodes_connected, what="node back")
    assert f"peer=spiffe://iop.test/edge/edge-1 cert_serial={new}" in node.log()


def _presented_serial(cluster) -> str:
    port = int(cluster.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with cluster.ssl_context().wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert()["serialNumber"].lower().lstrip("0")


def test_client_listener_certificate_rotates_on_sighup_mid_stream():
    with Cluster(client_tls=True, mock_args=PACED) as cluster:
        edge = cluster.edge
        old, new = cluster.serials["https.pem"], cluster.serials["https-rotated.pem"]
        assert _presented_serial(cluster) == old.lstrip("0")
        stream = InFlight(cluster)
        wait_until(lambda: _mock_streaming(cluster), what="a stream in flight")
        _replace(cluster, "https", "https-rotated")
        edge.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: "client-listener certificate reloaded" in edge.log(), what="reload logged")
        # The HTTPS connection opened before the reload finishes its stream.
        assert stream.text() == EXPECTED_TEXT
        assert _presented_serial(cluster) == new.lstrip("0")
        # A key that does not match the certificate is refused.
        tls = cluster.dir / "tls"
        shutil.copyfile(tls / "https-key.pem", tls / "saved-key.pem")
        shutil.copyfile(tls / "wrong-host-key.pem", tls / "https-key.pem")
        edge.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: _count(edge, "client-listener certificate not reloaded") == 1, what="refusal")
        assert "private key does not match the certificate" in edge.log()
        assert _presented_serial(cluster) == new.lstrip("0")
        # So is a malformed certificate.
        shutil.copyfile(tls / "saved-key.pem", tls / "https-key.pem")
        (tls / "https.pem").write_text(MALFORMED)
        edge.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: _count(edge, "client-listener certificate not reloaded") == 2, what="refusal")
        assert _presented_serial(cluster) == new.lstrip("0")
        assert edge.popen.poll() is None
