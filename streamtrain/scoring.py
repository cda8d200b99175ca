"""The operator's independent check: score what a job stores in Redis now.

``streamtrain up`` and the tests use it instead of what a trainer reports, so a
trainer that lies (or a parameter plane that lost an update) cannot pass.
"""

from __future__ import annotations

import torch

from datastream import load_source
from services import ParameterStore, connect
from trainers import EvalResult, build_model, evaluate


def score_job(redis_url: str, job: str, model: str, eval_source: str, *, limit: int | None = None) -> EvalResult:
    """Score the parameters a job stores in Redis now on ``eval_source``'s test split.

    It reads one consistent snapshot (``ParameterStore.pull``), loads it into
    ``model``'s module and evaluates it with :func:`trainers.evaluate`.
    """
    client = connect(redis_url)
    try:
        snapshot = ParameterStore(client, job).pull()
    finally:
        client.close()
    spec = build_model(model)
    spec.model.load_state_dict(snapshot.tensors)
    x, y = load_source(eval_source, split="test").read(limit=limit)
    target = torch.from_numpy(y).long() if spec.classification else torch.from_numpy(y).float()
    return evaluate(spec.model, spec.loss_fn, torch.from_numpy(x).float(), target,
                    version=snapshot.version, classification=spec.classification)
