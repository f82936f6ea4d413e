"""The official Anthropic SDK → Edge `/v1/messages` passthrough → tunnel →
mock Messages API, real processes.

CONTRACT: U1, U2, U3 — `POST /v1/messages` and `/v1/messages/count_tokens`
travel as tunnels with operations `messages` and `count_tokens`; the client
receives exactly the events and objects the provider sent.
"""

import anthropic
import pytest

from iop_harness import Cluster

MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "say something deterministic"}]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(mock_args=["--tokens", "5"]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return anthropic.Anthropic(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def direct(cluster):
    return anthropic.Anthropic(base_url=f"http://{cluster.mock.ready['addr']}", api_key="unused", max_retries=0)


def test_messages_create_equals_the_provider_message(client, direct):
    # CONTRACT: U3 — operation `messages`, body model rewritten (U5).
    relayed = client.messages.create(model=MODEL, max_tokens=64, system="be brief", messages=MESSAGES)
    expected = direct.messages.create(model="mock-model", max_tokens=64, system="be brief", messages=MESSAGES)
    assert relayed.type == "message" and relayed.role == "assistant"
    assert [b.type for b in relayed.content] == ["text"]
    assert relayed.content[0].text == expected.content[0].text == "tok0 tok1 tok2 tok3 tok4 "
    assert relayed.model == "mock-model"
    assert relayed.stop_reason == "end_turn"
    assert relayed.usage.input_tokens == expected.usage.input_tokens == 5
    assert relayed.usage.output_tokens == 5


def test_messages_stream_equals_the_provider_stream(client, direct):
    # CONTRACT: U1, U2 — the SSE events (ping included) arrive in order and
    # the text is the provider's.
    def collect(c, model):
        events = list(c.messages.create(model=model, max_tokens=3, messages=MESSAGES, stream=True))
        return events

    relayed = collect(client, MODEL)
    expected = collect(direct, "mock-model")
    types = [e.type for e in relayed]
    assert types == [e.type for e in expected]
    assert types == (["message_start", "content_block_start"] + ["content_block_delta"] * 3
                     + ["content_block_stop", "message_delta", "message_stop"])
    text = "".join(e.delta.text for e in relayed if e.type == "content_block_delta")
    assert text == "tok0 tok1 tok2 "
    delta = next(e for e in relayed if e.type == "message_delta")
    assert delta.delta.stop_reason == "max_tokens"
    assert delta.usage.output_tokens == 3


def test_messages_stream_helper_accumulates(client):
    # The SDK's higher-level helper parses every event of the relayed stream.
    with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    assert final.content[0].text == text
    assert final.usage.output_tokens == 5


def test_count_tokens(client, direct):
    # CONTRACT: U3 — operation `count_tokens`.
    relayed = client.messages.count_tokens(model=MODEL, system="two words", messages=MESSAGES)
    expected = direct.messages.count_tokens(model="mock-model", system="two words", messages=MESSAGES)
    assert relayed.input_tokens == expected.input_tokens == 5


def test_unknown_model_is_an_anthropic_error(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=8, messages=MESSAGES)
    assert e.value.status_code == 404
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
