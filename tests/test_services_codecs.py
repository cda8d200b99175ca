"""Gradient codecs: round trips, sizes, strict payload limits, error feedback (pure, no servers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services import BadGradientError, PayloadError, UnknownCodecError, decode_gradient, get_codec
from services.codecs import DEFAULT_DENSE_BELOW, SizeAdaptive, warmup_density
from services.codecs.sparse import varint_decode, varint_encode
from services.wire import pack

CHAINS = ["none", "fp16", "bf16", "int8", "topk", "topk+fp16", "topk+bf16", "topk+int8"]


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("n", [1, 7, 1000, 200_003])
def test_round_trip(name: str, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    enc = get_codec(name).encode(x)
    y = decode_gradient(enc.data, numel=n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert enc.nbytes == len(enc.data)
    if name == "none":
        assert torch.equal(x, y)
    elif name.startswith("topk"):
        kept = y != 0
        k = math.ceil(0.01 * n)
        assert 1 <= int(kept.sum()) <= k
        tol = {"topk": 0, "topk+fp16": 1e-3, "topk+bf16": 1e-2, "topk+int8": 1e-2}[name]
        assert torch.allclose(y[kept], x[kept], rtol=tol, atol=tol * float(x.abs().max()))
        if (~kept).any():  # what it keeps is (approximately) the largest magnitudes
            assert float(x[kept].abs().min()) >= float(torch.quantile(x[~kept].abs(), 0.95))
    else:
        tol = {"fp16": 1e-3, "bf16": 8e-3, "int8": 1e-2}[name]
        assert torch.allclose(x, y, rtol=tol, atol=tol * float(x.abs().max()))


def test_sizes_against_fp32() -> None:
    x = torch.randn(1_000_000)
    fp32 = get_codec("none").encode(x).nbytes
    assert get_codec("fp16").encode(x).nbytes < fp32 / 1.99
    assert get_codec("int8").encode(x).nbytes < fp32 / 3.9
    assert fp32 / get_codec("topk+fp16", density=0.01).encode(x).nbytes >= 100


def test_topk_sampled_threshold_is_close_to_exact() -> None:
    x = torch.randn(500_000, generator=torch.Generator().manual_seed(1))
    codec = get_codec("topk", density=0.01).parts[0]
    idx = codec.select(x)
    exact = set(torch.topk(x.abs(), 5000).indices.tolist())
    assert idx.numel() == 5000 and set(idx.tolist()) == exact  # the 2k-candidate estimate rarely undershoots
    assert torch.all(idx[1:] > idx[:-1])


def test_varint_round_trip_and_truncation() -> None:
    vals = np.array([0, 1, 127, 128, 16383, 16384, 2**31, 2**34], dtype=np.int64)
    data = varint_encode(vals)
    assert list(varint_decode(data)) == list(vals)
    with pytest.raises(PayloadError, match="truncated varint"):
        varint_decode(data[:-1])


def test_unknown_codec_names() -> None:
    with pytest.raises(UnknownCodecError, match="'zstd'"):
        get_codec("topk+zstd")
    with pytest.raises(UnknownCodecError, match="sparsifier"):
        get_codec("fp16+topk")
    with pytest.raises(ValueError, match="unknown option"):
        get_codec("fp16", density=0.1)
    with pytest.raises(UnknownCodecError, match="'lz4'"):
        decode_gradient(pack({"c": "lz4", "n": 3, "d": b"xxx"}))


def test_payload_refusals() -> None:
    data = get_codec("fp16").encode(torch.randn(100)).data
    with pytest.raises(PayloadError, match="truncated"):
        decode_gradient(data[:-5])
    with pytest.raises(PayloadError, match="oversized"):
        decode_gradient(data, max_bytes=100)
    with pytest.raises(PayloadError, match="trailing"):
        decode_gradient(data + b"\x00")
    with pytest.raises(PayloadError, match="expected 200"):
        decode_gradient(pack({"c": "fp16", "n": 100, "d": b"\x00" * 10}))
    with pytest.raises(BadGradientError, match="expected 99"):
        decode_gradient(data, numel=99)
    bad = torch.randn(10)
    bad[3] = float("nan")
    with pytest.raises(BadGradientError, match="1 NaN or infinite"):
        decode_gradient(get_codec("none").encode(bad, check_finite=False).data)
    with pytest.raises(BadGradientError, match="infinite"):  # 1e6 overflows fp16
        decode_gradient(get_codec("fp16").encode(torch.full((4,), 1e6)).data)


@pytest.mark.parametrize("name", CHAINS)
def test_encoding_refuses_non_finite_input(name: str) -> None:
    """Every chain refuses NaN/inf before encoding: the receiver's check cannot catch all of them
    (unchecked, int8 encodes a block holding a NaN with scale 1, which decodes as finite garbage,
    and topk drops a NaN silently)."""
    codec = get_codec(name)
    for value, count in ((float("nan"), 1), (float("inf"), 2), (-float("inf"), 2)):
        x = torch.randn(1000)
        x[[7, 500][:count]] = value
        with pytest.raises(BadGradientError, match=f"{count} NaN or infinite"):
            codec.encode(x)
        with pytest.raises(BadGradientError, match=f"{count} NaN or infinite"):
            codec.encode_sent(x)
    with pytest.raises(BadGradientError, match="float32"):
        codec.encode(torch.zeros(3, dtype=torch.float64))


def test_error_feedback_bounded_and_topk_sgd_converges() -> None:
    """Least squares with top-k (0.5%) compressed gradients: with error feedback the loss
    falls close to the optimum and the residual stays bounded; without it, it does not."""
    gen = torch.Generator().manual_seed(0)
    d, n = 1000, 2000
    a = torch.randn(n, d, generator=gen) / math.sqrt(d)
    w_true = torch.randn(d, generator=gen)
    b = a @ w_true
    codec = get_codec("topk+fp16", density=0.01)
    ata, atb = a.T @ a / n * 10, a.T @ b / n * 10

    def train(feedback: bool) -> tuple[float, list[float]]:
        w = torch.zeros(d)
        residual = torch.zeros(d)
        norms = []
        for _ in range(800):
            g = ata @ w - atb
            corrected = g + residual if feedback else g
            sent = decode_gradient(codec.encode(corrected).data, numel=d)
            residual = corrected - sent if feedback else residual
            norms.append(float(residual.norm()))
            w -= 0.5 * sent
        return float(((a @ w - b) ** 2).mean()), norms

    start = float((b ** 2).mean())
    loss_ef, norms = train(True)
    loss_plain, _ = train(False)
    assert loss_ef < 0.05 * start
    assert loss_ef < loss_plain
    assert max(norms[400:]) <= 2 * max(norms[:400])  # bounded, not growing


def sample_values(kind: str, n: int, seed: int) -> torch.Tensor:
    """Test data: plain normals, heavy ties, all zeros, or signed zeros among tiny and large values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "ties":  # few distinct magnitudes: the top-k boundary falls inside a tie
        return torch.round(x * 2) / 2
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "signed zeros":
        x = x * torch.exp2(torch.randint(-30, 10, (n,), generator=gen).float())
        x[::3] = -0.0
        x[1::3] = 0.0
    return x


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "signed zeros"])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 70_000])
def test_encode_sent_is_what_decoding_the_bytes_gives(name: str, kind: str, n: int) -> None:
    """``encode_sent`` puts the same bytes on the wire as ``encode``, and what it says was sent
    is bit for bit what the receiver decodes (70 000 values: topk's sampled threshold)."""
    x = sample_values(kind, n, seed=n)
    plain, with_sent = get_codec(name), get_codec(name)  # same seed: the same sampled thresholds
    for step in range(2):
        data = plain.encode(x).data
        enc, sent = with_sent.encode_sent(x)
        assert enc.data == data and enc.numel == n
        decoded = decode_gradient(data, numel=n).numpy()
        rebuilt = np.zeros(n, dtype=np.float32)
        rebuilt[slice(None) if sent.indices is None else sent.indices] = sent.values
        assert sent.values.dtype == np.float32
        assert rebuilt.view(np.int32).tolist() == decoded.view(np.int32).tolist()  # -0.0 counts
        if sent.indices is not None:
            assert sent.indices.dtype == np.int64 and np.all(np.diff(sent.indices) > 0)
        x = x * 0.5 - 0.25 * step


