"""Processes the test session (or a CI run) started and left running.

Every process a test starts inherits the session's environment, orphans included (a vLLM engine core
whose worker was SIGKILLed, a service of a ``kvmesh up`` that lost its parent). Marking the
environment with a session id finds them all at the end, whoever their parent is now: a leaked
process keeps CPU and memory from later tests and, worse, holds the CI log's pipe open, so the CI
run never ends (one did: 90 minutes). Linux only (``/proc``); elsewhere nothing is found.

``python -m tests.leaks NAME`` lists and kills the processes whose environment variable ``NAME`` has
this process's value of it (``.ci/run`` sweeps its own run this way at the end).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

MARKER = "KVMESH_TEST_SESSION"


@dataclass(frozen=True)
class LeakedProcess:
    pid: int
    command: str


def mark_session() -> str:
    """Give this process (and so every process it starts from now on) the session's marker."""
    session = os.environ.setdefault(MARKER, uuid.uuid4().hex)
    return session


def _environment_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def command_of(pid: int) -> str:
    """A process's command line, its arguments joined by spaces (at most 200 characters; "?": gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def _ancestors_of_this_process() -> set[int]:
    """This process and its parents: they carry the marker too (a wrapper that set it) but are not
    leaks."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def leaked_processes(value: str, name: str = MARKER) -> list[LeakedProcess]:
    """Live processes whose environment has ``name=value``, other than this one and its ancestors."""
    needle = b"\0" + f"{name}={value}".encode() + b"\0"
    mine = _ancestors_of_this_process()
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        if needle in b"\0" + _environment_of(int(entry.name)):
            found.append(LeakedProcess(int(entry.name), command_of(int(entry.name))))
    return found


def kill(processes: list[LeakedProcess]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in os.environ:
        print("usage: python -m tests.leaks NAME  (NAME: an environment variable set in this process)")
        return 2
    leaked = leaked_processes(os.environ[argv[0]], argv[0])
    for process in leaked:
        print(f"left running, killed: pid {process.pid}: {process.command}")
    kill(leaked)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
