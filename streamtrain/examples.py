"""The examples ``streamtrain up --example NAME`` runs: each a data set and the settings that train it.

:data:`EXAMPLES` holds each example's :class:`~streamtrain.settings.UpSettings` values: ``digits`` (the
default: scikit-learn's digits through the built-in MLP, target accuracy 95 %) and ``movielens``
(MovieLens-100K in time order through ``dlrm?schema=movielens``, target AUC :data:`MOVIELENS_TARGET_AUC`);
a flag or variable the user gives wins (:func:`with_example`). See docs/recommendation.md, *What ``up
--example movielens`` runs*, and *What it reached* for how its settings were chosen.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from .settings import UpSettings

__all__ = ["CLICKS_RATE", "CLICKS_SOURCE", "CLICKS_TARGET_AUC", "EXAMPLES", "MOVIELENS_RATE", "MOVIELENS_TARGET_AUC",
           "with_example"]

MOVIELENS_TARGET_AUC = 0.70
"""The held-out AUC ``up --example movielens`` stops at."""

MOVIELENS_RATE = 2500.0
"""Records/s the ``movielens`` example streams at: the ratings arrive as a stream, a little under what
two trainers take on a 2-core machine, so the replica's served AUC (records scored before any trainer
trained on them) is of a model that trained on what came before, as online, not of one the producer
ran ahead of by the whole data set."""

CLICKS_SOURCE = "clicks?features=8&dense=4&vocab=100000"
"""The click stream ``up --example clicks`` draws its impressions from (docs/join.md)."""

CLICKS_TARGET_AUC = 0.75
"""The held-out AUC ``up --example clicks`` stops at."""

CLICKS_RATE = 2000.0
"""Impressions/s of event time (and about that of wall time) ``up --example clicks`` writes."""

EXAMPLES: Mapping[str, Mapping[str, Any]] = {
    "digits": {},
    "movielens": {
        "source": "movielens",
        "model": "dlrm?schema=movielens&dim=16&row_lr=0.01",
        "codec": "none",
        "optimizer": "adam",
        "lr": 0.001,
        "table_consistency": "asp",
        "table_staleness": 4,
        "target_auc": MOVIELENS_TARGET_AUC,
        "rate": MOVIELENS_RATE,
    },
    "clicks": {
        "source": CLICKS_SOURCE,
        "model": "dlrm?features=8&dense=4&dim=8",
        "join": True,
        "target_auc": CLICKS_TARGET_AUC,
        "rate": CLICKS_RATE,
        "table_consistency": "asp",
        "table_staleness": 4,
    },
}
"""Example name -> the :class:`UpSettings` fields it sets (``digits``: the defaults themselves)."""


def with_example(settings: UpSettings, given: Collection[str]) -> UpSettings:
    """``settings`` with ``settings.example``'s values in every field not in ``given`` (the fields a
    flag or a variable set)."""
    chosen = EXAMPLES[settings.example]
    return replace(settings, **{name: value for name, value in chosen.items() if name not in given})
