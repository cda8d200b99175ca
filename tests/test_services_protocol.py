"""The parameter plane's wire contract (``services.protocol``, ``services.scripts``, ``common.fence``).

The Lua contract: each script of ``services/lua`` declares in its header every KEYS and ARGV
position it reads (``-- KEYS[1] cursor``, ``-- KEYS[9..] renames`` for a tail) and names them in
locals (``local K_CURSOR = 1``; ``S_``/``U_`` for the fields of plan entries). These tests read
both and check them against the script's call class, and check what the class renders against
the positions the header declares; moving a position on one side only fails them (shown below
on altered copies of the scripts and classes). The records: their wire forms are pinned to what
running jobs and ``streamtrain-checkpoint-3`` and ``-4`` files hold.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import NamedTuple

import msgpack
import pytest
import redis as redis_lib

from common.fence import fence_token, parse_fence_token
from common.keys import JobKeys
from services.errors import PayloadError
from services.layout import make_layout
from services.protocol import (
    AccountingRecord,
    AccountPlan,
    PlanUpdate,
    Status,
    StreamId,
    Update,
    after,
    group_of,
    own_shards,
)
from services.scripts import (
    CALLS,
    AccountCall,
    ApplyCall,
    FeedReadCall,
    PushCall,
    RowsSweepCall,
    ScriptCall,
    ShardPlan,
    ShardPublish,
)
from services.server.apply import Outcome, write_batch

LUA = Path(__file__).resolve().parents[1] / "services" / "lua"
JOB = "protocol"


# -- reading a script's declarations ---------------------------------------------------------------

_POSITION = re.compile(r"^-- (KEYS|ARGV)\[(\d+)(\.\.)?\]\s+([a-z_]+)\b", re.M)
_INDEX_LOCAL = re.compile(r"^local ([A-Z])_([A-Z0-9_]+) = (\d+)\b", re.M)
_FIELD_LOCAL = re.compile(r"^local F_([A-Z0-9_]+) = '([^']*)'", re.M)
_STATUS_LOCAL = re.compile(r"^local (APPLIED|REJECTED) = '([^']*)'", re.M)


class Declared(NamedTuple):
    """What a script's header and locals declare."""

    header: dict[str, tuple[list[tuple[int, str]], tuple[int, str] | None]]
    """``KEYS``/``ARGV`` -> ((position, name) of the fixed ones, (position, name) of the tail)."""
    locals: dict[str, dict[str, int]]
    """Prefix (K, A, S, U, ...) -> lower-case name -> position."""


def declared(source: str) -> Declared:
    header: dict[str, tuple[list[tuple[int, str]], tuple[int, str] | None]] = {"KEYS": ([], None), "ARGV": ([], None)}
    for array, position, tail, name in _POSITION.findall(source):
        fixed, _ = header[array]
        if tail:
            header[array] = (fixed, (int(position), name))
        else:
            fixed.append((int(position), name))
    found: dict[str, dict[str, int]] = {}
    for prefix, name, position in _INDEX_LOCAL.findall(source):
        found.setdefault(prefix, {})[name.lower()] = int(position)
    return Declared(header, found)


def mismatches(call: type[ScriptCall], source: str) -> list[str]:
    """Every disagreement between ``call`` and the script ``source`` (empty when they agree)."""
    out = []
    d = declared(source)
    for array, names, tail_name in (("KEYS", call.KEYS, call.KEYS_TAIL), ("ARGV", call.ARGV, call.ARGV_TAIL)):
        fixed, tail = d.header[array]
        if [p for p, _ in fixed] != list(range(1, len(fixed) + 1)):
            out.append(f"header {array}: positions {[p for p, _ in fixed]} are not 1, 2, ... in order")
        if [n for _, n in fixed] != list(names):
            out.append(f"header {array} {[n for _, n in fixed]} != {call.__name__}.{array} {list(names)}")
        want_tail = None if tail_name is None else (len(names) + 1, tail_name)
        if tail != want_tail:
            out.append(f"header {array} tail {tail} != {call.__name__}'s {want_tail}")
        want = {n: i for i, n in enumerate(names, start=1)} | ({} if tail_name is None else {tail_name: len(names) + 1})
        prefix = array[0]
        if d.locals.get(prefix, {}) != want:
            out.append(f"locals {prefix}_ {d.locals.get(prefix, {})} != {call.__name__}'s {array} {want}")
    for prefix, entry in call.ENTRIES.items():
        want = {f: i for i, f in enumerate(entry._fields, start=1)}
        if d.locals.get(prefix, {}) != want:
            out.append(f"locals {prefix}_ {d.locals.get(prefix, {})} != {entry.__name__} fields {want}")
    unknown = set(d.locals) - {"K", "A", *call.ENTRIES}
    if unknown:
        out.append(f"locals with prefixes {sorted(unknown)} that {call.__name__} does not declare")
    return out


