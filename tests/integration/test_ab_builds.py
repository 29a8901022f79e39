"""``bench.ab_builds`` loads two real meshes in turn and counts each one's processes only.

Its figures mean something only if each burst's CPU is that mesh's own: with two meshes up, a count
of every kvmesh process on the machine would add the idle one's to each. And an A/A run (the same
revision on both sides) must come out near 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving_cpu import LOADGEN, descendants, service_pids

REPO = Path(__file__).resolve().parents[2]

# a process that starts a child of its own, says the child's pid and waits to be stopped
PARENT = (
    "import subprocess, sys; "
    "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE); "
    "print(child.pid, flush=True); sys.stdin.read(); child.stdin.close(); child.wait()"
)


def test_descendants_are_a_process_and_everything_below_it_only() -> None:
    first = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first_child = int(first.stdout.readline())
        other_child = int(other.stdout.readline())
        assert descendants(first.pid) == {first.pid, first_child}
        assert other_child in descendants(other.pid) and other_child not in descendants(first.pid)
        assert descendants(first.pid, other.pid) == {first.pid, first_child, other.pid, other_child}
        assert service_pids(first.pid) == {}  # neither runs a kvmesh service
    finally:
        for process in (first, other):
            process.communicate("", timeout=30)
    assert first.returncode == 0 and other.returncode == 0


@pytest.mark.skipif(not LOADGEN.exists(), reason="bench.serving_cpu needs ../shared/peers/loadgen.py")
def test_an_a_a_run_loads_both_meshes_and_reports_ratios() -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "bench.ab_builds", "--base", "HEAD", "--bursts", "2", "--n", "40", "--warmup", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    bursts = [line for line in finished.stdout.splitlines() if line.startswith("burst ")]
    assert [line.split()[2] for line in bursts] == ["base", "head", "head", "base"]
    assert all('"ok": 40, "errors": 0' in line for line in bursts)
    assert "base (HEAD):" in finished.stdout and "head (working tree):" in finished.stdout
    ratio = next(line for line in finished.stdout.splitlines() if line.startswith("head / base requests_per_s"))
    assert "over 2 bursts" in ratio
    # the worktree the base ran from is gone again
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "kvmesh-ab-" not in worktrees.stdout
