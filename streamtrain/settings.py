"""Settings of ``streamtrain up``: one frozen dataclass, filled from flags and environment
(:mod:`common.settings`). The job's own settings are declared by the service that owns them, so
``up``'s defaults, variables and bounds are the services' (:func:`_as_in`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from common import settings as cfg
from datastream.settings import JoinSettings

from .cluster import LOCAL_STREAM, ClusterSpec

__all__ = ["FOREVER_RATE", "UpSettings"]

FOREVER_RATE = 1000.0
"""Records/s a ``--forever`` producer stays under unless ``--rate`` says otherwise: a realistic
online stream, well under what two trainers sustain on two cores (``bench/pipeline.py`` measures
that capacity), so the live view shows the headroom; raise ``--rate`` to see the advice."""

_LOCAL = ClusterSpec()
"""The local topology's defaults, which are the services' own (``LOCAL_STREAM`` and ``LOCAL_TRAINER``
aside): ``up``'s job flags take their defaults, variables, bounds and help from there."""


_SAME = object()


def _as_in(settings: Any, name: str, default: Any = _SAME, **changes: Any) -> Any:
    """An :class:`UpSettings` field declared like field ``name`` of a service's settings dataclass
    (environment variable, bounds, choices, help), its default the value ``settings`` holds (or
    ``default``); ``changes`` override parts of the declaration."""
    meta = next(f.metadata for f in dataclasses.fields(settings) if f.name == name)
    declared = {"env": meta["env"], "help": meta["help"], "min": meta["min"], "max": meta["max"],
                "choices": meta["choices"], **changes}
    return cfg.setting(getattr(settings, name) if default is _SAME else default, **declared)


@dataclass(frozen=True)
class UpSettings:
    """Settings of the local main job. The job's own settings are declared by the service that owns
    them (:func:`_as_in`), so ``up``'s defaults are the services' defaults."""

    example: str = cfg.setting("digits", env="STREAMTRAIN_EXAMPLE", choices=("digits", "movielens", "clicks"),
                               help="what to train: digits, movielens (MovieLens-100K through the ranking model "
                                    "with embedding tables) or clicks (impressions and delayed clicks joined into "
                                    "the training topic, --join); flags given beside it win over its settings")
    trainers: int = cfg.setting(_LOCAL.trainers, env="STREAMTRAIN_TRAINERS", min=1, max=64,
                                help="trainer processes")
    serve: int = cfg.setting(1, env="STREAMTRAIN_UP_SERVE", min=0, max=16,
                             help="serving replicas (streamtrain serve), each on a free port; the first scores a "
                                  "sample of the records before they are produced (the served AUC); 0: none")
    partitions: int = _as_in(_LOCAL.coordinator, "partitions")
    consistency: str = _as_in(_LOCAL.coordinator, "consistency", help="consistency model")
    staleness: int = _as_in(_LOCAL.coordinator, "staleness", help="SSP staleness bound")
    table_consistency: str | None = _as_in(_LOCAL.coordinator, "table_consistency")
    table_staleness: int | None = _as_in(_LOCAL.coordinator, "table_staleness")
    codec: str = _as_in(_LOCAL.coordinator, "codec", help="gradient codec")
    optimizer: str = _as_in(_LOCAL.coordinator, "optimizer")
    lr: float = _as_in(_LOCAL.coordinator, "lr", help="learning rate")
    local_steps: int = _as_in(_LOCAL.coordinator, "local_steps")
    outer_lr: float = _as_in(_LOCAL.coordinator, "outer_lr")
    outer_momentum: float = _as_in(_LOCAL.coordinator, "outer_momentum")
    ps_groups: int = _as_in(_LOCAL.coordinator, "ps_groups", help="parameter servers, each applying the shards "
                                                                  "of one group (shard i: group i mod N)")
    topk_density: float = _as_in(_LOCAL.trainer, "topk_density")
    dense_below: int = _as_in(_LOCAL.trainer, "dense_below")
    density_warmup_steps: int = _as_in(_LOCAL.trainer, "density_warmup_steps")
    source: str = _as_in(LOCAL_STREAM, "source", help="what the producer streams (its train split)")
    model: str = _as_in(_LOCAL.trainer, "model")
    eval_source: str = _as_in(_LOCAL.trainer, "eval_source", "",
                              help="held-out data (its test split; default: one pass of --source)")
    target_accuracy: float = cfg.setting(0.95, env="STREAMTRAIN_TARGET_ACCURACY", min=0.0, max=1.0,
                                         help="stop once the held-out accuracy reaches this (classification)")
    target_auc: float | None = cfg.setting(None, env="STREAMTRAIN_TARGET_AUC", min=0.0, max=1.0,
                                           help="stop once the held-out AUC reaches this (a binary model; the "
                                                "accuracy target then does not apply)")
    target_loss: float | None = cfg.setting(None, env="STREAMTRAIN_TARGET_LOSS", min=0.0,
                                            help="stop once the held-out loss is at or below this (any task)")
    join: bool = cfg.setting(False, env="STREAMTRAIN_UP_JOIN",
                             help="the records arrive as impressions and delayed clicks (streamtrain produce-events "
                                  "from a clicks --source) and the joiner labels them for the training topic "
                                  "(streamtrain join); --max-records then counts impressions")
    negative_rate: float = _as_in(JoinSettings(), "negative_rate")
    max_records: int = cfg.setting(0, env="STREAMTRAIN_MAX_RECORDS", min=0,
                                   help="stop once this many records are produced and trained on (0: no limit)")
    timeout_s: float = cfg.setting(600.0, env="STREAMTRAIN_UP_TIMEOUT_S", min=1.0,
                                   help="give up after this long")
    forever: bool = cfg.setting(False, env="STREAMTRAIN_FOREVER",
                                help="online continuous training: stream forever until Ctrl-C")
    rate: float | None = cfg.setting(None, env="STREAMTRAIN_UP_RATE", min=0.0,
                                     help=f"records/s the producer stays under, 0 for unbounded (default: "
                                          f"{FOREVER_RATE:g} with --forever, else unbounded)")
    outage_limit_s: float = cfg.setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                        help="longest Redis outage the live view rides out before giving up")
    kafka_heap_mb: int = cfg.setting(_LOCAL.kafka_heap_mb, env="STREAMTRAIN_KAFKA_HEAP_MB", min=128,
                                     help="heap of each local Kafka broker")
    kafka_brokers: int = cfg.setting(_LOCAL.kafka_brokers, env="STREAMTRAIN_KAFKA_BROKERS", min=1, max=9,
                                     help="Kafka brokers (KRaft nodes) on loopback; with 3 or more, topics keep "
                                          "3 copies with min.insync.replicas=2, so one broker may die")
    redis_cluster: bool = cfg.setting(_LOCAL.redis_cluster, env="STREAMTRAIN_REDIS_CLUSTER",
                                      help="run the job on a local Redis Cluster of three masters "
                                           "(a redis+cluster:// URL) instead of one Redis server")
    model_out: str = cfg.setting("", env="STREAMTRAIN_MODEL_OUT",
                                 help="write the final model to this file (safetensors) when the run ends")