def source(call: type[ScriptCall]) -> str:
    return (LUA / f"{call.SCRIPT}.lua").read_text()


# -- the scripts agree with their classes ----------------------------------------------------------

def test_every_script_has_one_call_class() -> None:
    assert sorted(c.SCRIPT for c in CALLS) == sorted(p.stem for p in LUA.glob("*.lua"))


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.SCRIPT)
def test_the_script_header_its_locals_and_its_class_agree(call: type[ScriptCall]) -> None:
    assert mismatches(call, source(call)) == []
    d = declared(source(call))
    assert d.header["KEYS"][0] and d.locals["K"]  # the parser found them (a test that cannot fail is a defect)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.SCRIPT)
def test_the_scripts_index_keys_and_argv_only_through_their_locals(call: type[ScriptCall]) -> None:
    code = "\n".join(line for line in source(call).splitlines() if not line.lstrip().startswith("--"))
    assert re.findall(r"(?:KEYS|ARGV)\[\d", code) == []


def _swap_lines(text: str, a: str, b: str) -> str:
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(a))
    j = next(k for k, line in enumerate(lines) if line.startswith(b))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


def _renumber(text: str, line: str, new: str) -> str:
    assert line in text
    return text.replace(line, new)


@pytest.mark.parametrize("call, altered", [
    # the header moves two keys, the locals and the class stay
    (PushCall, lambda s: _swap_lines(s, "-- KEYS[3] offsets", "-- KEYS[4] update_log")),
    # a local moves, the header and the class stay
    (ApplyCall, lambda s: _renumber(s, "local K_RENAMES = 14", "local K_RENAMES = 15")),
    (FeedReadCall, lambda s: _renumber(s, "local K_TABLES = 4", "local K_TABLES = 3")),
    (AccountCall, lambda s: _renumber(s, "local A_PLAN = 1", "local A_PLAN = 2")),
    # the tail starts later in the header only
    (AccountCall, lambda s: _renumber(s, "-- KEYS[11..] applied_by", "-- KEYS[12..] applied_by")),
    # a plan entry's field moves in the script only
    (ApplyCall, lambda s: _renumber(s, "local S_STREAM = 5", "local S_STREAM = 4")),
    (AccountCall, lambda s: _renumber(s, "local U_VERDICT = 4", "local U_VERDICT = 3")),
    # an ARGV position is inserted in the script (header and locals alike), not in the class
    (PushCall, lambda s: _renumber(s, "-- ARGV[3] fence ", "-- ARGV[3] lease_ms\n-- ARGV[4] fence ")),
], ids=["push-header", "apply-local", "feed-local", "account-local", "account-tail", "apply-entry", "account-entry",
        "push-argv"])
def test_moving_a_position_in_the_script_only_fails_the_check(call: type[ScriptCall], altered) -> None:
    assert mismatches(call, source(call)) == []
    assert mismatches(call, altered(source(call))) != []


class _SwappedPlanUpdate(NamedTuple):
    member_id: str
    update_id: str
    clock: int
    verdict: str
    fields: list


