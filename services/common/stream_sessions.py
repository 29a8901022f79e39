"""One ``GenerateMany`` stream per peer, shared by every request sent there: a router's to each
worker, a frontend's to each router replica.

A request's outputs come out of :meth:`StreamSession.generate` exactly as they would from its own
``Generate`` call: in order, then the end; a refusal or a failure raises the
``grpc.aio.AioRpcError`` that call would have raised (with the ``kvmesh-origin`` mark of a
refusal), so migration, failover and error handling do not know the difference. A broken stream
fails every request on it as a transport failure (they migrate or fail over); the next request
opens a new stream. Why: docs/decisions/0021.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from kvmesh.common.backlog import Backlog
from kvmesh.common.channels import ChannelPool
from kvmesh.common.grpc_errors import call_error, error_of_end
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2_grpc, worker_pb2_grpc
from kvmesh.common.runtime import cancel_and_wait

FINISH_REASON_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


# Opens a GenerateMany call on a channel (e.g. ``lambda channel: WorkerStub(channel).GenerateMany()``).
OpenStream = Callable[[grpc.aio.Channel], grpc.aio.StreamStreamCall]


def open_worker_stream(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    return worker_pb2_grpc.WorkerStub(channel).GenerateMany()


def open_router_stream(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    return router_pb2_grpc.RouterStub(channel).GenerateMany()


class StreamSession:
    """One open ``GenerateMany`` stream. Guarantees: each request gets its items in order and ends
    once (finished, refused, failed or cancelled); a request the consumer stops reading is cancelled
    at the peer; once broken, the session takes no new request (:attr:`broken`)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, address: str) -> None:
        self.address = address
        self._call = call
        # every command ready goes in one message: one write for requests submitted together
        self._commands: Backlog[common_pb2.GenerateCommand] = Backlog()
        self._requests: dict[str, Backlog[common_pb2.StreamItem | BaseException]] = {}
        self.broken: BaseException | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self._tasks = [
            asyncio.create_task(self._write_all(), name=f"session-write-{address}"),
            asyncio.create_task(self._read_all(), name=f"session-read-{address}"),
        ]

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    async def _write_all(self) -> None:
        # one writer: grpc.aio allows a single write in flight per call
        try:
            while True:
                commands = await self._commands.take()
                await self._call.write(common_pb2.GenerateCommands(commands=commands))
        except Exception as exc:  # the call ended (AioRpcError, or InvalidStateError once cancelled)
            self._break(exc)

    async def _read_all(self) -> None:
        try:
            while True:
                batch = await self._call.read()
                if batch is grpc.aio.EOF:
                    self._break(None)
                    return
                requests = self._requests
                for item in batch.items:
                    inbox = requests.get(item.request_id)
                    if inbox is not None:
                        inbox.add(item)
        except grpc.aio.AioRpcError as exc:
            self._break(exc)

    def _break(self, cause: BaseException | None) -> None:
        if self.broken is not None:
            return
        if isinstance(cause, grpc.aio.AioRpcError):
            error = cause
        else:
            ended = f"the stream to {self.address} ended ({cause or 'closed by the peer'})"
            error = call_error(grpc.StatusCode.UNAVAILABLE, ended)
        self.broken = error
        for inbox in self._requests.values():
            inbox.add(error)

    async def generate(self, request: common_pb2.PreprocessedRequest) -> AsyncIterator[common_pb2.GenerateOutput]:
        """The request's outputs; raises ``grpc.aio.AioRpcError`` as its own ``Generate`` would.
        (A request marked ``whole_answer`` gets its first output and then one with the rest: the
        worker holds them, docs/decisions/0026.)"""
        request_id = request.request_id
        if self.broken is not None:
            raise self.broken
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already on this stream")
        # the request's items, handed over by the session's reader (all that came, per wake-up)
        inbox = self._requests[request_id] = Backlog()
        self.idle.clear()
        self._commands.add(common_pb2.GenerateCommand(submit=request))
        ended = False
        try:
            while True:
                items = await inbox.take()
                for item in items:
                    if isinstance(item, BaseException):
                        ended = True
                        raise item
                    if item.HasField("end"):
                        ended = True
                        if item.end.code:
                            raise error_of_end(item.end)
                        return
                    if item.output.finish_reason != FINISH_REASON_UNSPECIFIED:
                        # finished at the peer: a consumer that stops here has nothing to cancel
                        # (a cancel would cost a stream write per request for nothing)
                        ended = True
                    yield item.output
        finally:
            del self._requests[request_id]
            if not self._requests:
                self.idle.set()
            if not ended and self.broken is None:
                self._commands.add(common_pb2.GenerateCommand(cancel=request_id))

    async def close(self) -> None:
        self._call.cancel()
        await cancel_and_wait(*self._tasks)
        self._break(None)


class StreamSessions:
    """Sessions by peer address, opened on first use over the owner's channels and replaced
    when broken. :meth:`drop` closes a departed peer's session once its requests have ended."""

    def __init__(self, channels: ChannelPool, open_stream: OpenStream) -> None:
        self._channels = channels
        self._open_stream = open_stream
        self._sessions: dict[str, StreamSession] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, address: str) -> StreamSession:
        session = self._sessions.get(address)
        if session is None or session.broken is not None:
            if session is not None:
                self._close_later(session)
            call = self._open_stream(self._channels.get(address))
            session = self._sessions[address] = StreamSession(call, address)
        return session

    def generate(
        self, address: str, request: common_pb2.PreprocessedRequest
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        """:meth:`StreamSession.generate` on ``address``'s session (opened now if need be); the
        caller closes it, as it would close its own ``Generate`` call."""
        return self.get(address).generate(request)

    def drop(self, address: str) -> None:
        session = self._sessions.pop(address, None)
        if session is not None:
            self._close_later(session)

    def _close_later(self, session: StreamSession) -> None:
        async def close_when_idle() -> None:
            await session.idle.wait()  # its requests finish, or fail over once it is broken
            await session.close()

        task = asyncio.create_task(close_when_idle(), name=f"close-session-{session.address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        sessions = list(self._sessions.values())
        self._sessions.clear()
        await cancel_and_wait(*self._closing)
        for session in sessions:
            await session.close()
