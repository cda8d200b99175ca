"""``streamtrain up`` end to end, as a user runs it: a subprocess, its output and its exit status.

A tiny regression job (``tests/regression_job.py``: a ``module:callable`` source
and a ``module:factory`` model with the MSE loss) runs everything real (Kafka,
Redis, the coordinator, a parameter server, a trainer and the producer) until
``--max-records`` are consumed.

``up --forever`` hands over what it made: the credentials file it prints (the serving replica's URL
among them), the Prometheus targets of every process, and with ``--model-out`` the final model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def test_regression_job_ends_at_max_records_with_loss_mae_and_r2() -> None:
    source = "regression_job:records?limit=5000"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]), "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith("STREAMTRAIN_")}  # only the flags below count
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "up", "--source", source, "--eval-source", source,
         "--model", "regression_job:linear_model", "--max-records", "3000", "--trainers", "1",
         "--partitions", "2", "--codec", "none", "--optimizer", "adam", "--lr", "0.1", "--timeout-s", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "--max-records 3,000 consumed" in out, out[-3000:]
    assert "held-out MAE" in out and "held-out R²" in out, out[-3000:]
    assert "accuracy" not in out.lower() and "held-out acc" not in out, out[-3000:]  # regression: no accuracy
    r2 = float(re.search(r"held-out R²\s*│?\s*(-?[0-9.]+)", out).group(1))
    mae = float(re.search(r"held-out MAE\s*│?\s*(-?[0-9.]+)", out).group(1))
    assert r2 > 0.7 and mae < 1.0, out[-3000:]  # it learned the linear teacher (R² 0: the mean; ~0.16 at init)


def test_a_job_on_an_endless_source_is_scored_on_a_bounded_held_out_split_and_ends() -> None:
    """The built-in ``synthetic`` source has no end unless ``limit=``, and so neither has its test split:
    ``up`` scores on its first ``HELD_OUT_LIMIT`` records (it hung in its first score before)."""
    from streamtrain.up import HELD_OUT_LIMIT

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]), "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith("STREAMTRAIN_")}
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "up", "--source", "synthetic?task=regression&features=8",
         "--model", "regression_job:linear_model", "--max-records", "3000", "--trainers", "1",
         "--partitions", "2", "--timeout-s", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "--max-records 3,000 consumed" in out, out[-3000:]
    assert f"on {HELD_OUT_LIMIT} records" in out and "held-out R²" in out, out[-3000:]


def test_the_movielens_example_prints_its_held_out_auc_and_log_loss() -> None:
    """``up --example movielens``, shortened: MovieLens-100K through Kafka into the ranking model with
    embedding tables, 30,000 records at 2,000 records/s; scored on the last 10 % by time. The serving
    replica scores a sample of the records before they are produced: its served AUC and served version
    are in the final table, beside the trainers' progressive AUC."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith("STREAMTRAIN_")}
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "up", "--example", "movielens", "--max-records", "30000",
         "--rate", "2000", "--target-auc", "0.99", "--trainers", "1", "--timeout-s", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "job movielens" in out and "on 10000 records" in out, out[-3000:]  # the held-out last tenth
    auc = float(re.search(r"held-out AUC\s*│?\s*([0-9.]+)", out).group(1))
    logloss = float(re.search(r"held-out log loss\s*│?\s*([0-9.]+)", out).group(1))
    assert "--max-records 30,000 consumed" in out, out[-3000:]
    assert auc > 0.6 and logloss < 0.69, out[-3000:]  # better than chance (AUC 0.5, log loss ln 2 = 0.693)
    assert out.index("held-out AUC") < out.index("held-out log loss") < out.index("held-out accuracy")
    served = re.search(r"served AUC\s*│\s*([0-9.]+) on ([0-9,]+) records the replica scored before", out)
    assert served and 0 < float(served.group(1)) < 1 and int(served.group(2).replace(",", "")) > 0, out[-3000:]
    assert out.index("progressive AUC", out.index("final")) < out.index("served AUC", out.index("final"))
    assert re.search(r"served version\s*│\s*[0-9]+ · serving lag [0-9.]+ s · ready · http://", out), out[-3000:]


