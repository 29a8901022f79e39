"""What an HTTP server costs per request on its own: a bare ASGI answer, new connections and kept-alive.

The frontend serves the OpenAI API with uvicorn (httptools, uvloop: everything on the event loop's
thread). This bench prices that server with no application work in it, so a change of server, or of
how clients connect, can be weighed before it is built (docs/decisions/0019). The app answers every
request with two small server-sent events, as a short streamed answer does. A client in this
process (aiohttp, as the load generators use) sends ``--n`` requests ``--c`` at a time, once opening
a new connection per request (as ``bench.stream_load`` does) and once keeping connections alive,
``--rounds`` times in turn; the server's own CPU per request is read from ``/proc``. That is the
figure to read: the requests/s printed beside it are mostly the client's, which shares the cores.

``--server granian`` runs the same app under Granian's embedded server (a Rust HTTP stack on its own
Tokio thread, handing each request to the event loop). Granian is not a kvmesh dependency: give
``--python`` an interpreter that has it (``python -m venv /tmp/gr && /tmp/gr/bin/pip install granian
uvloop``).

    python -m bench.http_server_costs [--server uvicorn|granian --python /tmp/gr/bin/python --n 3000 --c 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

EVENTS = (b"data: {}\n\n", b"data: [DONE]\n\n")
SERVERS = ("uvicorn", "granian")


async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
    """Two events and the end, as a short streamed answer is written."""
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for event in EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def serve(server: str, port: int) -> None:
    """Run ``app`` under ``server`` on 127.0.0.1:``port`` until killed (the bench's child process)."""
    import uvloop

    if server == "uvicorn":
        import uvicorn

        from kvmesh.frontend.server import listening_socket  # bound as the frontend binds it

        sock = listening_socket("127.0.0.1", port)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        uvloop.run(uvicorn.Server(config).serve(sockets=[sock]))
        return
    from granian.constants import Interfaces
    from granian.server.embed import Server

    uvloop.run(Server(app, address="127.0.0.1", port=port, interface=Interfaces.ASGI, log_enabled=False).serve())


async def load(url: str, n: int, c: int, keep_alive: bool) -> float:
    """Send ``n`` requests, ``c`` at a time, reading each answer to its end; the wall time it took."""
    import aiohttp

    connector = aiohttp.TCPConnector(force_close=not keep_alive, limit=c)
    async with aiohttp.ClientSession(connector=connector) as session:
        remaining = iter(range(n))

        async def client() -> None:
            for _ in remaining:
                async with session.post(url, json={"stream": True}) as response:
                    body = await response.read()
                    if response.status != 200 or not body.endswith(EVENTS[-1]):
                        raise RuntimeError(f"unexpected answer: {response.status} {body[:80]!r}")

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(c)))
        return time.perf_counter() - started


def measure(server: str, python: str, n: int, c: int, rounds: int) -> list[dict[str, object]]:
    """One figure per round and connection mode: the server's CPU per request and the requests/s."""
    # imported here: the server's child process imports this module in an interpreter that may not
    # have kvmesh (Granian's), so the module's top level needs the standard library only
    from bench.peers import wait_for
    from bench.serving_cpu import cpu_seconds
    from kvmesh.common.ports import free_port

    port = free_port()
    child = subprocess.Popen(
        [python, "-c", f"from bench.http_server_costs import serve; serve({server!r}, {port})"],
        cwd=Path(__file__).resolve().parents[1],
    )
    url = f"http://127.0.0.1:{port}/"
    figures: list[dict[str, object]] = []
    try:
        wait_for(url, {}, timeout=30)
        asyncio.run(load(url, min(n, 500), c, keep_alive=True))  # warm: the server's code paths are hot
        for round_number in range(1, rounds + 1):
            for keep_alive in (False, True):
                before = cpu_seconds([child.pid])
                wall = asyncio.run(load(url, n, c, keep_alive))
                used = cpu_seconds([child.pid]) - before
                figures.append(
                    {
                        "server": server,
                        "round": round_number,
                        "connections": "kept alive" if keep_alive else "new per request",
                        "server_cpu_ms_per_request": round(1000 * used / n, 3),
                        "requests_per_s": round(n / wall),
                    }
                )
    finally:
        child.kill()
        child.wait()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=SERVERS, default="uvicorn")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the server")
    parser.add_argument("--n", type=int, default=3000, help="requests per round and connection mode")
    parser.add_argument("--c", type=int, default=8, help="requests at a time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON line per figure instead of a table")
    args = parser.parse_args()
    figures = measure(args.server, args.python, args.n, args.c, args.rounds)
    for figure in figures:
        if args.json:
            print(json.dumps(figure))
        else:
            print(
                f"{figure['server']:<8} round {figure['round']}  {figure['connections']:<16}"
                f"  server CPU {figure['server_cpu_ms_per_request']:.3f} ms/request"
                f"  {figure['requests_per_s']:>6} requests/s"
            )


if __name__ == "__main__":
    main()
