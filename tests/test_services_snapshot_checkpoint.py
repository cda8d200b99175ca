"""Checkpoints: a consistent snapshot restored into an empty Redis resumes exactly."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from unittest.mock import Mock

import pytest
import redis as redis_lib
import torch
from plane_util import accounting_left, optimizer_state, optimizer_steps, set_membership, small_model

from common.keys import JobKeys
from services import (
    OffsetConflictError,
    OptimizerConfig,
    ParameterServer,
    ParameterStore,
    Pusher,
    ServerSettings,
    restore_checkpoint,
    save_checkpoint,
    unapplied_updates,
)
from services.server import apply as apply_module
from services.snapshot import cut as checkpoint_cut
from services.snapshot.checkpoint import FORMAT, CheckpointError
from streamtrain import cli
from streamtrain.launcher import wait_until

JOB = "ckptjob"


def grads(c: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(c)
    return {k: torch.randn(v.shape, generator=g) for k, v in small_model().items()}


def drain(client: redis_lib.Redis, url: str, limit: int | None = None, *, persist: bool = False) -> None:
    """Apply (up to ``limit``) pending updates synchronously with a new server (which first
    replays what its persisted optimizer state lacks); ``persist`` then persists its state."""
    server = ParameterServer(ServerSettings(redis_url=url, job=JOB, block_ms=1, batch=1, persist_every=1000),
                             client=client)
    server.load()
    applied = 0
    while (limit is None or applied < limit) and server.step():
        applied += 1
    if persist:
        assert server.persist()


@pytest.fixture
def fresh_url(redis_server) -> str:
    """URL (with the password) of another flushed database: the "empty Redis" to restore into."""
    return redis_server.url_for(redis_server.next_db())


@pytest.fixture
def fresh(fresh_url: str) -> redis_lib.Redis:
    client = redis_lib.Redis.from_url(fresh_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def test_restore_into_an_empty_redis_resumes_from_committed_offsets(
        redis: redis_lib.Redis, redis_url: str, fresh: redis_lib.Redis, fresh_url: str, tmp_path: Path) -> None:
    store = ParameterStore(redis, JOB)
    store.init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig(name="adam", lr=0.01))
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    pusher = Pusher(redis, JOB, "a", codec="fp16")
    for c in range(1, 5):
        pusher.push(grads(c), generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)})
    drain(redis, redis_url, limit=2)  # 2 applied (the log keeps them: not persisted), 2 pending
    path = tmp_path / "ckpt.pt"
    assert save_checkpoint(redis, JOB, str(path)) == (2,)

    assert restore_checkpoint(fresh, str(path)) == (2,)
    keys = JobKeys(JOB)
    assert fresh.hgetall(keys.offsets) == {b"0": b"40"}
    assert fresh.xlen(keys.update_log) == 4 and unapplied_updates(fresh, JOB) == 2
    with pytest.raises(CheckpointError, match="already has a model"):
        restore_checkpoint(fresh, str(path))

    # both the original and the restored copy apply the pending updates and one more step
    for client, url in ((redis, redis_url), (fresh, fresh_url)):
        set_membership(client, JOB, {"a": [0]}, generation=2)  # the coordinator re-registers the trainer
        resumed = Pusher(client, JOB, "a", codec="fp16")
        with pytest.raises(OffsetConflictError, match="duplicate"):
            resumed.push(grads(5), generation=2, clock=5, offsets={0: (30, 40)})
        resumed.push(grads(5), generation=2, clock=5, offsets={0: (40, 50)})
        drain(client, url, persist=True)  # replays updates 1-2 into Adam's state, applies 3-5
    original, restored = ParameterStore(redis, JOB).pull(), ParameterStore(fresh, JOB).pull()
    assert original.version == restored.version == 5
    for k in original.tensors:
        assert torch.equal(original.tensors[k], restored.tensors[k])
    assert optimizer_steps(fresh, JOB) == optimizer_steps(redis, JOB) != {}
    state = optimizer_state(redis, JOB, 6, 2)
    assert optimizer_state(fresh, JOB, 6, 2) == state and None not in state
    assert fresh.xlen(keys.update_log) == redis.xlen(keys.update_log) == 0


def test_checkpoint_cli_and_bad_files(redis: redis_lib.Redis, redis_url: str, fresh: redis_lib.Redis,
                                      fresh_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ParameterStore(redis, JOB).init_model(small_model(), shard_elems=64)
    path = tmp_path / "c.pt"
    assert cli.main(["checkpoint", "save", str(path), "--redis-url", redis_url, "--job", JOB]) == 0
    url = fresh_url
    assert cli.main(["checkpoint", "restore", str(path), "--redis-url", url, "--job", "copy"]) == 0
    assert "restored version 0" in capsys.readouterr().out
    assert torch.equal(ParameterStore(fresh, "copy").pull().tensors["w"], small_model()["w"])
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        restore_checkpoint(fresh, str(junk))
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=f"is not a {FORMAT} file"):
        restore_checkpoint(fresh, str(tmp_path / "other.pt"))
    torch.save({"format": "streamtrain-checkpoint-2", "job": JOB}, tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match=f"is not a {FORMAT} file \\(it is streamtrain-checkpoint-2, written "
                                              "before a job's keys were split"):
        restore_checkpoint(fresh, str(tmp_path / "old.pt"))
    assert cli.main(["checkpoint", "restore", str(tmp_path / "old.pt"), "--redis-url", url]) == 1
    assert "streamtrain checkpoint restore: " in capsys.readouterr().err


def test_server_saves_a_checkpoint_every_n_versions(redis: redis_lib.Redis, redis_url: str,
                                                    tmp_path: Path) -> None:
    ParameterStore(redis, JOB).init_model(small_model(), shard_elems=64)
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    pusher = Pusher(redis, JOB, "a")
    for c in range(1, 6):
        pusher.push(grads(c), generation=1, clock=c)
    server = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, checkpoint_every=2,
                                            checkpoint_dir=str(tmp_path)), client=redis)
    server.load()
    for eid, fields in redis.xrange(JobKeys(JOB).update_log):
        assert server.apply_entries([(eid, fields)]) == 1
        assert server.wait_checkpoint(timeout_s=60)  # on its own thread: let it cut before the next apply
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{JOB}-v000000000002.pt", f"{JOB}-v000000000004.pt"]
    fresh_job = "restored"
    assert restore_checkpoint(redis, str(tmp_path / f"{JOB}-v000000000004.pt"), job=fresh_job) == (4,)
    assert unapplied_updates(redis, fresh_job) == 1  # the 5th update was still pending then
    restored = ParameterServer(ServerSettings(redis_url=redis_url, job=fresh_job), client=redis)
    restored.load()
    assert restored.step() == 1  # its re-keyed gradient blobs are there
    assert torch.equal(ParameterStore(redis, fresh_job).pull().tensors["w"],
                       ParameterStore(redis, JOB).pull().tensors["w"])


def test_the_automatic_checkpoint_runs_beside_the_apply_loop(redis: redis_lib.Redis, redis_url: str,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The automatic checkpoint runs on a thread of its own: applying goes on while it saves, one
    runs at a time (a multiple of checkpoint_every crossed meanwhile starts the next when it ends,
    at the version then), and close() waits for the one running."""
    import services.snapshot.checkpoint as checkpoint_module

    ParameterStore(redis, JOB).init_model(small_model(), shard_elems=64)
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    pusher = Pusher(redis, JOB, "a")
    for c in range(1, 8):
        pusher.push(grads(c), generation=1, clock=c)
    release, started = threading.Event(), threading.Semaphore(0)
    saves: list[tuple[str, str]] = []

    def blocked_save(client: redis_lib.Redis, job: str, path: str) -> tuple[int, ...]:
        saves.append((Path(path).name, threading.current_thread().name))
        started.release()
        assert release.wait(60)
        return (0,)

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", blocked_save)
    server = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, checkpoint_every=2,
                                            checkpoint_dir=str(tmp_path)), client=redis)
    server.load()
    entries = redis.xrange(JobKeys(JOB).update_log)
    for entry in entries[:2]:
        assert server.apply_entries([entry]) == 1
    assert started.acquire(timeout=30) and saves == [(f"{JOB}-v000000000002.pt", f"ps-{JOB}-checkpoint")]
    for entry in entries[2:5]:  # the save at version 2 blocks: applying goes on, no second save starts
        assert server.apply_entries([entry]) == 1
    assert server.version == 5 and len(saves) == 1 and not server.wait_checkpoint(timeout_s=0.1)
    release.set()
    assert server.wait_checkpoint(timeout_s=30)
    release.clear()
    assert server.apply_entries([entries[5]]) == 1  # the end is seen: versions 4 and 6 were crossed
    assert started.acquire(timeout=30) and [name for name, _ in saves] == [f"{JOB}-v000000000002.pt",
                                                                          f"{JOB}-v000000000006.pt"]
    assert server.apply_entries([entries[6]]) == 1 and len(saves) == 2
    closing = threading.Thread(target=server.close)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # close() waits for the save running
    release.set()
    closing.join(30)
    assert not closing.is_alive() and server.wait_checkpoint(timeout_s=0) and len(saves) == 2
    assert ParameterStore(redis, JOB).version() == 7


