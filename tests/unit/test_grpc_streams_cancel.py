"""``messages`` under an anyio-style cancel scope, which cancels the consuming task again at every
await until it ends: the generator must still wait for its read to finish (a read left behind kept
native memory per request in the frontend, ``bench.soak``). The call is a stand-in whose read ends
a little after ``cancel()``, as a real grpc.aio read does once the cancellation reaches its batch."""

from __future__ import annotations

import asyncio

import grpc

from kvmesh.common.rpc.grpc_streams import messages


class SlowToCancelCall:
    """Endless messages; after ``cancel()`` the pending read ends 20 ms later."""

    def __init__(self) -> None:
        self._cancelled = asyncio.Event()
        self.read_finished = False

    def cancel(self) -> bool:
        asyncio.get_running_loop().call_later(0.02, self._cancelled.set)
        return True

    async def read(self):
        if self._cancelled.is_set():
            self.read_finished = True
            raise asyncio.CancelledError
        try:
            await asyncio.wait_for(self._cancelled.wait(), 0.001)
        except TimeoutError:
            return b"m"
        self.read_finished = True
        raise asyncio.CancelledError


async def test_a_reader_cancelled_at_every_await_waits_for_its_read():
    call = SlowToCancelCall()
    first = asyncio.Event()
    finished_when_given_up: list[bool] = []

    async def consume() -> None:
        try:
            async for _ in messages(call):  # type: ignore[arg-type]
                first.set()
        finally:  # the moment messages() has given up, before anything else runs
            finished_when_given_up.append(call.read_finished)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 5)
    while not task.done():
        task.cancel()
        await asyncio.sleep(0)
    assert task.cancelled()
    assert finished_when_given_up == [True]


async def test_the_end_of_the_stream_still_ends_it():
    class TwoMessages:
        def __init__(self) -> None:
            self.left = [b"a", b"b", grpc.aio.EOF]

        def cancel(self) -> bool:
            return False

        async def read(self):
            return self.left.pop(0)

    assert [m async for m in messages(TwoMessages())] == [b"a", b"b"]  # type: ignore[arg-type]
