from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.common.wire.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    StoredBlock,
)

BLOCK = 4


def stored_chain(tokens: list[int], start_block: int = 0, parent_engine: int | None = None) -> BlocksStored:
    """A stored event for the blocks of ``tokens`` from ``start_block``, engine ids = sequence hashes."""
    local = local_block_hashes(tokens, BLOCK)
    seq = sequence_hashes(local)
    blocks = tuple(StoredBlock(seq[i], local[i], BLOCK) for i in range(start_block, len(local)))
    return BlocksStored(parent_engine, blocks)


class Feed:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.next_id: dict[int, int] = {}

    def send(self, worker: int, *events) -> None:
        first = self.next_id.get(worker, 0)
        batch = tuple(KvEvent(first + i, e) for i, e in enumerate(events))
        self.next_id[worker] = first + len(events)
        self.index.apply_batch(KvEventBatch(worker, 0, 0.0, batch))


def matches(index: PrefixIndex, tokens: list[int]) -> dict[int, int]:
    """Matched blocks per known worker (0 for those holding none of the prefix)."""
    matched = index.find_matches(local_block_hashes(tokens, BLOCK))
    return {key[0]: matched.get(key, 0) for key in index.tree_sizes()}


PROMPT = list(range(16))  # 4 blocks


def test_matched_prefix_per_worker():
    index = PrefixIndex()
    feed = Feed(index)
    feed.send(1, stored_chain(PROMPT))
    feed.send(2, stored_chain(PROMPT[:8]))
    feed.send(3, stored_chain([99] * 8))
    assert matches(index, PROMPT) == {1: 4, 2: 2, 3: 0}
    sizes = {k[0]: v for k, v in index.tree_sizes().items()}
    assert sizes == {1: 4, 2: 2, 3: 2}


def test_children_link_to_their_parent_by_engine_id():
    index = PrefixIndex()
    feed = Feed(index)
    seq = sequence_hashes(local_block_hashes(PROMPT, BLOCK))
    feed.send(1, stored_chain(PROMPT[:8]), stored_chain(PROMPT, start_block=2, parent_engine=seq[1]))
    assert matches(index, PROMPT) == {1: 4}


def test_removal_cuts_the_match_at_the_removed_block():
    index = PrefixIndex()
    feed = Feed(index)
    seq = sequence_hashes(local_block_hashes(PROMPT, BLOCK))
    feed.send(1, stored_chain(PROMPT))
    feed.send(1, BlocksRemoved((seq[2],)))
    assert matches(index, PROMPT) == {1: 2}


def test_duplicate_delivery_is_a_no_op():
    index = PrefixIndex()
    batch = KvEventBatch(1, 0, 0.0, (KvEvent(0, stored_chain(PROMPT)),))
    index.apply_batch(batch)
    removal = KvEventBatch(
        1, 0, 0.0, (KvEvent(1, BlocksRemoved((sequence_hashes(local_block_hashes(PROMPT, BLOCK))[0],))),)
    )
    index.apply_batch(removal)
    index.apply_batch(batch)  # redelivered old store must not bring the block back
    assert matches(index, PROMPT) == {1: 0}
    assert index.stats.duplicates_skipped == 1


def test_unknown_parent_is_dropped_not_guessed():
    index = PrefixIndex()
    Feed(index).send(1, stored_chain(PROMPT, start_block=2, parent_engine=12345))
    assert matches(index, PROMPT) == {1: 0}
    assert index.stats.unknown_parent == 1


def test_cleared_and_removed_workers_hold_nothing():
    index = PrefixIndex()
    feed = Feed(index)
    feed.send(1, stored_chain(PROMPT))
    feed.send(2, stored_chain(PROMPT))
    feed.send(1, AllBlocksCleared())
    index.remove_worker(2)
    feed.send(2, stored_chain([5] * 8))  # a late event of a departed worker is ignored
    assert matches(index, PROMPT) == {1: 0}
    assert index.num_blocks == 0


