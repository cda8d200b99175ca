"""Tables that store their rows in fewer bytes (``value_dtype`` float16 or bfloat16): the encoding
(round to nearest even, NaN and infinities, bfloat16 bit for bit as torch's), the server's apply
against the float32 math within the type's rounding, and float16 tables through a checkpoint (bit for
bit), an export and the feed (float32 values equal to the stored ones decoded), on the real Redis."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import redis as redis_lib
import safetensors
import safetensors.numpy
import torch
from test_services_snapshot_tables import tables_state
from test_services_tables import batch_rows, expected_rows, setup, stored

from common.keys import JobKeys
from services import ParameterServer, Pusher, ServerSettings, restore_checkpoint, save_checkpoint
from services.snapshot.checkpoint_tables import tables_folder
from services.snapshot.table_export import export_tables
from services.tables import RowOptimizerConfig, TableSpec, tables_from_json, tables_to_json
from services.tables.apply import kinds
from services.tables.feed import read_changes
from services.tables.rows import decode, decode_values, encode, pull_dtype, row_dtype
from services.tables.store import pull_rows
from trainers.ranking import dlrm_from_options

UPDATES = 8


def narrow(value_dtype: str) -> tuple[TableSpec, TableSpec]:
    """A lazy Adam and an Adagrad table (admitting after two sightings) storing ``value_dtype``."""
    return (TableSpec("user", 4, optimizer=RowOptimizerConfig("lazyadam", lr=0.05), value_dtype=value_dtype),
            TableSpec("item", 2, optimizer=RowOptimizerConfig("adagrad", lr=0.1), admit_after=2,
                      value_dtype=value_dtype))


def torch_round(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back, by torch (the reference the encoder is held to)."""
    if dtype == "float32":
        return x
    return torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, dtype)).float().numpy()


def specials() -> np.ndarray:
    """float32 values that exercise the rounding: every tie, the largest finite, subnormals, zeros,
    infinities, NaNs, and random values across float32's whole range."""
    rng = np.random.default_rng(7)
    random = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)  # bf16 ties
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4028235e38, -3.4028235e38, 1e-45, 1e-40,
                      65504.0, 65519.0, 65520.0, 6e-8, 2.9e-8, 3.1e-8, 1e-8, 1e-4, 0.05, -0.05], dtype=np.float32)
    return np.concatenate([random, ties.view(np.float32), edges])


# -- the encoding (pure) ---------------------------------------------------------------------------

def test_bfloat16_is_torchs_bit_for_bit_rounding_to_nearest_even() -> None:
    x = specials()
    got = encode(x, "bfloat16")
    assert got.dtype == np.uint16
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert (got[nan] == 0x7FC0).all()  # one quiet NaN, as c10::BFloat16 has it
    back = decode(got, "bfloat16")
    assert back.dtype == np.float32 and np.isnan(back[nan]).all()
    np.testing.assert_array_equal(back[~nan], torch_round(x[~nan], "bfloat16"))
    # ties go to the even neighbour: 1 + 2**-8 sits between 1 and 1 + 2**-7
    assert decode(encode(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32), "bfloat16"), "bfloat16").tolist() == \
        [1.0, 1 + 2**-6]
    # beyond the largest finite bfloat16 (float32's largest rounds up): infinity of the sign
    assert decode(encode(np.array([3.4028235e38, -3.4028235e38], np.float32), "bfloat16"), "bfloat16").tolist() \
        == [np.inf, -np.inf]
    # every bfloat16 reads back exactly
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    finite = ~np.isnan(decode(every, "bfloat16"))
    np.testing.assert_array_equal(encode(decode(every, "bfloat16"), "bfloat16")[finite], every[finite])


def test_float16_rounds_to_nearest_even_overflows_to_infinity_and_keeps_nan() -> None:
    x = specials()
    got = encode(x, "float16")
    assert got.dtype == np.float16
    want = torch.from_numpy(x).half().numpy()
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
    assert np.isnan(got[nan]).all()
    # 2**-25, half the smallest subnormal, is a tie: to the even neighbour, zero
    assert decode(encode(np.array([65519.0, 65520.0, -1e6, 1e-8, 2.0**-25, 3.1e-8], np.float32), "float16"),
                  "float16").tolist() == [65504.0, np.inf, -np.inf, 0.0, 0.0, 2.0**-24]
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.isfinite(every)
    np.testing.assert_array_equal(encode(decode(every, "float16"), "float16")[finite].view(np.uint16),
                                  every[finite].view(np.uint16))


