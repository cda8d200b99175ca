"""The coordinator answers as ``coordinator/openapi.yaml`` says: schemathesis, with all its checks and
its coverage, fuzzing and stateful phases, against a real coordinator on a real Redis.

Every check is on (server errors, undocumented status codes and content types, response schemas,
schema-valid requests refused, schema-invalid ones accepted, missing auth accepted, unsupported
methods, ...), so a field the server reads differently from the schema (``229.0`` for an integer),
a query parameter whose schema allows what the server refuses, or an answer the file does not
list fails here. The run is bounded (:data:`MAX_EXAMPLES` per operation, one worker, a fixed seed:
the same cases every run) and prints schemathesis's report of each failure with a ``curl`` line
that reproduces it.

Two departures from schemathesis's defaults, both answers the file documents: a schema-valid
request may be answered 410 (a member that left, a model version no longer kept: the resource is
gone, as 404 says it never existed), and ``/readyz`` answers 503 while Kafka is down, which it is
here (a listener that never answers).

The presence channel is a WebSocket, which an HTTP fuzzer cannot hold: a schema-valid request is
a real handshake, after which the connection speaks WebSocket and the fuzzer's next request on it
fails. Its answers are checked against the file by hand instead
(:func:`test_the_channels_answers_are_the_ones_its_openapi_entry_lists`).
"""

from __future__ import annotations

import asyncio
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis as redis_lib
import torch
import yaml

from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator
from services import ParameterStore

JOB = "openapi"
MAX_EXAMPLES = 10
"""Cases per operation and phase: enough to meet every documented answer, few enough to run in
well under a minute on a loaded 2-core machine."""
SEED = 20260521
"""Fixed, so every run sends the same cases (a failure reproduces with the same seed)."""

CHANNEL = "/v1/members/{member_id}/channel"

CONFIG = """\
[auth.openapi.jobToken]
bearer = "job-secret"

[auth.openapi.adminToken]
bearer = "admin-secret"

[checks.positive_data_acceptance]
# schemathesis's default list with 410 added: a well-formed request for a member that left, or for a
# model version no longer kept, is answered 410 Gone (documented), as one for a resource never known is 404
expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "410", "429", "5xx"]

[[operations]]
include-path = "/readyz"
# not ready while Kafka is down (this test's broker never answers): 503 is readiness's documented answer
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]
"""


@pytest.fixture
def settings(redis_url: str, silent_broker: str) -> CoordinatorSettings:
    """A coordinator on this test's Redis database; Kafka is down. Long leases: no member the run
    registers expires during it (the stateful phase registers, heartbeats, drains and leaves)."""
    return CoordinatorSettings(job=JOB, redis_url=redis_url, kafka_bootstrap=silent_broker, topic="train",
                               partitions=4, lease_ms=120_000, heartbeat_interval_ms=1000,
                               admin_token="admin-secret", job_token="job-secret", kafka_timeout_ms=100)


def _failures(report: str, width: int = 240) -> str:
    """The FAILURES section of a schemathesis report (else all of it), each line cut to ``width``."""
    start = report.find("= FAILURES =")
    text = report[start:] if start >= 0 else report
    return "\n".join(line if len(line) <= width else line[:width] + " ..." for line in text.splitlines())


@pytest.mark.timeout(240)
async def test_the_coordinator_answers_as_its_openapi_file_says(
        settings: CoordinatorSettings, redis: redis_lib.Redis, tmp_path: Path) -> None:
    ParameterStore(redis, JOB).init_model({"w": torch.zeros(300), "b": torch.zeros(3)}, shard_elems=128)
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    spec = resources.files("coordinator").joinpath("openapi.yaml")
    async with running_coordinator(settings) as client:
        url = str(client.make_url("/")).rstrip("/")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
            "run", str(spec), "--url", url, "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
            "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1",
            "--generation-database", "none", "--request-timeout", "30", "--continue-on-failure",
            "--exclude-path", CHANNEL,
            cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=200)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    report = out.decode(errors="replace")
    (tmp_path / "report.txt").write_text(report)
    assert proc.returncode == 0, _failures(report)
    documented = sum(1 for ops in _spec()["paths"].values() for m in ops if m in {"get", "post", "patch"})
    assert f"Tested: {documented - 1}" in report, report  # every operation but the channel


def _spec() -> dict[str, Any]:
    return yaml.safe_load(resources.files("coordinator").joinpath("openapi.yaml").read_text("utf-8"))


async def test_the_channels_answers_are_the_ones_its_openapi_entry_lists(settings: CoordinatorSettings) -> None:
    entry = _spec()["paths"][CHANNEL]["get"]
    headers = {p["name"]: p for p in entry["parameters"] if p.get("in") == "header"}
    assert {name for name, p in headers.items() if p["required"]} == {
        "Upgrade", "Connection", "Sec-WebSocket-Version", "Sec-WebSocket-Key"}
    auth = {"Authorization": "Bearer job-secret"}
    async with running_coordinator(settings) as client:
        member = (await (await client.post("/v1/members", json={"capabilities": {"device": "cpu"}},
                                           headers=auth)).json())["member_id"]
        answers = {}
        answers["no token"] = (await client.get(CHANNEL.format(member_id=member))).status
        answers["no handshake"] = (await client.get(CHANNEL.format(member_id=member), headers=auth)).status
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(CHANNEL.format(member_id="nobody"), headers=auth)
        answers["not a member"] = refused.value.status
        ws = await client.ws_connect(CHANNEL.format(member_id=member), headers=auth)
        answers["handshake"] = 101
        await ws.close()
    assert answers == {"no token": 401, "no handshake": 400, "not a member": 404, "handshake": 101}
    assert {str(status) for status in answers.values()} == set(entry["responses"])
