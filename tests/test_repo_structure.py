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
LAYERS = {"common": 0, "datastream": 1, "services": 1, "coordinator": 2, "trainers": 3, "serving": 4, "streamtrain": 5}
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
                                    "services.clocks", "services.server.core",
                                    "services.slot_types", "services.local_steps"])
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
    """Every package (sub-packages too) whose ``__init__`` calls :func:`common.exports.lazy_exports`."""
    return sorted(_module_name(init) for pkg in LAYERS for init in (ROOT / pkg).rglob("__init__.py")
                  if "lazy_exports(" in init.read_text())


def test_the_lazy_packages_are_found() -> None:
    assert {"services", "coordinator", "trainers"} <= set(_lazy_packages())


@pytest.mark.parametrize("package", _lazy_packages())
def test_a_lazy_package_writes_its_public_names_once(package: str) -> None:
    """A package whose names are imported on first use declares them once, as the explicit
    re-exports of its ``if TYPE_CHECKING:`` block (what mypy and editors read): ``lazy_exports`` is
    given no list of its own, nothing else assigns ``__all__``, and each name read from the package
    is the object its declared module holds."""
    from common.exports import declared_exports

    init = ROOT / Path(*package.split(".")) / "__init__.py"
    tree = ast.parse(init.read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "lazy_exports"]
    assert [ast.unparse(call) for call in calls] == ["lazy_exports(__name__)"]
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "__all__"]
    pkg = importlib.import_module(package)
    homes = declared_exports(init.read_text(), package)
    assert dict(pkg._export_homes) == homes and pkg.__all__ == list(homes)
    for name, home in homes.items():
        assert getattr(pkg, name) is getattr(importlib.import_module(home, package), name), name


@pytest.mark.parametrize("block,message", [
    ("from .state import Store", "not 'from .state import Store'"),          # no re-export for mypy
    ("from .state import Store as Shop", "not 'from .state import Store as Shop'"),
    ("from common.keys import JobKeys as JobKeys", "not 'from common.keys"),  # not one of its modules
    ("import json", "not 'import json'"),
    ("from .state import Store as Store\n    from .shop import Store as Store", "both .state and .shop"),
    (None, "no 'if TYPE_CHECKING:' block"),
])
def test_the_declaration_of_a_lazy_package_is_checked(block: str | None, message: str) -> None:
    from common.exports import declared_exports

    source = "from typing import TYPE_CHECKING\n" + (f"\nif TYPE_CHECKING:\n    {block}\n" if block else "")
    with pytest.raises(ValueError, match=message):
        declared_exports(source, "pkg")


def test_a_lazy_package_imports_a_module_when_one_of_its_names_is_first_read(tmp_path: Path) -> None:
    """The declared names resolve on first use, each from its module (not before), and ``__all__``
    lists them as written."""
    package = tmp_path / "lazy_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom common.exports import lazy_exports\n\nlazy_exports(__name__)\n\n"
        "if TYPE_CHECKING:\n    from .b import two as two\n    from .a import ONE as ONE\n")
    (package / "a.py").write_text("ONE = 1\n")
    (package / "b.py").write_text("def two() -> int:\n    return 2\n")
    probe = ("import sys, lazy_probe_pkg as p; before = 'lazy_probe_pkg.a' in sys.modules; "
             "print(p.__all__, before, p.ONE, 'lazy_probe_pkg.a' in sys.modules, 'lazy_probe_pkg.b' in sys.modules, "
             "p.two())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}"}).stdout
    assert out.split() == ["['two',", "'ONE']", "False", "1", "True", "False", "2"]
