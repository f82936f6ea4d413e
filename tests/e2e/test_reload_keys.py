"""SIGHUP applies `[[client_keys]]` without a restart, and `/admin` needs the
admin scope (or, without client keys, a loopback peer).

A revoked key gets 401 in the OpenAI error shape from its next request on —
on a new connection and on the keep-alive connection whose stream was let in
under it — while that stream, already in flight, runs to its end. An added
key works at once. The "needs a restart" warning is logged on every reload
whose file still differs from what runs, and stops once the file matches.
A usage file path that cannot be opened does not hold a revocation back:
the rest of the file applies and the usage file goes on in its open file.
"""

import http.client
import json
import signal
import socket
import urllib.request

import pytest

from iop_harness import Cluster, post_raw, wait_until

OPS_KEY = "sk-ops-3b9f0c1d7e2a"
KEY_A = "sk-team-a-8d21c4e0f9b7"
KEY_B = "sk-team-b-51e7a2c9d0f3"
TOKENS = 60
INVALID_KEY = {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                         "param": None, "code": "invalid_api_key"}}


def _keys(**extra):
    # The first key is the one the harness sends for /status: never revoked.
    return {"ops": {"key": OPS_KEY, "scopes": ["admin"]}, **extra}


# "0-1": the reload runs on Control's core; requests are read on either.
@pytest.fixture(params=["0", "0-1"])
def cluster(request):
    # 60 tokens 100 ms apart: a stream stays in flight for about 6 s.
    with Cluster(cores=request.param, client_keys=_keys(**{"team-a": KEY_A}),
                 mock_args=["--tokens", str(TOKENS), "--inter-token-ms", "100"]) as c:
        yield c


def _reloads(cluster) -> int:
    return cluster.edge.log().count("configuration reloaded")


def _restart_warnings(cluster) -> int:
    return cluster.edge.log().count("these changes need a restart and were not applied")


def _reload(cluster, extra_toml: str = "", edit=lambda text: text):
    """Writes the harness's config for the current `client_keys` (plus
    `extra_toml`, then `edit`ed) and sends SIGHUP; returns once the reload
    is logged."""
    before = _reloads(cluster)
    text = edit(cluster.edge_config(cluster.mock.ready["addr"]) + extra_toml)
    (cluster.dir / "edge.toml").write_text(text)
    cluster.edge.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: _reloads(cluster) == before + 1, timeout_s=10, what="reload logged")


