"""What every engine's setup takes and gives back: the worker's KV event publishers in, a
:class:`StartedEngine` out (:mod:`~kvmesh.worker.engines.factory` chooses the setup)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import JetStreamContext

from kvmesh.common.runtime.service import ServiceStack
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine import Engine
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.kv_transfer.handoff import KvHandoff
from kvmesh.worker.metrics import TransferView


@dataclass
class StartedEngine:
    """A running engine and what the rest of the worker needs of it. ``publisher``: its (rank 0's)
    KV events; ``ranks``: the data-parallel ranks past the first (rank 0 is ``engine``);
    ``handoff``: its half of prefill/decode disaggregation (None: it cannot split); ``extra``: what
    its discovery record says of it."""

    engine: Engine
    publisher: KvEventPublisher
    ranks: list[Engine] = field(default_factory=list)
    handoff: KvHandoff | None = None
    transfer_view: TransferView | None = None
    extra: dict[str, object] = field(default_factory=dict)


class EventPublishers:
    """Starts the worker's KV event publishers, each on ``stack`` (stopped when it unwinds): one per
    data-parallel rank and one per storage tier an engine offloads to. ``publisher_class`` lets a
    failure drill swap in a lossy publisher."""

    def __init__(
        self,
        stack: ServiceStack,
        js: JetStreamContext,
        config: WorkerConfig,
        worker_id: int,
        publisher_class: type[KvEventPublisher] = KvEventPublisher,
    ) -> None:
        self._stack = stack
        self._make = lambda **where: publisher_class(
            js, config.namespace, worker_id, flush_interval_s=config.kv_events_flush_ms / 1000, **where
        )

    async def start(self, dp_rank: int = 0, tier: str | None = None) -> KvEventPublisher:
        where: dict[str, object] = {"dp_rank": dp_rank}
        if tier is not None:
            where["tier"] = tier
        return await self._stack.start(self._make(**where))