def test_varint_matches_leb128_bytes() -> None:
    """The vectorized encoder writes textbook LEB128: low 7 bits first, high bit = more bytes follow."""
    def leb128(v: int) -> bytes:
        out = bytearray()
        while True:
            byte, v = v & 0x7F, v >> 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                return bytes(out)

    vals = np.random.default_rng(3).integers(0, 2**35, 500) >> np.random.default_rng(4).integers(0, 35, 500)
    vals = np.concatenate([vals, [0, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**35 - 1]])
    assert varint_encode(vals) == b"".join(leb128(int(v)) for v in vals)
    assert varint_encode(np.zeros(0, dtype=np.int64)) == b""
    assert list(varint_decode(varint_encode(vals))) == list(vals)


def test_default_encode_sent_decodes_the_message() -> None:
    """A codec that does not override ``encode_sent`` gets the decode-based default, which agrees
    with the cheap override; the default refuses to wrap an inner codec it cannot see into."""
    from services.codecs import Codec
    from services.codecs.floating import Float16Codec

    class PlainFp16(Float16Codec):
        encode_sent = Codec.encode_sent

    x = sample_values("signed zeros", 999, seed=5)
    msg, sent = PlainFp16().encode_sent(x, None)
    cheap_msg, cheap = Float16Codec().encode_sent(x, None)
    assert msg == cheap_msg and sent.indices is None and cheap.indices is None
    assert sent.values.view(np.int32).tolist() == cheap.values.view(np.int32).tolist()
    with pytest.raises(TypeError, match="must override encode_sent"):
        PlainFp16().encode_sent(x, Float16Codec())


