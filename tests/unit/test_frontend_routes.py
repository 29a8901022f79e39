"""The frontend's request metrics are labelled by route template, and its router channels follow
discovery (both in process: no router is needed for either)."""

from __future__ import annotations

import grpc
import httpx
import pytest

from kvmesh.common.calling.request_path import RequestPath
from kvmesh.common.calling.router_client import RouterClient, route_request
from kvmesh.common.core.tiny_model import MODEL_DIR, MODEL_NAME
from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.frontend.app import create_app
from kvmesh.frontend.gateway import Frontend, ServedModel
from kvmesh.frontend.tokenizer import ModelTokenizer


def frontend(routers: RouterClient) -> Frontend:
    return Frontend(ServedModel(MODEL_NAME, ModelTokenizer(MODEL_DIR), 0), RequestPath(routers))


async def test_request_metrics_are_labelled_by_route_not_by_raw_path():
    app = create_app(frontend(RouterClient(fixed_address="127.0.0.1:1")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        assert (await client.get("/v1/models")).status_code == 200
        for i in range(50):  # a scanner trying paths
            assert (await client.get(f"/wp-admin/{i}.php")).status_code == 404
        metrics = (await client.get("/metrics")).text
    series = [line for line in metrics.splitlines() if line.startswith("kvmesh_frontend_requests_total")]
    assert 'kvmesh_frontend_requests_total{endpoint="/v1/models",status="200"} 1.0' in series
    assert 'kvmesh_frontend_requests_total{endpoint="unmatched",status="404"} 50.0' in series
    assert not any("wp-admin" in line for line in series)


async def test_completion_requests_are_counted_under_their_route():
    """The completion routes are called past FastAPI's router (CompletionRoutes); they keep their label."""
    app = create_app(frontend(RouterClient(fixed_address="127.0.0.1:1")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        for path in ("/v1/chat/completions", "/v1/completions"):
            response = await client.post(path, content=b"not json")
            assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
        assert (await client.get("/v1/completions")).status_code == 405
        metrics = (await client.get("/metrics")).text
    series = [line for line in metrics.splitlines() if line.startswith("kvmesh_frontend_requests_total")]
    assert 'kvmesh_frontend_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in series
    assert 'kvmesh_frontend_requests_total{endpoint="/v1/completions",status="400"} 1.0' in series
    assert 'kvmesh_frontend_requests_total{endpoint="/v1/completions",status="405"} 1.0' in series


async def test_a_departed_router_loses_its_channel():
    routers = RouterClient(fixed_address="127.0.0.1:1")
    for address in ("127.0.0.1:7001", "127.0.0.1:7002"):  # nothing listens: the attempt fails, the channel stays
        query = route_request(common_pb2.PreprocessedRequest(request_id="r", token_ids=[1]))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await routers.route(address, query)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sorted(routers.channel_addresses()) == ["127.0.0.1:7001", "127.0.0.1:7002"]
    await routers.router_left(InstanceRecord("router", 1, "127.0.0.1:7001"))
    assert routers.channel_addresses() == ["127.0.0.1:7002"]
    await routers.close()
    assert routers.channel_addresses() == []
