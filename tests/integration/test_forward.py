"""Forwards (docs/decisions/0030) against a real worker process over real gRPC: the worker serves a
request a router hands on to the stream a frontend attached, and tells the router only of a
forward that failed; the frontend's direct path, driven by a scripted router peer that hands on
through a real router-side session, claims handed-on requests, submits a refused one itself,
cancels and moves on a lost one, and stops what it no longer waits for at the worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.calling.request_path import ROUTER_FAILOVER_LIMIT, RequestPath
from kvmesh.common.calling.router_client import RouterClient
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_server import GrpcService, start_grpc_server
from kvmesh.common.rpc.stream_sessions import StreamSessions, open_worker_stream
from kvmesh.common.wire.request_reports import END, FIRST_TOKEN, RequestReport, decode_reports
from tests.integration.test_stream_sessions import one_worker, request, submit
from tests.support import wait_until_async

pytestmark = pytest.mark.integration
REFUSED = grpc.StatusCode.FAILED_PRECONDITION.value[0]
# about a minute at --speedup-ratio 5 (the handing_on fixture's worker): a request this long that
# leaves the worker within the waits' 10 s was cancelled there
ENDLESS = 200_000
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def forward(frontend_id: str, sent: common_pb2.PreprocessedRequest) -> common_pb2.GenerateCommands:
    command = common_pb2.GenerateCommand(forward=common_pb2.Forward(request=sent, frontend_id=frontend_id))
    return common_pb2.GenerateCommands(commands=[command])


def attach(frontend_id: str) -> common_pb2.GenerateCommands:
    return common_pb2.GenerateCommands(commands=[common_pb2.GenerateCommand(attach=frontend_id)])


async def read_until_end(call: grpc.aio.StreamStreamCall, request_id: str) -> tuple[int, int]:
    """(tokens, end code) of ``request_id`` on ``call``; every item read must be that request's."""
    tokens = 0
    while True:
        for item in (await call.read()).items:
            assert item.request_id == request_id
            if item.HasField("end"):
                return tokens, item.end.code
            tokens += len(item.output.token_ids)


async def running_requests(stub: worker_pb2_grpc.WorkerStub) -> int:
    """Requests the worker's engine holds, running or queued."""
    status = await stub.GetStatus(worker_pb2.WorkerStatusRequest())
    return status.running_requests + status.waiting_requests


async def test_a_worker_serves_a_forward_on_the_attached_stream_and_tells_the_router_only_of_failures(
    nc: NatsClient, nats_url: str
):
    async with (
        one_worker(nc, nats_url, "--speedup-ratio", "50") as (address, _),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = worker_pb2_grpc.WorkerStub(channel)
        router = stub.GenerateMany()
        await router.write(forward("front-1", request("h0", 0, 4)))
        assert await read_until_end(router, "h0") == (0, REFUSED)  # no stream from front-1 yet

        frontend = stub.GenerateMany()
        await frontend.write(attach("front-1"))
        await frontend.write(submit(request("s1", 0, 2)))  # answered after the attach: the stream is attached
        assert await read_until_end(frontend, "s1") == (2, 0)
        await router.write(forward("front-1", request("h1", 100, 4)))
        assert await read_until_end(frontend, "h1") == (4, 0)  # served on the frontend's stream
        await router.write(forward("front-2", request("h2", 200, 4)))
        assert await read_until_end(router, "h2") == (0, REFUSED)  # and nothing of h1 came before it here

        # the frontend's stream ends while a handed-on request runs: the router hears it was cut short
        await router.write(forward("front-1", request("h3", 300, ENDLESS)))
        first = (await frontend.read()).items[0]
        assert first.request_id == "h3" and first.HasField("output")
        frontend.cancel()
        assert await read_until_end(router, "h3") == (0, UNAVAILABLE)
        await wait_until_async(lambda: _zero(stub), what="h3 aborted at the worker")
        router.cancel()


async def _zero(stub: worker_pb2_grpc.WorkerStub) -> bool:
    return await running_requests(stub) == 0


class ScriptedRouter(router_pb2_grpc.RouterServicer):
    """Routes every request to one real worker. A query without a forward is answered at once; one
    with a forward is handled by ``script`` (a query's request id → what to do), by default handed
    on through a real router-side session and never answered unless the worker says it failed."""

    def __init__(self, worker_address: str) -> None:
        self.worker_address = worker_address
        self.sessions = StreamSessions(ChannelPool(), open_worker_stream)
        self.queries: list[router_pb2.RouteRequest] = []
        self.reports: list[RequestReport] = []
        self.script: dict[str, str] = {}
        self.refused: list[str] = []  # forwards the worker refused (no stream from that frontend)
        self.forward_delay = 0.0

    def response(self, **fields) -> router_pb2.RouteResponse:
        return router_pb2.RouteResponse(worker_id=1, worker_address=self.worker_address, migration_limit=3, **fields)

    async def RouteMany(
        self, request_iterator: AsyncIterator[router_pb2.RouteQueries], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouteAnswers]:
        answers: asyncio.Queue[router_pb2.RouteAnswer | str] = asyncio.Queue()
        handling: set[asyncio.Future[None]] = set()

        async def handle(query: router_pb2.RouteQuery) -> None:
            routed = query.request
            action = self.script.get(routed.request.request_id, "hand on")
            if not routed.forward_to:
                action = "answer"
            if action in ("hand on", "lost", "break"):
                await asyncio.sleep(self.forward_delay)
                handed = routed.request
                if action != "hand on":  # what is lost or left behind runs until it is cancelled
                    handed = common_pb2.PreprocessedRequest()
                    handed.CopyFrom(routed.request)
                    handed.stop.max_tokens = ENDLESS
                failed = self.sessions.get(self.worker_address).forward(handed, routed.forward_to)
                if action == "break":
                    await answers.put("break")
                    return
                if action == "hand on":
                    end = await failed
                    if end.code != REFUSED:
                        return
                    self.refused.append(routed.request.request_id)
            lost = action == "lost"
            answer = router_pb2.RouteAnswer(query_id=query.query_id, response=self.response(forward_lost=lost))
            await answers.put(answer)

        async def read() -> None:
            async for message in request_iterator:
                self.reports += decode_reports(message.reports) if message.reports else []
                for query in message.queries:
                    self.queries.append(query.request)
                    task = asyncio.ensure_future(handle(query))
                    handling.add(task)
                    task.add_done_callback(handling.discard)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                answer = await answers.get()
                if answer == "break":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted break")
                yield router_pb2.RouteAnswers(answers=[answer])
        finally:
            reader.cancel()
            for task in handling:
                task.cancel()

    def ends(self, request_id: str) -> list[RequestReport]:
        return [r for r in self.reports if r.kind == END and r.request_id == request_id]


async def serve(router: ScriptedRouter) -> tuple[GrpcService, str]:
    server = await start_grpc_server(
        lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s), ["kvmesh.v1.Router"]
    )
    return server, f"127.0.0.1:{server.port}"


