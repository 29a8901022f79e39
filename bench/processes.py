"""The processes a benchmark starts for the systems it measures: each in its own session, so that
stopping it stops everything it started, and each ending with the benchmark if that is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvmesh.common.runtime.child_process import ending_with_parent


def start_in_session(argv: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """``argv`` in a new session (its process group is what :func:`stop_sessions` signals) that gets
    SIGTERM when this process dies; ``popen``: more of ``subprocess.Popen``'s arguments."""
    return subprocess.Popen(ending_with_parent(argv), start_new_session=True, **popen)


def stop_sessions(processes: Sequence[subprocess.Popen[bytes]], timeout: float = 30) -> None:
    """SIGTERM every process's group, then wait for each (all are asked before any is waited for);
    a group still there after ``timeout`` seconds (a server waiting on a request that never ends)
    gets SIGKILL."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes have used so far (from /proc; one that has exited
    counts nothing)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited
        total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total
