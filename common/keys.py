"""Redis key names of one training job: the one place that spells them.

Every key of a job carries the job name in a hash tag (``{job}``), so a job's
keys share one Redis Cluster slot and Lua scripts may touch several of them.
The coordinator writes the membership keys; the parameter plane reads them to
fence stale trainers; both go through this class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_job(job: str) -> str:
    """Return ``job`` if it is a valid job name, else raise ValueError naming it."""
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ValueError(f"invalid job name {job!r}: use 1-64 letters, digits, '_', '.', '-' "
                         "starting with a letter or digit")
    return job


@dataclass(frozen=True)
class JobKeys:
    """Key names for job ``job``. Hash fields are documented per key."""

    job: str

    def __post_init__(self) -> None:
        validate_job(self.job)

    def key(self, *parts: str | int) -> str:
        """``st:{job}:part1:part2...`` for keys not named below."""
        return ":".join([f"st:{{{self.job}}}", *map(str, parts)])

    # -- parameter plane ---------------------------------------------------
    @property
    def meta(self) -> str:
        """Model metadata: names, shapes, dtypes, shard layout, optimizer."""
        return self.key("meta")

    def shard(self, index: int) -> str:
        """Full float32 bytes of parameter shard ``index`` as of its base version (:attr:`bases`)."""
        return self.key("shard", index)

    @property
    def versions(self) -> str:
        """Hash: shard index -> the model version that last changed it."""
        return self.key("versions")

    @property
    def bases(self) -> str:
        """Hash: shard index -> the model version its full bytes (:meth:`shard`) are as of."""
        return self.key("bases")

    @property
    def delta_floors(self) -> str:
        """Hash: shard index -> every delta of the shard above this version is kept (<= its base)."""
        return self.key("delta_floors")

    def deltas(self, index: int) -> str:
        """Stream of shard ``index``'s deltas: entry id ``<model version>-0``, field ``d`` the
        coordinates that version changed and their new values (``services.deltas``)."""
        return self.key("deltas", index)

    @property
    def update_log(self) -> str:
        """Stream of pushed updates (compressed gradients with their offsets), kept until every
        group's persisted optimizer state includes them."""
        return self.key("log")

    @property
    def offsets(self) -> str:
        """Hash: Kafka partition -> next offset to consume (committed with the gradient)."""
        return self.key("offsets")

    @property
    def clocks(self) -> str:
        """Hash: member id -> clock of its last pushed update (SSP/BSP); a departed member's
        field is removed once all its updates are applied (as are its :attr:`applied_clocks` and
        :attr:`staleness` fields)."""
        return self.key("clocks")

    @property
    def applied_clocks(self) -> str:
        """Hash: member id -> highest clock of its updates already applied to the parameters."""
        return self.key("applied_clocks")

    @property
    def applied_samples(self) -> str:
        """Stream: one entry per applied update naming the samples it covered
        (producer id, first sequence number, count) and its offset ranges, so the
        accounting can be checked record by record; entries older than the servers' audit
        horizon are trimmed (:attr:`audit_floor`)."""
        return self.key("applied_samples")

    @property
    def audit_floor(self) -> str:
        """Hash: Kafka partition -> offset below which records are no longer accounted one by one
        (their :attr:`applied_samples` entries were trimmed past the servers' audit horizon)."""
        return self.key("audit_floor")

    @property
    def model_version(self) -> str:
        """Integer global model version, bumped by every atomic apply that changes a shard;
        a shard's entry in :attr:`versions` is the model version that last wrote it."""
        return self.key("model_version")

    def optimizer_state(self, index: int, slot: int) -> str:
        """Bytes of optimizer state ``slot`` (momentum, Adam's m and v) of shard ``index``, as of
        its group's :meth:`ps_persisted` update."""
        return self.key("opt", index, slot)

    @property
    def optimizer_steps(self) -> str:
        """Hash: shard index -> optimizer steps (Adam, lr schedule) as of its group's :meth:`ps_persisted`."""
        return self.key("opt_steps")

    def ps_cursor(self, group: int) -> str:
        """Stream id of the last update applied by parameter-server shard group ``group``."""
        return self.key("ps_cursor", group)

    def ps_persisted(self, group: int) -> str:
        """Stream id of the last update that group ``group``'s persisted optimizer state
        (:meth:`optimizer_state`, :attr:`optimizer_steps`) includes."""
        return self.key("ps_persisted", group)

    @property
    def unapplied(self) -> str:
        """Integer: pushed updates not yet applied by every group (the backpressure count)."""
        return self.key("unapplied")

    def update_blob(self, token: str, index: int) -> str:
        """Encoded gradient of shard ``index`` of the pushed update ``token`` (deleted with its log
        entry, once every group's persisted optimizer state includes the update)."""
        return self.key("grad", token, index)

    def staging(self, token: str, slot: int) -> str:
        """A parameter server's staged value ``slot`` of apply ``token``, renamed into place
        by the atomic apply (or deleted when it loses the compare-and-set)."""
        return self.key("stage", token, slot)

    @property
    def apply_progress(self) -> str:
        """Hash: update id -> number of shard groups that applied it (until all have)."""
        return self.key("apply_progress")

    @property
    def staleness(self) -> str:
        """Hash: member id -> staleness (clocks) it observed at its last SSP wait."""
        return self.key("staleness")

    # -- control plane -----------------------------------------------------
    @property
    def generation(self) -> str:
        """Integer membership generation, bumped on every membership change."""
        return self.key("generation")

    @property
    def members(self) -> str:
        """Hash: member id -> JSON of its registration and last heartbeat."""
        return self.key("members")

    @property
    def assignment(self) -> str:
        """Hash: Kafka partition -> ``"<member id>|<generation>"`` that owns it.

        The parameter plane's atomic push refuses offsets for a partition
        whose owner or generation differs from the pushing trainer's (fencing).
        """
        return self.key("assignment")

    @property
    def config(self) -> str:
        """Hash: job configuration, written by the coordinator, read by trainers and servers.

        Fields: ``consistency`` (bsp|ssp|asp), ``staleness`` (int), ``codec``,
        ``optimizer``, ``lr``, ``topic``, ``partitions``, ``paused`` (0|1).
        """
        return self.key("config")

    @property
    def departed(self) -> str:
        """Hash: member id -> JSON ``{"reason": "expired"|"left", "generation", "at_ms"}`` of
        members that are gone, so a late heartbeat gets "gone, register anew" (ids are never reused);
        dropped by the coordinator after its ``departed_retention_s``."""
        return self.key("departed")
