"""Block tiers (DESIGN §7): the index's state machine for blocks in transit to a pool, pooled,
and evicted with their metadata kept; its snapshot round trip; and a mock worker's pool writer,
whose events must leave the index holding exactly what its segment dump says."""

from __future__ import annotations

from kvmesh.common.core.prefix_index import EVICTED_METADATA_LIMIT, DumpedBlock, PrefixIndex
from kvmesh.common.core.timing import TimingModel
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.common.wire.kv_events import (
    DEVICE_TIER,
    EVICTED_TIER,
    IN_TRANSIT_TIER,
    POOLED_TIER,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    EventData,
    KvEvent,
    KvEventBatch,
    StoredBlock,
)
from kvmesh.common.wire.worker_key import TierKey
from kvmesh.indexer import snapshot as snapshots
from kvmesh.worker.engine import EngineRequestSpec
from kvmesh.worker.engines.mock.mock_engine import EngineConfig, MockEngine
from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer, KvLayout
from kvmesh.worker.kv_transfer.kv_pool import KvPool
from kvmesh.worker.kv_transfer.pool_writer import PoolWriter

POOL = TierKey(7, 0, POOLED_TIER)  # worker 7's KV pool segment: a stream of its own
PROMPT = list(range(100, 100 + 16 * 6))  # six full blocks of 16
SEQ = sequence_hashes(local_block_hashes(PROMPT, 16))
LOCAL = local_block_hashes(PROMPT, 16)


class Recorder:
    """Numbers events like :class:`KvEventPublisher` and keeps them instead of publishing."""

    def __init__(self, tier: str = POOLED_TIER) -> None:
        self.tier = tier
        self.events: list[KvEvent] = []

    @property
    def last_event_id(self) -> int:
        return len(self.events) - 1

    def enqueue(self, events: list[EventData], tier: str | None = None) -> None:
        for data in events:
            self.events.append(KvEvent(len(self.events), data, tier or self.tier))

    def apply_to(self, index: PrefixIndex, key=POOL, start: int = 0) -> None:
        index.apply_batch(KvEventBatch(key[0], key[1], 0.0, tuple(self.events[start:]), stream_tier(key)))


def stream_tier(key) -> str:
    return key.tier if isinstance(key, TierKey) else DEVICE_TIER


def stored(first: int, count: int) -> BlocksStored:
    """Blocks ``first``.. of PROMPT, named by their sequence hash (as the mock engine does)."""
    parent = SEQ[first - 1] if first else None
    return BlocksStored(parent, tuple(StoredBlock(SEQ[i], LOCAL[i], 16) for i in range(first, first + count)))


def apply(index: PrefixIndex, *events: tuple[str, EventData], key=POOL) -> None:
    start = index.last_event_id(key) + 1 if key in index.workers() else 0
    batch = tuple(KvEvent(start + i, data, tier) for i, (tier, data) in enumerate(events))
    index.apply_batch(KvEventBatch(key[0], key[1], 0.0, batch, stream_tier(key)))


def test_a_block_in_transit_matches_nothing_until_its_pooled_store_settles_it():
    index = PrefixIndex()
    apply(index, (IN_TRANSIT_TIER, stored(0, 4)))
    assert index.find_matches_by_sequence(SEQ) == {}
    assert [index.tier_of(POOL, h) for h in SEQ[:5]] == [IN_TRANSIT_TIER] * 4 + [None]
    apply(index, (POOLED_TIER, stored(0, 2)))
    assert index.find_matches_by_sequence(SEQ) == {POOL: 2}
    assert [index.tier_of(POOL, h) for h in SEQ[:4]] == [POOLED_TIER] * 2 + [IN_TRANSIT_TIER] * 2
    assert index.tier_counts(POOL) == (2, 0)
    # a copy given up: the block is gone, not evicted (it was never readable)
    apply(index, (IN_TRANSIT_TIER, BlocksRemoved((SEQ[3],))))
    assert index.tier_of(POOL, SEQ[3]) is None and index.tier_counts(POOL) == (1, 0)


def test_a_pooled_block_removed_keeps_its_metadata_as_evicted_and_comes_back_when_stored_again():
    index = PrefixIndex()
    apply(index, (POOLED_TIER, stored(0, 3)), (POOLED_TIER, BlocksRemoved((SEQ[2],))))
    assert index.tier_of(POOL, SEQ[2]) == EVICTED_TIER
    assert index.find_matches_by_sequence(SEQ) == {POOL: 2}
    assert index.tier_counts(POOL) == (0, 1)
    apply(index, (IN_TRANSIT_TIER, stored(2, 1)))  # copied in again...
    assert index.tier_of(POOL, SEQ[2]) == IN_TRANSIT_TIER
    apply(index, (POOLED_TIER, stored(2, 1)))  # ...and readable
    assert index.tier_of(POOL, SEQ[2]) == POOLED_TIER and index.tier_counts(POOL) == (0, 0)
    assert index.find_matches_by_sequence(SEQ) == {POOL: 3}
    apply(index, (POOLED_TIER, AllBlocksCleared()))
    assert [index.tier_of(POOL, h) for h in SEQ[:3]] == [None] * 3


def test_device_removals_forget_blocks_and_a_device_worker_reports_the_device_tier():
    index = PrefixIndex()
    device = (7, 0)
    apply(index, (DEVICE_TIER, stored(0, 2)), (DEVICE_TIER, BlocksRemoved((SEQ[1],))), key=device)
    assert index.tier_of(device, SEQ[0]) == DEVICE_TIER and index.tier_of(device, SEQ[1]) is None
    assert index.tier_of_worker(device) == DEVICE_TIER and index.tier_counts(device) == (0, 0)


