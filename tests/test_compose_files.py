"""compose/docker-compose.yml is checked by parsing it (no container engine here).

Every one of our services must run a real ``streamtrain`` subcommand whose
flags parse, every ``STREAMTRAIN_*`` variable it sets must be a setting that
exists, and every Kafka or Redis address it is given must point at a service
the file defines, on the port that service listens on. Secrets have no
defaults: the file is interpolated the way compose does it (``${VAR}``,
``${VAR:-default}``, ``${VAR:?message}``), with made-up values for the secrets,
and refuses to interpolate without them.

Prometheus (``compose/prometheus.yml``) must scrape only services the file
defines, each on the port its command and environment serve metrics on, and
Grafana's provisioned data source and dashboards must exist, parse, point at
that Prometheus, and query only series some endpoint of ours exports.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from common.redis_client import is_cluster_url, parse_cluster_url
from common.settings import from_args
from coordinator.metrics import Metrics as CoordinatorMetrics
from coordinator.routes import routes as coordinator_routes
from coordinator.settings import CoordinatorSettings
from datastream.consumer import ConsumerStats
from datastream.join.metrics import join_registry
from datastream.join.service import JoinStats
from datastream.settings import JoinSettings
from services.metrics import ServerMetrics
from services.settings import ServerSettings
from serving.app import create_app as create_serving_app
from serving.metrics import ServeMetrics
from serving.settings import ServeSettings
from streamtrain.cli import COMMANDS, build_parser
from trainers.evaluate import EvalResult
from trainers.metrics import TrainerMetrics, TrainerReport
from trainers.rowcache import CacheStats
from trainers.settings import TrainerSettings

COMPOSE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
METRICS_PORT = {"coordinator": (CoordinatorSettings, "port"), "ps": (ServerSettings, "metrics_port"),
                "trainer": (TrainerSettings, "metrics_port"), "serve": (ServeSettings, "port"),
                "join": (JoinSettings, "metrics_port")}
"""Subcommand -> (its settings, the field naming the port its /metrics is served on)."""
OUR_PACKAGES = ("streamtrain", "services", "coordinator", "trainers", "datastream", "serving")
SECRETS = ("STREAMTRAIN_JOB_TOKEN", "STREAMTRAIN_ADMIN_TOKEN", "STREAMTRAIN_REDIS_PASSWORD")
"""Variables compose must refuse to start without."""
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|_AUTH$|_KEY$")
"""Names that hold a secret, wherever they appear in the file."""
TEST_ENV = {name: f"test-{name.lower().replace('_', '-')}" for name in SECRETS}
"""What the shell gives compose in these tests (URL-safe, like the file asks)."""
CLUSTER_PROFILE = "redis-cluster"
"""The optional profile of a Redis Cluster (three nodes and a one-shot ``redis-cli --cluster create``)."""
CLUSTER_ENV = {**TEST_ENV, "STREAMTRAIN_REDIS_SCHEME": "redis+cluster",
               "STREAMTRAIN_REDIS_NODES": "redis-node-1:6379,redis-node-2:6379,redis-node-3:6379"}
"""What the file's header says to set to run the job on that cluster."""

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
            return arg if missing else given  # type: ignore[return-value]  # given is set unless missing
        if missing:
            raise MissingVariable(f"{name}: {arg}")
        return given  # type: ignore[return-value]  # given is set unless missing

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
        if mod_name.split(".")[0] not in OUR_PACKAGES or mod is None:
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
    assert {"coordinator", "ps-0", "ps-1", "trainer", "producer", "serve", "join"} <= set(ours)
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
    for name, svc in compose["services"].items():
        cmd = svc.get("command") or []
        if cmd[:1] == ["redis-server"]:
            ports[name] = {int(cmd[cmd.index("--port") + 1])} if "--port" in cmd else {6379}
    return ports


def _addresses(value: str) -> list[tuple[str, int]]:
    """``(host, port)`` of a Redis URL (credentials skipped) or of ``host:port[,host:port]``."""
    if value.startswith(("redis://", "rediss://")):
        url = urlsplit(value)
        return [(url.hostname or "", url.port or 6379)]
    if is_cluster_url(value):
        return list(parse_cluster_url(value).nodes)
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


