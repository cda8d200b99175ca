"""Helpers shared by the serving tests: HTTP calls to a replica of a :class:`LocalCluster`, waiting
for it, and the check that it equals the parameter plane (rows, tombstones, dense tensors)."""

from __future__ import annotations

import json
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import numpy as np
import redis as redis_lib
import safetensors.numpy

from common.keys import JobKeys
from datastream.jagged import Jagged
from services.slot_types import VersionVector
from services.slots import read_meta
from services.snapshot.export import snapshot
from services.tables import TableSpec
from services.tables.feed import feed_heads
from services.tables.rows import row_dtype
from streamtrain.cluster import LocalCluster
from streamtrain.launcher import wait_until


def call(url: str, path: str, *, token: str | None = None, body: Any = None,
         timeout_s: float = 30.0) -> tuple[int, bytes]:
    """``(status, body)`` of a GET (or a POST of ``body``: JSON unless bytes) to ``url + path``."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:  # its response's socket closed here, not by the collector in a later test
            return exc.code, exc.read()


def call_json(url: str, path: str, **kw: Any) -> tuple[int, Any]:
    """:func:`call` with the answer parsed as JSON."""
    status, raw = call(url, path, **kw)
    return status, json.loads(raw)


def replica_status(cluster: LocalCluster, index: int = 0) -> dict[str, Any]:
    """``GET /v1/replica`` of replica ``index`` (raises unless 200)."""
    status, body = call_json(cluster.replica_url(index), "/v1/replica", token=cluster.job_token)
    assert status == 200, body
    return body


def is_ready(cluster: LocalCluster, index: int = 0) -> bool:
    """``GET /v2/health/ready`` of replica ``index`` answers 200 (False while it does not answer)."""
    try:
        return call(cluster.replica_url(index), "/v2/health/ready", timeout_s=5.0)[0] == 200
    except OSError:
        return False


def wait_ready(cluster: LocalCluster, index: int = 0, timeout_s: float = 120.0) -> None:
    """Wait until replica ``index`` is ready (a state loaded, the feed read up to its head lately)."""
    def check() -> bool:
        proc = cluster.replicas[index][0]
        assert proc.returncode is None, f"{proc.name} exited ({proc.returncode}):\n{proc.log_tail(30)}"
        return is_ready(cluster, index)
    wait_until(check, timeout_s, interval_s=0.25, what=f"serving replica {index} to be ready")


def heads_now(client: redis_lib.Redis, job: str) -> str:
    """The feed heads of every group, as a feed position (``"12.7"``)."""
    return VersionVector(feed_heads(client, job, read_meta(client, job).groups)).name()


def wait_caught_up(cluster: LocalCluster, client: redis_lib.Redis, index: int = 0,
                   timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until replica ``index``'s feed position is the feed's heads now; return its status."""
    found: dict[str, Any] = {}

    def check() -> bool:
        st = replica_status(cluster, index)
        if st.get("feed_position") == heads_now(client, cluster.spec.job):
            found.update(st)
            return True
        return False
    wait_until(check, timeout_s, interval_s=0.25, what=f"serving replica {index} to reach the feed's heads")
    return found


