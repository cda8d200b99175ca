"""What the coordinator tells a trainer: its assignment, its registration, and the job's configuration.

Plain frozen dataclasses with their JSON and Redis-hash forms, and no I/O: the HTTP client
(:mod:`coordinator.client`) and the Redis store (:mod:`coordinator.state`) read and write them,
and the trainer's pure core (``trainers.state``) reasons about them without importing either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from .settings import CONSISTENCY_MODELS

__all__ = ["Assignment", "JobConfig", "Registration"]


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

    def to_hash(self) -> dict[str, str]:
        """Field -> string, as stored in Redis (``paused`` as 0|1)."""
        out = {k: str(v) for k, v in asdict(self).items()}
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
        kinds = {"staleness": int, "partitions": int, "ps_groups": int, "lr": float}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                if f.name in ("paused", "ps_groups"):  # optional: their defaults apply
                    continue
                raise ValueError(f"job config lacks field {f.name!r}")
            text = d[f.name]
            try:
                values[f.name] = (text == "1") if f.name == "paused" else kinds.get(f.name, str)(text)
            except ValueError:
                raise ValueError(f"job config field {f.name!r} is malformed: {text!r}") from None
        return cls(**values)

    def as_json(self) -> dict[str, Any]:
        """The JSON form sent to trainers."""
        return asdict(self)


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
                   config=JobConfig(**d["config"]))


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
