"""Whole-worker state in the prefix index (sans-I/O): a worker's blocks exported for a snapshot and
loaded back, and replaced by the worker's own dump after a gap in its events.

:class:`WorkerStateTransfer` is one part of :class:`~kvmesh.common.core.prefix_index.PrefixIndex`
(its base class): it works on the index's own state, which the index declares, so a reader finds
applying events and querying in ``prefix_index.py`` and moving a worker's whole state here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.common.core.worker_blocks import UNKNOWN_PARENT, ApplyStats, WorkerBlocks
from kvmesh.common.wire.kv_events import KvEvent, MoePlacement, StoredBlock
from kvmesh.common.wire.worker_key import WorkerKey


@dataclass(frozen=True)
class DumpedBlock:
    """One cached block of a worker's own state dump (gap recovery).

    ``sequence_hash``, when the worker gives it, places the block directly; without it the block is
    placed under its parent, and a block whose parent is not in the dump cannot be placed.
    """

    block_hash: int
    tokens_hash: int
    parent_hash: int | None
    sequence_hash: int | None = None


class WorkerStateTransfer:
    """Export, import and replacement of one worker's whole state. Guarantees: an import replaces
    whatever the index held for that worker; a replacement from the worker's own dump places every
    block whose parent it can place (the rest are counted as unknown parents) and then applies the
    events held back since the gap that are newer than the dump."""

    _workers: dict[WorkerKey, WorkerBlocks]
    _holders: dict[int, int]
    _tree_sizes: dict[WorkerKey, int]
    _removed_workers: set[int]
    _admissions: dict[int, int]
    _held_back: dict[WorkerKey, list[KvEvent]]
    gaps_pending: set[WorkerKey]
    stats: ApplyStats

    if TYPE_CHECKING:  # the index's own operations (prefix_index.py)

        def _worker(self, key: WorkerKey) -> WorkerBlocks: ...
        def _clear(self, worker: WorkerBlocks) -> None: ...
        def _drop(self, worker: WorkerBlocks, seq: int) -> None: ...
        def _hold(self, worker: WorkerBlocks, seq: int, parent: int | None) -> None: ...
        def _set_orphans(self, worker: WorkerBlocks, orphans: int) -> None: ...
        def _store(self, worker: WorkerBlocks, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> None: ...
        def _apply_events(self, key: WorkerKey, worker: WorkerBlocks, events: Sequence[KvEvent]) -> None: ...

    def export_worker(self, key: WorkerKey) -> tuple[int, dict[int, int], dict[int, int | None]]:
        """(last applied event id, engine id -> sequence hash, sequence hash -> parent's) of one
        worker, for snapshots."""
        worker = self._workers[key]
        return worker.last_event_id, dict(worker.by_engine_id), dict(worker.parent_of)

    def export_moe(self, key: WorkerKey) -> dict[int, tuple[MoePlacement, ...]]:
        """A worker's MoE metadata (sequence hash -> placements), for snapshots."""
        return dict(self._workers[key].moe)

    def import_moe(self, key: WorkerKey, moe: Mapping[int, tuple[MoePlacement, ...]]) -> None:
        """Restore a worker's MoE metadata after :meth:`import_worker` (blocks it does not hold are skipped)."""
        worker = self._workers.get(key)
        if worker is None:
            return
        for seq, placements in moe.items():
            if seq in worker.parent_of and placements:
                worker.tag(seq, tuple(placements))

    def import_worker(
        self,
        key: WorkerKey,
        last_event_id: int,
        by_engine_id: Mapping[int, int],
        parent_of: Mapping[int, int | None],
    ) -> None:
        """Load one worker's exported state (replacing whatever the index held for it).

        Bulk path for snapshot restores: the per-worker maps are built whole (set and Counter work
        in C) rather than block by block.
        """
        worker = self._worker(key)
        self._clear(worker)
        worker.by_engine_id = dict(by_engine_id)
        copies = Counter(worker.by_engine_id.values())
        worker.extra_copies = {seq: count - 1 for seq, count in copies.items() if count > 1}
        holders = self._holders
        bit = worker.bit
        for seq in copies:
            holders[seq] = holders.get(seq, 0) | bit
        worker.parent_of = {seq: parent_of.get(seq, UNKNOWN_PARENT) for seq in copies}
        parents = [p for p in worker.parent_of.values() if p is not None]
        worker.child_count = dict(Counter(parents))
        held = worker.parent_of
        self._set_orphans(worker, sum(1 for p in parents if p not in held))
        worker.last_event_id = last_event_id
        self._tree_sizes[key] = worker.unique_blocks

    def _load(self, worker: WorkerBlocks, by_engine_id: Mapping[int, int], parent_of: Mapping[int, int | None]) -> None:
        for engine_id, seq in by_engine_id.items():
            previous = worker.by_engine_id.get(engine_id)
            if previous is not None:
                self._drop(worker, previous)
            worker.by_engine_id[engine_id] = seq
            self._hold(worker, seq, parent_of.get(seq, UNKNOWN_PARENT))

    def replace_worker(
        self, key: WorkerKey, last_event_id: int, blocks: Sequence[DumpedBlock], admission: int | None = None
    ) -> bool:
        """Make the index hold exactly ``blocks`` for this worker as of ``last_event_id`` (its own
        dump), then apply the events held back since the gap that are newer than the dump. Returns
        whether it did: not for a removed worker, nor for a dump asked for under another
        ``admission`` (see :meth:`admission`) than the worker's now. Such a dump predates events
        that were ignored while the worker was removed, and the events held back since its return
        start after them: loaded, it would miss their blocks for good.

        Blocks may come in any order; each is placed once its parent is placed.
        """
        if key[0] in self._removed_workers:
            return False
        if admission is not None and admission != self._admissions.get(key[0], 0):
            return False
        worker = self._worker(key)
        self._clear(worker)
        placed = {b.block_hash: b.sequence_hash for b in blocks if b.sequence_hash is not None}
        if placed:
            parents: dict[int, int | None] = {}
            for b in blocks:
                if b.sequence_hash is not None:
                    parent = None if b.parent_hash is None else placed.get(b.parent_hash, UNKNOWN_PARENT)
                    parents[b.sequence_hash] = parent
            self._load(worker, placed, parents)
        pending = [b for b in blocks if b.sequence_hash is None]
        while pending:
            waiting = []
            for block in pending:
                if block.parent_hash is not None and block.parent_hash not in worker.by_engine_id:
                    waiting.append(block)
                    continue
                self._store(worker, block.parent_hash, [StoredBlock(block.block_hash, block.tokens_hash, 0)])
            if len(waiting) == len(pending):
                self.stats.unknown_parent += len(waiting)  # orphans without a sequence hash: dropped
                break
            pending = waiting
        worker.last_event_id = last_event_id
        self.gaps_pending.discard(key)
        self.stats.recoveries += 1
        held = self._held_back.pop(key, [])
        self._apply_events(key, worker, held)
        self._tree_sizes[key] = worker.unique_blocks
        return True

    def suspect_worker(self, worker_id: int) -> None:
        """Events of this worker may be lost with no gap in its event ids to show it (the stream no
        longer holds messages this replica never read, and the worker may publish nothing after
        them): put each of its streams in recovery, as a gap does, so that its own dump rebuilds
        it. A removed worker is left alone; one the index has not seen is recovered as rank 0."""
        if worker_id in self._removed_workers:
            return
        for key in [key for key in self._workers if key[0] == worker_id] or [WorkerKey(worker_id, 0)]:
            self._await_dump(key)

    def _await_dump(self, key: WorkerKey) -> None:
        """Put ``key`` in recovery: its events are held back from now until :meth:`replace_worker`
        loads its dump."""
        self._worker(key)
        self.gaps_pending.add(key)
        self._held_back.setdefault(key, [])

    def export_tiers(self, key: WorkerKey) -> tuple[str, dict[int, int], dict[int, int]]:
        """(resident tier, blocks in transit, evicted metadata) of one worker, for snapshots."""
        worker = self._workers[key]
        return worker.tier, dict(worker.in_transit), dict(worker.evicted)

    def import_tiers(
        self, key: WorkerKey, tier: str, in_transit: Mapping[int, int], evicted: Mapping[int, int]
    ) -> None:
        """Restore a worker's tiers after :meth:`import_worker`."""
        worker = self._workers.get(key)
        if worker is not None:
            worker.import_tiers(tier, in_transit, evicted)