def test_a_float32_table_is_stored_as_before() -> None:
    x = specials()
    assert encode(x, "float32").tobytes() == x.tobytes() and decode(x, "float32").tobytes() == x.tobytes()
    spec = TableSpec("t", 16)
    assert row_dtype(spec).itemsize == 208 and pull_dtype(spec).itemsize == 72
    assert "value_dtype" not in spec.to_dict()  # a float32 table's meta is as it always was
    with pytest.raises(ValueError, match="no stored type 'int8'"):
        encode(x, "int8")


def test_value_dtype_is_validated_stored_in_the_meta_and_fixes_the_record() -> None:
    with pytest.raises(ValueError, match=r"table t: value_dtype must be one of float32, float16, bfloat16, got 'fp8'"):
        TableSpec("t", 4, value_dtype="fp8")
    adam, adagrad = RowOptimizerConfig("lazyadam"), RowOptimizerConfig("adagrad")
    for dtype, adam_bytes, adagrad_bytes in (("float32", 208, 84), ("float16", 112, 52), ("bfloat16", 112, 52)):
        a, g = TableSpec("a", 16, optimizer=adam, value_dtype=dtype), TableSpec("g", 16, optimizer=adagrad,
                                                                                 value_dtype=dtype)
        assert row_dtype(a).itemsize == adam_bytes and row_dtype(g).itemsize == adagrad_bytes
        assert pull_dtype(a).itemsize == 8 + 16 * (4 if dtype == "float32" else 2)
        # Adam's m and v of a narrow table as bfloat16 (float32's range); Adagrad's one sum as float32
        assert a.state_dtype == ("float32" if dtype == "float32" else "bfloat16") and g.state_dtype == "float32"
        assert tables_from_json(json.dumps(tables_to_json([a, g]))) == (a, g)
    # tables of one shape but another stored type are applied apart (their records differ)
    assert len(kinds([TableSpec("x", 4), TableSpec("y", 4, value_dtype="float16")])) == 2
    model = dlrm_from_options({"features": "2", "dense": "0", "value_dtype": "bfloat16"})
    assert {t.value_dtype for t in model.tables} == {"bfloat16"}
    with pytest.raises(ValueError, match="dlrm option value_dtype: one of float32, float16, bfloat16, got 'half'"):
        dlrm_from_options({"value_dtype": "half"})


# -- the server's apply, on the real Redis ---------------------------------------------------------

def push(redis: redis_lib.Redis, job: str, tables: tuple[TableSpec, ...], clocks: range) -> None:
    pusher = Pusher(redis, job, "a", row_dtype="float32")
    for c in clocks:
        pusher.push(None, generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                    samples=[("prod", 10 * (c - 1), 10)], batch_size=10, rows=batch_rows(c, tables))


def run_servers(redis: redis_lib.Redis, url: str, job: str, groups: int, batch: int) -> None:
    """Apply every pending update with one synchronous server per group."""
    servers = [ParameterServer(ServerSettings(redis_url=url, job=job, group=g, groups=groups, block_ms=1,
                                              batch=batch, persist_every=1000), client=redis) for g in range(groups)]
    try:
        for s in servers:
            s.load()
            while s.step():
                pass
    finally:
        for s in servers:
            s.close()


