"""Settings of the serving replica (``streamtrain serve``), a frozen dataclass filled from flags and
environment (:mod:`common.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import setting

__all__ = ["ServeSettings"]


@dataclass(frozen=True)
class ServeSettings:
    """Configuration of one serving replica."""

    job: str = setting("default", env="STREAMTRAIN_JOB", help="job whose model this replica serves")
    model: str = setting("digits-mlp", env="STREAMTRAIN_MODEL",
                         help="the job's model spec, as its trainers have it (built-in, dlrm?OPTIONS or "
                              "package.module:factory)")
    coordinator_url: str = setting("http://127.0.0.1:8700", env="STREAMTRAIN_COORDINATOR_URL",
                                   help="base URL of the coordinator (its feed, GET /v1/model/updates)")
    job_token: str = setting("", env="STREAMTRAIN_JOB_TOKEN",
                             help="the job's token: reads the coordinator's feed, and authorises the model "
                                  "routes of this replica unless --serve-token is set")
    serve_token: str = setting("", env="STREAMTRAIN_SERVE_TOKEN",
                               help="a token of the replica's own for its model routes (empty: the job token); "
                                    "the health routes take none")
    redis_url: str = setting("redis://127.0.0.1:6379/0", env="STREAMTRAIN_REDIS_URL",
                             help="Redis holding the parameters (the replica's own export on start and reload, "
                                  "and the rows it misses with --max-rows)")
    host: str = setting("127.0.0.1", env="STREAMTRAIN_SERVE_HOST", help="address to listen on")
    port: int = setting(8800, env="STREAMTRAIN_SERVE_PORT", min=0, max=65535,
                        help="port to listen on (0: a free one, printed)")
    export_dir: str = setting("", env="STREAMTRAIN_SERVE_EXPORT_DIR",
                              help="start from this `streamtrain export --tables-dir` folder (its dense part "
                                   "is model.safetensors in it, or the first feed answer's), then follow the "
                                   "feed from its position; empty: take an export of its own from Redis")
    max_rows: int = setting(0, env="STREAMTRAIN_SERVE_MAX_ROWS", min=0, max=1 << 31,
                            help="rows kept per table, the most recently used (0: every row of every table); "
                                 "with a bound, a row not kept is read from Redis on its request and counted "
                                 "as a miss")
    poll_interval_s: float = setting(0.05, env="STREAMTRAIN_SERVE_POLL_INTERVAL_S", min=0.001, max=60.0,
                                     help="wait between reads of the feed once caught up")
    max_staleness_s: float = setting(30.0, env="STREAMTRAIN_SERVE_MAX_STALENESS_S", min=0.1,
                                     help="GET /v2/health/ready turns false once the feed has not been read "
                                          "this long (the replica keeps answering from its last state)")
    max_records: int = setting(4096, env="STREAMTRAIN_SERVE_MAX_RECORDS", min=1, max=1 << 20,
                               help="most records one request may hold")
    name: str = setting("", env="STREAMTRAIN_SERVE_NAME",
                        help="this replica's name in its reports to the coordinator (empty: host:port)")
    url: str = setting("", env="STREAMTRAIN_SERVE_URL",
                       help="the URL clients reach this replica at, as reported (empty: http://host:port)")
    report_every_s: float = setting(1.0, env="STREAMTRAIN_SERVE_REPORT_EVERY_S", min=0.0, max=3600.0,
                                    help="report the served version, lag, rows, requests and served AUC to the "
                                         "coordinator this often (its status page and `up` show them; 0: never)")
    threads: int = setting(1, env="STREAMTRAIN_SERVE_THREADS", min=1, max=256,
                           help="torch intra-op threads of the forward pass")
