"""Settings of ``streamtrain produce``: one frozen dataclass, filled from flags and environment
(:mod:`common.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from common import settings as cfg

__all__ = ["ProduceSettings"]


@dataclass(frozen=True)
class ProduceSettings:
    """Settings of the shard producer."""

    source: str = cfg.setting("digits", env="STREAMTRAIN_SOURCE",
                              help="source spec: digits, synthetic?..., csv:PATH, npz:PATH, jsonl:PATH, "
                                   "stdin, module:callable")
    topic: str = cfg.setting("digits", env="STREAMTRAIN_TOPIC", help="training topic")
    bootstrap: str = cfg.setting("127.0.0.1:9092", env="STREAMTRAIN_KAFKA_BOOTSTRAP",
                                 help="Kafka bootstrap servers")
    partitions: int = cfg.setting(4, env="STREAMTRAIN_PARTITIONS", min=1, max=4096,
                                  help="partitions when the topic is created")
    shard_size: int = cfg.setting(256, env="STREAMTRAIN_SHARD_SIZE", min=1, max=1_000_000,
                                  help="records per shard")
    rate: float | None = cfg.setting(None, env="STREAMTRAIN_PRODUCE_RATE", min=0.001,
                                     help="records per second to stay under (default: unthrottled)")
    limit: int | None = cfg.setting(None, env="STREAMTRAIN_PRODUCE_LIMIT", min=0,
                                    help="stop after this many records")
    split: str = cfg.setting("all", env="STREAMTRAIN_SPLIT", choices=("train", "test", "all"),
                             help="which split of the source to produce")
    producer_id: str | None = cfg.setting(None, env="STREAMTRAIN_PRODUCER_ID",
                                          help="id written into the shards (default: host-pid-random)")
    progress: bool = cfg.setting(True, env="STREAMTRAIN_PROGRESS", help="show a progress bar")
    outage_limit_s: float = cfg.setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                        help="longest broker outage ridden out before the producer exits "
                                             "with an error")
    max_in_flight_shards: int = cfg.setting(256, env="STREAMTRAIN_PRODUCE_MAX_IN_FLIGHT_SHARDS", min=1,
                                            max=65_536, help="unacknowledged shards held in memory before "
                                                             "the producer waits for the brokers")
    score_url: str = cfg.setting("", env="STREAMTRAIN_PRODUCE_SCORE_URL",
                                 help="a serving replica's base URL: every --score-every-th record is POSTed with its "
                                      "label to its /v1/predict before it is produced (the served AUC, scored before "
                                      "any trainer trains on it); empty: off")
    score_token: str = cfg.setting("", env="STREAMTRAIN_PRODUCE_SCORE_TOKEN",
                                   help="bearer token of the replica's model routes (the job token, unless the "
                                        "replica has a --serve-token)")
    score_every: int = cfg.setting(10, env="STREAMTRAIN_PRODUCE_SCORE_EVERY", min=1, max=1_000_000,
                                   help="with --score-url, the share of the stream scored: every Nth record")
    score_wait_s: float = cfg.setting(120.0, env="STREAMTRAIN_PRODUCE_SCORE_WAIT_S", min=0.0, max=3600.0,
                                      help="with --score-url, wait up to this long for the replica to be ready "
                                           "before producing, so the first records are scored too (0: do not wait)")
