"""What ``streamtrain up`` hands over: its cluster's connection settings as a shell file.

:func:`shell_exports` writes the Redis URL, the tokens and the addresses as ``export STREAMTRAIN_*=...``
lines, quoted for the shell, and :func:`write_credentials` writes them to a file created readable by
its owner only, so the user can reach the model the job trains. See README.md, *The main job*
(*Getting the model out*).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from .cluster import Endpoints

__all__ = ["CREDENTIALS_NAME", "shell_exports", "write_credentials"]

CREDENTIALS_NAME = "credentials.sh"
"""The file's name in the cluster's folder."""


def shell_exports(at: Endpoints, job: str) -> str:
    """``export STREAMTRAIN_*=value`` lines for a cluster reached at ``at`` running ``job``: the
    coordinator URL, the Redis URL (with its password), the job and admin tokens, the Kafka bootstrap
    and the job's name, each value quoted with :func:`shlex.quote`."""
    values = {
        "STREAMTRAIN_COORDINATOR_URL": at.coordinator_url,
        "STREAMTRAIN_REDIS_URL": at.redis_url,
        "STREAMTRAIN_JOB_TOKEN": at.job_token,
        "STREAMTRAIN_ADMIN_TOKEN": at.admin_token,
        "STREAMTRAIN_KAFKA_BOOTSTRAP": at.bootstrap,
        "STREAMTRAIN_JOB": job,
    }
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
