"""One worker's blocks in the prefix index, and the bookkeeping that concerns that worker alone
(sans-I/O): engine block ids, prefix closure, block tiers, MoE tags. The index
(:class:`~kvmesh.common.core.prefix_index.PrefixIndex`) keeps what spans workers: which workers hold
each block (one bit each), and applies events in order.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from kvmesh.common.wire.hashing import HASH_SEED
from kvmesh.common.wire.kv_events import (
    DEVICE_TIER,
    EVICTED_TIER,
    IN_TRANSIT_TIER,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    MoePlacement,
    StoredBlock,
)

_pack_pair = struct.Struct("<QQ").pack
_xxh3 = xxhash.xxh3_64_intdigest

UNKNOWN_PARENT = -1  # a held block whose parent's sequence hash is not known (sequence hashes are >= 0)
# Metadata of blocks a pool evicted, kept per worker: enough to tell what the pool recently lost
# without letting a long-lived pool grow the index without bound.
EVICTED_METADATA_LIMIT = 65536


@dataclass
class WorkerBlocks:
    """One worker's blocks: engine block id -> sequence hash, plus duplicate copies per hash.

    ``parent_of`` / ``child_count`` / ``orphans`` track prefix closure: a block is an *orphan* when its
    parent is not held by the same worker (its parent was evicted first). With no orphan, holding a
    block implies holding its whole prefix, which lets queries bisect instead of scanning.
    """

    bit: int
    by_engine_id: dict[int, int] = field(default_factory=dict)
    # Engines that keep two blocks with the same content (vLLM does not de-duplicate) hold a hash
    # more than once; only the extra copies are counted, so the common case costs nothing.
    extra_copies: dict[int, int] = field(default_factory=dict)
    parent_of: dict[int, int | None] = field(default_factory=dict)
    child_count: dict[int, int] = field(default_factory=dict)
    orphans: int = 0
    last_event_id: int = -1
    # MoE metadata of held blocks that carry any (sequence hash -> placements), and how many held
    # blocks were computed with each (layer, expert): what the worker hosts. Empty for dense models.
    moe: dict[int, tuple[MoePlacement, ...]] = field(default_factory=dict)
    experts: Counter[tuple[int, int]] = field(default_factory=Counter)
    # Block tiers beyond the resident one (the tier of the events that store blocks here): copies in
    # flight (engine id -> sequence hash; not matched) and evicted blocks' metadata (the same,
    # oldest first). Both empty unless the worker publishes those tiers.
    tier: str = DEVICE_TIER
    in_transit: dict[int, int] = field(default_factory=dict)
    evicted: dict[int, int] = field(default_factory=dict)

    @property
    def unique_blocks(self) -> int:
        return len(self.parent_of)

    # ---- block tiers (DESIGN §7) ------------------------------------------------------------
    def track_transit(self, data: BlocksStored | BlocksRemoved | AllBlocksCleared, stats: ApplyStats) -> None:
        """Apply an ``in_transit`` event: announce blocks (their parent held or in flight) or abandon them."""
        transit = self.in_transit
        if isinstance(data, BlocksStored):
            parent: int | None = None
            if data.parent_hash is not None:
                parent = self.by_engine_id.get(data.parent_hash, transit.get(data.parent_hash))
                if parent is None:
                    stats.unknown_parent += 1
                    return
            for block in data.blocks:
                seq = block.tokens_hash if parent is None else _xxh3(_pack_pair(parent, block.tokens_hash), HASH_SEED)
                transit[block.block_hash] = seq
                self.evicted.pop(block.block_hash, None)
                parent = seq
        elif isinstance(data, BlocksRemoved):
            for engine_id in data.block_hashes:
                if transit.pop(engine_id, None) is None:
                    stats.unknown_removals += 1
        else:
            transit.clear()

    def settle(self, blocks: Sequence[StoredBlock]) -> None:
        """Blocks now resident leave the in-flight and evicted states."""
        for block in blocks:
            self.in_transit.pop(block.block_hash, None)
            self.evicted.pop(block.block_hash, None)

    def keep_evicted(self, engine_ids: Iterable[int]) -> None:
        """Keep the metadata of blocks a pool evicted (at most :data:`EVICTED_METADATA_LIMIT`, oldest out)."""
        evicted = self.evicted
        for engine_id in engine_ids:
            seq = self.by_engine_id.get(engine_id)
            if seq is not None:
                evicted.pop(engine_id, None)  # re-evicted: it becomes the newest
                evicted[engine_id] = seq
        while len(evicted) > EVICTED_METADATA_LIMIT:
            del evicted[next(iter(evicted))]

    def tier_of(self, engine_id: int) -> str | None:
        """One block's state: the resident tier, ``in_transit``, ``evicted``, or None (unknown here)."""
        if engine_id in self.by_engine_id:
            return self.tier
        if engine_id in self.in_transit:
            return IN_TRANSIT_TIER
        if engine_id in self.evicted:
            return EVICTED_TIER
        return None

    def import_tiers(self, tier: str, in_transit: Mapping[int, int], evicted: Mapping[int, int]) -> None:
        self.tier = tier
        self.in_transit = dict(in_transit)
        self.evicted = dict(evicted)

    # ---- MoE metadata (DESIGN §7) ----------------------------------------------------------
    def tag(self, seq: int, placements: tuple[MoePlacement, ...]) -> None:
        """Record the expert placement a held block was computed with."""
        self.untag(seq)
        self.moe[seq] = placements
        self.experts.update({(layer, expert) for layer, expert, _ in placements})

    def untag(self, seq: int) -> None:
        placements = self.moe.pop(seq, None)
        if placements:
            self.experts.subtract({(layer, expert) for layer, expert, _ in placements})
            self.experts = +self.experts  # drop experts no block uses any more

    def moe_alignment(self, matched_prefix: Sequence[int], experts: set[tuple[int, int]]) -> tuple[int, int]:
        """(blocks of ``matched_prefix`` computed with one of ``experts``, how many of ``experts`` this
        worker's held blocks were computed with)."""
        hosted = sum(1 for expert in experts if self.experts.get(expert))
        tags = self.moe
        aligned = sum(
            1 for seq in matched_prefix if any((layer, expert) in experts for layer, expert, _ in tags.get(seq, ()))
        )
        return aligned, hosted

    def clear_metadata(self) -> None:
        """Forget MoE tags and tier bookkeeping (the worker cleared its cache)."""
        self.moe.clear()
        self.experts.clear()
        self.in_transit.clear()
        self.evicted.clear()


@dataclass
class ApplyStats:
    events_applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    duplicates_skipped: int = 0
    unknown_parent: int = 0
    unknown_removals: int = 0
    gaps: int = 0
    recoveries: int = 0
