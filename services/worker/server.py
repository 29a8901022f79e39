"""The worker service: ``kvmesh.v1.Worker`` over the mock engine, KV events, discovery."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog

from services.common.discovery import new_instance_id
from services.common.grpc_errors import refuse
from services.common.metrics import MetricsEndpoint
from services.common.proto.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.requests import DEFAULT_MAX_TOKENS
from services.common.runtime import connect_nats
from services.common.service import registered_grpc_service, service_main
from services.common.streams import ensure_kv_events_stream
from services.common.timing import TimingModel
from services.worker.config import WorkerConfig
from services.worker.engine_loop import EngineLoop
from services.worker.event_publisher import KvEventPublisher
from services.worker.metrics import WorkerMetrics
from services.worker.mock_engine import EngineConfig, EngineRequestError, FinishReason, MockEngine

log = structlog.get_logger(__name__)

_FINISH = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


def build_engine(config: WorkerConfig) -> MockEngine:
    return MockEngine(
        EngineConfig(
            num_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            timing=TimingModel(speedup_ratio=config.speedup_ratio),
        )
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves ``Generate`` from the engine loop; a cancelled stream aborts its request and frees blocks."""

    def __init__(self, worker_id: int, config: WorkerConfig, loop: EngineLoop, metrics: WorkerMetrics) -> None:
        self.worker_id = worker_id
        self.config = config
        self.loop = loop
        self.metrics = metrics

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
        max_tokens = request.stop.max_tokens or DEFAULT_MAX_TOKENS
        seed = request.sampling.seed if request.sampling.HasField("seed") else 0
        lora = request.lora_name if request.HasField("lora_name") else None
        try:
            engine_request, queue = self.loop.submit(
                request_id, list(request.token_ids), max_tokens, list(request.stop.stop_token_ids), seed, lora
            )
        except EngineRequestError as exc:
            await refuse(context, "worker", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("request accepted", request_id=request_id, prompt_tokens=len(request.token_ids))
        completion = 0
        try:
            while True:
                output = await queue.get()
                completion += 1
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
                    self.metrics.requests.labels(output.finish_reason.value).inc()
                    self.metrics.prompt_tokens.inc(len(engine_request.prompt))
                    self.metrics.cached_tokens.inc(output.cached_tokens)
                    self.metrics.generated_tokens.inc(completion)
                    yield message
                    log.info(
                        "request finished",
                        request_id=request_id,
                        completion_tokens=completion,
                        cached_tokens=output.cached_tokens,
                    )
                    return
                yield message
        finally:
            # Runs on normal end too, where it is a no-op; on cancellation it frees the blocks.
            self.loop.abort(request_id)

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
    loop = EngineLoop(build_engine(config), publisher)
    loop.start()
    metrics = WorkerMetrics(loop.engine, publisher)
    endpoint = MetricsEndpoint(config, metrics.registry)
    servicer = WorkerServicer(worker_id, config, loop, metrics)
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
                **endpoint.discovery_extra(),
            },
        ) as record:
            log.info("worker ready", address=record.address, engine=config.engine, role=config.role)
            await stop.wait()
            log.info("worker shutting down")
    finally:
        endpoint.close()
        await loop.stop()
        await publisher.stop()
        await nc.close()


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        WorkerConfig,
        argv,
        service="worker",
        description="Run an inference worker (kvmesh.v1.Worker) that publishes its KV cache events.",
        serve=serve,
    )
