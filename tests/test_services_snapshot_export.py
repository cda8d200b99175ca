"""Train -> serve: a job's model as safetensors, from ``streamtrain export`` and ``GET /v1/model``.

A real parameter server applies real gradients of the digits MLP in the test's
Redis; the exported file loads into the model spec's module (strict) and
scores exactly as the parameters stored in Redis score, and every version the
store retains is exported exactly as a pull saw it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import redis as redis_lib
import safetensors.torch
import torch
from plane_util import set_membership

from common.keys import JobKeys
from coordinator.model_route import _matches
from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator
from datastream import load_source
from services import OptimizerConfig, ParameterServer, ParameterStore, Pusher, ServerSettings
from services.slot_types import VersionVector
from services.snapshot.export import (
    BadVersionError,
    NoModelError,
    Retained,
    VersionGoneError,
    VersionNotFoundError,
    resolve_version,
    retained,
    snapshot,
    to_safetensors_bytes,
)
from streamtrain import cli
from streamtrain.scoring import score_job
from trainers.evaluate import EvalResult, evaluate
from trainers.models import build_model

JOB = "exportjob"
MODEL = "digits-mlp"
UPDATES = 8
COMPACT_EVERY = 5  # shards are rewritten in full at version 5: versions 0-4 are gone, 5-8 retained
JOB_AUTH = {"Authorization": "Bearer job-secret"}
ADMIN_AUTH = {"Authorization": "Bearer admin-secret"}


# -- pure ----------------------------------------------------------------------------------------

def test_resolve_version_names_the_versions_available() -> None:
    kept = Retained(current=(8,), oldest=(5,))
    assert resolve_version(JOB, None, kept) == (8,)
    assert resolve_version(JOB, (5,), kept) == (5,) and resolve_version(JOB, (8,), kept) == (8,)
    with pytest.raises(VersionNotFoundError, match="no model version 9 yet: the current version is 8"):
        resolve_version(JOB, (9,), kept)
    with pytest.raises(VersionGoneError, match=r"version 4 is no longer retained .* oldest version available is 5") \
            as gone:
        resolve_version(JOB, (4,), kept)
    assert (gone.value.oldest, gone.value.current) == ((5,), (8,))
    for bad in ((-1,), (True,), (1.0,), "3", 3, (3, 4), ()):
        with pytest.raises(ValueError, match="non-negative integer"):
            resolve_version(JOB, bad, kept)  # type: ignore[arg-type]  # not a version, on purpose


def test_a_version_of_several_groups_is_each_groups_version_joined_by_dots() -> None:
    assert VersionVector((1200,)).name() == "1200" and VersionVector((12, 7)).name() == "12.7"
    assert VersionVector.parse("1200", 1) == (1200,) and VersionVector.parse("12.7", 2) == (12, 7)
    assert VersionVector.parse("0.0.3", 3) == (0, 0, 3)
    for text in ("12", "12.7.1", "12.", ".7", "12.-7", "12.x", "1" * 19 + ".7", "12,7"):
        with pytest.raises(BadVersionError, match=f"job {JOB} has 2 shard groups: version must be 2 non-negative "
                                                  f"integers joined by '.'.* e.g. '12.7'.*got '{re.escape(text)}'"):
            VersionVector.parse(text, 2, job=JOB)
    with pytest.raises(BadVersionError, match=r"version must be one non-negative integer \(a model version\), "
                                              "got '12.7'"):
        VersionVector.parse("12.7", 1, job=JOB)
    kept = Retained(current=(12, 7), oldest=(10, 0))
    assert resolve_version(JOB, None, kept) == (12, 7)
    assert resolve_version(JOB, (10, 0), kept) == (10, 0) and resolve_version(JOB, (11, 7), kept) == (11, 7)
    with pytest.raises(VersionNotFoundError, match=r"no model version 12\.8 yet: the current version is 12\.7"):
        resolve_version(JOB, (12, 8), kept)
    # a version some group can no longer rebuild is gone, even when another group has not reached its own
    for gone_version in ((9, 7), (9, 8)):
        gone = VersionVector(gone_version).name()
        with pytest.raises(VersionGoneError, match=f"version {gone} is no longer retained .* "
                                                   "oldest version available is 10.0, the current 12.7"):
            resolve_version(JOB, gone_version, kept)


def test_safetensors_bytes_are_the_same_for_the_same_tensors_and_name_the_version() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"0.weight": torch.randn(4, 3, generator=gen), "0.bias": torch.randn(4, generator=gen),
               "head.é": torch.randn(2, generator=gen)}
    blobs = {to_safetensors_bytes(tensors, job=JOB, version=(3,)) for _ in range(8)}
    assert len(blobs) == 1  # safetensors writes its metadata in hash order; we sort it
    blob = blobs.pop()
    loaded = safetensors.torch.load(blob)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    n = int.from_bytes(blob[:8], "little")
    assert n % 8 == 0
    assert json.loads(blob[8:8 + n])["__metadata__"] == {"format": "pt", "streamtrain.job": JOB,
                                                         "streamtrain.version": "3"}


def test_if_none_match_uses_the_weak_comparison() -> None:
    tag = '"exportjob-v8"'
    assert _matches(tag, tag) and _matches(f'"other", W/{tag}', tag) and _matches("*", tag)
    assert not _matches('"exportjob-v7"', tag) and not _matches(None, tag) and not _matches("", tag)


def test_export_flags_are_checked_before_connecting(capsys: pytest.CaptureFixture) -> None:
    for argv, problem in ((["--job", JOB], "--out FILE is required"),
                          (["--out", "m.safetensors", "--version", "-1"], ("--version must be a model version: "
                           "a non-negative integer, or with several shard groups one per group joined by '.' "
                           "(e.g. 12.7), got '-1'")),
                          (["--out", "m.safetensors", "--version", "latest"], "got 'latest'"),
                          (["--out", "m.safetensors", "--version", "12."], "got '12.'"),
                          (["--out", "m.safetensors", "--job", "no spaces"], "invalid job name 'no spaces'")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["export", *argv])
        assert exited.value.code == 2 and problem in capsys.readouterr().err


# -- on Redis ------------------------------------------------------------------------------------

@dataclass
class Trained:
    """A digits MLP trained for a few updates in Redis, and every version a pull saw."""

    redis_url: str
    history: dict[int, dict[str, torch.Tensor]]
    """Model version -> the tensors a pull returned at it."""
    server: ParameterServer
    """The job's parameter server (``step()`` applies the next pending update)."""


