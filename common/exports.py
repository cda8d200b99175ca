"""A package's public names, each imported from its module on first use.

An eager ``from .x import y`` in a package's ``__init__.py`` would run all of its modules whenever any
one is imported (aiohttp and redis for three frozen dataclasses). :func:`lazy_exports` reads the public
names from the ``if TYPE_CHECKING:`` re-exports of the package's ``__init__.py`` (written once, read by
type checkers too) and imports each name's module when the name is first read (PEP 562).
See docs/architecture.md, *The three planes* (*Imports on first use*).
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any, cast

__all__ = ["LazyPackage", "declared_exports", "lazy_exports"]


class LazyPackage(types.ModuleType):
    """A package whose public names are imported from their modules on first use."""

    _export_homes: Mapping[str, str]
    """Public name -> the (relative) module that holds it."""

    def __getattr__(self, name: str) -> Any:
        homes = self.__dict__.get("_export_homes", {})
        if name not in homes:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name], self.__name__), name)
        setattr(self, name, value)  # later reads are plain attribute reads
        return value

    def __dir__(self) -> list[str]:
        return sorted({*self.__dict__, *self.__dict__.get("_export_homes", {})})

    def __setattr__(self, name: str, value: Any) -> None:
        if (isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}"
                and name in self.__dict__.get("_export_homes", {})):
            return  # the import system binds submodule `name`: the exported `name` wins, as when eager
        super().__setattr__(name, value)


def declared_exports(source: str, package: str = "<package>") -> dict[str, str]:
    """Public name -> relative module (``.state``), in the order written, of the explicit
    re-exports in the top-level ``if TYPE_CHECKING:`` blocks of ``source`` (a package's
    ``__init__.py``).

    Raises:
        ValueError: the blocks hold anything but ``from .module import Name as Name`` (a plain
            ``import Name`` is no re-export for type checkers), a name is declared twice, or
            there is no name at all; the message quotes the statement.
    """
    homes: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module
                    and all(alias.asname == alias.name for alias in stmt.names)):
                raise ValueError(f"{package}: its TYPE_CHECKING block may only re-export names of its modules "
                                 f"as 'from .module import Name as Name', not {ast.unparse(stmt)!r}")
            for alias in stmt.names:
                if alias.name in homes:
                    raise ValueError(f"{package}: {alias.name!r} is exported from both {homes[alias.name]} "
                                     f"and .{stmt.module}")
                homes[alias.name] = f".{stmt.module}"
    if not homes:
        raise ValueError(f"{package}: no 'if TYPE_CHECKING:' block of 'from .module import Name as Name' "
                         "declares its public names")
    return homes


def lazy_exports(package: str) -> None:
    """Make ``package`` (a package's ``__name__``, called from its ``__init__``) a
    :class:`LazyPackage` whose public names are those its ``if TYPE_CHECKING:`` block re-exports
    (:func:`declared_exports`), and set its ``__all__`` to them.

    Raises:
        ValueError: see :func:`declared_exports`; or the package's source cannot be read.
    """
    pkg = sys.modules[package]
    loader = pkg.__spec__.loader if pkg.__spec__ is not None else None
    get_source = getattr(loader, "get_source", None)
    source = get_source(package) if get_source is not None else None
    if source is None:
        raise ValueError(f"{package}: lazy_exports reads the package's source, and its loader has none")
    homes = declared_exports(source, package)
    pkg.__class__ = LazyPackage
    cast(LazyPackage, pkg)._export_homes = homes
    pkg.__dict__["__all__"] = list(homes)
