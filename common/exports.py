"""A package's public names, each imported from its module on first use.

A package that re-exports its modules' names with ``from .x import y`` runs all
of those modules whenever any one of its modules is imported: ``import
coordinator.assignment`` (three frozen dataclasses) would pull in aiohttp and
redis through ``coordinator/__init__.py``. A package that calls
:func:`lazy_exports` instead says where each public name lives; the module that
holds a name is imported the first time the name is read
(``from coordinator import CoordinatorClient`` works as before), so a pure
module such as ``trainers.state`` imports only what it uses itself.

Usage, at the end of a package's ``__init__.py``::

    __all__ = ["Store", "assign"]
    lazy_exports(__name__, __all__, {
        ".state": ("Store",),
        ".assign": ("assign",),
    })

    if TYPE_CHECKING:  # the same names, for type checkers, which do not run lazy_exports
        from .assign import assign
        from .state import Store

(``tests/test_structure.py`` checks that the ``TYPE_CHECKING`` imports name the same modules.)

It is PEP 562's module ``__getattr__``, plus one rule an eager ``from .assign
import assign`` gave for free: a name exported from a submodule of the same name
(``coordinator.assign``, ``trainers.evaluate``) stays the exported function when
the import system binds the submodule on the package. Python documents setting
a module's ``__class__`` to a :class:`types.ModuleType` subclass for this
(*Customizing module attribute access*); that is what :class:`LazyPackage` is.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Collection, Mapping
from typing import Any, cast

__all__ = ["LazyPackage", "lazy_exports"]


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


def lazy_exports(package: str, public: Collection[str], homes: Mapping[str, Collection[str]]) -> None:
    """Make ``package`` (a package's ``__name__``, called from its ``__init__``) a
    :class:`LazyPackage` whose ``public`` names live in the modules of ``homes`` (relative module
    name -> the names it holds).

    Raises:
        ValueError: ``public`` and the names of ``homes`` differ (the message lists the difference),
            or a name is given for two modules.
    """
    home: dict[str, str] = {}
    for module, names in homes.items():
        for name in names:
            if name in home:
                raise ValueError(f"{package}: {name!r} is exported from both {home[name]} and {module}")
            home[name] = module
    if set(home) != set(public):
        raise ValueError(f"{package}: __all__ and the exported names differ: "
                         f"not exported {sorted(set(public) - set(home))}, "
                         f"not in __all__ {sorted(set(home) - set(public))}")
    pkg = sys.modules[package]
    pkg.__class__ = LazyPackage
    cast(LazyPackage, pkg)._export_homes = home
