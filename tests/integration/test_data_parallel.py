"""Data-parallel ranks on the mock engine, over real NATS, a real indexer, router and worker: the
worker advertises its ranks and publishes each rank's events as its own, the indexer keeps them
apart, and the router chooses a (worker, rank) — a repeated prompt finds the rank that cached it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.integration.test_router_queue import up
from tests.support import indexed_blocks, registered, router_generate, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "dp"
PROMPT = [5] * 256  # 16 blocks of 16 tokens


async def test_the_router_chooses_a_worker_and_rank_and_each_rank_keeps_its_own_cache(nats_url: str, nc: NatsClient):
    args = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    async with (
        running(indexer_server.serve, service_config(IndexerConfig, [*args, "--replica-id", "dp"])),
        running(worker_server.serve, service_config(WorkerConfig, [*args, "--data-parallel-size", "2"])),
        running(router_server.serve, service_config(RouterConfig, args)),
    ):
        router = await up(nc, NAMESPACE, workers=1, indexers=1)
        # distinct prompts at once: the router spreads them over both ranks by their load
        answers = await asyncio.gather(
            *(router_generate(router, f"spread-{i}", [100 + i] * 256, max_tokens=8) for i in range(8))
        )
        assert {answer[-1].dp_rank for answer in answers} == {0, 1}
        worker_id = answers[0][-1].worker_id

        first = (await router_generate(router, "first", PROMPT))[-1]

        async def indexed() -> bool:
            return (await indexed_blocks(nc, NAMESPACE)).get((worker_id, first.dp_rank), 0) >= 16

        await wait_until_async(indexed, what="the rank's events indexed under its own key")
        ranks = await indexed_blocks(nc, NAMESPACE)
        assert set(ranks) == {(worker_id, 0), (worker_id, 1)}  # each rank's events apart
        again = (await router_generate(router, "again", PROMPT))[-1]
        assert again.dp_rank == first.dp_rank  # the rank that holds the prefix
        assert again.usage.cached_prompt_tokens >= 240  # from that rank's own cache

        async with grpc.aio.insecure_channel(router) as channel:
            status = await router_pb2_grpc.RouterStub(channel).GetStatus(router_pb2.RouterStatusRequest(), timeout=5)
        assert {(load.worker_id, load.dp_rank) for load in status.loads} == {(worker_id, 0), (worker_id, 1)}

        (record,) = await registered(nc, NAMESPACE, "worker")
        assert record.extra["data_parallel_size"] == 2
        async with grpc.aio.insecure_channel(record.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            dump = await stub.DumpKvState(worker_pb2.DumpKvStateRequest(dp_rank=first.dp_rank), timeout=5)
            assert len(dump.blocks) == ranks[(worker_id, first.dp_rank)]
            request = common_pb2.PreprocessedRequest(request_id="rank-5", token_ids=[1, 2, 3])
            request.stop.max_tokens = 1
            request.routing.dp_rank = 5
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(request, timeout=5):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ranks 0..1, not 5" in refused.value.details()
