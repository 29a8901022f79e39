"""Indexer replicas against real NATS, real mock workers and real gRPC: convergence under load,
kill -9 and restart, snapshot + purge + restore, and recovery from lost events."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import (
    common_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire import names
from kvmesh.common.wire.hashing import block_set_digest
from kvmesh.common.wire.kv_events import POOLED_TIER
from kvmesh.devtools.index_truth import as_truth, converged, settle_in_fresh_process, truth, view
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer import snapshot as snapshots
from kvmesh.indexer.config import IndexerConfig
from kvmesh.indexer.snapshot_lock import SnapshotLock
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.event_publisher import KvEventPublisher
from tests.support import running, service_config, service_process, stored_under_lock, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "replicas"
# A small cache so that the load evicts blocks and the event stream carries removals too.
WORKER_ARGS = ["--speedup-ratio", "100", "--block-size", "16", "--num-gpu-blocks-override", "48", "--lease-ttl", "2"]


def worker_config(nats_url: str, *extra: str) -> WorkerConfig:
    return service_config(WorkerConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE, *WORKER_ARGS, *extra])


def indexer_config(nats_url: str, replica: str, *extra: str) -> IndexerConfig:
    return service_config(
        IndexerConfig,
        ["--nats-url", nats_url, "--namespace", NAMESPACE, "--replica-id", replica, "--lease-ttl", "2", *extra],
    )


async def watcher(nc: NatsClient, component: str) -> DiscoveryWatcher:
    w = DiscoveryWatcher(nc.jetstream(), NAMESPACE, component)
    await w.start()
    return w


async def workers_cache_blocks(workers: DiscoveryWatcher) -> bool:
    return any(count for count, _digest in (await truth(workers)).values())


async def load(workers: DiscoveryWatcher, requests: int, concurrency: int = 8, seed: int = 0) -> None:
    """Requests with shared prefixes straight to the workers (no router needed for indexer drills)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(48)] for _ in range(6)]
    queue = list(range(requests))

    async def client() -> None:
        while queue:
            i = queue.pop()
            record = rng.choice(workers.instances())
            prompt = rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
            request = common_pb2.PreprocessedRequest(request_id=f"load-{seed}-{i}", token_ids=prompt)
            request.stop.max_tokens = rng.randrange(1, 20)
            async with grpc.aio.insecure_channel(record.address) as channel:
                # A deadline: a stuck worker fails the drill with its request named, not by the
                # test-wide timeout.
                async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=30):
                    pass

    await asyncio.gather(*(client() for _ in range(concurrency)))


@contextlib.asynccontextmanager
async def two_workers(nats_url: str, nc: NatsClient, publisher_class=KvEventPublisher, *extra: str):
    workers = await watcher(nc, "worker")
    config = worker_config(nats_url, *extra)
    stops = [asyncio.Event(), asyncio.Event()]
    tasks = [asyncio.create_task(worker_server.serve(config, stop, publisher_class=publisher_class)) for stop in stops]
    try:
        await wait_until_async(lambda: len(workers.instances()) == 2, what="two workers registered")
        yield workers
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)
        await workers.stop()


def indexer_process(nats_url: str, replica: str) -> subprocess.Popen[bytes]:
    return service_process("indexer", nats_url, NAMESPACE, "--replica-id", replica, "--lease-ttl", "2")