# -- compression that fits the tensor (services.codecs.adaptive) ------------------------------------

@pytest.mark.parametrize(("chain", "dense"), [("topk+fp16", "fp16"), ("topk+int8", "int8"), ("topk", "none"),
                                              ("topk+bf16", "bf16")])
def test_size_adaptive_sends_tensors_below_the_threshold_dense_with_the_value_codec(chain: str, dense: str) -> None:
    adaptive = SizeAdaptive(chain, dense_below=4096, density=0.01)
    assert adaptive.for_tensor(4095).name == dense and adaptive.for_tensor(1).name == dense
    assert adaptive.for_tensor(4096).name == chain and adaptive.for_tensor(1 << 20).name == chain
    assert SizeAdaptive(chain, dense_below=0).for_tensor(1).name == chain  # 0: no tensor is dense


def test_size_adaptive_keeps_the_value_codec_options_and_leaves_dense_chains_alone() -> None:
    adaptive = SizeAdaptive("topk+int8", dense_below=100, density=0.01, block=64)
    assert adaptive.for_tensor(10).parts[0].block == 64  # type: ignore[attr-defined]  # the value codec is an Int8Codec here
    for name in ("none", "fp16", "int8"):
        assert SizeAdaptive(name, dense_below=1 << 20).for_tensor(10).name == name
    with pytest.raises(ValueError, match="dense_below"):
        SizeAdaptive("topk+fp16", dense_below=-1)
    with pytest.raises(ValueError, match="warm-up"):
        SizeAdaptive("topk+fp16", warmup_steps=-1)


def test_a_mixed_update_round_trips_each_tensor_by_the_codec_it_names() -> None:
    """Small tensors come back whole (fp16-rounded), large ones as their top 1 %."""
    adaptive = SizeAdaptive("topk+fp16", dense_below=4096, density=0.01)
    assert DEFAULT_DENSE_BELOW > 64 * 16  # a 64-16-10 plug-in classifier travels whole by default
    g = torch.Generator().manual_seed(1)
    for x in (torch.randn(256, generator=g), torch.randn(10, 300, generator=g), torch.randn(256, 256, generator=g)):
        chain = adaptive.for_tensor(x.numel())
        enc, sent = chain.encode_sent(x)
        y = decode_gradient(enc.data, numel=x.numel())
        assert torch.equal(y, torch.from_numpy(sent.dense(x.numel())))  # what the encoder says it sent
        if x.numel() < 4096:
            assert sent.indices is None and torch.equal(y, x.reshape(-1).half().float())
        else:
            k = math.ceil(0.01 * x.numel())
            assert sent.indices is not None and int((y != 0).sum()) == k
            assert y.abs().max() == x.abs().max().half().float()  # the largest magnitude is kept


def test_warmup_density_decays_exponentially_from_a_quarter_to_the_target() -> None:
    assert warmup_density(0, 0.01, 100) == 0.25
    assert warmup_density(100, 0.01, 100) == warmup_density(10_000, 0.01, 100) == 0.01
    assert warmup_density(50, 0.01, 100) == pytest.approx(math.sqrt(0.25 * 0.01))  # geometric midpoint
    series = [warmup_density(t, 0.01, 100) for t in range(101)]
    assert all(a > b for a, b in zip(series, series[1:]))  # strictly decreasing
    ratios = [b / a for a, b in zip(series, series[1:])]
    assert max(ratios) == pytest.approx(min(ratios))  # by the same factor every step
    assert warmup_density(0, 0.01, 0) == 0.01  # no warm-up
    assert warmup_density(3, 0.5, 100) == 0.5  # a target above the start: no warm-up
    with pytest.raises(ValueError, match="density"):
        warmup_density(0, 0.0, 10)
    with pytest.raises(ValueError, match=">= 0"):
        warmup_density(-1, 0.01, 10)


def test_size_adaptive_sets_the_top_k_density_of_each_step() -> None:
    adaptive = SizeAdaptive("topk+fp16", warmup_steps=10, density=0.01)
    adaptive.set_step(0)
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(2))
    assert adaptive.density == 0.25
    assert adaptive.for_tensor(x.numel()).encode_sent(x)[1].values.size == 25_000
    adaptive.set_step(10)
    assert adaptive.density == 0.01
    assert adaptive.for_tensor(x.numel()).encode_sent(x)[1].values.size <= 1000