async def answer_of(direct: RequestPath, sent: common_pb2.PreprocessedRequest, router_address: str) -> list[int]:
    tokens: list[int] = []
    async for output in direct.generate(sent):
        tokens.extend(output.token_ids)
    return tokens


@contextlib.asynccontextmanager
async def handed_on_mesh(nc: NatsClient, nats_url: str, *worker_flags: str):
    """(worker stub, scripted router, its address, a forward direct path); the path has served one
    request already, answered by the router (it learns the router's migration limit that way) and
    submitted by itself, so its stream to the worker is attached."""
    async with one_worker(nc, nats_url, "--speedup-ratio", "5", *worker_flags) as (address, _):
        router = ScriptedRouter(address)
        server, router_address = await serve(router)
        routers = RouterClient(fixed_address=router_address)
        direct = RequestPath(routers)
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                assert len(await answer_of(direct, request("warm", 0, 2), router_address)) == 2
                assert not router.queries[0].forward_to  # no limit known yet: routed the usual way
                yield worker_pb2_grpc.WorkerStub(channel), router, router_address, direct
            finally:
                await direct.close()
                await routers.close()
                await router.sessions.close()
                await server.stop()


@pytest.fixture
async def handing_on(nc: NatsClient, nats_url: str):
    """:func:`handed_on_mesh`."""
    async with handed_on_mesh(nc, nats_url) as mesh:
        yield mesh


@pytest.fixture
async def handing_on_one_sequence(nc: NatsClient, nats_url: str):
    """:func:`handed_on_mesh` on a worker that runs one sequence at a time (see :func:`occupied`)."""
    async with handed_on_mesh(nc, nats_url, "--max-num-seqs", "1") as mesh:
        yield mesh


@contextlib.asynccontextmanager
async def occupied(stub: worker_pb2_grpc.WorkerStub):
    """A one-sequence worker's sequence held by an endless request for the block's span, so that a
    try handed on meanwhile waits there without output. Why: a router's break and the worker's
    first output of the try it handed on race to the frontend; one that claims the output first
    is served (rightly), and a test of the break would then hang on an endless answer."""
    call = stub.GenerateMany()
    try:
        await call.write(submit(request("occupier", 900, ENDLESS)))
        first = (await call.read()).items[0]
        assert first.request_id == "occupier" and first.HasField("output")
        yield
    finally:
        call.cancel()  # the worker aborts the request of a stream that ends


