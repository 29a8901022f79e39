"""``Worker.GenerateMany``: many requests over one stream, every ready output in one message.

Each submitted request runs exactly as its own ``Generate`` stream would (the same code, given a
context whose ``abort`` ends the request instead of the call); its outputs and its end go to one
send queue, and the stream sends whatever that queue holds as one ``GenerateBatch``. While a message is
being written the next engine step's outputs gather, so under load one message carries one step of
every request on the stream (docs/decisions/0021).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.rpc.grpc_errors import ORIGIN_KEY, RETRY_AFTER_KEY
from kvmesh.common.rpc.tasks import cancel_and_wait

log = structlog.get_logger(__name__)

GenerateOne = Callable[[common_pb2.PreprocessedRequest, object], AsyncIterator[common_pb2.GenerateOutput]]


class RequestEnded(Exception):
    """How :class:`RequestContext`'s ``abort`` ends one request of a shared stream."""

    def __init__(self, end: common_pb2.RequestEnd) -> None:
        super().__init__(end.details)
        self.end = end


class RequestContext:
    """What ``Generate`` needs of a servicer context, for one request of a shared stream: an abort
    ends that request with the status, never the stream."""

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        origin = next((value for key, value in trailing_metadata if key == ORIGIN_KEY), "")
        retry_after = next((value for key, value in trailing_metadata if key == RETRY_AFTER_KEY), "0")
        end = common_pb2.RequestEnd(
            code=code.value[0], details=details, origin=origin, retry_after_secs=int(retry_after)
        )
        raise RequestEnded(end)


def ending_of(error: Exception, request_id: str) -> common_pb2.RequestEnd:
    """How one request of a shared stream ends when serving it raised ``error``: a refusal
    (:class:`RequestContext`'s ``abort``) as given; anything else is a bug, logged (call it from the
    ``except`` block) and ended INTERNAL, so that it ends this request, not the stream."""
    if isinstance(error, RequestEnded):
        return error.end
    log.exception("request failed", request_id=request_id)
    details = f"{type(error).__name__}: {error}"
    return common_pb2.RequestEnd(code=grpc.StatusCode.INTERNAL.value[0], details=details)


class Attachments:
    """Which ``GenerateMany`` stream serves each frontend's forwards: the one it attached last,
    while that stream is open (docs/decisions/0030)."""

    def __init__(self) -> None:
        self._by_frontend: dict[str, RequestMultiplexer] = {}

    def attach(self, frontend_id: str, stream: RequestMultiplexer) -> None:
        self._by_frontend[frontend_id] = stream

    def detach(self, frontend_id: str, stream: RequestMultiplexer) -> None:
        if self._by_frontend.get(frontend_id) is stream:  # a later stream of that frontend stays
            del self._by_frontend[frontend_id]

    def stream_of(self, frontend_id: str) -> RequestMultiplexer | None:
        return self._by_frontend.get(frontend_id)