def _connect(cluster) -> http.client.HTTPConnection:
    host, port = cluster.edge.ready["client"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    conn.connect()
    return conn


def _chat(conn, key: str, stream: bool, model: str = "iop-test-model") -> http.client.HTTPResponse:
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    if not stream:
        body["max_tokens"] = 1
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    return conn.getresponse()


def _chat_once(cluster, key: str, model: str = "iop-test-model") -> tuple[int, dict]:
    conn = _connect(cluster)
    try:
        resp = _chat(conn, key, stream=False, model=model)
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _stream_text(resp) -> tuple[str, bool]:
    """The content of the rest of an SSE chat stream and whether it ended
    with [DONE]."""
    text, done = [], False
    for raw in iter(resp.readline, b""):
        line = raw.decode().rstrip("\r\n")
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        for choice in json.loads(data).get("choices", []):
            text.append(choice["delta"].get("content") or "")
    return "".join(text), done


def _in_flight(cluster) -> int:
    return cluster.provider("node-a", "mock-1")["in_flight"]


def _admin(cluster, key: str | None, host: str | None = None) -> tuple[int, dict]:
    url = cluster.base_url if host is None else f"http://{host}:{cluster.edge.ready['client'].rsplit(':', 1)[1]}"
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    status, _, raw = post_raw(f"{url}/admin/nodes/node-a/commands", {"type": "provider_status"}, headers=headers)
    return status, json.loads(raw)


def test_a_revoked_key_gets_401_next_while_its_stream_finishes(cluster):
    conn = _connect(cluster)
    resp = _chat(conn, KEY_A, stream=True)
    assert resp.status == 200
    first = resp.readline()
    while not first.startswith(b"data: "):
        first = resp.readline()
    # Revoke team-a, add team-b.
    cluster.client_keys = _keys(**{"team-b": KEY_B})
    _reload(cluster)
    assert "client_keys_added=1 client_keys_revoked=1" in cluster.edge.log()
    assert _chat_once(cluster, KEY_A) == (401, INVALID_KEY)
    status, body = _chat_once(cluster, KEY_B)
    assert status == 200, body
    # The stream let in under the revoked key is still running ...
    assert _in_flight(cluster) == 1
    # ... and runs to its end.
    rest, done = _stream_text(resp)
    first_text = "".join(c["delta"].get("content") or ""
                         for c in json.loads(first.decode()[len("data: "):])["choices"])
    assert (first_text + rest, done) == ("".join(f"tok{i} " for i in range(TOKENS)), True)
    # The next request on that same keep-alive connection is refused.
    again = _chat(conn, KEY_A, stream=False)
    assert (again.status, json.loads(again.read())) == (401, INVALID_KEY)
    conn.close()
    assert _in_flight(cluster) == 0


def test_the_restart_warning_repeats_until_the_file_matches(cluster):
    # Another drain grace needs a restart; the key change and the model
    # added in the same file apply.
    added_model = '[[models]]\nname = "added-model"\nproviders = ["node-a/mock-1"]\n'

    def slower(text: str) -> str:
        return text.replace('node_listen = "127.0.0.1:0"', 'node_listen = "127.0.0.1:0"\ndrain_grace_ms = 5000')

    cluster.client_keys = _keys(**{"team-a": KEY_A, "team-b": KEY_B})
    _reload(cluster, added_model, slower)
    assert _restart_warnings(cluster) == 1
    assert 'sections=["edge.drain_grace_ms"]' in cluster.edge.log()
    assert _chat_once(cluster, KEY_B)[0] == 200
    assert _chat_once(cluster, KEY_B, model="added-model")[0] == 200
    # The file still differs from what runs: warned again.
    _reload(cluster, added_model, slower)
    assert _restart_warnings(cluster) == 2
    # Back to what runs (the keys are the applied part): no warning.
    _reload(cluster)
    assert _restart_warnings(cluster) == 2
    status, body = _chat_once(cluster, KEY_B)
    assert status == 200, body


def test_admin_needs_the_admin_scope(cluster):
    status, body = _admin(cluster, OPS_KEY)
    assert status == 200, body
    assert body["ok"] is True
    assert _admin(cluster, KEY_A) == (403, {"error": {
        "message": 'this API key may not use /admin: give it scopes = ["admin"] in [[client_keys]]',
        "type": "admin_error", "param": None, "code": "admin_scope_required"}})
    assert _admin(cluster, None)[0] == 401
    assert _admin(cluster, "sk-unknown")[0] == 401
    # Scopes follow a reload: team-a gains admin, ops loses it.
    cluster.client_keys = {"ops": OPS_KEY, "team-a": {"key": KEY_A, "scopes": ["admin"]}}
    _reload(cluster)
    assert _admin(cluster, KEY_A)[0] == 200
    assert _admin(cluster, OPS_KEY)[0] == 403


def _non_loopback_address() -> str | None:
    """An address of this machine that is not loopback, if it has one (a
    UDP connect sends nothing; it only picks the outgoing interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_without_client_keys_admin_answers_loopback_peers_only():
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    with Cluster(client_listen="0.0.0.0:0") as cluster:
        status, body = _admin(cluster, None, host="127.0.0.1")
        assert status == 200, body
        assert _admin(cluster, None, host=address) == (403, {"error": {
            "message": "without [[client_keys]] /admin answers loopback clients only",
            "type": "admin_error", "param": None, "code": "admin_loopback_only"}})
        # The inference surface itself stays open to that peer.
        status, _, raw = post_raw(
            f"http://{address}:{cluster.edge.ready['client'].rsplit(':', 1)[1]}/v1/chat/completions",
            {"model": "iop-test-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert status == 200, raw


def test_removing_the_last_key_is_refused_until_the_file_says_it_runs_open():
    """The revocation procedure with one key (delete its entry, SIGHUP) must
    not open the Edge to everyone: the reload is refused with the reason in
    the log and the key still applies, until the file says
    `allow_anonymous = true`."""
    with Cluster(client_keys={"team-a": KEY_A}) as cluster:
        addr = cluster.mock.ready["addr"]
        failed = cluster.edge.log().count("configuration reload failed")
        cluster.client_keys = {}
        no_keys = cluster.edge_config(addr).replace("allow_anonymous = true\n", "")
        assert "[[client_keys]]" not in no_keys and "allow_anonymous" not in no_keys
        (cluster.dir / "edge.toml").write_text(no_keys)
        cluster.edge.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: cluster.edge.log().count("configuration reload failed") == failed + 1,
                   timeout_s=10, what="reload refused")
        assert "client_keys: no client key is configured" in cluster.edge.log()
        status, body = _chat_once(cluster, "sk-anything")
        assert (status, body) == (401, INVALID_KEY)
        status, _ = _chat_once(cluster, KEY_A)
        assert status == 200
        # Said explicitly: the Edge runs open from the next request on.
        _reload(cluster)
        status, _, raw = post_raw(f"{cluster.base_url}/v1/chat/completions",
                                  {"model": "iop-test-model", "max_tokens": 1,
                                   "messages": [{"role": "user", "content": "x"}]})
        assert status == 200, raw


def _metric(cluster, name: str) -> float:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_usage_path_that_cannot_be_opened_does_not_hold_back_a_revocation(tmp_path):
    """The usage file was rotated and a directory took its path: the SIGHUP
    that revokes team-a applies anyway; usage records go on to the file
    already open, and the journal, /metrics and /status say why."""
    usage, rotated = tmp_path / "usage.jsonl", tmp_path / "usage.jsonl.1"
    with Cluster(client_keys=_keys(**{"team-a": KEY_A}),
                 edge_extra=["[edge.usage_log]", f'path = "{usage}"']) as cluster:
        assert _chat_once(cluster, KEY_A)[0] == 200
        wait_until(lambda: len(_lines(usage)) == 1, timeout_s=10, what="the first usage record")
        usage.rename(rotated)
        usage.mkdir()
        cluster.client_keys = _keys()
        _reload(cluster)
        why = f"cannot open {usage} for appending: Is a directory (os error 21)"
        assert (f"edge.usage_log.path: {why}; keeping the running usage log (opened as {usage})"
                in cluster.edge.log())
        assert _chat_once(cluster, KEY_A) == (401, INVALID_KEY)
        assert _chat_once(cluster, OPS_KEY)[0] == 200
        assert _metric(cluster, "iop_edge_usage_log_failing") == 1
        assert _metric(cluster, "iop_edge_usage_log_open_errors_total") == 1
        assert cluster.status()["logs"]["usage_log"] == {
            "path": str(usage), "failing": True, "open_error": why, "write_error": None,
            "open_errors_total": 1, "write_errors_total": 0, "dropped_records_total": 0,
        }
        wait_until(lambda: len(_lines(rotated)) == 2, timeout_s=10, what="the second usage record")
        assert [(r["principal"], r["status"]) for r in _lines(rotated)] == [("team-a", 200), ("ops", 200)]
        assert usage.is_dir()
