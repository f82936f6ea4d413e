"""The commands of the README's "Running it yourself" block run as written
from the root of a fresh clone.

The block is read from README.md. Its first line (`cargo build --release
--bins`) is checked, not run: the binaries under test (IOP_BIN_DIR) stand in
for `target/release/`, the only change made to any line. Every other line runs
as written in a directory holding exactly the repository's tracked
`examples/` files: the certificate command must put the certificates where
the example configs read them, the Edge must start on the example config,
and the example Node must connect to it.
"""

import shlex
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from iop_harness import BIN_DIR, http_json, start, wait_until

REPO = Path(__file__).resolve().parents[2]
BUILD = "cargo build --release --bins"
RELEASE = "target/release/"


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Running it yourself\n"):]
    block = section[section.index("```sh\n") + len("```sh\n"):]
    block = block[:block.index("```\n")]
    return [line for line in block.splitlines() if line.strip()]


def fresh_clone_examples(root: Path) -> None:
    """Copies the tracked files under examples/ (what a clone has) to root."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--", "examples"],
                            capture_output=True, text=True)
    files = listed.stdout.split() if listed.returncode == 0 else \
        [str(p.relative_to(REPO)) for p in (REPO / "examples").glob("*.toml")]
    assert files, "no example files"
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)


def port_free(port: int) -> bool:
    """True when nothing listens on the port (connections of an earlier run
    lingering in TIME_WAIT do not count: the Edge binds past them too)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_running_it_yourself_works_as_written():
    commands = readme_commands()
    assert commands[0] == BUILD, commands
    for port in (8080, 7443):
        if not port_free(port):
            pytest.skip(f"127.0.0.1:{port} (the example config's) is in use on this machine")
    root = Path(tempfile.mkdtemp(prefix="iop-readme-"))
    fresh_clone_examples(root)
    procs = []
    try:
        for line in commands[1:]:
            argv = shlex.split(line, comments=True)
            assert argv[0].startswith(RELEASE), line
            argv[0] = str(BIN_DIR / argv[0][len(RELEASE):])
            if "--config" in argv:
                # A server: runs until stopped. The Edge announces itself;
                # the Node is waited for through the Edge's /status.
                is_edge = Path(argv[0]).name == "edge-bin"
                procs.append(start(Path(argv[0]).name, argv, wait_ready=is_edge, cwd=root))
            else:
                done = subprocess.run(argv, cwd=root, capture_output=True, text=True)
                assert done.returncode == 0, (line, done.stdout, done.stderr)
        assert (root / "examples" / "certs" / "ca.pem").is_file()
        assert [p.name for p in procs] == ["edge-bin", "node-bin"]
        edge = procs[0]
        assert edge.ready["client"] == "127.0.0.1:8080", edge.log()

        def node_a_connected() -> bool:
            providers = http_json("http://127.0.0.1:8080/status")["providers"]
            return {p["node_id"] for p in providers if p["connected"]} == {"node-a"}

        wait_until(node_a_connected, timeout_s=30, what="the example node connected")
    finally:
        codes = [p.stop() for p in reversed(procs)]
    assert codes == [0] * len(procs), "\n".join(p.log() for p in procs)
