"""Fair share between keys on one saturated model, real processes (Edge,
Node, mock), judged by the order of admissions in the Edge's access log.

The model has capacity 2 and the mock streams slowly (4 tokens, 100 ms
apart), so a flood of 40 requests from key A takes seconds to drain. Each
request carries its own `x-request-id`; its access-log line gives when the
Edge read it (`ts` − `duration_ms`) and when its first body byte left
(+ `ttft_ms`; the mock's TTFT is 0, so that is when it was admitted).
"Between" below counts A's requests whose first byte left after B's
request was read and before B's first byte: the admissions B waited for.

- Weighted fair queueing: B (another principal, same class) sent into A's
  backlog is admitted at once (at most 2 of A's first bytes between: those
  admitted as B arrived), while most of A's backlog is still queued.
- Priority: B `interactive` against A `batch`: five requests of B sent
  together are all admitted before A's next ones.
- `x-iop-priority: batch` on a request of B's interactive key puts it in
  the batch class, behind A's `standard` flood: it waits for several of
  A's admissions (the batch class gets one admission in ten), where the
  same key's request without the header waited for none.
"""

import json
import threading
from datetime import datetime, timezone

import pytest

from iop_harness import Cluster, post_raw, wait_until

MODEL = "iop-test-model"
FLOOD = 40
KEYS = {
    "ops": {"key": "sk-ops-5b0e7c1d9a24f3e6", "scopes": ["admin"]},
    "flood": {"key": "sk-flood-8c3a1f5e0d7b2946", "priority": "standard"},
    "light": {"key": "sk-light-2e9d4b7a1c6f0853", "priority": "standard"},
    "flood-batch": {"key": "sk-floodb-7f1c0a9e3d5b2684", "priority": "batch"},
    "vip": {"key": "sk-vip-4a6e2c8f0b1d3957", "priority": "interactive"},
}


@pytest.fixture(scope="module")
def cluster():
    with Cluster(
        client_keys=KEYS,
        provider_capacity=2,
        mock_args=["--tokens", "4", "--inter-token-ms", "100"],
        edge_extra=['access_log = { destination = "access.log", format = "json" }'],
    ) as c:
        yield c


def _send(cluster, principal: str, request_id: str, results: dict, extra_headers=None):
    headers = {
        "authorization": f"Bearer {KEYS[principal]['key']}",
        "x-request-id": request_id,
        **(extra_headers or {}),
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, _, data = post_raw(cluster.base_url + "/v1/chat/completions", body, timeout_s=120, headers=headers)
    results[request_id] = (status, data)


def _start(cluster, principal: str, ids: list[str], results: dict, extra_headers=None) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=_send, args=(cluster, principal, rid, results, extra_headers), daemon=True)
        for rid in ids
    ]
    for t in threads:
        t.start()
    return threads


def _queued(cluster) -> int:
    return next(m["queued"] for m in cluster.status()["models"] if m["model"] == MODEL)


def _flood(cluster, principal: str, prefix: str, results: dict) -> tuple[list[str], list[threading.Thread]]:
    """Starts A's flood and waits until most of it is queued."""
    ids = [f"{prefix}-a-{i}" for i in range(FLOOD)]
    threads = _start(cluster, principal, ids, results)
    wait_until(lambda: _queued(cluster) >= FLOOD - 10, timeout_s=30, what="A's backlog")
    return ids, threads


def _unix_ms(ts: str) -> float:
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp() * 1000.0


def _timeline(cluster, ids: list[str]) -> dict[str, tuple[float, float]]:
    """(read, first byte) in Unix ms of each request, from the access log."""
    wanted = set(ids)
    path = cluster.dir / "access.log"

    def lines() -> dict:
        if not path.exists():
            return {}
        out = {}
        for raw in path.read_text().splitlines():
            rec = json.loads(raw)
            if rec["request_id"] in wanted:
                out[rec["request_id"]] = rec
        return out

    wait_until(lambda: len(lines()) == len(wanted), timeout_s=20, what="the access log lines")
    times = {}
    for rid, rec in lines().items():
        assert rec["outcome"] == "completed" and rec["status"] == 200, rec
        read = _unix_ms(rec["ts"]) - rec["duration_ms"]
        times[rid] = (read, read + rec["ttft_ms"])
    return times


def _join(threads, results: dict, ids: list[str]):
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == sorted(ids)
    for rid in ids:
        status, data = results[rid]
        assert status == 200, (rid, status, data[:300])
        assert data.rstrip().endswith(b"data: [DONE]"), (rid, data[-200:])


def _between(times, a_ids, start: float, end: float) -> int:
    return sum(1 for a in a_ids if start < times[a][1] < end)


def _after(times, a_ids, t: float) -> int:
    return sum(1 for a in a_ids if times[a][1] > t)


def test_a_flood_does_not_hold_back_another_principal(cluster):
    results = {}
    a_ids, threads = _flood(cluster, "flood", "wfq", results)
    b_ids = ["wfq-b-0"]
    threads += _start(cluster, "light", b_ids, results)
    _join(threads, results, a_ids + b_ids)
    times = _timeline(cluster, a_ids + b_ids)
    b_read, b_first = times["wfq-b-0"]
    # B waited for no admission of A's beyond those under way as it came.
    assert _between(times, a_ids, b_read, b_first) <= 2, sorted(t[1] for t in times.values())
    # ...while A's backlog was far from drained (FIFO: none of it after B).
    assert _after(times, a_ids, b_first) >= 10


def test_an_interactive_key_goes_before_a_batch_flood(cluster):
    results = {}
    a_ids, threads = _flood(cluster, "flood-batch", "prio", results)
    b_ids = [f"prio-b-{i}" for i in range(5)]
    threads += _start(cluster, "vip", b_ids, results)
    _join(threads, results, a_ids + b_ids)
    times = _timeline(cluster, a_ids + b_ids)
    b_first_read = min(times[b][0] for b in b_ids)
    b_last_admitted = max(times[b][1] for b in b_ids)
    # All five of B's, one after the other, before A's next: under fair
    # queueing between equals they would alternate with A's (4 between).
    assert _between(times, a_ids, b_first_read, b_last_admitted) <= 2
    assert _after(times, a_ids, b_last_admitted) >= 10


def test_the_priority_header_lowers_a_request_to_batch(cluster):
    results = {}
    a_ids, threads = _flood(cluster, "flood", "hdr", results)
    # As its key's class (interactive) the request goes first...
    first = {}
    _start(cluster, "vip", ["hdr-b-0"], first)[0].join(timeout=60)
    # ...as batch, the same key's next one waits behind the standard flood.
    lowered = _start(cluster, "vip", ["hdr-b-1"], results, {"x-iop-priority": "batch"})
    _join(threads + lowered, results, a_ids + ["hdr-b-1"])
    assert first["hdr-b-0"][0] == 200
    times = _timeline(cluster, a_ids + ["hdr-b-0", "hdr-b-1"])
    read0, first0 = times["hdr-b-0"]
    read1, first1 = times["hdr-b-1"]
    assert _between(times, a_ids, read0, first0) <= 2
    # The batch class gets one admission in ten while A's class waits:
    # nine of A's go first (some slack for those under way as it came).
    waited_for = _between(times, a_ids, read1, first1)
    assert 7 <= waited_for <= 11, waited_for
    # It is still admitted before A's backlog drains.
    assert _after(times, a_ids, first1) >= 5