def _flag(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def test_redis_cluster_profile(raw: dict) -> None:
    """The optional Redis Cluster: three password-protected AOF cluster nodes, a one-shot that
    creates the cluster from exactly them, and, with the header's two variables set, every
    service's Redis URL a ``redis+cluster://`` URL naming those nodes with the password."""
    compose = interpolate_all(raw, CLUSTER_ENV)
    services = compose["services"]
    password = TEST_ENV["STREAMTRAIN_REDIS_PASSWORD"]
    profiled = {name for name, svc in services.items() if svc.get("profiles")}
    assert all(services[n]["profiles"] == [CLUSTER_PROFILE] for n in profiled)
    for name, svc in services.items():  # the default topology never needs a profile's service
        if name not in profiled:
            assert not set(svc.get("depends_on", {})) & profiled, f"{name} depends on {profiled}"
    nodes = {name for name in profiled if services[name]["command"][:1] == ["redis-server"]}
    assert len(nodes) == 3
    for name in nodes:
        svc = services[name]
        cmd = svc["command"]
        assert _flag(cmd, "--cluster-enabled") == "yes" and _flag(cmd, "--appendonly") == "yes"
        assert _flag(cmd, "--requirepass") == password and _flag(cmd, "--masterauth") == password
        assert _flag(cmd, "--cluster-announce-hostname") == name  # clients are told names compose resolves
        assert _flag(cmd, "--cluster-preferred-endpoint-type") == "hostname"
        assert _env(svc)["REDISCLI_AUTH"] == password and "PONG" in svc["healthcheck"]["test"][1]
    ports = _listen_ports(compose)
    creators = [services[n] for n in profiled - nodes]
    assert len(creators) == 1
    creator = creators[0]
    script = creator["command"][-1]
    assert "redis-cli --cluster create" in script and "--cluster-yes" in script
    assert "-a " not in script and _env(creator)["REDISCLI_AUTH"] == password  # never on a command line
    created = _addresses(",".join(script.split("--cluster create", 1)[1].split()[:-3]))
    assert {h for h, _ in created} == nodes and all(p in ports[h] for h, p in created)
    assert creator.get("restart") == "no"
    assert {n: c["condition"] for n, c in creator["depends_on"].items()} == dict.fromkeys(nodes, "service_healthy")
    urls = {name: _env(svc)["STREAMTRAIN_REDIS_URL"] for name, svc in _our_services(compose).items()}
    for name, url in urls.items():
        assert is_cluster_url(url), f"{name}: {url}"
        where = parse_cluster_url(url)
        assert where.password == password and {h for h, _ in where.nodes} == nodes
        assert all(p in ports[h] for h, p in where.nodes)


def test_kafka_advertises_the_address_our_services_use(compose: dict) -> None:
    kenv = _env(compose["services"]["kafka"])
    advertised = kenv["KAFKA_ADVERTISED_LISTENERS"]
    bootstraps = {v for svc in _our_services(compose).values() for k, v in _env(svc).items()
                  if k.endswith("BOOTSTRAP")}
    assert bootstraps, "no service is given the Kafka bootstrap address"
    for b in bootstraps:
        assert b in advertised, f"{b} is not among Kafka's advertised listeners {advertised}"


@pytest.mark.parametrize("service", ["trainer", "serve", "join"])
def test_scaled_services_are_scalable(compose: dict, service: str) -> None:
    svc = compose["services"][service]
    assert "container_name" not in svc and "hostname" not in svc  # fixed names would forbid --scale
    assert "ports" not in svc or all(":" not in str(p) for p in svc["ports"])  # no fixed host port


def test_the_joiner_writes_the_topic_the_trainers_read_and_reports_to_the_coordinator(compose: dict) -> None:
    """``join`` reads the impressions and feedback topics from the job's Kafka and writes the labelled records
    to the job's topic, which the trainers consume; it reports to the coordinator with the job token and serves its
    metrics on 9105, and starts once Kafka and the coordinator are up."""
    services = _our_services(compose)
    svc = services["join"]
    assert svc["command"][:2] == ["streamtrain", "join"]
    settings = from_args(JoinSettings, build_parser("join").parse_args(svc["command"][2:]), environ=_env(svc))
    trainer = services["trainer"]
    trained = from_args(TrainerSettings, build_parser("trainer").parse_args(trainer["command"][2:]),
                        environ=_env(trainer))
    coordinator = services["coordinator"]
    coordinating = from_args(CoordinatorSettings, build_parser("coordinator").parse_args(coordinator["command"][2:]),
                             environ=_env(coordinator))
    assert (settings.impressions, settings.feedback_topics) == ("impressions", ["feedback"])
    assert settings.topic == coordinating.topic  # the trainers read the topic the coordinator assigns
    # should the joiner start first, it creates the training topic with the job's partitions, as the producer would
    producer = services["producer"]["command"]
    assert settings.partitions == coordinating.partitions == int(_flag(producer, "--partitions"))
    assert settings.bootstrap == trained.kafka_bootstrap
    assert settings.job_token == coordinating.job_token and settings.metrics_port == 9105
    url = urlsplit(settings.coordinator_url)
    assert url.hostname == "coordinator" and url.port == coordinating.port
    assert {d: c["condition"] for d, c in svc["depends_on"].items()} == {
        "kafka": "service_healthy", "coordinator": "service_healthy"}


def _serving_routes() -> set[tuple[str, str]]:
    """(method, path) of every route of the serving replica's application."""
    app = create_serving_app(ServeSettings(job_token="t"), replica=SimpleNamespace())  # type: ignore[arg-type]  # its routes only: nothing runs
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}


