"""An engine that fails a request mid-stream: the worker ends the call UNAVAILABLE *without* marking it
a refusal, so a router takes the worker for failed and migrates the request (real gRPC, no router)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_errors import error_origin, is_transport_failure
from kvmesh.common.rpc.grpc_server import channel_to, start_grpc_server
from kvmesh.common.rpc.stream_sessions import StreamSessions, open_worker_stream
from kvmesh.worker.engine import (
    CachedBlock,
    Engine,
    EngineFailure,
    EngineRequestError,
    EngineRequestSpec,
    EngineStatus,
    TokenOutput,
    TokenQueue,
    TransferPlan,
)
from kvmesh.worker.metrics import WorkerMetrics
from kvmesh.worker.servicer import WorkerServicer
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


class FailingEngine(Engine):
    """Answers two tokens, then fails the request as a dead engine would (vLLM's EngineDeadError)."""

    block_size = 16
    max_num_batched_tokens = 8192

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, spec: EngineRequestSpec, hold_on_finish: bool = False) -> TokenQueue:
        if len(spec.prompt) > 100:
            raise EngineRequestError("the prompt is longer than the model's context")
        queue = TokenQueue()
        queue.put_nowait(TokenOutput(spec.request_id, 7, None, 0))
        queue.put_nowait(TokenOutput(spec.request_id, 8, None, 0))
        queue.put_nowait(EngineFailure("the engine died"))
        return queue

    def reserve_remote(self, spec: EngineRequestSpec) -> tuple[TransferPlan | None, TokenQueue]:
        raise EngineRequestError("no disaggregation")

    def finish_transfer(self, request_id: str, received: bool) -> None:
        pass

    def held_slots(self, request_id: str, num_blocks: int) -> list[int]:
        return []

    def release_held(self, request_id: str) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def status(self) -> EngineStatus:
        return EngineStatus(16, 100, 0, 0, 0, 0, 0)

    def dump_kv_state(self) -> tuple[int, list[CachedBlock]]:
        return -1, []


async def call(generate, tokens: int) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    """``generate(request)``: a Worker.Generate stream, or a request on a router's GenerateMany session."""
    request = common_pb2.PreprocessedRequest(request_id=f"r{tokens}", token_ids=list(range(tokens)))
    received: list[int] = []
    try:
        async for output in generate(request):
            received.extend(output.token_ids)
    except grpc.aio.AioRpcError as exc:
        return received, exc
    return received, None


@contextlib.asynccontextmanager
async def worker_serving(engine: Engine) -> AsyncIterator[str]:
    """``engine`` behind the worker's gRPC servicer on a real server; yields its address."""
    servicer = WorkerServicer(1, "kvmesh-tiny", engine, WorkerMetrics(engine, None, None), None)
    server = await start_grpc_server(
        lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
    )
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop()


@pytest.mark.parametrize("streams", ["per-request", "multiplexed"])
async def test_an_engine_failure_is_a_transport_failure_and_a_bad_prompt_a_refusal(streams: str):
    engine = FailingEngine()
    async with worker_serving(engine) as address, channel_to(address) as channel, contextlib.AsyncExitStack() as stack:
        generate = worker_pb2_grpc.WorkerStub(channel).Generate
        if streams == "multiplexed":
            channels = ChannelPool()
            stack.push_async_callback(channels.close)
            sessions = StreamSessions(channels, open_worker_stream)
            stack.push_async_callback(sessions.close)
            generate = functools.partial(sessions.generate, address)
        tokens, error = await call(generate, 10)
        assert tokens == [7, 8] and error is not None
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "the engine died" in error.details()
        assert is_transport_failure(error)  # a router migrates it
        # the worker aborts the request in the engine after the failure is on its way to the caller
        await wait_until_async(lambda: engine.aborted == ["r10"], what="the failed request aborted in the engine")
        tokens, error = await call(generate, 200)
        assert tokens == [] and error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_origin(error) == "worker"  # a refusal, passed on to the client as a 400
