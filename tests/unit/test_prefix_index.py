from services.common.hashing import local_block_hashes, sequence_hashes
from services.common.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    StoredBlock,
)
from services.indexer.prefix_index import PrefixIndex

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
    return {o.worker[0]: o.matched_blocks for o in index.find_matches(local_block_hashes(tokens, BLOCK))}


PROMPT = list(range(16))  # 4 blocks


def test_matched_prefix_per_worker():
    index = PrefixIndex()
    feed = Feed(index)
    feed.send(1, stored_chain(PROMPT))
    feed.send(2, stored_chain(PROMPT[:8]))
    feed.send(3, stored_chain([99] * 8))
    assert matches(index, PROMPT) == {1: 4, 2: 2, 3: 0}
    sizes = {o.worker[0]: o.total_blocks for o in index.find_matches([])}
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
