"""The worker service: ``kvmesh.v1.Worker`` over the mock engine, KV events, discovery, KV transfer.

A request may carry ``disaggregated_params`` (services/common/disagg.py): ``prefill`` makes this
worker prefill and then hold the prompt's KV for a decode worker; ``decode`` makes it pull the
prompt's KV from a prefill worker (retrying once) before decoding, or prefill locally when that
fails and the router allowed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from kvmesh.common.disagg import DECODE, KV_SOURCE, PREFILL, PREFILLED, DisaggParams, DisaggParamsError
from kvmesh.common.discovery import new_instance_id
from kvmesh.common.grpc_errors import refuse
from kvmesh.common.metrics import MetricsEndpoint
from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.common.requests import DEFAULT_MAX_TOKENS
from kvmesh.common.runtime import connect_nats
from kvmesh.common.service import registered_grpc_service, service_main
from kvmesh.common.streams import ensure_kv_events_stream
from kvmesh.common.timing import TimingModel
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine_loop import EngineLoop
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.kv_buffer import KvBuffer, KvLayout
from kvmesh.worker.kv_transfer import (
    KvTransferClient,
    KvTransferServer,
    NixlAgent,
    TransferError,
    TransferStats,
)
from kvmesh.worker.metrics import WorkerMetrics
from kvmesh.worker.mock_engine import (
    EngineConfig,
    EngineRequest,
    EngineRequestError,
    FinishReason,
    MockEngine,
    TokenOutput,
    transferable_blocks,
)

log = structlog.get_logger(__name__)

_FINISH = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


class Refusal(Exception):
    """A request this worker turns down with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def kv_layout(config: WorkerConfig) -> KvLayout:
    return KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, config.kv_dtype_bytes)


def build_engine(config: WorkerConfig, kv: KvBuffer | None = None) -> MockEngine:
    return MockEngine(
        EngineConfig(
            num_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            timing=TimingModel(speedup_ratio=config.speedup_ratio),
        ),
        kv,
    )


