"""MoE expert metadata on cached blocks: the wire format, the index's alignment counts, snapshots,
and a dense fleet (no metadata) answering exactly as before."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.common.wire.kv_events import (
    BlocksRemoved,
    BlocksStored,
    EventDecodeError,
    KvEvent,
    KvEventBatch,
    StoredBlock,
    decode_batch,
    encode_batch,
    parse_moe_placements,
)
from kvmesh.indexer import snapshot
from kvmesh.worker.engines.mock.block_manager import BlockManager

MOE = ((0, 3, 0), (1, 7, 1))
W1, W2 = (1, 0), (2, 0)


def stored(worker: int, event_id: int, hashes: list[int], moe=(), parent=None) -> KvEventBatch:
    blocks = tuple(StoredBlock(h, h, 16, moe) for h in hashes)
    return KvEventBatch(worker, 0, 0.0, (KvEvent(event_id, BlocksStored(parent, blocks)),))


def test_placements_travel_with_their_blocks_and_dense_blocks_are_encoded_as_before():
    batch = stored(1, 0, [11, 12], MOE)
    assert decode_batch(encode_batch(batch)) == batch
    dense = stored(1, 0, [11])
    assert "moe" not in msgpack.unpackb(encode_batch(dense))["events"][0]["data"]["blocks"][0]
    assert decode_batch(encode_batch(dense)) == dense
    raw = msgpack.unpackb(encode_batch(batch))
    raw["events"][0]["data"]["blocks"][0]["moe"] = [[0, -3, 0]]
    with pytest.raises(EventDecodeError):
        decode_batch(msgpack.packb(raw))


def test_the_flag_reads_layer_expert_and_optional_group():
    assert parse_moe_placements("0:3, 1:7:1") == ((0, 3, 0), (1, 7, 1))
    assert parse_moe_placements("") == ()
    with pytest.raises(ValueError, match="layer:expert"):
        parse_moe_placements("0-3")


def test_alignment_counts_matched_blocks_and_hosted_experts_and_forgets_removed_blocks():
    index = PrefixIndex()
    index.apply_batch(stored(1, 0, [11, 12, 13], MOE))
    index.apply_batch(stored(2, 0, [11, 12]))  # a dense worker
    query = sequence_hashes([11, 12, 13])
    matched = index.find_matches_by_sequence(query)
    assert index.moe_alignment(query, matched, {(0, 3), (5, 5)}) == {W1: (3, 1)}
    assert index.moe_alignment(query, matched, {(0, 3), (1, 7)}) == {W1: (3, 2)}
    assert index.moe_alignment(query, matched, {(9, 9)}) == {}
    assert index.moe_alignment(sequence_hashes([99]), {}, {(0, 3)}) == {W1: (0, 1)}  # hosted, nothing matched
    index.apply_batch(KvEventBatch(1, 0, 0.0, (KvEvent(1, BlocksRemoved((13, 12, 11))),)))
    assert index.moe_alignment(query, index.find_matches_by_sequence(query), {(0, 3)}) == {}


def test_a_dense_fleet_answers_as_if_no_query_was_made():
    index = PrefixIndex()
    index.apply_batch(stored(1, 0, [11, 12]))
    query = sequence_hashes([11, 12])
    assert index.moe_alignment(query, index.find_matches_by_sequence(query), {(0, 3)}) == {}


def test_snapshots_keep_the_metadata():
    index = PrefixIndex()
    index.apply_batch(stored(1, 0, [11, 12], MOE))
    index.apply_batch(stored(2, 0, [21]))
    restored = PrefixIndex()
    snapshot.restore(restored, snapshot.decode(snapshot.encode(snapshot.capture(index, 5))))
    query = sequence_hashes([11, 12])
    matched = restored.find_matches_by_sequence(query)
    assert restored.moe_alignment(query, matched, {(1, 7)}) == {W1: (2, 1)}
    assert restored.export_moe(W2) == {}


def test_the_mock_engines_blocks_carry_the_workers_experts():
    manager = BlockManager(8, 4, MOE)
    blocks = manager.allocate(2)
    manager.register(blocks, [101, 102], [201, 202], None)
    events = manager.drain_events()
    assert all(block.moe == MOE for event in events for block in event.blocks)
