"""The parameter plane's Redis data model as a layer (``services.slots``, ``services.slot_types``): a
group's keys listed once (creation, restore and the sweep name the same keys), the readers' named
fields, one "no model" error, and the version vector."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
import torch

from common.keys import GroupKeys, JobKeys
from services import OptimizerConfig, ParameterStore
from services.errors import LayoutError, NoModelError
from services.layout import make_layout
from services.slot_types import BadVersionError, MetaHead, VersionVector
from services.slots import GROUP_FIELDS, GroupSlot, JobSlot, ModelMeta, SlotKey, read_meta
from services.snapshot.checkpoint import restore_checkpoint, save_checkpoint
from services.tables import TableSpec

JOB = "slots"
TOKEN = "0123456789abcdef0123456789abcdef"


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(10, 20, generator=g), "b": torch.randn(20, generator=g)}


def make_model(client: redis_lib.Redis) -> ModelMeta:
    return ParameterStore(client, JOB).init_model(tensors(), shard_elems=64, groups=2,
                                                  optimizer=OptimizerConfig(name="adam", lr=0.01),
                                                  tables=(TableSpec("user", 4),))


# -- pure: the version vector and the meta's head ---------------------------------------------------

def test_a_version_vector_is_named_parsed_and_compared_group_by_group() -> None:
    v = VersionVector.parse("12.7", 2)
    assert v == (12, 7) and v.name() == "12.7" and v.json() == "12.7" and VersionVector((1200,)).json() == 1200
    assert VersionVector.parse("0.0.3", 3) == (0, 0, 3) and VersionVector.parse("812", 1, kind="position") == (812,)
    assert hash(v) == hash((12, 7)) and {v: 1}[(12, 7)] == 1
    # the partial order: every group, not the tuple's lexicographic one
    assert v >= (12, 7) and v >= (11, 7) and not v >= (11, 8) and not v <= (11, 8) and v < (12, 8)
    assert v.covers((0, 7)) and not VersionVector((11, 8)).covers(v) and v.total == 19
    with pytest.raises(ValueError, match="vectors of 2 and 1 groups do not compare"):
        v.covers((1,))
    assert VersionVector.is_name("12.7") and VersionVector.is_name("0") and not VersionVector.is_name("12.")
    assert not VersionVector.is_name("1" * 19) and not VersionVector.is_name(None)


@pytest.mark.parametrize(("text", "groups", "kind", "message"), [
    ("12.x", 2, "version", "job j has 2 shard groups: version must be 2 non-negative integers joined by '.'"),
    ("12.7", 1, "version", r"version must be one non-negative integer \(a model version\), got '12.7'"),
    ("-1", 1, "position", r"feed position must be one non-negative integer \(a feed position\), got '-1'"),
    ("1" * 19, 1, "version", f"got '{'1' * 19}'"),
    ("3", 2, "position", "feed position must be 2 non-negative integers .* e.g. '12.7'.*got '3'"),
])
def test_a_parse_error_names_the_bad_value_and_the_form(text: str, groups: int, kind: str, message: str) -> None:
    with pytest.raises(BadVersionError, match=message) as refused:
        VersionVector.parse(text, groups, kind=kind, job="j")
    assert isinstance(refused.value, ValueError)


def test_a_caller_s_group_versions_are_checked() -> None:
    assert VersionVector.check([3, 4], 2) == (3, 4)
    for bad in ((-1,), (True,), (1.0,), "3", 3, (3, 4), ()):
        with pytest.raises(ValueError, match=f"non-negative integer.*got {re.escape(repr(bad))}$"):
            VersionVector.check(bad, 1)


def test_the_meta_head_reads_the_group_count_and_the_table_names() -> None:
    meta = ModelMeta(make_layout(tensors(), 64), OptimizerConfig(), 3, (TableSpec("user", 4), TableSpec("item", 2)))
    head = MetaHead.parse(meta.to_json())
    assert (head.groups, head.tables) == (3, ("user", "item"))
    for bad in (b"not json", b"[1]", b'{"groups": 0}', b'{"groups": 1, "tables": [1]}'):
        with pytest.raises(ValueError, match="model meta"):
            MetaHead.parse(bad)


# -- a group's keys ----------------------------------------------------------------------------------

_JUNK = b"junk"


def write_junk(client: redis_lib.Redis, keys: list[SlotKey]) -> None:
    """Something recognisable in every key (of its type); the feed's head and its one entry agree."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.delete(k.key)
        if k.name == "feed_head":
            pipe.set(k.key, 41)
        elif k.kind == "string":
            pipe.set(k.key, _JUNK)
        elif k.kind == "hash":
            pipe.hset(k.key, _JUNK, 1)
        else:
            pipe.xadd(k.key, {_JUNK: 1}, id="41-0")
    pipe.execute()


def holds_junk(client: redis_lib.Redis, k: SlotKey) -> bool:
    if not client.exists(k.key):
        return False
    if k.kind == "string":
        return bool(client.get(k.key) == _JUNK)
    if k.kind == "hash":
        return bool(client.hexists(k.key, _JUNK))
    return any(_JUNK in fields for _, fields in client.xrange(k.key))


def slot_keys(client: redis_lib.Redis, gk: GroupKeys) -> set[str]:
    return {k.decode() for k in client.scan_iter(match=gk.key("*"), count=1000)}


