"""A departed peer's channel is dropped from the pool without cutting the calls still running on it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_server import start_grpc_server
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


async def test_dropping_a_channel_lets_its_open_stream_finish():
    server = await start_grpc_server(lambda _server: None, [])
    address = f"127.0.0.1:{server.port}"
    pool = ChannelPool()
    try:
        # Watch is a server stream that stays open and sends each status change
        call = health_pb2_grpc.HealthStub(pool.get(address)).Watch(health_pb2.HealthCheckRequest(service=""))
        first = await call.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING

        await pool.drop(address)
        assert pool.addresses() == [] and pool.draining() == 1

        await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        second = await asyncio.wait_for(call.read(), timeout=5)
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING

        # the call ends (the server goes away): the drained channel then closes by itself
        await server.server.stop(None)
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(call.read(), timeout=5)
        await wait_until_async(lambda: pool.draining() == 0, timeout=5, what="the dropped channel to close")
    finally:
        await pool.close()
        await server.server.stop(None)


async def test_closing_the_pool_cuts_calls_on_draining_channels_too():
    server = await start_grpc_server(lambda _server: None, [])
    address = f"127.0.0.1:{server.port}"
    pool = ChannelPool()
    try:
        call = health_pb2_grpc.HealthStub(pool.get(address)).Watch(health_pb2.HealthCheckRequest(service=""))
        await call.read()
        await pool.drop(address)
        await pool.close()
        assert pool.draining() == 0
        await wait_until_async(call.done, timeout=5, what="the call on the closed channel to end")
        assert call.cancelled()
    finally:
        await server.server.stop(None)
