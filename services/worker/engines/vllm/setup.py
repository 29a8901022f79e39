"""The vLLM engine's setup: vLLM's own engine arguments with the worker's options that are also
vLLM's, a KV event publisher per data-parallel rank and per offloaded tier, LoRA adapters, and on a
prefill or decode worker vLLM's NIXL connector for the KV handoff."""

from __future__ import annotations

from kvmesh.common.runtime.config import advertised_host
from kvmesh.common.runtime.service import ServiceStack
from kvmesh.common.wire.kv_events import OFFLOADED_TIERS
from kvmesh.common.wire.lora import adapter_paths
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engines.started import EventPublishers, StartedEngine
from kvmesh.worker.engines.vllm.vllm_engine import VllmEngine
from kvmesh.worker.engines.vllm.vllm_events import Publisher
from kvmesh.worker.kv_transfer.connector_handoff import ConnectorHandoff
from kvmesh.worker.metrics import TransferView


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


async def start(
    config: WorkerConfig, stack: ServiceStack, publishers: EventPublishers, worker_id: int
) -> StartedEngine:
    # prefill and decode workers move KV with vLLM's NIXL connector; aggregated ones need none
    connector_host = None if config.role == "aggregated" else advertised_host(config)
    publisher = await publishers.start()

    async def offloaded(rank: int) -> dict[str, Publisher]:
        """The streams of the blocks an offloading connector keeps in CPU memory or on disk for this
        rank: each tier of each rank a stream of its own."""
        tiers = {}
        for tier in OFFLOADED_TIERS:
            tier_publisher = await publishers.start(dp_rank=rank, tier=tier)
            tiers[tier] = (tier_publisher.enqueue, lambda p=tier_publisher: p.last_event_id)
        return tiers

    tiers = await offloaded(0)
    # vLLM's engine cores past the first, each one's events as its rank
    rank_publishers = []
    for rank in range(1, config.data_parallel_size):
        device = await publishers.start(dp_rank=rank)
        rank_publishers.append(((device.enqueue, lambda p=device: p.last_event_id), await offloaded(rank)))
    adapters = adapter_paths(config.lora_adapters)
    vllm = VllmEngine(
        config.engine_args,
        vllm_overrides(config),
        publisher.enqueue,
        lambda: publisher.last_event_id,
        kv_connector_host=connector_host,
        tier_publishers=tiers,
        lora_paths={name: path for name, path in adapters.items() if path},
        rank_publishers=rank_publishers,
    )
    await stack.start(vllm)
    if connector_host is None:
        return StartedEngine(vllm, publisher, list(vllm.ranks))
    handoff = ConnectorHandoff(worker_id, vllm, config.kv_transfer_timeout_secs)
    return StartedEngine(
        vllm,
        publisher,
        list(vllm.ranks),
        handoff,
        TransferView(handoff.backend, vllm.transfer_stats),
        {"kv_transfer_backend": handoff.backend},
    )
