"""Triton's own Python HTTP client (``tritonclient.http``) against a running serving replica of a job
that trained a little: health, model metadata, and inference with ragged IDs, its scores those of
``POST /v1/predict`` for the same records; a wrong token is refused. On the same job, a replica started
from a ``streamtrain export --tables-dir`` folder (``--export-dir``), and one refusing another job's."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as http
from serving_util import assert_replica_equals_plane, call_json, replica_status, wait_caught_up, wait_ready
from tritonclient.utils import InferenceServerException

from coordinator.settings import CoordinatorSettings
from datastream import load_source
from services import connect
from services.snapshot.table_export import export_tables
from streamtrain.cluster import LOCAL_STREAM, LOCAL_TRAINER, ClusterSpec, LocalCluster

pytestmark = [pytest.mark.slow]

JOB = "clicks"
SOURCE = "clicks?features=4&dense=3&vocab=3000&seed=7&limit=6000"
MODEL = "dlrm?features=4&dense=3&dim=8&admit=1&row_lr=0.05"
FEATURES = ("c1", "c2", "c3", "c4")


@dataclass(frozen=True)
class Served:
    cluster: LocalCluster
    url: str
    """``host:port`` of the replica (tritonclient's form)."""
    token: str
    version: str
    """The version the replica serves (the job stands still)."""

    def auth(self) -> dict[str, str]:
        """The headers of a call with the job's token: a new dict each call, since tritonclient's ``infer``
        writes its ``Inference-Header-Content-Length`` into the dict it is given (a later JSON request
        with the same dict would carry a binary one's header)."""
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A job that trained on a short stream and stands still, and its replica caught up with it."""
    spec = ClusterSpec(job=JOB, topic=JOB, trainers=1, replicas=1,
                       coordinator=CoordinatorSettings(ps_groups=2, optimizer="adam", lr=0.005, codec="none",
                                                       table_consistency="asp", table_staleness=4),
                       trainer=replace(LOCAL_TRAINER, model=MODEL, eval_source="", batch_size=128),
                       producer=replace(LOCAL_STREAM, source=SOURCE, shard_size=64))
    cluster = LocalCluster(spec, workdir=tmp_path_factory.mktemp("triton") / "cluster")
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        cluster.wait_consumed(timeout_s=300)
        cluster.quiesce()
        wait_ready(cluster)
        client = connect(cluster.redis_url)
        stack.callback(client.close)
        status = wait_caught_up(cluster, client)
        assert status["rows"] > 0, status
        yield Served(cluster, cluster.replica_url().removeprefix("http://"),
                     cluster.job_token, status["model_version"])


@pytest.fixture
def triton(served: Served) -> Iterator[Any]:
    client = http.InferenceServerClient(url=served.url)
    try:
        yield client
    finally:
        client.close()


def ragged_records(n: int = 24) -> tuple[np.ndarray, dict[str, list[list[int]]]]:
    """``n`` held-out records' dense features, and per feature 0 to 3 IDs a record (IDs of the held-out
    records, some trained, and some no row has)."""
    held = load_source(SOURCE, split="test").read(limit=4 * n)
    rng = np.random.default_rng(5)
    ids: dict[str, list[list[int]]] = {}
    for f in FEATURES:
        pool = held.ids[f].values
        ids[f] = [rng.choice(pool, size=(i + FEATURES.index(f)) % 4).tolist() for i in range(n)]
    ids["c2"][3] = [12345, 67890]  # IDs no record has: their initial rows
    return np.ascontiguousarray(held.x[:n], dtype=np.float32), ids


def predicted(served: Served, x: np.ndarray, ids: dict[str, list[list[int]]]) -> tuple[str, dict[str, np.ndarray]]:
    """``POST /v1/predict``'s version and outputs for the same records."""
    records = [{"x": x[i].tolist(), "ids": {f: ids[f][i] for f in FEATURES}} for i in range(len(x))]
    code, body = call_json(served.cluster.replica_url(), "/v1/predict", token=served.cluster.job_token,
                           body={"records": records})
    assert code == 200, body
    return body["model_version"], {name: np.asarray([p[name] for p in body["predictions"]], np.float32)
                                   for name in ("probability", "logit")}


