"""BatchQueue: one consumer takes everything added since its last take, in order, waiting for at least one."""

from __future__ import annotations

import asyncio

from kvmesh.common.rpc.batch_queue import BatchQueue


async def test_take_returns_everything_added_since_the_last_take_in_order():
    queue: BatchQueue[int] = BatchQueue()
    for item in (3, 1, 2):
        queue.add(item)
    assert await queue.take() == [3, 1, 2]
    queue.add(4)
    assert await queue.take() == [4]


async def test_take_waits_for_an_item_and_then_takes_all_that_came():
    queue: BatchQueue[str] = BatchQueue()
    taking = asyncio.create_task(queue.take())
    await asyncio.sleep(0)  # let it start waiting
    assert not taking.done()
    queue.add("a")
    queue.add("b")  # added before the waiting consumer runs: it takes both
    assert await asyncio.wait_for(taking, timeout=5) == ["a", "b"]
