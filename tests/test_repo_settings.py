"""``common.settings.to_flags`` is the inverse of ``add_arguments`` + ``from_args``: every service's
settings survive the trip through their own command line; each lives in its package's ``settings.py``;
test-only switches stay out of ``--help``. Pure, no servers."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from common.settings import _field_types, add_arguments, from_args, setting, to_flags
from coordinator.settings import CoordinatorSettings
from datastream.settings import EventsSettings, JoinSettings, ProduceSettings
from services.settings import ExportSettings, ServerSettings
from streamtrain.cli import COMMANDS, build_parser
from streamtrain.settings import UpSettings
from trainers.settings import TrainerSettings

SERVICES = {"coordinator": CoordinatorSettings, "trainer": TrainerSettings, "ps": ServerSettings,
            "produce": ProduceSettings, "export": ExportSettings, "up": UpSettings, "join": JoinSettings,
            "produce-events": EventsSettings}
"""Subcommand -> its settings dataclass."""

TEST_ONLY = {"ps": {"fault", "fault_at"}}
"""Subcommand -> the fields its ``--help`` must not show (switches for the tests, not the user)."""


def changed(settings: object) -> object:
    """``settings`` with every field moved off its default to a valid value (within its bounds, among
    its choices); strings become awkward ones: empty, starting like a flag, with spaces and ``=``."""
    awkward = ["", "-starts like a flag", "with spaces = and ?x=1&y=2"]
    values: dict[str, object] = {}
    for f in dataclasses.fields(settings):
        meta, value, kind = f.metadata, getattr(settings, f.name), _field_types(type(settings))[f.name]
        if meta.get("choices"):
            values[f.name] = next(c for c in reversed(meta["choices"]) if c != value)
        elif kind is bool:
            values[f.name] = not value
        elif kind in (int, float):
            values[f.name] = kind(meta["max"]) if meta.get("max") is not None else kind((value or 0) * 2 + 7)
        else:
            turn = len(values) % len(awkward)
            values[f.name] = next(a for a in awkward[turn:] + awkward[:turn] if a != value)
    if "heartbeat_interval_ms" in values:  # must stay below the lease (both at their maxima)
        values["heartbeat_interval_ms"] = min(int(values["heartbeat_interval_ms"]), int(values["lease_ms"]) - 1)
    if "local_steps" in values and values.get("optimizer") == "dgc":  # local steps need an inner optimizer
        values["optimizer"] = "adam"
    if "groups" in values:  # group must stay below groups
        values.update(groups=5, group=3)
    if "negative_rate" in values:  # its maximum (1: keep every negative) is its default
        values["negative_rate"] = 0.25
    if isinstance(settings, JoinSettings):  # topics of their own, several feedback topics
        values.update(impressions="imps with = spaces", feedback="-fb,other fb", topic="", late="late ?x=1",
                      app_id="-app", instance_id="host 2")
    if isinstance(settings, ExportSettings):  # a valid job name, a file, a version's form
        values.update(job="other-job", out="-starts like a flag.safetensors", version="12.7")
    return type(settings)(**values)


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_defaults_and_changed_settings_round_trip_through_the_services_parsers(command: str) -> None:
    cls = SERVICES[command]
    moved = changed(defaults(cls))
    assert all(getattr(moved, f.name) != f.default for f in dataclasses.fields(cls))
    for settings in (defaults(cls), moved):
        flags = to_flags(settings)
        assert from_args(cls, build_parser(command).parse_args(flags), environ={}) == settings, flags


def defaults(cls: type) -> object:
    """``cls`` at its defaults (export has no default file)."""
    return cls(out="model.safetensors") if cls is ExportSettings else cls()


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_the_flags_win_over_the_environment(command: str) -> None:
    # every field is on the command line, so an inherited variable changes nothing (None-valued fields aside)
    cls = SERVICES[command]
    settings = defaults(cls)
    hostile = {f.metadata["env"]: "not a value" for f in dataclasses.fields(cls)
               if f.metadata.get("env") and getattr(settings, f.name) is not None}
    assert from_args(cls, build_parser(command).parse_args(to_flags(settings)), environ=hostile) == settings


def test_omitted_fields_are_left_to_the_environment() -> None:
    settings = CoordinatorSettings(job_token="j-secret", admin_token="a-secret")
    flags = to_flags(settings, omit=("job_token", "admin_token"))
    assert not any("secret" in f for f in flags)
    environ = {"STREAMTRAIN_JOB_TOKEN": "j-secret", "STREAMTRAIN_ADMIN_TOKEN": "a-secret"}
    assert from_args(CoordinatorSettings, build_parser("coordinator").parse_args(flags), environ) == settings
    with pytest.raises(ValueError, match="no field nope"):
        to_flags(settings, omit=("nope",))


@dataclasses.dataclass(frozen=True)
class Optional:
    rate: float | None = setting(None, env=None, help="a rate")
    size: int | None = setting(3, env=None, help="a size")
    flag: bool = setting(False, env=None, help="a flag")


def test_booleans_none_and_values_are_spelt_as_argparse_reads_them() -> None:
    assert to_flags(Optional(rate=0.5, size=4, flag=True)) == ["--rate=0.5", "--size=4", "--flag"]
    assert to_flags(Optional()) == ["--size=3", "--no-flag"]  # None: left out, the default
    with pytest.raises(ValueError, match="size: None cannot be given as a flag"):
        to_flags(Optional(size=None))
    parser = argparse.ArgumentParser()
    add_arguments(parser, Optional)
    for settings in (Optional(), Optional(rate=1e-7, size=-2, flag=True)):
        assert from_args(Optional, parser.parse_args(to_flags(settings)), environ={}) == settings


def test_every_command_with_settings_declares_them_in_its_packages_settings_module() -> None:
    for command, cls in SERVICES.items():
        package = COMMANDS[command][0].split(".")[0]
        assert cls.__module__ == f"{package}.settings", command


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_every_setting_but_the_test_only_switches(command: str) -> None:
    text = build_parser(command).format_help()
    hidden = TEST_ONLY.get(command, set())
    cls = SERVICES.get(command)
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    assert {name for name, f in fields.items() if f.metadata["hidden"]} == hidden
    for name in fields:
        flag = "--" + name.replace("_", "-")
        shown = re.search(rf"{re.escape(flag)}[\s=,]", text) is not None
        assert shown == (name not in hidden), f"streamtrain {command} --help: {flag} shown={shown}"


def test_a_hidden_switch_is_still_set_by_its_flag_and_its_variable() -> None:
    parser = build_parser("ps")
    given = from_args(ServerSettings, parser.parse_args(["--fault", "kill-after-write", "--fault-at", "3"]),
                      environ={})
    assert (given.fault, given.fault_at) == ("kill-after-write", 3)
    from_env = from_args(ServerSettings, parser.parse_args([]), environ={"STREAMTRAIN_PS_FAULT": "kill-before-write",
                                                                        "STREAMTRAIN_PS_FAULT_AT": "2"})
    assert (from_env.fault, from_env.fault_at) == ("kill-before-write", 2)
    with pytest.raises(SystemExit):  # its choices still hold
        parser.parse_args(["--fault", "explode"])


def test_the_parameter_plane_doc_lists_every_ps_setting() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "parameter-plane.md").read_text()
    section = doc.split("## Settings of `streamtrain ps`", 1)[1].split("\n## ", 1)[0]
    missing = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(ServerSettings)
               if f"`--{f.name.replace('_', '-')}`" not in section and f"`--{f.name.replace('_', '-')}/" not in section]
    assert not missing, f"docs/parameter-plane.md's ps settings omit {missing}"
