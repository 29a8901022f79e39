"""Stopping a background task ends it, even one that lost its cancellation inside
``asyncio.wait_for`` (Python 3.11 drops a cancellation that arrives as the awaited operation
completes: CPython gh-86296). A planner stopped with SIGTERM hung on exactly this in its lease loop."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvmesh.common.rpc.tasks import cancel_and_wait


async def test_a_task_that_swallowed_its_cancellation_is_cancelled_again():
    replies: list[asyncio.Future[int]] = []
    rounds = 0

    async def contend_forever() -> None:
        nonlocal rounds
        while True:
            reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            replies.append(reply)
            await asyncio.wait_for(reply, timeout=60)
            rounds += 1
            await asyncio.sleep(3600)  # where the old stop waited for ever

    task = asyncio.create_task(contend_forever())
    await asyncio.sleep(0)
    # The reply and the cancellation in the same moment: 3.11's wait_for returns the reply.
    replies[0].set_result(1)
    # Not inside a timeout: its cancellation would reach the task through the awaiting caller.
    stopper = asyncio.create_task(cancel_and_wait(task))
    done, _ = await asyncio.wait({stopper}, timeout=10)
    if not done:
        stopper.cancel()
    assert stopper in done, "the stop still waits for a task that swallowed its cancellation"
    # the reply arrived as it was cancelled: before 3.12 it lost the cancellation and ran on
    assert rounds == (1 if sys.version_info < (3, 12) else 0)
    assert task.cancelled()


async def test_an_error_the_task_ended_with_is_raised():
    async def fails() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise RuntimeError("while unwinding")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="while unwinding"):
        await cancel_and_wait(task)
