"""Request/answer calls over one long-lived stream per peer instead of a unary call each.

In grpc.aio a unary call costs its caller about five times the CPU of a stream message (measured
by ``bench/grpc_costs.py``, now in git history; decision 19 records it), so the calls a service
makes for every request (the router's indexer queries, the frontend's ``Route``) ride a
bidirectional stream: each query carries an id,
each answer echoes it, and queries asked while a write is in flight go together in the next
message. Why and what it saves: docs/decisions/0024.

The stream's messages follow one shape, whatever the query: the caller sends a message with
``repeated ... queries``, each ``{query_id, request}``; the peer answers with ``repeated ...
answers``, each ``{query_id, response}`` or, for a query it will not answer, a refusal that
:attr:`QueryKind.response_of` turns into the exception the unary call would have raised.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.message_builder import MessageBuilder
from kvmesh.common.rpc.tasks import cancel_and_wait

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")


class QueryStreamBroken(ConnectionError):
    """The stream a query was asked on ended before its answer came."""


@dataclass(frozen=True)
class QueryKind(Generic[RequestT, ResponseT]):
    """One kind of query stream: how to open it and how its messages are made and read."""

    open: Callable[[grpc.aio.Channel], grpc.aio.StreamStreamCall]
    queries: Callable[[], Any]  # the caller's message type, whose ``queries`` are {query_id, request}
    response_of: Callable[[Any], ResponseT]  # an answer's response, or raise its refusal
    # for a stream that also carries reports (messages that need no answer): puts them in a message
    attach_reports: Callable[[Any, list[Any]], None] | None = None


# A report waits this long for a query to ride with before it is sent alone: the peer learns it that
# much later, which is small beside a request's life, and one message carries many reports.
REPORTS_WINDOW_S = 0.002


class QueryStream(Generic[RequestT, ResponseT]):
    """One stream of queries to one peer. Guarantees: every query asked gets its answer, its
    refusal, or :class:`QueryStreamBroken` once the stream ends (at once, not at its deadline);
    once broken it takes no new query (:attr:`broken`). One writer (grpc.aio allows one write in
    flight per call) sends everything asked meanwhile as one message."""

    def __init__(self, kind: QueryKind[RequestT, ResponseT], channel: grpc.aio.Channel, address: str) -> None:
        self.address = address
        self._kind = kind
        self._call = kind.open(channel)
        self._last_id = 0
        self._waiting: dict[int, asyncio.Future[ResponseT]] = {}
        self._unsent: MessageBuilder[Any] = MessageBuilder(kind.queries, "queries")
        self._reports: list[Any] = []
        self._reports_due: asyncio.TimerHandle | None = None
        self._closing = False
        self._reported = False  # a report went out: closing then waits for the peer to read it
        self.broken: QueryStreamBroken | None = None
        self._tasks = [
            asyncio.create_task(self._write_all(), name=f"queries-write-{address}"),
            asyncio.create_task(self._read_all(), name=f"queries-read-{address}"),
        ]

    def ask(self, request: RequestT) -> asyncio.Future[ResponseT]:
        """The answer's future. Cancelling it (a deadline, a caller that left) only means the
        answer is dropped when it comes."""
        if self.broken is not None:
            raise self.broken
        self._last_id += 1
        query_id = self._last_id
        answer: asyncio.Future[ResponseT] = asyncio.get_running_loop().create_future()
        self._waiting[query_id] = answer
        answer.add_done_callback(lambda done: self._forget_cancelled(query_id, done))
        query = self._unsent.add()
        query.query_id = query_id
        query.request.CopyFrom(request)  # in place: see MessageBuilder
        return answer

    def tell(self, report: Any) -> None:
        """Send ``report`` with the next message: with the next query, or alone once
        :data:`REPORTS_WINDOW_S` has passed. Reports are sent in the order told; on a broken stream
        they are dropped (the peer is gone, or lost what it was told anyway)."""
        if self.broken is not None:
            return
        self._reports.append(report)
        if self._reports_due is None:
            self._reports_due = asyncio.get_running_loop().call_later(REPORTS_WINDOW_S, self._unsent.wake)

    def _forget_cancelled(self, query_id: int, answer: asyncio.Future[ResponseT]) -> None:
        # a peer that never answers must not make the waiting table grow with every query given up
        if answer.cancelled():
            self._waiting.pop(query_id, None)

    async def _write_all(self) -> None:
        try:
            while not (self._closing and not self._reports):
                message = await self._unsent.take()
                reports, self._reports = self._reports, []
                if self._reports_due is not None:
                    self._reports_due.cancel()
                    self._reports_due = None
                if not message.queries and not reports:
                    continue  # the window's reports already rode with a query
                if reports and self._kind.attach_reports is not None:
                    self._kind.attach_reports(message, reports)
                    self._reported = True
                await self._call.write(message)
        except Exception as exc:  # the call ended (AioRpcError, or InvalidStateError once cancelled)
            self._break(exc)

    async def _read_all(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    self._break(None)
                    return
                for answer in message.answers:
                    waiting = self._waiting.pop(answer.query_id, None)
                    if waiting is None or waiting.done():
                        continue  # its asker gave up
                    try:
                        waiting.set_result(self._kind.response_of(answer))
                    except Exception as refusal:
                        waiting.set_exception(refusal)
        except grpc.aio.AioRpcError as exc:
            self._break(exc)

    def _break(self, cause: BaseException | None) -> None:
        if self.broken is not None:
            return
        if isinstance(cause, grpc.aio.AioRpcError):
            cause_text = f"{cause.code().name}: {cause.details()}"
        else:
            cause_text = str(cause or "closed by the peer")
        self.broken = QueryStreamBroken(f"the query stream to {self.address} ended ({cause_text})")
        self._fail_waiting(self.broken)

    def _fail_waiting(self, error: QueryStreamBroken) -> None:
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(error)
        self._waiting.clear()

    async def close(self, reports_grace_s: float = 1.0) -> None:
        """End the stream. A stream that carries reports gets up to ``reports_grace_s`` for them to
        reach the peer: the writer sends what it holds (cancelling a write in flight would cut the
        call), then the stream is half-closed and ends when the peer has read everything. Cancelling
        the call as soon as the last write went out would drop it: the peer discards a message it
        had not yet read when the cancel came (it lost a frontend's last end report under load, and
        the router then counted that request until ``--request-timeout-secs``)."""
        # queries still waiting fail now, not after the grace: their askers fail over at once
        self._fail_waiting(QueryStreamBroken(f"the query stream to {self.address} was closed"))
        if self.broken is None and (self._reports or self._reported):
            self._closing = True
            self._unsent.wake()
            with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                async with asyncio.timeout(reports_grace_s):
                    await asyncio.shield(self._tasks[0])
                    if self.broken is None:
                        await self._call.done_writing()
                        await asyncio.shield(self._tasks[1])  # the peer's end of the call
        if self._reports_due is not None:
            self._reports_due.cancel()
        self._call.cancel()
        await cancel_and_wait(*self._tasks)
        self._break(None)


class QueryStreams(Generic[RequestT, ResponseT]):
    """Query streams by peer address over the owner's channels: opened on first use, replaced
    once broken, closed by :meth:`forget` when the peer leaves."""

    def __init__(self, kind: QueryKind[RequestT, ResponseT], channels: ChannelPool) -> None:
        self._kind = kind
        self._channels = channels
        self._streams: dict[str, QueryStream[RequestT, ResponseT]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def ask(self, address: str, request: RequestT) -> asyncio.Future[ResponseT]:
        """:meth:`QueryStream.ask` on ``address``'s stream; raises :class:`QueryStreamBroken` when
        that stream broke (the next ask opens a new one)."""
        return self._stream_to(address).ask(request)

    def tell(self, address: str, report: Any) -> None:
        """:meth:`QueryStream.tell` on ``address``'s stream. Reports concern what was asked there, so
        without a stream that is still open (it broke, or the peer left) the report is dropped rather
        than a stream opened for it, which for a departed peer would reconnect forever."""
        stream = self._streams.get(address)
        if stream is not None:
            stream.tell(report)

    def _stream_to(self, address: str) -> QueryStream[RequestT, ResponseT]:
        stream = self._streams.get(address)
        if stream is None or stream.broken is not None:
            if stream is not None:
                self._close_later(stream)
            stream = self._streams[address] = QueryStream(self._kind, self._channels.get(address), address)
        return stream

    def forget(self, address: str) -> None:
        """The peer left: close its stream (queries waiting on it fail over at once)."""
        stream = self._streams.pop(address, None)
        if stream is not None:
            self._close_later(stream)

    def _close_later(self, stream: QueryStream[RequestT, ResponseT]) -> None:
        task = asyncio.create_task(stream.close(), name=f"close-queries-{stream.address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        await cancel_and_wait(*self._closing)
        for stream in streams:
            await stream.close()
