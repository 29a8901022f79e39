"""Router replicas over real NATS, real workers and real gRPC: a shared load picture, phantom load
cleared after a router crash, migration when a worker dies mid-stream (busy
protection: test_router_queue.py)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.client import RouterApi
from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import router_generate, running, service_config, service_process, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "routers"


def router_config(nats_url: str, *extra: str) -> RouterConfig:
    return service_config(RouterConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE, "--lease-ttl", "2", *extra])


def worker_config(nats_url: str, *extra: str) -> WorkerConfig:
    return service_config(WorkerConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE, "--lease-ttl", "2", *extra])


async def watch(nc: NatsClient, component: str) -> DiscoveryWatcher:
    watcher = DiscoveryWatcher(nc.jetstream(), NAMESPACE, component)
    await watcher.start()
    return watcher


async def stream(address: str, request_id: str, prompt: list[int], max_tokens: int) -> list[common_pb2.GenerateOutput]:
    return await router_generate(address, request_id, prompt, max_tokens)


def loads_of(loads) -> dict[int, tuple[int, int]]:
    return {w.worker_id: (w.active_prefill_tokens, w.active_decode_blocks) for w in loads}


async def test_two_synced_replicas_agree_on_every_workers_load(nats_url: str, nc: NatsClient):
    workers = await watch(nc, "worker")
    routers = await watch(nc, "router")
    slow = worker_config(nats_url, "--speedup-ratio", "1")  # real-time: requests stay in flight
    async with (
        running(worker_server.serve, slow),
        running(worker_server.serve, slow),
        running(router_server.serve, router_config(nats_url, "--router-replica-sync")),
        running(router_server.serve, router_config(nats_url, "--router-replica-sync")),
    ):
        await wait_until_async(lambda: len(workers.instances()) == 2 and len(routers.instances()) == 2, what="up")
        addresses = sorted(r.address for r in routers.instances())
        prompts = [[p] * 64 + list(range(i, i + 40)) for i, p in enumerate([3, 5, 7, 9] * 4)]
        tasks = [
            asyncio.create_task(stream(addresses[i % 2], f"s{i}", prompt, max_tokens=400))
            for i, prompt in enumerate(prompts)
        ]
        apis = [RouterApi(a) for a in addresses]
        probe = list(range(500, 600))

        async def agree_while_busy() -> bool:
            first, second = [loads_of(await api.potential_loads(probe)) for api in apis]
            busy = sum(blocks for _, blocks in first.values()) > 0
            return busy and first == second

        await wait_until_async(agree_while_busy, timeout=15, what="replicas agree while requests are in flight")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

        async def idle_everywhere() -> bool:
            views = [loads_of(await api.potential_loads(probe)) for api in apis]
            return all(v == (0, 0) for view in views for v in view.values())

        await wait_until_async(idle_everywhere, timeout=15, what="both replicas see every load gone")
        for api in apis:
            await api.close()
    await workers.stop()
    await routers.stop()


def router_process(nats_url: str) -> subprocess.Popen[bytes]:
    return service_process("router", nats_url, NAMESPACE, "--router-replica-sync", "--lease-ttl", "30")


async def test_a_crashed_replicas_requests_are_forgotten(nats_url: str, nc: NatsClient):
    workers = await watch(nc, "worker")
    routers = await watch(nc, "router")
    crashing = None
    try:
        async with (
            running(worker_server.serve, worker_config(nats_url, "--speedup-ratio", "1")),
            running(router_server.serve, router_config(nats_url, "--router-replica-sync")),
        ):
            await wait_until_async(lambda: workers.instances() and len(routers.instances()) == 1, what="up")
            survivor_address = routers.instances()[0].address
            crashing = router_process(nats_url)
            await wait_until_async(lambda: len(routers.instances()) == 2, timeout=20, what="second replica up")
            doomed = next(r.address for r in routers.instances() if r.address != survivor_address)
            survivor = RouterApi(survivor_address)
            tasks = [asyncio.create_task(stream(doomed, f"d{i}", [i] * 100, 2000)) for i in range(4)]

            async def survivor_sees_them() -> bool:
                return any(b for _, b in loads_of(await survivor.potential_loads([1])).values())

            await wait_until_async(survivor_sees_them, timeout=15, what="the survivor sees the other's load")
            crashing.send_signal(signal.SIGKILL)  # no Free will ever come from it
            crashing.wait(timeout=10)
            await asyncio.gather(*tasks, return_exceptions=True)
            started = time.monotonic()

            async def phantom_gone() -> bool:
                return all(v == (0, 0) for v in loads_of(await survivor.potential_loads([1])).values())

            await wait_until_async(phantom_gone, timeout=15, what="the crashed replica's load is dropped")
            assert time.monotonic() - started < 10  # the silence timeout (5 s) plus a heartbeat
            await survivor.close()
    finally:
        if crashing is not None:
            crashing.kill()
            crashing.wait(timeout=10)
        await workers.stop()
        await routers.stop()


def worker_process(nats_url: str) -> subprocess.Popen[bytes]:
    return service_process("worker", nats_url, NAMESPACE, "--speedup-ratio", "1", "--lease-ttl", "30")


async def test_requests_survive_a_worker_killed_mid_stream(nats_url: str, nc: NatsClient):
    workers = await watch(nc, "worker")
    routers = await watch(nc, "router")
    processes = [worker_process(nats_url), worker_process(nats_url)]
    try:
        async with running(router_server.serve, router_config(nats_url, "--router-mode", "round-robin")):
            await wait_until_async(lambda: len(workers.instances()) == 2 and routers.instances(), timeout=20, what="up")
            address = routers.instances()[0].address
            received: dict[str, int] = {}

            async def one(i: int) -> list[common_pb2.GenerateOutput]:
                def count(output: common_pb2.GenerateOutput) -> None:
                    received[f"m{i}"] = received.get(f"m{i}", 0) + len(output.token_ids)

                return await router_generate(address, f"m{i}", [i % 7] * 80, 120, on_output=count)

            tasks = [asyncio.create_task(one(i)) for i in range(20)]
            await wait_until_async(
                lambda: len(received) == 20 and min(received.values()) >= 5, timeout=20, what="every stream under way"
            )
            processes[0].send_signal(signal.SIGKILL)  # half the streams lose their worker
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            for outputs in results:
                assert sum(len(o.token_ids) for o in outputs) == 120
                assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert outputs[-1].usage.completion_tokens == 120 and outputs[-1].usage.prompt_tokens == 80
            assert len({o.worker_id for outputs in results for o in outputs}) == 2  # some moved workers
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=10)
        await workers.stop()
        await routers.stop()


async def test_a_new_replica_starts_empty_and_converges(nats_url: str, nc: NatsClient):
    workers = await watch(nc, "worker")
    routers = await watch(nc, "router")
    slow = worker_config(nats_url, "--speedup-ratio", "1")
    synced = router_config(nats_url, "--router-replica-sync")
    async with (
        running(worker_server.serve, slow),
        running(worker_server.serve, slow),
        running(router_server.serve, synced),
    ):
        await wait_until_async(lambda: len(workers.instances()) == 2 and routers.instances(), what="up")
        first = routers.instances()[0].address
        old = [asyncio.create_task(stream(first, f"old{i}", [i] * 90, 3000)) for i in range(4)]
        first_api = RouterApi(first)

        async def first_busy() -> bool:
            return any(b for _, b in loads_of(await first_api.potential_loads([1])).values())

        await wait_until_async(first_busy, what="the first replica has requests in flight")
        async with running(router_server.serve, synced):
            await wait_until_async(lambda: len(routers.instances()) == 2, what="a new replica joined")
            newcomer = next(r.address for r in routers.instances() if r.address != first)
            new_api = RouterApi(newcomer)
            # it knows nothing of what was routed before it started
            assert all(v == (0, 0) for v in loads_of(await new_api.potential_loads([1])).values())
            for task in old:
                task.cancel()
            await asyncio.gather(*old, return_exceptions=True)
            fresh = [asyncio.create_task(stream(first, f"new{i}", [i + 50] * 90, 3000)) for i in range(4)]

            async def converged() -> bool:
                mine, theirs = [loads_of(await api.potential_loads([1])) for api in (first_api, new_api)]
                return any(b for _, b in mine.values()) and mine == theirs

            await wait_until_async(converged, timeout=15, what="the newcomer converges on the first replica's view")
            for task in fresh:
                task.cancel()
            await asyncio.gather(*fresh, return_exceptions=True)
            await new_api.close()
        await first_api.close()
    await workers.stop()
    await routers.stop()
