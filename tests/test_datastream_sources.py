"""Sources: every built-in kind, plug-ins, the split convention and spec errors."""

from __future__ import annotations

import io
import itertools
import json
import sys
import types

import numpy as np
import pytest

from datastream.examples import Examples
from datastream.producer import iter_shards
from datastream.sources import TEST_EVERY, Source, SourceError, load_source, split_mask


def test_digits_and_the_split_convention() -> None:
    x_all, y_all = load_source("digits").read()
    assert x_all.shape == (1797, 64) and x_all.dtype == np.float32 and y_all.dtype == np.int64
    assert x_all.min() >= 0.0 and x_all.max() <= 1.0
    x_tr, _ = load_source("digits", split="train").read()
    x_te, y_te = load_source("digits", split="test").read()
    assert len(x_tr) + len(x_te) == 1797 and len(x_te) == 1797 // TEST_EVERY
    np.testing.assert_array_equal(x_te, x_all[TEST_EVERY - 1::TEST_EVERY])
    np.testing.assert_array_equal(y_te, y_all[TEST_EVERY - 1::TEST_EVERY])
    # a repeated pass restarts the numbering: the same records are held out each time
    x2, _ = load_source("digits?repeat=2", split="test").read()
    np.testing.assert_array_equal(x2, np.concatenate([x_te, x_te]))
    assert split_mask(0, 10, "all") is None
    assert split_mask(3, 4, "test").tolist() == [False, True, False, False]


def test_synthetic_is_seeded_unbounded_and_both_tasks() -> None:
    a = load_source("synthetic?seed=3&features=5&classes=3").read(limit=3000)
    b = load_source("synthetic?seed=3&features=5&classes=3").read(limit=3000)
    np.testing.assert_array_equal(a.x, b.x)
    assert a.x.shape == (3000, 5) and set(np.unique(a.y)) == {0, 1, 2}
    c = load_source("synthetic?seed=4&features=5&classes=3").read(limit=10)
    assert not np.array_equal(a.x[:10], c.x)
    xr, yr = load_source("synthetic?task=regression&features=2&limit=50").read()
    assert xr.shape == (50, 2) and yr.dtype == np.float32
    unbounded = iter(load_source("synthetic"))
    assert sum(len(x) for x, _ in itertools.islice(unbounded, 20)) == 20 * 1024
    test_only, _ = load_source("synthetic?seed=3&features=5&classes=3&limit=3000", split="test").read()
    np.testing.assert_array_equal(test_only, a.x[TEST_EVERY - 1::TEST_EVERY])