def test_a_block_shared_by_two_workers_survives_one_removal():
    index = PrefixIndex()
    feed = Feed(index)
    seq = sequence_hashes(local_block_hashes(PROMPT, BLOCK))
    feed.send(1, stored_chain(PROMPT))
    feed.send(2, stored_chain(PROMPT))
    feed.send(1, BlocksRemoved(tuple(seq)))
    assert matches(index, PROMPT) == {1: 0, 2: 4}


def _dump(tokens: list[int]) -> list:
    from kvmesh.common.core.prefix_index import DumpedBlock

    local = local_block_hashes(tokens, BLOCK)
    seq = sequence_hashes(local)
    return [DumpedBlock(seq[i], local[i], seq[i - 1] if i else None) for i in range(len(seq))]


def test_a_gap_holds_back_events_until_the_workers_dump_rebuilds_it():
    index = PrefixIndex()
    seq = sequence_hashes(local_block_hashes(PROMPT, BLOCK))
    index.apply_batch(KvEventBatch(1, 0, 0.0, (KvEvent(0, stored_chain(PROMPT[:8])),)))
    # events 1..2 are lost; event 3 removes block 0 and event 4 stores an unrelated prefix
    other = [77] * 8
    index.apply_batch(KvEventBatch(1, 0, 0.0, (KvEvent(3, BlocksRemoved((seq[0],))), KvEvent(4, stored_chain(other)))))
    assert index.gaps_pending == {(1, 0)} and index.in_recovery((1, 0))
    assert matches(index, PROMPT) == {1: 2}  # nothing after the gap was applied
    # the worker's dump as of event 2: it had stored the whole prompt by then
    index.replace_worker((1, 0), 2, list(reversed(_dump(PROMPT))))  # any order
    assert not index.gaps_pending and not index.in_recovery((1, 0))
    assert matches(index, PROMPT) == {1: 0}  # held-back removal (event 3) applied on top
    assert matches(index, other) == {1: 2}  # and the held-back store (event 4)
    assert index.last_event_id((1, 0)) == 4 and index.stats.recoveries == 1


def test_a_dump_newer_than_held_back_events_skips_them():
    index = PrefixIndex()
    index.apply_batch(KvEventBatch(1, 0, 0.0, (KvEvent(5, stored_chain([3] * 8)),)))  # first seen: 5
    assert index.gaps_pending == {(1, 0)}
    index.replace_worker((1, 0), 9, _dump(PROMPT))
    assert matches(index, PROMPT) == {1: 4} and matches(index, [3] * 8) == {1: 0}
    assert index.stats.duplicates_skipped == 1


def test_removing_a_worker_in_recovery_drops_its_held_back_events():
    index = PrefixIndex()
    index.apply_batch(KvEventBatch(1, 0, 0.0, (KvEvent(3, stored_chain(PROMPT)),)))
    index.remove_worker(1)
    assert not index.gaps_pending and index.workers() == []
    index.replace_worker((1, 0), 4, _dump(PROMPT))  # a late dump of a departed worker is ignored
    assert index.num_blocks == 0


def test_a_readmitted_worker_is_rebuilt_from_its_dump_and_its_new_events_count():
    index = PrefixIndex()
    feed = Feed(index)
    feed.send(1, stored_chain(PROMPT[:8]))  # event 0
    index.remove_worker(1)  # its lease lapsed behind a partition; it lived on
    feed.send(
        1, stored_chain(PROMPT, start_block=2, parent_engine=sequence_hashes(local_block_hashes(PROMPT, BLOCK))[1])
    )
    assert index.num_blocks == 0  # ignored while removed
    index.readmit_worker(1)
    assert index.gaps_pending == {(1, 0)} and index.in_recovery((1, 0))
    feed.send(1, stored_chain([9] * 8))  # event 2 arrives before the dump: held back
    assert matches(index, [9] * 8) == {1: 0}
    index.replace_worker((1, 0), 1, _dump(PROMPT))  # its dump as of event 1 holds what it stored while away
    assert matches(index, PROMPT) == {1: 4} and matches(index, [9] * 8) == {1: 2}
    assert not index.is_removed(1) and not index.gaps_pending


