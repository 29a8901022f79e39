"""How many indexer and router replicas does a fleet need? The figures docs/sizing.md is built from:

- ``indexer-stream``: blocks/s one indexer replica applies from the KV event stream replicated three
  times on a three-node NATS cluster (the stream preloaded, so the replica runs flat out), in large
  packed batches: the best case;
- ``worker-shaped``: the same, with events shaped as workers publish them: per worker, one message
  each 5 ms flush window holding a prefill chunk's stored blocks, decode steps' single-block
  stores and the evictions' removals (about 3,100 block events/s a worker, the model below), for 64
  and 256 workers; and the three NATS servers' CPU per event while the stream was written and read;
- ``find-matches``: FindMatches time (p50/p99, 64-block queries) and memory per indexed block with
  1M and 10M blocks over 64 workers, in process;
- ``router``: requests/s one router replica serves and the CPU it uses for them (mock workers);
- ``replay``: ``kvmesh replay`` with 256 workers on a synthetic trace of a million requests shaped like
  the shared Mooncake trace (``--replay-requests``): wall time and peak memory.

    python -m bench.sizing [--parts indexer-stream find-matches router replay] [--replay-requests 1000000]
    python -m bench.sizing --smoke    # every part at a small size (CI): the figures mean nothing
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.indexer_bench import CHAIN_BLOCKS, NAMESPACE, QUERY_BLOCKS, apply_flat_out, jetstream_apply, percentile
from bench.router_bench import throughput
from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.wire import names
from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.common.wire.kv_events import BlocksRemoved, BlocksStored, KvEvent, KvEventBatch, StoredBlock, encode_batch

SHARED_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
PARTS = ("indexer-stream", "worker-shaped", "find-matches", "router", "replay")
# A busy worker in the sizing model: 20,000 prefill + 5,000 decode tokens/s, 16-token blocks, each
# block stored once and evicted once. Per 5 ms flush window: a prefill chunk of ~6 blocks, a decode
# block now and then, and ~7.8 blocks removed.
WINDOW_S = 0.005
PREFILL_BLOCKS_PER_WINDOW = 20_000 / 16 * WINDOW_S
DECODE_BLOCKS_PER_WINDOW = 5_000 / 16 * WINDOW_S
BLOCK_EVENTS_PER_WORKER_S = 2 * (PREFILL_BLOCKS_PER_WINDOW + DECODE_BLOCKS_PER_WINDOW) / WINDOW_S  # stored + removed
# Token ids are 32-bit and a hash id stands for 512 of them: hash ids stay below 2**32 / 512.
MAX_HASH_ID = 2**32 // 512 - 1


def worker_shaped_batches(workers: int, seconds: float, seed: int = 0) -> tuple[list[KvEventBatch], int]:
    """Each worker's flush windows over ``seconds``: (batches in publish order, block events)."""
    rng = random.Random(seed)
    windows = round(seconds / WINDOW_S)
    batches: list[KvEventBatch] = []
    block_events = 0
    held: list[list[int]] = [[] for _ in range(workers)]  # each worker's cached blocks, oldest first
    next_event = [0] * workers
    chain_tail: list[int | None] = [None] * workers
    for _ in range(windows):
        for worker in range(workers):
            events: list[KvEvent] = []
            # a prefill chunk: a run of blocks extending the current prompt (a new prompt now and then)
            count = int(PREFILL_BLOCKS_PER_WINDOW) + (rng.random() < PREFILL_BLOCKS_PER_WINDOW % 1)
            if rng.random() < 0.1:
                chain_tail[worker] = None
            stored = [rng.getrandbits(63) for _ in range(count)]
            if stored:
                blocks = tuple(StoredBlock(h, h ^ 0x5555, 16) for h in stored)
                events.append(KvEvent(next_event[worker], BlocksStored(chain_tail[worker], blocks)))
                next_event[worker] += 1
                chain_tail[worker] = stored[-1]
            # decode: a sequence fills a block and stores it alone
            decode = int(DECODE_BLOCKS_PER_WINDOW) + (rng.random() < DECODE_BLOCKS_PER_WINDOW % 1)
            for _ in range(decode):
                h = rng.getrandbits(63)
                events.append(KvEvent(next_event[worker], BlocksStored(chain_tail[worker], (StoredBlock(h, h, 16),))))
                next_event[worker] += 1
                stored.append(h)
            held[worker].extend(stored)
            # eviction at steady state: as many blocks leave as came, the oldest first
            if len(held[worker]) > 4 * len(stored):
                gone, held[worker] = held[worker][: len(stored)], held[worker][len(stored) :]
                events.append(KvEvent(next_event[worker], BlocksRemoved(tuple(gone))))
                next_event[worker] += 1
                block_events += len(gone)
            block_events += len(stored)
            if events:
                batches.append(KvEventBatch(worker, 0, 0.0, tuple(events)))
    return batches, block_events


