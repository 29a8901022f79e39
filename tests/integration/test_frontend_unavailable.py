"""The facade's answers when the mesh behind it cannot serve: real router, real frontend, no worker."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from tests.support import free_port, running, service_config, wait_until_async

pytestmark = pytest.mark.integration


async def test_no_worker_is_503_and_no_router_is_503(nats_url: str):
    port = free_port()
    common = ["--nats-url", nats_url, "--namespace", "empty"]
    router_config = service_config(RouterConfig, common)
    frontend_config = service_config(FrontendConfig, [*common, "--http-port", str(port)])
    body = {"model": "kvmesh-tiny", "messages": [{"role": "user", "content": "anyone there?"}]}
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http,
        running(frontend_server.serve, frontend_config),
    ):

        async def answering() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get("/health")).status_code in (200, 503)
            return False

        await wait_until_async(answering, what="frontend listening")
        no_router = await http.post("/v1/chat/completions", json=body)
        assert no_router.status_code == 503
        assert no_router.json()["error"]["type"] == "service_unavailable"

        async with running(router_server.serve, router_config):

            async def router_seen() -> bool:
                return (await http.get("/health")).status_code == 200

            await wait_until_async(router_seen, what="frontend discovers the router")
            for stream in (False, True):
                response = await http.post("/v1/chat/completions", json={**body, "stream": stream})
                assert response.status_code == 503
                assert "no worker available" in response.json()["error"]["message"]


async def test_busy_workers_with_no_router_queue_are_a_quick_429_with_retry_after(nats_url: str):
    from kvmesh.common.runtime.discovery import DiscoveryWatcher
    from kvmesh.worker import server as worker_server
    from kvmesh.worker.config import WorkerConfig

    port = free_port()
    common = ["--nats-url", nats_url, "--namespace", "busy"]
    worker_config = service_config(WorkerConfig, [*common, "--speedup-ratio", "1"])
    router_config = service_config(
        RouterConfig, [*common, "--active-decode-blocks-threshold", "4", "--router-queue-size", "0"]
    )
    frontend_config = service_config(FrontendConfig, [*common, "--http-port", str(port)])
    import nats

    nc = await nats.connect(nats_url)
    workers = DiscoveryWatcher(nc.jetstream(), "busy", "worker")
    await workers.start()
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
        running(worker_server.serve, worker_config),
        running(router_server.serve, router_config),
        running(frontend_server.serve, frontend_config),
    ):

        async def ready() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return bool(workers.instances()) and (await http.get("/health")).status_code == 200
            return False

        await wait_until_async(ready, what="mesh up")
        hog = {"model": "kvmesh-tiny", "prompt": "x" * 200, "max_tokens": 3000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=hog) as streaming:
            assert streaming.status_code == 200  # it holds 13 blocks > 4 while it streams
            late = await http.post("/v1/completions", json={"model": "kvmesh-tiny", "prompt": "hello", "max_tokens": 2})
            assert late.status_code == 429 and late.headers["retry-after"] == "1"
            error = late.json()["error"]
            assert error["type"] == "rate_limit_error" and "busy" in error["message"]
    await workers.stop()
    await nc.close()
