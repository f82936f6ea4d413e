"""How the binaries start, with real processes (S1, S3).

CONTRACT: S1 — a Node started before its Edge exists keeps dialling and
connects once the Edge comes up; after the Edge restarts, the one supervisor
redials: the new Edge sees exactly one session of the Node.
CONTRACT: S3 — a bad config value, a missing certificate file and an
unusable key each end the process with exit 1 before it serves anything,
and the one error line names the file, the key and the reason.
"""

import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from iop_harness import BIN_DIR, Cluster, post_raw, start, wait_until

MODEL = "iop-test-model"


def _chat(cluster) -> str:
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    return json.loads(body)["choices"][0]["message"]["content"]


def _count(proc, text: str) -> int:
    return sum(text in line for line in proc.log().splitlines())


def test_a_node_started_before_its_edge_connects_once_the_edge_comes_up():
    # CONTRACT: S1
    with Cluster(mock_args=["--tokens", "3"]) as c:
        node = c.nodes["node-a"]
        # No Edge at all: stop both, then start the Node alone.
        node.stop(signal.SIGTERM)
        c.procs.remove(node)
        nodes_addr = c.edge.ready["nodes"]
        c.edge.stop()
        c.procs.remove(c.edge)
        node = c.start_node("node-a")  # its config still names nodes_addr
        wait_until(lambda: _count(node, "connection attempt failed") >= 2, timeout_s=20,
                   what="the node dialling an Edge that does not exist yet")
        assert node.popen.poll() is None, node.log()
        # The Edge comes up on the address the Node dials.
        edge_toml = c.dir / "edge.toml"
        edge_toml.write_text(c.edge_config(c.mock.ready["addr"]).replace(
            'node_listen = "127.0.0.1:0"', f'node_listen = "{nodes_addr}"'))
        c.edge = start("edge", [str(BIN_DIR / "edge-bin"), "--config", str(edge_toml), "--cores", c.cores])
        c.procs.append(c.edge)
        c.base_url = f"http://{c.edge.ready['client']}"
        wait_until(c.all_nodes_connected, timeout_s=20, what="the node connected to the new Edge")
        assert _chat(c) == "tok0 tok1 tok2 "
        assert _count(node, "session ready") == 1, node.log()
        # The Edge restarts: the same supervisor redials, one session only.
        c.restart_edge()
        wait_until(c.all_nodes_connected, timeout_s=20, what="the node reconnected")
        assert _chat(c) == "tok0 tok1 tok2 "
        time.sleep(2.5)  # two reconnect intervals: a second dialler would have connected
        assert _count(c.edge, "register request") == 1, c.edge.log()
        assert _count(node, "session ready") == 2, node.log()
        assert node.popen.poll() is None, node.log()


def _certs(d: Path):
    subprocess.run(
        [str(BIN_DIR / "edge-bin"), "certs", "--out", str(d / "certs"), "--trust-domain", "iop.test",
         "--edge-name", "edge-1", "--node", "node-a"],
        check=True, capture_output=True, text=True,
    )
    (d / "not-a-key.pem").write_text("this is no PEM\n")


def _edge_toml(edge_line: str = "", key: str = "certs/edge-key.pem", ca: str = "certs/ca.pem") -> str:
    return "\n".join([
        "[edge]",
        'name = "edge-1"',
        'trust_domain = "iop.test"',
        'client_listen = "127.0.0.1:0"',
        'node_listen = "127.0.0.1:0"',
        "allow_anonymous = true",
        edge_line,
        "[tls]",
        f'ca = "{ca}"',
        'cert = "certs/edge.pem"',
        f'key = "{key}"',
    ]) + "\n"


def _node_toml(edge_addr: str = '"127.0.0.1:9"', key: str = "certs/node-node-a-key.pem",
               ca: str = "certs/ca.pem") -> str:
    return "\n".join([
        'node_id = "node-a"',
        'trust_domain = "iop.test"',
        f"edge_addr = {edge_addr}",
        'edge_name = "edge-1"',
        "[tls]",
        f'ca = "{ca}"',
        'cert = "certs/node-node-a.pem"',
        f'key = "{key}"',
    ]) + "\n"


CASES = [
    # (binary, config text, expected error line after "<binary>: error: ")
    ("edge-bin", _edge_toml("flow_window_bytes = 12"),
     "edge.toml: edge.flow_window_bytes: must be between 256 and 16777216 (got 12)"),
    ("edge-bin", _edge_toml(ca="certs/missing-ca.pem"),
     "edge.toml: tls.ca: cannot read certs/missing-ca.pem: No such file or directory (os error 2)"),
    ("edge-bin", _edge_toml(key="not-a-key.pem"),
     "edge.toml: tls: not-a-key.pem: no private key found"),
    ("node-bin", _node_toml(edge_addr="5"),
     "node.toml: edge_addr: invalid type: integer `5`, expected a string or an array of strings (line 3, column 13)"),
    ("node-bin", _node_toml(ca="certs/missing-ca.pem"),
     "node.toml: tls.ca: cannot read certs/missing-ca.pem: No such file or directory (os error 2)"),
    ("node-bin", _node_toml(key="not-a-key.pem"),
     "node.toml: tls: not-a-key.pem: no private key found"),
]


@pytest.mark.parametrize("binary,config,expected", CASES,
                         ids=[f"{b}-{i}" for i, (b, _, _) in enumerate(CASES)])
def test_a_bad_config_exits_1_naming_file_key_and_reason(binary, config, expected):
    # CONTRACT: S3
    d = Path(tempfile.mkdtemp(prefix="iop-e2e-start-"))
    _certs(d)
    name = "edge.toml" if binary == "edge-bin" else "node.toml"
    (d / name).write_text(config)
    done = subprocess.run([str(BIN_DIR / binary), "--config", name, "--cores", "0"], cwd=d,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1, (done.stdout, done.stderr)
    # Nothing was served: no readiness line on stdout.
    assert done.stdout == "", done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"{binary}: error: ")]
    assert errors == [f"{binary}: error: {expected}"], done.stderr