@pytest.fixture
def fresh(redis_server) -> Iterator[redis_lib.Redis]:
    """Another flushed database: the Redis to restore into."""
    client = redis_lib.Redis.from_url(redis_server.url_for(redis_server.next_db()))
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def test_a_groups_keys_are_listed_once_for_creation_restore_and_the_sweep(
        redis: redis_lib.Redis, fresh: redis_lib.Redis, tmp_path: Path) -> None:
    meta = make_model(redis)
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(redis, JOB, path)
    slot = GroupSlot.of(redis, JOB, meta, 0)
    gk, listed = slot.keys, slot.state_keys()
    assert len({k.key for k in listed}) == len(listed) and {k.kind for k in listed} == {"string", "hash", "stream"}
    # every key the group holds is listed: the layer writes them all, plus what a push names by its token
    write_junk(redis, listed)
    blobs = {gk.update_blob(TOKEN, i) for i in slot.own} | {gk.rows_blob(TOKEN)}
    staged = gk.staging(TOKEN, 0)
    for key in (*blobs, staged):
        redis.set(key, _JUNK)
    assert slot_keys(redis, gk) == {k.key for k in listed} | blobs | {staged}

    # the sweep: its pattern finds the blobs and nothing listed, and reads the token out of each
    swept = {k.decode() for k in redis.scan_iter(match=gk.blobs_pattern, count=1000)}
    assert swept == blobs
    assert {gk.blob_token(k) for k in swept} == {TOKEN}
    assert all(gk.blob_token(k.key) is None for k in listed) and gk.blob_token(staged) is None

    # creation (a writer that died before writing the meta left the group full): every listed key is
    # replaced, the token-named ones are left to the sweeper and the apply
    redis.delete(JobKeys(JOB).meta)
    make_model(redis)
    assert not [k.name for k in listed if holds_junk(redis, k)]
    left = {k.name for k in listed if redis.exists(k.key)}
    assert left == {"version", *(f"{h}" for h in ("versions", "bases", "delta_floors")),
                    *(f"shard:{i}" for i in slot.own)}
    assert slot_keys(redis, gk) - {k.key for k in listed} == blobs | {staged}

    # restore into a Redis whose group slots hold junk: the same keys are replaced; the feed is emptied
    # and its head moved one past, so every position before the restore reads as gone
    for g in range(meta.groups):
        write_junk(fresh, GroupSlot.of(fresh, JOB, meta, g).state_keys())
    restore_checkpoint(fresh, path)
    for g in range(meta.groups):
        keys = GroupSlot.of(fresh, JOB, meta, g).state_keys()
        assert not [k.name for k in keys if holds_junk(fresh, k)]
        assert int(fresh.get(JobKeys(JOB).group(g).feed_head)) == 42
        assert fresh.xlen(JobKeys(JOB).group(g).feed) == 0
        assert slot_keys(fresh, JobKeys(JOB).group(g)) <= {k.key for k in keys}


# -- the readers -------------------------------------------------------------------------------------

def test_the_readers_return_named_fields(redis: redis_lib.Redis) -> None:
    with pytest.raises(NoModelError, match=f"job {JOB} has no model in this Redis") as none:
        read_meta(redis, JOB)
    assert isinstance(none.value, LayoutError) and none.value.job == JOB
    with pytest.raises(NoModelError):
        JobSlot(redis, JOB).read("meta").model()
    with pytest.raises(NoModelError, match="no model yet"):
        ParameterStore(redis, JOB).pull()

    meta = make_model(redis)
    assert read_meta(redis, JOB) == meta
    slot = GroupSlot.of(redis, JOB, meta, 1)
    gk = slot.keys
    i = slot.own[0]
    for v in (1, 2, 3):
        redis.xadd(gk.deltas(i), {"d": b"%d" % v}, id=f"{v}-0")
    redis.set(gk.update_blob(TOKEN, i), b"blob")
    read = slot.read("version", "cursor", "versions", "bases", "shards", "optimizer", "deltas",
                     blobs=[(TOKEN, i), ("gone", i)], after=1, upto=2)
    assert read.group == 1 and read.version == 0 and read.cursor == "" and read.plan is None
    assert read.versions == read.bases == dict.fromkeys(slot.own, 0)
    assert set(read.shards) == set(slot.own) and all(len(b or b"") == 4 * meta.layout.shards[j].numel
                                                     for j, b in read.shards.items())
    assert read.optimizer == {(j, s): None for j in slot.own for s in range(2)}  # adam: m, v; none persisted
    assert [e for e, _ in read.deltas[i]] == [b"2-0"] and all(read.deltas[j] == [] for j in slot.own[1:])
    assert read.blobs == {(TOKEN, i): b"blob", ("gone", i): None}
    assert read.asked >= {"version", "shards", "deltas", "blobs"} and read.delta_floors == {}  # not asked
    some = slot.read("persisted", shards=[i])
    assert set(some.shards) == {i} and some.deltas == {} and some.asked == {"persisted", "shards"}
    with pytest.raises(ValueError, match="no group field 'shard'"):
        slot.read("shard")
    assert "table_stats" in GROUP_FIELDS

    job = JobSlot(redis, JOB).read("meta", "unapplied", "offsets", applied_by=["1-0"])
    assert job.model() == meta and job.unapplied == 0 and job.offsets == {} and job.applied_by == {}
    with pytest.raises(ValueError, match="no job field 'metas'"):
        JobSlot(redis, JOB).read("metas")
