"""/metrics with real processes, read by a real Prometheus text parser
(`prometheus_client.parser`): the Edge's own families with their types, its
request counters by route, model and code, the Node's series pulled over
the link and labelled `node`, and the Node's node_exporter textfile.
"""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from iop_harness import Cluster, post_raw, sse_data, wait_until

MODEL = "iop-test-model"
KEY = "sk-e2e-metrics-7d1f"
MESSAGES = [{"role": "user", "content": "hi"}]

# Family names as the parser reports them (a counter's without `_total`).
EDGE_FAMILIES = {
    "iop_edge_requests": "counter",
    "iop_edge_rejections": "counter",
    "iop_edge_tokens": "counter",
    "iop_edge_queue_depth": "gauge",
    "iop_edge_active_streams": "gauge",
    "iop_edge_node_scrape_errors": "counter",
    "iop_edge_time_to_first_token_seconds": "histogram",
    "iop_edge_chunk_interval_seconds": "histogram",
    "iop_edge_request_duration_seconds": "histogram",
    "iop_edge_queue_wait_seconds": "histogram",
    "iop_edge_relay_chunk_latency_seconds": "histogram",
    "iop_edge_end_to_end_seconds": "histogram",
    "iop_edge_relay_body_bytes": "counter",
    "iop_edge_client_connections_open": "gauge",
    "iop_edge_access_log_dropped_lines": "counter",
    "iop_edge_access_log_write_errors": "counter",
    "iop_edge_access_log_open_errors": "counter",
    "iop_edge_access_log_failing": "gauge",
    "iop_edge_usage_log_write_errors": "counter",
    "iop_edge_usage_log_open_errors": "counter",
    "iop_edge_usage_log_dropped_records": "counter",
    "iop_edge_usage_log_failing": "gauge",
    "iop_build_info": "gauge",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "process_start_time_seconds": "gauge",
}
NODE_FAMILIES = {
    "iop_node_provider_time_to_first_byte_seconds": "histogram",
    "iop_node_relay_chunk_latency_seconds": "histogram",
    "iop_node_provider_call_duration_seconds": "histogram",
    "iop_node_provider_calls_aborted": "counter",
    "iop_build_info": "gauge",
    "process_open_fds": "gauge",
}


# One core, and two: requests counted on either shard add up on one page.
@pytest.fixture(scope="module", params=["0", "0-1"])
def cluster(request, tmp_path_factory):
    textfile = tmp_path_factory.mktemp("textfile") / "iop_node.prom"
    extra = ["[metrics]", f'textfile = "{textfile}"', "textfile_interval_sec = 1"]
    with Cluster(mock_args=["--tokens", "3"], client_keys={"metrics-e2e": KEY}, node_extra=extra,
                 cores=request.param) as c:
        c.textfile = textfile
        yield c


def scrape(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as resp:
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str, **labels) -> float:
    found = [s.value for s in families[family].samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, (sample, labels, families[family].samples)
    return found[0]


def test_edge_families_types_and_request_counts(cluster):
    url = cluster.base_url + "/v1/chat/completions"
    status, _, body = post_raw(url, {"model": MODEL, "messages": MESSAGES, "stream": True},
                               headers={"authorization": f"Bearer {KEY}"})
    assert status == 200 and sse_data(body)[-1] == "[DONE]"
    status, _, _ = post_raw(url, {"model": MODEL, "messages": MESSAGES})
    assert status == 401
    for _ in range(3):
        status, _, _ = post_raw(url, {"model": MODEL, "messages": MESSAGES},
                                headers={"authorization": f"Bearer {KEY}"})
        assert status == 200

    # A request is counted as its response ends, which the client may see
    # an instant before; the node's provider calls as they return.
    found = {}

    def counted():
        found.update(scrape(cluster))
        total = found.get("iop_edge_requests")
        node_calls = found.get("iop_node_provider_call_duration_seconds")
        return (total is not None and node_calls is not None
                and sum(s.value for s in total.samples if s.labels.get("route") == "chat_completions") == 5
                and any(s.name.endswith("_count") and s.labels == {"node": "node-a"} and s.value == 4
                        for s in node_calls.samples))

    wait_until(counted, timeout_s=20, what="every request counted")
    families = found
    for name, kind in EDGE_FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
    for name, kind in NODE_FAMILIES.items():
        assert families[name].type == kind, name
    assert value(families, "iop_edge_requests", "iop_edge_requests_total",
                 route="chat_completions", model=MODEL, code="200") == 4
    assert value(families, "iop_edge_requests", "iop_edge_requests_total",
                 route="chat_completions", model="none", code="401") == 1
    assert value(families, "iop_edge_rejections", "iop_edge_rejections_total", reason="unauthorized") == 1
    assert value(families, "iop_edge_time_to_first_token_seconds",
                 "iop_edge_time_to_first_token_seconds_count", route="chat_completions", model=MODEL) == 4
    assert value(families, "iop_edge_time_to_first_token_seconds",
                 "iop_edge_time_to_first_token_seconds_bucket",
                 route="chat_completions", model=MODEL, le="+Inf") == 4
    # Three tokens streamed: at least one gap between chunks.
    assert value(families, "iop_edge_chunk_interval_seconds", "iop_edge_chunk_interval_seconds_count",
                 route="chat_completions", model=MODEL) >= 1
    (info,) = families["iop_build_info"].samples[:1]
    assert info.labels["version"] and info.labels["commit"] and info.value == 1
    # The Node's series, pulled over its link, carry its id.
    assert value(families, "iop_node_provider_call_duration_seconds",
                 "iop_node_provider_call_duration_seconds_count", node="node-a") == 4
    assert value(families, "process_open_fds", "process_open_fds", node="node-a") > 0
    assert value(families, "process_open_fds", "process_open_fds") > 0
    assert value(families, "iop_edge_node_scrape_errors", "iop_edge_node_scrape_errors_total", node="node-a") == 0


def test_node_textfile_is_written_for_node_exporter(cluster):
    def written():
        return cluster.textfile.exists() and cluster.textfile.stat().st_size > 0

    wait_until(written, timeout_s=20, what="the node's metrics textfile")
    families = {f.name: f for f in text_string_to_metric_families(cluster.textfile.read_text())}
    for name, kind in NODE_FAMILIES.items():
        assert families[name].type == kind, name
    assert not any(s.labels.get("node") for f in families.values() for s in f.samples)
