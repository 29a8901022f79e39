import msgpack
import pytest

from kvmesh.common.wire.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    EventDecodeError,
    KvEvent,
    KvEventBatch,
    StoredBlock,
    decode_batch,
    encode_batch,
)
from kvmesh.common.wire.names import kv_event_msg_id, kv_events_subject


def sample_batch() -> KvEventBatch:
    return KvEventBatch(
        worker_id=42,
        dp_rank=1,
        ts=1700000000.5,
        events=(
            KvEvent(7, BlocksStored(None, (StoredBlock(2**64 - 1, 12345, 16), StoredBlock(5, 6, 16)))),
            KvEvent(8, BlocksStored(5, (StoredBlock(9, 10, 16),))),
            KvEvent(9, BlocksRemoved((9, 5)), tier="host"),
            KvEvent(10, AllBlocksCleared()),
        ),
    )


def test_round_trip_preserves_every_field():
    batch = sample_batch()
    assert decode_batch(encode_batch(batch)) == batch
    assert batch.first_event_id == 7


def test_wire_format_is_the_documented_map():
    raw = msgpack.unpackb(encode_batch(sample_batch()))
    assert set(raw) == {"v", "worker_id", "dp_rank", "tier", "ts", "events"}
    assert raw["v"] == 2 and raw["tier"] == "device"
    first = raw["events"][0]
    assert first["event_id"] == 7 and first["tier"] == "device"
    assert first["data"] == {
        "type": "stored",
        "parent_hash": None,
        "blocks": [
            {"block_hash": 2**64 - 1, "tokens_hash": 12345, "num_tokens": 16},
            {"block_hash": 5, "tokens_hash": 6, "num_tokens": 16},
        ],
    }
    assert raw["events"][2]["data"] == {"type": "removed", "block_hashes": [9, 5]}
    assert raw["events"][3]["data"] == {"type": "cleared"}


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"worker_id": 1, "events": [{"event_id": 1, "data": {"type": "exploded"}}]}),
        msgpack.packb({"worker_id": 1, "events": [{"event_id": 1, "data": {"type": "stored"}}]}),
        msgpack.packb({"v": 2, "worker_id": 1, "tier": "attic", "events": []}),  # no such storage tier
        msgpack.packb({"v": 3, "worker_id": 1, "events": []}),  # newer than this reader
    ],
)
def test_malformed_messages_raise_a_decode_error(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_names_follow_the_contract():
    assert kv_events_subject("prod", 17) == "kvmesh.prod.kv.17"
    assert kv_event_msg_id(17, 0, 250) == "17:0:250"


@pytest.mark.parametrize("tier", ["host", "disk", "pooled"])
def test_a_tier_travels_as_a_field_of_its_own_beside_a_real_rank(tier):
    batch = KvEventBatch(3, 2, 1.5, sample_batch().events, tier)
    decoded = decode_batch(encode_batch(batch))
    assert (decoded.worker_id, decoded.dp_rank, decoded.tier) == (3, 2, tier)
    assert decoded.events == batch.events


@pytest.mark.parametrize(("rank", "tier"), [(0xFFFF, "pooled"), (0xFFFE, "host"), (0xFFFD, "disk"), (1, "device")])
def test_a_version_1_batch_is_read_with_its_reserved_rank_as_a_tier_of_rank_0(rank, tier):
    """Batches published before tiers were a field (still in a stream after an upgrade) name a tier
    by a reserved dp rank; they are read as that tier of rank 0."""
    v1 = msgpack.packb({"worker_id": 3, "dp_rank": rank, "ts": 0.0, "events": []})
    decoded = decode_batch(v1)
    assert (decoded.dp_rank, decoded.tier) == ((0 if tier != "device" else rank), tier)
