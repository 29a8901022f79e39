"""The global prefix index of cached KV blocks (sans-I/O).

The radix tree of cached prefixes is stored flat: a node is identified by its *sequence hash*
(DESIGN §2), which names a block together with its whole prefix, so "the child of node P with local
hash L" is simply the node ``next_sequence_hash(P, L)``. Walking a query down the tree is then one
hash-map lookup per block, and no node ever holds pointers that need fixing when a worker leaves.

Workers are keyed by (worker_id, dp_rank). Engines name their blocks with their own opaque ids; the
index keeps, per worker, a map from the engine's id to our sequence hash, used to resolve a stored
event's parent and to apply removals. Our matching never depends on the engine's hashing.

Guarantees: applying the same event twice is a no-op (events at or below the last applied
``event_id`` of a worker are skipped); a store whose parent the index does not know is dropped and
counted, never guessed; a removed or unknown worker holds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.common.hashing import next_sequence_hash
from services.common.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEventBatch

WorkerKey = tuple[int, int]  # (worker_id, dp_rank)


@dataclass
class _WorkerBlocks:
    """One worker's blocks: engine block id -> sequence hash, and how many engine blocks per hash."""

    by_engine_id: dict[int, int] = field(default_factory=dict)
    copies: dict[int, int] = field(default_factory=dict)
    last_event_id: int = -1


@dataclass
class ApplyStats:
    events_applied: int = 0
    duplicates_skipped: int = 0
    unknown_parent: int = 0
    unknown_removals: int = 0
    gaps: int = 0


@dataclass(frozen=True)
class WorkerOverlap:
    worker: WorkerKey
    matched_blocks: int
    total_blocks: int


class PrefixIndex:
    """Which worker holds which prefix. See the module docstring for the guarantees."""

    def __init__(self) -> None:
        self._holders: dict[int, set[WorkerKey]] = {}
        self._workers: dict[WorkerKey, _WorkerBlocks] = {}
        self._removed_workers: set[int] = set()
        self.stats = ApplyStats()

    # ---- events --------------------------------------------------------------------------
    def apply_batch(self, batch: KvEventBatch) -> None:
        if batch.worker_id in self._removed_workers:
            return  # late events of a worker that has left must not resurrect its blocks
        key = (batch.worker_id, batch.dp_rank)
        worker = self._workers.get(key)
        if worker is None:
            worker = self._workers[key] = _WorkerBlocks()
        for event in batch.events:
            if event.event_id <= worker.last_event_id:
                self.stats.duplicates_skipped += 1
                continue
            if event.event_id != worker.last_event_id + 1:
                self.stats.gaps += 1
            worker.last_event_id = event.event_id
            data = event.data
            if isinstance(data, BlocksStored):
                self._store(key, worker, data)
            elif isinstance(data, BlocksRemoved):
                self._remove(key, worker, data.block_hashes)
            elif isinstance(data, AllBlocksCleared):
                self._clear(key, worker)
            self.stats.events_applied += 1

    def _store(self, key: WorkerKey, worker: _WorkerBlocks, data: BlocksStored) -> None:
        if data.parent_hash is None:
            parent: int | None = None
        else:
            parent = worker.by_engine_id.get(data.parent_hash)
            if parent is None:
                self.stats.unknown_parent += 1
                return
        for block in data.blocks:
            seq = block.tokens_hash if parent is None else next_sequence_hash(parent, block.tokens_hash)
            previous = worker.by_engine_id.get(block.block_hash)
            if previous != seq:
                if previous is not None:
                    self._drop_copy(key, worker, previous)
                worker.by_engine_id[block.block_hash] = seq
                count = worker.copies.get(seq, 0)
                worker.copies[seq] = count + 1
                if count == 0:
                    self._holders.setdefault(seq, set()).add(key)
            parent = seq

    def _remove(self, key: WorkerKey, worker: _WorkerBlocks, engine_ids: Iterable[int]) -> None:
        for engine_id in engine_ids:
            seq = worker.by_engine_id.pop(engine_id, None)
            if seq is None:
                self.stats.unknown_removals += 1
                continue
            self._drop_copy(key, worker, seq)

    def _drop_copy(self, key: WorkerKey, worker: _WorkerBlocks, seq: int) -> None:
        count = worker.copies[seq] - 1
        if count > 0:
            worker.copies[seq] = count
            return
        del worker.copies[seq]
        holders = self._holders[seq]
        holders.discard(key)
        if not holders:
            del self._holders[seq]

    def _clear(self, key: WorkerKey, worker: _WorkerBlocks) -> None:
        for seq in worker.copies:
            holders = self._holders[seq]
            holders.discard(key)
            if not holders:
                del self._holders[seq]
        worker.copies.clear()
        worker.by_engine_id.clear()

    def remove_worker(self, worker_id: int) -> None:
        """Forget every block of a worker (all its dp ranks) and ignore its late events."""
        self._removed_workers.add(worker_id)
        for key in [k for k in self._workers if k[0] == worker_id]:
            self._clear(key, self._workers.pop(key))

    # ---- queries -------------------------------------------------------------------------
    def find_matches(self, local_hashes: Sequence[int]) -> list[WorkerOverlap]:
        """Per known worker: leading blocks of the query it holds, and all blocks it holds."""
        matched: dict[WorkerKey, int] = {}
        active: set[WorkerKey] | None = None
        parent: int | None = None
        for depth, local in enumerate(local_hashes, start=1):
            seq = local if parent is None else next_sequence_hash(parent, local)
            parent = seq
            holders = self._holders.get(seq)
            if not holders:
                break
            active = set(holders) if active is None else active & holders
            if not active:
                break
            for key in active:
                matched[key] = depth
        return [WorkerOverlap(key, matched.get(key, 0), len(worker.copies)) for key, worker in self._workers.items()]

    def worker_blocks(self, key: WorkerKey) -> set[int]:
        """Sequence hashes a worker holds (for convergence checks)."""
        worker = self._workers.get(key)
        return set(worker.copies) if worker else set()

    def workers(self) -> list[WorkerKey]:
        return list(self._workers)

    @property
    def num_blocks(self) -> int:
        """(worker, block) pairs indexed."""
        return sum(len(w.copies) for w in self._workers.values())
