"""Cached blocks moved between live workers (sans-I/O): one worker *offers* cached blocks, held in
place until they are taken or the hold expires, and another *takes* them into its own cache, as if
it had computed them. A shrink hands a leaving worker's cache on this way and a join starts warm
(docs/decisions/0051); the bytes travel over the workers' KV transfer (``kvmesh.worker.cache_moves``).

A block is named ``(sequence hash, local hash, parent sequence hash)``, parents before children, as
:meth:`BlockManager.recently_used` lists them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvmesh.worker.engines.mock.block_manager import BlockManager, KvBlock

Block = tuple[int, int, int | None]  # (sequence hash, local hash, parent sequence hash)


def families(blocks: Sequence[Block], skip: Collection[int] = ()) -> list[list[Block]]:
    """``blocks`` (parents first) grouped by their first ancestor among them, each group one cached
    prefix and what grew from it, in order; a block named in ``skip`` (one the receiver holds) is
    left out of its group but still ties its descendants to it. Groups in order of their first block
    kept."""
    root_of: dict[int, int] = {}
    groups: dict[int, list[Block]] = {}
    for block in blocks:
        sequence_hash, _, parent = block
        root = root_of.get(parent, sequence_hash) if parent is not None else sequence_hash
        root_of[sequence_hash] = root
        if sequence_hash not in skip:
            groups.setdefault(root, []).append(block)
    return list(groups.values())


@dataclass
class Offer:
    """Blocks held for a taker: they stay cached (and are not evicted) until released."""

    held: list[KvBlock]

    @property
    def slots(self) -> list[int]:
        return [block.slot for block in self.held]


@dataclass
class Intake:
    """Fresh blocks reserved for an offer's bytes, and the cached parents they will hang from."""

    blocks: list[Block]  # the offer's first blocks, one per fresh block
    fresh: list[KvBlock]
    pinned: list[KvBlock]

    @property
    def slots(self) -> list[int]:
        return [block.slot for block in self.fresh]


def hold(pool: BlockManager, sequence_hashes: Sequence[int]) -> Offer:
    """Hold the cached blocks among ``sequence_hashes`` (in their order; one not cached is left out)."""
    return Offer(pool.acquire_cached([h for h in sequence_hashes if pool.cached_block(h) is not None]))


def reserve(pool: BlockManager, blocks: Sequence[Block]) -> Intake:
    """Room for as many of ``blocks`` (from the first) as this pool can take now. The cached parents
    they name are held meanwhile, so making room cannot evict the block a taken one hangs from."""
    offered = {block[0] for block in blocks}
    parents = dict.fromkeys(
        parent
        for _, _, parent in blocks
        if parent is not None and parent not in offered and pool.cached_block(parent) is not None
    )
    pinned = pool.acquire_cached(list(parents))
    count = min(len(blocks), pool.num_available)
    return Intake(list(blocks[:count]), pool.allocate(count) if count else [], pinned)


def commit(pool: BlockManager, intake: Intake, received: bool) -> int:
    """Register the intake's blocks whose bytes arrived (``received``), each after its parent, and
    release everything it held; a block already cached here, or whose parent is not, is dropped.
    Returns how many were cached; their ``stored`` events are the pool's to drain."""
    taken = 0
    if received:
        for block, (sequence_hash, local_hash, parent) in zip(intake.fresh, intake.blocks, strict=True):
            if pool.cached_block(sequence_hash) is not None:
                continue
            if parent is not None and pool.cached_block(parent) is None:
                continue
            pool.register([block], [sequence_hash], [local_hash], parent)
            taken += 1
    pool.release(intake.fresh)  # registered ones become cached (the newest), the rest free
    pool.release(intake.pinned)
    intake.fresh, intake.pinned = [], []
    return taken
