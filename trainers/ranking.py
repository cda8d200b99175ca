"""The built-in ranking model: a DLRM (Naumov et al., 2019) whose embedding tables live in the
parameter plane.

Per record: the dense features go through a bottom MLP to a vector of the
embedding dimension; each categorical feature's IDs are looked up in its own
table and pooled to one vector; the pairwise dot products of all these vectors
(the feature interactions), beside the bottom MLP's output, go through a top
MLP to one logit, trained with the logistic loss on 0/1 labels.

The model itself holds only the dense part (the MLPs): the tables are declared
(:attr:`Dlrm.tables`) and their rows reach :meth:`Dlrm.forward` already pooled,
one ``[n, dim]`` tensor per feature, so no trainer ever holds a table
(``trainers.tables``).

Spec: ``dlrm?features=26&dense=13&dim=16``; options (all optional):

==================  ======================================================  ==========
``schema``          whose features: ``clicks`` (``c1`` .. ``cN``, ``tags``)  clicks
                    or ``movielens`` (see below)
``features``        single-valued categorical features ``c1`` .. ``cN``      26
``tags``            1: also the multi-hot feature ``tags`` (mean-pooled)     0
``dense``           dense features (0: none, no bottom MLP)                 13
``dim``             embedding dimension                                     16
``bottom``          hidden widths of the bottom MLP, ``-`` separated        64
``top``             hidden widths of the top MLP                            64-32
``row_optimizer``   ``lazyadam`` or ``adagrad``                             lazyadam
``row_lr``          the row optimizer's learning rate                       0.01
``admit``           admit an ID after this many updates carried it          1
``expire_s``        remove a row not written for this long (0: never)       0
``max_rows``        rows per table before the least recently written go     0 (no cap)
``init_scale``      rows start uniform in [-s, s)                           0.05
==================  ======================================================  ==========

With the default ``schema=clicks`` the feature names match the ``clicks`` source
(``datastream.clicks``). ``schema=movielens`` declares the features of the ``movielens`` source
instead (:mod:`datastream.movielens`): one table for each of ``user``, ``item``, ``age``,
``gender``, ``occupation``, ``zip``, ``year`` and a mean-pooled one for the multi-hot
``genres``, and no dense features — so ``dlrm?schema=movielens`` is the whole spec of a ranking
model for it (``features``, ``tags`` and ``dense`` are refused with it: the schema fixes them; the
other options apply). It is the one way to fit the model to a data set's features: a schema names
them, as the source names them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from common.options import SpecOptions
from datastream.movielens import MULTI as MOVIELENS_MULTI
from datastream.movielens import SINGLE as MOVIELENS_SINGLE
from services.tables import RowOptimizerConfig, TableSpec

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
    """The DLRM a ``dlrm?...`` spec's options describe (see the module docstring).

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
    bottom, top = _ints(opts.text("bottom", "64"), "bottom"), _ints(opts.text("top", "64-32"), "top")
    opts.refuse_unread()
    if schema not in SCHEMAS:
        raise ValueError(f"dlrm option schema: one of {', '.join(SCHEMAS)}, got {schema!r}")
    if fixed:
        raise ValueError(f"dlrm: schema={schema} fixes the features; drop {', '.join(fixed)}")
    row_opt = RowOptimizerConfig(row_opt_name, lr=row_lr)

    def table(name: str, pooling: str = "sum") -> TableSpec:
        return TableSpec(name, dim, pooling=pooling, init_scale=scale, optimizer=row_opt, admit_after=admit,
                         expire_after_s=expire, max_rows=cap)

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
