"""Operator commands through the Edge admin endpoint to a real Node.

CONTRACT: K2, H6 — `POST /admin/nodes/{node}/commands` reaches the node's
dispatch-ready connection; CAPABILITIES answers per adapter instance and
target with the probe status and the session's observation sequence;
PROVIDER_STATUS shows the gate; OLLAMA_QUERY refuses non read-only paths;
a node that is not ready gets 404.
"""

import json

import pytest

from iop_harness import Cluster, post_raw


# "0-1": the command or refresh leaves from Control's core and may have to
# reach the node's connection on the other core.
@pytest.fixture(scope="module", params=["0", "0-1"])
def cluster(request):
    with Cluster(cores=request.param) as c:
        yield c


def _command(cluster, node: str, body: dict):
    status, _, raw = post_raw(f"{cluster.base_url}/admin/nodes/{node}/commands", body)
    return status, json.loads(raw)


def test_capabilities_and_provider_status(cluster):
    # CONTRACT: K2, H6, W7
    status, first = _command(cluster, "node-a", {"type": "capabilities", "adapter": "mock"})
    assert status == 200, first
    assert first["ok"] is True
    [cap] = first["capabilities"]
    assert (cap["adapter_key"], cap["target"], cap["provider_status"]) == ("mock", "mock-model", "available")
    status, second = _command(cluster, "node-a", {"type": "capabilities", "adapter": "mock"})
    assert second["capabilities"][0]["health_observation_seq"] > cap["health_observation_seq"]

    status, providers = _command(cluster, "node-a", {"type": "provider_status"})
    assert status == 200
    [p] = providers["providers"]
    assert (p["adapter_key"], p["capacity"], p["in_flight"], p["state"]) == ("mock", 64, 0, "running")

    status, transport = _command(cluster, "node-a", {"type": "transport_status"})
    assert transport["transport_status"]["node_id"] == "node-a"


def test_refusals(cluster):
    # CONTRACT: K2
    status, refused = _command(cluster, "node-a", {"type": "ollama_query", "path": "/api/pull"})
    assert status == 200 and refused["ok"] is False
    assert "not allowed" in refused["error"]
    status, body = _command(cluster, "node-offline", {"type": "capabilities"})
    assert status == 404 and body["error"]["code"] == "node_not_ready"
    status, body = _command(cluster, "node-a", {"type": "run"})
    assert status == 400
