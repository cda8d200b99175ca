"""Sources of training records, named by a spec string (``NAME[:ARG][?key=value&...]``).

:func:`load_source` turns a spec into a :class:`Source` of one split: the built-in data sets, files,
standard input or a plug-in ``package.module:callable``, each yielding :class:`~datastream.examples.Examples`
block by block; record *i* is held out when ``i % 5 == 4`` (a source in time order holds out its
last records). See docs/records.md, *Sources* and *Train/test split*.
"""

from __future__ import annotations

import csv
import importlib
import itertools
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from common.options import SpecOptions, split_spec

from .clicks import ClickStream
from .examples import Examples
from .jagged import Jagged
from .movielens import MovieLensMissing, load_movielens, time_split_mask
from .records import DecodeError, parse_ids

__all__ = ["SPLITS", "Block", "Source", "SourceError", "TEST_EVERY", "load_source", "split_mask"]

logger = logging.getLogger(__name__)

SPLITS = ("train", "test", "all")
"""Split names accepted by :func:`load_source`."""

TEST_EVERY = 5
"""Record *i* of a source is in the test split when ``i % TEST_EVERY == TEST_EVERY - 1``."""

_BLOCK = 1024

Block = tuple[int, Examples]
"""(index of the first record in the source's numbering, its examples: x [n, d], y [n], ids)."""

SplitRule = Callable[[int, int, str], "np.ndarray | None"]
"""``rule(start, n, split)``: the mask of ``split`` among records ``start .. start+n-1`` (as :func:`split_mask`)."""


class SourceError(ValueError):
    """A source spec or its data is invalid; the message names the problem."""


def split_mask(start: int, n: int, split: str) -> np.ndarray | None:
    """Boolean mask selecting ``split`` among records ``start .. start+n-1``; ``None`` keeps all."""
    if split == "all":
        return None
    is_test = (np.arange(start, start + n) % TEST_EVERY) == TEST_EVERY - 1
    return is_test if split == "test" else ~is_test


def _labels(y: np.ndarray, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.dtype.kind in "iub":
        return y.astype(np.int64)
    if y.dtype.kind != "f":
        raise SourceError(f"{where}: labels must be numbers, got dtype {y.dtype}")
    if np.isfinite(y).all() and (y == np.round(y)).all():
        return y.astype(np.int64)
    return y.astype(np.float32)


def _features(x: Any, where: str, *, with_ids: bool = False) -> np.ndarray:
    """float32 ``[n, d]``; ``d`` may be 0 only for records that carry IDs."""
    try:
        arr = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise SourceError(f"{where}: features must be numbers ({exc})") from None
    if arr.ndim != 2 or (arr.shape[1] == 0 and not with_ids):
        raise SourceError(f"{where}: features must be [n, d] with d > 0 (or records with ids), "
                          f"got shape {arr.shape}")
    return arr


class Source:
    """An iterable of :class:`~datastream.examples.Examples` blocks restricted to one split.

    Features are float32 ``[n, d]``; labels int64 (classification) or float32 (regression);
    ``ids`` the categorical features, empty for dense sources.
    """

    def __init__(self, name: str, blocks: Callable[[], Iterator[Block]], split: str = "all",
                 rule: SplitRule = split_mask) -> None:
        if split not in SPLITS:
            raise SourceError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
        self.name = name
        self.split = split
        self._blocks = blocks
        self._rule = rule

    def __repr__(self) -> str:
        return f"Source({self.name!r}, split={self.split!r})"

    def __iter__(self) -> Iterator[Examples]:
        for start, block in self._blocks():
            mask = self._rule(start, len(block), self.split)
            if mask is not None:
                block = block.take(mask)
            if len(block):
                yield block

    def read(self, limit: int | None = None) -> Examples:
        """All examples of the split (at most ``limit``) at once; needs a bounded source or a limit.

        Dense-only examples unpack as ``x, y = source.read()``; see :class:`Examples`.
        """
        parts, n = [], 0
        for block in self:
            if limit is not None and n + len(block) > limit:
                block = block.slice(0, limit - n)
            parts.append(block)
            n += len(block)
            if limit is not None and n >= limit:
                break
        if not parts:
            raise SourceError(f"source {self.name} has no records in split {self.split!r}")
        try:
            return Examples.concat(parts)
        except ValueError as exc:
            raise SourceError(f"source {self.name}: blocks disagree ({exc})") from None


def _digits(opts: SpecOptions) -> Callable[[], Iterator[Block]]:
    repeat = opts.integer("repeat", 1)
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)

    def blocks() -> Iterator[Block]:
        for _ in (itertools.count() if repeat == 0 else range(repeat)):
            yield 0, Examples(x, y)
    return blocks


