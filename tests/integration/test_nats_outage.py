"""NATS killed (-9) under streaming load and started again on the same port and store, 10 s later:
the gRPC streams in flight complete whole, every service reconnects, the events the workers
published meanwhile reach the stream (their publishers resend), and the indexer replica ends up
holding exactly what the workers hold. Real NATS, real services, gRPC clients."""

from __future__ import annotations

import asyncio

import grpc
import nats
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from kvmesh.devtools.index_truth import converged, view
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import router_generate, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "outage"
OUTAGE_SECS = 10  # the drill's scenario: how long NATS stays down
STREAMS = 8
MAX_TOKENS = 2500  # at real-time speed, longer than the outage


async def generate(router_address: str, request_id: str, prompt: list[int], max_tokens: int) -> int:
    outputs = await asyncio.wait_for(
        router_generate(router_address, request_id, prompt, max_tokens, ignore_eos=True), timeout=120
    )
    assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return sum(len(o.token_ids) for o in outputs)


async def test_nats_down_for_10_s_under_load_loses_no_stream_and_no_event():
    server = await EmbeddedNatsServer().start()
    common = ["--nats-url", server.url, "--namespace", NAMESPACE, "--lease-ttl", "30"]
    worker = service_config(WorkerConfig, [*common, "--speedup-ratio", "1", "--block-size", "16"])
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    workers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    indexers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "indexer")
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    for watcher in (workers, indexers, routers):
        await watcher.start()
    try:
        async with (
            running(worker_server.serve, worker),
            running(worker_server.serve, worker),
            running(indexer_server.serve, service_config(IndexerConfig, [*common, "--replica-id", "o"])),
            running(router_server.serve, service_config(RouterConfig, common)),
        ):
            await wait_until_async(
                lambda: len(workers.instances()) == 2 and indexers.instances() and routers.instances(),
                timeout=20,
                what="the mesh registered",
            )
            router = routers.instances()[0].address
            indexer = indexers.instances()[0].address
            prompts = [[(i * 7 + j) % 250 for j in range(64 + 16 * i)] for i in range(STREAMS)]
            streams = [
                asyncio.create_task(generate(router, f"long-{i}", prompt, MAX_TOKENS))
                for i, prompt in enumerate(prompts)
            ]
            await wait_until_async(lambda: _applied_some(indexer), timeout=20, what="events flowing to the index")

            server.kill()
            await asyncio.sleep(OUTAGE_SECS)  # the outage itself, not a wait for anything
            # requests routed while NATS is down: their blocks' events wait in the publishers
            during = [await generate(router, f"during-{i}", prompts[i][:48], 4) for i in range(3)]
            await server.restart()

            assert await asyncio.gather(*streams) == [MAX_TOKENS] * STREAMS
            assert during == [4, 4, 4]
            await wait_until_async(
                lambda: converged(workers, indexer), timeout=30, what="the index equal to the workers' caches"
            )
            status = await view(indexer)
            assert sum(w.blocks for w in status.workers) > 0
    finally:
        for watcher in (workers, indexers, routers):
            await watcher.stop()
        await nc.close()
        server.stop()


async def _applied_some(address: str) -> bool:
    try:
        return (await view(address)).applied_sequence > 0
    except grpc.aio.AioRpcError:
        return False
