"""A worker that stops serving while it still holds a session is left (decision 63): over real NATS
and gRPC, with mock worker processes, the holder of a session's prefix is stopped (SIGSTOP: it stays
registered and keeps its cache) with a turn of that session queued there. The session's next turn
goes to the other worker and is served while the holder is stopped; the queued turn completes once
the holder goes on. The router counts the turn it moved (``kvmesh_router_steered_total``)."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh.common.runtime.ports import pid_listening_on
from tests.support import metric_value, registered, router_generate, wait_until_async, worker_mesh

pytestmark = pytest.mark.integration
NAMESPACE = "stalled"
BLOCK = 16
TURN_1 = list(range(5000, 5000 + BLOCK * 60 + 3))
TURN_2 = [*TURN_1, *range(9000, 9000 + BLOCK * 2)]  # queued on the holder when it stops
TURN_3 = [*TURN_1, *range(9500, 9500 + BLOCK * 2)]  # sent once it has been stopped a while
FLAGS = ("--lease-ttl", "60")  # the stopped holder stays registered for the whole test


async def test_a_stopped_holder_is_left_and_its_queued_turn_completes_after(nats_url: str, nc: NatsClient):
    async with worker_mesh(nc, nats_url, NAMESPACE, FLAGS) as up:
        first = await router_generate(up.router, "turn-1", TURN_1, 2)
        holder = first[-1].worker_id
        (other,) = [r.instance_id for r in up.workers.instances() if r.instance_id != holder]
        port = int(up.workers.get(holder).address.rsplit(":", 1)[1])
        process = next(p for p in up.processes if pid_listening_on(port) == p.pid)
        async with grpc.aio.insecure_channel(up.router) as channel:
            router = router_pb2_grpc.RouterStub(channel)

            async def queued_on_holder() -> bool:
                status = await router.GetStatus(router_pb2.RouterStatusRequest())
                return any(w.worker_id == holder and w.active_prefill_tokens for w in status.loads)

            async def best_worker() -> int:
                query = router_pb2.RoutingQuery(token_ids=TURN_3)
                return (await router.BestWorker(query)).worker_id

            async def holder_left() -> bool:
                return await best_worker() == other

            assert await best_worker() == holder  # the penalty holds the session's prefix there
            process.send_signal(signal.SIGSTOP)
            try:
                stuck = asyncio.create_task(router_generate(up.router, "turn-2", TURN_2, 2))
                await wait_until_async(queued_on_holder, timeout=10, what="turn 2 queued on the stopped holder")
                # its queue waits with no first token, well past its prediction: the router leaves it
                await wait_until_async(holder_left, timeout=10, what="the router to leave the stopped holder")
                third = await asyncio.wait_for(router_generate(up.router, "turn-3", TURN_3, 2), timeout=10)
                assert third[-1].worker_id == other
                assert not stuck.done()
                assert await steered_off_stalled(nc) >= 1  # the router says it moved the turn
            finally:
                process.send_signal(signal.SIGCONT)
            second = await asyncio.wait_for(stuck, timeout=30)
            assert second[-1].worker_id == holder and second[-1].finish_reason


async def steered_off_stalled(nc: NatsClient) -> float:
    """The router's count of requests moved off a stalled worker, read from its /metrics."""
    (router,) = await registered(nc, NAMESPACE, "router")
    return metric_value(router.extra["metrics"], "kvmesh_router_steered_total", 0.0, rule="stalled")
