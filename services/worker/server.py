"""The worker service: ``kvmesh worker``. Starts the engine ``--engine`` names (the one factory,
:mod:`~kvmesh.worker.engines.factory`), serves ``kvmesh.v1.Worker`` (:mod:`~kvmesh.worker.servicer`)
and stays registered in discovery, advertising what routers cost it by."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import structlog

from kvmesh.common.core.timing import as_constants
from kvmesh.common.proto.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import InstanceRecord, Registration, new_instance_id, registered_now
from kvmesh.common.runtime.heap import freeze_startup_heap
from kvmesh.common.runtime.kv_event_stream import ensure_kv_events_stream
from kvmesh.common.runtime.metrics import MetricsEndpoint
from kvmesh.common.runtime.service import ServiceStack, service_main
from kvmesh.common.wire.disagg import MOVES_BLOCKS_KEY
from kvmesh.common.wire.gateway_endpoint import GATEWAY_ENDPOINT_KEY, endpoint_of_url
from kvmesh.common.wire.lora import ADAPTERS_KEY, RESIDENT_KEY, adapter_paths
from kvmesh.common.wire.step_timing import SPEED_CLASS_KEY, TIMING_EVIDENCE_KEY, TIMING_KEY
from kvmesh.common.wire.worker_key import DATA_PARALLEL_KEY, POD_KEY
from kvmesh.worker.cache_moves import CacheMoves
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine import Engine
from kvmesh.worker.engines.factory import start_engine
from kvmesh.worker.engines.started import EventPublishers, StartedEngine
from kvmesh.worker.engines.vllm.vllm_defaults import require_vllm
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.kv_transfer.handoff import TransferHandoff
from kvmesh.worker.lora_slots import AdapterSlots
from kvmesh.worker.metrics import WorkerMetrics
from kvmesh.worker.servicer import WorkerServicer

log = structlog.get_logger(__name__)


async def serve(
    config: WorkerConfig,
    stop: asyncio.Event,
    worker_id: int | None = None,
    publisher_class: type[KvEventPublisher] = KvEventPublisher,
) -> None:
    """Run a worker until ``stop`` is set. ``publisher_class`` lets a failure drill swap in a lossy
    publisher; the service itself always uses :class:`KvEventPublisher`."""
    if config.engine == "vllm":
        require_vllm(split_roles=config.role != "aggregated")  # one line, before anything starts
    worker_id = worker_id if worker_id is not None else new_instance_id()
    structlog.contextvars.bind_contextvars(worker_id=worker_id)
    async with ServiceStack() as stack:
        # 1. NATS and the KV event stream the engine publishes to
        js = (await stack.nats(config, f"kvmesh-worker-{worker_id}")).jetstream()
        await ensure_kv_events_stream(js, config.kv_events_max_age)
        # 2. the LoRA adapters it serves, and the engine
        slots, adapter_extra = adapter_slots(config)
        publishers = EventPublishers(stack, js, config, worker_id, publisher_class)
        started = await start_engine(config, stack, publishers, worker_id)
        # 3. kvmesh.v1.Worker and its metrics
        moves = cache_moves(config, worker_id, started)
        metrics = WorkerMetrics(started.engine, started.publisher, started.transfer_view, moves)
        endpoint = MetricsEndpoint(config, metrics.registry)
        stack.push_async_callback(endpoint.close)
        ranks = [started.engine, *started.ranks]
        servicer = WorkerServicer(
            worker_id, config.model_name, started.engine, metrics, started.handoff, slots, ranks, moves
        )
        # 4. warm (with --join-warmup-blocks), then registered last (deregistered first), with what
        # routers cost it by
        if moves is not None and config.join_warmup_blocks:
            await moves.warm_up(
                lambda: worker_peers(js, config, worker_id), config.join_warmup_blocks, config.join_warmup_secs
            )
        extra = {**started.extra, **adapter_extra, **endpoint.discovery_extra(), **gateway_extra(config)}
        if moves is not None:  # routers may tell it to pull a prefix, and others to pull from it
            extra[MOVES_BLOCKS_KEY] = True
        if config.pod_name:
            extra[POD_KEY] = config.pod_name
        registration = await register(stack, js, config, worker_id, started, servicer, extra)
        # 5. kept up to date while it serves
        stack.task(advertise_timing_forever(started.engine, registration, config.timing_advertise_secs), "timing")
        if slots is not None and slots.limited:
            stack.task(advertise_adapters_forever(slots, registration), "advertise-adapters")
        log.info(
            "worker ready",
            address=registration.record.address,
            engine=config.engine,
            role=config.role,
            block_size=started.engine.status().block_size,
            kv_transfer_backend=extra.get("kv_transfer_backend"),
        )
        freeze_startup_heap()  # the engine, model and connections live as long as the process
        await stop.wait()
        log.info("worker shutting down")
        if moves is not None and config.shrink_handoff_blocks:
            # out of discovery first: no new request comes while the cache is handed on
            await registration.stop()
            await moves.hand_on(lambda: worker_peers(js, config, worker_id), config.shrink_handoff_blocks)


def cache_moves(config: WorkerConfig, worker_id: int, started: StartedEngine) -> CacheMoves | None:
    """The worker's cached-block moves to and from other workers (None: its engine cannot move its
    blocks over a transfer of its own)."""
    handoff = started.handoff
    if not started.engine.moves_blocks or not isinstance(handoff, TransferHandoff):
        return None
    return CacheMoves(worker_id, started.engine, handoff.transfer, config.kv_transfer_timeout_secs)


async def worker_peers(js, config: WorkerConfig, worker_id: int) -> list[InstanceRecord]:
    """The other registered workers of this worker's role and model, as discovery shows them now."""
    records = await registered_now(js, config.namespace, "worker")
    return [r for r in records if r.instance_id != worker_id and r.role == config.role and r.model == config.model_name]


