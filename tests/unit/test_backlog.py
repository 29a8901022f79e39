"""Backlog: one consumer takes everything added since its last take, in order, waiting for at least one."""

from __future__ import annotations

import asyncio

from kvmesh.common.rpc.backlog import Backlog


async def test_take_returns_everything_added_since_the_last_take_in_order():
    backlog: Backlog[int] = Backlog()
    for item in (3, 1, 2):
        backlog.add(item)
    assert await backlog.take() == [3, 1, 2]
    backlog.add(4)
    assert await backlog.take() == [4]


async def test_take_waits_for_an_item_and_then_takes_all_that_came():
    backlog: Backlog[str] = Backlog()
    taking = asyncio.create_task(backlog.take())
    await asyncio.sleep(0)  # let it start waiting
    assert not taking.done()
    backlog.add("a")
    backlog.add("b")  # added before the waiting consumer runs: it takes both
    assert await asyncio.wait_for(taking, timeout=5) == ["a", "b"]
