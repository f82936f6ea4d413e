"""Several Edges of one cluster on a real etcd (`[cluster]`,
docs/multi-edge.md): real edge-bin, node-bin, bench mock-provider and etcd
processes on loopback (cluster_harness.py).

Requests go through every Edge: an Edge that owns none of a model's nodes
forwards the request over its peer listener to the Edge owning the most of
them (`forward_target`), which serves it; the entry Edge charges the
caller's limits.

Timing: the Edges hold etcd leases of 4 s kept alive every 1 s (an Edge
that cannot prove its lease fences what it owns 3 s after its last
acknowledged keep-alive); the Nodes redial every 1 s ± 50 %.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

from cluster_harness import (CLUSTER_NAME, FENCE_LINE, MODEL, EdgeCluster, StreamLoad, forward_target, http_json,
                             ids_out, node_model, send_stream, wait_until)
from iop_harness import post_raw

TTL_S = 4
KEEPALIVE_S = 1
# The mock streams up to 100 tokens 30 ms apart (3 s); the load asks for
# 20 (0.6 s), a drain-holding stream for all 100.
MOCK = ["--tokens", "100", "--inter-token-ms", "30"]
LOAD_TOKENS = 20
MESSAGES = [{"role": "user", "content": "count"}]
LOAD_BODY = {"model": MODEL, "stream": True, "max_tokens": LOAD_TOKENS, "messages": MESSAGES,
             "stream_options": {"include_usage": True}}
LONG_BODY = {"model": MODEL, "stream": True, "messages": MESSAGES, "stream_options": {"include_usage": True}}
# Generous bounds a loaded 2-core machine keeps: the property is that
# Nodes re-home within a few reconnect intervals.
REHOME_BOUND_S = 20.0
# An Edge's log line when its drain begins (after SIGTERM).
DRAIN_LINE = "draining: listeners closed"



# Attempts at the retry of a request a draining Edge refused (each after
# the answer's retry-after, 1 s): the draining Edge's idle nodes re-home
# within about one reconnect interval (1 s ± 50 % here).
RETRIES_AFTER_DRAIN = 5

def log_timing(what: str, seconds: float):
    print(f"TIMING {what}: {seconds:.2f} s")


def ok_count(load: StreamLoad, edges: set[int], since: float = 0.0) -> dict[int, int]:
    counts = {e: 0 for e in edges}
    for o in load.snapshot():
        if o.edge in counts and o.kind == "ok" and o.sent_at >= since:
            counts[o.edge] += 1
    return counts


def describe(outcomes) -> str:
    return "\n".join(f"edge={o.edge} sent={o.sent_at:.2f} headers={o.headers_at} ended={o.ended_at:.2f} "
                     f"status={o.status} kind={o.kind} {o.detail}" for o in outcomes)


def model_nodes(c: EdgeCluster, model: str) -> list[str]:
    """The nodes serving `model` (MODEL: every node)."""
    return list(c.node_ids) if model == MODEL else [n for n in c.node_ids if node_model(n) == model]


def served_at(c: EdgeCluster, entry: int, model: str, owners: dict[str, str]) -> int:
    """The Edge that serves a request for `model` entering at `entry`, by
    node ownership alone (`forward_target`). With free slots at several
    owners of the model, capacity summaries may pick another of them: see
    `may_serve` and `routed_to`."""
    target = forward_target(c.edges[entry].name, model_nodes(c, model), owners)
    return entry if target is None else c.index_of(target)


def may_serve(c: EdgeCluster, entry: int, model: str, owners: dict[str, str]) -> set[int]:
    """The Edges that may serve a request for `model` entering at an idle
    `entry`: the entry itself when it owns a node of the model (it has a
    free slot), else any Edge owning one of its nodes (the peer with the
    most free slots in its summary, which in-flight requests move)."""
    if served_at(c, entry, model, owners) == entry:
        return {entry}
    return {c.index_of(owners[n]) for n in model_nodes(c, model) if n in owners}


def routed_to(c: EdgeCluster, entry: int, request_id: str) -> int:
    """Where the entry Edge sent request `request_id`, from its access log
    line: the Edge it was forwarded to, or the entry itself."""
    target = c.access_line(entry, request_id, timeout_s=5).get("forwarded_to")
    return entry if target is None else c.index_of(target)


def forwarded_to(c: EdgeCluster, o) -> str | None:
    """Where the entry Edge of load request `o` forwarded it, from its
    access log line (None: served there, or no line)."""
    try:
        return c.access_line(o.edge, o.request_id, timeout_s=5).get("forwarded_to")
    except TimeoutError:
        return None


class OpenStream:
    """A streaming completion whose headers and first event were read; the
    rest is read by `finish`."""

    def __init__(self, cluster: EdgeCluster, edge: int, body: dict, headers: dict | None = None,
                 refusable: bool = False):
        self.conn = http.client.HTTPConnection(cluster.edges[edge].client_addr, timeout=30)
        self.conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                          headers={"content-type": "application/json", **(headers or {})})
        self.resp = self.conn.getresponse()
        self.refusal = None
        if refusable and self.resp.status != 200:
            # Not admitted: (status, headers, JSON body).
            self.refusal = (self.resp.status, {k.lower(): v for k, v in self.resp.getheaders()},
                            json.loads(self.resp.read()))
            self.conn.close()
            return
        assert self.resp.status == 200, self.resp.read()
        self.head = self.resp.read1(1)
        assert self.head, "no first byte"

    def close(self):
        """Leaves the stream (the client goes away)."""
        self.conn.close()

    def finish(self) -> tuple[bytes, BaseException | None]:
        """The whole body read so far and the error that ended it, if any."""
        data = self.head
        try:
            data += self.resp.read()
            return data, None
        except (OSError, http.client.HTTPException) as e:
            return data, e
        finally:
            self.conn.close()


# ---------------------------------------------------------------------------
# (a) one owner per node, the same view everywhere; every Edge answers
# byte-exact, forwarding to the owner where it owns none of the model's nodes
# ---------------------------------------------------------------------------

def test_every_edge_answers_byte_exact_forwarding_to_the_owner():
    keys = {"ops": {"key": "sk-ops", "scopes": ["admin"]},
            "app": {"key": "sk-app", "max_concurrent": 6}}
    with EdgeCluster(mock_args=MOCK, client_keys=keys, admin_principal="ops") as c:
        # Two owners: every Edge owns none of some model's nodes.
        owners = c.spread_nodes()
        names = [s.name for s in c.edges]
        assert set(owners) == {"node-a", "node-b"} and set(owners.values()) <= set(names), owners
        assert len(set(owners.values())) == 2, owners
        for i, slot in enumerate(c.edges):
            doc = c.status(i)
            cluster = dict(doc["cluster"])
            # What each Edge has free: this Edge's own summary, and one per
            # peer as last polled (ages vary; the peers are the others).
            capacity = cluster.pop("capacity")
            assert set(capacity) == {"here", "peers"}, capacity
            assert set(capacity["peers"]) == set(names) - {slot.name}, capacity
            # One fleet: published at start by the first Edge, adopted by
            # the others (their files say the same fleet).
            fleet = cluster.pop("fleet")
            first = c.status(0)["cluster"]["fleet"]
            assert fleet == first and fleet["source"] in names and fleet["revision"] > 0, fleet
            assert len(fleet["digest"]) == 64 and fleet["latest_revision"] == fleet["revision"], fleet
            assert (fleet["file_differs"], fleet["refused"]) == (False, None), fleet
            assert f"iop_edge_cluster_fleet_revision {fleet['revision']}\n" in c.metrics(i)
            assert cluster == {
                "name": CLUSTER_NAME, "edge": slot.name, "up": True, "edges": names,
                "nodes": [{"node_id": n, "edge": owners[n]} for n in sorted(owners)],
            }
            # One owner: a node's provider is connected on its owner only.
            for p in doc["providers"]:
                assert p["connected"] == (owners[p["node_id"]] == slot.name), (slot.name, p)
            assert c.readyz(i) == (200, "ok\n")
            metrics = c.metrics(i)
            assert "iop_edge_cluster_up 1\n" in metrics
            assert f"iop_edge_cluster_edges {len(names)}\n" in metrics
            for edge in set(owners.values()):
                count = sum(1 for e in owners.values() if e == edge)
                assert f'iop_edge_cluster_nodes{{edge="{edge}"}} {count}\n' in metrics, metrics
            # Nothing forwarded yet.
            assert "iop_edge_cluster_peer_requests_total 0\n" in metrics, metrics
            assert "iop_edge_cluster_forwarded_total{" not in metrics, metrics
            # A key that may not see the whole fleet gets no cluster object.
            app_view = http_json(slot.base_url + "/status", headers={"authorization": "Bearer sk-app"})
            assert "cluster" not in app_view

        # Every Edge, every model (MODEL on both nodes, each node's own),
        # streamed and not: the mock's bytes. Where the Edge owns none of
        # the model's nodes the request is forwarded to the owner.
        direct = {}
        for stream in (False, True):
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LOAD_TOKENS}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            direct[stream] = (body, ids_out(c.direct(body)))
        forwarded = {}   # (entry, owner) -> requests
        peer_requests = {i: 0 for i in range(len(c.edges))}
        sent = []
        for i, slot in enumerate(c.edges):
            url = slot.base_url + "/v1/chat/completions"
            for model in (MODEL, node_model("node-a"), node_model("node-b")):
                possible = may_serve(c, i, model, owners)
                for stream in (False, True):
                    body, expected = direct[stream]
                    request_id = f"a-{slot.name}-{model}-{'stream' if stream else 'whole'}"
                    status, headers, relayed = post_raw(url, dict(body, model=model),
                                                        headers={"authorization": "Bearer sk-app",
                                                                 "x-request-id": request_id})
                    assert status == 200, (slot.name, model, relayed)
                    assert ids_out(relayed) == expected, (slot.name, model, stream, relayed)
                    headers = {k.lower(): v for k, v in headers.items()}
                    assert headers["x-request-id"] == request_id
                    if stream:
                        assert headers["content-type"] == "text/event-stream"
                    at = routed_to(c, i, request_id)
                    assert at in possible, (slot.name, model, names[at], possible)
                    if at != i:
                        forwarded[(i, at)] = forwarded.get((i, at), 0) + 1
                        peer_requests[at] += 1
                    sent.append((i, at, request_id))
        print(f"FORWARDED (entry, owner) -> requests: "
              f"{ {(names[e], names[o]): n for (e, o), n in forwarded.items()} }")
        # Every Edge forwarded something; every owner served a peer's request.
        assert {e for e, _ in forwarded} == {0, 1, 2}, forwarded
        assert {o for _, o in forwarded} == {c.index_of(e) for e in owners.values()}, forwarded

        # The access log: the entry Edge names where it forwarded, the
        # owner names the peer it came from, under the one request id.
        for entry, at, request_id in sent:
            line = c.access_line(entry, request_id)
            assert (line["status"], line["principal"], line["outcome"]) == ("200", "app", "completed"), line
            if at == entry:
                assert "forwarded_to" not in line and "peer" not in line, line
                assert line["node"] in model_nodes(c, line["model"]), line
            else:
                assert line["forwarded_to"] == names[at] and "peer" not in line, line
                owner_line = c.access_line(at, request_id)
                assert owner_line["peer"] == names[entry] and "forwarded_to" not in owner_line, owner_line
                assert (owner_line["status"], owner_line["principal"], owner_line["outcome"]) == ("200", "app", "completed"), owner_line
                assert owner_line["node"] in model_nodes(c, owner_line["model"]), owner_line

        # /metrics: forwards counted at the entry Edge by target, peer
        # requests at the owner, exactly.
        for i in range(len(c.edges)):
            metrics = c.metrics(i)
            for j in range(len(c.edges)):
                n = forwarded.get((i, j), 0)
                series = f'iop_edge_cluster_forwarded_total{{edge="{names[j]}",outcome="ok"}}'
                if n:
                    assert f"{series} {n}\n" in metrics, (names[i], metrics)
                else:
                    assert series not in metrics, (names[i], metrics)
            assert [line for line in metrics.splitlines() if line.startswith("iop_edge_cluster_forwarded_total{")] \
                == sorted(f'iop_edge_cluster_forwarded_total{{edge="{names[j]}",outcome="ok"}} {n}'
                          for (e, j), n in forwarded.items() if e == i), (names[i], metrics)
            assert f"iop_edge_cluster_peer_requests_total {peer_requests[i]}\n" in metrics, (names[i], metrics)


# ---------------------------------------------------------------------------
# (b) an Edge killed under load
# ---------------------------------------------------------------------------

def test_killed_edge_nodes_rehome_and_only_streams_through_it_fail():
    with EdgeCluster(mock_args=MOCK) as c:
        owners = c.spread_nodes()
        names = [s.name for s in c.edges]
        victim_name = owners["node-a"]
        victim = c.index_of(victim_name)
        survivors = [i for i in c.live() if i != victim]
        orphans = sorted(n for n, e in owners.items() if e == victim_name)
        expected = c.direct(LOAD_BODY)
        long_expected = ids_out(c.direct(LONG_BODY))

        # The load goes through every ready Edge.
        with StreamLoad(c, LOAD_BODY, expected, threads=4) as load:
            wait_until(lambda: min(ok_count(load, {0, 1, 2}).values()) >= 2, timeout_s=30,
                       what="load flowing through every Edge")
            # Streams certainly in flight when the victim dies: through
            # every Edge, for every model. Each fails exactly when it
            # passes through the victim: entered there, or was forwarded
            # there.
            held = []
            for i in range(len(c.edges)):
                for model in (MODEL, node_model("node-a"), node_model("node-b")):
                    request_id = f"held-{names[i]}-{model}"
                    stream = OpenStream(c, i, dict(LONG_BODY, model=model), headers={"x-request-id": request_id})
                    held.append((i, request_id, stream))
            killed_at = c.kill_edge(victim)
            held_ends = []
            for i, request_id, stream in held:
                body, error = stream.finish()
                # Where it went, from the entry's access line (the victim
                # logs nothing more: its own are cut there).
                at = victim if i == victim else routed_to(c, i, request_id)
                held_ends.append((i, at, request_id, body, error))
            wait_until(lambda: c.rehomed(orphans, survivors) is not None, timeout_s=REHOME_BOUND_S,
                       interval_s=0.05, what="the victim's nodes owned by survivors and ready")
            rehomed_at = time.monotonic()
            log_timing("kill -9 -> its nodes owned by survivors and ready", rehomed_at - killed_at)
            assert rehomed_at - killed_at <= REHOME_BOUND_S
            # Every survivor agrees, and the victim leaves the member list
            # when its lease expires.
            new_owners = c.wait_settled(timeout_s=REHOME_BOUND_S, live=survivors)
            log_timing("kill -9 -> every survivor's view settled (victim's lease expired)",
                       time.monotonic() - killed_at)
            for n in orphans:
                assert new_owners[n] != victim_name, new_owners
            # Survivors' nodes stay where they were.
            for n, e in owners.items():
                if e != victim_name:
                    assert new_owners[n] == e, (owners, new_owners)
            wait_until(lambda: min(ok_count(load, set(survivors), since=rehomed_at).values()) >= 2, timeout_s=30,
                       what="load flowing through every survivor")
        outcomes = load.snapshot()

        # The held streams: those through the victim broke off short of
        # the mock's bytes; a survivor that had forwarded one to the victim
        # ended it with the node_disconnected error event; every other one
        # is the mock's whole stream.
        for i, at, request_id, body, error in held_ends:
            what = (names[i], names[at], request_id, repr(error), body[-300:])
            if i == victim:
                # Cut with the victim's connection.
                assert ids_out(body) != long_expected, what
                assert error is not None or not body.endswith(b"data: [DONE]\n\n"), what
            elif at == victim:
                # The survivor ends the event stream with the error event
                # of a lost node.
                assert ids_out(body) != long_expected and error is None, what
                assert b'"code":"node_disconnected"' in body and body.endswith(b"data: [DONE]\n\n"), what
                assert c.access_line(i, request_id)["forwarded_to"] == victim_name
            else:
                assert error is None and ids_out(body) == long_expected, what
        print("HELD " + "; ".join(f"{names[i]}->{names[at]}: {'cut' if victim in (i, at) else 'whole'}"
                                  for i, at, *_ in held_ends))

        # The load: every request that failed passed through the victim
        # after it died: sent to it, or forwarded to it by a survivor while
        # in flight at the kill.
        def through_victim(o) -> str | None:
            if o.edge == victim:
                return "entered at the victim" if o.ended_at >= killed_at else None
            if forwarded_to(c, o) == victim_name and o.sent_at <= killed_at:
                return f"entered at {names[o.edge]}, forwarded to the victim"
            return None

        failed = [o for o in outcomes if o.kind != "ok"]
        why = {o.request_id: through_victim(o) for o in failed}
        print(f"LOAD {len(outcomes)} requests: {sum(o.kind == 'ok' for o in outcomes)} ok; failed: "
              + (", ".join(f"{o.request_id} {o.kind} ({why[o.request_id]})" for o in failed) or "none"))
        stray = [o for o in failed if why[o.request_id] is None]
        assert not stray, describe(stray) + "\nforwarded to: " + str([forwarded_to(c, o) for o in stray])
        # The victim's requests that ended before the kill succeeded, and
        # every survivor answered after the kill.
        before = [o for o in outcomes if o.edge == victim and o.ended_at < killed_at]
        assert before and all(o.kind == "ok" for o in before), describe(before)
        for i in survivors:
            assert any(o.edge == i and o.kind == "ok" and o.sent_at > killed_at for o in outcomes), names[i]

        # Nothing leaked: every surviving Edge's providers are idle, and
        # the mock streams nothing for the runs that died with the victim.
        def idle():
            for i in survivors:
                for p in c.status(i)["providers"]:
                    if p["in_flight"] != 0 or p["queued"] != 0:
                        return False
            return c.mock_stats()["active_streams"] == 0

        wait_until(idle, timeout_s=15, what="providers idle on every survivor")
        for i in survivors:
            assert "iop_edge_cluster_self_fences_total 0\n" in c.metrics(i)


# ---------------------------------------------------------------------------
# (c) an Edge that loses its etcd member fences itself before its lease ends
# ---------------------------------------------------------------------------

def test_edge_cut_from_etcd_fences_before_its_lease_expires():
    with EdgeCluster(etcd_size=3, etcd_of="own", mock_args=MOCK,
                     lease_ttl_sec=TTL_S, keepalive_interval_sec=KEEPALIVE_S) as c:
        owners = c.spread_nodes()
        victim_name = owners["node-a"]
        victim = c.index_of(victim_name)
        member = c.edges[victim].etcd_members[0]
        others = [i for i in c.live() if i != victim]
        watcher = next(m for m in range(3) if m != member)
        # Losing the Raft leader would stall every Edge's keep-alives for
        # an election; this test is about the one Edge cut off.
        if c.etcd.leader() == member:
            c.etcd.move_leader(watcher)
        edge_key = f"/iop/{CLUSTER_NAME}/edges/{victim_name}"
        assert c.etcd.get(edge_key, member=watcher) is not None

        # When the victim's lease ends on the server: its edge key goes.
        gone = {}

        def watch_key():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if c.etcd.get(edge_key, member=watcher) is None:
                        gone["at"] = time.monotonic()
                        return
                except OSError:
                    pass
                time.sleep(0.02)

        stopped_at = time.monotonic()
        c.etcd.stop_member(member)
        key_watch = threading.Thread(target=watch_key, daemon=True)
        key_watch.start()

        wait_until(lambda: c.readyz(victim) == (503, "cluster store unreachable\n"), timeout_s=15,
                   interval_s=0.02, what="the cut-off Edge's /readyz at 503")
        unready_at = time.monotonic()
        proc = c.edges[victim].proc
        wait_until(lambda: proc.first_line(FENCE_LINE, since=stopped_at) is not None, timeout_s=15,
                   what="the fence line")
        fenced_at, _ = proc.first_line(FENCE_LINE, since=stopped_at)
        key_watch.join(timeout=30)
        assert "at" in gone, "the victim's edge key never expired"
        log_timing("member stop -> fence line", fenced_at - stopped_at)
        log_timing("member stop -> /readyz 503 seen", unready_at - stopped_at)
        log_timing("member stop -> lease expired on the server (edge key gone)", gone["at"] - stopped_at)
        # The last acknowledged keep-alive came before the stop, so a fence
        # at TTL - interval after it is within TTL of the stop, and before
        # the server lets the lease (and the keys on it) go.
        assert fenced_at - stopped_at <= TTL_S
        assert fenced_at < gone["at"]

        # The victim closed its node connections as ownership_lost, at the
        # fence; the node saw that reason.
        closed = proc.first_line("reason=ownership_lost", since=stopped_at)
        assert closed is not None and "node connection closed" in closed[1], proc.log()
        assert fenced_at <= closed[0] < gone["at"]
        node_saw = c.nodes["node-a"].first_line("reason=peer:ownership_lost", since=stopped_at)
        assert node_saw is not None, c.nodes["node-a"].log()
        # The fenced nodes move to Edges that hold their leases.
        orphans = sorted(n for n, e in owners.items() if e == victim_name)
        wait_until(lambda: c.rehomed(orphans, others) is not None, timeout_s=REHOME_BOUND_S, interval_s=0.05,
                   what="the fenced nodes owned elsewhere and ready")
        log_timing("member stop -> fenced nodes owned elsewhere and ready", time.monotonic() - stopped_at)
        new_owners = c.wait_settled(timeout_s=REHOME_BOUND_S, live=others)
        assert new_owners["node-a"] != victim_name
        assert "iop_edge_cluster_up 0\n" in c.metrics(victim)
        assert "iop_edge_cluster_self_fences_total 1\n" in c.metrics(victim)
        for i in others:
            assert "iop_edge_cluster_self_fences_total 0\n" in c.metrics(i)
        # Nothing of the victim's node connections is left on it.
        assert not any(p["connected"] for p in c.status(victim)["providers"])

        # The member comes back: the Edge takes a lease again and is ready.
        c.etcd.start_member(member)
        wait_until(lambda: c.readyz(victim) == (200, "ok\n"), timeout_s=20, what="/readyz 200 again")
        c.wait_settled()


# ---------------------------------------------------------------------------
# (d) a key's concurrency limit holds across the Edges
# ---------------------------------------------------------------------------

# Streams of 2000 tokens 20 ms apart (40 s): a held request keeps its slot
# until its client leaves, which the Edge sees at the next token it cannot
# write. (A client leaving a stream that sends nothing is not seen until
# something is written.)
HOLD_MOCK = ["--tokens", "2000", "--inter-token-ms", "20"]
HELD_BODY = {"model": MODEL, "stream": True, "messages": MESSAGES}


def try_stream(c: EdgeCluster, edge: int, key: str) -> tuple[OpenStream | None, tuple[int, dict, dict]]:
    """A held stream of `key` through `edge` if admitted, else None and the
    refusal (status, headers, JSON body)."""
    stream = OpenStream(c, edge, HELD_BODY, headers={"authorization": f"Bearer {key}"}, refusable=True)
    if stream.refusal is not None:
        return None, stream.refusal
    return stream, (200, {}, {})


def assert_concurrency_refused(c: EdgeCluster, edge: int, key: str, message: str):
    stream, (status, headers, body) = try_stream(c, edge, key)
    assert stream is None, f"{c.edges[edge].name} admitted one more for {key}"
    assert status == 429 and headers["retry-after"] == "1", (c.edges[edge].name, status, headers, body)
    assert body["error"]["code"] == "rate_limit_concurrency", body
    assert body["error"]["message"] == message, body


def test_a_keys_concurrency_limit_holds_across_edges():
    keys = {"ops": {"key": "sk-ops", "scopes": ["admin"]},
            "three": {"key": "sk-three", "max_concurrent": 3},
            "two": {"key": "sk-two", "max_concurrent": 2}}
    with EdgeCluster(mock_args=HOLD_MOCK, client_keys=keys, admin_principal="ops") as c:
        owners = c.wait_settled()
        names = [s.name for s in c.edges]
        owning = sorted({c.index_of(e) for e in owners.values()})
        # Owning Edges first: a stream another Edge forwards to one of them
        # then meets that Edge's own slot in use (it is charged where it
        # entered only).
        order = owning + [i for i in range(3) if i not in owning]
        routes = {i: served_at(c, i, MODEL, owners) for i in order}
        print("ROUTES " + ", ".join(f"{names[i]}->{names[at]}" for i, at in routes.items()))
        assert any(at != i for i, at in routes.items()), routes

        # max_concurrent = 3 over 3 Edges: one slot each.
        held = {}
        for i in order:
            stream, refusal = try_stream(c, i, "sk-three")
            assert stream is not None, (names[i], refusal)
            held[i] = stream
        at_most_one = "rate limit reached: at most 1 requests in flight for this key"
        for i in range(3):
            assert_concurrency_refused(c, i, "sk-three", at_most_one)
        # Three in flight in the cluster, each counted once.
        wait_until(lambda: sum(p["in_flight"] for i in range(3) for p in c.status(i)["providers"]) == 3,
                   timeout_s=10, what="three runs in flight")
        # One ends (its client leaves) at an Edge that forwarded it: that
        # Edge admits one again; the others still refuse.
        freed = next(i for i in reversed(order) if routes[i] != i)
        held.pop(freed).close()
        box = {}

        def admitted():
            box["stream"], box["refusal"] = try_stream(c, freed, "sk-three")
            return box["stream"] is not None

        wait_until(admitted, timeout_s=15, interval_s=0.2, what=f"{names[freed]} admitting again")
        held[freed] = box["stream"]
        for i in range(3):
            assert_concurrency_refused(c, i, "sk-three", at_most_one)

        # max_concurrent = 2 over 3 Edges: e1 and e2 one slot each, e3 none.
        assert names == ["e1", "e2", "e3"]
        share_zero = ("rate limit reached: this key's concurrency limit is shared by the cluster's 3 edges and "
                      "this edge's share is 0; send this key's requests to another edge")
        assert_concurrency_refused(c, 2, "sk-two", share_zero)
        two = []
        for i in (0, 1):
            stream, refusal = try_stream(c, i, "sk-two")
            assert stream is not None, (names[i], refusal)
            two.append(stream)
        for i in (0, 1):
            assert_concurrency_refused(c, i, "sk-two", at_most_one)
        assert_concurrency_refused(c, 2, "sk-two", share_zero)

        # Every client leaves: nothing stays in flight anywhere.
        for stream in list(held.values()) + two:
            stream.close()
        wait_until(lambda: all(p["in_flight"] == 0 and p["queued"] == 0
                               for i in range(3) for p in c.status(i)["providers"])
                   and c.mock_stats()["active_streams"] == 0,
                   timeout_s=15, what="nothing in flight")
        for i in range(3):
            stream, refusal = try_stream(c, i, "sk-three")
            assert stream is not None, (names[i], refusal)
            stream.close()


# ---------------------------------------------------------------------------
# (e) rolling restart under load
# ---------------------------------------------------------------------------

def test_rolling_restart_cuts_no_stream():
    with EdgeCluster(mock_args=MOCK, edge_extra=["drain_grace_ms = 20000"]) as c:
        c.spread_nodes()
        names = [s.name for s in c.edges]
        expected = c.direct(LOAD_BODY)
        long_expected = ids_out(c.direct(LONG_BODY))
        windows: dict[int, tuple[float, float]] = {}
        held_routes = []
        retry_failures = []
        # The load, the held stream, the kept-alive probe and the retry go
        # through every Edge.
        with StreamLoad(c, LOAD_BODY, expected, threads=3) as load:
            wait_until(lambda: len([o for o in load.snapshot() if o.kind == "ok"]) >= 4, timeout_s=30,
                       what="load flowing")
            for i, slot in enumerate(c.edges):
                owners = c.owners()
                held_routes.append((names[i], names[served_at(c, i, MODEL, owners)]))
                holder = OpenStream(c, i, LONG_BODY)
                kept = http.client.HTTPConnection(slot.client_addr, timeout=10)
                kept.request("GET", "/readyz")
                first = kept.getresponse()
                assert (first.status, first.read()) == (200, b"ok\n")
                term_at = c.term_edge(i)
                proc = slot.proc
                wait_until(lambda: proc.first_line(DRAIN_LINE, since=term_at) is not None, timeout_s=10,
                           what="the drain begun")
                # A new request on the kept-alive connection: refused.
                kept.request("POST", "/v1/chat/completions", body=json.dumps(LOAD_BODY),
                             headers={"content-type": "application/json"})
                refused = kept.getresponse()
                refused_body = json.loads(refused.read())
                kept.close()
                assert refused.status == 503, refused_body
                assert refused.getheader("retry-after") == "1"
                assert refused_body["error"]["code"] == "shutting_down", refused_body
                # Retried on another Edge (the next one), it succeeds — as a
                # client retries, honouring retry-after: while the draining
                # Edge still owns every node of the model, the other Edge
                # answers 503 peer_unavailable with retry-after until one of
                # them re-homes (the draining Edge lets go of a node as soon
                # as nothing runs on it).
                other = (i + 1) % len(c.edges)
                for attempt in range(RETRIES_AFTER_DRAIN):
                    retried = send_stream(c.edges[other], other, json.dumps(LOAD_BODY).encode(), ids_out(expected),
                                          30, request_id=f"retry-{slot.name}-{attempt}")
                    if retried.kind != "refused" or retried.retry_after is None:
                        break
                    time.sleep(float(retried.retry_after))
                if retried.kind != "ok":
                    entry_line = c.access_line(other, retried.request_id, timeout_s=5)
                    target = entry_line.get("forwarded_to")
                    owner_line = c.access_line(c.index_of(target), retried.request_id, timeout_s=5) if target else None
                    retry_failures.append((describe([retried]), entry_line, owner_line))
                # The stream in flight at the SIGTERM completes.
                body, error = holder.finish()
                assert error is None and ids_out(body) == long_expected, (error, body[-200:])
                code = slot.proc.wait(30)
                assert code == 0, slot.proc.log()
                left = slot.proc.first_line("cluster: left (lease revoked)", since=term_at)
                assert left is not None, slot.proc.log()
                log_timing(f"{slot.name}: SIGTERM -> drained and left the cluster", left[0] - term_at)
                c.start_edge(i)
                c.wait_settled(timeout_s=REHOME_BOUND_S)
                windows[i] = (term_at, time.monotonic())
                log_timing(f"{slot.name}: SIGTERM -> restarted and every node owned and ready",
                           windows[i][1] - term_at)
        outcomes = load.snapshot()
        across = [o for o in outcomes if o.headers_at is not None and o.headers_at < windows[o.edge][0] < o.ended_at]
        print(f"LOAD {len(outcomes)} requests: {sum(o.kind == 'ok' for o in outcomes)} ok, "
              f"{sum(o.kind == 'refused' for o in outcomes)} refused; {len(across)} streaming across a SIGTERM "
              f"(+{len(held_routes)} held streams: {held_routes})")
        assert len([o for o in outcomes if o.kind == "ok"]) >= 10

        # A request was refused (connection refused, or 503 with
        # retry-after) only by an Edge in its restart: it entered there,
        # or it was forwarded there, or (503 peer_unavailable) the Edge it
        # entered could reach no owner of the model while one restarted.
        def in_restart(o) -> str | None:
            for j, (begun, done) in windows.items():
                if o.ended_at >= begun and o.sent_at <= done:
                    if o.edge == j:
                        return f"entered at {names[j]} in its restart"
                    if o.status is not None and forwarded_to(c, o) == names[j]:
                        return f"entered at {names[o.edge]}, forwarded to {names[j]} in its restart: {o.detail[:60]}"
                    if o.status == 503 and '"code":"peer_unavailable"' in o.detail:
                        return f"entered at {names[o.edge]}, no owner reachable while {names[j]} restarted"
            return None

        not_ok = [o for o in outcomes if o.kind != "ok"]
        why = {o.request_id: in_restart(o) for o in not_ok}
        print("NOT OK: " + (", ".join(f"{o.request_id} {o.kind} {o.status} ({why[o.request_id]})" for o in not_ok)
                            or "none"))
        # Nothing leaked on any Edge.
        wait_until(lambda: all(p["in_flight"] == 0 and p["queued"] == 0
                               for i in c.live() for p in c.status(i)["providers"]),
                   timeout_s=15, what="providers idle on every Edge")
        problems = []
        # Every request refused by a draining Edge succeeded when retried
        # on another Edge.
        problems += [f"retry not answered: {o}\n  entry: {e}\n  owner: {w}" for o, e, w in retry_failures]
        # No request was cut or failed.
        bad = [o for o in outcomes if o.kind in ("cut", "error")]
        problems += [f"cut or failed: {describe([o])}" for o in bad]
        stray = [o for o in not_ok if why[o.request_id] is None]
        problems += [f"refused outside a restart: {describe([o])} (forwarded to {forwarded_to(c, o)})" for o in stray]
        assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# etcd down: every Edge fences; etcd back: every Edge ready, nodes owned
# ---------------------------------------------------------------------------

def test_etcd_down_fences_every_edge_until_it_returns():
    with EdgeCluster(mock_args=MOCK) as c:
        owners = c.wait_settled()
        stopped_at = time.monotonic()
        c.etcd.stop_member(0)
        for i in range(len(c.edges)):
            wait_until(lambda: c.readyz(i) == (503, "cluster store unreachable\n"), timeout_s=15,
                       what=f"{c.edges[i].name}'s /readyz at 503")
        for i, slot in enumerate(c.edges):
            fence = slot.proc.first_line(FENCE_LINE, since=stopped_at)
            assert fence is not None, slot.proc.log()
            log_timing(f"etcd stop -> {slot.name} fenced", fence[0] - stopped_at)
            assert fence[0] - stopped_at <= TTL_S
            # No Edge holds a node: nothing is dispatched anywhere.
            assert not any(p["connected"] for p in c.status(i)["providers"]), c.describe()
            assert c.status(i)["cluster"]["up"] is False
        for node_id in owners:
            assert c.nodes[node_id].first_line("reason=peer:ownership_lost", since=stopped_at) is not None

        restarted_at = time.monotonic()
        c.etcd.start_member(0)
        for i in range(len(c.edges)):
            wait_until(lambda: c.readyz(i) == (200, "ok\n"), timeout_s=20, what=f"{c.edges[i].name} ready")
        c.wait_settled(timeout_s=REHOME_BOUND_S)
        log_timing("etcd back -> every Edge ready, every node owned and ready", time.monotonic() - restarted_at)
        # Every Edge answers again (forwarding where it owns no node).
        expected = ids_out(c.direct(LOAD_BODY))
        for slot in c.edges:
            status, _, relayed = post_raw(slot.base_url + "/v1/chat/completions", LOAD_BODY)
            assert status == 200 and ids_out(relayed) == expected, (slot.name, relayed)


def test_a_fleet_reloaded_at_one_edge_reaches_every_edge_and_a_restarted_one():
    """SIGHUP at e1 with a model added to its file: e1 publishes the fleet
    to etcd (`/iop/<cluster>/fleet`, docs/multi-edge.md); e2 and e3 list
    and serve the model without a reload of their own, all three at the
    put's fleet revision; e3 restarted with its original file applies the
    published fleet."""
    with EdgeCluster(mock_args=MOCK) as c:
        c.wait_settled()

        def fleet(i: int) -> dict:
            return c.status(i)["cluster"]["fleet"]

        def models(i: int) -> list[str]:
            listed = http_json(c.edges[i].base_url + "/v1/models", headers=c.auth_headers())
            return [m["id"] for m in listed["data"]]

        wait_until(lambda: len({fleet(i)["revision"] for i in range(3)}) == 1 and fleet(0)["revision"] > 0,
                   timeout_s=20, what="every Edge at the fleet published at start")
        before = fleet(0)["revision"]
        original = models(0)
        assert "fleet-added" not in original

        path = c.dir / "edge-e1.toml"
        path.write_text(path.read_text() + '[[models]]\nname = "fleet-added"\nproviders = ["node-a/mock-1"]\n')
        c.edges[0].proc.send(signal.SIGHUP)
        for i in range(3):
            wait_until(lambda: models(i) == original + ["fleet-added"], timeout_s=20,
                       what=f"{c.edges[i].name} lists the model added at e1")
        wait_until(lambda: len({fleet(i)["revision"] for i in range(3)}) == 1, timeout_s=20,
                   what="every Edge at one fleet revision")
        published = fleet(1)
        assert published["revision"] > before and published["source"] == "e1", published
        key = c.etcd.get(f"/iop/{CLUSTER_NAME}/fleet")
        assert key["mod_revision"] == published["revision"] and key["lease"] is None, key
        document = json.loads(key["value"])
        assert document["source"] == "e1" and document["digest"] == published["digest"], document
        assert [fleet(i)["file_differs"] for i in range(3)] == [False, True, True]
        for slot in c.edges:
            status, _, body = post_raw(slot.base_url + "/v1/chat/completions", dict(LOAD_BODY, model="fleet-added"))
            assert status == 200, (slot.name, body)

        # e3 restarted: its file (rewritten as it started) lacks the model.
        c.restart_edge(2)
        wait_until(lambda: models(2) == original + ["fleet-added"], timeout_s=20,
                   what="the restarted e3 applies the published fleet")
        assert fleet(2)["revision"] == published["revision"] and fleet(2)["file_differs"] is True
        assert c.edges[2].proc.first_line("this Edge's file says another fleet than the cluster's") is not None
        assert fleet(0)["revision"] == published["revision"]
