"""Parameter servers on the real Redis: optimizer math, exactly-once across a kill, split shards, refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
import torch
from plane_util import (
    accounting_left,
    gradient_blobs,
    optimizer_state,
    optimizer_steps,
    set_membership,
    small_model,
    staged_values,
)

from common.keys import JobKeys
from services import (
    OptimizerConfig,
    ParameterServer,
    ParameterStore,
    Pusher,
    Sent,
    ServerSettings,
    ServerStatus,
    Update,
    decode_sent,
    get_codec,
    push_update,
    unapplied_updates,
)
from services.optim import slots, step
from services.wire import unpack
from streamtrain.launcher import wait_until

JOB = "psjob"
ROOT = Path(__file__).resolve().parents[1]


def grads_for(clock: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(clock)
    return {k: torch.randn(v.shape, generator=g) for k, v in small_model().items()}


def expected_params(cfg: OptimizerConfig, clocks: list[int]) -> dict[str, torch.Tensor]:
    """What applying the updates of ``clocks`` in order gives (computed locally, whole tensors)."""
    params = {k: v.clone().reshape(-1) for k, v in small_model().items()}
    n_slots = 2 if cfg.name == "adam" else 1
    state = {k: [torch.zeros_like(v) for _ in range(n_slots)] for k, v in params.items()}
    for t, c in enumerate(clocks, start=1):
        for k, g in grads_for(c).items():
            step(cfg, params[k], Sent(g.reshape(-1).numpy()), state[k], t)
    return {k: v.view(small_model()[k].shape) for k, v in params.items()}


def setup(redis: redis_lib.Redis, cfg: OptimizerConfig, groups: int | None = 1) -> ParameterStore:
    store = ParameterStore(redis, JOB)
    store.init_model(small_model(), shard_elems=64, optimizer=cfg, groups=groups)
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    return store


def push_n(redis: redis_lib.Redis, clocks: range, codec: str = "none") -> None:
    pusher = Pusher(redis, JOB, "a", codec=codec)
    for c in clocks:
        pusher.push(grads_for(c), generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                    samples=[("prod", 10 * (c - 1), 10)], batch_size=10)


def applied(redis: redis_lib.Redis) -> int:
    return int(redis.hget(JobKeys(JOB).applied_clocks, "a") or 0)


@pytest.fixture
def servers(redis_url: str) -> Iterator[list[ParameterServer]]:
    started: list[ParameterServer] = []
    yield started
    for s in reversed(started):
        s.close()
    assert all(s.status is ServerStatus.CLOSED for s in started)


@pytest.mark.parametrize("cfg", [OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
                                 OptimizerConfig(name="adam", lr=0.01, schedule="cosine", warmup_steps=2,
                                                 total_steps=10)], ids=["sgd", "adam"])
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("groups", [1, 2])
def test_applies_like_the_local_optimizer(redis: redis_lib.Redis, redis_url: str, servers: list,
                                          cfg: OptimizerConfig, batch: int, groups: int) -> None:
    """Pending updates applied one by one (batch 1) or together in one write (batch 16), by one
    server or by two running side by side, each applying its group's shards."""
    store = setup(redis, cfg, groups=groups)
    push_n(redis, range(1, 6))
    for g in range(groups):
        servers.append(ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, batch=batch, group=g,
                                                      groups=groups)))
    for s in servers:
        s.start()
    wait_until(lambda: applied(redis) == 5, 60, what="5 updates applied")
    snap = store.pull()
    want = expected_params(cfg, [1, 2, 3, 4, 5])
    for k in want:
        torch.testing.assert_close(snap.tensors[k], want[k], rtol=1e-5, atol=1e-6)
    keys = JobKeys(JOB)
    # one group version per write: 5 single applies, or the 5 pending updates in one batch; every
    # update changes every shard, so every group wrote as often; the model version is their sum
    writes = 5 if batch == 1 else 1
    assert snap.group_versions == (writes,) * groups and snap.version == writes * groups == store.version()
    assert unapplied_updates(redis, JOB) == 0 and accounting_left(redis, JOB) == []
    for s in servers:
        s.close()  # a clean stop persists the optimizer state: once every group has, the log is empty
    assert redis.xlen(keys.update_log) == 0 and gradient_blobs(redis, JOB) == []
    assert optimizer_steps(redis, JOB) == {str(i).encode(): b"5" for i in range(6)}
    entries = redis.xrange(keys.applied_samples)
    assert [json.loads(f[b"samples"]) for _, f in entries] == [[["prod", 10 * c, 10]] for c in range(5)]
    assert {f[b"status"] for _, f in entries} == {b"applied"}