class RequestMultiplexer:
    """Serves one ``GenerateMany`` stream. Guarantees: every submitted request gets its outputs in
    order and then exactly one end item, unless the caller cancels it (or the stream) first; a
    cancelled request, or every request of a stream that ends, is aborted in the engine; once the
    caller has closed its side, the stream ends after the last of its requests' end items.

    With ``attachments`` (a worker's), a frontend may attach its stream, and a router may hand a
    request on to be served on that frontend's stream: the router's stream then hears only of a
    forward that failed, refused (no stream from that frontend) or cut short (that stream ended
    while the request ran), each as the request's end item on the router's stream."""

    def __init__(self, generate_one: GenerateOne, service: str, attachments: Attachments | None = None) -> None:
        """``generate_one``: the service's own ``Generate``; ``service``: who refuses a bad submit."""
        self._generate_one = generate_one
        self._service = service
        self._to_send: asyncio.Queue[common_pb2.StreamItem | None] = asyncio.Queue()  # None: the end
        self._running: dict[str, asyncio.Task[None]] = {}
        self._attachments = attachments
        self._attached_as: str | None = None
        # requests handed on to this stream, by the stream they came from (told if they are cut short)
        self._handed_from: dict[str, RequestMultiplexer] = {}
        self.closed = False

    async def serve(
        self, commands: AsyncIterator[common_pb2.GenerateCommands]
    ) -> AsyncIterator[common_pb2.GenerateBatch]:
        reader = asyncio.create_task(self._read(commands))
        try:
            while (first := await self._to_send.get()) is not None:
                batch, last = self._next_batch(first)
                yield batch
                if last:
                    return
        finally:
            self.closed = True
            if self._attached_as is not None:
                self._attachments.detach(self._attached_as, self)
            cut_short = [(rid, origin) for rid, origin in self._handed_from.items() if rid in self._running]
            await cancel_and_wait(reader, *self._running.values())
            for request_id, origin in cut_short:
                origin.end(request_id, grpc.StatusCode.UNAVAILABLE, "the frontend's stream here ended first", "")

    def _next_batch(self, first: common_pb2.StreamItem) -> tuple[common_pb2.GenerateBatch, bool]:
        """``first`` and everything else the send queue holds, a request's consecutive outputs merged
        into one (as ``Generate`` sends every ready token of a request in one message), so the
        router relays one message per request per batch, not one per token; and whether the
        stream ends after it."""
        items = [first]
        open_outputs = {first.request_id: first.output} if first.HasField("output") else {}
        to_send = self._to_send
        while not to_send.empty():
            item = to_send.get_nowait()
            if item is None:
                return common_pb2.GenerateBatch(items=items), True
            request_id = item.request_id
            if not item.HasField("output"):
                open_outputs.pop(request_id, None)  # nothing merges across a request's end
            else:
                output = item.output
                previous = open_outputs.get(request_id)
                if previous is not None and not previous.finish_reason and not output.disaggregated_params:
                    previous.token_ids.extend(output.token_ids)
                    previous.usage.CopyFrom(output.usage)
                    previous.finish_reason = output.finish_reason
                    continue
                open_outputs[request_id] = output
            items.append(item)
        return common_pb2.GenerateBatch(items=items), False

    async def _read(self, messages: AsyncIterator[common_pb2.GenerateCommands]) -> None:
        try:
            async for message in messages:
                for command in message.commands:
                    if command.HasField("submit"):
                        self._submit(command.submit)
                    elif command.HasField("forward"):
                        self._forward(command.forward)
                    elif command.HasField("attach"):
                        self._attach(command.attach)
                    else:
                        task = self._running.get(command.cancel)
                        if task is not None:
                            task.cancel()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            return  # the call is over: nothing more to send
        # the caller closed its side: its requests run to their ends, then the stream ends
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        self._to_send.put_nowait(None)

    def end(self, request_id: str, code: grpc.StatusCode, details: str, origin: str) -> None:
        """End ``request_id`` on this stream with ``code`` (``origin``: who refused it; empty for a
        failure), unless the stream has ended."""
        if not self.closed:
            end = common_pb2.RequestEnd(code=code.value[0], details=details, origin=origin)
            self._to_send.put_nowait(common_pb2.StreamItem(request_id=request_id, end=end))

    def _submit(self, request: common_pb2.PreprocessedRequest) -> bool:
        request_id = request.request_id
        if not request_id or request_id in self._running:
            reason = "request_id is required" if not request_id else f"request {request_id!r} is already running here"
            self.end(request_id, grpc.StatusCode.INVALID_ARGUMENT, reason, self._service)
            return False
        self._running[request_id] = asyncio.create_task(self._run(request), name=f"generate-{request_id}")
        return True

    def _attach(self, frontend_id: str) -> None:
        if self._attachments is not None and frontend_id and not self.closed:
            if self._attached_as is not None:
                self._attachments.detach(self._attached_as, self)
            self._attachments.attach(frontend_id, self)
            self._attached_as = frontend_id

    def _forward(self, forward: common_pb2.Forward) -> None:
        request = forward.request
        target = self._attachments.stream_of(forward.frontend_id) if self._attachments is not None else None
        if target is None or target.closed:
            details = f"no stream from frontend {forward.frontend_id!r} is attached here"
            self.end(request.request_id, grpc.StatusCode.FAILED_PRECONDITION, details, self._service)
            return
        target.take_forward(request, self)

    def take_forward(self, request: common_pb2.PreprocessedRequest, origin: RequestMultiplexer) -> None:
        """Serve ``request``, handed on from the stream ``origin``, as if submitted here; ``origin``
        is told if this stream ends before the request does."""
        if self._submit(request):
            self._handed_from[request.request_id] = origin

    async def _run(self, request: common_pb2.PreprocessedRequest) -> None:
        request_id = request.request_id
        put = self._to_send.put_nowait
        end = common_pb2.RequestEnd()
        try:
            async with contextlib.aclosing(self._generate_one(request, RequestContext())) as outputs:
                async for output in outputs:
                    put(common_pb2.StreamItem(request_id=request_id, output=output))
        except asyncio.CancelledError:
            return  # the caller cancelled it: it expects nothing more (Generate's cleanup has run)
        except Exception as exc:  # a refusal or a bug ends this request, not the stream and its other requests
            end = ending_of(exc, request_id)
        finally:
            self._running.pop(request_id, None)
            self._handed_from.pop(request_id, None)
        put(common_pb2.StreamItem(request_id=request_id, end=end))
