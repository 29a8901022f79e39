"""The shared-memory KV pool: segments written by one worker and read by another, bytes checked."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.worker.kv_transfer.kv_pool import PROBE_SLOTS, KvPool, PoolSegment

BLOCK = 256


def block(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def test_a_block_written_by_one_worker_is_read_back_exactly_by_another(tmp_path):
    writer = KvPool(tmp_path / "pool", writer_id=1, block_bytes=BLOCK, num_slots=64)
    reader = KvPool(tmp_path / "pool", writer_id=2, block_bytes=BLOCK, num_slots=64)
    for seq in (5, 69, 1 << 63):
        assert writer.put(seq, block(seq)) is None
    for seq in (5, 69, 1 << 63):
        assert reader.get(seq) == block(seq)
    assert reader.get(6) is None
    reader.close()
    writer.close()
    assert not list((tmp_path / "pool").iterdir())  # clean stops remove their segments


def test_a_full_probe_window_evicts_its_least_recently_written_block(tmp_path):
    segment = PoolSegment.create(tmp_path / "s.kvseg", BLOCK, 16, writer_id=1)
    same_window = [3 + 16 * i for i in range(PROBE_SLOTS)]  # all start probing at slot 3
    for seq in same_window:
        assert segment.write(seq, block(seq)) is None
    segment.write(same_window[0], block(same_window[0]))  # rewriting refreshes it
    assert segment.write(3 + 16 * 99, block(1)) == same_window[1]
    assert segment.read(same_window[1]) is None and segment.read(3 + 16 * 99) == block(1)
    assert all(segment.read(seq) == block(seq) for seq in [same_window[0], *same_window[2:]])


def test_a_torn_or_corrupted_block_is_a_miss_never_wrong_bytes(tmp_path):
    segment = PoolSegment.create(tmp_path / "s.kvseg", BLOCK, 16, writer_id=1)
    segment.write(7, block(7))
    slot = segment._slot_of[7]
    segment._blocks[slot][0] ^= 0xFF  # a byte flipped after the checksum was taken
    assert PoolSegment(tmp_path / "s.kvseg", writable=False).read(7) is None
    segment._blocks[slot][0] ^= 0xFF
    segment._entries[slot][2] = 1  # the writer is rewriting the slot
    assert PoolSegment(tmp_path / "s.kvseg", writable=False).read(7) is None


def test_segments_of_another_shape_or_garbage_are_ignored(tmp_path):
    pool = tmp_path / "pool"
    other = KvPool(pool, writer_id=1, block_bytes=BLOCK * 2, num_slots=16)
    other.put(9, block(9) * 2)
    (pool / "junk.kvseg").write_bytes(b"not a segment")
    mine = KvPool(pool, writer_id=2, block_bytes=BLOCK, num_slots=16)
    assert mine.get(9) is None
    with pytest.raises(PermissionError):
        PoolSegment(other.own.path, writable=False).write(1, block(1))
