"""Indexer figures: apply throughput, FindMatches latency, snapshot/restore, memory per block.

In process (the sans-I/O PrefixIndex) and end to end (JetStream → replica, and over gRPC), at 100k
and 1M indexed blocks spread over 8 and 64 workers, with 64-block queries. Prints figures; not a test.

    python -m bench.indexer_bench                 # everything
    python -m bench.indexer_bench --only inproc   # the in-process part
    python -m bench.indexer_bench --smoke         # every part at a hundredth the blocks (CI; figures mean nothing)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass

import grpc

from bench.processes import cpu_seconds
from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.kv_event_stream import ensure_kv_events_stream
from kvmesh.common.runtime.nats_cluster import EmbeddedNatsCluster
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.wire import names
from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.common.wire.kv_events import BlocksStored, KvEvent, KvEventBatch, StoredBlock, encode_batch
from kvmesh.indexer import snapshot as snapshots
from kvmesh.indexer.consumer import EventStreamConsumer

NAMESPACE = "bench"
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


def to_messages(workload: Workload, events_per_message: int = 16) -> list[tuple[str, bytes, str]]:
    """(subject, payload, Nats-Msg-Id) messages, as workers would publish the workload."""
    messages = []
    for batch in workload.batches:
        for start in range(0, len(batch.events), events_per_message):
            chunk = KvEventBatch(batch.worker_id, 0, 0.0, batch.events[start : start + events_per_message])
            messages.append(
                (
                    names.kv_events_subject(NAMESPACE, batch.worker_id),
                    encode_batch(chunk),
                    names.kv_event_msg_id(batch.worker_id, 0, chunk.first_event_id),
                )
            )
    return messages


async def preload(js, messages: list[tuple[str, bytes, str]]) -> None:
    """Publish concurrently in windows (a publish waits for its ack; one at a time would be slow)."""
    await ensure_kv_events_stream(js)
    for start in range(0, len(messages), 256):
        await asyncio.gather(
            *(
                js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})
                for subject, payload, msg_id in messages[start : start + 256]
            )
        )


async def apply_flat_out(messages: list[tuple[str, bytes, str]], nats_servers: int) -> dict[str, float]:
    """Preload ``messages`` into the stream on a NATS cluster of ``nats_servers`` (3: the stream has
    three replicas), then let one replica apply them flat out (decode + apply + ack): the seconds it
    took, and the servers' CPU seconds while the stream was written and while it was read."""
    server = await EmbeddedNatsCluster(nats_servers).start()
    try:
        pids = [node.pid for node in server.nodes if node.pid is not None]
        nc = await connect_nats(server.url, name="kvmesh-bench")
        js = nc.jetstream()
        cpu_before = cpu_seconds(pids)
        await preload(js, messages)
        written = cpu_seconds(pids) - cpu_before
        last = (await js.stream_info(names.KV_EVENTS_STREAM)).state.last_seq
        consumer = EventStreamConsumer(nc, NAMESPACE, "bench", PrefixIndex())
        cpu_before = cpu_seconds(pids)
        started = time.perf_counter()
        await consumer.start()
        while consumer.applied_sequence < last:
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        read = cpu_seconds(pids) - cpu_before
        await consumer.stop()
        await nc.close()
        return {"seconds": elapsed, "nats_cpu_written_s": written, "nats_cpu_read_s": read}
    finally:
        server.stop()


async def jetstream_apply(total_blocks: int, workers: int, nats_servers: int = 1) -> dict[str, float]:
    """Blocks/s one replica applies from the stream (decode + apply + ack), stream preloaded; on a
    NATS cluster of ``nats_servers`` (3: the stream has three replicas)."""
    workload = make_workload(total_blocks, workers, seed=1)
    messages = to_messages(workload)
    elapsed = (await apply_flat_out(messages, nats_servers))["seconds"]
    return {
        "blocks": workload.blocks,
        "messages": len(messages),
        "blocks_per_s": workload.blocks / elapsed,
        "messages_per_s": len(messages) / elapsed,
    }


async def grpc_queries(total_blocks: int, workers: int) -> dict[str, float]:
    """FindMatches p50 / p99 over gRPC against an indexer process fed from JetStream."""
    workload = make_workload(total_blocks, workers, seed=2)
    server = await EmbeddedNatsServer().start()
    process = None
    try:
        nc = await connect_nats(server.url, name="kvmesh-bench")
        js = nc.jetstream()
        await preload(js, to_messages(workload))
        last = (await js.stream_info(names.KV_EVENTS_STREAM)).state.last_seq
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh.indexer",
                "--nats-url",
                server.url,
                "--namespace",
                NAMESPACE,
                "--log-level",
                "warning",
                "--metrics-port",
                "-1",
            ]
        )
        watcher = DiscoveryWatcher(js, NAMESPACE, "indexer")
        await watcher.start()
        while not watcher.instances():
            await asyncio.sleep(0.05)
        address = watcher.instances()[0].address
        await watcher.stop()
        async with grpc.aio.insecure_channel(address) as channel:
            stub = indexer_pb2_grpc.IndexerStub(channel)
            while (await stub.GetStatus(indexer_pb2.IndexerStatusRequest())).applied_sequence < last:
                await asyncio.sleep(0.05)
            samples = []
            for _ in range(3):
                for query in workload.query_sequences:
                    started = time.perf_counter_ns()
                    await stub.FindMatches(indexer_pb2.FindMatchesRequest(sequence_hashes=query))
                    samples.append((time.perf_counter_ns() - started) / 1000)
        await nc.close()
        return {"p50_us": percentile(samples, 50), "p99_us": percentile(samples, 99)}
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
        server.stop()


