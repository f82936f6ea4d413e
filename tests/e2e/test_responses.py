"""The official OpenAI SDK's Responses API → Edge `/v1/responses`
passthrough → tunnel → mock Responses API, real processes.

CONTRACT: U1, U2, U3 — `POST /v1/responses` travels as a tunnel with
operation `responses`; the client gets the provider's events unchanged.
"""

import openai
import pytest

from iop_harness import Cluster

MODEL = "iop-test-model"
TEXT = "tok0 tok1 tok2 tok3 "


@pytest.fixture(scope="module")
def cluster():
    with Cluster(mock_args=["--tokens", "4"]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def direct(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.mock.ready['addr']}/v1", api_key="unused", max_retries=0)


def test_streaming_text_equals_the_provider_text(client, direct):
    # CONTRACT: U1, U2, U3
    relayed = list(client.responses.create(model=MODEL, input="say hi", stream=True))
    expected = list(direct.responses.create(model="mock-model", input="say hi", stream=True))
    deltas = "".join(e.delta for e in relayed if e.type == "response.output_text.delta")
    assert deltas == "".join(e.delta for e in expected if e.type == "response.output_text.delta") == TEXT
    assert [e.type for e in relayed] == [e.type for e in expected]
    assert relayed[0].type == "response.created"
    assert relayed[-1].type == "response.completed"
    assert [e.sequence_number for e in relayed] == list(range(len(relayed)))
    done = relayed[-1].response
    assert done.output_text == TEXT
    assert done.model == "mock-model"
    assert done.usage.output_tokens == 4


def test_non_streaming_response(client):
    # CONTRACT: U3
    r = client.responses.create(model=MODEL, input="say hi", instructions="be brief")
    assert r.object == "response" and r.status == "completed"
    assert r.output_text == TEXT
    assert r.usage.input_tokens == 4


def test_stream_helper_accumulates(client):
    # The SDK's accumulating helper checks event order and identity.
    with client.responses.stream(model=MODEL, input="say hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == TEXT
    assert final.output_text == TEXT


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
