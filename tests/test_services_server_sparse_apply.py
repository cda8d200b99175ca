"""The sparse apply path, pure: an update's top-k gradients decoded together, and lazy Adam (and
dgc) stepping every shard an update touches at once, against straightforward references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services import BadGradientError, OptimizerConfig, PayloadError, Sent, Update, get_codec
from services.codecs import decode_sent, decode_sents
from services.codecs.sparse import varint_decode, varint_encode
from services.layout import make_layout
from services.optim import sparse_steps, step
from services.push.updates import validate_gradients
from services.wire import pack, unpack


def _leb128_decode(data: bytes) -> list[int]:
    out, value, shift = [], 0, 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(value)
            value, shift = 0, 0
    return out


def test_varint_decode_is_leb128() -> None:
    rng = np.random.default_rng(0)
    for top in (2, 128, 129, 300, 1 << 14, 1 << 21, 1 << 28, 1 << 35):
        vals = rng.integers(0, top, 500)
        vals[::97] = top - 1  # the widest value of the range
        data = varint_encode(vals)
        got = varint_decode(data)
        assert got.dtype == np.int64 and got.tolist() == _leb128_decode(data) == vals.tolist()
    with pytest.raises(PayloadError, match="truncated"):
        varint_decode(b"\x05\x81")
    with pytest.raises(PayloadError, match="longer than 5 bytes"):
        varint_decode(b"\x01" + b"\x80" * 5 + b"\x01")
    assert varint_decode(b"\x80" * 4 + b"\x01").tolist() == [1 << 28]


def _blobs(inner: str, numels: list[int], seed: int = 0) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    codec = get_codec(f"topk+{inner}", density=0.02)
    return [codec.encode(torch.randn(n, generator=gen)).data for n in numels]


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Equal bit for bit, dtype included."""
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("inner", ["none", "fp16", "bf16"])
def test_decode_sents_is_decode_sent_bit_for_bit(inner: str) -> None:
    numels = [70000, 1000, 3, 65536, 200000, 1]
    blobs = _blobs(inner, numels)
    empty = {"c": "topk", "n": 10, "k": 0, "i": b"", "v": {"c": inner, "n": 0, "d": b""}}  # a gradient that keeps none
    blobs.insert(2, pack(empty))
    numels.insert(2, 10)
    together = decode_sents(blobs, numels)
    assert together is not None
    for blob, n, got in zip(blobs, numels, together, strict=True):
        alone = decode_sent(blob, numel=n)
        assert _same(got.indices, alone.indices) and _same(got.values, alone.values)
    assert together[2].values.size == 0 and together[0].values.size > 1000


def _mutations(inner: str, numels: tuple[int, int, int] = (5000, 6000, 7000)) -> dict[str, list[bytes]]:
    """Malformed variants of a good 3-shard update (shard 1 is the bad one)."""
    good = _blobs(inner, list(numels), seed=1)
    msg = unpack(good[1])

    def edit(**fields: object) -> list[bytes]:
        return [good[0], pack({**msg, **fields}), good[2]]

    idx = varint_decode(msg["i"])
    width = len(msg["v"]["d"]) // msg["k"]
    last_byte_open = msg["i"][:-1] + bytes([msg["i"][-1] | 0x80])  # its last varint runs on
    nan = np.frombuffer(msg["v"]["d"], np.uint8).copy()
    nan[:width] = 0xFF  # all ones: a NaN in float32, float16 and bfloat16
    out = {
        "wrong n": edit(n=msg["n"] + 1),
        "k over n": edit(k=msg["n"] + 1),
        "k not the index count": edit(k=msg["k"] - 1, v={**msg["v"], "n": msg["k"] - 1,
                                                          "d": msg["v"]["d"][:-width]}),
        "index out of range": edit(i=varint_encode(np.concatenate([idx[:-1], [msg["n"]]]))),
        "repeated index": edit(i=varint_encode(np.concatenate([idx[:2], [0], idx[3:]]))),
        "last varint runs on": edit(i=last_byte_open),
        # k values, then a continuation byte: alone, truncated; joined with the next shard's bytes it
        # would decode to k values for each shard (the next one's first value shifted)
        "stream ends inside a varint": edit(i=msg["i"] + b"\x80"),
        "values short": edit(v={**msg["v"], "d": msg["v"]["d"][:-width]}),
        "values count": edit(v={**msg["v"], "n": msg["k"] + 1}),
        "NaN value": edit(v={**msg["v"], "d": nan.tobytes()}),
        "nested topk": edit(v={**msg, "n": msg["k"]}),
        "not a map": [good[0], pack([1, 2]), good[2]],
        "truncated msgpack": [good[0], good[1][:-3], good[2]],
        "trailing bytes": [good[0], good[1] + b"\x00", good[2]],
    }
    # two shards whose errors cancel out when joined: shard 1 one byte short, shard 2 one byte long
    # in its indices, so the joined bytes decode to the right counts; each alone is refused
    cut = msg["i"][-1:]
    other = unpack(good[2])
    out["errors that cancel when joined"] = [good[0], pack({**msg, "i": msg["i"][:-1]}),
                                             pack({**other, "i": cut + other["i"]})]
    return out