@pytest.mark.parametrize("call", [
    type("PushSwapped", (PushCall,), {"KEYS": ("generation", "assignment", "update_log", "offsets", "clocks",
                                               "unapplied")}),
    type("ApplyArgvSwapped", (ApplyCall,), {"ARGV": ("accounting", "plan")}),
    type("ApplyNoTail", (ApplyCall,), {"KEYS_TAIL": None}),
    type("AccountEntrySwapped", (AccountCall,), {"ENTRIES": {"U": _SwappedPlanUpdate}}),
], ids=["push-keys", "apply-argv", "apply-tail", "account-entry"])
def test_moving_a_position_in_the_class_only_fails_the_check(call: type[ScriptCall]) -> None:
    assert mismatches(call, source(call)) != []


# -- what the classes render sits where the headers say --------------------------------------------

def _positions(call: type[ScriptCall], array: str) -> dict[str, int]:
    fixed, tail = declared(source(call)).header[array]
    return {name: p for p, name in fixed} | ({tail[1]: tail[0]} if tail else {})


def _update(**changes: object) -> Update:
    base = Update(member_id="m-1", generation=7, clock=3, gradients={2: b"g2", 0: b"g0"}, codec="topk+fp16",
                  offsets={4: (10, 15), 1: (0, 5)}, samples=(("p", 0, 5), ("q", 3, 5)), batch_size=10,
                  produced_ts_ms=1_700_000_000_000, log_id="", token="tok", wire_bytes=4)
    return dataclasses.replace(base, **changes)


def test_push_call_renders_by_the_headers_positions() -> None:
    keys, u = JobKeys(JOB), _update()
    call = PushCall(keys, u, max_pending=64)
    k, a = _positions(PushCall, "KEYS"), _positions(PushCall, "ARGV")
    rendered_keys, argv = call.keys(), call.argv()
    assert {name: rendered_keys[p - 1] for name, p in k.items()} == {name: getattr(keys, name) for name in k}
    assert argv[a["member_id"] - 1] == "m-1" and argv[a["generation"] - 1] == 7 and argv[a["clock"] - 1] == 3
    assert argv[a["fence"] - 1] == fence_token("m-1", 7) and argv[a["max_pending"] - 1] == 64
    assert argv[a["range_count"] - 1] == 2
    tail = argv[a["ranges"] - 1:]
    assert tail[:6] == [1, 0, 5, 4, 10, 15]  # partition, first, next by partition
    assert tail[6:] == ["h", u.to_fields()["h"]]


def test_apply_call_renders_by_the_headers_positions_and_its_plan_points_at_them() -> None:
    gk = JobKeys(JOB).group(1)
    plan = AccountPlan(group=1, groups=2, start="", end="5-0")
    call = ApplyCall(gk, cursor="", last="5-0", renames=[("s0", "d0"), ("s1", "d1")],
                     shards=[ShardPublish(3, 9, b"delta3", False), ShardPublish(5, 2, None, True),
                             ShardPublish(7, 4, b"delta7", True)],
                     accounting=plan, steps={3: 11, 5: 12}, blobs=["b1", "b2"])
    k, a = _positions(ApplyCall, "KEYS"), _positions(ApplyCall, "ARGV")
    keys, argv = call.keys(), call.argv()
    fixed = {name: p for name, p in k.items() if name != "renames"}
    assert {name: keys[p - 1] for name, p in fixed.items()} == {name: getattr(gk, name) for name in fixed}
    assert keys[k["renames"] - 1:k["renames"] + 3] == ["s0", "d0", "s1", "d1"]
    assert argv[a["accounting"] - 1] == plan.pack()
    decoded = msgpack.unpackb(argv[a["plan"] - 1])
    assert (decoded["cursor"], decoded["last"], decoded["renames"]) == ("", "5-0", 2)
    shards = [ShardPlan(*entry) for entry in decoded["shards"]]
    assert [(s.index, s.version_read, s.full) for s in shards] == [(3, 9, 0), (5, 2, 1), (7, 4, 1)]
    assert [keys[s.stream - 1] for s in shards] == [gk.deltas(3), gk.deltas(5), gk.deltas(7)]
    assert [argv[s.delta - 1] if s.delta else None for s in shards] == [b"delta3", None, b"delta7"]
    assert all(s.delta == 0 or s.delta >= a["deltas"] for s in shards)
    first, count = decoded["persist"]["blobs"]
    assert keys[first - 1:first - 1 + count] == ["b1", "b2"] and len(keys) == first - 1 + count
    assert decoded["persist"]["steps"] == [3, 11, 5, 12]
    assert decoded["feed"] == call.feed_entries > 0


