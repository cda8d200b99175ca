"""``streamtrain coordinator`` and ``streamtrain status`` as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import redis as redis_lib

from common.keys import JobKeys
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
