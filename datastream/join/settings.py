"""Settings of ``streamtrain join``: one frozen dataclass, filled from flags and environment
(:mod:`common.settings`)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from common import settings as cfg

from .events import FORMATS

__all__ = ["JoinSettings"]


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
    token: str = cfg.setting("", env="STREAMTRAIN_JOB_TOKEN", help="the job's token, for the reports")
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