def test_the_feed_calls_render_by_the_headers_positions() -> None:
    gk = JobKeys(JOB).group(2)
    call = FeedReadCall(gk, since=7, limit=50, most_rows=1000, tables=[("user", 24), ("item", 16)])
    k, a = _positions(FeedReadCall, "KEYS"), _positions(FeedReadCall, "ARGV")
    keys, argv = call.keys(), call.argv()
    assert (keys[k["version"] - 1], keys[k["feed"] - 1], keys[k["feed_head"] - 1]) == (gk.version, gk.feed,
                                                                                       gk.feed_head)
    assert keys[k["tables"] - 1:] == [gk.table_rows("user"), gk.table_rows("item")]
    assert (argv[a["since"] - 1], argv[a["limit"] - 1], argv[a["most_rows"] - 1]) == (7, 50, 1000)
    assert argv[a["tables"] - 1:] == ["user", 24, "item", 16]
    with pytest.raises(ValueError, match="limit >= 1"):
        FeedReadCall(gk, since=0, limit=0, most_rows=1, tables=[])
    sweep = RowsSweepCall(gk, "user", written_at=25, cutoff_ms=0, cursor="0", seen_cursor="0", count=10, cap=5,
                          most_evicted=9, feed_entries=321)
    k, a = _positions(RowsSweepCall, "KEYS"), _positions(RowsSweepCall, "ARGV")
    assert [sweep.keys()[k[n] - 1] for n in ("version", "feed", "feed_head")] == [gk.version, gk.feed, gk.feed_head]
    assert sweep.argv()[a["feed_entries"] - 1] == 321


def test_account_call_renders_by_the_headers_positions() -> None:
    keys = JobKeys(JOB)
    plan = AccountPlan(group=0, groups=1, start="", end="2-0",
                       updates=[PlanUpdate("1-0", "a", 1, "", ["update", "1-0"]),
                                PlanUpdate("2-0", "b", 4, "bad", ["update", "2-0"])])
    call = AccountCall(keys, plan)
    k, a = _positions(AccountCall, "KEYS"), _positions(AccountCall, "ARGV")
    rendered = call.keys()
    fixed = {name: p for name, p in k.items() if name != "applied_by"}
    assert {name: rendered[p - 1] for name, p in fixed.items()} == {name: getattr(keys, name) for name in fixed}
    assert rendered[k["applied_by"] - 1:] == [keys.applied_by("1-0"), keys.applied_by("2-0")]
    assert call.argv()[a["plan"] - 1] == plan.pack()


def test_a_call_refuses_values_that_do_not_match_its_names() -> None:
    class Broken(PushCall):
        def named_keys(self) -> dict[str, str]:
            return {**super().named_keys(), "extra": "x"}

    with pytest.raises(TypeError, match="extra"):
        Broken(JobKeys(JOB), _update(), 1).keys()


# -- ownership, stream ids, the fence token --------------------------------------------------------

@pytest.mark.parametrize("shards, groups", [(1, 1), (7, 1), (7, 3), (12, 4), (3, 5)])
def test_every_shard_belongs_to_exactly_one_group(shards: int, groups: int) -> None:
    owned = [own_shards(shards, groups, g) for g in range(groups)]
    assert sorted(i for own in owned for i in own) == list(range(shards))
    assert all(group_of(i, groups) == g for g, own in enumerate(owned) for i in own)
    assert owned[0][:2] == list(range(0, min(shards, 2 * groups), groups))  # i % groups: round robin


