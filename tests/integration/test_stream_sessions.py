"""``Worker.GenerateMany`` and the router's sessions over it, against real worker processes and real
gRPC: the same answers as ``Worker.Generate``, one message per engine step for many requests,
refusals and failures raised as their own streams would raise them, cancellation freeing the
worker, and a killed worker failing every request on its stream as a transport failure."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_errors import error_origin, is_transport_failure
from kvmesh.common.rpc.stream_sessions import StreamSessions, open_worker_stream
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from tests.support import router_generate, running, service_config, service_process, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "sessions"


@contextlib.asynccontextmanager
async def one_worker(nc: NatsClient, nats_url: str, *flags: str):
    """A worker process; yields (its address, the process)."""
    watcher = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    await watcher.start()
    process = service_process("worker", nats_url, NAMESPACE, "--lease-ttl", "30", *flags)
    try:
        await wait_until_async(lambda: len(watcher.instances()) == 1, timeout=30, what="worker registered")
        yield watcher.instances()[0].address, process
    finally:
        process.kill()
        process.wait(timeout=10)
        await watcher.stop()


LONG_ANSWER = 2000  # tokens: about half a second at --speedup-ratio 50


def request(request_id: str, prompt_start: int, max_tokens: int, **fields) -> common_pb2.PreprocessedRequest:
    message = common_pb2.PreprocessedRequest(
        request_id=request_id, token_ids=list(range(prompt_start, prompt_start + 40)), **fields
    )
    message.stop.max_tokens = max_tokens
    message.stop.ignore_eos = True
    message.sampling.seed = prompt_start
    return message


def submit(*requests: common_pb2.PreprocessedRequest, cancel: tuple[str, ...] = ()) -> common_pb2.GenerateCommands:
    """One GenerateMany message: these submits, then these cancels."""
    commands = [common_pb2.GenerateCommand(submit=r) for r in requests]
    return common_pb2.GenerateCommands(commands=commands + [common_pb2.GenerateCommand(cancel=c) for c in cancel])


def tally(items, tokens: dict[str, int], ended: Callable[[str], None]) -> None:
    """Count each request's output tokens into ``tokens``; hand each request that ended (with OK,
    which this asserts) to ``ended``."""
    for item in items:
        if item.HasField("end"):
            assert item.end.code == 0
            ended(item.request_id)
        else:
            tokens[item.request_id] += len(item.output.token_ids)


async def tokens_of(outputs) -> list[int]:
    tokens: list[int] = []
    async for output in outputs:
        tokens.extend(output.token_ids)
    return tokens


async def test_many_requests_on_one_stream_answer_as_their_own_streams_would(nc: NatsClient, nats_url: str):
    async with one_worker(nc, nats_url, "--speedup-ratio", "50") as (address, _):
        channels = ChannelPool()
        sessions = StreamSessions(channels, open_worker_stream)
        try:
            stub = worker_pb2_grpc.WorkerStub(channels.get(address))
            alone = [await tokens_of(stub.Generate(request(f"a{i}", 100 * i, 24))) for i in range(8)]
            shared = await asyncio.gather(
                *(tokens_of(sessions.generate(address, request(f"m{i}", 100 * i, 24))) for i in range(8))
            )
            assert shared == alone and all(len(tokens) == 24 for tokens in shared)
        finally:
            await sessions.close()
            await channels.close()


async def test_one_message_carries_the_outputs_of_many_requests(nc: NatsClient, nats_url: str):
    async with one_worker(nc, nats_url, "--speedup-ratio", "50") as (address, _):
        async with grpc.aio.insecure_channel(address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).GenerateMany()
            for i in range(8):
                await call.write(submit(request(f"b{i}", 100 * i, 16)))
            ended: set[str] = set()
            tokens = dict.fromkeys((f"b{i}" for i in range(8)), 0)
            widest = 0
            while len(ended) < 8:
                batch = await call.read()
                widest = max(widest, len({item.request_id for item in batch.items}))
                tally(batch.items, tokens, ended.add)
            call.cancel()
        assert all(count == 16 for count in tokens.values())
        assert widest >= 2  # requests sharing engine steps share messages


async def test_the_commands_of_one_message_run_in_their_order(nc: NatsClient, nats_url: str):
    # A caller sends whatever commands it has ready as one message; a cancel after its submit in
    # the same message aborts that request before it produces anything, and only that one.
    async with one_worker(nc, nats_url, "--speedup-ratio", "50") as (address, _):
        async with grpc.aio.insecure_channel(address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).GenerateMany()
            await call.write(submit(*(request(f"c{i}", 100 * i, 16) for i in range(3)), cancel=("c1",)))
            tokens = {"c0": 0, "c2": 0}
            ended: set[str] = set()
            while ended != {"c0", "c2"}:
                items = (await call.read()).items
                assert all(item.request_id in tokens for item in items)  # nothing for the cancelled request
                tally(items, tokens, ended.add)
            call.cancel()
        assert tokens == {"c0": 16, "c2": 16}


async def test_a_caller_that_closes_its_side_gets_every_answer_then_the_end_of_the_stream(
    nc: NatsClient, nats_url: str
):
    async with (
        one_worker(nc, nats_url, "--speedup-ratio", "50") as (address, _),
        grpc.aio.insecure_channel(address) as channel,
    ):
        call = worker_pb2_grpc.WorkerStub(channel).GenerateMany()
        await call.write(submit(*(request(f"h{i}", 100 * i, 16) for i in range(3))))
        await call.done_writing()  # before any answer: the requests still run to their ends
        tokens = dict.fromkeys(("h0", "h1", "h2"), 0)
        ended: list[str] = []
        while (batch := await asyncio.wait_for(call.read(), timeout=30)) is not grpc.aio.EOF:
            tally(batch.items, tokens, ended.append)
        assert sorted(ended) == ["h0", "h1", "h2"] and set(tokens.values()) == {16}
        assert (await call.code()) == grpc.StatusCode.OK


async def test_refusals_and_duplicates_end_only_their_request(nc: NatsClient, nats_url: str):
    async with one_worker(nc, nats_url, "--speedup-ratio", "50") as (address, _):
        channels = ChannelPool()
        sessions = StreamSessions(channels, open_worker_stream)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tokens_of(sessions.generate(address, request("r1", 0, 4, model="not-this-model")))
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND and error_origin(refused.value) == "worker"
            assert "not-this-model" in refused.value.details()
            assert not is_transport_failure(refused.value)
            # a request id already running on the stream is refused; the running one goes on
            async with grpc.aio.insecure_channel(address) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).GenerateMany()
                await call.write(submit(request("twice", 0, LONG_ANSWER)))
                # the duplicate goes once the first is running, and that one is long enough not to end
                # before the worker reads it, however slowly the machine runs this test
                first = (await call.read()).items
                assert first and first[0].HasField("output")
                tokens = sum(len(item.output.token_ids) for item in first)
                await call.write(submit(request("twice", 0, LONG_ANSWER)))
                ends = []
                while len(ends) < 2:
                    for item in (await call.read()).items:
                        if item.HasField("end"):
                            ends.append(item.end)
                        else:
                            tokens += len(item.output.token_ids)
                call.cancel()
            refusal, finish = ends
            assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already running" in refusal.details
            assert refusal.origin == "worker"
            assert finish.code == 0 and tokens == LONG_ANSWER
        finally:
            await sessions.close()
            await channels.close()


async def test_a_request_the_router_stops_reading_is_aborted_at_the_worker(nc: NatsClient, nats_url: str):
    async with one_worker(nc, nats_url, "--speedup-ratio", "5") as (address, _):
        channels = ChannelPool()
        sessions = StreamSessions(channels, open_worker_stream)
        stub = worker_pb2_grpc.WorkerStub(channels.get(address))
        try:
            async with contextlib.aclosing(sessions.generate(address, request("c1", 0, 5000))) as outputs:
                await anext(outputs)
                status = await stub.GetStatus(worker_pb2.WorkerStatusRequest())
                assert status.running_requests == 1

            async def idle() -> bool:
                return (await stub.GetStatus(worker_pb2.WorkerStatusRequest())).running_requests == 0

            await wait_until_async(idle, timeout=10, what="the cancelled request aborted at the worker")
            # the stream stays usable for the next request
            assert len(await tokens_of(sessions.generate(address, request("c2", 0, 3)))) == 3
        finally:
            await sessions.close()
            await channels.close()


async def test_a_killed_worker_fails_every_request_on_its_stream_as_a_transport_failure(nc: NatsClient, nats_url: str):
    async with one_worker(nc, nats_url, "--speedup-ratio", "2") as (address, process):
        channels = ChannelPool()
        sessions = StreamSessions(channels, open_worker_stream)
        try:
            streams = [sessions.generate(address, request(f"k{i}", 100 * i, 5000)) for i in range(4)]
            for stream in streams:
                await anext(stream)
            broken = sessions.get(address)
            process.send_signal(signal.SIGKILL)
            for stream in streams:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await tokens_of(stream)
                assert is_transport_failure(failed.value)
            assert broken.broken is not None and sessions.get(address) is not broken
        finally:
            await sessions.close()
            await channels.close()


async def test_a_request_id_already_in_flight_is_refused_and_the_first_finishes(nc: NatsClient, nats_url: str):
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    await routers.start()
    config = service_config(RouterConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE])
    try:
        async with one_worker(nc, nats_url, "--speedup-ratio", "5"), running(router_server.serve, config):
            await wait_until_async(lambda: len(routers.instances()) == 1, what="router registered")
            address = routers.instances()[0].address
            first = asyncio.create_task(router_generate(address, "same-id", list(range(50)), 40))
            channel = grpc.aio.insecure_channel(address)
            stub = router_pb2_grpc.RouterStub(channel)

            async def first_in_flight() -> bool:
                status = await stub.GetStatus(router_pb2.RouterStatusRequest())
                return status.active_requests == 1

            await wait_until_async(first_in_flight, what="the first request in flight")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await router_generate(address, "same-id", list(range(50)), 4)
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS and error_origin(refused.value) == "router"
            outputs = await first
            assert sum(len(o.token_ids) for o in outputs) == 40
            await channel.close()
    finally:
        await routers.stop()


@contextlib.asynccontextmanager
async def sessions_to(servicer: worker_pb2_grpc.WorkerServicer):
    """``servicer`` served on real gRPC; yields (sessions opened over it, its address)."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = ChannelPool()
    sessions = StreamSessions(channels, open_worker_stream)
    try:
        yield sessions, f"127.0.0.1:{port}"
    finally:
        await sessions.close()
        await channels.close()
        await server.stop(None)