# -- two shard groups ------------------------------------------------------------------------------

TWO = "ckpttwo"


def wide_model() -> dict[str, torch.Tensor]:
    """Five shards of up to 1024 values (two groups: 0, 2, 4 and 1, 3): top-k gradients at 2 % are
    far smaller than the optimizer state, so the servers persist only when told to."""
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(32, 128, generator=g), "b": torch.randn(128, generator=g)}


def wide_grads(c: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(c)
    return {k: torch.randn(v.shape, generator=g) for k, v in wide_model().items()}


def two_servers(client: redis_lib.Redis, url: str, job: str = TWO) -> list[ParameterServer]:
    servers = [ParameterServer(ServerSettings(redis_url=url, job=job, group=g, groups=2, block_ms=1, batch=1,
                                              persist_every=1000), client=client) for g in (0, 1)]
    for server in servers:
        server.load()
    return servers


def drain_all(servers: list[ParameterServer]) -> None:
    """Every server applies everything pending, then persists."""
    for server in servers:
        while server.step():
            pass
        assert server.persist()


def assert_accounted_once(client: redis_lib.Redis, job: str, updates: list[str]) -> None:
    """Every update accounted exactly once, nothing pending, no accounting left open."""
    keys = JobKeys(job)
    entries = [fields for _, fields in client.xrange(keys.applied_samples)]
    assert sorted(f[b"update"].decode() for f in entries) == sorted(updates)  # each once
    assert all(f[b"status"] == b"applied" for f in entries)
    assert unapplied_updates(client, job) == 0 and accounting_left(client, job) == []
    assert client.hgetall(keys.group_accounted) == {b"0": updates[-1].encode(), b"1": updates[-1].encode()}


def assert_same_plane(a: redis_lib.Redis, b: redis_lib.Redis, job: str, shards: int, opt_slots: int, *,
                      same_versions: bool = True) -> None:
    """The same parameters and persisted optimizer state (and group versions: the same batching)."""
    pa, pb = ParameterStore(a, job).pull(), ParameterStore(b, job).pull()
    assert pa.group_versions == pb.group_versions or not same_versions
    for name in pa.tensors:
        assert torch.equal(pa.tensors[name], pb.tensors[name]), name
    assert optimizer_steps(a, job) == optimizer_steps(b, job) != {}
    assert optimizer_state(a, job, shards, opt_slots) == optimizer_state(b, job, shards, opt_slots)


def two_group_job(client: redis_lib.Redis, updates: int) -> tuple[Pusher, list[str]]:
    """A two-group job with ``updates`` pushed: the pusher and the updates' ids."""
    ParameterStore(client, TWO).init_model(wide_model(), shard_elems=1024, groups=2,
                                           optimizer=OptimizerConfig(name="lazyadam", lr=0.01))
    set_membership(client, TWO, {"a": [0]}, generation=1)
    pusher = Pusher(client, TWO, "a", codec="topk", codec_options={"density": 0.02})
    return pusher, [pusher.push(wide_grads(c), generation=1, clock=c, offsets={0: (c - 1, c)}).update_id
                    for c in range(1, updates + 1)]


def race_the_job_read(monkeypatch: pytest.MonkeyPatch, *moves: Callable[[], None]) -> list[int]:
    """Run ``moves[k]`` in save attempt k between its reads of the groups and of the job's slot;
    returns the attempts seen."""
    real = checkpoint_cut._read_job
    attempts: list[int] = []

    def racing(client: redis_lib.Redis, job: str, named: list[str]) -> object:
        attempts.append(len(attempts) + 1)
        if len(attempts) <= len(moves):
            moves[len(attempts) - 1]()
        return real(client, job, named)

    monkeypatch.setattr(checkpoint_cut, "_read_job", racing)
    return attempts


def test_two_groups_applying_during_a_save_restore_to_the_groups_cut(
        redis: redis_lib.Redis, redis_url: str, fresh: redis_lib.Redis, fresh_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 0 applies and accounts between the save's reads of the groups and of the job's slot;
    group 1 was cut off between the halves of an apply: the checkpoint is the groups' cut, and the
    restored job applies and accounts every update once."""
    _, ids = two_group_job(redis, 6)
    g0, g1 = two_servers(redis, redis_url)
    for _ in range(3):
        assert g0.step() == 1
    for _ in range(4):
        assert g1.step() == 1
    with monkeypatch.context() as patch:
        patch.setattr(apply_module, "_account", Mock(side_effect=redis_lib.ConnectionError("killed")))
        with pytest.raises(redis_lib.ConnectionError):
            g1.step()  # group 1's half of update 5 is written and its plan kept; the job's half is not
    keys = JobKeys(TWO)
    assert redis.hget(keys.group_accounted, "1") == ids[3].encode()

    def group_0_moves() -> None:  # completes update 4 and reports update 5
        assert g0.step() == 1 and g0.step() == 1

    attempts = race_the_job_read(monkeypatch, group_0_moves)
    path = tmp_path / "two.pt"
    assert save_checkpoint(redis, TWO, str(path)) == (3, 5)
    assert attempts == [1]
    assert redis.hgetall(keys.group_accounted) == {b"0": ids[4].encode(), b"1": ids[3].encode()}
    assert restore_checkpoint(fresh, str(path)) == (3, 5)
    # the cut: group 0 applied 1-3; group 1 applied 1-5, 5 not accounted yet (its plan is kept)
    assert fresh.hgetall(keys.group_accounted) == {b"0": ids[2].encode(), b"1": ids[3].encode()}
    assert fresh.get(keys.group(1).unaccounted) == redis.get(keys.group(1).unaccounted) is not None
    assert unapplied_updates(fresh, TWO) == 3  # update 4 is complete in the original, not in the cut
    assert [f[b"update"].decode() for _, f in fresh.xrange(keys.applied_samples)] == ids[:3]
    assert fresh.hget(keys.applied_clocks, "a") == b"3" and redis.hget(keys.applied_clocks, "a") == b"4"
    assert accounting_left(fresh, TWO) == [keys.applied_by(ids[3]).encode()]  # group 1 reported it
    assert fresh.hgetall(keys.offsets) == {b"0": b"6"} and fresh.xlen(keys.update_log) == 6

    drain_all([g0, g1])
    restored = two_servers(fresh, fresh_url)  # group 1 records its plan, replays 1-5, applies 6
    drain_all(restored)
    for client in (redis, fresh):
        assert_accounted_once(client, TWO, ids)
    assert_same_plane(redis, fresh, TWO, shards=5, opt_slots=2)


def test_a_save_reads_again_when_a_blob_it_needs_is_gone(
        redis: redis_lib.Redis, redis_url: str, fresh: redis_lib.Redis, fresh_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An update pushed during the save is applied and persisted by group 0 at once (its blob
    deleted) before the save read it: the save reads everything again."""
    pusher, ids = two_group_job(redis, 3)
    g0, g1 = two_servers(redis, redis_url)
    assert g0.step() == 1

    def push_apply_persist() -> None:
        ids.append(pusher.push(wide_grads(4), generation=1, clock=4, offsets={0: (3, 4)}).update_id)
        while g0.step():
            pass
        assert g0.persist()

    attempts = race_the_job_read(monkeypatch, push_apply_persist)
    path = tmp_path / "two.pt"
    assert save_checkpoint(redis, TWO, str(path)) == (4, 0)
    assert attempts == [1, 2]
    assert restore_checkpoint(fresh, str(path)) == (4, 0)
    drain_all([g0, g1])
    drain_all(two_servers(fresh, fresh_url))
    for client in (redis, fresh):
        assert_accounted_once(client, TWO, ids)
    assert_same_plane(redis, fresh, TWO, shards=5, opt_slots=2)


def test_a_save_while_both_groups_apply_restores_every_update_once(
        redis: redis_lib.Redis, redis_url: str, fresh: redis_lib.Redis, fresh_url: str, tmp_path: Path) -> None:
    """Both groups' servers run and persist often while a trainer pushes and the save reads; the
    restored job, given the records after its committed offset again, ends with the same model and
    every update accounted once."""
    total = 12
    _, ids = two_group_job(redis, 0)
    keys = JobKeys(TWO)
    servers = [ParameterServer(ServerSettings(redis_url=redis_url, job=TWO, group=g, groups=2, block_ms=5, batch=2,
                                              persist_every=3)) for g in (0, 1)]
    pushing = redis_lib.Redis.from_url(redis_url)
    # no error feedback: the resumed trainer sends the very gradients the original one sent
    pusher = Pusher(pushing, TWO, "a", codec="topk", codec_options={"density": 0.02}, error_feedback=False)

    def push_all() -> None:
        for c in range(1, total + 1):
            ids.append(pusher.push(wide_grads(c), generation=1, clock=c, offsets={0: (c - 1, c)}).update_id)

    trainer = threading.Thread(target=push_all, name="test-pusher")
    path = tmp_path / "running.pt"
    try:
        for server in servers:
            server.start()
        trainer.start()
        wait_until(lambda: len(ids) >= 4, 30, what="4 pushes")
        save_checkpoint(redis, TWO, str(path))
        trainer.join(60)
        wait_until(lambda: len(ids) == total and unapplied_updates(redis, TWO) == 0, 60, what="everything applied")
    finally:
        trainer.join(60)
        for server in servers:
            server.close()
        pushing.close()
    assert all(server.error is None for server in servers)

    restore_checkpoint(fresh, str(path))
    committed = int(fresh.hget(keys.offsets, "0"))
    assert 4 <= committed <= total
    set_membership(fresh, TWO, {"a": [0]}, generation=1)
    resumed = Pusher(fresh, TWO, "a", codec="topk", codec_options={"density": 0.02}, error_feedback=False)
    again = [resumed.push(wide_grads(c), generation=1, clock=c, offsets={0: (c - 1, c)}).update_id
             for c in range(committed + 1, total + 1)]
    drain_all(two_servers(fresh, fresh_url))
    assert_accounted_once(redis, TWO, ids)
    assert_accounted_once(fresh, TWO, ids[:committed] + again)
    assert_same_plane(redis, fresh, TWO, shards=5, opt_slots=2, same_versions=False)


def test_a_cut_that_cannot_be_restored_is_read_again_or_refused() -> None:
    """Pure: the log trimmed past a group's persisted cursor is read again; slots that contradict
    each other (the job accounts a group behind its cursor with no plan leading there) are refused."""

    def group(cursor: str, persisted: str) -> checkpoint_cut.GroupCut:
        return checkpoint_cut.GroupCut(version=1, cursor=cursor, persisted=persisted, plan=None, hashes={}, shards={},
                                    optimizer={}, deltas={}, blobs={})

    def job(log: list[str], accounted: dict[int, str], persisted: dict[int, str]) -> checkpoint_cut.JobCut:
        return checkpoint_cut.JobCut(meta=b"{}", log=[(eid, {}) for eid in log],
                                  hashes={"offsets": {}, "clocks": {}, "applied_clocks": {}, "audit_floor": {}},
                                  unapplied=0, accounted=accounted, persisted=persisted, applied_samples=[],
                                  applied_by={})

    groups = [group("5-0", "3-0"), group("5-0", "2-0")]
    state = checkpoint_cut._settle(groups, job(["2-0", "3-0", "4-0", "5-0"], {0: "5-0", 1: "5-0"},
                                           {0: "3-0", 1: "2-0"}))
    assert state.accounted == {0: "5-0", 1: "5-0"} and state.persisted == {0: "3-0", 1: "2-0"}
    with pytest.raises(checkpoint_cut._Moved, match="trimmed past"):  # group 1 persisted 4-0 and the log lost 3-0
        checkpoint_cut._settle(groups, job(["4-0", "5-0"], {0: "5-0", 1: "5-0"}, {0: "4-0", 1: "4-0"}))
    with pytest.raises(CheckpointError, match="group 1: the job's slot accounts this group up to '4-0', behind its "
                                              "cursor '5-0'"):
        checkpoint_cut._settle(groups, job(["2-0", "3-0", "4-0", "5-0"], {0: "5-0", 1: "4-0"}, {}))
