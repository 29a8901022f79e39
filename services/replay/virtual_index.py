"""What the indexer replicas would answer the replay's router, in virtual time.

The workers' KV events reach a :class:`PrefixIndex` ``--kv-event-delay-ms`` after the step that
made them, as they reach a live mesh's indexers after batching and NATS; a query is answered with
:func:`~kvmesh.common.core.index_answer.answer_query`, the indexer service's own function. With
``--oracle-index`` the answer is instead what every worker holds or is computing at that instant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from kvmesh.common.core.index_answer import IndexAnswer, answer_query
from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.wire.kv_events import KvEventBatch
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.worker.engines.mock.mock_engine import MockEngine


class VirtualIndex:
    """Guarantees: events are applied in the order they left, and none of a departed worker's is
    applied after it left (it would bring the worker's blocks back)."""

    def __init__(self, delay_ms: float) -> None:
        self.delay_ms = delay_ms
        self.index = PrefixIndex()
        self._in_flight: list[tuple[float, int, KvEventBatch]] = []  # (visible at, seq, batch)
        self._order = itertools.count()

    def publish(self, batch: KvEventBatch, now_ms: float) -> None:
        """Into the index at once, or once it has travelled (applied before the next query after)."""
        if self.delay_ms > 0:
            heapq.heappush(self._in_flight, (now_ms + self.delay_ms, next(self._order), batch))
        else:
            self.index.apply_batch(batch)

    def answer(self, block_hashes: Sequence[int], now_ms: float) -> IndexAnswer:
        """What an indexer replica answers at ``now_ms``: every event that has arrived applied."""
        while self._in_flight and self._in_flight[0][0] <= now_ms:
            _, _, batch = heapq.heappop(self._in_flight)
            self.index.apply_batch(batch)
        return answer_query(self.index, block_hashes)

    def oracle(
        self, block_hashes: Sequence[int], workers: Sequence[WorkerKey], engine: Callable[[int], MockEngine]
    ) -> IndexAnswer:
        """Per worker of ``workers``, the leading blocks it holds or is computing now; ``held``, those
        it has computed (a pull brings no block still being computed)."""
        matches, computed = {}, {}
        for key in workers:
            worker = engine(key.worker_id)
            cached = worker.blocks.cached_prefix_length(block_hashes)
            if cached:
                computed[key] = cached
            held = holding(worker, block_hashes, cached)
            if held:
                matches[key] = held
        return IndexAnswer(matches, self.index.tree_sizes(), held=computed)

    def remove_worker(self, worker_id: int) -> None:
        self._in_flight = [e for e in self._in_flight if e[2].worker_id != worker_id]
        heapq.heapify(self._in_flight)
        self.index.remove_worker(worker_id)


def holding(engine: MockEngine, block_hashes: Sequence[int], cached: int) -> int:
    """The leading blocks of ``block_hashes`` ``engine`` holds or is computing now, past the ``cached``
    leading ones it holds computed (its cache's prefix length, which the caller has read)."""
    held = cached
    if held < len(block_hashes) and engine.num_requests:
        computing: set[int] = set()
        for request in (*engine.waiting, *engine.running, *engine.transferring.values()):
            computing.update(request.seq_hashes)
        while held < len(block_hashes) and (
            block_hashes[held] in computing or engine.blocks.slot_of(block_hashes[held]) is not None
        ):
            held += 1
    return held
