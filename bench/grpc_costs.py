"""What one gRPC operation costs the caller in ``grpc.aio`` (uvloop, as the services run), CPU and wall.

A server process answers three generic methods (raw bytes, no protobuf): a client-streaming call
that only reads, a unary call, and a bidirectional stream that answers each message. The client,
in this process, times ``--n`` of each in a row with a ``--size``-byte message: a stream write, a
unary call, and a stream write plus the read of its answer. These are the prices behind kvmesh's
choice of long-lived streams over unary calls on the request path (docs/decisions/0024). Both
processes choose gRPC core's I/O layer as the services do (``KVMESH_GRPC_IO``, default iomgr:
docs/decisions/0025). For scale, the same write and answer over a plain asyncio stream (uvloop,
4-byte length prefix, no HTTP/2): what a transport that completes on the event loop's own thread,
without grpc.aio's poller thread, would cost (docs/decisions/0019).

``--option NAME=VALUE`` (repeatable) gives the server and the channel a gRPC channel argument, to
price one before the services take it (``--option grpc.minimal_stack=1``, decision 19).

    [KVMESH_GRPC_IO=event-engine] python -m bench.grpc_costs [--n 5000 --size 1200 --option NAME=VALUE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from kvmesh.common.grpc_io import GRPC_EXPERIMENTS_ENV, choose_grpc_io

choose_grpc_io()  # before gRPC loads, as the kvmesh command does; the server process inherits it

import grpc  # noqa: E402
import uvloop  # noqa: E402

from kvmesh.common.ports import free_port  # noqa: E402

FRAME = struct.Struct("<I")  # the plain stream's length prefix


def serve(
    port: int, plain_port: int, ready: multiprocessing.synchronize.Event, options: list[tuple[str, int | str]]
) -> None:
    async def read_only(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        async for _ in messages:
            pass
        return b""

    async def unary(message: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"x"

    async def answer_each(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for _ in messages:
            yield b"y" * 200

    async def answer_each_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = FRAME.pack(200) + b"y" * 200
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                await reader.readexactly(size)
                writer.write(answer)

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            "bench.Costs",
            {
                "ReadOnly": grpc.stream_unary_rpc_method_handler(read_only),
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "AnswerEach": grpc.stream_stream_rpc_method_handler(answer_each),
            },
        )
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await asyncio.start_server(answer_each_frame, "127.0.0.1", plain_port)
        ready.set()
        await server.wait_for_termination()

    uvloop.run(main())


async def timed(label: str, n: int, operation: Callable[[], Awaitable[object]]) -> None:
    await operation()  # warm: the call is open and the connection settled
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        await operation()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"{label:<28} {1e6 * cpu / n:8.1f} µs CPU {1e6 * wall / n:8.1f} µs wall")


async def measure(port: int, plain_port: int, n: int, size: int, options: list[tuple[str, int | str]]) -> None:
    message = b"z" * size
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        await channel.channel_ready()
        writes = channel.stream_unary("/bench.Costs/ReadOnly")()
        await timed("stream write", n, lambda: writes.write(message))
        await writes.done_writing()
        await writes
        unary = channel.unary_unary("/bench.Costs/Unary")
        await timed("unary call", n, lambda: unary(message))
        both = channel.stream_stream("/bench.Costs/AnswerEach")()

        async def write_and_read() -> object:
            await both.write(message)
            return await both.read()

        await timed("stream write + its answer", n, write_and_read)
        both.cancel()
    reader, writer = await asyncio.open_connection("127.0.0.1", plain_port)
    writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    frame = FRAME.pack(size) + message

    async def plain_write_and_read() -> object:
        writer.write(frame)
        (answer_size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        return await reader.readexactly(answer_size)

    await timed("plain asyncio write + answer", n, plain_write_and_read)
    writer.close()


def channel_option(text: str) -> tuple[str, int | str]:
    """``NAME=VALUE`` as gRPC takes a channel argument: an integer where the value is one."""
    name, separator, value = text.partition("=")
    if not separator or not name:
        raise SystemExit(f"--option takes NAME=VALUE, not {text!r}")
    try:
        return name, int(value)
    except ValueError:
        return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="operations of each kind")
    parser.add_argument("--size", type=int, default=1200, help="bytes per message sent")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a gRPC channel argument for the server and the channel (repeatable; integers stay integers)",
    )
    args = parser.parse_args()
    options = [channel_option(text) for text in args.option]
    port, plain_port = free_port(), free_port()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=serve, args=(port, plain_port, ready, options), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the bench's gRPC server did not start")
        experiments = os.environ.get(GRPC_EXPERIMENTS_ENV, "gRPC's defaults")
        print(f"client-side cost per operation, {args.n} each, {args.size}-byte messages (grpc {grpc.__version__})")
        print(f"{GRPC_EXPERIMENTS_ENV}: {experiments}")
        if options:
            print("channel arguments: " + ", ".join(f"{name}={value}" for name, value in options))
        uvloop.run(measure(port, plain_port, args.n, args.size, options))
    finally:
        server.kill()
        server.join()


if __name__ == "__main__":
    main()
