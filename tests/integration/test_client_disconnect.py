"""A client that gives up on a request, streamed or whole, cancels it everywhere: real frontend,
router and mock worker (real-time speed), httpx as the client."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import httpx
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import free_port, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "walkaway"


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
async def test_a_request_whose_client_left_is_cancelled_on_the_worker(nats_url: str, nc: NatsClient, streaming: bool):
    port = free_port()
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    workers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    await workers.start()
    await routers.start()
    frontend_args = [*common, "--http-port", str(port)]
    body = {"model": "kvmesh-tiny", "prompt": "a long answer, please", "max_tokens": 50_000}
    async with (
        running(worker_server.serve, service_config(WorkerConfig, [*common, "--speedup-ratio", "1"])),
        running(router_server.serve, service_config(RouterConfig, common)),
        running(frontend_server.serve, service_config(FrontendConfig, frontend_args)),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http,
    ):

        async def serving() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get("/health")).status_code == 200 and bool(
                    workers.instances() and routers.instances()
                )
            return False

        await wait_until_async(serving, what="the mesh serving")
        async with grpc.aio.insecure_channel(workers.instances()[0].address) as channel:
            worker = worker_pb2_grpc.WorkerStub(channel)

            async def running_requests() -> int:
                return (await worker.GetStatus(worker_pb2.WorkerStatusRequest())).running_requests

            if streaming:
                # the client reads the first event and hangs up; uvicorn's send then drops what the
                # frontend writes without a word, so only watching for the disconnect stops it
                request = http.build_request("POST", "/v1/completions", json={**body, "stream": True})
                response = await http.send(request, stream=True)
                assert response.status_code == 200
                lines = response.aiter_lines()  # held: a dropped iterator would close the response
                await anext(lines)
                await wait_until_async(lambda: running_requests_is(running_requests, 1), what="the stream generating")
                await response.aclose()
            else:
                # the client gives up after 3 s; 50,000 tokens at real speed would take minutes
                timeout = httpx.Timeout(10, read=3.0)
                post = asyncio.create_task(http.post("/v1/completions", json=body, timeout=timeout))
                await wait_until_async(lambda: running_requests_is(running_requests, 1), what="the request generating")
                with pytest.raises(httpx.ReadTimeout):
                    await post
            await wait_until_async(lambda: running_requests_is(running_requests, 0), what="the request cancelled")
        async with grpc.aio.insecure_channel(routers.instances()[0].address) as channel:
            router = router_pb2_grpc.RouterStub(channel)

            async def router_holds_nothing() -> bool:
                return (await router.GetStatus(router_pb2.RouterStatusRequest())).active_requests == 0

            # freed by the relay's end, or with ``direct`` by the frontend's report
            await wait_until_async(router_holds_nothing, what="the router's load freed")
    await workers.stop()
    await routers.stop()


async def running_requests_is(running_requests, count: int) -> bool:
    return await running_requests() == count
