"""`kvmesh up --planner --shrink-handoff-blocks N --join-warmup-blocks N`: a shrink stops a worker that
first hands its hot blocks on, so its session's next turn finds its history cached on the survivor;
a grow starts a worker that imports the hot blocks before it registers, so its first requests find
them. Each against the same prompt length uncached, on the same worker.

The test sends the planner's scale requests itself, through the planner's own local connector to
the `kvmesh up` supervisor, so that the moments are the test's (the planner's interval is left
long; its decisions are test_planner_live's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import nats
import pytest

from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.planner.connectors import LocalSupervisor
from kvmesh.planner.decision import PoolSizes
from tests.e2e.conftest import start_mesh
from tests.integration.test_cache_moves import cached_on
from tests.support import discovered, router_generate, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
BLOCK = 16
HISTORY = 120  # blocks of a session's first turn


def turn(session: int, blocks: int, tail: int = 3) -> list[int]:
    return list(range(100_000 * (session + 1), 100_000 * (session + 1) + BLOCK * blocks + tail))


@pytest.fixture(scope="module")
def moving_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh(
        "--planner",
        "--workers", "2",
        "--min-workers", "1",
        "--max-workers", "2",
        "--adjustment-interval", "600",
        "--speedup-ratio", "0.5",
        "--block-size", str(BLOCK),
        "--shrink-handoff-blocks", "4096",
        "--join-warmup-blocks", "4096",
    )  # fmt: skip


async def ttft(router: str, request_id: str, prompt: list[int], worker_id: int | None = None) -> tuple[float, int, int]:
    """(time to first token in ms, prompt tokens cached, the worker that served it)."""
    started = time.perf_counter()
    first: list[float] = []
    outputs = await router_generate(
        router, request_id, prompt, 2, worker_id, on_output=lambda _: first.append(time.perf_counter())
    )
    return (first[0] - started) * 1000, outputs[-1].usage.cached_prompt_tokens, outputs[-1].worker_id


async def scale(mesh: MeshProcess, workers: int) -> PoolSizes:
    nc = await nats.connect(mesh.nats_url)
    try:
        return await LocalSupervisor(nc, "default", timeout=30).scale(PoolSizes(aggregated=workers))
    finally:
        await nc.close()


def worker_ids(mesh: MeshProcess) -> set[int]:
    return {record.instance_id for record in discovered(mesh.nats_url, "worker")}


def test_a_shrink_hands_the_cache_on_and_a_grow_starts_warm(moving_mesh):
    mesh = moving_mesh
    router = discovered(mesh.nats_url, "router")[0].address
    first, second = sorted(worker_ids(mesh))
    # two sessions, one on each worker: whichever leaves, its session has a history to lose
    for session, worker in enumerate((first, second)):
        asyncio.run(router_generate(router, f"s{session}-t1", turn(session, HISTORY), 2, worker))

    assert asyncio.run(scale(mesh, 1)) == PoolSizes(aggregated=1)
    wait_until(lambda: len(worker_ids(mesh)) == 1, timeout=60, what="the shrink")
    (survivor,) = worker_ids(mesh)
    survivor_address = discovered(mesh.nats_url, "worker")[0].address
    for session in (0, 1):
        history = set(sequence_hashes(local_block_hashes(turn(session, HISTORY), BLOCK)))
        wait_until(
            lambda h=history: h <= asyncio.run(cached_on(survivor_address)),
            timeout=30,
            what=f"session {session}'s history on the survivor",
        )
    # both sessions' next turns find their history on the survivor, the moved one too
    moved = [asyncio.run(ttft(router, f"s{s}-t2", turn(s, HISTORY + 4))) for s in (0, 1)]
    assert all(cached == HISTORY * BLOCK and worker == survivor for _, cached, worker in moved), moved
    cold, cached, _ = asyncio.run(ttft(router, "fresh-1", turn(7, HISTORY + 4), survivor))
    assert cached == 0
    assert max(ms for ms, _, _ in moved) < cold, (moved, cold)

    assert asyncio.run(scale(mesh, 2)) == PoolSizes(aggregated=2)
    wait_until(lambda: len(worker_ids(mesh)) == 2, timeout=60, what="the grow")
    (joiner,) = worker_ids(mesh) - {survivor}
    # registered only once warm: its first request of a session finds the session's history without
    # having served it (after one short request that opens the router's stream to the new worker,
    # whose set-up would otherwise be charged to whichever request came first)
    asyncio.run(router_generate(router, "opening", turn(9, 1), 1, joiner))
    warm_ms, cached, worker = asyncio.run(ttft(router, "s0-t3", turn(0, HISTORY + 8), joiner))
    assert worker == joiner and cached == (HISTORY + 4) * BLOCK  # its history and the second turn
    cold_ms, cached, _ = asyncio.run(ttft(router, "fresh-2", turn(8, HISTORY + 8), joiner))
    assert cached == 0 and warm_ms < cold_ms, (warm_ms, cold_ms)
