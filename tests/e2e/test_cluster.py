"""Several Edges of one cluster on a real etcd (`[cluster]`,
docs/multi-edge.md): real edge-bin, node-bin, bench mock-provider and etcd
processes on loopback (cluster_harness.py).

Requests go to Edges that own a node of the model (`/status` →
`cluster.nodes`): an Edge that owns none does not forward yet. Each test
names where it does so ("owning Edges only").

Timing: the Edges hold etcd leases of 4 s kept alive every 1 s (an Edge
that cannot prove its lease fences what it owns 3 s after its last
acknowledged keep-alive); the Nodes redial every 1 s ± 50 %.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

from cluster_harness import (CLUSTER_NAME, FENCE_LINE, MODEL, EdgeCluster, StreamLoad, http_json, ids_out,
                             send_stream, wait_until)
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


class OpenStream:
    """A streaming completion whose headers and first event were read; the
    rest is read by `finish`."""

    def __init__(self, cluster: EdgeCluster, edge: int, body: dict):
        self.conn = http.client.HTTPConnection(cluster.edges[edge].client_addr, timeout=30)
        self.conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                          headers={"content-type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.head = self.resp.read1(1)
        assert self.head, "no first byte"

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
# (own) one owner per node, the same view everywhere, byte-exact answers
# ---------------------------------------------------------------------------

def test_every_node_has_one_owner_and_owning_edges_answer_byte_exact():
    keys = {"ops": {"key": "sk-ops", "scopes": ["admin"]},
            "app": {"key": "sk-app", "max_concurrent": 6}}
    with EdgeCluster(mock_args=MOCK, client_keys=keys, admin_principal="ops") as c:
        owners = c.wait_settled()
        names = [s.name for s in c.edges]
        assert set(owners) == {"node-a", "node-b"} and set(owners.values()) <= set(names), owners
        for i, slot in enumerate(c.edges):
            doc = c.status(i)
            assert doc["cluster"] == {
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
            # A key that may not see the whole fleet gets no cluster object.
            app_view = http_json(slot.base_url + "/status", headers={"authorization": "Bearer sk-app"})
            assert "cluster" not in app_view

        # Owning Edges only: the mock's bytes, streamed and not.
        app = {"authorization": "Bearer sk-app"}
        for edge in sorted(set(owners.values())):
            url = c.edges[c.index_of(edge)].base_url + "/v1/chat/completions"
            for stream in (False, True):
                body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LOAD_TOKENS}
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                status, headers, relayed = post_raw(url, body, headers=app)
                assert status == 200, (edge, relayed)
                assert ids_out(relayed) == ids_out(c.direct(body)), (edge, stream, relayed)
                if stream:
                    assert {k.lower(): v for k, v in headers.items()}["content-type"] == "text/event-stream"


# ---------------------------------------------------------------------------
# (b) an Edge killed under load
# ---------------------------------------------------------------------------

def test_killed_edge_nodes_rehome_and_only_its_streams_fail():
    with EdgeCluster(mock_args=MOCK) as c:
        owners = c.spread_nodes()
        victim_name = owners["node-a"]
        victim = c.index_of(victim_name)
        survivors = [i for i in c.live() if i != victim]
        orphans = sorted(n for n, e in owners.items() if e == victim_name)
        owning_survivors = {c.index_of(e) for e in owners.values() if e != victim_name}
        assert owning_survivors, owners
        expected = c.direct(LOAD_BODY)
        long_expected = ids_out(c.direct(LONG_BODY))

        # Owning Edges only (the load's router).
        with StreamLoad(c, LOAD_BODY, expected, threads=4) as load:
            wait_until(lambda: min(ok_count(load, owning_survivors | {victim}).values()) >= 2, timeout_s=30,
                       what="load flowing through every owning Edge")
            # A stream certainly in flight through the victim when it dies.
            doomed = OpenStream(c, victim, LONG_BODY)
            killed_at = c.kill_edge(victim)
            doomed_body, doomed_error = doomed.finish()
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
            new_owning = {c.index_of(e) for e in new_owners.values()}
            wait_until(lambda: min(ok_count(load, new_owning, since=rehomed_at).values()) >= 2, timeout_s=30,
                       what="load flowing through the new owners")
        outcomes = load.snapshot()
        print(f"LOAD {len(outcomes)} requests: {sum(o.kind == 'ok' for o in outcomes)} ok, failed through the "
              f"victim: {sum(o.kind != 'ok' for o in outcomes)} "
              f"({', '.join(sorted({o.kind for o in outcomes if o.kind != 'ok'}))})")

        # The stream through the victim broke off short of the mock's bytes.
        assert ids_out(doomed_body) != long_expected
        assert doomed_error is not None or not doomed_body.endswith(b"data: [DONE]\n\n"), doomed_body[-200:]
        # Every request through a surviving Edge got the mock's bytes; the
        # victim's requests that ended before the kill too.
        through_survivors = [o for o in outcomes if o.edge != victim]
        assert through_survivors and all(o.kind == "ok" for o in through_survivors), \
            describe([o for o in through_survivors if o.kind != "ok"])
        before = [o for o in outcomes if o.edge == victim and o.ended_at < killed_at]
        assert before and all(o.kind == "ok" for o in before), describe(before)
        # What failed went through the victim, after it died.
        failed = [o for o in outcomes if o.kind != "ok"]
        assert all(o.edge == victim and o.ended_at >= killed_at for o in failed), describe(failed)

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
# (e) rolling restart under load
# ---------------------------------------------------------------------------

def test_rolling_restart_cuts_no_stream():
    with EdgeCluster(mock_args=MOCK, edge_extra=["drain_grace_ms = 20000"]) as c:
        c.spread_nodes()
        expected = c.direct(LOAD_BODY)
        long_expected = ids_out(c.direct(LONG_BODY))
        windows: dict[int, tuple[float, float]] = {}
        drain_checks = 0
        # Owning Edges only (the load's router, the kept-alive probe, the
        # retry).
        with StreamLoad(c, LOAD_BODY, expected, threads=3) as load:
            wait_until(lambda: len([o for o in load.snapshot() if o.kind == "ok"]) >= 4, timeout_s=30,
                       what="load flowing")
            for i, slot in enumerate(c.edges):
                owners = c.owners()
                owns = slot.name in owners.values()
                if owns:
                    holder = OpenStream(c, i, LONG_BODY)
                    kept = http.client.HTTPConnection(slot.client_addr, timeout=10)
                    kept.request("GET", "/readyz")
                    first = kept.getresponse()
                    assert (first.status, first.read()) == (200, b"ok\n")
                term_at = c.term_edge(i)
                if owns:
                    drain_checks += 1
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
                    # Retried on another owning Edge, it succeeds.
                    retried = {}

                    def retry_elsewhere():
                        others = {c.index_of(e) for e in c.owners().values()} - {i}
                        if not others:
                            return False
                        out = send_stream(c.edges[min(others)], min(others), json.dumps(LOAD_BODY).encode(),
                                          ids_out(expected), 30)
                        retried["outcome"] = out
                        return out.kind == "ok"

                    wait_until(retry_elsewhere, timeout_s=REHOME_BOUND_S, interval_s=0.2,
                               what="the refused request answered by another owning Edge")
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
              f"(+{drain_checks} held streams)")
        assert drain_checks >= 1
        assert len([o for o in outcomes if o.kind == "ok"]) >= 10
        # No request was cut or failed; a request was refused (connection
        # refused, or 503 with retry-after) only by an Edge in its restart.
        bad = [o for o in outcomes if o.kind in ("cut", "error")]
        assert not bad, describe(bad)
        stray = [o for o in outcomes if o.kind == "refused"
                 and not (o.ended_at >= windows[o.edge][0] and o.sent_at <= windows[o.edge][1])]
        assert not stray, describe(stray)
        # Nothing leaked on any Edge.
        wait_until(lambda: all(p["in_flight"] == 0 and p["queued"] == 0
                               for i in c.live() for p in c.status(i)["providers"]),
                   timeout_s=15, what="providers idle on every Edge")


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
        for edge in set(c.owners().values()):
            status, _, relayed = post_raw(c.edges[c.index_of(edge)].base_url + "/v1/chat/completions", LOAD_BODY)
            assert status == 200 and ids_out(relayed) == ids_out(c.direct(LOAD_BODY)), relayed
