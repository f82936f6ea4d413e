"""The fleet changes live, with real processes under a steady streaming load.

An Edge, two Nodes and the mock provider; a loader keeps streamed requests
for `iop-test-model` in flight the whole time. Every SIGHUP below edits
`edge.toml` and the Edge applies it without a restart:

1. node-b leaves the configuration: it is let go of (`node_removed`) only
   when its streams ended;
2. node-b comes back with a new model on it: it registers on its next
   redial and the new model is served within seconds;
3. node-b's provider leaves `iop-test-model`'s pool: its streams complete
   whole and no new request of that model goes to it;
4. node-a's capacity drops below what it runs: nothing is cut, new
   admissions wait until it is below again;
5. an invalid file changes nothing;
6. node-b's provider drained by the admin API takes no new request while
   its streams finish, and serves again once undrained.

Throughout, every request of the loader succeeds with its whole answer: no
failed request on the providers a step leaves alone.
"""

import json
import re
import signal
import threading
import time
import urllib.request

import pytest

from iop_harness import Cluster, post_raw, wait_until

MODEL = "iop-test-model"
LIVE_MODEL = "live-model"
TOKENS = 30
WHOLE = "".join(f"tok{i} " for i in range(TOKENS))


class Loader:
    """Streamed requests for MODEL from `workers` threads until stopped;
    records every outcome and the node that served it (from the Edge's
    access log, by request id)."""

    def __init__(self, cluster, workers: int = 3):
        self.cluster = cluster
        self.results: list[tuple[str, int, bool]] = []  # (request id, status, whole)
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]
        self.sent = 0

    def _run(self, worker: int):
        n = 0
        while not self.stop_flag.is_set():
            n += 1
            rid = f"load-{worker}-{n}"
            status, whole = self._one(rid)
            with self.lock:
                self.results.append((rid, status, whole))

    def _one(self, rid: str) -> tuple[int, bool]:
        body = json.dumps({"model": MODEL, "max_tokens": TOKENS, "stream": True,
                           "messages": [{"role": "user", "content": "x"}]}).encode()
        req = urllib.request.Request(self.cluster.base_url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", "x-request-id": rid})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw = resp.read().decode()
                status = resp.status
        except urllib.error.HTTPError as e:
            return e.code, False
        except OSError:
            return 0, False
        text = ""
        for event in raw.split("\n\n"):
            if not event.startswith("data: ") or event == "data: [DONE]":
                continue
            for choice in json.loads(event[len("data: "):]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
        return status, text == WHOLE and raw.rstrip().endswith("data: [DONE]")

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        for t in self.threads:
            t.join(90)

    def count(self) -> int:
        with self.lock:
            return len(self.results)

    def failures(self) -> list:
        with self.lock:
            return [r for r in self.results if r[1] != 200 or not r[2]]

    def served_by(self, since: int = 0) -> dict[str, str]:
        """Request id → node of the requests recorded from index `since`."""
        with self.lock:
            ids = {rid for rid, _, _ in self.results[since:]}
        nodes = {}
        for line in self.cluster.edge.log().splitlines():
            m = re.search(r" request_id=(\S+) .* node=(\S+) ", line)
            if line.startswith("ts=") and m and m.group(1) in ids:
                nodes[m.group(1)] = m.group(2)
        return nodes


def _config(cluster, nodes=("node-a", "node-b"), pool=("node-a", "node-b"), live_model=False,
            capacity_a=64) -> str:
    """The harness's edge.toml with only `nodes`, MODEL on `pool`, and
    LIVE_MODEL on node-b when asked; node-a's provider capacity."""
    text = cluster.edge_config(cluster.mock.ready["addr"])
    blocks = text.split("[[nodes]]\n")
    head, node_blocks = blocks[0], blocks[1:]
    kept = []
    for block in node_blocks:
        node_id = re.match(r'id = "([^"]+)"', block).group(1)
        if node_id in ("node-a", "node-b") and node_id not in nodes:
            continue
        if node_id == "node-a":
            providers_at = block.index("[[nodes.providers]]")
            block = block[:providers_at] + block[providers_at:].replace(
                "capacity = 64", f"capacity = {capacity_a}", 1)
        kept.append(block)
    text = head + "".join("[[nodes]]\n" + b for b in kept)
    members = ", ".join(f'"{n}/mock-1"' for n in pool)
    text = re.sub(r'(name = "iop-test-model"\nproviders = )\[[^\]]*\]', lambda m: m.group(1) + f"[{members}]",
                  text)
    if live_model:
        text += f'[[models]]\nname = "{LIVE_MODEL}"\nproviders = ["node-b/mock-1"]\n'
    return text


def _sighup(cluster, text: str, applied_before: int) -> None:
    """Writes `text` and SIGHUPs the Edge; waits for the reload's log line."""
    (cluster.dir / "edge.toml").write_text(text)
    cluster.edge.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: cluster.edge.log().count("configuration reloaded") > applied_before,
               timeout_s=20, what="reload applied")


def _reloads(cluster) -> int:
    return cluster.edge.log().count("configuration reloaded")


def _providers(cluster) -> dict:
    return {(p["node_id"], p["provider_id"]): p for p in cluster.status()["providers"]}


def _models(cluster) -> list[str]:
    with urllib.request.urlopen(cluster.base_url + "/v1/models", timeout=10) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(node_ids=("node-a", "node-b"),
                 mock_args=["--tokens", str(TOKENS), "--inter-token-ms", "20"]) as c:
        yield c


def test_the_fleet_changes_under_load_without_a_failed_request(cluster):
    with Loader(cluster) as load:
        wait_until(lambda: load.count() >= 6, timeout_s=30, what="load running")

        # 1. node-b leaves: let go of when its streams ended.
        _sighup(cluster, _config(cluster, nodes=("node-a",), pool=("node-a",)), _reloads(cluster))
        wait_until(lambda: "node_removed" in cluster.nodes["node-b"].log(), timeout_s=30,
                   what="node-b let go of")
        assert ("node-b", "mock-1") not in _providers(cluster) or \
            not _providers(cluster)[("node-b", "mock-1")]["connected"]
        time.sleep(0.1)
        mark = load.count()
        wait_until(lambda: load.count() >= mark + 6, timeout_s=30, what="load goes on")
        assert set(load.served_by(mark).values()) == {"node-a"}

        # 2. node-b and a new model on it come back: served within seconds.
        _sighup(cluster, _config(cluster, live_model=True), _reloads(cluster))
        assert LIVE_MODEL in _models(cluster)
        wait_until(lambda: _providers(cluster).get(("node-b", "mock-1"), {}).get("connected"),
                   timeout_s=20, what="node-b registered again")
        status, _, raw = post_raw(f"{cluster.base_url}/v1/chat/completions",
                                  {"model": LIVE_MODEL, "max_tokens": 3,
                                   "messages": [{"role": "user", "content": "x"}]})
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
        # Its own series in /metrics, not `other`.
        with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert f'iop_edge_requests_total{{route="chat_completions",model="{LIVE_MODEL}",code="200"}} 1\n' \
            in metrics

        # 3. node-b's provider leaves MODEL's pool while it runs streams.
        wait_until(lambda: _providers(cluster)[("node-b", "mock-1")]["in_flight"] > 0, timeout_s=30,
                   what="a stream on node-b")
        _sighup(cluster, _config(cluster, pool=("node-a",), live_model=True), _reloads(cluster))
        wait_until(lambda: _providers(cluster)[("node-b", "mock-1")]["in_flight"] == 0, timeout_s=30,
                   what="node-b's streams ended")
        # Requests sent after the reload: none on node-b.
        time.sleep(0.1)
        mark = load.count()
        wait_until(lambda: load.count() >= mark + 6, timeout_s=30, what="load goes on")
        assert set(load.served_by(mark).values()) == {"node-a"}
        assert _providers(cluster)[("node-b", "mock-1")]["connected"]

        # 4. node-a's capacity drops below what it runs: nothing is cut,
        # new admissions wait.
        wait_until(lambda: _providers(cluster)[("node-a", "mock-1")]["in_flight"] >= 2, timeout_s=30,
                   what="two streams on node-a")
        _sighup(cluster, _config(cluster, pool=("node-a",), live_model=True, capacity_a=1), _reloads(cluster))
        assert _providers(cluster)[("node-a", "mock-1")]["capacity"] == 1
        wait_until(lambda: _providers(cluster)[("node-a", "mock-1")]["in_flight"] <= 1, timeout_s=30,
                   what="back within the new capacity")
        peak = 0
        for _ in range(20):
            peak = max(peak, _providers(cluster)[("node-a", "mock-1")]["in_flight"])
            time.sleep(0.05)
        assert peak <= 1
        _sighup(cluster, _config(cluster, pool=("node-a", "node-b"), live_model=True), _reloads(cluster))

        # 5. An invalid file changes nothing.
        before = _models(cluster)
        failed = cluster.edge.log().count("configuration reload failed")
        bad = _config(cluster, live_model=True).replace('providers = ["node-b/mock-1"]',
                                                         'providers = ["node-z/mock-1"]')
        (cluster.dir / "edge.toml").write_text(bad)
        cluster.edge.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: cluster.edge.log().count("configuration reload failed") > failed, timeout_s=20,
                   what="reload refused")
        assert _models(cluster) == before
        mark = load.count()
        wait_until(lambda: load.count() >= mark + 6, timeout_s=30, what="load goes on")

        # 6. Drain node-b's provider by the admin API: no new request goes
        # there, its streams finish; undrain: it serves again.
        status, _, raw = post_raw(f"{cluster.base_url}/admin/providers/node-b/mock-1/drain", {})
        assert (status, json.loads(raw)) == (200, {"provider": "node-b/mock-1", "drained": True})
        assert _providers(cluster)[("node-b", "mock-1")]["drained"] is True
        wait_until(lambda: _providers(cluster)[("node-b", "mock-1")]["in_flight"] == 0, timeout_s=30,
                   what="node-b's streams ended")
        time.sleep(0.1)
        mark = load.count()
        wait_until(lambda: load.count() >= mark + 6, timeout_s=30, what="load goes on")
        assert set(load.served_by(mark).values()) == {"node-a"}
        status, _, raw = post_raw(f"{cluster.base_url}/admin/providers/node-b/mock-1/undrain", {})
        assert (status, json.loads(raw)) == (200, {"provider": "node-b/mock-1", "drained": False})
        wait_until(lambda: _providers(cluster)[("node-b", "mock-1")]["in_flight"] > 0, timeout_s=30,
                   what="node-b serves again")

    assert load.failures() == []
    assert load.count() >= 30
