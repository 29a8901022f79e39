"""A request's token queue: outputs in order for one reader, and, once told to hold, a reader woken
only by the last output or a failure (a whole answer's worker, docs/decisions/0026)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.worker.engine import EngineFailure, TokenOutput, TokenQueue

TURNS = 20  # event-loop turns a waiting reader gets to show it was (wrongly) woken


def token(token_id: int, finish: FinishReason | None = None) -> TokenOutput:
    return TokenOutput("r", token_id, finish, cached_tokens=0)


async def turns(n: int = TURNS) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_reader_gets_every_output_in_order_as_it_comes():
    queue = TokenQueue()
    reader = asyncio.ensure_future(queue.get())
    await turns()
    queue.put_nowait(token(1))
    queue.put_nowait(token(2))
    assert (await reader).token_id == 1
    assert (await queue.get()).token_id == 2
    assert queue.empty()


async def test_a_holding_reader_sleeps_through_the_outputs_before_the_last():
    queue = TokenQueue()
    queue.hold_until_last()
    reader = asyncio.ensure_future(queue.get())
    await turns()  # the reader is waiting before the outputs come
    queue.put_nowait(token(1))
    queue.put_nowait(token(2))
    await turns()
    assert not reader.done() and queue.qsize() == 2
    queue.put_nowait(token(3, FinishReason.LENGTH))
    assert (await reader).token_id == 1  # still in order: the rest are taken behind it
    assert [queue.get_nowait().token_id for _ in range(2)] == [2, 3]


async def test_a_failure_wakes_a_holding_reader():
    queue = TokenQueue()
    queue.hold_until_last()
    reader = asyncio.ensure_future(queue.get())
    await turns()
    queue.put_nowait(token(1))
    await turns()
    assert not reader.done()
    queue.put_nowait(EngineFailure("engine died"))
    assert (await reader).token_id == 1
    assert isinstance(queue.get_nowait(), EngineFailure)


async def test_holding_after_the_last_was_queued_does_not_wait():
    queue = TokenQueue()
    queue.put_nowait(token(1, FinishReason.STOP))
    queue.hold_until_last()
    assert (await asyncio.wait_for(queue.get(), 5)).finish_reason is FinishReason.STOP


def test_taking_from_an_empty_queue_raises_queue_empty():
    with pytest.raises(asyncio.QueueEmpty):
        TokenQueue().get_nowait()