async def test_a_handed_on_request_is_claimed_from_the_frontends_own_stream(handing_on):
    _stub, router, router_address, direct = handing_on
    assert len(await answer_of(direct, request("h1", 100, 6), router_address)) == 6
    assert router.queries[-1].forward_to == direct.caller_id
    await wait_until_async(lambda: bool(router.ends("h1")), what="the end reported")
    kinds = [(r.kind, r.outcome) for r in router.reports if r.request_id == "h1"]
    # a first-token report that would leave with the end is dropped (decision 19)
    assert kinds in ([(FIRST_TOKEN, ""), (END, "completed")], [(END, "completed")])
    assert direct.expected_forwards == 0


async def test_a_lost_forward_is_cancelled_at_its_worker_and_moves_on(handing_on):
    stub, router, router_address, direct = handing_on
    router.script["lost"] = "lost"  # handed on, and answered lost at once: it may be running
    assert len(await answer_of(direct, request("lost", 100, 20), router_address)) == 20
    assert [(r.outcome, r.failed_worker_id) for r in router.ends("lost")] == [("migrated", 1)]
    assert router.queries[-1].migration == 1 and not router.queries[-1].forward_to
    await wait_until_async(lambda: _zero(stub), what="the lost try cancelled at the worker")
    assert not router.ends("lost")[0].output_tokens


async def test_a_router_stream_that_breaks_before_the_first_output_fails_over_and_stops_the_forward(
    handing_on_one_sequence,
):
    stub, router, router_address, direct = handing_on_one_sequence
    router.script["b1"] = "break"
    # the path fails over to another router replica; with none left, the one replica is asked
    # again (on a new stream), and the try handed on before the break is stopped where it ran
    async with occupied(stub):  # the forward waits at the worker: the break reaches the frontend first
        answer = asyncio.ensure_future(answer_of(direct, request("b1", 100, 20), router_address))
        await wait_until_async(lambda: any(q.request.request_id == "b1:t1" for q in router.queries), what="failover")
    assert len(await answer) == 20
    asked = [q for q in router.queries if q.request.request_id.startswith("b1")]
    assert len(asked) == 2 and asked[0].forward_to
    assert direct.expected_forwards == 0
    await wait_until_async(lambda: _zero(stub), what="the forward cancelled wherever it ran")


async def test_a_replica_that_breaks_every_try_fails_the_request_at_the_failover_limit(handing_on_one_sequence):
    stub, router, router_address, direct = handing_on_one_sequence
    tries = ["b2", *(f"b2:t{i}" for i in range(1, ROUTER_FAILOVER_LIMIT + 1))]
    router.script.update(dict.fromkeys(tries, "break"))
    async with occupied(stub):  # each try waits at the worker: every break reaches the frontend first
        with pytest.raises(grpc.aio.AioRpcError, match=f"failed {ROUTER_FAILOVER_LIMIT + 1} times") as failed:
            await answer_of(direct, request("b2", 100, 20), router_address)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [q.request.request_id for q in router.queries if q.request.request_id.startswith("b2")] == tries
    await wait_until_async(lambda: _zero(stub), what="every try handed on stopped where it ran")


async def test_an_output_no_one_waits_for_is_cancelled_at_the_worker(handing_on):
    stub, router, _router_address, direct = handing_on
    session = router.sessions.get(router.worker_address)
    failed = session.forward(request("stray", 100, ENDLESS), direct.caller_id)  # this frontend never asked
    await wait_until_async(lambda: _zero(stub), what="the stray request cancelled at the worker")
    assert not failed.done()  # served on the frontend's stream, not refused


async def test_a_client_that_leaves_before_the_first_output_stops_the_forward_and_frees_its_load(handing_on):
    stub, router, router_address, direct = handing_on
    router.script["gone"] = "lost"  # handed on late, and then answered lost: both after the client left
    router.forward_delay = 0.3
    task = asyncio.ensure_future(answer_of(direct, request("gone", 100, ENDLESS), router_address))
    await wait_until_async(lambda: any(q.request.request_id == "gone" for q in router.queries), what="routed")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_async(lambda: bool(router.ends("gone")), timeout=5, what="the end reported")
    assert [r.outcome for r in router.ends("gone")] == ["cancelled"]
    await wait_until_async(lambda: _zero(stub), what="the late forward cancelled at the worker")
    assert direct.expected_forwards == 0


async def test_a_forward_the_worker_refuses_is_submitted_by_the_frontend_itself(handing_on):
    _stub, router, router_address, _ = handing_on
    routers = RouterClient(fixed_address=router_address)
    routers.note_route(router_address, router.response())  # the limit is known, no worker stream is open
    fresh = RequestPath(routers)
    try:
        assert len(await answer_of(fresh, request("r1", 100, 6), router_address)) == 6
        assert router.queries[-1].forward_to == fresh.caller_id  # asked for, refused, then submitted
        assert len(await answer_of(fresh, request("r2", 200, 6), router_address)) == 6  # now attached
        assert router.queries[-1].forward_to == fresh.caller_id
        assert router.refused == ["r1"] and fresh.expected_forwards == 0
    finally:
        await fresh.close()
        await routers.close()
