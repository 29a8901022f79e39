"""The worker service: ``kvmesh worker``. Builds the engine, its KV event publisher and KV transfer,
serves ``kvmesh.v1.Worker`` (:mod:`~kvmesh.worker.servicer`) and stays registered in discovery."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import structlog

from kvmesh.common.core.timing import TimingModel, as_constants
from kvmesh.common.proto.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.config import advertised_host
from kvmesh.common.runtime.discovery import Registration, new_instance_id
from kvmesh.common.runtime.heap import freeze_startup_heap
from kvmesh.common.runtime.kv_event_stream import ensure_kv_events_stream
from kvmesh.common.runtime.metrics import MetricsEndpoint
from kvmesh.common.runtime.service import ServiceStack, service_main
from kvmesh.common.wire.kv_events import (
    HOST_DP_RANK,
    HOST_TIER,
    POOL_DP_RANK,
    POOLED_TIER,
    TIER_DP_RANKS,
    parse_moe_placements,
)
from kvmesh.common.wire.lora import ADAPTERS_KEY, RESIDENT_KEY, adapter_paths
from kvmesh.common.wire.worker_key import DATA_PARALLEL_KEY
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.connector_handover import ConnectorHandover
from kvmesh.worker.engine import Engine
from kvmesh.worker.engine_loop import MockEngineLoop
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.kv_buffer import KvBuffer, KvLayout
from kvmesh.worker.kv_handover import Handover, KvHandover, KvTransfer
from kvmesh.worker.kv_pool import KvPool
from kvmesh.worker.kv_transfer import KvTransferClient, KvTransferServer, TransferStats
from kvmesh.worker.lora_slots import AdapterSlots
from kvmesh.worker.metrics import TransferView, WorkerMetrics
from kvmesh.worker.mock_engine import EngineConfig, MockEngine
from kvmesh.worker.nixl_agent import NixlAgent
from kvmesh.worker.served_engine import ServedEngine
from kvmesh.worker.servicer import WorkerServicer
from kvmesh.worker.vllm_defaults import require_vllm
from kvmesh.worker.vllm_engine import VllmEngine

log = structlog.get_logger(__name__)


def kv_layout(config: WorkerConfig) -> KvLayout:
    return KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, config.kv_dtype_bytes)


def build_mock_engine(config: WorkerConfig, kv: KvBuffer | None = None) -> MockEngine:
    return MockEngine(
        EngineConfig(
            num_blocks=config.mock_shape("num_gpu_blocks"),
            block_size=config.mock_shape("block_size"),
            max_num_seqs=config.mock_shape("max_num_seqs"),
            max_num_batched_tokens=config.mock_shape("max_num_batched_tokens"),
            timing=TimingModel(speedup_ratio=config.speedup_ratio),
            moe_placements=parse_moe_placements(config.moe_experts),
            host_blocks=config.host_kv_blocks,
            host_reload_ms_per_token=config.host_reload_ms_per_token,
        ),
        kv,
    )


async def advertise_timing_forever(engine: Engine, registration: Registration, period_s: float) -> None:
    """Put the engine's fitted step-time constants into this worker's discovery record, for the
    routers' ttft cost (each worker its own: heterogeneous workers get different costs)."""
    while True:
        await asyncio.sleep(period_s)
        fitted = engine.fitted_timing()
        if fitted is None:
            continue
        constants = as_constants(fitted)
        record = registration.record
        if record.extra.get("timing") != constants:
            await registration.update(dataclasses.replace(record, extra={**record.extra, "timing": constants}))


async def advertise_adapters_forever(slots: AdapterSlots, registration: Registration) -> None:
    """Put the LoRA adapters loaded now into this worker's discovery record whenever they change,
    for the routers' load charge (only for a worker that cannot hold all it serves at once)."""
    while True:
        await slots.changed.wait()
        slots.changed.clear()
        record = registration.record
        await registration.update(dataclasses.replace(record, extra={**record.extra, RESIDENT_KEY: slots.loaded()}))


