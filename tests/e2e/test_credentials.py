"""Managed credential leases end to end: real edge-bin and node-bin with the
credential plane on, and a mock provider that requires an API key
(`bench mock-provider --require-api-key`). The key lives only in the Edge's
secret file; each request carries it to the Node in a lease sealed to that
Node (C1), which injects it right before the provider call (C2).

CONTRACT: C1, C2, C3, C4, C5
"""

import json
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from iop_harness import Cluster, http_json, post_raw, wait_until

CANARY = "sk-iop-leak-canary-7f3a"
CLIENT_KEY = "iop-client-key-team-a-3c9d"
MODEL = "iop-test-model"
MESSAGES = [{"role": "user", "content": "say something deterministic"}]
CHAT = {"model": MODEL, "messages": MESSAGES}


def managed_cluster(credentials=None, **kwargs) -> Cluster:
    return Cluster(mock_args=["--require-api-key", CANARY], credentials=credentials or {"secret": CANARY},
                   **kwargs)


@pytest.fixture(scope="module")
def cluster():
    # Debug logs make the leak scan stricter.
    with managed_cluster(client_keys={"team-a": CLIENT_KEY},
                         edge_env={"RUST_LOG": "debug"}, node_env={"RUST_LOG": "debug"}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=20)


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_provider_key_reaches_the_provider_through_a_lease(cluster, client):
    # CONTRACT: C1, C2 — the provider requires the key; only the Edge has it.
    status, _, body = post_raw(f"http://{cluster.mock.ready['addr']}/v1/chat/completions",
                               {"model": "mock-model", "messages": MESSAGES})
    assert status == 401, body
    before = cluster.mock_stats()["chat_requests"]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        if c.choices
    )
    assert streamed == reply.choices[0].message.content
    assert cluster.mock_stats()["chat_requests"] == before + 2


def test_client_keys(cluster):
    # CONTRACT: C1 — the principal of a lease comes from the client's key.
    # 401 in the OpenAI shape without a key or with a wrong one.
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
    assert status == 401
    assert json.loads(body) == {"error": {
        "message": "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
        "type": "invalid_request_error", "param": None, "code": None}}
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT, headers=bearer("wrong"))
    assert status == 401
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    # The Anthropic shape on /v1/messages, which also takes x-api-key.
    messages = {"model": MODEL, "max_tokens": 16, "messages": MESSAGES}
    status, headers, body = post_raw(cluster.base_url + "/v1/messages", messages, headers={"x-api-key": "wrong"})
    assert status == 401
    assert json.loads(body) == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."},
        "request_id": headers["x-request-id"]}
    # 200 with the right key, both ways.
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT, headers=bearer(CLIENT_KEY))
    assert status == 200, body
    reply = anthropic.Anthropic(base_url=cluster.base_url, api_key=CLIENT_KEY, max_retries=0,
                                timeout=20).messages.create(**messages)
    assert reply.content[0].text
    # Probes and the metrics scrape stay open.
    with urllib.request.urlopen(cluster.base_url + "/livez", timeout=5) as resp:
        assert resp.status == 200


def test_nothing_leaks(cluster, client):
    # CONTRACT: C4 — after successful, streamed, refused and failed
    # requests the secret is in no Edge or Node log line, nor in /metrics or
    # /status (the mock, which must see it, is not scanned).
    client.chat.completions.create(model=MODEL, messages=MESSAGES)
    list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    post_raw(cluster.base_url + "/v1/chat/completions", CHAT, headers=bearer(CANARY))
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    status = json.dumps(http_json(cluster.base_url + "/status", headers=bearer(CLIENT_KEY)))
    assert "iop_edge" in metrics and "node-a" in status
    assert CANARY not in metrics
    assert CANARY not in status
    edge_log, node_log = cluster.edge.log(), cluster.nodes["node-a"].log()
    # The scan saw the logs of the credential plane at work.
    assert "credential plane enabled" in edge_log and "credential plane enabled" in node_log
    for name, log in (("edge", edge_log), ("node", node_log)):
        leaked = [line for line in log.splitlines() if CANARY in line]
        assert leaked == [], f"{name} log leaks the secret: {leaked[:3]}"


def test_rotated_recipient_key_fails_closed():
    # CONTRACT: C2, C3, C5 — the Edge still seals to the node's old key; the
    # restarted node cannot open it: lease_invalid, no provider call.
    with managed_cluster() as cluster:
        status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
        assert status == 200, body
        cluster.rotate_recipient_key("node-a")
        before = cluster.mock_stats()["chat_requests"]
        status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
        assert status == 502, body
        assert json.loads(body)["error"]["code"] == "lease_invalid"
        assert cluster.mock_stats()["chat_requests"] == before
        assert not any(CANARY in p.log() for p in (cluster.edge, *cluster.nodes.values()))


