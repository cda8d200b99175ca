"""Sparse optimizers, versioned deltas, compaction, and what a pull moves (pure, then on the real Redis)."""

from __future__ import annotations

import numpy as np
import pytest
import redis as redis_lib
import torch
from plane_util import gradient_blobs, set_membership

from common.keys import JobKeys
from services import (
    OptimizerConfig,
    ParameterServer,
    ParameterStore,
    PayloadError,
    Pusher,
    Sent,
    ServerSettings,
    Update,
    decode_gradient,
    push_update,
    unapplied_updates,
)
from services.codecs.sparse import varint_encode
from services.deltas import apply_deltas, decode_delta, encode_delta
from services.optim import step
from services.wire import pack

JOB = "deltajob"
N = 4096  # one tensor, 4 shards of 1024


# -- pure ----------------------------------------------------------------------------------------

def test_delta_round_trip_and_refusals() -> None:
    idx = np.array([0, 3, 200, 1023])
    vals = np.array([1.5, -2.0, 3.25, 0.0], dtype=np.float32)
    got_idx, got_vals = decode_delta(encode_delta(idx, vals), 1024)
    assert got_idx.tolist() == idx.tolist() and got_vals.tolist() == vals.tolist()
    with pytest.raises(PayloadError, match=r"outside 0\.\.999"):
        decode_delta(encode_delta(idx, vals), 1000)
    with pytest.raises(PayloadError, match="not increasing"):
        decode_delta(encode_delta(np.array([5, 5]), vals[:2]), 1024)
    with pytest.raises(PayloadError, match="4 indices but 12 bytes"):
        decode_delta(pack({"i": varint_encode(np.diff(idx, prepend=0)), "v": vals[:3].tobytes()}), 1024)
    flat = torch.zeros(1024)
    entries = [(b"3-0", {b"d": encode_delta(np.array([1]), np.array([7.0], np.float32))}),
               (b"5-0", {b"d": encode_delta(np.array([1, 2]), np.array([8.0, 9.0], np.float32))})]
    apply_deltas(flat, entries, after=3, upto=5)  # version 3 is already held: only 5 applies
    assert flat[:3].tolist() == [0.0, 8.0, 9.0]


