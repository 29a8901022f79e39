"""``kvmesh.v1.Worker`` over gRPC, in front of any :class:`Engine`.

A request may carry ``disaggregated_params`` (:mod:`kvmesh.common.wire.disagg`): a
:class:`~kvmesh.common.wire.disagg.PrefillOrder` makes this worker prefill and then hold the prompt's KV
for a decode worker; a :class:`~kvmesh.common.wire.disagg.DecodeOrder` makes it pull the prompt's KV from
a prefill worker before decoding (see :mod:`~kvmesh.worker.kv_transfer.handoff`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_errors import refuse
from kvmesh.common.rpc.multiplexed import Attachments, RequestMultiplexer
from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.wire import disagg
from kvmesh.common.wire.disagg import DecodeOrder, DisaggParamsError, KvSource, PrefillOrder, PrefixPull
from kvmesh.common.wire.finish_reasons import to_proto
from kvmesh.common.wire.kv_events import DEVICE_TIER, POOLED_TIER, stream_of_v1_rank
from kvmesh.worker.cache_moves import CacheMoves
from kvmesh.worker.engine import (
    Engine,
    EngineFailure,
    EngineRequestError,
    EngineRequestSpec,
    TokenOutput,
    take_ready,
)
from kvmesh.worker.kv_transfer.handoff import KvHandoff
from kvmesh.worker.lora_slots import AdapterSlots
from kvmesh.worker.metrics import WorkerMetrics

log = structlog.get_logger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves ``Generate`` from the engine; a cancelled stream aborts its request and frees its KV."""

    def __init__(
        self,
        worker_id: int,
        model_name: str,
        engine: Engine,
        metrics: WorkerMetrics,
        handoff: KvHandoff | None,
        adapters: AdapterSlots | None = None,
        ranks: Sequence[Engine] = (),
        moves: CacheMoves | None = None,
    ) -> None:
        """``engine`` is data-parallel rank 0, which also serves the worker's status, metrics and
        KV handoff; ``ranks``: every rank's engine in rank order (default: ``engine`` alone);
        ``adapters``: the LoRA adapters this worker serves and which are loaded (None: none served);
        ``moves``: its cached blocks' moves to and from other workers (None: its engine cannot)."""
        self.worker_id = worker_id
        self.model_name = model_name
        self.adapters = adapters
        self.ranks = list(ranks) or [engine]
        self.engine = engine
        self.metrics = metrics
        self.handoff = handoff
        self.moves = moves
        # each frontend's attached GenerateMany stream, where routers' forwards for it are served
        self.attachments = Attachments()

    async def Generate(
        self, request: common_pb2.PreprocessedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        request_id = request.request_id
        if not request_id:
            await refuse(context, "worker", grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if request.model and request.model != self.model_name:
            await refuse(
                context,
                "worker",
                grpc.StatusCode.NOT_FOUND,
                f"this worker serves model {self.model_name!r}, not {request.model!r}",
            )
        served_adapters = self.adapters.adapters if self.adapters is not None else ()
        if request.HasField("lora_name") and request.lora_name not in served_adapters:
            served = ", ".join(sorted(served_adapters)) or "none"
            await refuse(
                context,
                "worker",
                grpc.StatusCode.NOT_FOUND,
                f"this worker does not serve LoRA adapter {request.lora_name!r} (it serves: {served})",
            )
        order: PrefillOrder | DecodeOrder | None = None
        pull: PrefixPull | None = None
        if request.disaggregated_params:
            try:
                order = disagg.decode(request.disaggregated_params)
            except DisaggParamsError as exc:
                await refuse(context, "worker", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if isinstance(order, PrefixPull):
                pull, order = order, None
            elif not isinstance(order, PrefillOrder | DecodeOrder):
                await refuse(
                    context, "worker", grpc.StatusCode.INVALID_ARGUMENT, f"a request cannot carry {order.kind!r} params"
                )
        if order is not None and self.handoff is None:
            await refuse(
                context,
                "worker",
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker's engine does not do disaggregation",
            )
        rank = request.routing.dp_rank if request.routing.HasField("dp_rank") else self._least_loaded_rank()
        if rank >= len(self.ranks):
            await refuse(
                context,
                "worker",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this worker has data-parallel ranks 0..{len(self.ranks) - 1}, not {rank}",
            )
        engine = self.ranks[rank]
        if pull is not None:
            await self._pull_prefix(request_id, pull, rank)
        spec = EngineRequestSpec.from_proto(request)
        if spec.lora_name and self.adapters is not None and await self.adapters.use(spec.lora_name):
            log.info("LoRA adapter loaded", request_id=request_id, adapter=spec.lora_name)
        prefill = order if isinstance(order, PrefillOrder) else None
        handed_off = False
        try:
            source: KvSource | None = None
            try:
                if isinstance(order, DecodeOrder):
                    queue, source = await self.handoff.receive(spec, order)
                else:
                    queue = engine.submit(spec, hold_on_finish=prefill is not None)
            except (EngineRequestError, StatusError) as exc:
                code = exc.code if isinstance(exc, StatusError) else grpc.StatusCode.INVALID_ARGUMENT
                await refuse(context, "worker", code, str(exc))
            log.info(
                "request accepted",
                request_id=request_id,
                prompt_tokens=len(spec.prompt),
                disagg=order.kind if order else None,
                kv_source=source.source if source else None,
            )
            completion = 0
            failure: EngineFailure | None = None
            while True:
                if failure is not None:
                    # not marked as a refusal: the router takes it as a failed worker and migrates
                    await context.abort(grpc.StatusCode.UNAVAILABLE, failure.message)
                first = await queue.get()
                if isinstance(first, EngineFailure):
                    failure = first
                    continue
                # every output ready, up to the last or a failure: what was made before a failure goes
                # out first, so that a migration carries on after it
                output, tokens, failure = take_ready(queue, first)
                starts_answer = completion == 0 and bool(tokens)
                completion += len(tokens)
                message = self._output(spec, output, completion, tokens, rank)
                if source is not None and source.source == "remote":
                    # the prompt was computed on the prefill worker: its cache hit is the client's
                    message.usage.cached_prompt_tokens = source.cached_tokens
                if source is not None and starts_answer:
                    message.disaggregated_params = disagg.encode(source)
                if output.finish_reason is None:
                    if request.whole_answer and starts_answer:
                        # the rest waits in the queue for the last output or a failure (decision 26):
                        # one wake-up, not one a step
                        queue.hold_until_last()
                    yield message
                    continue
                if prefill is not None:
                    message.disaggregated_params = disagg.encode(self.handoff.hand_off(spec, prefill, output))
                    handed_off = True
                self._count_finished(spec, output, completion)
                yield message
                log.info(
                    "request finished",
                    request_id=request_id,
                    completion_tokens=completion,
                    cached_tokens=output.cached_tokens,
                )
                return
        finally:
            if prefill is not None and not handed_off:
                self.handoff.prefill_failed(prefill, "the prefill did not finish")
            if not handed_off:
                # Runs on normal end too, where it is a no-op; on cancellation it frees the blocks.
                engine.abort(request_id)

    async def GenerateMany(
        self, request_iterator: AsyncIterator[common_pb2.GenerateCommands], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateBatch]:
        """Many requests over one stream, each served by :meth:`Generate` (docs/decisions/0021); a
        frontend's stream may be attached, and a router's hand requests on to it (docs/decisions/0030)."""
        multiplexer = RequestMultiplexer(self.Generate, "worker", self.attachments)
        async with contextlib.aclosing(multiplexer.serve(request_iterator)) as batches:
            async for batch in batches:
                yield batch

    async def _pull_prefix(self, request_id: str, pull: PrefixPull, rank: int) -> None:
        """Bring the prompt's prefix from the worker the router named before the engine sees the
        request (docs/decisions/0070); what does not arrive in time is computed as usual."""
        if self.moves is None or rank != 0:  # the moves serve rank 0's engine
            log.warning("prefix pull ignored: this engine cannot take blocks", request_id=request_id, rank=rank)
            return
        moved = await self.moves.pull_prefix(pull.worker_id, pull.address, pull.sequence_hashes)
        log.info(
            "prefix pulled",
            request_id=request_id,
            holder=pull.worker_id,
            blocks=moved.blocks,
            asked=len(pull.sequence_hashes),
            ms=round(moved.seconds * 1e3),
        )

    def _least_loaded_rank(self) -> int:
        """The rank for a request that names none (a client of this worker alone): the one running
        the fewest requests."""
        if len(self.ranks) == 1:
            return 0
        return min(range(len(self.ranks)), key=lambda rank: self.ranks[rank].status().running_requests)

    def _output(
        self, spec: EngineRequestSpec, output: TokenOutput, completion: int, tokens: list[int], rank: int = 0
    ) -> common_pb2.GenerateOutput:
        # Usage rides on every piece, so a client that stops early still knows its cached tokens.
        message = common_pb2.GenerateOutput(
            token_ids=tokens,
            worker_id=self.worker_id,
            dp_rank=rank,
            usage=common_pb2.Usage(
                prompt_tokens=len(spec.prompt),
                completion_tokens=completion,
                cached_prompt_tokens=output.cached_tokens,
            ),
        )
        if output.finish_reason is not None:
            message.finish_reason = to_proto(output.finish_reason)
        return message

    def _count_finished(self, spec: EngineRequestSpec, output: TokenOutput, completion: int) -> None:
        self.metrics.requests.labels(output.finish_reason.value).inc()
        self.metrics.prompt_tokens.inc(len(spec.prompt))
        self.metrics.cached_tokens.inc(output.cached_tokens)
        self.metrics.generated_tokens.inc(completion)

    async def DumpKvState(
        self, request: worker_pb2.DumpKvStateRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvStateDump:
        dp_rank, tier = request.dp_rank, request.tier or DEVICE_TIER
        if not request.tier:  # an indexer from before tiers were a field names one by a reserved rank
            dp_rank, tier = stream_of_v1_rank(dp_rank)
        dumped = None
        if dp_rank < len(self.ranks):
            engine = self.ranks[dp_rank]
            if tier == DEVICE_TIER:
                dumped = engine.dump_kv_state()
            elif tier == POOLED_TIER:
                dumped = engine.dump_pool_state()
            else:
                dumped = engine.dump_tier_state(tier)
        if dumped is None:
            await refuse(
                context,
                "worker",
                grpc.StatusCode.NOT_FOUND,
                f"this worker has dp ranks 0..{len(self.ranks) - 1}, and no {tier} tier at rank {dp_rank}",
            )
        last_event_id, blocks = dumped
        log.info("dumped KV state", dp_rank=dp_rank, tier=tier, last_event_id=last_event_id, blocks=len(blocks))
        cached = []
        for b in blocks:
            block = worker_pb2.CachedBlock(
                block_hash=b.block_hash, tokens_hash=b.tokens_hash, sequence_hash=b.sequence_hash
            )
            if b.parent_hash is not None:
                block.parent_hash = b.parent_hash
            cached.append(block)
        return worker_pb2.KvStateDump(
            worker_id=self.worker_id, dp_rank=dp_rank, last_event_id=last_event_id, blocks=cached
        )

    async def OfferBlocks(
        self, request: worker_pb2.OfferBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.BlockOffer:
        moves = await self._moves(context)
        if request.sequence_hashes:  # a prompt's prefix, for a worker told to pull it
            offer = moves.offer_prefix(request.sequence_hashes)
            log.info("prefix offered", blocks=len(offer.blocks), asked=len(request.sequence_hashes))
            return offer
        offer = moves.offer_hottest(request.max_blocks, set(request.skip), hold=not request.list_only)
        log.info("cached blocks offered", blocks=len(offer.blocks), asked=request.max_blocks)
        return offer

    async def TakeBlocks(
        self, request: worker_pb2.BlockOffer, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TakenBlocks:
        moves = await self._moves(context)
        if request.blocks and not (request.host and request.port and request.room):
            await refuse(context, "worker", grpc.StatusCode.INVALID_ARGUMENT, "an offer needs its host, port and room")
        moved = await moves.take(request)
        return worker_pb2.TakenBlocks(blocks=moved.blocks, bytes=moved.bytes, seconds=moved.seconds)

    async def _moves(self, context: grpc.aio.ServicerContext) -> CacheMoves:
        if self.moves is None:
            await refuse(
                context, "worker", grpc.StatusCode.FAILED_PRECONDITION, "this worker's engine cannot move cached blocks"
            )
        assert self.moves is not None
        return self.moves

    async def GetStatus(
        self, request: worker_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        status = self.engine.status()
        handoff = self.handoff
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id,
            model=self.model_name,
            block_size=status.block_size,
            total_blocks=status.total_blocks,
            cached_blocks=status.cached_blocks,
            active_blocks=status.active_blocks,
            running_requests=status.running_requests,
            waiting_requests=status.waiting_requests,
            kv_transfer_backend=handoff.backend if handoff else "",
            kv_transfers_in_flight=handoff.transfers_in_flight() if handoff else 0,
            held_prefills=status.held_prefills,
        )
