"""kvmesh's layout with no work in it: its processes and messages per request, and nothing else.

kvmesh's shape fixes how many processes a request crosses and how many messages it needs: the HTTP
request into a frontend; a route query to a router, which asks an indexer for the prompt's overlap
before it answers; the request to the chosen worker and its answer; and the completion the router
must learn of to keep its load view. This module runs exactly that pattern and nothing else:

- the same stack: uvicorn (httptools, uvloop) in the frontend, ``grpc.aio`` between processes, one
  bidirectional stream per pair of processes (as kvmesh multiplexes), every message a msgpack batch
  of what the sender had ready in one turn of its event loop (as kvmesh coalesces);
- no work: no request validation, tokenizer, block hashing, index, routing policy, load tracking,
  engine, detokeniser, metrics or logs. The worker answers at once with one message, where kvmesh's
  sends the first output and the last. The frontend alternates the two workers.

Its requests per second, latency and CPU per request are what kvmesh's layout costs on this machine
before kvmesh does anything, so the difference to kvmesh is kvmesh's own work, and the difference to
a peer is what the layout itself costs.

``--engine mock`` puts one piece of work back: each worker runs kvmesh's own mock engine
(``MockEngineLoop`` with a worker's default shape and ``--speedup``) on the prompt's bytes as
tokens and answers when the engine has produced ``max_tokens`` tokens; it publishes no KV events.
Against a peer that runs mock engines too (Dynamo's mockers), that is the layout with the engines'
time and CPU in it: the most any kvmesh could reach on this machine, since kvmesh must still
tokenise, hash, index, route and track load on top.

``--pattern forward`` changes the messages, not the work: the router sends the request on to the
worker it chose, and the worker answers the frontend on the stream the frontend opened to it, so a
request crosses five hops between processes (frontend, router, indexer, router, worker, frontend)
instead of six (the route answer back to the frontend and its call to the worker become the
router's one message to the worker). Five is the fewest this shape allows, since the router must
hear the indexer before it chooses; so ``layout-engine-forward`` is the ceiling of any message
pattern of kvmesh's shape, not only of the one kvmesh uses. ``--pattern forward-answered`` is the
same with the router also answering the frontend's route query (which worker), as a frontend that
must cancel, fail over or migrate a request before its first output needs: the critical path keeps
five hops, the route answer costs the router a write and the frontend a read.

``--pattern forward-local`` is the ``forward`` pattern with a router that does not ask the indexer:
it chooses from what it holds itself, as a router reading its own in-process replica of the index
would (the indexer still runs, idle). A request then crosses three hops (frontend, router, worker,
frontend). That is outside kvmesh's fixed shape, where indexer replicas answer the router's overlap
queries; ``layout-engine-local`` measures what that change of shape would be worth, before any of it
is built (docs/decisions/0019). Keeping such a replica costs the router the KV events' work, which
no layout counts.

``python -m bench.peers --systems layout layout-engine kvmesh dynamo`` runs them beside the peers;
by hand::

    python -m bench.bare_layout --port 8000 [--engine mock] [--pattern forward|forward-answered|forward-local]
    # then POST /v1/chat/completions
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
import msgpack
import numpy as np
import uvicorn
import uvloop

from bench.processes import start_in_session, stop_sessions
from kvmesh.common.hashing import token_array
from kvmesh.common.ports import free_port
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine import EngineFailure, EngineRequestError, EngineRequestSpec
from kvmesh.worker.engine_loop import MockEngineLoop
from kvmesh.worker.server import build_mock_engine

SERVICE, RPC = "bare.Hop", "Exchange"
METHOD = f"/{SERVICE}/{RPC}"
_RUNNING: set[asyncio.Task[Any]] = set()  # the loop keeps only weak references to its tasks
ROLES = ("indexer", "worker", "router", "frontend")
ENGINES = ("none", "mock")
# the router answers the frontend / sends the request on to the worker / both / sends it on unasked of the indexer
PATTERNS = ("reply", "forward", "forward-answered", "forward-local")
CREATED = int(time.time())
# the kinds of a frontend's items to the router; only a route is answered
ROUTE, DONE, FORWARD, FORWARD_LOCAL = 0, 1, 2, 3
GENERATE, HELLO, FORWARDED = 0, 1, 2  # the kinds of a worker's items: a request, the frontend's reply stream
INDEXER_ANSWER = msgpack.packb([[0, 64], [1, 0]])  # an overlap per worker, the size of kvmesh's
WORKER_OUTPUT = msgpack.packb({"token_ids": list(range(8)), "finish_reason": "length", "ttft_ms": 1.0})


def spawn(coroutine: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(coroutine)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)


class BatchWriter:
    """Writes items as msgpack batches: everything sent while a write is in flight goes in the next
    one, so a busy sender writes one message per turn however many requests it serves."""

    def __init__(self, write: Callable[[bytes], Awaitable[Any]]) -> None:
        self._write = write
        self._pending: list[Any] = []
        self._flushing = False

    def send(self, item: Any) -> None:
        self._pending.append(item)
        if not self._flushing:
            self._flushing = True
            spawn(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                await self._write(msgpack.packb(batch))
        finally:
            self._flushing = False


class Inbox:
    """Where answers wait for their request id, shared by the streams an answer may come on."""

    def __init__(self) -> None:
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count()

    def expect(self) -> tuple[int, asyncio.Future[Any]]:
        request_id = next(self.ids)
        answer = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = answer
        return request_id, answer


class Peer:
    """The client end of one stream: ``ask`` returns the answer to an item, ``tell`` expects none."""

    def __init__(self, address: str, inbox: Inbox | None = None) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._call = self._channel.stream_stream(METHOD)(wait_for_ready=True)  # its server may still be starting
        self._writer = BatchWriter(self._call.write)
        # answers may also come for requests asked elsewhere (forwarded by the router): one inbox for all
        self._inbox = inbox or Inbox()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def ask(self, *item: Any) -> asyncio.Future[Any]:
        request_id, answer = self._inbox.expect()
        self._writer.send([request_id, *item])
        return answer

    def tell(self, *item: Any) -> None:
        self._writer.send([-1, *item])

    async def _read(self) -> None:
        async for message in self._call:
            for request_id, payload in msgpack.unpackb(message):
                self._inbox.waiting.pop(request_id).set_result(payload)


async def serve(role: str, port: int, handle: Callable[[list[Any], BatchWriter], None]) -> None:
    """A gRPC server whose streams pass each incoming batch to ``handle`` with the stream's writer."""

    async def exchange(requests: Any, context: grpc.aio.ServicerContext) -> None:
        writer = BatchWriter(context.write)
        async for message in requests:
            handle(msgpack.unpackb(message), writer)

    handler = grpc.stream_stream_rpc_method_handler(exchange)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {RPC: handler})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"{role} ready on {port}", flush=True)
    await server.wait_for_termination()


