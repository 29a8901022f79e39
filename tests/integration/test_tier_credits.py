"""Tier credits over real NATS, a real indexer, a real router and a mock worker with a host tier: a
prompt evicted from the worker's device memory to its host tier is indexed as the worker's host
tier, credited by the router at --host-block-credit, and served again from the host tier."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.client import RouterApi
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


@pytest.mark.parametrize("credit", [0.75, 1.0])
async def test_a_prompt_in_the_host_tier_is_credited_and_reloaded(nats_url: str, nc: NatsClient, credit: float):
    namespace = f"tiers{int(credit * 100)}"
    common = ["--nats-url", nats_url, "--namespace", namespace, "--lease-ttl", "2"]
    # 24 device blocks: two other prompts of 12 blocks push the first one out, into 64 host blocks
    worker = service_config(
        WorkerConfig, [*common, "--num-gpu-blocks-override", "24", "--host-kv-blocks", "64", "--speedup-ratio", "10"]
    )
    async with (
        running(indexer_server.serve, service_config(IndexerConfig, [*common, "--replica-id", namespace])),
        running(worker_server.serve, worker),
        running(router_server.serve, service_config(RouterConfig, [*common, "--host-block-credit", str(credit)])),
    ):
        address = await up(nc, namespace, workers=1, indexers=1)
        api = RouterApi(address)
        first = await router_generate(address, "first", PROMPT, 2)
        for i in range(2):
            await router_generate(address, f"other{i}", [1000 * (i + 1) + t for t in range(192)], 2)

        async def credited() -> bool:  # 10 blocks in the host tier, none on the device
            (load,) = await api.potential_loads(PROMPT)
            return load.overlap_blocks == round(credit * 10)

        await wait_until_async(credited, timeout=15, what=f"the host tier credited at {credit}")
        again = await router_generate(address, "again", PROMPT, 2)
        await api.close()
    assert first[0].usage.cached_prompt_tokens == 0
    assert again[0].usage.cached_prompt_tokens == 144  # 9 blocks reloaded; the last one computes a token
