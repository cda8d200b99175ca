"""Our own services (coordinator, parameter server, trainers, producer) as child processes.

``streamtrain up``, the end-to-end tests and the benchmarks run the same
topology as docker-compose, as local processes started through this class.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .process import ManagedProcess


class ServiceProcess(ManagedProcess):
    """``python -m streamtrain.cli <args>`` with its own log and a readiness probe.

    Args:
        name: a label for logs and errors, e.g. ``trainer-1``.
        args: the subcommand and its flags, e.g. ``["ps", "--job", "digits"]``.
        env: environment variables added to ours.
        ready: returns True once the service is usable; None means ready once spawned.
        prefix: a command that runs the service's command line in place (it execs it, so the
            pid stays the service's), e.g. ``ip netns exec NS`` (:meth:`streamtrain.netns.NetNamespace.command`).
    """

    def __init__(self, name: str, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 ready: Callable[[], bool] | None = None, prefix: Sequence[str] = (),
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.args = list(args)
        self.env = dict(env or {})
        self._ready = ready
        self.prefix = list(prefix)

    def _command(self) -> Sequence[str]:
        return [*self.prefix, sys.executable, "-m", "streamtrain.cli", *self.args]

    def _environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _probe_ready(self) -> bool:
        return True if self._ready is None else bool(self._ready())

    @property
    def returncode(self) -> int | None:
        """Exit code once the process has exited, else None."""
        return None if self._proc is None else self._proc.poll()