async def worker_shaped_apply(workers: int, seconds: float) -> dict[str, float]:
    """One indexer replica applying worker-shaped messages flat out from a 3-replica stream on three
    NATS servers, and the servers' CPU seconds per block event written and read."""
    batches, block_events = worker_shaped_batches(workers, seconds)
    messages = [
        (
            names.kv_events_subject(NAMESPACE, b.worker_id),
            encode_batch(b),
            names.kv_event_msg_id(b.worker_id, 0, b.first_event_id),
        )
        for b in batches
    ]
    run = await apply_flat_out(messages, nats_servers=3)
    elapsed = run["seconds"]
    return {
        "workers": workers,
        "messages": len(messages),
        "block_events": block_events,
        "events_per_message": block_events / len(messages),
        "block_events_per_s": block_events / elapsed,
        "messages_per_s": len(messages) / elapsed,
        "nats_cpu_us_per_event_written": run["nats_cpu_written_s"] / block_events * 1e6,
        "nats_cpu_us_per_event_read": run["nats_cpu_read_s"] / block_events * 1e6,
        "worker_equivalents": block_events / elapsed / BLOCK_EVENTS_PER_WORKER_S,
    }


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def find_matches_at(total_blocks: int, workers: int = 64, seed: int = 0) -> dict[str, float]:
    """Build an index of ``total_blocks`` (chains of 128 blocks, the first half shared in families,
    as indexer_bench's workload) batch by batch, so the workload itself is never held whole."""
    rng = random.Random(seed)
    chains = total_blocks // CHAIN_BLOCKS
    families = max(1, chains // 4)
    family_prefix = [[rng.getrandbits(64) for _ in range(CHAIN_BLOCKS // 2)] for _ in range(min(families, 20_000))]
    queries: list[list[int]] = []
    gc.collect()
    before = rss_bytes()
    index = PrefixIndex()
    gc.disable()
    started = time.perf_counter()
    for chain in range(chains):
        local = family_prefix[rng.randrange(len(family_prefix))] + [
            rng.getrandbits(64) for _ in range(CHAIN_BLOCKS // 2)
        ]
        blocks = tuple(StoredBlock(rng.getrandbits(64), t, 64) for t in local)
        # each worker's events are numbered 0, 1, 2, ... (a gap would hold them back)
        event = KvEvent(chain // workers, BlocksStored(None, blocks))
        index.apply_batch(KvEventBatch(chain % workers, 0, 0.0, (event,)))
        if len(queries) < 2000 and rng.random() < 0.01:
            queries.append(local[:QUERY_BLOCKS])
    build_s = time.perf_counter() - started
    gc.enable()
    gc.collect()
    memory = rss_bytes() - before
    assert not index.gaps_pending, "the workload must have no gaps"
    sequences = [sequence_hashes(q) for q in queries]
    matched = sum(max(index.find_matches_by_sequence(q).values(), default=0) for q in sequences) / len(sequences)
    samples = []
    for _ in range(3):
        for query in sequences:
            t0 = time.perf_counter_ns()
            index.find_matches_by_sequence(query)
            samples.append((time.perf_counter_ns() - t0) / 1000)
    return {
        "blocks": chains * CHAIN_BLOCKS,
        "workers": workers,
        "build_blocks_per_s": chains * CHAIN_BLOCKS / build_s,
        "find_p50_us": percentile(samples, 50),
        "find_p99_us": percentile(samples, 99),
        "bytes_per_block": memory / (chains * CHAIN_BLOCKS),
        "index_gib": memory / 2**30,
        "mean_matched_blocks": matched,
    }


def synthetic_trace(source: Path, requests: int, parallel: int, out: Path, seed: int = 0) -> dict[str, float]:
    """A trace of ``requests`` requests shaped like ``source``: copies of it, ``parallel`` of them at
    a time (each shifted by a random fraction of a second), one group after the other. Each copy has
    hash ids of its own (prefixes are shared within a copy exactly as in the source, never across),
    until the 32-bit token space runs out, after which copies reuse the ids of copies long past."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    span = max(max(r["hash_ids"], default=0) for r in rows) + 1
    duration = max(r["timestamp"] for r in rows) + 1
    distinct_copies = MAX_HASH_ID // span
    rng = random.Random(seed)
    written = 0
    lines = []
    copy = 0
    while written < requests:
        group = copy // parallel
        start = group * duration + rng.uniform(0, 1000)
        offset = (copy % distinct_copies) * span
        for row in rows:
            if written >= requests:
                break
            shifted = {
                "timestamp": int(start + row["timestamp"]),
                "input_length": row["input_length"],
                "output_length": row["output_length"],
                "hash_ids": [h + offset for h in row["hash_ids"]],
            }
            lines.append(shifted)
            written += 1
        copy += 1
    lines.sort(key=lambda r: r["timestamp"])
    with out.open("w") as file:
        for row in lines:
            file.write(json.dumps(row) + "\n")
    last = lines[-1]["timestamp"] / 1000
    return {"requests": written, "copies": copy, "seconds": last, "rate": written / max(last, 1e-9)}


def replay(requests: int, workers: int) -> dict[str, float]:
    """``kvmesh replay`` on the synthetic trace, as a child process: its wall time and peak RSS."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-sizing-") as folder:
        trace = Path(folder) / "trace.jsonl"
        shape = synthetic_trace(SHARED_TRACE, requests, parallel=max(1, workers // 8), out=trace)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        started = time.perf_counter()
        result = subprocess.run(
            [
                *(sys.executable, "-m", "kvmesh", "replay", str(trace), "--workers", str(workers)),
                *("--router-mode", "kv", "--no-reuse-bounds"),  # the routing, not the bounds' pass
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        wall = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    return {
        **{f"trace_{k}": v for k, v in shape.items()},
        "workers": workers,
        "wall_s": wall,
        "requests_per_wall_s": shape["requests"] / wall,
        "peak_rss_gib": max(peak, before) / 2**20,
        "prefix_reuse": summary.get("prefix_reuse_ratio", summary.get("prefix_reuse")),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--replay-requests", type=int, default=1_000_000)
    parser.add_argument("--replay-workers", type=int, default=256)
    parser.add_argument("--router-seconds", type=float, default=10.0)
    parser.add_argument(
        "--shaped-seconds",
        type=float,
        default=10.0,
        help="worker-shaped: seconds of 64 workers' events (256: a quarter)",
    )
    parser.add_argument("--smoke", action="store_true", help="every part at a small size (CI): figures mean nothing")
    args = parser.parse_args(argv)
    scale = 0.01 if args.smoke else 1.0
    if args.smoke:
        args.replay_requests, args.replay_workers = 2_000, 8
        args.router_seconds, args.shaped_seconds = 1.0, 0.2
    if "indexer-stream" in args.parts:
        for servers in (1, 3):
            r = asyncio.run(jetstream_apply(int(1_000_000 * scale), 64, nats_servers=servers))
            print(
                f"indexer replica from the KV event stream ({servers} NATS server(s), {min(servers, 3)} replica(s)): "
                f"{r['blocks_per_s']:,.0f} blocks/s ({r['messages_per_s']:,.0f} messages/s), {r['blocks']:,} blocks",
                flush=True,
            )
    if "worker-shaped" in args.parts:
        for workers in (64, 256):
            r = asyncio.run(worker_shaped_apply(workers, args.shaped_seconds * 64 / workers))
            print(
                f"indexer replica, worker-shaped events, {workers} workers (3 NATS servers, 3 replicas): "
                f"{r['block_events_per_s']:,.0f} block events/s ({r['messages_per_s']:,.0f} messages/s of "
                f"{r['events_per_message']:.1f} block events): {r['worker_equivalents']:.0f} busy workers; "
                f"NATS CPU (3 servers) {r['nats_cpu_us_per_event_written']:.1f} µs per block event written, "
                f"{r['nats_cpu_us_per_event_read']:.1f} µs read",
                flush=True,
            )
    if "find-matches" in args.parts:
        for total in (1_000_000, 10_000_000):
            r = find_matches_at(int(total * scale))
            print(
                f"FindMatches at {r['blocks']:,} blocks, {r['workers']} workers: p50 {r['find_p50_us']:.1f} µs, "
                f"p99 {r['find_p99_us']:.1f} µs; {r['bytes_per_block']:.0f} bytes/block ({r['index_gib']:.2f} GiB); "
                f"built at {r['build_blocks_per_s']:,.0f} blocks/s; "
                f"a query matched {r['mean_matched_blocks']:.0f} blocks",
                flush=True,
            )
    if "router" in args.parts:
        r = asyncio.run(throughput(args.router_seconds, 32))
        print(
            f"one router replica: {r['requests_per_s']:,.0f} requests/s using {r['router_cpu_cores']:.2f} cores "
            f"({r['requests_per_s'] / max(r['router_cpu_cores'], 1e-9):,.0f} requests/s per core); its indexer "
            f"replica answered them using {r['indexer_cpu_cores']:.2f} cores "
            f"({r['requests_per_s'] / max(r['indexer_cpu_cores'], 1e-9):,.0f} queries/s per core), "
            f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms (mock workers on the same 2 cores)",
            flush=True,
        )
    if "replay" in args.parts:
        r = replay(args.replay_requests, args.replay_workers)
        print(
            f"kvmesh replay, {r['workers']} workers, {r['trace_requests']:,} requests ({r['trace_copies']} copies of "
            f"the shared trace, {r['trace_rate']:.0f} requests/s over {r['trace_seconds']:,.0f} s): "
            f"{r['wall_s']:,.0f} s wall ({r['requests_per_wall_s']:,.0f} requests/s), "
            f"peak {r['peak_rss_gib']:.2f} GiB, "
            f"prefix reuse {r['prefix_reuse']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
