"""A package's public names, each imported from its module on first use.

A package that re-exports its modules' names with ``from .x import y`` runs all
of those modules whenever any one of its modules is imported: ``import
coordinator.assignment`` (three frozen dataclasses) would pull in aiohttp and
redis through ``coordinator/__init__.py``. A package that calls
:func:`lazy_exports` instead says where each public name lives; the module that
holds a name is imported the first time the name is read
(``from coordinator import CoordinatorClient`` works as before), so a pure
module such as ``trainers.state`` imports only what it uses itself.

The public names are written once: as the explicit re-exports (PEP 484's ``import A as A``)
of the ``if TYPE_CHECKING:`` block of the package's ``__init__.py``. Type checkers and editors
read them as eager imports; :func:`lazy_exports` reads the same block (with :mod:`ast`, from
the package's source) for each name's module, and sets ``__all__`` to the names::

    from typing import TYPE_CHECKING

    from common.exports import lazy_exports

    lazy_exports(__name__)

    if TYPE_CHECKING:  # the public names, each from its module (lazy_exports reads this block)
        from .assign import assign as assign
        from .state import Store as Store

It is PEP 562's module ``__getattr__``, plus one rule an eager ``from .assign
import assign`` gave for free: a name exported from a submodule of the same name
(``coordinator.assign``, ``trainers.evaluate``) stays the exported function when
the import system binds the submodule on the package. Python documents setting
a module's ``__class__`` to a :class:`types.ModuleType` subclass for this
(*Customizing module attribute access*); that is what :class:`LazyPackage` is.
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