async def test_two_replicas_converge_exactly_under_load(nats_url: str, nc: NatsClient):
    indexers = await watcher(nc, "indexer")
    async with (
        two_workers(nats_url, nc) as workers,
        running(indexer_server.serve, indexer_config(nats_url, "a")),
        running(indexer_server.serve, indexer_config(nats_url, "b")),
    ):
        await wait_until_async(lambda: len(indexers.instances()) == 2, what="two replicas registered")
        await load(workers, requests=150)
        for record in indexers.instances():
            await wait_until_async(
                lambda r=record: converged(workers, r.address),
                timeout=20,
                what=f"replica {record.extra['replica_id']} converges",
            )
        statuses = [await view(r.address) for r in indexers.instances()]
        assert all(s.gaps == 0 for s in statuses)
        assert as_truth(statuses[0]) == as_truth(statuses[1])
        assert sum(b for b, _ in as_truth(statuses[0]).values()) > 0
        # the same judgement from a process of its own, as the cross-host tests make it
        settled = await settle_in_fresh_process(nats_url, 10, namespace=NAMESPACE)
        assert settled.ok() and sorted(settled) == sorted(r.address for r in indexers.instances())
        assert settled.at is not None
        named = [indexers.instances()[0].address, "127.0.0.1:9"]  # nothing listens on port 9
        settled = await settle_in_fresh_process(nats_url, 0.5, namespace=NAMESPACE, indexers=named, restored=True)
        assert not settled.ok() and settled.at is None
        assert settled[named[0]] == "not restored from a snapshot"
        assert settled[named[1]].startswith("unreachable (UNAVAILABLE"), settled
    await indexers.stop()


async def test_a_replica_killed_mid_stream_converges_after_restart(nats_url: str, nc: NatsClient):
    indexers = await watcher(nc, "indexer")
    async with two_workers(nats_url, nc) as workers:
        process = indexer_process(nats_url, "k")
        try:
            await wait_until_async(lambda: len(indexers.instances()) == 1, what="replica registered")
            background = asyncio.create_task(load(workers, requests=200, concurrency=4, seed=1))
            await wait_until_async(lambda: workers_cache_blocks(workers), what="load running (workers cache blocks)")
            first = indexers.instances()[0]
            await wait_until_async(lambda: _applied_some(first.address), what="replica applied events")
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            await background  # the workers keep going while the replica is dead
            process = indexer_process(nats_url, "k")
            await wait_until_async(
                lambda: any(r.instance_id != first.instance_id for r in indexers.instances()),
                what="restarted replica registered",
            )
            restarted = next(r for r in indexers.instances() if r.instance_id != first.instance_id)
            await wait_until_async(
                lambda: converged(workers, restarted.address), timeout=20, what="restarted replica converges"
            )
        finally:
            process.kill()
            process.wait(timeout=10)
    await indexers.stop()


async def _applied_some(address: str) -> bool:
    try:
        return (await view(address)).applied_sequence > 5
    except grpc.aio.AioRpcError:
        return False


def snapshotting(nats_url: str) -> IndexerConfig:
    """Replica "s", which snapshots and purges once the stream holds 10 of the namespace's events."""
    return indexer_config(nats_url, "s", "--router-snapshot-threshold", "10", "--snapshot-check-interval", "0.2")


async def test_snapshot_purge_and_a_new_replica_restores_it(nats_url: str, nc: NatsClient):
    js = nc.jetstream()
    indexers = await watcher(nc, "indexer")
    async with two_workers(nats_url, nc) as workers, running(indexer_server.serve, snapshotting(nats_url)):
        await load(workers, requests=80)
        probe = SnapshotLock(js, NAMESPACE, "probe")
        stored: snapshots.Snapshot | None = None

        async def snapshot_taken_and_purged() -> bool:
            nonlocal stored
            stored = await stored_under_lock(js, probe, NAMESPACE)
            if stored is None:
                return False
            if (await js.stream_info(names.KV_EVENTS_STREAM)).state.first_seq > 1:
                return True  # the probe still holds the lock: nothing is snapshotted or purged meanwhile
            await probe.release()
            return False

        await wait_until_async(snapshot_taken_and_purged, timeout=20, what="snapshot written and stream purged")
        assert stored is not None
        first_seq = (await js.stream_info(names.KV_EVENTS_STREAM)).state.first_seq
        assert first_seq <= stored.stream_sequence + 1  # nothing the snapshot does not cover was purged
        await probe.release()
        await load(workers, requests=20, seed=2)  # more events after the snapshot

        async with running(indexer_server.serve, indexer_config(nats_url, "fresh")):
            await wait_until_async(lambda: len(indexers.instances()) == 2, what="fresh replica registered")
            fresh = next(r for r in indexers.instances() if r.extra["replica_id"] == "fresh")
            status = await view(fresh.address)
            assert status.snapshot_sequence >= stored.stream_sequence > 0  # it started from the snapshot
            await wait_until_async(
                lambda: converged(workers, fresh.address), timeout=20, what="restored replica converges"
            )
            assert (await view(fresh.address)).gaps == 0
    await indexers.stop()