def test_disabled_slot_is_refused_at_the_edge():
    # CONTRACT: C3, C5 — a disabled slot issues no lease: 503, nothing sent
    # to the node or the provider, and no other credential tried: the
    # model's second provider, on node-b, has an enabled slot of its own
    # ("spare-key") and is not used for the refused requests.
    credentials = {"secret": CANARY, "providers": ["node-a/mock-1"], "slot_extra": ["enabled = false"],
                   "spare_providers": ["node-b/mock-1"]}
    with managed_cluster(credentials=credentials, node_ids=("node-a", "node-b")) as cluster:
        # Both idle, node-a/mock-1 is first in the model's pool: every
        # request is routed to it.
        for stream in (False, True):
            status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", {**CHAT, "stream": stream})
            assert status == 503, body
            error = json.loads(body)["error"]
            assert error["code"] == "credential_unavailable"
            assert error["message"] == ("credential slot `mock-key` is disabled; the request was not sent "
                                        "to the provider (no other credential is tried).")
        # Neither provider (both on this mock) was called.
        assert cluster.mock_stats()["chat_requests"] == 0
        # The provider's lease was settled: nothing stays in flight.
        assert cluster.provider("node-a", "mock-1")["in_flight"] == 0
        # The other credential works: with node-a gone, node-b's provider
        # serves the model through "spare-key".
        cluster.nodes["node-a"].stop()
        wait_until(lambda: not cluster.provider("node-a", "mock-1")["connected"], what="node-a gone")
        status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
        assert status == 200, body
        assert cluster.mock_stats()["chat_requests"] == 1


def test_a_secret_from_the_environment_leaves_it():
    # CONTRACT: C4 — a slot secret read from `secret_env` serves leases, and
    # is then gone from the Edge's environment: not in /proc/<pid>/environ
    # (which keeps the initial block even after unsetenv) and so not
    # inherited by anything the Edge would start.
    with managed_cluster(credentials={"secret": CANARY, "secret_env": "IOP_E2E_PROVIDER_KEY"}) as cluster:
        status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
        assert status == 200, body
        environ = Path(f"/proc/{cluster.edge.popen.pid}/environ").read_bytes()
        assert CANARY.encode() not in environ
        assert b"IOP_E2E_PROVIDER_KEY=" not in environ
        # The rest of the environment is intact.
        assert b"RUST_LOG=" in environ
        assert "could not wipe the secret" not in cluster.edge.log()


FAILOVER_COUNTERS = (
    'iop_edge_liveness_recovery_eligibility_total{source="failover",eligible="true"}',
    'iop_edge_liveness_recovery_eligibility_total{source="failover",eligible="false"}',
    'iop_edge_liveness_recovery_results_total{source="failover",result="retried"}',
)


def failover_counters(cluster) -> dict:
    """The Edge's failover counters by name (each must be in /metrics)."""
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    values = {}
    for name in FAILOVER_COUNTERS:
        found = [line.rsplit(" ", 1)[1] for line in lines if line.startswith(name + " ")]
        assert len(found) == 1, (name, found)
        values[name] = int(found[0])
    return values


def two_slot_cluster(**credentials) -> Cluster:
    """Model iop-test-model over node-a/mock-1 and node-b/mock-1 (node-a
    first: an idle pool picks it), each served by a slot of its own,
    mock-key-node-a and mock-key-node-b; the model fails over once (the
    default max_attempts = 2) on a failure another provider may not share."""
    return managed_cluster(credentials={"secret": CANARY, "slot_per_node": True, **credentials},
                           node_ids=("node-a", "node-b"))


def serves_after_node_a_stops(cluster) -> None:
    """node-b's own slot and route work: with node-a gone, node-b answers."""
    before = cluster.mock_stats()["chat_requests"]
    cluster.nodes["node-a"].stop()
    wait_until(lambda: not cluster.provider("node-a", "mock-1")["connected"], what="node-a gone")
    status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
    assert status == 200, body
    assert cluster.mock_stats()["chat_requests"] == before + 1


def test_no_fallback_to_another_slot_after_a_bound_route_fails():
    # CONTRACT: C5 — node-a cannot open its lease (its recipient key was
    # rotated): the request bound to node-a's slot ends with lease_invalid,
    # and neither node-b's slot nor its provider is tried, though both work
    # (proven last) and the model fails over on other failures.
    with two_slot_cluster() as cluster:
        status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
        assert status == 200, body
        cluster.rotate_recipient_key("node-a")
        mock_before = cluster.mock_stats()["chat_requests"]
        failover_before = failover_counters(cluster)
        for _ in range(3):
            status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
            assert status == 502, body
            assert json.loads(body)["error"]["code"] == "lease_invalid"
        assert cluster.mock_stats()["chat_requests"] == mock_before
        assert failover_counters(cluster) == failover_before
        assert cluster.provider("node-b", "mock-1")["in_flight"] == 0
        assert cluster.provider("node-a", "mock-1")["in_flight"] == 0
        serves_after_node_a_stops(cluster)


def test_no_fallback_to_another_slot_after_a_disabled_one():
    # CONTRACT: C3, C5 — node-a's slot is disabled, node-b's is not: the
    # request bound to node-a gets no lease (503) and no other slot or
    # provider is tried; node-b's slot serves once node-a is gone.
    with two_slot_cluster(slot_extra_of={"node-a": ["enabled = false"]}) as cluster:
        failover_before = failover_counters(cluster)
        for _ in range(3):
            status, _, body = post_raw(cluster.base_url + "/v1/chat/completions", CHAT)
            assert status == 503, body
            error = json.loads(body)["error"]
            assert error["code"] == "credential_unavailable"
            assert "credential slot `mock-key-node-a` is disabled" in error["message"]
        assert cluster.mock_stats()["chat_requests"] == 0
        assert failover_counters(cluster) == failover_before
        assert cluster.provider("node-b", "mock-1")["in_flight"] == 0
        assert cluster.provider("node-a", "mock-1")["in_flight"] == 0
        serves_after_node_a_stops(cluster)
