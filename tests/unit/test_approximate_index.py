import pytest

from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.router.approximate_index import ApproximateIndex

W1, W2 = (1, 0), (2, 0)


def chain(*locals_: int) -> tuple[list[int], list[int]]:
    return list(locals_), sequence_hashes(list(locals_))


def test_routed_blocks_match_until_their_ttl_passes():
    index = ApproximateIndex(block_size=16, ttl_s=10)
    local, seq = chain(1, 2, 3)
    index.record(W1, local, seq, now=0.0)
    assert index.find_matches_by_sequence(seq, now=9.9) == {W1: 3}
    assert index.find_matches_by_sequence(seq, now=10.1) == {}
    assert len(index) == 0 and index.tree_sizes()[W1] == 0


def test_reuse_refreshes_the_shared_prefix_only():
    index = ApproximateIndex(block_size=16, ttl_s=10)
    local, seq = chain(1, 2, 3)
    index.record(W1, local, seq, now=0.0)
    index.record(W1, local[:2], seq[:2], now=8.0)  # a later request shares the first two blocks
    assert index.find_matches_by_sequence(seq, now=12.0) == {W1: 2}


def test_size_bound_prunes_the_stalest_first_tail_before_parent():
    index = ApproximateIndex(block_size=16, ttl_s=100, max_blocks=4)
    old_local, old_seq = chain(1, 2, 3)
    new_local, new_seq = chain(7, 8)
    index.record(W1, old_local, old_seq, now=0.0)
    index.record(W2, new_local, new_seq, now=1.0)  # 5 pairs > 4: the oldest chain loses its leaf
    assert len(index) == 4
    assert index.find_matches_by_sequence(old_seq, now=2.0) == {W1: 2}
    assert index.find_matches_by_sequence(new_seq, now=2.0) == {W2: 2}


def test_removed_worker_holds_nothing():
    index = ApproximateIndex(block_size=16)
    local, seq = chain(1, 2)
    index.record(W1, local, seq, now=0.0)
    index.record(W2, local, seq, now=0.0)
    index.remove_worker(1)
    assert index.find_matches_by_sequence(seq, now=1.0) == {W2: 2} and len(index) == 2


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError):
        ApproximateIndex(block_size=16, ttl_s=0)
