"""The operator's independent check: score what a job stores in Redis now.

``streamtrain up`` and the tests use it instead of what a trainer reports, so a
trainer that lies (or a parameter plane that lost an update) cannot pass.
"""

from __future__ import annotations

import numpy as np
import torch

from datastream import load_source
from services import ParameterStore, connect
from services.tables.store import pull_rows
from trainers import EvalResult, build_model, evaluate
from trainers.tables import table_inputs


def score_job(redis_url: str, job: str, model: str, eval_source: str, *, limit: int | None = None) -> EvalResult:
    """Score the parameters a job stores in Redis now on ``eval_source``'s test split.

    It reads one consistent snapshot (``ParameterStore.pull``), loads it into
    ``model``'s module and evaluates it with :func:`trainers.evaluate`; a model with
    embedding tables also reads the rows of the held-out records' IDs (each row as its
    group last wrote it). A binary model's result reports its calibration too
    (:attr:`~trainers.EvalResult.mean_predicted` against :attr:`~trainers.EvalResult.observed_rate`).
    """
    spec = build_model(model)
    held_out = load_source(eval_source, split="test").read(limit=limit)
    target = torch.from_numpy(held_out.y).long() if spec.classification else torch.from_numpy(held_out.y).float()
    client = connect(redis_url)
    try:
        store = ParameterStore(client, job)
        snapshot = store.pull()
        spec.model.load_state_dict(snapshot.tensors)
        inputs = None
        if spec.tables:  # the held-out records' rows, read as they are now, group by group
            tables, groups = {t.name: t for t in spec.tables}, store.meta().groups

            def pull(wanted: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                got = pull_rows(client, job, tables, groups, wanted)
                return {name: rows.values for name, rows in got.tables.items()}

            inputs = table_inputs(tables, held_out.ids, pull, torch.device("cpu"))
        return evaluate(spec.model, spec.loss_fn, torch.from_numpy(held_out.x).float(), target,
                        version=snapshot.version, classification=spec.classification, binary=spec.binary,
                        inputs=inputs)
    finally:
        client.close()
