"""Two meshes (namespaces) on one NATS server: each one's indexer replicas apply its events whatever
else the shared stream holds and whichever mesh started first; snapshots and purges stay within
their namespace; a new replica of either converges exactly. Real NATS, real workers, real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import grpc
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.kv_event_stream import ensure_kv_events_stream
from kvmesh.common.wire import names
from kvmesh.common.wire.kv_events import BlocksStored, KvEvent, KvEventBatch, StoredBlock, encode_batch
from kvmesh.devtools.index_truth import converged, difference, view
from kvmesh.indexer import purge
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer import snapshot as snapshots
from kvmesh.indexer.config import IndexerConfig
from kvmesh.indexer.consumer import EventStreamConsumer
from kvmesh.indexer.metrics import IndexerState
from kvmesh.indexer.snapshot_lock import SnapshotLock
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import running, service_config, stored_under_lock, wait_until_async

pytestmark = pytest.mark.integration
# small caches: the load evicts, so the stream carries removals too
WORKER_ARGS = ["--speedup-ratio", "100", "--block-size", "16", "--num-gpu-blocks-override", "48", "--lease-ttl", "2"]


def indexer_config(nats_url: str, namespace: str, replica: str) -> IndexerConfig:
    """A replica that snapshots and purges often (10 events), with the default-looking replica id
    both meshes would use."""
    return service_config(
        IndexerConfig,
        [
            *("--nats-url", nats_url, "--namespace", namespace, "--replica-id", replica, "--lease-ttl", "2"),
            *("--router-snapshot-threshold", "10", "--snapshot-check-interval", "0.2"),
        ],
    )


@contextlib.asynccontextmanager
async def mesh(nats_url: str, nc: NatsClient, namespace: str) -> AsyncIterator[tuple[DiscoveryWatcher, str]]:
    """Two workers and one indexer replica (id ``0``) in ``namespace``; yields the workers' watcher
    and the replica's address."""
    js = nc.jetstream()
    workers = DiscoveryWatcher(js, namespace, "worker")
    indexers = DiscoveryWatcher(js, namespace, "indexer")
    await workers.start()
    await indexers.start()
    config = service_config(WorkerConfig, ["--nats-url", nats_url, "--namespace", namespace, *WORKER_ARGS])
    stops = [asyncio.Event(), asyncio.Event()]
    tasks = [asyncio.create_task(worker_server.serve(config, stop)) for stop in stops]
    try:
        async with running(indexer_server.serve, indexer_config(nats_url, namespace, "0")):
            await wait_until_async(lambda: len(workers.instances()) == 2, what=f"{namespace}: two workers")
            await wait_until_async(lambda: len(indexers.instances()) == 1, what=f"{namespace}: indexer registered")
            yield workers, indexers.instances()[0].address
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)
        await workers.stop()
        await indexers.stop()