def vllm_overrides(config: WorkerConfig) -> dict[str, object]:
    """The worker's options that are also vLLM engine arguments (None: vLLM's own default)."""
    overrides: dict[str, object] = {
        "block_size": config.block_size,
        "num_gpu_blocks_override": config.num_gpu_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "served_model_name": [config.model_name],
    }
    adapters = adapter_paths(config.lora_adapters)
    if adapters:
        # vLLM holds max_cpu_loras adapters loaded and loads others from disk on demand, least
        # recently used out first: the worker's slots mirror that cache
        slots = min(config.max_loras or len(adapters), len(adapters))
        overrides |= {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots}
    return overrides


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
        nc = await stack.nats(config, f"kvmesh-worker-{worker_id}")
        js = nc.jetstream()
        await ensure_kv_events_stream(js, config.kv_events_max_age)
        flush = config.kv_events_flush_ms / 1000
        publisher = await stack.start(publisher_class(js, config.namespace, worker_id, flush_interval_s=flush))
        handover: Handover | None = None
        extra: dict[str, object] = {"engine": config.engine, "kv_handoff": config.resolved_kv_handoff()}
        adapters = adapter_paths(config.lora_adapters)
        ranks: list[Engine] = []  # data-parallel ranks past the first (rank 0 is `engine`)
        # their KV events go out as their own dp ranks, whichever engine runs them
        rank_publishers = [
            await stack.start(publisher_class(js, config.namespace, worker_id, dp_rank=rank, flush_interval_s=flush))
            for rank in range(1, config.data_parallel_size)
        ]
        slots: AdapterSlots | None = None
        if adapters:
            # the mock simulates a load's time; vLLM loads an adapter itself on its first request
            load_s = config.lora_load_ms / 1000 if config.engine == "mock" else 0.0
            slots = AdapterSlots(list(adapters), config.max_loras, load_s)
            extra[ADAPTERS_KEY] = list(adapters)
            if slots.limited:
                extra[RESIDENT_KEY] = slots.loaded()
        if config.engine == "served":
            assert config.engine_url is not None  # validated
            engine = await stack.start(
                ServedEngine(
                    config.engine_url,
                    publisher.enqueue,
                    lambda: publisher.last_event_id,
                    block_size=config.block_size,
                    kv_events=config.engine_kv_events,
                    kv_replay=config.engine_kv_replay,
                )
            )
        elif config.engine == "vllm":
            # prefill and decode workers move KV with vLLM's NIXL connector; aggregated ones need none
            connector_host = None if config.role == "aggregated" else advertised_host(config)
            # the blocks an offloading connector keeps in CPU memory or on disk, each tier its own dp rank
            tiers = {}
            for tier, rank in TIER_DP_RANKS.items():
                tier_publisher = await stack.start(
                    publisher_class(js, config.namespace, worker_id, dp_rank=rank, tier=tier, flush_interval_s=flush)
                )
                tiers[tier] = (tier_publisher.enqueue, lambda p=tier_publisher: p.last_event_id)
            vllm = VllmEngine(
                config.engine_args,
                vllm_overrides(config),
                publisher.enqueue,
                lambda: publisher.last_event_id,
                kv_connector_host=connector_host,
                tier_publishers=tiers,
                lora_paths={name: path for name, path in adapters.items() if path},
                # vLLM's engine cores past the first, each one's events as its rank
                rank_publishers=[(p.enqueue, lambda p=p: p.last_event_id) for p in rank_publishers],
            )
            engine: Engine = await stack.start(vllm)
            ranks.extend(vllm.ranks)
            if connector_host is not None:
                handover = ConnectorHandover(worker_id, vllm, config.kv_transfer_timeout_secs)
                extra["kv_transfer_backend"] = handover.backend
        else:
            shape = kv_layout(config).block_bytes(config.mock_shape("block_size"))
            kv = KvBuffer(config.mock_shape("num_gpu_blocks"), shape)
            pool, pool_publisher = None, None
            if config.kv_pool:
                pool = KvPool(Path(config.kv_pool), worker_id, shape, config.kv_pool_blocks)
                stack.callback(pool.close)  # runs after the engine stops: a clean stop removes the segment
                pool_publisher = await stack.start(
                    publisher_class(
                        js, config.namespace, worker_id, dp_rank=POOL_DP_RANK, tier=POOLED_TIER, flush_interval_s=flush
                    )
                )
                extra["kv_pool"] = pool.pool_id
            host_publisher = None
            if config.host_kv_blocks:
                host_publisher = await stack.start(
                    publisher_class(
                        js, config.namespace, worker_id, dp_rank=HOST_DP_RANK, tier=HOST_TIER, flush_interval_s=flush
                    )
                )
            engine = await stack.start(
                MockEngineLoop(build_mock_engine(config, kv), publisher, pool, pool_publisher, host_publisher)
            )
            # data-parallel ranks past the first: an engine each, its KV its own, its events as its rank
            for rank_publisher in rank_publishers:
                rank_kv = KvBuffer(config.mock_shape("num_gpu_blocks"), shape)
                ranks.append(await stack.start(MockEngineLoop(build_mock_engine(config, rank_kv), rank_publisher)))
            transfer = await start_kv_transfer(stack, config, worker_id, kv, engine)
            handover = KvHandover(worker_id, engine, transfer, config.kv_transfer_timeout_secs)
            extra |= {
                "kv_transfer_host": transfer.host,
                "kv_transfer_port": transfer.server.port,
                "kv_transfer_backend": transfer.backend,
            }
        if config.data_parallel_size > 1:
            extra[DATA_PARALLEL_KEY] = config.data_parallel_size
        transfer_view = None
        if isinstance(handover, KvHandover):
            transfer_view = TransferView.of_server(handover.transfer.server)
        elif isinstance(handover, ConnectorHandover):
            transfer_view = TransferView(handover.backend, vllm.transfer_stats)
        metrics = WorkerMetrics(engine, publisher, transfer_view)
        endpoint = MetricsEndpoint(config, metrics.registry)
        stack.push_async_callback(endpoint.close)
        servicer = WorkerServicer(worker_id, config.model_name, engine, metrics, handover, slots, [engine, *ranks])
        status = engine.status()
        registration = await stack.grpc_service(
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
            extra={"max_num_batched_tokens": engine.max_num_batched_tokens, **extra, **endpoint.discovery_extra()},
        )
        record = registration.record
        stack.task(advertise_timing_forever(engine, registration, config.timing_advertise_secs), "advertise-timing")
        if slots is not None and slots.limited:
            stack.task(advertise_adapters_forever(slots, registration), "advertise-adapters")
        log.info(
            "worker ready",
            address=record.address,
            engine=config.engine,
            role=config.role,
            block_size=status.block_size,
            kv_transfer_backend=extra.get("kv_transfer_backend"),
        )
        freeze_startup_heap()  # the engine, model and connections live as long as the process
        await stop.wait()
        log.info("worker shutting down")


async def start_kv_transfer(
    stack: ServiceStack, config: WorkerConfig, worker_id: int, kv: KvBuffer, engine: Engine
) -> KvTransfer:
    """The transfer server (serving held prefills) and client (pulling them), on the chosen backend;
    the server stops when ``stack`` unwinds."""
    backend = config.resolved_transfer_backend()
    nixl = None
    if backend == "nixl":
        # NIXL's agent start blocks for a while; keep the event loop (and lease refreshes) going
        nixl = await asyncio.to_thread(NixlAgent, f"kvmesh-worker-{worker_id}", kv)
    stats = TransferStats()
    server = KvTransferServer(kv, engine.release_held, config.disagg_hold_timeout_secs, nixl, stats)
    await server.start(config.host, config.kv_transfer_port)
    stack.push_async_callback(server.stop)
    client = KvTransferClient(kv, nixl, stats)
    log.info("KV transfer ready", backend=backend, port=server.port)
    return KvTransfer(server, client, advertised_host(config))


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
