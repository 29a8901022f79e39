"""`kvmesh up --planner`: under a load ramp the planner grows the worker pool, after it shrinks it
back by draining workers, and no request fails; its decisions are in its SQLite history. With
`--prefill-workers` it sizes the prefill and the decode pool apart."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvmesh.common.runtime.run_file import read_run_record
from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.planner.state import PlannerState
from tests.e2e.conftest import start_mesh
from tests.support import assert_every_stream_whole, discovered, stream_chat, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STATE_DB = "planner.sqlite"


PLANNER_ARGS = (
    "--planner",
    "--workers", "1",
    "--min-workers", "1",
    "--max-workers", "3",
    "--adjustment-interval", "2",
    "--worker-startup-secs", "2",
    "--ttft-target-ms", "300",
    "--itl-target-ms", "20",
    "--speedup-ratio", "1",
)  # fmt: skip


@pytest.fixture(scope="module")
def planned_mesh(tmp_path_factory) -> Iterator[tuple[MeshProcess, Path]]:
    state = tmp_path_factory.mktemp("planner") / STATE_DB
    for mesh in start_mesh(*PLANNER_ARGS, "--planner-state-db", str(state)):
        yield mesh, state


async def stored_steps(path: Path) -> list:
    async with PlannerState(path) as state:
        return await state.recent(10_000)


def workers(mesh: MeshProcess) -> int:
    return len(discovered(mesh.nats_url, "worker"))


def pools(mesh: MeshProcess) -> tuple[int, int]:
    """(prefill, decode) workers registered."""
    roles = [record.role for record in discovered(mesh.nats_url, "worker")]
    return roles.count("prefill"), roles.count("decode")


async def drive(mesh: MeshProcess, prompts: list[str], output_tokens: int, watch_fn) -> tuple[list, list]:
    """Stream every prompt (24 at a time) while sampling ``watch_fn(mesh)`` twice a second."""
    client = openai.AsyncOpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(24)
    seen: list = []

    async def one(prompt: str):
        async with gate:
            return await stream_chat(client, prompt, output_tokens)

    async def watch() -> None:
        while True:
            seen.append(await asyncio.to_thread(watch_fn, mesh))
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    try:
        return await asyncio.gather(*(one(p) for p in prompts)), seen
    finally:
        watcher.cancel()
        await client.close()


def test_the_pool_grows_under_load_shrinks_after_and_no_request_fails(planned_mesh):
    mesh, state = planned_mesh
    assert workers(mesh) == 1
    prompts = [f"request {i}: " + "a long shared document " * 150 for i in range(240)]
    results, seen = asyncio.run(drive(mesh, prompts, 48, workers))
    assert_every_stream_whole(results, len(prompts), 48)
    assert max(seen) > 1, f"the pool never grew under load: {seen}"
    wait_until(lambda: workers(mesh) == 1, timeout=60, what="the pool to shrink back to one worker")

    # next to the running mesh, `kvmesh planner history` finds the planner's state file by itself
    assert read_run_record("default").planner_state_db == str(state)
    history = subprocess.run(
        [sys.executable, "-m", "kvmesh", "planner", "history", "--limit", "200"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    set_sizes = [int(line.split()[-2]) for line in history[1:]]
    assert max(set_sizes) > 1 and set_sizes[-1] == 1
    # the router published each worker's load, and the planner observed it under load
    recorded = asyncio.run(stored_steps(state))
    assert max(load.requests for step in recorded for load in step.observation.worker_loads) >= 1


@pytest.fixture(scope="module")
def disaggregated_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh(*PLANNER_ARGS, "--prefill-workers", "1", "--disagg-split-when", "always")


def test_disaggregated_the_prefill_and_decode_pools_are_sized_apart_and_no_request_fails(disaggregated_mesh):
    mesh = disaggregated_mesh
    assert pools(mesh) == (1, 1)
    # unique prompts longer than --disagg-min-uncached-tokens: every one prefills on a prefill worker
    prompts = [f"[{i}] " + f"document {i} that nothing else shares, " * 60 for i in range(360)]
    results, seen = asyncio.run(drive(mesh, prompts, 48, pools))
    assert_every_stream_whole(results, len(prompts), 48)
    assert max(p for p, _ in seen) > 1 or max(d for _, d in seen) > 1, f"no pool grew under load: {seen}"
    wait_until(lambda: pools(mesh) == (1, 1), timeout=60, what="both pools to shrink back to one worker")


def test_the_planners_own_files_are_removed_when_the_mesh_stops():
    """Without --planner-state-db the planner's state file and engine profile go in a directory of
    this run's own; a later `kvmesh up` never reads it, so it must not outlive the mesh."""
    namespace = "planner-files"
    mesh = MeshProcess("--planner", "--workers", "1", "--namespace", namespace, "--log-level", "warning").start()
    try:
        record = read_run_record(namespace)
        assert record is not None and record.planner_state_db
        planner_dir = Path(record.planner_state_db).parent
        assert (planner_dir / "engine-profile.json").is_file()
    finally:
        code = mesh.stop()
    assert code == 0, "kvmesh up did not stop cleanly:\n" + "".join(mesh.output[-50:])
    assert not planner_dir.exists(), f"{planner_dir} outlived kvmesh up"
