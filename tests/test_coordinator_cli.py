"""``streamtrain coordinator`` and ``streamtrain status`` as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import redis as redis_lib
from rich.console import Console

from common.keys import JobKeys
from coordinator.status_cli import render
from streamtrain.launcher import free_port, wait_until


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_coordinator_process_serves_and_status_prints(redis_url: str,
                                                      redis: redis_lib.Redis) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "STREAMTRAIN_JOB_TOKEN": "jt", "STREAMTRAIN_ADMIN_TOKEN": "at",
           "STREAMTRAIN_TABLE_STALENESS": "8"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamtrain.cli", "coordinator", "--job", "clijob",
         "--redis-url", redis_url, "--port", str(port), "--partitions", "3", "--table-consistency", "asp",
         "--kafka-bootstrap", f"127.0.0.1:{free_port()}", "--kafka-timeout-ms", "200"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _healthy(url) or proc.poll() is not None, timeout_s=30,
                   what="coordinator /healthz")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        config = redis.hgetall(JobKeys("clijob").config)
        assert (config[b"partitions"], config[b"table_consistency"], config[b"table_staleness"]) == (
            b"3", b"asp", b"8")
        req = urllib.request.Request(url + "/v1/members", method="POST",
                                     data=json.dumps({"capabilities": {"device": "cpu"}}).encode(),
                                     headers={"Authorization": "Bearer jt",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            member = json.load(resp)["member_id"]
        out = subprocess.run([sys.executable, "-m", "streamtrain.cli", "status", "--url", url],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0, out.stderr
        assert "job clijob" in out.stdout and member in out.stdout
        assert "ssp (s=2)  tables asp (s=8)  lr" in out.stdout, out.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
    assert proc.returncode == 0


def test_missing_tokens_and_unreachable_status_fail_clearly(redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    out = subprocess.run([sys.executable, "-m", "streamtrain.cli", "coordinator",
                          "--redis-url", redis_url], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 2 and "--admin-token" in out.stderr
    out = subprocess.run([sys.executable, "-m", "streamtrain.cli", "status", "--url",
                          f"http://127.0.0.1:{free_port()}", "--timeout-s", "2"],
                         capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "200"})
    assert out.returncode == 1 and "cannot read" in out.stdout


def _status(tables: dict | None) -> dict:
    """A ``/v1/status`` document with no member and no partition."""
    status = {"job": "j", "generation": 1, "config": {"consistency": "ssp", "staleness": 2, "lr": 0.1,
                                                      "codec": "none", "ps_groups": 2, "paused": False},
              "throughput_records_per_s": 0.0, "loss": None, "accuracy": None, "lag": 0,
              "versions": {"min": 3, "max": 4}, "members": [], "partitions": []}
    if tables is not None:
        status["tables"] = tables
    return status


def test_status_prints_the_embedding_tables_only_for_a_model_with_tables() -> None:
    tables = {"row_cache_hit_rate": 0.8125, "per_table": [
        {"name": "user", "rows": 1234567, "bytes": 3 * 2**20, "admitted": 1300000, "dropped": 42,
         "expired": 65433, "evicted": 0},
        {"name": "item", "rows": 5, "bytes": 700, "admitted": 5, "dropped": 0, "expired": 0, "evicted": 0}]}
    console = Console(record=True, width=200)
    render(_status(tables), console)
    out = console.export_text()
    assert "embedding tables (row cache hit rate 81.2%)" in out, out
    user = [cell.strip() for cell in next(line for line in out.splitlines() if "user" in line).split("│")]
    assert user[1:-1] == ["user", "1,234,567", "3.0 MiB", "1,300,000", "42", "65,433", "0"], user
    assert "700 B" in out
    for dense in (_status(None), _status({"row_cache_hit_rate": None, "per_table": []})):
        console = Console(record=True, width=200)
        render(dense, console)
        assert "embedding tables" not in console.export_text()


def test_status_prints_a_binary_models_held_out_auc_and_log_loss() -> None:
    console = Console(record=True, width=200)
    render({**_status(None), "auc": 0.7213, "log_loss": 0.6091, "accuracy": 0.66}, console)
    out = console.export_text()
    assert "held-out AUC 0.7213  log loss 0.6091  accuracy 0.66" in out, out
    console = Console(record=True, width=200)
    render(_status(None), console)  # not a binary model: no AUC
    assert "AUC" not in console.export_text()
