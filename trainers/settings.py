"""Settings of a trainer service (``streamtrain trainer``)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import setting
from services.codecs import DEFAULT_DENSE_BELOW


@dataclass(frozen=True)
class TrainerSettings:
    """Configuration of one trainer. The job's consistency model, codec and
    learning rate come from the coordinator, not from here."""

    job: str = setting("default", env="STREAMTRAIN_JOB", help="name of the training job")
    coordinator_url: str = setting("http://127.0.0.1:8700", env="STREAMTRAIN_COORDINATOR_URL",
                                   help="base URL of the coordinator")
    job_token: str = setting("", env="STREAMTRAIN_JOB_TOKEN",
                             help="bearer token of trainer calls to the coordinator")
    redis_url: str = setting("redis://127.0.0.1:6379/0", env="STREAMTRAIN_REDIS_URL",
                             help="Redis holding the parameters")
    kafka_bootstrap: str = setting("127.0.0.1:9092", env="STREAMTRAIN_KAFKA_BOOTSTRAP",
                                   help="Kafka bootstrap servers")
    model: str = setting("digits-mlp", env="STREAMTRAIN_MODEL",
                         help="built-in model (digits-mlp, mlp-2m, dlrm?OPTIONS) or package.module:factory")
    batch_size: int = setting(64, env="STREAMTRAIN_BATCH_SIZE", min=1, max=1 << 20,
                              help="records per training step")
    device: str = setting("auto", env="STREAMTRAIN_DEVICE",
                          help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    threads: int = setting(0, env="STREAMTRAIN_THREADS", min=0, max=1024,
                           help="CPU threads for compute (0: torch's default)")
    mixed_precision: bool = setting(True, env="STREAMTRAIN_MIXED_PRECISION",
                                    help="bf16 autocast on CUDA")
    flush_denormal: bool = setting(True, env="STREAMTRAIN_FLUSH_DENORMAL",
                                   help="flush denormal floats to zero in the trainer's CPU arithmetic (FTZ/DAZ): "
                                        "a CPU computes on them many times slower, and a digits step took 2.2 ms "
                                        "with them against 1.4 ms without")
    topk_density: float = setting(0.01, env="STREAMTRAIN_TOPK_DENSITY", min=1e-6, max=1.0,
                                  help="fraction of values a topk codec keeps")
    dense_below: int = setting(DEFAULT_DENSE_BELOW, env="STREAMTRAIN_DENSE_BELOW", min=0, max=1 << 30,
                               help="tensors with fewer values travel dense, with the codec's value codec "
                                    "(fp16 for topk+fp16), never top-k'd (0: every tensor through the codec)")
    density_warmup_steps: int = setting(0, env="STREAMTRAIN_DENSITY_WARMUP_STEPS", min=0, max=1 << 30,
                                        help="the topk density decays exponentially from 0.25 to --topk-density "
                                             "over this trainer's first N pushes (DGC's warm-up; 0: off)")
    eval_source: str = setting("", env="STREAMTRAIN_EVAL_SOURCE",
                               help="source spec of held-out data (its test split); empty: no evaluation")
    eval_every: int = setting(25, env="STREAMTRAIN_EVAL_EVERY", min=1,
                              help="evaluate every N of this trainer's steps")
    eval_limit: int = setting(2000, env="STREAMTRAIN_EVAL_LIMIT", min=1,
                              help="most held-out records to evaluate on")
    progressive_every: int = setting(2000, env="STREAMTRAIN_PROGRESSIVE_EVERY", min=0, max=1 << 30,
                                     help="binary models: score the AUC and log loss of every N records this "
                                          "trainer consumes, on the logits of the training forward pass, before "
                                          "training on them (progressive validation; 0: off)")
    row_cache_rows: int = setting(32768, env="STREAMTRAIN_ROW_CACHE_ROWS", min=0, max=1 << 28,
                                  help="rows of each embedding table kept between steps (least recently used "
                                       "out; 0: pull every row every step); bounds the trainer's memory")
    row_prefetch: int = setting(2, env="STREAMTRAIN_ROW_PREFETCH", min=0, max=64,
                                help="fetch the embedding rows of the next N decoded batches while this step "
                                     "computes, into the row cache (used only as the tables' bound allows: "
                                     "at most S batches ahead, none under BSP; at most --prefetch; 0: off)")
    row_dtype: str = setting("float16", env="STREAMTRAIN_ROW_DTYPE", choices=("float16", "float32"),
                             help="how gradient rows of embedding tables travel")
    seed: int = setting(0, env="STREAMTRAIN_SEED", help="seed of the initial weights")
    prefetch: int = setting(4, env="STREAMTRAIN_PREFETCH", min=1, max=1024,
                            help="batches decoded ahead of compute")
    overlap_pulls: bool = setting(False, env="STREAMTRAIN_OVERLAP_PULLS",
                                  help="pull for the next step while this one computes, into a second copy "
                                       "of the dense parameters (ASP, and SSP with staleness >= 1, one step "
                                       "per push); a step takes it when it is the newest within the bound. "
                                       "Off by default: on 2 shared CPU cores it gained nothing reliable")
    max_steps: int = setting(0, env="STREAMTRAIN_MAX_STEPS", min=0,
                             help="stop after this many steps (0: run until stopped)")
    max_unapplied: int = setting(4, env="STREAMTRAIN_MAX_UNAPPLIED", min=1, max=1024,
                                 help="under ASP, most of this trainer's pushed updates not yet applied "
                                      "(bounds the update log and the staleness it causes)")
    staleness_timeout_s: float = setting(60.0, env="STREAMTRAIN_STALENESS_TIMEOUT_S", min=0.1,
                                         help="longest wait for the SSP/BSP clock bound")
    outage_limit_s: float = setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                    help="longest Redis outage ridden out before the trainer exits with an error")
    metrics_port: int = setting(0, env="STREAMTRAIN_METRICS_PORT", min=0, max=65535,
                                help="serve Prometheus metrics on this port, all interfaces (0: off)")
    commit_to_kafka: bool = setting(True, env="STREAMTRAIN_COMMIT_TO_KAFKA",
                                    help="mirror committed offsets to Kafka (group streamtrain-<job>) "
                                         "so Kafka's tools show the lag")
