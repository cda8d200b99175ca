"""The built-in ranking model: a DLRM (Naumov et al., 2019) whose embedding tables live in the
parameter plane.

:class:`Dlrm` holds only the dense part (the bottom and top MLPs); its tables are declared
(:attr:`Dlrm.tables`) and their rows reach :meth:`Dlrm.forward` already pooled, so no trainer ever holds
a table. :func:`dlrm_from_options` builds it from a ``dlrm?...`` spec, for the ``clicks`` or the
``movielens`` features (``schema``). See docs/embeddings.md, *The data model* (its options).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from common.options import SpecOptions
from datastream.movielens import MULTI as MOVIELENS_MULTI
from datastream.movielens import SINGLE as MOVIELENS_SINGLE
from services.tables import VALUE_DTYPES, RowOptimizerConfig, TableSpec

__all__ = ["SCHEMAS", "Dlrm", "dlrm_from_options", "binary_logistic_loss"]

SCHEMAS = ("clicks", "movielens")
"""Feature sets the ``schema`` option names."""


def binary_logistic_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean logistic loss of one logit per record (``[n]`` or ``[n, 1]``) against 0/1 labels."""
    return nn.functional.binary_cross_entropy_with_logits(output.reshape(-1), target.reshape(-1).float())


def _mlp(sizes: list[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(n_in, n_out))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Dlrm(nn.Module):
    """DLRM's dense part; its embedding tables are :attr:`tables` (rows in the parameter plane)."""

    def __init__(self, tables: tuple[TableSpec, ...], *, dense: int, dim: int, bottom: list[int],
                 top: list[int]) -> None:
        super().__init__()
        self.tables = tables
        """The embedding tables (one per feature, named like it)."""
        self.features = [f for t in tables for f in t.features]
        self.dense = dense
        self.bottom = _mlp([dense, *bottom, dim], last_relu=True) if dense else None
        vectors = len(self.features) + (1 if dense else 0)
        pairs = vectors * (vectors - 1) // 2
        self.top = _mlp([pairs + (dim if dense else 0), *top, 1], last_relu=False)
        self._rows, self._cols = torch.triu_indices(vectors, vectors, offset=1)

    def forward(self, x: torch.Tensor, pooled: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One logit per record from the dense features ``x [n, dense]`` and each feature's pooled
        rows ``pooled[feature] [n, dim]``."""
        vectors = [pooled[f] for f in self.features]
        head = []
        if self.bottom is not None:
            z = self.bottom(x)
            vectors.insert(0, z)
            head.append(z)
        stacked = torch.stack(vectors, dim=1)  # [n, vectors, dim]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # [n, vectors, vectors]
        interactions = dots[:, self._rows.to(dots.device), self._cols.to(dots.device)]
        return self.top(torch.cat([*head, interactions], dim=1)).reshape(-1)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split("-") if v]
    except ValueError:
        raise ValueError(f"dlrm option {what}: widths separated by '-', got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"dlrm option {what}: widths must be >= 1, got {text!r}")
    return values


def dlrm_from_options(options: Mapping[str, str]) -> Dlrm:
    """The DLRM a ``dlrm?...`` spec's options describe (docs/embeddings.md, *The data model*).

    Raises:
        ValueError: an unknown option or a bad value, named.
    """
    opts = SpecOptions(options, what="dlrm")
    schema = opts.text("schema", "clicks")
    fixed = [key for key in ("features", "tags", "dense") if opts.given(key)] if schema != "clicks" else []
    features, tags, dense = opts.integer("features", 26), opts.integer("tags", 0), opts.integer("dense", 13)
    dim = opts.integer("dim", 16, lo=1)
    row_opt_name, row_lr = opts.text("row_optimizer", "lazyadam"), opts.number("row_lr", 0.01, lo=0)
    admit, expire = opts.integer("admit", 1, lo=1), opts.number("expire_s", 0.0, lo=0)
    cap, scale = opts.integer("max_rows", 0), opts.number("init_scale", 0.05, lo=0)
    value_dtype = opts.text("value_dtype", "float32")
    bottom, top = _ints(opts.text("bottom", "64"), "bottom"), _ints(opts.text("top", "64-32"), "top")
    opts.refuse_unread()
    if schema not in SCHEMAS:
        raise ValueError(f"dlrm option schema: one of {', '.join(SCHEMAS)}, got {schema!r}")
    if fixed:
        raise ValueError(f"dlrm: schema={schema} fixes the features; drop {', '.join(fixed)}")
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"dlrm option value_dtype: one of {', '.join(VALUE_DTYPES)}, got {value_dtype!r}")
    row_opt = RowOptimizerConfig(row_opt_name, lr=row_lr)

    def table(name: str, pooling: str = "sum") -> TableSpec:
        return TableSpec(name, dim, pooling=pooling, init_scale=scale, optimizer=row_opt, admit_after=admit,
                         expire_after_s=expire, max_rows=cap, value_dtype=value_dtype)

    if schema == "movielens":
        tables = [table(name) for name in MOVIELENS_SINGLE] + [table(MOVIELENS_MULTI, pooling="mean")]
        dense = 0
    else:
        tables = [table(f"c{i}") for i in range(1, features + 1)]
        if tags:
            tables.append(table("tags", pooling="mean"))
    if not tables:
        raise ValueError("dlrm: needs at least one categorical feature (features >= 1 or tags=1)")
    return Dlrm(tuple(tables), dense=dense, dim=dim, bottom=bottom, top=top)
