"""The fence token: which member owns a partition, at which membership generation.

The coordinator writes one per partition into ``JobKeys.assignment`` at every generation bump, and the
push script (``services/lua/push.lua``) compares a writer's token with it, given the token built here.
It lives on the floor because the coordinator must not import the parameter plane (which imports
torch). See docs/parameter-plane.md, *The wire contract, in one place*.
"""

from __future__ import annotations

__all__ = ["SEPARATOR", "fence_token", "parse_fence_token"]

SEPARATOR = "|"
"""Between the member id and the generation; never part of a member id."""


def fence_token(member_id: str, generation: int) -> str:
    """``"<member id>|<generation>"``, the value of ``JobKeys.assignment`` for a partition that
    ``member_id`` owns at ``generation``.

    Raises:
        ValueError: an empty member id or one holding the separator, or a generation that is
            not an int >= 0.
    """
    if not isinstance(member_id, str) or not member_id or SEPARATOR in member_id:
        raise ValueError(f"member id must be a non-empty string without {SEPARATOR!r}, got {member_id!r}")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise ValueError(f"generation must be an int >= 0, got {generation!r}")
    return f"{member_id}{SEPARATOR}{generation}"


def parse_fence_token(token: str | bytes) -> tuple[str, int]:
    """(member id, generation) of a token :func:`fence_token` wrote.

    Raises:
        ValueError: ``token`` is not of that form (the message names it).
    """
    text = token.decode() if isinstance(token, bytes) else token
    member_id, sep, generation = text.rpartition(SEPARATOR)
    if not sep or not member_id or not (generation.isascii() and generation.isdigit()):
        raise ValueError(f"not a fence token (\"<member id>{SEPARATOR}<generation>\"): {text!r}")
    return member_id, int(generation)
