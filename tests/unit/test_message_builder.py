"""A stream's next message built in place: every item added goes out once, in order, and the
writer waits until there is something to send."""

from __future__ import annotations

import asyncio

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.rpc.message_builder import MessageBuilder

TURNS = 20  # event-loop turns a waiting taker gets to show it was (wrongly) woken


async def turns(n: int = TURNS) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def commands_builder() -> MessageBuilder[common_pb2.GenerateCommands]:
    return MessageBuilder(common_pb2.GenerateCommands, "commands")


async def test_items_added_between_takes_go_out_together_in_order_and_once():
    builder = commands_builder()
    builder.add().cancel = "a"
    builder.add().submit.CopyFrom(common_pb2.PreprocessedRequest(request_id="b", token_ids=[1, 2, 3]))
    first = await asyncio.wait_for(builder.take(), 5)
    assert [c.WhichOneof("command") for c in first.commands] == ["cancel", "submit"]
    assert first.commands[0].cancel == "a" and list(first.commands[1].submit.token_ids) == [1, 2, 3]
    builder.add().cancel = "c"
    second = await asyncio.wait_for(builder.take(), 5)
    assert [c.cancel for c in second.commands] == ["c"]  # nothing of the first message again
    assert len(first.commands) == 2  # and the message taken before is left as it was


async def test_the_taker_waits_for_an_item_or_a_wake():
    builder = commands_builder()
    taker = asyncio.ensure_future(builder.take())
    await turns()
    assert not taker.done()
    builder.add().cancel = "r"
    assert [c.cancel for c in (await asyncio.wait_for(taker, 5)).commands] == ["r"]
    taker = asyncio.ensure_future(builder.take())
    await turns()
    assert not taker.done()
    builder.wake()  # e.g. a query stream's reports: a message with no item
    assert len((await asyncio.wait_for(taker, 5)).commands) == 0
