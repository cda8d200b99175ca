"""The parameter server's decisions (``services.server.core``), without Redis, threads or a clock."""

from __future__ import annotations

import dataclasses

import pytest

from services.server.core import (
    Checkpoint,
    DeleteOrphans,
    Housekeep,
    Policy,
    Read,
    Reload,
    ServerCore,
    SweepBlobs,
    SweepTables,
    WritePlan,
)
from services.settings import ServerSettings


def core(**settings: object) -> ServerCore:
    """A core with the server's default settings but ``settings``."""
    return ServerCore(Policy.of(dataclasses.replace(ServerSettings(), **settings)))


def test_the_policy_takes_its_fields_from_the_servers_settings() -> None:
    settings = ServerSettings(group=1, groups=2, batch=3, persist_every=4, compact_fraction=0.5, compact_every=6,
                              audit_horizon_s=7.0, housekeeping_s=8.0, sweep_every_s=9.0, table_sweep_every_s=10.0,
                              sweep_grace_s=11.0, checkpoint_every=12)
    policy = Policy.of(settings)
    assert dataclasses.asdict(policy) == {f.name: getattr(settings, f.name) for f in dataclasses.fields(Policy)}
    assert (policy.group, policy.batch, policy.checkpoint_every, policy.sweep_grace_s) == (1, 3, 12, 11.0)


# -- reload or read ---------------------------------------------------------------------------------

def test_a_round_reloads_until_memory_matches_redis() -> None:
    c = core(batch=5)
    assert c.next_round() == Reload()  # nothing loaded yet
    c.loaded(3)
    assert c.next_round() == Read(5) and c.version == 3
    c.computing()  # a batch is being applied in memory
    assert c.next_round() == Reload()
    c.written(4)
    assert c.next_round() == Read(5) and c.version == 4
    c.computing()
    assert c.lost() == Reload() and c.next_round() == Reload()  # another server of the group won
    c.loaded(6)
    c.outage()
    assert c.next_round() == Reload()
    c.loaded(6)
    c.computing()
    assert c.idle(0.0) is not None and c.next_round() == Read(5)  # nothing computed after all


def test_written_keeps_the_newest_version() -> None:
    c = core()
    c.loaded(9)
    c.written(7)
    assert c.version == 9


# -- persist ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("updates", "grad_bytes", "state_bytes", "due"), [
    (1, 10, 1000, False),
    (3, 10, 1000, False),     # below persist_every, and the gradients are smaller than the state
    (4, 10, 1000, True),      # persist_every updates since the last persist
    (5, 10, 1000, True),
    (1, 999, 1000, False),
    (1, 1000, 1000, True),    # replaying would read as many bytes as persisting writes
    (1, 0, 0, True),          # an optimizer without state (sgd without momentum): every write
])
def test_persist_every_n_updates_or_once_the_gradients_outweigh_the_state(
        updates: int, grad_bytes: int, state_bytes: int, due: bool) -> None:
    c = core(persist_every=4)
    assert c.persist_due(updates=updates, grad_bytes=grad_bytes, state_bytes=state_bytes) is due
    assert c.write_plan(0.0, updates=updates, grad_bytes=grad_bytes, state_bytes=state_bytes).persist is due


# -- compaction -------------------------------------------------------------------------------------

def test_a_shard_is_compacted_once_its_deltas_outgrow_a_fraction_of_it() -> None:
    c = core(compact_fraction=0.5, compact_every=1000)
    # 100 values: 400 bytes, half of it 200
    assert not c.compact(delta_bytes=150, new_delta=50, numel=100, base=0, version=10)  # 200: not above
    assert c.compact(delta_bytes=150, new_delta=51, numel=100, base=0, version=10)
    assert c.compact(delta_bytes=0, new_delta=201, numel=100, base=0, version=10)  # one delta alone
    assert not core(compact_fraction=1.0).compact(delta_bytes=300, new_delta=100, numel=100, base=0, version=1)
    assert core(compact_fraction=0.0).compact(delta_bytes=0, new_delta=1, numel=100, base=0, version=1)


def test_a_shard_is_compacted_once_its_base_is_compact_every_versions_old() -> None:
    c = core(compact_every=10)
    assert not c.compact(delta_bytes=0, new_delta=1, numel=100, base=5, version=14)
    assert c.compact(delta_bytes=0, new_delta=1, numel=100, base=5, version=15)
    assert core(compact_every=1).compact(delta_bytes=0, new_delta=1, numel=100, base=5, version=6)


# -- housekeeping -----------------------------------------------------------------------------------

def test_the_first_write_housekeeps_then_every_housekeeping_s() -> None:
    c = core(housekeeping_s=10.0, audit_horizon_s=1.5)
    c.loaded(0)
    assert c.write_plan(100.0, updates=1, grad_bytes=0, state_bytes=8) == WritePlan(False, Housekeep(1500))
    c.housekept(100.0, more=False)
    assert c.write_plan(109.9, updates=1, grad_bytes=0, state_bytes=8).housekeeping is None
    assert c.idle(109.9) is None
    assert c.write_plan(110.0, updates=1, grad_bytes=0, state_bytes=8).housekeeping == Housekeep(1500)
    c.housekept(110.0, more=True)  # entries past the horizon left: the next write trims more at once
    assert c.idle(110.0) == Housekeep(1500)
    assert core(housekeeping_s=0.0, audit_horizon_s=0.0).idle(5.0) == Housekeep(0)


