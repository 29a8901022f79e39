"""Cached blocks offered by one mock engine's pool and taken into another's (sans-I/O)."""

from __future__ import annotations

from kvmesh.common.calling.worker_caches import sole_holdings
from kvmesh.common.wire.kv_events import BlocksStored
from kvmesh.worker.engines.mock import block_moves
from kvmesh.worker.engines.mock.block_manager import BlockManager


def cached_chain(pool: BlockManager, hashes: list[int]) -> None:
    blocks = pool.allocate(len(hashes))
    pool.register(blocks, hashes, [h + 1000 for h in hashes], None)
    pool.release(blocks)


def test_an_offered_block_is_not_evicted_until_released():
    pool = BlockManager(4, 16)
    cached_chain(pool, [1, 2])
    offer = block_moves.hold(pool, [1, 2, 99])  # 99 is not cached: left out
    assert len(offer.held) == 2
    assert pool.num_available == 2  # the held blocks cannot be evicted for new ones
    fresh = pool.allocate(2)
    assert pool.cached_block(1) is not None and pool.cached_block(2) is not None
    pool.release(fresh)
    pool.release(offer.held)
    assert pool.num_available == 4


def test_taken_blocks_are_cached_after_their_parents_and_announced():
    giver, taker = BlockManager(8, 16), BlockManager(8, 16)
    cached_chain(giver, [1, 2, 3])
    cached_chain(taker, [1])  # the taker holds the chain's first block already
    taker.drain_events()
    offered = giver.recently_used(8)
    intake = block_moves.reserve(taker, offered)
    assert len(intake.slots) == 3
    assert block_moves.commit(taker, intake, received=True) == 2  # 1 was cached: dropped
    assert taker.cached_block(3).parent_hash == 2 and taker.cached_block(2).parent_hash == 1
    stored = [e for e in taker.drain_events() if isinstance(e, BlocksStored)]
    assert [(e.parent_hash, [b.block_hash for b in e.blocks]) for e in stored] == [(1, [2]), (2, [3])]
    assert taker.num_available == 8  # nothing left held


def test_a_block_whose_parent_is_missing_and_a_failed_pull_cache_nothing():
    taker = BlockManager(8, 16)
    orphan = block_moves.reserve(taker, [(5, 6, 4)])  # its parent 4 is neither here nor offered
    assert block_moves.commit(taker, orphan, received=True) == 0
    failed = block_moves.reserve(taker, [(1, 2, None), (3, 4, 1)])
    assert block_moves.commit(taker, failed, received=False) == 0
    assert taker.num_cached == 0 and taker.num_available == 8


def test_a_taker_reserves_only_what_fits():
    taker = BlockManager(2, 16)
    intake = block_moves.reserve(taker, [(1, 2, None), (3, 4, 1), (5, 6, 3)])
    assert len(intake.slots) == 2 and [b[0] for b in intake.blocks] == [1, 3]
    assert block_moves.commit(taker, intake, received=True) == 2


def test_a_departure_loses_the_blocks_no_other_worker_holds():
    cached = {1: {10, 11, 12}, 2: {10, 20}, 3: {11}}
    assert sole_holdings(cached, cached) == {1: 1, 2: 1, 3: 0}
    # weighed by its hot blocks only (a subset of its cache), against every worker's cache
    assert sole_holdings({1: {10, 12}, 2: {20}}, cached) == {1: 1, 2: 1}
