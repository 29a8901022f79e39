"""Publishes the engine's KV events to JetStream, batched, ordered and de-duplicated (DESIGN §3)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

import structlog
from nats.js import JetStreamContext

from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.wire import names
from kvmesh.common.wire.kv_events import DEVICE_TIER, EventData, KvEvent, KvEventBatch, encode_batch

log = structlog.get_logger(__name__)

# JetStream moves about ten thousand messages a second per consumer, so many events share a message.
MAX_EVENTS_PER_MESSAGE = 512


class KvEventPublisher:
    """Numbers the events of one stream, (worker, dp_rank, tier), and publishes them in order.

    Guarantees: event ids increase by one with no gaps; every queued event is published (a failed
    publish is retried with the same ``Nats-Msg-Id``, so the stream stores it once).
    """

    def __init__(
        self,
        js: JetStreamContext,
        namespace: str,
        worker_id: int,
        dp_rank: int = 0,
        tier: str = DEVICE_TIER,
        flush_interval_s: float = 0.0,
    ) -> None:
        """``tier``: the storage tier whose stream this is (the device cache; ``host`` or ``disk``, an
        engine's offloaded copies; ``pooled``, a KV pool segment): each numbers its own events.
        ``flush_interval_s``: how long the first queued event waits for more before a publish, so
        that one stream message (one publish, one acknowledgement, one indexer delivery) carries
        several engine steps' events instead of one each."""
        self._js = js
        self._flush_interval = flush_interval_s
        self.tier = tier
        self._subject = names.kv_events_subject(namespace, worker_id)
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self._next_event_id = 0
        self._queue: list[KvEvent] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self.published_events = 0

    @property
    def last_event_id(self) -> int:
        """Id of the last event numbered so far (-1 before the first)."""
        return self._next_event_id - 1

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-publisher-{self.worker_id}")

    def enqueue(self, events: Iterable[EventData], tier: str | None = None) -> None:
        """Number and queue ``events``, of this publisher's tier unless ``tier`` names another
        (a pool segment announces copies in flight as ``in_transit``)."""
        tier = tier or self.tier
        for data in events:
            self._queue.append(KvEvent(self._next_event_id, data, tier))
            self._next_event_id += 1
        if self._queue:
            self._idle.clear()
            self._wakeup.set()

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued event is in the stream."""
        async with asyncio.timeout(timeout):
            await self._idle.wait()

    async def stop(self) -> None:
        with contextlib.suppress(TimeoutError):
            await self.flush(timeout=5.0)
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            if self._flush_interval and len(self._queue) < MAX_EVENTS_PER_MESSAGE:
                await asyncio.sleep(self._flush_interval)
            self._wakeup.clear()
            while self._queue:
                chunk = self._queue[:MAX_EVENTS_PER_MESSAGE]
                batch = KvEventBatch(self.worker_id, self.dp_rank, time.time(), tuple(chunk), self.tier)
                await self._publish(batch)
                del self._queue[: len(chunk)]
                self.published_events += len(chunk)
            self._idle.set()

    async def _publish(self, batch: KvEventBatch) -> None:
        payload = encode_batch(batch)
        msg_id = names.kv_event_msg_id(batch.worker_id, batch.dp_rank, batch.first_event_id, batch.tier)
        headers = {"Nats-Msg-Id": msg_id}
        delay = 0.05
        while True:
            try:
                await self._js.publish(self._subject, payload, headers=headers)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("KV event publish failed; retrying", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