@pytest.fixture
def trained(redis: redis_lib.Redis, redis_url: str) -> Iterator[Trained]:
    spec = build_model(MODEL)
    model = spec.model
    store = ParameterStore(redis, JOB)
    store.init_model(dict(model.named_parameters()), shard_elems=8192,  # 14 shards
                     optimizer=OptimizerConfig(name="lazyadam", lr=0.01))
    set_membership(redis, JOB, {"a": [0]}, generation=1)
    pusher = Pusher(redis, JOB, "a", codec="topk", codec_options={"density": 0.05})
    server = ParameterServer(ServerSettings(redis_url=redis_url, job=JOB, block_ms=1, batch=1,
                                            compact_every=COMPACT_EVERY, compact_fraction=1000.0),
                             client=redis)  # compaction by age only: at version 5 exactly
    server.load()
    x, y = load_source("digits", split="train").read(limit=64 * (UPDATES + 1))
    x, y = torch.from_numpy(x).float(), torch.from_numpy(y).long()
    params = {n: p.data for n, p in model.named_parameters()}
    snap = store.pull(out=params)
    history = {snap.version: {k: v.clone() for k, v in snap.tensors.items()}}
    for clock in range(1, UPDATES + 1):  # one trainer step: pull, gradients, push; the server applies
        model.zero_grad()
        rows = slice(64 * (clock - 1), 64 * clock)
        spec.loss_fn(model(x[rows]), y[rows]).backward()
        pusher.push({n: p.grad for n, p in model.named_parameters()}, generation=1, clock=clock,
                    offsets={0: (clock - 1, clock)})
        assert server.step() == 1
        snap = store.pull(since=snap, out=params)
        assert snap.version == clock
        history[snap.version] = {k: v.clone() for k, v in snap.tensors.items()}
    keys = JobKeys(JOB)
    # the trainer leaves (a coordinator of the route tests writes the membership in its own format)
    redis.delete(keys.members, keys.assignment, keys.generation)
    yield Trained(redis_url, history, server)


