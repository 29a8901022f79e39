"""The request path against a real worker, with a router stand-in that records what it is
told: a finished request's end is reported before the client gets its last output, exactly once,
so that the client's next request (sent on the same stream to the router, behind that report)
finds the first one's load freed."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.calling.request_path import RequestPath
from kvmesh.common.proto.kvmesh.v1 import router_pb2
from kvmesh.common.wire.request_reports import END
from tests.integration.test_stream_sessions import one_worker, request

pytestmark = pytest.mark.integration


class RecordingRouters:
    """What the request path needs of its RouterClient: routes to one worker, records every call."""

    def __init__(self, worker_address: str) -> None:
        self.worker_address = worker_address
        self.calls: list[tuple[str, ...]] = []
        self.migration_limits: dict[str, int] = {}  # none known: no forward is asked for

    def pick(self, avoid: frozenset[str] = frozenset()) -> str:
        return "router-1"

    async def route(self, address: str, query: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        self.calls.append(("route", query.request.request_id))
        return router_pb2.RouteResponse(worker_id=1, worker_address=self.worker_address, migration_limit=3)

    def report(self, address: str, report) -> None:
        self.calls.append((report.kind, report.request_id, report.outcome))


async def test_a_finished_request_is_reported_ended_before_its_last_output_reaches_the_client(
    nc: NatsClient, nats_url: str
):
    async with one_worker(nc, nats_url, "--speedup-ratio", "50") as (address, _):
        routers = RecordingRouters(address)
        direct = RequestPath(routers)  # type: ignore[arg-type]
        try:
            outputs = direct.generate(request("r1", 0, 4))
            async for output in outputs:
                if output.finish_reason:
                    assert routers.calls[-1] == (END, "r1", "completed")  # before the client sees it
                    break
            await outputs.aclose()
            assert [c for c in routers.calls if c[0] == END] == [(END, "r1", "completed")]
        finally:
            await direct.close()


async def test_a_whole_answer_from_a_real_worker_comes_as_its_first_token_then_the_rest_in_one_output(
    nc: NatsClient, nats_url: str
):
    # at speed-up 5 a token takes about 1.2 ms, so the streamed answer lasts about 0.25 s: a reader
    # gets most tokens alone, and only a stall of the whole answer (once seen in CI at speed-up 50,
    # 23 ms) would let the worker fold them all into one output
    async with one_worker(nc, nats_url, "--speedup-ratio", "5") as (address, _):
        direct = RequestPath(RecordingRouters(address))  # type: ignore[arg-type]
        try:
            whole = [o async for o in direct.generate(request("w1", 0, 200, whole_answer=True))]
            assert len(whole) == 2 and len(whole[0].token_ids) >= 1 and whole[1].finish_reason
            assert sum(len(o.token_ids) for o in whole) == 200 and whole[1].usage.completion_tokens == 200
            # the same request streamed: the same tokens (the seed fixes them), in many outputs
            streamed = [o async for o in direct.generate(request("s1", 0, 200))]
            assert len(streamed) > 2
            assert [t for o in streamed for t in o.token_ids] == [t for o in whole for t in o.token_ids]
        finally:
            await direct.close()
