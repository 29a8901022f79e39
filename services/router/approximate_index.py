"""Approximate mode (``--no-kv-events``): a prefix index fed by the router's own decisions (sans-I/O).

Without KV events the router assumes that a worker caches the blocks of every request it was sent,
for ``ttl_s`` seconds after the last request that used them. Storage and matching are the real
:class:`PrefixIndex` (one implementation of matching); this class adds the expiry policy:

- recording a request (re)stamps all its blocks on that worker;
- blocks expire ``ttl_s`` after their last stamp;
- the index never holds more than ``max_blocks`` (worker, block) pairs: the stalest go first.

Within one request the leaf is stamped before its parents, so at equal age a chain shrinks from its
tail and a parent never disappears before its child.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.wire.kv_events import BlocksRemoved, BlocksStored, KvEvent, KvEventBatch, StoredBlock
from kvmesh.common.wire.worker_key import WorkerKey


class ApproximateIndex:
    """Guarantees: every held (worker, block) was routed there within ``ttl_s``; at most
    ``max_blocks`` pairs are held."""

    def __init__(self, block_size: int, ttl_s: float = 120.0, max_blocks: int = 1 << 20) -> None:
        if ttl_s <= 0 or max_blocks <= 0:
            raise ValueError("ttl_s and max_blocks must be positive")
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._index = PrefixIndex()
        # (worker, sequence hash) -> time of its last stamp, stalest first
        self._stamps: OrderedDict[tuple[WorkerKey, int], float] = OrderedDict()
        self._next_event_id: dict[WorkerKey, int] = {}

    def _apply(self, worker: WorkerKey, data: BlocksStored | BlocksRemoved) -> None:
        event_id = self._next_event_id.get(worker, 0)
        self._next_event_id[worker] = event_id + 1
        self._index.apply_batch(KvEventBatch(worker[0], worker[1], 0.0, (KvEvent(event_id, data),)))

    def record(
        self, worker: WorkerKey, local_hashes: Sequence[int], sequence_hashes: Sequence[int], now: float
    ) -> None:
        """The router sent a request with these full blocks to ``worker``."""
        self.expire(now)
        held = self._index.worker_blocks(worker)
        new_from = next((i for i, h in enumerate(sequence_hashes) if h not in held), len(sequence_hashes))
        if new_from < len(sequence_hashes):
            parent = sequence_hashes[new_from - 1] if new_from else None
            blocks = tuple(
                StoredBlock(sequence_hashes[i], local_hashes[i], self.block_size)
                for i in range(new_from, len(sequence_hashes))
            )
            self._apply(worker, BlocksStored(parent, blocks))
        for seq in reversed(sequence_hashes):  # leaf first: at equal age the tail goes first
            key = (worker, seq)
            self._stamps.pop(key, None)
            self._stamps[key] = now
        self._prune(now)

    def expire(self, now: float) -> None:
        self._prune(now)

    def _prune(self, now: float) -> None:
        deadline = now - self.ttl_s
        doomed: dict[WorkerKey, list[int]] = {}
        while self._stamps:
            (worker, seq), stamped = next(iter(self._stamps.items()))
            if stamped > deadline and len(self._stamps) <= self.max_blocks:
                break
            self._stamps.popitem(last=False)
            doomed.setdefault(worker, []).append(seq)
        for worker, hashes in doomed.items():
            self._apply(worker, BlocksRemoved(tuple(hashes)))

    def find_matches_by_sequence(self, sequence_hashes: Sequence[int], now: float) -> dict[WorkerKey, int]:
        self.expire(now)
        return self._index.find_matches_by_sequence(sequence_hashes)

    def tree_sizes(self) -> Mapping[WorkerKey, int]:
        return self._index.tree_sizes()

    def remove_worker(self, worker_id: int) -> None:
        self._index.remove_worker(worker_id)
        for key in [k for k in self._stamps if k[0][0] == worker_id]:
            del self._stamps[key]

    def __len__(self) -> int:
        return len(self._stamps)