class WorkerItems:
    """A worker's side of every pattern: requests come from the frontend (``GENERATE``, answered on
    the same stream) or from the router (``FORWARDED``, answered on the stream the frontend opened
    with ``HELLO``); ``answer(request_id, prompt, max_tokens, writer)`` answers each."""

    def __init__(self, answer: Callable[[int, bytes, int, BatchWriter], None]) -> None:
        self._answer = answer
        self._frontend: BatchWriter | None = None
        self._early: list[list[Any]] = []  # forwarded before the frontend's stream said hello

    def handle(self, batch: list[Any], writer: BatchWriter) -> None:
        for request_id, kind, *args in batch:
            if kind == GENERATE:
                self._answer(request_id, *args, writer)
            elif kind == HELLO:
                self._frontend = writer
                early, self._early = self._early, []
                for forwarded in early:
                    self._answer(*forwarded, writer)
            elif self._frontend is None:
                self._early.append(args)
            else:
                self._answer(*args, self._frontend)


def answer_at_once(request_id: int, prompt: bytes, max_tokens: int, writer: BatchWriter) -> None:
    writer.send([request_id, WORKER_OUTPUT])


def answer_indexer(batch: list[Any], writer: BatchWriter) -> None:
    for request_id, *_ in batch:
        writer.send([request_id, INDEXER_ANSWER])


