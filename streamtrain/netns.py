"""A host of its own on this machine: a network namespace joined to ours by a veth pair.

A process started in a :class:`NetNamespace` (:meth:`~NetNamespace.command`) reaches this machine's
servers, bound to :attr:`~NetNamespace.host_address`, only over the pair's /30, so
:meth:`~NetNamespace.cut` partitions it silently (the failure a lease exists for) and
:meth:`~NetNamespace.restore` heals it. Needs root and iproute2, else :class:`NetnsUnavailable`;
:func:`remove_stale` removes namespaces a killed run left. See README.md, *Faults and outages*.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

logger = logging.getLogger(__name__)

__all__ = ["NetNamespace", "NetnsError", "NetnsUnavailable", "remove_stale"]

POOL = ipaddress.IPv4Network("10.213.0.0/16")
"""Where the /30 of each link is drawn from (one not overlapping any address or route here)."""

NAME_PREFIX = "streamtrain-"
"""Namespace names are ``streamtrain-<pid>-<6 hex>``; the veth ends ``st<6 hex>h`` and ``st<6 hex>n``."""

_NAME_RE = re.compile(rf"^{NAME_PREFIX}(\d+)-([0-9a-f]{{6}})$")
_LOCK = Path(tempfile.gettempdir()) / "streamtrain-netns.lock"
"""Held while a subnet is drawn and assigned, so two runs never draw the same one."""
_DENIED = ("Operation not permitted", "Permission denied")


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and its error output."""


class NetnsUnavailable(NetnsError):
    """This machine cannot create a namespace: no ``ip`` binary, or not privileged enough."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``.

    Raises:
        NetnsUnavailable: no ``ip`` on PATH, or the kernel refused for lack of privilege.
        NetnsError: it failed otherwise (only when ``check``).
    """
    binary = shutil.which("ip")
    if binary is None:
        raise NetnsUnavailable("no 'ip' binary on PATH (apt-get install iproute2)")
    res = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30, check=False)
    if res.returncode != 0 and check:
        message = f"ip {' '.join(args)} failed (exit {res.returncode}): {res.stderr.strip()}"
        if any(word in res.stderr for word in _DENIED):
            raise NetnsUnavailable(message)
        raise NetnsError(message)
    return res


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    with open(_LOCK, "a") as fh:  # a lock file, held open while locked
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of every address and route of this namespace."""
    used = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):  # "default", "local", "broadcast", ...
            used.append(ipaddress.IPv4Network(first, strict=False))
    return used


def _free_subnet() -> ipaddress.IPv4Network:
    """A random /30 of :data:`POOL` that overlaps nothing in use (call under :func:`_subnet_lock`)."""
    used = _networks_in_use()
    subnets = 1 << (30 - POOL.prefixlen)
    for _ in range(64):
        subnet = ipaddress.IPv4Network((int(POOL.network_address) + 4 * secrets.randbelow(subnets), 30))
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetnsError(f"no free /30 found in {POOL}")


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_stale() -> list[str]:
    """Delete the namespaces (and their links) that runs no longer alive left behind; their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir("/run/netns"):
            match = _NAME_RE.match(entry)
            if match is None or _pid_alive(int(match[1])):
                continue
            _ip("link", "del", f"st{match[2]}h", check=False)
            _ip("netns", "del", entry, check=False)
            removed.append(entry)
    if removed:
        logger.info("removed network namespaces of runs that are gone: %s", ", ".join(removed))
    return removed


class NetNamespace:
    """A network namespace linked to this one by a veth pair with its own /30. A context manager.

    Nothing exists until :meth:`create` (or ``with``); :meth:`close` removes it all again,
    idempotently, and also after a :meth:`create` that failed halfway.
    """

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.name = f"{NAME_PREFIX}{os.getpid()}-{tag}"
        """The namespace's name (``ip netns exec NAME ...``)."""
        self.host_ifname = f"st{tag}h"
        """The veth end in this (the root) namespace."""
        self.ns_ifname = f"st{tag}n"
        """The veth end inside the namespace."""
        self.subnet: ipaddress.IPv4Network | None = None
        """The link's /30, once created."""
        self.is_cut = False
        """True between :meth:`cut` and :meth:`restore`."""
        self._created = False

    @property
    def host_address(self) -> str:
        """This side's address: what servers bind for processes inside to reach (once created)."""
        if self.subnet is None:
            raise NetnsError(f"{self.name} is not created")
        return str(self.subnet.network_address + 1)

    @property
    def address(self) -> str:
        """The namespace's own address (once created)."""
        if self.subnet is None:
            raise NetnsError(f"{self.name} is not created")
        return str(self.subnet.network_address + 2)

    def create(self) -> Self:
        """Create the namespace, the veth pair and their addresses, links up. Idempotent.

        Raises:
            NetnsUnavailable: no ``ip``, or not privileged enough (nothing is left behind).
            NetnsError: an ``ip`` command failed otherwise (nothing is left behind).
        """
        if self._created:
            return self
        remove_stale()
        self._created = True  # from here on close() has something to undo
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_ifname, "type", "veth", "peer", "name", self.ns_ifname)
            _ip("link", "set", self.ns_ifname, "netns", self.name)
            with _subnet_lock():
                subnet = _free_subnet()
                _ip("addr", "add", f"{subnet.network_address + 1}/30", "dev", self.host_ifname)
            self.subnet = subnet
            _ip("-n", self.name, "addr", "add", f"{self.address}/30", "dev", self.ns_ifname)
            _ip("link", "set", self.host_ifname, "up")
            _ip("-n", self.name, "link", "set", self.ns_ifname, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        logger.info("network namespace %s: %s (%s) <-> %s (%s)", self.name, self.host_address,
                    self.host_ifname, self.address, self.ns_ifname)
        return self

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace. ``ip netns exec`` execs it in place, so the pid of
        the process started with this command line is ``argv``'s own."""
        self._require()
        return [shutil.which("ip") or "ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace to completion (``subprocess.run`` keywords; text output
        captured unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), check=False, **kwargs)

    def cut(self) -> None:
        """Partition the namespace: its end of the link goes down. Nothing is told to either side:
        this namespace's packets are dropped, the namespace has no route out.

        The namespace's end, not ours: downing ours would also drop this namespace's local route
        to :attr:`host_address`, cutting every process here off the servers bound to it.
        """
        self._require()
        _ip("-n", self.name, "link", "set", self.ns_ifname, "down")
        self.is_cut = True
        logger.info("network namespace %s: link cut", self.name)

    def restore(self) -> None:
        """Heal the partition: the namespace's end comes up again (its route back with it)."""
        self._require()
        _ip("-n", self.name, "link", "set", self.ns_ifname, "up")
        self.is_cut = False
        logger.info("network namespace %s: link restored", self.name)

    def close(self) -> None:
        """Delete the veth pair and the namespace. Idempotent; never raises for what is already gone.

        Processes still running inside keep the namespace's network alive until they exit; stop
        them first.
        """
        if not self._created:
            return
        self._created = False
        for args in (("link", "del", self.host_ifname), ("netns", "del", self.name)):
            try:
                _ip(*args, check=False)
            except NetnsError as exc:  # no ip binary: nothing was created either
                logger.debug("could not %s: %s", " ".join(args), exc)
        self.is_cut = False

    def _require(self) -> None:
        if not self._created or self.subnet is None:
            raise NetnsError(f"{self.name} is not created")

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{self.host_address}<->{self.address}" if self.subnet is not None else "not created"
        return f"NetNamespace({self.name}, {where}{', cut' if self.is_cut else ''})"
