"""The docker-compose topology as local processes: what ``streamtrain up`` runs.

:class:`LocalCluster` starts real Kafka and Redis servers (the launcher), then the coordinator, one
parameter server per shard group, trainers and a producer as ``streamtrain`` child processes, with
fault helpers for the tests and benchmarks. What runs is a :class:`ClusterSpec`; each service's
settings become its command line through :func:`common.settings.to_flags` (:func:`commands`), so a
renamed flag fails in the tests, not at run time. See docs/architecture.md, *The three planes*.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from common.keys import JobKeys
from common.outage import REDIS_DOWN
from common.settings import from_args, to_flags
from coordinator.settings import CoordinatorSettings
from datastream.settings import EventsSettings, JoinSettings, ProduceSettings
from services.settings import ServerSettings
from serving.settings import ServeSettings
from trainers.settings import TrainerSettings

from .launcher import KafkaCluster, RedisCluster, RedisServer, ServiceProcess, free_port, wait_until
from .netns import NetNamespace

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

logger = logging.getLogger(__name__)

S = TypeVar("S", bound="DataclassInstance")

LOCAL_STREAM = ProduceSettings(source="digits?repeat=60", split="train", shard_size=32, progress=False)
"""What a local cluster (and ``streamtrain up``) streams unless told otherwise: the digits train split
60 times over (enough for 95 % held out with the job defaults, ``up``'s target), in shards of 32 records,
without a progress bar (its output goes to a log)."""

LOCAL_TRAINER = TrainerSettings(threads=1, eval_source="digits")
"""A local cluster's trainers: one CPU thread each (several processes share the machine), scoring the
digits test split (``eval_every`` and the rest: the trainer's defaults)."""

REDIS_PASSWORD_ENV = "STREAMTRAIN_REDIS_PASSWORD"
"""The variable of the Redis password a cluster runs with (compose's too)."""

SECRET_FIELDS = ("admin_token", "job_token", "redis_url", "score_token")
"""Settings passed to a child in their environment variables, not on its command line (``ps`` shows
command lines to every user; a Redis URL may hold a password)."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to run: each service's settings, and what only a cluster has.

    The job's configuration (consistency, staleness, the tables' own,
    codec, optimizer, lr, partitions, lease, ``ps_groups``) is ``coordinator``'s; the trainers' (model,
    batch size, threads, top-k density, evaluation) is ``trainer``'s. Addresses,
    ports, tokens, the job and the topic in these settings are placeholders:
    :func:`service_settings` replaces them with the cluster's. Change a part with
    :func:`dataclasses.replace`, e.g.
    ``ClusterSpec(coordinator=CoordinatorSettings(consistency="bsp", ps_groups=2))``.
    """

    job: str = "digits"
    """Job name (Redis keys, Kafka group) of every service."""
    topic: str = "digits"
    """Training topic of every service."""
    host: str = "127.0.0.1"
    """The address Redis, Kafka and the coordinator bind and every service connects to: loopback, or
    the root side of a veth pair (:class:`streamtrain.netns.NetNamespace`), which trainers in that
    namespace reach and processes here reach too. A coordinator whose own settings name another
    ``host`` than loopback (``0.0.0.0``) binds that."""
    trainers: int = 2
    """Trainer processes started with the cluster (:meth:`LocalCluster.add_trainer` starts more)."""
    coordinator: CoordinatorSettings = CoordinatorSettings()
    """The coordinator, and through it the job's configuration; ``ps_groups`` parameter servers run."""
    trainer: TrainerSettings = LOCAL_TRAINER
    """Every trainer."""
    ps: ServerSettings = ServerSettings()
    """Every parameter server (``group``/``groups`` are set per server; a relative ``checkpoint_dir``
    is in the cluster's folder; a non-zero ``metrics_port`` is group 0's, group g's is that plus g)."""
    producer: ProduceSettings | None = LOCAL_STREAM
    """The producer (None: start no producer; ``partitions`` is the coordinator's)."""
    events: EventsSettings | None = None
    """With :attr:`join`: the events producer (``streamtrain produce-events``) writing impressions and their
    delayed clicks to the joiner's inputs (``partitions`` is the coordinator's)."""
    join: JoinSettings | None = None
    """The joiner (``streamtrain join``) labelling the impressions for the training topic, reporting to the
    coordinator (None: no joiner; its topic, bootstrap and partitions are the cluster's)."""
    redis_aof: bool = True
    """Redis AOF persistence."""
    redis_cluster: bool = False
    """Run the job on a Redis Cluster of three masters (:class:`~streamtrain.launcher.RedisCluster`,
    its ``redis+cluster://`` URL handed to every service) instead of one Redis server."""
    redis_replicas: int = 0
    """Replicas of each master of the Redis Cluster (``redis_cluster``): with 1, a master may die and
    its replica takes over."""
    redis_password: str = ""
    """The password of Redis (of every node of a Redis Cluster); empty: a fresh random one. Up reads it
    from ``STREAMTRAIN_REDIS_PASSWORD`` (:meth:`with_environment`)."""
    kafka_heap_mb: int = 512
    """Heap of each local Kafka broker."""
    kafka_brokers: int = 1
    """Kafka brokers (KRaft nodes, each also a controller) of the local cluster. With three or more,
    topics keep three copies and an ``acks=all`` write needs two in sync
    (:func:`~streamtrain.launcher.replication_config`): one broker may die (:meth:`LocalCluster.kill_broker`)."""
    extra_trainer_args: tuple[str, ...] = ()
    """More flags for every trainer, after its settings' (they win)."""
    replicas: int = 0
    """Serving replicas (``streamtrain serve``) started with the cluster, each on a free port
    (:meth:`LocalCluster.add_replica` starts more)."""
    serve: ServeSettings = ServeSettings()
    """Every serving replica (its job, model, addresses, tokens and port are the cluster's)."""
    score_served: bool = False
    """With ``replicas`` >= 1 and a producer: the producer scores every ``producer.score_every``-th record
    on the first replica before producing it (its URL and the job token; the replica's served AUC).
    A ``producer.score_url`` of the spec's own wins."""
    metrics_ports: bool = False
    """Give every parameter server and trainer a free ``--metrics-port`` (each its own), so that every
    process serves Prometheus metrics (the coordinator and replicas on their own ports):
    :meth:`LocalCluster.metrics_targets` lists them."""

    @property
    def partitions(self) -> int:
        """Partitions of the training topic (the coordinator's)."""
        return self.coordinator.partitions

    @property
    def ps_groups(self) -> int:
        """Parameter servers, one per shard group (the coordinator's ``ps_groups``)."""
        return self.coordinator.ps_groups

    def with_environment(self, environ: Mapping[str, str]) -> ClusterSpec:
        """This spec with every service setting whose variable is set in ``environ``
        (``STREAMTRAIN_*``) taken from there, as the service itself would read it, and the Redis
        password from ``STREAMTRAIN_REDIS_PASSWORD`` (as compose reads it). The tokens of the
        coordinator's settings (``STREAMTRAIN_JOB_TOKEN``, ``STREAMTRAIN_ADMIN_TOKEN``) are then the
        cluster's (:class:`LocalCluster`).

        Raises:
            SettingsError: a variable has a bad value.
        """
        return replace(self, redis_password=environ.get(REDIS_PASSWORD_ENV, self.redis_password),
                       coordinator=_environment_over(self.coordinator, environ),
                       trainer=_environment_over(self.trainer, environ), ps=_environment_over(self.ps, environ),
                       producer=None if self.producer is None else _environment_over(self.producer, environ),
                       events=None if self.events is None else _environment_over(self.events, environ),
                       join=None if self.join is None else _environment_over(self.join, environ))


def _environment_over(settings: S, environ: Mapping[str, str]) -> S:
    """``settings`` with the fields whose environment variable ``environ`` sets read from there."""
    kept = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if f.metadata.get("env") not in environ}
    return from_args(type(settings), kept, environ)


@dataclass(frozen=True)
class Endpoints:
    """What a running cluster decides for its services."""

    redis_url: str
    """Redis of the job."""
    bootstrap: str
    """Kafka bootstrap address."""
    coordinator_port: int
    """Port the coordinator binds on loopback."""
    admin_token: str
    """Bearer token of admin calls."""
    job_token: str
    """Bearer token of trainer calls."""
    workdir: Path
    """The cluster's folder (relative checkpoint folders are in it)."""
    host: str = "127.0.0.1"
    """The address the servers bind (:attr:`ClusterSpec.host`)."""

    @property
    def coordinator_url(self) -> str:
        """Base URL of the coordinator."""
        return f"http://{self.host}:{self.coordinator_port}"


class Services(NamedTuple):
    """The settings each service of a cluster runs with."""

    coordinator: CoordinatorSettings
    """The coordinator."""
    ps: tuple[ServerSettings, ...]
    """One parameter server per shard group, group g at index g."""
    trainer: TrainerSettings
    """Every trainer."""
    producer: ProduceSettings | None
    """The producer, if any."""
    serve: ServeSettings
    """Every serving replica (the port is each replica's own: :meth:`LocalCluster.add_replica`)."""
    events: EventsSettings | None = None
    """The events producer, if any."""
    join: JoinSettings | None = None
    """The joiner, if any."""


def service_settings(spec: ClusterSpec, at: Endpoints) -> Services:
    """``spec``'s services with the cluster's job, topic, addresses, tokens and shard groups filled in."""
    host = at.host if spec.coordinator.host == CoordinatorSettings().host else spec.coordinator.host
    coordinator = replace(spec.coordinator, job=spec.job, topic=spec.topic, redis_url=at.redis_url,
                          kafka_bootstrap=at.bootstrap, host=host, port=at.coordinator_port,
                          admin_token=at.admin_token, job_token=at.job_token)
    groups = coordinator.ps_groups
    ps = tuple(replace(spec.ps, job=spec.job, redis_url=at.redis_url, groups=groups, group=g,
                       checkpoint_dir=str(at.workdir / spec.ps.checkpoint_dir),
                       metrics_port=spec.ps.metrics_port + g if spec.ps.metrics_port else 0)
               for g in range(groups))
    trainer = replace(spec.trainer, job=spec.job, coordinator_url=at.coordinator_url, job_token=at.job_token,
                      redis_url=at.redis_url, kafka_bootstrap=at.bootstrap)
    producer = None if spec.producer is None else replace(
        spec.producer, topic=spec.topic, bootstrap=at.bootstrap, partitions=coordinator.partitions,
        score_token=spec.producer.score_token or (at.job_token if spec.producer.score_url else ""))
    serve = replace(spec.serve, job=spec.job, model=spec.trainer.model, coordinator_url=at.coordinator_url,
                    job_token=at.job_token, redis_url=at.redis_url, host=at.host)
    join = None if spec.join is None else replace(
        spec.join, topic=spec.topic, bootstrap=at.bootstrap, partitions=coordinator.partitions,
        coordinator_url=at.coordinator_url, job_token=at.job_token)
    events = None if spec.events is None or join is None else replace(
        spec.events, bootstrap=at.bootstrap, impressions=join.impressions, feedback=join.feedback_topics[0],
        partitions=coordinator.partitions)
    return Services(coordinator, ps, trainer, producer, serve, events, join)


def command_line(command: str, settings: Any) -> tuple[list[str], dict[str, str]]:
    """``(args, env)`` that run ``streamtrain <command>`` with exactly ``settings``: the flags of
    :func:`common.settings.to_flags`, and the :data:`SECRET_FIELDS` in their environment variables."""
    secret = {f.name: f.metadata["env"] for f in dataclasses.fields(settings) if f.name in SECRET_FIELDS}
    env = {var: str(getattr(settings, name)) for name, var in secret.items()}
    return [command, *to_flags(settings, omit=secret)], env


def commands(spec: ClusterSpec, at: Endpoints) -> dict[str, tuple[list[str], dict[str, str]]]:
    """What :class:`LocalCluster` runs: ``(args after streamtrain, environment added)`` of the
    ``coordinator``, of ``ps0`` .. one parameter server per shard group, of every ``trainer`` (its
    settings' flags, then ``spec.extra_trainer_args``), of the ``producer``, the ``join``er and the
    ``events`` producer (those there are) and of a serving replica (``serve``)."""
    services = service_settings(spec, at)
    out = {"coordinator": command_line("coordinator", services.coordinator)}
    out.update({f"ps{s.group}": command_line("ps", s) for s in services.ps})
    args, env = command_line("trainer", services.trainer)
    out["trainer"] = ([*args, *spec.extra_trainer_args], env)
    if services.producer is not None:
        out["producer"] = command_line("produce", services.producer)
    out["serve"] = command_line("serve", services.serve)
    if services.join is not None:
        out["join"] = command_line("join", services.join)
    if services.events is not None:
        out["events"] = command_line("produce-events", services.events)
    return out


@dataclass
class LocalCluster:
    """Everything of one job on this machine. Use as a context manager."""

    spec: ClusterSpec = field(default_factory=ClusterSpec)
    workdir: Path | None = None
    redis: RedisServer | RedisCluster | None = None
    kafka: KafkaCluster | None = None
    coordinator: ServiceProcess | None = None
    ps: list[ServiceProcess] = field(default_factory=list)
    """The parameter servers, group g at index g."""
    producer: ServiceProcess | None = None
    events: ServiceProcess | None = None
    """The events producer (``spec.events``)."""
    joiner: ServiceProcess | None = None
    """The joiner (``spec.join``)."""
    trainers: list[ServiceProcess] = field(default_factory=list)
    replicas: list[tuple[ServiceProcess, int]] = field(default_factory=list)
    """The serving replicas and their ports."""
    _replica_flags: dict[int, tuple[str, ...]] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Process name (``ps0``, a trainer's) -> the metrics port it was given (``spec.metrics_ports``); a
    parameter server keeps its port across restarts."""
    admin_token: str = ""
    """Bearer token of admin calls: the spec's coordinator's when set, else a fresh random one."""
    job_token: str = ""
    """Bearer token of trainer calls: the spec's coordinator's when set, else a fresh random one."""
    coordinator_port: int = field(default_factory=free_port)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _started: int = 0

    def __post_init__(self) -> None:
        self.admin_token = self.admin_token or self.spec.coordinator.admin_token or secrets.token_urlsafe(16)
        self.job_token = self.job_token or self.spec.coordinator.job_token or secrets.token_urlsafe(16)

    # -- addresses --------------------------------------------------------------------------------
    @property
    def coordinator_url(self) -> str:
        """Base URL of the coordinator."""
        return f"http://{self.spec.host}:{self.coordinator_port}"

    @property
    def redis_url(self) -> str:
        """Redis URL of the job."""
        assert self.redis is not None
        return self.redis.url

    @property
    def bootstrap(self) -> str:
        """Kafka bootstrap addresses: every broker's, comma-separated."""
        assert self.kafka is not None
        return self.kafka.bootstrap

    @property
    def endpoints(self) -> Endpoints:
        """What this cluster gives its services (once Redis and Kafka run)."""
        assert self.workdir is not None
        return Endpoints(redis_url=self.redis_url, bootstrap=self.bootstrap,
                         coordinator_port=self.coordinator_port, admin_token=self.admin_token,
                         job_token=self.job_token, workdir=self.workdir, host=self.spec.host)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        """Start servers and services; returns once the coordinator answers."""
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="streamtrain-cluster-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            password = self.spec.redis_password or None  # None: a fresh random one
            if self.spec.redis_cluster:
                self.redis = RedisCluster(host=self.spec.host, appendonly=self.spec.redis_aof,
                                          replicas=self.spec.redis_replicas, password=password,
                                          workdir=self.workdir / "redis").start()
            else:
                self.redis = RedisServer(host=self.spec.host, appendonly=self.spec.redis_aof, password=password,
                                         workdir=self.workdir / "redis").start()
            self.kafka = KafkaCluster(self.spec.kafka_brokers, host=self.spec.host, heap_mb=self.spec.kafka_heap_mb,
                                      log_level="WARN", start_timeout_s=120, workdir=self.workdir / "kafka").start()
            from datastream import ensure_topic

            ensure_topic(self.bootstrap, self.spec.topic, self.spec.partitions)
            if self.spec.join is not None:  # both partition alike, whichever of its writer and its joiner starts first
                for topic in (self.spec.join.impressions, *self.spec.join.feedback_topics):
                    ensure_topic(self.bootstrap, topic, self.spec.partitions)
            self.start_coordinator()
            self.start_ps()
            ports = [free_port(self.spec.host) for _ in range(self.spec.replicas)]  # before the producer scores
            if self.spec.join is not None:
                self.start_joiner()
            if self.spec.events is not None:
                self.events = self._service("events", "events")
            if self.spec.producer is not None:
                scoring = self.spec.score_served and ports and not self.spec.producer.score_url
                self.start_producer(score_url=f"http://{self.spec.host}:{ports[0]}" if scoring else "")
            for _ in range(self.spec.trainers):
                self.add_trainer()
            for port in ports:
                self.add_replica(port)
        except BaseException:
            self.stop()
            raise
        return self

    def _service(self, which: str, name: str, ready: Callable[[], bool] | None = None,
                 netns: NetNamespace | None = None, env: Mapping[str, str] | None = None,
                 flags: tuple[str, ...] = ()) -> ServiceProcess:
        """Start service ``which`` (a key of :func:`commands`) as process ``name`` (inside ``netns``,
        with ``env`` over its environment and ``flags`` after its own: they win)."""
        args, base_env = commands(self.spec, self.endpoints)[which]
        args = [*args, *flags]
        prefix = netns.command([]) if netns is not None else ()
        assert self.workdir is not None
        proc = ServiceProcess(name, args, env={**base_env, **(env or {})}, ready=ready, prefix=prefix,
                              workdir=self.workdir / name, start_timeout_s=120, stop_timeout_s=30)
        return proc.start()

    def start_coordinator(self) -> ServiceProcess:
        """Start (or restart) the coordinator on its fixed port."""
        self.coordinator = self._service("coordinator", f"coordinator-{self._next()}", ready=self._coordinator_up)
        return self.coordinator

    def start_ps(self, group: int | None = None) -> list[ServiceProcess]:
        """Start (or restart) the parameter server of shard ``group``, or of every group (None)."""
        if group is not None:
            self.ps[group] = self._service(f"ps{group}", f"ps{group}-{self._next()}",
                                           flags=self._metrics_flags(f"ps{group}"))
            return self.ps
        self.ps = []
        for g in range(self.spec.ps_groups):  # one at a time: stop() finds those started before a failure
            self.ps.append(self._service(f"ps{g}", f"ps{g}-{self._next()}", flags=self._metrics_flags(f"ps{g}")))
        return self.ps

    def _metrics_flags(self, name: str) -> tuple[str, ...]:
        """``--metrics-port`` of process ``name`` (a free port, kept for the name) when ``spec.metrics_ports``."""
        if not self.spec.metrics_ports:
            return ()
        port = self.metrics_ports.setdefault(name, free_port(self.spec.host))
        return ("--metrics-port", str(port))

    def start_producer(self, score_url: str = "") -> ServiceProcess:
        """Start the producer streaming ``spec.producer.source`` into the topic; with ``score_url`` (a
        replica's base URL) it scores a sample of its records there first, with the job token."""
        if score_url:
            self.producer = self._service("producer", "producer", flags=("--score-url", score_url),
                                          env={"STREAMTRAIN_PRODUCE_SCORE_TOKEN": self.job_token})
        else:
            self.producer = self._service("producer", "producer")
        return self.producer

    def start_joiner(self) -> ServiceProcess:
        """Start (or start again: the same instance id, so it aborts what its predecessor left open) the
        joiner."""
        self.joiner = self._service("join", f"join-{self._next()}", flags=self._metrics_flags("join"))
        return self.joiner

    def kill_joiner(self) -> ServiceProcess:
        """SIGKILL the joiner (fault injection); :meth:`start_joiner` brings it back."""
        assert self.joiner is not None, "the cluster runs no joiner"
        self.joiner.kill()
        self.joiner.stop()
        return self.joiner

    def add_trainer(self, netns: NetNamespace | None = None,
                    env: Mapping[str, str] | None = None) -> ServiceProcess:
        """Start one more trainer; inside ``netns`` (its own host: the cluster's ``spec.host`` must be
        ``netns.host_address`` for it to reach the servers) when given. ``env`` is added to its
        environment: it replaces what the cluster passes there (the :data:`SECRET_FIELDS`, e.g.
        ``STREAMTRAIN_REDIS_URL``); every other setting is a flag, and flags win. Its pid is the
        trainer's own (``ip netns exec`` execs it), so it stops, is killed and frozen like any other."""
        name = f"trainer-{self._next()}"
        trainer = self._service("trainer", name, netns=netns, env=env, flags=self._metrics_flags(name))
        self.trainers.append(trainer)
        return trainer

    def add_replica(self, port: int | None = None, flags: tuple[str, ...] = ()) -> ServiceProcess:
        """Start one more serving replica on ``port`` (a free one by default: :meth:`replica_url`), with
        ``flags`` after the spec's (they win); it answers its liveness route once started (readiness
        follows its first state)."""
        port = port or free_port(self.spec.host)
        proc = self._service("serve", f"serve-{self._next()}", ready=lambda: self._live(port),
                             flags=("--port", str(port), *flags))
        self._replica_flags[len(self.replicas)] = flags
        self.replicas.append((proc, port))
        return proc

    def replica_url(self, index: int = 0) -> str:
        """Base URL of serving replica ``index``."""
        return f"http://{self.spec.host}:{self.replicas[index][1]}"

    def restart_replica(self, index: int = 0) -> ServiceProcess:
        """SIGKILL serving replica ``index`` and start it again on its port, with its flags."""
        proc, port = self.replicas[index]
        with contextlib.suppress(Exception):
            proc.kill()
            proc.stop()
        new = self._service("serve", f"serve-{self._next()}", ready=lambda: self._live(port),
                            flags=("--port", str(port), *self._replica_flags.get(index, ())))
        self.replicas[index] = (new, port)
        return new

    def metrics_targets(self) -> list[tuple[str, str, int]]:
        """``(service, name, port)`` of every running process that serves Prometheus metrics on
        ``spec.host``: the coordinator (``/metrics`` on its port), each parameter server and trainer
        given a port (``spec.metrics_ports``) and each serving replica (on its port)."""
        out = [("coordinator", "coordinator", self.coordinator_port)] if self.coordinator is not None else []
        out += [("ps", f"ps{g}", self.metrics_ports[f"ps{g}"]) for g in range(len(self.ps))
                if f"ps{g}" in self.metrics_ports]
        out += [("trainer", t.name, self.metrics_ports[t.name]) for t in self.trainers if t.name in self.metrics_ports]
        if self.joiner is not None and "join" in self.metrics_ports:
            out.append(("join", self.joiner.name, self.metrics_ports["join"]))
        out += [("serve", proc.name, port) for proc, port in self.replicas]
        return out

    def _live(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.spec.host}:{port}/v2/health/live", timeout=1.0) as resp:
                return bool(resp.status == 200)
        except urllib.error.HTTPError as exc:
            exc.close()
            return False
        except (OSError, urllib.error.URLError):
            return False

    def _next(self) -> int:
        self._started += 1
        return self._started

    def stop(self) -> None:
        """Stop everything, trainers first (they drain and leave), servers last."""
        replicas = [proc for proc, _ in self.replicas]
        for proc in [*replicas, *self.trainers, self.producer, self.events, self.joiner, *self.ps, self.coordinator,
                     self.kafka, self.redis]:
            if proc is not None:
                try:
                    proc.stop()
                except Exception:  # keep stopping the rest
                    logger.exception("could not stop %s", proc.name)

    def cleanup(self) -> None:
        """Remove the cluster folder (logs, data) when this object made it."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observing ----------------------------------------------------------------------------------
    def _get(self, path: str, timeout_s: float = 2.0) -> Any:
        try:
            with urllib.request.urlopen(self.coordinator_url + path, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            exc.close()  # its response's socket: closed now, not by the collector in some later test
            raise

    def _coordinator_up(self) -> bool:
        try:
            self._get("/healthz", timeout_s=1.0)
            return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def status(self) -> dict[str, Any] | None:
        """``/v1/status`` of the coordinator, or None while it does not answer."""
        try:
            return self._get("/v1/status")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def progressive(self) -> dict[str, Any] | None:
        """The progressive validation of a binary model (``/v1/history``'s ``progressive``: the job's
        series and each trainer's), or None while the coordinator does not answer."""
        try:
            return self._get("/v1/history", timeout_s=5.0)["progressive"]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return None

    def wait_for(self, predicate: Any, timeout_s: float, what: str) -> dict[str, Any]:
        """Poll the status until ``predicate(status)`` holds; return that status."""
        found: dict[str, Any] = {}

        def check() -> bool:
            st = self.status()
            if st is not None and predicate(st):
                found.update(st)
                return True
            self.raise_if_crashed()
            return False

        wait_until(check, timeout_s, interval_s=0.25, what=what)
        return found

    def raise_if_crashed(self) -> None:
        """Raise when a service that should run has exited on its own, with its log's tail."""
        for proc in [self.coordinator, *self.ps, *self.trainers, self.joiner, self.events]:
            if proc is not None and proc.pid is not None and proc.returncode not in (None, 0):
                raise RuntimeError(f"{proc.name} exited with code {proc.returncode}:\n{proc.log_tail(30)}")

    def producer_done(self) -> bool:
        """True once the producer has exited (successfully)."""
        return self.producer is not None and self.producer.returncode == 0

    def impressions_produced(self) -> int | None:
        """Impressions the events producer wrote, once it exited successfully (its last line says);
        None before."""
        if self.events is None or self.events.returncode != 0:
            return None
        found = re.findall(r"produced (\d+) impressions", self.events.log_tail(20))
        return int(found[-1]) if found else None

    def joined(self, st: dict[str, Any]) -> bool:
        """True when the joiner has labelled every impression the events producer wrote (the coordinator's
        status shows the joiner's last report; negatives dropped by downsampling count too)."""
        produced = self.impressions_produced()
        join = st.get("join") or {}
        return produced is not None and join.get("joined") == produced and not join.get("pending")

    def kill_trainer(self, index: int = 0) -> ServiceProcess:
        """SIGKILL trainer ``index`` (fault injection); it is removed from :attr:`trainers`."""
        trainer = self.trainers.pop(index)
        trainer.kill()
        trainer.stop()
        return trainer

    def kill_broker(self, index: int = 0) -> int:
        """SIGKILL Kafka broker ``index`` (node id ``index + 1``; fault injection); returns its node id.
        With three brokers the other two carry on; :meth:`restart_broker` brings it back."""
        assert self.kafka is not None
        self.kafka.kill(index)
        return self.kafka.nodes[index].node_id

    def restart_broker(self, index: int = 0) -> None:
        """Start Kafka broker ``index`` again on its ports and folder (SIGKILLed first if it runs);
        returns once it is back in the cluster."""
        assert self.kafka is not None
        self.kafka.restart(index)

    def kill_redis_master(self) -> str:
        """SIGKILL the Redis Cluster master that holds the job's keys (fault injection; needs
        ``spec.redis_cluster``, and ``spec.redis_replicas`` >= 1 for the job to survive it: the replica
        is promoted after ``cluster-node-timeout``); returns the killed node's address."""
        if not isinstance(self.redis, RedisCluster):
            raise ValueError("kill_redis_master needs a Redis Cluster (spec.redis_cluster)")
        return self.redis.kill_master_of(JobKeys(self.spec.job).config).address

    def restart(self, which: str, down_s: float = 0.0) -> None:
        """SIGKILL ``which`` (``ps``: every parameter server, ``coordinator``, ``redis`` or ``kafka``:
        every broker), wait ``down_s``, and start it again: Redis and Kafka on the same ports and
        folders (Redis reloads its AOF)."""
        if which not in ("ps", "coordinator", "redis", "kafka"):
            raise ValueError(f"cannot restart {which!r}: ps, coordinator, redis or kafka")
        if which == "redis" and isinstance(self.redis, RedisCluster):
            raise ValueError("cannot restart redis: this cluster runs a Redis Cluster (spec.redis_cluster), "
                             "whose nodes are not restarted; restart a single Redis server instead")
        procs = list(self.ps) if which == "ps" else [getattr(self, which)]
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.stop()
        time.sleep(down_s)
        if which == "redis":
            old = self.redis
            assert isinstance(old, RedisServer)  # a Redis Cluster was refused above
            self.redis = RedisServer(host=old.host, port=old.port, password=old.password,
                                     appendonly=self.spec.redis_aof, workdir=old.workdir).start()
        elif which == "kafka":
            procs[0].start()  # the killed brokers, on their ports and folders
        elif which == "ps":
            self.start_ps()
        else:
            self.start_coordinator()

    def freeze_trainer(self, index: int = 0) -> ServiceProcess:
        """SIGSTOP trainer ``index``: alive, silent, its lease running out (see :meth:`thaw`)."""
        trainer = self.trainers[index]
        assert trainer.pid is not None, f"{trainer.name} is not running"
        os.kill(trainer.pid, signal.SIGSTOP)
        return trainer

    @staticmethod
    def thaw(trainer: ServiceProcess) -> None:
        """SIGCONT a frozen trainer."""
        assert trainer.pid is not None, f"{trainer.name} is not running"
        os.kill(trainer.pid, signal.SIGCONT)

    def quiesce(self, timeout_s: float = 60.0) -> None:
        """Stop the producers, the joiner and the trainers (they drain, commit and leave), then wait until
        the parameter servers have applied every pushed update: the job then stands still."""
        for proc in [self.producer, self.events, self.joiner, *self.trainers]:
            if proc is not None:
                proc.stop()
        self.wait_applied(timeout_s)

    def wait_applied(self, timeout_s: float = 60.0) -> None:
        """Wait until the parameter servers have applied every pushed update, and so recorded its
        accounting: a push commits its offsets before the servers apply it, so an audit of committed
        records must wait for this (``unapplied`` is lowered with the accounting entry, atomically)."""
        from common.redis_client import connect
        from services import unapplied_updates

        client = connect(self.redis_url)

        def applied() -> bool:
            try:
                return unapplied_updates(client, self.spec.job) == 0
            except REDIS_DOWN:  # restarting: ask again
                return False

        try:
            wait_until(applied, timeout_s, what="the parameter servers to apply every pushed update")
        finally:
            client.close()

    @staticmethod
    def all_committed(st: dict[str, Any]) -> bool:
        """True when the status shows every partition's committed offset at its end."""
        parts = st.get("partitions", [])
        return bool(parts) and all(p["end"] is not None and p["committed"] == p["end"] for p in parts)

    def consumed(self, st: dict[str, Any]) -> bool:
        """True when our producer (if any) is done, so is our joiner (if any: :meth:`joined`), and
        everything they wrote is committed."""
        return ((self.producer is None or self.producer_done()) and (self.joiner is None or self.joined(st))
                and self.all_committed(st))

    def wait_reassigned(self, members: int, timeout_s: float = 30.0, *, what: str = "the partitions to be reassigned"
                        ) -> dict[str, Any]:
        """Wait until ``members`` members are live and every partition has an owner again (after a
        trainer was killed or left); return that status."""
        return self.wait_for(lambda st: len(st["members"]) == members and all(
            p["owner"] is not None for p in st["partitions"]), timeout_s, what)

    def wait_consumed(self, timeout_s: float) -> dict[str, Any]:
        """Wait until :meth:`consumed` holds, then until the servers have applied every pushed update
        (:meth:`wait_applied`: what an audit of the committed records needs); return that status."""
        status = self.wait_for(self.consumed, timeout_s, "every produced record to be committed")
        self.wait_applied(timeout_s)
        return status
