"""`kvmesh up --nats-cluster 3`: a three-node NATS cluster on loopback with every stream and bucket
replicated three times. kill -9 of the node that leads the KV event stream under streaming load:
every stream completes whole, `kvmesh up` starts the node again and it catches up. kill -9 of
`kvmesh up` itself: every process it started (NATS nodes, services) ends with it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal

import pytest

from kvmesh.common.runtime.jetstream_state import kvmesh_streams
from kvmesh.common.runtime.ports import process_tree
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.wire import names
from kvmesh.devtools.mesh_process import MeshProcess
from tests.e2e.test_nats_restart import index_converges, nats_pids
from tests.leaks import command_of
from tests.support import stream_chat, streams_interrupted_by, wait_until, wait_until_async

pytestmark = pytest.mark.e2e
STREAMS = 8
MAX_TOKENS = 400


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


async def stream_leader(nats_url: str) -> str:
    nc = await connect_nats(nats_url, name="test")
    try:
        [state] = [s for s in await kvmesh_streams(nc.jetstream()) if s.stream == names.KV_EVENTS_STREAM]
        assert state.replicas == 3
        assert state.leader is not None
        return state.leader
    finally:
        await nc.close()


async def fully_replicated(nats_url: str) -> bool:
    nc = await connect_nats(nats_url, name="test")
    try:
        states = await kvmesh_streams(nc.jetstream())
        return bool(states) and all(s.replicas == 3 and s.current_replicas == 3 for s in states)
    except Exception:
        return False
    finally:
        await nc.close()


def test_a_dead_cluster_node_is_restarted_under_load_and_nothing_outlives_kvmesh_up():
    mesh = MeshProcess("--nats-cluster", "3", "--workers", "2", "--speedup-ratio", "2").start(timeout=90)
    try:
        pids = nats_pids(mesh)
        assert len(pids) == 3
        leader = asyncio.run(stream_leader(mesh.nats_url))  # servers are named n1, n2, n3 in start order
        victim = pids[int(leader.removeprefix("n")) - 1]

        async def kill_leader() -> None:
            os.kill(victim, signal.SIGKILL)

        answers = asyncio.run(
            streams_interrupted_by(mesh.api, kill_leader, streams=STREAMS, max_tokens=MAX_TOKENS, after_started=4)
        )
        assert [a.completion_tokens for a in answers] == [MAX_TOKENS] * STREAMS
        wait_until(lambda: any("NATS server restarted" in line for line in mesh.output), timeout=60)

        async def after() -> None:
            await wait_until_async(lambda: fully_replicated(mesh.nats_url), timeout=60, what="3 current replicas")
            import openai

            client = openai.AsyncOpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=30)
            assert (await stream_chat(client, "after the node came back " * 8, 8)).completion_tokens == 8
            await client.close()
            await index_converges(mesh)

        asyncio.run(after())
        assert mesh.process is not None
        started = process_tree(mesh.process.pid) - {mesh.process.pid}
        assert len(started) >= 3 + 5  # three NATS nodes, two workers, indexer, router, frontend
        mesh.process.kill()
        mesh.process.wait()
        try:
            wait_until(lambda: not any(alive(pid) for pid in started), timeout=30)
        except AssertionError:  # name the survivors: CI once saw one and nothing said which
            survivors = {pid: command_of(pid) for pid in started if alive(pid)}
            raise AssertionError(f"still running 30 s after kvmesh up was killed: {survivors}") from None
    finally:
        if mesh.process is not None and mesh.process.poll() is None:
            mesh.stop()
        remove_nats_store(mesh)


def remove_nats_store(mesh: MeshProcess) -> None:
    """The embedded cluster's store, as `kvmesh up` logged it: it removes the store when it stops, and
    a `kvmesh up` killed with -9 cannot."""
    for line in mesh.output:
        if "embedded NATS started" in line:
            shutil.rmtree(json.loads(line)["store"], ignore_errors=True)
