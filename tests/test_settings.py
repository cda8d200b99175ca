"""``common.settings.to_flags`` is the inverse of ``add_arguments`` + ``from_args``: every service's
settings survive the trip through their own command line. Pure, no servers."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.settings import _field_types, add_arguments, from_args, setting, to_flags
from coordinator.settings import CoordinatorSettings
from datastream.cli import ProduceSettings
from services.server import ServerSettings
from streamtrain.cli import build_parser
from trainers.settings import TrainerSettings

SERVICES = {"coordinator": CoordinatorSettings, "trainer": TrainerSettings, "ps": ServerSettings,
            "produce": ProduceSettings}
"""Subcommand -> its settings dataclass."""


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
    if "groups" in values:  # group must stay below groups
        values.update(groups=5, group=3)
    return type(settings)(**values)


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_defaults_and_changed_settings_round_trip_through_the_services_parsers(command: str) -> None:
    cls = SERVICES[command]
    moved = changed(cls())
    assert all(getattr(moved, f.name) != f.default for f in dataclasses.fields(cls))
    for settings in (cls(), moved):
        flags = to_flags(settings)
        assert from_args(cls, build_parser(command).parse_args(flags), environ={}) == settings, flags


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_the_flags_win_over_the_environment(command: str) -> None:
    # every field is on the command line, so an inherited variable changes nothing (None-valued fields aside)
    cls = SERVICES[command]
    settings = cls()
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
