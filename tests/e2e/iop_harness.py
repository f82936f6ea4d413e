"""Start and stop real IOP processes on loopback for end-to-end tests.

Every process binds port 0 and announces its address on stdout with one line
`IOP_READY <what> key=value ...`; the harness reads it, and stops every process
it started by PID (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import signal
import ssl
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
    pump: threading.Thread | None = None

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
        # Once the process has exited, its last lines may still sit in the
        # pipe: wait for the pump to read them to EOF.
        if self.pump is not None and self.popen.poll() is not None:
            self.pump.join(timeout=5)
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


def start(name: str, argv: list[str], env: dict | None = None, wait_ready: bool = True,
          cwd: str | Path | None = None) -> Proc:
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
        cwd=cwd,
    )
    proc = Proc(name, popen)
    event = threading.Event()
    proc.pump = threading.Thread(target=_pump, args=(popen.stdout, proc.lines, proc.ready, event), daemon=True)
    proc.pump.start()
    if wait_ready:
        if not event.wait(READY_TIMEOUT_S) or not proc.ready:
            proc.stop(signal.SIGKILL)
            raise RuntimeError(f"{name} did not become ready:\n{proc.log()}")
    return proc


def http_json(url: str, timeout_s: float = 5.0, headers: dict | None = None,
              context: ssl.SSLContext | None = None):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout_s, context=context) as resp:
        return json.loads(resp.read())


def run_bin(argv: list[str], stdin: str | None = None) -> str:
    """Runs one of the built binaries to completion; returns its stdout, stripped."""
    done = subprocess.run([str(BIN_DIR / argv[0])] + argv[1:], input=stdin, check=True,
                          capture_output=True, text=True)
    return done.stdout.strip()


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


def _client_key(entry) -> str:
    """The key of a Cluster client_keys entry (a key, or a dict with one)."""
    return entry["key"] if isinstance(entry, dict) else entry


# Models a Cluster(ollama=True) adds: served by Ollama-kind providers only,
# and by an OpenAI-compatible and an Ollama provider together (U7).
OLLAMA_MODEL = "iop-ollama-model"
MIXED_MODEL = "iop-mixed-model"
# The same providers with the Ollama ones listed first (ties go to them).
MIXED_OLLAMA_FIRST_MODEL = "iop-mixed-ollama-first"


class Cluster:
    """A mock provider, an Edge and N Nodes on loopback with fresh dev certs."""

    def __init__(self, node_ids=("node-a",), mock_args=(), edge_env=None, node_env=None,
                 provider_extra=(), reconnect=(1, 0), provider_capacity=64, ollama=False,
                 credentials=None, client_keys=None, cores="0", edge_extra=(),
                 provider_tls=None, client_tls=False, tls_fixtures=False, client_listen="127.0.0.1:0",
                 node_extra=(), routing="least_loaded", profile="openai", extra_toml=()):
        # provider_tls: serve the mock over HTTPS with this `bench
        # tls-fixtures` certificate ("https", "wrong-host", "expired",
        # "unknown-ca"); every adapter then uses https://localhost:<port> with
        # ca_file = the fixtures' CA. client_tls: the Edge's client listener
        # serves HTTPS ([edge.client_tls], the "https" fixture), and
        # base_url is https://localhost:<port>. Either one (or tls_fixtures)
        # makes the Edge and the Nodes use the fixtures' SPIFFE certificates
        # (tls/edge.pem, tls/node-<id>.pem), which have rotated twins.
        self.provider_tls = provider_tls
        self.client_tls = client_tls
        self.fixtures = provider_tls is not None or client_tls or tls_fixtures
        # provider_extra: extra TOML lines for every node's [[nodes.providers]]
        # entry (e.g. "response_stall_timeout_ms = 500"); reconnect: the
        # nodes' (interval_sec, max_attempts). ollama: every node also gets an
        # Ollama-kind adapter "ollama" on the same mock (which speaks both
        # protocols) with provider "ollama-1" serving the same target, and the
        # Edge gets models OLLAMA_MODEL (only the Ollama providers) and
        # MIXED_MODEL (the OpenAI-compatible and the Ollama provider of every
        # node, in that order: U7) and MIXED_OLLAMA_FIRST_MODEL (the same,
        # Ollama providers first).
        self.ollama = ollama
        # edge_extra: more `key = value` lines of the Edge's [edge] table
        # (e.g. "flow_window_bytes = 65536").
        self.edge_extra = list(edge_extra)
        # cores: the --cores list of the Edge and every Node ("0-1": the
        # multi-core layout, Control and the Node session on core 0).
        self.cores = cores
        # credentials: enable the credential plane (C1-C5): a dict with
        # "secret" (the provider API key, written to a 0600 secret file, or
        # with "secret_env": NAME given to the Edge in that environment
        # variable instead) and optional "header", "format" and "slot_extra"
        # (extra TOML lines of the slot). Every node gets a recipient key and its "mock-1"
        # provider is served by slot "mock-key" (or only the "node/provider"
        # entries of "providers"; those of "spare_providers" by a second slot,
        # "spare-key", with the same secret); with "slot_per_node": True each node's
        # "mock-1" is served by a slot of its own, "mock-key-<node id>" (same secret), with
        # the extra lines "slot_extra_of"[node id]. client_keys: {principal:
        # key} or {principal: {"key": key, "scopes": [...], and optionally
        # "max_concurrent", "requests_per_minute", "tokens_per_minute",
        # "tokens_per_day", "tokens_per_month", "models", "priority" (a class
        # name or a number), "weight"}}; requests then
        # need `Authorization: Bearer <key>` (the harness's own /status calls
        # send the first key). client_listen: the Edge's edge.client_listen.
        self.credentials = credentials
        self.edge_env = dict(edge_env or {})
        if credentials is not None and "secret_env" in credentials:
            self.edge_env[credentials["secret_env"]] = credentials["secret"]
        self.client_keys = dict(client_keys or {})
        self.client_listen = client_listen
        self.recipient_key_path: dict[str, str] = {}
        self.provider_extra = list(provider_extra)
        self.reconnect = reconnect
        self.dir = Path(tempfile.mkdtemp(prefix="iop-e2e-"))
        self.node_ids = list(node_ids)
        self.mock_args = list(mock_args)
        self.node_env = node_env or {}
        # node_extra: more TOML lines at the end of every node's config
        # (e.g. a `[metrics]` table).
        self.node_extra = list(node_extra)
        self.provider_capacity = provider_capacity
        # routing: the `routing` of the model every node serves: least_loaded,
        # so that the suite's spread over nodes does not follow its identical
        # prompts; None leaves the key out (the default: prefix with two or
        # more nodes).
        self.routing = routing
        # profile: the protocol profile of every node's OpenAI-compatible
        # adapter ("openai", "vllm", "llama_cpp", "sglang": which operations
        # its providers serve). extra_toml: more lines at the end of the
        # Edge's config (e.g. more [[models]] of the same providers).
        self.profile = profile
        self.extra_toml = list(extra_toml)
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
        if self.fixtures:
            done = subprocess.run(
                [str(BIN_DIR / "bench"), "tls-fixtures", "--out", str(self.dir / "tls"), "--trust-domain",
                 "iop.test", "--edge-name", "edge-1"] + sum((["--node", n] for n in self.node_ids), []),
                check=True, capture_output=True, text=True,
            )
            self.serials = json.loads(done.stdout)["serials"]
        if self.credentials is not None:
            self._make_credentials()
        mock_tls = []
        if self.provider_tls is not None:
            tls = self.dir / "tls"
            mock_tls = ["--tls-cert", str(tls / f"{self.provider_tls}.pem"),
                        "--tls-key", str(tls / f"{self.provider_tls}-key.pem")]
        self.mock = start("mock", [str(BIN_DIR / "bench"), "mock-provider", "--port", "0"] + mock_tls
                          + self.mock_args)
        self.procs.append(self.mock)
        mock_addr = self.mock.ready["addr"]
        edge_toml = self.dir / "edge.toml"
        edge_toml.write_text(self.edge_config(mock_addr))
        self.edge = start("edge", [str(BIN_DIR / "edge-bin"), "--config", str(edge_toml), "--cores", self.cores],
                          env=self.edge_env)
        self.procs.append(self.edge)
        self.base_url = self.client_url(self.edge.ready["client"])
        for node_id in self.node_ids:
            self.start_node(node_id)
        wait_until(self.all_nodes_connected, what="nodes connected")

    def client_url(self, addr: str) -> str:
        """The Edge's client base URL: https://localhost:<port> with
        client_tls (the fixture certificate names localhost)."""
        if self.client_tls:
            return f"https://localhost:{addr.rsplit(':', 1)[1]}"
        return f"http://{addr}"

    def ca_file(self) -> str:
        """The fixtures' CA (trusts the HTTPS listener and the HTTPS mock)."""
        return str(self.dir / "tls" / "ca.pem")

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context trusting the fixtures' CA, when anything serves
        HTTPS."""
        if not self.fixtures:
            return None
        return ssl.create_default_context(cafile=self.ca_file())

    def mock_url(self) -> str:
        """The mock provider's base URL as the Node reaches it."""
        addr = self.mock.ready["addr"]
        if self.provider_tls is not None:
            return f"https://localhost:{addr.rsplit(':', 1)[1]}"
        return f"http://{addr}"

    def _make_credentials(self):
        keys = self.dir / "keys"
        keys.mkdir()
        self.issuer_public_key = run_bin(["edge-bin", "keys", "issuer", "--out", str(keys / "issuer.key")])
        self.recipient_public_key = {}
        for node_id in self.node_ids:
            self.new_recipient_key(node_id, f"node-{node_id}.key")
        secrets = self.dir / "secrets"
        secrets.mkdir()
        secret = secrets / "provider"
        secret.write_text(self.credentials["secret"] + "\n")
        os.chmod(secret, 0o600)

    def new_recipient_key(self, node_id: str, file_name: str) -> str:
        """Generates a recipient key for `node_id` under keys/ and makes the
        node's config use it; returns the public key (x25519:...)."""
        public = run_bin(["node-bin", "keys", "recipient", "--out", str(self.dir / "keys" / file_name)])
        self.recipient_key_path[node_id] = f"keys/{file_name}"
        self.recipient_public_key.setdefault(node_id, public)
        return public

    def auth_headers(self) -> dict:
        """The Authorization header of the first client key, if any."""
        if not self.client_keys:
            return {}
        return {"authorization": f"Bearer {_client_key(next(iter(self.client_keys.values())))}"}

    def credentials_config(self) -> list[str]:
        out = []
        if self.credentials is not None:
            def slot(name: str, providers, extra) -> list[str]:
                return [
                    "[[credentials.slots]]",
                    f'name = "{name}"',
                    (f'secret_env = "{self.credentials["secret_env"]}"' if "secret_env" in self.credentials
                     else 'secret_file = "secrets/provider"'),
                    f'header = "{self.credentials.get("header", "Authorization")}"',
                    f'format = "{self.credentials.get("format", "Bearer {secret}")}"',
                    "providers = [" + ", ".join(f'"{p}"' for p in providers) + "]",
                ] + list(extra)
            out += ["[credentials]", 'issuer_key = "keys/issuer.key"']
            if self.credentials.get("slot_per_node"):
                for n in self.node_ids:
                    out += slot(f"mock-key-{n}", [f"{n}/mock-1"],
                                self.credentials.get("slot_extra_of", {}).get(n, ()))
            else:
                providers = self.credentials.get("providers", [f"{n}/mock-1" for n in self.node_ids])
                out += slot("mock-key", providers, self.credentials.get("slot_extra", ()))
                if self.credentials.get("spare_providers"):
                    out += slot("spare-key", self.credentials["spare_providers"], ())
        for principal, key in self.client_keys.items():
            key_hash = run_bin(["edge-bin", "keys", "hash-client-key"], stdin=_client_key(key) + "\n")
            out += ["[[client_keys]]", f'principal = "{principal}"', f'key_hash = "{key_hash}"']
            if isinstance(key, dict) and key.get("scopes"):
                out.append("scopes = [" + ", ".join(f'"{s}"' for s in key["scopes"]) + "]")
            if isinstance(key, dict):
                for limit in ("max_concurrent", "requests_per_minute", "tokens_per_minute",
                              "tokens_per_day", "tokens_per_month"):
                    if limit in key:
                        out.append(f"{limit} = {key[limit]}")
                if "models" in key:
                    out.append("models = [" + ", ".join(f'"{m}"' for m in key["models"]) + "]")
                if "priority" in key:
                    p = key["priority"]
                    out.append(f'priority = "{p}"' if isinstance(p, str) else f"priority = {p}")
                if "weight" in key:
                    out.append(f"weight = {key['weight']}")
        return out

    def edge_config(self, mock_addr: str) -> str:
        certs = "tls" if self.fixtures else "certs"
        out = [
            "[edge]",
            'name = "edge-1"',
            'trust_domain = "iop.test"',
            f'client_listen = "{self.client_listen}"',
            'node_listen = "127.0.0.1:0"',
        ]
        if not self.client_keys and not any(l.startswith("allow_anonymous") for l in self.edge_extra):
            # An Edge without client keys must say it runs open (before
            # edge_extra, which may open a subtable such as [edge.usage_log]).
            out.append("allow_anonymous = true")
        out += self.edge_extra
        if self.client_tls:
            out += [
                "[edge.client_tls]",
                'cert = "tls/https.pem"',
                'key = "tls/https-key.pem"',
            ]
        out += [
            "[tls]",
            f'ca = "{certs}/ca.pem"',
            f'cert = "{certs}/edge.pem"',
            f'key = "{certs}/edge-key.pem"',
        ]
        provider_base = f"http://{mock_addr}"
        provider_tls = []
        if self.provider_tls is not None:
            provider_base = f"https://localhost:{mock_addr.rsplit(':', 1)[1]}"
            provider_tls = ['ca_file = "tls/ca.pem"']
        for node_id in self.node_ids:
            out += ["[[nodes]]", f'id = "{node_id}"']
            if self.credentials is not None:
                out.append(f'recipient_key = "{self.recipient_public_key[node_id]}"')
            out += [
                "[[nodes.adapters]]",
                'name = "mock"',
                'kind = "openai_compat"',
                f'profile = "{self.profile}"',
                f'base_url = "{provider_base}"',
            ] + provider_tls + [
                "capacity = 64",
                "[[nodes.providers]]",
                'id = "mock-1"',
                'adapter = "mock"',
                'target = "mock-model"',
                f"capacity = {self.provider_capacity}",
            ] + self.provider_extra
            if self.ollama:
                out += [
                    "[[nodes.adapters]]",
                    'name = "ollama"',
                    'kind = "ollama"',
                    f'base_url = "{provider_base}"',
                ] + provider_tls + [
                    "capacity = 64",
                    "[[nodes.providers]]",
                    'id = "ollama-1"',
                    'adapter = "ollama"',
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
        ] + ([f'routing = "{self.routing}"'] if self.routing else []) + [
            "[[models]]",
            'name = "offline-model"',
            'providers = ["node-offline/mock-1"]',
            "queue_timeout_ms = 300",
        ]
        if self.ollama:
            out += [
                "[[models]]",
                f'name = "{OLLAMA_MODEL}"',
                "providers = [" + ", ".join(f'"{n}/ollama-1"' for n in self.node_ids) + "]",
                "[[models]]",
                f'name = "{MIXED_MODEL}"',
                "providers = [" + ", ".join(f'"{n}/mock-1", "{n}/ollama-1"' for n in self.node_ids) + "]",
                "[[models]]",
                f'name = "{MIXED_OLLAMA_FIRST_MODEL}"',
                "providers = [" + ", ".join(f'"{n}/ollama-1"' for n in self.node_ids)
                + ", " + ", ".join(f'"{n}/mock-1"' for n in self.node_ids) + "]",
            ]
        out += self.credentials_config()
        out += self.extra_toml
        return "\n".join(out) + "\n"

    def node_config(self, node_id: str) -> str:
        lines = self.node_base_config(node_id)
        if self.credentials is not None:
            lines += [
                "[credentials]",
                f'recipient_key = "{self.recipient_key_path[node_id]}"',
                f'issuer_public_key = "{self.issuer_public_key}"',
            ]
        return "\n".join(lines) + "\n"

    def node_base_config(self, node_id: str) -> list[str]:
        certs = "tls" if self.fixtures else "certs"
        return [
            f'node_id = "{node_id}"',
            'trust_domain = "iop.test"',
            f'edge_addr = "{self.edge.ready["nodes"]}"',
            'edge_name = "edge-1"',
            "[tls]",
            f'ca = "{certs}/ca.pem"',
            f'cert = "{certs}/node-{node_id}.pem"',
            f'key = "{certs}/node-{node_id}-key.pem"',
            "[reconnect]",
            f"interval_sec = {self.reconnect[0]}",
            f"max_attempts = {self.reconnect[1]}",
        ] + self.node_extra

    def start_node(self, node_id: str) -> Proc:
        path = self.dir / f"node-{node_id}.toml"
        path.write_text(self.node_config(node_id))
        proc = start(f"node {node_id}", [str(BIN_DIR / "node-bin"), "--config", str(path), "--cores", self.cores],
                     env=self.node_env, wait_ready=False)
        self.procs.append(proc)
        self.nodes[node_id] = proc
        return proc

    def status(self) -> dict:
        return http_json(self.base_url + "/status", headers=self.auth_headers(), context=self.ssl_context())

    def mock_stats(self) -> dict:
        """The mock provider's counters (GET /admin/stats). An HTTPS mock
        with a certificate made to be refused is read without verifying it
        (this is the test reading counters, not a Node)."""
        context = self.ssl_context()
        if self.provider_tls not in (None, "https"):
            context = ssl._create_unverified_context()  # noqa: S323 - test counters only
        return http_json(self.mock_url() + "/admin/stats", context=context)

    def provider(self, node_id: str, provider_id: str) -> dict:
        """One provider's entry in the Edge's /status."""
        return next(p for p in self.status()["providers"]
                    if p["node_id"] == node_id and p["provider_id"] == provider_id)

    def all_nodes_connected(self) -> bool:
        providers = self.status()["providers"]
        connected = {p["node_id"] for p in providers if p["connected"]} - {"node-offline"}
        return connected == set(self.node_ids)

    def rotate_recipient_key(self, node_id: str) -> Proc:
        """Restarts `node_id` with a new recipient key the Edge does not
        know (the Edge keeps sealing to the old public key)."""
        self.nodes[node_id].stop()
        wait_until(lambda: not self.provider(node_id, "mock-1")["connected"], what=f"{node_id} gone")
        self.new_recipient_key(node_id, f"node-{node_id}-rotated.key")
        proc = self.start_node(node_id)
        wait_until(self.all_nodes_connected, what=f"{node_id} reconnected")
        return proc

    def restart_edge(self, sig: int = signal.SIGTERM, edge_env: dict | None = None,
                     keep_client_port: bool = False) -> Proc:
        """Stops the Edge with `sig` (SIGKILL: killed, nothing flushed) and
        starts a new one on the same node port, with `edge_env` as its
        environment when given. The client port changes (`base_url`
        follows it) unless `keep_client_port`."""
        nodes_addr = self.edge.ready["nodes"]
        client_addr = self.edge.ready["client"]
        self.edge.stop(sig)
        self.procs.remove(self.edge)
        if edge_env is not None:
            self.edge_env = dict(edge_env)
        text = self.edge_config(self.mock.ready["addr"]).replace(
            'node_listen = "127.0.0.1:0"', f'node_listen = "{nodes_addr}"')
        if keep_client_port:
            text = text.replace(f'client_listen = "{self.client_listen}"', f'client_listen = "{client_addr}"')
        edge_toml = self.dir / "edge.toml"
        edge_toml.write_text(text)
        self.edge = start("edge", [str(BIN_DIR / "edge-bin"), "--config", str(edge_toml), "--cores", self.cores],
                          env=self.edge_env)
        self.procs.append(self.edge)
        self.base_url = self.client_url(self.edge.ready["client"])
        return self.edge


def post_raw(url: str, body: dict, timeout_s: float = 20.0,
             headers: dict | None = None, context: ssl.SSLContext | None = None) -> tuple[int, dict, bytes]:
    """POSTs JSON (with extra `headers`); returns (status, headers, whole
    body) also for error statuses."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def sse_data(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]