def test_lazyadam_is_pytorch_sparse_adam() -> None:
    """Our lazy Adam on sparse gradients gives what torch.optim.SparseAdam gives."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=gen)
    ours = start.clone()
    state = [torch.zeros(1000), torch.zeros(1000)]
    theirs = torch.nn.Parameter(start.clone())
    reference = torch.optim.SparseAdam([theirs], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    cfg = OptimizerConfig(name="lazyadam", lr=0.01)
    for t in range(1, 8):
        idx = torch.randperm(1000, generator=gen)[:50].sort().values
        vals = torch.randn(50, generator=gen)
        changed = step(cfg, ours, Sent(vals.numpy(), idx.numpy()), state, t)
        assert changed.tolist() == idx.tolist()
        theirs.grad = torch.sparse_coo_tensor(idx[None], vals, (1000,), check_invariants=True)
        reference.step()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[state[1].nonzero().view(-1)] = False
    assert torch.equal(ours[untouched], start[untouched])  # coordinates no gradient named never move


def test_dgc_server_step_is_plain_sgd_on_the_sent_coordinates() -> None:
    p = torch.ones(10)
    cfg = OptimizerConfig(name="dgc", lr=0.5, weight_decay=0.1)
    changed = step(cfg, p, Sent(np.array([2.0, -4.0], np.float32), np.array([1, 7])), [], 1)
    assert changed.tolist() == [1, 7]
    decay = 1 - 0.5 * 0.1  # decoupled: applied where the step touches
    assert p.tolist() == pytest.approx([1, decay - 1.0, 1, 1, 1, 1, 1, decay + 2.0, 1, 1])


def test_a_dense_optimizer_fills_in_a_sparse_gradient() -> None:
    cfg = OptimizerConfig(name="adam", lr=0.1)
    dense, sparse = torch.ones(6), torch.ones(6)
    sd, ss = [torch.zeros(6), torch.zeros(6)], [torch.zeros(6), torch.zeros(6)]
    g = np.array([0, 3.0, 0, 0, -1.0, 0], dtype=np.float32)
    for t in (1, 2):
        assert step(cfg, dense, Sent(g.copy()), sd, t) is None
        assert step(cfg, sparse, Sent(g[[1, 4]].copy(), np.array([1, 4])), ss, t) is None  # dense step
    assert torch.equal(dense, sparse)


def test_trainer_momentum_is_dgc_momentum_correction_with_factor_masking(redis: redis_lib.Redis) -> None:
    ParameterStore(redis, JOB).init_model({"w": torch.zeros(N)}, shard_elems=1024)
    pusher = Pusher(redis, JOB, "a", codec="topk", codec_options={"density": 0.01}, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    u = torch.zeros(N)  # the reference: DGC, Algorithm 1 with momentum correction and masking
    v = torch.zeros(N)
    for _ in range(4):
        g = torch.randn(N, generator=gen)
        blobs, residuals, momenta, _ = pusher.encode({"w": g})
        pusher.residuals.update(residuals)
        pusher.momenta.update(momenta)
        u = 0.9 * u + g
        v = v + u
        sent = torch.cat([decode_gradient(blobs[i], numel=1024) for i in range(4)])
        mask = sent != 0
        assert int(mask.sum()) == 4 * 11  # ceil(1% of 1024) per shard
        # what was sent is the largest accumulated values of each shard
        for i in range(4):
            part, m = v[i * 1024:(i + 1) * 1024].abs(), mask[i * 1024:(i + 1) * 1024]
            assert float(part[m].min()) >= float(part[~m].max())
        torch.testing.assert_close(sent[mask], v[mask])
        v[mask] = 0
        u[mask] = 0
        torch.testing.assert_close(torch.cat([pusher.residuals[i] for i in range(4)]), v)
        torch.testing.assert_close(torch.cat([pusher.momenta[i] for i in range(4)]), u)
    with pytest.raises(ValueError, match="needs a top-k codec"):
        Pusher(redis, JOB, "a", codec="fp16", momentum=0.9)


# -- on Redis -------------------------------------------------------------------------------------

def sparse_update(redis: redis_lib.Redis, clock: int, coords: dict[int, list[int]], value: float = 1.0) -> None:
    """Push an update whose shard ``i`` gradient is ``value`` at ``coords[i]`` (a top-k message)."""
    blobs = {i: pack({"c": "topk", "n": 1024, "k": len(idx), "i": varint_encode(np.diff(idx, prepend=0)),
                      "v": {"c": "none", "n": len(idx), "d": np.full(len(idx), value, np.float32).tobytes()}})
             for i, idx in coords.items()}
    push_update(redis, JOB, Update(member_id="a", generation=1, clock=clock, gradients=blobs,
                                   offsets={0: (clock - 1, clock)}, samples=[("p", clock - 1, 1)], batch_size=1))


@pytest.fixture
def sparse_job(redis: redis_lib.Redis):
    store = ParameterStore(redis, JOB)
    store.init_model({"w": torch.zeros(N)}, shard_elems=1024, optimizer=OptimizerConfig(name="dgc", lr=1.0,
                                                                                         momentum=0.0))
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    return store


def server(redis: redis_lib.Redis, redis_url: str, **settings) -> ParameterServer:
    ps = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, block_ms=1, batch=1, **settings), client=redis)
    ps.load()
    return ps


def test_a_sparse_update_publishes_only_the_coordinates_it_changed(redis: redis_lib.Redis, redis_url: str,
                                                                   sparse_job: ParameterStore) -> None:
    keys = JobKeys(JOB).group(0)  # one group: every shard is in its slot
    first = sparse_job.pull()
    sparse_update(redis, 1, {0: [5, 9], 2: [100]})
    ps = server(redis, redis_url)
    assert ps.step() == 1
    assert redis.xlen(keys.deltas(0)) == 1 and redis.xlen(keys.deltas(2)) == 1
    assert redis.xlen(keys.deltas(1)) == redis.xlen(keys.deltas(3)) == 0
    (eid, fields), = redis.xrange(keys.deltas(0))
    assert eid == b"1-0" and decode_delta(fields[b"d"], 1024)[0].tolist() == [5, 9]
    assert redis.hgetall(keys.bases) == {str(i).encode(): b"0" for i in range(4)}  # no full rewrite
    assert redis.get(keys.shard(0)) == bytes(4096)
    snap = sparse_job.pull(since=first)
    assert snap.version == 1 and snap.fetched == (0, 2)
    assert snap.wire_bytes < 40  # two small deltas, not 2 x 4 KB of shards
    want = torch.zeros(N)
    want[[5, 9, 2048 + 100]] = -1.0
    assert torch.equal(snap.tensors["w"], want) and torch.equal(sparse_job.pull().tensors["w"], want)
    assert torch.equal(first.tensors["w"], torch.zeros(N))  # an older snapshot is never modified


def test_compaction_rewrites_a_shard_and_a_stale_puller_reads_it_in_full(redis: redis_lib.Redis, redis_url: str,
                                                                         sparse_job: ParameterStore) -> None:
    keys = JobKeys(JOB).group(0)
    start = sparse_job.pull()
    ps = server(redis, redis_url, compact_fraction=0.1)  # 410 bytes of deltas for a 4 KB shard
    for c in range(1, 7):  # 60 coordinates each: ~310 bytes of delta
        sparse_update(redis, c, {0: list(range(60 * (c - 1), 60 * c))})
        assert ps.step() == 1
        if c == 3:
            middle = sparse_job.pull(since=start)
    # every second version pushes the deltas since the base past 410 bytes: versions 2, 4 and 6
    # compact the shard, each keeping the deltas since the previous base
    assert int(redis.hget(keys.bases, 0)) == 6 and int(redis.hget(keys.delta_floors, 0)) == 4
    assert [e for e, _ in redis.xrange(keys.deltas(0))] == [b"5-0", b"6-0"]
    want = torch.zeros(N)
    want[:360] = -1.0
    assert torch.equal(torch.from_numpy(np.frombuffer(redis.get(keys.shard(0)), np.float32).copy()), want[:1024])
    stale = sparse_job.pull(since=middle)  # version 3 < floor 4: the shard is read in full
    recent_base = sparse_job.pull(since=start)
    assert stale.version == 6 and stale.wire_bytes >= 4096 and torch.equal(stale.tensors["w"], want)
    assert torch.equal(recent_base.tensors["w"], want)
    sparse_update(redis, 7, {0: [1000]})
    assert ps.step() == 1
    fresh = sparse_job.pull(since=stale)  # 6 >= floor: one delta
    want[1000] = -1.0
    assert fresh.wire_bytes < 100 and torch.equal(fresh.tensors["w"], want)


def test_a_dense_change_rewrites_the_shard_and_keeps_no_delta(redis: redis_lib.Redis, redis_url: str) -> None:
    store = ParameterStore(redis, JOB)
    store.init_model({"w": torch.zeros(N)}, shard_elems=1024, optimizer=OptimizerConfig(name="adam", lr=0.1))
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    sparse_update(redis, 1, {0: [5]})  # a sparse gradient, but Adam's step moves every coordinate after
    sparse_update(redis, 2, {0: [6]})
    ps = server(redis, redis_url)
    assert ps.step() == 1 and ps.step() == 1
    keys = JobKeys(JOB).group(0)
    assert redis.xlen(keys.deltas(0)) == 0 and redis.hget(keys.bases, 0) == b"2"
    assert redis.hget(keys.delta_floors, 0) == b"2"  # nothing before version 2 can be rebuilt from deltas
    values = store.pull().tensors["w"]
    assert float(values[5]) < 0 and float(values[6]) < 0 and float(values[7]) == 0.0
    assert redis.xlen(keys.deltas(1)) == 0 and redis.hget(keys.bases, 1) == b"0"  # no gradient, no change


def test_compact_every_bounds_the_versions_a_shard_is_rebuilt_from(redis: redis_lib.Redis, redis_url: str,
                                                                   sparse_job: ParameterStore) -> None:
    ps = server(redis, redis_url, compact_every=3)
    for c in range(1, 5):
        sparse_update(redis, c, {1: [c]})
        assert ps.step() == 1
    keys = JobKeys(JOB).group(0)
    assert redis.hget(keys.bases, 1) == b"3" and redis.hget(keys.delta_floors, 1) == b"0"
    assert [e for e, _ in redis.xrange(keys.deltas(1))] == [b"1-0", b"2-0", b"3-0", b"4-0"]


def test_backpressure_counts_unapplied_updates_not_the_log(redis: redis_lib.Redis, redis_url: str) -> None:
    store = ParameterStore(redis, JOB)
    store.init_model({"w": torch.zeros(N)}, shard_elems=1024, optimizer=OptimizerConfig(name="lazyadam", lr=0.1))
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    pusher = Pusher(redis, JOB, "a", codec="topk", max_pending=2)
    grads = {"w": torch.randn(N)}
    pusher.push(grads, generation=1, clock=1, offsets={0: (0, 1)})
    pusher.push(grads, generation=1, clock=2, offsets={0: (1, 2)})
    with pytest.raises(Exception, match="holds 2 unapplied updates"):
        pusher.push(grads, generation=1, clock=3, offsets={0: (2, 3)}, backpressure_timeout_s=0.05)
    ps = server(redis, redis_url, persist_every=100)
    assert ps.step() == 1 and ps.step() == 1
    keys = JobKeys(JOB)
    assert redis.xlen(keys.update_log) == 2 and unapplied_updates(redis, JOB) == 0  # kept until persisted
    pusher.push(grads, generation=1, clock=3, offsets={0: (2, 3)})
    assert ps.step() == 1 and ps.persist()
    assert redis.xlen(keys.update_log) == 0 and gradient_blobs(redis, JOB) == []
