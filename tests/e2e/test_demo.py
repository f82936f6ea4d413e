"""`scripts/demo.sh` runs the whole system, uses the binaries of cargo's
target directory (CARGO_TARGET_DIR honoured) and keeps its logs after it
stops, saying where they are.
"""

import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from iop_harness import BIN_DIR, wait_until

REPO = Path(__file__).resolve().parents[2]


def test_demo_streams_and_keeps_its_logs():
    if BIN_DIR.name != "debug":
        pytest.skip(f"IOP_BIN_DIR {BIN_DIR} is not a cargo dev-profile directory")
    work = Path(tempfile.mkdtemp(prefix="iop-demo-test-")) / "demo"
    env = dict(os.environ, CARGO_TARGET_DIR=str(BIN_DIR.parent), IOP_DEMO_PROFILE="dev",
               IOP_DEMO_PORT="0", IOP_DEMO_DIR=str(work))
    # Ctrl-C as in a terminal: SIGINT at its default disposition when the
    # script starts. A suite started as a background job of a script (a CI
    # runner, `nohup … &`) has SIGINT ignored, children inherit that, and
    # bash cannot trap a signal ignored when it started.
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "demo.sh")], cwd=REPO, env=env, text=True,
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
        out = "".join(lines)
        assert proc.poll() is None, out
        assert f"==> binaries from {BIN_DIR}\n" in out
        assert f"==> configs, certificates and logs in {work}\n" in out
        # The streamed completion of the mock (24 tokens) was printed.
        assert "tok0 tok1 tok2" in out and "tok23" in out, out
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
    assert code == 0, out
    assert out.endswith(f"==> stopped; logs kept in {work} (mock.log, edge.log, node.log)\n"), out
    for name in ("mock.log", "edge.log", "node.log"):
        assert (work / name).stat().st_size > 0, name
    assert "IOP_READY edge" in (work / "edge.log").read_text()
