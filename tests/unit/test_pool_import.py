"""Importing blocks from the KV pool into a full cache: the prefix the imported run hangs from must
survive the allocation, or the worker caches a run whose parent it no longer has (an index then
drops it as an orphan, while the worker keeps and reports it: the index and the worker disagree
until the next gap makes the indexer ask for a dump)."""

from __future__ import annotations

from kvmesh.common.wire.kv_events import BlocksRemoved, BlocksStored
from kvmesh.worker.engines.mock.kv_cache_manager import KvCacheManager
from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer

BLOCK_BYTES = 64


def pool_copy(sequence_hash: int) -> bytes:
    """The bytes another worker would have written to the pool for this block."""
    buffer = KvBuffer(1, BLOCK_BYTES)
    buffer.fill(0, sequence_hash)
    return bytes(buffer.region(0))


def test_the_prefix_of_an_import_is_not_evicted_to_make_room_for_it():
    cache = KvCacheManager(num_blocks=4, block_size=16, kv=KvBuffer(4, BLOCK_BYTES))
    prefix = cache.blocks.allocate(2)
    cache.blocks.register(prefix, [100, 101], [1, 2], None)
    cache.blocks.release(prefix)  # cached and idle: 101, the tail, is the first to go
    cache.drain_events()

    taken = cache.import_blocks([102, 103, 104], [3, 4, 5], [100, 101], [pool_copy(h) for h in (102, 103, 104)])

    events = cache.drain_events()
    removed = {h for e in events if isinstance(e, BlocksRemoved) for h in e.block_hashes}
    stored = [e for e in events if isinstance(e, BlocksStored)]
    assert taken == 2  # the room the free blocks give, the prefix kept
    assert not removed & {100, 101}
    assert {100, 101, 102, 103} <= cache.blocks.cached_hashes()
    assert stored and stored[0].parent_hash == 101 and stored[0].parent_hash in cache.blocks.cached_hashes()


def test_an_import_at_the_start_of_a_prompt_has_no_parent():
    cache = KvCacheManager(num_blocks=4, block_size=16, kv=KvBuffer(4, BLOCK_BYTES))
    assert cache.import_blocks([7, 8], [1, 2], [], [pool_copy(7), pool_copy(9)]) == 1  # 8's bytes differ
    stored = [e for e in cache.drain_events() if isinstance(e, BlocksStored)]
    assert [b.block_hash for e in stored for b in e.blocks] == [7] and stored[0].parent_hash is None
    assert cache.blocks.num_active == 0  # nothing held after the import
