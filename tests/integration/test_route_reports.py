"""The frontend's reports to a router replica ride its ``RouteMany`` stream (real gRPC, a scripted
router peer): with the next query when there is one, alone within the notes' window otherwise,
in the order told, and the ones still waiting when the frontend closes are sent before the stream
ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.common.calling.router_client import RouterClient
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvmesh.common.rpc.grpc_server import GrpcService, start_grpc_server
from kvmesh.common.wire.request_reports import END, FIRST_TOKEN, RequestReport, decode_reports
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


class RecordingRouter(router_pb2_grpc.RouterServicer):
    """Answers every route query with worker 1 and records each message: (queries, reports)."""

    def __init__(self) -> None:
        self.messages: list[tuple[list[str], list[RequestReport]]] = []

    async def RouteMany(
        self, request_iterator: AsyncIterator[router_pb2.RouteQueries], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouteAnswers]:
        async for message in request_iterator:
            reports = decode_reports(message.reports) if message.reports else []
            self.messages.append(([q.request.request.request_id for q in message.queries], reports))
            if message.queries:
                yield router_pb2.RouteAnswers(
                    answers=[
                        router_pb2.RouteAnswer(query_id=q.query_id, response=router_pb2.RouteResponse(worker_id=1))
                        for q in message.queries
                    ]
                )

    def reports(self) -> list[RequestReport]:
        return [report for _, reports in self.messages for report in reports]


async def serve(servicer: RecordingRouter) -> tuple[GrpcService, str]:
    server = await start_grpc_server(
        lambda s: router_pb2_grpc.add_RouterServicer_to_server(servicer, s), ["kvmesh.v1.Router"]
    )
    return server, f"127.0.0.1:{server.port}"


def route_query(request_id: str) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(request=common_pb2.PreprocessedRequest(request_id=request_id, token_ids=[1]))


async def test_reports_ride_with_the_next_query_or_go_alone_in_their_order():
    peer = RecordingRouter()
    server, address = await serve(peer)
    routers = RouterClient(fixed_address=address)
    try:
        assert (await routers.route(address, route_query("q1"))).worker_id == 1
        still_running = RequestReport(FIRST_TOKEN, "q0")
        ended = RequestReport(END, "q1", "completed", 4)
        for report in (RequestReport(FIRST_TOKEN, "q1"), still_running, ended):
            routers.report(address, report)
        await routers.route(address, route_query("q2"))  # asked at once: the reports go with it
        # in their order, less q1's first token: its end, in the same message, frees it anyway
        assert peer.messages[1] == (["q2"], [still_running, ended])

        routers.report(address, RequestReport(END, "q2", "completed", 2))  # no query follows
        await wait_until_async(lambda: len(peer.messages) == 3, timeout=10, what="the report sent alone")
        assert peer.messages[2] == ([], [RequestReport(END, "q2", "completed", 2)])
    finally:
        await routers.close()
        await server.stop(0)


class StalledRouter(RecordingRouter):
    """A loaded replica: it answers its first message, then stalls ``stall_s`` before it reads on."""

    def __init__(self, stall_s: float) -> None:
        super().__init__()
        self.stall_s = stall_s

    async def RouteMany(
        self, request_iterator: AsyncIterator[router_pb2.RouteQueries], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouteAnswers]:
        answered = False
        async for answers in super().RouteMany(request_iterator, context):
            yield answers
            if not answered and self.stall_s:
                answered = True
                await asyncio.sleep(self.stall_s)  # the loaded replica's stall, not a wait on the client


@pytest.mark.parametrize("stall_s", [0.0, 0.3])
async def test_reports_still_waiting_when_the_frontend_closes_reach_the_replica_first(stall_s):
    # A replica slow to read (stall_s) lost the last report when the frontend cancelled the call once
    # it was written: the cancel overtook a message not yet read. Half-closed, the stream ends only
    # when the replica has read everything, so the report is there by the time close returns.
    peer = StalledRouter(stall_s)
    server, address = await serve(peer)
    routers = RouterClient(fixed_address=address)
    try:
        await routers.route(address, route_query("q1"))
        last = RequestReport(END, "q1", "cancelled")
        routers.report(address, last)
        await routers.close()  # at once: well within the reports' window
        assert peer.reports() == [last]
    finally:
        await server.stop(0)


async def test_a_report_to_a_replica_whose_stream_broke_is_dropped_and_the_next_route_reconnects():
    peer = RecordingRouter()
    server, address = await serve(peer)
    routers = RouterClient(fixed_address=address)
    try:
        await routers.route(address, route_query("q1"))
        port = server.port
        await server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as broken:  # the stream to a dead replica: fail over
            await asyncio.wait_for(routers.route(address, route_query("q2")), timeout=30)
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
        routers.report(address, RequestReport(END, "q1", "completed", 1))  # lost with the replica
        server = await start_grpc_server(
            lambda s: router_pb2_grpc.add_RouterServicer_to_server(peer, s), ["kvmesh.v1.Router"], port=port
        )
        await wait_until_async(
            lambda: _routes_again(routers, address), timeout=30, what="a new stream to the restarted replica"
        )
    finally:
        await routers.close()
        await server.stop(0)


async def _routes_again(routers: RouterClient, address: str) -> bool:
    try:
        return (await routers.route(address, route_query("q3"))).worker_id == 1
    except grpc.aio.AioRpcError:
        return False
