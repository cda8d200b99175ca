"""The tree passes its linter and its type checker, and says why wherever it silences them.

``ruff check`` and ``mypy`` run over the tree with the rules in ``pyproject.toml``
(``[tool.ruff]``, ``[tool.mypy]``: what each checks, and why each rule left out is left out), as
part of the README's test command, so CI runs them; a failure shows their report. A ``# noqa`` or
``# type: ignore`` names the codes it silences and says why on the same line
(``# noqa: BLE001 - a scrape reports what it can``, ``# type: ignore[abstract]  # why``).
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("common", "datastream", "services", "coordinator", "trainers", "streamtrain", "bench", "scripts", "tests")
"""The folders of Python code in the repository."""

_CODES = r"[A-Za-z]+[0-9]+(?:\s*,\s*[A-Za-z]+[0-9]+)*"
_NOQA = re.compile(rf"#\s*(?:ruff:\s*|flake8:\s*)?noqa\b(?P<codes>:\s*{_CODES})?(?P<rest>.*)", re.IGNORECASE)
_ERROR_CODES = r"[a-z][a-z0-9-]*(?:\s*,\s*[a-z][a-z0-9-]*)*"
_IGNORE = re.compile(rf"#\s*type:\s*ignore\b(?P<codes>\[\s*{_ERROR_CODES}\s*\])?(?P<rest>.*)")
_NOQA_REASON = re.compile(r"^\s*(?:-|#)\s*\S")
"""After a noqa's codes: `` - why`` (the house style) or ``  # why``."""
_IGNORE_REASON = re.compile(r"^\s*#\s*\S")
"""After a type: ignore's codes: ``  # why``."""


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_passes() -> None:
    done = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert done.returncode == 0, f"ruff check found problems:\n{done.stdout}{done.stderr}"


@pytest.mark.timeout(900)  # a first run without mypy's cache takes ~40 s on two loaded cores
def test_mypy_passes() -> None:
    done = _run("mypy")  # the files and settings are pyproject.toml's [tool.mypy]
    assert done.returncode == 0, f"mypy found problems:\n{done.stdout}{done.stderr}"


def unexplained_suppressions(source: str) -> list[tuple[int, str]]:
    """(line, comment) of each ``noqa`` or ``type: ignore`` comment in ``source`` that names no
    code or gives no reason after its codes."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        for pattern, reason in ((_NOQA, _NOQA_REASON), (_IGNORE, _IGNORE_REASON)):
            match = pattern.search(tok.string)
            if match and not (match["codes"] and reason.match(match["rest"])):
                found.append((tok.start[0], tok.string))
                break
    return found


@pytest.mark.parametrize(("line", "ok"), [
    ("x = 1  # noqa: E501 - a URL", True),
    ("x = 1  # noqa: BLE001, E501  # a URL and a catch-all", True),
    ("x = 1  # type: ignore[attr-defined]  # redis-py's stubs lack it", True),
    ("x = 1  # type: ignore[misc, valid-type]  # a base class chosen at run time", True),
    ("x = 1  # a plain comment that talks of noqa-free code", True),
    ('x = "# noqa"  # the text of a string is not a comment', True),
    ("x = 1  # noqa", False),
    ("x = 1  # noqa: E501", False),
    ("x = 1  # noqa: E501 -", False),
    ("x = 1  # NOQA", False),
    ("# ruff: noqa", False),
    ("# ruff: noqa: E402 - the file puts the repository on sys.path first", True),
    ("x = 1  # type: ignore", False),
    ("x = 1  # type: ignore  # why", False),
    ("x = 1  # type: ignore[attr-defined]", False),
    ("x = 1  # type: ignore[attr-defined] - why", False),
    ("x = 1  # noqa: E501 - long  # type: ignore", False),
])
def test_a_suppression_needs_its_codes_and_a_reason(line: str, ok: bool) -> None:
    assert (unexplained_suppressions(line + "\n") == []) is ok


def test_every_suppression_in_the_tree_names_its_codes_and_says_why() -> None:
    bad = [f"{path.relative_to(ROOT)}:{n}: {comment}"
           for folder in CHECKED for path in sorted((ROOT / folder).rglob("*.py"))
           for n, comment in unexplained_suppressions(path.read_text())]
    assert not bad, "a noqa or type: ignore without its codes or a reason:\n" + "\n".join(bad)
