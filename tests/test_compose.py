"""compose/docker-compose.yml is checked by parsing it (no container engine here).

Every one of our services must run a real ``streamtrain`` subcommand whose
flags parse, every ``STREAMTRAIN_*`` variable it sets must be a setting that
exists, and every Kafka or Redis address it is given must point at a service
the file defines, on the port that service listens on. Secrets have no
defaults: the file is interpolated the way compose does it (``${VAR}``,
``${VAR:-default}``, ``${VAR:?message}``), with made-up values for the secrets,
and refuses to interpolate without them.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from streamtrain.cli import COMMANDS, build_parser

COMPOSE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
OUR_PACKAGES = ("streamtrain", "services", "coordinator", "trainers", "datastream")
SECRETS = ("STREAMTRAIN_JOB_TOKEN", "STREAMTRAIN_ADMIN_TOKEN", "STREAMTRAIN_REDIS_PASSWORD")
"""Variables compose must refuse to start without."""
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|_AUTH$|_KEY$")
"""Names that hold a secret, wherever they appear in the file."""
TEST_ENV = {name: f"test-{name.lower().replace('_', '-')}" for name in SECRETS}
"""What the shell gives compose in these tests (URL-safe, like the file asks)."""

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}; $$ is a literal $
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


class MissingVariable(Exception):
    """A ``${NAME:?message}`` (or ``${NAME?message}``) was not set: compose refuses to start."""


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """``value`` with its variables replaced the way docker compose does.

    Raises:
        MissingVariable: a required variable is unset (or empty, for ``:?``);
            the message is the file's message.
    """
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name", "op", "arg")
        given = env.get(name)
        missing = given is None or (given == "" and op is not None and op.startswith(":"))
        if op is None:
            return given or ""
        if op.endswith("-"):
            return arg if missing else given  # type: ignore[return-value]
        if missing:
            raise MissingVariable(f"{name}: {arg}")
        return given  # type: ignore[return-value]

    if "$" in _VAR.sub("", value):
        raise AssertionError(f"unsupported interpolation in {value!r}")
    return _VAR.sub(one, value)


def interpolate_all(node: Any, env: Mapping[str, str]) -> Any:
    """Every string of a parsed compose file interpolated (keys are never interpolated)."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_all(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_all(v, env) for k, v in node.items()}
    return node


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    return []


@pytest.fixture(scope="module")
def raw() -> dict:
    """The file as YAML, before interpolation."""
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw: dict) -> dict:
    """The file as compose runs it with the secrets set."""
    return interpolate_all(raw, TEST_ENV)


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


def _redis_password(compose: dict) -> str:
    command = compose["services"]["redis"]["command"]
    assert "--requirepass" in command, "Redis must require a password"
    return command[command.index("--requirepass") + 1]


def _listen_ports(compose: dict) -> dict[str, set[int]]:
    ports: dict[str, set[int]] = {}
    kenv = _env(compose["services"]["kafka"])
    ports["kafka"] = {int(m) for m in re.findall(r"PLAINTEXT://[^:,]*:(\d+)", kenv["KAFKA_LISTENERS"])}
    redis_cmd = compose["services"]["redis"]["command"]
    ports["redis"] = {int(redis_cmd[redis_cmd.index("--port") + 1])} if "--port" in redis_cmd else {6379}
    return ports


def _addresses(value: str) -> list[tuple[str, int]]:
    """``(host, port)`` of a Redis URL (credentials skipped) or of ``host:port[,host:port]``."""
    if value.startswith(("redis://", "rediss://")):
        url = urlsplit(value)
        return [(url.hostname or "", url.port or 6379)]
    return [(h, int(p)) for h, p in re.findall(r"(?:^|,)([a-z][a-z0-9_-]*):(\d+)", value)]


def test_addresses_point_at_defined_services(compose: dict) -> None:
    services = compose["services"]
    ports = _listen_ports(compose)
    seen: set[str] = set()
    for name, svc in _our_services(compose).items():
        values = list(_env(svc).values()) + [str(a) for a in svc["command"][2:]]
        for value in values:
            for host, port in _addresses(value):
                assert host in services, f"{name}: {value!r} names undefined service {host!r}"
                seen.add(host)
                if host in ports:
                    assert port in ports[host], f"{name}: {host} does not listen on {port}"
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on undefined {dep}"
            assert cond["condition"] in {"service_healthy", "service_started",
                                         "service_completed_successfully"}
    assert {"redis", "kafka"} <= seen, "the Redis and Kafka addresses were not found"


def test_secrets_have_no_default(raw: dict) -> None:
    """Every secret comes from a ``${NAME:?message}`` alone: no default, no literal value."""
    for text in _strings(raw):
        for m in _VAR.finditer(text):
            if m.group("name") and SECRET_NAME.search(m.group("name")):
                assert m.group("op") == ":?", f"{m.group(0)!r}: a secret must be ${{NAME:?message}}"
                assert m.group("name") in SECRETS, f"{m.group('name')} is not listed in SECRETS"
    for sname, svc in raw["services"].items():
        for var, value in _env(svc).items():
            if SECRET_NAME.search(var):
                assert _VAR.fullmatch(value), f"{sname}: {var} has a literal value, not ${{...:?}}"
    env = dict(TEST_ENV)
    assert interpolate_all(raw, env)
    for name in SECRETS:
        for missing in ({k: v for k, v in env.items() if k != name}, {**env, name: ""}):
            with pytest.raises(MissingVariable, match=f"{name}: set {name}"):
                interpolate_all(raw, missing)


def test_redis_requires_the_password_every_service_uses(compose: dict) -> None:
    password = _redis_password(compose)
    assert password == TEST_ENV["STREAMTRAIN_REDIS_PASSWORD"]
    redis = compose["services"]["redis"]
    assert _env(redis)["REDISCLI_AUTH"] == password  # the healthcheck authenticates
    test = redis["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "redis-cli" in test[1] and "PONG" in test[1], \
        "redis-cli exits 0 on NOAUTH: the healthcheck must look for PONG"
    urls = {name: _env(svc)["STREAMTRAIN_REDIS_URL"] for name, svc in _our_services(compose).items()}
    assert urls and all(urlsplit(u).password == password for u in urls.values()), urls
    assert all(_env(svc)[k] == TEST_ENV[k] for svc in _our_services(compose).values()
               for k in ("STREAMTRAIN_JOB_TOKEN", "STREAMTRAIN_ADMIN_TOKEN"))


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
