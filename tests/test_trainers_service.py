"""Trainer pieces: model specs, devices, the step (on parameters pulled from the real Redis), evaluation,
settings, polling (on the real broker), and how the push thread files a push's outcome for the state (on the
real Redis)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from kafka import KafkaProducer
from plane_util import LosesPushReply, set_membership, small_model
from torch import nn

from common.outage import REDIS_DOWN
from common.settings import SettingsError, from_args
from coordinator.assignment import Assignment, JobConfig
from datastream import Batch, ShardConsumer, encode_shard
from services import FencedError, ParameterStore, Pusher, was_committed
from streamtrain.cli import main
from streamtrain.launcher import await_until
from trainers import TrainerSettings, build_model, builtin_specs, evaluate, plan_device
from trainers.service import next_batch, send_push
from trainers.state import Adopt, Outcome, Resync, TrainerState
from trainers.step import Replica


def good_factory():
    return nn.Linear(3, 2), nn.functional.cross_entropy


def not_a_pair():
    return nn.Linear(3, 2)


def test_builtin_models_have_the_documented_shapes() -> None:
    assert builtin_specs() == ["digits-mlp", "dlrm", "mlp-2m"]
    digits = build_model("digits-mlp")
    assert digits.model(torch.zeros(5, 64)).shape == (5, 10)
    big = build_model("mlp-2m")
    assert sum(p.numel() for p in big.model.parameters()) == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 10250
    assert digits.classification


def test_same_seed_same_weights() -> None:
    a, b = build_model("digits-mlp", seed=3), build_model("digits-mlp", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_custom_factory_and_bad_specs() -> None:
    spec = build_model(f"{__name__}:good_factory")
    assert isinstance(spec.model, nn.Linear)
    with pytest.raises(ValueError, match="unknown model spec 'resnet'"):
        build_model("resnet")
    with pytest.raises(ValueError, match="cannot import 'nope'"):
        build_model(f"{__name__}:nope")
    with pytest.raises(ValueError, match=r"must return \(nn.Module, loss_fn\)"):
        build_model(f"{__name__}:not_a_pair")


def test_device_plan() -> None:
    plan = plan_device("cpu", threads=1)
    assert plan.kind == "cpu" and plan.autocast_dtype is None and plan.threads == 1
    with pytest.raises(ValueError, match="not a device"):
        plan_device("tpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            plan_device("cuda")


_DENORMAL_PROBE = """
import asyncio, sys
import numpy as np, torch
from trainers import TrainerSettings, plan_device
flush = sys.argv[1] == "1"
plan = plan_device("cpu", threads=1, flush_denormal=flush)
tiny = np.float32(1e-39)  # a float32 denormal
def product() -> tuple[float, float]:  # on a worker thread started after the plan, as a trainer's step runs
    return float(np.float32(1.0) * tiny), (torch.tensor([1e-39]) * 1.0).item()
print(plan.flush_denormal, *asyncio.run(asyncio.to_thread(product)))
"""


@pytest.mark.parametrize("flush", [True, False])
def test_a_trainer_flushes_denormals_on_the_threads_it_starts(flush: bool) -> None:
    """``flush_denormal`` (on by default) makes the CPU treat denormal floats as zero on the trainer's
    worker threads, numpy's arithmetic too; off, they stay. In a subprocess: the flag is process state."""
    assert TrainerSettings().flush_denormal
    done = subprocess.run([sys.executable, "-c", _DENORMAL_PROBE, "1" if flush else "0"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    in_effect, by_numpy, by_torch = done.stdout.split()
    assert in_effect == str(flush)
    if flush:
        assert float(by_numpy) == 0.0 and float(by_torch) == 0.0
    else:
        assert float(by_numpy) > 0.0 and float(by_torch) > 0.0


def test_step_computes_the_true_gradient_on_parameters_pulled_into_the_replica(redis) -> None:
    spec = build_model("digits-mlp", seed=1)
    reference = build_model("digits-mlp", seed=2).model
    replica = Replica(spec, plan_device("cpu"))
    store = ParameterStore(redis, "replica")
    store.init_model({name: p.detach() for name, p in reference.named_parameters()})
    storage = {name: p.data_ptr() for name, p in replica.params.items()}
    snap = store.pull(out=replica.tensors)
    assert all(torch.equal(p, snap.tensors[n]) for n, p in reference.named_parameters())
    for name, p in replica.model.named_parameters():  # written in place: no second copy
        assert torch.equal(p, dict(reference.named_parameters())[name]) and p.data_ptr() == storage[name]

    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    result = replica.step(x, y)
    reference.zero_grad()
    loss = nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    assert result.rows == 8 and result.loss == pytest.approx(loss.item())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(result.grads[name], p.grad)


def test_evaluate_counts_correct_predictions() -> None:
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))  # predicts the larger coordinate
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    y = torch.tensor([0, 1, 1, 1])  # the third is wrong
    result = evaluate(model, nn.functional.cross_entropy, x, y, version=3, classification=True)
    assert result.accuracy == 0.75 and result.samples == 4 and result.version == 3
    assert model.training  # mode restored
    with pytest.raises(ValueError, match="non-empty"):
        evaluate(model, nn.functional.cross_entropy, x[:0], y[:0], version=0, classification=True)


