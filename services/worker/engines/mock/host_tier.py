"""The mock engine's host tier: copies of evicted device blocks in host memory (sans-I/O).

When the device pool evicts a cached block, its copy goes to the host tier, with the ancestors it
needs that are still on the device (so the tier's own chain starts at a prompt's first block, as the
index requires of every tier; vLLM's CPU offloading keeps whole prefixes too). A later request whose
prefix continues there reloads those blocks to the device instead of recomputing them, at a cost the
engine adds to the step (``EngineConfig.host_reload_ms_per_token``). The tier is bounded; the least
recently used block goes first, a chain's tail before its head. Its changes are events of tier
``host``, published as a stream of its own (the batch's tier ``host``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.common.wire.kv_events import BlocksRemoved, BlocksStored, EventData, MoePlacement, StoredBlock

ChainBlock = tuple[int, int, int | None]  # (sequence hash, local hash, parent sequence hash)


class HostTier:
    """Guarantees: at most ``num_blocks`` blocks; every held block's parent is held too (or it is a
    first block); the events describe exactly what it holds."""

    def __init__(self, num_blocks: int, block_size: int, moe_placements: tuple[MoePlacement, ...] = ()) -> None:
        if num_blocks <= 0:
            raise ValueError("a host tier needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.moe_placements = moe_placements
        self._held: OrderedDict[int, tuple[int, int | None]] = OrderedDict()  # least recently used first
        self._children: dict[int, int] = {}  # held children per held block
        self._events: list[EventData] = []

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, sequence_hash: int) -> bool:
        return sequence_hash in self._held

    def run_length(self, sequence_hashes: Sequence[int], start: int) -> int:
        """How many blocks from ``start`` on the tier holds, one after the other."""
        count = 0
        for sequence_hash in sequence_hashes[start:]:
            if sequence_hash not in self._held:
                break
            count += 1
        return count

    def offload(self, chain: Sequence[ChainBlock]) -> None:
        """Take copies of ``chain`` (from a first block, or from a block whose parent the tier holds,
        down to the evicted one); blocks already held are only marked recently used."""
        if not chain or (chain[0][2] is not None and chain[0][2] not in self._held):
            return  # it could not be chained to anything the tier holds: it is not taken
        new: list[ChainBlock] = [block for block in chain if block[0] not in self._held]
        if len(new) > self.num_blocks:
            return
        self._make_room(len(new), keep={block[0] for block in chain})
        if len(self._held) + len(new) > self.num_blocks:
            return  # what it holds is all in this chain's way: no room
        if new:
            parent = new[0][2]
            run: list[StoredBlock] = []
            for sequence_hash, local_hash, block_parent in new:
                if run and block_parent != run[-1].block_hash:  # a held block in between splits the run
                    self._events.append(BlocksStored(parent, tuple(run)))
                    run, parent = [], block_parent
                self._held[sequence_hash] = (local_hash, block_parent)
                if block_parent is not None:
                    self._children[block_parent] = self._children.get(block_parent, 0) + 1
                run.append(StoredBlock(sequence_hash, local_hash, self.block_size, self.moe_placements))
            self._events.append(BlocksStored(parent, tuple(run)))
        for sequence_hash, _local, _parent in reversed(chain):  # the head most recent: evicted last
            self._held.move_to_end(sequence_hash)

    def touch(self, sequence_hashes: Sequence[int]) -> None:
        """Blocks reloaded from the tier are its most recently used (the head last)."""
        for sequence_hash in reversed(sequence_hashes):
            if sequence_hash in self._held:
                self._held.move_to_end(sequence_hash)

    def blocks(self) -> list[ChainBlock]:
        """Every held block, parents before their children (a dump for the indexers)."""
        order: list[ChainBlock] = []
        placed: set[int] = set()
        for sequence_hash in self._held:
            chain = []
            current: int | None = sequence_hash
            while current is not None and current not in placed:
                local, parent = self._held[current]
                chain.append((current, local, parent))
                current = parent
            for block in reversed(chain):
                placed.add(block[0])
                order.append(block)
        return order

    def drain_events(self) -> list[EventData]:
        events, self._events = self._events, []
        return events

    def _make_room(self, wanted: int, keep: set[int]) -> None:
        """Drop least recently used leaves (never a block of ``keep``) until ``wanted`` more fit."""
        removed: list[int] = []
        while len(self._held) + wanted > self.num_blocks:
            victim = next((h for h in self._held if not self._children.get(h) and h not in keep), None)
            if victim is None:
                break
            _local, parent = self._held.pop(victim)
            if parent is not None and parent in self._children:
                self._children[parent] -= 1
                if not self._children[parent]:
                    del self._children[parent]
            removed.append(victim)
        if removed:
            self._events.append(BlocksRemoved(tuple(removed)))
