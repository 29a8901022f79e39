"""Indexer figures: apply throughput, FindMatches latency, snapshot/restore, memory per block.

In process (the sans-I/O PrefixIndex) and end to end (JetStream → replica, and over gRPC), at 100k
and 1M indexed blocks spread over 8 and 64 workers, with 64-block queries. Prints figures; not a test.

    python -m bench.indexer_bench                 # everything
    python -m bench.indexer_bench --only inproc   # the in-process part
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from dataclasses import dataclass

from services.common.hashing import sequence_hashes
from services.common.kv_events import BlocksStored, KvEvent, KvEventBatch, StoredBlock
from services.common.prefix_index import PrefixIndex

CHAIN_BLOCKS = 128  # one cached "conversation": 128 blocks, the first half shared within its family
QUERY_BLOCKS = 64


@dataclass
class Workload:
    batches: list[KvEventBatch]
    queries: list[list[int]]  # local hashes
    query_sequences: list[list[int]]
    blocks: int


def make_workload(total_blocks: int, workers: int, seed: int = 0) -> Workload:
    """Chains of 128 blocks; chains of one family share their first 64 blocks; families spread over workers."""
    rng = random.Random(seed)
    chains_per_worker = total_blocks // workers // CHAIN_BLOCKS
    families = max(1, chains_per_worker * workers // 4)
    family_prefix = [[rng.getrandbits(64) for _ in range(CHAIN_BLOCKS // 2)] for _ in range(families)]
    batches: list[KvEventBatch] = []
    queries: list[list[int]] = []
    for worker in range(workers):
        events = []
        for chain in range(chains_per_worker):
            local = family_prefix[rng.randrange(families)] + [rng.getrandbits(64) for _ in range(CHAIN_BLOCKS // 2)]
            engine_ids = [rng.getrandbits(64) for _ in local]
            blocks = tuple(StoredBlock(e, t, 64) for e, t in zip(engine_ids, local, strict=True))
            events.append(KvEvent(chain, BlocksStored(None, blocks)))
            if len(queries) < 2000 and rng.random() < 0.5:
                queries.append(local[:QUERY_BLOCKS])
        for start in range(0, len(events), 64):
            batches.append(KvEventBatch(worker, 0, 0.0, tuple(events[start : start + 64])))
    stored = workers * chains_per_worker * CHAIN_BLOCKS
    return Workload(batches, queries, [sequence_hashes(q) for q in queries], stored)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def time_queries(call, queries: list[list[int]], repeat: int = 3) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        for query in queries:
            started = time.perf_counter_ns()
            call(query)
            samples.append((time.perf_counter_ns() - started) / 1000)
    return percentile(samples, 50), percentile(samples, 99)


def in_process(total_blocks: int, workers: int) -> dict[str, float]:
    workload = make_workload(total_blocks, workers)
    index = PrefixIndex()
    gc.collect()
    gc.disable()  # measure the index, not the collector walking millions of fresh objects
    started = time.perf_counter()
    for batch in workload.batches:
        index.apply_batch(batch)
    apply_s = time.perf_counter() - started
    gc.enable()
    seq_p50, seq_p99 = time_queries(index.find_matches_by_sequence, workload.query_sequences)
    local_p50, local_p99 = time_queries(index.find_matches, workload.queries)
    return {
        "blocks": workload.blocks,
        "apply_blocks_per_s": workload.blocks / apply_s,
        "find_p50_us_by_sequence": seq_p50,
        "find_p99_us_by_sequence": seq_p99,
        "find_p50_us_by_local": local_p50,
        "find_p99_us_by_local": local_p99,
        "mean_matched": statistics.fmean(
            max(index.find_matches_by_sequence(q).values(), default=0) for q in workload.query_sequences[:200]
        ),
    }


def memory_per_block(total_blocks: int, workers: int) -> float:
    workload = make_workload(total_blocks, workers)
    gc.collect()
    tracemalloc.start()
    index = PrefixIndex()
    for batch in workload.batches:
        index.apply_batch(batch)
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return current / workload.blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("inproc", "snapshot", "jetstream", "grpc"), default=None)
    args = parser.parse_args()
    if args.only in (None, "inproc"):
        print(
            f"{'in process':<28}{'blocks':>10}{'apply blk/s':>14}{'p50 µs':>9}{'p99 µs':>9}{'p50 µs':>9}{'p99 µs':>9}"
        )
        print(f"{'':<28}{'':>10}{'':>14}{'(by sequence hash)':>18}{'(by local hash)':>18}")
        for total in (100_000, 1_000_000):
            for workers in (8, 64):
                r = in_process(total, workers)
                print(
                    f"{f'{workers} workers':<28}{r['blocks']:>10}{r['apply_blocks_per_s']:>14,.0f}"
                    f"{r['find_p50_us_by_sequence']:>9.1f}{r['find_p99_us_by_sequence']:>9.1f}"
                    f"{r['find_p50_us_by_local']:>9.1f}{r['find_p99_us_by_local']:>9.1f}"
                )
        print(f"memory per indexed block (1M blocks, 8 workers): {memory_per_block(1_000_000, 8):.0f} bytes")


if __name__ == "__main__":
    main()
