"""MovieLens-100K replayed in time order as click records (the source ``movielens``).

Read from the files inside the ``recbole`` wheel (nothing is downloaded or copied here): one record per
rating in timestamp order, labelled 1 from :data:`LIKED` up, with the ID features :data:`SINGLE` and
:data:`MULTI` as ``hash_id("<feature>/<value>")``; the last :data:`HELD_OUT` of the events by time are
held out (:func:`time_split_mask`). See docs/recommendation.md, *The data*, *Records* and *The split*.
"""

from __future__ import annotations

import csv
import functools
import importlib.resources
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources.abc import Traversable

import numpy as np

from .examples import Examples
from .jagged import Jagged
from .records import hash_id

__all__ = ["AGE_BUCKETS", "FEATURES", "HELD_OUT", "INSTALL", "LIKED", "MULTI", "PACKAGE", "SINGLE", "ZIP_PREFIX",
           "MovieLens", "MovieLensMissing", "age_bucket", "load_movielens", "time_split_mask", "train_size",
           "year_bucket"]

PACKAGE = "recbole"
"""The package whose ``dataset_example/ml-100k`` holds the files."""

INSTALL = "pip install --no-deps recbole==1.2.1 (scripts/setup.sh does it)"
"""How to install the data set, as the errors say it."""

SINGLE = ("user", "item", "age", "gender", "occupation", "zip", "year")
"""The single-valued categorical features, one ID per record each."""

MULTI = "genres"
"""The multi-hot feature: the movie's genres."""

FEATURES = (*SINGLE, MULTI)
"""Every categorical feature of a record."""

LIKED = 4.0
"""A rating of this or more is a click (label 1)."""

HELD_OUT = 0.1
"""The fraction of the events, the last by time, held out for scoring."""

AGE_BUCKETS = (18, 25, 35, 45, 50, 56)
"""Lower bounds of the age buckets after the first (under 18)."""

ZIP_PREFIX = 2
"""Characters of the zip code kept."""

_DIR = "dataset_example/ml-100k"


class MovieLensMissing(LookupError):
    """The data set's files cannot be found; the message says how to install them."""


@dataclass(frozen=True)
class MovieLens:
    """Every rating of the data set as one record, in time order."""

    examples: Examples
    """The records: ``x`` ``[n, 0]``, ``y`` 0/1, ``ids`` of every feature of :data:`FEATURES`."""
    timestamps: np.ndarray
    """int64 ``[n]``: seconds since the epoch of each rating, non-decreasing."""
    ratings: np.ndarray
    """int64 ``[n]``: the ratings, 1 to 5."""

    def __len__(self) -> int:
        return len(self.examples)

    def first(self, n: int) -> MovieLens:
        """The first ``n`` ratings by time (all of them when ``n`` is larger)."""
        n = min(n, len(self))
        return MovieLens(self.examples.slice(0, n), self.timestamps[:n], self.ratings[:n])

    @property
    def train_size(self) -> int:
        """Records before the held-out part: ``n - n // 10``."""
        return train_size(len(self))

    def blocks(self, passes: int = 1, block: int = 8192) -> Iterator[tuple[int, Examples]]:
        """``(first record, examples)`` of each block, every record in time order, ``passes`` times over
        (0: forever); each pass numbers its records from 0 again."""
        done = 0
        while passes == 0 or done < passes:
            for start in range(0, len(self), block):
                yield start, self.examples.slice(start, min(start + block, len(self)))
            done += 1


def train_size(n: int) -> int:
    """Records of ``n`` that come before the held-out last :data:`HELD_OUT` of them."""
    return n - round(n * HELD_OUT)


def time_split_mask(start: int, n: int, split: str, total: int) -> np.ndarray | None:
    """Boolean mask of ``split`` among records ``start .. start+n-1`` of a replay of ``total`` records
    in time order: ``test`` holds the last :data:`HELD_OUT` of them, ``train`` the rest; ``None`` for
    ``all``."""
    if split == "all":
        return None
    is_test = np.arange(start, start + n) >= train_size(total)
    return is_test if split == "test" else ~is_test


def _dir(package: str) -> Traversable:
    try:
        root = importlib.resources.files(package) / _DIR
    except ModuleNotFoundError:
        raise MovieLensMissing(f"MovieLens-100K comes with the {package!r} package, which is not installed: "
                               f"{INSTALL}") from None
    if not root.is_dir():
        raise MovieLensMissing(f"MovieLens-100K: no {_DIR} in package {package!r}: {INSTALL}")
    return root


