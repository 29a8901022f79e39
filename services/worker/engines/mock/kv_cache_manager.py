"""A sequence's KV memory in the mock engine: which blocks it holds, what it finds cached, what it
registers (sans-I/O).

The scheduler (:class:`~kvmesh.worker.engines.mock.mock_engine.MockEngine`) decides *who* runs; this class
decides whether the memory is there and keeps each sequence's block table, on top of the
:class:`BlockManager` pool (prefix cache, reference counts, eviction, KV events). As in vLLM, the
KV cache manager is its own class beside the scheduler, not inside it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.common.wire.hashing import blocks_needed, hash_block_tokens, local_block_hashes, lora_seed, sequence_hashes
from kvmesh.common.wire.kv_events import EventData, MoePlacement
from kvmesh.worker.engine import EngineRequestError, TransferPlan, transferable_blocks
from kvmesh.worker.engines.mock.block_manager import BlockManager, KvBlock
from kvmesh.worker.engines.mock.host_tier import ChainBlock, HostTier
from kvmesh.worker.engines.mock.request import EngineRequest
from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer


class KvCacheManager:
    """Block tables of the engine's sequences over one pool. Guarantees: a sequence holds exactly
    ``blocks_needed(num_computed + scheduled)`` blocks while it runs and none once freed; its full
    computed blocks are registered (and, with a KV buffer, filled) in order, each once."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv: KvBuffer | None = None,
        moe_placements: tuple[MoePlacement, ...] = (),
        host_blocks: int = 0,
    ) -> None:
        """``host_blocks``: the size of a host tier that takes evicted blocks (0: none)."""
        if kv is not None and kv.num_blocks != num_blocks:
            raise ValueError("the KV buffer must have one region per block")
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size, moe_placements)
        self.kv = kv
        self.host: HostTier | None = None
        if host_blocks:
            self.host = HostTier(host_blocks, block_size, moe_placements)
            self.blocks.on_evict = self._offload

    def _offload(self, evicted: KvBlock) -> None:
        """Copy an evicted block to the host tier, with its ancestors still on the device."""
        assert self.host is not None and evicted.sequence_hash is not None
        chain: list[ChainBlock] = [(evicted.sequence_hash, evicted.local_hash, evicted.parent_hash)]
        parent = evicted.parent_hash
        while parent is not None and not self.host.holds(parent):
            block = self.blocks.cached_block(parent)
            if block is None:
                return  # an ancestor is gone from both tiers: the copy could not be chained
            chain.append((parent, block.local_hash, block.parent_hash))
            parent = block.parent_hash
        chain.reverse()
        self.host.offload(chain)

    def drain_host_events(self) -> list[EventData]:
        return self.host.drain_events() if self.host is not None else []

    # ---- reading ---------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return self.blocks.num_cached

    @property
    def num_active(self) -> int:
        return self.blocks.num_active

    def cached_blocks(self) -> list[tuple[int, int, int | None]]:
        """(block id = sequence hash, local hash, parent id) of every registered block."""
        return self.blocks.cached_blocks()

    def drain_events(self) -> list[EventData]:
        return self.blocks.drain_events()

    def cached_prefix_tokens(self, prompt: Sequence[int], lora_name: str | None = None) -> int:
        """Prompt tokens the cache would serve right now."""
        hashes = sequence_hashes(local_block_hashes(prompt, self.block_size, lora_name))
        return self.blocks.cached_prefix_length(hashes) * self.block_size

    def prompt_hashes(
        self,
        prompt: Sequence[int],
        lora_name: str | None,
        precomputed: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """(local, sequence) hashes of the prompt's full blocks; ``precomputed`` ones (the replay has
        them from routing) are checked against the prompt's length and taken as they are."""
        if precomputed is None:
            local = local_block_hashes(prompt, self.block_size, lora_name)
            return local, sequence_hashes(local)
        local, chained = list(precomputed[0]), list(precomputed[1])
        if not len(local) == len(chained) == len(prompt) // self.block_size:
            raise EngineRequestError("block_hashes does not match the prompt's full blocks")
        return local, chained

    def full_block_hashes(self, request: EngineRequest) -> list[int]:
        """Sequence hashes of every full block of prompt + output so far (output blocks hashed as
        they fill)."""
        full = request.num_tokens // self.block_size
        hashes = request.seq_hashes
        if full > len(hashes):
            seed = lora_seed(request.lora_name)
            for b in range(len(hashes), full):
                start = b * self.block_size
                tokens = [request.token_at(i) for i in range(start, start + self.block_size)]
                local = hash_block_tokens(tokens, seed)
                request.local_hashes.append(local)
                hashes.extend(sequence_hashes([local], hashes[-1] if hashes else None))
        return hashes[:full]

    # ---- changing ----------------------------------------------------------------------------
    def admit(self, request: EngineRequest, budget: int) -> bool:
        """Attach the cached prefix and the blocks of the first chunk; False if memory is short.
        With a host tier, the blocks past the device's prefix that it holds are reloaded (cached
        again on the device, counted as cached tokens; ``request.reloaded_blocks`` says how many,
        for the step's time)."""
        all_hashes = self.full_block_hashes(request)
        cached = self.blocks.cached_prefix_length(all_hashes)
        # At least one token is always computed, so the step has a token to sample from.
        last_full = (request.num_tokens - 1) // self.block_size
        cached = min(cached, last_full)
        reload = min(self.host.run_length(all_hashes, cached), last_full - cached) if self.host is not None else 0
        prefix = all_hashes[:cached]
        computed = (cached + reload) * self.block_size
        first_chunk = min(request.num_tokens - computed, budget)
        fresh = blocks_needed(computed + first_chunk, self.block_size) - cached
        if fresh + self.blocks.inactive_count(prefix) > self.blocks.num_available:
            return False
        request.blocks = self.blocks.acquire_cached(prefix)
        request.blocks.extend(self.blocks.allocate(fresh))
        if reload:
            assert self.host is not None
            reloaded = all_hashes[cached : cached + reload]
            parent = prefix[-1] if prefix else None
            self.blocks.register(
                request.blocks[cached : cached + reload],
                reloaded,
                request.local_hashes[cached : cached + reload],
                parent,
            )
            self.host.touch(reloaded)
            if self.kv is not None:
                self.kv.fill_many([block.slot for block in request.blocks[cached : cached + reload]], reloaded)
        request.reloaded_blocks = reload
        request.num_computed = computed
        request.num_registered = cached + reload
        if request.cached_tokens is None:
            request.cached_tokens = min(computed, len(request.prompt))
        return True

    def grow(self, request: EngineRequest, num_tokens: int) -> bool:
        """Give the request blocks for ``num_tokens`` tokens; False if the pool cannot."""
        needed = blocks_needed(num_tokens, self.block_size) - len(request.blocks)
        if needed <= 0:
            return True
        if needed > self.blocks.num_available:
            return False
        request.blocks.extend(self.blocks.allocate(needed))
        return True

    def register_full_blocks(self, request: EngineRequest) -> None:
        """Register the request's newly computed full blocks (emitting ``stored``) and fill their KV."""
        full = request.num_computed // self.block_size
        if full <= request.num_registered:
            return
        hashes = self.full_block_hashes(request)
        start = request.num_registered
        parent = hashes[start - 1] if start > 0 else None
        self.blocks.register(request.blocks[start:full], hashes[start:full], request.local_hashes[start:full], parent)
        request.num_registered = full
        if self.kv is not None:
            self.kv.fill_many([block.slot for block in request.blocks[start:full]], hashes[start:full])

    def import_blocks(
        self,
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        prefix_hashes: Sequence[int],
        contents: Sequence[bytes],
    ) -> int:
        """Cache consecutive blocks whose KV another worker computed (read from the KV pool), after
        the cached blocks ``prefix_hashes`` (sequence hashes, the last one the new blocks' parent;
        empty at the start); returns how many were taken. Each block's bytes are checked against what
        this worker would have computed for it; the first that differs ends the import. The blocks
        are cached, not held: the request that wanted them finds them as a cached prefix."""
        if self.kv is None:
            return 0
        # The prefix is held while fresh blocks are allocated: evicting it to make room (its parent
        # is often the least recently used block) would cache the imported run under a parent this
        # worker no longer has, and every index would drop the run as an orphan.
        prefix = self.blocks.acquire_cached(prefix_hashes)
        try:
            count = min(len(contents), self.blocks.num_available)
            if count == 0:
                return 0
            blocks = self.blocks.allocate(count)
            good = 0
            for block, sequence_hash, content in zip(blocks, sequence_hashes, contents, strict=False):
                self.kv.region(block.slot)[:] = content
                if not self.kv.holds(block.slot, sequence_hash):
                    break
                good += 1
            parent = prefix_hashes[-1] if prefix_hashes else None
            self.blocks.register(blocks[:good], sequence_hashes[:good], local_hashes[:good], parent)
            self.blocks.release(blocks)
            return good
        finally:
            self.blocks.release(prefix)  # after the new blocks: their tail is evicted before the prefix

    def free(self, request: EngineRequest) -> None:
        self.blocks.release(request.blocks)
        request.blocks = []

    def reserve_transfer(self, request: EngineRequest) -> TransferPlan | None:
        """Blocks for a prompt whose KV another worker computed: the cached prefix here is reused,
        fresh blocks take the rest of the transferable blocks. None (nothing held) when memory is
        short. A plan with no slots means everything transferable is cached here already."""
        wanted = transferable_blocks(len(request.prompt), self.block_size)
        hashes = request.seq_hashes[:wanted]
        cached = self.blocks.cached_prefix_length(hashes)
        fresh = wanted - cached
        if fresh + self.blocks.inactive_count(hashes[:cached]) > self.blocks.num_available:
            return None
        request.blocks = self.blocks.acquire_cached(hashes[:cached])
        request.blocks.extend(self.blocks.allocate(fresh))
        request.cached_tokens = cached * self.block_size
        return TransferPlan(cached, [b.slot for b in request.blocks[cached:]], hashes[cached:])

    def commit_transfer(self, request: EngineRequest) -> None:
        """The transferred KV is in the reserved blocks: register them; the request resumes after them."""
        full = len(request.blocks)
        cached = request.cached_tokens // self.block_size if request.cached_tokens else 0
        parent = request.seq_hashes[cached - 1] if cached > 0 else None
        self.blocks.register(
            request.blocks[cached:full], request.seq_hashes[cached:full], request.local_hashes[cached:full], parent
        )
        request.num_computed = full * self.block_size
        request.num_registered = full
