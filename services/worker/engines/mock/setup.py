"""The mock engine's setup: its KV buffer, the host tier's and the KV pool's publishers, one engine
loop per data-parallel rank, and the worker's own KV transfer (TCP or NIXL) for disaggregation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.runtime.config import advertised_host
from kvmesh.common.runtime.service import ServiceStack
from kvmesh.common.wire.kv_events import HOST_TIER, POOLED_TIER, parse_moe_placements
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine import Engine
from kvmesh.worker.engines.mock.engine_loop import MockEngineLoop
from kvmesh.worker.engines.mock.mock_engine import EngineConfig, MockEngine
from kvmesh.worker.engines.started import EventPublishers, StartedEngine
from kvmesh.worker.kv_transfer.handoff import KvTransfer, TransferHandoff
from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer, KvLayout
from kvmesh.worker.kv_transfer.kv_pool import KvPool
from kvmesh.worker.kv_transfer.nixl_agent import NixlAgent
from kvmesh.worker.kv_transfer.transport import KvTransferClient, KvTransferServer, TransferStats
from kvmesh.worker.metrics import TransferView

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


async def start(
    config: WorkerConfig, stack: ServiceStack, publishers: EventPublishers, worker_id: int
) -> StartedEngine:
    shape = kv_layout(config).block_bytes(config.mock_shape("block_size"))
    kv = KvBuffer(config.mock_shape("num_gpu_blocks"), shape)
    extra: dict[str, object] = {}
    pool, pool_publisher = None, None
    if config.kv_pool:
        pool = KvPool(Path(config.kv_pool), worker_id, shape, config.kv_pool_blocks)
        stack.callback(pool.close)  # runs after the engine stops: a clean stop removes the segment
        pool_publisher = await publishers.start(tier=POOLED_TIER)
        extra["kv_pool"] = pool.pool_id
    host_publisher = await publishers.start(tier=HOST_TIER) if config.host_kv_blocks else None
    publisher = await publishers.start()
    engine = await stack.start(
        MockEngineLoop(build_mock_engine(config, kv), publisher, pool, pool_publisher, host_publisher)
    )
    # data-parallel ranks past the first: an engine each, its KV its own, its events as its rank
    ranks: list[Engine] = []
    for rank in range(1, config.data_parallel_size):
        rank_kv = KvBuffer(config.mock_shape("num_gpu_blocks"), shape)
        loop = MockEngineLoop(build_mock_engine(config, rank_kv), await publishers.start(dp_rank=rank))
        ranks.append(await stack.start(loop))
    transfer = await start_kv_transfer(stack, config, worker_id, kv, engine)
    extra |= {
        "kv_transfer_host": transfer.host,
        "kv_transfer_port": transfer.server.port,
        "kv_transfer_backend": transfer.backend,
    }
    return StartedEngine(
        engine,
        publisher,
        ranks,
        TransferHandoff(worker_id, engine, transfer, config.kv_transfer_timeout_secs),
        TransferView.of_server(transfer.server),
        extra,
    )


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
