"""Sample weights in the trainers' loss: a record of weight k is k copies of it, a loss that cannot be
weighted refuses, a batch without weights computes what it always did; and evaluate's calibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from coordinator.assignment import JobConfig
from datastream import Batch
from services import ParameterStore
from services.consistency import Consistency
from trainers import TrainerSettings, build_model, evaluate, plan_device
from trainers.ranking import binary_logistic_loss
from trainers.step import Replica
from trainers.steps import PlainSteps, StepInputs, choose_steps
from trainers.weights import LossWeightsError, weighted_loss


def binary_factory():
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)), binary_logistic_loss


def regression_factory():
    return nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)), nn.functional.mse_loss


def smoothed_factory():
    return nn.Sequential(nn.Linear(3, 4)), nn.CrossEntropyLoss(label_smoothing=0.1)


def custom_factory():
    return nn.Linear(3, 2), lambda out, y: nn.functional.cross_entropy(out, y) * 2


def _data(spec: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if spec == "digits-mlp":
        return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
    x = torch.randn(n, 3, generator=g)
    if spec.endswith("regression_factory"):
        return x, torch.randn(n, generator=g)
    classes = 4 if spec.endswith("smoothed_factory") else 2
    return x, torch.randint(0, classes, (n,), generator=g)


SPECS = ["digits-mlp", f"{__name__}:binary_factory", f"{__name__}:regression_factory",
         f"{__name__}:smoothed_factory"]


def _repeated(x: torch.Tensor, y: torch.Tensor, w: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row k times, for a weight k."""
    times = torch.tensor(w)
    return x.repeat_interleave(times, dim=0), y.repeat_interleave(times)


@pytest.mark.parametrize("spec", SPECS)
def test_a_record_of_weight_k_gives_the_gradient_of_k_copies_of_it(spec: str) -> None:
    x, y = _data(spec, 6)
    w = [1, 3, 1, 2, 1, 5]
    weighted = Replica(build_model(spec, seed=1), plan_device("cpu")).step(x, y, w=torch.tensor(w, dtype=torch.float32))
    copies = Replica(build_model(spec, seed=1), plan_device("cpu")).step(*_repeated(x, y, w))
    assert weighted.loss == pytest.approx(copies.loss, rel=1e-5)
    assert weighted.grads.keys() == copies.grads.keys()
    for name, grad in copies.grads.items():
        torch.testing.assert_close(weighted.grads[name], grad)


@pytest.mark.parametrize("spec", SPECS)
def test_a_batch_without_weights_computes_what_it_always_did(spec: str) -> None:
    x, y = _data(spec, 8)
    built = build_model(spec, seed=1)
    got = Replica(built, plan_device("cpu")).step(x, y)
    reference = build_model(spec, seed=1)
    loss = reference.loss_fn(reference.model(x).float(), y)
    loss.backward()
    assert got.loss == float(loss.detach())
    for name, p in reference.model.named_parameters():
        assert torch.equal(got.grads[name], p.grad)  # bit for bit
    ones = Replica(build_model(spec, seed=1), plan_device("cpu")).step(x, y, w=torch.ones(8))
    for name, p in reference.model.named_parameters():  # weights of 1: the same mean, up to rounding
        torch.testing.assert_close(ones.grads[name], p.grad)


def test_a_local_step_weighs_its_records_too() -> None:
    x, y = _data("digits-mlp", 5)
    w = [4, 1, 1, 2, 1]
    replicas = [Replica(build_model("digits-mlp", seed=2), plan_device("cpu")) for _ in range(2)]
    sgd = [torch.optim.SGD(r.params.values(), lr=0.1) for r in replicas]
    replicas[0].step(x, y, inner=sgd[0], w=torch.tensor(w, dtype=torch.float32))
    replicas[1].step(*_repeated(x, y, w), inner=sgd[1])
    for name, p in replicas[1].params.items():
        torch.testing.assert_close(replicas[0].params[name], p)


