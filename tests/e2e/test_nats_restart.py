"""kill -9 of `kvmesh up`'s NATS server under streaming load: `kvmesh up` starts it again on the same
port and store, every stream completes whole, the services reconnect and the index converges to
what the workers hold. The official openai client drives the load."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import nats
import pytest

from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.devtools.index_truth import converged
from kvmesh.devtools.mesh_process import MeshProcess
from tests.support import stream_chat, streams_interrupted_by, wait_until, wait_until_async

pytestmark = pytest.mark.e2e
STREAMS = 12
MAX_TOKENS = 600


def nats_pids(mesh: MeshProcess) -> list[int]:
    started = next(line for line in mesh.output if "embedded NATS started" in line)
    match = re.search(r"\bpids\W+\[([\d, ]+)\]", started)  # console (pids=[1]) or JSON ("pids": [1]) logs
    assert match is not None, started
    return [int(pid) for pid in match.group(1).split(",")]


async def index_converges(mesh: MeshProcess) -> None:
    nc = await nats.connect(servers=mesh.nats_url.split(","))
    workers = DiscoveryWatcher(nc.jetstream(), "default", "worker")
    indexers = DiscoveryWatcher(nc.jetstream(), "default", "indexer")
    await workers.start()
    await indexers.start()
    try:
        await wait_until_async(lambda: len(workers.instances()) == 2 and indexers.instances(), timeout=30)
        address = indexers.instances()[0].address
        await wait_until_async(lambda: converged(workers, address), timeout=30, what="the index converges")
    finally:
        await workers.stop()
        await indexers.stop()
        await nc.close()


def test_nats_killed_under_load_is_restarted_and_nothing_is_lost():
    mesh = MeshProcess("--workers", "2", "--speedup-ratio", "2", "--log-level", "info").start()
    try:
        [pid] = nats_pids(mesh)

        async def kill_nats() -> None:
            os.kill(pid, signal.SIGKILL)

        answers = asyncio.run(
            streams_interrupted_by(mesh.api, kill_nats, streams=STREAMS, max_tokens=MAX_TOKENS, after_started=6)
        )
        assert [a.completion_tokens for a in answers] == [MAX_TOKENS] * STREAMS
        assert all(a.finish_reason == "length" for a in answers)
        wait_until(lambda: any("NATS server restarted" in line for line in mesh.output), timeout=30)

        async def after() -> None:
            import openai

            client = openai.AsyncOpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=30)
            answer = await stream_chat(client, "after the restart " * 10, 8)
            assert answer.completion_tokens == 8
            await client.close()
            await index_converges(mesh)

        asyncio.run(after())
    finally:
        assert mesh.stop() == 0
