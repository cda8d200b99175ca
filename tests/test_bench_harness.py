"""The benches run as the README runs them, and what they rely on holds.

Each bench is a script (``.venv/bin/python bench/<name>.py``): here each is run as a file from a
folder that is not the repository, in a fresh shell's environment (no ``PYTHONPATH``), and writes its
results to a temporary folder (``bench.harness.RESULTS_ENV``). The plug-in models a bench trains are
imported the way its trainers import them: in a process of their own, in another folder, with the
environment the cluster hands a trainer once the bench has started (``bench.harness.start``). The
cheap benches run end to end at their smallest size; so does ``bench/compression.py``'s small-model
job (marked slow: a whole local cluster), whose trainers must import its plug-in model. The benches
read a trainer's step phases from its :mod:`trainers.events` records, never from a human log line.

Tests assert behaviour, never timing: no figure a bench prints is checked, only that it ran, wrote
its results with the machine, and printed its ratio last.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainers import events

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS_ENV = "STREAMTRAIN_BENCH_RESULTS"
"""``bench.harness.RESULTS_ENV`` (spelt here: importing the harness puts the repository on our path)."""
BENCHES = sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
"""The benches: the scripts of bench/ (the other modules are what they import)."""
MODULES = sorted(p.stem for p in BENCH.glob("*.py"))
PLUGIN = re.compile(r"""["'](bench\.[\w.]+:\w+)["']""")


def _fresh_environment(tmp_path: Path) -> dict[str, str]:
    """A fresh shell's environment (no PYTHONPATH), results going to ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", RESULTS_ENV)}
    env[RESULTS_ENV] = str(tmp_path / "results")
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _plugin_specs() -> list[str]:
    """Every plug-in model spec a bench names, and every factory of bench/models.py."""
    named = {m for p in BENCH.glob("*.py") for m in PLUGIN.findall(p.read_text())}
    tree = ast.parse((BENCH / "models.py").read_text())
    factories = {f"bench.models:{node.name}" for node in tree.body
                 if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    return sorted(named | factories)


def test_the_benches_are_found() -> None:
    assert {"compression", "coordinator", "datastream", "embeddings", "failover", "gpu", "paramserver", "pipeline",
            "recommendation", "scale", "soak"} <= set(BENCHES)
    assert {"harness", "models", "peers"} <= set(MODULES) - set(BENCHES)
    assert "bench.models:small_mlp" in _plugin_specs()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", BENCHES)
def test_a_bench_imports_as_it_is_run(name: str, tmp_path: Path) -> None:
    # everything a bench imports at its top runs before argparse answers --help
    done = _run([str(BENCH / f"{name}.py"), "--help"], tmp_path, _fresh_environment(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


@pytest.mark.timeout(300)
def test_every_bench_module_imports_as_a_module(tmp_path: Path) -> None:
    # as one bench imports another (compression imports bench.pipeline) and DDP's ranks import bench.peers
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}:\n"
            "    importlib.import_module('bench.' + name)\n"
            f"assert sys.path[0] == {str(ROOT)!r}, sys.path[:3]\n"
            f"assert {str(BENCH)!r} not in sys.path\n")
    env = _fresh_environment(tmp_path) | {"PYTHONPATH": str(ROOT)}
    done = _run(["-c", code], tmp_path, env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def _trainer_environment(tmp_path: Path) -> dict[str, str]:
    """The environment a trainer of a bench's cluster gets: what the launcher (``ServiceProcess``) hands
    its process once the bench has called ``bench.harness.start()``."""
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "from bench import harness\n"
            "harness.start()\n"
            "from streamtrain.launcher import ServiceProcess\n"
            "print(json.dumps(ServiceProcess('trainer', ['trainer'])._environment()))\n")
    done = _run(["-c", code], tmp_path, _fresh_environment(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    env: dict[str, str] = json.loads(done.stdout)
    return env


_BUILD = ("import sys\n"
          "from trainers import build_model\n"
          "spec = build_model(sys.argv[1])\n"
          "print(sum(p.numel() for p in spec.model.parameters()))\n")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec", _plugin_specs())
def test_a_plugin_model_imports_where_the_trainers_run(spec: str, tmp_path: Path) -> None:
    folder = tmp_path / "trainer-1"  # a trainer runs in its own folder of the cluster's, not the repository
    folder.mkdir()
    done = _run(["-c", _BUILD, spec], folder, _trainer_environment(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0


@pytest.mark.timeout(240)
def test_without_the_harness_a_trainer_cannot_import_a_plugin_model(tmp_path: Path) -> None:
    # what bench/compression.py failed with before its trainers were given the repository
    done = _run(["-c", _BUILD, "bench.models:small_mlp"], tmp_path, _fresh_environment(tmp_path), timeout=120)
    assert done.returncode != 0
    assert "No module named 'bench'" in done.stderr


def _bench_module(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``bench.<name>``, imported here (the repository on our path for this test only)."""
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module(f"bench.{name}")


def test_the_harness_hands_its_processes_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    harness = _bench_module("harness", monkeypatch)
    env = harness.child_environment({"PYTHONPATH": f"/elsewhere{os.pathsep}{ROOT}", "HOME": "/home/x"})
    assert env == {"PYTHONPATH": f"{ROOT}{os.pathsep}/elsewhere", "HOME": "/home/x"}  # first, and once
    assert harness.child_environment({})["PYTHONPATH"] == str(ROOT)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # and restores it when the test ends
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)  # the bench's logging, not the tests'
    harness.start()
    assert os.environ["PYTHONPATH"] == str(ROOT)
    from streamtrain.launcher import ServiceProcess
    assert ServiceProcess("trainer", ["trainer"])._environment()["PYTHONPATH"] == str(ROOT)


