"""Several Edges of one cluster on a real etcd, on loopback, for end-to-end
tests.

    Etcd          1 member, or 3 members as one cluster; free ports, data in a
                  temp dir; stop_member(i) / start_member(i) by PID
    EdgeCluster   the etcd, N Edges of one cluster (certificates from one CA
                  with every Edge's name), `bench mock-provider` and M Nodes
                  whose `edge_addr` lists every Edge's node address and whose
                  `edge_name` lists every Edge name

Every Edge listens on ports chosen once (free at the time) and written into
its config, so an Edge stopped and started again (`kill_edge`, `term_edge`,
`start_edge`) comes back where the Nodes' lists say it is. Every process is
stopped by its PID; every line a process prints is kept with the monotonic
time it arrived (`Process.lines_since`, `Process.first_line`), which is how
the tests time log events such as a self-fence.

Every Edge has a peer listener (`[cluster] peer_listen = "127.0.0.1:0"`,
its bound address announced in etcd): a request reaching an Edge that owns
none of its model's nodes is forwarded to the Edge owning the most of them
(`forward_target` says which, as `cluster::route` decides). Besides
`MODEL` (served by every Node) each Node has a model of its own,
`node_model(node_id)`, so a test can make any Edge forward.

`StreamLoad` is a steady client load: threads that send streaming
completions in a loop to every Edge whose `/readyz` answers 200 (as a load
balancer checking it would), each with its own `x-request-id`, and record
each outcome.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from iop_harness import BIN_DIR, http_json, run_bin, wait_until

READY_TIMEOUT_S = 30.0
ETCD_START_TIMEOUT_S = 60.0
TRUST_DOMAIN = "iop.test"
CLUSTER_NAME = "e2e"
MODEL = "iop-test-model"
TARGET = "mock-model"
# The log line of an Edge that can no longer prove its etcd lease.
FENCE_LINE = "fencing every node this edge owns"
# How long a load thread waits after a request that did not succeed.
REFUSED_BACKOFF_S = 0.1


def node_model(node_id: str) -> str:
    """The model served by `node_id` alone."""
    return f"{MODEL}-{node_id}"


def forward_target(entry: str, model_nodes: list[str], owners: dict[str, str]) -> str | None:
    """Where Edge `entry` sends a request for a model of `model_nodes`,
    given node → owner (`cluster::route::decide`, every Edge having a peer
    listener): None (served at `entry`) when `entry` owns one of the nodes
    or nobody owns any; else the Edge owning the most of them, ties by
    name."""
    owning = [owners[n] for n in model_nodes if n in owners]
    if entry in owning or not owning:
        return None
    return min(set(owning), key=lambda e: (-owning.count(e), e))


def etcd_binary() -> str:
    """`/usr/bin/etcd`, else `etcd` on PATH; fails (never skips) without
    one, naming the package."""
    for candidate in ["/usr/bin/etcd"] + [str(Path(d) / "etcd") for d in os.environ.get("PATH", "").split(":") if d]:
        if Path(candidate).is_file():
            return candidate
    raise RuntimeError("etcd is not installed: run `apt-get install etcd-server` (scripts/e2e.sh does when root)")


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports, free when this returns (each bound
    at once, then all released). They are drawn below the kernel's
    ephemeral range (32768 and up by default), so the outgoing connections
    the processes of a test open meanwhile never take one of them before
    its Edge binds it (a port of the ephemeral range could be). A port is
    never handed out twice in one run: a cluster's Edges take theirs before
    its etcd members take their own, and both are released until bound."""
    rng = random.Random()
    socks = []
    try:
        while len(socks) < count:
            port = rng.randrange(20000, 32000)
            if port in _ISSUED_PORTS:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
        _ISSUED_PORTS.update(ports)
        return ports
    finally:
        for s in socks:
            s.close()


# Every port free_ports handed out in this run.
_ISSUED_PORTS: set[int] = set()


