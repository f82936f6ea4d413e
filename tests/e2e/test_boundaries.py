"""CONTRACT: X1 — nothing connects to a Node: the Node dials out and listens on
no socket, so no control plane or client can reach or schedule it directly."""

import os

import pytest

from iop_harness import Cluster


def _listening_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        inodes.add(fields[9])
        except FileNotFoundError:
            pass
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:["):-1])
    return out


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c:
        yield c


def test_the_node_listens_on_nothing(cluster):
    listening = _listening_inodes()
    node_sockets = _socket_inodes(cluster.nodes["node-a"].popen.pid)
    edge_sockets = _socket_inodes(cluster.edge.popen.pid)
    assert node_sockets, "the node holds its edge connection"
    assert not (node_sockets & listening), "node-bin has a listening socket"
    # The check can see listeners: the Edge has its client and node listeners.
    assert len(edge_sockets & listening) >= 2
