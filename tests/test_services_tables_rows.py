"""The pure parts of embedding tables: specs, placement, initial rows, row optimizers, row gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.errors import BadGradientError, PayloadError
from services.tables import (
    RowGrads,
    RowOptimizerConfig,
    TableSpec,
    decode_row_grads,
    encode_row_grads,
    group_of_ids,
    initial_rows,
    pull_dtype,
    row_dtype,
    split_by_group,
    step_rows,
    tables_from_json,
    tables_to_json,
)
from services.tables.apply import RowBatch
from services.tables.rows import SEEN_DTYPE
from services.tables.spec import validate_tables
from services.tables.store import LoadedRows


def test_a_spec_round_trips_and_defaults_its_feature_to_its_name() -> None:
    t = TableSpec("user", 16, optimizer=RowOptimizerConfig("adagrad", lr=0.1), admit_after=3,
                  expire_after_s=60.0, max_rows=1000)
    assert t.features == ("user",)
    assert t.slots == 1
    assert TableSpec("item", 8, features=("item", "clicked_item")).slots == 16  # lazyadam: m and v
    back = tables_from_json(tables_to_json([t]))
    assert back == (t,)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "bad name", "dim": 4}, "invalid table name"),
    ({"name": "t", "dim": 0}, "dim must be"),
    ({"name": "t", "dim": 4, "pooling": "max"}, "pooling must be"),
    ({"name": "t", "dim": 4, "admit_after": 0}, "admit_after"),
    ({"name": "t", "dim": 4, "max_rows": -1}, "max_rows"),
    ({"name": "t", "dim": 4, "expire_after_s": float("inf")}, "expire_after_s"),
    ({"name": "t", "dim": 4, "features": ("a", "a")}, "named twice"),
])
def test_a_bad_spec_is_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TableSpec(**kwargs)


def test_tables_are_checked_as_a_whole() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        validate_tables([TableSpec("a", 4), TableSpec("a", 8, features=("b",))])
    with pytest.raises(ValueError, match="looked up in two tables"):
        validate_tables([TableSpec("a", 4, features=("x",)), TableSpec("b", 4, features=("x",))])
    with pytest.raises(ValueError, match="unknown field"):
        tables_from_json([{"name": "a", "dim": 4, "colour": "red"}])


def test_placement_is_stable_and_even() -> None:
    ids = np.arange(200_000, dtype=np.int64) * 7  # regular IDs: the mix must still spread them
    groups = group_of_ids(ids, 4)
    assert groups.dtype == np.int64 and set(groups.tolist()) == {0, 1, 2, 3}
    counts = np.bincount(groups, minlength=4)
    assert (abs(counts - 50_000) < 1_500).all(), counts
    assert (group_of_ids(ids, 4) == groups).all()
    assert (group_of_ids(ids, 1) == 0).all()
    assert group_of_ids(np.array([-1, 2**63 - 1], dtype=np.int64), 3).tolist() == \
        group_of_ids(np.array([-1, 2**63 - 1], dtype=np.int64), 3).tolist()
    with pytest.raises(TypeError, match="int64"):
        group_of_ids(np.arange(3, dtype=np.int32), 2)


def test_initial_rows_depend_on_the_table_and_id_only() -> None:
    spec = TableSpec("user", 16, init_scale=0.05)
    ids = np.array([0, 1, 42, -7, 2**62], dtype=np.int64)
    rows = initial_rows(spec, ids)
    assert rows.dtype == np.float32 and rows.shape == (5, 16)
    assert (np.abs(rows) <= 0.05).all() and len({r.tobytes() for r in rows}) == 5
    # the same ID in another batch, in another order, in another process: the same row
    assert np.array_equal(initial_rows(spec, ids[::-1])[::-1], rows)
    assert np.array_equal(initial_rows(TableSpec("user", 16, init_scale=0.05, max_rows=9), ids[2:3]), rows[2:3])
    # another table's row of the same ID differs
    assert not np.array_equal(initial_rows(TableSpec("item", 16, init_scale=0.05), ids), rows)
    # uniform: the mean and spread of many rows are those of U(-s, s)
    many = initial_rows(spec, np.arange(20_000, dtype=np.int64))
    assert abs(float(many.mean())) < 1e-3
    assert float(many.std()) == pytest.approx(0.05 / 3 ** 0.5, rel=0.02)
    # stable across releases: a row nobody wrote must not change meaning under a running job
    assert initial_rows(TableSpec("t", 2, init_scale=1.0), np.array([42], dtype=np.int64))[0].tolist() == \
        [0.7555707693099976, 0.5102741718292236]


def test_stored_rows_put_what_a_pull_returns_first() -> None:
    spec = TableSpec("t", 16)
    assert row_dtype(spec).itemsize == 8 + 64 + 8 + 128
    assert pull_dtype(spec).itemsize == 8 + 64
    assert row_dtype(spec).fields["values"][1] == pull_dtype(spec).fields["values"][1] == 8
    assert row_dtype(TableSpec("t", 16, optimizer=RowOptimizerConfig("adagrad"))).itemsize == 8 + 64 + 8 + 4


def test_lazyadam_rows_are_pytorch_sparse_adam_on_an_embedding_bag() -> None:
    """The row optimizer on deduplicated rows gives what SparseAdam gives on an EmbeddingBag's
    sparse gradient (duplicates coalesced), with the table's step count as SparseAdam's step."""
    gen = torch.Generator().manual_seed(0)
    n, dim = 50, 8
    bag = torch.nn.EmbeddingBag(n, dim, mode="sum", sparse=True)
    start = bag.weight.detach().clone()
    reference = torch.optim.SparseAdam(bag.parameters(), lr=0.01)
    cfg = RowOptimizerConfig("lazyadam", lr=0.01)
    values = start.numpy().copy()
    state = np.zeros((n, 2 * dim), dtype=np.float32)
    for t in range(1, 6):
        ids = torch.randint(0, n, (40,), generator=gen)  # repeats: one gradient row per unique ID
        offsets = torch.arange(0, 40, 4)
        target = torch.randn(10, dim, generator=gen)
        bag.zero_grad()
        ((bag(ids, offsets) - target) ** 2).sum().backward()
        reference.step()
        # ours: the same gradient, as the trainer sends it: unique IDs, summed rows
        uniq, inverse = torch.unique(ids, return_inverse=True)
        w = torch.from_numpy(values[uniq.numpy()]).requires_grad_()
        pooled = torch.nn.functional.embedding_bag(inverse, w, offsets, mode="sum")
        ((pooled - target) ** 2).sum().backward()
        rows = uniq.numpy()
        v, s = values[rows], state[rows]
        step_rows(cfg, v, s, w.grad.numpy(), t)
        values[rows], state[rows] = v, s
    torch.testing.assert_close(torch.from_numpy(values), bag.weight.detach(), rtol=1e-6, atol=1e-7)
    touched = np.abs(state).sum(axis=1) > 0
    assert np.array_equal(values[~touched], start.numpy()[~touched])  # untouched rows never move


def test_rowwise_adagrad_follows_its_formula() -> None:
    rng = np.random.default_rng(0)
    cfg = RowOptimizerConfig("adagrad", lr=0.1, eps=1e-8)
    values = rng.standard_normal((5, 4)).astype(np.float32)
    expect = values.astype(np.float64)
    acc = np.zeros((5, 1), dtype=np.float32)
    acc64 = np.zeros(5)
    for t in range(1, 4):
        g = rng.standard_normal((5, 4)).astype(np.float32)
        step_rows(cfg, values, acc, g, t)
        acc64 += (g.astype(np.float64) ** 2).mean(axis=1)
        expect -= 0.1 * g / (np.sqrt(acc64) + 1e-8)[:, None]
    np.testing.assert_allclose(values, expect, rtol=1e-5)
    np.testing.assert_allclose(acc[:, 0], acc64, rtol=1e-6)


def _parts() -> list[RowGrads]:
    rng = np.random.default_rng(1)
    return [RowGrads("user", np.array([-5, 3, 9], dtype=np.int64), rng.standard_normal((3, 4)).astype(np.float32)),
            RowGrads("item", np.array([7], dtype=np.int64), rng.standard_normal((1, 2)).astype(np.float32))]


_TABLES = {"user": TableSpec("user", 4), "item": TableSpec("item", 2)}


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_row_gradients_round_trip(wire: str) -> None:
    parts = _parts()
    blob = encode_row_grads(parts, wire_dtype=wire)
    back = decode_row_grads(blob, _TABLES)
    assert [p.table for p in back] == ["user", "item"]
    for a, b in zip(parts, back, strict=True):
        assert a.ids.tolist() == b.ids.tolist() and b.grads.dtype == np.float32
        expect = a.grads.astype(np.float16).astype(np.float32) if wire == "float16" else a.grads
        assert np.array_equal(b.grads, expect)
    half = len(encode_row_grads(parts, wire_dtype="float16"))
    assert half < len(encode_row_grads(parts)) - 20


def test_bad_row_gradients_are_refused_by_name() -> None:
    good = _parts()
    with pytest.raises(BadGradientError, match="table 'colour' is not in the model"):
        decode_row_grads(encode_row_grads([RowGrads("colour", good[0].ids, good[0].grads)]), {})
    with pytest.raises(BadGradientError, match="unique and increasing"):
        decode_row_grads(encode_row_grads([RowGrads("user", good[0].ids[::-1].copy(), good[0].grads)]), _TABLES)
    with pytest.raises(PayloadError, match="need 24 bytes"):
        decode_row_grads(encode_row_grads([RowGrads("item", np.array([1, 2, 3]), np.zeros((3, 4), np.float32))]),
                         _TABLES)
    nan = good[0].grads.copy()
    nan[1, 2] = np.nan
    with pytest.raises(BadGradientError, match=r"table 'user': 1 value.s. NaN"):
        encode_row_grads([RowGrads("user", good[0].ids, nan)])
    big = np.full((3, 4), 1e6, dtype=np.float32)
    with pytest.raises(BadGradientError, match="overflowing float16"):
        encode_row_grads([RowGrads("user", good[0].ids, big)], wire_dtype="float16")
    with pytest.raises(PayloadError, match=r"truncated|invalid"):
        decode_row_grads(encode_row_grads(good)[:-3], _TABLES)
    with pytest.raises(PayloadError, match="each entry"):
        decode_row_grads(b"\x81\xa1t\x91\x93\xa4user\xc4\x00\xc4\x00", _TABLES)


def test_a_part_splits_by_owning_group_in_order() -> None:
    ids = np.arange(0, 3000, 3, dtype=np.int64)
    grads = np.arange(ids.size * 2, dtype=np.float32).reshape(-1, 2)
    split = split_by_group(RowGrads("t", ids, grads), 3)
    assert sorted(split) == [0, 1, 2]
    assert sum(p.ids.size for p in split.values()) == ids.size
    for g, p in split.items():
        assert (group_of_ids(p.ids, 3) == g).all() and (np.diff(p.ids) > 0).all()
        assert np.array_equal(p.grads[:, 0], p.ids / 3 * 2)  # each row stays with its ID


def _loaded(spec: TableSpec, ids: np.ndarray, rows: dict[int, np.ndarray] | None = None,
            seen: dict[int, int] | None = None) -> LoadedRows:
    rows, seen = rows or {}, seen or {}
    present = np.array([int(i) in rows for i in ids], dtype=bool)
    records = np.zeros(int(present.sum()), dtype=row_dtype(spec))
    records["values"] = [rows[int(i)] for i in ids[present]] if present.any() else records["values"]
    records["version"] = 3
    seen_mask = np.array([int(i) in seen for i in ids], dtype=bool) & ~present
    seen_records = np.zeros(int(seen_mask.sum()), dtype=SEEN_DTYPE)
    seen_records["count"] = [seen[int(i)] for i in ids[seen_mask]] if seen_mask.any() else seen_records["count"]
    return LoadedRows(ids, present, records, seen_mask, seen_records)


def test_a_batch_steps_rows_in_order_and_writes_only_what_changed() -> None:
    spec = TableSpec("t", 2, optimizer=RowOptimizerConfig("adagrad", lr=1.0, eps=0.0))
    ids = np.array([1, 5, 9], dtype=np.int64)
    tb = RowBatch.load([spec], {"t": _loaded(spec, ids, rows={1: np.array([1.0, 1.0]), 5: np.array([2.0, 2.0])})},
                       {"t": 7})
    g = np.ones((1, 2), dtype=np.float32)
    tb.apply([(("t",), {"t": RowGrads("t", np.array([1], dtype=np.int64), g)}),
              (("t",), {}),  # an update whose rows of this table are all in other groups
              (("t",), {"t": RowGrads("t", np.array([1, 9], dtype=np.int64), np.vstack([g, g]))})], now_ms=1002)
    [w] = tb.writes(version=12)
    assert w.steps == 10 and w.admitted == 1 and w.dropped == 0
    assert w.row_ids.tolist() == [1, 9]  # 5 was loaded but never touched: not rewritten
    records = np.frombuffer(w.rows, dtype=row_dtype(spec))
    assert records["version"].tolist() == [12, 12] and records["written_ms"].tolist() == [1002, 1002]
    # row 1: adagrad twice (acc 1 then 2); row 9 born at its initial value, one step
    assert records["values"][0] == pytest.approx(1.0 - 1.0 - 1 / 2 ** 0.5)
    np.testing.assert_allclose(records["values"][1], initial_rows(spec, ids[2:])[0] - 1.0, rtol=1e-6)
    assert records["state"][:, 0].tolist() == [2.0, 1.0]
    assert w.seen_ids.size == 0 and w.unseen_ids.size == 0


def test_admission_drops_and_counts_until_an_id_was_seen_often_enough() -> None:
    spec = TableSpec("t", 2, admit_after=3)
    ids = np.array([4, 8], dtype=np.int64)
    tb = RowBatch.load([spec], {"t": _loaded(spec, ids, seen={8: 1})}, {"t": 0})
    g = np.ones((2, 2), dtype=np.float32)
    tb.apply([(("t",), {"t": RowGrads("t", ids, g)})], now_ms=50)  # 4: seen once, dropped; 8: twice, dropped
    [w] = tb.writes(version=1)
    assert (w.admitted, w.dropped) == (0, 2) and w.row_ids.size == 0
    assert w.seen_ids.tolist() == [4, 8]
    assert np.frombuffer(w.seen, dtype=np.dtype([("count", "<u4"), ("seen_ms", "<u8")]))["count"].tolist() == [1, 2]
    tb.apply([(("t",), {"t": RowGrads("t", ids, g)})], now_ms=60)  # 4: twice, dropped; 8: three times, admitted
    [w] = tb.writes(version=2)
    assert (w.admitted, w.dropped) == (1, 3)  # counted over the batch's life
    assert w.row_ids.tolist() == [8] and w.seen_ids.tolist() == [4] and w.unseen_ids.tolist() == [8]
    born = np.frombuffer(w.rows, dtype=row_dtype(spec))[0]
    assert not np.array_equal(born["values"], initial_rows(spec, ids[1:])[0])  # the admitting gradient applied
    assert w.steps == 2


def test_a_batch_of_many_tables_applies_like_one_update_after_another() -> None:
    """Several tables and updates in one RowBatch (rounds over each row's gradients) give, bit for bit,
    what one table and one update at a time give."""
    specs = [TableSpec(f"t{j}", 3, admit_after=2) for j in range(3)]
    rng = np.random.default_rng(5)
    updates = []
    for _ in range(6):
        named = tuple(s.name for s in specs if rng.random() < 0.8)
        parts = {}
        for name in named:
            ids = np.unique(rng.integers(0, 12, 5)).astype(np.int64)
            parts[name] = RowGrads(name, ids, rng.standard_normal((ids.size, 3)).astype(np.float32))
        updates.append((named, parts))
    every = {s.name: np.arange(12, dtype=np.int64) for s in specs}
    loaded = {s.name: _loaded(s, every[s.name], rows={1: np.ones(3)}, seen={2: 1}) for s in specs}
    together = RowBatch.load(specs, loaded, {"t0": 3})
    together.apply(updates, now_ms=7)
    one_by_one = [RowBatch.load([s], {s.name: loaded[s.name]}, {"t0": 3}) for s in specs]
    for u in updates:
        for rb in one_by_one:
            rb.apply([u], now_ms=7)
    want = [w for rb in one_by_one for w in rb.writes(9)]
    got = together.writes(9)
    assert [w.table for w in got] == [w.table for w in want]
    for a, b in zip(got, want, strict=True):
        assert (a.rows, a.seen, a.steps, a.admitted, a.dropped) == (b.rows, b.seen, b.steps, b.admitted, b.dropped)
        assert a.row_ids.tolist() == b.row_ids.tolist() and a.unseen_ids.tolist() == b.unseen_ids.tolist()
    assert sum(w.admitted for w in got) > 0 and sum(w.dropped for w in got) > 0


def test_ids_packed_at_once_are_the_bytes_redis_py_would_send() -> None:
    from redis._parsers import Encoder
    from redis.connection import PythonRespSerializer

    from services.resp import PackedArgs, Packer

    encode = Encoder("utf-8", "strict", False).encode
    ids = np.array([0, 1, -1, 2**62, 256], dtype=np.int64)
    fields = list(ids.astype("<i8").view("V8").tolist())
    want = b"".join(PythonRespSerializer(6000, encode).pack("HMGET", "st:{j:g0}:rows:t", *fields))
    got = b"".join(Packer(6000, encode).pack("HMGET", "st:{j:g0}:rows:t", PackedArgs.ids(ids)))
    assert got == want
    assert Packer(6000, encode).pack("GET", "k") == PythonRespSerializer(6000, encode).pack("GET", "k")
    assert repr(PackedArgs.ids(ids)) == "<5 packed arguments>"
    # field/value pairs (an apply's rows): each ID, then its record, as redis-py would send them
    records = bytes(range(5 * 13))
    pairs = [x for k, f in enumerate(fields) for x in (f, records[13 * k:13 * (k + 1)])]
    want = b"".join(PythonRespSerializer(6000, encode).pack("HSET", "st:{j:g0}:rows:t", *pairs))
    got = b"".join(Packer(6000, encode).pack("HSET", "st:{j:g0}:rows:t", PackedArgs.pairs(ids, records, 13)))
    assert got == want and PackedArgs.pairs(ids, records, 13).count == 10
    with pytest.raises(ValueError, match="64 bytes of records for 5 IDs of 13 bytes"):
        PackedArgs.pairs(ids, records[:64], 13)
