"""What the coordinator tells a trainer: its assignment, its registration, and the job's configuration.

Plain frozen dataclasses with their JSON and Redis-hash forms, and no I/O: the HTTP client
(:mod:`coordinator.client`) and the Redis store (:mod:`coordinator.state`) read and write them,
and the trainer's pure core (``trainers.state``) reasons about them without importing either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from services.local_steps import check_local_steps

from .settings import CONSISTENCY_MODELS

__all__ = ["FOLLOW_DENSE", "LOCAL_STEPS", "Assignment", "JobConfig", "Registration"]

FOLLOW_DENSE = ("table_consistency", "table_staleness")
"""Job config fields whose absence is itself a setting: None (not in the hash, not in the JSON) means
"the same as the dense part". A restarted coordinator therefore does not fill them in; they are
written when the job begins, and afterwards only ``PATCH /v1/admin/config`` changes them."""

LOCAL_STEPS = ("local_steps", "outer_lr", "outer_momentum")
"""Job config fields of local steps (fixed once the job begins; a job begun before they existed
reads their defaults: one step per push, no outer optimizer)."""


@dataclass(frozen=True)
class JobConfig:
    """The job configuration stored in ``JobKeys.config`` (read by trainers and servers)."""

    consistency: str
    """bsp | ssp | asp."""
    staleness: int
    """SSP bound s (0 under BSP)."""
    codec: str
    """Gradient codec name, e.g. ``topk+fp16``."""
    optimizer: str
    """Optimizer: sgd | adam | lazyadam | dgc (``services.optim``)."""
    lr: float
    """Learning rate."""
    topic: str
    """Training topic."""
    partitions: int
    """Number of partitions of the topic."""
    ps_groups: int = 1
    """Parameter-server shard groups (shard i belongs to group ``i % ps_groups``); read by
    ``services.ParameterStore.init_model`` when it creates the model, fixed after (absent in a
    job begun before the field existed: 1, the layout such a job got)."""
    table_consistency: str | None = None
    """Consistency model of the embedding tables' rows (bsp | ssp | asp), PERSIA's hybrid: e.g. tables
    asynchronous while the dense part runs SSP. None: the dense part's (``consistency``), as a job
    begun before the field existed reads."""
    table_staleness: int | None = None
    """Staleness bound of the tables' rows (0 under BSP). None: the dense part's (``staleness``)."""
    local_steps: int = 1
    """Local steps H (DiLoCo): each trainer takes H steps of its inner optimizer on its own replica
    between a pull and a push, and pushes the difference of its parameters since the pull, applied
    by the servers' outer Nesterov optimizer. 1 (and a job begun before the field existed): every
    step pushes its gradient, and the servers apply ``optimizer``."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov optimizer (``local_steps`` > 1)."""
    outer_momentum: float = 0.9
    """Momentum of the outer Nesterov optimizer (``local_steps`` > 1)."""
    paused: bool = False
    """Trainers stop consuming while set."""

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCY_MODELS:
            raise ValueError(f"consistency must be one of {', '.join(CONSISTENCY_MODELS)}, "
                             f"got {self.consistency!r}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness!r}")
        if not self.lr >= 0:
            raise ValueError(f"lr must be >= 0, got {self.lr!r}")
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions!r}")
        if self.ps_groups < 1:
            raise ValueError(f"ps_groups must be >= 1, got {self.ps_groups!r}")
        if self.table_consistency is not None and self.table_consistency not in CONSISTENCY_MODELS:
            raise ValueError(f"table_consistency must be one of {', '.join(CONSISTENCY_MODELS)} (or unset: "
                             f"the dense part's), got {self.table_consistency!r}")
        if self.table_staleness is not None and self.table_staleness < 0:
            raise ValueError(f"table_staleness must be >= 0 (or unset: the dense part's), "
                             f"got {self.table_staleness!r}")
        check_local_steps(self.local_steps, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                          optimizer=self.optimizer, codec=self.codec)

    def table_bound(self) -> tuple[str, int]:
        """The embedding tables' (consistency model, staleness bound): each of the two the table
        field where set, else the dense part's; the bound is 0 under BSP. (Under ASP the bound is
        returned as set; what the tables make of it is ``docs/embeddings.md``'s.)"""
        mode = self.consistency if self.table_consistency is None else self.table_consistency
        staleness = self.staleness if self.table_staleness is None else self.table_staleness
        return mode, 0 if mode == "bsp" else staleness

    def to_hash(self) -> dict[str, str]:
        """Field -> string, as stored in Redis (``paused`` as 0|1; a field of :data:`FOLLOW_DENSE`
        that is None left out)."""
        out = {k: str(v) for k, v in self.as_json().items()}
        out["paused"] = "1" if self.paused else "0"
        return out

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str]) -> JobConfig:
        """Parse a ``JobKeys.config`` hash.

        Raises:
            ValueError: a field is missing or malformed (the message names it).
        """
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        kinds = {"staleness": int, "partitions": int, "ps_groups": int, "lr": float, "table_staleness": int,
                 "local_steps": int, "outer_lr": float, "outer_momentum": float}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                if f.name in ("paused", "ps_groups", *LOCAL_STEPS, *FOLLOW_DENSE):  # optional: their defaults apply
                    continue
                raise ValueError(f"job config lacks field {f.name!r}")
            text = d[f.name]
            try:
                values[f.name] = (text == "1") if f.name == "paused" else kinds.get(f.name, str)(text)
            except ValueError:
                raise ValueError(f"job config field {f.name!r} is malformed: {text!r}") from None
        return cls(**values)

    def as_json(self) -> dict[str, Any]:
        """The JSON form sent to trainers: every field, but a field of :data:`FOLLOW_DENSE` only
        when set (so a trainer older than those fields parses the config of a job that does not
        use them)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in FOLLOW_DENSE}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobConfig:
        """Parse :meth:`as_json`'s form. Fields this class does not know (those of a newer
        coordinator) are ignored, so an older trainer keeps working; the ones it knows are
        validated as always.

        Raises:
            TypeError: a required field is missing.
            ValueError: a value is out of bounds (the message names the field).
        """
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class Assignment:
    """The coordinator's answer to a heartbeat (and part of a registration)."""

    member_id: str
    """This trainer's id."""
    generation: int
    """Membership generation: the fencing token every push carries."""
    partitions: tuple[int, ...]
    """Partitions this trainer owns now (sorted)."""
    state: str
    """``active`` (train), ``draining`` (commit and leave) or ``paused`` (stop consuming)."""
    config: JobConfig
    """The job configuration now."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Assignment:
        """Parse a register or heartbeat reply."""
        return cls(member_id=d["member_id"], generation=int(d["generation"]),
                   partitions=tuple(int(p) for p in d["partitions"]), state=d["state"],
                   config=JobConfig.from_json(d["config"]))


@dataclass(frozen=True)
class Registration:
    """The coordinator's answer to a registration."""

    assignment: Assignment
    """Id, generation, partitions, state and config at registration."""
    lease_ms: int
    """The lease; heartbeat well within it."""
    heartbeat_interval_ms: int
    """How often to heartbeat."""

    @property
    def member_id(self) -> str:
        """This trainer's id."""
        return self.assignment.member_id

    @property
    def generation(self) -> int:
        """Generation at registration."""
        return self.assignment.generation

    @property
    def partitions(self) -> tuple[int, ...]:
        """Partitions owned at registration."""
        return self.assignment.partitions