@pytest.mark.parametrize("inner", ["none", "fp16", "bf16"])
def test_decode_sents_refuses_what_decode_sent_refuses(inner: str) -> None:
    """Any gradient decode_sent refuses makes decode_sents answer None (decode one by one then)."""
    numels = [5000, 6000, 7000]
    for name, blobs in _mutations(inner).items():
        assert decode_sents(blobs, numels) is None, name
        with pytest.raises((PayloadError, BadGradientError)):
            for blob, n in zip(blobs, numels, strict=True):
                decode_sent(blob, numel=n)


def test_decode_sents_leaves_other_codecs_to_decode_sent() -> None:
    gen = torch.Generator().manual_seed(2)
    dense = [get_codec(c).encode(torch.randn(100, generator=gen)).data for c in ("fp16", "none")]
    assert decode_sents(dense, [100, 100]) is None
    mixed = _blobs("fp16", [3000]) + _blobs("bf16", [3000])  # one update, two value codecs
    assert decode_sents(mixed, [3000, 3000]) is None
    assert decode_sents([*_blobs("fp16", [3000]), get_codec("topk+int8").encode(torch.randn(3000)).data],
                        [3000, 3000]) is None
    assert decode_sents([], []) is None


def test_validate_gradients_decodes_together_what_it_decoded_one_by_one() -> None:
    layout = make_layout({"a": torch.zeros(300, 100), "b": torch.zeros(5000)}, shard_elems=8192)
    numels = [s.numel for s in layout.shards]
    blobs = _blobs("fp16", numels, seed=3)
    update = Update(member_id="m", generation=1, clock=1, gradients=dict(enumerate(blobs)), log_id="1-0")
    got = validate_gradients(update, layout)
    assert list(got) == list(range(len(numels)))
    for i, sent in got.items():
        alone = decode_sent(blobs[i], numel=numels[i])
        assert _same(sent.indices, alone.indices) and _same(sent.values, alone.values)
    bad = _mutations("fp16", (8192, 8192, 8192))
    for name, error, match in [("NaN value", BadGradientError, r"gradient of shard 1 \(a\[8192:16384\]\): 1 NaN"),
                               ("stream ends inside a varint", PayloadError, "truncated varint")]:
        with pytest.raises(error, match=match):  # the one-by-one error, naming the shard where it did
            validate_gradients(Update(member_id="m", generation=1, clock=1,
                                      gradients={**update.gradients, 1: bad[name][1]}, log_id="1-0"), layout)


# -- the optimizer ------------------------------------------------------------------------------

