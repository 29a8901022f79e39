"""``--token-path direct``: the frontend streams each answer straight from its worker; the router
only chooses the worker and hears how the request goes (docs/decisions/0023)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog
from nats.js import JetStreamContext

from kvmesh.common.channels import ChannelPool
from kvmesh.common.discovery import DiscoveryWatcher, InstanceRecord
from kvmesh.common.grpc_errors import call_error, is_transport_failure
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2
from kvmesh.common.request_reports import END, FIRST_TOKEN, RequestReport
from kvmesh.common.requests import DEFAULT_MAX_TOKENS, AnswerUsage, continue_request
from kvmesh.common.stream_sessions import HandOnTable, Inbox, StreamSession, StreamSessions, open_worker_stream
from kvmesh.frontend.router_client import RouterClient, route_failure, route_request

log = structlog.get_logger(__name__)


class DirectTokenPath:
    """Serves a request the way ``Router.Generate`` would, without the router in the token path.

    A router replica chooses the worker and counts the request (``Router.Route``, over the
    frontend's ``RouteMany`` stream to it); the answer streams from the worker over this frontend's
    own ``Worker.GenerateMany`` stream to it; the first token and the end of each try are reported
    to that replica on the same ``RouteMany`` stream, and it applies them to its load picture as
    its relay would have.

    Guarantees, the same as the relay's: the outputs carry the usage of the whole request (the
    original prompt, every token of every try); a worker that breaks mid-stream is avoided and the
    request moves to another with the tokens streamed so far, up to the router's
    ``--migration-limit`` (never for a request forced to one worker); a refusal is raised as the
    router would raise it. Every try the router counted is reported ended exactly once, however it
    ends (finished, refused, broken, cancelled). A request the router splits into prefill and
    decode (``relay``) is served through the router's Generate instead.

    With ``hand_on`` the router sends a first try on to the worker itself and does not answer; the
    request is claimed from this frontend's stream to that worker by its first output. A hand-on
    that fails is answered: refused (submitted here instead) or lost (cancelled at its worker and
    moved on, as a broken stream). Nothing handed on is left running: whatever no one here waits
    for is cancelled at the worker (docs/decisions/0030).
    """

    def __init__(self, routers: RouterClient, hand_on: bool = False) -> None:
        """``hand_on``: let the router send each request's first try on to the worker itself, to be
        served on this frontend's stream there (docs/decisions/0030)."""
        self._routers = routers
        self._channels = ChannelPool()
        self._hand_ons = HandOnTable() if hand_on else None
        self.frontend_id = uuid.uuid4().hex if hand_on else ""
        self._sessions = StreamSessions(self._channels, open_worker_stream, self._hand_ons, self.frontend_id)

    async def generate(
        self, request: common_pb2.PreprocessedRequest, router_address: str
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        """The request's outputs; raises ``grpc.aio.AioRpcError`` as ``Router.Generate`` would (a
        transport failure of the router's Route call, too: the caller fails over to another replica)."""
        usage = AnswerUsage(len(request.token_ids))
        max_tokens = request.stop.max_tokens or DEFAULT_MAX_TOKENS
        migration = 0
        while True:
            sent = request if not migration else continue_request(request, usage.generated, max_tokens, f"m{migration}")
            claimed: tuple[StreamSession, Inbox] | None = None
            if self._may_hand_on(sent, migration, router_address):
                route, claimed = await self._hand_on(router_address, sent)
            else:
                route = await self._route(router_address, route_request(sent, migration=migration))
            if route.relay:
                async with contextlib.aclosing(self._routers.generate(sent, router_address)) as outputs:
                    async for output in outputs:
                        yield usage.account(output)
                return
            # the end to report unless it ends otherwise (None: already reported)
            end: RequestReport | None = RequestReport(END, sent.request_id, outcome="cancelled")
            failed_worker: int | None = None  # set when the stream broke: the request may move on
            try:
                first = True
                # closing the stream when we stop early cancels the request at the worker
                if claimed is not None:
                    session, inbox = claimed
                    stream = session.generate(sent, inbox)
                elif route.hand_on_lost:
                    stream = _lost_hand_on(route, self._sessions.open_session(route.worker_address), sent.request_id)
                else:
                    stream = self._sessions.generate(route.worker_address, sent)
                async with contextlib.aclosing(stream) as outputs:
                    async for output in outputs:
                        if first:
                            first = False
                            route.worker_id = output.worker_id  # a claimed hand-on learns it here
                            self._routers.report(router_address, RequestReport(FIRST_TOKEN, sent.request_id))
                        finished = output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                        output = usage.account(output)
                        if finished:
                            # told before the client has its answer: its next request, on the same
                            # stream to the router, then finds this one's load freed
                            self._routers.report(
                                router_address, RequestReport(END, sent.request_id, "completed", len(usage.generated))
                            )
                            end = None
                        yield output
                        if finished:
                            return
                log.warning("worker stream ended without a finish reason", worker_id=route.worker_id)
                failed_worker = 0  # not avoided: the relay does not avoid a worker for this either
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
                    self._routers.report(router_address, end)
            # the stream broke or ended unfinished: what the router's relay would decide
            gives_up = route.forced or migration >= route.migration_limit
            done = len(usage.generated) >= max_tokens
            outcome = "unavailable" if gives_up else "completed" if done else "migrated"
            ended = RequestReport(END, sent.request_id, outcome, len(usage.generated), failed_worker)
            self._routers.report(router_address, ended)
            if gives_up:
                how = "forced worker" if route.forced else f"{migration} migrations"
                details = f"worker {route.worker_id} failed after {len(usage.generated)} tokens ({how})"
                raise call_error(grpc.StatusCode.UNAVAILABLE, details, origin="router")  # as the relay refuses
            if done:
                yield usage.closing_output(route.worker_id)
                return
            migration += 1

    def _may_hand_on(self, request: common_pb2.PreprocessedRequest, migration: int, router_address: str) -> bool:
        """A first try, not forced to a worker (the frontend must know that before any answer),
        to a router whose migration limit is known (its answers carry it)."""
        return (
            self._hand_ons is not None
            and not migration
            and not request.routing.HasField("worker_id")
            and router_address in self._routers.migration_limits
        )

    async def _hand_on(
        self, router_address: str, sent: common_pb2.PreprocessedRequest
    ) -> tuple[router_pb2.RouteResponse, tuple[StreamSession, Inbox] | None]:
        """Route ``sent`` with a hand-on: the router sends it on to the worker, and its first item
        comes on this frontend's stream there, which claims it; or the router answers, because
        the hand-on failed or did not happen. Returns the route (for a claimed request: its
        worker's address and the router's migration limit) and the claiming session, if any."""
        request_id = sent.request_id
        expectation = self._hand_ons.expect(request_id)
        query = route_request(sent, hand_on_to=self.frontend_id)
        try:
            answer = self._routers.ask_route(router_address, query)
        except BaseException:
            self._hand_ons.forget(request_id)
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
            answer.cancel()  # an answer now could only say the hand-on was lost after it ran
            limit = self._routers.migration_limits[router_address]
            route = router_pb2.RouteResponse(worker_address=session.address, migration_limit=limit)
            return route, (session, expectation.inbox)
        self._hand_ons.forget(request_id)
        error = answer.exception()
        if error is not None:
            failure = route_failure(error)
            if is_transport_failure(failure):
                # the router may have sent it on before its stream broke: wherever it runs, stop it
                self._sessions.cancel_everywhere(request_id)
            raise failure
        route = answer.result()
        self._routers.note_route(router_address, route)
        return route, None

    def _abandon(
        self,
        router_address: str,
        request_id: str,
        answer: asyncio.Future[router_pb2.RouteResponse],
        decided: asyncio.Future[StreamSession | None],
    ) -> None:
        """A hand-on whose client left, once it is decided: cancelled where it runs, and reported
        ended to the router that counted it."""
        self._hand_ons.forget(request_id)
        session = decided.result()
        if session is not None:
            answer.cancel()
            session.abandon(request_id)
            self._routers.report(router_address, RequestReport(END, request_id, outcome="cancelled"))
            return
        if not answer.cancelled() and answer.exception() is None and answer.result().hand_on_lost:
            self._sessions.cancel_everywhere(request_id)
        self._release(router_address, request_id, answer)

    def _release(self, router_address: str, request_id: str, answer: asyncio.Future[router_pb2.RouteResponse]) -> None:
        """A route answer that came after its client left: a request the router counted (not one it
        relays, which it ends itself) is reported ended, so it leaves no load behind."""
        if answer.cancelled() or answer.exception() is not None or answer.result().relay:
            return
        self._routers.report(router_address, RequestReport(END, request_id, outcome="cancelled"))

    async def _route(self, router_address: str, query: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        """``Router.Route``. If the client goes away while the router answers, the request may be
        counted all the same: it is then reported ended at once, so it leaves no load behind."""
        call = asyncio.ensure_future(self._routers.route(router_address, query))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(functools.partial(self._release, router_address, query.request.request_id))
            raise

    @property
    def expected_hand_ons(self) -> int:
        """Hand-ons asked for and not yet decided (for tests and inspection)."""
        return len(self._hand_ons) if self._hand_ons is not None else 0

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


def _answered(decided: asyncio.Future[StreamSession | None], _answer: asyncio.Future[router_pb2.RouteResponse]) -> None:
    """A hand-on's route answer came (or its stream broke) before any output: the answer decides."""
    if not decided.done():
        decided.set_result(None)


async def _lost_hand_on(
    route: router_pb2.RouteResponse, session: StreamSession | None, request_id: str
) -> AsyncIterator[common_pb2.GenerateOutput]:
    """A hand-on the router lost track of: it may be running on its worker, so it is cancelled
    there, and the try fails as a broken worker stream does (the request moves on)."""
    if session is not None:
        session.abandon(request_id)
    raise call_error(grpc.StatusCode.UNAVAILABLE, f"the hand-on to worker {route.worker_id} was lost")
    yield  # an async generator, like the worker streams it stands in for
