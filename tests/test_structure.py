"""The import drawing of the tree: one floor, one roof, no circles.

Packages sit on layers: ``common`` (the floor: key names, settings, outages)
under the planes (``datastream``, ``services``), the coordinator over them, the
trainers over the coordinator's client, and ``streamtrain`` (the roof: the
command, ``up``, the local cluster, the audit, the operator's scoring) on top.
An import may only point down or sideways within its own package, and no
modules import each other in a circle. Read from the source with :mod:`ast`,
so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"common": 0, "datastream": 1, "services": 1, "coordinator": 2, "trainers": 3, "streamtrain": 4}
"""Package -> layer; an import must not reach a higher layer, nor a peer on the same one."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute, ours or not (``from x import y`` yields ``x`` and
    ``x.y``: ``y`` may be a submodule)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    """Our module -> the modules of ours it imports."""
    paths = [p for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")]
    ours = {_module_name(p) for p in paths}
    return {_module_name(p): {m for m in _imports(p) if m in ours and m != _module_name(p)} for p in paths}


def test_every_package_has_a_layer() -> None:
    from tomllib import loads

    include = loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} == set(LAYERS)


def test_imports_only_point_down() -> None:
    upward = []
    for module, targets in _graph().items():
        here = module.split(".")[0]
        for target in targets:
            there = target.split(".")[0]
            if there != here and LAYERS[there] >= LAYERS[here]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run up or sideways:\n" + "\n".join(sorted(upward))


def test_no_module_imports_itself_in_a_circle() -> None:
    # a package's __init__ re-exporting its modules is not a circle: drop edges into a package
    # from its own modules, which Python resolves by importing the package first
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in _graph().items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


HEAVY = ("redis", "aiohttp", "prometheus_client", "torch", "kafka")
"""What a pure module must not import: clients of the servers, the metrics library, the tensor library."""


@pytest.mark.parametrize("module", ["trainers.state", "trainers.progress", "coordinator.membership",
                                    "coordinator.assignment", "coordinator.history", "coordinator.tables",
                                    "services.clocks"])
def test_pure_modules_import_no_io(module: str) -> None:
    """A pure core imports its rules and their data types, nothing that does I/O (checked in a fresh
    interpreter: a package ``__init__`` re-exporting a heavy module would drag it in)."""
    probe = (f"import sys, {module}; "
             f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.split()
    assert not found, f"importing {module} imports {', '.join(found)}"


@pytest.mark.parametrize("package", ["common", "datastream", "services", "coordinator", "trainers", "streamtrain"])
def test_every_public_name_of_a_package_resolves(package: str) -> None:
    """Every name in a package's ``__all__`` can be read (those imported on first use included), and
    a name exported from a submodule of the same name stays the export once the submodule is bound."""
    pkg = importlib.import_module(package)
    for name in getattr(pkg, "__all__", ()):
        value = getattr(pkg, name)
        assert not (isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}"), name


def _lazy_packages() -> list[str]:
    return [pkg for pkg in LAYERS if "lazy_exports(" in (ROOT / pkg / "__init__.py").read_text()]


def _type_checking_imports(package: str) -> dict[str, str]:
    """Name -> relative module of each import in the ``if TYPE_CHECKING:`` blocks of ``package``'s
    ``__init__.py`` (what type checkers and editors read, since the names are imported lazily)."""
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.level == 1, ast.unparse(stmt)
                found.update({alias.asname or alias.name: f".{stmt.module}" for alias in stmt.names})
    return found


def test_the_lazy_packages_are_found() -> None:
    assert {"services", "coordinator", "trainers"} <= set(_lazy_packages())


@pytest.mark.parametrize("package", _lazy_packages())
def test_a_lazy_package_shows_type_checkers_every_export_from_its_home(package: str) -> None:
    """A package whose names are imported on first use (:func:`common.exports.lazy_exports`) imports
    the same names from the same modules under ``if TYPE_CHECKING:``, so mypy sees them: the two
    lists cannot drift apart."""
    pkg = importlib.import_module(package)
    assert _type_checking_imports(package) == dict(pkg._export_homes)
    assert set(_type_checking_imports(package)) == set(pkg.__all__)
