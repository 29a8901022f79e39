"""`kvmesh up --planner`: under a load ramp the planner grows the worker pool, after it shrinks it
back by draining workers, and no request fails; its decisions are in its SQLite history."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvmesh.common.run_file import read_run_record
from kvmesh.up import MeshProcess
from tests.e2e.conftest import start_mesh
from tests.support import discovered, stream_chat, wait_until

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


def workers(mesh: MeshProcess) -> int:
    return len(discovered(mesh.nats_url, "worker"))


def test_the_pool_grows_under_load_shrinks_after_and_no_request_fails(planned_mesh):
    mesh, state = planned_mesh
    assert workers(mesh) == 1
    seen: list[int] = []

    async def load() -> list:
        client = openai.AsyncOpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
        gate = asyncio.Semaphore(24)
        prompts = [f"request {i}: " + "a long shared document " * 150 for i in range(360)]

        async def one(prompt: str):
            async with gate:
                return await stream_chat(client, prompt, 48)

        async def watch() -> None:
            while True:
                seen.append(await asyncio.to_thread(workers, mesh))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            watcher.cancel()
            await client.close()

    results = asyncio.run(load())
    assert all(a.finish_reason == "length" and a.completion_tokens == 48 for a in results)
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
