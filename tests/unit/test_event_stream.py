"""EventStreamResponse at the ASGI level: chunks out, a disconnect stops it, other cancels propagate."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.frontend.event_stream import EventStreamResponse


class Client:
    """The server side of one HTTP exchange: what was sent, and a disconnect to trigger."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def test_every_chunk_is_sent_then_the_end():
    client = Client()

    async def chunks():
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    await EventStreamResponse(chunks(), headers={"x-worker-id": "7"})({"type": "http"}, client.receive, client.send)
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-worker-id", b"7") in start["headers"]
    assert client.bodies() == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False


async def test_a_disconnect_stops_the_stream_where_it_waits_and_runs_its_cleanup():
    client = Client()
    waiting, cleaned_up = asyncio.Event(), asyncio.Event()

    async def chunks():
        try:
            yield b"data: first\n\n"
            waiting.set()
            await asyncio.Event().wait()  # the next token never comes
            yield b"never"
        finally:
            cleaned_up.set()

    response = asyncio.create_task(EventStreamResponse(chunks())({"type": "http"}, client.receive, client.send))
    await asyncio.wait_for(waiting.wait(), 5)
    client.gone.set()
    await asyncio.wait_for(response, 5)  # ends quietly: the client left
    assert cleaned_up.is_set()
    assert client.bodies() == [b"data: first\n\n"]


async def test_a_cancel_from_elsewhere_propagates():
    client = Client()
    waiting = asyncio.Event()

    async def chunks():
        waiting.set()
        await asyncio.Event().wait()
        yield b"never"

    response = asyncio.create_task(EventStreamResponse(chunks())({"type": "http"}, client.receive, client.send))
    await asyncio.wait_for(waiting.wait(), 5)
    response.cancel()
    with pytest.raises(asyncio.CancelledError):
        await response
