"""Pushing updates on the real Redis: fencing, offset commits, backpressure, bad input, init_model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import redis as redis_lib
import torch
from plane_util import LosesPushReply, gradient_blobs, set_membership, small_model

from common.keys import JobKeys
from common.outage import REDIS_DOWN
from services import (
    BackpressureError,
    BadGradientError,
    Feedback,
    FencedError,
    LayoutError,
    OffsetConflictError,
    ParameterStore,
    PayloadError,
    Prepared,
    Pusher,
    UnknownCodecError,
    Update,
    decode_gradient,
    get_codec,
    push_update,
    was_committed,
)
from services.wire import pack

JOB = "pushjob"


@pytest.fixture
def store(redis: redis_lib.Redis) -> ParameterStore:
    s = ParameterStore(redis, JOB)
    s.init_model(small_model(), shard_elems=64, groups=2)  # a push spreads its blobs over two group slots
    set_membership(redis, JOB, {"a": [0, 1], "b": [2]}, generation=3)
    return s


def grads(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in small_model().items()}


def state(redis: redis_lib.Redis) -> tuple:
    keys = JobKeys(JOB)
    return (redis.xlen(keys.update_log), redis.hgetall(keys.offsets), redis.hgetall(keys.clocks),
            redis.get(keys.unapplied), ParameterStore(redis, JOB).group_versions(),
            [redis.get(keys.group(i % 2).shard(i)) for i in range(6)],
            gradient_blobs(redis, JOB))  # a refused push leaves no gradient blob in any group's slot


def pusher_token(redis: redis_lib.Redis) -> str:
    """The blob token of the last logged update."""
    (eid, fields), = redis.xrevrange(JobKeys(JOB).update_log, count=1)
    return Update.from_fields(eid, fields).token


def test_init_model_is_idempotent_and_checks_layout(redis: redis_lib.Redis, store: ParameterStore) -> None:
    other = ParameterStore(redis, JOB)
    meta = other.init_model(small_model(seed=5), shard_elems=64)  # second writer: layout matches, first wins
    assert meta == store.meta()
    snap = other.pull()
    assert torch.equal(snap.tensors["w"], small_model()["w"])
    assert len(store.layout.shards) == 6  # w: 200 values -> 4 shards, b, v
    bad = small_model()
    bad["w"] = torch.zeros(10, 21)
    with pytest.raises(LayoutError, match=r"tensor 'w' has shape \[10, 21\], stored \[10, 20\]"):
        other.init_model(bad, shard_elems=64)
    with pytest.raises(LayoutError, match="no model yet"):
        ParameterStore(redis, "empty").pull()


def test_push_commits_offsets_and_appends_atomically(redis: redis_lib.Redis, store: ParameterStore) -> None:
    pusher = Pusher(redis, JOB, "a", codec="fp16")
    res = pusher.push(grads(), generation=3, clock=1, offsets={0: (0, 5), 1: (0, 2)},
                      samples=[("p1", 0, 7)], batch_size=7)
    assert res.raw_bytes == 4 * 225 and res.wire_bytes < res.raw_bytes
    keys = JobKeys(JOB)
    assert redis.hgetall(keys.offsets) == {b"0": b"5", b"1": b"2"}
    assert redis.hget(keys.clocks, "a") == b"1"
    (entry_id, fields), = redis.xrange(keys.update_log)
    assert entry_id.decode() == res.update_id and sorted(fields) == [b"h"]
    # one gradient blob per shard, each in the slot of the shard's group
    assert sorted(redis.keys(keys.group(0).update_blob("*", "*"))) == [
        keys.group(0).update_blob(pusher_token(redis), i).encode() for i in (0, 2, 4)]
    assert sorted(redis.keys(keys.group(1).update_blob("*", "*"))) == [
        keys.group(1).update_blob(pusher_token(redis), i).encode() for i in (1, 3, 5)]
    # the next range must start at the committed offset; an offsets-only update is fine
    assert not was_committed(redis, JOB, "a", 2)
    pusher.push(None, generation=3, clock=2, offsets={0: (5, 9)})
    assert redis.hget(keys.offsets, "0") == b"9"
    assert was_committed(redis, JOB, "a", 2) and not was_committed(redis, JOB, "b", 1)


def test_stale_generation_and_foreign_partition_are_fenced(redis: redis_lib.Redis, store: ParameterStore) -> None:
    pusher = Pusher(redis, JOB, "a")
    pusher.push(grads(), generation=3, clock=1, offsets={0: (0, 5)})
    set_membership(redis, JOB, {"a": [0], "b": [1, 2]}, generation=4)  # a membership change
    before = state(redis)
    with pytest.raises(FencedError, match="generation 3 of member a is stale: current generation is 4"):
        pusher.push(grads(), generation=3, clock=2, offsets={0: (5, 9)})
    with pytest.raises(FencedError, match=r"partition 1 is assigned to b\|4, not a\|4"):
        pusher.push(grads(), generation=4, clock=2, offsets={0: (5, 9), 1: (0, 3)})
    assert state(redis) == before
    assert FencedError.retriable is False
    pusher.push(grads(), generation=4, clock=2, offsets={0: (5, 9)})  # re-synced: accepted
    assert redis.hget(JobKeys(JOB).offsets, "0") == b"9"


def test_offset_gap_duplicate_and_clock_conflicts(redis: redis_lib.Redis, store: ParameterStore) -> None:
    pusher = Pusher(redis, JOB, "a")
    pusher.push(grads(), generation=3, clock=1, offsets={0: (0, 5)})
    before = state(redis)
    with pytest.raises(OffsetConflictError, match="range starts at 7 but the committed offset is 5 \\(a gap\\)"):
        pusher.push(grads(), generation=3, clock=2, offsets={0: (7, 9)})
    with pytest.raises(OffsetConflictError, match="\\(a duplicate\\)"):
        pusher.push(grads(), generation=3, clock=2, offsets={0: (0, 5)})
    with pytest.raises(OffsetConflictError, match="last pushed clock is 1"):
        pusher.push(grads(), generation=3, clock=1, offsets={0: (5, 6)})
    assert state(redis) == before


def test_backpressure_when_the_log_is_full(redis: redis_lib.Redis, store: ParameterStore) -> None:
    pusher = Pusher(redis, JOB, "a", max_pending=2)
    pusher.push(grads(), generation=3, clock=1)
    pusher.push(grads(), generation=3, clock=2)
    before = state(redis)
    with pytest.raises(BackpressureError, match="holds 2 unapplied updates") as info:
        pusher.push(grads(), generation=3, clock=3, backpressure_timeout_s=0.05)
    assert info.value.retriable
    assert state(redis) == before  # its blobs were deleted again


@pytest.mark.parametrize("case", ["unknown tensor", "shape", "dtype", "nan", "inf"])
def test_bad_gradients_refused_before_anything_is_written(redis: redis_lib.Redis, store: ParameterStore,
                                                          case: str) -> None:
    pusher = Pusher(redis, JOB, "a", codec="topk+fp16")
    g = grads()
    expected = {"unknown tensor": "unknown tensor 'zz'", "shape": r"shape \[10, 19\], expected \[10, 20\]",
                "dtype": "dtype torch.float64, expected torch.float32", "nan": "'b': 1 NaN",
                "inf": "'w': 2 NaN or infinite"}[case]
    if case == "unknown tensor":
        g["zz"] = torch.zeros(3)
    elif case == "shape":
        g["w"] = torch.zeros(10, 19)
    elif case == "dtype":
        g["w"] = g["w"].double()
    elif case == "nan":
        g["b"][4] = float("nan")
    else:
        g["w"][0, 0] = float("inf")
        g["w"][3, 1] = -float("inf")
    before = state(redis)
    with pytest.raises(BadGradientError, match=expected):
        pusher.push(g, generation=3, clock=1, offsets={0: (0, 5)})
    assert state(redis) == before
    assert pusher.residuals == {}


@pytest.mark.parametrize("case", ["unknown codec", "truncated", "oversized", "wrong shard", "wrong size", "nan"])
def test_raw_update_refusals_name_the_problem(redis: redis_lib.Redis, store: ParameterStore, case: str) -> None:
    good = get_codec("fp16").encode(torch.ones(64)).data
    blob, match, err, limit = good, "", Exception, 256 * 1024 * 1024
    shard = 0
    if case == "unknown codec":
        blob, match, err = pack({"c": "zstd", "n": 64, "d": b""}), "unknown codec 'zstd'", UnknownCodecError
    elif case == "truncated":
        blob, match, err = good[:-3], r"shard 0 \(w\[0:64\]\).*truncated", PayloadError
    elif case == "oversized":
        match, err, limit = "oversized", PayloadError, 100
    elif case == "wrong shard":
        shard, match, err = 9, "shard 9 does not exist", BadGradientError
    elif case == "wrong size":
        shard, match, err = 5, r"shard 5 \(v\[0:5\]\): has 64 values, expected 5", BadGradientError
    else:
        blob = get_codec("none").encode(torch.full((64,), float("nan")), check_finite=False).data
        match, err = "64 NaN", BadGradientError
    before = state(redis)
    upd = Update(member_id="a", generation=3, clock=1, gradients={shard: blob}, offsets={0: (0, 5)})
    with pytest.raises(err, match=match):
        push_update(redis, JOB, upd, layout=store.layout, max_bytes=limit)
    assert state(redis) == before


def test_malformed_header_fields_refused(redis: redis_lib.Redis, store: ParameterStore) -> None:
    with pytest.raises(PayloadError, match="clock must be an int >= 1"):
        push_update(redis, JOB, Update(member_id="a", generation=3, clock=0, gradients={}))
    with pytest.raises(PayloadError, match=r"offsets\[0\] must be \(first, next\)"):
        push_update(redis, JOB, Update(member_id="a", generation=3, clock=1, gradients={}, offsets={0: (5, 2)}))
    with pytest.raises(PayloadError, match="member_id"):
        push_update(redis, JOB, Update(member_id="a|b", generation=3, clock=1, gradients={}))


CHAINS = ["none", "fp16", "bf16", "int8", "topk", "topk+fp16", "topk+bf16", "topk+int8"]


@pytest.mark.parametrize("name", CHAINS)
def test_encoder_bytes_and_residuals_equal_the_decode_based_reference(redis: redis_lib.Redis, name: str) -> None:
    """Pusher.encode (the codec reports what it sent) gives bit for bit the bytes and residuals of
    the plain recipe: encode g + residual, decode the bytes, subtract. Tiny tensors, a shard big
    enough for topk's sampled threshold, ties, zeros, signed zeros, and values growing by 1e6."""
    shapes = {"big": (300, 300), "w": (10, 20), "b": (20,), "one": (1,), "two": (2,)}
    ParameterStore(redis, JOB).init_model({k: torch.zeros(s) for k, s in shapes.items()}, shard_elems=70_000)
    pusher = Pusher(redis, JOB, "a", codec=name, codec_options={"density": 0.01} if "topk" in name else None)
    layout = pusher.layout
    codec = get_codec(name, **({"density": 0.01} if "topk" in name else {}))  # same seed as the pusher's
    residuals: dict[int, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(len(name))
    for step in range(6):
        grads = {}
        for tname, shape in shapes.items():
            g = torch.randn(shape, generator=gen) * 10.0 ** (step - 2)
            if step == 1:
                g = torch.round(g * 4) / 4  # ties at the top-k boundary, many zeros
            elif step == 2:
                g = torch.zeros(shape)
            elif step == 3:
                g.view(-1)[::2] = -0.0
            grads[tname] = g
        blobs, new, _, raw = pusher.encode(grads)
        assert raw == 4 * layout.numel
        for tname, g in grads.items():
            flat = g.reshape(-1)
            for shard in layout.shards_of(tname):
                part = flat[shard.start:shard.start + shard.numel]
                if codec.lossy and shard.index in residuals:
                    part = part + residuals[shard.index]
                data = codec.encode(part).data
                assert blobs[shard.index] == data, (step, shard)
                if codec.lossy:
                    want = part - decode_gradient(data, numel=shard.numel)
                    got = new[shard.index]
                    assert got.dtype == torch.float32 and got.shape == want.shape
                    assert np.array_equal(got.numpy().view(np.int32), want.numpy().view(np.int32)), (step, shard)
                    residuals[shard.index] = want
        assert sorted(new) == (sorted(blobs) if codec.lossy else [])
        pusher.residuals.update(new)  # as a successful push commits them
    assert (pusher.residual_norm() > 0) == codec.lossy


@pytest.mark.parametrize("name,momentum", [*((c, 0.0) for c in CHAINS), ("topk+fp16", 0.9), ("topk+int8", 0.9)])
def test_the_device_path_encodes_bit_for_bit_what_the_host_path_does(redis: redis_lib.Redis, name: str,
                                                                      momentum: float) -> None:
    """A gradient on an accelerator is encoded by ``Pusher._encode_on_device`` (residual, momentum,
    finiteness and top-k where it lives; only the kept values and indices cross). Its torch
    arithmetic, run here on the CPU, gives the host path's bytes, residuals and momenta bit for bit
    over steps of error feedback (tensors below topk's sampling size: both paths take the exact top-k)."""
    shapes = {"big": (200, 200), "w": (10, 20), "b": (20,), "one": (1,)}
    ParameterStore(redis, JOB).init_model({k: torch.zeros(s) for k, s in shapes.items()}, shard_elems=30_000)
    options = {"density": 0.01} if "topk" in name else None
    host = Pusher(redis, JOB, "a", codec=name, codec_options=options, momentum=momentum)
    device = Pusher(redis, JOB, "b", codec=name, codec_options=options, momentum=momentum)
    gen = torch.Generator().manual_seed(7)
    for step in range(5):
        grads = {t: torch.randn(shape, generator=gen) * 10.0 ** (step - 2) for t, shape in shapes.items()}
        if step == 1:
            grads = {t: torch.round(g * 4) / 4 for t, g in grads.items()}  # ties and zeros
        blobs, residuals, momenta, _ = host.encode(grads)
        d_blobs: dict[int, bytes] = {}
        d_residuals: dict[int, torch.Tensor] = {}
        d_momenta: dict[int, torch.Tensor] = {}
        for t, g in grads.items():
            device._encode_on_device(t, g, device.layout.shards_of(t), device.codec, d_blobs, d_residuals, d_momenta)
        assert d_blobs == blobs, step
        assert sorted(d_residuals) == sorted(residuals) and sorted(d_momenta) == sorted(momenta)
        for got, want in [*zip(d_residuals.values(), residuals.values()), *zip(d_momenta.values(), momenta.values())]:
            assert np.array_equal(got.numpy().view(np.int32), want.numpy().view(np.int32)), step
        host.adopt(Feedback(residuals, momenta))
        device.adopt(Feedback(d_residuals, d_momenta))
    assert (device.residual_norm() > 0) == get_codec(name).lossy
    bad = {t: torch.zeros(shape) for t, shape in shapes.items()}
    bad["w"][1, 2] = float("nan")
    with pytest.raises(BadGradientError, match=r"gradient of 'w': 1 NaN or infinite value"):
        device._encode_on_device("w", bad["w"], device.layout.shards_of("w"), device.codec, {}, {}, {})


def test_values_a_codec_cannot_carry_are_refused_before_anything_is_written(redis: redis_lib.Redis,
                                                                              store: ParameterStore) -> None:
    """1e6 overflows fp16 (the receiver would decode inf); a finite gradient whose sum with its
    residual overflows float32 is refused too; either way nothing is written and residuals stay."""
    pusher = Pusher(redis, JOB, "a", codec="topk+fp16")
    before = state(redis)
    g = grads(1e-3)
    g["w"][2, 3] = 1e6
    with pytest.raises(BadGradientError, match=r"gradient of 'w' \(shard 0\): 1 value\(s\) overflow codec topk\+fp16"):
        pusher.push(g, generation=3, clock=1, offsets={0: (0, 5)})
    assert pusher.residuals == {} and state(redis) == before
    pusher.push(grads(1e-3), generation=3, clock=1, offsets={0: (0, 5)})
    kept = {i: r.clone() for i, r in pusher.residuals.items()}
    pusher.residuals[5] = torch.full((5,), 3e38)  # v's shard
    kept[5] = pusher.residuals[5].clone()
    before = state(redis)
    g = grads(1e-3)
    g["v"][:] = 3e38
    with pytest.raises(BadGradientError, match="'v': finite, but it overflows float32 once its error-feedback"):
        pusher.push(g, generation=3, clock=2, offsets={0: (5, 6)})
    assert state(redis) == before
    assert all(torch.equal(pusher.residuals[i], r) for i, r in kept.items())


@pytest.mark.parametrize("error", REDIS_DOWN, ids=lambda e: e.__name__)
def test_a_push_whose_reply_is_lost_keeps_its_blobs_and_the_residual_waits_for_the_caller(
        redis: redis_lib.Redis, store: ParameterStore, error: type[Exception]) -> None:
    """Every error the trainer rides out as an outage (``common.outage.REDIS_DOWN``, CLUSTERDOWN
    included) reaches the caller as it is, after a push that went through: the update's blobs stay
    (not dropped as after a refusal), ``was_committed`` says it is committed, and the residual moves
    on only when the caller adopts the push's feedback (the Pusher decides nothing on its own)."""
    want = Pusher(redis, JOB, "a", codec="topk", codec_options={"density": 0.1}).encode(grads(0.5))[1]
    pusher = Pusher(LosesPushReply(error, connection_pool=redis.connection_pool), JOB, "a", codec="topk",
                    codec_options={"density": 0.1})
    prepared = pusher.prepare(grads(0.5), generation=3, clock=1, offsets={0: (0, 5)})
    with pytest.raises(error, match="reply of the push lost"):
        pusher.send(prepared)
    assert was_committed(redis, JOB, "a", 1)
    assert len(gradient_blobs(redis, JOB)) == 6  # the committed update's blobs are not dropped
    assert pusher.residuals == {}
    pusher.adopt(prepared.feedback)
    assert want and sorted(pusher.residuals) == sorted(want)
    assert all(torch.equal(pusher.residuals[i], r) for i, r in want.items())


def test_small_tensors_go_dense_and_the_density_warms_up_by_committed_push(
        redis: redis_lib.Redis, store: ParameterStore) -> None:
    """``dense_below`` 21: ``b`` (20) and ``v`` (5) travel as fp16, ``w``'s shards top-k'd; the top-k
    density starts at 25 % and decays over the warm-up's committed pushes only (a prepared push never
    adopted does not count)."""
    pusher = Pusher(redis, JOB, "a", codec="topk+fp16", codec_options={"density": 0.05}, dense_below=21,
                    density_warmup_steps=4)
    layout = store.layout

    def kept(prepared: Prepared) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for s in layout.shards:
            y = decode_gradient(prepared.update.gradients[s.index], numel=s.numel)
            out.setdefault(s.name, set()).add(int((y != 0).sum()))
        return out

    g = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(3)) for k, v in small_model().items()}
    first = pusher.prepare(g, generation=3, clock=1, offsets={0: (0, 1)})
    assert kept(first) == {"w": {16, 2}, "b": {20}, "v": {5}}  # 25 % of w's shards (64, 64, 64, 8 values)
    again = pusher.prepare(g, generation=3, clock=1, offsets={0: (0, 1)})
    assert kept(again)["w"] == {16, 2}  # not adopted: still step 0
    for clock in range(1, 5):
        pusher.push(g, generation=3, clock=clock, offsets={0: (clock - 1, clock)})
    assert pusher.steps == 4
    last = pusher.prepare(g, generation=3, clock=5, offsets={0: (4, 5)})
    assert kept(last) == {"w": {4, 1}, "b": {20}, "v": {5}}  # 5 %, rounded up


