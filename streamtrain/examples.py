"""The examples ``streamtrain up --example NAME`` runs: each a data set and the settings that train it.

An example is a set of :class:`~streamtrain.settings.UpSettings` values; a flag or a variable the
user gives wins over the example's (:func:`with_example`), so ``--example movielens --trainers 1``
is the MovieLens job on one trainer. The flag is ``--example``, not ``--job``: every other command
reads ``--job`` / ``STREAMTRAIN_JOB`` as the job's *name* (its Redis keys and Kafka group), and an
example also names the job it runs (its job and topic are the example's name).

=============  ====================================================================================
``digits``     (the default) scikit-learn's digits, 60 passes, the built-in MLP; target accuracy 95 %
``movielens``  MovieLens-100K (:mod:`datastream.movielens`): the first 90 % of the ratings by time,
               once, through the ranking model with embedding tables (``dlrm?schema=movielens``);
               held out the last 10 % by time; target AUC :data:`MOVIELENS_TARGET_AUC`
=============  ====================================================================================

The MovieLens settings were chosen by measuring (``docs/recommendation.md``): a plain local PyTorch
loop of the same model, one pass in time order (``bench/recommendation.py``), reaches a held-out AUC of
0.728-0.731, the pipeline's whole pass 0.721-0.735; on two cores it reaches the target after 30-60 s
of training.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from .settings import UpSettings

__all__ = ["EXAMPLES", "MOVIELENS_TARGET_AUC", "with_example"]

MOVIELENS_TARGET_AUC = 0.70
"""The held-out AUC ``up --example movielens`` stops at."""

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
    },
}
"""Example name -> the :class:`UpSettings` fields it sets (``digits``: the defaults themselves)."""


def with_example(settings: UpSettings, given: Collection[str]) -> UpSettings:
    """``settings`` with ``settings.example``'s values in every field not in ``given`` (the fields a
    flag or a variable set)."""
    chosen = EXAMPLES[settings.example]
    return replace(settings, **{name: value for name, value in chosen.items() if name not in given})