def test_a_suspected_worker_is_rebuilt_from_its_dump_though_no_gap_showed():
    """The stream lost messages this replica never read, and the worker published nothing after them
    (no gap in its event ids): suspected, it is rebuilt from its dump like a worker with a gap."""
    index = PrefixIndex()
    feed = Feed(index)
    feed.send(1, stored_chain(PROMPT[:8]))  # event 0; event 1 (the rest of the prompt) was in the lost messages
    feed.next_id[1] = 2
    index.remove_worker(2)
    for worker in (1, 2, 3):  # 3: a worker whose only events were lost
        index.suspect_worker(worker)
    assert index.gaps_pending == {(1, 0), (3, 0)} and index.in_recovery((1, 0))
    feed.send(1, stored_chain([9] * 8))  # event 2 comes before the dump: held back, then applied on top
    assert matches(index, [9] * 8) == {1: 0, 3: 0}
    index.replace_worker((1, 0), 1, _dump(PROMPT))  # the worker's dump as of event 1
    index.replace_worker((3, 0), 4, _dump([5] * 8))
    assert matches(index, PROMPT) == {1: 4, 3: 0} and matches(index, [9] * 8) == {1: 2, 3: 0}
    assert matches(index, [5] * 8) == {1: 0, 3: 2}
    assert not index.gaps_pending and index.workers() == [(1, 0), (3, 0)]


def test_a_dump_asked_for_before_the_worker_was_removed_and_readmitted_again_is_refused():
    """The indexer asked a readmitted worker for its dump; while the answer travelled, the worker was
    removed (its events ignored) and readmitted once more. That dump misses what it stored meanwhile,
    and no event held back brings it: loading it would lose those blocks for good."""
    index = PrefixIndex()
    feed = Feed(index)
    feed.send(1, stored_chain(PROMPT[:8]))  # event 0
    index.remove_worker(1)
    index.readmit_worker(1)
    asked = index.admission(1)
    stale = _dump(PROMPT[:8])  # the worker's state as of event 0, when it was asked
    index.remove_worker(1)
    seq = sequence_hashes(local_block_hashes(PROMPT, BLOCK))
    feed.send(1, stored_chain(PROMPT, start_block=2, parent_engine=seq[1]))  # event 1: ignored, removed
    index.readmit_worker(1)
    assert not index.replace_worker((1, 0), 0, stale, asked)
    assert index.gaps_pending == {(1, 0)}  # still waiting for a dump
    assert index.replace_worker((1, 0), 1, _dump(PROMPT), index.admission(1))
    assert matches(index, PROMPT) == {1: 4} and not index.gaps_pending


def test_snapshot_export_import_round_trip():
    index = PrefixIndex()
    feed = Feed(index)
    feed.send(1, stored_chain(PROMPT))
    feed.send(2, stored_chain(PROMPT[:8]))
    restored = PrefixIndex()
    for key in index.workers():
        restored.import_worker(key, *index.export_worker(key))
    assert matches(restored, PROMPT) == {1: 4, 2: 2}
    assert dict(restored.tree_sizes()) == dict(index.tree_sizes())
    assert restored.last_event_id((1, 0)) == 0


def test_a_parent_stored_again_counts_the_orphan_it_adopts_and_a_new_child():
    """Regression (found by the property test): a block re-stored in a run adopts its held orphan
    child; the next block of the same run is a second child, and both must be counted."""
    index = PrefixIndex()
    feed = Feed(index)
    p, c = 101, 102  # engine ids
    feed.send(1, BlocksStored(None, (StoredBlock(p, 11, BLOCK), StoredBlock(c, 22, BLOCK))))
    feed.send(1, BlocksRemoved((p,)))  # c is now an orphan
    p2, c2 = 103, 104
    feed.send(1, BlocksStored(None, (StoredBlock(p2, 11, BLOCK), StoredBlock(c2, 33, BLOCK))))
    feed.send(1, BlocksRemoved((c2,)))
    feed.send(1, BlocksRemoved((p2,)))  # c is an orphan again
    worker = index._workers[(1, 0)]
    assert worker.orphans == 1
    # a query for the orphan's prefix must not claim the missing parent
    assert index.find_matches([11, 22]) == {}
