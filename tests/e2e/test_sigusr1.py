"""SIGUSR1 dumps the latency histograms (wrk2-style percentile distribution)
to stderr, on the Edge and on the Node, and the process keeps serving.

The dump of a side is the block from `# iop <side> latency histograms
(milliseconds)` to `# end iop <side> latency histograms`; each histogram is a
wrk2 report (title, summary percentiles, detailed spectrum, `#[Mean …]`,
`#[Max …, Total count …]`, `#[Buckets …]`).
"""

import json
import os
import re
import signal
import time
import urllib.request

import pytest

from iop_harness import Cluster, post_raw, sse_data, wait_until

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "hi"}]
PLAIN_REQUESTS = 3
STREAM_REQUESTS = 2
REQUESTS = PLAIN_REQUESTS + STREAM_REQUESTS
# Chat requests made so far against the current cluster (every one reaches
# the provider).
made = {"requests": 0}

EDGE_HISTOGRAMS = ["queue_wait", "relay_chunk_latency", "end_to_end"]
NODE_HISTOGRAMS = ["provider_time_to_first_byte", "relay_chunk_latency", "provider_call_duration"]

TITLE = re.compile(r"^  (edge|node) (\w+) \(HdrHistogram - Recorded Latency\)$")
SUMMARY = re.compile(r"^ *(\d+\.\d{3})% +(\d+\.\d{3})ms$")
ROW = re.compile(r"^ +(\d+\.\d{3}) +(\d\.\d{6}) +(\d+) +(\d+\.\d{2}|inf)$")
MEAN = re.compile(r"^#\[Mean    = +(\d+\.\d{3}), StdDeviation   = +(\d+\.\d{3})\]$")
MAX = re.compile(r"^#\[Max     = +(\d+\.\d{3}), Total count    = +(\d+)\]$")
BUCKETS = re.compile(r"^#\[Buckets = +22, SubBuckets     = +2048\]$")


def parse_dump(lines: list[str]) -> tuple[dict, dict]:
    """Parses one dump (its lines without newlines): {name: histogram},
    {counter: value}. Asserts every line is well formed."""
    histograms, counters = {}, {}
    i = 1
    while lines[i] != "  Counters:":
        m = TITLE.match(lines[i])
        assert m, lines[i]
        name = m.group(2)
        i += 1
        summary = []
        for _ in range(8):
            s = SUMMARY.match(lines[i])
            assert s, lines[i]
            summary.append((float(s.group(1)), float(s.group(2))))
            i += 1
        assert [p for p, _ in summary] == [50.0, 75.0, 90.0, 99.0, 99.9, 99.99, 99.999, 100.0]
        assert lines[i:i + 4] == ["", "  Detailed Percentile spectrum:",
                                  "       Value   Percentile   TotalCount 1/(1-Percentile)", ""]
        i += 4
        rows = []
        while not lines[i].startswith("#[Mean"):
            r = ROW.match(lines[i])
            assert r, lines[i]
            rows.append((float(r.group(1)), float(r.group(2)), int(r.group(3)), r.group(4)))
            i += 1
        mean = MEAN.match(lines[i])
        maximum = MAX.match(lines[i + 1])
        assert mean and maximum and BUCKETS.match(lines[i + 2]), lines[i:i + 3]
        assert lines[i + 3] == "-" * 58
        i += 4
        count = int(maximum.group(2))
        for a, b in zip(rows, rows[1:]):
            assert b[0] >= a[0] and b[1] > a[1] and b[2] >= a[2], (a, b)
        if count:
            # The spectrum ends at percentile 1 with every sample counted,
            # at the maximum; the summary never decreases.
            assert rows[-1][1:] == (1.0, count, "inf"), rows[-1]
            assert rows[-1][0] == float(maximum.group(1))
            values = [v for _, v in summary]
            assert values == sorted(values) and values[-1] == float(maximum.group(1))
        else:
            assert rows == []
        histograms[name] = {"count": count, "summary": summary, "rows": rows}
    i += 1
    while not lines[i].startswith("# end iop "):
        name, value = lines[i].split()
        counters[name] = int(value)
        i += 1
    return histograms, counters


