"""Cache-aware routing through a real Edge and Nodes: two mock providers,
each with a prefix cache of its own (one per Node, as two GPU hosts).

- `prefix` (the default for the two-provider model): a conversation's
  turns land on the provider that served its first turn (even where
  least_loaded would pick the other), whose cache then covers the repeated
  history; when that provider is ejected, the next turn fails over to the
  other provider and succeeds, and the turns after it stay there.
- `session`: requests naming a session (`prompt_cache_key`) stay on one
  provider each.
"""

import http.client
import json
import threading

from iop_harness import BIN_DIR, Cluster, http_json, start, wait_until

MODEL = "iop-test-model"
SESSION_MODEL = "iop-session-model"
TOKENS = 4
REPLY = "".join(f"tok{i} " for i in range(TOKENS))
# The mock's cache holds far more than one conversation; every prompt token
# not cached costs prefill time (a 20,000-word prompt holds its provider
# for 2 s).
MOCK_ARGS = ["--tokens", str(TOKENS), "--prefix-cache-tokens", "100000", "--prefill-us-per-token", "100"]
LONG_PROMPT = " ".join(f"w{i}" for i in range(20_000))
SYSTEM = ("You are a careful assistant who answers in full sentences and cites the "
          "passages of the conversation it relies on. ") * 4


class TwoCaches(Cluster):
    """node-a's adapter calls one mock, node-b's another; passive health
    ejects a provider at its first failure; a second model routes by
    session."""

    def _start(self):
        self.mock_b = start("mock-b", [str(BIN_DIR / "bench"), "mock-provider", "--port", "0"] + self.mock_args)
        self.procs.append(self.mock_b)
        super()._start()

    def edge_config(self, mock_addr: str) -> str:
        text = super().edge_config(mock_addr)
        head, sep, tail = text.partition('id = "node-b"')
        tail = tail.replace(f'base_url = "http://{mock_addr}"',
                            f'base_url = "http://{self.mock_b.ready["addr"]}"', 1)
        return (head + sep + tail
                + "[[models]]\n"
                + f'name = "{SESSION_MODEL}"\n'
                + 'providers = ["node-a/mock-1", "node-b/mock-1"]\n'
                + 'routing = "session"\n'
                + "[outlier_detection]\nconsecutive_failures = 1\n")

    def stats(self) -> dict:
        """Each mock's counters, by the node whose provider it is."""
        return {"node-a": self.mock_stats(),
                "node-b": http_json(f"http://{self.mock_b.ready['addr']}/admin/stats")}


def chat(cluster: Cluster, body: dict) -> tuple[int, dict]:
    host, port = cluster.edge.ready["client"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def turn(cluster: TwoCaches, messages: list, question: str) -> str:
    """One turn of a conversation: `question` after the history; the reply
    is appended to it. Returns the node whose mock served it."""
    messages.append({"role": "user", "content": question})
    before = cluster.stats()
    status, answer = chat(cluster, {"model": MODEL, "messages": messages})
    assert status == 200, answer
    reply = answer["choices"][0]["message"]["content"]
    assert reply == REPLY
    messages.append({"role": "assistant", "content": reply})
    after = cluster.stats()
    served = [n for n in after if after[n]["chat_requests"] > before[n]["chat_requests"]]
    assert len(served) == 1, (before, after)
    return served[0]


def model_routing(cluster: Cluster, model: str) -> dict:
    return next(m for m in cluster.status()["models"] if m["model"] == model)["routing"]


def test_a_conversation_stays_with_its_cache_and_moves_when_its_provider_is_ejected():
    with TwoCaches(node_ids=("node-a", "node-b"), mock_args=MOCK_ARGS, routing=None) as cluster:
        # A long prompt holds node-a (first in the pool) while the
        # conversation starts: its first turn goes to the idle node-b.
        held = {}
        holder = threading.Thread(target=lambda: held.update(result=chat(
            cluster, {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]})))
        holder.start()
        # The provider has it (its counters moved), not only the Edge's
        # lease: the turns below compare the mocks' counters.
        wait_until(lambda: cluster.provider("node-a", "mock-1")["in_flight"] == 1
                   and cluster.stats()["node-a"]["chat_requests"] == 1,
                   what="node-a holding the long prompt")
        messages = [{"role": "system", "content": SYSTEM}]
        assert turn(cluster, messages, "What is a prefix cache?") == "node-b"
        holder.join(timeout=30)
        assert held["result"][0] == 200, held
        # Both idle now: least_loaded would pick node-a (configured order);
        # the conversation's prefix is on node-b, and its turns go there.
        for question in ["Why does it help?", "And when does it not?", "Summarize."]:
            assert turn(cluster, messages, question) == "node-b"
        # node-b's cache covered the repeated history of the later turns.
        assert cluster.stats()["node-b"]["cached_tokens_hit"] > 0
        routing = model_routing(cluster, MODEL)
        assert routing["policy"] == "prefix"
        assert routing["routed_by_match"] == 3
        assert routing["routed_by_load"] == 2
        assert routing["tree_bytes"] > 0

        # node-b's mock goes away: the next turn goes there by its prefix,
        # fails before anything reached the client, fails over to node-a and
        # succeeds; the failure ejects node-b's provider, whose prefixes are
        # forgotten.
        node_a_before = cluster.stats()["node-a"]
        cluster.mock_b.stop()
        messages.append({"role": "user", "content": "Still there?"})
        status, answer = chat(cluster, {"model": MODEL, "messages": messages})
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == REPLY
        messages.append({"role": "assistant", "content": REPLY})
        assert cluster.provider("node-b", "mock-1")["outlier"]["ejected"]
        # The turns after it stay on node-a, which now holds the
        # conversation, and hit its cache.
        for question in ["One more.", "And the last."]:
            messages.append({"role": "user", "content": question})
            status, answer = chat(cluster, {"model": MODEL, "messages": messages})
            assert status == 200, answer
            assert answer["choices"][0]["message"]["content"] == REPLY
            messages.append({"role": "assistant", "content": REPLY})
        node_a = cluster.mock_stats()
        assert node_a["chat_requests"] == node_a_before["chat_requests"] + 3
        assert node_a["cached_tokens_hit"] > node_a_before["cached_tokens_hit"]


def test_requests_of_one_session_stay_on_one_provider():
    with TwoCaches(node_ids=("node-a", "node-b"), mock_args=MOCK_ARGS, routing=None) as cluster:
        homes = {}
        for key in [f"session-{i}" for i in range(8)]:
            for n in range(3):
                before = cluster.stats()
                status, answer = chat(cluster, {"model": SESSION_MODEL, "prompt_cache_key": key,
                                                "messages": [{"role": "user", "content": f"{key} turn {n}"}]})
                assert status == 200, answer
                after = cluster.stats()
                served = [x for x in after if after[x]["chat_requests"] > before[x]["chat_requests"]]
                assert len(served) == 1
                assert homes.setdefault(key, served[0]) == served[0], key
        # Eight sessions, hashed over two providers: both serve some.
        assert set(homes.values()) == {"node-a", "node-b"}, homes
        routing = model_routing(cluster, SESSION_MODEL)
        assert routing == {"policy": "session", "routed_by_load": 0, "routed_by_match": 0,
                           "routed_by_session": 24, "imbalance_fallbacks": 0,
                           "affinity_waits": 0, "affinity_waits_expired": 0,
                           "tree_bytes": 0, "tree_budget_bytes": 0}
