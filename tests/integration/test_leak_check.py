"""The suite's leak check (tests/conftest.py, tests/leaks.py) run on small suites of its own, serially
and on two pytest-xdist workers: a process a test leaves running fails the run and is killed, and
one worker's check never touches the processes of a test another worker is still running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import leaks

REPO = Path(__file__).resolve().parents[2]

LEAKING_TEST = """
import subprocess, sys

def test_leaves_a_sleeper_running():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # kvmesh-leak-probe"])
"""

# Two files, so that two workers run one each (loadfile). The second's worker finishes first and
# runs its leak check while the first's test still holds its child; the first then checks that the
# child lived through that check.
HOLDING_TEST = """
import os, subprocess, sys, time
from pathlib import Path

def test_holds_a_child_while_the_other_worker_finishes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        done = Path(os.environ["PROBE_DIR"]) / "other-worker"
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.read_text() != os.environ["PYTEST_XDIST_WORKER"], "both files ran on one worker"
        checked = Path(os.environ["PROBE_DIR"]) / f"checked-{done.read_text()}"
        while not checked.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checked.exists(), "the other worker did not finish its session"
        assert child.poll() is None, "the other worker's leak check killed this test's child"
    finally:
        child.kill()
        child.wait()
"""

QUICK_TEST = """
import os
from pathlib import Path

def test_finishes_at_once():
    # Written aside and renamed: the holder must never see the file before its name is in it.
    done = Path(os.environ["PROBE_DIR"]) / "other-worker"
    staged = done.with_suffix(".staged")
    staged.write_text(os.environ["PYTEST_XDIST_WORKER"])
    os.replace(staged, done)
"""

# Says when a worker's session has ended: after every other sessionfinish hook, the leak check's too.
CONFTEST = """
import os
from pathlib import Path
import pytest

@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        (Path(os.environ["PROBE_DIR"]) / f"checked-{worker}").write_text("")
"""


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest on ``folder`` with this suite's conftest as a plugin and none of its settings."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROBE_DIR": str(folder)}
    env.pop(leaks.MARKER, None)  # the inner run is a test session of its own
    command = [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(folder)]
    command += ["-p", "tests.conftest", "-p", "no:cacheprovider", *args, str(folder)]
    return subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=120)


def probes_alive() -> list[int]:
    """The live processes the leaking test started (their command line carries the probe's tag)."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if "kvmesh-leak-probe" in leaks.command_of(pid)]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "two-workers"])
def test_a_process_left_running_fails_the_run_and_is_killed(tmp_path: Path, workers: list[str]):
    (tmp_path / "test_leaking.py").write_text(LEAKING_TEST)
    (tmp_path / "test_quick.py").write_text(QUICK_TEST.replace('os.environ["PYTEST_XDIST_WORKER"]', '"-"'))
    result = run_pytest(tmp_path, *workers)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 process(es) left running by the tests (killed)" in result.stdout
    assert "kvmesh-leak-probe" in result.stdout
    assert probes_alive() == []


def test_one_workers_leak_check_spares_another_workers_running_test(tmp_path: Path):
    (tmp_path / "test_holding.py").write_text(HOLDING_TEST)
    (tmp_path / "test_quick.py").write_text(QUICK_TEST)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    result = run_pytest(tmp_path, "-n", "2", "--dist", "loadfile")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
    assert "left running" not in result.stdout
