"""The documented Ollama + vLLM example config runs as written.

`examples/edge-ollama-vllm.toml` (quoted in docs/providers.md, which the
first test checks) is started unchanged
except for its listen ports and the two provider addresses, which point at
one mock that speaks both Ollama's and the OpenAI-compatible API; two Nodes
with the example's ids connect, and the official SDK is served through both.

CONTRACT: U7 — the example's mixed model is served by an Ollama and a vLLM
provider with one client surface.
"""

import re
import subprocess
import tempfile
import tomllib
from pathlib import Path

import openai
import pytest

from iop_harness import BIN_DIR, start, wait_until, http_json

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "edge-ollama-vllm.toml"
PROVIDERS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "providers.md"
NODES = ("gpu-ollama", "gpu-vllm")
TEXT = "tok0 tok1 tok2 "


def _node_config(node_id: str, edge_nodes_addr: str) -> str:
    return "\n".join([
        f'node_id = "{node_id}"',
        'trust_domain = "iop.local"',
        f'edge_addr = "{edge_nodes_addr}"',
        'edge_name = "edge-1"',
        "[tls]",
        'ca = "certs/ca.pem"',
        f'cert = "certs/node-{node_id}.pem"',
        f'key = "certs/node-{node_id}-key.pem"',
        "[reconnect]",
        "interval_sec = 1",
        "max_attempts = 0",
    ]) + "\n"


def _entry(entries: list[dict], key: str, value: str) -> dict:
    found = [e for e in entries if e.get(key) == value]
    assert len(found) == 1, f"{key} = {value!r}: {len(found)} entries in {EXAMPLE.name}"
    return found[0]


def _quoted(part: dict, whole: dict, where: str) -> None:
    """Every key of the page's table has the example's value."""
    for key, value in part.items():
        assert whole.get(key) == value, f"{where}.{key}: page {value!r}, example {whole.get(key)!r}"


def test_the_providers_page_quotes_the_example():
    """Each TOML block of docs/providers.md is an excerpt of the example:
    every node, adapter, provider and model it shows is the example's,
    key for key, and the page links to the file."""
    page = PROVIDERS_PAGE.read_text()
    assert "](../examples/edge-ollama-vllm.toml)" in page
    example = tomllib.loads(EXAMPLE.read_text())
    blocks = [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", page, re.DOTALL)]
    shown = []
    for block in blocks:
        assert set(block) <= {"nodes", "models"}, sorted(block)
        for node in block.get("nodes", []):
            whole = _entry(example["nodes"], "id", node["id"])
            for adapter in node.get("adapters", []):
                _quoted(adapter, _entry(whole["adapters"], "name", adapter["name"]), f"{node['id']}.adapters")
            for provider in node.get("providers", []):
                _quoted(provider, _entry(whole["providers"], "id", provider["id"]), f"{node['id']}.providers")
            shown.append(node["id"])
        for model in block.get("models", []):
            _quoted(model, _entry(example["models"], "name", model["name"]), "models")
            shown.append(model["name"])
    assert shown == ["gpu-ollama", "gpu-vllm", "llama-3.1-8b"], shown


def test_ollama_vllm_example_serves_both_paths():
    # CONTRACT: U7
    work = Path(tempfile.mkdtemp(prefix="iop-example-"))
    subprocess.run(
        [str(BIN_DIR / "edge-bin"), "certs", "--out", str(work / "certs"), "--trust-domain", "iop.local",
         "--edge-name", "edge-1"] + sum((["--node", n] for n in NODES), []),
        check=True, capture_output=True, text=True,
    )
    procs = []
    try:
        mock = start("mock", [str(BIN_DIR / "bench"), "mock-provider", "--port", "0", "--tokens", "3",
                              "--model-list", "llama3.1:8b,qwen2.5:7b,meta-llama/Llama-3.1-8B-Instruct"])
        procs.append(mock)
        addr = mock.ready["addr"]
        text = EXAMPLE.read_text()
        for old, new in [('client_listen = "127.0.0.1:8080"', 'client_listen = "127.0.0.1:0"'),
                         ('node_listen = "127.0.0.1:7443"', 'node_listen = "127.0.0.1:0"'),
                         ('"http://127.0.0.1:11434"', f'"http://{addr}"'),
                         ('"http://127.0.0.1:8000"', f'"http://{addr}"')]:
            assert old in text, old
            text = text.replace(old, new)
        (work / "edge.toml").write_text(text)
        edge = start("edge", [str(BIN_DIR / "edge-bin"), "--config", str(work / "edge.toml")])
        procs.append(edge)
        base = f"http://{edge.ready['client']}"
        for node_id in NODES:
            path = work / f"{node_id}.toml"
            path.write_text(_node_config(node_id, edge.ready["nodes"]))
            procs.append(start(node_id, [str(BIN_DIR / "node-bin"), "--config", str(path), "--cores", "0"],
                               wait_ready=False))

        def connected():
            providers = http_json(base + "/status")["providers"]
            return all(p["connected"] for p in providers)

        wait_until(connected, what="both example nodes connected")
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=20)
        assert [m.id for m in client.models.list().data] == ["llama-3.1-8b", "qwen2.5-7b"]
        messages = [{"role": "user", "content": "hi"}]
        for model in ("llama-3.1-8b", "qwen2.5-7b"):
            r = client.chat.completions.create(model=model, messages=messages)
            assert r.choices[0].message.content == TEXT
            streamed = "".join(c.choices[0].delta.content or ""
                               for c in client.chat.completions.create(model=model, messages=messages, stream=True)
                               if c.choices)
            assert streamed == TEXT
        # /v1/responses needs an OpenAI-compatible provider: the vLLM host
        # (first in the mixed pool) serves it; the Ollama-only model cannot.
        r = client.responses.create(model="llama-3.1-8b", input="hi")
        assert r.output_text == TEXT
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="qwen2.5-7b", input="hi")
        stats = http_json(f"http://{addr}/admin/stats")
        assert stats["ollama_chat_requests"] >= 2, "qwen2.5-7b ran on the Ollama host"
        assert stats["responses_requests"] == 1
    finally:
        for p in reversed(procs):
            p.stop()
