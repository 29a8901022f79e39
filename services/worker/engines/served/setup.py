"""The served engine's setup: a running OpenAI-compatible engine server the worker fronts, its KV
events relayed to the worker's publisher. It serves whole requests only (no KV handoff)."""

from __future__ import annotations

from kvmesh.common.runtime.service import ServiceStack
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engines.served.served_engine import ServedEngine
from kvmesh.worker.engines.started import EventPublishers, StartedEngine


async def start(
    config: WorkerConfig, stack: ServiceStack, publishers: EventPublishers, worker_id: int
) -> StartedEngine:
    assert config.engine_url is not None  # validated
    publisher = await publishers.start()
    engine = ServedEngine(
        config.engine_url,
        publisher.enqueue,
        lambda: publisher.last_event_id,
        block_size=config.block_size,
        kv_events=config.engine_kv_events,
        kv_replay=config.engine_kv_replay,
    )
    return StartedEngine(await stack.start(engine), publisher)