def adapter_slots(config: WorkerConfig) -> tuple[AdapterSlots | None, dict[str, object]]:
    """The LoRA adapters' slots (None: it serves none) and what its discovery record says of them."""
    adapters = adapter_paths(config.lora_adapters)
    if not adapters:
        return None, {}
    # the mock simulates a load's time; vLLM loads an adapter itself on its first request
    load_s = config.lora_load_ms / 1000 if config.engine == "mock" else 0.0
    slots = AdapterSlots(list(adapters), config.max_loras, load_s)
    extra: dict[str, object] = {ADAPTERS_KEY: list(adapters)}
    if slots.limited:
        extra[RESIDENT_KEY] = slots.loaded()
    return slots, extra


async def register(
    stack: ServiceStack,
    js,
    config: WorkerConfig,
    worker_id: int,
    started: StartedEngine,
    servicer: WorkerServicer,
    extra: dict[str, object],
) -> Registration:
    """Serve ``servicer`` over gRPC and register the worker: its role, model, cache shape, step
    token budget, data-parallel ranks and speed class, and ``extra``."""
    engine = started.engine
    status = engine.status()
    if config.data_parallel_size > 1:
        extra[DATA_PARALLEL_KEY] = config.data_parallel_size
    speed_class = config.speed_class or engine.speed_class
    if speed_class:
        extra[SPEED_CLASS_KEY] = speed_class
    return await stack.grpc_service(
        js,
        config,
        component="worker",
        instance_id=worker_id,
        service_name=worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
        add_servicer=lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server),
        role=config.role,
        model=config.model_name,
        block_size=status.block_size,
        capacity_blocks=status.total_blocks,
        extra={"max_num_batched_tokens": engine.max_num_batched_tokens, **extra},
    )


def gateway_extra(config: WorkerConfig) -> dict[str, object]:
    """The model server address a gateway's endpoint picker names for this worker (none: the worker
    is not reachable over HTTP, and the picker passes it over)."""
    endpoint = config.gateway_endpoint
    if endpoint is None and config.engine == "served" and config.engine_url:
        endpoint = endpoint_of_url(config.engine_url)
    return {GATEWAY_ENDPOINT_KEY: endpoint} if endpoint else {}


async def advertise_timing_forever(engine: Engine, registration: Registration, period_s: float) -> None:
    """Put the engine's fitted step-time constants, and the steps they were fitted on, into this
    worker's discovery record for the routers' ttft cost: a router pools the steps of a model's
    workers and costs each at its own speed (docs/decisions/0061), so heterogeneous workers still
    get different costs."""
    while True:
        await asyncio.sleep(period_s)
        fitted = engine.fitted_timing()
        if fitted is None:
            continue
        timing = {TIMING_KEY: as_constants(fitted)}
        evidence = engine.timing_evidence()
        if evidence is not None:
            timing[TIMING_EVIDENCE_KEY] = evidence.to_wire()
        record = registration.record
        if any(record.extra.get(key) != value for key, value in timing.items()):
            await registration.update(dataclasses.replace(record, extra={**record.extra, **timing}))


async def advertise_adapters_forever(slots: AdapterSlots, registration: Registration) -> None:
    """Put the LoRA adapters loaded now into this worker's discovery record whenever they change,
    for the routers' load charge (only for a worker that cannot hold all it serves at once)."""
    while True:
        await slots.changed.wait()
        slots.changed.clear()
        record = registration.record
        await registration.update(dataclasses.replace(record, extra={**record.extra, RESIDENT_KEY: slots.loaded()}))


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