def run_ps(redis_url: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "streamtrain.cli", "ps", "--redis-url", redis_url,
                             "--job", JOB, "--block-ms", "50", "--log-level", "WARNING", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def push_encoded(redis: redis_lib.Redis, jobs: list[str], clocks: range, codec: str) -> None:
    """The same encoded gradients (one error-feedback Pusher's bytes) pushed to every job."""
    layout = ParameterStore(redis, jobs[0]).layout
    pusher = Pusher(redis, jobs[0], "a", codec=codec, codec_options={"density": 0.05} if "topk" in codec else {})
    for c in clocks:
        blobs, residuals, _, _ = pusher.encode(grads_for(c))
        pusher.residuals.update(residuals)
        for job in jobs:
            push_update(redis, job, Update(member_id="a", generation=1, clock=c, gradients=blobs,
                                           offsets={0: (10 * (c - 1), 10 * c)}, samples=[("prod", 10 * (c - 1), 10)],
                                           batch_size=10), layout=layout)


def published(redis: redis_lib.Redis, job: str) -> tuple[dict[str, torch.Tensor], list[bytes | None]]:
    """The job's parameters (a full pull) and every optimizer state value persisted in Redis."""
    return ParameterStore(redis, job).pull().tensors, optimizer_state(redis, job, shards=6, slots=2)


@pytest.mark.parametrize(("optimizer", "codec", "batch"), [("lazyadam", "topk+fp16", 1), ("lazyadam", "topk+fp16", 4),
                                                           ("adam", "none", 1)], ids=["lazy-single", "lazy-batch4",
                                                                                      "adam-single"])
@pytest.mark.parametrize("fault", ["kill-before-write", "kill-after-write"])
def test_exactly_once_across_a_ps_kill(redis: redis_lib.Redis, redis_url: str, fault: str, optimizer: str,
                                       codec: str, batch: int) -> None:
    """A `streamtrain ps` SIGKILLs itself just before / just after the atomic write that holds its
    3rd update (alone with --batch 1; with updates 1-4 with --batch 4); a restarted server rebuilds
    its optimizer state by replaying the updates its persisted state lacks, applies the rest, and
    every update counts exactly once: the parameters and optimizer state are bit-identical to
    those of a server that was never killed."""
    cfg = OptimizerConfig(name=optimizer, lr=0.01)
    reference = "psjob-ref"
    for job in (JOB, reference):
        ParameterStore(redis, job).init_model(small_model(), shard_elems=64, optimizer=cfg, groups=1)
        set_membership(redis, job, {"a": [0]}, generation=1)
    push_encoded(redis, [JOB, reference], range(1, 7), codec)
    ref = ParameterServer(ServerSettings(redis_url=redis_url, job=reference, batch=batch, block_ms=1), client=redis)
    ref.load()
    while ref.step():
        pass
    ref.persist()
    proc = run_ps(redis_url, "--batch", str(batch), "--persist-every", "1000", "--fault", fault, "--fault-at", "3")
    try:
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.stderr.close()
    assert rc == -9  # killed at the crash point, not a clean exit
    keys = JobKeys(JOB)
    # the 6 updates were pending at the start, so the batches are [1], [2], [3] ... or [1-4], [5-6]
    done = {("kill-before-write", 1): 2, ("kill-after-write", 1): 3,
            ("kill-before-write", 4): 0, ("kill-after-write", 4): 4}[fault, batch]
    assert applied(redis) == done and redis.xlen(keys.applied_samples) == done
    assert unapplied_updates(redis, JOB) == 6 - done
    if optimizer == "lazyadam":  # nothing persisted yet: the log still holds every update
        assert redis.xlen(keys.update_log) == 6 and redis.get(keys.group(0).persisted) is None
    proc = run_ps(redis_url)
    try:
        wait_until(lambda: applied(redis) == 6, timeout_s=120, what="all 6 updates applied after restart")
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.stderr.close()
    ours, theirs = published(redis, JOB), published(redis, reference)
    for k in ours[0]:
        assert torch.equal(ours[0][k], theirs[0][k]), f"parameters of {k} differ from the reference"
    assert ours[1] == theirs[1], "optimizer state differs from the reference"
    entries = redis.xrange(keys.applied_samples)
    assert [int(f[b"clock"]) for _, f in entries] == [1, 2, 3, 4, 5, 6]
    assert optimizer_steps(redis, JOB) == {str(i).encode(): b"6" for i in range(6)}
    assert redis.xlen(keys.update_log) == 0  # the clean stop persisted: every update left the log
    assert gradient_blobs(redis, JOB) == [] and staged_values(redis, JOB) == []
    assert accounting_left(redis, JOB) == [] and unapplied_updates(redis, JOB) == 0


def test_two_servers_split_the_shards(redis: redis_lib.Redis, redis_url: str, servers: list) -> None:
    cfg = OptimizerConfig(name="sgd", lr=0.05, momentum=0.5)
    redis.hset(JobKeys(JOB).config, "ps_groups", 2)  # the deployment says 2 server groups
    store = setup(redis, cfg, groups=None)
    assert store.meta().groups == 2
    push_n(redis, range(1, 9), codec="none")
    for g in (0, 1):
        servers.append(ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, group=g, groups=2)))
    servers[0].start()
    wait_until(lambda: servers[0].applied == 8, 60, what="group 0 applied 8")
    assert applied(redis) == 0  # group 1 has not applied anything: no update is complete
    assert redis.xlen(JobKeys(JOB).applied_samples) == 0
    assert servers[0].own_shards() == [0, 2, 4]
    servers[0].close()  # group 0 persisted its state; the log keeps what group 1 has not
    assert redis.get(JobKeys(JOB).group(0).persisted) is not None and redis.xlen(JobKeys(JOB).update_log) == 8
    # group 0 deleted its blobs of the updates its persisted state includes; group 1's are all there
    assert [k.split(b"}")[0] for k in gradient_blobs(redis, JOB)] == [b"st:{psjob:g1"] * 8 * 3
    assert store.group_versions() == (servers[0].version, 0) and servers[0].version > 0
    servers[1].start()
    wait_until(lambda: applied(redis) == 8, 60, what="both groups applied 8")
    want = expected_params(cfg, list(range(1, 9)))
    snap = store.pull()
    for k in want:
        torch.testing.assert_close(snap.tensors[k], want[k], rtol=1e-5, atol=1e-6)
    keys = JobKeys(JOB)
    assert redis.xlen(keys.applied_samples) == 8 and unapplied_updates(redis, JOB) == 0
    assert accounting_left(redis, JOB) == []
    servers[1].close()
    assert redis.xlen(keys.update_log) == 0
    assert gradient_blobs(redis, JOB) == [] and staged_values(redis, JOB) == []
    with pytest.raises(Exception, match="split into 2 shard groups"):
        ParameterServer(ServerSettings(redis_url=redis_url, job=JOB), client=redis).load()


