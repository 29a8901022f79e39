"""A paged KV block pool with prefix caching, reference counts and LRU eviction (sans-I/O).

The pool holds a fixed number of blocks. A block is either

- *free*: holds nothing;
- *active*: referenced by at least one running sequence (``ref_count > 0``);
- *cached and inactive*: registered under its sequence hash, referenced by nobody, kept for reuse
  and evicted least-recently-released first when a new block is needed.

Full, computed blocks are *registered* under their sequence hash so later requests can reuse them.
Two sequences may compute the same block concurrently; the second copy is not registered (it stays
private and is freed on release), so every hash maps to exactly one block and the events we emit
describe the cache exactly.

Every block owns a physical *slot* (0 … num_blocks-1) for its whole life: the slot is where the
block's KV bytes live in the worker's KV buffer, and what a KV transfer reads or writes. A slot goes
back to the free list when its block is freed or evicted.

Events are produced here, at the single place the cache changes: registering emits ``stored``,
evicting emits ``removed``, :meth:`clear` emits ``cleared``. The engine's block id in the events is
the sequence hash, which is unique per cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.common.wire.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    EventData,
    MoePlacement,
    StoredBlock,
)


class OutOfBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free or evictable."""


@dataclass(slots=True, eq=False)
class KvBlock:
    """One block of the pool. The hashes are set once the block is registered in the cache."""

    slot: int
    ref_count: int = 0
    sequence_hash: int | None = None
    local_hash: int = 0
    parent_hash: int | None = None