def _synthetic(opts: SpecOptions) -> Callable[[], Iterator[Block]]:
    task = opts.text("task", "classification")
    if task not in ("classification", "regression"):
        raise SourceError(f"synthetic task must be classification or regression, got {task!r}")
    d = opts.integer("features", 16, lo=1)
    k = opts.integer("classes", 4, lo=2)
    seed = opts.integer("seed", 0)
    limit = opts.integer("limit", None)
    noise = opts.number("noise", 0.1)

    def blocks() -> Iterator[Block]:
        rng = np.random.default_rng(seed)
        teacher = rng.standard_normal((d, k if task == "classification" else 1)).astype(np.float32)
        start = 0
        while limit is None or start < limit:
            n = _BLOCK if limit is None else min(_BLOCK, limit - start)
            x = rng.standard_normal((n, d), dtype=np.float32)
            out = x @ teacher + noise * rng.standard_normal((n, teacher.shape[1]), dtype=np.float32)
            y = out.argmax(axis=1).astype(np.int64) if task == "classification" else out[:, 0]
            yield start, Examples(x, y)
            start += n
    return blocks


def _clicks(opts: SpecOptions) -> Callable[[], Iterator[Block]]:
    defaults = ClickStream()
    try:
        stream = ClickStream(
            features=opts.integer("features", defaults.features), dense=opts.integer("dense", defaults.dense),
            vocab=opts.integer("vocab", defaults.vocab, lo=1), zipf=opts.number("zipf", defaults.zipf),
            multi=opts.integer("multi", defaults.multi), drift=opts.number("drift", defaults.drift),
            seed=opts.integer("seed", defaults.seed))
    except ValueError as exc:
        raise SourceError(f"clicks: {exc}") from None
    limit = opts.integer("limit", None)
    return lambda: stream.blocks(limit)


def _movielens(opts: SpecOptions) -> tuple[Callable[[], Iterator[Block]], SplitRule]:
    repeat = opts.integer("repeat", 1)
    limit = opts.integer("limit", None, lo=1)
    try:
        data = load_movielens()
    except MovieLensMissing as exc:
        raise SourceError(f"source movielens: {exc}") from None
    if limit is not None:
        data = data.first(limit)
    total = len(data)
    return (lambda: data.blocks(repeat)), (lambda start, n, split: time_split_mask(start, n, split, total))


