"""What a model declares about each of its embedding tables (pure; stored in the model's meta).

:class:`TableSpec` names a table, its ``dim`` and the features that look IDs up in it, and how its rows
start, are updated (:class:`RowOptimizerConfig`) and stay bounded (admission, expiry, a row cap: the
knobs of Monolith's and PERSIA's tables). See docs/embeddings.md, *The data model*.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["RowOptimizerConfig", "TableSpec", "ROW_OPTIMIZERS", "POOLINGS", "VALUE_DTYPES", "tables_to_json",
           "tables_from_json", "validate_tables"]

ROW_OPTIMIZERS = ("lazyadam", "adagrad")
"""Row optimizers: ``lazyadam`` (PyTorch's ``SparseAdam`` at the touched rows, m and v per value)
and ``adagrad`` (row-wise Adagrad as TorchRec's ``ROWWISE_ADAGRAD``: one accumulator per row)."""

POOLINGS = ("sum", "mean")
"""How the rows of a multi-hot feature's IDs become one vector per record."""

VALUE_DTYPES = ("float32", "float16", "bfloat16")
"""How a table stores its rows' values (``services.tables.rows``: the arithmetic is float32 whatever
the table stores; ``bfloat16`` is kept as the top 16 bits of the float32, in a ``uint16``)."""

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class RowOptimizerConfig:
    """How a parameter server updates the rows a gradient touches (and nothing else)."""

    name: str = "lazyadam"
    """One of :data:`ROW_OPTIMIZERS`."""
    lr: float = 0.01
    """Learning rate."""
    beta1: float = 0.9
    """Adam first-moment decay (``lazyadam``)."""
    beta2: float = 0.999
    """Adam second-moment decay (``lazyadam``)."""
    eps: float = 1e-8
    """Denominator epsilon."""

    def __post_init__(self) -> None:
        if self.name not in ROW_OPTIMIZERS:
            raise ValueError(f"row optimizer must be one of {', '.join(ROW_OPTIMIZERS)}, got {self.name!r}")
        for name in ("lr", "eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"row optimizer {name} must be a finite number >= 0, got {value!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"row optimizer {name} must be in [0, 1), got {value!r}")

    def slots(self, dim: int) -> int:
        """float32 values of optimizer state per row: m and v per value for ``lazyadam``, one
        accumulator for ``adagrad``."""
        return 2 * dim if self.name == "lazyadam" else 1


@dataclass(frozen=True)
class TableSpec:
    """One embedding table of a model."""

    name: str
    """Table name (letters, digits, ``_.-``; at most 64)."""
    dim: int
    """Values per row."""
    features: tuple[str, ...] = ()
    """The record features (``ids`` keys) looked up in this table; empty means the one feature
    named like the table. Several features may share a table (the same ID, the same row)."""
    pooling: str = "sum"
    """``sum`` or ``mean`` of a record's rows for one feature (a record with no ID for a feature
    pools to zeros)."""
    init_scale: float = 0.05
    """A row starts uniform in ``[-init_scale, init_scale)``, drawn from its ID alone
    (:func:`services.tables.rows.initial_rows`), so every trainer and server agrees on a row
    nobody has written yet."""
    optimizer: RowOptimizerConfig = field(default_factory=RowOptimizerConfig)
    """The row optimizer."""
    admit_after: int = 1
    """An ID gets a row once gradients for it have arrived in this many updates (Monolith's
    occurrence threshold); before, it reads as its initial value and its gradients are dropped
    (and counted). 1 admits at once."""
    expire_after_s: float = 0.0
    """Remove a row not written for this long (0: never)."""
    max_rows: int = 0
    """Most rows the table keeps; beyond it the least recently written are evicted (0: no cap)."""
    value_dtype: str = "float32"
    """How the rows' values are stored, one of :data:`VALUE_DTYPES` (the optimizer state's type
    follows: :attr:`state_dtype`). Servers and trainers compute in float32, decoding on read and
    rounding to nearest even on write."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"invalid table name {self.name!r}: 1-64 letters, digits, '_', '.', '-'")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or not 1 <= self.dim <= 4096:
            raise ValueError(f"table {self.name}: dim must be an int in 1..4096, got {self.dim!r}")
        features = tuple(self.features) or (self.name,)
        for f in features:
            if not isinstance(f, str) or not _NAME.match(f):
                raise ValueError(f"table {self.name}: invalid feature name {f!r}")
        if len(set(features)) != len(features):
            raise ValueError(f"table {self.name}: a feature is named twice in {list(features)}")
        object.__setattr__(self, "features", features)
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name}: pooling must be one of {', '.join(POOLINGS)}, "
                             f"got {self.pooling!r}")
        if not isinstance(self.init_scale, (int, float)) or not math.isfinite(self.init_scale) \
                or self.init_scale < 0:
            raise ValueError(f"table {self.name}: init_scale must be a finite number >= 0, got {self.init_scale!r}")
        if isinstance(self.optimizer, dict):
            object.__setattr__(self, "optimizer", RowOptimizerConfig(**self.optimizer))
        if not isinstance(self.admit_after, int) or isinstance(self.admit_after, bool) or self.admit_after < 1:
            raise ValueError(f"table {self.name}: admit_after must be an int >= 1, got {self.admit_after!r}")
        if not isinstance(self.expire_after_s, (int, float)) or not math.isfinite(self.expire_after_s) \
                or self.expire_after_s < 0:
            raise ValueError(f"table {self.name}: expire_after_s must be a finite number >= 0, "
                             f"got {self.expire_after_s!r}")
        if not isinstance(self.max_rows, int) or isinstance(self.max_rows, bool) or self.max_rows < 0:
            raise ValueError(f"table {self.name}: max_rows must be an int >= 0, got {self.max_rows!r}")
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"table {self.name}: value_dtype must be one of {', '.join(VALUE_DTYPES)}, "
                             f"got {self.value_dtype!r}")

    @property
    def slots(self) -> int:
        """Values of optimizer state per row (each of :attr:`state_dtype`)."""
        return self.optimizer.slots(self.dim)

    @property
    def state_dtype(self) -> str:
        """How the optimizer state is stored: ``float32`` in a ``float32`` table and for ``adagrad``'s
        one accumulator (a sum of squared gradients that bfloat16 would stop growing after a few hundred
        steps, and 2 bytes a row at most); ``bfloat16`` for lazy Adam's m and v in a ``float16`` or
        ``bfloat16`` table: 2 bytes a value, as the values, and float32's exponent range, which v
        (about g**2: 1e-8 for gradients of 1e-4) needs and float16 lacks (below 6e-8 it is zero).
        See docs/embeddings.md, *Where a row lives*."""
        if self.value_dtype == "float32" or self.optimizer.name == "adagrad":
            return "float32"
        return "bfloat16"

    def to_dict(self) -> dict:
        """JSON-ready form (what the model's meta stores; ``value_dtype`` only when not ``float32``, so a
        float32 table's meta is as it was before tables had the field)."""
        d = asdict(self)
        d["features"] = list(self.features)
        if self.value_dtype == "float32":
            del d["value_dtype"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TableSpec:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown field or a bad value, named.
        """
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"table spec: unknown field(s) {unknown}")
        d = dict(d)
        d["features"] = tuple(d.get("features", ()))
        if isinstance(d.get("optimizer"), dict):
            d["optimizer"] = RowOptimizerConfig(**d["optimizer"])
        return cls(**d)


def validate_tables(tables: Sequence[TableSpec]) -> tuple[TableSpec, ...]:
    """``tables`` as a tuple, checked as a whole.

    Raises:
        ValueError: two tables with one name, or one feature looked up in two tables.
    """
    seen: dict[str, str] = {}
    names: set[str] = set()
    for t in tables:
        if not isinstance(t, TableSpec):
            raise ValueError(f"expected TableSpec, got {type(t).__name__}")
        if t.name in names:
            raise ValueError(f"table {t.name!r} is declared twice")
        names.add(t.name)
        for f in t.features:
            if f in seen:
                raise ValueError(f"feature {f!r} is looked up in two tables: {seen[f]!r} and {t.name!r}")
            seen[f] = t.name
    return tuple(tables)


def tables_to_json(tables: Sequence[TableSpec]) -> list[dict]:
    """JSON-ready list of the tables (in declaration order)."""
    return [t.to_dict() for t in tables]


def tables_from_json(raw: list[dict] | str | bytes) -> tuple[TableSpec, ...]:
    """Inverse of :func:`tables_to_json` (also takes the JSON text)."""
    entries: list[dict] = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    return validate_tables([TableSpec.from_dict(d) for d in entries])
