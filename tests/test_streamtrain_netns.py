"""A network namespace linked by a veth pair: reachable, cut, restored, and gone after close.

Needs root (``ip netns``); skipped with the reason where a namespace cannot be created.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from streamtrain.netns import NetNamespace, NetnsError, remove_stale

pytestmark = pytest.mark.netns




def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def _dial_from_inside(ns: NetNamespace, port: int) -> str:
    """Connect from inside the namespace to ``host_address:port``: ``ok`` or the error's name."""
    code = ("import socket\ntry:\n"
            f"    socket.create_connection(({ns.host_address!r}, {port}), timeout=2).close(); print('ok')\n"
            "except OSError as exc:\n    print(type(exc).__name__)\n")
    return ns.run([sys.executable, "-c", code], timeout=30).stdout.strip()


def test_the_link_carries_traffic_until_cut_and_again_once_restored(netns: NetNamespace) -> None:
    assert len(netns.host_ifname) <= 15 and len(netns.ns_ifname) <= 15
    with socket.create_server((netns.host_address, 0)) as server:
        port = server.getsockname()[1]
        assert _dial_from_inside(netns, port) == "ok"
        netns.cut()
        assert netns.is_cut
        assert _dial_from_inside(netns, port) != "ok"
        socket.create_connection((netns.host_address, port), timeout=2).close()  # here it still answers
        netns.restore()
        assert _dial_from_inside(netns, port) == "ok"
    inside = netns.run(["ip", "-4", "-o", "addr", "show", "dev", netns.ns_ifname]).stdout
    assert f"{netns.address}/30" in inside


def test_close_removes_everything_and_is_idempotent(netns: NetNamespace) -> None:
    netns.close()
    netns.close()
    assert netns.name not in _ip("netns", "list").stdout
    assert _ip("link", "show", netns.host_ifname).returncode != 0
    with pytest.raises(NetnsError):
        netns.cut()


def test_namespaces_of_runs_that_are_gone_are_removed(netns: NetNamespace) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"streamtrain-{gone.pid}-abcdef"
    assert _ip("netns", "add", stale).returncode == 0
    try:
        assert stale in remove_stale()
        assert netns.name not in remove_stale()  # ours: this process is alive
        assert stale not in _ip("netns", "list").stdout
    finally:
        _ip("netns", "del", stale)
