"""A service that fails part-way through start-up releases everything it had acquired, in reverse."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvmesh.common.runtime.service import ServiceStack
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import service_config

pytestmark = pytest.mark.integration


class Component:
    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    async def start(self) -> None:
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")
        self.log.append(f"start {self.name}")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")


async def test_the_stack_releases_what_started_in_reverse_when_a_later_start_fails():
    log: list[str] = []
    with pytest.raises(RuntimeError, match="c cannot start"):
        async with ServiceStack() as stack:
            await stack.start(Component("a", log))
            stack.task(asyncio.sleep(3600), "sleeper")
            await stack.start(Component("b", log))
            await stack.start(Component("c", log, fail=True))
    assert log == ["start a", "start b", "stop b", "stop a"]
    assert {t.get_name() for t in asyncio.all_tasks()} == {asyncio.current_task().get_name()}


def _occupied_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


async def _leftover_tasks() -> set[str]:
    await asyncio.sleep(0)  # let cancelled callbacks run
    return {t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_a_worker_whose_transfer_port_is_taken_leaks_nothing(nats_url: str):
    """It has connected to NATS, started its event publisher and its engine loop when the KV transfer
    server fails to bind: all of them must be gone afterwards (a NATS client leaves tasks behind)."""
    before = await _leftover_tasks()
    with _occupied_port() as busy:
        port = busy.getsockname()[1]
        config = service_config(WorkerConfig, ["--nats-url", nats_url, "--kv-transfer-port", str(port)])
        with pytest.raises(OSError):
            await asyncio.wait_for(worker_server.serve(config, asyncio.Event()), 30)
    assert await _leftover_tasks() == before


async def test_a_router_whose_grpc_port_is_taken_leaks_nothing(nats_url: str):
    """Discovery watchers, the expiry task and the NATS connection are up when gRPC fails to bind."""
    before = await _leftover_tasks()
    with _occupied_port() as busy:
        port = busy.getsockname()[1]
        config = service_config(RouterConfig, ["--nats-url", nats_url, "--port", str(port), "--metrics-port", "-1"])
        with pytest.raises(OSError):
            await asyncio.wait_for(router_server.serve(config, asyncio.Event()), 30)
    assert await _leftover_tasks() == before
