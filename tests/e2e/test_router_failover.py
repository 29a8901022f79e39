"""kill -9 one of two router replicas during 200 concurrent streaming requests: every client still
gets one uninterrupted answer with its full token count. The answers stream from the workers, so
none is cut; requests routed while the replica dies fail over to the other one, and ``kvmesh up``
restarts the killed replica."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.devtools.mesh_process import MeshProcess
from tests.e2e.conftest import descendants, start_mesh
from tests.support import assert_every_stream_whole, streams_interrupted_by, wait_until

pytestmark = pytest.mark.e2e
MAX_TOKENS = 60
STREAMS = 200
KILL_AFTER_STARTED = 50  # early: most streams are still mid-flight when the router dies


@pytest.fixture(scope="module")
def two_router_mesh() -> Iterator[MeshProcess]:
    # a slow engine (about 5 s per stream), so streams are still running when the router dies even
    # when the test client, busy with 200 streams, notices the 50th first token late
    yield from start_mesh("--routers", "2", "--router-replica-sync", "--speedup-ratio", "0.2")


def router_pids(mesh: MeshProcess) -> list[int]:
    assert mesh.process is not None
    pids = []
    for pid in descendants(mesh.process.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvmesh.router" in cmdline:
            pids.append(pid)
    return sorted(pids)


def test_streams_survive_a_router_killed_mid_flight(two_router_mesh):
    routers = router_pids(two_router_mesh)
    assert len(routers) == 2

    async def kill() -> None:
        os.kill(routers[0], signal.SIGKILL)

    results = asyncio.run(
        streams_interrupted_by(
            two_router_mesh.api, kill, streams=STREAMS, max_tokens=MAX_TOKENS, after_started=KILL_AFTER_STARTED
        )
    )
    assert_every_stream_whole(results, STREAMS, MAX_TOKENS)
    # kvmesh up restarted the killed replica (the log is read by a thread that may lag: wait for it)
    for line_part in ("restarting it",):
        wait_until(
            lambda part=line_part: any(part in line for line in two_router_mesh.output),
            timeout=30,
            what=f"log line {line_part!r}",
        )
