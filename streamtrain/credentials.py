"""What ``streamtrain up`` hands over: its cluster's connection settings as a shell file.

:func:`shell_exports` writes the Redis URL, the tokens and the addresses as ``export STREAMTRAIN_*=...``
lines, quoted for the shell, and :func:`write_credentials` writes them to a file created readable by
its owner only, so the user can reach the model the job trains. See README.md, *The main job*
(*Getting the model out*). :func:`prometheus_targets` and :func:`write_targets` write beside it where
every process serves its metrics, as a Prometheus file-based discovery file.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .cluster import Endpoints

__all__ = ["CREDENTIALS_NAME", "TARGETS_NAME", "prometheus_targets", "shell_exports", "write_credentials",
           "write_targets"]

CREDENTIALS_NAME = "credentials.sh"
"""The file's name in the cluster's folder."""
TARGETS_NAME = "prometheus-targets.json"
"""The Prometheus file-based discovery file's name in the cluster's folder (beside the credentials)."""
TARGETS_JOB = "streamtrain"
"""The ``job`` label of every target."""


def shell_exports(at: Endpoints, job: str, serve_urls: Sequence[str] = ()) -> str:
    """``export STREAMTRAIN_*=value`` lines for a cluster reached at ``at`` running ``job``: the
    coordinator URL, the Redis URL (with its password), the job and admin tokens, the Kafka bootstrap,
    the job's name and, with serving replicas, the first one's base URL (``STREAMTRAIN_SERVE_URL``; its
    model routes take the job token) and, with more, all of them (``STREAMTRAIN_SERVE_URLS``,
    space-separated), each value quoted with :func:`shlex.quote`."""
    values = {
        "STREAMTRAIN_COORDINATOR_URL": at.coordinator_url,
        "STREAMTRAIN_REDIS_URL": at.redis_url,
        "STREAMTRAIN_JOB_TOKEN": at.job_token,
        "STREAMTRAIN_ADMIN_TOKEN": at.admin_token,
        "STREAMTRAIN_KAFKA_BOOTSTRAP": at.bootstrap,
        "STREAMTRAIN_JOB": job,
    }
    if serve_urls:
        values["STREAMTRAIN_SERVE_URL"] = serve_urls[0]
    if len(serve_urls) > 1:
        values["STREAMTRAIN_SERVE_URLS"] = " ".join(serve_urls)
    lines = ["# streamtrain up: connection settings of the running cluster (source this file)"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def write_credentials(path: Path, text: str) -> Path:
    """Write ``text`` to a new file ``path`` of mode 0600 (created so; an existing file is an error:
    it may be someone else's).

    Raises:
        FileExistsError: ``path`` exists.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def prometheus_targets(host: str, targets: Iterable[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """Prometheus file-based service discovery (``file_sd_configs``) of ``targets``, ``(service, name,
    port)`` each (:meth:`~streamtrain.cluster.LocalCluster.metrics_targets`): one group per process,
    labelled ``job`` (:data:`TARGETS_JOB`), ``service`` and ``instance_name``."""
    return [{"targets": [f"{host}:{port}"],
             "labels": {"job": TARGETS_JOB, "service": service, "instance_name": name}}
            for service, name, port in targets]


def write_targets(path: Path, groups: list[dict[str, Any]]) -> Path:
    """Write ``groups`` (:func:`prometheus_targets`) to ``path`` as JSON, replacing it atomically (a
    Prometheus that watches the file never reads half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
