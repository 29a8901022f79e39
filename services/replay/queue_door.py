"""The router queue at the replay's door: the live router's waiting lists
(:class:`~kvmesh.router.request_queue.WaitingRequests`), in virtual time.

An arriving request routes at once while some worker is under the busy thresholds and nobody waits;
else it waits behind those already waiting in its priority class (or is refused: the class is full,
or with no queue at all the fleet is busy), and leaves the queue when capacity frees, in the queue's
order, or at its deadline.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from kvmesh.replay.config import RequestRecord
from kvmesh.router.request_queue import QueueConfig, Waiting, WaitingRequests


class QueueDoor:
    """Guarantees: a request is routed, waiting or refused (``record.refused`` says why), never
    two of these; a waiting one is let go only while ``all_busy()`` is false."""

    def __init__(
        self, config: QueueConfig, all_busy: Callable[[], bool], uncached_tokens: Callable[[RequestRecord], int]
    ) -> None:
        """``uncached_tokens``: a request's prompt past the longest prefix the router's view holds
        (shortest-prefill-first's key, as the live router takes it from the decision it could not make)."""
        self.waiting = WaitingRequests(config) if config.size > 0 else None
        self._all_busy = all_busy
        self._uncached_tokens = uncached_tokens
        self._order = itertools.count()

    def admit_now(self, record: RequestRecord) -> bool:
        """Whether an arriving request routes at once; else it waits or is refused."""
        queue = self.waiting
        if queue is None or (not len(queue) and not self._all_busy()):
            if queue is None and self._all_busy():
                record.refused = "busy"  # no queue: refused at once
                return False
            if queue is not None:
                queue.served(record.session, record.input_length, record.arrival_ms / 1000.0)
            return True
        self.expire(record.arrival_ms)
        if len(queue.waiting[record.priority]) >= queue.config.size:
            record.refused = "full"
            return False
        uncached = self._uncached_tokens(record)
        waiting = Waiting(next(self._order), record.priority, uncached, record.arrival_ms / 1000.0, payload=record)
        waiting.session, waiting.prompt_tokens = record.session, record.input_length
        queue.add(waiting)
        return False

    def release(self, now: float) -> Iterator[RequestRecord]:
        """The waiting requests to route now, in the queue's order, each once the one before it was
        routed, while some worker can take one (``record.queued_ms`` set)."""
        queue = self.waiting
        if queue is None or not len(queue):
            return
        self.expire(now)
        while len(queue) and not self._all_busy():
            entry = queue.next()
            assert entry is not None
            queue.remove(entry)
            queue.charge(entry, now / 1000.0)
            record = entry.payload
            assert isinstance(record, RequestRecord)
            record.queued_ms = now - entry.enqueued_at * 1000.0
            yield record

    def expire(self, now: float) -> None:
        """Refuse the requests that waited past the deadline."""
        if self.waiting is None:
            return
        deadline = self.waiting.config.timeout_s * 1000.0
        for waiting in list(self.waiting.waiting.values()):
            for entry in list(waiting):
                waited = now - entry.enqueued_at * 1000.0
                if waited >= deadline:
                    self.waiting.remove(entry)
                    record = entry.payload
                    assert isinstance(record, RequestRecord)
                    record.refused, record.queued_ms = "timeout", waited

    def __len__(self) -> int:
        return len(self.waiting) if self.waiting is not None else 0
