"""The leak check that runs around every test (``tests/leaks.py``, ``conftest.py::leak_check``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from leaks import Allowance, Snapshot, find_leaks, wait_for_no_leaks

TESTS = Path(__file__).resolve().parent


def test_a_leaked_thread_is_named_until_it_ends() -> None:
    before = Snapshot.take()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="straggler", daemon=True)
    thread.start()
    try:
        found = wait_for_no_leaks(before, grace_s=0.3)
        assert len(found) == 1 and "thread 'straggler' (daemon" in found[0], found
        assert find_leaks(before, Snapshot.take(), kinds=("processes", "fds")) == []
        assert find_leaks(before, Snapshot.take(), Allowance(threads={thread})) == []
    finally:
        stop.set()
        thread.join(30)
    assert wait_for_no_leaks(before) == []


def test_a_leaked_child_process_is_named_with_its_command_line() -> None:
    before = Snapshot.take()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        found = wait_for_no_leaks(before, grace_s=0.3)
        assert [f"child process {child.pid}: {sys.executable} -c import time; time.sleep(600)"] == found
    finally:
        child.kill()
        child.wait()
    assert wait_for_no_leaks(before) == []  # reaped: neither alive nor a zombie


def test_open_descriptors_count_only_beyond_the_tolerance() -> None:
    before = Snapshot.take()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        assert find_leaks(before, Snapshot.take(), fd_tolerance=3) == []
        found = find_leaks(before, Snapshot.take(), fd_tolerance=2)
        assert len(found) == 1 and found[0].startswith("3 more open file descriptors") and "/dev/null" in found[0]
    finally:
        for fd in fds:
            os.close(fd)
    assert find_leaks(before, Snapshot.take(), fd_tolerance=0) == []


LEAKY_TESTS = '''
import pytest
import subprocess, sys, threading

STOP = threading.Event()

def test_leaks_a_thread():
    threading.Thread(target=STOP.wait, name="left-running", daemon=True).start()

@pytest.mark.leaks_allowed("this one is allowed to", kinds=("threads",))
def test_leaks_a_thread_but_may():
    threading.Thread(target=STOP.wait, name="allowed-to-run", daemon=True).start()

@pytest.fixture(scope="module")
def module_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield child
    child.kill()
    child.wait()

def test_uses_a_module_scoped_process(module_child):
    assert module_child.poll() is None

def test_does_not_leak():
    STOP.set()
'''


def test_the_fixture_fails_a_leaking_test_and_spares_higher_scoped_fixtures(tmp_path: Path) -> None:
    """The real conftest, in a pytest of its own: a leaked thread errors its test with the thread's
    name; the marker lets one pass; a module-scoped fixture's process is not the test's leak."""
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                                         "filterwarnings = ignore::DeprecationWarning\n"
                                         "markers =\n    leaks_allowed: leaks may stay\n")
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rE", "."],
                            cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    out = result.stdout + result.stderr
    assert re.search(r"\b4 passed.*\b1 error", out), out
    assert "ERROR at teardown of test_leaks_a_thread " in out and "thread 'left-running' (daemon" in out, out
    assert "allowed-to-run" not in out and "child process" not in out, out