def test_the_serving_replicas_follow_the_job_and_check_their_health(compose: dict) -> None:
    """``serve`` builds the model the trainers train, from the job's Redis, following the coordinator with
    the job token; it listens on all addresses on the port its healthcheck, Prometheus and its published
    port name, and the healthcheck asks a route the replica has."""
    services = _our_services(compose)
    svc = services["serve"]
    assert svc["command"][:2] == ["streamtrain", "serve"]
    settings = from_args(ServeSettings, build_parser("serve").parse_args(svc["command"][2:]), environ=_env(svc))
    trainer = services["trainer"]
    trained = from_args(TrainerSettings, build_parser("trainer").parse_args(trainer["command"][2:]),
                        environ=_env(trainer))
    coordinator = services["coordinator"]
    coordinating = from_args(CoordinatorSettings, build_parser("coordinator").parse_args(coordinator["command"][2:]),
                             environ=_env(coordinator))
    assert settings.model == trained.model and settings.job == trained.job == coordinating.job
    assert settings.redis_url == trained.redis_url and settings.job_token == coordinating.job_token
    url = urlsplit(settings.coordinator_url)
    assert url.hostname == "coordinator" and url.port == coordinating.port
    assert settings.host == "0.0.0.0"  # other containers (Prometheus) reach it
    # the entrypoint names each replica by its container's hostname, with flags `serve` takes
    entrypoint = svc["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"] and entrypoint[3] == "--" and entrypoint[2].startswith('exec "$@" ')
    added = [arg.strip('"') for arg in entrypoint[2].split()[2:]]
    named = from_args(ServeSettings, build_parser("serve").parse_args([*svc["command"][2:], *added]),
                      environ=_env(svc))
    assert named.name == f"$(hostname):{settings.port}" and named.url == f"http://$(hostname):{settings.port}"
    assert [str(p) for p in svc["ports"]] == [str(settings.port)]
    test = svc["healthcheck"]["test"]
    health = re.search(r"http://127\.0\.0\.1:(\d+)(/[^'\"]*)", " ".join(test))
    assert health and int(health[1]) == settings.port and health[2] == "/v2/health/live", test
    assert ("GET", health[2]) in _serving_routes()
    assert {d: c["condition"] for d, c in svc["depends_on"].items()} == {
        "redis": "service_healthy", "coordinator": "service_healthy"}


# -- Prometheus and Grafana ---------------------------------------------------------------------


def _served_metrics_port(svc: dict) -> int | None:
    """The port ``svc``'s command serves /metrics on, from its flags and environment (None: it
    serves none; 0 means off for ps and trainers)."""
    command = svc.get("command") or []
    if "build" not in svc or len(command) < 2 or command[1] not in METRICS_PORT:
        return None
    cls, field = METRICS_PORT[command[1]]
    settings = from_args(cls, build_parser(command[1]).parse_args(command[2:]), environ=_env(svc))
    return getattr(settings, field) or None


