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
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from services.protocol import AccountingRecord
    from streamtrain.cluster import LocalCluster

__all__ = ["RESULTS_DIR", "RESULTS_ENV", "ROOT", "child_environment", "finish", "machine", "results_path", "start"]

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
