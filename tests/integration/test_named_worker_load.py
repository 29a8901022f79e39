"""A request that names its worker, over real NATS, a real indexer, a real router and mock workers:
the router counts the prefix that worker holds as held, not as prefill queued there (a client that
keeps a conversation where its replies were decoded, or a gateway that picks workers itself, would
otherwise make that worker look behind and have the session's next turn moved off it)."""

from __future__ import annotations

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.client import RouterApi
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.integration.test_router_queue import up
from tests.support import router_generate, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
PROMPT = [7 + i % 200 for i in range(160)]  # 10 full blocks of 16


async def test_a_named_request_is_counted_with_the_prefix_its_worker_holds(nats_url: str, nc: NatsClient):
    common = ["--nats-url", nats_url, "--namespace", "named", "--lease-ttl", "2"]
    worker = [*common, "--speedup-ratio", "10"]
    async with (
        running(indexer_server.serve, service_config(IndexerConfig, [*common, "--replica-id", "named"])),
        running(worker_server.serve, service_config(WorkerConfig, worker)),
        running(worker_server.serve, service_config(WorkerConfig, worker)),
        running(router_server.serve, service_config(RouterConfig, common)),
    ):
        address = await up(nc, "named", workers=2, indexers=1)
        api = RouterApi(address)
        first = await router_generate(address, "first", PROMPT, 2)
        holder = first[0].worker_id

        async def indexed() -> bool:
            return {load.worker_id: load.overlap_blocks for load in await api.potential_loads(PROMPT)}[holder] == 10

        await wait_until_async(indexed, timeout=15, what="the prompt indexed on its worker")
        # routed only, never served: it stays in the load picture until its lease runs out
        request = common_pb2.PreprocessedRequest(request_id="named", token_ids=[*PROMPT, 1, 2, 3])
        request.stop.max_tokens = 2
        request.routing.worker_id = holder
        async with grpc.aio.insecure_channel(address) as channel:
            answer = await router_pb2_grpc.RouterStub(channel).Route(router_pb2.RouteRequest(request=request))
        loads = {load.worker_id: load for load in await api.potential_loads(PROMPT)}
        await api.close()
    assert answer.worker_id == holder and answer.forced
    assert answer.overlap_blocks == 10
    # what it computes there: the 3 tokens past the held prefix, not all 163
    assert loads[holder].active_prefill_tokens == 3
