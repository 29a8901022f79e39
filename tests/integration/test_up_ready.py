"""`kvmesh up` says the mesh is up only once every router replica sees every registered worker, over
real NATS, a real router and a mock worker: a request naming a worker the router has not heard of
yet is refused (the CI's live benchmark met that on a busy machine)."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.runtime.discovery import InstanceRecord, registered_now
from kvmesh.common.runtime.ports import free_port
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.up.supervisor import routers_see_workers
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import running, service_config, wait_until_async

pytestmark = pytest.mark.integration


async def test_up_waits_for_each_router_to_see_each_registered_worker(nats_url: str, nc: NatsClient):
    common = ["--nats-url", nats_url, "--namespace", "seen", "--lease-ttl", "2"]
    async with (
        running(worker_server.serve, service_config(WorkerConfig, common)),
        running(router_server.serve, service_config(RouterConfig, common)),
    ):
        js = nc.jetstream()

        async def registered() -> bool:
            return len(await registered_now(js, "seen", "worker")) == 1 and bool(
                await registered_now(js, "seen", "router")
            )

        await wait_until_async(registered, what="a worker and a router registered")
        routers = await registered_now(js, "seen", "router")
        workers = await registered_now(js, "seen", "worker")
        await wait_until_async(lambda: routers_see_workers(routers, workers), what="the router seeing the worker")
        # a worker the router has not heard of (registered elsewhere, or not yet seen)
        unseen = InstanceRecord("worker", workers[0].instance_id + 1, "127.0.0.1:1", namespace="seen")
        assert not await routers_see_workers(routers, [*workers, unseen])
        # a router that does not answer sees nothing
        silent = InstanceRecord("router", 1, f"127.0.0.1:{free_port()}", namespace="seen")
        assert not await routers_see_workers([*routers, silent], workers)