def _reference(cfg: OptimizerConfig, p: np.ndarray, m: np.ndarray, v: np.ndarray,
               updates: list[list[tuple[int, Sent, int]]], scales: list[float]) -> None:
    """Lazy Adam (or dgc) written out coordinate by coordinate in float32 scalars: for each update in
    order, for each (shard offset, gradient, step t) it carries, each coordinate it names."""
    f32 = np.float32
    for parts, scale in zip(updates, scales, strict=True):
        for off, grad, t in parts:
            lr = cfg.lr  # constant schedule
            decay = f32(1.0 - lr * cfg.weight_decay)
            rate = f32(lr * np.sqrt(1 - cfg.beta2 ** t) / (1 - cfg.beta1 ** t)) if cfg.name == "lazyadam" \
                else f32(lr)
            idx = range(grad.values.size) if grad.indices is None else grad.indices
            for j, i in enumerate(idx):
                g = grad.values[j] if scale == 1.0 else grad.values[j] * f32(scale)
                c = off + int(i)
                if cfg.weight_decay:
                    p[c] = p[c] * decay
                if cfg.name == "lazyadam":
                    m[c] = m[c] + (g - m[c]) * f32(1 - cfg.beta1)
                    v[c] = v[c] + (g * g - v[c]) * f32(1 - cfg.beta2)
                    p[c] = p[c] - rate * (m[c] / (np.sqrt(v[c]) + f32(cfg.eps)))
                else:
                    p[c] = p[c] - rate * g


@pytest.mark.parametrize("cfg", [OptimizerConfig(name="lazyadam", lr=0.01),
                                 OptimizerConfig(name="lazyadam", lr=0.003, weight_decay=0.1, beta1=0.8),
                                 OptimizerConfig(name="dgc", lr=0.1, weight_decay=0.01)])
def test_sparse_steps_is_lazy_adam_coordinate_by_coordinate(cfg: OptimizerConfig) -> None:
    """Random sparse updates over three shards in one buffer: some skip a shard (so the shards'
    step counts differ), the same coordinates recur across updates, one gradient is dense, some
    updates are scaled (clipping): sparse_steps equals the written-out reference and step() on
    each shard, bit for bit."""
    rng = np.random.default_rng(7)
    sizes = [300, 50, 1000]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    k = 2 if cfg.name == "lazyadam" else 0
    rows = np.zeros((1 + k, sum(sizes)), dtype=np.float32)
    rows[0] = rng.standard_normal(sum(sizes)).astype(np.float32)
    start = rows[0].copy()
    touched = np.zeros(sum(sizes), dtype=np.int64)
    ref = rows.copy() if k else np.concatenate([rows, np.zeros((2, sum(sizes)), np.float32)])
    shards = [[torch.from_numpy(rows[0, o:o + n].copy()), [torch.zeros(n) for _ in range(k)]]
              for o, n in zip(offsets, sizes, strict=True)]
    steps = [0, 0, 0]
    updates, scales = [], []
    for u in range(12):
        parts, ref_parts = [], []
        scale = 1.0 if u % 3 else float(rng.uniform(0.1, 0.9))
        for s, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
            if u % 4 == 1 and s == 1:
                continue  # this update does not touch shard 1
            steps[s] += 1
            if u == 5 and s == 0:
                grad = Sent(rng.standard_normal(n).astype(np.float32))  # dense
            else:
                idx = np.sort(rng.choice(min(n, 60 if u % 2 else n), size=min(n, 20), replace=False))
                grad = Sent(rng.standard_normal(idx.size).astype(np.float32), idx.astype(np.int64))
            touched[off + (np.arange(n) if grad.indices is None else grad.indices)] += 1
            parts.append((off, n, grad, steps[s]))
            ref_parts.append((off, grad, steps[s]))
            changed = step(cfg, shards[s][0], grad, shards[s][1], steps[s], scale)
            assert _same(changed, grad.indices)
        sparse_steps(cfg, rows, parts, scale)
        updates.append(ref_parts)
        scales.append(scale)
    _reference(cfg, ref[0], ref[1], ref[2], updates, scales)
    assert _same(rows[0], ref[0]) and not np.array_equal(rows[0], ref[0] * 0)
    if k:
        assert _same(rows[1], ref[1]) and _same(rows[2], ref[2])
    assert _same(rows[0], np.concatenate([p.numpy() for p, _ in shards]))
    for r in range(k):
        assert _same(rows[1 + r], np.concatenate([st[r].numpy() for _, st in shards]))
    assert steps == [12, 9, 12]
    assert (touched == 0).any() and (touched > 2).any()  # untouched coordinates, and ones updates share
    assert _same(rows[0][touched == 0], start[touched == 0])  # coordinates no gradient named never move
