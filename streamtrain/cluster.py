"""The docker-compose topology as local processes: what ``streamtrain up`` runs.

:class:`LocalCluster` starts a real Kafka broker and a real Redis server
(the launcher), then the coordinator, parameter servers, trainers and a
producer as ``streamtrain`` child processes, each with its own log in the
cluster's folder. The end-to-end tests and ``bench/pipeline.py`` use it too,
with its fault helpers (kill a trainer, restart the parameter server or the
coordinator).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .launcher import KafkaBroker, RedisServer, ServiceProcess, free_port, wait_until
from .outage import REDIS_DOWN

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterSpec:
    """What to run. Every field maps onto a flag of one of the services."""

    job: str = "digits"
    """Job name (Redis keys, Kafka group)."""
    topic: str = "digits"
    """Training topic."""
    partitions: int = 4
    """Partitions of the training topic."""
    trainers: int = 2
    """Trainer processes."""
    model: str = "digits-mlp"
    """Model spec of the trainers."""
    batch_size: int = 64
    """Records per training step."""
    threads: int = 1
    """CPU threads per trainer."""
    consistency: str = "ssp"
    """bsp, ssp or asp."""
    staleness: int = 2
    """SSP bound."""
    codec: str = "topk+fp16"
    """Gradient codec."""
    topk_density: float = 0.01
    """Fraction of values a topk codec keeps."""
    optimizer: str = "lazyadam"
    """Optimizer: lazyadam trains digits to 95% fastest with the top-k codec (``bench/compression.py``)."""
    lr: float = 0.005
    """Learning rate (lazy Adam at 0.01 reached 95 % as fast but swung down to 81 % after it; ``bench/compression.py``)."""
    source: str | None = "digits?repeat=20"
    """Producer source spec (None: start no producer)."""
    source_split: str = "train"
    """Split of the source that is produced."""
    limit: int | None = None
    """Most records to produce."""
    shard_size: int = 32
    """Records per Kafka message."""
    rate: float | None = None
    """Records/s the producer stays under."""
    eval_source: str = "digits"
    """Held-out data (its test split) the trainers score."""
    eval_every: int = 25
    """Trainer steps between evaluations."""
    lease_ms: int = 3000
    """Coordinator lease."""
    heartbeat_interval_ms: int = 500
    """Trainer heartbeat period."""
    redis_aof: bool = True
    """Redis AOF persistence."""
    kafka_heap_mb: int = 512
    """Heap of the local broker."""
    ps_checkpoint_every: int = 0
    """Automatic checkpoint period in versions (0: off)."""
    extra_trainer_args: tuple[str, ...] = ()
    """More flags for every trainer."""


@dataclass
class LocalCluster:
    """Everything of one job on this machine. Use as a context manager."""

    spec: ClusterSpec = field(default_factory=ClusterSpec)
    workdir: Path | None = None
    redis: RedisServer | None = None
    kafka: KafkaBroker | None = None
    coordinator: ServiceProcess | None = None
    ps: ServiceProcess | None = None
    producer: ServiceProcess | None = None
    trainers: list[ServiceProcess] = field(default_factory=list)
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    job_token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    coordinator_port: int = field(default_factory=free_port)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _started: int = 0

    # -- addresses --------------------------------------------------------------------------------
    @property
    def coordinator_url(self) -> str:
        """Base URL of the coordinator."""
        return f"http://127.0.0.1:{self.coordinator_port}"

    @property
    def redis_url(self) -> str:
        """Redis URL of the job."""
        assert self.redis is not None
        return self.redis.url

    @property
    def bootstrap(self) -> str:
        """Kafka bootstrap address."""
        assert self.kafka is not None
        return self.kafka.bootstrap

    def _env(self) -> dict[str, str]:
        return {"STREAMTRAIN_JOB": self.spec.job, "STREAMTRAIN_REDIS_URL": self.redis_url,
                "STREAMTRAIN_KAFKA_BOOTSTRAP": self.bootstrap,
                "STREAMTRAIN_JOB_TOKEN": self.job_token, "STREAMTRAIN_ADMIN_TOKEN": self.admin_token,
                "STREAMTRAIN_COORDINATOR_URL": self.coordinator_url}

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        """Start servers and services; returns once the coordinator answers."""
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="streamtrain-cluster-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.redis = RedisServer(appendonly=self.spec.redis_aof,
                                     workdir=self.workdir / "redis").start()
            self.kafka = KafkaBroker(heap_mb=self.spec.kafka_heap_mb, log_level="WARN",
                                     workdir=self.workdir / "kafka").start()
            from datastream import ensure_topic

            ensure_topic(self.bootstrap, self.spec.topic, self.spec.partitions)
            self.start_coordinator()
            self.start_ps()
            if self.spec.source is not None:
                self.start_producer()
            for _ in range(self.spec.trainers):
                self.add_trainer()
        except BaseException:
            self.stop()
            raise
        return self

    def _service(self, name: str, args: list[str],
                 ready: Callable[[], bool] | None = None) -> ServiceProcess:
        proc = ServiceProcess(name, args, env=self._env(), ready=ready,
                              workdir=self.workdir / name, start_timeout_s=120, stop_timeout_s=30)
        return proc.start()

    def start_coordinator(self) -> ServiceProcess:
        """Start (or restart) the coordinator on its fixed port."""
        s = self.spec
        self.coordinator = self._service(f"coordinator-{self._next()}", [
            "coordinator", "--port", str(self.coordinator_port), "--topic", s.topic,
            "--partitions", str(s.partitions), "--consistency", s.consistency,
            "--staleness", str(s.staleness), "--codec", s.codec, "--optimizer", s.optimizer,
            "--lr", str(s.lr), "--lease-ms", str(s.lease_ms),
            "--heartbeat-interval-ms", str(s.heartbeat_interval_ms)], ready=self._coordinator_up)
        return self.coordinator

    def start_ps(self) -> ServiceProcess:
        """Start (or restart) the parameter server."""
        args = ["ps"]
        if self.spec.ps_checkpoint_every:
            args += ["--checkpoint-every", str(self.spec.ps_checkpoint_every),
                     "--checkpoint-dir", str(self.workdir / "checkpoints")]
        self.ps = self._service(f"ps-{self._next()}", args)
        return self.ps

    def start_producer(self) -> ServiceProcess:
        """Start the producer streaming ``spec.source`` into the topic."""
        s = self.spec
        args = ["produce", "--source", s.source, "--split", s.source_split, "--topic", s.topic,
                "--partitions", str(s.partitions), "--shard-size", str(s.shard_size), "--no-progress"]
        if s.limit is not None:
            args += ["--limit", str(s.limit)]
        if s.rate is not None:
            args += ["--rate", str(s.rate)]
        self.producer = self._service("producer", args)
        return self.producer

    def add_trainer(self) -> ServiceProcess:
        """Start one more trainer."""
        s = self.spec
        args = ["trainer", "--model", s.model, "--batch-size", str(s.batch_size),
                "--threads", str(s.threads), "--topk-density", str(s.topk_density),
                "--eval-every", str(s.eval_every), *s.extra_trainer_args]
        if s.eval_source:
            args += ["--eval-source", s.eval_source]
        trainer = self._service(f"trainer-{self._next()}", args)
        self.trainers.append(trainer)
        return trainer

    def _next(self) -> int:
        self._started += 1
        return self._started

    def stop(self) -> None:
        """Stop everything, trainers first (they drain and leave), servers last."""
        for proc in [*self.trainers, self.producer, self.ps, self.coordinator, self.kafka, self.redis]:
            if proc is not None:
                try:
                    proc.stop()
                except Exception:  # noqa: BLE001 - keep stopping the rest
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
        with urllib.request.urlopen(self.coordinator_url + path, timeout=timeout_s) as resp:  # noqa: S310
            return json.loads(resp.read())

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
        for proc in [self.coordinator, self.ps, *self.trainers]:
            if proc is not None and proc.pid is not None and proc.returncode not in (None, 0):
                raise RuntimeError(f"{proc.name} exited with code {proc.returncode}:\n{proc.log_tail(30)}")

    def producer_done(self) -> bool:
        """True once the producer has exited (successfully)."""
        return self.producer is not None and self.producer.returncode == 0

    def kill_trainer(self, index: int = 0) -> ServiceProcess:
        """SIGKILL trainer ``index`` (fault injection); it is removed from :attr:`trainers`."""
        trainer = self.trainers.pop(index)
        trainer.kill()
        trainer.stop()
        return trainer

    def restart(self, which: str, down_s: float = 0.0) -> None:
        """SIGKILL ``which`` (``ps``, ``coordinator``, ``redis`` or ``kafka``), wait ``down_s``, and
        start a new one: Redis and Kafka on the same port and folder (Redis reloads its AOF)."""
        proc = getattr(self, which)
        with contextlib.suppress(Exception):
            proc.kill()
            proc.stop()
        time.sleep(down_s)
        if which == "redis":
            self.redis = RedisServer(port=proc.port, password=proc.password, appendonly=self.spec.redis_aof,
                                     workdir=proc.workdir).start()
        elif which == "kafka":
            self.kafka = KafkaBroker(port=proc.port, heap_mb=self.spec.kafka_heap_mb, log_level="WARN",
                                     workdir=proc.workdir).start()
        elif which in ("ps", "coordinator"):
            (self.start_ps if which == "ps" else self.start_coordinator)()
        else:
            raise ValueError(f"cannot restart {which!r}: ps, coordinator, redis or kafka")

    def freeze_trainer(self, index: int = 0) -> ServiceProcess:
        """SIGSTOP trainer ``index``: alive, silent, its lease running out (see :meth:`thaw`)."""
        trainer = self.trainers[index]
        os.kill(trainer.pid, signal.SIGSTOP)
        return trainer

    @staticmethod
    def thaw(trainer: ServiceProcess) -> None:
        """SIGCONT a frozen trainer."""
        os.kill(trainer.pid, signal.SIGCONT)

    def quiesce(self, timeout_s: float = 60.0) -> None:
        """Stop the producer and the trainers (they drain, commit and leave), then wait until
        the parameter server has applied every pushed update: the job then stands still."""
        import redis as redis_lib

        from services import unapplied_updates

        for proc in [self.producer, *self.trainers]:
            if proc is not None:
                proc.stop()
        client = redis_lib.Redis.from_url(self.redis_url)

        def applied() -> bool:
            try:
                return unapplied_updates(client, self.spec.job) == 0
            except REDIS_DOWN:  # restarting: ask again
                return False

        try:
            wait_until(applied, timeout_s, what="the parameter server to apply every pushed update")
        finally:
            client.close()

    @staticmethod
    def all_committed(st: dict[str, Any]) -> bool:
        """True when the status shows every partition's committed offset at its end."""
        parts = st.get("partitions", [])
        return bool(parts) and all(p["end"] is not None and p["committed"] == p["end"] for p in parts)

    def consumed(self, st: dict[str, Any]) -> bool:
        """True when our producer (if any) is done and everything it wrote is committed."""
        return (self.producer is None or self.producer_done()) and self.all_committed(st)

    def wait_consumed(self, timeout_s: float) -> dict[str, Any]:
        """Wait until :meth:`consumed` holds; return that status."""
        return self.wait_for(self.consumed, timeout_s, "every produced record to be committed")
