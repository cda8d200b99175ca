"""The Lua scripts of the parameter plane, registered once per client.

On a Redis Cluster client (``common.redis_client``) SCRIPT LOAD goes to every master and an
EVALSHA to the master of its keys' slot (a job's keys share one), so a script is loaded up front
on whichever node runs it, and a node that lost it (restarted, failed over) answers NOSCRIPT,
which reloads it everywhere and retries.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import resources

import redis

__all__ = ["script", "execute_with_script"]


@cache
def _source(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def script(client: redis.Redis, name: str) -> redis.commands.core.Script:
    """``services/lua/<name>.lua`` registered on ``client`` (EVALSHA, reloaded on NOSCRIPT)."""
    cached = getattr(client, "_streamtrain_scripts", None)
    if cached is None:
        cached = {}
        client._streamtrain_scripts = cached  # type: ignore[attr-defined]
    if name not in cached:
        cached[name] = client.register_script(_source(name))
        # load it now: an EVALSHA answered NOSCRIPT costs more than the round trip (redis-py
        # formats the error with every argument of the transaction, megabytes of it)
        client.script_load(_source(name))
    return cached[name]


def execute_with_script(client: redis.Redis, name: str,
                        build: Callable[[redis.client.Pipeline, str], None]) -> list:
    """Run a MULTI/EXEC that ``build(pipe, sha)`` queues, including an EVALSHA of script ``name``.

    EVALSHA is queued directly (redis-py's pipelined ``Script`` would add a
    SCRIPT EXISTS round trip to every call); on NOSCRIPT (a restarted or
    flushed Redis) the script is loaded and the whole transaction rebuilt and
    run once more, so ``build`` must be repeatable.
    """
    sha = script(client, name).sha
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=True)
        build(pipe, sha)
        try:
            return pipe.execute()
        except redis.exceptions.NoScriptError:
            if attempt == 2:
                raise
            client.script_load(_source(name))
    raise AssertionError("unreachable")
