"""What every bench shares: the repository on the path, the machine, the results file and the last lines.

A bench runs as a file (``.venv/bin/python bench/pipeline.py``), so Python puts ``bench/`` first on
``sys.path``, where ``bench/datastream.py`` and ``bench/coordinator.py`` would hide the packages of those
names, and the editable install maps only the six packages (``bench`` is not one). So each bench starts
with the one line that lets it import this module::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first

and importing this module leaves the repository first on ``sys.path`` and ``bench/`` off it. A bench's
``main()`` then calls :func:`start` (logging, and the environment of the processes it starts: a
trainer given a plug-in model of ``bench/models.py`` imports it from the repository,
:func:`child_environment`) and ends with :func:`finish`, which writes its results with the
:func:`machine` they were measured on to ``bench/results/<name>.json`` (or under
``$STREAMTRAIN_BENCH_RESULTS``) and prints its ratio lines last.

What a process costs in CPU: :func:`cpu_seconds` reads it from ``/proc``, and a :class:`CpuSampler`
over the processes of a cluster (:func:`cluster_pids`) gives each one's CPU over a window known only
afterwards, such as from the first to the last applied update.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from services.protocol import AccountingRecord
    from streamtrain.cluster import LocalCluster

__all__ = ["RESULTS_DIR", "RESULTS_ENV", "ROOT", "CpuSampler", "child_environment", "cluster_pids", "cpu_seconds",
           "finish", "machine", "results_path", "start"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository."""
RESULTS_ENV = "STREAMTRAIN_BENCH_RESULTS"
"""A folder to write results to instead of ``bench/results`` (``tests/test_bench_harness.py``'s runs)."""
RESULTS_DIR = Path(os.environ.get(RESULTS_ENV) or ROOT / "bench" / "results")
"""Where the benches write their results (and, for some, their clusters' folders)."""


def _repository_first() -> None:
    """The repository first on ``sys.path``, once, and ``bench/`` off it."""
    def at(entry: str) -> Path:
        return Path(entry or ".").resolve()
    sys.path[:] = [str(ROOT), *(p for p in sys.path if at(p) not in (ROOT, ROOT / "bench"))]


_repository_first()


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (ours by default) with the repository first on ``PYTHONPATH``: the environment of
    every process a bench starts (a cluster's services run in their own folders with ours, plus their
    secrets: ``streamtrain.launcher.ServiceProcess``), so that what a trainer imports by name from the
    repository, a plug-in model of a bench, is found there."""
    env = dict(os.environ if environ is None else environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])
    return env


def start(level: int = logging.WARNING) -> None:
    """What a bench's ``main()`` does first: log at ``level``, and give the processes it starts
    :func:`child_environment`."""
    logging.basicConfig(level=level)
    os.environ["PYTHONPATH"] = child_environment()["PYTHONPATH"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the figures were measured on: the CPU model, its cores (and those this process may use),
    torch's threads in this process now, the platform, the host, and the versions of Python, torch,
    redis-py and kafka-python."""
    import kafka
    import redis
    import torch

    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(), "host": platform.node(),
            "python": platform.python_version(), "torch": torch.__version__, "redis_py": redis.__version__,
            "kafka_python": kafka.__version__}


def results_path(name: str) -> Path:
    """Where bench ``name`` writes its results: ``bench/results/<name>.json`` (:data:`RESULTS_DIR`)."""
    return RESULTS_DIR / f"{name}.json"


def finish(name: str, results: Mapping[str, Any], lines: Iterable[str] = (), *, path: Path | None = None) -> Path:
    """End bench ``name``: write ``results`` with its name, its arguments and the :func:`machine` to
    ``path`` (:func:`results_path` by default) as JSON, say where, and print ``lines`` (its ratios) last.
    Returns the path written."""
    path = results_path(name) if path is None else path
    document = {"bench": name, "argv": sys.argv[1:], "machine": machine(), **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    for line in lines:
        print(line)
    sys.stdout.flush()
    return path


def applied_entries(cluster: LocalCluster) -> list[AccountingRecord]:
    """The accounting entries of the updates ``cluster``'s job applied (``applied_samples``), those with records."""
    import redis as redis_lib

    from common.keys import JobKeys
    from services.protocol import AccountingRecord

    client = redis_lib.Redis.from_url(cluster.redis_url)
    try:
        raw = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(JobKeys(cluster.spec.job).applied_samples))
    finally:
        client.close()
    return [e for e in (AccountingRecord.from_fields(f) for _, f in raw) if e.batch_size > 0]


