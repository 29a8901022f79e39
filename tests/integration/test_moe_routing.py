"""MoE-aware KV routing over real NATS and gRPC: a mock worker hosting experts tags its blocks, the
indexer keeps the tags, and a request's ``moe_query`` draws it to that worker; a dense fleet routes
exactly as without the query."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2, indexer_pb2, indexer_pb2_grpc, router_pb2, router_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import router_generate, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "moe"
EXPERTS = [common_pb2.MoeExpert(layer=0, expert=3), common_pb2.MoeExpert(layer=1, expert=7)]


def config(kind: type, nats_url: str, *extra: str):
    return service_config(kind, ["--nats-url", nats_url, "--namespace", NAMESPACE, *extra])


@contextlib.asynccontextmanager
async def mesh(nc: NatsClient, nats_url: str, worker_flags: list[list[str]]):
    """An indexer, mock workers with these flags and a kv router; yields (router, indexer, workers)."""
    watchers = {c: DiscoveryWatcher(nc.jetstream(), NAMESPACE, c) for c in ("worker", "router", "indexer")}
    for watcher in watchers.values():
        await watcher.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(running(indexer_server.serve, config(IndexerConfig, nats_url)))
            for flags in worker_flags:
                await stack.enter_async_context(running(worker_server.serve, config(WorkerConfig, nats_url, *flags)))
            await stack.enter_async_context(running(router_server.serve, config(RouterConfig, nats_url)))
            await wait_until_async(
                lambda: (
                    len(watchers["worker"].instances()) == len(worker_flags)
                    and watchers["router"].instances()
                    and watchers["indexer"].instances()
                ),
                what="up",
            )
            yield (
                watchers["router"].instances()[0].address,
                watchers["indexer"].instances()[0].address,
                watchers["worker"].instances(),
            )
    finally:
        for watcher in watchers.values():
            await watcher.stop()


async def best_worker(router: str, prompt: list[int], moe: list[common_pb2.MoeExpert]) -> int:
    query = router_pb2.RoutingQuery(token_ids=prompt)
    query.router_config_override.moe_query.extend(moe)
    async with grpc.aio.insecure_channel(router) as channel:
        return (await router_pb2_grpc.RouterStub(channel).BestWorker(query)).worker_id


async def find_matches(indexer: str, prompt: list[int]) -> dict[int, indexer_pb2.WorkerMatch]:
    request = indexer_pb2.FindMatchesRequest(sequence_hashes=sequence_hashes(local_block_hashes(prompt, 16)))
    request.moe_query.extend(EXPERTS)
    async with grpc.aio.insecure_channel(indexer) as channel:
        response = await indexer_pb2_grpc.IndexerStub(channel).FindMatches(request)
    return {w.worker_id: w for w in response.workers}


async def hosting(indexer: str, prompt: list[int]) -> dict[int, tuple[int, int]]:
    """(aligned blocks, hosted experts) per worker for ``prompt`` and :data:`EXPERTS`."""
    return {w: (m.moe_aligned_blocks, m.moe_hosted_experts) for w, m in (await find_matches(indexer, prompt)).items()}


async def test_a_moe_query_draws_a_request_to_the_worker_hosting_its_experts(nats_url: str, nc: NatsClient):
    async with mesh(nc, nats_url, [["--moe-experts", "0:3,1:7:1"], []]) as (router, indexer, records):
        prompts = {r.instance_id: list(range(1000 * (i + 1), 1000 * (i + 1) + 160)) for i, r in enumerate(records)}
        for worker_id, prompt in prompts.items():  # 10 blocks cached on each worker
            await router_generate(router, f"warm{worker_id}", prompt, worker_id=worker_id)
        tagged: dict[int, tuple[int, int]] = {}

        async def indexed() -> bool:
            tagged.clear()
            for worker_id, prompt in prompts.items():
                tagged.update({w: v for w, v in (await hosting(indexer, prompt)).items() if w == worker_id})
            return len(tagged) == 2 and sorted(tagged.values()) == [(0, 0), (10, 2)]

        await wait_until_async(indexed, what="the indexer to hold both workers' blocks, one worker's tagged")
        moe_worker = next(w for w, v in tagged.items() if v == (10, 2))
        dense_worker = next(w for w in tagged if w != moe_worker)
        # its tree is now the bigger one
        await router_generate(router, "more", list(range(8000, 8160)), worker_id=moe_worker)
        fresh = list(range(5000, 5200))
        await wait_until_async(lambda: _all_indexed(indexer, 2, blocks=30), what="the indexer to hold the last blocks")
        # nothing cached for `fresh`: without the query the smaller tree (the dense worker) wins the tie
        assert await best_worker(router, fresh, []) == dense_worker
        assert await best_worker(router, fresh, EXPERTS) == moe_worker
        assert await best_worker(router, fresh, EXPERTS[:1]) == moe_worker  # half the experts: half the waiver
        assert await best_worker(router, fresh, [common_pb2.MoeExpert(layer=9, expert=9)]) == dense_worker


async def test_a_dense_fleet_routes_exactly_as_without_the_query(nats_url: str, nc: NatsClient):
    async with mesh(nc, nats_url, [[], []]) as (router, indexer, records):
        for i, record in enumerate(records):
            await router_generate(
                router, f"warm{i}", list(range(100 * i, 100 * i + 48 * (i + 1))), worker_id=record.instance_id
            )
        await wait_until_async(
            lambda: _all_indexed(indexer, len(records)), what="the indexer to hold both workers' blocks"
        )
        prompts = [list(range(100 * i, 100 * i + 60)) for i in range(2)] + [list(range(7000, 7100))]
        for prompt in prompts:
            assert await best_worker(router, prompt, EXPERTS) == await best_worker(router, prompt, [])
            assert {v for v in (await hosting(indexer, prompt)).values()} == {(0, 0)}


async def _all_indexed(indexer: str, workers: int, blocks: int = 1) -> bool:
    """``workers`` workers hold blocks and ``blocks`` blocks in all are indexed."""
    async with grpc.aio.insecure_channel(indexer) as channel:
        status = await indexer_pb2_grpc.IndexerStub(channel).GetStatus(indexer_pb2.IndexerStatusRequest())
    return sum(1 for w in status.workers if w.blocks) == workers and sum(w.blocks for w in status.workers) >= blocks
