"""The `/status` contract of a running Edge, pinned field by field (X5, P3).

CONTRACT: X5 — `/status` carries exactly the provider projection, each
node's phase and drains (and the state of the Edge's own log files): every
field is listed here with its value, and nothing that names a Node's
address, a token or a transport internal (connection ids, generations,
certificates, the Edge's or the provider's socket addresses) appears in it.
"""

import json
import urllib.request

from iop_harness import Cluster

OUTLIER_CLEAR = {"ejected": False, "reason": None, "consecutive_failures": 0,
                 "ejections": 0, "readmit_in_ms": None}
# Taking new work: no operator drain of it or its node, its node does not
# say it drains, no reload removed it.
IN_SERVICE = {"drained": False, "node_drained": False, "draining": False, "removed": False}
NODE_IN_SERVICE = {"drained": False, "draining": False, "removed": False}


def test_status_is_the_projection_and_nothing_else():
    with Cluster(mock_args=["--tokens", "3"]) as c:
        with urllib.request.urlopen(c.base_url + "/status", timeout=5) as resp:
            assert resp.headers["content-type"].startswith("application/json")
            text = resp.read().decode()
        status = json.loads(text)
        assert status == {"providers": [
            {
                "node_id": "node-a", "provider_id": "mock-1", "adapter": "mock",
                "target": "mock-model", "category": "local_inference",
                "status": "available", "health": "available",
                "capacity": 64, "long_context_capacity": 0,
                "in_flight": 0, "long_in_flight": 0, "queued": 0, "long_queued": 0,
                "connected": True, "outlier": OUTLIER_CLEAR, **IN_SERVICE,
            },
            {
                # Configured, never connected: P3's offline projection.
                "node_id": "node-offline", "provider_id": "mock-1", "adapter": "mock",
                "target": "mock-model", "category": "local_inference",
                "status": "unavailable", "health": "offline",
                "capacity": 0, "long_context_capacity": 0,
                "in_flight": 0, "long_in_flight": 0, "queued": 0, "long_queued": 0,
                "connected": False, "outlier": OUTLIER_CLEAR, **IN_SERVICE,
            },
        ], "nodes": [
            {"node_id": "node-a", "phase": "ready", **NODE_IN_SERVICE},
            {"node_id": "node-offline", "phase": "offline", **NODE_IN_SERVICE},
        ], "models": [
            # Each model's queue and routing (one provider: least_loaded).
            {"model": "iop-test-model", "queued": 0, "max_queue": 256, "routing": {
                "policy": "least_loaded", "routed_by_load": 0, "routed_by_match": 0,
                "routed_by_session": 0, "imbalance_fallbacks": 0, "affinity_waits": 0,
                "affinity_waits_expired": 0, "tree_bytes": 0,
                "tree_budget_bytes": 0}},
            {"model": "offline-model", "queued": 0, "max_queue": 256, "routing": {
                "policy": "least_loaded", "routed_by_load": 0, "routed_by_match": 0,
                "routed_by_session": 0, "imbalance_fallbacks": 0, "affinity_waits": 0,
                "affinity_waits_expired": 0, "tree_bytes": 0,
                "tree_budget_bytes": 0}},
        ], "logs": {
            # The Edge's own files (for callers that see everything; this
            # Edge runs open): the access log on stderr, no usage file.
            "access_log": {
                "destination": "stderr", "failing": False, "open_error": None,
                "write_error": None, "open_errors_total": 0, "write_errors_total": 0,
                "dropped_lines_total": 0,
            },
            "usage_log": None,
        }}
        # Nothing of the transport, whatever its key would be called.
        _, mock_port = c.mock.ready["addr"].rsplit(":", 1)
        edge_node_port = c.edge.ready["nodes"].rsplit(":", 1)[1]
        for forbidden in ["127.0.0.1", mock_port, edge_node_port, "http://", "spiffe://",
                          "\"conn\"", "conn_id", "generation", "token", "secret", "cert", "tls",
                          "addr"]:
            assert forbidden not in text, (forbidden, text)