def finishing_batch(request_id: str, token: int) -> common_pb2.GenerateBatch:
    """One message with the request's finishing output (``token``, length) and its end."""
    last = common_pb2.GenerateOutput(token_ids=[token], finish_reason=common_pb2.FINISH_REASON_LENGTH)
    return common_pb2.GenerateBatch(
        items=[
            common_pb2.StreamItem(request_id=request_id, output=last),
            common_pb2.StreamItem(request_id=request_id, end=common_pb2.RequestEnd()),
        ]
    )


class RecordingWorker(worker_pb2_grpc.WorkerServicer):
    """A worker stand-in on real gRPC: records every GenerateMany command; answers each submit with
    one finishing output, then the request's end."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    async def GenerateMany(self, messages, context):
        async for message in messages:
            for command in message.commands:
                kind = command.WhichOneof("command")
                request_id = command.submit.request_id if kind == "submit" else command.cancel
                self.commands.append(f"{kind} {request_id}")
                if kind == "submit":
                    yield finishing_batch(request_id, 7)


async def test_a_request_read_to_its_finishing_output_is_not_cancelled_at_the_worker():
    # the direct path and the router stop reading at the output that finishes a request; the peer
    # has nothing left to abort, so a cancel would be a stream write for nothing
    worker = RecordingWorker()
    async with sessions_to(worker) as (sessions, address):
        for request_id in ("r1", "r2"):
            async with contextlib.aclosing(sessions.generate(address, request(request_id, 0, 1))) as outputs:
                async for output in outputs:
                    if output.finish_reason:
                        break  # as a consumer that has its answer does
        # commands keep their order: a cancel of r1 would come before the submit of r2
        await wait_until_async(lambda: "submit r2" in worker.commands, timeout=10, what="the second submit")
        assert worker.commands == ["submit r1", "submit r2"]
