"""``process_tree``: a process and everything below it, and nothing of a process beside it."""

from __future__ import annotations

import subprocess
import sys

from kvmesh.common.runtime.ports import process_tree

# a process that starts a child of its own, says the child's pid and waits to be stopped
PARENT = (
    "import subprocess, sys; "
    "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE); "
    "print(child.pid, flush=True); sys.stdin.read(); child.stdin.close(); child.wait()"
)


def test_a_process_tree_is_a_process_and_everything_below_it_only() -> None:
    first = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first_child = int(first.stdout.readline())
        other_child = int(other.stdout.readline())
        assert process_tree(first.pid) == {first.pid, first_child}
        assert other_child in process_tree(other.pid) and other_child not in process_tree(first.pid)
        assert process_tree(first.pid, other.pid) == {first.pid, first_child, other.pid, other_child}
    finally:
        for process in (first, other):
            process.communicate("", timeout=30)
    assert first.returncode == 0 and other.returncode == 0