def test_dgc_momentum_is_kept_on_dense_tensors_and_masked_on_sparse_ones(
        redis: redis_lib.Redis, store: ParameterStore) -> None:
    """Momentum factor masking clears the momentum where top-k sent values; a tensor sent whole keeps
    it (momentum SGD), or its momentum would be cleared at every step."""
    pusher = Pusher(redis, JOB, "a", codec="topk+fp16", codec_options={"density": 0.05}, dense_below=21,
                    momentum=0.9)
    ones = grads(1.0)
    pusher.push(ones, generation=3, clock=1, offsets={0: (0, 1)})
    for s in store.layout.shards:
        m = pusher.momenta[s.index].numpy()
        if s.name == "w":  # 5 % of each shard (64, 64, 64, 8 values) sent, rounded up
            assert int((m == 0).sum()) == math.ceil(0.05 * s.numel) and set(np.unique(m)) == {0.0, 1.0}
        else:
            assert (m == 1.0).all()
    second = pusher.prepare(ones, generation=3, clock=2, offsets={0: (1, 2)})
    for s in store.layout.shards:
        if s.name != "w":  # momentum 0.9 * 1 + 1, sent whole (fp16 of 1.9)
            y = decode_gradient(second.update.gradients[s.index], numel=s.numel)
            assert torch.equal(y, torch.full((s.numel,), 1.9).half().float())
