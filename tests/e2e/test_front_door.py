"""The front door against a client that writes its whole body before it
reads (Python's urllib): a 64 MiB body over the limit is answered 413 at the
head, and the Edge's lingering close lets the client finish writing and
read that answer instead of a connection reset."""

import json
import re
import urllib.error
import urllib.request

import pytest

from iop_harness import Cluster

BODY_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c:
        yield c


def _post_whole_body(url):
    request = urllib.request.Request(
        url, data=b" " * BODY_BYTES, headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    return raised.value.code, json.loads(raised.value.read())


def test_urllib_reads_the_413_in_the_openai_shape(cluster):
    status, body = _post_whole_body(cluster.base_url + "/v1/chat/completions")
    assert status == 413
    assert body == {
        "error": {
            "message": "Request body exceeds the limit of 8388608 bytes.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    }


def test_urllib_reads_the_413_in_the_anthropic_shape(cluster):
    status, body = _post_whole_body(cluster.base_url + "/v1/messages")
    assert status == 413
    assert body == {
        "type": "error",
        "error": {
            "type": "request_too_large",
            "message": "Request body exceeds the limit of 8388608 bytes.",
        },
        # The x-request-id the Edge minted (the Anthropic shape carries it).
        "request_id": body.get("request_id"),
    }
    assert re.fullmatch(r"req_[0-9a-f]{32}", body["request_id"]), body
