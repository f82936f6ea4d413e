"""Node response-stall watchdog and provider failures through real processes:
client → edge-bin → mTLS → node-bin → bench mock-provider with injected faults.

CONTRACT: W2, W4 — the provider's `response_stall_timeout_ms` configured at
the Edge travels in the request; a provider that stalls ends the client's
stream with an SSE error event `response_stalled` (HTTP 504 before the
response started), and the slot is released.
CONTRACT: W6, P4 — a provider that drops the connection mid-stream ends the
stream with a (non-stall) error and frees the slot.
"""

import json

import pytest

from iop_harness import Cluster, post_raw, sse_data, wait_until

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "hi"}]
STALL_MS = 500


def _in_flight(cluster) -> int:
    return sum(p["in_flight"] for p in cluster.status()["providers"] if p["node_id"] != "node-offline")


@pytest.fixture(scope="module")
def stalling():
    with Cluster(
        mock_args=["--stall-after-tokens", "2", "--stall-ms", "0", "--tokens", "8"],
        provider_extra=[f"response_stall_timeout_ms = {STALL_MS}"],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def dropping():
    with Cluster(mock_args=["--drop-after-tokens", "2", "--tokens", "8"]) as c:
        yield c


def test_stalled_stream_ends_with_response_stalled(stalling):
    # CONTRACT: W2, W3, W4
    status, headers, body = post_raw(
        stalling.base_url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True}
    )
    assert status == 200
    events = sse_data(body)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "response_stalled"
    assert error["type"] == "upstream_error"
    content = "".join(
        (json.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for e in events[:-2]
    )
    assert content == "tok0 tok1 ", content
    wait_until(lambda: _in_flight(stalling) == 0, timeout_s=10, what="stalled slot released")


def test_stalled_non_streaming_request_is_504(stalling):
    # CONTRACT: W4
    status, _, body = post_raw(stalling.base_url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
    assert status == 504, body
    error = json.loads(body)["error"]
    assert error["code"] == "response_stalled"
    wait_until(lambda: _in_flight(stalling) == 0, timeout_s=10, what="stalled slot released")


def test_dropped_provider_ends_the_stream_with_an_error_and_frees_the_slot(dropping):
    # CONTRACT: W6, P4
    status, _, body = post_raw(
        dropping.base_url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True}
    )
    assert status == 200
    events = sse_data(body)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "provider_error"
    wait_until(lambda: _in_flight(dropping) == 0, timeout_s=10, what="slot released")
    # The slot serves the next request (which fails the same way, promptly).
    status, _, body = post_raw(
        dropping.base_url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True}
    )
    assert status == 200 and b"provider_error" in body
