"""Local steps (DiLoCo): the inner/outer arithmetic, the window's push, and the job settings that
refuse what cannot run (pure: no servers; the end-to-end runs are in ``tests/test_streamtrain_local_steps_e2e.py``)."""

from __future__ import annotations

import pytest
import torch

from coordinator.assignment import JobConfig
from datastream import Batch
from services.codecs import Sent
from services.optim import OptimizerConfig, slots, step
from trainers.device import plan_device
from trainers.local import LocalSteps, check_model, inner_optimizer, server_optimizer, window_batch
from trainers.models import build_model
from trainers.step import Replica


def _config(**changes: object) -> JobConfig:
    base: dict[str, object] = {"consistency": "ssp", "staleness": 2, "codec": "fp16", "optimizer": "adam",
                               "lr": 0.01, "topic": "t", "partitions": 2}
    return JobConfig(**{**base, **changes})  # type: ignore[arg-type]  # values of mixed types, checked by JobConfig


def _batch(offsets: dict[int, tuple[int, int]], n: int, *, ts: int = 100, seq: int = 0) -> Batch:
    return Batch(torch.randn(n, 64), torch.randint(0, 10, (n,)), offsets, [("p", seq, n)] if n else [], ts, 0)


def _apply(cfg: OptimizerConfig, params: dict[str, torch.Tensor], pushed: dict[str, torch.Tensor],
           state: dict[str, list[torch.Tensor]], t: int) -> None:
    """What a parameter server does with one push (``services.optim.step`` per tensor)."""
    for name, p in params.items():
        state.setdefault(name, [torch.zeros(p.numel()) for _ in range(slots(cfg))])
        flat = p.view(-1)
        step(cfg, flat, Sent(pushed[name].reshape(-1).numpy(), None), state[name], t)


