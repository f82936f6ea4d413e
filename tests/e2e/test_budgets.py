"""Token budgets per key per UTC day and month, real processes (Edge, Node,
mock), on a budget clock pinned by the test-only IOP_TEST_BUDGET_CLOCK_OFFSET_MS.

- A key that spends its day budget gets 429 `budget_exhausted` in OpenAI's
  shape, naming the budget, its size and its reset (the next 00:00 UTC),
  with `retry-after` until then.
- The usage outlives `kill -9` of the Edge: the restarted Edge replays its
  budget file and still refuses the key.
- At 00:00 UTC the day budget is whole again while the month keeps
  counting.
"""

import calendar
import json
import signal
import time
import urllib.request

import pytest

from iop_harness import Cluster, post_raw, wait_until

MODEL = "iop-test-model"
KEY_OPS = "sk-ops-5b0e27c9d4f1"
KEY_BUDGET = "sk-budget-8f3a61d2c0e7"
OFFSET_ENV = "IOP_TEST_BUDGET_CLOCK_OFFSET_MS"
# The mock counts one prompt token per word and answers 3 tokens: 47 + 3
# = 50 tokens per request.
PROMPT = " ".join(["w"] * 47)
PER_REQUEST = 50
DAY_BUDGET = 100
MONTH_BUDGET = 1000
# The budget clock starts at 2031-03-10T12:00:00Z.
PINNED_MS = calendar.timegm((2031, 3, 10, 12, 0, 0)) * 1000
HOUR_MS = 3_600_000


def _offset_to(unix_ms: int) -> str:
    return str(unix_ms - int(time.time() * 1000))


@pytest.fixture(scope="module")
def cluster():
    keys = {
        "ops": {"key": KEY_OPS, "scopes": ["admin"]},
        "budgeted": {"key": KEY_BUDGET, "tokens_per_day": DAY_BUDGET, "tokens_per_month": MONTH_BUDGET},
    }
    with Cluster(client_keys=keys, mock_args=["--tokens", "3"], edge_extra=['budget_file = "budgets.log"'],
                 edge_env={OFFSET_ENV: _offset_to(PINNED_MS)}) as c:
        yield c


def _chat(cluster):
    return post_raw(cluster.base_url + "/v1/chat/completions",
                    {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
                    headers={"authorization": f"Bearer {KEY_BUDGET}"})


def _budget(cluster) -> dict:
    return cluster.status()["budgets"]


def _wait_on_disk(cluster, day_used: int, month_used: int) -> dict:
    """Waits until the Edge counts these tokens and every record is synced."""
    def settled():
        b = _budget(cluster)
        key = b["keys"]["budgeted"]
        return (key["day"]["used"] == day_used and key["month"]["used"] == month_used
                and b["file"]["durable"] == b["file"]["appended"])
    wait_until(settled, what=f"day {day_used} / month {month_used} tokens on disk")
    return _budget(cluster)


def _metrics(cluster) -> str:
    req = urllib.request.Request(cluster.base_url + "/metrics", headers={"authorization": f"Bearer {KEY_OPS}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def _header(headers: dict, name: str) -> str:
    return next(v for k, v in headers.items() if k.lower() == name)


def _assert_refused(cluster, used: int):
    status, headers, body = _chat(cluster)
    assert status == 429, body
    error = json.loads(body)["error"]
    assert error == {
        "message": (f"token budget exhausted: this key's tokens_per_day budget of {DAY_BUDGET} tokens is "
                    f"spent ({used} used); it resets at 2031-03-11T00:00:00Z"),
        "type": "rate_limit_error",
        "param": None,
        "code": "budget_exhausted",
    }
    # Until 00:00 UTC: at most 12 h from the pinned noon, and the test has
    # not run for 10 minutes.
    retry_after = int(_header(headers, "retry-after"))
    assert 12 * 3600 - 600 <= retry_after <= 12 * 3600, retry_after
    retry_after_ms = int(_header(headers, "retry-after-ms"))
    assert retry_after == -(-retry_after_ms // 1000)


def test_a_spent_day_budget_survives_kill_9_and_resets_at_midnight_utc(cluster):
    wait_until(cluster.all_nodes_connected, what="node connected")
    assert "TEST ONLY: the token budgets' clock is moved" in cluster.edge.log()
    for _ in range(DAY_BUDGET // PER_REQUEST):
        status, _, body = _chat(cluster)
        assert status == 200, body
    budgets = _wait_on_disk(cluster, DAY_BUDGET, DAY_BUDGET)
    assert budgets["keys"]["budgeted"] == {
        "day": {"used": DAY_BUDGET, "limit": DAY_BUDGET, "resets_at": "2031-03-11T00:00:00Z",
                "resets_at_unix_ms": PINNED_MS + 12 * HOUR_MS},
        "month": {"used": DAY_BUDGET, "limit": MONTH_BUDGET, "resets_at": "2031-04-01T00:00:00Z",
                  "resets_at_unix_ms": calendar.timegm((2031, 4, 1, 0, 0, 0)) * 1000},
    }
    # The ops key has no budget: it is not listed.
    assert list(budgets["keys"]) == ["budgeted"]
    _assert_refused(cluster, DAY_BUDGET)
    metrics = _metrics(cluster)
    assert f'iop_edge_key_budget_used_tokens{{principal="budgeted",period="day"}} {DAY_BUDGET}\n' in metrics
    assert f'iop_edge_key_budget_limit_tokens{{principal="budgeted",period="month"}} {MONTH_BUDGET}\n' in metrics

    # kill -9: nothing is flushed; the same config, ports and budget clock.
    cluster.restart_edge(sig=signal.SIGKILL, edge_env={OFFSET_ENV: _offset_to(PINNED_MS)},
                         keep_client_port=True)
    assert cluster.edge.popen.poll() is None
    wait_until(cluster.all_nodes_connected, what="node reconnected")
    assert _budget(cluster)["keys"]["budgeted"]["day"]["used"] == DAY_BUDGET
    _assert_refused(cluster, DAY_BUDGET)

    # One hour past midnight UTC: the day budget is whole, the month counts on.
    cluster.restart_edge(edge_env={OFFSET_ENV: _offset_to(PINNED_MS + 13 * HOUR_MS)}, keep_client_port=True)
    wait_until(cluster.all_nodes_connected, what="node reconnected")
    status, _, body = _chat(cluster)
    assert status == 200, body
    budgets = _wait_on_disk(cluster, PER_REQUEST, DAY_BUDGET + PER_REQUEST)
    assert budgets["keys"]["budgeted"]["day"]["resets_at"] == "2031-03-12T00:00:00Z"
    assert budgets["keys"]["budgeted"]["month"]["resets_at"] == "2031-04-01T00:00:00Z"
