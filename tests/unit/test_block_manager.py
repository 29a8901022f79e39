import pytest

from kvmesh.common.wire.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored
from kvmesh.worker.engines.mock.block_manager import BlockManager, OutOfBlocksError


def fill(bm: BlockManager, hashes: list[int], parent: int | None = None):
    """Allocate and register one block per hash, as an engine does after computing them."""
    blocks = bm.allocate(len(hashes))
    bm.register(blocks, hashes, [h + 1000 for h in hashes], parent)
    return blocks


def test_registered_blocks_are_reused_by_prefix():
    bm = BlockManager(num_blocks=8, block_size=16)
    blocks = fill(bm, [1, 2, 3])
    bm.release(blocks)
    assert bm.cached_prefix_length([1, 2, 3, 4]) == 3
    assert bm.cached_prefix_length([9, 2]) == 0  # stops at the first block it lacks
    again = bm.acquire_cached([1, 2])
    assert again == blocks[:2]
    assert bm.num_active == 2 and bm.num_cached == 3


def test_reference_counts_keep_shared_blocks_alive():
    bm = BlockManager(num_blocks=4, block_size=16)
    first = fill(bm, [1, 2])
    second = bm.acquire_cached([1, 2])
    bm.release(first)
    assert bm.num_active == 2  # still held by the second sequence
    bm.release(second)
    assert bm.num_active == 0 and bm.num_cached == 2


def test_eviction_is_least_recently_released_first_and_emits_removed():
    bm = BlockManager(num_blocks=4, block_size=16)
    a = fill(bm, [10, 11])
    b = fill(bm, [20, 21])
    bm.release(b)  # released first: evicted first
    bm.release(a)
    bm.drain_events()
    bm.allocate(1)
    # a sequence releases its tail first, so the tail goes before its prefix
    assert bm.drain_events() == [BlocksRemoved((21,))]
    bm.allocate(2)
    assert bm.drain_events() == [BlocksRemoved((20, 11))]
    assert bm.cached_prefix_length([10]) == 1


def test_capacity_is_never_exceeded():
    bm = BlockManager(num_blocks=3, block_size=16)
    held = bm.allocate(3)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(1)
    bm.release(held)  # private blocks go straight back to free
    assert bm.num_free == 3
    assert len(bm.allocate(3)) == 3


def test_stored_events_carry_parent_links_and_skip_duplicates():
    bm = BlockManager(num_blocks=8, block_size=16)
    fill(bm, [1, 2])
    duplicate_run = bm.allocate(2)
    bm.register(duplicate_run, [2, 3], [1002, 1003], parent_hash=1)  # 2 exists already: stays private
    events = bm.drain_events()
    assert isinstance(events[0], BlocksStored) and events[0].parent_hash is None
    assert [b.block_hash for b in events[0].blocks] == [1, 2]
    assert events[1] == BlocksStored(2, events[1].blocks)
    assert [b.block_hash for b in events[1].blocks] == [3]
    assert bm.num_cached == 3


def test_clear_forgets_the_cache():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.release(fill(bm, [1, 2]))
    bm.clear()
    assert bm.num_cached == 0 and bm.num_free == 4
    assert bm.drain_events()[-1] == AllBlocksCleared()


def test_a_leaving_worker_lists_its_hottest_blocks_with_their_prefixes_parent_first():
    bm = BlockManager(num_blocks=16, block_size=16)
    cold = fill(bm, [1, 2, 3])
    bm.release(cold)
    warm = fill(bm, [4, 5], parent=1)  # hangs under block 1
    bm.release(warm)
    running = fill(bm, [7, 8])  # held by a running sequence: hottest
    listed = bm.recently_used(limit=5)
    order = [h for h, _local, _parent in listed]
    assert order[:2] == [7, 8]  # what runs now first
    assert {1, 4, 5} <= set(order)  # then the most recently released, with its prefix (1)
    assert order.index(1) < order.index(4) < order.index(5)  # parents before children
    assert 3 not in order  # the cold tail is left out
    assert dict((h, p) for h, _l, p in listed)[4] == 1
    bm.release(running)


def test_adopted_blocks_are_cached_and_announced_and_orphans_skipped():
    source = BlockManager(num_blocks=16, block_size=16)
    bm_blocks = fill(source, [1, 2, 3])
    source.release(bm_blocks)
    receiver = BlockManager(num_blocks=4, block_size=16)
    own = fill(receiver, [9])
    receiver.release(own)
    receiver.drain_events()
    handed = [*source.recently_used(limit=8), (50, 1050, 49)]  # 50's parent 49 is nowhere
    assert receiver.adopt(handed) == 3
    assert receiver.cached_prefix_length([1, 2, 3]) == 3
    stored = [e for e in receiver.drain_events() if isinstance(e, BlocksStored)]
    assert [(e.parent_hash, [b.block_hash for b in e.blocks]) for e in stored] == [(None, [1]), (1, [2]), (2, [3])]
    assert receiver.adopt(handed) == 0  # already there
    assert receiver.num_cached == 4 and receiver.num_active == 0
    small = BlockManager(num_blocks=2, block_size=16)
    assert small.adopt(handed) == 2  # room for two: the chain's head, its tail left out
    assert small.cached_prefix_length([1, 2, 3]) == 2