def score_file(path: Path | bytes, version: int) -> EvalResult:
    """Load a safetensors export into the model spec's module (strict) and score it on digits' test split."""
    spec = build_model(MODEL, seed=1)  # other initial weights: everything must come from the file
    state = safetensors.torch.load(path) if isinstance(path, bytes) else safetensors.torch.load_file(path)
    spec.model.load_state_dict(state, strict=True)
    x, y = load_source("digits", split="test").read()
    return evaluate(spec.model, spec.loss_fn, torch.from_numpy(x).float(), torch.from_numpy(y).long(),
                    version=version, classification=True)


def assert_same(tensors: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(tensors) == sorted(want)
    for name in want:
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], want[name]), name


def test_the_cli_export_scores_like_the_parameters_in_redis(trained: Trained, redis: redis_lib.Redis,
                                                            tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert retained(redis, JOB) == Retained(current=(UPDATES,), oldest=(COMPACT_EVERY,))
    path = tmp_path / "model.safetensors"
    assert cli.main(["export", "--redis-url", trained.redis_url, "--job", JOB, "--out", str(path)]) == 0
    assert f"exported version {UPDATES} of job {JOB} to {path}" in capsys.readouterr().out
    assert_same(safetensors.torch.load_file(path), trained.history[UPDATES])
    exported = score_file(path, UPDATES)
    stored = score_job(trained.redis_url, JOB, MODEL, "digits")
    assert stored.version == UPDATES
    assert (exported.loss, exported.accuracy, exported.samples) == (stored.loss, stored.accuracy, stored.samples)
    assert exported.accuracy > 0.3  # it did learn (10 classes: chance is 0.1)
    # an older version the store still retains is what a pull saw at it
    old = tmp_path / "old.safetensors"
    assert cli.main(["export", "--redis-url", trained.redis_url, "--job", JOB, "--out", str(old),
                     "--version", str(COMPACT_EVERY)]) == 0
    assert f"exported version {COMPACT_EVERY} of job {JOB}" in capsys.readouterr().out
    assert_same(safetensors.torch.load_file(old), trained.history[COMPACT_EVERY])
    assert old.read_bytes() != path.read_bytes()
    for version in range(COMPACT_EVERY, UPDATES + 1):
        got, tensors = snapshot(redis, JOB, (version,))
        assert got == (version,) and snapshot(redis, JOB, str(version))[0] == got
        assert_same(tensors, trained.history[version])


def test_the_cli_refuses_bad_inputs_naming_the_problem(trained: Trained, redis: redis_lib.Redis, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "m.safetensors"

    def export(*argv: str) -> str:
        rc = cli.main(["export", "--redis-url", trained.redis_url, *argv])
        captured = capsys.readouterr()
        assert rc == 1 and captured.out == "", captured
        return captured.err

    assert "job nosuchjob has no model in this Redis" in export("--job", "nosuchjob", "--out", str(out))
    assert f"no model version 99 yet: the current version is {UPDATES}" in export(
        "--job", JOB, "--out", str(out), "--version", "99")
    err = export("--job", JOB, "--out", str(out), "--version", "2")
    assert "model version 2 is no longer retained" in err and f"oldest version available is {COMPACT_EVERY}" in err
    missing = tmp_path / "no-such-dir" / "m.safetensors"
    assert f"cannot write {missing}: No such file or directory" in export("--job", JOB, "--out", str(missing))
    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert f"cannot write {folder}" in export("--job", JOB, "--out", str(folder))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder"]  # no file, no temporary left behind
    with pytest.raises(NoModelError):
        snapshot(redis, "nosuchjob")



@pytest.fixture
def settings(redis_url: str, silent_broker: str) -> CoordinatorSettings:
    return CoordinatorSettings(job=JOB, redis_url=redis_url, kafka_bootstrap=silent_broker, topic="train",
                               partitions=1, lease_ms=3000, heartbeat_interval_ms=500,
                               admin_token="admin-secret", job_token="job-secret", kafka_timeout_ms=200)


async def test_the_route_serves_the_model_with_its_version_and_etag(
        trained: Trained, redis: redis_lib.Redis, settings: CoordinatorSettings, tmp_path: Path) -> None:
    path = tmp_path / "cli.safetensors"
    assert cli.main(["export", "--redis-url", trained.redis_url, "--job", JOB, "--out", str(path)]) == 0
    tag = f'"{JOB}-v{UPDATES}"'
    async with running_coordinator(settings) as client:
        for headers, problem in (({}, "missing bearer job or admin token"),
                                 ({"Authorization": "Bearer nope"}, "wrong job or admin token")):
            resp = await client.get("/v1/model", headers=headers)
            assert resp.status == 401 and problem in (await resp.json())["error"]["message"]
        resp = await client.get("/v1/model", headers=JOB_AUTH)
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Model-Version"] == str(UPDATES) and resp.headers["ETag"] == tag
        assert resp.headers["Content-Type"] == "application/octet-stream"
        assert f'filename="{JOB}-v{UPDATES}.safetensors"' in resp.headers["Content-Disposition"]
        body = await resp.read()
        assert body == path.read_bytes()  # the same bytes as the CLI's file
        assert_same(safetensors.torch.load(body), trained.history[UPDATES])
        stored = score_job(trained.redis_url, JOB, MODEL, "digits")
        served = score_file(body, UPDATES)
        assert (served.loss, served.accuracy) == (stored.loss, stored.accuracy)
        assert (await client.get("/v1/model", headers=ADMIN_AUTH)).status == 200

        for if_none_match in (tag, f'W/{tag}', f'"{JOB}-v1", {tag}', "*"):
            resp = await client.get("/v1/model", headers={**JOB_AUTH, "If-None-Match": if_none_match})
            assert resp.status == 304 and resp.headers["ETag"] == tag and await resp.read() == b""
            assert resp.headers["X-Model-Version"] == str(UPDATES)

        # a retained older version, exactly as a pull saw it; its own ETag
        resp = await client.get(f"/v1/model?version={COMPACT_EVERY + 1}", headers=JOB_AUTH)
        assert resp.status == 200 and resp.headers["X-Model-Version"] == str(COMPACT_EVERY + 1)
        old_tag = f'"{JOB}-v{COMPACT_EVERY + 1}"'
        assert resp.headers["ETag"] == old_tag
        assert_same(safetensors.torch.load(await resp.read()), trained.history[COMPACT_EVERY + 1])
        resp = await client.get(f"/v1/model?version={COMPACT_EVERY + 1}",
                                headers={**JOB_AUTH, "If-None-Match": old_tag})
        assert resp.status == 304
        resp = await client.get(f"/v1/model?version={COMPACT_EVERY + 1}", headers={**JOB_AUTH, "If-None-Match": tag})
        assert resp.status == 200  # the current version's tag is not this version's

        # training goes on (a trainer registers with this coordinator and pushes, the server
        # applies): the tag a client holds no longer matches, it gets the new version
        joined = await client.post("/v1/members", json={"capabilities": {"device": "cpu"}}, headers=JOB_AUTH)
        member = await joined.json()
        assert joined.status == 201 and member["partitions"] == [0]
        gen = torch.Generator().manual_seed(7)
        pusher = Pusher(redis, JOB, member["member_id"], codec="topk", codec_options={"density": 0.05})
        pusher.push({k: torch.randn(v.shape, generator=gen) for k, v in trained.history[UPDATES].items()},
                    generation=member["generation"], clock=1, offsets={0: (UPDATES, UPDATES + 1)})
        assert trained.server.step() == 1
        now = ParameterStore(redis, JOB).pull()
        assert now.version == UPDATES + 1
        resp = await client.get("/v1/model", headers={**JOB_AUTH, "If-None-Match": tag})
        assert resp.status == 200 and resp.headers["X-Model-Version"] == str(UPDATES + 1)
        assert_same(safetensors.torch.load(await resp.read()), now.tensors)


async def test_the_route_refuses_bad_versions_naming_what_is_available(
        trained: Trained, settings: CoordinatorSettings) -> None:
    async with running_coordinator(settings) as client:
        async def error(query: str, status: int) -> dict:
            resp = await client.get(f"/v1/model{query}", headers=JOB_AUTH)
            assert resp.status == status, (query, resp.status, await resp.text())
            return (await resp.json())["error"]

        gone = await error("?version=2", 410)
        assert gone["code"] == "version_gone" and (gone["oldest"], gone["current"]) == (COMPACT_EVERY, UPDATES)
        assert f"oldest version available is {COMPACT_EVERY}" in gone["message"]
        ahead = await error(f"?version={UPDATES + 1}", 404)
        assert ahead["code"] == "version_not_found" and ahead["current"] == UPDATES
        assert f"no model version {UPDATES + 1} yet" in ahead["message"]
        for query, shown in (("?version=abc", "'abc'"), ("?version=-1", "'-1'"), ("?version=1.x", "'1.x'"),
                             ("?version=", "''"), ("?version=" + "9" * 19, "'" + "9" * 19 + "'")):
            bad = await error(query, 400)
            assert bad["code"] == "invalid_query" and f"non-negative integer (a model version), got {shown}" \
                in bad["message"], bad
        # a version name with two parts names no version of a one-group job (the OpenAPI pattern allows it)
        other = await error("?version=1.5", 404)
        assert other["code"] == "version_not_found" and other["current"] == UPDATES
        assert "no version '1.5': version must be one non-negative integer" in other["message"], other
        twice = await error("?version=1&version=2", 400)
        assert twice["code"] == "invalid_query" and "version must be given once" in twice["message"]
        unknown = await error("?v=3", 400)
        assert unknown["code"] == "invalid_query" and "unknown query parameter 'v'" in unknown["message"]
    async with running_coordinator(replace(settings, job="nomodel")) as client:
        resp = await client.get("/v1/model", headers=JOB_AUTH)
        body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "no_model"
        assert "job nomodel has no model" in body["error"]["message"]


# -- two shard groups ----------------------------------------------------------------------------

@dataclass
class TrainedTwo:
    """The digits MLP in two shard groups, each applied by its own server, group 1 half as often."""

    redis_url: str
    history: dict[tuple[int, ...], dict[str, torch.Tensor]]
    """Group versions -> the tensors a pull returned at them."""
    current: tuple[int, ...]
    """The group versions after the last apply."""


TWO_JOB = "exporttwo"


@pytest.fixture
def trained_two(redis: redis_lib.Redis, redis_url: str) -> Iterator[TrainedTwo]:
    spec = build_model(MODEL)
    model = spec.model
    store = ParameterStore(redis, TWO_JOB)
    store.init_model(dict(model.named_parameters()), shard_elems=8192,
                     optimizer=OptimizerConfig(name="lazyadam", lr=0.01), groups=2)
    set_membership(redis, TWO_JOB, {"a": [0]}, generation=1)
    pusher = Pusher(redis, TWO_JOB, "a", codec="topk", codec_options={"density": 0.05})
    servers = [ParameterServer(ServerSettings(redis_url=redis_url, job=TWO_JOB, group=g, groups=2, block_ms=1,
                                              batch=2, compact_every=COMPACT_EVERY, compact_fraction=1000.0),
                               client=redis) for g in (0, 1)]
    for server in servers:
        server.load()
    x, y = load_source("digits", split="train").read(limit=64 * UPDATES)
    x, y = torch.from_numpy(x).float(), torch.from_numpy(y).long()
    params = {n: p.data for n, p in model.named_parameters()}
    snap = store.pull(out=params)
    history = {snap.group_versions: {k: v.clone() for k, v in snap.tensors.items()}}
    for clock in range(1, UPDATES + 1):
        model.zero_grad()
        rows = slice(64 * (clock - 1), 64 * clock)
        spec.loss_fn(model(x[rows]), y[rows]).backward()
        pusher.push({n: p.grad for n, p in model.named_parameters()}, generation=1, clock=clock,
                    offsets={0: (clock - 1, clock)})
        for server in servers if clock % 2 == 0 else servers[:1]:  # group 1 applies two at a time
            while server.step():
                pass
        snap = store.pull(since=snap, out=params)
        history[snap.group_versions] = {k: v.clone() for k, v in snap.tensors.items()}
    assert snap.group_versions == (UPDATES, UPDATES // 2)
    keys = JobKeys(TWO_JOB)
    redis.delete(keys.members, keys.assignment, keys.generation)
    yield TrainedTwo(redis_url, history, snap.group_versions)


def test_two_groups_export_each_group_at_its_version(trained_two: TrainedTwo, redis: redis_lib.Redis,
                                                     tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    current = trained_two.current
    name = VersionVector(current).name()
    assert name == f"{UPDATES}.{UPDATES // 2}"
    # group 0 compacted at version 5; group 1 (at 4) never did
    assert retained(redis, TWO_JOB) == Retained(current=current, oldest=(COMPACT_EVERY, 0))
    path = tmp_path / "two.safetensors"
    assert cli.main(["export", "--redis-url", trained_two.redis_url, "--job", TWO_JOB, "--out", str(path)]) == 0
    assert f"exported version {name} of job {TWO_JOB} to {path}" in capsys.readouterr().out
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["streamtrain.version"] == name
    state = safetensors.torch.load_file(path)
    pulled = ParameterStore(redis, TWO_JOB).pull()
    assert pulled.group_versions == current
    assert_same(state, pulled.tensors)
    module = build_model(MODEL, seed=1).model
    module.load_state_dict(state, strict=True)
    assert_same({n: p.data for n, p in module.named_parameters()}, pulled.tensors)
    # every retained version a pull saw exports as the pull saw it
    seen = [v for v in trained_two.history if v[0] >= COMPACT_EVERY]
    assert len(seen) >= 3
    for version in seen:
        got, tensors = snapshot(redis, TWO_JOB, VersionVector(version).name())
        assert got == version
        assert_same(tensors, trained_two.history[version])

    def refused(*argv: str) -> str:
        rc = cli.main(["export", "--redis-url", trained_two.redis_url, "--job", TWO_JOB, "--out", str(path), *argv])
        captured = capsys.readouterr()
        assert rc == 1 and captured.out == "", captured
        return captured.err

    assert f"job {TWO_JOB} has 2 shard groups: version must be 2 non-negative integers joined by '.'" in refused(
        "--version", str(UPDATES))
    assert f"no model version {UPDATES}.{UPDATES} yet: the current version is {name}" in refused(
        "--version", f"{UPDATES}.{UPDATES}")
    assert f"the oldest version available is {COMPACT_EVERY}.0, the current {name}" in refused("--version", "2.2")


async def test_the_route_names_a_two_group_version_by_its_vector(
        trained_two: TrainedTwo, redis: redis_lib.Redis, settings: CoordinatorSettings) -> None:
    name = VersionVector(trained_two.current).name()
    tag = f'"{TWO_JOB}-v{name}"'
    async with running_coordinator(replace(settings, job=TWO_JOB, ps_groups=2)) as client:
        resp = await client.get("/v1/model", headers=JOB_AUTH)
        assert resp.status == 200 and resp.headers["X-Model-Version"] == name and resp.headers["ETag"] == tag
        assert f'filename="{TWO_JOB}-v{name}.safetensors"' in resp.headers["Content-Disposition"]
        assert_same(safetensors.torch.load(await resp.read()), ParameterStore(redis, TWO_JOB).pull().tensors)
        resp = await client.get("/v1/model", headers={**JOB_AUTH, "If-None-Match": tag})
        assert resp.status == 304 and resp.headers["X-Model-Version"] == name
        older = next(v for v in sorted(trained_two.history) if v[0] >= COMPACT_EVERY)
        resp = await client.get(f"/v1/model?version={VersionVector(older).name()}", headers=JOB_AUTH)
        assert resp.status == 200 and resp.headers["ETag"] == f'"{TWO_JOB}-v{VersionVector(older).name()}"'
        assert_same(safetensors.torch.load(await resp.read()), trained_two.history[older])

        async def error(query: str, status: int) -> dict:
            resp = await client.get(f"/v1/model{query}", headers=JOB_AUTH)
            assert resp.status == status, (query, resp.status, await resp.text())
            return (await resp.json())["error"]

        other = await error(f"?version={UPDATES}", 404)
        assert other["code"] == "version_not_found" and "2 non-negative integers joined by '.'" in other["message"]
        bad = await error(f"?version={UPDATES}.x", 400)
        assert bad["code"] == "invalid_query" and "2 non-negative integers joined by '.'" in bad["message"]
        ahead = await error(f"?version={UPDATES + 1}.0", 404)
        assert ahead["code"] == "version_not_found" and ahead["current"] == name
        gone = await error("?version=1.1", 410)
        assert gone["code"] == "version_gone" and (gone["oldest"], gone["current"]) == (f"{COMPACT_EVERY}.0", name)
