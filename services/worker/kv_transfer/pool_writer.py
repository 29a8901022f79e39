"""Write-through of a mock worker's KV blocks into its pool segment, as tier transitions.

A block the engine computed is copied into the segment at the end of the step that stored it but
stays unreadable while "in flight" (published as tier ``in_transit``); it is committed, readable and
published as ``pooled``, at the end of the next step, or at once when the engine goes idle, as a
copy overlapping the next step's compute would be. A block the segment's window pushes out is
published as removed: of tier ``pooled`` if it was readable (the index keeps its metadata as
``evicted``), of tier ``in_transit`` if its copy never committed. Layout: docs/decisions/0018.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.wire.kv_events import IN_TRANSIT_TIER, BlocksRemoved, BlocksStored, EventData, StoredBlock
from kvmesh.worker.engine import CachedBlock
from kvmesh.worker.engines.mock.kv_cache_manager import KvCacheManager
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.kv_transfer.kv_pool import KvPool


@dataclass(frozen=True, slots=True)
class _Written:
    parent: int | None  # the sequence hash of the block before it
    block: StoredBlock  # block_hash is the sequence hash (the mock engine's block id)


class PoolWriter:
    """Guarantees: the events published for the segment (under its own event ids) describe exactly
    the blocks it holds readable, those in flight, and those it dropped, as far as the index can
    place them; :meth:`dump` is consistent with the events numbered up to the id it returns.

    A block whose parent the segment no longer holds (its window pushed it out) cannot be placed
    by the index (it would need the parent's sequence hash): it is written readable, so imports
    still find it, but not published.
    """

    def __init__(self, pool: KvPool, publisher: KvEventPublisher | None) -> None:
        self.pool = pool
        self._publisher = publisher
        self._in_flight: dict[int, _Written] = {}
        self._readable: dict[int, _Written] = {}
        self._unplaced: set[int] = set()  # readable, not published: their parent had gone
        self.written_blocks = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def write(self, events: list[EventData], cache: KvCacheManager) -> None:
        """Copy the blocks these engine events stored into the segment, in flight."""
        stored: list[EventData] = []
        dropped_readable: list[int] = []
        dropped_in_flight: list[int] = []
        segment = self.pool.own
        for event in events:
            if not isinstance(event, BlocksStored):
                continue
            parent, run = event.parent_hash, []
            for block in event.blocks:
                sequence_hash = block.block_hash
                slot = cache.blocks.slot_of(sequence_hash)
                if cache.kv is None or slot is None or segment.holds(sequence_hash):
                    if run:
                        stored.append(BlocksStored(parent, tuple(run)))
                    parent, run = sequence_hash, []
                    continue
                block_parent = run[-1].block_hash if run else parent
                placeable = block_parent is None or block_parent in self._readable or block_parent in self._in_flight
                evicted = self.pool.put(sequence_hash, cache.kv.region(slot), commit=not placeable)
                if evicted is not None:
                    self._drop(evicted, dropped_readable, dropped_in_flight)
                self.written_blocks += 1
                if not placeable:
                    self._unplaced.add(sequence_hash)
                    if run:
                        stored.append(BlocksStored(parent, tuple(run)))
                    parent, run = sequence_hash, []
                    continue
                self._in_flight[sequence_hash] = _Written(block_parent, block)
                run.append(block)
            if run:
                stored.append(BlocksStored(parent, tuple(run)))
        # removals after the stores: a block may be pushed out by a later block of the same step
        self._publish(stored, IN_TRANSIT_TIER)
        self._publish([BlocksRemoved(tuple(dropped_in_flight))] if dropped_in_flight else [], IN_TRANSIT_TIER)
        self._publish([BlocksRemoved(tuple(dropped_readable))] if dropped_readable else [])

    def _drop(self, sequence_hash: int, readable: list[int], in_flight: list[int]) -> None:
        if self._in_flight.pop(sequence_hash, None) is not None:
            in_flight.append(sequence_hash)
        elif self._readable.pop(sequence_hash, None) is not None:
            readable.append(sequence_hash)
        else:
            self._unplaced.discard(sequence_hash)

    def commit(self) -> None:
        """Make every block in flight readable and publish it as pooled (parents first)."""
        if not self._in_flight:
            return
        runs: list[EventData] = []
        abandoned: list[int] = []
        parent: int | None = None
        run: list[StoredBlock] = []
        for sequence_hash, written in self._in_flight.items():
            self.pool.own.commit(sequence_hash)
            if written.parent is not None and written.parent not in self._readable:
                # its parent was pushed out while both were in flight: readable, but not placeable
                self._unplaced.add(sequence_hash)
                abandoned.append(sequence_hash)
                continue
            self._readable[sequence_hash] = written
            if run and written.parent == run[-1].block_hash:
                run.append(written.block)
            else:
                if run:
                    runs.append(BlocksStored(parent, tuple(run)))
                parent, run = written.parent, [written.block]
        if run:
            runs.append(BlocksStored(parent, tuple(run)))
        self._in_flight.clear()
        self._publish([BlocksRemoved(tuple(abandoned))] if abandoned else [], IN_TRANSIT_TIER)
        self._publish(runs)

    def _publish(self, events: list[EventData], tier: str | None = None) -> None:
        if events and self._publisher is not None:
            self._publisher.enqueue(events, tier)

    def dump(self) -> tuple[int, list[CachedBlock]]:
        """(last event id published for the segment, its readable placed blocks): gap recovery of
        the segment's entry in the index. Blocks in flight are left out; their commit follows."""
        last = self._publisher.last_event_id if self._publisher is not None else -1
        blocks = [
            CachedBlock(sequence_hash, written.block.tokens_hash, written.parent, sequence_hash)
            for sequence_hash, written in self._readable.items()
        ]
        return last, blocks
