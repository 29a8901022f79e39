"""The global prefix index of cached KV blocks (sans-I/O).

The radix tree of cached prefixes is stored flat (docs/decisions/0001): a node is named by its
*sequence hash* (DESIGN §2), which identifies a block together with its whole prefix, so "the child
of node P with local hash L" is the node ``next_sequence_hash(P, L)``. Each node maps to a bitmask of
the streams holding it, one bit per stream: a (worker_id, dp_rank) device cache, or a
:class:`~kvmesh.common.wire.worker_key.TierKey` for an offloaded tier or a pool segment. Walking a
query down the tree is then one dictionary lookup and one integer AND per block.

Engines name their blocks with their own opaque ids; the index keeps, per worker, a map from the
engine's id to our sequence hash, used to resolve a stored event's parent and to apply removals. Our
matching never depends on the engine's hashing.

Guarantees:

- applying an event twice is a no-op: events at or below a worker's last applied ``event_id`` are
  skipped (redelivery, publisher retries, replays);
- a store whose parent the index does not know is dropped and counted, never guessed; a removal of
  an unknown block is counted and ignored;
- a gap in a worker's ``event_id`` sequence (including a first event that is not event 0) puts the
  worker in recovery: its events from the gap on are held back, the worker is listed in
  :attr:`PrefixIndex.gaps_pending`, and :meth:`PrefixIndex.replace_worker` with the worker's own
  dump rebuilds it exactly and then applies the held-back events newer than the dump;
- a removed worker holds nothing and its late events are ignored;
- block tiers (DESIGN §7): a store of tier ``in_transit`` (a copy into a pool in flight) only
  announces its blocks, which match nothing until a store of their resident tier settles them; a
  removal of tier ``in_transit`` abandons them; a removal of tier ``pooled`` keeps the block's
  metadata as ``evicted`` (at most :data:`EVICTED_METADATA_LIMIT` per worker, oldest dropped
  first). :meth:`PrefixIndex.tier_of` tells a block's state.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate, repeat
from operator import and_, neg

import xxhash

from kvmesh.common.core.worker_blocks import (
    EVICTED_METADATA_LIMIT,
    UNKNOWN_PARENT,
    ApplyStats,
    WorkerBlocks,
)
from kvmesh.common.core.worker_state import DumpedBlock, WorkerStateTransfer
from kvmesh.common.wire.hashing import HASH_SEED, sequence_hashes
from kvmesh.common.wire.kv_events import (
    DEVICE_TIER,
    IN_TRANSIT_TIER,
    POOLED_TIER,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    StoredBlock,
)
from kvmesh.common.wire.worker_key import IndexKey, WorkerKey, index_key

__all__ = ["EVICTED_METADATA_LIMIT", "UNKNOWN_PARENT", "ApplyStats", "DumpedBlock", "PrefixIndex", "WorkerKey"]

_pack_pair = struct.Struct("<QQ").pack
_xxh3 = xxhash.xxh3_64_intdigest


class PrefixIndex(WorkerStateTransfer):
    """Which worker holds which prefix. See the module docstring for the guarantees."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._workers: dict[WorkerKey, WorkerBlocks] = {}
        self._key_of_bit: dict[int, WorkerKey] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._removed_workers: set[int] = set()
        self._removed_keys: dict[int, list[IndexKey]] = {}  # the streams a removed worker had
        # counts each worker's removals and readmissions: a dump asked for before the last of them
        # misses what the worker did while its events were ignored (see replace_worker)
        self._admissions: dict[int, int] = {}
        self._tree_sizes: dict[WorkerKey, int] = {}
        self._unclosed = 0  # bits of workers with at least one orphan block
        self.gaps_pending: set[WorkerKey] = set()
        self._held_back: dict[WorkerKey, list[KvEvent]] = {}
        self.stats = ApplyStats()

    # ---- workers -------------------------------------------------------------------------
    def _worker(self, key: WorkerKey) -> WorkerBlocks:
        worker = self._workers.get(key)
        if worker is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = 1 << self._next_bit
                self._next_bit += 1
            worker = self._workers[key] = WorkerBlocks(bit)
            self._key_of_bit[bit] = key
            self._tree_sizes[key] = 0
        return worker

    def remove_worker(self, worker_id: int) -> None:
        """Forget every block of a worker (all its dp ranks) and ignore its late events."""
        self._removed_workers.add(worker_id)
        self._admissions[worker_id] = self._admissions.get(worker_id, 0) + 1
        keys = [k for k in self._workers if k[0] == worker_id]
        self._removed_keys[worker_id] = keys or [WorkerKey(worker_id, 0)]
        for key in keys:
            worker = self._workers.pop(key)
            self._clear(worker)
            del self._key_of_bit[worker.bit]
            del self._tree_sizes[key]
            self._free_bits.append(worker.bit)
            self.gaps_pending.discard(key)
            self._held_back.pop(key, None)

    def is_removed(self, worker_id: int) -> bool:
        return worker_id in self._removed_workers

    def readmit_worker(self, worker_id: int) -> None:
        """A removed worker is back (its lease lapsed while it lived on: a partition, a NATS outage).
        Its events count again, from its own state: each of its dp ranks is put in recovery, so that
        its events are held back until :meth:`replace_worker` loads its dump (the events it published
        while removed were ignored; the dump holds their effect)."""
        if worker_id not in self._removed_workers:
            return
        self._removed_workers.discard(worker_id)
        self._admissions[worker_id] = self._admissions.get(worker_id, 0) + 1
        for key in self._removed_keys.pop(worker_id, [WorkerKey(worker_id, 0)]):
            self._await_dump(key)

    def admission(self, worker_id: int) -> int:
        """How many times the worker was removed or readmitted: take it before asking the worker for
        its dump and hand it to :meth:`replace_worker`, which refuses a dump outdated by either."""
        return self._admissions.get(worker_id, 0)

    def removed_workers(self) -> list[int]:
        return sorted(self._removed_workers)

    @property
    def recovering(self) -> list[WorkerKey]:
        """Workers whose events are held back until their dump arrives."""
        return sorted(self._held_back)

    # ---- events --------------------------------------------------------------------------
    def apply_batch(self, batch: KvEventBatch) -> None:
        if batch.worker_id in self._removed_workers:
            return  # late events of a worker that has left must not resurrect its blocks
        key = index_key(batch.worker_id, batch.dp_rank, batch.tier)
        worker = self._worker(key)
        self._apply_events(key, worker, batch.events)
        self._tree_sizes[key] = worker.unique_blocks

    def _apply_events(self, key: WorkerKey, worker: WorkerBlocks, events: Sequence[KvEvent]) -> None:
        held = self._held_back.get(key)
        if held is not None:
            held.extend(events)  # in recovery: wait for the worker's dump
            return
        for position, event in enumerate(events):
            if event.event_id <= worker.last_event_id:
                self.stats.duplicates_skipped += 1
                continue
            if event.event_id != worker.last_event_id + 1:
                # Events were lost: stop here and hold back the rest until the worker's dump arrives.
                self.stats.gaps += 1
                self.gaps_pending.add(key)
                self._held_back[key] = list(events[position:])
                return
            worker.last_event_id = event.event_id
            data = event.data
            tier = event.tier
            if tier == IN_TRANSIT_TIER:
                worker.track_transit(data, self.stats)
            elif isinstance(data, BlocksStored):
                worker.tier = tier
                if worker.in_transit or worker.evicted:
                    worker.settle(data.blocks)
                self._store(worker, data.parent_hash, data.blocks)
            elif isinstance(data, BlocksRemoved):
                if tier == POOLED_TIER:
                    worker.keep_evicted(data.block_hashes)
                self._remove(worker, data.block_hashes)
            elif isinstance(data, AllBlocksCleared):
                self._clear(worker)
            self.stats.events_applied += 1

    def in_recovery(self, key: WorkerKey) -> bool:
        return key in self._held_back

    # ---- block tiers (the worker's own bookkeeping, WorkerBlocks) ------------------------
    def tier_of(self, key: WorkerKey, engine_id: int) -> str | None:
        """The state of one of a worker's blocks: its resident tier (``device``, or ``pooled`` for
        a pool segment), ``in_transit``, ``evicted``, or None when the index knows nothing of it."""
        worker = self._workers.get(key)
        return None if worker is None else worker.tier_of(engine_id)

    def tier_of_worker(self, key: WorkerKey) -> str:
        """The tier of the blocks a worker holds resident (``device`` until it stores any other)."""
        worker = self._workers.get(key)
        return DEVICE_TIER if worker is None else worker.tier

    def tier_counts(self, key: WorkerKey) -> tuple[int, int]:
        """(blocks in transit, evicted blocks whose metadata is kept) of one worker."""
        worker = self._workers.get(key)
        return (0, 0) if worker is None else (len(worker.in_transit), len(worker.evicted))

    def _store(self, worker: WorkerBlocks, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> None:
        by_engine_id = worker.by_engine_id
        if parent_hash is None:
            parent: int | None = None
        else:
            parent = by_engine_id.get(parent_hash)
            if parent is None:
                self.stats.unknown_parent += 1
                return
        holders = self._holders
        get = holders.get
        bit = worker.bit
        parent_of = worker.parent_of
        child_count = worker.child_count
        parent_held = parent is None or bool(get(parent, 0) & bit)
        for block in blocks:
            block_hash = block.block_hash
            tokens_hash = block.tokens_hash
            # next_sequence_hash, inlined: this loop is the indexer's hot path
            seq = tokens_hash if parent is None else _xxh3(_pack_pair(parent, tokens_hash), HASH_SEED)
            known = len(by_engine_id)
            previous = by_engine_id.setdefault(block_hash, seq)  # one lookup for the common new block
            if len(by_engine_id) > known or previous != seq:
                if len(by_engine_id) == known:  # the engine id was re-used for other content
                    self._drop(worker, previous)
                    by_engine_id[block_hash] = seq
                    parent_held = parent is None or bool(get(parent, 0) & bit)
                mask = get(seq, 0)
                if mask & bit:
                    worker.extra_copies[seq] = worker.extra_copies.get(seq, 0) + 1
                else:
                    # _hold, inlined for the common case
                    holders[seq] = mask | bit
                    parent_of[seq] = parent
                    orphans = worker.orphans
                    # held children of a block not held are orphans, so with none there is none to adopt
                    delta = -child_count.get(seq, 0) if orphans else 0
                    if parent is not None:
                        # (a parent held moments ago may already have children: held orphans it adopted)
                        child_count[parent] = child_count.get(parent, 0) + 1
                        if not parent_held:
                            delta += 1
                    if delta:
                        self._set_orphans(worker, orphans + delta)
            if block.moe:
                worker.tag(seq, block.moe)
            parent = seq
            parent_held = True
        self.stats.blocks_stored += len(blocks)

    def _hold(self, worker: WorkerBlocks, seq: int, parent: int | None) -> None:
        """One more copy of ``seq`` on this worker (``parent``: its parent's sequence hash)."""
        mask = self._holders.get(seq, 0)
        bit = worker.bit
        if mask & bit:
            worker.extra_copies[seq] = worker.extra_copies.get(seq, 0) + 1
            return
        self._holders[seq] = mask | bit
        worker.parent_of[seq] = parent
        orphans = worker.orphans - worker.child_count.get(seq, 0)  # its children are orphans no more
        if parent is not None:
            worker.child_count[parent] = worker.child_count.get(parent, 0) + 1
            if parent == UNKNOWN_PARENT or not self._holders.get(parent, 0) & bit:
                orphans += 1
        self._set_orphans(worker, orphans)

    def _unhold(self, worker: WorkerBlocks, seq: int) -> None:
        """The last copy of ``seq`` leaves this worker."""
        bit = worker.bit
        mask = self._holders[seq] & ~bit
        if mask:
            self._holders[seq] = mask
        else:
            del self._holders[seq]
        parent = worker.parent_of.pop(seq)
        if worker.moe:
            worker.untag(seq)
        orphans = worker.orphans + worker.child_count.get(seq, 0)  # its children become orphans
        if parent is not None:
            count = worker.child_count[parent] - 1
            if count:
                worker.child_count[parent] = count
            else:
                del worker.child_count[parent]
            if parent == UNKNOWN_PARENT or not self._holders.get(parent, 0) & bit:
                orphans -= 1
        self._set_orphans(worker, orphans)

    def _set_orphans(self, worker: WorkerBlocks, orphans: int) -> None:
        worker.orphans = orphans
        if orphans:
            self._unclosed |= worker.bit
        else:
            self._unclosed &= ~worker.bit

    def _remove(self, worker: WorkerBlocks, engine_ids: Iterable[int]) -> None:
        by_engine_id = worker.by_engine_id
        for engine_id in engine_ids:
            seq = by_engine_id.pop(engine_id, None)
            if seq is None:
                self.stats.unknown_removals += 1
                continue
            self._drop(worker, seq)
            self.stats.blocks_removed += 1

    def _drop(self, worker: WorkerBlocks, seq: int) -> None:
        extra = worker.extra_copies.get(seq)
        if extra:
            if extra == 1:
                del worker.extra_copies[seq]
            else:
                worker.extra_copies[seq] = extra - 1
            return
        self._unhold(worker, seq)

    def _clear(self, worker: WorkerBlocks) -> None:
        holders = self._holders
        keep = ~worker.bit
        for seq in worker.parent_of:
            mask = holders[seq] & keep
            if mask:
                holders[seq] = mask
            else:
                del holders[seq]
        worker.by_engine_id.clear()
        worker.extra_copies.clear()
        worker.parent_of.clear()
        worker.child_count.clear()
        worker.clear_metadata()
        self._set_orphans(worker, 0)

    def moe_alignment(
        self, seq_hashes: Sequence[int], matched: Mapping[WorkerKey, int], experts: set[tuple[int, int]]
    ) -> dict[WorkerKey, tuple[int, int]]:
        """Per worker with MoE metadata: (blocks of its matched prefix computed with one of ``experts``,
        how many of ``experts`` (layer, expert) its held blocks were computed with). Workers with
        neither are left out, so a dense fleet answers an empty map."""
        alignment = {}
        for key, worker in self._workers.items():
            if worker.experts:
                aligned, hosted = worker.moe_alignment(seq_hashes[: matched.get(key, 0)], experts)
                if hosted or aligned:
                    alignment[key] = (aligned, hosted)
        return alignment

    # ---- queries -------------------------------------------------------------------------
    def find_matches_by_sequence(self, seq_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Leading blocks of the query each worker holds (workers with none are left out)."""
        n = len(seq_hashes)
        if n == 0:
            return {}
        get = self._holders.get
        first = get(seq_hashes[0], 0)
        if not first:
            return {}
        if first & self._unclosed:
            return self._scan(seq_hashes)
        # Every candidate holds whole prefixes, so the holders of position i are nested in those of
        # i - 1: a worker's depth is where its bit disappears, found by bisection (a handful of
        # lookups instead of one per block).
        matched: dict[WorkerKey, int] = {}
        key_of_bit = self._key_of_bit
        last = get(seq_hashes[-1], 0) & first
        pending = [(0, first, n - 1, last)]
        while pending:
            low, low_mask, high, high_mask = pending.pop()
            if low_mask == high_mask:
                continue
            if high - low == 1:
                dropped = low_mask & ~high_mask
                while dropped:
                    bit = dropped & -dropped
                    matched[key_of_bit[bit]] = high
                    dropped ^= bit
                continue
            middle = (low + high) // 2
            middle_mask = get(seq_hashes[middle], 0) & low_mask
            pending.append((low, low_mask, middle, middle_mask))
            pending.append((middle, middle_mask, high, high_mask))
        while last:
            bit = last & -last
            matched[key_of_bit[bit]] = n
            last ^= bit
        return matched

    def _scan(self, seq_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Exact for any holdings: the running AND of holder masks along the query (in C loops) only
        loses bits; each worker's depth is where its bit disappears, found by bisection on it."""
        n = len(seq_hashes)
        still_held = list(accumulate(map(self._holders.get, seq_hashes, repeat(0, n)), and_))
        matched: dict[WorkerKey, int] = {}
        key_of_bit = self._key_of_bit
        start = 0
        while start < n:
            mask = still_held[start]
            if not mask:
                break
            end = bisect_right(still_held, -mask, lo=start, key=neg)  # first position holding fewer
            dropped = mask & ~(still_held[end] if end < n else 0)
            while dropped:
                low = dropped & -dropped
                matched[key_of_bit[low]] = end
                dropped ^= low
            start = end
        return matched

    def find_matches(self, local_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        return self.find_matches_by_sequence(sequence_hashes(local_hashes))

    def tree_sizes(self) -> Mapping[WorkerKey, int]:
        """Blocks each known worker holds (a live view; do not mutate)."""
        return self._tree_sizes

    def worker_blocks(self, key: WorkerKey) -> set[int]:
        """Sequence hashes a worker holds (for convergence checks)."""
        worker = self._workers.get(key)
        return set(worker.by_engine_id.values()) if worker else set()

    def workers(self) -> list[WorkerKey]:
        return list(self._workers)

    def last_event_id(self, key: WorkerKey) -> int:
        worker = self._workers.get(key)
        return worker.last_event_id if worker else -1

    @property
    def num_blocks(self) -> int:
        """(worker, block) pairs indexed."""
        return sum(self._tree_sizes.values())