def _rows(root: Traversable, name: str) -> tuple[list[str], list[list[str]]]:
    """The header's column names (without their ``:type``) and the rows of one tab-separated file."""
    entry = root / name
    if not entry.is_file():
        raise MovieLensMissing(f"MovieLens-100K: {name} is missing from {root}: {INSTALL}")
    rows = list(csv.reader(entry.read_text(encoding="utf-8").splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE))
    header = [col.split(":")[0] for col in rows[0]]
    return header, [r for r in rows[1:] if r]


def _ids(feature: str, values: list[str]) -> dict[str, int]:
    """Value -> ID of each distinct value of ``feature`` (one hash per distinct value)."""
    return {v: hash_id(f"{feature}/{v}") for v in dict.fromkeys(values)}


def age_bucket(age: int) -> str:
    """The bucket of an age: ``"<18"``, ``"18"``, ``"25"``, ... ``"56"`` (each the bucket's lower bound)."""
    lower = [b for b in AGE_BUCKETS if age >= b]
    return str(lower[-1]) if lower else "<18"


def year_bucket(year: str) -> str:
    """The 5-year bucket of a release year (``"1997"`` -> ``"1995"``), ``"unknown"`` when there is none."""
    return str(int(year) // 5 * 5) if year.strip().isdigit() else "unknown"


@functools.lru_cache(maxsize=2)
def load_movielens(package: str = PACKAGE) -> MovieLens:
    """Every rating of MovieLens-100K as records in time order (read once per process and kept).

    Raises:
        MovieLensMissing: ``package`` is not installed or lacks the files; the message says
            ``pip install --no-deps recbole==1.2.1``.
    """
    root = _dir(package)
    inter_head, inter = _rows(root, "ml-100k.inter")
    user_head, users = _rows(root, "ml-100k.user")
    item_head, items = _rows(root, "ml-100k.item")
    ui, ii, ri, ti = (inter_head.index(c) for c in ("user_id", "item_id", "rating", "timestamp"))
    timestamps = np.array([int(float(r[ti])) for r in inter], np.int64)
    order = np.argsort(timestamps, kind="stable")
    inter = [inter[i] for i in order]

    col = {c: user_head.index(c) for c in ("user_id", "age", "gender", "occupation", "zip_code")}
    user_of = {r[col["user_id"]]: (age_bucket(int(r[col["age"]])), r[col["gender"]], r[col["occupation"]],
                                   r[col["zip_code"]][:ZIP_PREFIX].upper()) for r in users}
    icol = {c: item_head.index(c) for c in ("item_id", "release_year", "class")}
    item_of = {r[icol["item_id"]]: (year_bucket(r[icol["release_year"]] if len(r) > icol["release_year"] else ""),
                                    (r[icol["class"]] if len(r) > icol["class"] else "").split())
               for r in items}

    user_ids, item_ids = [r[ui] for r in inter], [r[ii] for r in inter]
    columns: dict[str, list[str]] = {
        "user": user_ids, "item": item_ids,
        "age": [user_of[u][0] for u in user_ids], "gender": [user_of[u][1] for u in user_ids],
        "occupation": [user_of[u][2] for u in user_ids], "zip": [user_of[u][3] for u in user_ids],
        "year": [item_of[i][0] for i in item_ids],
    }
    n = len(inter)
    single = np.arange(n + 1, dtype=np.int64)
    ids: dict[str, Jagged] = {}
    for feature, values in columns.items():
        table = _ids(feature, values)
        ids[feature] = Jagged(np.fromiter((table[v] for v in values), np.int64, count=n), single)
    genre_ids = {g: hash_id(f"{MULTI}/{g}") for _, genres in item_of.values() for g in genres}
    genres = [item_of[i][1] for i in item_ids]
    ids[MULTI] = Jagged.from_lengths(np.fromiter((genre_ids[g] for gs in genres for g in gs), np.int64),
                                     np.fromiter((len(gs) for gs in genres), np.int64, count=n))
    ratings = np.array([int(float(r[ri])) for r in inter], np.int64)
    examples = Examples(np.zeros((n, 0), np.float32), (ratings >= LIKED).astype(np.int64), ids)
    return MovieLens(examples, timestamps[order], ratings)
