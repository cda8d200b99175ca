"""Checkpoints: a consistent snapshot restored into an empty Redis resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis as redis_lib
import torch
from test_services_util import set_membership, small_model

from services import (
    OffsetConflictError, OptimizerConfig, ParameterServer, ParameterStore, Pusher, ServerSettings,
    restore_checkpoint, save_checkpoint, unapplied_updates,
)
from services.checkpoint import FORMAT, CheckpointError
from streamtrain import cli
from common.keys import JobKeys

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
    assert save_checkpoint(redis, JOB, str(path)) == 2

    assert restore_checkpoint(fresh, str(path)) == 2
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
    assert fresh.hgetall(keys.optimizer_steps) == redis.hgetall(keys.optimizer_steps) != {}
    state = [keys.optimizer_state(i, s) for i in range(6) for s in (0, 1)]
    assert fresh.mget(state) == redis.mget(state) and None not in redis.mget(state)
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
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{JOB}-v000000000002.pt", f"{JOB}-v000000000004.pt"]
    fresh_job = "restored"
    assert restore_checkpoint(redis, str(tmp_path / f"{JOB}-v000000000004.pt"), job=fresh_job) == 4
    assert unapplied_updates(redis, fresh_job) == 1  # the 5th update was still pending then
    restored = ParameterServer(ServerSettings(redis_url=redis_url, job=fresh_job), client=redis)
    restored.load()
    assert restored.step() == 1  # its re-keyed gradient blobs are there
    assert torch.equal(ParameterStore(redis, fresh_job).pull().tensors["w"],
                       ParameterStore(redis, JOB).pull().tensors["w"])
