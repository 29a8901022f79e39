"""The requests a router replica handed on to their workers for one frontend, until each is known to
run (docs/decisions/0030).

A handed-on request's route query gets no answer while all goes well: the frontend learns the
worker from the first output, which comes on its own stream to that worker. The router answers
only when the forward fails, and must then tell the frontend which of two things happened:

- the worker refused it (no stream from that frontend is attached there): the answer is the
  ordinary route answer, and the frontend submits the request to that worker itself;
- it may or may not have run (the router's stream to the worker broke, or the frontend's stream
  there ended while it ran): the answer is marked ``forward_lost``, and the frontend cancels it
  there and moves it on, as it does when its own stream to a worker breaks.

The frontend's first-token or end report settles a request (it runs, or ran), as does the end of
the frontend's ``RouteMany`` stream (nothing could be answered any more).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import grpc

from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2
from kvmesh.common.rpc.batch_queue import BatchQueue
from kvmesh.common.rpc.stream_sessions import StreamSession

REFUSED = grpc.StatusCode.FAILED_PRECONDITION.value[0]  # the worker's refusal of a forward


class Forwards:
    """One ``RouteMany`` stream's forwards in flight. Guarantees: each is answered at most once,
    and only if it failed before it was settled."""

    def __init__(
        self, answers: BatchQueue[router_pb2.RouteAnswer | None], on_failed: Callable[[bool], None] | None = None
    ) -> None:
        """``on_failed``: told of each failed forward, whether it was lost (else refused)."""
        self._answers = answers
        self._on_failed = on_failed
        self._watching: dict[str, tuple[StreamSession, asyncio.Future[common_pb2.RequestEnd]]] = {}

    def watch(
        self,
        request_id: str,
        session: StreamSession,
        failed: asyncio.Future[common_pb2.RequestEnd],
        response: router_pb2.RouteResponse,
        reply: router_pb2.RouteAnswer,
    ) -> None:
        """Answer ``reply`` with ``response`` if ``failed`` (from :meth:`StreamSession.forward`)
        resolves before ``request_id`` is settled."""
        self._watching[request_id] = (session, failed)
        failed.add_done_callback(functools.partial(self._failed, request_id, response, reply))

    def settle(self, request_id: str) -> None:
        watched = self._watching.pop(request_id, None)
        if watched is not None:
            session, failed = watched
            session.settle(request_id)
            failed.cancel()

    def settle_all(self) -> None:
        for request_id in list(self._watching):
            self.settle(request_id)

    def __len__(self) -> int:
        return len(self._watching)

    def _failed(
        self,
        request_id: str,
        response: router_pb2.RouteResponse,
        reply: router_pb2.RouteAnswer,
        failed: asyncio.Future[common_pb2.RequestEnd],
    ) -> None:
        if failed.cancelled():
            return  # settled: it runs
        self._watching.pop(request_id, None)
        broken = failed.exception() is not None
        response.forward_lost = broken or failed.result().code != REFUSED
        if self._on_failed is not None:
            self._on_failed(response.forward_lost)
        reply.response.CopyFrom(response)
        self._answers.add(reply)
