"""The README's examples run as written: every ``streamtrain`` command in it parses with that
subcommand's real parser, and every script or file it runs exists.

(The commands that need servers are run for real by the tests of what they do: the e2e tests
run ``coordinator --ps-groups 2`` with ``ps --groups 2 --group g``, the checkpoint tests run
``checkpoint save|restore`` through the same CLI; here a renamed flag or subcommand fails.)
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from common import settings as cfg
from streamtrain.cli import COMMANDS, build_parser
from streamtrain.settings import UpSettings
from streamtrain.up import Outcome, Task, exit_code

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_lines() -> list[str]:
    """Shell lines of the README's fenced and indented code blocks (continuations joined) and its
    inline ``streamtrain ...`` spans."""
    lines: list[str] = []
    fenced = False
    for raw in README.splitlines():
        if raw.startswith("```"):
            fenced = not fenced
            continue
        if fenced or raw.startswith("    "):
            lines.append(raw.strip())
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    inline = re.findall(r"`(streamtrain [^`]+)`", README)  # commands quoted in the prose
    return [line for line in joined + inline if line and not line.startswith("#")]


def _commands() -> list[list[str]]:
    """Every ``streamtrain ...`` invocation (a line may hold several, joined by ``&``/``&&``/``;``)."""
    found = []
    for line in _code_lines():
        line = line.split(" #", 1)[0]
        for part in re.split(r"\s(?:&&|&|;|\|)\s?", line):
            words = shlex.split(re.sub(r"\[(--[^\]]*)\]", r"\1", part))  # a synopsis: [--flag X]
            while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
                words = words[1:]
            if words and words[0] == "streamtrain":
                found.append(words[1:])
    return found


COMMAND_LINES = _commands()


def test_the_readme_has_streamtrain_examples() -> None:
    assert {"up", "ps", "coordinator", "checkpoint"} <= {words[0] for words in COMMAND_LINES if words}


@pytest.mark.parametrize("words", COMMAND_LINES, ids=lambda w: " ".join(w)[:60])
def test_every_streamtrain_example_parses(words: list[str]) -> None:
    if not words or words[0] in ("--help", "-h"):
        return
    assert words[0] in COMMANDS, f"streamtrain {words[0]}: no such subcommand"
    args = [w for w in words[1:] if w not in ("--help", "-h")]
    build_parser(words[0]).parse_args(args)  # exits (SystemExit) on a flag that does not exist


def test_every_script_and_file_an_example_runs_exists() -> None:
    missing = []
    for line in _code_lines():
        for word in shlex.split(line.split(" #", 1)[0], posix=True):
            if re.fullmatch(r"(scripts|bench|compose|docs)/[\w./-]+", word) and not (ROOT / word).exists():
                missing.append(word)
    assert not missing, f"the README runs files that do not exist: {missing}"


def test_the_readme_names_every_exit_code_of_up() -> None:
    codes = {exit_code(outcome, cfg.from_args(UpSettings, {"forever": forever, "max_records": records}, environ={}),
                       Task(classification))
             for outcome in Outcome for forever in (False, True) for records in (0, 5)
             for classification in (False, True)}
    text = " ".join(README.split())
    start = text.find("`up` exits ")
    assert start >= 0, "the README says nothing of up's exit codes"
    sentence = text[start:text.index(". ", start)]
    said = {int(n) for n in re.findall(r"(?:^`up` exits |, (?:and )?)(\d+) when\b", sentence)}
    assert said == codes, f"the README names exit codes {sorted(said)}, up returns {sorted(codes)}: {sentence}"