def test_a_bad_gradient_that_bypassed_validation_leaves_parameters_untouched(
        redis: redis_lib.Redis, redis_url: str, servers: list) -> None:
    store = setup(redis, OptimizerConfig(lr=0.1))
    before = store.pull()
    nan = get_codec("none").encode(torch.full((64,), float("nan")), check_finite=False).data
    push_update(redis, JOB, Update(member_id="a", generation=1, clock=1, gradients={0: nan},
                                   offsets={0: (0, 10)}, samples=[("p", 0, 10)]))  # no layout: not validated
    servers.append(ParameterServer(ServerSettings(redis_url=redis_url, job=JOB)))
    servers[0].start()
    wait_until(lambda: applied(redis) == 1, 60, what="the bad update recorded")
    after = store.pull()
    assert after.version == before.version == 0
    for k in before.tensors:
        assert torch.equal(before.tensors[k], after.tensors[k])
    (_, entry), = redis.xrange(JobKeys(JOB).applied_samples)
    assert entry[b"status"] == b"rejected" and b"64 NaN" in entry[b"reason"]
    assert servers[0].rejected == 1


def test_cas_loser_reloads_and_does_not_double_apply(redis: redis_lib.Redis, redis_url: str) -> None:
    """Two servers of the same group race on the same log: each update is applied once."""
    cfg = OptimizerConfig(name="sgd", lr=0.1, momentum=0.0)
    store = setup(redis, cfg)
    push_n(redis, range(1, 4))
    first = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB), client=redis)
    second = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB), client=redis)
    first.load()
    second.load()  # both read the same cursor and shards
    entries = redis.xrange(JobKeys(JOB).update_log)
    assert first.step() == 3 and first.applied == 3
    version = store.version()
    assert version == 1  # the three pending updates were written together
    assert second.apply_entries(entries[:2]) == 0  # lost the compare-and-set: nothing written
    assert store.version() == version and second.applied == 0
    assert staged_values(redis, JOB) == []  # the loser's staged bytes were dropped
    assert second._state.cursor == entries[-1][0].decode()  # reloaded: resumes after the winner
    assert second.step() == 0
    want = expected_params(cfg, [1, 2, 3])
    snap = store.pull()
    for k in want:
        torch.testing.assert_close(snap.tensors[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_refused_update_inside_a_batch_is_rejected_and_the_rest_apply(
        redis: redis_lib.Redis, redis_url: str) -> None:
    cfg = OptimizerConfig(name="adam", lr=0.01)
    store = setup(redis, cfg)
    push_n(redis, range(1, 3))
    nan = get_codec("none").encode(torch.full((64,), float("nan")), check_finite=False).data
    push_update(redis, JOB, Update(member_id="a", generation=1, clock=3, gradients={0: nan},
                                   offsets={0: (20, 30)}, samples=[("prod", 20, 10)]))  # not validated
    push_n(redis, range(4, 5))
    server = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, batch=8), client=redis)
    server.load()
    assert server.step() == 4 and server.applied == 4 and server.rejected == 1
    assert server.persist()
    keys = JobKeys(JOB)
    entries = [f for _, f in redis.xrange(keys.applied_samples)]
    assert [(int(f[b"clock"]), f[b"status"]) for f in entries] == [
        (1, b"applied"), (2, b"applied"), (3, b"rejected"), (4, b"applied")]
    assert b"64 NaN" in entries[2][b"reason"]
    assert [json.loads(f[b"offsets"]) for f in entries] == [[[0, 10 * c, 10 * c + 10]] for c in range(4)]
    snap = store.pull()
    assert snap.version == 1  # one write for the batch
    want = expected_params(cfg, [1, 2, 4])  # three optimizer steps: the refused update took none
    for k in want:
        torch.testing.assert_close(snap.tensors[k], want[k], rtol=1e-5, atol=1e-6)
    assert optimizer_steps(redis, JOB) == {str(i).encode(): b"3" for i in range(6)}
    assert int(redis.hget(keys.applied_clocks, "a")) == 4 and redis.xlen(keys.update_log) == 0
    assert gradient_blobs(redis, JOB) == [] and staged_values(redis, JOB) == []


