"""A request marked ``whole_answer`` (a non-streamed completion): the worker sends its first output at
once and holds the others until the last, or until a failure, which sends what was held before the
call ends (real gRPC, a scripted engine the test feeds token by token)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.worker.engine import EngineFailure, EngineRequestSpec, TokenOutput, TokenQueue
from tests.integration.test_engine_failure import FailingEngine, worker_serving
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


class ScriptedEngine(FailingEngine):
    """Outputs only what the test puts in the request's queue."""

    def __init__(self) -> None:
        super().__init__()
        self.queues: dict[str, TokenQueue] = {}

    def submit(self, spec: EngineRequestSpec, hold_on_finish: bool = False) -> TokenQueue:
        queue = self.queues[spec.request_id] = TokenQueue()
        return queue


async def feed_one_at_a_time(queue: TokenQueue, *items: TokenOutput | EngineFailure) -> None:
    """Each item alone: a worker that reads each output has taken one before the next comes, so none
    is gathered with another. A whole answer's worker leaves them queued until its last (it waits
    for that one only), so they are fed without waiting there."""
    for item in items:
        queue.put_nowait(item)
        if not queue.holding:
            await wait_until_async(queue.empty, timeout=10, what="the worker took the output")


@contextlib.asynccontextmanager
async def scripted_worker() -> AsyncIterator[tuple[ScriptedEngine, worker_pb2_grpc.WorkerStub]]:
    engine = ScriptedEngine()
    async with worker_serving(engine) as address, channel_to(address) as channel:
        yield engine, worker_pb2_grpc.WorkerStub(channel)


async def answer_started(
    engine: ScriptedEngine, stub: worker_pb2_grpc.WorkerStub, request_id: str, whole: bool
) -> tuple[AsyncIterator[common_pb2.GenerateOutput], TokenQueue]:
    """A request whose first output, token 7, the caller has received."""
    request = common_pb2.PreprocessedRequest(request_id=request_id, token_ids=[1, 2, 3], whole_answer=whole)
    outputs = stub.Generate(request).__aiter__()
    await wait_until_async(lambda: request_id in engine.queues, timeout=10, what="the request reached the engine")
    queue = engine.queues[request_id]
    queue.put_nowait(TokenOutput(request_id, 7, None, 0))
    assert list((await anext(outputs)).token_ids) == [7]  # at once, whole or not
    return outputs, queue


@pytest.mark.parametrize("whole", [True, False])
async def test_a_whole_answer_comes_as_its_first_output_and_then_one_with_the_rest(whole: bool):
    async with scripted_worker() as (engine, stub):
        outputs, queue = await answer_started(engine, stub, "w", whole)
        # a whole answer's reader waits for the last output only, not for each one before it
        assert queue.holding is whole
        await feed_one_at_a_time(queue, TokenOutput("w", 8, None, 0), TokenOutput("w", 9, None, 0))
        queue.put_nowait(TokenOutput("w", 10, FinishReason.LENGTH, 0))
        rest = [output async for output in outputs]
    if whole:
        assert [list(o.token_ids) for o in rest] == [[8, 9, 10]]
    else:
        assert [list(o.token_ids) for o in rest] == [[8], [9], [10]]
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 4


async def test_a_failure_sends_the_held_tokens_before_the_call_ends():
    async with scripted_worker() as (engine, stub):
        outputs, queue = await answer_started(engine, stub, "f", whole=True)
        await feed_one_at_a_time(queue, TokenOutput("f", 8, None, 0), TokenOutput("f", 9, None, 0))
        queue.put_nowait(EngineFailure("the engine died"))
        held = await anext(outputs)
        assert list(held.token_ids) == [8, 9] and held.usage.completion_tokens == 3
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await anext(outputs)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # a router migrates it after 7, 8, 9
    assert engine.aborted == ["f"]