def _bind_mounts(svc: dict) -> dict[str, Path]:
    """Container path -> host path of ``svc``'s bind mounts (relative ones resolved like compose)."""
    out = {}
    for v in svc.get("volumes", []):
        source, target = str(v).split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (COMPOSE.parent / source).resolve()
    return out


def _host_file(svc: dict, container_path: str) -> Path:
    """The host file a container path of ``svc`` reads, through its bind mounts."""
    for target, source in sorted(_bind_mounts(svc).items(), key=lambda kv: -len(kv[0])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target):].lstrip("/")
    raise AssertionError(f"{container_path} is not mounted from the host")


def _flag_value(command: list[str], flag: str) -> str | None:
    for i, arg in enumerate(command):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
    return None


def _prometheus_port(compose: dict) -> int:
    address = _flag_value(compose["services"]["prometheus"].get("command", []), "--web.listen-address")
    return int((address or ":9090").rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def prometheus_config(compose: dict) -> dict:
    svc = compose["services"]["prometheus"]
    assert svc["image"].startswith("prom/prometheus:")
    path = _flag_value(svc["command"], "--config.file")
    assert path, "prometheus must be given its --config.file"
    return yaml.safe_load(_host_file(svc, path).read_text())


def _targets(job: dict) -> list[tuple[str, int]]:
    """(host, port) of every target of a scrape job (static and DNS discovered)."""
    out = []
    for static in job.get("static_configs", []):
        for target in static["targets"]:
            host, port = target.rsplit(":", 1)
            out.append((host, int(port)))
    for dns in job.get("dns_sd_configs", []):
        assert dns.get("type") == "A", f"{job['job_name']}: compose's DNS answers A records (type: A)"
        out.extend((name, int(dns["port"])) for name in dns["names"])
    return out


def test_one_parameter_server_per_shard_group(compose: dict) -> None:
    """The ps services together serve every group of the model the coordinator creates, once."""
    services = _our_services(compose)
    args = build_parser("coordinator").parse_args(services["coordinator"]["command"][2:])
    groups = from_args(CoordinatorSettings, args, environ=_env(services["coordinator"])).ps_groups
    assert groups >= 2, "compose runs a model split into shard groups"
    served = []
    for name, svc in services.items():
        if svc["command"][1] == "ps":
            settings = from_args(ServerSettings, build_parser("ps").parse_args(svc["command"][2:]), environ=_env(svc))
            assert settings.groups == groups, f"{name}: --groups {settings.groups}, the model has {groups}"
            served.append(settings.group)
    assert sorted(served) == list(range(groups))


def test_prometheus_scrapes_every_metrics_endpoint_on_its_port(compose: dict, prometheus_config: dict) -> None:
    services = compose["services"]
    scraped: set[str] = set()
    for job in prometheus_config["scrape_configs"]:
        path = job.get("metrics_path", "/metrics")
        targets = _targets(job)
        assert targets, f"scrape job {job['job_name']} has no target"
        for host, port in targets:
            assert host in services, f"{job['job_name']}: {host} is not a compose service"
            served = _served_metrics_port(services[host])
            assert served == port, f"{job['job_name']}: {host} serves metrics on {served}, not {port}"
            if services[host]["command"][1] == "coordinator":  # prometheus_client's server answers any path
                assert path in {r.path for r in coordinator_routes if r.method == "GET"}, path
            if services[host]["command"][1] == "serve":
                assert ("GET", path) in _serving_routes(), path
            scraped.add(host)
    serving = {name for name, svc in services.items() if _served_metrics_port(svc)}
    assert serving == scraped, f"serving metrics but not scraped: {serving - scraped}"
    assert {"coordinator", "ps-0", "ps-1", "trainer", "serve", "join"} <= scraped
    assert [j["job_name"] for j in prometheus_config["scrape_configs"] if ("join", 9105) in _targets(j)] == ["join"]
    # trainers, serving replicas and joiners scale with --scale: they are discovered by DNS, never listed one by one
    for scaled in ("trainer", "serve", "join"):
        jobs = [j for j in prometheus_config["scrape_configs"] if any(h == scaled for h, _ in _targets(j))]
        assert jobs and all(not j.get("static_configs") for j in jobs), scaled


def _provisioned(svc: dict, kind: str) -> list[dict]:
    root = _host_file(svc, "/etc/grafana/provisioning") / kind
    files = sorted(root.glob("*.yml")) + sorted(root.glob("*.yaml"))
    assert files, f"no Grafana {kind} provisioned under {root}"
    docs = [yaml.safe_load(f.read_text()) for f in files]
    assert all(d.get("apiVersion") == 1 for d in docs)
    return docs


def _dashboards(compose: dict) -> list[dict]:
    grafana = compose["services"]["grafana"]
    out = []
    for doc in _provisioned(grafana, "dashboards"):
        for provider in doc["providers"]:
            assert provider["type"] == "file"
            folder = _host_file(grafana, provider["options"]["path"])
            files = sorted(folder.glob("*.json"))
            assert files, f"no dashboard JSON in {folder}"
            out.extend(json.loads(f.read_text()) for f in files)
    return out


def _queried(dashboard: dict) -> list[dict]:
    """The panels of ``dashboard`` that query (a ``row`` panel is a heading: it has a title, no query)."""
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert all(p["title"] and not p.get("targets") for p in rows), rows
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana:")
    for target, source in _bind_mounts(grafana).items():
        assert source.exists(), f"grafana mounts {source} at {target}: missing"
    sources = [d for doc in _provisioned(grafana, "datasources") for d in doc["datasources"]]
    prometheus = [d for d in sources if d["type"] == "prometheus"]
    assert len(prometheus) == 1 and prometheus[0].get("isDefault")
    url = urlsplit(prometheus[0]["url"])
    assert url.hostname == "prometheus" and url.port == _prometheus_port(compose)
    assert "prometheus" in compose["services"]
    uids = {d["uid"] for d in sources}
    dashboards = _dashboards(compose)
    titles = {p["title"] for d in dashboards for p in d["panels"]}
    for want in ("loss", "accuracy", "records/s", "lag", "staleness", "freshness", "versions/s", "updates/s"):
        assert any(want in t.lower() for t in titles), f"no dashboard panel for {want}: {sorted(titles)}"
    for want in ("table rows", "table bytes", "row cache hit rate"):
        assert any(want in t.lower() for t in titles), f"no dashboard panel for {want}: {sorted(titles)}"
    for want in ("serving requests/s", "serving latency p50 / p99", "serving lag", "served version", "serving rows",
                 "serving misses", "serving reloads"):
        assert any(want in t.lower() for t in titles), f"no dashboard panel for {want}: {sorted(titles)}"
    rows = {p["title"].split(" (")[0] for d in dashboards for p in d["panels"] if p["type"] == "row"}
    assert "Joiner" in rows, rows
    queries = " ".join(t["expr"] for d in dashboards for p in _queried(d) for t in p["targets"])
    for series in ("rate(streamtrain_join_joined_total", "rate(streamtrain_join_positives_total",
                   "rate(streamtrain_join_negatives_total", "sum by (reason) (rate(streamtrain_join_late_total",
                   "sum by (reason) (increase(streamtrain_join_dead_letters_total", "streamtrain_join_pending",
                   "streamtrain_join_watermark_lag_seconds"):
        assert series in queries, f"no dashboard panel queries {series}"
    for d in dashboards:
        assert d["uid"] and d["title"]
        for panel in _queried(d):
            assert panel["datasource"]["uid"] in uids, f"{panel['title']}: unknown data source"
            assert panel["targets"] and all(t["expr"] and t["datasource"]["uid"] in uids
                                            for t in panel["targets"]), panel["title"]


def _exported_series() -> set[str]:
    """Every series name our /metrics endpoints can expose (sample names: _total, _bucket...)."""
    server = SimpleNamespace(settings=SimpleNamespace(group=0, redis_url="redis://127.0.0.1:1/0", job="j"),
                             version=0, table_names=["c1"])
    report = TrainerReport(steps=0, clock=1, staleness=0, loss=0.5, version=1,
                           last_eval=EvalResult(1, 0.5, 0.5, 10), consumer=ConsumerStats(0, 0, 0, 0),
                           row_cache=CacheStats(hits=3, misses=1, rows=2))
    joined = JoinStats(partitions=[0], counters={"joined": 1, "late.outside_window": 1, "dead.bad_event": 1},
                       pending=0, early_feedback=0, watermark_ms=0, transactions=1)
    registries = [ServerMetrics(server).registry, TrainerMetrics(lambda: report).registry,
                  CoordinatorMetrics().registry, ServeMetrics().registry, join_registry(lambda: joined)]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {f.name + s for r in registries for f in r.collect() for s in suffixes.get(f.type, ("",))}


def test_dashboard_queries_only_exported_series(compose: dict) -> None:
    exported = _exported_series()
    for d in _dashboards(compose):
        for panel in _queried(d):
            for target in panel["targets"]:
                for name in re.findall(r"\bstreamtrain_[a-z0-9_]+", target["expr"]):
                    assert name in exported, f"panel {panel['title']!r} queries {name}, which nothing exports"


def test_image_copies_every_package() -> None:
    """The image installs what pyproject packages: a package missing from the Dockerfile would
    import-fail only inside the container."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (root / "compose" / "Dockerfile").read_text(), re.M))
    assert packages == copied


def test_the_build_context_lets_through_what_the_image_copies() -> None:
    """compose/Dockerfile's context is the repository root, cut down by .dockerignore to an allow-list:
    each path the Dockerfile copies must be on it, or the build fails only under a real engine."""
    root = Path(__file__).resolve().parents[1]
    allowed = {line[1:] for line in (root / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    copied = set(re.findall(r"^COPY (?!--from)(\S+) ", (root / "compose" / "Dockerfile").read_text(), re.M))
    assert copied and copied <= allowed, copied - allowed


OFFLINE = COMPOSE.with_name("offline.yml")


def _load_kafka_start() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("kafka_start", COMPOSE.parent / "offline" / "kafka_start.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_offline_override_builds_every_image_it_runs(raw: dict) -> None:
    """compose/offline.yml names only services of the default file, builds a local image for every one
    that runs there (the Redis Cluster profile's too), so nothing is pulled, and keeps Grafana, which
    Debian does not package, out unless its profile is asked for."""
    offline = yaml.safe_load(OFFLINE.read_text())["services"]
    assert set(offline) <= set(raw["services"])
    for name, svc in raw["services"].items():
        if name == "grafana":
            assert offline[name] == {"profiles": ["grafana"]}
            continue
        assert "build" in offline.get(name, {}), f"{name} would pull {svc.get('image')} offline"
        assert offline[name]["image"] != svc.get("image"), f"{name}: the stand-in would shadow {svc.get('image')}"
    base = {s["build"]["args"]["BASE_IMAGE"] for s in offline.values() if "build" in s}
    assert base == {"${STREAMTRAIN_BASE_IMAGE:-streamtrain-base:bookworm}"}, "one base for every stand-in"
    targets = set(re.findall(r"^FROM \S+ AS (\w+)$", (COMPOSE.parent / "offline" / "Dockerfile").read_text(), re.M))
    used = {s["build"]["target"] for s in offline.values() if "target" in s.get("build", {})}
    assert used == targets == {"kafka", "redis", "prometheus"}


def test_the_kafka_stand_in_reads_the_variables_apache_kafka_does(compose: dict) -> None:
    kafka_start = _load_kafka_start()
    assert kafka_start.property_name("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP") == "listener.security.protocol.map"
    assert kafka_start.property_name("KAFKA_A__B___C_D") == "a_b-c.d"
    props = kafka_start.server_properties({**_env(compose["services"]["kafka"]), "PATH": "/bin"})
    assert props == {
        "node.id": "1", "process.roles": "broker,controller", "listeners": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "advertised.listeners": "PLAINTEXT://kafka:9092", "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "controller.quorum.voters": "1@kafka:9093", "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1", "transaction.state.log.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0", "auto.create.topics.enable": "false",
        "log.dirs": "/var/lib/kafka/data"}  # KAFKA_HEAP_OPTS is the JVM's, not a property