def triton_inputs(x: np.ndarray, ids: dict[str, list[list[int]]], binary: bool) -> list[Any]:
    """``x`` FP32 ``[n, 3]`` and, per feature, its IDs (INT64 ``[nnz]``) and lengths (INT64 ``[n]``)."""
    inputs = [http.InferInput("x", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x, binary_data=binary)
    for f in FEATURES:
        values = np.asarray([i for rec in ids[f] for i in rec], dtype=np.int64)
        lengths = np.asarray([len(rec) for rec in ids[f]], dtype=np.int64)
        for name, arr in ((f, values), (f + ".lengths", lengths)):
            tensor = http.InferInput(name, list(arr.shape), "INT64")
            tensor.set_data_from_numpy(arr, binary_data=binary)
            inputs.append(tensor)
    return inputs


@pytest.mark.timeout(420)
def test_tritonclient_sees_a_live_ready_model_and_its_metadata(served: Served, triton: Any) -> None:
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready(JOB)
    assert not triton.is_model_ready("another-model")
    meta = triton.get_model_metadata(JOB, headers=served.auth())
    assert meta["name"] == JOB and meta["versions"] == [served.version]
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]}
    assert inputs == {"x": ("FP32", [-1, 3]), **{name: ("INT64", [-1]) for f in FEATURES
                                                 for name in (f, f + ".lengths")}}
    assert [o["name"] for o in meta["outputs"]] == ["probability", "logit"]
    assert all(o["datatype"] == "FP32" for o in meta["outputs"])


@pytest.mark.timeout(420)
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_infers_ragged_ids_as_v1_predict_scores_them(served: Served, triton: Any, binary: bool) -> None:
    x, ids = ragged_records()
    version, want = predicted(served, x, ids)
    assert version == served.version
    outputs = [http.InferRequestedOutput(name, binary_data=binary) for name in ("probability", "logit")]
    result = triton.infer(JOB, triton_inputs(x, ids, binary), outputs=outputs, request_id="r-1", headers=served.auth())
    answer = result.get_response()
    assert answer["model_name"] == JOB and answer["model_version"] == served.version and answer["id"] == "r-1"
    # the outputs come back as asked: binary tensor data, or JSON data
    sent_as = {o["name"]: "binary_data_size" in (o.get("parameters") or {}) for o in answer["outputs"]}
    assert sent_as == {"probability": binary, "logit": binary}, answer["outputs"]
    for name in ("probability", "logit"):
        got = result.as_numpy(name)
        assert got is not None and got.dtype == np.float32 and got.shape == (len(x),), name
        np.testing.assert_allclose(got, want[name], rtol=0, atol=1e-6, err_msg=name)
    # no outputs named: tritonclient asks for every output as binary data
    result = triton.infer(JOB, triton_inputs(x, ids, binary), headers=served.auth())
    np.testing.assert_allclose(result.as_numpy("logit"), want["logit"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("probability"), want["probability"], rtol=0, atol=1e-6)


@pytest.mark.timeout(420)
def test_tritonclient_with_a_wrong_token_is_refused(served: Served, triton: Any) -> None:
    x, ids = ragged_records(4)
    for headers in ({"Authorization": "Bearer not-the-token"}, None):
        with pytest.raises(InferenceServerException, match="token"):
            triton.infer(JOB, triton_inputs(x, ids, False), headers=headers)
        with pytest.raises(InferenceServerException, match="token"):
            triton.get_model_metadata(JOB, headers=headers)
    # and the replica still answers the right one, from the same version
    assert replica_status(served.cluster)["model_version"] == served.version
    result = triton.infer(JOB, triton_inputs(x, ids, False), headers=served.auth())
    assert result.get_response()["model_version"] == served.version


def test_a_replica_starts_warm_from_an_export_folder_and_follows_the_feed_from_its_position(
        served: Served, tmp_path: Path) -> None:
    cluster = served.cluster
    client = connect(cluster.redis_url)
    try:
        exported = export_tables(client, JOB, str(tmp_path / "tables"))
        assert exported.rows > 0
        replica = cluster.add_replica(flags=("--export-dir", str(tmp_path / "tables")))
        try:
            index = len(cluster.replicas) - 1
            wait_ready(cluster, index)
            status = wait_caught_up(cluster, client, index)
            assert status["loaded_from"] == str(tmp_path / "tables") and status["loaded_rows"] == exported.rows
            assert status["reloads"] == 0
            assert_replica_equals_plane(cluster, client, index)
        finally:
            replica.stop()  # the module's cluster goes on: this test's replica is its own
    finally:
        client.close()


def test_a_replica_refuses_an_export_folder_that_is_not_the_job_s(served: Served, tmp_path: Path) -> None:
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": "streamtrain-tables-1", "job": "another",
                                                      "groups": 2, "feed_position": "0.0", "tables": []}))
    cluster = served.cluster
    env = {"STREAMTRAIN_JOB_TOKEN": cluster.job_token, "STREAMTRAIN_REDIS_URL": cluster.redis_url}
    proc = subprocess.run([sys.executable, "-m", "streamtrain.cli", "serve", f"--job={JOB}", f"--model={MODEL}",
                           f"--coordinator-url={cluster.coordinator_url}", "--port=0", f"--export-dir={folder}",
                           "--report-every-s=0"], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "an export of job 'another', not 'clicks'" in proc.stderr
