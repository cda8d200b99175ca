"""Settings of the coordinator service: one frozen dataclass, filled from flags and environment.

The rules of local steps it checks, and the bounds of their flags, live in :mod:`services.local_steps`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import setting
from services.local_steps import MAX_LOCAL_STEPS, MAX_OUTER_LR, MAX_OUTER_MOMENTUM_FLAG, check_local_steps
from services.names import OPTIMIZERS

CONSISTENCY_MODELS = ("bsp", "ssp", "asp")
"""Consistency models a job may run under (bulk-synchronous, stale-synchronous, asynchronous)."""


@dataclass(frozen=True)
class CoordinatorSettings:
    """Configuration of ``streamtrain coordinator``.

    The job fields (``topic`` .. ``table_staleness``) seed ``JobKeys.config``
    when a job is first started; on a restart the configuration already stored
    in Redis wins (a table field that was unset stays unset).
    """

    job: str = setting("default", env="STREAMTRAIN_JOB", help="name of the training job")
    redis_url: str = setting("redis://127.0.0.1:6379/0", env="STREAMTRAIN_REDIS_URL",
                             help="Redis holding the job's state")
    kafka_bootstrap: str = setting("127.0.0.1:9092", env="STREAMTRAIN_KAFKA_BOOTSTRAP",
                                   help="Kafka bootstrap servers (host:port[,host:port])")
    topic: str = setting("streamtrain", env="STREAMTRAIN_TOPIC", help="training topic")
    partitions: int = setting(4, env="STREAMTRAIN_PARTITIONS", min=1, max=10_000,
                              help="number of partitions of the training topic")
    lease_ms: int = setting(3000, env="STREAMTRAIN_LEASE_MS", min=100, max=600_000,
                            help="a member that has not heartbeated for this long is dead")
    heartbeat_interval_ms: int = setting(500, env="STREAMTRAIN_HEARTBEAT_INTERVAL_MS", min=10,
                                         max=60_000, help="how often trainers heartbeat")
    admin_token: str = setting("", env="STREAMTRAIN_ADMIN_TOKEN",
                               help="bearer token of admin calls (required)")
    job_token: str = setting("", env="STREAMTRAIN_JOB_TOKEN",
                             help="bearer token of trainer calls (required)")
    host: str = setting("127.0.0.1", env="STREAMTRAIN_COORDINATOR_HOST", help="address to bind")
    port: int = setting(8700, env="STREAMTRAIN_COORDINATOR_PORT", min=0, max=65535,
                        help="port to bind (0: any free port)")
    consistency: str = setting("ssp", env="STREAMTRAIN_CONSISTENCY", choices=CONSISTENCY_MODELS,
                               help="consistency model of a new job")
    staleness: int = setting(2, env="STREAMTRAIN_STALENESS", min=0, max=1000,
                             help="SSP staleness bound s of a new job")
    codec: str = setting("topk+fp16", env="STREAMTRAIN_CODEC", help="gradient codec of a new job")
    optimizer: str = setting("lazyadam", env="STREAMTRAIN_OPTIMIZER", choices=OPTIMIZERS,
                             help="optimizer of a new job: sgd, adam (dense), lazyadam, dgc (sparse: a top-k "
                                  "gradient changes only its coordinates)")
    lr: float = setting(0.005, env="STREAMTRAIN_LR", min=0.0, max=10.0,
                        help="learning rate of a new job")
    local_steps: int = setting(1, env="STREAMTRAIN_LOCAL_STEPS", min=1, max=MAX_LOCAL_STEPS,
                               help="local steps H of a new job (DiLoCo): each trainer takes H steps of its inner "
                                    "optimizer (AdamW for adam/lazyadam, SGD for sgd) on its own replica between a "
                                    "pull and a push, and pushes the difference of its parameters since the pull, "
                                    "which the parameter servers apply with Nesterov momentum (--outer-lr, "
                                    "--outer-momentum); 1: push every step's gradient, the optimizer on the servers")
    outer_lr: float = setting(0.7, env="STREAMTRAIN_OUTER_LR", min=0.0, max=MAX_OUTER_LR,
                              help="with --local-steps > 1: learning rate of the servers' outer Nesterov optimizer")
    outer_momentum: float = setting(0.9, env="STREAMTRAIN_OUTER_MOMENTUM", min=0.0, max=MAX_OUTER_MOMENTUM_FLAG,
                                    help="with --local-steps > 1: momentum of the servers' outer Nesterov optimizer")
    ps_groups: int = setting(1, env="STREAMTRAIN_PS_GROUPS", min=1, max=1024,
                             help="parameter-server shard groups of a new job (shard i belongs to group "
                                  "i mod N); fixed once the model exists")
    table_consistency: str | None = setting(None, env="STREAMTRAIN_TABLE_CONSISTENCY", choices=CONSISTENCY_MODELS,
                                            help="consistency model of a new job's embedding tables (unset: "
                                                 "the dense part's, --consistency)")
    table_staleness: int | None = setting(None, env="STREAMTRAIN_TABLE_STALENESS", min=0, max=1000,
                                          help="staleness bound of a new job's embedding tables (unset: the "
                                               "dense part's, --staleness)")
    max_request_bytes: int = setting(64 * 1024, env="STREAMTRAIN_COORDINATOR_MAX_REQUEST_BYTES",
                                     min=1024, max=16 * 1024 * 1024,
                                     help="largest request body accepted")
    outage_limit_s: float = setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                    help="longest Redis outage ridden out before the coordinator exits with an error")
    departed_retention_s: float = setting(3600.0, env="STREAMTRAIN_COORDINATOR_DEPARTED_RETENTION_S", min=0.0,
                                          max=30 * 86400.0,
                                          help="keep the record of a departed member (its late heartbeat is told "
                                               "it is gone) this long, then forget it")
    kafka_timeout_ms: int = setting(2000, env="STREAMTRAIN_COORDINATOR_KAFKA_TIMEOUT_MS", min=100,
                                    max=60_000, help="timeout of Kafka probes (readyz, end offsets)")
    history_samples: int = setting(3600, env="STREAMTRAIN_COORDINATOR_HISTORY_SAMPLES", min=10,
                                   max=86_400, help="samples (one a second) of loss, throughput, lag, "
                                                    "staleness and freshness kept for /v1/history and the dashboard")

    def __post_init__(self) -> None:
        if self.heartbeat_interval_ms >= self.lease_ms:
            raise ValueError(f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be smaller "
                             f"than lease_ms ({self.lease_ms})")
        check_local_steps(self.local_steps, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                          optimizer=self.optimizer, codec=self.codec)

    @property
    def check_interval_s(self) -> float:
        """Period of the lease checker: a quarter of the lease."""
        return self.lease_ms / 4000.0