def test_a_batch_gives_the_same_bytes_as_single_applies(redis: redis_lib.Redis, redis_url: str) -> None:
    """The same 7 lossy (topk+fp16) gradients applied with --batch 1 and --batch 3 (batches of 3, 3, 1)
    leave bit-identical shards, Adam state and step counts; two groups split the shards."""
    cfg = OptimizerConfig(name="adam", lr=0.01, clip_norm=5.0, schedule="cosine", total_steps=20)
    jobs = {1: "single", 3: "batched"}
    codec = get_codec("topk+fp16", density=0.2)
    for job in jobs.values():
        ParameterStore(redis, job).init_model(small_model(), shard_elems=64, optimizer=cfg, groups=2)
        set_membership(redis, job, {"a": [0]}, generation=1)
    layout = ParameterStore(redis, "single").layout
    for c in range(1, 8):
        flat = {k: v.reshape(-1) for k, v in grads_for(c).items()}
        blobs = {s.index: codec.encode(flat[s.name][s.start:s.start + s.numel].clone()).data
                 for s in layout.shards}
        for job in jobs.values():
            push_update(redis, job, Update(member_id="a", generation=1, clock=c, gradients=blobs,
                                           offsets={0: (c - 1, c)}, samples=[("p", c - 1, 1)]), layout=layout)
    for batch, job in jobs.items():
        for group in (0, 1):
            server = ParameterServer(ServerSettings(redis_url=redis_url, job=job, batch=batch, block_ms=1,
                                                    group=group, groups=2), client=redis)
            server.load()
            while server.step():
                pass
            assert server.applied == 7
            assert server.persist()
    one, other = ParameterStore(redis, "single").pull(), ParameterStore(redis, "batched").pull()
    for name in one.tensors:
        assert torch.equal(one.tensors[name], other.tensors[name]), f"parameters of {name} differ"
    n = len(layout.shards)
    for i, (a, b) in enumerate(zip(optimizer_state(redis, "single", n, 2), optimizer_state(redis, "batched", n, 2),
                                   strict=True)):
        assert a is not None and a == b, f"optimizer state {i % 2} of shard {i // 2} differs"
    assert optimizer_steps(redis, "single") == optimizer_steps(redis, "batched")
    assert len(optimizer_steps(redis, "single")) == n
    # each group wrote once per update (7) or once per batch (3, 3, 1: 3 writes)
    assert (one.group_versions, other.group_versions) == ((7, 7), (3, 3))
    assert (one.version, other.version) == (14, 6)
    for job in jobs.values():
        k = JobKeys(job)
        assert redis.xlen(k.applied_samples) == 7 and redis.xlen(k.update_log) == 0
        assert accounting_left(redis, job) == [] and gradient_blobs(redis, job) == []