def test_files(tmp_path) -> None:
    (tmp_path / "d.csv").write_text("a,b,label\n1,2,0\n3,4,1\n\n5,6,1\n")
    x, y = load_source(f"csv:{tmp_path / 'd.csv'}").read()
    np.testing.assert_array_equal(x, [[1, 2], [3, 4], [5, 6]])
    assert y.tolist() == [0, 1, 1] and y.dtype == np.int64
    x, y = load_source(f"{tmp_path / 'd.csv'}?label=a").read()
    np.testing.assert_array_equal(x, [[2, 0], [4, 1], [6, 1]])
    (tmp_path / "r.csv").write_text("0.5,1,2.25\n")
    x, y = load_source(f"csv:{tmp_path / 'r.csv'}?label=first").read()
    assert x.tolist() == [[1.0, 2.25]] and y.dtype == np.float32 and y.tolist() == [0.5]

    np.savez(tmp_path / "d.npz", feats=np.ones((4, 3)), labels=np.array([0.1, 0.2, 0.3, 0.4]))
    x, y = load_source(f"npz:{tmp_path / 'd.npz'}?x=feats&y=labels").read()
    assert x.shape == (4, 3) and x.dtype == np.float32 and y.dtype == np.float32
    with pytest.raises(SourceError, match="needs arrays 'x' and 'y'"):
        load_source(f"npz:{tmp_path / 'd.npz'}").read()

    lines = [json.dumps({"x": [i, i + 1], "y": i % 2}) for i in range(2500)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    x, y = load_source(f"{tmp_path / 'd.jsonl'}", split="test").read()
    assert len(x) == 500 and x[0].tolist() == [4, 5] and y.dtype == np.int64
    (tmp_path / "bad.jsonl").write_text('{"x": [1], "y": 0}\n{"x": [1]}\n')
    with pytest.raises(SourceError, match="line 2"):
        load_source(f"jsonl:{tmp_path / 'bad.jsonl'}").read()
    (tmp_path / "bad.csv").write_text("1,2\n3,x\n")
    with pytest.raises(SourceError, match="only numbers"):
        load_source(f"csv:{tmp_path / 'bad.csv'}").read()


def test_stdin_is_streamed() -> None:
    text = "".join(json.dumps({"x": [i, 0], "y": i}) + "\n" for i in range(7))
    blocks = list(load_source("stdin", stdin=io.StringIO(text)))
    assert len(blocks) == 7  # one record at a time: a pipe is a live stream
    x, y = load_source("stdin", split="test", stdin=io.StringIO(text)).read()
    assert x[:, 0].tolist() == [4] and y.tolist() == [4]
    x, y = load_source("stdin?format=csv", stdin=io.StringIO("f,label\n1,2\n3,4\n")).read()
    assert x.tolist() == [[1], [3]] and y.tolist() == [2, 4]


def test_plugin_sources(monkeypatch) -> None:
    mod = types.ModuleType("my_plugin_source")
    mod.records = lambda n="3": ((np.array([i, i]), i % 2) for i in range(int(n)))
    mod.blocks = lambda: iter([(np.zeros((4, 2)), np.arange(4))])
    mod.made = lambda: load_source("digits", split="train")
    mod.broken = lambda: iter([1, 2])
    monkeypatch.setitem(sys.modules, "my_plugin_source", mod)
    x, y = load_source("my_plugin_source:records?n=6").read()
    assert x.shape == (6, 2) and y.tolist() == [0, 1, 0, 1, 0, 1]
    assert load_source("my_plugin_source:blocks").read().x.shape == (4, 2)
    assert len(load_source("my_plugin_source:made").read()) == 1797 - 1797 // 5
    with pytest.raises(SourceError, match=r"\(x, y\) pairs"):
        load_source("my_plugin_source:broken").read()
    with pytest.raises(SourceError, match="cannot load 'nope'"):
        load_source("my_plugin_source:nope")


@pytest.mark.parametrize("spec,message", [
    ("nothing", "unknown source"), ("digits?color=red", "unknown option"),
    ("synthetic?task=ranking", "classification or regression"), ("synthetic?features=0", ">= 1"),
    ("synthetic?seed=x", "not an integer"), ("csv:/no/such.csv", "no such file"),
    ("no_such_module_xyz:fn", "cannot load"), ("stdin?format=xml", "jsonl or csv")])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(SourceError, match=message):
        load_source(spec)


def test_bad_split() -> None:
    with pytest.raises(SourceError, match="split"):
        load_source("digits", split="validation")
    with pytest.raises(SourceError, match="split"):
        Source("x", lambda: iter([]), split="dev")


def test_iter_shards_rechunks_exactly() -> None:
    src = load_source("synthetic?features=3&limit=2500")
    shards = list(iter_shards(src, 1000))
    assert [len(x) for x, _ in shards] == [1000, 1000, 500]
    np.testing.assert_array_equal(np.concatenate([x for x, _ in shards]), src.read().x)
    assert [len(x) for x, _ in iter_shards(src, 300, limit=700)] == [300, 300, 100]
    with pytest.raises(ValueError, match="shard_size"):
        next(iter_shards(src, 0))


def test_labels_may_not_change_kind_mid_stream() -> None:
    blocks = [(0, Examples(np.zeros((2, 1), np.float32), np.array([0, 1]))),
              (2, Examples(np.zeros((2, 1), np.float32), np.array([0.5, 1.5], np.float32)))]
    with pytest.raises(SourceError, match="labels changed from int64 to float32"):
        list(iter_shards(Source("mixed", lambda: iter(blocks)), 10))
