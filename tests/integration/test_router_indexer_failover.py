"""The router with real workers: approximate mode without an indexer, and KV routing that survives
an indexer replica killed with -9 (its registration still listed until its lease expires)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import router_generate, running, service_config, service_process, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "failover"
PROMPT = list(range(300))  # 18 full blocks of 16


async def generate(router_address: str, request_id: str, prompt: list[int]) -> common_pb2.GenerateOutput:
    return (await router_generate(router_address, request_id, prompt))[-1]


@contextlib.asynccontextmanager
async def mesh(nats_url: str, nc: NatsClient, *router_args: str):
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    worker_config = service_config(WorkerConfig, [*common, "--speedup-ratio", "100", "--lease-ttl", "2"])
    router_config = service_config(RouterConfig, [*common, *router_args])
    workers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    await workers.start()
    await routers.start()
    async with (
        running(worker_server.serve, worker_config),
        running(worker_server.serve, worker_config),
        running(router_server.serve, router_config),
    ):
        await wait_until_async(lambda: len(workers.instances()) == 2 and routers.instances(), what="mesh up")
        yield routers.instances()[0].address
    await workers.stop()
    await routers.stop()


async def test_approximate_mode_follows_its_own_routing_decisions(nats_url: str, nc: NatsClient):
    async with mesh(nats_url, nc, "--no-kv-events") as router:
        first = await generate(router, "a", PROMPT)
        second = await generate(router, "b", PROMPT)  # no indexer exists: the router remembers
        assert second.worker_id == first.worker_id
        assert second.usage.cached_prompt_tokens >= 17 * 16
        other = await generate(router, "c", [7] * 300)  # a cold prompt goes to the less loaded tree
        assert other.worker_id != first.worker_id


def indexer_process(nats_url: str, replica: str) -> subprocess.Popen[bytes]:
    return service_process("indexer", nats_url, NAMESPACE, "--replica-id", replica, "--lease-ttl", "30")


async def test_kv_routing_survives_a_dead_indexer_replica(nats_url: str, nc: NatsClient):
    indexers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "indexer")
    await indexers.start()
    replicas = [indexer_process(nats_url, "x"), indexer_process(nats_url, "y")]
    try:
        async with mesh(nats_url, nc, "--indexer-timeout-ms", "300") as router:
            await wait_until_async(lambda: len(indexers.instances()) == 2, timeout=20, what="two replicas")
            replicas[0].send_signal(signal.SIGKILL)  # its 30 s lease keeps it listed: the router must cope
            replicas[0].wait(timeout=10)
            first = await generate(router, "warm", PROMPT)

            async def reused() -> bool:
                # retries until the events reach the live replica; every attempt must still succeed
                started = time.monotonic()
                out = await generate(router, f"again-{started}", PROMPT)
                assert time.monotonic() - started < 2.0  # a dead replica costs at most a short deadline
                return out.worker_id == first.worker_id and out.usage.cached_prompt_tokens >= 17 * 16

            await wait_until_async(reused, timeout=15, what="KV-aware routing through the live replica")
            assert len(indexers.instances()) == 2  # the dead one was still registered throughout
    finally:
        for process in replicas:
            process.kill()
            process.wait(timeout=10)
        await indexers.stop()


async def test_prefill_role_workers_get_no_whole_requests(nats_url: str, nc: NatsClient):
    common = ["--nats-url", nats_url, "--namespace", "roles"]
    prefill_worker = service_config(WorkerConfig, [*common, "--role", "prefill"])
    decode_worker = service_config(WorkerConfig, [*common, "--role", "decode"])
    router = service_config(RouterConfig, common)
    workers = DiscoveryWatcher(nc.jetstream(), "roles", "worker")
    routers = DiscoveryWatcher(nc.jetstream(), "roles", "router")
    await workers.start()
    await routers.start()
    async with running(worker_server.serve, prefill_worker), running(router_server.serve, router):
        await wait_until_async(lambda: workers.instances() and routers.instances(), what="up")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(routers.instances()[0].address, "p", PROMPT)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        async with running(worker_server.serve, decode_worker):
            await wait_until_async(lambda: len(workers.instances()) == 2, what="decode worker up")
            decode_id = next(r.instance_id for r in workers.instances() if r.role == "decode")
            for i in range(3):
                assert (await generate(routers.instances()[0].address, f"d{i}", PROMPT)).worker_id == decode_id
    await workers.stop()
    await routers.stop()
