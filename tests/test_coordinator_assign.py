"""Pure tests of the control plane: assignment, the membership state machine, the job config, body
validation."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest

from coordinator.assign import assign, capability_weight, quotas
from coordinator.assignment import Assignment, JobConfig
from coordinator.errors import MemberGoneError, UnknownMemberError
from coordinator.membership import (
    CheckLeases,
    Drain,
    Heartbeat,
    Leave,
    Member,
    MemberExpired,
    MemberState,
    Rebalanced,
    Register,
    RenewLeases,
    empty,
    handle,
)
from coordinator.runtime import next_check_s
from coordinator.validation import CONFIG_CHANGE, HEARTBEAT, REGISTER, InvalidBody, parse_json

P12 = list(range(12))


def counts(result: dict[int, str]) -> Counter[str]:
    return Counter(result.values())


# -- assign -------------------------------------------------------------------

def test_no_members_gives_empty_assignment() -> None:
    assert assign({}, P12, {0: "gone"}) == {}


def test_every_partition_assigned_exactly_once_and_balanced() -> None:
    result = assign({"a": 1, "b": 1, "c": 1}, P12, {})
    assert sorted(result) == P12
    assert counts(result) == {"a": 4, "b": 4, "c": 4}


def test_uneven_split_differs_by_at_most_one() -> None:
    result = assign({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1}, P12, {})
    assert sorted(result) == P12
    assert max(counts(result).values()) - min(counts(result).values()) == 1


def test_weights_give_proportional_shares() -> None:
    result = assign({"gpu": 3.0, "cpu": 1.0}, P12, {})
    assert counts(result) == {"gpu": 9, "cpu": 3}


def test_sticky_when_membership_unchanged() -> None:
    prev = {p: ("a" if p % 2 else "b") for p in P12}
    assert assign({"a": 1, "b": 1}, P12, prev) == prev


def test_newcomer_takes_only_excess() -> None:
    prev = assign({"a": 1, "b": 1}, P12, {})
    new = assign({"a": 1, "b": 1, "c": 1}, P12, prev)
    assert counts(new) == {"a": 4, "b": 4, "c": 4}
    moved = [p for p in P12 if new[p] != prev[p]]
    assert all(new[p] == "c" for p in moved)  # nothing moves between the old members
    assert len(moved) == 4  # the minimum


def test_departed_member_partitions_spread_others_keep_theirs() -> None:
    prev = assign({"a": 1, "b": 1, "c": 1}, P12, {})
    new = assign({"a": 1, "b": 1}, P12, prev)
    assert counts(new) == {"a": 6, "b": 6}
    for p in P12:
        if prev[p] != "c":
            assert new[p] == prev[p]


def test_deterministic_regardless_of_input_order() -> None:
    members = {"x": 1.0, "y": 2.0, "z": 1.5}
    prev = {0: "y", 3: "x", 7: "gone"}
    base = assign(members, P12, prev)
    for perm in itertools.permutations(members):
        shuffled = {m: members[m] for m in perm}
        parts = P12[:]
        random.Random(len(perm)).shuffle(parts)
        assert assign(shuffled, parts, dict(reversed(list(prev.items())))) == base


def test_stale_previous_entries_are_ignored() -> None:
    result = assign({"a": 1}, [0, 1], {0: "ghost", 5: "a"})
    assert result == {0: "a", 1: "a"}


def test_more_members_than_partitions() -> None:
    result = assign(dict.fromkeys("abcdef", 1), [0, 1, 2], {})
    assert sorted(result) == [0, 1, 2]
    assert set(counts(result).values()) == {1}


def test_random_sequences_keep_invariants() -> None:
    rng = random.Random(7)
    prev: dict[int, str] = {}
    members: dict[str, float] = {}
    for step in range(200):
        if members and rng.random() < 0.4:
            del members[rng.choice(sorted(members))]
        else:
            members[f"m{step}"] = rng.choice([1.0, 2.0, 8.0])
        new = assign(members, P12, prev)
        if members:
            assert sorted(new) == P12
            q = quotas(members, len(P12))
            got = counts(new)
            assert all(abs(got[m] - q[m]) <= 1 for m in members)
            # stickiness: a surviving member keeps min(held, quota) of its old partitions
            for m in members:
                kept = sum(1 for p, o in prev.items() if o == m and new[p] == m)
                held = sum(1 for o in prev.values() if o == m)
                assert kept >= min(held, got[m])
        else:
            assert new == {}
        prev = new


def test_bad_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="weight of member 'a'"):
        assign({"a": 0.0}, P12, {})


def test_capability_weight_formula() -> None:
    assert capability_weight("cpu", 1) == 1.0
    assert capability_weight("cpu", 16) == 4.0
    assert capability_weight("cuda", 1) == 8.0
    assert capability_weight("cuda", 4) > capability_weight("cpu", 64)
    assert capability_weight("cpu", 10_000) == capability_weight("cpu", 256)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        capability_weight("tpu", 1)


# -- membership state machine -------------------------------------------------

def register(state, member_id, now=0, lease=1000, weight=1.0):
    return handle(state, Register(member_id, {"device": "cpu"}, weight, now, lease))


def test_register_bumps_generation_and_assigns() -> None:
    s, actions = register(empty(range(4)), "a")
    assert s.generation == 1 and s.partitions_of("a") == [0, 1, 2, 3]
    assert isinstance(actions[-1], Rebalanced)
    s, _ = register(s, "b", now=10)
    assert s.generation == 2 and len(s.partitions_of("b")) == 2
    with pytest.raises(ValueError, match="already registered"):
        register(s, "a")


def test_heartbeat_renews_lease_without_bump() -> None:
    s, _ = register(empty(range(4)), "a", now=0, lease=1000)
    s2, actions = handle(s, Heartbeat("a", {"loss": 0.5}, 900, 1000))
    assert actions == [] and s2.generation == s.generation
    assert s2.members["a"].lease_expires_ms == 1900 and s2.members["a"].stats == {"loss": 0.5}
    s3, actions = handle(s2, CheckLeases(1500))
    assert s3 is s2 and actions == []


def test_expired_lease_removes_member_and_reassigns() -> None:
    s, _ = register(empty(range(4)), "a", now=0, lease=1000)
    s, _ = register(s, "b", now=500, lease=1000)
    s, actions = handle(s, CheckLeases(1000))
    assert set(s.members) == {"b"} and s.partitions_of("b") == [0, 1, 2, 3]
    assert actions[0] == MemberExpired("a", s.generation, 1000, 1000)
    with pytest.raises(UnknownMemberError):
        handle(s, Heartbeat("a", {}, 1001, 1000))


def test_heartbeat_after_expiry_before_check_is_gone() -> None:
    s, _ = register(empty(range(2)), "a", now=0, lease=1000)
    with pytest.raises(MemberGoneError, match="register anew"):
        handle(s, Heartbeat("a", {}, 1000, 1000))


def test_leave_and_drain() -> None:
    s, _ = register(empty(range(4)), "a")
    s, _ = register(s, "b")
    gen = s.generation
    d, _ = handle(s, Drain("a", 5))
    assert d.generation == gen + 1 and d.members["a"].state is MemberState.DRAINING
    assert d.partitions_of("a") == [] and d.partitions_of("b") == [0, 1, 2, 3]
    assert handle(d, Drain("a", 6)) == (d, [])
    left, _ = handle(d, Leave("a", 7))
    assert set(left.members) == {"b"} and left.generation == gen + 2


def test_renew_leases_after_restart() -> None:
    s, _ = register(empty(range(2)), "a", now=0, lease=1000)
    s, _ = handle(s, RenewLeases(now_ms=5000, lease_ms=1000))
    assert s.members["a"].lease_expires_ms == 6000 and s.generation == 1


def test_member_json_roundtrip_and_errors() -> None:
    m = Member("a", {"device": "cuda"}, 8.0, 1, 2, 3, MemberState.DRAINING, {"loss": 1.0})
    assert Member.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match="bad member record"):
        Member.from_json('{"member_id": "a"}')


# -- job config -------------------------------------------------------------------

DENSE = JobConfig(consistency="ssp", staleness=2, codec="topk+fp16", optimizer="lazyadam", lr=0.005,
                  topic="train", partitions=4)


def test_the_tables_follow_the_dense_part_unless_the_job_sets_their_own() -> None:
    assert DENSE.table_bound() == ("ssp", 2)
    assert replace(DENSE, table_consistency="asp", table_staleness=8).table_bound() == ("asp", 8)
    assert replace(DENSE, table_consistency="asp").table_bound() == ("asp", 2)  # each field on its own
    assert replace(DENSE, table_staleness=0).table_bound() == ("ssp", 0)
    assert replace(DENSE, table_consistency="bsp", table_staleness=8).table_bound() == ("bsp", 0)  # BSP is s = 0
    assert replace(DENSE, consistency="bsp").table_bound() == ("bsp", 0)
    assert replace(DENSE, consistency="bsp", table_consistency="ssp").table_bound() == ("ssp", 2)
    assert replace(DENSE, consistency="asp", staleness=5, table_consistency="ssp").table_bound() == ("ssp", 5)


@pytest.mark.parametrize("config", [DENSE, replace(DENSE, table_consistency="asp", table_staleness=8),
                                    replace(DENSE, table_staleness=0), replace(DENSE, table_consistency="bsp"),
                                    replace(DENSE, ps_groups=3, paused=True)])
def test_job_config_round_trips_through_its_hash_and_its_json(config: JobConfig) -> None:
    raw = {k.encode(): v.encode() for k, v in config.to_hash().items()}
    assert JobConfig.from_hash(raw) == config
    assert JobConfig.from_json(config.as_json()) == config
    reply = {"member_id": "m-1", "generation": 3, "partitions": [0, 2], "state": "active",
             "config": config.as_json()}
    assert Assignment.from_json(reply).config == config


def test_unset_table_fields_are_left_out_of_the_hash_and_the_json() -> None:
    for form in (DENSE.to_hash(), DENSE.as_json()):
        assert "table_consistency" not in form and "table_staleness" not in form
    own = replace(DENSE, table_consistency="asp", table_staleness=8)
    assert (own.to_hash()["table_consistency"], own.to_hash()["table_staleness"]) == ("asp", "8")
    assert (own.as_json()["table_consistency"], own.as_json()["table_staleness"]) == ("asp", 8)
    # a job begun before the fields existed: its hash has neither, and reads as following the dense part
    older = {k: v for k, v in DENSE.to_hash().items() if k not in ("ps_groups", "paused")}
    assert JobConfig.from_hash(older) == DENSE


def test_a_config_from_a_newer_coordinator_parses_without_its_new_fields() -> None:
    newer = {**replace(DENSE, table_consistency="asp").as_json(), "table_codec": "int8"}
    assert JobConfig.from_json(newer) == replace(DENSE, table_consistency="asp")
    with pytest.raises(ValueError, match=r"table_consistency must be one of bsp, ssp, asp .* got 'eventual'"):
        JobConfig.from_json({**DENSE.as_json(), "table_consistency": "eventual"})  # known fields still checked
    with pytest.raises(TypeError):
        JobConfig.from_json({k: v for k, v in DENSE.as_json().items() if k != "topic"})


@pytest.mark.parametrize(("changes", "message"), [
    ({"table_consistency": "eventual"},
     "table_consistency must be one of bsp, ssp, asp (or unset: the dense part's), got 'eventual'"),
    ({"table_consistency": ""}, "table_consistency must be one of bsp, ssp, asp (or unset: the dense part's), got ''"),
    ({"table_staleness": -1}, "table_staleness must be >= 0 (or unset: the dense part's), got -1"),
])
def test_bad_table_fields_are_refused_naming_the_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        replace(DENSE, **changes)
    assert str(info.value) == message


@pytest.mark.parametrize(("field", "text"), [("table_staleness", "eight"), ("table_staleness", "")])
def test_a_malformed_table_field_in_the_hash_is_named(field: str, text: str) -> None:
    with pytest.raises(ValueError, match=f"job config field '{field}' is malformed: '{text}'"):
        JobConfig.from_hash({**DENSE.to_hash(), field: text})
    with pytest.raises(ValueError, match="table_consistency must be one of"):
        JobConfig.from_hash({**DENSE.to_hash(), "table_consistency": "eventual"})


# -- validation -----------------------------------------------------------------

@pytest.mark.parametrize(("raw", "message"), [
    (b"", "empty body"),
    (b"{not json", "malformed JSON"),
    (b"[]", "expected a JSON object"),
    (b'{"capabilities": {"device": "cpu"}, "x": 1}', "unknown field(s) 'x'"),
    (b'{"capabilities": {"device": "tpu"}}', "capabilities.device: must be one of"),
    (b'{"capabilities": {"device": "cpu", "threads": "8"}}', "capabilities.threads: expected an integer"),
    (b'{"capabilities": {"device": "cpu", "threads": true}}', "capabilities.threads: expected an integer"),
    (b'{"capabilities": {}}', "capabilities.device: required"),
    (b'{"capabilities": {"device": "cpu", "color": "red"}}', "capabilities: unknown field(s) 'color'"),
])
def test_register_body_errors_name_the_problem(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidBody) as info:
        parse_json(raw, REGISTER)
    assert message in str(info.value)


def test_an_integer_field_takes_an_integral_number_as_json_schema_does() -> None:
    # 229.0 is an integer to JSON Schema (and to the OpenAPI file): accepted, and stored as an int
    body = parse_json(b'{"stats": {"staleness": 229.0, "clock": 3}}', HEARTBEAT)
    assert body == {"stats": {"staleness": 229, "clock": 3}} and type(body["stats"]["staleness"]) is int
    registered = parse_json(b'{"capabilities": {"device": "cpu", "memory_mb": 531887735.0}}', REGISTER)
    assert type(registered["capabilities"]["memory_mb"]) is int
    with pytest.raises(InvalidBody, match=r"stats.staleness: expected an integer, got 229.5"):
        parse_json(b'{"stats": {"staleness": 229.5}}', HEARTBEAT)
    with pytest.raises(InvalidBody, match=r"capabilities.threads: must be <= 4096, got 5000"):
        parse_json(b'{"capabilities": {"device": "cpu", "threads": 5e3}}', REGISTER)  # bounds after the cast
    with pytest.raises(InvalidBody, match=r"stats\.clock: expected an integer, got inf"):
        parse_json(b'{"stats": {"clock": Infinity}}', HEARTBEAT)


def test_heartbeat_body_checks_stats() -> None:
    assert parse_json(b"", HEARTBEAT, allow_empty=True) == {}
    assert parse_json(b'{"stats": {"loss": 0.1, "freshness_s": [0.5, 1]}}', HEARTBEAT) == {
        "stats": {"loss": 0.1, "freshness_s": [0.5, 1]}}
    with pytest.raises(InvalidBody, match=r"stats.freshness_s\[1\]: expected a number"):
        parse_json(b'{"stats": {"freshness_s": [0.5, "x"]}}', HEARTBEAT)
    with pytest.raises(InvalidBody, match=r"stats\.loss: expected a finite number"):
        parse_json(b'{"stats": {"loss": NaN}}', HEARTBEAT)


def test_a_config_change_may_set_or_unset_the_tables_own_mode_and_bound() -> None:
    assert parse_json(b'{"table_consistency": "asp", "table_staleness": 8}', CONFIG_CHANGE) == {
        "table_consistency": "asp", "table_staleness": 8}
    assert parse_json(b'{"table_consistency": null, "table_staleness": null}', CONFIG_CHANGE) == {
        "table_consistency": None, "table_staleness": None}  # null: follow the dense part again
    for raw, message in [(b'{"table_consistency": "eventual"}', "table_consistency: must be one of bsp, ssp, asp"),
                         (b'{"table_staleness": -1}', "table_staleness: must be >= 0"),
                         (b'{"table_staleness": 1001}', "table_staleness: must be <= 1000"),
                         (b'{"table_staleness": 2.5}', "table_staleness: expected an integer, got 2.5"),
                         # the dense part's own fields take no null: they have no part to follow
                         (b'{"consistency": null}', "consistency: expected a string, got NoneType")]:
        with pytest.raises(InvalidBody, match=message):
            parse_json(raw, CONFIG_CHANGE)


def test_lease_checker_wakes_at_the_soonest_expiry() -> None:
    assert next_check_s(empty(range(2)), 0.75, 0) == 0.75
    s, _ = register(empty(range(2)), "a", now=0, lease=3000)
    assert next_check_s(s, 0.75, 0) == 0.75
    assert next_check_s(s, 0.75, 2900) == pytest.approx(0.101)
    assert next_check_s(s, 0.75, 5000) == 0.001
