"""The options of a spec, ``name?key=value&key=value``, read one by one.

A source (``synthetic?features=8&limit=1000``, ``csv:data.csv?label=target``) and a model
(``dlrm?schema=movielens&dim=8``) are named by a spec whose options follow a ``?``, URL-query
style. :func:`split_spec` splits a spec; :class:`SpecOptions` hands out each option once, as text
or as a bounded integer or number, and :meth:`SpecOptions.refuse_unread` refuses what no reader
asked for (a misspelt option is an error, never ignored). Messages name the option and its value:
``option limit=0 must be >= 1``, ``option seed='x' is not an integer``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar
from urllib.parse import parse_qsl

__all__ = ["SpecOptions", "split_spec"]

_Default = TypeVar("_Default", int, float, None)
"""A numeric option's default: a number, or None for none (then the option may be absent)."""
_N = TypeVar("_N", int, float)


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``spec``'s name (everything before the first ``?``) and its options.

    Raises:
        ValueError: the options are not ``key=value`` pairs joined by ``&`` (``urllib.parse``'s message).
    """
    name, _, query = spec.partition("?")
    return name, dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))


class SpecOptions:
    """A spec's options, each read (and so known) once.

    Args:
        given: the options, as :func:`split_spec` returns them.
        error: what a bad option raises (the caller's error type, a :class:`ValueError`).
        what: the spec's kind, which messages start with (``dlrm option dim=0 must be >= 1``); none
            by default (``option limit=0 must be >= 1``).
    """

    def __init__(self, given: Mapping[str, str], error: Callable[[str], ValueError] = ValueError,
                 what: str = "") -> None:
        self._left = dict(given)
        self._read: set[str] = set()
        self._error = error
        self._what = what

    def given(self, key: str) -> bool:
        """Whether ``key`` was given (and not read yet)."""
        return key in self._left

    def text(self, key: str, default: str) -> str:
        """Option ``key`` as given, or ``default``."""
        self._read.add(key)
        return self._left.pop(key, default)

    def integer(self, key: str, default: _Default, lo: int = 0) -> int | _Default:
        """Option ``key`` as an integer >= ``lo``, or ``default`` when absent.

        Raises:
            error: not an integer, or below ``lo``.
        """
        raw = self._raw(key)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise self._bad(f"option {key}={raw!r} is not an integer") from None
        return self._at_least(key, value, lo)

    def number(self, key: str, default: _Default, lo: float | None = None) -> float | _Default:
        """Option ``key`` as a float (>= ``lo`` when given), or ``default`` when absent.

        Raises:
            error: not a number, or below ``lo``.
        """
        raw = self._raw(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise self._bad(f"option {key}={raw!r} is not a number") from None
        return value if lo is None else self._at_least(key, value, lo)

    def rest(self) -> dict[str, str]:
        """Every option not read yet, as given (for a plugin that takes its own); all read now."""
        self._read.update(self._left)
        rest, self._left = self._left, {}
        return rest

    def refuse_unread(self, what: str = "") -> None:
        """Refuse the options no reader asked for.

        Raises:
            error: ``"<what>: unknown option(s) a, b (known: c, d)"`` (``what``: the spec's kind by
                default).
        """
        if self._left:
            known = f" (known: {', '.join(sorted(self._read))})" if self._read else ""
            raise self._error(f"{what or self._what}: unknown option(s) {', '.join(sorted(self._left))}{known}")

    def _bad(self, message: str) -> ValueError:
        return self._error(f"{self._what} {message}" if self._what else message)

    def _raw(self, key: str) -> str | None:
        self._read.add(key)
        return self._left.pop(key, None)

    def _at_least(self, key: str, value: _N, lo: float) -> _N:
        if value < lo:
            raise self._bad(f"option {key}={value} must be >= {lo}")
        return value

