"""The Lua scripts of the parameter plane, registered once per client."""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis

__all__ = ["script"]


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
    return cached[name]