def test_the_harness_writes_results_with_the_machine_and_prints_the_ratio_last(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    harness = _bench_module("harness", monkeypatch)
    path = harness.finish("example", {"ratio": 0.5}, ["first", "ratio example: 0.50"], path=tmp_path / "e.json")
    written = json.loads(path.read_text())
    assert written["bench"] == "example" and written["ratio"] == 0.5
    assert {"cpu", "cores", "torch_threads", "python", "torch", "redis_py"} <= set(written["machine"])
    assert capsys.readouterr().out.splitlines()[-3:] == [f"wrote {path}", "first", "ratio example: 0.50"]


def test_the_harness_reads_a_processs_cpu_with_its_childrens(monkeypatch: pytest.MonkeyPatch) -> None:
    harness = _bench_module("harness", monkeypatch)
    # a shell that spends nothing itself, waiting on a child that spins: the child's CPU is the shell's
    shell = subprocess.Popen(["bash", "-c", f"{sys.executable} -c 'while True: pass' & wait"], start_new_session=True)
    try:
        sampler = harness.CpuSampler({"shell": shell.pid}, interval_s=0.05).start()
        deadline = time.monotonic() + 60
        while harness.cpu_seconds(shell.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert harness.cpu_seconds(shell.pid) >= 0.2
        sampler.stop()  # (its last reading is now, after the spending was seen) before the kill: a child
        # killed but not reaped yet is counted by neither the shell nor a walk of its children
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    with pytest.raises(OSError):
        harness.cpu_seconds(shell.pid)
    sampler.sample()  # after its process is gone: its last reading stays
    spent = [s["shell"] for s in sampler.samples]
    assert spent == sorted(spent) and spent[-1] >= 0.2
    assert sampler.between(sampler.times[0], sampler.times[-1]) == {"shell": spent[-1] - spent[0]}


def test_the_cpu_sampler_reads_a_window_between_its_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    harness = _bench_module("harness", monkeypatch)
    sampler = harness.CpuSampler({"a": 1, "b": 2})
    sampler.times, sampler.samples = [10.0, 12.0, 14.0], [{"a": 1.0, "b": 0.0}, {"a": 3.0, "b": 0.0},
                                                          {"a": 3.0, "b": 4.0}]
    assert sampler.at(11.0) == {"a": 2.0, "b": 0.0}
    assert sampler.at(5.0) == sampler.samples[0] and sampler.at(20.0) == sampler.samples[-1]  # outside: the ends
    assert sampler.between(11.0, 13.0) == {"a": 1.0, "b": 2.0}


@contextlib.contextmanager
def _trainer_log(path: Path) -> Iterator[logging.Logger]:
    """While open, :func:`trainers.events.emit`'s records go to ``path`` in ``streamtrain.cli``'s format."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(events.LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        handler.close()


def test_the_benches_read_a_trainers_events_not_its_wording(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pipeline = _bench_module("pipeline", monkeypatch)
    logs = [tmp_path / "trainer-1.log", tmp_path / "trainer-2.log"]
    before = time.time()
    for i, path in enumerate(logs):
        with _trainer_log(path) as logger:
            logger.info("member m%d: something a person reads, worded as anyone likes", i)
            events.emit(events.CONSUMING, member=f"m{i}", generation=1, partitions={0: 10})
            events.emit(events.STEP_PHASES, member=f"m{i}", steps=50,
                        ms_per_step={"wait": 1.0 + i, "pull": 2.0, "compute": 3.0, "push_wait": 0.5})
            events.emit(events.STEP_PHASES, member=f"m{i}", steps=50,
                        ms_per_step={"wait": 3.0 + i, "pull": 2.0, "compute": 5.0, "push_wait": 0.5})
    with logs[1].open("a") as fh:
        fh.write(f"2000-01-01 00:00:00,000 INFO trainers.events: {events.PREFIX}{{\"event\": \"step_pha")  # torn
    after = time.time()

    cluster = SimpleNamespace(trainers=[SimpleNamespace(log_path=p) for p in logs])  # what step_phases reads
    assert pipeline.step_phases(cluster) == {"compute": 4.0, "pull": 2.0, "push_wait": 0.5, "wait": 2.5}
    started = pipeline.started_consuming(logs[0])
    assert before <= started <= after
    [consuming] = events.read(logs[0], events.CONSUMING)
    assert consuming["member"] == "m0" and consuming["partitions"] == {"0": 10}
    assert list(events.read(["no record on this line", "nor here"], events.STEP_PHASES)) == []
    silent = tmp_path / "trainer-3.log"
    silent.write_text("2000-01-01 00:00:00,000 INFO trainers.service: member m3 generation 1: consuming {0: 10}\n")
    with pytest.raises(RuntimeError, match="no 'consuming' record"):
        pipeline.started_consuming(silent)  # the human line alone does not count
    assert pipeline.started_consuming(silent, logs[0]) == started  # a trainer that never took partitions: the others'


def _check_run(name: str, done: subprocess.CompletedProcess[str], tmp_path: Path, last: str) -> dict[str, Any]:
    """The bench ran, printed ``last``... as its last line, and wrote its results with the machine."""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith(last), done.stdout[-2000:]
    results: dict[str, Any] = json.loads((tmp_path / "results" / f"{name}.json").read_text())
    assert results["bench"] == name
    assert {"cpu", "cores", "torch_threads", "python", "torch", "redis_py"} <= set(results["machine"])
    return results


@pytest.mark.timeout(240)
def test_the_coordinator_bench_runs(tmp_path: Path) -> None:
    done = _run([str(BENCH / "coordinator.py"), "--rounds", "1", "--lease-ms", "600", "--members", "2"],
                tmp_path, _fresh_environment(tmp_path), timeout=200)
    results = _check_run("coordinator", done, tmp_path, "ratio expiry delay / checker period: ")
    assert len(results["rounds"]) == 1


@pytest.mark.timeout(240)
def test_the_gpu_bench_runs(tmp_path: Path) -> None:
    # on a machine without CUDA it measures the CPU path, and says so
    done = _run([str(BENCH / "gpu.py"), "--model", "digits-mlp", "--batch", "32", "--steps", "12"],
                tmp_path, _fresh_environment(tmp_path), timeout=200)
    results = _check_run("gpu", done, tmp_path, "ratio trainer step / plain loop, digits-mlp on ")
    assert {"pull", "compute", "encode", "push", "apply"} <= set(results["phases_ms"])


@pytest.mark.timeout(240)
def test_the_datastream_bench_runs(kafka: Any, tmp_path: Path) -> None:
    done = _run([str(BENCH / "datastream.py"), "--records", "2000", "--rounds", "1", "--bootstrap", kafka.bootstrap],
                tmp_path, _fresh_environment(tmp_path), timeout=200)
    results = _check_run("datastream", done, tmp_path, "ratio ours/raw: ")
    assert results["records"] == 2000


@pytest.mark.timeout(420)
def test_the_join_bench_runs(kafka: Any, tmp_path: Path) -> None:
    done = _run([str(BENCH / "join.py"), "--impressions", "3000", "--rounds", "1", "--latency-s", "13",
                 "--latency-rate", "200", "--memory", "500,1000", "--max-pending", "100", "--calibration-records", "0",
                 "--bootstrap", kafka.bootstrap], tmp_path, _fresh_environment(tmp_path), timeout=380)
    results = _check_run("join", done, tmp_path, "ratio joined records/s / raw consume+produce records/s")
    assert results["throughput"]["impressions"] == 3000 and results["ratio"] > 0
    latency = results["latency"]
    assert latency["impressions"] == 2600 and latency["negatives"]["count"] > 0 and latency["positives"]["count"] > 0
    runs = results["memory"]["runs"]
    assert [(r["pending"], r["decided_early"]) for r in runs] == [(500, 0), (1000, 0), (400, 600)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_compression_bench_trains_its_plugin_model_on_a_cluster(tmp_path: Path) -> None:
    # its trainers, started by the cluster in their own folders, import bench.models:small_mlp; two
    # trainers of 8,000 records take more than 50 steps each, so each reports its step phases
    workdir = tmp_path / "run"
    done = _run([str(BENCH / "compression.py"), "--records", "8000", "--small-runs", "1", "--small-jobs", "defaults",
                 "--skip", "speed", "sizes", "warmup", "--workdir", str(workdir)],
                tmp_path, _fresh_environment(tmp_path), timeout=540)
    results = _check_run("compression", done, tmp_path, "small model (1,210 parameters): defaults ")
    assert results["small_model"]["defaults"]["settings"]["model"] == "bench.models:small_mlp"
    logs = sorted(workdir.glob("*/trainer-*/trainer-*.log"))
    assert len(logs) == 2
    for log in logs:
        assert list(events.read(log, events.CONSUMING)), log.read_text()[-3000:]
        phases = list(events.read(log, events.STEP_PHASES))
        assert phases and {"wait", "pull", "compute", "push_wait"} <= set(phases[0]["ms_per_step"])