def test_one_local_step_with_inner_sgd_and_outer_lr_1_momentum_0_is_todays_sgd_update() -> None:
    lr = 0.05
    today = {n: p.detach().clone() for n, p in build_model("digits-mlp", seed=3).model.named_parameters()}
    replica = Replica(build_model("digits-mlp", seed=3), plan_device("cpu"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}  # the parameter plane's copy
    local = LocalSteps(replica.params, torch.optim.SGD(replica.params.values(), lr=lr, momentum=0.0), steps=1)
    sgd = OptimizerConfig(name="sgd", lr=lr, momentum=0.0)
    outer = OptimizerConfig(name="sgd", lr=1.0, momentum=0.0, nesterov=True)
    state_today: dict[str, list[torch.Tensor]] = {}
    state_outer: dict[str, list[torch.Tensor]] = {}
    for t in range(1, 4):
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        grads = replica.step(x, y).grads  # today: the gradient, applied by the server's sgd
        _apply(sgd, today, grads, state_today, t)
        local.begin()
        assert replica.step(x, y, inner=local.inner).grads == {}
        local.stepped(_batch({0: (t, t + 1)}, 16))
        assert local.full
        delta, covered = local.close()
        assert covered.offsets == {0: (t, t + 1)} and len(covered) == 16
        _apply(outer, params, delta, state_outer, t)
        for n, p in replica.params.items():  # the replica went back to the pull; the next pull brings `params`
            with torch.no_grad():
                p.copy_(params[n])
        for n in today:
            torch.testing.assert_close(params[n], today[n], rtol=1e-6, atol=1e-7)


def test_the_outer_optimizer_is_torchs_nesterov_sgd_on_the_pseudo_gradients() -> None:
    torch.manual_seed(0)
    start = torch.randn(50)
    pushes = [torch.randn(50) for _ in range(5)]
    reference = torch.nn.Parameter(start.clone())
    torch_sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for delta in pushes:
        reference.grad = delta.clone()
        torch_sgd.step()
    cfg = OptimizerConfig(name="sgd", lr=0.7, momentum=0.9, nesterov=True)
    ours, state = start.clone(), [torch.zeros(50)]
    for t, delta in enumerate(pushes, 1):
        step(cfg, ours, Sent(delta.numpy(), None), state, t)
    torch.testing.assert_close(ours, reference.detach())
    plain = start.clone()  # without nesterov: a different trajectory (the option is not ignored)
    plain_state = [torch.zeros(50)]
    for t, delta in enumerate(pushes, 1):
        step(OptimizerConfig(name="sgd", lr=0.7, momentum=0.9), plain, Sent(delta.numpy(), None), plain_state, t)
    assert not torch.allclose(plain, ours)
    with pytest.raises(ValueError, match="Nesterov"):
        OptimizerConfig(name="adam", nesterov=True)
    assert OptimizerConfig.from_json(cfg.to_json()) == cfg


def test_a_window_of_h_steps_pushes_the_parameters_difference_and_returns_to_the_pull() -> None:
    replica = Replica(build_model("digits-mlp", seed=4), plan_device("cpu"))
    pulled = {n: p.detach().clone() for n, p in replica.params.items()}
    local = LocalSteps(replica.params, inner_optimizer(_config(), replica.params.values()), steps=4)
    assert isinstance(local.inner, torch.optim.AdamW)
    # the same steps as a plain local loop of the inner optimizer
    loop = build_model("digits-mlp", seed=4).model
    loop_opt = torch.optim.AdamW(loop.parameters(), lr=0.01, weight_decay=0.0)
    local.begin()
    for k in range(4):
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        replica.step(x, y, inner=local.inner)
        local.stepped(_batch({1: (10 + 16 * k, 26 + 16 * k)}, 16, ts=200 - k, seq=16 * k))
        loop_opt.zero_grad()
        torch.nn.functional.cross_entropy(loop(x), y).backward()
        loop_opt.step()
    assert local.full
    ended = {n: p.detach().clone() for n, p in replica.params.items()}
    delta, covered = local.close()
    for n, p in loop.named_parameters():
        torch.testing.assert_close(ended[n], p.detach())
        torch.testing.assert_close(delta[n], pulled[n] - p.detach())
        assert torch.equal(replica.params[n].detach(), pulled[n])  # back at the pull
    assert covered.offsets == {1: (10, 74)} and len(covered) == 64 and covered.produced_ts_ms == 197
    assert covered.samples == [("p", 0, 16), ("p", 16, 16), ("p", 32, 16), ("p", 48, 16)]
    assert not local.open


def test_a_discarded_window_leaves_the_replica_at_its_pull() -> None:
    replica = Replica(build_model("digits-mlp", seed=5), plan_device("cpu"))
    pulled = {n: p.detach().clone() for n, p in replica.params.items()}
    local = LocalSteps(replica.params, torch.optim.SGD(replica.params.values(), lr=0.1), steps=8)
    with pytest.raises(RuntimeError, match="begin"):
        local.stepped(_batch({0: (0, 4)}, 4))
    local.begin()
    replica.step(torch.randn(4, 64), torch.randint(0, 10, (4,)), inner=local.inner)
    local.stepped(_batch({0: (0, 4)}, 4))
    assert local.open and not local.full
    local.discard()
    assert not local.open
    assert all(torch.equal(p.detach(), pulled[n]) for n, p in replica.params.items())
    with pytest.raises(RuntimeError, match="no window"):
        local.close()


def test_the_window_batch_covers_every_partition_contiguously_and_refuses_a_gap() -> None:
    merged = window_batch([_batch({0: (0, 3), 1: (5, 6)}, 4), _batch({1: (6, 9)}, 0),  # dead-lettered only
                           _batch({0: (3, 7), 2: (0, 1)}, 5)])
    assert merged.offsets == {0: (0, 7), 1: (5, 9), 2: (0, 1)} and len(merged) == 9
    with pytest.raises(ValueError, match="partition 0: a batch of the window starts at offset 4, not at 3"):
        window_batch([_batch({0: (0, 3)}, 3), _batch({0: (4, 6)}, 2)])
    with pytest.raises(ValueError, match="nothing to push"):
        window_batch([])


def test_the_servers_optimizer_follows_local_steps() -> None:
    assert server_optimizer(_config(optimizer="lazyadam")) == OptimizerConfig(name="lazyadam", lr=0.01)
    outer = server_optimizer(_config(local_steps=16, outer_lr=0.5, outer_momentum=0.8))
    assert outer == OptimizerConfig(name="sgd", lr=0.5, momentum=0.8, nesterov=True)
    params = list(build_model("digits-mlp").model.parameters())
    sgd = inner_optimizer(_config(local_steps=4, optimizer="sgd", lr=0.1), params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == OptimizerConfig().momentum
    assert isinstance(inner_optimizer(_config(local_steps=4, optimizer="lazyadam"), params), torch.optim.AdamW)


@pytest.mark.parametrize("optimizer", ["lazyadam", "sgd"])
def test_the_inner_optimizer_is_fused_on_the_cpu_and_steps_as_the_per_tensor_loop_does(optimizer: str) -> None:
    torch.manual_seed(3)
    fused_net, plain_net = build_model("digits-mlp").model, build_model("digits-mlp").model
    plain_net.load_state_dict(fused_net.state_dict())
    initial = [p.detach().clone() for p in fused_net.parameters()]
    inner = inner_optimizer(_config(local_steps=4, optimizer=optimizer, lr=0.01), fused_net.parameters())
    assert inner.defaults["fused"] is True
    kwargs = {k: v for k, v in inner.defaults.items() if k in ("lr", "betas", "eps", "weight_decay", "momentum")}
    plain = type(inner)(plain_net.parameters(), foreach=False, **kwargs)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for net, opt in ((fused_net, inner), (plain_net, plain)):
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    moved = [(a - b).abs().max().item() for a, b in zip(fused_net.parameters(), plain_net.parameters(), strict=True)]
    assert max(moved) < 1e-5
    assert all(not torch.equal(a, b) for a, b in zip(fused_net.parameters(), initial, strict=True))


@pytest.mark.parametrize(("changes", "message"), [
    ({"local_steps": 0}, "local_steps must be an integer >= 1, got 0"),
    ({"local_steps": 8, "codec": "topk+fp16"}, "cannot run with codec 'topk\\+fp16'.*use a dense codec"),
    ({"local_steps": 8, "optimizer": "dgc"}, "needs an optimizer the trainers can run.*got 'dgc'"),
    ({"outer_momentum": 1.0}, "outer_momentum must be in \\[0, 1\\)"),
    ({"outer_lr": -1.0}, "outer_lr must be in \\[0, 10\\]"),
])
def test_the_job_config_refuses_what_local_steps_cannot_run(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_one_local_step_runs_with_any_codec_and_optimizer_as_today() -> None:
    assert _config(codec="topk+fp16", optimizer="dgc").local_steps == 1


def test_the_job_config_round_trips_local_steps_and_an_older_job_reads_the_defaults() -> None:
    config = _config(local_steps=16, outer_lr=0.6, outer_momentum=0.85)
    assert JobConfig.from_hash(config.to_hash()) == config
    assert JobConfig.from_json(config.as_json()) == config
    older = {k: v for k, v in _config().to_hash().items() if k not in ("local_steps", "outer_lr", "outer_momentum")}
    assert JobConfig.from_hash(older) == _config() and _config().local_steps == 1


def test_a_model_with_embedding_tables_is_refused_with_local_steps() -> None:
    spec = build_model("dlrm?schema=movielens&dim=8")
    check_model(_config(), spec)  # one step per push: as today
    with pytest.raises(ValueError, match=r"has embedding tables.*dense models only"):
        check_model(_config(local_steps=4), spec)


def test_every_optimizer_the_rules_allow_with_local_steps_has_an_inner_optimizer_and_the_others_are_refused() -> None:
    from services.local_steps import INNER_OPTIMIZERS
    from services.names import OPTIMIZERS

    params = list(build_model("digits-mlp").model.parameters())
    assert set(INNER_OPTIMIZERS) < set(OPTIMIZERS)
    for name in OPTIMIZERS:
        if name in INNER_OPTIMIZERS:
            assert isinstance(inner_optimizer(_config(local_steps=4, optimizer=name), params), torch.optim.Optimizer)
        else:
            with pytest.raises(ValueError, match=f"needs an optimizer the trainers can run.*got '{name}'"):
                _config(local_steps=4, optimizer=name)