class Process:
    """One child process; every output line kept with its arrival time."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None, cwd: str | Path | None = None,
                 ready_prefix: str | None = "IOP_READY "):
        full_env = dict(os.environ)
        full_env.setdefault("RUST_LOG", "info")
        full_env.update(env or {})
        self.name = name
        self.ready: dict = {}
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._ready_event = threading.Event()
        self._ready_prefix = ready_prefix
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=full_env, cwd=cwd)
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self):
        for raw in iter(self.popen.stdout.readline, ""):
            now = time.monotonic()
            with self._lock:
                self.lines.append((now, raw))
            if self._ready_prefix and raw.startswith(self._ready_prefix) and not self._ready_event.is_set():
                parts = raw.split()
                self.ready["what"] = parts[1]
                for kv in parts[2:]:
                    if "=" in kv:
                        k, v = kv.split("=", 1)
                        self.ready[k] = v
                self._ready_event.set()
        self._ready_event.set()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S):
        if not self._ready_event.wait(timeout_s) or not self.ready:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"{self.name} did not become ready:\n{self.log()}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int):
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout=timeout_s)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int:
        if self.alive():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def timed_lines(self) -> list[tuple[float, str]]:
        if not self.alive():
            self._pump.join(timeout=5)
        with self._lock:
            return list(self.lines)

    def log(self) -> str:
        return "".join(line for _, line in self.timed_lines())

    def first_line(self, needle: str, since: float = 0.0) -> tuple[float, str] | None:
        """The first line containing `needle` that arrived at or after
        `since` (monotonic), with its arrival time."""
        return next(((t, line) for t, line in self.timed_lines() if t >= since and needle in line), None)


# ---------------------------------------------------------------------------
# etcd
# ---------------------------------------------------------------------------

@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"


def etcd_call(endpoint: str, path: str, body: dict, timeout_s: float = 3.0) -> dict:
    """One call of etcd's v3 JSON gateway (`POST /v3/...`)."""
    req = urllib.request.Request(f"http://{endpoint}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Etcd:
    """A real etcd of `size` members (one cluster) on loopback."""

    def __init__(self, size: int = 1, root: Path | None = None):
        self.binary = etcd_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="iop-etcd-", dir=root))
        ports = free_ports(2 * size)
        self.members = [
            EtcdMember(f"m{i}", ports[2 * i], ports[2 * i + 1], self.dir / f"m{i}.etcd", self.dir / f"m{i}.log")
            for i in range(size)
        ]
        self.initial_cluster = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)

    def start(self) -> "Etcd":
        for i in range(len(self.members)):
            self._spawn(i)
        self.wait_healthy()
        return self

    def _spawn(self, i: int):
        m = self.members[i]
        client_url = f"http://{m.endpoint}"
        peer_url = f"http://127.0.0.1:{m.peer_port}"
        log = open(m.log, "a")
        m.proc = subprocess.Popen(
            [self.binary, "--name", m.name, "--data-dir", str(m.data_dir),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new",
             "--initial-cluster-token", f"iop-e2e-{self.dir.name}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def endpoint(self, i: int) -> str:
        return self.members[i].endpoint

    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def running(self, i: int) -> bool:
        p = self.members[i].proc
        return p is not None and p.poll() is None

    def health(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint(i)}/health", timeout=2) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float = ETCD_START_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        for i, m in enumerate(self.members):
            if m.proc is None:
                continue
            while not self.health(i):
                if m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited ({m.proc.returncode}):\n{self.log_tail(i)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {m.name} not healthy within {timeout_s} s:\n{self.log_tail(i)}")
                time.sleep(0.05)

    def stop_member(self, i: int):
        """SIGKILL to member `i` by its PID; waits for it to exit."""
        p = self.members[i].proc
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        self.members[i].proc = None

    def start_member(self, i: int):
        """Starts a stopped member again on its ports and data, and waits
        until every running member is healthy."""
        assert self.members[i].proc is None, f"m{i} is running"
        self._spawn(i)
        self.wait_healthy()

    def leader(self) -> int:
        """The index of the Raft leader (asked of every running member)."""
        ids, leader = {}, None
        for i in range(len(self.members)):
            if not self.running(i):
                continue
            answer = etcd_call(self.endpoint(i), "/v3/maintenance/status", {})
            ids[answer["header"]["member_id"]] = i
            leader = answer["leader"]
        return ids[leader]

    def move_leader(self, to: int):
        """Makes member `to` the Raft leader (asked of the current one)."""
        target = etcd_call(self.endpoint(to), "/v3/maintenance/status", {})["header"]["member_id"]
        etcd_call(self.endpoint(self.leader()), "/v3/maintenance/transfer-leadership", {"targetID": target})
        wait_until(lambda: self.leader() == to, timeout_s=20, what=f"m{to} leading")

    def get(self, key: str, member: int = 0) -> dict | None:
        """The key-value of `key` (value decoded), or None."""
        answer = etcd_call(self.endpoint(member), "/v3/kv/range", {"key": b64(key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return {"value": base64.b64decode(kv.get("value", "")).decode(), "lease": kv.get("lease"),
                "mod_revision": int(kv["mod_revision"])}

    def log_tail(self, i: int, lines: int = 20) -> str:
        try:
            return "".join(self.members[i].log.read_text().splitlines(keepends=True)[-lines:])
        except OSError:
            return ""

    def close(self):
        """Stops every member and removes their data (etcd preallocates
        tens of MB of WAL per member)."""
        for i in range(len(self.members)):
            self.stop_member(i)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# Edges and Nodes
# ---------------------------------------------------------------------------

@dataclass
class EdgeSlot:
    """One Edge of the cluster: its name, fixed ports and the etcd members
    it talks to; `proc` is the running process (None while stopped)."""
    index: int
    name: str
    client_port: int
    node_port: int
    etcd_members: list[int]
    proc: Process | None = None
    starts: int = 0
    # The peer listener's address of the running process (port 0 in the
    # config: a new one on every start).
    peer_addr: str | None = None
    # The processes of earlier starts (their logs stay readable).
    past: list = None

    def __post_init__(self):
        self.past = []

    @property
    def client_addr(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def node_addr(self) -> str:
        return f"127.0.0.1:{self.node_port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.client_addr}"


def _client_key(entry) -> str:
    return entry["key"] if isinstance(entry, dict) else entry


class EdgeCluster:
    """etcd, N Edges of one cluster, the mock provider and M Nodes.

    edges: the Edge names. etcd_size: members of the etcd cluster.
    etcd_of: how each Edge reaches etcd: "all" (every member, in order) or
    "own" (Edge i only member i % etcd_size). lease_ttl_sec /
    keepalive_interval_sec: the Edges' `[cluster]` lease (small for tests).
    client_keys: {principal: key} or {principal: {"key", "scopes",
    "max_concurrent", "requests_per_minute", "tokens_per_minute",
    "models"}} on every Edge (each Edge enforces its share of a limit
    across the live Edges); the harness's own /status calls send the key
    of `admin_principal` (which must see the whole fleet: scopes admin or
    metrics). Without client keys the Edges run open.
    """

    def __init__(self, edges=("e1", "e2", "e3"), node_ids=("node-a", "node-b"), etcd_size=1, etcd_of="all",
                 lease_ttl_sec=4, keepalive_interval_sec=1, etcd_timeout_ms=1000, mock_args=(),
                 reconnect_interval_sec=1, jitter_percent=None, provider_capacity=64, edge_extra=(),
                 client_keys=None, admin_principal=None, cores=None, env=None):
        self.dir = Path(tempfile.mkdtemp(prefix="iop-e2e-cluster-"))
        self.etcd = Etcd(etcd_size, root=None)
        ports = free_ports(2 * len(edges))
        self.edges = [
            EdgeSlot(i, name, ports[2 * i], ports[2 * i + 1],
                     list(range(etcd_size)) if etcd_of == "all" else [i % etcd_size])
            for i, name in enumerate(edges)
        ]
        self.node_ids = list(node_ids)
        self.lease_ttl_sec = lease_ttl_sec
        self.keepalive_interval_sec = keepalive_interval_sec
        self.etcd_timeout_ms = etcd_timeout_ms
        self.mock_args = list(mock_args)
        self.reconnect_interval_sec = reconnect_interval_sec
        self.jitter_percent = jitter_percent
        self.provider_capacity = provider_capacity
        self.edge_extra = list(edge_extra)
        self.client_keys = dict(client_keys or {})
        self.admin_principal = admin_principal
        if self.client_keys:
            assert admin_principal in self.client_keys, "client keys need an admin_principal for /status"
        # --cores of each process: alternate the two cores of the machine
        # unless told (Edge i on core i % 2).
        self.cores = cores
        self.env = dict(env or {})
        self.nodes: dict[str, Process] = {}
        self.mock: Process | None = None

    # -- lifecycle ---------------------------------------------------------

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
        for proc in list(self.nodes.values()):
            proc.stop()
        for slot in self.edges:
            if slot.proc is not None:
                slot.proc.stop()
        if self.mock is not None:
            self.mock.stop()
        self.etcd.close()

    def _cores(self, i: int) -> str:
        if self.cores is not None:
            return self.cores
        return str(i % max(1, min(2, os.cpu_count() or 1)))

    def _start(self):
        self.etcd.start()
        run_bin(["edge-bin", "certs", "--out", str(self.dir / "certs"), "--trust-domain", TRUST_DOMAIN]
                + sum((["--edge-name", s.name] for s in self.edges), [])
                + sum((["--node", n] for n in self.node_ids), []))
        self.mock = Process("mock", [str(BIN_DIR / "bench"), "mock-provider", "--port", "0"] + self.mock_args)
        self.mock.wait_ready()
        self._key_lines = self._client_key_lines()
        for slot in self.edges:
            self.start_edge(slot.index)
        for i, node_id in enumerate(self.node_ids):
            self.start_node(node_id, i)
        self.wait_settled()

    # -- configs -----------------------------------------------------------

    def _client_key_lines(self) -> list[str]:
        out = []
        for principal, key in self.client_keys.items():
            key_hash = run_bin(["edge-bin", "keys", "hash-client-key"], stdin=_client_key(key) + "\n")
            out += ["[[client_keys]]", f'principal = "{principal}"', f'key_hash = "{key_hash}"']
            if isinstance(key, dict):
                if key.get("scopes"):
                    out.append("scopes = [" + ", ".join(f'"{s}"' for s in key["scopes"]) + "]")
                for limit in ("max_concurrent", "requests_per_minute", "tokens_per_minute"):
                    if limit in key:
                        out.append(f"{limit} = {key[limit]}")
                if "models" in key:
                    out.append("models = [" + ", ".join(f'"{m}"' for m in key["models"]) + "]")
        return out

    def edge_config(self, slot: EdgeSlot) -> str:
        mock = self.mock.ready["addr"]
        out = [
            "[edge]",
            f'name = "{slot.name}"',
            f'trust_domain = "{TRUST_DOMAIN}"',
            f'client_listen = "{slot.client_addr}"',
            f'node_listen = "{slot.node_addr}"',
        ]
        if not self.client_keys:
            out.append("allow_anonymous = true")
        out += self.edge_extra
        out += [
            "[tls]",
            'ca = "certs/ca.pem"',
            f'cert = "certs/edge-{slot.name}.pem"',
            f'key = "certs/edge-{slot.name}-key.pem"',
            "[cluster]",
            f'name = "{CLUSTER_NAME}"',
            "etcd_endpoints = [" + ", ".join(f'"{self.etcd.endpoint(m)}"' for m in slot.etcd_members) + "]",
            f"lease_ttl_sec = {self.lease_ttl_sec}",
            f"keepalive_interval_sec = {self.keepalive_interval_sec}",
            f"etcd_timeout_ms = {self.etcd_timeout_ms}",
            'peer_listen = "127.0.0.1:0"',
        ]
        for node_id in self.node_ids:
            out += [
                "[[nodes]]",
                f'id = "{node_id}"',
                "[[nodes.adapters]]",
                'name = "mock"',
                'kind = "openai_compat"',
                'profile = "openai"',
                f'base_url = "http://{mock}"',
                "capacity = 64",
                "[[nodes.providers]]",
                'id = "mock-1"',
                'adapter = "mock"',
                f'target = "{TARGET}"',
                f"capacity = {self.provider_capacity}",
            ]
        out += [
            "[[models]]",
            f'name = "{MODEL}"',
            "providers = [" + ", ".join(f'"{n}/mock-1"' for n in self.node_ids) + "]",
        ]
        for node_id in self.node_ids:
            out += ["[[models]]", f'name = "{node_model(node_id)}"', f'providers = ["{node_id}/mock-1"]']
        out += self._key_lines
        return "\n".join(out) + "\n"

    def node_config(self, node_id: str) -> str:
        out = [
            f'node_id = "{node_id}"',
            f'trust_domain = "{TRUST_DOMAIN}"',
            "edge_addr = [" + ", ".join(f'"{s.node_addr}"' for s in self.edges) + "]",
            "edge_name = [" + ", ".join(f'"{s.name}"' for s in self.edges) + "]",
            "[tls]",
            'ca = "certs/ca.pem"',
            f'cert = "certs/node-{node_id}.pem"',
            f'key = "certs/node-{node_id}-key.pem"',
            "[reconnect]",
            f"interval_sec = {self.reconnect_interval_sec}",
            "max_attempts = 0",
        ]
        if self.jitter_percent is not None:
            out.append(f"jitter_percent = {self.jitter_percent}")
        return "\n".join(out) + "\n"

    # -- processes ---------------------------------------------------------

    def start_edge(self, i: int) -> Process:
        """Starts Edge `i` on its ports (the same on every start) and waits
        for its IOP_READY line."""
        slot = self.edges[i]
        assert slot.proc is None or not slot.proc.alive(), f"{slot.name} is running"
        path = self.dir / f"edge-{slot.name}.toml"
        path.write_text(self.edge_config(slot))
        slot.starts += 1
        # The listening ports may still be held for an instant by the
        # previous process's exit: retry the bind a few times.
        for attempt in range(20):
            proc = Process(f"edge {slot.name}#{slot.starts}",
                           [str(BIN_DIR / "edge-bin"), "--config", str(path), "--cores", self._cores(i)],
                           env=self.env, cwd=self.dir)
            try:
                proc.wait_ready()
                break
            except RuntimeError:
                if "Address already in use" not in proc.log() or attempt == 19:
                    raise
                time.sleep(0.25)
        assert proc.ready["client"] == slot.client_addr and proc.ready["nodes"] == slot.node_addr, proc.ready
        assert proc.ready.get("peer", "").startswith("127.0.0.1:"), proc.ready
        if slot.proc is not None:
            slot.past.append(slot.proc)
        slot.proc = proc
        slot.peer_addr = proc.ready["peer"]
        return proc

    def kill_edge(self, i: int) -> float:
        """SIGKILL to Edge `i`; returns the monotonic time it was sent."""
        slot = self.edges[i]
        at = time.monotonic()
        slot.proc.stop(signal.SIGKILL)
        return at

    def term_edge(self, i: int) -> float:
        """SIGTERM to Edge `i` (it drains, then exits); does not wait.
        Returns the monotonic time it was sent."""
        at = time.monotonic()
        self.edges[i].proc.send(signal.SIGTERM)
        return at

    def restart_edge(self, i: int, sig: int = signal.SIGTERM, exit_timeout_s: float = 30.0) -> Process:
        """Stops Edge `i` with `sig`, waits for its exit, starts it again on
        the same ports."""
        slot = self.edges[i]
        slot.proc.send(sig)
        slot.proc.wait(exit_timeout_s)
        return self.start_edge(i)

    def start_node(self, node_id: str, i: int = 0) -> Process:
        path = self.dir / f"node-{node_id}.toml"
        path.write_text(self.node_config(node_id))
        proc = Process(f"node {node_id}",
                       [str(BIN_DIR / "node-bin"), "--config", str(path), "--cores", self._cores(i + 1)],
                       env=self.env, cwd=self.dir, ready_prefix=None)
        self.nodes[node_id] = proc
        return proc

    def restart_node(self, node_id: str):
        i = self.node_ids.index(node_id)
        self.nodes[node_id].stop()
        self.start_node(node_id, i)

    # -- observation -------------------------------------------------------

    def live(self) -> list[int]:
        """Indices of the Edges whose process runs."""
        return [s.index for s in self.edges if s.proc is not None and s.proc.alive()]

    def index_of(self, name: str) -> int:
        return next(s.index for s in self.edges if s.name == name)

    def auth_headers(self) -> dict:
        if not self.client_keys:
            return {}
        return {"authorization": f"Bearer {_client_key(self.client_keys[self.admin_principal])}"}

    def status(self, i: int, timeout_s: float = 5.0) -> dict:
        return http_json(self.edges[i].base_url + "/status", timeout_s=timeout_s, headers=self.auth_headers())

    def readyz(self, i: int, timeout_s: float = 2.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.edges[i].base_url + "/readyz", timeout=timeout_s) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self, i: int) -> str:
        req = urllib.request.Request(self.edges[i].base_url + "/metrics", headers=self.auth_headers())
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read().decode()

    def metric(self, i: int, series: str) -> int | None:
        """The value of `series` (name and labels exactly as exposed) in
        Edge `i`'s /metrics, None when absent."""
        for line in self.metrics(i).splitlines():
            if line.startswith(series + " "):
                return int(float(line.split(" ")[-1]))
        return None

    def access_line(self, i: int, request_id: str, timeout_s: float = 10.0) -> dict:
        """Edge `i`'s access log line (logfmt) of `request_id`, parsed,
        from any of its processes; waits for it (a line is written when its
        request ends)."""
        found = {}
        slot = self.edges[i]

        def present():
            lines = [line for proc in slot.past + [slot.proc] for _, line in proc.timed_lines()]
            line = next((line for line in lines
                         if line.startswith("ts=") and f" request_id={request_id} " in line), None)
            if line is not None:
                found.update(parse_logfmt(line))
            return line is not None

        wait_until(present, timeout_s=timeout_s, what=f"{self.edges[i].name}'s access log line of {request_id}")
        return found

    def owners(self, i: int | None = None) -> dict[str, str]:
        """node id → owning Edge name, from Edge `i`'s /status (the first
        live Edge that answers when `i` is None)."""
        candidates = [i] if i is not None else self.live()
        last = None
        for j in candidates:
            try:
                return {n["node_id"]: n["edge"] for n in self.status(j, timeout_s=2)["cluster"]["nodes"]}
            except OSError as e:
                last = e
        raise RuntimeError(f"no Edge answered /status: {last}")

    def provider(self, i: int, node_id: str) -> dict:
        """Node `node_id`'s provider as Edge `i`'s /status shows it."""
        return next(p for p in self.status(i)["providers"]
                    if p["node_id"] == node_id and p["provider_id"] == "mock-1")

    def settled(self, live: list[int] | None = None) -> dict[str, str] | None:
        """The owners map if the cluster is settled, else None. Settled:
        every live Edge holds its lease and lists exactly the live Edges;
        every live Edge shows the same owner for every node, always a live
        Edge; and on its owner each node's provider is connected and
        available (the node is ready)."""
        live = self.live() if live is None else live
        live_names = sorted(self.edges[i].name for i in live)
        views = {}
        for i in live:
            doc = self.status(i, timeout_s=2)
            cluster = doc["cluster"]
            if not cluster["up"] or sorted(cluster["edges"]) != live_names:
                return None
            views[i] = ({n["node_id"]: n["edge"] for n in cluster["nodes"]}, doc["providers"])
        owners = views[live[0]][0]
        if set(owners) != set(self.node_ids) or any(v[0] != owners for v in views.values()):
            return None
        if not set(owners.values()) <= set(live_names):
            return None
        for node_id, edge in owners.items():
            providers = views[self.index_of(edge)][1]
            if not any(p["node_id"] == node_id and p["connected"] and p["status"] == "available"
                       for p in providers):
                return None
        return owners

    def rehomed(self, node_ids: list[str], among: list[int]) -> dict[str, str] | None:
        """node → owner for `node_ids` if each is owned, as the first Edge
        of `among` sees it, by an Edge of `among` on which the node's
        provider is connected and available; else None. (Unlike
        `settled`, this does not wait for a dead Edge's lease to expire.)"""
        names = {self.edges[i].name for i in among}
        owners = self.owners(among[0])
        if not all(owners.get(n) in names for n in node_ids):
            return None
        for n in node_ids:
            p = self.provider(self.index_of(owners[n]), n)
            if not (p["connected"] and p["status"] == "available"):
                return None
        return {n: owners[n] for n in node_ids}

    def wait_settled(self, timeout_s: float = 30.0, live: list[int] | None = None) -> dict[str, str]:
        """Waits until `settled`; returns the owners map."""
        box = {}

        def check():
            box["owners"] = self.settled(live)
            return box["owners"] is not None

        try:
            wait_until(check, timeout_s=timeout_s, interval_s=0.1, what="cluster settled")
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.describe()}") from None
        return box["owners"]

    def spread_nodes(self, attempts: int = 12) -> dict[str, str]:
        """Restarts Nodes until no two share an Edge (each dial picks an
        Edge at random; the tests want a survivor that owns a node when
        one Edge goes). Needs at least as many Edges as Nodes."""
        assert len(self.node_ids) <= len(self.edges)
        owners = self.wait_settled()
        for _ in range(attempts):
            seen = {}
            crowded = [n for n, e in sorted(owners.items()) if seen.setdefault(e, n) != n]
            if not crowded:
                return owners
            self.restart_node(crowded[0])
            wait_until(lambda: crowded[0] not in self.owners() or self.settled() is not None, timeout_s=20,
                       what="restarted node registered")
            owners = self.wait_settled()
        raise RuntimeError(f"nodes still share an Edge after {attempts} restarts: {owners}")

    def describe(self) -> str:
        """Every live Edge's cluster view and providers, for a failure
        message."""
        out = []
        for i in self.live():
            try:
                doc = self.status(i, timeout_s=2)
                provs = [(p["node_id"], p["connected"], p["status"], p["in_flight"]) for p in doc["providers"]]
                out.append(f"{self.edges[i].name}: cluster={doc.get('cluster')} providers={provs}")
            except OSError as e:
                out.append(f"{self.edges[i].name}: /status failed: {e}")
        return "\n".join(out)

    def mock_stats(self) -> dict:
        return http_json(f"http://{self.mock.ready['addr']}/admin/stats")

    def direct(self, body: dict) -> bytes:
        """The mock's own answer to `body` (model = the target)."""
        req = urllib.request.Request(f"http://{self.mock.ready['addr']}/v1/chat/completions",
                                     data=json.dumps(dict(body, model=TARGET)).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.read()


def parse_logfmt(line: str) -> dict:
    fields = {}
    for m in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line):
        key, value = m.group(1), m.group(2)
        fields[key] = json.loads(value) if value.startswith('"') else value
    return fields


def ids_out(raw: bytes) -> bytes:
    """The mock numbers its completions (chatcmpl-mock-<seq>) and stamps
    each object with its send time (iop_mock_sent_ns); everything else of
    two answers to one request is the same bytes."""
    raw = re.sub(rb"chatcmpl-mock-\d+", b"chatcmpl-mock-N", raw)
    return re.sub(rb'"iop_mock_sent_ns":\d+', b'"iop_mock_sent_ns":0', raw)


# ---------------------------------------------------------------------------
# Client load
# ---------------------------------------------------------------------------

@dataclass
class Outcome:
    """One request of a load: where it went, when, and how it ended.

    kind: "ok" (200 and the mock's exact bytes), "refused" (no response:
    connection refused or reset before a status line, or a 503 with
    retry-after), "cut" (a 200 whose body is not the mock's full bytes or
    broke off), "error" (any other status).
    """
    edge: int
    sent_at: float
    request_id: str = ""
    headers_at: float | None = None
    ended_at: float = 0.0
    status: int | None = None
    kind: str = ""
    detail: str = ""
    retry_after: str | None = None


class StreamLoad:
    """Threads sending the same streaming completion in a loop to every
    Edge whose /readyz answers 200 (re-checked every `refresh_s`), in
    turn, each request on a new connection with its own `x-request-id`
    (`<prefix>-<n>`: the access log lines of both Edges of a forwarded
    request carry it).
    """

    def __init__(self, cluster: EdgeCluster, body: dict, expected: bytes, threads: int = 4,
                 refresh_s: float = 0.1, request_timeout_s: float = 30.0, prefix: str = "load"):
        self.cluster = cluster
        self.prefix = prefix
        self._sent = 0
        self.body = json.dumps(body).encode()
        self.expected = ids_out(expected)
        self.threads = threads
        self.refresh_s = refresh_s
        self.request_timeout_s = request_timeout_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._targets: list[int] = []
        self._next = 0
        self._workers: list[threading.Thread] = []

    def __enter__(self):
        self._refresh()
        assert self._targets, "no Edge is ready"
        self._workers = [threading.Thread(target=self._route_loop, daemon=True)]
        self._workers += [threading.Thread(target=self._send_loop, daemon=True) for _ in range(self.threads)]
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self._stop.set()
        for w in self._workers:
            w.join(timeout=self.request_timeout_s + 5)

    def _refresh(self):
        targets = []
        for slot in self.cluster.edges:
            try:
                if self.cluster.readyz(slot.index, timeout_s=1.0)[0] == 200:
                    targets.append(slot.index)
            except OSError:
                pass
        with self._lock:
            self._targets = targets

    def _route_loop(self):
        while not self._stop.wait(self.refresh_s):
            self._refresh()

    def _pick(self) -> tuple[int, str] | None:
        with self._lock:
            if not self._targets:
                return None
            self._next += 1
            self._sent += 1
            return self._targets[self._next % len(self._targets)], f"{self.prefix}-{self._sent}"

    def _send_loop(self):
        while not self._stop.is_set():
            picked = self._pick()
            if picked is None:
                time.sleep(0.05)
                continue
            edge, request_id = picked
            outcome = send_stream(self.cluster.edges[edge], edge, self.body, self.expected, self.request_timeout_s,
                                  request_id=request_id)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.kind != "ok":
                # As a client would: not straight back at a refusing Edge.
                self._stop.wait(REFUSED_BACKOFF_S)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)


def send_stream(slot: EdgeSlot, edge: int, body: bytes, expected: bytes, timeout_s: float,
                headers: dict | None = None, request_id: str = "") -> Outcome:
    """One POST of `body` to Edge `slot` on a new connection (with
    `x-request-id: request_id` if given), classified against the
    `expected` bytes (ids normalized)."""
    out = Outcome(edge=edge, sent_at=time.monotonic(), request_id=request_id)
    conn = http.client.HTTPConnection(slot.client_addr, timeout=timeout_s)
    extra = {"x-request-id": request_id} if request_id else {}
    try:
        try:
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json", **extra, **(headers or {})})
            resp = conn.getresponse()
        except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected,
                BrokenPipeError) as e:
            out.kind, out.detail = "refused", repr(e)
            return out
        out.headers_at = time.monotonic()
        out.status = resp.status
        out.retry_after = resp.getheader("retry-after")
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            out.kind, out.detail = ("cut" if resp.status == 200 else "error"), repr(e)
            return out
        if resp.status == 200:
            if ids_out(data) == expected:
                out.kind = "ok"
            else:
                out.kind, out.detail = "cut", f"{len(data)} bytes, not the mock's {len(expected)}: {data[-200:]!r}"
        elif resp.status == 503 and out.retry_after is not None:
            out.kind, out.detail = "refused", data.decode(errors="replace")[:300]
        else:
            out.kind, out.detail = "error", f"{resp.status}: {data.decode(errors='replace')[:300]}"
        return out
    except (OSError, http.client.HTTPException) as e:
        out.kind, out.detail = "error", repr(e)
        return out
    finally:
        out.ended_at = time.monotonic()
        conn.close()
