"""The router's record of one frontend's forwards (kvmesh.router.forwards): a forward is answered
only if it fails before it is settled, as the ordinary route answer when the worker refused it and
marked lost otherwise, and never twice."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2
from kvmesh.common.rpc.batch_queue import BatchQueue
from kvmesh.common.rpc.grpc_errors import call_error
from kvmesh.router.forwards import Forwards


class FakeSession:
    """What Forwards needs of a StreamSession: ``settle``, recorded."""

    def __init__(self) -> None:
        self.settled: list[str] = []

    def settle(self, request_id: str) -> None:
        self.settled.append(request_id)


def end(code: grpc.StatusCode) -> common_pb2.RequestEnd:
    return common_pb2.RequestEnd(code=code.value[0])


async def watched(forwards: Forwards, request_id: str, session: FakeSession) -> asyncio.Future:
    failed = asyncio.get_running_loop().create_future()
    response = router_pb2.RouteResponse(worker_id=7, worker_address="w:1", migration_limit=3)
    forwards.watch(request_id, session, failed, response, router_pb2.RouteAnswer(query_id=len(forwards) + 1))
    return failed


async def answers_now(queue: BatchQueue) -> list[router_pb2.RouteAnswer]:
    await asyncio.sleep(0)  # the futures' callbacks run on the next turn of the loop
    return await asyncio.wait_for(queue.take(), 1) if queue._items else []


@pytest.mark.parametrize(
    ("failure", "lost"),
    [
        (end(grpc.StatusCode.FAILED_PRECONDITION), False),  # refused: the frontend submits it itself
        (end(grpc.StatusCode.UNAVAILABLE), True),  # the frontend's stream there ended while it ran
        (call_error(grpc.StatusCode.UNAVAILABLE, "stream to the worker broke"), True),
    ],
)
async def test_a_failed_forward_is_answered_once_refused_or_lost(failure, lost):
    answers: BatchQueue = BatchQueue()
    forwards = Forwards(answers)
    session = FakeSession()
    failed = await watched(forwards, "r1", session)
    if isinstance(failure, BaseException):
        failed.set_exception(failure)
    else:
        failed.set_result(failure)
    (answer,) = await answers_now(answers)
    assert answer.response.worker_id == 7 and answer.response.forward_lost is lost
    forwards.settle("r1")  # a report after the answer changes nothing
    assert await answers_now(answers) == [] and len(forwards) == 0


async def test_a_settled_forward_is_never_answered():
    answers: BatchQueue = BatchQueue()
    forwards = Forwards(answers)
    session = FakeSession()
    failed = await watched(forwards, "r1", session)
    forwards.settle("r1")
    assert failed.cancelled() and session.settled == ["r1"]
    assert await answers_now(answers) == []


async def test_the_end_of_the_stream_settles_every_forward():
    answers: BatchQueue = BatchQueue()
    forwards = Forwards(answers)
    session = FakeSession()
    futures = [await watched(forwards, f"r{i}", session) for i in range(3)]
    forwards.settle_all()
    assert all(f.cancelled() for f in futures) and sorted(session.settled) == ["r0", "r1", "r2"]
    assert len(forwards) == 0 and await answers_now(answers) == []
