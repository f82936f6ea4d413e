"""A draining Node takes no new work (issue 40), with real processes.

At its first SIGTERM a Node tells its Edge `NodeDraining` (the Edge said at
registration that it understands it); the Edge logs `node draining` and
dispatches nothing new to that connection, while what runs there finishes.

- Two Nodes under steady streaming load, SIGTERM one: every request sent
  after the Edge logged the notice is served by the other Node (the Edge's
  access log names the node), the draining Node's streams in flight
  complete whole, no request fails, and the draining Node exits 0.
- One Node: a request sent after the notice is not served by the draining
  Node; it waits in the Edge's queue and is served by the Node's next
  process.

"After the notice" is an order, not a time: the Edge runs on one core
here, where it logs the notice and applies it to Control in one step, so a
request sent once the line is in its log is admitted after it. A request
sent between the signal and the notice may still go to the draining Node;
it too must complete whole.
"""

import http.client
import itertools
import json
import re
import signal
import threading
import time

from iop_harness import Cluster, wait_until

MODEL = "iop-test-model"
TOKENS = 100
# 100 tokens 20 ms apart: a stream runs about two seconds.
SLOW_MOCK = ["--inter-token-ms", "20", "--tokens", str(TOKENS)]
EXPECTED_TEXT = "".join(f"tok{i} " for i in range(TOKENS))
# Streams each load client keeps going, one after another.
LOAD_CLIENTS = 6
# Requests sent after the notice that must have completed before the load
# stops (each is one the draining Node must not get).
AFTER_NOTICE_MIN = 12
EXIT_TIMEOUT_S = 30
CLIENT_TIMEOUT_S = 60


def _notice_seen(edge, node_id: str) -> bool:
    return any("node draining" in line and f"node_id={node_id}" in line
               for line in edge.log().splitlines())


def _stream(cluster, request_id: str) -> tuple[int, list[str]]:
    """One streamed chat completion with `request_id`; its status and
    `data:` payloads."""
    host, port = cluster.edge.ready["client"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=CLIENT_TIMEOUT_S)
    try:
        body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"content-type": "application/json", "x-request-id": request_id})
        resp = conn.getresponse()
        raw = resp.read().decode()
        return resp.status, [l[len("data: "):] for l in raw.split("\n") if l.startswith("data: ")]
    finally:
        conn.close()


def _text(data: list[str]) -> str:
    out = []
    for d in data:
        if d == "[DONE]":
            continue
        for choice in json.loads(d).get("choices", []):
            out.append(choice["delta"].get("content") or "")
    return "".join(out)


def _whole(result) -> bool:
    status, data = result
    return status == 200 and data[-1:] == ["[DONE]"] and _text(data) == EXPECTED_TEXT


def _served_by(edge, request_ids) -> dict:
    """The node the Edge's access log names for each request id (logfmt
    lines on stderr, written at each response's end)."""
    found = {}

    def all_logged():
        for line in edge.log().splitlines():
            m = re.search(r" request_id=(\S+) ", line)
            if line.startswith("ts=") and m and m.group(1) in request_ids:
                node = re.search(r" node=(\S+)", line)
                found[m.group(1)] = node.group(1) if node else None
        return set(found) == set(request_ids)

    wait_until(all_logged, timeout_s=10, what="an access log line for every request")
    return found


def _node_runs(node) -> set:
    """The request ids of the runs a Node process ended (its span carries
    the id)."""
    out = set()
    for line in node.log().splitlines():
        if "tunnel ended" in line:
            m = re.search(r"request_id=([\w.:/+=@-]+)", line)
            if m:
                out.add(m.group(1))
    return out