@dataclass
class KvTransfer:
    """This worker's two ends of a KV transfer and where others reach its server."""

    server: KvTransferServer
    client: KvTransferClient
    host: str

    @property
    def backend(self) -> str:
        return self.server.backend

    @property
    def stats(self) -> TransferStats:
        """Shared by server and client: what moved, both ways."""
        return self.server.stats


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves ``Generate`` from the engine loop; a cancelled stream aborts its request and frees blocks."""

    def __init__(
        self, worker_id: int, config: WorkerConfig, loop: EngineLoop, metrics: WorkerMetrics, transfer: KvTransfer
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.loop = loop
        self.metrics = metrics
        self.transfer = transfer
        self._tasks: set[asyncio.Future[None]] = set()

    async def Generate(
        self, request: common_pb2.PreprocessedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        request_id = request.request_id
        if not request_id:
            await refuse(context, "worker", grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if request.model and request.model != self.config.model_name:
            await refuse(
                context,
                "worker",
                grpc.StatusCode.NOT_FOUND,
                f"this worker serves model {self.config.model_name!r}, not {request.model!r}",
            )
        params: DisaggParams | None = None
        if request.disaggregated_params:
            try:
                params = DisaggParams.decode(request.disaggregated_params)
            except DisaggParamsError as exc:
                await refuse(context, "worker", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if params.kind not in (PREFILL, DECODE):
                await refuse(
                    context,
                    "worker",
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a request cannot carry {params.kind!r} params",
                )
        prefill = params is not None and params.kind == PREFILL
        handed_over = False
        try:
            try:
                if params is not None and params.kind == DECODE:
                    engine_request, queue, source = await self._receive_kv(request, params)
                else:
                    engine_request, queue = self.loop.submit(*self._engine_args(request), hold_on_finish=prefill)
                    source = None
            except EngineRequestError as exc:
                await refuse(context, "worker", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Refusal as exc:
                await refuse(context, "worker", exc.code, str(exc))
            log.info(
                "request accepted",
                request_id=request_id,
                prompt_tokens=len(request.token_ids),
                disagg=params.kind if params else None,
                kv_source=source.source if source else None,
            )
            completion = 0
            while True:
                output = await queue.get()
                completion += 1
                message = self._output(engine_request, output, completion)
                if source is not None and completion == 1:
                    message.disaggregated_params = source.encode()
                if output.finish_reason is None:
                    yield message
                    continue
                if prefill:
                    message.disaggregated_params = self._hand_over(engine_request, params).encode()
                    handed_over = True
                self._count_finished(engine_request, output, completion)
                yield message
                log.info(
                    "request finished",
                    request_id=request_id,
                    completion_tokens=completion,
                    cached_tokens=output.cached_tokens,
                )
                return
        finally:
            if prefill and not handed_over:
                self.transfer.server.fail(params.room, "the prefill did not finish")
            if not handed_over:
                # Runs on normal end too, where it is a no-op; on cancellation it frees the blocks.
                self.loop.abort(request_id)

    def _engine_args(
        self, request: common_pb2.PreprocessedRequest
    ) -> tuple[str, list[int], int, list[int], int, str | None]:
        max_tokens = request.stop.max_tokens or DEFAULT_MAX_TOKENS
        seed = request.sampling.seed if request.sampling.HasField("seed") else 0
        lora = request.lora_name if request.HasField("lora_name") else None
        return request.request_id, list(request.token_ids), max_tokens, list(request.stop.stop_token_ids), seed, lora

    def _output(self, engine_request: EngineRequest, output: TokenOutput, completion: int) -> common_pb2.GenerateOutput:
        # Usage rides on every piece, so a client that stops early still knows its cached tokens.
        message = common_pb2.GenerateOutput(
            token_ids=[output.token_id],
            worker_id=self.worker_id,
            dp_rank=0,
            usage=common_pb2.Usage(
                prompt_tokens=len(engine_request.prompt),
                completion_tokens=completion,
                cached_prompt_tokens=output.cached_tokens,
            ),
        )
        if output.finish_reason is not None:
            message.finish_reason = _FINISH[output.finish_reason]
        return message

    def _count_finished(self, engine_request: EngineRequest, output: TokenOutput, completion: int) -> None:
        self.metrics.requests.labels(output.finish_reason.value).inc()
        self.metrics.prompt_tokens.inc(len(engine_request.prompt))
        self.metrics.cached_tokens.inc(output.cached_tokens)
        self.metrics.generated_tokens.inc(completion)

    def _hand_over(self, engine_request: EngineRequest, params: DisaggParams) -> DisaggParams:
        """The prefill is done: hold its transferable blocks for the room, say where they are."""
        count = transferable_blocks(len(engine_request.prompt), self.loop.engine.block_size)
        slots = [block.slot for block in engine_request.blocks[:count]]
        self.transfer.server.ready(params.room, engine_request.request_id, slots)
        return DisaggParams(
            PREFILLED,
            room=params.room,
            host=self.transfer.host,
            port=self.transfer.server.port,
            worker_id=self.worker_id,
            blocks=count,
            backend=self.transfer.backend,
        )

    async def _receive_kv(
        self, request: common_pb2.PreprocessedRequest, params: DisaggParams
    ) -> tuple[EngineRequest, asyncio.Queue[TokenOutput], DisaggParams]:
        """Pull the prompt's KV from the prefill worker into reserved blocks (one retry), or fall
        back to a local prefill when allowed. Returns the engine request, its token queue and where
        its KV came from."""
        args = self._engine_args(request)
        request_id = request.request_id
        plan, queue = self.loop.submit_remote(*args)
        if plan is None or plan.num_blocks == 0:
            reason = "decode_memory" if plan is None else "cached"
            if plan is None and not params.allow_local:
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV memory free to receive the prefill")
            # Let the prefill worker release what it holds for us, without making this request wait.
            self._background(self._decline(params))
            if plan is None:
                engine_request, queue = self.loop.submit(*args)
            else:
                engine_request = plan.request
                self.loop.finish_transfer(request_id, True)
            return engine_request, queue, DisaggParams(KV_SOURCE, source="local", reason=reason)
        error = "no attempt"
        for attempt in (1, 2):
            try:
                result = await self.transfer.client.pull(
                    params.host,
                    params.port,
                    params.room,
                    plan.first_block,
                    plan.slots,
                    plan.sequence_hashes,
                    self.config.kv_transfer_timeout_secs,
                )
            except TransferError as exc:
                error = str(exc)
                log.warning("KV transfer failed", attempt=attempt, error=error, prefill_worker=params.worker_id)
                if not exc.retryable:
                    break
                continue
            self.loop.finish_transfer(request_id, True)
            log.info(
                "KV received",
                backend=result.backend,
                blocks=plan.num_blocks,
                bytes=result.bytes,
                ms=round(result.seconds * 1000, 3),
                cached_blocks=plan.first_block,
            )
            return (
                plan.request,
                queue,
                DisaggParams(
                    KV_SOURCE, source="remote", backend=result.backend, bytes=result.bytes, blocks=plan.num_blocks
                ),
            )
        if not params.allow_local:
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE, f"remote prefill failed and local prefill is not allowed: {error}"
            )
        self.loop.finish_transfer(request_id, False)
        return plan.request, queue, DisaggParams(KV_SOURCE, source="local", reason="transfer_failed")

    async def _decline(self, params: DisaggParams) -> None:
        try:
            await self.transfer.client.pull(
                params.host, params.port, params.room, 0, [], [], self.config.kv_transfer_timeout_secs
            )
        except TransferError as exc:
            log.info("could not release a prefill's held KV; it expires on its own", error=str(exc))

    def _background(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def DumpKvState(
        self, request: worker_pb2.DumpKvStateRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvStateDump:
        if request.dp_rank != 0:
            await refuse(
                context, "worker", grpc.StatusCode.NOT_FOUND, f"this worker has only dp rank 0, not {request.dp_rank}"
            )
        last_event_id, blocks = self.loop.dump_state()
        log.info("dumped KV state", last_event_id=last_event_id, blocks=len(blocks))
        cached = []
        for block_hash, tokens_hash, parent_hash in blocks:
            # the mock engine's block id is our sequence hash
            block = worker_pb2.CachedBlock(block_hash=block_hash, tokens_hash=tokens_hash, sequence_hash=block_hash)
            if parent_hash is not None:
                block.parent_hash = parent_hash
            cached.append(block)
        return worker_pb2.KvStateDump(worker_id=self.worker_id, dp_rank=0, last_event_id=last_event_id, blocks=cached)

    async def GetStatus(
        self, request: worker_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        engine = self.loop.engine
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id,
            model=self.config.model_name,
            block_size=engine.block_size,
            total_blocks=engine.config.num_blocks,
            cached_blocks=engine.blocks.num_cached,
            active_blocks=engine.blocks.num_active,
            running_requests=len(engine.running),
            waiting_requests=len(engine.waiting),
            kv_transfer_backend=self.transfer.backend,
            kv_transfers_in_flight=self.transfer.stats.in_flight,
            held_prefills=len(engine.held),
        )


async def serve(
    config: WorkerConfig,
    stop: asyncio.Event,
    worker_id: int | None = None,
    publisher_class: type[KvEventPublisher] = KvEventPublisher,
) -> None:
    """Run a worker until ``stop`` is set. ``publisher_class`` lets a failure drill swap in a lossy
    publisher; the service itself always uses :class:`KvEventPublisher`."""
    worker_id = worker_id if worker_id is not None else new_instance_id()
    structlog.contextvars.bind_contextvars(worker_id=worker_id)
    nc = await connect_nats(config.nats_url, name=f"kvmesh-worker-{worker_id}")
    js = nc.jetstream()
    await ensure_kv_events_stream(js, config.kv_events_max_age)
    publisher = publisher_class(js, config.namespace, worker_id)
    publisher.start()
    kv = KvBuffer(config.num_gpu_blocks, kv_layout(config).block_bytes(config.block_size))
    loop = EngineLoop(build_engine(config, kv), publisher)
    loop.start()
    transfer = await start_kv_transfer(config, worker_id, kv, loop)
    metrics = WorkerMetrics(loop.engine, publisher, transfer.server)
    endpoint = MetricsEndpoint(config, metrics.registry)
    servicer = WorkerServicer(worker_id, config, loop, metrics, transfer)
    try:
        async with registered_grpc_service(
            js,
            config,
            component="worker",
            instance_id=worker_id,
            service_name=worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
            add_servicer=lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server),
            role=config.role,
            model=config.model_name,
            block_size=config.block_size,
            capacity_blocks=config.num_gpu_blocks,
            extra={
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "engine": config.engine,
                "kv_transfer_host": transfer.host,
                "kv_transfer_port": transfer.server.port,
                "kv_transfer_backend": transfer.backend,
                **endpoint.discovery_extra(),
            },
        ) as record:
            log.info(
                "worker ready",
                address=record.address,
                engine=config.engine,
                role=config.role,
                kv_transfer_backend=transfer.backend,
                kv_transfer_port=transfer.server.port,
                kv_block_bytes=kv.block_bytes,
            )
            await stop.wait()
            log.info("worker shutting down")
    finally:
        await endpoint.close()
        await transfer.server.stop()
        await loop.stop()
        await publisher.stop()
        await nc.close()


async def start_kv_transfer(config: WorkerConfig, worker_id: int, kv: KvBuffer, loop: EngineLoop) -> KvTransfer:
    """The transfer server (serving held prefills) and client (pulling them), on the chosen backend."""
    backend = config.resolved_transfer_backend()
    nixl = None
    if backend == "nixl":
        # NIXL's agent start blocks for a while; keep the event loop (and lease refreshes) going
        nixl = await asyncio.to_thread(NixlAgent, f"kvmesh-worker-{worker_id}", kv)
    stats = TransferStats()
    server = KvTransferServer(kv, loop.release_held, config.disagg_hold_timeout_secs, nixl, stats)
    await server.start(config.host, config.kv_transfer_port)
    client = KvTransferClient(kv, nixl, stats)
    log.info("KV transfer ready", backend=backend, port=server.port)
    return KvTransfer(server, client, config.advertise_host or config.host)


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        WorkerConfig,
        argv,
        service="worker",
        description=(
            "Run an inference worker (kvmesh.v1.Worker) that publishes its KV cache events and moves KV "
            "to and from other workers (NIXL or TCP) for prefill/decode disaggregation."
        ),
        serve=serve,
    )
