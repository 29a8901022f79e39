"""The one request path, as its caller (the frontend, ``kvmesh.client``) walks it: a router replica
plans the request and hands it on to its worker; the answer streams from that worker straight to
the caller; the caller reports the first token and the end of each try to that replica. Migration
(a worker that breaks), router failover (a replica that breaks) and the usage the client sees live
here, once (docs/architecture.md walks one request).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog
from nats.js import JetStreamContext

from kvmesh.common.calling.router_client import RouterClient, route_failure, route_request
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_errors import NO_WORKER, call_error, error_origin, is_transport_failure
from kvmesh.common.rpc.stream_sessions import ForwardTable, Inbox, StreamSession, StreamSessions, open_worker_stream
from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord
from kvmesh.common.wire.request_reports import END, FIRST_TOKEN, RequestReport
from kvmesh.common.wire.requests import DEFAULT_MAX_TOKENS, AnswerUsage, continue_request, with_disaggregated_params

log = structlog.get_logger(__name__)

# Router replicas one request may fail over to after the first.
ROUTER_FAILOVER_LIMIT = 3


class RouterFailedOver(Exception):
    """A router replica broke before it answered a try (a transport failure): the try goes to another."""


class RouterSeesNoWorker(RouterFailedOver):
    """A router replica sees no worker for the model. Its view may be partial (a replica just back
    from a partition, whose discovery has not caught up), so another replica is asked; where none
    is left, its refusal is the answer."""

    def __init__(self, refusal: grpc.aio.AioRpcError) -> None:
        super().__init__(refusal.details() or "no worker available")
        self.refusal = refusal


class RequestPath:
    """Serves requests over the mesh, from this caller's streams to the routers and the workers.

    A router replica plans each try (``RouteMany``, over this caller's stream to it) and hands it
    on to its worker, which serves it on this caller's ``GenerateMany`` stream there (attached as
    :attr:`caller_id`); the router answers only when the forward did not happen or failed, and
    the try is then submitted here, with the parameters of a split request. The first token and
    the end of each try are reported to that replica on the same ``RouteMany`` stream.

    Guarantees: the outputs carry the usage of the whole request (the original prompt, the first
    try's cached tokens, every token of every try); a worker that breaks mid-stream is avoided and
    the request moves to another with the tokens streamed so far, up to the router's
    ``--migration-limit`` (never for a request forced to one worker); a router replica that breaks
    before it answers is replaced by another, up to :data:`ROUTER_FAILOVER_LIMIT` times (once every
    replica known has failed the request, they are asked again in turn); a refusal
    is raised as a ``grpc.aio.AioRpcError`` with the refuser's status. Every try a router counted is
    reported ended exactly once, however it ends (finished, refused, broken, cancelled). Nothing
    handed on is left running: whatever no one here waits for is cancelled at the worker
    (docs/decisions/0030).
    """

    def __init__(self, routers: RouterClient) -> None:
        self.routers = routers
        self._channels = ChannelPool()
        self._forwards = ForwardTable()
        self.caller_id = uuid.uuid4().hex
        self._sessions = StreamSessions(self._channels, open_worker_stream, self._forwards, self.caller_id)

    async def generate(self, request: common_pb2.PreprocessedRequest) -> AsyncIterator[common_pb2.GenerateOutput]:
        """The request's outputs, the last with its finish reason. Raises ``grpc.aio.AioRpcError``
        for a refusal or a failure past the limits, and :class:`NoRouterError` when no router
        replica is left to ask. Closing it early cancels the request where it runs."""
        usage = AnswerUsage(len(request.token_ids))
        max_tokens = request.stop.max_tokens or DEFAULT_MAX_TOKENS
        failed_routers: set[str] = set()  # replicas this request avoids
        failovers = 0
        migration = 0
        tries = 0
        router_address = ""
        while True:
            # A moved request stays with the replica that planned it: that one was told which worker
            # broke and avoids it (another replica would not know and might choose it again).
            if not router_address or router_address in failed_routers:
                if failed_routers and not self.routers.others(failed_routers):
                    # Every replica known failed this request once. A failure may have been passing
                    # (a stream cut while the mesh rode out a fault elsewhere): they are asked again,
                    # within the failover limit.
                    failed_routers.clear()
                router_address = self.routers.pick(frozenset(failed_routers))
            sent = request if not tries else continue_request(request, usage.generated, max_tokens, f"t{tries}")
            tries += 1
            try:
                # closed with the caller's generator: a client that leaves cancels the try at once
                async with contextlib.aclosing(
                    self._try(sent, router_address, migration, usage, max_tokens)
                ) as outputs:
                    async for output in outputs:
                        yield output
                return
            except RouterFailedOver as failed:
                failed_routers.add(router_address)
                failovers += 1
                if isinstance(failed, RouterSeesNoWorker) and not self.routers.others(failed_routers):
                    raise failed.refusal from None
                log.warning(
                    "router replica failed; continuing on another",
                    router=router_address,
                    tokens_so_far=len(usage.generated),
                    error=str(failed),
                )
                if failovers > ROUTER_FAILOVER_LIMIT:
                    details = f"router replicas failed {ROUTER_FAILOVER_LIMIT + 1} times for this request"
                    raise call_error(grpc.StatusCode.UNAVAILABLE, details, origin="frontend") from None
                if usage.generated and len(usage.generated) >= max_tokens:
                    yield usage.closing_output(0)  # the answer was whole before the router broke
                    return
            except _Migrate:
                migration += 1  # _try ended a try that was already whole itself

    async def _try(
        self,
        sent: common_pb2.PreprocessedRequest,
        router_address: str,
        migration: int,
        usage: AnswerUsage,
        max_tokens: int,
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        """One try on one worker: its outputs until the finish; raises :class:`_Migrate` when its
        worker broke and the request may move, :class:`RouterFailedOver` when the router broke
        before it answered."""
        claimed: tuple[StreamSession, Inbox] | None = None
        try:
            if self._may_forward(sent, migration, router_address):
                route, claimed = await self._forward(router_address, sent)
            else:
                route = await self._route(router_address, route_request(sent, migration=migration))
        except grpc.aio.AioRpcError as exc:
            if is_transport_failure(exc):
                raise RouterFailedOver(exc.details() or exc.code().name) from exc
            if is_no_worker_refusal(exc):
                raise RouterSeesNoWorker(exc) from exc
            raise
        if route.HasField("dp_rank"):
            sent.routing.dp_rank = route.dp_rank  # the data-parallel rank the router chose
        if route.disaggregated_params:
            sent = with_disaggregated_params(sent, route.disaggregated_params)
        # the end to report unless it ends otherwise (None: already reported)
        end: RequestReport | None = RequestReport(END, sent.request_id, outcome="cancelled")
        failed_worker: int | None = None  # set when the stream broke: the request may move on
        try:
            first = True
            # closing the stream when we stop early cancels the request at the worker
            if claimed is not None:
                session, inbox = claimed
                stream = session.generate(sent, inbox)
            elif route.forward_lost:
                stream = _lost_forward(route, self._sessions.open_session(route.worker_address), sent.request_id)
            else:
                stream = self._sessions.generate(route.worker_address, sent)
            async with contextlib.aclosing(stream) as outputs:
                async for output in outputs:
                    if first:
                        first = False
                        route.worker_id = output.worker_id  # a claimed forward learns it here
                        kv_source = output.disaggregated_params
                        report = RequestReport(FIRST_TOKEN, sent.request_id, kv_source=kv_source)
                        self.routers.report(router_address, report)
                        output.ClearField("disaggregated_params")
                    finished = output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    output = usage.account(output, migration)
                    if finished:
                        # told before the client has its answer: its next request, on the same
                        # stream to the router, then finds this one's load freed
                        self.routers.report(
                            router_address, RequestReport(END, sent.request_id, "completed", len(usage.generated))
                        )
                        end = None
                    yield output
                    if finished:
                        return
            log.warning("worker stream ended without a finish reason", worker_id=route.worker_id)
            failed_worker = 0  # not avoided: it did not break
        except grpc.aio.AioRpcError as exc:
            if not is_transport_failure(exc):
                end = RequestReport(END, sent.request_id, exc.code().name.lower(), len(usage.generated))
                raise
            failed_worker = route.worker_id
            log.warning(
                "worker stream broke",
                worker_id=route.worker_id,
                code=exc.code().name,
                tokens_so_far=len(usage.generated),
            )
        finally:
            if failed_worker is None and end is not None:  # refused, or closed by the client
                self.routers.report(router_address, end)
        # the stream broke or ended unfinished
        gives_up = route.forced or migration >= route.migration_limit
        done = len(usage.generated) >= max_tokens
        outcome = "unavailable" if gives_up else "completed" if done else "migrated"
        ended = RequestReport(END, sent.request_id, outcome, len(usage.generated), failed_worker)
        self.routers.report(router_address, ended)
        if gives_up:
            how = "forced worker" if route.forced else f"{migration} migrations"
            details = f"worker {route.worker_id} failed after {len(usage.generated)} tokens ({how})"
            raise call_error(grpc.StatusCode.UNAVAILABLE, details, origin="router")
        if done:
            yield usage.closing_output(route.worker_id)
            return
        raise _Migrate

    def _may_forward(self, request: common_pb2.PreprocessedRequest, migration: int, router_address: str) -> bool:
        """A first try, not forced to a worker (the frontend must know that before any answer),
        to a router whose migration limit is known (its answers carry it)."""
        return (
            not migration
            and not request.routing.HasField("worker_id")
            and router_address in self.routers.migration_limits
        )

    async def _forward(
        self, router_address: str, sent: common_pb2.PreprocessedRequest
    ) -> tuple[router_pb2.RouteResponse, tuple[StreamSession, Inbox] | None]:
        """Route ``sent`` with a forward: the router sends it on to the worker, and its first item
        comes on this frontend's stream there, which claims it; or the router answers, because
        the forward failed or did not happen. Returns the route (for a claimed request: its
        worker's address and the router's migration limit) and the claiming session, if any."""
        request_id = sent.request_id
        expectation = self._forwards.expect(request_id)
        query = route_request(sent, forward_to=self.caller_id)
        try:
            answer = self.routers.ask_route(router_address, query)
        except BaseException:
            self._forwards.forget(request_id)
            raise
        decided = expectation.decided
        answer.add_done_callback(functools.partial(_answered, decided))
        try:
            session = await asyncio.shield(decided)
        except asyncio.CancelledError:
            # the client left: whatever decides it later, stop it and free its load at the router
            decided.add_done_callback(functools.partial(self._abandon, router_address, request_id, answer))
            raise
        if session is not None:
            answer.cancel()  # an answer now could only say the forward was lost after it ran
            limit = self.routers.migration_limits[router_address]
            route = router_pb2.RouteResponse(worker_address=session.address, migration_limit=limit)
            return route, (session, expectation.inbox)
        self._forwards.forget(request_id)
        error = answer.exception()
        if error is not None:
            failure = route_failure(error)
            if is_transport_failure(failure):
                # the router may have sent it on before its stream broke: wherever it runs, stop it
                self._sessions.cancel_everywhere(request_id)
            raise failure
        route = answer.result()
        self.routers.note_route(router_address, route)
        return route, None

    def _abandon(
        self,
        router_address: str,
        request_id: str,
        answer: asyncio.Future[router_pb2.RouteResponse],
        decided: asyncio.Future[StreamSession | None],
    ) -> None:
        """A forward whose client left, once it is decided: cancelled where it runs, and reported
        ended to the router that counted it."""
        self._forwards.forget(request_id)
        session = decided.result()
        if session is not None:
            answer.cancel()
            session.abandon(request_id)
            self.routers.report(router_address, RequestReport(END, request_id, outcome="cancelled"))
            return
        if not answer.cancelled() and answer.exception() is None and answer.result().forward_lost:
            self._sessions.cancel_everywhere(request_id)
        self._release(router_address, request_id, answer)

    def _release(self, router_address: str, request_id: str, answer: asyncio.Future[router_pb2.RouteResponse]) -> None:
        """A route answer that came after its client left: the request the router counted is
        reported ended, so it leaves no load behind."""
        if answer.cancelled() or answer.exception() is not None:
            return
        self.routers.report(router_address, RequestReport(END, request_id, outcome="cancelled"))

    async def _route(self, router_address: str, query: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        """``Router.Route``. If the client goes away while the router answers, the request may be
        counted all the same: it is then reported ended at once, so it leaves no load behind."""
        call = asyncio.ensure_future(self.routers.route(router_address, query))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(functools.partial(self._release, router_address, query.request.request_id))
            raise

    @property
    def expected_forwards(self) -> int:
        """Forwards asked for and not yet decided (for tests and inspection)."""
        return len(self._forwards)

    def watch(self, js: JetStreamContext, namespace: str) -> DiscoveryWatcher:
        """Follow the workers in discovery (start the returned watcher): a worker that leaves has its
        stream closed once the requests on it have ended, so a draining worker is not kept waiting."""
        return DiscoveryWatcher(js, namespace, "worker", on_removed=self.worker_left)

    async def worker_left(self, record: InstanceRecord) -> None:
        self._sessions.drop(record.address)
        await self._channels.drop(record.address)

    async def close(self) -> None:
        await self._sessions.close()
        await self._channels.close()


def is_no_worker_refusal(error: grpc.aio.AioRpcError) -> bool:
    """The router's refusal for a model it sees no worker of."""
    return (
        error.code() == grpc.StatusCode.UNAVAILABLE
        and error_origin(error) == "router"
        and (error.details() or "").startswith(NO_WORKER)
    )


def _answered(decided: asyncio.Future[StreamSession | None], _answer: asyncio.Future[router_pb2.RouteResponse]) -> None:
    """A forward's route answer came (or its stream broke) before any output: the answer decides."""
    if not decided.done():
        decided.set_result(None)


async def _lost_forward(
    route: router_pb2.RouteResponse, session: StreamSession | None, request_id: str
) -> AsyncIterator[common_pb2.GenerateOutput]:
    """A forward the router lost track of: it may be running on its worker, so it is cancelled
    there, and the try fails as a broken worker stream does (the request moves on)."""
    if session is not None:
        session.abandon(request_id)
    raise call_error(grpc.StatusCode.UNAVAILABLE, f"the forward to worker {route.worker_id} was lost")
    yield  # an async generator, like the worker streams it stands in for


class _Migrate(Exception):
    """A try's worker broke (or ended its stream unfinished): the request moves to another."""