def dumps(proc, side: str) -> list[list[str]]:
    """Every complete dump of `side` in the process's output so far."""
    out, current = [], None
    for raw in list(proc.lines):
        line = raw.rstrip("\n")
        if line == f"# iop {side} latency histograms (milliseconds)":
            current = [line]
        elif current is not None:
            current.append(line)
            if line == f"# end iop {side} latency histograms":
                out.append(current)
                current = None
    return out


def dump_after_signal(proc, side: str, done) -> tuple[dict, dict]:
    """Sends SIGUSR1 until a fresh dump satisfies `done` (a request's last
    samples may land just after its response reaches the client); returns
    the last dump, parsed."""
    parsed = None
    for _ in range(20):
        before = len(dumps(proc, side))
        os.kill(proc.popen.pid, signal.SIGUSR1)
        wait_until(lambda: len(dumps(proc, side)) > before, timeout_s=10, what=f"{side} dump")
        parsed = parse_dump(dumps(proc, side)[-1])
        if done(parsed[0]):
            return parsed
        time.sleep(0.05)
    return parsed


def chat(cluster, stream: bool) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "stream": stream}
    status, _, raw = post_raw(cluster.base_url + "/v1/chat/completions", body)
    made["requests"] += 1
    assert status == 200, raw
    if stream:
        assert sse_data(raw)[-1] == "[DONE]"
    else:
        assert json.loads(raw)["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "


# One core, and two: the histograms of both cores merge into one dump.
@pytest.fixture(scope="module", params=["0", "0-1"])
def cluster(request):
    with Cluster(mock_args=["--tokens", "3"], cores=request.param) as c:
        made["requests"] = 0
        for i in range(REQUESTS):
            chat(c, stream=i >= PLAIN_REQUESTS)
        yield c


def test_edge_dump_counts_every_request_and_keeps_serving(cluster):
    edge = cluster.edge
    n = made["requests"]
    hist, counters = dump_after_signal(edge, "edge", lambda h: h["end_to_end"]["count"] >= n)
    assert list(hist) == EDGE_HISTOGRAMS
    assert hist["end_to_end"]["count"] == n
    assert hist["queue_wait"]["count"] == n
    assert hist["relay_chunk_latency"]["count"] >= n
    assert counters["relay_body_bytes_total"] > 0
    # Still alive and serving after the signal; /metrics shows the same
    # histograms as Prometheus histograms.
    assert edge.popen.poll() is None, edge.log()
    chat(cluster, stream=False)

    def scraped_count():
        with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return re.search(r"^iop_edge_end_to_end_seconds_count (\d+)$", text, re.M).group(1)

    wait_until(lambda: scraped_count() == str(n + 1), timeout_s=10, what="/metrics count")
    hist, _ = dump_after_signal(edge, "edge", lambda h: h["end_to_end"]["count"] >= n + 1)
    assert hist["end_to_end"]["count"] == n + 1
    assert edge.popen.poll() is None, edge.log()


def test_node_dump_counts_every_provider_call_and_keeps_serving(cluster):
    node = cluster.nodes["node-a"]
    hist, counters = dump_after_signal(
        node, "node", lambda h: h["provider_call_duration"]["count"] >= made["requests"])
    assert list(hist) == NODE_HISTOGRAMS
    calls = made["requests"]
    assert hist["provider_call_duration"]["count"] == calls
    assert hist["provider_time_to_first_byte"]["count"] == calls
    assert hist["relay_chunk_latency"]["count"] >= calls
    # Every streamed request asked for no usage: the Edge asked for it, and
    # the Node left each usage chunk out.
    # Tracing is off: no span was started, none exported or dropped.
    assert counters == {
        "provider_calls_aborted_total": 0,
        "tunnel_usage_chunks_stripped_total": STREAM_REQUESTS,
        "tunnel_usage_missing_total": 0,
        "tunnel_events_unchecked_total": 0,
        "trace_spans_started_total": 0,
        "trace_spans_exported_total": 0,
        "trace_spans_dropped_total": 0,
        "trace_export_failures_total": 0,
    }
    assert node.popen.poll() is None, node.log()
    chat(cluster, stream=True)
    hist, _ = dump_after_signal(
        node, "node", lambda h: h["provider_call_duration"]["count"] >= calls + 1)
    assert hist["provider_call_duration"]["count"] == calls + 1
    assert node.popen.poll() is None, node.log()
