"""``bench.http_server_costs`` loads a real uvicorn both ways and reads the server's own CPU.

Its figures mean something only if every request was answered in full by the server it names, over
the kind of connection it names: a bad or cut answer must stop the bench, not count as a fast one.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from bench import http_server_costs
from kvmesh.common.ports import free_port


def test_each_round_measures_new_and_kept_alive_connections_on_the_named_server() -> None:
    figures = http_server_costs.measure("uvicorn", sys.executable, n=200, c=4, rounds=2)

    assert [(f["round"], f["connections"]) for f in figures] == [
        (1, "new per request"),
        (1, "kept alive"),
        (2, "new per request"),
        (2, "kept alive"),
    ]
    assert all(f["server"] == "uvicorn" for f in figures)
    assert all(f["requests_per_s"] > 0 and f["server_cpu_ms_per_request"] >= 0 for f in figures)


def test_an_answer_that_is_not_the_apps_stops_the_load() -> None:
    async def scenario() -> None:
        async def wrong_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno")
            await writer.drain()
            writer.close()

        port = free_port()
        server = await asyncio.start_server(wrong_answer, "127.0.0.1", port)
        async with server:
            with pytest.raises(RuntimeError, match="unexpected answer"):
                await http_server_costs.load(f"http://127.0.0.1:{port}/", n=3, c=1, keep_alive=False)

    asyncio.run(scenario())
