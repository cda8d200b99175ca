"""The synthetic click source: seeded, Zipf-shaped IDs, labels from a hidden logistic truth that drifts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.hashing import mix64
from datastream.clicks import BLOCK, ClickStream, zipf_ranks
from datastream.producer import iter_shards
from datastream.records import decode_record, encode_shard
from datastream.sources import TEST_EVERY, SourceError, load_source


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    """Probability that a random click scores above a random non-click (ties count half)."""
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    pos = label == 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum()))


def test_records_are_shaped_like_criteo_and_seeded() -> None:
    a = load_source("clicks?limit=3000").read()
    assert a.x.shape == (3000, 13) and a.x.dtype == np.float32 and a.y.dtype == np.int64
    assert set(np.unique(a.y)) == {0, 1}
    assert list(a.ids) == [f"c{f}" for f in range(1, 27)]
    assert all(col.lengths.tolist() == [1] * 3000 for col in a.ids.values())
    b = load_source("clicks?limit=3000").read()
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert a.ids == b.ids
    c = load_source("clicks?limit=3000&seed=1").read()
    assert not np.array_equal(a.ids["c1"].values, c.ids["c1"].values)
    # a record depends only on the seed and its index, not on where the source stops
    longer = load_source(f"clicks?limit={BLOCK + 100}").read()
    assert longer.slice(0, 3000).ids == a.ids and np.array_equal(longer.y[:3000], a.y)
    assert len(longer) == BLOCK + 100
    # the split convention holds, IDs aligned with their records
    test = load_source("clicks?limit=3000", split="test").read()
    assert len(test) == 600
    assert test.ids == a.take(np.arange(TEST_EVERY - 1, 3000, TEST_EVERY)).ids
    with pytest.raises(TypeError, match="carry ID features"):
        _x, _y = test


def test_vocabulary_is_split_over_the_features_and_ids_are_a_bijection() -> None:
    stream = ClickStream()
    assert stream.sizes.sum() == 10_000_000 and len(stream.sizes) == 26
    assert stream.sizes.max() - stream.sizes.min() <= 1
    assert ClickStream(multi=4).names[-1] == "tags" and ClickStream(multi=4).sizes.sum() == 10_000_000
    ranks = np.arange(1, 200_001)
    ids = np.concatenate([stream.ids_of(f, ranks) for f in range(3)])
    assert len(np.unique(ids)) == len(ids)  # no two (feature, rank) pairs share an ID
    assert (np.abs(stream.ids_of(0, np.arange(1, 11))) > 1 << 40).all()  # popular IDs are not small numbers
    z = np.arange(1 << 16, dtype=np.uint64)
    assert len(np.unique(mix64(z))) == len(z) and mix64(z)[1] != 1


def test_zipf_ranks_match_the_exact_law() -> None:
    rng = np.random.default_rng(7)
    for n, exponent in ((40, 1.1), (7, 0.6), (500, 1.0), (1, 1.1), (25, 2.5)):
        draws = 300_000
        k = zipf_ranks(rng, n, exponent, (draws,))
        assert k.dtype == np.int64 and k.min() >= 1 and k.max() <= n
        p = np.arange(1, n + 1, dtype=np.float64) ** -exponent
        p /= p.sum()
        seen = np.bincount(k, minlength=n + 1)[1:] / draws
        sd = np.sqrt(p * (1 - p) / draws) + 1e-12
        assert (np.abs(seen - p) / sd).max() < 5.5, (n, exponent)  # every rank within 5.5 standard errors
    rows = zipf_ranks(rng, np.array([[3], [100_000]]), 1.1, (2, 50_000))  # one bound per row
    assert rows[0].max() == 3 and rows[1].max() > 3
    with pytest.raises(ValueError, match="> 0"):
        zipf_ranks(rng, 10, 0.0, (3,))


def test_id_counts_are_zipf_shaped() -> None:
    stream = ClickStream(features=1, dense=0, vocab=1000, zipf=1.1)
    ex = load_source("clicks?features=1&dense=0&vocab=1000&zipf=1.1&limit=200000").read()
    ids, counts = np.unique(ex.ids["c1"].values, return_counts=True)
    order = np.argsort(-counts)
    top = ids[order][:3].tolist()
    assert top == stream.ids_of(0, np.array([1, 2, 3])).tolist()  # the most popular ID is rank 1, ...
    assert counts[order][0] / counts[order][1] == pytest.approx(2 ** 1.1, rel=0.05)
    # log-count against log-rank over the first 100 ranks: a straight line of slope -1.1
    ranks = np.arange(1, 101)
    slope = np.polyfit(np.log(ranks), np.log(counts[order][:100]), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.08)
    assert len(ids) > 900  # the tail is drawn too


def test_labels_follow_the_hidden_truth() -> None:
    stream = ClickStream(multi=6)
    ex = load_source("clicks?multi=6&limit=60000").read()
    lengths = ex.ids["tags"].lengths
    assert lengths.min() == 0 and lengths.max() == 6 and abs(lengths.mean() - 3) < 0.05
    logit = stream.logit(0, ex.x, ex.ids)
    p = 1 / (1 + np.exp(-logit))
    assert abs(p.mean() - ex.y.mean()) < 0.01  # calibrated: labels are Bernoulli(sigmoid(logit))
    assert _auc(logit, ex.y) > 0.8  # and there is plenty to learn
    for lo, hi in ((0.1, 0.3), (0.45, 0.55), (0.7, 0.9)):
        band = (p > lo) & (p < hi)
        assert abs(ex.y[band].mean() - p[band].mean()) < 0.02, (lo, hi)
    other = ClickStream(multi=6, seed=5).logit(0, ex.x, ex.ids)  # another seed is another truth
    assert _auc(other, ex.y) < 0.65


def test_the_truth_drifts_slowly() -> None:
    stream = ClickStream(drift=0.1)
    ex = load_source("clicks?limit=20000").read()

    def corr(delta: float) -> float:
        a, b = stream.logit(0, ex.x, ex.ids), stream.logit(int(delta), ex.x, ex.ids)
        return float(np.corrcoef(a, b)[0, 1])

    assert corr(0) == 1.0
    assert 0.99 < corr(1e6) < 0.9999  # a million records later: a turn of 0.1 rad, cos 0.995
    assert corr(2e6) < corr(1e6)
    assert abs(corr(math.pi / 2 / 0.1 * 1e6)) < 0.1  # a quarter turn later: an unrelated truth
    spread = [stream.logit(s, ex.x, ex.ids).std() for s in (0, 5_000_000, 15_000_000)]
    assert max(spread) / min(spread) < 1.15  # turning keeps the truth's spread
    still = ClickStream(drift=0.0)
    np.testing.assert_array_equal(still.logit(0, ex.x, ex.ids), still.logit(10**7, ex.x, ex.ids))


def test_clicks_make_version_2_shards() -> None:
    src = load_source("clicks?multi=3&dense=0&vocab=5000&limit=1000", split="train")
    shards = list(iter_shards(src, 256))
    assert [len(s) for s in shards] == [256, 256, 256, 32]
    for shard in shards:
        rec = decode_record(encode_shard(shard.x, shard.y, ids=shard.ids, producer_id="p", first_seq=0),
                            feature_dim=0, label_kind="classification")
        assert rec.x.shape == (len(shard), 0) and rec.ids == shard.ids


@pytest.mark.parametrize("spec,message", [
    ("clicks?vocab=3", "at least one ID per categorical feature"), ("clicks?zipf=0", "zipf must be > 0"),
    ("clicks?zipf=x", "not a number"), ("clicks?features=0&dense=0", "needs some features"),
    ("clicks?color=red", "unknown option"), ("clicks?drift=inf", "drift finite"), ("clicks?multi=-1", ">= 0")])
def test_bad_click_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(SourceError, match=message):
        load_source(spec)