def test_a_custom_loss_refuses_a_weighted_batch_and_leaves_the_replica_alone() -> None:
    spec = build_model(f"{__name__}:custom_factory", seed=0)
    replica = Replica(spec, plan_device("cpu"))
    before = {name: p.detach().clone() for name, p in replica.params.items()}
    x, y = _data(f"{__name__}:custom_factory", 4)
    sgd = torch.optim.SGD(replica.params.values(), lr=0.1)
    with pytest.raises(LossWeightsError, match=r"carries sample weights .* is not one streamtrain can weight"):
        replica.step(x, y, inner=sgd, w=torch.tensor([1.0, 10.0, 1.0, 1.0]))
    assert all(torch.equal(p, before[name]) for name, p in replica.params.items())
    assert replica.step(x, y).grads  # unweighted batches still train with it


def test_weighted_loss_refuses_what_it_cannot_weigh() -> None:
    out, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(LossWeightsError, match="class weights"):
        weighted_loss(nn.CrossEntropyLoss(weight=torch.ones(4)), out, y, torch.ones(3))
    with pytest.raises(LossWeightsError, match="reduction"):
        weighted_loss(nn.MSELoss(reduction="sum"), torch.randn(3), torch.randn(3), torch.ones(3))
    with pytest.raises(LossWeightsError, match="not one value per target"):
        weighted_loss(nn.functional.mse_loss, torch.randn(3, 2), torch.randn(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"sample weights must be \[n\] for 3 records"):
        weighted_loss(nn.functional.cross_entropy, out, y, torch.ones(2))
    # records cross entropy ignores weigh nothing: the weighted mean of the others
    labels = torch.tensor([0, -100, 2])
    got = weighted_loss(nn.functional.cross_entropy, out, labels, torch.tensor([1.0, 7.0, 3.0]))
    per = nn.functional.cross_entropy(out, labels, reduction="none")
    torch.testing.assert_close(got, (per[0] + 3 * per[2]) / 4)


def test_the_trainer_s_steps_hand_the_batch_weights_to_the_loss(redis) -> None:
    job = "weighted-steps"
    config = JobConfig(consistency="ssp", staleness=2, codec="fp16", optimizer="adam", lr=0.01, topic="t",
                       partitions=1)
    given = StepInputs(member_id="m1", clock=1, own_from=1, known=None, covers=None, base=None,
                       dense=Consistency("ssp", 2), bound=None)
    x, y = _data("digits-mlp", 4)
    w = [1, 3, 2, 1]
    weighted = Batch(x, y, {0: (0, 4)}, [("p", 0, 4)], 0, 0, w=torch.tensor(w, dtype=torch.float32))
    copies = Batch(*_repeated(x, y, w), {0: (0, 4)}, [("p", 0, 7)], 0, 0)
    grads = []
    for batch in (weighted, copies):
        replica = Replica(build_model("digits-mlp", seed=1), plan_device("cpu"))
        store = ParameterStore(redis, job)
        store.init_model(replica.initial_tensors())
        steps = choose_steps(config, redis, TrainerSettings(job=job), store, replica, rows=None, progressive=None)
        assert isinstance(steps, PlainSteps)
        try:
            [done] = steps.compute([batch], given)
        finally:
            steps.close()
        assert done.result is not None
        grads.append(done.result.grads)
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad)


def test_evaluate_reports_a_binary_model_s_calibration() -> None:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)  # the logit is x
    x = torch.tensor([[-2.0], [0.0], [1.0], [3.0]])
    y = torch.tensor([0, 0, 1, 1])
    result = evaluate(model, binary_logistic_loss, x, y, version=1, classification=True, binary=True)
    p = 1.0 / (1.0 + np.exp(-np.array([-2.0, 0.0, 1.0, 3.0])))
    assert result.mean_predicted == pytest.approx(float(p.mean()), rel=1e-9)
    assert result.observed_rate == 0.5
    multi = evaluate(nn.Linear(1, 3), nn.functional.cross_entropy, x, torch.tensor([0, 1, 2, 1]), version=1,
                     classification=True)
    regression = evaluate(nn.Linear(1, 1), nn.functional.mse_loss, x, torch.randn(4, 1), version=1,
                          classification=False)
    for other in (multi, regression):
        assert other.mean_predicted is None and other.observed_rate is None
