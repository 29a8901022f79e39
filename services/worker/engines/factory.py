"""The one place a worker's engine is chosen: ``--engine`` names a setup, and every setup hands back
the same :class:`~kvmesh.worker.engines.started.StartedEngine`, so nothing past this module branches
on which engine it holds. Each engine's setup lives in its own folder (``mock/setup.py``,
``vllm/setup.py``, ``served/setup.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvmesh.common.runtime.service import ServiceStack
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engines.mock import setup as mock
from kvmesh.worker.engines.served import setup as served
from kvmesh.worker.engines.started import EventPublishers, StartedEngine
from kvmesh.worker.engines.vllm import setup as vllm

Setup = Callable[[WorkerConfig, ServiceStack, EventPublishers, int], Awaitable[StartedEngine]]


# Each engine's setup, by --engine name. vLLM itself is imported only when its engine starts.
SETUPS: dict[str, Setup] = {"mock": mock.start, "vllm": vllm.start, "served": served.start}


async def start_engine(
    config: WorkerConfig, stack: ServiceStack, publishers: EventPublishers, worker_id: int
) -> StartedEngine:
    """Start ``config.engine`` on ``stack`` (stopped when it unwinds)."""
    started = await SETUPS[config.engine](config, stack, publishers, worker_id)
    started.extra.setdefault("engine", config.engine)
    started.extra.setdefault("kv_handoff", config.resolved_kv_handoff())
    return started