def test_a_refused_idle_housekeeping_waits_and_reloads() -> None:
    c = core(housekeeping_s=10.0)
    c.loaded(0)
    assert c.idle(50.0) is not None
    c.housekeeping_refused(50.0)
    assert c.next_round() == Reload()
    assert c.idle(59.0) is None and c.idle(60.0) is not None


# -- sweeps -----------------------------------------------------------------------------------------

def test_the_sweeps_run_at_the_first_round_then_on_their_schedules() -> None:
    c = core(sweep_every_s=30.0, table_sweep_every_s=1.0)
    assert c.tick(0.0) == [SweepBlobs(), SweepTables()]
    c.blobs_swept(0.0)
    c.tables_swept(0.0)
    assert c.tick(0.5) == []
    assert c.tick(1.0) == [SweepTables()]
    assert c.tick(1.0) == [SweepTables()]  # not done yet (a failed sweep is tried again next round)
    c.tables_swept(1.0)
    assert c.tick(30.0) == [SweepBlobs(), SweepTables()]
    every_round = core(sweep_every_s=0.0, table_sweep_every_s=0.0)
    every_round.blobs_swept(5.0)
    every_round.tables_swept(5.0)
    assert every_round.tick(5.0) == [SweepBlobs(), SweepTables()]


def test_orphaned_blobs_go_after_the_grace_and_logged_ones_never() -> None:
    c = core(sweep_grace_s=10.0)
    assert c.blobs_found(0.0, ["a", "b", "logged"], {"logged"}) == DeleteOrphans(())
    assert c.orphans == {"a": 0.0, "b": 0.0}
    assert c.blobs_found(5.0, ["a", "b", "c", "logged"], {"logged"}) == DeleteOrphans(())
    assert c.blobs_found(9.9, ["a", "c"], set()) == DeleteOrphans(())  # b is gone: forgotten
    assert c.orphans == {"a": 0.0, "c": 5.0}
    assert c.blobs_found(10.0, ["a", "c"], set()) == DeleteOrphans(("a",))
    assert c.orphans == {"c": 5.0}
    assert c.blobs_found(12.0, ["c"], {"c"}) == DeleteOrphans(())  # logged after all (a slow push)
    assert c.orphans == {}
    assert c.blobs_found(13.0, ["c"], set()) == DeleteOrphans(())  # unnamed again: a new grace
    assert c.blobs_found(22.9, ["c"], set()) == DeleteOrphans(())
    assert c.blobs_found(23.0, ["c"], set()) == DeleteOrphans(("c",))
    c.blobs_found(24.0, ["d"], set())
    c.blobs_found(25.0, [], set())  # nothing found: nothing remembered
    assert c.orphans == {}


# -- the automatic checkpoint -----------------------------------------------------------------------

def test_a_checkpoint_every_n_versions_of_group_0() -> None:
    c = core(checkpoint_every=3)
    c.loaded(0)
    started = []
    for version in range(1, 10):
        for todo in c.written(version):
            started.append(todo.version)
            assert c.checkpoint_ended() == []
    assert started == [3, 6, 9]


def test_no_checkpoint_when_off_or_on_another_group() -> None:
    for c in (core(checkpoint_every=0), core(group=1, groups=2, checkpoint_every=2)):
        c.loaded(0)
        assert [c.written(v) for v in range(1, 6)] == [[]] * 5


def test_a_batch_that_jumps_past_a_multiple_checkpoints_at_its_version() -> None:
    c = core(checkpoint_every=4)
    c.loaded(0)
    assert c.written(3) == [] and c.written(9) == [Checkpoint(9)]
    assert c.checkpoint_ended() == []
    assert c.written(11) == [] and c.written(12) == [Checkpoint(12)]


def test_one_checkpoint_at_a_time_and_the_next_when_it_ends() -> None:
    c = core(checkpoint_every=2)
    c.loaded(0)
    assert c.written(1) == [] and c.written(2) == [Checkpoint(2)]
    assert c.checkpointing == 2
    assert c.written(3) == [] and c.written(4) == [] and c.written(5) == []  # one runs: none starts
    assert c.checkpoint_ended() == [Checkpoint(5)]  # 4 was crossed meanwhile: at the version now
    assert c.checkpointing == 5
    assert c.checkpoint_ended() == []  # nothing crossed while it ran
    assert c.written(6) == [Checkpoint(6)]


def test_a_checkpoint_that_ended_without_a_crossing_starts_none() -> None:
    c = core(checkpoint_every=10)
    c.loaded(0)
    assert c.written(10) == [Checkpoint(10)]
    assert c.written(19) == []
    assert c.checkpoint_ended() == []
    assert c.checkpointing is None and c.written(20) == [Checkpoint(20)]


def test_a_restarted_server_checkpoints_at_its_first_write() -> None:
    """As before the core: the last checkpoint is unknown after a start, so the first write past
    version ``checkpoint_every`` saves one; loading alone saves none."""
    c = core(checkpoint_every=5)
    c.loaded(42)
    assert c.checkpointing is None and c.next_round() == Read(16)
    assert c.written(43) == [Checkpoint(43)]
    assert c.checkpoint_ended() == [] and c.written(44) == []