def _table(rows: list[list[str]], label: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    header = None
    if rows:
        try:
            [float(v) for v in rows[0]]
        except ValueError:
            header, rows = rows[0], rows[1:]
    if not rows:
        raise SourceError(f"{where}: no data rows")
    if label in ("last", "first"):
        col = -1 if label == "last" else 0
    elif header is not None and label in header:
        col = header.index(label)
    else:
        raise SourceError(f"{where}: label column {label!r} not found (header: {header})")
    try:
        table = np.array(rows, dtype=np.float64)
    except ValueError as exc:
        raise SourceError(f"{where}: rows must hold only numbers of equal count ({exc})") from None
    y = table[:, col]
    x = np.delete(table, col if col >= 0 else table.shape[1] - 1, axis=1)
    return _features(x, where), _labels(y, where)


def _csv_file(path: Path, opts: SpecOptions) -> Callable[[], Iterator[Block]]:
    label = opts.text("label", "last")

    def blocks() -> Iterator[Block]:
        with path.open(newline="") as fh:
            rows = [r for r in csv.reader(fh) if r]
        x, y = _table(rows, label, str(path))
        yield 0, Examples(x, y)
    return blocks


def _npz_file(path: Path, opts: SpecOptions) -> Callable[[], Iterator[Block]]:
    xkey, ykey = opts.text("x", "x"), opts.text("y", "y")

    def blocks() -> Iterator[Block]:
        with np.load(path, allow_pickle=False) as data:
            if xkey not in data or ykey not in data:
                raise SourceError(f"{path}: needs arrays {xkey!r} and {ykey!r}; has {sorted(data)}")
            x, y = _features(data[xkey], str(path)), _labels(data[ykey], str(path))
        if y.shape != (x.shape[0],):
            raise SourceError(f"{path}: y must be [{x.shape[0]}], got {y.shape}")
        yield 0, Examples(x, y)
    return blocks


def _examples(xs: list[Any], ys: list[Any], ids: list[dict[str, list[int]]], where: str) -> Examples:
    """A block of JSON-lines records; a record without one of the block's ID features has none of it."""
    names = sorted({name for rec in ids for name in rec})
    columns = {name: Jagged.from_lists([rec.get(name, []) for rec in ids]) for name in names}
    return Examples(_features(xs, where, with_ids=bool(names)), _labels(np.array(ys), where), columns)


def _json_lines(lines: Iterable[str], where: str, block: int) -> Iterator[Block]:
    start, xs, ys, ids = 0, [], [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if "ids" not in obj and "x" not in obj:
                raise KeyError("x")
            ys.append(obj["y"])
            ids.append(parse_ids(obj["ids"]) if "ids" in obj else {})
            xs.append(obj.get("x", []))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SourceError(f"{where} line {lineno}: expected {{\"x\": [...], \"y\": ..., \"ids\": {{...}}}} "
                              f"({exc})") from None
        except DecodeError as exc:
            raise SourceError(f"{where} line {lineno}: {exc}") from None
        if len(xs) >= block:
            yield start, _examples(xs, ys, ids, where)
            start, xs, ys, ids = start + len(xs), [], [], []
    if xs:
        yield start, _examples(xs, ys, ids, where)


def _jsonl_file(path: Path, opts: SpecOptions) -> Callable[[], Iterator[Block]]:
    def blocks() -> Iterator[Block]:
        with path.open() as fh:
            yield from _json_lines(fh, str(path), _BLOCK)
    return blocks


def _stdin(opts: SpecOptions, stream: TextIO | None = None) -> Callable[[], Iterator[Block]]:
    fmt = opts.text("format", "jsonl")
    label = opts.text("label", "last")
    if fmt not in ("jsonl", "csv"):
        raise SourceError(f"stdin format must be jsonl or csv, got {fmt!r}")

    def blocks() -> Iterator[Block]:
        fh = stream if stream is not None else sys.stdin
        if fmt == "jsonl":
            yield from _json_lines(fh, "stdin", 1)  # one line at a time: stdin is a live stream
            return
        start, header_seen = 0, False
        for row in csv.reader(fh):
            if not row:
                continue
            if not header_seen:
                header_seen = True
                try:
                    [float(v) for v in row]
                except ValueError:
                    continue
            x, y = _table([row], label, "stdin")
            yield start, Examples(x, y)
            start += 1
    return blocks


def _plugin(target: str, opts: SpecOptions) -> Callable[[], Iterator[Block]]:
    module_name, _, attr = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SourceError(f"source {target!r}: cannot load {attr!r} from {module_name!r} ({exc})") from None
    kwargs = opts.rest()

    def blocks() -> Iterator[Block]:
        made = fn(**kwargs)
        if isinstance(made, Source):  # already blocks; its own split applies first
            start = 0
            for block in made:
                yield start, block
                start += len(block)
            return
        start = 0
        for item in made:
            block = _plugin_block(target, item)
            yield start, block
            start += len(block)
    return blocks


def _plugin_block(target: str, item: Any) -> Examples:
    """One ``(x, y)`` or ``(x, y, ids)`` item of a plug-in as examples."""
    if not isinstance(item, tuple | list) or len(item) not in (2, 3):
        raise SourceError(f"source {target!r} must yield (x, y) pairs or (x, y, ids) triples, "
                          f"got {type(item).__name__}")
    x, y, ids = np.asarray(item[0]), item[1], item[2] if len(item) == 3 else {}
    if not isinstance(ids, Mapping):
        raise SourceError(f"source {target!r}: ids must be a map of feature name to IDs")
    if x.ndim == 1:  # one record; its ids as in the JSON record
        x, y = x[None, :], np.asarray([y])
        try:
            ids = {name: Jagged.from_lists([v]) for name, v in parse_ids(dict(ids)).items()}
        except DecodeError as exc:
            raise SourceError(f"source {target!r}: {exc}") from None
    elif not all(isinstance(col, Jagged) for col in ids.values()):
        raise SourceError(f"source {target!r}: the ids of a block must be Jagged columns")
    xb, yb = _features(x, target, with_ids=bool(ids)), _labels(np.asarray(y), target)
    if yb.shape != (xb.shape[0],) or any(col.n != len(xb) for col in ids.values()):
        raise SourceError(f"source {target!r}: y and every ID feature must have one entry per row of x")
    return Examples(xb, yb, dict(ids))


_FILES = {"csv": _csv_file, "npz": _npz_file, "jsonl": _jsonl_file}


def one_pass(spec: str) -> str:
    """``spec`` with any ``repeat=`` option removed: one pass of a repeated data set (its held-out
    split is then each held-out record once)."""
    base, _, query = spec.partition("?")
    kept = [kv for kv in query.split("&") if kv and not kv.startswith("repeat=")]
    return base + ("?" + "&".join(kept) if kept else "")


def load_source(spec: str, split: str = "all", *, stdin: TextIO | None = None) -> Source:
    """The source named by ``spec`` (docs/records.md, *Sources*), restricted to ``split``.

    Args:
        spec: e.g. ``"digits"``, ``"synthetic?task=regression&features=8&limit=10000"``,
            ``"clicks?multi=8&limit=1000000"``,
            ``"csv:data.csv?label=target"``, ``"mypkg.data:records"``.
        split: ``"train"``, ``"test"`` or ``"all"``.
        stdin: the text stream for ``stdin`` (default ``sys.stdin``).

    Raises:
        SourceError: unknown source, bad option, missing file or module.
    """
    if split not in SPLITS:
        raise SourceError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    base, given = split_spec(spec)
    opts = SpecOptions(given, SourceError)
    prefix, colon, arg = base.partition(":")
    rule: SplitRule = split_mask
    if base == "digits":
        blocks = _digits(opts)
    elif base == "synthetic":
        blocks = _synthetic(opts)
    elif base == "clicks":
        blocks = _clicks(opts)
    elif base == "movielens":
        blocks, rule = _movielens(opts)
    elif base == "stdin":
        blocks = _stdin(opts, stdin)
    elif (colon and prefix in _FILES) or (not colon and Path(base).suffix[1:] in _FILES):
        kind, path = (prefix, Path(arg)) if colon else (Path(base).suffix[1:], Path(base))
        if not path.is_file():
            raise SourceError(f"source {spec!r}: no such file {path}")
        blocks = _FILES[kind](path, opts)
    elif colon and arg:
        blocks = _plugin(base, opts)
    else:
        raise SourceError(f"unknown source {spec!r}: use digits, synthetic, clicks, movielens, stdin, csv:PATH, "
                          "npz:PATH, jsonl:PATH or module:callable")
    opts.refuse_unread(f"source {spec!r}")
    return Source(spec, blocks, split, rule)
