"""Typed settings: one frozen dataclass per service, filled from CLI flags and environment.

Fields are declared with :func:`setting` (environment variable, bounds, help); :func:`add_arguments`
makes them ``--flag-name`` options and :func:`from_args` fills the dataclass with the precedence
*flag > environment > default*, refusing a bad value with a ``ValueError`` that names it. :func:`to_flags`
is the inverse, the command line ``streamtrain.cluster`` runs a child with. See README.md, *How the parts fit*.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class SettingsError(ValueError):
    """A setting has a bad value; the message names the flag, its variable and the value."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def setting(default: Any, *, env: str | None, help: str,  # noqa: A002 - `help` as in argparse
            min: float | None = None, max: float | None = None,  # noqa: A002 - the bounds, as the docs name them
            choices: Sequence[Any] | None = None, hidden: bool = False) -> Any:
    """Declare a settings field with its environment variable, bounds and help.

    ``hidden``: a switch for the tests, not the user: its flag and variable work as any other's,
    but ``--help`` does not list it.
    """
    return dataclasses.field(default=default, metadata={
        "env": env, "help": help, "min": min, "max": max,
        "choices": tuple(choices) if choices is not None else None, "hidden": hidden})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(field: str, kind: Any, raw: Any) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise SettingsError(f"{field}: expected a boolean (true/false), got {raw!r}")
    if kind in (int, float):
        try:
            return kind(raw)
        except (TypeError, ValueError):
            raise SettingsError(f"{field}: expected {kind.__name__}, got {raw!r}") from None
    return str(raw) if kind is str else raw


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> its scalar type, with ``X | None`` unwrapped to ``X``."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        out[name] = hint
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--flag`` per field of the settings dataclass ``cls``."""
    kinds = _field_types(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        env = meta.get("env")
        help_text = meta.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        suffix = f" [env {env}; default {default!r}]" if env else f" [default {default!r}]"
        help_text = argparse.SUPPRESS if meta.get("hidden") else help_text + suffix
        kind = kinds[f.name]
        if kind is bool:
            parser.add_argument(_flag(f.name), dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=None,
                                choices=meta.get("choices"), metavar=f.name.upper(), help=help_text)


def from_args(cls: type[T], args: argparse.Namespace | Mapping[str, Any] | None = None,
              environ: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from flags (``args``), then environment, then defaults.

    Raises:
        SettingsError: a value has the wrong type, is out of bounds or not among
            the choices; the message names the field (and its variable).
    """
    env_map = os.environ if environ is None else environ
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    kinds = _field_types(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        env = meta.get("env")
        label = f"{_flag(f.name)}" + (f" / {env}" if env else "")
        raw = given.get(f.name)
        if raw is None and env and env in env_map:
            raw = env_map[env]
        if raw is None:
            continue
        value = _convert(label, kinds[f.name], raw)
        lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
        if lo is not None and value < lo:
            raise SettingsError(f"{label}: must be >= {lo}, got {value!r}")
        if hi is not None and value > hi:
            raise SettingsError(f"{label}: must be <= {hi}, got {value!r}")
        if choices is not None and value not in choices:
            raise SettingsError(f"{label}: must be one of {', '.join(map(str, choices))}; got {value!r}")
        values[f.name] = value
    try:
        return cls(**values)
    except SettingsError:
        raise
    except (TypeError, ValueError) as exc:  # checks across fields in __post_init__
        raise SettingsError(f"{cls.__name__}: {exc}") from exc


def to_flags(settings: Any, *, omit: Collection[str] = ()) -> list[str]:
    """The flags that :func:`add_arguments`' parser and :func:`from_args` turn back into ``settings``.

    Every field is written, default or not, so the command line alone decides the
    settings: a variable the child process inherits cannot change them. A value is
    written ``--name=value`` (so an empty value, or one starting with ``-``, stays a
    value), a boolean ``--name`` or ``--no-name``. Left out: a field that is None
    (no flag spells None; it is then the default) and the fields named in ``omit``
    (e.g. secrets, passed in their environment variables instead, off the command
    line). For any settings object ``s`` of class ``C``::

        from_args(C, parser.parse_args(to_flags(s)), environ={}) == s

    Raises:
        ValueError: a field is None where its default is not, or ``omit`` names no field.
    """
    fields = dataclasses.fields(settings)
    unknown = set(omit) - {f.name for f in fields}
    if unknown:
        raise ValueError(f"{type(settings).__name__} has no field {', '.join(sorted(unknown))}")
    flags: list[str] = []
    for f in fields:
        if f.name in omit:
            continue
        value = getattr(settings, f.name)
        if value is None:
            if f.default is not None:
                raise ValueError(f"{type(settings).__name__}.{f.name}: None cannot be given as a flag "
                                 f"(its default is {f.default!r})")
            continue
        if isinstance(value, bool):
            flags.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            flags.append(f"{_flag(f.name)}={value}")
    return flags