def _sourced(path: str, command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``command`` in bash after ``source path``, as a user types it."""
    return subprocess.run(["bash", "-c", f"source {path} && {command}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _check_targets(path: str) -> None:
    """The Prometheus file_sd file names one target per process (the coordinator, the parameter server, the
    trainer and the serving replica), each on its own port, and each answers ``/metrics`` with Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    groups = json.loads(Path(path).read_text())
    services = sorted(g["labels"]["service"] for g in groups)
    assert services == ["coordinator", "ps", "serve", "trainer"], groups
    assert all(g["labels"]["job"] == "streamtrain" and g["labels"]["instance_name"] for g in groups), groups
    targets = [t for g in groups for t in g["targets"]]
    assert len(set(targets)) == len(targets) == 4, targets
    for group in groups:
        (target,) = group["targets"]
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            families = list(text_string_to_metric_families(resp.read().decode()))
        assert any(f.name.startswith("streamtrain_") for f in families), (group, [f.name for f in families])


def test_forever_hands_over_its_credentials_and_writes_the_model_out(tmp_path: Path) -> None:
    """The printed credentials file (0600) lets a shell fetch ``/v1/model`` with the job token (401
    without), ask the serving replica (``STREAMTRAIN_SERVE_URL``, the job token) what it serves, and run
    ``streamtrain export`` and ``status`` without flags; the tokens and Redis password set before ``up`` are
    the ones it uses; every process is listed in the printed Prometheus targets and answers ``/metrics``;
    Ctrl-C ends the run with the model in ``--model-out`` and the served version in the final table."""
    from safetensors.torch import load_file

    source = "regression_job:records?limit=5000"
    base = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    base.update(PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]), COLUMNS="200")
    given = {"STREAMTRAIN_JOB_TOKEN": "job-token-given", "STREAMTRAIN_ADMIN_TOKEN": "admin-token-given",
             "STREAMTRAIN_REDIS_PASSWORD": "redis-pass-given"}
    model_out = tmp_path / "final.safetensors"
    up = subprocess.Popen(
        [sys.executable, "-m", "streamtrain.cli", "up", "--forever", "--rate", "2000", "--source", source,
         "--eval-source", source, "--model", "regression_job:linear_model", "--trainers", "1", "--partitions", "2",
         "--codec", "none", "--optimizer", "adam", "--lr", "0.05", "--model-out", str(model_out)],
        cwd=ROOT, env={**base, **given}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if line.startswith("credentials: "):
                break
        else:
            raise AssertionError(f"up ended without printing its credentials:\n{''.join(lines)[-3000:]}")
        drain = threading.Thread(target=lambda: lines.extend(up.stdout or ()), daemon=True)
        drain.start()
        path = line.removeprefix("credentials: ").strip()
        targets = next(t for t in lines if t.startswith("prometheus targets: ")).split()[2]
        assert Path(targets).parent == Path(path).parent  # beside the credentials
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        text = Path(path).read_text()
        assert "export STREAMTRAIN_JOB_TOKEN=job-token-given" in text  # the environment's, not a random one
        assert "export STREAMTRAIN_ADMIN_TOKEN=admin-token-given" in text
        assert re.search(r"export STREAMTRAIN_REDIS_URL=.*:redis-pass-given@", text), text

        code = ('curl -s -o {out} -w "%{{http_code}}" {auth} "$STREAMTRAIN_COORDINATOR_URL/v1/model"')
        served = tmp_path / "served.safetensors"
        with_token = code.format(out=served, auth='-H "Authorization: Bearer $STREAMTRAIN_JOB_TOKEN"')
        deadline = time.monotonic() + 120
        while (got := _sourced(path, with_token, base)).stdout != "200":  # 404 until the first model is stored
            assert up.poll() is None and time.monotonic() < deadline, (got, "".join(lines)[-3000:])
            time.sleep(1.0)
        assert set(load_file(served)) == {"0.weight", "0.bias"}  # the model's parameter names
        assert _sourced(path, code.format(out="/dev/null", auth=""), base).stdout == "401"

        assert re.search(r"export STREAMTRAIN_SERVE_URL=http://127\.0\.0\.1:[0-9]+\n", text), text
        ask = 'curl -s -H "Authorization: Bearer $STREAMTRAIN_JOB_TOKEN" "$STREAMTRAIN_SERVE_URL/v1/replica"'
        while (replica := json.loads(_sourced(path, ask, base).stdout or "{}")).get("model_version") is None:
            assert up.poll() is None and time.monotonic() < deadline, (replica, "".join(lines)[-3000:])
            time.sleep(1.0)
        assert replica["job"] == "digits"  # up's job, served
        _check_targets(targets)

        exported = tmp_path / "exported.safetensors"
        done = _sourced(path, f"{sys.executable} -m streamtrain.cli export --out {exported}", base)
        assert done.returncode == 0, done.stderr
        assert set(load_file(exported)) == {"0.weight", "0.bias"}
        done = _sourced(path, f"{sys.executable} -m streamtrain.cli status --json", base)
        assert done.returncode == 0 and '"job"' in done.stdout, done.stderr

        up.send_signal(signal.SIGINT)  # Ctrl-C: a --forever run ends as asked
        assert up.wait(timeout=180) == 0, "".join(lines)[-3000:]
        drain.join(timeout=10)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stdout is not None:
            up.stdout.close()
    out = "".join(lines)
    assert "model written" in out, out[-3000:]
    assert re.search(r"served version\s*│\s*[0-9][0-9.]* · serving lag [0-9.]+ s · ", out), out[-3000:]
    final = load_file(model_out)
    assert set(final) == {"0.weight", "0.bias"} and final["0.weight"].shape == (1, 8)
    assert not Path(path).exists()  # removed with the cluster's folder