async def test_a_replica_restores_only_while_no_other_takes_a_snapshot(nats_url: str, nc: NatsClient):
    """A new replica reads the snapshot and makes its durable under the snapshot lock: a replica that
    snapshotted and purged in between would drop events the new one never sees (a CI run lost them)."""
    js = nc.jetstream()
    indexers = await watcher(nc, "indexer")
    async with two_workers(nats_url, nc) as workers, running(indexer_server.serve, snapshotting(nats_url)):
        await load(workers, requests=60)
        drill = SnapshotLock(js, NAMESPACE, "drill")  # as a replica taking a snapshot holds it
        await wait_until_async(
            lambda: stored_under_lock(js, drill, NAMESPACE), timeout=20, what="a snapshot taken, the lock held"
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh.indexer", "--nats-url", nats_url, "--namespace", NAMESPACE,
            "--replica-id", "fresh", "--lease-ttl", "2", "--log-level", "info",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        seen: list[str] = []
        drain: asyncio.Task[bytes] | None = None

        async def logged(event: str) -> None:
            assert process.stdout is not None
            while line := (await process.stdout.readline()).decode():
                seen.append(line)
                if f'"{event}"' in line:
                    return
            raise AssertionError(f"the indexer ended before logging {event!r}:\n" + "".join(seen))

        try:
            await asyncio.wait_for(logged("waiting for the replica taking a snapshot"), 60)
            durable = names.indexer_durable_name(NAMESPACE, "fresh")
            with pytest.raises(nats.js.errors.NotFoundError):  # nothing read, nothing pinned while it waits
                await js.consumer_info(names.KV_EVENTS_STREAM, durable)
            await load(workers, requests=20, seed=2)  # events that no snapshot covers yet
            await drill.release()
            drain = asyncio.create_task(process.stdout.read())  # a full pipe would stall the replica
            await wait_until_async(lambda: len(indexers.instances()) == 2, timeout=30, what="fresh replica up")
            fresh = next(r for r in indexers.instances() if r.extra["replica_id"] == "fresh")
            await wait_until_async(lambda: converged(workers, fresh.address), timeout=30, what="fresh converges")
            assert (await view(fresh.address)).snapshot_sequence > 0  # it did start from the snapshot
        finally:
            await drill.release()
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 30)
            if drain is not None:
                await drain
    await indexers.stop()


class LossyPublisher(KvEventPublisher):
    """Numbers events like the real publisher but loses its 3rd and 7th messages on the way.

    Only mid-stream messages are lost: a loss is detected by the next event of the same worker, so a
    worker's very last message could never be noticed missing (by any design).
    """

    lost = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._messages = 0

    async def _publish(self, batch) -> None:
        self._messages += 1
        if self._messages in (3, 7):
            LossyPublisher.lost += 1
            return
        await super()._publish(batch)


async def test_lost_events_are_detected_and_recovered_exactly(nats_url: str, nc: NatsClient):
    indexers = await watcher(nc, "indexer")
    async with (
        two_workers(nats_url, nc, publisher_class=LossyPublisher) as workers,
        running(indexer_server.serve, indexer_config(nats_url, "g")),
    ):
        await wait_until_async(lambda: len(indexers.instances()) == 1, what="replica registered")
        await load(workers, requests=120)
        address = indexers.instances()[0].address
        await wait_until_async(lambda: converged(workers, address), timeout=20, what="recovered replica converges")
        status = await view(address)
        assert LossyPublisher.lost > 0
        assert status.gaps > 0 and status.recoveries > 0
        assert not any(w.recovering for w in status.workers)
    await indexers.stop()