class BlockManager:
    """Fixed-capacity block pool; guarantees ``free + active + inactive == num_blocks`` at all times,
    and that no two live blocks share a slot."""

    def __init__(self, num_blocks: int, block_size: int, moe_placements: tuple[MoePlacement, ...] = ()) -> None:
        """``moe_placements``: the MoE experts every block is computed with (its stored events say so)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.moe_placements = moe_placements
        self._cached: dict[int, KvBlock] = {}
        # Inactive cached blocks in eviction order: the first entry is the least recently released.
        self._inactive: OrderedDict[int, KvBlock] = OrderedDict()
        self._num_active = 0
        self._events: list[EventData] = []
        # Free slots; popped from the end, so a fresh pool hands out 0, 1, 2, ...
        self._free_slots: list[int] = list(range(num_blocks - 1, -1, -1))
        # told of each cached block as it is evicted (already out of the cache; the host tier copies it)
        self.on_evict: Callable[[KvBlock], None] | None = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return self.num_blocks - self._num_active - len(self._inactive)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.num_blocks - self._num_active

    @property
    def num_active(self) -> int:
        return self._num_active

    @property
    def num_cached(self) -> int:
        """Registered blocks, active or not (what the indexer should see for this worker)."""
        return len(self._cached)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def cached_prefix_length(self, sequence_hashes: Sequence[int]) -> int:
        """How many leading blocks of a sequence the cache holds."""
        for i, h in enumerate(sequence_hashes):
            if h not in self._cached:
                return i
        return len(sequence_hashes)

    def cached_block(self, sequence_hash: int) -> KvBlock | None:
        """The registered block of a sequence hash (None when it is not cached)."""
        return self._cached.get(sequence_hash)

    def slot_of(self, sequence_hash: int) -> int | None:
        """The KV slot of a cached block (None when it is not cached)."""
        block = self._cached.get(sequence_hash)
        return None if block is None else block.slot

    def inactive_count(self, sequence_hashes: Sequence[int]) -> int:
        """How many of these cached blocks are inactive (acquiring them uses up evictable space)."""
        return sum(1 for h in sequence_hashes if h in self._inactive)

    def cached_blocks(self) -> list[tuple[int, int, int | None]]:
        """(engine block id, local hash, parent engine id) of every registered block."""
        return [(h, b.local_hash, b.parent_hash) for h, b in self._cached.items()]

    def drain_events(self) -> list[EventData]:
        events, self._events = self._events, []
        return events

    def recently_used(self, limit: int) -> list[tuple[int, int, int | None]]:
        """Up to about ``limit`` cached blocks, the hottest first chosen (those running sequences
        hold, then the most recently released), each with every cached ancestor, ordered so that a
        block's parent comes before it: what a worker that leaves hands on. (sequence hash, local
        hash, parent sequence hash)."""
        active = [h for h, b in self._cached.items() if b.ref_count > 0]
        chosen: dict[int, None] = {}
        for h in [*active, *reversed(self._inactive)]:
            if len(chosen) >= limit:
                break
            chain = []
            while h is not None and h in self._cached and h not in chosen:
                chain.append(h)
                h = self._cached[h].parent_hash
            chosen.update(dict.fromkeys(reversed(chain)))
        # within each chain, ancestors were added before their descendants
        return [(h, self._cached[h].local_hash, self._cached[h].parent_hash) for h in chosen]

    def cached_prefix(self, sequence_hashes: Sequence[int]) -> list[tuple[int, int, int | None]]:
        """The first of ``sequence_hashes`` that are cached, up to the first that is not, as
        (sequence hash, local hash, parent sequence hash): what another worker can pull of a prefix."""
        blocks = []
        for h in sequence_hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append((h, block.local_hash, block.parent_hash))
        return blocks

    def adopt(self, blocks: Sequence[tuple[int, int, int | None]]) -> int:
        """Cache blocks another worker computed, parent first (as :meth:`recently_used` lists them),
        without their bytes (a simulation's): each is registered after its parent, which must be
        cached here by then; one already cached, or whose parent is not, is skipped, and room is made
        by evicting this worker's least recently used blocks. Returns how many were taken."""
        taken = 0
        room = self.num_available  # free and evictable now: the blocks adopted here are never evicted for more
        for sequence_hash, local_hash, parent in blocks:
            if sequence_hash in self._cached or (parent is not None and parent not in self._cached):
                continue
            if taken == room:
                break
            held = self.acquire_cached([parent]) if parent is not None else []
            try:
                block = self.allocate(1)
                self.register(block, [sequence_hash], [local_hash], parent)
                self.release(block)
            finally:
                self.release(held)
            taken += 1
        return taken

    # ---- changes -------------------------------------------------------------------------
    def acquire_cached(self, sequence_hashes: Sequence[int]) -> list[KvBlock]:
        """Reference cached blocks for a new sequence (all must be cached)."""
        blocks = []
        for h in sequence_hashes:
            block = self._cached[h]
            if block.ref_count == 0:
                del self._inactive[h]
                self._num_active += 1
            block.ref_count += 1
            blocks.append(block)
        return blocks

    def allocate(self, count: int) -> list[KvBlock]:
        """Take ``count`` fresh blocks, evicting least-recently-used cached blocks if needed."""
        if count > self.num_available:
            raise OutOfBlocksError(f"need {count} blocks, {self.num_available} available")
        shortfall = count - self.num_free
        if shortfall > 0:
            evicted = []
            for _ in range(shortfall):
                h, block = self._inactive.popitem(last=False)
                del self._cached[h]
                if self.on_evict is not None:
                    self.on_evict(block)
                self._free_slots.append(block.slot)
                evicted.append(h)
            self._events.append(BlocksRemoved(tuple(evicted)))
        self._num_active += count
        free_slots = self._free_slots
        return [KvBlock(free_slots.pop(), ref_count=1) for _ in range(count)]

    def register(
        self,
        blocks: Sequence[KvBlock],
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        parent_hash: int | None,
    ) -> None:
        """Register consecutive full blocks of one sequence in the cache and emit ``stored``.

        ``parent_hash`` is the sequence hash of the block before ``blocks[0]`` (None at the start).
        A block whose hash is already cached stays private, which splits the stored run there.
        """
        run: list[StoredBlock] = []
        run_parent = parent_hash
        for block, seq_hash, local_hash in zip(blocks, sequence_hashes, local_hashes, strict=True):
            if seq_hash in self._cached:
                if run:
                    self._events.append(BlocksStored(run_parent, tuple(run)))
                    run = []
                run_parent = seq_hash
                continue
            block.sequence_hash = seq_hash
            block.local_hash = local_hash
            block.parent_hash = run_parent if not run else run[-1].block_hash
            self._cached[seq_hash] = block
            run.append(StoredBlock(seq_hash, local_hash, self.block_size, self.moe_placements))
        if run:
            self._events.append(BlocksStored(run_parent, tuple(run)))

    def release(self, blocks: Sequence[KvBlock]) -> None:
        """Drop one reference to each block. Registered blocks become evictable, private ones free.

        Blocks are released last-to-first so that a sequence's tail is evicted before its prefix.
        """
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self._num_active -= 1
            h = block.sequence_hash
            if h is not None and self._cached.get(h) is block:
                self._inactive[h] = block
            else:
                self._free_slots.append(block.slot)

    def clear(self) -> None:
        """Forget every inactive cached block (active ones stay usable but unregistered)."""
        for h in list(self._cached):
            self._cached[h].sequence_hash = None
        for block in self._inactive.values():
            self._free_slots.append(block.slot)
        self._cached.clear()
        self._inactive.clear()
        self._events.append(AllBlocksCleared())
