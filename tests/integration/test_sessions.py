"""Sessions over real NATS, real workers, two synced router replicas and the HTTP facade: a request
names its session by header, body or gRPC field; the routers keep an affinity for it (each replica
knows the other's), `kvmesh inspect router` lists it, and a session id the facade cannot take is a
400 naming where it came from."""

from __future__ import annotations

import contextlib

import grpc
import httpx
import openai
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.client import RouterApi
from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.inspector import inspect_routers, render_routers
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import free_port, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "sessions"
MODEL = "kvmesh-tiny"


async def affinities(address: str) -> dict[str, int]:
    """The sessions the router at ``address`` keeps an affinity for, and each one's worker."""
    async with grpc.aio.insecure_channel(address) as channel:
        status = await router_pb2_grpc.RouterStub(channel).GetStatus(router_pb2.RouterStatusRequest(), timeout=5)
    return {s.session_id: s.worker_id for s in status.recent_sessions}


async def test_a_session_named_over_http_or_grpc_is_kept_by_every_router_replica(nats_url: str, nc: NatsClient):
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    port = free_port()
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    await routers.start()
    async with (
        running(indexer_server.serve, service_config(IndexerConfig, [*common, "--replica-id", "s"])),
        running(worker_server.serve, service_config(WorkerConfig, common)),
        running(worker_server.serve, service_config(WorkerConfig, common)),
        running(router_server.serve, service_config(RouterConfig, [*common, "--router-replica-sync"])),
        running(router_server.serve, service_config(RouterConfig, [*common, "--router-replica-sync"])),
        running(frontend_server.serve, service_config(FrontendConfig, [*common, "--http-port", str(port)])),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):

        async def ready() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get("/health")).status_code == 200 and len(routers.instances()) == 2
            return False

        await wait_until_async(ready, timeout=30, what="the mesh up")
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        addresses = [r.address for r in routers.instances()]

        # by kvmesh's header, by an agent's (Claude Code's), and by the body's user
        named = {
            "conv-1": {"extra_headers": {"x-session-id": "conv-1"}},
            "claude-7": {"extra_headers": {"x-claude-code-session-id": "claude-7"}},
            "alice": {"user": "alice"},
        }
        served: dict[str, int] = {}
        for session, how in named.items():
            reply = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello from {session}"}], max_tokens=2, **how
            )
            served[session] = int(reply.headers["x-kvmesh-worker-id"])
        # over gRPC, straight to one replica
        api = RouterApi(addresses[0])
        chunks = [c async for c in api.generate(list(range(300, 340)), 2, session="grpc-1")]
        await api.close()
        served["grpc-1"] = chunks[-1].worker_id

        async def every_replica_knows() -> bool:
            kept = [await affinities(address) for address in addresses]
            return all(each.items() >= served.items() for each in kept)

        await wait_until_async(every_replica_knows, timeout=10, what="both replicas keep every session's worker")
        listing = render_routers(await inspect_routers(nats_url, NAMESPACE, 5.0))
        assert "4 session(s) with an affinity" in listing and "conv-1 -> worker" in listing

        # a session id too long for the router is the client's error, naming where it came from
        with pytest.raises(openai.BadRequestError, match="x-session-id: a session id is at most 256 characters"):
            await client.completions.create(
                model=MODEL, prompt="p", max_tokens=2, extra_headers={"x-session-id": "x" * 300}
            )
        async with grpc.aio.insecure_channel(addresses[0]) as channel:
            request = router_pb2.RouteRequest()
            request.request.request_id, request.request.model = "bad-session", MODEL
            request.request.token_ids.extend(range(8))
            request.request.routing.session_id = "y" * 300
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await router_pb2_grpc.RouterStub(channel).Route(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await client.close()
    await routers.stop()
