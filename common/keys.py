"""Redis key names of one training job: the one place that spells them.

A job's keys live in ``1 + G`` Redis Cluster hash slots: :class:`JobKeys` (hash tag ``{job}``) for what a
push, the coordinator and the audit touch atomically, and one :class:`GroupKeys` per parameter-server
shard group (``{job:g<g>}``) for what that group writes when it applies, so under Redis Cluster the
groups' bytes land on different nodes. See docs/parameter-plane.md, *Redis data model*.
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

    def group(self, group: int) -> GroupKeys:
        """The keys of parameter-server shard group ``group``."""
        return GroupKeys(self.job, group)

    @property
    def update_log(self) -> str:
        """Stream of pushed updates (their headers: offsets, samples, the shards with a gradient and
        the token naming their blobs in each group's slot), kept until every group's persisted
        optimizer state includes them (:attr:`group_persisted`)."""
        return self.key("log")

    def applied_by(self, update_id: str) -> str:
        """Hash: group -> "" (applied) or the reason it refused update ``update_id``; written once per
        group (HSETNX: a group that redoes its accounting after a crash counts once), deleted when
        every group has reported and the update is accounted."""
        return self.key("applied_by", update_id)

    @property
    def group_accounted(self) -> str:
        """Hash: group -> the last update whose accounting the group has recorded (the job-slot half
        of its apply; see :attr:`GroupKeys.unaccounted`)."""
        return self.key("group_accounted")

    @property
    def group_persisted(self) -> str:
        """Hash: group -> the last update its persisted optimizer state includes (as it last
        reported): the log keeps every update above the lowest of them."""
        return self.key("group_persisted")

    @property
    def init_lock(self) -> str:
        """String: the writer creating the model (``SET NX PX``), so one writer's weights fill
        every group."""
        return self.key("init_lock")

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
    def unapplied(self) -> str:
        """Integer: pushed updates not yet applied by every group (the backpressure count)."""
        return self.key("unapplied")

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
        """Hash: Kafka partition -> the fence token of the member that owns it
        (:func:`common.fence.fence_token`: ``"<member id>|<generation>"``).

        The parameter plane's atomic push refuses offsets for a partition
        whose owner or generation differs from the pushing trainer's (fencing).
        """
        return self.key("assignment")

    @property
    def config(self) -> str:
        """Hash: job configuration, written by the coordinator, read by trainers and servers.

        Fields: ``consistency`` (bsp|ssp|asp), ``staleness`` (int), ``codec``,
        ``optimizer``, ``lr``, ``topic``, ``partitions``, ``ps_groups`` (int), ``paused`` (0|1),
        and, only while the embedding tables have their own, ``table_consistency`` and
        ``table_staleness`` (absent: the dense part's ``consistency`` / ``staleness``).
        """
        return self.key("config")

    @property
    def departed(self) -> str:
        """Hash: member id -> JSON ``{"reason": "expired"|"left", "generation", "at_ms"}`` of
        members that are gone, so a late heartbeat gets "gone, register anew" (ids are never reused);
        dropped by the coordinator after its ``departed_retention_s``."""
        return self.key("departed")


@dataclass(frozen=True)
class GroupKeys:
    """Key names of parameter-server shard group ``group`` of job ``job`` (hash tag ``{job:g<group>}``).

    Group g owns shards ``i`` with ``i % groups == g`` (``services.protocol.group_of``); its version,
    cursors and optimizer state are its own. Shard ``i`` at group version V is :meth:`shard` plus its
    deltas in (base, V].
    """

    job: str
    group: int

    def __post_init__(self) -> None:
        validate_job(self.job)
        if not isinstance(self.group, int) or self.group < 0:
            raise ValueError(f"invalid group {self.group!r}: a non-negative int")

    def key(self, *parts: str | int) -> str:
        """``st:{job:g<group>}:part1:part2...``."""
        return ":".join([f"st:{{{self.job}:g{self.group}}}", *map(str, parts)])

    def shard(self, index: int) -> str:
        """Full float32 bytes of shard ``index`` as of its base version (:attr:`bases`)."""
        return self.key("shard", index)

    @property
    def versions(self) -> str:
        """Hash: shard index -> the group version that last changed it."""
        return self.key("versions")

    @property
    def bases(self) -> str:
        """Hash: shard index -> the group version its full bytes (:meth:`shard`) are as of."""
        return self.key("bases")

    @property
    def delta_floors(self) -> str:
        """Hash: shard index -> every delta of the shard above this version is kept (<= its base)."""
        return self.key("delta_floors")

    def deltas(self, index: int) -> str:
        """Stream of shard ``index``'s deltas: entry id ``<group version>-0``, field ``d`` the
        coordinates that version changed and their new values (``services.deltas``)."""
        return self.key("deltas", index)

    @property
    def version(self) -> str:
        """Integer: the group's version, bumped by every atomic apply that changes its shards; a shard's
        entry in :attr:`versions` is the group version that last wrote it."""
        return self.key("version")

    def optimizer_state(self, index: int, slot: int) -> str:
        """Bytes of optimizer state ``slot`` (momentum, Adam's m and v) of shard ``index``, as of
        the group's :attr:`persisted` update."""
        return self.key("opt", index, slot)

    @property
    def optimizer_steps(self) -> str:
        """Hash: shard index -> optimizer steps (Adam, lr schedule) as of :attr:`persisted`."""
        return self.key("opt_steps")

    @property
    def cursor(self) -> str:
        """Stream id of the last update the group applied."""
        return self.key("cursor")

    @property
    def persisted(self) -> str:
        """Stream id of the last update the group's persisted optimizer state includes."""
        return self.key("persisted")

    @property
    def unaccounted(self) -> str:
        """The accounting plan (msgpack) of the group's last apply, written atomically with it (each
        apply replaces it): a server killed before the job's slot recorded it
        (:attr:`JobKeys.group_accounted`) finishes the accounting from it on restart; one already
        recorded is answered ``ALREADY`` (or ``PAST``) and counts nothing."""
        return self.key("unaccounted")

    def update_blob(self, token: str, index: int | str) -> str:
        """Encoded gradient of shard ``index`` of the pushed update ``token``: written before the push
        (a refused or abandoned one is deleted by the pusher or swept by the group's server), deleted
        once the group's persisted optimizer state includes the update. (``"*"`` for either makes a
        SCAN pattern.)"""
        return self.key("grad", token, index)

    def table_rows(self, table: str) -> str:
        """Hash: ID (8 little-endian bytes) -> the stored record of its row of embedding table
        ``table`` (``services.tables.rows.row_dtype``: version, values, when it was written,
        optimizer state), for the IDs this group owns (``services.tables.rows.group_of_ids``).
        Bounded by the table's expiry and row cap."""
        return self.key("rows", table)

    def table_seen(self, table: str) -> str:
        """Hash: ID -> how often, and when last, a gradient arrived for an ID of table ``table`` that
        has no row yet (``services.tables.rows.SEEN_DTYPE``); deleted when the ID is admitted,
        and expired like the rows."""
        return self.key("seen", table)

    @property
    def table_stats(self) -> str:
        """Hash: ``<table>:<counter>`` -> the group's counters of its tables: ``steps`` (updates
        that carried gradients for the table), ``admitted``, ``dropped`` (gradients of IDs not
        admitted yet), ``expired`` and ``evicted`` rows."""
        return self.key("table_stats")

    def rows_blob(self, token: str) -> str:
        """Gradient rows, for this group's rows, of the pushed update ``token``
        (``services.tables.grads``); deleted by the group's apply of the update (which writes its rows
        with their optimizer state), or swept with the shard blobs of an abandoned push."""
        return self.key("grad", token, "rows")

    @property
    def blobs_pattern(self) -> str:
        """SCAN pattern of every gradient blob of the group (:meth:`update_blob` and :meth:`rows_blob`
        of any token): what the group's sweeper looks at."""
        return self.key("grad", "*")

    def blob_token(self, key: bytes | str) -> str | None:
        """The push token a gradient blob key of this group names (:meth:`update_blob`,
        :meth:`rows_blob`), or None for any other key."""
        text = key.decode() if isinstance(key, bytes) else key
        prefix = self.key("grad", "")
        if not text.startswith(prefix):
            return None
        token, sep, rest = text[len(prefix):].partition(":")
        return token if sep and token and rest and ":" not in rest else None

    @property
    def table_cut(self) -> str:
        """String ``"<version> <owner> <blobs>"``: a checkpoint is saving this group's tables as of
        group version ``<version>`` (``services.snapshot.checkpoint``). While it is set, the applies and the
        sweeps copy every row record of at most that version, and every sighting record, into the
        shadows (:meth:`table_shadow`, :meth:`seen_shadow`) before they overwrite or delete it, and
        with ``<blobs>`` = 1 the row-gradient blobs they delete into :attr:`rows_blob_shadow`. Set
        (``PX``, renewed by its owner as it goes) in the MULTI/EXEC that reads the group's cut, by one
        save at a time; deleted by its owner when done, or expired when it died."""
        return self.key("table_cut")

    def table_shadow(self, table: str) -> str:
        """Hash: ID -> the record its row of table ``table`` had at the :attr:`table_cut`, for the rows
        written or removed since (HSETNX: the first old record after the cut). Bounded by the rows
        changed while a checkpoint saves; deleted with the cut (or by the next save, or a sweep, once
        the cut of a save that died has expired)."""
        return self.key("shadow", table)

    def seen_shadow(self, table: str) -> str:
        """Hash: ID -> its sighting record of table ``table`` at the :attr:`table_cut` (``""``: it had
        none), for the IDs whose sighting record was written or removed since. Bounded and deleted
        as :meth:`table_shadow`."""
        return self.key("seen_shadow", table)

    @property
    def rows_blob_shadow(self) -> str:
        """Hash: :meth:`rows_blob` key -> the blob, of the row-gradient blobs the group's applies
        deleted while the :attr:`table_cut` asked for them (the first moments of a save, until it has
        read the blobs of the updates pending at its cut). Deleted as soon as the save has read them."""
        return self.key("rows_blob_shadow")

    @property
    def feed(self) -> str:
        """Stream: the changelog of the group's rows, which a serving system follows
        (``services.tables.feed``). Entry ``<n>-0`` is the group's feed position n (1, 2, 3, ...),
        written by the same script as what it records: one per apply that bumps the group version
        (fields ``v`` the version, ``ms`` Redis's time in ms, ``d`` 1 when dense shards changed, and
        ``w:<table>`` the IDs of the rows written, 8 little-endian bytes each), one per sweep step
        that removed rows (``v`` unchanged, ``ms``, ``d`` 0, ``r:<table>`` the IDs removed). Trimmed
        by those scripts to about the servers' ``feed_entries`` newest entries (``MAXLEN ~``). Deleted
        when the group is created, and emptied when it is restored from a checkpoint (:attr:`feed_head`
        then moves past every position before the restore)."""
        return self.key("feed")

    @property
    def feed_head(self) -> str:
        """Integer: the group's last feed position (:attr:`feed`'s newest entry, or past it), INCRed by
        the script that appends an entry; a restore from a checkpoint INCRs it once more with no entry,
        so every position before the restore reads as gone. Deleted when the group is created."""
        return self.key("feed_head")

    def staging(self, token: str, slot: int) -> str:
        """A server's staged value ``slot`` of apply ``token``, renamed into place by the atomic apply
        (or deleted when it loses the compare-and-set)."""
        return self.key("stage", token, slot)