@pytest.mark.parametrize("optimizer", ["lazyadam", "dgc"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_mixed_dense_and_sparse_update_is_applied_shard_by_shard(
        redis: redis_lib.Redis, redis_url: str, servers: list, optimizer: str, batch: int) -> None:
    """With ``dense_below`` 21 the Pusher sends the biases ``b`` (20 values) and ``v`` (5) dense in
    fp16 and the weight ``w`` (200 values, 4 shards) top-k'd at 5 %, in one update; the server
    applies each shard as it was sent: every coordinate of the dense ones, only the kept ones of
    the sparse ones, exactly as the local optimizer does on the decoded shards."""
    cfg = OptimizerConfig(name=optimizer, lr=0.01)
    store = setup(redis, cfg)
    layout = store.layout
    pusher = Pusher(redis, JOB, "a", codec="topk+fp16", codec_options={"density": 0.05}, dense_below=21,
                    momentum=cfg.trainer_momentum)
    params = {k: v.clone().reshape(-1) for k, v in small_model().items()}
    state = {s.index: [torch.zeros(s.numel) for _ in range(slots(cfg))] for s in layout.shards}
    for c in range(1, 6):
        prepared = pusher.prepare(grads_for(c), generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                                  samples=[("prod", 10 * (c - 1), 10)], batch_size=10)
        for s in layout.shards:
            blob = prepared.update.gradients[s.index]
            sent = decode_sent(blob, numel=s.numel)
            codec = unpack(blob)["c"]
            if s.name == "w":
                assert codec == "topk" and sent.indices is not None and sent.indices.size == math.ceil(0.05 * s.numel)
            else:
                assert codec == "fp16" and sent.indices is None
            step(cfg, params[s.name][s.start:s.start + s.numel], sent, state[s.index], c)
        pusher.send(prepared)
        pusher.adopt(prepared.feedback)
    assert pusher.steps == 5
    servers.append(ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, batch=batch)))
    servers[0].start()
    wait_until(lambda: applied(redis) == 5, 60, what="5 mixed updates applied")
    snap = store.pull()
    for k, v in params.items():
        assert torch.equal(snap.tensors[k].reshape(-1), v), f"{k} differs from the local optimizer"
    moved = {k: snap.tensors[k].reshape(-1) != small_model()[k].reshape(-1) for k in params}
    assert moved["b"].all() and moved["v"].all()  # dense: every coordinate stepped
    assert 0 < int(moved["w"].sum()) < 200  # sparse: only the coordinates sent
