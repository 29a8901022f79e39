"""SGLang's routing policies in the router service, over real NATS and gRPC with mock workers:
``cache-aware`` (its own tree, no KV events), ``power-of-two``, and PD pairing with a policy per pool."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import router_generate, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "sglang"


def config(kind: type, nats_url: str, *extra: str):
    return service_config(kind, ["--nats-url", nats_url, "--namespace", NAMESPACE, *extra])


async def generate(router_address: str, request_id: str, prompt: list[int]) -> common_pb2.GenerateOutput:
    return (await router_generate(router_address, request_id, prompt))[-1]


@contextlib.asynccontextmanager
async def mesh(nc: NatsClient, nats_url: str, router_flags: list[str], roles: list[str]):
    """Mock workers of ``roles`` and one router; yields (router address, worker records)."""
    workers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    await workers.start()
    await routers.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            for role in roles:
                await stack.enter_async_context(
                    running(worker_server.serve, config(WorkerConfig, nats_url, "--role", role))
                )
            await stack.enter_async_context(running(router_server.serve, config(RouterConfig, nats_url, *router_flags)))
            await wait_until_async(lambda: len(workers.instances()) == len(roles) and routers.instances(), what="up")
            yield routers.instances()[0].address, workers.instances()
    finally:
        await workers.stop()
        await routers.stop()


async def cached_blocks(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        dump = await worker_pb2_grpc.WorkerStub(channel).DumpKvState(worker_pb2.DumpKvStateRequest())
    return len(dump.blocks)


async def test_cache_aware_keeps_a_prefix_on_its_worker_and_sends_new_ones_to_the_smallest_tree(
    nats_url: str, nc: NatsClient
):
    flags = ["--router-mode", "cache-aware", "--no-kv-events", "--cache-threshold", "0.5"]
    async with mesh(nc, nats_url, flags, ["aggregated", "aggregated"]) as (router, records):
        first = (await generate(router, "a0", list(range(400)))).worker_id
        # 90% of the prompt matches what went to `first`: above the threshold, it goes there again
        for i in range(3):
            assert (
                await generate(router, f"a{i + 1}", [*range(360), *range(9000 + 40 * i, 9040 + 40 * i)])
            ).worker_id == first
        # a prompt sharing 25% goes to the worker with the smaller tree: the other one
        other = (await generate(router, "b0", [*range(100), *range(5000, 5300)])).worker_id
        assert other != first and {first, other} == {r.instance_id for r in records}


async def test_power_of_two_spreads_requests_over_both_workers(nats_url: str, nc: NatsClient):
    async with mesh(nc, nats_url, ["--router-mode", "power-of-two", "--seed", "3"], ["aggregated"] * 2) as (
        router,
        records,
    ):
        chosen = [(await generate(router, f"p{i}", list(range(i, i + 64)))).worker_id for i in range(12)]
        assert set(chosen) == {r.instance_id for r in records}


async def test_pd_pairing_takes_a_policy_per_pool(nats_url: str, nc: NatsClient):
    flags = ["--prefill-policy", "cache-aware", "--decode-policy", "round-robin", "--disagg-min-uncached-tokens", "0"]
    roles = ["prefill", "prefill", "decode", "decode"]
    async with mesh(nc, nats_url, flags, roles) as (router, records):
        prompts = [list(range(640))] * 3 + [list(range(7000, 7640))]
        decodes = [(await generate(router, f"pd{i}", prompt)).worker_id for i, prompt in enumerate(prompts)]
        assert decodes[0] != decodes[1] and decodes[0] == decodes[2] and decodes[1] == decodes[3]  # round robin
        prefill = [r for r in records if r.role == "prefill"]
        held = sorted([await cached_blocks(r.address) for r in prefill])
        # cache-aware: the repeated prompt prefilled on one worker, the new one on the other (smaller tree)
        assert held == [640 // 16, 640 // 16]
