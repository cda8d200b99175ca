"""Embedding tables in checkpoints and exports, on the real Redis: tables larger than one piece saved
and restored bit for bit as of the groups' cut while the servers keep applying (copy-on-write
shadows), a restored job that ends like one never saved, a save that waits out a dead save's cut,
files refused naming what is missing, and tables exported in pieces."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import redis as redis_lib
import safetensors.numpy
import safetensors.torch
import torch
from plane_util import accounting_left, small_model
from test_services_tables import ITEM, USER, batch_rows, setup, stored

from common.keys import JobKeys
from services import (
    ParameterServer,
    ParameterStore,
    Pusher,
    ServerSettings,
    restore_checkpoint,
    save_checkpoint,
)
from services.errors import CheckpointError
from services.snapshot import cut as checkpoint_cut
from services.snapshot.checkpoint_tables import SavedPiece, tables_folder
from services.tables import TableSpec
from services.tables.feed import FeedGoneError, feed_heads, read_group
from services.tables.rows import SEEN_DTYPE, row_dtype
from services.tables.store import sweep_rows
from streamtrain import cli

JOB = "saved"
CALM = "calm"
"""A job fed the same pushes and never saved or restored."""
GROUPS = 2
UPDATES = 10


def push(redis: redis_lib.Redis, jobs: tuple[str, ...], clocks: range) -> None:
    for job in jobs:
        pusher = Pusher(redis, job, "a")
        for c in clocks:
            pusher.push(None, generation=1, clock=c, offsets={0: (10 * (c - 1), 10 * c)},
                        samples=[("prod", 10 * (c - 1), 10)], batch_size=10, rows=batch_rows(c))


def servers(client: redis_lib.Redis, url: str, job: str) -> list[ParameterServer]:
    """One synchronous server per group (each ``step()`` applies the group's next update)."""
    out = [ParameterServer(ServerSettings(redis_url=url, job=job, group=g, groups=GROUPS, block_ms=1, batch=1,
                                          persist_every=1000), client=client) for g in range(GROUPS)]
    for s in out:
        s.load()
    return out


def step(group_servers: list[ParameterServer], n: int) -> None:
    for s in group_servers:
        for _ in range(n):
            assert s.step() == 1


def drain(group_servers: list[ParameterServer]) -> None:
    for s in group_servers:
        while s.step():
            pass


def tables_state(client: redis_lib.Redis, job: str, specs: tuple[TableSpec, ...] = (USER, ITEM),
                 groups: int = GROUPS) -> dict:
    """Every group's rows, sighting records and table counters, as stored (bytes)."""
    out = {}
    for g in range(groups):
        gk = JobKeys(job).group(g)
        out[g] = {"stats": client.hgetall(gk.table_stats)}
        for spec in specs:
            out[g][spec.name] = client.hgetall(gk.table_rows(spec.name))
            out[g][f"{spec.name}:seen"] = client.hgetall(gk.table_seen(spec.name))
    return out


def assert_like_calm(client: redis_lib.Redis, job: str, calm: redis_lib.Redis,
                     specs: tuple[TableSpec, ...] = (USER, ITEM)) -> None:
    """The same rows (version, values, optimizer state bit for bit), sighting counts and counters as
    the job never saved (only the wall-clock stamps differ)."""
    for spec in specs:
        got, want = stored(client, job, spec, GROUPS), stored(calm, CALM, spec, GROUPS)
        assert sorted(got) == sorted(want) and want
        for i in want:
            for field in ("version", "values", "state"):
                assert got[i][field].tobytes() == want[i][field].tobytes(), (spec.name, i, field)
        for g in range(GROUPS):
            seen = [c.hgetall(JobKeys(j).group(g).table_seen(spec.name)) for c, j in ((client, job), (calm, CALM))]
            assert {k: v[:4] for k, v in seen[0].items()} == {k: v[:4] for k, v in seen[1].items()}
    for g in range(GROUPS):
        assert client.hgetall(JobKeys(job).group(g).table_stats) == calm.hgetall(JobKeys(CALM).group(g).table_stats)
    entries = client.xrange(JobKeys(job).applied_samples)
    assert len(entries) == UPDATES and {f[b"status"] for _, f in entries} == {b"applied"}
    assert accounting_left(client, job) == []


def leftovers(client: redis_lib.Redis, job: str) -> list[bytes]:
    """Cuts and shadows left in Redis."""
    return sorted(k for g in range(GROUPS) for pattern in ("table_cut", "shadow:*", "seen_shadow:*", "rows_blob_shadow")
                  for k in client.keys(JobKeys(job).group(g).key(pattern)))


def manifest(path: Path) -> dict:
    return json.loads((Path(tables_folder(str(path))) / "manifest.json").read_text())


# -- checkpoints -----------------------------------------------------------------------------------

def test_a_table_larger_than_a_piece_restores_bit_for_bit_and_resumes_like_a_job_never_saved(
        redis: redis_lib.Redis, redis_url: str, fresh: tuple[redis_lib.Redis, str], tmp_path: Path) -> None:
    fresh_client, fresh_url = fresh
    for job in (JOB, CALM):
        setup(redis, job=job, groups=GROUPS)
    push(redis, (JOB, CALM), range(1, UPDATES + 1))
    saved, calm = servers(redis, redis_url, JOB), servers(redis, redis_url, CALM)
    step(saved, 6)
    step(calm, 6)
    cut = tables_state(redis, JOB)
    pieces: list[SavedPiece] = []
    path = tmp_path / "tables.pt"
    assert save_checkpoint(redis, JOB, str(path), rows_per_piece=3, progress=pieces.append) == (6, 6)

    listed = manifest(path)
    assert listed["format"] == "streamtrain-checkpoint-4-tables" and len(listed["tables"]) == GROUPS * 2
    for entry in listed["tables"]:  # every table of every group is larger than one piece
        g, table = entry["group"], entry["table"]
        assert entry["version"] == 6
        assert entry["rows"]["records"] == len(cut[g][table]) > 3 and len(entry["rows"]["pieces"]) > 1
        assert entry["seen"]["records"] == len(cut[g][f"{table}:seen"])
    assert any(len(cut[g]["item:seen"]) for g in range(GROUPS))  # IDs sighted but not admitted are saved too
    assert [p.records for p in pieces] == [p["records"] for e in listed["tables"] for kind in ("rows", "seen")
                                           for p in e[kind]["pieces"]]
    piece = safetensors.numpy.load_file(str(Path(tables_folder(str(path))) / pieces[0].file))
    assert piece["ids"].dtype == np.int64 and piece["records"].shape == (3, row_dtype(USER).itemsize)
    assert tables_state(redis, JOB) == cut and leftovers(redis, JOB) == []  # the save changed nothing, left nothing

    assert restore_checkpoint(fresh_client, str(path)) == (6, 6)
    assert tables_state(fresh_client, JOB) == cut  # rows, sighting records and counters bit for bit
    # the four updates pending at the cut (their gradient rows saved with them) apply as in the job never saved
    drain(servers(fresh_client, fresh_url, JOB))
    drain(calm)
    assert_like_calm(fresh_client, JOB, redis)
    drain(saved)
    assert_like_calm(redis, JOB, redis)


def expiring(spec: TableSpec) -> TableSpec:
    return TableSpec(spec.name, spec.dim, optimizer=spec.optimizer, admit_after=spec.admit_after,
                     expire_after_s=3600.0)


def expire_everything(redis: redis_lib.Redis, job: str, group: int, spec: TableSpec) -> int:
    """Sweep ``group``'s part of ``spec`` as if ten hours had passed: every row and sighting record goes."""
    removed, cursors = 0, ("0", "0")
    while True:
        done = sweep_rows(redis, job, group, spec, GROUPS, now_ms=2**41, cursor=cursors[0], seen_cursor=cursors[1],
                          count=5)
        removed += done.expired + done.seen_expired
        cursors = (done.cursor, done.seen_cursor)
        if cursors == ("0", "0"):
            return removed


def test_a_save_while_the_servers_apply_and_sweep_restores_the_cut(
        redis: redis_lib.Redis, redis_url: str, fresh: tuple[redis_lib.Redis, str], tmp_path: Path) -> None:
    """Between the save's pieces both groups apply updates (rows change, rows are born, IDs are admitted
    and sighted) and group 1's tables are swept empty: the restore is the cut, rows changed after it
    from their shadows, rows born after it absent, rows expired after it present."""
    fresh_client, fresh_url = fresh
    specs = (expiring(USER), expiring(ITEM))
    for job in (JOB, CALM):
        setup(redis, job=job, groups=GROUPS, tables=specs)
    push(redis, (JOB, CALM), range(1, UPDATES + 1))
    saved, calm = servers(redis, redis_url, JOB), servers(redis, redis_url, CALM)
    step(saved, 5)
    step(calm, 5)
    cut = tables_state(redis, JOB)
    moved: list[SavedPiece] = []

    def meanwhile(piece: SavedPiece) -> None:
        if moved:
            return
        moved.append(piece)
        step(saved, 3)  # updates 6-8, in both groups, while group 0's first table is half read
        assert all(expire_everything(redis, JOB, 1, spec) for spec in specs)
        assert sum(redis.hlen(JobKeys(JOB).group(g).table_shadow(s.name)) for g in range(GROUPS) for s in specs)

    path = tmp_path / "running.pt"
    assert save_checkpoint(redis, JOB, str(path), rows_per_piece=4, progress=meanwhile) == (5, 5)
    assert moved == [SavedPiece(0, "user", "rows", "user-0-rows-0.safetensors", 4)]
    after = tables_state(redis, JOB, specs)
    assert all(not after[1][k] for k in ("user", "item", "user:seen", "item:seen"))  # swept empty after the cut
    born = {k for g in range(GROUPS) for s in specs for k in after[g][s.name]} - {
        k for g in range(GROUPS) for s in specs for k in cut[g][s.name]}
    assert born  # rows born after the cut, which the checkpoint must not hold
    assert leftovers(redis, JOB) == []

    restore_checkpoint(fresh_client, str(path))
    assert tables_state(fresh_client, JOB, specs) == cut
    drain(servers(fresh_client, fresh_url, JOB))
    drain(calm)
    assert_like_calm(fresh_client, JOB, redis, specs)


def test_gradient_rows_of_an_update_applied_just_after_the_cut_are_saved(
        redis: redis_lib.Redis, redis_url: str, fresh: tuple[redis_lib.Redis, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An update pushed after the save read the log, applied by group 0 right after its cut (which
    deletes its row-gradient blob): the save reads the blob from the shadow the cut had the apply
    keep, at its first attempt, and the restored group 0 applies the update."""
    fresh_client, fresh_url = fresh
    for job in (JOB, CALM):
        setup(redis, job=job, groups=GROUPS)
    push(redis, (JOB, CALM), range(1, UPDATES))
    saved, calm = servers(redis, redis_url, JOB), servers(redis, redis_url, CALM)
    drain(saved)
    drain(calm)
    real = checkpoint_cut._read_job
    attempts = []

    def racing(client: redis_lib.Redis, job: str, named: list[str]) -> object:
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            push(redis, (JOB,), range(UPDATES, UPDATES + 1))
            assert saved[0].step() == 1
        return real(client, job, named)

    monkeypatch.setattr(checkpoint_cut, "_read_job", racing)
    path = tmp_path / "late.pt"
    assert save_checkpoint(redis, JOB, str(path), rows_per_piece=5) == (UPDATES - 1, UPDATES - 1)
    assert attempts == [1] and leftovers(redis, JOB) == []
    restore_checkpoint(fresh_client, str(path))
    push(redis, (CALM,), range(UPDATES, UPDATES + 1))
    drain(servers(fresh_client, fresh_url, JOB))
    drain(calm)
    assert_like_calm(fresh_client, JOB, redis)


def test_a_save_waits_out_the_cut_of_a_save_that_died(
        redis: redis_lib.Redis, redis_url: str, fresh: tuple[redis_lib.Redis, str], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    fresh_client, _ = fresh
    setup(redis, job=JOB, groups=GROUPS)
    push(redis, (JOB,), range(1, 5))
    drain(servers(redis, redis_url, JOB))
    cut = tables_state(redis, JOB)
    gk = JobKeys(JOB).group(1)
    # a save that died holding group 1's cut, with the shadows it had the applies keep
    redis.set(gk.table_cut, "2 dead-save 0", px=60_000)
    junk = np.zeros(1, dtype=row_dtype(USER)).tobytes()
    redis.hset(gk.table_shadow("user"), mapping={np.int64(7).tobytes(): junk})
    redis.hset(gk.seen_shadow("item"), mapping={np.int64(8).tobytes(): np.zeros(1, SEEN_DTYPE).tobytes()})
    path = tmp_path / "after.pt"
    with pytest.raises(CheckpointError, match=r"group 1: another checkpoint holds the cut of its tables "
                                              r"\(st:\{saved:g1\}:table_cut = '2 dead-save 0'"):
        save_checkpoint(redis, JOB, str(path))
    assert not path.exists() and not os.path.exists(tables_folder(str(path)))
    assert redis.get(JobKeys(JOB).group(0).table_cut) is None  # the group it had taken is let go
    redis.pexpire(gk.table_cut, 300)  # the dead save's cut expires: a save that waits takes it
    assert cli.main(["checkpoint", "save", str(path), "--redis-url", redis_url, "--job", JOB, "--wait-s", "30",
                     "--rows-per-piece", "3"]) == 0
    assert f"saved version 4.4 of job {JOB}" in capsys.readouterr().out
    assert leftovers(redis, JOB) == []  # the dead save's shadows went with the new cut
    assert max(len(e["rows"]["pieces"]) for e in manifest(path)["tables"]) > 1
    restore_checkpoint(fresh_client, str(path))
    assert tables_state(fresh_client, JOB) == cut


def test_files_of_format_3_restore_and_incomplete_tables_are_refused_naming_what_is_wrong(
        redis: redis_lib.Redis, redis_url: str, fresh: tuple[redis_lib.Redis, str], tmp_path: Path) -> None:
    fresh_client, _ = fresh
    # format 3: a dense model's file, as that format wrote it (no tables, no row-gradient blobs)
    ParameterStore(redis, "dense").init_model(small_model(), shard_elems=64)
    dense = tmp_path / "dense.pt"
    save_checkpoint(redis, "dense", str(dense))
    assert not os.path.exists(tables_folder(str(dense)))
    data = torch.load(dense, weights_only=True)
    data["format"] = "streamtrain-checkpoint-3"
    del data["tables"]
    for group in data["groups"]:
        del group["table_stats"], group["row_blobs"]
    old = tmp_path / "old.pt"
    torch.save(data, old)
    assert restore_checkpoint(fresh_client, str(old), job="dense-copy") == (0,)
    assert torch.equal(ParameterStore(fresh_client, "dense-copy").pull().tensors["w"], small_model()["w"])

    setup(redis, job=JOB, groups=GROUPS)
    push(redis, (JOB,), range(1, 4))
    drain(servers(redis, redis_url, JOB))
    path = tmp_path / "t.pt"
    save_checkpoint(redis, JOB, str(path), rows_per_piece=2)
    folder = Path(tables_folder(str(path)))
    entry = manifest(path)["tables"][0]
    victim = folder / entry["rows"]["pieces"][1]["file"]

    def refused(match: str) -> None:
        with pytest.raises(CheckpointError, match=match):
            restore_checkpoint(fresh_client, str(path))
        assert fresh_client.keys(f"st:{{{JOB}*") == []  # checked before anything is written

    victim.rename(folder / "aside")
    refused(f"table {entry['table']} of group {entry['group']} \\(rows\\): piece {victim.name} is missing")
    (folder / "aside").rename(victim)
    listed = manifest(path)
    listed["tables"][0]["rows"]["pieces"][1]["records"] += 1
    (folder / "manifest.json").write_text(json.dumps(listed))
    refused(f"piece {victim.name} holds ids \\(2,\\) and records \\(2, {row_dtype(USER).itemsize}\\), the manifest "
            f"says 3 records")
    listed["save"] = "another"
    (folder / "manifest.json").write_text(json.dumps(listed))
    refused("holds the tables of another save")
    folder.rename(tmp_path / "elsewhere")
    refused(f"its tables folder {folder} is missing")
    (tmp_path / "elsewhere").rename(folder)
    mine = tmp_path / "mine.pt.tables"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"mine.pt.tables exists and is not a checkpoint's tables folder"):
        save_checkpoint(redis, JOB, str(tmp_path / "mine.pt"))
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and not (tmp_path / "mine.pt").exists()
    data = torch.load(path, weights_only=True)
    data["format"], data["tables"] = "streamtrain-checkpoint-3", None
    torch.save(data, tmp_path / "t3.pt")
    with pytest.raises(CheckpointError, match=r"model with embedding tables \['user', 'item'\], but it holds none"):
        restore_checkpoint(fresh_client, str(tmp_path / "t3.pt"))
    # saved again to the same path: the file and its folder are replaced together, nothing else is left
    save_checkpoint(redis, JOB, str(path), rows_per_piece=1000)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["manifest.json", *(p["file"] for e in manifest(path)["tables"] for k in ("rows", "seen")
                            for p in e[k]["pieces"])])
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    assert restore_checkpoint(fresh_client, str(path)) == (3, 3)


def test_a_servers_automatic_checkpoint_saves_the_tables(redis: redis_lib.Redis, redis_url: str,
                                                         fresh: tuple[redis_lib.Redis, str], tmp_path: Path) -> None:
    fresh_client, _ = fresh
    setup(redis, job=JOB, groups=1)
    push(redis, (JOB,), range(1, 4))
    server = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, block_ms=1, batch=1, checkpoint_every=2,
                                            checkpoint_dir=str(tmp_path)), client=redis)
    server.load()
    while server.step():
        assert server.wait_checkpoint(timeout_s=60)  # on its own thread: let it cut before the next apply
    name = f"{JOB}-v000000000002.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, f"{name}.tables"]
    restore_checkpoint(fresh_client, str(tmp_path / name))
    rows = stored(fresh_client, JOB, USER, 1)
    assert rows and max(int(r["version"]) for r in rows.values()) == 2
    # the restored rows are in no feed entry: every position before the restore is gone, following
    # goes on from the restore's (a copy loads an export taken after it)
    assert feed_heads(fresh_client, JOB, 1) == (1,)
    with pytest.raises(FeedGoneError) as gone:
        read_group(fresh_client, JOB, 0, (USER, ITEM), 0)
    assert gone.value.oldest == (1,)
    assert read_group(fresh_client, JOB, 0, (USER, ITEM), 1).position == 1


# -- export ----------------------------------------------------------------------------------------

def test_tables_export_in_pieces_that_read_back_as_the_rows_in_redis(
        redis: redis_lib.Redis, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    setup(redis, job=JOB, groups=GROUPS)
    push(redis, (JOB,), range(1, 7))
    drain(servers(redis, redis_url, JOB))
    out, folder = tmp_path / "model.safetensors", tmp_path / "tables"

    def export(rows_per_piece: int) -> dict:
        assert cli.main(["export", "--redis-url", redis_url, "--job", JOB, "--out", str(out), "--tables-dir",
                         str(folder), "--rows-per-piece", str(rows_per_piece)]) == 0
        return json.loads((folder / "manifest.json").read_text())

    listed = export(4)
    printed = capsys.readouterr().out
    assert f"exported version 6.6 of job {JOB} to {out}" in printed and f"to {folder} in" in printed
    dense = safetensors.torch.load_file(out)  # the dense part, as before
    pulled = ParameterStore(redis, JOB).pull().tensors
    assert sorted(dense) == sorted(pulled) and all(torch.equal(dense[k], pulled[k]) for k in pulled)
    assert listed["format"] == "streamtrain-tables-1" and [t["table"] for t in listed["tables"]] == ["user", "item"]
    assert listed["feed_position"] == ".".join(map(str, feed_heads(redis, JOB, GROUPS)))
    for spec, table in zip((USER, ITEM), listed["tables"], strict=True):
        want = stored(redis, JOB, spec, GROUPS)
        assert table["dim"] == spec.dim and table["rows"] == len(want) > 4 and len(table["pieces"]) > GROUPS
        got: dict[int, np.ndarray] = {}
        for p in table["pieces"]:
            assert p["file"].startswith(f"{spec.name}-{p['group']}-") and 0 < p["rows"] <= 4
            tensors = safetensors.numpy.load_file(str(folder / p["file"]))
            with safetensors.safe_open(str(folder / p["file"]), framework="numpy") as f:
                meta = f.metadata()
            assert meta == {"streamtrain.job": JOB, "streamtrain.table": spec.name, "streamtrain.dim": str(spec.dim),
                            "streamtrain.group": str(p["group"]), "streamtrain.version": str(p["version"])}
            assert tensors["ids"].dtype == np.int64 and tensors["values"].dtype == np.float32
            assert tensors["values"].shape == (p["rows"], spec.dim) and p["version"] == 6
            got.update(zip(tensors["ids"].tolist(), tensors["values"], strict=True))
        assert sorted(got) == sorted(want)
        for i, row in want.items():
            assert got[i].tobytes() == row["values"].tobytes()
    # again, in larger pieces: the folder is replaced whole
    again = export(1000)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["manifest.json", *(p["file"] for t in again["tables"] for p in t["pieces"])])
    assert all(len(t["pieces"]) == GROUPS for t in again["tables"])
    # a folder of something else is never replaced
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert cli.main(["export", "--redis-url", redis_url, "--job", JOB, "--out", str(out), "--tables-dir",
                     str(other)]) == 1
    assert "is not an earlier export of tables" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model.safetensors", "tables"]