@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 16])
def test_the_apply_of_a_narrow_table_is_the_float32_math_rounded_at_each_step(
        redis: redis_lib.Redis, redis_url: str, value_dtype: str, batch: int) -> None:
    tables, job, groups = narrow(value_dtype), f"narrow-{value_dtype}", 2
    setup(redis, job=job, groups=groups, tables=tables)
    push(redis, job, tables, range(1, UPDATES + 1))
    run_servers(redis, redis_url, job, groups, batch)
    exact = expected_rows(range(1, UPDATES + 1), tables, rounding=torch_round)  # rounded by torch at each step
    f32 = expected_rows(range(1, UPDATES + 1), tables)
    # the stored type's rounding: 2**-11 (float16) or 2**-8 (bfloat16) of a value, per step at most
    rel = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[value_dtype] * UPDATES * 4
    for spec in tables:
        got = stored(redis, job, spec, groups)
        assert sorted(got) == sorted(exact[spec.name]) and got
        records = [v for g in range(groups) for v in redis.hvals(JobKeys(job).group(g).table_rows(spec.name))]
        assert {len(v) for v in records} == {row_dtype(spec).itemsize}
        ids = np.array(sorted(got), dtype=np.int64)
        pulled = pull_rows(redis, job, {spec.name: spec}, groups, {spec.name: ids}).tables[spec.name]
        assert pulled.values.dtype == np.float32
        for k, i in enumerate(ids.tolist()):
            values = decode_values(spec, got[i]["values"])
            # bit for bit the one-by-one math, rounded as stored after every step, whatever the batch
            assert values.tobytes() == exact[spec.name][i].tobytes(), (spec.name, i)
            assert pulled.values[k].tobytes() == values.tobytes()
            np.testing.assert_allclose(values, f32[spec.name][i], rtol=rel, atol=rel * spec.init_scale)


# -- float16 tables through checkpoints, exports and the feed --------------------------------------

def test_float16_tables_round_trip_through_a_checkpoint_an_export_and_the_feed(
        redis: redis_lib.Redis, redis_url: str, fresh: tuple[redis_lib.Redis, str], tmp_path: Path) -> None:
    tables, job, groups = narrow("float16"), "narrowsaved", 2
    setup(redis, job=job, groups=groups, tables=tables)
    push(redis, job, tables, range(1, UPDATES + 1))
    run_servers(redis, redis_url, job, groups, batch=4)
    before = tables_state(redis, job, tables, groups)

    # checkpoint: the records as stored, restored bit for bit
    path = tmp_path / "narrow.pt"
    save_checkpoint(redis, job, str(path), rows_per_piece=3)
    listed = json.loads((Path(tables_folder(str(path))) / "manifest.json").read_text())
    for entry in listed["tables"]:
        spec = next(t for t in tables if t.name == entry["table"])
        assert entry["rows"]["record_bytes"] == row_dtype(spec).itemsize
        first = Path(tables_folder(str(path))) / entry["rows"]["pieces"][0]["file"]
        with safetensors.safe_open(str(first), framework="numpy") as f:
            assert f"values <f2[{spec.dim}]" in f.metadata()["streamtrain.record"]
    fresh_client, _ = fresh
    restore_checkpoint(fresh_client, str(path))
    assert tables_state(fresh_client, job, tables, groups) == before

    # export: float32 values, the stored values decoded
    folder = tmp_path / "tables"
    export_tables(redis, job, str(folder), rows_per_piece=4)
    manifest = json.loads((folder / "manifest.json").read_text())
    for spec, table in zip(tables, manifest["tables"], strict=True):
        want = stored(redis, job, spec, groups)
        got: dict[int, np.ndarray] = {}
        for p in table["pieces"]:
            tensors = safetensors.numpy.load_file(str(folder / p["file"]))
            assert tensors["values"].dtype == np.float32
            got.update(zip(tensors["ids"].tolist(), tensors["values"], strict=True))
        assert sorted(got) == sorted(want) and want
        for i, rec in want.items():
            assert got[i].tobytes() == rec["values"].astype(np.float32).tobytes(), (spec.name, i)

    # the feed: every row written, float32, as stored
    changes = read_changes(redis, job, tables, (0,) * groups)
    for spec in tables:
        want = stored(redis, job, spec, groups)
        part = changes.tables[spec.name]
        assert part.values.dtype == np.float32
        fed = dict(zip(part.ids.tolist(), part.values, strict=True))
        assert sorted(fed) == sorted(want)
        for i, rec in want.items():
            assert fed[i].tobytes() == rec["values"].astype(np.float32).tobytes(), (spec.name, i)
