"""One trace from the client to the provider, with real processes
(docs/tracing.md): a client sends a W3C `traceparent`; the Edge's and the
Node's spans reach an OTLP/HTTP receiver run by this test (decoded with the
reference `opentelemetry-proto` package) under that trace id, linked
client → Edge request → queue wait and dispatch → Node provider call, and
the mock provider sees a `traceparent` whose parent is the Node's span.
With tracing off no span is built; with `sample_ratio = 0` a request that
fails is still exported.
"""

import re
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from iop_harness import Cluster, post_raw, wait_until

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "trace me"}]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SPAN_KIND_SERVER, SPAN_KIND_CLIENT, SPAN_KIND_INTERNAL = 2, 3, 1
STATUS_CODE_ERROR = 2


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span posted to
    /v1/traces, with the service.name of its resource."""

    def __init__(self):
        self.spans = []  # (service name, Span)
        self.posts = []  # (path, content-type)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    receiver.posts.append((self.path, self.headers["content-type"]))
                    for rs in request.resource_spans:
                        service = next(a.value.string_value for a in rs.resource.attributes
                                       if a.key == "service.name")
                        for ss in rs.scope_spans:
                            receiver.spans.extend((service, s) for s in ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def of_trace(self, trace_hex: str) -> list:
        with self.lock:
            return [(service, s) for service, s in self.spans if s.trace_id.hex() == trace_hex]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def tracing_table(receiver: Receiver, *extra: str) -> list[str]:
    return ["[tracing]", f'otlp_endpoint = "{receiver.endpoint}"', *extra]


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind)
    return out


def scrape(cluster) -> dict:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample_value(families, family: str, sample: str, **labels) -> float:
    return next(s.value for s in families[family].samples if s.name == sample and s.labels == labels)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_one_trace_from_the_client_through_the_edge_and_node_to_the_provider(receiver):
    with Cluster(extra_toml=tracing_table(receiver), node_extra=tracing_table(receiver)) as cluster:
        url = cluster.base_url + "/v1/chat/completions"
        status, _, _ = post_raw(url, {"model": MODEL, "messages": MESSAGES},
                                headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                                         "tracestate": "rojo=00f067aa0ba902b7",
                                         "x-request-id": "e2e-traced-1"})
        assert status == 200

        def arrived():
            names = {(service, s.name) for service, s in receiver.of_trace(CLIENT_TRACE)}
            return {("iop-edge", "dispatch"), ("iop-node", "provider_call")} <= names

        wait_until(arrived, timeout_s=20, what="the edge's and the node's spans")
        spans = receiver.of_trace(CLIENT_TRACE)
        edge = {s.name: s for service, s in spans if service == "iop-edge"}
        node = [s for service, s in spans if service == "iop-node"]
        assert set(edge) == {"POST /v1/chat/completions", "queue_wait", "dispatch"}, edge.keys()
        assert len(node) == 1
        request, queue, dispatch, provider = (edge["POST /v1/chat/completions"], edge["queue_wait"],
                                              edge["dispatch"], node[0])
        # The links: client → request → (queue_wait, dispatch → provider_call).
        assert request.parent_span_id.hex() == CLIENT_SPAN
        assert request.kind == SPAN_KIND_SERVER
        assert queue.parent_span_id == request.span_id and queue.kind == SPAN_KIND_INTERNAL
        assert dispatch.parent_span_id == request.span_id
        assert provider.parent_span_id == dispatch.span_id
        assert provider.kind == SPAN_KIND_CLIENT
        assert len({s.span_id for _, s in spans}) == 4
        assert request.trace_state == "rojo=00f067aa0ba902b7"
        assert provider.trace_state == "rojo=00f067aa0ba902b7"
        # Timing: each child inside its parent.
        assert request.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano
        assert queue.end_time_unix_nano <= dispatch.start_time_unix_nano <= dispatch.end_time_unix_nano
        assert dispatch.end_time_unix_nano <= request.end_time_unix_nano
        assert [e.name for e in provider.events] == ["first_byte"]
        assert provider.start_time_unix_nano <= provider.events[0].time_unix_nano <= provider.end_time_unix_nano
        assert attributes(request) == {
            "http.request.method": "POST", "url.path": "/v1/chat/completions",
            "http.response.status_code": 200, "iop.outcome": "completed",
            "iop.request_id": "e2e-traced-1", "gen_ai.request.model": MODEL,
        }
        assert attributes(dispatch)["iop.node"] == "node-a"
        assert attributes(provider)["http.response.status_code"] == 200
        assert attributes(provider)["gen_ai.request.model"] == "mock-model"
        assert attributes(provider)["iop.run_id"] == attributes(dispatch)["iop.run_id"]
        assert request.status.code != STATUS_CODE_ERROR and provider.status.code != STATUS_CODE_ERROR
        # The provider got a child traceparent: same trace, the Node's span
        # as its parent, sampled.
        assert cluster.mock_stats()["last_traceparent"] == f"00-{CLIENT_TRACE}-{provider.span_id.hex()}-01"
        # OTLP/HTTP protobuf, as a collector expects it.
        assert set(receiver.posts) == {("/v1/traces", "application/x-protobuf")}
        # The trace id is in the Edge's access line and the Node's line for the run.
        wait_until(lambda: any(l.startswith("ts=") and "request_id=e2e-traced-1" in l
                               and f"trace_id={CLIENT_TRACE}" in l
                               for l in cluster.edge.log().splitlines()),
                   what="the access line with the trace id")
        wait_until(lambda: any("tunnel ended" in l and f"trace_id={CLIENT_TRACE}" in l
                               for l in cluster.nodes["node-a"].log().splitlines()),
                   what="the node's line with the trace id")
        families = scrape(cluster)
        assert sample_value(families, "iop_edge_trace_spans_started",
                            "iop_edge_trace_spans_started_total") == 3
        assert sample_value(families, "iop_edge_trace_spans_dropped",
                            "iop_edge_trace_spans_dropped_total") == 0

        # A request without a traceparent starts a trace of its own, whose
        # id the access line names.
        status, _, _ = post_raw(url, {"model": MODEL, "messages": MESSAGES},
                                headers={"x-request-id": "e2e-traced-2"})
        assert status == 200
        found = {}

        def new_trace_logged():
            for line in cluster.edge.log().splitlines():
                m = re.search(r"request_id=e2e-traced-2 .*trace_id=([0-9a-f]{32})", line)
                if m:
                    found["trace"] = m.group(1)
                    return True
            return False

        wait_until(new_trace_logged, what="the second access line")
        assert found["trace"] != CLIENT_TRACE
        wait_until(lambda: {s.name for _, s in receiver.of_trace(found["trace"])}
                   >= {"POST /v1/chat/completions", "provider_call"},
                   what="the new trace's spans")
        root = next(s for _, s in receiver.of_trace(found["trace"]) if s.name == "POST /v1/chat/completions")
        assert root.parent_span_id == b""


def test_with_tracing_off_no_span_is_built_and_nothing_is_propagated():
    with Cluster() as cluster:
        url = cluster.base_url + "/v1/chat/completions"
        for _ in range(3):
            status, _, _ = post_raw(url, {"model": MODEL, "messages": MESSAGES},
                                    headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            assert status == 200
        found = {}

        def node_scraped():
            found.update(scrape(cluster))
            calls = found.get("iop_node_provider_call_duration_seconds")
            return calls is not None and any(s.name.endswith("_count") and s.value == 3 for s in calls.samples)

        wait_until(node_scraped, what="the node's calls counted")
        assert sample_value(found, "iop_edge_trace_spans_started", "iop_edge_trace_spans_started_total") == 0
        assert sample_value(found, "iop_node_trace_spans_started", "iop_node_trace_spans_started_total",
                            node="node-a") == 0
        # The provider got no traceparent, and the access line names no trace.
        assert cluster.mock_stats()["last_traceparent"] is None
        def access_lines():
            return [l for l in cluster.edge.log().splitlines() if l.startswith("ts=") and "path=/v1/chat" in l]

        # The access log's writer thread writes in batches.
        wait_until(lambda: len(access_lines()) == 3, what="three access lines")
        assert not any("trace_id=" in l for l in access_lines())


def access_trace_id(cluster, request_id: str) -> str:
    """The trace id on the access line of `request_id`."""
    found = {}

    def logged():
        for line in cluster.edge.log().splitlines():
            m = re.search(rf"request_id={request_id} .*trace_id=([0-9a-f]{{32}})", line)
            if m:
                found["id"] = m.group(1)
                return True
        return False

    wait_until(logged, what=f"the access line of {request_id}")
    return found["id"]


def test_a_failed_request_is_exported_even_at_sample_ratio_zero(receiver):
    ratio = tracing_table(receiver, "sample_ratio = 0.0")
    with Cluster(mock_args=["--fail-status", "500"], extra_toml=ratio, node_extra=ratio) as cluster:
        url = cluster.base_url + "/v1/chat/completions"
        # First a request the client got wrong (404): not an error of the
        # path, so at ratio 0 it is not exported.
        status, _, _ = post_raw(url, {"model": "no-such-model", "messages": MESSAGES},
                                headers={"x-request-id": "e2e-unsampled-1"})
        assert status == 404
        unsampled = access_trace_id(cluster, "e2e-unsampled-1")
        status, _, _ = post_raw(url, {"model": MODEL, "messages": MESSAGES},
                                headers={"x-request-id": "e2e-failed-1"})
        assert status == 500
        failed = access_trace_id(cluster, "e2e-failed-1")
        wait_until(lambda: {(svc, s.name) for svc, s in receiver.of_trace(failed)}
                   >= {("iop-edge", "POST /v1/chat/completions"), ("iop-node", "provider_call")},
                   what="the failed request's spans")
        spans = {s.name: s for _, s in receiver.of_trace(failed)}
        request, provider = spans["POST /v1/chat/completions"], spans["provider_call"]
        assert request.status.code == STATUS_CODE_ERROR
        assert provider.status.code == STATUS_CODE_ERROR
        assert attributes(request)["http.response.status_code"] == 500
        assert attributes(provider)["http.response.status_code"] == 500
        assert provider.parent_span_id == spans["dispatch"].span_id
        # Unsampled at its head: the provider was told so.
        assert cluster.mock_stats()["last_traceparent"] == f"00-{failed}-{provider.span_id.hex()}-00"
        # The 404 ended first and the exporter keeps order: had it been
        # exported, it would be here by now.
        assert receiver.of_trace(unsampled) == []
        families = scrape(cluster)
        assert sample_value(families, "iop_edge_trace_spans_started",
                            "iop_edge_trace_spans_started_total") == 5
