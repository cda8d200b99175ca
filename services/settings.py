"""Settings of the parameter plane's commands: ``streamtrain ps`` (:class:`ServerSettings`) and
``streamtrain export`` (:class:`ExportSettings`), each a frozen dataclass filled from flags and
environment (:mod:`common.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.keys import validate_job
from common.settings import setting

from .scripts import DEFAULT_FEED_ENTRIES
from .slot_types import VersionVector
from .wire import DEFAULT_MAX_BYTES

__all__ = ["ServerSettings", "ExportSettings"]


@dataclass(frozen=True)
class ServerSettings:
    """Settings of one parameter server (``streamtrain ps``)."""

    redis_url: str = setting("redis://127.0.0.1:6379/0", env="STREAMTRAIN_REDIS_URL",
                             help="Redis holding the parameters")
    job: str = setting("default", env="STREAMTRAIN_JOB", help="job whose model this server applies")
    group: int = setting(0, env="STREAMTRAIN_PS_GROUP", min=0, help="this server's shard group")
    groups: int = setting(1, env="STREAMTRAIN_PS_GROUPS", min=1, max=1024,
                          help="number of shard groups (must match the job's model)")
    block_ms: int = setting(200, env="STREAMTRAIN_PS_BLOCK_MS", min=1, max=60000,
                            help="longest wait for new updates before checking for shutdown")
    batch: int = setting(16, env="STREAMTRAIN_PS_BATCH", min=1, max=10000,
                         help="most pending updates applied per write (one read, one atomic write)")
    max_update_bytes: int = setting(DEFAULT_MAX_BYTES, env="STREAMTRAIN_PS_MAX_UPDATE_BYTES", min=1024,
                                    help="largest gradient accepted per shard")
    compact_fraction: float = setting(1.0, env="STREAMTRAIN_PS_COMPACT_FRACTION", min=0.0, max=1000.0,
                                      help="rewrite a shard in full once its deltas since its last full write "
                                           "hold this fraction of its bytes")
    compact_every: int = setting(1000, env="STREAMTRAIN_PS_COMPACT_EVERY", min=1,
                                 help="rewrite a changed shard in full once its last full write is this many "
                                      "versions of its group old")
    persist_every: int = setting(256, env="STREAMTRAIN_PS_PERSIST_EVERY", min=1,
                                 help="persist the optimizer state after this many updates (or once the "
                                      "gradients applied since hold as many bytes as the state); the log "
                                      "keeps every update until then, and a restart replays them")
    audit_horizon_s: float = setting(600.0, env="STREAMTRAIN_PS_AUDIT_HORIZON_S", min=0.0,
                                     help="keep each applied update's applied_samples entry (what the record-by-"
                                          "record audit reads) this long; older ones are trimmed and the "
                                          "partitions' audit floor raised (0: keep them forever)")
    housekeeping_s: float = setting(10.0, env="STREAMTRAIN_PS_HOUSEKEEPING_S", min=0.0, max=3600.0,
                                    help="how often a write also trims applied_samples past the audit horizon "
                                         "and drops departed members' clocks (0: every write)")
    sweep_every_s: float = setting(30.0, env="STREAMTRAIN_PS_SWEEP_EVERY_S", min=0.0, max=3600.0,
                                   help="how often the server looks for its group's orphaned gradient blobs "
                                        "(a pusher that died between writing them and pushing; 0: every round)")
    table_sweep_every_s: float = setting(1.0, env="STREAMTRAIN_PS_TABLE_SWEEP_EVERY_S", min=0.0, max=3600.0,
                                         help="how often the server takes one step of each embedding table's sweep "
                                              "(expiry and the row cap, for tables that have them; 0: every round)")
    table_sweep_count: int = setting(2000, env="STREAMTRAIN_PS_TABLE_SWEEP_COUNT", min=10, max=1_000_000,
                                     help="rows (and sighting records) one sweep step of a table looks at for expiry")
    feed_entries: int = setting(DEFAULT_FEED_ENTRIES, env="STREAMTRAIN_PS_FEED_ENTRIES", min=1, max=10_000_000,
                                help="entries the group's feed of row changes keeps (GET /v1/model/updates; "
                                     "one per apply that writes rows or shards, one per sweep step that removes "
                                     "rows; each holds 8 bytes per row it names): a consumer that falls further "
                                     "behind reloads the tables")
    sweep_grace_s: float = setting(120.0, env="STREAMTRAIN_PS_SWEEP_GRACE_S", min=1.0,
                                   help="delete an orphaned gradient blob once no logged update has named it "
                                        "for this long (longer than a push can take, backpressure waits included)")
    checkpoint_every: int = setting(0, env="STREAMTRAIN_PS_CHECKPOINT_EVERY", min=0,
                                    help="group 0 saves a checkpoint every N versions of group 0 (0: off)")
    checkpoint_dir: str = setting("checkpoints", env="STREAMTRAIN_PS_CHECKPOINT_DIR",
                                  help="directory of automatic checkpoints")
    outage_limit_s: float = setting(60.0, env="STREAMTRAIN_OUTAGE_LIMIT_S", min=0.1,
                                    help="longest Redis outage ridden out before the server exits with an error")
    metrics_port: int = setting(0, env="STREAMTRAIN_METRICS_PORT", min=0, max=65535,
                                help="serve Prometheus metrics on this port, all interfaces (0: off)")
    start_timeout_s: float = setting(300.0, env="STREAMTRAIN_PS_START_TIMEOUT_S", min=0.1,
                                     help="how long streamtrain ps waits for the job's model to exist "
                                          "before it exits with an error")
    torch_threads: int = setting(1, env="STREAMTRAIN_PS_TORCH_THREADS", min=1, max=256,
                                 help="torch intra-op threads of the ps process (1 avoids spinning "
                                      "threads on a shared machine)")
    fault: str = setting("none", env="STREAMTRAIN_PS_FAULT", hidden=True,
                         choices=("none", "kill-before-write", "kill-after-write"),
                         help="TESTING ONLY: SIGKILL this process around the write of update number fault_at")
    fault_at: int = setting(0, env="STREAMTRAIN_PS_FAULT_AT", min=0, hidden=True,
                            help="TESTING ONLY: which update (1-based, counted by this process) faults: "
                                 "the kill hits the write of the batch holding it")

    def __post_init__(self) -> None:
        if self.group >= self.groups:
            raise ValueError(f"group {self.group} must be below groups {self.groups}")


@dataclass(frozen=True)
class ExportSettings:
    """Settings of ``streamtrain export``."""

    redis_url: str = setting("redis://127.0.0.1:6379/0", env="STREAMTRAIN_REDIS_URL",
                             help="Redis holding the job's model")
    job: str = setting("default", env="STREAMTRAIN_JOB", help="job whose model to export")
    out: str = setting("", env=None, help="file to write (required; safetensors, replaced atomically)")
    version: str | None = setting(None, env=None,
                                  help="model version to export (default: the current one): an integer, or "
                                       "with several shard groups each group's version joined by '.' "
                                       "(e.g. 12.7); it must still be retained in Redis")
    tables_dir: str | None = setting(None, env=None,
                                     help="also write the embedding tables, in pieces, to this folder (safetensors "
                                          "<table>-<group>-<n>.safetensors and manifest.json; replaced atomically). "
                                          "Each row as its group last wrote it: not one version, unlike --out")
    rows_per_piece: int = setting(65536, env=None, min=1, max=2**31 - 1,
                                  help="rows of a table per piece file of --tables-dir")

    def __post_init__(self) -> None:
        validate_job(self.job)
        if not self.out:
            raise ValueError("--out FILE is required (where to write the .safetensors file)")
        if self.version is not None and not VersionVector.is_name(self.version):
            raise ValueError(f"--version must be a model version: a non-negative integer, or with several "
                             f"shard groups one per group joined by '.' (e.g. 12.7), got {self.version!r}")
