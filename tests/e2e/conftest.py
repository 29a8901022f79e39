"""A whole mesh started the way a user starts it: ``kvmesh up`` as a separate process tree."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import free_port, wait_until


@dataclass
class Mesh:
    base_url: str
    nats_url: str
    process: subprocess.Popen[str]
    output: list[str]

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents[int(entry.name)] = ppid
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_mesh(*extra: str) -> Iterator[Mesh]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services",
            "up",
            "--http-port",
            str(port),
            "--speedup-ratio",
            "50",
            "--log-level",
            "warning",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")), daemon=True).start()
    try:
        wait_until(
            lambda: any("kvmesh is up" in line for line in output) or process.poll() is not None,
            timeout=60,
            what="kvmesh up banner",
        )
        assert process.poll() is None, "kvmesh up exited:\n" + "".join(output)
        nats_url = next(m.group(1) for line in output if (m := re.search(r"NATS: (\S+)", line)))
        mesh = Mesh(f"http://127.0.0.1:{port}", nats_url, process, output)
        children = _children(process.pid)
        assert len(children) >= 6  # nats, indexer, router, 2 workers, frontend
        yield mesh
    finally:
        children = _children(process.pid)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
    assert code == 0, "kvmesh up did not stop cleanly:\n" + "".join(output[-50:])
    wait_until(lambda: not any(_alive(pid) for pid in children), timeout=10, what="no orphan processes")


@pytest.fixture(scope="module")
def kv_mesh() -> Iterator[Mesh]:
    yield from start_mesh("--router-mode", "kv")


@pytest.fixture(scope="module")
def round_robin_mesh() -> Iterator[Mesh]:
    yield from start_mesh("--router-mode", "round-robin")
