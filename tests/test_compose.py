"""compose/docker-compose.yml is checked by parsing it (no container engine here).

Every one of our services must run a real ``streamtrain`` subcommand whose
flags parse, every ``STREAMTRAIN_*`` variable it sets must be a setting that
exists, and every Kafka or Redis address it is given must point at a service
the file defines, on the port that service listens on.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import yaml

from streamtrain.cli import COMMANDS, build_parser

COMPOSE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
OUR_PACKAGES = ("streamtrain", "services", "coordinator", "trainers", "datastream")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _our_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if "build" in svc}


def _known_env_names() -> set[str]:
    """Every environment variable declared by a settings dataclass in our packages."""
    names: set[str] = set()
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.split(".")[0] in OUR_PACKAGES or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and dataclasses.is_dataclass(obj):
                names.update(f.metadata["env"] for f in dataclasses.fields(obj)
                             if f.metadata.get("env"))
    return names


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_infrastructure_services(compose: dict) -> None:
    services = compose["services"]
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    kenv = _env(kafka)
    assert "controller" in kenv["KAFKA_PROCESS_ROLES"] and "broker" in kenv["KAFKA_PROCESS_ROLES"]
    assert "healthcheck" in kafka
    redis = services["redis"]
    assert redis["image"].startswith("redis:")
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert "healthcheck" in redis


def test_every_service_runs_a_real_cli_command(compose: dict) -> None:
    ours = _our_services(compose)
    assert {"coordinator", "ps", "trainer", "producer"} <= set(ours)
    for name, svc in ours.items():
        command = svc["command"]
        assert command[0] == "streamtrain", f"{name}: command must start with streamtrain"
        sub = command[1]
        assert sub in COMMANDS, f"{name}: {sub!r} is not a streamtrain subcommand"
        parser = build_parser(sub)
        try:
            parser.parse_args(command[2:])
        except SystemExit as exc:  # argparse refuses unknown or malformed flags
            pytest.fail(f"{name}: flags {command[2:]} do not parse for 'streamtrain {sub}' ({exc})")


def test_environment_names_are_real_settings(compose: dict) -> None:
    ours = _our_services(compose)
    for svc in ours.values():
        build_parser(svc["command"][1])  # imports the command's settings
    known = _known_env_names()
    for name, svc in ours.items():
        for var in _env(svc):
            if var.startswith("STREAMTRAIN_"):
                assert var in known, f"{name}: {var} is not a setting of any streamtrain service"


def _listen_ports(compose: dict) -> dict[str, set[int]]:
    ports: dict[str, set[int]] = {}
    kenv = _env(compose["services"]["kafka"])
    ports["kafka"] = {int(m) for m in re.findall(r"PLAINTEXT://[^:,]*:(\d+)", kenv["KAFKA_LISTENERS"])}
    redis_cmd = compose["services"]["redis"]["command"]
    ports["redis"] = {int(redis_cmd[redis_cmd.index("--port") + 1])} if "--port" in redis_cmd else {6379}
    return ports


def test_addresses_point_at_defined_services(compose: dict) -> None:
    services = compose["services"]
    ports = _listen_ports(compose)
    for name, svc in _our_services(compose).items():
        values = list(_env(svc).values()) + [str(a) for a in svc["command"][2:]]
        for value in values:
            for host, port in re.findall(r"(?:redis://|^|,)([a-z][a-z0-9_-]*):(\d+)", value):
                assert host in services, f"{name}: {value!r} names undefined service {host!r}"
                if host in ports:
                    assert int(port) in ports[host], f"{name}: {host} does not listen on {port}"
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on undefined {dep}"
            assert cond["condition"] in {"service_healthy", "service_started",
                                         "service_completed_successfully"}


def test_kafka_advertises_the_address_our_services_use(compose: dict) -> None:
    kenv = _env(compose["services"]["kafka"])
    advertised = kenv["KAFKA_ADVERTISED_LISTENERS"]
    bootstraps = {v for svc in _our_services(compose).values() for k, v in _env(svc).items()
                  if k.endswith("BOOTSTRAP")}
    assert bootstraps, "no service is given the Kafka bootstrap address"
    for b in bootstraps:
        assert b in advertised, f"{b} is not among Kafka's advertised listeners {advertised}"


def test_trainer_is_scalable(compose: dict) -> None:
    trainer = compose["services"]["trainer"]
    assert "container_name" not in trainer  # a fixed name would forbid --scale
    assert "ports" not in trainer or all(":" not in str(p) for p in trainer["ports"])