async def run_engine_worker(port: int, speedup: float) -> None:
    """A worker whose answer waits for kvmesh's mock engine to generate it (``--engine mock``): the
    engine a ``kvmesh worker --speedup-ratio`` builds with its default shape."""
    loop = MockEngineLoop(build_mock_engine(WorkerConfig(speedup_ratio=speedup)), publisher=None)
    await loop.start()
    names = itertools.count()

    async def generate(request_id: int, prompt: bytes, max_tokens: int, writer: BatchWriter) -> None:
        tokens = token_array(np.frombuffer(prompt, dtype=np.uint8))  # the bytes as tokens, as a byte-level model's
        spec = EngineRequestSpec(f"r{next(names)}", tokens, max_tokens=max_tokens, ignore_eos=True)
        generated: list[int] = []
        finish = "length"
        try:
            outputs = loop.submit(spec)
        except EngineRequestError:  # an empty prompt, say: answered, with nothing, not left hanging
            finish = "error"
        else:
            while True:
                output = await outputs.get()
                if isinstance(output, EngineFailure):
                    finish = "error"
                    break
                if output.token_id is not None:
                    generated.append(output.token_id)
                if output.finish_reason is not None:
                    break
        answer = {"token_ids": generated, "finish_reason": finish, "ttft_ms": 1.0}
        writer.send([request_id, msgpack.packb(answer)])

    def answer(request_id: int, prompt: bytes, max_tokens: int, writer: BatchWriter) -> None:
        spawn(generate(request_id, prompt, max_tokens, writer))

    await serve("worker", port, WorkerItems(answer).handle)


async def run_router(port: int, indexer_port: int, worker_ports: list[int]) -> None:
    indexer = Peer(f"127.0.0.1:{indexer_port}")
    workers = [Peer(f"127.0.0.1:{p}") for p in worker_ports]
    choices = itertools.cycle((0, 1))

    async def choose(prompt: bytes) -> int:
        overlaps = msgpack.unpackb(await indexer.ask(prompt))
        return next(choices) if overlaps else 0

    async def route(request_id: int, prompt: bytes, writer: BatchWriter) -> None:
        writer.send([request_id, await choose(prompt)])

    async def forward(
        request_id: int, writer: BatchWriter, frontend_request_id: int, prompt: bytes, max_tokens: int
    ) -> None:
        worker = await choose(prompt)
        workers[worker].tell(FORWARDED, frontend_request_id, prompt, max_tokens)
        if request_id >= 0:  # asked, not told: the frontend wants to know where it went
            writer.send([request_id, worker])

    def handle(batch: list[Any], writer: BatchWriter) -> None:
        for request_id, kind, payload in batch:
            if kind == ROUTE:
                spawn(route(request_id, payload, writer))
            elif kind == FORWARD:
                spawn(forward(request_id, writer, *payload))
            elif kind == FORWARD_LOCAL:  # chosen from the router's own copy of the index: free here, as all work is
                workers[next(choices)].tell(FORWARDED, *payload)

    await serve("router", port, handle)


