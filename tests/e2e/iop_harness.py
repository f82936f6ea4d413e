"""Start and stop real IOP processes on loopback for end-to-end tests.

Every process binds port 0 and announces its address on stdout with one line
`IOP_READY <what> key=value ...`; the harness reads it, and stops every process
it started by PID (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BIN_DIR = Path(os.environ.get("IOP_BIN_DIR", Path(__file__).resolve().parents[2] / "target" / "debug"))
READY_TIMEOUT_S = 30.0


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready: dict = field(default_factory=dict)
    lines: list = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def log(self) -> str:
        return "".join(self.lines)


def _pump(stream, sink: list, ready_box: dict, event: threading.Event) -> None:
    for raw in iter(stream.readline, ""):
        sink.append(raw)
        if raw.startswith("IOP_READY ") and not event.is_set():
            parts = raw.split()
            ready_box["what"] = parts[1]
            for kv in parts[2:]:
                if "=" in kv:
                    k, v = kv.split("=", 1)
                    ready_box[k] = v
            event.set()
    event.set()


def start(name: str, argv: list[str], env: dict | None = None, wait_ready: bool = True) -> Proc:
    full_env = dict(os.environ)
    full_env.setdefault("RUST_LOG", "info")
    if env:
        full_env.update(env)
    popen = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
    )
    proc = Proc(name, popen)
    event = threading.Event()
    threading.Thread(target=_pump, args=(popen.stdout, proc.lines, proc.ready, event), daemon=True).start()
    if wait_ready:
        if not event.wait(READY_TIMEOUT_S) or not proc.ready:
            proc.stop(signal.SIGKILL)
            raise RuntimeError(f"{name} did not become ready:\n{proc.log()}")
    return proc


def http_json(url: str, timeout_s: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last_error = e
        time.sleep(interval_s)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last_error})")


class Cluster:
    """A mock provider, an Edge and N Nodes on loopback with fresh dev certs."""

    def __init__(self, node_ids=("node-a",), mock_args=(), edge_env=None, node_env=None,
                 provider_extra=(), reconnect=(1, 0), provider_capacity=64):
        # provider_extra: extra TOML lines for every node's [[nodes.providers]]
        # entry (e.g. "response_stall_timeout_ms = 500"); reconnect: the
        # nodes' (interval_sec, max_attempts).
        self.provider_extra = list(provider_extra)
        self.reconnect = reconnect
        self.dir = Path(tempfile.mkdtemp(prefix="iop-e2e-"))
        self.node_ids = list(node_ids)
        self.mock_args = list(mock_args)
        self.edge_env = edge_env or {}
        self.node_env = node_env or {}
        self.provider_capacity = provider_capacity
        self.procs: list[Proc] = []
        self.nodes: dict[str, Proc] = {}

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for p in reversed(self.procs):
            p.stop()

    def _start(self):
        certs = self.dir / "certs"
        subprocess.run(
            [str(BIN_DIR / "edge-bin"), "certs", "--out", str(certs), "--trust-domain", "iop.test",
             "--edge-name", "edge-1"] + sum((["--node", n] for n in self.node_ids), []),
            check=True, capture_output=True, text=True,
        )
        self.mock = start("mock", [str(BIN_DIR / "bench"), "mock-provider", "--port", "0"] + self.mock_args)
        self.procs.append(self.mock)
        mock_addr = self.mock.ready["addr"]
        edge_toml = self.dir / "edge.toml"
        edge_toml.write_text(self.edge_config(mock_addr))
        self.edge = start("edge", [str(BIN_DIR / "edge-bin"), "--config", str(edge_toml)], env=self.edge_env)
        self.procs.append(self.edge)
        self.base_url = f"http://{self.edge.ready['client']}"
        for node_id in self.node_ids:
            self.start_node(node_id)
        wait_until(self.all_nodes_connected, what="nodes connected")

    def edge_config(self, mock_addr: str) -> str:
        out = [
            "[edge]",
            'name = "edge-1"',
            'trust_domain = "iop.test"',
            'client_listen = "127.0.0.1:0"',
            'node_listen = "127.0.0.1:0"',
            "[tls]",
            'ca = "certs/ca.pem"',
            'cert = "certs/edge.pem"',
            'key = "certs/edge-key.pem"',
        ]
        for node_id in self.node_ids:
            out += [
                "[[nodes]]",
                f'id = "{node_id}"',
                "[[nodes.adapters]]",
                'name = "mock"',
                'kind = "openai_compat"',
                'profile = "openai"',
                f'base_url = "http://{mock_addr}"',
                "capacity = 64",
                "[[nodes.providers]]",
                'id = "mock-1"',
                'adapter = "mock"',
                'target = "mock-model"',
                f"capacity = {self.provider_capacity}",
            ] + self.provider_extra
        # A configured node that never connects: its model has no ready provider.
        out += [
            "[[nodes]]",
            'id = "node-offline"',
            "[[nodes.adapters]]",
            'name = "mock"',
            'kind = "openai_compat"',
            f'base_url = "http://{mock_addr}"',
            "[[nodes.providers]]",
            'id = "mock-1"',
            'adapter = "mock"',
            'target = "mock-model"',
            "capacity = 1",
        ]
        out += [
            "[[models]]",
            'name = "iop-test-model"',
            "providers = [" + ", ".join(f'"{n}/mock-1"' for n in self.node_ids) + "]",
            "[[models]]",
            'name = "offline-model"',
            'providers = ["node-offline/mock-1"]',
            "queue_timeout_ms = 300",
        ]
        return "\n".join(out) + "\n"

    def node_config(self, node_id: str) -> str:
        return "\n".join([
            f'node_id = "{node_id}"',
            'trust_domain = "iop.test"',
            f'edge_addr = "{self.edge.ready["nodes"]}"',
            'edge_name = "edge-1"',
            "[tls]",
            'ca = "certs/ca.pem"',
            f'cert = "certs/node-{node_id}.pem"',
            f'key = "certs/node-{node_id}-key.pem"',
            "[reconnect]",
            f"interval_sec = {self.reconnect[0]}",
            f"max_attempts = {self.reconnect[1]}",
        ]) + "\n"

    def start_node(self, node_id: str) -> Proc:
        path = self.dir / f"node-{node_id}.toml"
        path.write_text(self.node_config(node_id))
        proc = start(f"node {node_id}", [str(BIN_DIR / "node-bin"), "--config", str(path), "--cores", "0"],
                     env=self.node_env, wait_ready=False)
        self.procs.append(proc)
        self.nodes[node_id] = proc
        return proc

    def status(self) -> dict:
        return http_json(self.base_url + "/status")

    def all_nodes_connected(self) -> bool:
        providers = self.status()["providers"]
        connected = {p["node_id"] for p in providers if p["connected"]} - {"node-offline"}
        return connected == set(self.node_ids)

    def restart_edge(self) -> Proc:
        """Stops the Edge and starts a new one on the same node port (the
        client port changes; `base_url` follows it)."""
        nodes_addr = self.edge.ready["nodes"]
        self.edge.stop()
        self.procs.remove(self.edge)
        text = self.edge_config(self.mock.ready["addr"]).replace(
            'node_listen = "127.0.0.1:0"', f'node_listen = "{nodes_addr}"')
        edge_toml = self.dir / "edge.toml"
        edge_toml.write_text(text)
        self.edge = start("edge", [str(BIN_DIR / "edge-bin"), "--config", str(edge_toml)], env=self.edge_env)
        self.procs.append(self.edge)
        self.base_url = f"http://{self.edge.ready['client']}"
        return self.edge


def post_raw(url: str, body: dict, timeout_s: float = 20.0) -> tuple[int, dict, bytes]:
    """POSTs JSON; returns (status, headers, whole body) also for error statuses."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def sse_data(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]
