"""A client that walks away mid-stream frees the request everywhere: its worker's engine, and the
router's load picture."""

from __future__ import annotations

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.client import RouterApi
from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "cancel"


async def test_cancelling_a_stream_frees_the_workers_blocks(nats_url: str, nc: NatsClient):
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    worker_config = service_config(WorkerConfig, common)
    router_config = service_config(RouterConfig, [*common, "--router-mode", "round-robin"])
    workers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    await workers.start()
    await routers.start()
    async with running(worker_server.serve, worker_config), running(router_server.serve, router_config):
        await wait_until_async(lambda: workers.instances() and routers.instances(), what="services registered")
        async with (
            grpc.aio.insecure_channel(routers.instances()[0].address) as router_channel,
            grpc.aio.insecure_channel(workers.instances()[0].address) as worker_channel,
        ):
            router_stub = router_pb2_grpc.RouterStub(router_channel)
            worker_stub = worker_pb2_grpc.WorkerStub(worker_channel)

            async def worker_status() -> worker_pb2.WorkerStatus:
                return await worker_stub.GetStatus(worker_pb2.WorkerStatusRequest())

            await wait_until_async(lambda: routers.instances(), what="router up")
            api = RouterApi(routers.instances()[0].address)
            # far more tokens than we will read (real-time speed)
            answer = api.generate(list(range(200)), max_tokens=100_000 // 2, request_id="long")
            received = 0
            async for chunk in answer:
                received += len(chunk.token_ids)
                if received >= 2:
                    break
            status = await worker_status()
            assert status.running_requests == 1 and status.active_blocks > 0
            router_status = await router_stub.GetStatus(router_pb2.RouterStatusRequest())
            assert router_status.active_requests == 1
            await answer.aclose()

            async def freed() -> bool:
                status = await worker_status()
                router_status = await router_stub.GetStatus(router_pb2.RouterStatusRequest())
                return status.running_requests == 0 and status.active_blocks == 0 and not router_status.active_requests

            await wait_until_async(freed, what="the cancelled request's blocks are freed")
            assert (await worker_status()).cached_blocks >= 200 // 16  # computed blocks stay cached
            await api.close()
    await workers.stop()
    await routers.stop()
