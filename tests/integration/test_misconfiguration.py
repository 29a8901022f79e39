"""Each misconfiguration the anchors' users report most, started for real, is said once with what to
change: in the router's status (and so ``kvmesh inspect router``), in its
``kvmesh_misconfigurations`` gauge, and for the frontend's model in its /health and metrics."""

from __future__ import annotations

import contextlib

import grpc
import httpx
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.inspector import inspect_routers, render_routers
from kvmesh.router import fleet_checks
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import free_port, metric_value, router_generate, running, service_config, wait_until_async

pytestmark = pytest.mark.integration


@pytest.fixture
def short_graces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks' grace periods at 2 s instead of 10: what they find is the same, sooner."""
    monkeypatch.setattr(fleet_checks, "EVENTS_GRACE_S", 2.0)
    monkeypatch.setattr(fleet_checks, "NO_INDEXER_GRACE_S", 2.0)


def common(nats_url: str, namespace: str) -> list[str]:
    return ["--nats-url", nats_url, "--namespace", namespace, "--lease-ttl", "2"]


async def router_record(nc: NatsClient, namespace: str, workers: int):
    watchers = [DiscoveryWatcher(nc.jetstream(), namespace, c) for c in ("router", "worker")]
    for watcher in watchers:
        await watcher.start()
    try:
        await wait_until_async(
            lambda: watchers[0].instances() and len(watchers[1].instances()) == workers, what="router and workers"
        )
        return watchers[0].instances()[0]
    finally:
        for watcher in watchers:
            await watcher.stop()


async def problems(address: str) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        status = await router_pb2_grpc.RouterStub(channel).GetStatus(router_pb2.RouterStatusRequest(), timeout=5)
    return list(status.misconfigurations)


async def said(address: str, words: str, timeout: float = 20.0) -> str:
    """The router's finding that contains ``words``, once it has one."""

    async def found() -> bool:
        return any(words in problem for problem in await problems(address))

    await wait_until_async(found, timeout=timeout, what=f"a finding saying {words!r}")
    return next(problem for problem in await problems(address) if words in problem)


async def gauge(metrics_address: str, kind: str) -> float:
    # the service's /metrics answers from a thread of its own, so a blocking read is safe here
    return metric_value(metrics_address, "kvmesh_misconfigurations", 0.0, kind=kind)


async def test_workers_of_one_model_with_different_block_sizes(nats_url: str, nc: NatsClient):
    args = common(nats_url, "blocksizes")
    async with (
        running(worker_server.serve, service_config(WorkerConfig, [*args, "--block-size", "16"])),
        running(worker_server.serve, service_config(WorkerConfig, [*args, "--block-size", "32"])),
        running(router_server.serve, service_config(RouterConfig, args)),
    ):
        record = await router_record(nc, "blocksizes", workers=2)
        problem = await said(record.address, "different KV block sizes")
        assert "1 with 16, 1 with 32" in problem and "--block-size" in problem
        assert await gauge(record.extra["metrics"], "block_sizes") == 1.0
        shown = render_routers(await inspect_routers(nats_url, "blocksizes", timeout=5))
        assert f"MISCONFIGURED: {problem}" in shown


async def test_a_worker_whose_kv_events_never_reach_the_indexers(nats_url: str, nc: NatsClient, short_graces):
    args = common(nats_url, "silent")
    # its events wait an hour before they are published: as if they went nowhere
    silent = service_config(WorkerConfig, [*args, "--kv-events-flush-ms", "3600000"])
    async with (
        running(indexer_server.serve, service_config(IndexerConfig, [*args, "--replica-id", "silent"])),
        running(worker_server.serve, silent),
        running(router_server.serve, service_config(RouterConfig, args)),
    ):
        record = await router_record(nc, "silent", workers=1)
        for i in range(6):
            await router_generate(record.address, f"r{i}", [i + 1] * 64, 2)
        problem = await said(record.address, "its KV events do not reach the indexers", timeout=30)
        assert "was sent 6 requests" in problem and "--kv-events-config" in problem
        assert await gauge(record.extra["metrics"], "kv_events") == 1.0


async def test_a_router_with_no_indexer_routes_on_load_alone_and_says_so(nats_url: str, nc: NatsClient, short_graces):
    args = common(nats_url, "noindexer")
    async with (
        running(worker_server.serve, service_config(WorkerConfig, args)),
        running(router_server.serve, service_config(RouterConfig, args)),
    ):
        record = await router_record(nc, "noindexer", workers=1)
        problem = await said(record.address, "no indexer replica is registered")
        assert "kvmesh indexer" in problem and "--no-kv-events" in problem
        assert await gauge(record.extra["metrics"], "no_indexer") == 1.0


async def test_a_model_no_worker_serves_is_named_with_the_ones_they_do(nats_url: str, nc: NatsClient):
    args = common(nats_url, "models")
    port = free_port()
    frontend = service_config(FrontendConfig, [*args[:4], "--http-port", str(port), "--model-name", "gpt-x"])
    async with (
        running(worker_server.serve, service_config(WorkerConfig, args)),
        running(router_server.serve, service_config(RouterConfig, args)),
        running(frontend_server.serve, frontend),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http,
    ):
        record = await router_record(nc, "models", workers=1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router_generate(record.address, "wrong", [1, 2, 3], 2, model="gpt-x")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the workers serve 'kvmesh-tiny'" in refused.value.details()
        problem = await said(record.address, "requests came for model 'gpt-x'")
        assert "--model-name" in problem

        async def frontend_says() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return any("'gpt-x'" in p for p in (await http.get("/health")).json().get("misconfigurations", []))
            return False

        await wait_until_async(frontend_says, timeout=15, what="the frontend's /health naming the model")
        metrics = (await http.get("/metrics")).text
        assert 'kvmesh_misconfigurations{kind="unknown_model"} 1.0' in metrics