async def test_a_replica_whose_missed_messages_were_purged_rebuilds_every_worker(nats_url: str, nc: NatsClient):
    """A replica comes back to find the messages it never read gone from the stream (purged, or aged
    out while it was away), and the workers publish nothing after them: no gap in their event ids
    shows the hole, so only a rebuild of every worker from its own dump makes the replica right."""
    js = nc.jetstream()
    indexers = await watcher(nc, "indexer")
    async with two_workers(nats_url, nc) as workers:
        async with running(indexer_server.serve, indexer_config(nats_url, "away")):
            await wait_until_async(lambda: len(indexers.instances()) == 1, what="replica registered")
            await load(workers, requests=40)
            address = indexers.instances()[0].address
            await wait_until_async(lambda: converged(workers, address), timeout=20, what="replica converges")
        await load(workers, requests=40, seed=3)  # events the replica never reads
        await js.purge_stream(names.KV_EVENTS_STREAM)
        async with running(indexer_server.serve, indexer_config(nats_url, "away")):
            await wait_until_async(lambda: len(indexers.instances()) == 1, what="replica back")
            address = indexers.instances()[0].address
            await wait_until_async(lambda: converged(workers, address), timeout=20, what="replica rebuilt")
            assert (await view(address)).recoveries >= 2  # both workers, from their dumps
    await indexers.stop()


async def pool_converged(workers: DiscoveryWatcher, address: str) -> bool:
    """Whether the replica holds exactly each worker's pool segment (its dump of tier ``pooled``)."""
    try:
        status = await view(address)
        held = {w.worker_id: (w.blocks, w.blocks_digest) for w in status.workers if w.tier == POOLED_TIER}
        for record in workers.instances():
            async with grpc.aio.insecure_channel(record.address) as channel:
                dump = await worker_pb2_grpc.WorkerStub(channel).DumpKvState(
                    worker_pb2.DumpKvStateRequest(dp_rank=0, tier=POOLED_TIER)
                )
            expected = (len(dump.blocks), block_set_digest(b.sequence_hash for b in dump.blocks))
            if held.get(record.instance_id, (0, block_set_digest([]))) != expected:
                return False
        return True
    except grpc.aio.AioRpcError:
        return False


async def test_lost_pool_segment_events_are_recovered_from_the_segment_dump(nats_url: str, nc: NatsClient):
    LossyPublisher.lost = 0
    indexers = await watcher(nc, "indexer")
    pool = Path(tempfile.mkdtemp(prefix="kvmesh-pool-test-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        async with (
            two_workers(nats_url, nc, LossyPublisher, "--kv-pool", str(pool), "--kv-pool-blocks", "64") as workers,
            running(indexer_server.serve, indexer_config(nats_url, "p")),
        ):
            await wait_until_async(lambda: len(indexers.instances()) == 1, what="replica registered")
            await load(workers, requests=120)
            address = indexers.instances()[0].address
            await wait_until_async(lambda: converged(workers, address), timeout=20, what="device blocks converge")
            await wait_until_async(lambda: pool_converged(workers, address), timeout=20, what="pool segments converge")
            status = await view(address)
            segments = [w for w in status.workers if w.tier == POOLED_TIER]
            assert LossyPublisher.lost >= 4  # each worker's device and pool publishers lost messages
            assert status.recoveries >= 4 and not any(w.recovering for w in status.workers)
            assert len(segments) == 2 and all(w.tier == "pooled" and w.blocks > 0 for w in segments)
            assert sum(w.evicted_blocks for w in segments) > 0  # 64-block segments under this load evict
    finally:
        shutil.rmtree(pool, ignore_errors=True)
    await indexers.stop()