def test_own_shards_takes_a_layout() -> None:
    layout = make_layout([("w", (10, 20)), ("b", (20,))], shard_elems=64)
    assert own_shards(layout, 2, 1) == own_shards(len(layout.shards), 2, 1) == [1, 3]


def test_stream_ids_order_as_redis_orders_them() -> None:
    ids = ["", "0-1", "9-0", "10-0", "10-2", "10-11"]
    assert sorted(["10-11", "10-2", "10-0", "9-0", "0-1", ""], key=StreamId.parse) == ids  # numeric, not text, order
    assert StreamId.parse(b"10-2") == StreamId(10, 2) and str(StreamId(10, 2)) == "10-2"
    assert str(StreamId.parse("")) == ""
    assert after("") == "-" and after("10-2") == "10-3" and after(b"7-0") == "7-1"
    for bad in ("10", "a-1", "1-b", "-1", "1-"):
        with pytest.raises(ValueError, match="stream id"):
            StreamId.parse(bad)


def test_the_fence_token_round_trips_and_refuses_what_it_cannot_spell() -> None:
    assert fence_token("m-1", 7) == "m-1|7"
    assert parse_fence_token(fence_token("m-1", 7)) == parse_fence_token(b"m-1|7") == ("m-1", 7)
    for member, generation in (("a|b", 1), ("", 1), ("a", -1), ("a", True)):
        with pytest.raises(ValueError):
            fence_token(member, generation)  # type: ignore[arg-type]  # bad on purpose
    for bad in ("m-1", "m-1|", "|3", "m|x"):
        with pytest.raises(ValueError, match="fence token"):
            parse_fence_token(bad)


def test_lua_never_spells_the_fence_token() -> None:
    scripts = sorted(LUA.glob("*.lua"))
    assert PushCall.SCRIPT in [p.stem for p in scripts]  # the script that fences
    for path in scripts:
        text = path.read_text()
        assert "'|'" not in text and '"|"' not in text, path.name


# -- the records: typed, and their wire forms as running jobs and checkpoints hold them ------------

def test_the_log_entry_is_the_header_running_jobs_hold() -> None:
    u = _update()
    old = {"m": "m-1", "g": 7, "c": 3, "codec": "topk+fp16", "off": [[1, 0, 5], [4, 10, 15]],
           "s": [["p", 0, 5], ["q", 3, 5]], "b": 10, "ts": 1_700_000_000_000, "shards": [0, 2], "t": "tok",
           "wb": 4}
    assert u.to_fields() == {"h": msgpack.packb(old, use_bin_type=True)}
    back = Update.from_fields(b"5-1", {b"h": u.to_fields()["h"]})
    assert back == dataclasses.replace(u, gradients={}, log_id="5-1", shards=(0, 2))
    del old["wb"]  # written before the field existed: 0
    assert Update.from_fields("5-2", {b"h": msgpack.packb(old)}).wire_bytes == 0
    with pytest.raises(PayloadError, match=r"5-3.*missing"):
        Update.from_fields("5-3", {b"x": b""})
    with pytest.raises(PayloadError, match=r"5-4.*malformed"):
        Update.from_fields("5-4", {b"h": msgpack.packb({"m": "a"})})


