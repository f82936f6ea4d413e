"""Request ids and the access log with real processes: the official SDKs'
request → Edge → Node → mock, and back.

The client's x-request-id comes back on the response, is in the Node's log
lines about that run, and names the Edge's access log line for the request;
an Anthropic-shape error carries it as request_id.
"""

import re

import anthropic
import openai
import pytest

from iop_harness import Cluster, wait_until

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "say something deterministic"}]


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c:
        yield c


def access_line(proc, request_id: str) -> dict:
    """The access log line (logfmt on stderr) of `request_id`, parsed."""
    found = {}

    def present():
        for line in proc.log().splitlines():
            if line.startswith("ts=") and f" request_id={request_id} " in line:
                found.update(parse_logfmt(line))
                return True
        return False

    wait_until(present, what=f"access log line of {request_id}")
    return found


def parse_logfmt(line: str) -> dict:
    fields = {}
    for m in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line):
        key, value = m.group(1), m.group(2)
        if value.startswith('"'):
            value = bytes(value[1:-1], "utf-8").decode("unicode_escape")
        fields[key] = value
    return fields


def test_a_client_request_id_is_echoed_logged_and_reaches_the_node(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-request-id": "e2e-trace-1"},
    )
    assert raw.headers["x-request-id"] == "e2e-trace-1"
    usage = None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens > 0

    line = access_line(cluster.edge, "e2e-trace-1")
    assert {k: line[k] for k in ("principal", "method", "path", "model", "provider", "node", "status",
                                 "outcome", "attempts")} == {
        "principal": "anonymous", "method": "POST", "path": "/v1/chat/completions", "model": MODEL,
        "provider": "node-a/mock-1", "node": "node-a", "status": "200", "outcome": "completed",
        "attempts": "1",
    }
    assert int(line["prompt_tokens"]) == usage.prompt_tokens
    assert int(line["completion_tokens"]) == usage.completion_tokens
    assert line["usage"] == "reported"
    assert 0 < float(line["ttft_ms"]) <= float(line["duration_ms"])
    assert int(line["bytes_in"]) > 0 and int(line["bytes_out"]) > 0

    # The Node's lines about this run carry the id (its span), ending with
    # one "tunnel ended" line.
    node = cluster.nodes["node-a"]
    wait_until(lambda: any("request_id=e2e-trace-1" in l and "tunnel ended" in l
                           for l in node.log().splitlines()),
               what="the node's line for the request")


def test_a_minted_id_is_the_one_in_the_anthropic_error(cluster):
    client = anthropic.Anthropic(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=20)
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=8, messages=MESSAGES)
    response = caught.value.response
    request_id = response.headers["x-request-id"]
    assert re.fullmatch(r"req_[0-9a-f]{32}", request_id), request_id
    assert response.json()["request_id"] == request_id
    line = access_line(cluster.edge, request_id)
    assert (line["path"], line["status"], line["outcome"], line["model"]) == (
        "/v1/messages", "404", "model_not_found", "no-such-model")
