"""``streamtrain up`` end to end, as a user runs it: a subprocess, its output and its exit status.

A tiny regression job (``tests/regression_job.py``: a ``module:callable`` source
and a ``module:factory`` model with the MSE loss) runs everything real (Kafka,
Redis, the coordinator, a parameter server, a trainer and the producer) until
``--max-records`` are consumed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def test_the_movielens_example_prints_its_held_out_auc_and_log_loss() -> None:
    """``up --example movielens``, shortened: MovieLens-100K through Kafka into the ranking model with
    embedding tables, until a low AUC target or 30,000 records; scored on the last 10 % by time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env = {k: v for k, v in env.items() if not k.startswith("STREAMTRAIN_")}
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "up", "--example", "movielens", "--max-records", "30000",
         "--target-auc", "0.66", "--trainers", "1", "--timeout-s", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "job movielens" in out and "on 10000 records" in out, out[-3000:]  # the held-out last tenth
    auc = float(re.search(r"held-out AUC\s*│?\s*([0-9.]+)", out).group(1))
    logloss = float(re.search(r"held-out log loss\s*│?\s*([0-9.]+)", out).group(1))
    assert auc >= 0.66 or "--max-records 30,000 consumed" in out, out[-3000:]
    assert auc > 0.6 and logloss < 0.69, out[-3000:]  # better than chance (AUC 0.5, log loss ln 2 = 0.693)
    assert out.index("held-out AUC") < out.index("held-out log loss") < out.index("held-out accuracy")
