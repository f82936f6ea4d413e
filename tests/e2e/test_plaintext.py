"""Plain TCP between Edge and Node, with real processes (T5).

CONTRACT: T5 — plain TCP on the node link only behind the explicit flags on
both sides (`edge.insecure_plaintext_nodes`, the Node's
`insecure_plaintext`): then a request is served end to end with no TLS
anywhere, and the credential plane is refused (a config error naming
`credentials`). A default Edge refuses a plaintext Node (its handshake
fails and is counted), and a default Node never registers with a plaintext
Edge.
"""

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from iop_harness import BIN_DIR, http_json, post_raw, start, wait_until

MODEL = "plain-model"


def _edge_toml(mock_addr: str, plaintext: bool, extra: str = "") -> str:
    lines = [
        "[edge]",
        'name = "edge-1"',
        'trust_domain = "iop.test"',
        'client_listen = "127.0.0.1:0"',
        'node_listen = "127.0.0.1:0"',
        "allow_anonymous = true",
    ]
    if plaintext:
        lines.append("insecure_plaintext_nodes = true")
    else:
        lines += ["[tls]", 'ca = "certs/ca.pem"', 'cert = "certs/edge.pem"', 'key = "certs/edge-key.pem"']
    lines += [
        "[[nodes]]",
        'id = "node-a"',
        "[[nodes.adapters]]",
        'name = "mock"',
        'kind = "openai_compat"',
        f'base_url = "http://{mock_addr}"',
        "[[nodes.providers]]",
        'id = "mock-1"',
        'adapter = "mock"',
        'target = "mock-model"',
        "capacity = 2",
        "[[models]]",
        f'name = "{MODEL}"',
        'providers = ["node-a/mock-1"]',
    ]
    return "\n".join(lines) + "\n" + extra


def _node_toml(edge_nodes_addr: str, plaintext: bool) -> str:
    lines = [
        'node_id = "node-a"',
        'trust_domain = "iop.test"',
        f'edge_addr = "{edge_nodes_addr}"',
        'edge_name = "edge-1"',
    ]
    if plaintext:
        lines.append("insecure_plaintext = true")
    else:
        lines += ["[tls]", 'ca = "certs/ca.pem"', 'cert = "certs/node-node-a.pem"',
                  'key = "certs/node-node-a-key.pem"']
    lines += ["[reconnect]", "interval_sec = 1", "max_attempts = 0"]
    return "\n".join(lines) + "\n"


@pytest.fixture()
def workdir():
    d = Path(tempfile.mkdtemp(prefix="iop-e2e-plain-"))
    subprocess.run(
        [str(BIN_DIR / "edge-bin"), "certs", "--out", str(d / "certs"), "--trust-domain", "iop.test",
         "--edge-name", "edge-1", "--node", "node-a"],
        check=True, capture_output=True, text=True,
    )
    procs = []
    yield d, procs
    for p in reversed(procs):
        p.stop()


def _start_all(d: Path, procs: list, edge_plain: bool, node_plain: bool):
    mock = start("mock", [str(BIN_DIR / "bench"), "mock-provider", "--port", "0", "--tokens", "3"])
    procs.append(mock)
    (d / "edge.toml").write_text(_edge_toml(mock.ready["addr"], edge_plain))
    edge = start("edge", [str(BIN_DIR / "edge-bin"), "--config", str(d / "edge.toml"), "--cores", "0"])
    procs.append(edge)
    (d / "node.toml").write_text(_node_toml(edge.ready["nodes"], node_plain))
    node = start("node", [str(BIN_DIR / "node-bin"), "--config", str(d / "node.toml"), "--cores", "0"],
                 wait_ready=False)
    procs.append(node)
    return edge, node


def _connected(edge) -> bool:
    status = http_json(f"http://{edge.ready['client']}/status")
    return any(p["node_id"] == "node-a" and p["connected"] for p in status["providers"])


def _metric(edge, name: str) -> int:
    import urllib.request
    with urllib.request.urlopen(f"http://{edge.ready['client']}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return int(float(line.split()[1]))
    raise AssertionError(f"no {name}")


def test_plain_tcp_behind_both_flags_serves_end_to_end(workdir):
    # CONTRACT: T5
    d, procs = workdir
    edge, node = _start_all(d, procs, edge_plain=True, node_plain=True)
    wait_until(lambda: _connected(edge), timeout_s=20, what="plaintext node connected")
    status, _, body = post_raw(f"http://{edge.ready['client']}/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    # Both sides say loudly that the link is not encrypted.
    assert "accepting nodes without TLS (dev only, T5)" in edge.log(), edge.log()
    assert "dialling the edge without TLS (dev only, T5)" in node.log(), node.log()


def test_a_default_edge_refuses_a_plaintext_node(workdir):
    # CONTRACT: T5
    d, procs = workdir
    edge, node = _start_all(d, procs, edge_plain=False, node_plain=True)
    wait_until(lambda: _metric(edge, "iop_edge_node_handshake_failures_total") >= 1, timeout_s=20,
               what="the plaintext node's handshake refused")
    assert not _connected(edge)
    assert node.popen.poll() is None, node.log()  # it keeps trying; nothing registers


def test_a_default_node_never_registers_with_a_plaintext_edge(workdir):
    # CONTRACT: T5
    d, procs = workdir
    edge, node = _start_all(d, procs, edge_plain=True, node_plain=False)
    wait_until(lambda: sum("connection attempt failed" in line for line in node.log().splitlines()) >= 2,
               timeout_s=20, what="the TLS node's attempts failing")
    assert not _connected(edge)
    assert "register request" not in edge.log(), edge.log()


@pytest.mark.parametrize("binary", ["edge-bin", "node-bin"])
def test_the_credential_plane_is_refused_over_plain_tcp(workdir, binary):
    # CONTRACT: T5
    d, _ = workdir
    if binary == "edge-bin":
        text = _edge_toml("127.0.0.1:9", True, "[credentials]\nissuer_key = \"keys/issuer.key\"\n")
        name, expected = "edge.toml", ("edge.toml: credentials: the credential plane needs mTLS to the "
                                       "nodes: remove [credentials] or edge.insecure_plaintext_nodes")
    else:
        text = _node_toml("127.0.0.1:9", True) + (
            "[credentials]\nrecipient_key = \"keys/r.key\"\nissuer_public_key = \"ed25519:x\"\n")
        name, expected = "node.toml", ("node.toml: credentials: the credential plane needs mTLS to the "
                                       "edge: remove [credentials] or insecure_plaintext")
    (d / name).write_text(text)
    done = subprocess.run([str(BIN_DIR / binary), "--config", name, "--cores", "0"], cwd=d,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1, done.stderr
    assert f"{binary}: error: {expected}" in done.stderr.splitlines(), done.stderr