def chat_app(router_port: int, worker_ports: list[int], pattern: str = "reply") -> Callable[..., Awaitable[None]]:
    """A bare ASGI app: POST any path with a chat body, get a chat completion of eight tokens."""
    peers: dict[str, Any] = {}
    inbox = Inbox()

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await receive()  # startup: the streams need the server's event loop
            peers["router"] = Peer(f"127.0.0.1:{router_port}")
            peers["workers"] = [Peer(f"127.0.0.1:{p}", inbox) for p in worker_ports]
            for worker in peers["workers"]:
                worker.tell(HELLO)  # the stream a forwarded request's answer comes back on
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        prompt = "".join(m.get("content", "") for m in request.get("messages", [])).encode()
        max_tokens = request.get("max_tokens") or 8
        if pattern in ("forward", "forward-local"):
            request_id, answered = inbox.expect()
            kind = FORWARD if pattern == "forward" else FORWARD_LOCAL
            peers["router"].tell(kind, [request_id, prompt, max_tokens])
        elif pattern == "forward-answered":
            request_id, answered = inbox.expect()
            await peers["router"].ask(FORWARD, [request_id, prompt, max_tokens])  # the worker it went to
        else:
            worker = await peers["router"].ask(ROUTE, prompt)
            answered = peers["workers"][worker].ask(GENERATE, prompt, max_tokens)
        output = msgpack.unpackb(await answered)
        peers["router"].tell(DONE, b"")
        answer = json.dumps(
            {
                "id": "chatcmpl-floor",
                "object": "chat.completion",
                "created": CREATED,
                "model": request.get("model", "tiny"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "x" * len(output["token_ids"])},
                        "finish_reason": output["finish_reason"],
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(output["token_ids"]),
                    "total_tokens": len(prompt) + len(output["token_ids"]),
                },
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    return app


def run_role(args: argparse.Namespace) -> None:
    if args.role == "frontend":
        app = chat_app(args.router_port, args.worker_ports, args.pattern)
        uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", log_level="warning")
        return
    uvloop.install()
    if args.role == "router":
        asyncio.run(run_router(args.port, args.indexer_port, args.worker_ports))
    elif args.role == "worker" and args.engine == "mock":
        asyncio.run(run_engine_worker(args.port, args.speedup))
    elif args.role == "worker":
        asyncio.run(serve(args.role, args.port, WorkerItems(answer_at_once).handle))
    else:
        asyncio.run(serve(args.role, args.port, answer_indexer))


def start_all(
    http_port: int, engine: str = "none", speedup: float = 100.0, pattern: str = "reply"
) -> list[subprocess.Popen[bytes]]:
    """The five processes (indexer, two workers, router, frontend), each in its own session; with
    ``engine`` ``mock`` the workers run kvmesh's mock engine sped up ``speedup`` times; ``pattern``
    ``forward``: the router sends each request on to its worker (``forward-local``: without asking
    the indexer first)."""
    indexer, router = free_port(), free_port()
    workers = [free_port(), free_port()]
    module = [sys.executable, "-m", "bench.bare_layout"]
    argvs = [[*module, "--role", "indexer", "--port", str(indexer)]]
    engine_args = ["--engine", engine, "--speedup", str(speedup)]
    argvs += [[*module, "--role", "worker", "--port", str(p), *engine_args] for p in workers]
    worker_ports = ["--worker-ports", *map(str, workers)]
    argvs.append([*module, "--role", "router", "--port", str(router), "--indexer-port", str(indexer), *worker_ports])
    frontend = [*module, "--role", "frontend", "--port", str(http_port), "--router-port", str(router)]
    argvs.append([*frontend, *worker_ports, "--pattern", pattern])
    return [start_in_session(argv) for argv in argvs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="the frontend's HTTP port (with --role: this role's)")
    parser.add_argument("--role", choices=ROLES, help="run one process of the floor (what the parent starts)")
    parser.add_argument("--router-port", type=int)
    parser.add_argument("--indexer-port", type=int)
    parser.add_argument("--worker-ports", type=int, nargs=2)
    parser.add_argument(
        "--engine", choices=ENGINES, default="none", help="none: workers answer at once; mock: kvmesh's mock engine"
    )
    parser.add_argument("--speedup", type=float, default=100.0, help="the mock engine's speed-up (with --engine mock)")
    parser.add_argument(
        "--pattern",
        choices=PATTERNS,
        default="reply",
        help="reply: the router answers the frontend, which calls the worker (kvmesh's messages); "
        "forward: the router sends the request on to the worker, which answers the frontend; "
        "forward-answered: the same, and the router also tells the frontend which worker; "
        "forward-local: forward with a router that does not ask the indexer (outside kvmesh's shape)",
    )
    args = parser.parse_args()
    if args.role:
        run_role(args)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the children on a plain kill too
    processes = start_all(args.port, args.engine, args.speedup, args.pattern)
    try:
        processes[-1].wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_sessions(processes)


if __name__ == "__main__":
    main()