async def load(workers: DiscoveryWatcher, requests: int, seed: int) -> None:
    """Requests with shared prefixes straight to the workers."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(48)] for _ in range(4)]
    for i in range(requests):
        record = rng.choice(workers.instances())
        request = common_pb2.PreprocessedRequest(
            request_id=f"ns-{seed}-{i}", token_ids=rng.choice(prefixes) + [rng.randrange(256) for _ in range(20)]
        )
        request.stop.max_tokens = 3
        async with grpc.aio.insecure_channel(record.address) as channel:
            async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=30):
                pass


async def holds_exactly(workers: DiscoveryWatcher, address: str, namespace: str) -> None:
    async def exact() -> bool:
        return await converged(workers, address)

    try:
        await wait_until_async(exact, timeout=20, what=f"{namespace}: replica holds what its workers hold")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {await difference(workers, address)}") from None


async def snapshotted_and_purged(nc: NatsClient, namespace: str) -> bool:
    js = nc.jetstream()
    probe = SnapshotLock(js, namespace, "probe")
    stored = await stored_under_lock(js, probe, namespace)
    await probe.release()
    return stored is not None and stored.stream_sequence > 0


@pytest.mark.parametrize("first", ["a", "b"])
async def test_two_meshes_on_one_nats_each_index_exactly_their_own(nats_url: str, nc: NatsClient, first: str):
    second = "b" if first == "a" else "a"
    async with mesh(nats_url, nc, f"ns{first}") as (first_workers, first_indexer):
        await load(first_workers, 40, seed=1)
        async with mesh(nats_url, nc, f"ns{second}") as (second_workers, second_indexer):
            await asyncio.gather(load(first_workers, 40, seed=2), load(second_workers, 60, seed=3))
            meshes = {f"ns{first}": (first_workers, first_indexer), f"ns{second}": (second_workers, second_indexer)}
            for namespace, (workers, address) in meshes.items():
                await holds_exactly(workers, address, namespace)
                await wait_until_async(
                    lambda n=namespace: snapshotted_and_purged(nc, n), timeout=20, what=f"{namespace}: snapshot"
                )
                # the lag counts this namespace's events only, though the stream's sequence runs ahead
                await wait_until_async(lambda a=address: _no_lag(a), timeout=10, what=f"{namespace}: lag reaches 0")
            # more events in both after the purges; then a new replica of each restores and converges
            await asyncio.gather(load(first_workers, 20, seed=4), load(second_workers, 20, seed=5))
            for namespace, (workers, _address) in meshes.items():
                async with running(indexer_server.serve, indexer_config(nats_url, namespace, "fresh")):
                    fresh = DiscoveryWatcher(nc.jetstream(), namespace, "indexer")
                    await fresh.start()
                    try:
                        await wait_until_async(lambda w=fresh: len(w.instances()) == 2, what=f"{namespace}: fresh")
                        record = next(r for r in fresh.instances() if r.extra["replica_id"] == "fresh")
                        assert (await view(record.address)).snapshot_sequence > 0  # restored, not replayed
                        await holds_exactly(workers, record.address, f"{namespace} (fresh replica)")
                        assert (await view(record.address)).gaps == 0
                    finally:
                        await fresh.stop()


async def _no_lag(address: str) -> bool:
    status = await view(address)
    return status.lag_messages == 0 and status.stream_last_sequence > 0


async def _publish(nc: NatsClient, namespace: str, worker_id: int, count: int, first: int = 0) -> None:
    """``count`` events of one stored block each, numbered from ``first``."""
    js = nc.jetstream()
    for i in range(first, first + count):
        block = StoredBlock(worker_id * 100_000 + i + 1, worker_id * 100_000 + i + 1, 16)
        batch = KvEventBatch(worker_id, 0, 0.0, (KvEvent(i, BlocksStored(None, (block,))),))
        await js.publish(names.kv_events_subject(namespace, worker_id), encode_batch(batch))


async def _held(nc: NatsClient, namespace: str) -> int:
    info = await nc.jetstream().stream_info(names.KV_EVENTS_STREAM, subjects_filter=names.kv_events_wildcard(namespace))
    return sum((info.state.subjects or {}).values())


async def test_another_namespaces_events_neither_trigger_a_snapshot_nor_are_purged(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    await _publish(nc, "busy", 1, 30)  # another mesh, busy, with no replica reading yet
    await _publish(nc, "quiet", 2, 5)
    index, state = PrefixIndex(), IndexerState()
    consumer = EventStreamConsumer(nc, "quiet", "0", index)
    await consumer.start()
    try:
        await wait_until_async(lambda: index.stats.events_applied == 5, what="quiet replica applies its 5 events")
        snapshotter = snapshots.Snapshotter(
            nc, "quiet", "t", index, lambda: consumer.applied_sequence, state, threshold=10, durable=consumer.durable
        )
        assert not await snapshotter.check()  # 35 messages in the stream, 5 of them quiet's
        assert state.namespace_messages == 5 and state.lag_messages == 0
        await _publish(nc, "quiet", 2, 10, first=5)
        await wait_until_async(lambda: index.stats.events_applied == 15, what="quiet replica applies 15")

        async def acked() -> bool:
            info = await js.consumer_info(names.KV_EVENTS_STREAM, consumer.durable)
            return info.ack_floor.stream_seq == consumer.applied_sequence

        await wait_until_async(acked, what="acks reach the server")
        assert await snapshotter.check()
        assert await _held(nc, "quiet") < 15  # quiet's covered events purged
        assert await _held(nc, "busy") == 30  # busy's all kept
    finally:
        await consumer.stop()


async def test_a_durable_named_before_namespaces_is_dropped_only_by_its_own_namespace(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    for replica, namespace in (("legacy-a", "nsa"), ("legacy-b", "nsb")):
        config = ConsumerConfig(
            durable_name=names.legacy_indexer_durable_name(replica),
            filter_subject=names.kv_events_wildcard(namespace),
        )
        await js.add_consumer(names.KV_EVENTS_STREAM, config)
    consumers = [EventStreamConsumer(nc, "nsa", replica, PrefixIndex()) for replica in ("legacy-a", "legacy-b")]
    for consumer in consumers:
        await consumer.start()
    try:
        durables = {info.name for info in await js.consumers_info(names.KV_EVENTS_STREAM)}
        assert names.legacy_indexer_durable_name("legacy-a") not in durables  # nsa's own: migrated
        assert names.legacy_indexer_durable_name("legacy-b") in durables  # nsb's: not nsa's to drop
        assert {
            names.indexer_durable_name("nsa", "legacy-a"),
            names.indexer_durable_name("nsa", "legacy-b"),
        } <= durables
    finally:
        for consumer in consumers:
            await consumer.stop()


async def test_a_restoring_replica_waits_for_its_own_durable_to_be_listed(nc: NatsClient):
    """A restored replica holds the snapshot lock until its durable is in the list purges read: the
    wait ends when it is listed, and gives up at its bound for a durable of another namespace."""
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    consumer = EventStreamConsumer(nc, "listed", "r", PrefixIndex())
    await consumer.start()
    try:
        assert await purge.wait_listed(nc, "listed", consumer.durable, timeout_s=30)
        other = ConsumerConfig(
            durable_name=names.indexer_durable_name("elsewhere", "r"),
            filter_subject=names.kv_events_wildcard("elsewhere"),
        )
        await js.add_consumer(names.KV_EVENTS_STREAM, other)
        # listed by the server, but it follows another namespace, so no purge of this one waits on it
        assert not await purge.wait_listed(nc, "listed", other.durable_name, timeout_s=0.5)
    finally:
        await consumer.stop()


async def test_a_replica_gone_longer_than_the_inactive_threshold_leaves_no_durable(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    consumer = EventStreamConsumer(nc, "scaled", "gone", PrefixIndex(), inactive_threshold_s=1.0)
    await consumer.start()
    info = await js.consumer_info(names.KV_EVENTS_STREAM, consumer.durable)
    assert info.config.inactive_threshold == 1.0
    await consumer.stop()

    async def removed() -> bool:
        return consumer.durable not in {c.name for c in await js.consumers_info(names.KV_EVENTS_STREAM)}

    await wait_until_async(removed, timeout=20, what="the server removes the idle durable")


async def test_a_changed_inactive_threshold_is_set_on_the_durable_in_place(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    await _publish(nc, "edited", 3, 4)
    first = EventStreamConsumer(nc, "edited", "r", PrefixIndex(), inactive_threshold_s=3600.0)
    await first.start()
    await wait_until_async(lambda: first.applied_sequence == 4, what="the first replica applies 4 events")
    await first.stop()
    created = (await js.consumer_info(names.KV_EVENTS_STREAM, first.durable)).created
    index = PrefixIndex()
    again = EventStreamConsumer(nc, "edited", "r", index, inactive_threshold_s=120.0)
    await again.start()
    try:
        info = await js.consumer_info(names.KV_EVENTS_STREAM, again.durable)
        assert info.config.inactive_threshold == 120.0
        assert info.created == created  # edited, not remade: the durable keeps its position
        await _publish(nc, "edited", 3, 2, first=4)
        await wait_until_async(lambda: again.applied_sequence == 6, what="it follows on from the durable")
        assert index.stats.duplicates_skipped == 0
    finally:
        await again.stop()
