"""The ``movielens`` source: MovieLens-100K read from the recbole wheel, replayed in time order,
the last 10 % by time held out, labels, features and IDs; and its shards through the producer."""

from __future__ import annotations

import csv
import importlib.resources
import re

import numpy as np
import pytest

from datastream.movielens import (
    FEATURES,
    INSTALL,
    LIKED,
    MULTI,
    SINGLE,
    MovieLensMissing,
    age_bucket,
    load_movielens,
    time_split_mask,
    year_bucket,
)
from datastream.producer import iter_shards
from datastream.records import decode_record, encode_shard, hash_id
from datastream.sources import SourceError, load_source

DATA = importlib.resources.files("recbole") / "dataset_example" / "ml-100k"


def _raw_ratings() -> list[tuple[str, str, int, int]]:
    """(user, item, rating, timestamp) of every line of the ratings file, in the file's order."""
    with (DATA / "ml-100k.inter").open(newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t"))[1:]
    return [(u, i, int(float(r)), int(float(t))) for u, i, r, t in rows]


def test_every_rating_is_one_record_in_timestamp_order_stable_for_ties() -> None:
    data = load_movielens()
    raw = _raw_ratings()
    assert len(data) == len(raw) == 100_000
    assert (np.diff(data.timestamps) >= 0).all()
    expected = sorted(range(len(raw)), key=lambda k: raw[k][3])  # Python's sort is stable: ties keep file order
    users = data.examples.ids["user"].values
    items = data.examples.ids["item"].values
    for pos in (0, 1, 2, 4_999, 50_000, 99_999):
        u, i, rating, ts = raw[expected[pos]]
        assert (users[pos], items[pos]) == (hash_id(f"user/{u}"), hash_id(f"item/{i}"))
        assert (int(data.ratings[pos]), int(data.timestamps[pos])) == (rating, ts)
    order = [(hash_id(f"user/{raw[k][0]}"), hash_id(f"item/{raw[k][1]}")) for k in expected]
    assert order == list(zip(users.tolist(), items.tolist(), strict=True))


def test_a_rating_of_four_or_more_is_a_click() -> None:
    data = load_movielens()
    y = data.examples.y
    assert y.dtype == np.int64 and set(np.unique(y).tolist()) == {0, 1}
    np.testing.assert_array_equal(y, (data.ratings >= LIKED).astype(np.int64))
    assert set(np.unique(data.ratings[y == 1]).tolist()) == {4, 5}
    assert set(np.unique(data.ratings[y == 0]).tolist()) == {1, 2, 3}


def test_the_last_tenth_by_time_is_held_out_and_never_trained_on() -> None:
    train = load_source("movielens", split="train").read()
    test = load_source("movielens", split="test").read()
    everything = load_movielens()
    assert (len(train), len(test)) == (90_000, 10_000)
    assert train.x.shape == (90_000, 0) and test.x.shape == (10_000, 0)  # no dense features
    for name in FEATURES:
        assert train.ids[name] == everything.examples.ids[name].slice(0, 90_000)
        assert test.ids[name] == everything.examples.ids[name].slice(90_000, 100_000)
    assert everything.timestamps[:90_000].max() <= everything.timestamps[90_000:].min()  # the future only
    # several passes over the train split repeat it, never reaching into the held-out part
    twice = load_source("movielens?repeat=2", split="train").read()
    assert len(twice) == 180_000 and twice.ids["item"] == type(twice.ids["item"]).concat([train.ids["item"]] * 2)
    # a shorter replay holds out its own last tenth
    short_train = load_source("movielens?limit=1000", split="train").read()
    short_test = load_source("movielens?limit=1000", split="test").read()
    assert (len(short_train), len(short_test)) == (900, 100)
    assert short_test.ids["user"] == everything.examples.ids["user"].slice(900, 1000)
    assert time_split_mask(0, 10, "all", 10) is None
    assert time_split_mask(8, 4, "test", 20).tolist() == [False, False, False, False]
    assert time_split_mask(17, 3, "test", 20).tolist() == [False, True, True]
    assert time_split_mask(17, 3, "train", 20).tolist() == [True, False, False]


def test_every_feature_is_present_single_valued_but_the_multi_hot_genres() -> None:
    ids = load_movielens().examples.ids
    assert tuple(ids) == FEATURES and MULTI == "genres" and MULTI not in SINGLE
    for name in SINGLE:
        assert (ids[name].lengths == 1).all(), name
    genres = ids[MULTI]
    assert genres.lengths.min() >= 1 and genres.lengths.max() > 1  # multi-hot: some movies have several
    distinct = {name: len(np.unique(col.values)) for name, col in ids.items()}
    assert distinct == {"user": 943, "item": 1682, "age": 7, "gender": 2, "occupation": 21, "zip": distinct["zip"],
                        "year": distinct["year"], "genres": 19}
    assert 10 < distinct["zip"] < 200 and 5 < distinct["year"] < 25
    # Toy Story (item 1, 1995: Animation, Children's, Comedy) wherever it is rated
    rows = np.flatnonzero(ids["item"].values == hash_id("item/1"))
    assert rows.size > 0
    first = int(rows[0])
    assert ids["year"].values[first] == hash_id("year/1995")
    assert sorted(ids[MULTI].to_lists()[first]) == sorted(hash_id(f"genres/{g}")
                                                          for g in ("Animation", "Children's", "Comedy"))


def test_ids_are_the_hashed_feature_and_value_and_no_two_features_share_one() -> None:
    ids = load_movielens().examples.ids
    seen: dict[int, str] = {}
    for name, col in ids.items():
        for value in np.unique(col.values).tolist():
            assert seen.setdefault(value, name) == name, f"{name} and {seen[value]} share ID {value}"
    assert hash_id("gender/M") in seen and hash_id("gender/F") in seen
    assert age_bucket(7) == "<18" and age_bucket(18) == "18" and age_bucket(34) == "25" and age_bucket(73) == "56"
    assert year_bucket("1997") == "1995" and year_bucket("1990") == "1990" and year_bucket("") == "unknown"


def test_a_missing_data_set_names_the_install_command() -> None:
    with pytest.raises(MovieLensMissing, match=re.escape(INSTALL)):
        load_movielens("no_such_package_streamtrain_test")
    with pytest.raises(MovieLensMissing, match="no dataset_example/ml-100k in package 'datastream'"):
        load_movielens("datastream")
    assert "scripts/setup.sh" in INSTALL
    with pytest.raises(SourceError, match="unknown option"):
        load_source("movielens?colour=red")
    with pytest.raises(SourceError, match="limit=0 must be >= 1"):
        load_source("movielens?limit=0")


def test_records_go_through_shards_with_their_ids_and_no_dense_features() -> None:
    block = load_source("movielens?limit=200", split="train").read()
    shards = list(iter_shards(load_source("movielens?limit=200", split="train"), 64))
    assert [len(s) for s in shards] == [64, 64, 52]
    first = shards[0]
    decoded = decode_record(encode_shard(first.x, first.y, producer_id="p", first_seq=0, ids=first.ids))
    assert decoded.x.shape == (64, 0) and set(decoded.ids) == set(FEATURES)
    assert decoded.ids["genres"] == block.ids["genres"].slice(0, 64)
    np.testing.assert_array_equal(decoded.y, block.y[:64])
