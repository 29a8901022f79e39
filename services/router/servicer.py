"""``kvmesh.v1.Router`` over gRPC: plan each request and hand it on to its worker.

The one request path (docs/architecture.md): a frontend asks ``RouteMany`` where a request goes;
the router plans it (a worker, or a prefill worker and a decode worker, :mod:`disaggregation`),
counts it in the load picture and hands it on to the (decode) worker, to be served on the stream
that frontend attached there (docs/decisions/0030). The answer streams from the worker to the
frontend, which reports the first token and the end of each try on the same ``RouteMany`` stream
and moves a request whose worker broke (migration lives in :mod:`kvmesh.common.calling.request_path`).
``Route`` is the same decision for one request, for tools and external gRPC clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvmesh.common.rpc.batch_queue import BatchQueue
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_errors import refuse
from kvmesh.common.rpc.multiplexed import RequestContext, ending_of
from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.rpc.stream_sessions import StreamSessions
from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.wire import disagg
from kvmesh.common.wire.disagg import PrefixPull
from kvmesh.common.wire.priority import Priority, parse_priority
from kvmesh.common.wire.request_reports import END, FIRST_TOKEN
from kvmesh.common.wire.requests import with_disaggregated_params
from kvmesh.common.wire.session import parse_session
from kvmesh.router.disaggregation import Disaggregation
from kvmesh.router.forwards import Forwards
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prefill_job import LocalPrefill, RemotePrefill
from kvmesh.router.report_listener import ReportListener
from kvmesh.router.request_queue import QueueRefusal, RouterQueue
from kvmesh.router.routing import Router

log = structlog.get_logger(__name__)

RECENT_SESSIONS = 20  # the sessions GetStatus lists (kvmesh inspect router), the most recently routed


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Guarantees: every request routed is counted in the load picture until its end is reported
    (or ``--request-timeout-secs`` passes, for a report that was lost); a request is handed on at
    most once, and its caller gets an answer only when the forward did not happen or failed; a
    refusal answers its own query with a gRPC status, never the stream."""

    def __init__(
        self,
        router: Router,
        channels: ChannelPool,
        sessions: StreamSessions,
        metrics: RouterMetrics,
        queue: RouterQueue,
    ) -> None:
        """``sessions``: this replica's ``GenerateMany`` streams to the workers, which carry its
        forwards; ``queue``: where requests wait while every worker is busy (the one the router
        tells when capacity frees)."""
        self.router = router
        self.channels = channels
        self.sessions = sessions
        self.metrics = metrics
        self.reports = ReportListener(router, self.metrics)  # what the frontends tell us
        self.disaggregation = Disaggregation(router, channels, self.metrics)
        self.queue = queue

    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        """Plan one request and count it; the caller submits it to the worker named (with the
        answer's ``disaggregated_params``, for a split request) and reports its first token and end
        on a ``RouteMany`` stream. The same decision ``RouteMany`` makes, for one request."""
        sent = request.request
        if not sent.request_id:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        structlog.contextvars.bind_contextvars(request_id=sent.request_id)
        try:
            await self._check(sent, context)
            try:
                return await self.queue.route(
                    sent.model,
                    parse_priority(sent.routing.priority),  # checked above
                    lambda: self._plan(sent, request.migration),
                    len(sent.token_ids),
                    sent.routing.session_id,
                )
            except QueueRefusal as exc:
                await self._refuse(context, exc.code, str(exc), exc.retry_after_secs)
            except StatusError as exc:
                await self._refuse(context, exc.code, str(exc))
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def _plan(self, sent: common_pb2.PreprocessedRequest, migration: int) -> router_pb2.RouteResponse:
        """Choose where ``sent`` runs, start its remote prefill if it is split, and count it in the
        load picture. A request that names its worker, and any migrated try, is never split."""
        forced = self._forced(sent)
        with self.metrics.decision_seconds.time():
            plan = None if forced or migration else await self.router.plan_prefill(sent)
            rank: int | None = 0
            steered_by = ""
            pull: PrefixPull | None = None
            if plan is None:
                choice = await self.router.choose(sent)
                # a pulled prefix is cached there by the time the prefill runs
                worker, overlap, block_hashes = choice.worker, choice.cached_blocks, choice.block_hashes
                rank, steered_by, pull = choice.dp_rank, choice.steered_by, choice.pull_order()
            elif isinstance(plan, LocalPrefill):
                worker, overlap, block_hashes = plan.decode, plan.overlap, plan.block_hashes
                rank = plan.decode_rank
                self.metrics.prefills.labels("local", plan.reason).inc()
            else:
                worker, block_hashes, rank = plan.decode, plan.block_hashes, plan.decode_rank
                overlap = len(block_hashes)  # its KV arrives: only the tail is computed there
        response = router_pb2.RouteResponse(
            worker_id=worker.instance_id,
            worker_address=worker.address,
            router_id=self.router.router_id,
            migration_limit=self.router.config.migration_limit,
            forced=forced,
        )
        if isinstance(plan, RemotePrefill):
            decided = self.router.clock()
            decode_half = await self.disaggregation.start(sent, plan)
            if decode_half.disaggregated_params:
                response.disaggregated_params = decode_half.disaggregated_params
            else:
                overlap = 0  # sync path, prefill failed: the decode worker prefills itself
        if pull is not None:  # rides with the request as a split's decode order does
            response.disaggregated_params = disagg.encode(pull)
            self.metrics.prefix_pulls.inc()
        response.overlap_blocks = overlap
        if rank is not None:
            # the rank rides on the request itself too, for the forward that sends it on from here
            response.dp_rank = sent.routing.dp_rank = rank
        expected = sent.expected_output_tokens if sent.HasField("expected_output_tokens") else 0
        self.router.track_add(
            sent.request_id,
            worker,
            block_hashes,
            len(sent.token_ids),
            overlap,
            expected,
            rank or 0,
            session=sent.routing.session_id,
        )
        if isinstance(plan, RemotePrefill):  # tracked now: its free or its expiry forgets the timing
            self.router.picture.split_started(sent.request_id, plan.predicted_prefill_ms, decided)
        if steered_by:  # named only where it happened: the rules are meant to be rare
            self.metrics.steered.labels(steered_by).inc()
        log.info(
            "routed",
            worker_id=worker.instance_id,
            overlap_blocks=overlap,
            mode=self.router.config.router_mode,
            migration=migration,
            prefill_worker_id=plan.prefill.instance_id if isinstance(plan, RemotePrefill) else None,
            **({"pulls_from": pull.worker_id, "pull_blocks": len(pull.sequence_hashes)} if pull else {}),
            **({"steered_by": steered_by} if steered_by else {}),
        )
        return response

    async def RouteMany(
        self, request_iterator: AsyncIterator[router_pb2.RouteQueries], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouteAnswers]:
        """:meth:`Route` for each query of the stream, concurrently (a query waits on the indexer);
        a query that asks for a forward (``forward_to``) is sent on to its worker and answered only
        if that fails; other answers go out as soon as they are decided, with the others then
        ready. A refusal answers its query only; the stream goes on (docs/decisions/0024), and ends
        once the caller has closed its side and every query is answered. The caller's reports on
        the requests it routed here ride on the same stream (:mod:`kvmesh.router.report_listener`)."""
        answers: BatchQueue[router_pb2.RouteAnswer | None] = BatchQueue()  # None: the caller is done
        running: set[asyncio.Task[None]] = set()
        forwards = Forwards(answers, self.metrics.forward_failed)  # handed on, not yet known to run

        async def answer(query: router_pb2.RouteQuery) -> None:
            reply = router_pb2.RouteAnswer(query_id=query.query_id)
            try:
                response = await self.Route(query.request, RequestContext())
                if query.request.forward_to and self._forward(query.request, response, reply, forwards):
                    return  # answered only if the forward fails
                reply.response.CopyFrom(response)
            except Exception as exc:  # a refusal or a bug answers this query, not the stream
                reply.refused.CopyFrom(ending_of(exc, query.request.request.request_id))
            answers.add(reply)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    if message.reports:
                        for report in self.reports.apply_message(message.reports):
                            forwards.settle(report.request_id)  # its first token or its end: it ran
                            if report.kind == FIRST_TOKEN and report.kv_source:
                                self.disaggregation.first_token(report.request_id, report.kv_source)
                            elif report.kind == END:
                                self.disaggregation.end(report.request_id)
                    for query in message.queries:
                        task = asyncio.create_task(answer(query))
                        running.add(task)
                        task.add_done_callback(running.discard)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                return  # the call is over: nothing more to send
            # the caller closed its side: answer what it asked, then end the stream
            await asyncio.gather(*running, return_exceptions=True)
            answers.add(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                ready = await answers.take()
                replies = [reply for reply in ready if reply is not None]
                if replies:
                    yield router_pb2.RouteAnswers(answers=replies)
                if len(replies) < len(ready):
                    return
        finally:
            forwards.settle_all()
            await cancel_and_wait(reader, *running)

    def _forward(
        self,
        query: router_pb2.RouteRequest,
        response: router_pb2.RouteResponse,
        reply: router_pb2.RouteAnswer,
        forwards: Forwards,
    ) -> bool:
        """Send the routed request on to its worker, to be served on the stream the caller's frontend
        attached there (docs/decisions/0030); whether it was sent. Not for a request that never
        moves (``forced``: the frontend must know that), nor when the stream to the worker is
        already broken (the caller then submits it itself, and finds that out as it would have)."""
        if response.forced:
            return False
        session = self.sessions.get(response.worker_address)
        request = query.request
        if response.disaggregated_params:
            request = with_disaggregated_params(request, response.disaggregated_params)
        try:
            failed = session.forward(request, query.forward_to)
        except grpc.aio.AioRpcError:
            return False
        forwards.watch(request.request_id, session, failed, response, reply)
        self.metrics.forwards_sent.inc()
        return True

    def _forced(self, request: common_pb2.PreprocessedRequest) -> bool:
        """Whether ``request`` stays on the worker it was sent to (it names one, or this router
        routes directly): never moved to another, and not split into prefill and decode."""
        return request.routing.HasField("worker_id") or self.router.config.router_mode == "direct"

    async def _check(self, request: common_pb2.PreprocessedRequest, context: grpc.aio.ServicerContext) -> None:
        """Refuse a request this router cannot take as it is."""
        if not request.token_ids:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        if request.disaggregated_params:
            await self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "disaggregated_params is set by the router itself; send the request without it",
            )
        try:
            parse_priority(request.routing.priority)
            parse_session(request.routing.session_id)
        except ValueError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.request_id in self.router.loads:
            # its load would be counted twice and freed once; a worker stream carries one request per id
            await self._refuse(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {request.request_id!r} is already in flight; give each request its own request_id",
            )

    async def _refuse(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, retry_after_secs: int = 0
    ) -> None:
        """Refuse a call, counting it as an outcome named after its status."""
        self.metrics.outcome(code.name.lower())
        await refuse(context, "router", code, message, retry_after_secs)

    async def BestWorker(
        self, request: router_pb2.RoutingQuery, context: grpc.aio.ServicerContext
    ) -> router_pb2.BestWorkerResponse:
        if not request.token_ids:
            await refuse(context, "router", grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            choice = await self.router.choose(as_request(request), commit=False)
        except StatusError as exc:
            await refuse(context, "router", exc.code, str(exc))
        return router_pb2.BestWorkerResponse(
            worker_id=choice.worker.instance_id, dp_rank=choice.dp_rank or 0, overlap_blocks=choice.overlap_blocks
        )

    async def PotentialLoads(
        self, request: router_pb2.RoutingQuery, context: grpc.aio.ServicerContext
    ) -> router_pb2.PotentialLoadsResponse:
        if not request.token_ids:
            await refuse(context, "router", grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            loads = await self.router.potential_loads(as_request(request))
        except StatusError as exc:
            await refuse(context, "router", exc.code, str(exc))
        return router_pb2.PotentialLoadsResponse(loads=loads)

    async def GetStatus(
        self, request: router_pb2.RouterStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatus:
        router = self.router
        outcomes = self.metrics.outcomes
        now = router.clock()
        return router_pb2.RouterStatus(
            router_id=router.router_id,
            mode=router.config.router_mode,
            replica_sync=router.sync is not None,
            sync_peers=len(router.sync.peers()) if router.sync is not None else 0,
            loads=router.load_by_worker(),
            active_requests=len(router.loads),
            outcome_window_seconds=int(outcomes.window_seconds),
            recent_outcomes=outcomes.recent(),
            total_outcomes=outcomes.totals(),
            migrations=self.metrics.migrations_total,
            queued={p: self.queue.depth(priority=p) for p in Priority},
            misconfigurations=self.metrics.findings.messages(),
            sessions=len(router.cache_views.sessions),
            recent_sessions=[
                router_pb2.SessionAffinity(
                    session_id=entry.session,
                    worker_id=entry.key.worker_id,
                    dp_rank=entry.key.dp_rank,
                    expires_in_s=entry.until - now,
                )
                for entry in router.cache_views.sessions.live(now)[:RECENT_SESSIONS]
            ],
        )


def as_request(query: router_pb2.RoutingQuery) -> common_pb2.PreprocessedRequest:
    """A routing query in the shape of the request it asks about."""
    request = common_pb2.PreprocessedRequest(model=query.model, token_ids=query.token_ids)
    if query.HasField("lora_name"):
        request.lora_name = query.lora_name
    if query.HasField("expected_output_tokens"):
        request.expected_output_tokens = query.expected_output_tokens
    request.routing.router_config_override.CopyFrom(query.router_config_override)
    return request