def test_the_accounting_record_is_the_entry_running_jobs_hold() -> None:
    u = _update(log_id="5-1")
    record = AccountingRecord.of(u, grad_bytes=4, applied_ms=1_700_000_000_123)
    before = {"update": "5-1", "member": "m-1", "generation": "7", "clock": "3",
              "samples": json.dumps([["p", 0, 5], ["q", 3, 5]]), "offsets": json.dumps([[1, 0, 5], [4, 10, 15]]),
              "batch_size": "10", "produced_ts_ms": "1700000000000", "applied_ms": "1700000000123",
              "grad_bytes": "4"}
    flat = record.fields_before_verdict()
    assert dict(zip(flat[::2], flat[1::2], strict=True)) == before and flat[::2] == list(before)
    assert record.to_fields() == {**before, "status": "applied"} and record.verdict == ""
    rejected = dataclasses.replace(record, status=Status.REJECTED, reason="shard 2: NaN")
    assert rejected.to_fields() == {**before, "status": "rejected", "reason": "shard 2: NaN"}
    assert rejected.verdict == "shard 2: NaN"
    assert dataclasses.replace(rejected, reason="").verdict == "refused"
    for entry in (record, rejected):
        raw = {k.encode(): v.encode() for k, v in entry.to_fields().items()}
        assert AccountingRecord.from_fields(raw) == AccountingRecord.from_fields(entry.to_fields()) == entry
    old = {k: v for k, v in record.to_fields().items() if k != "grad_bytes"}  # before the field existed
    assert AccountingRecord.from_fields(old).grad_bytes == 0
    with pytest.raises(PayloadError, match="'samples' missing"):
        AccountingRecord.from_fields({k: v for k, v in record.to_fields().items() if k != "samples"})
    with pytest.raises(PayloadError, match=r"5-1.*malformed"):
        AccountingRecord.from_fields({**record.to_fields(), "status": "maybe"})


def test_the_account_plan_is_what_unaccounted_keeps() -> None:
    record = AccountingRecord.of(_update(log_id="5-1"), Status.REJECTED, reason="bad", grad_bytes=4, applied_ms=9)
    plan = AccountPlan(group=1, groups=2, start="4-0", end="5-1", updates=(PlanUpdate.of(record),),
                       persisted="5-1", housekeep=(600_000, 2000))
    old = {"group": 1, "groups": 2, "from": "4-0", "to": "5-1",
           "updates": [["5-1", "m-1", 3, "bad", record.fields_before_verdict()]], "persisted": "5-1",
           "housekeep": [600_000, 2000]}
    assert plan.pack() == msgpack.packb(old, use_bin_type=True)
    assert AccountPlan.unpack(plan.pack()) == plan and plan.verdicts() == {"5-1": "bad"}
    none = dataclasses.replace(plan, updates=(), persisted="", housekeep=None)
    assert msgpack.unpackb(none.pack())["housekeep"] == 0 and AccountPlan.unpack(none.pack()) == none
    with pytest.raises(PayloadError, match="unaccounted"):
        AccountPlan.unpack(msgpack.packb({"group": 1}), what="unaccounted")


def test_account_lua_completes_the_record_the_plan_carries(redis: redis_lib.Redis) -> None:
    """On the real Redis: what the script appends to ``applied_samples`` reads back as the record
    the server built, status and reason included."""
    keys = JobKeys(JOB)
    good, bad = _update(log_id="1-0", clock=1), _update(log_id="2-0", clock=2)
    outcomes = [Outcome(good, Status.APPLIED, grad_bytes=4, applied_ms=11),
                Outcome(bad, Status.REJECTED, reason="shard 2: NaN", grad_bytes=4, applied_ms=12)]
    redis.hset(keys.members, "m-1", "{}")  # a live member keeps its applied clock
    assert write_batch(redis, JOB, group=0, groups=1, cursor="", outcomes=outcomes, shards=[]).ok
    entries = redis.xrange(keys.applied_samples)
    assert [AccountingRecord.from_fields(f) for _, f in entries] == [o.record() for o in outcomes]
    assert redis.hgetall(keys.applied_clocks) == {b"m-1": b"2"}
    assert AccountPlan.unpack(redis.get(keys.group(0).unaccounted)).verdicts() == {"1-0": "", "2-0": "shard 2: NaN"}


def test_account_lua_spells_the_records_fields_and_statuses_as_the_record_does() -> None:
    text = source(AccountCall)
    fields = dict(_FIELD_LOCAL.findall(text))
    statuses = dict(_STATUS_LOCAL.findall(text))
    record = dataclasses.replace(AccountingRecord.of(_update(log_id="1-0"), applied_ms=0), status=Status.REJECTED)
    assert fields and set(fields.values()) <= set(record.to_fields())
    assert all(value == name.lower() for name, value in fields.items())
    assert statuses == {s.name: s.value for s in Status}