def test_settings_flags_environment_and_bad_values() -> None:
    s = from_args(TrainerSettings, {"batch_size": "128"}, environ={"STREAMTRAIN_MODEL": "mlp-2m"})
    assert s.batch_size == 128 and s.model == "mlp-2m"
    with pytest.raises(SettingsError, match="--batch-size / STREAMTRAIN_BATCH_SIZE: must be >= 1, got 0"):
        from_args(TrainerSettings, {"batch_size": "0"}, environ={})
    with pytest.raises(SettingsError, match="--prefetch"):
        from_args(TrainerSettings, {}, environ={"STREAMTRAIN_PREFETCH": "lots"})


def test_cli_refuses_a_bad_flag_with_its_name(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["trainer", "--topk-density", "2"])
    assert exc.value.code == 2
    assert "--topk-density / STREAMTRAIN_TOPK_DENSITY: must be <= 1.0, got 2.0" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_with_bf16_autocast_matches_cpu() -> None:
    plan = plan_device("auto")
    assert plan.kind == "cuda" and plan.autocast_dtype in (torch.bfloat16, None)
    cpu = Replica(build_model("digits-mlp", seed=4), plan_device("cpu"))
    gpu = Replica(build_model("digits-mlp", seed=4), plan)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    want, got = cpu.step(x, y), gpu.step(x, y)
    assert got.loss == pytest.approx(want.loss, rel=0.05)
    for name, grad in want.grads.items():  # the gradient stays on the device: the push encodes it there
        assert got.grads[name].device.type == "cuda" and got.grads[name].dtype == torch.float32
        torch.testing.assert_close(got.grads[name].cpu(), grad, rtol=0.1, atol=0.02)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gradients_are_compressed_on_the_device(redis) -> None:
    """Top-k, error feedback and the fp16 cast of a gradient on the GPU run there: the residuals stay
    on the device, and the bytes equal the host path's for the same gradient."""
    job = "cudapush"
    gpu = Replica(build_model("digits-mlp", seed=4), plan_device("cuda"))
    ParameterStore(redis, job).init_model(gpu.initial_tensors())
    on_device = Pusher(redis, job, "gpu", codec="topk+fp16", codec_options={"density": 0.01})
    on_host = Pusher(redis, job, "cpu", codec="topk+fp16", codec_options={"density": 0.01})
    step = gpu.step(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    blobs, residuals, _, raw = on_device.encode(step.grads)
    want, _, _, _ = on_host.encode({n: g.cpu() for n, g in step.grads.items()})
    assert blobs == want and raw == 4 * on_device.layout.numel
    assert all(r.device.type == "cuda" for r in residuals.values())


async def test_a_batch_of_poison_records_only_is_handed_to_the_step_not_dropped(
        kafka) -> None:
    """A batch whose records all went to the dead-letter topic has no rows but covers their offsets:
    the trainer must step on it (an offsets-only push), or its next push starts after a gap the
    parameter plane refuses, and the trainer resynchronises for nothing."""
    topic = kafka.create_topic()
    shard = encode_shard(np.ones((2, 2), np.float32), np.zeros(2, np.int64), producer_id="p", first_seq=0)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    try:
        with ShardConsumer(kafka.bootstrap, topic, feature_dim=2, max_records_per_batch=8) as consumer:
            consumer.assign({0: 0})
            producer.send(topic, shard[:-5], partition=0).get(30)  # offset 0: a truncated shard of 2 records
            await await_until(lambda: consumer.stats().batches == 1, 60, what="the poison-only batch")
            producer.send(topic, shard, partition=0).get(30)  # offset 1: the same 2 records, whole
            await await_until(lambda: consumer.stats().batches == 2, 60, what="the batch of good records")
            first, second = await next_batch(consumer), await next_batch(consumer)
    finally:
        producer.close()
    assert first is not None and second is not None
    assert (len(first), first.rejected, first.offsets) == (0, 2, {0: (0, 1)})
    assert (len(second), second.offsets) == (2, {0: (1, 2)})


PUSHJOB = "trainerpush"


def _assignment(member: str) -> Assignment:
    return Assignment(member_id=member, generation=1, partitions=(0,), state="active",
                      config=JobConfig(consistency="ssp", staleness=2, codec="topk", optimizer="lazyadam", lr=0.01,
                                       topic="t", partitions=1))


@pytest.mark.parametrize("error", REDIS_DOWN, ids=lambda e: e.__name__)
def test_a_push_cut_off_by_any_redis_outage_is_unsettled_and_keeps_its_residual_once_committed(
        redis, error: type[Exception]) -> None:
    """The push thread (``send_push``) files every ``common.outage.REDIS_DOWN`` error, CLUSTERDOWN
    included, as an unreachable push; the state keeps it unsettled with its error feedback, and once
    ``was_committed`` says it went through, tells the shell to adopt that feedback. (On a Redis
    Cluster a committed push cut off by CLUSTERDOWN used to lose its residual.)"""
    ParameterStore(redis, PUSHJOB).init_model(small_model(), shard_elems=64)
    set_membership(redis, PUSHJOB, {"m1": [0]}, generation=1)
    g = {k: torch.full_like(v, 0.5) for k, v in small_model().items()}
    want = Pusher(redis, PUSHJOB, "m1", codec="topk", codec_options={"density": 0.1}).encode(g)[1]
    pusher = Pusher(LosesPushReply(error, connection_pool=redis.connection_pool), PUSHJOB, "m1", codec="topk",
                    codec_options={"density": 0.1})
    state = TrainerState()
    state.joined("m1", 1, _assignment("m1"))
    batch = Batch(torch.empty(0, 0), torch.empty(0), {0: (0, 5)}, [], 0, 0)

    report = send_push(pusher, g, batch, clock=state.pushing(), generation=1)
    assert report.outcome is Outcome.UNREACHABLE and isinstance(report.error, error)
    assert state.push_ended(report.outcome, report.feedback) == []
    assert pusher.residuals == {}  # nothing decided yet
    unsettled = state.unsettled
    assert unsettled is not None
    committed = was_committed(redis, PUSHJOB, unsettled.member_id, unsettled.clock)
    assert committed
    assert state.outage_settled(committed) == [Adopt(report.feedback)]
    pusher.adopt(report.feedback)  # what the shell does with Adopt
    assert state.last_pushed == 1
    assert want and sorted(pusher.residuals) == sorted(want)
    assert all(torch.equal(pusher.residuals[i], r) for i, r in want.items())


def test_a_refused_push_is_filed_as_refused_and_its_feedback_dropped(redis) -> None:
    ParameterStore(redis, PUSHJOB).init_model(small_model(), shard_elems=64)
    set_membership(redis, PUSHJOB, {"m1": [0]}, generation=2)  # the push below carries generation 1
    pusher = Pusher(redis, PUSHJOB, "m1", codec="topk", codec_options={"density": 0.1})
    state = TrainerState()
    state.joined("m1", 1, _assignment("m1"))
    g = {k: torch.full_like(v, 0.5) for k, v in small_model().items()}
    report = send_push(pusher, g, Batch(torch.empty(0, 0), torch.empty(0), {0: (0, 5)}, [], 0, 0),
                       clock=state.pushing(), generation=1)
    assert report.outcome is Outcome.REFUSED and isinstance(report.error, FencedError)
    assert state.push_ended(report.outcome, report.feedback) == [Resync(1)]
    assert pusher.residuals == {} and state.last_pushed == 0


async def test_an_idle_tick_under_local_steps_waits_and_pushes_but_neither_pulls_nor_begins_a_window(
        kafka, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With local steps, a tick (the empty push that advances an idle member's clock while others wait
    on it) waits for the clock bound and pushes, but pulls nothing and begins no window: no local step
    follows it. (It used to pull the whole model and clone it as a window's anchor, for nothing.)"""
    from common.tasks import cancel_and_wait
    from coordinator.settings import CoordinatorSettings
    from coordinator.testing import running_coordinator
    from trainers.service import Trainer

    job, topic = "idletick", kafka.create_topic()
    settings = CoordinatorSettings(job=job, redis_url=redis_url, kafka_bootstrap=kafka.bootstrap, topic=topic,
                                   partitions=1, admin_token="a", job_token="j", kafka_timeout_ms=5000,
                                   lease_ms=60_000, local_steps=4, codec="fp16", optimizer="adam")
    async with running_coordinator(settings) as coordinator:
        trainer = Trainer(TrainerSettings(
            job=job, coordinator_url=str(coordinator.make_url("")).rstrip("/"), job_token="j", redis_url=redis_url,
            kafka_bootstrap=kafka.bootstrap, model="digits-mlp", commit_to_kafka=False))
        pulls: list[object] = []
        pull = trainer.store.pull

        def counted(*args: Any, **kwargs: Any) -> Any:
            pulls.append(args)
            return pull(*args, **kwargs)

        monkeypatch.setattr(trainer.store, "pull", counted)
        try:
            await trainer._join()
            trainer.state.follow()
            await trainer._assign_from_committed()
            clock = trainer.state.clock
            await trainer._step([Batch(torch.empty(0, 0), torch.empty(0), {}, [], 0, 0)], tick=True)
            await trainer._settle_push()
            assert trainer.state.last_pushed == clock and trainer.state.last_wait is not None  # waited, pushed
            assert pulls == [] and trainer.snapshot is None
            window = trainer.local
            assert window is not None and not window.open and window._anchor is None
        finally:
            await cancel_and_wait(trainer._heartbeat_task)
            await trainer._leave()
            for task in trainer._background:
                await cancel_and_wait(task)
            await trainer._close()


def test_the_step_is_chosen_once_a_window_waits_and_pulls_on_its_first_step_only(redis) -> None:
    """``choose_steps``: one push per step (each step waits and pulls what the bound asks for), or a
    window of local steps (only its first step waits and pulls; a tick waits, pulls nothing, opens
    nothing)."""
    from services.consistency import Consistency
    from trainers.steps import PlainSteps, StepInputs, WindowSteps, choose_steps

    job = "steps"
    replica = Replica(build_model("digits-mlp", seed=1), plan_device("cpu"))
    store = ParameterStore(redis, job)
    store.init_model(replica.initial_tensors())
    given = StepInputs(member_id="m1", clock=1, own_from=1, known=None, covers=None, base=None,
                       dense=Consistency("ssp", 2), bound=None)
    batches = [Batch(torch.randn(8, 64), torch.randint(0, 10, (8,)), {0: (k, k + 1)}, [], 0, 0) for k in range(3)]
    config = JobConfig(consistency="ssp", staleness=2, codec="fp16", optimizer="adam", lr=0.01, topic="t",
                       partitions=1)

    plain = choose_steps(config, redis, TrainerSettings(job=job), store, replica, rows=None, progressive=None)
    assert isinstance(plain, PlainSteps) and plain.window is None and plain.room() == 0
    [done] = plain.compute(batches[:1], given)
    assert done.wait is not None and done.snapshot is not None and not done.in_window  # not trusted: pulled
    assert done.result is not None and done.result.grads

    local = choose_steps(JobConfig(**{**config.__dict__, "local_steps": 3}), redis, TrainerSettings(job=job),
                         store, replica, rows=None, progressive=None)
    assert isinstance(local, WindowSteps) and local.room() == 2
    tick = local.tick(Batch(torch.empty(0, 0), torch.empty(0), {}, [], 0, 0), given)
    assert tick.wait is not None and tick.snapshot is None and not tick.in_window and not local.window.open
    done_all = local.compute(batches, given)
    assert [d.wait is not None for d in done_all] == [True, False, False]
    assert done_all[0].snapshot is not None and [d.snapshot for d in done_all[1:]] == [None, None]
    assert all(d.in_window and d.result is not None and d.result.grads == {} for d in done_all)
