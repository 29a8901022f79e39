"""Property: under any interleaving of store / remove / clear events, duplicated, reordered or lost
deliveries (with gap recovery from the worker's own dump), the index answers exactly what a naive
model of the workers' real caches answers."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.common.core.prefix_index import DumpedBlock, PrefixIndex
from kvmesh.common.wire.hashing import next_sequence_hash
from kvmesh.common.wire.kv_events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    StoredBlock,
)
from kvmesh.indexer import snapshot as snapshots

WORKERS = (1, 2, 3)
ALPHABET = (11, 22, 33, 44)  # few local hashes, so workers share prefixes often


@dataclass
class TrueWorker:
    """What a worker really caches: engine id -> (local hash, parent engine id, sequence hash)."""

    blocks: dict[int, tuple[int, int | None, int]] = field(default_factory=dict)
    next_engine_id: int = 1
    next_event_id: int = 0
    batches: list[KvEventBatch] = field(default_factory=list)

    def emit(self, worker_id: int, *data) -> None:
        events = tuple(KvEvent(self.next_event_id + i, d) for i, d in enumerate(data))
        self.next_event_id += len(events)
        self.batches.append(KvEventBatch(worker_id, 0, 0.0, events))

    def sequences(self) -> set[int]:
        return {seq for _, _, seq in self.blocks.values()}

    def dump(self) -> list[DumpedBlock]:
        return [DumpedBlock(e, local, parent, seq) for e, (local, parent, seq) in self.blocks.items()]


def naive_matches(truth: dict[int, TrueWorker], locals_: list[int]) -> dict[tuple[int, int], int]:
    result = {}
    for worker_id, worker in truth.items():
        held = worker.sequences()
        depth, parent = 0, None
        for local in locals_:
            seq = local if parent is None else next_sequence_hash(parent, local)
            if seq not in held:
                break
            depth, parent = depth + 1, seq
        if depth:
            result[(worker_id, 0)] = depth
    return result


@st.composite
def histories(draw) -> dict[int, TrueWorker]:
    truth = {w: TrueWorker() for w in WORKERS}
    for _ in range(draw(st.integers(1, 25))):
        worker_id = draw(st.sampled_from(WORKERS))
        worker = truth[worker_id]
        op = draw(st.sampled_from(("store", "store", "store", "remove", "clear", "batch")))
        if op in ("store", "batch"):
            parent = draw(st.sampled_from([None, *worker.blocks])) if worker.blocks else None
            parent_seq = worker.blocks[parent][2] if parent is not None else None
            stored = []
            for local in draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4)):
                seq = local if parent_seq is None else next_sequence_hash(parent_seq, local)
                engine_id = worker.next_engine_id
                worker.next_engine_id += 1
                worker.blocks[engine_id] = (local, parent, seq)
                stored.append(StoredBlock(engine_id, local, 16))
                parent, parent_seq = engine_id, seq
            first_parent = worker.blocks[stored[0].block_hash][1]
            data = [BlocksStored(first_parent, tuple(stored))]
            if op == "batch" and worker.blocks:  # a removal travelling in the same message
                victim = draw(st.sampled_from(sorted(worker.blocks)))
                del worker.blocks[victim]
                data.append(BlocksRemoved((victim,)))
            worker.emit(worker_id, *data)
        elif op == "remove" and worker.blocks:
            victims = draw(st.lists(st.sampled_from(sorted(worker.blocks)), min_size=1, max_size=3, unique=True))
            for v in victims:
                del worker.blocks[v]
            worker.emit(worker_id, BlocksRemoved((*victims, 999_999)))  # plus an unknown id
        elif op == "clear":
            worker.blocks.clear()
            worker.emit(worker_id, AllBlocksCleared())
    return truth


@st.composite
def deliveries(draw, truth: dict[int, TrueWorker]) -> list[KvEventBatch]:
    """Every worker's batches, perturbed; each worker's last batch always arrives (it reveals gaps)."""
    streams = []
    for worker in truth.values():
        batches = list(worker.batches)
        perturbed: list[KvEventBatch] = []
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            fate = "keep" if last else draw(st.sampled_from(("keep", "keep", "keep", "drop", "dup", "swap")))
            if fate == "drop":
                continue
            perturbed.append(batch)
            if fate == "dup":
                perturbed.append(draw(st.sampled_from(perturbed)))
            elif fate == "swap" and len(perturbed) >= 2:
                perturbed[-1], perturbed[-2] = perturbed[-2], perturbed[-1]
        if batches and perturbed[-1] is not batches[-1]:
            perturbed.append(batches[-1])
        streams.append(perturbed)
    # interleave the workers' streams in a random order that keeps each stream's own order
    merged: list[KvEventBatch] = []
    positions = [0] * len(streams)
    while any(p < len(s) for p, s in zip(positions, streams, strict=True)):
        choices = [i for i, s in enumerate(streams) if positions[i] < len(s)]
        pick = draw(st.sampled_from(choices))
        merged.append(streams[pick][positions[pick]])
        positions[pick] += 1
    return merged


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_index_matches_the_naive_model(data):
    truth = data.draw(histories())
    index = PrefixIndex()
    for batch in data.draw(deliveries(truth)):
        index.apply_batch(batch)
        for key in sorted(index.gaps_pending):
            worker = truth[key[0]]  # the worker answers with its state now (ahead of the stream)
            index.replace_worker(key, worker.next_event_id - 1, worker.dump())
    assert not index.gaps_pending
    for worker_id, worker in truth.items():
        assert index.worker_blocks((worker_id, 0)) == worker.sequences()
    queries = [[a] for a in ALPHABET] + [
        data.draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=6)) for _ in range(6)
    ]
    for query in queries:
        assert index.find_matches(query) == naive_matches(truth, query), query
    assert_closure_bookkeeping(index)
    restored = PrefixIndex()  # a snapshot of the index, through its wire format, answers the same
    snapshots.restore(restored, snapshots.decode(snapshots.encode(snapshots.capture(index, 1))))
    assert_closure_bookkeeping(restored)
    for worker_id, worker in truth.items():
        assert restored.worker_blocks((worker_id, 0)) == worker.sequences()
    for query in queries:
        assert restored.find_matches(query) == naive_matches(truth, query), query


def assert_closure_bookkeeping(index: PrefixIndex) -> None:
    """Orphans (held blocks whose parent is not held) are counted exactly: the fast query path
    relies on a worker with none holding whole prefixes only."""
    for key in index.workers():
        worker = index._workers[key]
        held = set(worker.parent_of)
        orphans = sum(1 for parent in worker.parent_of.values() if parent is not None and parent not in held)
        assert worker.orphans == orphans
        assert bool(index._unclosed & worker.bit) == (orphans > 0)
