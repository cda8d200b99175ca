"""Settings of ``streamtrain produce``: one frozen dataclass, filled from flags and environment
(:mod:`common.settings`)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from common import settings as cfg

from .join.events import FORMATS

__all__ = ["EventsSettings", "JoinSettings", "ProduceSettings"]


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


@dataclass(frozen=True)
class EventsSettings:
    """Settings of ``streamtrain produce-events``: impressions and delayed clicks for ``streamtrain join``
    (docs/join.md, *The events source*)."""

    bootstrap: str = cfg.setting("127.0.0.1:9092", env="STREAMTRAIN_KAFKA_BOOTSTRAP",
                                 help="Kafka bootstrap servers")
    impressions: str = cfg.setting("impressions", env="STREAMTRAIN_EVENTS_IMPRESSIONS", help="impressions topic")
    feedback: str = cfg.setting("feedback", env="STREAMTRAIN_EVENTS_FEEDBACK", help="feedback (clicks) topic")
    partitions: int = cfg.setting(4, env="STREAMTRAIN_EVENTS_PARTITIONS", min=1, max=4096,
                                  help="partitions of both topics when they are created")
    stream: str = cfg.setting("clicks", env="STREAMTRAIN_EVENTS_STREAM",
                              help="the click stream the impressions come from: clicks?features=..&dense=..&seed=.. "
                                   "(its options: docs/records.md, The clicks source)")
    limit: int | None = cfg.setting(None, env="STREAMTRAIN_EVENTS_LIMIT", min=0,
                                    help="impressions to write, every click of theirs included (default: until "
                                         "stopped)")
    rate_per_s: float = cfg.setting(1000.0, env="STREAMTRAIN_EVENTS_RATE_PER_S", min=0.001, max=1e9,
                                    help="impressions per second of event time")
    start_ms: int | None = cfg.setting(None, env="STREAMTRAIN_EVENTS_START_MS", min=0, max=2 ** 52 - 1,
                                       help="event time of the first impression, ms since the epoch (default: now)")
    delay_mean_s: float = cfg.setting(3.0, env="STREAMTRAIN_EVENTS_DELAY_MEAN_S", min=0.001, max=1e6,
                                      help="mean of the exponential delay from an impression to its click, seconds "
                                           "of event time")
    disorder_ms: int = cfg.setting(0, env="STREAMTRAIN_EVENTS_DISORDER_MS", min=0, max=86_400_000,
                                   help="jitter each event's place in the emission order by up to this many ms of "
                                        "event time (0: in event-time order)")
    seed: int = cfg.setting(0, env="STREAMTRAIN_EVENTS_SEED", min=0, help="seed of the delays and the jitter")
    rate: float | None = cfg.setting(None, env="STREAMTRAIN_EVENTS_RATE", min=0.001,
                                     help="events (impressions and clicks) per second of wall time to stay under "
                                          "(default: unthrottled)")
    final_watermark_s: float = cfg.setting(3600.0, env="STREAMTRAIN_EVENTS_FINAL_WATERMARK_S", min=0.0, max=1e7,
                                           help="the punctuation written to every partition at the end: the last "
                                                "event time plus this many seconds")
    truth: str = cfg.setting("", env="STREAMTRAIN_EVENTS_TRUTH",
                             help="write the ground truth of every label to this JSON-lines file (empty: off)")
    window_s: float = cfg.setting(30.0, env="STREAMTRAIN_EVENTS_WINDOW_S", min=0.0, max=1e7,
                                  help="the join window the ground truth's labels are for")
    format: str = cfg.setting("msgpack", env="STREAMTRAIN_EVENTS_FORMAT", choices=("msgpack", "json"),
                              help="encoding of the events")
    train_split: bool = cfg.setting(False, env="STREAMTRAIN_EVENTS_TRAIN_SPLIT",
                                    help="only the stream's train split becomes impressions: its test split "
                                         "(every 5th record) is left out, the held-out data a job is scored on")


@dataclass(frozen=True)
class JoinSettings:
    """Settings of the joiner."""

    bootstrap: str = cfg.setting("127.0.0.1:9092", env="STREAMTRAIN_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers")
    impressions: str = cfg.setting("impressions", env="STREAMTRAIN_JOIN_IMPRESSIONS",
                                   help="topic of impressions (keyed by impression id)")
    feedback: str = cfg.setting("feedback", env="STREAMTRAIN_JOIN_FEEDBACK",
                                help="feedback topic, or several separated by commas (keyed by impression id, as "
                                     "many partitions as the impressions topic)")
    topic: str = cfg.setting("clicks", env="STREAMTRAIN_TOPIC", help="training topic the labelled records go to")
    label: str = cfg.setting("click", env="STREAMTRAIN_JOIN_LABEL",
                             help="the feedback label that makes an impression positive (others are counted, "
                                  "not joined)")
    window_s: float = cfg.setting(30.0, env="STREAMTRAIN_JOIN_WINDOW_S", min=0.0, max=30 * 86400.0,
                                  help="feedback within this long after its impression (event time) makes it "
                                       "positive")
    allowed_lateness_s: float = cfg.setting(5.0, env="STREAMTRAIN_JOIN_ALLOWED_LATENESS_S", min=0.0,
                                            max=86400.0, help="how far the watermark stays behind the inputs' "
                                                              "event times: out-of-order events within it still join")
    retain_s: float | None = cfg.setting(None, env="STREAMTRAIN_JOIN_RETAIN_S", min=0.0, max=30 * 86400.0,
                                         help="how long past its window end a decided impression is remembered "
                                              "(duplicates, late feedback); default: the window")
    late: str = cfg.setting("", env="STREAMTRAIN_JOIN_LATE",
                            help="topic late feedback is written to, with its reason (empty: counted only)")
    max_pending: int = cfg.setting(1_000_000, env="STREAMTRAIN_JOIN_MAX_PENDING", min=1, max=1 << 31,
                                   help="impressions (and, apart, early feedback events) kept per partition; "
                                        "beyond, the oldest are decided early (negative) and counted")
    negative_rate: float = cfg.setting(1.0, env="STREAMTRAIN_JOIN_NEGATIVE_RATE", min=1e-6, max=1.0,
                                       help="share of negatives written (chosen by a hash of the impression id), "
                                            "each with weight 1/rate so the model stays calibrated")
    app_id: str = cfg.setting("streamtrain-join", env="STREAMTRAIN_JOIN_APP_ID",
                              help="the join's name: its consumer group, transactional-id prefix and "
                                   "changelog topic (<app-id>.changelog)")
    instance_id: str = cfg.setting(socket.gethostname(), env="STREAMTRAIN_JOIN_INSTANCE_ID",
                                   help="this joiner's name, the same across its restarts (its transactional id "
                                        "is <app-id>-<instance-id>: a restart aborts what its predecessor left "
                                        "open); default: the host name")
    commit_interval_ms: int = cfg.setting(100, env="STREAMTRAIN_JOIN_COMMIT_INTERVAL_MS", min=1, max=600_000,
                                          help="how often a transaction commits what was joined")
    idle_s: float = cfg.setting(30.0, env="STREAMTRAIN_JOIN_IDLE_S", min=0.1, max=86400.0,
                                help="an input partition with nothing new for this long (wall clock) stops "
                                     "holding the watermark back")
    transaction_timeout_s: float = cfg.setting(10.0, env="STREAMTRAIN_JOIN_TRANSACTION_TIMEOUT_S", min=1.0,
                                               max=900.0, help="how long the broker keeps a dead joiner's open "
                                                               "transaction before aborting it")
    session_timeout_s: float = cfg.setting(10.0, env="STREAMTRAIN_JOIN_SESSION_TIMEOUT_S", min=6.0, max=300.0,
                                           help="how long the group waits for a silent joiner before moving its "
                                                "partitions")
    format: str = cfg.setting("msgpack", env="STREAMTRAIN_JOIN_FORMAT", choices=FORMATS,
                              help="encoding of the records written")
    partitions: int = cfg.setting(0, env="STREAMTRAIN_PARTITIONS", min=0, max=4096,
                                  help="partitions of the training topic when the joiner creates it "
                                       "(0: as many as the impressions topic)")
    metrics_port: int = cfg.setting(0, env="STREAMTRAIN_JOIN_METRICS_PORT", min=0, max=65535,
                                    help="port of the joiner's Prometheus /metrics (0: off)")
    coordinator_url: str = cfg.setting("", env="STREAMTRAIN_COORDINATOR_URL",
                                       help="coordinator to report to every second (empty: no reports)")
    job_token: str = cfg.setting("", env="STREAMTRAIN_JOB_TOKEN", help="the job's token, for the reports")
    outage_limit_s: float = cfg.setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                        help="longest broker outage ridden out before the joiner exits with an "
                                             "error")

    @property
    def feedback_topics(self) -> list[str]:
        """The feedback topics."""
        return [t.strip() for t in self.feedback.split(",") if t.strip()]

    def __post_init__(self) -> None:
        topics = [self.impressions, *self.feedback_topics]
        if not self.feedback_topics:
            raise cfg.SettingsError("--feedback / STREAMTRAIN_JOIN_FEEDBACK: name at least one feedback topic")
        if len(set(topics)) != len(topics) or self.topic in topics or (self.late and self.late in topics):
            raise cfg.SettingsError(f"--impressions, --feedback, --topic and --late must name different topics, "
                                    f"got {self.impressions!r}, {self.feedback!r}, {self.topic!r}, {self.late!r}")
        if not self.instance_id or not self.app_id:
            raise cfg.SettingsError("--app-id and --instance-id must not be empty")
