"""`scripts/demo.sh` runs the whole system, uses the binaries of cargo's
target directory (CARGO_TARGET_DIR honoured) and keeps its logs after it
stops, saying where they are. `scripts/demo.sh --cluster` does the same with
three Edges of one cluster on an etcd and two Nodes that list every Edge,
streaming through every Edge (one that owns no node forwards to the owner).
"""

import os
import re
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from iop_harness import BIN_DIR, wait_until

REPO = Path(__file__).resolve().parents[2]


def run_demo(args: list[str], work: Path, while_running=None) -> tuple[str, str, int | None]:
    """Runs demo.sh with `args` until it says IOP is running, calls
    `while_running(output)` if given, then stops it with SIGINT. Returns
    (output while running, whole output, exit code)."""
    if BIN_DIR.name != "debug":
        pytest.skip(f"IOP_BIN_DIR {BIN_DIR} is not a cargo dev-profile directory")
    env = dict(os.environ, CARGO_TARGET_DIR=str(BIN_DIR.parent), IOP_DEMO_PROFILE="dev",
               IOP_DEMO_PORT="0", IOP_DEMO_DIR=str(work))
    # Ctrl-C as in a terminal: SIGINT at its default disposition when the
    # script starts. A suite started as a background job of a script (a CI
    # runner, `nohup … &`) has SIGINT ignored, children inherit that, and
    # bash cannot trap a signal ignored when it started.
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "demo.sh")] + args, cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    pump = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    pump.start()
    try:
        # The dev build is up to date when the suite runs; allow for a
        # rebuild on a loaded machine anyway.
        wait_until(lambda: any("IOP is running" in line for line in lines) or proc.poll() is not None,
                   timeout_s=600, interval_s=0.2, what="the demo running")
        running = "".join(lines)
        assert proc.poll() is None, running
        if while_running is not None:
            while_running(running)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # Still stop what it started (its TERM trap stops the children).
            proc.terminate()
            proc.wait(timeout=60)
            code = None
        pump.join(timeout=5)
    out = "".join(lines)
    assert code is not None, f"demo.sh did not stop within 60 s of SIGINT:\n{out}"
    return running, out, code


def test_demo_streams_and_keeps_its_logs():
    work = Path(tempfile.mkdtemp(prefix="iop-demo-test-")) / "demo"
    running, out, code = run_demo([], work)
    assert f"==> binaries from {BIN_DIR}\n" in running
    assert f"==> configs, certificates and logs in {work}\n" in running
    # The streamed completion of the mock (24 tokens) was printed.
    assert "tok0 tok1 tok2" in running and "tok23" in running, running
    assert code == 0, out
    assert out.endswith(f"==> stopped; logs kept in {work} (mock.log, edge.log, node.log)\n"), out
    for name in ("mock.log", "edge.log", "node.log"):
        assert (work / name).stat().st_size > 0, name
    assert "IOP_READY edge" in (work / "edge.log").read_text()


def test_cluster_demo_runs_three_edges_on_etcd():
    work = Path(tempfile.mkdtemp(prefix="iop-demo-cluster-test-")) / "demo"
    pids = {}

    def edge_processes(output: str):
        # The printed pid of each Edge is that Edge's edge-bin.
        for name, pid in re.findall(r"  (edge-[123])  client API \S+   \(owns: [^;]*; pid (\d+)\)\n", output):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            pids[name] = (Path(cmdline[0].decode()).name, cmdline[2].decode())

    running, out, code = run_demo(["--cluster"], work, edge_processes)
    assert pids == {name: ("edge-bin", str(work / f"{name}.toml")) for name in ("edge-1", "edge-2", "edge-3")}
    assert f"==> configs, certificates and logs in {work}\n" in running
    # Both nodes owned, each by one of the three Edges.
    owned = re.search(r"==> nodes owned: node-a=(edge-[123]) node-b=(edge-[123])\n", running)
    assert owned, running
    # A completion streamed through every Edge: the whole of the mock's
    # 24 tokens each time; an Edge owning no node forwarded it to the one
    # owning the most (ties: name order).
    streams = re.findall(r"==> streaming a chat completion through (edge-[123]) \((127\.0\.0\.1:\d+)\)"
                         r" → mTLS → node → provider\n\n(.*)\n"
                         r"(?:    \(edge-[123] owns no node of the model: forwarded to (edge-[123]) over the peer link\)\n)?",
                         running)
    streams = [(name, addr, forwarded_to, text) for name, addr, text, forwarded_to in streams]
    assert [s[0] for s in streams] == ["edge-1", "edge-2", "edge-3"], running
    whole = "".join(f"tok{i} " for i in range(24))
    for name, _, forwarded_to, text in streams:
        assert text == whole, (name, text)
        if name in owned.groups():
            assert forwarded_to == "", (name, forwarded_to)
        else:
            # To an Edge owning a node of the model (the one with the most
            # free slots in its summary).
            assert forwarded_to in owned.groups(), (name, forwarded_to, owned.groups())
    assert any(forwarded_to for _, _, forwarded_to, _ in streams), streams
    # Every Edge's client address, and what it owns.
    clients = {}
    for name in ("edge-1", "edge-2", "edge-3"):
        line = re.search(rf"  {name}  client API http://(127\.0\.0\.1:\d+)/v1   \(owns: ([^;]*); pid \d+\)\n",
                         running)
        assert line, running
        clients[name] = line.group(1)
        mine = [n for n, e in zip(("node-a", "node-b"), owned.groups()) if e == name]
        assert line.group(2) == (" ".join(mine) or "no node"), running
    assert len(set(clients.values())) == 3
    assert {name: addr for name, addr, _, _ in streams} == clients
    assert code == 0, out
    assert out.endswith(f"==> stopped; logs kept in {work} (etcd.log, mock.log, edge-1.log … edge-3.log, "
                        "node-a.log, node-b.log)\n"), out
    for name in ("etcd.log", "mock.log", "edge-1.log", "edge-2.log", "edge-3.log", "node-a.log", "node-b.log"):
        assert (work / name).stat().st_size > 0, name
    assert not (work / "etcd").exists()
    for name in ("edge-1", "edge-2", "edge-3"):
        log = (work / f"{name}.log").read_text()
        assert "IOP_READY edge" in log and "cluster: lease granted" in log, log
        assert re.search(r"IOP_READY edge client=\S+ nodes=\S+ peer=127\.0\.0\.1:\d+\n", log), log
    # The forwarded stream is in the access logs of both Edges.
    for name, _, forwarded_to, _ in streams:
        if forwarded_to:
            entry = (work / f"{name}.log").read_text()
            assert f" forwarded_to={forwarded_to}" in entry, entry
            assert f" peer={name}" in (work / f"{forwarded_to}.log").read_text()


def test_cluster_demo_without_etcd_says_how_to_install_it(tmp_path):
    # PATH without etcd (and without /usr/bin, where Debian puts it): only
    # the tools the script needs before its check.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        target = next(Path(d) / tool for d in os.environ["PATH"].split(":") if (Path(d) / tool).is_file())
        (bin_dir / tool).symlink_to(target)
    done = subprocess.run([str(bin_dir / "bash"), str(REPO / "scripts" / "demo.sh"), "--cluster"], cwd=REPO,
                          env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert "needs etcd, which is not installed" in done.stderr
    assert "apt-get install etcd-server" in done.stderr
