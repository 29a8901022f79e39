"""``kvmesh.v1.Router`` over gRPC: route, relay the worker's stream, migrate when a worker dies.

``Generate`` is a migration loop around two steps: an *attempt* (choose a worker, or a prefill +
decode pair, and record the request in the load picture) and a *relay* (stream that worker's
tokens to the client, tracking first token and output). If the worker's stream breaks — the worker
died, it did not refuse — the request moves to another worker with the prompt plus the tokens
generated so far and the remaining budget, up to ``--migration-limit`` times; the client sees one
uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from kvmesh.common import disagg
from kvmesh.common.backlog import Backlog
from kvmesh.common.channels import ChannelPool
from kvmesh.common.disagg import DecodeOrder, DisaggParamsError, KvSource
from kvmesh.common.discovery import InstanceRecord
from kvmesh.common.grpc_errors import is_transport_failure, refuse
from kvmesh.common.grpc_streams import messages
from kvmesh.common.multiplexed import RequestContext, RequestMultiplexer, ending_of
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc
from kvmesh.common.requests import DEFAULT_MAX_TOKENS, AnswerUsage, continue_request
from kvmesh.common.runtime import cancel_and_wait
from kvmesh.common.stream_sessions import StreamSessions
from kvmesh.router.hand_ons import HandOns
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prefill_job import (
    LocalPrefill,
    PrefillJob,
    RemotePrefill,
    bootstrap_order,
    decode_request,
    prefill_request,
)
from kvmesh.router.report_listener import ReportListener
from kvmesh.router.routing import Router, RoutingError

log = structlog.get_logger(__name__)


@dataclass
class Progress(AnswerUsage):
    """What the client has been sent so far, across every attempt of one request."""

    max_tokens: int = field(kw_only=True)
    migrations: int = 0
    # the message with the finish reason is on its way: the client may close the call as soon as it
    # has it, before this replica's generator resumes, and that still counts as completed
    finished: bool = False


@dataclass
class Attempt:
    """One try at serving a request: the request as sent to ``worker``, and its remote prefill."""

    request: common_pb2.PreprocessedRequest
    worker: InstanceRecord
    prefill: PrefillJob | None = None


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Guarantees: every attempt is tracked in the load picture until it ends (freed however it
    ends), and a client sees either one whole answer or one error with a gRPC status."""

    def __init__(
        self,
        router: Router,
        channels: ChannelPool,
        metrics: RouterMetrics | None = None,
        sessions: StreamSessions | None = None,
    ) -> None:
        """``sessions``: the multiplexed streams to the workers (``--worker-streams multiplexed``);
        without them every request opens its own ``Worker.Generate`` stream."""
        self.router = router
        self.channels = channels
        self.sessions = sessions if router.config.worker_streams == "multiplexed" else None
        self.metrics = metrics or RouterMetrics(router.loads.pictures, lambda: 0)
        self.reports = ReportListener(router, self.metrics)  # what direct-path frontends tell us

    async def Generate(
        self, request: common_pb2.PreprocessedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        await self._check(request, context)
        progress = Progress(len(request.token_ids), max_tokens=request.stop.max_tokens or DEFAULT_MAX_TOKENS)
        forced = self._forced(request)
        try:
            while True:
                attempt = await self._attempt(request, progress, forced, context)
                try:
                    async with contextlib.aclosing(self._relay(attempt, progress)) as outputs:
                        async for output in outputs:
                            progress.finished = output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                            yield output
                    if progress.finished:
                        self.metrics.outcome("completed")
                        return
                    # a worker stream that ends without a finish reason is no answer: treat it as broken
                    await self._ended_unfinished(attempt, progress, forced, context)
                except grpc.aio.AioRpcError as exc:
                    last = await self._after_broken_stream(exc, attempt, progress, forced, context)
                    if last is not None:
                        progress.finished = True
                        yield last
                        self.metrics.outcome("completed")
                        return
                finally:
                    self.router.track_free(attempt.request.request_id)
                    if attempt.prefill is not None:
                        await attempt.prefill.close()
        except (asyncio.CancelledError, GeneratorExit):
            # the client closed the call: after the finish message (counted as completed) or before
            self.metrics.outcome("completed" if progress.finished else "cancelled")
            raise
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def _ended_unfinished(
        self, attempt: Attempt, progress: Progress, forced: bool, context: grpc.aio.ServicerContext
    ) -> None:
        """A worker's stream ended cleanly but without a finish reason: migrate, like a broken one."""
        worker_id = attempt.worker.instance_id
        log.warning("worker stream ended without a finish reason", worker_id=worker_id, tokens=len(progress.generated))
        if forced or progress.migrations >= self.router.config.migration_limit:
            await self._refuse(
                context, grpc.StatusCode.UNAVAILABLE, f"worker {worker_id} ended the stream without a finish reason"
            )
        progress.migrations += 1
        self.metrics.migrated()

    async def GenerateMany(
        self, request_iterator: AsyncIterator[common_pb2.GenerateCommands], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateBatch]:
        """Many requests over one stream, each served by :meth:`Generate` (docs/decisions/0021)."""
        async with contextlib.aclosing(RequestMultiplexer(self.Generate, "router").serve(request_iterator)) as batches:
            async for batch in batches:
                yield batch

    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        """Choose the worker and count the request, for a caller that streams from the worker itself
        and reports the first token and the end (:mod:`kvmesh.router.report_listener`). A request
        this router would split into prefill and decode is answered ``relay``: call Generate."""
        sent = request.request
        if not sent.request_id:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        structlog.contextvars.bind_contextvars(request_id=sent.request_id)
        try:
            await self._check(sent, context)
            forced = self._forced(sent)
            if not forced and self.router.has_prefill_workers():
                return router_pb2.RouteResponse(relay=True, router_id=self.router.router_id)
            try:
                with self.metrics.decision_seconds.time():
                    choice = await self.router.choose(sent)
            except RoutingError as exc:
                await self._refuse(context, exc.code, str(exc))
            worker = choice.worker
            self._track(sent, worker, choice.block_hashes, choice.overlap_blocks)
            log.info(
                "routed",
                worker_id=worker.instance_id,
                overlap_blocks=choice.overlap_blocks,
                mode=self.router.config.router_mode,
                migration=request.migration,
                token_path="direct",
            )
            return router_pb2.RouteResponse(
                worker_id=worker.instance_id,
                worker_address=worker.address,
                overlap_blocks=choice.overlap_blocks,
                router_id=self.router.router_id,
                migration_limit=self.router.config.migration_limit,
                forced=forced,
            )
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def RouteMany(
        self, request_iterator: AsyncIterator[router_pb2.RouteQueries], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouteAnswers]:
        """:meth:`Route` for each query of the stream, concurrently (a query waits on the indexer);
        each answer goes out as soon as it is decided, with the others then ready. A refusal
        answers its query only; the stream goes on (docs/decisions/0024), and ends once the caller
        has closed its side and every query is answered. The caller's reports on the requests it
        routed here ride on the same stream (:mod:`kvmesh.router.report_listener`)."""
        answers: Backlog[router_pb2.RouteAnswer | None] = Backlog()  # None: the caller is done
        running: set[asyncio.Task[None]] = set()
        hand_ons = HandOns(answers, self.metrics.hand_on_failed)  # handed on, not yet known to run

        async def answer(query: router_pb2.RouteQuery) -> None:
            reply = router_pb2.RouteAnswer(query_id=query.query_id)
            try:
                response = await self.Route(query.request, RequestContext())
                if query.request.hand_on_to and self._hand_on(query.request, response, reply, hand_ons):
                    return  # answered only if the hand-on fails
                reply.response.CopyFrom(response)
            except Exception as exc:  # a refusal or a bug answers this query, not the stream
                reply.refused.CopyFrom(ending_of(exc, query.request.request.request_id))
            answers.add(reply)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    if message.reports:
                        for report in self.reports.apply_message(message.reports):
                            hand_ons.settle(report.request_id)  # its first token or its end: it ran
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
            hand_ons.settle_all()
            await cancel_and_wait(reader, *running)

    def _hand_on(
        self,
        query: router_pb2.RouteRequest,
        response: router_pb2.RouteResponse,
        reply: router_pb2.RouteAnswer,
        hand_ons: HandOns,
    ) -> bool:
        """Send the routed request on to its worker, to be served on the stream the caller's frontend
        attached there (docs/decisions/0030); whether it was sent. Not for a request that is relayed,
        never moves (``forced``: the frontend must know that) or that this router serves without
        multiplexed worker streams; nor when the stream to the worker is already broken (the caller
        then submits it itself, and finds that out as it would have)."""
        if response.relay or response.forced or self.sessions is None:
            return False
        session = self.sessions.get(response.worker_address)
        try:
            failed = session.hand_on(query.request, query.hand_on_to)
        except grpc.aio.AioRpcError:
            return False
        hand_ons.watch(query.request.request_id, session, failed, response, reply)
        self.metrics.hand_ons_sent.inc()
        return True

    def _forced(self, request: common_pb2.PreprocessedRequest) -> bool:
        """Whether ``request`` stays on the worker it was sent to (it names one, or this router
        routes directly): never moved to another, and not split into prefill and decode."""
        return request.routing.HasField("worker_id") or self.router.config.router_mode == "direct"

    def _track(
        self, sent: common_pb2.PreprocessedRequest, worker: InstanceRecord, block_hashes: list[int], overlap: int
    ) -> None:
        """Count ``sent`` in the load picture on ``worker`` (Generate's attempts and Route alike)."""
        expected = sent.expected_output_tokens if sent.HasField("expected_output_tokens") else 0
        self.router.track_add(sent.request_id, worker, block_hashes, len(sent.token_ids), overlap, expected)

    async def _check(self, request: common_pb2.PreprocessedRequest, context: grpc.aio.ServicerContext) -> None:
        """Refuse a request this router cannot take as it is (the checks Generate and Route share)."""
        if not request.token_ids:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        if request.disaggregated_params:
            await self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "disaggregated_params is set by the router itself; send the request without it",
            )
        if request.request_id in self.router.loads:
            # its load would be counted twice and freed once; a worker stream carries one request per id
            await self._refuse(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {request.request_id!r} is already in flight; give each request its own request_id",
            )

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        """Refuse a Generate call, counting it as an outcome named after its status."""
        self.metrics.outcome(code.name.lower())
        await refuse(context, "router", code, message)

    async def _attempt(
        self,
        request: common_pb2.PreprocessedRequest,
        progress: Progress,
        forced: bool,
        context: grpc.aio.ServicerContext,
    ) -> Attempt:
        """Choose where this try runs and record it in the load picture; refuse the call when the
        request cannot be routed. A migrated try continues from the tokens already sent."""
        migration = progress.migrations
        sent = (
            request
            if not migration
            else continue_request(request, progress.generated, progress.max_tokens, f"m{migration}")
        )
        prefill: PrefillJob | None = None
        try:
            with self.metrics.decision_seconds.time():
                plan = None if forced or migration else await self.router.plan_prefill(sent)
                if plan is None:
                    choice = await self.router.choose(sent)
                    worker, overlap, block_hashes = choice.worker, choice.overlap_blocks, choice.block_hashes
                elif isinstance(plan, LocalPrefill):
                    worker, overlap, block_hashes = plan.decode, plan.overlap, plan.block_hashes
                    self.metrics.prefills.labels("local", plan.reason).inc()
                else:
                    worker, block_hashes = plan.decode, plan.block_hashes
                    overlap = len(block_hashes)  # its KV arrives: only the tail is computed there
            if isinstance(plan, RemotePrefill):
                sent, prefill = await self._start_prefill(sent, plan)
                if prefill is None:  # sync path, prefill failed: this worker prefills itself
                    overlap = 0
        except RoutingError as exc:
            await self._refuse(context, exc.code, str(exc))
        self._track(sent, worker, block_hashes, overlap)
        log.info(
            "routed",
            worker_id=worker.instance_id,
            overlap_blocks=overlap,
            mode=self.router.config.router_mode,
            migration=migration,
            prefill_worker_id=plan.prefill.instance_id if isinstance(plan, RemotePrefill) else None,
        )
        return Attempt(sent, worker, prefill)

    async def _relay(self, attempt: Attempt, progress: Progress) -> AsyncIterator[common_pb2.GenerateOutput]:
        """The worker's stream, with usage as the client asked (the original prompt, every token of
        every attempt). Raises ``grpc.aio.AioRpcError`` when the stream breaks."""
        request_id = attempt.request.request_id
        address = attempt.worker.address
        if self.sessions is not None:
            stream = self.sessions.generate(address, attempt.request)
        else:
            stream = messages(worker_pb2_grpc.WorkerStub(self.channels.get(address)).Generate(attempt.request))
        first = True
        # closing the stream when we stop early cancels the request at the worker, freeing its KV
        async with contextlib.aclosing(stream) as outputs:
            async for output in outputs:
                if first:
                    first = False
                    self.router.track_first_token(request_id)
                    if attempt.prefill is not None:
                        remote_cached = await self._account_kv_source(output, attempt.prefill)
                        if remote_cached is not None:
                            progress.cached_tokens = remote_cached
                output.ClearField("disaggregated_params")
                self.router.track_output(request_id, len(output.token_ids))
                yield progress.account(output)

    async def _after_broken_stream(
        self,
        exc: grpc.aio.AioRpcError,
        attempt: Attempt,
        progress: Progress,
        forced: bool,
        context: grpc.aio.ServicerContext,
    ) -> common_pb2.GenerateOutput | None:
        """Decide what a broken worker stream means: pass a refusal on, give up past the migration
        limit, finish for a worker that died after the last token (returns that last message), or
        count a migration (returns None: the loop tries again)."""
        if not is_transport_failure(exc):
            await self._refuse(context, exc.code(), exc.details() or exc.code().name)
        worker_id = attempt.worker.instance_id
        self.router.avoid(worker_id)
        log.warning(
            "worker stream broke", worker_id=worker_id, code=exc.code().name, tokens_so_far=len(progress.generated)
        )
        if forced or progress.migrations >= self.router.config.migration_limit:
            await self._refuse(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"worker {worker_id} failed after {len(progress.generated)} tokens "
                f"({'forced worker' if forced else f'{progress.migrations} migrations'})",
            )
        if len(progress.generated) >= progress.max_tokens:
            return progress.closing_output(worker_id)
        progress.migrations += 1
        self.metrics.migrated()
        return None

    async def _start_prefill(
        self, request: common_pb2.PreprocessedRequest, plan: RemotePrefill
    ) -> tuple[common_pb2.PreprocessedRequest, PrefillJob | None]:
        """Send the prefill half to the prefill worker; return the decode half to send and the job.

        Bootstrap: the decode half carries the rendezvous at once. Sync: wait for the prefill's
        answer and inject it; if the prefill failed, the request goes to the decode worker whole
        (no job), or fails under --enforce-disagg."""
        config = self.router.config
        room = disagg.new_room()
        prefill_half = prefill_request(request, room)
        record = plan.prefill
        self.router.track_add(
            prefill_half.request_id, record, plan.block_hashes, len(request.token_ids), plan.prefill_overlap, 0
        )

        def prefill_done() -> None:
            self.router.track_free(prefill_half.request_id)

        stub = worker_pb2_grpc.WorkerStub(self.channels.get(record.address))
        job = PrefillJob(record.instance_id, stub, prefill_half, prefill_done)
        allow_local = not config.enforce_disagg
        # an engine with its own KV connector (vLLM) hands out its KV's whereabouts only once the
        # prefill has run: those pairs always take the sync path
        if config.disagg_mode == "bootstrap" and record.extra.get("engine", "mock") == "mock":
            return decode_request(request, bootstrap_order(record, room, allow_local)), job
        result = await job.result()
        if result is None:
            if job.transport_failed:
                self.router.avoid(record.instance_id)
            if config.enforce_disagg:
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE, f"prefill on worker {record.instance_id} failed: {job.error}"
                )
            self.metrics.prefills.labels("local", "prefill_failed").inc()
            return request, None
        return decode_request(request, DecodeOrder.from_ready(result.ready, allow_local)), job

    async def _account_kv_source(self, output: common_pb2.GenerateOutput, prefill: PrefillJob) -> int | None:
        """Count where the decode worker got the prompt's KV; returns the prefill worker's cached
        prompt tokens when the KV came from it (the usage the client sees), else None."""
        try:
            source = disagg.decode_as(output.disaggregated_params, KvSource)
        except DisaggParamsError:
            source = KvSource.local("transfer_failed")
        if source.source == "remote":
            self.metrics.prefills.labels("remote", "").inc()
            self.metrics.kv_transfer_bytes.labels(source.backend).inc(source.bytes)
            # the prefill answered before the decode worker could pull: this does not wait in practice
            result = await prefill.result(timeout=1.0)
            return result.cached_tokens if result is not None else None
        reason = source.reason
        if prefill.task.done() and prefill.task.result() is None:
            reason = "prefill_failed"
            if prefill.transport_failed:
                self.router.avoid(prefill.worker_id)
        self.metrics.prefills.labels("local", reason).inc()
        return None

    async def BestWorker(
        self, request: router_pb2.RoutingQuery, context: grpc.aio.ServicerContext
    ) -> router_pb2.BestWorkerResponse:
        if not request.token_ids:
            await refuse(context, "router", grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            choice = await self.router.choose(as_request(request), commit=False)
        except RoutingError as exc:
            await refuse(context, "router", exc.code, str(exc))
        return router_pb2.BestWorkerResponse(
            worker_id=choice.worker.instance_id, dp_rank=0, overlap_blocks=choice.overlap_blocks
        )

    async def PotentialLoads(
        self, request: router_pb2.RoutingQuery, context: grpc.aio.ServicerContext
    ) -> router_pb2.PotentialLoadsResponse:
        if not request.token_ids:
            await refuse(context, "router", grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            loads = await self.router.potential_loads(as_request(request))
        except RoutingError as exc:
            await refuse(context, "router", exc.code, str(exc))
        return router_pb2.PotentialLoadsResponse(loads=loads)

    async def GetStatus(
        self, request: router_pb2.RouterStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatus:
        router = self.router
        outcomes = self.metrics.outcomes
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
