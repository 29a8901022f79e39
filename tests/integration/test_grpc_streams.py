"""``kvmesh.common.rpc.grpc_streams.messages`` over a real grpc.aio server: every message, errors as
errors, and a reader that stops or is cancelled cancels the call (the server sees it) with no read
left behind."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.common.rpc.grpc_streams import messages

pytestmark = pytest.mark.integration

WAIT_S = 10.0


class CountingStream:
    """A server stream of ``count`` messages (endless when None), or an error after ``fail_after``."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.count: int | None = 3
        self.fail_after: int | None = None

    async def handle(self, request: bytes, context: grpc.aio.ServicerContext):
        sent = 0
        try:
            while self.count is None or sent < self.count:
                if self.fail_after is not None and sent == self.fail_after:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
                yield f"m{sent}".encode()
                sent += 1
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
async def stream():
    handler = CountingStream()
    server = grpc.aio.server()
    methods = {"Stream": grpc.unary_stream_rpc_method_handler(handler.handle)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Counting", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield handler, channel.unary_stream("/test.Counting/Stream")
    await channel.close()
    await server.stop(None)


async def test_every_message_then_the_end(stream):
    _, method = stream
    assert [m async for m in messages(method(b""))] == [b"m0", b"m1", b"m2"]


async def test_an_error_status_is_raised(stream):
    handler, method = stream
    handler.fail_after = 1
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for message in messages(method(b"")):
            received.append(message)
    assert received == [b"m0"]
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_stopping_early_cancels_the_call(stream):
    handler, method = stream
    handler.count = None
    call = method(b"")
    reader = messages(call)
    assert await anext(reader) == b"m0"
    await reader.aclose()
    assert call.cancelled()
    await asyncio.wait_for(handler.cancelled.wait(), WAIT_S)


async def test_a_cancelled_reader_cancels_the_call_and_leaves_no_read_in_flight(stream):
    handler, method = stream
    handler.count = None
    call = method(b"")
    first = asyncio.Event()

    async def read_forever() -> None:
        async for _ in messages(call):
            first.set()

    reader = asyncio.create_task(read_forever())
    await asyncio.wait_for(first.wait(), WAIT_S)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert call.cancelled()
    # the read finished before the reader gave up: no read of the call is left running
    reads = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith((".read", ".read_all"))]
    assert not [t for t in reads if not t.done()]
    await asyncio.wait_for(handler.cancelled.wait(), WAIT_S)
