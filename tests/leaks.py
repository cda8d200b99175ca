"""Find what a test left running: threads, child processes and file descriptors.

The check that ``conftest.py`` runs around every test, in the spirit of dask's
``gen_cluster``: a :class:`Snapshot` before the test, another after it, and
whatever is new in the second and still there after a short grace is a leak.
Linux only (it reads ``/proc``); psutil is not needed.
"""

from __future__ import annotations

import gc
import os
import threading
from dataclasses import dataclass, field

from streamtrain.launcher import wait_until

GRACE_S = 5.0
"""How long stragglers (a thread finishing its last loop, a process exiting) get before they count."""

FD_TOLERANCE = 4
"""Open file descriptors a test may add without blame: lazily opened, cached connections
(say, the session's Kafka admin client meeting a new broker connection) are not leaks."""

KINDS = ("threads", "processes", "fds")
"""What the check looks at; ``leaks_allowed(kinds=...)`` names a subset to let pass."""


@dataclass(frozen=True)
class Child:
    """A child process of this one."""

    pid: int
    """Its process id."""
    start_ticks: int
    """When it started (clock ticks after boot): with ``pid``, names it even if the pid is reused."""
    cmdline: str
    """Its command line, space-separated (``[name]`` when it has none)."""


@dataclass(frozen=True)
class Snapshot:
    """The threads, child processes and file descriptors of this process at one moment."""

    threads: frozenset[threading.Thread]
    """Live Python threads, daemon or not, except the main thread and the dummy entries of threads
    that Python did not start (on 3.11 those never leave ``threading.enumerate()``)."""
    children: frozenset[Child]
    """Direct children that have not exited (zombies are not counted: they hold nothing)."""
    fds: frozenset[tuple[int, str]]
    """Open descriptors as ``(number, what it points to)``."""

    @classmethod
    def take(cls) -> Snapshot:
        """The state now."""
        main = threading.main_thread()
        threads = (t for t in threading.enumerate()
                   if t is not main and t.is_alive() and not isinstance(t, threading._DummyThread))
        return cls(threads=frozenset(threads),
                   children=frozenset(_children()), fds=frozenset(_fds()))


@dataclass
class Allowance:
    """What higher-scoped fixtures (module, session ...) started: never blamed on a test."""

    threads: set[threading.Thread] = field(default_factory=set)
    children: set[Child] = field(default_factory=set)
    fds: set[tuple[int, str]] = field(default_factory=set)

    def add(self, before: Snapshot, after: Snapshot) -> None:
        """Allow what appeared between ``before`` and ``after``."""
        self.threads |= after.threads - before.threads
        self.children |= after.children - before.children
        self.fds |= after.fds - before.fds


def _children() -> list[Child]:
    me = os.getpid()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != me or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                argv = fh.read().rstrip(b"\0").split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        cmdline = " ".join(a.decode(errors="replace") for a in argv if a) or f"[{fields[0]}]"
        out.append(Child(pid=int(entry.name), start_ticks=int(fields[19]), cmdline=cmdline))
    return out


def _fds() -> list[tuple[int, str]]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            out.append((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return out


def find_leaks(before: Snapshot, after: Snapshot, allowed: Allowance | None = None,
               kinds: tuple[str, ...] = KINDS, fd_tolerance: int = FD_TOLERANCE) -> list[str]:
    """What is in ``after`` but not in ``before`` (nor in ``allowed``), one line per finding."""
    allowed = allowed or Allowance()
    found = []
    if "threads" in kinds:
        for t in sorted(after.threads - before.threads - allowed.threads, key=lambda t: t.name):
            found.append(f"thread {t.name!r} ({'daemon' if t.daemon else 'non-daemon'}, "
                         f"target {_target(t)})")
    if "processes" in kinds:
        for c in sorted(after.children - before.children - allowed.children, key=lambda c: c.pid):
            found.append(f"child process {c.pid}: {c.cmdline[:300]}")
    if "fds" in kinds:
        new = after.fds - before.fds - allowed.fds
        growth = len(new) - len(before.fds - after.fds)
        if growth > fd_tolerance:
            listed = ", ".join(f"{fd} -> {target}" for fd, target in sorted(new)[:20])
            found.append(f"{growth} more open file descriptors than before the test "
                         f"(tolerance {fd_tolerance}); new: {listed}")
    return found


def _target(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    return getattr(target, "__qualname__", None) or type(thread).__qualname__


def wait_for_no_leaks(before: Snapshot, allowed: Allowance | None = None, kinds: tuple[str, ...] = KINDS,
                      grace_s: float = GRACE_S, fd_tolerance: int = FD_TOLERANCE) -> list[str]:
    """Give stragglers up to ``grace_s`` to go, then return the leaks left (``[]`` when none).

    Unreferenced sockets and files are collected (``gc.collect``) before each look.
    """
    last: list[str] = []

    def clean() -> bool:
        nonlocal last
        last = find_leaks(before, Snapshot.take(), allowed, kinds, fd_tolerance)
        if last and "fds" in kinds:
            gc.collect()
            last = find_leaks(before, Snapshot.take(), allowed, kinds, fd_tolerance)
        return not last

    try:
        wait_until(clean, grace_s, interval_s=0.1, what="leaked threads, processes and descriptors to go")
    except TimeoutError:
        return last
    return []