def test_evicted_metadata_is_bounded_oldest_first():
    index = PrefixIndex()
    count = EVICTED_METADATA_LIMIT + 3
    blocks = tuple(StoredBlock(i, i, 16) for i in range(count))
    apply(index, (POOLED_TIER, BlocksStored(None, blocks)), (POOLED_TIER, BlocksRemoved(tuple(range(count)))))
    assert index.tier_counts(POOL) == (0, EVICTED_METADATA_LIMIT)
    assert index.tier_of(POOL, 0) is None and index.tier_of(POOL, count - 1) == EVICTED_TIER


def test_tiers_survive_a_snapshot_round_trip():
    index = PrefixIndex()
    apply(
        index,
        (POOLED_TIER, stored(0, 3)),
        (POOLED_TIER, BlocksRemoved((SEQ[2],))),
        (IN_TRANSIT_TIER, stored(2, 2)),
    )
    apply(index, (DEVICE_TIER, stored(0, 1)), key=(7, 0))
    restored = PrefixIndex()
    snapshots.restore(restored, snapshots.decode(snapshots.encode(snapshots.capture(index, 42))))
    for key in ((7, 0), POOL):
        assert restored.tier_of_worker(key) == index.tier_of_worker(key)
        assert restored.tier_counts(key) == index.tier_counts(key)
        assert [restored.tier_of(key, h) for h in SEQ] == [index.tier_of(key, h) for h in SEQ]
    assert restored.tier_of(POOL, SEQ[3]) == IN_TRANSIT_TIER
    # the in-transit blocks settle after the restore as they would have before it
    apply(restored, (POOLED_TIER, stored(2, 2)))
    assert restored.find_matches_by_sequence(SEQ) == {POOL: 4, (7, 0): 1}


def test_a_snapshot_from_before_tiers_were_a_field_restores_the_pool_as_its_tier():
    """Such a snapshot names a pool segment by the reserved dp rank 0xFFFF; it restores as worker 7's
    pooled stream, beside its device cache."""
    import msgpack

    index = PrefixIndex()
    apply(index, (POOLED_TIER, stored(0, 3)))
    apply(index, (DEVICE_TIER, stored(0, 1)), key=(7, 0))
    raw = msgpack.unpackb(snapshots.encode(snapshots.capture(index, 42)))
    for section in ("workers", "tiers"):
        for entry in raw[section]:
            storage = entry.pop("storage")
            if storage == POOLED_TIER:
                entry["dp_rank"] = 0xFFFF
    restored = PrefixIndex()
    snapshots.restore(restored, snapshots.decode(msgpack.packb(raw)))
    assert restored.find_matches_by_sequence(SEQ) == {POOL: 3, (7, 0): 1}
    assert isinstance(next(k for k in restored.workers() if k != (7, 0)), TierKey)


def run_engine_with_pool(tmp_path, num_gpu_blocks: int, pool_slots: int, prompts: list[list[int]]):
    """A mock engine whose blocks a PoolWriter copies into a pool segment, step by step as the
    engine loop does; returns (writer, recorder, stored-in-flight counts seen after each step)."""
    layout = KvLayout()
    engine = MockEngine(
        EngineConfig(num_blocks=num_gpu_blocks, block_size=16, timing=TimingModel(speedup_ratio=1e6)),
        KvBuffer(num_gpu_blocks, layout.block_bytes(16)),
    )
    recorder = Recorder()
    writer = PoolWriter(KvPool(tmp_path / "pool", 7, layout.block_bytes(16), pool_slots), recorder)  # type: ignore[arg-type]
    in_flight = []
    for number, prompt in enumerate(prompts):
        engine.add_request(EngineRequestSpec(f"r{number}", prompt, max_tokens=3))
        while engine.has_work():
            engine.step()
            writer.commit()
            writer.write(engine.drain_events(), engine.cache)
            in_flight.append(writer.in_flight)
    return writer, recorder, in_flight


def test_the_pool_writer_publishes_copies_in_flight_then_pooled_and_its_dump_agrees(tmp_path):
    prompts = [list(range(1000 * n, 1000 * n + 16 * 12 + 5)) for n in range(6)]
    writer, recorder, in_flight = run_engine_with_pool(tmp_path, num_gpu_blocks=40, pool_slots=32, prompts=prompts)
    assert max(in_flight) > 0
    tiers = {e.tier for e in recorder.events}
    assert tiers == {IN_TRANSIT_TIER, POOLED_TIER}
    removed_pooled = [e for e in recorder.events if e.tier == POOLED_TIER and isinstance(e.data, BlocksRemoved)]
    assert removed_pooled  # 72 blocks through 32 slots: the window evicts
    writer.commit()
    index = PrefixIndex()
    recorder.apply_to(index)
    assert index.stats.unknown_parent == 0 and index.stats.unknown_removals == 0
    assert index.tier_counts(POOL)[0] == 0  # nothing left in flight once committed
    assert index.tier_counts(POOL)[1] > 0  # the pushed-out blocks' metadata is kept
    last, blocks = writer.dump()
    assert last == recorder.last_event_id
    assert index.worker_blocks(POOL) == {b.sequence_hash for b in blocks}
    assert all(writer.pool.get(b.sequence_hash) is not None for b in blocks)  # every dumped block is readable
    # gap recovery from the dump rebuilds the same picture
    recovered = PrefixIndex()
    recovered.replace_worker(
        POOL, last, [DumpedBlock(b.block_hash, b.tokens_hash, b.parent_hash, b.sequence_hash) for b in blocks]
    )
    assert recovered.worker_blocks(POOL) == index.worker_blocks(POOL)
    writer.pool.close()
