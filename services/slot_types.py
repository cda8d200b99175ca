"""The pure types of the parameter plane's Redis data model (:mod:`services.slots`): the version vector
and the head of the model's meta.

A model version, and a feed position, is one integer per shard group, group 0's first, written
``"12.7"`` (``docs/parameter-plane.md``, *Redis data model*; ``docs/serving.md``): :class:`VersionVector`
names, parses and compares them, for the export, the feed, the settings, the routes and the
checkpoint alike. :class:`MetaHead` is what the coordinator reads of the model's meta (its group
count and table names) without the parameter plane's heavy modules. This module imports no redis,
torch or aiohttp, so the coordinator uses it at no cost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ParameterPlaneError

__all__ = ["VersionVector", "BadVersionError", "MetaHead", "NAME_PATTERN"]

NAME_PATTERN = r"[0-9]{1,18}(?:\.[0-9]{1,18})*"
"""A version's (or feed position's) name, of a job with any number of groups (the OpenAPI file's
``pattern``)."""
_NAME = re.compile(NAME_PATTERN)
_PART = re.compile(r"[0-9]{1,18}")
_KINDS = {"version": ("version", "a model version"), "position": ("feed position", "a feed position")}
"""What a vector names -> (the subject of a parse error, what the form is of)."""


class BadVersionError(ParameterPlaneError, ValueError):
    """A version (or feed position) name does not have the job's form (one non-negative integer per
    shard group, joined by '.'); the message names the value and the form expected."""


class VersionVector(tuple[int, ...]):
    """One non-negative integer per shard group, group 0's first: a model version (each group's
    version) or a feed position (each group's position). A tuple, so it compares equal to the plain
    tuple of its parts; the order operators are the vectors' partial order (every part), not the
    tuple's: ``a <= b`` when no part of ``a`` is after ``b``'s."""

    __slots__ = ()

    def __new__(cls, parts: Iterable[int] = ()) -> VersionVector:
        return super().__new__(cls, (int(p) for p in parts))

    # -- names -------------------------------------------------------------------------------------
    def name(self) -> str:
        """How the vector is written: ``"1200"`` with one group, ``"12.7"`` with several."""
        return ".".join(str(v) for v in self)

    def json(self) -> int | str:
        """The vector in an answer's JSON: the integer with one group (as before groups), else its name."""
        return self[0] if len(self) == 1 else self.name()

    @staticmethod
    def is_name(text: object) -> bool:
        """``text`` is a name of some vector (:data:`NAME_PATTERN`: any number of groups)."""
        return isinstance(text, str) and _NAME.fullmatch(text) is not None

    @staticmethod
    def form(groups: int, kind: str = "version") -> str:
        """The form of a ``kind`` (``"version"`` or ``"position"``) of a job with ``groups`` groups,
        for messages."""
        what = _KINDS[kind][1]
        if groups == 1:
            return f"one non-negative integer ({what})"
        example = VersionVector([12, 7, 9, 4, 15][:groups] + [3] * max(0, groups - 5)).name()
        return (f"{groups} non-negative integers joined by '.', one per shard group, group 0's first "
                f"({what}, e.g. {example!r})")

    @classmethod
    def parse(cls, text: object, groups: int, *, kind: str = "version", job: str | None = None) -> VersionVector:
        """The vector named ``text`` (:meth:`name`'s form) of a job with ``groups`` groups.

        Raises:
            BadVersionError: ``text`` is not ``groups`` non-negative integers of at most 18 digits
                joined by '.'; the message names the value and the form expected (and the job's
                group count when ``job`` is given and it has several).
        """
        parts = text.split(".") if isinstance(text, str) else []
        if len(parts) != groups or not all(_PART.fullmatch(p) for p in parts):
            whose = f"job {job} has {groups} shard groups: " if job is not None and groups > 1 else ""
            raise BadVersionError(f"{whose}{_KINDS[kind][0]} must be {cls.form(groups, kind)}, got {text!r}")
        return cls(int(p) for p in parts)

    @classmethod
    def check(cls, value: Any, groups: int) -> VersionVector:
        """``value`` (a sequence of ints, e.g. a caller's group versions) as a vector of ``groups`` groups.

        Raises:
            ValueError: it is not ``groups`` non-negative ints (names the value).
        """
        if (isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != groups
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
            raise ValueError(f"version must be {groups} non-negative integer(s), one per shard group, "
                             f"got {value!r}")
        return cls(value)

    # -- the partial order -------------------------------------------------------------------------
    def _pairs(self, other: Iterable[int]) -> list[tuple[int, int]]:
        theirs = tuple(other)
        if len(theirs) != len(self):
            raise ValueError(f"vectors of {len(self)} and {len(theirs)} groups do not compare: "
                             f"{self.name()} and {VersionVector(theirs).name()}")
        return list(zip(self, theirs, strict=True))

    def covers(self, other: Iterable[int]) -> bool:
        """Every group is at or after ``other``'s (``self >= other``)."""
        return all(a >= b for a, b in self._pairs(other))

    def __ge__(self, other: object) -> bool:
        return self.covers(other) if isinstance(other, tuple) else NotImplemented

    def __le__(self, other: object) -> bool:
        return VersionVector(other).covers(self) if isinstance(other, tuple) else NotImplemented

    def __gt__(self, other: object) -> bool:
        return self.covers(other) and tuple(self) != tuple(other) if isinstance(other, tuple) else NotImplemented

    def __lt__(self, other: object) -> bool:
        return VersionVector(other).covers(self) and tuple(self) != tuple(other) if isinstance(other, tuple) \
            else NotImplemented

    @property
    def total(self) -> int:
        """The sum of the parts: it grows with every apply of any group (an order of one reader's
        snapshots), but names no model (``12.7`` and ``11.8`` have the same sum)."""
        return sum(self)

    def __repr__(self) -> str:
        return f"VersionVector({self.name()!r})"


@dataclass(frozen=True)
class MetaHead:
    """What the coordinator reads of the model's meta (``JobKeys.meta``, written by
    ``ParameterStore.init_model``) without the parameter plane: the group count and the tables' names.
    :class:`services.slots.ModelMeta` is the whole of it."""

    groups: int
    """The number of shard groups: the model's, fixed when it is created (``docs/parameter-plane.md``)."""
    tables: tuple[str, ...] = ()
    """Its embedding tables' names, in declaration order."""

    @classmethod
    def parse(cls, raw: bytes | str) -> MetaHead:
        """The head of the stored meta JSON ``raw``.

        Raises:
            ValueError: it is not a model's meta (names what is wrong).
        """
        try:
            meta = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"model meta is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise ValueError(f"model meta is not a JSON object: {type(meta).__name__}")
        groups = meta.get("groups", 1)
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"model meta has no valid group count: {groups!r}")
        tables = meta.get("tables", [])
        if not isinstance(tables, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                   for t in tables):
            raise ValueError(f"model meta has unreadable tables: {tables!r}")
        return cls(groups, tuple(t["name"] for t in tables))