def _ticks(pid: int) -> int:
    """Clock ticks of CPU ``pid`` spent, all its threads, user and system, with those of the children it
    reaped (``cutime``, ``cstime``) and, walked down, of those still alive."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    ticks = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime: fields 14-17 of proc(5)
    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as fh:
                children.update(int(c) for c in fh.read().split())
        except OSError:  # a thread that ended meanwhile
            continue
    for child in children:
        try:
            ticks += _ticks(child)
        except OSError:  # a child that ended meanwhile: its parent reaps it into cutime
            continue
    return ticks


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has spent so far, over all its threads and with its
    children's (those alive, and those it reaped), from ``/proc/<pid>/stat``.

    Raises:
        OSError: no such process.
    """
    return _ticks(pid) / os.sysconf("SC_CLK_TCK")


def cluster_pids(cluster: LocalCluster) -> dict[str, int]:
    """The pids of ``cluster``'s processes by name, those running now: ``trainer 1`` .. (in the order they
    were added), ``ps0`` .. (by shard group), ``coordinator``, ``producer``, ``serve 1`` .., ``redis``
    (``redis0`` .. for the nodes of a Redis Cluster) and ``kafka`` (``kafka0`` .. with several brokers)."""
    out: dict[str, int | None] = {f"trainer {i + 1}": t.pid for i, t in enumerate(cluster.trainers)}
    out.update({f"ps{g}": p.pid for g, p in enumerate(cluster.ps)})
    out["coordinator"] = cluster.coordinator.pid if cluster.coordinator is not None else None
    out["producer"] = cluster.producer.pid if cluster.producer is not None else None
    out.update({f"serve {i + 1}": p.pid for i, (p, _) in enumerate(cluster.replicas)})
    from streamtrain.launcher import RedisCluster

    redis = cluster.redis
    redis_pids = [] if redis is None else list(redis.pids) if isinstance(redis, RedisCluster) else [redis.pid]
    kafka_pids = [] if cluster.kafka is None else list(cluster.kafka.pids)
    for name, pids in (("redis", redis_pids), ("kafka", kafka_pids)):
        out.update({name: pids[0]} if len(pids) == 1 else {f"{name}{i}": pid for i, pid in enumerate(pids)})
    return {name: pid for name, pid in out.items() if pid is not None}


def redis_commands(url: str) -> dict[str, tuple[int, int]]:
    """Redis's own account of its commands so far (``INFO commandstats``): command -> (calls, CPU
    microseconds). Two readings' difference (:func:`command_usage`) says where Redis's time went."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(url)
    try:
        stats = cast("dict[str, dict[str, Any]]", client.info("commandstats"))
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}


def command_usage(before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]
                  ) -> dict[str, tuple[int, int]]:
    """Calls and CPU microseconds of each command between two :func:`redis_commands` readings, the
    costliest first (commands without calls between them left out)."""
    out = {}
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if calls > c0:
            out[name] = (calls - c0, usec - u0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


class CpuSampler:
    """Every ``interval_s``, in a thread of its own, the :func:`cpu_seconds` of each named process, so
    that :meth:`between` gives each one's CPU over a window known only afterwards (from the first to the
    last applied update). Use as a context manager, or :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.2) -> None:
        self.pids = dict(pids)
        """Name -> pid of the processes sampled."""
        self.interval_s = interval_s
        self.times: list[float] = []
        """Wall-clock seconds (``time.time()``) of each sample."""
        self.samples: list[dict[str, float]] = []
        """Each process's CPU seconds at each of :attr:`times` (a process gone keeps its last reading)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def sample(self) -> None:
        """Take one sample now."""
        last = self.samples[-1] if self.samples else {}
        now: dict[str, float] = {}
        for name, pid in self.pids.items():
            try:
                now[name] = cpu_seconds(pid)
            except OSError:  # it ended: it spends no more
                now[name] = last.get(name, 0.0)
        self.times.append(time.time())
        self.samples.append(now)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> CpuSampler:
        """Take a first sample and go on in the background."""
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling, after one last sample."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()

    def __enter__(self) -> CpuSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def at(self, t: float) -> dict[str, float]:
        """Each process's CPU seconds at wall-clock time ``t``, linear between the samples around it
        (the first or last sample outside them)."""
        if not self.samples:
            raise ValueError("no samples taken")
        i = bisect.bisect_left(self.times, t)
        if i == 0:
            return dict(self.samples[0])
        if i == len(self.times):
            return dict(self.samples[-1])
        t0, t1 = self.times[i - 1], self.times[i]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        a, b = self.samples[i - 1], self.samples[i]
        return {name: a[name] + w * (b[name] - a[name]) for name in b}

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """Each process's CPU seconds from wall-clock time ``t0`` to ``t1``."""
        start, end = self.at(t0), self.at(t1)
        return {name: end[name] - start[name] for name in end}
