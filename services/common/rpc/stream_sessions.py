"""One ``Worker.GenerateMany`` stream per worker, shared by every request sent there: a router's
(which carries its forwards) and a caller's (a frontend's, where the requests handed on to it are
served).

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

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.rpc.batch_queue import BatchQueue
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_errors import call_error, error_of_end
from kvmesh.common.rpc.message_builder import MessageBuilder
from kvmesh.common.rpc.tasks import cancel_and_wait

FINISH_REASON_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


# Opens a GenerateMany call on a channel (e.g. ``lambda channel: WorkerStub(channel).GenerateMany()``).
OpenStream = Callable[[grpc.aio.Channel], grpc.aio.StreamStreamCall]


def open_worker_stream(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    return worker_pb2_grpc.WorkerStub(channel).GenerateMany()


Inbox = BatchQueue[common_pb2.StreamItem | BaseException]


class ForwardExpectation:
    """A request that a router may hand on to a worker for this frontend (docs/decisions/0030).
    :attr:`decided` resolves with the session that the request's first item came in on, unless
    the caller decides first (the router answered): whichever comes first wins."""

    __slots__ = ("decided", "inbox", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.inbox: Inbox = BatchQueue()
        self.decided: asyncio.Future[StreamSession | None] = asyncio.get_running_loop().create_future()


class ForwardTable:
    """The requests this frontend expects to be handed on, shared by its sessions to the workers:
    a session that reads an item for a request it was not given claims it here."""

    def __init__(self) -> None:
        self._expected: dict[str, ForwardExpectation] = {}

    def expect(self, request_id: str) -> ForwardExpectation:
        expectation = self._expected[request_id] = ForwardExpectation(request_id)
        return expectation

    def forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)

    def claim(self, request_id: str, session: StreamSession) -> Inbox | None:
        expectation = self._expected.pop(request_id, None)
        if expectation is None or expectation.decided.done():
            return None
        expectation.decided.set_result(session)
        return expectation.inbox

    def __len__(self) -> int:
        return len(self._expected)


class StreamSession:
    """One open ``GenerateMany`` stream. Guarantees: each request gets its items in order and ends
    once (finished, refused, failed or cancelled); a request the consumer stops reading is cancelled
    at the peer; once broken, the session takes no new request (:attr:`broken`).

    Forwards (docs/decisions/0030): a frontend's session ``attach``es its stream and claims, from
    ``expected``, the requests that routers hand on to it; an output for a request that no one here
    waits for is cancelled at the peer. A router's session sends forwards (:meth:`forward`) and
    hears back only of those that failed."""

    def __init__(
        self,
        call: grpc.aio.StreamStreamCall,
        address: str,
        expected: ForwardTable | None = None,
        attach_as: str | None = None,
    ) -> None:
        self.address = address
        self._call = call
        # every command ready goes in one message: one write for requests submitted together
        self._commands: MessageBuilder[common_pb2.GenerateCommands] = MessageBuilder(
            common_pb2.GenerateCommands, "commands"
        )
        if attach_as:
            self._commands.add().attach = attach_as
        self._requests: dict[str, Inbox] = {}
        self._expected = expected
        self._handed_on: dict[str, asyncio.Future[common_pb2.RequestEnd]] = {}
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
                await self._call.write(await self._commands.take())
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
                    if inbox is None:
                        inbox = self._unexpected(item)
                        if inbox is None:
                            continue
                    inbox.add(item)
        except grpc.aio.AioRpcError as exc:
            self._break(exc)

    def _unexpected(self, item: common_pb2.StreamItem) -> Inbox | None:
        """Where an item for a request not submitted on this session goes: a forward's failure to
        the router that sent it, a handed-on request's first item to the frontend's expectation
        (the request is this session's from then on); None to drop it. The end item of a finished
        request comes this way too, and is dropped."""
        request_id = item.request_id
        failed = self._handed_on.pop(request_id, None)
        if failed is not None:
            if not failed.done():
                failed.set_result(item.end)
            return None
        if self._expected is None:
            return None
        inbox = self._expected.claim(request_id, self)
        if inbox is not None:
            self._requests[request_id] = inbox
            self.idle.clear()
            return inbox
        if item.HasField("output") and not item.output.finish_reason:
            # handed on after its asker gave up on it (or to a frontend that never asked): stop it
            self._commands.add().cancel = request_id
        return None

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
        for failed in self._handed_on.values():
            if not failed.done():
                failed.set_exception(error)
        self._handed_on.clear()

    async def generate(
        self, request: common_pb2.PreprocessedRequest, claimed: Inbox | None = None
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        """The request's outputs; raises ``grpc.aio.AioRpcError`` as its own ``Generate`` would.
        (A request marked ``whole_answer`` gets its first output and then one with the rest: the
        worker holds them, docs/decisions/0026.) ``claimed``: the request was handed on to this
        session and claimed (its items gather there): only read it."""
        request_id = request.request_id
        if claimed is not None:
            inbox = claimed
        else:
            if self.broken is not None:
                raise self.broken
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already on this stream")
            # the request's items, handed over by the session's reader (all that came, per wake-up)
            inbox = self._requests[request_id] = BatchQueue()
            self.idle.clear()
            self._commands.add().submit.CopyFrom(request)
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
            if ended:
                self._forget(request_id)
            else:
                self.abandon(request_id)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if not self._requests:
            self.idle.set()

    def abandon(self, request_id: str) -> None:
        """Stop reading ``request_id`` here and cancel it at the peer."""
        self._forget(request_id)
        if self.broken is None:
            self._commands.add().cancel = request_id

    def forward(
        self, request: common_pb2.PreprocessedRequest, frontend_id: str
    ) -> asyncio.Future[common_pb2.RequestEnd]:
        """Send ``request`` to the peer, to be served on the stream ``frontend_id`` attached there.
        The future resolves with the end item the peer sends back if the forward fails (refused:
        no such stream; cut short: that stream ended first), or fails with this session's break;
        :meth:`settle` it once the request is known to run (its first token was reported)."""
        if self.broken is not None:
            raise self.broken
        failed: asyncio.Future[common_pb2.RequestEnd] = asyncio.get_running_loop().create_future()
        self._handed_on[request.request_id] = failed
        forward = self._commands.add().forward
        forward.frontend_id = frontend_id
        forward.request.CopyFrom(request)
        return failed

    def settle(self, request_id: str) -> None:
        """The forward of ``request_id`` runs, or no longer matters: stop watching for its failure."""
        self._handed_on.pop(request_id, None)

    async def close(self) -> None:
        self._call.cancel()
        await cancel_and_wait(*self._tasks)
        self._break(None)


class StreamSessions:
    """Sessions by peer address, opened on first use over the owner's channels and replaced
    when broken. :meth:`drop` closes a departed peer's session once its requests have ended."""

    def __init__(
        self,
        channels: ChannelPool,
        open_stream: OpenStream,
        expected: ForwardTable | None = None,
        attach_as: str | None = None,
    ) -> None:
        """``expected`` and ``attach_as``: a frontend's sessions that take forwards (each stream is
        attached as ``attach_as`` and claims requests from ``expected``)."""
        self._channels = channels
        self._open_stream = open_stream
        self._expected = expected
        self._attach_as = attach_as
        self._sessions: dict[str, StreamSession] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, address: str) -> StreamSession:
        session = self._sessions.get(address)
        if session is None or session.broken is not None:
            if session is not None:
                self._close_later(session)
            call = self._open_stream(self._channels.get(address))
            session = self._sessions[address] = StreamSession(call, address, self._expected, self._attach_as)
        return session

    def open_session(self, address: str) -> StreamSession | None:
        """``address``'s session if it is open (none is opened)."""
        session = self._sessions.get(address)
        return session if session is not None and session.broken is None else None

    def cancel_everywhere(self, request_id: str) -> None:
        """Cancel ``request_id`` on every open session: a forward whose worker is not known may be
        running on any of them (a peer that does not hold it ignores the cancel)."""
        for session in self._sessions.values():
            session.abandon(request_id)  # a broken one sends nothing

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