async def snapshot_figures(total_blocks: int, workers: int) -> dict[str, float]:
    """Capture + encode, upload, download, decode + restore of a snapshot of ``total_blocks``."""
    workload = make_workload(total_blocks, workers, seed=3)
    index = PrefixIndex()
    for batch in workload.batches:
        index.apply_batch(batch)
    started = time.perf_counter()
    payload = snapshots.encode(snapshots.capture(index, 1))
    encode_s = time.perf_counter() - started
    server = await EmbeddedNatsServer().start()
    try:
        nc = await connect_nats(server.url, name="kvmesh-bench")
        js = nc.jetstream()
        started = time.perf_counter()
        await snapshots.upload(js, NAMESPACE, snapshots.decode(payload))
        upload_s = time.perf_counter() - started
        started = time.perf_counter()
        loaded = await snapshots.load(js, NAMESPACE)
        download_decode_s = time.perf_counter() - started
        restored = PrefixIndex()
        started = time.perf_counter()
        snapshots.restore(restored, loaded)
        restore_s = time.perf_counter() - started
        await nc.close()
    finally:
        server.stop()
    assert restored.num_blocks == index.num_blocks
    return {
        "blocks": workload.blocks,
        "bytes": len(payload),
        "capture_encode_s": encode_s,
        "upload_s": upload_s,
        "download_decode_s": download_decode_s,
        "restore_s": restore_s,
        "restore_total_s": download_decode_s + restore_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("inproc", "snapshot", "jetstream", "grpc"), default=None)
    parser.add_argument("--smoke", action="store_true", help="a hundredth the blocks (CI): the figures mean nothing")
    args = parser.parse_args()

    def n(total: int) -> int:
        return max(20_000, total // 100) if args.smoke else total  # at least 2 chains a worker at 64

    if args.only in (None, "inproc"):
        print(
            f"{'in process':<28}{'blocks':>10}{'apply blk/s':>14}{'p50 µs':>9}{'p99 µs':>9}{'p50 µs':>9}{'p99 µs':>9}"
        )
        print(f"{'':<28}{'':>10}{'':>14}{'(by sequence hash)':>18}{'(by local hash)':>18}")
        for total in (n(100_000), n(1_000_000)):
            for workers in (8, 64):
                r = in_process(total, workers)
                print(
                    f"{f'{workers} workers':<28}{r['blocks']:>10}{r['apply_blocks_per_s']:>14,.0f}"
                    f"{r['find_p50_us_by_sequence']:>9.1f}{r['find_p99_us_by_sequence']:>9.1f}"
                    f"{r['find_p50_us_by_local']:>9.1f}{r['find_p99_us_by_local']:>9.1f}"
                )
        print(f"memory per indexed block (1M blocks, 8 workers): {memory_per_block(n(1_000_000), 8):.0f} bytes")
    if args.only in (None, "jetstream"):
        for total, workers in ((n(100_000), 8), (n(1_000_000), 8)):
            r = asyncio.run(jetstream_apply(total, workers))
            print(
                f"JetStream → replica, {r['blocks']} blocks in {r['messages']} messages: "
                f"{r['blocks_per_s']:,.0f} blocks/s ({r['messages_per_s']:,.0f} messages/s)"
            )
    if args.only in (None, "grpc"):
        for total in (n(100_000), n(1_000_000)):
            for workers in (8, 64):
                r = asyncio.run(grpc_queries(total, workers))
                print(
                    f"FindMatches over gRPC, {total} blocks, {workers} workers: p50 {r['p50_us']:.0f} µs, "
                    f"p99 {r['p99_us']:.0f} µs"
                )
    if args.only in (None, "snapshot"):
        r = asyncio.run(snapshot_figures(n(1_000_000), 8))
        print(
            f"snapshot of {r['blocks']} blocks: {r['bytes'] / 1e6:.1f} MB; "
            f"capture+encode {r['capture_encode_s']:.2f} s, "
            f"upload {r['upload_s']:.2f} s; download+decode {r['download_decode_s']:.2f} s, "
            f"restore {r['restore_s']:.2f} s (restore total {r['restore_total_s']:.2f} s)"
        )


if __name__ == "__main__":
    main()