def read_safetensors(raw: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and the metadata of a safetensors body."""
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8:8 + n]).get("__metadata__", {})
    return safetensors.numpy.load(raw), meta


def replica_state(cluster: LocalCluster, index: int = 0) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``GET /v1/replica/state`` of replica ``index``: its rows and dense tensors, and their metadata."""
    status, raw = call(cluster.replica_url(index), "/v1/replica/state", token=cluster.job_token, timeout_s=60.0)
    assert status == 200, raw[:300]
    return read_safetensors(raw)


def plane_rows(client: redis_lib.Redis, job: str, spec: TableSpec, groups: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row of ``spec`` straight from the groups' hashes: IDs ascending, values, versions."""
    ids: list[int] = []
    records: list[np.ndarray] = []
    dtype = row_dtype(spec)
    for g in range(groups):
        for k, v in client.hgetall(JobKeys(job).group(g).table_rows(spec.name)).items():
            ids.append(int(np.frombuffer(k, "<i8")[0]))
            records.append(np.frombuffer(v, dtype=dtype)[0])
    if not ids:
        return np.empty(0, np.int64), np.empty((0, spec.dim), np.float32), np.empty(0, np.uint64)
    arr = np.array(ids, dtype=np.int64)
    order = np.argsort(arr)
    rec = np.array(records, dtype=dtype)[order]
    return arr[order], np.ascontiguousarray(rec["values"]), rec["version"].astype(np.uint64)


def _compare(tensors: Mapping[str, np.ndarray], meta: Mapping[str, str], client: redis_lib.Redis, job: str
             ) -> tuple[list[str], dict[str, int]]:
    """What differs between a replica's dump and the plane now (empty: equal), and the rows per table."""
    plane_meta = read_meta(client, job)
    problems: list[str] = []
    rows: dict[str, int] = {}
    for spec in plane_meta.tables:
        ids, values, versions = plane_rows(client, job, spec, plane_meta.groups)
        rows[spec.name] = int(ids.size)
        got_ids = tensors.get(f"{spec.name}.ids")
        if got_ids is None:
            problems.append(f"table {spec.name}: not in the replica's dump")
            continue
        got_values, got_versions = tensors[f"{spec.name}.values"], tensors[f"{spec.name}.versions"]
        if not np.array_equal(got_ids, ids):
            extra = np.setdiff1d(got_ids, ids)
            lacking = np.setdiff1d(ids, got_ids)
            problems.append(f"table {spec.name}: the replica holds {got_ids.size} rows, the plane {ids.size}; "
                            f"{extra.size} the plane lacks (a tombstone missed: {extra[:5].tolist()}), "
                            f"{lacking.size} the replica lacks ({lacking[:5].tolist()})")
            continue
        if got_values.tobytes() != values.tobytes():  # bit for bit
            bad = np.flatnonzero((got_values.view(np.uint32) != values.view(np.uint32)).any(axis=1))
            problems.append(f"table {spec.name}: {bad.size} rows' values differ (IDs {ids[bad[:5]].tolist()})")
        if not np.array_equal(got_versions, versions):
            bad = np.flatnonzero(got_versions != versions)
            problems.append(f"table {spec.name}: {bad.size} rows' versions differ (IDs {ids[bad[:5]].tolist()}: "
                            f"{got_versions[bad[:5]].tolist()} != {versions[bad[:5]].tolist()})")
    version, dense = snapshot(client, job)
    plane_version = VersionVector(version).name()
    if meta.get("streamtrain.version") != plane_version:
        problems.append(f"the replica is at version {meta.get('streamtrain.version')}, the plane at {plane_version}")
    got_dense = {k.removeprefix("dense."): v for k, v in tensors.items() if k.startswith("dense.")}
    if sorted(got_dense) != sorted(dense):
        problems.append(f"dense tensors: the replica has {sorted(got_dense)}, the plane {sorted(dense)}")
    for name, want in dense.items():
        got = got_dense.get(name)
        if got is not None and (got.shape != tuple(want.shape) or got.tobytes() != want.numpy().tobytes()):
            problems.append(f"dense tensor {name} differs")
    return problems, rows


def assert_replica_equals_plane(cluster: LocalCluster, client: redis_lib.Redis, index: int = 0,
                                timeout_s: float = 120.0) -> dict[str, int]:
    """Assert that replica ``index`` holds exactly the plane's rows (IDs, values bit for bit and versions:
    no ID the plane lacks), and the plane's dense tensors at its version; return the rows per table.

    The plane may still move (a table sweep expires rows after the job quiesced): a comparison counts
    only when the feed's heads were the same before and after the plane was read and the replica's dump
    names them as its position; until then it is taken again."""
    job = cluster.spec.job
    last: list[str] = ["no comparison at a standing feed position"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = heads_now(client, job)
        tensors, meta = replica_state(cluster, index)
        if meta.get("streamtrain.feed.position") != before:
            at = meta.get("streamtrain.feed.position")
            last = [f"the replica is at feed position {at}, the feed's heads at {before}"]
            time.sleep(0.25)
            continue
        problems, rows = _compare(tensors, meta, client, job)
        after = heads_now(client, job)
        if after != before:  # the plane moved while it was read: again
            last = [f"the feed moved from {before} to {after} while comparing", *problems]
            continue
        assert not problems, "the replica differs from the parameter plane at feed position " \
                             f"{before}:\n  " + "\n  ".join(problems)
        return rows
    raise AssertionError(f"the replica never stood at the plane's feed position in {timeout_s:.0f} s: "
                         + "; ".join(last))


def assert_held_rows_are_the_plane_s(cluster: LocalCluster, client: redis_lib.Redis, index: int) -> dict[str, int]:
    """Assert that every row bounded replica ``index`` holds is the plane's (ID present there, values bit
    for bit, version); return the rows it holds per table. The plane must stand still."""
    tensors, _ = replica_state(cluster, index)
    meta = read_meta(client, cluster.spec.job)
    held = {}
    for spec in meta.tables:
        ids, values = tensors[f"{spec.name}.ids"], tensors[f"{spec.name}.values"]
        p_ids, p_values, p_versions = plane_rows(client, cluster.spec.job, spec, meta.groups)
        at = np.searchsorted(p_ids, ids)
        assert np.all(at < p_ids.size) and np.array_equal(p_ids[np.minimum(at, p_ids.size - 1)], ids), \
            f"{spec.name}: the replica holds rows the plane lacks"
        assert values.tobytes() == p_values[at].tobytes(), f"{spec.name}: a held row differs from the plane's"
        assert np.array_equal(tensors[f"{spec.name}.versions"], p_versions[at]), spec.name
        held[spec.name] = int(ids.size)
    return held


def infer_body(x: np.ndarray, ids: Mapping[str, Jagged]) -> dict[str, Any]:
    """The OIP infer request (JSON tensors) of records with dense features ``x`` and ragged ``ids``."""
    inputs: list[dict[str, Any]] = []
    if x.shape[1]:
        inputs.append({"name": "x", "datatype": "FP32", "shape": list(x.shape),
                       "data": x.astype(np.float32).ravel().tolist()})
    for f, col in ids.items():
        lengths = np.diff(col.offsets)
        inputs.append({"name": f, "datatype": "INT64", "shape": [int(col.values.size)],
                       "data": col.values.tolist()})
        inputs.append({"name": f + ".lengths", "datatype": "INT64", "shape": [int(lengths.size)],
                       "data": lengths.tolist()})
    return {"inputs": inputs}


def outputs_of(answer: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """An OIP infer answer's outputs by name."""
    return {o["name"]: np.asarray(o["data"], dtype=np.float32 if o["datatype"] == "FP32" else np.int64)
            for o in answer["outputs"]}