class Load:
    """`LOAD_CLIENTS` threads, each sending one stream after another until
    stopped; every request gets the next sequence number when it is sent."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.seq = itertools.count()
        self.lock = threading.Lock()
        self.results: dict[int, tuple] = {}
        self.ended_at: dict[int, float] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(LOAD_CLIENTS)]

    def _client(self):
        while not self.stop.is_set():
            with self.lock:
                n = next(self.seq)
            try:
                result = _stream(self.cluster, f"load-{n}")
            except Exception as e:  # noqa: BLE001 - a failure is a result
                result = (None, [repr(e)])
            with self.lock:
                self.results[n] = result
                self.ended_at[n] = time.monotonic()

    def next_seq(self) -> int:
        """The sequence number the next request sent will get."""
        with self.lock:
            n = next(self.seq)
        # Taken, never sent: the results skip it.
        return n + 1

    def completed_from(self, first: int) -> int:
        with self.lock:
            return sum(1 for n in self.results if n >= first)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=CLIENT_TIMEOUT_S)


def test_a_draining_node_gets_no_new_requests_under_steady_load():
    with Cluster(node_ids=("node-a", "node-b"), mock_args=SLOW_MOCK) as cluster:
        node_a = cluster.nodes["node-a"]
        with Load(cluster) as load:
            # Both nodes serve: node-a has streams in flight at the signal.
            wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] >= 2
                       and cluster.provider("node-b", "mock-1")["in_flight"] >= 1,
                       timeout_s=20, what="both nodes streaming")
            node_a.popen.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
            wait_until(lambda: _notice_seen(cluster.edge, "node-a"), timeout_s=10,
                       interval_s=0.01, what="the Edge's node draining line")
            first_after = load.next_seq()
            wait_until(lambda: load.completed_from(first_after) >= AFTER_NOTICE_MIN,
                       timeout_s=CLIENT_TIMEOUT_S, what=f"{AFTER_NOTICE_MIN} requests after the notice")
        # The draining Node finished its streams and exited 0.
        assert node_a.popen.wait(timeout=EXIT_TIMEOUT_S) == 0
        log_a = node_a.log()
        assert "draining: told the edge (NodeDraining)" in log_a, log_a
        assert "drained: every run and tunnel released" in log_a, log_a

        results = load.results
        # Zero failed requests: every stream is whole.
        failed = {n: r for n, r in results.items() if not _whole(r)}
        assert failed == {}, failed
        served = _served_by(cluster.edge, {f"load-{n}" for n in results})
        after = sorted(n for n in results if n >= first_after)
        assert len(after) >= AFTER_NOTICE_MIN
        # Every request sent after the notice went to node-b.
        assert {f"load-{n}": served[f"load-{n}"] for n in after} == {f"load-{n}": "node-b" for n in after}
        # What node-a served is exactly what its log says it ran; some of
        # it was in flight at the signal and completed whole (checked
        # above with every stream).
        on_a = {n for n in results if served[f"load-{n}"] == "node-a"}
        assert _node_runs(node_a) == {f"load-{n}" for n in on_a}
        assert any(load.ended_at[n] > signalled_at for n in on_a), "no stream of node-a was in flight"


def test_with_one_node_a_request_after_the_signal_waits_for_its_next_process():
    with Cluster(mock_args=SLOW_MOCK) as cluster:
        results = {}

        def send(request_id: str):
            results[request_id] = _stream(cluster, request_id)

        in_flight = threading.Thread(target=send, args=("in-flight",))
        in_flight.start()
        # In flight at the provider, not only leased by the Edge: a run the
        # Node has not started yet when its drain ends is sent again after
        # its `Close(drained)` (to its next process, which this test starts
        # only later).
        wait_until(lambda: cluster.mock_stats()["active_streams"] == 1, what="a stream in flight")
        old = cluster.nodes["node-a"]
        old.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: _notice_seen(cluster.edge, "node-a"), timeout_s=10, interval_s=0.01,
                   what="the Edge's node draining line")
        waiting = threading.Thread(target=send, args=("after-sigterm",))
        waiting.start()

        # The stream in flight completes whole; the draining process exits
        # 0 without ever running the new request, which still waits.
        in_flight.join(timeout=CLIENT_TIMEOUT_S)
        assert _whole(results["in-flight"]), results["in-flight"]
        assert old.popen.wait(timeout=EXIT_TIMEOUT_S) == 0
        assert _node_runs(old) == {"in-flight"}, old.log()
        assert waiting.is_alive() and "after-sigterm" not in results

        # The Node's next process serves it (from the Edge's queue).
        new = cluster.start_node("node-a")
        waiting.join(timeout=CLIENT_TIMEOUT_S)
        assert _whole(results["after-sigterm"]), results["after-sigterm"]
        wait_until(lambda: _node_runs(new) == {"after-sigterm"}, timeout_s=10, what="the new process's run")
        assert _served_by(cluster.edge, {"in-flight", "after-sigterm"}) == {
            "in-flight": "node-a", "after-sigterm": "node-a"}
